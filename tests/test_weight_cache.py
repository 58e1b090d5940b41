"""The executors' cache of converted weights: bounded by a byte budget sized from the host's
free memory (or TOPTPU_WEIGHT_CACHE), never beyond it, and a bad setting is one clear
error."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime import weight_cache
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.weight_cache import (
    ENV_VAR,
    WeightCache,
    default_budget,
    mem_available,
    parse_size,
)


def test_sizes_parse_and_bad_ones_are_refused() -> None:
    assert parse_size("3G") == 3 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("2KiB") == 2048
    assert parse_size("1000") == 1000
    assert parse_size("0") == 0
    for bad in ("", "-1", "3X", "G", "1e9", "lots"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_budget_follows_the_hosts_available_memory(tmp_path, monkeypatch) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert mem_available(str(info)) == 8000000 * 1024
    assert mem_available(str(tmp_path / "absent")) is None
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(weight_cache, "mem_available", lambda: 8 << 30)
    assert default_budget() == 4 << 30  # half of what is available
    monkeypatch.setattr(weight_cache, "mem_available", lambda: None)
    assert default_budget() == weight_cache.FALLBACK_BYTES
    monkeypatch.setenv(ENV_VAR, "64M")
    assert default_budget() == 64 << 20
    monkeypatch.setenv(ENV_VAR, "a lot")
    with pytest.raises(GenerationError, match=f"{ENV_VAR}='a lot' is not a size"):
        default_budget()
    with pytest.raises(GenerationError, match="give 0 or more"):
        WeightCache(-1)


def test_cache_keeps_what_fits_and_converts_the_rest_each_time() -> None:
    cache = WeightCache(budget=3 * 800)  # three 100-element float64 arrays
    made: list[int] = []

    def make(i: int) -> np.ndarray:
        made.append(i)
        return np.full(100, i, np.float64)

    for _ in range(2):
        for i in range(5):
            assert np.array_equal(cache.get(i, lambda i=i: make(i)), np.full(100, i))
    assert made == [0, 1, 2, 3, 4, 3, 4]  # 0..2 kept, 3 and 4 made again
    assert len(cache) == 3 and cache.used == 3 * 800 <= cache.budget
    off = WeightCache(budget=0)
    off.get("w", lambda: make(9))
    off.get("w", lambda: make(9))
    assert len(off) == 0 and made[-2:] == [9, 9]


def _quantized(n: int, rows: int = 64, k: int = 128, gs: int = 32
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`n` random 4-bit weights (qweight, scales, zeros) of [rows, k]: 32 KiB in f32, 8 KiB
    as int8 offsets."""
    rng = np.random.default_rng(n)
    return [(rng.integers(0, 256, (rows, k // 2), dtype=np.uint8),
             (rng.standard_normal((rows, k // gs)) * 1e-2).astype(K.BF16),
             rng.integers(0, 16, (rows, k // gs)).astype(np.uint8)) for _ in range(n)]


@pytest.mark.parametrize(("budget_f32s", "want"), [
    (10.0, {"converted": 8, "offsets": 0}),  # all f32 forms fit: as before
    (4.0, {"converted": 2, "offsets": 6}),  # 2 f32 + 6 offsets = 3.5 f32 sizes
    (1.0, {"converted": 0, "offsets": 4}),  # offsets only, and only 4 of them
])
def test_quantized_weights_fall_back_to_their_offsets_within_the_budget(
        budget_f32s: float, want: dict[str, int], monkeypatch) -> None:  # noqa: ANN001
    """Cycling over 8 quantized weights (a decode step's order): every result is the
    kernel's `dequantize` bit for bit; the cache never exceeds its budget; from the third
    pass on nothing changes: the weights kept as f32 are hits, those kept as offsets are
    expanded from them (no packed weight is unpacked again) and only what fits no form is
    made from its packed bytes each time."""
    weights = _quantized(8)
    f32_bytes = 64 * 128 * 4
    cache = WeightCache(budget=int(budget_f32s * f32_bytes))
    made: list[int] = []
    offsets = K.weight_offsets
    monkeypatch.setattr(K, "weight_offsets", lambda q, *a: made.append(id(q)) or offsets(q, *a))
    per_pass: list[int] = []
    for _ in range(4):
        made.clear()
        for i, (q, s, z) in enumerate(weights):
            got = cache.dequantized(("w", i), q, s, z, 4, 32)
            assert got.tobytes() == K.dequantize(q, s, z, 4, 32).tobytes()
            assert cache.used <= cache.budget
        per_pass.append(len(made) - len(weights))  # minus the reference's own
    assert cache.forms() == want
    uncached = len(weights) - sum(want.values())
    assert per_pass[0] == len(weights) and per_pass[2:] == [uncached, uncached], per_pass


def test_a_conversion_without_a_smaller_form_takes_the_room_of_quantized_f32_forms() -> None:
    """An lm_head's f32 form (no offsets to fall back to) asked for after the quantized
    weights' f32 forms filled the budget: the last of those give way and keep their
    offsets, the conversion is kept, and the next pass settles every weight in a form."""
    weights = _quantized(4)
    f32_bytes = 64 * 128 * 4
    cache = WeightCache(budget=4 * f32_bytes)
    head = np.arange(2 * f32_bytes // 4, dtype=np.float32)  # two f32 weights' size
    for _ in range(2):
        for i, (q, s, z) in enumerate(weights):
            got = cache.dequantized(("w", i), q, s, z, 4, 32)
            assert got.tobytes() == K.dequantize(q, s, z, 4, 32).tobytes()
        assert cache.get("lm_head", lambda: head.copy()).tobytes() == head.tobytes()
        assert cache.used <= cache.budget
    # 3 f32 forms gave way to the head (it takes 2 f32 sizes, each keeps a quarter for its
    # offsets): 1 f32 + 3 offsets + the head = 1 + 0.75 + 2 of the 4 f32 sizes
    assert cache.forms() == {"converted": 2, "offsets": 3}
    assert "lm_head" in cache._items
    # one that would not fit even if every f32 form gave way: nothing gives way
    huge = np.zeros(5 * f32_bytes // 4, np.float32)
    assert cache.get("huge", lambda: huge) is huge
    assert cache.forms() == {"converted": 2, "offsets": 3} and "huge" not in cache._items


def test_decode_products_with_offsets_expand_a_block_at_a_time_once_checked(
        monkeypatch) -> None:  # noqa: ANN001
    """A one-row product with a weight kept as offsets: the first one of its shape computes
    the whole weight's product and the blocked one (`kernels.matmul_offsets`) and returns
    the whole's; later ones use the blocked product only where the bits were the same on
    this host — either way every result has `a16_matmul`'s bytes (whichever the BLAS does,
    so the test holds on any CPU). A prefill-sized input always takes the whole weight."""
    (q, s, z), = _quantized(1, rows=200)
    f32_bytes = 200 * 128 * 4
    x1 = K.to_bf16(np.random.default_rng(1).standard_normal((1, 1, 128)).astype(np.float32))
    x16 = K.to_bf16(np.random.default_rng(2).standard_normal((1, 16, 128)).astype(np.float32))
    bias = np.linspace(-1, 1, 200).astype(np.float32)
    blocked: list[int] = []
    real = K.matmul_offsets

    def counted(*args, **kw) -> np.ndarray:  # noqa: ANN002, ANN003
        blocked.append(1)
        return real(*args, **kw)

    def bit_flipped(*args, **kw) -> np.ndarray:  # noqa: ANN002, ANN003
        r = counted(*args, **kw).copy()
        r.reshape(-1).view(np.uint16)[0] ^= 1
        return r

    for flip in (False, True):  # flip: a BLAS whose blocked products differ in a bit
        monkeypatch.setattr(K, "matmul_offsets", bit_flipped if flip else counted)
        cache = WeightCache(budget=f32_bytes // 2)  # the offsets fit, the f32 form does not
        for x in (x1, x16, x1, x1, x16):  # the first makes and keeps the offsets
            want = K.a16_matmul(x, q, s, z, bias, 4, 32)
            got = cache.a16_product("w", x, q, s, z, 4, 32, bias, None)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        assert cache.forms() == {"converted": 0, "offsets": 1}
        (verdict,) = cache.fused_ok.values()  # one shape checked: the one-row one
        assert not (flip and verdict)
        # the first one-row product (which kept the offsets) is the check's blocked one;
        # then the two later one-row products' if it matched
        assert len(blocked) == 1 + 2 * verdict, (flip, verdict)
        blocked.clear()


def test_a_decode_product_that_keeps_offsets_never_makes_the_whole_f32_form(
        monkeypatch) -> None:  # noqa: ANN001
    """Decode products (one row) cycling over 8 weights of one shape with room for some
    f32 forms and then offsets: the cache keeps the same weights in the same forms as
    when every such product went through `dequantized` (which makes the whole f32 form
    first, then keeps it or the offsets), every result is `a16_matmul`'s bytes, and a
    weight kept as offsets is multiplied from them a block at a time from its first
    product on: no whole f32 form is made for it (only the first product of the shape,
    the check, makes one)."""
    weights = _quantized(8)
    f32_bytes = 64 * 128 * 4
    budget = int(4.0 * f32_bytes)
    x1 = K.to_bf16(np.random.default_rng(4).standard_normal((1, 1, 128)).astype(np.float32))
    whole: list[int] = []
    real = K.dequantize_offsets

    def counted(off, *a, **kw) -> np.ndarray:  # noqa: ANN001, ANN002, ANN003
        whole.append(off.shape[0])
        return real(off, *a, **kw)

    through = WeightCache(budget=budget)  # every product through `dequantized`
    monkeypatch.setattr(through, "_f32_fits", lambda *a: True)
    cache = WeightCache(budget=budget)
    made: list[int] = []
    for c in (through, cache):
        whole.clear()
        monkeypatch.setattr(K, "dequantize_offsets", counted)
        for _ in range(3):
            for i, (q, s, z) in enumerate(weights):
                got = c.a16_product(("w", i), x1, q, s, z, 4, 32, None, None)
                monkeypatch.setattr(K, "dequantize_offsets", real)
                want = K.a16_matmul(x1, q, s, z, None, 4, 32)
                monkeypatch.setattr(K, "dequantize_offsets", counted)
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
                assert c.used <= c.budget
        made.append(len(whole))
    assert cache.forms() == through.forms() == {"converted": 2, "offsets": 6}
    assert set(cache._items) == set(through._items)
    assert set(cache._offsets) == set(through._offsets)
    # whole f32 forms made over the 3 passes: through `dequantized`, the 4 made while they
    # fit (2 given up later), one for each of the 6 weights when it first keeps offsets,
    # and the shape's check; now the 4 and the check only
    assert made == [4 + 6 + 1, 4 + 1], made


def test_the_blocked_product_is_the_whole_products_math() -> None:
    """`matmul_offsets` computes each output as the same f32 dot product as
    `matmul_dequantized` (bitwise equality is the BLAS's business and checked at run time:
    here, equal to a few ulps), with any block size, a partial last block, bias."""
    (q, s, z), = _quantized(1, rows=200)
    off = K.weight_offsets(q, z, 4, 32)
    x = K.to_bf16(np.random.default_rng(3).standard_normal((1, 2, 128)).astype(np.float32))
    bias = np.linspace(-1, 1, 200).astype(np.float32)
    want = K.f32(K.matmul_dequantized(x, K.dequantize_offsets(off, s, 32), bias, np.float32))
    for rows in (1, 7, 64, 200, 512):
        got = K.matmul_offsets(x, off, s, 32, bias, np.float32, block_rows=rows)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    empty = K.matmul_offsets(x, off[:0], s[:0], 32, None, np.float32)  # no output channels
    assert empty.shape == (1, 2, 0)


def test_weights_with_mins_are_cached_and_expanded_with_them() -> None:
    """A scale-and-min weight (float mins, no zero points) kept as offsets (q itself)
    gives `a16_matmul`'s bytes for prefill and decode inputs alike."""
    rng = np.random.default_rng(7)
    q = rng.integers(0, 256, (64, 64), dtype=np.uint8)  # 4-bit: [N, K/2]
    s = (rng.standard_normal((64, 4)) * 1e-2).astype(np.float16)
    m = (rng.standard_normal((64, 4)) * 1e-1).astype(np.float16)
    cache = WeightCache(budget=64 * 128 * 4 // 2)  # the offsets fit, the f32 form does not
    for rows in (16, 1, 1):
        x = rng.standard_normal((1, rows, 128)).astype(np.float32)
        want = K.a16_matmul(x, q, s, None, None, 4, 32, np.float32, m)
        got = cache.a16_product("w", x, q, s, None, 4, 32, None, np.float32, mins=m)
        assert got.tobytes() == want.tobytes()
    assert cache.forms() == {"converted": 0, "offsets": 1}


@pytest.mark.parametrize("policy", ["2", "3"])
def test_blocked_decode_products_split_over_threads_keep_one_threads_bits(
        policy: str, monkeypatch) -> None:  # noqa: ANN001
    """A decode step's blocked products (`matmul_packed`, `matmul_offsets`,
    `matmul_weight_rows`) split their blocks of rows over the threads the policy chooses
    for the whole product (`blas_threads.workers`), at whole blocks: every block is
    multiplied, on more than one thread, and the result has one thread's bytes."""
    from toptpu.backend.reference import blas_threads

    rng = np.random.default_rng(7)
    (q, s, z), = _quantized(1, rows=200)  # 4 blocks of 64 rows, the last of 8
    off = K.weight_offsets(q, z, 4, 32)
    head = K.to_bf16(rng.standard_normal((300, 128)).astype(np.float32))
    x = K.to_bf16(rng.standard_normal((1, 1, 128)).astype(np.float32))
    products = {
        "packed": lambda: K.matmul_packed(x, q, s, z, 32, None),
        "offsets": lambda: K.matmul_offsets(x, off, s, 32, None),
        "weight rows": lambda: K.matmul_weight_rows(x, head, 64)}
    real = K._block_product
    threads: set[int] = set()
    rows: list[int] = []

    def recorded(fx, block, r, r0) -> None:  # noqa: ANN001
        threads.add(threading.get_ident())
        rows.append(r0)
        real(fx, block, r, r0)

    monkeypatch.setattr(K, "_block_product", recorded)
    for name, product in products.items():
        blas_threads.set_policy("1")
        one = product()
        blas_threads.set_policy(policy)
        threads.clear()
        rows.clear()
        try:
            split = product()
        finally:
            blas_threads.set_policy(None)
        assert split.tobytes() == one.tobytes(), name
        assert len(threads) > 1, name
        n = head.shape[0] if name == "weight rows" else q.shape[0]
        assert sorted(rows) == list(range(0, n, 64)), name  # every block once


@pytest.mark.parametrize(("budget_kib", "head_kept"), [(48, False), (128, True)])
def test_a_float_weights_f32_form_leaves_its_room_to_the_quantized_weights_offsets(
        budget_kib: int, head_kept: bool) -> None:
    """A bf16 lm_head's f32 form (32 KiB) is kept only where the budget holds it beside
    the offsets of every quantized weight seen (8 x 8 KiB): kept first (one decode net is
    run when the model opens, before the other layers' weights are seen), given up as
    soon as the offsets need its room, then multiplied a block of rows at a time while
    the budget keeps offsets only; kept where both fit. Every product has
    `a16_matmul`'s bytes."""
    weights = _quantized(8)
    rng = np.random.default_rng(3)
    head = K.to_bf16(rng.standard_normal((64, 128)).astype(np.float32))
    x = K.to_bf16(rng.standard_normal((1, 1, 128)).astype(np.float32))
    cache = WeightCache(budget=budget_kib << 10)
    assert cache.f32_form("head", head) is not None  # no quantized weight seen yet
    for _ in range(3):
        for i, (q, s, z) in enumerate(weights):
            got = cache.a16_product(("w", i), x, q, s, z, 4, 32, None, None)
            assert got.tobytes() == K.a16_matmul(x, q, s, z, None, 4, 32).tobytes()
            assert cache.used <= cache.budget
        form = cache.f32_form("head", head)
        assert (form is not None) == head_kept
        if form is not None:
            assert form.tobytes() == K.f32(head).tobytes()
    assert cache.offsets_needed == 8 * 64 * 128
    if not head_kept:
        assert cache.forms() == {"converted": 0, "offsets": 6}  # 48 KiB of 8 KiB offsets
