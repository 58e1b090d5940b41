"""The machine part of the Tpu pipeline and codegen for one module, on any `Chip` (tests,
benchmarks and `toptpu compare` build programs with it; `toptpu.compiler` compiles the nets of
a model file with the same passes, by chip name, through `machine_passes`).

It runs passes and codegen, so it lives at the driver level: the runtime only runs programs
(`toptpu.backend.runtime.simulate`).
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.codegen.streams import generate
from toptpu.backend.formats.program import Program
from toptpu.backend.target.chips import Chip
from toptpu.passes.address_assign import assign_function
from toptpu.passes.layer_group import layer_group_function
from toptpu.passes.lmem import verify_group


def compile_for_machine(module: ModuleOp, chip: Chip, max_ops: int = 12) -> Program:
    """layer-group + lmem-verify + address-assign + codegen for the module's function."""
    fns = [f for f in module.ops if isinstance(f, func.FuncOp)]
    for fn in fns:
        for g in layer_group_function(fn, chip, max_ops):
            verify_group(g, chip)
        assign_function(fn)
    module.verify()
    if len(fns) != 1:
        raise ValueError("simulate runs modules with exactly one function")
    return generate(module, fns[0], chip)
