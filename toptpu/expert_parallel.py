"""Expert parallelism for a mixture of experts: the decomposition, in numpy.

`--parallel ep` (`toptpu.passes.tensor_parallel.ExpertParallelPass`, run by the compiler
on every per-layer net; the device-group executor runs the result) computes a MoE layer
over N chips as this module does with the numpy kernels, its reference:

- the attention, the norms, the router and a shared expert are **replicated** on every
  chip: every chip computes the same hidden state and the same routing, so *dispatch
  moves nothing* — each chip takes the tokens its experts were chosen for from its own
  copy;
- chip d holds experts [d E/N, (d+1) E/N) (`expert_range`) and computes, for every
  token, the weighted sum over the token's chosen experts that live on it
  (`local_routing`: an index elsewhere routes nowhere, -1; `partial_experts`);
- the **combine** is an all-reduce of the [T, H] partial sums in the order
  `kernels.all_reduce` adds (`expert_parallel_experts`), after which every chip holds the
  layer's output;
- the embeddings, the lm_head and the heads run on chip 0, whose hidden state the others
  receive (one send each per pass over the layers).

What a step costs is not modelled here: `toptpu estimate --parallel ep` and the executed
run time the compiled nets (the chip's DDR for each chip's own expert bytes, the link for
the all-reduce: `backend.target.link`), one cost model for every strategy
(`bench/moe_parallel.py` prints one chip, pp and ep side by side).
"""

from __future__ import annotations

import numpy as np

from toptpu.backend.reference import kernels


def expert_range(device: int, devices: int, experts: int) -> range:
    """The experts chip `device` of `devices` holds: E/N consecutive ones (N divides E)."""
    if devices < 1 or experts % devices:
        raise ValueError(f"{experts} experts do not divide among {devices} devices")
    if not 0 <= device < devices:
        raise ValueError(f"device {device} of {devices}")
    per = experts // devices
    return range(device * per, (device + 1) * per)


def local_routing(weights: np.ndarray, indices: np.ndarray, device: int, devices: int,
                  experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The routing (`top.moe_route`'s weights [T, k], indices [T, k]) as chip `device` uses
    it: an index of one of its experts made local (minus its first expert), any other
    index -1 (it adds nothing there), its weight 0."""
    held = expert_range(device, devices, experts)
    idx = np.asarray(indices)
    mine = (idx >= held.start) & (idx < held.stop)
    local = np.where(mine, idx - held.start, -1).astype(np.int32)
    return np.where(mine, weights, np.zeros_like(weights)), local


def partial_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                    weights: np.ndarray, indices: np.ndarray, device: int, devices: int
                    ) -> np.ndarray:
    """Chip `device`'s share of `top.moe_experts` (gate/up [E, I, H], down [E, H, I] the
    whole model's stacked experts, of which it reads only its own): the f32 sum over each
    token's chosen experts that live on it (`kernels.moe_experts_part`)."""
    held = expert_range(device, devices, gate.shape[0])
    w, idx = local_routing(weights, indices, device, devices, gate.shape[0])
    part = slice(held.start, held.stop)
    return kernels.moe_experts_part(None, x, gate[part], up[part], down[part], w, idx)


def expert_parallel_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray,
                            down: np.ndarray, weights: np.ndarray, indices: np.ndarray,
                            devices: int, algorithm: str = "tree") -> np.ndarray:
    """`top.moe_experts` computed over `devices` chips: every chip's share
    (`partial_experts`), summed by an all-reduce (`kernels.all_reduce`'s order of adds,
    in f32) and rounded to x's dtype. Equal to the one-chip op up to the order the f32
    partial sums are added in."""
    parts = [partial_experts(x, gate, up, down, weights, indices, d, devices)
             for d in range(devices)]
    return kernels.moe_experts_finish(kernels.all_reduce(parts, algorithm), None, x)
