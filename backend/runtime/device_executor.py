"""The device-group executor: a multi-device model file on one reference machine per device.

It implements `toptpu.backend.runtime.executor.Executor` over a model file spread over N
devices (the header's `parallel` section, `toptpu.backend.formats.llm_file.ParallelInfo`), so
the runtime's generation loop runs unchanged:

- every device is a `Machine` with its own global memory (`Chip.ddr_bytes`), local memory
  and weight cache; device d maps only its own weight blob (section `weights:<d>`);
- a net runs on the devices the header gives it (`ParallelInfo.runners`): the embeddings on
  device 0; a tensor-parallel net on all devices together (`machine.run_together`: each
  device its program copy, weights and pieces of the IO, the collectives on the link); a
  pipeline stage's per-layer net on the device that holds the layer;
- a buffer the runtime allocates (`DeviceBuffer`) is a logical tensor with a part on each
  device that binds it, placed at its first binding: the whole tensor, or for an IO the net
  cuts over the devices (`ParallelInfo.splits`: the KV cache by heads, the logits by
  vocabulary) the device's piece. The executor tracks which devices hold a buffer's current
  value; a net that reads a buffer on a device whose part is stale first receives it from
  one that holds it: a **peer copy** (`PeerCopy`, a DMA to another device's global memory
  over the chip-to-chip link), so the hidden state is sent from one pipeline stage to the
  next, and device 0's embedding to the others under tensor parallelism;
- the host writes a buffer into every device part it has (one host transfer each) and
  reads it from a device that holds it (a cut buffer: its pieces from the devices);
- the modelled time is one schedule: the runtime waits for each operation, so a step's
  time is the sum of its net runs (a multi-device run's timeline, collectives included),
  peer copies (link time: `toptpu.backend.target.link`, one `send` each) and host
  transfers (`Ledger`).

Traps as the one-device machine's, plus a peer copy to a device that does not exist or into
memory the peer has not allocated (`DeviceGroup.copy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from toptpu.backend.contract import TensorSpec
from toptpu.backend.formats.commands import PeerCopy
from toptpu.backend.formats.llm_file import LlmFile, WeightLayout
from toptpu.backend.formats.model_file import ModelFileError
from toptpu.backend.runtime.accounting import Costs, Ledger
from toptpu.backend.runtime.executor import Buffer, check_bindings, owned, value_for
from toptpu.backend.runtime.machine import (
    Binding,
    LoadedNet,
    Machine,
    MachineTrap,
    run_together,
)
from toptpu.backend.runtime.machine_executor import (
    MachineBuffer,
    MachineExecutor,
    MachineExecutorError,
    NetStats,
)
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.weight_pages import WeightPages
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.backend.target.link import LinkWork, collective_seconds
from toptpu.dialects.sharding import Split, piece_of, take_piece


class DeviceGroup:
    """The machines of one deployment and the copies between them."""

    def __init__(self, machines: list[Machine]) -> None:
        self.machines = machines

    def copy(self, c: PeerCopy) -> None:
        """Execute a peer copy: `nbytes` from device `src_device`'s global memory at
        `src_addr` into device `dst_device`'s at `dst_addr`. A device that does not exist, a
        source outside the sender's mapped memory or a destination the peer has not
        allocated traps."""
        n = len(self.machines)
        for what, d in (("from", c.src_device), ("to", c.dst_device)):
            if not 0 <= d < n:
                raise MachineTrap(f"{c.name}: a transfer {what} device {d}, which does not "
                                  f"exist ({n} devices)")
        src = self.machines[c.src_device].gmem
        dst = self.machines[c.dst_device].gmem
        r, off = src.find(c.src_addr, c.nbytes, f"{c.name} (device {c.src_device})")
        try:
            w, woff = dst.find(c.dst_addr, c.nbytes, c.name)
        except MachineTrap:
            raise MachineTrap(f"{c.name}: a transfer into memory device {c.dst_device} has "
                              f"not allocated ([{c.dst_addr}, {c.dst_addr + c.nbytes}))"
                              ) from None
        if not w.writable:
            raise MachineTrap(f"{c.name}: write to read-only region '{w.name}' of device "
                              f"{c.dst_device}")
        w.data[woff:woff + c.nbytes] = r.data[off:off + c.nbytes]


@dataclass(eq=False)
class _Root:
    """A logical tensor and its parts on the devices."""

    shape: tuple[int, ...]
    dtype: np.dtype
    split: Split | None = None  # how its parts are cut (fixed at its first placement)
    parts: dict[int, MachineBuffer] = field(default_factory=dict)
    valid: set[int] = field(default_factory=set)  # the devices whose part is current
    written: bool = False  # a value was written (before: zeros everywhere)
    pending: np.ndarray | None = None  # the value the host wrote, until a net writes it
    placed: bool = False


@dataclass
class DeviceBuffer:
    """A buffer of the device group: a logical tensor, or a slot of one (`slot`)."""

    root: _Root
    shape: tuple[int, ...]
    dtype: np.dtype
    slots: tuple[tuple[int, int, int], ...] = ()  # (axis, start, length), applied in order

    def slot(self, axis: int, start: int, length: int) -> DeviceBuffer:
        if any(d != 1 for d in self.shape[:axis]):
            raise MachineExecutorError(
                f"slot along axis {axis} of a {list(self.shape)} buffer is not contiguous")
        if not (0 <= start and length >= 0 and start + length <= self.shape[axis]):
            raise MachineExecutorError(f"slot [{start}:{start + length}] along axis {axis} is "
                                       f"outside a buffer of shape {list(self.shape)}")
        shape = list(self.shape)
        shape[axis] = length
        return DeviceBuffer(self.root, tuple(shape), self.dtype,
                            (*self.slots, (axis, start, length)))

    @property
    def whole(self) -> bool:
        return not self.slots

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def window(self) -> tuple[slice, ...]:
        """Where the buffer lies in its root's tensor."""
        index = [slice(None)] * len(self.root.shape)
        for axis, start, length in self.slots:
            base = index[axis].start or 0
            index[axis] = slice(base + start, base + start + length)
        return tuple(index)

    def part(self, device: int) -> MachineBuffer:
        """The buffer on `device` (its piece of a cut root)."""
        buf = self.root.parts[device]
        for axis, start, length in self.slots:
            if self.root.split is not None and axis == self.root.split.axis:
                raise MachineExecutorError("a slot along the axis a buffer is cut along")
            buf = buf.slot(axis, start, length)
        return buf


