"""How each Tpu op can be sliced for a layer group.

The slicing kinds:

- **rows**: every op in the group computes the same range of token rows. For each op the
  rule names the axis of the result that holds the rows and, per operand, the axis the
  rows come from, or None when the op needs that operand whole (weights, the keys/values
  of attention, a broadcast operand).
- **cols**: one matmul with a weight operand computes a range of output channels at a
  time: its weight (and scales, zeros, bias) tiles stream in while the activation stays
  resident. This is what decode (one token row) needs to overlap weight loading with
  compute.
- **heads**: one attention computes a range of KV-head groups at a time (each KV head with
  its query heads): queries, keys, values, history and output stream by heads, so the
  keys and values of a long sequence never need to be resident whole (decode over a long
  KV cache, multi-head models). Heads are independent: the numbers do not change. Linear
  attention's ops slice the same way: a gated delta rule by key heads (each with its value
  heads: q, k, v, g, beta, the output and the recurrent state stream by heads, so a 2 MB
  f32 state never needs to be resident whole), a causal conv by channels (input, taps,
  conv state and output; the valid flags whole). Heads and channels are independent.
- **tiles**: one weight matmul computes a 2-D tile at a time, a block of token rows times
  a block of output channels: the activation streams by rows, the weight (scales, zeros,
  bias) by output channels, the result by both (`tpu.GroupOp.tile_grid`), so neither the
  whole activation nor the whole weight needs to be resident (prefill of large layers).
  Each output element is still one whole reduction over K: the numbers do not change.
  An attention tiles the same way by query rows and KV-head groups (the second loop is
  then the heads'): queries and output by both, keys, values and history by heads, the
  mask by rows (and heads when it has them), so neither the keys and values of every head
  nor the mask of every row need to be resident (long prefill over a history).

- **reduction parts** (a third tile loop, inside the other two): a float weight matmul
  computes each tile over parts of K (an a16_matmul over whole quantization groups: its
  weight, scales and zero points are cut along K with the activation), an attention
  without history over parts of its keys (keys, values and the mask's columns), each part
  folded into an f32 accumulator in local memory (`tpu.GroupOp`): a partial sum, a running
  max and sum (online softmax). The parts are summed in their order: the numbers change
  within f32 rounding of the sums (the tolerance is stated where it is tested).

A group with a single slice needs no rule: every tensor is whole.

Each op answers how it slices itself (`toptpu.dialects.slicing_interface.SlicingInterface`,
the rules on the op classes); the functions here ask it and derive what layer-group plans
with: the row axis of a span, the axes of each tiles loop, of the reduction parts.
"""

from __future__ import annotations

from xdsl.ir import Operation

from toptpu.dialects.common import shape_of
from toptpu.dialects.slicing_interface import (
    RowRule,
    SliceKind,
    SlicingInterface,
    token_axis,
)

__all__ = ["RowRule", "SliceKind", "token_axis"]


def row_rule(op: Operation) -> RowRule | None:
    """How `op` slices along token rows (the first non-unit axis of its first result
    before the feature axis), or None when it cannot."""
    if not isinstance(op, SlicingInterface) or not op.results:
        return None
    r = token_axis(shape_of(op.results[0]))
    if r is None:
        return None
    return op.row_rule(r)


def col_sliceable(op: Operation) -> bool:
    """A matmul whose right operand is a 2-D weight [N, K] (transpose_b) or an a16_matmul."""
    return isinstance(op, SlicingInterface) and op.col_sliceable()


def col_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """For a cols slice: activation whole, weight-like operands along their N axis (0)."""
    return (None, *(0 for _ in op.operands[1:]))


def col_result_axis(op: Operation) -> int:
    return len(shape_of(op.results[0])) - 1


def col_count(op: Operation) -> int:
    return shape_of(op.results[0])[-1]


def _by_heads(op: Operation) -> bool:
    """Whether the second loop of `op`'s tiles is the heads' (else the output channels')."""
    return isinstance(op, SlicingInterface) and op.tile_loop() == SliceKind.HEADS


def tile_sliceable(op: Operation) -> bool:
    """A weight matmul (`col_sliceable`) or an attention with KV heads to slice
    (`heads_sliceable`) whose first input also slices by rows (`row_rule`)."""
    if not (col_sliceable(op) or heads_sliceable(op)):
        return False
    rule = row_rule(op)
    return rule is not None and rule.operand_axes[0] is not None


