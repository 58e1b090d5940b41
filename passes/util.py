"""Small helpers for writing rewrite patterns over Top/Tpu IR (`producer` and `named_like`
live with the dialects' canonicalization patterns, `toptpu.dialects.canonicalization`)."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriteWalker,
    RewritePattern,
)
from xdsl.transforms.common_subexpression_elimination import cse as eliminate_common
from xdsl.transforms.dead_code_elimination import region_dce
from xdsl.utils.exceptions import DiagnosticException

from toptpu.dialects.canonicalization import named_like, producer
from toptpu.dialects.naming import op_name
from toptpu.errors import ToptpuError

__all__ = ["apply_patterns", "has_one_use", "inverse_permutation", "named_like", "producer",
           "require_level"]


def has_one_use(value: SSAValue) -> bool:
    return value.has_one_use()


def apply_patterns(module: ModuleOp, patterns: list[RewritePattern], ctx: Context | None = None,
                   cse: bool = True) -> None:
    """Apply `patterns` greedily to a fixpoint, erasing dead ops; then, with `cse`, merge
    common subexpressions."""
    applier = GreedyRewritePatternApplier(patterns, ctx=ctx)
    PatternRewriteWalker(applier, post_walk_func=region_dce).rewrite_module(module)
    if cse:
        eliminate_common(module)


def inverse_permutation(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


class IRLevelError(ToptpuError, DiagnosticException):
    """A pass given IR of the other level (Tpu IR to a pass that takes Top IR, or the
    reverse): a mistake of the command line, named before the pass changes anything."""


#: what to run to get each level's IR
_HOW_TO_GET = {"top": "give it the IR of `toptpu compile --dump-ir` (or of top-pipeline)",
               "tpu": "run convert-top-to-tpu (or tpu-pipeline{chip=none}) first"}


def require_level(module: Operation, level: str, pass_name: str) -> None:
    """Refuse `module` unless it is IR of `level` ('top' or 'tpu'): no op of the other
    dialect anywhere in it (xDSL's and other dialects' ops are allowed)."""
    other = {"top": "tpu", "tpu": "top"}[level]
    for op in module.walk():
        if op.name.startswith(other + "."):
            where = op_name(op)
            found = f"'{op.name}'" + (f" ({where})" if where else "")
            raise IRLevelError(
                f"the input is {'already ' if other == 'tpu' else ''}{other.capitalize()} IR "
                f"(it holds {found}); {pass_name} takes {level.capitalize()} IR: "
                f"{_HOW_TO_GET[level]}")
