"""`toptpu-opt`: an mlir-opt style driver built on xDSL's opt main.

Reads `.mlir` (custom or generic form), runs `-p 'pass1,pass2{opt=v}'`, prints the result
(`--print-op-generic` for the generic form), or with `-t commands{chip=NAME}` the command
streams codegen makes of each function of a grouped, allocated, addressed module (after
`tpu-pipeline`): one line per command (`toptpu.backend.formats.program.Program.text`).
It loads toptpu's dialects (builtin, func, arith, top, tpu) and, lazily, every other
dialect xDSL knows (linalg, tensor, ... as produced by convert-top-to-linalg or
`mlir{pipeline=...}`), and registers toptpu's passes (listed in `--help`) beside xDSL's
generic ones.

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
import dataclasses
import difflib
import os
import re
import stat
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from io import StringIO
from typing import IO, Any, get_type_hints

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass, PassPipeline
from xdsl.printer import Printer
from xdsl.universe import Universe
from xdsl.utils.arg_spec import _convert_arg_to_type, parse_pipeline, parse_spec
from xdsl.utils.exceptions import ArgSpecParseError, DiagnosticException, ParseError
from xdsl.utils.target import Target
from xdsl.xdsl_opt_main import xDSLOptMain

from toptpu.backend.codegen.streams import generate
from toptpu.backend.runtime.machine import command_cycles, schedule
from toptpu.backend.target.chips import DEFAULT_CHIP, get_chip
from toptpu.command_io import StdoutError, command_run, drop_stdout
from toptpu.dialects import all_dialects
from toptpu.dialects.ir_text import IRTextError, parse_ir, verify_ir
from toptpu.dialects.output_file import (
    OutputPathError,
    note_input,
    output_target,
    write_output,
)
from toptpu.dialects.weight_store import (
    STORE_ATTR,
    WeightsContext,
    WeightStore,
    needed_names,
)
from toptpu.errors import ToptpuError
from toptpu.passes.pipelines import PIPELINES, PipelineEntry, all_passes, expand_pipelines

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


def _spec_parse_problem(error: ArgSpecParseError) -> str:
    """xDSL's located multi-line parse error of a pipeline, as one clause."""
    text = str(error)
    where = re.search(r"pass-pipeline:\d+:(\d+)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    what = lines[-1].removesuffix(" here") if lines else "malformed"
    what = what[:1].lower() + what[1:]
    return f"{what} at column {where.group(1)}" if where else what


def _describe_type(hint: Any) -> str:
    text = str(hint)
    for word, say in (("tuple", "a comma-separated list"), ("bool", "true or false"),
                      ("float", "a number"), ("int", "an integer"), ("str", "a string")):
        if word in text:
            return say
    return text


def pass_options(cls: type[ModulePass]) -> list[tuple[str, str, Any]]:
    """A pass's options as -p spells them: (name, what it takes, default)."""
    hints = get_type_hints(cls)
    return [(f.name.replace("_", "-"), _describe_type(hints[f.name]), f.default)
            for f in dataclasses.fields(cls) if f.init and f.name != "name"]  # type: ignore[arg-type]


def passes_help() -> str:
    """The epilog of --help: toptpu's pipelines, then its passes, each with a one-line
    description and its options (type and default), as mlir-opt lists its passes."""
    ours = all_passes()
    groups = (("toptpu pipelines", [n for n, c in ours.items() if c in PIPELINES]),
              ("toptpu passes", [n for n, c in ours.items() if c not in PIPELINES]))
    lines: list[str] = []
    w = max(len(n) for n in ours) + 2
    for title, names in groups:
        lines.append(f"{title} (-p 'NAME{{option=value ...}}'):")
        for name in names:
            cls = ours[name]
            doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
            lines.append(f"  {name:<{w}} {doc}")
            for opt, takes, default in pass_options(cls):
                shown = "none" if default is None else (
                    str(default).lower() if isinstance(default, bool) else default)
                lines.append(f"  {'':<{w}}   {opt}: {takes} (default {shown})")
        lines.append("")
    lines.append("xDSL's own passes run too: --list-xdsl-passes lists them.")
    return "\n".join(lines)


def check_pipeline_spec(spec: str,
                        available: dict[str, Any]) -> None:
    """Refuse a `-p` pipeline that xDSL would refuse (or crash on), in one line naming the
    problem: its syntax, an unknown pass, an unknown option or a value of the wrong type."""
    shown_spec = f"'{spec}'" if spec.isprintable() else repr(spec)  # one line
    try:
        specs = list(parse_pipeline(spec))
    except ArgSpecParseError as e:
        raise OptInputError(f"-p {shown_spec}: {_spec_parse_problem(e)}") from None
    for s in specs:
        if s.name not in available:
            close = difflib.get_close_matches(s.name, list(available), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise OptInputError(f"-p {shown_spec}: unknown pass '{s.name}'{hint}; "
                                "toptpu-opt --help lists the passes")
        cls = available[s.name]()
        options = {f.name: f for f in dataclasses.fields(cls)
                   if f.init and f.name != "name"}
        hints = get_type_hints(cls)
        for key, values in s.normalize_parameter_names().parameters.items():
            shown = key.replace("_", "-")
            if key not in options:
                valid = ", ".join(o.replace("_", "-") for o in options) or "none"
                raise OptInputError(f"-p {shown_spec}: pass '{s.name}' has no option '{shown}' "
                                    f"(its options: {valid})")
            if not values:
                raise OptInputError(f"-p {shown_spec}: option '{shown}' of pass '{s.name}' "
                                    f"needs a value ({shown}=...: "
                                    f"{_describe_type(hints[key])})")
            try:
                _convert_arg_to_type(values, hints[key])
            except ValueError:
                given = ",".join(str(v) for v in values)
                raise OptInputError(f"-p {shown_spec}: option '{shown}' of pass '{s.name}' "
                                    f"takes {_describe_type(hints[key])}, not {given}") from None


@dataclass(frozen=True)
class CommandsTarget(Target):
    """`-t commands{chip=NAME}`: the command streams of each function, as text."""

    name = "commands"
    chip: str = DEFAULT_CHIP

    def emit(self, ctx: Context, module: ModuleOp, output: IO[str]) -> None:
        try:
            chip = get_chip(self.chip)
            for fn in module.ops:
                if isinstance(fn, func.FuncOp):
                    prog = generate(module, fn, chip)
                    events, _ = schedule(prog.commands, chip)
                    total = max((e.end for e in events), default=0.0)
                    busy = {k: sum(e.end - e.start for e in events if e.engine == k)
                            for k in ("dma", "cmp")}
                    timeline = (f"modelled on {chip.name}: {total:.0f} cycles "
                                f"({total / (chip.freq_ghz * 1e3):.2f} us), dma busy "
                                f"{busy['dma']:.0f}, compute busy {busy['cmp']:.0f}")
                    print(prog.text([command_cycles(chip, c) for c in prog.commands],
                                    timeline), file=output)
        except ToptpuError as e:
            raise ValueError(f"-t commands: {e}") from None


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

    def register_all_dialects(self) -> None:
        ours = {d.name for d in all_dialects()}
        for d in all_dialects():
            self.ctx.register_dialect(d.name, lambda d=d: d)
        for name, factory in Universe.get_multiverse().all_dialects.items():
            if name not in ours:
                self.ctx.register_dialect(name, factory)

    def register_all_passes(self) -> None:
        ours = all_passes()
        for name, cls in ours.items():
            self.register_pass(name, lambda cls=cls: cls)
        super().register_all_passes()
        for name, cls in ours.items():  # ours win where xDSL has a pass of the same name
            self.register_pass(name, lambda cls=cls: cls)

    def setup_pipeline(self) -> None:
        check_pipeline_spec(self.args.passes, self.available_passes)
        try:
            super().setup_pipeline()
        except (ValueError, TypeError) as e:  # a pass refusing its options when made
            spec = self.args.passes
            raise OptInputError(f"-p {spec!r}: {e}") from None
        # the named pipelines run as the passes they are made of, so that timing and the IR
        # printed between passes look inside them (as mlir-opt expands a pipeline alias)
        self.pass_times: list[tuple[str, float]] = []
        self.pipeline = PassPipeline(tuple(expand_pipelines(self.pipeline.passes)),
                                     self._between_passes)

    def _between_passes(self, prev: ModulePass | None, module: ModuleOp,
                        nxt: ModulePass | None) -> None:
        """After `prev` and before `nxt`: its time (--time-passes), the IR after it
        (--print-between-passes), both on stderr: stdout holds the result alone."""
        now = time.perf_counter()
        if prev is not None and not isinstance(prev, PipelineEntry):
            self.pass_times.append((prev.name, now - self._pass_started))
            if self.args.print_between_passes and nxt is not None:
                self._print_between(prev, module)
        self._pass_started = time.perf_counter()

    def _print_between(self, prev: ModulePass, module: ModuleOp) -> None:
        """The IR after `prev` on stderr, naming a weight store that holds its tensors:
        when the passes so far derived some, the companion file the result's tensors go to
        (written at the end with every printed module's tensors), so any printed module
        can be cut out and run on its own."""
        print(f"// -----// IR after {prev.name} //----- //", file=sys.stderr)
        path = self._companion_for(module, f"the IR printed after {prev.name}")
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
        super().register_all_targets()
        self.available_targets[CommandsTarget.name] = lambda: CommandsTarget

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
        arg_parser.epilog = passes_help()
        arg_parser.formatter_class = argparse.RawDescriptionHelpFormatter

    # -- input and output ----------------------------------------------------------------------
    def get_input_stream(self) -> tuple[IO[bytes], str]:
        if self.args.input_file is not None:
            _check_input_path(self.args.input_file)
        stream, extension = super().get_input_stream()
        if self.args.frontend:  # -f names the format whatever the extension (xDSL checks both)
            extension = parse_spec(self.args.frontend).name
        return stream, extension

    def prepare_input(self) -> tuple[list[tuple[IO[bytes], int]], str]:
        try:
            return super().prepare_input()
        except OptInputError:
            raise
        except ValueError as e:  # xDSL's only check here: the file extension
            raise OptInputError(f"{self.get_input_name()}: {e}; to read it as MLIR text, "
                                "add -f mlir") from None

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
            ours = all_passes()
            print("\n".join(n for n in sorted(self.available_passes) if n not in ours))
            return
        if self.args.output_file is not None and not self.args.strip_debuginfo:
            self.args.print_debuginfo = True  # a file keeps where each op came from
        super().run()
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

        def callback(prev: ModulePass | None, module: ModuleOp, nxt: ModulePass | None) -> None:
            state["running"], state["verifying_after"] = None, prev
            if prev is not None and not self.args.disable_verify:
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
    except (OptInputError, IRTextError, StdoutError) as e:
        print(f"toptpu-opt: {e}", file=sys.stderr)
    except ParseError as e:
        print(f"toptpu-opt: parse error:\n{e}", file=sys.stderr)
    except PassError as e:
        print(f"toptpu-opt: {name}: {e}", file=sys.stderr)
    except DiagnosticException as e:
        print(f"toptpu-opt: the IR does not verify:\n{e}", file=sys.stderr)
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
