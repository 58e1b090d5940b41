"""VLM checkpoint directories compiled by streaming (issue 13): the text model as a
streaming skeleton (one layer's tensors in memory at a time), the vision tower read whole
from the shards. Real producers: the suite's tiny InternVL and MiniCPM-V (4.6 with a Qwen3
text model, 4.7 with its Qwen3.5 one) from the real config classes, saved by
`save_pretrained` in bf16 in several shards."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_scale import _compile_in_subprocess, _cut_shard_while_writing, _shards

from toptpu.compiler import compile as compile_model
from toptpu.dialects.checkpoint_reader import CheckpointReader
from toptpu.frontends.hf_loader import ModelLoadError, quiet_transformers
from toptpu.frontends.tiny_vlms import save_tiny_vlm
from toptpu.frontends.vlm import load_vlm, text_name

#: compile options of these tests (the tiny VLMs' images fit in 160 tokens)
OPTIONS = dict(seq_length=160, max_input_length=16, progress=None)


def _save(path: str, family: str, text: dict | None = None, shard: str = "40KB") -> str:
    """A tiny VLM of `family` saved in bf16 in shards of at most `shard`."""
    with quiet_transformers():
        save_tiny_vlm(path, family, text=text, dtype=torch.bfloat16, max_shard_size=shard)
    return path


def _edit_text_config(path: str, **changes: int | bool) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["text_config"].update(changes)
    if "num_hidden_layers" in changes:  # one layer type per layer
        cfg["text_config"]["layer_types"] = ["full_attention"] * changes["num_hidden_layers"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.slow
@pytest.mark.parametrize("family, tied", [("internvl", False), ("minicpmv", True)])
def test_streamed_vlm_compile_gives_the_bytes_of_the_in_memory_compile(tmp_path, family,
                                                                       tied):
    """A sharded bf16 VLM directory compiled by streaming (w4bf16: the text model w4, the
    vit net bf16) == the same directory loaded whole by transformers (float32) and compiled
    in memory, byte for byte (the vit net, its weights, the image tokens and the text nets
    alike). The streamed text model held layer 0 only: every other layer stayed on the
    meta device. The VLM's own config decides the tie of lm_head and embedding: the
    InternVL's text_config says tied but the VLM is not (its lm_head is stored), the
    MiniCPM-V ties them (no lm_head stored). The MiniCPM-V (whose vision header has the
    most parts) compiles again in another process (another hash seed) to the same bytes."""
    path = _save(str(tmp_path / "ckpt"), family, {"tie_word_embeddings": True} if tied else None)
    if not tied:
        _edit_text_config(path, tie_word_embeddings=True)
    assert len(_shards(path)) > 2
    with CheckpointReader.open(path) as reader:
        assert any(n.endswith("lm_head.weight") for n in reader.names()) != tied
    streamed, whole = str(tmp_path / "s.toptpu"), str(tmp_path / "w.toptpu")
    result = compile_model(path, streamed, mode="w4bf16", **OPTIONS)
    loaded = result.loaded
    assert loaded is not None and loaded.stream is not None  # it streamed
    text = loaded.model
    assert (text.lm_head.weight is text.model.embed_tokens.weight) == tied
    layers = text.model.layers
    assert len(layers) == 2 and all(p.is_meta for p in layers[1].parameters())
    in_memory = load_vlm(path)
    assert in_memory.stream is None
    compile_model(in_memory, whole, mode="w4bf16", **OPTIONS)
    with open(streamed, "rb") as f, open(whole, "rb") as g:
        data = f.read()
        assert g.read() == data
    if tied:
        again = str(tmp_path / "a.toptpu")
        _compile_in_subprocess(path, again, "w4bf16", seq=OPTIONS["seq_length"],
                               input_len=OPTIONS["max_input_length"], hash_seed="12345")
        with open(again, "rb") as f:
            assert f.read() == data


#: a small Qwen3.5 text model (its multi-axis rotary: 8 frequency pairs in sections 3/3/2)
SMALL_QWEN3_5 = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                 "linear_value_head_dim": 64,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                     "mrope_interleaved": True}}


@pytest.mark.slow
def test_streamed_minicpmv4_7_gives_the_bytes_of_the_in_memory_compile(tmp_path):
    """MiniCPM-V 4.7 with its Qwen3.5 text model (linear- and full-attention layers, canvas
    positions) as a sharded bf16 directory: the streaming compile holds the first layer of
    each kind only and writes the bytes of the in-memory compile (w4bf16)."""
    path = _save(str(tmp_path / "ckpt"), "minicpmv4_7", SMALL_QWEN3_5, shard="2MB")
    assert len(_shards(path)) > 2
    streamed, whole = str(tmp_path / "s.toptpu"), str(tmp_path / "w.toptpu")
    result = compile_model(path, streamed, mode="w4bf16", **OPTIONS)
    loaded = result.loaded
    assert loaded is not None and loaded.stream is not None  # it streamed
    layers = loaded.model.model.layers
    # each layer kind's first layer made real (its nets: 0 linear, 3 full attention)
    assert len(layers) == 4 and all(p.is_meta for i in (1, 2) for p in layers[i].parameters())
    assert result.header["vision"]["canvas_markers"]
    compile_model(load_vlm(path), whole, mode="w4bf16", **OPTIONS)
    with open(streamed, "rb") as f, open(whole, "rb") as g:
        assert f.read() == g.read()


def test_text_names_follow_transformers_renaming(tmp_path):
    """InternVL checkpoints name the text model 'language_model.model.…' (what
    save_pretrained writes), MiniCPM-V 'model.language_model.…'; both reach the causal LM's
    'model.layers.N.…' names the streaming skeleton reads."""
    assert text_name("model.language_model.layers.3.mlp.up_proj.weight") == \
        "model.layers.3.mlp.up_proj.weight"
    assert text_name("lm_head.weight") == "lm_head.weight"
    assert text_name("model.vision_tower.embeddings.cls_token") is None
    path = _save(str(tmp_path / "internvl"), "internvl")
    with CheckpointReader.open(path) as reader:
        assert "language_model.model.layers.1.mlp.up_proj.weight" in reader
    loaded = load_vlm(path, stream=True)
    view = loaded.stream.reader
    assert "model.layers.1.mlp.up_proj.weight" in view and "lm_head.weight" in view
    assert not any("vision" in n or "projector" in n for n in view.names())
    whole = load_vlm(path)
    want = whole.model.model.layers[1].mlp.up_proj.weight.detach().numpy()
    got = loaded.stream.float_of(1)("layer.mlp.up_proj.weight")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("family, changes, match", [
    ("internvl", {"num_hidden_layers": 3}, r"missing tensors: model\.language_model\.layers\.2\."),
    ("minicpmv", {"num_hidden_layers": 1}, r"unexpected tensors: model\.language_model\.layers"
                                           r"\.1\."),
    ("internvl", {"intermediate_size": 128}, r"mis-shaped tensors: language_model\.model\."
                                             r"layers\.0\.mlp\.down_proj\.weight is \[64, 192\], "
                                             r"expected \[64, 128\]"),
])
def test_checkpoint_that_does_not_match_its_config_is_named(tmp_path, family, changes, match):
    """Checked from the shard headers before anything is compiled: each problem named."""
    path = _save(str(tmp_path / "ckpt"), family)
    _edit_text_config(path, **changes)
    with pytest.raises(ModelLoadError, match=f"does not match its config.json.*{match}"):
        load_vlm(path, stream=True)


@pytest.mark.parametrize("family", ["internvl", "minicpmv"])
def test_missing_shard_is_a_clear_error_and_leaves_no_file(tmp_path, family):
    path = _save(str(tmp_path / "ckpt"), family)
    middle = _shards(path)[1]
    os.unlink(os.path.join(path, middle))
    out = str(tmp_path / "out" / "m.toptpu")
    os.makedirs(os.path.dirname(out))
    with pytest.raises(ModelLoadError, match=f"'{middle}'.*missing"):
        compile_model(path, out, mode="w4bf16", **OPTIONS)
    assert os.listdir(os.path.dirname(out)) == []


@pytest.mark.slow
def test_shard_truncated_mid_compile_is_a_clear_error_and_leaves_no_file(tmp_path):
    """The shard holding the last text layer is cut after the nets are compiled, while
    the layers are being written: an error naming the shard, and no model file."""
    path = _save(str(tmp_path / "ckpt"), "internvl", text={"num_hidden_layers": 4})
    _cut_shard_while_writing(path, str(tmp_path / "out"),
                             "language_model.model.layers.3.mlp.down_proj.weight",
                             seq_length=160)


#: the text model of the memory test: 48 Qwen2 layers of hidden 256 (4 MB each in float32)
MANY_LAYERS = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=2048)


@pytest.mark.slow
def test_streamed_vlm_compile_memory_is_bounded_by_a_layer(tmp_path):
    """Peak RSS of a streaming compile (getrusage in a fresh process) of an InternVL whose
    text model has 48 layers, after the same process compiled a 2-layer one of the same
    shape: it grows by less than 12 text layers' float32 plus the embedding, the lm_head
    and the whole vision side (tower and projector) in float32 — under a third of the
    float32 model the in-memory path holds."""
    path = _save(str(tmp_path / "ckpt"), "internvl", {**MANY_LAYERS, "num_hidden_layers": 48},
                 shard="8MB")
    small = _save(str(tmp_path / "small"), "internvl", {**MANY_LAYERS, "num_hidden_layers": 2},
                  shard="8MB")
    with CheckpointReader.open(path) as reader:
        assert len(reader.shards) > 4
        f32 = {n: 4 * int(np.prod(t.shape)) for n, t in reader.tensors.items()}
    layer = sum(n for name, n in f32.items() if name.startswith("language_model.model.layers.0."))
    text_layers = [name for name in f32 if ".layers." in name and name.startswith("language_")]
    other = sum(n for name, n in f32.items() if name not in text_layers)  # shared + vision
    whole = sum(f32.values())
    bound = 12 * layer + other
    assert whole > 3 * bound  # the float32 model is far above the bound
    base, peak = _compile_in_subprocess(path, str(tmp_path / "m.toptpu"), "w4bf16", seq=160,
                                        warm_up=small)
    assert peak - base < bound, (f"peak RSS {peak / 1e6:.0f} MB is {(peak - base) / 1e6:.0f} "
                                 f"MB above the {base / 1e6:.0f} MB of the warm-up; bound "
                                 f"{bound / 1e6:.0f} MB (float32 model {whole / 1e6:.0f} MB)")
