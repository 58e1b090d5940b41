"""The integer grid every calibrated method quantizes onto: per group of input channels a
float scale and an integer zero point, ``w ~ (q - zero) * scale``, ``q`` in ``[0, 2**bits)``.

The grid is GPTQ's (`Quantizer.find_params` of the GPTQ reference code and AutoGPTQ):

- asymmetric: ``lo = min(min(w), 0)``, ``hi = max(max(w), 0)``, ``scale = (hi - lo) / maxq``,
  ``zero = round(-lo / scale)``;
- symmetric: ``hi = max|w|``, ``scale = 2 * hi / maxq``, ``zero = (maxq + 1) / 2`` (8 for 4
  bits: the integers stand for -8..7 steps);
- a group of zeros gets ``lo, hi = -1, 1``;
- ``q = clamp(round(w / scale) + zero, 0, maxq)`` (round half to even).

With the range search ``mse`` (`RANGE_SEARCHES`; the GPTQ reference code's
``Quantizer(mse=True)`` with its defaults ``grid=100``, ``maxshrink=0.8``, ``norm=2.4``) the
range ``lo, hi`` above is shrunk to ``p lo, p hi`` for ``p = 1, 0.99, ..., 0.21`` and each
group keeps the first ``p`` whose grid gives the least ``sum |dequantized - w|^2.4``
(`mse_grid_params`); ``minmax`` (the default) keeps ``p = 1``.

One change from the reference: the scale is rounded to its storage dtype (float16 by
default, as GPTQ checkpoints store it) *before* the zero point and the integers are computed,
so the integers are the best ones for the scale a kernel really reads, and dequantizing the
stored checkpoint (`frontends.quant.QuantizedLinear.dequantize`: ``(q - zero) * scale`` in
float32) gives exactly the weights the algorithm worked with. (``q - zero`` is an integer of
at most 8 bits and the scale a float16: their product is exact in float32 and float64.)
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from toptpu.dialects.common import DEFAULT_GROUP_SIZE
from toptpu.errors import ToptpuError

#: weight bits a calibrated checkpoint may have (the GPTQ layout packs them into int32 words)
CALIBRATED_BITS = (4, 8)
#: group sizes besides -1 (one group per output row)
GROUP_SIZES = (32, 64, 128)
#: how a group's range is found: its min/max, or the GPTQ reference's MSE grid over shrunk
#: ranges (module doc)
RANGE_SEARCHES = ("minmax", "mse")
#: the MSE grid's defaults in the GPTQ reference code (`Quantizer.configure`)
MSE_GRID = 100
MSE_MAX_SHRINK = 0.8
MSE_NORM = 2.4


class CalibrationError(ToptpuError, ValueError):
    """A calibration that cannot be done as asked; the message names what and why."""


@dataclass(frozen=True)
class QuantScheme:
    """How the weights are quantized: bits, group size (-1: one group per output row; by
    default the compiler's round-to-nearest group size), symmetric or not, and the scales'
    storage dtype."""

    bits: int = 4
    group_size: int = DEFAULT_GROUP_SIZE
    sym: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.bits not in CALIBRATED_BITS:
            bits = " or ".join(map(str, CALIBRATED_BITS))
            raise CalibrationError(f"calibrated weights have {bits} bits, not {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise CalibrationError(f"group size {self.group_size}: use a positive size (e.g. "
                                   f"{', '.join(map(str, GROUP_SIZES))}) or -1 (per channel)")
        if self.scale_dtype not in ("float16", "bfloat16", "float32"):
            raise CalibrationError(f"scale dtype {self.scale_dtype}: float16, bfloat16 or float32")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_length(self, in_features: int) -> int:
        """The channels of one group of a linear with `in_features` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def fits(self, out_features: int, in_features: int) -> bool:
        """The GPTQ layout can hold a linear of this shape: whole groups, whole int32 words
        of integers (along K) and of zero points (along N)."""
        per = 32 // self.bits
        gs = self.group_length(in_features)
        return in_features % gs == 0 and in_features % per == 0 and out_features % per == 0

    @property
    def numpy_scale_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16) if self.scale_dtype == "bfloat16" else \
            np.dtype(self.scale_dtype)


