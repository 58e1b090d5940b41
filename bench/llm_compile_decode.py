"""Full compile time of a 24-layer Qwen2.5-0.5B-shaped model, and prefill and decode
tokens/s of the compiled model file on our executors vs transformers eager on the CPU, all
in the same run.

The model has Qwen2.5-0.5B's public shape (hidden 896, intermediate 4864, 14 heads, 2 KV
heads, vocab 151936, tied embeddings) with seeded random weights; nothing is downloaded.
Compile: `toptpu.compile` to a model file (default w4bf16, seq 512), timed end to end with
its per-stage breakdown. Then, greedy with EOS ignored and the same prompt ids for all:

- prefill: the prompt (default 128 tokens, one `max_input_length` chunk) to the first
  token, as tokens/s of host wall time;
- decode: tokens/s after the first token.

Ours runs on the reference machine in its fast mode (the default of `toptpu run`/`chat`; it
computes a sliced matmul as one host product where that gives the slices' own bytes on this
host, see `machine.SliceJoin`; the run prints how many) and
in its checked mode (the tests' mode: bytes really live in local memory), and on the numpy
Tpu interpreter (`--executors` picks among `fast,checked,interpreter`); the machine also
reports modelled chip time. transformers runs the float32 model in eager PyTorch (no
compile). After one warm-up run each (weights converted, joins checked), each is measured
`--repeat` times, alternating, `--pause` seconds apart (a BLAS's threads spin for a while
after a call and would slow whatever runs next); the best run's rates are reported, with
the ratios ours / transformers of the best runs and of the medians (this host's speed
drifts by 10-15% over minutes: the two ratios show how much). Last, the f32 products of
one prefill and of one decode step alone, on numpy's BLAS (our kernels') and on torch's
(eager's), on the model's weights: how fast numpy's products alone would run against eager
bounds what any of our executors can reach on this host (the ratio moves with the CPU:
torch's BLAS is MKL, numpy's OpenBLAS).

Our executors' matmuls are numpy's, on its BLAS (OpenBLAS, one thread per core unless
`OPENBLAS_NUM_THREADS` says otherwise; the run prints which). On a shared, loaded host a
multi-threaded BLAS call waits for its second thread to be scheduled, and the machine makes
many more, smaller calls than the interpreter (the compiler's slices: the lm_head is 64 of
them), so its ratios there depend on the host's load; `OPENBLAS_NUM_THREADS=1 python
bench/llm_compile_decode.py` measures without that wait. The thread count can change the
last bits of a sliced matmul's result (BLAS splits the work differently), never the
agreement between the machine's two modes in one process.

Run: python bench/llm_compile_decode.py [--layers 24] [--mode w4bf16] [--seq 512]
         [--input 128] [--prompt 128] [--decode 8] [--hf-decode 32]
         [--executors fast,checked,interpreter] [--repeat 3] [--pause 0.3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime
from toptpu.compiler import compile as compile_model
from toptpu.frontends.tiny_models import qwen25_05b_config

#: our executors: bench name -> label
EXECUTORS = {
    "fast": "machine, fast mode",
    "checked": "machine, checked mode",
    "interpreter": "Tpu interpreter",
}


@dataclass
class Rates:
    prefill: float  # prompt tokens / s to the first token
    decode: float  # tokens / s after the first
    modelled_decode: float | None = None


def open_runtime(kind: str, path: str) -> Runtime:
    if kind == "interpreter":
        return Runtime(InterpreterExecutor(path))
    return Runtime(MachineExecutor(path, checked=kind == "checked"))


def our_rates(rt: Runtime, ids: list[int], n: int) -> Rates:
    r = rt.generate(ids, n + 1, stop_on_eos=False)
    return Rates(len(ids) / r.ttft_s, r.decode_tokens_per_s or 0.0, r.modelled_tokens_per_s)


def hf_rates(model: Qwen2ForCausalLM, ids: list[int], n: int) -> Rates:
    """Prefill and decode rates of transformers greedy generate."""
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
    return Rates(len(ids) / ttft, n / max(total - ttft, 1e-9))


def best(runs: list[Rates]) -> Rates:
    """The best prefill and decode rates of `runs` (each may come from another run)."""
    return Rates(max(r.prefill for r in runs), max(r.decode for r in runs),
                 runs[-1].modelled_decode)


def median(runs: list[Rates]) -> Rates:
    """The median prefill and decode rates of `runs`."""
    return Rates(float(np.median([r.prefill for r in runs])),
                 float(np.median([r.decode for r in runs])), runs[-1].modelled_decode)


def products(model: Qwen2ForCausalLM, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The f32 matmuls of one forward over `rows` tokens (every layer's projections, the
    lm_head on the last row), as (input, weight) pairs sharing the model's weights."""
    rng = np.random.default_rng(1)
    out = []
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            w = lin.weight.detach().numpy()
            out.append((rng.standard_normal((rows, w.shape[1]), dtype=np.float32), w))
    w = model.lm_head.weight.detach().numpy()
    out.append((rng.standard_normal((1, w.shape[1]), dtype=np.float32), w))
    return out


def blas_ceiling(model: Qwen2ForCausalLM, rows: int, repeat: int, pause: float
                 ) -> tuple[float, float]:
    """Host seconds of the f32 products of one forward over `rows` tokens on numpy's BLAS
    (what our kernels call) and on torch's (what eager calls), best of `repeat`
    alternating runs on the same weights: the part of eager's time our executors cannot
    undercut with numpy, whatever else they save."""
    pairs = products(model, rows)
    tpairs = [(torch.from_numpy(x), torch.from_numpy(w)) for x, w in pairs]
    ours, theirs = [], []
    for _ in range(repeat):
        time.sleep(pause)
        t = time.perf_counter()
        for x, w in pairs:
            np.matmul(x, w.T)
        ours.append(time.perf_counter() - t)
        time.sleep(pause)
        t = time.perf_counter()
        with torch.no_grad():
            for tx, tw in tpairs:
                torch.nn.functional.linear(tx, tw)
        theirs.append(time.perf_counter() - t)
    return min(ours), min(theirs)


