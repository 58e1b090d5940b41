"""Wrap one Hugging Face decoder layer (with the model's rotary embedding) as a module
that torch.export can trace at static shapes: (hidden, position_ids, attention_mask) ->
hidden. Used by the Top-level checks and the demo; the LLM nets with KV plumbing live in
`toptpu.frontends.llm`.
"""

from __future__ import annotations

from typing import Any

import torch


class DecoderLayerWithRope(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        pe = self.rotary(hidden, position_ids)
        out = self.layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=pe)
        return out[0] if isinstance(out, tuple) else out


def decoder_layer(model: Any, index: int = 0) -> DecoderLayerWithRope:
    """Layer `index` of a `*ForCausalLM` model with its rotary embedding, using sdpa."""
    inner = model.model
    model.config._attn_implementation = "sdpa"
    return DecoderLayerWithRope(inner.layers[index], inner.rotary_emb).eval()


def causal_mask(length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal mask [1, 1, L, L] (0 where visible, a large negative elsewhere)."""
    m = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype)
    return torch.triu(m, 1)[None, None]


def layer_inputs(hidden_size: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, hidden_size, generator=g)
    pos = torch.arange(length, dtype=torch.int64)[None]
    return hidden, pos, causal_mask(length)


class DecoderStack(torch.nn.Module):
    """A whole causal LM at static shapes without a KV cache: ids -> logits.

    Uses the model's own embedding, layers, rotary embedding, final norm and lm_head; the
    causal mask is an input (additive), so nothing in the graph depends on cache classes.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        model.config._attn_implementation = "sdpa"
        self.embed = model.model.embed_tokens
        self.layers = torch.nn.ModuleList(
            DecoderLayerWithRope(layer, model.model.rotary_emb) for layer in model.model.layers
        )
        self.norm = model.model.norm
        self.lm_head = model.lm_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, position_ids, attention_mask)
        return self.lm_head(self.norm(h))
