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

The result also gives the bytes of the model file's weights and of its KV cache, and where
each step's time goes: DDR-bound nets, compute-bound nets, net launches, host transfers.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    EMBEDDING,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HISTORY_K,
    LM_HEAD,
    PER_LAYER_NETS,
    SAMPLE_HEAD,
    TEXT_NETS,
    StaticShapes,
    net_io,
)
from toptpu.backend.formats.llm_file import WeightLayout
from toptpu.backend.formats.program import Program
from toptpu.backend.runtime.accounting import SAMPLERS, Costs, StepModel, net_costs
from toptpu.backend.runtime.machine import command_costs
from toptpu.backend.target.chips import (
    DEFAULT_CHIP,
    FIGURES,
    Chip,
    ChipFigureError,
    chip_names,
    get_chip,
)
from toptpu.backend.target.cost import CommandCost, NetTiming, net_timing
from toptpu.cli_args import (
    UsageError,
    add_static_shape_args,
    add_weight_quant_args,
    int_at_least,
)
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import CompileError, ToptpuError
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.convert_top_to_tpu import parse_mode
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes

#: the nets a decode-speed and first-token estimate needs (prompts of at most one chunk)
STEP_NETS = (EMBEDDING, EMBEDDING_CACHE, BLOCK, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD)


class EstimateError(UsageError):
    """An estimate that cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """The widths the nets' IO and the model file depend on (`contract.ModelWidths`)."""

    family: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool


