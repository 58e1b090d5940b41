"""The compile driver: a causal LM in, one model file out (`toptpu.compile`).

1. load the model (`toptpu.frontends.hf_loader`: a HF directory or an in-memory model);
2. split it into the nets of the net contract (`toptpu.backend.contract`) with
   `toptpu.frontends.llm`, per-layer nets wrapping layer 0;
3. import each net ONCE into Top (torch.export), run `top-pipeline`, check that the
   history nets attend to their caches in place (reload-free), run
   `tpu-pipeline{mode, group_size, symmetric}`;
4. for every layer, derive its tensors for the same compiled per-layer nets from that
   layer's float weights with the tpu.weight recipes (`toptpu.passes.weight_recipe`);
5. write the model file (`toptpu.backend.formats.llm_file`): header, each net's Tpu IR, the
   tokenizer files, and one weight blob [shared][layer 0]...[layer N-1].

Compile time and IR size do not grow with the layer count: only step 4 runs per layer, and
it only quantizes/converts that layer's weights.

Progress goes to stderr; `dump_ir=DIR` writes every net's IR after every pass to
`DIR/<net>/NN-<pass>.mlir`, all pointing (`top.weight_store`) at one
`DIR/weights.safetensors` saved at the end.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import IO, Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.ir import BlockArgument
from xdsl.passes import ModulePass
from xdsl.printer import Printer

from toptpu.backend.codegen.streams import CodegenError, generate
from toptpu.backend.contract import (
    BLOCK,
    HISTORY_K,
    HISTORY_NETS,
    HISTORY_V,
    VISION_NET,
    NetName,
    StaticShapes,
    TensorSpec,
)
from toptpu.backend.formats.header_schema import HeaderError, decode
from toptpu.backend.formats.llm_file import (
    KIND,
    LLM_FORMAT,
    CheckpointInfo,
    CompileInfo,
    Generation,
    LlmHeader,
    ModelInfo,
    NetEntry,
    TokenizerInfo,
    VisionInfo,
    WeightLayout,
    const_section,
    ir_section,
    stream_section,
    write_llm_file,
)
from toptpu.backend.formats.program import constant_pool
from toptpu.backend.target.chips import chip_names, get_chip
from toptpu.dialects import top
from toptpu.dialects.common import numpy_dtype
from toptpu.dialects.naming import input_names, output_names
from toptpu.dialects.weight_store import STORE_ATTR, WeightStore, _torch_to_numpy
from toptpu.frontends.fx_importer import ImportError_, import_module
from toptpu.frontends.hf_loader import LoadedModel, ModelLoadError, load_model
from toptpu.frontends.llm import (
    LAYER_PREFIX,
    LlmArch,
    NetSpec,
    check_block_matches_model,
    split_model,
)
from toptpu.frontends.vlm import load_vlm, vlm_model_type
from toptpu.passes.address_assign import AddressError
from toptpu.passes.convert_top_to_tpu import MODES, ConversionError, parse_mode
from toptpu.passes.layer_group import LayerGroupError
from toptpu.passes.lmem import LocalMemoryError
from toptpu.passes.pipelines import (
    machine_passes,
    run_passes,
    top_pipeline_passes,
    tpu_pipeline_passes,
)
from toptpu.passes.quantize import (
    CHECKPOINT_MODEL,
    QuantizationError,
    checkpoint_key,
    checkpoint_parts,
)
from toptpu.passes.weight_recipe import WeightRecipe, derive_weights, weight_recipes
from toptpu.paths import (
    OutputPathError,
    check_not_inside,
    check_output_dir,
    check_output_file,
    is_inside,
)


class CompileError(Exception):
    """The model cannot be compiled as asked; the message names the problem and the fix."""


def known_chips() -> tuple[str, ...]:
    """Chip names `--chip` accepts: the presets of `toptpu.backend.target.chips`."""
    return tuple(chip_names())


@dataclass
class CompiledNet:
    name: str
    per_layer: bool
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    tpu: ModuleOp
    top: ModuleOp | None = None  # the Top module after top-pipeline, when kept
    ir_bytes: int = 0
    seconds: float = 0.0
    program: Any = None  # the machine's command streams (backend.formats.program.Program)
    stream_bytes: int = 0


@dataclass
class CompileResult:
    """What `compile` produced (the model file is at `path`)."""

    path: str
    header: dict[str, Any]
    nets: dict[str, CompiledNet]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    store: WeightStore | None = None  # the compile-time weight store (layer 0), when kept
    loaded: LoadedModel | None = None


class Progress:
    """Progress over nets and passes on a stream (stderr): a live bar on a terminal, one
    line per net otherwise."""

    def __init__(self, total: int, stream: IO[str] | None) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.parts: list[str] = []
        self.net = ""

    def start(self, net: str) -> None:
        self.net, self.parts = net, []
        self._live("import")

    def step(self, what: str, seconds: float) -> None:
        self.parts.append(f"{what} {seconds:.2f}s")
        self._live(what)

    def _bar(self) -> str:
        width = 20
        filled = width * self.done // max(self.total, 1)
        return f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"

    def _live(self, what: str) -> None:
        if self.tty and self.stream is not None:
            self.stream.write(f"\r\x1b[2K{self._bar()} {self.net}: {what}")
            self.stream.flush()

    def finish(self, seconds: float) -> None:
        self.done += 1
        if self.stream is None:
            return
        line = f"{self._bar()} {self.net} ({seconds:.2f}s): " + ", ".join(self.parts)
        self.stream.write(("\r\x1b[2K" if self.tty else "") + line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()


def print_ir(module: ModuleOp, generic: bool) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic, print_debuginfo=True).print_op(module)
    out.write("\n")
    return out.getvalue()


def _io_specs(module: ModuleOp) -> tuple[list[TensorSpec], list[TensorSpec]]:
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))

    def spec(name: str, t: Any) -> TensorSpec:
        assert isinstance(t, TensorType)
        return TensorSpec(name, tuple(int(d) for d in t.get_shape()),
                          numpy_dtype(t.element_type).name)

    ins = [spec(n, t) for n, t in zip(input_names(fn), fn.function_type.inputs.data,
                                      strict=True)]
    outs = [spec(n, t) for n, t in zip(output_names(fn), fn.function_type.outputs.data,
                                       strict=True)]
    return ins, outs


def check_reload_free(module: ModuleOp, net: str) -> None:
    """A history net must attend to `history_k`/`history_v` as they are (function
    arguments as attention history operands), never through a concatenated copy."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    names = input_names(fn)
    args = {names[a.index]: a for a in fn.body.block.args}
    atts = [op for op in module.walk() if isinstance(op, top.AttentionOp)]
    ok = len(atts) == 1 and atts[0].history_k is args.get(HISTORY_K) and \
        atts[0].history_v is args.get(HISTORY_V)
    concat_of_cache = [op for op in module.walk() if isinstance(op, top.ConcatOp) and any(
        isinstance(v, BlockArgument) and names[v.index] in (HISTORY_K, HISTORY_V)
        for v in op.operands)]
    if not ok or concat_of_cache:
        raise CompileError(
            f"net '{net}': the fuse pass did not turn attention over concat(history, new) into "
            "top.attention with history operands, so decode would copy and reload the KV "
            "cache. The model's attention does not have the form the splitter expects.")


