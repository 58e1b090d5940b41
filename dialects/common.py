"""Helpers shared by the Top and Tpu dialects: attribute constructors/readers, element
types, broadcasting and the `ShapedOp` protocol (shape inference, FLOP count, verifier).

Every op attribute is an MLIR *attribute* (never a property) so that the generic form
printed by xDSL is accepted by MLIR's IRDL-loaded dialects.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, Self

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike
from xdsl.dialects.builtin import (
    AnyFloat,
    BFloat16Type,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    Float16Type,
    Float32Type,
    Float64Type,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    Signedness,
    StringAttr,
    TensorType,
    UnrankedTensorType,
    bf16,
    f16,
    f32,
    f64,
    i1,
    i8,
    i32,
    i64,
)
from xdsl.ir import Attribute, Block, Dialect, Region, SSAValue
from xdsl.irdl import (
    AnyOf,
    AttrConstraint,
    AttrSetConstraint,
    BaseAttr,
    IntConstraint,
    IRDLOperation,
    VerificationContext,
)
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.slicing_interface import SlicingInterface

if TYPE_CHECKING:
    from typing_extensions import TypeVar

#: ranked tensors, or unranked ones whose shape `shape-infer` has yet to derive
AnyTensor = AnyOf((BaseAttr(TensorType), BaseAttr(UnrankedTensorType)))


def is_ranked(value: SSAValue | Attribute) -> bool:
    t = value.type if isinstance(value, SSAValue) else value
    return isinstance(t, TensorType)


# --------------------------------------------------------------------------- attributes


def i64_attr(value: int) -> IntegerAttr:
    return IntegerAttr(int(value), i64)


def f64_attr(value: float) -> FloatAttr:
    return FloatAttr(float(value), f64)


def bool_attr(value: bool) -> IntegerAttr:
    return IntegerAttr(1 if value else 0, i1)


class FlagConstraint(AttrSetConstraint[IntegerAttr]):
    """Attribute constraint of a flag: `true` or `false` (an i1, what `bool_attr` builds)."""

    def verify(self, attr: Attribute, constraint_context: VerificationContext) -> None:
        if attr not in self.values:
            raise VerifyException(f"a flag attribute (keepdims, transpose_a/_b, causal, "
                                  f"reverse, largest) is true or false (an i1), not {attr}")


#: the constraint of every flag attribute of Top and Tpu ops (`7 : i64` is refused)
BOOL_FLAG = FlagConstraint(frozenset({bool_attr(False), bool_attr(True)}))


def i64_array(values: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, [int(v) for v in values])


def str_attr(value: str) -> StringAttr:
    return StringAttr(value)


def read_int(attr: Attribute | None, default: int | None = None) -> int:
    if attr is None:
        if default is None:
            raise VerifyException("missing integer attribute")
        return default
    assert isinstance(attr, IntegerAttr), attr
    return int(attr.value.data)


def read_float(attr: Attribute | None, default: float | None = None) -> float:
    if attr is None:
        if default is None:
            raise VerifyException("missing float attribute")
        return default
    if isinstance(attr, IntegerAttr):
        return float(attr.value.data)
    assert isinstance(attr, FloatAttr), attr
    return float(attr.value.data)


def read_bool(attr: Attribute | None, default: bool = False) -> bool:
    if attr is None:
        return default
    assert isinstance(attr, IntegerAttr), attr
    return bool(attr.value.data)


def read_ints(attr: Attribute | None) -> list[int]:
    if attr is None:
        return []
    assert isinstance(attr, DenseArrayBase), attr
    return [int(v) for v in attr.get_values()]


def read_str(attr: Attribute | None, default: str = "") -> str:
    if attr is None:
        return default
    assert isinstance(attr, StringAttr), attr
    return attr.data


# --------------------------------------------------------------------------- typed values
# The typed op constructors (`top.SliceOp(x, axis=1, start=0, end=4)`) turn Python values
# into attributes with these; a value of the wrong kind is a TypeError naming the attribute
# (`what`), never silently converted (no float truncated to an int).


def int_value_attr(what: str, value: int) -> IntegerAttr:
    """An i64 attribute of an integer (Python or numpy); TypeError for anything else."""
    if isinstance(value, bool | float) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    return i64_attr(int(value))


def ints_value_attr(what: str, values: Sequence[int]) -> DenseArrayBase:
    """An i64 array attribute of a sequence of integers; TypeError naming a bad entry."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise TypeError(f"{what} must be a sequence of integers, not {values!r}")
    return i64_array([int_value_attr(what, v).value.data for v in values])


