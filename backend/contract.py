"""The net contract: what the compiler builds, the model file records and the runtime runs.

Compiler (`toptpu.compiler`), frontends (the LLM splitter, the VLM wrappers) and runtime
(`toptpu.backend.runtime`) all import this one module, and nothing here imports them: it
needs numpy alone (no torch, no xDSL), so the runtime can depend on it without pulling in
the compiler. It fixes (ARCHITECTURE.md, "The net contract"):

- the net names (`TEXT_NETS`, `PER_LAYER_NETS`, `HEAD_NETS`, `VISION_NET`), the prefill
  nets at shorter chunk lengths (`PREFILL_NETS`, `block:16`) and the per-layer variants of
  a layer of another kind or quantization than layer 0 (`block@3`, `block:16@3`:
  `NetName`);
- the IO names and, at given static shapes (`StaticShapes`, with the prefill chunk lengths
  and `chunk_length`, the shortest that holds a chunk), the exact IO of every text net
  (`net_io`);
- the additive attention masks (`prefill_mask`, `decode_mask`);
- the text positions of a model whose rotary has several axes and whose VLM lays them out
  per axis (MiniCPM-V 4.7's canvas M-RoPE: `canvas_position_ids`);
- the files a model file carries besides its nets (`TOKENIZER_FILES`; the vision families
  are `toptpu.families`'s);
- the host-side packing of MiniCPM-V image slices into the static `vit` net (`pack_slice`);
- the JSON every file header we read is held to (`parse_strict_json`: model files, the
  safetensors shards and their index);
- which files of a model directory may be read (`model_file_path`, `read_model_file`,
  `check_model_dir_files`: regular files inside the directory, never a link out of it, a
  FIFO or a device).

The model file header that records all this is the file format's
(`toptpu.backend.formats.llm_file.LlmHeader`): it checks each net's IO against `net_io`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from toptpu.errors import ToptpuError


class ContractError(ToptpuError, ValueError):
    """A request the net contract cannot meet (shapes, net names); the message says why."""


# =========================================================================== tensors


@dataclass(frozen=True)
class TensorSpec:
    """A net input or output: name, static shape, numpy dtype name (e.g. 'bfloat16')."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class NetInfo:
    """A compiled net's interface."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    per_layer: bool  # True when every layer binds its own weights to this net


# =========================================================================== net names

EMBEDDING = "embedding"
EMBEDDING_CACHE = "embedding_cache"
BLOCK = "block"
BLOCK_KV = "block_kv"
BLOCK_CACHE = "block_cache"
LM_HEAD = "lm_head"
GREEDY_HEAD = "greedy_head"
SAMPLE_HEAD = "sample_head"
#: the nets of every LLM model file, in the order the compiler emits them
TEXT_NETS = (EMBEDDING, EMBEDDING_CACHE, BLOCK, BLOCK_KV, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD,
             SAMPLE_HEAD)
#: the nets that run once per layer (each layer binds its own weights)
PER_LAYER_NETS = (BLOCK, BLOCK_KV, BLOCK_CACHE)
#: the nets that choose the next token from the lm_head's logits on the chip (LLM-TPU's
#: greedy_head and sample_head); they compute in f32 whatever the activation type
HEAD_NETS = (GREEDY_HEAD, SAMPLE_HEAD)
#: how many candidates `sample_head` keeps (LLM-TPU's top-k of its sampling head); a
#: vocabulary smaller than that keeps all (`sample_k`)
SAMPLE_TOP_K = 50
#: the nets that read the KV cache in place (their attention takes history operands)
HISTORY_NETS = (BLOCK_KV, BLOCK_CACHE)
#: the vision net of a VLM model file
VISION_NET = "vit"
#: Qwen3-VL's DeepStack: `hidden` [1, L, H] + `deepstack` [1, L, H] -> `hidden_out`, run
#: after each of the first text layers (one per DeepStack level) of a prefill chunk that
#: holds image tokens, with that level's vision rows at their positions and zeros elsewhere
#: (LLM-TPU's `add` net; `deepstack_embeds` of the `vit` net)
DEEPSTACK_NET = "deepstack_add"
#: every net name a model file may hold, besides per-layer variants
KNOWN_NETS = (*TEXT_NETS, VISION_NET, DEEPSTACK_NET)


#: the nets compiled at every prefill chunk length (`StaticShapes.prefill_lengths`): the
#: prompt's embedding and the prefill blocks; the runtime runs a chunk of n tokens through
#: the shortest that holds n
PREFILL_NETS = (EMBEDDING, BLOCK, BLOCK_KV)


#: the nets compiled at a batch B besides at 1 (`toptpu compile --batch B`): a decode step
#: of B conversations at once, each with its own KV cache (`<net>.b<B>`: `block_cache.b4`)
BATCH_NETS = (EMBEDDING_CACHE, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD, SAMPLE_HEAD)


def _decimal(text: str) -> int | None:
    """A positive decimal number without leading zeros (at most 9 digits), else None."""
    if text.isascii() and text.isdigit() and len(text) < 10 and str(int(text)) == text \
            and int(text) > 0:
        return int(text)
    return None


@dataclass(frozen=True)
class NetName:
    """A net's name: a known net; a prefill net at a shorter chunk length
    `<prefill net>:<length>` (`block:16`: `block` compiled for chunks of 16 tokens; the
    net without a length is the one at `max_input_length`); a decode net at a batch
    `<batch net>.b<B>` (`block_cache.b4`: a decode step of 4 conversations; `BATCH_NETS`);
    and a variant `<per-layer net>[:<length>|.b<B>]@<layer>` compiled for the layers (from
    `layer` on) whose kind or checkpoint quantization differs from layer 0's."""

    base: str
    layer: int = 0  # 0: the net every layer runs unless it has a variant
    length: int = 0  # 0: at max_input_length; else a shorter prefill chunk length
    batch: int = 0  # 0: one conversation; else the batch B >= 2 of a batch net

    @classmethod
    def parse(cls, name: str) -> NetName:
        """`block:16@3` -> NetName('block', 3, 16); `block_cache.b4` ->
        NetName('block_cache', batch=4); `lm_head` -> NetName('lm_head'). ContractError for
        anything else (an unknown net, a variant of a net that is not per-layer, a length
        of a net that is not a prefill net, a batch of a net that is not a batch net or
        below 2, a layer, length or batch that is not a positive decimal number without
        leading zeros)."""
        head, at, layer_text = name.partition("@")
        head, dot, batch_text = head.partition(".b")
        base, colon, length_text = head.partition(":")
        layer = _decimal(layer_text) if at else 0
        length = _decimal(length_text) if colon else 0
        batch = _decimal(batch_text) if dot else 0
        ok = (base in KNOWN_NETS and layer is not None and length is not None
              and batch is not None and (not at or base in PER_LAYER_NETS)
              and (not colon or base in PREFILL_NETS)
              and (not dot or (base in BATCH_NETS and batch >= 2)))
        if ok:
            return cls(base, layer or 0, length or 0, batch or 0)
        raise ContractError(f"'{name}' is not a net name (nets: {', '.join(KNOWN_NETS)}, "
                            "<prefill net>:<length>, <batch net>.b<B>, or <per-layer net>"
                            "[:<length>|.b<B>]@<layer>)")

    @property
    def is_variant(self) -> bool:
        return self.layer > 0

    def at_length(self, length: int) -> NetName:
        """This net compiled for chunks of `length` (0: at max_input_length)."""
        return NetName(self.base, self.layer, length, self.batch)

    def at_layer(self, layer: int) -> NetName:
        """This net as layer `layer`'s variant (0: the net of layer 0's kind)."""
        return NetName(self.base, layer, self.length, self.batch)

    def at_batch(self, batch: int) -> NetName:
        """This net compiled for a batch of `batch` conversations (0: one)."""
        return NetName(self.base, self.layer, self.length, batch)

    @property
    def layer_net(self) -> NetName:
        """The net `layer_nets` names for the layers that run this one (`block@3` for
        `block:16@3` and `block_cache.b4@3`)."""
        return NetName(self.base, self.layer)

    def __str__(self) -> str:
        name = f"{self.base}:{self.length}" if self.length else self.base
        name = f"{name}.b{self.batch}" if self.batch else name
        return f"{name}@{self.layer}" if self.layer else name


