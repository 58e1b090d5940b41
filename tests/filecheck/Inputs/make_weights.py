"""Writes weights.safetensors for the FileCheck tests (deterministic; rerun to regenerate)."""

import os

import numpy as np
from safetensors.numpy import save_file

rng = np.random.default_rng(0)
save_file({
    "fc.weight": rng.standard_normal((32, 64)).astype(np.float32),
    "fc.bias": rng.standard_normal((32,)).astype(np.float32),
    "norm.weight": rng.standard_normal((64,)).astype(np.float32),
    "embed.weight": rng.standard_normal((16, 64)).astype(np.float32),
    "inv_freq": (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32),
}, os.path.join(os.path.dirname(__file__), "weights.safetensors"))

# a pre-quantized layer (as the compiler stores a GPTQ/AWQ checkpoint's tensors): 4-bit,
# group 32, act-order g_idx; the marker "#checkpoint" says the model came pre-quantized
k, n = 64, 32
g_idx = rng.permutation(np.repeat(np.arange(k // 32), 32)).astype(np.int32)
save_file({
    "fc.weight": rng.standard_normal((n, k)).astype(np.float32),
    "fc.weight#checkpoint.qweight": rng.integers(0, 16, (n, k)).astype(np.uint8),
    "fc.weight#checkpoint.scales": (rng.random((n, k // 32)) * 0.1).astype(np.float16),
    "fc.weight#checkpoint.zeros": rng.integers(0, 16, (n, k // 32)).astype(np.uint8),
    "fc.weight#checkpoint.g_idx": g_idx,
    "fc.weight#checkpoint.meta": np.array([4, 32], np.int32),
    "proj.weight": rng.standard_normal((n, n)).astype(np.float32),
    "#checkpoint": np.ones(1, np.int8),
}, os.path.join(os.path.dirname(__file__), "checkpoint.safetensors"))

# a scale-and-min layer (as the compiler stores a GGUF Q4_1 / Q4_K linear): 4-bit integers
# as stored, group 32, f16 scales and float mins (no zero points)
save_file({
    "fc.weight": rng.standard_normal((n, k)).astype(np.float32),
    "fc.weight#checkpoint.qweight": rng.integers(0, 16, (n, k)).astype(np.uint8),
    "fc.weight#checkpoint.scales": (rng.random((n, k // 32)) * 0.1).astype(np.float16),
    "fc.weight#checkpoint.mins": (rng.standard_normal((n, k // 32)) * 0.1).astype(np.float16),
    "fc.weight#checkpoint.meta": np.array([4, 32], np.int32),
    "#checkpoint": np.ones(1, np.int8),
}, os.path.join(os.path.dirname(__file__), "checkpoint_mins.safetensors"))

# a linear-attention layer's depthwise conv taps [C, K] (its own generator: the tensors
# above stay as they were)
save_file({
    "conv.weight": np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32),
}, os.path.join(os.path.dirname(__file__), "linear_attention.safetensors"))

# a mixture-of-experts block's router [E, H] and its experts stacked by expert: gate and
# up [E, I, H], down [E, H, I] (E 4, H 8, I 3; its own generator)
moe_rng = np.random.default_rng(2)
save_file({
    "router.weight": moe_rng.standard_normal((4, 8)).astype(np.float32),
    "experts.gate_proj": moe_rng.standard_normal((4, 3, 8)).astype(np.float32),
    "experts.up_proj": moe_rng.standard_normal((4, 3, 8)).astype(np.float32),
    "experts.down_proj": moe_rng.standard_normal((4, 8, 3)).astype(np.float32),
}, os.path.join(os.path.dirname(__file__), "moe.safetensors"))

# the same block's experts pre-quantized (as the compiler stores a MoE checkpoint's
# tensors: each projection's integers, scales and zero points stacked by expert; 4-bit,
# group 32; E 4, H 32, I 32; the router float; its own generator)
ck_rng = np.random.default_rng(3)
moe_ck: dict[str, np.ndarray] = {"#checkpoint": np.ones(1, np.int8),
                                 "router.weight": ck_rng.standard_normal((4, 32)).astype(
                                     np.float32)}
for proj in ("gate_proj", "up_proj", "down_proj"):
    w = f"experts.{proj}"
    moe_ck[w] = np.zeros((4, 32, 32), np.float32)  # the float weight the IR names
    moe_ck[f"{w}#checkpoint.qweight"] = ck_rng.integers(0, 16, (4, 32, 32)).astype(np.uint8)
    moe_ck[f"{w}#checkpoint.scales"] = (ck_rng.random((4, 32, 1)) * 0.1).astype(np.float16)
    moe_ck[f"{w}#checkpoint.zeros"] = np.full((4, 32, 1), 8, np.uint8)
    moe_ck[f"{w}#checkpoint.meta"] = np.array([4, 32], np.int32)
save_file(moe_ck, os.path.join(os.path.dirname(__file__), "moe_checkpoint.safetensors"))