def float_value_attr(what: str, value: float) -> FloatAttr:
    """An f64 attribute of a real number (int or float, Python or numpy)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{what} must be a number, not {value!r}")
    return f64_attr(float(value))


def flag_value_attr(what: str, value: bool) -> IntegerAttr | None:
    """An optional i1 flag: the attribute when `value` is True, None (left out, its default)
    when False; TypeError unless a bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be a bool, not {value!r}")
    return bool_attr(True) if value else None


# --------------------------------------------------------------------------- enum attributes


class AttrEnum(StrEnum):
    """The values a string attribute may take (`RopeMode.HALF` is "half").

    Such an attribute stays a plain `StringAttr` (the IR text is that of a bare string:
    `mode = "half"`, so existing IR and model files read as before); ops declare it with
    `attr_def(EnumAttr(RopeMode))`, their verifier rejects any other value naming the
    allowed ones, and the IRDL export lists them (`irdl.any_of(irdl.is "half", ...)`).
    Members are `str`s: kernels and comparisons take them as they are.
    """

    @classmethod
    def describe(cls) -> str:
        """What the value is, for messages: `RopeMode` -> "rope mode"."""
        return re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()

    @classmethod
    def allowed(cls) -> str:
        return ", ".join(m.value for m in cls)

    @classmethod
    def parse(cls, value: str) -> Self:
        """The member named by `value`; ValueError naming the allowed values otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {cls.describe()} '{value}'; expected one of "
                             f"{cls.allowed()}") from None

    @classmethod
    def read(cls, attr: Attribute | None, default: Self | None = None) -> Self:
        """The member an op's (verified) attribute holds; `default` when it is absent."""
        if attr is None:
            if default is None:
                raise VerifyException(f"missing {cls.describe()} attribute")
            return default
        if not isinstance(attr, StringAttr):
            raise VerifyException(f"a {cls.describe()} is a string, not {attr}")
        try:
            return cls.parse(attr.data)
        except ValueError as e:
            raise VerifyException(str(e)) from None

    @property
    def attr(self) -> StringAttr:
        return StringAttr(self.value)


@dataclass(frozen=True)
class EnumAttr(AttrConstraint[StringAttr]):
    """Attribute constraint: a `StringAttr` whose value is a member of `enum`."""

    enum: type[AttrEnum]

    def verify(self, attr: Attribute, constraint_context: VerificationContext) -> None:
        if not isinstance(attr, StringAttr) or attr.data not in self.values():
            raise VerifyException(f"{self.enum.describe()} {attr} is not one of "
                                  f"{self.enum.allowed()}")

    def values(self) -> tuple[str, ...]:
        return tuple(m.value for m in self.enum)

    def get_bases(self) -> set[type[Attribute]] | None:
        return {StringAttr}

    def mapping_type_vars(
        self, type_var_mapping: Mapping[TypeVar, AttrConstraint | IntConstraint]
    ) -> AttrConstraint[StringAttr]:
        return self


class GeluApproximation(AttrEnum):
    """`top.gelu`'s `approximate`: the erf form or the tanh approximation (torch's names)."""

    NONE = "none"
    TANH = "tanh"


class ComparePredicate(AttrEnum):
    """`top.compare`'s `predicate`."""

    EQ = "eq"
    NE = "ne"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"


class ReduceMode(AttrEnum):
    """`top.reduce`'s `mode`."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"


class RopeMode(AttrEnum):
    """`top.rope`'s `mode`: HF rotate_half ("half") or pairs (x0, x1) ("interleaved")."""

    HALF = "half"
    INTERLEAVED = "interleaved"


