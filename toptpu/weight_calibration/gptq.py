"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), as the GPTQ reference code and AutoGPTQ implement it.

For one linear ``y = x W^T`` (``W`` [N, K]) and its calibration inputs ``X`` [n, K]:

1. ``H = 2/n X^T X`` (`HessianAccumulator`, summed batch by batch). Channels never seen
   (``H[k, k] == 0``) get ``H[k, k] = 1`` and ``W[:, k] = 0``.
2. act-order (optional): columns in descending ``diag(H)``. With act-order the groups are
   *static*: each group's scale and zero point come from the original weights of its own
   contiguous channels (``k // group``) before any column is quantized, so the stored groups
   stay contiguous and ``g_idx`` is trivial once the integers are put back in channel order.
   Without act-order a group's grid is found from its columns as updated so far, when its
   first column is reached. A grid is the group's min/max or, with ``ranges="mse"``, the
   reference code's MSE grid over shrunk ranges (`grid.mse_grid_params`), found on the same
   weights.
3. Damping: ``H += percdamp * mean(diag(H)) * I``; if ``H`` is still not positive definite
   the damping is raised tenfold (to at most 100 %) and the result says which was used.
4. ``U = cholesky(H^-1)^T`` (upper); then Algorithm 1 with lazy batch updates: columns in
   blocks of `block_size` (a multiple of the group size, so a group's columns are all up to
   date when its grid is found); within a block each column is quantized, its error
   ``e = (w - q) / U[j, j]`` spread over the block's remaining columns (``-e U[j, j:]``), and
   after the block the whole block's errors over the rest of the matrix at once.

GPTAQ (Li et al., ICML 2025, "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric
Calibration", first "GPTQv2"; GPTQModel's ``v2=True``): the linear's output is matched to
the *float* model's, ``|| W X_float - Q X ||``, where ``X_float`` are the inputs the float
model gives the linear and ``X`` those the quantized layers before it give. Besides ``H``
it takes ``dXX^T = 2/n (X_float - X)^T X`` (`AsymmetryAccumulator`; ``[:, dead] = 0``,
permuted as ``H``) and ``P = alpha triu(dXX^T U^T, 1) U`` (`asymmetry_term`, alpha 0.25 as
its reference code and GPTQModel), and each column's update gains ``+ w P[j, j:]``: within
a block ``w`` is the column before rounding, across blocks the block's columns after it (as
the reference code's lazy batches do: it holds the rounded values there).

Precision: the dtype of the Hessian, float32 (as the reference code and AutoGPTQ, and what
the calibration uses) or float64 (the exact check against a transcription of Algorithm 1).
In float32 the Hessian, its permutation, damping and factor share one K x K matrix
(`prepare_hessian` with ``overwrite``): 1.4 GB for Qwen2.5-7B's down_proj (K = 18944), where
float64 and the copies of a plain factorization would take 2.9 GB each. The suite checks
that float32 gives float64's integers but for a few near a rounding boundary. GPTAQ's P is
strictly upper triangular and U upper: `asymmetry_rows` puts P, transposed, in the strict
lower triangle of U's own matrix, a run of rows at a time from those rows of ``dXX^T``
(`AsymmetryInFactor`), so a stage needs one K x K matrix where `asymmetry_term` needs two
(the driver's choice, `sequential._gptaq_stage`).

The integers, scales and zero points are exactly what the stored checkpoint holds (the grid
of `grid`: scales rounded to their storage dtype first).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toptpu.weight_calibration.grid import (
    CalibrationError,
    QuantizedWeights,
    QuantScheme,
    grid_params,
    quantize_column,
)

#: damping fractions tried in turn when H + damp is not positive definite
DAMPING_STEPS = 4
#: the dtypes GPTQ works in: float32 (the GPTQ reference code's and AutoGPTQ's) or float64
GPTQ_DTYPES = ("float32", "float64")
#: columns of the lazy batch update computed at a time (bounds its temporaries)...
UPDATE_COLUMNS = 4096
#: ... and fewer where the weight has so many rows that they would take more than this
#: each (Qwen2.5-7B's gate/up: 18944 rows)
UPDATE_BYTES = 1 << 25


class NotPositiveDefinite(CalibrationError):
    """``H + damp I`` is not positive definite at this damping (`prepare_hessian`)."""

    def __init__(self, percdamp: float) -> None:
        super().__init__(f"the Hessian is not positive definite with {percdamp:.0%} damping")
        self.percdamp = percdamp


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the duration (LAPACK's potri spins on a loaded
    two-core host when given two: 15-20x slower than one, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HessianAccumulator:
    """``2/n X^T X`` over the input rows ``X`` added so far, in `dtype`: float32 is summed in
    place (one K x K matrix: K x K x 4 bytes, 1.4 GB for Qwen2.5-7B's down_proj); float64
    adds each batch's float32 product to a float64 sum."""

    def __init__(self, in_features: int, dtype: str = "float32") -> None:
        if dtype not in GPTQ_DTYPES:
            raise CalibrationError(f"GPTQ dtype '{dtype}': one of {', '.join(GPTQ_DTYPES)}")
        self.sum = torch.zeros(in_features, in_features, dtype=getattr(torch, dtype))
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Rows of inputs ``[..., K]``."""
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        if self.sum.dtype == torch.float32:
            self.sum.addmm_(x2.T, x2)
        else:
            self.sum += (x2.T @ x2).to(torch.float64)
        self.rows += x2.shape[0]

    def hessian(self) -> np.ndarray:
        """The Hessian, scaled in place: the accumulator's own memory (it is spent)."""
        if self.rows == 0:
            raise CalibrationError("no calibration inputs reached this linear")
        self.sum.mul_(2.0 / self.rows)
        return self.sum.numpy()


class AsymmetryAccumulator:
    """GPTAQ's ``dXX^T = 2/n (X_float - X)^T X`` over pairs of rows added so far (module
    doc): the float model's inputs of the linear and the quantized layers' inputs of it for
    the same tokens, summed in float32 in place (one K x K matrix)."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.rows = 0

    def add(self, x_float: torch.Tensor, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        d2 = x_float.detach().reshape(-1, x.shape[-1]).to(torch.float32) - x2
        self.sum.addmm_(d2.T, x2)
        self.rows += x2.shape[0]

    def cross(self) -> np.ndarray:
        """``dXX^T``, scaled in place (the accumulator is spent)."""
        if self.rows == 0:
            raise CalibrationError("no calibration inputs reached this linear")
        self.sum.mul_(2.0 / self.rows)
        return self.sum.numpy()


#: GPTAQ's scale of its asymmetry term (its reference code's and GPTQModel's default)
GPTAQ_ALPHA = 0.25


def asymmetry_term(cross: np.ndarray, prepared: PreparedHessian, alpha: float = GPTAQ_ALPHA,
                   block_bytes: int = 1 << 27) -> np.ndarray:
    """GPTAQ's ``P = alpha triu(dXX^T U^T, 1) U`` in GPTQ's column order (module doc), from
    ``dXX^T`` `cross` (`AsymmetryAccumulator.cross`) and the prepared Hessian's dead
    channels, order and factor ``U``, in U's dtype. P is made in `cross`'s own memory when
    it has U's dtype (overwritten), `block_bytes` of rows at a time (row r of P needs row r
    of dXX^T alone): no other K x K matrix (1.4 GB at Qwen2.5-7B's down_proj)."""
    u = prepared.upper
    d = cross if cross.dtype == u.dtype and cross.flags.writeable else cross.astype(u.dtype)
    d[:, prepared.dead] = 0.0
    if not np.array_equal(prepared.perm, np.arange(len(prepared.perm))):
        permute_symmetric(d, prepared.perm)
    k = d.shape[0]
    rows = max(1, block_bytes // (d.itemsize * k))
    for r0 in range(0, k, rows):
        part = d[r0:r0 + rows]
        a = np.triu(part @ u.T, r0 + 1)  # triu(., 1) of these rows of the whole
        np.matmul(a, u, out=part)
        part *= alpha
    return d


class AsymmetryInFactor:
    """`gptq`'s `asymmetry` when GPTAQ's P is held in the prepared factor's own matrix: U on
    and above the diagonal, P transposed in the strict lower triangle (P is strictly upper
    triangular, U upper: together one K x K matrix; `asymmetry_rows` puts P there)."""


def asymmetry_rows(rows: np.ndarray, r0: int, prepared: PreparedHessian,
                   alpha: float = GPTAQ_ALPHA, block_bytes: int = 1 << 25) -> None:
    """Rows ``r0 : r0 + len(rows)`` of GPTAQ's P (`asymmetry_term`) from those rows of
    ``dXX^T`` in GPTQ's order (`rows`: rows and columns permuted, dead columns zeroed, in
    U's dtype; overwritten), stored transposed in the strict lower triangle of the
    prepared factor's matrix (`AsymmetryInFactor`). Row r of P needs row r of dXX^T and
    U's rows and columns r + 1 onward alone (``triu(., 1)`` drops the rest), so the calls
    go in ascending, disjoint runs of rows: the runs stored so far lie in columns before
    ``r0``, never read again. `rows` is turned into P `block_bytes` of rows at a time (that
    block's two temporaries). The sums start at column r0 + 1 where `asymmetry_term`'s run
    over the whole row (its other terms exact zeros): the same values, which may round
    differently in their last bits."""
    m = prepared.upper
    k = m.shape[0]
    n = rows.shape[0]
    if rows.shape[1] != k or rows.dtype != m.dtype or r0 < 0 or r0 + n > k:
        raise CalibrationError(f"rows {r0}:{r0 + n} of dXX^T of {rows.dtype} "
                               f"{list(rows.shape)} for a factor of {m.dtype} {list(m.shape)}")
    c0 = r0 + 1
    if c0 >= k:
        return  # P's last row is zero
    u = m[c0:, c0:]  # U's rows and columns from c0 on; below its diagonal still zeros
    step = max(1, block_bytes // (rows.itemsize * k))
    for s0 in range(0, n, step):
        s1 = min(s0 + step, n)
        part = rows[s0:s1, c0:]
        a = np.triu(part @ u.T, s0)  # row r0 + s keeps columns after r0 + s
        np.matmul(a, u, out=part)
        part *= alpha
        del a
    # P[r, c] (c > r) to m[c, r]: the rows c past the run whole, the run's square below its
    # diagonal
    p_t = rows[:, c0:].T
    target = m[c0:, r0:r0 + n]
    top = min(n, k - c0)
    for t0 in range(top, k - c0, max(1, step)):
        target[t0:t0 + step] = p_t[t0:t0 + step]
    below = np.tri(top, n, 0, dtype=bool)
    square = target[:top]
    square[below] = p_t[:top][below]


@dataclass
class GptqResult:
    weights: QuantizedWeights
    #: sum over the weights of (w - q)^2 / U[j, j]^2 / 2: GPTQ's own loss estimate
    loss: float
    #: the damping fraction used (percdamp, or more where H needed it)
    percdamp: float


def _lapack(name: str) -> Any:
    """LAPACK's Fortran routine `name` (e.g. 'spotrf_') from the library torch's own
    cholesky and cholesky_inverse call (MKL, linked into libtorch_cpu), or None where this
    torch does not export it."""
    lib = _LAPACK.get("lib")
    if lib is None:
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                           "libtorch_cpu.so"))
        except OSError:
            lib = False
        _LAPACK["lib"] = lib
    return getattr(lib, name, None) if lib else None


_LAPACK: dict[str, Any] = {}


def _lapack_in_place(routine: str, uplo: bytes, a: np.ndarray) -> int:
    """LAPACK's `routine` ('potrf' or 'potri', in `a`'s dtype) on the square C-contiguous
    `a` taken as the column-major matrix ``a.T``, in its own memory; LAPACK's info."""
    fn = _lapack(("s" if a.dtype == np.float32 else "d") + routine + "_")
    n = ctypes.c_int(a.shape[0])
    info = ctypes.c_int(0)
    fn(ctypes.c_char_p(uplo), ctypes.byref(n), a.ctypes.data_as(ctypes.c_void_p),
       ctypes.byref(n), ctypes.byref(info))
    return int(info.value)


def _rows_per_block(a: np.ndarray) -> int:
    return max(1, (1 << 24) // max(1, a.shape[1] * a.itemsize))


def _lower_from_upper(a: np.ndarray, zero: bool = False) -> None:
    """``a``'s strict lower triangle set to its upper triangle's mirror (or to zero with
    `zero`), a block of rows at a time (that block's temporary)."""
    k = a.shape[0]
    step = _rows_per_block(a)
    for r0 in range(0, k, step):
        r1 = min(r0 + step, k)
        lower = np.arange(r1)[None, :] < np.arange(r0, r1)[:, None]
        rows = a[r0:r1, :r1]
        if zero:
            rows[lower] = 0
        else:
            rows[lower] = a[:r1, r0:r1].T[lower]


def inverse_cholesky_upper(h: np.ndarray, percdamp: float) -> np.ndarray:
    """``cholesky((H + damp I)^-1)`` as an upper triangle (zeros below), computed in the
    memory of `h` (C-contiguous, overwritten; returned): damping added to the diagonal,
    then LAPACK's potrf, potri, potrf, called in place on `h` (no other K x K matrix is
    made: torch's `cholesky_ex` and `cholesky_inverse` with ``out=`` the input each make
    and copy back a K x K result, 1.4 GB at Qwen2.5-7B's down_proj). The routines and
    triangles are those torch calls (MKL's, from libtorch_cpu; one thread, `torch_threads`),
    so the factor is torch's bit for bit (tested); where this torch exports no LAPACK, its
    functions are called instead. Raises NotPositiveDefinite when ``H + damp I`` is not (`h`
    is spent then)."""
    t = torch.from_numpy(h)
    mean_diag = float(t.diagonal().mean(dtype=torch.float64))
    t.diagonal().add_(percdamp * mean_diag)
    if _lapack("spotrf_") is None or _lapack("spotri_") is None:
        return _inverse_cholesky_upper_torch(h, percdamp)
    # h read as a column-major matrix is H^T. torch factors the lower triangle of H (a sum
    # of products need not be symmetric to the last bit): mirrored into h's upper triangle,
    # the column-major matrix is that. potrf('L') leaves L in its lower triangle (h's
    # upper), potri('L') the inverse's lower triangle there; mirrored into h's lower
    # triangle (the column-major upper one), potrf('U') leaves U in h's lower triangle as
    # U^T, mirrored back, the rest zeroed.
    _lower_from_upper(h.T)
    with torch_threads(1):
        info = _lapack_in_place("potrf", b"L", h)
        if info == 0:
            info = _lapack_in_place("potri", b"L", h)
        if info == 0:
            _lower_from_upper(h)
            info = _lapack_in_place("potrf", b"U", h)
    if info != 0:
        raise NotPositiveDefinite(percdamp)
    _lower_from_upper(h.T)
    _lower_from_upper(h, zero=True)
    if not bool(np.isfinite(np.diagonal(h)).all()):
        raise NotPositiveDefinite(percdamp)
    return h


def _inverse_cholesky_upper_torch(h: np.ndarray, percdamp: float) -> np.ndarray:
    """`inverse_cholesky_upper` by torch's functions (the damping already added): each makes
    a K x K result of its own before copying it into `h`."""
    t = torch.from_numpy(h)
    info = torch.zeros((), dtype=torch.int32)
    with torch_threads(1):
        torch.linalg.cholesky_ex(t, out=(t, info))
        if int(info) == 0:
            torch.cholesky_inverse(t, out=t)
            torch.linalg.cholesky_ex(t, upper=True, out=(t, info))
    if int(info) != 0 or not bool(torch.isfinite(t.diagonal()).all()):
        raise NotPositiveDefinite(percdamp)
    return h


def permute_columns(a: np.ndarray, perm: np.ndarray) -> None:
    """``a <- a[:, perm]`` in place, a block of rows at a time (that block's temporary)."""
    step = max(1, (1 << 24) // max(1, a.shape[1] * a.itemsize))
    for r in range(0, a.shape[0], step):
        a[r:r + step] = a[r:r + step][:, perm]


def permute_symmetric(h: np.ndarray, perm: np.ndarray) -> None:
    """``h <- h[perm][:, perm]`` in place: each block of rows permuted along its columns (a
    block's temporary), then the rows moved along the permutation's cycles (a row's)."""
    k = h.shape[0]
    step = max(1, (1 << 24) // max(1, k * h.itemsize))
    for r in range(0, k, step):
        h[r:r + step] = h[r:r + step][:, perm]
    done = np.zeros(k, dtype=bool)
    for start in range(k):
        if done[start]:
            continue
        done[start] = True
        if perm[start] == start:
            continue
        first = h[start].copy()
        i = start
        while perm[i] != start:
            h[i] = h[perm[i]]
            i = int(perm[i])
            done[i] = True
        h[i] = first


@dataclass
class PreparedHessian:
    """What GPTQ derives from a Hessian alone, shared by the linears of one input: the
    channels never seen, the column order, ``cholesky((H + damp I)^-1)^T`` in that order,
    and the damping used."""

    dead: np.ndarray
    perm: np.ndarray
    upper: np.ndarray
    percdamp: float


def prepare_hessian(hessian: np.ndarray, *, act_order: bool = False, percdamp: float = 0.01,
                    overwrite: bool = False) -> PreparedHessian:
    """Dead channels, act-order's permutation, damping and the inverse's Cholesky factor of
    `hessian` (in its dtype, float32 or float64). With `overwrite` the factor is made in the
    Hessian's own memory (no copy: what bounds a 7B-shaped layer) and a damping too small
    raises NotPositiveDefinite (the Hessian is spent: the caller makes it again and asks
    with more damping); otherwise a copy is factored and the damping raised tenfold, up to
    100 %, until ``H + damp I`` is positive definite."""
    if hessian.dtype not in (np.float32, np.float64) or hessian.ndim != 2 \
            or hessian.shape[0] != hessian.shape[1]:
        raise CalibrationError(f"a Hessian of {hessian.dtype} {list(hessian.shape)}: a square "
                               "float32 or float64 matrix")
    diag = np.diag(hessian).copy()
    dead = diag == 0
    diag[dead] = 1.0
    perm = np.argsort(-diag, kind="stable") if act_order else np.arange(hessian.shape[0])

    def ready(h: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(dead)
        h[idx, idx] = 1.0
        if act_order:
            permute_symmetric(h, perm)
        return h

    if overwrite and hessian.flags.c_contiguous and hessian.flags.writeable:
        upper = inverse_cholesky_upper(ready(hessian), percdamp)
        return PreparedHessian(dead, perm, upper, percdamp)
    damp = percdamp
    for _ in range(DAMPING_STEPS):
        try:
            upper = inverse_cholesky_upper(ready(np.array(hessian, order="C")), damp)
            return PreparedHessian(dead, perm, upper, damp)
        except NotPositiveDefinite:
            damp = min(damp * 10, 1.0)
    raise CalibrationError(f"the Hessian stays singular with {damp:.0%} damping: the "
                           "calibration inputs do not determine this linear (more or more "
                           "varied calibration text)")


def gptq(weight: np.ndarray, hessian: np.ndarray | PreparedHessian, scheme: QuantScheme, *,
         act_order: bool = False, block_size: int = 128, percdamp: float = 0.01,
         ranges: str = "minmax", asymmetry: np.ndarray | AsymmetryInFactor | None = None
         ) -> GptqResult:
    """GPTQ of `weight` [N, K] with the input Hessian `hessian` [K, K] (module doc), or its
    `prepare_hessian` (made with the same `act_order` and `percdamp`), in the Hessian's
    dtype (float32 or float64); each group's grid by `ranges` (`grid.RANGE_SEARCHES`);
    with `asymmetry` (GPTAQ's P, `asymmetry_term` of the same prepared Hessian, or
    `AsymmetryInFactor`: P in the prepared factor's lower triangle) GPTAQ."""
    prepared = hessian if isinstance(hessian, PreparedHessian) else prepare_hessian(
        hessian, act_order=act_order, percdamp=percdamp)
    upper = prepared.upper
    in_factor = isinstance(asymmetry, AsymmetryInFactor)
    if in_factor and not isinstance(hessian, PreparedHessian):
        raise CalibrationError("GPTAQ's P in the factor needs that prepared factor")
    dtype = upper.dtype
    n, k = weight.shape
    if upper.shape != (k, k):
        raise CalibrationError(f"a Hessian of {list(upper.shape)} for a weight of "
                               f"{list(weight.shape)}")
    gs = scheme.group_length(k)
    if k % gs:
        raise CalibrationError(f"group size {gs} does not divide in_features {k}")
    groups = k // gs
    maxq = scheme.maxq
    dead = prepared.dead

    scales = np.zeros((n, groups))
    zeros = np.zeros((n, groups))
    if act_order or gs == k:  # static grids: from the weights before any update
        for g in range(groups):
            part = np.array(weight[:, g * gs:(g + 1) * gs], dtype=dtype)
            part[:, dead[g * gs:(g + 1) * gs]] = 0.0
            scales[:, g], zeros[:, g] = grid_params(part, scheme, ranges)
            del part
    perm = prepared.perm
    # the one working copy of the weights, in GPTQ's column order
    w = np.asarray(weight[:, perm], dtype=dtype) if act_order else np.array(weight, dtype=dtype)
    w[:, dead[perm]] = 0.0

    block = block_size if gs == k else max(1, block_size // gs) * gs
    columns = UPDATE_COLUMNS if n * dtype.itemsize * UPDATE_COLUMNS <= UPDATE_BYTES \
        else max(1, UPDATE_BYTES // (n * dtype.itemsize))
    q = np.zeros((n, k), dtype=np.uint8)
    loss = 0.0
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].copy()
        err = np.zeros((n, i2 - i1), dtype=dtype)
        u1 = upper[i1:i2, i1:i2]
        p1 = None if asymmetry is None else asymmetry[i1:i2, i1:i2] \
            if isinstance(asymmetry, np.ndarray) else np.tril(upper[i1:i2, i1:i2], -1).T
        for i in range(i2 - i1):
            j = i1 + i
            g = perm[j] // gs
            if not act_order and gs < k and j % gs == 0:
                scales[:, g], zeros[:, g] = grid_params(w1[:, i:i + gs], scheme,
                                                           ranges)
            col = w1[:, i]
            qi = quantize_column(col, scales[:, g], zeros[:, g], maxq)
            dq = (qi - zeros[:, g]) * scales[:, g]
            e = (col - dq) / u1[i, i]
            loss += float(np.sum(e * e)) / 2
            step = e.astype(dtype)[:, None] * u1[i, i:]
            if p1 is not None:  # GPTAQ: the column before rounding
                step -= col[:, None] * p1[i, i:]
            w1[:, i:] -= step
            err[:, i] = e
            q[:, j] = qi
        for c1 in range(i2, k, columns):  # the block's errors over the rest, in parts
            c2 = min(c1 + columns, k)
            if asymmetry is None:
                w[:, c1:c2] -= err @ upper[i1:i2, c1:c2]
            else:  # GPTAQ: the block's columns as rounded
                p = asymmetry[i1:i2, c1:c2] if isinstance(asymmetry, np.ndarray) \
                    else np.ascontiguousarray(upper[c1:c2, i1:i2].T)
                w[:, c1:c2] -= err @ upper[i1:i2, c1:c2] - w1 @ p
    if act_order:
        q = q[:, np.argsort(perm)]
    qw = QuantizedWeights(q, scales.astype(scheme.numpy_scale_dtype), zeros.astype(np.uint8),
                          scheme)
    return GptqResult(qw, loss, prepared.percdamp)
