"""The example plugin's op: `top.silu_mul`, SwiGLU's gate silu(gate) * up as one op.

Written as toptpu's own ops are (`toptpu/dialects/top.py`): the semantics on a base class,
`SiluMulBase`, from which toptpu derives the op's Tpu twin `tpu.silu_mul` when the plugin
loads (operands, verifier, shape inference, FLOPs, kernel binding, slicing answers); the Top
op, `SiluMulOp`, adds its lowering to linalg. Its kernel lives in this package
(`kernels.silu_mul`), named by its kernel binding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import irdl_op_definition, operand_def, result_def
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.common import (
    AnyTensor,
    ShapedOp,
    elem_of,
    is_float,
    numel,
    shape_of,
    tensor,
)
from toptpu.dialects.linalg_interface import compute_type
from toptpu.dialects.slicing_interface import RowRule, broadcast_row_rule
from toptpu.dialects.top import TopOp

if TYPE_CHECKING:
    from toptpu.dialects.linalg_builder import Body, Emitter


class SiluMulBase(ShapedOp):
    """silu(gate) * up, elementwise over two float tensors of one shape and type, computed
    in f32 and rounded once (the pair `top.silu`, `top.mul` rounds silu's result first)."""

    gate = operand_def(AnyTensor)
    up = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    assembly_format = "$gate `,` $up attr-dict `:` type($gate) `,` type($up) `->` type($output)"

    # the kernel binding: `kernels.silu_mul` of this package, called with (gate, up) and
    # `kernel_params` as keywords
    KERNEL_MODULE: ClassVar[str] = "toptpu_plugin_example.kernels"
    KERNEL: ClassVar[str] = "silu_mul"
    ELEMENTWISE: ClassVar[bool] = True
    #: silu's 5 (toptpu's `top.silu`) and the multiply's 1
    FLOPS_PER_ELEMENT: ClassVar[int] = 6

    def __init__(self, gate: SSAValue, up: SSAValue, *,
                 result_type: TensorType | None = None) -> None:
        self.construct([gate, up], {}, None if result_type is None else [result_type])

    @classmethod
    def infer(cls, operands: Sequence[SSAValue | None],
              attrs: Mapping[str, Attribute]) -> list[TensorType]:
        gate, up = operands[0], operands[1]
        assert gate is not None and up is not None
        if shape_of(gate) != shape_of(up) or elem_of(gate) != elem_of(up):
            raise VerifyException(f"gate {gate.type} and up {up.type} differ (silu_mul "
                                  "takes two tensors of one shape and type)")
        if not is_float(elem_of(gate)):
            raise VerifyException(f"silu_mul takes float tensors, not {elem_of(gate)}")
        return [tensor(shape_of(gate), elem_of(gate))]

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype()}

    def flops(self) -> int:
        return numel(shape_of(self.output)) * self.FLOPS_PER_ELEMENT

    # the slicing interface: a layer group slices it along token rows, as any elementwise op
    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)


@irdl_op_definition
class SiluMulOp(SiluMulBase, TopOp):
    name = "top.silu_mul"

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """One elementwise generic: silu(gate) * up in f32 for f16/bf16 storage, rounded
        once."""
        out = elem_of(self.output)
        ct = compute_type(out)

        def body(b: Body) -> SSAValue:
            g, u = b.convert(b.args[0], ct), b.convert(b.args[1], ct)
            one = b.const(1.0, ct)
            silu = b.div(g, b.add(one, b.math("exp", b.neg(g))))
            return b.convert(b.mul(silu, u), out)

        return e.elementwise([self.gate, self.up], shape_of(self.output), out, body)
