"""The mixture-of-experts decoder families: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B:
q/k norms, top-k routing, `norm_topk_prob`) and Qwen2-MoE (Qwen1.5-MoE-A2.7B: biased q/k/v,
a shared expert scaled by a sigmoid gate). Their attention is the dense decoders'; their
MLP is a sparse MoE block the splitter recognizes in the module (`frontends.moe`) and
exports as two Top ops (`top.moe_route`, `top.moe_experts`). What works and what does not
yet: docs/moe.md."""

from __future__ import annotations

from toptpu.families.base import TextFamily

QWEN3_MOE = TextFamily("qwen3_moe", "Qwen3-MoE", ("qwen3_moe",), "Qwen3MoeConfig")
QWEN2_MOE = TextFamily("qwen2_moe", "Qwen2-MoE", ("qwen2_moe",), "Qwen2MoeConfig")
