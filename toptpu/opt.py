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
  named with the pass), an `-o` that is a directory or in a missing directory.
- The result is written to `-o` only when everything succeeded (atomically: the input may be the
  output, and a failed run leaves the old file as it was).
- A pass (or a verifier) that crashes on IR that verified is a bug in toptpu, not a mistake of
  the user: it is reported as an internal error, with the traceback and a bug-report hint
  (exit 70), never dressed up as a diagnostic.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from io import StringIO
from typing import IO

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass, PassPipeline
from xdsl.universe import Universe
from xdsl.utils.arg_spec import parse_spec
from xdsl.utils.exceptions import DiagnosticException, ParseError
from xdsl.utils.target import Target
from xdsl.xdsl_opt_main import xDSLOptMain

from toptpu.backend.codegen.streams import CodegenError, generate
from toptpu.backend.target.chips import UnknownChipError, get_chip
from toptpu.dialects import all_dialects
from toptpu.dialects.ir_text import IRTextError, parse_ir, verify_ir
from toptpu.dialects.mlir_check import MlirCheckError
from toptpu.dialects.weight_store import WeightStoreError
from toptpu.passes.address_assign import AddressError
from toptpu.passes.convert_top_to_linalg import LinalgLoweringError
from toptpu.passes.convert_top_to_tpu import ConversionError
from toptpu.passes.layer_group import LayerGroupError
from toptpu.passes.lmem import LocalMemoryError
from toptpu.passes.pipelines import all_passes
from toptpu.passes.quantize import QuantizationError
from toptpu.passes.weight_recipe import RecipeError

#: what a pass raises on purpose when it refuses valid IR (anything else is a bug);
#: WeightStoreError: the weight store the IR names is missing or unreadable
PASS_ERRORS: tuple[type[Exception], ...] = (
    DiagnosticException, ConversionError, QuantizationError, RecipeError, LocalMemoryError,
    LayerGroupError, AddressError, LinalgLoweringError, MlirCheckError, WeightStoreError,
    UnknownChipError)

#: exit status of an internal error (sysexits' EX_SOFTWARE)
EXIT_INTERNAL = 70

BUG_HINT = ("this is a bug in toptpu, not in your input: please report it with the input file "
            "and the command line")


class OptInputError(ValueError):
    """A command-line path that cannot be used (missing, a directory, unreadable)."""


class PassError(DiagnosticException):
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


def _check_output_path(path: str) -> None:
    if os.path.isdir(path):
        raise OptInputError(f"-o {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OptInputError(f"-o {path}: the directory {parent} does not exist")


def _write_atomically(path: str, text: str) -> None:
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True)
class CommandsTarget(Target):
    """`-t commands{chip=NAME}`: the command streams of each function, as text."""

    name = "commands"
    chip: str = "bm1684x"

    def emit(self, ctx: Context, module: ModuleOp, output: IO[str]) -> None:
        try:
            chip = get_chip(self.chip)
            for fn in module.ops:
                if isinstance(fn, func.FuncOp):
                    print(generate(module, fn, chip).text(), file=output)
        except (CodegenError, AddressError, LocalMemoryError, UnknownChipError) as e:
            raise ValueError(f"-t commands: {e}") from None


class ToptpuOptMain(xDSLOptMain):
    _kept_output: _KeptOutput | None = None

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

    def register_all_targets(self) -> None:
        super().register_all_targets()
        self.available_targets[CommandsTarget.name] = lambda: CommandsTarget

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)

        lines = ["toptpu passes:"]
        for name, cls in all_passes().items():
            doc = (cls.__doc__ or "").strip().splitlines()
            lines.append(f"  {name:<24} {doc[0] if doc else ''}")
        arg_parser.epilog = "\n".join(lines)
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
        if self.args.output_file is None:
            return sys.stdout
        _check_output_path(self.args.output_file)
        self._kept_output = _KeptOutput()
        return self._kept_output

    def run(self) -> None:
        super().run()
        if self._kept_output is not None:
            _write_atomically(self.args.output_file, self._kept_output.getvalue())

    def parse_chunk(self, chunk: IO[bytes], file_extension: str,
                    start_offset: int = 0) -> ModuleOp | None:
        if parse_spec(self.args.frontend or file_extension).name != "mlir":
            return super().parse_chunk(chunk, file_extension, start_offset)
        name = self.get_input_name()
        if self.args.split_input_file:
            name = f"{name} (the chunk from line {start_offset + 1})"
        try:
            return parse_ir(chunk.read(), name, self.ctx,
                            implicit_module=not self.args.no_implicit_module,
                            verify=not self.args.disable_verify)
        except (ParseError, IRTextError, DiagnosticException):
            raise
        except Exception as e:  # noqa: BLE001 - parse errors are mapped: a verifier crashed
            raise InternalError("a verifier crashed", e) from e

    # -- passes --------------------------------------------------------------------------------
    def apply_passes(self, prog: ModuleOp) -> None:
        """xDSL's pipeline (its callback verifies between passes), with each exception
        attributed: a pass refusing the IR, a pass crashing, a pass leaving invalid IR."""
        pipeline = self.pipeline
        state: dict[str, ModulePass | None] = {"running": None, "verifying_after": None}

        def callback(prev: ModulePass | None, module: ModuleOp, nxt: ModulePass | None) -> None:
            state["running"], state["verifying_after"] = None, prev
            if pipeline.callback is not None:  # xDSL's: verifies, times, prints between passes
                pipeline.callback(prev, module, nxt)
            if prev is not None and not self.args.disable_verify:
                verify_ir(module)  # defined-before-use too, which xDSL's verifier skips
            state["running"], state["verifying_after"] = nxt, None

        try:
            PassPipeline(pipeline.passes, callback).apply(self.ctx, prog)
        except Exception as e:  # noqa: BLE001 - sorted into refusal, crash, invalid output
            after, running = state["verifying_after"], state["running"]
            if after is not None:
                raise InternalError(f"pass '{after.name}' left IR that does not verify",
                                    e) from e
            name = running.name if running is not None else "?"
            if isinstance(e, PASS_ERRORS):
                raise PassError(name, e) from e
            raise InternalError(f"pass '{name}' crashed", e) from e

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
        tool.run()
    except (OptInputError, IRTextError) as e:
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
    except KeyboardInterrupt:
        print("toptpu-opt: interrupted", file=sys.stderr)
        return 130
    else:
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