_VARIANT = re.compile(r"v\d+\.")


def layer_key(source: str) -> str | None:
    """'layer.self_attn.q_proj.weight' (or 'v3.layer.…' in a layer variant's nets) ->
    'self_attn.q_proj.weight'; None for a weight that is not per layer."""
    m = _VARIANT.match(source)
    rest = source[m.end():] if m else source
    return rest[len(LAYER_PREFIX):] if rest.startswith(LAYER_PREFIX) else None


def _float_of_layer(model: Any, layer: int) -> Callable[[str], np.ndarray]:
    """Top weight name ('layer.…') -> layer `layer`'s float tensor (zero-copy)."""
    mod = model.model.layers[layer]
    state = dict(mod.named_parameters())
    state.update(dict(mod.named_buffers()))

    def get(source: str) -> np.ndarray:
        key = layer_key(source)
        if key is None:
            raise CompileError(f"'{source}' is not a per-layer weight")
        if key not in state:
            raise CompileError(f"layer {layer} has no tensor '{key}' (the net reads "
                               f"'{source}'); its layers are not all alike")
        return _torch_to_numpy(state[key])

    return get


# ------------------------------------------------------------------ request checks

#: the w4 quantization group size when none is given
DEFAULT_GROUP_SIZE = 64

_W4_MODES = ", ".join(m for m, (_, bits) in MODES.items() if bits == 4)


def check_quant_options(mode: str | None, group_size: int | None, symmetric: bool | None,
                        checkpoint: str | None = None) -> None:
    """Refuse `group_size` / `symmetric` where they would be ignored: the group size shapes
    round-to-nearest quantization in the w4 modes only (w8 is per channel), symmetric in
    the w4 and w8 modes; a pre-quantized `checkpoint` keeps its own (None: not known yet).
    None means "not given"."""
    if group_size is not None and group_size != -1 and group_size <= 0:
        raise CompileError(f"--group-size must be positive or -1 (per channel), not {group_size}")
    bits = MODES[mode][1] if mode in MODES else None
    what = "-q auto" if mode == "auto" else (f"-q {mode}" if mode else "the default mode (f32, "
                                             "or a pre-quantized checkpoint's own)")
    for flag, given, applies in (("--group-size", group_size is not None, bits == 4),
                                 ("--symmetric", bool(symmetric is not None),
                                  bits in (4, 8))):
        if not given:
            continue
        if checkpoint is not None:
            raise CompileError(f"{flag} does not apply to {checkpoint}: a pre-quantized "
                               "checkpoint keeps its own group size and zero points; drop "
                               f"{flag}")
        if not applies:
            modes = _W4_MODES if flag == "--group-size" else "w4 and w8 modes"
            why = " (w8 quantizes per channel)" if flag == "--group-size" and bits == 8 else ""
            raise CompileError(f"{flag} applies to round-to-nearest weight quantization in "
                               f"the {modes}; {what} does not use it{why}: drop {flag} or "
                               "choose such a mode")


