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
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument, Operation, SSAValue

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
from toptpu.backend.formats.program import Program, Regions, TensorSpec, WeightSpec
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import cost_dtype, nbytes, op_flops
from toptpu.dialects import tpu
from toptpu.dialects.common import numpy_dtype, read_int, read_ints, shape_of
from toptpu.dialects.ir_text import print_generic
from toptpu.dialects.naming import input_names, op_name, output_names
from toptpu.passes.address_assign import regions_of
from toptpu.passes.lmem import group_template, result_addresses


class CodegenError(ValueError):
    """The IR is not ready for codegen (not grouped, allocated or addressed); the message
    names the pass to run."""


def _dtype(v: SSAValue) -> str:
    t = v.type
    return str(numpy_dtype(t.element_type))  # type: ignore[attr-defined]


@dataclass
class _Access:
    key: tuple
    lo: int
    hi: int
    cmd: int
    write: bool


class _Emitter:
    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        self.commands: list[Command] = []
        self.accesses: list[_Access] = []
        self.next_buf = 0

    def new_buf(self) -> int:
        self.next_buf += 1
        return self.next_buf

    def add(self, make: Callable[..., Command], reads: list[tuple], writes: list[tuple],
            **fields: Any) -> int:
        """The command `make(id=..., deps=..., **fields)`, its dependencies derived from the
        memory it reads and writes."""
        cid = len(self.commands)
        deps: set[int] = set()
        for is_write, accs in ((False, reads), (True, writes)):
            for key, lo, hi in accs:
                for a in self.accesses:
                    if a.key == key and a.lo < hi and lo < a.hi and (a.write or is_write):
                        deps.add(a.cmd)
        for is_write, accs in ((False, reads), (True, writes)):
            for key, lo, hi in accs:
                if is_write:  # a covering write supersedes older accesses of that range
                    self.accesses = [a for a in self.accesses
                                     if not (a.key == key and lo <= a.lo and a.hi <= hi)]
                self.accesses.append(_Access(key, lo, hi, cid, is_write))
        self.commands.append(make(id=cid, deps=tuple(sorted(deps)), **fields))
        return cid


def _global_ref(v: SSAValue, fn_inputs: dict[SSAValue, str], fn_outputs: dict[SSAValue, str],
                act: dict[SSAValue, int]) -> GlobalRef:
    if v in fn_inputs:
        return GlobalRef(Space.IO, fn_inputs[v])
    if v in fn_outputs:
        return GlobalRef(Space.IO, fn_outputs[v])
    owner = v.owner
    if isinstance(owner, tpu.WeightOp):
        return GlobalRef(Space.WEIGHT, owner.tensor_name)
    if isinstance(owner, tpu.ConstantOp):
        return GlobalRef(Space.CONST, offset=read_int(owner.attributes["tpu.const_offset"]))
    if v in act:
        return GlobalRef(Space.ACT, offset=act[v])
    raise CodegenError(f"no global home for {v.name_hint or v}: run address-assign")


def _gkey(ref: GlobalRef) -> tuple:
    return (ref.space, ref.name)


