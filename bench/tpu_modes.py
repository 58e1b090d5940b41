"""Similarity per quantization mode and weight-store size per mode, for a Qwen2.5-0.5B-shaped
model (24 layers, random weights) — the numbers of the Tpu-lowering closing note.

For each mode the whole model (embedding -> 24 layers -> norm -> lm_head logits, one static
sequence) is lowered with tpu-pipeline and run by the Tpu interpreter on the same input as
the Top f32 module; printed: cosine / euclidean / SQNR of the logits against Top and the
bytes of the weights the Tpu module references.
Run: python bench/tpu_modes.py [--layers 24] [--seq 16] [--modes f32,bf16,...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.dialects import tpu
from toptpu.dialects.common import QuantMode
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.hf_layers import DecoderStack
from toptpu.frontends.tiny_models import qwen25_05b_config
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--modes", default=",".join(QuantMode.names()))
    a = ap.parse_args()
    cfg = qwen25_05b_config(a.layers)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=g)
    pos = torch.arange(a.seq)[None]
    mask = torch.triu(torch.full((a.seq, a.seq), -10000.0), 1)[None, None]
    module, store = import_module(DecoderStack(model), (ids, pos, mask),
                                  input_names=["input_ids", "position_ids", "attention_mask"],
                                  output_names=["logits"])
    run_passes(module, top_pipeline_passes(), store=store)
    feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "attention_mask": mask.numpy()}
    ref = Interpreter(module, store).run(feeds).outputs["logits"]
    print(f"Qwen2.5-0.5B-shaped, {a.layers} layers, seq {a.seq}: logits vs Top f32")
    print(f"{'mode':<8} {'cosine':>9} {'euclid':>8} {'sqnr dB':>8} {'weights MB':>11} "
          f"{'lower s':>8}")
    for mode in a.modes.split(","):
        m = module.clone()
        t = time.perf_counter()
        run_passes(m, tpu_pipeline_passes(mode), store=store)
        dt = time.perf_counter() - t
        names = {op.tensor_name for op in m.walk() if isinstance(op, tpu.WeightOp)}
        size = sum(store[n].nbytes for n in names)
        out = Interpreter(m, store).run(feeds).outputs["logits"].astype(np.float32)
        s = similarity(out, ref)
        print(f"{mode:<8} {s.cosine:9.6f} {s.euclidean:8.4f} {s.sqnr_db:8.1f} "
              f"{size / 1e6:11.1f} {dt:8.1f}")


if __name__ == "__main__":
    main()
