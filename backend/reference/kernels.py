"""numpy kernels: the single numeric truth of every op.

The Top interpreter, the Tpu interpreter, constant folding and the reference machine all
call these functions; no other module re-implements an op's math.

Every product is `np.matmul` on the BLAS threads `blas_threads` chooses for its size (the
same bits on any count); the products made a block of a weight's rows at a time (a decode
step's 4-bit and bf16 weights: `matmul_packed`, `matmul_offsets`, `matmul_weight_rows`)
split their blocks over that many Python threads instead (`_row_blocks`: the same blocks).

Conventions: inputs are numpy arrays (float32, float16, ml_dtypes.bfloat16, ints);
floating-point math is done in float32 (f32 accumulation, as the chip does) and the
result is rounded to `out_dtype` (default: the dtype of the first input).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from toptpu.backend.reference.blas_threads import matmul as _matmul
from toptpu.backend.reference.blas_threads import products as _products
from toptpu.backend.reference.blas_threads import workers as _workers

BF16 = np.dtype(ml_dtypes.bfloat16)
HALF_TYPES = (np.dtype(np.float16), BF16)
#: a kernel's output dtype: None for its input's
OutDType: TypeAlias = "DTypeLike | None"


#: arrays of at most this many elements convert with one `astype` call: below it, the cost
#: of a numpy call dominates and the bit operations make several (same bytes either way)
SMALL_CONVERSION = 8192
#: elements per chunk of large elementwise work (a float32 -> bf16 rounding, the unary,
#: binary and constant kernels): its temporaries stay in a core's cache (`_by_chunks`)
CONVERSION_CHUNK = 1 << 16


def f32(x: np.ndarray) -> np.ndarray:
    """View/convert any float array as float32 for computing."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return x
    if x.dtype == BF16 and x.size > SMALL_CONVERSION:
        # a bf16 is the upper half of the float32 of the same value (NaN payloads too):
        # the same bits as `astype`, ~4x faster
        bits = x.view(np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    return x.astype(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, rounded to nearest even: the bytes of `astype(bfloat16)`
    (ml_dtypes: a NaN becomes the quiet NaN of its sign), ~2x faster on the bits for all
    but small arrays; a large contiguous array a chunk at a time."""
    x = np.asarray(x, dtype=np.float32)
    if x.size <= SMALL_CONVERSION:
        return x.astype(BF16)
    bits = _by_chunks(_to_bf16_bits, x)
    return (_to_bf16_bits(x) if bits is None else bits).view(BF16)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """`to_bf16`'s bits (uint16) of float32 `x`, computed on its bits."""
    b = x.view(np.uint32)
    r = b >> 16
    r &= 1  # ties go to the even upper half
    r += 0x7FFF
    r += b  # a finite value never wraps: the largest magnitude rounds up to infinity
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((b[nan] >> 16) & 0x8000) | 0x7FC0
    return out


def round_to(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """`x` as dtype `dt` (rounded the way `astype` rounds); `x` itself when it has it."""
    if x.dtype == dt:
        return x
    if dt == BF16 and x.dtype == np.float32:
        return to_bf16(x)
    return x.astype(dt)


def _out(x: np.ndarray, out_dtype: OutDType, like: np.ndarray) -> np.ndarray:
    dt = np.dtype(out_dtype) if out_dtype is not None else np.asarray(like).dtype
    return round_to(x, dt)


def _by_chunks(kernel: Callable[..., np.ndarray], *xs: np.ndarray) -> np.ndarray | None:
    """An elementwise `kernel` (arrays -> its result) on large C-contiguous inputs of one
    shape, CONVERSION_CHUNK elements at a time into one result: each element is computed
    alone, so the bytes are the whole call's, and the f32 temporaries stay in cache
    instead of being whole fresh arrays (4-5x faster for a [128, 4864] bf16 product on one
    host). None where the inputs do not qualify (small, strided, broadcast)."""
    first = xs[0]
    if first.size <= CONVERSION_CHUNK or any(
            x.shape != first.shape or not x.flags.c_contiguous for x in xs):
        return None
    flats = [x.reshape(-1) for x in xs]
    out: np.ndarray | None = None
    for i in range(0, first.size, CONVERSION_CHUNK):
        part = kernel(*(f[i:i + CONVERSION_CHUNK] for f in flats))
        if out is None:
            out = np.empty(first.size, part.dtype)
        out[i:i + part.size] = part
    assert out is not None
    return out.reshape(first.shape)


def is_float_dtype(dt: np.dtype) -> bool:
    return np.issubdtype(dt, np.floating) or np.dtype(dt) == np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- elementwise

ElementwiseKernel = Callable[..., np.ndarray]

#: kind -> kernel of the elementwise families (`unary`, `binary`, `binary_const`): each
#: filled by its kernels' `@_elementwise(TABLE, kind)`
UNARY: dict[str, ElementwiseKernel] = {}
BINARY: dict[str, ElementwiseKernel] = {}
BINARY_CONST: dict[str, ElementwiseKernel] = {}


def _elementwise(table: dict[str, ElementwiseKernel], kind: str
                 ) -> Callable[[ElementwiseKernel], ElementwiseKernel]:
    """The decorated elementwise kernel (its arrays positional, its parameters keyword
    only), computed in chunks where its inputs qualify (`_by_chunks`: the same bytes),
    listed in `table` as `kind`."""

    def deco(kernel: ElementwiseKernel) -> ElementwiseKernel:
        @functools.wraps(kernel)
        def run(*xs: np.ndarray, **kw: object) -> np.ndarray:
            arrays = [np.asarray(x) for x in xs]
            got = _by_chunks(lambda *c: kernel(*c, **kw), *arrays)
            return kernel(*arrays, **kw) if got is None else got

        table[kind] = run
        return run

    return deco


def _float_operands(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float operands in f32 (the chip's arithmetic), integer ones as they are."""
    return (f32(a), f32(b)) if is_float_dtype(np.asarray(a).dtype) else (a, b)


@_elementwise(BINARY, "add")
def add(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fa, fb = _float_operands(a, b)
    return _out(np.asarray(fa + fb), out_dtype, a)


@_elementwise(BINARY, "sub")
def sub(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fa, fb = _float_operands(a, b)
    return _out(np.asarray(fa - fb), out_dtype, a)


@_elementwise(BINARY, "mul")
def mul(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fa, fb = _float_operands(a, b)
    return _out(np.asarray(fa * fb), out_dtype, a)


@_elementwise(BINARY, "div")
def div(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    """a / b for floats; integers divide with floor (torch's floor_divide)."""
    fa, fb = _float_operands(a, b)
    r = fa / fb if is_float_dtype(np.asarray(a).dtype) else np.floor_divide(fa, fb)
    return _out(np.asarray(r), out_dtype, a)


@_elementwise(BINARY, "max")
def maximum(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fa, fb = _float_operands(a, b)
    return _out(np.asarray(np.maximum(fa, fb)), out_dtype, a)


@_elementwise(BINARY, "min")
def minimum(a: np.ndarray, b: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fa, fb = _float_operands(a, b)
    return _out(np.asarray(np.minimum(fa, fb)), out_dtype, a)


def binary(kind: str, a: np.ndarray, b: np.ndarray, out_dtype: OutDType = None) -> np.ndarray:
    """The binary kernel of `kind` (add, sub, mul, div, max, min)."""
    kernel = BINARY.get(kind)
    if kernel is None:
        raise ValueError(f"unknown binary kernel {kind}")
    return kernel(a, b, out_dtype=out_dtype)


def _const_operands(x: np.ndarray, value: float, reverse: bool
                    ) -> tuple[np.ndarray | np.floating | float, np.ndarray | np.floating | float]:
    """x (in f32 if a float) and the scalar, in the order the op takes them."""
    is_f = is_float_dtype(np.asarray(x).dtype)
    fx = f32(x) if is_f else x
    c = np.float32(value) if is_f else value
    return (c, fx) if reverse else (fx, c)


@_elementwise(BINARY_CONST, "add")
def add_const(x: np.ndarray, *, value: float, reverse: bool = False,
              out_dtype: OutDType = None) -> np.ndarray:
    a, b = _const_operands(x, value, reverse)
    return _out(np.asarray(a + b), out_dtype, x)


@_elementwise(BINARY_CONST, "sub")
def sub_const(x: np.ndarray, *, value: float, reverse: bool = False,
              out_dtype: OutDType = None) -> np.ndarray:
    a, b = _const_operands(x, value, reverse)
    return _out(np.asarray(a - b), out_dtype, x)


@_elementwise(BINARY_CONST, "mul")
def mul_const(x: np.ndarray, *, value: float, reverse: bool = False,
              out_dtype: OutDType = None) -> np.ndarray:
    a, b = _const_operands(x, value, reverse)
    return _out(np.asarray(a * b), out_dtype, x)


@_elementwise(BINARY_CONST, "div")
def div_const(x: np.ndarray, *, value: float, reverse: bool = False,
              out_dtype: OutDType = None) -> np.ndarray:
    a, b = _const_operands(x, value, reverse)
    return _out(np.asarray(a / b), out_dtype, x)


def binary_const(kind: str, x: np.ndarray, value: float, reverse: bool = False,
                 out_dtype: OutDType = None) -> np.ndarray:
    """The scalar kernel of `kind` (add, sub, mul, div): x (op) value, or value (op) x
    when `reverse`."""
    kernel = BINARY_CONST.get(kind)
    if kernel is None:
        raise ValueError(f"unknown const kernel {kind}")
    return kernel(x, value=value, reverse=reverse, out_dtype=out_dtype)


def compare(a: np.ndarray, b: np.ndarray, predicate: str) -> np.ndarray:
    ops = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal}
    return ops[predicate](a, b)


def where(c: np.ndarray, a: np.ndarray, b: np.ndarray, out_dtype: OutDType = None) -> np.ndarray:
    return _out(np.where(c.astype(bool), a, b), out_dtype, a)


def cast(x: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.integer) and is_float_dtype(x.dtype):
        return np.trunc(f32(x)).astype(dt)
    return round_to(np.asarray(x), dt)


def _erf(x: np.ndarray) -> np.ndarray:
    # float64 vectorised erf (math.erf is exact to double precision)
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64))


def _unary_out(r: np.ndarray, out_dtype: OutDType, x: np.ndarray) -> np.ndarray:
    """A unary kernel's f32 result, rounded to `out_dtype` (x's dtype when None)."""
    return _out(np.asarray(r, dtype=np.float32), out_dtype, x)


@_elementwise(UNARY, "rsqrt")
def rsqrt(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(1.0 / np.sqrt(f32(x)), out_dtype, x)


@_elementwise(UNARY, "sqrt")
def sqrt(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.sqrt(f32(x)), out_dtype, x)


@_elementwise(UNARY, "exp")
def exp(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.exp(f32(x)), out_dtype, x)


@_elementwise(UNARY, "cos")
def cos(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.cos(f32(x)), out_dtype, x)


@_elementwise(UNARY, "sin")
def sin(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.sin(f32(x)), out_dtype, x)


@_elementwise(UNARY, "tanh")
def tanh(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.tanh(f32(x)), out_dtype, x)


@_elementwise(UNARY, "sigmoid")
def sigmoid(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x)
    with np.errstate(over="ignore"):  # exp(-x) -> inf below -88: the limit, 0
        r = 1.0 / (1.0 + np.exp(-fx))
    return _unary_out(r, out_dtype, x)


@_elementwise(UNARY, "relu")
def relu(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    return _unary_out(np.maximum(f32(x), np.float32(0)), out_dtype, x)


@_elementwise(UNARY, "silu")
def silu(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x)
    with np.errstate(over="ignore"):  # exp(-x) -> inf below -88: the limit, -0
        r = fx / (1.0 + np.exp(-fx))
    return _unary_out(r, out_dtype, x)


@_elementwise(UNARY, "softplus")
def softplus(x: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    """torch's F.softplus, beta 1, threshold 20."""
    fx = f32(x)
    with np.errstate(over="ignore"):  # exp overflows only where x > 20 is taken
        r = np.where(fx > np.float32(20), fx, np.log1p(np.exp(fx)))
    return _unary_out(r, out_dtype, x)


@_elementwise(UNARY, "gelu")
def gelu(x: np.ndarray, *, out_dtype: OutDType = None, approximate: str = "none") -> np.ndarray:
    """GELU with erf (computed in f64), or its tanh approximation."""
    fx = f32(x)
    if approximate == "tanh":
        c = np.float32(math.sqrt(2.0 / math.pi))
        r = 0.5 * fx * (1.0 + np.tanh(c * (fx + np.float32(0.044715) * fx * fx * fx)))
    else:
        r = (0.5 * fx.astype(np.float64) * (1.0 + _erf(fx / math.sqrt(2.0)))).astype(
            np.float32
        )
    return _unary_out(r, out_dtype, x)


@_elementwise(UNARY, "pow")
def power(x: np.ndarray, *, out_dtype: OutDType = None, exponent: float = 1.0) -> np.ndarray:
    fx = f32(x)
    e = float(exponent)
    r = fx * fx if e == 2.0 else np.power(fx, np.float32(e))
    return _unary_out(r, out_dtype, x)


@_elementwise(UNARY, "clamp")
def clamp(x: np.ndarray, *, out_dtype: OutDType = None, min: float | None = None,
          max: float | None = None) -> np.ndarray:
    """torch.clamp: max(x, min), then min(that, max), a bound None where not given (a NaN
    stays NaN; with min > max every element is max). f16/bf16 in f32, other types in their
    own (exact: each element is x's or a bound rounded once to the output type)."""
    v = f32(x) if x.dtype in HALF_TYPES else x
    if min is not None:
        v = np.maximum(v, v.dtype.type(min))
    if max is not None:
        v = np.minimum(v, v.dtype.type(max))
    return _out(np.asarray(v), out_dtype, x)


def unary(kind: str, x: np.ndarray, out_dtype: OutDType = None, **kw: float | str | None
          ) -> np.ndarray:
    """The unary kernel of `kind` (`UNARY`: rsqrt, sqrt, exp, ..., gelu, pow, clamp),
    computed in f32 and rounded to `out_dtype`; `kw` its parameters (gelu's `approximate`,
    pow's `exponent`, clamp's `min` and `max`)."""
    kernel = UNARY.get(kind)
    if kernel is None:
        raise ValueError(f"unknown unary kernel {kind}")
    return kernel(x, out_dtype=out_dtype, **kw)


# --------------------------------------------------------------------------- reductions, norms


def softmax(x: np.ndarray, axis: int, out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x)
    m = np.max(fx, axis=axis, keepdims=True)
    e = np.exp(fx - m)
    return _out(e / np.sum(e, axis=axis, keepdims=True), out_dtype, x)


def reduce(x: np.ndarray, mode: str, axes: Sequence[int], keepdims: bool,
           out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x) if is_float_dtype(x.dtype) else x
    ax = tuple(axes)
    reductions: dict[str, Callable[..., Any]] = {"mean": np.mean, "sum": np.sum,
                                                 "max": np.max, "min": np.min}
    fn = reductions[mode]
    return _out(np.asarray(fn(fx, axis=ax, keepdims=keepdims)), out_dtype, x)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float,
             out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x)
    var = np.mean(fx * fx, axis=-1, keepdims=True)
    y = fx * (1.0 / np.sqrt(var + np.float32(eps)))
    if weight is not None:
        y = y * f32(weight)
    return _out(y, out_dtype, x)


def layer_norm(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
               eps: float, axis: int, out_dtype: OutDType = None) -> np.ndarray:
    fx = f32(x)
    axes = tuple(range(axis % fx.ndim, fx.ndim))
    mean = np.mean(fx, axis=axes, keepdims=True)
    var = np.mean((fx - mean) ** 2, axis=axes, keepdims=True)
    y = (fx - mean) / np.sqrt(var + np.float32(eps))
    if weight is not None:
        y = y * f32(weight)
    if bias is not None:
        y = y + f32(bias)
    return _out(y, out_dtype, x)


# --------------------------------------------------------------------------- LLM ops


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str,
         out_dtype: OutDType = None) -> np.ndarray:
    fx, c, s = f32(x), f32(cos), f32(sin)
    d = fx.shape[-1]
    if mode == "half":
        rot = np.concatenate([-fx[..., d // 2 :], fx[..., : d // 2]], axis=-1)
    else:
        rot = np.empty_like(fx)
        rot[..., 0::2] = -fx[..., 1::2]
        rot[..., 1::2] = fx[..., 0::2]
    return _out(fx * c + rot * s, out_dtype, x)


#: an additive attention mask value at or below this (as the mask's dtype holds it: -9984
#: in bf16) hides the key: the net contract's MASK_VALUE. A hidden key's softmax weight
#: exp(s - 9984 - max) is exactly 0 in f32 whenever the row sees a key scoring within
#: ~9800 of it
HIDDEN_KEY = -10000.0


def _seen_history(history_k: np.ndarray, history_v: np.ndarray, mask: np.ndarray,
                  new_keys: int) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """The history keys and values up to the last one a query row sees, and the mask of
    the keys kept: a KV cache's unfilled tail (hidden from every row) is neither converted
    nor scored, so a decode step costs the filled positions, not the compiled cache length,
    and whatever the tail holds (even NaN) cannot reach the result. (None, None, mask)
    where no row sees any history key; the inputs as they are where the mask does not
    name each key (broadcast along the keys)."""
    history = history_k.shape[1]
    m = np.asarray(mask)
    if (m.ndim == 0 or m.shape[-1] != history + new_keys or history == 0
            or not is_float_dtype(m.dtype)):
        return history_k, history_v, mask
    hidden = f32(round_to(np.array(HIDDEN_KEY, np.float32), m.dtype))
    seen = ~(f32(m[..., :history]).reshape(-1, history) <= hidden)
    cols = np.flatnonzero(seen.any(axis=0))  # a NaN mask value counts as seen
    keep = int(cols[-1]) + 1 if cols.size else 0
    if keep == history:
        return history_k, history_v, mask
    kept_mask = np.concatenate([m[..., :keep], m[..., history:]], axis=-1)
    if keep == 0:
        return None, None, kept_mask
    return history_k[:, :keep], history_v[:, :keep], kept_mask


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
              scale: float, history_k: np.ndarray | None = None,
              history_v: np.ndarray | None = None, causal: bool = False,
              out_dtype: OutDType = None) -> np.ndarray:
    """Sequence-major GQA attention: q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> [B,Sq,Hq,Dv].

    History keys (if any) come first; they are scored and weighted separately and never
    concatenated with k/v (reload-free concatenation); those hidden from every query row
    past the last one some row sees are left out (`_seen_history`). Scores, softmax and
    the weighted sum are computed in f32.
    """
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    if history_k is not None and history_v is not None and mask is not None and not causal:
        history_k, history_v, mask = _seen_history(history_k, history_v, mask,
                                                    k.shape[1])
    # [B, Hkv, rep, Sq, D]
    fq = f32(q).transpose(0, 2, 1, 3).reshape(b, hkv, rep, sq, d)
    parts_k = [k] if history_k is None else [history_k, k]
    parts_v = [v] if history_v is None else [history_v, v]
    scores = []
    for kk in parts_k:
        fk = f32(kk).transpose(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, Sk]
        sc = _matmul(fq, fk)  # [B, Hkv, rep, Sq, Sk]
        sc *= np.float32(scale)
        scores.append(sc)
    # the scores are a new array: masked, normalised and exponentiated in place
    p = np.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    sk = p.shape[-1]
    if mask is not None:  # broadcast over the heads without a copy
        p += np.broadcast_to(f32(mask), (b, hq, sq, sk)).reshape(b, hkv, rep, sq, sk)
    if causal:
        off = sk - sq
        np.copyto(p, np.float32(-np.inf), where=np.triu(np.ones((sq, sk), bool), k=1 + off))
    p -= np.max(p, axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= np.sum(p, axis=-1, keepdims=True)
    out = None
    start = 0
    for vv in parts_v:
        n = vv.shape[1]
        fv = f32(vv).transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, Sk, Dv]
        o = _matmul(p[..., start : start + n], fv)
        out = o if out is None else out + o
        start += n
    assert out is not None
    dv = out.shape[-1]
    res = out.reshape(b, hq, sq, dv).transpose(0, 2, 1, 3)
    return _out(np.ascontiguousarray(res), out_dtype, q)


@dataclass
class OnlineSoftmax:
    """The running state of attention over key tiles (online softmax): per query row and
    head the largest score so far (`peak`), the sum of exp(score - peak) (`total`) and the
    weighted sum of values at that peak (`acc`), all f32 [B, Hkv, rep, Sq, ...]. A tile of
    keys rescales what came before by exp(old peak - new peak); `attention_finish` divides
    by the total. The L x (Hh + L) scores are never whole: one tile's [Sq, tile] at a time."""

    peak: np.ndarray
    total: np.ndarray
    acc: np.ndarray


    def packed(self) -> np.ndarray:
        """The state as one f32 array [B, Hkv, rep, Sq, 2 + Dv]: peak, total, acc (a layer
        group's accumulator in local memory, `tpu.accumulator_type`)."""
        return np.concatenate([self.peak, self.total, self.acc], axis=-1)

    @classmethod
    def unpacked(cls, packed: np.ndarray) -> OnlineSoftmax:
        return cls(packed[..., :1], packed[..., 1:2], packed[..., 2:])


def attention_start(q: np.ndarray, k: np.ndarray, dv: int) -> OnlineSoftmax:
    b, sq, hq, _ = q.shape
    hkv = k.shape[2]
    shape = (b, hkv, hq // hkv, sq)
    return OnlineSoftmax(np.full((*shape, 1), -np.inf, np.float32),
                         np.zeros((*shape, 1), np.float32),
                         np.zeros((*shape, dv), np.float32))


def attention_tile(state: OnlineSoftmax, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   mask: np.ndarray | None, scale: float, first_key: int = 0,
                   causal_offset: int | None = None) -> None:
    """Fold one tile of keys and values (k/v [B, St, Hkv, D], the keys numbered from
    `first_key` in the whole key sequence; `mask` its columns [.., Sq, St]) into `state`.
    `causal_offset` (Sk - Sq of the whole sequence) hides key j from query i when
    j > i + offset."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    st = k.shape[1]
    # contiguous operands: a tile is a strided window of its tensor where it is not in
    # local memory, and a BLAS may sum a strided operand in another order
    k, v = np.ascontiguousarray(f32(k)), np.ascontiguousarray(f32(v))
    fq = np.ascontiguousarray(f32(q).transpose(0, 2, 1, 3).reshape(b, hkv, rep, sq, d))
    sc = _matmul(fq, k.transpose(0, 2, 3, 1)[:, :, None])  # [B, Hkv, rep, Sq, St]
    sc *= np.float32(scale)
    if mask is not None:
        sc += np.broadcast_to(f32(mask), (b, hq, sq, st)).reshape(b, hkv, rep, sq, st)
    if causal_offset is not None:
        hidden = (np.arange(first_key, first_key + st)[None, :]
                  > np.arange(sq)[:, None] + causal_offset)
        np.copyto(sc, np.float32(-np.inf), where=hidden)
    peak = np.maximum(state.peak, np.max(sc, axis=-1, keepdims=True))
    safe = np.where(np.isfinite(peak), peak, np.float32(0))  # a row that saw nothing yet
    sc -= safe
    np.exp(sc, out=sc)
    keep = np.exp(state.peak - safe)
    state.total = state.total * keep + np.sum(sc, axis=-1, keepdims=True)
    state.acc = state.acc * keep + _matmul(sc, v.transpose(0, 2, 1, 3)[:, :, None])
    state.peak = peak


def attention_finish(state: OnlineSoftmax, q: np.ndarray, out_dtype: OutDType = None
                     ) -> np.ndarray:
    b, sq, hq, _ = q.shape
    out = state.acc / state.total
    res = out.reshape(b, hq, sq, out.shape[-1]).transpose(0, 2, 1, 3)
    return _out(np.ascontiguousarray(res), out_dtype, q)


def attention_online(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                     scale: float, history_k: np.ndarray | None = None,
                     history_v: np.ndarray | None = None, causal: bool = False,
                     out_dtype: OutDType = None, tile: int = 128) -> np.ndarray:
    """`attention` computed over tiles of `tile` keys (history first, then k) with a running
    max and sum (`OnlineSoftmax`): the same function, summed in another order (the scores'
    exponentials are rescaled per tile), so equal to `attention` within f32 rounding."""
    parts = [(k, v)] if history_k is None or history_v is None else [(history_k, history_v),
                                                                      (k, v)]
    sk = sum(kk.shape[1] for kk, _ in parts)
    state = attention_start(q, k, v.shape[-1])
    offset = sk - q.shape[1] if causal else None
    at = 0
    for kk, vv in parts:
        for s in range(0, kk.shape[1], tile):
            e = min(s + tile, kk.shape[1])
            m = None if mask is None else mask[..., at + s:at + e]
            attention_tile(state, q, kk[:, s:e], vv[:, s:e], m, scale, at + s, offset)
        at += kk.shape[1]
    return attention_finish(state, q, out_dtype)


def attention_part(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                   scale: float, causal: bool = False) -> np.ndarray:
    """Attention of `q` over one part of the keys (k/v, the mask's columns of them): its
    softmax-weighted values within the part and the log of its sum of exponentials, f32
    [B, Sq, Hq, Dv + 1] (the last column). `attention_merge` of the parts of all keys is
    `attention` (within f32 rounding: the exponentials are summed in another order)."""
    state = attention_start(q, k, v.shape[-1])
    attention_tile(state, q, k, v, mask, scale, 0, k.shape[1] - q.shape[1] if causal else None)
    return attention_part_finish(state, q)


def attention_part_finish(state: OnlineSoftmax, q: np.ndarray) -> np.ndarray:
    """`attention_part`'s result from the state after all of the part's keys: the weighted
    values and the log-sum-exp, f32 [B, Sq, Hq, Dv + 1]."""
    b, sq, hq, _ = q.shape
    lse = state.peak + np.log(state.total)
    out = np.concatenate([state.acc / state.total, lse], axis=-1)
    return np.ascontiguousarray(out.reshape(b, hq, sq, -1).transpose(0, 2, 1, 3))


def attention_fold(acc: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   mask: np.ndarray | None, *, scale: float, first_key: int = 0) -> np.ndarray:
    """One part of an attention's keys (a layer group's reduction parts, keys numbered from
    `first_key`) folded into the packed state `acc` (`OnlineSoftmax.packed`; None: the
    first part); returns the new packed state."""
    state = (attention_start(q, k, v.shape[-1]) if acc is None
             else OnlineSoftmax.unpacked(acc))
    attention_tile(state, q, k, v, mask, scale, first_key)
    return state.packed()


def attention_result(acc: np.ndarray, q: np.ndarray, *, out_dtype: OutDType = None) -> np.ndarray:
    """An attention's result from its packed state after its last part (`attention_fold`)."""
    return attention_finish(OnlineSoftmax.unpacked(acc), q, out_dtype)


def attention_part_result(acc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """`attention_part`'s result from its packed state after its last part."""
    return attention_part_finish(OnlineSoftmax.unpacked(acc), q)


def attention_merge(parts: Sequence[np.ndarray], out_dtype: OutDType = None,
                    like: np.ndarray | None = None) -> np.ndarray:
    """The attention over all keys from its parts (`attention_part`): each part's values
    weighted by exp(its log-sum-exp - the largest), over the sum of those weights."""
    lses = [f32(p)[..., -1:] for p in parts]
    top_ = np.maximum.reduce(lses)
    num = np.zeros(parts[0].shape[:-1] + (parts[0].shape[-1] - 1,), np.float32)
    den = np.zeros(parts[0].shape[:-1] + (1,), np.float32)
    for p, lse in zip(parts, lses, strict=True):
        w = np.exp(lse - top_)
        num += w * f32(p)[..., :-1]
        den += w
    return _out(num / den, out_dtype, parts[0] if like is None else like)


def matmul(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None,
           transpose_a: bool = False, transpose_b: bool = False,
           out_dtype: OutDType = None) -> np.ndarray:
    fa = f32(a) if is_float_dtype(a.dtype) else a
    fb = f32(b) if is_float_dtype(b.dtype) else b
    if transpose_a:
        fa = np.swapaxes(fa, -1, -2)
    if transpose_b:
        fb = np.swapaxes(fb, -1, -2)
    r = _matmul(fa, fb)
    if bias is not None:
        r = r + f32(bias).reshape(-1)
    return _out(r, out_dtype, a)


def matmul_part(acc: np.ndarray | None, a: np.ndarray, b: np.ndarray,
                transpose_a: bool = False, transpose_b: bool = False) -> np.ndarray:
    """One part of a matmul split along K (a layer group's reduction parts): `acc` + a @ b
    over the part's K, in f32, without the bias (`acc` None: the first part). The parts'
    sums are added in their order, so the result differs from `matmul`'s one sum over K by
    f32 rounding (`matmul_finish` adds the bias and rounds). The operands are made
    contiguous first: a part is a strided window of its tensor where it is not in local
    memory (the fast machine, the interpreter), and a BLAS may sum a strided operand in
    another order than a contiguous one."""
    fa = np.ascontiguousarray(f32(a) if is_float_dtype(a.dtype) else a)
    fb = np.ascontiguousarray(f32(b) if is_float_dtype(b.dtype) else b)
    if transpose_a:
        fa = np.swapaxes(fa, -1, -2)
    if transpose_b:
        fb = np.swapaxes(fb, -1, -2)
    r = _matmul(fa, fb).astype(np.float32, copy=False)
    if acc is None:
        return r
    return np.add(acc, r, out=r)


#: the f32 bytes of a float weight's rows `matmul_weight_rows` converts at a time: about
#: this host's L2 (2 MiB a core), so the block is converted and multiplied in cache
WEIGHT_ROWS_TILE_BYTES = 2 << 20


def matmul_weight_rows(a: np.ndarray, w: np.ndarray, block_rows: int) -> np.ndarray:
    """a @ f32(w).T in f32 without the bias, for a float weight `w` [N, K] (a bf16
    lm_head) whose f32 form is never made whole: at most `block_rows` of its rows (fewer
    where their f32 form is over WEIGHT_ROWS_TILE_BYTES: a multiple of 16 rows) are
    converted at a time into one reused buffer (a bf16's bits shifted into the upper half
    of a uint32: `f32`'s bits) and multiplied while in cache, on the threads set once for
    all blocks, each block's outputs written into the result. Each output is the same dot
    product as in `matmul(a, w, transpose_b=True)`'s one product (and `matmul_part`'s, `a`
    contiguous); whether a BLAS gives it the same bits when it computes fewer outputs
    together depends on the BLAS, so a caller checks it per shape
    (`WeightCache.f32_rows_product`)."""
    fa = np.ascontiguousarray(f32(a))
    n, k = w.shape
    rows = max(1, min(block_rows, n))
    fit = WEIGHT_ROWS_TILE_BYTES // (4 * max(1, k)) // 16 * 16
    if fit and rows > fit:
        rows = fit
    r = np.empty((*fa.shape[:-1], n), np.float32)
    bf16 = w.dtype == BF16
    src = w.view(np.uint16) if bf16 else w

    def blocks(start: int, end: int) -> None:
        buf = np.empty((rows, k), np.uint32 if bf16 else np.float32)
        for r0 in range(start, end, rows):
            m = min(rows, end - r0)
            b = buf[:m]
            np.copyto(b, src[r0:r0 + m])
            if bf16:
                np.left_shift(b, 16, out=b)
            _block_product(fa, b.view(np.float32), r, r0)

    _row_blocks(blocks, math.prod(fa.shape[:-1]), k, n, rows)
    return r


#: the threads that run blocks of a product's rows beside the calling one (`_row_blocks`)
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _row_blocks(blocks: Callable[[int, int], None], m: int, k: int, n: int,
                rows: int) -> None:
    """Run `blocks(start, end)` over the n rows of an [m, k] x [k, n] product made
    `rows` rows at a time (each call allocates its own buffers and multiplies the blocks
    r0 = start, start + rows, ... below `end`), split at whole blocks over the Python
    threads `blas_threads.workers` chooses for the whole product, the calling thread one
    of them (numpy and the BLAS release the GIL in their loops); each block's own
    product on one BLAS thread, set once for all (`blas_threads.products`). The blocks are
    those of one thread, so are the bits."""
    global _pool, _pool_size
    count = -(-n // rows)  # blocks
    parts = min(_workers(m, k, n), count)
    with _products(m, k, rows):
        if parts <= 1:
            blocks(0, n)
            return
        per = -(-count // parts) * rows  # whole blocks a part
        with _pool_lock:
            if _pool is None or _pool_size < parts - 1:
                _pool, _pool_size = ThreadPoolExecutor(
                    parts - 1, thread_name_prefix="toptpu-rows"), parts - 1
            pool = _pool
        done = [pool.submit(blocks, start, min(n, start + per))
                for start in range(0, n - per, per)]
        try:
            blocks(len(done) * per, n)
        finally:
            for f in done:
                f.result()


def matmul_finish(acc: np.ndarray, bias: np.ndarray | None, out_dtype: OutDType, like: np.ndarray
                  ) -> np.ndarray:
    """A matmul's result from its f32 sum over all of K (`matmul_part`): plus `bias`,
    rounded to the output dtype (`like`'s when None), as `matmul` finishes its one sum."""
    return _biased(acc, bias, out_dtype, like)


def gather(table: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
    idx = np.asarray(indices).astype(np.int64)
    n = table.shape[axis]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx[(idx < 0) | (idx >= n)].flat[0])
        raise IndexError(f"gather index {bad} is out of range for axis of size {n}")
    return np.take(table, idx, axis=axis)


def topk(x: np.ndarray, k: int, axis: int, largest: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sorted top-k; ties keep the lower index first (like argmax): the first k of a stable
    argsort of the keys (NaN last)."""
    fx = f32(x) if is_float_dtype(x.dtype) else x
    key = np.moveaxis(-fx if largest else fx, axis, -1)
    rows = key.reshape(-1, key.shape[-1]) if key.size else key.reshape(0, key.shape[-1])
    if 0 < k and k * TOPK_PARTITION < key.shape[-1] and rows.shape[0] <= TOPK_ROWS:
        idx = np.stack([_smallest_k(row, k) for row in rows]).reshape(*key.shape[:-1], k)
    else:
        idx = np.argsort(key, axis=-1, kind="stable")[..., :k]
    idx = np.moveaxis(idx, -1, axis)
    vals = np.take_along_axis(np.asarray(x), idx, axis=axis)
    return vals, idx.astype(np.int32)


#: `topk` partitions (instead of sorting everything) when k is below 1/TOPK_PARTITION of
#: the axis and there are at most TOPK_ROWS rows (the heads: one row of the vocabulary)
TOPK_PARTITION = 8
TOPK_ROWS = 8


def _smallest_k(row: np.ndarray, k: int) -> np.ndarray:
    """The first k indices of `np.argsort(row, kind="stable")`, without sorting the row:
    every key up to the k-th smallest (ties included, in index order), sorted stably."""
    if row.dtype.kind == "f" and np.isnan(row).any():  # NaN compares false: sort them all
        return np.argsort(row, kind="stable")[:k]
    if k == 1:  # greedy decoding: the first index of the smallest key
        return np.array([np.argmin(row)])
    kth = np.partition(row, k - 1)[k - 1]
    candidates = np.flatnonzero(row <= kth)
    return candidates[np.argsort(row[candidates], kind="stable")[:k]]


def scatter(x: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int) -> np.ndarray:
    """A copy of `x` with `updates` written along `axis` at `indices` (torch.scatter with a
    source); duplicate indices: the update last in row-major order lands."""
    idx = np.asarray(indices).astype(np.int64)
    n = x.shape[axis]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx[(idx < 0) | (idx >= n)].flat[0])
        raise IndexError(f"scatter index {bad} is out of range for axis of size {n}")
    out = np.array(x, copy=True)
    np.put_along_axis(out, idx, np.asarray(updates).astype(out.dtype), axis=axis)
    return out


def cumsum(x: np.ndarray, axis: int, out_dtype: OutDType = None) -> np.ndarray:
    """Inclusive prefix sum along `axis`, accumulated in order in f32."""
    return _out(np.cumsum(f32(x), axis=axis, dtype=np.float32), out_dtype, x)


def conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: Sequence[int],
           pads: Sequence[int], dilations: Sequence[int], groups: int,
           out_dtype: OutDType = None) -> np.ndarray:
    fx, fw = f32(x), f32(w)
    pt, pl, pb, pr = pads
    fx = np.pad(fx, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, wd = fx.shape
    o, cg, kh, kw = fw.shape
    sh, sw = strides
    dh, dw = dilations
    oh = (h - dh * (kh - 1) - 1) // sh + 1
    ow = (wd - dw * (kw - 1) - 1) // sw + 1
    og = o // groups
    out = np.zeros((n, o, oh, ow), dtype=np.float32)
    for g in range(groups):
        xg = fx[:, g * cg : (g + 1) * cg]
        wg = fw[g * og : (g + 1) * og]  # [og, cg, kh, kw]
        # im2col: [n, cg, kh, kw, oh, ow]
        cols = np.empty((n, cg, kh, kw, oh, ow), dtype=np.float32)
        for i in range(kh):
            for j in range(kw):
                cols[:, :, i, j] = xg[:, :, i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                                      j * dw : j * dw + sw * (ow - 1) + 1 : sw]
        out[:, g * og : (g + 1) * og] = np.einsum(
            "nckl...,ockl->no...", cols, wg, optimize=True
        )
    if bias is not None:
        out = out + f32(bias).reshape(1, -1, 1, 1)
    return _out(out, out_dtype, x)


# --------------------------------------------------------------------------- linear attention


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None,
                  valid: np.ndarray, out_dtype: OutDType = None, state_dtype: OutDType = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over `cat(state, x)` (`top.causal_conv1d`): x [1, T, C],
    weight [C, K], state [1, K-1, C] or None (zeros), valid [1, T] (a prefix of n ones)
    -> (y [1, T, C], new_state [1, K-1, C] = xs[n : n + K-1]). The taps are summed in
    order in f32; y rounds to `out_dtype`, the state to `state_dtype` (default: x's).
    Channels are independent: a slice of them computes the same numbers."""
    x = np.asarray(x)
    _, t, c = x.shape
    k = weight.shape[1]
    fx = f32(x)
    # the state as x's dtype holds it (the definition concatenates in x's dtype)
    fs = (np.zeros((1, k - 1, c), np.float32) if state is None
          else f32(round_to(np.asarray(state), x.dtype)))
    xs = np.concatenate([fs, fx], axis=1)  # [1, K-1+T, C]
    fw = f32(weight)
    y = np.zeros((1, t, c), np.float32)
    for j in range(k):
        y += xs[:, j:j + t] * fw[:, j]
    n = int(np.count_nonzero(f32(np.asarray(valid)).reshape(-1) > 0))
    new_state = np.ascontiguousarray(xs[:, n:n + k - 1])
    return _out(y, out_dtype, x), _out(new_state, state_dtype, x)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                     beta: np.ndarray, state: np.ndarray | None, scale: float,
                     out_dtype: OutDType = None) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule (`top.gated_delta_rule`), recurrent over the tokens in f32,
    vectorised over the value heads: q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta
    [1, T, Hv], state [1, Hv, Dk, Dv] or None (zeros) -> (o [1, T, Hv, Dv] in `out_dtype`
    (default: v's), new_state [1, Hv, Dk, Dv] f32). Per token: S = S * exp(g);
    delta = beta * (v - k S); S = S + k^T delta; o = (scale * q) S. A token with g = 0 and
    beta = 0 leaves S bit for bit (S * 1 + k^T 0). Heads are independent: a slice of them
    (each key head with its value heads) computes the same numbers."""
    v = np.asarray(v)
    _, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    fq = np.repeat(f32(q)[0], r, axis=1) * np.float32(scale)  # [T, Hv, Dk]
    fk = np.repeat(f32(k)[0], r, axis=1)
    fv, fg, fb = f32(v)[0], f32(g)[0], f32(beta)[0]
    s = (np.zeros((hv, dk, dv), np.float32) if state is None
         else np.array(f32(state)[0], dtype=np.float32, copy=True))
    out = np.empty((t, hv, dv), np.float32)
    decay = np.exp(fg)  # [T, Hv]
    for i in range(t):
        s *= decay[i][:, None, None]
        kv = _matmul(fk[i][:, None, :], s)[:, 0]  # [Hv, Dv]
        delta = (fv[i] - kv) * fb[i][:, None]
        s += fk[i][:, :, None] * delta[:, None, :]
        out[i] = _matmul(fq[i][:, None, :], s)[:, 0]
    return _out(out[None], out_dtype, v), s[None]


# --------------------------------------------------------------------------- mixture of experts


def moe_route(logits: np.ndarray, valid: np.ndarray | None, k: int, normalize: bool,
              out_dtype: OutDType = None) -> tuple[np.ndarray, np.ndarray]:
    """The router (`top.moe_route`): logits [T, E], valid [T] or None -> (weights [T, k]
    in `out_dtype` (default: the logits'), indices i32 [T, k]). Per row: softmax in f32,
    the k largest probabilities in descending order (ties: the lower index first, `topk`),
    divided by their sum when `normalize`; a row whose `valid` is not > 0 routes nowhere
    (indices -1, weights 0). Rows are independent: a slice of them computes the same
    numbers."""
    probs = softmax(logits, axis=-1, out_dtype=np.float32)
    values, indices = topk(probs, k, axis=-1)
    values = np.asarray(values, np.float32)
    if normalize:
        values = values / values.sum(axis=-1, keepdims=True, dtype=np.float32)
    if valid is not None:
        real = (f32(np.asarray(valid)).reshape(-1, 1) > 0)
        values = np.where(real, values, np.float32(0))
        indices = np.where(real, indices, np.int32(-1)).astype(np.int32)
    return _out(values, out_dtype, logits), indices


def moe_experts_part(acc: np.ndarray | None, x: np.ndarray, gate: np.ndarray, up: np.ndarray,
                     down: np.ndarray, weights: np.ndarray, indices: np.ndarray,
                     fetched_from: int | None = None, block: tuple[int, int] | None = None
                     ) -> np.ndarray:
    """One part of the experts (`top.moe_experts`) over the intermediate rows its `gate`
    [E, i, H], `up` [E, i, H] and `down` [E, H, i] hold (all of them: the whole op), added
    into the f32 accumulator `acc` [T, H] (None: the first part). Each expert some token
    chose computes its tokens' rows at once, in f32: `silu(x @ gate[e].T) * (x @ up[e].T)`
    `@ down[e].T`, scaled by the token's routing weight, the experts in ascending order.
    Index -1 adds nothing; any other index outside [0, E) is an IndexError. Rows are
    independent: a slice of them computes the same numbers.

    `fetched_from` (a layer group's buffers of the fetched experts, `tpu.load` `by_index`):
    the indices range over that many experts, and gate, up and down hold only the ones they
    name, in ascending order, in their first rows (the same numbers, the same order).

    `block` (first, count): a part of the experts instead (a layer group's expert blocks):
    only the experts first .. first + count - 1 are added, the weights hold that block —
    row e - first is expert e, or with fewer than `count` rows its chosen experts packed
    in ascending order. Folding the blocks in ascending order into one accumulator adds
    each token's experts in the whole op's order: the same bits."""
    return _experts_fold(acc, x, weights, indices, gate.shape[0],
                         lambda e: (f32(gate[e]), f32(up[e]), f32(down[e])), fetched_from,
                         block)


def _experts_fold(acc: np.ndarray | None, x: np.ndarray, weights: np.ndarray,
                  indices: np.ndarray, n: int,
                  expert: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
                  fetched_from: int | None = None, block: tuple[int, int] | None = None
                  ) -> np.ndarray:
    """The arithmetic of `moe_experts_part` and `a16_moe_experts_part`: `expert(r)` gives
    the gate, up and down in f32 of the expert at row r of the `n` rows the weights hold,
    asked only for the experts some token chose. Row r is expert r, or with `fetched_from`
    (the indices' range; the weights hold the chosen experts only, ascending) the r-th
    chosen expert; more chosen experts than the `n` rows is an IndexError. With `block`
    (first, count; the indices range over `fetched_from`) only that block's experts are
    added: row r is expert first + r, or with n < count the r-th chosen of the block."""
    idx = np.asarray(indices).astype(np.int64)
    span = n if fetched_from is None else fetched_from
    if idx.size and (idx.min() < -1 or idx.max() >= span):
        bad = int(idx[(idx < -1) | (idx >= span)].flat[0])
        raise IndexError(f"moe_experts index {bad} is out of range for {span} experts")
    first, count = (0, span) if block is None else block
    packed = fetched_from is not None and (block is None or n < count)
    if block is not None and not packed and n != count:
        raise IndexError(f"moe_experts: a block of {count} experts, its weights hold {n}")
    fx, fw = f32(x), f32(weights)
    out = np.zeros(fx.shape, np.float32) if acc is None else acc.copy()
    chosen = np.unique(idx[(idx >= first) & (idx < first + count)])
    if packed and chosen.size > n:
        raise IndexError(f"moe_experts: the indices name {chosen.size} experts, its weights "
                         f"hold {n}")
    for row, e in enumerate(chosen):
        tokens, slots = np.nonzero(idx == e)
        rows = np.ascontiguousarray(fx[tokens])
        gate_e, up_e, down_e = expert(row if packed else int(e) - first)
        g = rows @ np.ascontiguousarray(gate_e).T
        u = rows @ np.ascontiguousarray(up_e).T
        y = (silu(g) * u) @ np.ascontiguousarray(down_e).T
        out[tokens] += y * fw[tokens, slots][:, None]
    return out


def moe_experts_finish(acc: np.ndarray, out_dtype: OutDType = None,
                       like: np.ndarray | None = None) -> np.ndarray:
    """The experts' result from their f32 accumulator (`moe_experts_part`), rounded to the
    output dtype (`like`'s when None)."""
    return _out(acc, out_dtype, like if like is not None else acc)


def moe_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                weights: np.ndarray, indices: np.ndarray, out_dtype: OutDType = None,
                fetched_from: int | None = None) -> np.ndarray:
    """The experts (`top.moe_experts`): x [T, H], gate [E, I, H], up [E, I, H], down
    [E, H, I], weights [T, k], indices [T, k] -> y [T, H] in `out_dtype` (default: x's):
    one part over all of I (`moe_experts_part`), rounded."""
    return moe_experts_finish(moe_experts_part(None, x, gate, up, down, weights, indices,
                                               fetched_from), out_dtype, x)


# --------------------------------------------------------------------------- data movement


def reshape(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    return np.reshape(x, tuple(shape))


def permute(x: np.ndarray, order: Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(x, tuple(order)))


def expand(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(np.broadcast_to(x, tuple(shape)))


def concat(xs: Sequence[np.ndarray], axis: int) -> np.ndarray:
    return np.concatenate(list(xs), axis=axis)


def slice_(x: np.ndarray, axis: int, start: int, end: int, step: int) -> np.ndarray:
    sl = [slice(None)] * x.ndim
    sl[axis] = slice(start, end, step)
    return np.ascontiguousarray(x[tuple(sl)])


# --------------------------------------------------------------------------- quantized weights


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """ui8 [N, K/2] -> ui8 [N, K]: byte j holds k=2j (low nibble) and k=2j+1 (high)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty((*p.shape[:-1], p.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


def dequantize(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int,
               group_size: int, mins: np.ndarray | None = None) -> np.ndarray:
    """The weights `tpu.a16_matmul` multiplies by, in f32: (q - z) * s per group, or with
    `mins` (the scale-and-min variant) q * s + m, the product rounded before the sum.

    Its two halves: the integer offsets q - z (`weight_offsets`, exact; q itself with
    mins), then one f32 product (and sum) per weight (`dequantize_offsets`); a 7B-sized
    weight allocates its f32 result and offsets of a quarter of its size (4-bit), not three
    f32 arrays."""
    return dequantize_offsets(
        weight_offsets(qweight, zeros, bits, group_size, mins is not None), scales,
        group_size, mins)


def weight_offsets(qweight: np.ndarray, zeros: np.ndarray | None, bits: int,
                   group_size: int, with_mins: bool = False) -> np.ndarray:
    """q - z of each weight (z: the group's zero point; 8 for 4-bit and 0 for 8-bit weights
    without zero points; 0 for weights with mins, `with_mins`), exact, as int8 where every
    q - z the dtypes allow fits (4-bit weights with zero points up to 127), else int16: the
    integer half of `dequantize`, a new array (never a view of `qweight`)."""
    if bits == 4 and sys.byteorder == "little":
        implied = 0 if with_mins else 8
        fast = _offsets_4bit(np.asarray(qweight), zeros, implied, group_size)
        if fast is not None:
            return fast
    q = unpack_int4(qweight) if bits == 4 else np.asarray(qweight)
    n, k = q.shape
    g = k // group_size
    if zeros is None:
        implied = 0 if with_mins or bits == 8 else 8
        z = np.full((n, g, 1), implied, np.int16)
        z_lo = z_hi = implied
    else:
        z = np.asarray(zeros)[:, :, None]
        z_lo, z_hi = (int(z.min()), int(z.max())) if z.size else (0, 0)
    info = np.iinfo(q.dtype)
    q_lo, q_hi = (0, 15) if bits == 4 else (int(info.min), int(info.max))
    qg = q.reshape(n, g, group_size)
    if -128 <= q_lo - z_hi and q_hi - z_lo <= 127 and q_hi <= 127 and z_hi <= 127:
        # every operand and every difference is an int8: one narrow pass (in place into
        # a 4-bit weight's unpacked bytes, a new array: about half the time)
        if bits == 4:
            d = qg.view(np.int8)
            return np.subtract(d, z.astype(np.int8), out=d).reshape(n, k)
        return np.subtract(qg.astype(np.int8, copy=False), z.astype(np.int8),
                           dtype=np.int8).reshape(n, k)
    return np.subtract(qg, z, dtype=np.int16).reshape(n, k)


def _spread_nibbles(v: np.ndarray, packed: np.ndarray, shifted: np.ndarray) -> None:
    """Each packed byte of `packed` [m, half] widened into `v` [m, half] (uint16, rows
    contiguous) as its two 4-bit weights, the low nibble in the low byte and the high one
    in the high byte (`v.view(np.int8)`: q of each weight, k in order); `shifted` a uint16
    scratch of v's shape. The passes run over 8 bytes at a time (4 packed bytes: no bit
    crosses from one uint16 to the next) where a row is whole uint64s."""
    np.copyto(v, packed)
    lanes, mask = (np.uint64, np.uint64(0x0F0F0F0F0F0F0F0F)) if v.shape[-1] % 4 == 0 else \
        (np.uint16, np.uint16(0x0F0F))
    vl, tl = v.view(lanes), shifted.view(lanes)
    np.left_shift(vl, lanes(4), out=tl)
    np.bitwise_or(vl, tl, out=vl)
    np.bitwise_and(vl, mask, out=vl)


def _offsets_4bit(qweight: np.ndarray, zeros: np.ndarray | None, implied: int,
                  group_size: int, block_rows: int = 64) -> np.ndarray | None:
    """`weight_offsets` of a 4-bit weight as int8 on a little-endian host, made from the
    packed bytes a block of rows at a time in the result itself (`matmul_packed`'s spread:
    each packed byte widened to the uint16 of its two weights, its high nibble moved to the
    high byte, over uint64 lanes where a row is whole uint64s; the zero point subtracted in
    int8): the same integers as unpacking first, in fewer passes. None where some q - z
    leaves int8 (zero points below -112 or above 127: `weight_offsets` makes int16)."""
    n, half = qweight.shape
    k = 2 * half
    if group_size <= 0 or k % group_size:
        return None
    if zeros is not None:
        zs = np.asarray(zeros)
        if zs.size and (int(zs.min()) < -112 or int(zs.max()) > 127):
            return None
        z: np.ndarray | None = (zs.view(np.int8) if zs.dtype == np.uint8
                                else zs.astype(np.int8))[:, :, None]
    else:
        z = None
    g = k // group_size
    out = np.empty((n, k), np.int8)
    wide = out.view(np.uint16)  # [n, half]: one packed byte's two weights each
    rows = max(1, min(block_rows, n))
    shifted = np.empty((rows, half), np.uint16)
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        _spread_nibbles(wide[r0:r0 + m], qweight[r0:r0 + m], shifted[:m])
        d = out[r0:r0 + m].reshape(m, g, group_size)
        if z is not None:
            np.subtract(d, z[r0:r0 + m], out=d)
        elif implied:
            np.subtract(d, np.int8(implied), out=d)
    return out


def dequantize_offsets(offsets: np.ndarray, scales: np.ndarray, group_size: int,
                       mins: np.ndarray | None = None) -> np.ndarray:
    """offsets * s (+ m) per group in f32 (`offsets` from `weight_offsets`): each integer
    widened exactly, one rounding per product (and one per sum) — the bits of
    `dequantize`."""
    n, k = offsets.shape
    g = k // group_size
    w = np.empty((n, g, group_size), np.float32)
    np.multiply(offsets.reshape(n, g, group_size), f32(scales)[:, :, None], out=w,
                dtype=np.float32)
    if mins is not None:
        np.add(w, f32(mins)[:, :, None], out=w)
    return w.reshape(n, k)


def matmul_offsets(x: np.ndarray, offsets: np.ndarray, scales: np.ndarray, group_size: int,
                   bias: np.ndarray | None, out_dtype: OutDType = None, block_rows: int = 64,
                   mins: np.ndarray | None = None) -> np.ndarray:
    """`matmul_dequantized(x, dequantize_offsets(offsets, scales, group_size, mins), bias)`
    without the whole f32 weight: `block_rows` of its rows at a time are expanded into one
    small array and multiplied while in cache (about 2x faster for a decode step's one
    row: the f32 weight is never written to memory). Each output is the same dot product,
    but whether a BLAS gives it the same bits when it computes fewer outputs together
    depends on the BLAS, so a caller checks this once per shape against
    `matmul_dequantized` (`WeightCache.a16_product` does)."""
    fx = f32(x)
    n, k = offsets.shape
    g = k // group_size
    sf = f32(scales)
    mf = None if mins is None else f32(mins)
    rows = max(1, min(block_rows, n))
    r = np.empty((*fx.shape[:-1], n), np.float32)

    def blocks(start: int, end: int) -> None:
        block = np.empty((rows, g, group_size), np.float32)
        for r0 in range(start, end, rows):
            m = min(rows, end - r0)
            b = block[:m]
            np.copyto(b, offsets[r0:r0 + m].reshape(m, g, group_size))  # exact: integers
            _scale_block(b, sf[r0:r0 + m], None if mf is None else mf[r0:r0 + m])
            _block_product(fx, b.reshape(m, k), r, r0)

    _row_blocks(blocks, math.prod(fx.shape[:-1]), k, n, rows)
    return _biased(r, bias, out_dtype, x)


def _block_product(fx: np.ndarray, block: np.ndarray, r: np.ndarray, r0: int) -> None:
    """r[..., r0:r0 + m] = fx @ block.T for a block [m, K] of a weight's rows, written in
    place where that slice of `r` is one contiguous run (one row of x), on the threads
    the caller set (`blas_threads.products`, once for all blocks)."""
    m = block.shape[0]
    if math.prod(r.shape[:-1]) == 1:
        np.matmul(fx.reshape(1, -1), block.T, out=r.reshape(1, -1)[:, r0:r0 + m])
    else:
        r[..., r0:r0 + m] = np.matmul(fx, block.T)


def _scale_block(b: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> None:
    """A block [m, G, group] of integer offsets in f32 (exact) times its f32 scales [m, G]
    (+ mins) in place: `dequantize_offsets`' one rounding per product (and per sum)."""
    np.multiply(b, scales[:, :, None], out=b)
    if mins is not None:
        np.add(b, mins[:, :, None], out=b)


def matmul_packed(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                  zeros: np.ndarray | None, group_size: int, bias: np.ndarray | None,
                  out_dtype: OutDType = None, block_rows: int = 64,
                  mins: np.ndarray | None = None, zeros_checked: bool = False
                  ) -> np.ndarray | None:
    """`matmul_offsets(x, weight_offsets(qweight, zeros, 4, group_size, mins is not None),
    scales, group_size, bias, out_dtype, block_rows, mins)` for a 4-bit weight, each
    block's offsets made from its packed bytes while in cache instead of the weight's
    (or a slice's) offsets written to memory first: the same blocks, the same f32 weights
    (the same integers, widened exactly, times the same scales), the same products — its
    bits. Per block, in fewer and cheaper passes than `weight_offsets`: the packed bytes
    widened to uint16 and their two nibbles spread to the two bytes of each (`b | b << 4`
    masked with 0x0F0F: low nibble in the low byte, what `unpack_int4` writes at k = 2j on a
    little-endian host) in contiguous passes, instead of two strided byte writes; the
    zero point subtracted in int8; widened to f32, scaled. None where the offsets of
    some zero point do not fit int8 (`weight_offsets` makes int16 ones) or on a
    big-endian host: the caller uses `weight_offsets`. `zeros_checked`: the caller found
    every zero point within [-112, 127] (`weight_cache.packed_int8`): not checked again."""
    if sys.byteorder != "little":
        return None
    fx = f32(x)
    n, half = qweight.shape
    k = 2 * half
    g = k // group_size
    if zeros is None:
        z: np.ndarray | int = 0 if mins is not None else 8
    else:
        zs = np.asarray(zeros)
        if not zeros_checked and zs.size and (int(zs.min()) < -112 or int(zs.max()) > 127):
            return None  # q - z outside int8 (weight_offsets: int16)
        z = (zs.view(np.int8) if zs.dtype == np.uint8 else zs.astype(np.int8))[:, :, None]
    sf = f32(scales)
    mf = None if mins is None else f32(mins)
    rows = max(1, min(block_rows, n))
    r = np.empty((*fx.shape[:-1], n), np.float32)

    def blocks(start: int, end: int) -> None:
        wide = np.empty((rows, half), np.uint16)
        shifted = np.empty_like(wide)
        block = np.empty((rows, g, group_size), np.float32)
        for r0 in range(start, end, rows):
            m = min(rows, end - r0)
            v = wide[:m]
            _spread_nibbles(v, qweight[r0:r0 + m], shifted[:m])
            d = v.view(np.int8).reshape(m, g, group_size)  # q of each weight, k in order
            if isinstance(z, np.ndarray):
                np.subtract(d, z[r0:r0 + m], out=d)
            elif z:
                np.subtract(d, np.int8(z), out=d)
            b = block[:m]
            np.copyto(b, d)
            _scale_block(b, sf[r0:r0 + m], None if mf is None else mf[r0:r0 + m])
            _block_product(fx, b.reshape(m, k), r, r0)

    _row_blocks(blocks, math.prod(fx.shape[:-1]), k, n, rows)
    return _biased(r, bias, out_dtype, x)


def a16_matmul(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
               zeros: np.ndarray | None, bias: np.ndarray | None, bits: int, group_size: int,
               out_dtype: OutDType = None, mins: np.ndarray | None = None) -> np.ndarray:
    return matmul_dequantized(x, dequantize(qweight, scales, zeros, bits, group_size, mins),
                              bias, out_dtype)


def a16_matmul_part(acc: np.ndarray | None, x: np.ndarray, qweight: np.ndarray,
                    scales: np.ndarray, zeros: np.ndarray | None, bits: int,
                    group_size: int, mins: np.ndarray | None = None) -> np.ndarray:
    """One part of an `a16_matmul` split along K (whole quantization groups): `acc` +
    x @ dequantize(part).T in f32, without the bias (`matmul_finish` adds it); `mins`:
    the scale-and-min form's part (`dequantize`)."""
    return matmul_dequantized_part(acc, x, dequantize(qweight, scales, zeros, bits,
                                                      group_size, mins))


def a16_moe_experts_part(acc: np.ndarray | None, x: np.ndarray,
                         gate_q: np.ndarray, gate_s: np.ndarray, gate_z: np.ndarray | None,
                         gate_m: np.ndarray | None,
                         up_q: np.ndarray, up_s: np.ndarray, up_z: np.ndarray | None,
                         up_m: np.ndarray | None,
                         down_q: np.ndarray, down_s: np.ndarray, down_z: np.ndarray | None,
                         down_m: np.ndarray | None,
                         weights: np.ndarray, indices: np.ndarray, *, bits: Sequence[int],
                         group_sizes: Sequence[int], fetched_from: int | None = None,
                         block: tuple[int, int] | None = None) -> np.ndarray:
    """`moe_experts_part` with quantized experts (`tpu.a16_moe_experts`): each projection
    stacked by expert in `tpu.a16_matmul`'s layout (qweight [E, N, K/2] or [E, N, K],
    scales [E, N, G], zero points or mins [E, N, G] or None), `bits` and `group_sizes`
    per projection (gate, up, down). Only the experts some token chose are dequantized
    (`dequantize`, the a16_matmul's own), then computed as the float experts are
    (`fetched_from` and `block` as there)."""
    stacked = ((gate_q, gate_s, gate_z, gate_m), (up_q, up_s, up_z, up_m),
               (down_q, down_s, down_z, down_m))

    def expert(e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g, u, d = (dequantize(q[e], s[e], None if z is None else z[e], b, gs,
                              None if m is None else m[e])
                   for (q, s, z, m), b, gs in zip(stacked, bits, group_sizes, strict=True))
        return g, u, d

    return _experts_fold(acc, x, weights, indices, gate_q.shape[0], expert, fetched_from,
                         block)


def a16_moe_experts(x: np.ndarray, gate_q: np.ndarray, gate_s: np.ndarray,
                    gate_z: np.ndarray | None, gate_m: np.ndarray | None, up_q: np.ndarray,
                    up_s: np.ndarray, up_z: np.ndarray | None, up_m: np.ndarray | None,
                    down_q: np.ndarray, down_s: np.ndarray, down_z: np.ndarray | None,
                    down_m: np.ndarray | None, weights: np.ndarray, indices: np.ndarray, *,
                    bits: Sequence[int], group_sizes: Sequence[int],
                    out_dtype: OutDType = None, fetched_from: int | None = None
                    ) -> np.ndarray:
    """The quantized experts (`tpu.a16_moe_experts`): one part over all of I
    (`a16_moe_experts_part`), rounded to `out_dtype` (default: x's)."""
    return moe_experts_finish(a16_moe_experts_part(
        None, x, gate_q, gate_s, gate_z, gate_m, up_q, up_s, up_z, up_m, down_q, down_s,
        down_z, down_m, weights, indices, bits=bits, group_sizes=group_sizes,
        fetched_from=fetched_from), out_dtype, x)


def matmul_dequantized_part(acc: np.ndarray | None, x: np.ndarray, w: np.ndarray
                            ) -> np.ndarray:
    """`a16_matmul_part` with the part's weights dequantized (`dequantize`); contiguous
    operands, as `matmul_part`."""
    r = _matmul(np.ascontiguousarray(f32(x)), np.ascontiguousarray(w).T)
    if acc is None:
        return r
    return np.add(acc, r, out=r)


def matmul_dequantized(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
                       out_dtype: OutDType = None) -> np.ndarray:
    """The second half of `a16_matmul`: x @ w.T (+ bias) in f32 with `w` = `dequantize(...)`
    (callers that hold the same weights for many calls dequantize once)."""
    return _biased(_matmul(f32(x), w.T), bias, out_dtype, x)


def _biased(r: np.ndarray, bias: np.ndarray | None, out_dtype: OutDType, like: np.ndarray
            ) -> np.ndarray:
    """A dequantized matmul's f32 product `r` plus `bias`, rounded to the output dtype."""
    if bias is not None:
        r = r + f32(bias)
    return _out(r, out_dtype, like)


# ---------------------------------------------------------------------- collectives


def _add_rounded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One device's add of two partial sums: in f32, rounded to their dtype."""
    return round_to(f32(a) + f32(b), np.asarray(a).dtype)


def all_reduce(parts: Sequence[np.ndarray], algorithm: str) -> np.ndarray:
    """The sum every device holds after an all-reduce of `parts` (device order), added in the
    order `algorithm` adds them (each add in f32, rounded to the parts' dtype, as a device
    adds what it received; addition commutes, so every device ends with these bits):

    - `ring`: the tensor in N chunks (of its flattened elements); chunk c is summed around the
      ring starting at device c: ((p_c + p_c+1) + p_c+2) + ... (indices mod N);
    - `tree`: recursive doubling: with N a power of two, at step t every device adds the
      partial sum of the device 2^t away; otherwise the devices past the largest power of
      two P first add into devices 0.., the P devices double, and the sums go back."""
    n = len(parts)
    if n == 0:
        raise ValueError("an all-reduce of no parts")
    shape, dt = np.shape(parts[0]), np.asarray(parts[0]).dtype
    if any(np.shape(p) != shape or np.asarray(p).dtype != dt for p in parts):
        raise ValueError("all-reduce parts differ in shape or dtype")
    if n == 1:
        return np.array(parts[0])
    if algorithm == "ring":
        flat = [np.asarray(p).reshape(-1) for p in parts]
        size = flat[0].size
        out = np.empty(size, dt)
        step = -(-size // n)
        for c in range(n):
            lo, hi = c * step, min((c + 1) * step, size)
            if lo >= hi:
                continue
            acc = flat[c][lo:hi]
            for j in range(1, n):
                acc = _add_rounded(acc, flat[(c + j) % n][lo:hi])
            out[lo:hi] = acc
        return out.reshape(shape)
    if algorithm != "tree":
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")
    vals = [np.asarray(p) for p in parts]
    p2 = 1 << (n.bit_length() - 1)
    for i in range(p2, n):  # fold the extra devices in
        vals[i - p2] = _add_rounded(vals[i - p2], vals[i])
    t = 1
    while t < p2:
        vals[:p2] = [_add_rounded(vals[i], vals[i ^ t]) for i in range(p2)]
        t <<= 1
    return np.array(vals[0])


def all_gather(parts: Sequence[np.ndarray], axis: int) -> np.ndarray:
    """Every device's part concatenated along `axis` in device order."""
    return np.concatenate([np.asarray(p) for p in parts], axis=axis)
