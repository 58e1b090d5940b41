"""`toptpu estimate CONFIG_DIR`: a model's modelled speed on a chip from its config alone.

No weights are needed: the model's shapes are enough. The nets of the net contract are
built from the config with one layer of placeholder weights
(`toptpu.frontends.hf_loader.placeholder_model`), compiled as `toptpu compile` compiles
them (import, top-pipeline, tpu-pipeline in the mode, the machine passes and codegen on
the chip), and their command streams are timed by the chip's cost model without running
(`toptpu.backend.target.cost`). The step accounting (`toptpu.backend.runtime.accounting`)
then charges what the runtime would do: time to first token (the prompt's prefill, the
lm_head and the head that picks the token, every launch and host transfer) and each
decoded token after it (embedding, every layer's block, lm_head, head). The per-layer nets
are compiled once and run once per layer, as in a model file.

A hybrid model (Qwen3.5: `layer_types` with linear-attention layers) has per-layer nets
of each kind, compiled from the first layer of each kind as `toptpu compile` names them
(`block`, `block@3`, ...), and each layer is charged its kind's nets; a linear-attention
layer's decode net reads and writes its state (conv and recurrent) every step, bytes its
command streams move and its modelled time counts.

With `--devices N --parallel tp|pp` the nets are compiled as a multi-device compile cuts
them (tp: the per-layer nets and the heads cut by the tensor-parallel pass; pp: the
one-device nets, the stages balanced by each layer's decode-net time as `toptpu compile`
balances them) and the step accounting charges the device group's host writes, logit
pieces and sends between devices. A hybrid model spreads by pp only (each stage holds its
layers' KV cache or state and the nets of its layers' kinds); tp is refused, as compile
refuses it.

The result also gives the bytes of the model file's weights, of its KV cache (the
full-attention layers) and of the linear-attention state, each device's share of them and
whether it fits, and where each step's time goes: DDR-bound nets, compute-bound nets, net
launches, host transfers, the link between devices.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import IO, Any

from toptpu import vlm_estimate
from toptpu.backend.contract import (
    BATCH_NETS,
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    CONV_STATE,
    EMBEDDING,
    EMBEDDING_CACHE,
    FULL_ATTENTION,
    GREEDY_HEAD,
    HISTORY_K,
    HISTORY_V,
    LINEAR_ATTENTION,
    LM_HEAD,
    PER_LAYER_NETS,
    PREFILL_NETS,
    RECURRENT_STATE,
    SAMPLE_HEAD,
    TEXT_NETS,
    LinearWidths,
    NetName,
    StaticShapes,
    TensorSpec,
    batch_net_io,
    linear_net_io,
    net_io,
)
from toptpu.backend.formats.llm_file import WeightLayout
from toptpu.backend.formats.program import Program
from toptpu.backend.runtime.accounting import (
    CATEGORIES,
    SAMPLERS,
    Costs,
    Spread,
    StepModel,
    net_costs,
)
from toptpu.backend.runtime.machine import command_costs
from toptpu.backend.target.chips import (
    ALL_FIGURES,
    DEFAULT_CHIP,
    LINK_TOPOLOGIES,
    Chip,
    ChipFigureError,
    chip_names,
    get_chip,
)
from toptpu.backend.target.cost import CommandCost, NetTiming, net_timing
from toptpu.cli_args import (
    UsageError,
    int_at_least,
    pixel_size,
)
from toptpu.devices import Parallel, balance_layers, devices_needed
from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import CompileError
from toptpu.net_compiler import CompiledNet, NetPlan, compile_net
from toptpu.request import CompileRequest, add_request_args

#: the nets a decode-speed and first-token estimate needs (prompts of at most one chunk)
STEP_NETS = (EMBEDDING, EMBEDDING_CACHE, BLOCK, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD)


class EstimateError(UsageError):
    """An estimate that cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """The widths the nets' IO and the model file depend on (`contract.ModelWidths`), and
    each layer's kind (`layer_types`, empty: all full attention) with the linear-attention
    state's sizes."""

    family: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    layer_types: tuple[str, ...] = ()
    linear: LinearWidths | None = None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def representatives(self) -> list[int]:
        """The first layer of each kind, in layer order: the layers whose nets are
        compiled (as `toptpu compile` picks them for a float model)."""
        first: dict[str, int] = {}
        for i in range(self.num_layers):
            first.setdefault(self.layer_type(i), i)
        return list(first.values())

    def layer_net(self, net: str, layer: int) -> str:
        """The per-layer net `layer` runs for `net`: its kind's (`block`, `block@3`)."""
        kind = self.layer_type(layer)
        rep = next(r for r in self.representatives if self.layer_type(r) == kind)
        return str(NetName.parse(net).at_layer(rep))  # `block:16` -> `block:16@3`

    def layer_nets(self) -> dict[str, list[str]]:
        """Each per-layer net -> the net every layer runs for it."""
        return {net: [self.layer_net(net, i) for i in range(self.num_layers)]
                for net in PER_LAYER_NETS}

    def layers_of(self, kind: str) -> int:
        return sum(self.layer_type(i) == kind for i in range(self.num_layers))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelShape:
        linear = d.get("linear")
        return cls(**{**d, "layer_types": tuple(d.get("layer_types", ())),
                      "linear": None if linear is None else LinearWidths(**linear)})


