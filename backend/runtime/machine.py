"""The reference machine: a parameterized tensor processor that runs command streams in
numpy, with global and local memory modelled.

- Global memory is a flat address space made of regions, each backed by a numpy buffer
  (the weight blob memory-mapped read-only; activation regions; constant pools; IO buffers
  the runtime allocates, KV caches among them). An access outside every region, or a
  write to a read-only one, traps.
- Local memory is `[lanes, lane_bytes]` bytes. A local tensor occupies the same per-lane
  address range in every lane (split evenly across lanes). The compiler's allocation
  decides where each buffer lives: a write over a live buffer, an access past the end of a
  lane or a misaligned address traps, naming the command and the tensors; so does a read
  of a buffer that is not live (or not where it was written) and a net that ends with
  live buffers (leaked).
- Two engines, DMA and compute, run their streams in order; a command starts when its
  engine is free and its dependencies have finished (the timeline); commands execute in
  start-time order. DMA and compute cycles come from the cost model
  (`toptpu.backend.target.cost`).
- Compute commands call the same evaluators, hence the same kernels, as the interpreters.

Two modes of the same machine, with the same traps, the same numbers (bit for bit) and
the same timeline:

- checked (`checked=True`, the tests' mode): local memory is a real byte array; values
  live there at their addresses, and a read of bytes nothing wrote traps too.
- fast (the default of `toptpu run`/`chat`): local memory is a reference to each live
  buffer's value, so a load from a read-only region (the weights) costs no copy. Where
  the buffers live is fixed by the command stream, not by the data: each net's plan
  replays the live buffers' intervals (a sorted structure) once and finds the first
  local-memory trap, which the run raises at its step (`first_local_trap`). A matmul the
  compiler sliced is computed as one host product where that gives each slice's own
  bytes on this host (`SliceJoin`: checked bit for bit on its first run); so are the
  slices of row-local ops, on whole tensors (`WholeRows`: the inputs of a sliced matmul,
  and chains of their own such as the MLP's silu and product), checked the same way.

Both run a net's program pre-decoded once per chip (`LoadedNet.plan`): the typed records
(`toptpu.backend.formats.commands`) turned into steps with their kernels, slices and local
ranges resolved, the execution order and the timeline computed; a run resolves the net's
global operands once and executes the steps. Weights converted for a kernel (dequantized,
upcast to f32) are kept across runs in a bounded cache (`weight_cache.WeightCache`).
"""

from __future__ import annotations

import bisect
import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from toptpu.backend.formats.commands import (
    Command,
    Compute,
    Gather,
    GlobalRef,
    Load,
    LocalRef,
    Space,
    Store,
    TableRef,
)
from toptpu.backend.formats.program import Program
from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import EVALUATORS, EvalContext, Evaluator
from toptpu.backend.runtime.weight_cache import WeightCache
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import CommandCost, compute_cycles, dma_cycles
from toptpu.dialects import top, tpu
from toptpu.dialects.common import ShapedOp, elem_of, numpy_dtype, read_int
from toptpu.dialects.ir_text import parse_ir


class MachineTrap(Exception):
    """The machine stopped: the message names the command and the tensors involved."""


def evaluator_of(op: Operation) -> Evaluator | None:
    """The interpreters' evaluator of a template op (None: no kernel)."""
    return EVALUATORS.get(type(op))


def command_cycles(chip: Chip, c: Command) -> float:
    """Cycles one command takes on its engine (the cost model's)."""
    if c.engine == "dma":
        return dma_cycles(chip, c.nbytes)
    return compute_cycles(chip, c.flops, c.dtype)


# ====================================================================== global memory


@dataclass
class Region:
    name: str
    base: int
    data: np.ndarray  # uint8
    writable: bool = True

    @property
    def end(self) -> int:
        return self.base + self.data.size


