"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), as the GPTQ reference code and AutoGPTQ implement it, in float64.

For one linear ``y = x W^T`` (``W`` [N, K]) and its calibration inputs ``X`` [n, K]:

1. ``H = 2/n X^T X`` (`HessianAccumulator`, summed batch by batch in float32 and carried in
   float64). Channels never seen (``H[k, k] == 0``) get ``H[k, k] = 1`` and ``W[:, k] = 0``.
2. act-order (optional): columns in descending ``diag(H)``. With act-order the groups are
   *static*: each group's scale and zero point come from the original weights of its own
   contiguous channels (``k // group``) before any column is quantized, so the stored groups
   stay contiguous and ``g_idx`` is trivial once the integers are put back in channel order.
   Without act-order a group's grid is found from its columns as updated so far, when its
   first column is reached.
3. Damping: ``H += percdamp * mean(diag(H)) * I``; if ``H`` is still not positive definite
   the damping is raised tenfold (to at most 100 %) and the result says which was used.
4. ``U = cholesky(H^-1)^T`` (upper); then Algorithm 1 with lazy batch updates: columns in
   blocks of `block_size` (a multiple of the group size, so a group's columns are all up to
   date when its grid is found); within a block each column is quantized, its error
   ``e = (w - q) / U[j, j]`` spread over the block's remaining columns (``-e U[j, j:]``), and
   after the block the whole block's errors over the rest of the matrix at once.

The integers, scales and zero points are exactly what the stored checkpoint holds (the grid
of `grid`: scales rounded to their storage dtype first).
"""

from __future__ import annotations

from dataclasses import dataclass

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


class HessianAccumulator:
    """``2/n X^T X`` over the input rows ``X`` added so far (float64)."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Rows of inputs ``[..., K]`` (a batch's product in float32, summed in float64)."""
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        self.sum += (x2.T @ x2).to(torch.float64)
        self.rows += x2.shape[0]

    def hessian(self) -> np.ndarray:
        if self.rows == 0:
            raise CalibrationError("no calibration inputs reached this linear")
        return (self.sum * (2.0 / self.rows)).numpy()


@dataclass
class GptqResult:
    weights: QuantizedWeights
    #: sum over the weights of (w - q)^2 / U[j, j]^2 / 2: GPTQ's own loss estimate
    loss: float
    #: the damping fraction used (percdamp, or more where H needed it)
    percdamp: float


def inverse_cholesky_upper(h: np.ndarray, percdamp: float) -> tuple[np.ndarray, float]:
    """``cholesky((H + damp I)^-1)`` as an upper triangle, with the damping fraction used
    (raised tenfold while ``H + damp I`` is not positive definite). The inverse is
    ``L^-T L^-1`` from a triangular solve (torch's `cholesky_inverse` is two orders of
    magnitude slower multi-threaded on a loaded CPU)."""
    ht = torch.from_numpy(np.array(h, dtype=np.float64))
    eye = torch.eye(ht.shape[0], dtype=torch.float64)
    mean_diag = float(torch.mean(torch.diag(ht)))
    damp_fraction = percdamp
    for _ in range(DAMPING_STEPS):
        lower, info = torch.linalg.cholesky_ex(ht + damp_fraction * mean_diag * eye)
        if int(info) == 0:
            lower_inv = torch.linalg.solve_triangular(lower, eye, upper=False)
            upper, info = torch.linalg.cholesky_ex(lower_inv.T @ lower_inv, upper=True)
            if int(info) == 0:
                return upper.numpy(), damp_fraction
        damp_fraction = min(damp_fraction * 10, 1.0)
    raise CalibrationError(f"the Hessian stays singular with {damp_fraction:.0%} damping: the "
                           "calibration inputs do not determine this linear (more or more "
                           "varied calibration text)")


@dataclass
class PreparedHessian:
    """What GPTQ derives from a Hessian alone, shared by the linears of one input: the
    channels never seen, the column order, ``cholesky((H + damp I)^-1)^T`` in that order,
    and the damping used."""

    dead: np.ndarray
    perm: np.ndarray
    upper: np.ndarray
    percdamp: float


def prepare_hessian(hessian: np.ndarray, *, act_order: bool = False, percdamp: float = 0.01
                    ) -> PreparedHessian:
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(h.shape[0])
    upper, used = inverse_cholesky_upper(h[perm][:, perm], percdamp)
    return PreparedHessian(dead, perm, upper, used)


def gptq(weight: np.ndarray, hessian: np.ndarray | PreparedHessian, scheme: QuantScheme, *,
         act_order: bool = False, block_size: int = 128, percdamp: float = 0.01
         ) -> GptqResult:
    """GPTQ of `weight` [N, K] with the input Hessian `hessian` [K, K] (module doc), or its
    `prepare_hessian` (made with the same `act_order` and `percdamp`)."""
    w = np.array(weight, dtype=np.float64)
    n, k = w.shape
    prepared = hessian if isinstance(hessian, PreparedHessian) else prepare_hessian(
        hessian, act_order=act_order, percdamp=percdamp)
    if prepared.upper.shape != (k, k):
        raise CalibrationError(f"a Hessian of {list(prepared.upper.shape)} for a weight of "
                               f"{list(w.shape)}")
    gs = scheme.group_length(k)
    if k % gs:
        raise CalibrationError(f"group size {gs} does not divide in_features {k}")
    groups = k // gs
    maxq = scheme.maxq
    w[:, prepared.dead] = 0.0

    scales = np.zeros((n, groups))
    zeros = np.zeros((n, groups))
    if act_order or gs == k:  # static grids: from the weights before any update
        for g in range(groups):
            scales[:, g], zeros[:, g] = grid_params(w[:, g * gs:(g + 1) * gs], scheme)
    perm, upper = prepared.perm, prepared.upper
    w = w[:, perm]

    block = block_size if gs == k else max(1, block_size // gs) * gs
    q = np.zeros((n, k))
    loss = 0.0
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].copy()
        err = np.zeros((n, i2 - i1))
        u1 = upper[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = perm[j] // gs
            if not act_order and gs < k and j % gs == 0:
                scales[:, g], zeros[:, g] = grid_params(w1[:, i:i + gs], scheme)
            col = w1[:, i]
            qi = quantize_column(col, scales[:, g], zeros[:, g], maxq)
            dq = (qi - zeros[:, g]) * scales[:, g]
            d = u1[i, i]
            e = (col - dq) / d
            loss += float(np.sum(e * e)) / 2
            w1[:, i:] -= e[:, None] * u1[i, i:]
            err[:, i] = e
            q[:, j] = qi
        w[:, i2:] -= err @ upper[i1:i2, i2:]
    q = q[:, np.argsort(perm)]
    qw = QuantizedWeights(q.astype(np.uint8), scales.astype(scheme.numpy_scale_dtype),
                          zeros.astype(np.uint8), scheme)
    return GptqResult(qw, loss, prepared.percdamp)
