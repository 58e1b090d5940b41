"""The Top dialect: what the model computes, independent of framework and chip.

Every op has a verifier (its result types must equal the inferred ones), shape inference
(`infer`, a classmethod usable before the op exists), a FLOP count (`flops`) and a numpy
reference in `toptpu.backend.reference.kernels`. Weights are named references into a weight store
(`top.weight`), never dense attributes; only small constants are `top.constant`.

Layout conventions:
- `top.attention` is sequence-major: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], result
  [B, Sq, Hq, Dv]; the optional history_k/history_v [B, Sh, Hkv, D] are attended before
  k/v without being concatenated (reload-free KV concatenation); the additive mask
  broadcasts to [B, Hq, Sq, Sh + Sk].
- `top.matmul` computes a @ b (+ bias) with numpy batch broadcasting; `transpose_b` reads
  b as [..., N, K] (the layout of `nn.Linear.weight`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, Self

import numpy as np
from xdsl.dialects.builtin import (
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    FloatAttr,
    IntegerAttr,
    StringAttr,
    TensorType,
    f32,
    i1,
    i32,
)
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    attr_def,
    irdl_op_definition,
    operand_def,
    opt_attr_def,
    opt_operand_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.common import (
    BOOL_FLAG,
    AnyTensor,
    ComparePredicate,
    ConvertedWeight,
    ElementType,
    EnumAttr,
    GeluApproximation,
    ReduceMode,
    RopeMode,
    ShapedOp,
    Storage,
    bool_attr,
    broadcast_shapes,
    constant_value,
    dense_attr,
    dtype_name,
    elem_of,
    flag_value_attr,
    float_value_attr,
    int_value_attr,
    ints_value_attr,
    is_float,
    norm_axis,
    numel,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
    str_attr,
    tensor,
)

Operands = Sequence[SSAValue | None]
Attrs = Mapping[str, Attribute]


class TopOp(ShapedOp):
    """Base class of Top compute ops (all pure)."""

    traits = traits_def(Pure())


# =========================================================================== sources


class WeightBase(ShapedOp):
    """A named tensor of the weight store (module attribute `top.weight_store`)."""

    weight_name = attr_def(StringAttr, attr_name="name")
    output = result_def(AnyTensor)
    assembly_format = "$name attr-dict `:` type($output)"
    STRUCTURAL: ClassVar[bool] = True  # read from the weight store
    SOURCE: ClassVar[bool] = True

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        raise VerifyException("a weight takes its type from the weight store")

    CHECK_INFERRED: ClassVar[bool] = False

    @property
    def tensor_name(self) -> str:
        return self.weight_name.data


@irdl_op_definition
class WeightOp(WeightBase, TopOp):
    name = "top.weight"

    def __init__(self, tensor_name: str, result_type: TensorType) -> None:
        if not isinstance(tensor_name, str) or not tensor_name:
            raise TypeError(f"a top.weight names its tensor (a non-empty str), not "
                            f"{tensor_name!r}")
        self.construct([], {"name": str_attr(tensor_name)}, [result_type])


class ConstantBase(ShapedOp):
    """A small constant held in the IR (scalars, masks of a few elements)."""

    value = attr_def(DenseIntOrFPElementsAttr)
    output = result_def(AnyTensor)
    STRUCTURAL: ClassVar[bool] = True  # its value is its attribute
    SOURCE: ClassVar[bool] = True

    def __init__(self, value: np.ndarray | DenseIntOrFPElementsAttr) -> None:
        """A constant holding `value` (an array: its dtype is the element type)."""
        attr = value if isinstance(value, DenseIntOrFPElementsAttr) else dense_attr(value)
        self.construct([], {"value": attr})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        v = attrs["value"]
        assert isinstance(v, DenseIntOrFPElementsAttr)
        t = v.get_type()
        assert isinstance(t, TensorType)
        return [t]


@irdl_op_definition
class ConstantOp(ConstantBase, TopOp):
    name = "top.constant"


def weight_name(value: SSAValue | None) -> str | None:
    """The tensor name of the weight (`top.weight`, `tpu.weight`) whose result `value` is;
    None for any other value (or None)."""
    owner = value.owner if value is not None else None
    return owner.tensor_name if isinstance(owner, WeightBase) else None


def constant_array(value: SSAValue | None) -> np.ndarray | None:
    """The array of the constant (`top.constant`, `tpu.constant`) whose result `value` is;
    None for any other value (or None)."""
    owner = value.owner if value is not None else None
    return constant_value(owner.value) if isinstance(owner, ConstantBase) else None


# =========================================================================== elementwise


class UnaryOp(ShapedOp):
    input = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    FLOPS_PER_ELEMENT: ClassVar[int] = 1
    ELEMENTWISE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, *, result_type: TensorType | None = None) -> None:
        self.construct([input], {}, None if result_type is None else [result_type])

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        return [tensor(shape_of(x), elem_of(x))]

    def flops(self) -> int:
        return numel(shape_of(self.output)) * self.FLOPS_PER_ELEMENT


@irdl_op_definition
class RsqrtOp(UnaryOp, TopOp):
    name = "top.rsqrt"
    FLOPS_PER_ELEMENT: ClassVar[int] = 2


@irdl_op_definition
class SqrtOp(UnaryOp, TopOp):
    name = "top.sqrt"


@irdl_op_definition
class ExpOp(UnaryOp, TopOp):
    name = "top.exp"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4


@irdl_op_definition
class CosOp(UnaryOp, TopOp):
    name = "top.cos"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4


@irdl_op_definition
class SinOp(UnaryOp, TopOp):
    name = "top.sin"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4


@irdl_op_definition
class TanhOp(UnaryOp, TopOp):
    name = "top.tanh"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4


@irdl_op_definition
class SigmoidOp(UnaryOp, TopOp):
    name = "top.sigmoid"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4


@irdl_op_definition
class SiluOp(UnaryOp, TopOp):
    name = "top.silu"
    FLOPS_PER_ELEMENT: ClassVar[int] = 5


@irdl_op_definition
class ReluOp(UnaryOp, TopOp):
    """max(x, 0)."""

    name = "top.relu"


@irdl_op_definition
class SoftplusOp(UnaryOp, TopOp):
    """log(1 + exp(x)), and x itself above 20 (torch's F.softplus with beta 1 and threshold
    20, where log1p(exp(x)) equals x in f32 anyway); Gated DeltaNet's decay uses it."""

    name = "top.softplus"
    FLOPS_PER_ELEMENT: ClassVar[int] = 5
    TPU_COMPUTES_F32: ClassVar[bool] = True  # it feeds the delta rule's decay (f32)


