"""Choosing the next token: on the chip (`greedy_head`, `sample_head`) or on the host.

The next token is chosen where the real deployment chooses it: `lm_head` computes the
logits, then `greedy_head` (argmax) or `sample_head` (repetition penalty over a recent
window, temperature, top-k, top-p; the host draws one of its K candidates) runs on the
chip. `SamplingConfig.sampler` "host" reads the logits back and samples on the host
(`sample_token`, numpy; also what "auto" does when the chip's head cannot: top-k off or
above K); both samplers draw from the same distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toptpu.backend.contract import (
    GREEDY_HEAD,
    HIDDEN,
    LM_HEAD,
    LOGITS,
    PENALTY,
    PROBS,
    RECENT_IDS,
    REPETITION_PENALTY_RANGE,
    SAMPLE_HEAD,
    TEMPERATURE,
    TOKEN,
    TOKEN_IDS,
    TOP_K,
    TOP_P,
)
from toptpu.backend.runtime.conversation import Engine
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer

#: where `SamplingConfig.sampler` may choose the token
SAMPLER_CHOICES = ("auto", "chip", "host")
#: sample_head's inputs besides the logits, and its outputs
_SAMPLE_IO = (RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P, PROBS, TOKEN_IDS)


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    repetition_penalty: float = 1.0  # 1: off
    penalty_window: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None
    sampler: str = "auto"  # chip | host | auto (chip where its heads can, else host)

    def validate(self) -> None:
        """Refuse values that have no meaning (NaN, infinities, out of range)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"temperature must be a finite number >= 0 (0: greedy), got "
                                  f"{self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # False for NaN
            raise GenerationError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:  # False for NaN
            raise GenerationError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1: off), "
                                  f"got {self.repetition_penalty}")
        if not _is_int(self.penalty_window) or self.penalty_window < 0:
            raise GenerationError(f"penalty_window must be an integer >= 0, got "
                                  f"{self.penalty_window}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be an integer >= 0, got {self.seed}")
        if self.sampler not in SAMPLER_CHOICES:
            raise GenerationError(f"sampler must be one of {', '.join(SAMPLER_CHOICES)}, got "
                                  f"{self.sampler!r}")

    @property
    def greedy(self) -> bool:
        """Plain argmax without penalty: greedy_head suffices."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def sample_token(logits: np.ndarray, recent: Sequence[int], cfg: SamplingConfig,
                 rng: np.random.Generator) -> int:
    """Choose the next token from logits [V] (host-side sampling, numpy).

    Order as in transformers: repetition penalty (logit / p if positive, * p if negative,
    for each distinct id of the recent window), temperature, top-k, top-p, then a draw.
    """
    x = np.asarray(logits, dtype=np.float32).reshape(-1).copy()
    if cfg.repetition_penalty != 1.0 and recent and cfg.penalty_window:
        ids = np.unique(np.asarray(recent[-cfg.penalty_window:], dtype=np.int64))
        v = x[ids]
        x[ids] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
    if cfg.temperature == 0:
        return int(np.argmax(x))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = x / np.float32(cfg.temperature)
    if not np.isfinite(np.max(scaled)):
        # a temperature so low (or a penalty so strong) that the top logit overflows: all
        # the probability is on the argmax, the limit of the distribution as T -> 0
        return int(np.argmax(x))
    x = scaled
    if cfg.top_k and cfg.top_k < x.size:
        kth = np.partition(x, -cfg.top_k)[-cfg.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, cfg.top_p) + 1)  # the smallest set reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def recent_ids(window: Sequence[int], seq_length: int) -> np.ndarray:
    """sample_head's `recent_ids` [1, SEQ]: the window's ids, the slots after them repeating
    the first (penalized once, like the host's set of distinct ids)."""
    if not window or len(window) > seq_length:
        raise GenerationError(f"the penalty window holds {len(window)} ids; sample_head "
                              f"takes 1 to {seq_length}")
    out = np.full((1, seq_length), int(window[0]), np.int32)
    out[0, :len(window)] = window
    return out


class Sampler:
    """The heads of a model file on its engine: logits from a hidden row, and the next
    token from them (see the module doc). Its buffers are the heads' IO."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.logits = engine.alloc(LM_HEAD, LOGITS)
        self.token = engine.alloc(GREEDY_HEAD, TOKEN)
        self.head = {name: engine.alloc(SAMPLE_HEAD, name) for name in _SAMPLE_IO}
        self.k = engine.nets.sample_k

    def resolve(self, cfg: SamplingConfig) -> str:
        """How `cfg` chooses tokens here: 'greedy' (greedy_head), 'sample' (sample_head) or
        'host' (logits read back). A chip request the heads cannot serve is an error
        naming why; 'auto' then falls back to the host."""
        if cfg.sampler == "host":
            return "host"
        if cfg.greedy:
            return "greedy"
        if cfg.temperature == 0 or 1 <= cfg.top_k <= self.k:
            return "sample"
        if cfg.sampler == "auto":
            return "host"
        why = "off (0)" if cfg.top_k == 0 else f"{cfg.top_k}"
        raise GenerationError(
            f"the chip's sample_head keeps the {self.k} most likely tokens, so "
            f"sampling on the chip needs a top-k between 1 and {self.k} (top-k is "
            f"{why}); pass --top-k in that range, or --sampler host to sample from the "
            "whole vocabulary")

    def setup(self, cfg: SamplingConfig) -> None:
        """sample_head's parameters, once per generation (temperature 0 with a penalty:
        the top candidate of temperature 1, top-k 1)."""
        ex, b = self.engine.ex, self.head
        greedy = cfg.temperature == 0
        ex.write(b[PENALTY], np.array([[cfg.repetition_penalty if cfg.penalty_window
                                         else 1.0]], np.float32))
        ex.write(b[TEMPERATURE], np.array([[1.0 if greedy else cfg.temperature]], np.float32))
        ex.write(b[TOP_K], np.array([[1 if greedy else cfg.top_k]], np.int32))
        ex.write(b[TOP_P], np.array([[1.0 if greedy else cfg.top_p]], np.float32))

    def logits_of(self, hidden_row: Buffer) -> np.ndarray:
        """The logits [V] (f32) after the hidden row [1, 1, H] (lm_head, read back)."""
        ex = self.engine.ex
        ex.run(LM_HEAD, {HIDDEN: hidden_row, LOGITS: self.logits})
        return ex.read(self.logits).reshape(-1).astype(np.float32)

    def next_token(self, hidden_row: Buffer, cfg: SamplingConfig, sampler: str,
                   rng: np.random.Generator, recent: Sequence[int]) -> int:
        """The token after the hidden row, chosen as `sampler` (`resolve`) says."""
        ex, b = self.engine.ex, self.head
        ex.run(LM_HEAD, {HIDDEN: hidden_row, LOGITS: self.logits})
        if sampler == "host":
            return sample_token(ex.read(self.logits), recent, cfg, rng)
        if sampler == "greedy":
            ex.run(GREEDY_HEAD, {LOGITS: self.logits, TOKEN: self.token})
            return int(ex.read(self.token).reshape(-1)[0])
        window = list(recent[-cfg.penalty_window:]) if cfg.penalty_window else []
        ex.write(b[RECENT_IDS], recent_ids(window, self.engine.nets.seq))
        probs, ids = self._run_sample_head()
        if cfg.temperature == 0:  # greedy with a penalty: the top candidate
            return int(ids[0])
        if not np.all(np.isfinite(probs)):
            # a temperature so low that the scaled logits overflow: all the probability is
            # on the top penalized logit (as on the host). Candidates tied at +inf come in
            # no order, so the head runs once more at temperature 1, top-k 1 for it.
            ex.write(b[TEMPERATURE], np.array([[1.0]], np.float32))
            ex.write(b[TOP_K], np.array([[1]], np.int32))
            _, ids = self._run_sample_head()
            self.setup(cfg)
            return int(ids[0])
        return int(ids[rng.choice(probs.size, p=probs / probs.sum())])

    def _run_sample_head(self) -> tuple[np.ndarray, np.ndarray]:
        """sample_head on the logits buffer: (probabilities f64, candidate ids). Overflow in
        the chip's arithmetic (a tiny temperature) is a result the caller handles, not a
        warning for the user."""
        ex, b = self.engine.ex, self.head
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ex.run(SAMPLE_HEAD, {LOGITS: self.logits, **b})
        return (ex.read(b[PROBS]).reshape(-1).astype(np.float64),
                ex.read(b[TOKEN_IDS]).reshape(-1))
