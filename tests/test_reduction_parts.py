"""Layer groups that split a reduction in parts (issue 32): a matmul's K (an a16_matmul's
whole quantization groups) and an attention's keys, each part folded into an f32
accumulator in local memory (`tpu.GroupOp` with three `tiles`).

The numbers: the machine gives the bytes of the interpreter running the same grouped IR
(both call the kernels' `matmul_part` / `attention_tile` in the same order); against the
ungrouped IR the parts' sums are added in another order. The tolerance of a K split is
stated by `k_split_bound` (the classic bound of two summation orders of the same K
products, plus the output's rounding), of a key split by ONLINE_TOLERANCE (test_tiles)."""

from __future__ import annotations

import numpy as np
from fuzz import fuzz_settings
from hypothesis import assume, example, given
from hypothesis import strategies as st
from test_tiles import (
    matmul_module,
    run_all,
    the_matmul,
    tiny_chip,
)

from toptpu.backend.reference import kernels as K
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.dialects import tpu
from toptpu.dialects.common import QuantMode, read_ints
from toptpu.dialects.weight_store import WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.layer_group import LayerGroupError, _candidates, _reduction_plans
from toptpu.passes.slicing import SliceKind

U = 2.0 ** -24  # the unit roundoff of f32


def k_split_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, ref: np.ndarray
                  ) -> np.ndarray:
    """How far a matmul whose K is summed in parts may be from the one summed whole, per
    output element: each of the two f32 sums of the same K products lies within
    gamma_K * sum_k |x_k w_k| of the exact one (gamma_K = K u / (1 - K u), any summation
    order, with or without fused multiply-adds), the bias added to each rounds once more,
    and a half-precision output may round the two to neighbouring values (one of its ulps).
    `w` [N, K] is the weight the kernel multiplies by (dequantized for an a16_matmul)."""
    k = x.shape[-1]
    gamma = k * U / (1 - k * U)
    absprod = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    y = np.abs(ref.astype(np.float64))
    b = 0.0 if bias is None else np.abs(bias.astype(np.float64))
    bound = 2 * gamma * absprod + 2 * U * (y + b)
    if ref.dtype != np.float32:
        ulp = 2.0 ** -7 if ref.dtype == K.BF16 else 2.0 ** -10
        bound = bound + ulp * np.maximum(y, 2.0 ** -14) * 2
    return bound


def reduction_groups(module) -> list[tpu.GroupOp]:  # noqa: ANN001
    return [g for g in module.walk() if isinstance(g, tpu.GroupOp) and g.reduction_parts() > 1]


def lane_that_needs_parts(module, name: str) -> Chip:  # noqa: ANN001
    """The largest (aligned) lane of a two-lane `name` on which no plan of the module's
    matmul (or attention) without reduction parts fits, but one with them compiles (on
    lanes of a few hundred bytes the banks' rule may refuse what the bound allows)."""
    op = next(op for op in module.walk() if isinstance(op, tpu.REDUCTION_OPS))
    align = get_chip(name).align
    for lane in range(64 * align, align, -align):
        chip = tiny_chip(name, lane)
        if (any(_candidates([op], kind, chip, None) for kind in SliceKind)
                or not _reduction_plans([op], chip, None)):
            continue
        try:
            compile_for_machine(module.clone(), chip, split_reduction="needed")
        except LayerGroupError:
            continue
        return chip
    assume(False)  # no lane separates them for this shape
    raise AssertionError


def weight_of(module, store: WeightStore) -> tuple[np.ndarray, np.ndarray | None]:  # noqa: ANN001
    """The weight [N, K] the module's matmul multiplies by (dequantized) and its bias."""
    op = the_matmul(module)
    arrays = [store[v.owner.tensor_name] if v is not None  # type: ignore[union-attr]
              and isinstance(v.owner, tpu.WeightOp) else None for v in op.operand_groups()]
    if isinstance(op, tpu.A16MatMulOp):
        _, q, s, z, b = arrays
        w = K.dequantize(q, s, z, op.weight_bits.value.data, op.group_size.value.data)
        return w, b
    _, w, b = arrays
    return K.f32(w), b


# ---------------------------------------------------------------------------- K split


@fuzz_settings(20)
@given(m=st.sampled_from([1, 3, 8, 16, 24, 48]), n=st.sampled_from([16, 32, 48, 64, 96]),
       k=st.sampled_from([64, 128, 256]), mode=st.sampled_from(QuantMode.names()),
       chip=st.sampled_from(["bm1684x", "bm1688"]), bias=st.booleans(),
       seed=st.integers(0, 3))
@example(m=1, n=32, k=256, mode="w8bf16", chip="bm1688", bias=True, seed=0)  # per channel
def test_k_split_on_the_machine_equals_the_interpreter(m: int, n: int, k: int, mode: str,
                                                       chip: str, bias: bool,
                                                       seed: int) -> None:
    """Where no plan without reduction parts fits a lane, the matmul's K is split: the
    machine (checked and fast) gives the grouped interpreter's bytes, within
    `k_split_bound` of the ungrouped matmul."""
    module, store, feeds = matmul_module(m, n, k, mode, seed, bias, silu=False)
    target = lane_that_needs_parts(module, chip)
    w, b = weight_of(module, store)
    out = run_all(module, store, feeds, target, split="needed")
    (g,) = reduction_groups(module)
    r, c, parts = read_ints(g.tiles)  # type: ignore[misc]
    assert parts > 1 and r * c * parts == g.slices.value.data
    assert np.array_equal(out["checked"], out["grouped"])
    assert np.array_equal(out["fast"], out["grouped"])
    bound = k_split_bound(feeds["input0"][0], w, b, out["ref"][0])
    diff = np.abs(out["grouped"][0].astype(np.float64) - out["ref"][0].astype(np.float64))
    assert (diff <= bound).all(), float((diff - bound).max())
