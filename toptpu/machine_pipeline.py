"""The machine pipeline and codegen for one module: the one way Tpu IR becomes a `Program`.

`compile_for_machine` runs the `machine-pipeline` passes (`toptpu.passes.pipelines.
machine_passes`: layer-group, lmem-verify, address-assign) on the module, in place, and
generates the command streams of its function. The compiler builds every net of a model file
with it (on a copy of the net's Tpu module); tests, benchmarks and `toptpu compare` build
programs with it on any `Chip`, a preset or not.

It runs passes and codegen, so it lives at the driver level: the runtime only runs programs
(`toptpu.backend.runtime.simulate`).
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu.backend.codegen.streams import CodegenError, generate
from toptpu.backend.formats.program import Program
from toptpu.backend.target.chips import Chip
from toptpu.dialects.weight_store import STORE_ATTR
from toptpu.passes.pipelines import AfterPass, machine_passes, run_passes


def compile_for_machine(module: ModuleOp, chip: Chip, max_ops: int = 12, *,
                        after: AfterPass | None = None, split_reduction: str = "cost",
                        passes: Sequence[ModulePass] | None = None) -> Program:
    """machine-pipeline (layer-group + lmem-verify + address-assign) on `module`, in place,
    then codegen for its one function on `chip` (a preset or not); `after` is
    called after each pass (progress, IR dumps); `split_reduction`: layer-group's option
    (where a reduction is split in parts); `passes` replaces the machine pipeline's passes
    (a compile's machine stage with passes inserted; none: codegen of grouped, addressed
    IR). The program's IR does not name the module's weight store: whoever runs the program
    hands it the weights."""
    fns = [f for f in module.ops if isinstance(f, func.FuncOp)]
    if len(fns) != 1:
        raise CodegenError(f"a machine program is made of a module with exactly one function; "
                           f"this one has {len(fns)}")
    if passes is None:
        passes = machine_passes(chip, max_ops, split_reduction)
    run_passes(module, passes, after=after)
    store = module.attributes.pop(STORE_ATTR, None)
    try:
        return generate(module, fns[0], chip)
    finally:
        if store is not None:
            module.attributes[STORE_ATTR] = store
