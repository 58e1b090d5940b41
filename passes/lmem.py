"""Local-memory buffers of a layer group: their lifetimes, allocation and verification.

A group's template has loads, m compute ops and stores. Slice i runs its loads in pipeline
stage i, its compute in stage i+1 and its stores in stage i+2, so with P = m + 2 time
units per stage:

- a sliced load of slice i lives from i*P until its last use by compute op k_last:
  (i+1)*P + 1 + k_last;
- the result of compute op k of slice i lives from (i+1)*P + 1 + k until its last use in
  the same slice, or, when it is stored, until the store: (i+2)*P + m + 1;
- a resident load (a whole tensor, e.g. weights of a row-sliced group) lives for the whole
  group.

Sliced loads and stored results of slice i overlap those of slice i+1 (that is the point of
the pipeline), so they get two copies (ping-pong by slice parity); slice i+2 reuses slice
i's copy. Every buffer occupies the same per-lane address range in all lanes
(`Chip.per_lane` bytes: the tensor is split evenly across lanes).

Rules (checked by `verify_group`, honoured by `allocate_group`):
- addresses are multiples of the chip's alignment and buffers end within a lane;
- two buffers live at the same time never share bytes;
- a compute op's result never shares a bank with any of its local inputs (the engine
  reads and writes different banks in the same cycle).
The pattern repeats every two slices, so checking a window of four slices checks them all.

In a group of 2-D tiles (`tpu.GroupOp.tile_grid`), a load sliced by the outer tile loop
only serves the n tiles of the inner loop (`GroupOp.tiles_per_buffer`): instance b of it
lives from b*n*P until its last use by the compute of tile b*n + n - 1, and its two copies
alternate by b. The window then spans four instances of the buffer with the longer period
and every instance of the other that overlaps them.

A group with reduction parts (R x C tiles of Q parts each) has one more buffer: the
accumulator of its op (`tpu.accumulator_type`, one copy, the group's `acc` address), live
from the compute of a tile's first part to that of its last (period Q*P); the op's result
exists from its last part until its store, one instance per tile (period Q*P, two copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from xdsl.ir import Operation, SSAValue

from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import nbytes
from toptpu.dialects import tpu
from toptpu.dialects.common import i64_attr, numel, read_int
from toptpu.dialects.naming import op_name
from toptpu.errors import ToptpuError

BIG = 1 << 60


class LocalMemoryError(ToptpuError):
    pass


class BufferKind(StrEnum):
    """A local buffer's lifetime (see the module doc)."""

    RESIDENT = "resident"  # loaded whole once, live for the whole group
    SLICED = "sliced"  # a loaded slice
    INTERMEDIATE = "intermediate"  # a computed value used inside the slice only
    STORED = "stored"  # a computed value stored back to global memory
    ACCUMULATOR = "accumulator"  # a reduction's f32 accumulator over a tile's parts


@dataclass
class LocalBuffer:
    value: SSAValue
    op: Operation
    kind: BufferKind
    copies: int
    per_lane: int
    start: int  # time of slice 0
    end: int  # time of slice 0 (inclusive)
    period: int  # time shift per instance (P, or n*P for one serving n tiles), 0 resident
    count: int = 1  # instances over the group (slices, or slices / n)

    def interval(self, i: int) -> tuple[int, int]:
        if self.kind == BufferKind.RESIDENT:
            return (-1, BIG)
        return (self.start + i * self.period, self.end + i * self.period)

    def name(self) -> str:
        return op_name(self.op) or self.op.name


def _tpu_op(op: Operation) -> tpu.TpuOp:
    if not isinstance(op, tpu.TpuOp):
        raise LocalMemoryError(f"'{op.name}' ({op_name(op) or 'unnamed'}) in a tpu.group is not "
                               "a Tpu op: run convert-top-to-tpu before layer-group")
    return op


