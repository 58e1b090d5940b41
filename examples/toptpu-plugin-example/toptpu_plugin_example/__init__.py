"""An example toptpu plugin: two rewrite-pattern passes and one op.

- `expand-silu{form=sigmoid}` rewrites every `top.silu` into the ops of its definition,
  `x * sigmoid(x)` (`form=tanh`: `x * (0.5 * tanh(0.5 * x) + 0.5)`, the same function through
  tanh). The model computes the same function; each rewritten silu costs one (sigmoid) or
  four (tanh) more elementwise ops, and at bf16 the sigmoid is rounded to bf16 before the
  multiply.
- `fuse-silu-mul` rewrites SwiGLU's `top.mul(top.silu(gate), up)` into the plugin's op
  `top.silu_mul(gate, up)` (`ops.py`; its kernel `kernels.silu_mul`): one elementwise op
  instead of two, the silu's result never stored, rounded once instead of twice.

The package is a toptpu plugin by its entry point (pyproject.toml):

    [project.entry-points."toptpu.plugins"]
    example = "toptpu_plugin_example:plugin"

whose object, `plugin`, is a `toptpu.plugins.Plugin` listing the pass and op classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from toptpu.dialects import top
from toptpu.dialects.canonicalization import named_like
from toptpu.dialects.common import elem_of, shape_of
from toptpu.passes.util import require_level
from toptpu.plugins import Plugin
from toptpu_plugin_example.ops import SiluMulOp

#: the forms expand-silu writes silu in
FORMS = ("sigmoid", "tanh")


class ExpandSilu(RewritePattern):
    """silu(x) -> x * sigmoid(x) (form sigmoid) or x * (0.5 * tanh(0.5 * x) + 0.5) (tanh)."""

    def __init__(self, form: str = "sigmoid") -> None:
        self.form = form

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SiluOp, rewriter: PatternRewriter) -> None:
        x = op.input
        new: list[Operation]
        if self.form == "sigmoid":
            gate = named_like(top.SigmoidOp(x), op, ".sigmoid")
            new = [gate]
        else:
            half = named_like(top.MulConstOp(x, 0.5), op, ".half")
            tanh = named_like(top.TanhOp(half.output), op, ".tanh")
            scaled = named_like(top.MulConstOp(tanh.output, 0.5), op, ".scaled")
            gate = named_like(top.AddConstOp(scaled.output, 0.5), op, ".gate")
            new = [half, tanh, scaled, gate]
        product = named_like(top.MulOp(x, gate.results[0]), op)
        rewriter.replace(op, [*new, product], [product.output])


@dataclass(frozen=True)
class ExpandSiluPass(ModulePass):
    """Rewrite every top.silu into x * sigmoid(x) (form=tanh: through tanh)."""

    name = "expand-silu"
    LEVEL: ClassVar[str] = "top"

    #: sigmoid: x * sigmoid(x); tanh: x * (0.5 * tanh(0.5 * x) + 0.5)
    form: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"expand-silu: form must be {' or '.join(FORMS)}, not "
                             f"'{self.form}'")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.LEVEL, self.name)
        PatternRewriteWalker(ExpandSilu(self.form)).rewrite_module(op)


class FuseSiluMul(RewritePattern):
    """mul(silu(gate), up) (either operand order) -> silu_mul(gate, up), where the silu has
    no other use and gate, up and the product share one shape and type."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MulOp, rewriter: PatternRewriter) -> None:
        for gated, up in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            silu = gated.owner
            if not isinstance(silu, top.SiluOp) or not gated.has_one_use():
                continue
            gate = silu.input
            if {(shape_of(v), elem_of(v)) for v in (gate, up, op.output)} != {
                    (shape_of(op.output), elem_of(op.output))}:
                continue
            fused = named_like(SiluMulOp(gate, up), op)
            rewriter.replace(op, fused, [fused.output])
            rewriter.erase(silu)
            return


@dataclass(frozen=True)
class FuseSiluMulPass(ModulePass):
    """Fuse SwiGLU's silu(gate) * up into one top.silu_mul (the example plugin's op)."""

    name = "fuse-silu-mul"
    LEVEL: ClassVar[str] = "top"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, self.LEVEL, self.name)
        PatternRewriteWalker(FuseSiluMul()).rewrite_module(op)


plugin = Plugin("example", passes=(ExpandSiluPass, FuseSiluMulPass), ops=(SiluMulOp,),
                description="expand-silu: silu written as x * sigmoid(x); fuse-silu-mul: "
                            "silu(gate) * up as the op top.silu_mul")
