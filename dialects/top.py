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
from typing import TYPE_CHECKING, ClassVar, Self

import numpy as np
from xdsl.dialects.builtin import (
    AffineMapAttr,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    FloatAttr,
    IndexType,
    IntegerAttr,
    IntegerType,
    Signedness,
    StringAttr,
    TensorType,
    f32,
    f64,
    i1,
    i32,
    i64,
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
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.canonicalization import (
    CanonicalizationPatterns,
    attributes_of,
    named_like,
    producer,
    sibling_op,
)
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
    f64_attr,
    flag_value_attr,
    float_value_attr,
    i64_array,
    i64_attr,
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
from toptpu.dialects.linalg_interface import (
    LinalgLowering,
    LinalgLoweringError,
    Shape,
    amap,
    broadcast_map,
    broadcast_results,
    common_type,
    compute_type,
    const,
    dim,
    identity,
    identity_of,
    op_where,
    reduced_map,
)
from toptpu.dialects.slicing_interface import (
    Misaligned,
    RowRule,
    SliceKind,
    activation_rows,
    aligned_axis,
    broadcast_row_rule,
    same_rows,
    token_axis,
    weight_reduction_axes,
)

if TYPE_CHECKING:
    from toptpu.dialects.linalg_builder import Body, Emitter

Operands = Sequence[SSAValue | None]
Attrs = Mapping[str, Attribute]


class TopOp(ShapedOp, LinalgLowering):
    """Base class of Top compute ops (all pure; each lowers to linalg: `LinalgLowering`)."""

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

    GLOBAL_SOURCE: ClassVar[bool] = True

    LINALG_NOT_LOWERED: ClassVar[str | None] = (
        "a weight becomes an argument of its function (convert-top-to-linalg's "
        "weights_to_arguments), not an op")


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

    GLOBAL_SOURCE: ClassVar[bool] = True

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """An `arith.constant` of the value (booleans stored as i8)."""
        value = self.value
        assert isinstance(value, DenseIntOrFPElementsAttr)
        return e.constant(value)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """One broadcasting generic around the op's scalar body (`linalg_scalar`), in f32
        for a float storage type other than f32 and f64 (and for integers)."""
        out = elem_of(self.output)
        ct = compute_type(out) if is_float(out) else f32
        return e.elementwise([self.input], shape_of(self.output), out, lambda b: b.convert(
            self.linalg_scalar(b, b.convert(b.args[0], ct)), out))

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        """The op on one element `x` (of its compute type); each elementwise op declares
        its own."""
        raise LinalgLoweringError(f"{op_where(self)}: {self.name} declares no scalar body "
                                  "(linalg_scalar)")


@irdl_op_definition
class RsqrtOp(UnaryOp, TopOp):
    name = "top.rsqrt"
    FLOPS_PER_ELEMENT: ClassVar[int] = 2

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("rsqrt", x)


@irdl_op_definition
class SqrtOp(UnaryOp, TopOp):
    name = "top.sqrt"

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("sqrt", x)


@irdl_op_definition
class ExpOp(UnaryOp, TopOp):
    name = "top.exp"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("exp", x)


@irdl_op_definition
class CosOp(UnaryOp, TopOp):
    name = "top.cos"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("cos", x)


@irdl_op_definition
class SinOp(UnaryOp, TopOp):
    name = "top.sin"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("sin", x)


@irdl_op_definition
class TanhOp(UnaryOp, TopOp):
    name = "top.tanh"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.math("tanh", x)


@irdl_op_definition
class SigmoidOp(UnaryOp, TopOp):
    name = "top.sigmoid"
    FLOPS_PER_ELEMENT: ClassVar[int] = 4

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        one = b.const(1.0, x.type)
        return b.div(one, b.add(one, b.math("exp", b.neg(x))))


@irdl_op_definition
class SiluOp(UnaryOp, TopOp):
    name = "top.silu"
    FLOPS_PER_ELEMENT: ClassVar[int] = 5

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        one = b.const(1.0, x.type)
        return b.div(x, b.add(one, b.math("exp", b.neg(x))))


@irdl_op_definition
class ReluOp(UnaryOp, TopOp):
    """max(x, 0)."""

    name = "top.relu"

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.binary("max", x, b.const(0.0, x.type))


@irdl_op_definition
class SoftplusOp(UnaryOp, TopOp):
    """log(1 + exp(x)), and x itself above 20 (torch's F.softplus with beta 1 and threshold
    20, where log1p(exp(x)) equals x in f32 anyway); Gated DeltaNet's decay uses it."""

    name = "top.softplus"
    FLOPS_PER_ELEMENT: ClassVar[int] = 5
    TPU_COMPUTES_F32: ClassVar[bool] = True  # it feeds the delta rule's decay (f32)

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        big = b.cmp("gt", x, b.const(20.0, x.type))  # x itself above the threshold 20
        return b.select(big, x, b.math("log1p", b.math("exp", x)))


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

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        t = x.type
        one = b.const(1.0, t)
        half = b.const(0.5, t)
        if self.approximation == GeluApproximation.TANH:
            k = b.const(math.sqrt(2.0 / math.pi), t)
            x3 = b.mul(b.mul(x, x), x)
            inner = b.mul(k, b.add(x, b.mul(b.const(0.044715, t), x3)))
            return b.mul(b.mul(half, x), b.add(one, b.math("tanh", inner)))
        erf = b.math("erf", b.mul(x, b.const(1.0 / math.sqrt(2.0), t)))
        return b.mul(b.mul(half, x), b.add(one, erf))


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

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        exponent = read_float(self.exponent)
        if exponent == 2.0:
            return b.mul(x, x)
        return b.powf(x, b.const(exponent, x.type))


@irdl_op_definition
class PowOp(PowBase, TopOp):
    name = "top.pow"


class ClampBase(UnaryOp):
    """torch.clamp: max(x, min), then min(that, max), each bound optional (at least one
    given, neither NaN). A NaN element stays NaN; with min > max every element is max.
    Floats and signed integers (whose bounds are integers); the result is an element of x
    or a bound, so nothing is computed but the rounding of a bound to the element type."""

    min_value = opt_attr_def(FloatAttr, attr_name="min")
    max_value = opt_attr_def(FloatAttr, attr_name="max")

    def __init__(self, input: SSAValue, min: float | None = None, max: float | None = None,
                 *, result_type: TensorType | None = None) -> None:
        self.construct([input], {
            "min": None if min is None else float_value_attr(f"{self.name} min", min),
            "max": None if max is None else float_value_attr(f"{self.name} max", max)},
            None if result_type is None else [result_type])

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """(min, max), None where the bound is not given."""
        return (None if self.min_value is None else read_float(self.min_value),
                None if self.max_value is None else read_float(self.max_value))

    def kernel_params(self) -> dict[str, object]:
        lower, upper = self.bounds
        return {"min": lower, "max": upper, "out_dtype": self.result_dtype()}

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        elem = elem_of(x)
        bounds = [a.value.data for k in ("min", "max")
                  if isinstance(a := attrs.get(k), FloatAttr)]
        if not bounds:
            raise VerifyException(f"{cls.name} has neither a min nor a max")
        if any(math.isnan(v) for v in bounds):
            raise VerifyException(f"{cls.name} bound is NaN; give a number")
        if isinstance(elem, IntegerType):
            if elem.width.data == 1 or elem.signedness.data == Signedness.UNSIGNED:
                raise VerifyException(f"{cls.name} takes a float or signed integer tensor, "
                                      f"not {elem}")
            top_value = 2 ** (elem.width.data - 1)
            if not all(float(v).is_integer() and -top_value <= v < top_value for v in bounds):
                raise VerifyException(f"{cls.name} of an {elem} tensor has {elem} bounds, "
                                      f"not {bounds}")
        return [tensor(shape_of(x), elem)]

    def flops(self) -> int:
        return numel(shape_of(self.output)) * sum(v is not None for v in self.bounds)

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """A clamp of a clamp is one clamp."""
        return (ComposeClamps(),)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """One elementwise generic; f16/bf16 clamp in f32, other types in their own (an
        integer exactly, as its kernel)."""
        out = elem_of(self.output)
        ct = compute_type(out)
        return e.elementwise([self.input], shape_of(self.output), out, lambda b: b.convert(
            self.linalg_scalar(b, b.convert(b.args[0], ct)), out))

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        lower, upper = self.bounds
        if lower is not None:
            x = b.binary("max", x, b.const(lower, x.type))  # NaN-propagating, as torch
        if upper is not None:
            x = b.binary("min", x, b.const(upper, x.type))
        return x


@irdl_op_definition
class ClampOp(ClampBase, TopOp):
    name = "top.clamp"


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

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """x*1, x+0, x-0, x/1 are x; (x*a)*b is x*(a*b)."""
        return (FoldIdentityScalarOp(), ComposeScalarMuls())

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        kind = self.op_kind().removesuffix("_const")
        out = elem_of(self.output)
        # float tensors compute in f32; integer tensors with a float scalar in f64 (numpy)
        ct = compute_type(out) if is_float(out) else f64
        value = read_float(self.value)
        reverse = read_bool(self.reverse)

        def body(b: Body) -> SSAValue:
            x, c = b.convert(b.args[0], ct), b.const(value, ct)
            a, y = (c, x) if reverse else (x, c)
            return b.convert(b.binary(kind, a, y), out)

        return e.elementwise([self.input], shape_of(self.output), out, body)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """One broadcasting generic around the op's scalar body (`linalg_scalar`), in f32
        for f16/bf16 storage."""
        out = elem_of(self.output)
        ct = compute_type(out)
        return e.elementwise([self.lhs, self.rhs], shape_of(self.output), out,
                             lambda b: b.convert(self.linalg_scalar(
                                 b, b.convert(b.args[0], ct), b.convert(b.args[1], ct)), out))

    def linalg_scalar(self, b: Body, x: SSAValue, y: SSAValue) -> SSAValue:
        """The op on one pair of elements (of its compute type): the arith op of its kind
        (add, sub, mul, div, max, min)."""
        return b.binary(self.op_kind(), x, y)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        pred = self.compare_predicate
        ct = common_type(elem_of(self.lhs), elem_of(self.rhs))
        return e.elementwise([self.lhs, self.rhs], shape_of(self.output), i1, lambda b: b.cmp(
            pred, b.convert(b.args[0], ct), b.convert(b.args[1], ct)))


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        out = elem_of(self.output)
        return e.elementwise([self.cond, self.lhs, self.rhs], shape_of(self.output), out,
                             lambda b: b.select(b.convert(b.args[0], i1), b.args[1], b.args[2]))


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """A cast to the input's own type is its input."""
        return (FoldNoOpShapeOp(),)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        out = elem_of(self.output)
        return e.elementwise([self.input], shape_of(self.output), out,
                             lambda b: b.convert(b.args[0], out))


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_int(self.axis) % len(shape_of(self.output)) == axis:
            return None  # the rows are what it normalizes over
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x = self.input
        shape = shape_of(x)
        axis = norm_axis(read_int(self.axis), len(shape))
        out = elem_of(self.output)
        ct = compute_type(out)
        full = identity(len(shape))
        red = reduced_map(len(shape), [axis], False)
        mx = e.reduce([(x, full)], shape, [axis], False, ct, -math.inf,
                      lambda b, acc: b.binary("max", acc, b.compute(b.args[0])))
        sm = e.reduce([(x, full), (mx, red)], shape, [axis], False, ct, 0.0,
                      lambda b, acc: b.add(acc, b.math("exp", b.sub(b.compute(b.args[0]),
                                                                     b.args[1]))))
        return e.map([(x, full), (mx, red), (sm, red)], shape, out, lambda b: b.convert(
            b.div(b.math("exp", b.sub(b.compute(b.args[0]), b.args[1])), b.args[2]), out))


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

    def row_rule(self, axis: int) -> RowRule | None:
        axes = {x % len(shape_of(self.input)) for x in read_ints(self.axes)}
        if axis in axes or not read_bool(self.keepdims):
            return None
        return RowRule((axis,), (axis,))

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x = self.input
        shape = shape_of(x)
        mode = self.reduce_mode
        axes = sorted({norm_axis(a, len(shape)) for a in read_ints(self.axes)})
        keep = read_bool(self.keepdims)
        out = elem_of(self.output)
        if mode == ReduceMode.MEAN and not is_float(out):
            raise LinalgLoweringError(f"{op_where(self)}: mean of integers is not lowered")
        ct = compute_type(out)
        if is_float(ct):
            init = {ReduceMode.MEAN: 0.0, ReduceMode.SUM: 0.0, ReduceMode.MAX: -math.inf,
                    ReduceMode.MIN: math.inf}[mode]
        else:
            w = ct.width.data if isinstance(ct, IntegerType) else 64
            init = {ReduceMode.SUM: 0, ReduceMode.MAX: -(2 ** (w - 1)),
                    ReduceMode.MIN: 2 ** (w - 1) - 1}[mode]
        kind = {ReduceMode.MEAN: "add", ReduceMode.SUM: "add", ReduceMode.MAX: "max",
                ReduceMode.MIN: "min"}[mode]
        acc = e.reduce([(x, identity(len(shape)))], shape, axes, keep, ct, init,
                       lambda b, a: b.binary(kind, a, b.compute(b.args[0])))
        n = numel([shape[a] for a in axes])
        if mode == ReduceMode.MEAN:
            return e.elementwise([acc], shape_of(self.output), out, lambda b: b.convert(
                b.div(b.args[0], b.const(float(n), ct)), out))
        return e.convert(acc, out)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x, w = self.input, self.weight
        shape = shape_of(x)
        r = len(shape)
        out = elem_of(self.output)
        ct = compute_type(out)
        eps, n = read_float(self.eps), shape[-1]
        full = identity(r)
        ss = e.reduce([(x, full)], shape, [r - 1], False, ct, 0.0,
                      lambda b, acc: b.add(acc, b.mul(b.compute(b.args[0]),
                                                      b.compute(b.args[0]))))
        ins = [(x, full), (ss, reduced_map(r, [r - 1], False))]
        if w is not None:
            ins.append((w, broadcast_map(shape_of(w), shape)))

        def body(b: Body) -> SSAValue:
            mean = b.div(b.args[1], b.const(float(n), ct))
            inv = b.math("rsqrt", b.add(mean, b.const(eps, ct)))
            y = b.mul(b.compute(b.args[0]), inv)
            if w is not None:
                y = b.mul(y, b.convert(b.args[2], ct))
            return b.convert(y, out)

        return e.map(ins, shape, out, body)


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_int(self.axis) % len(shape_of(self.output)) <= axis:
            return None  # the rows are among the axes it normalizes over
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x, w, bias = self.input, self.weight, self.bias
        shape = shape_of(x)
        r = len(shape)
        axis = norm_axis(read_int(self.axis), r)
        axes = list(range(axis, r))
        out = elem_of(self.output)
        ct = compute_type(out)
        eps, n = read_float(self.eps), numel(shape[axis:])
        full, red = identity(r), reduced_map(r, axes, False)
        s = e.reduce([(x, full)], shape, axes, False, ct, 0.0,
                     lambda b, acc: b.add(acc, b.compute(b.args[0])))

        def centered(b: Body) -> SSAValue:
            return b.sub(b.compute(b.args[0]), b.div(b.args[1], b.const(float(n), ct)))

        v = e.reduce([(x, full), (s, red)], shape, axes, False, ct, 0.0,
                     lambda b, acc: b.add(acc, b.mul(centered(b), centered(b))))
        ins = [(x, full), (s, red), (v, red)]
        if w is not None:
            ins.append((w, broadcast_map(shape_of(w), shape)))
        if bias is not None:
            ins.append((bias, broadcast_map(shape_of(bias), shape)))

        def body(b: Body) -> SSAValue:
            var = b.div(b.args[2], b.const(float(n), ct))
            y = b.div(centered(b), b.math("sqrt", b.add(var, b.const(eps, ct))))
            k = 3
            if w is not None:
                y = b.mul(y, b.convert(b.args[k], ct))
                k += 1
            if bias is not None:
                y = b.add(y, b.convert(b.args[k], ct))
            return b.convert(y, out)

        return e.map(ins, shape, out, body)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return broadcast_row_rule(self, axis)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x, cos, sin = self.input, self.cos, self.sin
        shape = shape_of(x)
        r, dd = len(shape), shape[-1]
        mode = self.rope_mode
        out = elem_of(self.output)
        ct = compute_type(out)
        ins = [(x, identity(r)), (cos, broadcast_map(shape_of(cos), shape)),
               (sin, broadcast_map(shape_of(sin), shape))]

        def body(b: Body) -> SSAValue:
            idx = [b.index(i) for i in range(r)]
            last = idx[-1]
            if mode == RopeMode.HALF:
                h = b.idx(dd // 2)
                first = b.cmp("lt", last, h)  # rotate_half: [-x2, x1]
                partner = b.select(first, b.add(last, h), b.sub(last, h))
            else:
                even = b.cmp("eq", b.and_(last, b.idx(1)), b.idx(0))
                partner = b.xor(last, b.idx(1))  # pairs (x0, x1) -> (-x1, x0)
                first = even
            other = b.compute(b.extract(x, [*idx[:-1], partner]))
            rot = b.select(first, b.neg(other), other)
            xv = b.compute(b.args[0])
            y = b.add(b.mul(xv, b.convert(b.args[1], ct)), b.mul(rot, b.convert(b.args[2], ct)))
            return b.convert(y, out)

        return e.map(ins, shape, out, body)


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

    HEADS_UNIT: ClassVar[str] = "KV-head"

    def row_rule(self, axis: int) -> RowRule | None:
        """Query rows (axis 1), keys and values whole, the mask by its rows when it has
        them; not causal (a causal mask's diagonal depends on the row)."""
        if axis != 1 or read_bool(self.causal):
            return None
        out = shape_of(self.output)
        axes: list[int | None] = [1]
        for i, v in enumerate(self.operands[1:], start=1):
            if self.mask is not None and v is self.mask and i == 3:
                ms = shape_of(v)
                axes.append(2 if ms[2] == out[1] and ms[2] > 1 else None)
            else:
                axes.append(None)
        return RowRule(tuple(axes), (1,))

    def heads_count(self) -> int:
        """KV heads, each with its query heads."""
        return read_int(self.kv_heads)

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        """q, k, v and history along their head axis (2), the mask along its head axis
        (1) when it has one per query head, else whole."""
        return tuple((1 if shape_of(v)[1] > 1 else None) if v is self.mask else 2
                     for v in self.operands)

    def heads_result_axes(self) -> tuple[int, ...]:
        return (2,)

    def tile_loop(self) -> SliceKind:
        """Query rows times KV-head groups."""
        return SliceKind.HEADS

    def reduction_sliceable(self) -> bool:
        """Its keys, without history, not causal, the mask with a column per key or one
        for all."""
        return (self.history_k is None and not read_bool(self.causal)
                and (self.mask is None or shape_of(self.mask)[-1] in (1, shape_of(self.k)[1])))

    def reduction_count(self) -> int:
        return shape_of(self.k)[1]

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        """Keys and values along their sequence (1), the mask along its last axis when it
        has a column per key; the queries whole."""
        axes: list[int | None] = []
        for i, v in enumerate(self.operands):
            if v is self.mask and i == 3:
                ms = shape_of(v)
                axes.append(len(ms) - 1 if ms[-1] > 1 else None)
            else:
                axes.append(None if v is self.q else 1)
        return tuple(axes)

    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        """A slice of 1/`heads` of the KV heads has as many fewer query heads."""
        if heads == 1:
            return {}
        return {"q_heads": i64_attr(read_int(self.q_heads) // heads),
                "kv_heads": i64_attr(read_int(self.kv_heads) // heads)}

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        q, k, v = self.q, self.k, self.v
        bsz, sq, hq, dh = shape_of(q)
        hkv = shape_of(k)[2]
        dv = shape_of(v)[3]
        rep = hq // hkv
        scale = read_float(self.scale)
        causal = read_bool(self.causal)
        out = elem_of(self.output)
        ct = compute_type(out)
        parts: list[tuple[SSAValue, SSAValue]] = []
        if self.history_k is not None and self.history_v is not None:
            parts.append((self.history_k, self.history_v))
        parts.append((k, v))
        total = sum(shape_of(kk)[1] for kk, _ in parts)
        mask = self.mask
        mask_shape = shape_of(mask) if mask is not None else ()

        # 1. scores per part, [B, Hq, Sq, S_p]: scale * q.k + mask, causal -inf
        scores: list[SSAValue] = []
        off = 0
        for kk, _ in parts:
            sp = shape_of(kk)[1]
            shp = (bsz, hq, sq, sp)
            dot = e.generic(
                [(q, amap(5, [dim(0), dim(2), dim(1), dim(4)])),
                 (kk, amap(5, [dim(0), dim(3), dim(1) // rep, dim(4)]))],
                e.fill(shp, ct, 0.0), amap(5, [dim(0), dim(1), dim(2), dim(3)]),
                ["parallel"] * 4 + ["reduction"],
                lambda b: b.add(b.args[2], b.mul(b.compute(b.args[0]), b.compute(b.args[1]))))
            ins = [(dot, identity(4))]

            def body(b: Body, off: int = off) -> SSAValue:
                s = b.mul(b.args[0], b.const(scale, ct))
                if mask is not None:
                    # mask [.., Sh + Sk] broadcasts to [B, Hq, Sq, total]: read it by index
                    idx = [b.index(i) for i in range(4)]
                    idx[3] = b.add(idx[3], b.idx(off))
                    lead = 4 - len(mask_shape)
                    at = [idx[lead + i] if n != 1 else b.idx(0) for i, n in enumerate(mask_shape)]
                    s = b.add(s, b.convert(b.extract(mask, at), ct))
                if causal:
                    key = b.add(b.index(3), b.idx(off))
                    limit = b.add(b.index(2), b.idx(total - sq))
                    s = b.select(b.cmp("gt", key, limit), b.const(-math.inf, ct), s)
                return s

            scores.append(e.map(ins, shp, ct, body))
            off += sp

        # 2. row maximum and sum of exponentials over all parts (history first)
        row = amap(4, [dim(0), dim(1), dim(2)])
        mx: float | SSAValue = -math.inf
        for s in scores:
            mx = e.reduce([(s, identity(4))], shape_of(s), [3], False, ct, mx,
                          lambda b, acc: b.binary("max", acc, b.args[0]))
        assert isinstance(mx, SSAValue)
        sm: float | SSAValue = 0.0
        for s in scores:
            sm = e.reduce([(s, identity(4)), (mx, row)], shape_of(s), [3], False, ct, sm,
                          lambda b, acc: b.add(acc, b.math("exp", b.sub(b.args[0], b.args[1]))))
        assert isinstance(sm, SSAValue)

        # 3. weighted values, [B, Sq, Hq, Dv], loop dims (b, i, h, e, j)
        acc = e.fill((bsz, sq, hq, dv), ct, 0.0)
        for s, (_, vv) in zip(scores, parts, strict=True):
            acc = e.generic(
                [(s, amap(5, [dim(0), dim(2), dim(1), dim(4)])),
                 (mx, amap(5, [dim(0), dim(2), dim(1)])),
                 (vv, amap(5, [dim(0), dim(4), dim(2) // rep, dim(3)]))],
                acc, amap(5, [dim(0), dim(1), dim(2), dim(3)]), ["parallel"] * 4 + ["reduction"],
                lambda b: b.add(b.args[3], b.mul(b.math("exp", b.sub(b.args[0], b.args[1])),
                                                 b.compute(b.args[2]))))
        return e.map([(acc, identity(4)), (sm, amap(4, [dim(0), dim(2), dim(1)]))],
                     (bsz, sq, hq, dv), out,
                     lambda b: b.convert(b.div(b.args[0], b.args[1]), out))


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_bool(self.transpose_a) or len(shape_of(self.rhs)) != 2:
            return None
        return activation_rows(self, axis)

    def col_sliceable(self) -> bool:
        """A right operand that is a 2-D weight [N, K] (transpose_b)."""
        return (isinstance(self.rhs.owner, WeightBase) and read_bool(self.transpose_b)
                and not read_bool(self.transpose_a) and len(shape_of(self.rhs)) == 2)

    def reduction_sliceable(self) -> bool:
        """A float weight matmul: its K."""
        return self.col_sliceable() and is_float(elem_of(self.lhs)) and is_float(
            elem_of(self.rhs))

    def reduction_count(self) -> int:
        return shape_of(self.lhs)[-1]

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        return weight_reduction_axes(self)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        a, bm, bias = self.lhs, self.rhs, self.bias
        ta, tb = read_bool(self.transpose_a), read_bool(self.transpose_b)
        sa, sb = shape_of(a), shape_of(bm)
        out_shape = shape_of(self.output)
        out = elem_of(self.output)
        ct = compute_type(out)
        nb = len(out_shape) - 2
        batch = out_shape[:nb]
        m_, n_, k_ = nb, nb + 1, nb + 2  # loop dims: batch..., m, n, k
        ndims = nb + 3

        def operand_map(s: Shape, rows: int, cols: int) -> AffineMapAttr:
            res = broadcast_results(s[:-2], list(range(nb)), batch) if nb else []
            return amap(ndims, [*res, dim(rows), dim(cols)])

        a_map = operand_map(sa, k_, m_) if ta else operand_map(sa, m_, k_)
        b_map = operand_map(sb, n_, k_) if tb else operand_map(sb, k_, n_)
        if bias is not None:
            init = e.elementwise([bias], out_shape, ct, lambda b: b.compute(b.args[0]))
        else:
            init = e.fill(out_shape, ct, 0.0 if is_float(ct) else 0)
        acc = e.generic([(a, a_map), (bm, b_map)], init,
                        amap(ndims, [dim(i) for i in range(nb + 2)]),
                        ["parallel"] * (nb + 2) + ["reduction"],
                        lambda b: b.add(b.args[2], b.mul(b.compute(b.args[0]),
                                                         b.compute(b.args[1]))))
        return e.convert(acc, out)


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

    def row_rule(self, axis: int) -> RowRule | None:
        """An embedding lookup (axis 0) by the rows of its indices; the table whole (read
        row by row, `row_gather_table`)."""
        if read_int(self.axis) != 0 or axis >= len(shape_of(self.indices)):
            return None
        return RowRule((None, axis), (axis,))

    def row_gather_table(self) -> SSAValue | None:
        return self.table

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        table, idx = self.table, self.indices
        ts, isz = shape_of(table), shape_of(idx)
        axis = norm_axis(read_int(self.axis), len(ts))
        out_shape = shape_of(self.output)
        out = elem_of(self.output)
        r = len(out_shape)
        ni = len(isz)
        idx_map = amap(r, [dim(axis + i) for i in range(ni)])

        def body(b: Body) -> SSAValue:
            i = b.convert(b.args[0], IndexType())
            n = ts[axis]
            ok = b.and_(b.cmp("ge", i, b.idx(0)), b.cmp("lt", i, b.idx(n)))
            pos = b.clamp(i, 0, n - 1)
            before = [b.index(d) for d in range(axis)]
            after = [b.index(d) for d in range(axis + ni, r)]
            val = b.extract(table, [*before, pos, *after])
            if is_float(out):  # an out-of-range index reads NaN, never a neighbour's row
                return b.select(ok, val, b.const(math.nan, out))
            return val

        return e.map([(idx, idx_map)], out_shape, out, body)


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_int(self.axis) % len(shape_of(self.values)) == axis:
            return None
        return same_rows(self, axis)

    def lower_to_linalg(self, e: Emitter) -> list[SSAValue]:
        """k = 1 (argmax / argmin): one reduction carrying the best value and its index; ties
        keep the lowest index, like the interpreter. Larger k (a sort) is not lowered."""
        k = read_int(self.k)
        if k != 1:
            raise LinalgLoweringError(f"{op_where(self)}: only k = 1 (argmax/argmin) is "
                                      f"lowered, not k = {k} (sorting has no linalg form)")
        x = self.input
        shape = shape_of(x)
        r = len(shape)
        axis = norm_axis(read_int(self.axis), r)
        largest = read_bool(self.largest, True)
        val_elem, idx_elem = elem_of(self.values), elem_of(self.indices)
        ct = compute_type(val_elem)
        out_shape = shape_of(self.values)
        if is_float(ct):
            worst: float | int = -math.inf if largest else math.inf
        else:
            w = ct.width.data if isinstance(ct, IntegerType) else 64
            worst = -(2 ** (w - 1)) if largest else 2 ** (w - 1) - 1
        red = reduced_map(r, [axis], True)
        init_v = e.fill(out_shape, ct, worst)
        init_i = e.fill(out_shape, idx_elem, 0)

        def body(b: Body) -> list[SSAValue]:
            xv, best, best_i = b.compute(b.args[0]), b.args[1], b.args[2]
            better = b.cmp("gt" if largest else "lt", xv, best)
            i = b.index_cast(b.index(axis), idx_elem)
            return [b.select(better, xv, best), b.select(better, i, best_i)]

        val, idx = e.generic_n([(x, identity(r))], [(init_v, red), (init_i, red)],
                               ["reduction" if d == axis else "parallel" for d in range(r)],
                               body)
        return [e.convert(val, val_elem), idx]


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

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """The input, then each update in order where its index names the position (a
        reduction over the updates: the last one for a position lands, like the kernel; an
        index out of range writes nothing)."""
        x, idx, upd = self.input, self.indices, self.updates
        r = len(shape_of(x))
        axis = norm_axis(read_int(self.axis), r)
        u_map = amap(r + 1, [dim(r) if d == axis else dim(d) for d in range(r)])

        def body(b: Body) -> SSAValue:
            hit = b.cmp("eq", b.convert(b.args[0], IndexType()), b.index(axis))
            return b.select(hit, b.args[1], b.args[2])

        return e.generic([(idx, u_map), (upd, u_map)], x, identity_of(r, r + 1),
                         ["parallel"] * r + ["reduction"], body)


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

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """out[..., i, ...] = sum of x[..., j, ...] for j <= i along the axis: a reduction over
        a second loop j that adds only where j <= i, in order of j (f32, like the kernel)."""
        x = self.input
        shape = shape_of(x)
        r = len(shape)
        axis = norm_axis(read_int(self.axis), r)
        out = elem_of(self.output)
        ct = compute_type(out)
        x_map = amap(r + 1, [dim(r) if d == axis else dim(d) for d in range(r)])

        def body(b: Body) -> SSAValue:
            acc = b.args[1]
            keep = b.cmp("le", b.index(r), b.index(axis))
            return b.select(keep, b.add(acc, b.compute(b.args[0])), acc)

        acc = e.generic([(x, x_map)], e.fill(shape, ct, 0), identity_of(r, r + 1),
                        ["parallel"] * r + ["reduction"], body)
        return e.convert(acc, out)


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

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        x, w, bias = self.input, self.weight, self.bias
        _, _, h, wd = shape_of(x)
        o, cg, kh, kw = shape_of(w)
        sh, sw = read_ints(self.strides)
        pt, pl, _, _ = read_ints(self.pads)
        dh, dw = read_ints(self.dilations)
        g = read_int(self.groups)
        og = o // g
        out_shape = shape_of(self.output)
        out = elem_of(self.output)
        ct = compute_type(out)
        if bias is not None:
            init = e.map([(bias, amap(4, [dim(1)]))], out_shape, ct,
                         lambda b: b.compute(b.args[0]))
        else:
            init = e.fill(out_shape, ct, 0.0)

        # loop dims (n, o, oh, ow, c, i, j); padding reads zero
        def body(b: Body) -> SSAValue:
            on, oo, oy, ox, ci, ki, kj = (b.index(d) for d in range(7))
            chan = b.add(b.mul(b.div(oo, b.idx(og)), b.idx(cg)), ci)
            y = b.sub(b.add(b.mul(oy, b.idx(sh)), b.mul(ki, b.idx(dh))), b.idx(pt))
            xx = b.sub(b.add(b.mul(ox, b.idx(sw)), b.mul(kj, b.idx(dw))), b.idx(pl))
            inside = b.and_(b.and_(b.cmp("ge", y, b.idx(0)), b.cmp("lt", y, b.idx(h))),
                            b.and_(b.cmp("ge", xx, b.idx(0)), b.cmp("lt", xx, b.idx(wd))))
            val = b.compute(b.extract(x, [on, chan, b.clamp(y, 0, h - 1),
                                          b.clamp(xx, 0, wd - 1)]))
            val = b.select(inside, val, b.const(0.0, ct))
            return b.add(b.args[1], b.mul(val, b.compute(b.args[0])))

        acc = e.generic([(w, amap(7, [dim(1), dim(4), dim(5), dim(6)]))], init,
                        amap(7, [dim(0), dim(1), dim(2), dim(3)]),
                        ["parallel"] * 4 + ["reduction"] * 3, body)
        return e.convert(acc, out)


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

    HEADS_UNIT: ClassVar[str] = "channel"

    def heads_count(self) -> int:
        """Its channels (independent)."""
        return shape_of(self.x)[2]

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        """Input and state along their channel axis (2), taps along theirs (0), the valid
        flags whole."""
        return tuple(None if v is self.valid else 0 if v is self.weight else 2
                     for v in self.operands)

    def heads_result_axes(self) -> tuple[int, ...]:
        return (2, 2)

    def lower_to_linalg(self, e: Emitter) -> list[SSAValue]:
        """y[t, c] = sum_j w[c, j] * xs[t + j, c] over `xs = cat(state, x)` (read by index:
        positions before K-1 from the state, rounded to x's type as the kernel does, or zero
        without one), the taps summed in order in f32; new_state[i] = xs[n + i] with n the
        number of real tokens, counted from `valid` by a reduction (a prefix of ones)."""
        x, w, state, valid = self.x, self.weight, self.state, self.valid
        _, t, c = shape_of(x)
        k = shape_of(w)[1]
        xe = elem_of(x)
        ct = compute_type(elem_of(self.output))

        def xs_at(b: Body, pos: SSAValue, ch: SSAValue) -> SSAValue:
            """xs[pos, ch] in f32 (pos in [0, K-1+T))."""
            from_x = b.compute(b.extract(
                x, [b.idx(0), b.clamp(b.sub(pos, b.idx(k - 1)), 0, t - 1), ch]))
            if k == 1:
                return from_x
            if state is None:
                from_state = b.const(0.0, ct)
            else:
                s = b.extract(state, [b.idx(0), b.clamp(pos, 0, k - 2), ch])
                from_state = b.compute(b.convert(s, xe))
            return b.select(b.cmp("lt", pos, b.idx(k - 1)), from_state, from_x)

        # y: loop dims (0, t, c, j), reduction over the taps j
        def tap(b: Body) -> SSAValue:
            pos = b.add(b.index(1), b.index(3))
            return b.add(b.args[1], b.mul(xs_at(b, pos, b.index(2)), b.compute(b.args[0])))

        acc = e.generic([(w, amap(4, [dim(2), dim(3)]))], e.fill((1, t, c), ct, 0.0),
                        amap(4, [dim(0), dim(1), dim(2)]), ["parallel"] * 3 + ["reduction"], tap)
        y = e.convert(acc, elem_of(self.output))
        # n = the number of real tokens (valid > 0), [1, 1] i64
        n = e.reduce([(valid, identity(2))], (1, t), [1], True, i64, 0, lambda b, a: b.add(
            a, b.select(b.cmp("gt", b.compute(b.args[0]), b.const(0.0, compute_type(
                elem_of(valid)))), b.const(1, i64), b.const(0, i64))))
        state_elem = elem_of(self.new_state)

        def carried(b: Body) -> SSAValue:
            pos = b.add(b.convert(b.args[0], IndexType()), b.index(1))
            return b.convert(xs_at(b, pos, b.index(2)), state_elem)

        new_state = e.map([(n, amap(3, [const(0), const(0)]))], (1, k - 1, c), state_elem,
                          carried)
        return [y, new_state]


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

    HEADS_UNIT: ClassVar[str] = "key-head"

    def heads_count(self) -> int:
        """Its key heads, each with its value heads."""
        return shape_of(self.k)[2]

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        """q, k, v, g, beta along their head axis (2), the state along its value-head axis
        (1)."""
        return tuple(1 if v is self.state else 2 for v in self.operands)

    def heads_result_axes(self) -> tuple[int, ...]:
        return (2, 1)

    def lower_to_linalg(self, e: Emitter) -> list[SSAValue]:
        """An `scf.for` over the tokens carrying the state [1, Hv, Dk, Dv] f32 and the output
        [1, T, Hv, Dv] f32 as iter_args; per token t (read by index; key head h // r for value
        head h): S = S * exp(g_t); kv = k_t S (sum over Dk in order); S = S + k_t^T (beta_t *
        (v_t - kv)); o_t = (scale * q_t) S, inserted as row t. The output rounds to v's type
        after the loop."""
        q, k, v, g, beta, state = self.q, self.k, self.v, self.g, self.beta, self.state
        _, t, hk, dk = shape_of(k)
        _, _, hv, dv = shape_of(v)
        r = hv // hk
        scale = read_float(self.scale)
        s_shape = (1, hv, dk, dv)
        s0 = e.fill(s_shape, f32, 0.0) if state is None else e.convert(state, f32)
        o0 = e.empty((1, t, hv, dv), f32)

        def step(inner: Emitter, i: SSAValue, carried: Sequence[SSAValue]) -> list[SSAValue]:
            s, o = carried

            def at(b: Body, x: SSAValue, *rest: SSAValue) -> SSAValue:
                """x[0, i, rest...] in f32."""
                return b.compute(b.extract(x, [b.idx(0), i, *rest]))

            # loop dims of the state: (0, h, a, d) with a over Dk and d over Dv; the state is
            # updated in place (each generic writes the tensor it reads element by element),
            # so the loop yields what it was given (one-shot bufferization wants them
            # equivalent)
            all_parallel = ["parallel"] * 4
            decayed = inner.generic([], s, identity(4), all_parallel, lambda b: b.mul(
                b.args[0], b.math("exp", at(b, g, b.index(1)))))

            def key_head(b: Body) -> SSAValue:
                """The key head of the loop's value head (loop dim 1)."""
                return b.div(b.index(1), b.idx(r))

            # kv [1, Hv, 1, Dv]: loop dims (0, h, a, d), a reduced
            kv = inner.reduce([(decayed, identity(4))], s_shape, [2], True, f32, 0.0,
                              lambda b, acc: b.add(acc, b.mul(at(b, k, key_head(b), b.index(2)),
                                                              b.args[0])))

            def update(b: Body) -> SSAValue:
                h, a, d = b.index(1), b.index(2), b.index(3)
                delta = b.mul(b.sub(at(b, v, h, d), b.args[0]), at(b, beta, h))
                return b.add(b.args[1], b.mul(at(b, k, key_head(b), a), delta))

            updated = inner.generic([(kv, amap(4, [const(0), dim(1), const(0), dim(3)]))],
                                    decayed, identity(4), all_parallel, update)

            def read_out(b: Body, acc: SSAValue) -> SSAValue:
                qs = b.mul(at(b, q, key_head(b), b.index(2)), b.const(scale, f32))
                return b.add(acc, b.mul(qs, b.args[0]))

            # o_t [1, 1, Hv, Dv]: loop dims (0, h, a, d), a reduced
            row = inner.generic([(updated, identity(4))], inner.fill((1, 1, hv, dv), f32, 0.0),
                                amap(4, [dim(0), const(0), dim(1), dim(3)]),
                                ["parallel", "parallel", "reduction", "parallel"],
                                lambda b: read_out(b, b.args[1]))
            placed = inner.insert_slice(row, o, [0, i, 0, 0], [1, 1, hv, dv])
            return [updated, placed]

        new_state, out = e.for_loop(t, [s0, o0], step)
        return [e.convert(out, elem_of(self.output)), new_state]


@irdl_op_definition
class GatedDeltaRuleOp(GatedDeltaRuleBase, TopOp):
    name = "top.gated_delta_rule"


# =========================================================================== mixture of experts


class MoeRouteBase(ShapedOp):
    """The router of a sparse mixture-of-experts block after its linear
    (`frontends.moe_ops.moe_route` is the definition): router logits [T, E] and optionally
    `valid` [T] (1.0 for a real token, 0.0 for a padded row of a static chunk) -> routing
    weights [T, k] (the logits' element type) and expert indices i32 [T, k].

    Per token: `p = softmax(logits)` in f32, the k largest in descending order (ties: the
    lower expert index first), divided by their sum when `normalize` (`norm_topk_prob`),
    rounded to the logits' type. A row with `valid` <= 0 routes nowhere: indices -1,
    weights 0 (`top.moe_experts` adds nothing for it).
    """

    logits = operand_def(AnyTensor)
    valid = opt_operand_def(AnyTensor)
    k = attr_def(IntegerAttr)
    normalize = opt_attr_def(BOOL_FLAG)
    weights = result_def(AnyTensor)
    indices = result_def(AnyTensor)
    assembly_format = (
        "$logits (`valid` $valid^)? attr-dict `:` type($logits) (`valid` type($valid)^)? "
        "`->` type($weights) `,` type($indices)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True
    FLOAT_PRODUCER: ClassVar[bool] = True

    def kernel_params(self) -> dict[str, object]:
        return {"k": read_int(self.k), "normalize": read_bool(self.normalize),
                "out_dtype": self.result_dtype(0)}

    def __init__(self, logits: SSAValue, valid: SSAValue | None, *, k: int,
                 normalize: bool) -> None:
        self.construct([logits, valid], {
            "k": int_value_attr(f"{self.name} k", k),
            "normalize": flag_value_attr(f"{self.name} normalize", normalize)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        logits = operands[0]
        valid = operands[1] if len(operands) > 1 else None
        assert logits is not None
        name = cls.name
        ls = shape_of(logits)
        if len(ls) != 2:
            raise VerifyException(f"{name} logits is {list(ls)}; it must be [T, E] (a row of "
                                  "router logits per token)")
        t, e = ls
        _check_float(name, "logits", logits)
        k = read_int(attrs.get("k"))
        if not 1 <= k <= e:
            raise VerifyException(f"{name} k is {k}; it must be from 1 to the {e} experts")
        if valid is not None:
            _check_shape(name, "valid", shape_of(valid), (t,))
            _check_float(name, "valid", valid)
        return [tensor((t, k), elem_of(logits)), tensor((t, k), i32)]

    def flops(self) -> int:
        t, e = shape_of(self.logits)
        k = read_int(self.k)
        return 5 * t * e + t * e * k + 2 * t * k  # softmax, the k picks, the renormalization

    def row_rule(self, axis: int) -> RowRule | None:
        """Tokens are independent: every operand and result by its rows (axis 0)."""
        if axis != 0:
            return None
        return RowRule(tuple(0 for _ in self.operands), (0, 0))

    def lower_to_linalg(self, e: Emitter) -> list[SSAValue]:
        """The softmax over the experts in f32 (max, sum of exponentials, quotient); each
        expert's rank in its row (how many experts have a larger probability, or an equal
        one at a lower index: a reduction over a second expert loop); slot j takes the
        expert of rank j (index and probability: a reduction over the experts selecting
        it); the renormalization divides by the slots' sum; a row whose `valid` is not
        > 0 gets index -1 and weight 0."""
        logits, valid = self.logits, self.valid
        t, n = shape_of(logits)
        k = read_int(self.k)
        out = elem_of(self.weights)
        idx_elem = elem_of(self.indices)
        mx = e.reduce([(logits, identity(2))], (t, n), [1], False, f32, -math.inf,
                      lambda b, acc: b.binary("max", acc, b.compute(b.args[0])))
        row = amap(2, [dim(0)])
        sm = e.reduce([(logits, identity(2)), (mx, row)], (t, n), [1], False, f32, 0.0,
                      lambda b, acc: b.add(acc, b.math("exp", b.sub(b.compute(b.args[0]),
                                                                     b.args[1]))))
        probs = e.map([(logits, identity(2)), (mx, row), (sm, row)], (t, n), f32,
                      lambda b: b.div(b.math("exp", b.sub(b.compute(b.args[0]), b.args[1])),
                                      b.args[2]))

        def before(b: Body, acc: SSAValue) -> SSAValue:
            """Loop dims (t, e, e2): does expert e2 rank before expert e?"""
            other, mine = b.args[0], b.args[1]
            ahead = b.cmp("gt", other, mine)
            tie_lower = b.and_(b.cmp("eq", other, mine), b.cmp("lt", b.index(2), b.index(1)))
            one = b.select(b.or_(ahead, tie_lower), b.const(1, i64), b.const(0, i64))
            return b.add(acc, one)

        rank = e.reduce([(probs, amap(3, [dim(0), dim(2)])), (probs, amap(3, [dim(0), dim(1)]))],
                        (t, n, n), [2], False, i64, 0, before)
        slot_map = amap(3, [dim(0), dim(1)])  # loop dims (t, j, e), e reduced

        def pick(b: Body) -> list[SSAValue]:
            r, p, best_i, best_p = b.args[0], b.args[1], b.args[2], b.args[3]
            hit = b.cmp("eq", r, b.index_cast(b.index(1), i64))
            return [b.select(hit, b.index_cast(b.index(2), idx_elem), best_i),
                    b.select(hit, p, best_p)]

        chosen, top_p = e.generic_n(
            [(rank, amap(3, [dim(0), dim(2)])), (probs, amap(3, [dim(0), dim(2)]))],
            [(e.fill((t, k), idx_elem, 0), slot_map), (e.fill((t, k), f32, 0.0), slot_map)],
            ["parallel", "parallel", "reduction"], pick)
        if read_bool(self.normalize):
            total = e.reduce([(top_p, identity(2))], (t, k), [1], False, f32, 0.0,
                             lambda b, acc: b.add(acc, b.args[0]))
            top_p = e.map([(top_p, identity(2)), (total, row)], (t, k), f32,
                          lambda b: b.div(b.args[0], b.args[1]))
        if valid is None:
            return [e.convert(top_p, out), chosen]
        vt = compute_type(elem_of(valid))

        def real(b: Body) -> SSAValue:
            return b.cmp("gt", b.compute(b.args[0]), b.const(0.0, vt))

        weights = e.map([(valid, row), (top_p, identity(2))], (t, k), out, lambda b: b.convert(
            b.select(real(b), b.args[1], b.const(0.0, f32)), out))
        indices = e.map([(valid, row), (chosen, identity(2))], (t, k), idx_elem,
                        lambda b: b.select(real(b), b.args[1], b.const(-1, idx_elem)))
        return [weights, indices]


@irdl_op_definition
class MoeRouteOp(MoeRouteBase, TopOp):
    name = "top.moe_route"


class MoeExpertsBase(ShapedOp):
    """The experts of a sparse mixture-of-experts block (`frontends.moe_ops.moe_experts`
    is the definition): x [T, H], the experts' weights stacked by expert — `gate` [E, I, H]
    and `up` [E, I, H] (each expert's gate and up projections: the halves of transformers'
    fused `gate_up_proj`, the hub layout's per-expert `gate_proj`/`up_proj` stacked) and
    `down` [E, H, I] — the routing `weights` [T, k] (float) and `indices` [T, k]
    (integers) -> y [T, H] (x's element type).

    `y[t] = sum over j of weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t])`,
    `e = indices[t, j]`: each token's weighted sum of its k experts' SwiGLU MLPs, exact (no
    capacity: no token dropped). An index of -1 adds nothing (a padded row routed nowhere
    by `top.moe_route`); any other index outside [0, E) is an error. The contributions
    are added in f32, expert by expert in ascending order, then rounded.

    The sum over the intermediate axis I is separable (SwiGLU is elementwise over I): a
    layer group may cut it in reduction parts — each part its I/P rows of every expert's
    gate and up and columns of its down, folded into an f32 accumulator — so an op whose
    experts do not fit local memory streams them through it.

    `fetched_from` (inside a layer group only: `tpu.load` `by_index` into buffers of the
    fetched experts): the indices range over that many experts E, and gate, up and down
    hold S < E rows, the experts the indices name in ascending order in their first rows
    (`fetched_rows_needed`: S is at least min(E, the entries of the indices), so every
    chosen expert has its row — no token dropped).

    `expert_blocks` P (inside a layer group only, with `fetched_from`: the expert-major
    schedule): the group's reduction parts are blocks of E/P consecutive experts instead
    of parts of I; part p holds experts [p E/P, (p+1) E/P) — those the indices name, each
    loaded once for the rows of the tile — and adds only theirs. The blocks fold into one
    f32 accumulator in ascending order: each token's experts are added in the whole op's
    order (the same bits).
    """

    x = operand_def(AnyTensor)
    gate = operand_def(AnyTensor)
    up = operand_def(AnyTensor)
    down = operand_def(AnyTensor)
    weights = operand_def(AnyTensor)
    indices = operand_def(AnyTensor)
    fetched_from = opt_attr_def(IntegerAttr)
    expert_blocks = opt_attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    assembly_format = (
        "$x `,` $gate `,` $up `,` $down `,` $weights `,` $indices attr-dict `:` type($x) `,` "
        "type($gate) `,` type($up) `,` type($down) `,` type($weights) `,` type($indices) "
        "`->` type($output)"
    )
    TPU_COMPUTES_F32: ClassVar[bool] = True
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("moe_experts_part",
                                                           "moe_experts_finish")

    def kernel_params(self) -> dict[str, object]:
        return {"out_dtype": self.result_dtype(), **fetched_param(self.fetched_from)}

    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """Part `part` of I: every operand (gate, up and down cut to the part's rows); or
        with `expert_blocks`, block `part` of the experts."""
        return operands, {**fetched_param(self.fetched_from),
                          **expert_block_param(self.fetched_from, self.expert_blocks, part)}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return (), {"out_dtype": self.result_dtype(), "like": operands[0]}

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, down: SSAValue,
                 weights: SSAValue, indices: SSAValue) -> None:
        self.construct([x, gate, up, down, weights, indices], {})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, gate, up, down, weights, indices = operands[:6]
        assert x is not None and gate is not None and up is not None and down is not None \
            and weights is not None and indices is not None
        name = cls.name
        xs = shape_of(x)
        if len(xs) != 2:
            raise VerifyException(f"{name} x is {list(xs)}; it must be [T, H] (a row per token)")
        t, h = xs
        gs = shape_of(gate)
        if len(gs) != 3 or gs[2] != h:
            raise VerifyException(f"{name} gate is {list(gs)}; it must be [E, I, {h}] (each "
                                  "expert's gate projection, stacked)")
        e, inter = gs[0], gs[1]
        _check_shape(name, "up", shape_of(up), (e, inter, h))
        _check_shape(name, "down", shape_of(down), (e, h, inter))
        ws = shape_of(weights)
        check_fetched_rows(name, e, shape_of(indices), attrs.get("fetched_from"),
                           attrs.get("expert_blocks"))
        if len(ws) != 2 or ws[0] != t or ws[1] < 1:
            raise VerifyException(f"{name} weights is {list(ws)}; it must be [{t}, k] with k "
                                  "at least 1")
        _check_shape(name, "indices", shape_of(indices), ws)
        for what, v in (("x", x), ("gate", gate), ("up", up), ("down", down),
                        ("weights", weights)):
            _check_float(name, what, v)
        if is_float(elem_of(indices)):
            raise VerifyException(f"{name} indices must be integers, not {elem_of(indices)}")
        return [tensor(xs, elem_of(x))]

    @property
    def experts(self) -> int:
        return shape_of(self.gate)[0]

    @property
    def top_k(self) -> int:
        return shape_of(self.weights)[1]

    @property
    def intermediate(self) -> int:
        return shape_of(self.gate)[1]

    def flops(self) -> int:
        """The k experts each token computes (at most the E the op holds: an expert
        parallel device's local op may take a k above its E, the slots naming other
        devices' experts -1): its gate, up and down products (2 FLOPs a MAC), silu and the
        gating product, the weighted sum."""
        t, h = shape_of(self.x)
        i = self.intermediate
        return t * min(self.top_k, self.experts) * (2 * h * 2 * i + 2 * i * h + 6 * i + 2 * h)

    def row_rule(self, axis: int) -> RowRule | None:
        """Tokens are independent: x, the weights, the indices and y by rows (axis 0), the
        experts' weights whole."""
        if axis != 0:
            return None
        return RowRule((0, None, None, None, 0, 0), (0,))

    def tile_loop(self) -> SliceKind:
        """Tiles are row blocks times reduction parts: the second loop is a heads loop of
        one unit (no output channel of y is computed apart from the others)."""
        return SliceKind.HEADS

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        """The one unit of the second tile loop cuts nothing."""
        return (None,) * 6

    def heads_result_axes(self) -> tuple[int, ...]:
        return (1,)

    def reduction_sliceable(self) -> bool:
        """Float experts: their intermediate axis."""
        return all(is_float(elem_of(v)) for v in (self.x, self.gate, self.up, self.down))

    def reduction_count(self) -> int:
        return self.intermediate

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        """gate and up along their rows (1), down along its columns (2); the rest whole."""
        return (None, 1, 1, 2, None, None)

    def fetched_by_index(self) -> dict[int, int]:
        """gate, up and down: only the experts the indices name are read (an expert
        nobody chose is never fetched)."""
        return {1: 5, 2: 5, 3: 5}

    def expert_block_axes(self) -> tuple[int | None, ...] | None:
        """Blocks of experts: gate, up and down along E (0); the rest whole."""
        return (None, 0, 0, 0, None, None)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """Dense over each token's k slots, the expert's weights read by index (clamped
        into range; a slot of index -1 is weighted 0): gate and up [T, k, I] (reductions
        over H), silu(gate) * up, down [T, k, H] (a reduction over I), then the weighted
        sum over the slots [T, H]."""
        x, gate, up, down, weights, indices = (self.x, self.gate, self.up, self.down,
                                               self.weights, self.indices)
        t, h = shape_of(x)
        n, k, inter = self.experts, self.top_k, self.intermediate
        out = elem_of(self.output)

        def expert(b: Body) -> SSAValue:
            """The clamped expert index of the loop's slot (block arg 1: the index)."""
            return b.clamp(b.convert(b.args[1], IndexType()), 0, n - 1)

        def project(w: SSAValue) -> SSAValue:
            """[T, k, I]: loop dims (t, j, r, c), r over I, c over H reduced."""
            return e.generic(
                [(x, amap(4, [dim(0), dim(3)])), (indices, amap(4, [dim(0), dim(1)]))],
                e.fill((t, k, inter), f32, 0.0), amap(4, [dim(0), dim(1), dim(2)]),
                ["parallel", "parallel", "parallel", "reduction"],
                lambda b: b.add(b.args[2], b.mul(b.compute(b.args[0]), b.compute(b.extract(
                    w, [expert(b), b.index(2), b.index(3)])))))

        g_proj, u_proj = project(gate), project(up)
        slots = amap(3, [dim(0), dim(1), dim(2)])

        def gated(b: Body) -> SSAValue:
            g, u = b.args[0], b.args[1]
            sig = b.div(b.const(1.0, f32), b.add(b.const(1.0, f32),
                                                  b.math("exp", b.neg(g))))
            return b.mul(b.mul(g, sig), u)

        act = e.map([(g_proj, slots), (u_proj, slots)], (t, k, inter), f32, gated)
        # loop dims (t, j, o, i): o over H, i over I reduced
        slot_out = e.generic(
            [(act, amap(4, [dim(0), dim(1), dim(3)])), (indices, amap(4, [dim(0), dim(1)]))],
            e.fill((t, k, h), f32, 0.0), amap(4, [dim(0), dim(1), dim(2)]),
            ["parallel", "parallel", "parallel", "reduction"],
            lambda b: b.add(b.args[2], b.mul(b.args[0], b.compute(b.extract(
                down, [expert(b), b.index(2), b.index(3)])))))
        it = elem_of(indices)

        def weighted(b: Body, acc: SSAValue) -> SSAValue:
            y, w, i = b.args[0], b.compute(b.args[1]), b.args[2]
            w = b.select(b.cmp("ge", i, b.const(0, it)), w, b.const(0.0, f32))
            return b.add(acc, b.mul(w, y))

        # loop dims (t, o, j): j reduced
        total = e.reduce([(slot_out, amap(3, [dim(0), dim(2), dim(1)])),
                          (weights, amap(3, [dim(0), dim(2)])),
                          (indices, amap(3, [dim(0), dim(2)]))],
                         (t, h, k), [2], False, f32, 0.0, weighted)
        return e.convert(total, out)


def fetched_rows_needed(experts: int, indices_shape: Sequence[int]) -> int:
    """The rows a buffer of fetched experts needs (`MoeExpertsBase.fetched_from`): the
    distinct experts indices of `indices_shape` ([T, k]) can name, min(E, T x k)."""
    return min(experts, numel(indices_shape))


def fetched_param(attr: Attribute | None) -> dict[str, object]:
    """The experts kernels' `fetched_from` keyword (none when the op holds every expert)."""
    return {} if attr is None else {"fetched_from": read_int(attr)}


def expert_block_param(fetched_from: Attribute | None, blocks: Attribute | None, part: int
                       ) -> dict[str, object]:
    """The experts part kernels' `block` keyword of reduction part `part` of an op with
    `expert_blocks` P (first expert, experts a block): block `part` mod P (the parts of a
    group with parts of I too: `tpu.GroupOp.part_blocks`), none without."""
    if blocks is None or fetched_from is None:
        return {}
    count = read_int(fetched_from) // read_int(blocks)
    return {"block": (part % read_int(blocks) * count, count)}


def check_fetched_rows(name: str, held: int, indices_shape: Sequence[int],
                       attr: Attribute | None, blocks: Attribute | None = None) -> None:
    """An experts op's weights holding `held` rows of the experts its `fetched_from`
    attribute names hold fewer than all of them and at least every expert the indices can
    name (no chosen expert without its row); with `expert_blocks` P, of a block's E/P
    experts (at most E/P, at least what the indices can name of them)."""
    if blocks is not None:
        if not isinstance(blocks, IntegerAttr) or attr is None:
            raise VerifyException(f"{name} expert_blocks must be an integer, with "
                                  "fetched_from")
        p = read_int(blocks)
        if p < 2 or not isinstance(attr, IntegerAttr) or read_int(attr) % p:
            raise VerifyException(f"{name} expert_blocks {p} must divide its experts "
                                  "(fetched_from) in blocks, at least 2")
        count = read_int(attr) // p
        need = fetched_rows_needed(count, indices_shape)
        if len(indices_shape) != 2 or not need <= held <= count:
            raise VerifyException(f"{name} holds {held} rows of a block of {count} experts "
                                  f"(expert_blocks {p}); its indices {list(indices_shape)} "
                                  f"can name {need}: it must hold from {need} to {count}")
        return
    if attr is None:
        return
    if not isinstance(attr, IntegerAttr):
        raise VerifyException(f"{name} fetched_from must be an integer")
    n = read_int(attr)
    if len(indices_shape) != 2:
        raise VerifyException(f"{name} indices are {list(indices_shape)}; they must be [T, k]")
    need = fetched_rows_needed(n, indices_shape)
    if not need <= held < n:
        raise VerifyException(f"{name} holds {held} of its {n} experts (fetched_from); its "
                              f"indices {list(indices_shape)} can name {need}: it must hold "
                              f"from {need} to {n - 1}")


@irdl_op_definition
class MoeExpertsOp(MoeExpertsBase, TopOp):
    name = "top.moe_experts"


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

    def row_rule(self, axis: int) -> RowRule | None:
        """The same rows, or rows merged with the axes after them ([1, T, H, D] -> [T*H,
        D]) or split back: with equal leading axes, a block of rows along one is a block of
        rows along the other (the slice count divides both: layer-group checks)."""
        ins, out = shape_of(self.input), shape_of(self.output)
        a = token_axis(ins)
        if a is None:
            return None
        if math.prod(ins[:a]) == math.prod(out[:axis]) and (
                ins[a] == out[axis] or max(ins[a], out[axis]) % min(ins[a], out[axis]) == 0):
            return RowRule((a,), (axis,))
        return None

    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        return {"shape": i64_array(shape_of(result_types[0]))}

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """A reshape to its input's shape is its input; reshapes of reshapes compose."""
        return (FoldNoOpReshape(), ComposeReshapes())

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """collapse_shape to 1-D, then expand_shape to the target (MLIR folds the pair where
        a direct reassociation exists); rank 0 uses the empty reassociation."""
        x = self.input
        src, dst = shape_of(x), shape_of(self.output)
        if src == dst:
            return x

        if not src:
            return e.expand_shape(x, [], dst)
        if not dst:
            return e.collapse_shape(x, [], dst)
        flat = x if len(src) == 1 else e.collapse_shape(x, [list(range(len(src)))],
                                                        (numel(src),))
        return flat if len(dst) == 1 else e.expand_shape(flat, [list(range(len(dst)))], dst)


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

    def row_rule(self, axis: int) -> RowRule | None:
        return RowRule((read_ints(self.order)[axis],), (axis,))

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """The identity order is its input; permutes of permutes compose; a permute
        moving only unit axes is a reshape."""
        return (FoldNoOpPermute(), ComposePermutes(), PermuteOfUnitAxesIsReshape())

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        order = read_ints(self.order)
        r = len(order)
        inv = [order.index(j) for j in range(r)]  # input axis j is output axis inv[j]
        return e.map([(self.input, amap(r, [dim(inv[j]) for j in range(r)]))],
                     shape_of(self.output), elem_of(self.output), lambda b: b.args[0])


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

    def row_rule(self, axis: int) -> RowRule | None:
        a = aligned_axis(shape_of(self.input), shape_of(self.output), axis)
        if a is None or isinstance(a, Misaligned):
            return None  # rows broadcast: every slice would read the same input
        return RowRule((a,), (axis,))

    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        return {"shape": i64_array(shape_of(result_types[0]))}

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """An expand to its input's shape is its input."""
        return (FoldNoOpShapeOp(),)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        return e.elementwise([self.input], shape_of(self.output), elem_of(self.output),
                             lambda b: b.args[0])


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_int(self.axis) % len(shape_of(self.output)) == axis:
            return None
        return same_rows(self, axis)

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """A concat of one input is that input."""
        return (FoldSingleConcat(),)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        xs = list(self.inputs)
        out_shape = shape_of(self.output)
        r = len(out_shape)
        axis = norm_axis(read_int(self.axis), r)
        offsets, o = [], 0
        for x in xs:
            offsets.append(o)
            o += shape_of(x)[axis]

        def body(b: Body) -> SSAValue:
            idx = [b.index(i) for i in range(r)]

            def read(k: int) -> SSAValue:
                n = shape_of(xs[k])[axis]
                local = b.clamp(b.sub(idx[axis], b.idx(offsets[k])), 0, n - 1)
                return b.extract(xs[k], [*idx[:axis], local, *idx[axis + 1:]])

            val = read(len(xs) - 1)
            for k in range(len(xs) - 2, -1, -1):
                val = b.select(b.cmp("lt", idx[axis], b.idx(offsets[k + 1])), read(k), val)
            return val

        return e.map([], out_shape, elem_of(self.output), body)


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

    def row_rule(self, axis: int) -> RowRule | None:
        if read_int(self.axis) % len(shape_of(self.output)) == axis:
            return None
        return same_rows(self, axis)

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        """A slice of the whole axis is its input."""
        return (FoldNoOpShapeOp(),)

    def lower_to_linalg(self, e: Emitter) -> SSAValue:
        """out[..., j, ...] = x[..., start + j * step, ...] (an extract: an indexing map that
        reads a larger operand with a pure loop dimension would redefine that loop's range)."""
        x = self.input
        r = len(shape_of(x))
        axis = norm_axis(read_int(self.axis), r)
        start, step = read_int(self.start), read_int(self.step)

        def body(b: Body) -> SSAValue:
            idx = [b.index(i) for i in range(r)]
            idx[axis] = b.add(b.mul(idx[axis], b.idx(step)), b.idx(start))
            return b.extract(x, idx)

        return e.map([], shape_of(self.output), elem_of(self.output), body)


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
        ClampOp,
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
        MoeRouteOp,
        MoeExpertsOp,
        ReshapeOp,
        PermuteOp,
        ExpandOp,
        ConcatOp,
        SliceOp,
    ],
    [],
)


# =========================================================================== canonicalization
# The patterns of the op classes' `get_canonicalization_patterns` (run by xDSL's
# `canonicalize`); each has its op as root and serves its Top op and its Tpu twin.


class FoldNoOpReshape(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ReshapeBase, rewriter: PatternRewriter) -> None:
        if shape_of(op.input) == shape_of(op.output):
            rewriter.replace(op, [], [op.input])


class ComposeReshapes(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ReshapeBase, rewriter: PatternRewriter) -> None:
        if (inner := producer(op.input, type(op))) is not None:
            new = type(op).build([inner.input], attributes_of(op))
            rewriter.replace(op, named_like(new, op))


class FoldNoOpPermute(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: PermuteBase, rewriter: PatternRewriter) -> None:
        order = read_ints(op.order)
        if order == list(range(len(order))):
            rewriter.replace(op, [], [op.input])


class ComposePermutes(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: PermuteBase, rewriter: PatternRewriter) -> None:
        if (inner := producer(op.input, type(op))) is None:
            return
        p1, p2 = read_ints(inner.order), read_ints(op.order)
        order = [p1[i] for i in p2]
        if order == list(range(len(order))):
            rewriter.replace(op, [], [inner.input])
            return
        new = type(op).build([inner.input], {**attributes_of(op), "order": i64_array(order)})
        rewriter.replace(op, named_like(new, op))


class PermuteOfUnitAxesIsReshape(RewritePattern):
    """A permute that keeps the order of all non-unit axes moves no data: a reshape (of
    the permute's level: `top.reshape` or `tpu.reshape`)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: PermuteBase, rewriter: PatternRewriter) -> None:
        shape = shape_of(op.input)
        order = read_ints(op.order)
        moved = [i for i in order if shape[i] != 1]
        if moved == sorted(moved) and order != list(range(len(order))):
            attrs = {**attributes_of(op), "shape": i64_array(shape_of(op.output))}
            attrs.pop("order")
            new = sibling_op(op, ReshapeBase).build([op.input], attrs)
            rewriter.replace(op, named_like(new, op))


class FoldNoOpShapeOp(RewritePattern):
    """An expand, slice or cast whose result type is its input's."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ExpandBase | SliceBase | CastBase,
                          rewriter: PatternRewriter) -> None:
        if op.input.type == op.output.type:
            rewriter.replace(op, [], [op.input])


class FoldSingleConcat(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ConcatBase, rewriter: PatternRewriter) -> None:
        if len(op.inputs) == 1:
            rewriter.replace(op, [], [op.inputs[0]])


class FoldIdentityScalarOp(RewritePattern):
    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ConstBinaryOp, rewriter: PatternRewriter) -> None:
        v = read_float(op.value)
        rev = read_bool(op.reverse)
        kind = op.op_kind()
        is_identity = (
            (kind == "mul_const" and v == 1.0)
            or (kind == "add_const" and v == 0.0)
            or (kind == "sub_const" and v == 0.0 and not rev)
            or (kind == "div_const" and v == 1.0 and not rev)
        )
        if is_identity:
            rewriter.replace(op, [], [op.input])


class ComposeClamps(RewritePattern):
    """clamp(clamp(x, a, b), c, d) -> clamp(x, clamp(a, c, d), clamp(b, c, d)), a missing
    bound infinite (and dropped again where the new one is): clamps are monotone, so the
    outer clamp of the inner's bounds bounds the composition, for any a, b, c, d (min > max
    included). Rounding a bound to the element type is monotone too, so the bits are the
    two clamps' (tests/test_op_clamp.py checks every case against the kernel); a NaN stays
    NaN in both."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ClampBase, rewriter: PatternRewriter) -> None:
        inner = producer(op.input, type(op))
        if inner is None or not inner.output.has_one_use():
            return
        (a, b), (c, d) = inner.bounds, op.bounds
        lo, hi = -math.inf if c is None else c, math.inf if d is None else d

        def outer(v: float) -> float:
            return min(max(v, lo), hi)

        lower, upper = outer(-math.inf if a is None else a), outer(math.inf if b is None else b)
        if lower == -math.inf and upper == math.inf:  # neither clamp bounds anything
            rewriter.replace(op, [], [inner.input])
            return
        attrs = {**attributes_of(op), "min": f64_attr(lower), "max": f64_attr(upper)}
        if lower == -math.inf:
            del attrs["min"]
        if upper == math.inf:
            del attrs["max"]
        rewriter.replace(op, named_like(type(op).build([inner.input], attrs), op))


class ComposeScalarMuls(RewritePattern):
    """(x * a) * b -> x * (a*b)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: ConstBinaryOp, rewriter: PatternRewriter) -> None:
        if op.op_kind() != "mul_const":
            return
        inner = producer(op.input, type(op))
        if inner is None or not inner.output.has_one_use():
            return
        v = read_float(inner.value) * read_float(op.value)
        new = type(op).build([inner.input], {**attributes_of(op), "value": f64_attr(v)})
        rewriter.replace(op, named_like(new, op))