class GlobalMemory:
    """A flat address space of regions; addresses are 4 KiB aligned per region."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.regions: list[Region] = []  # by base (mapping only appends higher bases)
        self._bases: list[int] = []
        self._next = 1 << 12  # address 0 stays unmapped
        self._views: dict[tuple, tuple[np.ndarray, Region]] = {}
        #: a plan's operands resolved for one binding (`Machine.views`): (plan, views)
        self.resolved: dict[tuple, tuple[Plan, list[tuple[np.ndarray, bool, int]]]] = {}

    def map(self, name: str, data: np.ndarray, writable: bool = True) -> Region:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        size = data.size
        base = self._next
        if base + size > self.capacity:
            raise MachineTrap(
                f"global memory exhausted mapping '{name}' ({size} B at {base}; "
                f"the chip has {self.capacity} B)")
        r = Region(name, base, data, writable)
        self.regions.append(r)
        self._bases.append(base)
        self._next = (base + size + 4095) // 4096 * 4096
        return r

    def alloc(self, name: str, nbytes: int) -> Region:
        return self.map(name, np.zeros(max(nbytes, 1), np.uint8))

    def mark(self) -> tuple[int, int]:
        """Where mapping stands: `release(mark)` unmaps everything mapped after it."""
        return len(self.regions), self._next

    def release(self, mark: tuple[int, int]) -> None:
        n, nxt = mark
        del self.regions[n:], self._bases[n:]
        self._next = nxt
        self._views.clear()
        self.resolved.clear()

    def find(self, addr: int, nbytes: int, who: str) -> tuple[Region, int]:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            r = self.regions[i]
            if addr + nbytes <= r.end:
                return r, addr - r.base
        raise MachineTrap(f"{who}: global access [{addr}, {addr + nbytes}) is outside every "
                          "mapped region")

    def tensor(self, addr: int, shape: tuple[int, ...], dtype: np.dtype, who: str,
               write: bool = False) -> np.ndarray:
        return self.tensor_in(addr, shape, dtype, who, write)[0]

    def tensor_in(self, addr: int, shape: tuple[int, ...], dtype: np.dtype, who: str,
                  write: bool = False) -> tuple[np.ndarray, Region]:
        """A view of the tensor at `addr` and the region holding it."""
        key = (addr, shape, dtype)
        hit = self._views.get(key)
        if hit is None:
            nb = int(np.prod(shape)) * np.dtype(dtype).itemsize
            r, off = self.find(addr, nb, who)
            hit = r.data[off:off + nb].view(dtype).reshape(shape), r
            self._views[key] = hit
        if write and not hit[1].writable:
            raise MachineTrap(f"{who}: write to read-only region '{hit[1].name}'")
        return hit


# ====================================================================== timeline


@dataclass(frozen=True)
class Event:
    cmd: int
    engine: str
    start: float
    end: float
    name: str
    bytes: int = 0
    flops: int = 0
    dtype: str = ""


@dataclass(frozen=True, eq=False)
class Timeline:
    """A net's timeline: one event per command. It depends on the command stream and the
    chip only, so a net's plan makes it once and every run returns it; its totals are
    computed on first use."""

    net: str
    events: tuple[Event, ...] = ()

    @cached_property
    def cycles(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def busy(self, engine: str) -> float:
        return self._busy.get(engine, 0.0)

    @cached_property
    def _busy(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.events:
            out[e.engine] = out.get(e.engine, 0.0) + (e.end - e.start)
        return out

    @cached_property
    def dma_bytes(self) -> int:
        return sum(e.bytes for e in self.events if e.engine == "dma")

    @cached_property
    def flops(self) -> int:
        return sum(e.flops for e in self.events)


def schedule(commands: Sequence[Command], chip: Chip) -> tuple[list[Event], list[int]]:
    """The timeline of a command stream (each engine runs its commands in stream order; a
    command starts when its engine is free and its dependencies have finished) and the
    order the commands execute in (by start time)."""
    end: dict[int, float] = {}
    free_at = {"dma": 0.0, "cmp": 0.0}
    timed: list[tuple[float, int]] = []
    events = []
    for c in commands:  # stream order per engine: times follow in one pass
        ready = max((end[d] for d in c.deps), default=0.0)
        start = max(free_at[c.engine], ready)
        finish = start + command_cycles(chip, c)
        end[c.id] = free_at[c.engine] = finish
        timed.append((start, c.id))
        events.append(Event(c.id, c.engine, start, finish, c.name,
                            c.nbytes if c.engine == "dma" else 0, c.flops, c.dtype))
    heapq.heapify(timed)
    return events, [heapq.heappop(timed)[1] for _ in range(len(timed))]


@dataclass
class Binding:
    """Where one run's global operands live: IO tensors by name, weights by name."""

    io: Mapping[str, int]
    weights: Mapping[str, int]
    act: int
    const: int

    def address(self, ref: GlobalRef, who: str) -> int:
        if ref.space == Space.IO:
            if ref.name not in self.io:
                raise MachineTrap(f"{who}: IO tensor '{ref.name}' is not bound")
            return self.io[ref.name]
        if ref.space == Space.WEIGHT:
            if ref.name not in self.weights:
                raise MachineTrap(f"{who}: weight '{ref.name}' is not bound")
            return self.weights[ref.name]
        if ref.space == Space.ACT:
            return self.act + ref.offset
        return self.const + ref.offset


