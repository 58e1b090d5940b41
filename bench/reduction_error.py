"""How far a matmul whose K is summed in parts (a layer group's reduction parts) lands from
the one summed whole, on random data at the real layers' K: the kernels' own
`matmul_part` / `matmul_finish` against `matmul`, side by side in one run.

For each K (Qwen2.5-0.5B/7B/14B's inputs: 896, 3584, 5120, 13824, 18944), number of parts
and output type it prints the largest difference relative to the largest output, and the
largest difference over the stated bound (`tests/test_reduction_parts.k_split_bound`:
2·γ_K·Σ|x_k w_k| + 2u(|y| + |b|), plus one ulp of a half-precision output), which the
tests assert is at most 1.

Run: python bench/reduction_error.py [--rows 64] [--cols 256]
"""

from __future__ import annotations

import argparse

import numpy as np

from toptpu.backend.reference import kernels as K

U = 2.0 ** -24


def bound(x: np.ndarray, w: np.ndarray, b: np.ndarray, ref: np.ndarray) -> np.ndarray:
    k = x.shape[-1]
    gamma = k * U / (1 - k * U)
    y = np.abs(ref.astype(np.float64))
    out = (2 * gamma * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
           + 2 * U * (y + np.abs(b.astype(np.float64))))
    if ref.dtype != np.float32:
        ulp = 2.0 ** -7 if ref.dtype == K.BF16 else 2.0 ** -10
        out = out + 2 * ulp * np.maximum(y, 2.0 ** -14)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=256)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"x [{a.rows}, K] @ w [{a.cols}, K]^T + b, random normal; K summed in P parts")
    print(f"{'K':>6} {'P':>4} {'out':>5} {'max |d| / max |y|':>18} {'max |d| / bound':>16}")
    for k in (896, 3584, 5120, 13824, 18944):
        x32 = rng.standard_normal((a.rows, k)).astype(np.float32)
        w = rng.standard_normal((a.cols, k)).astype(np.float32)
        b = rng.standard_normal(a.cols).astype(np.float32)
        for out in (np.dtype(np.float32), K.BF16):
            x = x32.astype(out)
            whole = K.matmul(x, w, b, transpose_b=True, out_dtype=out)
            for parts in (2, 8, 32):
                n = k // parts
                acc = None
                for p in range(parts):
                    acc = K.matmul_part(acc, x[:, p * n:(p + 1) * n], w[:, p * n:(p + 1) * n],
                                        transpose_b=True)
                split = K.matmul_finish(acc, b, out, x)
                d = np.abs(split.astype(np.float64) - whole.astype(np.float64))
                rel = d.max() / np.abs(whole.astype(np.float64)).max()
                over = (d / bound(x, w, b, whole)).max()
                print(f"{k:>6} {parts:>4} {np.dtype(out).name:>5} {rel:>18.2e} {over:>16.3f}")


if __name__ == "__main__":
    main()
