"""The mixture-of-experts families beyond Qwen3-MoE and Qwen2-MoE (`tests/test_moe.py`):
Qwen3.5-MoE (`qwen3_5_moe_text`: Qwen3.5's hybrid of Gated DeltaNet and gated
full-attention layers, every MLP a MoE block with renormalized top-k and a shared expert
scaled by its sigmoid gate) and the vision-language MoEs of the Qwen-VL family: Qwen3-VL-MoE
(`qwen3_vl_moe`: Qwen3-VL's vision with DeepStack, a Qwen3-MoE text model) and Qwen3.5-MoE
as published (`qwen3_5_moe`: Qwen3.5's vision with the hybrid MoE text model).

Checked: transformers' Qwen3.5-MoE block recognized and its router and experts equal to
the kernels; the checkpoint layouts (`save_pretrained`'s one tensor per expert, the fused
3-D form Qwen3-VL-MoE's `save_pretrained` keeps, and the axis-swapped form of Qwen3-VL-MoE's
published checkpoints, which transformers transposes on loading) read by the streaming
compile as transformers loads them; and (slow) f32 greedy tokens equal to transformers
`generate` for 32 tokens, on the interpreter and the machine, the machine bit for bit the
interpreter: the text model with a prompt of three prefill chunks (its prefill rows'
logits per stage too), the VLMs with an image."""

from __future__ import annotations

import gc
import os
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from filelock import FileLock
from llm_fixtures import LONG_PROMPT, compiled, hf_model, shared_dir
from vlm_fixtures import make_image, vlm_dir, vlm_file

from toptpu.backend.reference import kernels as K
from toptpu.frontends import moe
from toptpu.frontends.tiny_models import tiny_model

N = 32  # new tokens


def _hf_generate(model: Any, ids: list[int], n: int, **inputs: Any) -> list[int]:
    """transformers greedy `generate` of exactly n tokens (no stop at an end token: the
    tiny models' random weights may choose one)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, **inputs)
    return out[0, len(ids):].tolist()


# =========================================================================== the block


def test_qwen3_5_moe_block_is_recognized_and_equals_the_kernels() -> None:
    """transformers' `Qwen3_5MoeSparseMoeBlock`: fused 3-D experts, a router that always
    renormalizes (no `norm_topk_prob`), a shared expert with its gate; its router's
    indices and weights and its experts' sum are the kernels'."""
    model = tiny_model("qwen3_5_moe", layers=4)
    block = model.model.layers[0].mlp
    assert type(block).__name__ == "Qwen3_5MoeSparseMoeBlock"
    assert moe.moe_shape(block) == moe.MoeShape(8, 2, True, 64, 32, True, True)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, want_w, want_i = block.gate(x)
        want = block.experts(x, want_i, want_w).numpy()
        whole = block(x[None])[0].numpy()
    w, i = K.moe_route(logits.numpy(), None, 2, True)
    assert np.array_equal(i, want_i.numpy())
    np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-6, atol=1e-7)
    gate_up = block.experts.gate_up_proj.detach().numpy()
    down = block.experts.down_proj.detach().numpy()
    got = K.moe_experts(x.numpy(), gate_up[:, :32], gate_up[:, 32:], down, w, i)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the splitter's path: the custom ops and the gated shared expert
        ours = moe.MoeMlp(block)(x[None])[0].numpy()
    np.testing.assert_allclose(ours, whole, rtol=1e-5, atol=1e-6)


def test_a_moe_config_needs_no_intermediate_size() -> None:
    """Qwen3.5-MoE's config.json has no intermediate_size (no dense MLP): accepted when
    the experts' size is given, still required of a dense config."""
    from toptpu.frontends.hf_loader import ModelLoadError, check_config_values
    from toptpu.frontends.tiny_models import tiny_config

    raw = tiny_config("qwen3_5_moe").to_dict()
    assert "intermediate_size" not in raw
    check_config_values(raw, "config.json")
    raw.pop("moe_intermediate_size")
    with pytest.raises(ModelLoadError, match="intermediate_size is missing"):
        check_config_values(raw, "config.json")


