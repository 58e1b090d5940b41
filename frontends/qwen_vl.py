"""Qwen's vision-language models: Qwen2.5-VL, Qwen3-VL and Qwen3.5, and their mixtures of
experts Qwen3-VL-MoE and Qwen3.5-MoE (the torch side).

A Qwen VLM compiles as its text model (the LLM splitter's nets, with M-RoPE positions
[3, n] in its full-attention nets: `split_model(position_axes=3)`) plus one static `vit`
net over a budget of N patches, and, for Qwen3-VL, the `deepstack_add` net:

- `vit` (`QwenVit`): `pixel_values` f32 [N, C*T*P*P] (the image processor's patches,
  merge windows consecutive; Qwen2.5-VL's reordered window by window), `position_ids_vit`
  i32 [N, 2] (each patch's row and column for the 2-D vision rotary), `attention_mask`
  [1, 1, N, N] (one block per frame, the padding a block of its own), Qwen2.5-VL's
  `window_mask` [1, 1, N, N] (one block per window, for the layers outside
  `fullatt_block_indexes`), Qwen3-VL's and Qwen3.5's `interp_indices` i32 / `interp_weights`
  f32 [N, 4] (the bilinear taps of the learned position grid at the image's grid) ->
  `image_embeds` [1, N/4, H] and, for Qwen3-VL, `deepstack_embeds` [N/4, K, H] (the
  DeepStack mergers' rows after vision layers `deepstack_visual_indexes`). The host builds
  the inputs (`toptpu.backend.contract.qwen_vit_inputs`) and puts the rows back in the
  model's order. The wrapper calls the model's own modules: the patch embedding's weights
  (its Conv3d over one whole patch, kernel = stride, is a linear map of the flattened
  patch), the learned position embedding, the vision rotary, every block's norms, qkv,
  `apply_rotary_pos_emb_vision`, projection and MLP, the merger and the DeepStack mergers;
  the attention is written out because the model's splits its packed sequence at
  `cu_seqlens` on the host, which the static net replaces by the key masks.
- `deepstack_add` (`DeepStackAdd`): `hidden` [1, L, H] + `deepstack` [1, L, H] ->
  `hidden_out` (LLM-TPU's `add` net): the runtime runs it after text layer k of a prefill
  chunk that holds image tokens, with DeepStack level k's rows at the image positions and
  zeros elsewhere, which is the model's `_deepstack_process`.

transformers has no causal-LM class for the text models of Qwen2.5-VL and Qwen3-VL
(`qwen2_5_vl_text`, `qwen3_vl_text`, `qwen3_vl_moe_text`): `TextCausalLM` is the view the
splitter takes (the VLM's own language model and lm_head). Qwen3.5's text models are
`qwen3_5_text` and `qwen3_5_moe_text`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from toptpu.families import QWEN_VL, VLM_TEXT_TYPES

#: VLM model_type -> the transformers class of the whole VLM (the family's table)
QWEN_VL_CLASSES = dict(QWEN_VL.model_types)
#: text model_type of a Qwen VLM that transformers has no causal LM for -> the family of
#: text models whose layers it has (Qwen2's biased q/k/v, Qwen3's q/k norms)
QWEN_VL_TEXT_TYPES = {mt: family.name for mt, family in VLM_TEXT_TYPES.items()}
#: the tokens a Qwen processor lays out, with the defaults it falls back to when the
#: tokenizer does not name them (`Qwen2_5_VLProcessor.__init__`)
QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
               "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
#: the config fields holding each token's id
QWEN_TOKEN_IDS = {"image_token": "image_token_id", "video_token": "video_token_id",
                  "vision_start_token": "vision_start_token_id",
                  "vision_end_token": "vision_end_token_id"}
#: the default static pixel budget W x H (LLM-TPU's Qwen3-VL files: max_pixel 768x768)
DEFAULT_MAX_PIXELS = (768, 768)


class TextCausalLM(torch.nn.Module):
    """A causal LM view of a VLM's text model transformers has no causal-LM class for:
    `model` is the VLM's language model, `lm_head` its lm_head (no copies)."""

    def __init__(self, config: Any, model: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head
        self.generation_config: Any = None

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> torch.nn.Module:
        embed = self.model.embed_tokens
        assert isinstance(embed, torch.nn.Module)
        return embed


def text_model_shell(text_config: Any) -> TextCausalLM:
    """`TextCausalLM` of a text config (the model from `AutoModel`, an lm_head of its
    vocabulary), built where the caller's device context says (the streaming skeleton
    builds it on the meta device)."""
    from transformers import AutoModel

    model = AutoModel.from_config(text_config, dtype=torch.float32)
    head = torch.nn.Linear(int(text_config.hidden_size), int(text_config.vocab_size),
                           bias=False)
    return TextCausalLM(text_config, model, head)


def _vision_module_function(visual: Any, name: str) -> Any:
    fn = getattr(sys.modules[type(visual).__module__], name, None)
    if fn is None:
        raise ValueError(f"{type(visual).__module__} has no {name}")
    return fn


class QwenVit(torch.nn.Module):
    """The vision tower of a Qwen VLM over N patches (see the module doc)."""

    def __init__(self, visual: Any, windowed: bool) -> None:
        super().__init__()
        self.visual = visual
        proj = visual.patch_embed.proj
        dim = int(proj.weight.shape[0])
        # the Conv3d over one whole patch (kernel = stride) is this linear map of the
        # flattened patch (its view shares the weight's storage)
        self.patch_weight = torch.nn.Parameter(proj.weight.detach().reshape(dim, -1),
                                               requires_grad=False)
        self.windowed = windowed
        self.full_layers = set(int(i) for i in getattr(visual, "fullatt_block_indexes", ())
                               or ()) if windowed else set()
        self.interpolated = hasattr(visual, "pos_embed")
        self.deepstack = [int(i) for i in getattr(visual, "deepstack_visual_indexes", ()) or ()]
        self.apply_rotary = _vision_module_function(visual, "apply_rotary_pos_emb_vision")

    def _attend(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The model's vision attention over x [N, D] with an additive key mask."""
        s, d = x.shape
        # the model's qkv(x).reshape(s, 3, heads, -1).permute(1, 0, 2, 3).unbind(0), as three
        # column slices (a permute of the stacked three would move every row at once)
        qkv = attn.qkv(x)
        q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(1, s, attn.num_heads, -1)
                   for i in range(3))
        q, k = self.apply_rotary(q, k, cos, sin)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        return attn.proj(o.transpose(1, 2).reshape(s, d))

    def forward(self, pixel_values: torch.Tensor, position_ids_vit: torch.Tensor,
                attention_mask: torch.Tensor, *rest: torch.Tensor
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        v = self.visual
        window_mask = rest[0] if self.windowed else attention_mask
        x = F.linear(pixel_values, self.patch_weight, v.patch_embed.proj.bias)
        if self.interpolated:  # the model's (pos_embed(taps) * weights[:, :, None]).sum(1),
            # tap by tap: a sum over the middle axis of [N, 4, D] cannot be sliced by rows
            taps, weights = rest[-2:]
            pos = v.pos_embed(taps[:, 0]) * weights[:, 0:1]
            for j in range(1, int(taps.shape[1])):
                pos = pos + v.pos_embed(taps[:, j]) * weights[:, j:j + 1]
            x = x + pos
        cos, sin = v.rotary_pos_emb(x, position_ids_vit)
        levels = []
        for i, blk in enumerate(v.blocks):
            mask = attention_mask if not self.windowed or i in self.full_layers else window_mask
            x = x + self._attend(blk.attn, blk.norm1(x), cos, sin, mask)
            x = x + blk.mlp(blk.norm2(x))
            if i in self.deepstack:
                levels.append(v.deepstack_merger_list[self.deepstack.index(i)](x))
        out = v.merger(x).unsqueeze(0)
        if levels:
            # rows first, the K levels side by side (a concat along a leading axis of K
            # would not slice by rows)
            return out, torch.cat([lv.unsqueeze(1) for lv in levels], dim=1)
        return out


class DeepStackAdd(torch.nn.Module):
    """hidden [1, L, H] + deepstack [1, L, H] (the model's `_deepstack_process` with the
    level's rows at the image positions and zeros elsewhere)."""

    def forward(self, hidden: torch.Tensor, deepstack: torch.Tensor) -> torch.Tensor:
        return hidden + deepstack
