"""Time to the first token and decode speed of `toptpu run` as a user meets it — one fresh
process per request — against transformers eager float32 with the model already loaded,
measured side by side in one run.

The model has Qwen2.5-0.5B's public shape (24 layers, hidden 896, vocab 151936; seeded random
weights, nothing downloaded) with toptpu's tiny built-in tokenizer, compiled once (default
w4bf16, seq 512, the default prefill lengths 16, 32, 64, 128). The path is the default one, as a
user meets it: the bench writes no weight cache file (and removes one left beside the model
file); the first `toptpu run` writes it itself (TOPTPU_WEIGHT_CACHE_FILE's default) and is
measured apart — its TTFT, its whole process with the write, the file's size against the
model file's —, every run after it is a second run of the same file. `--no-weight-cache`
runs every process with TOPTPU_WEIGHT_CACHE_FILE=off (each converts its weights: the path
before the runs wrote the file). Then, for each prompt length (default 5, 32, 64 and 500
token ids) and each repeat, alternately:

- ours: `toptpu run FILE --ids ... --max-new-tokens 16 --ignore-eos --json` in a new process
  (per executor: the reference machine in its fast mode, the default of `run`, and the Tpu
  interpreter; `--baseline NAME=PYTHON:FILE` adds another checkout's toptpu on a file it
  compiled, e.g. main's before a change); its `ttft_s` (host wall time from the request to
  the first token, in a process that has done nothing before: the cold TTFT), its decode
  tok/s (the 15 tokens after the first), and the process's whole wall time (interpreter
  start, imports and loading the model file included);
- eager: `generate` of 1 token (its TTFT) and of 16 tokens (decode tok/s after the first)
  on the loaded float32 model.

Last, the f32 products of one decode step alone (every layer's projections, the lm_head), on
numpy's BLAS (what our kernels call) and on torch's (what eager calls): each executor's
decode step over numpy's products, against eager's step over torch's, is a ratio the
host's BLAS cancels out of (the host-independent overhead).

The host is shared: compare the ratios printed, not absolute times across runs. Medians
over the repeats; the ratios are ours / eager (TTFT: lower is better; decode: higher).
`OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python bench/first_token.py` runs every party on
one thread (numpy's BLAS in the subprocesses, torch's in eager).

Run: python bench/first_token.py [--layers 24] [--mode w4bf16] [--seq 512] [--eager-threads N]
         [--prompts 5,32,64,500] [--new 16] [--repeat 3]
         [--executors machine,interpreter] [--prefill-lengths 16,64,128] [--keep DIR]
         [--no-weight-cache] [--baseline NAME=PYTHON:FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from llm_compile_decode import blas_ceiling  # bench/ is on sys.path as the script's folder
from transformers import Qwen2ForCausalLM

from toptpu.backend.runtime.weight_cache_file import cache_path
from toptpu.compiler import compile as compile_model
from toptpu.frontends.tiny_models import build_tokenizer, qwen25_05b_config


@dataclass
class Runs:
    """One executor's measurements at one prompt length, over the repeats."""

    ttft: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)  # tok/s after the first
    wall: list[float] = field(default_factory=list)  # the whole process (ours only)
    modelled_ttft: float | None = None


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass(frozen=True)
class Ours:
    """One of our executors as the bench runs it: `toptpu run --executor EXECUTOR FILE` by
    a Python (a baseline: another checkout's, on its own model file)."""

    name: str
    executor: str
    python: str
    path: str


def run_cli(ours: Ours, ids: list[int], new: int, env: dict[str, str] | None = None) -> dict:
    """One `toptpu run --json` in a fresh process (`env` added to the environment); its
    JSON with the process wall time and its stderr."""
    cmd = [ours.python, "-m", "toptpu.cli", "run", ours.path, "--ids",
           ",".join(map(str, ids)), "--max-new-tokens", str(new), "--ignore-eos", "--json",
           "--executor", ours.executor]
    t = time.perf_counter()
    # from a neutral directory: `-m` puts the working directory first on sys.path, and a
    # checkout's `toptpu/` there would shadow the one the Python has installed
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd="/",
                         env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"toptpu run failed ({out.returncode}): {out.stderr.strip()}")
    res = json.loads(out.stdout)
    res["wall_s"] = wall
    res["stderr"] = out.stderr
    return res


