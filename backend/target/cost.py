"""What things cost on a chip: the bytes a tensor takes, the FLOPs and compute type of an op,
and the cycles of a DMA transfer or a compute command.

One cost model for everyone: `layer-group` plans with it, codegen writes each command's
bytes, FLOPs and type with it, and the machine times the commands with it.
"""

from __future__ import annotations

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
    """Cycles one DMA transfer takes: latency plus bytes over DDR bandwidth."""
    return chip.dma_latency_cycles + nbytes / chip.bytes_per_cycle


def compute_cycles(chip: Chip, flops: int, dtype: str) -> float:
    """Cycles one compute command takes: issue latency plus work over peak throughput."""
    return chip.compute_latency_cycles + flops / chip.flops_per_cycle(dtype)
