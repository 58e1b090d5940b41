"""toptpu-opt's start-up and a one-layer top-pipeline, beside `python -c pass` and the bare
imports, measured side by side in one run (the ratio cancels the host's speed).

    python bench/opt_startup.py [--repeat 5] [--baseline OTHER_VENV/bin/python]

Prints the median wall time of each command and its ratio to `python -c pass`. With
`--baseline`, the same commands also run with that interpreter's toptpu (another checkout:
main before a change), interleaved, in two more columns.
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


def _cases(py: str, src: str) -> dict[str, list[str]]:
    opt = os.path.join(os.path.dirname(py), "toptpu-opt")
    return {
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", metavar="PYTHON",
                    help="another venv's python (its toptpu-opt beside it) to time alongside")
    args = ap.parse_args()
    from helpers import decoder_layer_ir
    from toptpu.frontends.tiny_models import tiny_model

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "top.mlir")
        with open(src, "w") as f:
            f.write(decoder_layer_ir(tiny_model("qwen2"), d))
        runs = {"this": _cases(sys.executable, src)}
        if args.baseline:
            runs["baseline"] = _cases(args.baseline, src)
        times = {who: {k: [] for k in cases} for who, cases in runs.items()}
        for _ in range(args.repeat):  # interleaved, so drifts of the host hit every case
            for name in runs["this"]:
                for who, cases in runs.items():
                    times[who][name].append(_wall(cases[name]))
    med = {who: {k: statistics.median(v) for k, v in t.items()} for who, t in times.items()}
    base = med["this"]["python -c pass"]
    head = f"{'command':<44} {'median s':>9} {'x python -c pass':>17}"
    if args.baseline:
        head += f" {'baseline s':>11} {'baseline/this':>14}"
    print(head)
    for name, m in med["this"].items():
        line = f"{name:<44} {m:>9.3f} {m / base:>17.1f}"
        if args.baseline:
            b = med["baseline"][name]
            line += f" {b:>11.3f} {b / m:>14.2f}"
        print(line)


if __name__ == "__main__":
    main()
