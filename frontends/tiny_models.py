"""The built-in default model and other tiny models with seeded random weights.

Nothing is downloaded: configs are real `transformers` config classes at tiny sizes, the
weights are drawn from a seeded generator, and the tokenizer is a byte-level BPE trained
with the `tokenizers` library on a small built-in text. `save_tiny_model` writes a normal
Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json), exactly what a user's checkpoint looks like.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = """\
The tensor processor runs the compiled model. Each layer is compiled once and bound to
its own weights. Prefill reads the whole prompt; decode adds one token at a time and
writes its keys and values straight into the cache. A compiler lowers the model from Top
to Tpu, groups layers into local memory, assigns addresses and emits command streams.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. One two three four five six seven eight nine ten.
The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>,.;:!?'"
Quantization stores weights in four or eight bits with a scale and a zero point per group.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on CORPUS (deterministic)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str = "qwen2", vocab_size: int = 384, layers: int = 2, **overrides: Any
                ) -> Any:
    """A tiny config of a supported family: qwen2, qwen3, qwen3_5, qwen3_moe,
    qwen3_moe_unnormalized, qwen2_moe, qwen3_5_moe, llama2, llama3."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=0,
    )
    cfg: tf.PretrainedConfig
    if family == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "head_dim": 16, "tie_word_embeddings": True,
                                **overrides})
    elif family == "llama2":
        cfg = tf.LlamaConfig(**{**common, "num_key_value_heads": 4, **overrides})
    elif family == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                "rope_theta": 500000.0}
        cfg = tf.LlamaConfig(**{**common, "rope_scaling": rope, "tie_word_embeddings": True,
                                **overrides})
    elif family == "qwen3_5":
        # hybrid: three linear-attention (Gated DeltaNet) layers to one full-attention layer,
        # gated attention with partial rotary (0.25), zero-centered norms
        cfg = tf.Qwen3_5TextConfig(**{
            **common, "head_dim": 16, "tie_word_embeddings": True, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
            "num_hidden_layers": max(layers, 4), **overrides})
    elif family == "qwen3_5_moe":
        # Qwen3.5-35B-A3B's structure (Qwen3.5's hybrid layers, every MLP a MoE block: top-k
        # renormalized, a shared expert with its sigmoid gate) with 8 experts, top-2; no
        # dense MLP, so no intermediate_size (as its config.json)
        dense = {k: v for k, v in common.items() if k != "intermediate_size"}
        cfg = tf.Qwen3_5MoeTextConfig(**{
            **dense, "head_dim": 16, "tie_word_embeddings": False, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96,
            "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": max(layers, 4), **overrides})
    elif family in ("qwen3_moe", "qwen3_moe_unnormalized"):
        # Qwen3-30B-A3B's structure (q/k norms, untied, top-k routing) with 8 experts of
        # which each token takes 2; `qwen3_moe_unnormalized`: norm_topk_prob false
        cfg = tf.Qwen3MoeConfig(**{
            **common, "head_dim": 16, "tie_word_embeddings": False,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": family == "qwen3_moe", "decoder_sparse_step": 1,
            "mlp_only_layers": [], **overrides})
    elif family == "qwen2_moe":
        # Qwen1.5-MoE-A2.7B's structure (biased q/k/v, top-4 of the experts without
        # renormalization, a shared expert with its sigmoid gate) with 8 experts
        cfg = tf.Qwen2MoeConfig(**{
            **common, "tie_word_embeddings": False, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96, "num_experts": 8,
            "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], **overrides})
    else:
        raise ValueError(f"unknown tiny model family '{family}' (qwen2, qwen3, qwen3_5, "
                         "qwen3_moe, qwen3_moe_unnormalized, qwen2_moe, qwen3_5_moe, llama2, "
                         "llama3)")
    return cfg


def qwen3_5_small_config(layers: int = 4, **overrides: Any) -> Any:
    """Qwen3.5's real small shapes (hidden 1024, head_dim 256, 8/2 heads, 16 key and 16
    value linear heads of 128, partial rotary 0.25) at a few layers and a tiny vocabulary."""
    return tiny_config("qwen3_5", layers=layers, **{
        "hidden_size": 1024, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, **overrides})


def qwen3_moe_real_config(layers: int = 2, experts: int = 16, **overrides: Any) -> Any:
    """Qwen3-30B-A3B's published shape (hidden 2048, 32 query and 4 KV heads of 128, experts
    of intermediate 768, top-8 routing, norm_topk_prob) with its 128 experts cut to
    `experts`, 48 layers to `layers` and the vocabulary to the tiny tokenizer's."""
    return tiny_config("qwen3_moe", layers=layers, **{
        "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
        "num_experts": experts, "num_experts_per_tok": 8, "rope_theta": 1000000.0,
        **overrides})


def qwen2_moe_real_config(layers: int = 2, experts: int = 8, **overrides: Any) -> Any:
    """Qwen1.5-MoE-A2.7B's published shape (hidden 2048, 16 heads of 128, experts of
    intermediate 1408, top-4 routing without renormalization, a shared expert of 5632)
    with its 60 experts cut to `experts`, 24 layers to `layers` and the vocabulary to the
    tiny tokenizer's."""
    return tiny_config("qwen2_moe", layers=layers, **{
        "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
        "num_key_value_heads": 16, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts": experts,
        "num_experts_per_tok": 4, "rope_theta": 1000000.0, **overrides})


def qwen3_5_moe_real_config(layers: int = 4, experts: int = 16, **overrides: Any) -> Any:
    """Qwen3.5-35B-A3B's published shape (transformers' `Qwen3_5MoeTextConfig` defaults:
    hidden 2048, 16 query and 2 KV heads of 256 with partial rotary 0.25, 16 key and 32
    value linear-attention heads of 128, experts of intermediate 512, top-8, a shared
    expert of 512) with its 256 experts cut to `experts`, 40 layers to `layers` (every
    fourth full attention) and the vocabulary to the tiny tokenizer's."""
    return tiny_config("qwen3_5_moe", layers=layers, **{
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts": experts, "num_experts_per_tok": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25}, **overrides})


def tiny_model(family: str = "qwen2", seed: int = 0, **config_overrides: Any) -> Any:
    """A `transformers` causal LM with seeded random weights (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    cfg = config_overrides.pop("config", None) or tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    # Qwen3.5's norms scale by (1 + weight): their weights are drawn around 0
    centered = "Qwen3_5" in type(cfg).__name__
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random weights with a scale that keeps activations in a healthy range
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if (name.endswith("norm.weight") or "layernorm" in name) and not (
                    centered and "linear_attn.norm" not in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif centered and (name.endswith("norm.weight") or "layernorm" in name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))
    return model.eval()


def save_tiny_model(path: str, family: str = "qwen2", seed: int = 0,
                    **config_overrides: Any) -> str:
    """Write a tiny model directory (weights, config, tokenizer, generation config)."""
    from transformers import GenerationConfig

    os.makedirs(path, exist_ok=True)
    model = tiny_model(family, seed, **config_overrides)
    tok = build_tokenizer(model.config.vocab_size)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"),
                      tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def qwen25_05b_config(layers: int = 24, **overrides: Any) -> Any:
    """Qwen2.5-0.5B's public shape (hidden 896, intermediate 4864, 14 heads, 2 KV heads,
    vocab 151936, tied embeddings) for benchmarks with random weights."""
    import transformers as tf

    return tf.Qwen2Config(**{
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": layers,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, **overrides})