def group_buffers(group: tpu.GroupOp, chip: Chip) -> list[LocalBuffer]:
    """Every local buffer of the group with its lifetime (see the module doc)."""
    loads, computes, stores = group.template()
    m = len(computes)
    period = m + 2
    index = {op: k for k, op in enumerate(computes)}
    stored = {s.input for s in stores}
    sliced = read_int(group.slices) > 1

    def last_use(v: SSAValue) -> int:
        ks = [index[u.operation] for u in v.uses if u.operation in index]
        return max(ks) if ks else -1

    bufs: list[LocalBuffer] = []
    slices = read_int(group.slices)
    for ld in loads:
        resident = read_int(ld.slice_axis) == -1
        kind = BufferKind.RESIDENT if resident else BufferKind.SLICED
        copies = 2 if (sliced and not resident) else 1
        n = group.tiles_per_buffer(ld)
        bufs.append(LocalBuffer(ld.output, ld, kind, copies, chip.per_lane(nbytes(ld.output)),
                                0, n * period + 1 + max(last_use(ld.output), 0), n * period,
                                slices // n))
    parts = group.reduction_parts()
    for k, op in enumerate(computes):
        if parts > 1:  # the accumulator, then the result from the tile's last part on
            acc = tpu.accumulator_type(op)
            bufs.append(LocalBuffer(op.results[0], op, BufferKind.ACCUMULATOR, 1,
                                    chip.per_lane(numel(acc.get_shape()) * 4), period + 1 + k,
                                    (parts - 1) * period + period + 1 + k, parts * period,
                                    slices // parts))
        before = (parts - 1) * period  # the result is written by the last part
        for r in op.results:
            start = period + 1 + k + before
            if r in stored:
                kind, end = BufferKind.STORED, 2 * period + m + 1 + before
                copies = 2 if sliced else 1
            else:
                kind, end = BufferKind.INTERMEDIATE, period + 1 + max(last_use(r), k)
                copies = 1
            bufs.append(LocalBuffer(r, op, kind, copies, chip.per_lane(nbytes(r)), start, end,
                                    parts * period, slices // parts))
    return bufs


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _banks(addr: int, size: int, chip: Chip) -> range:
    return range(addr // chip.bank_bytes, (addr + max(size, 1) - 1) // chip.bank_bytes + 1)


def _time_conflict(a: LocalBuffer, ca: int, b: LocalBuffer, cb: int, slices: int) -> bool:
    """Whether copy `ca` of `a` and copy `cb` of `b` are ever live at the same time: over
    four instances of the one with the longer period, every instance of the other that
    overlaps them in time (see the module doc)."""
    if a.period < b.period or (a.period == b.period and a.count < b.count):
        a, ca, b, cb = b, cb, a, ca
    if b.kind == BufferKind.RESIDENT or a.kind == BufferKind.RESIDENT:
        return ca < a.count and cb < b.count
    for i in range(ca, min(a.count, 4), a.copies):
        lo, hi = a.interval(i)
        # instances j of b with b.start + j*p <= hi and lo <= b.end + j*p
        p = b.period
        jlo = max(0, -(-(lo - b.end) // p))
        jhi = min(b.count - 1, (hi - b.start) // p)
        first = jlo + (cb - jlo) % b.copies
        if first <= jhi:
            return True
    return False


def _bank_pairs(group: tpu.GroupOp, bufs: list[LocalBuffer]) -> set[tuple[int, int]]:
    """Index pairs (output buffer, input buffer) of compute ops: must not share banks."""
    by_value = {b.value: i for i, b in enumerate(bufs) if b.kind != BufferKind.ACCUMULATOR}
    accs = {b.op: i for i, b in enumerate(bufs) if b.kind == BufferKind.ACCUMULATOR}
    pairs: set[tuple[int, int]] = set()
    _, computes, _ = group.template()
    for op in computes:
        for r in op.results:
            for v in op.operands:
                if v in by_value and r in by_value:
                    pairs.add((by_value[r], by_value[v]))
        if op in accs:  # the accumulator is written from the inputs, the result from it
            pairs |= {(accs[op], by_value[v]) for v in op.operands if v in by_value}
            pairs |= {(by_value[r], accs[op]) for r in op.results if r in by_value}
    return pairs


def allocate_group(group: tpu.GroupOp, chip: Chip) -> None:
    """First-fit allocation of every buffer copy; writes the `lmem` attributes.

    Raises LocalMemoryError when the buffers cannot fit (the caller slices further)."""
    bufs = group_buffers(group, chip)
    slices = read_int(group.slices)
    pairs = _bank_pairs(group, bufs)
    bank_partners: dict[int, set[int]] = {}
    for first, second in pairs:
        bank_partners.setdefault(first, set()).add(second)
        bank_partners.setdefault(second, set()).add(first)
    items = [(i, c) for i, b in enumerate(bufs) for c in range(b.copies)]
    items.sort(key=lambda ic: (-bufs[ic[0]].per_lane, ic[0], ic[1]))
    placed: dict[tuple[int, int], int] = {}
    for i, c in items:
        b = bufs[i]
        size = b.per_lane
        blockers = []  # (start, end) byte ranges this copy must avoid
        for (j, cj), at in placed.items():
            o = bufs[j]
            if _time_conflict(b, c, o, cj, slices):
                blockers.append((at, at + o.per_lane))
            if j in bank_partners.get(i, ()):
                if b.copies == 1 or o.copies == 1 or c == cj:
                    lo = at // chip.bank_bytes * chip.bank_bytes
                    hi = -(-(at + max(o.per_lane, 1)) // chip.bank_bytes) * chip.bank_bytes
                    blockers.append((lo, hi))
        candidates = sorted({0, *(e for _, e in blockers)})
        addr: int | None = None
        for cand in candidates:
            cand = -(-cand // chip.align) * chip.align
            if cand + size > chip.lane_bytes:
                continue
            if all(cand + size <= s or cand >= e for s, e in blockers):
                addr = cand
                break
        if addr is None:
            need = sum(bb.per_lane * bb.copies for bb in bufs)
            raise LocalMemoryError(
                f"local memory is full: buffer of {b.name()} ({size} B/lane) does not fit; "
                f"the group's buffers total {need} B/lane, a lane has {chip.lane_bytes}"
            )
        placed[(i, c)] = addr
    per_op: dict[Operation, list[int]] = {}
    for i, b in enumerate(bufs):  # results in order: lmem lists each result's copies
        if b.kind == BufferKind.ACCUMULATOR:
            group.acc = i64_attr(placed[(i, 0)])
            continue
        per_op.setdefault(b.op, []).extend(placed[(i, c)] for c in range(b.copies))
    for op, addrs in per_op.items():
        _tpu_op(op).set_local_addresses(addrs)


def verify_group(group: tpu.GroupOp, chip: Chip) -> None:
    """Re-check the allocation written in the IR; raise LocalMemoryError naming the
    buffers on any violation."""
    bufs = group_buffers(group, chip)
    slices = read_int(group.slices)
    addrs: list[list[int]] = []
    for b in bufs:
        op = _tpu_op(b.op)
        if b.kind == BufferKind.ACCUMULATOR:
            if group.acc is None:
                raise LocalMemoryError(f"{b.name()}'s accumulator has no local address")
            a = [read_int(group.acc)]
        elif op.lmem is None:
            raise LocalMemoryError(f"{b.name()} has no local address")
        else:
            a = op.local_addresses(b.value, read_int(group.slices) > 1)
        if len(a) != b.copies:
            raise LocalMemoryError(f"{b.name()} needs {b.copies} address(es), has {len(a)}")
        for x in a:
            if x % chip.align:
                raise LocalMemoryError(f"{b.name()} at {x} is not {chip.align}-byte aligned")
            if x < 0 or x + b.per_lane > chip.lane_bytes:
                raise LocalMemoryError(
                    f"{b.name()} at [{x}, {x + b.per_lane}) is outside the lane "
                    f"({chip.lane_bytes} B)")
        addrs.append(a)
    n = len(bufs)
    for i in range(n):
        for j in range(i, n):  # j == i: the ping-pong copies of one buffer against each other
            for ci in range(bufs[i].copies):
                for cj in range(ci + 1 if j == i else 0, bufs[j].copies):
                    ai, aj = addrs[i][ci], addrs[j][cj]
                    if ai + bufs[i].per_lane <= aj or aj + bufs[j].per_lane <= ai:
                        continue
                    if _time_conflict(bufs[i], ci, bufs[j], cj, slices):
                        raise LocalMemoryError(
                            f"live buffers overlap: {bufs[i].name()} [{ai}, "
                            f"{ai + bufs[i].per_lane}) and {bufs[j].name()} [{aj}, "
                            f"{aj + bufs[j].per_lane})")
    for o, iv in _bank_pairs(group, bufs):
        for co in range(bufs[o].copies):
            for ci in range(bufs[iv].copies):
                if bufs[o].copies == 2 and bufs[iv].copies == 2 and co != ci:
                    continue
                bo = set(_banks(addrs[o][co], bufs[o].per_lane, chip))
                bi = set(_banks(addrs[iv][ci], bufs[iv].per_lane, chip))
                if bo & bi:
                    raise LocalMemoryError(
                        f"bank conflict: {bufs[o].name()} writes bank(s) {sorted(bo & bi)} "
                        f"that its input {bufs[iv].name()} occupies")
