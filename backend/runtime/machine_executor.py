"""The machine executor: runs a model file's command streams on the reference machine.

It implements `toptpu.backend.runtime.executor.Executor` over an LLM model file
(`toptpu.backend.formats.llm_file`) whose nets carry command streams (section `stream:<net>`,
a `toptpu.backend.formats.program.Program`, and `const:<net>`, its constant pool):

- the weight blob is mapped read-only into global memory once; a per-layer net binds layer
  i's weights at its chunk's base + each tensor's offset in the chunk (laid out as layer
  i's kind, `WeightLayout.layer_offset`), a
  shared net the shared region — the command streams name weights, never addresses;
- each net gets its activation region and constant pool once;
- `alloc` maps buffers into global memory (KV caches among them); `Buffer.slot` is an
  address inside one, so binding decode's `present_k` to `cache.slot(1, pos, 1)` makes the
  store command write the new keys straight into the cache;
- every run's timeline is kept per net (`profiles()` summarizes them), and every run and
  host transfer is charged to the step accounting (`ledger`,
  `toptpu.backend.runtime.accounting`: engine time, one launch per run, `write`/`read` as
  host<->device copies): `modelled_seconds()` is the chip time so far, `modelled_costs()`
  where it went; with a `recorder` (`toptpu.backend.runtime.run_trace`) each of them is
  also recorded where it falls on that clock (a generation's trace).

The machine runs in its fast mode by default (`checked=True`: the byte-exact checked mode;
both give the same numbers and traps, see `toptpu.backend.runtime.machine`); converted
weights are cached within `weight_cache_bytes` (default: from the host's free memory, capped
for a streamed blob, see `toptpu.backend.runtime.weight_cache`).

Weights streamed (`stream_weights`; by default where the weight blob is larger than
`model_file.STREAM_ABOVE`, `TOPTPU_STREAM_WEIGHTS=auto|on|off` overrides): after each
run, the mapped pages of the weights it read are released (`weight_pages.WeightPages`, the
one mechanism of every executor: they leave the process's resident set, stay in the page
cache, and the next run of that layer maps them again), so a run of a 7B file holds one
layer's weight bytes, not the blob's 6 GB. `released_bytes` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from toptpu.backend.contract import VISION_NET, NetInfo, NetName, TensorSpec
from toptpu.backend.formats.commands import Gather, Load, Space, Store
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader
from toptpu.backend.formats.model_file import ModelFileError
from toptpu.backend.formats.program import Program, StreamError
from toptpu.backend.reference import blas_threads
from toptpu.backend.runtime.accounting import Costs, Ledger
from toptpu.backend.runtime.executor import (
    Buffer,
    Executor,
    check_bindings,
    owned,
    squeezed,
    value_for,
)
from toptpu.backend.runtime.machine import (
    Binding,
    LoadedNet,
    Machine,
    MachineTrap,
    Timeline,
)
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.steps import OpStep
from toptpu.backend.runtime.weight_cache_file import StoredForms
from toptpu.backend.runtime.weight_pages import StreamedWeights, WeightPages
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.backend.target.cost import NetTiming
from toptpu.dialects import tpu
from toptpu.dialects.common import read_float, read_int
from toptpu.dialects.ir_text import one_line
from toptpu.errors import ToptpuError


class MachineExecutorError(ToptpuError, RuntimeError):
    pass


@dataclass
class MachineBuffer:
    """A tensor in the machine's global memory."""

    machine: Machine
    addr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def slot(self, axis: int, start: int, length: int) -> MachineBuffer:
        if any(d != 1 for d in self.shape[:axis]):
            raise MachineExecutorError(
                f"slot along axis {axis} of a {list(self.shape)} buffer is not contiguous")
        n = self.shape[axis]
        if not (0 <= start and length >= 0 and start + length <= n):
            raise MachineExecutorError(f"slot [{start}:{start + length}] along axis {axis} is "
                                       f"outside a buffer of shape {list(self.shape)}")
        inner = int(np.prod(self.shape[axis + 1:], dtype=np.int64)) * self.dtype.itemsize
        shape = list(self.shape)
        shape[axis] = length
        return MachineBuffer(self.machine, self.addr + start * inner, tuple(shape), self.dtype)

    def array(self, write: bool = False) -> np.ndarray:
        return self.machine.gmem.tensor(self.addr, self.shape, self.dtype, "buffer", write)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def timing_of(tl: Timeline) -> NetTiming:
    """What the step accounting needs of a run's timeline."""
    return NetTiming(cycles=tl.cycles, dma_busy=tl.busy("dma"), compute_busy=tl.busy("cmp"),
                     dma_bytes=tl.dma_bytes, flops=tl.flops, link_busy=tl.busy("link"),
                     link_bytes=tl.link_bytes)


