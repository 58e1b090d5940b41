"""Codegen: a grouped, allocated, addressed Tpu function -> command streams.

Each layer group is unrolled slice by slice into the order of its software pipeline:
load(0); then for every slice i: load(i+1), compute(i), store(i-1); finally store(last).
Commands go to two engines — DMA (global <-> local, gathers) and compute — and carry
explicit dependencies, derived from the memory they touch (read-after-write,
write-after-read, write-after-write on local address ranges and global tensors). Each
engine runs its commands in stream order; a command starts when its engine is free and its
dependencies have finished.

The commands are the typed records of `toptpu.backend.formats.commands`. Global operands
are named by space: `io` (a function input/output, bound per call), `w` (a weight, found by
name in the weight blob; per-layer nets bind their layer's chunk), `act` (the net's
activation region, offsets from address-assign) and `const` (the net's constant pool).
Local operands are (per-lane address, shape, dtype) plus a buffer instance id, so the
machine can track which local buffers are live and trap on any overlap.

Compute commands name the template op they run (its index among the grouped IR's ops) so
the machine calls the same evaluators — the same kernels — as the interpreters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import BlockArgument, Operation, SSAValue

from toptpu.backend.formats.commands import (
    Collective,
    Command,
    Compute,
    Cut,
    Gather,
    GlobalRef,
    Load,
    LocalRef,
    Space,
    Store,
    TableRef,
)
from toptpu.backend.formats.program import Program, Regions, TensorSpec, WeightSpec
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import cost_dtype, nbytes, op_flops
from toptpu.dialects import dev, tpu
from toptpu.dialects.common import dtype_bytes, numel, numpy_dtype, read_int, read_ints, shape_of
from toptpu.dialects.ir_text import print_generic
from toptpu.dialects.naming import input_names, op_name, output_names
from toptpu.dialects.top import weight_name
from toptpu.errors import ToptpuError


class CodegenError(ToptpuError, ValueError):
    """The IR is not ready for codegen (not grouped, allocated or addressed); the message
    names the pass to run."""


def nbytes_of(t: TensorType) -> int:
    return numel(t.get_shape()) * dtype_bytes(t.element_type)


def _dtype(v: SSAValue) -> str:
    t = v.type
    assert isinstance(t, TensorType), t
    return str(numpy_dtype(t.element_type))


class _Emitter:
    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        self.commands: list[Command] = []
        #: the accesses a later command may depend on: per memory key, per byte range
        #: [lo, hi), the commands that read it and those that wrote it (a tiled group makes
        #: thousands of commands over a few ranges: only the ranges are scanned)
        self.accesses: dict[tuple, dict[tuple[int, int], tuple[list[int], list[int]]]] = {}
        self.next_buf = 0

    def new_buf(self) -> int:
        self.next_buf += 1
        return self.next_buf

    def add(self, make: Callable[..., Command], reads: list[tuple], writes: list[tuple],
            kills: list[tuple] | None = None, **fields: Any) -> int:
        """The command `make(id=..., deps=..., **fields)`, its dependencies derived from the
        memory it reads and writes: a read waits for the overlapping writes before it, a
        write for the overlapping reads and writes. The local buffers the command frees
        (`kills`: their ranges) count as written: freeing waits for every earlier reader of
        the buffer — on the other engine a reader may still be pending when the command that
        reads it last in stream order runs."""
        writes = [*writes, *(kills or [])]
        cid = len(self.commands)
        deps: set[int] = set()
        for is_write, accs in ((False, reads), (True, writes)):
            for key, lo, hi in accs:
                for (alo, ahi), (rs, ws) in self.accesses.get(key, {}).items():
                    if alo < hi and lo < ahi:
                        deps.update(ws)
                        if is_write:
                            deps.update(rs)
        for is_write, accs in ((False, reads), (True, writes)):
            for key, lo, hi in accs:
                ranges = self.accesses.setdefault(key, {})
                if is_write:  # a covering write supersedes older accesses of that range
                    for r in [r for r in ranges if lo <= r[0] and r[1] <= hi]:
                        del ranges[r]
                rs, ws = ranges.setdefault((lo, hi), ([], []))
                (ws if is_write else rs).append(cid)
        self.commands.append(make(id=cid, deps=tuple(sorted(deps)), **fields))
        return cid


def _global_ref(v: SSAValue, fn_inputs: dict[SSAValue, str], fn_outputs: dict[SSAValue, str],
                act: dict[SSAValue, int]) -> GlobalRef:
    if v in fn_inputs:
        return GlobalRef(Space.IO, fn_inputs[v])
    if v in fn_outputs:
        return GlobalRef(Space.IO, fn_outputs[v])
    owner = v.owner
    if (name := weight_name(v)) is not None:
        return GlobalRef(Space.WEIGHT, name)
    if isinstance(owner, tpu.ConstantOp):
        if owner.pool_offset is None:
            raise CodegenError(f"constant {op_name(owner) or v.name_hint}: run address-assign")
        return GlobalRef(Space.CONST, offset=owner.pool_offset)
    if v in act:
        return GlobalRef(Space.ACT, offset=act[v])
    raise CodegenError(f"no global home for {v.name_hint or v}: run address-assign")


def _regions(fn: func.FuncOp) -> dict[str, int]:
    regions = tpu.regions_of(fn)
    if regions is None:
        raise CodegenError(f"@{fn.sym_name.data} has no addresses: run address-assign")
    return regions


def _gkey(ref: GlobalRef) -> tuple:
    return (ref.space, ref.name)


def generate(module: ModuleOp, fn: func.FuncOp, chip: Chip) -> Program:
    """Command streams for one grouped, allocated and addressed function."""
    block = fn.body.block
    ret = block.last_op
    assert isinstance(ret, func.ReturnOp)
    in_names = input_names(fn)
    out_names = output_names(fn)
    fn_inputs: dict[SSAValue, str] = dict(zip(block.args, in_names, strict=True))
    fn_outputs: dict[SSAValue, str] = {}
    for v, n in zip(ret.operands, out_names, strict=True):
        if v in fn_outputs or v in fn_inputs:
            raise CodegenError(f"output '{n}' repeats another input/output; return distinct values")
        fn_outputs[v] = n
    stages = tpu.stages(block)
    act: dict[SSAValue, int] = {}
    for g in stages:
        offsets = g.result_offsets()
        if offsets is None:
            raise CodegenError("run address-assign before codegen")
        for r, off in zip(g.results, offsets, strict=True):
            if off >= 0:
                act[r] = off
    # index every op of the grouped IR in walk order: compute commands refer to these
    op_index: dict[Operation, int] = {op: i for i, op in enumerate(fn.walk())}
    weights = {}
    for op in block.ops:
        name = weight_name(op.results[0]) if op.results else None
        if name is not None:
            (w,) = op.results
            weights[name] = WeightSpec(tuple(shape_of(w)), _dtype(w), nbytes(w))
    em = _Emitter(chip)
    total_flops = 0
    for gi, g in enumerate(stages):
        if isinstance(g, dev.CollectiveOp):
            total_flops += _collective(em, g, gi, op_index, fn_inputs, fn_outputs, act)
        else:
            total_flops += _GroupEmitter(em, g, gi, chip, op_index, fn_inputs, fn_outputs,
                                         act).emit()
    prog = Program(
        name=fn.sym_name.data,
        inputs=tuple(TensorSpec(n, tuple(shape_of(a)), _dtype(a))
                     for n, a in zip(in_names, block.args, strict=True)),
        outputs=tuple(TensorSpec(n, tuple(shape_of(v)), _dtype(v))
                      for n, v in zip(out_names, ret.operands, strict=True)),
        regions=Regions(**_regions(fn)),
        weights=weights,
        commands=tuple(em.commands),
        ir=print_generic(module, debuginfo=True),
        flops=total_flops,
    )
    return prog


def _collective(em: _Emitter, op: dev.CollectiveOp, gi: int, op_index: dict[Operation, int],
                fn_inputs: dict[SSAValue, str], fn_outputs: dict[SSAValue, str],
                act: dict[SSAValue, int]) -> int:
    """The link command of one collective: global tensor to global tensor on every device
    (it waits for the store of its operand; the loads of its result wait for it)."""
    src = _global_ref(op.input, fn_inputs, fn_outputs, act)
    dst = _global_ref(op.output, fn_inputs, fn_outputs, act)

    def access(ref: GlobalRef, v: SSAValue) -> tuple:
        lo = ref.offset if ref.space == Space.ACT else 0
        return (_gkey(ref), lo, lo + nbytes(v))

    em.add(Collective, [access(src, op.input)], [access(dst, op.output)],
           name=op_name(op) or op.name, op=op_index[op], kind=op.KIND,
           algorithm=op.algorithm_name, devices=op.device_count,
           axis=op.link_axis, src=src, src_shape=tuple(shape_of(op.input)),
           dst=dst, dst_shape=tuple(shape_of(op.output)), dtype=_dtype(op.output),
           flops=op.flops(), group=gi, slice=0)
    return op.flops()


@dataclass
class _GroupEmitter:
    """The commands of one layer group, slice by slice in its software pipeline's order
    (`emit`): loads (`load`), compute ops (`compute`) and stores (`store`) of the group's
    template, with the local buffer instances each slice makes and frees."""

    em: _Emitter
    g: tpu.GroupOp
    gi: int
    chip: Chip
    op_index: dict[Operation, int]
    fn_inputs: dict[SSAValue, str]
    fn_outputs: dict[SSAValue, str]
    act: dict[SSAValue, int]

    def __post_init__(self) -> None:
        g = self.g
        self.loads, self.computes, self.stores = g.template()
        self.slices = s = read_int(g.slices)
        self.outer: dict[SSAValue, SSAValue] = dict(zip(g.body.block.args, g.inputs, strict=True))
        yielded = g.body.block.last_op
        assert yielded is not None  # a group's body ends with its yield
        self.store_target = dict(zip(yielded.operands, g.outputs, strict=True))
        self.lmem: dict[SSAValue, list[int]] = {}
        for op in [*self.loads, *self.computes]:
            if not read_ints(op.lmem):
                raise CodegenError(f"{op_name(op)} has no local address: run layer-group")
            for r in op.results:
                self.lmem[r] = op.local_addresses(r, s > 1)
        self.per_lane = {v: self.chip.per_lane(nbytes(v)) for v in self.lmem}
        # buffer instance of (local value, slice): ids; and how many reads it has left
        self.inst: dict[tuple[SSAValue, int], int] = {}
        self.readers_left: dict[tuple[SSAValue, int], int] = {}
        #: buffer instance -> its local range, from its last read until the command freeing it
        self.freed_range: dict[int, tuple] = {}
        computes = self.computes
        in_group = {*computes, *self.stores}
        self.uses_in_group = {v: sum(1 for u in v.uses if u.operation in in_group)
                              for v in self.lmem}
        self.resident = {ld.output for ld in self.loads if read_int(ld.slice_axis) == -1}
        #: slices one buffer instance serves (a tiled group's load kept for the inner loop)
        self.per_buffer: dict[SSAValue, int] = {
            ld.output: g.tiles_per_buffer(ld) for ld in self.loads}
        self.loaded = {ld.output for ld in self.loads}
        #: a group with reduction parts: its op, accumulator (address, type), the slices a
        #: stored tile takes, and the accumulator instance of the tile being reduced
        self.parts = g.reduction_parts()
        self.reducing: Operation | None = None
        if self.parts > 1:
            (self.reducing,) = self.computes
            if g.acc is None:
                raise CodegenError(f"{op_name(g)} has no accumulator address: run layer-group")
            acc_type = tpu.accumulator_type(self.reducing)
            self.acc_at = read_int(g.acc)
            self.acc_shape = tuple(acc_type.get_shape())
            self.acc_bytes = nbytes_of(acc_type)
        self.acc_buf = 0
        self.store_every = self.parts
        if self.reducing is not None:  # its result: one instance per tile
            self.per_buffer.update({r: self.parts for r in self.reducing.results})
        self._index_loads()

    def _index_loads(self) -> None:
        """The indexed loads (`tpu.load` `by_index`): the index value each reads (its
        consumer's index operand) in `index_of`. One whose index the group computes is
        loaded per slice right before its consumer (`deferred`); one whose index is
        loaded is loaded after that index (the index loads go first), and each buffer
        instance must serve only slices that read one instance of the index."""
        self.index_of: dict[SSAValue, SSAValue] = {}
        for ld in self.loads:
            if ld.by_index is None:
                continue
            picks = {u.operation.operands[u.operation.fetched_by_index()[u.index]]
                     for u in ld.output.uses}
            if len(picks) != 1:
                raise CodegenError(f"{op_name(ld)}: its consumers read it by different "
                                   "indices")
            self.index_of[ld.output] = picks.pop()
        # deferred: an indexed load whose indices the group computes, or whose indices are
        # loaded slice by slice while it is not sliced (one buffer of the experts a slice
        # chose, fetched again for each slice's indices)
        self.deferred = {v for v, idx in self.index_of.items() if idx not in self.loaded
                         or (idx not in self.resident and v in self.resident)}
        for v in self.deferred:
            if v not in self.resident:
                raise CodegenError(f"{v.name_hint}: an indexed load sliced by the group "
                                   "reads indices the group computes; group the op apart")
            self.resident.discard(v)
            self.per_buffer[v] = 1
        for v, idx in self.index_of.items():
            if v in self.deferred or idx in self.resident:
                continue
            if v in self.resident or self.per_buffer[idx] % self.per_buffer[v]:
                raise CodegenError(f"{v.name_hint}: a buffer of an indexed load would serve "
                                   "slices of different indices")
        # the loads of indices first: an indexed load reads them
        picked = set(self.index_of.values())
        self.loads.sort(key=lambda ld: ld.output not in picked)

    def emit(self) -> int:
        """Emit every command of the group; return its FLOPs (each slice runs the
        slice-shaped template ops)."""
        s = self.slices
        sliced_loads = [ld for ld in self.loads
                        if ld.output not in self.resident and ld.output not in self.deferred]
        for ld in self.loads:
            if ld.output in self.resident:
                self.load(ld, 0)
        for ld in sliced_loads:
            self.load(ld, 0)
        for i in range(s):
            if i + 1 < s:
                for ld in sliced_loads:
                    if (i + 1) % self.per_buffer[ld.output] == 0:
                        self.load(ld, i + 1)
            for op in self.computes:
                self.compute(op, i)
            if i >= 1 and i % self.store_every == 0:  # a tile after its last part
                for st in self.stores:
                    self.store(st, i - 1)
        for st in self.stores:
            self.store(st, s - 1)
        return s * sum(op_flops(op) for op in self.computes)

    # ------------------------------------------------------------------ local buffers

    def _key(self, v: SSAValue, i: int) -> tuple[SSAValue, int]:
        return (v, 0 if v in self.resident else i // self.per_buffer.get(v, 1))

    def addr(self, v: SSAValue, i: int) -> int:
        a = self.lmem[v]
        return a[self._key(v, i)[1] % len(a)]

    def local_ref(self, v: SSAValue, i: int) -> LocalRef:
        return LocalRef(self.addr(v, i), tuple(shape_of(v)), _dtype(v),
                        self.inst[self._key(v, i)], nbytes(v))

    def lrange(self, v: SSAValue, i: int) -> tuple:
        a = self.addr(v, i)
        return ("L", None), a, a + self.per_lane[v]

    def consume(self, v: SSAValue, i: int, freed: list[int]) -> None:
        """One read of `v` in slice `i`; its buffer is freed after its last read."""
        key = self._key(v, i)
        self.readers_left[key] -= 1
        if self.readers_left[key] == 0:
            freed.append(self.inst[key])
            self.freed_range[self.inst[key]] = self.lrange(v, i)

    def kills(self, freed: list[int]) -> list[tuple]:
        """The local ranges of the buffer instances a command frees."""
        return [self.freed_range.pop(b) for b in freed]

    def make(self, v: SSAValue, i: int) -> None:
        """A new buffer instance of `v` for slice `i` (one for all slices when resident)."""
        key = self._key(v, i)
        self.inst[key] = self.em.new_buf()
        n = self.uses_in_group[v] * (self.slices if v in self.resident
                                     else self.per_buffer.get(v, 1) if v in self.loaded
                                     else 1)
        self.readers_left[key] = max(n, 1)

    def global_ref(self, v: SSAValue) -> GlobalRef:
        return _global_ref(v, self.fn_inputs, self.fn_outputs, self.act)

    # ------------------------------------------------------------------ commands

    def load(self, ld: tpu.LoadOp, i: int) -> None:
        src = self.outer[ld.input]
        ref = self.global_ref(src)
        ax = read_int(ld.slice_axis)
        full = list(shape_of(src))
        window = self.g.slice_window(ld, i, full)
        part = window[ax] if ax >= 0 else slice(0, 0)
        self.make(ld.output, i)
        # the whole tensor counts as read (today's dependency rule: a named tensor from 0)
        read = (_gkey(ref), ref.offset, ref.offset + nbytes(src)) if ref.space == Space.ACT \
            else (_gkey(ref), 0, nbytes(src))
        reads = [read]
        index = None
        if (picks := self.index_of.get(ld.output)) is not None:
            index = self.local_ref(picks, i)
            reads.append(self.lrange(picks, i))
        self.em.add(Load, reads, [self.lrange(ld.output, i)], index=index,
                    name=op_name(ld) or "load", tensor=ref, shape=tuple(full),
                    dtype=_dtype(src), axis=ax, start=part.start, length=part.stop - part.start,
                    cuts=_cuts(window, ax), local=self.local_ref(ld.output, i), group=self.gi,
                    slice=i)

    def compute(self, op: Operation, i: int) -> None:
        for ld in self.loads:  # indexed loads by indices computed in the group
            if ld.output in self.deferred and ld.output in op.operands \
                    and (ld.output, i) not in self.inst:
                self.load(ld, i)
        if op is self.reducing:
            self.reduce(op, i)
            return
        freed: list[int] = []
        ins: list[LocalRef | None] = []
        reads = []
        groups_ = op.operand_groups() if hasattr(op, "operand_groups") else list(op.operands)
        table: TableRef | None = None
        table_operand = 0
        for k, v in enumerate(groups_):
            if v is None:
                ins.append(None)
                continue
            if isinstance(v, BlockArgument) and v in self.outer and v not in self.lmem:
                src = self.outer[v]  # a table read row by row from global memory
                ref = self.global_ref(src)
                table, table_operand = TableRef(ref, tuple(shape_of(src)), _dtype(src)), k
                reads.append((_gkey(ref), ref.offset, ref.offset + nbytes(src)))
                continue
            ins.append(self.local_ref(v, i))
            reads.append(self.lrange(v, i))
        for v in op.operands:
            if v in self.lmem:
                self.consume(v, i, freed)
        outs = []
        for r in op.results:
            self.make(r, i)
            outs.append(self.local_ref(r, i))
        fields: dict[str, Any] = dict(
            name=op_name(op) or op.name, kind=op.name, op=self.op_index[op], ins=tuple(ins),
            outs=tuple(outs), flops=op_flops(op),  # the template op is slice-shaped already
            dtype=cost_dtype(op), free=tuple(freed), group=self.gi, slice=i,
            # results nothing reads die as soon as they are written
            free_after=tuple(o.buf for r, o in zip(op.results, outs, strict=True)
                             if self.uses_in_group[r] == 0))
        writes = [self.lrange(r, i) for r in op.results]
        if table is not None:
            self.em.add(Gather, reads, writes, self.kills(freed), table=table,
                        table_operand=table_operand, **fields)
        else:
            self.em.add(Compute, reads, writes, self.kills(freed), **fields)

    def reduce(self, op: Operation, i: int) -> None:
        """The compute of one reduction part (`Compute.parts`): its part's inputs folded
        into the accumulator; at the last part the result written, the accumulator freed."""
        part = self.g.reduction_part(i)
        last = part == self.parts - 1
        if part == 0:
            self.acc_buf = self.em.new_buf()
        acc = LocalRef(self.acc_at, self.acc_shape, "float32", self.acc_buf, self.acc_bytes)
        acc_range = (("L", None), self.acc_at, self.acc_at + self.chip.per_lane(self.acc_bytes))
        freed: list[int] = []
        groups_ = op.operand_groups() if hasattr(op, "operand_groups") else list(op.operands)
        ins = [self.local_ref(v, i) if v is not None else None for v in groups_]
        reads = [self.lrange(v, i) for v in op.operands]
        if part > 0:
            reads.append(acc_range)
        for v in op.operands:
            self.consume(v, i, freed)
        outs: list[LocalRef] = []
        writes = []
        kills = self.kills(freed)
        if last:
            freed.append(self.acc_buf)
            kills.append(acc_range)
            for r in op.results:
                self.make(r, i)
                outs.append(self.local_ref(r, i))
                writes.append(self.lrange(r, i))
        else:
            writes.append(acc_range)
        self.em.add(Compute, reads, writes, kills, name=op_name(op) or op.name, kind=op.name,
                    op=self.op_index[op], ins=tuple(ins), outs=tuple(outs),
                    flops=op_flops(op), dtype=cost_dtype(op), free=tuple(freed),
                    group=self.gi, slice=i, part=part, parts=self.parts, acc=acc)

    def store(self, st: tpu.StoreOp, i: int) -> None:
        dst = self.store_target[st.output]
        ref = self.global_ref(dst)
        ax = read_int(st.slice_axis)
        full = list(shape_of(dst))
        n = full[ax] // self.slices if ax >= 0 else 0
        freed: list[int] = []
        src = self.local_ref(st.input, i)
        self.consume(st.input, i, freed)
        glo = ref.offset if ref.space == Space.ACT else 0
        item = np.dtype(_dtype(dst)).itemsize
        if tpu.tile_axes_of(st) is not None:  # a tile: a box of the result
            window = self.g.slice_window(st, i, full)
            lo, hi = _box_range(full, window, item)
            part = window[ax]
            self.em.add(Store, [self.lrange(st.input, i)], [(_gkey(ref), glo + lo, glo + hi)],
                        self.kills(freed), name=op_name(st) or "store", tensor=ref,
                        shape=tuple(full), dtype=_dtype(dst), axis=ax, start=part.start,
                        length=part.stop - part.start, cuts=_cuts(window, ax), local=src,
                        free=tuple(freed), group=self.gi, slice=i)
            return
        if ax >= 0 and all(d == 1 for d in full[:ax]):
            inner = int(np.prod(full[ax + 1:])) * item
            lo, hi = glo + i * n * inner, glo + (i + 1) * n * inner
        else:
            lo, hi = glo, glo + nbytes(dst)
        self.em.add(Store, [self.lrange(st.input, i)], [(_gkey(ref), lo, hi)],
                    self.kills(freed), name=op_name(st) or "store", tensor=ref,
                    shape=tuple(full),
                    dtype=_dtype(dst), axis=ax, start=i * n, length=n, local=src,
                    free=tuple(freed), group=self.gi, slice=i)


def _cuts(window: tuple[slice, ...], axis: int) -> tuple[Cut, ...]:
    """The axes other than `axis` that `window` cuts (a part of a tile)."""
    return tuple(Cut(a, w.start, w.stop - w.start) for a, w in enumerate(window)
                 if a != axis and w != slice(None))


def _box_range(shape: list[int], window: tuple[slice, ...], item: int) -> tuple[int, int]:
    """The byte range [lo, hi) from the first to the last element of a box of a row-major
    tensor (what a store of a tile may write)."""
    strides = [item] * len(shape)
    for a in range(len(shape) - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]
    lo = hi = 0
    for w, n, stride in zip(window, shape, strides, strict=True):
        start, stop = (0, n) if w == slice(None) else (w.start, w.stop)
        lo += start * stride
        hi += (stop - 1) * stride
    return lo, hi + item


def generate_module(module: ModuleOp, chip: Chip) -> dict[str, Program]:
    return {fn.sym_name.data: generate(module, fn, chip)
            for fn in module.ops if isinstance(fn, func.FuncOp)}

