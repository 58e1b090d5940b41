"""layer-group{chip=..., max-ops=...}: partition each function's Tpu ops into layer groups.

A layer group runs a contiguous span of ops out of local memory, slice by slice, as a
load / compute / store software pipeline (see `tpu.GroupOp` and passes/lmem.py). For each
span the planner picks how to slice it (token rows for the whole span, output channels
of a single weight matmul, 2-D tiles of rows and output channels of one, or KV heads of a
single attention; see passes/slicing.py) and how many slices, by a cost model of
the chip: DMA = latency + bytes / bandwidth, compute = latency + FLOPs / peak, combined as
the pipeline overlaps them. Group boundaries come from dynamic programming over spans
(the cheapest partition of the op sequence), as TPU-MLIR's layer group does, not greedily.

Each chosen group is built as IR and its local memory allocated (passes/lmem.py); when the
allocation does not fit, the group is sliced further, and failing that, split; an op that
cannot fit alone is an error naming it. `max-ops=1` makes one op per group (the baseline
the benchmark compares DDR traffic against).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Self

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, UnitAttr
from xdsl.ir import Attribute, Block, Operation, OpResult, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from toptpu.backend.target.chips import DEFAULT_CHIP, Chip, get_chip
from toptpu.backend.target.cost import (
    compute_cycles,
    cost_dtype,
    ddr_bytes,
    dma_cycles,
    expected_distinct,
    nbytes,
    op_flops,
    run_bytes,
    type_nbytes,
)
from toptpu.dialects import dev, tpu
from toptpu.dialects.common import (
    dtype_bytes,
    elem_of,
    i64_array,
    i64_attr,
    numel,
    read_bool,
    read_float,
    read_int,
    shape_of,
    tensor,
)
from toptpu.dialects.naming import op_name, set_name
from toptpu.dialects.slicing_interface import SlicingInterface
from toptpu.dialects.top import fetched_rows_needed
from toptpu.errors import ToptpuError
from toptpu.passes.lmem import LocalMemoryError, allocate_group, verify_group
from toptpu.passes.slicing import (
    RowRule,
    SliceKind,
    col_count,
    col_operand_axes,
    col_result_axis,
    col_sliceable,
    heads_count,
    heads_operand_axes,
    heads_result_axes,
    heads_sliceable,
    reduction_count,
    reduction_operand_axes,
    reduction_sliceable,
    reduction_tile_axes,
    row_rule,
    tile_count,
    tile_operand_axes,
    tile_result_axes,
    tile_sliceable,
)
from toptpu.passes.util import require_level


class LayerGroupError(ToptpuError):
    pass


@functools.cache
def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass
class Plan:
    ops: list[Operation]
    kind: SliceKind
    slices: int
    cost: float = 0.0
    inputs: list[SSAValue] = field(default_factory=list)
    input_axes: dict[SSAValue, int | None] = field(default_factory=dict)
    gather_tables: set[SSAValue] = field(default_factory=set)
    result_axes: dict[SSAValue, int | None] = field(default_factory=dict)
    outputs: list[SSAValue] = field(default_factory=list)
    #: a tiles plan: (row blocks, output-channel blocks), the outer loop, and per input and
    #: result the (row, output-channel, reduction) axes each loop slices (-1: none)
    tiles: tuple[int, int] = (1, 1)
    outer: str = ""
    tile_axes: dict[SSAValue, tuple[int, ...]] = field(default_factory=dict)
    #: a tiles plan's reduction parts (a third loop, inside the others; 1: none)
    parts: int = 1
    #: the parts are blocks of consecutive experts (`expert_block_axes`: the MoE experts'
    #: expert-major schedule), this many, each block's experts in `parts` / this parts of
    #: the op's reduction axis (the intermediate axis I); 0: parts of that axis only
    expert_blocks: int = 0


def nbytes_of_type(t: TensorType) -> int:
    return numel(t.get_shape()) * dtype_bytes(t.element_type)


#: one layer-group run's answers about its values and ops, which the search asks again for
#: every span and slice count it costs (cleared after each run, as `_TILE_PLANS`): a value's
#: bytes and a slice's DMA cycles (kept with the value's type, asked again only while it is
#: that type), an op's row rule, FLOPs and compute type (kept with its result's type)
_VALUE_BYTES: dict[SSAValue, tuple[Attribute, int]] = {}
_SLICE_CYCLES: dict[tuple[SSAValue, int | None, int, Chip], tuple[Attribute, float]] = {}
_ROW_RULES: dict[Operation, tuple[Attribute | None, RowRule | None]] = {}
_OP_WORK: dict[Operation, tuple[Attribute | None, int, str]] = {}


def _clear_run_caches() -> None:
    for cache in (_TILE_PLANS, _VALUE_BYTES, _SLICE_CYCLES, _ROW_RULES, _OP_WORK):
        cache.clear()


def _first_type(op: Operation) -> Attribute | None:
    return op.results[0].type if op.results else None


def _nbytes(v: SSAValue) -> int:
    """`cost.nbytes` of `v`, once per run (`_VALUE_BYTES`)."""
    hit = _VALUE_BYTES.get(v)
    if hit is not None and hit[0] is v.type:
        return hit[1]
    n = nbytes(v)
    _VALUE_BYTES[v] = (v.type, n)
    return n


def _row_rule(op: Operation) -> RowRule | None:
    """`slicing.row_rule` of `op`, once per run (`_ROW_RULES`)."""
    hit = _ROW_RULES.get(op)
    if hit is not None and hit[0] is _first_type(op):
        return hit[1]
    rule = row_rule(op)
    _ROW_RULES[op] = (_first_type(op), rule)
    return rule


def _op_work(op: Operation) -> tuple[int, str]:
    """`op`'s FLOPs and compute type (`cost.op_flops`, `cost.cost_dtype`), once per run."""
    hit = _OP_WORK.get(op)
    if hit is not None and hit[0] is _first_type(op):
        return hit[1], hit[2]
    work = (op_flops(op), cost_dtype(op))
    _OP_WORK[op] = (_first_type(op), *work)
    return work


def _external_uses(v: SSAValue, inside: set[Operation]) -> bool:
    return any(u.operation not in inside for u in v.uses)


#: when layer-group splits a reduction in parts (`split-reduction`): where that is the
#: cheapest plan by the cost model, or only where no plan without it fits (the numbers of
#: a split reduction change within f32 rounding: "needed" keeps them wherever it can)
SPLIT_REDUCTION = ("cost", "needed")
#: with `split-reduction=cost`, a plan with reduction parts replaces the cheapest plan
#: without them only when it is cheaper by more than this fraction of that plan's cost:
#: a split reduction trades contiguous transfers for strided runs and a partial sum kept
#: in f32 between parts, costs the model sees only in part (whole bursts per run, no DRAM
#: page misses between runs, no accumulator traffic). Near a tie — a decode lm_head over
#: 151936 channels in 64 channel blocks, or over 28 parts of its 896 inputs, 0.1% apart —
#: the whole reduction is kept (the vocabulary split every LLM deployment uses).
REDUCTION_MARGIN = 0.02


