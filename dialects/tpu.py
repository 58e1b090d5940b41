"""The Tpu dialect: how this chip computes the model.

Each Top op has a Tpu twin derived from it (`TPU_OF_TOP`, `twin`): its operands, attributes,
shape inference, FLOP count, kernel binding and assembly format (the `*Base` classes of
`toptpu.dialects.top`), with the chip's decisions; the Tpu-only ops (`tpu.a16_matmul`,
the attention parts, layer groups, loads and stores) are written here. The chip's
decisions:

- storage element types in the result types (f32, f16, bf16; i8/ui8 for packed weights);
- `compute`: the element type the op computes in (f32 for norms, softmax, attention and rope
  whatever the storage type; matmuls accumulate in f32 on this chip);
- `tpu.a16_matmul`: activations f16/bf16/f32 times 4- or 8-bit weights with per-group or
  per-channel scales and either integer zero points or float mins (`weight_bits`,
  `group_size`);
- layer-group information and addresses, filled by `layer-group` / `address-assign`.

`tpu.a16_matmul` semantics (the kernel implements exactly this): with G = K / group_size,
``w[n, k] = (q[n, k] - z[n, k // group_size]) * s[n, k // group_size]`` computed in f32
(s upcast from its storage type), ``y = x @ w.T + bias`` accumulated in f32 and rounded to
the result type. 4-bit q is packed two per byte along K: byte j of row n holds k = 2j in
its low nibble and k = 2j + 1 in its high nibble (qweight ui8 [N, K/2]). 8-bit q is i8
[N, K] when there is no zero point (symmetric) and ui8 [N, K] otherwise. Without a zero
point operand z = 0 (8-bit signed) or z = 8 (4-bit symmetric).

The scale-and-min variant (a `mins` operand instead of `zeros`; llama.cpp's Q4_1, Q5_1,
Q4_K, Q5_K): ``w[n, k] = q[n, k] * s[n, g] + m[n, g]`` (g = k // group_size), the product
rounded to f32 first, then the sum (s and m upcast from their storage types); q is the
unsigned integer as stored (ui8 for 8 bits). The min is a float, not an integer zero point:
``m / s`` need not be an integer, so no zero point gives these weights exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, TypeVar

from xdsl.dialects import func
from xdsl.dialects.builtin import (
    DenseArrayBase,
    IntegerAttr,
    StringAttr,
    TensorType,
    UnitAttr,
    f32,
    i64,
)
from xdsl.ir import (
    Attribute,
    Block,
    Dialect,
    Operation,
    ParametrizedAttribute,
    SSAValue,
    TypeAttribute,
)
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    attr_def,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_attr_def,
    opt_operand_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import HasParent, IsolatedFromAbove, IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import dev, top
from toptpu.dialects.common import (
    AnyTensor,
    ConvertedWeight,
    EnumAttr,
    ShapedOp,
    WeightPart,
    dtype_name,
    elem_of,
    i64_array,
    i64_attr,
    int_value_attr,
    is_float,
    numel,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
    tensor,
)
from toptpu.dialects.slicing_interface import (
    RowRule,
    SliceKind,
    SlicingInterface,
    activation_rows,
    same_rows,
    weight_reduction_axes,
)

Operands = Sequence[SSAValue | None]
Attrs = Mapping[str, Attribute]


class TpuOp(ShapedOp):
    """Base class of Tpu ops: pure, with the element type they compute in.

    Inside a `tpu.group`, `lmem` holds the local-memory addresses (per lane) of the op's
    results: each result's buffer copies in result order (two for a double-buffered result,
    one otherwise; see `local_copies`), read through `local_addresses`; `ts` is the
    pipeline stage the op runs in (loads 0, compute 1, stores 2, relative to its slice).
    """

    traits = traits_def(Pure())
    compute = opt_attr_def(TypeAttribute)
    lmem = opt_attr_def(DenseArrayBase)
    ts = opt_attr_def(IntegerAttr)

    def local_copies(self, sliced: bool) -> list[int]:
        """How many local buffer copies each result has: two when the group is `sliced`
        and the result changes per slice (a sliced load, a stored result), else one."""
        loaded = isinstance(self, LoadOp) and read_int(self.slice_axis) != -1
        return [2 if sliced and (loaded or any(isinstance(u.operation, StoreOp)
                                               for u in r.uses)) else 1
                for r in self.results]

    def set_local_addresses(self, addresses: Sequence[int]) -> None:
        """Record the local addresses of every result's copies (`lmem`, see the class doc)."""
        self.lmem = i64_array(list(addresses))

    def local_addresses(self, value: SSAValue, sliced: bool) -> list[int]:
        """The local addresses (one per copy) of `value`, a result of this op; [] when the
        op has none or `lmem` does not list one address per copy."""
        addrs = read_ints(self.lmem)
        counts = self.local_copies(sliced)
        if sum(counts) != len(addrs):
            return addrs if len(self.results) == 1 else []
        start = 0
        for r, n in zip(self.results, counts, strict=True):
            if r is value:
                return addrs[start:start + n]
            start += n
        return []


# =========================================================================== twins of Top ops


class TpuWeight(top.WeightBase, TpuOp):
    """A weight in the chip's storage format (`tpu.weight`, the twin of `top.weight`).

    `source` names the Top (float) weight it was derived from and `part` (a `WeightPart`)
    says how: "data" (a dtype conversion), "qweight", "scales" or "zeros" (quantized by the
    consuming `tpu.a16_matmul`'s parameters), or "checkpoint.<field>" (taken as is from a
    pre-quantized checkpoint), with ".t" when stored transposed. This recipe lets every
    layer derive its own weights for the same net.
    """

    source = opt_attr_def(StringAttr)
    part = opt_attr_def(EnumAttr(WeightPart))

    @property
    def weight_part(self) -> WeightPart | None:
        return None if self.part is None else WeightPart.read(self.part)


class TpuConstant(top.ConstantBase, TpuOp):
    """A small constant (`tpu.constant`, the twin of `top.constant`); `tpu.const_offset`
    (filled by address-assign) is its byte offset in the net's constant pool."""

    const_offset = opt_attr_def(IntegerAttr, attr_name="tpu.const_offset")

    @property
    def pool_offset(self) -> int | None:
        """The byte offset in the constant pool, None before address-assign."""
        return None if self.const_offset is None else read_int(self.const_offset)

    @pool_offset.setter
    def pool_offset(self, offset: int) -> None:
        self.const_offset = i64_attr(offset)


#: the Tpu-only attributes of a twin, declared once: Top op -> the class its twin derives
#: from (an op not listed derives from its Top base class and `TpuOp`)
TPU_EXTRAS: dict[type[ShapedOp], type[TpuOp]] = {top.WeightOp: TpuWeight,
                                                 top.ConstantOp: TpuConstant}


