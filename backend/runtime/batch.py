"""A decode step of several conversations at once, on the batch nets (`--batch B`).

A model file compiled with `toptpu compile --batch B` has the decode nets at batch B too
(`contract.BATCH_NETS`, `contract.batch_net_io`): `embedding_cache.bB`, each layer's
`block_cache.bB` (the B tokens through the norms, projections and MLP together, so a
layer's weights are read once for all of them; each row attending to its own
conversation's KV cache under its own mask row, its new k/v written in place into its own
cache slot), `lm_head.bB` and the heads on B rows. `BatchDecoder.step` advances up to B
conversations by one token in one pass: one launch of each net instead of B. Rows left
over when fewer conversations step run on a scratch cache (their results are dropped):
the nets are static, so a step costs B rows whatever the number of conversations in it.

Each row chooses its token as the unbatched `Sampler` would: `greedy_head.bB` for greedy
rows, `sample_head.bB` for rows sampled on the chip (each row its own penalty,
temperature, top-k, top-p and random generator), the logits read back for rows sampled on
the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    ATTENTION_MASK,
    BLOCK_CACHE,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_K,
    HISTORY_V,
    INPUT_IDS,
    LM_HEAD,
    LOGITS,
    PENALTY,
    POSITION_IDS,
    PRESENT_K,
    PRESENT_V,
    PROBS,
    RECENT_IDS,
    SAMPLE_HEAD,
    TEMPERATURE,
    TOKEN,
    TOKEN_IDS,
    TOP_K,
    TOP_P,
    decode_mask,
    row_name,
)
from toptpu.backend.runtime.conversation import Conversation, Engine
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer
from toptpu.backend.runtime.sampler import SamplingConfig, recent_ids, sample_token

_SAMPLE_PARAMS = (RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P)


@dataclass
class BatchRow:
    """One conversation's part of a batch step: the token it feeds, how it chooses the
    next (`sampler`: `Sampler.resolve`'s greedy, sample or host), its random generator and
    the recent ids its repetition penalty sees (the fed token last)."""

    conv: Conversation
    token: int
    sampling: SamplingConfig
    sampler: str
    rng: np.random.Generator
    recent: Sequence[int]


class BatchDecoder:
    """The batch nets of a model file on its engine (see the module doc)."""

    def __init__(self, engine: Engine) -> None:
        nets = engine.nets
        if nets.batch < 2:
            raise GenerationError("the model file has no batch nets; compile it with "
                                  "--batch B (B >= 2)")
        if any(nets.linear):
            raise GenerationError("a model with linear-attention layers has no batch nets")
        self.engine = engine
        self.size = nets.batch
        self.names = {base: nets.batch_net(base) for base in
                      (EMBEDDING_CACHE, LM_HEAD, GREEDY_HEAD, SAMPLE_HEAD)}
        self.layers = [nets.batch_net(BLOCK_CACHE, i) for i in range(nets.num_layers)]
        block = self.layers[0]

        def alloc(net: str, name: str) -> Buffer:
            return engine.alloc(net, name)

        self.ids = alloc(self.names[EMBEDDING_CACHE], INPUT_IDS)
        self.hidden = [alloc(self.names[EMBEDDING_CACHE], HIDDEN), alloc(block, HIDDEN_OUT)]
        self.pos = alloc(block, POSITION_IDS)
        self.mask = alloc(block, ATTENTION_MASK)
        self.logits = alloc(self.names[LM_HEAD], LOGITS)
        self.token = alloc(self.names[GREEDY_HEAD], TOKEN)
        self.head = {name: alloc(self.names[SAMPLE_HEAD], name)
                     for name in (*_SAMPLE_PARAMS, PROBS, TOKEN_IDS)}
        # where the rows no conversation fills attend and write (their results dropped)
        self.scratch_k = alloc(block, row_name(HISTORY_K, 0))
        self.scratch_v = alloc(block, row_name(HISTORY_V, 0))
        self.axes = nets.position_axes
        self.k = nets.sample_k

    def step(self, rows: Sequence[BatchRow]) -> list[int]:
        """Feed each row's token to its conversation (one decode step of all of them) and
        choose each one's next token."""
        B, engine = self.size, self.engine
        ex, nets = engine.ex, engine.nets
        if not 0 < len(rows) <= B:
            raise GenerationError(f"a batch step takes 1 to {B} conversations, not "
                                  f"{len(rows)}")
        if len({id(r.conv) for r in rows}) != len(rows):
            raise GenerationError("a conversation appears twice in one batch step")
        slots = [r.conv.decode_slot() for r in rows]
        ids = np.full((1, B), engine.pad_id, np.int32)
        ids[0, :len(rows)] = [r.token for r in rows]
        pos = np.zeros((self.axes, B), np.int32)
        mask = np.concatenate([decode_mask(0, nets.seq)] * B, axis=2)
        for b, (r, slot) in enumerate(zip(rows, slots, strict=True)):
            pos[:, b] = r.conv.decode_positions()[:, 0]
            mask[:, :, b] = decode_mask(slot, nets.seq)[:, :, 0]
        ex.write(self.ids, ids)
        ex.run(self.names[EMBEDDING_CACHE], {INPUT_IDS: self.ids, HIDDEN: self.hidden[0]})
        ex.write(self.pos, pos)
        ex.write(self.mask, mask)
        src, dst = self.hidden
        for layer, net in enumerate(self.layers):
            bind: dict[str, Buffer] = {HIDDEN: src, HIDDEN_OUT: dst, POSITION_IDS: self.pos,
                                       ATTENTION_MASK: self.mask}
            for b in range(B):
                if b < len(rows):
                    k, v, pk, pv = rows[b].conv.kv_bindings(layer, slots[b])
                else:
                    k, v = self.scratch_k, self.scratch_v
                    pk, pv = k.slot(1, 0, 1), v.slot(1, 0, 1)
                bind.update({row_name(HISTORY_K, b): k, row_name(HISTORY_V, b): v,
                             row_name(PRESENT_K, b): pk, row_name(PRESENT_V, b): pv})
            ex.run(net, bind, layer=layer)
            src, dst = dst, src
        for r in rows:
            r.conv.stepped(r.token)
        ex.run(self.names[LM_HEAD], {HIDDEN: src, LOGITS: self.logits})
        return self._choose(rows)

    def _choose(self, rows: Sequence[BatchRow]) -> list[int]:
        """Each row's next token from the logits [B, V], as its sampler says."""
        ex = self.engine.ex
        out: list[int | None] = [None] * len(rows)
        kinds = [r.sampler for r in rows]
        if "greedy" in kinds:
            ex.run(self.names[GREEDY_HEAD], {LOGITS: self.logits, TOKEN: self.token})
            tokens = ex.read(self.token).reshape(-1)
            for b, r in enumerate(rows):
                if r.sampler == "greedy":
                    out[b] = int(tokens[b])
        if "host" in kinds:
            logits = ex.read(self.logits).reshape(self.size, -1)
            for b, r in enumerate(rows):
                if r.sampler == "host":
                    out[b] = sample_token(logits[b], r.recent, r.sampling, r.rng)
        if "sample" in kinds:
            self._sample(rows, out)
        chosen = [int(t) for t in out if t is not None]
        assert len(chosen) == len(out)
        return chosen

    def _sample(self, rows: Sequence[BatchRow], out: list[int | None]) -> None:
        """The rows sampled on the chip: `sample_head.bB`, each row with its parameters (a
        row that overflows at a tiny temperature: its top penalized candidate, as the
        unbatched sampler takes it)."""
        params = self._params(rows, set())
        probs, ids = self._run_head(params)
        overflow = {b for b, r in enumerate(rows) if r.sampler == "sample"
                    and r.sampling.temperature != 0 and not np.all(np.isfinite(probs[b]))}
        if overflow:
            _, top = self._run_head(self._params(rows, overflow))
        for b, r in enumerate(rows):
            if r.sampler != "sample":
                continue
            if r.sampling.temperature == 0:  # greedy with a penalty: the top candidate
                out[b] = int(ids[b, 0])
            elif b in overflow:
                out[b] = int(top[b, 0])
            else:
                p = probs[b]
                out[b] = int(ids[b, r.rng.choice(p.size, p=p / p.sum())])

    def _params(self, rows: Sequence[BatchRow], top1: set[int]) -> dict[str, np.ndarray]:
        """sample_head.bB's parameter rows: a sampled row's own (as `Sampler.setup` writes
        them; the rows in `top1` at temperature 1, top-k 1), the others a harmless top-1."""
        B, seq = self.size, self.engine.nets.seq
        recent = np.zeros((B, seq), np.int32)
        penalty = np.ones((B, 1), np.float32)
        temperature = np.ones((B, 1), np.float32)
        top_k = np.ones((B, 1), np.int32)
        top_p = np.ones((B, 1), np.float32)
        for b, r in enumerate(rows):
            window = [r.token]
            if r.sampler == "sample":
                cfg = r.sampling
                window = list(r.recent[-cfg.penalty_window:]) if cfg.penalty_window else []
                window = window or [r.token]
                greedy = cfg.temperature == 0 or b in top1
                penalty[b] = cfg.repetition_penalty if cfg.penalty_window else 1.0
                temperature[b] = 1.0 if greedy else cfg.temperature
                top_k[b] = 1 if greedy else cfg.top_k
                top_p[b] = 1.0 if greedy else cfg.top_p
            recent[b] = recent_ids(window, seq)[0]
        return {RECENT_IDS: recent, PENALTY: penalty, TEMPERATURE: temperature, TOP_K: top_k,
                TOP_P: top_p}

    def _run_head(self, params: dict[str, np.ndarray]) -> tuple[np.ndarray, Any]:
        ex, b = self.engine.ex, self.head
        for name, value in params.items():
            ex.write(b[name], value)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ex.run(self.names[SAMPLE_HEAD], {LOGITS: self.logits, **b})
        return (ex.read(b[PROBS]).reshape(self.size, -1).astype(np.float64),
                ex.read(b[TOKEN_IDS]).reshape(self.size, -1))