#: The unary elementwise ops without attributes: each computes the kernel its name gives
#: (`top.silu` -> `kernels.silu`, its kernel binding). Listed here, an op gets its place in
#: the Top dialect, hence its Tpu twin (`tpu.TPU_OF_TOP`) and its generic lowering by
#: `convert-top-to-tpu`; nothing else registers it.
UNARY_ELEMENTWISE: tuple[type[UnaryOp], ...] = (
    RsqrtOp, SqrtOp, ExpOp, CosOp, SinOp, TanhOp, SigmoidOp, SiluOp, ReluOp, SoftplusOp)


class GeluBase(UnaryOp):
    """GELU; `approximate` (a `GeluApproximation`) is "none" (erf, the default) or "tanh"."""

    approximate = opt_attr_def(EnumAttr(GeluApproximation))
    FLOPS_PER_ELEMENT: ClassVar[int] = 8

    def kernel_params(self) -> dict[str, object]:
        return {"approximate": str(self.approximation), "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, approximate: GeluApproximation = GeluApproximation.NONE,
                 *, result_type: TensorType | None = None) -> None:
        self.construct([input], {"approximate": GeluApproximation.parse(approximate).attr},
                       None if result_type is None else [result_type])

    @property
    def approximation(self) -> GeluApproximation:
        return GeluApproximation.read(self.approximate, GeluApproximation.NONE)


@irdl_op_definition
class GeluOp(GeluBase, TopOp):
    name = "top.gelu"


class PowBase(UnaryOp):
    """x ** exponent (scalar exponent)."""

    exponent = attr_def(FloatAttr)
    FLOPS_PER_ELEMENT: ClassVar[int] = 2
    KERNEL: ClassVar[str] = "power"

    def kernel_params(self) -> dict[str, object]:
        return {"exponent": read_float(self.exponent), "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, exponent: float, *,
                 result_type: TensorType | None = None) -> None:
        self.construct([input], {"exponent": float_value_attr(f"{self.name} exponent", exponent)},
                       None if result_type is None else [result_type])


@irdl_op_definition
class PowOp(PowBase, TopOp):
    name = "top.pow"


class ConstBinaryOp(UnaryOp):
    """x (op) value, a scalar; `reverse` puts the scalar on the left (value - x)."""

    value = attr_def(FloatAttr)
    reverse = opt_attr_def(BOOL_FLAG)

    def kernel_params(self) -> dict[str, object]:
        return {"value": read_float(self.value), "reverse": read_bool(self.reverse),
                "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, value: float, *, reverse: bool = False,
                 result_type: TensorType | None = None) -> None:
        self.construct([input], {"value": float_value_attr(f"{self.name} value", value),
                                 "reverse": flag_value_attr(f"{self.name} reverse", reverse)},
                       None if result_type is None else [result_type])


@irdl_op_definition
class AddConstOp(ConstBinaryOp, TopOp):
    name = "top.add_const"


@irdl_op_definition
class SubConstOp(ConstBinaryOp, TopOp):
    name = "top.sub_const"


@irdl_op_definition
class MulConstOp(ConstBinaryOp, TopOp):
    name = "top.mul_const"


@irdl_op_definition
class DivConstOp(ConstBinaryOp, TopOp):
    name = "top.div_const"


class BinaryOp(ShapedOp):
    """Elementwise with numpy broadcasting; both operands share the element type."""

    lhs = operand_def(AnyTensor)
    rhs = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    assembly_format = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs) `->` type($output)"
    ELEMENTWISE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype()}

    def __init__(self, lhs: SSAValue, rhs: SSAValue, *,
                 result_type: TensorType | None = None) -> None:
        self.construct([lhs, rhs], {}, None if result_type is None else [result_type])

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        a, b = operands[0], operands[1]
        assert a is not None and b is not None
        if elem_of(a) != elem_of(b):
            raise VerifyException(
                f"operand element types differ: {elem_of(a)} vs {elem_of(b)}"
            )
        return [tensor(broadcast_shapes(shape_of(a), shape_of(b)), elem_of(a))]

    def flops(self) -> int:
        return numel(shape_of(self.output))


@irdl_op_definition
class AddOp(BinaryOp, TopOp):
    name = "top.add"


@irdl_op_definition
class SubOp(BinaryOp, TopOp):
    name = "top.sub"


@irdl_op_definition
class MulOp(BinaryOp, TopOp):
    name = "top.mul"


@irdl_op_definition
class DivOp(BinaryOp, TopOp):
    name = "top.div"


@irdl_op_definition
class MaxOp(BinaryOp, TopOp):
    name = "top.max"
    KERNEL: ClassVar[str] = "maximum"


@irdl_op_definition
class MinOp(BinaryOp, TopOp):
    name = "top.min"
    KERNEL: ClassVar[str] = "minimum"


class CompareBase(ShapedOp):
    """Elementwise comparison; `predicate` (a `ComparePredicate`) is eq, ne, lt, le, gt or
    ge; result i1."""

    lhs = operand_def(AnyTensor)
    rhs = operand_def(AnyTensor)
    predicate = attr_def(EnumAttr(ComparePredicate))
    output = result_def(AnyTensor)
    assembly_format = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs) `->` type($output)"
    ELEMENTWISE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"predicate": str(self.compare_predicate)}

    def tpu_operand_storage(self) -> list[Storage]:
        """Floats compare in the activation type; integers (and what they compare with)
        as they are."""
        keep = not is_float(elem_of(self.lhs))
        return [Storage.KEEP if keep else Storage.ACTIVATION] * 2

    def __init__(self, lhs: SSAValue, rhs: SSAValue, predicate: ComparePredicate) -> None:
        self.construct([lhs, rhs], {"predicate": ComparePredicate.parse(predicate).attr})

    @property
    def compare_predicate(self) -> ComparePredicate:
        return ComparePredicate.read(self.predicate)

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        a, b = operands[0], operands[1]
        assert a is not None and b is not None
        return [tensor(broadcast_shapes(shape_of(a), shape_of(b)), i1)]

    def flops(self) -> int:
        return numel(shape_of(self.output))


@irdl_op_definition
class CompareOp(CompareBase, TopOp):
    name = "top.compare"


class WhereBase(ShapedOp):
    """cond ? x : y with broadcasting (cond is i1 or nonzero-is-true)."""

    cond = operand_def(AnyTensor)
    lhs = operand_def(AnyTensor)
    rhs = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    assembly_format = (
        "$cond `,` $lhs `,` $rhs attr-dict `:` type($cond) `,` type($lhs) `,` "
        "type($rhs) `->` type($output)"
    )
    ELEMENTWISE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.KEEP, Storage.ACTIVATION, Storage.ACTIVATION]

    def __init__(self, cond: SSAValue, lhs: SSAValue, rhs: SSAValue, *,
                 result_type: TensorType | None = None) -> None:
        self.construct([cond, lhs, rhs], {}, None if result_type is None else [result_type])

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        c, a, b = operands[0], operands[1], operands[2]
        assert c is not None and a is not None and b is not None
        if elem_of(a) != elem_of(b):
            raise VerifyException("top.where branches must share the element type")
        return [tensor(broadcast_shapes(shape_of(c), shape_of(a), shape_of(b)), elem_of(a))]

    def flops(self) -> int:
        return numel(shape_of(self.output))