def derive_twin(op: type[ShapedOp], module: str = __name__) -> type[TpuOp]:
    """The Tpu twin of Top op class `op`: its Top base classes (operands, attributes, shape
    inference, FLOPs, kernel binding, lowering types) with the chip's attributes (`TpuOp`,
    or its `TPU_EXTRAS`), its own class constants (`FLOPS_PER_ELEMENT`, `KERNEL`, ...), and
    its name at the Tpu level (`top.silu` -> `tpu.silu`, class `SiluOp` of `module`: this
    one; a plugin op's twin belongs to the plugin's module, `plugin_ops`)."""
    extras = TPU_EXTRAS.get(op)
    bases = ((extras,) if extras is not None
             else (*(b for b in op.__bases__ if b is not top.TopOp), TpuOp))
    kind = op.op_kind()
    constants = {k: v for k, v in vars(op).items() if k.isupper()}
    doc = (extras.__doc__ if extras is not None else
           f"`top.{kind}` on the chip: its storage type in the result, its `compute` type.")
    twin = type(op.__name__, bases, {
        **constants, "name": f"tpu.{kind}",
        "__annotations__": {k: ClassVar[type(v)] for k, v in constants.items()},
        "__module__": module, "__qualname__": op.__name__, "__doc__": doc})
    return irdl_op_definition(twin)


#: Top op class -> its Tpu twin (same operands, attributes and shape semantics), derived
#: for every op of the Top dialect
TPU_OF_TOP: dict[type[ShapedOp], type[TpuOp]] = {
    op: derive_twin(op) for op in top.Top.operations if issubclass(op, ShapedOp)}

B = TypeVar("B", bound=ShapedOp)


def twin(op: type[ShapedOp]) -> type[TpuOp]:
    """The Tpu twin of Top op class `op` (`TPU_OF_TOP`)."""
    return TPU_OF_TOP[op]


def _twin_as(op: type[ShapedOp], base: type[B]) -> type[B]:
    """The Tpu twin of `op`, typed as `base`, a class it derives from (its Top base class:
    what a type checker needs to see its operands and attributes)."""
    t = TPU_OF_TOP[op]
    assert issubclass(t, base), (t, base)
    return t


# The twins by class name, for code that names them (`tpu.MatMulOp`); a twin without a
# line here (an op added later) is found by `__getattr__`.
WeightOp = _twin_as(top.WeightOp, TpuWeight)
ConstantOp = _twin_as(top.ConstantOp, TpuConstant)
RsqrtOp = _twin_as(top.RsqrtOp, top.UnaryOp)
SqrtOp = _twin_as(top.SqrtOp, top.UnaryOp)
ExpOp = _twin_as(top.ExpOp, top.UnaryOp)
CosOp = _twin_as(top.CosOp, top.UnaryOp)
SinOp = _twin_as(top.SinOp, top.UnaryOp)
TanhOp = _twin_as(top.TanhOp, top.UnaryOp)
SigmoidOp = _twin_as(top.SigmoidOp, top.UnaryOp)
SiluOp = _twin_as(top.SiluOp, top.UnaryOp)
ReluOp = _twin_as(top.ReluOp, top.UnaryOp)
SoftplusOp = _twin_as(top.SoftplusOp, top.UnaryOp)
GeluOp = _twin_as(top.GeluOp, top.GeluBase)
PowOp = _twin_as(top.PowOp, top.PowBase)
AddConstOp = _twin_as(top.AddConstOp, top.ConstBinaryOp)
SubConstOp = _twin_as(top.SubConstOp, top.ConstBinaryOp)
MulConstOp = _twin_as(top.MulConstOp, top.ConstBinaryOp)
DivConstOp = _twin_as(top.DivConstOp, top.ConstBinaryOp)
AddOp = _twin_as(top.AddOp, top.BinaryOp)
SubOp = _twin_as(top.SubOp, top.BinaryOp)
MulOp = _twin_as(top.MulOp, top.BinaryOp)
DivOp = _twin_as(top.DivOp, top.BinaryOp)
MaxOp = _twin_as(top.MaxOp, top.BinaryOp)
MinOp = _twin_as(top.MinOp, top.BinaryOp)
CompareOp = _twin_as(top.CompareOp, top.CompareBase)
WhereOp = _twin_as(top.WhereOp, top.WhereBase)
CastOp = _twin_as(top.CastOp, top.CastBase)
SoftmaxOp = _twin_as(top.SoftmaxOp, top.SoftmaxBase)
ReduceOp = _twin_as(top.ReduceOp, top.ReduceBase)
RmsNormOp = _twin_as(top.RmsNormOp, top.RmsNormBase)
LayerNormOp = _twin_as(top.LayerNormOp, top.LayerNormBase)
RopeOp = _twin_as(top.RopeOp, top.RopeBase)
AttentionOp = _twin_as(top.AttentionOp, top.AttentionBase)
MatMulOp = _twin_as(top.MatMulOp, top.MatMulBase)
GatherOp = _twin_as(top.GatherOp, top.GatherBase)
TopKOp = _twin_as(top.TopKOp, top.TopKBase)
ScatterOp = _twin_as(top.ScatterOp, top.ScatterBase)
CumSumOp = _twin_as(top.CumSumOp, top.CumSumBase)
Conv2dOp = _twin_as(top.Conv2dOp, top.Conv2dBase)
CausalConv1dOp = _twin_as(top.CausalConv1dOp, top.CausalConv1dBase)
GatedDeltaRuleOp = _twin_as(top.GatedDeltaRuleOp, top.GatedDeltaRuleBase)
MoeRouteOp = _twin_as(top.MoeRouteOp, top.MoeRouteBase)
MoeExpertsOp = _twin_as(top.MoeExpertsOp, top.MoeExpertsBase)
ReshapeOp = _twin_as(top.ReshapeOp, top.ReshapeBase)
PermuteOp = _twin_as(top.PermuteOp, top.PermuteBase)
ExpandOp = _twin_as(top.ExpandOp, top.ExpandBase)
ConcatOp = _twin_as(top.ConcatOp, top.ConcatBase)
SliceOp = _twin_as(top.SliceOp, top.SliceBase)

#: Top unary elementwise op -> its Tpu twin (`top.UNARY_ELEMENTWISE`)
UNARY_ELEMENTWISE: dict[type[top.UnaryOp], type[TpuOp]] = {
    op: TPU_OF_TOP[op] for op in top.UNARY_ELEMENTWISE}


def __getattr__(name: str) -> type[TpuOp]:
    """A twin by its class name where this module names none (PEP 562): `tpu.XOp` of a
    Top op `top.XOp` added after these lines."""
    for op in TPU_OF_TOP.values():
        if op.__name__ == name:
            return op
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# =========================================================================== Tpu-only ops


