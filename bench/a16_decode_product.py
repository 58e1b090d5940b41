"""A decode step's 4-bit products at 7B widths, side by side in one run, against the host's
own limits measured in the same run.

The products (every variant's bytes checked equal to `a16_matmul`'s, the kernels' one
numeric truth, before it is timed):
- from the packed bytes: `packed, 1024 rows` (`weight_offsets` of 1024 rows written to
  memory, then multiplied a 64-row block at a time: how a weight kept in no form was
  multiplied first), `packed before` (`kernels.matmul_packed` as it was: each 64-row
  block's nibbles spread in uint16 passes, its zero point subtracted in int8, widened and
  scaled in place, all in cache, the BLAS threads set and restored around each block's
  product) and `packed now` (`kernels.matmul_packed`: the same blocks and bits, the spread
  in uint64 passes, the threads set once for all blocks, each block's product written in
  place);
- from a weight's int8 offsets kept in the weight cache: `offsets before` / `offsets now`
  (`kernels.matmul_offsets` as it was / now: the same change of threads and output);
- `f32 kept`: from its f32 form kept (one BLAS product over 4 bytes a weight).
Then the layer's whole forms (what a prefill product multiplies by and the weight cache
keeps): its int8 offsets and its f32 form, before (the nibbles unpacked first) and now
(`weight_offsets` spreading the packed bytes a block of rows at a time), bytes compared.

The two limits, each the bytes a step moves over numpy's bandwidth measured here (the best
of 5 passes over 512 MB of float32, far beyond any cache, before and after the products):
- **read bound**: the bytes the product must read as stored (packed weights, scales, zero
  points) over numpy's read bandwidth (a sum);
- **conversion bound**: the read bound plus the weights' f32 form (4 bytes a weight: a
  numpy host cannot multiply 4-bit integers, it must make a float of each weight) written
  once and read once, over numpy's copy bandwidth (`np.copyto`, bytes moved: read +
  written). It is the cost of converting through memory; a product that converts a
  cache-sized block at a time never writes the f32 form to memory and may go below it (so
  may `f32 kept`, which converts nothing).

Times are CPU seconds of this process (`time.process_time`: the host is shared, a wall
clock measures the share of a core the process got) and wall seconds, the best of
`--repeat` rounds, the variants interleaved in each round; each bound is taken CPU-timed
against CPU seconds and wall-timed against wall seconds. `x28` is a 7B decode step's
layers (the lm_head and attention not included).

One layer of Qwen2.5-7B's widths (hidden 3584, MLP 18944, 28 query and 4 KV heads of
128), w4bf16 as `toptpu compile` stores it (asymmetric, groups of 64 along the input,
bf16 scales, uint8 zero points), random values; x one bf16 row.

`--lm-head`: the lm_head's one-row product at Qwen2.5-14B's widths (152064 × 5120, bf16)
when its f32 form does not fit the weight cache: the whole f32 form (3.1 GB) converted
for the product, 1024 rows converted to a new array at a time (`matmul_weight_rows`
before) and now (`kernels.matmul_weight_rows`: a cache-sized tile of rows at a time into
one reused buffer), their bytes compared (the machine checks a prefix of the rows at run
time; this checks the whole), CPU and wall seconds; it needs ~5 GB.

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


def offsets_blocks_1024(x: np.ndarray, offsets: np.ndarray, scales: np.ndarray,
                        group_size: int, block_rows: int = 64) -> np.ndarray:
    """`kernels.matmul_offsets` as `packed, 1024 rows` used it: each block widened and
    scaled by one mixed-type multiply (int8 times f32 into f32)."""
    return _offsets_blocks(x, offsets, scales, group_size, block_rows, mixed_multiply=True)


def _offsets_blocks(x: np.ndarray, offsets: np.ndarray, scales: np.ndarray,
                    group_size: int, block_rows: int, mixed_multiply: bool) -> np.ndarray:
    """The old blocked products: each block of offsets widened and scaled (by one mixed-type
    multiply, or copied to f32 then scaled in place), its product into a new array copied
    into the result."""
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
        if mixed_multiply:
            np.multiply(offsets[r0:r0 + m].reshape(m, g, group_size), sf[r0:r0 + m, :, None],
                        out=b, dtype=np.float32)
        else:
            np.copyto(b, offsets[r0:r0 + m].reshape(m, g, group_size))
            np.multiply(b, sf[r0:r0 + m, :, None], out=b)
        r[..., r0:r0 + m] = blas_matmul(fx, b.reshape(m, k).T)
    return r


def packed_1024_rows(x: np.ndarray, q: np.ndarray, s: np.ndarray, z: np.ndarray
                     ) -> np.ndarray:
    """`WeightCache.streamed_product`'s blocks as they were first: OLD_STREAM_ROWS rows'
    offsets (`weight_offsets` as it was: `offsets_unpacked_first`) at a time, each
    multiplied by `offsets_blocks_1024`."""
    n = q.shape[0]
    out = np.empty((*x.shape[:-1], n), np.float32)
    for r0 in range(0, n, OLD_STREAM_ROWS):
        r1 = min(n, r0 + OLD_STREAM_ROWS)
        off = offsets_unpacked_first(q[r0:r1], z[r0:r1])
        out[..., r0:r1] = offsets_blocks_1024(x, off, s[r0:r1], GROUP)
    return out


def offsets_before(x: np.ndarray, offsets: np.ndarray, scales: np.ndarray,
                   group_size: int, block_rows: int = 64) -> np.ndarray:
    """`kernels.matmul_offsets` (no bias, no mins) as it was before this bench's `now`:
    each block's product through `blas_threads.matmul` (the threads set and restored
    around each) into a new array, then copied into the result."""
    return _offsets_blocks(x, offsets, scales, group_size, block_rows, mixed_multiply=False)


def packed_before(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                  zeros: np.ndarray, group_size: int, block_rows: int = 64) -> np.ndarray:
    """`kernels.matmul_packed` (uint8 zero points, no bias, no mins) as it was before this
    bench's `now`: the nibbles spread in uint16 passes, each block's product through
    `blas_threads.matmul` into a new array."""
    fx = K.f32(x)
    n, half = qweight.shape
    k = 2 * half
    g = k // group_size
    z = zeros.view(np.int8)[:, :, None]
    sf = K.f32(scales)
    rows = max(1, min(block_rows, n))
    wide = np.empty((rows, half), np.uint16)
    shifted = np.empty_like(wide)
    block = np.empty((rows, g, group_size), np.float32)
    r = np.empty((*fx.shape[:-1], n), np.float32)
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        v, t = wide[:m], shifted[:m]
        np.copyto(v, qweight[r0:r0 + m])
        np.left_shift(v, 4, out=t)
        np.bitwise_or(v, t, out=v)
        np.bitwise_and(v, 0x0F0F, out=v)
        d = v.view(np.int8).reshape(m, g, group_size)
        np.subtract(d, z[r0:r0 + m], out=d)
        b = block[:m]
        np.copyto(b, d)
        np.multiply(b, sf[r0:r0 + m, :, None], out=b)
        r[..., r0:r0 + m] = blas_matmul(fx, b.reshape(m, k).T)
    return r


def offsets_unpacked_first(q: np.ndarray, z: np.ndarray) -> np.ndarray:
    """`kernels.weight_offsets` of a 4-bit weight as it was: the nibbles unpacked
    (`unpack_int4`: two strided byte writes), then the zero points subtracted in place."""
    n, half = q.shape
    d = K.unpack_int4(q).view(np.int8).reshape(n, -1, GROUP)
    return np.subtract(d, z.astype(np.int8)[:, :, None], out=d).reshape(n, 2 * half)


def bandwidths() -> dict[str, tuple[float, float]]:
    """numpy's bandwidths in bytes/s, each (CPU-timed, wall-timed), the best of 5 passes
    over BANDWIDTH_BYTES: 'read' (a sum: bytes read), 'copy' (`np.copyto`: bytes read +
    written)."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    b = np.empty_like(a)
    out: dict[str, tuple[float, float]] = {}
    for name, fn, moved in (("read", lambda: a.sum(dtype=np.float32), a.nbytes),
                            ("copy", lambda: np.copyto(b, a), 2 * a.nbytes)):
        cpu = wall = float("inf")
        for _ in range(5):
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
        out[name] = (moved / cpu, moved / wall)
    return out


