"""The dev dialect: collectives between the devices that run one net together.

A net compiled for several devices (tensor parallel) is one program that every device runs
on its own piece of the data (SPMD, see `toptpu.dialects.sharding`). Where the pieces must
meet, the program holds a collective; the tensor-parallel pass
(`toptpu.passes.tensor_parallel`) places them, at the Top level, and they stay through the
Tpu level to codegen, which makes each one a command of the link engine
(`toptpu.backend.formats.commands.Collective`):

- `dev.all_reduce` (`input` -> the elementwise sum of every device's `input`, on every
  device): after a row-parallel matmul, whose devices each hold a partial sum;
- `dev.all_gather` (`input` -> every device's `input` concatenated along `axis` in device
  order, on every device): where an op needs the whole of a split tensor.

Both carry `devices` (how many devices take part) and `algorithm` (`ring` or `tree`, how the
link moves the data: `toptpu.backend.target.link`), which fixes the order of the sums
(`toptpu.backend.reference.kernels.all_reduce`) as well as the time. Neither is pure: a
collective is never removed, duplicated or moved by a canonicalization.

The ops belong to neither level: Top IR and Tpu IR may both hold them. Layer groups never
span one (`layer-group` groups the ops between collectives); address-assign gives its
result an activation offset (`gaddr`) like a group's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from xdsl.dialects.builtin import IntegerAttr, StringAttr, TensorType
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import attr_def, irdl_op_definition, operand_def, opt_attr_def, result_def
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.common import (
    AnyTensor,
    ShapedOp,
    elem_of,
    i64_attr,
    int_value_attr,
    is_float,
    norm_axis,
    numel,
    read_int,
    shape_of,
    str_attr,
    tensor,
)

Operands = Sequence[SSAValue | None]
Attrs = Mapping[str, Attribute]

#: how a collective moves its data (`toptpu.backend.target.link.ALGORITHMS`)
ALGORITHMS = ("ring", "tree")


def _check_common(attrs: Attrs) -> tuple[int, str]:
    devices = read_int(attrs.get("devices"))
    if devices < 2:
        raise VerifyException(f"a collective joins at least 2 devices, not {devices}")
    alg = attrs.get("algorithm")
    name = alg.data if isinstance(alg, StringAttr) else None
    if name not in ALGORITHMS:
        raise VerifyException(f"algorithm must be one of {', '.join(ALGORITHMS)}, not "
                              f"{name!r}")
    return devices, name


class CollectiveOp(ShapedOp):
    """A collective over `devices` devices, moved by `algorithm`."""

    input = operand_def(AnyTensor)
    devices = attr_def(IntegerAttr)
    algorithm = attr_def(StringAttr)
    #: where its result lies in the net's activation region (address-assign's; -1: it is
    #: an output of the net)
    gaddr = opt_attr_def(IntegerAttr)
    output = result_def(AnyTensor)

    #: the collective's kind in the link model (`toptpu.backend.target.link.COLLECTIVES`)
    KIND: ClassVar[str] = ""
    #: its kernel (`kernels.all_reduce`, `all_gather`: the op's kind) combines the values
    #: of all devices: a device alone cannot evaluate it (`interpreter.run_spmd` does)
    STRUCTURAL: ClassVar[bool] = True

    def kernel_arguments(self, operands: Sequence[object]
                         ) -> tuple[Sequence[object], Mapping[str, object]]:
        """The kernel's arguments for `operands`, the input's value on every device in
        device order."""
        return [list(operands)], self.kernel_params()

    @property
    def device_count(self) -> int:
        return read_int(self.devices)

    @property
    def algorithm_name(self) -> str:
        return self.algorithm.data

    @property
    def result_offset(self) -> int | None:
        """Its result's activation offset (address-assign's), -1 for an output, None before
        address-assign."""
        return None if self.gaddr is None else read_int(self.gaddr)

    def result_offsets(self) -> list[int] | None:
        """Its result's activation offset as a list (a stage's, as `tpu.GroupOp` has them:
        `tpu.stages`), None before address-assign."""
        return None if self.gaddr is None else [read_int(self.gaddr)]

    def set_result_offsets(self, offsets: Sequence[int]) -> None:
        """Record its result's activation offset (address-assign; -1: an output)."""
        (self.gaddr,) = (i64_attr(o) for o in offsets)

    @property
    def link_axis(self) -> int:
        """The axis its link command names: the concatenation's (0 for a sum)."""
        return 0


@irdl_op_definition
class AllReduceOp(CollectiveOp):
    """The elementwise sum of every device's `input`, on every device."""

    name = "dev.all_reduce"
    KIND: ClassVar[str] = "all_reduce"

    def kernel_params(self) -> dict[str, object]:
        return {"algorithm": self.algorithm_name}

    def __init__(self, input: SSAValue, devices: int, algorithm: str) -> None:
        self.construct([input], {"devices": int_value_attr(f"{self.name} devices", devices),
                                 "algorithm": str_attr(algorithm)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        _check_common(attrs)
        if not is_float(elem_of(x)):
            raise VerifyException("dev.all_reduce sums floats")
        return [tensor(shape_of(x), elem_of(x))]

    def flops(self) -> int:
        """The adds one device makes (ring: N - 1 parts of 1/N; tree: log2 N wholes)."""
        n, size = self.device_count, numel(shape_of(self.input))
        if self.algorithm_name == "ring":
            return (n - 1) * -(-size // n)
        return (n - 1).bit_length() * size


@irdl_op_definition
class AllGatherOp(CollectiveOp):
    """Every device's `input` concatenated along `axis` in device order, on every device."""

    name = "dev.all_gather"
    KIND: ClassVar[str] = "all_gather"
    axis = attr_def(IntegerAttr)

    def kernel_params(self) -> dict[str, object]:
        return {"axis": self.gather_axis}

    def __init__(self, input: SSAValue, axis: int, devices: int, algorithm: str) -> None:
        self.construct([input], {"axis": int_value_attr(f"{self.name} axis", axis),
                                 "devices": int_value_attr(f"{self.name} devices", devices),
                                 "algorithm": str_attr(algorithm)})

    @classmethod
    def infer(cls, operands: Operands, attrs: Attrs) -> list[TensorType]:
        x = operands[0]
        assert x is not None
        devices, _ = _check_common(attrs)
        shape = list(shape_of(x))
        axis = norm_axis(read_int(attrs.get("axis")), len(shape))
        shape[axis] *= devices
        return [tensor(shape, elem_of(x))]

    @property
    def gather_axis(self) -> int:
        return norm_axis(read_int(self.axis), len(shape_of(self.input)))

    @property
    def link_axis(self) -> int:
        return self.gather_axis


COLLECTIVES = (AllReduceOp, AllGatherOp)

Dev = Dialect("dev", [AllReduceOp, AllGatherOp])
