"""The reference machine on a Qwen2.5-0.5B-shaped decoder layer (random weights).

For prefill (`block`, 512 tokens) and decode (`block_cache`, 1024 cached tokens), in one
quantization mode, this prints — all measured side by side in this one run:

- modelled time and the roofline bound (max of the net's own bytes over DDR bandwidth and
  its FLOPs over peak), and their ratio;
- DDR bytes moved with layer grouping vs one op per group (ratio);
- host wall time of the machine vs the Tpu interpreter on the same inputs (ratio), and
  that their outputs agree.

Run: python bench/machine.py [--mode w4bf16] [--chip bm1684x]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from toptpu.backend.contract import StaticShapes
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.profile import profile_timeline
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.llm import split_model
from toptpu.frontends.tiny_models import qwen25_05b_config
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--chip", default="bm1684x")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--cached", type=int, default=1024)
    a = ap.parse_args()
    chip = get_chip(a.chip)
    cfg = qwen25_05b_config(1, vocab_size=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    specs = {s.name: s for s in split_model(
        model, StaticShapes.make(a.cached, a.prefill, a.cached))}
    print(f"Qwen2.5-0.5B-shaped layer, {a.mode}, chip {chip.name}")
    print(f"{'net':<12} {'model us':>9} {'roof us':>8} {'roof/model':>10} {'DDR MB':>8} "
          f"{'1-op MB':>8} {'bytes ratio':>11} {'machine s':>9} {'interp s':>8} "
          f"{'wall ratio':>10} {'cos':>9}")
    for name in ("block", "block_cache"):
        spec = specs[name]
        module, store = import_module(spec.module, spec.args, input_names=spec.input_names,
                                      output_names=spec.output_names)
        run_passes(module, top_pipeline_passes(), store=store)
        run_passes(module, tpu_pipeline_passes(a.mode), store=store)
        feeds = {n: t.numpy() for n, t in zip(spec.input_names, spec.args, strict=True)}
        grouped, single = module.clone(), module.clone()
        t = time.perf_counter()
        ref = Interpreter(module, store).run(feeds).outputs
        t_interp = time.perf_counter() - t
        prog = compile_for_machine(grouped, chip)
        prog1 = compile_for_machine(single, chip, max_ops=1)
        t = time.perf_counter()
        res = simulate(prog, store, feeds, chip, checked=False)
        t_machine = time.perf_counter() - t
        res1 = simulate(prog1, store, feeds, chip, checked=False)
        prof = profile_timeline(res.timeline, chip, prog.inherent_bytes(), prog.flops)
        cos = min(similarity(res.outputs[k].astype(np.float32),
                             ref[k].astype(np.float32)).cosine for k in ref)
        us = 1e6 / (chip.freq_ghz * 1e9)
        print(f"{name:<12} {prof.cycles * us:9.1f} {prof.roofline_cycles * us:8.1f} "
              f"{prof.roofline_ratio:10.3f} {res.timeline.dma_bytes / 1e6:8.2f} "
              f"{res1.timeline.dma_bytes / 1e6:8.2f} "
              f"{res.timeline.dma_bytes / res1.timeline.dma_bytes:11.3f} {t_machine:9.2f} "
              f"{t_interp:8.2f} {t_machine / t_interp:10.2f} {cos:9.6f}")


if __name__ == "__main__":
    main()
