"""The reference machine's commands pre-decoded into steps (`LoadStep`, `StoreStep`, `OpStep`
with its kernel and local ranges resolved) and the first local-memory trap a run of them
meets (`first_local_trap`), found from the command stream alone."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.ir import Operation

from toptpu.backend.formats.commands import (
    Collective,
    Compute,
    Gather,
    GlobalRef,
    Load,
    Store,
)
from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Evaluator, reduction_finish, reduction_part
from toptpu.backend.runtime.errors import MachineTrap
from toptpu.backend.runtime.local_memory import LiveBuffers, Local, local_trap
from toptpu.backend.target.chips import Chip
from toptpu.dialects import dev, tpu
from toptpu.dialects.common import ShapedOp

if TYPE_CHECKING:
    from toptpu.backend.runtime.joins import SliceJoin, WholeRows
    from toptpu.backend.runtime.machine import Machine


# ====================================================================== pre-decoded steps


@dataclass(frozen=True)
class Operand:
    """A global tensor a net reads or writes, resolved once per run."""

    ref: GlobalRef
    shape: tuple[int, ...]
    dtype: np.dtype
    write: bool
    who: str  # the first command that touches it (named by its traps)


class Step(ABC):
    """One command, pre-decoded."""

    __slots__ = ("who",)

    @abstractmethod
    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        """Execute the command on `m`, its global operands resolved to `views`."""


class LoadStep(Step):
    __slots__ = ("g", "window", "local", "prov", "cmd")

    def __init__(self, c: Load, g: int, local: Local) -> None:
        self.who = f"command {c.id} ({c.name})"
        self.g, self.window, self.local, self.cmd = g, c.window(), local, c
        self.prov = held_window(c)

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        whole, writable, addr = views[self.g]
        m.local.write(self.local, whole[self.window], self.who, copy=writable)
        if writable:
            m.provenance.pop(self.local.buf, None)
        else:  # read-only bytes: what the buffer holds is known across runs
            m.provenance[self.local.buf] = (addr, *self.prov)


@dataclass(frozen=True)
class Fetched:
    """What one indexed load (`Load.index`) of a run read from global memory: the rows
    along axis 0 of its tensor (ascending, each once) and their bytes."""

    command: int
    tensor: GlobalRef
    rows: tuple[int, ...]
    nbytes: int
    all_nbytes: int  # the part's bytes of every row (what a load of the whole moves)


class IndexedLoadStep(LoadStep):
    """An indexed load: only the rows its index buffer names are read from global
    memory (each once, in ascending order), the others of the local buffer are zero;
    recorded in `Machine.fetched`."""

    __slots__ = ("index",)

    def __init__(self, c: Load, g: int, local: Local, index: Local) -> None:
        super().__init__(c, g, local)
        self.index = index

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        whole = views[self.g][0]
        picks = m.local.read(self.index, self.who)
        rows = np.unique(picks[picks >= 0]).astype(np.int64)
        if rows.size and rows[-1] >= whole.shape[0]:
            raise MachineTrap(f"{self.who}: index {int(rows[-1])} past the {whole.shape[0]} "
                              f"rows of {self.cmd.tensor}")
        # the part's rows along axis 0 (a block of experts, or all of them): only the
        # picked rows inside it are read
        first, count = self.cmd.part_first_row, self.cmd.part_shape()[0]
        rows = rows[(rows >= first) & (rows < first + count)]
        part = np.zeros(self.local.shape, self.local.dtype)
        held = self.local.shape[0]
        fetched = held < count  # a buffer of the fetched rows, ascending
        if fetched and rows.size > held:
            raise MachineTrap(f"{self.who}: its index names {rows.size} rows of "
                              f"{self.cmd.tensor}; its buffer holds {held}")
        if rows.size:  # the rows read: only their window of the global tensor
            index: tuple[Any, ...] = (rows, *self.window[1:])
            if fetched:
                part[:rows.size] = whole[index]
            else:
                part[rows - first] = whole[index]
        m.local.write(self.local, part, self.who)
        m.provenance.pop(self.local.buf, None)
        row = self.cmd.row_nbytes
        m.fetched.append(Fetched(self.cmd.id, self.cmd.tensor, tuple(int(r) for r in rows),
                                 row * int(rows.size), self.cmd.all_nbytes))


class StoreStep(Step):
    __slots__ = ("g", "window", "part_shape", "local", "free")

    g: int

    def __init__(self, c: Store, g: int, local: Local) -> None:
        self.who = f"command {c.id} ({c.name})"
        self.g, self.window, self.part_shape = g, c.window(), c.part_shape()
        self.local, self.free = local, c.free

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        views[self.g][0][self.window] = m.local.read(self.local, self.who).reshape(
            self.part_shape)
        m.free(self.free)


#: an a16_matmul's weight operands (qweight, scales, zeros, mins) among its `ins`
A16_WEIGHT = tpu.A16MatMulOp.WEIGHT_OPERANDS


class OpStep(Step):
    """A compute command, or a gather (its table read from global memory)."""

    __slots__ = ("op", "fn", "ins", "outs", "free", "free_after", "table", "table_at",
                 "special", "bits", "group_size", "out_dtype", "cmd", "join", "join_at",
                 "part_of", "acc", "part", "last")

    def __init__(self, c: Compute | Gather, op: Operation, fn: Evaluator, chip: Chip,
                 table: int = -1) -> None:
        self.who = f"command {c.id} ({c.name})"
        self.op, self.fn, self.cmd = op, fn, c
        self.join: SliceJoin | None = None
        self.join_at = 0  # its slice's position in the join
        #: a row-local op's slice whose whole a rows join computes (`WholeRows.slices`)
        self.part_of: WholeRows | None = None
        self.ins = [Local.of(r, chip) if r is not None else None for r in c.ins]
        self.outs = [Local.of(r, chip) for r in c.outs]
        self.free, self.free_after = c.free, c.free_after
        self.table = table
        self.table_at = c.table_operand if isinstance(c, Gather) else -1
        self.special = ""
        self.bits = self.group_size = 0
        self.out_dtype = self.outs[0].dtype if self.outs else None
        #: a reduction part (`Compute.parts`): its accumulator, part, whether the last
        self.acc = Local.of(c.acc, chip) if isinstance(c, Compute) and c.acc else None
        self.part = c.part if isinstance(c, Compute) else 0
        self.last = not isinstance(c, Compute) or c.last_part
        conv = op.converted_weight() if isinstance(op, ShapedOp) else None
        if conv is not None and self.table < 0 and len(self.ins) > max(conv.operands) \
                and self.ins[conv.operands[0]] is not None:
            # its weight converted once (cached): a16's dequantized, a f16/bf16 weight
            # (the lm_head) upcast
            self.special = "a16" if conv.form == "a16" else "f32w"
            self.bits, self.group_size = conv.bits, conv.group_size

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        who, local = self.who, m.local
        args: list[np.ndarray | None] = [local.read(r, who) if r is not None else None
                                         for r in self.ins]
        if self.acc is not None:
            self.reduce(m, args)
            return
        if self.table_at >= 0:
            args.insert(self.table_at, views[self.table][0])
        try:
            if self.join is not None and not m.checked:
                results: Sequence[np.ndarray] = [self.join.result(m, self, args, views)]
            elif self.part_of is not None and not m.checked:
                results = [self.part_of.part(m, self, args, views)]
            else:
                results = self.compute(m, args)
        except IndexError as e:  # a gather's index past its table (kernels.gather)
            if self.table_at < 0:
                raise
            table = self.cmd.table.tensor if isinstance(self.cmd, Gather) else "?"
            raise MachineTrap(f"{who}: {e} (table {table}); the ids must be below the "
                              "table's rows") from None
        m.free(self.free)
        for ref, value in zip(self.outs, results, strict=True):
            local.write(ref, value, who)
        m.free(self.free_after)

    def reduce(self, m: Machine, args: list[np.ndarray | None]) -> None:
        """One reduction part: fold it into the accumulator (read unless the first part);
        at the last part free it and write the result (`reference.reduction_finish`)."""
        assert self.acc is not None
        who, local = self.who, m.local
        acc = local.read(self.acc, who) if self.part else None
        if self.special == "a16":  # the part's weights dequantized once (cached)
            x, q, s, z, mins, _ = args
            assert x is not None and q is not None and s is not None
            key = self._weight_key(m)
            w = None if key is None else m.stored_form("a16", key, self.bits,
                                                        self.group_size)
            if w is not None and not w.flags.c_contiguous:
                # the weight cache file's window of the whole form, made contiguous once
                # (as the kernel wants it) and kept across runs, not at every run
                window = w
                w = m.cache.get(("a16", key), lambda: np.ascontiguousarray(window))
            if w is None:
                w = (m.cache.dequantized(("a16", key), q, s, z, self.bits, self.group_size,
                                         mins=mins)
                     if key is not None else K.dequantize(q, s, z, self.bits,
                                                          self.group_size, mins))
            acc = K.matmul_dequantized_part(acc, x, w)
        else:
            blocked = None
            if self.special == "f32w":  # the part's weights upcast once (cached)
                w = args[1]
                form = self._f32_part(m, w)
                if form is None and w is not None:  # not kept: too large for the cache
                    blocked = self._rows_product(m, args[0], w)
                    form = K.f32(w) if blocked is None else None
                args = [args[0], form, *args[2:]]
            if blocked is not None:
                acc = blocked if acc is None else np.add(acc, blocked, out=blocked)
            else:
                acc = reduction_part(self.op, args, acc, self.part)
        m.free(self.free)
        if not self.last:
            local.write(self.acc, acc, who)
            return
        for ref, value in zip(self.outs, [reduction_finish(self.op, args, acc)], strict=True):
            local.write(ref, value, who)
        m.free(self.free_after)

    def _f32_part(self, m: Machine, w: np.ndarray | None) -> np.ndarray | None:
        """A reduction part's f16/bf16 weight `w` in f32, contiguous, as `matmul_part`
        makes it (the same bits: the upcast is exact): the weight cache file's window of
        it, or its conversion, kept in the cache across runs under what the buffer holds
        (a decode step's lm_head split along K would otherwise convert the whole weight,
        a part at a time, at every token). `w` itself where its bytes are not read-only."""
        key = self._weight_key(m)
        if key is None or w is None:
            return w
        stored = m.stored_form(self.special, key, self.bits, self.group_size)
        if stored is not None and stored.shape != w.shape:
            stored = None
        if stored is not None and stored.flags.c_contiguous:
            return stored
        if stored is None:
            return m.cache.f32_form(("f32", key), w)
        return m.cache.get(("f32", key), lambda: np.ascontiguousarray(stored))

    def _weight_key(self, m: Machine) -> tuple | None:
        """The cache key of what the weight buffers hold (`held_key`), None unless every
        one holds read-only bytes."""
        refs = self.ins[A16_WEIGHT] if self.special == "a16" else self.ins[1:2]
        provs = [m.provenance.get(r.buf) if r is not None else None for r in refs]
        if all(p is not None for p, r in zip(provs, refs, strict=True) if r is not None):
            return held_key(provs)
        return None

    def compute(self, m: Machine, args: list[np.ndarray | None],
                weight_key: tuple | None = None, keep: bool = True) -> Sequence[np.ndarray]:
        """The op's kernel on `args`; a weight converted for it (dequantized, upcast) is
        the weight cache file's form where it has one (`Machine.stored_form`), else
        cached under `weight_key`, by default what the weight buffers hold (`held_key`);
        `keep=False` uses a cached form but keeps no new one (a join's check of its
        slices: their forms would duplicate the whole's)."""
        if not self.special:
            return self.fn(self.op, args, m.context)
        if weight_key is None:
            weight_key = self._weight_key(m)
        stored = None if weight_key is None else m.stored_form(
            self.special, weight_key, self.bits, self.group_size)
        if self.special == "a16":
            if stored is not None:
                x, bias = args[0], args[5]  # (x, qweight, scales, zeros, mins, bias)
                assert x is not None
                return [K.matmul_dequantized(x, stored, bias, self.out_dtype)]
            return [self._a16_matmul(m, args, weight_key, keep)]
        if stored is not None:
            args = [args[0], stored, *args[2:]]
        elif weight_key is not None:
            w = args[1]
            assert w is not None  # the matmul's weight operand
            form = m.cache.f32_form(("f32", weight_key), w, keep)
            if form is None:
                blocked = self._rows_product(m, args[0], w)
                if blocked is not None:
                    x = args[0]
                    assert x is not None  # (a blocked product's)
                    return [K.matmul_finish(blocked, args[2], self.out_dtype, x)]
                form = K.f32(w)  # the whole f32 form, not kept (as the cache decides)
            args = [args[0], form, *args[2:]]
        return self.fn(self.op, args, m.context)

    def _rows_product(self, m: Machine, x: np.ndarray | None, w: np.ndarray
                      ) -> np.ndarray | None:
        """x @ f32(w).T (f32, no bias) a block of the weight's rows at a time for a
        `top.matmul` with a transposed weight (the lm_head: [vocab, hidden]) whose f32 form
        the cache does not keep (`WeightCache.f32_rows_product`); None for another matmul
        or where the blocks' bits differ on this host."""
        if x is None or not isinstance(self.op, ShapedOp):
            return None
        params = self.op.kernel_params()
        if params.get("transpose_a") or not params.get("transpose_b"):
            return None
        return m.cache.f32_rows_product(x, w)

    def _a16_matmul(self, m: Machine, args: list[np.ndarray | None],
                    weight_key: Hashable | None, keep: bool) -> np.ndarray:
        """The a16_matmul kernel, dequantizing each weight once: per buffer instance within
        a run (row slices reuse resident weights), per provenance (which read-only bytes
        the buffers hold) across runs."""
        x, q, s, z, mins, bias = args
        assert x is not None and q is not None and s is not None
        if weight_key is not None:
            return m.cache.a16_product(("a16", weight_key), x, q, s, z, self.bits,
                                       self.group_size, bias, self.out_dtype, keep, mins)
        key = tuple(r.buf if r is not None else None for r in self.ins[A16_WEIGHT])
        w = m.run_cache.get(key)
        if w is None:
            w = m.run_cache[key] = K.dequantize(q, s, z, self.bits, self.group_size, mins)
        return K.matmul_dequantized(x, w, bias, self.out_dtype)


class CollectiveStep(Step):
    """A collective: global tensor `src` of every device into `dst` of every device. It
    cannot run on one machine: the machines running the net together do it
    (`machine.run_together`)."""

    __slots__ = ("op", "src", "dst", "cmd")

    def __init__(self, c: Collective, op: dev.CollectiveOp, src: int, dst: int) -> None:
        self.who = f"command {c.id} ({c.name})"
        self.op, self.src, self.dst, self.cmd = op, src, dst, c

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        raise MachineTrap(f"{self.who}: a {self.cmd.kind} over {self.cmd.devices} devices "
                          "on one machine; run the net on all its devices together")


def held_window(c: Load) -> tuple:
    """What a load's buffer holds of its tensor, but where the tensor lies: its shape,
    dtype and window (`Machine.provenance` puts the tensor's address first)."""
    return (c.shape, c.dtype, c.axis, c.start, c.length, c.cuts)


def held_key(provs: Sequence[tuple | None]) -> tuple:
    """The cache key of a weight converted from read-only bytes, from what its buffers hold
    (`Machine.provenance`, one per weight operand; None: an absent operand). A tensor read
    whole is keyed by its address and shape: the key of the whole weight a cols join reads
    (`SliceJoin`), so the nets that read a weight whole and those that join its slices
    share one converted form; a slice by its load's address, tensor and window."""
    return tuple(None if p is None else (p[0], p[1]) if p[3] < 0 else p for p in provs)



def first_local_trap(steps: Sequence[Step], net: str) -> tuple[int, str] | None:
    """The first local-memory trap a run of `steps` meets, found without data: the
    buffers' addresses, writes, reads and frees are fixed by the command stream. Returns
    (the step it fires at — `len(steps)` for a leak at the end, the message), or None."""
    live = LiveBuffers()
    for i, step in enumerate(steps):
        try:
            if isinstance(step, LoadStep):
                if isinstance(step, IndexedLoadStep):
                    live.entry(step.index, step.who)
                live.claim(step.local, step.who, None)
            elif isinstance(step, StoreStep):
                live.entry(step.local, step.who)
                for b in step.free:
                    live.release(b)
            elif isinstance(step, OpStep):
                for r in step.ins:
                    if r is not None:
                        live.entry(r, step.who)
                if step.acc is not None and step.part:
                    live.entry(step.acc, step.who)
                for b in step.free:
                    live.release(b)
                if step.acc is not None and not step.last:
                    live.claim(step.acc, step.who, None)
                for r in step.outs:
                    live.claim(r, step.who, None)
                for b in step.free_after:
                    live.release(b)
        except MachineTrap as e:
            return i, str(e)
    trap = local_trap(live, net)
    return None if trap is None else (len(steps), trap)
