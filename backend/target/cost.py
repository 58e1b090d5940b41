"""What things cost on a chip: the bytes a tensor takes, the FLOPs and compute type of an op,
the cycles of a DMA transfer or a compute command, and the timeline of a command stream.

One cost model for everyone: `layer-group` plans with it, codegen writes each command's
bytes, FLOPs and type with it, the machine times the commands with `schedule`, and the
estimates and sweeps (`toptpu estimate`, `toptpu sweep`) re-time compiled command streams
with it without running them.

- DMA: latency + bytes / the DMA bandwidth of all cores (`Chip.dma_gbps`: the per-core
  limit times the cores, up to the sustained DDR bandwidth they share), the bytes being
  what the DDR moves: a transfer's window in its global tensor is a set of contiguous
  runs (one for a whole tensor or a slice along its first axis, one per row a window of
  fewer columns cuts), each run rounded up to whole `Chip.dma_burst_bytes` (`ddr_bytes`);
- compute: latency + FLOPs / (peak of the command's type on all cores x
  `compute_efficiency`);
- link (a net several devices run together): a collective's time on the chip-to-chip link
  for its algorithm (`toptpu.backend.target.link`);
- a command starts when its engine (DMA, compute or link) is free and its dependencies
  have finished; each engine runs its commands in stream order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.ir import Attribute, Operation, SSAValue

from toptpu.backend.target.chips import Chip
from toptpu.backend.target.link import LinkWork, collective_seconds
from toptpu.dialects.common import ShapedOp, dtype_bytes, dtype_name, elem_of, numel, shape_of


def nbytes(v: SSAValue) -> int:
    """Bytes of the tensor `v` in its storage type."""
    return type_nbytes(v.type)


@functools.lru_cache(maxsize=1 << 16)
def type_nbytes(t: Attribute) -> int:
    """Bytes of a tensor of type `t` (a type's bytes are asked for again and again: the
    layer group costs every candidate slicing of every span by them)."""
    return numel(shape_of(t)) * dtype_bytes(elem_of(t))


def cost_dtype(op: Operation) -> str:
    """The element type whose throughput an op runs at: MAC ops run at their input type
    (accumulating in f32), others at their compute type."""
    if isinstance(op, ShapedOp) and op.MULTIPLY_ACCUMULATE:
        return dtype_name(elem_of(op.operands[0]))
    c = op.attributes.get("compute")
    if c is not None:
        return dtype_name(c)
    return dtype_name(elem_of(op.results[0])) if op.results else "f32"


def op_flops(op: Operation) -> int:
    """The op's FLOPs (its dialect's FLOP count; 0 for ops that compute nothing)."""
    return op.flops() if isinstance(op, ShapedOp) else 0


def ddr_bytes(chip: Chip, nbytes: Any, run: Any = 0) -> Any:
    """Bytes the DDR moves for a transfer of `nbytes` made of contiguous runs of `run`
    bytes each (0: one run), every run rounded up to whole bursts. Elementwise over numpy
    arrays too (the layer group costs a grid of candidates at once)."""
    burst = chip.dma_burst_bytes
    run = np.where(np.asarray(run) > 0, run, nbytes)
    return nbytes / np.maximum(run, 1) * (-(-run // burst) * burst)


def dma_cycles(chip: Chip, nbytes: int, run: int = 0) -> float:
    """Cycles one DMA transfer of `nbytes` in contiguous runs of `run` bytes (0: one run)
    takes: latency plus the bytes the DDR moves (`ddr_bytes`) over the cores' DMA
    bandwidth."""
    return chip.dma_latency_cycles + float(ddr_bytes(chip, nbytes, run)) / chip.bytes_per_cycle


def run_bytes(shape: Sequence[int], part: Sequence[Any], itemsize: int) -> Any:
    """The contiguous runs of a window of shape `part` in a row-major tensor of `shape`:
    their length in bytes (the innermost axes the window covers whole, times the first
    one it cuts). The whole tensor is one run. Elementwise where `part`'s sizes are numpy
    arrays (the layer group's grid of candidates)."""
    run: Any = itemsize
    cut: Any = False
    for n, full in zip(reversed(part), reversed(shape), strict=True):
        run = np.where(cut, run, run * n)
        cut = cut | (np.asarray(n) != full)
    return int(run) if np.ndim(run) == 0 else run


def expected_distinct(rows: int, tokens: int, picks: int) -> float:
    """How many distinct rows of `rows` an indexed load moves when `tokens` tokens each
    pick `picks` distinct rows (a MoE layer's experts: E experts, T tokens, top-k), under
    uniform routing: E * (1 - (1 - k/E)^T). One token moves exactly its k; the modelled
    prefill chunk (all its rows taken as real tokens) the expected count. The machine
    counts what a run really moved (`Machine.fetched`)."""
    if tokens <= 1 or picks >= rows:
        return float(min(rows, picks * max(tokens, 0)))
    return rows * (1.0 - (1.0 - picks / rows) ** tokens)


def compute_cycles(chip: Chip, flops: int, dtype: str) -> float:
    """Cycles one compute command takes: issue latency plus work over the sustained
    throughput of its type (peak of all cores x compute efficiency)."""
    return chip.compute_latency_cycles + flops / (chip.flops_per_cycle(dtype)
                                                  * chip.compute_efficiency)


def link_cycles(chip: Chip, work: LinkWork) -> float:
    """Cycles of one collective on the chip-to-chip link."""
    return collective_seconds(chip, work) / chip.seconds_per_cycle


@dataclass(frozen=True)
class CommandCost:
    """What the timing of one command needs: its engine, work and dependencies (indices
    of earlier commands of the same stream). A collective (`link`: its kind, algorithm and
    devices) runs on the link engine; its `nbytes` is the tensor every device ends with."""

    dma: bool
    nbytes: int
    flops: int
    dtype: str
    deps: tuple[int, ...]
    link: tuple[str, str, int] | None = None
    run: int = 0  # a transfer's contiguous runs in global memory, bytes (0: one run)

    @property
    def engine(self) -> int:
        """0: compute, 1: DMA, 2: link."""
        return 2 if self.link is not None else int(self.dma)

    def link_work(self) -> LinkWork | None:
        if self.link is None:
            return None
        kind, algorithm, devices = self.link
        return LinkWork(kind, algorithm, devices, self.nbytes)

    def cycles(self, chip: Chip) -> float:
        work = self.link_work()
        if work is not None:
            return link_cycles(chip, work)
        return dma_cycles(chip, self.nbytes, self.run) if self.dma else compute_cycles(
            chip, self.flops, self.dtype)


def schedule(commands: Sequence[CommandCost], chip: Chip) -> list[tuple[float, float]]:
    """(start, end) cycle of every command on the engines: a command starts when its
    engine is free and the commands it depends on have ended."""
    end: list[float] = []
    free = [0.0, 0.0, 0.0]  # compute, dma, link
    out: list[tuple[float, float]] = []
    for c in commands:
        ready = max((end[d] for d in c.deps), default=0.0)
        engine = c.engine
        start = max(free[engine], ready)
        stop = start + c.cycles(chip)
        free[engine] = stop
        end.append(stop)
        out.append((start, stop))
    return out


@dataclass(frozen=True)
class NetTiming:
    """A net's modelled time on a chip: cycles, each engine's busy cycles, DMA bytes and
    FLOPs (what the step accounting and the estimates need of one run)."""

    cycles: float
    dma_busy: float
    compute_busy: float
    dma_bytes: int
    flops: int
    link_busy: float = 0.0  # cycles the link engine ran collectives
    link_bytes: int = 0  # bytes one device sent over its link

    def seconds(self, chip: Chip) -> float:
        return self.cycles * chip.seconds_per_cycle

    @property
    def bound(self) -> str:
        """'ddr' when the DMA engine is the busier one, else 'compute'."""
        return "ddr" if self.dma_busy >= self.compute_busy else "compute"


def net_timing(commands: Sequence[CommandCost], chip: Chip) -> NetTiming:
    """Time a command stream without running it."""
    spans = schedule(commands, chip)
    busy = [0.0, 0.0, 0.0]
    for (s, e), c in zip(spans, commands, strict=True):
        busy[c.engine] += e - s
    works = [w for c in commands if (w := c.link_work()) is not None]
    return NetTiming(cycles=max((e for _, e in spans), default=0.0), dma_busy=busy[1],
                     compute_busy=busy[0],
                     dma_bytes=sum(c.nbytes for c in commands if c.dma),
                     flops=sum(c.flops for c in commands), link_busy=busy[2],
                     link_bytes=sum(w.link_bytes() for w in works))
