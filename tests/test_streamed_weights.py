"""Weights streamed from the mapped model file (a 7B's run within 6 GB): a weight cache
smaller than the model and the mapped weight pages released after every run give the
logits of an unbounded cache bit for bit; what is released and what is made straight from
the packed bytes is counted (no RSS measured: the checks hold on any host)."""

from __future__ import annotations

import numpy as np
import pytest
from llm_fixtures import compiled

from toptpu.backend.formats.model_file import ModelFile, ModelFileError
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime import weight_cache as wc
from toptpu.backend.runtime import weight_pages
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime

IDS = [3, 14, 15, 92, 65, 35, 89, 79]


def _logits(rt: Runtime) -> np.ndarray:
    """The prompt's teacher-forced logits, then those of 4 greedy decode steps."""
    prompt = rt.sequence_logits(IDS)
    gen = rt.generate(IDS, 4, stop_on_eos=False)
    return np.concatenate([prompt.reshape(-1), np.asarray(gen.generated_ids, np.float32)])


@pytest.mark.parametrize("budget_share", [0, 20])
def test_a_budget_below_the_model_and_released_pages_give_the_same_logits(
        tmp_path_factory, budget_share: int) -> None:
    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    full = Runtime(MachineExecutor(path, weight_cache_bytes=1 << 40, stream_weights=False))
    want = _logits(full)
    want_again = _logits(full)  # (with every converted form kept)
    assert want.tobytes() == want_again.tobytes()
    used = full.ex.machine.cache.used  # type: ignore[attr-defined]
    assert full.ex.released_bytes == 0  # type: ignore[attr-defined]
    budget = used // budget_share if budget_share else 0
    ex = MachineExecutor(path, weight_cache_bytes=budget, stream_weights=True)
    small = Runtime(ex)
    for _ in range(2):
        got = _logits(small)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    cache = ex.machine.cache
    assert cache.used <= cache.budget
    assert cache.streamed > 0  # decode products made from the packed bytes
    assert ex.released_bytes > 0
    # every run releases the pages of the weights it read (a whole chunk at least a page)
    assert ex.released_bytes >= sum(ex.stats[n].runs for n in ex.stats
                                    if ex.nets()[n].per_layer) * 4096