class WeightPart(AttrEnum):
    """`tpu.weight`'s `part`: how the tensor derives from its source (float) weight.

    "data" is a dtype conversion; "qweight", "scales", "zeros" the round-to-nearest
    quantization by the consuming `tpu.a16_matmul`'s parameters; "checkpoint.<field>" a
    tensor taken as is from a pre-quantized checkpoint; a ".t" suffix (weight-reorder) says
    the tensor is stored transposed.
    """

    DATA = "data"
    QWEIGHT = "qweight"
    SCALES = "scales"
    ZEROS = "zeros"
    CHECKPOINT_QWEIGHT = "checkpoint.qweight"
    CHECKPOINT_SCALES = "checkpoint.scales"
    CHECKPOINT_ZEROS = "checkpoint.zeros"
    CHECKPOINT_MINS = "checkpoint.mins"
    CHECKPOINT_PERM = "checkpoint.perm"
    DATA_T = "data.t"
    QWEIGHT_T = "qweight.t"
    SCALES_T = "scales.t"
    ZEROS_T = "zeros.t"
    CHECKPOINT_QWEIGHT_T = "checkpoint.qweight.t"
    CHECKPOINT_SCALES_T = "checkpoint.scales.t"
    CHECKPOINT_ZEROS_T = "checkpoint.zeros.t"
    CHECKPOINT_MINS_T = "checkpoint.mins.t"
    CHECKPOINT_PERM_T = "checkpoint.perm.t"

    @classmethod
    def checkpoint(cls, field: str) -> WeightPart:
        """The part of a pre-quantized checkpoint's `field` (qweight, scales, zeros, mins,
        perm)."""
        return cls.parse(f"checkpoint.{field}")

    @property
    def transposed(self) -> bool:
        return self.value.endswith(".t")

    @property
    def untransposed(self) -> WeightPart:
        """The part without the ".t" suffix (this part when it has none)."""
        return WeightPart(self.value.removesuffix(".t"))

    def transpose(self) -> WeightPart:
        """The part stored transposed; ValueError when it already is."""
        if self.transposed:
            raise ValueError(f"weight part '{self}' is already transposed")
        return WeightPart(f"{self.value}.t")

    @property
    def checkpoint_field(self) -> str | None:
        """For checkpoint parts the field ("qweight", ...); None otherwise."""
        base = self.untransposed.value
        return base.split(".", 1)[1] if base.startswith("checkpoint.") else None


# --------------------------------------------------------------------------- element types

ui8 = IntegerType(8, Signedness.UNSIGNED)

DTYPE_BY_NAME: dict[str, Attribute] = {
    "f32": f32,
    "f16": f16,
    "bf16": bf16,
    "f64": f64,
    "i1": i1,
    "i8": i8,
    "ui8": ui8,
    "i32": i32,
    "i64": i64,
}


class QuantMode(StrEnum):
    """A quantization mode, as `convert-top-to-tpu` accepts it and a model file header names
    it: the activations' element type and the weight bits (None: float weights in the
    activation type). A `str` too, so headers and options keep their spelling."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    W8F16 = "w8f16"
    W8BF16 = "w8bf16"
    W4F16 = "w4f16"
    W4BF16 = "w4bf16"
    W8F32 = "w8f32"  # f32 activations: the exact check of a quantized checkpoint
    W4F32 = "w4f32"

    @property
    def activation(self) -> str:
        """The activations' element type name: "f32", "f16" or "bf16"."""
        return self.value[2:] if self.value.startswith("w") else self.value

    @property
    def weight_bits(self) -> int | None:
        """4 or 8 for the weight-only modes, None for the float modes."""
        return int(self.value[1]) if self.value.startswith("w") else None

    @classmethod
    def named(cls, name: str) -> QuantMode | None:
        """The mode called `name`, None if there is none."""
        try:
            return cls(name)
        except ValueError:
            return None

    @classmethod
    def names(cls, bits: int | None | str = "any") -> list[str]:
        """The modes' names (only those with `bits` weight bits, when given)."""
        return [m.value for m in cls if bits == "any" or m.weight_bits == bits]


#: the w4 quantization group size when none is given (-1 would mean per channel)
DEFAULT_GROUP_SIZE = 64


#: an element type toptpu knows (an attribute constraint: `top.cast`'s `dtype`); written as a
#: set of exact types so that its IRDL export (`irdl.any_of(irdl.is f32, ...)`) says the same
ElementType = AttrSetConstraint.get(*DTYPE_BY_NAME.values())


def dtype_name(t: Attribute) -> str:
    """The short name of an element type: f32, f16, bf16, i32, ..."""
    if isinstance(t, Float32Type):
        return "f32"
    if isinstance(t, Float16Type):
        return "f16"
    if isinstance(t, BFloat16Type):
        return "bf16"
    if isinstance(t, Float64Type):
        return "f64"
    if isinstance(t, IntegerType):
        prefix = "ui" if t.signedness.data == Signedness.UNSIGNED else "i"
        return f"{prefix}{t.width.data}"
    raise ValueError(f"unsupported element type {t}")


