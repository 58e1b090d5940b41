"""MiniCPM-V 4.6 and 4.7 as released: their vision tower (as for MiniCPM-V with a Qwen3
text model) with a Qwen3.5 hybrid text model (Gated DeltaNet and gated full attention),
built from the real config classes with random weights (the text model at Qwen3.5-0.8B's
shapes cut to four layers), saved as directories and compiled from them (streamed).

MiniCPM-V 4.7 is 4.6's architecture (transformers' 4.7 classes are 4.6's) with one
difference that changes the tokens: canvas M-RoPE. Its image tokens get positions per axis
(T, H, W) of the text model's multi-axis rotary, laid out on a canvas from the markers
around them, and the text after an image continues past the canvas. The full-attention nets
then take position_ids [3, n] and the runtime lays them out (`canvas_position_ids`, checked
here against the model's own `get_rope_index`). Greedy tokens with an image equal
transformers `generate` (4.7 with the `mm_token_type_ids` its processor returns, without
which transformers falls back to text positions: different tokens), over a second chat turn
too; the machine equals the interpreter (to f32 rounding: tile-by-tile BLAS sums)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from vlm_fixtures import (
    PROMPT,
    hf_generate,
    hf_image_inputs,
    image_path,
    vlm_dir,
    vlm_file,
)

from toptpu.backend.contract import CANVAS_MARKERS, canvas_position_ids
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader
from toptpu.backend.runtime.runtime import Runtime
from toptpu.frontends.hf_loader import ModelLoadError, quiet_transformers
from toptpu.frontends.tiny_vlms import tiny_vlm, tiny_vlm_config, vlm_tokenizer
from toptpu.frontends.vlm import load_vlm

N = 16  # new tokens of the first turn


# =========================================================================== canvas positions


def _image_text(tok, grid: tuple[int, int], sizes: list[list[int]]) -> str:
    """An image's placeholder as MiniCPM-V's processor lays it out for these crops."""
    from types import SimpleNamespace

    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

    layout = SimpleNamespace(slice_mode=True, **{k: getattr(tok, k) for k in (
        "image_token", "image_start_token", "image_end_token", "slice_start_token",
        "slice_end_token")})
    return MiniCPMV4_6Processor.replace_image_token(
        layout, {"grids": [grid], "num_patches_per_image": [len(sizes)],
                 "target_sizes": np.array(sizes)}, 0, image_token_divisor=16)


def test_canvas_positions_are_the_models() -> None:
    """`canvas_position_ids` == MiniCPMV4_7Model.get_rope_index over 30 random layouts: one or
    two images, slice grids of one or more rows (newlines between them), slices of
    different sizes, text before, between and after; counted from a later start it is the
    model's layout of the same ids after that much text; the next position is where the
    model's rope_deltas continue."""
    from transformers import MiniCPMV4_7Model

    cfg = tiny_vlm_config("minicpmv4_7", text={"num_hidden_layers": 1})
    with torch.device("meta"):
        model = MiniCPMV4_7Model(cfg)
    tok = vlm_tokenizer("minicpmv4_7")
    markers = {k: getattr(cfg, k) for k in CANVAS_MARKERS}
    rng = np.random.default_rng(0)
    prefix = tok("Some text before it all.", add_special_tokens=False)["input_ids"]
    newlines = 0
    for _ in range(30):
        text, sizes = "", []
        for k in range(int(rng.integers(1, 3))):
            rows, cols = [(0, 0), (1, 3), (2, 2), (3, 1), (2, 3)][rng.integers(0, 5)]
            def grid() -> list[int]:
                return [int(rng.integers(1, 6)) * 4, int(rng.integers(1, 6)) * 4]

            # the source, then its slices: of one size, or (adaptive upsampling) of several
            crops = [grid(), grid()]
            crops += [grid() if rng.random() < 0.3 else crops[1] for _ in range(rows * cols - 1)]
            crops = crops[:1 + rows * cols]
            text += " pre"[:int(rng.integers(0, 5))] + f"<image_id>{k}</image_id>"
            text += _image_text(tok, (rows, cols), crops)
            sizes += crops
            newlines += rows > 1
        text += "\nWhat is it?" if rng.random() < 0.8 else ""
        ids = tok(text, add_special_tokens=False)["input_ids"]
        image = [i == cfg.image_token_id for i in ids]
        grids = [tuple(s) for s in sizes]
        for before in ([], prefix):
            whole = torch.tensor([before + ids])
            types = torch.tensor([[0] * len(before) + [int(f) for f in image]])
            ref, delta = model.get_rope_index(whole, mm_token_type_ids=types,
                                              target_sizes=torch.tensor(sizes))
            ours, nxt = canvas_position_ids(ids, image, markers, grids, 4, len(before))
            assert np.array_equal(ours, ref[:, 0, len(before):].numpy()), text
            assert nxt == whole.shape[1] + int(delta)
    assert newlines > 5  # rows of slices were laid out
    with pytest.raises(Exception, match="more image crops than"):
        canvas_position_ids(ids, image, markers, grids[:-1], 4)
    with pytest.raises(Exception, match="more patch grids than"):
        canvas_position_ids(ids, image, markers, [*grids, (8, 8)], 4)