def test_streamed_products_are_the_cached_ones_bit_for_bit(monkeypatch) -> None:  # noqa: ANN001
    """A decode product with a weight kept in no form (cache budget 0) is made a few rows'
    offsets at a time from the packed bytes, several blocks of STREAM_ROWS with a partial
    last one: `a16_matmul`'s bytes, with and without zero points, bias, mins; a prefill
    product takes the whole weight; a BLAS whose blocked products differ in a bit leaves
    every product whole."""
    monkeypatch.setattr(wc, "STREAM_ROWS", 128)
    rng = np.random.default_rng(5)
    n, k, gs = 300, 256, 32
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = (rng.standard_normal((n, k // gs)) * 1e-2).astype(np.float16)
    z = rng.integers(0, 16, (n, k // gs), dtype=np.uint8)
    m = (rng.standard_normal((n, k // gs)) * 1e-1).astype(np.float16)
    bias = np.linspace(-1, 1, n).astype(np.float32)
    for zeros, mins, b in ((z, None, bias), (None, None, None), (None, m, None)):
        cache = wc.WeightCache(0)
        for rows in (1, 16, 1, 1):
            x = K.to_bf16(rng.standard_normal((1, rows, k)).astype(np.float32))
            want = K.a16_matmul(x, q, s, zeros, b, 4, gs, None, mins)
            got = cache.a16_product("w", x, q, s, zeros, 4, gs, b, None, mins=mins)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        assert cache.streamed == 3 and len(cache) == 0 and cache.used == 0
    def bit_flipped(real):  # noqa: ANN001, ANN202
        def flipped(*args, **kw) -> np.ndarray:  # noqa: ANN002, ANN003
            r = real(*args, **kw).copy()
            r.reshape(-1).view(np.uint32)[0] ^= 1 << 22  # (kept by the bf16 rounding)
            return r
        return flipped

    # the blocked products from offsets and from packed bytes (the same blocks)
    monkeypatch.setattr(K, "matmul_offsets", bit_flipped(K.matmul_offsets))
    monkeypatch.setattr(K, "matmul_packed", bit_flipped(K.matmul_packed))
    cache = wc.WeightCache(0)
    for _ in range(3):
        x = K.to_bf16(rng.standard_normal((1, 1, k)).astype(np.float32))
        want = K.a16_matmul(x, q, s, z, None, 4, gs)
        assert cache.a16_product("w", x, q, s, z, 4, gs, None, None).tobytes() == \
            want.tobytes()
    assert list(cache.fused_ok.values()) == [False]


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_products_from_packed_bytes_are_matmul_offsets_bit_for_bit(gs: int) -> None:
    """`kernels.matmul_packed` (each block's offsets made from the packed bytes in cache)
    gives `matmul_offsets` of the weight's offsets byte for byte: zero points over the
    whole int8-safe range (-112..127), the implied 8, mins instead; one row and several,
    a partial last block, bias, an output dtype; None (the caller's offsets) where q - z
    leaves int8."""
    rng = np.random.default_rng(gs)
    n, k = 203, 512
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = (rng.standard_normal((n, k // gs)) * 1e-2).astype(K.BF16)
    m = (rng.standard_normal((n, k // gs)) * 1e-1).astype(np.float16)
    cases = [(rng.integers(0, 16, (n, k // gs), dtype=np.uint8), None),
             (rng.integers(-112, 128, (n, k // gs)).astype(np.int32), None),
             (None, None), (None, m)]
    bias = np.linspace(-1, 1, n).astype(np.float32)
    for zeros, mins in cases:
        off = K.weight_offsets(q, zeros, 4, gs, mins is not None)
        assert off.dtype == np.int8
        for shape, b, out in (((1, k), None, None), ((1, 1, k), bias, np.float32),
                              ((3, k), bias, None)):
            x = K.to_bf16(rng.standard_normal(shape).astype(np.float32))
            for rows in (64, 50):
                want = K.matmul_offsets(x, off, s, gs, b, out, block_rows=rows, mins=mins)
                got = K.matmul_packed(x, q, s, zeros, gs, b, out, block_rows=rows,
                                      mins=mins)
                assert got is not None and got.dtype == want.dtype
                assert got.tobytes() == want.tobytes()
    x = K.to_bf16(rng.standard_normal((1, k)).astype(np.float32))
    for bad in (128, -113):
        zeros = np.full((n, k // gs), 3, np.int32)
        zeros[7, 0] = bad
        assert K.matmul_packed(x, q, s, zeros, gs, None) is None
        assert not wc.packed_int8(zeros)
        cache = wc.WeightCache(0)  # streamed from offsets (int16) instead, same bytes
        for _ in range(2):
            got = cache.a16_product("w", x, q, s, zeros, 4, gs, None, None)
            assert got.tobytes() == K.a16_matmul(x, q, s, zeros, None, 4, gs).tobytes()


@pytest.mark.parametrize(("k", "gs"), [(512, 64), (12, 4)])
def test_a_tiled_decode_product_is_the_whole_weights_product(k: int, gs: int) -> None:
    """A decode step's product converted a tile of rows at a time in cache
    (`kernels.matmul_packed`, from the packed bytes; `kernels.matmul_offsets`, from kept
    offsets) against the whole weight's f32 form multiplied at once (`a16_matmul`): every
    output is the same dot product of the same f32 weights, so within 1e-6 relative at any
    tile height, and bit for bit wherever this host's BLAS gives that many output columns
    the whole product's bits (checked here on the f32 weights themselves, as the weight
    cache checks each shape at run time). Both spreads of the nibbles (in `weight_offsets`
    too, checked against unpacking the nibbles one by one): whole uint64 lanes (K/2 a
    multiple of 4) and uint16 lanes (K = 12); zero points, the implied 8, mins; a partial
    last tile."""
    rng = np.random.default_rng(k)
    n = 203
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = (rng.random((n, k // gs)) * 1e-2 + 1e-3).astype(K.BF16)
    m = (rng.standard_normal((n, k // gs)) * 1e-1).astype(np.float16)
    x = K.to_bf16(rng.standard_normal((1, k)).astype(np.float32))
    fx = K.f32(x)
    for zeros, mins in ((rng.integers(0, 16, (n, k // gs), dtype=np.uint8), None),
                        (None, None), (None, m)):
        w = K.dequantize(q, s, zeros, 4, gs, mins)
        whole = K.a16_matmul(x, q, s, zeros, None, 4, gs, np.float32, mins)
        off = K.weight_offsets(q, zeros, 4, gs, mins is not None)
        z = (0 if mins is not None else 8) if zeros is None else \
            zeros.astype(np.int16)[:, :, None]
        unpacked = K.unpack_int4(q).astype(np.int16).reshape(n, -1, gs)  # the reference
        assert off.dtype == np.int8 and np.array_equal(off.reshape(n, -1, gs), unpacked - z)
        for rows in (64, 16, 4, 7, 1):
            same_bits = all(
                (fx @ w[r0:r0 + rows].T).tobytes() == whole[:, r0:r0 + rows].tobytes()
                for r0 in range(0, n, rows))
            for tiled in (K.matmul_packed(x, q, s, zeros, gs, None, np.float32, rows, mins),
                          K.matmul_offsets(x, off, s, gs, None, np.float32, rows, mins)):
                assert tiled is not None and tiled.shape == whole.shape
                np.testing.assert_allclose(tiled, whole, rtol=1e-6,
                                           atol=1e-6 * float(np.abs(whole).max()))
                if same_bits:
                    assert tiled.tobytes() == whole.tobytes(), (rows, zeros is None)
        assert (fx @ w[:64].T).tobytes() == whole[:, :64].tobytes()  # (this host: 64 rows)


def test_an_lm_head_over_the_cache_is_multiplied_a_block_of_rows_at_a_time(
        tmp_path_factory, monkeypatch) -> None:  # noqa: ANN001
    """A bf16 lm_head whose f32 form the cache does not keep (budget 0 here; a 14B model's
    3.1 GB f32 lm_head over the 2.5 GiB cap) is converted and multiplied STREAM_ROWS rows of
    the vocabulary at a time, never whole: the prompt's and the decode steps' logits are
    those of the whole f32 form kept in an unbounded cache, bit for bit (several blocks
    and the first check on a prefix of the vocabulary: CHECK_ROWS below its 384 rows)."""
    monkeypatch.setattr(wc, "STREAM_ROWS", 16)
    monkeypatch.setattr(wc, "CHECK_ROWS", 48)
    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    full = Runtime(MachineExecutor(path, weight_cache_bytes=1 << 40, stream_weights=False))
    want = _logits(full)
    assert full.ex.machine.cache.blocked == 0  # type: ignore[attr-defined]
    ex = MachineExecutor(path, weight_cache_bytes=0, stream_weights=True)
    small = Runtime(ex)
    for _ in range(2):
        got = _logits(small)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    cache = ex.machine.cache
    assert cache.blocked > 0 and len(cache) == 0
    checked = [v for k, v in cache.fused_ok.items() if k[0] == "f32w"]
    assert checked and all(checked)  # a prompt's shape and a decode step's at least


def test_blocked_float_products_are_the_whole_ones_and_refused_where_they_differ(
        monkeypatch) -> None:  # noqa: ANN001
    """`f32_rows_product`: a bf16 weight [N, K] not kept (no f32 form made whole) times
    one row: `matmul(x, w, transpose_b=True)`'s f32 bytes, with a partial last block;
    several rows: None (the caller's whole product); the first product of a shape is
    checked (on the first CHECK_ROWS rows): a BLAS whose blocked products differ in a bit
    gets None from then on."""
    monkeypatch.setattr(wc, "STREAM_ROWS", 32)
    monkeypatch.setattr(wc, "CHECK_ROWS", 96)
    rng = np.random.default_rng(11)
    w = K.to_bf16(rng.standard_normal((300, 128)).astype(np.float32))
    cache = wc.WeightCache(0)
    assert cache.f32_form("head", w) is None and cache.f32_form("head", w, keep=False) is None
    for shape in ((1, 128), (1, 1, 128), (1, 128), (1, 1, 128)):
        x = K.to_bf16(rng.standard_normal(shape).astype(np.float32))
        want = K.matmul(x, w, transpose_b=True, out_dtype=np.float32)
        got = cache.f32_rows_product(x, w)
        assert got is not None and got.tobytes() == want.tobytes()
    assert cache.blocked == 4 and cache.used == 0 and len(cache.fused_ok) == 2
    x5 = K.to_bf16(rng.standard_normal((1, 5, 128)).astype(np.float32))
    assert cache.f32_rows_product(x5, w) is None and cache.blocked == 4
    roomy = wc.WeightCache(1 << 20)  # the f32 form fits: kept, as before
    form = roomy.f32_form("head", w)
    assert form is not None and form.tobytes() == K.f32(w).tobytes() and len(roomy) == 1
    real = K.matmul_weight_rows

    def bit_flipped(*args, **kw) -> np.ndarray:  # noqa: ANN002, ANN003
        r = real(*args, **kw)
        r.reshape(-1).view(np.uint32)[0] ^= 1
        return r

    monkeypatch.setattr(K, "matmul_weight_rows", bit_flipped)
    cache = wc.WeightCache(0)
    x = K.to_bf16(rng.standard_normal((1, 128)).astype(np.float32))
    assert cache.f32_rows_product(x, w) is None and cache.f32_rows_product(x, w) is None
    assert list(cache.fused_ok.values()) == [False] and cache.blocked == 0


def test_release_drops_whole_pages_of_a_range_and_reads_stay_the_same(
        tmp_path_factory) -> None:
    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    with ModelFile(path) as f:
        info = f.sections["weights"]
        before = f.read("weights")
        page = 4096
        assert f.release(info.offset + 1, page) == 0  # no whole page inside
        assert f.release(info.offset, info.size) == info.size // page * page
        assert f.release(0, 0) == 0
        assert f.read("weights") == before


def test_streaming_is_chosen_by_size_or_the_environment(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(wc.STREAM_ENV_VAR, raising=False)
    assert not weight_pages.streams_weights(wc.STREAM_ABOVE)
    assert weight_pages.streams_weights(wc.STREAM_ABOVE + 1)
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "on")
    assert weight_pages.streams_weights(1)
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "off")
    assert not weight_pages.streams_weights(1 << 40)
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "sometimes")
    with pytest.raises(ModelFileError, match="give auto, on or off"):
        weight_pages.streams_weights(1)
    monkeypatch.delenv(wc.ENV_VAR, raising=False)
    monkeypatch.setattr(wc, "mem_available", lambda: 16 << 30)
    assert wc.default_budget() == 8 << 30  # half of what is available
    assert wc.default_budget(streaming=True) == wc.STREAMING_CAP
    monkeypatch.setenv(wc.ENV_VAR, "5G")
    assert wc.default_budget(streaming=True) == 5 << 30  # the environment's, uncapped


def test_checksums_checked_a_window_at_a_time_still_find_a_flipped_byte(
        tmp_path_factory, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The sections' sha256 hashed HASH_WINDOW bytes at a time (each window's pages
    released after): a good file opens, a byte flipped in a later window is found."""
    import shutil

    from toptpu.backend.formats import model_file
    from toptpu.backend.formats.model_file import ModelFileError

    monkeypatch.setattr(model_file, "HASH_WINDOW", 3 * 4096 + 64)  # not a page multiple
    monkeypatch.setattr(model_file, "RELEASE_CHECKED_ABOVE", 0)  # released as a 7B's
    src = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    path = str(tmp_path / "m.toptpu")
    shutil.copyfile(src, path)
    with ModelFile(path) as f:
        info = f.sections["weights"]
    assert info.size > 4 * model_file.HASH_WINDOW
    at = info.offset + info.size - 100  # in the last window
    with open(path, "r+b") as out:
        out.seek(at)
        byte = out.read(1)
        out.seek(at)
        out.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ModelFileError, match="checksum mismatch in section 'weights'"):
        ModelFile(path)
