"""GGUF files written by the `gguf` package itself (GGUFWriter, gguf.quants.quantize) from the
tiny random HF models of `toptpu.frontends.tiny_models`: what llama.cpp's convert_hf_to_gguf
writes for a llama / qwen2 checkpoint (llama's q/k rows permuted for its rope layout), small
enough to write in well under a second.

gguf-py quantizes the 32-value types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) but not the K-quants
(its `quantize` raises NotImplementedError for Q4_K, Q5_K, Q6_K, and llama.cpp's quantizer
is not installable here), so `quantize_k` packs those blocks itself: a plain round-to-nearest
(no llama.cpp search for the best scales) in llama.cpp's block layout. The bytes are valid
blocks whatever their quality: what the tests compare is toptpu against gguf's own
dequantization of the same bytes (`gguf.quants.dequantize`, which transformers uses), and
`test_gguf` checks that this dequantization is close to the float weights the blocks came
from (so the layout is the one gguf reads)."""

from __future__ import annotations

import json
import os
from typing import Any

import gguf
import numpy as np

from toptpu.frontends.tiny_models import build_tokenizer, tiny_model

#: HF parameter suffix of a decoder layer -> GGUF tensor name suffix
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    # mixture of experts: llama.cpp's names (src/llama-arch.cpp), the experts 3-D
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
#: the GGUF architecture of a tiny model family
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "qwen3_moe_unnormalized": "qwen3moe", "qwen2_moe": "qwen2moe"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF -> GGUF rope layout)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(model: Any, arch: str) -> dict[str, np.ndarray]:
    """The HF model's tensors by GGUF name, in float32 (llama's q/k permuted)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate | up
            layer, inter = name.split(".")[2], w.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :inter])
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, inter:])
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = w
        elif name.endswith("mlp.shared_expert_gate.weight"):  # llama.cpp: a vector {H}
            out[f"blk.{name.split('.')[2]}.ffn_gate_inp_shexp.weight"] = w.reshape(-1)
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and module == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
            out[f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"] = w
    return out


#: K-quants packed by `quantize_k`
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float values [...] -> their f16 bytes [..., 2]."""
    return v.astype(np.float16)[..., None].view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _low_high(q: np.ndarray, run: int) -> np.ndarray:
    """4-bit values [..., 2 * C] -> bytes [..., C]: each run of `run` bytes holds `run`
    values in its low nibbles and the next `run` in its high ones (llama.cpp's layout)."""
    v = q.reshape(*q.shape[:-1], -1, 2, run)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*q.shape[:-1], -1).astype(np.uint8)


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> the Q4_K / Q5_K / Q6_K blocks uint8
    [N, K / 256 * block bytes], round-to-nearest (see the module doc)."""
    n, k = w.shape
    x = w.astype(np.float64).reshape(n, k // 256, -1)  # super-blocks
    if qtype in ("Q4_K", "Q5_K"):
        top = 15 if qtype == "Q4_K" else 31
        sub = x.reshape(n, -1, 8, 32)
        lo = np.minimum(sub.min(-1), 0.0)
        scale = (sub.max(-1) - lo) / top
        low = -lo
        d = (scale.max(-1) / 63).astype(np.float16).astype(np.float64)
        dmin = (low.max(-1) / 63).astype(np.float16).astype(np.float64)
        sc = np.clip(np.rint(_div(scale, d[..., None])), 0, 63).astype(np.uint8)
        mc = np.clip(np.rint(_div(low, dmin[..., None])), 0, 63).astype(np.uint8)
        step = (d[..., None] * sc)[..., None]
        q = np.clip(np.rint(_div(sub + (dmin[..., None] * mc)[..., None], step)), 0, top)
        q = q.astype(np.uint8).reshape(n, -1, 256)
        scales = np.concatenate([
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (mc[..., :4] & 63) | ((mc[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mc[..., 4:] & 15) << 4)], axis=-1)
        parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
        if qtype == "Q5_K":  # bit j of byte i: the high bit of sub-block j's value i
            high = (q >> 4).reshape(n, -1, 8, 32)
            parts.append(np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None],
                                              axis=-2).astype(np.uint8))
        parts.append(_low_high(q & 15, 32))
    elif qtype == "Q6_K":
        sub = x.reshape(n, -1, 16, 16)
        amax = np.abs(sub).max(-1)
        scale = amax / 31
        d = (scale.max(-1) / 127).astype(np.float16).astype(np.float64)
        sc = np.clip(np.rint(_div(scale, d[..., None])), -128, 127).astype(np.int8)
        step = (d[..., None] * sc)[..., None]
        q = (np.clip(np.rint(_div(sub, step)), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(n, -1, 2, 128)  # two halves of 128 values
        ql = _low_high(q & 15, 64).reshape(n, -1, 128)
        qh = (q >> 4).reshape(n, -1, 2, 4, 32)  # bits 2s..2s+1 of byte i: value 32s + i
        qh = np.bitwise_or.reduce(qh << (2 * np.arange(4, dtype=np.uint8))[:, None],
                                  axis=-2).astype(np.uint8).reshape(n, -1, 64)
        parts = [ql, qh, sc.view(np.uint8), _f16_bytes(d)]
    else:
        raise ValueError(qtype)
    return np.concatenate(parts, axis=-1).reshape(n, -1)


#: types neither gguf-py nor `quantize_k` quantizes: written as blocks of random bytes, for
#: the tests that refuse them by their type (from the header, before a block is read)
RANDOM_BLOCK_TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_S")


def random_blocks(shape: tuple[int, ...], qtype: str, seed: int = 0) -> np.ndarray:
    """Seeded random bytes shaped as `qtype` blocks of a tensor of `shape` (rows, K)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, k = shape
    return np.random.default_rng(seed).integers(0, 256, (rows, k // block * size),
                                                dtype=np.uint8)


#: a metadata value `write_gguf` writes as given: (value, its GGUF type, the element type
#: of an array); a `None` value drops the key
Metadata = dict[str, tuple[Any, "gguf.GGUFValueType | None", "gguf.GGUFValueType | None"]]


def write_gguf(path: str, family: str = "llama2", qtype: str = "F32", seed: int = 0,
               types: dict[str, str] | None = None, metadata: Metadata | None = None,
               **overrides: Any) -> str:
    """A tiny `family` model (llama2 / qwen2 / qwen3) as the GGUF file `path`: every 2-D weight in
    `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q6_K, ...; `types` by GGUF name overrides),
    norms and biases in F32, the tokenizer, its special ids and the chat template in the
    metadata. `metadata` replaces or adds keys as the real writer writes them (a hostile
    file made by the `gguf` package itself): `{key: (value, type, element type)}`."""
    arch = GGUF_ARCH.get(family, "llama")
    model = tiny_model(family, seed, **overrides)
    cfg = model.config
    tok = build_tokenizer(cfg.vocab_size)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in ("qwen3", "qwen3moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None)
                               or cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in data["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    merges = data["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_pad_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    for key, (value, vtype, sub_type) in (metadata or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            assert vtype is not None
            w.add_key_value(key, value, vtype, sub_type)
    for name, t in gguf_tensors(model, arch).items():
        want = (types or {}).get(name, qtype if t.ndim in (2, 3) else "F32")
        if name.endswith("ffn_gate_inp.weight") and want not in ("F16", "BF16"):
            want = "F32"  # the router: llama.cpp's converter keeps it float
        ty = gguf.GGMLQuantizationType[want]
        if ty == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif ty == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif want in K_TYPES:
            blocks = quantize_k(t.reshape(-1, t.shape[-1]), want)
            w.add_tensor(name, blocks.reshape(*t.shape[:-1], -1), raw_dtype=ty)
        elif want in RANDOM_BLOCK_TYPES:
            w.add_tensor(name, random_blocks(t.shape, want, seed), raw_dtype=ty)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, ty), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_dir(root: str, family: str = "llama2", qtype: str = "F32", **kw: Any) -> str:
    """A directory holding one GGUF file (`root`/model.gguf); the directory."""
    os.makedirs(root, exist_ok=True)
    write_gguf(os.path.join(root, "model.gguf"), family, qtype, **kw)
    return root


#: the metadata of `small_gguf`: a llama header with an 8-token vocabulary (no tokenizer
#: conversion, no transformers: what the header checks read)
SMALL_TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]


def small_gguf(path: str, metadata: Metadata | None = None, vocab_rows: int = 8,
               tensors: dict[str, np.ndarray] | None = None) -> str:
    """A header-only llama GGUF written by the `gguf` package (no model behind it, so it
    writes in milliseconds): the sizes transformers maps, an 8-token gpt2 tokenizer, and a
    `token_embd.weight` of `vocab_rows` rows (or `tensors`); `metadata` replaces or adds
    keys (`write_gguf`'s form). For the checks of the header and the metadata."""
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("small")
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(SMALL_TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * len(SMALL_TOKENS))
    w.add_token_merges(["a b", "b c"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, (value, vtype, sub_type) in (metadata or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.add_key_value(key, value, vtype if vtype is not None else V.STRING, sub_type)
    for name, t in (tensors if tensors is not None else
                    {"token_embd.weight": np.zeros((vocab_rows, 32), np.float32)}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