@dataclass
class CompiledCosts:
    """The command streams of a model's nets (one layer compiled), reduced to what timing
    needs, with the model file's weight and KV-cache bytes. JSON-serializable: what a
    cache or a sweep keeps of a compile."""

    model: ModelShape
    mode: QuantMode
    shapes: StaticShapes
    commands: dict[str, list[CommandCost]]
    weight_bytes: int  # the model file's (a multi-device file's: every device's together)
    kv_bytes: int
    compile_s: float = 0.0
    #: the linear-attention layers' state (conv + recurrent, every such layer)
    state_bytes: int = 0
    #: rows of the full-attention nets' position_ids (3: a VLM's M-RoPE)
    position_axes: int = 1
    devices: int = 1
    parallel: Parallel | None = None  # tp | pp over `devices`
    #: each device's weight blob and its layers' KV cache and linear-attention state (one
    #: entry for one device)
    device_weight_bytes: list[int] = field(default_factory=list)
    device_kv_bytes: list[int] = field(default_factory=list)
    #: pp: each device's layers [first, end) (empty: not known, every stage takes every
    #: per-layer input, as in a model of one layer kind)
    device_layers: list[tuple[int, int]] = field(default_factory=list)

    @property
    def act(self) -> str:
        return act_dtype(self.mode)

    @property
    def spread(self) -> Spread | None:
        if self.parallel is None:
            return None
        return Spread(self.parallel.value, self.devices,
                      tuple(range(a, b) for a, b in self.device_layers)
                      if self.parallel is Parallel.PP else ())

    @property
    def batch(self) -> int:
        """The batch of the batch nets compiled (`--batch B`), 1 without."""
        return max((NetName.parse(n).batch for n in self.commands), default=0) or 1

    def io(self) -> dict[str, Any]:
        return model_net_io(self.shapes, self.model, self.act, self.position_axes,
                            self.batch)

    def timings(self, chip: Chip, nets: Sequence[str] | None = None) -> dict[str, NetTiming]:
        """Each compiled net (or `nets`) timed on `chip`."""
        return {name: net_timing(self.commands[name], chip)
                for name in (self.commands if nets is None else nets)}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model.to_json(), "mode": self.mode.value,
               "shapes": asdict(self.shapes), "weight_bytes": self.weight_bytes,
               "kv_bytes": self.kv_bytes, "state_bytes": self.state_bytes,
               "compile_s": self.compile_s,
               # [dma, bytes, flops, type, deps, link or null, run]
               "commands": {n: [[int(c.dma), c.nbytes, c.flops, c.dtype, list(c.deps),
                                 list(c.link) if c.link is not None else None, c.run]
                                for c in cmds] for n, cmds in self.commands.items()}}
        if self.position_axes != 1:
            out["position_axes"] = self.position_axes
        if self.parallel is not None:
            out.update(devices=self.devices, parallel=self.parallel.value,
                       device_weight_bytes=self.device_weight_bytes,
                       device_kv_bytes=self.device_kv_bytes,
                       device_layers=[list(r) for r in self.device_layers])
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CompiledCosts:
        def link(c: Sequence[Any]) -> tuple[str, str, int] | None:
            return (str(c[5][0]), str(c[5][1]), int(c[5][2])) if len(c) > 5 \
                and c[5] is not None else None

        parallel = d.get("parallel")
        return cls(model=ModelShape.from_json(d["model"]), mode=QuantMode(d["mode"]),
                   shapes=StaticShapes(**d["shapes"]),
                   commands={n: [CommandCost(bool(c[0]), int(c[1]), int(c[2]), str(c[3]),
                                             tuple(c[4]), link(c),
                                             int(c[6]) if len(c) > 6 else 0) for c in cmds]
                             for n, cmds in d["commands"].items()},
                   weight_bytes=int(d["weight_bytes"]), kv_bytes=int(d["kv_bytes"]),
                   compile_s=float(d.get("compile_s", 0.0)),
                   state_bytes=int(d.get("state_bytes", 0)),
                   position_axes=int(d.get("position_axes", 1)),
                   devices=int(d.get("devices", 1)),
                   parallel=None if parallel is None else Parallel(parallel),
                   device_weight_bytes=[int(x) for x in d.get("device_weight_bytes", [])],
                   device_kv_bytes=[int(x) for x in d.get("device_kv_bytes", [])],
                   device_layers=[(int(a), int(b)) for a, b in d.get("device_layers", [])])


