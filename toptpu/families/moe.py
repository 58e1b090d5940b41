"""The mixture-of-experts decoder families: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B:
q/k norms, top-k routing, `norm_topk_prob`), Qwen2-MoE (Qwen1.5-MoE-A2.7B: biased q/k/v,
a shared expert scaled by a sigmoid gate) and Qwen3.5-MoE (Qwen3.5-35B-A3B: Qwen3.5's
hybrid of Gated DeltaNet and gated full-attention layers, each with a MoE block of
renormalized top-k experts and a gated shared expert). The text model of Qwen3-VL-MoE
(`qwen3_vl_moe_text`, no causal LM of its own in transformers) has Qwen3-MoE's layers.
Their attention is the dense decoders' (Qwen3.5's for Qwen3.5-MoE); their MLP is a sparse
MoE block the splitter recognizes in the module (`frontends.moe`) and exports as two Top
ops (`top.moe_route`, `top.moe_experts`). What works and what does not yet: docs/moe.md."""

from __future__ import annotations

from toptpu.families.base import TextFamily

QWEN3_MOE = TextFamily("qwen3_moe", "Qwen3-MoE", ("qwen3_moe",), "Qwen3MoeConfig",
                       vlm_text_types=("qwen3_vl_moe_text",))
QWEN2_MOE = TextFamily("qwen2_moe", "Qwen2-MoE", ("qwen2_moe",), "Qwen2MoeConfig")
QWEN3_5_MOE = TextFamily(
    "qwen3_5_moe", "Qwen3.5-MoE", ("qwen3_5_moe_text",), "Qwen3_5MoeTextConfig", hybrid=True,
    skipped_prefixes=("mtp.",),
    refused={
        "qwen3_5_moe": "this is a Qwen3.5-MoE vision-language checkpoint, which `toptpu "
                       "compile` takes as a VLM (its vision tower and hybrid MoE text model) "
                       "from its directory; a text model alone is model_type "
                       "qwen3_5_moe_text",
    })
