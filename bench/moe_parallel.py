"""Modelled decode time of a token of a MoE model over several BM1684X: one chip, pipeline
parallel and expert parallel (`toptpu.expert_parallel`: attention and router replicated,
E/N experts a chip, the [1, H] partial sums all-reduced after every layer's experts), from
the model's widths alone (bf16 weights; a decode step is bound by the weight bytes each chip
reads from DDR, plus the link's collectives).

Two cases: every expert a chip holds moves each step (today's machine: no indexed fetch),
and only the chosen ones (the indexed fetch; a chip's share of the k choices spread evenly).

Run: python bench/moe_parallel.py [--chip bm1684x] [--devices 2,4,8]
"""

from __future__ import annotations

import argparse

from toptpu.backend.target.chips import get_chip
from toptpu.expert_parallel import ExpertParallelLayer, token_table

#: widths (hidden, heads, kv heads, head dim, experts, top-k, expert intermediate, layers,
#: vocabulary) of the published configs
MODELS = {
    "Qwen3-30B-A3B": (2048, 32, 4, 128, 128, 8, 768, 48, 151936),
    "Qwen3.5-35B-A3B widths": (2048, 16, 2, 256, 256, 8, 512, 40, 248320),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="bm1684x")
    ap.add_argument("--devices", default="2,4,8")
    args = ap.parse_args()
    chip = get_chip(args.chip)
    counts = [int(n) for n in args.devices.split(",")]
    print(f"{chip.name}: sustained DDR {chip.sustained_gbps:.1f} GB/s, link "
          f"{chip.link_gbps} GB/s + {chip.link_latency_us} us a step; bf16 weights\n")
    print("| model | experts move | strategy | chips | ms / token | of which link ms "
          "| link bytes / token | weights GB on the fullest chip |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (h, q, kv, d, e, k, i, layers, vocab) in MODELS.items():
        dense = 2 * (h * q * d * 2 + h * kv * d * 2 + e * h + 2 * h + 2 * d)
        for every in (True, False):
            layer = ExpertParallelLayer(e, k, 3 * i * h * 2, dense, h, 2, 1,
                                        all_experts_move=every)
            head = vocab * h * 2
            for t in token_table(chip, layer, layers, head, counts):
                n = t.devices
                experts = e * 3 * i * h * 2
                if t.strategy == "ep":  # every layer's dense part, E/N experts, embeddings
                    held = layers * (dense + experts // n) + 2 * head
                else:  # one chip, or pp's stages: the layers over N (and the embeddings)
                    held = -(-layers // n) * (dense + experts) + 2 * head
                over = " (over its memory)" if held > chip.ddr_bytes else ""
                print(f"| {name} | {'all' if every else 'chosen'} | {t.strategy} "
                      f"| {n} | {t.seconds * 1e3:.2f} | {t.link_seconds * 1e3:.2f} "
                      f"| {t.link_bytes} | {held / 1e9:.1f}{over} |")


if __name__ == "__main__":
    main()
