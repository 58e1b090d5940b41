"""The physical bound of a MoE model's decode on a chip, from its config.json alone: the
bytes one decoded token cannot avoid moving (every layer's attention or linear-attention
weights, its router, its k active experts' weights and its shared expert, the KV cache a
full-attention layer attends to, the recurrent and conv state a linear-attention layer
reads and writes, the final norm and lm_head, one embedding row) over the sustained DDR
bandwidth. No run, no compile: the figure `toptpu estimate`'s decode is compared against
(docs/moe.md, README's MoE table). Qwen3-MoE (`qwen3_moe`), Qwen2-MoE's shared expert
(`shared_expert_intermediate_size`) and Qwen3.5-MoE's hybrid layers (`layer_types`: Gated
DeltaNet linear attention, gated full attention with its doubled query projection).

    python bench/moe_bound.py bench/configs/qwen3-30B-A3B [--mode-bytes 2] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os

from toptpu.backend.target.chips import get_chip


def _layer_kinds(cfg: dict) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention"] * layers
    full = sum(t == "full_attention" for t in types[:layers])
    return full, layers - full


def active_bytes(cfg: dict, weight_bytes: float, seq: int, kv_bytes: int = 2,
                 expert_share: float = 1.0) -> dict:
    """Bytes one decode token moves at least, by part (weights at `weight_bytes` each;
    the KV cache and the conv state at `kv_bytes`, the recurrent state f32, read and
    written). `expert_share` 1/N: what one chip of N moves under expert parallelism (its
    expected k/N of the k experts; the rest replicated, the lm_head on chip 0)."""
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    full, linear = _layer_kinds(cfg)
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    shared_inter = cfg.get("shared_expert_intermediate_size") or 0
    gated = 2 if cfg.get("attn_output_gate") else 1  # Qwen3.5: q_proj also makes a gate
    attention = (h * heads * d * (gated + 1) + h * kv * d * 2) * weight_bytes
    kv_cache = 2 * seq * kv * d * kv_bytes
    if linear:
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = 2 * nk * dk + nv * dv  # the q, k, v channels the short convolution runs on
        linear_weights = (h * conv + h * nv * dv + 2 * h * nv + nv * dv * h) * weight_bytes
        state = 2 * (nv * dk * dv * 4 + conv * (cfg["linear_conv_kernel_dim"] - 1) * kv_bytes)
    else:
        linear_weights = state = 0
    router = h * e * weight_bytes  # the router stays float (the activation type)
    shared = (3 * shared_inter * h + h) * weight_bytes if shared_inter else 0  # and its gate
    experts = k * 3 * inter * h * weight_bytes * expert_share
    all_experts = e * 3 * inter * h * weight_bytes
    head = cfg["vocab_size"] * h * weight_bytes + h * weight_bytes  # lm_head, one embedding row
    moe = router + shared + experts
    per_full, per_linear = attention + kv_cache + moe, linear_weights + state + moe
    layers = full + linear
    weights = full * attention + linear * linear_weights + layers * (
        router + shared + all_experts) + 2 * cfg["vocab_size"] * h * weight_bytes  # (norms
    # aside) the model file's weights: embedding and lm_head
    token = full * per_full + linear * per_linear + head
    return {"per_layer": token / layers, "experts": experts, "all_experts": all_experts,
            "weights": weights, "token": token,
            "token_all_experts": token + layers * (all_experts - experts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir", nargs="+")
    ap.add_argument("--mode-bytes", type=float, default=2.0,
                    help="bytes per weight (2: bf16/f16, the experts' type in every mode)")
    ap.add_argument("--seq", type=int, default=512, help="KV cache length attended")
    ap.add_argument("--chip", default="bm1684x")
    args = ap.parse_args()
    chip = get_chip(args.chip)
    bw = chip.sustained_gbps * 1e9
    for path in args.config_dir:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        b = active_bytes(cfg, args.mode_bytes, args.seq)
        print(f"{os.path.basename(path.rstrip('/'))}: {b['token'] / 1e6:.1f} MB a token "
              f"({b['per_layer'] / 1e6:.2f} MB a layer on average, of which "
              f"{b['experts'] / 1e6:.2f} MB "
              f"the k experts; {b['all_experts'] / 1e6:.1f} MB all experts) -> bound "
              f"{bw / b['token']:.2f} tok/s at {chip.sustained_gbps:.3g} GB/s; every expert "
              f"moved: {b['token_all_experts'] / 1e6:.0f} MB, {bw / b['token_all_experts']:.3f} "
              f"tok/s; weights {b['weights'] / 1e9:.1f} GB: at least "
              f"{-(-b['weights'] // chip.ddr_bytes):.0f} {chip.name} of "
              f"{chip.ddr_bytes / 2**30:.0f} GiB")


if __name__ == "__main__":
    main()