def generate(module: ModuleOp, fn: func.FuncOp, chip: Chip) -> Program:
    """Command streams for one grouped, allocated and addressed function."""
    block = fn.body.block
    ret = block.last_op
    assert isinstance(ret, func.ReturnOp)
    in_names = input_names(fn)
    out_names = output_names(fn)
    fn_inputs = dict(zip(block.args, in_names, strict=True))
    fn_outputs: dict[SSAValue, str] = {}
    for v, n in zip(ret.operands, out_names, strict=True):
        if v in fn_outputs or v in fn_inputs:
            raise CodegenError(f"output '{n}' repeats another input/output; return distinct values")
        fn_outputs[v] = n
    groups = [op for op in block.ops if isinstance(op, tpu.GroupOp)]
    act: dict[SSAValue, int] = {}
    for g in groups:
        gaddrs = read_ints(g.attributes.get("gaddrs"))
        if len(gaddrs) != len(g.outputs):
            raise CodegenError("run address-assign before codegen")
        for r, off in zip(g.outputs, gaddrs, strict=True):
            if off >= 0:
                act[r] = off
    # index every op of the grouped IR in walk order: compute commands refer to these
    op_index = {op: i for i, op in enumerate(fn.walk())}
    weights = {}
    for op in block.ops:
        if isinstance(op, tpu.WeightOp):
            weights[op.tensor_name] = WeightSpec(tuple(shape_of(op.output)), _dtype(op.output),
                                                 nbytes(op.output))
    em = _Emitter(chip)
    total_flops = 0
    for gi, g in enumerate(groups):
        total_flops += _emit_group(em, g, gi, chip, op_index, fn_inputs, fn_outputs, act)
    prog = Program(
        name=fn.sym_name.data,
        inputs=tuple(TensorSpec(n, tuple(shape_of(a)), _dtype(a))
                     for n, a in zip(in_names, block.args, strict=True)),
        outputs=tuple(TensorSpec(n, tuple(shape_of(v)), _dtype(v))
                      for n, v in zip(out_names, ret.operands, strict=True)),
        regions=Regions(**regions_of(fn)),
        weights=weights,
        commands=tuple(em.commands),
        ir=print_generic(module, debuginfo=True),
        flops=total_flops,
    )
    return prog