def act_dtype(mode: QuantMode) -> str:
    """numpy dtype name of a mode's activations."""
    return {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[mode.activation]


# =========================================================================== compiling


def model_shape(config: Any) -> ModelShape:
    heads = int(config.num_attention_heads)
    n = int(config.num_hidden_layers)
    types = tuple(str(t) for t in (getattr(config, "layer_types", None) or ()))[:n]
    linear = None
    if LINEAR_ATTENTION in types:
        linear = LinearWidths(int(config.linear_conv_kernel_dim),
                              int(config.linear_num_key_heads),
                              int(config.linear_num_value_heads),
                              int(config.linear_key_head_dim),
                              int(config.linear_value_head_dim))
    return ModelShape(
        family=str(config.model_type), num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        vocab_size=int(config.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layer_types=types if LINEAR_ATTENTION in types else (), linear=linear)


def model_net_io(shapes: StaticShapes, model: ModelShape, act: str, position_axes: int = 1,
                 batch: int = 1
                 ) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """Each text net's IO (`contract.net_io`; `position_axes` rows of positions; with the
    batch nets at `batch` above 1, `contract.batch_net_io`), the per-layer nets of every
    layer kind under their names (a linear-attention kind's `contract.linear_net_io`)."""
    io = net_io(shapes, model, act, position_axes)
    if batch > 1:
        io.update(batch_net_io(shapes, model, act, batch, position_axes))
    out = {name: spec for name, spec in io.items()
           if NetName.parse(name).base not in PER_LAYER_NETS}
    for rep in model.representatives:
        kind_io = (linear_net_io(shapes, model.hidden_size, model.linear, act)
                   if model.layer_type(rep) == LINEAR_ATTENTION and model.linear is not None
                   else io)
        for name, spec in kind_io.items():  # at every prefill length (`block:16@3`)
            net = NetName.parse(name)
            if net.base in PER_LAYER_NETS:
                out[str(net.at_layer(rep))] = spec
    return out


def compile_costs(config: Any, request: CompileRequest, nets: Sequence[str] = TEXT_NETS,
                  progress: IO[str] | None = None, position_axes: int = 1,
                  build: Any = None) -> CompiledCosts:
    """Compile `nets` of the model of `config` (one layer, placeholder weights) as `request`
    asks (its mode, chip, shapes, group size; spread over its devices, tp or pp, as
    `toptpu compile` spreads it) and keep their command costs. `position_axes` 3: the
    full-attention nets take M-RoPE positions (a VLM's text model, built by `build` where
    transformers has no causal LM class for it)."""
    t0 = time.perf_counter()
    programs = compile_programs(config, request, nets, progress, position_axes, build)
    out = spread_costs(programs, model_shape(config), request.fixed_mode("toptpu estimate"),
                       request.shapes, request.devices, request.parallel, request.chip,
                       position_axes)
    out.compile_s = time.perf_counter() - t0
    return out


def compile_programs(config: Any, request: CompileRequest, nets: Sequence[str] = TEXT_NETS,
                     progress: IO[str] | None = None, position_axes: int = 1,
                     build: Any = None) -> dict[str, Program]:
    """The programs of `nets` of the model of `config` (one layer, placeholder weights),
    each net compiled as `toptpu compile` compiles it (`net_compiler.compile_net`: the
    tensor-parallel nets cut over the devices of a tp request)."""
    from toptpu.frontends.hf_loader import placeholder_model
    from toptpu.frontends.llm import split_model

    mode = request.fixed_mode("toptpu estimate")
    shape = model_shape(config)
    if request.parallel is Parallel.TP and shape.linear is not None:  # as compile refuses
        raise EstimateError(f"--devices {request.devices} --parallel tp: the model has "
                            "linear-attention layers (Qwen3.5), which toptpu does not cut "
                            "over devices yet; use --parallel pp")
    if request.batch > 1 and shape.linear is not None:  # as compile refuses
        raise EstimateError(f"--batch {request.batch}: the model has linear-attention layers "
                            "(Qwen3.5), which have no batch decode net yet")
    reps = shape.representatives  # the first layer of each kind
    model = placeholder_model(config, layers=max(reps) + 1, build=build)
    shapes, act, batch = request.shapes, mode.activation, request.batch
    specs = {s.name: NetPlan(s, s.mode or mode)
             for s in split_model(model, shapes, act=act, position_axes=position_axes,
                                  batch=batch)}
    for rep in reps[1:]:  # another layer kind: its per-layer nets, named as compile does
        for s in split_model(model, shapes, layer=rep, act=act, position_axes=position_axes,
                             batch=batch):
            if s.per_layer:
                name = str(NetName.parse(s.name).at_layer(rep))
                specs[name] = NetPlan(replace(s, name=name), s.mode or mode, f"v{rep}.")
    unknown = [n for n in nets if n not in specs]
    if unknown:
        raise EstimateError(f"unknown nets {unknown}; nets: {', '.join(specs)}")
    # a per-layer net asked for (at any prefill length) is compiled for every layer kind
    wanted = list(dict.fromkeys(
        name for n in nets for name in ([str(NetName.parse(n).at_layer(r)) for r in reps]
                                        if NetName.parse(n).base in PER_LAYER_NETS else [n])))
    store = WeightStore(placeholders=True)  # shapes only: nothing derived is computed
    programs: dict[str, Program] = {}
    for name in wanted:
        t = time.perf_counter()
        programs[name] = program_of(compile_net(specs[name], request, store))
        if progress is not None:
            progress.write(f"  {name}: {len(programs[name].commands)} commands "
                           f"({time.perf_counter() - t:.1f}s)\n")
            progress.flush()
    return programs


def program_of(net: CompiledNet) -> Program:
    """The machine program of a net compiled with the machine pipeline."""
    assert net.program is not None, net.name
    return net.program


def spread_costs(programs: Mapping[str, Program], shape: ModelShape, mode: QuantMode,
                 shapes: StaticShapes, devices: int = 1, parallel: Parallel | None = None,
                 chip: Chip | None = None, position_axes: int = 1) -> CompiledCosts:
    """The costs of compiled `programs` on `devices` devices by `parallel` (the programs of
    a pp spread are the one-device programs: one compile serves every device count)."""
    commands = {n: command_costs(p.commands) for n, p in programs.items()}
    one = CompiledCosts(model=shape, mode=mode, shapes=shapes, commands=commands,
                        weight_bytes=weight_bytes(programs, shape),
                        kv_bytes=kv_bytes(shape, shapes, mode),
                        state_bytes=state_bytes(shape, shapes, mode),
                        position_axes=position_axes)
    if parallel is None:
        return one
    assert chip is not None
    shares = device_bytes(programs, shape, devices, parallel, chip)
    return replace(one, weight_bytes=sum(shares.weights), kv_bytes=sum(shares.kv),
                   devices=devices, parallel=parallel, device_weight_bytes=shares.weights,
                   device_kv_bytes=[k + s for k, s in zip(shares.kv, shares.state,
                                                           strict=True)],
                   device_layers=[(r.start, r.stop) for r in shares.layers])


def weight_bytes(programs: Mapping[str, Program], shape: ModelShape,
                 layers: Sequence[int] | None = None) -> int:
    """The model file's weight blob as the compiler lays it out: the shared weights once
    (a tied lm_head shares the embedding table; a per-layer net's weight that is not the
    layer's own, e.g. rotary frequencies, is shared too), then every layer's chunk, laid
    out as its kind's (`WeightLayout`; the layers `layers`, default the model's)."""
    from toptpu.layer_weights import layer_key

    reps = shape.representatives
    shared: dict[str, tuple[tuple[int, ...], str]] = {}
    chunks: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {r: {} for r in reps}
    for name, prog in programs.items():
        net = NetName.parse(name)
        for w, spec in prog.weights.items():
            if net.base in PER_LAYER_NETS and layer_key(w) is not None:
                chunks[net.layer][w] = (tuple(spec.shape), str(spec.dtype))
            else:
                shared[w] = (tuple(spec.shape), str(spec.dtype))
    if shape.tied_embeddings:  # one tensor feeds the gather and the lm_head
        tables = [w for w, s in shared.items() if s[0] == (shape.vocab_size, shape.hidden_size)]
        for w in tables[1:]:
            del shared[w]
    kind_chunk = {shape.layer_type(r): i for i, r in enumerate(reps)}
    return WeightLayout.plan(shared, [chunks[r] for r in reps],
                             [kind_chunk[shape.layer_type(i)]
                              for i in (range(shape.num_layers) if layers is None
                                        else layers)]).size


@dataclass(frozen=True)
class DeviceShares:
    """What each device of a spread holds: its layers, weight blob, KV cache and
    linear-attention state (bytes)."""

    layers: list[range]
    weights: list[int]
    kv: list[int]
    state: list[int]


def device_bytes(programs: Mapping[str, Program], shape: ModelShape, devices: int,
                 parallel: Parallel, chip: Chip) -> DeviceShares:
    """Each device's layers, weight blob, KV cache and linear-attention state, as
    a multi-device compile lays them out (`toptpu.compiler.place`): tp, every layer's
    pieces on every device, the embedding on device 0; ep, every layer on every device
    with its share of the experts, the embeddings and heads on device 0; pp, contiguous
    layers balanced by each layer's decode net's time, the embeddings on the first device,
    the lm_head and heads on the last, each stage the per-layer nets of its layers' kinds
    only."""
    layers = shape.num_layers

    def cache(layer: int, names: Sequence[str]) -> int:
        """The inputs `names` of `layer`'s decode net, as the device binds them (a tp net:
        its piece)."""
        return sum(s.nbytes for s in programs[shape.layer_net(BLOCK_CACHE, layer)].inputs
                   if s.name in names)

    embeddings = [n for n in programs  # at every prefill length (`embedding:16`)
                  if NetName.parse(n).base in (EMBEDDING, EMBEDDING_CACHE)]
    per_layer = [n for n in programs if NetName.parse(n).base in PER_LAYER_NETS]
    heads = [n for n in programs if n not in embeddings and n not in per_layer]
    if parallel is Parallel.TP:
        ranges = [range(layers)] * devices
        nets = [embeddings + per_layer + heads] + [per_layer + heads] * (devices - 1)
    elif parallel is Parallel.EP:
        ranges = [range(layers)] * devices
        nets = [embeddings + per_layer + heads] + [per_layer] * (devices - 1)
    else:
        def seconds(net: str) -> float:
            return net_timing(command_costs(programs[net].commands), chip).seconds(chip) \
                if net in programs else 0.0

        ranges = balance_layers([seconds(shape.layer_net(BLOCK_CACHE, i))
                                 for i in range(layers)],
                                seconds(EMBEDDING_CACHE),
                                seconds(LM_HEAD) + seconds(GREEDY_HEAD), devices)
        nets = []
        for d, r in enumerate(ranges):
            own = {shape.layer_net(str(NetName.parse(n).at_layer(0)), i)  # at its length
                   for i in r for n in per_layer}
            nets.append((embeddings if d == 0 else []) + [n for n in per_layer if n in own]
                        + (heads if d == devices - 1 else []))
    weights = [weight_bytes({n: programs[n] for n in mine}, shape, r)
               for mine, r in zip(nets, ranges, strict=True)]
    return DeviceShares(ranges, weights,
                        [sum(cache(i, (HISTORY_K, HISTORY_V)) for i in r) for r in ranges],
                        [sum(cache(i, (CONV_STATE, RECURRENT_STATE)) for i in r)
                         for r in ranges])


def kv_bytes(shape: ModelShape, shapes: StaticShapes, mode: QuantMode) -> int:
    """Both caches of every full-attention layer: 2 x layers x SEQ x kv heads x head_dim x
    act bytes."""
    ins, _ = net_io(shapes, shape, act_dtype(mode))[BLOCK_CACHE]
    history = next(s for s in ins if s.name == HISTORY_K)
    return 2 * shape.layers_of(FULL_ATTENTION) * history.nbytes


def state_bytes(shape: ModelShape, shapes: StaticShapes, mode: QuantMode) -> int:
    """The state of every linear-attention layer: its conv state (act type) and recurrent
    state (f32), which a decode step reads and writes in place."""
    if shape.linear is None:
        return 0
    ins, _ = linear_net_io(shapes, shape.hidden_size, shape.linear,
                           act_dtype(mode))[BLOCK_CACHE]
    per_layer = sum(s.nbytes for s in ins if s.name in (CONV_STATE, RECURRENT_STATE))
    return shape.layers_of(LINEAR_ATTENTION) * per_layer


# =========================================================================== estimating


@dataclass
class Estimate:
    """Modelled time to first token and per decoded token, by where it goes."""

    chip: Chip
    compiled: CompiledCosts
    prompt_tokens: int
    sampler: str
    first_token: Costs
    per_token: Costs
    nets: dict[str, NetTiming] = field(default_factory=dict)
    #: one decode step of B conversations on the batch nets (None: none compiled)
    batch_step: Costs | None = None

    def batch_json(self) -> dict[str, Any] | None:
        """The batch nets' decode: one step of B conversations, the tokens/s each of them
        and all together get (None: no batch nets)."""
        if self.batch_step is None:
            return None
        b, step = self.compiled.batch, self.batch_step.total_s
        return {"batch": b, "step": self.batch_step.to_json(),
                "tokens_per_s_per_user": 1 / step, "tokens_per_s_total": b / step,
                "speedup_over_batch_1": b / step * self.per_token.total_s}

    @property
    def ttft_s(self) -> float:
        return self.first_token.total_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token.total_s

    def net_json(self) -> dict[str, dict[str, Any]]:
        runs = Counter(n for nets in self.compiled.model.layer_nets().values() for n in nets)
        out = {}
        for name, t in self.nets.items():
            c = net_costs(self.chip, t)
            out[name] = {"seconds": t.seconds(self.chip), "bound": t.bound,
                         "dma_bytes": t.dma_bytes, "flops": t.flops,
                         "runs_per_step": runs.get(name, 1), "launch_s": c.launch_s}
        return out

    @property
    def device_bytes(self) -> list[int]:
        """What each device holds: its weights and its KV cache."""
        m = self.compiled
        return [w + k for w, k in zip(m.device_weight_bytes or [m.weight_bytes],
                                      m.device_kv_bytes or [m.kv_bytes + m.state_bytes],
                                      strict=True)]

    @property
    def fits(self) -> bool:
        """Every device's weights and KV cache fit its memory (`Chip.ddr_bytes`)."""
        return max(self.device_bytes) <= self.chip.ddr_bytes

    def to_json(self) -> dict[str, Any]:
        m = self.compiled
        return {
            "modelled_ttft_s": self.ttft_s,
            "modelled_tokens_per_s": self.tokens_per_s,
            "weight_bytes": m.weight_bytes,
            "kv_bytes": m.kv_bytes,
            "state_bytes": m.state_bytes,
            "devices": m.devices,
            "parallel": m.parallel,
            "device_weight_bytes": m.device_weight_bytes or [m.weight_bytes],
            "device_kv_bytes": m.device_kv_bytes or [m.kv_bytes + m.state_bytes],
            "fits": self.fits,
            "breakdown": {"first_token": self.first_token.to_json(),
                          "per_decoded_token": self.per_token.to_json(),
                          "nets": self.net_json()},
            "chip": self.chip.to_json(),
            "mode": m.mode,
            "shapes": asdict(m.shapes),
            "model": m.model.to_json(),
            "prompt_tokens": self.prompt_tokens,
            "sampler": self.sampler,
            "batch": self.batch_json(),
        }


def estimate(compiled: CompiledCosts, chip: Chip, prompt_tokens: int | None = None,
             sampler: str = "greedy") -> Estimate:
    """Time to first token for a prompt of `prompt_tokens` (default: one full chunk L) and
    the time of each decoded token, choosing tokens with `sampler` (greedy_head,
    sample_head on the chip, or the host)."""
    if sampler not in SAMPLERS:
        raise EstimateError(f"unknown sampler '{sampler}' ({', '.join(SAMPLERS)})")
    tokens = compiled.shapes.max_input_length if prompt_tokens is None else prompt_tokens
    if not 1 <= tokens <= compiled.shapes.seq_length:
        raise EstimateError(f"--prompt-tokens {tokens} must be between 1 and --seq-length "
                            f"{compiled.shapes.seq_length}")
    model = compiled.model
    layer_nets = model.layer_nets()
    needed = [name for n in _needed_nets(tokens, compiled.shapes, sampler, compiled.batch)
              for name in ([model.layer_net(n, i) for i in range(model.num_layers)]
                           if NetName.parse(n).base in PER_LAYER_NETS else [n])]
    missing = sorted(set(needed) - set(compiled.commands))
    if missing:
        raise EstimateError(f"this estimate needs the nets {missing}, which were not compiled")
    timings = compiled.timings(chip)
    steps = StepModel(chip, compiled.io(), timings, compiled.model.num_layers, layer_nets,
                      spread=compiled.spread)
    return Estimate(chip, compiled, tokens, sampler, steps.first_token(tokens, sampler),
                    steps.per_token(sampler), timings,
                    steps.batch_step(sampler) if compiled.batch > 1 else None)


def _needed_nets(tokens: int, shapes: StaticShapes, sampler: str, batch: int = 1
                 ) -> list[str]:
    """The nets a generation from a prompt of `tokens` runs (`Runtime.generate`): each
    prefill chunk's embedding and block (the first) or block_kv at the shortest prefill
    length that holds it, the decode nets (also for prompt tokens past max_history), the
    lm_head and the sampler's head."""
    nets = [EMBEDDING_CACHE, BLOCK_CACHE, LM_HEAD]
    done = 0
    while done < tokens:
        if done == 0 or done <= shapes.max_history:
            n = min(shapes.max_input_length, tokens - done)
            length = shapes.chunk_length(n)
            nets += [shapes.prefill_net(EMBEDDING, length),
                     shapes.prefill_net(BLOCK if done == 0 else BLOCK_KV, length)]
            done += n
        else:
            done += 1
    heads = {"greedy": [GREEDY_HEAD], "sample": [SAMPLE_HEAD], "host": []}[sampler]
    nets += heads
    if batch > 1:  # a decode step of `batch` conversations
        nets += [str(NetName(n, batch=batch)) for n in (EMBEDDING_CACHE, BLOCK_CACHE, LM_HEAD,
                                                        *heads)]
    return list(dict.fromkeys(nets))


def estimate_nets(shapes: StaticShapes, prompt_tokens: int | None, sampler: str,
                  batch: int = 1) -> list[str]:
    """The nets `toptpu estimate` compiles: every net of a model file at its longest
    prefill length, the shorter prefill nets the prompt's chunks run, and with `batch`
    above 1 the batch nets."""
    tokens = shapes.max_input_length if prompt_tokens is None else prompt_tokens
    needed = _needed_nets(tokens, shapes, sampler, batch) \
        if 1 <= tokens <= shapes.seq_length and sampler in SAMPLERS else []
    extra = [str(NetName(n, batch=batch)) for n in BATCH_NETS] if batch > 1 else []
    return list(dict.fromkeys([*TEXT_NETS, *needed, *extra]))


def all_prefill_nets(shapes: StaticShapes) -> list[str]:
    """Every net of a model file: the text nets and the prefill nets at each shorter
    prefill length."""
    return [*TEXT_NETS, *(shapes.prefill_net(base, n) for n in shapes.shorter_lengths
                          for base in PREFILL_NETS)]


# =========================================================================== the command


def summary(est: Estimate) -> str:
    """The estimate for a reader."""
    m, chip = est.compiled, est.chip
    s = m.shapes
    model = m.model
    n_linear = model.layers_of(LINEAR_ATTENTION)
    kinds = (f" ({n_linear} linear attention, {model.num_layers - n_linear} full attention)"
             if n_linear else "")
    state = ""
    if n_linear:
        state = (f", linear-attention state {m.state_bytes / 1e6:.1f} MB ({n_linear} layers; "
                 "read and written every decode step)")
    lines = [
        f"{model.family}: {model.num_layers} layers{kinds}, hidden {model.hidden_size}, "
        f"{model.num_kv_heads} KV heads x {model.head_dim}, vocab {model.vocab_size}; "
        f"{m.mode} on {chip.name} ({chip.cores} core(s), {chip.sustained_gbps:.3g} GB/s "
        f"sustained DDR); seq {s.seq_length}, input {s.max_input_length}, history "
        f"{s.max_history}, prefill lengths {', '.join(map(str, s.prefill_lengths))}",
        f"weights {m.weight_bytes / 1e6:.1f} MB, KV cache {m.kv_bytes / 1e6:.1f} MB "
        f"({model.num_layers - n_linear} layers){state}",
        *_device_lines(est),
        f"time to first token ({est.prompt_tokens}-token prompt): {est.ttft_s * 1e3:.2f} ms "
        f"modelled ({_where(est.first_token)})",
        f"decode: {est.tokens_per_s:.2f} tokens/s modelled, {est.per_token.total_s * 1e3:.3f} "
        f"ms per token ({_where(est.per_token)})",
        *_batch_lines(est),
        f"{'net':<16} {'runs/step':>9} {'ms/run':>9} {'bound':>8} {'MB moved':>9} "
        f"{'GFLOP':>8}",
    ]
    for name, row in est.net_json().items():
        lines.append(f"{name:<16} {row['runs_per_step']:>9} {row['seconds'] * 1e3:>9.4f} "
                     f"{row['bound']:>8} {row['dma_bytes'] / 1e6:>9.2f} "
                     f"{row['flops'] / 1e9:>8.3f}")
    return "\n".join(lines)


def _batch_lines(est: Estimate) -> list[str]:
    """The batch nets' decode, when compiled."""
    b = est.batch_json()
    if b is None or est.batch_step is None:
        return []
    return [f"decode at batch {b['batch']} (the batch nets): one step of {b['batch']} "
            f"conversations {est.batch_step.total_s * 1e3:.3f} ms "
            f"({_where(est.batch_step)}): {b['tokens_per_s_per_user']:.2f} tokens/s per "
            f"user, {b['tokens_per_s_total']:.2f} tokens/s in total "
            f"({b['speedup_over_batch_1']:.2f}x batch 1)"]


def _device_lines(est: Estimate) -> list[str]:
    """Per device: what it holds against its memory (one line for one device only when
    it does not fit)."""
    m, chip = est.compiled, est.chip
    lines = []
    if m.parallel is not None:
        lines.append(f"{m.devices} devices, {m.parallel}: collectives and sends between "
                     f"devices {est.per_token.link_s * 1e3:.3f} ms per token "
                     f"({chip.link_gbps:g} GB/s link, {chip.link_latency_us:g} us per "
                     "transfer)")
        for d, (w, k) in enumerate(zip(m.device_weight_bytes, m.device_kv_bytes,
                                       strict=True)):
            cache = "KV cache and state" if m.state_bytes else "KV cache"
            lines.append(f"  device {d}: weights {w / 1e6:.1f} MB + {cache} {k / 1e6:.1f} MB")
    if not est.fits:
        lines.append(f"does NOT fit: a device needs {max(est.device_bytes) / 2**30:.2f} GiB, "
                     f"a {chip.name} has {chip.ddr_bytes / 2**30:.2f} GiB; "
                     + devices_needed(max(est.device_bytes), m.devices, chip))
    return lines


def _where(c: Costs) -> str:
    parts = [f"{name} {getattr(c, f'{name}_s') / c.total_s:.0%}"
             for name in CATEGORIES if name != "link" or c.link_s > 0]
    return f"{c.bound}-bound: " + ", ".join(parts) + f"; {c.launches:g} launches, " \
        f"{c.transfers:g} host transfers"


def parse_figures(items: Sequence[str] | None, chip: Chip | None = None) -> dict[str, Any]:
    """`--set FIGURE=VALUE` items -> chip figures (finite numbers; `tflops.TYPE=V` per
    compute type). With `chip`, a figure or compute type it does not have is refused, the
    message listing the valid keys (the ranges are the chip's own checks)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise EstimateError(f"--set {item!r}: write FIGURE=VALUE (e.g. ddr_gbps=128)")
        if chip is not None:
            _check_figure_key(item, key, chip)
        if key == "link_topology":
            if value.strip() not in LINK_TOPOLOGIES:
                raise EstimateError(f"--set {item!r}: the link topologies are "
                                    f"{', '.join(LINK_TOPOLOGIES)}")
            out[key] = value.strip()
            continue
        try:
            number = float(value)
        except ValueError as e:
            raise EstimateError(f"--set {item!r}: {value!r} is not a number") from e
        if not math.isfinite(number):
            raise EstimateError(f"--set {item!r}: {value.strip()!r} is not a finite number")
        if key.startswith("tflops."):
            if number <= 0:
                raise EstimateError(f"--set {item!r}: a peak is a positive number")
            out.setdefault("tflops", {})[key.split(".", 1)[1]] = number
        else:
            out[key] = int(number) if number.is_integer() and key in INT_FIGURES else number
    return out


def figure_keys(chip: Chip) -> list[str]:
    """The keys `--set` takes for `chip`: its figures, tflops as `tflops.TYPE`."""
    keys: list[str] = []
    for k in ALL_FIGURES:
        keys += [f"tflops.{t}" for t in chip.tflops] if k == "tflops" else [k]
    return keys


def _check_figure_key(item: str, key: str, chip: Chip) -> None:
    if key in figure_keys(chip):
        return
    what = ("tflops is per compute type" if key == "tflops" else
            f"{chip.name} has no compute type '{key.split('.', 1)[1]}'"
            if key.startswith("tflops.") else f"'{key}' is not a chip figure")
    raise EstimateError(f"--set {item!r}: {what}; the keys of {chip.name}: "
                        f"{', '.join(figure_keys(chip))}")


#: the figures that are whole numbers
INT_FIGURES = ("lanes", "lane_bytes", "banks", "align", "cores", "ddr_bytes",
               "dma_latency_cycles", "dma_burst_bytes", "compute_latency_cycles",
               "max_devices")


def chip_with(chip: Chip, figures: Mapping[str, Any]) -> Chip:
    """`chip` with `figures` changed (a tflops dict updates the types given)."""
    figures = dict(figures)
    if "tflops" in figures:
        given = figures["tflops"]
        if not isinstance(given, Mapping):
            raise ChipFigureError(f"tflops is per compute type ({', '.join(chip.tflops)}), "
                                  f"not {given!r}")
        unknown = sorted(set(given) - set(chip.tflops))
        if unknown:
            raise ChipFigureError(f"{chip.name} has no compute type(s) {unknown}; its "
                                  f"types: {', '.join(chip.tflops)}")
        figures["tflops"] = {**chip.tflops, **given}
    return chip.with_figures(**figures)


def read_checked_config(config_dir: str, request: CompileRequest) -> Any:
    """The config of `config_dir`, checked as `toptpu compile` checks it for the request
    (its mode, sequence length, group size and devices; a user error names the problem)."""
    from toptpu.compile_options import (
        check_group_size,
        check_parallel_config,
        check_seq_length,
    )
    from toptpu.frontends.hf_loader import check_config, read_config

    mode = request.fixed_mode("toptpu estimate")
    config, raw = read_config(config_dir)
    where = f"{config_dir}/config.json"
    check_config(_without_quantization(config), where)
    check_seq_length(raw, where, request.shapes.seq_length, mode)
    check_group_size(raw, where, mode, request.group_size)
    text_config = raw.get("text_config")
    check_parallel_config(text_config if isinstance(text_config, dict) else raw, where,
                          request.devices, request.parallel, mode, request.group_size)
    return config


def cmd_estimate(args: Any) -> int:
    """Modelled time to first token and decode speed of a model on a chip, from its
    config.json alone (one layer compiled with placeholder weights)."""
    try:
        base = get_chip(args.chip)  # a name argparse checked (`--chip` choices)
        chip = chip_with(base, parse_figures(args.set, base))
    except (ValueError, ChipFigureError) as e:
        raise CompileError(str(e)) from e
    request = CompileRequest.from_args(args, chip=chip)  # the preset, figures changed
    request.fixed_mode("toptpu estimate")
    vlm = vlm_estimate.vlm_config(args.config_dir)
    if vlm is None:
        if (request.max_pixels, request.max_patches, request.vision_mode) != (None,) * 3:
            raise EstimateError("--max-pixels, --max-patches and --vision-quantize apply to "
                                "vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5)")
        config = read_checked_config(args.config_dir, request)
    else:
        if request.parallel is not None:
            raise EstimateError(f"--devices {request.devices}: a vision-language model is "
                                "estimated on one device (its vit and text nets are not "
                                "spread over several yet); drop --devices")
        config = _checked_vlm_text(vlm, args.config_dir, request)
    progress = None if args.json or args.quiet else sys.stderr
    if progress is not None:
        progress.write(f"toptpu estimate: compiling one layer of {args.config_dir} "
                       f"(placeholder weights) for {chip.name}\n")
    build = vlm_estimate.text_placeholder_builder(config) if vlm is not None else None
    shapes = request.shapes
    # a VLM's prompt holds an image's tokens too: every prefill length is compiled
    nets = estimate_nets(shapes, args.prompt_tokens, args.sampler, request.batch) \
        if vlm is None else all_prefill_nets(shapes)
    compiled = compile_costs(config, request, nets=nets, progress=progress,
                             position_axes=3 if vlm is not None else 1, build=build)
    est = estimate(compiled, chip, args.prompt_tokens, args.sampler)
    if vlm is None:
        print(json.dumps(est.to_json(), indent=1) if args.json else summary(est))
        return 0
    budget = vlm_estimate.budget_of(vlm, request.max_pixels, request.max_patches)
    if progress is not None:
        progress.write(f"  vit: {budget} patches in "
                       f"{request.vision_mode_for(compiled.mode)}\n")
    vision = vlm_estimate.vision_costs(vlm, request, budget)
    both = vlm_estimate.estimate_vlm(est, vision, args.sampler)
    print(json.dumps(both.to_json(), indent=1) if args.json else
          "\n".join([summary(est), *vlm_estimate.summary_lines(both)]))
    return 0


def _checked_vlm_text(vlm: Any, config_dir: str, request: CompileRequest) -> Any:
    """A Qwen VLM's text config, checked as compile checks it for the mode and shapes."""
    from toptpu.compile_options import check_seq_length

    where = f"{config_dir}/config.json"
    text = vlm_estimate.checked_text_config(vlm, where)
    check_seq_length(text.to_dict(), where, request.shapes.seq_length,
                     request.fixed_mode("toptpu estimate"))
    return text


def _without_quantization(config: Any) -> Any:
    """The config as a float model's (estimates take the mode from -q)."""
    c = copy.copy(config)
    if getattr(c, "quantization_config", None):
        c.quantization_config = None
    return c


def add_estimate_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help=cmd_estimate.__doc__)
    p.add_argument("config_dir", help="a directory with the model's config.json (weights are "
                   "not needed)")
    p.add_argument("--chip", choices=chip_names(), default=DEFAULT_CHIP,
                   help="the chip preset to model")
    p.add_argument("-q", "--mode", default="w4bf16", help="quantization mode (as compile)")
    add_request_args(p, ("shapes", "batch", "devices", "parallel", "group_size", "symmetric",
                         "pipeline"))  # the nets compiled with the passes a compile runs
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None,
                   help="prompt length of the time to first token (default: one chunk, "
                   "--max-input-length); its chunks run at the shortest prefill length "
                   "that holds them, as `toptpu run` runs them")
    p.add_argument("--sampler", choices=list(SAMPLERS), default="greedy",
                   help="how tokens are chosen: greedy_head or sample_head on the chip, or "
                   "on the host from the logits read back")
    v = p.add_argument_group("vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5)")
    v.add_argument("--max-pixels", type=pixel_size, default=None, metavar="W,H",
                   help="the vision net's pixel budget (default 768,768), as compile")
    v.add_argument("--max-patches", type=int_at_least(1), default=None,
                   help="the vision net's patch budget (instead of --max-pixels)")
    v.add_argument("--vision-quantize", dest="vision_mode", metavar="MODE", default=None,
                   help="mode of the vit net (default: the activation type of -q)")
    p.add_argument("--set", action="append", metavar="FIGURE=VALUE",
                   help="change a chip figure (repeatable), e.g. ddr_gbps=128, cores=1, "
                   "tflops.bf16=32")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys "
                   "modelled_ttft_s, modelled_tokens_per_s, weight_bytes, kv_bytes, "
                   "breakdown, ...)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(fn=cmd_estimate)
