"""The LLM model file: what `toptpu compile` writes and every executor reads.

It is a `toptpu.backend.formats.model_file` container (magic, version, checksummed JSON header,
checksummed sections, zero padding, written atomically). This module fixes the LLM
conventions on top of it: ONE typed schema for the header (`LlmHeader` and its nested
dataclasses), which the compiler builds and writes and every reader gets back validated.

Sections (every section is named by the header; a file with any other section is refused):

- `ir:<net>`: the net's Tpu IR, xDSL generic form (with `loc("name")` debug info). The
  `top.weight_store` module attribute is removed: weights come from the blob below.
- `stream:<net>` / `const:<net>`: the machine's command streams (a
  `toptpu.backend.formats.program.Program` with the grouped Tpu IR) and its constant pool.
- `tokenizer:<file>`: the tokenizer files, byte for byte; `<file>` is one of
  `TOKENIZER_FILES` of `toptpu.backend.contract` (`tokenizer.json`,
  `tokenizer_config.json`, `chat_template.jinja`, ...), never a path.
- `weights`: ONE weight blob, laid out as

      [shared tensors][layer 0 chunk][layer 1 chunk] ... [layer N-1 chunk]

  Tensors follow each other in table order, each at the next multiple of `alignment` (64)
  bytes (a shared tensor identical to an earlier one may reuse its entry). Each layer's
  chunk has the layout of its kind: layers that run different per-layer nets (a mixed
  checkpoint's `block@3` variants; models mixing linear and full attention) read different
  tensors, and each chunk holds only its own layer's (no union of every kind's names). A
  layer's chunk follows the previous one; a per-layer net binds layer i's weights by the
  chunk base `layers[i].offset` plus each tensor's offset in chunk `layers[i].chunk`
  (`WeightLayout.layer_offset`).

Header fields (`LlmHeader`; every field is type- and range-checked on load, and an error
names the field, e.g. `nets.block.inputs[2].shape`):

- `kind`: "toptpu-llm", `llm_format`: 3 (1 had one chunk layout for every layer, 2 one
  prefill chunk length; such files are refused: recompile them)
- `chip` (a known chip), `mode` (a quantization mode), `group_size` (-1: per channel),
  `symmetric`
- `shapes`: `seq_length`, `max_input_length`, `max_history`, `prefill_lengths` (the chunk
  lengths the prefill nets are compiled at: ascending, the last is `max_input_length`); the
  nets' IO shapes must be exactly what these give (runtimes read the static shapes back
  from the nets)
- `model`: `family`, `num_layers`, `hidden_size`, `num_heads`, `num_kv_heads`,
  `head_dim`, `vocab_size`, `qk_norm`, `tied_embeddings`, `config` (the HF config dict)
- `generation`: `eos_token_ids`, `pad_token_id`, `bos_token_id` (ids within the
  vocabulary), `stop_strings`, `do_sample`, `temperature`, `top_k`, `top_p`,
  `repetition_penalty`
- `tokenizer`: `files` (names from `TOKENIZER_FILES`; each in section `tokenizer:<name>`)
- `nets`: name -> `inputs`/`outputs` (lists of {name, shape, dtype: numpy dtype name}; the
  text nets' IO is the net contract, `toptpu.backend.contract.net_io`), `per_layer`, `ir`,
  `streams`, `consts` (their section names), `weights` (the tensor names the net reads, all
  in the weight table), `commands`. Net names (`toptpu.backend.contract`): `TEXT_NETS`,
  `VISION_NET`, the prefill nets at each shorter prefill length (`embedding:16`,
  `block:16`, `block_kv:16`: every one of `PREFILL_NETS` at every length below
  `max_input_length`, and nothing else), and `block@3`-style variants (`NetName`) of the
  per-layer nets for layers of another kind or checkpoint quantization (`block:16@3` at a
  shorter length: a variant has its nets at every length as layer 0's have); with
  `toptpu compile --batch B`, every one of `BATCH_NETS` at batch B (`block_cache.b4`,
  `lm_head.b4`, ...; each layer's `block_cache` variant too: `block_cache.b4@3`; IO
  `contract.batch_net_io`). Nets of different lengths or batches read the same tensors of
  a layer's chunk: no byte is stored twice
- `layer_nets`: per-layer net -> the net each layer runs (itself or a variant), at
  `max_input_length` (at a shorter length the same variant: `block@3` -> `block:16@3`)
- `weights`: `section`, `alignment`, `size`, `shared` (name -> {offset, shape, dtype,
  nbytes}), `chunks` (a list of chunk layouts, name -> entry, offsets relative to a chunk
  base; one per layer kind, a model of one kind has one), `layers` (one {chunk: index into
  `chunks`, offset: the chunk's absolute base} per layer, in order, contiguous after the
  shared region). Every per-layer net's weights are in the chunk of each layer running it
- `compile`: provenance (source, toptpu version; no time: a compile is reproducible, the
  same inputs and options give the same bytes); `checkpoint`: the pre-quantized
  checkpoint's method, packing, bits, layer count and dtype (or null)
- `vision` (VLMs only): the `vit` net's family, image processor and its config, image
  tokens and ids, tile/patch numbers, the HF config and the vit net's mode; for MiniCPM-V
  4.7 its `canvas_markers` (the token ids its canvas positions are pinned to), with which
  the full-attention nets take `position_ids` [3, n] (T, H, W) instead of [1, n]; for
  Qwen2.5-VL / Qwen3-VL / Qwen3.5 (`qwenvl`) its `qwen` section: merge and temporal patch
  sizes, video and vision start/end token ids, the window size (Qwen2.5-VL), the learned
  position grid (Qwen3-VL, Qwen3.5), the DeepStack levels (Qwen3-VL) and how videos are
  laid out in time; its text nets take M-RoPE positions [3, n]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.contract import (
    BATCH_NETS,
    BLOCK_CACHE,
    FULL_ATTENTION,
    KNOWN_NETS,
    LAYER_TYPES,
    LINEAR_ATTENTION,
    PER_LAYER_NETS,
    PREFILL_NETS,
    REPETITION_PENALTY_RANGE,
    TEXT_NETS,
    TOKENIZER_FILES,
    VISION_NET,
    ContractError,
    LinearWidths,
    NetInfo,
    NetName,
    StaticShapes,
    TensorSpec,
    batch_net_io,
    linear_net_io,
    net_io,
)
from toptpu.backend.formats.header_schema import (
    Count,
    HeaderError,
    Name,
    NamePattern,
    OneOf,
    Range,
    decode,
    encode,
    join,
    short,
)
from toptpu.backend.formats.model_file import (
    GroupedSection,
    ModelFile,
    ModelFileError,
    Section,
    StreamedSection,
    write_model_file,
)
from toptpu.backend.target.chips import chip_names
from toptpu.dialects.common import DTYPE_BY_NAME, QuantMode, numpy_dtype
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.plugin_ops import PluginOpMissingError
from toptpu.dialects.plugin_ops import require as require_plugin_ops
from toptpu.families import VISION_FAMILIES, vision_family
from toptpu.families.base import FAMILY_KEYS, VisionFamily

KIND: Final = "toptpu-llm"
LLM_FORMAT: Final = 3
WEIGHTS_SECTION = "weights"
WEIGHT_ALIGN: Final = 64

#: numpy dtype names of the element types toptpu knows
KNOWN_DTYPES = frozenset(numpy_dtype(t).name for t in DTYPE_BY_NAME.values())
#: the most elements one net input/output may have
MAX_ELEMENTS = 2**40


def weights_section(device: int | None = None) -> str:
    """The weight blob's section: `weights`, or device d's `weights:<d>`."""
    return WEIGHTS_SECTION if device is None else f"{WEIGHTS_SECTION}:{device}"


def ir_section(net: str) -> str:
    return f"ir:{net}"


def stream_section(net: str) -> str:
    return f"stream:{net}"


def const_section(net: str) -> str:
    return f"const:{net}"


def tokenizer_section(name: str) -> str:
    return f"tokenizer:{name}"


def align(n: int, a: int = WEIGHT_ALIGN) -> int:
    return (n + a - 1) // a * a


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


DType = Annotated[str, OneOf(tuple(sorted(KNOWN_DTYPES)), "dtype")]
Mode = Annotated[str, OneOf(tuple(QuantMode.names()), "quantization mode")]
TokenId = int  # checked against model.vocab_size in LlmHeader.check
JsonObject = dict[str, Any]  # free-form JSON (HF configs): only its type is checked


# =========================================================================== header types


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the weight blob (offset relative to its region)."""

    offset: int
    shape: tuple[int, ...]
    dtype: DType
    nbytes: int

    @classmethod
    def make(cls, offset: int, shape: tuple[int, ...], dtype: str) -> WeightEntry:
        return cls(offset, tuple(shape), dtype, _nbytes(tuple(shape), dtype))


