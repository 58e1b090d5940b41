"""Pass registry and the named pipelines (`top-pipeline`, later `tpu-pipeline`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu.passes.canonicalize import CanonicalizePass
from toptpu.passes.fuse import FusePass
from toptpu.passes.shape_infer import ShapeInferPass

#: a callback run after each pass: (pass, module) -> None (dumps, progress, timing)
AfterPass = Callable[[ModulePass, ModuleOp], None]


def run_passes(module: ModuleOp, passes: Sequence[ModulePass], ctx: Context | None = None,
               after: AfterPass | None = None, verify: bool = True) -> None:
    from toptpu.dialects import context

    ctx = ctx or context()
    for p in passes:
        p.apply(ctx, module)
        if verify:
            module.verify()
        if after is not None:
            after(p, module)


def top_pipeline_passes() -> list[ModulePass]:
    return [ShapeInferPass(), CanonicalizePass(), FusePass(), CanonicalizePass()]


@dataclass(frozen=True)
class TopPipeline(ModulePass):
    """shape-infer, canonicalize, fuse, canonicalize."""

    name = "top-pipeline"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        run_passes(op, top_pipeline_passes(), ctx)


def all_passes() -> dict[str, type[ModulePass]]:
    """Every pass toptpu registers, by name."""
    passes: list[type[ModulePass]] = [ShapeInferPass, CanonicalizePass, FusePass, TopPipeline]
    return {p.name: p for p in passes}
