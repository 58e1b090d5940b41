"""Full compile time of a 24-layer Qwen2.5-0.5B-shaped model, and decode tokens/s of the
compiled model file on our executor vs transformers eager on the CPU, in the same run.

The model has Qwen2.5-0.5B's public shape (hidden 896, intermediate 4864, 14 heads, 2 KV
heads, vocab 151936, tied embeddings) with seeded random weights; nothing is downloaded.
Compile: `toptpu.compile` to a model file (default w4bf16, seq 512), timed end to end with
its per-stage breakdown. Decode: greedy, EOS ignored, the same prompt ids for both; ours runs
on the reference machine by default (`--executor interpreter`: the numpy Tpu interpreter),
and reports host wall time and modelled chip time; transformers runs the float32 model in
eager PyTorch (no compile).

Run: python bench/llm_compile_decode.py [--layers 24] [--mode w4bf16] [--seq 512]
         [--input 128] [--prompt 32] [--decode 8] [--hf-decode 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from toptpu.backend.runtime.runtime import Runtime
from toptpu.compiler import compile as compile_model
from toptpu.frontends.tiny_models import qwen25_05b_config


def hf_decode_rate(model: Qwen2ForCausalLM, ids: list[int], n: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s) of transformers greedy generate."""
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(x, max_new_tokens=2, **kw)  # warm up
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=n + 1, **kw)
        total = time.perf_counter() - t
    assert out.shape[1] == len(ids) + n + 1
    return ttft, n / max(total - ttft, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--input", type=int, default=128, help="max_input_length")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=8, help="tokens decoded by our executor")
    ap.add_argument("--hf-decode", type=int, default=32, help="tokens decoded by transformers")
    ap.add_argument("--repeat", type=int, default=2,
                    help="measure both decoders alternately this many times; report the best")
    ap.add_argument("--out", help="directory for the model file (default: a temp dir)")
    ap.add_argument("--executor", default="machine", choices=["machine", "interpreter"])
    a = ap.parse_args()

    cfg = qwen25_05b_config(a.layers, eos_token_id=151645)
    torch.manual_seed(0)
    t = time.perf_counter()
    model = Qwen2ForCausalLM(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2.5-0.5B shape, {a.layers} layers, {n_params / 1e6:.0f}M parameters "
          f"(random, float32), built in {time.perf_counter() - t:.1f}s")

    out_dir = a.out or tempfile.mkdtemp(prefix="toptpu-bench-")
    path = os.path.join(out_dir, f"qwen2.5-0.5b-shape-{a.mode}.toptpu")
    t = time.perf_counter()
    res = compile_model(model, path, mode=a.mode, seq_length=a.seq, max_input_length=a.input,
                        progress=None)
    compile_s = time.perf_counter() - t
    nets_s = sum(v for k, v in res.timings.items() if k.startswith("net:"))
    print(f"compile ({a.mode}, seq {a.seq}, input {a.input}): {compile_s:.1f}s total = "
          f"nets {nets_s:.1f}s (7 nets, each once) + per-layer weights "
          f"{res.timings['weights']:.1f}s + write {res.timings['write']:.1f}s; model file "
          f"{os.path.getsize(path) / 1e6:.0f} MB")
    print("  IR bytes per net: " + ", ".join(f"{n} {c.ir_bytes}" for n, c in res.nets.items()))

    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, 1000, a.prompt)]
    rt = Runtime.open(path, a.executor)
    best_ours, best_hf = None, None
    for _ in range(a.repeat):  # alternate, so both see the same machine load
        r = rt.generate(ids, a.decode + 1, stop_on_eos=False)
        if best_ours is None or (r.decode_tokens_per_s or 0) > (best_ours.decode_tokens_per_s
                                                               or 0):
            best_ours = r
        hf_ttft, hf = hf_decode_rate(model, ids, a.hf_decode)
        if best_hf is None or hf > best_hf[1]:
            best_hf = (hf_ttft, hf)
    assert best_ours is not None and best_hf is not None
    ours = best_ours.decode_tokens_per_s or 0.0
    modelled = best_ours.modelled_tokens_per_s
    print(f"ours ({a.executor} executor): time to first token {best_ours.ttft_s:.2f}s "
          f"({a.prompt} prompt tokens in one {a.input}-row chunk), decode {ours:.2f} tok/s "
          f"host, modelled {'n/a' if modelled is None else f'{modelled:.1f} tok/s'}")
    print(f"transformers eager f32 (CPU, {torch.get_num_threads()} threads): time to first "
          f"token {best_hf[0]:.2f}s, decode {best_hf[1]:.2f} tok/s")
    print(f"decode ratio ours / transformers: {ours / best_hf[1]:.3f} "
          f"(best of {a.repeat} alternating runs each)")


if __name__ == "__main__":
    main()