def weight_rows_before(a: np.ndarray, w: np.ndarray, block_rows: int) -> np.ndarray:
    """`kernels.matmul_weight_rows` as it was: `block_rows` rows converted to a new f32
    array at a time, each block's product through `blas_threads.matmul`."""
    fa = np.ascontiguousarray(K.f32(a))
    n = w.shape[0]
    r = np.empty((*fa.shape[:-1], n), np.float32)
    for r0 in range(0, n, max(1, block_rows)):
        block = np.ascontiguousarray(K.f32(w[r0:r0 + block_rows]))
        r[..., r0:r0 + block.shape[0]] = blas_matmul(fa, block.T)
    return r


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
        for name, fn in (("whole f32 form", lambda: K.matmul(
                x, K.f32(w), transpose_b=True, out_dtype=np.float32)),
                         ("1024 rows at a time (before)",
                          lambda: weight_rows_before(x, w, block)),
                         ("tiles in cache (now)",
                          lambda: K.matmul_weight_rows(x, w, block))):
            c, t = time.process_time(), time.perf_counter()
            results[name] = fn()
            cpu, wall = time.process_time() - c, time.perf_counter() - t
            old = times.get(name, (float("inf"), float("inf")))
            times[name] = (min(old[0], cpu), min(old[1], wall))
    a, *others = results.values()
    print(f"lm_head {vocab} x {hidden} bf16 ({w.nbytes / 1e9:.2f} GB; f32 form "
          f"{4 * w.size / 1e9:.2f} GB), one row, best of {repeat}: bytes equal "
          f"{all(a.tobytes() == b.tobytes() for b in others)}")
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
    bw_before = bandwidths()
    offsets = {name: K.weight_offsets(q, z, 4, GROUP) for name, (q, s, z) in weights.items()}
    f32_forms: dict[str, np.ndarray] = {}

    def x_for(q: np.ndarray) -> np.ndarray:
        return xs[q.shape[1] * 2]

    def v_packed_1024(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        return lambda: packed_1024_rows(x_for(q), q, s, z)

    def v_packed_before(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        return lambda: packed_before(x_for(q), q, s, z, GROUP)

    def v_packed_now(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        return lambda: K.matmul_packed(x_for(q), q, s, z, GROUP, None,
                                       np.float32)  # type: ignore[return-value]

    def v_offsets_before(name: str) -> Callable[[], np.ndarray]:
        q, s, _ = weights[name]
        return lambda: offsets_before(x_for(q), offsets[name], s, GROUP)

    def v_offsets_now(name: str) -> Callable[[], np.ndarray]:
        q, s, _ = weights[name]
        return lambda: K.matmul_offsets(x_for(q), offsets[name], s, GROUP, None, np.float32)

    def v_f32_kept(name: str) -> Callable[[], np.ndarray]:
        q, s, z = weights[name]
        if name not in f32_forms:
            f32_forms[name] = K.dequantize(q, s, z, 4, GROUP)
        w = f32_forms[name]
        return lambda: K.matmul_dequantized(x_for(q), w, None, np.float32)

    variants: dict[str, Callable[[str], Callable[[], np.ndarray]]] = {
        "packed, 1024 rows": v_packed_1024, "packed before": v_packed_before,
        "packed now": v_packed_now, "offsets before": v_offsets_before,
        "offsets now": v_offsets_now, "f32 kept": v_f32_kept}
    calls = {v: {name: make(name) for name in weights} for v, make in variants.items()}
    for name, (q, s, z) in weights.items():  # every variant's bytes: a16_matmul's
        want = K.a16_matmul(x_for(q), q, s, z, None, 4, GROUP, np.float32)
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
    bw_after = bandwidths()
    bw = {kind: (max(bw_before[kind][0], bw_after[kind][0]),
                 max(bw_before[kind][1], bw_after[kind][1])) for kind in bw_before}
    f32_bytes = 4 * sum(n * k for n, k in projections().values())
    # (CPU-timed, wall-timed) each
    read_bound = (nbytes / bw["read"][0], nbytes / bw["read"][1])
    conv_bound = tuple(read_bound[i] + 2 * f32_bytes / bw["copy"][i] for i in (0, 1))
    print(f"a Qwen2.5-7B layer's 7 projections, w4 g{GROUP} bf16 scales uint8 zeros, one "
          f"bf16 row: {nbytes / 1e6:.1f} MB read, {f32_bytes / 1e6:.1f} MB of f32 weights; "
          f"{os.cpu_count()} CPUs, load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; best of {args.repeat}")
    for kind, what in (("read", "read"), ("copy", "copy (read + written)")):
        (bc, bwl), (ac, awl) = bw_before[kind], bw_after[kind]
        print(f"numpy {what} bandwidth: {bc / 1e9:.2f} / {ac / 1e9:.2f} GB/s CPU-timed, "
              f"{bwl / 1e9:.2f} / {awl / 1e9:.2f} GB/s wall-timed (before / after)")
    print(f"read bound {read_bound[0] * 1e3:.1f} ms CPU, {read_bound[1] * 1e3:.1f} ms wall a "
          f"layer; conversion bound (+ the f32 form written and read once) "
          f"{conv_bound[0] * 1e3:.1f} ms CPU, {conv_bound[1] * 1e3:.1f} ms wall a layer")
    names = list(weights)
    print(f"{'variant':18s}" + "".join(f"{n:>7s}" for n in names)
          + f"{'layer ms':>9s}{'x28 s':>7s}{'/read':>7s}{'/conv':>7s}"
          f"{'wall ms':>9s}{'/read':>7s}{'/conv':>7s}")
    totals = {}
    for v in variants:
        cpu = sum(best[v][n][0] for n in names)
        wall = sum(best[v][n][1] for n in names)
        totals[v] = (cpu, wall)
        print(f"{v:18s}" + "".join(f"{best[v][n][0] * 1e3:7.1f}" for n in names)
              + f"{cpu * 1e3:9.1f}{cpu * LAYERS:7.2f}{cpu / read_bound[0]:7.1f}"
              f"{cpu / conv_bound[0]:7.2f}{wall * 1e3:9.1f}{wall / read_bound[1]:7.1f}"
              f"{wall / conv_bound[1]:7.2f}")
    for a, b in (("packed before", "packed now"), ("offsets before", "offsets now"),
                 ("packed, 1024 rows", "packed now")):
        print(f"{a} / {b}: {totals[a][0] / totals[b][0]:.2f}x CPU, "
              f"{totals[a][1] / totals[b][1]:.2f}x wall")
    now = totals["packed now"][0]
    print(f"packed now: {now / read_bound[0]:.1f}x the read bound, "
          f"{now / conv_bound[0]:.2f}x the conversion bound (CPU-timed), "
          f"{now / totals['f32 kept'][0]:.2f}x the kept f32 form's product")
    whole_forms(weights, args.repeat)


def whole_forms(weights: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                repeat: int) -> None:
    """The layer's whole converted forms (what a prefill product multiplies by and what
    the weight cache keeps): the int8 offsets (`weight_offsets`) and the f32 form
    (`dequantize`: the offsets, then one product a weight), before (the nibbles unpacked
    first) and now (`weight_offsets` spreading a block of rows at a time in its result),
    their bytes compared; CPU seconds, best of `repeat`, interleaved."""
    fns: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
        "offsets before": lambda q, s, z: offsets_unpacked_first(q, z),
        "offsets now": lambda q, s, z: K.weight_offsets(q, z, 4, GROUP),
        "f32 form before": lambda q, s, z: K.dequantize_offsets(
            offsets_unpacked_first(q, z), s, GROUP),
        "f32 form now": lambda q, s, z: K.dequantize(q, s, z, 4, GROUP)}
    for (q, s, z) in weights.values():
        for a, b in (("offsets before", "offsets now"), ("f32 form before", "f32 form now")):
            if fns[a](q, s, z).tobytes() != fns[b](q, s, z).tobytes():
                raise SystemExit(f"{b} differs from {a}")
    best = dict.fromkeys(fns, 0.0)
    for name in fns:
        for (q, s, z) in weights.values():
            t = float("inf")
            for _ in range(repeat):
                c = time.process_time()
                fns[name](q, s, z)
                t = min(t, time.process_time() - c)
            best[name] += t
    print("the layer's whole forms (ms CPU, best of each): " + ", ".join(
        f"{name} {t * 1e3:.1f}" for name, t in best.items())
          + f"; offsets {best['offsets before'] / best['offsets now']:.2f}x, f32 form "
          f"{best['f32 form before'] / best['f32 form now']:.2f}x")

if __name__ == "__main__":
    main()