def plan_span(ops: list[Operation], chip: Chip, slices: int | None = None,
              kinds: tuple[SliceKind, ...] = tuple(SliceKind), split: str = "cost"
              ) -> Plan | None:
    """The cheapest feasible plan for running `ops` as one group (None if none fits), a
    reduction split in parts as `split` says (`SPLIT_REDUCTION`, `REDUCTION_MARGIN`)."""
    best: Plan | None = None
    for kind in kinds:
        for p in _candidates(ops, kind, chip, slices):
            if best is None or p.cost < best.cost:
                best = p
    if SliceKind.TILES in kinds and (best is None or split == "cost"):
        parts = min(_reduction_plans(ops, chip, slices), key=lambda p: p.cost, default=None)
        if parts is not None and (best is None
                                  or parts.cost < best.cost * (1 - REDUCTION_MARGIN)):
            best = parts
    return best


def _reduction_plans(ops: list[Operation], chip: Chip, only: int | None) -> list[Plan]:
    """Tiles plans of `ops` (one op) with reduction parts."""
    return _tile_candidates(ops, chip, only, reduce=True)


def _candidates(ops: list[Operation], kind: SliceKind, chip: Chip, only: int | None
                ) -> list[Plan]:
    inside = set(ops)
    plans = []
    if kind == SliceKind.TILES:
        return _tile_candidates(ops, chip, only)
    if kind == SliceKind.COLS:
        if len(ops) != 1 or not col_sliceable(ops[0]):
            return []
        counts = divisors(col_count(ops[0]))
    elif kind == SliceKind.HEADS:
        if len(ops) != 1 or not heads_sliceable(ops[0]):
            return []
        counts = divisors(heads_count(ops[0]))[1:]  # one slice is the rows kind's
    else:
        rows = _row_count(ops)
        counts = [1] if rows is None else divisors(rows)
    for s in counts:
        if only is not None and s != only:
            continue
        p = _make_plan(ops, kind, s, inside)
        if p is None:
            continue
        need = _lane_bytes_bound(p, chip)
        if need > chip.lane_bytes:
            continue
        p.cost = _pipeline_cost(p, chip)
        plans.append(p)
    return plans


def _row_count(ops: list[Operation]) -> int | None:
    """The common row count of a span, or None when the span cannot be row-sliced."""
    rows = None
    for op in ops:
        rule = _row_rule(op)
        if rule is None or rule.result_axes[0] is None:
            return None
        n = shape_of(op.results[0])[rule.result_axes[0]]
        if rows is None:
            rows = n
        elif rows != n:
            return None
    return rows


def _make_plan(ops: list[Operation], kind: SliceKind, s: int, inside: set[Operation]
               ) -> Plan | None:
    p = Plan(ops, kind, s)
    produced: dict[SSAValue, int | None] = {}
    for op in ops:
        table = _gather_table(op)
        if kind == SliceKind.COLS:
            in_axes: tuple[int | None, ...] = col_operand_axes(op)
            out_axes: tuple[int | None, ...] = (col_result_axis(op),)
        elif kind == SliceKind.HEADS:
            in_axes, out_axes = heads_operand_axes(op), heads_result_axes(op)
        elif s == 1:
            in_axes = tuple(None for _ in op.operands)
            out_axes = tuple(None for _ in op.results)
        else:
            rule = _row_rule(op)
            if rule is None:
                return None
            in_axes, out_axes = rule.operand_axes, rule.result_axes
        for i, v in enumerate(op.operands):
            ax = in_axes[i]
            if v is table and v not in produced:
                p.gather_tables.add(v)  # read row by row from global memory
                if v not in p.inputs:
                    p.inputs.append(v)
                continue
            if v in produced:
                if produced[v] != ax:
                    return None  # produced sliced, needed whole (or another axis)
                continue
            if v in p.input_axes:
                if p.input_axes[v] != ax:
                    return None
                continue
            p.inputs.append(v)
            p.input_axes[v] = ax
        for r, ax in zip(op.results, out_axes, strict=True):
            produced[r] = ax
            p.result_axes[r] = ax
    for op in ops:
        for r in op.results:
            if _external_uses(r, inside):
                if s > 1 and p.result_axes[r] is None:
                    return None
                p.outputs.append(r)
    if s > 1:
        for v, ax in p.input_axes.items():
            if ax is not None and shape_of(v)[ax] % s:
                return None
    return p


def _slice_bytes(v: SSAValue, ax: int | None, s: int) -> int:
    return _nbytes(v) // s if ax is not None else _nbytes(v)


def _lane_bytes_bound(p: Plan, chip: Chip) -> int:
    """A safe upper bound of the per-lane bytes the group needs (no reuse assumed)."""
    total = 0
    copies = 2 if p.slices > 1 else 1
    fetched = _fetched_buffers(p)
    for v in p.inputs:
        if v in p.gather_tables:
            continue
        ax = p.input_axes[v]
        n = fetched.get(v, _slice_bytes(v, ax, p.slices))
        total += chip.per_lane(n) * (copies if ax is not None else 1)
    outs = set(p.outputs)
    for op in p.ops:
        for r in op.results:
            ax = p.result_axes[r]
            b = chip.per_lane(_slice_bytes(r, ax, p.slices))
            total += b * (copies if r in outs else 1)
    return total


def _slice_cycles(v: SSAValue, ax: int | None, s: int, chip: Chip) -> float:
    """Cycles of one transfer of `v`'s slice (one of `s` along `ax`; None: whole)."""
    key = (v, ax, s, chip)
    hit = _SLICE_CYCLES.get(key)
    if hit is not None and hit[0] is v.type:
        return hit[1]
    cycles = _type_slice_cycles(v.type, ax, s, chip)
    _SLICE_CYCLES[key] = (v.type, cycles)
    return cycles


