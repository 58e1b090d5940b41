"""Model loading: HF directories (single file and sharded), in-memory models, and clear
errors for what cannot be compiled (unknown model_type, missing / extra / mis-shaped
tensors, missing shards or tokenizer, configs the static nets cannot honour)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from llm_fixtures import tiny_dir
from safetensors.torch import load_file, save_file

from toptpu.frontends.hf_loader import ModelLoadError, load_model, quiet_transformers
from toptpu.frontends.tiny_models import build_tokenizer, tiny_model


def _copy(tmp_path_factory, tmp_path, family: str = "qwen2") -> str:
    dst = str(tmp_path / "model")
    shutil.copytree(tiny_dir(tmp_path_factory, family), dst)
    return dst


def _edit_config(path: str, **changes: object) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _edit_weights(path: str, fn: Callable[[dict[str, torch.Tensor]], object]) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loads_a_directory_in_float32_with_tokenizer_and_generation(tmp_path_factory) -> None:
    loaded = load_model(tiny_dir(tmp_path_factory, "llama3"))
    assert loaded.family == "llama"
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.generation["eos_token_ids"] == [2, 0]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(loaded.tokenizer_files)
    ref = tiny_model("llama3")
    assert torch.equal(loaded.model.model.layers[1].mlp.up_proj.weight,
                       ref.model.layers[1].mlp.up_proj.weight)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight \
        .data_ptr()  # tied embeddings stay tied


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path) -> None:
    model = tiny_model("qwen2")
    path = str(tmp_path / "sharded")
    with quiet_transformers():
        model.save_pretrained(path, max_shard_size="100KB")
    build_tokenizer(model.config.vocab_size).save_pretrained(path)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) > 1
    loaded = load_model(path)
    for (n, a), (_, b) in zip(loaded.model.state_dict().items(), model.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n
    os.remove(os.path.join(path, shards[-1]))
    with pytest.raises(ModelLoadError, match=f"shard.*{shards[-1]}.*missing"):
        load_model(path)


def test_in_memory_model_with_tokenizer() -> None:
    model = tiny_model("qwen3")
    loaded = load_model(model, tokenizer=build_tokenizer(model.config.vocab_size))
    assert loaded.family == "qwen3" and loaded.model is model
    assert "tokenizer.json" in loaded.tokenizer_files
    with pytest.raises(ModelLoadError, match="expected a transformers causal LM"):
        load_model(torch.nn.Linear(2, 2))


def test_unknown_model_type(tmp_path_factory, tmp_path) -> None:
    path = _copy(tmp_path_factory, tmp_path)
    _edit_config(path, model_type="mamba")
    with pytest.raises(ModelLoadError, match="unknown model_type 'mamba'.*llama, qwen2, qwen2_moe, "
                       "qwen3"):
        load_model(path)


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path_factory, tmp_path) -> None:
    path = _copy(tmp_path_factory, tmp_path)
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError,
                       match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)
    path = _copy(tmp_path_factory, tmp_path / "b")
    _edit_weights(path, lambda t: t.update({
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64),
        "model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "unexpected tensors: model.layers.0.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight is [16, 64], expected [32, 64]" in msg


def test_configs_the_compiler_cannot_honour(tmp_path_factory, tmp_path) -> None:
    path = _copy(tmp_path_factory, tmp_path)
    _edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                        "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'.*static shapes"):
        load_model(path)
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ModelLoadError, match="sliding-window attention"):
        load_model(model)
    model = tiny_model("qwen2")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ModelLoadError, match=r"pre-quantized \(gptq\) model.*checkpoint directory"):
        load_model(model)


def test_missing_files_are_named(tmp_path_factory, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    path = _copy(tmp_path_factory, tmp_path)
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model(path)
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save({}, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors.*convert them to safetensors"):
        load_model(path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(path)