@irdl_op_definition
class AttentionPartOp(top.AttentionBase, TpuOp):
    """An attention over one part of its keys (layer-group splits an attention whose keys
    and values do not fit local memory at once: the history's and the new tokens'): the
    part's softmax-weighted values and the log of its sum of exponentials, f32
    [B, Sq, Hq, Dv + 1] (the last column); `tpu.attention_merge` combines the parts."""

    name = "tpu.attention_part"
    KERNEL: ClassVar[str] = "attention_part"
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("attention_fold",
                                                           "attention_part_result")

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        return operands[:4], {"scale": read_float(self.scale), "causal": read_bool(self.causal)}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return operands[:1], {}

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        (out,) = super().infer(operands, attrs)
        b, sq, hq, dv = shape_of(out)
        return [tensor((b, sq, hq, dv + 1), f32)]


@irdl_op_definition
class AttentionMergeOp(TpuOp):
    """The attention over all keys from its two parts (`tpu.attention_part`, each f32
    [B, Sq, Hq, Dv + 1]: the history's keys and the new ones): [B, Sq, Hq, Dv] in the
    result's element type."""

    name = "tpu.attention_merge"
    first = operand_def(AnyTensor)
    second = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    assembly_format = (
        "$first `,` $second attr-dict `:` type($first) `,` type($second) `->` "
        "type($output)"
    )
    CHECK_INFERRED: ClassVar[bool] = False

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        return [list(operands)], {"out_dtype": self.result_dtype()}

    def verify_(self) -> None:
        shapes = {shape_of(self.first), shape_of(self.second)}
        if len(shapes) != 1:
            raise VerifyException("tpu.attention_merge needs parts of one shape")
        (ps,) = shapes
        if len(ps) != 4 or shape_of(self.output) != (*ps[:3], ps[3] - 1):
            raise VerifyException(f"tpu.attention_merge of parts {list(ps)} gives "
                                  f"{[*ps[:3], ps[3] - 1]}, not {list(shape_of(self.output))}")

    def flops(self) -> int:
        return 8 * numel(shape_of(self.output))

    def row_rule(self, axis: int) -> RowRule | None:
        """Row-local over its parts."""
        return same_rows(self, axis)


