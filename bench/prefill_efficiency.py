"""Modelled prefill over the prompt length L: how close to the compute roofline, and the time
to first token of a full-length prompt, beside the published figures.

For each model shape (Qwen2.5-0.5B, -7B, -14B; random weights: only the shapes matter), chip
and L, the nets of a first token are compiled as `toptpu estimate` compiles them (one
layer, w4bf16, group 64) at `--seq-length L --max-input-length L` (LLM-TPU compiles its
prefill at max_input_length = seq: its published first-token latencies are full-length
prefills), and timed by the chip model:

- `block ms`: one layer's prefill net (`block`), modelled;
- `eff`: its efficiency, the compute-roofline time of its FLOPs (each compute command's
  FLOPs over the sustained throughput of its type: peak x `compute_efficiency`, the
  chip's fitted figure) over its modelled time; 1.0 is compute bound with the DMA hidden;
- `peak`: the same against the peak throughput (eff x compute_efficiency);
- `ttft s`: modelled time to first token of an L-token prompt (every layer's block, the
  embedding, lm_head and greedy head, launches and host transfers: the step accounting);
- `published`: the first-token latency Sophgo publishes for that model shape, chip and
  seq (bench/calibration/bm168x_published.csv and LLM-TPU's README), where there is one.

The compiles take minutes (the 14B at L = 2048 on bm1688 the longest); `--quick` runs
the 7B on bm1684x only.

Run: python bench/prefill_efficiency.py [--quick] [--lengths 512 1024 2048]
"""

from __future__ import annotations

import argparse
import sys
import time

from toptpu.backend.contract import BLOCK, EMBEDDING, GREEDY_HEAD, LM_HEAD, StaticShapes
from toptpu.backend.runtime.accounting import StepModel
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.backend.target.cost import CommandCost, net_timing
from toptpu.dialects.common import QuantMode
from toptpu.estimate import compile_costs
from toptpu.frontends.tiny_models import qwen25_05b_config
from toptpu.request import CompileRequest

#: the public shapes (transformers' configs of the Qwen2.5 checkpoints)
MODELS = {
    "Qwen2.5-0.5B": dict(layers=24),
    "Qwen2.5-1.5B": dict(layers=28, hidden_size=1536, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960),
    "Qwen2.5-7B": dict(layers=28, hidden_size=3584, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False),
    "Qwen2.5-14B": dict(layers=48, hidden_size=5120, num_attention_heads=40,
                        num_key_value_heads=8, intermediate_size=13824, vocab_size=152064,
                        tie_word_embeddings=False),
}

#: published first-token latencies of these shapes, w4bf16 (model, chip, seq) -> (s, source)
PUBLISHED = {
    ("Qwen2.5-7B", "bm1684x", 2048): [
        (2.70, "sophon-demo Qwen2.5-7B"), (2.94, "LLM-TPU R1-Distill-Qwen-7B")],
    ("Qwen2.5-7B", "bm1688", 1024): [(10.6, "sophon-demo R1-Distill-Qwen-7B, 2 cores")],
    ("Qwen2.5-1.5B", "bm1684x", 8192): [(5.43, "LLM-TPU R1-Distill-Qwen-1.5B")],
}

#: the extra rows of the published figures outside the L sweep
EXTRA = [("Qwen2.5-1.5B", "bm1684x", 8192)]


def roofline_cycles(commands: list[CommandCost], chip: Chip) -> float:
    """Cycles of the net's FLOPs at the sustained throughput of each one's type."""
    return sum(c.flops / (chip.flops_per_cycle(c.dtype) * chip.compute_efficiency)
               for c in commands if not c.dma)


def row(model: str, chip_name: str, length: int) -> str:
    kw = dict(MODELS[model])
    layers = kw.pop("layers")
    config = qwen25_05b_config(layers=layers, **kw)
    chip = get_chip(chip_name)
    t0 = time.perf_counter()
    request = CompileRequest(mode=QuantMode.W4BF16, chip=chip,
                             shapes=StaticShapes.make(length, length))
    compiled = compile_costs(config, request, nets=(EMBEDDING, BLOCK, LM_HEAD, GREEDY_HEAD))
    compile_s = time.perf_counter() - t0
    block = compiled.commands[BLOCK]
    timing = net_timing(block, chip)
    eff = roofline_cycles(block, chip) / timing.cycles
    steps = StepModel(chip, compiled.io(), compiled.timings(chip), layers)
    ttft = steps.first_token(length, "greedy").total_s
    pub = PUBLISHED.get((model, chip_name, length), [])
    published = "; ".join(f"{s:.2f} s ({src}, model/published {ttft / s:.2f})"
                          for s, src in pub) or "-"
    return (f"| {model} | {chip_name} | {length} | {timing.seconds(chip) * 1e3:.2f} | "
            f"{eff:.3f} | {eff * chip.compute_efficiency:.3f} | {ttft:.3f} | {published} | "
            f"{compile_s:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--quick", action="store_true", help="the 7B on bm1684x only")
    a = ap.parse_args()
    models = ["Qwen2.5-7B"] if a.quick else ["Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen2.5-14B"]
    chips = ["bm1684x"] if a.quick else ["bm1684x", "bm1688"]
    print("modelled prefill, w4bf16, seq = max-input-length = L (a full-length prompt)")
    print("| model | chip | L | block ms | eff | peak | ttft s | published FTL | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for chip in chips:
            for length in a.lengths:
                print(row(model, chip, length), flush=True)
    if not a.quick:
        for model, chip, length in EXTRA:
            print(row(model, chip, length), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
