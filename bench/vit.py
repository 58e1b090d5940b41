"""The `vit` net at real widths (random weights): does it compile, fit local memory and how
long is one tile on the reference machine?

- InternVL3-1B-shaped: InternViT-300M (448 px tiles, patch 14, hidden 1024, 16 heads, MLP
  4096, layer norm, layer scale), pixel shuffle 0.5, projector to hidden 896 (256 tokens);
- MiniCPM-V-shaped: SigLIP-400M width (hidden 1152, 16 heads, MLP 4304), the window-
  attention merger after layer `--insert`, the downsample MLP merger to hidden 896, at a
  448 px slice (the default patch budget: 1200 patches, 75 tokens).

For each, in one mode, it prints — measured side by side in this one run — compile time,
commands, the modelled time of one tile and its roofline bound (bytes over DDR bandwidth,
FLOPs over peak), the machine's host time, and the cosine of the machine's output against
the Tpu interpreter's. `--layers` vision layers (default 2; 24 / 27 for the whole towers:
modelled time grows linearly with them, host time too).

Run: python bench/vit.py [--mode bf16] [--layers 2] [--chip bm1684x]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.profile import profile_timeline
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.tiny_vlms import tiny_vlm, vlm_tokenizer
from toptpu.frontends.vlm import load_vlm
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--chip", default="bm1684x")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--insert", type=int, default=0, help="MiniCPM-V insert_layer_id")
    a = ap.parse_args()
    chip = get_chip(a.chip)
    text = {"hidden_size": 896}
    towers = {
        "internvl (InternViT-300M)": ("internvl", dict(
            hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
            num_hidden_layers=a.layers, image_size=448)),
        "minicpmv (SigLIP-400M)": ("minicpmv", dict(
            hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
            num_hidden_layers=a.layers, insert_layer_id=min(a.insert, a.layers - 1),
            image_size=448)),
    }
    print(f"vit nets, {a.layers} vision layers, {a.mode}, chip {chip.name}")
    print(f"{'tower':<26} {'tokens':>6} {'compile s':>9} {'commands':>8} {'model ms':>9} "
          f"{'roof ms':>8} {'roof/model':>10} {'GFLOP':>7} {'machine s':>9} {'cos':>9}")
    for label, (family, vision) in towers.items():
        vlm = tiny_vlm(family, **vision)
        loaded = load_vlm(_with_text_width(vlm, family, text), vlm_tokenizer(family))
        assert loaded.vision is not None
        spec = loaded.vision.net_spec()
        t = time.perf_counter()
        module, store = import_module(spec.module, spec.args, input_names=spec.input_names,
                                      output_names=spec.output_names)
        run_passes(module, top_pipeline_passes(), store=store)
        run_passes(module, tpu_pipeline_passes(a.mode), store=store)
        grouped = module.clone()
        prog = compile_for_machine(grouped, chip)
        t_compile = time.perf_counter() - t
        feeds = {n: x.numpy() for n, x in zip(spec.input_names, spec.args, strict=True)}
        ref = Interpreter(module, store).run(feeds).outputs["image_embeds"]
        t = time.perf_counter()
        res = simulate(prog, store, feeds, chip, checked=False)
        t_machine = time.perf_counter() - t
        prof = profile_timeline(res.timeline, chip, prog.inherent_bytes(), prog.flops)
        cos = similarity(res.outputs["image_embeds"].astype(np.float32),
                         ref.astype(np.float32)).cosine
        ms = 1e3 / (chip.freq_ghz * 1e9)
        print(f"{label:<26} {loaded.vision.tokens_per_tile:6d} {t_compile:9.1f} "
              f"{len(prog.commands):8d} {prof.cycles * ms:9.3f} {prof.roofline_cycles * ms:8.3f} "
              f"{prof.roofline_ratio:10.3f} {prog.flops / 1e9:7.1f} {t_machine:9.1f} "
              f"{cos:9.6f}")
        sys.stdout.flush()


def _with_text_width(vlm, family: str, text: dict):  # noqa: ANN001, ANN202
    """The tiny VLM's projector resized to a real text width (the text model stays tiny:
    only the vit net is compiled here)."""
    import torch

    hidden = text["hidden_size"]
    with torch.no_grad():
        if family == "internvl":
            proj = vlm.model.multi_modal_projector
            proj.linear_1 = torch.nn.Linear(proj.linear_1.in_features, hidden)
            proj.linear_2 = torch.nn.Linear(hidden, hidden)
        else:
            mlp = vlm.model.merger.mlp[-1]
            mlp.linear_2 = torch.nn.Linear(mlp.linear_2.in_features, hidden)
    vlm.config.text_config.hidden_size = hidden
    return vlm


if __name__ == "__main__":
    main()
