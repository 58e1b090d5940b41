"""The windows of the weight cache file's f32 forms that the machine's weight loads hold
(`machine._stored_window`): a load of a weight's part — a slice along one axis and cuts
along others, as the layer groups write for 2-D tiles and reduction parts (a K split) —
names the window of the stored form whose values the kernel would compute from the part's
own bytes. Checked against the kernels on the keys the machine's loads really make
(`LoadStep`'s provenance, `held_key`); a part whose scales do not hold the groups of its
columns has no window (the machine then converts the part itself)."""

from __future__ import annotations

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
import pytest

from toptpu.backend.formats.commands import Cut, GlobalRef, Load, LocalRef, Space
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.local_memory import Local
from toptpu.backend.runtime.machine import _stored_window
from toptpu.backend.runtime.steps import LoadStep, held_key
from toptpu.backend.target.chips import get_chip

CHIP = get_chip("bm1684x")
N, K_COLS, GROUP, BITS = 32, 128, 32, 4  # a 4-bit weight: K_COLS / 2 packed bytes a row


def _load(addr: int, whole: np.ndarray, axis: int, start: int, length: int,
          cuts: tuple[Cut, ...] = ()) -> tuple[Load, tuple]:
    """A load of `whole`'s part and the provenance the machine keeps for it."""
    load = Load(id=0, name="w.load", deps=(), group=0, slice=0,
                tensor=GlobalRef(Space.WEIGHT, "w"), shape=whole.shape,
                dtype=whole.dtype.name, axis=axis, start=start, length=length, cuts=cuts,
                local=LocalRef(addr=0, shape=whole[0:1].shape, dtype=whole.dtype.name,
                               buf=1, nbytes=64))
    step = LoadStep(load, 0, Local.of(load.local, CHIP))
    return load, (addr, *step.prov)


def _a16_weight() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (N, K_COLS * BITS // 8), dtype=np.uint8)
    scales = rng.standard_normal((N, K_COLS // GROUP)).astype(K.BF16)
    zeros = rng.integers(0, 16, (N, K_COLS // GROUP), dtype=np.uint8)
    return q, scales, zeros


@pytest.mark.parametrize(("rows", "cols"), [
    ((0, N), (16, 16)),  # a reduction part: all rows, K bytes 16..31 (columns 32..63)
    ((8, 8), (0, 32)),  # a 2-D tile's rows of K bytes 0..31
    ((8, 16), None),  # a slice of output channels, K whole
])
def test_an_a16_part_is_the_window_of_the_dequantized_weight(rows, cols) -> None:  # noqa: ANN001
    q, scales, zeros = _a16_weight()
    form = K.dequantize(q, scales, zeros, BITS, GROUP)
    per_group = GROUP * BITS // 8  # packed bytes per quantization group
    provs, parts = [], []
    for addr, whole in ((1000, q), (2000, scales), (3000, zeros)):
        g = per_group if whole is q else 1  # columns of `whole` per group
        cuts = () if cols is None else (Cut(1, cols[0] // per_group * g,
                                            cols[1] // per_group * g),)
        load, prov = _load(addr, whole, 0, rows[0], rows[1], cuts)
        provs.append(prov)
        parts.append(whole[load.window()])
    window = _stored_window("a16", held_key(provs), BITS, GROUP)
    assert window is not None
    want = K.dequantize(*parts, BITS, GROUP)
    assert form[window].shape == want.shape and np.array_equal(form[window], want)


def test_scales_that_are_not_the_columns_groups_give_no_window() -> None:
    q, scales, zeros = _a16_weight()
    _, pq = _load(1000, q, 0, 0, N, (Cut(1, 16, 16),))  # the second group's bytes
    _, ps = _load(2000, scales, 0, 0, N, (Cut(1, 2, 1),))  # the third group's scales
    _, pz = _load(3000, zeros, 0, 0, N, (Cut(1, 1, 1),))
    assert _stored_window("a16", held_key([pq, ps, pz]), BITS, GROUP) is None
    _, whole_scales = _load(2000, scales, -1, 0, 0)
    assert _stored_window("a16", held_key([pq, whole_scales, pz]), BITS, GROUP) is None
    _, half = _load(1000, q, 0, 0, N, (Cut(1, 8, 8),))  # half a group's bytes
    _, ps = _load(2000, scales, 0, 0, N, (Cut(1, 0, 1),))
    assert _stored_window("a16", held_key([half, ps, pz]), BITS, GROUP) is None


@pytest.mark.parametrize(("axis", "start", "length", "cuts"), [
    (0, 0, 96, (Cut(1, 16, 16),)),  # a reduction part of a [vocab, hidden] lm_head
    (0, 32, 32, (Cut(1, 0, 16),)),  # a 2-D tile
    (0, 32, 32, ()),  # a slice of rows
])
def test_an_upcast_part_is_the_window_of_the_f32_weight(axis, start, length, cuts) -> None:  # noqa: ANN001
    w = np.random.default_rng(1).standard_normal((96, 64)).astype(K.BF16)
    load, prov = _load(4000, w, axis, start, length, cuts)
    window = _stored_window("f32w", held_key([prov]), 0, 0)
    assert window is not None
    want = K.f32(w[load.window()])
    assert K.f32(w)[window].shape == want.shape and np.array_equal(K.f32(w)[window], want)
