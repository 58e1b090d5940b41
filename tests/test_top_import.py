"""Importing real transformers decoder layers into Top, before and after the Top pipeline."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.dialects import top
from toptpu.dialects.naming import source_of
from toptpu.frontends.fx_importer import (
    ATEN_BUILDERS,
    UnsupportedOpError,
    builds_from_schema,
    import_module,
)
from toptpu.frontends.hf_layers import decoder_layer, layer_inputs
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes

NAMES = dict(input_names=["hidden", "position_ids", "attention_mask"],
             output_names=["hidden_out"])


def _import_layer(tiny_models, family: str, length: int = 12):
    model = tiny_models(family)
    layer = decoder_layer(model)
    args = layer_inputs(model.config.hidden_size, length)
    module, store = import_module(layer, args, **NAMES)
    with torch.no_grad():
        ref = layer(*args).numpy()
    feeds = {"hidden": args[0].numpy(), "position_ids": args[1].numpy(),
             "attention_mask": args[2].numpy()}
    return module, store, feeds, ref


def _op_names(module) -> list[str]:
    return [op.name for op in module.walk()]


@pytest.mark.parametrize("family", ["qwen2", "llama3", "llama2", "qwen3"])
def test_decoder_layer_matches_torch_before_and_after_pipeline(tiny_models, family: str) -> None:
    module, store, feeds, ref = _import_layer(tiny_models, family)
    module.verify()
    before = Interpreter(module, store).run(feeds).outputs["hidden_out"]
    assert similarity(before, ref).cosine >= 0.99999
    n_before = len(_op_names(module))

    run_passes(module, top_pipeline_passes(), store=store)
    names = _op_names(module)
    for fused in ("top.rms_norm", "top.rope", "top.attention"):
        assert fused in names, f"{fused} missing after the Top pipeline"
    # the decomposed forms are gone
    for gone in ("top.rsqrt", "top.pow", "top.expand", "top.permute"):
        assert gone not in names, f"{gone} survived fusion"
    assert len(names) < n_before
    after = Interpreter(module, store).run(feeds).outputs["hidden_out"]
    assert similarity(after, ref).cosine >= 0.99999
    np.testing.assert_allclose(after, ref, rtol=1e-4, atol=1e-4)


def test_fused_attention_is_gqa_native(tiny_models) -> None:
    module, store, _, _ = _import_layer(tiny_models, "qwen2")
    run_passes(module, top_pipeline_passes(), store=store)
    (att,) = [op for op in module.walk() if op.name == "top.attention"]
    cfg = tiny_models("qwen2").config
    assert att.attributes["q_heads"].value.data == cfg.num_attention_heads
    assert att.attributes["kv_heads"].value.data == cfg.num_key_value_heads
    assert att.attributes["head_dim"].value.data == cfg.hidden_size // cfg.num_attention_heads


def test_weights_live_in_the_store_not_the_ir(tiny_models) -> None:
    module, store, _, _ = _import_layer(tiny_models, "qwen2")
    text = str(module)
    assert "dense<" not in text
    layer = decoder_layer(tiny_models("qwen2"))
    w = layer.layer.self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(store["layer.self_attn.q_proj.weight"], w)
    # the non-persistent rotary buffer comes from the module itself
    assert np.array_equal(store["rotary.inv_freq"], layer.rotary.inv_freq.numpy())


def test_intermediates_are_named_by_location(tiny_models) -> None:
    module, store, feeds, _ = _import_layer(tiny_models, "qwen2")
    res = Interpreter(module, store).run(feeds, keep_all=True)
    assert "layer.self_attn.q_proj.linear" in res.values
    assert res.values["hidden"] is not None


class _Cumprod(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(x, dim=-1) + 1.0


def test_unsupported_op_names_the_op_and_the_source_line() -> None:
    with pytest.raises(UnsupportedOpError) as err:
        import_module(_Cumprod(), (torch.randn(2, 3),))
    msg = str(err.value)
    assert "aten.cumprod" in msg
    assert "test_top_import.py" in msg and "torch.cumprod(x, dim=-1)" in msg


def test_locations_name_source_files_by_import_path_not_install_path(tiny_models) -> None:
    """The IR (and so the model file's bytes) must not depend on where Python, the packages
    or this checkout live: a location names 'transformers/models/...', not '/usr/...'."""
    module, _, _, _ = _import_layer(tiny_models, "qwen2", length=4)
    files = {where.rsplit(":", 1)[0] for op in module.walk() if (where := source_of(op))}
    assert "transformers/models/qwen2/modeling_qwen2.py" in files, files
    assert not any(os.path.isabs(f) for f in files), files


def test_an_aten_schema_that_does_not_fit_the_op_is_refused_when_registered() -> None:
    """builds_from_schema reads the aten op's schema: an argument the op's constructor has
    no keyword for, or of a kind it cannot pass (a list), fails at registration, and
    registers nothing."""
    aten = torch.ops.aten
    before = dict(ATEN_BUILDERS)
    with pytest.raises(TypeError, match="aten.clamp.default argument min is no keyword of "
                                        "PowOp"):
        builds_from_schema(top.PowOp, aten.pow.Tensor_Scalar, aten.clamp.default)
    with pytest.raises(TypeError,
                       match=r"argument dim is a Optional\[List\[int\]\]; write a builder"):
        builds_from_schema(top.PowOp, aten.mean.dim)
    assert ATEN_BUILDERS == before