@dataclass
class CompiledCosts:
    """The command streams of a model's nets (one layer compiled), reduced to what timing
    needs, with the model file's weight and KV-cache bytes. JSON-serializable: what a
    cache or a sweep keeps of a compile."""

    model: ModelShape
    mode: str
    shapes: StaticShapes
    commands: dict[str, list[CommandCost]]
    weight_bytes: int
    kv_bytes: int
    compile_s: float = 0.0

    @property
    def act(self) -> str:
        return act_dtype(self.mode)

    def io(self) -> dict[str, Any]:
        return net_io(self.shapes, self.model, self.act)

    def timings(self, chip: Chip, nets: Sequence[str] | None = None) -> dict[str, NetTiming]:
        """Each compiled net (or `nets`) timed on `chip`."""
        return {name: net_timing(self.commands[name], chip)
                for name in (self.commands if nets is None else nets)}

    def to_json(self) -> dict[str, Any]:
        return {"model": asdict(self.model), "mode": self.mode, "shapes": asdict(self.shapes),
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "compile_s": self.compile_s,
                "commands": {n: [[int(c.dma), c.nbytes, c.flops, c.dtype, list(c.deps)]
                                 for c in cmds] for n, cmds in self.commands.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CompiledCosts:
        return cls(model=ModelShape(**d["model"]), mode=d["mode"],
                   shapes=StaticShapes(**d["shapes"]),
                   commands={n: [CommandCost(bool(c[0]), int(c[1]), int(c[2]), str(c[3]),
                                             tuple(c[4])) for c in cmds]
                             for n, cmds in d["commands"].items()},
                   weight_bytes=int(d["weight_bytes"]), kv_bytes=int(d["kv_bytes"]),
                   compile_s=float(d.get("compile_s", 0.0)))


def act_dtype(mode: str) -> str:
    """numpy dtype name of a mode's activations."""
    return {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[QuantMode(mode).activation]


# =========================================================================== compiling


def model_shape(config: Any) -> ModelShape:
    heads = int(config.num_attention_heads)
    return ModelShape(
        family=str(config.model_type), num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        vocab_size=int(config.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def compile_costs(config: Any, chip: Chip, mode: str, shapes: StaticShapes,
                  group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool | None = None,
                  nets: Sequence[str] = TEXT_NETS, progress: IO[str] | None = None
                  ) -> CompiledCosts:
    """Compile `nets` of the model of `config` (one layer, placeholder weights) for `chip`
    and keep their command costs."""
    from toptpu.frontends.hf_loader import placeholder_model
    from toptpu.frontends.llm import split_model

    t0 = time.perf_counter()
    shape = model_shape(config)
    model = placeholder_model(config, layers=1)
    act = QuantMode(mode).activation
    specs = {s.name: s for s in split_model(model, shapes, act=act)}
    unknown = [n for n in nets if n not in specs]
    if unknown:
        raise EstimateError(f"unknown nets {unknown}; nets: {', '.join(specs)}")
    store = WeightStore()
    programs: dict[str, Program] = {}
    for name in nets:
        t = time.perf_counter()
        programs[name] = net_program(specs[name], store, mode, group_size, symmetric, chip)
        if progress is not None:
            progress.write(f"  {name}: {len(programs[name].commands)} commands "
                           f"({time.perf_counter() - t:.1f}s)\n")
            progress.flush()
    return CompiledCosts(
        model=shape, mode=mode, shapes=shapes,
        commands={n: command_costs(p.commands) for n, p in programs.items()},
        weight_bytes=weight_bytes(programs, shape), kv_bytes=kv_bytes(shape, shapes, mode),
        compile_s=time.perf_counter() - t0)


def net_program(spec: Any, store: WeightStore, mode: str, group_size: int,
                symmetric: bool | None, chip: Chip) -> Program:
    """One net as `toptpu compile` compiles it, on any chip: its command streams."""
    from toptpu.frontends.fx_importer import import_module

    try:
        module, _ = import_module(spec.module, spec.args, store=store,
                                  input_names=spec.input_names,
                                  output_names=spec.output_names)
        run_passes(module, top_pipeline_passes(), store=store)
        run_passes(module, tpu_pipeline_passes(spec.mode or mode, group_size, symmetric,
                                               keep_input_types=spec.keep_input_types),
                   store=store)
    except ToptpuError as e:  # importing or lowering the net
        raise CompileError(f"net '{spec.name}': {e}") from e
    try:
        return compile_for_machine(module, chip)
    except ToptpuError as e:  # the machine passes and codegen: what the chip cannot hold
        raise CompileError(f"net '{spec.name}' on {chip.name}: {e}") from e


def weight_bytes(programs: Mapping[str, Program], shape: ModelShape) -> int:
    """The model file's weight blob as the compiler lays it out: the shared weights once
    (a tied lm_head shares the embedding table; a per-layer net's weight that is not the
    layer's own, e.g. rotary frequencies, is shared too), then every layer's chunk
    (`WeightLayout`)."""
    from toptpu.layer_weights import layer_key

    shared: dict[str, tuple[tuple[int, ...], str]] = {}
    layer: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, prog in programs.items():
        for w, spec in prog.weights.items():
            per_layer = name in PER_LAYER_NETS and layer_key(w) is not None
            (layer if per_layer else shared)[w] = (tuple(spec.shape), str(spec.dtype))
    if shape.tied_embeddings:  # one tensor feeds the gather and the lm_head
        tables = [w for w, s in shared.items() if s[0] == (shape.vocab_size, shape.hidden_size)]
        for w in tables[1:]:
            del shared[w]
    return WeightLayout.plan(shared, [layer], [0] * shape.num_layers).size


def kv_bytes(shape: ModelShape, shapes: StaticShapes, mode: str) -> int:
    """Both caches of every layer: 2 x layers x SEQ x kv heads x head_dim x act bytes."""
    ins, _ = net_io(shapes, shape, act_dtype(mode))[BLOCK_CACHE]
    history = next(s for s in ins if s.name == HISTORY_K)
    return 2 * shape.num_layers * history.nbytes


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

    @property
    def ttft_s(self) -> float:
        return self.first_token.total_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token.total_s

    def net_json(self) -> dict[str, dict[str, Any]]:
        layers = self.compiled.model.num_layers
        out = {}
        for name, t in self.nets.items():
            c = net_costs(self.chip, t)
            out[name] = {"seconds": t.seconds(self.chip), "bound": t.bound,
                         "dma_bytes": t.dma_bytes, "flops": t.flops,
                         "runs_per_step": layers if name in PER_LAYER_NETS else 1,
                         "launch_s": c.launch_s}
        return out

    def to_json(self) -> dict[str, Any]:
        m = self.compiled
        return {
            "modelled_ttft_s": self.ttft_s,
            "modelled_tokens_per_s": self.tokens_per_s,
            "weight_bytes": m.weight_bytes,
            "kv_bytes": m.kv_bytes,
            "breakdown": {"first_token": self.first_token.to_json(),
                          "per_decoded_token": self.per_token.to_json(),
                          "nets": self.net_json()},
            "chip": self.chip.to_json(),
            "mode": m.mode,
            "shapes": asdict(m.shapes),
            "model": asdict(m.model),
            "prompt_tokens": self.prompt_tokens,
            "sampler": self.sampler,
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
    needed = _needed_nets(tokens, compiled.shapes, sampler)
    missing = sorted(set(needed) - set(compiled.commands))
    if missing:
        raise EstimateError(f"this estimate needs the nets {missing}, which were not compiled")
    timings = compiled.timings(chip)
    steps = StepModel(chip, compiled.io(), timings, compiled.model.num_layers)
    return Estimate(chip, compiled, tokens, sampler, steps.first_token(tokens, sampler),
                    steps.per_token(sampler), timings)


def _needed_nets(tokens: int, shapes: StaticShapes, sampler: str) -> list[str]:
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
    nets += {"greedy": [GREEDY_HEAD], "sample": [SAMPLE_HEAD], "host": []}[sampler]
    return list(dict.fromkeys(nets))


def estimate_nets(shapes: StaticShapes, prompt_tokens: int | None, sampler: str) -> list[str]:
    """The nets `toptpu estimate` compiles: every net of a model file at its longest
    prefill length, and the shorter prefill nets the prompt's chunks run."""
    tokens = shapes.max_input_length if prompt_tokens is None else prompt_tokens
    needed = _needed_nets(tokens, shapes, sampler) \
        if 1 <= tokens <= shapes.seq_length and sampler in SAMPLERS else []
    return list(dict.fromkeys([*TEXT_NETS, *needed]))


# =========================================================================== the command


def summary(est: Estimate) -> str:
    """The estimate for a reader."""
    m, chip = est.compiled, est.chip
    s = m.shapes
    lines = [
        f"{m.model.family}: {m.model.num_layers} layers, hidden {m.model.hidden_size}, "
        f"{m.model.num_kv_heads} KV heads x {m.model.head_dim}, vocab {m.model.vocab_size}; "
        f"{m.mode} on {chip.name} ({chip.cores} core(s), {chip.sustained_gbps:.3g} GB/s "
        f"sustained DDR); seq {s.seq_length}, input {s.max_input_length}, history "
        f"{s.max_history}, prefill lengths {', '.join(map(str, s.prefill_lengths))}",
        f"weights {m.weight_bytes / 1e6:.1f} MB, KV cache {m.kv_bytes / 1e6:.1f} MB",
        f"time to first token ({est.prompt_tokens}-token prompt): {est.ttft_s * 1e3:.2f} ms "
        f"modelled ({_where(est.first_token)})",
        f"decode: {est.tokens_per_s:.2f} tokens/s modelled, {est.per_token.total_s * 1e3:.3f} "
        f"ms per token ({_where(est.per_token)})",
        f"{'net':<16} {'runs/step':>9} {'ms/run':>9} {'bound':>8} {'MB moved':>9} "
        f"{'GFLOP':>8}",
    ]
    for name, row in est.net_json().items():
        lines.append(f"{name:<16} {row['runs_per_step']:>9} {row['seconds'] * 1e3:>9.4f} "
                     f"{row['bound']:>8} {row['dma_bytes'] / 1e6:>9.2f} "
                     f"{row['flops'] / 1e9:>8.3f}")
    return "\n".join(lines)


def _where(c: Costs) -> str:
    parts = [f"{name} {getattr(c, f'{name}_s') / c.total_s:.0%}"
             for name in ("ddr", "compute", "launch", "host")]
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
    for k in FIGURES:
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
               "dma_latency_cycles", "compute_latency_cycles")


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


def read_checked_config(config_dir: str, mode: str, seq_length: int,
                        group_size: int | None = None, symmetric: bool | None = None) -> Any:
    """The config of `config_dir`, checked as `toptpu compile` checks it for `mode` and
    `seq_length` (a user error names the problem)."""
    from toptpu.compile_options import (
        check_group_size,
        check_quant_options,
        check_seq_length,
    )
    from toptpu.frontends.hf_loader import check_config, read_config

    try:
        parse_mode(mode)
    except ValueError as e:
        raise CompileError(str(e)) from e
    check_quant_options(mode, group_size, symmetric)
    config, raw = read_config(config_dir)
    where = f"{config_dir}/config.json"
    check_config(_without_quantization(config), where)
    check_seq_length(raw, where, seq_length, mode)
    check_group_size(raw, where, mode, group_size)
    return config


def cmd_estimate(args: Any) -> int:
    """Modelled time to first token and decode speed of a model on a chip, from its
    config.json alone (one layer compiled with placeholder weights)."""
    try:
        shapes = StaticShapes.make(args.seq_length, args.max_input_length, args.max_history,
                                   args.prefill_lengths)
        base = get_chip(args.chip)
        chip = chip_with(base, parse_figures(args.set, base))
    except (ValueError, ChipFigureError) as e:
        raise CompileError(str(e)) from e
    config = read_checked_config(args.config_dir, args.mode, shapes.seq_length,
                                 args.group_size, args.symmetric)
    progress = None if args.json or args.quiet else sys.stderr
    if progress is not None:
        progress.write(f"toptpu estimate: compiling one layer of {args.config_dir} "
                       f"(placeholder weights) for {chip.name}\n")
    compiled = compile_costs(config, chip, args.mode, shapes,
                             DEFAULT_GROUP_SIZE if args.group_size is None else args.group_size,
                             args.symmetric,
                             nets=estimate_nets(shapes, args.prompt_tokens, args.sampler),
                             progress=progress)
    est = estimate(compiled, chip, args.prompt_tokens, args.sampler)
    print(json.dumps(est.to_json(), indent=1) if args.json else summary(est))
    return 0


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
    add_static_shape_args(p)
    add_weight_quant_args(p)
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None,
                   help="prompt length of the time to first token (default: one chunk, "
                   "--max-input-length); its chunks run at the shortest prefill length "
                   "that holds them, as `toptpu run` runs them")
    p.add_argument("--sampler", choices=list(SAMPLERS), default="greedy",
                   help="how tokens are chosen: greedy_head or sample_head on the chip, or "
                   "on the host from the logits read back")
    p.add_argument("--set", action="append", metavar="FIGURE=VALUE",
                   help="change a chip figure (repeatable), e.g. ddr_gbps=128, cores=1, "
                   "tflops.bf16=32")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys "
                   "modelled_ttft_s, modelled_tokens_per_s, weight_bytes, kv_bytes, "
                   "breakdown, ...)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(fn=cmd_estimate)