@irdl_op_definition
class WhereOp(WhereBase, TopOp):
    name = "top.where"


class CastBase(ShapedOp):
    """Element type conversion; the result type names the target."""

    input = operand_def(AnyTensor)
    dtype = attr_def(ElementType)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    ELEMENTWISE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, dtype: Attribute) -> None:
        """Convert `input` to the element type `dtype` (f32, bf16, i32, ...)."""
        self.construct([input], {"dtype": dtype})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        return [tensor(shape_of(x), attrs["dtype"])]


@irdl_op_definition
class CastOp(CastBase, TopOp):
    name = "top.cast"


# =========================================================================== reductions, norms


class SoftmaxBase(UnaryOp):
    axis = attr_def(IntegerAttr)
    FLOPS_PER_ELEMENT: ClassVar[int] = 5
    ELEMENTWISE: ClassVar[bool] = False
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"axis": read_int(self.axis), "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, axis: int, *,
                 result_type: TensorType | None = None) -> None:
        self.construct([input], {"axis": int_value_attr(f"{self.name} axis", axis)},
                       None if result_type is None else [result_type])

    def verify_(self) -> None:
        norm_axis(read_int(self.axis), len(shape_of(self.input)))
        super().verify_()


@irdl_op_definition
class SoftmaxOp(SoftmaxBase, TopOp):
    name = "top.softmax"


class ReduceBase(ShapedOp):
    """Reduce over `axes` with `mode` (a `ReduceMode`) mean, sum, max or min."""

    input = operand_def(AnyTensor)
    mode = attr_def(EnumAttr(ReduceMode))
    axes = attr_def(DenseArrayBase)
    keepdims = attr_def(BOOL_FLAG)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"mode": str(self.reduce_mode), "axes": read_ints(self.axes),
                "keepdims": read_bool(self.keepdims), "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, mode: ReduceMode, axes: Sequence[int],
                 keepdims: bool) -> None:
        if not isinstance(keepdims, bool):
            raise TypeError(f"{self.name} keepdims must be a bool, not {keepdims!r}")
        self.construct([input], {"mode": ReduceMode.parse(mode).attr,
                                 "axes": ints_value_attr(f"{self.name} axes", axes),
                                 "keepdims": bool_attr(keepdims)})

    @property
    def reduce_mode(self) -> ReduceMode:
        return ReduceMode.read(self.mode)

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = shape_of(x)
        axes = {norm_axis(a, len(shape)) for a in read_ints(attrs.get("axes"))}
        keep = read_bool(attrs.get("keepdims"))
        out = [1 if i in axes else d for i, d in enumerate(shape) if keep or i not in axes]
        return [tensor(out, elem_of(x))]

    def flops(self) -> int:
        return numel(shape_of(self.input))


@irdl_op_definition
class ReduceOp(ReduceBase, TopOp):
    name = "top.reduce"


def check_eps(name: str, attrs: Attrs) -> None:
    """A norm's `eps`: a positive, finite float (the verifier of the attribute's type runs
    first; a missing or non-float `eps` is refused there)."""
    eps = attrs.get("eps")
    if isinstance(eps, FloatAttr) and not (math.isfinite(eps.value.data) and eps.value.data > 0):
        raise VerifyException(f"{name} eps is {eps.value.data}; it must be positive and finite")


