"""The example plugin's numpy kernels: the numeric truth of its ops, which the interpreters
and the reference machine call through each op's kernel binding (`KERNEL_MODULE` names this
module, `KERNEL` the function), as they call toptpu's own `kernels.py`."""

from __future__ import annotations

import numpy as np

from toptpu.backend.reference.kernels import f32, round_to


def silu_mul(gate: np.ndarray, up: np.ndarray, *, out_dtype: np.dtype | None = None
             ) -> np.ndarray:
    """silu(gate) * up computed in f32 (silu as toptpu's kernel computes it,
    gate / (1 + exp(-gate))) and rounded once, to `out_dtype` (gate's dtype when None):
    the unfused pair rounds silu's result to the storage type before the multiply."""
    g = f32(gate)
    with np.errstate(over="ignore"):  # exp(-g) -> inf below -88: silu's limit, -0
        silu = g / (np.float32(1.0) + np.exp(-g))
    product = np.asarray(silu * f32(up), dtype=np.float32)
    return round_to(product, np.dtype(out_dtype) if out_dtype is not None
                    else np.asarray(gate).dtype)
