"""Similarity metrics used for every stage comparison (ARCHITECTURE.md,
"Verification ladder").

Two broken outputs must never look alike: a tensor holding NaN or inf, or a pair of tensors
that are both all zero, has no direction to compare, so its similarity is *degenerate* —
cosine and euclidean similarity 0, SQNR -inf, and `degenerate` says why. A check of
`cosine >= threshold` fails on it. Where two exactly equal finite tensors are the right
answer whatever their values (a comparison report of every intermediate tensor, some of
which are legitimately zero), the caller asks `Similarity.exact`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Similarity:
    cosine: float
    euclidean: float  # 1 - ||a - b|| / ||(a + b) / 2||
    sqnr_db: float  # 10 log10(||ref||^2 / ||ref - x||^2); inf when equal
    #: why the tensors could not be compared (None: they could): 'non-finite' or 'all zero'
    degenerate: str | None = None
    #: the two tensors are bit for bit the same finite values
    exact: bool = False

    def __str__(self) -> str:
        text = f"cos={self.cosine:.6f} euc={self.euclidean:.6f} sqnr={self.sqnr_db:.1f}dB"
        return f"{text} ({self.degenerate})" if self.degenerate else text


def similarity(x: np.ndarray, ref: np.ndarray) -> Similarity:
    """Compare `x` against the reference `ref` (same size), in float64."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    b = np.asarray(ref, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of {a.size} and {b.size} elements")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return Similarity(0.0, 0.0, -math.inf, degenerate="non-finite")
    exact = bool(np.array_equal(a, b))
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 and nb == 0.0:
        return Similarity(0.0, 0.0, -math.inf, degenerate="all zero", exact=exact)
    diff = np.linalg.norm(a - b)
    cos = 0.0 if na == 0.0 or nb == 0.0 else float(np.dot(a, b) / (na * nb))
    mid = np.linalg.norm((a + b) / 2.0)
    euc = 1.0 if diff == 0.0 else (float(1.0 - diff / mid) if mid > 0 else 0.0)
    sqnr = math.inf if diff == 0.0 else (
        float(10.0 * math.log10(nb * nb / (diff * diff))) if nb > 0 else -math.inf)
    return Similarity(cos, euc, sqnr, exact=exact)
