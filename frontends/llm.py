"""The LLM splitter: a causal LM cut into the static nets of the net contract
(`toptpu.backend.contract`; ARCHITECTURE.md, "The net contract").

Each net is a small `nn.Module` wrapper around the Hugging Face model's *own* submodules —
its embedding, norms, q/k/v/o projections, q/k norms (Qwen3), MLP, rotary embedding (with
its scaling, e.g. Llama 3's) and the `apply_rotary_pos_emb` of the model's modeling
module. The wrappers only make the KV plumbing explicit: history tensors in, present
tensors out. Each is exported with `torch.export` at static shapes:

- `embedding`: `input_ids` i32 [1, L] -> `hidden` [1, L, H]
- `embedding_cache`: `input_ids` i32 [1, 1] -> `hidden` [1, 1, H]
- `block` (prefill): `hidden` [1, L, H], `position_ids` i32 [1, L] (or [3, L]: a position
  per rotary axis, T/H/W, for a VLM that lays them out per axis: MiniCPM-V 4.7),
  `attention_mask` [1, 1, L, L] -> `hidden_out` [1, L, H], `present_k`/`present_v`
  [1, L, kvH, D]
- `block_kv` (prefill_kv): as `block` plus `history_k`/`history_v` [1, Hh, kvH, D], with
  mask [1, 1, L, Hh + L] -> the same outputs
- `block_cache` (decode): `hidden` [1, 1, H], `position_ids` [1, 1], mask
  [1, 1, 1, SEQ + 1], `history_k`/`history_v` [1, SEQ, kvH, D] -> `hidden_out` [1, 1, H],
  `present_k`/`present_v` [1, 1, kvH, D]
- `lm_head`: `hidden` [1, H] -> `logits` [1, V] (final norm, lm_head)
- `greedy_head`: `logits` [1, V] -> `token` i32 [1, 1] (argmax; LLM-TPU's greedy_head)
- `sample_head`: `logits`, `recent_ids` i32 [1, SEQ], `penalty`, `temperature`, `top_k`,
  `top_p` -> `probs` f32 [1, K], `token_ids` i32 [1, K] (LLM-TPU's sample_head: repetition
  penalty, temperature, top-k, top-p; the host draws one of the K candidates)

The heads are small torch modules of our own (no weights) that compute in f32 whatever
the activation type: their `NetSpec` asks for mode f32 with the logits input kept in the
activation type (`keep_input_types`), so the lm_head's logits bind to them as they are.

(The block output is named `hidden_out` so that a net's IO names are unique: the runtime
binds buffers by name.) KV layout is `[1, SEQ, kvH, D]`, sequence-major. Attention is
written as `sdpa(q, cat(history, present).transpose(1, 2), ...)`, the concatenation in the
cache layout; the Top `fuse` pass turns that into `top.attention` with
`history_k`/`history_v` operands, so the caches are read where they lie and never
concatenated into a fresh buffer (reload-free decode; the compiler checks it).

Net and IO names, static shapes and masks are the net contract (`toptpu.backend.contract`,
which the runtime reads too). Masks are additive: 0 where visible, -10000 elsewhere
(`prefill_mask` and `decode_mask` build them for the splitter's example inputs, the runtime
and the tests alike).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    BLOCK_INPUTS,
    BLOCK_KV,
    BLOCK_OUTPUTS,
    EMBEDDING,
    EMBEDDING_CACHE,
    FULL_ATTENTION,
    GREEDY_HEAD,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_INPUTS,
    INPUT_IDS,
    LINEAR_ATTENTION,
    LINEAR_BLOCK_INPUTS,
    LINEAR_CACHE_INPUTS,
    LINEAR_HISTORY_INPUTS,
    LINEAR_OUTPUTS,
    LM_HEAD,
    LOGITS,
    MASK_VALUE,
    ROW_INPUTS,
    ROW_OUTPUTS,
    SAMPLE_HEAD,
    SAMPLE_INPUTS,
    SAMPLE_OUTPUTS,
    TOKEN,
    LinearWidths,
    NetName,
    StaticShapes,
    decode_mask,
    prefill_mask,
    row_name,
    sample_k,
)
from toptpu.dialects.common import QuantMode
from toptpu.errors import ToptpuError
from toptpu.frontends.moe import MoeError, MoeShape, is_moe_block, moe_forward, moe_shape


class SplitError(ToptpuError, ValueError):
    """The model cannot be split into nets as asked (shapes, structure); the message says why."""


@dataclass(frozen=True)
class LlmArch:
    """What the wrappers and the runtime need to know of the model's shape."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    qk_norm: bool
    tied_embeddings: bool
    #: each layer's kind (`contract.LAYER_TYPES`): full attention unless the model says
    layer_types: tuple[str, ...] = ()
    #: the state sizes of the linear-attention layers (None: the model has none)
    linear: LinearWidths | None = None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @classmethod
    def of(cls, model: Any) -> LlmArch:
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        n = int(cfg.num_hidden_layers)
        types = tuple(getattr(cfg, "layer_types", None) or (FULL_ATTENTION,) * n)
        linear = None
        if LINEAR_ATTENTION in types:
            linear = LinearWidths(int(cfg.linear_conv_kernel_dim),
                                  int(cfg.linear_num_key_heads),
                                  int(cfg.linear_num_value_heads),
                                  int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim))
        attn = model.model.layers[types.index(FULL_ATTENTION)].self_attn
        return cls(
            family=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            qk_norm=hasattr(attn, "q_norm"),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            layer_types=types,
            linear=linear,
        )


