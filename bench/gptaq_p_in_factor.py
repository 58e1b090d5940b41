"""GPTAQ's P made a run of rows at a time into the factor's lower triangle
(`gptq.asymmetry_rows`, what a stage holding one K x K matrix does) against the whole
product (`gptq.asymmetry_term`), side by side at a width where the sums round differently:
both in float32 against the float64 product, then GPTQ's integers with each and with the
float64 product rounded to float32.

Run: python bench/gptaq_p_in_factor.py [--k 8192] [--rows 512] [--tokens 4096]

Random inputs X [tokens, K] with a dead channel (and X_float = X perturbed), act-order,
float32 as the calibration runs it. Printed: the largest differences of each float32 P from
the float64 one and from each other (relative to max |P|), and how many of the integers of a
random [rows, K] weight differ between GPTAQ with the three Ps (a flipped integer moves the
later columns' updates: GPTQ's error feedback spreads one rounding difference).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


def main() -> None:
    from toptpu.weight_calibration.gptq import (
        AsymmetryInFactor,
        PreparedHessian,
        asymmetry_rows,
        asymmetry_term,
        gptq,
        prepare_hessian,
    )
    from toptpu.weight_calibration.grid import QuantScheme

    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--run-bytes", type=int, default=1 << 26)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    k = a.k
    x = (rng.standard_normal((a.tokens, k)) * (0.2 + rng.random(k))).astype(np.float32)
    x[:, 7] = 0
    xf = x + (0.05 * rng.standard_normal(x.shape)).astype(np.float32)
    h = 2 * x.T @ x / a.tokens
    cross = 2 * (xf - x).T @ x / a.tokens
    del xf
    t = time.perf_counter()
    prepared = prepare_hessian(h, act_order=True, overwrite=True)
    print(f"K = {k}: factor {time.perf_counter() - t:.0f} s")
    packed = PreparedHessian(prepared.dead, prepared.perm, prepared.upper.copy(),
                             prepared.percdamp)
    d = cross.copy()
    d[:, prepared.dead] = 0
    d = np.ascontiguousarray(d[prepared.perm][:, prepared.perm])
    exact = 0.25 * np.triu(d.astype(np.float64) @ prepared.upper.T.astype(np.float64), 1) \
        @ prepared.upper.astype(np.float64)
    t = time.perf_counter()
    whole = asymmetry_term(cross, prepared)
    t_whole = time.perf_counter() - t
    step = max(1, a.run_bytes // (4 * k))
    t = time.perf_counter()
    for r0 in range(0, k, step):
        asymmetry_rows(d[r0:r0 + step].copy(), r0, packed)
    t_rows = time.perf_counter() - t
    got = np.tril(packed.upper, -1).T
    scale = float(np.abs(exact).max())

    off_whole = float(np.abs(whole - exact).max()) / scale
    off_rows = float(np.abs(got - exact).max()) / scale
    print(f"P whole {t_whole:.0f} s, in runs of {step} rows {t_rows:.0f} s")
    print(f"max |P32 - P64| / max|P|: whole {off_whole:.2e}, in the factor {off_rows:.2e}; "
          f"whole vs in the factor {float(np.abs(whole - got).max()) / scale:.2e}, "
          f"{np.count_nonzero(whole != got)} of {k * (k - 1) // 2} values differ")
    rounded = exact.astype(np.float32)  # the float64 product, rounded once
    del exact, d
    weight = (rng.standard_normal((a.rows, k)) * 0.05).astype(np.float32)
    scheme = QuantScheme(4, 128, False)
    q_whole = gptq(weight, prepared, scheme, act_order=True, asymmetry=whole)
    del whole
    q_exact = gptq(weight, prepared, scheme, act_order=True, asymmetry=rounded)
    del rounded
    q_rows = gptq(weight, packed, scheme, act_order=True, asymmetry=AsymmetryInFactor())

    def differ(p: Any, q: Any) -> int:
        return int(np.count_nonzero(p.weights.qweight != q.weights.qweight))

    print(f"GPTAQ integers of a [{a.rows}, {k}] weight ({a.rows * k}), differing: whole vs "
          f"in the factor {differ(q_whole, q_rows)}; against P from float64: whole "
          f"{differ(q_whole, q_exact)}, in the factor {differ(q_rows, q_exact)} (loss "
          f"{q_whole.loss:.6g} whole, {q_rows.loss:.6g} in the factor, {q_exact.loss:.6g} "
          "from float64)")


if __name__ == "__main__":
    main()
