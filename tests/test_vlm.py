"""Vision-language models (InternVL, MiniCPM-V 4.6 with a Qwen3 text model; with its
Qwen3.5 text model and MiniCPM-V 4.7: tests/test_vlm_qwen3_5.py), tiny models from the real config
classes: the vit net matches the model's own image features (Top f32 and the model file on
the machine, cosine >= 0.99999); greedy generation with an image equals transformers
`generate` (pixel values from the model's own image processor); quantized model files meet
the thresholds of ARCHITECTURE.md per net; images and options that cannot work are clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from vlm_fixtures import (
    IMAGE_SIZE,
    PROMPT,
    hf_generate,
    hf_image_features,
    hf_image_inputs,
    image_path,
    make_image,
    vlm_dir,
    vlm_file,
)

from toptpu.backend.contract import decode_mask, merge_order, prefill_mask
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.backend.runtime.runtime import GenerationError, Runtime
from toptpu.backend.runtime.vision import ImageError, ImagePreprocessor, VisionEncoder
from toptpu.compare import tpu_threshold
from toptpu.compiler import CompileError
from toptpu.compiler import compile as compile_model
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.hf_loader import ModelLoadError
from toptpu.frontends.vlm import load_vlm
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes

pytestmark = pytest.mark.slow  # builds, compiles and runs vision-language models


FAMILIES = ["internvl", "minicpmv"]
N = 24


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return similarity(np.asarray(a, np.float32), np.asarray(b, np.float32)).cosine


# =========================================================================== vit net


@pytest.mark.parametrize("family", FAMILIES)
def test_vit_top_net_matches_the_model_image_features(tmp_path_factory, family: str) -> None:
    """The Top f32 vit net (torch.export + top-pipeline, numpy interpreter) on every tile
    of a real image equals the model's get_image_features."""
    model_dir = vlm_dir(tmp_path_factory, family)
    path = image_path(tmp_path_factory, family)
    vision = load_vlm(model_dir).vision
    assert vision is not None
    spec = vision.net_spec()
    module, store = import_module(spec.module, spec.args, input_names=spec.input_names,
                                  output_names=spec.output_names)
    run_passes(module, top_pipeline_passes(), store=store)
    assert any(op.name == "top.attention" for op in module.walk())
    # the vit inputs of each tile, exactly as the runtime prepares them
    p = ImagePreprocessor({**vision.header(), "mode": "f32"}).prepare(path)
    interp = Interpreter(module, store)
    ours = np.concatenate([interp.run(f).outputs["image_embeds"][0, :n]
                           for f, n in zip(p.feeds, p.rows, strict=True)])
    inputs, _ = hf_image_inputs(model_dir, path)
    ref = hf_image_features(model_dir, inputs)
    assert len(p.feeds) > 2  # several tiles / slices
    assert ours.shape == ref.shape
    assert _cos(ours, ref) >= 0.99999


def test_internvl_rms_norm_qk_norm_and_another_tile_size() -> None:
    """InternViT-6B style blocks (RMS norm, q/k norm) at a tile size other than the
    checkpoint's (position embeddings interpolated once, by the model's own function)."""
    from toptpu.frontends.tiny_vlms import tiny_vlm, vlm_tokenizer

    vlm = tiny_vlm("internvl", norm_type="rms_norm", use_qk_norm=True)
    loaded = load_vlm(vlm, vlm_tokenizer("internvl"), image_size=84)
    vision = loaded.vision
    assert vision is not None and vision.tokens_per_tile == 9
    spec = vision.net_spec()
    vision.check(spec)
    module, store = import_module(spec.module, spec.args, input_names=spec.input_names,
                                  output_names=spec.output_names)
    run_passes(module, top_pipeline_passes(), store=store)
    x = torch.randn(1, 3, 84, 84, generator=torch.Generator().manual_seed(1))
    ours = Interpreter(module, store).run({"pixel_values": x.numpy()}).outputs["image_embeds"]
    with torch.no_grad():
        ref = vlm.get_image_features(pixel_values=x).pooler_output.numpy()
    assert _cos(ours, ref) >= 0.99999


