"""fuse: recognize the decomposed forms torch.export produces and fuse them into Top's
LLM ops.

- pow-mean-add-rsqrt-mul (and the weight multiply) -> `top.rms_norm`
- rotate-half cos/sin arithmetic -> `top.rope`
- the GQA repeat (unsqueeze-expand-reshape of k/v) in front of `top.attention` -> kv_heads
- `attention(q, concat(history_k, k), concat(history_v, v))` -> history operands
  (reload-free KV concatenation)
- linear written as permute(weight) + matmul (+ add bias), or as flatten-matmul-unflatten,
  -> one `top.matmul` with `transpose_b` and bias
- permutes are moved through rope and out of concats so that the layout permutes around
  attention cancel; canonicalization patterns run in the same walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    PatternRewriter,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.transforms.canonicalize import CanonicalizationRewritePattern

from toptpu.dialects import top
from toptpu.dialects.canonicalization import named_like, producer
from toptpu.dialects.common import (
    ReduceMode,
    RopeMode,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
)
from toptpu.passes.fold_constants import FoldConstants
from toptpu.passes.util import apply_patterns, inverse_permutation, require_level


def _other(op: top.BinaryOp, v: SSAValue) -> SSAValue:
    return op.rhs if op.lhs is v else op.lhs


class FuseRmsNorm(RewritePattern):
    """x * rsqrt(mean(x^2, -1, keepdim) + eps) -> rms_norm(x)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MulOp, rewriter: PatternRewriter) -> None:
        for x, r in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            rs = producer(r, top.RsqrtOp)
            if rs is None:
                continue
            add = producer(rs.input, top.AddConstOp)
            if add is None or read_bool(add.reverse):
                continue
            mean = producer(add.input, top.ReduceOp)
            if mean is None or mean.reduce_mode != ReduceMode.MEAN or not read_bool(mean.keepdims):
                continue
            rank = len(shape_of(x))
            if [a % rank for a in read_ints(mean.axes)] != [rank - 1]:
                continue
            sq = producer(mean.input, top.PowOp)
            if sq is None or read_float(sq.exponent) != 2.0 or sq.input is not x:
                continue
            eps = read_float(add.value)
            new = top.RmsNormOp(x, None, eps)
            rewriter.replace(op, named_like(new, op))
            return


class FuseRmsNormWeight(RewritePattern):
    """rms_norm(x) * w (w of shape [D]) -> rms_norm(x, w)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MulOp, rewriter: PatternRewriter) -> None:
        for n, w in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            norm = producer(n, top.RmsNormOp)
            if norm is None or norm.weight is not None or not n.has_one_use():
                continue
            if len(shape_of(w)) != 1 or shape_of(w)[0] != shape_of(n)[-1]:
                continue
            new = top.RmsNormOp(norm.input, w, read_float(norm.eps))
            rewriter.replace(op, named_like(new, op))
            return


def _rotate_half_source(v: SSAValue) -> SSAValue | None:
    """If v = cat(-x[..., D/2:], x[..., :D/2]) return x."""
    cat = producer(v, top.ConcatOp)
    if cat is None or len(cat.inputs) != 2:
        return None
    rank = len(shape_of(v))
    if read_int(cat.axis) % rank != rank - 1:
        return None
    neg = producer(cat.inputs[0], top.MulConstOp)
    if neg is None or read_float(neg.value) != -1.0:
        return None
    hi = producer(neg.input, top.SliceOp)
    lo = producer(cat.inputs[1], top.SliceOp)
    if hi is None or lo is None or hi.input is not lo.input:
        return None
    x = hi.input
    d = shape_of(x)[-1]
    for s, (a, b) in ((hi, (d // 2, d)), (lo, (0, d // 2))):
        if read_int(s.axis) % rank != rank - 1 or read_int(s.step) != 1:
            return None
        if (read_int(s.start), read_int(s.end)) != (a, b):
            return None
    return x


class FuseRope(RewritePattern):
    """x * cos + rotate_half(x) * sin -> rope(x, cos, sin, "half")."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AddOp, rewriter: PatternRewriter) -> None:
        for a, b in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            m1, m2 = producer(a, top.MulOp), producer(b, top.MulOp)
            if m1 is None or m2 is None:
                continue
            for rot, sin in ((m2.lhs, m2.rhs), (m2.rhs, m2.lhs)):
                x = _rotate_half_source(rot)
                if x is None:
                    continue
                if m1.lhs is x:
                    cos = m1.rhs
                elif m1.rhs is x:
                    cos = m1.lhs
                else:
                    continue
                if shape_of(x) != shape_of(op.output):
                    continue
                new = top.RopeOp(x, cos, sin, RopeMode.HALF)
                rewriter.replace(op, named_like(new, op))
                return


