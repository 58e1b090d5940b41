"""How each Tpu op can be sliced for a layer group.

Two slicing kinds exist:

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from xdsl.ir import Operation, SSAValue

from toptpu.dialects import top, tpu
from toptpu.dialects.common import elem_of, is_float, read_bool, read_int, read_ints, shape_of


class SliceKind(StrEnum):
    """How a layer group slices (see the module doc)."""

    ROWS = "rows"
    COLS = "cols"
    HEADS = "heads"
    TILES = "tiles"


@dataclass(frozen=True)
class RowRule:
    operand_axes: tuple[int | None, ...]  # per operand (flat order); None = whole
    result_axes: tuple[int | None, ...]  # per result; None = whole (not sliceable)


def token_axis(shape: tuple[int, ...]) -> int | None:
    """The axis holding token rows: the first non-unit axis before the feature axis."""
    for i, d in enumerate(shape[:-1]):
        if d > 1:
            return i
    return None


def _aligned_axis(operand_shape: tuple[int, ...], result_shape: tuple[int, ...],
                  r: int) -> int | None | str:
    """The operand axis broadcast-aligned with result axis r: an int when the operand holds
    those rows, None when it is broadcast along them, "bad" otherwise."""
    off = len(result_shape) - len(operand_shape)
    a = r - off
    if a < 0 or operand_shape[a] == 1:
        return None
    if operand_shape[a] == result_shape[r]:
        return a
    return "bad"


def row_rule(op: Operation) -> RowRule | None:
    """How `op` slices along token rows, or None when it cannot."""
    if not op.results:
        return None
    out = shape_of(op.results[0])
    r = token_axis(out)
    if r is None:
        return None
    if isinstance(op, top.UnaryOp | top.BinaryOp | top.WhereBase | top.CompareBase |
                  top.CastBase | top.RopeBase | top.RmsNormBase | top.LayerNormBase):
        if isinstance(op, top.SoftmaxBase) and read_int(op.axis) % len(out) == r:
            return None
        if isinstance(op, top.LayerNormBase) and read_int(op.axis) % len(out) <= r:
            return None
        axes: list[int | None] = []
        for v in op.operands:
            a = _aligned_axis(shape_of(v), out, r)
            if a == "bad":
                return None
            axes.append(a)  # type: ignore[arg-type]
        return RowRule(tuple(axes), (r,))
    if isinstance(op, top.MatMulBase | tpu.A16MatMulOp):
        x = op.operands[0]
        xs = shape_of(x)
        if isinstance(op, top.MatMulBase):
            if read_bool(op.transpose_a) or len(shape_of(op.rhs)) != 2:
                return None
        if r >= len(out) - 1 or len(xs) != len(out):
            return None
        return RowRule((r, *([None] * (len(op.operands) - 1))), (r,))
    if isinstance(op, tpu.AttentionMergeOp):  # row-local over its parts
        return RowRule(tuple(r for _ in op.operands), (r,))
    if isinstance(op, top.AttentionBase):
        if r != 1 or read_bool(op.causal):  # a causal mask's diagonal depends on the row
            return None
        axes = [1]
        for i, v in enumerate(op.operands[1:], start=1):
            if op.mask is not None and v is op.mask and i == 3:
                ms = shape_of(v)
                axes.append(2 if ms[2] == out[1] and ms[2] > 1 else None)
            else:
                axes.append(None)
        return RowRule(tuple(axes), (1,))
    if isinstance(op, top.GatherBase):
        ax = read_int(op.axis)
        idx = shape_of(op.indices)
        if ax != 0 or r >= len(idx):
            return None
        return RowRule((None, r), (r,))
    if isinstance(op, top.ReshapeBase):
        ins = shape_of(op.input)
        a = token_axis(ins)
        if a is None:
            return None
        # the same rows, or rows merged with the axes after them ([1, T, H, D] -> [T*H, D])
        # or split back: with equal leading axes, a block of rows along one is a block of
        # rows along the other (the slice count divides both: layer-group checks)
        if math.prod(ins[:a]) == math.prod(out[:r]) and (
                ins[a] == out[r] or max(ins[a], out[r]) % min(ins[a], out[r]) == 0):
            return RowRule((a,), (r,))
        return None
    if isinstance(op, top.PermuteBase):
        order = read_ints(op.order)
        return RowRule((order[r],), (r,))
    if isinstance(op, top.ExpandBase):
        a = _aligned_axis(shape_of(op.input), out, r)
        if a is None or a == "bad":
            return None
        return RowRule((a,), (r,))  # type: ignore[arg-type]
    if isinstance(op, top.ReduceBase):
        axes_ = {x % len(shape_of(op.input)) for x in read_ints(op.axes)}
        if r in axes_ or not read_bool(op.keepdims):
            return None
        return RowRule((r,), (r,))
    if isinstance(op, top.SoftmaxBase):
        if read_int(op.axis) % len(out) == r:
            return None
        return RowRule((r,), (r,))
    if isinstance(op, top.ConcatBase | top.SliceBase):
        if read_int(op.axis) % len(out) == r:
            return None
        return RowRule(tuple(r for _ in op.operands), (r,))
    if isinstance(op, top.TopKBase):
        if read_int(op.axis) % len(out) == r:
            return None
        return RowRule((r,), (r, r))
    return None


def col_sliceable(op: Operation) -> bool:
    """A matmul whose right operand is a 2-D weight [N, K] (transpose_b) or an a16_matmul."""
    if isinstance(op, tpu.A16MatMulOp):
        return True
    if isinstance(op, tpu.MatMulOp):
        w = op.rhs.owner
        return (isinstance(w, tpu.WeightOp) and read_bool(op.transpose_b)
                and not read_bool(op.transpose_a) and len(shape_of(op.rhs)) == 2)
    return False


def col_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """For a cols slice: activation whole, weight-like operands along their N axis (0)."""
    return (None, *(0 for _ in op.operands[1:]))


def col_result_axis(op: Operation) -> int:
    return len(shape_of(op.results[0])) - 1


def col_count(op: Operation) -> int:
    return shape_of(op.results[0])[-1]


def tile_sliceable(op: Operation) -> bool:
    """A weight matmul (`col_sliceable`) or an attention with KV heads to slice
    (`heads_sliceable`) whose first input also slices by rows (`row_rule`)."""
    if not (col_sliceable(op) or heads_sliceable(op)):
        return False
    rule = row_rule(op)
    return rule is not None and rule.operand_axes[0] is not None


def tile_count(op: Operation) -> int:
    """How many blocks the second tile loop may cut: output channels or KV heads."""
    return heads_count(op) if isinstance(op, top.AttentionBase) else col_count(op)


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
    second = (heads_operand_axes(op) if isinstance(op, top.AttentionBase)
              else col_operand_axes(op))
    return tuple((-1 if r is None else r, -1 if c is None else c)
                 for r, c in zip(rows, second, strict=True))


def tile_result_axes(op: Operation) -> tuple[int, int]:
    rule = _tile_rows(op)
    rows = rule.result_axes[0] if rule is not None else None
    second = HEADS_RESULT_AXIS if isinstance(op, top.AttentionBase) else col_result_axis(op)
    return -1 if rows is None else rows, second


def heads_sliceable(op: Operation) -> bool:
    """An attention with more than one KV head, a gated delta rule with more than one key
    head, a causal conv with more than one channel."""
    return isinstance(op, top.AttentionBase | top.GatedDeltaRuleBase | top.CausalConv1dBase) \
        and heads_count(op) > 1


def heads_count(op: Operation) -> int:
    """The units a heads slice divides: KV heads (each with its query heads), key heads
    (each with its value heads), conv channels."""
    if isinstance(op, top.AttentionBase):
        return read_int(op.kv_heads)
    if isinstance(op, top.GatedDeltaRuleBase):
        return shape_of(op.k)[2]
    assert isinstance(op, top.CausalConv1dBase)
    return shape_of(op.x)[2]


def heads_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """For a heads slice, per operand (flat order): an attention's q, k, v and history
    along their head axis (2), its mask along its head axis (1) when it has one per query
    head, else whole; a delta rule's q, k, v, g, beta along their head axis (2) and its
    state along its value-head axis (1); a conv's input and state along their channel axis
    (2), its taps along theirs (0), its valid flags whole."""
    axes: list[int | None] = []
    for v in op.operands:
        if isinstance(op, top.AttentionBase):
            axes.append((1 if shape_of(v)[1] > 1 else None) if v is op.mask else 2)
        elif isinstance(op, top.GatedDeltaRuleBase):
            axes.append(1 if v is op.state else 2)
        else:
            assert isinstance(op, top.CausalConv1dBase)
            axes.append(None if v is op.valid else 0 if v is op.weight else 2)
    return tuple(axes)


#: an attention's result (and a delta rule's output) along its head axis
HEADS_RESULT_AXIS = 2


def heads_result_axes(op: Operation) -> tuple[int, ...]:
    """For a heads slice, per result: the output's head (or channel) axis, a delta rule's
    new state's value-head axis (1), a conv's new state's channel axis (2)."""
    if isinstance(op, top.GatedDeltaRuleBase):
        return (HEADS_RESULT_AXIS, 1)
    if isinstance(op, top.CausalConv1dBase):
        return (2, 2)
    return (HEADS_RESULT_AXIS,)