def test_merge_order_is_the_model_window_order() -> None:
    """One 2x2 level reproduces the model's own window index; two levels put the second
    merge's windows on consecutive merged tokens."""
    from transformers.vision_utils import get_vision_window_index

    for h, w in ((4, 4), (4, 8), (8, 12)):
        ref, _ = get_vision_window_index(torch.tensor([[1, h, w]]), 1, 2, 1)
        assert merge_order(h, w, [(2, 2)]).tolist() == ref.tolist()
    order = merge_order(4, 4, [(2, 2), (2, 2)])
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    with pytest.raises(ValueError, match="not divisible"):
        merge_order(6, 4, [(2, 2), (2, 2)])


@pytest.mark.parametrize("family", FAMILIES)
def test_model_file_image_rows_match_the_model(tmp_path_factory, family: str) -> None:
    """The compiled vit net run from the model file on the reference machine (command
    streams, f32) gives the model's image features, with modelled time."""
    model_dir = vlm_dir(tmp_path_factory, family)
    path = image_path(tmp_path_factory, family)
    rt = Runtime.open(vlm_file(tmp_path_factory, family))
    enc = rt.encode_image(path)
    inputs, placeholder = hf_image_inputs(model_dir, path)
    ref = hf_image_features(model_dir, inputs)
    assert enc.embeds.shape == ref.shape
    assert _cos(enc.embeds, ref) >= 0.99999
    assert enc.modelled_s is not None and enc.modelled_s > 0
    assert enc.size == IMAGE_SIZE[family][::-1] and enc.tiles > 2
    # the placeholder text is the processor's own (MiniCPM-V adds the image id when laid out)
    assert rt.vision.expand(rt.vision.marker, [enc]) == placeholder


# =========================================================================== generation


@pytest.mark.parametrize("family,executor", [("internvl", "machine"), ("minicpmv", "machine"),
                                             ("minicpmv", "interpreter")])
def test_generation_with_an_image_equals_transformers(tmp_path_factory, family: str,
                                                      executor: str) -> None:
    model_dir = vlm_dir(tmp_path_factory, family)
    path = image_path(tmp_path_factory, family)
    rt = Runtime.open(vlm_file(tmp_path_factory, family), executor)
    ids, images = rt.image_prompt(PROMPT, [path])
    n_img = ids.count(rt.vision.image_token_id)
    assert n_img == images[0].image_tokens >= 20
    assert len(ids) > 2 * rt.L  # the image tokens and the text span several prefill chunks
    res = rt.generate(ids, N, images=images)
    inputs, placeholder = hf_image_inputs(model_dir, path)
    from transformers import AutoTokenizer

    ref_ids = AutoTokenizer.from_pretrained(model_dir)(placeholder + "\n" + PROMPT)["input_ids"]
    assert ids == ref_ids  # the prompt is laid out as the model's processor lays it out
    assert len(res.generated_ids) >= 16
    assert res.generated_ids == hf_generate(model_dir, ids, inputs, N)
    assert res.image_tokens == n_img and res.vision_s is not None
    assert (res.vision_modelled_s is not None) == (executor == "machine")


def test_chat_with_an_image_keeps_it_in_the_cache(tmp_path_factory) -> None:
    """A chat turn with an image, then a text turn: the second reply equals transformers
    on the whole conversation (the image rows stay in the KV cache)."""
    family = "internvl"
    model_dir = vlm_dir(tmp_path_factory, family)
    path = image_path(tmp_path_factory, family)
    rt = Runtime.open(vlm_file(tmp_path_factory, family))
    r1 = rt.chat("What is in the picture?", 12, images=[path])
    assert r1.image_tokens == 20
    r2 = rt.chat("And the colours?", 12)
    assert r2.image_tokens == 0 and "\n" not in rt.decode(r2.prompt_ids[:1])
    inputs, _ = hf_image_inputs(model_dir, path)
    conversation = r1.prompt_ids + r1.generated_ids + r2.prompt_ids
    assert r2.generated_ids == hf_generate(model_dir, conversation, inputs,
                                           len(r2.generated_ids))


# =========================================================================== quantized nets

_RESULTS: dict[tuple[str, str, str | None], object] = {}


def _quantized(tmp_path_factory, family: str, mode: str, vision_mode: str | None):
    key = (family, mode, vision_mode)
    if key not in _RESULTS:
        out = tmp_path_factory.mktemp("vlmq") / f"{family}-{mode}.toptpu"
        _RESULTS[key] = compile_model(vlm_dir(tmp_path_factory, family), str(out), mode=mode,
                                      seq_length=48, max_input_length=8, max_history=16,
                                      progress=None, keep_modules=True,
                                      vision_mode=vision_mode)
    return _RESULTS[key]