# ====================================================================== local memory


@dataclass(frozen=True, slots=True)
class Local:
    """A local buffer as a step uses it: its per-lane range [lo, hi), and the trap its
    address deserves (misaligned, outside the lane), raised when a command touches it."""

    lo: int
    hi: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    buf: int
    error: str | None

    @classmethod
    def of(cls, ref: LocalRef, chip: Chip) -> Local:
        per = chip.per_lane(ref.nbytes)
        lo, hi = ref.addr, ref.addr + per
        error = None
        if lo % chip.align:
            error = f"local address {lo} is not {chip.align}-byte aligned"
        elif lo < 0 or hi > chip.lane_bytes:
            error = f"local access [{lo}, {hi}) is outside the lane ({chip.lane_bytes} B)"
        return cls(lo, hi, ref.nbytes, np.dtype(ref.dtype), tuple(ref.shape), ref.buf, error)


class LiveBuffers:
    """The live local buffers: their per-lane intervals (disjoint), kept sorted by start so
    a new buffer is checked against its one possible neighbour, and each buffer's payload
    (the fast mode's value)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.by_start: dict[int, int] = {}  # lo -> buf
        self.live: dict[int, tuple[int, int, str, Any]] = {}  # buf -> (lo, hi, who, payload)

    def clear(self) -> None:
        self.starts.clear()
        self.by_start.clear()
        self.live.clear()

    def claim(self, ref: Local, who: str, payload: Any) -> None:
        """Make `ref` live (its own earlier instance aside, it must overlap nothing live)."""
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        if ref.buf in self.live:
            self.release(ref.buf)
        lo, hi = ref.lo, ref.hi
        i = bisect.bisect_left(self.starts, hi)
        if i:
            other = self.live[self.by_start[self.starts[i - 1]]]
            if other[1] > lo:
                raise MachineTrap(f"{who}: writes local [{lo}, {hi}) over the live buffer "
                                  f"{other[2]} [{other[0]}, {other[1]})")
        self.starts.insert(i, lo)
        self.by_start[lo] = ref.buf
        self.live[ref.buf] = (lo, hi, who, payload)

    def release(self, buf: int) -> None:
        entry = self.live.pop(buf, None)
        if entry is not None:
            lo = entry[0]
            del self.starts[bisect.bisect_left(self.starts, lo)]
            del self.by_start[lo]

    def entry(self, ref: Local, who: str) -> tuple[int, int, str, Any]:
        """The live entry a read of `ref` finds (traps: bad address, not live, not where
        the buffer was written)."""
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        e = self.live.get(ref.buf)
        if e is None:
            raise MachineTrap(f"{who}: reads buffer {ref.buf} that is not live")
        if e[0] != ref.lo or e[1] != ref.hi:
            raise MachineTrap(f"{who}: reads buffer {ref.buf} at local [{ref.lo}, {ref.hi}) "
                              f"but it was written at [{e[0]}, {e[1]})")
        return e


class CheckedLocal:
    """Local memory as bytes: values live at their addresses; unwritten bytes trap."""

    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        self.bytes = np.zeros((chip.lanes, chip.lane_bytes), np.uint8)
        self.written = np.zeros(chip.lane_bytes, bool)
        self.buffers = LiveBuffers()

    def begin(self) -> None:
        self.buffers.clear()
        self.written[:] = False

    def release(self, buf: int) -> None:
        self.buffers.release(buf)

    def read(self, ref: Local, who: str) -> np.ndarray:
        lo, hi = ref.lo, ref.hi
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        if not self.written[lo:hi].all():
            raise MachineTrap(f"{who}: reads local [{lo}, {hi}) that nothing wrote")
        self.buffers.entry(ref, who)
        raw = self.bytes[:, lo:hi].reshape(-1)[:ref.nbytes]
        return raw.view(ref.dtype).reshape(ref.shape)

    def write(self, ref: Local, value: np.ndarray, who: str, copy: bool = False) -> None:
        arr = np.ascontiguousarray(value, dtype=ref.dtype)
        if arr.nbytes != ref.nbytes:
            raise MachineTrap(f"{who}: result has {arr.nbytes} B, its buffer {ref.nbytes} B")
        self.buffers.claim(ref, who, None)
        per = ref.hi - ref.lo
        flat = np.zeros(self.chip.lanes * per, np.uint8)
        flat[:ref.nbytes] = arr.reshape(-1).view(np.uint8)
        self.bytes[:, ref.lo:ref.hi] = flat.reshape(self.chip.lanes, per)
        self.written[ref.lo:ref.hi] = True


class FastLocal:
    """Local memory as each live buffer's value (a view of a read-only region for loaded
    weights: no copy). Where the buffers live does not depend on the data, so the traps
    about it (overlap, alignment, lane, reads of buffers not live or not where they were
    written, leaks) are found once per plan (`first_local_trap`) and raised at their step."""

    def __init__(self, chip: Chip) -> None:
        self.values: dict[int, np.ndarray] = {}

    def begin(self) -> None:
        self.values.clear()

    def release(self, buf: int) -> None:
        self.values.pop(buf, None)

    def read(self, ref: Local, who: str) -> np.ndarray:
        value = self.values[ref.buf]
        if value.dtype != ref.dtype or value.shape != ref.shape:  # the bytes, reinterpreted
            value = value.reshape(-1).view(np.uint8)[:ref.nbytes].view(ref.dtype)
            value = value.reshape(ref.shape)
        return value

    def write(self, ref: Local, value: np.ndarray, who: str, copy: bool = False) -> None:
        """Keep `value` as the buffer's contents; `copy` when its source may change (a
        load from a writable region)."""
        if copy:
            arr = np.array(value, dtype=ref.dtype, order="C")
        elif value.dtype == ref.dtype and value.shape == ref.shape:
            arr = value  # kept as it is, strided or not (a joined slice's part of the whole)
        else:
            arr = np.ascontiguousarray(value, dtype=ref.dtype)
        if arr.nbytes != ref.nbytes:
            raise MachineTrap(f"{who}: result has {arr.nbytes} B, its buffer {ref.nbytes} B")
        self.values[ref.buf] = arr if arr.shape == ref.shape else arr.reshape(ref.shape)


LocalMemory = CheckedLocal | FastLocal


def local_trap(buffers: LiveBuffers, net: str) -> str | None:
    """The trap of a net that ends with `buffers` live (None: nothing is live); clears
    them."""
    if not buffers.live:
        return None
    names = sorted({e[2] for e in buffers.live.values()})[:4]
    buffers.clear()
    return f"net '{net}' ended with live local buffers {names}"


def first_local_trap(steps: Sequence[Step], net: str) -> tuple[int, str] | None:
    """The first local-memory trap a run of `steps` meets, found without data: the
    buffers' addresses, writes, reads and frees are fixed by the command stream. Returns
    (the step it fires at — `len(steps)` for a leak at the end, the message), or None."""
    live = LiveBuffers()
    for i, step in enumerate(steps):
        try:
            if isinstance(step, LoadStep):
                live.claim(step.local, step.who, None)
            elif isinstance(step, StoreStep):
                live.entry(step.local, step.who)
                for b in step.free:
                    live.release(b)
            elif isinstance(step, OpStep):
                for r in step.ins:
                    if r is not None:
                        live.entry(r, step.who)
                for b in step.free:
                    live.release(b)
                for r in step.outs:
                    live.claim(r, step.who, None)
                for b in step.free_after:
                    live.release(b)
        except MachineTrap as e:
            return i, str(e)
    trap = local_trap(live, net)
    return None if trap is None else (len(steps), trap)


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
        self.prov = (c.shape, c.dtype, c.axis, c.start, c.length)

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        whole, writable, addr = views[self.g]
        m.local.write(self.local, whole[self.window], self.who, copy=writable)
        if writable:
            m.provenance.pop(self.local.buf, None)
        else:  # read-only bytes: what the buffer holds is known across runs
            m.provenance[self.local.buf] = (addr, *self.prov)


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


class OpStep(Step):
    """A compute command, or a gather (its table read from global memory)."""

    __slots__ = ("op", "fn", "ins", "outs", "free", "free_after", "table", "table_at",
                 "special", "bits", "group_size", "out_dtype", "cmd", "join", "join_at",
                 "part_of")

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
        if isinstance(op, tpu.A16MatMulOp) and self.table < 0 and len(self.ins) == 5:
            self.special = "a16"
            self.bits = read_int(op.attributes["weight_bits"])
            self.group_size = read_int(op.attributes["group_size"])
        elif (isinstance(op, tpu.MatMulOp) and self.table < 0 and len(self.ins) >= 2
              and self.ins[1] is not None
              and self.ins[1].dtype.name in ("float16", "bfloat16")):
            self.special = "f32w"  # a f16/bf16 weight (the lm_head): upcast once

    def run(self, m: Machine, views: list[tuple[np.ndarray, bool, int]]) -> None:
        who, local = self.who, m.local
        args: list[np.ndarray | None] = [local.read(r, who) if r is not None else None
                                         for r in self.ins]
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

    def compute(self, m: Machine, args: list[np.ndarray | None],
                weight_key: Hashable | None = None, keep: bool = True) -> Sequence[np.ndarray]:
        """The op's kernel on `args`; a weight converted for it (dequantized, upcast) is
        cached under `weight_key`, by default what the weight buffers hold (`held_key`);
        `keep=False` uses a cached form but keeps no new one (a join's check of its
        slices: their forms would duplicate the whole's)."""
        if not self.special:
            return self.fn(self.op, args, m.context)
        refs = self.ins[1:4] if self.special == "a16" else self.ins[1:2]
        if weight_key is None:
            provs = [m.provenance.get(r.buf) if r is not None else None for r in refs]
            if all(p is not None for p, r in zip(provs, refs, strict=True) if r is not None):
                weight_key = held_key(provs)
        if self.special == "a16":
            return [self._a16_matmul(m, args, weight_key, keep)]
        if weight_key is not None:
            w = args[1]
            args = [args[0], m.cache.get(("f32", weight_key), lambda: K.f32(w), keep),
                    *args[2:]]
        return self.fn(self.op, args, m.context)

    def _a16_matmul(self, m: Machine, args: list[np.ndarray | None],
                    weight_key: Hashable | None, keep: bool) -> np.ndarray:
        """The a16_matmul kernel, dequantizing each weight once: per buffer instance within
        a run (row slices reuse resident weights), per provenance (which read-only bytes
        the buffers hold) across runs."""
        x, q, s, z, bias = args
        assert x is not None and q is not None and s is not None
        if weight_key is not None:
            return m.cache.a16_product(("a16", weight_key), x, q, s, z, self.bits,
                                       self.group_size, bias, self.out_dtype, keep)
        key = tuple(r.buf if r is not None else None for r in self.ins[1:4])
        w = m.run_cache.get(key)
        if w is None:
            w = m.run_cache[key] = K.dequantize(q, s, z, self.bits, self.group_size)
        return K.matmul_dequantized(x, w, bias, self.out_dtype)


def held_key(provs: Sequence[tuple | None]) -> tuple:
    """The cache key of a weight converted from read-only bytes, from what its buffers hold
    (`Machine.provenance`, one per weight operand; None: an absent operand). A tensor read
    whole is keyed by its address and shape: the key of the whole weight a cols join reads
    (`SliceJoin`), so the nets that read a weight whole and those that join its slices
    share one converted form; a slice by its load's address, tensor and window."""
    return tuple(None if p is None else (p[0], p[1]) if p[3] < 0 else p for p in provs)


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
            got = args[0].reshape(self.shape)  # type: ignore[union-attr]
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
        x_view, _, x_addr = views[src]  # type: ignore[index]
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
        n = 3 if step.special == "a16" else 1  # the weight's operands
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
            if step.special and step.table < 0:
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
        if len(chain) < 2 or chain[0][1].part_of is not None:  # type: ignore[attr-defined]
            continue
        found = _RowSlices(inputs, wholes, products=True)
        whole = found.whole(chain)
        if whole is None or whole.step is None:
            continue
        _share_parts(steps, whole, found.guard(steps))


#: row-local ops whose result is always a new array (not their input: see `WholeRows`)
PART_OPS: tuple[type[Operation], ...] = (top.UnaryOp, top.BinaryOp, tpu.RmsNormOp)


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
        if (c.axis != axis or c.start != at or ld.local.shape != c.part_shape()
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

    def whole(self, srcs: list[Writer | None]) -> WholeRows | None:
        if any(s is None for s in srcs):
            return None
        ws: list[Writer] = srcs  # type: ignore[assignment]
        key = tuple(pos for pos, _ in ws)
        if all(isinstance(s, LoadStep) for _, s in ws):
            return self._loaded(ws, key)
        if not all(isinstance(s, OpStep) for _, s in ws):
            return None
        ops: list[OpStep] = [s for _, s in ws]  # type: ignore[misc]
        if ops[0].join is not None:
            return self._product(ops, key) if self.products else None
        first = ops[0]
        if (not isinstance(first.op, ROW_LOCAL_OPS) or first.special or first.table >= 0
                or len(first.outs) != 1 or any(s.cmd.op != first.cmd.op for s in ops)):
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
            sub = self.whole(writers)
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
        if any(c is None and r is not None and len(r.shape) > ndim - axis - 1
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

    def _loaded(self, ws: list[Writer], key: tuple[int, ...]) -> WholeRows | None:
        loads: list[LoadStep] = [s for _, s in ws]  # type: ignore[misc]
        g, c0 = loads[0].g, loads[0].cmd
        axis = c0.axis
        if (any(ld.g != g for ld in loads) or not 0 <= axis < len(c0.shape) - 1
                or not _covering(loads, axis, c0.shape[axis])):
            return None
        parts = [(ld.cmd.start, ld.cmd.length) for ld in loads]
        lead = tuple(c0.shape[:axis])
        if self.axis < 0:
            self.axis, self.lead, self.parts = axis, lead, parts
        elif (axis, lead, parts) != (self.axis, self.lead, self.parts):
            return None
        self.loads.extend(ws)  # type: ignore[arg-type]
        return self.wholes.setdefault(key, WholeRows(g=g, shape=tuple(c0.shape)))


def _rows_join(chain: list[tuple[int, OpStep]], inputs: dict[int, list[Writer | None]],
               steps: list[Step], wholes: dict[tuple[int, ...], WholeRows]
               ) -> SliceJoin | None:
    first = chain[0][1]
    if first.ins[0] is None or any(s.ins[1:] != first.ins[1:] for _, s in chain):
        return None  # the weight is resident
    found = _RowSlices(inputs, wholes)
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
        loads: list[LoadStep] = [f[1] for f in found]  # type: ignore[index,misc]
        g = loads[0].g
        if (any(ld.g != g for ld in loads) or operands[g].write
                or not _covering(loads, 0, loads[0].cmd.shape[0])):
            return None
        these = [(Ellipsis, slice(ld.cmd.start, ld.cmd.start + ld.cmd.length))
                 for ld in loads]
        if parts and these != parts:
            return None
        parts = these
        sources.append(g)
    if not parts or any(s.outs[0].shape[-1] != p[-1].stop - p[-1].start
                        for (_, s), p in zip(chain, parts, strict=True)):
        return None
    return SliceJoin("cols", [s for _, s in chain], parts, sources, [],
                     resident=frozenset({first.ins[0].buf}))


@dataclass
class Plan:
    """A net's program pre-decoded for one chip."""

    operands: list[Operand]
    steps: list[Step]  # in execution order
    timeline: Timeline
    local_trap: tuple[int, str] | None  # the fast mode's: (the step raising it, message)


class LoadedNet:
    """A Program with its template ops parsed and its commands checked against them; its
    pre-decoded plans (`plan(chip)`) are made on first use, once per chip. `name` names the
    net in its timeline and traps (default: the program's function name)."""

    def __init__(self, program: Program, name: str | None = None) -> None:
        self.program = program
        self.name = name or program.name
        # verified: the stream is as untrusted as the header (an attribute out of range
        # would crash a kernel); the verifiers run once per net, at load
        module = parse_ir(program.ir, f"stream:{self.name}")
        fns = [f for f in module.ops if isinstance(f, func.FuncOp)
               and f.sym_name.data == program.name]
        if not fns:
            raise MachineTrap(f"program '{program.name}' carries no function of that name")
        self.module = module
        self.ops: list[Operation] = list(fns[0].walk())
        self.evaluators: dict[int, Evaluator] = {}
        for c in program.commands:
            if isinstance(c, Compute | Gather):
                self.evaluators[c.id] = self._evaluator(c)
        self._plans: dict[Chip, Plan] = {}

    def _evaluator(self, c: Compute | Gather) -> Evaluator:
        if c.op >= len(self.ops):
            raise MachineTrap(f"command {c.id}: op {c.op} is not in the net's IR "
                              f"({len(self.ops)} ops)")
        op = self.ops[c.op]
        if op.name != c.kind:
            raise MachineTrap(f"command {c.id}: op {c.op} is '{op.name}', the command says "
                              f"'{c.kind}'")
        fn = evaluator_of(op)
        if fn is None:
            raise MachineTrap(f"command {c.id}: no kernel for '{op.name}'")
        self._check_types(c, op)
        return fn

    @staticmethod
    def _check_types(c: Compute | Gather, op: Operation) -> None:
        """The command's buffers hold what its op's operands and results are (a compute
        reading a bf16 buffer as f16 would read other numbers)."""
        operands: list[SSAValue | None] = (op.operand_groups() if isinstance(op, ShapedOp)
                                           else list(op.operands))
        ins: list[LocalRef | TableRef | None] = list(c.ins)
        if isinstance(c, Gather):
            ins.insert(c.table_operand, c.table)
        if len(ins) != len(operands) or len(c.outs) != len(op.results):
            raise MachineTrap(f"command {c.id}: {len(ins)} operands and {len(c.outs)} results "
                              f"for '{op.name}', which has {len(operands)} and "
                              f"{len(op.results)}")
        pairs = [(f"operand {i}", r, v)
                 for i, (r, v) in enumerate(zip(ins, operands, strict=True))]
        pairs += [(f"result {i}", r, v)
                  for i, (r, v) in enumerate(zip(c.outs, op.results, strict=True))]
        for what, ref, value in pairs:
            if (ref is None) != (value is None):
                raise MachineTrap(f"command {c.id}: {what} of '{op.name}' is "
                                  f"{'absent' if value is None else 'present'} in the IR")
            if ref is None or value is None:
                continue
            want = numpy_dtype(elem_of(value)).name
            if np.dtype(ref.dtype).name != want:
                raise MachineTrap(f"command {c.id} ({c.name}): {what} of '{op.name}' is "
                                  f"{want} in the IR, the command's buffer holds {ref.dtype}")

    def plan(self, chip: Chip) -> Plan:
        plan = self._plans.get(chip)
        if plan is None:
            plan = self._plans[chip] = self._make_plan(chip)
        return plan

    def _make_plan(self, chip: Chip) -> Plan:
        cmds = self.program.commands
        events, order = schedule(cmds, chip)
        operands: list[Operand] = []
        index: dict[tuple, int] = {}

        def operand(ref: GlobalRef, shape: tuple[int, ...], dtype: str, write: bool,
                    who: str) -> int:
            key = (ref, shape, dtype)
            i = index.get(key)
            if i is None:
                i = index[key] = len(operands)
                operands.append(Operand(ref, shape, np.dtype(dtype), write, who))
            elif write and not operands[i].write:
                old = operands[i]
                operands[i] = Operand(old.ref, old.shape, old.dtype, True, who)
            return i

        steps: list[Step] = []
        for cid in order:
            c = cmds[cid]
            who = f"command {c.id} ({c.name})"
            if isinstance(c, Load | Store):
                g = operand(c.tensor, c.shape, c.dtype, isinstance(c, Store), who)
                step: Step = (LoadStep(c, g, Local.of(c.local, chip)) if isinstance(c, Load)
                              else StoreStep(c, g, Local.of(c.local, chip)))
            elif isinstance(c, Gather):
                g = operand(c.table.tensor, c.table.shape, c.table.dtype, False, who)
                step = OpStep(c, self.ops[c.op], self.evaluators[c.id], chip, g)
            else:
                step = OpStep(c, self.ops[c.op], self.evaluators[c.id], chip)
            steps.append(step)
        find_joins(steps, operands)
        return Plan(operands, steps, Timeline(self.name, tuple(events)),
                    first_local_trap(steps, self.name))


# ====================================================================== the machine


def command_costs(commands: Sequence[Command]) -> list[CommandCost]:
    """What timing a command stream needs of each command (ids are stream positions)."""
    for i, c in enumerate(commands):
        if c.id != i:
            raise MachineTrap(f"command {i} has id {c.id}: ids must be stream positions")
    return [CommandCost(c.engine == "dma", c.nbytes if c.engine == "dma" else 0, c.flops,
                        str(c.dtype), tuple(c.deps)) for c in commands]


#: how many (net, binding) pairs keep their resolved operands: a model's layers times its
#: nets, with room; past it the kept ones are dropped (resolved again on their next run)
RESOLVED_BINDINGS = 4096


class Machine:
    """The reference machine of a chip, in checked or fast mode (see the module doc)."""

    def __init__(self, chip: Chip, checked: bool = False,
                 weight_cache_bytes: int | None = None) -> None:
        self.chip = chip
        self.checked = checked
        self.gmem = GlobalMemory(chip.ddr_bytes)
        self.local: LocalMemory = CheckedLocal(chip) if checked else FastLocal(chip)
        self.cache = WeightCache(weight_cache_bytes)
        self.run_cache: dict[Hashable, np.ndarray] = {}  # converted writable weights
        self.provenance: dict[int, tuple] = {}  # buf -> the read-only bytes it holds
        self.joined: dict[SliceJoin | WholeRows, np.ndarray | None] = {}  # this run's wholes
        self.join_ok: dict[SliceJoin, bool] = {}  # joins checked bit for bit on this host
        self.part_ok: dict[WholeRows, bool] = {}  # row-local slices' parts, the same way
        self.context = EvalContext(None)

    def free(self, bufs: Sequence[int]) -> None:
        release = self.local.release
        for b in bufs:
            release(b)

    def run(self, net: LoadedNet, binding: Binding) -> Timeline:
        """Run a net's commands on the two engines; return the timeline."""
        plan = net.plan(self.chip)
        views = self.views(plan, binding)
        self.local.begin()
        self.provenance.clear()
        self.run_cache.clear()
        self.joined.clear()
        if isinstance(self.local, CheckedLocal):  # the checked mode tracks live buffers
            for step in plan.steps:
                step.run(self, views)
            trap = local_trap(self.local.buffers, net.name)
            if trap:
                raise MachineTrap(trap)
            return plan.timeline
        steps, trap = plan.steps, plan.local_trap
        for i in range(len(steps) if trap is None else trap[0]):
            steps[i].run(self, views)
        if trap is not None:
            self.local.begin()
            raise MachineTrap(trap[1])
        return plan.timeline

    def views(self, plan: Plan, binding: Binding) -> list[tuple[np.ndarray, bool, int]]:
        """`plan`'s operands resolved for `binding` (view, writable, address), kept for the
        next run with the same addresses (a decode step runs each layer's net with the
        bindings of the step before); resolving traps as it did, never kept."""
        key = (id(plan), tuple(binding.io.items()), tuple(binding.weights.items()),
               binding.act, binding.const)
        resolved = self.gmem.resolved
        hit = resolved.get(key)
        if hit is None or hit[0] is not plan:
            if len(resolved) >= RESOLVED_BINDINGS:
                resolved.clear()
            hit = resolved[key] = (plan, [self._resolve(op, binding) for op in plan.operands])
        return hit[1]

    def _resolve(self, op: Operand, binding: Binding) -> tuple[np.ndarray, bool, int]:
        addr = binding.address(op.ref, op.who)
        view, region = self.gmem.tensor_in(addr, op.shape, op.dtype, op.who, op.write)
        return view, region.writable, addr
