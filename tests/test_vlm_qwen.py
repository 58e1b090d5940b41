"""Qwen's vision-language models: Qwen2.5-VL, Qwen3-VL and Qwen3.5 (its vision tower with its
hybrid text model), built from the real config classes with random weights at the shapes
that decide the layout (head dims 80 / 64 in the vision towers and 128 in the text models,
14 / 16 pixel patches, Qwen2.5-VL's 112-pixel windows with full attention in layers 1 and
3, Qwen3-VL's 48x48 learned position grid and two DeepStack levels, Qwen3.5 at 0.8B's text
shapes), layer counts cut, saved as directories and compiled from them (streamed).

The vision net is compiled for a budget of 400 patches; the test image (230x300) becomes a
smaller grid (16x22 patches of 14, 14x18 of 16), so the padding is masked and the windows
are partial. Checked: the vision rows (and DeepStack rows) equal transformers'
`get_image_features` / `get_video_features` (cos >= 0.99999); f32 greedy tokens with an
image and with a two-frame video equal transformers `generate` on the same processor output
(16 tokens); a net compiled for exactly the image's grid gives the same tokens; M-RoPE
positions equal `get_rope_index` over random prompts of text, images and videos; the
machine equals the interpreter bit for bit.

At real widths (the published Qwen2.5-VL-3B and Qwen3-VL-4B configs of bench/vlm_configs,
two vision and two text layers, the vocabulary cut to 400): the machine's vision rows (and
DeepStack rows) equal transformers' (cos >= 0.99999) and f32 greedy tokens with an image
equal `generate` (16 tokens)."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from filelock import FileLock
from llm_fixtures import shared_dir
from vlm_fixtures import make_image, vlm_dir, vlm_file

from toptpu.backend.contract import (
    ContractError,
    mrope_position_ids,
    qwen_vit_inputs,
)
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader
from toptpu.backend.runtime.runtime import Runtime
from toptpu.frontends.hf_loader import ModelLoadError
from toptpu.frontends.tiny_vlms import tiny_vlm, tiny_vlm_config, vlm_tokenizer

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
N = 16  # new tokens
#: the vision net's budget, as each family's compile asks for it
BUDGET = {"qwen2_5_vl": {"max_pixels": (280, 280)},  # 280*280 / 14^2 = 400 patches
          "qwen3_vl": {"max_patches": 400},
          "qwen3_5": {"max_pixels": (320, 320)}}  # 320*320 / 16^2 = 400 patches
IMAGE = (230, 300)  # (height, width): 16x22 patches of 14, 14x18 of 16
PROMPT = "Describe the image. What is the capital of France?"
FPS = 2.0


def qwen_file(tmp_path_factory: pytest.TempPathFactory, family: str, **extra: Any) -> str:
    kwargs = {**BUDGET[family], **extra}
    return vlm_file(tmp_path_factory, family, seq=256, input_len=32, **kwargs)


def image(seed: int = 0) -> Any:
    return make_image(*IMAGE, seed=seed)


def image_file(tmp_path_factory: pytest.TempPathFactory, seed: int = 0) -> str:
    path = os.path.join(shared_dir(tmp_path_factory), f"qwen-image-{seed}.png")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            image(seed).save(path)
    return path


_HF: dict[str, Any] = {}


def hf_model(tmp_path_factory: pytest.TempPathFactory, family: str) -> Any:
    """The saved directory loaded back by transformers (float32)."""
    if family not in _HF:
        import transformers

        from toptpu.frontends.hf_loader import quiet_transformers
        from toptpu.frontends.vlm import VLM_CLASSES

        path = vlm_dir(tmp_path_factory, family)
        cfg = transformers.AutoConfig.from_pretrained(path)
        with quiet_transformers():
            _HF[family] = getattr(transformers, VLM_CLASSES[cfg.model_type]).from_pretrained(
                path, dtype=torch.float32).eval()
    return _HF[family]


def hf_generate(model: Any, ids: list[int], n: int, **inputs: Any) -> list[int]:
    """transformers greedy `generate` with the processor's `mm_token_type_ids` (1 image, 2
    video tokens), as its processor returns them."""
    cfg = model.config
    types = [[1 if i == cfg.image_token_id else 2 if i == cfg.video_token_id else 0
              for i in ids]]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             mm_token_type_ids=torch.tensor(types), **inputs)
    return out[0, len(ids):].tolist()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# =========================================================================== M-RoPE


def _random_prompt(rng: np.random.Generator, frames_apart: bool
                   ) -> tuple[list[int], list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Token types of a prompt of text, images and videos (as the processor lays them
    out: a Qwen3-VL video is one run per temporal patch, a timestamp between), and the
    grids (t, h, w) in patches."""
    types: list[int] = []
    images, videos = [], []
    for k in range(int(rng.integers(1, 5))):  # `<|vision_start|>` at least between two
        types += [0] * int(rng.integers(0 if k == 0 else 1, 6))
        h, w = (int(rng.integers(1, 7)) * 2 for _ in range(2))
        if rng.random() < 0.5:
            images.append((1, h, w))
            types += [1] * (h * w // 4)
        else:
            t = int(rng.integers(1, 4))
            videos.append((t, h, w))
            for k in range(t if frames_apart else 1):
                types += [0] * (3 if frames_apart else 0)  # '<0.5 seconds>' and the start
                types += [2] * (h * w // 4 * (1 if frames_apart else t))
                types += [0] if frames_apart and k < t - 1 else []
    types += [0] * int(rng.integers(0, 4))
    return types, images, videos


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_are_the_models(family: str) -> None:
    """`mrope_position_ids` == the model's `get_rope_index` over 40 random prompts of text,
    images and videos (Qwen2.5-VL's videos spaced in time by tokens_per_second x seconds
    per temporal patch, Qwen3-VL's laid out frame by frame); counted from a later start it
    is the model's layout after that much text; the next position is where the model's
    rope_deltas continue."""
    import transformers

    cfg = tiny_vlm_config(family)
    with torch.device("meta"):
        model = getattr(transformers, {"qwen2_5_vl": "Qwen2_5_VLModel",
                                       "qwen3_vl": "Qwen3VLModel"}[family])(cfg)
    rng = np.random.default_rng(0)
    tps = int(getattr(cfg.vision_config, "tokens_per_second", 1))
    apart = family != "qwen2_5_vl"
    videos_seen = 0
    for _ in range(40):
        types, images, videos = _random_prompt(rng, apart)
        videos_seen += len(videos)
        seconds = [float(s) for s in rng.choice([0.5, 1.0, 4 / 3, 2.0], len(videos))]
        for before in (0, 7):
            whole = [0] * before + types
            extra = {}
            if videos and not apart:
                extra["second_per_grid_ts"] = torch.tensor(seconds)
            ref, delta = model.get_rope_index(
                torch.zeros(1, len(whole), dtype=torch.long),
                mm_token_type_ids=torch.tensor([whole]),
                image_grid_thw=torch.tensor(images) if images else None,
                video_grid_thw=torch.tensor(videos) if videos else None, **extra)
            intervals = [float(np.float32(tps) * np.float32(s)) for s in seconds]
            ours, nxt = mrope_position_ids(types, images, videos, 2, before, intervals,
                                           frames_apart=apart)
            assert np.array_equal(ours, ref[:, 0, before:].numpy()), (types, images, videos)
            assert nxt == len(whole) + int(delta)
    assert videos_seen > 10
    with pytest.raises(ContractError, match="more image runs than image grids"):
        mrope_position_ids([1] * 4, [], [], 2)
    with pytest.raises(ContractError, match="does not match its grid"):
        mrope_position_ids([1] * 3, [(1, 4, 4)], [], 2)
    with pytest.raises(ContractError, match="more grids than"):
        mrope_position_ids([0, 0], [(1, 2, 2)], [], 2)


def test_vit_inputs_mask_the_padding_and_reorder_by_window() -> None:
    """`qwen_vit_inputs`: a grid smaller than the budget is padded with a block of its own
    in the key masks (no real patch sees padding, frames apart in the full mask, windows
    apart in the window mask); the patches go in window by window and `rows` puts the
    merged rows back; a grid past the budget is refused naming both numbers."""
    from transformers.vision_utils import get_vision_window_index

    grid = (2, 10, 12)  # two frames of 10x12 patches: windows of 8x8 patches are partial
    n = 2 * 10 * 12
    patches = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    inp = qwen_vit_inputs(patches, grid, 256, 2, patch_size=14, window_size=112)
    full, window = inp.feeds["attention_mask"][0, 0], inp.feeds["window_mask"][0, 0]
    assert full.shape == (256, 256) and inp.tokens == n // 4
    assert (full[:n, n:] < 0).all() and (full[n:, :n] < 0).all() and (full[n:, n:] == 0).all()
    assert (full[:120, :120] == 0).all() and (full[:120, 120:n] < 0).all()  # frames apart
    index, cu = get_vision_window_index(torch.tensor([grid]), 2, 112, 14)
    order = (index.numpy()[:, None] * 4 + np.arange(4)).reshape(-1)
    assert np.array_equal(inp.feeds["pixel_values"][:n, 0], order.astype(np.float32))
    for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False):
        assert (window[a:b, a:b] == 0).all() and (window[a:b, :a] < 0).all()
    assert np.array_equal(index.numpy()[inp.rows], np.arange(n // 4))
    with pytest.raises(ContractError, match="240 patches .* exceed the vision net's budget "
                                            "of 200"):
        qwen_vit_inputs(patches, grid, 200, 2, patch_size=14, window_size=112)


# =========================================================================== vision features


def _hf_inputs(rt: Runtime, img: Any) -> dict[str, torch.Tensor]:
    out = rt.vision.processor(img, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_rows_equal_transformers(tmp_path_factory, family: str) -> None:
    """The vision net's rows of an image and of a two-frame video (in f32, padded to the
    budget, Qwen2.5-VL's window order undone) == transformers' `get_image_features` /
    `get_video_features` on the same processor output, cos >= 0.99999, DeepStack levels
    too (Qwen3-VL)."""
    rt = Runtime.open(qwen_file(tmp_path_factory, family), "interpreter")
    model = hf_model(tmp_path_factory, family)
    enc = rt.encode_image(image())
    inputs = _hf_inputs(rt, image())
    assert enc.grid_thw == tuple(inputs["image_grid_thw"][0].tolist())
    assert enc.image_tokens == int(inputs["image_grid_thw"].prod()) // 4 < 100
    frames = [image(1), image(2)]
    video = rt.encode_video(frames, FPS)
    patches = rt.vision.video_patches(frames, FPS)
    assert video.grid_thw == (1, *enc.grid_thw[1:]) and video.modality == "video"
    with torch.no_grad():
        ref = model.model.get_image_features(**inputs)
        ref_video = model.model.get_video_features(torch.from_numpy(patches.patches),
                                                   torch.tensor([patches.grid]))
    for ours, theirs in ((enc, ref), (video, ref_video)):
        assert cos(ours.embeds, torch.cat(list(theirs.pooler_output)).numpy()) >= 0.99999
        levels = getattr(theirs, "deepstack_features", None) or []
        assert len(levels) == (2 if family == "qwen3_vl" else 0)
        for k, feats in enumerate(levels):
            assert cos(ours.deepstack[k], torch.cat(list(feats)).numpy()) >= 0.99999


# =========================================================================== generation


_RUNS: dict[tuple[str, str, str], dict[str, Any]] = {}


def _image_turn(tmp_path_factory, family: str, executor: str, path: str | None = None
                ) -> dict[str, Any]:
    """A fresh conversation with the test image (chat template, N new tokens), run once
    per file and executor: ids, tokens, image rows and every KV cache after it."""
    path = path or qwen_file(tmp_path_factory, family)
    key = (family, executor, path)
    if key not in _RUNS:
        rt = Runtime.open(path, executor)
        ids, images = rt.image_prompt(PROMPT, [image_file(tmp_path_factory)],
                                      chat_template=True)
        res = rt.generate(ids, N, images=images, stop_on_eos=False)
        caches = {f"{i}.{kv}": rt.ex.read(b[i]) for kv, b in (("k", rt.cache_k),
                                                               ("v", rt.cache_v))
                  for i in range(rt.num_layers) if b[i] is not None}
        _RUNS[key] = {"ids": ids, "tokens": res.generated_ids, "embeds": images[0].embeds,
                      "deepstack": images[0].deepstack, "caches": caches,
                      "breakdown": res.modelled_breakdown, "position": rt.next_position}
    return _RUNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_an_image_equals_transformers(tmp_path_factory, family: str) -> None:
    """f32 greedy tokens with an image on the machine == transformers `generate` on the
    same processor output (its M-RoPE positions from `get_rope_index`, Qwen3-VL's DeepStack
    rows added after the first text layers); the prompt spans several prefill chunks."""
    turn = _image_turn(tmp_path_factory, family, "machine")
    ids = turn["ids"]
    model = hf_model(tmp_path_factory, family)
    assert ids.count(model.config.image_token_id) == len(turn["embeds"])
    assert len(ids) > 3 * 32  # prefill chunks of 32: block, then block_kv
    assert len(set(turn["tokens"])) > 2  # the model does not answer with one token
    assert turn["tokens"] == hf_generate(model, ids, N, **_hf_inputs(
        Runtime.open(qwen_file(tmp_path_factory, family), "interpreter"), image()))
    vision = turn["breakdown"]["vision"]  # the vit's modelled time, beside the prefill's
    assert vision["total_s"] > 0 and vision["launches"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_a_video_equals_transformers(tmp_path_factory, family: str) -> None:
    """f32 greedy tokens with a two-frame video (one temporal patch; Qwen3-VL's and
    Qwen3.5's placeholder with its timestamp) == transformers `generate` on the same
    pixel values; Qwen2.5-VL with four frames too (two temporal patches, their positions
    spaced by tokens_per_second x 2 / fps), interpreter."""
    path = qwen_file(tmp_path_factory, family)
    model = hf_model(tmp_path_factory, family)
    counts = (2, 4) if family == "qwen2_5_vl" else (2,)
    for count in counts:
        rt = Runtime.open(path, "interpreter")
        frames = [image(seed) for seed in range(1, count + 1)]
        ids, items = rt.image_prompt("What happens in the video?", [], chat_template=True,
                                     videos=[frames], fps=FPS)
        patches = rt.vision.video_patches(frames, FPS)
        assert patches.grid[0] == count // 2 and items[0].modality == "video"
        text = rt.decode(ids)
        assert ("<1.0 seconds>" in text) == (family != "qwen2_5_vl" and count == 4)
        assert ("<0.2 seconds>" in text) == (family != "qwen2_5_vl")
        res = rt.generate(ids, N if count == 2 else 8, images=items, stop_on_eos=False)
        extra = {"second_per_grid_ts": torch.tensor([2 / FPS])} \
            if family == "qwen2_5_vl" else {}
        assert res.generated_ids == hf_generate(
            model, ids, len(res.generated_ids),
            pixel_values_videos=torch.from_numpy(patches.patches),
            video_grid_thw=torch.tensor([patches.grid]), **extra)


@pytest.mark.slow
def test_a_smaller_grid_gives_the_tokens_of_a_net_of_its_size(tmp_path_factory) -> None:
    """Qwen2.5-VL: the test image's grid is smaller than the 400-patch budget (padding
    masked out of every attention, the windows partial): its tokens equal those of a
    vision net compiled for exactly its grid (no padding). (Every family's padded rows
    equal transformers' unpadded ones: `test_vision_rows_equal_transformers`.)"""
    family = "qwen2_5_vl"
    padded = _image_turn(tmp_path_factory, family, "interpreter")
    exact = len(padded["embeds"]) * 4
    assert exact < 400
    path = vlm_file(tmp_path_factory, family, seq=256, input_len=32, max_patches=exact)
    tight = _image_turn(tmp_path_factory, family, "interpreter", path)
    assert LlmFile(path).header["vision"]["max_patches"] == exact
    assert tight["tokens"] == padded["tokens"]
    assert cos(tight["embeds"], padded["embeds"]) >= 0.99999


@pytest.mark.slow
def test_machine_equals_interpreter_bit_for_bit(tmp_path_factory) -> None:
    """Qwen3-VL with an image: with the same image rows the tokens and every KV cache after
    the turn are the same bits on the machine as on the Tpu interpreter (the text nets at L
    and `deepstack_add`; the last chunk's rows, at the prefill length 16, to f32 rounding).
    The vit's own rows are the interpreter's bits where its plan keeps
    every reduction whole; where a layer group sums a matmul's K in parts (the cost model's
    choice on bm1684x) they agree within cos >= 0.99999 (docs/machine.md). The caches too
    agree to f32 rounding only where the host's BLAS gives a product's rows other bits
    when the machine tiles them (`blas_threads.rows_keep_bits`)."""
    from toptpu.backend.reference.blas_threads import rows_keep_bits
    from toptpu.backend.runtime.machine_executor import MachineExecutor

    path = qwen_file(tmp_path_factory, "qwen3_vl")
    interp = Runtime.open(path, "interpreter")
    machine = Runtime.open(path, "machine")
    ids, images = interp.image_prompt(PROMPT, [image()], chat_template=True)
    rows = machine.encode_image(image())
    parts = sum(c.parts > 1 for c in MachineExecutor(path).program("vit").commands
                if hasattr(c, "parts"))
    for ours, theirs in ((rows.embeds, images[0].embeds),
                         (rows.deepstack, images[0].deepstack)):
        assert cos(ours, theirs) >= 0.99999
        assert np.array_equal(ours, theirs) or parts > 0
    turns = []
    for rt in (machine, interp):
        res = rt.generate(ids, N, images=images, stop_on_eos=False)
        caches = {f"{i}.{kv}": rt.ex.read(b[i]) for kv, b in (("k", rt.cache_k),
                                                               ("v", rt.cache_v))
                  for i in range(rt.num_layers)}
        turns.append((res.generated_ids, caches))
    (m_tokens, m_caches), (i_tokens, i_caches) = turns
    assert m_tokens == i_tokens
    assert sorted(m_caches) == sorted(i_caches) and len(m_caches) == 6
    for name, value in m_caches.items():
        # the chunks at L (those with image rows): the same bits; the prompt's last chunk
        # runs block_kv:16, whose rows agree to f32 rounding only on this host (docs/limits.md)
        want, at_l = i_caches[name], len(ids) - len(ids) % machine.L
        assert len(ids) % machine.L <= 16 < machine.L  # the last chunk runs at 16
        assert np.array_equal(value[:, :at_l], want[:, :at_l]) or not rows_keep_bits(), name
        assert np.abs(value - want).max() <= 1e-5 * np.abs(want).max(), name


# =========================================================================== real widths

#: the published configs checked at their real widths with only the layer counts cut (and
#: the vocabulary, to the tiny tokenizer's 400 rows): two vision layers, the first a window
#: layer and the second a full-attention one as in Qwen2.5-VL-3B (windows in 0-6, full in
#: 7, 15, 23, 31), or with one DeepStack level from the first as in Qwen3-VL-4B (levels from
#: 5, 11 and 17 of 24); two text layers (Qwen3-VL's DeepStack rows added after the first).
#: The image rows are centred (`save_tiny_vlm`'s `centred_image_rows`) and Qwen2.5-VL-3B's
#: embeddings untied (as 7B's are): otherwise, with random weights, the greedy tokens with
#: the test image are one token 16 times; Qwen3-VL-4B's stay tied as published.
PUBLISHED = {"qwen2_5_vl": ("qwen2.5-vl-3b", {"fullatt_block_indexes": [1],
                                              "tie_word_embeddings": False}),
             "qwen3_vl": ("qwen3-vl-4b", {"deepstack_visual_indexes": [0]})}
#: the widths the published configs give (vision hidden, heads, intermediate, patch; text
#: hidden, heads, KV heads, head dim, intermediate), checked on the saved model
REAL_WIDTHS = {"qwen2_5_vl": ((1280, 16, 3420, 14), (2048, 16, 2, 128, 11008)),
               "qwen3_vl": ((1024, 16, 4096, 16), (2560, 32, 8, 128, 9728))}
_CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "vlm_configs")


def real_width_file(tmp_path_factory: pytest.TempPathFactory, family: str
                    ) -> tuple[str, str]:
    """The published config of `family` cut to two vision and two text layers, saved with
    random weights, and that directory compiled (f32, the 400-patch budget)."""
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_vlms import published_vlm_config, save_tiny_vlm

    name, remap = PUBLISHED[family]
    model_dir = os.path.join(shared_dir(tmp_path_factory), f"vlm-{name}-cut")
    path = model_dir + ".toptpu"
    with FileLock(model_dir + ".lock"):
        if not os.path.exists(path):
            config = published_vlm_config(os.path.join(_CONFIGS, name), text_layers=2,
                                          depth=2, **remap)
            with quiet_transformers():
                save_tiny_vlm(model_dir, family, config=config, centred_image_rows=True)
            compile_model(model_dir, path, seq_length=256, max_input_length=32,
                          progress=None, **BUDGET[family])
    return model_dir, path


def real_width_model(model_dir: str, family: str) -> Any:
    """The saved directory loaded back by transformers (float32; not kept between tests),
    its widths checked to be the published ones."""
    import transformers

    from toptpu.frontends.hf_loader import quiet_transformers

    with quiet_transformers():
        model = getattr(transformers, {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                       "qwen3_vl": "Qwen3VLForConditionalGeneration"}[family]
                        ).from_pretrained(model_dir, dtype=torch.float32).eval()
    v, t = model.config.vision_config, model.config.text_config
    assert ((v.hidden_size, v.num_heads, v.intermediate_size, v.patch_size),
            (t.hidden_size, t.num_attention_heads, t.num_key_value_heads,
             t.hidden_size // t.num_attention_heads if family == "qwen2_5_vl" else t.head_dim,
             t.intermediate_size)) == REAL_WIDTHS[family]
    assert (v.depth, t.num_hidden_layers) == (2, 2)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == PUBLISHED[family][1].get("tie_word_embeddings", True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", list(PUBLISHED))
def test_vision_rows_at_real_widths_equal_transformers(tmp_path_factory, family: str) -> None:
    """At the published widths (Qwen2.5-VL-3B's vision tower: hidden 1280, 16 heads of 80,
    its 112-pixel windows in layer 0 and full attention in layer 1; Qwen3-VL-4B's: hidden
    1024, 16 heads of 64, the 48x48 position grid, one DeepStack level), layer counts cut:
    the vit's rows of the test image on the machine (padded to the 400-patch budget) ==
    transformers' `get_image_features` on the same processor output, cos >= 0.99999 in f32,
    the DeepStack rows too."""
    model_dir, path = real_width_file(tmp_path_factory, family)
    model = real_width_model(model_dir, family)
    rt = Runtime.open(path, "machine")
    enc = rt.encode_image(image())
    inputs = _hf_inputs(rt, image())
    assert enc.grid_thw == tuple(inputs["image_grid_thw"][0].tolist())
    with torch.no_grad():
        ref = model.model.get_image_features(**inputs)
    rows = cos(enc.embeds, torch.cat(list(ref.pooler_output)).numpy())
    assert rows >= 0.99999, rows
    levels = getattr(ref, "deepstack_features", None) or []
    deepstack = [] if enc.deepstack is None else list(enc.deepstack)
    assert len(levels) == len(deepstack) == (1 if family == "qwen3_vl" else 0)
    for ours, theirs in zip(deepstack, levels, strict=True):
        level = cos(ours, torch.cat(list(theirs)).numpy())
        assert level >= 0.99999, level


@pytest.mark.slow
@pytest.mark.parametrize("family", list(PUBLISHED))
def test_generation_at_real_widths_equals_transformers(tmp_path_factory, family: str) -> None:
    """At the published widths (Qwen2.5-VL-3B's text model: hidden 2048, 16 heads and 2 KV
    heads of 128, intermediate 11008, M-RoPE sections 16/24/24; Qwen3-VL-4B's: hidden 2560,
    32 and 8 heads of 128, intermediate 9728, interleaved sections 24/20/20, its DeepStack
    rows; vocabulary cut to 400) with two vision and two text layers: f32 greedy tokens
    with an image on the machine == transformers `generate` on the same processor output
    (16 tokens; the prompt spans four prefill chunks of 32)."""
    model_dir, path = real_width_file(tmp_path_factory, family)
    model = real_width_model(model_dir, family)
    rt = Runtime.open(path, "machine")
    ids, images = rt.image_prompt(PROMPT, [image()], chat_template=True)
    assert ids.count(model.config.image_token_id) == images[0].image_tokens
    assert len(ids) > 3 * 32
    res = rt.generate(ids, N, images=images, stop_on_eos=False)
    assert len(set(res.generated_ids)) > 2  # the model does not answer with one token
    assert res.generated_ids == hf_generate(model, ids, N, **_hf_inputs(rt, image()))


# =========================================================================== files and CLI


@pytest.mark.slow
def test_header_and_cli(tmp_path_factory, monkeypatch, capsys) -> None:
    """A Qwen3-VL model file: its header's qwen section (DeepStack levels, the learned
    position grid), `deepstack_add` and [3, n] positions in the text nets (a header without
    the section is refused naming the field); `toptpu run --image` gives the runtime's
    tokens with the vision time in the breakdown, `run --video` takes frames, `toptpu
    chat` takes `/image` and `/video`, `toptpu profile` runs the vit."""
    from toptpu.cli import main

    path = qwen_file(tmp_path_factory, "qwen3_vl")
    header = LlmFile(path).header
    q = header["vision"]["qwen"]
    assert q["deepstack_levels"] == 2 and q["position_grid_side"] == 48 and q["frames_apart"]
    assert header["vision"]["max_patches"] == 400 and "deepstack_add" in header["nets"]
    block = {s["name"]: s["shape"] for s in header["nets"]["block"]["inputs"]}
    assert block["position_ids"] == [3, 32]
    broken = copy.deepcopy(header)
    del broken["vision"]["qwen"]  # its text nets' [3, n] positions then break the contract
    with pytest.raises(HeaderError, match=r"nets\.block\.inputs.*position_ids int32 \[3, 32\]"):
        LlmHeader.from_json(broken)
    broken = copy.deepcopy(header)
    broken["vision"]["qwen"]["video_token_id"] = 10**6
    with pytest.raises(HeaderError, match=r"vision\.qwen\.video_token_id"):
        LlmHeader.from_json(broken)

    img = image_file(tmp_path_factory)
    assert main(["run", path, "--image", img, "--prompt", PROMPT, "--chat-template",
                 "--max-new-tokens", "6", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    turn = _image_turn(tmp_path_factory, "qwen3_vl", "machine")
    assert out["generated_ids"] == turn["tokens"][:6]
    assert out["image_tokens"] == len(turn["embeds"])
    assert out["modelled_breakdown"]["vision"]["total_s"] == pytest.approx(
        out["vision_modelled_s"])
    frames = [image_file(tmp_path_factory, s) for s in (1, 2)]
    assert main(["run", path, "--video", *frames, "--prompt", "What happens?",
                 "--max-new-tokens", "2", "--json", "--executor", "interpreter"]) == 0
    assert json.loads(capsys.readouterr().out)["image_tokens"] == len(turn["embeds"])
    lines = iter([f"/video {','.join(frames)}", f"/image {img} Describe both.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", path, "--max-new-tokens", "2", "--executor", "interpreter"]) == 0
    err = capsys.readouterr().err
    assert "[video 2 frames at 2 fps" in err
    assert f"vision {2 * len(turn['embeds'])} image tokens" in err
    assert main(["profile", path, "--json", "--nets", "vit,deepstack_add"]) == 0
    nets = {n["net"]: n for n in json.loads(capsys.readouterr().out)["nets"]}
    assert nets["vit"]["seconds"] > 0 and nets["deepstack_add"]["seconds"] > 0


@pytest.mark.slow
def test_bad_videos_and_images_are_named(tmp_path_factory) -> None:
    """Frames of different sizes, more frames than the budget has room for, a video
    prompt whose markers do not pair with the videos: one error each, naming it."""
    from toptpu.backend.runtime.errors import GenerationError
    from toptpu.backend.runtime.vision import ImageError

    rt = Runtime.open(qwen_file(tmp_path_factory, "qwen2_5_vl"), "interpreter")
    with pytest.raises(ImageError, match="different sizes"):
        rt.vision.video_patches([image(), make_image(100, 100)], FPS)
    with pytest.raises(ImageError, match="at most 200 frames"):
        rt.vision.video_patches([make_image(30, 30)] * 202, FPS)
    with pytest.raises(GenerationError, match="marks 2 video"):
        rt.image_prompt("<|video_pad|> and <|video_pad|>", [], videos=[[image()]])


def test_what_does_not_fit_is_refused() -> None:
    """--max-pixels on a model without a pixel budget, with --max-patches, or below one
    merged token; --image-size on a Qwen-VL; a config whose image token id is not the
    tokenizer's: refused naming the option or the field."""
    from toptpu.frontends.vlm import load_vlm

    tok = vlm_tokenizer("qwen2_5_vl")
    small = {"hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 1,
             "num_key_value_heads": 1, "num_hidden_layers": 1}  # head_dim 128: M-RoPE's
    vlm = tiny_vlm("qwen2_5_vl", text=small, depth=1)
    with pytest.raises(ModelLoadError, match="not both"):
        load_vlm(vlm, tok, max_pixels=(280, 280), max_patches=400)
    with pytest.raises(ModelLoadError, match="fewer than 4 patches"):
        load_vlm(vlm, tok, max_pixels=(20, 20))
    with pytest.raises(ModelLoadError, match="--image-size do not apply"):
        load_vlm(vlm, tok, image_size=448)
    with pytest.raises(ModelLoadError, match="must be a multiple of 4"):
        load_vlm(vlm, tok, max_patches=402)
    broken = copy.deepcopy(vlm)
    broken.config.video_token_id = broken.config.image_token_id
    with pytest.raises(ModelLoadError, match="video_token_id is .* but the tokenizer's "
                                             "video_token"):
        load_vlm(broken, tok)
    internvl = tiny_vlm("internvl", text={"num_hidden_layers": 1})
    with pytest.raises(ModelLoadError, match="--max-pixels applies to Qwen2.5-VL"):
        load_vlm(internvl, vlm_tokenizer("internvl"), max_pixels=(448, 448))


@pytest.mark.slow
def test_estimate_charges_what_run_charges(tmp_path_factory) -> None:
    """`toptpu estimate`'s vision side from the config alone (placeholder weights) charges
    what the machine charges the compiled Qwen3-VL file: the vit run with its transfers,
    and the prompt's first token with the image rows and the DeepStack adds."""
    from toptpu import vlm_estimate
    from toptpu.backend.contract import StaticShapes
    from toptpu.backend.runtime.accounting import StepModel, merged, total
    from toptpu.backend.target.chips import get_chip
    from toptpu.dialects.common import QuantMode
    from toptpu.estimate import all_prefill_nets, compile_costs
    from toptpu.request import CompileRequest

    path = qwen_file(tmp_path_factory, "qwen3_vl")
    rt = Runtime.open(path, "machine")
    ids, images = rt.image_prompt(PROMPT, [image()], chat_template=True)
    res = rt.generate(ids, 1, images=images)
    chip, shapes = get_chip("bm1684x"), StaticShapes.make(256, 32)
    config = vlm_estimate.vlm_config(vlm_dir(tmp_path_factory, "qwen3_vl"))
    request = CompileRequest(mode=QuantMode.F32, chip=chip, shapes=shapes)
    vision = vlm_estimate.vision_costs(config, request, 400)
    assert vision.tokens == 100 and vision.levels == 2
    assert images[0].modelled_costs.total_s == pytest.approx(vision.image().total_s, rel=1e-9)
    text = compile_costs(config.text_config, request, position_axes=3,
                         build=vlm_estimate.text_placeholder_builder(config.text_config),
                         nets=all_prefill_nets(shapes))
    steps = StepModel(chip, text.io(), text.timings(chip), text.model.num_layers)
    before = ids.index(config.image_token_id)
    # a chunk holding DeepStack rows runs at L, the others at the shortest length
    at_full = range(before, before + images[0].image_tokens)
    charges = [*steps.first_token_charges(len(ids), "greedy", at_full),
               *vision.prefill_charges(steps.chunk, before, images[0].image_tokens)]
    first = res.modelled_breakdown["first_token"]
    assert first["total_s"] == pytest.approx(total(merged(charges)).total_s, rel=1e-9)


@pytest.mark.slow
def test_a_streamed_directory_gives_the_bytes_of_the_in_memory_compile(tmp_path) -> None:
    """A Qwen3-VL directory in bf16 shards compiled by streaming (its text model a skeleton
    through the causal-LM view transformers lacks, its vision tower read whole, its vision
    rotary rebuilt from the config) writes the bytes of the in-memory compile."""
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_vlms import save_tiny_vlm
    from toptpu.frontends.vlm import load_vlm

    small = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2,
             "num_key_value_heads": 1, "num_hidden_layers": 2}
    model_dir = str(tmp_path / "qwen3_vl")
    with quiet_transformers():
        save_tiny_vlm(model_dir, "qwen3_vl", text=small, dtype=torch.bfloat16,
                      max_shard_size="2MB", depth=3, hidden_size=128, num_heads=2,
                      intermediate_size=128)
    kwargs = {"seq_length": 64, "max_input_length": 16, "progress": None}
    streamed, whole = str(tmp_path / "streamed.toptpu"), str(tmp_path / "whole.toptpu")
    compile_model(model_dir, streamed, max_patches=64, **kwargs)
    compile_model(load_vlm(model_dir, max_patches=64), whole, **kwargs)
    with open(streamed, "rb") as a, open(whole, "rb") as b:
        assert a.read() == b.read()