def check_compile_request(model: Any, output: str, *, mode: str | None, chip: str,
                          seq_length: int, max_input_length: int | None,
                          max_history: int | None, group_size: int | None,
                          symmetric: bool | None, dump_ir: str | None,
                          vision_mode: str | None = None) -> tuple[StaticShapes, int]:
    """Check `compile`'s arguments and output paths before any work starts (the model's
    config.json is read, its weights are not); return the static shapes and the group
    size to use. Raises CompileError naming the problem."""
    if mode not in (None, "auto"):
        try:
            parse_mode(mode)
        except ValueError as e:
            raise CompileError(f"{e}, or auto (a pre-quantized checkpoint's own)") from e
    if vision_mode is not None:
        try:
            parse_mode(vision_mode)
        except ValueError as e:
            raise CompileError(f"--vision-quantize: {e}") from e
    chips = known_chips()
    if chip not in chips:
        raise CompileError(f"unknown chip '{chip}'; choose one of {', '.join(chips)}")
    check_quant_options(mode, group_size, symmetric)
    try:
        shapes = StaticShapes.make(seq_length, max_input_length, max_history)
    except ValueError as e:
        raise CompileError(str(e)) from e
    try:
        _check_outputs(model, output, dump_ir)
    except OutputPathError as e:
        raise CompileError(str(e)) from e
    found = _text_config(model)
    if found is not None:
        _check_against_config(*found, shapes, mode, group_size)
    return shapes, DEFAULT_GROUP_SIZE if group_size is None else group_size


def _check_outputs(model: Any, output: str, dump_ir: str | None) -> None:
    """The model file and the IR dump directory can be written, neither inside the input
    model directory, and the model file not inside the dumps (which fill DIR/<net>/ and
    DIR/weights.safetensors)."""
    check_output_file(output, "the output file (-o)")
    if dump_ir is not None:
        check_output_dir(dump_ir, "--dump-ir")
        if is_inside(output, dump_ir):
            raise CompileError(f"the output file (-o) '{output}' is inside --dump-ir "
                               f"'{dump_ir}', which the IR dumps fill: write it elsewhere")
    source = model.source if isinstance(model, LoadedModel) else model
    if isinstance(source, str | os.PathLike) and os.path.isdir(source):
        check_not_inside(output, os.fspath(source), "the output file (-o)")
        if dump_ir is not None:
            check_not_inside(dump_ir, os.fspath(source), "--dump-ir")


def _text_config(model: Any) -> tuple[dict[str, Any], str] | None:
    """The (text) model's config as a dict, and where it is from, without loading weights;
    None when it cannot be read (the loader then says why)."""
    if isinstance(model, str | os.PathLike):
        where = os.path.join(os.fspath(model), "config.json")
        try:
            with open(where, "rb") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
    else:
        config = getattr(model, "config", None)
        try:
            raw = config.to_dict() if config is not None else None
        except Exception:  # noqa: BLE001 - a foreign object; the loader reports it
            return None
        where = "the model's config"
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    return (text if isinstance(text, dict) else raw), where