# =========================================================================== IO names

INPUT_IDS = "input_ids"
HIDDEN = "hidden"
HIDDEN_OUT = "hidden_out"  # the block nets' output: a net's IO names are unique
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
HISTORY_K = "history_k"
HISTORY_V = "history_v"
PRESENT_K = "present_k"
PRESENT_V = "present_v"
TOKEN = "token"
LOGITS = "logits"
RECENT_IDS = "recent_ids"
PENALTY = "penalty"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
PROBS = "probs"
TOKEN_IDS = "token_ids"
PIXEL_VALUES = "pixel_values"
POSITION_IDS_VIT = "position_ids_vit"
IMAGE_EMBEDS = "image_embeds"
#: Qwen-VL `vit` inputs besides pixel_values / position_ids_vit / attention_mask: the key
#: mask of the window-attention layers (Qwen2.5-VL), the taps and weights of the learned
#: position embedding interpolated to the image's grid (Qwen3-VL, Qwen3.5); and outputs:
#: the DeepStack levels' rows (Qwen3-VL)
WINDOW_MASK = "window_mask"
INTERP_INDICES = "interp_indices"
INTERP_WEIGHTS = "interp_weights"
DEEPSTACK_EMBEDS = "deepstack_embeds"
DEEPSTACK = "deepstack"

#: the inputs of `block`; `block_kv` and `block_cache` add the history (`HISTORY_INPUTS`).
#: `position_ids` is i32 [A, n]: A = 1 (a text position per token), or A = 3 for a model
#: whose rotary has a position per axis (T, H, W) and whose VLM lays them out per axis
#: (MiniCPM-V 4.7: `canvas_position_ids`)
BLOCK_INPUTS = (HIDDEN, POSITION_IDS, ATTENTION_MASK)
#: the position axes of the full-attention nets: text, or (T, H, W)
POSITION_AXES = (1, 3)
HISTORY_INPUTS = (*BLOCK_INPUTS, HISTORY_K, HISTORY_V)
BLOCK_OUTPUTS = (HIDDEN_OUT, PRESENT_K, PRESENT_V)

#: the per-layer state of a linear-attention layer (Qwen3.5's Gated DeltaNet), in place of a
#: KV cache: the causal conv's last inputs [1, K-1, conv_dim] (sequence-major, activation
#: type) and the delta rule's recurrent state [1, Hv, Dk, Dv] (float32 in every mode)
CONV_STATE = "conv_state"
RECURRENT_STATE = "recurrent_state"
PRESENT_CONV_STATE = "present_conv_state"
PRESENT_RECURRENT_STATE = "present_recurrent_state"
#: the inputs of a linear-attention layer's nets: `block` starts from a zero state (its mask
#: says which tokens of the chunk are real), `block_kv` from the carried one, `block_cache`
#: (one token, always real) updates it; all three return the new state
LINEAR_BLOCK_INPUTS = (HIDDEN, ATTENTION_MASK)
LINEAR_HISTORY_INPUTS = (HIDDEN, ATTENTION_MASK, CONV_STATE, RECURRENT_STATE)
LINEAR_CACHE_INPUTS = (HIDDEN, CONV_STATE, RECURRENT_STATE)
LINEAR_OUTPUTS = (HIDDEN_OUT, PRESENT_CONV_STATE, PRESENT_RECURRENT_STATE)
#: the state outputs and the inputs each is written over in place (the runtime binds both to
#: one buffer; the compiler checks that each state is read by the op that writes it)
STATE_IN_PLACE = {PRESENT_CONV_STATE: CONV_STATE, PRESENT_RECURRENT_STATE: RECURRENT_STATE}

#: layer kinds (HF's `layer_types`): softmax attention with a KV cache, or linear attention
#: with a fixed-size state
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
#: the inputs of `sample_head` after the logits: the recent token ids the repetition
#: penalty looks at (the last SEQ slots; unused slots repeat a used one), the penalty, the
#: temperature, the top-k (1..sample_k) and the top-p (in (0, 1]; 1 keeps all)
SAMPLE_INPUTS = (LOGITS, RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P)
SAMPLE_OUTPUTS = (PROBS, TOKEN_IDS)


def sample_k(vocab_size: int) -> int:
    """How many candidates `sample_head` returns for a vocabulary of `vocab_size`."""
    return min(SAMPLE_TOP_K, vocab_size)


# =========================================================================== static shapes


