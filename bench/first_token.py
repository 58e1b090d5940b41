"""Time to the first token and decode speed of `toptpu run` as a user meets it — one fresh
process per request — against transformers eager float32 with the model already loaded,
measured side by side in one run.

The model has Qwen2.5-0.5B's public shape (24 layers, hidden 896, vocab 151936; seeded random
weights, nothing downloaded) with toptpu's tiny built-in tokenizer, compiled once (default
w4bf16, seq 512). Then, for each prompt length (default 5, 32, 64 and 500 token ids) and
each repeat, alternately:

- ours: `toptpu run FILE --ids ... --max-new-tokens 16 --ignore-eos --json` in a new process
  (per executor: the reference machine in its fast mode, the default of `run`, and the Tpu
  interpreter); its `ttft_s` (host wall time from the request to the first token, in a
  process that has done nothing before: the cold TTFT), its decode tok/s, and the process's
  whole wall time (imports and file loading included);
- eager: `generate` of 1 token (its TTFT) and of 16 tokens (decode tok/s after the first)
  on the loaded float32 model.

Last, the f32 products of one decode step alone (every layer's projections, the lm_head), on
numpy's BLAS (what our kernels call) and on torch's (what eager calls): each executor's
decode step over numpy's products, against eager's step over torch's, is a ratio the
host's BLAS cancels out of (the host-independent overhead).

The host is shared: compare the ratios printed, not absolute times across runs. Medians
over the repeats; the ratios are ours / eager (TTFT: lower is better; decode: higher).

Run: python bench/first_token.py [--layers 24] [--mode w4bf16] [--seq 512]
         [--prompts 5,32,64,500] [--new 16] [--repeat 3]
         [--executors machine,interpreter] [--prefill-lengths 16,64,128] [--keep DIR]
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
from transformers import Qwen2ForCausalLM

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


def run_cli(path: str, ids: list[int], new: int, executor: str) -> dict:
    """One `toptpu run --json` in a fresh process; its JSON with the process wall time."""
    cmd = [sys.executable, "-m", "toptpu.cli", "run", path, "--ids",
           ",".join(map(str, ids)), "--max-new-tokens", str(new), "--ignore-eos", "--json",
           "--executor", executor]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"toptpu run failed ({out.returncode}): {out.stderr.strip()}")
    res = json.loads(out.stdout)
    res["wall_s"] = wall
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


def decode_products(model: Qwen2ForCausalLM, repeat: int) -> tuple[float, float]:
    """Seconds of one decode step's f32 products alone, numpy's BLAS and torch's (best of
    `repeat`, alternating, on the model's own weights)."""
    rng = np.random.default_rng(1)
    pairs = []
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            w = lin.weight.detach().numpy()
            pairs.append((rng.standard_normal((1, w.shape[1]), dtype=np.float32), w))
    w = model.lm_head.weight.detach().numpy()
    pairs.append((rng.standard_normal((1, w.shape[1]), dtype=np.float32), w))
    tpairs = [(torch.from_numpy(x), torch.from_numpy(w)) for x, w in pairs]
    ours, theirs = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        for x, w in pairs:
            np.matmul(x, w.T)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            for tx, tw in tpairs:
                torch.nn.functional.linear(tx, tw)
        theirs.append(time.perf_counter() - t)
    return min(ours), min(theirs)


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
    ap.add_argument("--keep", help="directory for the model file; reused when it exists")
    a = ap.parse_args()
    lengths = [int(x) for x in a.prompts.split(",") if x.strip()]
    lengths = [n for n in lengths if 0 < n < a.seq]
    executors = [e.strip() for e in a.executors.split(",") if e.strip()]

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
    print(f"model: Qwen2.5-0.5B shape, {a.layers} layers, {a.mode}, seq {a.seq}; "
          f"torch threads {torch.get_num_threads()}, host cores {os.cpu_count()}")

    rng = np.random.default_rng(0)
    prompts = {n: [int(i) for i in rng.integers(3, 380, n)] for n in lengths}
    eager(model, prompts[lengths[0]], 2)  # warm-up: eager's model is loaded and warm
    ours = {(e, n): Runs() for e in executors for n in lengths}
    hf = {n: Runs() for n in lengths}
    for _ in range(a.repeat):
        for n in lengths:  # interleaved: every measurement sees the same host load
            for e in executors:
                r = run_cli(path, prompts[n], a.new, e)
                runs = ours[(e, n)]
                runs.ttft.append(r["ttft_s"])
                runs.decode.append(r["tokens_per_s"] or float("nan"))
                runs.wall.append(r["wall_s"])
                runs.modelled_ttft = r["modelled_ttft_s"]
            ttft, dec = eager(model, prompts[n], a.new)
            hf[n].ttft.append(ttft)
            hf[n].decode.append(dec)

    print(f"`toptpu run --ids <n ids> --max-new-tokens {a.new} --ignore-eos --json`, one "
          f"fresh process each; eager f32 with the model loaded; medians of {a.repeat} "
          "interleaved runs")
    print(f"{'prompt':>6} {'executor':<12} {'TTFT s':>8} {'eager s':>8} {'ratio':>6} "
          f"{'decode tok/s':>12} {'eager':>7} {'ratio':>6} {'process s':>9} "
          f"{'modelled TTFT s':>15}")
    for n in lengths:
        h = hf[n]
        for e in executors:
            r = ours[(e, n)]
            mt = "n/a" if r.modelled_ttft is None else f"{r.modelled_ttft:.6f}"
            print(f"{n:>6} {e:<12} {med(r.ttft):8.3f} {med(h.ttft):8.3f} "
                  f"{med(r.ttft) / med(h.ttft):6.2f} {med(r.decode):12.2f} "
                  f"{med(h.decode):7.2f} {med(r.decode) / med(h.decode):6.2f} "
                  f"{med(r.wall):9.2f} {mt:>15}")
    ours_s, theirs_s = decode_products(model, max(a.repeat, 3))
    dec_all = [d for runs in hf.values() for d in runs.decode]
    eager_step = 1 / med(dec_all)
    print(f"one decode step's f32 products alone: numpy {ours_s * 1e3:.1f} ms, torch "
          f"{theirs_s * 1e3:.1f} ms; eager's step {eager_step * 1e3:.1f} ms = "
          f"{eager_step / theirs_s:.2f}x its products")
    for e in executors:
        step = 1 / med([d for (ex, _), r in ours.items() if ex == e for d in r.decode])
        print(f"  {e:<12} step {step * 1e3:.1f} ms = {step / ours_s:.2f}x numpy's products "
              f"(eager {eager_step / theirs_s:.2f}x torch's: overhead ratio "
              f"{(step / ours_s) / (eager_step / theirs_s):.2f})")


if __name__ == "__main__":
    main()