def round_scale(scale: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """`scale` rounded to the storage dtype (float64 values of it); a scale that rounds to 0
    becomes the dtype's smallest positive value."""
    dt = scheme.numpy_scale_dtype
    stored = np.asarray(scale).astype(dt)
    if not np.all(np.isfinite(stored.astype(np.float64))):
        raise CalibrationError(f"a quantization scale of {float(np.max(scale)):.3g} does not fit "
                               f"{scheme.scale_dtype}: the weights are too large for this "
                               "scale dtype")
    out = stored.astype(np.float64)
    return np.where(out == 0, _smallest_positive(dt), out)


def _smallest_positive(dt: np.dtype) -> float:
    if dt.itemsize == 2:
        return float(np.array([1], np.uint16).view(dt)[0])
    return float(np.array([1], np.uint32).view(np.float32)[0])


def _group_range(w: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of each row of `w` [N, g] (float64): GPTQ's range, zero inside it."""
    lo = np.minimum(w.min(axis=1), 0.0)
    hi = np.maximum(w.max(axis=1), 0.0)
    if scheme.sym:
        hi = np.maximum(-lo, hi)
        lo = np.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    return np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)


def _grid_of_range(lo: np.ndarray, hi: np.ndarray, scheme: QuantScheme
                   ) -> tuple[np.ndarray, np.ndarray]:
    maxq = scheme.maxq
    scale = round_scale((hi - lo) / maxq, scheme)
    if scheme.sym:
        zero = np.full_like(scale, (maxq + 1) / 2)
    else:
        zero = np.clip(np.rint(-lo / scale), 0, maxq)
    return scale, zero


def grid_params(w: np.ndarray, scheme: QuantScheme, ranges: str = "minmax"
                ) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero) for each row of `w` [N, g] (one group per row): float64 scales holding
    storage-dtype values, float64 integer zero points; `ranges` ``mse``: `mse_grid_params`."""
    if ranges == "mse":
        return mse_grid_params(w, scheme)
    if ranges != "minmax":
        raise CalibrationError(f"range search '{ranges}': one of {', '.join(RANGE_SEARCHES)}")
    w = np.asarray(w, dtype=np.float64)
    return _grid_of_range(*_group_range(w, scheme), scheme)


def mse_grid_params(w: np.ndarray, scheme: QuantScheme, grid: int = MSE_GRID,
                    max_shrink: float = MSE_MAX_SHRINK, norm: float = MSE_NORM
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`grid_params` of the range shrunk by the GPTQ reference's MSE grid (module doc): for
    ``i`` in ``0 .. int(max_shrink * grid) - 1`` the range times ``p = 1 - i / grid`` (the
    scale rounded to its storage dtype, as every grid here), each row keeping the grid of
    the first ``p`` with the least ``sum |(q - zero) scale - w|^norm``, that error in
    float32 as the reference code's (3x faster than float64 on a CPU)."""
    w = np.asarray(w)
    scale = np.zeros(w.shape[0])
    zero = np.zeros(w.shape[0])
    rows = max(1, (1 << 21) // max(1, w.shape[1]))  # a block's temporaries: 16 MB each
    for r0 in range(0, w.shape[0], rows):
        part = np.asarray(w[r0:r0 + rows], dtype=np.float64)
        part32 = part.astype(np.float32)
        lo, hi = _group_range(part, scheme)
        best = np.full(part.shape[0], np.inf)
        for i in range(int(max_shrink * grid)):
            p = 1 - i / grid
            s1, z1 = _grid_of_range(p * lo, p * hi, scheme)
            s32, z32 = s1.astype(np.float32)[:, None], z1.astype(np.float32)[:, None]
            q = np.clip(np.rint(part32 / s32) + z32, 0, scheme.maxq)
            err = np.sum(np.abs((q - z32) * s32 - part32) ** np.float32(norm), axis=1)
            better = err < best
            best[better] = err[better]
            scale[r0:r0 + rows][better] = s1[better]
            zero[r0:r0 + rows][better] = z1[better]
    return scale, zero


def quantize_column(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, maxq: int
                    ) -> np.ndarray:
    """The integers (float64) of values `w` on the grid (scale, zero), elementwise."""
    return np.clip(np.rint(w / scale) + zero, 0, maxq)


@dataclass
class QuantizedWeights:
    """One linear's quantization as a calibrated checkpoint stores it (the canonical form of
    `frontends.quant.QuantizedLinear`): ``qweight[n, k]`` uint8, ``scales``/``zeros``
    ``[N, G]`` (groups contiguous along K: ``k // group_length``), scales in their storage
    dtype, zeros uint8."""

    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    scheme: QuantScheme

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]`` = ``(q - zero) * scale``, as `QuantizedLinear.dequantize`
        (computed in the result's memory)."""
        n, k = self.qweight.shape
        gs = self.scheme.group_length(k)
        out = self.qweight.astype(np.float32).reshape(n, k // gs, gs)
        out -= self.zeros.astype(np.float32)[:, :, None]
        out *= self.scales.astype(np.float32)[:, :, None]
        return out.reshape(n, k)


def rtn(weight: np.ndarray, scheme: QuantScheme) -> QuantizedWeights:
    """Round-to-nearest onto the grid, group by group (what GPTQ does without error
    feedback)."""
    w = np.asarray(weight, dtype=np.float64)
    n, k = w.shape
    gs = scheme.group_length(k)
    if k % gs:
        raise CalibrationError(f"group size {gs} does not divide in_features {k}")
    g = w.reshape(n, k // gs, gs)
    scale, zero = grid_params(g.reshape(-1, gs), scheme)
    scale, zero = scale.reshape(n, -1), zero.reshape(n, -1)
    q = quantize_column(g, scale[..., None], zero[..., None], scheme.maxq).reshape(n, k)
    return QuantizedWeights(q.astype(np.uint8), scale.astype(scheme.numpy_scale_dtype),
                            zero.astype(np.uint8), scheme)