@dataclass(frozen=True)
class StaticShapes:
    """The compiled static shapes: KV capacity SEQ, prefill chunk L, prefill history Hh,
    and the chunk lengths the prefill nets are compiled at (`prefill_lengths`: ascending,
    the last is L; a file made with one length has just (L,))."""

    seq_length: int
    max_input_length: int
    max_history: int
    prefill_lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prefill_lengths:  # one chunk length: L
            object.__setattr__(self, "prefill_lengths", (self.max_input_length,))
        else:
            object.__setattr__(self, "prefill_lengths", tuple(self.prefill_lengths))

    @classmethod
    def make(cls, seq_length: int, max_input_length: int | None = None,
             max_history: int | None = None,
             prefill_lengths: Sequence[int] | None = None) -> StaticShapes:
        """Fill the defaults (L = min(SEQ, 128), or the largest of `prefill_lengths`;
        Hh = SEQ; prefill lengths `default_prefill_lengths(L)`) and validate
        (ContractError naming the command-line option)."""
        if seq_length < 2:
            raise ContractError(f"--seq-length must be at least 2, got {seq_length}")
        if prefill_lengths is not None:
            given = list(prefill_lengths)
            if not given:
                raise ContractError("--prefill-lengths names no length")
            bad = [n for n in given if not 1 <= n <= seq_length]
            if bad:
                raise ContractError(f"--prefill-lengths {bad[0]} must be between 1 and "
                                    f"--seq-length {seq_length}")
            twice = sorted({n for n in given if given.count(n) > 1})
            if twice:
                raise ContractError(f"--prefill-lengths names {twice[0]} twice")
            if max_input_length is not None and max(given) > max_input_length:
                raise ContractError(
                    f"--prefill-lengths {max(given)} is longer than --max-input-length "
                    f"{max_input_length} (the longest prefill chunk)")
        if max_input_length is not None:
            L = max_input_length
        elif prefill_lengths is not None:
            L = max(prefill_lengths)
        else:
            L = min(seq_length, 128)
        Hh = seq_length if max_history is None else max_history
        if not 1 <= L <= seq_length:
            raise ContractError(
                f"--max-input-length {L} must be between 1 and --seq-length {seq_length}")
        if not 1 <= Hh <= seq_length:
            raise ContractError(
                f"--max-history {Hh} must be between 1 and --seq-length {seq_length}")
        lengths = default_prefill_lengths(L) if prefill_lengths is None else \
            tuple(sorted({*prefill_lengths, L}))
        return cls(seq_length, L, Hh, lengths)

    def chunk_length(self, n: int) -> int:
        """The shortest prefill length that holds a chunk of `n` tokens (1 <= n <= L)."""
        if not 1 <= n <= self.max_input_length:
            raise ContractError(f"a prefill chunk of {n} tokens does not fit the longest "
                                f"prefill length {self.max_input_length}")
        return next(length for length in self.prefill_lengths if length >= n)

    @property
    def shorter_lengths(self) -> tuple[int, ...]:
        """The prefill lengths below L: those with nets `<prefill net>:<length>`."""
        return self.prefill_lengths[:-1]

    def prefill_net(self, base: str, length: int) -> str:
        """The name of prefill net `base` at chunk length `length` (`block`, `block:16`)."""
        if length not in self.prefill_lengths:
            raise ContractError(f"{length} is not a prefill length of these shapes "
                                f"({list(self.prefill_lengths)})")
        return str(NetName(base, 0, 0 if length == self.max_input_length else length))


#: the chunk lengths compiled below L by default: powers of 2 from 16 (16, 32, 64, ...)
DEFAULT_PREFILL_BASE = 16


def default_prefill_lengths(max_input_length: int) -> tuple[int, ...]:
    """16, 32, 64, ... below `max_input_length`, and `max_input_length` itself: a prompt
    runs a chunk at most twice its length (at least 16), a long one chunks of L."""
    out, n = [], DEFAULT_PREFILL_BASE
    while n < max_input_length:
        out.append(n)
        n *= 2
    return (*out, max_input_length)


