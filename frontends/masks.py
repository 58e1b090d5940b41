"""The additive attention masks of the LLM nets (numpy only, so runtimes need no torch).

0 where a key is visible, `MASK_VALUE` (-10000) where it is hidden — not -inf (a fully
masked padded row would turn into NaN) and not finfo.min (overflows in f16). exp(-10000)
is exactly 0 in f32, so a masked key contributes nothing, yet every row stays finite.
Padded rows and columns are fully masked.
"""

from __future__ import annotations

import numpy as np

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
