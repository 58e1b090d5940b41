"""Peak memory and time of calibrating one 7B-shaped decoder layer (`toptpu.weight_calibration`).

A Qwen2 checkpoint with Qwen2.5-7B's layer shapes (hidden 3584, intermediate 18944, 28 query
heads, 4 KV heads of 128) and random weights, `--layers` layers deep and a small vocabulary
(the layer is what calibration holds; the embedding's rows of the calibration tokens are
all it reads of the embedding), is written in bf16 and calibrated by GPTQ (or AWQ) in a
child process of its own on `--samples` x `--seq-length` tokens; the child reports its peak
RSS (`ru_maxrss`) and the time per layer. The layer is the unit of the memory bound: a
deeper model of the same shapes holds one layer at a time (the hidden states of the
calibration set live in a scratch file, `weight_calibration.activations`).

Run: python bench/calibration_memory_7b.py [--work DIR] [--method gptq] [--samples 4]

`--compile`: the whole `toptpu compile -q w4bf16 --calibrate METHOD` instead (the CLI in the
child, its phases traced as above), on bench/scale.py's checkpoint of the published
Qwen2.5-7B config (152064-token vocabulary, random bf16 weights) cut to `--layers` layers,
calibrated on Python's documentation (the compile's default text) in `--samples` x
`--seq-length` tokens; `--iterations N` SignRound's steps per layer (its tuning CPU is
reported per step). Printed: peak RSS of the child (`ru_maxrss`), CPU and wall seconds per
layer, and the compile's own. `--rss-cap GB` stops the child (exit 3, the phase named) when
its resident set passes the cap (a measurement above a limit, without eating the host).

     python bench/calibration_memory_7b.py --compile --method signround --layers 1 \
         --samples 8 --iterations 3
     python bench/calibration_memory_7b.py --compile --method gptq --layers 2 --samples 8
     python bench/calibration_memory_7b.py --compile --method awq --layers 1 --samples 8 \
         --rss-cap 6
     python bench/calibration_memory_7b.py --compile --method gptaq --layers 1 --samples 8 \
         --rss-cap 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

#: Qwen2.5-7B's layer shapes
SHAPES: dict[str, Any] = {"hidden_size": 3584, "intermediate_size": 18944,
                          "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128}


#: a smoke test of the bench itself (`--tiny`)
TINY: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def write_checkpoint(path: str, layers: int, vocab: int, shapes: dict[str, Any]) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=vocab, num_hidden_layers=layers,
                            max_position_embeddings=4096, tie_word_embeddings=False,
                            **shapes)
    model: Any = tf.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))  # a checkpoint carries one


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PhaseTrace:
    """The resident set sampled every 20 ms by a thread, per phase of the calibration
    (`phase` labels what runs now): the RSS on entering each phase and its peak inside, and
    the process's CPU seconds on entering it. Above `cap_mb` (None: no cap) the process
    stops at once (exit 3), naming the phase."""

    def __init__(self, cap_mb: float | None = None) -> None:
        self.label = "start"
        self.cap_mb = cap_mb
        self.rows: list[dict[str, Any]] = []
        self._open("start")
        #: SignRound: (CPU, wall) seconds of each tuning step
        self.steps: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _open(self, label: str) -> None:
        now = rss_mb()
        self.rows.append({"phase": label, "enter_mb": now, "peak_mb": now,
                          "t": time.perf_counter(), "cpu": time.process_time()})

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            row = self.rows[-1]
            now = rss_mb()
            row["peak_mb"] = max(row["peak_mb"], now)
            if self.cap_mb is not None and now > self.cap_mb:
                print(f"RSS {now:.0f} MB above the cap of {self.cap_mb:.0f} MB in phase "
                      f"'{row['phase']}' ({time.perf_counter() - row['t']:.0f} s into it): "
                      "stopped", file=sys.stderr, flush=True)
                os._exit(3)

    def phase(self, label: str) -> None:
        row = self.rows[-1]
        row["peak_mb"] = max(row["peak_mb"], rss_mb())
        row["seconds"] = time.perf_counter() - row["t"]
        row["cpu_seconds"] = time.process_time() - row["cpu"]
        if row["phase"] != "driver" or row["peak_mb"] - row["enter_mb"] > 50:
            print(f"phase: {row['phase']:<24} enter {row['enter_mb']:6.0f} MB  peak "
                  f"{row['peak_mb']:6.0f} MB  {row['seconds']:7.1f} s "
                  f"({row['cpu_seconds']:.1f} s CPU)", file=sys.stderr,
                  flush=True)  # as it goes: a long run shows where it is
        self._open(label)

    def close(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.thread.join()
        self.phase("end")
        return [{k: v for k, v in r.items() if k not in ("t", "cpu")} for r in self.rows[:-1]]


def traced(trace: PhaseTrace) -> None:
    """Label the calibration's phases: wrap the driver's steps (per layer: loading, each GPTQ
    stage's Hessian, its factor, each linear's GPTQ, the quantized layer's run, the shard)."""
    from toptpu.weight_calibration import sequential as seq

    def wrap(name: str, label: Any) -> None:
        inner = getattr(seq, name)

        def outer(*args: Any, **kw: Any) -> Any:
            trace.phase(label(*args, **kw) if callable(label) else label)
            try:
                return inner(*args, **kw)
            finally:
                trace.phase("driver")

        setattr(seq, name, outer)

    layer = seq.StreamedLayers.layer

    def loading(self: Any, index: int) -> Any:
        trace.phase("loading the layer")
        try:
            return layer(self, index)
        finally:
            trace.phase("driver")

    seq.StreamedLayers.layer = loading  # type: ignore[method-assign]
    wrap("_stage_hessian", lambda runner, first, *a, **k: f"hessian ({first.in_features})")
    wrap("prepare_hessian", "factor")
    wrap("gptq", lambda w, *a, **k: f"gptq {list(w.shape)}")
    wrap("layer_outputs", "layer outputs")
    wrap("layer_tensors", "shard tensors")
    wrap("awq_layer", "awq search")
    wrap("_gptaq_stage", lambda runner, twin, first, *a, **k: f"gptaq sums ({first})")
    wrap("asymmetry_term", "gptaq P")
    wrap("_cross_rows", "gptaq dXX^T rows")
    wrap("asymmetry_rows", "gptaq P rows")
    tune = seq.tune_layer

    def tuning(*args: Any, on_iteration: Any = None, **kw: Any) -> Any:
        """SignRound's tuning, its CPU seconds per step recorded (`steps`)."""
        trace.phase("signround tuning")
        last = [time.process_time(), time.perf_counter()]

        def step(i: int) -> None:
            now = [time.process_time(), time.perf_counter()]
            trace.steps.append((now[0] - last[0], now[1] - last[1]))
            last[:] = now
            if on_iteration is not None:
                on_iteration(i)

        try:
            return tune(*args, on_iteration=step, **kw)
        finally:
            trace.phase("driver")

    seq.tune_layer = tuning  # type: ignore[assignment]


def child(spec: str) -> None:
    import numpy as np

    from toptpu.weight_calibration import (
        CalibrationData,
        CalibrationRequest,
        QuantScheme,
        calibrate,
    )

    kw = json.loads(spec)
    trace = PhaseTrace()
    traced(trace)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, kw["vocab"], (kw["samples"], kw["seq_length"]))
    trace.phase("driver")
    t = time.perf_counter()
    rep = calibrate(kw["model"], kw["output"],
                    CalibrationRequest(kw["method"], QuantScheme(4, 128, False)),
                    CalibrationData(tokens, ("random tokens",)), progress=sys.stderr)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "layer_seconds": rep.layer_seconds,
                      "cpu_seconds": time.process_time(), "phases": trace.close(),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def compile_child(spec: str) -> None:
    """`toptpu compile` (the CLI, in this process) with the calibration's phases traced; one
    JSON line on stdout: the per-layer CPU and wall seconds (from each layer's loading to the
    next's; the last to the end of the calibration), SignRound's steps, the phases."""
    from toptpu import cli, compiler

    kw = json.loads(spec)
    trace = PhaseTrace(kw["cap_mb"])
    traced(trace)
    inner = compiler.calibrate
    marks: dict[str, float] = {}

    def calibrate(*args: Any, **k: Any) -> Any:
        marks["cpu0"], marks["wall0"] = time.process_time(), time.perf_counter()
        try:
            return inner(*args, **k)
        finally:
            marks["cpu1"], marks["wall1"] = time.process_time(), time.perf_counter()
            trace.phase("compile (after calibration)")

    compiler.calibrate = calibrate  # type: ignore[assignment]
    rc = cli.main(kw["argv"])
    if rc:
        raise SystemExit(rc)
    phases = trace.close()
    loads = [r for r in phases if r["phase"] == "loading the layer"]
    print(json.dumps({"phases": phases, "steps": trace.steps, "marks": marks,
                      "layers": len(loads),
                      "cpu_seconds": time.process_time(),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def per_layer(phases: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(CPU, wall) seconds of each layer: from its loading to the next layer's loading (the
    last: to the end of the calibration)."""
    out: list[tuple[float, float]] = []
    for row in phases:
        if row["phase"] == "loading the layer":
            out.append((0.0, 0.0))
        if row["phase"].startswith("compile (after"):
            break
        if out:
            out[-1] = (out[-1][0] + row.get("cpu_seconds", 0.0),
                       out[-1][1] + row.get("seconds", 0.0))
    return out


def run_compile(a: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import scale

    os.makedirs(a.work, exist_ok=True)
    ckpt = os.path.join(a.work, f"qwen2.5-7B-{a.layers}l")
    config = scale.model_config("7B")
    config.num_hidden_layers = a.layers
    if getattr(config, "layer_types", None):  # as bench/scale.py cuts it
        config.layer_types = config.layer_types[:a.layers]
    t = time.perf_counter()
    scale.write_checkpoint(ckpt, config)
    print(f"checkpoint {ckpt} ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    out = os.path.join(a.work, f"{a.method}-{a.layers}l.toptpu")
    argv = ["compile", ckpt, "-o", out, "-q", a.mode, "--calibrate", a.method,
            "--calibration-samples", str(a.samples),
            "--calibration-seq-length", str(a.seq_length)]
    if a.iterations is not None:
        argv += ["--calibration-iterations", str(a.iterations)]
    spec = {"argv": argv, "cap_mb": None if a.rss_cap is None else a.rss_cap * 1024}
    load = os.getloadavg()[0]
    t = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--compile-child", json.dumps(spec)],
                         stdout=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - t
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_gb = usage.ru_maxrss / 2**20
    cpu = usage.ru_utime + usage.ru_stime
    if os.path.exists(out):
        os.unlink(out)
    # a child stopped at the cap leaves the compile's calibration directory behind
    import glob

    for left in glob.glob(os.path.join(a.work, f".{os.path.basename(out)}.calibrating-*")):
        shutil.rmtree(left, ignore_errors=True)
    what = (f"{a.method}, {a.layers} layer(s) of Qwen2.5-7B (published config), {a.samples} x "
            f"{a.seq_length} tokens" + (f", {a.iterations} steps" if a.iterations else ""))
    if res.returncode:
        print(f"{what}: the child stopped (exit {res.returncode}) after {wall:.0f} s, "
              f"{cpu:.0f} s CPU; peak RSS {peak_gb:.2f} GiB (load {load:.1f} before)")
        raise SystemExit(res.returncode)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    for row in m["phases"]:
        if row["phase"] != "driver" or row["peak_mb"] - row["enter_mb"] > 50:
            print(f"  {row['phase']:<28} enter {row['enter_mb']:6.0f} MB  peak "
                  f"{row['peak_mb']:6.0f} MB  {row.get('seconds', 0):7.1f} s  "
                  f"{row.get('cpu_seconds', 0):7.1f} s CPU")
    layers = per_layer(m["phases"])
    mk = m["marks"]
    print(f"{what}: peak RSS {peak_gb:.2f} GiB ({peak_gb * 1.073741824:.2f} GB); "
          f"{cpu:.0f} s CPU and {wall:.0f} s wall in all (load {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after); calibration {mk['cpu1'] - mk['cpu0']:.0f} s CPU, "
          f"{mk['wall1'] - mk['wall0']:.0f} s wall")
    for i, (c, w) in enumerate(layers):
        print(f"  layer {i}: {c:.1f} s CPU, {w:.1f} s wall")
    if m["steps"]:
        cpus = [c for c, _ in m["steps"]]
        walls = [w for _, w in m["steps"]]
        print(f"  signround: {len(cpus)} steps, {sum(cpus) / len(cpus):.1f} s CPU a step "
              f"(min {min(cpus):.1f}, max {max(cpus):.1f}), {sum(walls) / len(walls):.1f} s "
              "wall a step")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "--compile-child":
        compile_child(sys.argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="calibration-7b")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="small shapes: checks the bench runs")
    ap.add_argument("--compile", action="store_true",
                    help="the whole `toptpu compile --calibrate` on the published 7B config")
    ap.add_argument("--mode", default="w4bf16", help="--compile: the mode")
    ap.add_argument("--iterations", type=int, default=None,
                    help="--compile --method signround: steps per layer")
    ap.add_argument("--rss-cap", type=float, default=None,
                    help="GiB: stop the child when its RSS passes it")
    a = ap.parse_args()
    if a.compile:
        run_compile(a)
        return
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, f"qwen2-{'tiny' if a.tiny else '7b-shaped'}-{a.layers}l")
    if not os.path.exists(os.path.join(model, "tokenizer.json")):
        write_checkpoint(model, a.layers, a.vocab, TINY if a.tiny else SHAPES)
    out = os.path.join(a.work, f"{a.method}-{a.samples}x{a.seq_length}")
    shutil.rmtree(out, ignore_errors=True)  # the calibrated copy of an earlier run
    spec = {"model": model, "output": out, "method": a.method, "vocab": a.vocab,
            "samples": a.samples, "seq_length": a.seq_length}
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         stdout=subprocess.PIPE, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    per_layer = sum(m["layer_seconds"]) / len(m["layer_seconds"])
    for row in m["phases"]:
        if row["phase"] != "driver" or row["peak_mb"] - row["enter_mb"] > 50:
            print(f"  {row['phase']:<24} enter {row['enter_mb']:6.0f} MB  peak "
                  f"{row['peak_mb']:6.0f} MB  {row.get('seconds', 0):7.1f} s")
    print(f"{a.method}, {a.layers} layer(s) of Qwen2.5-7B's shapes, {a.samples} x "
          f"{a.seq_length} tokens: peak RSS {m['peak_rss_mb']:.0f} MB, {per_layer:.0f} s a "
          f"layer, {m['seconds']:.0f} s in all ({m['cpu_seconds']:.0f} s CPU)")


if __name__ == "__main__":
    main()