#: sample_head's sampling parameters: a repetition penalty, temperature, top-k and top-p
SAMPLING_FEEDS = {"penalty": 1.3, "temperature": 0.8, "top_k": 5, "top_p": 0.9}


def _text_inputs(net: str, specs: tuple, rng: np.random.Generator, vocab: int
                 ) -> dict[str, np.ndarray]:
    feeds = {}
    for s in specs:
        if s.name == "input_ids":
            feeds[s.name] = rng.integers(0, vocab, s.shape).astype(np.int32)
        elif s.name == "position_ids":
            start = {"block": 0, "block_kv": 10, "block_cache": 20}[net]
            feeds[s.name] = np.arange(start, start + s.shape[1], dtype=np.int32)[None]
        elif s.name == "attention_mask":
            feeds[s.name] = {"block": lambda: prefill_mask(6, 8),
                             "block_kv": lambda: prefill_mask(6, 8, 10, 16),
                             "block_cache": lambda: decode_mask(20, 48)}[net]()
        elif s.name in SAMPLING_FEEDS:  # sample_head's parameters
            feeds[s.name] = np.full(s.shape, SAMPLING_FEEDS[s.name], s.dtype)
        elif s.name == "recent_ids":
            feeds[s.name] = rng.integers(0, vocab, s.shape).astype(np.int32)
        else:
            feeds[s.name] = rng.standard_normal(s.shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("family,mode,vision_mode", [("internvl", "bf16", None),
                                                     ("minicpmv", "w4bf16", None),
                                                     ("internvl", "w4bf16", "w4bf16")])
def test_quantized_nets_meet_their_thresholds(tmp_path_factory, family: str, mode: str,
                                              vision_mode: str | None) -> None:
    """Every net of the model file (interpreter executor) against its Top f32 net: cos >=
    0.99 for bf16 nets, >= 0.98 for w4 nets. The vit net runs a real tile; in w4 modes it
    is bf16 unless --vision-quantize asks for w4."""
    result = _quantized(tmp_path_factory, family, mode, vision_mode)
    vit_mode = result.header["vision"]["mode"]
    assert vit_mode == (vision_mode or "bf16")
    ex = InterpreterExecutor(result.path)
    enc = VisionEncoder(ex, result.header)
    tile = enc.prepare(image_path(tmp_path_factory, family)).feeds[0]
    rng = np.random.default_rng(0)
    vocab = result.header["model"]["vocab_size"]
    for name, net in result.nets.items():
        info = ex.nets()[name]
        feeds = tile if name == "vit" else _text_inputs(name, info.inputs, rng, vocab)
        ref = Interpreter(net.top, result.store).run(feeds).outputs
        bufs = {s.name: ex.alloc(s.shape, s.dtype) for s in (*info.inputs, *info.outputs)}
        for s in info.inputs:
            ex.write(bufs[s.name], feeds[s.name])
        ex.run(name, bufs, layer=0 if net.per_layer else None)
        threshold = tpu_threshold(vit_mode if name == "vit" else mode)
        for s in info.outputs:
            if s.name == "token":
                continue
            cos = _cos(ex.read(bufs[s.name]), ref[s.name])
            assert cos >= threshold, f"{family} {mode} {name} {s.name}: cos {cos}"


# =========================================================================== bad input


def test_images_that_cannot_be_read_are_clear_errors(tmp_path_factory, tmp_path) -> None:
    rt = Runtime.open(vlm_file(tmp_path_factory, "internvl"))
    with pytest.raises(ImageError, match="does not exist"):
        rt.encode_image(tmp_path / "missing.png")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x00not an image at all" * 20)
    with pytest.raises(ImageError, match="not an image Pillow can read"):
        rt.encode_image(bad)
    good = image_path(tmp_path_factory, "internvl")
    trunc = tmp_path / "trunc.png"
    with open(good, "rb") as f:
        trunc.write_bytes(f.read()[:1500])
    with pytest.raises(ImageError, match="corrupt or truncated"):
        rt.encode_image(trunc)
    with pytest.raises(ImageError, match="is a directory"):
        rt.encode_image(tmp_path)
    # prompts whose image tokens and images do not pair
    enc = rt.encode_image(good)
    with pytest.raises(GenerationError, match="marks 2 image"):
        rt.image_prompt(f"{rt.vision.marker} and {rt.vision.marker}", [enc])
    ids = rt.encode("hi") + [rt.vision.image_token_id] * 3
    with pytest.raises(GenerationError, match="holds 3 image tokens"):
        rt.generate(ids, 4)


def test_a_slice_beyond_the_patch_budget_is_an_error(tmp_path_factory, tmp_path) -> None:
    """MiniCPM-V: an extreme aspect ratio makes a slice larger than the compiled budget;
    nothing is resized or cropped to fit."""
    rt = Runtime.open(vlm_file(tmp_path_factory, "minicpmv"))
    path = tmp_path / "strip.png"
    make_image(20, 900).save(path)
    with pytest.raises(ImageError, match=r"static budget of 96 patches; recompile with "
                                         r"--max-patches \d+"):
        rt.encode_image(path)


def test_text_models_take_no_images(tmp_path_factory) -> None:
    from llm_fixtures import compiled, tiny_dir

    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file)
    assert not rt.is_vlm
    with pytest.raises(GenerationError, match="no vision net"):
        rt.encode_image(image_path(tmp_path_factory, "internvl"))
    with pytest.raises(CompileError, match="--image-size, --max-tiles apply to vision"):
        compile_model(tiny_dir(tmp_path_factory, "qwen2"), "/tmp/never.toptpu",
                      image_size=448, max_tiles=4, progress=None)


