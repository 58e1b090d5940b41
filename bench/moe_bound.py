"""The physical bound of a MoE model's decode on a chip, from its config.json alone: the
bytes one decoded token cannot avoid moving (every layer's attention weights, its router,
its k active experts' weights, the KV cache it attends to, the final norm and lm_head, one
embedding row) over the sustained DDR bandwidth. No run, no compile: the figure `toptpu
estimate`'s decode is compared against (docs/moe.md, README's MoE table).

    python bench/moe_bound.py bench/configs/qwen3-30B-A3B [--mode-bytes 2] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os

from toptpu.backend.target.chips import get_chip


def active_bytes(cfg: dict, weight_bytes: float, seq: int, kv_bytes: int = 2) -> dict:
    """Bytes one decode token moves at least, by part (weights at `weight_bytes` each)."""
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attention = (h * heads * d * 2 + h * kv * d * 2) * weight_bytes
    router = h * e * weight_bytes  # the router stays float (the activation type)
    experts = k * 3 * inter * h * weight_bytes
    all_experts = e * 3 * inter * h * weight_bytes
    kv_cache = 2 * seq * kv * d * kv_bytes
    head = cfg["vocab_size"] * h * weight_bytes + h * weight_bytes  # lm_head, one embedding row
    per_layer = attention + router + experts + kv_cache
    weights = layers * (attention + router + all_experts) + 2 * cfg["vocab_size"] * h \
        * weight_bytes  # (norms aside) the model file's weights: embedding and lm_head
    return {"per_layer": per_layer, "experts": experts, "all_experts": all_experts,
            "weights": weights,
            "token": layers * per_layer + head, "token_all_experts":
            layers * (per_layer - experts + all_experts) + head}


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
              f"({b['per_layer'] / 1e6:.2f} MB a layer, of which {b['experts'] / 1e6:.2f} MB "
              f"the k experts; {b['all_experts'] / 1e6:.1f} MB all experts) -> bound "
              f"{bw / b['token']:.2f} tok/s at {chip.sustained_gbps:.3g} GB/s; every expert "
              f"moved: {b['token_all_experts'] / 1e6:.0f} MB, {bw / b['token_all_experts']:.3f} "
              f"tok/s; weights {b['weights'] / 1e9:.1f} GB: at least "
              f"{-(-b['weights'] // chip.ddr_bytes):.0f} {chip.name} of "
              f"{chip.ddr_bytes / 2**30:.0f} GiB")


if __name__ == "__main__":
    main()
