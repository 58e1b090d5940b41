"""How passes run, and the Top-level pipeline.

- `run_passes` runs a list of passes with the module's weight store in a `WeightsContext`,
  verifying the IR after each;
- `top-pipeline`: shape-infer, simplify, fuse, simplify, where "simplify" is xDSL's
  `canonicalize` (the ops' patterns), `fold-constants` and xDSL's `cse`;
- `PipelineEntry` / `expand_pipelines`: a named pipeline seen as the passes it runs.

Apart from `toptpu.passes.pipelines` (which re-exports them, with the Tpu-level pipelines)
so that running Top passes loads none of the Tpu level's passes (`toptpu-opt -p
top-pipeline`'s start-up, issue 43).
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

from toptpu.dialects import context
from toptpu.dialects.ir_text import verify_ir
from toptpu.dialects.weight_store import WeightsContext, WeightStore, WeightStoreError
from toptpu.passes.fold_constants import FoldConstantsPass
from toptpu.passes.fuse import FusePass
from toptpu.passes.shape_infer import ShapeInferPass
from toptpu.passes.util import require_level


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
    if isinstance(ctx, WeightsContext) and ctx.weights is not None and store is not None:
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
            # the ignore below: a pipeline pass's LEVEL
            out.append(PipelineEntry(p.name, p.LEVEL))  # type: ignore[attr-defined]
            out.extend(expand_pipelines(inner()))
        else:
            out.append(p)
    return out