def is_global_source(v: SSAValue) -> bool:
    return isinstance(v.owner, tpu.WeightOp | tpu.ConstantOp)


def reduction_sliceable(op: Operation) -> bool:
    """An op whose reduction may be cut in parts (tiled by rows, when it has more than
    one, and output channels or KV heads): a float weight matmul (K), an a16_matmul, an
    attention without history, not causal (its keys)."""
    if not (col_sliceable(op) or isinstance(op, top.AttentionBase)):
        return False
    if isinstance(op, top.AttentionBase):
        return (op.history_k is None and not read_bool(op.causal)
                and (op.mask is None or shape_of(op.mask)[-1] in (1, shape_of(op.k)[1])))
    if isinstance(op, tpu.MatMulOp):
        return is_float(elem_of(op.lhs)) and is_float(elem_of(op.rhs))
    return isinstance(op, tpu.A16MatMulOp)


def reduction_count(op: Operation) -> int:
    """The most parts the reduction may be cut in: an attention's keys, a matmul's K, an
    a16_matmul's quantization groups (a group of K stays whole), or its K when one group
    spans all of K (per channel: every part shares the channel's scale)."""
    if isinstance(op, top.AttentionBase):
        return shape_of(op.k)[1]
    k = shape_of(op.operands[0])[-1]
    if isinstance(op, tpu.A16MatMulOp):
        groups = k // read_int(op.group_size)
        return groups if groups > 1 else k
    return k