# =========================================================================== checkpoints


def _text_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from llm_fixtures import tiny_dir

    return tiny_dir(tmp_path_factory, "qwen3_5_moe", layers=4)


def test_save_pretrained_layouts(tmp_path_factory) -> None:
    """Qwen3.5-MoE's `save_pretrained` (text model and VLM) writes one tensor per expert;
    Qwen3-VL-MoE's keeps the fused 3-D tensors; no intermediate_size in Qwen3.5-MoE's
    config (it has no dense MLP)."""
    import json

    from toptpu.frontends.hf_loader import checkpoint_shapes

    text = checkpoint_shapes(_text_dir(tmp_path_factory))
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in text
    assert not any(k.endswith("experts.gate_up_proj") for k in text)
    with open(os.path.join(_text_dir(tmp_path_factory), "config.json")) as f:
        assert "intermediate_size" not in json.load(f)
    vl35 = checkpoint_shapes(vlm_dir(tmp_path_factory, "qwen3_5_moe"))
    assert "model.language_model.layers.0.mlp.experts.7.up_proj.weight" in vl35
    vl3 = checkpoint_shapes(vlm_dir(tmp_path_factory, "qwen3_vl_moe"))
    assert vl3["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (8, 256, 512)
    assert vl3["model.language_model.layers.0.mlp.experts.down_proj"] == (8, 512, 128)


def _swapped_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-VL-MoE directory with its experts stored as Qwen3-VL-30B-A3B's
    published checkpoint stores them: `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]."""
    from safetensors.numpy import load_file, save_file

    src = vlm_dir(tmp_path_factory, "qwen3_vl_moe")
    path = os.path.join(shared_dir(tmp_path_factory), "vlm-qwen3_vl_moe-swapped")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            shutil.copytree(src, path, dirs_exist_ok=True)
            os.remove(os.path.join(path, "done"))
            tensors = load_file(os.path.join(path, "model.safetensors"))
            for name in list(tensors):
                if moe.is_fused_parameter(name):
                    tensors[name] = np.ascontiguousarray(tensors[name].swapaxes(1, 2))
            save_file(tensors, os.path.join(path, "model.safetensors"),
                      metadata={"format": "pt"})
            open(os.path.join(path, "done"), "w").close()
    return path


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl_moe", "swapped"])
def test_streamed_vlm_experts_equal_what_transformers_loads(tmp_path_factory,
                                                           family: str) -> None:
    """The streaming compile's skeleton layer and every layer's stacked experts, from the
    hub layout (Qwen3.5-MoE), the fused form (Qwen3-VL-MoE's `save_pretrained`) and the
    axis-swapped published form, equal transformers' `from_pretrained` of the directory
    (which merges, keeps or transposes them itself)."""
    import transformers

    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.vlm import VLM_CLASSES, load_vlm

    path = _swapped_dir(tmp_path_factory) if family == "swapped" \
        else vlm_dir(tmp_path_factory, family)
    cfg = transformers.AutoConfig.from_pretrained(path)
    with quiet_transformers():
        ref = getattr(transformers, VLM_CLASSES[cfg.model_type]).from_pretrained(
            path, dtype=torch.float32).eval()
    loaded = load_vlm(path, stream=True)
    assert loaded.stream is not None
    assert isinstance(loaded.stream.reader, moe.SwappedExperts) == (family == "swapped")
    layers = ref.model.language_model.layers
    for layer in range(len(layers)):
        get = loaded.stream.float_of(layer)
        experts = layers[layer].mlp.experts
        inter = experts.down_proj.shape[2]
        gate_up = experts.gate_up_proj.detach().numpy()
        for key, want in (("gate_proj", gate_up[:, :inter]), ("up_proj", gate_up[:, inter:]),
                          ("down_proj", experts.down_proj.detach().numpy())):
            assert np.array_equal(get("layer.mlp.experts." + key), want), (layer, key)
    skel = loaded.model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(skel, layers[0].mlp.experts.gate_up_proj)


def test_a_vlm_checkpoint_missing_an_expert_is_refused(tmp_path_factory, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    from toptpu.frontends.hf_loader import ModelLoadError
    from toptpu.frontends.vlm import load_vlm

    d = tmp_path / "broken"
    shutil.copytree(vlm_dir(tmp_path_factory, "qwen3_5_moe"), d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.language_model.layers.2.mlp.experts.5.gate_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing expert tensors: model.language_model."
                       "layers.2.mlp.experts.5.gate_proj.weight"):
        load_vlm(str(d), stream=True)


# =========================================================================== generation


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["interpreter", "machine"])
def test_qwen3_5_moe_greedy_generation_equals_transformers(tmp_path_factory,
                                                           executor: str) -> None:
    """f32, a prompt of 39 tokens (three prefill chunks of 16: `block`, then `block_kv`
    twice, the last chunk padded; each net of both layer kinds, linear and full
    attention), 32 decode steps (`block_cache`): the tokens of transformers' `generate` on
    the directory `save_pretrained` wrote, then a second turn on the caches (and the
    linear-attention states). Every prefill row's logits (teacher forced) are the model's
    within 1e-4 and pick its token."""
    from toptpu.backend.runtime.runtime import Runtime

    built = compiled(tmp_path_factory, "qwen3_5_moe", layers=4)
    ref = hf_model(built.model_dir)
    rt = Runtime.open(built.model_file, executor)
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L and len(ids) % rt.L
    ours = rt.sequence_logits(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].numpy()
    for stage, rows in (("block", slice(0, rt.L)), ("block_kv", slice(rt.L, len(ids)))):
        np.testing.assert_allclose(ours[rows], theirs[rows], rtol=0, atol=1e-4,
                                   err_msg=stage)
        assert np.array_equal(ours[rows].argmax(-1), theirs[rows].argmax(-1)), stage
    res = rt.generate(ids, N, stop_on_eos=False)
    assert res.generated_ids == _hf_generate(ref, ids, N)
    ids2 = rt.encode(" What is the capital of France?", add_special_tokens=False)
    res2 = rt.generate(ids2, N, keep_history=True, stop_on_eos=False)
    assert res2.generated_ids == _hf_generate(ref, ids + res.generated_ids + ids2, N)


@pytest.mark.slow
def test_qwen3_5_moe_machine_equals_interpreter_bit_for_bit(tmp_path_factory) -> None:
    from toptpu.backend.runtime.runtime import Runtime

    built = compiled(tmp_path_factory, "qwen3_5_moe", layers=4)
    machine = Runtime.open(built.model_file, "machine")
    interp = Runtime.open(built.model_file, "interpreter")
    ids = machine.encode(LONG_PROMPT)
    a, b = machine.sequence_logits(ids), interp.sequence_logits(ids)
    assert a.dtype == b.dtype and np.array_equal(a, b)
    ta = machine.generate(ids, 8, stop_on_eos=False)
    tb = interp.generate(ids, 8, stop_on_eos=False)
    assert ta.generated_ids == tb.generated_ids
    for layer in range(machine.num_layers):  # every KV cache and linear-attention state
        for bufs in (machine.cache_k, machine.cache_v):
            if bufs[layer] is not None:
                other = interp.cache_k if bufs is machine.cache_k else interp.cache_v
                assert np.array_equal(machine.ex.read(bufs[layer]),
                                      interp.ex.read(other[layer])), layer


def _real_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import GenerationConfig

    from toptpu.frontends import tiny_models as tm
    from toptpu.frontends.hf_loader import quiet_transformers

    path = os.path.join(shared_dir(tmp_path_factory), "qwen3_5_moe-real")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            model = tm.tiny_model(config=tm.qwen3_5_moe_real_config())
            tok = tm.build_tokenizer(model.config.vocab_size)
            model.generation_config = GenerationConfig(
                eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>")],
                pad_token_id=tok.pad_token_id, do_sample=False)
            with quiet_transformers():
                model.save_pretrained(path)
                tok.save_pretrained(path)
            open(os.path.join(path, "done"), "w").close()
    return path


@pytest.mark.slow
def test_qwen3_5_moe_published_shape_equals_transformers(tmp_path_factory) -> None:
    """Qwen3.5-35B-A3B's widths (hidden 2048, 16/2 heads of 256, 16 key and 32 value
    linear heads of 128, 16 of its 256 experts of 512, top-8, a shared expert of 512),
    four layers (three linear attention, one full): the experts do not fit local memory
    whole (layer groups cut them in reduction parts). 32 greedy tokens on the machine after
    a prompt of three chunks equal transformers' `generate`."""
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model_dir = _real_dir(tmp_path_factory)
    path = os.path.join(shared_dir(tmp_path_factory), "qwen3_5_moe-real-f32.toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode="f32", seq_length=160, max_input_length=16,
                          progress=None)
    rt = Runtime.open(path, "machine")
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L
    ours = rt.generate(ids, N, stop_on_eos=False).generated_ids
    del rt  # the model file's mapped weights go before transformers' model comes (the
    gc.collect()  # session's peak stays within ~4 GB)
    from transformers import AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    with quiet_transformers():  # not kept in hf_model's cache: 1.3 GB
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert ours == _hf_generate(ref, ids, N)


# --------------------------------------------------------------------------- with an image

VLMS = ("qwen3_vl_moe", "qwen3_5_moe")
#: the vision net's budget (400 patches of 16 pixels)
BUDGET = {"qwen3_vl_moe": {"max_patches": 400}, "qwen3_5_moe": {"max_pixels": (320, 320)}}
PROMPT = "Describe the image. What is the capital of France?"


def _vlm_file(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    return vlm_file(tmp_path_factory, family, seq=256, input_len=32, **BUDGET[family])


def _image(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = os.path.join(shared_dir(tmp_path_factory), "moe-image-230x300.png")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            make_image(230, 300).save(path)
    return path


_TURNS: dict[tuple[str, str, str], dict[str, Any]] = {}


def _image_turn(tmp_path_factory: pytest.TempPathFactory, family: str, executor: str,
                rows_of: str | None = None) -> dict[str, Any]:
    """A fresh conversation with the test image (chat template, N new tokens) on
    `executor`, with the image rows of the vit run by `rows_of` (default the same
    executor), once per family and executors."""
    from toptpu.backend.runtime.runtime import Runtime

    rows_of = rows_of or executor
    key = (family, executor, rows_of)
    if key not in _TURNS:
        path = _vlm_file(tmp_path_factory, family)
        rt = Runtime.open(path, executor)
        ids, images = Runtime.open(path, rows_of).image_prompt(
            PROMPT, [_image(tmp_path_factory)], chat_template=True)
        res = rt.generate(ids, N, images=images, stop_on_eos=False)
        caches = {f"{i}.{kv}": rt.ex.read(b[i]) for kv, b in (("k", rt.cache_k),
                                                               ("v", rt.cache_v))
                  for i in range(rt.num_layers) if b[i] is not None}
        pixels = rt.vision.processor(make_image(230, 300), return_tensors="pt")
        _TURNS[key] = {
            "ids": ids, "tokens": res.generated_ids, "rows": images[0].embeds,
            "deepstack": images[0].deepstack, "caches": caches, "L": rt.L,
            "inputs": {"pixel_values": pixels["pixel_values"],
                       "image_grid_thw": pixels["image_grid_thw"]}}
    return _TURNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["interpreter", "machine"])
@pytest.mark.parametrize("family", VLMS)
def test_generation_with_an_image_equals_transformers(tmp_path_factory, family: str,
                                                      executor: str) -> None:
    """f32 greedy tokens with an image (the executor's own vit rows) == transformers
    `generate` on the same processor output (M-RoPE positions; Qwen3-VL-MoE's DeepStack
    rows added after the first text layers); the prompt spans four prefill chunks of 32
    (`block`, `block_kv`), then 32 decode steps (`block_cache`)."""
    from vlm_fixtures import hf_vlm

    turn = _image_turn(tmp_path_factory, family, executor)
    model = hf_vlm(vlm_dir(tmp_path_factory, family))
    ids = turn["ids"]
    assert ids.count(model.config.image_token_id) == len(turn["rows"])
    assert len(ids) > 3 * turn["L"]
    assert (turn["deepstack"] is not None) == (family == "qwen3_vl_moe")
    assert len(set(turn["tokens"])) > 2  # the model does not answer with one token
    types = torch.tensor([[int(i == model.config.image_token_id) for i in ids]])
    assert turn["tokens"] == _hf_generate(model, ids, N, mm_token_type_ids=types,
                                          **turn["inputs"])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.slow
@pytest.mark.parametrize("family", VLMS)
def test_vlm_machine_equals_interpreter_bit_for_bit(tmp_path_factory, family: str) -> None:
    """With the same image rows, the machine's tokens are the interpreter's, and every KV
    cache after the image turn is the interpreter's bits (the chunks at L; the prompt's
    last chunk runs the 16-row prefill net, whose rows agree to f32 rounding only:
    docs/limits.md) where the prefill nets at L keep every reduction whole; where a layer
    group cuts the experts' intermediate axis in reduction parts (Qwen3.5-MoE's hidden 1024:
    8 parts on bm1684x) the partial sums round apart and the caches agree within 1e-5 of
    the largest value (docs/machine.md), as where the host's BLAS gives a product's rows
    other bits when the machine tiles them (`blas_threads.rows_keep_bits`). The vit's own
    rows likewise: the interpreter's bits where its plan keeps every reduction whole, else
    within cos >= 0.99999."""
    from toptpu.backend.formats.llm_file import LlmFile
    from toptpu.backend.reference.blas_threads import rows_keep_bits
    from toptpu.backend.runtime.machine_executor import MachineExecutor

    path = _vlm_file(tmp_path_factory, family)
    machine = MachineExecutor(path)

    def parts(net: str) -> int:
        return sum(getattr(c, "parts", 1) > 1 for c in machine.program(net).commands)

    at_l_nets = [n for n in LlmFile(path).header["nets"] if n.split("@")[0] in
                 ("block", "block_kv")]
    cut = sum(parts(net) for net in at_l_nets)  # the plan's choice (the cost model's)
    a = _image_turn(tmp_path_factory, family, "machine", rows_of="interpreter")
    b = _image_turn(tmp_path_factory, family, "interpreter")
    assert a["ids"] == b["ids"] and a["tokens"] == b["tokens"]
    assert a["caches"].keys() == b["caches"].keys() and a["caches"]
    n, L = len(a["ids"]), a["L"]
    at_l = n - n % L
    assert n % L <= 16 < L  # the last chunk runs at 16
    for key, cache in a["caches"].items():
        want = b["caches"][key]
        assert np.array_equal(cache[:, :at_l], want[:, :at_l]) or cut or not rows_keep_bits(), key
        assert np.abs(cache - want).max() <= 1e-5 * np.abs(want).max(), key
    own = _image_turn(tmp_path_factory, family, "machine")  # the machine's vit rows
    vit_parts = parts("vit")
    pairs = [(own["rows"], b["rows"])]
    if own["deepstack"] is not None:
        pairs.append((own["deepstack"], b["deepstack"]))
    for ours, theirs in pairs:
        assert _cos(ours, theirs) >= 0.99999
        assert np.array_equal(ours, theirs) or vit_parts > 0
