"""Host-speed joins of the reference machine's fast mode: a matmul the compiler sliced computed
as one host product (`SliceJoin`), and the slices of row-local ops computed on whole tensors
(`WholeRows`), each checked bit for bit against the slices' own results on its first run
(see `toptpu.backend.runtime.machine`'s module doc). `find_joins` finds them in a net's
steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from xdsl.ir import Operation

from toptpu.backend.runtime.steps import LoadStep, Operand, OpStep, Step, StoreStep
from toptpu.dialects import top, tpu
from toptpu.dialects.common import read_bool

if TYPE_CHECKING:
    from toptpu.backend.runtime.machine import Machine


# ====================================================================== joined slices


#: ops whose result rows depend only on the same rows of their row-sliced inputs (the other
#: inputs broadcast along the trailing axes): a rows join computes them on whole inputs
ROW_LOCAL_OPS: tuple[type[Operation], ...] = (top.UnaryOp, top.BinaryOp, tpu.CastOp,
                                              tpu.RmsNormOp, tpu.ReshapeOp)


@dataclass(eq=False)
class WholeRows:
    """The whole of a buffer whose row slices a group's slices hold one each of: the global
    tensor the slices load (`g`); the whole product of a rows join (`product`: the slices
    are its matmul's); or the first slice's row-local `step` (one of `ROW_LOCAL_OPS`) on
    the wholes of its row-sliced inputs (`ins`; None: an input that is resident, one buffer
    for all slices, read from local memory as it is).

    The slices of a row-local op (`slices`, at their `positions` in the plan) take their
    parts of its whole (`parts`) instead of computing them again — the wholes a rows join
    computes for its product anyway, and chains of row-local ops of their own (the MLP's
    silu of the loaded gate and its product with the up projection's join): checked bit for
    bit on their first run (`Machine.part_ok`), and not while the global tensors they load
    may change (`guard`: the join's, or the chain's own `LoadGuard`). A reshape or a cast
    may return its input itself, a view of global memory that a later store could change
    under a live local buffer: those compute their slices."""

    g: int = -1
    step: OpStep | None = None
    ins: list[WholeRows | None] = field(default_factory=list)
    shape: tuple[int, ...] = ()  # the whole's shape
    slices: list[OpStep] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    parts: list[tuple[slice, ...]] = field(default_factory=list)
    guard: SliceJoin | LoadGuard | None = None  # whose `inputs_stable` the parts follow
    product: SliceJoin | None = None

    def value(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]
              ) -> np.ndarray | None:
        """The whole in this run; None where it is not known (a join that did not compute
        its whole product in this run, or a whole computed from one)."""
        if self.product is not None:
            return m.joined.get(self.product)
        step = self.step
        if step is None:
            return views[self.g][0]
        if self in m.joined:  # computed once a run: the wholes' joins may share it
            return m.joined[self]
        args = [c.value(m, views) if c is not None
                else m.local.read(r, step.who) if r is not None else None
                for c, r in zip(self.ins, step.ins, strict=True)]
        got: np.ndarray | None
        if any(a is None for a, c in zip(args, self.ins, strict=True) if c is not None):
            got = None
        elif isinstance(step.op, tpu.ReshapeOp):
            got = args[0].reshape(self.shape)  # type: ignore[union-attr]  # no None: checked above
        else:
            got = step.fn(step.op, args, m.context)[0]
        m.joined[self] = got
        return got

    def part(self, m: Machine, step: OpStep, args: list[np.ndarray | None],
             views: list[tuple[np.ndarray, bool, int]]) -> np.ndarray:
        """The result of `step`, one of `slices`: its part of the whole where that is
        allowed on this host and in this run, else its own."""
        verdict = m.part_ok.get(self)
        assert self.guard is not None
        if verdict is False or not self.guard.inputs_stable(views):
            return step.compute(m, args)[0]
        whole = self.value(m, views)
        if whole is None:
            return step.compute(m, args)[0]
        i = step.join_at
        part = whole[self.parts[i]]
        if verdict is None:
            return _checked(m, m.part_ok, self, step, args, part, i == len(self.slices) - 1)
        return part


def _checked(m: Machine, verdicts: dict[Any, bool], key: SliceJoin | WholeRows, step: OpStep,
             args: list[np.ndarray | None], part: np.ndarray, last: bool) -> np.ndarray:
    """A slice's result on the first use of a join or of a whole's parts: its own, which
    decides `verdicts[key]` against `part` byte for byte (False at the first slice that
    differs, True when the last one matched). Its converted weight is not kept: the
    whole's is."""
    own = step.compute(m, args, keep=False)[0]
    if not (own.dtype == part.dtype and own.shape == part.shape
            and own.tobytes() == part.tobytes()):
        verdicts[key] = False
    elif last:
        verdicts[key] = True
    return own


@dataclass(eq=False)
class LoadGuard:
    """The global tensors a chain of row slices loads (`sources`) and the operands stored
    to while they load (`stores`): a whole computed from the sources at the first slice is
    what every slice loads only when no such store overlaps them (checked per run)."""

    sources: list[int]
    stores: list[int]

    def inputs_stable(self, views: list[tuple[np.ndarray, bool, int]]) -> bool:
        return _disjoint(views, self.sources, self.stores)


def _disjoint(views: list[tuple[np.ndarray, bool, int]], sources: Sequence[int | None],
              stores: Sequence[int]) -> bool:
    """Whether none of the `stores` operands overlaps a `sources` operand in memory."""
    for src in sources:
        x_view, _, x_addr = views[src]  # type: ignore[index]  # a rows join's: no None
        x_end = x_addr + x_view.nbytes
        for g in stores:
            view, _, addr = views[g]
            if addr < x_end and x_addr < addr + view.nbytes:
                return False
    return True


@dataclass(eq=False)
class SliceJoin:
    """The slices of one matmul that the fast mode computes as one host product.

    The compiler slices a layer group to fit local memory: a matmul runs once per slice,
    either on row slices of its input with the weight resident (`rows`), or on slices of
    the weight's output channels with the input resident (`cols`). The chip does the same
    work either way; a host BLAS does not: each row slice re-reads the whole weight, each
    column slice pays a call. So the fast mode computes the whole product once, at the
    first slice, and each slice's command takes its part. A `rows` join's whole input is
    read from the global tensor its slices load, through the row-local ops the group
    applies to each slice first (`WholeRows`: an RMS norm, a reshape of the trailing axes,
    elementwise ops); a `cols` join reads the weight's global tensors whole. Every command
    still runs (its loads, local reads and writes, frees: all traps fire); only the
    matmul's kernel call is shared.

    Bit for bit: a row or column of a product does not depend on the other rows or columns
    it is computed with in the kernels (numpy's elementwise ops and row reductions, BLAS's
    GEMM), but a BLAS may switch kernels by shape (GEMV for one row) and sum in another
    order. So the first time a join runs on a machine, each slice's own product is
    computed too and compared with its part, byte for byte; the slices' own results are
    what that run returns, and the join is used from the next run on only if every part
    matched (`Machine.join_ok`). A `rows` join also needs its global inputs unchanged
    while its slices load: when a store of that run may write one of them (address ranges
    checked per run), the slices run alone.
    """

    kind: str  # "rows" or "cols"
    steps: list[OpStep]  # one per slice, in execution order
    parts: list[tuple[slice, ...]]  # each slice's part of the whole product
    sources: list[int | None]  # rows: the global inputs; cols: the weight's operands
    guard: list[int]  # rows: operands stored to while the inputs' slices load
    rows: WholeRows | None = None  # rows: the whole input
    resident: frozenset[int] = frozenset()  # buffers that must hold one value for all slices

    def result(self, m: Machine, step: OpStep, args: list[np.ndarray | None],
               views: list[tuple[np.ndarray, bool, int]]) -> np.ndarray:
        verdict = m.join_ok.get(self)
        if verdict is False:  # refused on this host
            return step.compute(m, args)[0]
        i = step.join_at
        if i == 0:
            m.joined[self] = self._whole(m, step, args, views)
        whole = m.joined.get(self)
        if whole is None:  # its input is stored to during this run
            return step.compute(m, args)[0]
        part = whole[self.parts[i]]
        if verdict is None:
            return _checked(m, m.join_ok, self, step, args, part, i == len(self.steps) - 1)
        return part

    def inputs_stable(self, views: list[tuple[np.ndarray, bool, int]]) -> bool:
        """A rows join: whether no store of this run (to the `guard` operands) overlaps
        its global inputs."""
        return _disjoint(views, self.sources, self.guard)

    def _whole(self, m: Machine, step: OpStep, args: list[np.ndarray | None],
               views: list[tuple[np.ndarray, bool, int]]) -> np.ndarray | None:
        """The whole product, None when this run's stores may change a rows join's inputs
        while its slices load (or a cols join's weight is writable)."""
        if self.kind == "rows":
            assert self.rows is not None
            if not self.inputs_stable(views):
                return None
            x = self.rows.value(m, views)
            if x is None:
                return None
            return step.compute(m, [x, *args[1:]])[0]
        whole: list[np.ndarray | None] = [args[0]]
        key: list[tuple[int, tuple[int, ...]] | None] = []
        for g in self.sources:
            if g is None:
                whole.append(None)
                key.append(None)
                continue
            view, writable, addr = views[g]
            if writable:
                return None
            whole.append(view)
            key.append((addr, view.shape))  # `held_key` of a whole read
        n = 4 if step.special == "a16" else 1  # the weight's operands (`A16_WEIGHT`)
        return step.compute(m, whole, tuple(key[:n]))[0]


Writer = tuple[int, "Step"]  # (position, step) of the step that last wrote a buffer


def find_joins(steps: list[Step], operands: list[Operand]) -> None:
    """Give each step of a matmul whose slices the fast mode joins (see `SliceJoin`) its
    `join`; `steps` in execution order."""
    writer: dict[int, Writer] = {}  # buf -> the step that last wrote it
    inputs: dict[int, list[Writer | None]] = {}  # op position -> its inputs' writers
    chains: dict[tuple[int, int], list[tuple[int, OpStep]]] = {}
    for pos, step in enumerate(steps):
        if isinstance(step, LoadStep):
            writer[step.local.buf] = (pos, step)
        elif isinstance(step, OpStep):
            inputs[pos] = [writer.get(r.buf) if r is not None else None for r in step.ins]
            for r in step.outs:
                writer[r.buf] = (pos, step)
            if step.special and step.table < 0 and step.acc is None:
                chains.setdefault((step.cmd.group, step.cmd.op), []).append((pos, step))
    wholes: dict[tuple[int, ...], WholeRows] = {}  # shared by the joins of one input
    for chain in chains.values():
        if len(chain) < 2:
            continue
        join = (_rows_join(chain, inputs, steps, wholes)
                or _cols_join(chain, inputs, operands))
        if join is not None and _written_between(steps, chain[0][0], chain[-1][0],
                                                 join.resident):
            join = None
        if join is not None:
            for i, (_, step) in enumerate(chain):
                step.join, step.join_at = join, i
            if join.rows is not None:
                _share_parts(steps, join.rows, join)
    _share_row_local_chains(steps, inputs, wholes)


def _share_row_local_chains(steps: list[Step], inputs: dict[int, list[Writer | None]],
                            wholes: dict[tuple[int, ...], WholeRows]) -> None:
    """Let the slices of row-local ops whose whole no join needs take their parts of a
    whole computed once too, where their inputs come from row-sliced loads of global
    tensors, rows joins' products or other such ops (the MLP's silu and product): a host
    call on a whole tensor costs less than one per slice."""
    chains: dict[tuple[int, int], list[Writer]] = {}
    for pos, step in enumerate(steps):
        if (isinstance(step, OpStep) and isinstance(step.op, PART_OPS) and not step.special
                and step.part_of is None and step.join is None):
            chains.setdefault((step.cmd.group, step.cmd.op), []).append((pos, step))
    for chain in chains.values():
        # the ignore below: OpSteps only
        if len(chain) < 2 or chain[0][1].part_of is not None:  # type: ignore[attr-defined]
            continue
        found = _RowSlices(inputs, wholes, products=True)
        whole = found.whole(chain)
        if whole is None or whole.step is None:
            continue
        _share_parts(steps, whole, found.guard(steps))


#: row-local ops whose result is always a new array (not their input: see `WholeRows`)
PART_OPS: tuple[type[Operation], ...] = (top.UnaryOp, top.BinaryOp, tpu.RmsNormOp,
                                         tpu.AttentionOp)

#: an attention's mask operand, sliced along its query rows (axis 2 of [B, 1, Sq, Sk])
MASK_OPERAND, MASK_ROWS = 3, 2


def _query_rows(op: Operation) -> bool:
    """An attention whose result rows depend only on the same query rows (and their rows
    of an explicit mask): not a causal flag's, whose diagonal is at each slice's first
    row."""
    return isinstance(op, tpu.AttentionOp) and not read_bool(op.causal)


def _share_parts(steps: list[Step], whole: WholeRows, guard: SliceJoin | LoadGuard) -> None:
    """Let the slices of the row-local ops in `whole` (a rows join's input, or a chain of
    their own) take their parts of it (`WholeRows.part`), under `guard`."""
    for sub in whole.ins:
        if sub is not None:
            _share_parts(steps, sub, guard)
    first = whole.step
    if first is None or whole.guard is not None or not isinstance(first.op, PART_OPS):
        return
    resident = {r.buf for c, r in zip(whole.ins, first.ins, strict=True)
                if c is None and r is not None}
    if _written_between(steps, whole.positions[0], whole.positions[-1], resident):
        return
    whole.guard = guard
    for i, step in enumerate(whole.slices):
        step.part_of, step.join_at = whole, i


def _written_between(steps: list[Step], first: int, last: int,
                     bufs: frozenset[int] | set[int]) -> bool:
    """Whether one of `bufs` (a join's resident buffers: a rows join's weight, a cols
    join's input; a row-local op's resident inputs) is written by a step after position
    `first` and before `last`."""
    for step in steps[first + 1:last]:
        if isinstance(step, LoadStep) and step.local.buf in bufs:
            return True
        if isinstance(step, OpStep) and any(o.buf in bufs for o in step.outs):
            return True
    return False


def _covering(loads: list[LoadStep], axis: int, size: int) -> bool:
    """Whether `loads` take consecutive parts of one tensor along `axis`, the whole of it."""
    at = 0
    for ld in loads:
        c = ld.cmd
        if (c.axis != axis or c.start != at or c.cuts or ld.local.shape != c.part_shape()
                or ld.local.dtype != np.dtype(c.dtype)):
            return False
        at += c.length
    return at == size


class _RowSlices:
    """Finds how a rows join's whole input is computed (`WholeRows`) from the writers of
    its slices' inputs, one per slice; refuses (None) anything but row-sliced loads of one
    global tensor and the same row-local op in every slice."""

    def __init__(self, inputs: dict[int, list[Writer | None]],
                 wholes: dict[tuple[int, ...], WholeRows], products: bool = False) -> None:
        self.inputs, self.wholes = inputs, wholes
        self.products = products  # whether a rows join's product may be an input
        self.axis = -1
        self.lead: tuple[int, ...] = ()  # the whole's shape before the row axis
        self.parts: list[tuple[int, int]] = []  # each slice's (first row, rows)
        self.loads: list[tuple[int, LoadStep]] = []
        self.resident: set[int] = set()

    def whole(self, srcs: Sequence[Writer | None], axis: int | None = None
              ) -> WholeRows | None:
        """The whole of the buffers `srcs` wrote, one per slice; `axis`: the axis they
        are sliced along when it is not the rows' (an attention's mask), loads only."""
        if any(s is None for s in srcs):
            return None
        ws: list[Writer] = srcs  # type: ignore[assignment]  # no None: checked above
        key = tuple(pos for pos, _ in ws)
        if all(isinstance(s, LoadStep) for _, s in ws):
            return self._loaded(ws, key, axis)
        if axis is not None or not all(isinstance(s, OpStep) for _, s in ws):
            return None
        ops: list[OpStep] = [s for _, s in ws]  # type: ignore[misc]  # all OpSteps: checked above
        if ops[0].join is not None:
            return self._product(ops, key) if self.products else None
        first = ops[0]
        attention = _query_rows(first.op)
        if (not (isinstance(first.op, ROW_LOCAL_OPS) or attention) or first.special
                or first.table >= 0 or first.acc is not None or len(first.outs) != 1
                or any(s.cmd.op != first.cmd.op for s in ops)):
            return None
        ins: list[WholeRows | None] = []
        for k, ref in enumerate(first.ins):
            if any(s.ins[k] is None for s in ops) and ref is not None:
                return None
            if ref is None:
                ins.append(None)
                continue
            writers = [self.inputs[pos][k] for pos, _ in ws]
            if all(s.ins[k] == ref for s in ops) and len(set(writers)) == 1:
                ins.append(None)  # resident: one buffer, written once before the slices
                self.resident.add(ref.buf)
                continue
            if attention and k not in (0, MASK_OPERAND):
                return None  # keys and values are whole for every query row
            sub = self.whole(writers, MASK_ROWS if attention and k == MASK_OPERAND else None)
            if sub is None:
                return None
            ins.append(sub)
        if all(c is None for c in ins):
            return None
        axis = self.axis
        shapes = [s.outs[0].shape for s in ops]
        tail = shapes[0][axis + 1:]
        if any(sh[:axis] != self.lead or sh[axis] != n or sh[axis + 1:] != tail
               for sh, (_, n) in zip(shapes, self.parts, strict=True)):
            return None
        ndim = len(shapes[0])
        if not attention and any(c is None and r is not None and len(r.shape) > ndim - axis - 1
                                 for c, r in zip(ins, first.ins, strict=True)):
            return None  # a resident input would broadcast along the rows
        if isinstance(first.op, tpu.RmsNormOp) and axis >= ndim - 1:
            return None
        total = sum(n for _, n in self.parts)
        parts = [(slice(None),) * axis + (slice(start, start + n),)
                 for start, n in self.parts]
        made = WholeRows(step=first, ins=ins, shape=(*self.lead, total, *tail), slices=ops,
                         positions=list(key), parts=parts)
        return self.wholes.setdefault(key, made)

    def guard(self, steps: list[Step]) -> LoadGuard:
        """The global tensors the found loads read and the operands stored between the
        first and the last of them."""
        at = [pos for pos, _ in self.loads]
        stores = sorted({st.g for st in steps[min(at):max(at) + 1]
                         if isinstance(st, StoreStep)}) if at else []
        return LoadGuard(sorted({ld.g for _, ld in self.loads}), stores)

    def _product(self, ops: list[OpStep], key: tuple[int, ...]) -> WholeRows | None:
        """The whole product of a rows join whose slices are `ops`, in order."""
        join = ops[0].join
        if (join is None or join.kind != "rows" or join.steps != ops
                or any(s.join is not join for s in ops)):
            return None
        axis = len(join.parts[0]) - 1
        parts = [(p[-1].start, p[-1].stop - p[-1].start) for p in join.parts]
        out = ops[0].outs[0].shape
        lead = tuple(out[:axis])
        if self.axis < 0:
            self.axis, self.lead, self.parts = axis, lead, parts
        elif (axis, lead, parts) != (self.axis, self.lead, self.parts):
            return None
        total = sum(n for _, n in parts)
        made = WholeRows(product=join, shape=(*lead, total, *out[axis + 1:]),
                         positions=list(key))
        return self.wholes.setdefault(key, made)

    def _loaded(self, ws: list[Writer], key: tuple[int, ...], along: int | None = None
                ) -> WholeRows | None:
        loads: list[LoadStep] = [s for _, s in ws]  # type: ignore[misc]  # all LoadSteps (whole)
        g, c0 = loads[0].g, loads[0].cmd
        axis = c0.axis
        if (any(ld.g != g for ld in loads) or not 0 <= axis < len(c0.shape) - 1
                or not _covering(loads, axis, c0.shape[axis])):
            return None
        parts = [(ld.cmd.start, ld.cmd.length) for ld in loads]
        if along is not None:  # another axis than the rows': the same rows, in order
            if axis != along or self.axis < 0 or parts != self.parts:
                return None
            self.loads.extend(ws)  # type: ignore[arg-type]  # all LoadSteps (whole)
            return self.wholes.setdefault(key, WholeRows(g=g, shape=tuple(c0.shape)))
        lead = tuple(c0.shape[:axis])
        if self.axis < 0:
            self.axis, self.lead, self.parts = axis, lead, parts
        elif (axis, lead, parts) != (self.axis, self.lead, self.parts):
            return None
        self.loads.extend(ws)  # type: ignore[arg-type]  # all LoadSteps (whole)
        return self.wholes.setdefault(key, WholeRows(g=g, shape=tuple(c0.shape)))


def _rows_join(chain: list[tuple[int, OpStep]], inputs: dict[int, list[Writer | None]],
               steps: list[Step], wholes: dict[tuple[int, ...], WholeRows]
               ) -> SliceJoin | None:
    first = chain[0][1]
    if first.ins[0] is None or any(s.ins[1:] != first.ins[1:] for _, s in chain):
        return None  # the weight is resident
    # the input may come from another rows join's product (the MLP's gate and up after the
    # o projection, norm and residual in one row-sliced group): that join computes its
    # whole at its first slice, before this one's first; where it did not in a run (its
    # inputs stored to, or refused), this one's slices compute alone (`WholeRows.value`)
    found = _RowSlices(inputs, wholes, products=True)
    rows = found.whole([inputs[pos][0] for pos, _ in chain])
    if rows is None:
        return None
    axis = found.axis
    if axis >= len(first.ins[0].shape) - 1:
        return None  # the rows are the contracted axis
    if any(s.outs[0].shape[:axis] != found.lead or s.outs[0].shape[axis] != n
           for (_, s), (_, n) in zip(chain, found.parts, strict=True)):
        return None
    guard = found.guard(steps)
    parts = [(slice(None),) * axis + (slice(start, start + n),) for start, n in found.parts]
    resident = frozenset({r.buf for r in first.ins[1:] if r is not None} | found.resident)
    return SliceJoin("rows", [s for _, s in chain], parts, list(guard.sources), guard.stores,
                     rows, resident)


def _cols_join(chain: list[tuple[int, OpStep]], inputs: dict[int, list[Writer | None]],
               operands: list[Operand]) -> SliceJoin | None:
    first = chain[0][1]
    if first.ins[0] is None or any(s.ins[0] != first.ins[0] for _, s in chain):
        return None  # the input is resident
    sources: list[int | None] = []
    parts: list[tuple[slice, ...]] = []
    for k in range(1, len(first.ins)):
        if first.ins[k] is None:
            if any(s.ins[k] is not None for _, s in chain):
                return None
            sources.append(None)
            continue
        found = [inputs[pos][k] if s.ins[k] is not None else None for pos, s in chain]
        if any(f is None or not isinstance(f[1], LoadStep) for f in found):
            return None
        # the ignore below: all LoadSteps: checked
        loads: list[LoadStep] = [f[1] for f in found]  # type: ignore[index,misc]
        g = loads[0].g
        if (any(ld.g != g for ld in loads) or operands[g].write
                or not _covering(loads, 0, loads[0].cmd.shape[0])):
            return None
        these = [(Ellipsis, slice(ld.cmd.start, ld.cmd.start + ld.cmd.length))
                 for ld in loads]
        if parts and these != parts:
            return None
        # (..., rows) indexes the last axis whatever the rank: parts' slices but the first
        parts = these  # type: ignore[assignment]
        sources.append(g)
    if not parts or any(s.outs[0].shape[-1] != p[-1].stop - p[-1].start
                        for (_, s), p in zip(chain, parts, strict=True)):
        return None
    return SliceJoin("cols", [s for _, s in chain], parts, sources, [],
                     resident=frozenset({first.ins[0].buf}))