def _spec(s: TensorSpec) -> str:
    return f"{s.name} {s.dtype} {list(s.shape)}"


@dataclass
class NetStats:
    runs: int = 0
    cycles: float = 0.0
    timelines: list[Timeline] = field(default_factory=list)


class MachineExecutor(StreamedWeights, Executor):
    """Runs the nets of a model file on the reference machine (see the module doc)."""

    def __init__(self, model: str | LlmFile, checked: bool = False,
                 chip: Chip | None = None, keep_timelines: int = 4,
                 weight_cache_bytes: int | None = None,
                 stream_weights: bool | None = None) -> None:
        blas_threads.policy()  # a bad TOPTPU_BLAS_THREADS is an error now, not mid-run
        self.file = model if isinstance(model, LlmFile) else LlmFile(model)
        self.meta: LlmHeader = self.file.meta
        self.header: dict[str, Any] = self.file.header  # the JSON form of `meta`
        self.chip = chip or get_chip(self.meta.chip)
        section = self.file.file.sections["weights"]
        #: where the weight blob starts in the file (what `ModelFile.release` takes)
        self._blob_at = section.offset
        #: the weight pages released after each run when streaming (`weight_pages`)
        self.pages = WeightPages(self.file.file, section.size, stream_weights)
        self.machine = Machine(self.chip, checked, self.pages.cache_budget(weight_cache_bytes))
        self.keep_timelines = keep_timelines
        self._nets = self.file.net_infos()
        blob = np.frombuffer(self.file.file.view("weights"), np.uint8)
        self._blob = self.machine.gmem.map("weights", blob, writable=False).base
        self._programs: dict[str, Program] = {}
        for net in self._nets:  # every stream decoded and checked against the header now
            self._programs[net] = self._decode(net)
        self._loaded: dict[str, LoadedNet] = {}
        self._addresses: dict[tuple, dict[str, int]] = {}  # (net, program, layer) -> weights
        self._act: dict[str, int] = {}
        self._const: dict[str, int] = {}
        self.stats: dict[str, NetStats] = {}
        self.ledger = Ledger(self.chip)
        #: records every run and transfer on the modelled clock when set (a run's trace)
        self.recorder: RunRecorder | None = None

    def use_weight_cache(self, stored: StoredForms | None) -> None:
        """Read converted weights from this model file's weight cache file (None: stop)."""
        if stored is not None and stored.model is not self.file:
            raise MachineExecutorError("the weight cache file was opened for another "
                                       "model file")
        self.machine.stored = stored
        self.machine.weights_base = self._blob

    @property
    def stored(self) -> StoredForms | None:
        return self.machine.stored

    # ------------------------------------------------------------------ Executor
    def nets(self) -> Mapping[str, NetInfo]:
        return self._nets

    def alloc(self, shape: tuple[int, ...], dtype: str) -> Buffer:
        return self._machine_buffer(shape, dtype)

    def _machine_buffer(self, shape: tuple[int, ...], dtype: str) -> MachineBuffer:
        dt = np.dtype(dtype)
        nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        region = self.machine.gmem.alloc(f"buffer{len(self.machine.gmem.regions)}", nb)
        return MachineBuffer(self.machine, region.base, tuple(int(d) for d in shape), dt)

    def write(self, buf: Buffer, value: np.ndarray) -> None:
        mine = owned(buf, MachineBuffer, MachineExecutorError)
        mine.array(write=True)[...] = value_for(mine, value, MachineExecutorError)
        self._transfer(mine.nbytes, to_chip=True)

    def read(self, buf: Buffer) -> np.ndarray:
        mine = owned(buf, MachineBuffer, MachineExecutorError)
        self._transfer(mine.nbytes, to_chip=False)
        return mine.array().copy()

    def copy(self, dst: Buffer, src: Buffer) -> None:
        """A device-to-device copy in global memory, charged as one (`Ledger.device_copy`);
        another executor's buffers (a device group's) go through the host."""
        if not (isinstance(dst, MachineBuffer) and isinstance(src, MachineBuffer)
                and dst.machine is self.machine and src.machine is self.machine):
            super().copy(dst, src)
            return
        if squeezed(dst.shape) != squeezed(src.shape) or dst.dtype != src.dtype:
            raise MachineExecutorError(f"cannot copy a {src.dtype} {list(src.shape)} buffer "
                                       f"into a {dst.dtype} {list(dst.shape)} one")
        dst.array(write=True)[...] = src.array().reshape(dst.shape)
        start = self.ledger.totals.total_s
        costs = self.ledger.device_copy(src.nbytes)
        if self.recorder is not None:
            self.recorder.span(f"device copy: {src.nbytes} bytes", start,
                               start + costs.total_s, bytes=src.nbytes)

    def _transfer(self, nbytes: int, to_chip: bool) -> None:
        start = self.ledger.totals.total_s
        costs = self.ledger.transfer(nbytes)
        if self.recorder is not None:
            self.recorder.transfer(to_chip, nbytes, start, costs)

    def modelled_seconds(self) -> float:
        return self.ledger.totals.total_s

    def modelled_costs(self) -> Costs:
        return self.ledger.totals

    def start_recording(self) -> RunRecorder:
        self.recorder = RunRecorder(self.chip)
        return self.recorder

    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        info = self._nets.get(net)
        if info is None:
            raise MachineExecutorError(f"the model has no net '{net}' (it has "
                                       f"{sorted(self._nets)})")
        self.file.file.check_unchanged()  # truncated or rewritten under us: one line
        if self.machine.stored is not None:
            self.machine.stored.check_unchanged()
        loaded = self._load(net)
        prog = loaded.program
        check_bindings(net, info, bindings, lambda b: isinstance(b, MachineBuffer) and
                       b.machine is self.machine, MachineExecutorError)
        mine = cast(Mapping[str, MachineBuffer], bindings)  # checked just above
        io = {spec.name: mine[spec.name].addr for spec in (*info.inputs, *info.outputs)}
        weights = self._weight_addresses(info, prog, layer)
        try:
            tl = self.machine.run(loaded, Binding(io, weights, self._act[net],
                                                  self._const[net]))
        finally:
            self._release_weights(info, prog, layer)
        self._account(net, layer, tl)

    def _release_weights(self, info: NetInfo, prog: Program, layer: int | None) -> None:
        """Release the mapped pages of the weights a run of `prog` at `layer` read (when
        streaming: `WeightPages`)."""
        def extents() -> list[tuple[int, int]]:
            addresses = self._weight_addresses(info, prog, layer)
            return [(self._blob_at + a - self._blob, prog.weights[n].nbytes)
                    for n, a in addresses.items()]

        self.pages.release((info.name, id(prog), layer), extents)

    def _account(self, net: str, layer: int | None, tl: Timeline) -> None:
        """A run of `net` (of `layer`) that took `tl`: its stats (the last `keep_timelines`
        timelines kept), its modelled cost in the ledger, and the recorder's event."""
        st = self.stats.setdefault(net, NetStats())
        st.runs += 1
        st.cycles += tl.cycles
        st.timelines.append(tl)
        del st.timelines[:-self.keep_timelines]
        start = self.ledger.totals.total_s
        costs = self.ledger.net(net, timing_of(tl))
        if self.recorder is not None:
            self.recorder.net(net, layer, start, costs, tl)

    def prepare(self, nets: Sequence[str]) -> None:
        """Parse, check and plan `nets` now (each is otherwise prepared on its first run):
        a runtime prepares the nets every generation runs when it opens the model, so
        that a request's time is the nets' runs. In the fast mode each such net with
        joined slices (`toptpu.backend.runtime.joins`) is also run once on seeded inputs,
        unaccounted, which makes the joins' bit-for-bit checks: whether this host's BLAS
        gives a slice's product the bits of its part of the whole is a property of the
        shapes, checked here instead of in a request's first run (a check that fails
        leaves the slices computing alone, as it would then). Unknown names are left out."""
        for net in nets:
            if net not in self._nets:
                continue
            loaded = self._load(net)
            plan = loaded.plan(self.chip)
            if not self.machine.checked and any(
                    isinstance(s, OpStep) and (s.join is not None or s.part_of is not None)
                    for s in plan.steps):
                self._check_joins(net, loaded)

    def _check_joins(self, net: str, loaded: LoadedNet) -> None:
        """Run `net` once on seeded values (floats standard normal, integers 0: in range
        of any table), its outputs dropped and its buffers released, nothing accounted."""
        info = self._nets[net]
        layer = None
        if info.per_layer:  # the first layer that runs it
            full = str(NetName.parse(net).layer_net)
            layer = min(i for names in self.meta.layer_nets.values()
                        for i, name in enumerate(names) if name == full)
        gmem = self.machine.gmem
        mark = gmem.mark()
        rng = np.random.default_rng(0)
        try:
            io = {}
            for spec in (*info.inputs, *info.outputs):
                buf = self._machine_buffer(tuple(spec.shape), spec.dtype)
                if spec in info.inputs:
                    dt = np.dtype(spec.dtype)
                    buf.array(write=True)[...] = (
                        np.zeros(spec.shape, dt) if np.issubdtype(dt, np.integer)
                        else rng.standard_normal(spec.shape).astype(dt))
                io[spec.name] = buf.addr
            weights = self._weight_addresses(info, loaded.program, layer)
            self.machine.run(loaded, Binding(io, weights, self._act[net], self._const[net]))
        except MachineTrap:
            pass  # a trap of these values: a request's run meets its own, with its inputs
        finally:
            gmem.release(mark)
            self._release_weights(info, loaded.program, layer)

    # ------------------------------------------------------------------ internals
    def program(self, net: str) -> Program:
        return self._load(net).program

    def _decode(self, net: str) -> Program:
        """The net's program, decoded and checked against the header (its IR is parsed
        and verified when the net is first run, `_load`)."""
        try:
            prog = Program.from_json(self.file.file.view(self.meta.nets[net].streams))
        except StreamError as e:
            raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' "
                                 f"is unusable: {e}") from None
        self._check_program(net, prog)
        return prog

    def _load(self, net: str) -> LoadedNet:
        if net not in self._loaded:
            entry = self.meta.nets[net]
            prog = self._programs[net]
            try:
                loaded = LoadedNet(prog, net)
            except ModelFileError:
                raise
            except (StreamError, MachineTrap) as e:
                raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' "
                                     f"is unusable: {one_line(e)}; recompile the model"
                                     ) from None
            except Exception as e:  # noqa: BLE001 - IR that does not parse or verify
                raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' "
                                     f"is unusable: {one_line(e)}; recompile the model") from e
            self._check_attention(net, loaded)
            gmem = self.machine.gmem
            self._act[net] = gmem.alloc(f"act:{net}", prog.regions.activations).base
            pool = self.file.file.read(entry.consts)
            r = gmem.alloc(f"const:{net}", len(pool))
            r.data[:len(pool)] = np.frombuffer(pool, np.uint8)
            self._const[net] = r.base
            self._loaded[net] = loaded
        return self._loaded[net]

    def _check_program(self, net: str, prog: Program) -> None:
        """The header's account of a net's command stream: the weights it reads and its
        command count."""
        entry = self.meta.nets[net]
        problem = ""
        if set(prog.weights) != set(entry.weights):
            differ = sorted(set(prog.weights) ^ set(entry.weights))
            problem = f"the weights it reads ({differ[:3]} differ)"
        elif len(prog.commands) != entry.commands:
            problem = f"its commands ({len(prog.commands)}, the header says {entry.commands})"
        else:
            problem = self._disagreement(net, prog)
        if problem:
            raise ModelFileError(f"'{self.file.path}': the command stream of net '{net}' and "
                                 f"the header disagree on {problem}; recompile the model")

    def _disagreement(self, net: str, prog: Program) -> str:
        """The first fact the stream states that the header states otherwise (net IO,
        weight specs against the weight table, what each transfer moves), or ""."""
        for key in ("inputs", "outputs"):
            have, want = getattr(prog, key), self._expected_io(net, key)
            for i in range(max(len(have), len(want))):
                a = _spec(have[i]) if i < len(have) else "none"
                b = _spec(want[i]) if i < len(want) else "none"
                if a != b:
                    return (f"{key}[{i}] ({a}; the header says {b}, from its "
                            f"{self._sizes()})")
        for table in self._weight_tables(net):
            for name, w in prog.weights.items():
                e = table[name]  # the names were compared with the header's
                if (tuple(w.shape), w.dtype, w.nbytes) != (tuple(e.shape), e.dtype, e.nbytes):
                    return (f"weight '{name}' ({w.dtype} {list(w.shape)}; the weight table "
                            f"has {e.dtype} {list(e.shape)})")
        io = {s.name: s for s in (*prog.inputs, *prog.outputs)}
        outputs = {s.name for s in prog.outputs}
        for c in prog.commands:
            if isinstance(c, Gather):
                ref, shape, dtype = c.table.tensor, c.table.shape, c.table.dtype
            elif isinstance(c, Load | Store):
                ref, shape, dtype = c.tensor, c.shape, c.dtype
            else:
                continue
            if ref.space is Space.IO:
                spec = io.get(ref.name or "")
                if spec is None or (isinstance(c, Store) and ref.name not in outputs):
                    what = "stores into" if isinstance(c, Store) else "reads"
                    kind = "one of its inputs" if spec is not None else "no IO tensor of it"
                    return f"command {c.id}, which {what} '{ref.name}' ({kind})"
                want_shape, want_dtype = spec.shape, spec.dtype
            elif ref.space is Space.WEIGHT:
                listed = prog.weights.get(ref.name or "")
                if listed is None:
                    return f"command {c.id}, which reads weight '{ref.name}' it does not list"
                want_shape, want_dtype = listed.shape, listed.dtype
            else:
                continue
            if (tuple(shape), dtype) != (tuple(want_shape), want_dtype):
                return (f"command {c.id}, which moves '{ref.name}' as {dtype} {list(shape)} "
                        f"(it is {want_dtype} {list(want_shape)})")
        return ""

    def _heads(self, net: str) -> tuple[int, int, str]:
        """The query and KV heads one run of `net` computes, and what they are."""
        m = self.meta.model
        return (m.num_heads, m.num_kv_heads, f"model.num_heads {m.num_heads} and "
                f"model.num_kv_heads {m.num_kv_heads}")

    def _expected_io(self, net: str, key: str) -> tuple[TensorSpec, ...]:
        """The net's inputs or outputs (`key`) as its program must have them."""
        return tuple(getattr(self.meta.nets[net], key))

    def _weight_tables(self, net: str) -> list[dict[str, Any]]:
        """The weight tables a net's weights are checked against: a per-layer net's, the
        chunk layout of every layer that runs it (the header's checks put each of its
        weights in each of those chunks, or shared), with the shared tensors."""
        layout = self.file.layout
        tables = [{**layout.shared, **layout.chunks[c]} for c in self.meta.net_chunks(net)] \
            if self.meta.nets[net].per_layer else []
        return tables or [dict(layout.shared)]

    def _sizes(self) -> str:
        m, s = self.meta.model, self.meta.shapes
        return (f"model.hidden_size {m.hidden_size}, model.num_kv_heads {m.num_kv_heads}, "
                f"model.head_dim {m.head_dim}, model.vocab_size {m.vocab_size}, "
                f"shapes.seq_length {s.seq_length}, shapes.max_input_length "
                f"{s.max_input_length}, shapes.max_history {s.max_history}")

    def _check_attention(self, net: str, loaded: LoadedNet) -> None:
        """A text net's attention ops and norms against the header's heads and the
        config's `rms_norm_eps` (stated twice)."""
        if NetName.parse(net).base == VISION_NET:
            return
        m = self.meta.model
        eps = m.config.get("rms_norm_eps")
        for op in loaded.ops:
            if isinstance(op, tpu.RmsNormOp) and isinstance(eps, float) \
                    and not math.isclose(read_float(op.eps), eps, rel_tol=1e-6):
                raise ModelFileError(
                    f"'{self.file.path}': the command stream of net '{net}' and the header "
                    f"disagree on the norm's eps: {read_float(op.eps)} in the stream, "
                    f"model.config.rms_norm_eps is {eps}; recompile the model")
            if not isinstance(op, tpu.AttentionOp):
                continue
            # a layer group may slice an attention by heads (or head groups): each slice
            # holds the same share of the query and the KV heads, with the whole head_dim
            q, kv, d = (read_int(op.attributes[a]) for a in ("q_heads", "kv_heads", "head_dim"))
            heads, kv_heads, whose = self._heads(net)
            split = heads // q if q and heads % q == 0 else 0
            problem = None
            if d != m.head_dim:
                problem = f"head_dim {d}, model.head_dim is {m.head_dim}"
            elif not split or kv * split != kv_heads:
                problem = f"q_heads {q} and kv_heads {kv}, not the same share of {whose}"
            if problem:
                raise ModelFileError(
                    f"'{self.file.path}': the command stream of net '{net}' and the "
                    f"header disagree on the heads: its attention has {problem}; recompile "
                    "the model")

    def _weight_addresses(self, info: NetInfo, prog: Program, layer: int | None
                          ) -> dict[str, int]:
        """Where each weight `prog` reads lies (the layer's chunk or the shared region),
        the same for every run of the net at that layer (kept)."""
        key = (info.name, id(prog), layer)
        hit = self._addresses.get(key)
        if hit is None:
            hit = self._addresses[key] = self._find_weights(info, prog, layer)
        return hit

    def _find_weights(self, info: NetInfo, prog: Program, layer: int | None
                      ) -> dict[str, int]:
        layout = self.file.layout
        out = {}
        if info.per_layer:
            if layer is None or not 0 <= layer < layout.num_layers:
                raise MachineExecutorError(f"net '{info.name}' is per layer: pass layer= in "
                                           f"0..{layout.num_layers - 1}")
        elif layer is not None:
            raise MachineExecutorError(f"net '{info.name}' is shared by all layers; run it "
                                       "without layer=")
        for name in prog.weights:
            if info.per_layer and layer is not None and name in layout.chunk_of(layer):
                out[name] = self._blob + layout.layer_offset(layer, name)
            elif name in layout.shared:
                out[name] = self._blob + layout.shared[name].offset
            else:
                raise ModelFileError(f"'{self.file.path}': net '{info.name}' reads weight "
                                     f"'{name}', which the weight table does not have")
        return out
