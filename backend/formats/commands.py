"""The machine's command records: what codegen (`toptpu.backend.codegen.streams`) writes and
the reference machine (`toptpu.backend.runtime.machine`) runs.

A net's program is a list of commands for its engines. The DMA engine runs `Load` (a global
tensor, or a slice of it along one axis, into a local buffer), `Store` (a local buffer into
a global tensor or a slice of it) and `Gather` (rows of a global table, picked by indices
in local memory, into a local buffer); the compute engine runs `Compute` (one op of the
net's grouped Tpu IR over local buffers); the link engine of a net that several devices run
together (tensor parallel) runs `Collective` (a `dev.*` op: a global tensor of every device
summed or gathered into a global tensor of every device, over the chip-to-chip link).
Every command names the commands it waits for (`deps`), the layer group and slice it
belongs to, and the local buffers it frees.

Operands: a `GlobalRef` names a global tensor by `Space` — `io` (a net input/output, bound
per call by name), `w` (a weight, by name), `act` (the net's activation region, at an
offset) or `const` (the net's constant pool, at an offset); a `LocalRef` is a local buffer:
its per-lane address, shape, dtype and buffer instance id (what the machine tracks as live).

The records are written to the model file as JSON with the program's `STREAM_SCHEMA`
version; a program of another version is refused (recompile the model). On load every
record is decoded by the header schema decoder (types, ranges, names, dtypes; the field
named in the error) and checked across fields (`check_command`).

`command_text` is the one-line text form of a command (`toptpu-opt -t commands`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, ClassVar, Literal

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from toptpu.backend.formats.header_schema import HeaderError, Name, OneOf, Range, join
from toptpu.backend.formats.llm_file import MAX_ELEMENTS, DType
from toptpu.backend.target.cost import expected_distinct, run_bytes
from toptpu.dialects.common import DTYPE_BY_NAME

#: the version of the command records; programs of another version are refused.
#: 1: dicts with keys `e`, `g`, `ax`, `sp`, ... (no version field); 2: these records;
#: 3: transfers cut along further axes (`Cut`), reduction parts of a compute (`k_part`).
#: 4: `Collective` added (a transfer between devices). 5: a load by index (`Load.index`).
#: 6: an indexed load's buffer may hold only the rows it fetches (fewer than the part's).
STREAM_SCHEMA = 6

Dim = Annotated[int, Range(0, MAX_ELEMENTS)]
Shape = tuple[Dim, ...]
#: an element type name as the cost model takes it (`bf16`, `f32`, ...)
ComputeType = Annotated[str, OneOf(tuple(DTYPE_BY_NAME), "element type")]


class Space(Enum):
    """Where a global operand lives."""

    IO = "io"  # a net input or output, bound per call by name
    WEIGHT = "w"  # a weight, by name (a per-layer net binds its layer's chunk)
    ACT = "act"  # the net's activation region, at an offset
    CONST = "const"  # the net's constant pool, at an offset


NAMED_SPACES = (Space.IO, Space.WEIGHT)


@dataclass(frozen=True)
class GlobalRef:
    """A global tensor: by name (io, w) or by offset in the net's region (act, const)."""

    space: Space
    name: Name | None = None
    offset: int = 0

    def __str__(self) -> str:
        if self.space in NAMED_SPACES:
            return f"{self.space.value}:{self.name}"
        return f"{self.space.value}+{self.offset}"


@dataclass(frozen=True)
class LocalRef:
    """A local buffer: per-lane address, shape, dtype, instance id and size in bytes."""

    addr: int
    shape: Shape
    dtype: DType
    buf: Annotated[int, Range(1)]
    nbytes: int

    def __str__(self) -> str:
        return f"L{self.addr}#{self.buf}"


@dataclass(frozen=True)
class TableRef:
    """A gather's table, read row by row from global memory."""

    tensor: GlobalRef
    shape: Shape
    dtype: DType


@dataclass(frozen=True, kw_only=True)
class _Command:
    id: int
    name: str  # the tensor it moves or computes (its op's name in the IR)
    deps: tuple[int, ...]  # commands that must finish before this one starts
    group: int  # its layer group
    slice: int  # the slice of that group

    engine: ClassVar[str]  # "dma" or "cmp"


