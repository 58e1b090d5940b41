"""Similarity metrics used for every stage comparison (ARCHITECTURE.md,
"Verification ladder")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Similarity:
    cosine: float
    euclidean: float  # 1 - ||a - b|| / ||(a + b) / 2||
    sqnr_db: float  # 10 log10(||ref||^2 / ||ref - x||^2); inf when equal

    def __str__(self) -> str:
        return f"cos={self.cosine:.6f} euc={self.euclidean:.6f} sqnr={self.sqnr_db:.1f}dB"


def similarity(x: np.ndarray, ref: np.ndarray) -> Similarity:
    """Compare `x` against the reference `ref` (same shape), in float64."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    b = np.asarray(ref, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of {a.size} and {b.size} elements")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        both = np.array_equal(a, b, equal_nan=True)
        return Similarity(1.0 if both else 0.0, 1.0 if both else 0.0,
                          math.inf if both else 0.0)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    if na == 0.0 and nb == 0.0:
        cos = 1.0
    elif na == 0.0 or nb == 0.0:
        cos = 0.0
    else:
        cos = float(np.dot(a, b) / (na * nb))
    mid = np.linalg.norm((a + b) / 2.0)
    euc = 1.0 if diff == 0.0 else (float(1.0 - diff / mid) if mid > 0 else 0.0)
    sqnr = math.inf if diff == 0.0 else (
        float(10.0 * math.log10(nb * nb / (diff * diff))) if nb > 0 else -math.inf)
    return Similarity(cos, euc, sqnr)