class ModelWidths(Protocol):
    """The model sizes the text nets' IO depends on (e.g. the header's `ModelInfo`)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class LinearWidths:
    """The sizes of a linear-attention layer's state: conv kernel K, key heads Hk of Dk,
    value heads Hv of Dv (the conv runs over q|k|v: 2 Hk Dk + Hv Dv channels)."""

    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def conv_state(self, name: str, act: str) -> TensorSpec:
        return TensorSpec(name, (1, self.conv_kernel - 1, self.conv_dim), act)

    def recurrent_state(self, name: str) -> TensorSpec:
        return TensorSpec(name, (1, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                          "float32")


def linear_net_io(shapes: StaticShapes, hidden_size: int, widths: LinearWidths, act: str
                  ) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """The inputs and outputs of a linear-attention layer's `block`, `block_kv` and
    `block_cache` (`LINEAR_*` above): the state in, the new state out; `block` and
    `block_kv` at every prefill length (`block:16`, ...)."""
    Hh, H = shapes.max_history, hidden_size
    state_in = (widths.conv_state(CONV_STATE, act), widths.recurrent_state(RECURRENT_STATE))

    def outs(n: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec(HIDDEN_OUT, (1, n, H), act),
                widths.conv_state(PRESENT_CONV_STATE, act),
                widths.recurrent_state(PRESENT_RECURRENT_STATE))

    out: dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]] = {}
    for L in shapes.prefill_lengths:
        out[shapes.prefill_net(BLOCK, L)] = (
            (TensorSpec(HIDDEN, (1, L, H), act), TensorSpec(ATTENTION_MASK, (1, 1, L, L), act)),
            outs(L))
        out[shapes.prefill_net(BLOCK_KV, L)] = (
            (TensorSpec(HIDDEN, (1, L, H), act),
             TensorSpec(ATTENTION_MASK, (1, 1, L, Hh + L), act), *state_in), outs(L))
    out[BLOCK_CACHE] = ((TensorSpec(HIDDEN, (1, 1, H), act), *state_in), outs(1))
    return out


def net_io(shapes: StaticShapes, model: ModelWidths, act: str, position_axes: int = 1
           ) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """The inputs and outputs of each text net: static shapes L, SEQ and Hh, the model's
    widths, float activations (and logits) of dtype `act`, int32 ids and positions (one
    row per position axis, `POSITION_AXES`); the sampling head's parameters and
    probabilities are f32 whatever `act` is. The prefill nets (`PREFILL_NETS`) at every
    prefill length: `block` at L, `block:16` at 16, ..."""
    if position_axes not in POSITION_AXES:
        raise ContractError(f"{position_axes} position axes: the nets take "
                            f"{' or '.join(map(str, POSITION_AXES))}")
    S, Hh = shapes.seq_length, shapes.max_history
    H, kv, D = model.hidden_size, model.num_kv_heads, model.head_dim
    V, K = model.vocab_size, sample_k(model.vocab_size)

    def t(name: str, *shape: int, dtype: str = act) -> TensorSpec:
        return TensorSpec(name, shape, dtype)

    def block(n: int, mask: int, history: int | None
              ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        inputs = [t(HIDDEN, 1, n, H), t(POSITION_IDS, position_axes, n, dtype="int32"),
                  t(ATTENTION_MASK, 1, 1, n, mask)]
        if history is not None:
            inputs += [t(HISTORY_K, 1, history, kv, D), t(HISTORY_V, 1, history, kv, D)]
        return tuple(inputs), (t(HIDDEN_OUT, 1, n, H), t(PRESENT_K, 1, n, kv, D),
                               t(PRESENT_V, 1, n, kv, D))

    def prefill(L: int) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
        return {
            shapes.prefill_net(EMBEDDING, L): ((t(INPUT_IDS, 1, L, dtype="int32"),),
                                               (t(HIDDEN, 1, L, H),)),
            shapes.prefill_net(BLOCK, L): block(L, L, None),
            shapes.prefill_net(BLOCK_KV, L): block(L, Hh + L, Hh),
        }

    longest = prefill(shapes.max_input_length)
    return {
        EMBEDDING: longest[EMBEDDING],
        EMBEDDING_CACHE: ((t(INPUT_IDS, 1, 1, dtype="int32"),), (t(HIDDEN, 1, 1, H),)),
        BLOCK: longest[BLOCK],
        BLOCK_KV: longest[BLOCK_KV],
        BLOCK_CACHE: block(1, S + 1, S),
        LM_HEAD: ((t(HIDDEN, 1, H),), (t(LOGITS, 1, V),)),
        GREEDY_HEAD: ((t(LOGITS, 1, V),), (t(TOKEN, 1, 1, dtype="int32"),)),
        SAMPLE_HEAD: ((t(LOGITS, 1, V), t(RECENT_IDS, 1, S, dtype="int32"),
                       t(PENALTY, 1, 1, dtype="float32"), t(TEMPERATURE, 1, 1, dtype="float32"),
                       t(TOP_K, 1, 1, dtype="int32"), t(TOP_P, 1, 1, dtype="float32")),
                      (t(PROBS, 1, K, dtype="float32"), t(TOKEN_IDS, 1, K, dtype="int32"))),
        **{name: io for L in shapes.shorter_lengths for name, io in prefill(L).items()},
    }


def row_name(name: str, row: int) -> str:
    """The IO name of row `row`'s own tensor in a batch net (`history_k.2`)."""
    return f"{name}.{row}"


#: a batch `block_cache`'s tensors of each row: its KV cache in, its new k/v out
ROW_INPUTS = (HISTORY_K, HISTORY_V)
ROW_OUTPUTS = (PRESENT_K, PRESENT_V)


