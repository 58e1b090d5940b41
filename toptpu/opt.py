"""`toptpu-opt`: an mlir-opt style driver built on xDSL's opt main.

Reads `.mlir` (custom or generic form), runs `-p 'pass1,pass2{opt=v}'`, prints the result
(`--print-op-generic` for the generic form), or with `-t commands{chip=NAME}` the command
streams codegen makes of each function of a grouped, allocated, addressed module (after
`tpu-pipeline`): one line per command (`toptpu.backend.formats.program.Program.text`).
It loads toptpu's dialects (builtin, func, arith, top, tpu) and, lazily, every other
dialect xDSL knows (linalg, tensor, ... as produced by convert-top-to-linalg or
`mlir{pipeline=...}`), and registers toptpu's passes (listed in `--help`) beside xDSL's
generic ones.

mlir-opt's words: `--mlir-print-ir-before=PASS` / `--mlir-print-ir-after=PASS` (a pass or a
named pipeline), `--mlir-print-ir-before-all` / `-after-all` (stderr), `builtin.module(...)`
pipelines in `-p` or `--pass-pipeline`, `-` for stdin (and `-o -`), `--split-input-file` going
on past a failing chunk (exit 1 at the end), and `--verify-diagnostics` matching the input's
`expected-error` comments (`toptpu.expected_diagnostics`). `-t mlir-generic` prints what the
real mlir-opt reads with the IRDL of top/tpu (`toptpu.dialects.irdl_export.mlir_form`).

What it does with bad input (each a one-line or located diagnostic, exit 1):
- the input file missing, a directory, unreadable, empty, not UTF-8 or binary, IR that does not
  parse (`toptpu.dialects.ir_text.parse_ir`: file:line:column, the line, what is wrong) or does
  not verify (xDSL's verifier plus defined-before-use), a pass that refuses the IR (its error
  named with the pass; a pass given IR of the other level, Tpu IR to a pass taking Top IR or
  the reverse, and a weight the IR names that its store does not hold, are such refusals),
  an `-o` that is a directory or in a missing directory, a `-p` that does not parse or names
  an unknown pass, an unknown option or a value of the wrong type (`check_pipeline_spec`).
- The result is written to `-o` only when everything succeeded (atomically: the input may be the
  output, and a failed run leaves the old file as it was).
- A pass (or a verifier) that crashes on IR that verified is a bug in toptpu, not a mistake of
  the user: it is reported as an internal error, with the traceback and a bug-report hint
  (exit 70), never dressed up as a diagnostic.

Weights: the passes get the module's weight store from their context (a `WeightsContext`:
the file `top.weight_store` names, opened by the first pass that reads weights). When they
derive tensors the result needs (quantization, weight-reorder's transposes), the tensors
the result names are saved to a companion file, and the result's `top.weight_store` points
at it, so every printed module runs on its own:
- with `-o OUT.mlir` the companion is `OUT.weights.safetensors` beside it (`OUT.weights.
  safetensors` for an `-o OUT` without the `.mlir` extension too: `OUT` + the suffix);
- `--weights-out PATH` names it (required when the result goes to stdout: nothing is
  written anywhere the command line does not name);
- the input's own store is never overwritten (an error names the clash), and the companion
  is written atomically, before the result, only when everything succeeded.
A pipeline that derives nothing the result needs leaves `top.weight_store` as it was.
The IR printed between passes (`--print-between-passes`, on stderr) names the same companion
file once the passes derived tensors it needs, and the file holds the tensors of every
printed module too: any of them can be cut out and run on its own.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import stat
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO, StringIO
from typing import IO, Any

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass, PassPipeline
from xdsl.printer import Printer
from xdsl.universe import Universe
from xdsl.utils.arg_spec import parse_spec
from xdsl.utils.exceptions import DiagnosticException, ParseError
from xdsl.utils.target import Target
from xdsl.xdsl_opt_main import xDSLOptMain

from toptpu import pass_pipeline
from toptpu.command_io import StdoutError, command_run, drop_stdout
from toptpu.dialects import all_dialects, dialect_factory
from toptpu.dialects.ir_text import IRTextError, IRVerifyError, parse_ir, verify_ir
from toptpu.dialects.output_file import (
    OutputPathError,
    note_input,
    output_target,
    write_output,
)
from toptpu.dialects.plugin_ops import registered as registered_ops
from toptpu.dialects.weight_store import (
    STORE_ATTR,
    WeightsContext,
    WeightStore,
    needed_names,
)
from toptpu.errors import ToptpuError
from toptpu.expected_diagnostics import (
    Diagnostic,
    ExpectationSyntaxError,
    Expected,
    check,
    parse_expectations,
)
from toptpu.pass_pipeline import pass_options
from toptpu.passes.registry import PASSES, PIPELINE_NAMES, all_passes
from toptpu.passes.top_pipeline import PipelineEntry
from toptpu.plugins import ENTRY_POINT_GROUP, load_plugins, returning

#: what a pass raises on purpose when it refuses valid IR (anything else is a bug): xDSL's
#: diagnostics and toptpu's user-facing errors (`toptpu.errors.ToptpuError`)
PASS_ERRORS: tuple[type[Exception], ...] = (DiagnosticException, ToptpuError)

#: exit status of an internal error (sysexits' EX_SOFTWARE)
EXIT_INTERNAL = 70

BUG_HINT = ("this is a bug in toptpu, not in your input: please report it with the input file "
            "and the command line")


class OptInputError(ToptpuError, ValueError):
    """A command-line path that cannot be used (missing, a directory, unreadable)."""


#: the companion weight file of `-o OUT.mlir`: OUT + this suffix
WEIGHTS_SUFFIX = ".weights.safetensors"


def companion_weights_path(output: str) -> str:
    """Where the tensors of `-o OUTPUT` go: OUT.weights.safetensors for OUT.mlir."""
    return output.removesuffix(".mlir") + WEIGHTS_SUFFIX


class PassError(ToptpuError, DiagnosticException):
    """A pass refused the IR; names the pass."""

    def __init__(self, pass_name: str, error: Exception) -> None:
        super().__init__(f"pass '{pass_name}': {error}")


class InternalError(Exception):
    """A crash of toptpu's own code on IR that verified (or of a verifier); carries the
    traceback text for the report."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what}: {type(error).__name__}: {error}")
        self.trace = "".join(traceback.format_exception(error))


