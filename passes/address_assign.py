"""address-assign: global memory for each net.

Global memory holds four kinds of regions:

- **weights**: the model file's weight blob, mapped read-only; each `tpu.weight` is found
  by name in the blob's table (per-layer nets bind their layer's chunk by base address);
- **constants**: the net's `tpu.constant` values, packed into a constant pool;
- **activations**: tensors passed between layer groups (and the collectives between them,
  `dev.*`, which read and write global memory), placed by liveness: a tensor lives from the
  stage that stores it to the last stage that reads it, and tensors whose lives do not
  overlap share addresses (first fit, largest first);
- **IO**: the function's inputs and outputs (KV caches among them), bound per call by the
  runtime, so they need no address here.

Results are written as attributes: `gaddrs` on each `tpu.group` (activation offsets of its
results, -1 for results that go to an output), `gaddr` on each collective,
`tpu.const_offset` on constants, and on the function
`#tpu.regions<activations, constants, weights, io>` byte sizes — the report
`address_report` prints. These annotations are typed in the dialect (`tpu.RegionsAttr`,
`tpu.ConstantOp.pool_offset`), which is where codegen reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from toptpu.backend.target.cost import nbytes
from toptpu.dialects import tpu
from toptpu.dialects.common import ShapedOp
from toptpu.dialects.top import weight_name
from toptpu.errors import ToptpuError
from toptpu.passes.util import require_level

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class AddressError(ToptpuError):
    pass


def assign_function(fn: func.FuncOp) -> dict[str, int]:
    block = fn.body.block
    ret = block.last_op
    assert isinstance(ret, func.ReturnOp)
    returned = set(ret.operands)
    # the stages in program order: layer groups and the collectives between them
    stages = tpu.stages(block)
    order: dict[Operation, int] = {g: i for i, g in enumerate(stages)}
    ungrouped = [op.name for op in block.ops if op not in order and op is not ret
                 and not (isinstance(op, ShapedOp) and op.SOURCE)]
    if ungrouped:
        raise AddressError(f"run layer-group first: ops outside groups {sorted(set(ungrouped))}")
    # activation tensors: stage results that are not function outputs
    tensors: list[tuple[SSAValue, int, int, int]] = []  # value, size, first, last
    for g in stages:
        for r in g.results:
            if r in returned:
                continue
            last = max((order[u.operation] for u in r.uses if u.operation in order),
                       default=order[g])
            tensors.append((r, _align(nbytes(r)), order[g], last))
    placed: list[tuple[int, int, int, int]] = []  # offset, size, first, last
    offsets: dict[SSAValue, int] = {}
    for v, size, first, last in sorted(tensors, key=lambda t: (-t[1], t[2])):
        blockers = sorted((o, o + s) for o, s, f, la in placed if f <= last and first <= la)
        off = 0
        for s0, e0 in blockers:
            if off + size <= s0:
                break
            off = max(off, e0)
        placed.append((off, size, first, last))
        offsets[v] = off
    act = max((o + s for o, s, _, _ in placed), default=0)
    for g in stages:
        g.set_result_offsets([offsets.get(r, -1) for r in g.results])
    const = 0
    for op in block.ops:
        if isinstance(op, tpu.ConstantOp):
            op.pool_offset = const
            const += _align(nbytes(op.output))
    weights = sum(_align(nbytes(op.results[0])) for op in block.ops
                  if op.results and weight_name(op.results[0]) is not None)
    io = sum(_align(nbytes(a)) for a in block.args) + sum(_align(nbytes(v)) for v in returned)
    return tpu.set_regions(fn, act, const, weights, io).sizes()


def regions_of(fn: func.FuncOp) -> dict[str, int]:
    regions = tpu.regions_of(fn)
    if regions is None:
        raise AddressError(f"@{fn.sym_name.data} has no addresses: run address-assign")
    return regions


def address_report(module: ModuleOp) -> str:
    lines = [f"{'function':<20} {'activations':>12} {'constants':>10} {'weights':>12} {'io':>10}"]
    for fn in module.ops:
        if isinstance(fn, func.FuncOp):
            r = regions_of(fn)
            lines.append(f"@{fn.sym_name.data:<19} {r['activations']:>12} {r['constants']:>10} "
                         f"{r['weights']:>12} {r['io']:>10}")
    return "\n".join(lines)


@dataclass(frozen=True)
class AddressAssignPass(ModulePass):
    """Place activations by liveness, pack constants, size weight and IO regions."""

    name = "address-assign"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "tpu", self.name)
        for fn in op.ops:
            if isinstance(fn, func.FuncOp):
                assign_function(fn)

