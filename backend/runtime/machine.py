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
upcast to f32) are kept across runs in a bounded cache (`weight_cache.WeightCache`), or
read from the model file's weight cache file (`weight_cache_file.StoredForms`, `stored`)
when one was opened: the same bits, made once for the file instead of in every process.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from toptpu.backend.formats.commands import (
    Collective,
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
from toptpu.backend.formats.program import Program, program_module
from toptpu.backend.reference.interpreter import (
    EvalContext,
    Evaluator,
    bound_evaluator,
    collective_result,
)
from toptpu.backend.runtime.errors import MachineTrap
from toptpu.backend.runtime.joins import SliceJoin, WholeRows, find_joins
from toptpu.backend.runtime.local_memory import (
    CheckedLocal,
    FastLocal,
    Local,
    LocalMemory,
    local_trap,
)
from toptpu.backend.runtime.steps import (
    CollectiveStep,
    Fetched,
    IndexedLoadStep,
    LoadStep,
    Operand,
    OpStep,
    Step,
    StoreStep,
    first_local_trap,
)
from toptpu.backend.runtime.weight_cache import WeightCache
from toptpu.backend.runtime.weight_cache_file import StoredForms, _stored_window, form_part
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import CommandCost, compute_cycles, dma_cycles, link_cycles
from toptpu.backend.target.link import LinkWork
from toptpu.dialects import dev, tpu
from toptpu.dialects.common import ShapedOp, elem_of, numpy_dtype


def evaluator_of(op: Operation) -> Evaluator | None:
    """The interpreters' evaluator of a template op (None: no kernel)."""
    return bound_evaluator(type(op))


def link_work(c: Collective) -> LinkWork:
    """What the link model times of a collective command."""
    return LinkWork(c.kind, c.algorithm, c.devices, c.nbytes)


def command_cycles(chip: Chip, c: Command) -> float:
    """Cycles one command takes on its engine (the cost model's)."""
    if isinstance(c, Collective):
        return link_cycles(chip, link_work(c))
    if isinstance(c, Load | Store | Gather):
        return dma_cycles(chip, c.nbytes, c.run)
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
        self.resolved: dict[tuple, tuple[Plan, list[tuple[np.ndarray, bool, int] | None]]] = {}

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
    group: int = -1  # its layer group and slice
    slice: int = -1
    part: str = ""  # a reduction part, "j/P" (`Compute.parts`)


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
    def link_bytes(self) -> int:
        """Bytes one device sent over its link (the net's collectives)."""
        return sum(e.bytes for e in self.events if e.engine == "link")

    @cached_property
    def flops(self) -> int:
        return sum(e.flops for e in self.events)


def schedule(commands: Sequence[Command], chip: Chip, moved: Mapping[int, int] | None = None
             ) -> tuple[list[Event], list[int]]:
    """The timeline of a command stream (each engine runs its commands in stream order; a
    command starts when its engine is free and its dependencies have finished) and the
    order the commands execute in (by start time). `moved`: the bytes a run's indexed
    loads really moved, by command id, in place of their modelled bytes."""
    end: dict[int, float] = {}
    free_at = {"dma": 0.0, "cmp": 0.0, "link": 0.0}
    timed: list[tuple[float, int]] = []
    events = []
    for c in commands:  # stream order per engine: times follow in one pass
        ready = max((end[d] for d in c.deps), default=0.0)
        start = max(free_at[c.engine], ready)
        real = moved.get(c.id) if moved and isinstance(c, Load) else None
        finish = start + (command_cycles(chip, c) if real is None or not isinstance(c, Load)
                          else dma_cycles(chip, real, c.run) if real else 0.0)
        end[c.id] = free_at[c.engine] = finish
        timed.append((start, c.id))
        part = f"{c.part}/{c.parts}" if isinstance(c, Compute) and c.parts > 1 else ""
        nbytes = (link_work(c).link_bytes() if isinstance(c, Collective)
                  else real if real is not None else c.nbytes if c.engine == "dma" else 0)
        events.append(Event(c.id, c.engine, start, finish, c.name, nbytes, c.flops, c.dtype,
                            c.group, c.slice, part))
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
            if ref.name is None or ref.name not in self.io:
                raise MachineTrap(f"{who}: IO tensor '{ref.name}' is not bound")
            return self.io[ref.name]
        if ref.space == Space.WEIGHT:
            if ref.name is None or ref.name not in self.weights:
                raise MachineTrap(f"{who}: weight '{ref.name}' is not bound")
            return self.weights[ref.name]
        if ref.space == Space.ACT:
            return self.act + ref.offset
        return self.const + ref.offset


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
        # would crash a kernel); the verifiers run once per text (`program_module`), and
        # the net only reads the module
        module = program_module(program.ir, f"stream:{self.name}")
        fns = [f for f in module.ops if isinstance(f, func.FuncOp)
               and f.sym_name.data == program.name]
        if not fns:
            raise MachineTrap(f"program '{program.name}' carries no function of that name")
        self.module = module
        self.ops: list[Operation] = list(fns[0].walk())
        self.evaluators: dict[int, Evaluator] = {}
        #: collective command id -> its op
        self.collectives: dict[int, dev.CollectiveOp] = {}
        for c in program.commands:
            if isinstance(c, Compute | Gather):
                self.evaluators[c.id] = self._evaluator(c)
            elif isinstance(c, Collective):
                self.collectives[c.id] = self._collective_op(c)
        #: the devices its collectives join (None: a net of one device)
        self.devices = next((c.devices for c in program.commands
                             if isinstance(c, Collective)), None)
        if any(c.devices != self.devices for c in program.commands
               if isinstance(c, Collective)):
            raise MachineTrap(f"net '{self.name}': its collectives join different numbers of "
                              "devices")
        self._plans: dict[Chip, Plan] = {}

    def _collective_op(self, c: Collective) -> dev.CollectiveOp:
        """The collective op of command `c`, checked: the command is the collective its op
        in the IR says, over the same devices."""
        if c.op >= len(self.ops):
            raise MachineTrap(f"command {c.id}: op {c.op} is not in the net's IR "
                              f"({len(self.ops)} ops)")
        op = self.ops[c.op]
        coll = op if isinstance(op, dev.CollectiveOp) else None
        if coll is None or coll.KIND != c.kind \
                or coll.device_count != c.devices or coll.algorithm_name != c.algorithm:
            raise MachineTrap(f"command {c.id}: a {c.kind} ({c.algorithm}) over {c.devices} "
                              f"devices, but op {c.op} is '{op.name}'"
                              + (f" ({coll.algorithm_name}) over {coll.device_count} devices"
                                 if coll is not None else ""))
        return coll

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
        if isinstance(c, Compute) and c.acc is not None:
            if not tpu.splits_reduction(op):
                raise MachineTrap(f"command {c.id}: '{op.name}' has no reduction to split in "
                                  "parts")
            want_acc = tuple(tpu.accumulator_type(op).get_shape())
            if tuple(c.acc.shape) != want_acc:
                raise MachineTrap(f"command {c.id} ({c.name}): accumulator {list(c.acc.shape)}"
                                  f", '{op.name}' accumulates {list(want_acc)}")
        results = len(c.outs) if not isinstance(c, Compute) or c.last_part else len(op.results)
        if len(ins) != len(operands) or results != len(op.results):
            raise MachineTrap(f"command {c.id}: {len(ins)} operands and {len(c.outs)} results "
                              f"for '{op.name}', which has {len(operands)} and "
                              f"{len(op.results)}")
        pairs = [(f"operand {i}", r, v)
                 for i, (r, v) in enumerate(zip(ins, operands, strict=True))]
        if c.outs:  # (a reduction part before the last writes none)
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
                if isinstance(c, Load) and c.index is not None:
                    step = IndexedLoadStep(c, g, Local.of(c.local, chip),
                                           Local.of(c.index, chip))
            elif isinstance(c, Gather):
                g = operand(c.table.tensor, c.table.shape, c.table.dtype, False, who)
                step = OpStep(c, self.ops[c.op], self.evaluators[c.id], chip, g)
            elif isinstance(c, Collective):
                src = operand(c.src, c.src_shape, c.dtype, False, who)
                dst = operand(c.dst, c.dst_shape, c.dtype, True, who)
                step = CollectiveStep(c, self.collectives[c.id], src, dst)
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
    return [CommandCost(c.engine == "dma", c.nbytes if c.engine in ("dma", "link") else 0,
                        c.flops, str(c.dtype), tuple(c.deps),
                        (c.kind, c.algorithm, c.devices) if isinstance(c, Collective) else None,
                        c.run if isinstance(c, Load | Store | Gather) else 0)
            for c in commands]


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
        #: what the indexed loads of the last net run read (which rows, bytes)
        self.fetched: list[Fetched] = []
        self.joined: dict[SliceJoin | WholeRows, np.ndarray | None] = {}  # this run's wholes
        self.join_ok: dict[SliceJoin, bool] = {}  # joins checked bit for bit on this host
        self.part_ok: dict[WholeRows, bool] = {}  # row-local slices' parts, the same way
        self.context = EvalContext(None)
        #: the weight cache file's forms (None: none opened) and the global address of
        #: the weight blob they name offsets in
        self.stored: StoredForms | None = None
        self.weights_base = 0
        #: `stored_form`'s answers, by what was asked, for the file `_stored_of`
        self._stored: dict[tuple, np.ndarray | None] = {}
        self._stored_of: StoredForms | None = None

    def stored_form(self, special: str, key: tuple, bits: int, group_size: int
                    ) -> np.ndarray | None:
        """The f32 form of a kernel's weight from the weight cache file, or None: `key` is
        its operands' `held_key` (each the whole tensor, or a window of one) — a whole
        weight's form, or the same window of it (an a16 weight: rows, as the compiler
        slices output channels, or columns, as it splits K, its scales and zero points
        windowed alike)."""
        stored = self.stored
        if stored is None or not key or key[0] is None or stored.problem is not None:
            return None
        if self._stored_of is not stored:  # another file opened: its own answers
            self._stored.clear()
            self._stored_of = stored
        memo = (special, key, bits, group_size)
        if memo not in self._stored:
            self._stored[memo] = self._stored_form(special, key, bits, group_size)
        return self._stored[memo]

    def _stored_form(self, special: str, key: tuple, bits: int, group_size: int
                     ) -> np.ndarray | None:
        stored = self.stored
        assert stored is not None
        base = self.weights_base
        first = key[0]
        window: tuple[slice, ...] | None = None
        if len(first) > 2:  # a window (addr, shape, dtype, axis, start, length)
            window = _stored_window(special, key, bits, group_size)
            if window is None:
                return None
        elif any(p is not None and len(p) > 2 for p in key[1:]):
            return None
        part = form_part(window, first[1], special, bits) if window is not None else ()
        if special == "a16":  # key: the qweight's, scales', zero points' and mins' bytes
            scales = key[1]
            zeros, mins = (key[2] if len(key) > 2 else None), (key[3] if len(key) > 3 else None)
            if scales is None:
                return None
            at = (first[0] - base, scales[0] - base, -1 if zeros is None else zeros[0] - base,
                  bits, group_size, -1 if mins is None else mins[0] - base)
            own = stored.a16(*at, part=part) if part else None  # stored contiguous
            form = own if own is not None else stored.a16(*at)
        else:
            own = stored.upcast(first[0] - base, part) if part else None
            form = own if own is not None else stored.upcast(first[0] - base)
        if form is None or window is None or own is not None:
            return form
        return form[window]

    def free(self, bufs: Sequence[int]) -> None:
        if not bufs:
            return
        local = self.local
        if isinstance(local, FastLocal):  # (the per-step cost of the fast mode)
            pop = local.values.pop
            for b in bufs:
                pop(b, None)
            return
        for b in bufs:
            local.release(b)

    def run(self, net: LoadedNet, binding: Binding) -> Timeline:
        """Run a net's commands on its engines; return the timeline. A net with collectives
        runs on several machines together (`run_together`)."""
        if net.devices is not None:
            raise MachineTrap(f"net '{net.name}' joins {net.devices} devices in collectives: "
                              "run it on all of them together")
        for _ in self.steps(net, binding):
            pass
        return self.timeline_of_run(net)

    def timeline_of_run(self, net: LoadedNet) -> Timeline:
        """The timeline of the run just made: the plan's, unless its indexed loads moved
        other bytes than modelled (a prefill chunk's experts: the distinct ones its
        tokens chose), then the stream timed with what they moved."""
        plan = net.plan(self.chip)
        cmds = net.program.commands
        moved = {f.command: f.nbytes for f in self.fetched}
        if all(cmds[i].nbytes == b for i, b in moved.items()):
            return plan.timeline
        return Timeline(net.name, tuple(schedule(cmds, self.chip, moved)[0]))

    def steps(self, net: LoadedNet, binding: Binding
              ) -> Iterator[tuple[CollectiveStep, list[tuple[np.ndarray, bool, int]]]]:
        """Run a net's commands, stopping at each collective: it yields the collective's
        step and the run's resolved operands, and goes on once the caller has done it."""
        plan = net.plan(self.chip)
        views = self.views(plan, binding)
        self.local.begin()
        self.provenance.clear()
        self.fetched = []
        self.run_cache.clear()
        self.joined.clear()
        if isinstance(self.local, CheckedLocal):  # the checked mode tracks live buffers
            for step in plan.steps:
                if isinstance(step, CollectiveStep):
                    yield step, views
                else:
                    step.run(self, views)
            problem = local_trap(self.local.buffers, net.name)
            if problem:
                raise MachineTrap(problem)
            return
        steps, trap = plan.steps, plan.local_trap
        for i in range(len(steps) if trap is None else trap[0]):
            step = steps[i]
            if step.__class__ is CollectiveStep:  # (not isinstance: an ABC's is slower)
                yield step, views
            else:
                step.run(self, views)
        if trap is not None:
            self.local.begin()
            raise MachineTrap(trap[1])

    def views(self, plan: Plan, binding: Binding) -> list[tuple[np.ndarray, bool, int]]:
        """`plan`'s operands resolved for `binding` (view, writable, address), kept for the
        next run with the same addresses (a decode step runs each layer's net with the
        bindings of the step before); resolving traps as it did, never kept."""
        fixed = (id(plan), tuple(binding.weights.items()), binding.act, binding.const)
        key = (*fixed, tuple(binding.io.items()))
        resolved = self.gmem.resolved
        hit = resolved.get(key)
        if hit is None or hit[0] is not plan:
            if len(resolved) >= RESOLVED_BINDINGS:
                resolved.clear()
            # the operands but the IO tensors resolved once per weights and regions (a
            # decode step binds its layer's KV slot at a new position every step)
            base = resolved.get(fixed)
            if base is None or base[0] is not plan:
                base = resolved[fixed] = (plan, [
                    None if op.ref.space is Space.IO else self._resolve(op, binding)
                    for op in plan.operands])
            hit = resolved[key] = (plan, [self._resolve(op, binding) if v is None else v
                                          for v, op in zip(base[1], plan.operands,
                                                           strict=True)])
        # the entry under `key` is resolved whole (only those under `fixed` hold None)
        return cast(list[tuple[np.ndarray, bool, int]], hit[1])

    def _resolve(self, op: Operand, binding: Binding) -> tuple[np.ndarray, bool, int]:
        addr = binding.address(op.ref, op.who)
        view, region = self.gmem.tensor_in(addr, op.shape, op.dtype, op.who, op.write)
        return view, region.writable, addr


def run_together(machines: Sequence[Machine], net: LoadedNet, bindings: Sequence[Binding]
                 ) -> Timeline:
    """Run one net on several machines at once (tensor parallel: every device its own
    program copy, weights and IO): each machine runs its commands up to the next
    collective, then the collective combines every machine's source tensor
    (`collective_result`: the kernels' sum or concatenation) into every machine's
    destination, and all go on. The devices run the same program, so they meet the same
    collectives in the same order, and the timeline (with the collectives on the link
    engine) is every device's. (A net cut without collectives, the lm_head's split logits,
    runs on each device alone.) Where the devices' indexed loads moved different bytes
    (expert parallelism: each device the experts its tokens chose among its own), the
    timeline is the slowest device's, timed with what it moved: the collectives wait for
    it."""
    if net.devices not in (None, len(machines)) or len(bindings) != len(machines):
        raise MachineTrap(f"net '{net.name}' joins {net.devices} devices in collectives; "
                          f"it was run on {len(machines)}")
    chips = {m.chip for m in machines}
    if len(chips) != 1:
        raise MachineTrap(f"net '{net.name}': its devices are different chips")
    runs = [m.steps(net, b) for m, b in zip(machines, bindings, strict=True)]
    while True:
        met = [next(r, None) for r in runs]
        if all(x is None for x in met):
            return max((m.timeline_of_run(net) for m in machines), key=lambda t: t.cycles)
        if any(x is None for x in met) or len({id(x[0]) for x in met if x}) != 1:
            raise MachineTrap(f"net '{net.name}': its devices reached different collectives")
        step = met[0][0]  # type: ignore[index]  # no None: checked above
        # the ignore below: no None: checked above
        parts = [views[step.src][0] for _, views in met]  # type: ignore[misc]
        whole = collective_result(step.op, parts)
        for _, views in met:  # type: ignore[misc]  # no None: checked above
            target, writable, _ = views[step.dst]
            if not writable:
                raise MachineTrap(f"{step.who}: write to a read-only region")
            target[...] = whole
