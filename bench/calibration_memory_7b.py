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
import subprocess
import sys
import time
from typing import Any

#: Qwen2.5-7B's layer shapes
SHAPES: dict[str, Any] = {"hidden_size": 3584, "intermediate_size": 18944,
                          "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128}


def write_checkpoint(path: str, layers: int, vocab: int) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=vocab, num_hidden_layers=layers,
                            max_position_embeddings=4096, tie_word_embeddings=False,
                            **SHAPES)
    model: Any = tf.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))  # a checkpoint carries one


def child(spec: str) -> None:
    import numpy as np

    from toptpu.weight_calibration import (
        CalibrationData,
        CalibrationRequest,
        QuantScheme,
        calibrate,
    )

    kw = json.loads(spec)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, kw["vocab"], (kw["samples"], kw["seq_length"]))
    t = time.perf_counter()
    rep = calibrate(kw["model"], kw["output"],
                    CalibrationRequest(kw["method"], QuantScheme(4, 128, False)),
                    CalibrationData(tokens, ("random tokens",)), progress=sys.stderr)
    print(json.dumps({"seconds": time.perf_counter() - t, "layer_seconds": rep.layer_seconds,
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
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, f"qwen2-7b-shaped-{a.layers}l")
    if not os.path.exists(os.path.join(model, "tokenizer.json")):
        write_checkpoint(model, a.layers, a.vocab)
    out = os.path.join(a.work, f"{a.method}-{a.samples}x{a.seq_length}")
    spec = {"model": model, "output": out, "method": a.method, "vocab": a.vocab,
            "samples": a.samples, "seq_length": a.seq_length}
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         stdout=subprocess.PIPE, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    per_layer = sum(m["layer_seconds"]) / len(m["layer_seconds"])
    print(f"{a.method}, {a.layers} layer(s) of Qwen2.5-7B's shapes, {a.samples} x "
          f"{a.seq_length} tokens: peak RSS {m['peak_rss_mb']:.0f} MB, {per_layer:.0f} s a "
          f"layer, {m['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
