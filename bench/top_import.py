"""Import and Top-pipeline time for a 24-layer Qwen2.5-0.5B-shaped model (random weights).

Import (torch.export + FX walk + weight store) and the Top pipeline are timed separately;
the pipeline's passes are timed one by one. Shapes are Qwen2.5-0.5B's public config.
Run: python bench/top_import.py [--layers 24] [--seq 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2ForCausalLM

from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.hf_layers import DecoderStack, causal_mask
from toptpu.frontends.tiny_models import qwen25_05b_config
from toptpu.passes.pipelines import run_passes, top_pipeline_passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    cfg = qwen25_05b_config(a.layers)
    torch.manual_seed(0)
    t = time.perf_counter()
    model = Qwen2ForCausalLM(cfg).eval()
    print(f"built model: {time.perf_counter() - t:.1f}s, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq))
    pos = torch.arange(a.seq)[None]
    t = time.perf_counter()
    module, store = import_module(DecoderStack(model), (ids, pos, causal_mask(a.seq)),
                                  input_names=["input_ids", "position_ids", "attention_mask"],
                                  output_names=["logits"])
    t_import = time.perf_counter() - t
    n_before = sum(1 for _ in module.walk())
    times: list[tuple[str, float]] = []
    last = [time.perf_counter()]

    def after(p, m) -> None:  # noqa: ANN001
        now = time.perf_counter()
        times.append((p.name, now - last[0]))
        last[0] = now

    t = time.perf_counter()
    run_passes(module, top_pipeline_passes(), after=after, store=store)
    t_passes = time.perf_counter() - t
    n_after = sum(1 for _ in module.walk())
    print(f"import: {t_import:.1f}s ({n_before} ops, {len(store)} weights)")
    print(f"top-pipeline: {t_passes:.1f}s ({n_after} ops after)")
    for name, dt in times:
        print(f"  {name:<14} {dt:.2f}s")


if __name__ == "__main__":
    main()
