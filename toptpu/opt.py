"""`toptpu-opt`: an mlir-opt style driver built on xDSL's opt main.

Reads `.mlir` (custom or generic form), runs `-p 'pass1,pass2{opt=v}'`, prints the result
(`--print-op-generic` for the generic form). It loads toptpu's dialects (builtin, func,
arith, top, tpu) and, lazily, every other dialect xDSL knows (linalg, tensor, ... as
produced by convert-top-to-linalg or `mlir{pipeline=...}`), and registers toptpu's passes
(listed in `--help`) beside xDSL's generic ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException
from xdsl.xdsl_opt_main import xDSLOptMain

from toptpu.mlir_check import MlirCheckError
from toptpu.passes.convert_top_to_linalg import LinalgLoweringError


class ToptpuOptMain(xDSLOptMain):
    def register_all_dialects(self) -> None:
        from xdsl.universe import Universe

        from toptpu.dialects import all_dialects

        ours = {d.name for d in all_dialects()}
        for d in all_dialects():
            self.ctx.register_dialect(d.name, lambda d=d: d)
        for name, factory in Universe.get_multiverse().all_dialects.items():
            if name not in ours:
                self.ctx.register_dialect(name, factory)

    def register_all_passes(self) -> None:
        from toptpu.passes.pipelines import all_passes

        ours = all_passes()
        for name, cls in ours.items():
            self.register_pass(name, lambda cls=cls: cls)
        super().register_all_passes()
        for name, cls in ours.items():  # ours win where xDSL has a pass of the same name
            self.register_pass(name, lambda cls=cls: cls)

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)
        from toptpu.passes.pipelines import all_passes

        lines = ["toptpu passes:"]
        for name, cls in all_passes().items():
            doc = (cls.__doc__ or "").strip().splitlines()
            lines.append(f"  {name:<24} {doc[0] if doc else ''}")
        arg_parser.epilog = "\n".join(lines)
        arg_parser.formatter_class = argparse.RawDescriptionHelpFormatter


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ToptpuOptMain(
            description="toptpu-opt: run toptpu and xDSL passes over .mlir files",
            args=argv,
        ).run()
    except ParseError as e:
        print(f"toptpu-opt: parse error:\n{e}", file=sys.stderr)
        return 1
    except (VerifyException, DiagnosticException) as e:
        print(f"toptpu-opt: the IR does not verify:\n{e}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
        print(f"toptpu-opt: error: {e}", file=sys.stderr)
        return 1
    except (MlirCheckError, LinalgLoweringError) as e:
        print(f"toptpu-opt: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