def blas_threads() -> str:
    """How many threads numpy's BLAS uses, as the environment sets it."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return f"OpenBLAS default: one per core ({os.cpu_count()})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--input", type=int, default=128, help="max_input_length")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=int, default=8, help="tokens decoded by our executors")
    ap.add_argument("--hf-decode", type=int, default=32, help="tokens decoded by transformers")
    ap.add_argument("--repeat", type=int, default=3,
                    help="measure all alternately this many times; report the best and "
                         "the median")
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds between measured runs (the BLAS threads of the one "
                         "before spin for a while)")
    ap.add_argument("--out", help="directory for the model file (default: a temp dir)")
    ap.add_argument("--executors", default="fast,checked,interpreter",
                    help=f"comma-separated, of {', '.join(EXECUTORS)}")
    a = ap.parse_args()
    kinds = [k.strip() for k in a.executors.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in EXECUTORS]
    if unknown or not kinds:
        ap.error(f"--executors: unknown {unknown}; choose among {', '.join(EXECUTORS)}")

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
          f"nets {nets_s:.1f}s ({len(res.nets)} nets, each once) + per-layer weights "
          f"{res.timings['weights']:.1f}s + write {res.timings['write']:.1f}s; model file "
          f"{os.path.getsize(path) / 1e6:.0f} MB")
    print("  IR bytes per net: " + ", ".join(f"{n} {c.ir_bytes}" for n, c in res.nets.items()))

    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, 1000, a.prompt)]
    runtimes = {k: open_runtime(k, path) for k in kinds}
    for rt in runtimes.values():  # first use: weights converted, joins checked
        our_rates(rt, ids, 1)
    ours: dict[str, list[Rates]] = {k: [] for k in kinds}
    hf: list[Rates] = []
    for _ in range(a.repeat):  # alternate, so all see the same machine load
        for k, rt in runtimes.items():
            time.sleep(a.pause)
            ours[k].append(our_rates(rt, ids, a.decode))
        time.sleep(a.pause)
        hf.append(hf_rates(model, ids, a.hf_decode))
    print(f"prefill: {a.prompt} prompt tokens in one {a.input}-row chunk, to the first token; "
          f"decode: tokens after the first (ours {a.decode}, transformers {a.hf_decode}); "
          f"{a.repeat} alternating runs each, {a.pause} s apart, after one warm-up; host "
          f"wall time; numpy BLAS threads: {blas_threads()}")
    print("rates: the best run's; ratios: to transformers, of the best runs and of the "
          "medians")
    print(f"{'executor':<26} {'prefill tok/s':>13} {'ratio':>13} {'decode tok/s':>12} "
          f"{'ratio':>13} {'modelled decode tok/s':>21}")
    hb, hm = best(hf), median(hf)
    for k in kinds:
        b, md = best(ours[k]), median(ours[k])
        modelled = "n/a" if b.modelled_decode is None else f"{b.modelled_decode:.1f}"
        print(f"{EXECUTORS[k]:<26} {b.prefill:13.2f} "
              f"{b.prefill / hb.prefill:6.3f}/{md.prefill / hm.prefill:6.3f} "
              f"{b.decode:12.2f} {b.decode / hb.decode:6.3f}/{md.decode / hm.decode:6.3f} "
              f"{modelled:>21}")
    print(f"{'transformers eager f32':<26} {hb.prefill:13.2f} {'1':>13} {hb.decode:12.2f} "
          f"{'1':>13} {'':>21}  (CPU, {torch.get_num_threads()} threads)")
    print("the f32 products alone (each layer's projections, the lm_head on the last row; "
          "the same weights, best of the runs), numpy's BLAS vs torch's:")
    for what, rows, step_s in (("prefill", a.prompt, lambda r: a.prompt / r.prefill),
                               ("decode step", 1, lambda r: 1 / r.decode)):
        ours_s, theirs_s = blas_ceiling(model, rows, a.repeat, a.pause)
        eager_s = step_s(hb)
        print(f"  {what:<12} numpy {ours_s * 1e3:7.1f} ms, torch {theirs_s * 1e3:7.1f} ms "
              f"(numpy / torch {ours_s / theirs_s:.2f}); eager's whole {what}: "
              f"{eager_s * 1e3:.1f} ms, so numpy's products alone run at "
              f"{eager_s / ours_s:.2f}x eager")
        beyond = [f"{k} {(step_s(best(ours[k])) - ours_s) * 1e3:.1f}" for k in kinds]
        print(f"  {'':<12} time beyond the products (best runs), ms: "
              f"{', '.join(beyond)}; eager {(eager_s - theirs_s) * 1e3:.1f}")
        # the host's BLAS cancels out of this one: each executor against its own products
        over = [f"{k} {step_s(best(ours[k])) / ours_s:.2f}" for k in kinds]
        print(f"  {'':<12} whole {what} / its products alone (best runs): "
              f"{', '.join(over)} (numpy's); eager {eager_s / theirs_s:.2f} (torch's)")
    if "fast" in runtimes:
        verdicts = runtimes["fast"].ex.machine.join_ok  # type: ignore[attr-defined]
        used = [j for j, ok in verdicts.items() if ok]
        print(f"fast mode: {len(used)} of {len(verdicts)} sliced matmuls joined into one host "
              f"product each ({sum(len(j.steps) for j in used)} slices), after their "
              "bit-for-bit check on this host")


if __name__ == "__main__":
    main()