@irdl_op_definition
class A16MatMulOp(TpuOp):
    """Activations (f16/bf16/f32) times 4/8-bit weights; see the module doc for the math."""

    name = "tpu.a16_matmul"
    input = operand_def(AnyTensor)
    qweight = operand_def(AnyTensor)
    scales = operand_def(AnyTensor)
    zeros = opt_operand_def(AnyTensor)
    mins = opt_operand_def(AnyTensor)
    bias = opt_operand_def(AnyTensor)
    weight_bits = attr_def(IntegerAttr)
    group_size = attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    irdl_options = (AttrSizedOperandSegments(),)
    assembly_format = (
        "$input `,` $qweight `,` $scales (`zeros` $zeros^)? (`mins` $mins^)? (`bias` "
        "$bias^)? attr-dict `:` type($input) `,` type($qweight) `,` type($scales) "
        "(`zeros` type($zeros)^)? (`mins` type($mins)^)? (`bias` type($bias)^)? `->` "
        "type($output)"
    )

    #: the weight's operands (qweight, scales, zeros, mins) in `operand_groups()` order
    WEIGHT_OPERANDS: ClassVar[slice] = slice(1, 5)
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("a16_matmul_part",
                                                           "matmul_finish")

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        x, q, s, z, m, bias = operands
        return (x, q, s, z, bias), {**self._weight_params(), "mins": m,
                                    "out_dtype": self.result_dtype()}

    def converted_weight(self) -> ConvertedWeight:
        """Its weight (qweight, scales, zeros, mins), dequantized at every run."""
        return ConvertedWeight("a16", (1, 2, 3, 4), read_int(self.weight_bits),
                               read_int(self.group_size))

    def _weight_params(self) -> dict[str, object]:
        return {"bits": read_int(self.weight_bits), "group_size": read_int(self.group_size)}

    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """Part `part` of K (whole quantization groups): x's columns, the weights' rows."""
        return operands[:4], {**self._weight_params(), "mins": operands[4]}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return operands[5:6], {"out_dtype": self.result_dtype(), "like": operands[0]}

    def __init__(self, input: SSAValue, qweight: SSAValue, scales: SSAValue,
                 zeros: SSAValue | None, bias: SSAValue | None, *, weight_bits: int,
                 group_size: int, result_type: TensorType | None = None,
                 compute: Attribute = f32, mins: SSAValue | None = None) -> None:
        """`input` times the `weight_bits`-bit `qweight` (scales, and zero points or float
        `mins`, per group of `group_size` input channels), computed in `compute` (f32:
        this chip's matmuls)."""
        self.construct([input, qweight, scales, zeros, mins, bias], {
            "weight_bits": int_value_attr(f"{self.name} weight_bits", weight_bits),
            "group_size": int_value_attr(f"{self.name} group_size", group_size),
            "compute": compute}, None if result_type is None else [result_type])

    @staticmethod
    def unpacked_k(qweight_shape: Sequence[int], bits: int) -> int:
        return qweight_shape[-1] * (2 if bits == 4 else 1)

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, q, s = operands[0], operands[1], operands[2]
        z = operands[3] if len(operands) > 3 else None
        m = operands[4] if len(operands) > 4 else None
        b = operands[5] if len(operands) > 5 else None
        assert x is not None and q is not None and s is not None
        bits, gs = read_int(attrs.get("weight_bits")), read_int(attrs.get("group_size"))
        if bits not in (4, 8):
            raise VerifyException(f"weight_bits must be 4 or 8, got {bits}")
        qs = shape_of(q)
        if len(qs) != 2:
            raise VerifyException("a16_matmul qweight must be [N, K] (8 bit) or [N, K/2] (4 bit)")
        n, k = qs[0], cls.unpacked_k(qs, bits)
        qname = dtype_name(elem_of(q))
        if bits == 4 and qname != "ui8":
            raise VerifyException("4-bit qweight must be ui8 (two nibbles per byte)")
        if bits == 8 and qname not in ("i8", "ui8"):
            raise VerifyException("8-bit qweight must be i8 or ui8")
        if z is not None and m is not None:
            raise VerifyException("a16_matmul takes zero points or mins, not both")
        if bits == 8 and (qname == "ui8") != (z is not None or m is not None):
            raise VerifyException("8-bit weights are i8 without zero points or mins, ui8 "
                                  "with them")
        if gs <= 0 or k % gs:
            raise VerifyException(f"group_size {gs} does not divide K={k}")
        xs = shape_of(x)
        if xs[-1] != k:
            raise VerifyException(f"a16_matmul input K={xs[-1]} but weights have K={k}")
        if shape_of(s) != (n, k // gs):
            raise VerifyException(f"scales {list(shape_of(s))} must be {[n, k // gs]}")
        if z is not None and (shape_of(z) != (n, k // gs) or dtype_name(elem_of(z)) != "ui8"):
            raise VerifyException(f"zeros must be ui8 {[n, k // gs]}")
        if m is not None and (shape_of(m) != (n, k // gs) or not is_float(elem_of(m))):
            raise VerifyException(f"mins must be floating point {[n, k // gs]}")
        if not is_float(elem_of(s)):
            raise VerifyException("scales must be floating point")
        if b is not None and shape_of(b) != (n,):
            raise VerifyException(f"bias must be [{n}]")
        return [tensor((*xs[:-1], n), elem_of(x))]

    def flops(self) -> int:
        xs, qs = shape_of(self.input), shape_of(self.qweight)
        k = self.unpacked_k(qs, read_int(self.weight_bits))
        return 2 * numel(xs[:-1]) * k * qs[0]

    def row_rule(self, axis: int) -> RowRule | None:
        return activation_rows(self, axis)

    def col_sliceable(self) -> bool:
        return True

    def reduction_sliceable(self) -> bool:
        """Over whole quantization groups: weight, scales and zero points cut along K with
        the activation."""
        return True

    def reduction_count(self) -> int:
        """Its quantization groups (a group of K stays whole), or its K when one group
        spans all of K (per channel: every part shares the channel's scale)."""
        k = shape_of(self.input)[-1]
        groups = k // read_int(self.group_size)
        return groups if groups > 1 else k

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        return weight_reduction_axes(self)

    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        """A part of a per-channel weight's K is one group of K / `parts`."""
        if parts > 1 and read_int(self.group_size) == shape_of(self.input)[-1]:
            return {"group_size": i64_attr(read_int(self.group_size) // parts)}
        return {}


#: the projections of `tpu.a16_moe_experts`, in operand order
MOE_PROJECTIONS = ("gate", "up", "down")


@irdl_op_definition
class A16MoeExpertsOp(TpuOp):
    """`top.moe_experts` with quantized experts: each projection (gate [E, I, H], up
    [E, I, H], down [E, H, I]) stacked by expert in `tpu.a16_matmul`'s layout — expert e's
    qweight [N, K/2] (4 bit) or [N, K] (8 bit), scales [N, G] and zero points or mins
    [N, G] are element e of the operands (groups along each expert's input dimension:
    H for gate and up, I for down). `weight_bits` and `group_size` hold one value per
    projection (gate, up, down). y = the float op's arithmetic on the dequantized experts
    (`kernels.dequantize`, the a16_matmul's own): only the experts some token chose are
    dequantized. The router's weights and indices are as for `top.moe_experts`."""

    name = "tpu.a16_moe_experts"
    x = operand_def(AnyTensor)
    gate_qweight = operand_def(AnyTensor)
    gate_scales = operand_def(AnyTensor)
    gate_zeros = opt_operand_def(AnyTensor)
    gate_mins = opt_operand_def(AnyTensor)
    up_qweight = operand_def(AnyTensor)
    up_scales = operand_def(AnyTensor)
    up_zeros = opt_operand_def(AnyTensor)
    up_mins = opt_operand_def(AnyTensor)
    down_qweight = operand_def(AnyTensor)
    down_scales = operand_def(AnyTensor)
    down_zeros = opt_operand_def(AnyTensor)
    down_mins = opt_operand_def(AnyTensor)
    weights = operand_def(AnyTensor)
    indices = operand_def(AnyTensor)
    weight_bits = attr_def(DenseArrayBase)
    group_size = attr_def(DenseArrayBase)
    #: as `top.moe_experts`'s: the experts the indices range over, the weight operands
    #: holding only the ones they name (a layer group's buffers of the fetched experts)
    fetched_from = opt_attr_def(IntegerAttr)
    #: as `top.moe_experts`'s: the reduction parts are blocks of experts
    expert_blocks = opt_attr_def(IntegerAttr)
    output = result_def(AnyTensor)
    irdl_options = (AttrSizedOperandSegments(),)
    assembly_format = (
        "$x `,` `gate` `(` $gate_qweight `,` $gate_scales (`zeros` $gate_zeros^)? (`mins` "
        "$gate_mins^)? `)` `,` `up` `(` $up_qweight `,` $up_scales (`zeros` $up_zeros^)? "
        "(`mins` $up_mins^)? `)` `,` `down` `(` $down_qweight `,` $down_scales (`zeros` "
        "$down_zeros^)? (`mins` $down_mins^)? `)` `,` $weights `,` $indices attr-dict `:` "
        "type($x) `,` `gate` `(` type($gate_qweight) `,` type($gate_scales) (`zeros` "
        "type($gate_zeros)^)? (`mins` type($gate_mins)^)? `)` `,` `up` `(` "
        "type($up_qweight) `,` type($up_scales) (`zeros` type($up_zeros)^)? (`mins` "
        "type($up_mins)^)? `)` `,` `down` `(` type($down_qweight) `,` type($down_scales) "
        "(`zeros` type($down_zeros)^)? (`mins` type($down_mins)^)? `)` `,` type($weights) "
        "`,` type($indices) `->` type($output)"
    )
    MULTIPLY_ACCUMULATE: ClassVar[bool] = True
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = ("a16_moe_experts_part",
                                                           "moe_experts_finish")

    def __init__(self, x: SSAValue,
                 projections: Sequence[tuple[SSAValue, SSAValue, SSAValue | None,
                                             SSAValue | None]],
                 weights: SSAValue, indices: SSAValue, *, weight_bits: Sequence[int],
                 group_size: Sequence[int], result_type: TensorType | None = None) -> None:
        """`projections`: (qweight, scales, zeros, mins) of gate, up and down."""
        flat: list[SSAValue | None] = [x]
        for proj in projections:
            flat.extend(proj)
        self.construct([*flat, weights, indices], {
            "weight_bits": i64_array(list(weight_bits)),
            "group_size": i64_array(list(group_size)), "compute": f32},
            None if result_type is None else [result_type])

    # ------------------------------------------------------------------ kernel binding
    def _params(self) -> dict[str, object]:
        return {"bits": tuple(read_ints(self.weight_bits)),
                "group_sizes": tuple(read_ints(self.group_size)),
                **top.fetched_param(self.fetched_from)}

    def kernel_params(self) -> dict[str, object]:
        return {**self._params(), "out_dtype": self.result_dtype()}

    def quantized_weights(self) -> list[ConvertedWeight]:
        """Its three projections' (qweight, scales, zeros, mins) in `operand_groups`."""
        bits, groups = read_ints(self.weight_bits), read_ints(self.group_size)
        return [ConvertedWeight("a16", tuple(range(1 + 4 * p, 5 + 4 * p)), bits[p], groups[p])
                for p in range(3)]

    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """Part `part` of I: every operand (gate and up cut to the part's rows, down to
        its columns: whole groups); or with `expert_blocks`, block `part` of the
        experts."""
        return operands, {**self._params(), **top.expert_block_param(
            self.fetched_from, self.expert_blocks, part)}

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        return (), {"out_dtype": self.result_dtype(), "like": operands[0]}

    # ------------------------------------------------------------------ shapes
    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x, weights, indices = operands[0], operands[13], operands[14]
        assert x is not None and weights is not None and indices is not None
        name = cls.name
        bits, groups = read_ints(attrs.get("weight_bits")), read_ints(attrs.get("group_size"))
        if len(bits) != 3 or len(groups) != 3:
            raise VerifyException(f"{name} needs weight_bits and group_size for gate, up "
                                  "and down (three each)")
        xs = shape_of(x)
        if len(xs) != 2:
            raise VerifyException(f"{name} x is {list(xs)}; it must be [T, H]")
        t, h = xs
        shapes: list[tuple[int, int, int]] = []
        for p, what in enumerate(MOE_PROJECTIONS):
            q, s, z, m = operands[1 + 4 * p: 5 + 4 * p]
            assert q is not None and s is not None
            shapes.append(_stacked_quantized_shape(name, what, q, s, z, m, bits[p], groups[p]))
        (e, i, hk), (eu, iu, hu), (ed, hd, idn) = shapes
        if (hk, hu, hd) != (h, h, h) or (eu, ed) != (e, e) or (iu, idn) != (i, i):
            raise VerifyException(
                f"{name} experts are gate {list(shapes[0])}, up {list(shapes[1])}, down "
                f"{list(shapes[2])} (unpacked); for x [{t}, {h}] they must be [E, I, {h}], "
                f"[E, I, {h}], [E, {h}, I]")
        ws = shape_of(weights)
        top.check_fetched_rows(name, e, shape_of(indices), attrs.get("fetched_from"),
                               attrs.get("expert_blocks"))
        if len(ws) != 2 or ws[0] != t or ws[1] < 1 or shape_of(indices) != ws:
            raise VerifyException(f"{name} weights and indices must be [{t}, k] with k at "
                                  "least 1")
        if not is_float(elem_of(x)) or not is_float(elem_of(weights)) \
                or is_float(elem_of(indices)):
            raise VerifyException(f"{name} takes float x and weights, integer indices")
        return [tensor(xs, elem_of(x))]

    @property
    def experts(self) -> int:
        return shape_of(self.gate_scales)[0]

    @property
    def intermediate(self) -> int:
        return shape_of(self.gate_scales)[1]

    @property
    def top_k(self) -> int:
        return shape_of(self.weights)[1]

    def flops(self) -> int:
        """As `top.moe_experts`: the k experts each token computes (at most E)."""
        t, h = shape_of(self.x)
        i = self.intermediate
        return t * min(self.top_k, self.experts) * (2 * h * 2 * i + 2 * i * h + 6 * i + 2 * h)

    # ------------------------------------------------------------------ slicing
    def _flat_axes(self, x: int | None, gate_up: int | None, down: int | None,
                   routing: int | None) -> tuple[int | None, ...]:
        """An axis per present operand (flat order): x's, every gate/up weight operand's,
        every down operand's, the routing weights' and indices'."""
        axes: list[int | None] = []
        groups = self.operand_groups()
        for n, v in enumerate(groups):
            if v is None:
                continue
            if n == 0:
                axes.append(x)
            elif n < 9:
                axes.append(gate_up)
            elif n < 13:
                axes.append(down)
            else:
                axes.append(routing)
        return tuple(axes)

    def row_rule(self, axis: int) -> RowRule | None:
        """Tokens are independent: x, the routing and y by rows, the experts whole."""
        if axis != 0:
            return None
        return RowRule(self._flat_axes(0, None, None, 0), (0,))

    def tile_loop(self) -> SliceKind:
        """Row blocks times reduction parts (as `top.moe_experts`)."""
        return SliceKind.HEADS

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        return self._flat_axes(None, None, None, None)

    def heads_result_axes(self) -> tuple[int, ...]:
        return (1,)

    def fetched_by_index(self) -> dict[int, int]:
        """Every stacked weight operand (the integers, scales, zero points and mins of gate,
        up and down; flat positions 1 .. n-3) is read only at the experts the indices (the
        last operand) name, as `top.moe_experts`'s."""
        n = len(self.operands)
        return {p: n - 1 for p in range(1, n - 2)}

    def expert_block_axes(self) -> tuple[int | None, ...] | None:
        """Blocks of experts: every stacked weight operand along E (0); the rest whole."""
        return self._flat_axes(None, 0, 0, None)

    def reduction_sliceable(self) -> bool:
        return True

    def reduction_count(self) -> int:
        """down's quantization groups along I (a group stays whole), or, for a down with
        one group over all of I, I (half of I at 4 bits: a part's bytes stay whole)."""
        i = self.intermediate
        bits, gs = read_ints(self.weight_bits)[2], read_ints(self.group_size)[2]
        if gs < i:
            return i // gs
        return i // 2 if bits == 4 else i

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        """gate and up (their integers, scales, zero points, mins) along their rows (1),
        down's along their columns (2: I, its bytes or groups); a per-channel down's
        scales, zero points or mins ([E, H, 1]: one group over all of I) whole, shared by
        every part (as `tpu.a16_matmul`'s per-channel scales)."""
        axes = self._flat_axes(None, 1, 2, None)
        return tuple(None if a == 2 and shape_of(v)[2] == 1 else a
                     for a, v in zip(axes, self.operands, strict=True))

    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        """A part of a down with one group over I has one group of I / `parts`."""
        groups = read_ints(self.group_size)
        if parts > 1 and groups[2] == self.intermediate:
            return {"group_size": i64_array([groups[0], groups[1], groups[2] // parts])}
        return {}


def _stacked_quantized_shape(name: str, what: str, q: SSAValue, s: SSAValue,
                             z: SSAValue | None, m: SSAValue | None, bits: int, gs: int
                             ) -> tuple[int, int, int]:
    """[E, N, K] of one stacked quantized projection, checked as `tpu.a16_matmul` checks
    its weight (per expert)."""
    if bits not in (4, 8):
        raise VerifyException(f"{name} {what}: weight bits must be 4 or 8, got {bits}")
    qs = shape_of(q)
    if len(qs) != 3:
        raise VerifyException(f"{name} {what} qweight must be [E, N, K] (8 bit) or "
                              "[E, N, K/2] (4 bit)")
    e, n, k = qs[0], qs[1], A16MatMulOp.unpacked_k(qs, bits)
    qname = dtype_name(elem_of(q))
    if (bits == 4 and qname != "ui8") or (bits == 8 and qname not in ("i8", "ui8")):
        raise VerifyException(f"{name} {what}: {bits}-bit qweight cannot be {qname}")
    if z is not None and m is not None:
        raise VerifyException(f"{name} {what} takes zero points or mins, not both")
    if bits == 8 and (qname == "ui8") != (z is not None or m is not None):
        raise VerifyException(f"{name} {what}: 8-bit weights are i8 without zero points or "
                              "mins, ui8 with them")
    if gs <= 0 or k % gs:
        raise VerifyException(f"{name} {what}: group_size {gs} does not divide K={k}")
    g = (e, n, k // gs)
    if shape_of(s) != g or not is_float(elem_of(s)):
        raise VerifyException(f"{name} {what} scales must be float {list(g)}")
    if z is not None and (shape_of(z) != g or dtype_name(elem_of(z)) != "ui8"):
        raise VerifyException(f"{name} {what} zeros must be ui8 {list(g)}")
    if m is not None and (shape_of(m) != g or not is_float(elem_of(m))):
        raise VerifyException(f"{name} {what} mins must be float {list(g)}")
    return e, n, k


# =========================================================================== layer groups


@irdl_op_definition
class GroupOp(IRDLOperation):
    """A layer group: ops that run out of local memory, slice by slice.

    The body's block arguments are the group's global inputs; `tpu.load` brings (a slice of)
    one into local memory, compute ops work on slice-shaped local tensors, `tpu.store` writes
    a slice back into a global result, and `tpu.yield` returns the stored results. The
    slices form a software pipeline: the load of slice i+1 and the store of slice i-1
    overlap the compute of slice i. `slices` is the number of slices (all the same size);
    `cost` the modelled cycles the layer-group cost model chose this group for; `gaddrs`
    (filled by address-assign) the activation-region offsets of the results.

    A group of 2-D tiles (one matmul sliced along its rows and its output channels at once)
    says so in `tiles = array<i64: R, C>` (R row blocks times C output-channel blocks,
    `slices` = R * C) and `tile_outer` (which of those two loops is the outer one: 0 the
    row blocks', 1 the output channels'; a load sliced by the outer loop only stays in
    local memory for the inner loop's tiles); its loads and stores name the axes they
    slice per tile loop (`tile_axes`).

    A third count, `tiles = array<i64: R, C, P>`, splits the reduction of the group's one
    op into P parts, a loop inside the other two (`slices` = R * C * P): a matmul's K (a
    quantization group of K stays whole), an attention's keys (KV heads are its second
    loop). Each slice folds its part into an f32 accumulator in local memory, at per-lane
    address `acc` (`accumulator_type`: the matmul's f32 product, the attention's running
    max, sum and weighted values: online softmax), and the tile's result exists after its
    last part, when it is stored. The loads and stores then name three axes per tile loop.

    A fourth count, `tiles = array<i64: R, C, P, Q>` (the experts op's blocks of experts
    times parts of its intermediate axis, `expert_blocks`): the reduction's P x Q parts,
    part q cutting the third axis its loads name at block q mod P and the fourth at q div
    P (`part_blocks`).
    """

    name = "tpu.group"
    inputs = var_operand_def(AnyTensor)
    outputs = var_result_def(AnyTensor)
    body = region_def("single_block")
    slices = attr_def(IntegerAttr)
    cost = opt_attr_def(IntegerAttr)
    gaddrs = opt_attr_def(DenseArrayBase)
    tiles = opt_attr_def(DenseArrayBase)
    tile_outer = opt_attr_def(IntegerAttr)
    acc = opt_attr_def(IntegerAttr)
    traits = traits_def(IsolatedFromAbove())
    assembly_format = "`(` $inputs `)` attr-dict `:` functional-type($inputs, $outputs) $body"

    def verify_(self) -> None:
        block = self.body.block
        if len(block.args) != len(self.inputs):
            raise VerifyException("tpu.group needs one block argument per input")
        for a, v in zip(block.args, self.inputs, strict=True):
            if a.type != v.type:
                raise VerifyException("tpu.group block argument types must match the inputs")
        term = block.last_op
        if not isinstance(term, YieldOp):
            raise VerifyException("tpu.group must end with tpu.yield")
        if [v.type for v in term.operands] != [r.type for r in self.outputs]:
            raise VerifyException("tpu.yield types must match the group results")
        if read_int(self.slices) < 1:
            raise VerifyException("tpu.group needs at least one slice")
        if self.tiles is not None:
            rc = read_ints(self.tiles)
            if (len(rc) not in (2, 3, 4) or min(rc) < 1
                    or math.prod(rc) != read_int(self.slices)
                    or (len(rc) >= 3 and rc[2] < 2) or (len(rc) == 4 and rc[3] < 2)):
                raise VerifyException(
                    f"tpu.group tiles {list(rc)} must be two counts (and reduction parts, "
                    f"more than one) whose product is its {read_int(self.slices)} slices")
            if self.tile_outer is None or read_int(self.tile_outer) not in (0, 1):
                raise VerifyException("tpu.group with tiles needs tile_outer, 0 (the row "
                                      "blocks' loop is outer) or 1 (the output channels')")
            if len(rc) == 4:
                _, computes, _ = self.template()
                if len(computes) != 1 or "expert_blocks" not in computes[0].attributes:
                    raise VerifyException("tpu.group with four tiles counts computes one "
                                          "experts op in blocks of experts (expert_blocks)")
            if len(rc) >= 3:
                _, computes, _ = self.template()
                if len(computes) != 1 or not splits_reduction(computes[0]):
                    raise VerifyException(
                        "tpu.group with reduction parts computes one matmul, a16_matmul or "
                        "attention (without history), not "
                        f"{', '.join(op.name for op in computes) or 'nothing'}")

    def result_offsets(self) -> list[int] | None:
        """The activation offsets of its results (`gaddrs`, address-assign's; -1 for a
        result that is an output), None before address-assign."""
        offsets = read_ints(self.gaddrs)
        return offsets if self.gaddrs is not None and len(offsets) == len(self.outputs) \
            else None

    def set_result_offsets(self, offsets: Sequence[int]) -> None:
        """Record the activation offsets of its results (address-assign)."""
        self.gaddrs = i64_array(list(offsets))

    def tile_grid(self) -> tuple[int, int, str] | None:
        """(row blocks, output-channel blocks, the outer loop) of a 2-D tiled group, None
        for a group sliced along one axis (or not at all)."""
        if self.tiles is None:
            return None
        r, c = read_ints(self.tiles)[:2]
        return r, c, TILE_LOOPS[read_int(self.tile_outer)]

    def reduction_parts(self) -> int:
        """P of a group whose reduction is split in parts (`tiles` R, C, P; P x Q with a
        fourth count), else 1."""
        return math.prod(self.part_counts())

    def part_counts(self) -> tuple[int, ...]:
        """The counts of the reduction parts' loop per axis its loads name: (P,) or
        (P, Q) (`tiles` after R and C), (1,) without parts."""
        rc = read_ints(self.tiles) if self.tiles is not None else []
        return tuple(rc[2:]) if len(rc) >= 3 else (1,)

    def part_blocks(self, t: int) -> tuple[int, ...]:
        """The block of each part axis slice `t` computes: (q,) or (q mod P, q div P)."""
        q, counts = self.reduction_part(t), self.part_counts()
        return (q % counts[0], q // counts[0]) if len(counts) == 2 else (q,)

    def reduction_part(self, t: int) -> int:
        """The reduction part slice `t` computes (0 without reduction parts)."""
        return t % self.reduction_parts()

    def tile_blocks(self, t: int) -> tuple[int, int]:
        """(row block, output-channel block) of slice `t`'s tile (the tiles in loop order,
        each its reduction parts in a row)."""
        grid = self.tile_grid()
        if grid is None:
            return t, t
        r, c, outer = grid
        t //= self.reduction_parts()
        if outer == "rows":
            return divmod(t, c)
        j, i = divmod(t, r)
        return i, j

    def slice_window(self, op: Operation, t: int, shape: Sequence[int]) -> tuple[slice, ...]:
        """The part of a global tensor of `shape` that load or store `op` moves in slice `t`
        (along its `slice_axis`, or its `tile_axes` in a tiled group)."""
        assert isinstance(op, LoadOp | StoreOp)
        index = [slice(None)] * len(shape)
        ax = read_int(op.slice_axis)
        if ax == -1:
            return tuple(index)
        axes = tile_axes_of(op)
        grid = self.tile_grid()
        if axes is None or grid is None:
            n = shape[ax] // read_int(self.slices)
            index[ax] = slice(t * n, (t + 1) * n)
            return tuple(index)
        counts = (*grid[:2], *self.part_counts())
        blocks = (*self.tile_blocks(t), *self.part_blocks(t))
        for a, count, b in zip(axes, counts, blocks, strict=False):
            if a != -1:
                n = shape[a] // count
                index[a] = slice(b * n, (b + 1) * n)
        return tuple(index)

    def tiles_per_buffer(self, op: Operation) -> int:
        """How many consecutive slices one buffer of `op`'s value serves: in a tiled group,
        the slices of the loops inside the innermost loop that slices it (loops, outside
        in: the outer tile loop, the inner one, the reduction parts). A load sliced by the
        outer loop only stays in local memory while the inner loop runs; a tile's result
        is stored once, after its last reduction part. Else 1."""
        grid = self.tile_grid()
        if grid is None or not isinstance(op, LoadOp | StoreOp):
            return 1
        axes = tile_axes_of(op)
        if axes is None:
            return 1
        r, c, outer = grid
        parts = self.reduction_parts()
        sliced = (axes[0] != -1, axes[1] != -1, any(a != -1 for a in axes[2:]))
        # the loops outside in: (sliced?, count)
        loops = ([(sliced[0], r), (sliced[1], c)] if outer == "rows"
                 else [(sliced[1], c), (sliced[0], r)]) + [(sliced[2], parts)]
        n = 1
        for is_sliced, count in reversed(loops):
            if is_sliced:
                return n
            n *= count
        return n

    def template(self) -> tuple[list[LoadOp], list[TpuOp], list[StoreOp]]:
        """The body's loads, compute ops and stores, each in program order (the yield left
        out): the template every slice of the group runs."""
        loads: list[LoadOp] = []
        computes: list[TpuOp] = []
        stores: list[StoreOp] = []
        for op in self.body.block.ops:
            if isinstance(op, LoadOp):
                loads.append(op)
            elif isinstance(op, StoreOp):
                stores.append(op)
            elif isinstance(op, TpuOp):
                computes.append(op)
            elif not isinstance(op, YieldOp):
                raise VerifyException(f"tpu.group holds '{op.name}', not a Tpu op")
        return loads, computes, stores

    def computed_by(self, index: int) -> Operation | None:
        """The op in the body that computes the group's result `index` (the one its store
        stores), None when the yield does not yield a store of a computed value."""
        term = self.body.block.last_op
        store = term.operands[index].owner if term is not None else None
        if isinstance(store, StoreOp) and isinstance(store.input.owner, Operation):
            return store.input.owner
        return None


#: the loops of a 2-D tiled group: over row blocks and over output-channel blocks
TILE_LOOPS = ("rows", "cols")

#: a stage of a grouped function: a layer group, or a collective between two of them
Stage = GroupOp | dev.CollectiveOp


def stages(block: Block) -> list[Stage]:
    """The stages of a grouped function's block in program order: its layer groups and
    the collectives between them (what codegen emits and address-assign places)."""
    return [op for op in block.ops if isinstance(op, GroupOp | dev.CollectiveOp)]


def splits_reduction(op: Operation) -> bool:
    """Whether a tiled group may split `op`'s reduction in parts (`GroupOp`): its class
    declares the kernels (`ShapedOp.REDUCTION_KERNELS`)."""
    return isinstance(op, ShapedOp) and op.REDUCTION_KERNELS is not None


def accumulator_type(op: Operation) -> TensorType:
    """The f32 accumulator of a reduction split in parts (`GroupOp` with three `tiles`;
    `ShapedOp.accumulator_type`)."""
    assert isinstance(op, ShapedOp)
    return op.accumulator_type()


@irdl_op_definition
class YieldOp(IRDLOperation):
    name = "tpu.yield"
    values = var_operand_def(AnyTensor)
    traits = traits_def(IsTerminator(), HasParent(GroupOp), Pure())
    assembly_format = "attr-dict ($values^ `:` type($values))?"


@irdl_op_definition
class LoadOp(TpuOp):
    """DMA global -> local: slice `s` of the global tensor along `slice_axis` (the whole
    tensor, loaded once and kept resident, when `slice_axis` is -1).

    `by_index` (a load for an operand its consumer reads only at the rows its index operand
    names: `SlicingInterface.fetched_by_index`, the MoE experts' stacked weights): an
    indexed load — only the rows along axis 0 that the consumer's indices name move, each
    once (the DMA reads the indices from the local buffer the consumer reads them from;
    a negative index names none), the others are not read from global memory. Its
    buffer holds all the rows of the part (each at its place, the others zero), or fewer
    (a result with fewer rows along axis 0 than its input: a buffer of the fetched
    experts): the named rows in ascending order in its first rows, its consumers reading
    them as `fetched_from` the input's rows (`top.moe_experts`)."""

    name = "tpu.load"
    input = operand_def(AnyTensor)
    slice_axis = attr_def(IntegerAttr)
    tile_axes = opt_attr_def(DenseArrayBase)
    by_index = opt_attr_def(UnitAttr)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    CHECK_INFERRED: ClassVar[bool] = False
    STRUCTURAL: ClassVar[bool] = True  # run by its group

    def verify_(self) -> None:
        verify_slice(self.input, self.output, read_int(self.slice_axis), self, self.tile_axes,
                     fetched_rows=self.by_index is not None)
        if self.by_index is not None:
            self._verify_fetched()
            axes = read_ints(self.tile_axes) if self.tile_axes is not None else []
            # a block of experts: the reduction parts (third tile axis) cut axis 0, read by
            # consumers that add only their block's experts (`expert_blocks`)
            blocks = len(axes) >= 3 and axes[2] == 0 and 0 not in (*axes[:2], *axes[3:])
            if blocks:
                for u in self.output.uses:
                    if u.operation.attributes.get("expert_blocks") is None:
                        raise VerifyException(
                            f"{self.name} by_index loads blocks of rows along axis 0; its "
                            f"consumer {u.operation.name} does not read them as "
                            "expert_blocks")
            elif read_int(self.slice_axis) == 0 or 0 in axes:
                raise VerifyException(f"{self.name} by_index loads rows along axis 0 by "
                                      "index; it cannot also slice axis 0 (but in blocks "
                                      "of experts: the reduction parts' axis)")
            uses = list(self.output.uses)
            for u in uses:
                op = u.operation
                if not (isinstance(op, SlicingInterface)
                        and u.index in op.fetched_by_index()):
                    raise VerifyException(f"{self.name} by_index: its result is operand "
                                          f"{u.index} of {op.name}, which does not read it "
                                          "by index")
            if not uses:
                raise VerifyException(f"{self.name} by_index needs a consumer reading its "
                                      "rows by index")

    def _verify_fetched(self) -> None:
        """A buffer of the fetched rows (fewer rows than the input) is read by consumers
        that know it (`fetched_from` the input's rows); a buffer of every row by ones that
        read rows at their places."""
        full, held = shape_of(self.input)[0], shape_of(self.output)[0]
        for u in self.output.uses:
            attr = u.operation.attributes.get("fetched_from")
            got = None if attr is None else read_int(attr)
            if got != (None if held == full else full):
                raise VerifyException(
                    f"{self.name} by_index holds {held} of {full} rows; its consumer "
                    f"{u.operation.name} reads them as "
                    f"{'every row' if got is None else f'fetched from {got}'}")


@irdl_op_definition
class StoreOp(TpuOp):
    """DMA local -> global: the slice computed in local memory into its place in the
    global result (the whole result when `slice_axis` is -1)."""

    name = "tpu.store"
    input = operand_def(AnyTensor)
    slice_axis = attr_def(IntegerAttr)
    tile_axes = opt_attr_def(DenseArrayBase)
    output = result_def(AnyTensor)
    assembly_format = "$input attr-dict `:` type($input) `->` type($output)"
    CHECK_INFERRED: ClassVar[bool] = False
    STRUCTURAL: ClassVar[bool] = True  # run by its group

    def verify_(self) -> None:
        verify_slice(self.output, self.input, read_int(self.slice_axis), self, self.tile_axes)


def tile_axes_of(op: LoadOp | StoreOp) -> tuple[int, ...] | None:
    """The axes a load or store of a 2-D tiled group slices per tile loop (rows, cols and,
    with reduction parts, the reduction; -1: not sliced by that loop), None outside such a
    group."""
    if op.tile_axes is None:
        return None
    return tuple(read_ints(op.tile_axes))


def verify_slice(full: SSAValue, part: SSAValue, axis: int, op: IRDLOperation,
                 tile_axes: DenseArrayBase | None = None, fetched_rows: bool = False) -> None:
    """`part` is slice `axis` (or tiles `tile_axes`) of `full`; `fetched_rows` (an indexed
    load): its axis 0 holds from 1 to all of `full`'s rows, the rest sliced as said."""
    fs, ps = shape_of(full), shape_of(part)
    if fetched_rows and len(fs) == len(ps) and len(fs) > 0 and ps[0] != fs[0]:
        if not 1 <= ps[0] < fs[0]:
            raise VerifyException(f"{op.name} by_index holds {ps[0]} of the {fs[0]} rows; it "
                                  f"must hold from 1 to {fs[0]}")
        ps = (fs[0], *ps[1:])
    if elem_of(full) != elem_of(part):
        raise VerifyException(f"{op.name} cannot change the element type")
    if tile_axes is not None:
        axes = [a for a in read_ints(tile_axes) if a != -1]
        if len(read_ints(tile_axes)) not in (2, 3, 4) or not axes or len(set(axes)) != len(axes) \
                or axis not in axes:
            raise VerifyException(f"{op.name} tile_axes {list(read_ints(tile_axes))} must be "
                                  f"two to four axes (-1: none), one of them slice_axis "
                                  f"{axis}")
        if len(fs) != len(ps) or any(not 0 <= a < len(fs) for a in axes):
            raise VerifyException(f"{op.name} tile_axes {axes} are out of range")
        for i, (a, b) in enumerate(zip(fs, ps, strict=True)):
            if i not in axes and a != b:
                raise VerifyException(f"{op.name} may only slice along axes {axes}")
            if i in axes and (b < 1 or a % b):
                raise VerifyException(
                    f"{op.name} slice of {b} does not divide the axis of size {a}")
        return
    if axis == -1:
        if fs != ps:
            raise VerifyException(f"{op.name} of a whole tensor must keep its shape")
        return
    if not 0 <= axis < len(fs) or len(fs) != len(ps):
        raise VerifyException(f"{op.name} slice_axis {axis} is out of range")
    if any(a != b for i, (a, b) in enumerate(zip(fs, ps, strict=True)) if i != axis):
        raise VerifyException(f"{op.name} may only slice along axis {axis}")
    if ps[axis] < 1 or fs[axis] % ps[axis]:
        raise VerifyException(
            f"{op.name} slice of {ps[axis]} does not divide the axis of size {fs[axis]}")


# =========================================================================== annotations


@irdl_attr_definition
class RegionsAttr(ParametrizedAttribute):
    """`#tpu.regions<activations, constants, weights, io>`: the byte sizes of a net's four
    global memory regions, set on its function by address-assign (see `regions_of`)."""

    name = "tpu.regions"
    activations: IntegerAttr
    constants: IntegerAttr
    weights: IntegerAttr
    io: IntegerAttr

    #: the function attribute that holds it
    KEY: ClassVar[str] = "tpu.regions"

    def verify(self) -> None:
        for field, value in self.sizes().items():
            if value < 0:
                raise VerifyException(f"tpu.regions: {field} size {value} is negative")

    def sizes(self) -> dict[str, int]:
        """Region name -> byte size, in the order activations, constants, weights, io."""
        return {"activations": read_int(self.activations),
                "constants": read_int(self.constants),
                "weights": read_int(self.weights), "io": read_int(self.io)}


def set_regions(fn: func.FuncOp, activations: int, constants: int, weights: int,
                io: int) -> RegionsAttr:
    """Record a function's region sizes (address-assign)."""
    attr = RegionsAttr(*(IntegerAttr(v, i64) for v in (activations, constants, weights, io)))
    fn.attributes[RegionsAttr.KEY] = attr
    return attr


def regions_of(fn: func.FuncOp) -> dict[str, int] | None:
    """A function's region sizes (`RegionsAttr.sizes`), None before address-assign."""
    attr = fn.attributes.get(RegionsAttr.KEY)
    return attr.sizes() if isinstance(attr, RegionsAttr) else None


Tpu = Dialect(
    "tpu",
    [*TPU_OF_TOP.values(), A16MatMulOp, A16MoeExpertsOp, AttentionPartOp, AttentionMergeOp,
     GroupOp, YieldOp, LoadOp, StoreOp],
    [RegionsAttr],
)

#: the Tpu ops a tiled group may split the reduction of in parts (`splits_reduction`)
REDUCTION_OPS: tuple[type[ShapedOp], ...] = tuple(
    op for op in Tpu.operations if issubclass(op, ShapedOp) and op.REDUCTION_KERNELS)
