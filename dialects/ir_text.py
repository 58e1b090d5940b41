"""Reading IR text: `parse_ir` is the one entry point for every reader of `.mlir` text (the
`toptpu-opt` driver, the model file's IR sections, the machine's net templates, text read back
from MLIR), so every reader gets the same guards and the same diagnostics.

A user's IR file is untrusted input. What xDSL (pinned: xdsl==0.75.0) does with text that is
not IR, and what `parse_ir` does instead:

- **String literals that do not close** (`"abc` then the end of the line or file, or an
  invalid escape such as `\\q`): xDSL's `MLIRLexer._lex_string_literal` matches the literal
  with `"(?:[^"\\\\\\n\\v\\f]+|\\\\(?:["nt\\\\]|[0-9A-Fa-f]{2}))*"`. The `+` inside the `*`
  lets `re` split a run of n plain characters in 2^(n-1) ways, and when no closing quote
  follows it tries them all before it fails: 30 characters take seconds, the 55 of one
  location in a dumped layer take longer than anyone waits
  (`docs/upstream/xdsl-string-literal-backtracking.md`). The guard below checks each literal
  with the same grammar written without the nested quantifier (linear time) before xDSL's
  lexer sees it, and reports the first character that ends it (line:column, what, what to
  do). xDSL's own regex then runs only on literals that close, where it is linear. The guard
  is installed once, into `MLIRLexer`, and only over the exact 0.75.0 pattern; the tests fail
  if the pattern changes or the blow-up comes back.
- **Strings with non-ASCII characters do not survive a print and parse**: xDSL's printer
  writes every byte outside printable ASCII as an escape (`"é"` prints as `"\\C3\\A9"`), and its
  lexer makes a literal whose escapes give non-ASCII bytes a bytes literal (its docstring says
  "STRING_LIT when the payload can be decoded as UTF-8"; the code checks `isascii()`). So a
  location with such a file path (`loc("/home/josé/x.py":3:0)`: "Unexpected location
  syntax"), or an op's name attribute, printed by toptpu cannot be read back, and a module
  attribute silently turns into a BytesAttr. The guard makes such a literal a string when its
  bytes are UTF-8, as the docstring says; other byte strings stay bytes literals.
- **Integer types wider than MLIR's 2^24-1 bits** (`i2147483648`, from a digit typed into
  `i32`): xDSL builds the type and computes its value range `1 << width` (256 MB and seconds
  for 2^31 bits, more than the memory for 2^34). Refused at the token, before xDSL builds it.
- **Bytes that are not UTF-8** (`Parser` decodes strictly: a `UnicodeDecodeError` traceback),
  NUL bytes (binary files), an empty file (xDSL: "Could not parse entire input!" at 1:1): an
  `IRTextError` naming the file.
- **Other exceptions of the parser** on odd text (`VerifyException` from attribute
  constructors, as `300 : i8`; `RecursionError` from brackets nested a few hundred deep;
  `MemoryError` from a splat `dense<1.0> : tensor<1000000000000xf32>`, which xDSL
  materializes; any other crash): a `ParseError` at the token being parsed, naming it.
- **A value used before the op that defines it** (an op moved above its operands): xDSL parses
  forward references and its verifier does not check dominance; `verify_ir` does, in the
  blocks of SSA regions (every region but a module's body).
- **Verifier errors without a place** (xDSL's message names the op kind only, e.g. "attribute
  'axis' expected in operation 'top.softmax'"): `parse_ir` remembers where each op starts and
  reports the failing op at its file:line:column, like a parse error.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, BlockArgument, Operation, OpResult, SSAValue, TypeAttribute
from xdsl.parser import AttrParser, Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException
from xdsl.utils.lexer import Input, Span
from xdsl.utils.mlir_lexer import MLIRLexer, MLIRToken, MLIRTokenKind, StringLiteral

from toptpu.dialects import context, plugin_ops
from toptpu.errors import ToptpuError


class IRTextError(ToptpuError, ValueError):
    """The text is not IR at all (empty, not UTF-8, binary); the message names the file."""


# -- the string-literal guard -------------------------------------------------------------------

#: xDSL 0.75.0's pattern for a whole string literal (exponential when the literal does not close)
XDSL_STRING_PATTERN = r'"(?:[^"\\\n\v\f]+|\\(?:["nt\\]|[0-9A-Fa-f]{2}))*"'

#: the same grammar, one character or escape per step and possessive: the opening quote and the
#: longest run of legal content; the character after the match says how the literal ends
_STRING_PREFIX = re.compile(r'"(?:[^"\\\n\v\f]|\\(?:["nt\\]|[0-9A-Fa-f]{2}))*+')

_HEX_DIGITS = set("0123456789abcdefABCDEF")
_CONTROL_NAMES = {"\v": "vertical tab (\\0B)", "\f": "form feed (\\0C)"}


def check_string_literal(source: Input[str], start: int) -> None:
    """Raise a ParseError unless the string literal opening at `start` closes legally.
    Linear in the literal's length."""
    opening = _STRING_PREFIX.match(source.content, start)
    assert opening is not None, "check_string_literal called where no literal opens"
    end = opening.end()
    char = source.at(end)
    if char == '"':
        return
    if char is None:
        raise ParseError(Span(start, end, source),
                         "string literal not closed: the file ends first; add the closing '\"'")
    if char == "\n":
        raise ParseError(Span(start, end, source),
                         "string literal not closed before the end of the line; add the "
                         "closing '\"' (a line break inside a string is written \\n)")
    if char in _CONTROL_NAMES:
        raise ParseError(Span(end, end + 1, source),
                         f"a {_CONTROL_NAMES[char]} inside a string literal; write it as an "
                         "escape")
    escape = source.content[end:end + 2]  # a backslash and what follows
    if escape[1:] in _HEX_DIGITS:
        escape = source.content[end:end + 3]
    escape = escape.split("\n")[0]
    raise ParseError(Span(end, end + len(escape), source),
                     f"invalid escape '{escape}' in a string literal; the escapes are \\n, \\t, "
                     "\\\\, \\\" and two hex digits (\\0A)")


