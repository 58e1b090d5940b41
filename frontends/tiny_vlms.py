"""Tiny vision-language models with seeded random weights (InternVL, MiniCPM-V 4.6 and 4.7).

Like `tiny_models`, nothing is downloaded: the configs are the real `transformers` config
classes (`InternVLConfig`, `MiniCPMV4_6Config`, `MiniCPMV4_7Config`) at tiny sizes (vision
towers of 56 or 112 pixel tiles with 14-pixel patches), the weights come from a seeded
generator, and the
tokenizer is the tiny byte-level BPE of `tiny_models` plus the model's image special tokens,
saved as the real checkpoints save them (`tokenizer_config.json` names them:
`context_image_token`, `image_start_token`, ...). `save_tiny_vlm` writes a Hugging Face
directory with the image processor's `preprocessor_config.json`, as a user's checkpoint has.

Sizes are multiples of 64 where a matmul contracts over them, so w4 quantization with the
default group size 64 applies to every linear of the vision tower too.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from toptpu.dialects.output_file import write_output
from toptpu.frontends.tiny_models import SPECIAL_TOKENS, build_tokenizer

#: the image special tokens of each tiny VLM (tokenizer attribute -> token)
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
MINICPMV_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                   "image_start_token": "<image>", "image_end_token": "</image>",
                   "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                   "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}

QWEN_VL_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                  "vision_start_token": "<|vision_start|>",
                  "vision_end_token": "<|vision_end|>"}

#: the tiny families: internvl (Qwen2 text), minicpmv (MiniCPM-V 4.6 with a Qwen3 text
#: model), MiniCPM-V 4.6 and 4.7 as released: a Qwen3.5 hybrid text model
#: (minicpmv4_6, minicpmv4_7), and Qwen's: qwen2_5_vl, qwen3_vl and qwen3_5 (Qwen3.5's
#: vision tower with its hybrid text model), and the mixtures of experts qwen3_vl_moe
#: (Qwen3-VL's vision with a Qwen3-MoE text model) and qwen3_5_moe (Qwen3.5's with its
#: hybrid MoE text model)
TINY_VLM_FAMILIES = ("internvl", "minicpmv", "minicpmv4_6", "minicpmv4_7", "qwen2_5_vl",
                     "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
#: the Qwen-VL families (one image processor, one set of image tokens, M-RoPE positions)
QWEN_VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
#: the text model types of Qwen3.5's hybrid layers (norms that scale by 1 + weight)
_CENTERED_TEXT = ("qwen3_5_text", "qwen3_5_moe_text")
#: the MiniCPM-V families (one vision tower, one image processor, one set of image tokens)
MINICPMV_FAMILIES = ("minicpmv", "minicpmv4_6", "minicpmv4_7")

_BPE_VOCAB = 384
_TEXT_VOCAB = 400  # the BPE vocab plus the image tokens, rounded up


def vlm_tokenizer(family: str) -> Any:
    """The tiny BPE tokenizer with the image special tokens of `family` as attributes."""
    from transformers import PreTrainedTokenizerFast

    tokens = _tokens(family)
    base = build_tokenizer(_BPE_VOCAB)
    base.add_tokens(list(tokens.values()), special_tokens=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer,
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, extra_special_tokens=tokens)
    tok.chat_template = base.chat_template
    if len(tok) > _TEXT_VOCAB:
        raise AssertionError(f"tiny VLM vocabulary {len(tok)} exceeds {_TEXT_VOCAB}")
    return tok


def _tokens(family: str) -> dict[str, str]:
    if family == "internvl":
        return INTERNVL_TOKENS
    if family in MINICPMV_FAMILIES:
        return MINICPMV_TOKENS
    if family in QWEN_VL_FAMILIES:
        return QWEN_VL_TOKENS
    raise ValueError(f"unknown tiny VLM family '{family}' ({', '.join(TINY_VLM_FAMILIES)})")


def _text_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        model_type=model_type, vocab_size=_TEXT_VOCAB, hidden_size=64, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=0,
        tie_word_embeddings=False)
    if model_type == "qwen3":
        cfg["head_dim"] = 16
    if model_type in _CENTERED_TEXT:
        # Qwen3.5-0.8B's shapes (MiniCPM-V 4.6/4.7's text model) at four layers, three
        # Gated DeltaNet layers to one gated full-attention layer; its multi-axis rotary
        # (interleaved sections 11/11/10 of the 32 rotated frequency pairs)
        cfg.update(hidden_size=1024, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=256, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"],
                   linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    if model_type == "qwen3_5_moe_text":
        # Qwen3.5-35B-A3B's MoE block (renormalized top-k, a shared expert with its sigmoid
        # gate) with 8 experts of 128, top-2, a shared expert of 128
        cfg.update(moe_intermediate_size=128, shared_expert_intermediate_size=128,
                   num_experts=8, num_experts_per_tok=2)
        del cfg["intermediate_size"]
    cfg.update(overrides)
    if model_type in _CENTERED_TEXT and "num_hidden_layers" in overrides and \
            "layer_types" not in overrides:  # every fourth layer full attention
        n = int(overrides["num_hidden_layers"])
        cfg["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention"
                              for i in range(n)]
    return cfg


def tiny_vlm_config(family: str = "internvl", text: dict[str, Any] | None = None,
                    **vision_overrides: Any) -> Any:
    """A tiny config of `family`: internvl (InternViT 56 px tiles, pixel shuffle 0.5, MLP
    projector, Qwen2 text) or minicpmv (SigLIP-style tower with the window-attention merger
    after layer 1, 112 px slices, the downsample MLP merger, Qwen3 text); minicpmv4_6 and
    minicpmv4_7 are that vision side with MiniCPM-V's released text model, Qwen3.5 at its
    0.8B shapes cut to four layers (`_text_config`), and 4.7's config names the tokens its
    canvas positions are pinned to (`<image>`, `</image>`, `<slice>`, `</slice>`, the
    newline). `text` overrides the text config (e.g. more and wider layers); a text config
    that ties its embeddings makes a VLM that ties them (the VLM's own tie_word_embeddings
    decides; its `model_type` picks another text model for a MiniCPM-V)."""
    from transformers import InternVLConfig, MiniCPMV4_6Config, MiniCPMV4_7Config

    tok = vlm_tokenizer(family)
    tied = bool((text or {}).get("tie_word_embeddings", False))
    if family == "internvl":
        vision: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, image_size=56, patch_size=14,
                                      norm_type="layer_norm", layer_scale_init_value=0.5)
        vision.update(vision_overrides)
        return InternVLConfig(
            vision_config=vision, text_config=_text_config("qwen2", **(text or {})),
            image_token_id=tok.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
            image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2 // 4,
            downsample_ratio=0.5, tie_word_embeddings=tied)
    if family in MINICPMV_FAMILIES:
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, image_size=112, patch_size=14, insert_layer_id=1)
        vision.update(vision_overrides)
        text = dict(text or {})
        text_type = text.pop("model_type", "qwen3" if family == "minicpmv" else "qwen3_5_text")
        common = dict(
            vision_config=vision, text_config=_text_config(text_type, **text),
            insert_layer_id=vision["insert_layer_id"], image_size=vision["image_size"],
            image_token_id=tok.convert_tokens_to_ids(MINICPMV_TOKENS["image_token"]),
            video_token_id=tok.convert_tokens_to_ids(MINICPMV_TOKENS["video_token"]),
            tie_word_embeddings=tied)
        if family != "minicpmv4_7":
            return MiniCPMV4_6Config(**common)
        ids = tok.convert_tokens_to_ids
        return MiniCPMV4_7Config(
            **common, image_start_id=ids(MINICPMV_TOKENS["image_start_token"]),
            image_end_id=ids(MINICPMV_TOKENS["image_end_token"]),
            slice_start_id=ids(MINICPMV_TOKENS["slice_start_token"]),
            slice_end_id=ids(MINICPMV_TOKENS["slice_end_token"]),
            newline_id=tok("\n", add_special_tokens=False)["input_ids"][0])
    if family in QWEN_VL_FAMILIES:
        return _qwen_vl_config(family, tok, text, tied, vision_overrides)
    raise ValueError(f"unknown tiny VLM family '{family}' ({', '.join(TINY_VLM_FAMILIES)})")


def _qwen_vl_config(family: str, tok: Any, text: dict[str, Any] | None, tied: bool,
                    vision_overrides: dict[str, Any]) -> Any:
    """Qwen2.5-VL-3B's, Qwen3-VL-4B's and Qwen3.5's shapes where they decide the layout (head
    dims, patch and merge sizes, Qwen2.5-VL's 112-pixel windows with full attention in some
    layers, Qwen3-VL's 48x48 learned position grid, its DeepStack levels, the text models'
    M-RoPE sections at head_dim 128), narrowed and cut to a few layers."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
    )

    ids = {key: tok.convert_tokens_to_ids(QWEN_VL_TOKENS[attr]) for attr, key in (
        ("image_token", "image_token_id"), ("video_token", "video_token_id"),
        ("vision_start_token", "vision_start_token_id"),
        ("vision_end_token", "vision_end_token_id"))}
    text = dict(text or {})
    if family == "qwen2_5_vl":  # Qwen2.5-VL-3B: vision head_dim 80, text head_dim 128
        tc = _text_config("qwen2", **{"hidden_size": 512, "intermediate_size": 1024,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      **text})
        tc.update(model_type="qwen2_5_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
        vision = dict(depth=4, hidden_size=320, num_heads=4, intermediate_size=856,
                      out_hidden_size=tc["hidden_size"], patch_size=14, window_size=112,
                      fullatt_block_indexes=[1, 3], tokens_per_second=2,
                      spatial_merge_size=2, temporal_patch_size=2)
        vision.update(vision_overrides)
        return Qwen2_5_VLConfig(text_config=tc, vision_config=vision, tie_word_embeddings=tied,
                                **ids)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        # Qwen3-VL-4B: vision head_dim 64, DeepStack, text head_dim 128; Qwen3-VL-30B-A3B's
        # text model a Qwen3-MoE one: 8 experts of 128, top-2, renormalized
        moe = family == "qwen3_vl_moe"
        experts = {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "mlp_only_layers": []} if moe else {}
        tc = _text_config("qwen3", **{"hidden_size": 512, "intermediate_size": 1024,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "head_dim": 128, "num_hidden_layers": 3, **experts,
                                      **text})
        tc.update(model_type="qwen3_vl_moe_text" if moe else "qwen3_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
            "mrope_interleaved": True})
        vision = dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=512,
                      out_hidden_size=tc["hidden_size"], patch_size=16,
                      num_position_embeddings=2304, deepstack_visual_indexes=[1, 2],
                      spatial_merge_size=2, temporal_patch_size=2)
        vision.update(vision_overrides)
        return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
            text_config=tc, vision_config=vision, tie_word_embeddings=tied, **ids)
    # Qwen3.5-0.8B's text shapes, 4 layers (qwen3_5_moe: with MoE blocks)
    tc = _text_config("qwen3_5_moe_text" if family == "qwen3_5_moe" else "qwen3_5_text",
                      **text)
    vision = dict(depth=2, hidden_size=256, num_heads=4, intermediate_size=512,
                  out_hidden_size=tc["hidden_size"], patch_size=16,
                  num_position_embeddings=2304, spatial_merge_size=2, temporal_patch_size=2)
    vision.update(vision_overrides)
    return (Qwen3_5MoeConfig if family == "qwen3_5_moe" else Qwen3_5Config)(
        text_config=tc, vision_config=vision, tie_word_embeddings=tied, **ids)


