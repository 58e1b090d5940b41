"""The slicing interface: how a layer group may slice an op, answered by the op.

Every Top and Tpu op (`common.ShapedOp`) is a `SlicingInterface`; an op class overrides
the answers for the slicings it allows, and the defaults say it allows none. The slicing
kinds (`SliceKind`) are those of passes/slicing.py, whose module doc says what each means;
layer-group (passes/layer_group.py) plans through this interface only, as MLIR's
TilingInterface lets a tiling pass ask an op how it tiles:

- **rows** (`row_rule`): per operand and result, the axis holding the token rows of a
  slice, or None where the op needs that operand whole;
- **cols** (`col_sliceable`): a weight matmul computes a range of output channels at a time
  (activation whole, weight-like operands along their first axis, the result along its
  last);
- **heads** (`heads_count`, `heads_operand_axes`, `heads_result_axes`): independent units
  (KV heads, key heads, conv channels) sliced together over every operand;
- **tiles** (`tile_loop`): rows times a second loop, the output channels' or the heads';
- **reduction parts** (`reduction_sliceable`, `reduction_count`, `reduction_operand_axes`):
  the reduction cut in parts folded into an f32 accumulator (`tpu.accumulator_type`).

How a slice is built: `sliced_attributes` gives the attributes that change in a copy of the
op computing one slice (a reshape's target shape, an attention's head counts); a gather
reads its table row by row from global memory (`row_gather_table`); weights and constants
are `GLOBAL_SOURCE`s (in global memory before the net runs: loaded, never computed).

This module knows no op: it declares the interface and the helpers the ops' answers share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from xdsl.dialects.builtin import ShapedType
from xdsl.ir import Attribute, Operation, SSAValue


class SliceKind(StrEnum):
    """How a layer group slices (see passes/slicing.py's module doc)."""

    ROWS = "rows"
    COLS = "cols"
    HEADS = "heads"
    TILES = "tiles"


@dataclass(frozen=True)
class RowRule:
    """How an op slices along token rows."""

    operand_axes: tuple[int | None, ...]  # per operand (flat order); None = whole
    result_axes: tuple[int | None, ...]  # per result; None = whole (not sliceable)


def token_axis(shape: Sequence[int]) -> int | None:
    """The axis holding token rows: the first non-unit axis before the feature axis."""
    for i, d in enumerate(shape[:-1]):
        if d > 1:
            return i
    return None


class Misaligned:
    """`aligned_axis`'s answer for an operand whose axis neither holds the result's rows nor
    broadcasts along them."""


#: the one `Misaligned` answer
MISALIGNED = Misaligned()


def aligned_axis(operand_shape: Sequence[int], result_shape: Sequence[int],
                 r: int) -> int | None | Misaligned:
    """The operand axis broadcast-aligned with result axis r: an int when the operand holds
    those rows, None when it is broadcast along them, `MISALIGNED` otherwise."""
    off = len(result_shape) - len(operand_shape)
    a = r - off
    if a < 0 or operand_shape[a] == 1:
        return None
    if operand_shape[a] == result_shape[r]:
        return a
    return MISALIGNED


def _shape(v: SSAValue) -> tuple[int, ...]:
    t = v.type
    assert isinstance(t, ShapedType), t
    return tuple(t.get_shape())


def broadcast_row_rule(op: Operation, r: int) -> RowRule | None:
    """The row rule of an op computing each output row from the same rows of its operands,
    broadcast numpy-style (elementwise ops, norms over the last axis, rope): each operand
    sliced along the axis aligned with result axis `r`, whole where it broadcasts; None
    when an operand's axis is neither."""
    out = _shape(op.results[0])
    axes: list[int | None] = []
    for v in op.operands:
        a = aligned_axis(_shape(v), out, r)
        if isinstance(a, Misaligned):
            return None
        axes.append(a)
    return RowRule(tuple(axes), (r,))


def same_rows(op: Operation, r: int) -> RowRule:
    """Every operand and result sliced along axis `r` (ops whose operands have the
    result's rank and rows: concat off its axis, a merge of attention parts)."""
    return RowRule(tuple(r for _ in op.operands), tuple(r for _ in op.results))


def activation_rows(op: Operation, r: int) -> RowRule | None:
    """The row rule of a matmul: its first operand (the activation, of the result's rank)
    along the rows, the others (weight, scales, zero points, bias) whole; None when the
    rows are not before the output channels' axis."""
    out = _shape(op.results[0])
    if r >= len(out) - 1 or len(_shape(op.operands[0])) != len(out):
        return None
    return RowRule((r, *([None] * (len(op.operands) - 1))), (r,))


def weight_reduction_axes(op: Operation) -> tuple[int | None, ...]:
    """The reduction axes of a weight matmul's parts: the activation's last axis (K), each
    weight-like operand of two axes along its second (K, or K's packed bytes or groups:
    scales, zero points, any per-group operand; not a per-channel one, [N, 1]), the bias
    never."""
    x = op.operands[0]
    return (len(_shape(x)) - 1,
            *(1 if len(_shape(v)) == 2 and _shape(v)[1] > 1 else None
              for v in op.operands[1:]))


class SlicingInterface:
    """What a layer group asks an op (see the module doc); the defaults allow no slicing.

    Operand and result axes are per operand in flat order (`op.operands`) and per result.
    """

    #: what one unit of a heads slice is called in messages ("KV-head", "channel")
    HEADS_UNIT: ClassVar[str] = "head"
    #: a value in global memory before the net runs (weights, constants): a layer group
    #: loads it, never computes it
    GLOBAL_SOURCE: ClassVar[bool] = False

    # ------------------------------------------------------------------ rows
    def row_rule(self, axis: int) -> RowRule | None:
        """How the op slices along token rows held by axis `axis` of its first result, or
        None when it cannot (the default)."""
        return None

    def row_gather_table(self) -> SSAValue | None:
        """The operand the op reads row by row from global memory when it is an input of
        the group (an embedding table), never loaded whole; None (the default): none."""
        return None

    def fetched_by_index(self) -> dict[int, int]:
        """The operands of which the op reads only the rows (along axis 0) its index
        operand names, by operand position -> the index operand's position (a MoE experts
        op's stacked expert weights, read at the router's expert indices; negative entries
        name no row). A group loads such an operand by index (`tpu.load` with
        `by_index`): only those rows move. Empty (the default): none."""
        return {}

    # ------------------------------------------------------------------ cols
    def col_sliceable(self) -> bool:
        """Whether the op computes a range of output channels at a time: its first operand
        whole, the others along their axis 0, its result along its last axis."""
        return False

    # ------------------------------------------------------------------ heads
    def heads_count(self) -> int:
        """The independent units a heads slice divides (1, the default: none)."""
        return 1

    def heads_operand_axes(self) -> tuple[int | None, ...]:
        """For a heads slice, per operand: the axis of its units, None for whole."""
        return tuple(None for _ in self._sliced_operands())

    def heads_result_axes(self) -> tuple[int, ...]:
        """For a heads slice, per result: the axis of its units."""
        raise NotImplementedError(f"{type(self).__name__} has no heads slice")

    # ------------------------------------------------------------------ tiles
    def tile_loop(self) -> SliceKind:
        """The second loop of a tiles slice (the first is the rows'): COLS (the default:
        a weight matmul's output channels) or HEADS (an attention's KV heads). An op
        tiles when it slices by that loop and its first operand by rows."""
        return SliceKind.COLS

    # ------------------------------------------------------------------ reduction parts
    def reduction_sliceable(self) -> bool:
        """Whether the op's reduction may be cut in parts (False, the default)."""
        return False

    def reduction_count(self) -> int:
        """The most parts the reduction may be cut in."""
        return 1

    def reduction_operand_axes(self) -> tuple[int | None, ...]:
        """Per operand, the axis the reduction parts cut (None: the same in every part)."""
        return tuple(None for _ in self._sliced_operands())

    def expert_block_axes(self) -> tuple[int | None, ...] | None:
        """A second way to cut the reduction in parts, for an op whose sum runs over the
        experts its indices name (`fetched_by_index`): blocks of consecutive experts, per
        operand the axis a block cuts (None: the same in every part). None (the default):
        the op has none."""
        return None

    # ------------------------------------------------------------------ building a slice
    def sliced_attributes(self, result_types: Sequence[Attribute], heads: int = 1,
                          parts: int = 1) -> dict[str, Attribute]:
        """The attributes that differ in a copy of the op computing one slice, whose
        results have `result_types`, over 1/`heads` of its heads (a heads slice or a tile
        of the heads loop) and 1/`parts` of its reduction; {} (the default): none."""
        return {}

    def _sliced_operands(self) -> Sequence[SSAValue]:
        assert isinstance(self, Operation)
        return self.operands
