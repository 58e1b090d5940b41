"""mlir{pipeline="..."}: run a pass pipeline of real MLIR on the current module.

The module is printed in generic form, parsed by MLIR 22 with the top and tpu dialects
loaded from their IRDL (`toptpu.dialects.irdl_export`; no unregistered dialects), the pipeline runs
(MLIR's pass-pipeline syntax: "canonicalize,cse", "func.func(cse)", or a full
"builtin.module(...)"), and MLIR's result is parsed back into xDSL and replaces the
module's body. From the shell:

    toptpu-opt layer.mlir -p 'convert-top-to-linalg,mlir{pipeline="canonicalize,cse"}'

(xDSL's pass arguments: the pipeline is a quoted string, so it may contain commas,
parentheses and braces.)
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu.dialects.mlir_check import run_mlir_pipeline


@dataclass(frozen=True)
class MLIRPipelinePass(ModulePass):
    """Run an MLIR pass pipeline in real MLIR: mlir{pipeline="canonicalize,cse"}."""

    name = "mlir"

    pipeline: str = ""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        result = run_mlir_pipeline(op, self.pipeline)
        old = op.body.detach_block(0)
        old.drop_all_references()
        new = result.body.detach_block(0)
        op.body.add_block(new)
        op.attributes.clear()
        op.attributes.update(result.attributes)