def tile_count(op: Operation) -> int:
    """How many blocks the second tile loop may cut: output channels or KV heads."""
    return heads_count(op) if _by_heads(op) else col_count(op)


def _tile_rows(op: Operation) -> RowRule | None:
    """The row rule of a tiles slice: `row_rule` where it slices the first input, None
    for an op of one row (decode: the row loop has one block)."""
    rule = row_rule(op)
    return rule if rule is not None and rule.operand_axes[0] is not None else None


def tile_operand_axes(op: Operation) -> tuple[tuple[int, int], ...]:
    """For a tiles slice, per operand (row axis, second loop's axis), -1 where that loop
    does not slice it: a matmul's activation by its rows, weight-like operands by their N
    axis; an attention's operands by their rows (`row_rule`) and heads
    (`heads_operand_axes`). No row axes for an op of one row."""
    rule = _tile_rows(op)
    rows = rule.operand_axes if rule is not None else (None,) * len(op.operands)
    second = heads_operand_axes(op) if _by_heads(op) else col_operand_axes(op)
    return tuple((-1 if r is None else r, -1 if c is None else c)
                 for r, c in zip(rows, second, strict=True))


def tile_result_axes(op: Operation) -> tuple[int, int]:
    rule = _tile_rows(op)
    rows = rule.result_axes[0] if rule is not None else None
    second = heads_result_axes(op)[0] if _by_heads(op) else col_result_axis(op)
    return -1 if rows is None else rows, second


def heads_sliceable(op: Operation) -> bool:
    """An attention with more than one KV head, a gated delta rule with more than one key
    head, a causal conv with more than one channel."""
    return heads_count(op) > 1


def heads_count(op: Operation) -> int:
    """The units a heads slice divides: KV heads (each with its query heads), key heads
    (each with its value heads), conv channels; 1 for an op without heads."""
    return op.heads_count() if isinstance(op, SlicingInterface) else 1


def heads_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """For a heads slice, per operand (flat order): an attention's q, k, v and history
    along their head axis (2), its mask along its head axis (1) when it has one per query
    head, else whole; a delta rule's q, k, v, g, beta along their head axis (2) and its
    state along its value-head axis (1); a conv's input and state along their channel axis
    (2), its taps along theirs (0), its valid flags whole."""
    assert isinstance(op, SlicingInterface)
    return op.heads_operand_axes()


def heads_result_axes(op: Operation) -> tuple[int, ...]:
    """For a heads slice, per result: the output's head (or channel) axis, a delta rule's
    new state's value-head axis (1), a conv's new state's channel axis (2)."""
    assert isinstance(op, SlicingInterface)
    return op.heads_result_axes()


def reduction_sliceable(op: Operation) -> bool:
    """An op whose reduction may be cut in parts (tiled by rows, when it has more than
    one, and output channels or KV heads): a float weight matmul (K), an a16_matmul, an
    attention without history, not causal (its keys)."""
    return isinstance(op, SlicingInterface) and op.reduction_sliceable()


def reduction_count(op: Operation) -> int:
    """The most parts the reduction may be cut in: an attention's keys, a matmul's K, an
    a16_matmul's quantization groups (a group of K stays whole), or its K when one group
    spans all of K (per channel: every part shares the channel's scale)."""
    assert isinstance(op, SlicingInterface)
    return op.reduction_count()


def reduction_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """Per operand, the axis the reduction parts cut (None: the same in every part): an
    attention's keys and values along their sequence (1), the mask along its last axis
    when it has a column per key; a matmul's activation along its last axis (K), its
    weight-like operands of two axes along their second (K, or K's packed bytes or
    groups: scales, zero points, any per-group operand of an a16_matmul; not a per-channel
    one, [N, 1]), the bias never."""
    assert isinstance(op, SlicingInterface)
    return op.reduction_operand_axes()


def reduction_tile_axes(op: Operation) -> tuple[tuple[int, int, int], ...]:
    """For tiles with reduction parts, per operand (row axis, second loop's axis,
    reduction axis), -1 where that loop does not cut it."""
    red = reduction_operand_axes(op)
    return tuple((*ax, -1 if r is None else r)
                 for ax, r in zip(tile_operand_axes(op), red, strict=True))
