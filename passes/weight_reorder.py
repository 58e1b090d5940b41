"""weight-reorder: lay weights out the way the machine streams them.

The machine tiles a weight matmul along its output channels N (decode streams weight
tiles while the activation stays in local memory), so each tile must be contiguous rows:
a `tpu.matmul` whose 2-D weight is stored [K, N] (`transpose_b` false) gets a transposed
copy [N, K] in the weight store and `transpose_b = true`. The weight keeps its recipe
(`source`) and records the reorder in its `part` ("data.t"), so per-layer weights are
derived the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.rewriter import InsertPoint

from toptpu.dialects import top, tpu
from toptpu.dialects.common import (
    WeightPart,
    bool_attr,
    elem_of,
    read_bool,
    shape_of,
    str_attr,
    tensor,
)
from toptpu.dialects.naming import set_name
from toptpu.dialects.weight_store import WeightStore, weights_of
from toptpu.passes.util import named_like, producer, require_level


class TransposeMatmulWeight(RewritePattern):
    def __init__(self, store: WeightStore) -> None:
        self.store = store

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MatMulBase, rewriter: PatternRewriter) -> None:
        # (weight-reorder takes Tpu IR: every matmul is a tpu.matmul)
        w = producer(op.rhs, tpu.TpuWeight)
        if (w is None or read_bool(op.transpose_b)
                or read_bool(op.transpose_a) or len(shape_of(op.rhs)) != 2):
            return
        name = f"{w.tensor_name}.t"
        if name not in self.store:
            src = self.store[w.tensor_name]
            self.store[name] = self.store.derive(src.shape[::-1], src.dtype,
                                                 lambda: np.ascontiguousarray(src.T))
        k, n = shape_of(w.output)
        part = (w.weight_part or WeightPart.DATA).transpose()
        attrs = {"name": str_attr(name), "part": part.attr}
        if w.source is not None:
            attrs["source"] = w.source
        nw = tpu.WeightOp(attributes=attrs, result_types=[tensor((n, k), elem_of(w.output))])
        set_name(nw, name)
        rewriter.insert(nw, InsertPoint.before(op))
        new_attrs = {k_: v for k_, v in op.attributes.items() if k_ != "operandSegmentSizes"}
        new_attrs["transpose_b"] = bool_attr(True)
        new = tpu.MatMulOp.build([op.lhs, nw.output, op.bias], new_attrs)
        rewriter.replace(op, named_like(new, op))
        if not w.output.uses:  # the [K, N] original is dead: it must not take weight bytes
            rewriter.erase(w)


@dataclass(frozen=True)
class WeightReorderPass(ModulePass):
    """Store matmul weights [N, K] so output-channel tiles are contiguous."""

    name = "weight-reorder"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "tpu", self.name)
        store = weights_of(ctx, op)
        PatternRewriteWalker(GreedyRewritePatternApplier([TransposeMatmulWeight(store)]),
                             apply_recursively=False).rewrite_module(op)