def _is_utf8(literal: Span[str]) -> bool:
    try:
        StringLiteral.from_span(literal).bytes_contents.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _install_string_literal_guard() -> bool:
    """Put `check_string_literal` in front of xDSL 0.75.0's string lexer, and let a literal
    whose escapes spell UTF-8 text be a string (once). Returns whether the guard is in place:
    not over a lexer whose pattern is not the one known."""
    original = MLIRLexer._lex_string_literal
    if getattr(original, "toptpu_guard", False):
        return True
    if MLIRLexer._unescaped_characters_regex.pattern != XDSL_STRING_PATTERN:
        return False

    def guarded(self: MLIRLexer, start_pos: int) -> MLIRToken:
        if isinstance(self.input.content, str):
            check_string_literal(self.input, start_pos)
        token = original(self, start_pos)
        if token.kind == MLIRTokenKind.BYTES_LIT and _is_utf8(token.span):
            return MLIRToken(MLIRTokenKind.STRING_LIT, token.span)
        return token

    guarded.toptpu_guard = True  # type: ignore[attr-defined]  # a marker on the function
    guarded.__doc__ = original.__doc__
    MLIRLexer._lex_string_literal = guarded  # type: ignore[method-assign]  # guarded in place
    return True


#: MLIR's widest integer type (IntegerType::kMaxWidth); xDSL has no limit and computes the
#: value range 2**width of a type when it builds one (i2147483648: 256 MB and seconds)
MAX_INTEGER_WIDTH = (1 << 24) - 1
XDSL_INTEGER_TYPE_PATTERN = r"^[su]?i(\d+)$"


def _install_integer_width_guard() -> bool:
    """Refuse an integer type wider than MLIR allows before xDSL builds it (once); only over
    xDSL 0.75.0's integer-type parsing."""
    original = AttrParser._parse_optional_integer_or_float_type
    if getattr(original, "toptpu_guard", False):
        return True
    pattern = AttrParser._builtin_integer_type_regex
    if pattern.pattern != XDSL_INTEGER_TYPE_PATTERN:
        return False

    def guarded(self: AttrParser) -> TypeAttribute | None:
        token = self._current_token  # noqa: SLF001 - pinned xdsl 0.75.0
        if token.kind == MLIRTokenKind.BARE_IDENT and (m := pattern.match(token.text)):
            if len(m.group(1).lstrip("0")) > 8 or int(m.group(1)) > MAX_INTEGER_WIDTH:
                self.raise_error(f"integer type {token.text} is wider than MLIR's limit of "
                                 f"{MAX_INTEGER_WIDTH} bits", token.span)
        return original(self)

    guarded.toptpu_guard = True  # type: ignore[attr-defined]  # a marker on the function
    guarded.__doc__ = original.__doc__
    # the ignore below: guarded in place
    AttrParser._parse_optional_integer_or_float_type = guarded  # type: ignore[method-assign]
    return True


