"""Mutated IR through `toptpu-opt FILE -p top-pipeline` (and down to the chip with
`tpu-pipeline`): a diagnostic or a valid result, never a traceback, never a hang.

The IR is a real one: a tiny Qwen2 decoder layer imported into Top and printed as `toptpu
compile --dump-ir` prints it (custom form, with locations), its weights saved beside it. Each
example mutates it (truncation, holes, inserted characters, type and shape edits, number and
string edits, op names swapped, attributes dropped, operands swapped, an op moved above its
operands, lines duplicated, dropped or swapped) and runs the driver in-process. A hang is
caught by an alarm (the real protection is the guards in `toptpu.dialects.ir_text`, tested
below against xDSL 0.75.0's blow-ups). Also here: files that are not IR, paths that are not
files, `-o`, and the defects the fuzzer found (each with its own test).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from xdsl.context import Context
from xdsl.dialects.builtin import StringAttr
from xdsl.parser import Parser
from xdsl.utils.exceptions import ParseError
from xdsl.utils.lexer import Input

from helpers import decoder_layer_ir
from toptpu import opt
from toptpu.compiler import print_ir
from toptpu.dialects.ir_text import (
    GUARDS_INSTALLED,
    XDSL_STRING_PATTERN,
    IRVerifyError,
    check_string_literal,
    parse_ir,
)
from toptpu.dialects.top import Top
from toptpu.dialects.weight_store import STORE_ATTR

#: per example: far above the ~0.1-1 s an example takes, far below a hang
HANG_SECONDS = 30.0


class Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise Hung in the main thread after `seconds` (re's matcher checks signals too)."""
    def alarm(signum: int, frame: object) -> None:
        raise Hung(f"no answer after {seconds:.0f} s")

    try:
        old = signal.signal(signal.SIGALRM, alarm)
    except ValueError:  # not the main thread: measure only
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_opt(*argv: str) -> tuple[int, str, str, float]:
    """`toptpu-opt ARGV` in-process: exit status, stdout, stderr, seconds."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with deadline(HANG_SECONDS), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = opt.main(list(argv))
    return rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def check_answer(path: str, rc: int, out: str, err: str, seconds: float) -> None:
    """Exit 0 with IR that parses and verifies, or exit 1 with a diagnostic naming the file."""
    assert seconds < HANG_SECONDS, f"{seconds:.1f} s"
    assert "Traceback (most recent call last)" not in err, err[-3000:]
    assert rc in (0, 1), f"exit {rc}:\n{err[-3000:]}"
    if rc == 0:
        parse_ir(out, "the output")
    else:
        assert err.startswith("toptpu-opt: "), err[:500]
        assert os.path.basename(path) in err, err[:500]


# -- the real IR --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer_ir(tiny_models, tmp_path_factory) -> tuple[str, str]:
    """(directory, text): a qwen2 decoder layer as `--dump-ir` writes it after import."""
    d = str(tmp_path_factory.mktemp("ir_fuzz"))
    return d, decoder_layer_ir(tiny_models("qwen2"), d)


# -- mutations ----------------------------------------------------------------------------------

INSERTS = ['"', "'", "(", ")", "[", "]", "{", "}", "<", ">", "loc(", 'loc("', "%", "%0", "^bb1:",
           "#", "!", "@", ":", ",", "=", "->", "\\", "\\q", "\n", "\r", "\t", "\v", "x", "0",
           "-1", "0x", "1.5e999", "é", "∀", "\u2028", "\ufeff", "😀", "//", "{-#", "#-}", "...",
           "dense<", "tensor<", "array<i64:", "func.return", '"top.add"(', "builtin.module {"]

ELEMENT_TYPES = ["f16", "bf16", "f64", "i1", "i8", "i32", "i64", "index", "i0", "ui8",
                 "complex<f32>", "none", "f8E4M3FN", "!top.x", "tensor<2xf32>"]
NUMBERS = ["0", "1", "-1", "2", "3", "7", "999", "2147483648", "18446744073709551617",
           "100000000000000000000000000000000000000", "1.0", "-0.0", "1.0e400", "0x7FC00000",
           "?"]
STRINGS = ["", "mean", "max", "sum", "bogus", "layer.mlp.up_proj.weight", "rotary.inv_freq",
           "../../weights", "/", "/tmp", "\\00", "é"]
TOP_OPS = sorted(op.name for op in Top.operations)
TENSOR = re.compile(r"tensor<((?:[0-9?]+x)*)([^<>]+)>")
DIGITS = re.compile(r"\d+")
DEF_LINE = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)? = ")
VALUE = re.compile(r"%[\w.$-]+")
OP_NAME = re.compile(r'"top\.\w+"')
STRING = re.compile(r'(?:\{|, )[\w.]+ = "([^"\\\n]*)"')  # modes, weight names, the store
ATTRIBUTE = re.compile(r"(?:(?<=\{)|(?<=, ))\w+ = (?:array<[^>]*>|[^,{}<>]+)(?:, )?")


def _position(draw: st.DrawFn, text: str) -> int:
    return draw(st.integers(0, len(text)))


def _truncate(draw: st.DrawFn, text: str) -> str:
    return text[:draw(st.integers(1, len(text)))] if text else text


def _hole(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    return text[:i] + text[i + draw(st.integers(1, 400)):]


def _insert(draw: st.DrawFn, text: str) -> str:
    i = _position(draw, text)
    piece = draw(st.sampled_from(INSERTS) | st.text(min_size=1, max_size=4))
    return text[:i] + piece * draw(st.sampled_from([1, 1, 1, 2, 50])) + text[i:]


def _pick(draw: st.DrawFn, matches: list[re.Match[str]]) -> re.Match[str] | None:
    return draw(st.sampled_from(matches)) if matches else None


def _edit_type(draw: st.DrawFn, text: str) -> str:
    m = _pick(draw, list(TENSOR.finditer(text)))
    if m is None:
        return text
    dims = [d for d in m.group(1).split("x") if d]
    elem = m.group(2)
    kind = draw(st.sampled_from(["dim", "drop", "add", "element", "container"]))
    if kind == "dim" and dims:
        dims[draw(st.integers(0, len(dims) - 1))] = draw(st.sampled_from(NUMBERS))
    elif kind == "drop" and dims:
        dims.pop(draw(st.integers(0, len(dims) - 1)))
    elif kind == "add":
        dims.insert(draw(st.integers(0, len(dims))), draw(st.sampled_from(NUMBERS[:7])))
    elif kind == "element":
        elem = draw(st.sampled_from(ELEMENT_TYPES))
    container = draw(st.sampled_from(["vector", "memref"])) if kind == "container" else "tensor"
    new = f"{container}<{''.join(d + 'x' for d in dims)}{elem}>"
    return text[:m.start()] + new + text[m.end():]


def _edit_number(draw: st.DrawFn, text: str) -> str:
    m = _pick(draw, list(DIGITS.finditer(text)))
    if m is None:
        return text
    return text[:m.start()] + draw(st.sampled_from(NUMBERS)) + text[m.end():]


def _edit_string(draw: st.DrawFn, text: str) -> str:
    m = _pick(draw, list(STRING.finditer(text)))
    if m is None:
        return text
    return text[:m.start(1)] + draw(st.sampled_from(STRINGS)) + text[m.end(1):]


def _edit_op_name(draw: st.DrawFn, text: str) -> str:
    m = _pick(draw, list(OP_NAME.finditer(text)))
    if m is None:
        return text
    return text[:m.start()] + f'"{draw(st.sampled_from(TOP_OPS))}"' + text[m.end():]


def _drop_attribute(draw: st.DrawFn, text: str) -> str:
    m = _pick(draw, list(ATTRIBUTE.finditer(text)))
    return text if m is None else text[:m.start()] + text[m.end():]


def _value_types(lines: list[str]) -> dict[str, str]:
    """The type of each value of the printed layer: block arguments, one-result ops."""
    header = next((ln for ln in lines if "func.func" in ln), "")
    types = dict(re.findall(r"(%[\w.$-]+): (tensor<[^>]*>)", header))
    for ln in lines:
        if (m := DEF_LINE.match(ln)) and (t := re.search(r"-> (tensor<[^>]*>) loc\(", ln)):
            types[m.group(1)] = t.group(1)
    return types


def _swap_operand(draw: st.DrawFn, text: str) -> str:
    """Replace an operand, and its type in the op's signature, with another value defined above
    it: IR that parses, for the verifiers and the passes (a shape or element type mismatch)."""
    lines = text.split("\n")
    types = _value_types(lines)
    users = [i for i, ln in enumerate(lines) if DEF_LINE.match(ln) and "(%" in ln]
    if not users:
        return text
    k = draw(st.sampled_from(users))
    m = re.match(r'(.* = "[\w.]+"\()([^)]*)(\).* : \()([^)]*)(\) -> .*)', lines[k])
    defined = [v for ln in lines[:k] if (d := DEF_LINE.match(ln)) and (v := d.group(1)) in types]
    defined += [v for v in types if v not in defined and not any(
        (d := DEF_LINE.match(ln)) and d.group(1) == v for ln in lines)]
    if m is None or not defined:
        return text
    operands, signature = m.group(2).split(", "), m.group(4).split(", ")
    if len(operands) != len(signature):
        return text
    i = draw(st.integers(0, len(operands) - 1))
    operands[i] = draw(st.sampled_from(defined))
    signature[i] = types[operands[i]]
    lines[k] = (m.group(1) + ", ".join(operands) + m.group(3) + ", ".join(signature)
                + m.group(5))
    return "\n".join(lines)


def _move_op_above_operands(draw: st.DrawFn, text: str) -> str:
    lines = text.split("\n")
    users = [i for i, ln in enumerate(lines) if DEF_LINE.match(ln) and "(%" in ln]
    if not users:
        return text
    k = draw(st.sampled_from(users))
    operands = re.findall(r"%[\w.$-]+", lines[k].split(" = ", 1)[1])
    defs = {m.group(1): i for i, ln in enumerate(lines[:k]) if (m := DEF_LINE.match(ln))}
    targets = [defs[o] for o in operands if o in defs]
    if not targets:
        return text
    line = lines.pop(k)
    lines.insert(draw(st.sampled_from(targets)), line)
    return "\n".join(lines)


def _lines(draw: st.DrawFn, text: str) -> str:
    lines = text.split("\n")
    i = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["duplicate", "drop", "swap"]))
    if kind == "duplicate":
        lines.insert(draw(st.integers(0, len(lines))), lines[i])
    elif kind == "drop":
        lines.pop(i)
    else:
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


#: text-level mutations (mostly parse errors: the hunt for hangs) and IR-level ones (mostly
#: parse, to reach the verifiers and the passes), about half and half
MUTATIONS: list[Callable[[st.DrawFn, str], str]] = [
    _truncate, _hole, _insert, _insert, _lines,
    _edit_type, _edit_type, _edit_number, _edit_string, _edit_op_name, _drop_attribute,
    _swap_operand, _swap_operand, _move_op_above_operands]


@st.composite
def mutated(draw: st.DrawFn, text: str) -> str:
    for _ in range(draw(st.integers(1, 3))):
        text = draw(st.sampled_from(MUTATIONS))(draw, text)
    return text


# -- properties ---------------------------------------------------------------------------------

@pytest.mark.slow  # hypothesis over an exported layer
@fuzz_settings(60)
@given(data=st.data())
def test_mutated_ir_gets_a_diagnostic_or_a_valid_result(layer_ir, data) -> None:
    directory, text = layer_ir
    path = os.path.join(directory, "mutated.mlir")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(data.draw(mutated(text), label="ir"))
    check_answer(path, *run_opt(path, "-p", "top-pipeline"))


@pytest.mark.slow  # hypothesis over an exported layer
@fuzz_settings(15)
@given(data=st.data())
def test_mutated_ir_through_the_tpu_pipeline(layer_ir, data) -> None:
    """The same down to the chip (quantization, layer groups, local memory, addresses): fewer
    examples, each runs longer when it parses."""
    directory, text = layer_ir
    path = os.path.join(directory, "mutated_tpu.mlir")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(data.draw(mutated(text), label="ir"))
    weights = os.path.join(directory, "mutated_tpu.weights.safetensors")
    check_answer(path, *run_opt(path, "-p", "top-pipeline,tpu-pipeline{mode=w4f16}",
                                "--weights-out", weights))


@pytest.mark.slow  # exports a layer (layer_ir)
def test_a_weight_between_grouped_ops_moves_above_the_group(layer_ir, tmp_path) -> None:
    """Found by the fuzzer: a matmul without transpose_b gets a transposed weight just above
    it (weight-reorder); layer-group then put its group above that weight (use before
    definition, exit 0, output that did not parse back)."""
    _, text = layer_ir
    path = tmp_path / "layer.mlir"
    path.write_text(text.replace("{transpose_b = true}", "{}", 1))
    rc, out, err, seconds = run_opt(str(path), "-p", "top-pipeline,tpu-pipeline{mode=w4f16}",
                                    "--weights-out", str(tmp_path / "w.safetensors"))
    assert rc == 0, err
    check_answer(str(path), rc, out, err, seconds)
    assert ".t\"" in out and "tpu.group" in out


@pytest.mark.slow  # exports a layer (layer_ir)
def test_the_unmutated_layer_runs(layer_ir) -> None:
    directory, text = layer_ir
    path = os.path.join(directory, "layer.mlir")
    with open(path, "w") as f:
        f.write(text)
    rc, out, err, seconds = run_opt(path, "-p", "top-pipeline")
    assert rc == 0, err
    check_answer(path, rc, out, err, seconds)
    assert "top.attention" in out


# -- inputs that are not IR, outputs that cannot be written --------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"  \n// only a comment\n\n", "holds no operation, only whitespace and comments"),
    (b"builtin.module {\n} loc(\"caf\xe9\")\n", ":2:11: not UTF-8 text (byte 0xE9)"),
    (bytes(range(256)) * 4, ":2:118: not UTF-8 text (byte 0x80)"),
    (b"builtin.module {\0}", ":1:17: a NUL byte: this is a binary file"),
], ids=["empty", "comments", "latin-1", "bytes", "nul"])
def test_a_file_that_is_not_ir_is_named(tmp_path, content: bytes, message: str) -> None:
    path = tmp_path / "input.mlir"
    path.write_bytes(content)
    rc, _, err, seconds = run_opt(str(path), "-p", "top-pipeline")
    check_answer(str(path), rc, "", err, seconds)
    assert rc == 1 and f"{path}" in err and message in err, err


def test_random_bytes_are_named(tmp_path) -> None:
    path = tmp_path / "noise.mlir"
    path.write_bytes(os.urandom(4096))
    rc, _, err, seconds = run_opt(str(path))
    check_answer(str(path), rc, "", err, seconds)
    assert rc == 1 and str(path) in err, err


def test_paths_that_are_not_files(tmp_path) -> None:
    assert run_opt(str(tmp_path / "missing.mlir"))[:3:2] == (
        1, f"toptpu-opt: {tmp_path / 'missing.mlir'} does not exist\n")
    assert run_opt(str(tmp_path))[:3:2] == (
        1, f"toptpu-opt: {tmp_path} is a directory; give an IR file (.mlir)\n")


@pytest.mark.slow  # exports a layer (layer_ir)
def test_an_unknown_extension_is_read_with_f_mlir(layer_ir, tmp_path) -> None:
    _, text = layer_ir
    path = tmp_path / "layer.txt"
    path.write_text(text)
    rc, _, err, _ = run_opt(str(path))
    assert rc == 1 and "extension 'txt'; to read it as MLIR text, add -f mlir" in err
    rc, out, err, _ = run_opt(str(path), "-f", "mlir")
    assert rc == 0 and "top.matmul" in out, err


@pytest.mark.slow  # exports a layer (layer_ir)
def test_output_written_only_after_success(layer_ir, tmp_path) -> None:
    """`-o` onto the input itself: on success the result replaces it; on failure the input
    stays as it was (xDSL's opt main truncated it before parsing)."""
    _, text = layer_ir
    path = tmp_path / "layer.mlir"
    path.write_text(text[:-200])  # truncated: does not parse
    rc, _, err, _ = run_opt(str(path), "-p", "top-pipeline", "-o", str(path))
    assert rc == 1 and path.read_text() == text[:-200], err
    path.write_text(text)
    rc, _, err, _ = run_opt(str(path), "-p", "top-pipeline", "-o", str(path))
    assert rc == 0, err
    assert "top.attention" in path.read_text() and "top.rsqrt" not in path.read_text()
    assert sorted(os.listdir(tmp_path)) == ["layer.mlir"]
    rc, _, err, _ = run_opt(str(path), "-o", str(tmp_path))
    assert rc == 1 and "is a directory" in err


@pytest.mark.slow  # exports a layer (layer_ir)
@pytest.mark.parametrize("store", ["directory", "not_safetensors"])
def test_a_weight_store_that_is_not_one_is_named(layer_ir, tmp_path, store: str) -> None:
    directory, text = layer_ir
    target = tmp_path if store == "directory" else tmp_path / "w.safetensors"
    if store != "directory":
        target.write_bytes(b"not a safetensors file")
    path = tmp_path / "layer.mlir"
    path.write_text(text.replace(os.path.join(directory, "weights.safetensors"), str(target)))
    rc, _, err, seconds = run_opt(str(path), "-p", "top-pipeline")
    check_answer(str(path), rc, "", err, seconds)
    assert rc == 1 and f"weight store '{target}' is not a" in err, err


# -- the blow-ups of xDSL 0.75.0's parser ------------------------------------------------------

def test_guards_are_installed() -> None:
    assert GUARDS_INSTALLED, (
        "xDSL's string-literal or integer-type parsing is not the one of xdsl==0.75.0: re-check "
        "toptpu.dialects.ir_text's guards against the new parser (and whether it still blows up)")


def _unclosed_literal_module(n: int) -> str:
    return '"test.op"() : () -> () loc("' + "x" * n


def test_unclosed_string_literal_fails_in_linear_time() -> None:
    ctx = Context(allow_unregistered=True)
    for n in (10, 100_000):
        t0 = time.perf_counter()
        with deadline(HANG_SECONDS), pytest.raises(ParseError, match="not closed"):
            Parser(ctx, _unclosed_literal_module(n), "x.mlir").parse_module()
        assert time.perf_counter() - t0 < 2.0, n


@pytest.mark.parametrize("tail, message", [
    ('abc\\q")', "invalid escape '\\\\q'"),
    ('abc\n")', "not closed before the end of the line"),
    ('ab\vc")', "vertical tab"),
    ("abc", "the file ends first"),
])
def test_each_way_a_literal_can_fail_is_named(tail: str, message: str) -> None:
    text = '"test.op"() : () -> () loc("' + "y" * 60 + tail
    with deadline(HANG_SECONDS), pytest.raises(ParseError, match=message) as e:
        Parser(Context(allow_unregistered=True), text, "x.mlir").parse_module()
    assert "x.mlir:1:" in str(e.value)


@fuzz_settings(200)
@given(body=st.text(alphabet='a"\\ntF0g\n\vé', max_size=12))
def test_the_string_guard_accepts_what_xdsl_accepts(body: str) -> None:
    """On literals short enough for xDSL's own pattern to answer, the guard refuses exactly
    the literals xDSL refuses, and lets xDSL lex the rest as before."""
    source = Input('"' + body, "x.mlir")
    xdsl_match = re.compile(XDSL_STRING_PATTERN).match(source.content)
    try:
        check_string_literal(source, 0)
    except ParseError:
        assert xdsl_match is None
    else:
        assert xdsl_match is not None


def test_valid_literals_still_parse() -> None:
    text = '"test.op"() {s = "a\\"b\\\\c\\n\\t\\0A\\e9"} : () -> () loc("f.py":3:1)'
    module = Parser(Context(allow_unregistered=True), text).parse_module()
    assert "a\\22b" in str(module) or 'a\\"b' in str(module)


@pytest.mark.parametrize("width", ["2147483648", "18446744073709551617", "9" * 5000])
def test_integer_types_wider_than_mlir_allows_are_refused_at_once(width: str) -> None:
    text = f'"test.op"() {{v = 5 : i{width}}} : () -> ()'
    t0 = time.perf_counter()
    with deadline(HANG_SECONDS), pytest.raises(ParseError, match="wider than MLIR's limit"):
        Parser(Context(allow_unregistered=True), text, "x.mlir").parse_module()
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("attribute, message", [
    ("[" * 3000, "nesting too deep for xDSL's parser"),
    ("300 : i8", "invalid here: Integer value 300 is out of range for type i8"),
    ("dense<1.0> : tensor<1000000000000xf32>", "xDSL's parser raised MemoryError"),
], ids=["nesting", "attribute constructor", "splat"])
def test_odd_parser_exceptions_are_located(attribute: str, message: str) -> None:
    text = f'"top.weight"() {{name = "w", extra = {attribute}}} : () -> tensor<2xf32>'
    with deadline(HANG_SECONDS), pytest.raises(ParseError, match=message) as e:
        parse_ir(text, "x.mlir")
    assert "x.mlir:1:" in str(e.value)


def test_non_ascii_strings_survive_print_and_parse() -> None:
    """Found by the fuzzer: xDSL prints "é" as "\\C3\\A9" and read that back as bytes, so a
    location with a non-ASCII path (or such a name) written by toptpu could not be read."""
    text = ('builtin.module attributes {top.weight_store = "/tmp/josé/w.safetensors"} {\n'
            '  %0 = "top.weight"() {name = "poids_é"} : () -> tensor<2xf32> '
            'loc("layer.é"("/home/josé/modèle.py":3:0))\n}')
    module = parse_ir(text, "in.mlir")
    printed = print_ir(module, generic=True)
    assert "\\C3\\A9" in printed  # xDSL's printer escapes every non-ASCII byte
    back = parse_ir(printed, "out.mlir")
    assert back.is_structurally_equivalent(module)
    assert isinstance(back.attributes[STORE_ATTR], StringAttr)
    assert back.attributes[STORE_ATTR].data == "/tmp/josé/w.safetensors"
    with pytest.raises(IRVerifyError, match="should be of base attribute string"):
        parse_ir('"top.weight"() {name = "w\\FF"} : () -> tensor<2xf32>', "x.mlir")


@pytest.mark.slow  # exports a layer (layer_ir)
def test_opt_on_the_reported_hang_answers_in_seconds(layer_ir, tmp_path) -> None:
    """The reported case, in a subprocess as a user runs it: a hole cut into a dumped line
    leaves a location's string open to the end of the file."""
    _, text = layer_ir
    line = next(ln for ln in text.splitlines() if 'top.matmul ' in ln and 'loc("' in ln)
    cut = line.index('("', line.index("loc(")) + 12
    path = tmp_path / "hang.mlir"
    path.write_text(line[:cut] + line[cut + 40:].replace('"', ""))
    res = subprocess.run([os.path.join(os.path.dirname(sys.executable), "toptpu-opt"),
                          str(path), "-p", "top-pipeline"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stderr
    assert "hang.mlir:1:" in res.stderr and "string literal not closed" in res.stderr


@fuzz_settings(40)
@given(data=st.data())
def test_the_parsers_tensor_type_memo_reads_what_xdsl_reads(layer_ir, data) -> None:
    """`parse_ir` takes a tensor type it has read before from its memo (the text of a
    static ranked tensor type): on mutated IR it gives the module xDSL's own parser gives,
    or fails where that fails."""
    from toptpu.dialects import context
    from toptpu.dialects.ir_text import _parse, print_generic

    _, text = layer_ir
    text = data.draw(mutated(text), label="ir")
    try:
        plain = print_generic(Parser(context(), text, "plain").parse_module())
    except Exception:  # noqa: BLE001 - whatever xDSL raises, the memo must fail too
        plain = None
    for _ in range(2):  # the second read takes every tensor type from the memo
        try:
            got = print_generic(_parse(text, "memo", None, True)[0])
        except Exception:  # noqa: BLE001
            got = None
        assert (got is None) == (plain is None)
        assert got == plain
