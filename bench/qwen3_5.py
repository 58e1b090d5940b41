"""Qwen3.5-2B/4B/9B on BM1684X and BM1688: `toptpu estimate` from the published text configs
(bench/configs), w4bf16, seq 2048, a 1024-token prefill chunk (as LLM-TPU compiles them).

For each config and chip: the step nets compiled once (one layer of each kind, placeholder
weights), timed by the chip model; printed: the modelled time to first token (a prompt of
one full chunk), decode tokens/s, the weights, the KV cache of the full-attention layers,
the state of the linear-attention layers, and the bytes a decode step moves: the state
read and written in place by every linear layer, the KV cache the static decode net of
every full layer reads (all SEQ positions), and everything the step's nets move. The
numbers are the chip model's, not a board's (docs/estimates.md says how it is calibrated).
A chip that cannot hold a net at the asked shapes is tried again at half the sequence and
chunk (`--fallback`), and its row says which shapes it got and why.

Run: python bench/qwen3_5.py [--sizes 2B,4B,9B] [--chips bm1684x,bm1688] [--seq 2048]
         [--max-input-length 1024] [--mode w4bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from toptpu.backend.contract import FULL_ATTENTION, LINEAR_ATTENTION
from toptpu.backend.target.chips import get_chip
from toptpu.errors import CompileError
from toptpu.estimate import STEP_NETS, compile_costs, estimate, read_checked_config
from toptpu.request import CompileRequest

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2B,4B,9B")
    ap.add_argument("--chips", default="bm1684x,bm1688")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--max-input-length", type=int, default=1024)
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--fallback", type=int, default=1,
                    help="how many times to halve seq and chunk on a chip that cannot hold "
                    "a net")
    args = ap.parse_args()
    rows = []
    notes = []
    for size in args.sizes.split(","):
        config_dir = os.path.join(CONFIGS, f"qwen3.5-{size}")
        for chip_name in args.chips.split(","):
            chip = get_chip(chip_name)
            seq, chunk = args.seq, args.max_input_length
            for attempt in range(args.fallback + 1):
                t = time.perf_counter()
                load = os.getloadavg()[0]
                request = CompileRequest.make(mode=args.mode, chip=chip, seq_length=seq,
                                              max_input_length=chunk)
                config = read_checked_config(config_dir, request)
                try:
                    costs = compile_costs(config, request, nets=STEP_NETS)
                except CompileError as e:
                    notes.append(f"Qwen3.5-{size} on {chip_name} at seq {seq}, input {chunk}: "
                                 f"{e}")
                    print(notes[-1], file=sys.stderr, flush=True)
                    if attempt == args.fallback:
                        break
                    seq, chunk = seq // 2, chunk // 2
                    continue
                est = estimate(costs, chip)
                print(f"qwen3.5-{size} on {chip_name}: compiled and estimated in "
                      f"{time.perf_counter() - t:.0f}s (load average {load:.1f} before)",
                      file=sys.stderr, flush=True)
                rows.append((size, chip_name, costs, est))
                break
    print(f"\n{args.mode}: modelled by the chip model from the published Qwen3.5 text "
          "configs; TTFT for a prompt of one full chunk\n")
    print("| model | chip | seq / input | TTFT ms | decode tok/s | weights GB "
          "| KV cache MB (layers) | state MB (layers) | per decode step: state read+written "
          "MB | KV read MB | all moved MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, chip_name, costs, est in rows:
        m = costs.model
        n_full, n_lin = m.layers_of(FULL_ATTENTION), m.layers_of(LINEAR_ATTENTION)
        s = costs.shapes
        print(f"| Qwen3.5-{size} | {chip_name} | {s.seq_length} / {s.max_input_length} "
              f"| {est.ttft_s * 1e3:.0f} "
              f"| {est.tokens_per_s:.2f} | {costs.weight_bytes / 1e9:.2f} "
              f"| {costs.kv_bytes / 1e6:.1f} ({n_full}) | {costs.state_bytes / 1e6:.1f} "
              f"({n_lin}) | {2 * costs.state_bytes / 1e6:.1f} | {costs.kv_bytes / 1e6:.1f} "
              f"| {est.per_token.dma_bytes / 1e6:.0f} |")
    for note in notes:
        print(f"\n- not compiled: {note}")


if __name__ == "__main__":
    main()
