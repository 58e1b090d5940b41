"""AWQ for mixture-of-experts layers (`toptpu.weight_calibration.awq`, Qwen3-MoE and
Qwen2-MoE): the folded scales leave the layer's float function (router logits, MoE block
and layer outputs) unchanged; each routed expert's down scale is a direct numpy
transcription of the search on the tokens the router sent it; the fast search chooses what
the definition does; experts no search token chose are rounded to nearest and named; the
calibrated compile equals the compile of the checkpoint it exports and `eval`s next to
transformers' float model. Random weights: these prove equalities, not quality."""

from __future__ import annotations

import copy
import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moe_checkpoints import build_model as build_moe
from moe_checkpoints import calibrated_linears
from quant_fixtures import build_tokenizer, write_words

from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main as toptpu_main
from toptpu.frontends.quant import read_quantized_checkpoint
from toptpu.weight_calibration import (
    AwqOptions,
    CalibrationRequest,
    QuantScheme,
    calibrate,
    calibration_data,
)
from toptpu.weight_calibration.awq import awq_layer
from toptpu.weight_calibration.grid import rtn
from toptpu.weight_calibration.layers import FULL_ATTENTION, LayerRunner, layer_plan

LENGTH = 64
ARCHS = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    write_words(path, rng, 60)
    return str(path)


def _outlier_moe(arch: str) -> Any:
    """The tiny MoE (8 experts; Qwen2-MoE with its shared expert and gate) with a few hidden
    channels scaled up, as trained models' activations are."""
    model = build_moe(arch)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        gain = torch.ones(model.config.hidden_size)
        gain[::9] = 12.0
        model.model.embed_tokens.weight *= gain
    return model


def _first_layer(arch: str, tok: Any, text: str) -> tuple[Any, LayerRunner, torch.Tensor]:
    model = _outlier_moe(arch)
    data = calibration_data([text], lambda t: tok(t, add_special_tokens=False)["input_ids"],
                            8, LENGTH)
    x = model.model.embed_tokens(torch.from_numpy(data.tokens)).detach()
    layer = copy.deepcopy(model.model.layers[0])
    return layer, LayerRunner(layer, model.model.rotary_emb, FULL_ATTENTION, LENGTH, 4096), x


