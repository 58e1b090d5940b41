"""Wrap one Hugging Face decoder layer (with the model's rotary embedding) as a module
that torch.export can trace at static shapes: (hidden, position_ids, attention_mask) ->
hidden. Used by the Top-level checks and the demo; the LLM nets with KV plumbing live in
`toptpu.frontends.llm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.llm import LinearAttentionBlock, linear_widths, text_rotary
from toptpu.passes.pipelines import run_passes, top_pipeline_passes


class DecoderLayerWithRope(torch.nn.Module):
    """The model's decoder layer with its rotary embedding (at text positions: `text_rotary`).
    A linear-attention layer (Qwen3.5's Gated DeltaNet) runs as the splitter wraps it, from
    a zero state with every token real (`LinearAttentionBlock`: the model's projections and
    norms, the conv and the delta rule as the two fused ops), so that it exports as what is
    compiled rather than as transformers' chunked loop."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = text_rotary(rotary)
        self.linear: LinearAttentionBlock | None = None
        if hasattr(layer, "linear_attn"):
            linear_attn = layer.linear_attn
            assert isinstance(linear_attn, torch.nn.Module)
            self.linear = LinearAttentionBlock(layer, linear_widths(linear_attn))

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear.mix(hidden, hidden.new_ones(1, hidden.shape[1]), None, None)[0]
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


LAYER_IO = (["hidden", "position_ids", "attention_mask"], ["out"])


@dataclass
class ImportedLayer:
    """A decoder layer in Top, the inputs it was imported at and torch's output on them."""

    module: Any  # xdsl ModuleOp
    store: Any  # WeightStore
    feeds: dict[str, np.ndarray]
    reference: np.ndarray


def import_decoder_layer(model: Any, length: int, *, index: int = 0,
                         mask_value: float | None = None, top_pipeline: bool = True
                         ) -> ImportedLayer:
    """Layer `index` of `model` imported into Top at `length` tokens (after `top-pipeline`
    unless told otherwise), with its causal-mask inputs and torch's output. `mask_value`
    replaces the mask's large negative (-10000.0 keeps f16/bf16 nets finite)."""
    layer = decoder_layer(model, index)
    hidden, pos, mask = layer_inputs(model.config.hidden_size, length)
    if mask_value is not None:
        mask = torch.where(mask < 0, mask_value, 0.0)
    with torch.no_grad():
        ref = layer(hidden, pos, mask).numpy()
    module, store = import_module(layer, (hidden, pos, mask), input_names=LAYER_IO[0],
                                  output_names=LAYER_IO[1])
    if top_pipeline:
        run_passes(module, top_pipeline_passes(), store=store)
    feeds = {"hidden": hidden.numpy(), "position_ids": pos.numpy(),
             "attention_mask": mask.numpy()}
    return ImportedLayer(module, store, feeds, ref)
