"""canonicalize: local simplifications of Top IR.

- no-op reshape / permute / expand / slice / cast / concat fold away; chains of reshapes and
  permutes compose; a permute that only moves size-1 axes becomes a reshape;
- x*1, x+0, x-0, x/1 fold away;
- ops whose operands are all small `top.constant`s are evaluated (with the backend kernels,
  the single numeric truth) into a new `top.constant`;
- dead pure ops are erased (by the greedy driver); xDSL's own canonicalization patterns run
  for builtin/func ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.transforms.canonicalize import CanonicalizationRewritePattern
from xdsl.transforms.common_subexpression_elimination import cse
from xdsl.transforms.dead_code_elimination import region_dce

from toptpu.backend.reference.interpreter import EvalContext, evaluate_op
from toptpu.dialects import top, tpu
from toptpu.dialects.common import (
    ShapedOp,
    constant_value,
    elem_of,
    f64_attr,
    i64_array,
    numel,
    read_bool,
    read_float,
    read_ints,
    shape_of,
)
from toptpu.passes.util import named_like, producer

#: results with at most this many elements are constant-folded
FOLD_LIMIT = 4096


def _attrs(op: Operation) -> dict:
    return {k: v for k, v in op.attributes.items() if k != "operandSegmentSizes"}


class FoldNoOpReshape(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeBase, rewriter: PatternRewriter) -> None:
        if shape_of(op.input) == shape_of(op.output):
            rewriter.replace(op, [], [op.input])


class ComposeReshapes(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeBase, rewriter: PatternRewriter) -> None:
        if (inner := producer(op.input, type(op))) is not None:
            new = type(op).build([inner.input], _attrs(op))
            rewriter.replace(op, named_like(new, op))


class FoldNoOpPermute(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteBase, rewriter: PatternRewriter) -> None:
        order = read_ints(op.order)
        if order == list(range(len(order))):
            rewriter.replace(op, [], [op.input])


class ComposePermutes(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteBase, rewriter: PatternRewriter) -> None:
        if (inner := producer(op.input, type(op))) is None:
            return
        p1, p2 = read_ints(inner.order), read_ints(op.order)
        order = [p1[i] for i in p2]
        if order == list(range(len(order))):
            rewriter.replace(op, [], [inner.input])
            return
        new = type(op).build([inner.input], {**_attrs(op), "order": i64_array(order)})
        rewriter.replace(op, named_like(new, op))


class PermuteOfUnitAxesIsReshape(RewritePattern):
    """A permute that keeps the order of all non-unit axes moves no data: a reshape."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.PermuteBase, rewriter: PatternRewriter) -> None:
        shape = shape_of(op.input)
        order = read_ints(op.order)
        moved = [i for i in order if shape[i] != 1]
        if moved == sorted(moved) and order != list(range(len(order))):
            reshape = top.ReshapeOp if isinstance(op, top.TopOp) else tpu.ReshapeOp
            attrs = {**_attrs(op), "shape": i64_array(shape_of(op.output))}
            attrs.pop("order")
            new = reshape.build([op.input], attrs)
            rewriter.replace(op, named_like(new, op))


class FoldNoOpShapeOps(RewritePattern):
    """expand/slice/cast/concat that do nothing."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if isinstance(op, top.ExpandBase | top.SliceBase | top.CastBase):
            if op.input.type == op.output.type:
                rewriter.replace(op, [], [op.input])
        elif isinstance(op, top.ConcatBase) and len(op.inputs) == 1:
            rewriter.replace(op, [], [op.inputs[0]])


class FoldIdentityScalarOps(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConstBinaryOp, rewriter: PatternRewriter) -> None:
        v = read_float(op.value)
        rev = read_bool(op.reverse)
        kind = op.op_kind()
        identity = (
            (kind == "mul_const" and v == 1.0)
            or (kind == "add_const" and v == 0.0)
            or (kind == "sub_const" and v == 0.0 and not rev)
            or (kind == "div_const" and v == 1.0 and not rev)
        )
        if identity:
            rewriter.replace(op, [], [op.input])


class ComposeScalarMuls(RewritePattern):
    """(x * a) * b -> x * (a*b)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ConstBinaryOp, rewriter: PatternRewriter) -> None:
        if op.op_kind() != "mul_const":
            return
        inner = producer(op.input, type(op))
        if inner is None or not inner.output.has_one_use():
            return

        v = read_float(inner.value) * read_float(op.value)
        new = type(op).build([inner.input], {**_attrs(op), "value": f64_attr(v)})
        rewriter.replace(op, named_like(new, op))


class FoldConstants(RewritePattern):
    """Evaluate ops whose operands are all small constants."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, ShapedOp) or isinstance(op, top.ConstantBase | top.WeightBase):
            return
        if not op.operands:
            return
        if not all(producer(v, top.ConstantBase) is not None for v in op.operands):
            return
        if any(numel(shape_of(r)) > FOLD_LIMIT for r in op.results):
            return
        # constant folding computes with the reference kernels: the one numeric truth
        args = []
        for v in op.operand_groups():
            c = producer(v, top.ConstantBase) if v is not None else None
            args.append(constant_value(c.value) if c is not None else None)
        results = evaluate_op(op, args, EvalContext(None))
        const = top.ConstantOp if isinstance(op, top.TopOp) else tpu.ConstantOp
        new_ops = [named_like(const(r), op, f".{i}")
                   for i, r in enumerate(results)]
        for n, r in zip(new_ops, op.results, strict=True):
            assert elem_of(n.output) == elem_of(r)
        rewriter.replace(op, new_ops, [n.output for n in new_ops])


def canonicalization_patterns() -> list[RewritePattern]:
    return [
        FoldNoOpReshape(),
        ComposeReshapes(),
        FoldNoOpPermute(),
        ComposePermutes(),
        PermuteOfUnitAxesIsReshape(),
        FoldNoOpShapeOps(),
        FoldIdentityScalarOps(),
        ComposeScalarMuls(),
        FoldConstants(),
        CanonicalizationRewritePattern(),
    ]


def apply_patterns(module: ModuleOp, patterns: list[RewritePattern], ctx: Context | None = None
                   ) -> None:
    """Apply `patterns` greedily to a fixpoint, then merge common subexpressions."""
    applier = GreedyRewritePatternApplier(patterns, ctx=ctx)
    PatternRewriteWalker(applier, post_walk_func=region_dce).rewrite_module(module)
    cse(module)


@dataclass(frozen=True)
class CanonicalizePass(ModulePass):
    """Fold no-op shape ops and identities, small constants, dead code; then CSE."""

    name = "canonicalize"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        apply_patterns(op, canonicalization_patterns(), ctx)