@dataclass(frozen=True)
class Cut:
    """A transfer's part along one more axis: `length` elements from `start`."""

    axis: Annotated[int, Range(0)]
    start: Annotated[int, Range(0)]
    length: Annotated[int, Range(1)]


@dataclass(frozen=True, kw_only=True)
class _Transfer(_Command):
    tensor: GlobalRef  # the whole global tensor
    shape: Shape  # its shape
    dtype: DType
    axis: Annotated[int, Range(-1)]  # the axis sliced; -1: the whole tensor
    start: int = 0  # the slice along `axis`
    length: int = 0
    #: the other axes the part is cut along (a strided transfer: a 2-D tile's block of
    #: rows of a block of output channels, a reduction part of a weight's channels)
    cuts: tuple[Cut, ...] = ()
    local: LocalRef  # the local buffer written (load) or read (store)

    engine: ClassVar[str] = "dma"
    flops: ClassVar[int] = 0

    @property
    def nbytes(self) -> int:
        """Bytes moved."""
        return self.local.nbytes

    def window(self) -> tuple[slice, ...]:
        """The index of the part moved in the whole tensor."""
        index = [slice(None)] * len(self.shape)
        if self.axis >= 0:
            index[self.axis] = slice(self.start, self.start + self.length)
        for c in self.cuts:
            index[c.axis] = slice(c.start, c.start + c.length)
        return tuple(index)

    def part_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.axis >= 0:
            shape[self.axis] = self.length
        for c in self.cuts:
            shape[c.axis] = c.length
        return tuple(shape)

    @property
    def run(self) -> int:
        """Bytes of each contiguous run its window makes in the global tensor (the DDR
        moves whole bursts of each: `cost.ddr_bytes`)."""
        return run_bytes(self.shape, self.part_shape(), np.dtype(self.dtype).itemsize)


_SHARD0 = re.compile(r"@shard0-(\d+)(?![0-9])")


def _device_share(name: str | None) -> int:
    """How many devices share a tensor's rows: N for a weight cut along axis 0 in N
    pieces (`toptpu.dialects.sharding.shard_name`; a derived tensor keeps the cut in its
    name), else 1."""
    m = _SHARD0.search(name or "")
    return int(m.group(1)) if m else 1


