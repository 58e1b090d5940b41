"""The compile driver: a causal LM (or a VLM) in, one model file out (`toptpu.compile`).

`compile` checks its request (`toptpu.request.CompileRequest`, built from its keywords
when not given; `compile_options.check_compile_request`: against the output paths and the
model's config) and composes four steps, each with a typed result:

1. `plan(model, request) -> CompilePlan`: load the model (`frontends.hf_loader` /
   `frontends.vlm`), resolve the quantization mode (a pre-quantized checkpoint's own:
   `toptpu.prequantized`), split it into the nets of the net contract
   (`toptpu.backend.contract`, `frontends.llm`; per-layer nets wrap layer 0, and each layer
   variant of a mixed checkpoint its representative), and say where each layer's tensors
   come from (`toptpu.layer_weights`). Nothing is compiled yet.
2. `compile_nets(plan) -> CompiledNets`: each net compiled by `net_compiler.compile_net`
   (as `toptpu estimate` and `toptpu compare` compile theirs): imported ONCE into Top
   (torch.export) with its weights in one in-memory weight store, `top-pipeline`, the
   history nets checked to attend to their caches in place (reload-free), `tpu-pipeline{mode,
   group_size, symmetric}`, then the machine pipeline and codegen
   (`toptpu.machine_pipeline`).
3. `pack_weights(plan, compiled) -> PackedWeights`: the weight blob's layout
   (`WeightLayout`: shared tensors once, then one chunk per layer, laid out as its layer
   variant's: each variant's chunk holds only its own tensors) and its bytes, made region
   by region: every layer's tensors derived from that layer's own float weights (and
   checkpoint tensors) with the recipes of the compiled per-layer nets
   (`toptpu.passes.weight_recipe`), one layer at a time.
4. `write(plan, compiled, packed, output)`: the model file (`backend.formats.llm_file`):
   header, each net's Tpu IR, command streams and constants, the tokenizer files, the blob.

Compile time and IR size do not grow with the layer count: only step 3 runs per layer, and
it only quantizes/converts that layer's weights.

Progress goes to stderr; `dump_ir=DIR` writes every net's IR after every pass to
`DIR/<net>/NN-<pass>.mlir`, all pointing (`top.weight_store`) at one
`DIR/weights.safetensors` (the compile-time store, saved once the nets are compiled).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import IO, Any

import numpy as np
from jinja2 import TemplateSyntaxError
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    CONV_STATE,
    EMBEDDING,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HISTORY_K,
    HISTORY_V,
    LINEAR_ATTENTION,
    LM_HEAD,
    RECURRENT_STATE,
    NetName,
    StaticShapes,
)
from toptpu.backend.formats.header_schema import HeaderError, decode
from toptpu.backend.formats.llm_file import (
    KIND,
    LLM_FORMAT,
    CheckpointInfo,
    CompileInfo,
    DeviceInfo,
    FromIrInfo,
    Generation,
    IoSplit,
    LinearAttentionInfo,
    LlmHeader,
    ModelInfo,
    NetEntry,
    ParallelInfo,
    PluginOpInfo,
    TokenizerInfo,
    VisionInfo,
    WeightLayout,
    const_section,
    ir_section,
    stream_section,
    weights_section,
    write_llm_file,
)
from toptpu.backend.formats.model_file import StreamedGroup, StreamedSection
from toptpu.backend.formats.program import constant_pool
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.machine import command_costs
from toptpu.backend.runtime.runtime import TemplateLimitError, Tokenizer
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import net_timing
from toptpu.compile_options import (
    DEFAULT_GROUP_SIZE,
    CompileError,
    check_compile_request,
    check_group_size,
    check_quant_options,
    check_seq_length,
    known_chips,
    kv_cache_size,
)
from toptpu.devices import Parallel, balance_layers, devices_needed
from toptpu.dialects import plugin_ops
from toptpu.dialects.common import QuantMode
from toptpu.dialects.sharding import (
    device_tensor,
    parse_shard_name,
    take_piece,
)
from toptpu.dialects.top import weight_name
from toptpu.dialects.weight_store import STORE_ATTR, WeightStore
from toptpu.frontends.gguf_loader import gguf_file_of, load_gguf
from toptpu.frontends.hf_loader import LoadedModel, ModelLoadError, load_model
from toptpu.frontends.llm import (
    LlmArch,
    check_block_matches_model,
    layer_key,
    split_model,
)
from toptpu.frontends.moe import is_moe_block
from toptpu.frontends.streaming import load_streaming
from toptpu.frontends.vlm import load_vlm, vlm_model_type
from toptpu.ir_dump import DumpWriter, print_ir
from toptpu.layer_weights import (
    CheckpointOf,
    LayerWeights,
    ModelLayerWeights,
    StreamedLayerWeights,
)
from toptpu.net_compiler import (
    CompiledNet,
    NetPlan,
    OnStep,
    check_reload_free,
    check_state_in_place,
    compile_net,
    io_specs,
)
from toptpu.passes.weight_recipe import WeightRecipe, derive_weights, weight_recipes
from toptpu.prequantized import (
    add_checkpoint_tensors,
    checkpoint_bits,
    layer_variants,
    resolve_mode,
)
from toptpu.progress import elapsed_line, progress_bar
from toptpu.request import AskedMode, CompileRequest, activation_mode
from toptpu.weight_calibration import calibrate, request_for_mode
from toptpu.weight_calibration.data import write_default_text

# ====================================================================== the steps' results


@dataclass
class CompilePlan:
    """What `compile` builds, decided before any net is compiled (step 1)."""

    loaded: LoadedModel
    arch: LlmArch
    request: CompileRequest
    mode: QuantMode  # the quantization mode, resolved (`prequantized.resolve_mode`)
    nets: list[NetPlan]  # in compile order
    #: representative layer -> the layers compiled with its per-layer nets
    variants: dict[int, list[int]]
    layers: LayerWeights  # where each layer's tensors come from
    vision: Any = None  # a VLM's vision tower (`frontends.vlm`), None for an LLM
    vit_mode: QuantMode | None = None  # the vit net's mode
    load_seconds: float = 0.0
    #: `--calibrate`: the temporary directory of the calibrated checkpoint compiled
    scratch: CalibrationScratch | None = None
    calibrate_seconds: float = 0.0

    def release(self) -> None:
        """Remove the calibrated checkpoint's temporary directory (`CalibrationScratch`)."""
        if self.scratch is not None:
            self.scratch.remove()

    @property
    def chip(self) -> Chip:
        return self.request.chip

    @property
    def shapes(self) -> StaticShapes:
        return self.request.shapes

    @property
    def group_size(self) -> int:
        return self.request.quant_group_size

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def variant_of(self, layer: int) -> int:
        """The representative layer whose per-layer nets `layer` runs with."""
        return next(rep for rep, layers in self.variants.items() if layer in layers)


@dataclass
class CompiledNets:
    """Every net compiled (step 2), and the compile-time weight store their modules name:
    the shared tensors and the representative layers' tensors, as compiled."""

    nets: dict[str, CompiledNet]
    store: WeightStore