class SinkPermuteBelowRope(RewritePattern):
    """rope(permute(x), cos, sin) -> permute(rope(x, permute'(cos), permute'(sin)))."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.RopeOp, rewriter: PatternRewriter) -> None:
        perm = producer(op.input, top.PermuteOp)
        if perm is None:
            return
        order = read_ints(perm.order)
        if order[-1] != len(order) - 1:
            return  # the rotated axis must stay last
        rank = len(order)
        if len(shape_of(op.cos)) != rank or len(shape_of(op.sin)) != rank:
            return
        inv = inverse_permutation(order)
        new_ops = []
        cs = []
        for v, tag in ((op.cos, ".cos"), (op.sin, ".sin")):
            p = named_like(top.PermuteOp(v, inv), op, tag)
            new_ops.append(p)
            cs.append(p.output)
        cos, sin = cs
        rope = named_like(top.RopeOp(perm.input, cos, sin, op.rope_mode), op)
        out = named_like(top.PermuteOp(rope.output, order), op, ".perm")
        rewriter.replace(op, [*new_ops, rope, out])


class HoistPermuteOutOfConcat(RewritePattern):
    """concat(permute(a, p), permute(b, p)) -> permute(concat(a, b), p)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConcatOp, rewriter: PatternRewriter) -> None:
        perms = [producer(v, top.PermuteOp) for v in op.inputs]
        if len(perms) < 2 or any(p is None for p in perms):
            return
        orders = {tuple(read_ints(p.order)) for p in perms if p is not None}
        if len(orders) != 1:
            return
        order = list(orders.pop())
        axis = order[read_int(op.axis) % len(order)]
        cat = named_like(top.ConcatOp([p.input for p in perms if p is not None], axis), op)
        out = named_like(top.PermuteOp(cat.output, order), op, ".perm")
        rewriter.replace(op, [cat, out])


def _gqa_source(v: SSAValue) -> tuple[SSAValue, int, tuple[int, ...]] | None:
    """Recognize k/v repeated from kv heads to query heads in front of an attention:
    v = permute(reshape(expand(reshape(x [B,H,S,D] -> [B,H,1,S,D]) -> n) -> [B,Hn,S,D]),
    (0,2,1,3)). With S = 1 the permutes are reshapes and canonicalization may have merged
    them: v = reshape(expand(reshape(x -> [B,H,1,1,D]) -> n) -> [B,1,Hn,D]) for any x of
    B*H*D elements. Returns (x, n, [B,S,H,D]): x re-laid sequence-major is the un-repeated
    operand."""
    outer = producer(v, top.PermuteOp)
    if outer is not None:
        if read_ints(outer.order) != [0, 2, 1, 3]:
            return None
        r2 = producer(outer.input, top.ReshapeOp)
        if r2 is None:
            return None
        ex = producer(r2.input, top.ExpandOp)
    else:
        r2 = producer(v, top.ReshapeOp)
        ex = producer(r2.input, top.ExpandOp) if r2 is not None else None
    if r2 is None or ex is None:
        return None
    r1 = producer(ex.input, top.ReshapeOp)
    if r1 is None:
        return None
    us = shape_of(r1.output)
    es = shape_of(ex.output)
    if len(us) != 5 or len(es) != 5 or us[2] != 1 or us[:2] != es[:2] or us[3:] != es[3:]:
        return None
    b, h, _, s, d = us
    n = es[2]
    if outer is not None:
        if shape_of(r2.output) != (b, h * n, s, d) or shape_of(r1.input) != (b, h, s, d):
            return None
    elif s != 1 or shape_of(v) != (b, 1, h * n, d):
        return None
    return r1.input, n, (b, s, h, d)


