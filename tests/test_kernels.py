"""The backend kernels (the single numeric truth) against torch's implementations."""

from __future__ import annotations

import itertools
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from toptpu.backend.contract import MASK_VALUE, decode_mask, prefill_mask
from toptpu.backend.reference import kernels as K

rng = np.random.default_rng(0)


def _r(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _close(a: np.ndarray, b: torch.Tensor | np.ndarray, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(a, np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("history", [0, 5])
def test_attention_matches_sdpa(hq: int, hkv: int, history: int) -> None:
    b, sq, sk, d = 1, 3, 4, 8
    q, k, v = _r(b, sq, hq, d), _r(b, sk, hkv, d), _r(b, sk, hkv, d)
    hk, hv = (_r(b, history, hkv, d), _r(b, history, hkv, d)) if history else (None, None)
    mask = np.where(rng.random((1, 1, sq, history + sk)) < 0.3, -1e9, 0.0).astype(np.float32)
    mask[..., -1] = 0.0  # every row sees at least one key
    out = K.attention(q, k, v, mask, 0.3, hk, hv)
    kk = np.concatenate([hk, k], 1) if history else k
    vv = np.concatenate([hv, v], 1) if history else v
    t = lambda x: torch.from_numpy(x).transpose(1, 2)  # noqa: E731
    ref = F.scaled_dot_product_attention(t(q), t(kk), t(vv), torch.from_numpy(mask), scale=0.3,
                                         enable_gqa=True).transpose(1, 2)
    _close(out, ref)


def _bf16(*shape: int) -> np.ndarray:
    return K.to_bf16(_r(*shape))


@fuzz_settings(40)
@given(history=st.integers(1, 24), data=st.data(), length=st.integers(1, 3),
       tail=st.sampled_from([0.0, np.nan, np.inf, 3e38]),
       mask_dtype=st.sampled_from([np.float32, K.BF16, np.float16]))
def test_attention_leaves_out_the_hidden_cache_tail(history: int, data: st.DataObject,
                                                     length: int, tail: float,
                                                     mask_dtype: np.dtype) -> None:
    """Cache slots hidden from every query row by the contract's masks (the unfilled tail
    of a decode or prefill_kv cache) are left out: the bytes are those of the attention
    over the filled slots alone, whatever the tail holds (NaN and inf too); in the mask
    dtypes the nets use (bf16 holds MASK_VALUE as -9984)."""
    start = data.draw(st.integers(0, history))
    n = data.draw(st.integers(1, length))  # real tokens; the rest of the chunk is padding
    q, k, v = _bf16(1, length, 4, 8), _bf16(1, length, 2, 8), _bf16(1, length, 2, 8)
    hk, hv = _bf16(1, history, 2, 8), _bf16(1, history, 2, 8)
    hk[:, start:], hv[:, start:] = tail, tail
    mask = prefill_mask(n, length, start, history)
    if length == 1 and start < history:  # a decode step's
        assert (mask == decode_mask(start, history)).all()
    mask = mask.astype(mask_dtype)
    got = K.attention(q, k, v, mask, 0.3, hk, hv)
    kept = np.concatenate([mask[..., :start], mask[..., history:]], axis=-1)
    want = (K.attention(q, k, v, kept, 0.3, hk[:, :start], hv[:, :start]) if start
            else K.attention(q, k, v, kept, 0.3))
    assert got.tobytes() == want.tobytes()
    assert np.isfinite(K.f32(got)).all()


def test_attention_hides_keys_at_the_contracts_mask_value() -> None:
    """The kernel leaves out keys at the contract's MASK_VALUE; a NaN in the mask is not
    a hidden key: it reaches the result as it would over the whole cache."""
    assert K.HIDDEN_KEY == MASK_VALUE
    q, k, v = _bf16(1, 1, 2, 4), _bf16(1, 1, 1, 4), _bf16(1, 1, 1, 4)
    hk, hv = _bf16(1, 6, 1, 4), _bf16(1, 6, 1, 4)
    mask = decode_mask(2, 6)
    mask[..., 4] = np.nan
    assert np.isnan(K.f32(K.attention(q, k, v, mask, 0.5, hk, hv))).all()


def test_causal_attention() -> None:
    q, k, v = _r(1, 5, 2, 4), _r(1, 5, 2, 4), _r(1, 5, 2, 4)
    out = K.attention(q, k, v, None, 0.5, causal=True)
    t = lambda x: torch.from_numpy(x).transpose(1, 2)  # noqa: E731
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, scale=0.5)
    _close(out, ref.transpose(1, 2))


def test_rope_half_and_interleaved() -> None:
    x, ang = _r(1, 6, 2, 8), _r(1, 6, 1, 8)
    c, s = np.cos(ang), np.sin(ang)
    tx = torch.from_numpy(x)
    rot = torch.cat([-tx[..., 4:], tx[..., :4]], -1)
    _close(K.rope(x, c, s, "half"), tx * torch.from_numpy(c) + rot * torch.from_numpy(s))
    pairs = torch.stack([-tx[..., 1::2], tx[..., 0::2]], -1).flatten(-2)
    _close(K.rope(x, c, s, "interleaved"), tx * torch.from_numpy(c) + pairs * torch.from_numpy(s))


def test_norms() -> None:
    x, w, b = _r(2, 5, 16), _r(16), _r(16)
    ref = torch.nn.functional.rms_norm(torch.from_numpy(x), (16,), torch.from_numpy(w), 1e-6)
    _close(K.rms_norm(x, w, 1e-6), ref)
    ref = F.layer_norm(torch.from_numpy(x), (16,), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    _close(K.layer_norm(x, w, b, 1e-5, -1), ref, 1e-4)


@pytest.mark.parametrize("kind", ["silu", "sigmoid", "exp", "tanh", "rsqrt", "sqrt"])
def test_unary(kind: str) -> None:
    x = np.abs(_r(4, 7)) + 0.1 if kind in ("rsqrt", "sqrt") else _r(4, 7)
    fn = {"silu": F.silu, "sigmoid": torch.sigmoid, "exp": torch.exp, "tanh": torch.tanh,
          "rsqrt": torch.rsqrt, "sqrt": torch.sqrt}[kind]
    _close(K.unary(kind, x), fn(torch.from_numpy(x)))


@pytest.mark.parametrize("approx", ["none", "tanh"])
def test_gelu(approx: str) -> None:
    x = _r(64)
    _close(K.unary("gelu", x, approximate=approx), F.gelu(torch.from_numpy(x), approximate=approx))


def test_softmax_reduce_matmul() -> None:
    x = _r(3, 4, 5)
    _close(K.softmax(x, -1), torch.softmax(torch.from_numpy(x), -1))
    _close(K.reduce(x, "mean", [1, 2], True), torch.from_numpy(x).mean((1, 2), keepdim=True))
    _close(K.reduce(x, "max", [0], False), torch.from_numpy(x).amax(0))
    a, w, bias = _r(2, 3, 8), _r(6, 8), _r(6)
    _close(K.matmul(a, w, bias, transpose_b=True),
           F.linear(torch.from_numpy(a), torch.from_numpy(w), torch.from_numpy(bias)))
    bb = _r(2, 8, 4)
    _close(K.matmul(a, bb), torch.from_numpy(a) @ torch.from_numpy(bb))


@pytest.mark.parametrize("groups,stride,pad", [(1, 1, 0), (1, 2, 1), (2, 14, 0)])
def test_conv2d(groups: int, stride: int, pad: int) -> None:
    x, w, b = _r(1, 4, 28, 28), _r(6, 4 // groups, 3, 3), _r(6)
    ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride, pad,
                   1, groups)
    _close(K.conv2d(x, w, b, [stride] * 2, [pad] * 4, [1, 1], groups), ref, 1e-4)


def test_topk_and_gather() -> None:
    x = _r(2, 10)
    vals, idx = K.topk(x, 3, 1)
    tv, ti = torch.topk(torch.from_numpy(x), 3, 1)
    _close(vals, tv)
    assert np.array_equal(idx, ti.numpy())
    table = _r(10, 4)
    ids = np.array([[1, 9, 0]], np.int32)
    assert np.array_equal(K.gather(table, ids, 0), table[ids])
    with pytest.raises(IndexError, match="out of range"):
        K.gather(table, np.array([10]), 0)


def test_half_precision_computes_in_f32_and_rounds_once() -> None:
    a = _r(4, 64).astype(ml_dtypes.bfloat16)
    w = _r(32, 64).astype(ml_dtypes.bfloat16)
    out = K.matmul(a, w, transpose_b=True)
    assert out.dtype == ml_dtypes.bfloat16
    ref = (a.astype(np.float32) @ w.astype(np.float32).T).astype(ml_dtypes.bfloat16)
    assert np.array_equal(out, ref)


def test_bfloat16_to_float32_is_astype_bit_for_bit() -> None:
    """`f32` widens bf16 by moving its bits: every one of the 65536 bf16 values (zeros,
    subnormals, infinities, NaN payloads), contiguous or strided, small (one `astype`) or
    not, gives astype's bits."""
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    nans = every[0x7F81:0x7F81 + K.SMALL_CONVERSION]  # NaN payloads in a small array
    for x in (every, every.reshape(256, 256).T, every[::3], nans, every[-1:]):
        got = K.f32(x)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert np.array_equal(got.view(np.uint32), x.astype(np.float32).view(np.uint32))


def test_float32_to_bfloat16_is_astype_bit_for_bit() -> None:
    """`to_bf16` rounds on the bits: every upper half (sign, exponent, the bf16 mantissa)
    with the lower halves at each rounding edge (exact, just below/at/above the tie, the
    largest) and random ones, contiguous or strided, small (one `astype`), in one piece or
    in chunks with a short last one, gives astype's bytes (NaN's included; all 2^32
    patterns were compared once when it was written)."""
    upper = np.arange(65536, dtype=np.uint32) << 16
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    bits = (upper[:, None] | lower[None, :]).reshape(-1)
    bits = np.concatenate([bits, np.random.default_rng(3).integers(0, 2**32, 1 << 20,
                                                                     dtype=np.uint32)])
    every = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        nan_at = 0x7F81 * len(lower)  # NaNs only in the middle of the small array
        small = every[nan_at - K.SMALL_CONVERSION // 2:][:K.SMALL_CONVERSION]
        chunked = every[nan_at - K.CONVERSION_CHUNK:][:3 * K.CONVERSION_CHUNK + 6]
        for x in (every, every.reshape(-1, 64).T, every[::3], every[:1].reshape(()), small,
                  every[:K.SMALL_CONVERSION + 1], chunked, chunked.reshape(-1, 6)):
            got = K.to_bf16(x)
            assert got.dtype == K.BF16 and got.shape == x.shape
            assert np.array_equal(got.view(np.uint16), x.astype(K.BF16).view(np.uint16))


@pytest.mark.parametrize(("bits", "with_zeros"), [(4, True), (4, False), (8, True), (8, False)])
def test_dequantize_is_the_formula_bit_for_bit(bits: int, with_zeros: bool) -> None:
    """(q - z) * s per group computed in place gives the bits of the plain expression."""
    rng = np.random.default_rng(bits)
    n, k, gs = 48, 256, 64
    if bits == 4:
        qweight = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        q = K.unpack_int4(qweight)
    else:
        qweight = q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scales = (rng.standard_normal((n, k // gs)) * 1e-2).astype(ml_dtypes.bfloat16)
    zeros = rng.integers(0, 2**bits - 1, (n, k // gs)).astype(np.uint8) if with_zeros else None
    z = (zeros.astype(np.float32) if zeros is not None
         else np.full((n, k // gs), 8.0 if bits == 4 else 0.0, np.float32))
    want = ((q.astype(np.float32).reshape(n, -1, gs) - z[:, :, None])
            * scales.astype(np.float32)[:, :, None]).reshape(n, k)
    got = K.dequantize(qweight, scales, zeros, bits, gs)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("bits", "scale_dtype"), [(4, np.float16), (4, np.float32),
                                                   (8, np.float16), (8, np.float32)])
def test_the_scale_and_min_form_is_q_times_s_plus_m_bit_for_bit(bits: int,
                                                                 scale_dtype: type) -> None:
    """With mins (GGUF's Q4_1 / Q5_1 / Q4_K / Q5_K), w = q * s + m: the product rounded to
    f32 first, then the sum (what gguf's dequantizers compute), q the unsigned integer as
    stored; the offsets of the cached form are q itself, and the blocked product of a
    decode step adds the mins the same way."""
    rng = np.random.default_rng(10 + bits)
    n, k, gs = 24, 128, 32
    if bits == 4:
        qweight = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        q = K.unpack_int4(qweight)
    else:
        qweight = q = rng.integers(0, 256, (n, k), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // gs)) * 1e-2).astype(scale_dtype)
    mins = (rng.standard_normal((n, k // gs)) * 1e-1).astype(scale_dtype)
    prod = (q.astype(np.float32).reshape(n, -1, gs)
            * scales.astype(np.float32)[:, :, None])
    want = (prod + mins.astype(np.float32)[:, :, None]).reshape(n, k)
    got = K.dequantize(qweight, scales, None, bits, gs, mins)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    off = K.weight_offsets(qweight, None, bits, gs, with_mins=True)
    assert np.array_equal(off.astype(np.int32), q.astype(np.int32))
    again = K.dequantize_offsets(off, scales, gs, mins)
    assert np.array_equal(again.view(np.uint32), want.view(np.uint32))
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    whole = K.a16_matmul(x, qweight, scales, None, None, bits, gs, np.float32, mins)
    assert np.array_equal(whole, K.matmul_dequantized(x, want, None, np.float32))
    blocked = K.matmul_offsets(x, off, scales, gs, None, np.float32, block_rows=5, mins=mins)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("bits", "zero_max", "narrow"),
                         [(4, None, True), (4, 15, True), (4, 127, True), (4, 255, False),
                          (8, None, True), (8, 255, False)])
def test_weight_offsets_are_exact_in_the_narrowest_integer(bits: int, zero_max: int | None,
                                                           narrow: bool) -> None:
    """q - z as int8 where every difference the operands allow fits (4-bit with zero points
    up to 127; symmetric 8-bit: q itself), else int16 (a hostile 4-bit zero point of 255;
    8-bit ui8 with zero points); exact either way, a new array, and `dequantize_offsets` of
    it is `dequantize` bit for bit."""
    rng = np.random.default_rng(bits * 1000 + (zero_max or 0))
    n, k, gs = 32, 128, 32
    if bits == 4:
        qweight = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        q = K.unpack_int4(qweight).astype(np.int32)
    elif zero_max is None:
        qweight = rng.integers(-128, 128, (n, k), dtype=np.int8)
        q = qweight.astype(np.int32)
    else:
        qweight = rng.integers(0, 256, (n, k), dtype=np.uint8)
        q = qweight.astype(np.int32)
    zeros = (None if zero_max is None
             else rng.integers(0, zero_max + 1, (n, k // gs)).astype(np.uint8))
    if zeros is not None:
        zeros[0, 0] = zero_max  # the extreme is present
    z = (zeros.astype(np.int32) if zeros is not None
         else np.full((n, k // gs), 8 if bits == 4 else 0, np.int32))
    want = (q.reshape(n, -1, gs) - z[:, :, None]).reshape(n, k)
    off = K.weight_offsets(qweight, zeros, bits, gs)
    assert off.dtype == (np.int8 if narrow else np.int16)
    assert np.array_equal(off.astype(np.int32), want)
    assert not np.shares_memory(off, qweight)
    scales = (rng.standard_normal((n, k // gs)) * 1e-2).astype(ml_dtypes.bfloat16)
    got = K.dequantize_offsets(off, scales, gs)
    full = K.dequantize(qweight, scales, zeros, bits, gs)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), full.view(np.uint32))


@given(data=st.data())
@fuzz_settings(200)
def test_topk_is_the_stable_sort_prefix(data: st.DataObject) -> None:
    """`topk` (which partitions a long row instead of sorting it) gives the first k of a
    stable argsort: ties in index order, NaN last, -0.0 equal to 0.0, any axis."""
    n = data.draw(st.sampled_from([5, 40, 300]))
    rows = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    special = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan], np.float32)
    pool = np.concatenate([special, rng.uniform(-4, 4, 8).astype(np.float32)])
    if not data.draw(st.booleans()):  # mostly without NaN: the partitioning path
        pool = pool[~np.isnan(pool)]
    dtype = data.draw(st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32]))
    if dtype is np.int32:  # integers with many ties
        x = rng.integers(-3, 4, (rows, n)).astype(np.int32)
    else:
        x = rng.choice(pool, (rows, n)).astype(dtype)
    axis = data.draw(st.sampled_from([0, 1, -1]))
    size = x.shape[axis]
    k = data.draw(st.integers(1, max(1, size // 10)) | st.integers(1, size))
    largest = data.draw(st.booleans())
    fx = x.astype(np.float32) if dtype is not np.int32 else x
    want = np.take(np.argsort(-fx if largest else fx, axis=axis, kind="stable"),
                   np.arange(k), axis=axis)
    vals, idx = K.topk(x, k, axis, largest)
    assert idx.dtype == np.int32 and np.array_equal(idx, want)
    assert vals.tobytes() == np.take_along_axis(x, want, axis).tobytes()


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_top1_of_a_long_row_is_the_first_extreme(largest: bool, dtype: type) -> None:
    """The greedy head's top-1 (argmin of the keys, not a partition) keeps the lowest index
    among tied extremes, -0.0 equal to 0.0, as the stable sort does."""
    row = np.zeros(1000, np.float32)
    row[[7, 300, 999]] = 3.0 if largest else -3.0  # tied extremes: index 7 wins
    row[5] = -0.0
    x = row.astype(dtype)[None]
    vals, idx = K.topk(x, 1, 1, largest)
    key = -x.astype(np.float32) if largest else x.astype(np.float32)
    assert idx.tolist() == [[7]] == np.argsort(key, axis=1, kind="stable")[:, :1].tolist()
    assert vals.tobytes() == x[:, 7:8].tobytes()
    zeros = np.zeros((1, 1000), dtype)  # all tied: the first
    if dtype is not np.int32:
        zeros[0, 0] = -0.0
    assert K.topk(zeros, 1, 1, largest)[1].tolist() == [[0]]


def _special_values(n: int, dtype: type, seed: int) -> np.ndarray:
    """`n` values of `dtype`: random, with zeros of both signs, infinities, NaN and
    values where exp overflows or underflows mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 100.0, -100.0, 1e-30],
                       np.float32)
    at = rng.integers(0, n, n // 50)
    x[at] = rng.choice(special, at.size)
    return x.astype(dtype)


def _in_pieces(fn, *xs: np.ndarray, piece: int = 1000) -> np.ndarray:  # noqa: ANN001
    """`fn` applied to pieces of the flattened inputs small enough to be computed whole,
    joined: what any chunking of an elementwise kernel must give."""
    flats = [x.reshape(-1) for x in xs]
    parts = [fn(*(f[i:i + piece] for f in flats)) for i in range(0, flats[0].size, piece)]
    return np.concatenate(parts).reshape(xs[0].shape)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_large_elementwise_kernels_give_the_bytes_of_their_small_pieces(dtype: type) -> None:
    """Unary, binary and constant kernels on inputs larger than a chunk (computed a chunk at
    a time) give each element the bytes it gets in a small array (computed whole); the
    broadcast and strided cases, computed whole, too."""
    shape = (3, K.CONVERSION_CHUNK // 4 + 3, 4)  # a chunk and 12 values a leading index
    a = _special_values(int(np.prod(shape)), dtype, 1).reshape(shape)
    b = _special_values(a.size, dtype, 2).reshape(shape)
    kinds = ["rsqrt", "sqrt", "exp", "cos", "sin", "tanh", "sigmoid", "relu", "silu"]
    with np.errstate(all="ignore"):
        for kind in kinds:
            got = K.unary(kind, a)
            assert got.tobytes() == _in_pieces(lambda c, k=kind: K.unary(k, c), a).tobytes()
        got = K.unary("gelu", a, approximate="tanh")
        want = _in_pieces(lambda c: K.unary("gelu", c, approximate="tanh"), a)
        assert got.tobytes() == want.tobytes()
        got = K.unary("pow", a, np.float32, exponent=3.0)
        assert got.dtype == np.float32
        want = _in_pieces(lambda c: K.unary("pow", c, np.float32, exponent=3.0), a)
        assert got.tobytes() == want.tobytes()
        for kind in ["add", "sub", "mul", "div", "max", "min"]:
            got = K.binary(kind, a, b)
            want = _in_pieces(lambda x, y, k=kind: K.binary(k, x, y), a, b)
            assert got.dtype == a.dtype and got.tobytes() == want.tobytes()
        row = b[:1]  # broadcast along the leading axis: computed whole
        got = K.binary("add", a, row)
        want = np.concatenate([K.binary("add", a[i:i + 1], row) for i in range(3)])
        assert got.tobytes() == want.tobytes()
        strided = a.transpose(1, 0, 2)
        got = K.unary("silu", strided)
        assert got.tobytes() == np.ascontiguousarray(K.unary("silu", a).transpose(1, 0, 2)
                                                     ).tobytes()
        for kind, reverse in itertools.product(["add", "sub", "mul", "div"], [False, True]):
            got = K.binary_const(kind, a, 1.5, reverse)
            want = _in_pieces(lambda c, k=kind, r=reverse: K.binary_const(k, c, 1.5, r), a)
            assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["silu", "sigmoid"])
def test_silu_and_sigmoid_of_large_negative_values_are_their_limits_without_warnings(
        kind: str) -> None:
    """exp(-x) overflows below -88 (a real model's outlier activations reach that): the
    result is the limit (-0.0 for silu, 0 for sigmoid), with no numpy warning for the
    user."""
    x = np.array([-1000.0, -100.0, -89.0, 0.0, 5.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = K.unary(kind, x.astype(ml_dtypes.bfloat16)).astype(np.float32)
    ref = torch.nn.functional.silu if kind == "silu" else torch.sigmoid
    want = ref(torch.from_numpy(x)).to(torch.bfloat16).float().numpy()
    assert np.array_equal(got, want)
    assert np.all(got[:3] == 0)