@dataclass(frozen=True)
class LayerChunk:
    """Where one layer's weights lie: `offset`, the absolute base of its chunk in the blob,
    and `chunk`, the index of its chunk layout in `WeightLayout.chunks`."""

    chunk: int
    offset: int


#: a tensor to lay out: name -> (shape, numpy dtype name)
TensorSpecs = Mapping[str, tuple[tuple[int, ...], str]]


@dataclass
class WeightLayout:
    """Offsets of every tensor in the blob: the shared region, then one chunk per layer, in
    layer order. Layers of different kinds (a mixed checkpoint's layer variants, a model
    mixing linear and full attention) read different tensors: each layer's chunk has the
    layout of its kind (`chunks[layers[i].chunk]`, offsets relative to the chunk base
    `layers[i].offset`), so no layer carries room for another kind's tensors."""

    shared: dict[Name, WeightEntry]
    chunks: tuple[dict[Name, WeightEntry], ...]
    layers: tuple[LayerChunk, ...]
    size: int
    section: Name  # "weights"; device d's of a multi-device file: "weights:<d>"
    alignment: Literal[64]

    @classmethod
    def plan(cls, shared: TensorSpecs, chunks: Sequence[TensorSpecs],
             layer_chunks: Sequence[int], section: str = WEIGHTS_SECTION) -> WeightLayout:
        """Lay out tensors given as name -> (shape, dtype) (in the order given): the shared
        ones, then for layer i a chunk laid out as `chunks[layer_chunks[i]]`."""
        sh, end = cls._place(shared)
        placed = [cls._place(c) for c in chunks]
        layers: list[LayerChunk] = []
        offset = align(end)
        for c in layer_chunks:
            if not 0 <= c < len(placed):
                raise ValueError(f"layer {len(layers)}: chunk {c} of {len(placed)}")
            layers.append(LayerChunk(c, offset))
            offset += placed[c][1]
        return cls(sh, tuple(p[0] for p in placed), tuple(layers), offset, section,
                   WEIGHT_ALIGN)

    @staticmethod
    def _place(items: TensorSpecs) -> tuple[dict[str, WeightEntry], int]:
        """Entries one after the other, each at the next aligned offset; and the aligned
        size of the region."""
        out, off = {}, 0
        for name, (shape, dtype) in items.items():
            e = WeightEntry.make(off, shape, dtype)
            out[name] = e
            off = align(off + e.nbytes)
        return out, off

    # ------------------------------------------------------------------ access
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shared_size(self) -> int:
        """The bytes before layer 0's chunk (the shared region, aligned)."""
        return align(self._region_end(self.shared))

    def chunk_of(self, layer: int) -> dict[str, WeightEntry]:
        """Layer `layer`'s tensors (offsets relative to `layer_start(layer)`)."""
        return self.chunks[self.layers[layer].chunk]

    def chunk_size(self, chunk: int) -> int:
        """The bytes of one chunk of layout `chunks[chunk]` (aligned)."""
        return align(self._region_end(self.chunks[chunk]))

    def layer_start(self, layer: int) -> int:
        """The absolute offset of layer `layer`'s chunk in the blob."""
        return self.layers[layer].offset

    def layer_size(self, layer: int) -> int:
        return self.chunk_size(self.layers[layer].chunk)

    def layer_offset(self, layer: int, name: str) -> int:
        """The absolute offset of tensor `name` of layer `layer` (KeyError: not in its
        chunk)."""
        where = self.layers[layer]
        return where.offset + self.chunks[where.chunk][name].offset

    def chunk_layers(self, chunk: int) -> list[int]:
        """The layers laid out with chunk `chunk`."""
        return [i for i, where in enumerate(self.layers) if where.chunk == chunk]

    @staticmethod
    def _region_end(entries: Mapping[str, WeightEntry]) -> int:
        return max((e.offset + e.nbytes for e in entries.values()), default=0)

    # ------------------------------------------------------------------ checks
    def check(self, where: str = "weights") -> None:
        """Entries sized by their shape and dtype and tiling their region: by offset, each
        starts where the previous one ends (aligned), none overlaps another (a shared entry
        may repeat another one: identical tensors are stored once; a chunk's names are
        each their own tensor, none also a shared name); every chunk used by a layer; the
        layers' chunks following the shared region and each other in layer order, each
        sized by its layout; the total size as the layers give it."""
        end = self._check_region(self.shared, f"{where}.shared", may_repeat=True)
        sizes = []
        for c, entries in enumerate(self.chunks):
            at = f"{where}.chunks[{c}]"
            sizes.append(self._check_region(entries, at, may_repeat=False))
            both = sorted(set(entries) & set(self.shared))
            if both:
                raise HeaderError(join(at, both[0]), "is also a shared tensor (a name means "
                                                     "one tensor to the nets)")
        offset = align(end)
        for i, layer in enumerate(self.layers):
            at = f"{where}.layers[{i}]"
            if layer.chunk >= len(self.chunks):
                raise HeaderError(f"{at}.chunk", f"is {layer.chunk}, the file has "
                                                 f"{len(self.chunks)} chunk layouts")
            if layer.offset != offset:
                before = "the shared region" if i == 0 else f"layer {i - 1}'s chunk"
                raise HeaderError(f"{at}.offset", f"is {layer.offset}, {before} ends at "
                                                  f"{offset}")
            offset += sizes[layer.chunk]
        unused = sorted(set(range(len(self.chunks))) - {la.chunk for la in self.layers})
        if unused:
            raise HeaderError(f"{where}.chunks[{unused[0]}]", "is the chunk of no layer")
        if self.size != offset:
            raise HeaderError(f"{where}.size", f"is {self.size}, the weight table gives "
                                               f"{offset}")

    @staticmethod
    def _check_region(entries: dict[str, WeightEntry], where: str, may_repeat: bool) -> int:
        for name, e in entries.items():
            if e.nbytes != _nbytes(e.shape, e.dtype):
                raise HeaderError(f"{join(where, name)}.nbytes",
                                  f"is {e.nbytes}, {e.dtype} {list(e.shape)} takes "
                                  f"{_nbytes(e.shape, e.dtype)}")
        end, placed = 0, None
        for name, e in sorted(entries.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
            if e == placed and may_repeat:
                continue  # the same tensor under another name
            if e.offset != end:
                raise HeaderError(f"{join(where, name)}.offset",
                                  f"is {e.offset}, the tensor before it ends at {end}")
            placed, end = e, align(e.offset + e.nbytes)
        return end


#: the ranges of the static shapes (`StaticShapes` has plain ints: checked in `check`)
SHAPE_RANGES = {"seq_length": Range(2), "max_input_length": Range(1), "max_history": Range(1)}


LayerType = Annotated[str, OneOf(LAYER_TYPES, "layer type")]


@dataclass(frozen=True)
class LinearAttentionInfo:
    """The state sizes of the linear-attention layers (`contract.LinearWidths`)."""

    conv_kernel: Annotated[int, Range(2, 64)]
    num_k_heads: Count
    num_v_heads: Count
    head_k_dim: Count
    head_v_dim: Count

    @property
    def widths(self) -> LinearWidths:
        return LinearWidths(self.conv_kernel, self.num_k_heads, self.num_v_heads,
                            self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class ModelInfo:
    family: Name
    num_layers: Count
    hidden_size: Count
    num_heads: Count
    num_kv_heads: Count
    head_dim: Count
    vocab_size: Count
    qk_norm: bool
    tied_embeddings: bool
    #: each layer's kind; `linear` gives the linear-attention layers' sizes (null without)
    layer_types: tuple[LayerType, ...]
    linear: LinearAttentionInfo | None
    config: JsonObject

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]


@dataclass(frozen=True)
class Generation:
    eos_token_ids: tuple[TokenId, ...]
    stop_strings: tuple[str, ...]
    pad_token_id: TokenId | None
    bos_token_id: TokenId | None
    do_sample: bool
    temperature: Annotated[float, Range(0, math.inf)]
    top_k: int
    top_p: Annotated[float, Range(0, 1)]
    repetition_penalty: Annotated[float, Range(*REPETITION_PENALTY_RANGE)]


TokenizerFile = Annotated[str, OneOf(TOKENIZER_FILES, "tokenizer file name")]


@dataclass(frozen=True)
class TokenizerInfo:
    files: tuple[TokenizerFile, ...]


@dataclass(frozen=True)
class NetEntry:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    per_layer: bool
    ir: Name
    streams: Name
    consts: Name
    weights: tuple[Name, ...]
    commands: int
    #: the passes that made the net, as pipeline text (top stage through codegen's machine
    #: passes; `toptpu.pass_pipeline`); None in files written before it was recorded
    pipeline: str | None = None


@dataclass(frozen=True)
class IrStageInfo:
    """Where `toptpu compile --from-ir` picked a net up: the dump file (`block/08-cse.mlir`)
    and whether it had been edited since the dump wrote it."""

    file: str
    edited: bool


@dataclass(frozen=True)
class FromIrInfo:
    """A model file compiled from a `--dump-ir` directory: the directory and each net's
    stage."""

    directory: str
    nets: dict[Name, IrStageInfo]


@dataclass(frozen=True)
class PluginOpInfo:
    """An op of a plugin that the file's nets hold (`toptpu.dialects.plugin_ops`): the
    plugin's name and its package ("toptpu-plugin-example 0.1.0") at compile time."""

    plugin: str
    package: str


@dataclass(frozen=True)
class CompileInfo:
    source: str
    toptpu_version: str
    #: the compile options that chose the passes (`CompilePipeline.describe`: 'default', or
    #: e.g. "--pass-after 'fuse=expand-silu'")
    pipeline: str | None = None
    from_ir: FromIrInfo | None = None
    #: the plugins' ops the nets hold, by op name (`tpu.silu_mul`); opening the file
    #: needs them registered (`LlmFile`, `plugin_ops.require`); None: none
    plugin_ops: dict[Name, PluginOpInfo] | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    quant_method: Name
    packing_format: str
    bits: Annotated[int, Range(1, 8)]
    quantized_layers: int
    dtype: str | None


@dataclass(frozen=True)
class QwenVisionInfo:
    """Qwen2.5-VL / Qwen3-VL / Qwen3.5: how the host lays out an image's `vit` inputs and
    the text positions (`contract.qwen_vit_inputs`, `contract.mrope_position_ids`)."""

    merge_size: Count
    temporal_patch_size: Count
    video_token_id: TokenId
    vision_start_token_id: TokenId
    vision_end_token_id: TokenId
    #: Qwen2.5-VL: the window of its window-attention layers (pixels)
    window_size: Count | None = None
    #: Qwen3-VL / Qwen3.5: the side of the learned position grid the vit interpolates
    position_grid_side: Count | None = None
    #: Qwen3-VL: the DeepStack levels (`deepstack_embeds` rows, `deepstack_add` runs)
    deepstack_levels: Annotated[int, Range(0, 64)] = 0
    #: Qwen2.5-VL: a video's temporal positions per second
    tokens_per_second: Annotated[float, Range(0, 1e6)] | None = None
    #: Qwen3-VL / Qwen3.5: each temporal patch of a video is a grid of its own
    frames_apart: bool = False


@dataclass(frozen=True)
class VisionInfo:
    """What the runtime needs of a VLM's vision net (see `toptpu.backend.runtime.vision`)."""

    kind: Annotated[str, OneOf(tuple(VISION_FAMILIES), "vision family")]
    model_type: Name
    net: Literal["vit"]
    image_token_id: TokenId
    tokens: dict[Name, str]
    token_ids: dict[Name, TokenId]
    processor_class: Name
    processor: JsonObject
    image_size: Count
    patch_size: Count
    max_tiles: Count
    tokens_per_tile: Count
    config: JsonObject
    mode: Mode
    # the keys only some families carry (`toptpu.families.base.FAMILY_KEYS`; each family's
    # `header_keys` and `optional_keys`): MiniCPM-V's and Qwen-VL's patch budget and merge
    max_patches: Count | None = None
    merge_levels: tuple[tuple[Count, Count], ...] | None = None
    token_divisor: Count | None = None
    position_side: Count | None = None
    #: MiniCPM-V 4.7 only: `CANVAS_MARKERS` -> token id; the text nets then take a position
    #: per axis (T, H, W) and the runtime lays them out (`contract.canvas_position_ids`)
    canvas_markers: dict[Name, TokenId] | None = None
    #: Qwen-VL only (kind qwenvl): its M-RoPE text positions and vit layout
    qwen: QwenVisionInfo | None = None

    @property
    def family(self) -> VisionFamily:
        return vision_family(self.kind)

    @property
    def position_axes(self) -> int:
        """The text nets' position axes (`contract.POSITION_AXES`)."""
        return self.family.position_axes(self)

    def check(self, vocab: int, where: str = "vision") -> None:
        family = self.family
        processor, required, marker = family.processor_class, family.tokens, family.marker
        if self.processor_class != processor:
            raise HeaderError(f"{where}.processor_class", f"is {self.processor_class!r}; a "
                                                          f"{self.kind} model uses {processor}")
        for key, table in (("tokens", self.tokens), ("token_ids", self.token_ids)):
            if sorted(table) != sorted(required):
                raise HeaderError(f"{where}.{key}", f"names {sorted(table)}, a {self.kind} "
                                                    f"model needs {sorted(required)}")
        for name, token in self.token_ids.items():
            _check_token(token, vocab, f"{where}.token_ids.{name}")
        if self.image_token_id != self.token_ids[marker]:
            raise HeaderError(f"{where}.image_token_id", f"is {self.image_token_id}, the "
                                                         f"{marker} is {self.token_ids[marker]}")
        for key in FAMILY_KEYS:
            if key in family.optional_keys:
                continue
            if (getattr(self, key) is None) == (key in family.header_keys):
                raise HeaderError(f"{where}.{key}", "is missing" if key in family.header_keys
                                  else f"does not apply to a {self.kind} model")
        problems = family.header_problems(self)
        if problems:
            key, problem = problems[0]
            raise HeaderError(f"{where}.{key}", problem)
        for key, token in family.header_token_ids(self).items():
            _check_token(token, vocab, f"{where}.{key}")


#: how a multi-device file spreads the model (`ParallelInfo.strategy`)
STRATEGIES = ("tp", "pp", "ep")


@dataclass(frozen=True)
class IoSplit:
    """How a net input or output is cut over the devices that run the net: along `axis` in
    `pieces` equal pieces, device d holding piece d * pieces // devices
    (`toptpu.dialects.sharding`); its device programs' IO is that piece."""

    axis: Annotated[int, Range(0, 16)]
    pieces: Count


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a multi-device file: the layers whose weights it holds
    ([first_layer, end_layer)), the nets it runs, and its weight blob (section
    `weights:<d>`: its shared tensors, then its layers' chunks, `weights.layers[i]` for layer
    first_layer + i)."""

    first_layer: int
    end_layer: int
    nets: tuple[Name, ...]
    weights: WeightLayout

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


@dataclass(frozen=True)
class ParallelInfo:
    """A model spread over several devices: `tp` (tensor parallel: every device every layer,
    each its piece of each weight; the nets that all devices run together hold collectives),
    `pp` (pipeline parallel: contiguous layers per device, the embedding on the first,
    the lm_head and heads on the last) or `ep` (expert parallel: every device every layer,
    its share of each layer's experts, the rest whole; the per-layer nets hold an
    all-reduce after the experts; the embeddings and heads on device 0). `splits`: net ->
    IO name -> how each device's part is cut (tp; an IO not named is whole on every
    device)."""

    strategy: Annotated[str, OneOf(STRATEGIES, "parallel strategy")]
    devices: tuple[DeviceInfo, ...]
    splits: dict[Name, dict[Name, IoSplit]]

    def runners(self, net: str, layer: int | None = None) -> list[int]:
        """The devices that run `net` (for a per-layer net: on layer `layer`)."""
        return [d for d, dev in enumerate(self.devices) if net in dev.nets
                and (layer is None or layer in dev.layers)]


@dataclass(frozen=True)
class LlmHeader:
    """The model file header of an LLM (see the module doc)."""

    kind: Literal["toptpu-llm"]
    llm_format: Literal[3]
    chip: Name
    mode: Mode
    group_size: Annotated[int, Range(-1)]
    symmetric: bool | None
    shapes: StaticShapes
    model: ModelInfo
    generation: Generation
    tokenizer: TokenizerInfo
    nets: dict[Name, NetEntry]
    layer_nets: dict[Name, tuple[Name, ...]]
    weights: WeightLayout | None  # None in a multi-device file: each device has its own
    compile: CompileInfo
    checkpoint: CheckpointInfo | None
    vision: VisionInfo | None = None
    parallel: ParallelInfo | None = None  # several devices (`ParallelInfo`)

    def blobs(self) -> list[tuple[WeightLayout, range, tuple[str, ...] | None]]:
        """Every weight blob of the file: (its layout, the layers it holds, the nets that
        read it; None: every net)."""
        if self.parallel is None:
            assert self.weights is not None
            return [(self.weights, range(self.model.num_layers), None)]
        return [(d.weights, d.layers, d.nets) for d in self.parallel.devices]

    @classmethod
    def from_json(cls, data: Any) -> LlmHeader:
        """Decode and check (HeaderError names the first field that is wrong)."""
        if not isinstance(data, dict) or data.get("kind") != KIND:
            kind = data.get("kind") if isinstance(data, dict) else None
            raise HeaderError("kind", f"is {short(kind)}: not an LLM model file")
        header = decode(cls, data)
        header.check()
        return header

    def to_json(self) -> dict[str, Any]:
        return encode(self)

    @property
    def activation_dtype(self) -> str:
        """The numpy dtype name of the text nets' float activations."""
        return numpy_dtype(DTYPE_BY_NAME[QuantMode(self.mode).activation]).name

    def check(self) -> None:
        """The checks across fields (types and most ranges are checked while decoding)."""
        for key, bounds in SHAPE_RANGES.items():
            bounds.check(getattr(self.shapes, key), f"shapes.{key}")
        if self.chip not in chip_names():
            raise HeaderError("chip", f"is {self.chip!r}, not a known chip "
                                      f"({', '.join(chip_names())})")
        if self.group_size == 0:
            raise HeaderError("group_size", "is 0 (a positive group or -1 for per channel)")
        s, m = self.shapes, self.model
        for key in ("max_input_length", "max_history"):
            if getattr(s, key) > s.seq_length:
                raise HeaderError(f"shapes.{key}", f"is {getattr(s, key)}, more than "
                                                   f"shapes.seq_length {s.seq_length}")
        self._check_prefill_lengths()
        if m.num_heads % m.num_kv_heads:
            raise HeaderError("model.num_kv_heads", f"is {m.num_kv_heads}, which does not "
                                                    f"divide model.num_heads {m.num_heads}")
        if len(m.layer_types) != m.num_layers:
            raise HeaderError("model.layer_types", f"has {len(m.layer_types)} entries for "
                                                   f"{m.num_layers} layers")
        if FULL_ATTENTION not in m.layer_types:
            raise HeaderError("model.layer_types", "has no full-attention layer")
        if (m.linear is not None) != (LINEAR_ATTENTION in m.layer_types):
            raise HeaderError("model.linear", "and linear-attention layers come together "
                                              "(one is missing)")
        if m.linear is not None and m.linear.num_v_heads % m.linear.num_k_heads:
            raise HeaderError("model.linear.num_k_heads",
                              f"is {m.linear.num_k_heads}, which does not divide "
                              f"model.linear.num_v_heads {m.linear.num_v_heads}")
        self._check_generation()
        if len(set(self.tokenizer.files)) != len(self.tokenizer.files):
            raise HeaderError("tokenizer.files", "names a file twice")
        self._check_blobs()
        self._check_nets()
        self._check_layer_nets()
        self._check_batch_layer_nets()
        self._check_net_weights()
        self._check_parallel()
        if self.vision is not None:
            self.vision.check(m.vocab_size)
        if (self.vision is not None) != (VISION_NET in self.nets):
            raise HeaderError("vision", "and the vision net come together (one is missing)")

    def _check_prefill_lengths(self) -> None:
        lengths, L = self.shapes.prefill_lengths, self.shapes.max_input_length
        where = "shapes.prefill_lengths"
        for i, n in enumerate(lengths):
            if n < 1:
                raise HeaderError(f"{where}[{i}]", f"is {n}, not a chunk length (>= 1)")
            if i and n <= lengths[i - 1]:
                raise HeaderError(f"{where}[{i}]", f"is {n}, not above {lengths[i - 1]} "
                                                   "(the lengths ascend, each once)")
        if not lengths or lengths[-1] != L:
            raise HeaderError(where, f"is {list(lengths)}: the longest must be "
                                     f"shapes.max_input_length {L}")

    def _check_blobs(self) -> None:
        """One blob (`weights`) for one device, one per device for several, each holding
        its layers' chunks, in its own section."""
        m = self.model
        if (self.weights is None) == (self.parallel is None):
            raise HeaderError("weights", "is one layout for a file of one device, null for "
                                         "one of several (parallel gives each its own)")
        if self.parallel is None:
            assert self.weights is not None
            blobs = [("weights", self.weights, range(m.num_layers), weights_section())]
        else:
            blobs = [(f"parallel.devices[{d}].weights", dev.weights, dev.layers,
                      weights_section(d)) for d, dev in enumerate(self.parallel.devices)]
        for where, layout, layers, section in blobs:
            if layout.section != section:
                raise HeaderError(f"{where}.section", f"is {layout.section!r}, not "
                                                      f"{section!r}")
            if layout.num_layers != len(layers):
                held = (f"model.num_layers is {len(layers)}" if self.parallel is None
                        else f"the device holds {len(layers)} layers")
                raise HeaderError(f"{where}.layers", f"has {layout.num_layers} entries, "
                                                     + held)
            layout.check(where)

    def _weights_field(self, layout: WeightLayout) -> str:
        """The header field of a blob's table: `weights`, or `parallel.devices[d].weights`."""
        if self.parallel is None:
            return "weights"
        d = next(i for i, dev in enumerate(self.parallel.devices) if dev.weights is layout)
        return f"parallel.devices[{d}].weights"

    def _check_parallel(self) -> None:
        par = self.parallel
        if par is None:
            return
        n, layers = len(par.devices), self.model.num_layers
        if n < 2:
            raise HeaderError("parallel.devices", f"has {n} entries: a multi-device file "
                                                  "has at least 2")
        end = 0
        for d, dev in enumerate(par.devices):
            where = f"parallel.devices[{d}]"
            if par.strategy in ("tp", "ep") \
                    and (dev.first_layer, dev.end_layer) != (0, layers):
                what = "a tensor-parallel" if par.strategy == "tp" else "an expert-parallel"
                raise HeaderError(where, f"holds layers [{dev.first_layer}, {dev.end_layer});"
                                         f" {what} device holds all {layers}")
            if par.strategy == "pp" and not (dev.first_layer == end < dev.end_layer):
                raise HeaderError(f"{where}.first_layer",
                                  f"is {dev.first_layer} (to {dev.end_layer}); pipeline "
                                  f"stages hold contiguous layers, this one from {end}")
            end = dev.end_layer
            for i, net in enumerate(dev.nets):
                if net not in self.nets:
                    raise HeaderError(f"{where}.nets[{i}]", f"is {net!r}, not a net of "
                                                            "this file")
        if par.strategy == "pp" and end != layers:
            raise HeaderError("parallel.devices", f"hold layers up to {end} of {layers}")
        for name in self.nets:
            runs = par.runners(name)
            if not runs:
                raise HeaderError("parallel.devices", f"run no net {name!r}")
            if self.nets[name].per_layer:
                for layer, base in ((i, b) for b, names in self.layer_nets.items()
                                    for i, nm in enumerate(names) if nm == name):
                    want = 1 if par.strategy == "pp" else n
                    if len(par.runners(name, layer)) != want:
                        raise HeaderError("parallel.devices",
                                          f"run {base} of layer {layer} on "
                                          f"{len(par.runners(name, layer))} devices, not "
                                          f"{want}")
        for net, io in par.splits.items():
            entry = self.nets.get(net)
            if entry is None or par.strategy != "tp":
                raise HeaderError(f"parallel.splits.{net}", "names no net of this file"
                                  if entry is None else "apply to tensor parallelism only")
            runs = par.runners(net)
            if not entry.per_layer and len(runs) != n:
                raise HeaderError("parallel.devices",
                                  f"run the tensor-parallel net {net!r} on {len(runs)} of the "
                                  f"{n} devices: its weights and inputs are cut in {n}, "
                                  "every device runs its piece")
            specs = {s.name: s for s in (*entry.inputs, *entry.outputs)}
            for name, split in io.items():
                where = f"parallel.splits.{net}.{name}"
                spec = specs.get(name)
                if spec is None:
                    raise HeaderError(where, f"names no input or output of net {net!r}")
                if split.axis >= len(spec.shape) or spec.shape[split.axis] % split.pieces \
                        or n % split.pieces:
                    raise HeaderError(where, f"cuts {list(spec.shape)} along axis "
                                             f"{split.axis} in {split.pieces} pieces over "
                                             f"{n} devices: it must divide both")

    def _check_generation(self) -> None:
        g, vocab = self.generation, self.model.vocab_size
        for i, token in enumerate(g.eos_token_ids):
            _check_token(token, vocab, f"generation.eos_token_ids[{i}]")
        for key in ("pad_token_id", "bos_token_id"):
            if getattr(g, key) is not None:
                _check_token(getattr(g, key), vocab, f"generation.{key}")
        if g.top_p == 0:
            raise HeaderError("generation.top_p", "is 0 (it must be in (0, 1])")
        if g.repetition_penalty == 0:
            raise HeaderError("generation.repetition_penalty", "is 0 (it must be > 0)")

    def _check_nets(self) -> None:
        axes = self.vision.position_axes if self.vision is not None else 1
        contract = net_io(self.shapes, self.model, self.activation_dtype, axes)
        linear = {} if self.model.linear is None else linear_net_io(
            self.shapes, self.model.hidden_size, self.model.linear.widths,
            self.activation_dtype)
        required = [*TEXT_NETS, *(self.shapes.prefill_net(base, n)
                                  for n in self.shapes.shorter_lengths for base in PREFILL_NETS)]
        batch = self.batch
        if batch:
            required += [str(NetName(n, batch=batch)) for n in BATCH_NETS]
            contract.update(batch_net_io(self.shapes, self.model, self.activation_dtype, batch,
                                         axes))
        missing = [n for n in required if n not in self.nets]
        if missing:
            raise HeaderError("nets", f"lacks the nets {missing}")
        for name, net in self.nets.items():
            where = f"nets.{name}"
            base = self._base_net(name, where)
            if NetName.parse(name).batch not in (0, batch):
                raise HeaderError(where, f"is a net at batch {NetName.parse(name).batch}, "
                                         f"the file's batch nets are at {batch}")
            if NetName.parse(name).batch and net.per_layer and \
                    self._kind_of(name) == LINEAR_ATTENTION:
                raise HeaderError(where, "is a batch net of a linear-attention layer, which "
                                         "has none")
            contract_name = str(NetName.parse(name).at_layer(0))
            if net.per_layer != (base in PER_LAYER_NETS):
                raise HeaderError(f"{where}.per_layer", f"is {net.per_layer} for a "
                                                        f"{base} net")
            for key, want in (("ir", ir_section(name)), ("streams", stream_section(name)),
                              ("consts", const_section(name))):
                if getattr(net, key) != want:
                    raise HeaderError(f"{where}.{key}", f"is {getattr(net, key)!r}, not "
                                                        f"{want!r}")
            for key in ("inputs", "outputs"):
                specs = getattr(net, key)
                _check_specs(specs, f"{where}.{key}")
                kind_contract = contract
                if net.per_layer and self._kind_of(name) == LINEAR_ATTENTION:
                    kind_contract = linear
                if contract_name in kind_contract:
                    _check_contract(specs, kind_contract[contract_name][key == "outputs"],
                                    f"{where}.{key}")

    def _check_net_weights(self) -> None:
        """Every weight a net reads is in the chunk of a layer that runs it, or shared, in
        every blob of a device that runs it (after `_check_layer_nets`: a layer given the
        wrong net is named as that)."""
        for name, net in self.nets.items():
            where = f"nets.{name}"
            if len(set(net.weights)) != len(net.weights):
                raise HeaderError(f"{where}.weights", "names a tensor twice")
            for d, (layout, _layers, nets) in enumerate(self.blobs()):
                if nets is not None and name not in nets:
                    continue
                tables = [layout.chunks[c] for c in self.net_chunks(name, d)] \
                    if net.per_layer else []
                known = set().union(*tables) if tables else set()
                for i, w in enumerate(net.weights):
                    if w not in layout.shared and w not in known:
                        raise HeaderError(f"{where}.weights[{i}]",
                                          f"is {w!r}, which the weight table "
                                          f"{'' if nets is None else f'of device {d} '}"
                                          "does not have")

    def _base_net(self, name: str, where: str) -> str:
        """The net whose role `name` plays (`block@3` and `block:16` are `block`s): a
        layer of the model, a length among the shorter prefill lengths, and a variant at a
        shorter length only beside its net at `max_input_length` (and the other way
        round, `_check_nets`)."""
        try:
            net = NetName.parse(name)
        except ContractError:
            net = None
        if net is None or net.layer >= self.model.num_layers:
            raise HeaderError(where, f"names an unknown net (nets: {', '.join(KNOWN_NETS)}, "
                                     f"<prefill net>:<length>, or <per-layer net>"
                                     f"[:<length>]@<layer> for a layer of "
                                     f"{self.model.num_layers})")
        if net.length and net.length not in self.shapes.shorter_lengths:
            raise HeaderError(where, f"is a net at chunk length {net.length}, not one of the "
                                     f"shorter prefill lengths "
                                     f"{list(self.shapes.shorter_lengths)} "
                                     "(shapes.prefill_lengths)")
        if net.is_variant:
            at_full = str(net.at_length(0))
            siblings = [str(net.at_length(n)) for n in self.shapes.shorter_lengths] \
                if net.base in PREFILL_NETS else []
            lacking = [n for n in (at_full, *siblings) if n not in self.nets]
            if lacking:
                raise HeaderError(where, f"is a variant without the net {lacking[0]!r} (a "
                                         "variant has its nets at every prefill length)")
        return net.base

    @property
    def batch(self) -> int:
        """The batch B of the file's batch nets (`block_cache.b4`: 4; the most common when
        they disagree, which `check` refuses), 0 without."""
        seen: dict[int, int] = {}
        for name in self.nets:
            try:
                b = NetName.parse(name).batch
            except ContractError:
                continue
            if b:
                seen[b] = seen.get(b, 0) + 1
        return max(seen, key=lambda b: seen[b]) if seen else 0

    def _kind_of(self, name: str) -> str:
        """The layer kind a per-layer net computes: its representative layer's."""
        return self.model.layer_type(NetName.parse(name).layer)

    def _check_layer_nets(self) -> None:
        if sorted(self.layer_nets) != sorted(PER_LAYER_NETS):
            raise HeaderError("layer_nets", f"names {sorted(self.layer_nets)}, not the "
                                            f"per-layer nets {sorted(PER_LAYER_NETS)}")
        for base, names in self.layer_nets.items():
            where = f"layer_nets.{base}"
            if len(names) != self.model.num_layers:
                raise HeaderError(where, f"has {len(names)} entries for "
                                         f"{self.model.num_layers} layers")
            for i, name in enumerate(names):
                if name not in self.nets or NetName.parse(name).base != base \
                        or NetName.parse(name).length:
                    raise HeaderError(f"{where}[{i}]", f"is {name!r}, not a {base} net of "
                                                       "this file")
                if self._kind_of(name) != self.model.layer_type(i):
                    raise HeaderError(f"{where}[{i}]", f"is {name!r}, a "
                                                       f"{self._kind_of(name)} net, for a "
                                                       f"{self.model.layer_type(i)} layer")
                for layout, layers, nets in self.blobs():
                    if i not in layers or (nets is not None and name not in nets):
                        continue
                    local = i - layers.start
                    chunk = layout.chunk_of(local)
                    lacks = [w for w in self.nets[name].weights
                             if w not in chunk and w not in layout.shared]
                    if lacks:
                        raise HeaderError(f"{where}[{i}]", f"is {name!r}, which reads "
                                          f"{lacks[0]!r}: not in layer {i}'s chunk "
                                          f"({self._weights_field(layout)}.chunks"
                                          f"[{layout.layers[local].chunk}])")

    def _check_batch_layer_nets(self) -> None:
        """With batch nets, each layer's `block_cache` has its batch net."""
        batch = self.batch
        if not batch:
            return
        for i, name in enumerate(self.layer_nets[BLOCK_CACHE]):
            want = str(NetName.parse(name).at_batch(batch))
            if want not in self.nets:
                raise HeaderError(f"layer_nets.{BLOCK_CACHE}[{i}]",
                                  f"is {name!r}, which has no batch net {want!r}")

    def net_chunks(self, net: str, blob: int = 0) -> list[int]:
        """The chunk layouts (indices into the `blob`-th blob's `chunks`: `weights`, or
        device `blob`'s) of the layers that run the per-layer net `net` (`layer_nets`; at a
        shorter prefill length as at `max_input_length`) and lie in that blob, in order of
        first use."""
        layout, layers, _ = self.blobs()[blob]
        out: dict[int, None] = {}
        try:
            net = str(NetName.parse(net).layer_net)
        except ContractError:
            return []
        for names in self.layer_nets.values():
            for i, name in enumerate(names):
                if name == net and i in layers and i - layers.start < layout.num_layers:
                    out[layout.layers[i - layers.start].chunk] = None
        return list(out)