def test_multi_axis_nets_compute_the_models_layer() -> None:
    """The full-attention `block` at positions [3, L] (rows and columns apart) computes the
    model's own decoder layer with its multi-axis rotary; cos/sin are the model's bit for
    bit at canvas-like positions."""
    from toptpu.backend.contract import StaticShapes
    from toptpu.frontends.llm import MultiAxisRotary, check_block_matches_model, split_model
    from toptpu.frontends.vlm import text_causal_lm

    small = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
             "head_dim": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 2}
    lm = text_causal_lm(tiny_vlm("minicpmv4_7", text=small))
    rotary = lm.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 500, (3, 40), generator=g)
    x = torch.zeros(1, 40, 8)
    ref = rotary(x, pos[:, None, :])
    ours = MultiAxisRotary(rotary)(x, pos.int())
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    specs = split_model(lm, StaticShapes.make(64, 16), layer=3, position_axes=3)
    block = next(s for s in specs if s.name == "block")
    assert tuple(block.args[1].shape) == (3, 16) and not torch.equal(block.args[1][0],
                                                                      block.args[1][1])
    check_block_matches_model(lm, block, layer_index=3)


# =========================================================================== generation


@dataclass
class Turn:
    """A first turn with the family's test image, and what it left in the conversation."""

    ids: list[int]
    images: list
    generated: list[int]
    embeds: np.ndarray
    state: dict[str, np.ndarray]  # every linear-attention state and KV cache, copied


_TURNS: dict[tuple[str, str], Turn] = {}


def _snapshot(rt: Runtime) -> dict[str, np.ndarray]:
    out = {}
    for layer in range(rt.num_layers):
        if rt.linear[layer]:
            out.update({f"{layer}.{n}": rt.ex.read(b) for n, b in rt.states[layer].items()})
        else:
            out[f"{layer}.k"] = rt.ex.read(rt.cache_k[layer])
            out[f"{layer}.v"] = rt.ex.read(rt.cache_v[layer])
    return out


def _first_turn(tmp_path_factory, family: str, executor: str = "machine"
                ) -> tuple[Runtime | None, Turn]:
    """A fresh conversation with the family's test image (N new tokens), run once per
    session and executor: the runtime (None when the turn was run before) and the turn."""
    key = (family, executor)
    if key in _TURNS:
        return None, _TURNS[key]
    rt = Runtime.open(vlm_file(tmp_path_factory, family), executor)
    ids, images = rt.image_prompt(PROMPT, [image_path(tmp_path_factory, family)])
    res = rt.generate(ids, N, images=images)
    assert res.stop_reason == "max_new_tokens"
    _TURNS[key] = Turn(ids, images, res.generated_ids, images[0].embeds, _snapshot(rt))
    return rt, _TURNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["minicpmv4_6", "minicpmv4_7"])
def test_generation_with_an_image_equals_transformers(tmp_path_factory, family: str) -> None:
    """f32 greedy tokens with an image on the machine == transformers `generate` on the
    same processor output. 4.7's full-attention nets take a position per axis and its
    tokens need them (transformers without the canvas gives others), and a second turn of
    text in the same conversation (its positions continuing past the canvas, the states and
    the KV cache carried) == `generate` on the whole conversation."""
    model_dir = vlm_dir(tmp_path_factory, family)
    _TURNS.pop((family, "machine"), None)  # the second turn needs the runtime
    rt, turn = _first_turn(tmp_path_factory, family)
    ids, images = turn.ids, turn.images
    assert rt is not None and rt.linear == [True, True, True, False]
    assert rt.position_axes == (3 if family == "minicpmv4_7" else 1)
    assert ids.count(rt.vision.image_token_id) == images[0].image_tokens == 20
    assert images[0].grids == ((8, 8),) * 5  # a 2x2 slice grid: a newline between rows
    assert len(ids) > 2 * rt.L  # the prompt spans several prefill chunks: block_kv
    inputs, placeholder = hf_image_inputs(model_dir, image_path(tmp_path_factory, family))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert ids == tok(placeholder + "\n" + PROMPT)["input_ids"]
    assert len(turn.generated) >= 16
    assert turn.generated == hf_generate(model_dir, ids, inputs, N)
    if family == "minicpmv4_6":
        return
    with quiet_transformers():
        flat = hf_generate(model_dir, ids, inputs, 8, canvas=False)
    assert flat != turn.generated[:8]  # the canvas positions decide tokens here
    more = rt.encode(" And what colour is the disc?", add_special_tokens=False)
    res2 = rt.generate(more, 8, keep_history=True)
    assert rt.next_position < rt.position  # a canvas takes fewer positions than tokens
    conversation = ids + turn.generated + more
    assert res2.generated_ids == hf_generate(model_dir, conversation, inputs, 8)