@dataclass
class PackedWeights:
    """The weight blob (step 3): its layout, the tensors each net reads, and its bytes made
    piece by piece (`pieces`): each shared tensor, then one layer's tensors at a time. The
    shared tensors of a streamed checkpoint's placeholders are derived from the checkpoint
    when their piece is written (`streamed`)."""

    layout: WeightLayout
    net_weights: dict[str, list[str]]  # net -> the tpu.weight names it reads
    shared: dict[str, np.ndarray]  # shared tensors stored (one of each identical set)
    derive: Callable[[int], dict[str, np.ndarray]]  # layer -> its tensors by name
    #: stored shared tensors from a placeholder: their recipes, by placeholder source
    streamed: dict[str, list[WeightRecipe]] = field(default_factory=dict)
    #: the recipes of one placeholder source -> their tensors (`StreamedWeights.shared`)
    derive_shared: Callable[[list[WeightRecipe]], dict[str, np.ndarray]] | None = None
    #: called once a layer's tensors are written (a stream drops the pages it read)
    release: Callable[[], None] = lambda: None

    #: the model's layers this blob holds (its chunk i is layer layers.start + i)
    layers: range | None = None
    #: the recipes of the per-layer tensors, by the layer variant's representative
    variant_recipes: dict[int, dict[str, WeightRecipe]] = field(default_factory=dict)
    #: called once a layer's tensors are written, after `release` (the progress line)
    layer_written: Callable[[], None] = lambda: None

    def pieces(self) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) of every stored tensor in blob order (the bytes between them are
        zero): the shared ones, then layer 0, 1, ..."""
        yield from self.shared_pieces()
        for i in range(self.layout.num_layers):
            yield from self.layer_pieces(i)

    def layer_pieces(self, i: int) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) of the tensors of the blob's i-th layer chunk, in order."""
        layout = self.layout
        base, chunk = layout.layer_start(i), layout.chunk_of(i)
        tensors = self.derive(i)
        if set(tensors) != set(chunk):
            raise CompileError(f"layer {i}: its recipes give the tensors "
                               f"{sorted(set(tensors) ^ set(chunk))[:3]}, which its chunk "
                               "layout does not have (or lacks)")
        for name in sorted(tensors, key=lambda n: chunk[n].offset):
            yield base + chunk[name].offset, _bytes(tensors[name])
        del tensors
        self.release()
        self.layer_written()

    def shared_pieces(self) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) of the shared tensors, in blob order."""
        layout = self.layout
        group_of = {r.name: recipes for recipes in self.streamed.values() for r in recipes}
        stored = [(n, e) for n, e in layout.shared.items() if n in self.shared or n in group_of]
        made: dict[str, np.ndarray] = {}
        for name, entry in sorted(stored, key=lambda kv: kv[1].offset):
            if name in group_of and name not in made:
                assert self.derive_shared is not None
                made.update(self.derive_shared(group_of[name]))
            # not bound to a name here: a derived tensor goes once it is written
            yield entry.offset, _bytes(made.pop(name) if name in group_of
                                       else self.shared[name])

    def section(self) -> StreamedSection:
        """The blob as a model file section, written piece by piece."""
        return StreamedSection(self.layout.size, self.pieces)

    def blob(self) -> np.ndarray:
        """The whole blob in memory."""
        blob = np.zeros(self.layout.size, np.uint8)
        for offset, data in self.pieces():
            blob[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
        return blob


def _bytes(arr: np.ndarray) -> memoryview:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


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


# ====================================================================== compile


def compile(  # noqa: A001 - the public API is toptpu.compile
    model: Any,
    output: str,
    request: CompileRequest | None = None,
    *,
    tokenizer: Any = None,
    progress: IO[str] | None = sys.stderr,
    keep_modules: bool = False,
    **keywords: Any,
) -> CompileResult:
    """Compile a causal LM (or a VLM: InternVL, MiniCPM-V 4.6/4.7, Qwen2.5-VL, Qwen3-VL,
    Qwen3.5) to a model file at `output`, as `request` asks (a `toptpu.request.
    CompileRequest`), or as the `keywords` ask (`CompileRequest.make(**keywords)`; the
    options of `toptpu compile`, by their Python names):

    `model`: a Hugging Face directory, an in-memory transformers causal LM (with optional
    `tokenizer`), or a `LoadedModel`. `mode`: f32 | f16 | bf16 | w8f16 | w8bf16 | w4f16 |
    w4bf16 | w8f32 | w4f32 | auto (default: f32, or a pre-quantized checkpoint's own).
    `chip`: a preset's name. Static shapes: `seq_length` (KV capacity, default 512),
    `max_input_length` (prefill chunk, default min(SEQ, 128)), `max_history` (history of
    prefill_kv, default SEQ), `prefill_lengths` (the chunk lengths the prefill nets are
    compiled at besides `max_input_length`; default 16, 32, 64, ... below it: a short
    prompt runs the shortest that holds it). `group_size` (w4 modes only; default 64, -1 per
    channel) and `symmetric` (w4/w8 modes) shape round-to-nearest quantization and are
    refused where they would be ignored (float modes, w8's per-channel scales,
    pre-quantized checkpoints). Every argument and output path is checked before any work
    starts (`check_compile_request`): `output` and `dump_ir` must not lie inside the input
    model directory. `keep_modules` keeps each net's Top and Tpu modules and the weight
    store in the result (for stage comparisons).
    VLMs (`toptpu.frontends.vlm`) add the `vit` net: `image_size` (tile size; default the
    checkpoint's), `max_tiles` (InternVL tiles / MiniCPM-V slices per image), `max_patches`
    (MiniCPM-V patch budget per slice; Qwen-VL patch budget per image or video),
    `max_pixels` (Qwen-VL: the budget as W x H pixels; default 768 x 768), `vision_mode`
    (default: `mode`'s activation type, e.g. bf16 for w4bf16 — weight-only quantization is
    for the text model).
    A GGUF file (or a directory holding one, `frontends.gguf_loader`) compiles from its
    F32/F16/BF16 tensors; `dequantize` (a mode) dequantizes its quantized tensors and
    compiles in that mode. `devices` > 1 spreads the model over that many chips,
    `parallel` "tp" (tensor parallel, the default), "pp" (pipeline parallel) or "ep"
    (expert parallel, a mixture of experts): see `toptpu.devices`. Every device's weights
    and KV cache must fit its memory (`Chip.ddr_bytes`): a model that does not is refused
    with the device count it needs.
    """
    t0 = time.perf_counter()
    request = check_compile_request(model, output, request, **keywords)
    the_plan = plan(model, request, tokenizer=tokenizer, output=output, progress=progress,
                    stream=not keep_modules)
    try:
        return _compile_planned(the_plan, output, progress, keep_modules, t0)
    finally:
        the_plan.release()


def _compile_planned(the_plan: CompilePlan, output: str, progress: IO[str] | None,
                     keep_modules: bool, t0: float) -> CompileResult:
    """Steps 2-4 of `compile` on its plan."""
    timings = {"load": the_plan.load_seconds}
    if the_plan.scratch is not None:
        timings["calibrate"] = the_plan.calibrate_seconds
    bar = Progress(len(the_plan.nets), progress)
    compiled = compile_nets(the_plan, bar, keep_top=keep_modules)
    timings.update({f"net:{name}": net.seconds for name, net in compiled.nets.items()})
    return finish(the_plan, compiled, output, bar, timings, t0, keep_modules)


def finish(the_plan: CompilePlan, compiled: CompiledNets, output: str, bar: Progress,
           timings: dict[str, float], t0: float, keep_modules: bool = False,
           from_ir: FromIrInfo | None = None) -> CompileResult:
    """Steps 3 and 4 of a compile whose nets are compiled (by `compile_nets`, or picked up
    from a dump by `toptpu.from_ir`): the weights packed (per device), checked to fit, and
    the model file written."""
    t = time.perf_counter()
    packed: PackedWeights | DeviceWeights
    if the_plan.request.parallel is None:
        packed = pack_weights(the_plan, compiled)
        layout = packed.layout
        check_fits(the_plan, compiled, [(packed.layout, range(the_plan.num_layers))])
        bar.note(f"weights: {len(layout.shared)} shared tensors "
                 f"({layout.shared_size / 1e6:.1f} MB) + {_chunk_summary(layout)}")
    else:
        placement = place(the_plan, compiled)
        packed = pack_device_weights(the_plan, compiled, placement)
        check_fits(the_plan, compiled, [(p.layout, r) for p, r in
                                         zip(packed.devices, placement.layers, strict=True)])
        for d, (p, r) in enumerate(zip(packed.devices, placement.layers, strict=True)):
            bar.note(f"device {d}: layers {r.start}-{r.stop - 1}, "
                     f"{p.layout.size / 1e6:.1f} MB of weights")
    timings["weights"] = time.perf_counter() - t

    t = time.perf_counter()
    with progress_bar(the_plan.num_layers, "toptpu compile: writing weights", unit="layer",
                      stream=bar.stream, shown=bar.tty) as layers_bar:
        for p in [packed] if isinstance(packed, PackedWeights) else packed.devices:
            p.layer_written = lambda: layers_bar.update(1)
        header = write(the_plan, compiled, packed, output, from_ir)
    timings["write"] = time.perf_counter() - t
    total = time.perf_counter() - t0
    timings["total"] = total
    bar.note(f"wrote {output} ({os.path.getsize(output) / 1e6:.1f} MB) in {total:.1f}s")
    if not keep_modules:
        for net in compiled.nets.values():
            net.top = None
    return CompileResult(output, header.to_json(), compiled.nets, total, timings,
                         compiled.store if keep_modules else None, the_plan.loaded)


# ====================================================================== step 1: plan


def plan(model: Any, request: CompileRequest, *, tokenizer: Any = None, output: str = "",
         progress: IO[str] | None = None, stream: bool = True) -> CompilePlan:
    """Load the model and decide what to compile: the mode, the nets (with each layer
    variant's), where each layer's tensors come from. A line naming the model and the
    request goes to `progress` once the model is loaded.

    A float checkpoint directory is streamed (`frontends.streaming`) when `stream` is on and
    no IR is dumped (the dumps' weights would be the skeleton's placeholders): the nets come
    from a skeleton, every layer's tensors from the shards when its chunk is written.

    With `request.calibration` (`--calibrate`) the float model is first calibrated
    (`toptpu.weight_calibration`) into a checkpoint in a temporary directory beside the
    output (`CalibrationScratch`), which is then planned as any pre-quantized checkpoint;
    `CompilePlan.release` (called by `compile` once the file is written, on an error and
    on an interrupt; or when the plan is let go) removes it."""
    if request.calibration is not None:
        return _calibrated_plan(model, request, tokenizer=tokenizer, output=output,
                                progress=progress, stream=stream)
    t = time.perf_counter()
    tty = progress is not None and Progress(0, progress).tty
    with elapsed_line(f"toptpu compile: loading {model if isinstance(model, str) else 'the model'}",
                      stream=progress, shown=tty):
        loaded = model if isinstance(model, LoadedModel) else _load(
            model, tokenizer, request.image_size, request.max_tiles, request.max_patches,
            request.vision_mode, stream=stream and request.dump_ir is None,
            dequantize=request.dequantize, mode=request.mode, max_pixels=request.max_pixels)
    load_seconds = time.perf_counter() - t
    check_chat_template(loaded.tokenizer_files, loaded.source)
    hf = loaded.model
    mode = resolve_mode(request.mode, loaded)
    if loaded.checkpoint is not None:
        check_quant_options(mode, request.group_size, request.symmetric, loaded.source,
                            request.keep_float)
    arch = LlmArch.of(hf)
    check_parallel_model(loaded, arch, request)
    shapes = request.shapes
    if progress is not None:
        spread = "" if request.parallel is None else \
            f", {request.devices} devices {request.parallel}"
        progress.write(f"toptpu compile: {loaded.source} ({arch.family}, {arch.num_layers} "
                       f"layers, hidden {arch.hidden_size}) -> {output} [{mode}, "
                       f"{request.chip.name}{spread}, seq {shapes.seq_length}, input "
                       f"{shapes.max_input_length}, history {shapes.max_history}, prefill "
                       f"lengths {','.join(map(str, shapes.prefill_lengths))}]\n")
    act = mode.activation
    vision = getattr(loaded, "vision", None)
    axes = vision.position_axes if vision is not None else 1  # MiniCPM-V 4.7's canvas: 3
    if request.batch > 1 and LINEAR_ATTENTION in arch.layer_types:
        raise CompileError(f"--batch {request.batch}: {arch.family}'s linear-attention layers "
                           "have no batch decode net yet; compile it without --batch")
    specs = split_model(hf, shapes, act=act, position_axes=axes, batch=request.batch)
    check_block_matches_model(hf, next(s for s in specs if s.name == BLOCK))
    nets = [NetPlan(spec, spec.mode or mode) for spec in specs]
    vit = _vision_net(loaded, mode, request.vision_mode, shapes)
    if vit is not None:
        assert vision is not None  # a vit net is a vision tower's
        nets.append(vit)
        nets += [NetPlan(spec, spec.mode or mode) for spec in vision.extra_specs(shapes, act)]
    # layers whose checkpoint quantization differs get per-layer nets of their own
    variants = layer_variants(hf, loaded.checkpoint)
    for rep in list(variants)[1:]:
        if loaded.stream is not None:  # the skeleton's representative layer made real
            loaded.stream.materialize(hf, rep, f"v{rep}.")
        rep_specs = split_model(hf, shapes, layer=rep, act=act, position_axes=axes,
                                batch=request.batch)
        if arch.layer_type(rep) != arch.layer_type(0):  # a layer kind of its own
            check_block_matches_model(hf, next(s for s in rep_specs if s.name == BLOCK),
                                      layer_index=rep)
        for spec in rep_specs:
            if spec.per_layer:
                name = str(NetName.parse(spec.name).at_layer(rep))
                nets.append(NetPlan(replace(spec, name=name), mode, f"v{rep}."))
    layers: LayerWeights = ModelLayerWeights(hf, loaded.checkpoint)
    if loaded.stream is not None:
        layers = StreamedLayerWeights(loaded.stream, loaded.checkpoint)
        for net in nets:
            if not net.spec.per_layer:
                loaded.stream.bind_shared(net.spec.module, net.weight_prefix)
    return CompilePlan(loaded, arch, request, mode, nets, variants, layers, vision,
                       vit.mode if vit else None, load_seconds)


class CalibrationScratch:
    """The temporary directory of a calibrated compile: ``.OUTPUT.calibrating-XXXXXXXX``
    beside the output (the system's temporary directory when there is none), holding the
    default calibration text when no files are given and the calibrated checkpoint
    (`checkpoint`) until the model file is written (unless `--save-calibrated` keeps it
    elsewhere). `remove` removes it; so do the garbage collector and the interpreter's
    exit, whichever comes first. (The layers' hidden states live in a file that has no
    name from its creation on: `weight_calibration.activations`.)"""

    def __init__(self, output: str) -> None:
        parent = os.path.dirname(os.path.abspath(output)) if output else tempfile.gettempdir()
        prefix = f".{os.path.basename(output) or 'model'}.calibrating-"
        try:
            self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError as e:
            raise CompileError(f"cannot create the calibration's temporary directory in "
                               f"'{parent}': {e.strerror or e}") from None
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, True)

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.path, "checkpoint")

    def remove(self) -> None:
        self._remove()


def _calibrated_plan(model: Any, request: CompileRequest, *, tokenizer: Any, output: str,
                     progress: IO[str] | None, stream: bool) -> CompilePlan:
    """`plan` of a `--calibrate` request: the model calibrated (`weight_calibration.
    calibrate`, the request's mode, group size and symmetry: `request_for_mode`) into a
    checkpoint in a `CalibrationScratch` (or the `--save-calibrated` directory), which is
    then planned as any pre-quantized checkpoint with the request's mode: the request
    without the calibration, group size and symmetry (those are the checkpoint's now)."""
    cal = request.calibration
    assert cal is not None
    scratch = CalibrationScratch(output)
    checkpoint = scratch.checkpoint if cal.save is None else cal.save
    try:
        t = time.perf_counter()
        files = list(cal.data) or [write_default_text(os.path.join(scratch.path,
                                                                   "calibration.txt"))]
        calibrate(model, checkpoint,
                  request_for_mode(cal.method, str(request.mode), request.group_size,
                                   request.symmetric, cal.iterations, cal.ranges),
                  files, sequences=cal.samples, sequence_length=cal.sequence_length,
                  tokenizer=tokenizer, progress=progress,
                  dequantize=None if request.dequantize is None else str(request.dequantize))
        seconds = time.perf_counter() - t
        inner = replace(request, calibration=None, group_size=None, symmetric=None,
                        dequantize=None)
        loaded = _load(checkpoint, None, request.image_size, request.max_tiles,
                       request.max_patches, request.vision_mode,
                       stream=stream and request.dump_ir is None,
                       max_pixels=request.max_pixels)
        loaded.source = (model.source if isinstance(model, LoadedModel) else
                         os.fspath(model) if isinstance(model, str | os.PathLike)
                         else "<memory>")
        the_plan = plan(loaded, inner, output=output, progress=progress, stream=stream)
        the_plan.scratch, the_plan.calibrate_seconds = scratch, seconds
        return the_plan
    except BaseException:
        scratch.remove()
        raise


#: the conversation a chat template renders at compile time (what `toptpu chat` renders)
_PROBE = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
          {"role": "user", "content": "How are you?"}]


def check_parallel_model(loaded: LoadedModel, arch: LlmArch, request: CompileRequest
                         ) -> None:
    """What a multi-device compile cannot take yet: a vision-language model; for tensor
    parallelism a pre-quantized checkpoint (its packed integers are not cut yet),
    linear-attention layers and mixture-of-experts layers; for expert parallelism a model
    without experts."""
    if request.parallel is None:
        return
    flag = f"--devices {request.devices} --parallel {request.parallel}"
    if getattr(loaded, "vision", None) is not None:
        raise CompileError(f"{flag}: {loaded.source} is a vision-language model, which "
                           "toptpu compiles for one chip only")
    if request.parallel is Parallel.TP and loaded.checkpoint is not None:
        raise CompileError(f"{flag}: {loaded.source} is a pre-quantized checkpoint, whose "
                           "packed integers toptpu does not cut over devices yet; use "
                           "--parallel pp")
    if request.parallel is Parallel.TP and LINEAR_ATTENTION in arch.layer_types:
        raise CompileError(f"{flag}: {loaded.source} has linear-attention layers, which "
                           "toptpu does not cut over devices yet; use --parallel pp")
    moe = any(is_moe_block(getattr(layer, "mlp", None)) for layer in loaded.model.model.layers)
    if request.parallel is Parallel.TP and moe:
        raise CompileError(f"{flag}: {loaded.source} is a mixture of experts, whose "
                           "experts toptpu does not cut over devices by tensor parallelism; "
                           "use --parallel ep or pp")
    if request.parallel is Parallel.EP and not moe:
        raise CompileError(f"{flag}: {loaded.source} has no mixture-of-experts layers to "
                           "spread expert by expert; use --parallel tp or pp")


def check_chat_template(files: dict[str, bytes], source: str) -> None:
    """A chat template among the tokenizer files renders a probe conversation within the
    runtime's bounds (`runtime.TEMPLATE_MAX_CHARS`, `TEMPLATE_MAX_SECONDS`): a hostile
    template is refused before a model file is written, and so is one that does not parse.
    Other rendering errors are left to `toptpu chat`, which names them for the conversation
    at hand."""
    if "tokenizer.json" not in files:
        return
    where = next((n for n in ("chat_template.jinja", "chat_template.json") if n in files),
                 "tokenizer_config.json")
    where = f"{source} (tokenizer.chat_template)" if os.path.isfile(source) else \
        os.path.join(source, where)  # a GGUF file's metadata, or a directory's file
    try:
        tok = Tokenizer(files)
        if tok.has_chat_template:
            tok.apply_chat_template(_PROBE, add_generation_prompt=True)
    except TemplateLimitError as e:
        raise CompileError(f"{where}: {e}") from None
    except GenerationError as e:
        cause = e.__cause__
        if isinstance(cause, TemplateSyntaxError):  # no conversation could ever render
            raise CompileError(f"{where}: the chat template does not parse (line "
                               f"{cause.lineno}: {cause.message}); fix it, or remove it "
                               "to compile without one") from None


def _load(model: Any, tokenizer: Any, image_size: int | None, max_tiles: int | None,
          max_patches: int | None, vision_mode: QuantMode | None, stream: bool = False,
          dequantize: QuantMode | None = None, mode: AskedMode = None,
          max_pixels: tuple[int, int] | None = None) -> LoadedModel:
    """A VLM through `toptpu.frontends.vlm.load_vlm` (a directory with `stream`: its text
    model streamed), a directory with `stream` through `frontends.streaming.load_streaming`,
    any other model through load_model; a GGUF file (or a directory holding one) through
    `frontends.gguf_loader.load_gguf`, always streamed."""
    if gguf_file_of(model) is not None:
        return load_gguf(os.fspath(model), dequantize, mode=mode)
    if vlm_model_type(model) is not None:
        return load_vlm(model, tokenizer, image_size=image_size, max_tiles=max_tiles,
                        max_patches=max_patches, stream=stream, max_pixels=max_pixels)
    given = [f for f, v in (("--image-size", image_size), ("--max-tiles", max_tiles),
                            ("--max-patches", max_patches), ("--max-pixels", max_pixels),
                            ("--vision-quantize", vision_mode)) if v is not None]
    if given:
        raise CompileError(f"{', '.join(given)} apply to vision-language models (InternVL, "
                           "MiniCPM-V 4.6/4.7, Qwen2.5-VL, Qwen3-VL, Qwen3.5); this model "
                           "has no vision tower")
    if stream and isinstance(model, str | os.PathLike):
        return load_streaming(os.fspath(model))
    return load_model(model, tokenizer)


def _vision_net(loaded: LoadedModel, mode: QuantMode, vision_mode: QuantMode | None,
                shapes: StaticShapes) -> NetPlan | None:
    """A VLM's `vit` net (checked against the model's own image features) in the mode it
    compiles in; None for a model without a vision tower."""
    vision = getattr(loaded, "vision", None)
    if vision is None:
        return None
    vit_mode = vision_mode or activation_mode(mode)
    need = vision.max_image_tokens() + 2
    if need > shapes.seq_length:
        raise CompileError(vision.family.budget_error(need, shapes.seq_length, vision.max_tiles,
                                                      vision.max_patches))
    spec = vision.net_spec()
    vision.check(spec)
    return NetPlan(spec, vit_mode)


# ====================================================================== step 2: compile nets


def compile_nets(plan: CompilePlan, progress: Progress | None = None, *,
                 keep_top: bool = False) -> CompiledNets:
    """Compile every net of the plan, in order, with one in-memory weight store (and, for a
    pre-quantized checkpoint, its tensors beside the float weights). `keep_top` keeps each
    net's Top module. With `request.dump_ir`, every net's IR after every pass is written
    there, and the store beside it."""
    bar = progress if progress is not None else Progress(len(plan.nets), None)
    store = WeightStore()
    if plan.loaded.checkpoint is not None:
        add_checkpoint_tensors(store, [n.spec for n in plan.nets], plan.loaded.model,
                               plan.loaded.checkpoint,
                               {n.name: n.weight_prefix for n in plan.nets})
    dump = DumpWriter.make(plan.request.dump_ir)
    nets = {}
    stream = plan.loaded.stream
    if dump is not None and stream is not None:  # (a GGUF file is streamed even then)
        stream.fill_placeholders(plan.loaded.model)  # the dumped store: true tensors
    # a streaming compile compiles the per-layer nets first, so the float32 representative
    # layers (one per layer kind or variant: ~0.9 GB each at Qwen3.5-9B) are let go before
    # the shared nets convert the largest tensors (a 2 GB bf16 lm_head); the result keeps
    # the plan's order
    order = list(plan.nets) if stream is None else sorted(
        plan.nets, key=lambda n: not n.spec.per_layer)
    last_per_layer = max((i for i, n in enumerate(order) if n.spec.per_layer), default=-1)
    for i, net in enumerate(order):
        nets[net.name] = _compile_net(net, plan, store, bar, dump, keep_top)
        if stream is None or dump is not None:  # a dump keeps every tensor its IR names
            continue
        # a streaming compile lets go of what it will not write: what the placeholders
        # gave, and the skeleton's float32 layer 0 once the per-layer nets are compiled
        # (its derived tensors stay: pack_weights checks the recipes against them)
        # (a layer's placeholder experts, and what the passes made of them, stay for the
        # next per-layer net)
        gone = [n for n in store.names() if stream.from_placeholder(n, layers=False)]
        if i == last_per_layer:  # (a source the nets read as it is, e.g. a bias, stays)
            read = {name for n in nets.values() for op in n.tpu.walk() if op.results
                    and (name := weight_name(op.results[0])) is not None}
            gone += [n for n in stream.free_layers() if n not in read]
            gone += [n for n in store.names() if stream.from_placeholder(n)]
        for name in gone:
            if name in store:
                del store[name]
    if dump is not None:
        store.save(dump.weights_path)
        source = plan.loaded.source
        dump.finish(os.path.abspath(source) if os.path.exists(source) else None,
                    plan.request.keywords(),
                    {name: (net.inputs, net.outputs) for name, net in nets.items()})
    return CompiledNets({n.name: nets[n.name] for n in plan.nets}, store)


def _compile_net(net: NetPlan, plan: CompilePlan, store: WeightStore, bar: Progress,
                 dump: DumpWriter | None, keep_top: bool) -> CompiledNet:
    """`compile_net` with progress (and dumps) after the import and each pass."""
    bar.start(net.name)
    on_step = progress_steps(bar, dump.writer(net.name, io_specs) if dump else None)

    compiled = compile_net(net, plan.request, store, on_step=on_step, keep_top=keep_top)
    bar.finish(compiled.seconds)
    return compiled


def progress_steps(bar: Progress, write_dump: Callable[..., None] | None) -> OnStep:
    """An `OnStep` that reports each step's time to `bar` (and writes its dump file)."""
    last = [time.perf_counter()]

    def on_step(what: str, module: ModuleOp, spec: str | None = None,
                stage: str | None = None) -> None:
        now = time.perf_counter()
        bar.step(what, now - last[0])
        last[0] = now
        if write_dump is not None:
            write_dump(module, what, spec, stage)

    return on_step


# ====================================================================== step 3: pack weights


def pack_weights(plan: CompilePlan, compiled: CompiledNets) -> PackedWeights:
    """Lay out the weight blob: shared tensors once (identical tensors, e.g. tied embedding
    and lm_head, share one copy), then every layer's chunk, derived from its own float
    weights (and checkpoint tensors) with the recipes of its per-layer nets. Layers of
    different variants (`CompilePlan.variants`) read different tensors: each variant has a
    chunk layout of its own (its recipes', in the order the nets name them), and each
    layer's chunk is laid out as its variant's, so no chunk has room for another variant's
    tensors. Each representative layer derived here must be bit-identical to what the
    compiler stored; the other layers are derived when their chunk is made. The shared
    tensors of a streamed checkpoint's placeholders are laid out by their recipes and
    derived from the checkpoint when written (identical when their recipes are)."""
    return _pack(plan, compiled, None, range(plan.num_layers), None, weights_section())


def device_checkpoint(whole: CheckpointOf | None, device: int | None, devices: int
                      ) -> CheckpointOf | None:
    """A checkpoint lookup giving device `device`'s experts of a shard weight's parts (the
    expert-parallel cut: every part of a MoE projection stacked by expert, cut along E as
    its float weight is); `whole` itself for one device."""
    if device is None or whole is None:
        return whole

    def get(src: str) -> dict[str, np.ndarray] | None:
        parsed = parse_shard_name(src)
        if parsed is None:
            return whole(src)
        base, split = parsed
        parts = whole(base)
        return None if parts is None else {
            f: np.ascontiguousarray(take_piece(a, split, device, devices))
            for f, a in parts.items()}

    return get


def _pack(plan: CompilePlan, compiled: CompiledNets, nets: Collection[str] | None,
          layers: range, device: int | None, section: str) -> PackedWeights:
    """`pack_weights` for one blob: of the nets `nets` (None: all), the layers `layers`, the
    pieces of device `device` of a multi-device compile (None: one device), in `section`."""
    store = compiled.store
    stream = plan.loaded.stream
    n = plan.request.devices

    def cut(whole: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
        """A float tensor lookup giving this device's piece of a shard weight."""
        if device is None:
            return whole
        return lambda src: device_tensor(src, whole, device, n)

    shared: dict[str, np.ndarray] = {}
    from_placeholder: dict[str, WeightRecipe] = {}
    order: dict[str, None] = {}  # the shared tensors in the order the nets name them
    layer_recipes: dict[str, WeightRecipe] = {}
    variant_recipes: dict[int, dict[str, WeightRecipe]] = {rep: {} for rep in plan.variants}
    net_weights: dict[str, list[str]] = {}
    for net in compiled.nets.values():
        if nets is not None and net.name not in nets:
            continue
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
            elif stream is not None and stream.is_placeholder(r.source):
                prev = from_placeholder.setdefault(r.name, r)
                if prev != r:
                    raise CompileError(f"shared weight '{r.name}' has two recipes: {prev} "
                                       f"and {r}")
                order[r.name] = None
            else:
                if device and parse_shard_name(r.source) is not None:
                    arr = derive_weights([r], cut(lambda src: store[src]))[r.name]
                else:  # one device's, or device 0's pieces: what the passes stored
                    arr = store[r.name]
                if r.name in shared and not np.array_equal(shared[r.name], arr):
                    raise CompileError(f"shared weight '{r.name}' differs between nets")
                shared[r.name] = arr
                order[r.name] = None
        net_weights[net.name] = list(dict.fromkeys(names))

    def derive(layer: int) -> dict[str, np.ndarray]:
        return derive_weights(variant_recipes[plan.variant_of(layer)].values(),
                              cut(plan.layers.float_of(layer)),
                              device_checkpoint(plan.layers.checkpoint_of(layer), device, n))

    # each variant's own layer from the recipes must be exactly what the compiler stored
    # (device 0's pieces, which the passes stored, for a multi-device compile)
    # (a streaming compile's placeholder experts are zeros in the store: not compared, and
    # the layer derived again when written rather than held with its experts)
    checked: dict[int, dict[str, np.ndarray]] = {}
    for rep in plan.variants:
        if rep not in layers or (device or 0) != 0:
            continue
        recipes = variant_recipes[rep].values()
        real = [r for r in recipes if stream is None or not stream.from_placeholder(r.source)]
        made = derive_weights(real, cut(plan.layers.float_of(rep)),
                              device_checkpoint(plan.layers.checkpoint_of(rep), device, n))
        if len(real) == len(recipes):
            checked[rep] = made
        for name, arr in made.items():
            ref = store[name]
            if arr.dtype != ref.dtype or not np.array_equal(
                    arr.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8)):
                raise CompileError(f"the recipe of '{name}' does not reproduce the compiled "
                                   "tensor; convert-top-to-tpu and passes/weight_recipe.py "
                                   "disagree")
    # identical shared tensors are stored once (a placeholder's: identical recipes)
    unique: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    for name in order:
        recipe = from_placeholder.get(name)
        key = (_digest(shared[name]),) if recipe is None else (
            stream.placeholder_of(recipe.source), recipe.source.partition("@")[2], recipe.part,
            recipe.shape, str(recipe.dtype), recipe.bits, recipe.group_size, recipe.symmetric,
            str(recipe.scale_dtype))
        alias[name] = unique.setdefault(key, name)
    specs = {nm: (tuple(shared[nm].shape), shared[nm].dtype.name) if nm in shared
             else (from_placeholder[nm].shape, from_placeholder[nm].dtype.name)
             for nm in order if alias[nm] == nm}
    used = [rep for rep in plan.variants if any(plan.variant_of(i) == rep for i in layers)]
    chunk_index = {rep: i for i, rep in enumerate(used)}
    layout = WeightLayout.plan(
        specs, [{nm: (r.shape, r.dtype.name) for nm, r in variant_recipes[rep].items()}
                for rep in used],
        [chunk_index[plan.variant_of(i)] for i in layers], section)
    for name, target in alias.items():
        layout.shared[name] = layout.shared[target]
    streamed: dict[str, list[WeightRecipe]] = {}
    for name, r in from_placeholder.items():
        if alias[name] == name:
            streamed.setdefault(r.source, []).append(r)
    return PackedWeights(
        layout, net_weights, {nm: a for nm, a in shared.items() if alias[nm] == nm},
        lambda local: checked.pop(layers.start + local) if layers.start + local in checked
        else derive(layers.start + local), streamed,
        None if stream is None else (lambda recs: stream.shared(recs, device or 0, n)),
        stream.release if stream is not None else lambda: None, layers, variant_recipes)


# ====================================================================== several devices


@dataclass
class Placement:
    """Where a multi-device compile puts things: each device's layers and the nets it
    runs (tp: every layer on every device, the embeddings on device 0; pp: contiguous
    layers balanced by their modelled time, the embeddings on the first, the lm_head and
    the heads on the last)."""

    strategy: Parallel
    layers: list[range]
    nets: list[tuple[str, ...]]


def place(plan: CompilePlan, compiled: CompiledNets) -> Placement:
    """The devices' layers and nets. Pipeline stages are balanced by the cost model: each
    layer weighs its decode net's modelled time on the chip, the first device carries the
    embedding's too, the last the lm_head's and the greedy head's, and the contiguous split
    that makes the slowest device fastest is taken (`toptpu.devices.balance_layers`)."""
    n, layers = plan.request.devices, plan.num_layers
    names = list(compiled.nets)
    per_layer = [nm for nm in names if compiled.nets[nm].per_layer]
    embeddings = [nm for nm in names  # at every prefill length (`embedding:16`)
                  if NetName.parse(nm).base in (EMBEDDING, EMBEDDING_CACHE)]
    heads = [nm for nm in names if nm not in per_layer and nm not in embeddings]
    if plan.request.parallel is Parallel.TP:
        return Placement(Parallel.TP, [range(layers)] * n,
                         [tuple(names) if d == 0 else tuple(per_layer + heads)
                          for d in range(n)])
    if plan.request.parallel is Parallel.EP:  # the embeddings and heads whole on device 0
        return Placement(Parallel.EP, [range(layers)] * n,
                         [tuple(names) if d == 0 else tuple(per_layer) for d in range(n)])
    chip = plan.chip

    def seconds(net: str) -> float:
        prog = compiled.nets[net].program
        assert prog is not None
        return net_timing(command_costs(prog.commands), chip).seconds(chip)

    costs = [seconds(str(NetName(BLOCK_CACHE, plan.variant_of(i)))) for i in range(layers)]
    first = seconds(EMBEDDING_CACHE)
    last = seconds(LM_HEAD) + seconds(GREEDY_HEAD)
    ranges = balance_layers(costs, first, last, n)
    nets = []
    for d, r in enumerate(ranges):
        own = {str(NetName.parse(nm).at_layer(plan.variant_of(i)))  # at every length
               for i in r for nm in per_layer}
        mine = [nm for nm in per_layer if nm in own]
        nets.append(tuple((embeddings if d == 0 else []) + mine
                          + (heads if d == n - 1 else [])))
    return Placement(Parallel.PP, ranges, nets)


@dataclass
class DeviceWeights:
    """Every device's weight blob (step 3 of a multi-device compile), written together
    (`group`): one read of a layer's tensors cuts every device's pieces of it."""

    plan: CompilePlan
    placement: Placement
    devices: list[PackedWeights]

    def group(self) -> StreamedGroup:
        return StreamedGroup({p.layout.section: p.layout.size for p in self.devices},
                             self.pieces)

    def pieces(self) -> Iterator[tuple[str, int, memoryview]]:
        for p in self.devices:
            for offset, data in p.shared_pieces():
                yield p.layout.section, offset, data
        for layer in range(self.plan.num_layers):
            if self.placement.strategy in (Parallel.TP, Parallel.EP):
                yield from self._tp_layer(layer)
                continue
            (p,) = [p for p in self.devices if p.layers is not None and layer in p.layers]
            assert p.layers is not None
            for offset, data in p.layer_pieces(layer - p.layers.start):
                yield p.layout.section, offset, data

    def _tp_layer(self, layer: int) -> Iterator[tuple[str, int, memoryview]]:
        """One layer's chunk on every device, tensor by tensor: each float tensor is read
        once and every device's piece of it derived (memory: one tensor and its pieces)."""
        plan, n = self.plan, len(self.devices)
        recipes = self.devices[0].variant_recipes[plan.variant_of(layer)]
        chunk = self.devices[0].layout.chunk_of(layer)
        ordered = sorted(recipes.values(), key=lambda r: chunk[r.name].offset)
        float_of, checkpoint_of = plan.layers.float_of(layer), plan.layers.checkpoint_of(layer)
        last: dict[str, np.ndarray] = {}
        last_parts: dict[str, dict[str, np.ndarray] | None] = {}

        def whole(src: str) -> np.ndarray:
            if src not in last:
                last.clear()
                last[src] = float_of(src)
            return last[src]

        def whole_parts(src: str) -> dict[str, np.ndarray] | None:
            assert checkpoint_of is not None
            if src not in last_parts:
                last_parts.clear()
                last_parts[src] = checkpoint_of(src)
            return last_parts[src]

        runs: list[list[WeightRecipe]] = []
        for r in ordered:  # the recipes of one source in a row derive together
            if runs and runs[-1][0].source == r.source:
                runs[-1].append(r)
            else:
                runs.append([r])
        for run in runs:
            for d, p in enumerate(self.devices):
                made = derive_weights(
                    run, functools.partial(device_tensor, whole=whole, device=d, devices=n),
                    device_checkpoint(None if checkpoint_of is None else whole_parts, d, n))
                base = p.layout.layer_start(layer)
                for r in run:
                    yield p.layout.section, base + chunk[r.name].offset, _bytes(made[r.name])
                del made
        last.clear()
        last_parts.clear()
        self.devices[0].release()
        self.devices[0].layer_written()


def pack_device_weights(plan: CompilePlan, compiled: CompiledNets, placement: Placement
                        ) -> DeviceWeights:
    """Every device's blob: the shared tensors of the nets it runs, then its layers' chunks,
    its pieces of every shard weight (`pack_weights` per device)."""
    return DeviceWeights(plan, placement, [
        _pack(plan, compiled, nets, layers, d, weights_section(d))
        for d, (nets, layers) in enumerate(zip(placement.nets, placement.layers,
                                               strict=True))])


def check_fits(plan: CompilePlan, compiled: CompiledNets,
               blobs: Sequence[tuple[WeightLayout, range]]) -> None:
    """Each device's weights and KV cache (or recurrent state) must fit its memory
    (`Chip.ddr_bytes`); otherwise the compile is refused naming how many devices the model
    needs (`toptpu.devices.devices_needed`)."""
    chip = plan.chip
    for d, (layout, layers) in enumerate(blobs):
        need = layout.size + sum(cache_bytes(compiled, plan, i) for i in layers)
        if need <= chip.ddr_bytes:
            continue
        where = "one device" if len(blobs) == 1 else f"device {d} of {len(blobs)}"
        raise CompileError(
            f"the model does not fit {where}: it needs {need / 2**30:.2f} GiB "
            f"(weights {layout.size / 2**30:.2f} GiB + KV cache "
            f"{(need - layout.size) / 2**30:.2f} GiB), more than a {chip.name}'s "
            f"{chip.ddr_bytes / 2**30:.2f} GiB; "
            + devices_needed(need, len(blobs), chip))


def cache_bytes(compiled: CompiledNets, plan: CompilePlan, layer: int) -> int:
    """One layer's KV cache (or linear-attention state) on one device: the history (state)
    inputs of its decode net, as the device's program binds them."""
    net = compiled.nets[str(NetName(BLOCK_CACHE, plan.variant_of(layer)))]
    assert net.program is not None
    return sum(s.nbytes for s in net.program.inputs
               if s.name in (HISTORY_K, HISTORY_V, CONV_STATE, RECURRENT_STATE))


def _chunk_summary(layout: WeightLayout) -> str:
    """'28 layers x 7 tensors (12.34 MB each)', one such part per chunk layout (layer kind)."""
    parts = []
    for c, chunk in enumerate(layout.chunks):
        n = len(layout.chunk_layers(c))
        parts.append(f"{n} layer{'s' if n != 1 else ''} x {len(chunk)} tensors "
                     f"({layout.chunk_size(c) / 1e6:.2f} MB each)")
    return " + ".join(parts)


def _digest(arr: np.ndarray) -> str:
    a = np.ascontiguousarray(arr)
    h = hashlib.sha1(a.view(np.uint8).reshape(-1).data)  # noqa: S324 - dedup, not security
    return f"{a.dtype.name}{list(a.shape)}{h.hexdigest()}"


# ====================================================================== step 4: write


def write(plan: CompilePlan, compiled: CompiledNets, packed: PackedWeights | DeviceWeights,
          output: str, from_ir: FromIrInfo | None = None) -> LlmHeader:
    """Write the model file at `output` (atomically): the header, each net's Tpu IR (generic
    form, without the compile-time store's name), command streams and constant pool, the
    tokenizer files and the weight blob, streamed piece by piece (`PackedWeights.pieces`;
    a multi-device compile's blobs, one section per device, streamed together:
    `DeviceWeights.group`). Nothing in the bytes depends on the time, the process or the
    order of a set: the same inputs and options give the same file."""
    nets = compiled.nets
    irs: dict[str, str] = {}
    for name, net in nets.items():
        m = net.tpu.clone()
        m.attributes.pop(STORE_ATTR, None)
        irs[name] = print_ir(m, generic=True)
        net.ir_bytes = len(irs[name].encode())
    streams: dict[str, bytes] = {}
    commands: dict[str, int] = {}
    for name, net in nets.items():
        if net.program is None:
            raise CompileError(f"net '{name}' has no machine program")
        data = net.program.to_json()
        net.stream_bytes = len(data)
        streams[stream_section(name)] = data
        streams[const_section(name)] = constant_pool(net.program)
        commands[name] = len(net.program.commands)
    layer_nets = {
        base: [str(NetName(base, plan.variant_of(i))) for i in range(plan.num_layers)]
        for base in (n for n, net in nets.items()
                     if net.per_layer and NetName.parse(n) == NetName(n))}
    vision_info = (None if plan.vision is None
                   else {**plan.vision.header(), "mode": str(plan.vit_mode)})
    header = _header(plan, nets, commands, packed, layer_nets, vision_info, from_ir,
                     plugin_ops_in(net.tpu for net in nets.values()))
    blob = packed.section() if isinstance(packed, PackedWeights) else packed.group().members()
    try:
        write_llm_file(output, header, irs, plan.loaded.tokenizer_files, blob,
                       extra_sections=streams)
    except HeaderError as e:
        raise CompileError(f"the model file header would be invalid: {e}") from e
    return header


def _parallel_info(packed: DeviceWeights, nets: dict[str, CompiledNet]) -> ParallelInfo:
    """The header's account of the devices: each one's layers, nets and weight table, and
    how the tensor-parallel nets' IO is cut."""
    pl = packed.placement
    return ParallelInfo(
        strategy=pl.strategy.value,
        devices=tuple(DeviceInfo(r.start, r.stop, tuple(n), p.layout)
                      for r, n, p in zip(pl.layers, pl.nets, packed.devices, strict=True)),
        splits={name: {io: IoSplit(s.axis, s.pieces) for io, s in net.splits.items()}
                for name, net in nets.items() if net.splits})


def _model_info(arch: LlmArch, config: dict[str, Any]) -> ModelInfo:
    fields = asdict(arch)
    fields["layer_types"] = tuple(arch.layer_type(i) for i in range(arch.num_layers))
    fields["linear"] = None if arch.linear is None else LinearAttentionInfo(**fields["linear"])
    return ModelInfo(**fields, config=config)


def _json_config(config: Any) -> dict[str, Any]:
    return json.loads(config.to_json_string(use_diff=False))


def plugin_ops_in(modules: Iterable[ModuleOp]) -> dict[str, PluginOpInfo] | None:
    """The plugins' ops the `modules` hold, as the header records them (None: none)."""
    found = plugin_ops.used_in(modules)
    return {name: PluginOpInfo(e.plugin, e.package) for name, e in found.items()} or None


def _header(plan: CompilePlan, nets: dict[str, CompiledNet], commands: dict[str, int],
            packed: PackedWeights | DeviceWeights, layer_nets: dict[str, list[str]],
            vision: dict[str, Any] | None, from_ir: FromIrInfo | None = None,
            plugin_op_infos: dict[str, PluginOpInfo] | None = None) -> LlmHeader:
    """The model file header (`toptpu.backend.formats.llm_file.LlmHeader`). The parts the
    frontends give as JSON (generation config, vision section) are decoded with the
    schema, so a value the loader would refuse is a compile error naming the field."""
    net_weights: dict[str, list[str]] = {}
    for p in [packed] if isinstance(packed, PackedWeights) else packed.devices:
        for name, ws in p.net_weights.items():
            if net_weights.setdefault(name, ws) != ws:
                raise CompileError(f"net '{name}' reads other weights on other devices")
    try:
        toptpu_version = version("toptpu")
    except PackageNotFoundError:
        toptpu_version = "unknown"
    loaded = plan.loaded
    ck = loaded.checkpoint
    try:
        generation = decode(Generation, loaded.generation, "generation")
        vision_info = None if vision is None else decode(VisionInfo, vision, "vision")
    except HeaderError as e:
        raise CompileError(f"the model file header would be invalid: {e}") from e
    return LlmHeader(
        kind=KIND,
        llm_format=LLM_FORMAT,
        chip=plan.chip.name,
        mode=str(plan.mode),
        group_size=plan.group_size,
        symmetric=plan.request.symmetric,
        shapes=plan.shapes,
        model=_model_info(plan.arch, _json_config(loaded.config)),
        generation=generation,
        tokenizer=TokenizerInfo(tuple(sorted(loaded.tokenizer_files))),
        nets={name: NetEntry(inputs=tuple(n.inputs), outputs=tuple(n.outputs),
                             per_layer=n.per_layer, ir=ir_section(name),
                             streams=stream_section(name), consts=const_section(name),
                             weights=tuple(net_weights[name]),
                             commands=commands[name], pipeline=n.pipeline or None)
              for name, n in nets.items()},
        layer_nets={base: tuple(names) for base, names in layer_nets.items()},
        weights=packed.layout if isinstance(packed, PackedWeights) else None,
        parallel=None if isinstance(packed, PackedWeights) else _parallel_info(packed, nets),
        compile=CompileInfo(source=loaded.source, toptpu_version=toptpu_version,
                            pipeline=plan.request.pipeline.describe(), from_ir=from_ir,
                            plugin_ops=plugin_op_infos),
        checkpoint=None if ck is None else CheckpointInfo(
            quant_method=ck.quant_method, packing_format=ck.packing_format,
            bits=checkpoint_bits(ck), quantized_layers=len(ck.layouts),
            dtype=loaded.checkpoint_dtype),
        vision=vision_info,
    )


# ====================================================================== helpers

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


__all__ = ["DEFAULT_GROUP_SIZE", "CompileError", "CompilePlan", "CompileRequest",
           "CompileResult", "CompiledNet", "CompiledNets", "ModelLoadError", "NetPlan",
           "PackedWeights", "check_group_size", "check_reload_free", "check_seq_length",
           "check_state_in_place", "compile", "compile_net", "compile_nets", "known_chips",
           "kv_cache_size", "pack_weights", "plan", "write"]