def _check_token(token: int, vocab: int, where: str) -> None:
    if token >= vocab:
        raise HeaderError(where, f"is {token}, outside the vocabulary of {vocab} "
                                 "(model.vocab_size)")


def _check_specs(specs: tuple[TensorSpec, ...], where: str) -> None:
    """Net IO: names, known dtypes, positive dims, a bounded size, no name twice."""
    for i, s in enumerate(specs):
        at = f"{where}[{i}]"
        NamePattern().check(s.name, f"{at}.name")
        OneOf(tuple(sorted(KNOWN_DTYPES)), "dtype").check(s.dtype, f"{at}.dtype")
        if not s.shape or any(d < 1 for d in s.shape) or math.prod(s.shape) > MAX_ELEMENTS:
            raise HeaderError(f"{at}.shape", f"is {list(s.shape)}: dims must be >= 1, at "
                                             f"most {MAX_ELEMENTS} elements")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise HeaderError(where, f"names a tensor twice ({names})")


def _check_contract(specs: tuple[TensorSpec, ...], want: tuple[TensorSpec, ...],
                    where: str) -> None:
    if len(specs) != len(want):
        raise HeaderError(where, f"has {len(specs)} tensors, the net contract "
                                 f"{[w.name for w in want]}")
    for i, (s, w) in enumerate(zip(specs, want, strict=True)):
        if s != w:
            raise HeaderError(f"{where}[{i}]", f"is {s.name} {s.dtype} {list(s.shape)}, the net "
                                               f"contract (from shapes, model and mode) is "
                                               f"{w.name} {w.dtype} {list(w.shape)}")


