"""A conversation's state on the chip and its step loop: prefill chunks and decode steps.

`Conversation` holds what a conversation has put on the chip — one K and one V cache
`[1, SEQ, kvH, D]` per full-attention layer, one conv state and one recurrent state per
linear-attention layer (Qwen3.5), and the tokens they hold — and feeds tokens through the
text nets:

- `feed(ids)` prefills ids after the cached tokens in chunks of at most L
  (`max_input_length`): the first chunk of a conversation runs `block`, later chunks run
  `block_kv` over the history so far (the first Hh cache slots, bound in place), each at the
  shortest prefill length that holds the chunk (`block:16` for a 5-token prompt when the
  file has it). Each chunk's `present_k`/`present_v` output is bound straight to its cache
  slots (through a scratch buffer only when the padded chunk would run past SEQ). When the
  history is longer than `max_history` the remaining tokens go through the decode net one by
  one (exact, slower); nothing is clipped. A linear-attention layer's state is read and
  written in place (`block` starts from a zero state; a padded chunk leaves the state of
  its real tokens);
- `step(token)` is a decode step: `block_cache` per layer with the whole cache as history
  and `present_k`/`present_v` bound to `cache.slot(1, pos, 1)`: the new k/v land in their
  slot, no concatenated copy exists;
- positions: a token's text position is its cache slot, unless the full-attention nets take
  a position per rotary axis (position_ids [3, n]: MiniCPM-V 4.7's canvas, Qwen-VL's
  M-RoPE). Then a prompt's positions come with it (`PromptLayout.positions`, laid out by its
  vision family from `next_position`), and every generated token takes the next position on
  all three axes.

A server keeps several conversations over one `Engine` (the executor, the nets' shapes and
the work buffers a step uses; steps run one at a time) and reuses one for a prompt that
shares a prefix with it: `reusable_prefix(ids)` is how many of the prompt's first tokens it
can keep, `truncate(n)` forgets the rest, and `feed(ids[n:])` continues (the same tokens as
a cold run: a cache slot past the conversation is masked in every run). A linear-attention
state cannot be cut back: a hybrid model's conversation truncates to where it stands, to
the start, or to a `checkpoint()` it took (a host copy of the states). Copying is explicit:
`fork()` makes a new conversation with its own caches holding the same tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    ATTENTION_MASK,
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    CONV_STATE,
    DEEPSTACK,
    DEEPSTACK_NET,
    EMBEDDING,
    EMBEDDING_CACHE,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_K,
    HISTORY_V,
    INPUT_IDS,
    POSITION_IDS,
    PRESENT_CONV_STATE,
    PRESENT_K,
    PRESENT_RECURRENT_STATE,
    PRESENT_V,
    RECURRENT_STATE,
    NetName,
    decode_mask,
    prefill_mask,
)
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.text_nets import TextNets
from toptpu.families.base import PromptLayout

#: rows of hidden -> the caller's look at them (`Conversation.feed`'s `rows`)
RowsHook = Callable[[Buffer, int], None]


class Engine:
    """What every conversation of one model file shares: the executor, the text nets'
    shapes, the IO buffers a step binds (one set: steps run one at a time), the padding id,
    and the trace being recorded."""

    def __init__(self, executor: Executor, nets: TextNets, pad_id: int) -> None:
        self.ex = executor
        self.nets = nets
        self.pad_id = pad_id
        #: records the steps, net runs and transfers (`toptpu.backend.runtime.run_trace`)
        self.recorder: RunRecorder | None = None
        n = nets
        attn = n.attn_nets
        attn_at = {length: {base: str(NetName.parse(attn[base]).at_length(tag))
                            for base in (BLOCK, BLOCK_KV)}
                   for length, tag in n.prefill_tags.items()}
        # the prefill chunk's buffers, one set per length (not slots of the longest: a
        # device group keeps a buffer's current value per device for the whole buffer, and
        # sends or host-writes it whole)
        self.ids_L = {k: self.alloc(n.prefill_net(EMBEDDING, None, k), INPUT_IDS)
                      for k in n.lengths}
        self.h_L = {k: [self.alloc(n.prefill_net(EMBEDDING, None, k), HIDDEN),
                        self.alloc(attn_at[k][BLOCK], HIDDEN_OUT)] for k in n.lengths}
        # position_ids [axes, n] (3 axes: not a slot of a longer one): one per length
        self.pos_L = {k: self.alloc(attn_at[k][BLOCK], POSITION_IDS) for k in n.lengths}
        # the masks' rows and columns both follow the chunk length: one per length
        self.mask_L = {k: self.alloc(attn_at[k][BLOCK], ATTENTION_MASK) for k in n.lengths}
        self.mask_kv = {k: self.alloc(attn_at[k][BLOCK_KV], ATTENTION_MASK) for k in n.lengths}
        self.scratch_k = {k: self.alloc(attn_at[k][BLOCK], PRESENT_K) for k in n.lengths}
        self.scratch_v = {k: self.alloc(attn_at[k][BLOCK], PRESENT_V) for k in n.lengths}
        # a decode step's
        self.ids_1 = self.alloc(EMBEDDING_CACHE, INPUT_IDS)
        self.h_1 = [self.alloc(EMBEDDING_CACHE, HIDDEN), self.alloc(BLOCK_CACHE, HIDDEN_OUT)]
        self.pos_1 = self.alloc(attn[BLOCK_CACHE], POSITION_IDS)
        self.mask_1 = self.alloc(attn[BLOCK_CACHE], ATTENTION_MASK)
        self._deepstack: Buffer | None = None

    def alloc(self, net: str, name: str) -> Buffer:
        """A buffer for tensor `name` of `net`."""
        s = self.nets.spec(net, name)
        return self.ex.alloc(s.shape, s.dtype)

    @property
    def deepstack(self) -> Buffer:
        """Qwen3-VL: `deepstack_add`'s rows (allocated on first use)."""
        if self._deepstack is None:
            self._deepstack = self.alloc(DEEPSTACK_NET, DEEPSTACK)
        return self._deepstack

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """A step of the runtime in the trace (nothing without a recorder)."""
        rec = self.recorder
        start = self.ex.modelled_seconds() if rec is not None else 0.0
        yield
        if rec is not None:
            rec.span(name, start, self.ex.modelled_seconds(), **args)