#: whether xDSL 0.75.0's parser is guarded (tests assert it: False means xDSL changed)
GUARDS_INSTALLED = _install_string_literal_guard() & _install_integer_width_guard()


# -- whole-file checks --------------------------------------------------------------------------

def _line_col(data: bytes | str, offset: int) -> tuple[int, int]:
    if isinstance(data, bytes):
        line, start = data.count(b"\n", 0, offset) + 1, data.rfind(b"\n", 0, offset) + 1
    else:
        line, start = data.count("\n", 0, offset) + 1, data.rfind("\n", 0, offset) + 1
    return line, offset - start + 1


#: the first character of a line that is neither blank nor a comment
_CONTENT = re.compile(r"^[^\S\n]*+(?!//)\S", re.MULTILINE)


def decode_ir(data: bytes | str, name: str) -> str:
    """`data` as IR text, or an IRTextError naming the file: empty, not UTF-8, binary."""
    if len(data) == 0:
        raise IRTextError(f"{name} is empty: an IR file holds at least one operation")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line, col = _line_col(data, e.start)
            raise IRTextError(f"{name}:{line}:{col}: not UTF-8 text (byte 0x{data[e.start]:02X}"
                              f"); IR files are UTF-8 text — is this a binary file?") from None
    else:
        text = data
    nul = text.find("\0")
    if nul >= 0:
        line, col = _line_col(text, nul)
        raise IRTextError(f"{name}:{line}:{col}: a NUL byte: this is a binary file, not IR text")
    if _CONTENT.search(text) is None:
        raise IRTextError(f"{name} holds no operation, only whitespace and comments")
    return text


# -- parsing ------------------------------------------------------------------------------------

#: where each op of a parsed text starts (its first token), for verifier errors
OpStarts = Mapping[Operation, Span[str]]


class IRVerifyError(ToptpuError, VerifyException):
    """IR that parses but does not verify; with the op's place in the text when it was read
    from text (`location`: name:line:col, or the op; `reason`: what is wrong)."""

    def __init__(self, text: str, location: str = "", reason: str = "",
                 line: int | None = None) -> None:
        super().__init__(text)
        self.location, self.reason = location, reason or text
        #: the op's line in the text (1-based), when it was read from text
        self.line = line


def one_line(e: BaseException) -> str:
    """A parse or verify error of `parse_ir` as one line: where (name:line:col) and what is
    wrong, without the quoted line and its carets (`str(e)` keeps them)."""
    if isinstance(e, ParseError):
        where, reason = str(e.span.get_location()), e.msg
    elif isinstance(e, IRVerifyError):
        where, reason = e.location, e.reason
    else:
        where, reason = "", str(e)
    reason = " ".join(reason.split())
    return f"{where}: {reason}" if where else reason


#: a ranked tensor type of static shape, as the printer writes every value's type
_TENSOR_TYPE = re.compile(r"tensor<(?:[0-9]+x)*[a-z][a-z0-9]*>")
#: such types parsed, by their text: a type is an immutable value the ops of every parse
#: may share; parsing a net's IR is ~40% its types (`tensor<1x16x896xbf16>`, again and
#: again), which the runtime does on a request's first use of a net
_TENSOR_TYPES: dict[str, TypeAttribute] = {}
TENSOR_TYPES_KEPT = 4096


