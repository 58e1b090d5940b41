"""Pass registry and the named pipelines.

- `top-pipeline`: shape-infer, simplify, fuse, simplify;
- `tpu-pipeline{mode, chip, ...}`: convert-top-to-tpu, simplify, weight-reorder, then
  (unless chip=none) the machine pipeline;

where "simplify" is three passes: xDSL's `canonicalize` (each op's canonicalization
patterns, `toptpu.dialects.canonicalization`), `fold-constants` (small constant operands
evaluated with the reference kernels) and xDSL's `cse`.
- `machine-pipeline{chip, max-ops}`: layer-group, lmem-verify, address-assign: the chip's
  memory decisions, the one sequence of passes before codegen (`toptpu.machine_pipeline`
  runs it and codegen for the compiler, tests and benchmarks).

`run_passes` runs a list of passes with the module's weight store in a `WeightsContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.transforms.canonicalize import CanonicalizePass
from xdsl.transforms.common_subexpression_elimination import CommonSubexpressionElimination
from xdsl.utils.exceptions import DiagnosticException

from toptpu.backend.target.chips import DEFAULT_CHIP, Chip
from toptpu.dialects import context
from toptpu.dialects.common import DEFAULT_GROUP_SIZE
from toptpu.dialects.ir_text import verify_ir
from toptpu.dialects.weight_store import WeightsContext, WeightStore, WeightStoreError
from toptpu.passes.address_assign import AddressAssignPass
from toptpu.passes.convert_top_to_linalg import ConvertTopToLinalgPass
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.fold_constants import FoldConstantsPass
from toptpu.passes.fuse import FusePass
from toptpu.passes.layer_group import LayerGroupPass, LmemVerifyPass
from toptpu.passes.mlir_pipeline import MLIRPipelinePass
from toptpu.passes.shape_infer import ShapeInferPass
from toptpu.passes.tensor_parallel import TensorParallelPass
from toptpu.passes.util import require_level
from toptpu.passes.weight_reorder import WeightReorderPass


class InvalidPassOutput(Exception):
    """A pass turned IR that verified into IR that does not: a bug in the pass (not a
    DiagnosticException, so that it is never reported as a mistake of the input)."""


#: a callback run after each pass: (pass, module) -> None (dumps, progress, timing)
AfterPass = Callable[[ModulePass, ModuleOp], None]


def run_passes(module: ModuleOp, passes: Sequence[ModulePass], ctx: Context | None = None,
               after: AfterPass | None = None, verify: bool = True, *,
               store: WeightStore | None = None) -> None:
    """Run `passes` over `module` in order. The passes that read or derive weights use
    `store` (the module's weight store; without one, the file the module names), or the
    store of `ctx` when it is a `WeightsContext` (a nested pipeline)."""
    ctx = _weights_context(ctx, store)
    for p in passes:
        p.apply(ctx, module)
        if verify:  # xDSL's verifier and defined-before-use (xDSL does not check dominance)
            try:
                verify_ir(module)
            except DiagnosticException as e:
                raise InvalidPassOutput(f"pass '{p.name}' left IR that does not verify: "
                                        f"{e}") from e
        if after is not None:
            after(p, module)


def _weights_context(ctx: Context | None, store: WeightStore | None) -> WeightsContext:
    if isinstance(ctx, WeightsContext) and (store is None or ctx.weights is store):
        return ctx
    if isinstance(ctx, WeightsContext) and ctx.weights is not None:
        raise WeightStoreError(f"run_passes was given the weight store '{store.uri}' and a "
                               f"context holding '{ctx.weights.uri}'")
    return WeightsContext.of(ctx or context(), store)


def simplify_passes() -> list[ModulePass]:
    """canonicalize (xDSL's: the ops' patterns), fold-constants, cse (xDSL's)."""
    return [CanonicalizePass(), FoldConstantsPass(), CommonSubexpressionElimination()]


def top_pipeline_passes() -> list[ModulePass]:
    return [ShapeInferPass(), *simplify_passes(), FusePass(), *simplify_passes()]


@dataclass(frozen=True)
class TopPipeline(ModulePass):
    """shape-infer, canonicalize, fold-constants, cse, fuse, canonicalize, fold-constants,
    cse."""

    name = "top-pipeline"
    LEVEL: ClassVar[str] = "top"

    def inner_passes(self) -> list[ModulePass]:
        """The passes this pipeline runs, in order (toptpu-opt shows, times and prints
        between them)."""
        return top_pipeline_passes()

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.LEVEL, self.name)
        run_passes(op, self.inner_passes(), ctx)


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


@dataclass(frozen=True)
class PipelineEntry(ModulePass):
    """Where an expanded pipeline starts: the level check the pipeline makes of its input
    (`expand_pipelines`); it changes nothing."""

    name = "pipeline-entry"

    pipeline: str = ""
    level: str = "top"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.level, self.pipeline)


def expand_pipelines(passes: Sequence[ModulePass]) -> list[ModulePass]:
    """`passes` with every named pipeline replaced by its level check (`PipelineEntry`) and
    the passes it runs (recursively), as mlir-opt expands a pipeline alias: what
    --time-passes and --print-between-passes see."""
    out: list[ModulePass] = []
    for p in passes:
        inner = getattr(p, "inner_passes", None)
        if callable(inner):
            out.append(PipelineEntry(p.name, p.LEVEL))  # type: ignore[attr-defined]
            out.extend(expand_pipelines(inner()))
        else:
            out.append(p)
    return out


#: the named pipelines
PIPELINES: tuple[type[ModulePass], ...] = (TopPipeline, TpuPipeline, MachinePipeline)


def all_passes() -> dict[str, type[ModulePass]]:
    """Every pass toptpu registers, by name: its own, and xDSL's `canonicalize` (which runs
    the ops' canonicalization patterns) as xDSL defines it."""
    passes: list[type[ModulePass]] = [ShapeInferPass, CanonicalizePass, FoldConstantsPass,
                                      FusePass, TopPipeline,
                                      ConvertTopToTpuPass, WeightReorderPass, LayerGroupPass,
                                      LmemVerifyPass, AddressAssignPass, MachinePipeline,
                                      TpuPipeline, ConvertTopToLinalgPass, MLIRPipelinePass,
                                      TensorParallelPass]
    return {p.name: p for p in passes}
