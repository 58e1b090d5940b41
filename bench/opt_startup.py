"""toptpu-opt's start-up and a one-layer top-pipeline, beside `python -c pass` and the bare
imports, measured side by side in one run (the ratio cancels the host's speed).

    python bench/opt_startup.py [--repeat 5]

Prints the median wall time of each command and its ratio to `python -c pass`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from helpers import decoder_layer_ir
    from toptpu.frontends.tiny_models import tiny_model

    py = sys.executable
    opt = os.path.join(os.path.dirname(py), "toptpu-opt")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "top.mlir")
        with open(src, "w") as f:
            f.write(decoder_layer_ir(tiny_model("qwen2"), d))
        cases = {
            "python -c pass": [py, "-c", "pass"],
            "import numpy, ml_dtypes": [py, "-c", "import numpy, ml_dtypes"],
            "import toptpu.opt": [py, "-c", "import toptpu.opt"],
            "toptpu-opt --help": [opt, "--help"],
            "toptpu-opt -p top-pipeline (1 layer)": [opt, src, "-p", "top-pipeline", "-o",
                                                     os.devnull],
            "toptpu-opt -p top-pipeline,tpu-pipeline": [
                opt, src, "-p", "top-pipeline,tpu-pipeline{mode=w4bf16}", "-o", os.devnull,
                "--weights-out", os.devnull],
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeat):  # interleaved, so drifts of the host hit every case
            for name, cmd in cases.items():
                times[name].append(_wall(cmd))
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<44} {'median s':>9} {'x python -c pass':>17}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<44} {m:>9.3f} {m / base:>17.1f}")


if __name__ == "__main__":
    main()