def batch_net_io(shapes: StaticShapes, model: ModelWidths, act: str, batch: int,
                 position_axes: int = 1
                 ) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """The inputs and outputs of the batch nets (`BATCH_NETS` at `batch` B): a decode step
    of B conversations, row b of every batched tensor belonging to conversation b, each
    with its own KV cache (`history_k.b`, `history_v.b` [1, SEQ, kvH, D] in; its new k/v
    `present_k.b`, `present_v.b` [1, 1, kvH, D] out, written in place into its cache slot
    as `block_cache` does):

    - `embedding_cache.bB`: `input_ids` i32 [1, B] -> `hidden` [1, B, H]
    - `block_cache.bB`: `hidden` [1, B, H], `position_ids` [axes, B], `attention_mask`
      [1, 1, B, SEQ + 1] (row b: conversation b's decode mask), the rows' caches ->
      `hidden_out` [1, B, H], the rows' new k/v
    - `lm_head.bB`: [B, H] -> [B, V]; `greedy_head.bB`: [B, V] -> `token` [B, 1];
      `sample_head.bB`: every input and output with B rows (each row its own penalty,
      temperature, top-k and top-p)."""
    if batch < 2:
        raise ContractError(f"a batch net takes 2 or more conversations, not {batch}")
    single = net_io(shapes, model, act, position_axes)
    S = shapes.seq_length
    H, kv, D = model.hidden_size, model.num_kv_heads, model.head_dim

    def t(name: str, *shape: int, dtype: str = act) -> TensorSpec:
        return TensorSpec(name, shape, dtype)

    def rows(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        """The head's tensors [1, X] at B rows."""
        return tuple(TensorSpec(s.name, (batch, *s.shape[1:]), s.dtype) for s in specs)

    def name(base: str) -> str:
        return str(NetName(base, batch=batch))

    cache_in = [t(row_name(n, b), 1, S, kv, D) for b in range(batch) for n in ROW_INPUTS]
    cache_out = [t(row_name(n, b), 1, 1, kv, D) for b in range(batch) for n in ROW_OUTPUTS]
    return {
        name(EMBEDDING_CACHE): ((t(INPUT_IDS, 1, batch, dtype="int32"),),
                                (t(HIDDEN, 1, batch, H),)),
        name(BLOCK_CACHE): ((t(HIDDEN, 1, batch, H),
                             t(POSITION_IDS, position_axes, batch, dtype="int32"),
                             t(ATTENTION_MASK, 1, 1, batch, S + 1), *cache_in),
                            (t(HIDDEN_OUT, 1, batch, H), *cache_out)),
        **{name(head): (rows(single[head][0]), rows(single[head][1]))
           for head in (LM_HEAD, GREEDY_HEAD, SAMPLE_HEAD)},
    }


# =========================================================================== masks
#
# The masks are additive: 0 where a key is visible, `MASK_VALUE` (-10000) where it is
# hidden — not -inf (a fully masked padded row would turn into NaN) and not finfo.min
# (overflows in f16). exp(-10000) is exactly 0 in f32, so a masked key contributes nothing,
# yet every row stays finite. Padded rows and columns are fully masked.

MASK_VALUE = -10000.0


def prefill_mask(n: int, length: int, start: int = 0, history: int = 0) -> np.ndarray:
    """Mask [1, 1, L, history + L] of a prefill chunk of `n` real tokens at positions
    start..start+n-1, padded to `length` L, over `history` cache slots of which the first
    `start` hold the conversation so far (history 0: the `block` net, no cache)."""
    if not 0 <= n <= length or (history and not 0 <= start <= history):
        raise ValueError(f"bad prefill mask request: n={n} length={length} start={start} "
                         f"history={history}")
    m = np.full((length, history + length), MASK_VALUE, np.float32)
    if history:
        m[:n, :start] = 0.0
    tri = np.tril(np.ones((n, n), bool))
    m[:n, history:history + n][tri] = 0.0
    return m[None, None]


def decode_mask(pos: int, seq_length: int) -> np.ndarray:
    """Mask [1, 1, 1, SEQ + 1] of the token at `pos`: cache slots 0..pos-1 and the token
    itself (the last column: its own k/v, passed beside the cache) are visible."""
    if not 0 <= pos < seq_length:
        raise ValueError(f"decode position {pos} is outside the KV cache of {seq_length}")
    m = np.full((1, seq_length + 1), MASK_VALUE, np.float32)
    m[0, :pos] = 0.0
    m[0, seq_length] = 0.0
    return m[None, None]


# =========================================================================== other contents

#: the tokenizer files a model file may carry (what `toptpu compile` copies from the model
#: directory); their names are section names, never paths
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")

# =========================================================================== MiniCPM-V inputs
#
# The static-shape inputs of the MiniCPM-V `vit` net (the compiler checks the net with them,
# the runtime feeds it with them).
#
# MiniCPM-V packs each image slice NaViT-style: `pixel_values` [C, P, n * P] holds the n
# patches of an h x w patch grid side by side in raster order, and the vision tower runs on
# exactly those n patches (n varies with the slice's aspect ratio). Its window-attention
# merger then regroups the tokens window by window (`get_vision_window_index`) and merges
# each 2 x 2 window into one token; the downsample MLP merger merges 2 x 2 again.
#
# A static net cannot take a varying n, nor gather by a data-dependent window index. Both
# go away with one host-side permutation of the patches (`merge_order`): every attention
# before, between and after the merges treats tokens as a set (it is permutation
# equivariant, and the only mask is which tokens are real), patch embedding and position
# embedding are per patch, so the patches may enter in any order. In *merge order* each
# window of the innermost merge is 4 consecutive tokens, each window of the next merge is 4
# consecutive merged tokens, and the final tokens come out in raster order of the merged
# grid, exactly as the model's merger emits them. The slice is then padded to the net's
# static patch budget N with masked tokens (`pack_slice`); n is a multiple of 16, so the
# padding is whole windows at every level and the real tokens stay a prefix.


def merge_order(h: int, w: int, levels: Sequence[tuple[int, int]]) -> np.ndarray:
    """Raster patch indices of an h x w grid in merge order for `levels` (innermost merge
    kernel (kh, kw) first): windows of each level are consecutive, row-major inside."""
    kh = int(np.prod([k[0] for k in levels])) if levels else 1
    kw = int(np.prod([k[1] for k in levels])) if levels else 1
    if h % kh or w % kw:
        raise ValueError(f"a {h}x{w} patch grid is not divisible by the merge kernels "
                         f"{list(levels)} ({kh}x{kw})")
    offsets = [(0, 0)]
    size = (1, 1)
    for lh, lw in levels:  # grow the block outwards: sub-blocks in raster order
        offsets = [(sy * size[0] + dy, sx * size[1] + dx)
                   for sy in range(lh) for sx in range(lw) for dy, dx in offsets]
        size = (size[0] * lh, size[1] * lw)
    block = np.array(offsets, np.int64)  # [kh*kw, 2]
    rows = np.arange(h // kh)[:, None, None] * kh + block[None, None, :, 0]
    cols = np.arange(w // kw)[None, :, None] * kw + block[None, None, :, 1]
    return (rows * w + cols).reshape(-1)


def nearest_position_ids(h: int, w: int, num_patches_per_side: int) -> np.ndarray:
    """The position-embedding rows of an h x w patch grid in raster order: the model's own
    `transformers.vision_utils.get_vision_nearest_position_ids` (bucketize of i/h on the
    learned side x side grid). It needs torch and transformers, imported here: only the
    MiniCPM-V vision path (compile check and image encoding) gets this far, and that path
    runs the model's own image processor from transformers anyway."""
    import torch
    from transformers.vision_utils import get_vision_nearest_position_ids

    ids = get_vision_nearest_position_ids(torch.tensor([[h, w]]), num_patches_per_side)
    return ids.numpy().astype(np.int64)


def pack_slice(patches: np.ndarray, h: int, w: int, budget: int,
               levels: Sequence[tuple[int, int]], num_patches_per_side: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slice's NaViT patches [C, P, h*w*P] -> the vit net inputs at `budget` patches:
    pixel_values [1, C, P, budget*P] in merge order, position ids i32 [1, budget] and the
    key mask [1, 1, 1, budget] (0 for the h*w real patches, MASK_VALUE for padding)."""
    c, p, total = patches.shape
    n = h * w
    if total != n * p:
        raise ValueError(f"slice of {total // p} patches does not match its grid {h}x{w}")
    if n > budget:
        raise ValueError(f"slice of {n} patches exceeds the budget of {budget}")
    order = merge_order(h, w, levels)
    grid = patches.reshape(c, p, n, p)[:, :, order, :]
    pixels = np.zeros((c, p, budget, p), np.float32)
    pixels[:, :, :n] = grid
    pos = np.zeros((1, budget), np.int32)
    pos[0, :n] = nearest_position_ids(h, w, num_patches_per_side)[order]
    mask = np.full((1, 1, 1, budget), MASK_VALUE, np.float32)
    mask[..., :n] = 0.0
    return pixels.reshape(1, c, p, budget * p), pos, mask


# ====================================================================== canvas positions
#
# MiniCPM-V 4.7 places each image on a "canvas" in its text model's multi-axis rotary (canvas
# M-RoPE, `MiniCPMV4_7Model.get_rope_index`): text tokens have the same position on the
# three axes (T, H, W), while the tokens of an image's thumbnail and slices get the (row,
# column) of their place on a grid the size of the slices put together, the image's and
# slices' start/end markers and the newlines between slice rows are pinned to its corners
# and edges, and the text after the image continues one past the canvas's larger side. The
# full-attention nets of such a model take position_ids [3, n] (T, H, W) and the runtime
# lays them out with `canvas_position_ids`, a port of the model's own function to numpy for
# one sequence that starts at a given position (a chat continues where the conversation
# stands).

#: MiniCPM-V 4.7's config fields naming the tokens its canvas is pinned to, in the order
#: its layout reads them (`<slice>` first: it tells a slice from a new image)
CANVAS_MARKERS = ("slice_start_id", "slice_end_id", "image_start_id", "image_end_id",
                  "newline_id")

_Frame = tuple[int, int, int, list[tuple[int, int]]]


def _visual_groups(ids: Sequence[int], is_image: Sequence[bool], markers: tuple[int, ...],
                   slice_start: int) -> list[tuple[int, int, list[_Frame]]]:
    """The model's `_group_visual_frames` for images: (group start, group end, frames);
    a frame is (thumbnail start, thumbnail end, frame end, slices as (start, end))."""
    groups: list[tuple[int, list[tuple[int, int, list[tuple[int, int]]]]]] = []
    open_slices: list[tuple[int, int]] | None = None
    previous_end = 0
    for image, run in itertools.groupby(enumerate(is_image), lambda item: item[1]):
        if not image:
            continue
        run_list = list(run)
        crop = (run_list[0][0], run_list[-1][0] + 1)
        if open_slices is not None and ids[crop[0] - 1] == slice_start:
            open_slices.append(crop)
        else:
            open_slices = []
            frame = (crop[0], crop[1], open_slices)
            gap = ids[previous_end:crop[0] - 1]
            if groups and all(t in markers for t in gap):
                groups[-1][1].append(frame)
            else:
                groups.append((crop[0] - 1, [frame]))
        previous_end = crop[1]

    def frame_end(last: int) -> int:
        end = last
        while end < len(ids) and ids[end] in markers:
            end += 1
        return end

    out = []
    for start, frames in groups:
        done = [(ts, te, frame_end(sl[-1][1] if sl else te), sl) for ts, te, sl in frames]
        out.append((start, done[-1][2], done))
    return out


def _grid_positions(origin: int, grid: tuple[int, int], merge: int, canvas_h: int = 0,
                    canvas_w: int = 0, h_offset: int = 0, w_offset: int = 0) -> np.ndarray:
    """The model's `get_vision_position_ids`: [3, h*w] (T, H, W) of one crop's tokens in
    raster order, its grid stretched over a canvas. The stretch is torch's float32
    `linspace` rounded, as the model computes it: torch's CPU kernel computes some steps
    vectorized, a last bit apart from any formula, and rounding sees that bit at a half.
    torch is imported here (image prompts only: the image processor has loaded it)."""
    import torch

    h, w = int(grid[0]) // merge, int(grid[1]) // merge
    canvas_h, canvas_w = canvas_h or h, canvas_w or w
    rows = torch.linspace(0, canvas_h - 1, h).round().long().numpy() + h_offset
    cols = torch.linspace(0, canvas_w - 1, w).round().long().numpy() + w_offset
    hh, ww = np.meshgrid(rows, cols, indexing="ij")
    return np.stack([np.zeros_like(hh), hh, ww]).reshape(3, -1) + origin


def canvas_position_ids(ids: Sequence[int], is_image: Sequence[bool],
                        markers: Mapping[str, int], grids: Sequence[tuple[int, int]],
                        merge: int, start: int = 0) -> tuple[np.ndarray, int]:
    """MiniCPM-V 4.7's canvas positions of `ids` (one sequence; `is_image` marks its image
    tokens, as the processor's `mm_token_type_ids`: each run of them is one crop; `grids`
    the patch grid (h, w) of every crop in order: each image's source then its slices, as
    the processor's `target_sizes`), counted from `start`: positions i64 [3, n] (T, H, W)
    and the position of the token after them (one past the largest, as the model's
    `rope_deltas` continues). `merge` is the patches per token along a side (4 for the 16x
    downsample, 2 for 4x). `markers` maps `CANVAS_MARKERS` to token ids. ContractError when
    the crops and the grids do not pair."""
    ids = [int(i) for i in ids]
    n = len(ids)
    if len(is_image) != n:
        raise ContractError(f"{len(is_image)} image flags for {n} tokens")
    pos = np.zeros((3, n), np.int64)
    if not n:
        return pos, start
    marks = tuple(int(markers[k]) for k in CANVAS_MARKERS)
    grid_iter = iter([(int(h), int(w)) for h, w in grids])

    def next_grid() -> tuple[int, int]:
        try:
            return next(grid_iter)
        except StopIteration:
            raise ContractError("the prompt has more image crops than the images give patch "
                                "grids") from None

    current, idx = start, 0
    for group_start, group_end, frames in _visual_groups(
            ids, [bool(f) for f in is_image], marks, marks[0]):
        if group_start > idx:  # text in front of the group: one position on every axis
            pos[:, idx:group_start] = np.arange(group_start - idx) + current
            current += group_start - idx
        cursor = group_start
        for thumb_start, thumb_end, frame_end, slices in frames:
            thumb_grid = next_grid()
            frame_start = thumb_start - 1
            if frame_start > cursor:  # tokens between two frames of a group
                pos[:, cursor:frame_start] = np.arange(frame_start - cursor) + current
                current += frame_start - cursor + 1
            frame_end = min(frame_end, group_end)
            origin = current
            halo = max(origin - 1, 0)
            slice_h = slice_w = rows = cols = 0
            canvas_h, canvas_w = thumb_grid[0] // merge, thumb_grid[1] // merge
            first_grid = thumb_grid
            if slices:
                cols = len(slices)  # a gap wider than `</slice><slice>` ends a row
                for k in range(len(slices) - 1):
                    if slices[k + 1][0] - slices[k][1] > 2:
                        cols = k + 1
                        break
                rows = len(slices) // cols if cols > 0 else 1
                if rows * cols != len(slices):
                    rows, cols = 1, len(slices)
                first_grid = next_grid()
                slice_h, slice_w = first_grid[0] // merge, first_grid[1] // merge
                canvas_h, canvas_w = rows * slice_h, cols * slice_w
            pos[:, frame_start:frame_end] = origin
            pos[1:, frame_start] = halo
            if thumb_end < frame_end:  # `</image>` on the canvas's far corner
                pos[1, thumb_end] = origin + canvas_h
                pos[2, thumb_end] = origin + canvas_w
            pos[:, thumb_start:thumb_end] = _grid_positions(origin, thumb_grid, merge,
                                                            canvas_h, canvas_w)
            for k, (s0, s1) in enumerate(slices):
                h_off, w_off = (k // cols) * slice_h, (k % cols) * slice_w
                grid = first_grid if k == 0 else next_grid()
                sh, sw = grid[0] // merge, grid[1] // merge
                if s0 - 1 >= frame_start:  # `<slice>` on the slice's first corner
                    pos[1, s0 - 1], pos[2, s0 - 1] = origin + h_off, origin + w_off
                if s1 < frame_end:  # `</slice>` on its last
                    pos[1, s1], pos[2, s1] = origin + h_off + sh - 1, origin + w_off + sw - 1
                pos[:, s0:s1] = _grid_positions(origin, grid, merge, h_offset=h_off,
                                                w_offset=w_off)
            for k in range(len(slices) - 1):  # a newline just past its row's right edge
                gap0, gap1 = slices[k][1], slices[k + 1][0]
                if gap1 - gap0 <= 2:
                    continue
                for j in range(gap0 + 1, gap1 - 1):
                    pos[1, j] = origin + (k // cols + 1) * slice_h - 1
                    pos[2, j] = origin + cols * slice_w
            current = origin + max(canvas_h, canvas_w) + 1
            cursor = frame_end
        if cursor < group_end:
            pos[:, cursor:group_end] = np.arange(group_end - cursor) + current
            current += group_end - cursor
        idx = group_end
    if idx < n:
        pos[:, idx:] = np.arange(n - idx) + current
    if next(grid_iter, None) is not None:
        raise ContractError("the images give more patch grids than the prompt has image crops")
    return pos, int(pos.max()) + 1


# ====================================================================== Qwen-VL
#
# Qwen2.5-VL, Qwen3-VL and Qwen3.5 run one static `vit` net per image (or video) over a
# fixed budget of N patches (LLM-TPU's `--max-pixels`): the image processor resizes the
# image within the budget, its patches come in the processor's merge order (every 2 x 2
# merge window consecutive), and the host adds what the model computes from the grid
# (`qwen_vit_inputs`): each patch's (row, column) for the 2-D vision rotary, the key masks
# of its attention (one block per frame of t; Qwen2.5-VL's window layers one block per
# window, the patches reordered window by window as the model reorders them), Qwen3-VL's
# interpolation taps of its learned position grid; the padding past the image's patches is a
# block of its own, so no real patch sees it. The net's merged rows come out in the order
# the patches went in; the host puts them back (`rows`). Helpers of transformers'
# `vision_utils` (the models' own) give the window index, the rotary positions and the
# interpolation taps; torch and transformers are imported here (image encoding only).
#
# The text positions are M-RoPE (`mrope_position_ids`, the models' `get_rope_index` ported
# to numpy for one sequence from a start position): a text token has one position on the
# three axes (T, H, W), an image's tokens the (frame, row, column) of their merged grid from
# the position where the image starts, and the text after it continues one past the grid's
# larger side; generated tokens continue one past the largest position (`rope_deltas`).


@dataclass(frozen=True)
class QwenVitInputs:
    """One image or video through the static `vit` net: its inputs (`feeds`) and the
    permutation `rows` that puts the net's first `tokens` merged rows in the model's order
    (row i of the model's output is the net's row rows[i])."""

    feeds: dict[str, np.ndarray]
    rows: np.ndarray
    tokens: int


def qwen_vit_inputs(patches: np.ndarray, grid: tuple[int, int, int], budget: int, merge: int,
                    *, patch_size: int, window_size: int | None = None,
                    position_grid_side: int | None = None) -> QwenVitInputs:
    """The `vit` inputs of one image or video: `patches` [t*h*w, C*T*P*P] as the image
    processor lays them out, `grid` (t, h, w) in patches, the net's static `budget` N of
    patches, the spatial `merge` (2). `window_size` (pixels; Qwen2.5-VL) adds the window
    attention's mask and reorders the patches window by window; `position_grid_side` (the
    side of Qwen3-VL's learned position grid) adds its interpolation taps and weights.
    ContractError when the patches do not fit the budget or do not match the grid."""
    import torch
    from transformers import vision_utils as vu

    t, h, w = (int(x) for x in grid)
    n, unit = t * h * w, merge * merge
    if patches.ndim != 2 or patches.shape[0] != n:
        raise ContractError(f"{patches.shape[0] if patches.ndim else 0} patches do not match "
                            f"the grid {t}x{h}x{w}")
    if h % merge or w % merge:
        raise ContractError(f"a {h}x{w} patch grid is not divisible by the merge size {merge}")
    if n > budget:
        raise ContractError(f"{n} patches ({t}x{h}x{w}) exceed the vision net's budget of "
                            f"{budget}")
    thw = torch.tensor([[t, h, w]])
    positions = vu.get_vision_position_ids(thw, merge).numpy().astype(np.int32)
    frames = vu.get_vision_cu_seqlens(thw).numpy().astype(np.int64)
    order = np.arange(n // unit)
    windows = None
    if window_size is not None:
        index, cu = vu.get_vision_window_index(thw, merge, int(window_size), int(patch_size))
        order = index.numpy().astype(np.int64)
        windows = cu.numpy().astype(np.int64)
    patch_order = (order[:, None] * unit + np.arange(unit)).reshape(-1)

    def block_mask(cuts: np.ndarray) -> np.ndarray:
        mask = np.full((budget, budget), MASK_VALUE, np.float32)
        bounds = [*(int(c) for c in cuts), budget] if n < budget else [int(c) for c in cuts]
        for a, b in itertools.pairwise(bounds):
            mask[a:b, a:b] = 0.0
        return mask[None, None]

    pixels = np.zeros((budget, patches.shape[1]), np.float32)
    pixels[:n] = patches[patch_order]
    pos = np.zeros((budget, 2), np.int32)
    pos[:n] = positions[patch_order]
    feeds = {PIXEL_VALUES: pixels, POSITION_IDS_VIT: pos, ATTENTION_MASK: block_mask(frames)}
    if windows is not None:
        feeds[WINDOW_MASK] = block_mask(windows)
    if position_grid_side is not None:
        idx, wts = vu.get_vision_interpolation_indices_and_weights(
            thw, num_grid_per_side=int(position_grid_side), mode="bilinear",
            align_corners=True, spatial_merge_size=merge)
        taps = np.zeros((budget, idx.shape[1]), np.int32)
        weights = np.zeros((budget, idx.shape[1]), np.float32)
        taps[:n] = idx.numpy()[patch_order]
        weights[:n] = wts.numpy()[patch_order]
        feeds[INTERP_INDICES], feeds[INTERP_WEIGHTS] = taps, weights
    return QwenVitInputs(feeds, np.argsort(order), n // unit)


def mrope_position_ids(types: Sequence[int], image_grids: Sequence[tuple[int, int, int]],
                       video_grids: Sequence[tuple[int, int, int]], merge: int, start: int = 0,
                       video_intervals: Sequence[float] | None = None,
                       frames_apart: bool = False) -> tuple[np.ndarray, int]:
    """The M-RoPE positions i64 [3, n] (T, H, W) of one sequence whose token `types` are 0
    (text), 1 (image) or 2 (video), as the processor's `mm_token_type_ids` mark them: each
    run of image (video) tokens takes the next grid (t, h, w, in patches) of `image_grids`
    (`video_grids`); counted from `start`; and the position of the token after them (one
    past the largest). Qwen2.5-VL spaces a video's frames by `video_intervals` (its
    `tokens_per_second` x seconds per temporal patch, one per video); Qwen3-VL and Qwen3.5
    (`frames_apart`) lay out each temporal patch of a video as a grid of its own (a
    timestamp separates them). ContractError when the runs and the grids do not pair."""
    types = [int(x) for x in types]
    n = len(types)
    pos = np.zeros((3, n), np.int64)
    videos = [(int(t), int(h), int(w)) for t, h, w in video_grids]
    intervals = [1.0] * len(videos) if video_intervals is None else \
        [float(x) for x in video_intervals]
    if len(intervals) != len(videos):
        raise ContractError(f"{len(intervals)} video intervals for {len(videos)} videos")
    if frames_apart:
        videos = [(1, h, w) for t, h, w in videos for _ in range(t)]
        intervals = [1.0] * len(videos)
    grids: dict[int, Iterator[tuple[tuple[int, int, int], float]]] = {
        1: iter([((int(t), int(h), int(w)), 1.0) for t, h, w in image_grids]),
        2: iter(list(zip(videos, intervals, strict=True)))}
    current, idx = start, 0
    for kind, run in itertools.groupby(types):
        length = len(list(run))
        if kind == 0:
            pos[:, idx:idx + length] = np.arange(length) + current
            current += length
        elif kind in (1, 2):
            try:
                item = next(grids[kind])
            except StopIteration:
                what = "image" if kind == 1 else "video"
                raise ContractError(f"the prompt has more {what} runs than {what} grids") \
                    from None
            (t, h, w), interval = item
            gh, gw = h // merge, w // merge
            if t * gh * gw != length:
                raise ContractError(f"a run of {length} vision tokens does not match its grid "
                                    f"{t}x{h}x{w} (merge {merge}: {t * gh * gw} tokens)")
            frames = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
            tt, hh, ww = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, idx:idx + length] = np.stack([tt, hh, ww]).reshape(3, -1) + current
            current += max(h, w) // merge
        else:
            raise ContractError(f"token type {kind} is not text (0), image (1) or video (2)")
        idx += length
    if next(grids[1], None) is not None or next(grids[2], None) is not None:
        raise ContractError("the images or videos give more grids than the prompt has runs of "
                            "vision tokens")
    return pos, (int(pos.max()) + 1) if n else start


# ====================================================================== strict JSON

#: how deeply a header's JSON may nest (readers walk it recursively)
MAX_JSON_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"it holds {name}, which is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"it has the key {key!r} twice")
        out[key] = value
    return out


def parse_strict_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, nested at most
    `MAX_JSON_DEPTH` levels; a ValueError naming what is wrong otherwise."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                           object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"it is nested deeper than {MAX_JSON_DEPTH} levels")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return value


#: the repetition penalties the samplers take (header, CLI, `SamplingConfig` alike): a logit
#: times or over the penalty stays finite in f32 (1e300 overflowed into numpy warnings)
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


# ====================================================================== model directory files


class ModelDirFileError(ToptpuError, ValueError):
    """A file of a model directory that must not be read (a link out of the directory, a
    FIFO, a device, ...); the message names it and what to do."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _allowed_roots(directory: str) -> tuple[str, ...]:
    """Where the files of `directory` may lie: the directory itself and, for a snapshot of
    the Hugging Face hub cache (`<repo>/snapshots/<revision>`, whose files are links to
    `<repo>/blobs/<hash>`), its repository's `blobs`."""
    root = os.path.realpath(directory)
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        return root, os.path.join(os.path.dirname(parent), "blobs")
    return (root,)


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "not a regular file")


def model_file_path(directory: str, name: str) -> str | None:
    """The path of the file `name` of a model directory, or None when there is none: a
    regular file inside the directory (a symbolic link may point to another file of it).
    A link out of the directory, a dangling link, a FIFO, a device or a directory under
    that name is a `ModelDirFileError` naming it; nothing is opened."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelDirFileError(f"cannot read '{path}': {e.strerror}") from e
    target = os.path.realpath(path)
    if not any(_inside(target, r) for r in _allowed_roots(directory)):
        what = "a symbolic link to" if stat.S_ISLNK(st.st_mode) else "resolves to"
        raise ModelDirFileError(
            f"'{path}' is {what} {target}, outside the model directory; copy the file in "
            "(toptpu reads only the model directory's own files)")
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError:
            raise ModelDirFileError(f"'{path}' is a symbolic link to {target}, which does "
                                    "not exist; copy the file in") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelDirFileError(f"'{path}' is {_kind(st.st_mode)}, not a regular file; a "
                                "model directory holds regular files: copy the file in")
    return path


def read_model_file(directory: str, name: str) -> bytes | None:
    """The bytes of the file `name` of a model directory (checked by `model_file_path`;
    opened without blocking, so a FIFO swapped in after the check cannot hang), None when
    there is none."""
    path = model_file_path(directory, name)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ModelDirFileError(f"cannot read '{path}': {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ModelDirFileError(f"'{path}' is not a regular file; copy the file in")
        return f.read()


def check_model_dir_files(directory: str) -> None:
    """Every file of a model directory (not its subdirectories: nothing of ours reads them)
    is a regular file inside it (`model_file_path`): run before anything — transformers
    included — opens one of them."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise ModelDirFileError(f"cannot list the model directory '{directory}': "
                                f"{e.strerror}") from e
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            continue
        model_file_path(directory, name)
