"""What things cost on a chip: the bytes a tensor takes, the FLOPs and compute type of an op,
the cycles of a DMA transfer or a compute command, and the timeline of a command stream.

One cost model for everyone: `layer-group` plans with it, codegen writes each command's
bytes, FLOPs and type with it, the machine times the commands with `schedule`, and the
estimates and sweeps (`toptpu estimate`, `toptpu sweep`) re-time compiled command streams
with it without running them.

- DMA: latency + bytes / the DMA bandwidth of all cores (`Chip.dma_gbps`: the per-core
  limit times the cores, up to the sustained DDR bandwidth they share);
- compute: latency + FLOPs / (peak of the command's type on all cores x
  `compute_efficiency`);
- a command starts when its engine (DMA or compute) is free and its dependencies have
  finished; each engine runs its commands in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.ir import Operation, SSAValue

from toptpu.backend.target.chips import Chip
from toptpu.dialects import top, tpu
from toptpu.dialects.common import ShapedOp, dtype_bytes, dtype_name, elem_of, numel, shape_of


def nbytes(v: SSAValue) -> int:
    """Bytes of the tensor `v` in its storage type."""
    return numel(shape_of(v)) * dtype_bytes(elem_of(v))


def cost_dtype(op: Operation) -> str:
    """The element type whose throughput an op runs at: MAC ops run at their input type
    (accumulating in f32), others at their compute type."""
    if isinstance(op, top.MatMulBase | tpu.A16MatMulOp | top.AttentionBase | top.Conv2dBase):
        return dtype_name(elem_of(op.operands[0]))
    c = op.attributes.get("compute")
    if c is not None:
        return dtype_name(c)
    return dtype_name(elem_of(op.results[0])) if op.results else "f32"


def op_flops(op: Operation) -> int:
    """The op's FLOPs (its dialect's FLOP count; 0 for ops that compute nothing)."""
    return op.flops() if isinstance(op, ShapedOp) else 0


def dma_cycles(chip: Chip, nbytes: int) -> float:
    """Cycles one DMA transfer takes: latency plus bytes over the cores' DMA bandwidth."""
    return chip.dma_latency_cycles + nbytes / chip.bytes_per_cycle


def compute_cycles(chip: Chip, flops: int, dtype: str) -> float:
    """Cycles one compute command takes: issue latency plus work over the sustained
    throughput of its type (peak of all cores x compute efficiency)."""
    return chip.compute_latency_cycles + flops / (chip.flops_per_cycle(dtype)
                                                  * chip.compute_efficiency)


@dataclass(frozen=True)
class CommandCost:
    """What the timing of one command needs: its engine, work and dependencies (indices
    of earlier commands of the same stream)."""

    dma: bool
    nbytes: int
    flops: int
    dtype: str
    deps: tuple[int, ...]

    def cycles(self, chip: Chip) -> float:
        return dma_cycles(chip, self.nbytes) if self.dma else compute_cycles(
            chip, self.flops, self.dtype)


def schedule(commands: Sequence[CommandCost], chip: Chip) -> list[tuple[float, float]]:
    """(start, end) cycle of every command on the two engines: a command starts when its
    engine is free and the commands it depends on have ended."""
    end: list[float] = []
    free = [0.0, 0.0]  # compute, dma
    out: list[tuple[float, float]] = []
    for c in commands:
        ready = max((end[d] for d in c.deps), default=0.0)
        start = max(free[c.dma], ready)
        stop = start + c.cycles(chip)
        free[c.dma] = stop
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

    def seconds(self, chip: Chip) -> float:
        return self.cycles * chip.seconds_per_cycle

    @property
    def bound(self) -> str:
        """'ddr' when the DMA engine is the busier one, else 'compute'."""
        return "ddr" if self.dma_busy >= self.compute_busy else "compute"


def net_timing(commands: Sequence[CommandCost], chip: Chip) -> NetTiming:
    """Time a command stream without running it."""
    spans = schedule(commands, chip)
    dma_busy = sum(e - s for (s, e), c in zip(spans, commands, strict=True) if c.dma)
    cmp_busy = sum(e - s for (s, e), c in zip(spans, commands, strict=True) if not c.dma)
    return NetTiming(cycles=max((e for _, e in spans), default=0.0), dma_busy=dma_busy,
                     compute_busy=cmp_busy,
                     dma_bytes=sum(c.nbytes for c in commands if c.dma),
                     flops=sum(c.flops for c in commands))
