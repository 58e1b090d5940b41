"""The shell tools as a user runs them, and the real-MLIR round trip."""

from __future__ import annotations

import os

import pytest

from helpers import run_tool
from toptpu.dialects.mlir_check import check_roundtrip
from toptpu.dialects.weight_store import STORE_ATTR
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.hf_layers import decoder_layer, layer_inputs
from toptpu.passes.pipelines import run_passes, top_pipeline_passes


def _layer_module(tiny_models, family: str = "qwen2"):
    model = tiny_models(family)
    return import_module(decoder_layer(model), layer_inputs(model.config.hidden_size, 8),
                         input_names=["hidden", "position_ids", "attention_mask"],
                         output_names=["hidden_out"])


def test_opt_help_lists_our_passes() -> None:
    res = run_tool("toptpu-opt", "--help")
    assert res.returncode == 0
    for name in ("shape-infer", "canonicalize", "fuse", "top-pipeline"):
        assert f"  {name} " in res.stdout


@pytest.mark.slow  # exports a layer and runs toptpu-opt on it
def test_opt_runs_top_pipeline_on_a_dumped_layer(tiny_models, tmp_path) -> None:
    from xdsl.dialects.builtin import StringAttr

    module, store = _layer_module(tiny_models)
    weights = os.path.join(tmp_path, "weights.safetensors")
    store.save(weights)
    module.attributes[STORE_ATTR] = StringAttr(weights)
    src = os.path.join(tmp_path, "layer.mlir")
    with open(src, "w") as f:
        f.write(str(module))
    res = run_tool("toptpu-opt", src, "-p", "top-pipeline")
    assert res.returncode == 0, res.stderr
    for fused in ("top.rms_norm", "top.rope", "top.attention"):
        assert fused in res.stdout
    assert "top.rsqrt" not in res.stdout


def test_real_mlir_roundtrip(tiny_models) -> None:
    module, store = _layer_module(tiny_models, "llama3")
    back = check_roundtrip(module)
    assert back.is_structurally_equivalent(module)
    run_passes(module, top_pipeline_passes(), store=store)
    check_roundtrip(module)


@pytest.mark.slow  # starts a Python that imports the driver
def test_opt_does_not_load_torch() -> None:
    # the opt driver starts without torch (fast start for shell pipelines)
    code = ("import sys, toptpu.opt; toptpu.opt.ToptpuOptMain(args=['-p', 'top-pipeline']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    res = run_tool("python", "-c", code)
    assert res.returncode == 0, res.stderr
