"""One thread against the BLAS's default threads, per product size, side by side in one run:
the measurement behind `backend/reference/blas_threads.py`'s `auto` policy.

The products are the kernels' own (`x @ w.T` in f32, `kernels.matmul_dequantized`) at the
shapes real models make: each projection of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-7B
(q, o, gate, down, the lm_head) for 1 row (a decode step) and for prefill chunks of 16 and
128 rows, and an attention's score product (14 heads, 64-dim, over 512 keys). For each
product the two thread counts alternate over the repeats (every measurement sees the same
host load); medians. The columns say which won and by how much, and what the `auto` policy
picks (`blas_threads.threads_for`); the summary gives, per row count, the smallest product
from which the default threads won every larger one measured, and the total time of all
the products on one thread, on the default threads and as `auto` picks.

The host's load is printed (1-minute load average against its cores): run it once on a
quiet host and once under load, and compare the verdicts.

With `--model FILE` it measures a model instead: `toptpu run FILE --ids ... --json` in a
fresh process per policy (`TOPTPU_BLAS_THREADS`: `blas` the BLAS's own threads as numpy
has them, `auto`, `1`), the policies alternating over the repeats; medians of the decode
tok/s and the TTFT, and the ratios to `blas`.

Run: python bench/blas_threads.py [--repeat 7] [--rows 1,16,128] [--models smollm2,qwen05,qwen7]
     python bench/blas_threads.py --model FILE [--policies blas,auto,1] [--new 32] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from toptpu.backend.reference import blas_threads as BT

#: (hidden, intermediate, vocab, q heads, kv heads, head dim) of each model's config
MODELS = {
    "smollm2": (576, 1536, 49152, 9, 3, 64),
    "qwen05": (896, 4864, 151936, 14, 2, 64),
    "qwen7": (3584, 18944, 152064, 28, 4, 128),
}


def projections(name: str) -> list[tuple[str, int, int]]:
    """(what, k, n) of each distinct product of one layer and the lm_head."""
    h, inter, vocab, hq, hkv, d = MODELS[name]
    return [(f"{name} q", h, hq * d), (f"{name} kv", h, hkv * d), (f"{name} gate", h, inter),
            (f"{name} down", inter, h), (f"{name} lm_head", h, vocab)]


def timed(fn, threads: int) -> float:
    BT._the_blas().set(threads)
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        BT._the_blas().set(BT.inherited_threads())


def run_model(path: str, policies: list[str], new: int, prompt: int, repeat: int,
               executor: str) -> None:
    """`toptpu run` of `path` per thread policy, side by side (see the module doc)."""
    ids = ",".join(str(3 + i % 300) for i in range(prompt))
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    decode: dict[str, list[float]] = {p: [] for p in policies}
    load = os.getloadavg()[0]
    for r in range(repeat):
        for p in policies:  # alternating: each policy sees the same host load
            env = {**os.environ, BT.ENV_VAR: p}
            cmd = [sys.executable, "-m", "toptpu.cli", "run", path, "--ids", ids,
                   "--max-new-tokens", str(new), "--ignore-eos", "--json",
                   "--executor", executor]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/",
                                 check=False)
            if out.returncode:
                raise SystemExit(f"toptpu run failed ({out.returncode}): {out.stderr.strip()}")
            res = json.loads(out.stdout)
            ttft[p].append(res["ttft_s"])
            decode[p].append(res["tokens_per_s"])
            print(f"  (repeat {r + 1}, {BT.ENV_VAR}={p}: TTFT {res['ttft_s']:.3f} s, decode "
                  f"{res['tokens_per_s']:.2f} tok/s)", flush=True)
    end = os.getloadavg()[0]
    print(f"`toptpu run {path} --ids <{prompt} ids> --max-new-tokens {new} --ignore-eos "
          f"--executor {executor}`, one fresh process each; medians of {repeat}; host cores "
          f"{os.cpu_count()}, load average (1 min) {load:.2f} at the start, {end:.2f} at "
          "the end")
    base = policies[0]
    print(f"{BT.ENV_VAR:<20} {'decode tok/s':>12} {f'/ {base}':>9} {'TTFT s':>8} "
          f"{f'/ {base}':>9}   decode tok/s of each run")
    for p in policies:
        d, t = statistics.median(decode[p]), statistics.median(ttft[p])
        db, tb = statistics.median(decode[base]), statistics.median(ttft[base])
        runs = " ".join(f"{x:.2f}" for x in decode[p])
        print(f"{p:<20} {d:12.2f} {d / db:9.2f} {t:8.3f} {t / tb:9.2f}   {runs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--models", default="smollm2,qwen05,qwen7")
    ap.add_argument("--max-bytes", type=float, default=1.2e9,
                    help="skip products whose f32 weight is larger (memory)")
    ap.add_argument("--model", help="measure `toptpu run` of this model file per policy")
    ap.add_argument("--policies", default="blas,auto,1")
    ap.add_argument("--new", type=int, default=32, help="--max-new-tokens (--model)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt length in ids (--model)")
    ap.add_argument("--executor", default="machine", help="(--model)")
    a = ap.parse_args()
    if a.model:
        run_model(a.model, [p.strip() for p in a.policies.split(",") if p.strip()], a.new,
                  a.prompt, a.repeat, a.executor)
        return
    if not BT.controllable():
        raise SystemExit("numpy's BLAS threads cannot be set on this host (no OpenBLAS "
                         "found): nothing to compare")
    BT.set_policy("auto")  # what is measured is the auto policy, whatever the environment
    default = BT.inherited_threads()
    if default == 1:
        raise SystemExit("the BLAS runs on 1 thread by default here (OPENBLAS_NUM_THREADS=1 "
                         "or one core): nothing to compare")
    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)
    cases: list[tuple[str, int, int, int, object]] = []
    for model in a.models.split(","):
        for what, k, n in projections(model):
            if n * k * 4 > a.max_bytes:
                continue
            w = rng.standard_normal((n, k), np.float32)
            for m in rows:
                x = rng.standard_normal((m, k), np.float32)
                cases.append((what, m, k, n, lambda x=x, w=w: np.matmul(x, w.T)))
    for sk in (32, 512):  # an attention's scores: [1, heads, rows, 64] x [1, heads, 64, keys]
        for m in rows:
            q = rng.standard_normal((1, 14, m, 64), np.float32)
            kt = rng.standard_normal((1, 14, 64, sk), np.float32)
            cases.append((f"scores {sk} keys", m, 64, sk, lambda q=q, kt=kt: np.matmul(q, kt)))
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    state = "loaded" if load >= cores * 0.75 else "quiet"
    print(f"numpy BLAS: {BT._the_blas().path}; default threads {default}; host cores {cores}; "
          f"load average (1 min) {load:.2f} at the start ({state})")
    print(f"{'product':<18} {'rows':>5} {'k':>6} {'n':>7} {'mult-adds':>14} "
          f"{'1 thread ms':>11} {f'{default} threads ms':>12} {'default/1':>9}  "
          f"{'faster':<20} auto")
    results: list[tuple[int, int, float, float, int]] = []
    for what, m, k, n, fn in cases:
        fn()  # warm: caches, pages
        one: list[float] = []
        many: list[float] = []
        for _ in range(a.repeat):
            one.append(timed(fn, 1))
            many.append(timed(fn, default))
        t1, tn = statistics.median(one), statistics.median(many)
        macs = m * k * n
        auto = BT.threads_for(m, k, n) or default
        results.append((m, macs, t1, tn, auto))
        verdict = "1 thread" if t1 < tn else f"{default} threads"
        ratio = max(t1, tn) / min(t1, tn)
        print(f"{what:<18} {m:>5} {k:>6} {n:>7} {macs:>14,} {t1 * 1e3:11.3f} {tn * 1e3:12.3f} "
              f"{tn / t1:9.2f}  {f'{verdict} ({ratio:.2f}x)':<20} {auto}", flush=True)
    end = os.getloadavg()[0]
    print(f"load average (1 min) at the end {end:.2f}")
    for m in sorted({r[0] for r in results}):
        mine = sorted((macs, tn / t1) for rows, macs, t1, tn, _ in results if rows == m)
        start = next((macs for i, (macs, _) in enumerate(mine)
                      if all(r < 1.0 for _, r in mine[i:])), None)
        print(f"  {m} row(s): " + ("one thread won the largest product measured" if start is None
                                   else f"the default threads won every product of {start:,} "
                                        "multiply-adds and more"))
    total1 = sum(r[2] for r in results)
    totaln = sum(r[3] for r in results)
    totala = sum(t1 if auto == 1 else tn for _, _, t1, tn, auto in results)
    print(f"all products once: 1 thread {total1 * 1e3:.1f} ms, {default} threads "
          f"{totaln * 1e3:.1f} ms, auto {totala * 1e3:.1f} ms ({BT.describe()})")


if __name__ == "__main__":
    main()