@dataclass(frozen=True, kw_only=True)
class Load(_Transfer):
    """DMA: global tensor (or a slice of it) -> local buffer.

    With `index` (an indexed load, `tpu.load` `by_index`: a MoE layer's experts): the
    local buffer holds the part's rows along axis 0 as the tensor does, but only the rows
    the integers in the local buffer `index` name are read from global memory, each once
    (negative entries name none); the others are zero. What it moves depends on the
    indices: `nbytes` is the modelled count (`cost.expected_distinct` of the index's
    [T, k]: exactly k rows for one token), the machine records the rows it really read."""

    cmd: Literal["load"] = "load"
    index: LocalRef | None = None

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (along axis 0) of the part moved (its buffer holds all the
        part's rows, or with `index` possibly fewer: the fetched ones)."""
        return self.local.nbytes // max(self.local.shape[0], 1)

    @property
    def all_nbytes(self) -> int:
        """Bytes of the whole part: what it moves without an index, or if every row
        moved (its buffer may hold fewer rows: the fetched ones)."""
        return self.row_nbytes * self.part_shape()[0] if self.index is not None \
            else self.local.nbytes

    @property
    def part_first_row(self) -> int:
        """The first row along axis 0 of the part moved (0 unless it cuts axis 0: a block
        of experts)."""
        start = self.window()[0].start
        return 0 if start is None else int(start)

    @property
    def nbytes(self) -> int:
        """Bytes moved: the whole part, or (by index) the modelled rows of it."""
        if self.index is None:
            return self.local.nbytes
        shape = self.index.shape
        tokens = numel(shape[:-1]) if len(shape) > 1 else 1
        whole, share = self.shape[0], _device_share(self.tensor.name)
        # one device's share of experts cut over `share` devices (`W@shard0-<N>`, expert
        # parallelism): the tokens pick among all whole x share rows, this device moves
        # its expected part of them; a part of the rows (a block of experts) its share
        rows = expected_distinct(whole * share, tokens, shape[-1] if shape else 1) / share
        return round(rows * self.part_shape()[0] / whole * self.row_nbytes)

    @property
    def run(self) -> int:
        """An indexed load's runs: at most one row's part."""
        whole = super().run
        return min(whole, self.row_nbytes) if self.index is not None else whole


@dataclass(frozen=True, kw_only=True)
class Store(_Transfer):
    """DMA: local buffer -> global tensor (or a slice of it); frees `free` afterwards."""

    cmd: Literal["store"] = "store"
    free: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class _OpCommand(_Command):
    op: int  # index of the template op among the grouped IR's ops (walk order)
    kind: Name  # that op's name (`tpu.matmul`)
    ins: tuple[LocalRef | None, ...]  # None: an absent optional operand
    outs: tuple[LocalRef, ...]
    flops: int
    dtype: ComputeType  # the type its throughput is costed at
    free: tuple[int, ...] = ()  # buffers freed once its inputs are read
    free_after: tuple[int, ...] = ()  # results nothing reads: freed once written


@dataclass(frozen=True, kw_only=True)
class Compute(_OpCommand):
    """Compute engine: one op over local buffers.

    A reduction split in `parts` (a layer group's matmul over parts of K, an attention over
    parts of its keys) runs one command per part, in order: each folds its part into the
    f32 accumulator `acc` (the first writes it, the others read and write it); the last
    also reads it to write the op's result (`outs`, empty before) and frees it."""

    cmd: Literal["compute"] = "compute"
    part: Annotated[int, Range(0)] = 0
    parts: Annotated[int, Range(1)] = 1
    acc: LocalRef | None = None

    @property
    def last_part(self) -> bool:
        return self.part == self.parts - 1

    engine: ClassVar[str] = "cmp"
    nbytes: ClassVar[int] = 0


@dataclass(frozen=True, kw_only=True)
class Gather(_OpCommand):
    """DMA: rows of a global table into a local buffer (`tpu.gather`); the table is the
    op's operand number `table_operand`, `ins` its other operands."""

    cmd: Literal["gather"] = "gather"
    table: TableRef
    table_operand: int

    engine: ClassVar[str] = "dma"

    @property
    def nbytes(self) -> int:
        """Bytes moved: the rows gathered."""
        return sum(o.nbytes for o in self.outs)

    @property
    def run(self) -> int:
        """Bytes of each contiguous run it reads: one row of the table."""
        return numel(self.table.shape[1:]) * np.dtype(self.table.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class Collective(_Command):
    """Link engine: the collective `op` (index of its `dev.*` op among the net's ops, as a
    compute's) over the `devices` devices running the net, moved by `algorithm`: every
    device's `src` (a global tensor) summed (`all_reduce`) or concatenated along `axis` in
    device order (`all_gather`) into every device's `dst`."""

    cmd: Literal["collective"] = "collective"
    op: int
    kind: Literal["all_reduce", "all_gather"]
    algorithm: Literal["ring", "tree"]
    devices: Annotated[int, Range(2, 1024)]
    axis: Annotated[int, Range(0)] = 0
    src: GlobalRef
    src_shape: Shape
    dst: GlobalRef
    dst_shape: Shape
    dtype: DType
    flops: int = 0  # the adds one device makes

    engine: ClassVar[str] = "link"

    @property
    def nbytes(self) -> int:
        """The bytes of the tensor every device holds at the end (`dst`)."""
        return numel(self.dst_shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class PeerCopy:
    """A DMA to another device: `nbytes` from device `src_device`'s global memory at
    `src_addr` into device `dst_device`'s at `dst_addr`, over the chip-to-chip link. Not
    part of a net's stream: the device group issues it between nets (the hidden state from
    one pipeline stage to the next, device 0's embedding to the others)."""

    name: str
    src_device: int
    src_addr: int
    dst_device: int
    dst_addr: int
    nbytes: int


Command = Load | Store | Gather | Compute | Collective
Transfer = Load | Store


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _check_local(ref: LocalRef, where: str) -> None:
    need = numel(ref.shape) * np.dtype(ref.dtype).itemsize
    if ref.nbytes != need:
        raise HeaderError(join(where, "nbytes"), f"is {ref.nbytes}, {ref.dtype} "
                                                 f"{list(ref.shape)} takes {need}")
    if numel(ref.shape) > MAX_ELEMENTS:
        raise HeaderError(join(where, "shape"), f"has more than {MAX_ELEMENTS} elements")


def _check_global(ref: GlobalRef, where: str) -> None:
    named = ref.space in NAMED_SPACES
    if named != (ref.name is not None):
        raise HeaderError(join(where, "name"),
                          f"must be {'given' if named else 'absent'} in space "
                          f"'{ref.space.value}'")
    if named and ref.offset:
        raise HeaderError(join(where, "offset"), f"must be 0 in space '{ref.space.value}' "
                                                 "(its tensors are bound by name)")


def check_command(c: Command, index: int, where: str) -> None:
    """The checks across fields of one decoded command (its types were checked while
    decoding); `index` is its place in the program."""
    if c.id != index:
        raise HeaderError(join(where, "id"), f"is {c.id}, not its place {index}")
    if list(c.deps) != sorted(set(c.deps)) or any(d >= c.id for d in c.deps):
        raise HeaderError(join(where, "deps"), f"are {list(c.deps)[:8]}, not increasing ids "
                                               "of earlier commands")
    if isinstance(c, Load | Store):
        _check_global(c.tensor, join(where, "tensor"))
        _check_local(c.local, join(where, "local"))
        if c.axis >= len(c.shape):
            raise HeaderError(join(where, "axis"), f"is {c.axis}, the tensor has "
                                                   f"{len(c.shape)} axes")
        if c.axis >= 0 and not (c.length >= 1 and c.start + c.length <= c.shape[c.axis]):
            raise HeaderError(join(where, "length"),
                              f"slice [{c.start}, {c.start + c.length}) is outside an axis "
                              f"of {c.shape[c.axis]}")
        if c.cuts and c.axis < 0:
            raise HeaderError(join(where, "cuts"), "need a sliced axis (axis is -1)")
        seen = {c.axis}
        for i, cut in enumerate(c.cuts):
            at = join(join(where, "cuts"), i)
            if cut.axis >= len(c.shape) or cut.axis in seen:
                raise HeaderError(join(at, "axis"), f"is {cut.axis}: not another axis of "
                                                    f"the {len(c.shape)} of the tensor")
            if cut.start + cut.length > c.shape[cut.axis]:
                raise HeaderError(join(at, "length"),
                                  f"slice [{cut.start}, {cut.start + cut.length}) is outside "
                                  f"an axis of {c.shape[cut.axis]}")
            seen.add(cut.axis)
        part = c.part_shape()
        fetched = (isinstance(c, Load) and c.index is not None and len(part) > 1
                   and len(c.local.shape) == len(part) and c.local.shape[1:] == part[1:]
                   and 1 <= c.local.shape[0] < part[0])  # a buffer of the fetched rows
        if (numel(part) != numel(c.local.shape) and not fetched) or c.dtype != c.local.dtype:
            raise HeaderError(join(where, "local"),
                              f"is {c.local.dtype} {list(c.local.shape)}, the part moved is "
                              f"{c.dtype} {list(c.part_shape())}")
        if isinstance(c, Load) and c.index is not None:
            _check_local(c.index, join(where, "index"))
            if np.dtype(c.index.dtype).kind not in "iu":
                raise HeaderError(join(join(where, "index"), "dtype"),
                                  f"is {c.index.dtype}; indices are integers")
            # (a part along axis 0 is a block of rows: of those only the picked ones move)
            if not c.shape:
                raise HeaderError(join(where, "index"), "an indexed load picks rows along "
                                                        "axis 0, which its tensor must have")
        return
    if isinstance(c, Collective):
        _check_global(c.src, join(where, "src"))
        _check_global(c.dst, join(where, "dst"))
        want = list(c.src_shape)
        if c.kind == "all_gather":
            if c.axis >= len(want):
                raise HeaderError(join(where, "axis"), f"is {c.axis}, the tensor has "
                                                       f"{len(want)} axes")
            want[c.axis] *= c.devices
        if list(c.dst_shape) != want:
            raise HeaderError(join(where, "dst_shape"),
                              f"is {list(c.dst_shape)}, a {c.kind} of {list(c.src_shape)} over "
                              f"{c.devices} devices gives {want}")
        for key, shape in (("src_shape", c.src_shape), ("dst_shape", c.dst_shape)):
            if numel(shape) > MAX_ELEMENTS:
                raise HeaderError(join(where, key), f"has more than {MAX_ELEMENTS} elements")
        return
    for i, ref in enumerate(c.ins):
        if ref is not None:
            _check_local(ref, join(join(where, "ins"), i))
    for i, ref in enumerate(c.outs):
        _check_local(ref, join(join(where, "outs"), i))
    if isinstance(c, Compute):
        if c.part >= c.parts:
            raise HeaderError(join(where, "part"), f"is {c.part}, not one of {c.parts} parts")
        if (c.acc is not None) != (c.parts > 1):
            raise HeaderError(join(where, "acc"), "must be given exactly when the compute "
                                                  "has more than one part")
        if c.acc is not None:
            _check_local(c.acc, join(where, "acc"))
            if c.acc.dtype != "float32":
                raise HeaderError(join(join(where, "acc"), "dtype"),
                                  f"is {c.acc.dtype}, an accumulator is float32")
            if bool(c.outs) != c.last_part:
                raise HeaderError(join(where, "outs"), "a reduction writes its result at "
                                                       "its last part only")
    if isinstance(c, Gather):
        _check_global(c.table.tensor, join(join(where, "table"), "tensor"))
        if c.table_operand > len(c.ins):
            raise HeaderError(join(where, "table_operand"),
                              f"is {c.table_operand}, the op has {len(c.ins) + 1} operands")


# ------------------------------------------------------------------ text form


def _shape(shape: tuple[int, ...], dtype: str) -> str:
    return "x".join(map(str, (*shape, np.dtype(dtype).name))) if shape else np.dtype(
        dtype).name


def _deps(c: Command) -> str:
    return "[" + ",".join(map(str, c.deps)) + "]"


def _freed(c: Command) -> str:
    free = [*getattr(c, "free", ()), *getattr(c, "free_after", ())]
    return f" free=#{',#'.join(map(str, free))}" if free else ""


def command_text(c: Command) -> str:
    """One line: id, engine, what it does, the global tensor (with the slice moved) or the
    op's result, shape, local addresses, group.slice, deps and freed buffers. For example
    `4 dma load w:fc.weight 32x64xfloat32 [0:16,:] -> L1024#3 g1.s0 deps=[1]`."""
    head = f"{c.id:>4} {c.engine:<3} "
    if isinstance(c, Load | Store):
        what = ",".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in c.window())
        sl = f"[{what}]" if c.axis >= 0 else "[all]"
        arrow = f"-> {c.local}" if isinstance(c, Load) else f"<- {c.local}"
        if isinstance(c, Load) and c.index is not None:  # e.g. `by L3328#11`
            sl += f" by {c.index}"
        return (f"{head}{c.cmd:<8} {c.tensor} {_shape(c.shape, c.dtype)} {sl} {arrow} "
                f"g{c.group}.s{c.slice} deps={_deps(c)}{_freed(c)}")
    if isinstance(c, Collective):
        how = f"{c.kind} {c.algorithm}" + (f" axis={c.axis}" if c.kind == "all_gather" else "")
        return (f"{head}{how} x{c.devices} {c.name} {c.dst} {_shape(c.dst_shape, c.dtype)} <- "
                f"{c.src} {_shape(c.src_shape, c.dtype)} deps={_deps(c)}")
    args = [str(r) if r is not None else "-" for r in c.ins]
    if isinstance(c, Gather):
        args.insert(c.table_operand, str(c.table.tensor))
    outs = ",".join(str(o) for o in c.outs)
    shapes = ",".join(_shape(o.shape, o.dtype) for o in c.outs)
    part = ""
    if isinstance(c, Compute) and c.acc is not None:  # e.g. `part 1/4 acc L512#9`
        part = f" part {c.part}/{c.parts} acc {c.acc}"
        if not c.outs:
            shapes, outs = _shape(c.acc.shape, c.acc.dtype), str(c.acc)
    return (f"{head}{c.kind.removeprefix('tpu.'):<8} {c.name} {shapes} ({', '.join(args)}) "
            f"-> {outs}{part} g{c.group}.s{c.slice} deps={_deps(c)}{_freed(c)}")
