"""Real model sizes: the benchmark's checkpoint writer (bench/scale.py), the streaming
checkpoint reader and the streaming compile (issue 13)."""

from __future__ import annotations

import importlib.util
import json
import os

import ml_dtypes
import numpy as np
import pytest

_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "scale.py")


def bench_scale():  # noqa: ANN201 - the bench module
    spec = importlib.util.spec_from_file_location("bench_scale", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Qwen2.5 structure at tiny dimensions (many layers: a float32 copy is many layers' worth)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def test_bench_writer_is_a_checkpoint_transformers_loads(tmp_path):
    """bench/scale.py writes shards + index without a model object; transformers loads
    them with every tensor present, bf16, values in the ranges the writer promises."""
    import torch
    from transformers import AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    scale = bench_scale()
    cfg = scale.qwen25_config("7B", num_hidden_layers=3, **TINY)
    path = str(tmp_path / "ckpt")
    total = scale.write_checkpoint(path, cfg, shard_bytes=40_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == total
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)  # untied: lm_head is stored
    assert sum(t.numel() * 2 for t in state.values()) == total
    for name, t in state.items():
        mag = t.float().abs()
        lo, hi = (1.0, 2.0) if name.endswith("norm.weight") else (1 / 64, 1 / 32)
        assert float(mag.min()) >= lo and float(mag.max()) < hi, name
    q = state["model.layers.2.self_attn.q_proj.weight"].float()
    assert 0.3 < float((q > 0).float().mean()) < 0.7  # signs drawn, not constant


def test_bench_random_bf16_is_bf16_bits():
    scale = bench_scale()
    x = scale.random_bf16(np.random.default_rng(0), (1000,), norm=False)
    assert x.dtype == ml_dtypes.bfloat16
    assert len(np.unique(x.view(np.uint16))) > 200


@pytest.mark.parametrize("shard_bytes, want", [(10, 3), (250, 1), (150, 2)])
def test_bench_plan_shards(shard_bytes, want):
    scale = bench_scale()
    tensors = {"a": (10, 5), "b": (20,), "c": (5, 5)}  # 100, 40, 50 bytes
    shards = scale.plan_shards(tensors, shard_bytes)
    assert len(shards) == want
    assert [n for s in shards for n in s] == ["a", "b", "c"]
