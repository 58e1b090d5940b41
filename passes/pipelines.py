"""The named pipelines.

- `top-pipeline`: shape-infer, simplify, fuse, simplify (`toptpu.passes.top_pipeline`,
  re-exported here with `run_passes`);
- `tpu-pipeline{mode, chip, ...}`: convert-top-to-tpu, simplify, weight-reorder, then
  (unless chip=none) the machine pipeline;

- `machine-pipeline{chip, max-ops}`: layer-group, lmem-verify, address-assign: the chip's
  memory decisions, the one sequence of passes before codegen (`toptpu.machine_pipeline`
  runs it and codegen for the compiler, tests and benchmarks);

where "simplify" is three passes: xDSL's `canonicalize` (each op's canonicalization
patterns, `toptpu.dialects.canonicalization`), `fold-constants` (small constant operands
evaluated with the reference kernels) and xDSL's `cse`.

`run_passes` runs a list of passes with the module's weight store in a `WeightsContext`.
Every pass by name: `toptpu.passes.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu.backend.target.chips import DEFAULT_CHIP, Chip
from toptpu.dialects.common import DEFAULT_GROUP_SIZE
from toptpu.passes.address_assign import AddressAssignPass
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.layer_group import LayerGroupPass, LmemVerifyPass
from toptpu.passes.top_pipeline import (
    AfterPass,
    InvalidPassOutput,
    PipelineEntry,
    TopPipeline,
    expand_pipelines,
    run_passes,
    simplify_passes,
    top_pipeline_passes,
)
from toptpu.passes.util import require_level
from toptpu.passes.weight_reorder import WeightReorderPass

__all__ = ["AfterPass", "InvalidPassOutput", "MachinePipeline", "PipelineEntry", "TopPipeline",
           "TpuPipeline", "expand_pipelines", "machine_passes", "run_passes", "simplify_passes",
           "top_pipeline_passes", "tpu_pipeline_passes"]


def tpu_pipeline_passes(mode: str = "f32", group_size: int = DEFAULT_GROUP_SIZE,
                        symmetric: bool | None = None, keep_float: str = "lm_head",
                        chip: str | None = None, max_ops: int = 12,
                        keep_input_types: bool = False) -> list[ModulePass]:
    """convert-top-to-tpu, canonicalize, fold-constants, cse, weight-reorder; with a `chip`,
    also the machine passes: layer-group, lmem-verify, address-assign."""
    passes: list[ModulePass] = [ConvertTopToTpuPass(mode, group_size, symmetric, keep_float,
                                                    keep_input_types),
                                *simplify_passes(), WeightReorderPass()]
    if chip is not None:
        passes += machine_passes(chip, max_ops)
    return passes


def machine_passes(chip: str | Chip = DEFAULT_CHIP, max_ops: int = 12,
                   split_reduction: str = "cost") -> list[ModulePass]:
    """layer-group, lmem-verify, address-assign: the chip's memory decisions. `chip`: a
    preset's name, or a `Chip` description; `split_reduction`: layer-group's option."""
    if isinstance(chip, str):
        return [LayerGroupPass(chip, max_ops, split_reduction), LmemVerifyPass(chip),
                AddressAssignPass()]
    return [LayerGroupPass.for_chip(chip, max_ops=max_ops, split_reduction=split_reduction),
            LmemVerifyPass.for_chip(chip), AddressAssignPass()]


@dataclass(frozen=True)
class MachinePipeline(ModulePass):
    """layer-group, lmem-verify, address-assign (the passes before codegen)."""

    name = "machine-pipeline"
    LEVEL: ClassVar[str] = "tpu"

    chip: str = DEFAULT_CHIP
    max_ops: int = 12
    split_reduction: str = "cost"

    def inner_passes(self) -> list[ModulePass]:
        """The passes this pipeline runs, in order."""
        return machine_passes(self.chip, self.max_ops, self.split_reduction)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.LEVEL, self.name)
        run_passes(op, self.inner_passes(), ctx)


@dataclass(frozen=True)
class TpuPipeline(ModulePass):
    """convert-top-to-tpu, canonicalize, fold-constants, cse, weight-reorder, layer-group,
    lmem-verify, address-assign (the machine passes are skipped with chip=none)."""

    name = "tpu-pipeline"
    LEVEL: ClassVar[str] = "top"

    mode: str = "f32"
    chip: str = DEFAULT_CHIP
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool | None = None
    keep_float: str = "lm_head"

    def inner_passes(self) -> list[ModulePass]:
        """The passes this pipeline runs, in order."""
        chip = None if self.chip == "none" else self.chip
        return tpu_pipeline_passes(self.mode, self.group_size, self.symmetric,
                                   self.keep_float, chip)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.LEVEL, self.name)
        run_passes(op, self.inner_passes(), ctx)