def dtype_from_name(name: str) -> Attribute:
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown element type '{name}'; expected one of {', '.join(DTYPE_BY_NAME)}"
        ) from None


def is_float(t: Attribute) -> bool:
    return isinstance(t, AnyFloat)


def dtype_bytes(t: Attribute) -> int:
    name = dtype_name(t)
    return {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i1": 1, "i8": 1, "ui8": 1, "i32": 4,
            "i64": 8}[name]


def tensor(shape: Sequence[int], element: Attribute) -> TensorType:
    return TensorType(element, [int(d) for d in shape])


def shape_of(value: SSAValue | Attribute) -> tuple[int, ...]:
    t = value.type if isinstance(value, SSAValue) else value
    if not isinstance(t, TensorType):
        raise VerifyException(f"expected a ranked tensor, got {t}")
    return tuple(int(d) for d in t.get_shape())


def elem_of(value: SSAValue | Attribute) -> Attribute:
    t = value.type if isinstance(value, SSAValue) else value
    if not isinstance(t, TensorType):
        raise VerifyException(f"expected a ranked tensor, got {t}")
    return t.element_type


def numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def norm_axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise VerifyException(f"axis {axis} is out of range for rank {rank}")
    return a


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy broadcasting of static shapes; raises VerifyException when incompatible."""
    rank = max(len(s) for s in shapes)
    out: list[int] = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise VerifyException(
                f"shapes {', '.join(str(list(s)) for s in shapes)} do not broadcast"
            )
        out.append(dims.pop() if dims else 1)
    return tuple(out)


# --------------------------------------------------------------------------- op protocol


class Storage(StrEnum):
    """How `convert-top-to-tpu` types a float operand or result of an op
    (`ShapedOp.tpu_operand_storage`, `tpu_result_storage`); integer values keep their type."""

    #: the mode's activation type (f32 in the position math: float ops computed only from
    #: integer inputs, weights and constants)
    ACTIVATION = "activation"
    #: f32 whatever the mode (norm weights, biases, a recurrent state)
    F32 = "f32"
    #: as it comes (a `where`'s condition, rope's cos/sin: f32 position math)
    KEEP = "keep"


@dataclass(frozen=True)
class ConvertedWeight:
    """A weight an op's kernel converts to f32 at every run, which a runtime converts once
    per weight and keeps instead (its weight cache, the weight cache file): `form` "a16"
    (a `tpu.a16_matmul`'s packed integers with their scales and zero points or mins,
    dequantized: `kernels.dequantize`, `bits`, `group_size`) or "f32" (an f16/bf16 matmul
    weight, upcast); `operands` says where they are among the op's `operand_groups`
    (qweight, scales, zeros, mins; or the one weight)."""

    form: str
    operands: tuple[int, ...]
    bits: int = 0
    group_size: int = 0


class ShapedOp(IRDLOperation, SlicingInterface):
    """Base of every Top/Tpu compute op: the interfaces every stage reads of an op.

    - shape inference: `infer(operand_types, attributes)` (a classmethod, so builders can
      compute result types before the op exists); the verifier checks that the op's
      result types equal the inferred ones (`CHECK_INFERRED`);
    - its FLOP count: `flops()`;
    - its kernel binding, what the interpreters and the machine call
      (`toptpu.backend.reference`): `KERNEL` names the function of `kernels.py` (by
      default the op's kind: `top.rms_norm` -> `kernels.rms_norm`; a plugin's op names
      its own module, `KERNEL_MODULE`), called with
      `kernel_arguments(operand values)`: by default the operand values in declaration
      order (None for an absent optional operand) and `kernel_params()` as keywords (its
      attributes and result element types). `STRUCTURAL` ops have no kernel: dedicated code
      evaluates them (weights, constants, a layer group's loads and stores, collectives);
    - a reduction a layer group may split in parts (`REDUCTION_KERNELS`, see there);
    - its lowering to Tpu (`convert-top-to-tpu`): how it types its operands and results
      (`tpu_operand_storage`, `tpu_result_storage`, each a `Storage`) and whether it
      computes in f32 (`TPU_COMPUTES_F32`);
    - how a layer group may slice it: the `SlicingInterface` (rows, cols, heads, tiles,
      reduction parts; `dialects/slicing_interface.py`);
    - what it is to the passes that treat op families alike: `SOURCE` (a value given to
      the net: a weight, a constant), `INDEXES_TABLE` (it reads a table by index: its
      result is data, not index math), `ELEMENTWISE`, `MULTIPLY_ACCUMULATE` (the cost
      model's MAC ops, which run at their input type).
    """

    # operand groups as declared (optional operands may be absent)
    CHECK_INFERRED: ClassVar[bool] = True

    #: the function of `KERNEL_MODULE` computing the op ("": its kind)
    KERNEL: ClassVar[str] = ""
    #: the module holding the op's kernels (`KERNEL`, `REDUCTION_KERNELS`): toptpu's
    #: `kernels.py` for its own ops, the plugin's module for an op a plugin adds
    #: (`dialects/plugin_ops.py`)
    KERNEL_MODULE: ClassVar[str] = "toptpu.backend.reference.kernels"
    #: evaluated by dedicated code, not by a kernel binding (see the class doc)
    STRUCTURAL: ClassVar[bool] = False
    #: (fold, finish) kernels of a reduction a layer group splits in parts (`tpu.GroupOp`'s
    #: three tile counts): `fold(acc, *args, **kw)` adds one part into the f32 accumulator
    #: (`accumulator_type`; acc None for the first part) and returns it, `finish(acc, *args,
    #: **kw)` gives the result after the last part; None: the op has no such reduction
    REDUCTION_KERNELS: ClassVar[tuple[str, str] | None] = None
    #: convert-top-to-tpu: the Tpu op computes in f32 whatever its storage types (norms,
    #: softmax, attention, rope, matmuls); else in its result's type
    TPU_COMPUTES_F32: ClassVar[bool] = False
    #: a value given to the net rather than computed: a weight or a constant
    SOURCE: ClassVar[bool] = False
    #: it reads a table by index (a gather): its result is data, not index math, and the
    #: table it reads is looked up, not multiplied
    INDEXES_TABLE: ClassVar[bool] = False
    #: the matmul producing its first operand keeps a float weight in every mode (the MoE
    #: router: its logits choose the experts, so the weight-only modes leave it unquantized)
    FLOAT_PRODUCER: ClassVar[bool] = False
    #: each result element depends only on the operand elements at its index (broadcast)
    ELEMENTWISE: ClassVar[bool] = False
    #: a multiply-accumulate op (matmuls, attention, convolution): runs at the throughput
    #: of its input type, accumulating in f32
    MULTIPLY_ACCUMULATE: ClassVar[bool] = False

    @classmethod
    def op_kind(cls) -> str:
        """The op's name without its dialect (`top.silu` and `tpu.silu`: "silu"), the kind
        the kernels of an op family take."""
        return Dialect.split_name(cls.name)[1]

    @classmethod
    def infer(
        cls, operands: Sequence[SSAValue | None], attrs: Mapping[str, Attribute]
    ) -> list[TensorType]:
        raise NotImplementedError(f"{cls.name} has no shape inference")

    def operand_groups(self) -> list[SSAValue | None]:
        """Operands by declaration order; None where an optional operand is absent."""
        groups: list[SSAValue | None] = []
        for fname, _ in type(self).get_irdl_definition().operands:
            val = getattr(self, fname)
            if val is None or isinstance(val, SSAValue):
                groups.append(val)
            else:
                groups.extend(val)
        return groups

    def grouped(self, values: Sequence[SSAValue | None]
                ) -> list[SSAValue | Sequence[SSAValue] | None]:
        """`values`, one per operand in `operand_groups` order, as `build` takes operands:
        a variadic group's values as one list (the inverse of `operand_groups`)."""
        out: list[SSAValue | Sequence[SSAValue] | None] = []
        it = iter(values)
        for fname, _ in type(self).get_irdl_definition().operands:
            val = getattr(self, fname)
            if val is None or isinstance(val, SSAValue):
                out.append(next(it))
            else:
                group = [next(it) for _ in val]
                out.append([v for v in group if v is not None])
        return out

    def inferred_types(self) -> list[TensorType]:
        return type(self).infer(self.operand_groups(), self.attributes)

    def flops(self) -> int:
        return 0

    # ------------------------------------------------------------------ kernel binding
    @classmethod
    def kernel_name(cls) -> str:
        """The name of the op's function in its `KERNEL_MODULE`."""
        return cls.KERNEL or cls.op_kind()

    def result_dtype(self, index: int = 0) -> np.dtype:
        """The numpy dtype of result `index` (what the kernel rounds its result to)."""
        return numpy_dtype(elem_of(self.results[index]))

    def kernel_params(self) -> dict[str, object]:
        """The kernel's keyword arguments, from the op's attributes and result types."""
        return {}

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        """The kernel's positional and keyword arguments for the operand values `operands`
        (in `operand_groups` order, None for an absent optional operand)."""
        return operands, self.kernel_params()

    def converted_weight(self) -> ConvertedWeight | None:
        """The weight operands the op's kernel converts at every run (None: none)."""
        return None

    def quantized_weights(self) -> list[ConvertedWeight]:
        """Its quantized weights (form "a16"), each with the parameters its recipe
        quantizes another layer's float weight by (`passes.weight_recipe`): by default
        the one `converted_weight` (a `tpu.a16_matmul`'s), none for a float op."""
        conv = self.converted_weight()
        return [conv] if conv is not None and conv.form == "a16" else []

    # ------------------------------------------------------------------ reductions in parts
    def reduction_part_arguments(self, operands: Sequence[object], part: int
                                 ) -> tuple[Sequence[object], Mapping[str, object]]:
        """The fold kernel's arguments after the accumulator (`REDUCTION_KERNELS`) for part
        `part` of the reduction, its operands' values `operands`."""
        raise NotImplementedError(f"'{self.name}' has no reduction to split in parts")

    def reduction_finish_arguments(self, operands: Sequence[object]
                                   ) -> tuple[Sequence[object], Mapping[str, object]]:
        """The finish kernel's arguments after the accumulator (`REDUCTION_KERNELS`), the
        last part's operand values `operands`."""
        raise NotImplementedError(f"'{self.name}' has no reduction to split in parts")

    def accumulator_type(self) -> TensorType:
        """The f32 accumulator of the reduction split in parts: by default the result's
        shape (a matmul's product)."""
        return tensor(shape_of(self.results[0]), f32)

    # ------------------------------------------------------------------ lowering to Tpu
    def tpu_operand_storage(self) -> list[Storage]:
        """How convert-top-to-tpu types each operand, one per entry of `operand_groups`
        (absent optional operands and each operand of a variadic group included): by
        default the activation type."""
        return [Storage.ACTIVATION] * len(self.operand_groups())

    def tpu_result_storage(self) -> list[Storage]:
        """How convert-top-to-tpu types each result: by default the activation type."""
        return [Storage.ACTIVATION] * len(self.results)

    def verify_(self) -> None:
        if not self.CHECK_INFERRED:
            return
        if not all(is_ranked(v) for v in (*self.operands, *self.results)):
            return  # shape-infer has not run yet
        try:
            expected = self.inferred_types()
        except (VerifyException, ValueError, AssertionError, IndexError) as e:
            raise VerifyException(f"'{self.name}': {e}") from e
        got = [r.type for r in self.results]
        if len(expected) != len(got) or any(
            shape_of(a) != shape_of(b) or elem_of(a) != elem_of(b)
            for a, b in zip(expected, got, strict=False)
        ):
            raise VerifyException(
                f"'{self.name}' result types {[str(t) for t in got]} differ from the "
                f"inferred {[str(t) for t in expected]}"
            )

    @classmethod
    def build(  # type: ignore[override]  # also xDSL's keywords
        cls,
        operands: Sequence[SSAValue | Sequence[SSAValue] | None] = (),
        attrs: Mapping[str, Attribute | None] | None = None,
        result_types: Sequence[Attribute | Sequence[Attribute]] | None = None,
        *,
        attributes: Mapping[str, Attribute | None] | None = None,
        properties: Mapping[str, Attribute | None] | None = None,
        successors: Sequence[Block | Sequence[Block] | None] | None = None,
        regions: Sequence[Region | Sequence[Region]] | None = None,
    ) -> Self:
        """Create the op from operand groups (None for an absent optional operand) and
        attributes, inferring result types unless given. The generic form, for passes that
        rebuild any op of a family (`type(op).build(...)`); the commonly built ops have a
        typed constructor (`top.MatMulOp(x, w, transpose_b=True)`) that ends here too.
        Given `attributes` (the keywords of xDSL's own `build`, as a declarative assembly
        format's parser calls it), the op is built as xDSL builds it, from exactly what
        was parsed."""
        op = cls.__new__(cls)
        if attributes is None and properties is None and successors is None \
                and regions is None:
            # the ignore below: groups, as parsed
            op.construct(operands, attrs, result_types)  # type: ignore[arg-type]
            return op
        IRDLOperation.__init__(op, operands=[o if o is not None else [] for o in operands],
                               result_types=result_types, attributes=attributes,
                               properties=properties, successors=successors,
                               regions=regions)
        return op

    def construct(
        self,
        operands: Sequence[SSAValue | Sequence[SSAValue] | None],
        attrs: Mapping[str, Attribute | None] | None = None,
        result_types: Sequence[Attribute] | None = None,
    ) -> None:
        """Initialise this op as `build` describes (typed constructors call it); attributes
        given as None are left out."""
        cls = type(self)
        given = {k: v for k, v in (attrs or {}).items() if v is not None}
        flat: list[SSAValue | None] = []
        for o in operands:
            if o is None or isinstance(o, SSAValue):
                flat.append(o)
            else:
                flat.extend(o)
        if result_types is None:
            result_types = cls.infer(flat, given)
        opdef = cls.get_irdl_definition()
        n_opt = sum(1 for _, d in opdef.operands if type(d).__name__ != "OperandDef")
        if n_opt > 1:
            sizes = []
            for o in operands:
                if o is None:
                    sizes.append(0)
                elif isinstance(o, SSAValue):
                    sizes.append(1)
                else:
                    sizes.append(len(o))
            given = {**given, "operandSegmentSizes": DenseArrayBase.from_list(i32, sizes)}
        ops = [o if o is not None else [] for o in operands]
        IRDLOperation.__init__(self, operands=ops, attributes=given,
                               result_types=list(result_types))


# --------------------------------------------------------------------------- names


#: element type name -> numpy dtype (`numpy_dtype`)
NUMPY_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f64": np.dtype(np.float64),
    "i1": np.dtype(np.bool_),
    "i8": np.dtype(np.int8),
    "ui8": np.dtype(np.uint8),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
}


def numpy_dtype(t: Attribute) -> np.dtype:
    return NUMPY_DTYPES[dtype_name(t)]


def element_type_of_numpy(dt: DTypeLike) -> Attribute:

    dt = np.dtype(dt)
    table = {
        np.dtype(np.float32): f32,
        np.dtype(np.float16): f16,
        np.dtype(ml_dtypes.bfloat16): bf16,
        np.dtype(np.float64): f64,
        np.dtype(np.bool_): i1,
        np.dtype(np.int8): i8,
        np.dtype(np.uint8): ui8,
        np.dtype(np.int32): i32,
        np.dtype(np.int64): i64,
    }
    if dt not in table:
        raise ValueError(f"numpy dtype {dt} has no element type")
    return table[dt]


def dense_attr(arr: np.ndarray) -> DenseIntOrFPElementsAttr:
    elem = element_type_of_numpy(arr.dtype)
    shape = [int(d) for d in arr.shape]
    data = arr.reshape(-1)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        assert isinstance(elem, AnyFloat)
        return DenseIntOrFPElementsAttr.from_list(TensorType(elem, shape),
                                                  [float(x) for x in data.astype(np.float64)])
    assert isinstance(elem, IntegerType)
    return DenseIntOrFPElementsAttr.from_list(TensorType(elem, shape),
                                              [int(x) for x in data.astype(np.int64)])


def constant_value(attr: DenseIntOrFPElementsAttr) -> np.ndarray:
    """The value of a dense constant attribute as a numpy array of its element type (a
    splat filled to its shape)."""
    t = attr.get_type()
    assert isinstance(t, TensorType)
    dt = numpy_dtype(t.element_type)
    vals = attr.get_values()
    shape = tuple(t.get_shape())
    arr = np.array(vals, dtype=np.float64 if np.issubdtype(dt, np.floating) else None)
    if arr.size == 1 and int(np.prod(shape)) != 1:
        arr = np.full(shape, arr.reshape(-1)[0])
    return arr.reshape(shape).astype(dt)