def _emit_group(em: _Emitter, g: tpu.GroupOp, gi: int, chip: Chip, op_index: dict,
                fn_inputs: dict, fn_outputs: dict, act: dict) -> int:
    loads, computes, stores = group_template(g)
    s = read_int(g.slices)
    outer = dict(zip(g.body.block.args, g.inputs, strict=True))
    store_target = dict(zip(g.body.block.last_op.operands, g.outputs, strict=True))  # type: ignore[union-attr]
    lmem = {}
    for op in [*loads, *computes]:
        if not read_ints(op.attributes.get("lmem")):
            raise CodegenError(f"{op_name(op)} has no local address: run layer-group")
        for r in op.results:
            lmem[r] = result_addresses(op, r, s > 1)
    per_lane = {v: chip.per_lane(nbytes(v)) for v in lmem}
    # buffer instance of (local value, slice): ids; and the command that reads it last
    inst: dict[tuple[SSAValue, int], int] = {}
    readers_left: dict[tuple[SSAValue, int], int] = {}
    uses_in_group = {v: sum(1 for u in v.uses if u.operation in computes or
                            isinstance(u.operation, tpu.StoreOp)) for v in lmem}
    resident = {ld.output for ld in loads if read_int(ld.slice_axis) == -1}

    def addr(v: SSAValue, i: int) -> int:
        a = lmem[v]
        return a[i % len(a)]

    def local_ref(v: SSAValue, i: int) -> LocalRef:
        key = (v, 0 if v in resident else i)
        return LocalRef(addr(v, i), tuple(shape_of(v)), _dtype(v), inst[key], nbytes(v))

    def lrange(v: SSAValue, i: int) -> tuple:
        a = addr(v, i)
        return ("L", None), a, a + per_lane[v]

    def consume(v: SSAValue, i: int, freed: list[int]) -> None:
        key = (v, 0 if v in resident else i)
        readers_left[key] -= 1
        if readers_left[key] == 0:
            freed.append(inst[key])

    def make(v: SSAValue, i: int) -> None:
        key = (v, 0 if v in resident else i)
        inst[key] = em.new_buf()
        n = uses_in_group[v] * (s if v in resident else 1)
        readers_left[key] = max(n, 1)

    def emit_load(ld: tpu.LoadOp, i: int) -> None:
        src = outer[ld.input]
        ref = _global_ref(src, fn_inputs, fn_outputs, act)
        ax = read_int(ld.slice_axis)
        full = list(shape_of(src))
        n = full[ax] // s if ax >= 0 else 0
        make(ld.output, i)
        # the whole tensor counts as read (today's dependency rule: a named tensor from 0)
        read = (_gkey(ref), ref.offset, ref.offset + nbytes(src)) if ref.space == Space.ACT \
            else (_gkey(ref), 0, nbytes(src))
        em.add(Load, [read], [lrange(ld.output, i)],
               name=op_name(ld) or "load", tensor=ref, shape=tuple(full), dtype=_dtype(src),
               axis=ax, start=i * n, length=n, local=local_ref(ld.output, i), group=gi,
               slice=i)

    def emit_compute(op: Operation, i: int) -> None:
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
            if isinstance(v, BlockArgument) and v in outer and v not in lmem:
                src = outer[v]  # a table read row by row from global memory
                ref = _global_ref(src, fn_inputs, fn_outputs, act)
                table, table_operand = TableRef(ref, tuple(shape_of(src)), _dtype(src)), k
                reads.append((_gkey(ref), ref.offset, ref.offset + nbytes(src)))
                continue
            ins.append(local_ref(v, i))
            reads.append(lrange(v, i))
        for v in op.operands:
            if v in lmem:
                consume(v, i, freed)
        outs = []
        for r in op.results:
            make(r, i)
            outs.append(local_ref(r, i))
        fields: dict[str, Any] = dict(
            name=op_name(op) or op.name, kind=op.name, op=op_index[op], ins=tuple(ins),
            outs=tuple(outs), flops=op_flops(op),  # the template op is slice-shaped already
            dtype=cost_dtype(op), free=tuple(freed), group=gi, slice=i,
            # results nothing reads die as soon as they are written
            free_after=tuple(o.buf for r, o in zip(op.results, outs, strict=True)
                             if uses_in_group[r] == 0))
        writes = [lrange(r, i) for r in op.results]
        if table is not None:
            em.add(Gather, reads, writes, table=table, table_operand=table_operand, **fields)
        else:
            em.add(Compute, reads, writes, **fields)

    def emit_store(st: tpu.StoreOp, i: int) -> None:
        dst = store_target[st.output]
        ref = _global_ref(dst, fn_inputs, fn_outputs, act)
        ax = read_int(st.slice_axis)
        full = list(shape_of(dst))
        n = full[ax] // s if ax >= 0 else 0
        freed: list[int] = []
        src = local_ref(st.input, i)
        consume(st.input, i, freed)
        glo = ref.offset if ref.space == Space.ACT else 0
        item = np.dtype(_dtype(dst)).itemsize
        if ax >= 0 and all(d == 1 for d in full[:ax]):
            inner = int(np.prod(full[ax + 1:])) * item
            lo, hi = glo + i * n * inner, glo + (i + 1) * n * inner
        else:
            lo, hi = glo, glo + nbytes(dst)
        em.add(Store, [lrange(st.input, i)], [(_gkey(ref), lo, hi)],
               name=op_name(st) or "store", tensor=ref, shape=tuple(full), dtype=_dtype(dst),
               axis=ax, start=i * n, length=n, local=src, free=tuple(freed), group=gi,
               slice=i)

    sliced_loads = [ld for ld in loads if ld.output not in resident]
    for ld in loads:
        if ld.output in resident:
            emit_load(ld, 0)
    for ld in sliced_loads:
        emit_load(ld, 0)
    for i in range(s):
        if i + 1 < s:
            for ld in sliced_loads:
                emit_load(ld, i + 1)
        for op in computes:
            emit_compute(op, i)
        if i >= 1:
            for st in stores:
                emit_store(st, i - 1)
    for st in stores:
        emit_store(st, s - 1)
    return s * sum(op_flops(op) for op in computes)  # each slice runs the slice-shaped ops


def generate_module(module: ModuleOp, chip: Chip) -> dict[str, Program]:
    return {fn.sym_name.data: generate(module, fn, chip)
            for fn in module.ops if isinstance(fn, func.FuncOp)}