# =========================================================================== the file


def write_llm_file(path: str, header: LlmHeader, irs: Mapping[str, str],
                   tokenizer_files: Mapping[str, bytes],
                   blob: np.ndarray | StreamedSection | Mapping[str, Section],
                   extra_sections: Mapping[str, bytes] | None = None) -> None:
    """Write the model file atomically (see the module doc for the layout).
    `blob` is the weight blob, in memory or streamed (made region by region while it is
    written), or for a multi-device file every device's by section (`weights:<d>`);
    `extra_sections` adds the nets' command streams and constant pools (sections
    `stream:<net>` and `const:<net>`)."""
    header_json = header.to_json()
    # what a reader will decode: the same schema checks before anything is written
    LlmHeader.from_json(json.loads(json.dumps(header_json, sort_keys=True, allow_nan=False)))
    sections: dict[str, Section] = {}
    for net, text in irs.items():
        sections[ir_section(net)] = text.encode()
    for name, content in tokenizer_files.items():
        sections[tokenizer_section(name)] = content
    sections.update(extra_sections or {})
    blobs = blob if isinstance(blob, Mapping) else {WEIGHTS_SECTION: blob}
    for name, data in blobs.items():
        if isinstance(data, StreamedSection | GroupedSection):
            sections[name] = data
        else:
            sections[name] = np.ascontiguousarray(data, dtype=np.uint8).data
    for layout, _, _ in header.blobs():
        section = sections.get(layout.section)
        size = section.size if isinstance(section, StreamedSection | GroupedSection) \
            else len(section or b"")
        if size != layout.size:
            raise ValueError(f"the weight blob {layout.section} has {size} bytes, its "
                             f"weight table {layout.size}")
    want = _referenced_sections(header)
    if set(sections) != want:
        raise ValueError(f"the sections {sorted(set(sections) ^ want)} do not match the "
                         "header")
    write_model_file(path, header_json, sections)