@dataclass
class Checkpoint:
    """A conversation's linear-attention states after its first `length` tokens (host
    copies), and its rotary position there."""

    length: int
    next_position: int
    states: list[dict[str, np.ndarray] | None]


class Conversation:
    """One conversation's caches and tokens, and the steps that extend it (see the module
    doc). Not thread-safe: one step at a time over its `Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        nets = engine.nets
        try:
            kv = nets.spec(nets.attn_nets[BLOCK_CACHE], HISTORY_K)
            alloc = engine.ex.alloc
            # one K and one V cache per full-attention layer; one conv and one recurrent
            # state per linear-attention layer (each updated in place: its input and output)
            self.cache_k: list[Buffer | None] = [
                None if lin else alloc(kv.shape, kv.dtype) for lin in nets.linear]
            self.cache_v: list[Buffer | None] = [
                None if lin else alloc(kv.shape, kv.dtype) for lin in nets.linear]
            self.states: list[dict[str, Buffer] | None] = [
                {name: engine.alloc(nets.layer_net(BLOCK_CACHE, i), name)
                 for name in (CONV_STATE, RECURRENT_STATE)} if lin else None
                for i, lin in enumerate(nets.linear)]
        except MemoryError as e:
            need = 2 * nets.linear.count(False) * kv.nbytes
            raise GenerationError(
                f"this host cannot hold the KV cache of {nets.num_layers} layers x "
                f"{nets.seq} tokens ({need / 2**30:.2f} GiB); recompile with a smaller "
                "--seq-length") from e
        #: the ids whose k/v (or state) the caches hold, at positions 0..n-1
        self.tokens: list[int] = []
        #: the last generated token, chosen but not fed yet (its k/v are not cached)
        self.pending: int | None = None
        #: position axes 3: the rotary position of the next token fed
        self.next_position = 0
        #: position axes 3: the rotary position after the first n tokens, where known
        #: (after each feed and each step); where a truncation can go
        self._positions_at: dict[int, int] = {0: 0}
        self._checkpoints: dict[int, Checkpoint] = {}
        # the prompt being fed: its first cache slot and layout
        self._layout_start = 0
        self._layout: PromptLayout | None = None

    # ------------------------------------------------------------------ state
    @property
    def position(self) -> int:
        """Tokens in the conversation (cached plus the pending one)."""
        return len(self.tokens) + (self.pending is not None)

    @property
    def sequence(self) -> list[int]:
        """The conversation's tokens: the cached ones, then the pending one."""
        return [*self.tokens, *([] if self.pending is None else [self.pending])]

    @property
    def hybrid(self) -> bool:
        """It carries linear-attention states (which cannot be cut back)."""
        return any(self.engine.nets.linear)

    def reset(self) -> None:
        """Forget the conversation (the cache contents become unreachable)."""
        self.tokens, self.pending, self.next_position = [], None, 0
        self._positions_at, self._checkpoints = {0: 0}, {}

    def can_truncate(self, n: int) -> bool:
        """Whether `truncate(n)` keeps the conversation exact."""
        if not 0 <= n <= len(self.tokens):
            return False
        if n == len(self.tokens) or n == 0:
            return True
        if self.hybrid and n not in self._checkpoints:
            return False
        return self.engine.nets.position_axes == 1 or n in self._positions_at

    def reusable_prefix(self, ids: Sequence[int]) -> int:
        """How many of the first tokens of `ids` this conversation can keep for it (shared
        with its cached tokens, where it can truncate, and at least one token of `ids` left
        to feed: its logits come from feeding it)."""
        shared = 0
        for a, b in zip(self.tokens, ids[:-1], strict=False):
            if a != int(b):
                break
            shared += 1
        return max(n for n in range(shared + 1) if self.can_truncate(n))

    def truncate(self, n: int) -> None:
        """Keep the first `n` cached tokens (the pending one is dropped); GenerationError
        where that cannot be exact (`can_truncate`)."""
        if not self.can_truncate(n):
            why = ("its linear-attention states hold every token (take a checkpoint() "
                   "there)" if self.hybrid else "its positions there are not known")
            raise GenerationError(f"cannot truncate a conversation of {len(self.tokens)} "
                                  f"tokens to {n}: {why}")
        if n == 0:
            self.reset()
            return
        if self.hybrid and n != len(self.tokens):
            saved = self._checkpoints[n]
            ex = self.engine.ex
            for st, host in zip(self.states, saved.states, strict=True):
                if st is not None and host is not None:
                    for name, buf in st.items():
                        ex.write(buf, host[name])
        del self.tokens[n:]
        self.pending = None
        if self.engine.nets.position_axes != 1:
            self.next_position = self._positions_at[n]
        self._positions_at = {k: v for k, v in self._positions_at.items() if k <= n}
        self._checkpoints = {k: c for k, c in self._checkpoints.items() if k <= n}

    def checkpoint(self) -> None:
        """Keep a host copy of the linear-attention states as they stand (a hybrid model's
        conversation can then `truncate` back here)."""
        ex = self.engine.ex
        states = [None if st is None else {name: ex.read(buf) for name, buf in st.items()}
                  for st in self.states]
        n = len(self.tokens)
        self._checkpoints[n] = Checkpoint(n, self.next_position, states)

    def fork(self) -> Conversation:
        """A new conversation with caches of its own holding the same tokens (copied)."""
        other = Conversation(self.engine)
        other.copy_from(self)
        return other

    def copy_from(self, source: Conversation, length: int | None = None) -> None:
        """Make this conversation hold what `source` holds, or its first `length` tokens
        (where `source` could truncate: `can_truncate`): the filled cache slots and the
        states copied on the executor (`Executor.copy`, device to device where it can)."""
        if source.engine is not self.engine:
            raise GenerationError("a conversation copies only one of the same model file")
        whole = len(source.tokens)
        n = whole if length is None else length
        if not source.can_truncate(n):
            raise GenerationError(f"cannot copy the first {n} of a conversation's {whole} "
                                  "tokens exactly (see can_truncate)")
        ex = self.engine.ex
        if n:
            for mine, theirs in ((self.cache_k, source.cache_k), (self.cache_v, source.cache_v)):
                for dst, src in zip(mine, theirs, strict=True):
                    if dst is not None and src is not None:
                        ex.copy(dst.slot(1, 0, n), src.slot(1, 0, n))
            if n == whole:  # (a shorter copy takes the states of its checkpoint below)
                for st_dst, st_src in zip(self.states, source.states, strict=True):
                    if st_dst is not None and st_src is not None:
                        for name, buf in st_dst.items():
                            ex.copy(buf, st_src[name])
        self.tokens, self.pending = list(source.tokens), source.pending
        self.next_position = source.next_position
        self._positions_at = dict(source._positions_at)
        self._checkpoints = dict(source._checkpoints)
        if n != whole:
            self.truncate(n)

    # ------------------------------------------------------------------ steps
    def feed(self, ids: Sequence[int], layout: PromptLayout | None = None,
             rows: RowsHook | None = None) -> Buffer:
        """Feed `ids` after the cached tokens; returns the hidden row [1, 1, H] of the last
        one. `layout` (by index in `ids`): the vision rows that replace embeddings,
        DeepStack rows and, with position axes 3, the positions (required then).
        `rows(hidden, n)`, if given, sees the final hidden rows of every chunk (or decode
        step) before the next one reuses the buffer: rows 0..n-1 belong to the n ids fed."""
        ids = [int(i) for i in ids]
        if not ids:
            raise GenerationError("nothing to feed")
        if len(self.tokens) + len(ids) > self.engine.nets.seq:
            raise GenerationError(f"{len(self.tokens)} + {len(ids)} tokens do not fit the KV "
                                  f"cache of {self.engine.nets.seq}")
        axes = self.engine.nets.position_axes
        if axes != 1 and (layout is None or layout.positions is None):
            raise GenerationError("the text nets take a position per axis: feeding a prompt "
                                  "needs its positions (its vision family's layout)")
        self._layout_start, self._layout = len(self.tokens), layout
        if layout is not None and layout.positions is not None:
            self.next_position = layout.next_position
        try:
            last = self._feed(ids, rows)
        finally:
            self._layout = None
        self._positions_at[len(self.tokens)] = self.next_position
        return last

    def step(self, token: int) -> Buffer:
        """A decode step: feed one generated token at the next position; returns the final
        hidden [1, 1, H]."""
        out = self._decode(int(token))
        self.next_position += 1  # a generated token: the next one is one position later
        self._positions_at[len(self.tokens)] = self.next_position
        return out

    # ------------------------------------------------------------------ a batch's step
    # (`toptpu.backend.runtime.batch`: a decode step of several conversations in one run
    # of the batch nets; each conversation's part of it)
    def decode_slot(self) -> int:
        """The cache slot the next decode step fills (GenerationError when it is full)."""
        pos = len(self.tokens)
        if pos >= self.engine.nets.seq:
            raise GenerationError(f"the KV cache is full ({self.engine.nets.seq} tokens)")
        return pos

    def decode_positions(self) -> np.ndarray:
        """position_ids [axes, 1] of the next generated token."""
        return self._positions(len(self.tokens), 1, 1)

    def kv_bindings(self, layer: int, slot: int) -> tuple[Buffer, Buffer, Buffer, Buffer]:
        """Full-attention layer `layer`'s K and V caches (the history of a decode step) and
        their cache slot `slot` (where its new k/v go)."""
        k, v = self._kv(self.cache_k, layer), self._kv(self.cache_v, layer)
        return k, v, k.slot(1, slot, 1), v.slot(1, slot, 1)

    def stepped(self, token: int) -> None:
        """A decode step of `token` ran (in a batch): it is cached at the next slot."""
        self.tokens.append(int(token))
        self.next_position += 1
        self._positions_at[len(self.tokens)] = self.next_position

    def _feed(self, ids: list[int], rows: RowsHook | None) -> Buffer:
        nets, engine = self.engine.nets, self.engine
        last: Buffer | None = None
        i = 0
        while i < len(ids):
            start = len(self.tokens)
            if start == 0 or start <= nets.Hh:
                chunk = ids[i:i + nets.L]
                length = nets.chunk_length(len(chunk))
                net = nets.prefill_net(BLOCK if start == 0 else BLOCK_KV, None, length)
                with engine.span(f"prefill {net}: positions {start}..{start + len(chunk) - 1}",
                                 net=net, start=start, tokens=len(chunk), padded_to=length):
                    h = self._prefill_chunk(chunk)
                last = h.slot(1, len(chunk) - 1, 1)
                if rows is not None:
                    rows(h, len(chunk))
                i += len(chunk)
            else:  # history beyond max_history: the decode net takes the rest one by one
                with engine.span(f"prefill {BLOCK_CACHE}: position {start}", net=BLOCK_CACHE,
                                 start=start, tokens=1):
                    last = self._decode(ids[i])
                if rows is not None:
                    rows(last, 1)
                i += 1
        assert last is not None
        return last

    def _index(self, position: int) -> int:
        """The index in the prompt being fed of cache slot `position`."""
        return position - self._layout_start

    def _deepstack_rows(self, start: int, n: int) -> dict[int, np.ndarray]:
        """Qwen3-VL: the DeepStack rows of the slots start..start+n-1, by slot offset."""
        layout = self._layout
        if layout is None or not layout.deepstack:
            return {}
        return {i: layout.deepstack[k] for i in range(n)
                if (k := self._index(start + i)) in layout.deepstack}

    def _prefill_chunk(self, ids: Sequence[int]) -> Buffer:
        """Run one chunk (≤ L tokens) at the current position, at the shortest prefill
        length that holds it (a chunk with DeepStack rows: at L, the one length
        `deepstack_add` is compiled at); returns the final hidden [1, length, H] buffer
        (row i belongs to ids[i])."""
        engine, nets, ex = self.engine, self.engine.nets, self.engine.ex
        n, start = len(ids), len(self.tokens)
        deep = self._deepstack_rows(start, n)
        L = nets.L if deep else nets.chunk_length(n)
        assert 0 < n <= L and start + n <= nets.seq
        padded = np.full((1, L), engine.pad_id, np.int32)
        padded[0, :n] = ids
        ids_buf, hidden, pos = engine.ids_L[L], engine.h_L[L], engine.pos_L[L]
        ex.write(ids_buf, padded)
        ex.run(nets.prefill_net(EMBEDDING, None, L), {INPUT_IDS: ids_buf, HIDDEN: hidden[0]})
        self._put_image_rows(hidden[0], start, n)
        ex.write(pos, self._positions(start, n, L))
        direct = start + L <= nets.seq
        scratch_k, scratch_v = engine.scratch_k[L], engine.scratch_v[L]

        def present(layer: int) -> dict[str, Buffer]:
            if direct:
                return {PRESENT_K: self._kv(self.cache_k, layer).slot(1, start, L),
                        PRESENT_V: self._kv(self.cache_v, layer).slot(1, start, L)}
            return {PRESENT_K: scratch_k, PRESENT_V: scratch_v}

        if start == 0:
            mask = engine.mask_L[L]
            ex.write(mask, prefill_mask(n, L))
            net = BLOCK

            def extra(layer: int) -> dict[str, Buffer]:
                if nets.linear[layer]:
                    return {ATTENTION_MASK: mask, **self.state_bindings(layer, False)}
                return {POSITION_IDS: pos, ATTENTION_MASK: mask, **present(layer)}
        else:
            mask = engine.mask_kv[L]
            ex.write(mask, prefill_mask(n, L, start, nets.Hh))
            net = BLOCK_KV

            def extra(layer: int) -> dict[str, Buffer]:
                if nets.linear[layer]:
                    return {ATTENTION_MASK: mask, **self.state_bindings(layer, True)}
                return {POSITION_IDS: pos, ATTENTION_MASK: mask,
                        HISTORY_K: self._kv(self.cache_k, layer).slot(1, 0, nets.Hh),
                        HISTORY_V: self._kv(self.cache_v, layer).slot(1, 0, nets.Hh),
                        **present(layer)}

        deepstack = self._deepstack_adder(deep)
        src, dst = hidden
        for layer in range(nets.num_layers):
            ex.run(nets.prefill_net(net, layer, L),
                   {HIDDEN: src, HIDDEN_OUT: dst, **extra(layer)}, layer=layer)
            if not direct and not nets.linear[layer]:
                # the padded chunk runs past SEQ: copy the n real rows into the cache
                for cache, scratch in ((self.cache_k, scratch_k), (self.cache_v, scratch_v)):
                    ex.write(self._kv(cache, layer).slot(1, start, n), ex.read(scratch)[:, :n])
            src, dst = dst, src
            if deepstack is not None and deepstack(layer, src, dst):
                src, dst = dst, src
        self.tokens.extend(int(i) for i in ids)
        return src

    def _deepstack_adder(self, rows: dict[int, np.ndarray]
                         ) -> Callable[[int, Buffer, Buffer], bool] | None:
        """Qwen3-VL: the hook that adds DeepStack level k's rows (by row of the chunk) to
        the hidden rows after text layer k (`deepstack_add`); None without rows."""
        if not rows:
            return None
        levels = next(iter(rows.values())).shape[0]
        engine = self.engine
        buf = engine.deepstack

        def add(layer: int, hidden: Buffer, out: Buffer) -> bool:
            if layer >= levels:
                return False
            table = np.zeros((1, engine.nets.L, int(buf.shape[-1])), np.float32)
            for i, row in rows.items():
                table[0, i] = row[layer]
            engine.ex.write(buf, table)
            engine.ex.run(DEEPSTACK_NET, {HIDDEN: hidden, DEEPSTACK: buf, HIDDEN_OUT: out})
            return True

        return add

    def _decode(self, token: int) -> Buffer:
        """Feed one token at the next cache slot (a decode step, or a prompt token past
        the prefill history); returns the final hidden [1, 1, H]."""
        engine, nets, ex = self.engine, self.engine.nets, self.engine.ex
        pos = len(self.tokens)
        if pos >= nets.seq:
            raise GenerationError(f"the KV cache is full ({nets.seq} tokens)")
        if self._deepstack_rows(pos, 1):
            raise GenerationError(
                f"image token at position {pos} falls past the prefill history of {nets.Hh} "
                "(--max-history), where the decode net takes the prompt one token at a time: "
                "DeepStack's rows are added in prefill chunks only; recompile with a larger "
                "--max-history or put the image earlier in the conversation")
        ex.write(engine.ids_1, np.array([[token]], np.int32))
        ex.run(EMBEDDING_CACHE, {INPUT_IDS: engine.ids_1, HIDDEN: engine.h_1[0]})
        self._put_image_rows(engine.h_1[0], pos, 1)
        ex.write(engine.pos_1, self._positions(pos, 1, 1))
        ex.write(engine.mask_1, decode_mask(pos, nets.seq))

        def extra(layer: int) -> dict[str, Buffer]:
            if nets.linear[layer]:
                return self.state_bindings(layer, True)
            k, v = self._kv(self.cache_k, layer), self._kv(self.cache_v, layer)
            return {POSITION_IDS: engine.pos_1, ATTENTION_MASK: engine.mask_1,
                    HISTORY_K: k, HISTORY_V: v,
                    PRESENT_K: k.slot(1, pos, 1), PRESENT_V: v.slot(1, pos, 1)}

        src, dst = engine.h_1
        for layer in range(nets.num_layers):
            ex.run(nets.layer_net(BLOCK_CACHE, layer),
                   {HIDDEN: src, HIDDEN_OUT: dst, **extra(layer)}, layer=layer)
            src, dst = dst, src
        self.tokens.append(int(token))
        return src

    @staticmethod
    def _kv(cache: list[Buffer | None], layer: int) -> Buffer:
        buf = cache[layer]
        assert buf is not None, f"layer {layer} has no KV cache"
        return buf

    def state_bindings(self, layer: int, carried: bool) -> dict[str, Buffer]:
        """A linear-attention layer's state bindings: the new state written over the old
        one in place, and read first when it is `carried` (block_kv, block_cache; block
        starts from a zero state)."""
        st = self.states[layer]
        assert st is not None, f"layer {layer} has no linear-attention state"
        out = {PRESENT_CONV_STATE: st[CONV_STATE], PRESENT_RECURRENT_STATE: st[RECURRENT_STATE]}
        return {**st, **out} if carried else out

    def _positions(self, start: int, n: int, length: int) -> np.ndarray:
        """position_ids [axes, length] i32 of the n tokens fed at cache slots start.., the
        padding past them continuing (its rows are masked)."""
        axes = self.engine.nets.position_axes
        if axes == 1:
            return np.arange(start, start + length, dtype=np.int32)[None]
        layout = self._layout
        if layout is not None and layout.positions is not None:  # a prompt being fed
            first = self._index(start)
            cols = layout.positions[:, first:first + n]
        else:  # a generated token: text, at the next position on every axis
            cols = np.full((axes, n), self.next_position, np.int64)
        out = np.empty((axes, length), np.int64)
        out[:, :n] = cols
        out[:, n:] = cols[:, -1:] + np.arange(1, length - n + 1)
        return out.astype(np.int32)

    def _put_image_rows(self, hidden: Buffer, start: int, n: int) -> None:
        """Overwrite the embeddings of image placeholder positions start..start+n-1 in
        `hidden` [1, n', H] with their vision rows (contiguous runs in one write each)."""
        layout = self._layout
        if layout is None or not layout.rows:
            return
        rows = layout.rows
        i = 0
        while i < n:
            if self._index(start + i) not in rows:
                i += 1
                continue
            j = i
            while j < n and self._index(start + j) in rows:
                j += 1
            block = np.stack([rows[self._index(start + k)] for k in range(i, j)])
            self.engine.ex.write(hidden.slot(1, i, j - i), block[None])
            i = j
