"""A decode step's 4-bit products at 7B widths: the one-row product from the packed bytes
before (`weight_offsets` of 1024 rows written to memory, then `matmul_offsets` widening and
scaling each 64-row block in one mixed-type multiply) and now (`kernels.matmul_packed`:
each 64-row block's nibbles spread in uint16 passes, its zero point subtracted in int8,
widened and scaled in place, all in cache), side by side in one run, against the host's
own limit measured in the same run: the bytes the product must read (packed weights,
scales, zero points) over numpy's read bandwidth.

One layer of Qwen2.5-7B's widths (hidden 3584, MLP 18944, 28 query and 4 KV heads of
128), w4bf16 as `toptpu compile` stores it (asymmetric, groups of 64 along the input,
bf16 scales, uint8 zero points), random values; x one bf16 row. Also shown: the product
from a weight's int8 offsets kept in the weight cache (`matmul_offsets`, before and now:
widened then scaled, instead of one mixed-type multiply) and from its f32 form kept (one
BLAS call over 4 bytes a weight). Every variant's bytes are checked equal to
`a16_matmul`'s (the kernels' one numeric truth) before it is timed.

Times are CPU seconds of this process (`time.process_time`: the host is shared, a wall
clock measures the share of a core the process got) and wall seconds, the best of
`--repeat` rounds, the variants interleaved in each round. The bandwidth: the best of 5
sums over 512 MB of float32 (far beyond any cache), timed both ways, before and after.
`x28` is a 7B decode step's layers (the lm_head and attention not included).

`--lm-head`: the lm_head's one-row product at Qwen2.5-14B's widths (152064 × 5120, bf16)
as the machine made it before when its f32 form does not fit the weight cache (the whole
f32 form, 3.1 GB, converted for the product) and now (`kernels.matmul_weight_rows`: 1024
rows converted at a time), their bytes compared (the machine checks a prefix of the rows
at run time; this checks the whole), CPU and wall seconds; it needs ~5 GB.

Run: python bench/a16_decode_product.py [--repeat 3] [--lm-head]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.blas_threads import matmul as blas_matmul

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 3584, 18944, 28, 4, 128, 28
GROUP = 64
#: the rows `WeightCache.streamed_product` made offsets of at a time before
OLD_STREAM_ROWS = 1024
BANDWIDTH_BYTES = 512 << 20


def projections() -> dict[str, tuple[int, int]]:
    """A Qwen2.5-7B layer's projections: [out, in]."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {"q": (q, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "o": (HIDDEN, q),
            "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}


def old_matmul_offsets(x: np.ndarray, offsets: np.ndarray, scales: np.ndarray,
                       group_size: int, block_rows: int = 64) -> np.ndarray:
    """`kernels.matmul_offsets` as it was: each block widened and scaled by one
    mixed-type multiply (int8 times f32 into f32)."""
    fx = K.f32(x)
    n, k = offsets.shape
    g = k // group_size
    sf = K.f32(scales)
    rows = max(1, min(block_rows, n))
    block = np.empty((rows, g, group_size), np.float32)
    r = np.empty((*fx.shape[:-1], n), np.float32)
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        b = block[:m]
        np.multiply(offsets[r0:r0 + m].reshape(m, g, group_size), sf[r0:r0 + m, :, None],
                    out=b, dtype=np.float32)
        r[..., r0:r0 + m] = blas_matmul(fx, b.reshape(m, k).T)
    return r