def eager(model: Qwen2ForCausalLM, ids: list[int], new: int) -> tuple[float, float]:
    """transformers eager greedy generate on the loaded model: (TTFT s, decode tok/s)."""
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, **kw)
        total = time.perf_counter() - t
    n = out.shape[1] - len(ids) - 1
    return ttft, n / max(total - ttft, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompts", default="5,32,64,500",
                    help="prompt lengths in token ids (those that fit --seq)")
    ap.add_argument("--new", type=int, default=16, help="--max-new-tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--executors", default="machine,interpreter")
    ap.add_argument("--max-input-length", type=int, default=None)
    ap.add_argument("--prefill-lengths", default=None,
                    help="the compile's --prefill-lengths (default: its default)")
    ap.add_argument("--no-weight-cache", action="store_true",
                    help="every run with TOPTPU_WEIGHT_CACHE_FILE=off: none writes the model "
                    "file's weight cache file, each converts its weights")
    ap.add_argument("--eager-threads", type=int, default=None,
                    help="torch threads of eager (default: torch's, one per core)")
    ap.add_argument("--keep", help="directory for the model file; reused when it exists")
    ap.add_argument("--baseline", action="append", default=[], metavar="NAME=PYTHON:FILE",
                    help="also run `PYTHON -m toptpu.cli run FILE` (another checkout's "
                    "toptpu on a file it compiled, e.g. main's) as executor NAME")
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompts.split(",") if x.strip()]
    lengths = [n for n in lengths if 0 < n < a.seq]

    if a.eager_threads is not None:
        torch.set_num_threads(a.eager_threads)
    cfg = qwen25_05b_config(a.layers, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    out_dir = a.keep or tempfile.mkdtemp(prefix="toptpu-first-token-")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"qwen2.5-0.5b-shape-{a.layers}l-{a.mode}.toptpu")
    if not os.path.exists(path):
        extra = {}
        if a.prefill_lengths is not None:
            extra["prefill_lengths"] = [int(x) for x in a.prefill_lengths.split(",")]
        t = time.perf_counter()
        compile_model(model, path, mode=a.mode, seq_length=a.seq,
                      max_input_length=a.max_input_length, tokenizer=build_tokenizer(),
                      progress=None, **extra)
        print(f"compiled {path} in {time.perf_counter() - t:.1f}s "
              f"({os.path.getsize(path) / 1e6:.0f} MB)")
    if os.path.exists(cache_path(path)):  # the default path: none until a run writes it
        os.unlink(cache_path(path))
    env = {"TOPTPU_WEIGHT_CACHE_FILE": "off"} if a.no_weight_cache else {}
    runners = [Ours(e.strip(), e.strip(), sys.executable, path)
               for e in a.executors.split(",") if e.strip()]
    for item in a.baseline:
        name, _, rest = item.partition("=")
        python, _, file = rest.partition(":")
        runners.append(Ours(name, "machine", python, file))
    threads = {v: os.environ[v] for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
               if v in os.environ}
    print(f"model: Qwen2.5-0.5B shape, {a.layers} layers, {a.mode}, seq {a.seq}; "
          f"torch threads {torch.get_num_threads()}, numpy BLAS threads "
          f"{threads or 'default (one per core)'}, TOPTPU_BLAS_THREADS "
          f"{os.environ.get('TOPTPU_BLAS_THREADS', 'auto')}, host cores {os.cpu_count()}, "
          f"load average (1 min) {os.getloadavg()[0]:.2f}")

    rng = np.random.default_rng(0)
    prompts = {n: [int(i) for i in rng.integers(3, 380, n)] for n in lengths}
    eager(model, prompts[lengths[0]], 2)  # warm-up: eager's model is loaded and warm
    first = run_cli(runners[0], prompts[lengths[0]], a.new, env)  # writes the cache file
    wrote = os.path.exists(cache_path(path))
    size = f"{os.path.getsize(cache_path(path)) / 1e9:.2f} GB, " \
        f"{os.path.getsize(cache_path(path)) / os.path.getsize(path):.1f}x the model file" \
        if wrote else "none"
    print(f"  (the first run: {lengths[0]} ids, {runners[0].name}: TTFT {first['ttft_s']:.3f} s, "
          f"decode {first['tokens_per_s']:.2f} tok/s, process {first['wall_s']:.1f} s; "
          f"weight cache file written: {size})", flush=True)
    ours = {(r.name, n): Runs() for r in runners for n in lengths}
    cached: dict[str, object] = {}
    hf = {n: Runs() for n in lengths}
    for _ in range(a.repeat):
        for n in lengths:  # interleaved: every measurement sees the same host load
            for r in runners:
                res = run_cli(r, prompts[n], a.new, env)
                runs = ours[(r.name, n)]
                runs.ttft.append(res["ttft_s"])
                runs.decode.append(res["tokens_per_s"] or float("nan"))
                runs.wall.append(res["wall_s"])
                runs.modelled_ttft = res["modelled_ttft_s"]
                cached[r.name] = res.get("weight_cache_file")
                print(f"  ({n} ids, {r.name}: TTFT {res['ttft_s']:.3f} s, decode "
                      f"{runs.decode[-1]:.2f} tok/s, process {res['wall_s']:.1f} s)",
                      flush=True)
            ttft, dec = eager(model, prompts[n], a.new)
            hf[n].ttft.append(ttft)
            hf[n].decode.append(dec)
            print(f"  ({n} ids, eager: TTFT {ttft:.3f} s, decode {dec:.2f} tok/s)",
                  flush=True)

    print(f"`toptpu run --ids <n ids> --max-new-tokens {a.new} --ignore-eos --json`, one "
          f"fresh process each; eager f32 with the model loaded; medians of {a.repeat} "
          "interleaved runs")
    eager_first = med(hf[lengths[0]].ttft)
    print(f"the first run ({runners[0].name}, {lengths[0]} ids): TTFT {first['ttft_s']:.3f} s "
          f"= {first['ttft_s'] / eager_first:.2f}x eager's {eager_first:.3f} s; process "
          f"{first['wall_s']:.1f} s; weight cache file written: {size}")
    for r in runners:
        print(f"  {r.name}: {r.python} -m toptpu.cli run {r.path} --executor {r.executor}; "
              f"weight cache file: {cached.get(r.name)}")
    print(f"{'prompt':>6} {'executor':<12} {'TTFT s':>8} {'eager s':>8} {'ratio':>6} "
          f"{'decode tok/s':>12} {'eager':>7} {'ratio':>6} {'process s':>9} "
          f"{'modelled TTFT s':>15}")
    for n in lengths:
        h = hf[n]
        for r in runners:
            o = ours[(r.name, n)]
            mt = "n/a" if o.modelled_ttft is None else f"{o.modelled_ttft:.6f}"
            print(f"{n:>6} {r.name:<12} {med(o.ttft):8.3f} {med(h.ttft):8.3f} "
                  f"{med(o.ttft) / med(h.ttft):6.2f} {med(o.decode):12.2f} "
                  f"{med(h.decode):7.2f} {med(o.decode) / med(h.decode):6.2f} "
                  f"{med(o.wall):9.2f} {mt:>15}")
    ours_s, theirs_s = blas_ceiling(model, 1, max(a.repeat, 3), 0.0)  # a decode step
    dec_all = [d for runs in hf.values() for d in runs.decode]
    eager_step = 1 / med(dec_all)
    print(f"one decode step's f32 products alone: numpy {ours_s * 1e3:.1f} ms, torch "
          f"{theirs_s * 1e3:.1f} ms; eager's step {eager_step * 1e3:.1f} ms = "
          f"{eager_step / theirs_s:.2f}x its products")
    for r in runners:
        step = 1 / med([d for (name, _), o in ours.items() if name == r.name
                        for d in o.decode])
        print(f"  {r.name:<12} step {step * 1e3:.1f} ms = {step / ours_s:.2f}x numpy's "
              f"products (eager {eager_step / theirs_s:.2f}x torch's: overhead ratio "
              f"{(step / ours_s) / (eager_step / theirs_s):.2f})")


if __name__ == "__main__":
    main()