@functools.lru_cache(maxsize=1 << 16)
def _type_slice_cycles(t: Attribute, ax: int | None, s: int, chip: Chip) -> float:
    """`_slice_cycles` of a value of type `t`: the plan search asks for the same slice of
    the same type many times (every span and slice count it costs)."""
    shape = shape_of(t)
    part = [n // s if a == ax else n for a, n in enumerate(shape)]
    whole = type_nbytes(t)
    return dma_cycles(chip, whole // s if ax is not None else whole,
                      run_bytes(shape, part, dtype_bytes(elem_of(t))))


def _fetched_moved(p: Plan, chip: Chip) -> dict[SSAValue, float]:
    """Cycles of the indexed loads of a plan's whole by-index operands (the MoE experts):
    their expected distinct rows (`cost.expected_distinct` of a slice's indices [T, k]),
    in runs of at most one row, once per slice of indices."""
    out = {}
    for op in p.ops:
        for v, idx in _by_index_operands(op):
            if v not in p.input_axes or p.input_axes[v] is not None \
                    or not _fetched_by_index(v, p.ops):
                continue
            ax = p.result_axes[idx] if idx in p.result_axes else p.input_axes.get(idx)
            loads = p.slices if ax is not None else 1
            shape = shape_of(_slice_type(idx, ax, p.slices))
            e = shape_of(v)[0]
            row = nbytes(v) // e
            rows = expected_distinct(e, numel(shape[:-1]), shape[-1])
            out[v] = loads * dma_cycles(chip, round(row * rows), row)
    return out


def _pipeline_cost(p: Plan, chip: Chip) -> float:
    """Modelled cycles: resident loads, then slices with load(i+1)+store(i-1) overlapping
    compute(i) (one DMA engine, one compute engine)."""
    s = p.slices
    moved = _fetched_moved(p, chip)
    resident = sum(moved[v] if v in moved else _slice_cycles(v, None, s, chip)
                   for v in p.inputs if v not in p.gather_tables and p.input_axes[v] is None)
    load = sum(_slice_cycles(v, p.input_axes[v], s, chip) for v in p.inputs
               if v not in p.gather_tables and p.input_axes[v] is not None)
    gathers = 0.0
    for op in p.ops:
        table = _gather_table(op)
        if table is not None and table in p.gather_tables:
            row = numel(shape_of(table)[1:]) * dtype_bytes(elem_of(table))
            gathers += dma_cycles(chip, nbytes(op.results[0]) // s, row)
    load += gathers
    comp = sum(compute_cycles(chip, flops // s, dtype)
               for flops, dtype in map(_op_work, p.ops))
    store = sum(_slice_cycles(r, p.result_axes[r], s, chip) for r in p.outputs)
    if s == 1:
        return resident + load + comp + store
    return resident + load + (s - 1) * max(comp, load + store) + comp + store


# ------------------------------------------------------------------------------ 2-D tiles


@dataclass(frozen=True)
class _TileOperand:
    """What tile planning needs of one input or the result: its bytes and, per tile loop
    (rows, second, reduction), the axis that loop cuts (-1: none) and that axis's size."""

    value: SSAValue
    nbytes: int
    axes: tuple[int, int, int]
    sizes: tuple[int, int, int]
    #: a second axis the reduction parts cut and its count (blocks of experts times
    #: parts of I: the parts of I's axis; `nbytes` is then already one part's), -1: none
    also: tuple[int, int] = (-1, 1)

    def part(self, counts: tuple[int, int, int]) -> int | None:
        """Bytes of one tile's part (None when a count does not divide its axis)."""
        parts = 1
        for a, size, n in zip(self.axes, self.sizes, counts, strict=True):
            if a != -1:
                if size % n:
                    return None
                parts *= n
        return self.nbytes // parts

    def level(self, outer: str) -> int:
        """The innermost tile loop that cuts it: 1 the outer, 2 the inner, 3 the reduction
        parts, 0 none (loaded once)."""
        # (the outer loop's axis, the inner loop's): rows outer cuts axes[0] outside
        # axes[1] (`tpu.GroupOp.tile_blocks`)
        outer_axis, inner_axis = ((self.axes[0], self.axes[1]) if outer == "rows"
                                  else (self.axes[1], self.axes[0]))
        if self.axes[2] != -1 or self.also[0] != -1:
            return 3
        if inner_axis != -1:
            return 2
        return 1 if outer_axis != -1 else 0


def _tile_operands(op: Operation, blocks: bool = False
                   ) -> tuple[list[_TileOperand], _TileOperand, int] | None:
    """The tile operands of `op` (inputs, result) and its accumulator's bytes (whole op; 0
    when its reduction cannot be cut), None when `op` does not tile. `blocks`: the third
    loop cuts blocks of experts (`expert_block_axes`; None when the op has none)."""
    reducible = reduction_sliceable(op)
    if not (tile_sliceable(op) or reducible) or len(set(op.operands)) != len(op.operands):
        return None
    block_axes = _expert_block_axes(op)
    if blocks:
        if block_axes is None:
            return None
        reducible = True
        axes = tuple((*a, -1 if b is None else b)
                     for a, b in zip(tile_operand_axes(op), block_axes, strict=True))
    else:
        axes = (reduction_tile_axes(op) if reducible
                else tuple((*a, -1) for a in tile_operand_axes(op)))
    inputs = []
    for v, ax in zip(op.operands, axes, strict=True):
        shape = shape_of(v)
        inputs.append(_TileOperand(v, nbytes(v), ax,
                                   # the ignore below: as long as ax
                                   tuple(shape[a] if a != -1 else 1 for a in ax)))  # type: ignore[arg-type]
    res = op.results[0]
    rows_axis, cols_axis = tile_result_axes(op)
    shape = shape_of(res)
    result = _TileOperand(res, nbytes(res), (rows_axis, cols_axis, -1),
                          (shape[rows_axis] if rows_axis != -1 else 1, shape[cols_axis], 1))
    acc = nbytes_of_type(tpu.accumulator_type(op)) if reducible else 0
    return inputs, result, acc


#: the tiles plans found in one layer-group run, by (op, its operands, chip, count, reduce):
#: the DP and the allocation ask for one op's plans many times (cleared after each run)
_TILE_PLANS: dict[tuple, list[Plan]] = {}


def _tile_candidates(ops: list[Operation], chip: Chip, only: int | None,
                     reduce: bool = False) -> list[Plan]:
    """Tiles plans of one weight matmul or attention: every (row blocks R, second-loop
    blocks C) whose bound fits a lane, with either tile loop outer, R > 1 and C > 1 (R = 1
    or C = 1 are the cols / heads and rows kinds); `reduce`: every (R, C, reduction parts
    P > 1) instead, the parts a loop inside the other two (`reduction_sliceable`)."""
    if len(ops) != 1:
        return []
    op = ops[0]
    key = (op, tuple(op.operands), id(chip), chip.lane_bytes, reduce)
    found = _TILE_PLANS.get(key)
    if found is None:
        found = _TILE_PLANS[key] = _find_tile_plans(op, chip, reduce)
    return found if only is None else [p for p in found if p.slices == only]


def _expert_block_axes(op: Operation) -> tuple[int | None, ...] | None:
    """The axes blocks of experts cut (`SlicingInterface.expert_block_axes`), None for an
    op without experts."""
    return op.expert_block_axes() if isinstance(op, SlicingInterface) else None


def _find_tile_plans(op: Operation, chip: Chip, reduce: bool) -> list[Plan]:
    """The plans of `_tile_candidates`, the cheapest for each slice count, by cost: every
    (R, C, P) of divisors is costed at once (`_tile_costs`, numpy over the grid). An op
    with experts, in a chunk of more than one token, also has plans whose parts are blocks
    of its experts (the expert-major schedule: each block's chosen experts loaded once per
    row block): without `reduce` blocks of whole experts — they keep the numbers (each
    token's experts added in the same order), so they compete with the plans without
    reduction parts —, with `reduce` blocks each in parts of I (a split reduction); the
    cheaper by the cost model for each slice count kept."""
    found = _grid_plans(op, chip, reduce, blocks=False)
    # one token (decode) loads each chosen expert once already (the buffers of its k
    # fetched experts): blocks would only add loads
    pairs = _by_index_operands(op)
    if _expert_block_axes(op) is None or not pairs \
            or numel(shape_of(pairs[0][1])[:-1]) < 2:
        return found
    # each block's experts whole (the same numbers: beside the plans without parts), or in
    # parts of I (experts too large for local memory one by one, each chosen expert still
    # loaded once, a part at a time: a split reduction, with the others)
    i_parts = divisors(reduction_count(op))[1:] if reduction_sliceable(op) else []
    blocks = [p for q in (i_parts if reduce else [1])
              for p in _grid_plans(op, chip, True, blocks=True, i_parts=q)]
    found = blocks + found  # a tie: the blocks (an expert's rows stay contiguous)
    best: dict[int, Plan] = {}
    for p in found:
        if p.slices not in best or p.cost < best[p.slices].cost:
            best[p.slices] = p
    return sorted(best.values(), key=lambda p: p.cost)


def _grid_plans(op: Operation, chip: Chip, reduce: bool, blocks: bool, i_parts: int = 1
                ) -> list[Plan]:
    """`_find_tile_plans` with the parts of the reduction (`blocks`: of the experts, each
    block's in `i_parts` parts of the reduction axis)."""
    found = _tile_operands(op, blocks)
    if found is None or (reduce and not found[2]):
        return []
    inputs, result, acc = found
    if i_parts > 1:
        cut = []
        for v, ax in zip(inputs, reduction_operand_axes(op), strict=True):
            if ax is not None:
                if shape_of(v.value)[ax] % i_parts:
                    return []
                v = replace(v, nbytes=v.nbytes // i_parts, also=(ax, i_parts))
            cut.append(v)
        inputs = cut
    if not reduce:  # the whole reduction in every tile: no operand is cut along it
        inputs = [replace(v, axes=(*v.axes[:2], -1)) for v in inputs]
    most = _experts_of(op) if blocks else reduction_count(op)
    parts_ = np.array(divisors(most)[1:] if reduce else [1], np.int64)
    rows_ = np.array(divisors(result.sizes[0]), np.int64)
    cols_ = np.array(divisors(tile_count(op)), np.int64)
    r, c, parts = np.meshgrid(rows_, cols_, parts_, indexing="ij")
    ok = (parts > 1) | ((r > 1) & (c > 1))
    sizes, runs = [], []
    for v in [*inputs, result]:
        n = np.ones_like(r)
        for a, size, count in zip(v.axes, v.sizes, (r, c, parts), strict=True):
            if a != -1:
                ok &= size % count == 0
                n = n * count
        sizes.append(v.nbytes // n)
        runs.append(_tile_runs(v, (r, c, parts)))
    held, moved = _fetched_tile_sizes(op, inputs, sizes, runs, r,
                                      parts if blocks else None)
    parts_all = parts * i_parts  # the reduction loop: blocks of experts x parts of I
    lane = 2 * sum(_per_lane(n, chip) for n in [*held, sizes[-1]])
    if reduce:
        lane = lane + _per_lane(acc // (r * c), chip)
    ok &= lane <= chip.lane_bytes
    best: dict[int, tuple[float, int, str]] = {}  # slices -> (cost, cell, outer)
    for outer in ("rows", "cols"):
        cost = _tile_costs(inputs, [*moved, sizes[-1]], runs, (r, c, parts_all), outer,
                           op_flops(op), cost_dtype(op), chip)
        for cell in np.flatnonzero(ok).tolist():
            t = int(r.flat[cell] * c.flat[cell] * parts_all.flat[cell])
            k = float(cost.flat[cell])
            if t not in best or k < best[t][0]:
                best[t] = (k, int(cell), outer)
    plans = []
    for t, (k, cell, outer) in sorted(best.items(), key=lambda item: item[1][0]):
        p = Plan([op], SliceKind.TILES, t, cost=k, inputs=list(op.operands),
                 outputs=[op.results[0]], tiles=(int(r.flat[cell]), int(c.flat[cell])),
                 outer=outer, parts=int(parts_all.flat[cell]),
                 expert_blocks=int(parts.flat[cell]) if blocks else 0)
        for v in inputs:
            p.tile_axes[v.value] = (*v.axes, v.also[0]) if i_parts > 1 else v.axes
            p.input_axes[v.value] = next((a for a in (*v.axes, v.also[0]) if a != -1), None)
        p.tile_axes[result.value] = (*result.axes, -1) if i_parts > 1 else result.axes
        p.result_axes[result.value] = result.axes[1]
        plans.append(p)
    return plans


def _fetched_tile_sizes(op: Operation, inputs: list[_TileOperand], sizes: list[np.ndarray],
                        runs: list[np.ndarray], r: np.ndarray, blocks: np.ndarray | None
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The bytes each input's local buffer holds and a load of it moves, over the grid
    (`sizes` the whole parts; `runs` made at most one row for an indexed load, in place).
    An operand `op` reads by index (the MoE experts) is an indexed load where no tile
    loop shares it between row blocks of other indices (`_shared_by_tiles_of_other_
    indices`); it then moves its expected distinct rows (`cost.expected_distinct` of the
    row block's [T, k] indices), and its buffer holds the rows they can name,
    min(E, T x k), when every such operand of `op` is an indexed load
    (`_fetched_buffers`). `blocks` (the third loop's counts P, when it cuts blocks of
    experts): a load is one block's, E/P experts — its buffer min(E/P, T x k) rows, what
    it moves the block's share E/P of the row block's expected distinct experts (over
    the P blocks: each chosen expert once)."""
    held, moved = list(sizes[:len(inputs)]), [np.asarray(n, np.float64)
                                               for n in sizes[:len(inputs)]]
    by_index = _by_index_operands(op)
    if not by_index:
        return held, moved
    pos = {v.value: i for i, v in enumerate(inputs)}
    idx = inputs[pos[by_index[0][1]]]
    t, k = numel(shape_of(idx.value)[:-1]), shape_of(idx.value)[-1]
    tokens = t // r if idx.axes[0] != -1 else np.full_like(r, t)
    # a row block's indexed load of an operand no loop cuts would serve other row blocks
    shared = (r > 1) & (idx.axes[0] != -1) & any(
        all(a == -1 for a in inputs[pos[v]].axes) for v, _ in by_index)
    every = ~shared  # every by-index operand an indexed load
    for v, _ in by_index:
        i = pos[v]
        e = shape_of(v)[0]
        block = e // blocks if blocks is not None else np.full_like(r, e)
        row = sizes[i] // block
        rows = np.minimum(block, tokens * k)
        expect = np.vectorize(lambda n, e=e: expected_distinct(e, int(n), k),
                              otypes=[np.float64])(tokens) * block / e
        held[i] = np.where(every, row * rows, sizes[i])
        moved[i] = np.where(every, row * expect, sizes[i])
        runs[i] = np.where(every, np.minimum(runs[i], row), runs[i])
    return held, moved


def _by_index_operands(op: Operation) -> list[tuple[SSAValue, SSAValue]]:
    """(operand, its index operand) for each operand `op` reads by index."""
    if not isinstance(op, SlicingInterface):
        return []
    return [(op.operands[p], op.operands[i]) for p, i in op.fetched_by_index().items()]


def _tile_runs(v: _TileOperand, counts: tuple[np.ndarray, ...]) -> np.ndarray:
    """The contiguous runs (bytes) of `v`'s part in its global tensor over the grid of
    tile counts (`cost.run_bytes` elementwise): the innermost axes the part covers whole,
    times the first one it cuts."""
    shape = shape_of(v.value)
    part: list[np.ndarray | int] = list(shape)
    for a, count in zip(v.axes, counts, strict=True):
        if a != -1:
            part[a] = shape[a] // count
    if v.also[0] != -1:
        part[v.also[0]] = shape[v.also[0]] // v.also[1]
    run = run_bytes(shape, part, dtype_bytes(elem_of(v.value)))
    return np.broadcast_to(np.asarray(run, np.int64), counts[0].shape)


def _per_lane(nbytes: np.ndarray, chip: Chip) -> np.ndarray:
    """`Chip.per_lane` over an array of byte counts."""
    per = -(-nbytes // chip.lanes)
    return -(-per // chip.align) * chip.align


def _tile_lane_bytes(p: Plan, chip: Chip) -> int:
    """Per-lane bytes of a tiles group: two copies of every input's part and of the
    result's tile, and the accumulator of a tile's reduction parts."""
    found = _tile_operands(p.ops[0], bool(p.expert_blocks))
    assert found is not None
    inputs, result, acc = found
    counts = (*p.tiles, p.parts)
    fetched = _fetched_buffers(p)
    total = sum(2 * chip.per_lane(fetched.get(v.value, v.part(counts) or 0))
                for v in [*inputs, result])
    return total + (chip.per_lane(acc // (p.tiles[0] * p.tiles[1])) if p.parts > 1 else 0)


def _tile_costs(inputs: list[_TileOperand], sizes: list[np.ndarray], runs: list[np.ndarray],
                counts: tuple[np.ndarray, np.ndarray, np.ndarray], outer: str, flops: int,
                dtype: str, chip: Chip) -> np.ndarray:
    """Modelled cycles of tiles groups (arrays over the candidates' (R, C, P)): the slices
    pipelined as any sliced group (the loads of slice t+1 and the store of the tile before
    beside the compute of t). Loops, outside in: the outer tile loop (n1 blocks), the inner
    one (n2), the reduction parts (n3). A part is loaded again when the innermost loop that
    cuts it moves on: n1 - 1 slices start an outer block (every cut input loaded, a tile
    stored), n1 (n2 - 1) an inner one (the inputs cut by the inner loop or the parts, a
    tile stored), n1 n2 (n3 - 1) a reduction part (the inputs cut by the parts). `sizes`
    and `runs`: each input's part and the result's tile, bytes and contiguous runs."""
    r, c, parts = counts
    n1, n2 = (r, c) if outer == "rows" else (c, r)
    zero = np.zeros(r.shape)
    load = [zero, zero, zero, zero]  # by level: once, outer, inner, parts
    for v, n, run in zip(inputs, sizes, runs, strict=False):
        lv = v.level(outer)
        load[lv] = load[lv] + chip.dma_latency_cycles + ddr_bytes(chip, n, run) \
            / chip.bytes_per_cycle
    store = chip.dma_latency_cycles + ddr_bytes(chip, sizes[-1], runs[-1]) \
        / chip.bytes_per_cycle
    t = r * c * parts
    comp = chip.compute_latency_cycles + (flops // t) / (chip.flops_per_cycle(dtype)
                                                        * chip.compute_efficiency)
    a = load[1] + load[2] + load[3] + store
    b = load[2] + load[3] + store
    return (load[0] + load[1] + load[2] + load[3] + (n1 - 1) * np.maximum(comp, a)
            + n1 * (n2 - 1) * np.maximum(comp, b)
            + n1 * n2 * (parts - 1) * np.maximum(comp, load[3]) + comp + store)


def build_tile_group(p: Plan) -> tpu.GroupOp:
    """Replace a tiles plan's op by a tpu.group of its tiles (not yet allocated)."""
    (op,) = p.ops
    counts = _tile_counts(p)
    # tile_axes: rows, second loop (, reduction parts (, the parts' second axis))
    ndim = len(counts) if p.parts > 1 else 2

    fetched = _fetched_rows(p)

    def part_type(v: SSAValue) -> TensorType:
        shape = list(shape_of(v))
        for a, n in zip(p.tile_axes[v], counts, strict=True):
            if a != -1:
                shape[a] //= n
        if v in fetched:
            shape[0] = fetched[v]
        return tensor(shape, elem_of(v))

    block = Block(arg_types=[v.type for v in p.inputs])
    local: dict[SSAValue, SSAValue] = {}
    for v, arg in zip(p.inputs, block.args, strict=True):
        arg.name_hint = v.name_hint
        axes = p.tile_axes[v]
        ax = p.input_axes[v]
        attrs: dict[str, Attribute] = {"slice_axis": i64_attr(-1 if ax is None else ax),
                                       "ts": i64_attr(0)}
        if ax is not None:
            attrs["tile_axes"] = i64_array(list(axes[:ndim]))
        if _fetched_by_index(v, p.ops) and not _shared_by_tiles_of_other_indices(v, op, p):
            attrs["by_index"] = UnitAttr()
        ld = tpu.LoadOp(operands=[arg], result_types=[part_type(v)], attributes=attrs)
        set_name(ld, f"{_value_name(v)}.load")
        ld.output.name_hint = v.name_hint
        block.add_op(ld)
        local[v] = ld.output
    res = op.results[0]
    attrs = {k: a for k, a in op.attributes.items() if k not in ("lmem", "ts")}
    attrs["ts"] = i64_attr(1)
    if fetched:
        attrs["fetched_from"] = i64_attr(_experts_of(op))
    if p.expert_blocks:
        attrs["expert_blocks"] = i64_attr(p.expert_blocks)
    assert isinstance(op, SlicingInterface)
    # the second loop's blocks (c) of KV heads, each with its q heads; the reduction's parts
    heads = p.tiles[1] if op.tile_loop() == SliceKind.HEADS else 1
    i_parts = p.parts // p.expert_blocks if p.expert_blocks else p.parts
    attrs.update(op.sliced_attributes([part_type(res)], heads=heads, parts=i_parts))
    new = type(op).create(operands=[local[v] for v in op.operands],
                          result_types=[part_type(res)], attributes=attrs)
    new.location = op.location
    new.results[0].name_hint = res.name_hint
    block.add_op(new)
    st = tpu.StoreOp(operands=[new.results[0]], result_types=[res.type],
                     attributes={"slice_axis": i64_attr(p.tile_axes[res][1]),
                                 "tile_axes": i64_array(list(p.tile_axes[res][:ndim])),
                                 "ts": i64_attr(2)})
    set_name(st, f"{op_name(op) or op.name}.store")
    block.add_op(st)
    block.add_op(tpu.YieldOp(operands=[[st.output]]))
    group = tpu.GroupOp(operands=[p.inputs], result_types=[[res.type]],
                        regions=[Region(block)],
                        attributes={"slices": i64_attr(p.slices), "cost": i64_attr(int(p.cost)),
                                    "tiles": i64_array(list(counts[:ndim])),
                                    "tile_outer": i64_attr(tpu.TILE_LOOPS.index(p.outer))})
    set_name(group, f"group.{op_name(op) or op.name}")
    return group


# ------------------------------------------------------------------------------ IR building


def _fetched_by_index(v: SSAValue, ops: list[Operation]) -> bool:
    """Whether every use of `v` by the group's `ops` reads it by index
    (`SlicingInterface.fetched_by_index`): its load is then an indexed load."""
    uses = [u for u in v.uses if u.operation in ops]
    return bool(uses) and all(isinstance(u.operation, SlicingInterface)
                              and u.index in u.operation.fetched_by_index() for u in uses)


def _shared_by_tiles_of_other_indices(v: SSAValue, op: Operation, p: Plan) -> bool:
    """Whether `v`, an operand `op` reads by index, is cut by none of the tiles plan's
    loops (one buffer for every tile: a per-channel down's scales in reduction parts)
    while its indices are (row blocks of a prefill chunk): its one load would serve tiles
    of different indices, so it is loaded whole."""
    assert isinstance(op, SlicingInterface)
    picks = {op.operands[op.fetched_by_index()[u.index]] for u in v.uses
             if u.operation is op}
    counts = _tile_counts(p)
    return all(a == -1 for a in p.tile_axes[v]) and any(
        a != -1 and n > 1 for idx in picks
        for a, n in zip(p.tile_axes[idx], counts, strict=False))


def _tile_counts(p: Plan) -> tuple[int, ...]:
    """The counts of a tiles plan's loops per tile axis: (R, C, P), or with blocks of
    experts in parts of I (R, C, the blocks, I's parts) (`tpu.GroupOp.part_counts`)."""
    if p.expert_blocks and p.parts > p.expert_blocks:
        return (*p.tiles, p.expert_blocks, p.parts // p.expert_blocks)
    return (*p.tiles, p.parts)


def _experts_of(op: Operation) -> int:
    """The rows along axis 0 of the operands `op` reads by index (its experts)."""
    return shape_of(_by_index_operands(op)[0][0])[0]


def _fetched_rows(p: Plan) -> dict[SSAValue, int]:
    """The inputs whose local buffer holds only the experts its loads fetch, and its
    rows (`_fetched_ops`)."""
    return {v: rows for _, (pairs, rows) in _fetched_ops(p).items() for v, _ in pairs}


def _fetched_ops(p: Plan) -> dict[Operation, tuple[list[tuple[SSAValue, SSAValue]], int]]:
    """The ops of the plan whose by-index operands (the MoE experts) get buffers of the
    fetched experts, with those operands and the buffers' rows: every operand the op reads
    by index is an indexed load (a group input only it reads, not shared by row blocks of
    other indices) and its slice's indices [T, k] can name fewer than the E experts:
    min(E, T x k) rows — each distinct expert the slice's tokens chose has its row, none
    is dropped (a prefill chunk of T rows needs min(E, T k), all E at the chunk sizes
    used unless E > T k)."""
    out = {}
    for op in p.ops:
        pairs = _by_index_operands(op)
        if not pairs or any(v not in p.input_axes or not _fetched_by_index(v, p.ops)
                            or any(u.operation is not op for u in v.uses
                                   if u.operation in p.ops) for v, _ in pairs):
            continue
        idx = pairs[0][1]
        if p.kind == SliceKind.TILES:
            if any(_shared_by_tiles_of_other_indices(v, op, p) for v, _ in pairs):
                continue
            shape = list(shape_of(idx))
            if p.tile_axes[idx][0] != -1:
                shape[p.tile_axes[idx][0]] //= p.tiles[0]
            if p.expert_blocks:  # a block's experts, always in a buffer of their own
                out[op] = (pairs, fetched_rows_needed(_experts_of(op) // p.expert_blocks,
                                                      shape))
                continue
        else:
            if any(p.input_axes[v] is not None for v, _ in pairs):
                continue  # sliced buffers of every row (not built today)
            ax = p.result_axes[idx] if idx in p.result_axes else p.input_axes.get(idx)
            shape = list(shape_of(_slice_type(idx, ax, p.slices)))
        e = _experts_of(op)
        rows = fetched_rows_needed(e, shape)
        if rows < e:
            out[op] = (pairs, rows)
    return out


def _fetched_buffers(p: Plan) -> dict[SSAValue, int]:
    """The bytes of the buffers `_fetched_rows` makes (a slice or tile's part)."""
    fetched = _fetched_rows(p)
    out = {}
    for v, rows in fetched.items():
        n = 1  # the parts of a row (along the axes after 0)
        if p.kind == SliceKind.TILES:
            for a, count in zip(p.tile_axes[v], _tile_counts(p), strict=True):
                if a not in (-1, 0):
                    n *= count
        out[v] = nbytes(v) // n // shape_of(v)[0] * rows
    return out


def _slice_type(v: SSAValue, ax: int | None, s: int) -> TensorType:
    shape = list(shape_of(v))
    if ax is not None and s > 1:
        shape[ax] //= s
    return tensor(shape, elem_of(v))


def build_group(p: Plan) -> tpu.GroupOp:
    """Replace the plan's ops by a tpu.group (not yet allocated)."""
    if p.kind == SliceKind.TILES:
        return build_tile_group(p)
    s = p.slices
    fetched_ops = _fetched_ops(p)
    fetched = _fetched_rows(p)
    block = Block(arg_types=[v.type for v in p.inputs])
    local: dict[SSAValue, SSAValue] = {}
    for v, arg in zip(p.inputs, block.args, strict=True):
        arg.name_hint = v.name_hint
        if v in p.gather_tables:
            local[v] = arg
            continue
        ax = p.input_axes[v] if s > 1 else None
        attrs: dict[str, Attribute] = {"slice_axis": i64_attr(-1 if ax is None else ax),
                                       "ts": i64_attr(0)}
        if _fetched_by_index(v, p.ops):
            attrs["by_index"] = UnitAttr()
        part = _slice_type(v, ax, s)
        if v in fetched:
            part = tensor([fetched[v], *shape_of(part)[1:]], elem_of(v))
        ld = tpu.LoadOp(operands=[arg], result_types=[part],
                        attributes=attrs)
        set_name(ld, f"{_value_name(v)}.load")
        ld.output.name_hint = v.name_hint
        block.add_op(ld)
        local[v] = ld.output
    for op in p.ops:
        attrs = {k: a for k, a in op.attributes.items() if k not in ("lmem", "ts")}
        result_types = [_slice_type(r, p.result_axes[r], s) for r in op.results]
        if s > 1:  # a slice-shaped copy (a reshape's shape, the heads of a heads slice)
            assert isinstance(op, SlicingInterface)
            attrs.update(op.sliced_attributes(
                result_types, heads=s if p.kind == SliceKind.HEADS else 1))
        attrs["ts"] = i64_attr(1)
        if op in fetched_ops:
            attrs["fetched_from"] = i64_attr(_experts_of(op))
        operands = [local[v] for v in op.operands]
        new = type(op).create(operands=operands, result_types=result_types, attributes=attrs)
        new.location = op.location
        for old, nr in zip(op.results, new.results, strict=True):
            nr.name_hint = old.name_hint
            local[old] = nr
        block.add_op(new)
    stored = []
    for r in p.outputs:
        ax = p.result_axes[r] if s > 1 else None
        st = tpu.StoreOp(operands=[local[r]], result_types=[r.type],
                         attributes={"slice_axis": i64_attr(-1 if ax is None else ax),
                                     "ts": i64_attr(2)})
        owner = r.owner
        assert isinstance(owner, Operation)
        set_name(st, f"{op_name(owner) or owner.name}.store")
        block.add_op(st)
        stored.append(st.output)
    block.add_op(tpu.YieldOp(operands=[stored]))
    group = tpu.GroupOp(operands=[p.inputs], result_types=[[r.type for r in p.outputs]],
                        regions=[Region(block)],
                        attributes={"slices": i64_attr(s), "cost": i64_attr(int(p.cost))})
    first = p.ops[0]
    set_name(group, f"group.{op_name(first) or first.name}")
    return group


def _value_name(v: SSAValue) -> str:
    """What a load of `v` loads, by name: the op that computes it — inside the group that
    stored it, for a result of an earlier group (not the group's own name) — or the value's
    name for a function argument."""
    owner = v.owner
    if isinstance(owner, tpu.GroupOp) and isinstance(v, OpResult):
        owner = owner.computed_by(v.index) or owner
    if isinstance(owner, Operation):
        return op_name(owner) or owner.name
    return v.name_hint or "input"


def _install(group: tpu.GroupOp, p: Plan) -> None:
    first = p.ops[0]
    for v in p.inputs:  # weights and constants between the grouped ops (weight-reorder puts a
        # transposed weight just before its matmul) move above the group that now uses them
        w = v.owner
        if (isinstance(w, Operation) and _is_global_source(w)
                and w.parent_block() is first.parent_block() and not w.is_before_in_block(first)):
            w.detach()
            Rewriter.insert_op(w, InsertPoint.before(first))
    Rewriter.insert_op(group, InsertPoint.before(first))
    for r, gr in zip(p.outputs, group.outputs, strict=True):
        gr.name_hint = r.name_hint
        r.replace_all_uses_with(gr)
    for op in reversed(p.ops):
        op.detach()
        op.erase()


# ------------------------------------------------------------------------------ the pass


def _is_global_source(op: Operation) -> bool:
    """A weight or constant: in global memory before the net runs (`GLOBAL_SOURCE`)."""
    return isinstance(op, SlicingInterface) and op.GLOBAL_SOURCE


def _gather_table(op: Operation) -> SSAValue | None:
    """The operand `op` reads row by row from global memory (`row_gather_table`)."""
    return op.row_gather_table() if isinstance(op, SlicingInterface) else None


def compute_ops(fn: func.FuncOp) -> list[Operation]:
    """The ops layer groups compute: every Top/Tpu op but weights, constants and
    collectives (not groups, not the return)."""
    ops: list[Operation] = list(fn.body.block.ops)  # xDSL's BlockOps iterates untyped
    return [op for op in ops
            if isinstance(op, SlicingInterface) and not op.GLOBAL_SOURCE
            and not _is_collective(op)]


def _is_collective(op: Operation) -> bool:
    """A `dev` collective: it runs on the link between groups, never in one."""
    return isinstance(op, dev.CollectiveOp)


def segments(fn: func.FuncOp) -> list[list[Operation]]:
    """The compute ops in runs between collectives (`dev.*`): a collective runs on the link
    between groups, its operand stored to global memory before it and its result loaded
    after it, so no group spans one."""
    runs: list[list[Operation]] = [[]]
    ops = set(compute_ops(fn))
    for op in fn.body.block.ops:
        if _is_collective(op):
            runs.append([])
        elif op in ops:
            runs[-1].append(op)
    return [r for r in runs if r]


def partition(ops: list[Operation], chip: Chip, max_ops: int, split: str = "cost"
              ) -> list[Plan]:
    """Dynamic programming over contiguous spans: the cheapest partition into groups."""
    n = len(ops)
    best: list[float] = [math.inf] * (n + 1)
    choice: list[Plan | None] = [None] * (n + 1)
    best[0] = 0.0
    for j in range(1, n + 1):
        for i in range(max(0, j - max_ops), j):
            if best[i] == math.inf:
                continue
            plan = plan_span(ops[i:j], chip, split=split)
            if plan is None:
                continue
            c = best[i] + plan.cost
            if c < best[j]:
                best[j], choice[j] = c, plan
        if best[j] == math.inf:
            op = ops[j - 1]
            need, how = _finest(op, chip)
            raise LayerGroupError(
                f"'{op.name}' ({op_name(op)}) cannot run from local memory on {chip.name}: "
                f"even its finest slicing ({how}) still needs {need} B per lane, "
                f"{need - chip.lane_bytes} B more than a lane's {chip.lane_bytes} B")
    plans: list[Plan] = []
    j = n
    while j > 0:
        plan = choice[j]
        assert plan is not None
        plans.append(plan)
        j -= len(plan.ops)
    return plans[::-1]


def _finest(op: Operation, chip: Chip) -> tuple[int, str]:
    """The fewest per-lane bytes any slicing of `op` alone needs, and that slicing."""
    inside = {op}
    counts: list[tuple[SliceKind, int]] = [(SliceKind.ROWS, _row_count([op]) or 1)]
    if col_sliceable(op):
        counts.append((SliceKind.COLS, col_count(op)))
    if heads_sliceable(op):
        counts.append((SliceKind.HEADS, heads_count(op)))
    best: tuple[int, str] = (math.inf, "one slice")  # type: ignore[assignment]  # inf: unbounded
    what = {SliceKind.ROWS: "row", SliceKind.COLS: "output-channel",
            SliceKind.HEADS: op.HEADS_UNIT if isinstance(op, SlicingInterface) else "head"}
    for kind, n in counts:
        p = _make_plan([op], kind, n, inside)
        if p is not None:
            how = "one slice" if n == 1 else f"{n} {what[kind]} slices"
            best = min(best, (_lane_bytes_bound(p, chip), how))
    tiles = _tile_candidates([op], replace(chip, lane_bytes=1 << 62), None, reduce=True) \
        or _tile_candidates([op], replace(chip, lane_bytes=1 << 62), None)
    if tiles:
        p = max(tiles, key=lambda q: q.slices)
        how = f"{p.tiles[0]} x {p.tiles[1]} tiles"
        if p.parts > 1:
            how += f" of {p.parts} reduction parts"
        best = min(best, (_tile_lane_bytes(p, chip), how))
    return best


def _realize(plan: Plan, chip: Chip, split: str = "cost") -> list[tuple[tpu.GroupOp, Plan]]:
    """Build and allocate `plan`; slice further or split when the allocation fails."""
    tries = [plan]
    kinds = [sorted(_candidates(plan.ops, kind, chip, None), key=lambda q: q.cost)
             for kind in SliceKind]
    if any(q.expert_blocks for k in kinds for q in k):
        # an op with experts: its blocks of experts or its row slices, the cheaper first
        # (a row slice fetches again the experts its rows chose)
        tries += sorted((q for k in kinds for q in k), key=lambda q: q.cost)
    else:
        tries += [q for k in kinds for q in k]
    tries += sorted(_reduction_plans(plan.ops, chip, None), key=lambda q: q.cost)
    split_cost = math.inf
    if len(plan.ops) > 1 and any(_expert_block_axes(op) is not None for op in plan.ops):
        # a span with experts: alone they may stream in blocks of experts, each chosen
        # expert loaded once, where the span's row slices fetch them again per slice: a
        # try dearer than the ops planned one by one gives way to them
        singles = [plan_span([op], chip, split=split) for op in plan.ops]
        if all(q is not None for q in singles):
            split_cost = sum(q.cost for q in singles if q is not None)
    for p in tries:
        if p.slices < plan.slices and p.kind == plan.kind:
            continue
        if p is not plan and p.cost > split_cost:
            continue
        group = build_group(p)
        try:
            allocate_group(group, chip)
        except LocalMemoryError:
            group.erase()
            continue
        return [(group, p)]
    if len(plan.ops) == 1:
        op = plan.ops[0]
        raise LayerGroupError(
            f"'{op.name}' ({op_name(op)}) does not fit local memory on {chip.name} with any "
            "slicing; use a chip with more local memory or smaller static shapes")
    out = []
    for op in plan.ops:
        single = plan_span([op], chip, split=split)
        if single is None:
            raise LayerGroupError(f"'{op.name}' ({op_name(op)}) cannot be grouped")
        out += _realize(single, chip, split)
    return out


def split_attention_keys(fn: func.FuncOp, chip: Chip) -> None:
    """Each attention over a history that no slicing fits in local memory becomes two
    `tpu.attention_part`s, over the history's keys and over the new ones (the mask's
    columns sliced to each), and a `tpu.attention_merge` of them (online softmax between
    groups, in f32 in global memory): each part's keys and values are half of them."""
    for op in compute_ops(fn):
        if (not isinstance(op, tpu.AttentionOp) or op.history_k is None
                or op.history_v is None or plan_span([op], chip) is not None):
            continue
        hist = shape_of(op.history_k)[1]
        total = op.total_keys()
        masks: list[SSAValue | None] = [None, None]
        new_ops: list[Operation] = []
        if op.mask is not None:
            ms = shape_of(op.mask)
            if ms[-1] != total:
                continue  # a mask broadcast along the keys: not split
            for i, (lo, hi) in enumerate(((0, hist), (hist, total))):
                sl = tpu.SliceOp(op.mask, len(ms) - 1, lo, hi)
                set_name(sl, f"{op_name(op)}.mask{i}")
                new_ops.append(sl)
                masks[i] = sl.output
        parts = []
        for i, (k, v, causal) in enumerate(((op.history_k, op.history_v, False),
                                            (op.k, op.v, read_bool(op.causal)))):
            part = tpu.AttentionPartOp(op.q, k, v, masks[i], scale=read_float(op.scale),
                                       q_heads=read_int(op.q_heads),
                                       kv_heads=read_int(op.kv_heads),
                                       head_dim=read_int(op.head_dim), causal=causal)
            if "compute" in op.attributes:
                part.attributes["compute"] = op.attributes["compute"]
            part.location = op.location
            set_name(part, f"{op_name(op)}.part{i}")
            new_ops.append(part)
            parts.append(part.output)
        merge = tpu.AttentionMergeOp.create(operands=parts, result_types=[op.output.type])
        merge.location = op.location
        merge.output.name_hint = op.output.name_hint
        new_ops.append(merge)
        Rewriter.insert_op(new_ops, InsertPoint.before(op))
        op.output.replace_all_uses_with(merge.output)
        op.detach()
        op.erase()


def layer_group_function(fn: func.FuncOp, chip: Chip, max_ops: int = 12, split: str = "cost"
                         ) -> list[tpu.GroupOp]:
    if split not in SPLIT_REDUCTION:
        raise LayerGroupError(f"split-reduction is '{split}'; it is one of "
                              f"{', '.join(SPLIT_REDUCTION)}")
    try:
        split_attention_keys(fn, chip)
        plans = [p for run in segments(fn) for p in partition(run, chip, max_ops, split)]
        groups = []
        for stale in plans:
            # earlier groups replaced some of this span's inputs: plan it again, same choice
            plan = plan_span(stale.ops, chip, stale.slices, (stale.kind,), split) or stale
            for group, p in _realize(plan, chip, split):
                _install(group, p)
                groups.append(group)
        return groups
    finally:
        _clear_run_caches()


@dataclass(frozen=True)
class ChipPass(ModulePass):
    """A pass that plans for a chip: a preset by name (`chip`, the pass option), or a
    description that is not a preset (`for_chip`: tests, what-if studies; not an option)."""

    chip: str = DEFAULT_CHIP
    target: Chip | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def for_chip(cls, chip: Chip, **options: int | str) -> Self:
        p = cls(chip.name, **options)
        object.__setattr__(p, "target", chip)  # frozen: set once, here
        return p

    def the_chip(self) -> Chip:
        return self.target if self.target is not None else get_chip(self.chip)


@dataclass(frozen=True)
class LayerGroupPass(ChipPass):
    """Partition Tpu ops into local-memory layer groups (DP over spans) and allocate them."""

    name = "layer-group"

    max_ops: int = 12
    #: where a reduction is split in parts (`SPLIT_REDUCTION`)
    split_reduction: str = "cost"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "tpu", self.name)
        chip = self.the_chip()
        for fn in [f for f in op.ops if isinstance(f, func.FuncOp)]:
            layer_group_function(fn, chip, self.max_ops, self.split_reduction)


@dataclass(frozen=True)
class LmemVerifyPass(ChipPass):
    """Re-check every group's local-memory allocation (alignment, capacity, overlap, banks)."""

    name = "lmem-verify"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "tpu", self.name)
        chip = self.the_chip()
        for g in op.walk():
            if isinstance(g, tpu.GroupOp):
                try:
                    verify_group(g, chip)
                except LocalMemoryError as e:
                    raise LocalMemoryError(f"{op_name(g)}: {e}") from e