class FoldGqaRepeat(RewritePattern):
    """attention over k/v repeated to the query heads -> GQA-native attention."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AttentionOp, rewriter: PatternRewriter) -> None:
        if op.history_k is not None:
            return
        ks, vs = _gqa_source(op.k), _gqa_source(op.v)
        if ks is None or vs is None or ks[1] != vs[1] or ks[1] == 1:
            return
        (k, n, k_shape), (v, _, v_shape) = ks, vs
        new_ops = []
        kv = []
        for x, shape, tag in ((k, k_shape, ".k"), (v, v_shape, ".v")):
            p: top.PermuteOp | top.ReshapeOp
            if len(shape_of(x)) == 4 and shape_of(x)[1] == shape[2]:
                p = top.PermuteOp(x, [0, 2, 1, 3])
            else:  # one token: [B, H, 1, D] and [B, 1, H, D] share memory order
                p = top.ReshapeOp(x, shape)
            named_like(p, op, tag)
            new_ops.append(p)
            kv.append(p.output)
        att = named_like(op.with_operands(op.q, kv[0], kv[1], op.mask,
                                          kv_heads=read_int(op.kv_heads) // n), op)
        rewriter.replace(op, [*new_ops, att])


class FuseKvHistory(RewritePattern):
    """attention(q, concat(hk, k), concat(hv, v)) -> attention(q, k, v, history=hk, hv)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AttentionOp, rewriter: PatternRewriter) -> None:
        if op.history_k is not None:
            return
        ck, cv = producer(op.k, top.ConcatOp), producer(op.v, top.ConcatOp)
        if ck is None or cv is None or len(ck.inputs) != 2 or len(cv.inputs) != 2:
            return
        if read_int(ck.axis) % 4 != 1 or read_int(cv.axis) % 4 != 1:
            return
        hk, k = ck.inputs
        hv, v = cv.inputs
        if shape_of(hk)[1] != shape_of(hv)[1]:
            return
        att = named_like(op.with_operands(op.q, k, v, op.mask, hk, hv), op)
        rewriter.replace(op, att)


class FuseLinearWeightTranspose(RewritePattern):
    """matmul(x, permute(w, [1, 0])) -> matmul(x, w, transpose_b)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MatMulOp, rewriter: PatternRewriter) -> None:
        perm = producer(op.rhs, top.PermuteOp)
        if perm is None or len(shape_of(perm.input)) != 2:
            return
        if read_ints(perm.order) != [1, 0]:
            return
        new = top.MatMulOp(op.lhs, perm.input, op.bias, transpose_a=read_bool(op.transpose_a),
                           transpose_b=not read_bool(op.transpose_b))
        rewriter.replace(op, named_like(new, op))


class FuseMatmulBias(RewritePattern):
    """matmul(x, w) + b (b of shape [N]) -> matmul(x, w, b)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.AddOp, rewriter: PatternRewriter) -> None:
        for m, b in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            mm = producer(m, top.MatMulOp)
            if mm is None or mm.bias is not None or not m.has_one_use():
                continue
            if len(shape_of(b)) != 1 or shape_of(b)[0] != shape_of(m)[-1]:
                continue
            if len(shape_of(mm.rhs)) != 2:
                continue
            new = top.MatMulOp(mm.lhs, mm.rhs, b, transpose_a=read_bool(mm.transpose_a),
                               transpose_b=read_bool(mm.transpose_b))
            rewriter.replace(op, named_like(new, mm))
            return


class UnflattenLinear(RewritePattern):
    """reshape(matmul(reshape(x [..., K] -> [M, K]), w [K|N]) -> [..., N]) -> matmul(x, w)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeOp, rewriter: PatternRewriter) -> None:
        mm = producer(op.input, top.MatMulOp)
        if mm is None or len(shape_of(mm.rhs)) != 2 or not mm.output.has_one_use():
            return
        flat = producer(mm.lhs, top.ReshapeOp)
        if flat is None or read_bool(mm.transpose_a):
            return
        xs, os_ = shape_of(flat.input), shape_of(op.output)
        if len(xs) < 2 or xs[:-1] != os_[:-1] or shape_of(mm.lhs)[-1] != xs[-1]:
            return
        new = top.MatMulOp(flat.input, mm.rhs, mm.bias, transpose_b=read_bool(mm.transpose_b))
        rewriter.replace(op, named_like(new, mm))


def fusion_patterns() -> list[RewritePattern]:
    return [
        FuseRmsNorm(),
        FuseRmsNormWeight(),
        FuseRope(),
        SinkPermuteBelowRope(),
        HoistPermuteOutOfConcat(),
        FoldGqaRepeat(),
        FuseKvHistory(),
        FuseLinearWeightTranspose(),
        FuseMatmulBias(),
        UnflattenLinear(),
    ]


@dataclass(frozen=True)
class FusePass(ModulePass):
    """Fuse rms_norm, rope, GQA attention, KV history and linear from decomposed forms."""

    name = "fuse"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        # the ops' canonicalization patterns and constant folding run in the same walk
        apply_patterns(op, [*fusion_patterns(), CanonicalizationRewritePattern(),
                            FoldConstants()], ctx)