def _positive(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def kv_cache_size(cfg: dict[str, Any], seq_length: int, mode: str | None) -> str | None:
    """'the KV cache alone takes X (2 x layers x SEQ x kv heads x head_dim x bytes)' for a
    config dict, None when the config lacks the sizes."""
    layers, heads = _positive(cfg, "num_hidden_layers"), _positive(cfg, "num_attention_heads")
    hidden = _positive(cfg, "hidden_size")
    if layers is None or heads is None:
        return None
    kv = _positive(cfg, "num_key_value_heads") or heads
    head_dim = _positive(cfg, "head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        return None
    act = MODES[mode][0] if mode in MODES else ("f16/bf16" if mode == "auto" else "f32")
    width = 4 if act == "f32" else 2
    total = 2 * layers * seq_length * kv * head_dim * width
    return (f"{_human_bytes(total)} (2 x {layers} layers x {seq_length} positions x {kv} kv "
            f"heads x {head_dim} x {width} bytes, {act})")


def _check_against_config(cfg: dict[str, Any], where: str, shapes: StaticShapes,
                          mode: str | None, group_size: int | None) -> None:
    check_seq_length(cfg, where, shapes.seq_length, mode)
    check_group_size(cfg, where, mode, group_size)


def check_seq_length(cfg: dict[str, Any], where: str, seq_length: int, mode: str | None,
                     flag: str = "--seq-length", kv_cache: bool = True) -> None:
    """`seq_length` within the config's max_position_embeddings (with `kv_cache` the error
    says how much memory the KV cache would take)."""
    limit = _positive(cfg, "max_position_embeddings")
    if limit is not None and seq_length > limit:
        size = kv_cache_size(cfg, seq_length, mode) if kv_cache else None
        kv = f"; its KV cache alone would take {size}" if size else ""
        raise CompileError(f"{flag} {seq_length} exceeds max_position_embeddings {limit} of "
                           f"{where}{kv}. Use {flag} {limit} or less")


def check_group_size(cfg: dict[str, Any], where: str, mode: str | None,
                     group_size: int | None) -> None:
    """A given w4 group size divides the input dimension of every matmul of the config."""
    if group_size is None or group_size == -1 or mode not in MODES or MODES[mode][1] != 4:
        return
    heads, hidden = _positive(cfg, "num_attention_heads"), _positive(cfg, "hidden_size")
    head_dim = _positive(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    dims = {"hidden_size": hidden, "intermediate_size": _positive(cfg, "intermediate_size"),
            "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None}
    bad = {k: v for k, v in dims.items() if v is not None and v % group_size}
    if bad:
        divisor = math.gcd(*(v for v in dims.values() if v is not None))
        raise CompileError(
            f"--group-size {group_size} does not divide the input dimension of every matmul "
            f"({', '.join(f'{k} {v}' for k, v in bad.items())} in {where}); use a divisor of "
            f"{divisor} or -1 (per channel)")


def compile(  # noqa: A001 - the public API is toptpu.compile
    model: Any,
    output: str,
    *,
    mode: str | None = "f32",
    chip: str = "bm1684x",
    seq_length: int = 512,
    max_input_length: int | None = None,
    max_history: int | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
    dump_ir: str | None = None,
    tokenizer: Any = None,
    progress: IO[str] | None = sys.stderr,
    keep_modules: bool = False,
    image_size: int | None = None,
    max_tiles: int | None = None,
    max_patches: int | None = None,
    vision_mode: str | None = None,
) -> CompileResult:
    """Compile a causal LM (or a VLM: InternVL, MiniCPM-V 4.6) to a model file at `output`.

    `model`: a Hugging Face directory, an in-memory transformers causal LM (with optional
    `tokenizer`), or a `LoadedModel`. `mode`: f32 | f16 | bf16 | w8f16 | w8bf16 | w4f16 |
    w4bf16 | w8f32 | w4f32. Static shapes: `seq_length` (KV capacity), `max_input_length`
    (prefill chunk, default min(SEQ, 128)), `max_history` (history of prefill_kv, default
    SEQ). `group_size` (w4 modes only; default 64, -1 per channel) and `symmetric` (w4/w8
    modes) shape round-to-nearest quantization and are refused where they would be ignored
    (float modes, w8's per-channel scales, pre-quantized checkpoints). Every argument and
    output path is checked before any work starts (`check_compile_request`): `output` and
    `dump_ir` must not lie inside the input model directory. `keep_modules` keeps each
    net's Top and Tpu modules and the weight store in the result (for stage comparisons).
    VLMs (`toptpu.frontends.vlm`) add the `vit` net: `image_size` (tile size; default the
    checkpoint's), `max_tiles` (InternVL tiles / MiniCPM-V slices per image), `max_patches`
    (MiniCPM-V patch budget per slice), `vision_mode` (default: `mode`'s activation type,
    e.g. bf16 for w4bf16 — weight-only quantization is for the text model).
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    given_group_size = group_size
    shapes, group_size = check_compile_request(
        model, output, mode=mode, chip=chip, seq_length=seq_length,
        max_input_length=max_input_length, max_history=max_history, group_size=group_size,
        symmetric=symmetric, dump_ir=dump_ir, vision_mode=vision_mode)

    t = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else _load(
        model, tokenizer, image_size, max_tiles, max_patches, vision_mode)
    timings["load"] = time.perf_counter() - t
    hf = loaded.model
    mode = resolve_mode(mode, loaded)
    if loaded.checkpoint is not None:
        check_quant_options(mode, given_group_size, symmetric, loaded.source)
    arch = LlmArch.of(hf)
    if progress is not None:
        progress.write(f"toptpu compile: {loaded.source} ({arch.family}, {arch.num_layers} "
                       f"layers, hidden {arch.hidden_size}) -> {output} [{mode}, {chip}, "
                       f"seq {shapes.seq_length}, input {shapes.max_input_length}, history "
                       f"{shapes.max_history}]\n")
    specs = split_model(hf, shapes)
    check_block_matches_model(hf, next(s for s in specs if s.name == BLOCK))
    vision, vit_mode = _vision_net(loaded, specs, mode, vision_mode, shapes)
    # layers whose checkpoint quantization differs get per-layer nets of their own
    variants = layer_variants(hf, loaded.checkpoint)
    prefixes = {spec.name: "" for spec in specs}
    for rep in list(variants)[1:]:
        for spec in split_model(hf, shapes, layer=rep):
            if spec.per_layer:
                variant = str(NetName(spec.name, rep))
                specs.append(replace(spec, name=variant))
                prefixes[variant] = f"v{rep}."

    store = WeightStore()
    if loaded.checkpoint is not None:
        add_checkpoint_tensors(store, specs, hf, loaded.checkpoint, prefixes)
    weights_path = None
    if dump_ir is not None:
        os.makedirs(dump_ir, exist_ok=True)
        weights_path = os.path.abspath(os.path.join(dump_ir, "weights.safetensors"))
    bar = Progress(len(specs), progress)
    nets: dict[str, CompiledNet] = {}
    for spec in specs:
        net_mode = vit_mode if vision is not None and spec.name == VISION_NET else mode
        nets[spec.name] = _compile_net(spec, store, net_mode, group_size, symmetric, bar,
                                       dump_ir, weights_path, keep_modules, chip,
                                       prefixes[spec.name])
        timings[f"net:{spec.name}"] = nets[spec.name].seconds

    t = time.perf_counter()
    layout, blob, net_weights = _build_weights(hf, arch.num_layers, nets, store,
                                               loaded.checkpoint, variants)
    timings["weights"] = time.perf_counter() - t
    bar.note(f"weights: {len(layout.shared)} shared tensors ({layout.layer_base / 1e6:.1f} MB) "
             f"+ {arch.num_layers} layers x {len(layout.layer)} tensors "
             f"({layout.layer_stride / 1e6:.2f} MB each) in {timings['weights']:.2f}s")

    irs: dict[str, str] = {}
    for name, net in nets.items():
        m = net.tpu.clone()
        m.attributes.pop(STORE_ATTR, None)
        irs[name] = print_ir(m, generic=True)
        net.ir_bytes = len(irs[name].encode())
    streams: dict[str, bytes] = {}
    for name, net in nets.items():
        data = net.program.to_json()
        net.stream_bytes = len(data)
        streams[stream_section(name)] = data
        streams[const_section(name)] = constant_pool(net.program)
    layer_nets = {
        base: [str(NetName(base, rep)) for i in range(arch.num_layers)
               for rep, layers in variants.items() if i in layers]
        for base in (n for n, net in nets.items()
                     if net.per_layer and not NetName.parse(n).is_variant)}
    vision_info = None if vision is None else {**vision.header(), "mode": vit_mode}
    header = _header(loaded, arch, shapes, mode, chip, group_size, symmetric, nets,
                     net_weights, layout, layer_nets, vision_info,
                     round(time.perf_counter() - t0, 3))
    t = time.perf_counter()
    try:
        write_llm_file(output, header, irs, loaded.tokenizer_files, blob,
                       extra_sections=streams)
    except HeaderError as e:
        raise CompileError(f"the model file header would be invalid: {e}") from e
    timings["write"] = time.perf_counter() - t
    if weights_path is not None:
        _save_store(store, weights_path)
    total = time.perf_counter() - t0
    timings["total"] = total
    bar.note(f"wrote {output} ({os.path.getsize(output) / 1e6:.1f} MB) in {total:.1f}s")
    if not keep_modules:
        for net in nets.values():
            net.top = None
    return CompileResult(output, header.to_json(), nets, total, timings,
                         store if keep_modules else None, loaded)


def _load(model: Any, tokenizer: Any, image_size: int | None, max_tiles: int | None,
          max_patches: int | None, vision_mode: str | None) -> LoadedModel:
    """A VLM through `toptpu.frontends.vlm.load_vlm`, any other model through load_model."""
    if vlm_model_type(model) is not None:
        return load_vlm(model, tokenizer, image_size=image_size, max_tiles=max_tiles,
                        max_patches=max_patches)
    given = [f for f, v in (("--image-size", image_size), ("--max-tiles", max_tiles),
                            ("--max-patches", max_patches), ("--vision-quantize",
                                                             vision_mode)) if v is not None]
    if given:
        raise CompileError(f"{', '.join(given)} apply to vision-language models (InternVL, "
                           "MiniCPM-V 4.6); this model has no vision tower")
    return load_model(model, tokenizer)


def _vision_net(loaded: LoadedModel, specs: list[NetSpec], mode: str, vision_mode: str | None,
                shapes: StaticShapes) -> tuple[Any, str]:
    """A VLM's `vit` net appended to `specs` (checked against the model's own image
    features) and the mode it compiles in."""
    vision = getattr(loaded, "vision", None)
    if vision is None:
        return None, mode
    vit_mode = vision_mode or str(MODES[mode][0])
    try:
        parse_mode(vit_mode)
    except ValueError as e:
        raise CompileError(f"--vision-quantize: {e}") from e
    need = vision.max_image_tokens() + 2
    if need > shapes.seq_length:
        raise CompileError(
            f"an image of up to {vision.max_tiles} tiles needs about {need} tokens, more than "
            f"--seq-length {shapes.seq_length}: raise --seq-length or lower --max-tiles "
            f"(or --image-size)")
    spec = vision.net_spec()
    vision.check(spec)
    specs.append(spec)
    return vision, vit_mode


def _compile_net(spec: NetSpec, store: WeightStore, mode: str, group_size: int,
                 symmetric: bool | None, bar: Progress, dump_ir: str | None,
                 weights_path: str | None, keep_top: bool, chip: str = "bm1684x",
                 weight_prefix: str = "") -> CompiledNet:
    t0 = time.perf_counter()
    bar.start(spec.name)
    step = [0]
    last = [time.perf_counter()]

    def dump(module: ModuleOp, what: str) -> None:
        if dump_ir is None:
            return
        d = os.path.join(dump_ir, spec.name)
        os.makedirs(d, exist_ok=True)
        old = module.attributes.get(STORE_ATTR)
        module.attributes[STORE_ATTR] = StringAttr(str(weights_path))
        try:
            text = print_ir(module, generic=False)
        finally:
            if old is not None:
                module.attributes[STORE_ATTR] = old
        with open(os.path.join(d, f"{step[0]:02d}-{what}.mlir"), "w") as f:
            f.write(text)
        step[0] += 1

    def after(p: ModulePass, module: ModuleOp) -> None:
        now = time.perf_counter()
        bar.step(p.name, now - last[0])
        last[0] = now
        dump(module, p.name)

    try:
        module, _ = import_module(spec.module, spec.args, store=store,
                                  weight_prefix=weight_prefix,
                                  input_names=spec.input_names,
                                  output_names=spec.output_names)
    except ImportError_ as e:
        raise CompileError(f"net '{spec.name}': {e}") from e
    now = time.perf_counter()
    bar.step("import", now - last[0])
    last[0] = now
    dump(module, "import")
    run_passes(module, top_pipeline_passes(), after=after)
    if spec.name in HISTORY_NETS:
        check_reload_free(module, spec.name)
    top_module = module.clone() if keep_top else None
    try:
        run_passes(module, tpu_pipeline_passes(mode, group_size, symmetric), after=after)
    except (ConversionError, QuantizationError) as e:
        raise CompileError(f"net '{spec.name}': {e}") from e
    program = _machine_program(spec.name, module, chip, after)
    ins, outs = _io_specs(module)
    seconds = time.perf_counter() - t0
    bar.finish(seconds)
    return CompiledNet(spec.name, spec.per_layer, ins, outs, module, top_module, 0, seconds,
                       program)


def _machine_program(net: str, module: ModuleOp, chip: str,
                     after: Callable[[ModulePass, ModuleOp], None]) -> Any:
    """The machine passes (layer-group, lmem-verify, address-assign) on a copy of the Tpu
    module, then codegen: the net's command streams."""
    grouped = module.clone()
    try:
        run_passes(grouped, machine_passes(chip), after=after)
        grouped.attributes.pop(STORE_ATTR, None)
        fn = next(op for op in grouped.ops if isinstance(op, func.FuncOp))
        return generate(grouped, fn, get_chip(chip))
    except (LayerGroupError, LocalMemoryError, AddressError, CodegenError) as e:
        raise CompileError(f"net '{net}' on {chip}: {e}") from e


def _save_store(store: WeightStore, path: str) -> None:
    """Save the weight store for the IR dumps; tensors that share memory (tied embeddings)
    are copied, as safetensors stores no aliases."""
    arrays: dict[str, np.ndarray] = {}
    for name in store.names():
        arr = store[name]
        if any(np.may_share_memory(arr, seen) for seen in arrays.values()):
            arr = arr.copy()
        arrays[name] = arr
    WeightStore.from_arrays(arrays).save(path)


def _digest(arr: np.ndarray) -> str:
    a = np.ascontiguousarray(arr)
    h = hashlib.sha1(a.view(np.uint8).reshape(-1).data)  # noqa: S324 - dedup, not security
    return f"{a.dtype.name}{list(a.shape)}{h.hexdigest()}"


def _build_weights(hf: Any, num_layers: int, nets: dict[str, CompiledNet], store: WeightStore,
                   checkpoint: Any = None, variants: dict[int, list[int]] | None = None
                   ) -> tuple[WeightLayout, np.ndarray, dict[str, list[str]]]:
    """Lay out and fill the weight blob: shared tensors once (identical tensors, e.g. tied
    embedding and lm_head, share one copy), then every layer's chunk derived from its own
    float weights (and checkpoint tensors) with the recipes of its per-layer nets. Layers of
    different variants (see `layer_variants`) fill different names of the same chunk layout."""
    variants = variants or {0: list(range(num_layers))}
    shared: dict[str, np.ndarray] = {}
    layer_recipes: dict[str, WeightRecipe] = {}
    variant_recipes: dict[int, dict[str, WeightRecipe]] = {rep: {} for rep in variants}
    net_weights: dict[str, list[str]] = {}
    for net in nets.values():
        names = []
        rep = NetName.parse(net.name).layer
        for r in weight_recipes(net.tpu):
            names.append(r.name)
            if net.per_layer and layer_key(r.source) is not None:
                prev = layer_recipes.setdefault(r.name, r)
                if prev != r:
                    raise CompileError(f"per-layer weight '{r.name}' has two recipes: {prev} "
                                       f"and {r}")
                variant_recipes[rep][r.name] = r
            else:
                arr = store[r.name]
                if r.name in shared and not np.array_equal(shared[r.name], arr):
                    raise CompileError(f"shared weight '{r.name}' differs between nets")
                shared[r.name] = arr
        net_weights[net.name] = list(dict.fromkeys(names))

    def derive(layer: int) -> dict[str, np.ndarray]:
        rep = next(r for r, layers in variants.items() if layer in layers)
        return derive_weights(variant_recipes[rep].values(), _float_of_layer(hf, layer),
                              _checkpoint_of_layer(checkpoint, layer))

    # each variant's own layer from the recipes must be exactly what the compiler stored
    derived: dict[int, dict[str, np.ndarray]] = {}
    for rep in variants:
        derived[rep] = derive(rep)
        for name, arr in derived[rep].items():
            ref = store[name]
            if arr.dtype != ref.dtype or not np.array_equal(
                    arr.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8)):
                raise CompileError(f"the recipe of '{name}' does not reproduce the compiled "
                                   "tensor; convert-top-to-tpu and passes/weight_recipe.py "
                                   "disagree")
    # identical shared tensors are stored once
    unique: dict[str, str] = {}
    alias: dict[str, str] = {}
    for name, arr in shared.items():
        alias[name] = unique.setdefault(_digest(arr), name)
    layout = WeightLayout.plan(
        {n: (tuple(a.shape), a.dtype.name) for n, a in shared.items() if alias[n] == n},
        {n: (r.shape, r.dtype.name) for n, r in layer_recipes.items()}, num_layers)
    for name, target in alias.items():
        layout.shared[name] = layout.shared[target]
    blob = np.zeros(layout.size, np.uint8)

    def put(offset: int, arr: np.ndarray) -> None:
        a = np.ascontiguousarray(arr)
        blob[offset:offset + a.nbytes] = a.view(np.uint8).reshape(-1)

    for name, arr in shared.items():
        if alias[name] == name:
            put(layout.shared[name].offset, arr)
    for i in range(num_layers):
        tensors = derived[i] if i in derived else derive(i)
        for name, arr in tensors.items():
            put(layout.layer_offset(i, name), arr)
    return layout, blob, net_weights


# ------------------------------------------------------------------ pre-quantized checkpoints

#: checkpoint torch dtype -> the activation type `-q auto` picks
AUTO_ACTIVATIONS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def checkpoint_bits(checkpoint: Any) -> int:
    """The weight bits of most of the checkpoint's quantized layers."""
    counts = Counter(ql.bits for ql in checkpoint.linears.values())
    if not counts:
        raise CompileError("the checkpoint has no quantized layers")
    return counts.most_common(1)[0][0]


def resolve_mode(mode: str | None, loaded: LoadedModel) -> str:
    """`-q auto` -> the checkpoint's bits and dtype; and a mode contradicting a pre-quantized
    checkpoint is an error (its integers are used as they are, never re-quantized)."""
    ck = loaded.checkpoint
    if mode is None:
        mode = "f32" if ck is None else "auto"
    if ck is None:
        if mode == "auto":
            raise CompileError(f"-q auto takes a pre-quantized (GPTQ/AWQ/AutoRound) checkpoint; "
                               f"{loaded.source} is a float model: choose a mode such as "
                               "w4bf16")
        return mode
    bits = checkpoint_bits(ck)
    desc = f"{loaded.source} is a {bits}-bit {ck.quant_method} checkpoint"
    if mode == "auto":
        act = AUTO_ACTIVATIONS.get(str(loaded.checkpoint_dtype), "f16")
        return f"w{bits}{act}"
    _, mode_bits = parse_mode(mode)
    if mode_bits != bits:
        raise CompileError(f"-q {mode} contradicts the checkpoint: {desc}; use -q auto or "
                           f"w{bits}f16 / w{bits}bf16 / w{bits}f32 (activation type of your "
                           "choice)")
    return mode


def add_checkpoint_tensors(store: WeightStore, specs: list[NetSpec], hf: Any,
                           checkpoint: Any, prefixes: dict[str, str]) -> None:
    """Put the checkpoint tensors of every quantized linear the nets read (layer 0 for
    per-layer nets) into the weight store next to the float weight, under the names
    `passes.quantize.checkpoint_key(weight, field)`: convert-top-to-tpu then uses them."""
    store[CHECKPOINT_MODEL] = np.ones(1, np.int8)
    hf_names = {id(p): n for n, p in hf.named_parameters()}
    for spec in specs:
        for top_name, p in spec.module.named_parameters():
            hf_name = hf_names.get(id(p), "")
            ql = checkpoint.linears.get(hf_name.removesuffix(".weight"))
            if ql is None or not hf_name.endswith(".weight"):
                continue
            for fld, arr in _checkpoint_fields(ql).items():
                store[checkpoint_key(prefixes[spec.name] + top_name, fld)] = arr


def layer_variants(hf: Any, checkpoint: Any) -> dict[int, list[int]]:
    """Representative layer -> the layers compiled with its nets. Without a checkpoint all
    layers share layer 0's nets; with one, layers whose linears differ in quantization
    (bits, group size, act-order, or left in float) get nets of their own."""
    n = len(hf.model.layers)
    if checkpoint is None:
        return {0: list(range(n))}
    linears = [name for name, m in hf.model.layers[0].named_modules()
               if isinstance(m, __import__("torch").nn.Linear)]

    def signature(i: int) -> tuple:
        sig = []
        for lin in linears:
            ql = checkpoint.linears.get(f"model.layers.{i}.{lin}")
            sig.append(None if ql is None else (ql.bits, ql.group_size, ql.g_idx is not None))
        return tuple(sig)

    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault(signature(i), []).append(i)
    return {layers[0]: layers for layers in groups.values()}


def _checkpoint_fields(ql: Any) -> dict[str, np.ndarray]:
    out = {"qweight": ql.qweight, "scales": ql.scales, "zeros": ql.zeros,
           "meta": np.array([ql.bits, ql.group_size], np.int32)}
    if ql.g_idx is not None:
        out["g_idx"] = ql.g_idx
    return out


def _checkpoint_of_layer(checkpoint: Any, layer: int
                         ) -> Callable[[str], dict[str, np.ndarray] | None] | None:
    """Top weight name ('layer.…weight') -> that layer's checkpoint parts, as the lowering
    packs them (`passes.quantize.checkpoint_parts`)."""
    if checkpoint is None:
        return None

    def get(source: str) -> dict[str, np.ndarray] | None:
        key = layer_key(source)
        if key is None:
            return None
        name = f"model.layers.{layer}.{key}".removesuffix(".weight")
        ql = checkpoint.linears.get(name)
        if ql is None:
            return None
        try:
            return checkpoint_parts(ql.qweight, ql.scales, ql.zeros, ql.g_idx, ql.bits,
                                    ql.group_size, name)
        except QuantizationError as e:
            raise CompileError(str(e)) from e

    return get


def _json_config(config: Any) -> dict[str, Any]:
    return json.loads(config.to_json_string(use_diff=False))


def _header(loaded: LoadedModel, arch: LlmArch, shapes: StaticShapes, mode: str, chip: str,
            group_size: int, symmetric: bool | None, nets: dict[str, CompiledNet],
            net_weights: dict[str, list[str]], layout: WeightLayout,
            layer_nets: dict[str, list[str]], vision: dict[str, Any] | None,
            seconds: float) -> LlmHeader:
    """The model file header (`toptpu.backend.formats.llm_file.LlmHeader`). The parts the
    frontends give as JSON (generation config, vision section) are decoded with the
    schema, so a value the loader would refuse is a compile error naming the field."""
    try:
        toptpu_version = version("toptpu")
    except PackageNotFoundError:
        toptpu_version = "unknown"
    ck = loaded.checkpoint
    try:
        generation = decode(Generation, loaded.generation, "generation")
        vision_info = None if vision is None else decode(VisionInfo, vision, "vision")
    except HeaderError as e:
        raise CompileError(f"the model file header would be invalid: {e}") from e
    return LlmHeader(
        kind=KIND,
        llm_format=LLM_FORMAT,
        chip=chip,
        mode=mode,
        group_size=group_size,
        symmetric=symmetric,
        shapes=shapes,
        model=ModelInfo(**asdict(arch), config=_json_config(loaded.config)),
        generation=generation,
        tokenizer=TokenizerInfo(tuple(sorted(loaded.tokenizer_files))),
        nets={name: NetEntry(inputs=tuple(n.inputs), outputs=tuple(n.outputs),
                             per_layer=n.per_layer, ir=ir_section(name),
                             streams=stream_section(name), consts=const_section(name),
                             weights=tuple(net_weights[name]),
                             commands=len(n.program.commands))
              for name, n in nets.items()},
        layer_nets={base: tuple(names) for base, names in layer_nets.items()},
        weights=layout,
        compile=CompileInfo(source=loaded.source,
                            toptpu_version=toptpu_version),
        checkpoint=None if ck is None else CheckpointInfo(
            quant_method=ck.quant_method, packing_format=ck.packing_format,
            bits=checkpoint_bits(ck), quantized_layers=len(ck.linears),
            dtype=loaded.checkpoint_dtype),
        vision=vision_info,
    )


__all__ = ["CompileError", "CompileResult", "CompiledNet", "ModelLoadError", "compile",
           "known_chips"]
