"""The checks grouped, allocated, addressed Tpu IR must pass before codegen makes command
streams of it: what `toptpu profile FILE.mlir` times must be IR the machine could run.

`verify_machine_ir(module, chip)` checks each function, and raises `MachineIRError` naming
the function, the op (its location) and what is wrong:

- every tensor has elements (a zero-size tensor has nothing to time, and the local-memory
  checks would see a buffer of no bytes where an address is);
- every layer group's slicing is its loads' and stores': each sliced load or store moves
  1/slices of its tensor along its slice axis (of a 2-D tiled group: 1/count per tile
  loop), so a group cannot claim more slices than its tensors have rows (99999999999
  slices of a 16-row tensor are refused, not looped over);
- the local memory allocation (`lmem-verify`: alignment, the lane's capacity, live buffers
  that overlap, bank conflicts);
- the global addresses (what `address-assign` decides): the function's regions
  (`#tpu.regions`) hold what is placed in them — each activation inside its region and no
  two activations that live at the same time overlapping, each constant inside the
  constant pool, the weights and the IO within their regions' sizes — and a result
  without an address is a function output.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue

from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import nbytes
from toptpu.dialects import dev, tpu
from toptpu.dialects.common import numel, read_int, read_ints, shape_of
from toptpu.dialects.naming import op_name
from toptpu.errors import ToptpuError
from toptpu.passes.address_assign import ALIGN
from toptpu.passes.lmem import LocalMemoryError, verify_group


class MachineIRError(ToptpuError):
    """Grouped, addressed Tpu IR that codegen and the machine cannot take as it is."""


def _where(fn: func.FuncOp, op: Operation | None = None) -> str:
    name = None if op is None else (op_name(op) or op.name)
    return f"@{fn.sym_name.data}" + (f": {name}" if name else "")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def verify_machine_ir(module: ModuleOp, chip: Chip) -> None:
    """Check every function of `module` (see the module doc); MachineIRError otherwise."""
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        _check_sizes(fn)
        for op in fn.walk():
            if isinstance(op, tpu.GroupOp):
                _check_slices(fn, op)
                try:
                    verify_group(op, chip)
                except LocalMemoryError as e:
                    raise MachineIRError(f"{_where(fn, op)}: {e}") from None
        _check_addresses(fn)


def _check_sizes(fn: func.FuncOp) -> None:
    """Every tensor of the function has elements."""
    values: list[tuple[SSAValue, Operation | None]] = [(a, None) for a in fn.body.block.args]
    for op in fn.walk():
        values += [(r, op) for r in op.results]
    for v, owner in values:
        if isinstance(v.type, TensorType) and numel(shape_of(v)) == 0:
            what = "an argument" if owner is None else "a result"
            raise MachineIRError(f"{_where(fn, owner)}: {what} of type {v.type} has no "
                                 "elements; toptpu times nets whose tensors all have some")


def _check_slices(fn: func.FuncOp, group: tpu.GroupOp) -> None:
    """Each sliced load and store of `group` moves the part its slices say."""
    slices = read_int(group.slices)
    grid = group.tile_grid()
    counts = None if grid is None else (*grid[:2], *group.part_counts())
    sliced = False
    for op in group.body.block.ops:
        if not isinstance(op, tpu.LoadOp | tpu.StoreOp):
            continue
        full, part = (op.input, op.output) if isinstance(op, tpu.LoadOp) else \
            (op.output, op.input)
        fs, ps = shape_of(full), shape_of(part)
        axis = read_int(op.slice_axis)
        if axis == -1:
            continue
        sliced = True
        axes = tpu.tile_axes_of(op)
        if counts is None or axes is None:
            pairs = [(axis, slices)]
        else:
            pairs = [(a, c) for a, c in zip(axes, counts, strict=False) if a != -1]
        for a, count in pairs:
            if not 0 <= a < len(fs) or ps[a] * count != fs[a]:
                raise MachineIRError(
                    f"{_where(fn, op)}: in a group of {slices} slices it moves {ps[a]} of "
                    f"the {fs[a]} positions of axis {a} at a time, not 1/{count} of them")
    if slices > 1 and not sliced:
        raise MachineIRError(f"{_where(fn, group)}: a group of {slices} slices slices "
                             "nothing (every load and store moves a whole tensor)")


def _check_addresses(fn: func.FuncOp) -> None:
    """The global placements against the function's regions (see the module doc)."""
    regions = tpu.regions_of(fn)
    if regions is None:
        return
    block = fn.body.block
    ret = block.last_op
    returned = set(ret.operands) if isinstance(ret, func.ReturnOp) else set()
    stages = [op for op in block.ops if isinstance(op, tpu.GroupOp | dev.CollectiveOp)]
    order = {s: i for i, s in enumerate(stages)}
    placed: list[tuple[int, int, int, int, SSAValue, Operation]] = []
    for s in stages:
        if isinstance(s, tpu.GroupOp):
            addrs = read_ints(s.gaddrs) if s.gaddrs is not None else []
            if len(addrs) != len(s.outputs):
                raise MachineIRError(f"{_where(fn, s)}: gaddrs has {len(addrs)} addresses "
                                     f"for {len(s.outputs)} results: run address-assign")
            pairs = list(zip(s.outputs, addrs, strict=True))
        else:
            addr = s.attributes.get("gaddr")
            pairs = [(s.output, read_int(addr) if addr is not None else -1)]
        for r, at in pairs:
            if at == -1:
                if r not in returned:
                    raise MachineIRError(f"{_where(fn, s)}: a result that is not a function "
                                         "output has no global address (-1)")
                continue
            size = nbytes(r)
            if at < 0 or at % ALIGN or at + size > regions["activations"]:
                raise MachineIRError(
                    f"{_where(fn, s)}: a result of {size} bytes at global address {at} is "
                    f"not inside the activation region of {regions['activations']} bytes "
                    f"(or not {ALIGN}-byte aligned)")
            last = max((order[u.operation] for u in r.uses if u.operation in order),
                       default=order[s])
            placed.append((at, at + size, order[s], last, r, s))
    placed.sort(key=lambda p: p[0])
    for i, (a0, a1, f0, l0, _, s0) in enumerate(placed):
        for b0, b1, f1, l1, _, s1 in placed[i + 1:]:
            if b0 >= a1:
                break
            if f0 <= l1 and f1 <= l0:
                raise MachineIRError(
                    f"{_where(fn, s1)}: its result at [{b0}, {b1}) overlaps the live result "
                    f"of {op_name(s0) or s0.name} at [{a0}, {a1}) in the activation region")
    pool = regions["constants"]
    for op in block.ops:
        if isinstance(op, tpu.ConstantOp):
            offset, size = op.pool_offset, nbytes(op.output)
            if offset is None or offset < 0 or offset + size > pool:
                raise MachineIRError(f"{_where(fn, op)}: a constant of {size} bytes at pool "
                                     f"offset {offset} is not inside the constant pool of "
                                     f"{pool} bytes")
    for region, need in (
            ("weights", sum(_aligned(nbytes(op.output)) for op in block.ops
                            if isinstance(op, tpu.WeightOp))),
            ("io", sum(_aligned(nbytes(a)) for a in block.args)
             + sum(_aligned(nbytes(v)) for v in returned))):
        if regions[region] < need:
            raise MachineIRError(f"@{fn.sym_name.data}: its {region} region of "
                                 f"{regions[region]} bytes is smaller than the {need} bytes "
                                 f"placed in it")
