"""toptpu-opt's start-up on one layer's Top IR (`-p top-pipeline`) beside `xdsl-opt` on an
empty module, measured side by side in one run (issue 43's goal: at most 3x).

    python bench/opt_startup.py [--repeat 7] [--ir FILE.mlir] [--baseline OTHER_PYTHON]
                                [--bytecode cached|off|both]

Each command runs as a whole process, the commands in turn (A B C ... A B C ...) `--repeat`
times after one warm-up each, so that a drift of the host's load hits them all. Per command:
the median wall and CPU (user + sys, the kernel's accounting of the finished process) seconds,
and the median of the run-by-run ratios to the `xdsl-opt` run beside it. Both tools start the
same way, `python -c "from TOOL import main; main()"` with this interpreter.

- `--ir`: the Top IR to run (default: `toptpu compile --dump-ir` of the tiny default model,
  qwen2 with one layer, seq 64: its `block/00-import.mlir`, written to a temporary directory).
- `--bytecode`: `cached` (every module's bytecode written once and read back, as for any
  installed package: a private `PYTHONPYCACHEPREFIX`), `off` (toptpu's own modules compiled
  from source at each start, the installed packages' read from their bytecode: an editable
  checkout under `PYTHONDONTWRITEBYTECODE=1`, as on the hosts the issue was measured on; a
  `__pycache__` some other run left in a checkout is not read), or both.
- `--baseline`: another venv's python (main before a change); the same commands with its
  toptpu run interleaved, in more rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

XDSL_OPT = "import sys; from xdsl.tools.xdsl_opt import main; sys.exit(main())"
TOPTPU_OPT = "import sys; from toptpu.opt import main; sys.exit(main())"
#: prefixed to both tools' start in `--bytecode off`: toptpu's modules compiled from their
#: source, whatever `__pycache__` lies beside them
FROM_SOURCE = """\
import importlib._bootstrap_external as _be
_get_code = _be.SourceLoader.get_code
def _from_source(self, fullname):
    if fullname == "toptpu" or fullname.startswith("toptpu."):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)
    return _get_code(self, fullname)
_be.SourceLoader.get_code = _from_source
"""
REFERENCE = "xdsl-opt empty module"


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one run of `cmd` (its exit status must be 0), from the root
    directory: `python -c` puts the working directory first on sys.path, and a checkout's
    `toptpu/` folder there would shadow the interpreter's own toptpu."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            cwd="/")
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {err.decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def _cases(py: str, ir: str, who: str, mode: str) -> dict[str, list[str]]:
    opt = _launcher(TOPTPU_OPT, mode)
    return {f"toptpu-opt -p top-pipeline ({who})": [py, "-c", opt, ir, "-p", "top-pipeline",
                                                     "-o", os.devnull],
            f"toptpu-opt --help ({who})": [py, "-c", opt, "--help"]}


def _launcher(code: str, mode: str) -> str:
    return FROM_SOURCE + code if mode == "off" else code


def _env(mode: str, cache: str) -> dict[str, str]:
    env = dict(os.environ)
    if mode == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = cache
    else:
        env.pop("PYTHONPYCACHEPREFIX", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _dump_tiny_layer(directory: str) -> str:
    """`toptpu compile --dump-ir` of the tiny default model: its block net's Top IR."""
    from toptpu.cli import main
    from toptpu.frontends.tiny_models import save_tiny_model

    model = os.path.join(directory, "model")
    save_tiny_model(model, "qwen2", layers=1)
    dump = os.path.join(directory, "ir")
    status = main(["compile", model, "-q", "w4bf16", "--seq-length", "64", "--prefill-lengths",
                   "64", "-o", os.path.join(directory, "m.toptpu"), "--dump-ir", dump,
                   "--quiet"])
    assert status == 0, f"toptpu compile exited {status}"
    return os.path.join(dump, "block", "00-import.mlir")


def measure(cases: dict[str, list[str]], env: dict[str, str], repeat: int
            ) -> dict[str, list[tuple[float, float]]]:
    for cmd in cases.values():  # warm-up: bytecode written, files in the page cache
        _run(cmd, env)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, cmd in cases.items():
            runs[name].append(_run(cmd, env))
    return runs


def report(runs: dict[str, list[tuple[float, float]]]) -> None:
    ref = runs[REFERENCE]
    print(f"  {'command':<46} {'wall s':>7} {'cpu s':>7} {'wall/xdsl':>10} {'cpu/xdsl':>9}")
    for name, rs in runs.items():
        wall = statistics.median(w for w, _ in rs)
        cpu = statistics.median(c for _, c in rs)
        r_wall = statistics.median(w / rw for (w, _), (rw, _) in zip(rs, ref, strict=True))
        r_cpu = statistics.median(c / rc for (_, c), (_, rc) in zip(rs, ref, strict=True))
        print(f"  {name:<46} {wall:>7.3f} {cpu:>7.3f} {r_wall:>9.2f}x {r_cpu:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--ir", help="the Top IR file to run top-pipeline on")
    ap.add_argument("--baseline", metavar="PYTHON",
                    help="another venv's python (its toptpu) to time alongside")
    ap.add_argument("--bytecode", choices=("cached", "off", "both"), default="both")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ir = args.ir or _dump_tiny_layer(d)
        empty = os.path.join(d, "empty.mlir")
        with open(empty, "w") as f:
            f.write("builtin.module {\n}\n")
        print(f"one layer's Top IR: {ir} ({os.path.getsize(ir)} bytes); {args.repeat} runs "
              "each, medians; ratios run by run to the xdsl-opt run beside it")
        for mode in (("cached", "off") if args.bytecode == "both" else (args.bytecode,)):
            cases = {"python -c pass": [sys.executable, "-c", "pass"],
                     REFERENCE: [sys.executable, "-c", _launcher(XDSL_OPT, mode), empty]}
            cases.update(_cases(sys.executable, ir, "this", mode))
            if args.baseline:
                cases.update(_cases(args.baseline, ir, "baseline", mode))
            print(f"bytecode {mode}:")
            report(measure(cases, _env(mode, os.path.join(d, "pycache")), args.repeat))


if __name__ == "__main__":
    main()