class _LocatingParser(Parser):
    """xDSL's parser, remembering where each op starts; a tensor type it has read before
    (the same text) is taken as read then (`_TENSOR_TYPES`)."""

    def __init__(self, ctx: Context, text: str, name: str) -> None:
        self.op_starts: dict[Operation, Span[str]] = {}
        super().__init__(ctx, text, name)

    def parse_optional_type(self) -> TypeAttribute | None:
        tok = self._current_token  # noqa: SLF001 - pinned xdsl 0.75.0
        if tok.kind != MLIRTokenKind.BARE_IDENT or tok.text != "tensor":
            return super().parse_optional_type()
        text = tok.span.input.content
        m = _TENSOR_TYPE.match(text, tok.span.start)
        if m is None:
            return super().parse_optional_type()
        hit = _TENSOR_TYPES.get(m.group(0))
        if hit is not None:
            self._resume_from(m.end())  # noqa: SLF001 - pinned xdsl 0.75.0
            return hit
        got = super().parse_optional_type()
        after = self._current_token.span.start  # noqa: SLF001 - pinned xdsl 0.75.0
        if (got is not None and len(_TENSOR_TYPES) < TENSOR_TYPES_KEPT
                and not text[m.end():after].strip()):  # it read just that text
            _TENSOR_TYPES[m.group(0)] = got
        return got

    def parse_operation(self) -> Operation:
        start = self._current_token.span  # noqa: SLF001 - pinned xdsl 0.75.0
        op = super().parse_operation()
        self.op_starts[op] = start
        return op


def _error_here(parser: Parser, msg: str) -> ParseError:
    return ParseError(parser._current_token.span, msg)  # noqa: SLF001 - pinned xdsl 0.75.0


def parse_ir(data: bytes | str, name: str, ctx: Context | None = None, *,
             implicit_module: bool = True, verify: bool = True) -> ModuleOp:
    """Parse IR text (`data`, from `name`) into a module and, with `verify`, verify it
    (`verify_ir`). Raises IRTextError for text that is not IR, ParseError (name:line:col,
    the line, what is wrong) for text that does not parse, IRVerifyError (the same, at the op)
    for IR that does not verify. A verifier that crashes is not caught: that is a bug."""
    module, op_starts = _parse(decode_ir(data, name), name, ctx, implicit_module)
    if verify:
        verify_ir(module, op_starts)
    return module


#: xDSL's parse error for an op name no dialect of the context holds
_UNREGISTERED_OP = re.compile(r"Operation ((?:top|tpu)\.\w+) is not registered")


def _parse(text: str, name: str, ctx: Context | None,
           implicit_module: bool) -> tuple[ModuleOp, OpStarts]:
    ctx = ctx if ctx is not None else context()
    try:
        return _parse_once(text, name, ctx, implicit_module)
    except ParseError as e:
        if not _load_plugin_op(ctx, str(e)):
            raise
    return _parse_once(text, name, ctx, implicit_module)


def _load_plugin_op(ctx: Context, error: str) -> bool:
    """For a parse error at an unregistered `top.`/`tpu.` op: the installed plugins' ops
    loaded (`plugin_ops.load_installed`) and, when one of them is that op, every plugin op
    put in `ctx`; whether it was (then the text parses again)."""
    found = _UNREGISTERED_OP.search(error)
    if found is None:
        return False
    if plugin_ops.plugin_op(found.group(1)) is None:
        plugin_ops.load_installed()
        if plugin_ops.plugin_op(found.group(1)) is None:
            return False
    for entry in plugin_ops.registered():
        for op in (entry.top, entry.tpu):
            if ctx.get_optional_op(op.name) is None:
                ctx.load_op(op)
    return True


def _parse_once(text: str, name: str, ctx: Context,
                implicit_module: bool) -> tuple[ModuleOp, OpStarts]:
    parser = _LocatingParser(ctx, text, name)
    try:
        return parser.parse_module(implicit_module), parser.op_starts
    except ParseError:
        raise
    except RecursionError:
        raise _error_here(parser, "nesting too deep for xDSL's parser (brackets or regions "
                                  "inside each other: is one not closed?)") from None
    except DiagnosticException as e:  # attribute constructors verify their parameters
        raise _error_here(parser, f"invalid here: {e}") from None
    except Exception as e:  # noqa: BLE001 - xDSL's parser crashes on some odd text
        raise _error_here(parser, f"cannot parse here (xDSL's parser raised "
                                  f"{type(e).__name__}: {e})") from e


# -- verification -------------------------------------------------------------------------------