def _seen(runner: LayerRunner, x: torch.Tensor) -> dict[str, Any]:
    """The float layer's output, its router logits, its MoE block's output and the routed
    experts' call (hidden [T, H], top-k [T, k]) on `x`."""
    seen: dict[str, Any] = {}
    mlp = runner.layer.get_submodule("mlp")
    hooks = [mlp.gate.register_forward_hook(
                 lambda _m, _a, out: seen.__setitem__("logits", out[0].clone())),
             mlp.register_forward_hook(
                 lambda _m, _a, out: seen.__setitem__("block", out.clone())),
             mlp.experts.register_forward_pre_hook(
                 lambda _m, args: seen.__setitem__("routed", (args[0].clone(),
                                                              args[1].clone())))]
    try:
        with torch.no_grad():
            seen["layer"] = runner.forward(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", ARCHS)
def test_folded_scales_leave_the_moe_layer_float_function_unchanged(
        arch: str, tokenizer: Any, text_file: str) -> None:
    """AWQ's scales searched and folded (no clipping, no rounding): the norm, the router,
    every expert and (Qwen2-MoE) the shared expert and its gate changed, and the router's
    logits, the MoE block's output and the layer's output equal the float layer's to 1e-5
    relative (the routing therefore too)."""
    layer, runner, x = _first_layer(arch, tokenizer, text_file)
    before = _seen(runner, x)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    report = awq_layer(runner, plan, x, QuantScheme(4, 32, False), AwqOptions(clip=False),
                       set(plan.linears) | {"mlp.experts"})
    assert report.ratios["post_attention_layernorm"] > 0, report.ratios
    assert sum(f"mlp.experts.{e}.up_proj" in report.ratios for e in range(8)) == 8
    assert report.unscaled_experts == []
    changed = {n for n, p in layer.named_parameters() if not torch.equal(p, weights[n])}
    expected = {"post_attention_layernorm.weight", "mlp.gate.weight",
                "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    if arch == "qwen2_moe":
        expected |= {"mlp.shared_expert_gate.weight", "mlp.shared_expert.gate_proj.weight",
                     "mlp.shared_expert.down_proj.weight"}
    assert expected <= changed, expected - changed
    after = _seen(runner, x)
    for what in ("logits", "block", "layer"):
        assert _relative(after[what], before[what]) < 1e-5, what
    assert torch.equal(after["routed"][1], before["routed"][1])


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_search_equals_the_definition(arch: str, tokenizer: Any, text_file: str) -> None:
    """The experts' down scales and clipping from the inputs' products choose what the
    definitions choose (`direct=True`: the inspected module rerun per ratio)."""
    layer, runner, x = _first_layer(arch, tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    results = []
    for direct in (True, False):
        copy_of = copy.deepcopy(layer)
        run = LayerRunner(copy_of, runner.block.rotary, FULL_ATTENTION, LENGTH, 4096)
        report = awq_layer(run, plan, x, QuantScheme(4, 32, False), AwqOptions(),
                           set(plan.linears) | {"mlp.experts"}, direct)
        results.append((report.ratios, dict(copy_of.named_parameters())))
    (ratios_direct, direct_weights), (ratios, weights) = results
    assert ratios == ratios_direct and len(ratios) >= 9
    for name, p in weights.items():
        torch.testing.assert_close(p, direct_weights[name], rtol=1e-6, atol=1e-7)


def _fake_quantize(w: np.ndarray, group: int, bits: int = 4) -> np.ndarray:
    """Asymmetric min-max round trip per group of `group` columns, the scale stored in
    float16 (the checkpoint's grid), in float64."""
    maxq = 2 ** bits - 1
    g = w.reshape(-1, group)
    lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
    empty = (lo == 0) & (hi == 0)
    lo[empty], hi[empty] = -1, 1
    scale = ((hi - lo) / maxq).astype(np.float16).astype(np.float64)[:, None]
    zero = np.clip(np.rint(-lo[:, None] / scale), 0, maxq)
    q = np.clip(np.rint(g / scale) + zero, 0, maxq)
    return ((q - zero) * scale).reshape(w.shape)


def _awq_search(w: np.ndarray, x_all: np.ndarray, x_search: np.ndarray, group: int,
                grid: int = 20) -> tuple[float, np.ndarray]:
    """AWQ's scale search for one linear that is its own inspected module, as AutoAWQ
    states it: x_mean = mean |x| over all its tokens, w_mean = mean over rows of |w| /
    (max |w| of its group + 1e-6); for r = 0, 1/grid, ...: s = x_mean^r / (w_mean^(1-r) +
    1e-4) clamped at 1e-4 and divided by sqrt(max s min s); the loss the mean squared
    difference of x (Q(w s) / s)^T from x w^T on the search tokens; the first least."""
    x_mean = np.abs(x_all).mean(0)
    a = np.abs(w).reshape(-1, group)
    w_mean = (a / (a.max(1, keepdims=True) + 1e-6)).reshape(w.shape).mean(0)
    reference = x_search @ w.T
    best: tuple[float, float, np.ndarray] | None = None
    for i in range(grid):
        r = i / grid
        s = np.maximum(x_mean ** r / (w_mean ** (1 - r) + 1e-4), 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        loss = float(((x_search @ (_fake_quantize(w * s, group) / s).T - reference) ** 2).mean())
        if best is None or loss < best[0]:
            best = (loss, r, s)
    assert best is not None
    return best[1], best[2]


def test_each_expert_down_scale_equals_the_numpy_search_on_its_routed_tokens(
        tokenizer: Any, text_file: str) -> None:
    """Each routed expert's down scale (Qwen3-MoE, the search on 2 of the 8 sequences) is
    the numpy transcription's on act(x gate^T) * (x up^T) of the tokens of those sequences
    the router sent that expert, x_mean over every token it was sent: the same ratio, and
    down's columns multiplied by that s (up's rows divided by it)."""
    layer, runner, x = _first_layer("qwen3_moe", tokenizer, text_file)
    hidden, index = _seen(runner, x)["routed"]
    experts = layer.mlp.experts
    inter = experts.gate_up_proj.shape[1] // 2
    gate_up = experts.gate_up_proj.detach().clone().double()
    down = experts.down_proj.detach().clone().double()
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    options = AwqOptions(clip=False, search_tokens=2 * LENGTH)  # sequences 0 and 7
    report = awq_layer(runner, plan, x, QuantScheme(4, 32, False), options,
                       set(plan.linears) | {"mlp.experts"})
    in_search = torch.zeros(8, LENGTH, dtype=torch.bool)
    in_search[[0, 7]] = True
    in_search = in_search.reshape(-1)
    checked = 0
    for e in range(8):
        sent = (index == e).any(-1)
        assert report.expert_tokens[e] == int(sent.sum())
        h = hidden.double()[sent]
        g, u = (h @ gate_up[e, :inter].T), (h @ gate_up[e, inter:].T)
        inner = (torch.nn.functional.silu(g) * u).numpy()
        search = inner[in_search[sent].numpy()]
        assert len(search) > 0
        ratio, s = _awq_search(down[e].numpy(), inner, search, 32)
        assert report.ratios[f"mlp.experts.{e}.up_proj"] == ratio, e
        got = (experts.down_proj[e].detach().double() / down[e]).numpy()
        np.testing.assert_allclose(got, np.broadcast_to(s, got.shape), rtol=1e-5)
        checked += 1
    assert checked == 8


def test_experts_no_search_token_chose_are_rounded_to_nearest_and_named(
        tmp_path: Path, tokenizer: Any, text_file: str) -> None:
    """Calibrated by AWQ on one 4-token sequence (top-2 of 8 experts: some get no token):
    those experts are named on the progress stream and in the checkpoint's config; their
    down is the float down rounded to nearest (no scale, no clip), their gate and up the
    float ones times the layer's shared scale (read back from the router, which takes it
    too) rounded to nearest."""
    model = _outlier_moe("qwen3_moe")
    progress = io.StringIO()
    out = tmp_path / "ck"
    scheme = QuantScheme(4, 32, False)
    report = calibrate(model, str(out), CalibrationRequest("awq", scheme), [text_file],
                       sequences=1, sequence_length=4, tokenizer=tokenizer, progress=progress)
    assert report.rtn_experts, "every expert was chosen by 4 tokens' top-2"
    assert "chosen by no search token" in progress.getvalue()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["calibration"]["rtn_experts"] == report.rtn_experts
    ck = read_quantized_checkpoint(str(out))
    inter = model.config.moe_intermediate_size
    for name in report.rtn_experts:
        i, e = int(name.split(".")[2]), int(name.split(".")[-1])
        mlp = model.model.layers[i].mlp
        router = ck.float_tensors[f"model.layers.{i}.mlp.gate.weight"]
        shared = torch.from_numpy(router[0] / mlp.gate.weight[0].detach().numpy())
        assert not torch.allclose(shared, torch.ones_like(shared))
        fused = mlp.experts
        for proj, w in (("gate_proj", fused.gate_up_proj[e, :inter] * shared),
                        ("up_proj", fused.gate_up_proj[e, inter:] * shared),
                        ("down_proj", fused.down_proj[e])):
            got = ck.linear(f"{name}.{proj}")
            assert got is not None
            want = rtn(w.detach().numpy(), scheme).dequantize()
            np.testing.assert_allclose(got.dequantize(), want, rtol=0, atol=1e-6,
                                       err_msg=f"{name}.{proj}")


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode,again_mode", [("qwen3_moe", "w4f32", "auto"),
                                                  ("qwen2_moe", "w4bf16", "w4bf16")])
def test_awq_moe_compile_equals_its_checkpoint_generates_and_evals(
        arch: str, mode: str, again_mode: str, text_file: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`toptpu compile MOE -q MODE --calibrate awq --save-calibrated CK`: every expert of
    every layer is a linear of its own in the checkpoint (the router and Qwen2-MoE's shared
    expert gate float); `toptpu compile CK` (-q auto: the checkpoint's own mode, w4f32
    here; or the same MODE) reads them all back and gives the same logits bit for bit; the
    model file generates and `eval`s within 5% of transformers' float perplexity."""
    src, ck = tmp_path / "float", tmp_path / "ck"
    out, again = tmp_path / "m.toptpu", tmp_path / "again.toptpu"
    model = build_moe(arch)
    model.save_pretrained(src)
    build_tokenizer().save_pretrained(src)
    small = ["--seq-length", "64", "--max-input-length", "32", "--quiet"]
    assert toptpu_main(["compile", str(src), "-q", mode, "--group-size", "32",
                        "--calibrate", "awq", "--calibration-data", text_file,
                        "--calibration-samples", "8", "--calibration-seq-length", "64",
                        "--save-calibrated", str(ck), "-o", str(out), *small]) == 0
    checkpoint = read_quantized_checkpoint(str(ck))
    assert set(checkpoint.linears) == calibrated_linears(arch)
    config = json.loads((ck / "config.json").read_text())["quantization_config"]
    assert sorted(config.get("extra_config", {})) == (
        [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)]
        if arch == "qwen2_moe" else [])
    assert toptpu_main(["compile", str(ck), "-q", again_mode, "-o", str(again), *small]) == 0
    header = Runtime.open(str(again), "interpreter").header
    assert header["mode"] == mode and header["checkpoint"]["bits"] == 4
    assert header["checkpoint"]["quantized_layers"] == len(checkpoint.linears)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 250, 30)]
    logits = Runtime.open(str(out), "interpreter").sequence_logits(ids)
    assert np.array_equal(logits, Runtime.open(str(again), "interpreter").sequence_logits(ids))
    res = Runtime.open(str(out)).generate([5, 6, 7, 8], 6, stop_on_eos=False)
    assert len(res.generated_ids) == 6
    rng = random.Random(2)
    held = tmp_path / "held.txt"
    write_words(held, rng, 4)
    capsys.readouterr()
    assert toptpu_main(["eval", str(out), "--text", str(held), "--hf", str(src), "--json",
                        "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["problem"] is None and result["predicted_tokens"] > 64
    ppl, ref = result["perplexity"], result["reference"]["perplexity"]
    assert np.isfinite(ppl) and np.isfinite(ref) and abs(ppl / ref - 1) < 0.05, (ppl, ref)
