"""Pre-quantized checkpoints (GPTQ, AWQ, AutoRound written by the real auto-round package)
compiled end to end: the model file holds exactly the checkpoint's integers, scales and
zero points (its dequantized weights equal the fake-quantized reference bit for bit), the
logits match the fake-quantized float model run by transformers, greedy tokens with f32
activations match for >= 16 new tokens, and modes contradicting a checkpoint are errors."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from quant_fixtures import quant_checkpoints  # noqa: F401 - session fixture

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.runtime import Runtime
from toptpu.compiler import CompileError
from toptpu.compiler import compile as compile_model
from toptpu.metrics import similarity

pytestmark = pytest.mark.slow  # auto-round writes the checkpoints, then compile and generate


#: (recipe, packed format) -> its reference (the fake-quantized export of the same run)
CASES = [
    ("qwen2_asym_g32", "auto_gptq"),  # GPTQ asym, v1 zero offset; layer 1 up_proj float
    ("qwen2_asym_g32", "auto_awq"),  # AWQ gemm
    ("qwen2_asym_g32_autoround", "auto_round"),  # AutoRound, auto_round:auto_awq packing
    ("llama_sym_g64", "auto_gptq"),  # GPTQ sym, group 64, one 8-bit layer
    ("llama_sym_g64", "auto_round"),  # AutoRound, auto_round:auto_gptq packing
    ("qwen2_asym_perchannel", "auto_round"),  # per channel, plain auto_round packing
    ("qwen3_5_sym_g32_rtn", "auto_gptq"),  # Qwen3.5 (linear + full attention), RTN, GPTQ sym
    ("qwen3_5_sym_g32_rtn", "auto_round"),  # the same, auto_round:auto_gptq packing
]
REFERENCE_OF = {"qwen2_asym_g32_autoround": "qwen2_asym_g32"}
PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


def _dirs(ck, recipe: str, fmt: str) -> tuple[str, str]:  # noqa: ANN001
    runs = ck.manifest["runs"]
    return runs[recipe][fmt], runs[REFERENCE_OF.get(recipe, recipe)]["fake"]


_BUILT: dict[tuple[str, str, str | None], str] = {}


def _compiled(ck, tmp_path_factory, recipe: str, fmt: str, mode: str | None) -> str:  # noqa: ANN001
    key = (recipe, fmt, mode)
    if key not in _BUILT:
        src, _ = _dirs(ck, recipe, fmt)
        out = str(tmp_path_factory.mktemp("preq") / f"{recipe}-{fmt}-{mode}.toptpu")
        compile_model(src, out, mode=mode, seq_length=64, max_input_length=16, progress=None)
        _BUILT[key] = out
    return _BUILT[key]


def _reference(ref_dir: str):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_no_flags_compile_uses_the_checkpoint_integers(quant_checkpoints, tmp_path_factory,  # noqa: F811
                                                       recipe: str, fmt: str) -> None:
    path = _compiled(quant_checkpoints, tmp_path_factory, recipe, fmt, None)
    f = LlmFile(path)
    h = f.header
    # -q auto: the checkpoint's bits, activations of its dtype (float16 for auto-round's
    # GPTQ/AWQ exports, float32 for its auto_round exports of a float32 model)
    from toptpu.prequantized import AUTO_ACTIVATIONS

    assert h["checkpoint"]["bits"] == 4
    assert h["mode"] == f"w4{AUTO_ACTIVATIONS[h['checkpoint']['dtype']]}"
    _, ref_dir = _dirs(quant_checkpoints, recipe, fmt)
    ref = {k: v.numpy() for k, v in _reference(ref_dir).state_dict().items()}
    checked = 0
    for layer in range(f.num_layers):
        net = h["layer_nets"]["block"][layer]
        names = set(h["nets"][net]["weights"])
        w = f.layer_weights(layer)
        for name in sorted(n for n in names if n.endswith(":ckpt.qweight")):
            base = name.removesuffix(":ckpt.qweight")
            s, z, q = w[base + ":ckpt.scales"], w[base + ":ckpt.zeros"], w[name]
            k = ref[_hf_name(base, layer)].shape[1]
            bits = 4 if q.shape[1] * 2 == k else 8
            deq = K.dequantize(q, s, z, bits, k // s.shape[1])
            perm = w.get(base + ":ckpt.perm")
            if perm is not None:
                deq = deq[:, np.argsort(perm)]
            assert np.array_equal(deq, ref[_hf_name(base, layer)]), (layer, base)
            checked += 1
    assert checked >= 12  # every quantized linear of both layers


def _hf_name(top_name: str, layer: int) -> str:
    key = re.sub(r"^(v\d+\.)?layer\.", "", top_name)
    return f"model.layers.{layer}.{key}"


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_logits_match_the_fake_quantized_reference(quant_checkpoints, tmp_path_factory,  # noqa: F811
                                                   recipe: str, fmt: str) -> None:
    path = _compiled(quant_checkpoints, tmp_path_factory, recipe, fmt, None)
    _, ref_dir = _dirs(quant_checkpoints, recipe, fmt)
    rt = Runtime.open(path)
    ids = rt.encode(PROMPT)
    ours = rt.prompt_logits(ids)
    with torch.no_grad():
        ref = _reference(ref_dir)(torch.tensor([ids])).logits[0, -1].numpy()
    assert similarity(ours, ref).cosine >= 0.99


@pytest.mark.parametrize("recipe,fmt", [CASES[0], CASES[1], CASES[3], CASES[5]])
def test_greedy_tokens_with_f32_activations(quant_checkpoints, tmp_path_factory,  # noqa: F811
                                            recipe: str, fmt: str) -> None:
    path = _compiled(quant_checkpoints, tmp_path_factory, recipe, fmt, "w4f32")
    _, ref_dir = _dirs(quant_checkpoints, recipe, fmt)
    rt = Runtime.open(path)
    ids = rt.encode(PROMPT)
    res = rt.generate(ids, 16, stop_on_eos=False)
    with torch.no_grad():
        ref = _reference(ref_dir).generate(torch.tensor([ids]), max_new_tokens=16,
                                           min_new_tokens=16, do_sample=False)
    assert res.generated_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("fmt", ["auto_gptq", "auto_round"])
def test_a_qwen3_5_checkpoint_generates_the_dequantized_models_tokens(
        quant_checkpoints, tmp_path_factory, fmt: str) -> None:  # noqa: F811
    """auto-round's Qwen3.5 checkpoint (RTN: the tuning cannot run, docs/limits.md) in w4f32:
    the linear-attention layers and the full-attention layer each get nets of their kind,
    with the checkpoint's integers (in_proj_a/b, which auto-round leaves float, stay float);
    a prompt of two chunks (block, then block_kv on the carried state) and 16 decoded tokens
    equal transformers' generate on the fake-quantized (dequantized) model."""
    recipe = "qwen3_5_sym_g32_rtn"
    path = _compiled(quant_checkpoints, tmp_path_factory, recipe, fmt, "w4f32")
    _, ref_dir = _dirs(quant_checkpoints, recipe, fmt)
    f = LlmFile(path)
    h = f.header
    assert h["model"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert h["layer_nets"]["block"] == ["block"] * 3 + ["block@3"]
    weights = set(h["nets"]["block"]["weights"])
    assert "layer.linear_attn.in_proj_qkv.weight:ckpt.qweight" in weights
    assert not any(n.startswith("layer.linear_attn.in_proj_a.weight:ckpt") for n in weights)
    f.close()
    rt = Runtime.open(path)
    ids = rt.encode(" ".join(f"w{i}" for i in range(1, 25)))
    assert rt.L < len(ids) <= 2 * rt.L
    res = rt.generate(ids, 16, stop_on_eos=False)
    with torch.no_grad():
        ref = _reference(ref_dir).generate(torch.tensor([ids]), max_new_tokens=16,
                                           min_new_tokens=16, do_sample=False)
    assert res.generated_ids == ref[0, len(ids):].tolist()


def test_act_order_checkpoint_gathers_its_input_channels(quant_checkpoints, tmp_path,  # noqa: F811
                                                         tmp_path_factory) -> None:
    """GPTQ desc_act: permute a real checkpoint's channels with g_idx (auto-round never
    writes act-order), compile it, and the logits still match the unpermuted reference."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    src, ref_dir = _dirs(quant_checkpoints, "qwen2_asym_g32", "auto_gptq")
    dst = tmp_path / "act_order"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    qweight = tensors[f"{name}.qweight"]  # int32 [K/8, N], 8 nibbles along K per word
    k = qweight.shape[0] * 8
    rng = np.random.default_rng(0)
    perm = rng.permutation(k)  # new channel j holds old channel perm[j]
    nib = np.stack([(qweight >> (4 * i)) & 0xF for i in range(8)], 1).reshape(k, -1)
    nib = nib[perm]
    packed = np.zeros_like(qweight)
    for i in range(8):
        packed |= (nib.reshape(k // 8, 8, -1)[:, i] << (4 * i)).astype(np.int32)
    tensors[f"{name}.qweight"] = packed
    tensors[f"{name}.g_idx"] = (perm // 32).astype(np.int32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for cfg_name in ("config.json", "quantization_config.json"):
        p = dst / cfg_name
        cfg = json.loads(p.read_text())
        qc = cfg.get("quantization_config", cfg)
        qc["desc_act"] = True
        p.write_text(json.dumps(cfg))
    out = str(tmp_path / "act.toptpu")
    compile_model(str(dst), out, mode="w4f32", seq_length=64, max_input_length=16,
                  progress=None)
    f = LlmFile(out)
    assert any(n.endswith(":ckpt.perm") for n in f.layer_weights(0))
    # the reference: the permuted checkpoint dequantized (with its g_idx) and run by torch;
    # its q_proj weight is the fake reference's with the columns permuted
    from toptpu.frontends.hf_loader import load_model

    ref_model = load_model(str(dst)).model
    fake_w = _reference(ref_dir).model.layers[0].self_attn.q_proj.weight.detach()
    assert torch.equal(ref_model.model.layers[0].self_attn.q_proj.weight, fake_w[:, perm])
    rt = Runtime.open(out)
    ids = rt.encode(PROMPT)
    ours = rt.prompt_logits(ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0, -1].numpy()
    assert similarity(ours, ref).cosine >= 0.99999


def test_modes_that_contradict_the_checkpoint_are_errors(quant_checkpoints,  # noqa: F811
                                                         tmp_path) -> None:
    src, _ = _dirs(quant_checkpoints, "qwen2_asym_g32", "auto_gptq")
    out = os.path.join(tmp_path, "x.toptpu")
    with pytest.raises(CompileError, match="-q w8bf16 contradicts the checkpoint: .* 4-bit gptq"):
        compile_model(src, out, mode="w8bf16", seq_length=64, max_input_length=16,
                      progress=None)
    with pytest.raises(CompileError, match="-q bf16 contradicts the checkpoint"):
        compile_model(src, out, mode="bf16", seq_length=64, max_input_length=16,
                      progress=None)
    assert not os.path.exists(out)
