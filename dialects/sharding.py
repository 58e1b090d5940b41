"""How a tensor is split over several devices: shard weights and the layout of net IO.

Tensor parallelism runs one program on every device (SPMD): the same net, each device
with its own piece of the weights and of some inputs and outputs. Two facts say which
piece:

- a **shard weight** is named after the weight it is cut from: `W@shard<axis>-<pieces>` is
  `W` cut along `axis` into `pieces` equal, contiguous pieces (`shard_name`,
  `parse_shard_name`). Every device's program reads the same name; device d's weight blob
  holds piece `piece_of(d, devices, pieces)`. With fewer pieces than devices the pieces
  are replicated: a model with 2 KV heads on 4 devices cuts k_proj in 2 pieces, devices
  0 and 1 hold the first, 2 and 3 the second (devices // pieces consecutive devices share
  a piece);
- a net input or output split the same way carries the function attribute
  `dev.split = array<i64: axis, pieces>` (`arg_split`, `result_split`; absent: the whole
  tensor on every device).

Nothing here knows a model: the tensor-parallel pass (`toptpu.passes.tensor_parallel`)
decides the splits, the compiler cuts the weights with `take_piece`, the runtime binds each
device's piece of a split buffer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, DictionaryAttr, i64

from toptpu.errors import ToptpuError

#: the function argument / result attribute of a split net input or output
SPLIT_ATTR = "dev.split"

_SHARD = re.compile(r"(.+)@shard(\d+)-(\d+)")


class ShardingError(ToptpuError, ValueError):
    """A split that cannot be: pieces that do not divide an axis or the devices."""


@dataclass(frozen=True)
class Split:
    """A tensor cut along `axis` into `pieces` equal contiguous pieces."""

    axis: int
    pieces: int

    def __post_init__(self) -> None:
        if self.axis < 0 or self.pieces < 1:
            raise ShardingError(f"a split needs an axis >= 0 and pieces >= 1, got axis "
                                f"{self.axis}, {self.pieces} pieces")

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one piece of a tensor of `shape`."""
        if self.axis >= len(shape) or shape[self.axis] % self.pieces:
            raise ShardingError(f"{self.pieces} pieces do not divide axis {self.axis} of "
                                f"{list(shape)}")
        out = list(shape)
        out[self.axis] //= self.pieces
        return tuple(out)

    def whole_shape(self, part: tuple[int, ...]) -> tuple[int, ...]:
        out = list(part)
        out[self.axis] *= self.pieces
        return tuple(out)


def piece_of(device: int, devices: int, pieces: int) -> int:
    """The piece device `device` of `devices` holds when a tensor is cut in `pieces`."""
    if devices % pieces or not 0 <= device < devices:
        raise ShardingError(f"{pieces} pieces cannot be spread over {devices} devices "
                            f"(device {device})")
    return device * pieces // devices


def take_piece(arr: np.ndarray, split: Split, device: int, devices: int) -> np.ndarray:
    """Device `device`'s piece of `arr` (a view)."""
    size = split.part_shape(tuple(arr.shape))[split.axis]
    k = piece_of(device, devices, split.pieces)
    index = [slice(None)] * arr.ndim
    index[split.axis] = slice(k * size, (k + 1) * size)
    return arr[tuple(index)]


def shard_name(base: str, split: Split) -> str:
    """The name of the shard weight cut from `base` by `split`."""
    return f"{base}@shard{split.axis}-{split.pieces}"


def parse_shard_name(name: str) -> tuple[str, Split] | None:
    """(the weight it is cut from, the split) of a shard weight's name; None otherwise."""
    m = _SHARD.fullmatch(name)
    if m is None:
        return None
    return m.group(1), Split(int(m.group(2)), int(m.group(3)))


def base_name(name: str) -> str:
    """The weight a (shard) weight's tensor comes from: `name` for a whole one."""
    parsed = parse_shard_name(name)
    return name if parsed is None else parsed[0]


def device_tensor(name: str, whole: Callable[[str], np.ndarray], device: int,
                  devices: int) -> np.ndarray:
    """The tensor device `device` holds under `name`: the piece of a shard weight (cut
    from `whole(base)`), or `whole(name)`."""
    parsed = parse_shard_name(name)
    if parsed is None:
        return whole(name)
    base, split = parsed
    return take_piece(whole(base), split, device, devices)


# ------------------------------------------------------------------ net IO layouts


def _split_of(attrs: ArrayAttr | None, i: int) -> Split | None:
    if attrs is None or i >= len(attrs.data):
        return None
    d = attrs.data[i]
    if not isinstance(d, DictionaryAttr):
        return None
    a = d.data.get(SPLIT_ATTR)
    if not isinstance(a, DenseArrayBase):
        return None
    values = a.get_values()
    if len(values) != 2:
        raise ShardingError(f"{SPLIT_ATTR} is [axis, pieces], got {list(values)}")
    return Split(int(values[0]), int(values[1]))


def _with_split(attrs: ArrayAttr[DictionaryAttr] | None, n: int, i: int, split: Split | None
                ) -> ArrayAttr[DictionaryAttr]:
    dicts = [attrs.data[j] if attrs is not None and j < len(attrs.data) else DictionaryAttr({})
             for j in range(n)]
    d = dict(dicts[i].data)
    if split is None:
        d.pop(SPLIT_ATTR, None)
    else:
        d[SPLIT_ATTR] = DenseArrayBase.from_list(i64, [split.axis, split.pieces])
    dicts[i] = DictionaryAttr(d)
    return ArrayAttr(dicts)


def arg_split(fn: func.FuncOp, i: int) -> Split | None:
    return _split_of(fn.arg_attrs, i)


def result_split(fn: func.FuncOp, i: int) -> Split | None:
    return _split_of(fn.res_attrs, i)


def set_arg_split(fn: func.FuncOp, i: int, split: Split | None) -> None:
    fn.arg_attrs = _with_split(fn.arg_attrs, len(fn.function_type.inputs.data), i, split)


def set_result_split(fn: func.FuncOp, i: int, split: Split | None) -> None:
    fn.res_attrs = _with_split(fn.res_attrs, len(fn.function_type.outputs.data), i, split)
