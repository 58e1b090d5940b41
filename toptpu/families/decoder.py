"""The dense decoder families: Qwen2 (Qwen2, Qwen2.5: biased q/k/v), Qwen3 (q/k norms) and
Llama (Llama 2/3). Their layers are one structure that the splitter
(`toptpu.frontends.llm`) reads from the modules (a bias, a norm); what differs here is
their names, their model types and the config class of their structure."""

from __future__ import annotations

from toptpu.families.base import TextFamily

QWEN2 = TextFamily("qwen2", "Qwen2/2.5", ("qwen2",), "Qwen2Config",
                   vlm_text_types=("qwen2_5_vl_text",))
QWEN3 = TextFamily("qwen3", "Qwen3", ("qwen3",), "Qwen3Config",
                   vlm_text_types=("qwen3_vl_text",))
LLAMA = TextFamily("llama", "Llama 2/3", ("llama",), "LlamaConfig")