def old_streamed(x: np.ndarray, q: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    """`WeightCache.streamed_product`'s blocks as they were: OLD_STREAM_ROWS rows' offsets
    (`weight_offsets`) at a time, each multiplied by `old_matmul_offsets`."""
    n = q.shape[0]
    out = np.empty((*x.shape[:-1], n), np.float32)
    for r0 in range(0, n, OLD_STREAM_ROWS):
        r1 = min(n, r0 + OLD_STREAM_ROWS)
        off = K.weight_offsets(q[r0:r1], z[r0:r1], 4, GROUP)
        out[..., r0:r1] = old_matmul_offsets(x, off, s[r0:r1], GROUP)
    return out


def bandwidth() -> tuple[float, float]:
    """numpy's read bandwidth in bytes/s: (CPU-timed, wall-timed), the best of 5 sums."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    cpu = wall = float("inf")
    for _ in range(5):
        c, w = time.process_time(), time.perf_counter()
        a.sum(dtype=np.float32)
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return a.nbytes / cpu, a.nbytes / wall


def lm_head(repeat: int) -> None:
    """The 14B lm_head's one-row product: whole f32 form vs 1024 rows at a time."""
    vocab, hidden, block = 152064, 5120, 1024
    rng = np.random.default_rng(1)
    w = np.empty((vocab, hidden), K.BF16)
    for r0 in range(0, vocab, 8192):  # drawn in blocks: no f32 copy of the whole
        w[r0:r0 + 8192] = K.to_bf16(
            rng.standard_normal((min(8192, vocab - r0), hidden)).astype(np.float32) * 0.02)
    x = K.to_bf16(rng.standard_normal((1, hidden)).astype(np.float32))
    times: dict[str, tuple[float, float]] = {}
    results: dict[str, np.ndarray] = {}
    for _ in range(repeat):
        for name, fn in (("whole f32 form (before)", lambda: K.matmul(
                x, K.f32(w), transpose_b=True, out_dtype=np.float32)),
                         ("1024 rows at a time (now)",
                          lambda: K.matmul_weight_rows(x, w, block))):
            c, t = time.process_time(), time.perf_counter()
            results[name] = fn()
            cpu, wall = time.process_time() - c, time.perf_counter() - t
            old = times.get(name, (float("inf"), float("inf")))
            times[name] = (min(old[0], cpu), min(old[1], wall))
    a, b = results.values()
    print(f"lm_head {vocab} x {hidden} bf16 ({w.nbytes / 1e9:.2f} GB; f32 form "
          f"{4 * w.size / 1e9:.2f} GB), one row, best of {repeat}: bytes equal "
          f"{a.tobytes() == b.tobytes()}")
    for name, (cpu, wall) in times.items():
        print(f"  {name:28s} {cpu:7.2f} s CPU {wall:7.2f} s wall")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lm-head", action="store_true",
                    help="the 14B lm_head's product, whole f32 form vs blocked (~5 GB)")
    args = ap.parse_args()
    if args.lm_head:
        lm_head(args.repeat)
        return
    rng = np.random.default_rng(0)
    x = K.to_bf16(rng.standard_normal((1, HIDDEN)).astype(np.float32))
    xs: dict[int, np.ndarray] = {HIDDEN: x, MLP: K.to_bf16(
        rng.standard_normal((1, MLP)).astype(np.float32))}
    weights = {}
    nbytes = 0
    for name, (n, k) in projections().items():
        q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        s = K.to_bf16((rng.random((n, k // GROUP)) * 1e-2 + 1e-3).astype(np.float32))
        z = rng.integers(0, 16, (n, k // GROUP), dtype=np.uint8)
        weights[name] = (q, s, z)
        nbytes += q.nbytes + s.nbytes + z.nbytes
    load = os.getloadavg()[0]
    bw_before = bandwidth()
    variants: dict[str, Callable[[str], Callable[[], np.ndarray]]] = {}
    offsets = {name: K.weight_offsets(q, z, 4, GROUP) for name, (q, s, z) in weights.items()}
    f32_forms: dict[str, np.ndarray] = {}

    def packed_before(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        return lambda: old_streamed(xs[q.shape[1] * 2], q, s, z)

    def packed_now(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        return lambda: K.matmul_packed(xs[q.shape[1] * 2], q, s, z, GROUP, None,
                                       np.float32)  # type: ignore[return-value]

    def offsets_before(name: str) -> Callable[[], np.ndarray]:
        q, s, _ = weights[name]
        return lambda: old_matmul_offsets(xs[q.shape[1] * 2], offsets[name], s, GROUP)

    def offsets_now(name: str) -> Callable[[], np.ndarray]:
        q, s, _ = weights[name]
        return lambda: K.matmul_offsets(xs[q.shape[1] * 2], offsets[name], s, GROUP, None,
                                        np.float32)

    def f32_kept(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        if name not in f32_forms:
            f32_forms[name] = K.dequantize(q, s, z, 4, GROUP)
        w = f32_forms[name]
        return lambda: K.matmul_dequantized(xs[q.shape[1] * 2], w, None, np.float32)

    variants = {"packed before": packed_before, "packed now": packed_now,
                "offsets before": offsets_before, "offsets now": offsets_now,
                "f32 kept": f32_kept}
    calls = {v: {name: make(name) for name in weights} for v, make in variants.items()}
    for name, (q, s, z) in weights.items():  # every variant's bytes: a16_matmul's
        want = K.a16_matmul(xs[q.shape[1] * 2], q, s, z, None, 4, GROUP, np.float32)
        for v in variants:
            got = calls[v][name]()
            if got.tobytes() != want.tobytes():
                raise SystemExit(f"{v} differs from a16_matmul on {name}")
    best = {v: {name: (float("inf"), float("inf")) for name in weights} for v in variants}
    for _ in range(args.repeat):
        for name in weights:
            for v in variants:
                c, w = time.process_time(), time.perf_counter()
                calls[v][name]()
                cpu, wall = time.process_time() - c, time.perf_counter() - w
                b = best[v][name]
                best[v][name] = (min(b[0], cpu), min(b[1], wall))
    bw_after = bandwidth()
    bw_cpu, bw_wall = max(bw_before[0], bw_after[0]), max(bw_before[1], bw_after[1])
    bound_cpu, bound_wall = nbytes / bw_cpu, nbytes / bw_wall
    print(f"a Qwen2.5-7B layer's 7 projections, w4 g{GROUP} bf16 scales uint8 zeros, one "
          f"bf16 row: {nbytes / 1e6:.1f} MB read; {os.cpu_count()} CPUs, load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after; best of {args.repeat}")
    print(f"numpy read bandwidth: {bw_before[0] / 1e9:.2f} / {bw_after[0] / 1e9:.2f} GB/s "
          f"CPU-timed, {bw_before[1] / 1e9:.2f} / {bw_after[1] / 1e9:.2f} GB/s wall-timed "
          f"(before / after); bound {bound_cpu * 1e3:.1f} ms CPU, {bound_wall * 1e3:.1f} ms "
          "wall a layer")
    names = list(weights)
    print(f"{'variant':16s}" + "".join(f"{n:>8s}" for n in names)
          + f"{'layer ms':>10s}{'x28 s':>8s}{'/bound':>8s}{'wall ms':>9s}{'/bound':>8s}")
    totals = {}
    for v in variants:
        cpu = sum(best[v][n][0] for n in names)
        wall = sum(best[v][n][1] for n in names)
        totals[v] = cpu
        print(f"{v:16s}" + "".join(f"{best[v][n][0] * 1e3:8.1f}" for n in names)
              + f"{cpu * 1e3:10.1f}{cpu * LAYERS:8.2f}{cpu / bound_cpu:8.1f}"
              f"{wall * 1e3:9.1f}{wall / bound_wall:8.1f}")
    print(f"packed: before / now = {totals['packed before'] / totals['packed now']:.2f}x "
          f"(CPU); offsets: before / now = "
          f"{totals['offsets before'] / totals['offsets now']:.2f}x; now from packed bytes "
          f"{totals['packed now'] / bound_cpu:.1f}x the CPU-timed bound, "
          f"{totals['packed now'] / totals['f32 kept']:.2f}x the kept f32 form's product")


if __name__ == "__main__":
    main()