def tiny_image_processor(family: str, config: Any, max_tiles: int = 4) -> Any:
    """The model's own Pillow image processor at the tiny tile size."""
    if family == "internvl":
        from transformers import GotOcr2ImageProcessorPil

        size = int(config.vision_config.image_size[0])
        return GotOcr2ImageProcessorPil(size={"height": size, "width": size},
                                        crop_to_patches=True, min_patches=1,
                                        max_patches=max_tiles)
    if family in QWEN_VL_FAMILIES:
        from transformers import Qwen2VLImageProcessorPil

        patch = int(config.vision_config.patch_size)
        mean = [0.5, 0.5, 0.5] if family != "qwen2_5_vl" else None  # Qwen3-VL's normalization
        extra: dict[str, Any] = {"image_mean": mean, "image_std": mean} if mean else {}
        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": 16 * patch * patch, "longest_edge": 1024 * patch * patch},
            patch_size=patch, temporal_patch_size=2, merge_size=2, **extra)
    from transformers import MiniCPMV4_6ImageProcessorPil  # MiniCPM-V 4.7's as well

    return MiniCPMV4_6ImageProcessorPil(scale_resolution=int(config.vision_config.image_size),
                                        patch_size=int(config.vision_config.patch_size),
                                        max_slice_nums=max_tiles)


