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
    (`phase` labels what runs now): the RSS on entering each phase and its peak inside."""

    def __init__(self) -> None:
        self.label = "start"
        self.rows: list[dict[str, Any]] = []
        self._open("start")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _open(self, label: str) -> None:
        now = rss_mb()
        self.rows.append({"phase": label, "enter_mb": now, "peak_mb": now,
                          "t": time.perf_counter()})

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            row = self.rows[-1]
            row["peak_mb"] = max(row["peak_mb"], rss_mb())

    def phase(self, label: str) -> None:
        row = self.rows[-1]
        row["peak_mb"] = max(row["peak_mb"], rss_mb())
        row["seconds"] = time.perf_counter() - row["t"]
        if row["phase"] != "driver" or row["peak_mb"] - row["enter_mb"] > 50:
            print(f"phase: {row['phase']:<24} enter {row['enter_mb']:6.0f} MB  peak "
                  f"{row['peak_mb']:6.0f} MB  {row['seconds']:7.1f} s", file=sys.stderr,
                  flush=True)  # as it goes: a long run shows where it is
        self._open(label)

    def close(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.thread.join()
        self.phase("end")
        return [{k: v for k, v in r.items() if k != "t"} for r in self.rows[:-1]]


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


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="calibration-7b")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="small shapes: checks the bench runs")
    a = ap.parse_args()
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
