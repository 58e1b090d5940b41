"""Vision-language models, the compile side's torch part: the three vision families of
`toptpu.families` — InternVL (HF-format InternVL2.5/3, `internvl`), MiniCPM-V 4.6 / 4.7
(`minicpmv`) and Qwen-VL (Qwen2.5-VL, Qwen3-VL and Qwen3.5's vision tower, `qwenvl`; the
vit wrapper and `deepstack_add` in `toptpu.frontends.qwen_vl`, its `VisionModel` here,
`QwenVisionModel`) — each a `VisionModel` built by its entry in `VISION_MODELS`.

A VLM is compiled as its text model — the existing LLM nets, through a causal-LM view
that shares the VLM's own language model and lm_head (`text_causal_lm`) — plus one static
`vit` net: the vision tower and projector for ONE tile (InternVL), slice (MiniCPM-V) or
image or video over a patch budget (Qwen-VL), at the compiled size; Qwen3-VL adds its
`deepstack_add` net. The runtime (`toptpu.backend.runtime.vision`, with the family's host
side) preprocesses an image with the model's own Pillow image processor, runs `vit` once
per tile, slice or image and writes the output rows over the embeddings of the image
placeholder tokens, in order.

Videos: Qwen-VL only (`VisionFamily.takes_video`), given as their frames (image files: no
video decoder), one `vit` run over the frames' temporal patches within the same budget;
InternVL and MiniCPM-V take images only (a video is refused naming the model type).

`vit` nets (the net contract, `toptpu.backend.contract`):

- InternVL: `pixel_values` f32 [1, 3, S, S] -> `image_embeds` [1, T, H]; T = (S/p * r)^2
  for patch p and downsample ratio r (256 for 448 px tiles). The wrapper calls the model's
  own modules: patch-embedding conv, CLS token and position embeddings (interpolated once,
  at compile time, when S differs from the checkpoint's size, with the model's own
  `interpolate_pos_encoding`), every `InternVLVisionLayer` (layer or RMS norm, q/k norm,
  layer scale), the final norm, the model's `pixel_shuffle` and the MLP projector.
- MiniCPM-V 4.6 and 4.7 (one vision tower: transformers' 4.7 classes are 4.6's):
  `pixel_values` f32 [1, 3, P, N*P] (a NaViT-packed slice in merge order,
  see `toptpu.backend.contract.pack_slice`), `position_ids_vit` i32 [1, N], `attention_mask`
  [1, 1, 1, N] -> `image_embeds` [1, N/16, H]. N is a static patch budget (default
  the largest slice the processor makes from any image of aspect ratio up to 10, found
  with the processor's own sizing functions: slices are not square and hold up to ~1.2
  (S/p)^2 patches after its rounding; a larger slice is a clear error at run time). The
  encoder layers, the window-attention merger after `insert_layer_id` (windows of 4
  consecutive tokens: batched attention, the mean residual and the model's MLP) and the
  downsample MLP merger are the model's modules; attention is written out (`_attend`)
  because the model's own splits its packed sequence at `cu_seqlens` on the host, which a
  static net replaces by the key mask.

Both wrappers are checked against the model's own `get_image_features` at compile time
(`VisionModel.check`), as the block wrapper is checked against the decoder layer.

A directory is loaded whole (`_load_dir`: transformers `from_pretrained` in float32) or, for
the compiler, streamed (`_stream_dir`): the VLM is built on the meta device, the checkpoint's
tensor names are mapped to its parameters by transformers' own renaming and checked (names,
shapes, dtypes) from the shard headers, the text model becomes a streaming skeleton
(`frontends.streaming`) over the checkpoint's text tensors under the causal LM's names, and
the vision tower and projector — the one `vit` net — are read whole from the shards in
float32. Both give the same model file, byte for byte.

The text model is any the LLM splitter takes: MiniCPM-V 4.6 and 4.7 ship Qwen3.5
(`qwen3_5_text`: Gated DeltaNet and gated full-attention layers, each kind with nets of its
own). MiniCPM-V 4.6 gives every token one text position. MiniCPM-V 4.7 lays out its image
tokens on a canvas of its text model's multi-axis rotary (canvas M-RoPE: a position per
axis T, H, W; `toptpu.backend.contract.canvas_position_ids`): its full-attention nets take
position_ids [3, n] (`split_model(position_axes=3)`, `VisionModel.position_axes`) and the
header's vision section names the tokens the canvas is pinned to (`canvas_markers`).

The Qwen-VL `vit` net (`toptpu.frontends.qwen_vl.QwenVit`, `qwen_vit_spec`) takes the
image processor's patches over a static budget of N patches with their rotary positions,
frame-block key masks (Qwen2.5-VL: window masks too; Qwen3-VL and Qwen3.5: the learned
position grid's bilinear taps) and gives the merged rows (Qwen3-VL: and the DeepStack rows);
its text nets take M-RoPE positions [3, n].

The mixtures of experts Qwen3-VL-MoE (a Qwen3-MoE text model) and Qwen3.5-MoE (the hybrid
MoE text model) are Qwen-VL models like the others; their checkpoints may hold the experts
one tensor per expert (`save_pretrained`'s hub layout, merged by transformers on loading) or
fused, Qwen3-VL-MoE's published ones with the last two axes swapped (transposed by
transformers on loading): the streaming compile reads all three (`_checkpoint_names`).

What is not supported: a VLM whose text model is Qwen3-Next (refused by name), InternVL
`vision_feature_layer` other than -1, videos for InternVL and MiniCPM-V, and Qwen2-VL
(docs/limits.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toptpu.backend.contract import (
    ATTENTION_MASK,
    CANVAS_MARKERS,
    DEEPSTACK,
    DEEPSTACK_EMBEDS,
    DEEPSTACK_NET,
    HIDDEN,
    HIDDEN_OUT,
    IMAGE_EMBEDS,
    INTERP_INDICES,
    INTERP_WEIGHTS,
    PIXEL_VALUES,
    POSITION_IDS_VIT,
    VISION_NET,
    WINDOW_MASK,
    ModelDirFileError,
    StaticShapes,
    merge_order,
    pack_slice,
    qwen_vit_inputs,
    read_model_file,
)
from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader
from toptpu.errors import one_line_reason
from toptpu.families import INTERNVL, MINICPMV, QWEN_VL, vlm_family_of
from toptpu.families import VLM_MODEL_TYPES as FAMILY_OF_VLM
from toptpu.families.base import VisionFamily
from toptpu.frontends.hf_loader import (
    _IGNORABLE_SUFFIXES,
    FLOAT_DTYPES,
    LoadedModel,
    ModelLoadError,
    _listing,
    _read_tokenizer_files,
    _tokenizer_files_of,
    check_config,
    check_model_dir,
    dir_bytes,
    generation_settings,
    quiet_transformers,
    read_generation_config,
)
from toptpu.frontends.llm import LAYER_PREFIX, TORCH_ACTIVATIONS, NetSpec, SplitError
from toptpu.frontends.moe import SwappedExperts, is_fused_parameter, stacked_name, stacked_shapes
from toptpu.frontends.qwen_vl import (
    DEFAULT_MAX_PIXELS,
    QWEN_TOKEN_IDS,
    QWEN_TOKENS,
    QWEN_VL_TEXT_TYPES,
    DeepStackAdd,
    QwenVit,
    TextCausalLM,
    text_model_shell,
)
from toptpu.frontends.streaming import StreamedWeights, skeleton, to_f32

#: VLM model_type -> the transformers class of the whole VLM (the families' tables)
VLM_CLASSES = {mt: family.model_types[mt] for mt, family in FAMILY_OF_VLM.items()}
#: the tokenizer attribute (or text) of the token each canvas marker names
_CANVAS_TOKENS = {"image_start_id": "image_start_token", "image_end_id": "image_end_token",
                  "slice_start_id": "slice_start_token", "slice_end_id": "slice_end_token"}


def image_processor_class(family: VisionFamily) -> Any:
    """The model's own Pillow image processor class (the torchvision-based ones do not
    install beside torch 2.13)."""
    import transformers

    return getattr(transformers, family.processor_class)


# =========================================================================== detection


def vlm_model_type(source: Any) -> str | None:
    """The VLM model_type of a model directory or in-memory model, None for other models."""
    if isinstance(source, str | os.PathLike):
        try:
            mt = json.loads(read_model_file(os.fspath(source), "config.json") or b"")[
                "model_type"]
        except (OSError, ValueError, ModelDirFileError, KeyError, TypeError, RecursionError):
            return None  # hf_loader reports a missing, broken or unreadable config.json
    else:
        mt = getattr(getattr(source, "config", None), "model_type", None)
    return mt if vlm_family_of(mt) is not None else None


# =========================================================================== helpers


@contextlib.contextmanager
def attn_implementation(config: Any, impl: str) -> Iterator[None]:
    """Run the model's attention through `impl` (sdpa: one scaled_dot_product_attention
    the importer turns into top.attention) for the duration."""
    prev = config._attn_implementation
    config._attn_implementation = impl
    try:
        yield
    finally:
        config._attn_implementation = prev


def text_causal_lm(vlm: Any) -> Any:
    """A causal LM of the VLM's text config whose `model` is the VLM's own language model
    and `lm_head` its lm_head (no copies): what the LLM splitter and compiler take."""
    from transformers import AutoModelForCausalLM

    text_config = vlm.config.text_config
    if text_config.model_type in QWEN_VL_TEXT_TYPES:  # no causal-LM class in transformers
        shell: Any = TextCausalLM(text_config, vlm.model.language_model, vlm.lm_head)
    else:
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(text_config)
    shell.model = vlm.model.language_model
    shell.lm_head = vlm.lm_head
    left = [n for n, p in shell.named_parameters() if p.is_meta]
    if left:
        raise SplitError(f"the text model of this {vlm.config.model_type} has parameters "
                         f"outside its language model and lm_head: {left[:4]}")
    shell.generation_config = vlm.generation_config
    return shell.eval()


def _similar(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    err = float((ours - ref).abs().max())
    if not err <= atol * max(1.0, float(ref.abs().max())):
        raise SplitError(f"the {what} vit wrapper differs from the model's get_image_features "
                         f"by {err:.3g}: this checkpoint's vision tower does not have the "
                         "structure toptpu's wrapper expects")


# =========================================================================== InternVL


class InternVLVit(torch.nn.Module):
    """One InternVL tile: pixel_values [1, 3, S, S] -> image_embeds [1, T, H]."""

    #: the model (set past torch's module registry), a buffer when `own_positions`
    _owner: Any
    position_embeddings: torch.Tensor

    def __init__(self, vlm: Any, image_size: int) -> None:
        super().__init__()
        inner = vlm.model
        self.vision_tower = inner.vision_tower
        self.multi_modal_projector = inner.multi_modal_projector
        self.config = vlm.config
        object.__setattr__(self, "_owner", inner)  # for its pixel_shuffle; not a submodule
        emb = self.vision_tower.embeddings
        self.own_positions = emb.position_embeddings is not None and tuple(
            emb.image_size) != (image_size, image_size)
        if self.own_positions:  # the model's own bicubic interpolation, once
            with torch.no_grad():
                probe = torch.zeros(1, (image_size // emb.patch_size[0]) ** 2 + 1,
                                    emb.position_embeddings.shape[-1])
                pos = emb.interpolate_pos_encoding(probe, image_size, image_size)
            self.register_buffer("position_embeddings", pos.detach().clone())

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        vt, cfg = self.vision_tower, self.config
        emb = vt.embeddings
        with attn_implementation(vt.config, "sdpa"):
            x = emb.patch_embeddings(pixel_values)
            x = torch.cat((emb.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
            if emb.position_embeddings is not None:
                x = x + (self.position_embeddings if self.own_positions
                         else emb.position_embeddings)
            for layer in vt.encoder.layer:
                x = layer(x)
            x = vt.layernorm(x)
        x = x[:, 1:, :]  # vision_feature_select_strategy "default": drop CLS
        side = int(math.isqrt(x.shape[1]))
        x = x.reshape(x.shape[0], side, side, -1)
        x = self._owner.pixel_shuffle(x, scale_factor=cfg.downsample_ratio)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return self.multi_modal_projector(x)


# =========================================================================== MiniCPM-V


def _attend(attn: Any, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """MiniCPMV4_6VisionAttention over x [B, S, D] with an additive key mask (the model's
    own projections; its per-chunk attention with the padding as the mask)."""
    b, s, _ = x.shape
    shape = (b, s, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    return attn.out_proj(o.transpose(1, 2).reshape(b, s, -1))


class MiniCPMVVit(torch.nn.Module):
    """One MiniCPM-V slice in merge order, padded to N patches -> image_embeds [1, N/16, H]
    (the first h*w/16 rows are the slice's)."""

    def __init__(self, vlm: Any, levels: list[tuple[int, int]]) -> None:
        super().__init__()
        self.vision_tower = vlm.model.vision_tower
        self.merger = vlm.model.merger
        self.use_vit_merger = vlm.config.downsample_mode != "4x"
        self.insert_layer_id = int(vlm.config.vision_config.insert_layer_id)
        self.levels = levels

    def _layer(self, layer: Any, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """MiniCPMV4_6VisionEncoderLayer.forward with the key mask."""
        h = h + _attend(layer.self_attn, layer.layer_norm1(h), mask)
        return h + layer.mlp(layer.layer_norm2(h))

    def _window_merge(self, m: Any, h: torch.Tensor) -> torch.Tensor:
        """MiniCPMV4_6ViTWindowAttentionMerger.forward: windows are 4 consecutive tokens."""
        win = int(np.prod(m.window_kernel_size))
        d = h.shape[-1]
        x = h.reshape(-1, win, d)  # [N/4, 4, D]: one attention batch per window
        x = x + _attend(m.self_attn, m.layer_norm1(x), None)
        flat = x.flatten(1)
        residual = x.mean(dim=1)
        y = m.linear_2(m.act(m.linear_1(m.pre_norm(flat))))
        return (y + residual).unsqueeze(0)

    def forward(self, pixel_values: torch.Tensor, position_ids_vit: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        vt = self.vision_tower
        emb = vt.embeddings
        h = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        h = h + emb.position_embedding(position_ids_vit)
        mask = attention_mask
        for i, layer in enumerate(vt.encoder.layers):
            h = self._layer(layer, h, mask)
            if self.use_vit_merger and i == self.insert_layer_id:
                h = self._window_merge(vt.vit_merger, h)
                step = int(np.prod(vt.vit_merger.window_kernel_size))
                mask = mask[..., ::step]  # real tokens stay a prefix
        h = vt.post_layernorm(h)
        for mlp in self.merger.mlp:
            group = int(np.prod(self.merger.merge_kernel_size))
            h = mlp(h.reshape(-1, group * h.shape[-1]))
        return h.unsqueeze(0)


# =========================================================================== vision models


@dataclass
class VisionModel:
    """The vision half of a loaded VLM: its `vit` net and what the runtime needs. The
    compile side of a vision family (`toptpu.families`): one subclass per family."""

    family: VisionFamily
    vlm: Any
    tokens: dict[str, str]
    token_ids: dict[str, int]
    processor: dict[str, Any]  # the image processor's config (JSON)
    image_size: int
    max_tiles: int
    max_patches: int = 0  # MiniCPM-V, Qwen-VL: the static patch budget N
    #: MiniCPM-V 4.7: `CANVAS_MARKERS` -> token id (its canvas positions); empty otherwise
    canvas_markers: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ shape facts
    @property
    def kind(self) -> str:
        """The family name model files carry (`vision.kind`)."""
        return self.family.name

    @property
    def patch_size(self) -> int:
        p = self.vlm.config.vision_config.patch_size
        return int(p[0] if isinstance(p, list | tuple) else p)

    @property
    def position_axes(self) -> int:
        """The text nets' position axes: 3 for a canvas of T, H, W (MiniCPM-V 4.7), else 1
        (`toptpu.backend.contract.POSITION_AXES`)."""
        return 3 if self.canvas_markers else 1

    @property
    def tokens_per_tile(self) -> int:
        """Rows of one vit run's output."""
        raise NotImplementedError

    def max_image_tokens(self) -> int:
        """Placeholder tokens of an image at the most tiles (nominal slices for MiniCPM-V)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the net
    def net_spec(self) -> NetSpec:
        """The `vit` net: the wrapper and example inputs at the static shapes."""
        raise NotImplementedError

    def extra_specs(self, shapes: StaticShapes, act: str) -> list[NetSpec]:
        """Nets besides `vit` the vision side needs (Qwen3-VL's `deepstack_add`)."""
        return []

    def check(self, spec: NetSpec) -> None:
        """The wrapper computes what the model's own get_image_features computes."""
        raise NotImplementedError

    # ------------------------------------------------------------------ model file
    def header(self) -> dict[str, Any]:
        """What the runtime needs (the `vision` section of the model file header)."""
        cfg = self.vlm.config
        out: dict[str, Any] = {
            "kind": self.kind,
            "model_type": cfg.model_type,
            "net": VISION_NET,
            "image_token_id": int(cfg.image_token_id),
            "tokens": dict(self.tokens),
            "token_ids": dict(self.token_ids),
            "processor_class": self.family.processor_class,
            "processor": self.processor,
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "max_tiles": self.max_tiles,
            "tokens_per_tile": self.tokens_per_tile,
            "config": json.loads(cfg.to_json_string(use_diff=False)),
        }
        if self.canvas_markers:
            out["canvas_markers"] = dict(self.canvas_markers)
        return out


@dataclass
class InternVLVisionModel(VisionModel):
    """InternVL: one `vit` run per tile of the compiled size."""

    @property
    def tokens_per_tile(self) -> int:
        r = float(self.vlm.config.downsample_ratio)
        return int(round(self.image_size // self.patch_size * r)) ** 2

    def max_image_tokens(self) -> int:
        tiles = self.max_tiles + (1 if self.max_tiles > 1 else 0)
        return tiles * self.tokens_per_tile

    def net_spec(self) -> NetSpec:
        g = torch.Generator().manual_seed(0)
        s = self.image_size
        module = InternVLVit(self.vlm, s).eval()
        args = (torch.randn(1, 3, s, s, generator=g),)
        return NetSpec(VISION_NET, module, args, [PIXEL_VALUES], [IMAGE_EMBEDS], False)

    def check(self, spec: NetSpec) -> None:
        with torch.no_grad():
            ours = spec.module(*spec.args)
            ref = self.vlm.model.get_image_features(pixel_values=spec.args[0]).pooler_output
        _similar(ours, ref, "InternVL")


@dataclass
class MiniCPMVVisionModel(VisionModel):
    """MiniCPM-V 4.6 / 4.7: one `vit` run per NaViT-packed slice over a patch budget."""

    @property
    def levels(self) -> list[tuple[int, int]]:
        """MiniCPM-V merge kernels, innermost first."""
        cfg = self.vlm.config
        out = []
        if cfg.downsample_mode != "4x":
            out.append(tuple(int(k) for k in cfg.vision_config.window_kernel_size))
        out += [tuple(int(k) for k in cfg.merge_kernel_size)] * int(cfg.merger_times)
        return out  # type: ignore[return-value]  # the config's kernels are pairs

    @property
    def token_divisor(self) -> int:
        return int(np.prod([kh * kw for kh, kw in self.levels]))

    @property
    def tokens_per_tile(self) -> int:
        """Rows of the vit output (the budget)."""
        return self.max_patches // self.token_divisor

    def max_image_tokens(self) -> int:
        tiles = self.max_tiles + (1 if self.max_tiles > 1 else 0)
        nominal = (self.image_size // self.patch_size) ** 2 // self.token_divisor
        return tiles * nominal

    def net_spec(self) -> NetSpec:
        g = torch.Generator().manual_seed(0)
        h, w = self._probe_grid()
        patches = torch.randn(3, self.patch_size, h * w * self.patch_size, generator=g)
        args = tuple(torch.from_numpy(a) for a in self.pack(patches.numpy(), h, w))
        return NetSpec(VISION_NET, MiniCPMVVit(self.vlm, self.levels).eval(), args,
                       [PIXEL_VALUES, POSITION_IDS_VIT, ATTENTION_MASK], [IMAGE_EMBEDS], False)

    def pack(self, patches: np.ndarray, h: int, w: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One slice's NaViT patches as the vit net's inputs (`pack_slice`)."""
        vc = self.vlm.config.vision_config
        return pack_slice(patches, h, w, self.max_patches, self.levels,
                          int(vc.image_size) // self.patch_size)

    def _probe_grid(self) -> tuple[int, int]:
        """A slice grid with padding (h*w < N) for the example inputs and the check."""
        kh = int(np.prod([k[0] for k in self.levels]))
        kw = int(np.prod([k[1] for k in self.levels]))
        side = self.image_size // self.patch_size
        h = max(kh, side // kh * kh)
        w = max(kw, (self.max_patches // h) // kw * kw)
        if h * w == self.max_patches and w > kw:
            w -= kw
        return h, w

    def check(self, spec: NetSpec) -> None:
        inner = self.vlm.model
        with torch.no_grad():
            ours = spec.module(*spec.args)
            h, w = self._probe_grid()
            pixels, _, _ = spec.args
            n, p = h * w, self.patch_size
            order = np.argsort(np.asarray(self._order(h, w)))
            packed = pixels.reshape(3, p, -1, p)[:, :, :n][:, :, torch.from_numpy(order)]
            ref = inner.get_image_features(packed.reshape(1, 3, p, n * p),
                                           torch.tensor([[h, w]], dtype=torch.int32))
            ref_rows = torch.cat(list(ref.pooler_output), dim=0)
            _similar(ours[0, :n // self.token_divisor], ref_rows, "MiniCPM-V")

    def _order(self, h: int, w: int) -> np.ndarray:
        return merge_order(h, w, self.levels)

    def header(self) -> dict[str, Any]:
        out = super().header()
        cfg = self.vlm.config
        out.update(max_patches=self.max_patches, merge_levels=[list(k) for k in self.levels],
                   token_divisor=self.token_divisor,
                   position_side=int(cfg.vision_config.image_size) // self.patch_size)
        return out


def qwen_inputs(visual: Any, vc: Any, budget: int, patches: np.ndarray,
                grid: tuple[int, int, int]) -> Any:
    """`contract.qwen_vit_inputs` of one image or video for the vision tower `visual`
    (its config `vc`) at `budget` patches."""
    windowed = hasattr(visual, "fullatt_block_indexes")
    side = int(visual.num_grid_per_side) if hasattr(visual, "pos_embed") else None
    return qwen_vit_inputs(patches, grid, budget, int(vc.spatial_merge_size),
                           patch_size=int(vc.patch_size),
                           window_size=int(vc.window_size) if windowed else None,
                           position_grid_side=side)


def qwen_probe(vc: Any, budget: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches of a grid smaller than `budget` (padding present; several windows, not
    square) for a Qwen vit net's example inputs and its check."""
    m = int(vc.spatial_merge_size)
    h = max(m, math.isqrt(budget) // m * m)
    w = h - m if h > m else h
    while h * w > budget:
        h -= m
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    g = np.random.default_rng(0)
    return g.standard_normal((h * w, dim)).astype(np.float32), (1, h, w)


def qwen_vit_spec(visual: Any, vc: Any, budget: int) -> NetSpec:
    """The `vit` net of a Qwen vision tower `visual` (config `vc`) over `budget` patches:
    `frontends.qwen_vl.QwenVit` with example inputs of a probe grid."""
    windowed = hasattr(visual, "fullatt_block_indexes")
    inputs = [PIXEL_VALUES, POSITION_IDS_VIT, ATTENTION_MASK]
    if windowed:
        inputs.append(WINDOW_MASK)
    if hasattr(visual, "pos_embed"):
        inputs += [INTERP_INDICES, INTERP_WEIGHTS]
    levels = getattr(visual, "deepstack_visual_indexes", None) or ()
    outputs = [IMAGE_EMBEDS] + ([DEEPSTACK_EMBEDS] if levels else [])
    feeds = qwen_inputs(visual, vc, budget, *qwen_probe(vc, budget)).feeds
    args = tuple(torch.from_numpy(feeds[name]) for name in inputs)
    return NetSpec(VISION_NET, QwenVit(visual, windowed).eval(), args, inputs, outputs, False)


def deepstack_spec(width: int, shapes: StaticShapes, act: str) -> NetSpec:
    """The `deepstack_add` net of a text model of hidden size `width` at the chunk L."""
    g = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(1, shapes.max_input_length, width, generator=g).to(
        TORCH_ACTIVATIONS[act]) for _ in range(2))
    return NetSpec(DEEPSTACK_NET, DeepStackAdd().eval(), args, [HIDDEN, DEEPSTACK],
                   [HIDDEN_OUT], False)


def placeholder_vision(config: Any) -> Any:
    """The vision tower of a Qwen VLM config with placeholder weights (zeros on untouched
    pages) and its computed rotary frequencies: for what depends on shapes alone (the
    `vit` net's command streams, `toptpu estimate`)."""
    from transformers import AutoModel

    with quiet_transformers(), torch.device("meta"):
        visual = AutoModel.from_config(config.vision_config, dtype=torch.float32)
    for mod in visual.modules():
        for name, p in list(mod._parameters.items()):  # noqa: SLF001 - re-materialized
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(  # noqa: SLF001
                    torch.from_numpy(np.zeros(tuple(p.shape), np.float32)),
                    requires_grad=False)
    _rebuild_rotaries(visual)
    return visual.eval()


@dataclass
class QwenVisionModel(VisionModel):
    """The vision half of Qwen2.5-VL, Qwen3-VL or Qwen3.5 (`toptpu.frontends.qwen_vl`): one
    `vit` over a static budget of `max_patches` patches per image or video, M-RoPE text
    positions, and Qwen3-VL's `deepstack_add`."""

    @property
    def visual(self) -> Any:
        return self.vlm.model.visual

    @property
    def merge(self) -> int:
        return int(self.visual.spatial_merge_size)

    @property
    def windowed(self) -> bool:
        """Qwen2.5-VL: window attention outside `fullatt_block_indexes`."""
        return hasattr(self.visual, "fullatt_block_indexes")

    @property
    def position_grid_side(self) -> int | None:
        return int(self.visual.num_grid_per_side) if hasattr(self.visual, "pos_embed") else None

    @property
    def deepstack_levels(self) -> int:
        return len(getattr(self.visual, "deepstack_visual_indexes", None) or ())

    @property
    def position_axes(self) -> int:
        return 3

    @property
    def tokens_per_tile(self) -> int:
        return self.max_patches // (self.merge * self.merge)

    def max_image_tokens(self) -> int:
        return self.tokens_per_tile

    def inputs(self, patches: np.ndarray, grid: tuple[int, int, int]) -> Any:
        """`contract.qwen_vit_inputs` of one image or video at this net's budget."""
        return qwen_inputs(self.visual, self.vlm.config.vision_config, self.max_patches,
                           patches, grid)

    def _probe(self) -> tuple[np.ndarray, tuple[int, int, int]]:
        return qwen_probe(self.vlm.config.vision_config, self.max_patches)

    def net_spec(self) -> NetSpec:
        return qwen_vit_spec(self.visual, self.vlm.config.vision_config, self.max_patches)

    def extra_specs(self, shapes: StaticShapes, act: str) -> list[NetSpec]:
        if not self.deepstack_levels:
            return []
        return [deepstack_spec(int(self.vlm.config.text_config.hidden_size), shapes, act)]

    def check(self, spec: NetSpec) -> None:
        """The wrapper computes what the model's own get_image_features computes (image
        rows and DeepStack rows, back in the model's order)."""
        patches, grid = self._probe()
        order = torch.from_numpy(self.inputs(patches, grid).rows)
        with torch.no_grad():
            ours = spec.module(*spec.args)
            ref = self.vlm.model.get_image_features(
                pixel_values=torch.from_numpy(patches), image_grid_thw=torch.tensor([grid]))
        embeds, levels = (ours if isinstance(ours, tuple) else (ours, None))
        _similar(embeds[0, order], torch.cat(list(ref.pooler_output)), "Qwen-VL")
        for k, feats in enumerate(getattr(ref, "deepstack_features", None) or []):
            assert levels is not None
            _similar(levels[order, k], torch.cat(list(feats)), "Qwen-VL DeepStack")

    def header(self) -> dict[str, Any]:
        out = super().header()
        cfg = self.vlm.config
        vc = cfg.vision_config
        qwen: dict[str, Any] = {
            "merge_size": self.merge, "temporal_patch_size": int(vc.temporal_patch_size),
            "video_token_id": int(cfg.video_token_id),
            "vision_start_token_id": int(cfg.vision_start_token_id),
            "vision_end_token_id": int(cfg.vision_end_token_id),
            "deepstack_levels": self.deepstack_levels,
            "frames_apart": cfg.model_type not in QWEN_VL.spaced_video_types}
        if self.windowed:
            qwen["window_size"] = int(vc.window_size)
        if cfg.model_type in QWEN_VL.spaced_video_types:  # a video's frames spaced in time
            qwen["tokens_per_second"] = float(vc.tokens_per_second)
        if self.position_grid_side is not None:
            qwen["position_grid_side"] = self.position_grid_side
        out.update(max_patches=self.max_patches, token_divisor=self.merge * self.merge,
                   qwen=qwen)
        return out


@dataclass
class LoadedVlm(LoadedModel):
    """A loaded VLM: `model` is its text causal LM view, `vision` the vision half."""

    vision: VisionModel | None = None


# =========================================================================== loading


#: text models of a VLM that toptpu knows of and does not compile (yet)
_REFUSED_TEXT_MODELS = {
    "qwen3_next": "Qwen3-Next (a mixture of experts with linear attention), which toptpu does "
                  "not compile yet; a Qwen3.5 text model (qwen3_5_text, qwen3_5_moe_text) "
                  "compiles",
}


def _check_text_config(config: Any, where: str) -> str:
    if getattr(config, "quantization_config", None) or getattr(
            config.text_config, "quantization_config", None):
        raise ModelLoadError(
            f"{where} is a pre-quantized VLM checkpoint: toptpu reads GPTQ/AWQ/AutoRound "
            "checkpoints of text models only; compile the float VLM (-q w4bf16 quantizes its "
            "text model)")
    tc = config.text_config
    mt = getattr(tc, "model_type", None)
    if mt in _REFUSED_TEXT_MODELS:
        raise ModelLoadError(f"{where}: the text model is {mt}, {_REFUSED_TEXT_MODELS[mt]}")
    try:
        return check_config(tc, f"{where} (text_config)", family=QWEN_VL_TEXT_TYPES.get(str(mt)))
    except ModelLoadError as e:
        raise ModelLoadError(f"{e}; the VLM's text model must be one of these") from e


def _image_tokens(tok: Any, family: VisionFamily, config: Any, where: str
                  ) -> tuple[dict[str, str], dict[str, int]]:
    tokens: dict[str, str] = {}
    for attr in family.tokens:
        value = getattr(tok, attr, None)
        if not isinstance(value, str) or not value:
            raise ModelLoadError(
                f"the tokenizer of {where} does not name its '{attr}' (tokenizer_config.json "
                f"keys {', '.join(family.tokens)}): the {config.model_type} processor "
                "needs them to lay out image tokens; use the tokenizer files of the checkpoint")
        tokens[attr] = value
    ids: dict[str, int] = {}
    unk = getattr(tok, "unk_token_id", None)
    for attr, t in tokens.items():
        i = tok.convert_tokens_to_ids(t)
        if i is None or (unk is not None and i == unk and t != tok.unk_token):
            raise ModelLoadError(f"the image token {t!r} ({attr}) of {where} is not in its "
                                 "tokenizer's vocabulary")
        ids[attr] = int(i)
    image_attr = family.marker
    if ids[image_attr] != int(config.image_token_id):
        raise ModelLoadError(
            f"{where}: config.image_token_id is {config.image_token_id} but the tokenizer's "
            f"{image_attr} {tokens[image_attr]!r} is id {ids[image_attr]}; the config and the "
            "tokenizer do not belong together")
    return tokens, ids


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ModelLoadError(f"{name} must be positive, got {value}")


def vision_model(vlm: Any, tok: Any, processor_cfg: dict[str, Any] | None, where: str, *,
                 image_size: int | None = None, max_tiles: int | None = None,
                 max_patches: int | None = None, max_pixels: tuple[int, int] | None = None
                 ) -> VisionModel:
    """The vision half of `vlm` at the compiled image size and tile limits (defaults: the
    checkpoint's image processor config), by its family's builder (`VISION_MODELS`)."""
    family = vlm_family_of(vlm.config.model_type)
    assert family is not None, "load_vlm checks the model type"
    for name, v in (("--image-size", image_size), ("--max-tiles", max_tiles),
                    ("--max-patches", max_patches)):
        _positive(name, v)
    return VISION_MODELS[family](vlm, tok, dict(processor_cfg or {}), where, image_size,
                                 max_tiles, max_patches, max_pixels)


def _tiled_only(cfg: Any, max_pixels: tuple[int, int] | None) -> None:
    if max_pixels is not None:
        raise ModelLoadError(f"--max-pixels applies to Qwen2.5-VL, Qwen3-VL and Qwen3.5; a "
                             f"{cfg.model_type} model takes --image-size and --max-tiles")


def _patch_of(vc: Any) -> int:
    return int(vc.patch_size[0] if isinstance(vc.patch_size, list | tuple) else vc.patch_size)


def _internvl_vision(vlm: Any, tok: Any, pc: dict[str, Any], where: str,
                     image_size: int | None, max_tiles: int | None, max_patches: int | None,
                     max_pixels: tuple[int, int] | None) -> VisionModel:
    """InternVL at `--image-size` (a tile's side) and `--max-tiles`."""
    cfg = vlm.config
    _tiled_only(cfg, max_pixels)
    tokens, ids = _image_tokens(tok, INTERNVL, cfg, where)
    vc = cfg.vision_config
    patch = _patch_of(vc)
    if cfg.vision_feature_layer != -1 or cfg.vision_feature_select_strategy != "default":
        raise ModelLoadError(
            f"{where}: vision_feature_layer {cfg.vision_feature_layer} / strategy "
            f"'{cfg.vision_feature_select_strategy}' is not supported; toptpu's vit net "
            "takes the last layer without the CLS token (-1, 'default'), as InternVL2.5/3 do")
    size = pc.get("size") or {}
    default = int(size.get("height") or vc.image_size[0])
    s = image_size or default
    per_side = s // patch
    r = float(cfg.downsample_ratio)
    if s % patch or abs(per_side * r - round(per_side * r)) > 1e-9 or round(1 / r) != 1 / r:
        raise ModelLoadError(
            f"--image-size {s} does not fit the vision tower: it must be a multiple of the "
            f"patch size {patch} whose patch grid {per_side} the pixel shuffle (ratio {r}) "
            "divides")
    pc.update(size={"height": s, "width": s}, crop_to_patches=True)
    tiles = max_tiles or int(pc.get("max_patches", 12))
    pc["max_patches"] = tiles
    proc = image_processor_class(INTERNVL)(**pc)
    return InternVLVisionModel(INTERNVL, vlm, tokens, ids, json.loads(proc.to_json_string()),
                               s, tiles)


def _minicpmv_vision(vlm: Any, tok: Any, pc: dict[str, Any], where: str,
                     image_size: int | None, max_tiles: int | None, max_patches: int | None,
                     max_pixels: tuple[int, int] | None) -> VisionModel:
    """MiniCPM-V at `--image-size` (its scale resolution), `--max-tiles` slices and a patch
    budget (`--max-patches`, default `patch_budget`)."""
    cfg = vlm.config
    _tiled_only(cfg, max_pixels)
    tokens, ids = _image_tokens(tok, MINICPMV, cfg, where)
    vc = cfg.vision_config
    patch = _patch_of(vc)
    if cfg.downsample_mode not in ("16x", "4x"):
        raise ModelLoadError(f"{where}: unknown downsample_mode '{cfg.downsample_mode}'")
    if tuple(vc.window_kernel_size) != (2, 2) or tuple(cfg.merge_kernel_size) != (2, 2):
        raise ModelLoadError(
            f"{where}: window_kernel_size {vc.window_kernel_size} / merge_kernel_size "
            f"{cfg.merge_kernel_size}: the processor lays out tokens for 2x2 merges only")
    div = 16 if cfg.downsample_mode == "16x" else 4  # patches per token, as the processor
    merges = (1 if cfg.downsample_mode == "16x" else 0) + int(cfg.merger_times)
    if 4 ** merges != div:
        raise ModelLoadError(f"{where}: merger_times {cfg.merger_times} does not give the "
                             f"{cfg.downsample_mode} token reduction its processor assumes")
    if cfg.downsample_mode != "4x" and not 0 <= int(vc.insert_layer_id) < vc.num_hidden_layers:
        raise ModelLoadError(f"{where}: insert_layer_id {vc.insert_layer_id} is outside the "
                             f"{vc.num_hidden_layers} vision layers")
    s = image_size or int(pc.get("scale_resolution") or cfg.image_size)
    pc.update(scale_resolution=s, patch_size=int(patch), downsample_mode=cfg.downsample_mode)
    if "max_slice_nums" not in pc or max_tiles:
        pc["max_slice_nums"] = max_tiles or 9
    tiles = int(pc["max_slice_nums"])
    proc = image_processor_class(MINICPMV)(**pc)
    budget = max_patches or patch_budget(proc, s, int(patch), tiles, cfg.downsample_mode)
    if budget % div:
        raise ModelLoadError(f"--max-patches {budget} must be a multiple of {div} (the patches "
                             "merged into one token)")
    return MiniCPMVVisionModel(MINICPMV, vlm, tokens, ids, json.loads(proc.to_json_string()),
                               s, tiles, budget, _canvas_markers(vlm, tok, tokens, where))


#: image processor config keys that name classes, not settings
_PROCESSOR_NAMES = ("image_processor_type", "processor_class", "auto_map")


def _qwen_vision(vlm: Any, tok: Any, processor_cfg: dict[str, Any], where: str,
                 image_size: int | None, max_tiles: int | None, max_patches: int | None,
                 max_pixels: tuple[int, int] | None) -> VisionModel:
    """A Qwen VLM's vision half: the patch budget N (`--max-patches`, or `--max-pixels`
    W x H over the patch area, whole merge windows), the image processor resizing every
    image within it (its `longest_edge`, in pixels, is N patches; its `shortest_edge`
    capped there), the image tokens checked against the config."""
    cfg = vlm.config
    given = [n for n, v in (("--image-size", image_size), ("--max-tiles", max_tiles))
             if v is not None]
    if given:
        raise ModelLoadError(f"{', '.join(given)} do not apply to a {cfg.model_type} model "
                             "(one vision net run per image over a patch budget): use "
                             "--max-pixels W,H or --max-patches N")
    vc = cfg.vision_config
    patch, merge = int(vc.patch_size), int(vc.spatial_merge_size)
    temporal = int(vc.temporal_patch_size)
    unit = merge * merge
    pc = {k: v for k, v in (processor_cfg or {}).items() if k not in _PROCESSOR_NAMES}
    for key, want in (("patch_size", patch), ("merge_size", merge),
                      ("temporal_patch_size", temporal)):
        if key in pc and pc[key] != want:
            raise ModelLoadError(f"{where}: preprocessor_config.json has {key} {pc[key]!r} but "
                                 f"the vision tower's is {want}; they do not belong together")
    if max_patches is not None and max_pixels is not None:
        raise ModelLoadError("give --max-pixels or --max-patches, not both (each sets the "
                             "vision net's patch budget)")
    if max_patches is not None:
        budget = int(max_patches)
        if budget % unit:
            raise ModelLoadError(f"--max-patches {budget} must be a multiple of {unit} (the "
                                 f"{merge}x{merge} patches merged into one token)")
    else:
        wid, hgt = max_pixels or DEFAULT_MAX_PIXELS
        if wid < 1 or hgt < 1:
            raise ModelLoadError(f"--max-pixels {wid},{hgt}: both sides must be positive")
        budget = wid * hgt // (patch * patch) // unit * unit
        if budget < unit:
            raise ModelLoadError(
                f"--max-pixels {wid},{hgt} holds fewer than {unit} patches of {patch}x{patch} "
                f"pixels (one merged token); give at least {merge * patch}x{merge * patch}")
    size = dict(pc.pop("size", None) or {})
    shortest = int(pc.pop("min_pixels", None) or size.get("shortest_edge") or 56 * 56)
    pc.pop("max_pixels", None)
    longest = budget * patch * patch
    pc.update(size={"shortest_edge": min(shortest, longest), "longest_edge": longest},
              patch_size=patch, merge_size=merge, temporal_patch_size=temporal)
    try:
        proc = image_processor_class(QWEN_VL)(**pc)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: the image processor config does not make a "
                             f"Qwen2VLImageProcessorPil: {e}") from e
    tokens, ids = _qwen_tokens(tok, cfg, where)
    return QwenVisionModel(QWEN_VL, vlm, tokens, ids, json.loads(proc.to_json_string()),
                           patch * merge, 1, budget)


def _qwen_tokens(tok: Any, cfg: Any, where: str) -> tuple[dict[str, str], dict[str, int]]:
    """The Qwen image and video tokens (the tokenizer's, or the processor's defaults), each
    in the vocabulary with the id the config names."""
    tokens, ids = {}, {}
    unk = getattr(tok, "unk_token_id", None)
    for attr, default in QWEN_TOKENS.items():
        value = getattr(tok, attr, None)
        t = value if isinstance(value, str) and value else default
        i = tok.convert_tokens_to_ids(t)
        if i is None or (unk is not None and i == unk and t != tok.unk_token):
            raise ModelLoadError(f"the {attr} {t!r} of {where} is not in its tokenizer's "
                                 "vocabulary; use the tokenizer files of the checkpoint")
        want = getattr(cfg, QWEN_TOKEN_IDS[attr], None)
        if want != i:
            raise ModelLoadError(f"{where}: config.{QWEN_TOKEN_IDS[attr]} is {want} but the "
                                 f"tokenizer's {attr} {t!r} is id {i}; the config and the "
                                 "tokenizer do not belong together")
        tokens[attr], ids[attr] = t, int(i)
    return tokens, ids


def _canvas_markers(vlm: Any, tok: Any, tokens: dict[str, str], where: str) -> dict[str, int]:
    """MiniCPM-V 4.7's canvas markers (`CANVAS_MARKERS` -> token id, from its config), each
    checked against the tokenizer (the canvas is laid out by these ids: one that is not the
    token it names would misplace every image); {} for a model without a canvas. The text
    model must have a multi-axis rotary for the positions to mean anything."""
    cfg = vlm.config
    if cfg.model_type not in MINICPMV.canvas_model_types:
        return {}
    rotary = getattr(vlm.model.language_model, "rotary_emb", None)
    if not hasattr(rotary, "mrope_section"):
        raise ModelLoadError(
            f"{where}: a {cfg.model_type} lays out its image tokens on the axes of a "
            f"multi-axis (mrope) rotary, which its {cfg.text_config.model_type} text model "
            "does not have")
    want = {key: tok.convert_tokens_to_ids(tokens[attr]) for key, attr in
            _CANVAS_TOKENS.items()}
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    vocab = int(cfg.text_config.vocab_size)
    out: dict[str, int] = {}
    for key in CANVAS_MARKERS:
        value = getattr(cfg, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise ModelLoadError(
                f"{where}: {key} is {value!r}; a {cfg.model_type} config names the token ids "
                "its canvas positions are pinned to (image_start_id, image_end_id, "
                "slice_start_id, slice_end_id, newline_id): use the checkpoint's config.json")
        if key == "newline_id" and newline != [value]:
            raise ModelLoadError(f"{where}: newline_id is {value} but the tokenizer makes "
                                 f"'\\n' {newline}; the config and the tokenizer do not "
                                 "belong together")
        if key in want and want[key] != value:
            raise ModelLoadError(
                f"{where}: {key} is {value} but the tokenizer's "
                f"{_CANVAS_TOKENS[key]} {tokens[_CANVAS_TOKENS[key]]!r} is id {want[key]}; the "
                "config and the tokenizer do not belong together")
        out[key] = value
    return out


#: the compile side of each vision family (`toptpu.families`): its vision half's builder
VISION_MODELS: dict[VisionFamily, Callable[..., VisionModel]] = {
    INTERNVL: _internvl_vision, MINICPMV: _minicpmv_vision, QWEN_VL: _qwen_vision}

#: the default MiniCPM-V patch budget takes every image up to this aspect ratio
MAX_ASPECT = 10.0


def patch_budget(proc: Any, size: int, patch: int, max_slices: int, downsample_mode: str,
                 max_aspect: float = MAX_ASPECT) -> int:
    """The most patches one slice gets from the MiniCPM-V processor (its own resize and
    slice-grid functions) over images of aspect ratio up to `max_aspect`, scanned from an
    eighth to eight times the slice size: the default static budget N of the vit net."""
    worst = 0
    sides = np.unique(np.geomspace(max(1, size // 8), size * 8, 96).astype(int))
    for hgt in sides:
        for wid in sides:
            if max(hgt / wid, wid / hgt) > max_aspect:
                continue
            img = (int(hgt), int(wid))
            grid = proc.get_sliced_grid(img, max_slices, size)
            shapes = [proc.find_best_resize(img, size, patch, downsample_mode,
                                            allow_upscale=grid is None)]
            if grid is not None:
                rh, rw = proc.get_refine_size(img, grid, size, patch, downsample_mode,
                                              allow_upscale=True)
                shapes.append((rh // grid[0], rw // grid[1]))
            worst = max(worst, *((a // patch) * (b // patch) for a, b in shapes))
    div = 16 if downsample_mode != "4x" else 4
    return -(-worst // div) * div


def load_vlm(source: Any, tokenizer: Any = None, image_processor: Any = None, *,
             image_size: int | None = None, max_tiles: int | None = None,
             max_patches: int | None = None, stream: bool = False,
             max_pixels: tuple[int, int] | None = None) -> LoadedVlm:
    """Load an InternVL or MiniCPM-V 4.6/4.7 model (a Hugging Face directory, or an in-memory
    model with its `tokenizer` and optionally its `image_processor`) for compilation. A
    directory with `stream` is not loaded whole (`_stream_dir`): its text model is a
    streaming skeleton, its vision tower read from the shards."""
    if isinstance(source, str | os.PathLike):
        load = _stream_dir if stream else _load_dir
        return load(os.fspath(source), image_size, max_tiles, max_patches, max_pixels)
    vlm = source
    mt = getattr(vlm.config, "model_type", None)
    if vlm_family_of(mt) is None:
        raise ModelLoadError(f"expected an InternVL, MiniCPM-V 4.6/4.7, Qwen2.5-VL, Qwen3-VL "
                             f"(-MoE) or Qwen3.5 (-MoE) model, got {type(vlm).__name__} ({mt})")
    where = f"the {type(vlm).__name__}"
    family = _check_text_config(vlm.config, where)
    if tokenizer is None:
        raise ModelLoadError(f"{where} needs its tokenizer (tokenizer=...): the image tokens "
                             "and the placeholder layout come from it")
    vlm = vlm.float().eval()
    pc = json.loads(image_processor.to_json_string()) if image_processor is not None else None
    vision = vision_model(vlm, tokenizer, pc, where, image_size=image_size,
                          max_tiles=max_tiles, max_patches=max_patches, max_pixels=max_pixels)
    text = text_causal_lm(vlm)
    gen = generation_settings(getattr(vlm, "generation_config", None), vlm.config.text_config)
    return LoadedVlm(text, family, _tokenizer_files_of(tokenizer), gen, vision=vision)


@dataclass
class VlmDir:
    """What a VLM directory says besides its weights, checked."""

    path: str
    config: Any  # the transformers config
    family: str  # of the text model
    tokenizer_files: dict[str, bytes]
    tokenizer: Any
    processor: dict[str, Any] | None  # preprocessor_config.json
    generation: Any  # transformers GenerationConfig or None
    model_class: Any  # the transformers VLM class

    def generation_settings(self) -> dict[str, Any]:
        return generation_settings(self.generation, self.config.text_config)


def _read_vlm_dir(path: str) -> VlmDir:
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    check_model_dir(path)
    cfg_path = os.path.join(path, "config.json")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"transformers cannot read {cfg_path}: "
                             f"{one_line_reason(e)}") from e
    family = _check_text_config(config, cfg_path)
    files = _read_tokenizer_files(path, required=True, what=path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"transformers cannot load the tokenizer in {path}: {e}") from e
    pc = None
    pc_path = os.path.join(path, "preprocessor_config.json")
    pc_data = dir_bytes(path, "preprocessor_config.json")
    if pc_data is not None:
        try:
            pc = json.loads(pc_data)
        except (ValueError, RecursionError) as e:
            raise ModelLoadError(f"cannot read {pc_path}: {e}") from e
    gen = read_generation_config(path)
    cls = getattr(transformers, VLM_CLASSES[config.model_type])
    return VlmDir(path, config, family, files, tok, pc, gen, cls)


def _mismatch(d: VlmDir, problems: list[str]) -> ModelLoadError:
    return ModelLoadError(f"the checkpoint in {d.path} does not match its config.json "
                          f"({d.config.model_type}): " + "; ".join(problems)
                          + ". Use the config.json that belongs to these weights.")


def _load_dir(path: str, image_size: int | None, max_tiles: int | None,
              max_patches: int | None, max_pixels: tuple[int, int] | None = None
              ) -> LoadedVlm:
    """The whole VLM in float32 (transformers `from_pretrained`)."""
    d = _read_vlm_dir(path)
    try:
        with quiet_transformers():
            vlm, info = d.model_class.from_pretrained(
                path, config=d.config, dtype=torch.float32, local_files_only=True,
                output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"transformers could not load the weights in {path}: {e}") from e
    problems = []
    for key, what in (("missing_keys", "missing tensors"),
                      ("unexpected_keys", "unexpected tensors"),
                      ("mismatched_keys", "mis-shaped tensors")):
        names = sorted(str(k) for k in info.get(key) or [])
        if names:
            problems.append(f"{what}: {_listing(names)}")
    if problems:
        raise _mismatch(d, problems)
    vlm = vlm.eval()
    vision = vision_model(vlm, d.tokenizer, d.processor, path, image_size=image_size,
                          max_tiles=max_tiles, max_patches=max_patches, max_pixels=max_pixels)
    return LoadedVlm(text_causal_lm(vlm), d.family, d.tokenizer_files,
                     d.generation_settings(), path, vision=vision)


# =========================================================================== streaming

#: the VLM's parameter-name prefixes of its text model -> those of the causal LM view
TEXT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head."}


def text_name(key: str) -> str | None:
    """A VLM parameter name of its text model as the causal LM view names it
    ('model.language_model.layers.3.…' -> 'model.layers.3.…'); None outside the text
    model."""
    for vlm_prefix, lm_prefix in TEXT_PREFIXES.items():
        if key.startswith(vlm_prefix):
            return lm_prefix + key[len(vlm_prefix):]
    return None


def _stream_dir(path: str, image_size: int | None, max_tiles: int | None,
                max_patches: int | None, max_pixels: tuple[int, int] | None = None
                ) -> LoadedVlm:
    """A VLM directory without loading it whole: the checkpoint's tensor names, shapes and
    dtypes are checked against the model from the headers alone; the text model is a
    streaming skeleton (`frontends.streaming`) over the checkpoint's text tensors under the
    causal LM's names, so its layers are read one at a time when the blob is written; the
    vision tower and projector (one net) are read whole, in float32, into the VLM built on
    the meta device. The vision net and the tokens are those of `_load_dir`."""
    d = _read_vlm_dir(path)
    try:
        reader = CheckpointReader.open(path)
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e
    with quiet_transformers(), torch.device("meta"):
        vlm = d.model_class._from_config(d.config, dtype=torch.float32)  # noqa: SLF001
    found = _checkpoint_names(d, vlm, reader)
    text = {lm: key for name, key in (*found.names.items(), *found.experts.items())
            if (lm := text_name(name)) is not None}
    view: Any = reader.renamed(text)
    if found.swapped:
        view = SwappedExperts(view, {lm for name in found.swapped
                                     if (lm := text_name(name)) is not None})
    stream = StreamedWeights(view, {})
    shell = text_model_shell if d.config.text_config.model_type in QWEN_VL_TEXT_TYPES \
        else None
    model, stream.placeholders = skeleton(d.config.text_config, stream.tensor_f32,
                                          tied=_tied(vlm), build=shell)
    stream.materialized[LAYER_PREFIX] = model.model.layers[0]
    try:
        _read_vision(vlm, reader, found.names)
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e
    vision = vision_model(vlm.eval(), d.tokenizer, d.processor, path, image_size=image_size,
                          max_tiles=max_tiles, max_patches=max_patches, max_pixels=max_pixels)
    return LoadedVlm(model, d.family, d.tokenizer_files, d.generation_settings(), path,
                     stream=stream, vision=vision)


@dataclass
class CheckpointNames:
    """Where each parameter of a VLM is in its checkpoint."""

    #: parameter -> the checkpoint tensor that holds it
    names: dict[str, str]
    #: a MoE layer's experts held one tensor per expert and projection (the hub layout
    #: `save_pretrained` writes; transformers merges them into the fused parameters on
    #: loading): '<parameter's module>.<e>.<projection>.weight' -> the checkpoint tensor
    #: (the text stream stacks them itself, `frontends.moe.expert_tensor`)
    experts: dict[str, str] = field(default_factory=dict)
    #: fused expert parameters stored with their last two axes swapped (Qwen3-VL-MoE's
    #: published checkpoints; `frontends.moe.SwappedExperts`)
    swapped: set[str] = field(default_factory=set)


def _expert_transpose(converter: Any, new: str) -> bool:
    """`converter` (transformers' conversion of a checkpoint tensor into parameter `new`)
    only swaps the last two axes of a fused experts parameter (Qwen3-VL-MoE's)."""
    from transformers.core_model_loading import Transpose

    ops = getattr(converter, "operations", None) or []
    return is_fused_parameter(new) and len(ops) == 1 and isinstance(ops[0], Transpose) \
        and {ops[0].dim0, ops[0].dim1} == {1, 2}


def _checkpoint_names(d: VlmDir, vlm: Any, reader: CheckpointReader) -> CheckpointNames:
    """The VLM's parameter name -> the checkpoint tensor that holds it, by transformers'
    own renaming of checkpoint names (InternVL checkpoints name the text model
    'language_model.model.…'); every tensor checked against the model (name, shape,
    floating-point dtype) from the shard headers, as `from_pretrained` would. A MoE
    layer's experts may be held one tensor per expert (checked as the fused parameter
    they make) or, as transformers' conversion of Qwen3-VL-MoE's checkpoints allows, with
    the last two axes of the fused parameter swapped."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    want = {k: tuple(v.shape) for k, v in vlm.state_dict().items()}
    mapping = get_model_conversion_mapping(vlm)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    found = CheckpointNames({})
    names = found.names
    extra = []
    hub: dict[str, tuple[int, ...]] = {}
    for key in sorted(reader.names()):
        if stacked_name(key) is not None:
            hub[key] = tuple(reader.info(key).shape)
            continue
        new, converted = rename_source_key(key, renamings, converters, vlm.base_model_prefix,
                                           want)
        if new not in want and key in want:  # as from_pretrained: kept as it is
            new, converted = key, None
        if new not in want:
            if not key.endswith(_IGNORABLE_SUFFIXES):  # as for a text model
                extra.append(key)
            continue
        if converted is not None:
            converter = next((c for c in converters if converted in c.source_patterns), None)
            if not _expert_transpose(converter, new):
                raise ModelLoadError(
                    f"{d.path}: tensor '{key}' is stored in a layout transformers converts "
                    f"when loading ('{converted}'), which the streaming compile does not do; "
                    "compile the model in memory (toptpu.compile(load_vlm(path), ...))")
            shape = tuple(reader.info(key).shape)
            if shape != want[new] and len(shape) == 3 and \
                    (shape[0], shape[2], shape[1]) == want[new]:  # as transformers' check_dims
                found.swapped.add(new)
        if new in names:
            raise ModelLoadError(f"{d.path}: tensors '{names[new]}' and '{key}' both hold "
                                 f"'{new}': the checkpoint is inconsistent")
        names[new] = key
    fused, expert_problems = stacked_shapes(hub)
    if expert_problems:
        raise ModelLoadError(f"the checkpoint in {d.path} does not hold its MoE experts "
                             "whole: " + "; ".join(expert_problems))
    by_module: dict[str, list[str]] = {}  # '…experts' -> its hub-layout tensors
    for key in hub:
        by_module.setdefault(key.rpartition(".experts.")[0] + ".experts", []).append(key)
    stacked: dict[str, tuple[int, ...]] = {}  # a fused parameter the hub layout holds
    for name, shape in fused.items():
        new, _ = rename_source_key(name, renamings, [], vlm.base_model_prefix, want)
        if new not in want or new in names:
            extra.append(f"{name.rpartition('.')[0]}.*")
            continue
        stacked[new] = shape
        base, source_base = new.rpartition(".")[0], name.rpartition(".")[0]
        for key in by_module[source_base]:
            found.experts[base + key[len(source_base):]] = key
    optional = {"lm_head.weight"} if _tied(vlm) else set()
    missing = sorted(k for k in want if k not in names and k not in stacked
                     and k not in optional)

    def stored(k: str, key: str) -> tuple[int, ...]:
        s = tuple(reader.info(key).shape)
        return (s[0], s[2], s[1]) if k in found.swapped else s

    bad = [f"{key} is {list(reader.info(key).shape)}, expected {list(want[k])}"
           for k, key in sorted(names.items()) if stored(k, key) != want[k]]
    bad += [f"the experts of {k} make {list(s)}, expected {list(want[k])}"
            for k, s in sorted(stacked.items()) if s != want[k]]
    problems = [f"{what}: {_listing(items)}" for what, items in (
        ("missing tensors", missing), ("unexpected tensors", extra),
        ("mis-shaped tensors", bad)) if items]
    if problems:
        raise _mismatch(d, problems)
    not_float = [f"{key} is {reader.info(key).dtype}" for key in
                 sorted({*names.values(), *found.experts.values()})
                 if reader.info(key).dtype not in FLOAT_DTYPES]
    if not_float:
        raise ModelLoadError(
            f"the checkpoint in {d.path} holds weights that are not floating point: "
            f"{_listing(not_float)}. A float checkpoint holds {'/'.join(FLOAT_DTYPES)} tensors")
    return found


def _tied(vlm: Any) -> bool:
    """The VLM's lm_head is its embedding (its own config decides, whatever its
    text_config's tie_word_embeddings says)."""
    return vlm.get_output_embeddings().weight is vlm.get_input_embeddings().weight


def _is_rotary(module: torch.nn.Module) -> bool:
    """A rotary embedding whose only buffers are frequencies computed from its config (the
    checkpoint does not hold them: they are not persistent)."""
    return hasattr(module, "inv_freq") and hasattr(module, "config") and \
        not dict(module.state_dict())


def _rebuild_rotaries(module: torch.nn.Module) -> None:
    """Recompute the frequencies of `module`'s rotary embeddings (Qwen-VL's vision rotary)
    from their config, as the model's constructor does (`to_empty` left them garbage)."""
    for name, sub in list(module.named_modules()):
        if name and _is_rotary(sub):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, type(sub)(sub.config))


def _read_vision(vlm: Any, reader: CheckpointReader, names: dict[str, str]) -> None:
    """Materialize everything of the meta-device `vlm` outside its text model (the vision
    tower, the projector or merger) in float32 from the checkpoint."""
    inner = vlm.model
    parts = [(f"model.{n}", m) for n, m in inner.named_children() if m is not
             inner.language_model]
    parts += [(n, m) for n, m in vlm.named_children() if m is not inner and m is not
              vlm.lm_head]
    for prefix, module in parts:
        module.to_empty(device="cpu")
        _rebuild_rotaries(module)
        kept = dict(module.state_dict(prefix=f"{prefix}.", keep_vars=True))
        rebuilt = {f"{prefix}.{n}" for n, m in module.named_modules() if _is_rotary(m)}
        for name, _ in module.named_buffers(prefix=prefix):
            if name not in kept and name.rpartition(".")[0] not in rebuilt:
                raise ModelLoadError(f"{name} is a buffer the checkpoint does not hold, "
                                     "which the streaming compile cannot rebuild; compile "
                                     "the VLM loaded whole (toptpu.compile(load_vlm(path), "
                                     "...))")
        for name, tensor in kept.items():
            tensor.data = torch.from_numpy(to_f32(reader.tensor(names[name])))
        reader.release()
    left = [n for n, p in vlm.named_parameters() if p.is_meta and text_name(n) is None]
    if left:
        raise ModelLoadError(f"the {vlm.config.model_type} model has parameters outside its "
                             f"text model and its vision modules: {_listing(left)}")
