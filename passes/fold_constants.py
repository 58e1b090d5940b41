"""fold-constants: evaluate ops whose operands are all small constants.

An op (Top or Tpu) whose every operand is a `top.constant` / `tpu.constant` and whose
results have at most `FOLD_LIMIT` elements is computed with the reference kernels (the one
numeric truth: `toptpu.backend.reference`) and replaced by constants of its level, named
like it; ops left dead are erased. The op's own rewrites are its canonicalization patterns,
run by xDSL's `canonicalize`; the pipelines run `canonicalize`, `fold-constants` and `cse`
together (passes/pipelines.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

from toptpu.backend.reference.interpreter import EvalContext, evaluate_op
from toptpu.dialects.canonicalization import named_like, producer, sibling_op
from toptpu.dialects.common import ShapedOp, constant_value, elem_of, numel, shape_of
from toptpu.dialects.top import ConstantBase
from toptpu.passes.util import apply_patterns

#: results with at most this many elements are constant-folded
FOLD_LIMIT = 4096


class FoldConstants(RewritePattern):
    """Evaluate an op whose operands are all small constants."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, ShapedOp) or op.GLOBAL_SOURCE or not op.operands:
            return
        if not all(producer(v, ConstantBase) is not None for v in op.operands):
            return
        if any(numel(shape_of(r)) > FOLD_LIMIT for r in op.results):
            return
        # constant folding computes with the reference kernels: the one numeric truth
        args = []
        for v in op.operand_groups():
            c = producer(v, ConstantBase) if v is not None else None
            args.append(constant_value(c.value) if c is not None else None)
        results = evaluate_op(op, args, EvalContext(None))
        const = sibling_op(op, ConstantBase)
        new_ops = [named_like(const(r), op, f".{i}") for i, r in enumerate(results)]
        for n, r in zip(new_ops, op.results, strict=True):
            assert elem_of(n.output) == elem_of(r)
        rewriter.replace(op, new_ops, [n.output for n in new_ops])


@dataclass(frozen=True)
class FoldConstantsPass(ModulePass):
    """Evaluate ops whose operands are all small constants with the reference kernels."""

    name = "fold-constants"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        apply_patterns(op, [FoldConstants()], ctx, cse=False)
