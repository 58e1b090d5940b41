"""GGUF files written by the `gguf` package itself (GGUFWriter, gguf.quants.quantize) from the
tiny random HF models of `toptpu.frontends.tiny_models`: what llama.cpp's convert_hf_to_gguf
writes for a llama / qwen2 checkpoint (llama's q/k rows permuted for its rope layout), small
enough to write in well under a second."""

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
}


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
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and module == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
            out[f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"] = w
    return out


def write_gguf(path: str, family: str = "llama2", qtype: str = "F32", seed: int = 0,
               types: dict[str, str] | None = None, **overrides: Any) -> str:
    """A tiny `family` model (llama2 / qwen2 / qwen3) as the GGUF file `path`: every 2-D weight in
    `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q6_K, ...; `types` by GGUF name overrides),
    norms and biases in F32, the tokenizer, its special ids and the chat template in the
    metadata."""
    arch = family if family in ("qwen2", "qwen3") else "llama"
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
    if arch == "qwen3":
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
    for name, t in gguf_tensors(model, arch).items():
        want = (types or {}).get(name, qtype if t.ndim == 2 else "F32")
        ty = gguf.GGMLQuantizationType[want]
        if ty == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif ty == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
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