class _KeptOutput(StringIO):
    """The `-o` text, held until the run has succeeded (xDSL closes its stream in a
    `finally`, also after an error)."""

    def close(self) -> None:
        pass


class ChunksFailed(ToptpuError):
    """Chunks of a --split-input-file or --verify-diagnostics run failed; each reported."""


#: mlir-opt's split marker: a line that is exactly `// -----`
SPLIT_MARKER = re.compile(rb"^// -----[ \t]*\r?$", re.MULTILINE)


def describe_error(e: BaseException, name: str) -> str:
    """What toptpu-opt prints for a user's mistake (without the exit status)."""
    if isinstance(e, OptInputError | IRTextError):
        return f"toptpu-opt: {e}"
    if isinstance(e, ParseError):
        return f"toptpu-opt: parse error:\n{e}"
    if isinstance(e, PassError):
        return f"toptpu-opt: {name}: {e}"
    if isinstance(e, DiagnosticException):
        return f"toptpu-opt: the IR does not verify:\n{e}"
    return f"toptpu-opt: error: {e}"


def diagnostic_of(e: BaseException) -> Diagnostic:
    """The error diagnostic `e` is, at its line in the chunk where it has one: a parse error at
    its token, a verifier error at its op; a pass's refusal and the rest at none."""
    if isinstance(e, ParseError):
        return Diagnostic("error", e.span.get_location().line, " ".join(e.msg.split()))
    if isinstance(e, IRVerifyError):
        at = re.search(r":\d+:\d+: (.*)$", e.location) if e.line is not None else None
        what = at.group(1) if at else e.location
        reason = " ".join(e.reason.split())
        return Diagnostic("error", e.line, f"{what}: {reason}" if what else reason)
    return Diagnostic("error", None, " ".join(str(e).split()))


def _check_input_path(path: str) -> None:
    if not os.path.exists(path):
        raise OptInputError(f"{path} does not exist")
    if os.path.isdir(path):
        raise OptInputError(f"{path} is a directory; give an IR file (.mlir)")
    if not os.access(path, os.R_OK):
        raise OptInputError(f"{path} is not readable (permissions)")


