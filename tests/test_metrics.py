"""The similarity metrics of every stage comparison: two broken outputs never look alike."""

from __future__ import annotations

import math

import numpy as np
import pytest

from toptpu.compare import _row
from toptpu.metrics import similarity


def test_known_values() -> None:
    a = np.array([1.0, 0.0], np.float32)
    b = np.array([0.0, 1.0], np.float32)
    s = similarity(a, b)
    assert s.cosine == 0.0 and s.degenerate is None and not s.exact
    same = similarity(a, a)
    assert same.cosine == pytest.approx(1.0) and same.euclidean == 1.0
    assert same.sqnr_db == math.inf and same.exact
    half = similarity(np.array([1.0, 1.0]), np.array([2.0, 2.0]))
    assert half.cosine == pytest.approx(1.0) and half.euclidean == pytest.approx(1 - 2 / 3)
    assert half.sqnr_db == pytest.approx(10 * math.log10(8 / 2))


@pytest.mark.parametrize("x,ref,why", [
    (np.full(4, np.nan), np.full(4, np.nan), "non-finite"),
    (np.array([1.0, np.nan]), np.array([1.0, np.nan]), "non-finite"),
    (np.array([np.inf, 1.0]), np.array([np.inf, 1.0]), "non-finite"),
    (np.array([1.0, 2.0]), np.array([1.0, np.nan]), "non-finite"),
    (np.zeros(5), np.zeros(5), "all zero"),
])
def test_degenerate_inputs_fail_every_similarity_threshold(x: np.ndarray, ref: np.ndarray,
                                                            why: str) -> None:
    s = similarity(x, ref)
    assert s.degenerate == why
    assert not s.cosine >= 0.5 and not s.euclidean >= 0.5 and s.sqnr_db == -math.inf
    assert why in str(s)


def test_one_side_zero_is_not_similar() -> None:
    s = similarity(np.zeros(3), np.ones(3))
    assert s.cosine == 0.0 and s.degenerate is None


def test_a_comparison_row_passes_exactly_equal_zeros_but_not_nan() -> None:
    assert _row("pos", np.zeros((1, 1)), np.zeros((1, 1)), 0.99).ok
    assert not _row("nan", np.full(3, np.nan), np.full(3, np.nan), 0.99).ok
    assert not _row("zero vs small", np.zeros(3), np.full(3, 1e-30), 0.99).ok


def test_mismatched_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="3 and 4 elements"):
        similarity(np.zeros(3), np.zeros(4))