def verify_ir(module: ModuleOp, op_starts: OpStarts | None = None) -> None:
    """xDSL's verifier, then every operand defined before its use (`check_defined_before_use`);
    an IRVerifyError names the op, and where it starts in the text when `op_starts` knows."""
    try:
        module.verify()
    except DiagnosticException as e:
        op, error = _first_failing_op(module) or (None, e)
        raise _verify_error(op, str(error), op_starts) from None
    index: dict[Block, dict[Operation, int]] = {}

    def position(op: Operation) -> int:  # an op's index in its block, each block counted once
        block = op.parent_block()
        assert block is not None
        if block not in index:
            index[block] = {o: i for i, o in enumerate(block.ops)}
        return index[block][op]

    for op in module.walk():
        for value in op.operands:
            if (problem := _use_problem(op, value, position, op_starts)) is not None:
                raise _verify_error(op, problem, op_starts)


def _first_failing_op(module: ModuleOp) -> tuple[Operation, DiagnosticException] | None:
    """The first op (in walk order) whose own verifier fails, with its error."""
    for op in module.walk():
        try:
            op.verify(verify_nested_ops=False)
        except DiagnosticException as e:
            return op, e
    return None


def _verify_error(op: Operation | None, msg: str, op_starts: OpStarts | None) -> IRVerifyError:
    names = "" if op is None else ", ".join(f"%{r.name_hint}" for r in op.results
                                            if r.name_hint)
    at = "" if op is None else f"'{op.name}'{f' ({names})' if names else ''}"
    if op is not None and op_starts is not None and op in op_starts:
        span, reason = op_starts[op], msg.removeprefix(f"'{op.name}': ")
        return IRVerifyError(span.print_with_context(msg).rstrip(),
                             f"{span.get_location()}: {at}", reason, span.get_location().line)
    if op is not None:
        return IRVerifyError(f"{at}: {msg}", at, msg.removeprefix(f"'{op.name}': "))
    return IRVerifyError(msg)


def _value_name(value: SSAValue, op_starts: OpStarts | None) -> str:
    """`%name` as in the text (xDSL keeps no numeric names: the defining op's first token)."""
    if value.name_hint:
        return f"%{value.name_hint}"
    owner = value.owner
    if op_starts is not None and isinstance(value, OpResult) and isinstance(owner, Operation) \
            and owner in op_starts:
        token = op_starts[owner].text
        if token.startswith("%"):
            return token if len(owner.results) == 1 else f"{token}#{value.index}"
    return "a value"


def _use_problem(op: Operation, value: SSAValue, position: Callable[[Operation], int],
                 op_starts: OpStarts | None) -> str | None:
    """Why `op` may not use `value`, or None. A module's body is a graph region (order free);
    elsewhere a value is used in its own block after its definition, or in blocks nested in it
    (uses from another block of a multi-block region are not checked: that is CFG dominance)."""
    name = _value_name(value, op_starts)
    def_block: Block | None
    def_op: Operation | None
    if isinstance(value, BlockArgument):
        def_block, def_op = value.block, None
    else:
        owner = value.owner
        assert isinstance(owner, Operation)
        def_op, def_block = owner, owner.parent_block()
    if def_block is None:
        return f"uses {name}, which is not in the IR"
    if isinstance(def_block.parent_op(), ModuleOp):
        return None
    user: Operation | None = op
    while user is not None:
        block = user.parent_block()
        if block is def_block:
            if def_op is None or position(def_op) < position(user):
                return None
            if def_op is user:
                return f"uses its own result {name}"
            line = (f" at line {op_starts[def_op].get_location().line}"
                    if op_starts is not None and def_op in op_starts else "")
            return (f"uses {name} before the op that defines it ('{def_op.name}'{line}); an op "
                    "must come after the ops whose results it uses")
        if block is not None and block.parent is def_block.parent:
            return None  # another block of the same region: CFG dominance, not checked here
        user = user.parent_op()
    return f"uses {name} outside the region that defines it"


# -- printing -----------------------------------------------------------------------------------


def print_generic(module: ModuleOp, debuginfo: bool = True) -> str:
    """The module in MLIR's generic form (what real MLIR parses; `loc(...)` kept), each op's
    attributes in the order of their names: the same IR prints the same bytes however it
    was made (built by passes, or parsed from a custom form, whose parser adds
    `operandSegmentSizes` last). The attribute dictionaries are reordered in place."""
    for op in module.walk():
        names = list(op.attributes)
        if names != sorted(names):
            op.attributes = dict(sorted(op.attributes.items()))
    out = io.StringIO()
    Printer(stream=out, print_generic_format=True, print_debuginfo=debuginfo).print_op(module)
    return out.getvalue()