def reduction_operand_axes(op: Operation) -> tuple[int | None, ...]:
    """Per operand, the axis the reduction parts cut (None: the same in every part): an
    attention's keys and values along their sequence (1), the mask along its last axis
    when it has a column per key; a matmul's activation along its last axis (K), its
    weight-like operands of two axes along their second (K, or K's packed bytes or
    groups: scales, zero points, any per-group operand of an a16_matmul; not a per-channel
    one, [N, 1]), the bias never."""
    if isinstance(op, top.AttentionBase):
        axes: list[int | None] = []
        for i, v in enumerate(op.operands):
            if v is op.mask and i == 3:
                ms = shape_of(v)
                axes.append(len(ms) - 1 if ms[-1] > 1 else None)
            else:
                axes.append(None if v is op.q else 1)
        return tuple(axes)
    x = op.operands[0]
    return (len(shape_of(x)) - 1,
            *(1 if len(shape_of(v)) == 2 and shape_of(v)[1] > 1 else None
              for v in op.operands[1:]))


def reduction_tile_axes(op: Operation) -> tuple[tuple[int, int, int], ...]:
    """For tiles with reduction parts, per operand (row axis, second loop's axis,
    reduction axis), -1 where that loop does not cut it."""
    red = reduction_operand_axes(op)
    return tuple((*ax, -1 if r is None else r)
                 for ax, r in zip(tile_operand_axes(op), red, strict=True))
