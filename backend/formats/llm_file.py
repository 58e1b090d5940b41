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
  shorter length: a variant has its nets at every length as layer 0's have). Nets of
  different lengths read the same tensors of a layer's chunk: no byte is stored twice
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
  the full-attention nets take `position_ids` [3, n] (T, H, W) instead of [1, n]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.contract import (
    CANVAS_MARKERS,
    FULL_ATTENTION,
    KNOWN_NETS,
    LAYER_TYPES,
    LINEAR_ATTENTION,
    PER_LAYER_NETS,
    PREFILL_NETS,
    REPETITION_PENALTY_RANGE,
    TEXT_NETS,
    TOKENIZER_FILES,
    VISION_KINDS,
    VISION_NET,
    ContractError,
    LinearWidths,
    NetInfo,
    NetName,
    StaticShapes,
    TensorSpec,
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
    ModelFile,
    ModelFileError,
    Section,
    StreamedSection,
    write_model_file,
)
from toptpu.backend.target.chips import chip_names
from toptpu.dialects.common import DTYPE_BY_NAME, QuantMode, numpy_dtype
from toptpu.dialects.ir_text import parse_ir

KIND = "toptpu-llm"
LLM_FORMAT = 3
WEIGHTS_SECTION = "weights"
WEIGHT_ALIGN = 64