def _randomize(model: torch.nn.Module, seed: int, centred_image_rows: bool = False) -> None:
    """Weights with a scale that keeps activations in a healthy range (Qwen3.5's text norms
    scale by 1 + weight: theirs are drawn around 0, but for the gated norm's)."""
    g = torch.Generator().manual_seed(seed)
    config: Any = model.config  # a transformers VLM config: its fields are the family's
    centered = getattr(config.text_config, "model_type", "") in _CENTERED_TEXT
    # Qwen3.5's vision tower uses LayerNorm (weight around 1), like Qwen3-VL's
    with torch.no_grad():
        for name, p in model.named_parameters():
            if centered and "language_model" in name and "linear_attn.norm" not in name and (
                    name.endswith("norm.weight") or "layernorm" in name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or \
                    "layernorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif ".lambda_" in name:  # InternViT layer scale
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.dim() >= 4 else p.shape[-1]  # conv: C*(kt)*kh*kw
                p.copy_(torch.randn(p.shape, generator=g) / (fan_in ** 0.5))
        if config.model_type in QWEN_VL_FAMILIES:
            _image_rows_like_text(model, g, centred_image_rows)


def _image_rows_like_text(model: torch.nn.Module, g: torch.Generator, centred: bool) -> None:
    """A Qwen VLM's image rows (and DeepStack rows) scaled to its text embeddings' spread,
    without a bias (`centred`: the mergers' last bias cancels the rows' mean over a random
    probe instead): with random weights they would otherwise drown the text and look alike,
    and the text model would answer every image with one token (at the published widths it
    still does unless `centred`)."""
    hf: Any = model  # a transformers Qwen VLM: its submodules are the family's
    visual = hf.model.visual
    vc = hf.config.vision_config
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    side = 4 * int(vc.spatial_merge_size)
    probe = torch.randn(side * side, dim, generator=g)
    target = float(hf.get_input_embeddings().weight.std())
    out = hf.model.get_image_features(probe, torch.tensor([[1, side, side]]))
    rows = [torch.cat(list(out.pooler_output))]
    rows += [torch.cat(list(f)) for f in getattr(out, "deepstack_features", None) or []]
    for merger, feats in zip([visual.merger, *getattr(visual, "deepstack_merger_list", [])],
                             rows, strict=True):
        last = merger.mlp[2] if hasattr(merger, "mlp") else merger.linear_fc2
        scale = target / float((feats - feats.mean(0)).std())
        last.weight.mul_(scale)
        if centred:
            last.bias.copy_(-scale * (feats.mean(0) - last.bias))
        else:
            last.bias.zero_()


def published_vlm_config(config_dir: str, text_layers: int, depth: int,
                         tie_word_embeddings: bool | None = None,
                         **vision_overrides: Any) -> Any:
    """A published Qwen-VL config (`config_dir`/config.json) at its real widths (hidden
    sizes, heads, head dims, intermediate sizes, patch, window and position-grid sizes,
    M-RoPE sections) with only its layer counts cut: `text_layers` text layers and a vision
    tower of `depth` layers (`vision_overrides` remap its per-layer indexes to the cut
    tower: `fullatt_block_indexes`, `deepstack_visual_indexes`). The vocabulary is cut to
    the tiny tokenizer's (`vlm_tokenizer`: 400 rows instead of 151936, its image, video and
    vision marker ids and end-of-turn id in place of the published ones);
    `tie_word_embeddings` given overrides the published tie."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    if cfg.model_type not in QWEN_VL_FAMILIES:
        raise ValueError(f"{config_dir} is a {cfg.model_type} config, not a Qwen-VL one "
                         f"({', '.join(QWEN_VL_FAMILIES)})")
    tok = vlm_tokenizer(cfg.model_type)
    whole = cfg.to_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size",
                "vision_token_id"):  # the published ids, past the cut vocabulary
        whole.pop(key, None)
    whole.update({key: tok.convert_tokens_to_ids(QWEN_VL_TOKENS[attr]) for attr, key in (
        ("image_token", "image_token_id"), ("video_token", "video_token_id"),
        ("vision_start_token", "vision_start_token_id"),
        ("vision_end_token", "vision_end_token_id"))})
    text = whole["text_config"]
    text.pop("layer_types", None)  # one per published layer: rebuilt for the cut count
    text.update(num_hidden_layers=text_layers, vocab_size=_TEXT_VOCAB, bos_token_id=None,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tok.pad_token_id)
    whole["vision_config"].update(depth=depth, **vision_overrides)
    if tie_word_embeddings is not None:
        whole["tie_word_embeddings"] = text["tie_word_embeddings"] = tie_word_embeddings
    return type(cfg).from_dict(whole)


def tiny_vlm(family: str = "internvl", seed: int = 0, text: dict[str, Any] | None = None,
             config: Any = None, centred_image_rows: bool = False,
             **vision_overrides: Any) -> Any:
    """A transformers VLM of `family` with seeded random weights (float32, eval mode), of
    `config` when given (a config of that family, e.g. `published_vlm_config`'s), else of
    the tiny config; `centred_image_rows`: a Qwen VLM's image rows without a common offset
    (see `_image_rows_like_text`)."""
    import transformers

    if config is not None and config.model_type != family:
        raise ValueError(f"a {config.model_type} config given for a {family} model")
    cfg = config if config is not None else tiny_vlm_config(family, text, **vision_overrides)
    torch.manual_seed(seed)
    cls = getattr(transformers, {"internvl": "InternVLForConditionalGeneration",
                                 "minicpmv4_6": "MiniCPMV4_6ForConditionalGeneration",
                                 "minicpmv4_7": "MiniCPMV4_7ForConditionalGeneration",
                                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                 "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                 "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                                 "qwen3_5": "Qwen3_5ForConditionalGeneration",
                                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[
        cfg.model_type])
    model = cls(cfg).to(torch.float32)
    _randomize(model, seed, centred_image_rows)
    return model.eval()


def save_tiny_vlm(path: str, family: str = "internvl", seed: int = 0, max_tiles: int = 4,
                  text: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
                  max_shard_size: str | None = None, config: Any = None,
                  centred_image_rows: bool = False, **vision_overrides: Any) -> str:
    """Write a tiny VLM directory: weights (in `dtype`, default float32; in shards of
    `max_shard_size` when given, as `save_pretrained` shards), config (`config` and
    `centred_image_rows` as `tiny_vlm` takes them), tokenizer with the image tokens,
    generation config and the image processor's preprocessor_config.json."""
    from transformers import GenerationConfig

    os.makedirs(path, exist_ok=True)
    model = tiny_vlm(family, seed, text, config, centred_image_rows, **vision_overrides)
    if dtype is not None:
        model = model.to(dtype)
    tok = vlm_tokenizer(family)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"),
                      tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.pad_token_id, do_sample=False)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    tok.save_pretrained(path)
    proc = tiny_image_processor(family, model.config, max_tiles)
    write_output(os.path.join(path, "preprocessor_config.json"),
                 json.dumps(json.loads(proc.to_json_string()), indent=1))
    return path