# =========================================================================== wrappers


def model_apply_rotary(model: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`apply_rotary_pos_emb` of the model's own modeling module."""
    mod = sys.modules[type(model.model.layers[0]).__module__]
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        raise SplitError(
            f"{mod.__name__} has no apply_rotary_pos_emb; toptpu cannot split this model")
    return fn


class TextPositionRotary(torch.nn.Module):
    """A multi-axis (mrope) rotary embedding at text positions: every axis has the same
    position there, so the model's recomposition of the axes' frequencies (an in-place
    interleave, `recomposition_frequencies`) is the identity and cos/sin are those of the
    plain rotary over the model's own `inv_freq` and `attention_scaling`. (Image positions,
    where the axes differ, are Qwen-VL's.)"""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        hf_rotary: Any = rotary  # a transformers rotary: its attributes are the family's
        self.inv_freq: torch.Tensor = hf_rotary.inv_freq
        self.scaling = float(hf_rotary.attention_scaling)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype))


def rotary_axes(rotary: torch.nn.Module) -> torch.Tensor:
    """The axis (0 T, 1 H, 2 W) each rotated frequency pair of a multi-axis rotary takes its
    position from, read off the model's own `recomposition_frequencies` (Qwen3.5's and
    Qwen3-VL's interleave, Qwen2.5-VL's consecutive sections): it recomposes a probe whose
    axis a holds a everywhere."""
    hf_rotary: Any = rotary  # a transformers rotary: its attributes are the family's
    half = int(hf_rotary.inv_freq.shape[0])
    probe = torch.arange(3, dtype=torch.float32)[:, None, None, None].repeat(1, 1, 1, half)
    with torch.no_grad():
        out = hf_rotary.recomposition_frequencies(probe).reshape(-1)
    axis = out[:half].round().long()
    if out.numel() != 2 * half or not torch.equal(out[:half], out[half:]) or \
            not bool(((axis >= 0) & (axis <= 2)).all()) or \
            not torch.equal(axis.float(), out[:half]):
        raise SplitError(f"{type(rotary).__name__}.recomposition_frequencies does not pick one "
                         "axis per frequency pair; toptpu cannot compile its positions")
    return axis