#: numpy dtype names of the element types toptpu knows
KNOWN_DTYPES = frozenset(numpy_dtype(t).name for t in DTYPE_BY_NAME.values())
#: the most elements one net input/output may have
MAX_ELEMENTS = 2**40


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
    section: Literal["weights"]
    alignment: Literal[64]

    @classmethod
    def plan(cls, shared: TensorSpecs, chunks: Sequence[TensorSpecs],
             layer_chunks: Sequence[int]) -> WeightLayout:
        """Lay out tensors given as name -> (shape, dtype) (in the order given): the shared
        ones, then for layer i a chunk laid out as `chunks[layer_chunks[i]]`."""
        sh, end = cls._place(shared)
        placed = [cls._place(c) for c in chunks]
        layers, offset = [], align(end)
        for c in layer_chunks:
            if not 0 <= c < len(placed):
                raise ValueError(f"layer {len(layers)}: chunk {c} of {len(placed)}")
            layers.append(LayerChunk(c, offset))
            offset += placed[c][1]
        return cls(sh, tuple(p[0] for p in placed), tuple(layers), offset, WEIGHTS_SECTION,
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


@dataclass(frozen=True)
class CompileInfo:
    source: str
    toptpu_version: str


@dataclass(frozen=True)
class CheckpointInfo:
    quant_method: Name
    packing_format: str
    bits: Annotated[int, Range(1, 8)]
    quantized_layers: int
    dtype: str | None


@dataclass(frozen=True)
class VisionInfo:
    """What the runtime needs of a VLM's vision net (see `toptpu.backend.runtime.vision`)."""

    kind: Annotated[str, OneOf(tuple(VISION_KINDS), "vision family")]
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
    # MiniCPM-V only
    max_patches: Count | None = None
    merge_levels: tuple[tuple[Count, Count], ...] | None = None
    token_divisor: Count | None = None
    position_side: Count | None = None
    #: MiniCPM-V 4.7 only: `CANVAS_MARKERS` -> token id; the text nets then take a position
    #: per axis (T, H, W) and the runtime lays them out (`contract.canvas_position_ids`)
    canvas_markers: dict[Name, TokenId] | None = None

    @property
    def position_axes(self) -> int:
        """The text nets' position axes (`contract.POSITION_AXES`)."""
        return 3 if self.canvas_markers is not None else 1

    def check(self, vocab: int, where: str = "vision") -> None:
        processor, required, marker = VISION_KINDS[self.kind]
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
        minicpmv = ("max_patches", "merge_levels", "token_divisor", "position_side")
        for key in minicpmv:
            if (getattr(self, key) is None) == (self.kind == "minicpmv"):
                raise HeaderError(f"{where}.{key}", "is missing" if self.kind == "minicpmv"
                                  else f"does not apply to a {self.kind} model")
        if self.canvas_markers is not None:
            if self.kind != "minicpmv":
                raise HeaderError(f"{where}.canvas_markers",
                                  f"does not apply to a {self.kind} model")
            if sorted(self.canvas_markers) != sorted(CANVAS_MARKERS):
                raise HeaderError(f"{where}.canvas_markers",
                                  f"names {sorted(self.canvas_markers)}, a canvas needs "
                                  f"{sorted(CANVAS_MARKERS)}")
            for name, token in self.canvas_markers.items():
                _check_token(token, vocab, f"{where}.canvas_markers.{name}")
            if self.token_divisor not in (4, 16):
                raise HeaderError(f"{where}.token_divisor",
                                  f"is {self.token_divisor}; a canvas merges 2x2 or 4x4 "
                                  "patches into a token (4 or 16)")


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
    weights: WeightLayout
    compile: CompileInfo
    checkpoint: CheckpointInfo | None
    vision: VisionInfo | None = None

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
        if self.weights.num_layers != m.num_layers:
            raise HeaderError("weights.layers", f"has {self.weights.num_layers} entries, "
                                                f"model.num_layers is {m.num_layers}")
        self.weights.check()
        self._check_nets()
        self._check_layer_nets()
        self._check_net_weights()
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
        missing = [n for n in required if n not in self.nets]
        if missing:
            raise HeaderError("nets", f"lacks the nets {missing}")
        for name, net in self.nets.items():
            where = f"nets.{name}"
            base = self._base_net(name, where)
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
        """Every weight a net reads is in the chunk of a layer that runs it, or shared
        (after `_check_layer_nets`: a layer given the wrong net is named as that)."""
        for name, net in self.nets.items():
            where = f"nets.{name}"
            if len(set(net.weights)) != len(net.weights):
                raise HeaderError(f"{where}.weights", "names a tensor twice")
            tables = [self.weights.chunks[c] for c in self.net_chunks(name)] \
                if net.per_layer else []
            known = set().union(*tables) if tables else set()
            for i, w in enumerate(net.weights):
                if w not in self.weights.shared and w not in known:
                    raise HeaderError(f"{where}.weights[{i}]", f"is {w!r}, which the weight "
                                                               "table does not have")

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
                chunk = self.weights.chunk_of(i)
                lacks = [w for w in self.nets[name].weights
                         if w not in chunk and w not in self.weights.shared]
                if lacks:
                    raise HeaderError(f"{where}[{i}]", f"is {name!r}, which reads "
                                      f"{lacks[0]!r}: not in layer {i}'s chunk "
                                      f"(weights.chunks[{self.weights.layers[i].chunk}])")

    def net_chunks(self, net: str) -> list[int]:
        """The chunk layouts (indices into `weights.chunks`) of the layers that run the
        per-layer net `net` (`layer_nets`; at a shorter prefill length as at
        `max_input_length`), in order of first use."""
        out: dict[int, None] = {}
        try:
            net = str(NetName.parse(net).at_length(0))
        except ContractError:
            return []
        for names in self.layer_nets.values():
            for i, name in enumerate(names):
                if name == net and i < self.weights.num_layers:
                    out[self.weights.layers[i].chunk] = None
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
                   tokenizer_files: Mapping[str, bytes], blob: np.ndarray | StreamedSection,
                   extra_sections: Mapping[str, bytes] | None = None) -> None:
    """Write the model file atomically (see the module doc for the layout).
    `blob` is the weight blob, in memory or streamed (made region by region while it is
    written); `extra_sections` adds the nets' command streams and constant pools (sections
    `stream:<net>` and `const:<net>`)."""
    header_json = header.to_json()
    # what a reader will decode: the same schema checks before anything is written
    LlmHeader.from_json(json.loads(json.dumps(header_json, sort_keys=True, allow_nan=False)))
    sections: dict[str, Section] = {}
    for net, text in irs.items():
        sections[ir_section(net)] = text.encode()
    for name, data in tokenizer_files.items():
        sections[tokenizer_section(name)] = data
    sections.update(extra_sections or {})
    if isinstance(blob, StreamedSection):
        sections[WEIGHTS_SECTION] = blob
    else:
        sections[WEIGHTS_SECTION] = memoryview(np.ascontiguousarray(blob, dtype=np.uint8))
    size = sections[WEIGHTS_SECTION]
    size = size.size if isinstance(size, StreamedSection) else len(size)
    if size != header.weights.size:
        raise ValueError(f"the weight blob has {size} bytes, the weight table "
                         f"{header.weights.size}")
    want = _referenced_sections(header)
    if set(sections) != want:
        raise ValueError(f"the sections {sorted(set(sections) ^ want)} do not match the "
                         "header")
    write_model_file(path, header_json, sections)


def _referenced_sections(header: LlmHeader) -> set[str]:
    names = {WEIGHTS_SECTION}
    for net in header.nets.values():
        names |= {net.ir, net.streams, net.consts}
    return names | {tokenizer_section(n) for n in header.tokenizer.files}


class LlmFile:
    """A loaded, validated LLM model file (memory mapped).

    `meta` is the typed header (`LlmHeader`); `header` is its JSON form (a dict rebuilt from
    the validated `meta`, for readers that index it)."""

    def __init__(self, path: str, verify_checksums: bool = True) -> None:
        self.path = path
        self.file = ModelFile(path, verify_checksums)
        try:
            self.meta = self._validate()
        except BaseException:
            self.file.close()
            raise
        self.header: dict[str, Any] = self.meta.to_json()
        self.layout = self.meta.weights

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
        blob = self.file.sections[WEIGHTS_SECTION].size
        if meta.weights.size != blob:
            raise self._err(f"the weight table needs {meta.weights.size} bytes, the blob has "
                            f"{blob}")
        return meta

    # ------------------------------------------------------------------ access
    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

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
