"""Qwen3.5 (dense, `qwen3_5_text`): a hybrid of full-attention layers (a KV cache) and
Gated DeltaNet linear-attention layers (a conv state and a recurrent state each, carried
from one step to the next: `toptpu.backend.contract.linear_net_io`). Its checkpoints may
hold a multi-token-prediction head (`mtp.*`, for speculative decoding), which toptpu skips
as transformers' `Qwen3_5ForCausalLM` does."""

from __future__ import annotations

from toptpu.families.base import TextFamily

QWEN3_5 = TextFamily(
    "qwen3_5", "Qwen3.5", ("qwen3_5_text",), "Qwen3_5TextConfig", hybrid=True,
    skipped_prefixes=("mtp.",),
    refused={
        "qwen3_5": "this is a Qwen3.5 vision-language checkpoint, which `toptpu compile` "
                   "takes as a VLM (its vision tower and hybrid text model) from its "
                   "directory; a text model alone is model_type qwen3_5_text",
    })