def test_vlm_load_and_compile_errors(tmp_path_factory, tmp_path) -> None:
    from transformers import MiniCPMV4_6Config

    # a MiniCPM-V whose text model toptpu does not compile (MiniCPM-V 4.6 as released, with
    # Qwen3.5, compiles: tests/test_vlm_qwen3_5.py)
    d = tmp_path / "minicpmv46"
    MiniCPMV4_6Config(vision_config={"num_hidden_layers": 1},
                      text_config={"model_type": "qwen3_next"}).save_pretrained(d)
    with pytest.raises(ModelLoadError, match="qwen3_next, Qwen3-Next"):
        load_vlm(str(d))
    model_dir = vlm_dir(tmp_path_factory, "internvl")
    with pytest.raises(ModelLoadError, match="--image-size 50 does not fit"):
        load_vlm(model_dir, image_size=50)
    with pytest.raises(ModelLoadError, match="--max-tiles must be positive"):
        load_vlm(model_dir, max_tiles=0)
    with pytest.raises(CompileError, match="raise --seq-length or lower --max-tiles"):
        compile_model(model_dir, str(tmp_path / "x.toptpu"), seq_length=32, max_tiles=12,
                      progress=None)


# =========================================================================== command line


def test_cli_run_profile_and_chat_with_images(tmp_path_factory, monkeypatch, capsys) -> None:
    from toptpu.cli import main

    path = vlm_file(tmp_path_factory, "minicpmv")
    image = image_path(tmp_path_factory, "minicpmv")
    assert main(["run", path, "--image", image, "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["image_tokens"] == 24 and out["vision_modelled_s"] > 0
    rt = Runtime.open(path)
    ids, images = rt.image_prompt(PROMPT, [image])
    assert out["generated_ids"] == rt.generate(ids, 8, images=images).generated_ids

    trace = os.path.join(str(tmp_path_factory.mktemp("vlm_trace")), "run.json")
    assert main(["run", path, "--image", image, "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--json", "--trace", trace]) == 0
    traced = json.loads(capsys.readouterr().out)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    (vision,) = [e for e in events if e["name"].startswith("vision:")]
    vits = [e for e in events if e.get("args", {}).get("net") == "vit"]
    assert vits and all(vision["ts"] <= e["ts"] and e["ts"] + e["dur"] <= vision["ts"] +
                        vision["dur"] + 1e-3 for e in vits)
    assert vision["dur"] == pytest.approx(traced["vision_modelled_s"] * 1e6, abs=1e-2)
    assert main(["run", path, "--image", os.path.join(os.path.dirname(image), "nope.png"),
                 "--prompt", "x"]) == 1
    assert "error: image" in capsys.readouterr().err

    assert main(["profile", path, "--json"]) == 0
    nets = {n["net"]: n for n in json.loads(capsys.readouterr().out)["nets"]}
    assert nets["vit"]["seconds"] > 0 and "block_cache" in nets
    assert main(["profile", path]) == 0
    assert "vision (vit, f32): one 112 px slice" in capsys.readouterr().out

    lines = iter(["/image /no/such.png", f"/image {image} Describe the image.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", path, "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "[image '/no/such.png' does not exist]" in err
    assert "image tokens]" in err and "vision 24 image tokens" in err