def _referenced_sections(header: LlmHeader) -> set[str]:
    names = {layout.section for layout, _, _ in header.blobs()}
    for net in header.nets.values():
        names |= {net.ir, net.streams, net.consts}
    return names | {tokenizer_section(n) for n in header.tokenizer.files}


class LlmFile:
    """A loaded, validated LLM model file (memory mapped).

    `meta` is the typed header (`LlmHeader`); `header` is its JSON form (a dict rebuilt from
    the validated `meta`, for readers that index it)."""

    def __init__(self, path: str, verify_checksums: bool = True,
                 plugin_ops: bool = True) -> None:
        """`plugin_ops`: make the plugin ops the nets hold known (`require_plugin_ops`),
        what running the file needs (False: the header and sections only, as `info`
        reads them)."""
        self.path = path
        self.file = ModelFile(path, verify_checksums)
        try:
            self.meta = self._validate()
        except BaseException:
            self.file.close()
            raise
        self.header: dict[str, Any] = self.meta.to_json()
        #: the weight table of a one-device file (`device_layout` for several); the ignore:
        #: None in a multi-device file, whose readers use `device_layout`
        self.layout: WeightLayout = self.meta.weights  # type: ignore[assignment]
        if plugin_ops:
            try:
                self.require_plugin_ops()
            except BaseException:
                self.file.close()
                raise

    def require_plugin_ops(self) -> None:
        """Make the plugin ops the nets hold (`compile.plugin_ops`) known to this process,
        loading the installed plugins' ops (`plugin_ops.require`); ModelFileError naming
        the op and its plugin when none declares it."""
        ops = self.meta.compile.plugin_ops or {}
        try:
            require_plugin_ops({n: (i.plugin, i.package) for n, i in ops.items()},
                               f"'{self.path}'")
        except PluginOpMissingError as e:
            raise ModelFileError(str(e)) from None

    def device_layout(self, device: int) -> WeightLayout:
        """Device `device`'s weight table (a multi-device file)."""
        par = self.meta.parallel
        if par is None or not 0 <= device < len(par.devices):
            raise self._err(f"has no device {device}")
        return par.devices[device].weights

    def _err(self, msg: str) -> ModelFileError:
        return ModelFileError(f"'{self.path}': {msg}")

    def _validate(self) -> LlmHeader:
        raw = self.file.header
        if raw.get("kind") != KIND:
            raise self._err(f"not an LLM model file (kind {short(raw.get('kind'))}); compile one "
                            "with `toptpu compile MODEL_DIR`")
        try:
            meta = LlmHeader.from_json(raw)
        except HeaderError as e:
            raise self._err(f"invalid header: {e}; recompile the model with "
                            "`toptpu compile`") from e
        have, want = set(self.file.sections), _referenced_sections(meta)
        if want - have:
            raise self._err(f"has no section '{sorted(want - have)[0]}', which the header "
                            "names")
        if have - want:
            raise self._err(f"has a section '{sorted(have - want)[0]}' that the header does "
                            "not name")
        for layout, _, _ in meta.blobs():
            blob = self.file.sections[layout.section].size
            if layout.size != blob:
                raise self._err(f"the weight table needs {layout.size} bytes, the blob "
                                f"{layout.section} has {blob}")
        return meta

    # ------------------------------------------------------------------ access
    @property
    def num_layers(self) -> int:
        return self.meta.model.num_layers

    def net_infos(self) -> dict[str, NetInfo]:
        return {name: NetInfo(name, d.inputs, d.outputs, d.per_layer)
                for name, d in self.meta.nets.items()}

    def net_ir(self, net: str) -> str:
        if net not in self.meta.nets:
            raise self._err(f"has no net '{net}'")
        try:
            return self.file.read(self.meta.nets[net].ir).decode()
        except UnicodeDecodeError as e:
            raise self._err(f"the IR of net '{net}' is not UTF-8 text: {e}") from e

    def net_module(self, net: str) -> ModuleOp:
        return parse_ir(self.net_ir(net), f"{self.path}:{net}")

    def _blob(self) -> np.ndarray:
        return np.frombuffer(self.file.view(WEIGHTS_SECTION), np.uint8)

    def _view(self, blob: np.ndarray, offset: int, e: WeightEntry) -> np.ndarray:
        return blob[offset:offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.shape)

    def shared_weights(self) -> dict[str, np.ndarray]:
        """Zero-copy, read-only views of the shared tensors."""
        blob = self._blob()
        return {n: self._view(blob, e.offset, e) for n, e in self.layout.shared.items()}

    def layer_weights(self, layer: int) -> dict[str, np.ndarray]:
        """Zero-copy views of layer `layer`'s chunk."""
        if not 0 <= layer < self.num_layers:
            raise self._err(f"has {self.num_layers} layers, not layer {layer}")
        blob = self._blob()
        base = self.layout.layer_start(layer)
        return {n: self._view(blob, base + e.offset, e)
                for n, e in self.layout.chunk_of(layer).items()}

    def tokenizer_files(self) -> dict[str, bytes]:
        return {n: self.file.read(tokenizer_section(n)) for n in self.meta.tokenizer.files}

    def close(self) -> None:
        """Unmap the file; while zero-copy weight views are alive the mapping stays until
        they are garbage collected."""
        self.file.close()
