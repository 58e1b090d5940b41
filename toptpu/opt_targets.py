"""toptpu-opt's own output targets (`-t NAME`), beside xDSL's: registered by name and
imported only when named (`toptpu.opt.ToptpuOptMain.register_all_targets`), so that a run
printing IR loads neither codegen nor the machine nor the IRDL export (issue 43: start-up).

- `-t commands{chip=NAME}`: the command streams codegen makes of each function of a grouped,
  allocated, addressed module, one line per command, with the modelled timeline;
- `-t mlir-generic`: the module as real MLIR reads it with the IRDL of top/tpu.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.utils.target import Target

from toptpu.backend.codegen.streams import generate
from toptpu.backend.runtime.machine import command_cycles, schedule
from toptpu.backend.target.chips import DEFAULT_CHIP, get_chip
from toptpu.dialects.ir_text import print_generic
from toptpu.dialects.irdl_export import MlirFormError, mlir_form
from toptpu.errors import ToptpuError


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


@dataclass(frozen=True)
class MlirGenericTarget(Target):
    """`-t mlir-generic`: the module as real MLIR reads it with the IRDL of top/tpu
    (`python -m toptpu.dialects.irdl_export`): the generic form, with one operand / result
    segment per value of a variadic group (MLIR 22's IRDL gives a variadic group one type)."""

    name = "mlir-generic"

    def emit(self, ctx: Context, module: ModuleOp, output: IO[str]) -> None:
        try:
            output.write(print_generic(mlir_form(module), debuginfo=True))
        except MlirFormError as e:
            raise ValueError(f"-t mlir-generic: {e}") from None