def _check_output_path(path: str, what: str = "-o") -> None:
    if os.path.isdir(path):
        raise OptInputError(f"{what} {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OptInputError(f"{what} {path}: the directory {parent} does not exist")
    try:
        output_target(path, what)  # a socket, a symlink loop: refused; a device is fine
    except OutputPathError as e:
        raise OptInputError(str(e)) from None


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (the same path, or links to one file)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _is_device(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _write(path: str, text: str, what: str = "-o", replaces: tuple[str, ...] = ()) -> None:
    try:
        write_output(path, text, what, replaces)
    except OutputPathError as e:
        raise OptInputError(str(e)) from None


def passes_help() -> str:
    """The epilog of --help: toptpu's pipelines, then its passes, then the installed plugins'
    passes (`toptpu.plugins`), each with a one-line description and its options (type and
    default), as mlir-opt lists its passes; a plugin that failed to load is named."""
    ours = all_passes()
    plugins = load_plugins()
    groups: list[tuple[str, dict[str, type[ModulePass]]]] = [
        ("toptpu pipelines", {n: c for n, c in ours.items() if n in PIPELINE_NAMES}),
        ("toptpu passes", {n: c for n, c in ours.items() if n not in PIPELINE_NAMES})]
    plugin_ops: dict[str, list[str]] = {}
    for entry in plugins.loaded:
        own = {n: c for n, (c, e) in plugins.passes.items() if e is entry}
        title = (f"passes of the plugin '{entry.plugin.name}' ({entry.distribution}; "
                 f"entry point {ENTRY_POINT_GROUP}: {entry.entry_point})")
        groups.append((title, own))
        plugin_ops[title] = [f"{e.top.name} (on the chip {e.tpu.name})"
                             for e in registered_ops() if e.plugin == entry.plugin.name]
    lines: list[str] = []
    w = max(len(n) for _, group in groups for n in group) + 2
    for title, group in groups:
        lines.append(f"{title} (-p 'NAME{{option=value ...}}'):")
        if plugin_ops.get(title):
            lines.append(f"  its ops: {', '.join(plugin_ops[title])}")
        for name, cls in group.items():
            doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
            lines.append(f"  {name:<{w}} {doc}")
            for opt, takes, default in pass_options(cls):
                shown = "none" if default is None else (
                    str(default).lower() if isinstance(default, bool) else default)
                lines.append(f"  {'':<{w}}   {opt}: {takes} (default {shown})")
        lines.append("")
    for problem in plugins.problems:
        lines.append(f"not loaded: {problem.line()}")
    if plugins.problems:
        lines.append("")
    lines.append("xDSL's own passes run too: --list-xdsl-passes lists them. Plugins add passes "
                 f"and ops through the entry-point group {ENTRY_POINT_GROUP} "
                 "(docs/your-first-pass.md).")
    return "\n".join(lines)


def check_pipeline_spec(spec: str,
                        available: dict[str, Any]) -> None:
    """Refuse a `-p` pipeline that xDSL would refuse (or crash on), in one line naming the
    problem: its syntax, an unknown pass, an unknown option or a value of the wrong type
    (`toptpu.pass_pipeline.check_pipeline_spec`)."""
    pass_pipeline.check_pipeline_spec(spec, available, "-p", OptInputError)


def module_pipeline(spec: str) -> str:
    """A pass pipeline in mlir-opt's textual form, `builtin.module(pass1,pass2{opt=v})`, as
    the list of passes toptpu-opt runs on the module (`pass1,pass2{opt=v}`); a plain list is
    returned as it is. Nesting under another op (`func.func(...)`) is refused: toptpu's passes
    are module passes."""
    return pass_pipeline.module_pipeline(spec, OptInputError)


def expand_marking_ends(passes: Sequence[ModulePass]
                        ) -> tuple[list[ModulePass], dict[int, list[str]]]:
    """`expand_pipelines(passes)`, and where each named pipeline ends in it: the index of its
    last pass -> the names of the pipelines that end there (innermost first)."""
    out: list[ModulePass] = []
    ends: dict[int, list[str]] = {}
    for p in passes:
        inner = getattr(p, "inner_passes", None)
        if not callable(inner):
            out.append(p)
            continue
        # the ignore below: a pipeline pass's LEVEL
        out.append(PipelineEntry(p.name, p.LEVEL))  # type: ignore[attr-defined]
        sub, sub_ends = expand_marking_ends(inner())
        for i, names in sub_ends.items():
            ends.setdefault(len(out) + i, []).extend(names)
        out.extend(sub)
        ends.setdefault(len(out) - 1, []).append(p.name)
    return out, ends


def _commands_target() -> type[Target]:
    """`-t commands`, imported when named: codegen and the machine."""
    from toptpu.opt_targets import CommandsTarget

    return CommandsTarget


def _mlir_generic_target() -> type[Target]:
    """`-t mlir-generic`, imported when named: the IRDL export."""
    from toptpu.opt_targets import MlirGenericTarget

    return MlirGenericTarget


@dataclass
class _PendingWeights:
    """Derived tensors to save before the result is written."""

    store: WeightStore
    names: list[str]
    path: str


class ToptpuOptMain(xDSLOptMain):
    _kept_output: _KeptOutput | None = None
    _pending_weights: _PendingWeights | None = None
    #: the context of the chunk the passes run on (its store), and the store's tensors the
    #: printed modules and the result name (saved to the companion file)
    _weights_ctx: WeightsContext | None = None
    _companion_names: set[str]

    @functools.cached_property
    def _multiverse(self) -> Universe:
        """xDSL's dialects, passes, targets and frontends (its `xdsl.universe` entry points),
        read once: each read scans every installed distribution's entry points (~13 ms;
        xDSL's own `register_all_*` read them four times at start-up)."""
        return Universe.get_multiverse()

    def register_all_dialects(self) -> None:
        ours = {d.name for d in all_dialects()}
        for d in all_dialects():
            self.ctx.register_dialect(d.name, dialect_factory(d))
        for name, factory in self._multiverse.all_dialects.items():
            if name not in ours:
                self.ctx.register_dialect(name, factory)

    def register_all_frontends(self) -> None:
        for name, factory in self._multiverse.all_frontends.items():
            self.available_frontends.setdefault(name, factory)

    def register_all_passes(self) -> None:
        # by name: a pass's module is imported when a pipeline names it (start-up)
        for name, get in PASSES.items():
            self.register_pass(name, get)
        for name, factory in self._multiverse.all_passes.items():  # xDSL's (its own loop)
            self.register_pass(name, factory)
        for name, get in PASSES.items():  # ours win where xDSL has a pass of the same name
            self.register_pass(name, get)
        for name, (cls, _) in load_plugins().passes.items():  # names no other pass has
            self.register_pass(name, returning(cls))

    def setup_pipeline(self) -> None:
        for problem in load_plugins().problems:  # one line each; the other passes go on
            print(f"toptpu-opt: warning: {problem.line()}", file=sys.stderr)
        # mlir-opt's words: `-` is stdin (and stdout for -o), --pass-pipeline is -p, and a
        # pipeline may be written builtin.module(...)
        if self.args.input_file == "-":
            self.args.input_file = None
        if self.args.output_file == "-":
            self.args.output_file = None
        if self.args.pass_pipeline is not None:
            if self.args.passes:
                raise OptInputError("give the passes once: -p or --pass-pipeline, not both")
            self.args.passes = self.args.pass_pipeline
        self.args.passes = module_pipeline(self.args.passes)
        check_pipeline_spec(self.args.passes, self.available_passes)
        try:
            super().setup_pipeline()
        except (ValueError, TypeError) as e:  # a pass refusing its options when made
            spec = self.args.passes
            raise OptInputError(f"-p {spec!r}: {e}") from None
        # the named pipelines run as the passes they are made of, so that timing and the IR
        # printed between passes look inside them (as mlir-opt expands a pipeline alias)
        self.pass_times: list[tuple[str, float]] = []
        passes, self._pipeline_ends = expand_marking_ends(self.pipeline.passes)
        self.pipeline = PassPipeline(tuple(passes), self._between_passes)
        self._print_before = self._print_ir_names(self.args.mlir_print_ir_before,
                                                  "--mlir-print-ir-before", passes)
        self._print_after = self._print_ir_names(self.args.mlir_print_ir_after,
                                                 "--mlir-print-ir-after", passes)
        self._position = 0

    def _print_ir_names(self, given: list[str] | None, flag: str,
                        passes: Sequence[ModulePass]) -> set[str]:
        """The pass (or pipeline) names of a --mlir-print-ir-before/after flag (repeated or
        comma-separated); an unknown name is refused, a known one the pipeline does not run
        is noted on stderr (it prints nothing, as in mlir-opt)."""
        names = {n.strip() for value in (given or []) for n in value.split(",") if n.strip()}
        run = {p.pipeline if isinstance(p, PipelineEntry) else p.name for p in passes}
        for n in sorted(names):
            if n not in self.available_passes:
                close = difflib.get_close_matches(n, list(self.available_passes), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise OptInputError(f"{flag}={n}: no pass or pipeline of that name{hint}; "
                                    "toptpu-opt --help lists them")
            if n not in run:
                print(f"toptpu-opt: note: {flag}={n}: the pipeline does not run '{n}', "
                      "nothing is printed for it", file=sys.stderr)
        return names

    def _between_passes(self, prev: ModulePass | None, module: ModuleOp,
                        nxt: ModulePass | None) -> None:
        """After `prev` and before `nxt`: its time (--time-passes), the IR after it
        (--print-between-passes, --mlir-print-ir-after[-all]) and before `nxt`
        (--mlir-print-ir-before[-all]), all on stderr: stdout holds the result alone."""
        now = time.perf_counter()
        args = self.args
        if prev is not None:
            if not isinstance(prev, PipelineEntry):
                self.pass_times.append((prev.name, now - self._pass_started))
                if args.mlir_print_ir_after_all or prev.name in self._print_after:
                    self._print_ir(f"IR Dump After {prev.name}", module)
                elif args.print_between_passes:
                    self._print_ir(f"IR after {prev.name}", module)
            for pipeline in self._pipeline_ends.get(self._position, ()):
                if pipeline in self._print_after:
                    self._print_ir(f"IR Dump After {pipeline}", module)
            self._position += 1
        if isinstance(nxt, PipelineEntry):
            if nxt.pipeline in self._print_before:
                self._print_ir(f"IR Dump Before {nxt.pipeline}", module)
        elif nxt is not None and (args.mlir_print_ir_before_all
                                  or nxt.name in self._print_before):
            self._print_ir(f"IR Dump Before {nxt.name}", module)
        self._pass_started: float = time.perf_counter()

    def _print_ir(self, title: str, module: ModuleOp) -> None:
        """The IR under `title` on stderr, naming a weight store that holds its tensors:
        when the passes so far derived some, the companion file the result's tensors go to
        (written at the end with every printed module's tensors), so any printed module
        can be cut out and run on its own."""
        sys.stdout.flush()  # what came before it on stdout (2>&1 keeps the order)
        print(f"// -----// {title} //----- //", file=sys.stderr)
        when, name = title.split()[-2:]
        path = self._companion_for(module, f"the IR printed {when.lower()} {name}")
        kept = module.attributes.get(STORE_ATTR)
        if path is not None:  # printed as it will be saved; the passes go on with theirs
            module.attributes[STORE_ATTR] = StringAttr(os.path.abspath(path))
        try:
            Printer(stream=sys.stderr, print_generic_format=self.args.print_op_generic,
                    print_debuginfo=self.args.print_debuginfo).print_op(module)
        finally:
            if path is not None and kept is not None:
                module.attributes[STORE_ATTR] = kept
        print("\n", file=sys.stderr)

    def _companion_for(self, module: ModuleOp, what: str) -> str | None:
        """Where the tensors `module` names go when the passes derived some of them (None:
        its own store holds them all); records them for the companion file."""
        store = self._weights_ctx.weights if self._weights_ctx is not None else None
        if store is None:  # no pass read weights
            return None
        names = needed_names(module, store)
        derived = sorted(set(names) & store.derived_names())
        if not derived:
            return None
        path = self._weights_path(derived, what)
        if _same_file(path, store.uri):
            raise OptInputError(
                f"the weights of {what} would go to {path}, the weight store of the input, "
                "which is never overwritten: give -o another name or --weights-out PATH")
        self._companion_names.update(names)
        return path

    def timing_report(self) -> str:
        """--time-passes: each pass's wall time and share, mlir-opt's report in short."""
        total = sum(t for _, t in self.pass_times) or 1e-12
        lines = ["===-- toptpu-opt: pass execution timing --===",
                 f"  {'wall (s)':>10} {'share':>7}  pass"]
        lines += [f"  {t:>10.4f} {100 * t / total:>6.1f}%  {n}" for n, t in self.pass_times]
        lines.append(f"  {total:>10.4f} {100.0:>6.1f}%  total")
        return "\n".join(lines)

    def register_all_targets(self) -> None:
        for name, factory in self._multiverse.all_targets.items():
            self.available_targets.setdefault(name, factory)
        self.available_targets["commands"] = _commands_target
        self.available_targets["mlir-generic"] = _mlir_generic_target

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)

        for action in arg_parser._actions:  # xDSL's -p help lists ~150 passes, most not ours
            if action.dest == "passes":
                action.help = ("the passes to run, comma-separated, with options in braces: "
                               "-p 'top-pipeline,tpu-pipeline{mode=w4bf16 chip=bm1684x}'. "
                               "toptpu's passes and pipelines are listed below; xDSL's with "
                               "--list-xdsl-passes")
            if action.dest == "print_debuginfo":
                action.help = ("print locations on stdout too (the output of -o keeps them "
                               "unless --strip-debuginfo)")
            if action.dest == "disable_verify":
                action.help = "do not verify the IR after parsing it and after each pass"
            if action.dest == "version":
                action.help = "print xDSL's version and exit"
            if action.dest == "target":
                action.help = ("what to print: mlir (the default), mlir-generic (the form "
                               "real MLIR reads with toptpu's IRDL: mlir-opt --irdl-file=...), "
                               "commands{chip=NAME} (the command streams of grouped, "
                               "addressed Tpu IR), or one of xDSL's")
            if action.dest == "input_file":
                action.help = "the IR file to read (.mlir); '-' or none: stdin"
            if action.dest == "output_file":
                action.help = "where the result goes ('-': stdout, the default)"
            if action.dest == "print_between_passes":
                action.help = ("print the IR after each pass, the last one included, on "
                               "stderr (named pipelines are looked inside)")
            if action.dest == "split_input_file":
                action.help = ("split the input at lines '// -----' and process each chunk "
                               "on its own, as mlir-opt: the outputs joined by '// -----', "
                               "each failing chunk's error on stderr; exit 1 if one failed")
            if action.dest == "verify_diagnostics":
                action.help = ("check the diagnostics against the input's 'expected-error "
                               "{{...}}' comments (also -warning, -note, -remark; @+N, @-N, "
                               "@above, @below, @unknown; -re for regexes) as mlir-opt does: "
                               "exit 1 with one line per diagnostic not expected or "
                               "expectation not produced")
            if action.dest == "parsing_diagnostics":
                action.help = ("print a chunk's parse error on stdout instead of failing "
                               "(xDSL's flag); --verify-diagnostics checks them")
        arg_parser.add_argument(
            "--pass-pipeline", metavar="PIPELINE", default=None,
            help="the passes, as mlir-opt writes them: 'builtin.module(top-pipeline,"
                 "canonicalize)' (-p takes the same, with or without builtin.module(...))")
        arg_parser.add_argument(
            "--mlir-print-ir-before", metavar="PASS", action="append",
            help="print the IR before each run of PASS (a pass or a named pipeline; "
                 "comma-separated or repeated) on stderr")
        arg_parser.add_argument(
            "--mlir-print-ir-after", metavar="PASS", action="append",
            help="print the IR after each run of PASS (a pass or a named pipeline: after its "
                 "last pass; comma-separated or repeated) on stderr")
        arg_parser.add_argument(
            "--mlir-print-ir-before-all", action="store_true",
            help="print the IR before every pass on stderr")
        arg_parser.add_argument(
            "--mlir-print-ir-after-all", action="store_true",
            help="print the IR after every pass on stderr")
        arg_parser.add_argument(
            "--strip-debuginfo", action="store_true",
            help="drop the locations from the output of -o (kept by default)")
        arg_parser.add_argument(
            "--list-xdsl-passes", action="store_true",
            help="list the xDSL passes toptpu-opt also knows, and exit")
        arg_parser.add_argument(
            "--weights-out", metavar="PATH", default=None,
            help="where the tensors the passes derive go (a .safetensors file; the result's "
                 f"top.weight_store points at it); default with -o OUT.mlir: "
                 f"OUT{WEIGHTS_SUFFIX}; required when the result goes to stdout")
        arg_parser.formatter_class = argparse.RawDescriptionHelpFormatter
        format_help = arg_parser.format_help

        def format_help_with_passes() -> str:  # imports every pass: only when --help asks
            arg_parser.epilog = passes_help()
            return format_help()

        # the ignore below: this parser's help
        arg_parser.format_help = format_help_with_passes  # type: ignore[method-assign]

    # -- input and output ----------------------------------------------------------------------
    def get_input_stream(self) -> tuple[IO[bytes], str]:
        if self.args.input_file is not None:
            _check_input_path(self.args.input_file)
        stream, extension = super().get_input_stream()
        if self.args.frontend:  # -f names the format whatever the extension (xDSL checks both)
            extension = parse_spec(self.args.frontend).name
        return stream, extension

    def prepare_input(self) -> tuple[list[tuple[IO[bytes], int]], str]:
        """The chunks (and the line each starts at) and the format: as xDSL, but split at
        lines that are exactly `// -----` (as mlir-opt), not wherever the text occurs."""
        split, self.args.split_input_file = self.args.split_input_file, False
        try:
            chunks, extension = super().prepare_input()
        except OptInputError:
            raise
        except ValueError as e:  # xDSL's only check here: the file extension
            raise OptInputError(f"{self.get_input_name()}: {e}; to read it as MLIR text, "
                                "add -f mlir") from None
        finally:
            self.args.split_input_file = split
        if not split:
            return chunks, extension
        ((stream, _),) = chunks
        data = stream.read()
        stream.close()
        pieces, start = [], 0
        for m in SPLIT_MARKER.finditer(data):
            pieces.append((data[start:m.start()], data.count(b"\n", 0, start)))
            start = m.end()  # the chunk starts on the marker's line, as in xDSL
        pieces.append((data[start:], data.count(b"\n", 0, start)))
        return [(BytesIO(text), offset) for text, offset in pieces], extension

    def prepare_output(self) -> IO[str]:
        if self.args.weights_out is not None:
            _check_output_path(self.args.weights_out, "--weights-out")
            if self.args.output_file is not None and _same_file(
                    self.args.weights_out, self.args.output_file) and not _is_device(
                    self.args.output_file):  # /dev/null takes both
                raise OptInputError(f"--weights-out {self.args.weights_out} is the output "
                                    "file (-o): give the weights another name")
        if self.args.output_file is None:
            return sys.stdout
        _check_output_path(self.args.output_file)
        self._kept_output = _KeptOutput()
        return self._kept_output

    def run(self) -> None:
        if self.args.list_xdsl_passes:
            ours = {**PASSES, **load_plugins().passes}
            print("\n".join(n for n in sorted(self.available_passes) if n not in ours))
            return
        if self.args.output_file is not None and not self.args.strip_debuginfo:
            self.args.print_debuginfo = True  # a file keeps where each op came from
        failed, total = self._run_chunks()
        if failed:
            what = ("did not produce the diagnostics expected"
                    if self.args.verify_diagnostics else "failed")
            chunks = "chunk" if total == 1 else "chunks"
            raise ChunksFailed(f"{failed} of {total} {chunks} {what}"
                               + ("; nothing was written" if self.args.output_file else ""))
        if self.args.time_passes:
            print(self.timing_report(), file=sys.stderr)
        in_place = tuple(p for p in (self.args.input_file,) if p)
        if self._kept_output is not None:  # every output checked before any is written
            try:
                output_target(self.args.output_file, "-o", replaces=in_place)
            except OutputPathError as e:
                raise OptInputError(str(e)) from None
        if self._pending_weights is not None:
            pending = self._pending_weights
            try:
                pending.store.save(pending.path, pending.names)
            except OutputPathError as e:
                raise OptInputError(str(e)) from None
            except OSError as e:
                raise OptInputError(f"cannot write the weights file {pending.path}: "
                                    f"{e.strerror or e}") from None
        if self._kept_output is not None:  # the input IR may be rewritten in place
            _write(self.args.output_file, self._kept_output.getvalue(), replaces=in_place)

    def _run_chunks(self) -> tuple[int, int]:
        """Parse, run the passes on and print each chunk; (chunks failed, chunks). Without
        --split-input-file and --verify-diagnostics the first error is raised; with
        --split-input-file each failing chunk's error goes to stderr and the next chunk
        runs (as mlir-opt); with --verify-diagnostics each chunk's diagnostics are checked
        against its `expected-*` comments (`toptpu.expected_diagnostics`)."""
        chunks, extension = self.prepare_input()
        output = self.prepare_output()
        verify, split = self.args.verify_diagnostics, self.args.split_input_file
        failed = 0
        try:
            for i, (chunk, offset) in enumerate(chunks):
                data = chunk.read()
                chunk.close()
                if i > 0:
                    output.write("// -----\n")
                expected = self._expectations(data, offset) if verify else None
                produced: list[Diagnostic] = []
                try:
                    module = self.parse_chunk(BytesIO(data), extension, offset)
                    if module is not None:
                        self.apply_passes(module)
                        output.write(self.output_resulting_program(module))
                except (OptInputError, InternalError, ChunksFailed):
                    raise
                except (ParseError, IRTextError, DiagnosticException) as e:
                    if verify:
                        produced.append(diagnostic_of(e))
                    elif isinstance(e, ParseError) and self.args.parsing_diagnostics:
                        print(e)  # xDSL's flag: the parse error printed, the chunk done
                    elif split:
                        output.flush()
                        sys.stdout.flush()
                        print(describe_error(e, self.get_input_name()), file=sys.stderr)
                        failed += 1
                    else:
                        raise
                if expected is not None:
                    problems = check(expected, produced, self.get_input_name(), offset)
                    if problems:
                        output.flush()
                        sys.stdout.flush()
                        print("\n".join(problems), file=sys.stderr)
                        failed += 1
                output.flush()
        finally:
            if output is not sys.stdout:
                output.close()
        return failed, len(chunks)

    def _expectations(self, data: bytes, offset: int) -> list[Expected]:
        text = data.decode("utf-8", errors="replace")
        try:
            return parse_expectations(text)
        except ExpectationSyntaxError as e:
            line = re.match(r"line (\d+): (.*)", str(e), re.S)
            where = (f"{self.get_input_name()}:{int(line.group(1)) + offset}: {line.group(2)}"
                     if line else f"{self.get_input_name()}: {e}")
            raise OptInputError(f"--verify-diagnostics: {where}") from None

    # -- weights -------------------------------------------------------------------------------
    def _weights_path(self, derived: list[str], what: str = "the result") -> str:
        if self.args.weights_out is not None:
            return self.args.weights_out
        if self.args.output_file is not None:
            in_place = tuple(p for p in (self.args.input_file,) if p)
            if output_target(self.args.output_file, replaces=in_place)[1] == "through":
                raise OptInputError(
                    f"-o {self.args.output_file} is a device or FIFO, and the passes derived "
                    f"{len(derived)} weight tensor(s) {what} needs: give --weights-out "
                    "PATH (a .safetensors file) for them")
            return companion_weights_path(self.args.output_file)
        example = ", ".join(f"'{n}'" for n in derived[:2])
        raise OptInputError(
            f"the passes derived {len(derived)} weight tensor(s) {what} needs ({example}"
            f"{', ...' if len(derived) > 2 else ''}) and the result goes to stdout: give "
            f"--weights-out PATH (a .safetensors file), or -o OUT.mlir (the weights then go to "
            f"OUT{WEIGHTS_SUFFIX})")

    def _keep_derived_weights(self, module: ModuleOp, store: WeightStore | None) -> None:
        """Point the result at a companion file holding every tensor it names, when the
        passes derived some of them (written in `run`, before the result); the file also
        holds the tensors of the modules printed between passes."""
        if store is None:  # no pass read weights
            return
        path = self._companion_for(module, "the result")
        if path is not None:
            module.attributes[STORE_ATTR] = StringAttr(os.path.abspath(path))
        if not self._companion_names:  # every module's own store holds its tensors
            return
        path = path or self._weights_path(sorted(self._companion_names & store.derived_names()),
                                          "the IR printed between passes")
        if self._pending_weights is not None:
            raise OptInputError(
                "the passes derived weights in more than one --split-input-file chunk, and "
                "one weights file holds one module's tensors: run the chunks separately")
        # checked again now that the inputs are known: never over one (before any output)
        _check_output_path(path, "the weights file" if self.args.weights_out is None
                           else "--weights-out")
        self._pending_weights = _PendingWeights(store, sorted(self._companion_names), path)

    def parse_chunk(self, chunk: IO[bytes], file_extension: str,
                    start_offset: int = 0) -> ModuleOp | None:
        if parse_spec(self.args.frontend or file_extension).name != "mlir":
            return super().parse_chunk(chunk, file_extension, start_offset)
        name = self.get_input_name()
        if self.args.split_input_file:
            name = f"{name} (the chunk from line {start_offset + 1})"
        if self.args.input_file is not None:
            note_input(self.args.input_file)  # never an output of this command
        try:
            module = parse_ir(chunk.read(), name, self.ctx,
                              implicit_module=not self.args.no_implicit_module,
                              verify=not self.args.disable_verify)
        except (ParseError, IRTextError, DiagnosticException):
            raise
        except Exception as e:  # noqa: BLE001 - parse errors are mapped: a verifier crashed
            raise InternalError("a verifier crashed", e) from e
        store = module.attributes.get(STORE_ATTR)
        if isinstance(store, StringAttr) and not store.data.startswith("memory:"):
            note_input(store.data)  # the weight store it names: read, never written
        return module

    # -- passes --------------------------------------------------------------------------------
    def apply_passes(self, prog: ModuleOp) -> None:
        """xDSL's pipeline (its callback verifies between passes), with each exception
        attributed: a pass refusing the IR, a pass crashing, a pass leaving invalid IR."""
        pipeline = self.pipeline
        state: dict[str, ModulePass | None] = {"running": None, "verifying_after": None}
        ctx = WeightsContext.of(self.ctx)  # the module's store: opened by the first pass asking
        self._weights_ctx, self._companion_names = ctx, set()
        self._position = 0

        def callback(prev: ModulePass | None, module: ModuleOp, nxt: ModulePass | None) -> None:
            state["running"], state["verifying_after"] = None, prev
            if (prev is not None and not self.args.disable_verify
                    and not isinstance(prev, PipelineEntry)):  # a level check changes nothing
                verify_ir(module)  # xDSL's verifier, and defined-before-use, which it skips
            if pipeline.callback is not None:  # times and prints between passes
                pipeline.callback(prev, module, nxt)
            state["running"], state["verifying_after"] = nxt, None

        try:
            PassPipeline(pipeline.passes, callback).apply(ctx, prog)
        except OptInputError:  # printing between passes needs a weights file named
            raise
        except Exception as e:  # noqa: BLE001 - sorted into refusal, crash, invalid output
            after, running = state["verifying_after"], state["running"]
            if after is not None:
                raise InternalError(f"pass '{after.name}' left IR that does not verify",
                                    e) from e
            name = "?" if running is None else (
                running.pipeline if isinstance(running, PipelineEntry) else running.name)
            if isinstance(e, PASS_ERRORS):
                raise PassError(name, e) from e
            raise InternalError(f"pass '{name}' crashed", e) from e
        self._keep_derived_weights(prog, ctx.weights)

    def output_resulting_program(self, prog: ModuleOp) -> str:
        try:
            return super().output_resulting_program(prog)
        except ValueError:  # an unknown target
            raise
        except Exception as e:  # noqa: BLE001 - the printer crashing on verified IR is a bug
            raise InternalError("printing the result crashed", e) from e


def main(argv: Sequence[str] | None = None) -> int:
    try:
        tool = ToptpuOptMain(
            description="toptpu-opt: run toptpu and xDSL passes over .mlir files",
            args=argv,
        )
    except ValueError as e:  # an unknown pass, a bad pass option
        print(f"toptpu-opt: error: {e}", file=sys.stderr)
        return 1
    name = tool.get_input_name()
    try:
        with command_run():  # its inputs never written over, its stdout checked
            tool.run()
    except StdoutError as e:
        print(f"toptpu-opt: {e}", file=sys.stderr)
    except ChunksFailed as e:
        print(f"toptpu-opt: {name}: {e}", file=sys.stderr)
    except (OptInputError, IRTextError, ParseError, DiagnosticException) as e:
        print(describe_error(e, name), file=sys.stderr)
    except InternalError as e:
        print(f"{e.trace}\ntoptpu-opt: internal error on {name}: {e}\n{BUG_HINT}",
              file=sys.stderr)
        return EXIT_INTERNAL
    except ValueError as e:  # xDSL's own checks of the command line (an unknown extension)
        print(f"toptpu-opt: error: {e}", file=sys.stderr)
    except BrokenPipeError:  # the reader went away (`toptpu-opt ... | head`)
        drop_stdout()
    except KeyboardInterrupt:
        print("toptpu-opt: interrupted", file=sys.stderr)
        return 130
    else:
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