class MultiAxisRotary(torch.nn.Module):
    """A multi-axis (mrope) rotary embedding at positions [3, S] (T, H, W), as Qwen3.5's,
    Qwen3-VL's and Qwen2.5-VL's rotaries compute it: each frequency pair takes its angle
    from one axis, the one the model's `recomposition_frequencies` picks for it
    (`rotary_axes`: Qwen3.5 and Qwen3-VL interleave H and W into T's pairs, Qwen2.5-VL gives
    each axis a consecutive section). Each axis's angles are the model's
    `position * inv_freq` in float32; the pick is by 0/1 weights (`x * 1 + y * 0` is x
    exactly), so cos/sin are the model's bit for bit."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        hf_rotary: Any = rotary  # a transformers rotary: its attributes are the family's
        self.inv_freq: torch.Tensor = hf_rotary.inv_freq
        self.scaling = float(hf_rotary.attention_scaling)
        axis = rotary_axes(rotary)
        # [3, 1, half]; a constant like inv_freq (not a buffer: the export lifts both alike,
        # whether the rotary is the model's or a streaming skeleton's)
        self.pick = torch.nn.functional.one_hot(axis, 3).T.float()[:, None]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [3, S, half]
        freqs = (freqs * self.pick).sum(dim=0, keepdim=True)  # [1, S, half]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype))


def text_rotary(rotary: torch.nn.Module, position_axes: int = 1) -> torch.nn.Module:
    """The model's rotary embedding; for a multi-axis one, its form at text positions
    (`position_axes` 1) or at a position per axis (3)."""
    if not hasattr(rotary, "recomposition_frequencies"):
        if position_axes != 1:
            raise SplitError(f"{type(rotary).__name__} has one position axis; a model whose "
                             "positions have 3 needs a multi-axis (mrope) rotary")
        return rotary
    return MultiAxisRotary(rotary) if position_axes == 3 else TextPositionRotary(rotary)


def layer_moe(layer: Any) -> MoeShape | None:
    """The MoE block of a decoder layer's MLP (`frontends.moe`), None for a dense MLP; a
    SplitError naming what toptpu cannot compile."""
    mlp = layer.mlp
    if not is_moe_block(mlp):
        return None
    try:
        return moe_shape(mlp)
    except MoeError as e:
        raise SplitError(str(e)) from None


def real_rows(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """Which rows of a chunk are real, [1, S] (1.0 real, 0.0 padding: a padded row sees
    no key), from its additive mask [1, 1, S, K]; None for a single row (decode: real).
    keepdim: the reduction over a row's keys keeps the rows on a token axis, so a layer
    group can slice the mask by rows."""
    if hidden.shape[1] == 1:
        return None
    valid = (mask.amax(dim=-1, keepdim=True) > MASK_VALUE / 2).to(hidden.dtype)
    return valid.reshape(1, -1)


def layer_mlp(layer: Any, moe: MoeShape | None, x: torch.Tensor,
              valid: torch.Tensor | None) -> torch.Tensor:
    """The decoder layer's MLP on x: its own module, or its MoE block through the custom
    ops (a padded row routes to no expert)."""
    if moe is None:
        return layer.mlp(x)
    return moe_forward(layer.mlp, moe, x, valid)


class Embedding(torch.nn.Module):
    """input_ids i32 [1, S] -> hidden [1, S, H] (the model's embed_tokens)."""

    def __init__(self, embed_tokens: torch.nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class Block(torch.nn.Module):
    """One decoder layer with explicit KV plumbing: (hidden, position_ids, mask) ->
    (hidden, present_k, present_v), present in the cache layout [1, S, kvH, D].

    The parameter names (`layer.*`) are those of `model.model.layers[i]` after the
    `layer.` prefix: that is how every other layer's weights are found for the same net.
    """

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module,
                 apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 arch: LlmArch) -> None:
        super().__init__()
        hf_layer: Any = layer  # a transformers decoder layer: its submodules are the family's
        self.layer = hf_layer
        self.rotary = rotary
        self.apply_rotary = apply_rotary
        self.head_dim = arch.head_dim
        attn = hf_layer.self_attn
        self.scaling = float(attn.scaling)
        # Qwen3.5's q_proj is twice as wide as the heads: each head's query, then its gate
        self.gated = attn.q_proj.out_features == 2 * arch.num_heads * arch.head_dim
        self.moe = layer_moe(hf_layer)

    def attend(self, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor, history_k: torch.Tensor | None,
               history_v: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, gate = self.rotated(hidden, position_ids)
        present_k, present_v = k.transpose(1, 2), v.transpose(1, 2)
        o = self.attention(q, k, v, present_k, present_v, attention_mask, history_k,
                           history_v)
        valid = real_rows(attention_mask, hidden) if self.moe is not None else None
        return self.output(hidden, o, gate, valid), present_k, present_v

    def rotated(self, hidden: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rotated queries and keys and the values [b, heads, s, D] of `hidden`'s
        tokens, and the output gate (Qwen3.5)."""
        h = self.layer.input_layernorm(hidden)
        q, k, v, gate = self.project(h)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary(hidden, position_ids)
        q, k = self.apply_rotary(q, k, cos, sin)
        return q, k, v, gate

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  present_k: torch.Tensor, present_v: torch.Tensor,
                  attention_mask: torch.Tensor, history_k: torch.Tensor | None,
                  history_v: torch.Tensor | None) -> torch.Tensor:
        """The queries' attention over the history (when given: then over the new k/v in
        the cache layout, `present_*`) and the new k/v."""
        if history_k is not None and history_v is not None:
            # in the cache layout: fuse turns this into attention history operands
            k = torch.cat([history_k, present_k], dim=1).transpose(1, 2)
            v = torch.cat([history_v, present_v], dim=1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                              scale=self.scaling, enable_gqa=True)

    def output(self, hidden: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output from the attention's [b, heads, s, D]: gate, o_proj, the
        residual, the MLP (a MoE block's padded rows, `valid` 0, route nowhere)."""
        layer = self.layer
        b, s, _ = hidden.shape
        o = o.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        h = hidden + layer.self_attn.o_proj(o)
        return h + layer_mlp(layer, self.moe, layer.post_attention_layernorm(h), valid)

    def project(self, h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v [b, s, heads, D] of the normed hidden `h` (q/k normed where the model
        norms them), and the output gate [b, s, heads * D] of a gated attention (Qwen3.5:
        q_proj yields each head's query and gate side by side) or None."""
        attn = self.layer.self_attn
        b, s, _ = h.shape
        shape = (b, s, -1, self.head_dim)
        gate = None
        if self.gated:
            q, gate = torch.chunk(attn.q_proj(h).view(b, s, -1, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(b, s, -1)
        else:
            q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        v = attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v, gate

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attend(hidden, position_ids, attention_mask, None, None)


class BlockWithHistory(Block):
    """`Block` attending to a history KV cache first: prefill_kv and decode."""

    # the ignore below: + history
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,  # type: ignore[override]
                attention_mask: torch.Tensor, history_k: torch.Tensor,
                history_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attend(hidden, position_ids, attention_mask, history_k, history_v)


class BatchBlock(Block):
    """`block_cache` over B conversations at once (`contract.batch_net_io`): their tokens
    are the rows of `hidden` [1, B, H] and go through the norms, projections, rotary and
    MLP together (the weights are read once for all B); each row's query attends to its
    own conversation's cache (`history_k.b`, `history_v.b`) and its own new k/v, under its
    own mask row. Returns the hidden rows and each row's new k/v (`present_k.b`,
    `present_v.b`)."""

    # the ignore below: the single block's history_k/history_v become B caches (*caches)
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,  # type: ignore[override]
                attention_mask: torch.Tensor, *caches: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        q, k, v, gate = self.rotated(hidden, position_ids)
        present_k, present_v = k.transpose(1, 2), v.transpose(1, 2)
        outs, presents = [], []
        for r in range(hidden.shape[1]):
            pk, pv = present_k[:, r:r + 1], present_v[:, r:r + 1]
            outs.append(self.attention(q[:, :, r:r + 1], k, v, pk, pv,
                                       attention_mask[:, :, r:r + 1], caches[2 * r],
                                       caches[2 * r + 1]))
            presents += [pk, pv]
        return (self.output(hidden, torch.cat(outs, dim=2), gate), *presents)


class BatchSampleHead(torch.nn.Module):
    """`sample_head` on B rows, each with its own recent ids and parameters: the rows one
    after the other through `SampleHead` (its penalty gathers a row's own recent ids)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.head = SampleHead(k)

    def forward(self, logits: torch.Tensor, recent_ids: torch.Tensor, penalty: torch.Tensor,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, ids = [], []
        for r in range(logits.shape[0]):
            p, i = self.head(*(x[r:r + 1] for x in (logits, recent_ids, penalty, temperature,
                                                    top_k, top_p)))
            probs.append(p)
            ids.append(i)
        return torch.cat(probs, dim=0), torch.cat(ids, dim=0)


def linear_widths(linear_attn: torch.nn.Module) -> LinearWidths:
    """The state sizes of a Gated DeltaNet module (`Qwen3_5GatedDeltaNet`)."""
    la: Any = linear_attn  # transformers' Gated DeltaNet: its attributes are the family's
    return LinearWidths(int(la.conv_kernel_size), int(la.num_k_heads), int(la.num_v_heads),
                        int(la.head_k_dim), int(la.head_v_dim))


class LinearAttentionBlock(torch.nn.Module):
    """One linear-attention decoder layer (Qwen3.5's Gated DeltaNet) with its state explicit:
    (hidden, attention_mask[, conv_state, recurrent_state]) -> (hidden, new conv state, new
    recurrent state). The model's own projections, conv weights, `A_log`/`dt_bias`, gated
    norm, MLP and norms; the conv and the delta rule are the two fused ops of
    `toptpu.frontends.linear_attention_ops` (the model's `causal_conv1d_update` and
    `torch_recurrent_gated_delta_rule`, one node each, state in and out).

    The mask only says which tokens of the chunk are real (a row that sees some key): a
    padded token gets g = 0 and beta = 0, so it leaves the recurrent state exactly as it was,
    and the conv state is taken after the last real token. Decode (`cached`) feeds one real
    token and no mask."""

    def __init__(self, layer: torch.nn.Module, widths: LinearWidths, history: bool = False,
                 cached: bool = False) -> None:
        super().__init__()
        self.layer: Any = layer  # a transformers decoder layer: its submodules are the family's
        self.w = widths
        self.history = history or cached
        self.cached = cached
        self.moe = layer_moe(layer)
        mod = sys.modules[type(layer.linear_attn).__module__]
        l2norm, act = getattr(mod, "l2norm", None), getattr(mod, "ACT2FN", None)
        if l2norm is None or act is None:
            raise SplitError(f"{mod.__name__} has no l2norm/ACT2FN; toptpu cannot split this "
                             "linear-attention layer")
        self.l2norm: Callable[..., torch.Tensor] = l2norm
        self.act: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = act

    def mix(self, hidden: torch.Tensor, valid: torch.Tensor, conv_state: torch.Tensor | None,
            recurrent_state: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from toptpu.frontends import linear_attention_ops as ops

        layer, la, w = self.layer, self.layer.linear_attn, self.w
        b, s, _ = hidden.shape
        residual = hidden
        h = layer.input_layernorm(hidden)
        qkv = la.in_proj_qkv(h)  # [1, s, conv_dim]
        z = la.in_proj_z(h).reshape(b, s, -1, w.head_v_dim)
        beta = la.in_proj_b(h).sigmoid()
        g = -la.A_log.float().exp() * F.softplus(la.in_proj_a(h).float() + la.dt_bias)
        g, beta = g * valid[..., None], beta * valid[..., None]
        y, conv_out = ops.causal_conv1d(qkv, la.conv1d.weight.squeeze(1), conv_state, valid)
        y = self.act[la.activation](y)
        key_dim = w.num_k_heads * w.head_k_dim
        q, k, v = torch.split(y, [key_dim, key_dim, w.num_v_heads * w.head_v_dim], dim=-1)
        q = self.l2norm(q.reshape(b, s, -1, w.head_k_dim).float(), dim=-1, eps=1e-6)
        k = self.l2norm(k.reshape(b, s, -1, w.head_k_dim).float(), dim=-1, eps=1e-6)
        v = v.reshape(b, s, -1, w.head_v_dim)
        o, state_out = ops.gated_delta_rule(q, k, v, g, beta, recurrent_state,
                                            float(w.head_k_dim ** -0.5))
        o = la.norm(o.reshape(-1, w.head_v_dim), z.reshape(-1, w.head_v_dim))
        h = residual + la.out_proj(o.reshape(b, s, -1))
        h = h + layer_mlp(layer, self.moe, layer.post_attention_layernorm(h),
                          None if s == 1 else valid)
        return h, conv_out, state_out

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cached:  # hidden, conv_state, recurrent_state: one real token
            return self.mix(hidden, hidden.new_ones(1, hidden.shape[1]), *rest)
        mask, state = rest[0], rest[1:] if self.history else (None, None)
        # keepdim: the reduction over a row's keys keeps the rows on a token axis, so a
        # layer group can slice the mask ([1, 1, L, Hh+L]) by rows
        valid = (mask.amax(dim=-1, keepdim=True) > MASK_VALUE / 2).to(hidden.dtype)
        valid = valid.reshape(1, -1)
        return self.mix(hidden, valid, *state)


class LmHead(torch.nn.Module):
    """hidden [1, H] -> final norm -> lm_head -> logits [1, V]."""

    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class GreedyHead(torch.nn.Module):
    """logits [1, V] -> the top-1 id i32 [1, 1] (ties: the lowest id, like numpy's argmax)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.argmax(logits.float(), dim=-1, keepdim=True).to(torch.int32)


#: what `sample_head` writes over a removed candidate's scaled logit (finite: the IR keeps
#: constants as text; exp of it minus any kept logit is 0 in f32, as exp(-inf) is)
REMOVED = float(torch.finfo(torch.float32).min)
_ABOVE_ALL = float(torch.finfo(torch.float32).max)


class SampleHead(torch.nn.Module):
    """The host sampler (`toptpu.backend.runtime.runtime.sample_token`) on the chip, on the
    K best candidates: repetition penalty on the recent ids (logit / p if positive, * p if
    not), temperature, top-k (the k-th largest value and all equal to it stay, as the host
    keeps ties), top-p (a candidate stays while the probability before it, in descending
    order, is below top_p; top_p >= 1 keeps all), then the probabilities of what stays.
    Returns (probs f32 [1, K], token_ids i32 [1, K]), candidates in descending order."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, logits: torch.Tensor, recent_ids: torch.Tensor, penalty: torch.Tensor,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.float()
        seen = x.index_select(1, recent_ids.reshape(-1))
        seen = torch.where(seen > 0, seen / penalty, seen * penalty)
        x = x.scatter(1, recent_ids.long(), seen) / temperature
        values, ids = torch.topk(x, self.k, dim=1)
        rank = torch.arange(self.k, dtype=torch.int32)[None]
        kth = values.masked_fill(rank >= top_k, _ABOVE_ALL).amin(dim=1, keepdim=True)
        values = values.masked_fill(values < kth, REMOVED)
        p = values.softmax(dim=1)
        before = (p.cumsum(dim=1) - p).masked_fill(top_p >= 1.0, 0.0)
        values = values.masked_fill(before >= top_p, REMOVED)
        return values.softmax(dim=1), ids.to(torch.int32)


# =========================================================================== nets


@dataclass
class NetSpec:
    """One net to export: its module, example inputs at the static shapes, IO names; a
    net that compiles in a mode of its own names it (`mode`, None: the model's) and
    whether its float inputs keep their exported types (`keep_input_types`)."""

    name: str
    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    per_layer: bool
    mode: QuantMode | None = None
    keep_input_types: bool = False


#: the prefix of a per-layer net's parameters (`Block.layer`)
LAYER_PREFIX = "layer."
#: the weight-name prefix of a layer variant's nets ("v3." for the variant of layer 3)
_VARIANT = re.compile(r"v\d+\.")


def layer_key(source: str) -> str | None:
    """'layer.self_attn.q_proj.weight' (or 'v3.layer.…' in a layer variant's nets) ->
    'self_attn.q_proj.weight'; None for a weight that is not per layer."""
    m = _VARIANT.match(source)
    rest = source[m.end():] if m else source
    return rest[len(LAYER_PREFIX):] if rest.startswith(LAYER_PREFIX) else None


#: torch dtype of the activations of each activation type name (`QuantMode.activation`)
TORCH_ACTIVATIONS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def split_model(model: Any, shapes: StaticShapes, layer: int = 0, act: str = "f32",
                position_axes: int = 1, batch: int = 1) -> list[NetSpec]:
    """The nets of `model` (a transformers causal LM, float32, eval) at `shapes`.

    Per-layer nets wrap layer `layer` (0 by default); every layer binds its own weights to
    the same nets. `act` is the activation type the model compiles in (the heads take
    their logits in it). `position_axes` 3: the full-attention nets take a position per
    rotary axis (T, H, W; `MultiAxisRotary`), as a VLM that lays out its image tokens on
    the axes needs (MiniCPM-V 4.7).
    """
    if act not in TORCH_ACTIVATIONS:
        raise SplitError(f"unknown activation type '{act}' ({', '.join(TORCH_ACTIVATIONS)})")
    arch = LlmArch.of(model)
    inner = model.model
    seq, L, Hh = shapes.seq_length, shapes.max_input_length, shapes.max_history
    H, kvh, D = arch.hidden_size, arch.num_kv_heads, arch.head_dim
    apply_rotary = model_apply_rotary(model)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def pos(n: int, start: int = 0) -> torch.Tensor:
        text = torch.arange(start, start + n, dtype=torch.int32)[None]
        if position_axes == 1:
            return text
        # axes apart, as an image's tokens are: rows and columns of a grid from the start
        grid = torch.arange(n, dtype=torch.int32)
        return torch.cat([text, (start + grid // 3)[None], (start + grid % 3 + 5)[None]])

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, arch.vocab_size, (1, n), generator=g, dtype=torch.int32)

    lm_head = model.get_output_embeddings()
    kind = arch.layer_type(layer)
    if kind == LINEAR_ATTENTION:
        assert arch.linear is not None
        lay = inner.layers[layer]
        linear_block = LinearAttentionBlock(lay, arch.linear).eval()
        linear_history = LinearAttentionBlock(lay, arch.linear, history=True).eval()
    else:
        rotary = text_rotary(inner.rotary_emb, position_axes)
        block = Block(inner.layers[layer], rotary, apply_rotary, arch).eval()
        block_h = BlockWithHistory(inner.layers[layer], rotary, apply_rotary, arch).eval()
    embedding = Embedding(inner.embed_tokens)

    def prefill(L: int) -> list[NetSpec]:
        """The prefill nets at chunk length L: embedding, block, block_kv."""
        mask_kv = torch.from_numpy(prefill_mask(L, L, Hh, Hh))
        emb = NetSpec(shapes.prefill_net(EMBEDDING, L), embedding, (ids(L),), [INPUT_IDS],
                      [HIDDEN], False)
        name_b, name_kv = shapes.prefill_net(BLOCK, L), shapes.prefill_net(BLOCK_KV, L)
        if kind == LINEAR_ATTENTION:
            outs = list(LINEAR_OUTPUTS)
            return [emb,
                    NetSpec(name_b, linear_block,
                            (rand(1, L, H), torch.from_numpy(prefill_mask(L, L))),
                            list(LINEAR_BLOCK_INPUTS), outs, True),
                    NetSpec(name_kv, linear_history, (rand(1, L, H), mask_kv, *state()),
                            list(LINEAR_HISTORY_INPUTS), outs, True)]
        outs = list(BLOCK_OUTPUTS)
        return [emb,
                NetSpec(name_b, block,
                        (rand(1, L, H), pos(L), torch.from_numpy(prefill_mask(L, L))),
                        list(BLOCK_INPUTS), outs, True),
                NetSpec(name_kv, block_h,
                        (rand(1, L, H), pos(L, Hh), mask_kv, rand(1, Hh, kvh, D),
                         rand(1, Hh, kvh, D)),
                        list(HISTORY_INPUTS), outs, True)]

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        w = arch.linear
        assert w is not None
        return (rand(1, w.conv_kernel - 1, w.conv_dim),
                rand(1, w.num_v_heads, w.head_k_dim, w.head_v_dim) * 0.1)

    if kind == LINEAR_ATTENTION:
        assert arch.linear is not None
        cache = NetSpec(BLOCK_CACHE,
                        LinearAttentionBlock(inner.layers[layer], arch.linear,
                                             cached=True).eval(),
                        (rand(1, 1, H), *state()), list(LINEAR_CACHE_INPUTS),
                        list(LINEAR_OUTPUTS), True)
    else:
        cache = NetSpec(BLOCK_CACHE, block_h,
                        (rand(1, 1, H), pos(1, seq - 1),
                         torch.from_numpy(decode_mask(seq - 1, seq)), rand(1, seq, kvh, D),
                         rand(1, seq, kvh, D)),
                        list(HISTORY_INPUTS), list(BLOCK_OUTPUTS), True)
    emb_L, block_L, block_kv_L = prefill(L)
    lm = LmHead(inner.norm, lm_head)
    batched: list[NetSpec] = []
    if batch > 1:
        if kind == LINEAR_ATTENTION:
            raise SplitError("a linear-attention layer has no batch decode net yet; "
                             "compile this model without --batch")
        B = batch
        rows = [seq - 1 - b % seq for b in range(B)]  # each row at a position of its own
        mask = torch.from_numpy(np.concatenate([decode_mask(p, seq) for p in rows], axis=2))
        batch_pos = torch.cat([pos(1, p) for p in rows], dim=1)
        caches = tuple(rand(1, seq, kvh, D) for _ in range(2 * B))
        block_b = BatchBlock(inner.layers[layer], rotary, apply_rotary, arch).eval()
        batched = [
            NetSpec(str(NetName(EMBEDDING_CACHE, batch=B)), embedding, (ids(B),), [INPUT_IDS],
                    [HIDDEN], False),
            NetSpec(str(NetName(BLOCK_CACHE, batch=B)), block_b,
                    (rand(1, B, H), batch_pos, mask, *caches),
                    [*BLOCK_INPUTS, *(row_name(n, b) for b in range(B) for n in ROW_INPUTS)],
                    [HIDDEN_OUT, *(row_name(n, b) for b in range(B) for n in ROW_OUTPUTS)],
                    True),
            NetSpec(str(NetName(LM_HEAD, batch=B)), lm, (rand(B, H),), [HIDDEN], [LOGITS],
                    False),
            *head_specs(arch.vocab_size, seq, act, B),
        ]
    return [
        emb_L,
        NetSpec(EMBEDDING_CACHE, embedding, (ids(1),), [INPUT_IDS], [HIDDEN], False),
        block_L, block_kv_L, cache,
        NetSpec(LM_HEAD, lm, (rand(1, H),), [HIDDEN], [LOGITS], False),
        *head_specs(arch.vocab_size, seq, act),
        # the prefill nets at the shorter chunk lengths share every weight with those at L
        *(spec for length in shapes.shorter_lengths for spec in prefill(length)),
        *batched,
    ]


def head_specs(vocab_size: int, seq_length: int, act: str = "f32", batch: int = 1
               ) -> list[NetSpec]:
    """`greedy_head` and `sample_head` for a vocabulary, a KV capacity (the recent ids the
    penalty sees) and the activation type of the logits; they compile in f32. `batch` B
    >= 2: the heads of the batch nets, on B rows (`greedy_head.bB`, `sample_head.bB`)."""
    g = torch.Generator().manual_seed(0)
    n = batch
    logits = torch.randn(n, vocab_size, generator=g).to(TORCH_ACTIVATIONS[act])
    recent = torch.randint(0, vocab_size, (n, seq_length), generator=g, dtype=torch.int32)
    scalars = (torch.full((n, 1), 1.1), torch.full((n, 1), 0.7),
               torch.full((n, 1), 5, dtype=torch.int32), torch.full((n, 1), 0.9))
    k = sample_k(vocab_size)
    name = {h: h if batch == 1 else str(NetName(h, batch=batch))
            for h in (GREEDY_HEAD, SAMPLE_HEAD)}
    return [
        NetSpec(name[GREEDY_HEAD], GreedyHead(), (logits,), [LOGITS], [TOKEN], False,
                mode=QuantMode.F32, keep_input_types=True),
        NetSpec(name[SAMPLE_HEAD], SampleHead(k) if batch == 1 else BatchSampleHead(k),
                (logits, recent, *scalars), list(SAMPLE_INPUTS), list(SAMPLE_OUTPUTS), False,
                mode=QuantMode.F32, keep_input_types=True),
    ]


def _non_finite_cause(model: Any, layer: Any) -> str:
    """Why the first decoder layer computes NaN or infinity: its non-finite weights (named),
    else the config values it depends on."""
    bad = [f"model.layers.0.{name}" for name, p in layer.named_parameters()
           if not p.is_meta and not bool(torch.isfinite(p).all())]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        return (f"the checkpoint's weights are not finite (NaN or infinity in {shown}): the "
                "checkpoint is damaged; re-download or re-export it")
    cfg = model.config
    return (f"the first {type(layer).__name__} computes NaN or infinity from finite weights "
            f"(rms_norm_eps {getattr(cfg, 'rms_norm_eps', None)}, hidden "
            f"{getattr(cfg, 'hidden_size', None)}): check config.json and the weights' "
            "magnitudes")


def check_block_matches_model(model: Any, spec: NetSpec, atol: float = 1e-4,
                              layer_index: int = 0) -> None:
    """The `block` wrapper of layer `layer_index` must compute what the model's own decoder
    layer computes (catches a family whose layer structure the wrapper does not follow)."""
    layer = model.model.layers[layer_index]
    if isinstance(spec.module, LinearAttentionBlock):
        hidden, mask = spec.args
        position_ids = torch.arange(hidden.shape[1], dtype=torch.int32)[None]
    else:
        hidden, position_ids, mask = spec.args
    text_positions = position_ids[:1].long()
    # a position per axis: the model's rotary takes them as [axes, batch, S]
    rotary_positions = position_ids.long() if position_ids.shape[0] == 1 else \
        position_ids.long()[:, None, :]
    prev = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            pe = model.model.rotary_emb(hidden, rotary_positions)
            linear = isinstance(spec.module, LinearAttentionBlock)  # all its tokens real
            ref = layer(hidden, attention_mask=None if linear else mask,
                        position_ids=text_positions,
                        position_embeddings=pe)
            ref = ref[0] if isinstance(ref, tuple) else ref
            ours = spec.module(*spec.args)[0]
    finally:
        model.config._attn_implementation = prev
    if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(ours).all())):
        raise SplitError(_non_finite_cause(model, layer))
    err = float((ours - ref).abs().max())
    if not err <= atol * max(1.0, float(ref.abs().max())):
        raise SplitError(
            f"the block wrapper differs from {type(layer).__name__} by {err:.3g}: this "
            f"{model.config.model_type} layer does not have the structure toptpu's splitter "
            "expects (pre-norm attention + MLP with q/k/v/o projections)")