class DeviceGroupExecutor(MachineExecutor):
    """Runs a multi-device model file on one machine per device (see the module doc)."""

    def __init__(self, model: str | LlmFile, checked: bool = False,
                 chip: Chip | None = None, keep_timelines: int = 4,
                 weight_cache_bytes: int | None = None,
                 stream_weights: bool | None = None) -> None:
        self.file = model if isinstance(model, LlmFile) else LlmFile(model)
        self.meta = self.file.meta
        self.header: dict[str, Any] = self.file.header
        par = self.meta.parallel
        if par is None:
            raise MachineExecutorError(f"'{self.file.path}' is a one-device model file; run "
                                       "it with the machine executor")
        self.parallel = par
        self.n = len(par.devices)
        #: how a tensor-parallel net's IO is cut (by net and IO name)
        self.splits = {net: {io: Split(c.axis, c.pieces) for io, c in cuts.items()}
                       for net, cuts in par.splits.items()}
        self.chip = chip or get_chip(self.meta.chip)
        sections = [self.file.file.sections[dev.weights.section] for dev in par.devices]
        #: where each device's weight blob starts in the file (what `ModelFile.release` takes)
        self._blobs_at = [section.offset for section in sections]
        #: the weight pages released after each run when streaming (`weight_pages`): every
        #: device's blob is mapped in this one process, so their sum decides, and the
        #: converted-weight budget is split over the devices
        self.pages = WeightPages(self.file.file, sum(section.size for section in sections),
                                 stream_weights)
        budget = self.pages.cache_budget(weight_cache_bytes)
        self.machines = [Machine(self.chip, checked, budget // self.n) for _ in range(self.n)]
        self.machine = self.machines[0]
        self.group = DeviceGroup(self.machines)
        self.keep_timelines = keep_timelines
        self._nets = self.file.net_infos()
        self._blobs = []
        for d, dev in enumerate(par.devices):
            blob = np.frombuffer(self.file.file.view(dev.weights.section), np.uint8)
            self._blobs.append(self.machines[d].gmem.map(dev.weights.section, blob,
                                                         writable=False).base)
        self._programs = {}
        for net in self._nets:  # every stream decoded and checked against the header now
            self._programs[net] = self._decode(net)
        self._loaded: dict[str, LoadedNet] = {}
        self._dev_act: dict[tuple[str, int], int] = {}
        self._dev_const: dict[tuple[str, int], int] = {}
        self.stats: dict[str, NetStats] = {}
        self.ledger = Ledger(self.chip)
        self.recorder: RunRecorder | None = None
        self.peer_copies = 0

    # ------------------------------------------------------------------ Executor
    def alloc(self, shape: tuple[int, ...], dtype: str) -> Buffer:
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        return DeviceBuffer(_Root(shape, dt), shape, dt)

    def write(self, buf: Buffer, value: np.ndarray) -> None:
        """Write every part the buffer has (one host transfer each); the host keeps the
        value too (`_Root.pending`: a device that binds the buffer later gets it from the
        host) until a net writes the buffer."""
        mine = owned(buf, DeviceBuffer, MachineExecutorError)
        value = value_for(mine, value, MachineExecutorError)
        root = mine.root
        if root.pending is None and (not root.placed or mine.whole):
            root.pending = np.zeros(root.shape, root.dtype)
        if root.pending is not None:
            root.pending[mine.window()] = value
        root.written = True
        for d in sorted(root.parts):
            piece = value if root.split is None else take_piece(value, root.split, d, self.n)
            mine.part(d).array(write=True)[...] = piece
            self._transfer(int(piece.nbytes), to_chip=True)
        if mine.whole:
            root.valid = set(root.parts)

    def read(self, buf: Buffer) -> np.ndarray:
        mine = owned(buf, DeviceBuffer, MachineExecutorError)
        root = mine.root
        if not root.placed:
            whole = root.pending if root.pending is not None else \
                np.zeros(root.shape, root.dtype)
            return np.array(whole[mine.window()])
        if root.split is None:
            d = min(root.valid)
            self._transfer(mine.nbytes, to_chip=False)
            return mine.part(d).array().copy()
        pieces = []
        for k in range(root.split.pieces):
            d = min(d for d in root.valid if piece_of(d, self.n, root.split.pieces) == k)
            part = mine.part(d).array().copy()
            self._transfer(int(part.nbytes), to_chip=False)
            pieces.append(part)
        return np.concatenate(pieces, axis=root.split.axis)

    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        info = self._nets.get(net)
        if info is None:
            raise MachineExecutorError(f"the model has no net '{net}' (it has "
                                       f"{sorted(self._nets)})")
        self.file.file.check_unchanged()
        if info.per_layer:
            if layer is None or not 0 <= layer < self.meta.model.num_layers:
                raise MachineExecutorError(f"net '{net}' is per layer: pass layer= in "
                                           f"0..{self.meta.model.num_layers - 1}")
        elif layer is not None:
            raise MachineExecutorError(f"net '{net}' is shared by all layers; run it "
                                       "without layer=")
        devs = self.parallel.runners(net, layer)
        if not devs:
            raise MachineExecutorError(f"no device runs net '{net}'"
                                       + (f" for layer {layer}" if layer is not None else ""))
        check_bindings(net, info, bindings, lambda b: isinstance(b, DeviceBuffer),
                       MachineExecutorError)
        bindings = cast(Mapping[str, DeviceBuffer], bindings)  # checked just above
        splits = self.splits.get(net, {})
        for spec in info.inputs:
            self._place(bindings[spec.name], devs, splits.get(spec.name), spec, read=True)
        for spec in info.outputs:
            self._place(bindings[spec.name], devs, splits.get(spec.name), spec, read=False)
        loaded = self._load(net)
        binds = []
        for d in devs:
            io = {s.name: bindings[s.name].part(d).addr for s in (*info.inputs, *info.outputs)}
            weights = self._device_weights(net, loaded, d, layer)
            binds.append(Binding(io, weights, self._dev_act[net, d], self._dev_const[net, d]))
        try:
            if len(devs) == 1:
                tl = self.machines[devs[0]].run(loaded, binds[0])
            else:
                tl = run_together([self.machines[d] for d in devs], loaded, binds)
        finally:
            for d in devs:
                self._release_device_weights(net, loaded, d, layer)
        for spec in info.outputs:
            buf = bindings[spec.name]
            root = buf.root
            root.written, root.pending = True, None  # the host's copy is stale now
            root.valid = set(devs) if buf.whole else root.valid & set(devs)
        self._account(net, layer, tl)

    def modelled_costs(self) -> Costs:
        return self.ledger.totals

    # ------------------------------------------------------------------ placement
    def _place(self, buf: DeviceBuffer, devs: list[int], split: Split | None,
               spec: TensorSpec, read: bool) -> None:
        """Give `buf` a part on each of `devs` (cut by `split`), current there when the net
        reads it: the host's value, or a peer copy from a device that holds it."""
        root = buf.root
        if not root.placed:
            root.split, root.placed = split, True
        elif root.split != split:
            raise MachineExecutorError(f"'{spec.name}' is bound to a buffer cut "
                                       f"{_cut(root.split)}, net input/output '{spec.name}' "
                                       f"is {_cut(split)}")
        for d in devs:
            if d not in root.parts:
                shape = root.shape if split is None else split.part_shape(root.shape)
                nb = int(np.prod(shape, dtype=np.int64)) * root.dtype.itemsize
                m = self.machines[d]
                region = m.gmem.alloc(f"buffer{len(m.gmem.regions)}", nb)
                root.parts[d] = MachineBuffer(m, region.base, shape, root.dtype)
                if root.pending is not None:  # the host's value goes to the new part
                    piece = root.pending if split is None else \
                        take_piece(root.pending, split, d, self.n)
                    root.parts[d].array(write=True)[...] = piece
                    self._transfer(int(piece.nbytes), to_chip=True)
                    root.valid.add(d)
                elif not root.written:
                    root.valid.add(d)  # zeros, as everywhere
            if read and d not in root.valid:
                self._receive(root, d, spec.name)

    def _receive(self, root: _Root, d: int, name: str) -> None:
        """Bring device d's part of `root` up to date from a device that holds it (the
        same piece of a cut one): one peer copy over the link."""
        pieces = root.split.pieces if root.split is not None else 1
        want = piece_of(d, self.n, pieces)
        src = next((e for e in sorted(root.valid) if piece_of(e, self.n, pieces) == want),
                   None)
        if src is None:
            raise MachineExecutorError(f"'{name}': no device holds its current value")
        a, b = root.parts[src], root.parts[d]
        self.group.copy(PeerCopy(name=f"send {name}", src_device=src, src_addr=a.addr,
                                 dst_device=d, dst_addr=b.addr, nbytes=a.nbytes))
        self.peer_copies += 1
        start = self.ledger.totals.total_s
        costs = self.ledger.peer(a.nbytes, collective_seconds(
            self.chip, LinkWork("send", "tree", 2, a.nbytes)))
        if self.recorder is not None:
            self.recorder.peer(src, d, a.nbytes, start, costs)
        root.valid.add(d)

    # ------------------------------------------------------------------ nets
    def _check_joins(self, net: str, loaded: LoadedNet) -> None:
        """`MachineExecutor.prepare` checks no join here: each device's machine checks
        its own in the net's first run."""

    def _load(self, net: str) -> LoadedNet:
        if net not in self._loaded:
            prog = self._programs[net]
            try:
                loaded = LoadedNet(prog, net)
            except (MachineTrap, ValueError) as e:
                raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' "
                                     f"is unusable: {e}; recompile the model") from None
            self._check_attention(net, loaded)
            runners = self.parallel.runners(net)
            if loaded.devices not in (None, len(runners)):
                raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' "
                                     f"joins {loaded.devices} devices in collectives, "
                                     f"{len(runners)} run it; recompile the model")
            pool = self.file.file.read(self.meta.nets[net].consts)
            for d in runners:
                gmem = self.machines[d].gmem
                self._dev_act[net, d] = gmem.alloc(f"act:{net}",
                                                   prog.regions.activations).base
                r = gmem.alloc(f"const:{net}", len(pool))
                r.data[:len(pool)] = np.frombuffer(pool, np.uint8)
                self._dev_const[net, d] = r.base
            self._loaded[net] = loaded
        return self._loaded[net]

    def _device_weights(self, net: str, loaded: LoadedNet, d: int, layer: int | None
                        ) -> dict[str, int]:
        dev = self.parallel.devices[d]
        layout, base = dev.weights, self._blobs[d]
        out = {}
        for name in loaded.program.weights:
            if layer is not None and name in layout.chunk_of(layer - dev.first_layer):
                out[name] = base + layout.layer_offset(layer - dev.first_layer, name)
            elif name in layout.shared:
                out[name] = base + layout.shared[name].offset
            else:
                raise ModelFileError(f"'{self.file.path}': net '{net}' reads weight '{name}', "
                                     f"which device {d}'s weight table does not have")
        return out

    def _release_device_weights(self, net: str, loaded: LoadedNet, d: int,
                                layer: int | None) -> None:
        """Release the mapped pages of the weights device `d` read in a run of `net` at
        `layer` (when streaming: `WeightPages`, as the one-device machine)."""
        def extents() -> list[tuple[int, int]]:
            weights = self._device_weights(net, loaded, d, layer)
            return [(self._blobs_at[d] + a - self._blobs[d],
                     loaded.program.weights[n].nbytes) for n, a in weights.items()]

        self.pages.release((net, d, layer), extents)

    # ------------------------------------------------------------------ checks (hooks)
    def _heads(self, net: str) -> tuple[int, int, str]:
        m = self.meta.model
        if self.parallel.strategy != "tp" or self.meta.nets[net].per_layer is False:
            return super()._heads(net)
        n = self.n
        kv_pieces = n if m.num_kv_heads % n == 0 else m.num_kv_heads
        heads, kv = m.num_heads // n, m.num_kv_heads // kv_pieces
        return heads, kv, (f"a device's {heads} query and {kv} KV heads (model.num_heads "
                           f"{m.num_heads}, model.num_kv_heads {m.num_kv_heads} over {n} "
                           "devices)")

    def _expected_io(self, net: str, key: str) -> tuple[TensorSpec, ...]:
        splits = self.splits.get(net, {})
        out = []
        for s in getattr(self.meta.nets[net], key):
            split = splits.get(s.name)
            if split is not None:
                s = TensorSpec(s.name, split.part_shape(s.shape), s.dtype)
            out.append(s)
        return tuple(out)

    def _weight_tables(self, net: str) -> list[dict[str, Any]]:
        tables = []
        for d in self.parallel.runners(net):
            layout: WeightLayout = self.parallel.devices[d].weights
            chunks = self.meta.net_chunks(net, d) if self.meta.nets[net].per_layer else []
            tables += [{**layout.shared, **layout.chunks[c]} for c in chunks] \
                or [dict(layout.shared)]
        return tables

    def _sizes(self) -> str:
        return super()._sizes() + f", parallel {self.parallel.strategy} over {self.n} devices"


def _cut(split: Split | None) -> str:
    return "whole" if split is None else f"along axis {split.axis} in {split.pieces} pieces"


def machine_executor(path: str | LlmFile, checked: bool = False,
                     weight_cache_bytes: int | None = None,
                     stream_weights: bool | None = None) -> MachineExecutor:
    """The machine executor of a model file: one machine, or one per device of a file
    spread over several (`DeviceGroupExecutor`); both stream their weights the same way
    (`stream_weights`, None: by the blobs' size and TOPTPU_STREAM_WEIGHTS)."""
    f = path if isinstance(path, LlmFile) else LlmFile(path)
    if f.meta.parallel is None:
        return MachineExecutor(f, checked, weight_cache_bytes=weight_cache_bytes,
                               stream_weights=stream_weights)
    return DeviceGroupExecutor(f, checked, weight_cache_bytes=weight_cache_bytes,
                               stream_weights=stream_weights)
