"""The scale-and-min `tpu.a16_matmul` (float mins instead of zero points: GGUF's Q4_1 / Q5_1 /
Q4_K / Q5_K) through the machine pipeline: layer groups slice its mins like its scales (by
output channels, and whole for row slices and for the rows of 2-D tiles), and the machine
in its checked and fast modes gives the grouped Tpu IR's bytes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.dialects import tpu
from toptpu.dialects.common import read_int
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
from toptpu.passes.quantize import CHECKPOINT_MODEL, checkpoint_key


def _module(m: int, n: int, k: int, bits: int, mode: str) -> tuple:
    """x[1, m, k] @ W^T with W a scale-and-min checkpoint linear (group 32, f16 scales and
    mins), then a silu; its Tpu IR in `mode`, its store and an input."""
    rng = np.random.default_rng(m + n + k + bits)
    g = k // 32
    store = WeightStore.from_arrays({
        "fc.weight": rng.standard_normal((n, k)).astype(np.float32),
        checkpoint_key("fc.weight", "qweight"): rng.integers(0, 1 << (5 if bits == 8 else 4),
                                                             (n, k)).astype(np.uint8),
        checkpoint_key("fc.weight", "scales"): (rng.random((n, g)) * 0.1).astype(np.float16),
        checkpoint_key("fc.weight", "mins"): (rng.standard_normal((n, g)) * 0.1
                                              ).astype(np.float16),
        checkpoint_key("fc.weight", "meta"): np.array([bits, 32], np.int32),
        CHECKPOINT_MODEL: np.ones(1, np.int8)})
    xt, wt, yt = (f"tensor<1x{m}x{k}xf32>", f"tensor<{n}x{k}xf32>", f"tensor<1x{m}x{n}xf32>")
    attrs = "transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>"
    text = f'''builtin.module attributes {{top.weight_store = "{store.uri}"}} {{
  func.func @main(%x: {xt}) -> {yt} {{
    %w = "top.weight"() {{name = "fc.weight"}} : () -> {wt}
    %y = "top.matmul"(%x, %w) {{{attrs}}} : ({xt}, {wt}) -> {yt}
    %z = "top.silu"(%y) : ({yt}) -> {yt}
    func.return %z : {yt}
  }}
}}'''
    module = parse_ir(text, "a16_mins")
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    if mode not in ("w4f32", "w8f32"):
        x = x.astype(np.float16)
    return module, store, {"input0": x}


def _chip(lane_bytes: int) -> Chip:
    return replace(get_chip("bm1684x"), lanes=2, lane_bytes=lane_bytes, dma_latency_cycles=8,
                   compute_latency_cycles=4)


@pytest.mark.parametrize(("m", "n", "k", "bits", "mode", "lane", "kind"), [
    (1, 512, 256, 4, "w4f16", 4096, "cols"),     # decode: by output channels
    (64, 32, 256, 4, "w4f32", 4096, "rows"),     # prefill: by rows, the weight resident
    (64, 256, 256, 8, "w8f16", 4096, "tiles"),   # neither fits alone: rows x channels
    (16, 64, 128, 4, "w4f16", 1 << 18, "whole"),  # one slice
])
def test_a_sliced_scale_and_min_matmul_runs_on_the_machine_as_in_the_ir(
        m: int, n: int, k: int, bits: int, mode: str, lane: int, kind: str) -> None:
    module, store, feeds = _module(m, n, k, bits, mode)
    (op,) = [o for o in module.walk() if isinstance(o, tpu.A16MatMulOp)]
    assert op.mins is not None and op.zeros is None
    ref = Interpreter(module, store).run(feeds).outputs["output0"]
    chip = _chip(lane)
    prog = compile_for_machine(module, chip)
    grouped = Interpreter(module, store).run(feeds).outputs["output0"]
    groups = [g for g in module.walk() if isinstance(g, tpu.GroupOp)
              and any(isinstance(o, tpu.A16MatMulOp) for o in g.walk())]
    slices = read_int(groups[0].slices)
    assert (slices > 1) == (kind != "whole"), slices
    assert (groups[0].tiles is not None) == (kind == "tiles")
    group = groups[0]
    outer = dict(zip(group.body.block.args, group.operands, strict=True))
    (mins_load,) = [o for o in group.walk() if isinstance(o, tpu.LoadOp)
                    and isinstance(w := outer[o.input].owner, tpu.WeightOp)
                    and w.tensor_name.endswith("ckpt.mins")]
    # the mins stream by output channels with the scales, whole under row slices
    assert read_int(mins_load.slice_axis) == {"cols": 0, "tiles": 0}.get(kind, -1)
    for checked in (True, False):
        got = simulate(prog, store, feeds, chip, checked=checked).outputs["output0"]
        assert got.tobytes() == grouped.tobytes(), (checked, slices)
    np.testing.assert_allclose(grouped.astype(np.float32), ref.astype(np.float32),
                               rtol=2e-2 if mode.endswith("f16") else 1e-5, atol=1e-3)
