"""The LLM splitter: a causal LM cut into the static nets of the net contract
(`toptpu.backend.contract`; ARCHITECTURE.md, "The net contract").

Each net is a small `nn.Module` wrapper around the Hugging Face model's *own* submodules —
its embedding, norms, q/k/v/o projections, q/k norms (Qwen3), MLP, rotary embedding (with
its scaling, e.g. Llama 3's) and the `apply_rotary_pos_emb` of the model's modeling
module. The wrappers only make the KV plumbing explicit: history tensors in, present
tensors out. Each is exported with `torch.export` at static shapes:

- `embedding`: `input_ids` i32 [1, L] -> `hidden` [1, L, H]
- `embedding_cache`: `input_ids` i32 [1, 1] -> `hidden` [1, 1, H]
- `block` (prefill): `hidden` [1, L, H], `position_ids` i32 [1, L], `attention_mask`
  [1, 1, L, L] -> `hidden_out` [1, L, H], `present_k`/`present_v` [1, L, kvH, D]
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    GREEDY_HEAD,
    HIDDEN,
    HISTORY_INPUTS,
    INPUT_IDS,
    LM_HEAD,
    LOGITS,
    SAMPLE_HEAD,
    SAMPLE_INPUTS,
    SAMPLE_OUTPUTS,
    TOKEN,
    StaticShapes,
    decode_mask,
    prefill_mask,
    sample_k,
)
from toptpu.errors import ToptpuError


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

    @classmethod
    def of(cls, model: Any) -> LlmArch:
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        attn = model.model.layers[0].self_attn
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
        )


# =========================================================================== wrappers


def model_apply_rotary(model: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`apply_rotary_pos_emb` of the model's own modeling module."""
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        raise SplitError(
            f"{mod.__name__} has no apply_rotary_pos_emb; toptpu cannot split this model")
    return fn


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
        self.layer = layer
        self.rotary = rotary
        self.apply_rotary = apply_rotary
        self.head_dim = arch.head_dim
        self.scaling = float(layer.self_attn.scaling)

    def attend(self, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor, history_k: torch.Tensor | None,
               history_v: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer, attn = self.layer, self.layer.self_attn
        b, s, _ = hidden.shape
        residual = hidden
        h = layer.input_layernorm(hidden)
        shape = (b, s, -1, self.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        v = attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary(hidden, position_ids)
        q, k = self.apply_rotary(q, k, cos, sin)
        present_k, present_v = k.transpose(1, 2), v.transpose(1, 2)
        if history_k is not None and history_v is not None:
            # in the cache layout: fuse turns this into attention history operands
            k = torch.cat([history_k, present_k], dim=1).transpose(1, 2)
            v = torch.cat([history_v, present_v], dim=1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                           scale=self.scaling, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b, s, -1)
        h = residual + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, present_k, present_v

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attend(hidden, position_ids, attention_mask, None, None)


class BlockWithHistory(Block):
    """`Block` attending to a history KV cache first: prefill_kv and decode."""

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,  # type: ignore[override]
                attention_mask: torch.Tensor, history_k: torch.Tensor,
                history_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attend(hidden, position_ids, attention_mask, history_k, history_v)


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
    mode: str | None = None
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


def split_model(model: Any, shapes: StaticShapes, layer: int = 0, act: str = "f32"
                ) -> list[NetSpec]:
    """The nets of `model` (a transformers causal LM, float32, eval) at `shapes`.

    Per-layer nets wrap layer `layer` (0 by default); every layer binds its own weights to
    the same nets. `act` is the activation type the model compiles in (the heads take
    their logits in it).
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
        return torch.arange(start, start + n, dtype=torch.int32)[None]

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, arch.vocab_size, (1, n), generator=g, dtype=torch.int32)

    block = Block(inner.layers[layer], inner.rotary_emb, apply_rotary, arch).eval()
    block_h = BlockWithHistory(inner.layers[layer], inner.rotary_emb, apply_rotary, arch).eval()
    io_block, io_hist, outs = list(BLOCK_INPUTS), list(HISTORY_INPUTS), list(BLOCK_OUTPUTS)
    lm_head = model.get_output_embeddings()
    return [
        NetSpec(EMBEDDING, Embedding(inner.embed_tokens), (ids(L),), [INPUT_IDS], [HIDDEN],
                False),
        NetSpec(EMBEDDING_CACHE, Embedding(inner.embed_tokens), (ids(1),), [INPUT_IDS],
                [HIDDEN], False),
        NetSpec(BLOCK, block,
                (rand(1, L, H), pos(L), torch.from_numpy(prefill_mask(L, L))),
                io_block, outs, True),
        NetSpec(BLOCK_KV, block_h,
                (rand(1, L, H), pos(L, Hh), torch.from_numpy(prefill_mask(L, L, Hh, Hh)),
                 rand(1, Hh, kvh, D), rand(1, Hh, kvh, D)),
                io_hist, outs, True),
        NetSpec(BLOCK_CACHE, block_h,
                (rand(1, 1, H), pos(1, seq - 1), torch.from_numpy(decode_mask(seq - 1, seq)),
                 rand(1, seq, kvh, D), rand(1, seq, kvh, D)),
                io_hist, outs, True),
        NetSpec(LM_HEAD, LmHead(inner.norm, lm_head), (rand(1, H),), [HIDDEN], [LOGITS],
                False),
        *head_specs(arch.vocab_size, seq, act),
    ]


def head_specs(vocab_size: int, seq_length: int, act: str = "f32") -> list[NetSpec]:
    """`greedy_head` and `sample_head` for a vocabulary, a KV capacity (the recent ids the
    penalty sees) and the activation type of the logits; they compile in f32."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab_size, generator=g).to(TORCH_ACTIVATIONS[act])
    recent = torch.randint(0, vocab_size, (1, seq_length), generator=g, dtype=torch.int32)
    scalars = (torch.tensor([[1.1]]), torch.tensor([[0.7]]), torch.tensor([[5]], dtype=torch.int32),
               torch.tensor([[0.9]]))
    return [
        NetSpec(GREEDY_HEAD, GreedyHead(), (logits,), [LOGITS], [TOKEN], False, mode="f32",
                keep_input_types=True),
        NetSpec(SAMPLE_HEAD, SampleHead(sample_k(vocab_size)), (logits, recent, *scalars),
                list(SAMPLE_INPUTS), list(SAMPLE_OUTPUTS), False, mode="f32",
                keep_input_types=True),
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


def check_block_matches_model(model: Any, spec: NetSpec, atol: float = 1e-4) -> None:
    """The `block` wrapper must compute what the model's own decoder layer computes
    (catches a family whose layer structure the wrapper does not follow)."""
    layer = model.model.layers[0]
    hidden, position_ids, mask = spec.args
    prev = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            pe = model.model.rotary_emb(hidden, position_ids.long())
            ref = layer(hidden, attention_mask=mask, position_ids=position_ids.long(),
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