class RmsNormBase(ShapedOp):
    """x * rsqrt(mean(x^2, last axis) + eps) * weight, accumulated in f32."""

    input = operand_def(AnyTensor)
    weight = opt_operand_def(AnyTensor)
    eps = attr_def(FloatAttr)
    output = result_def(AnyTensor)
    assembly_format = (
        "$input (`weight` $weight^)? attr-dict `:` type($input) (`weight` "
        "type($weight)^)? `->` type($output)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"eps": read_float(self.eps), "out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.F32]

    def __init__(self, input: SSAValue, weight: SSAValue | None, eps: float) -> None:
        self.construct([input, weight], {"eps": float_value_attr(f"{self.name} eps", eps)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, w = operands[0], operands[1] if len(operands) > 1 else None
        assert x is not None
        check_eps(cls.name, attrs)
        if w is not None and shape_of(w)[-1:] != shape_of(x)[-1:]:
            raise VerifyException(
                f"rms_norm weight {list(shape_of(w))} does not match the last axis of "
                f"{list(shape_of(x))}"
            )
        return [tensor(shape_of(x), elem_of(x))]

    def flops(self) -> int:
        return 4 * numel(shape_of(self.input))


@irdl_op_definition
class RmsNormOp(RmsNormBase, TopOp):
    name = "top.rms_norm"


class LayerNormBase(ShapedOp):
    """Normalize over the axes from `axis` to the end; optional affine weight and bias."""

    input = operand_def(AnyTensor)
    weight = opt_operand_def(AnyTensor)
    bias = opt_operand_def(AnyTensor)
    eps = attr_def(FloatAttr)
    axis = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    irdl_options = (AttrSizedOperandSegments(),)
    assembly_format = (
        "$input (`weight` $weight^)? (`bias` $bias^)? attr-dict `:` type($input) "
        "(`weight` type($weight)^)? (`bias` type($bias)^)? `->` type($output)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"eps": read_float(self.eps), "axis": read_int(self.axis),
                "out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.F32, Storage.F32]

    def __init__(self, input: SSAValue, weight: SSAValue | None, bias: SSAValue | None, *,
                 eps: float, axis: int) -> None:
        self.construct([input, weight, bias],
                       {"eps": float_value_attr(f"{self.name} eps", eps),
                        "axis": int_value_attr(f"{self.name} axis", axis)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        check_eps(cls.name, attrs)
        shape = shape_of(x)
        axis = norm_axis(read_int(attrs.get("axis")), len(shape))
        for w in operands[1:]:
            if w is not None and shape_of(w) != shape[axis:]:
                raise VerifyException(
                    f"layer_norm affine shape {list(shape_of(w))} must be {list(shape[axis:])}"
                )
        return [tensor(shape, elem_of(x))]

    def flops(self) -> int:
        return 6 * numel(shape_of(self.input))


@irdl_op_definition
class LayerNormOp(LayerNormBase, TopOp):
    name = "top.layer_norm"


# =========================================================================== LLM ops


class RopeBase(ShapedOp):
    """Rotary position embedding: x * cos + rotate(x) * sin.

    `mode` (a `RopeMode`) "half": rotate(x) = cat(-x[..., D/2:], x[..., :D/2]) (HF
    rotate_half); "interleaved": pairs (x0, x1) -> (-x1, x0). cos/sin broadcast to x.
    """

    input = operand_def(AnyTensor)
    cos = operand_def(AnyTensor)
    sin = operand_def(AnyTensor)
    mode = attr_def(EnumAttr(RopeMode))
    output = result_def(AnyTensor)
    assembly_format = (
        "$input `,` $cos `,` $sin attr-dict `:` type($input) `,` type($cos) `,` "
        "type($sin) `->` type($output)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"mode": str(self.rope_mode), "out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        """x in the activation type; cos/sin as they come (f32 position math)."""
        return [Storage.ACTIVATION, Storage.KEEP, Storage.KEEP]

    def __init__(self, input: SSAValue, cos: SSAValue, sin: SSAValue, mode: RopeMode) -> None:
        self.construct([input, cos, sin], {"mode": RopeMode.parse(mode).attr})

    @property
    def rope_mode(self) -> RopeMode:
        return RopeMode.read(self.mode)

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, c, s = operands[0], operands[1], operands[2]
        assert x is not None and c is not None and s is not None
        shape = shape_of(x)
        if shape[-1] % 2:
            raise VerifyException("rope needs an even last dimension")
        if broadcast_shapes(shape, shape_of(c), shape_of(s)) != shape:
            raise VerifyException(
                f"rope cos/sin {list(shape_of(c))} do not broadcast to x {list(shape)}"
            )
        return [tensor(shape, elem_of(x))]

    def flops(self) -> int:
        return 3 * numel(shape_of(self.input))


@irdl_op_definition
class RopeOp(RopeBase, TopOp):
    name = "top.rope"


class AttentionBase(ShapedOp):
    """Scaled dot-product attention, GQA-native and sequence-major (see module doc)."""

    q = operand_def(AnyTensor)
    k = operand_def(AnyTensor)
    v = operand_def(AnyTensor)
    mask = opt_operand_def(AnyTensor)
    history_k = opt_operand_def(AnyTensor)
    history_v = opt_operand_def(AnyTensor)
    scale = attr_def(FloatAttr)
    q_heads = attr_def(IntegerAttr)
    kv_heads = attr_def(IntegerAttr)
    head_dim = attr_def(IntegerAttr)
    causal = opt_attr_def(BOOL_FLAG)
    output = result_def(AnyTensor)
    irdl_options = (AttrSizedOperandSegments(),)
    assembly_format = (
        "$q `,` $k `,` $v (`mask` $mask^)? (`history` $history_k^ `,` $history_v)? "
        "attr-dict `:` type($q) `,` type($k) `,` type($v) (`mask` type($mask)^)? "
        "(`history` type($history_k)^ `,` type($history_v))? `->` type($output)"
    )
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    TPU_COMPUTES_F32: ClassVar[bool] = True
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("attention_fold",
                                                           "attention_result")

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        q, k, v, mask, history_k, history_v = operands
        return (q, k, v, mask), {"scale": read_float(self.scale), "history_k": history_k,
                                 "history_v": history_v, "causal": read_bool(self.causal),
                                 "out_dtype": self.result_dtype()}

    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """Part `part` of the keys (each part as many as `k` holds)."""
        return operands[:4], {"scale": read_float(self.scale),
                              "first_key": part * shape_of(self.k)[1]}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return operands[:1], {"out_dtype": self.result_dtype()}

    def accumulator_type(self) -> TensorType:
        """The running state per KV head, query head of it and query row: max, sum and
        weighted values, f32 [B, Hkv, Hq / Hkv, Sq, 2 + Dv] (`kernels.OnlineSoftmax`)."""
        b, sq, hq, _ = shape_of(self.q)
        hkv = shape_of(self.k)[2]
        return tensor((b, hkv, hq // hkv, sq, 2 + shape_of(self.v)[3]), f32)

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, mask: SSAValue | None = None,
                 history_k: SSAValue | None = None, history_v: SSAValue | None = None, *,
                 scale: float, q_heads: int, kv_heads: int, head_dim: int,
                 causal: bool = False) -> None:
        what = self.name
        self.construct([q, k, v, mask, history_k, history_v], {
            "scale": float_value_attr(f"{what} scale", scale),
            "q_heads": int_value_attr(f"{what} q_heads", q_heads),
            "kv_heads": int_value_attr(f"{what} kv_heads", kv_heads),
            "head_dim": int_value_attr(f"{what} head_dim", head_dim),
            "causal": flag_value_attr(f"{what} causal", causal)})

    def with_operands(self, q: SSAValue, k: SSAValue, v: SSAValue, mask: SSAValue | None,
                      history_k: SSAValue | None = None, history_v: SSAValue | None = None,
                      *, kv_heads: int | None = None) -> Self:
        """A new attention of this class and parameters over other operands (and, given,
        another number of kv heads)."""
        return type(self)(q, k, v, mask, history_k, history_v, scale=read_float(self.scale),
                          q_heads=read_int(self.q_heads),
                          kv_heads=read_int(self.kv_heads) if kv_heads is None else kv_heads,
                          head_dim=read_int(self.head_dim), causal=read_bool(self.causal))

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        q, k, v = operands[0], operands[1], operands[2]
        mask = operands[3] if len(operands) > 3 else None
        hk = operands[4] if len(operands) > 4 else None
        hv = operands[5] if len(operands) > 5 else None
        assert q is not None and k is not None and v is not None
        qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
        if not len(qs) == len(ks) == len(vs) == 4:
            raise VerifyException("attention q/k/v must be rank 4 [B, S, H, D]")
        b, sq, hq, d = qs
        nq, nkv, hd = (read_int(attrs.get(n)) for n in ("q_heads", "kv_heads", "head_dim"))
        if (hq, d) != (nq, hd) or ks[2] != nkv or vs[2] != nkv or ks[3] != d:
            raise VerifyException(
                f"attention shapes q{list(qs)} k{list(ks)} v{list(vs)} disagree with "
                f"q_heads={nq} kv_heads={nkv} head_dim={hd}"
            )
        if nq % nkv:
            raise VerifyException(f"q_heads {nq} is not a multiple of kv_heads {nkv}")
        if ks[:2] != vs[:2] or ks[0] != b:
            raise VerifyException("attention k and v must share batch and sequence")
        sk = ks[1]
        if (hk is None) != (hv is None):
            raise VerifyException("history_k and history_v come together")
        if hk is not None and hv is not None:
            hks, hvs = shape_of(hk), shape_of(hv)
            if hks[0] != b or hks[2:] != ks[2:] or hvs[2:] != vs[2:] or hks[1] != hvs[1]:
                raise VerifyException(
                    f"history shapes {list(hks)}/{list(hvs)} do not match k/v"
                )
            sk += hks[1]
        if mask is not None:
            ms = shape_of(mask)
            try:
                ok = broadcast_shapes(ms, (b, hq, sq, sk)) == (b, hq, sq, sk)
            except VerifyException:
                ok = False
            if not ok:
                raise VerifyException(
                    f"attention mask {list(ms)} does not broadcast to {[b, hq, sq, sk]}"
                )
        return [tensor((b, sq, hq, vs[3]), elem_of(q))]

    def total_keys(self) -> int:
        n = shape_of(self.k)[1]
        if self.history_k is not None:
            n += shape_of(self.history_k)[1]
        return n

    def flops(self) -> int:
        b, sq, hq, d = shape_of(self.q)
        dv = shape_of(self.v)[3]
        sk = self.total_keys()
        return b * hq * sq * sk * (2 * d + 2 * dv + 5)


@irdl_op_definition
class AttentionOp(AttentionBase, TopOp):
    name = "top.attention"


class MatMulBase(ShapedOp):
    """a @ b (+ bias); `transpose_a`/`transpose_b` swap the last two axes first."""

    lhs = operand_def(AnyTensor)
    rhs = operand_def(AnyTensor)
    bias = opt_operand_def(AnyTensor)
    transpose_a = opt_attr_def(BOOL_FLAG)
    transpose_b = opt_attr_def(BOOL_FLAG)
    output = result_def(AnyTensor)
    assembly_format = (
        "$lhs `,` $rhs (`bias` $bias^)? attr-dict `:` type($lhs) `,` type($rhs) (`bias` "
        "type($bias)^)? `->` type($output)"
    )
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    TPU_COMPUTES_F32: ClassVar[bool] = True
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("matmul_part", "matmul_finish")

    def kernel_params(self) -> dict[str, object]:
        return {"transpose_a": read_bool(self.transpose_a),
                "transpose_b": read_bool(self.transpose_b), "out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        """Activations and weights in the activation type, the bias in f32 (the
        quantized weights of `tpu.a16_matmul` are convert-top-to-tpu's own pattern)."""
        return [Storage.ACTIVATION, Storage.ACTIVATION, Storage.F32]

    def converted_weight(self) -> ConvertedWeight | None:
        """An f16/bf16 `rhs` (a float weight: the lm_head) is upcast at every run."""
        return (ConvertedWeight("f32", (1,)) if dtype_name(elem_of(self.rhs)) in ("f16", "bf16")
                else None)

    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """Part `part` of K: its columns of a and rows of b (without the bias)."""
        return operands[:2], {"transpose_a": read_bool(self.transpose_a),
                              "transpose_b": read_bool(self.transpose_b)}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return operands[2:3], {"out_dtype": self.result_dtype(), "like": operands[0]}

    def __init__(self, lhs: SSAValue, rhs: SSAValue, bias: SSAValue | None = None, *,
                 transpose_a: bool = False, transpose_b: bool = False,
                 result_type: TensorType | None = None) -> None:
        self.construct([lhs, rhs, bias],
                       {"transpose_a": flag_value_attr(f"{self.name} transpose_a", transpose_a),
                        "transpose_b": flag_value_attr(f"{self.name} transpose_b", transpose_b)},
                       None if result_type is None else [result_type])

    @staticmethod
    def mkn(
        a_shape: Sequence[int], b_shape: Sequence[int], ta: bool, tb: bool
    ) -> tuple[tuple[int, ...], int, int, int]:
        if len(a_shape) < 2 or len(b_shape) < 2:
            raise VerifyException("matmul operands must have rank >= 2")
        m, k = (a_shape[-1], a_shape[-2]) if ta else (a_shape[-2], a_shape[-1])
        k2, n = (b_shape[-1], b_shape[-2]) if tb else (b_shape[-2], b_shape[-1])
        if k != k2:
            raise VerifyException(
                f"matmul contraction mismatch: {list(a_shape)} @ {list(b_shape)} "
                f"(transpose_a={ta}, transpose_b={tb})"
            )
        batch = broadcast_shapes(a_shape[:-2], b_shape[:-2])
        return batch, m, k, n

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        a, b = operands[0], operands[1]
        bias = operands[2] if len(operands) > 2 else None
        assert a is not None and b is not None
        ta, tb = read_bool(attrs.get("transpose_a")), read_bool(attrs.get("transpose_b"))
        batch, m, _, n = cls.mkn(shape_of(a), shape_of(b), ta, tb)
        if bias is not None and shape_of(bias) not in ((n,), (1, n)):
            raise VerifyException(f"matmul bias {list(shape_of(bias))} must be [{n}]")
        return [tensor((*batch, m, n), elem_of(a))]

    def flops(self) -> int:
        ta, tb = read_bool(self.transpose_a), read_bool(self.transpose_b)
        batch, m, k, n = self.mkn(shape_of(self.lhs), shape_of(self.rhs), ta, tb)
        return 2 * numel(batch) * m * k * n


@irdl_op_definition
class MatMulOp(MatMulBase, TopOp):
    name = "top.matmul"


class GatherBase(ShapedOp):
    """table.take(indices, axis): embedding lookup is axis 0."""

    table = operand_def(AnyTensor)
    indices = operand_def(AnyTensor)
    axis = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = (
        "$table `,` $indices attr-dict `:` type($table) `,` type($indices) `->` "
        "type($output)"
    )
    INDEXES_TABLE: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"axis": read_int(self.axis)}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.KEEP]

    def __init__(self, table: SSAValue, indices: SSAValue, axis: int) -> None:
        self.construct([table, indices], {"axis": int_value_attr(f"{self.name} axis", axis)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        t, idx = operands[0], operands[1]
        assert t is not None and idx is not None
        ts = shape_of(t)
        axis = norm_axis(read_int(attrs.get("axis")), len(ts))
        if is_float(elem_of(idx)):
            raise VerifyException("gather indices must be integers")
        return [tensor((*ts[:axis], *shape_of(idx), *ts[axis + 1 :]), elem_of(t))]


@irdl_op_definition
class GatherOp(GatherBase, TopOp):
    name = "top.gather"


class TopKBase(ShapedOp):
    """The k largest (or smallest) values along `axis` and their i32 indices, sorted."""

    input = operand_def(AnyTensor)
    k = attr_def(IntegerAttr)
    axis = attr_def(IntegerAttr)
    largest = opt_attr_def(BOOL_FLAG)
    values = result_def(AnyTensor)
    indices = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($values) `,` type($indices)"

    def kernel_params(self) -> dict[str, object]:
        return {"k": read_int(self.k), "axis": read_int(self.axis),
                "largest": read_bool(self.largest, True)}

    def __init__(self, input: SSAValue, k: int, axis: int, *, largest: bool = True) -> None:
        if not isinstance(largest, bool):
            raise TypeError(f"{self.name} largest must be a bool, not {largest!r}")
        self.construct([input], {"k": int_value_attr(f"{self.name} k", k),
                                 "axis": int_value_attr(f"{self.name} axis", axis),
                                 "largest": bool_attr(largest)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = list(shape_of(x))
        axis = norm_axis(read_int(attrs.get("axis")), len(shape))
        k = read_int(attrs.get("k"))
        if not 1 <= k <= shape[axis]:
            raise VerifyException(f"topk k={k} out of range for axis size {shape[axis]}")
        shape[axis] = k
        return [tensor(shape, elem_of(x)), tensor(shape, i32)]

    def flops(self) -> int:
        return numel(shape_of(self.input)) * 2


@irdl_op_definition
class TopKOp(TopKBase, TopOp):
    name = "top.topk"


class ScatterBase(ShapedOp):
    """`input` with `updates` written along `axis` where `indices` say (torch.scatter with a
    source, ONNX ScatterElements): out[..., indices[..., j, ...], ...] = updates[..., j, ...]
    along `axis`; indices and updates have one shape, equal to the input's off `axis`.
    Duplicate indices: one of their updates lands (torch leaves which unspecified; the
    kernel writes them in row-major order, so the last one)."""

    input = operand_def(AnyTensor)
    indices = operand_def(AnyTensor)
    updates = operand_def(AnyTensor)
    axis = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = (
        "$input `,` $indices `,` $updates attr-dict `:` type($input) `,` type($indices) "
        "`,` type($updates) `->` type($output)"
    )

    def kernel_params(self) -> dict[str, object]:
        return {"axis": read_int(self.axis)}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.KEEP, Storage.ACTIVATION]

    def __init__(self, input: SSAValue, indices: SSAValue, updates: SSAValue,
                 axis: int) -> None:
        self.construct([input, indices, updates],
                       {"axis": int_value_attr(f"{self.name} axis", axis)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, idx, upd = operands[0], operands[1], operands[2]
        assert x is not None and idx is not None and upd is not None
        xs, ids, us = shape_of(x), shape_of(idx), shape_of(upd)
        axis = norm_axis(read_int(attrs.get("axis")), len(xs))
        if is_float(elem_of(idx)):
            raise VerifyException("scatter indices must be integers")
        if ids != us:
            raise VerifyException(f"scatter indices {list(ids)} and updates {list(us)} must "
                                  "have one shape")
        if len(ids) != len(xs) or any(a != b for i, (a, b) in enumerate(zip(ids, xs,
                                                                            strict=True))
                                      if i != axis):
            raise VerifyException(f"scatter indices {list(ids)} must match the input "
                                  f"{list(xs)} off axis {axis}")
        if elem_of(upd) != elem_of(x):
            raise VerifyException("scatter updates must have the input's element type")
        return [tensor(xs, elem_of(x))]

    def flops(self) -> int:
        return numel(shape_of(self.updates))


@irdl_op_definition
class ScatterOp(ScatterBase, TopOp):
    name = "top.scatter"


class CumSumBase(ShapedOp):
    """Inclusive prefix sum along `axis`, accumulated in order in f32."""

    input = operand_def(AnyTensor)
    axis = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"axis": read_int(self.axis), "out_dtype": self.result_dtype()}

    def __init__(self, input: SSAValue, axis: int) -> None:
        self.construct([input], {"axis": int_value_attr(f"{self.name} axis", axis)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        norm_axis(read_int(attrs.get("axis")), len(shape_of(x)))
        return [tensor(shape_of(x), elem_of(x))]

    def flops(self) -> int:
        return numel(shape_of(self.input))


@irdl_op_definition
class CumSumOp(CumSumBase, TopOp):
    name = "top.cumsum"


class Conv2dBase(ShapedOp):
    """NCHW 2-D convolution; weight [O, C/groups, kh, kw]; pads [top, left, bottom, right]."""

    input = operand_def(AnyTensor)
    weight = operand_def(AnyTensor)
    bias = opt_operand_def(AnyTensor)
    strides = attr_def(DenseArrayBase)
    pads = attr_def(DenseArrayBase)
    dilations = attr_def(DenseArrayBase)
    groups = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = (
        "$input `,` $weight (`bias` $bias^)? attr-dict `:` type($input) `,` "
        "type($weight) (`bias` type($bias)^)? `->` type($output)"
    )
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"strides": read_ints(self.strides), "pads": read_ints(self.pads),
                "dilations": read_ints(self.dilations), "groups": read_int(self.groups),
                "out_dtype": self.result_dtype()}

    def tpu_operand_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.ACTIVATION, Storage.F32]

    def __init__(self, input: SSAValue, weight: SSAValue, bias: SSAValue | None, *,
                 strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int],
                 groups: int) -> None:
        what = self.name
        self.construct([input, weight, bias], {
            "strides": ints_value_attr(f"{what} strides", strides),
            "pads": ints_value_attr(f"{what} pads", pads),
            "dilations": ints_value_attr(f"{what} dilations", dilations),
            "groups": int_value_attr(f"{what} groups", groups)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, w = operands[0], operands[1]
        assert x is not None and w is not None
        n, c, h, wd = shape_of(x)
        o, cg, kh, kw = shape_of(w)
        sh, sw = read_ints(attrs.get("strides"))
        pt, pl, pb, pr = read_ints(attrs.get("pads"))
        dh, dw = read_ints(attrs.get("dilations"))
        g = read_int(attrs.get("groups"))
        if c != cg * g or o % g:
            raise VerifyException(f"conv2d channels {c} do not match weight {o}x{cg}, groups {g}")
        oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
        ow = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
        if oh <= 0 or ow <= 0:
            raise VerifyException("conv2d output would be empty")
        return [tensor((n, o, oh, ow), elem_of(x))]

    def flops(self) -> int:
        n, o, oh, ow = shape_of(self.output)
        _, cg, kh, kw = shape_of(self.weight)
        return 2 * n * o * oh * ow * cg * kh * kw


@irdl_op_definition
class Conv2dOp(Conv2dBase, TopOp):
    name = "top.conv2d"


# =========================================================================== linear attention


def _check_shape(op: str, what: str, got: Sequence[int], want: Sequence[int]) -> None:
    """VerifyException naming operand `what` of `op` unless its shape is `want`."""
    if tuple(got) != tuple(want):
        raise VerifyException(f"{op} {what} is {list(got)}; it must be {list(want)}")


def _check_float(op: str, what: str, v: SSAValue) -> None:
    if not is_float(elem_of(v)):
        raise VerifyException(f"{op} {what} must be a float tensor, not {elem_of(v)}")


class CausalConv1dBase(ShapedOp):
    """Depthwise causal convolution over the sequence with its state (Gated DeltaNet's
    short conv; `frontends.linear_attention_ops.causal_conv1d` is the definition).

    x [1, T, C], weight [C, K], state [1, K-1, C] (optional: zeros), valid [1, T] (1.0 for
    the real tokens, a prefix, 0.0 for padding) -> y [1, T, C] with
    `y[t, c] = sum_j weight[c, j] * xs[t + j, c]`, `xs = cat(state, x)`, and new_state
    [1, K-1, C] = `xs[n : n + K-1]` (n real tokens): the state the real tokens leave, so a
    padded static chunk continues exactly. y and new_state have x's element type; the
    state is sequence-major like the KV cache.
    """

    x = operand_def(AnyTensor)
    weight = operand_def(AnyTensor)
    state = opt_operand_def(AnyTensor)
    valid = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    new_state = result_def(AnyTensor)
    assembly_format = (
        "$x `,` $weight (`state` $state^)? `valid` $valid attr-dict `:` type($x) `,` "
        "type($weight) (`state` type($state)^)? `valid` type($valid) `->` type($output) "
        "`,` type($new_state)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype(0), "state_dtype": self.result_dtype(1)}

    def tpu_operand_storage(self) -> list[Storage]:
        """The weight [C, K] in f32 in every mode (a depthwise conv's few taps, never
        quantized); x, the state and valid in the activation type."""
        return [Storage.ACTIVATION, Storage.F32, Storage.ACTIVATION, Storage.ACTIVATION]

    def __init__(self, x: SSAValue, weight: SSAValue, state: SSAValue | None,
                 valid: SSAValue) -> None:
        self.construct([x, weight, state, valid], {})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, w, state, valid = operands[:4]
        assert x is not None and w is not None and valid is not None
        name = cls.name
        xs = shape_of(x)
        if len(xs) != 3 or xs[0] != 1:
            raise VerifyException(f"{name} x is {list(xs)}; it must be [1, T, C]")
        _, t, c = xs
        ws = shape_of(w)
        if len(ws) != 2 or ws[0] != c or ws[1] < 1:
            raise VerifyException(f"{name} weight is {list(ws)}; it must be [C, K] = [{c}, K] "
                                  "(one kernel of K >= 1 taps per channel of x)")
        k = ws[1]
        for what, v in (("x", x), ("weight", w), ("valid", valid)):
            _check_float(name, what, v)
        if state is not None:
            _check_shape(name, "state", shape_of(state), (1, k - 1, c))
            _check_float(name, "state", state)
        _check_shape(name, "valid", shape_of(valid), (1, t))
        return [tensor(xs, elem_of(x)), tensor((1, k - 1, c), elem_of(x))]

    @property
    def kernel_size(self) -> int:
        return shape_of(self.weight)[1]

    def flops(self) -> int:
        _, t, c = shape_of(self.x)
        return 2 * t * c * self.kernel_size


@irdl_op_definition
class CausalConv1dOp(CausalConv1dBase, TopOp):
    name = "top.causal_conv1d"


class GatedDeltaRuleBase(ShapedOp):
    """The gated delta rule, recurrent over the tokens in f32 (Gated DeltaNet's linear
    attention; `frontends.linear_attention_ops.gated_delta_rule` is the definition).

    q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta [1, T, Hv], state [1, Hv, Dk, Dv] f32
    (optional: zeros), `scale` -> o [1, T, Hv, Dv] (v's element type), new_state
    [1, Hv, Dk, Dv] f32. Key head h serves value heads h*r .. h*r+r-1 (r = Hv / Hk); per
    token: `S = S * exp(g_t)`, `delta = beta_t * (v_t - k_t S)`, `S = S + k_t^T delta`,
    `o_t = (scale * q_t) S`. A token with g = 0 and beta = 0 leaves S bit for bit.
    """

    q = operand_def(AnyTensor)
    k = operand_def(AnyTensor)
    v = operand_def(AnyTensor)
    g = operand_def(AnyTensor)
    beta = operand_def(AnyTensor)
    state = opt_operand_def(AnyTensor)
    scale = attr_def(FloatAttr)
    output = result_def(AnyTensor)
    new_state = result_def(AnyTensor)
    assembly_format = (
        "$q `,` $k `,` $v `,` $g `,` $beta (`state` $state^)? attr-dict `:` type($q) "
        "`,` type($k) `,` type($v) `,` type($g) `,` type($beta) (`state` "
        "type($state)^)? `->` type($output) `,` type($new_state)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"scale": read_float(self.scale), "out_dtype": self.result_dtype(0)}

    def tpu_operand_storage(self) -> list[Storage]:
        """q, k, v, g, beta in the activation type; the recurrent state f32 in every mode
        (the runtime binds it and new_state to one f32 buffer)."""
        return [*[Storage.ACTIVATION] * 5, Storage.F32]

    def tpu_result_storage(self) -> list[Storage]:
        return [Storage.ACTIVATION, Storage.F32]

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, g: SSAValue, beta: SSAValue,
                 state: SSAValue | None, *, scale: float) -> None:
        self.construct([q, k, v, g, beta, state],
                       {"scale": float_value_attr(f"{self.name} scale", scale)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        q, k, v, g, beta = operands[:5]
        state = operands[5] if len(operands) > 5 else None
        assert q is not None and k is not None and v is not None and g is not None \
            and beta is not None
        name = cls.name
        ks, vs = shape_of(k), shape_of(v)
        if len(ks) != 4 or ks[0] != 1:
            raise VerifyException(f"{name} k is {list(ks)}; it must be [1, T, Hk, Dk]")
        _, t, hk, dk = ks
        _check_shape(name, "q", shape_of(q), ks)
        if len(vs) != 4 or vs[:2] != (1, t):
            raise VerifyException(f"{name} v is {list(vs)}; it must be [1, {t}, Hv, Dv]")
        hv, dv = vs[2], vs[3]
        if hk < 1 or hv % hk:
            raise VerifyException(f"{name} v has {hv} heads, not a multiple of k's {hk} heads")
        _check_shape(name, "g", shape_of(g), (1, t, hv))
        _check_shape(name, "beta", shape_of(beta), (1, t, hv))
        for what, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            _check_float(name, what, x)
        if state is not None:
            _check_shape(name, "state", shape_of(state), (1, hv, dk, dv))
            if dtype_name(elem_of(state)) != "f32":
                raise VerifyException(f"{name} state must be f32 (the recurrent state is "
                                      f"float32 in every mode), not {elem_of(state)}")
        scale = attrs.get("scale")
        if isinstance(scale, FloatAttr) and not math.isfinite(scale.value.data):
            raise VerifyException(f"{name} scale is {scale.value.data}; it must be finite")
        return [tensor(vs, elem_of(v)), tensor((1, hv, dk, dv), f32)]

    def flops(self) -> int:
        _, t, hv, dv = shape_of(self.v)
        dk = shape_of(self.k)[3]
        return 6 * t * hv * dk * dv

    def state_bytes(self) -> int:
        """The bytes of the recurrent state (f32), loaded and stored each run."""
        _, hv, dk, dv = shape_of(self.new_state)
        return 4 * hv * dk * dv


@irdl_op_definition
class GatedDeltaRuleOp(GatedDeltaRuleBase, TopOp):
    name = "top.gated_delta_rule"


# =========================================================================== data movement


class ReshapeBase(ShapedOp):
    input = operand_def(AnyTensor)
    shape = attr_def(DenseArrayBase)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"

    def kernel_params(self) -> dict[str, object]:
        return {"shape": read_ints(self.shape)}

    def __init__(self, input: SSAValue, shape: Sequence[int]) -> None:
        self.construct([input], {"shape": ints_value_attr(f"{self.name} shape", shape)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = read_ints(attrs.get("shape"))
        if any(d < 0 for d in shape) or numel(shape) != numel(shape_of(x)):
            raise VerifyException(f"cannot reshape {list(shape_of(x))} to {shape}")
        return [tensor(shape, elem_of(x))]


@irdl_op_definition
class ReshapeOp(ReshapeBase, TopOp):
    name = "top.reshape"


class PermuteBase(ShapedOp):
    input = operand_def(AnyTensor)
    order = attr_def(DenseArrayBase)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"

    def kernel_params(self) -> dict[str, object]:
        return {"order": read_ints(self.order)}

    def __init__(self, input: SSAValue, order: Sequence[int]) -> None:
        self.construct([input], {"order": ints_value_attr(f"{self.name} order", order)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = shape_of(x)
        order = read_ints(attrs.get("order"))
        if sorted(order) != list(range(len(shape))):
            raise VerifyException(
                f"permute order {order} is not a permutation of rank {len(shape)}"
            )
        return [tensor([shape[i] for i in order], elem_of(x))]


@irdl_op_definition
class PermuteOp(PermuteBase, TopOp):
    name = "top.permute"


class ExpandBase(ShapedOp):
    """Broadcast to `shape` (numpy rules)."""

    input = operand_def(AnyTensor)
    shape = attr_def(DenseArrayBase)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"

    def kernel_params(self) -> dict[str, object]:
        return {"shape": read_ints(self.shape)}

    def __init__(self, input: SSAValue, shape: Sequence[int]) -> None:
        self.construct([input], {"shape": ints_value_attr(f"{self.name} shape", shape)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = tuple(read_ints(attrs.get("shape")))
        if broadcast_shapes(shape_of(x), shape) != shape:
            raise VerifyException(f"cannot expand {list(shape_of(x))} to {list(shape)}")
        return [tensor(shape, elem_of(x))]


@irdl_op_definition
class ExpandOp(ExpandBase, TopOp):
    name = "top.expand"


class ConcatBase(ShapedOp):
    inputs = var_operand_def(AnyTensor)
    axis = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = "$inputs attr-dict `:` type($inputs) `->` type($output)"

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        return [list(operands)], {"axis": read_int(self.axis)}

    def __init__(self, inputs: Sequence[SSAValue], axis: int) -> None:
        self.construct([list(inputs)], {"axis": int_value_attr(f"{self.name} axis", axis)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        xs = [o for o in operands if o is not None]
        if not xs:
            raise VerifyException("concat needs at least one input")
        shapes = [shape_of(x) for x in xs]
        axis = norm_axis(read_int(attrs.get("axis")), len(shapes[0]))
        for s in shapes:
            if len(s) != len(shapes[0]) or any(
                a != b for i, (a, b) in enumerate(zip(s, shapes[0], strict=True)) if i != axis
            ):
                raise VerifyException(f"concat shapes {[list(s) for s in shapes]} disagree")
        if len({elem_of(x) for x in xs}) != 1:
            raise VerifyException("concat inputs must share the element type")
        out = list(shapes[0])
        out[axis] = sum(s[axis] for s in shapes)
        return [tensor(out, elem_of(xs[0]))]


@irdl_op_definition
class ConcatOp(ConcatBase, TopOp):
    name = "top.concat"


class SliceBase(ShapedOp):
    """x[start:end:step] along `axis` (static, in range: nothing is clipped)."""

    input = operand_def(AnyTensor)
    axis = attr_def(IntegerAttr)
    start = attr_def(IntegerAttr)
    end = attr_def(IntegerAttr)
    step = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    KERNEL: ClassVar[str] = "slice_"

    def kernel_params(self) -> dict[str, object]:
        return {"axis": norm_axis(read_int(self.axis), len(shape_of(self.input))),
                "start": read_int(self.start), "end": read_int(self.end),
                "step": read_int(self.step)}

    def __init__(self, input: SSAValue, axis: int, start: int, end: int, step: int = 1) -> None:
        what = self.name
        self.construct([input], {"axis": int_value_attr(f"{what} axis", axis),
                                 "start": int_value_attr(f"{what} start", start),
                                 "end": int_value_attr(f"{what} end", end),
                                 "step": int_value_attr(f"{what} step", step)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        shape = list(shape_of(x))
        axis = norm_axis(read_int(attrs.get("axis")), len(shape))
        start, end, step = (read_int(attrs.get(n)) for n in ("start", "end", "step"))
        if not (0 <= start <= end <= shape[axis]) or step < 1:
            raise VerifyException(
                f"slice [{start}:{end}:{step}] out of range for axis {axis} of size {shape[axis]}"
            )
        shape[axis] = (end - start + step - 1) // step
        return [tensor(shape, elem_of(x))]


@irdl_op_definition
class SliceOp(SliceBase, TopOp):
    name = "top.slice"


Top = Dialect(
    "top",
    [
        WeightOp,
        ConstantOp,
        *UNARY_ELEMENTWISE,
        GeluOp,
        PowOp,
        AddConstOp,
        SubConstOp,
        MulConstOp,
        DivConstOp,
        AddOp,
        SubOp,
        MulOp,
        DivOp,
        MaxOp,
        MinOp,
        CompareOp,
        WhereOp,
        CastOp,
        SoftmaxOp,
        ReduceOp,
        RmsNormOp,
        LayerNormOp,
        RopeOp,
        AttentionOp,
        MatMulOp,
        GatherOp,
        TopKOp,
        ScatterOp,
        CumSumOp,
        Conv2dOp,
        CausalConv1dOp,
        GatedDeltaRuleOp,
        ReshapeOp,
        PermuteOp,
        ExpandOp,
        ConcatOp,
        SliceOp,
    ],
    [],
)