@pytest.mark.slow
def test_machine_equals_interpreter_bit_for_bit(tmp_path_factory) -> None:
    """MiniCPM-V 4.7 with an image: the tokens are the same on the machine (command
    streams) as on the Tpu interpreter, and the image rows, every linear-attention state
    and the full-attention layer's KV cache after the turn agree to f32 rounding. Not bit
    for bit: the machine multiplies the vision net's matrices tile by tile, and a BLAS may
    sum a tile's dot products in another order than the whole matrix's (OpenBLAS picks
    small-matrix kernels by size on AVX-512 CPUs: 1e-7 apart on CI's machine)."""
    _, m = _first_turn(tmp_path_factory, "minicpmv4_7", "machine")
    _, i = _first_turn(tmp_path_factory, "minicpmv4_7", "interpreter")
    assert m.generated == i.generated
    np.testing.assert_allclose(m.embeds, i.embeds, rtol=1e-5, atol=1e-6)
    assert sorted(m.state) == sorted(i.state) and len(m.state) == 3 * 2 + 2
    for name, value in m.state.items():
        np.testing.assert_allclose(value, i.state[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_header_and_cli_of_a_canvas_model(tmp_path_factory, monkeypatch, capsys) -> None:
    """A 4.7 model file: its header names the canvas markers and its full-attention nets
    take [3, n] positions (a header without the markers, or with one of them wrong, is
    refused naming the field); `toptpu run --image` gives the runtime's tokens, `toptpu
    chat` takes `/image`, `toptpu profile` runs the vision net and layer 0's. (Profiling
    a variant net, `block@3`, needs it run with layer 3's weights: not here yet.)"""
    from toptpu.cli import main

    path = vlm_file(tmp_path_factory, "minicpmv4_7")
    image = image_path(tmp_path_factory, "minicpmv4_7")
    header = LlmFile(path).header
    assert sorted(header["vision"]["canvas_markers"]) == sorted(CANVAS_MARKERS)
    block = {s["name"]: s["shape"] for s in header["nets"]["block@3"]["inputs"]}
    assert block["position_ids"] == [3, 16]
    no_canvas = copy.deepcopy(header)
    del no_canvas["vision"]["canvas_markers"]
    with pytest.raises(HeaderError, match=r"nets\.block@3\.inputs.*position_ids"):
        LlmHeader.from_json(no_canvas)
    bad = copy.deepcopy(header)
    bad["vision"]["canvas_markers"]["newline_id"] = 10**6
    with pytest.raises(HeaderError, match=r"vision\.canvas_markers\.newline_id"):
        LlmHeader.from_json(bad)

    assert main(["run", path, "--image", image, "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["image_tokens"] == 20
    assert out["generated_ids"] == _first_turn(tmp_path_factory, "minicpmv4_7")[1].generated[:6]
    lines = iter([f"/image {image} Describe the image.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", path, "--max-new-tokens", "4"]) == 0
    assert "vision 20 image tokens" in capsys.readouterr().err
    assert main(["profile", path, "--json", "--nets", "vit,block_kv"]) == 0
    nets = {n["net"]: n for n in json.loads(capsys.readouterr().out)["nets"]}
    assert nets["vit"]["seconds"] > 0 and nets["block_kv"]["seconds"] > 0
    # profile feeds [3, n] positions the text positions on every axis
    from toptpu.profile_cli import _placeholder

    assert _placeholder("position_ids", (3, 4), "int32").tolist() == [[0, 1, 2, 3]] * 3


# =========================================================================== refusals


def test_what_is_not_supported_is_named(tmp_path) -> None:
    """A MiniCPM-V whose text model is Qwen3-Next is refused naming it; a
    4.7 config without its canvas markers, one whose marker is not the tokenizer's, and a
    4.7 whose text model has no multi-axis rotary are refused naming the field."""
    from transformers import MiniCPMV4_6Config

    for text, name in (({"model_type": "qwen3_next"}, "Qwen3-Next"),):
        d = tmp_path / text["model_type"]
        MiniCPMV4_6Config(vision_config={"num_hidden_layers": 1},
                          text_config=text).save_pretrained(d)
        with pytest.raises(ModelLoadError, match=f"{text['model_type']}, {name}"):
            load_vlm(str(d))
    small = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 1,
             "linear_num_value_heads": 1, "linear_key_head_dim": 32,
             "linear_value_head_dim": 32}
    tok = vlm_tokenizer("minicpmv4_7")
    vlm = tiny_vlm("minicpmv4_7", text=small)
    for field, value, match in (("newline_id", None, "newline_id is None"),
                                ("slice_end_id", vlm.config.slice_start_id,
                                 "slice_end_id is .* but the tokenizer's slice_end_token"),
                                ("newline_id", 3, "newline_id is 3 but the tokenizer makes")):
        broken = copy.deepcopy(vlm)
        setattr(broken.config, field, value)
        with pytest.raises(ModelLoadError, match=match):
            load_vlm(broken, tok)
    qwen3 = tiny_vlm("minicpmv4_7", text={"model_type": "qwen3"})
    with pytest.raises(ModelLoadError, match="multi-axis .* rotary, which its qwen3 text"):
        load_vlm(qwen3, tok)
