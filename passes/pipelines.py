"""Pass registry and the named pipelines (`top-pipeline`, later `tpu-pipeline`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu.passes.canonicalize import CanonicalizePass
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
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


def tpu_pipeline_passes(mode: str = "f32", group_size: int = 64,
                        symmetric: bool | None = None, keep_float: str = "lm_head"
                        ) -> list[ModulePass]:
    return [ConvertTopToTpuPass(mode, group_size, symmetric, keep_float), CanonicalizePass()]


@dataclass(frozen=True)
class TpuPipeline(ModulePass):
    """convert-top-to-tpu{mode,group-size,symmetric}, canonicalize (more with the machine)."""

    name = "tpu-pipeline"

    mode: str = "f32"
    group_size: int = 64
    symmetric: bool | None = None
    keep_float: str = "lm_head"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        run_passes(op, tpu_pipeline_passes(self.mode, self.group_size, self.symmetric,
                                           self.keep_float), ctx)


def all_passes() -> dict[str, type[ModulePass]]:
    """Every pass toptpu registers, by name."""
    passes: list[type[ModulePass]] = [ShapeInferPass, CanonicalizePass, FusePass, TopPipeline,
                                      ConvertTopToTpuPass, TpuPipeline]
    return {p.name: p for p in passes}
