"""MLIR-JIT decoder layer vs the numpy interpreter, measured side by side in one run.

For a tiny Qwen2 layer and a Qwen2.5-0.5B-shaped layer (hidden 896, 14/2 heads, intermediate
4864; random weights): the Top module (after top-pipeline) is compiled once by real MLIR
(`toptpu.mlir_jit`: convert-top-to-linalg, MLIR 22 bufferization and LLVM lowering,
ExecutionEngine), then both implementations run the same inputs alternately; the per-call
time is the median over the calls (compile time excluded, reported separately). Both run on
one thread (the JIT code is single-threaded; OpenBLAS is pinned to one thread before numpy
loads: on a shared 2-core machine its spinning worker threads otherwise make numpy 10x
slower or faster from run to run). Two JIT variants: the oracle's strict IEEE order, and
fast-math (reassoc/contract: LLVM vectorizes the reductions).
Run: python bench/mlir_jit.py [--seq 16] [--calls 5] [--opt-level 3]
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from toptpu.backend.reference.interpreter import Interpreter  # noqa: E402
from toptpu.frontends.hf_layers import import_decoder_layer  # noqa: E402
from toptpu.frontends.tiny_models import tiny_model  # noqa: E402
from toptpu.metrics import similarity  # noqa: E402
from toptpu.mlir_jit import MLIRJit  # noqa: E402

CONFIGS = {
    "tiny qwen2": {},
    "qwen2.5-0.5b-shaped": dict(hidden_size=896, intermediate_size=4864,
                                num_attention_heads=14, num_key_value_heads=2,
                                rope_theta=1000000.0),
}


def bench(label: str, overrides: dict, seq: int, calls: int, opt_level: int) -> None:
    """One line per JIT variant (strict IEEE order, then fast-math reassoc/contract)."""
    model = tiny_model("qwen2", layers=1, **overrides)
    imp = import_decoder_layer(model, seq)
    module, feeds, ref = imp.module, imp.feeds, imp.reference
    interp = Interpreter(module, imp.store)
    out_np = interp.run(feeds)["out"]
    for fast in (False, True):
        jit = MLIRJit(module, imp.store, opt_level=opt_level, fast_math=fast)
        out_jit = jit.run(feeds)["out"]  # warm-up (also feeds the weights once)
        t_jit, t_np = [], []
        for _ in range(calls):
            t = time.perf_counter()
            jit.run(feeds)
            t_jit.append(time.perf_counter() - t)
            t = time.perf_counter()
            interp.run(feeds)
            t_np.append(time.perf_counter() - t)
        mj, mn = statistics.median(t_jit), statistics.median(t_np)
        speed = f"{mn / mj:.2f}x faster" if mj < mn else f"{mj / mn:.2f}x slower"
        variant = "fast-math JIT" if fast else "MLIR JIT"
        print(f"{label} layer, seq {seq}: {variant} {mj * 1e3:.2f} ms/call, numpy "
              f"interpreter {mn * 1e3:.2f} ms/call -> JIT is {speed} (median of {calls}; "
              f"compile {jit.compile_seconds:.2f} s + lowering {jit.lower_seconds:.2f} s at "
              f"-O{opt_level}); cosine JIT vs torch {similarity(out_jit, ref).cosine:.9f}, "
              f"vs numpy {similarity(out_jit, out_np).cosine:.9f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--opt-level", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for label, overrides in CONFIGS.items():
        bench(label, overrides, a.seq, a.calls, a.opt_level)


if __name__ == "__main__":
    main()
