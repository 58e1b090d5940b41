"""Calibrated 4-bit quantization (`toptpu.weight_calibration`): GPTQ against a direct
transcription of the paper's Algorithm 1, AWQ's folding against the float layer, calibrated
error against round-to-nearest, the calibration data refusals, and the exported checkpoint
in the real consumers (transformers with auto-round's CPU kernels; toptpu's own reader and
compile) against the weights the calibration produced."""

from __future__ import annotations

import copy
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from quant_fixtures import build_model, build_tokenizer

from toptpu.frontends.quant import (
    read_quantized_checkpoint,
    unpack_int32_columns,
    unpack_int32_rows,
)
from toptpu.weight_calibration import (
    AwqOptions,
    CalibrationDataError,
    CalibrationRequest,
    QuantScheme,
    SignRoundOptions,
    calibrate,
    calibration_data,
)
from toptpu.weight_calibration.awq import awq_layer
from toptpu.weight_calibration.export import pack_columns, pack_rows
from toptpu.weight_calibration.gptq import gptq
from toptpu.weight_calibration.grid import QuantizedWeights, grid_params, mse_grid_params, rtn
from toptpu.weight_calibration.layers import FULL_ATTENTION, LayerRunner, layer_plan

# ----------------------------------------------------------------------------- GPTQ

def _paper_grid(w: np.ndarray, bits: int, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's min-max grid per row (the reference code's Quantizer.find_params), the scale
    rounded to float16 as the checkpoint stores it."""
    maxq = 2 ** bits - 1
    lo, hi = np.minimum(w.min(1), 0), np.maximum(w.max(1), 0)
    if sym:
        hi = np.maximum(-lo, hi)
        lo = np.where(lo < 0, -hi, lo)
    both_zero = (lo == 0) & (hi == 0)
    lo[both_zero], hi[both_zero] = -1, 1
    scale = ((hi - lo) / maxq).astype(np.float16).astype(np.float64)
    zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.clip(np.rint(-lo / scale), 0, maxq)
    return scale, zero


def _reference_mse_grid(w: np.ndarray, bits: int, sym: bool, grid: int = 100,
                        maxshrink: float = 0.8, norm: float = 2.4
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The GPTQ reference code's `Quantizer.find_params` with ``mse=True`` (its defaults:
    grid 100, maxshrink 0.8, norm 2.4), row by row in plain Python: the min/max range
    shrunk by p = 1 - i / grid, the first p with the least sum |dequantized - w|^norm
    kept; the scale rounded to float16 before the zero point (the grid's one change); the
    error in float32, as the reference's torch tensors are."""
    maxq = 2 ** bits - 1
    scales, zeros = [], []
    for row in np.asarray(w, dtype=np.float64):
        row32 = row.astype(np.float32)
        xmin, xmax = min(row.min(), 0.0), max(row.max(), 0.0)
        if sym:
            xmax = max(abs(xmin), xmax)
            if xmin < 0:
                xmin = -xmax
        if xmin == 0 and xmax == 0:
            xmin, xmax = -1.0, 1.0
        best, chosen = float("inf"), (0.0, 0.0)
        for i in range(int(maxshrink * grid)):
            p = 1 - i / grid
            xmin1, xmax1 = p * xmin, p * xmax
            scale1 = float(np.float16((xmax1 - xmin1) / maxq))
            zero1 = (maxq + 1) / 2 if sym else float(np.rint(-xmin1 / scale1))
            s32, z32 = np.float32(scale1), np.float32(zero1)
            q = np.clip(np.rint(row32 / s32) + z32, 0, maxq)
            err = float(np.sum(np.abs((q - z32) * s32 - row32) ** np.float32(norm)))
            if err < best:
                best, chosen = err, (scale1, zero1)
        scales.append(chosen[0])
        zeros.append(chosen[1])
    return np.array(scales), np.array(zeros)


def _algorithm_1(weight: np.ndarray, hessian: np.ndarray, bits: int, group: int, sym: bool,
                 act_order: bool, percdamp: float = 0.01, grid: Any = _paper_grid
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ as the paper's Algorithm 1 states it, without lazy batches: every column's error
    is spread over all later columns at once. Groups: without act-order a group's grid comes
    from its columns as updated when its first column is reached; with act-order (columns
    by descending diag(H)) from the original weights of its own channels (static groups);
    each grid by `grid` (the min/max rule, or `_reference_mse_grid`)."""
    w, h = weight.astype(np.float64).copy(), hessian.astype(np.float64).copy()
    n, k = w.shape
    group = k if group == -1 else group
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    scale, zero = np.zeros((n, k // group)), np.zeros((n, k // group))
    if act_order or group == k:
        for g in range(k // group):
            scale[:, g], zero[:, g] = grid(w[:, g * group:(g + 1) * group], bits, sym)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h = w[:, order], h[order][:, order]
    h += percdamp * np.mean(np.diag(h)) * np.eye(k)
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1 <- Cholesky(H^-1)^T
    q = np.zeros((n, k))
    for j in range(k):
        g = order[j] // group
        if not act_order and group < k and j % group == 0:
            scale[:, g], zero[:, g] = grid(w[:, j:j + group], bits, sym)
        q[:, j] = np.clip(np.rint(w[:, j] / scale[:, g]) + zero[:, g], 0, 2 ** bits - 1)
        err = (w[:, j] - (q[:, j] - zero[:, g]) * scale[:, g]) / hinv[j, j]
        w[:, j:] -= np.outer(err, hinv[j, j:])
    return q[:, np.argsort(order)], scale, zero


def _structured_inputs(k: int, tokens: int, seed: int) -> np.ndarray:
    """Correlated activations with per-channel magnitudes over two orders of magnitude and a
    channel that is never active."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 8)) @ rng.standard_normal((8, k))
    x = (x + rng.standard_normal((tokens, k))) * np.exp(rng.standard_normal(k))
    x[:, 3] = 0
    return x


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_equals_algorithm_1(group: int, sym: bool, act_order: bool, bits: int) -> None:
    rng = np.random.default_rng(group + 7 * sym + 11 * act_order + bits)
    weight = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    x = _structured_inputs(256, 1024, 1)
    hessian = 2 * x.T @ x / len(x)
    got = gptq(weight, hessian, QuantScheme(bits, group, sym), act_order=act_order,
               block_size=64)
    q, scale, zero = _algorithm_1(weight, hessian, bits, group, sym, act_order)
    assert np.array_equal(got.weights.qweight, q.astype(np.uint8))
    assert np.array_equal(got.weights.scales.astype(np.float64), scale)
    assert np.array_equal(got.weights.zeros, zero.astype(np.uint8))
    assert got.percdamp == 0.01


@pytest.mark.parametrize("bits,sym", [(4, False), (4, True), (8, False)])
def test_mse_grid_equals_the_reference_rule(bits: int, sym: bool) -> None:
    """`mse_grid_params` chooses each group's scale and zero point as a plain transcription
    of the GPTQ reference's MSE grid does, on groups with outliers, one sign only, or all
    zeros; at 4 bits it shrinks half the groups' ranges or more (the min/max grid is its
    p = 1); it never raises a group's |error|^2.4 sum."""
    rng = np.random.default_rng(bits + sym)
    w = rng.standard_normal((40, 64)) * 0.05
    w[::5, 7] *= 12  # an outlier in some groups
    w[3] = np.abs(w[3])
    w[4] = -np.abs(w[4])
    w[6] = 0.0
    scheme = QuantScheme(bits, 64, sym)
    scale, zero = mse_grid_params(w, scheme)
    ref_scale, ref_zero = _reference_mse_grid(w, bits, sym)
    assert np.array_equal(scale, ref_scale) and np.array_equal(zero, ref_zero)
    assert np.array_equal(grid_params(w, scheme, "mse")[0], scale)
    minmax_scale, minmax_zero = grid_params(w, scheme)
    if bits == 4:  # at 8 bits a shrunk range seldom pays
        assert (scale < minmax_scale).sum() >= 20

    def err(s: np.ndarray, z: np.ndarray) -> np.ndarray:
        w32, s32, z32 = w.astype(np.float32), s.astype(np.float32), z.astype(np.float32)
        q = np.clip(np.rint(w32 / s32[:, None]) + z32[:, None], 0, scheme.maxq)
        return np.sum(np.abs((q - z32[:, None]) * s32[:, None] - w32) ** np.float32(2.4), axis=1)

    assert np.all(err(scale, zero) <= err(minmax_scale, minmax_zero))


@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_mse_ranges_equals_algorithm_1(group: int, sym: bool, act_order: bool) -> None:
    """GPTQ with ``ranges="mse"``: Algorithm 1 with each group's grid by the reference's MSE
    rule (static groups: on the original weights; otherwise on the columns as updated when
    the group's first column is reached), integers and grids exactly; not min/max's."""
    rng = np.random.default_rng(abs(group) + 5 * sym + 3 * act_order)
    weight = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    x = _structured_inputs(256, 1024, 2)
    hessian = 2 * x.T @ x / len(x)
    scheme = QuantScheme(4, group, sym)
    got = gptq(weight, hessian, scheme, act_order=act_order, block_size=64, ranges="mse")
    q, scale, zero = _algorithm_1(weight, hessian, 4, group, sym, act_order,
                                  grid=_reference_mse_grid)
    assert np.array_equal(got.weights.qweight, q.astype(np.uint8))
    assert np.array_equal(got.weights.scales.astype(np.float64), scale)
    assert np.array_equal(got.weights.zeros, zero.astype(np.uint8))
    minmax = gptq(weight, hessian, scheme, act_order=act_order, block_size=64)
    assert not np.array_equal(minmax.weights.scales, got.weights.scales)


def _gptaq_reference(weight: np.ndarray, hessian: np.ndarray, cross: np.ndarray, bits: int,
                     group: int, sym: bool, act_order: bool, block: int,
                     percdamp: float = 0.01, alpha: float = 0.25
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTAQ as its reference code's `fasterquant` does it, in float64 numpy: ``P = alpha
    triu(dXX^T U^T, 1) U``; lazy batches of `block` columns, within a block each column's
    update ``e U[j, j:] - w P[j, j:]`` (w before rounding), after it ``Err U - W1 P`` (W1 the
    block's columns, rounded by then). Static groups or one group per row."""
    w, h, d = weight.astype(np.float64).copy(), hessian.copy(), cross.copy()
    n, k = w.shape
    group = k if group == -1 else group
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    d[:, dead] = 0
    scale, zero = np.zeros((n, k // group)), np.zeros((n, k // group))
    for g in range(k // group):
        scale[:, g], zero[:, g] = _paper_grid(w[:, g * group:(g + 1) * group], bits, sym)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h, d = w[:, order], h[order][:, order], d[order][:, order]
    h += percdamp * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    p = alpha * np.triu(d @ u.T, 1) @ u
    q = np.zeros((n, k))
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1 = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        for i in range(i2 - i1):
            j, col = i1 + i, w1[:, i].copy()
            g = order[j] // group
            q[:, j] = np.clip(np.rint(col / scale[:, g]) + zero[:, g], 0, 2 ** bits - 1)
            err1[:, i] = (col - (q[:, j] - zero[:, g]) * scale[:, g]) / u[j, j]
            w1[:, i:] -= np.outer(err1[:, i], u[j, j:i2]) - np.outer(col, p[j, j:i2])
        w[:, i2:] -= err1 @ u[i1:i2, i2:] - w1 @ p[i1:i2, i2:]
    return q[:, np.argsort(order)], scale, zero


@pytest.mark.parametrize("act_order,group,sym", [(True, 32, False), (True, 64, True),
                                                 (False, -1, False)])
def test_gptaq_equals_its_reference_algorithm(act_order: bool, group: int, sym: bool) -> None:
    """GPTQ with GPTAQ's asymmetry term (`asymmetry_term` of ``dXX^T`` summed by
    `AsymmetryAccumulator` over two batches) gives exactly the integers and grids of a
    transcription of GPTAQ's reference `fasterquant`; against the float model's outputs
    ``X_float W^T`` its error is below plain GPTQ's on the same inputs."""
    from toptpu.weight_calibration.gptq import (
        AsymmetryAccumulator,
        HessianAccumulator,
        asymmetry_term,
        prepare_hessian,
    )

    rng = np.random.default_rng(abs(group) + act_order)
    weight = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    x_float = _structured_inputs(256, 1024, 4).astype(np.float32)
    x = (x_float * (1 + 0.1 * rng.standard_normal(256))
         + 0.2 * rng.standard_normal(x_float.shape)).astype(np.float32)
    x[:, 3] = 0
    acc, cross_acc = HessianAccumulator(256, "float64"), AsymmetryAccumulator(256)
    for rows in (slice(0, 600), slice(600, 1024)):
        acc.add(torch.from_numpy(x[rows]))
        cross_acc.add(torch.from_numpy(x_float[rows]), torch.from_numpy(x[rows]))
    hessian, cross = acc.hessian(), cross_acc.cross().astype(np.float64)
    x64, xf64 = x.astype(np.float64), x_float.astype(np.float64)
    np.testing.assert_allclose(cross, 2 * (xf64 - x64).T @ x64 / 1024, rtol=1e-5,
                               atol=1e-5 * np.abs(cross).max())
    scheme = QuantScheme(4, group, sym)
    prepared = prepare_hessian(hessian, act_order=act_order)
    got = gptq(weight, prepared, scheme, act_order=act_order, block_size=64,
               asymmetry=asymmetry_term(cross.copy(), prepared))
    q, scale, zero = _gptaq_reference(weight, hessian, cross, 4, group, sym, act_order, 64)
    assert np.array_equal(got.weights.qweight, q.astype(np.uint8))
    assert np.array_equal(got.weights.scales.astype(np.float64), scale)
    assert np.array_equal(got.weights.zeros, zero.astype(np.uint8))
    plain = gptq(weight, prepared, scheme, act_order=act_order, block_size=64)
    target = xf64 @ weight.T.astype(np.float64)

    def error(qw: QuantizedWeights) -> float:
        return float(np.mean((x64 @ qw.dequantize().T.astype(np.float64) - target) ** 2))

    assert error(got.weights) < error(plain.weights)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [5, 257, 700])
def test_in_place_factor_is_torchs_bit_for_bit(dtype: type, k: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The inverse's Cholesky factor made by LAPACK in the Hessian's own memory is exactly
    what torch's cholesky / cholesky_inverse / cholesky(upper) give (zeros below)."""
    from toptpu.weight_calibration import gptq as gptq_module

    x = torch.from_numpy(_structured_inputs(k, 2 * k + 64, k).astype(dtype))
    hessian = (2 * x.T @ x / len(x)).numpy()
    expected = hessian.copy()
    got = gptq_module.inverse_cholesky_upper(hessian, 0.01)
    with monkeypatch.context() as m:  # this torch's own functions
        m.setattr(gptq_module, "_lapack", lambda name: None)
        expected = gptq_module.inverse_cholesky_upper(expected, 0.01)
    assert got is hessian
    assert np.array_equal(got, expected)
    assert not np.tril(got, -1).any()


def test_in_place_factor_refuses_a_matrix_not_positive_definite() -> None:
    from toptpu.weight_calibration.gptq import NotPositiveDefinite, inverse_cholesky_upper

    h = np.array([[1.0, 2.0], [2.0, 1.0]], np.float32)
    with pytest.raises(NotPositiveDefinite):
        inverse_cholesky_upper(h, 0.01)


@pytest.mark.parametrize("group", [32, 128])
def test_calibrated_error_below_round_to_nearest(group: int) -> None:
    """On a linear with structured activations the output error of GPTQ's integers is well
    below round-to-nearest's on the same grid (and below toptpu's own RTN), on held-back
    inputs of the same distribution."""
    from toptpu.passes.quantize import quantize_rtn

    rng = np.random.default_rng(group)
    weight = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    x = _structured_inputs(256, 2048, 2)
    fit, held = x[:1024], x[1024:]
    scheme = QuantScheme(4, group, False)
    ref = held @ weight.T
    calibrated = gptq(weight, 2 * fit.T @ fit / len(fit), scheme, act_order=True)
    err_gptq = np.mean((held @ calibrated.weights.dequantize().T - ref) ** 2)
    err_rtn = np.mean((held @ rtn(weight, scheme).dequantize().T - ref) ** 2)
    own = quantize_rtn(weight, 4, group, False, np.dtype(np.float16))
    q = np.stack([own.qweight & 15, own.qweight >> 4], axis=-1).reshape(weight.shape)
    g = np.arange(256) // group
    own_w = (q.astype(np.float32) - own.zeros[:, g]) * own.scales.astype(np.float32)[:, g]
    err_own = np.mean((held @ own_w.T - ref) ** 2)
    assert err_gptq < 0.5 * err_rtn
    assert err_gptq < 0.5 * err_own


def test_pack_round_trip() -> None:
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        q = rng.integers(0, 2 ** bits, (24, 64)).astype(np.uint8)
        assert np.array_equal(unpack_int32_rows(pack_rows(q, bits), bits).T, q)
        z = rng.integers(0, 2 ** bits, (4, 24)).astype(np.uint8)
        assert np.array_equal(unpack_int32_columns(pack_columns(z, bits), bits), z)


# ----------------------------------------------------------------------------- models

WORDS = [f"w{i}" for i in range(240)]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(60)))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _encode(tok: Any) -> Any:
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _outlier_model(arch: str) -> Any:
    """A tiny model whose hidden channels differ in scale (a few large ones), as trained
    models' activations do: the embedding's columns scaled."""
    model = build_model(arch)
    with torch.no_grad():
        gain = torch.ones(model.config.hidden_size)
        gain[::9] = 12.0
        model.model.embed_tokens.weight *= gain
    return model


def _first_layer_setup(arch: str, tok: Any, text: str
                       ) -> tuple[Any, torch.nn.Module, LayerRunner, torch.Tensor]:
    model = _outlier_model(arch)
    model.config._attn_implementation = "sdpa"
    data = calibration_data([text], _encode(tok), 8, 64)
    x = model.model.embed_tokens(torch.from_numpy(data.tokens)).detach()
    layer = copy.deepcopy(model.model.layers[0])
    runner = LayerRunner(layer, model.model.rotary_emb, FULL_ATTENTION, 64, 4096)
    return model, layer, runner, x


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_awq_folded_layer_equals_the_float_layer(arch: str, tokenizer: Any,
                                                 text_file: str) -> None:
    """AWQ's searched scales folded into the norms and linears (no clipping) leave the layer's
    float function as it was, to float32 rounding; the scales are not all 1."""
    model, layer, runner, x = _first_layer_setup(arch, tokenizer, text_file)
    before = runner.forward(x)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    report = awq_layer(runner, plan, x, QuantScheme(4, 32, False), AwqOptions(clip=False),
                       set(plan.linears))
    assert any(r > 0 for r in report.ratios.values())
    changed = [n for n, p in layer.named_parameters() if not torch.equal(p, weights[n])]
    assert "input_layernorm.weight" in changed and "mlp.down_proj.weight" in changed
    after = runner.forward(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("group", [32, 64])
def test_awq_fast_search_equals_the_definition(arch: str, group: int, tokenizer: Any,
                                               text_file: str) -> None:
    """AWQ's search and clipping from the inputs' products (the default) choose what the
    definitions choose (the inspected module rerun per ratio, each shrink's partial products
    formed: `direct=True`): the same ratio for every scaling group and the same clipped
    weights."""
    _, layer, runner, x = _first_layer_setup(arch, tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, group, False)
    results = []
    threads = torch.get_num_threads()
    for direct in (True, False):
        copy_of = copy.deepcopy(layer)
        run = LayerRunner(copy_of, runner.block.rotary, FULL_ATTENTION, 64, 4096)
        report = awq_layer(run, plan, x, scheme, AwqOptions(), set(plan.linears), direct)
        results.append((report.ratios, dict(copy_of.named_parameters())))
    assert torch.get_num_threads() == threads  # AWQ's one thread is given back
    (ratios_direct, direct_weights), (ratios, weights) = results
    assert ratios == ratios_direct and len(ratios) >= 2
    for name, p in weights.items():
        torch.testing.assert_close(p, direct_weights[name], rtol=1e-6, atol=1e-7)


def test_awq_clip_equals_the_definition() -> None:
    """`clip_weight` (each group's input products) clamps every (row, group) where
    `clip_weight_direct` (every shrink's partial products) does, on inputs with outlier
    channels, and the clamp changes some weights."""
    from toptpu.weight_calibration.awq import clip_weight, clip_weight_direct

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    w[:, 5] *= 8
    x = torch.randn(700, 128, generator=gen) * (1 + 10 * (torch.arange(128) % 17 == 0))
    for scheme in (QuantScheme(4, 32, False), QuantScheme(4, 64, True)):
        fast = clip_weight(w, x, scheme, AwqOptions(), rows_per_batch=40)
        direct = clip_weight_direct(w, x, scheme, AwqOptions(), rows_per_batch=40)
        assert torch.equal(fast, direct)
        assert not torch.equal(fast, w)


def test_awq_product_losses_equal_the_gram_losses() -> None:
    """With fewer search tokens than input channels the linear search's losses are
    sum((X D^T)^2) over blocks of D's rows (no K x K Gram matrix): the Gram form's losses
    to float64 rounding, the same least ratio; a block's fake-quantized rows made in a
    buffer are the whole weight's bit for bit."""
    from toptpu.weight_calibration.awq import (
        _candidates,
        _scaled_quantized,
        _w_mean,
        gram_losses,
        product_losses,
    )

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen)
    x = torch.randn(100, 256, generator=gen) * (1 + 10 * (torch.arange(256) % 13 == 0))
    for scheme in (QuantScheme(4, 32, False), QuantScheme(4, 64, True),
                   QuantScheme(4, -1, False)):
        candidates = _candidates(x.abs().mean(dim=0), _w_mean([w], scheme), AwqOptions())
        gram = gram_losses(w, x, candidates, scheme)
        for block_bytes in (8 * 256 * 5, 1 << 26):  # 5 rows a block; one block
            got = product_losses(w, x, candidates, scheme, block_bytes=block_bytes)
            np.testing.assert_allclose(got, gram, rtol=1e-12)
            assert int(np.argmin(got)) == int(np.argmin(gram))
        assert len(set(gram)) == len(gram)  # the candidates are told apart
        s = candidates[7][1]
        buffer = torch.empty(5, 256)
        for r0 in range(0, 48, 5):
            part = _scaled_quantized(w[r0:r0 + 5], s, scheme, out=buffer[:len(w[r0:r0 + 5])])
            assert torch.equal(part, _scaled_quantized(w, s, scheme)[r0:r0 + 5])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_awq_search_on_fewer_tokens_than_channels_equals_the_definition(
        arch: str, tokenizer: Any, text_file: str) -> None:
    """On 64 search tokens (fewer than the MLP's 128 intermediate channels: down_proj's
    losses in the product form) AWQ chooses what the definitions choose."""
    _, layer, runner, x = _first_layer_setup(arch, tokenizer, text_file)
    x = x[:1]
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    assert layer.get_submodule("mlp.down_proj").in_features > x.shape[0] * x.shape[1]
    results = []
    for direct in (True, False):
        copy_of = copy.deepcopy(layer)
        run = LayerRunner(copy_of, runner.block.rotary, FULL_ATTENTION, 64, 4096)
        report = awq_layer(run, plan, x, QuantScheme(4, 32, False), AwqOptions(),
                           set(plan.linears), direct)
        results.append((report.ratios, dict(copy_of.named_parameters())))
    (ratios_direct, direct_weights), (ratios, weights) = results
    assert ratios == ratios_direct and "mlp.up_proj" in ratios
    for name, p in weights.items():
        torch.testing.assert_close(p, direct_weights[name], rtol=1e-6, atol=1e-7)


def test_gptaq_asymmetry_term_in_row_blocks() -> None:
    """P made in dXX^T's memory a block of rows at a time is the whole product's (to float64
    rounding: the blocks' sums may round differently), with act-order and dead channels."""
    from toptpu.weight_calibration.gptq import asymmetry_term, prepare_hessian

    rng = np.random.default_rng(3)
    k = 96
    x = _structured_inputs(k, 400, 6)
    x[:, 4] = 0
    prepared = prepare_hessian(2 * x.T @ x / len(x), act_order=True)
    cross = rng.standard_normal((k, k)) * 0.1
    whole = asymmetry_term(cross.copy(), prepared)
    blocked = cross.copy()
    got = asymmetry_term(blocked, prepared, block_bytes=8 * k * 7)
    assert got is blocked  # in dXX^T's own memory
    np.testing.assert_allclose(got, whole, rtol=1e-12, atol=1e-14 * np.abs(whole).max())
    assert np.all(np.tril(got) == 0) and np.abs(got).max() > 0


def _permuted_cross(cross: np.ndarray, prepared: Any) -> np.ndarray:
    """dXX^T as `asymmetry_term` takes it: dead columns zeroed, rows and columns permuted."""
    d = cross.copy()
    d[:, prepared.dead] = 0.0
    return np.ascontiguousarray(d[prepared.perm][:, prepared.perm])


@pytest.mark.parametrize("dtype,act_order", [(np.float64, True), (np.float64, False),
                                             (np.float32, True)])
def test_gptaq_asymmetry_rows_in_the_factor(dtype: type, act_order: bool) -> None:
    """P made a run of rows at a time (uneven runs, each in blocks of rows) into the strict
    lower triangle of the factor's own matrix: U above it is left as it was, and P^T below
    is the whole `asymmetry_term`'s (to rounding: its sums start at the row's first
    column past the diagonal), with act-order and a dead channel."""
    from toptpu.weight_calibration.gptq import (
        PreparedHessian,
        asymmetry_rows,
        asymmetry_term,
        prepare_hessian,
    )

    rng = np.random.default_rng(5)
    k = 96
    x = _structured_inputs(k, 400, 6)
    x[:, 4] = 0
    prepared = prepare_hessian((2 * x.T @ x / len(x)).astype(dtype), act_order=act_order)
    assert prepared.dead[4] and (act_order or np.array_equal(prepared.perm, np.arange(k)))
    cross = (rng.standard_normal((k, k)) * 0.1).astype(dtype)
    whole = asymmetry_term(cross.copy(), prepared)
    packed = PreparedHessian(prepared.dead, prepared.perm, prepared.upper.copy(),
                             prepared.percdamp)
    d = _permuted_cross(cross, prepared)
    for r0, r1 in ((0, 7), (7, 40), (40, 41), (41, 95), (95, 96)):
        asymmetry_rows(d[r0:r1].copy(), r0, packed, block_bytes=d.itemsize * k * 5)
    assert np.array_equal(np.triu(packed.upper), prepared.upper)
    got = np.tril(packed.upper, -1).T
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(got, whole, rtol=tol, atol=tol * np.abs(whole).max())
    assert np.all(np.tril(whole) == 0) and np.abs(got).max() > 0


@pytest.mark.parametrize("act_order,group", [(True, 32), (False, 32), (False, -1)])
def test_gptaq_with_p_in_the_factor_is_gptaq_with_p(act_order: bool, group: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ given P in the strict lower triangle of the factor's matrix (`AsymmetryInFactor`)
    gives exactly the integers, grids and loss it gives with the same P beside the factor,
    the lazy update in several parts of columns."""
    from toptpu.weight_calibration import gptq as gptq_module
    from toptpu.weight_calibration.gptq import (
        AsymmetryInFactor,
        PreparedHessian,
        asymmetry_term,
        prepare_hessian,
    )

    monkeypatch.setattr(gptq_module, "UPDATE_COLUMNS", 96)
    rng = np.random.default_rng(11)
    k = 256
    weight = (rng.standard_normal((40, k)) * 0.05).astype(np.float32)
    x = _structured_inputs(k, 1024, 4).astype(np.float32)
    x[:, 9] = 0
    prepared = prepare_hessian(2 * x.T @ x / len(x), act_order=act_order)
    p = asymmetry_term((rng.standard_normal((k, k)) * 0.01).astype(np.float32), prepared)
    m = prepared.upper.copy()
    lower = np.tri(k, k, -1, dtype=bool)
    m[lower] = p.T[lower]
    packed = PreparedHessian(prepared.dead, prepared.perm, m, prepared.percdamp)
    scheme = QuantScheme(4, group, False)
    want = gptq(weight, prepared, scheme, act_order=act_order, block_size=64, asymmetry=p)
    got = gptq(weight, packed, scheme, act_order=act_order, block_size=64,
               asymmetry=AsymmetryInFactor())
    assert np.array_equal(got.weights.qweight, want.weights.qweight)
    assert np.array_equal(got.weights.scales, want.weights.scales)
    assert np.array_equal(got.weights.zeros, want.weights.zeros)
    assert got.loss == want.loss
    plain = gptq(weight, prepared, scheme, act_order=act_order, block_size=64)
    assert not np.array_equal(plain.weights.qweight, got.weights.qweight)


def test_gptaq_cross_rows_from_spills_are_the_accumulators() -> None:
    """dXX^T's rows summed from spilled batches (`_cross_rows`) are exactly
    `AsymmetryAccumulator`'s, permuted and with the dead columns zeroed."""
    from toptpu.weight_calibration.activations import Spill
    from toptpu.weight_calibration.gptq import AsymmetryAccumulator, prepare_hessian
    from toptpu.weight_calibration.sequential import _cross_rows

    rng = np.random.default_rng(2)
    k = 80
    batches = [rng.standard_normal((n, k)).astype(np.float32) for n in (64, 64, 30)]
    for b in batches:
        b[:, 6] = 0
    floats = [b + 0.1 * rng.standard_normal(b.shape).astype(np.float32) for b in batches]
    xall = np.concatenate(batches)
    prepared = prepare_hessian(2 * xall.T @ xall / len(xall), act_order=True)
    assert prepared.dead[6] and not np.array_equal(prepared.perm, np.arange(k))
    acc = AsymmetryAccumulator(k)
    with Spill(k, None) as xs, Spill(k, None) as ds:
        for xb, fb in zip(batches, floats, strict=True):
            acc.add(torch.from_numpy(fb), torch.from_numpy(xb))
            xs.append(torch.from_numpy(xb))
            ds.append(torch.from_numpy(fb) - torch.from_numpy(xb))
        assert len(xs) == 3 and torch.equal(xs.read(2), torch.from_numpy(batches[2]))
        want = _permuted_cross(acc.cross(), prepared)
        got = np.concatenate([_cross_rows(xs, ds, prepared, r0, min(r0 + 33, k), acc.rows)
                              for r0 in range(0, k, 33)])
    assert np.array_equal(got, want)


def test_gptaq_stage_in_one_matrix_is_gptaq(tokenizer: Any, text_file: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPTAQ layer calibrated holding one K x K matrix a stage (inputs spilled, P in the
    factor's lower triangle, made a few rows at a time) gives the integers and grids of
    the layer calibrated with the Hessian and dXX^T whole, and the same float outputs."""
    from toptpu.weight_calibration import sequential
    from toptpu.weight_calibration.activations import InMemory
    from toptpu.weight_calibration.sequential import calibrate_layer

    _, layer, runner, x = _first_layer_setup("llama", tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, 32, False)
    xf = x * (1 + 0.05 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(0)))
    results = []
    in_one = sequential._gptaq_stage_in_one
    stages: list[str] = []

    def counted(*args: Any, **kw: Any) -> Any:
        stages.append(args[2])
        return in_one(*args, **kw)

    monkeypatch.setattr(sequential, "_gptaq_stage_in_one", counted)
    for two_matrices in (1 << 40, 0):
        monkeypatch.setattr(sequential, "GPTAQ_TWO_MATRICES_BYTES", two_matrices)
        monkeypatch.setattr(sequential, "GPTAQ_CROSS_ROWS_BYTES", 4 * 1536 * 100)
        run = LayerRunner(copy.deepcopy(layer), runner.block.rotary, FULL_ATTENTION, 64, 128)
        assert run.batch == 2  # four batches of two sequences
        targets = InMemory(xf.clone())
        got, losses = calibrate_layer(run, plan, x, set(plan.linears),
                                      CalibrationRequest("gptaq", scheme), targets=targets)
        results.append((got, losses, targets.x))
    (whole, whole_losses, whole_x), (one, one_losses, one_x) = results
    assert len(stages) == len(plan.stages)  # the second run's stages, each in one matrix
    assert set(whole) == set(one) == set(plan.linears)
    for name in plan.linears:
        assert np.array_equal(one[name].qweight, whole[name].qweight), name
        assert np.array_equal(one[name].scales, whole[name].scales), name
        assert one_losses[name] == pytest.approx(whole_losses[name], rel=1e-5), name
    assert torch.equal(one_x, whole_x)


@pytest.mark.parametrize("bfloat16_values", [True, False])
def test_gptaq_float_twin_holds_no_float32_weights(bfloat16_values: bool, tmp_path: Path
                                                   ) -> None:
    """GPTAQ's float copy of a layer holds no float32 weights between runs: bfloat16 values
    as bfloat16, others (AWQ's folded weights) in a scratch file in the directory given,
    and computes the layer's outputs bit for bit."""
    from toptpu.weight_calibration.sequential import _float_twin

    model = _outlier_model("qwen2")
    layer = copy.deepcopy(model.model.layers[0])
    for p in layer.parameters():
        p.data = p.data.to(torch.bfloat16).float()
        if not bfloat16_values:
            p.data *= 1.0 + 2.0 ** -12  # no longer bfloat16 values
    runner = LayerRunner(layer, model.model.rotary_emb, FULL_ATTENTION, 16, 4096)
    x = torch.randn(2, 16, layer.hidden_size if hasattr(layer, "hidden_size")
                    else model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    twin = _float_twin(runner, str(tmp_path))
    linears = [m for m in twin.layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 and all(m.weight.numel() == 0 for m in linears)
    assert torch.equal(twin.forward(x), runner.forward(x))
    assert all(m.weight.numel() == 0 for m in linears)
    assert os.listdir(tmp_path) == []  # anonymous scratch files: nothing left on disk


def _layer_error(method: str, arch: str, tok: Any, text: str, group: int) -> float:
    """The first layer's output error (quantized vs float) on the calibration sequences."""
    model, layer, runner, x = _first_layer_setup(arch, tok, text)
    ref = runner.forward(x)
    from toptpu.weight_calibration.sequential import calibrate_layer

    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    calibrate_layer(runner, plan, x, set(plan.linears),
                    CalibrationRequest(method, QuantScheme(4, group, False)))
    return float((runner.forward(x) - ref).pow(2).mean())


@pytest.mark.parametrize("group", [32, 64])
def test_layer_error_gptq_awq_below_rtn(group: int, tokenizer: Any, text_file: str) -> None:
    """On a decoder layer with outlier channels, GPTQ's and AWQ's layer outputs are closer to
    the float layer's than round-to-nearest's on the same grid."""
    err = {m: _layer_error(m, "llama", tokenizer, text_file, group) for m in ("rtn", "gptq", "awq")}
    assert err["gptq"] < err["rtn"], err
    assert err["awq"] < err["rtn"], err


def _assert_awq_then(got: dict[str, QuantizedWeights], details: dict[str, float],
                     expected: dict[str, QuantizedWeights], report: Any) -> None:
    """An AWQ-first method's result: the layer's 7 linears' integers and grids exactly
    `expected`'s (the second method's on the AWQ-scaled layer), the AWQ ratios `report`'s."""
    assert sorted(got) == sorted(expected) and len(got) == 7
    for name, q in got.items():
        assert np.array_equal(q.qweight, expected[name].qweight), name
        assert np.array_equal(q.scales, expected[name].scales), name
        assert np.array_equal(q.zeros, expected[name].zeros), name
    assert {k: v for k, v in details.items() if k.startswith("ratio:")} == \
        {f"ratio:{k}": v for k, v in report.ratios.items()}


def test_awq_gptq_is_gptq_on_the_awq_scaled_layer(tokenizer: Any, text_file: str) -> None:
    """``awq,gptq``: AWQ's scales (no clipping) folded first leave the layer's float function
    as it was; the integers and grids are then GPTQ's on that scaled layer (its weights and
    its inputs), linear for linear, and the layer's norms are the scaled layer's; its
    output error is below round-to-nearest's."""
    from toptpu.weight_calibration.sequential import calibrate_layer, gptq_layer

    _, layer, runner, x = _first_layer_setup("llama", tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, 32, False)
    float_out = runner.forward(x)
    scaled = copy.deepcopy(layer)
    by_hand = LayerRunner(scaled, runner.block.rotary, FULL_ATTENTION, 64, 4096)
    report = awq_layer(by_hand, plan, x, scheme, AwqOptions(clip=False), set(plan.linears))
    assert any(r > 0 for r in report.ratios.values())
    torch.testing.assert_close(by_hand.forward(x), float_out, rtol=1e-5, atol=1e-5)
    expected, _ = gptq_layer(by_hand, plan, x, set(plan.linears),
                             CalibrationRequest("gptq", scheme))
    got, details = calibrate_layer(runner, plan, x, set(plan.linears),
                                   CalibrationRequest("awq,gptq", scheme))
    _assert_awq_then(got, details, expected, report)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p, scaled.get_parameter(name), rtol=0, atol=0)
    rtn_error = _layer_error("rtn", "llama", tokenizer, text_file, 32)
    assert float((runner.forward(x) - float_out).pow(2).mean()) < rtn_error


def test_gptaq_layer_is_gptaq_on_each_stages_two_inputs(tokenizer: Any, text_file: str) -> None:
    """``gptaq`` on a layer: o_proj's integers are GPTAQ's (`gptq` with `asymmetry_term`)
    on its inputs in the layer with q/k/v as quantized, matched to its inputs in the float
    layer on the float model's hidden states; those hidden states are then advanced
    through the float layer; the layer's error against the float layer's outputs on the
    float hidden states is below plain GPTQ's."""
    from toptpu.weight_calibration.activations import InMemory
    from toptpu.weight_calibration.gptq import (
        AsymmetryAccumulator,
        HessianAccumulator,
        asymmetry_term,
        prepare_hessian,
    )
    from toptpu.weight_calibration.sequential import calibrate_layer

    _, layer, runner, x = _first_layer_setup("llama", tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, 32, False)
    float_layer = copy.deepcopy(layer)
    gptq_layer_copy = copy.deepcopy(layer)
    float_runner = LayerRunner(float_layer, runner.block.rotary, FULL_ATTENTION, 64, 4096)
    xf = x * (1 + 0.05 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(0)))
    float_out = float_runner.forward(xf)
    targets = InMemory(xf.clone())
    got, _ = calibrate_layer(runner, plan, x, set(plan.linears),
                             CalibrationRequest("gptaq", scheme), targets=targets)
    torch.testing.assert_close(targets.x, float_out, rtol=0, atol=0)
    partial = copy.deepcopy(float_layer)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        partial.get_submodule(name).weight.data = torch.from_numpy(got[name].dequantize())
    partial_runner = LayerRunner(partial, runner.block.rotary, FULL_ATTENTION, 64, 4096)

    def o_inputs(run: LayerRunner, xin: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        run.see_inputs(run.layer.get_submodule("self_attn.o_proj"), InMemory(xin),
                       lambda _m, args: seen.append(args[0]))
        return torch.cat(seen)

    assert x.shape[0] <= runner.batch  # one batch: the sums below are the calibration's
    xq_o, xf_o = o_inputs(partial_runner, x), o_inputs(float_runner, xf)
    acc, cross = HessianAccumulator(xq_o.shape[-1]), AsymmetryAccumulator(xq_o.shape[-1])
    acc.add(xq_o)
    cross.add(xf_o, xq_o)
    prepared = prepare_hessian(acc.hessian(), act_order=True)
    expected = gptq(float_layer.get_submodule("self_attn.o_proj").weight.detach().numpy(),
                    prepared, scheme, act_order=True,
                    asymmetry=asymmetry_term(cross.cross(), prepared))
    assert np.array_equal(got["self_attn.o_proj"].qweight, expected.weights.qweight)
    assert np.array_equal(got["self_attn.o_proj"].scales, expected.weights.scales)
    gptq_runner = LayerRunner(gptq_layer_copy, runner.block.rotary, FULL_ATTENTION, 64, 4096)
    calibrate_layer(gptq_runner, plan, x, set(plan.linears), CalibrationRequest("gptq", scheme))

    def error(run: LayerRunner) -> float:
        return float((run.forward(x) - float_out).pow(2).mean())

    assert error(runner) < error(gptq_runner)


def test_awq_gptaq_is_gptaq_on_the_awq_scaled_layer(tokenizer: Any, text_file: str) -> None:
    """``awq,gptaq``: AWQ's scales (no clipping), searched on the quantized model's inputs,
    folded first leave the layer's float function as it was; the integers and grids are
    then GPTAQ's on that scaled layer, linear for linear, matched to the (scaled) float
    layer on the float model's hidden states, which it advances as GPTAQ does; the layer's
    error against the float layer's outputs is below round-to-nearest's."""
    from toptpu.weight_calibration.activations import InMemory
    from toptpu.weight_calibration.sequential import calibrate_layer

    _, layer, runner, x = _first_layer_setup("llama", tokenizer, text_file)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, 32, False)
    xf = x * (1 + 0.05 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(0)))
    float_runner = LayerRunner(copy.deepcopy(layer), runner.block.rotary, FULL_ATTENTION, 64,
                               4096)
    float_out = float_runner.forward(xf)
    scaled = copy.deepcopy(layer)
    by_hand = LayerRunner(scaled, runner.block.rotary, FULL_ATTENTION, 64, 4096)
    report = awq_layer(by_hand, plan, x, scheme, AwqOptions(clip=False), set(plan.linears))
    assert any(r > 0 for r in report.ratios.values())
    torch.testing.assert_close(by_hand.forward(xf), float_out, rtol=1e-5, atol=1e-5)
    hand_targets = InMemory(xf.clone())
    expected, _ = calibrate_layer(by_hand, plan, x, set(plan.linears),
                                  CalibrationRequest("gptaq", scheme), targets=hand_targets)
    targets = InMemory(xf.clone())
    got, details = calibrate_layer(runner, plan, x, set(plan.linears),
                                   CalibrationRequest("awq,gptaq", scheme), targets=targets)
    _assert_awq_then(got, details, expected, report)
    torch.testing.assert_close(targets.x, hand_targets.x, rtol=0, atol=0)
    torch.testing.assert_close(targets.x, float_out, rtol=1e-5, atol=1e-5)
    rtn_runner = LayerRunner(copy.deepcopy(float_runner.layer), runner.block.rotary,
                             FULL_ATTENTION, 64, 4096)
    calibrate_layer(rtn_runner, plan, x, set(plan.linears), CalibrationRequest("rtn", scheme))

    def error(run: LayerRunner) -> float:
        return float((run.forward(x) - float_runner.forward(x)).pow(2).mean())

    assert error(runner) < error(rtn_runner)


def test_gptq_layer_holding_integers_gives_the_same_layer(tokenizer: Any, text_file: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """GPTQ through a layer with its quantized linears held as integers until they run
    (`IntegersUntilRun`) gives exactly the integers, losses, float weights and outputs of
    the same layer with their dequantized float32 weights kept in place throughout; while
    down_proj is quantized, the MLP's gate/up hold no float weights."""
    from toptpu.weight_calibration import sequential

    request = CalibrationRequest("gptq", QuantScheme(4, 32, False))
    seen: dict[str, int] = {}
    gptq_of = sequential.gptq

    def watching(weight: np.ndarray, *args: Any, **kw: Any) -> Any:
        if weight.shape[1] == layer.mlp.down_proj.in_features:
            seen["gate"] = layer.mlp.gate_proj.weight.numel()
            seen["up"] = layer.mlp.up_proj.weight.numel()
        return gptq_of(weight, *args, **kw)

    runs = []
    for hold in (True, False):
        _, layer, runner, x = _first_layer_setup("qwen2", tokenizer, text_file)
        plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
        with monkeypatch.context() as m:
            m.setattr(sequential, "gptq", watching)
            if not hold:  # the float32 weights set in place at once, as GPTQ's reference
                m.setattr(sequential.IntegersUntilRun, "hold", lambda self, name, w: setattr(
                    sequential._linear_weight(self.layer, name).weight, "data",
                    torch.from_numpy(w.dequantize())))
            out, losses = sequential.gptq_layer(runner, plan, x.clone(), set(plan.linears),
                                                request)
        if hold:
            assert seen == {"gate": 0, "up": 0}
        runs.append((out, losses, {n: p.detach().clone() for n, p in layer.named_parameters()},
                     runner.forward(x)))
    (held, held_losses, held_params, held_y), (ref, ref_losses, ref_params, ref_y) = runs
    assert held.keys() == ref.keys() == set(plan.linears)
    for name in ref:
        assert np.array_equal(held[name].qweight, ref[name].qweight)
        assert np.array_equal(held[name].scales, ref[name].scales)
        assert np.array_equal(held[name].zeros, ref[name].zeros)
    assert held_losses == ref_losses
    assert all(torch.equal(held_params[n], ref_params[n]) for n in ref_params)
    assert torch.equal(held_y, ref_y)
    assert not layer._forward_pre_hooks and not layer.mlp.gate_proj._forward_pre_hooks


# ----------------------------------------------------------------------------- data

def test_calibration_data_sequences(tmp_path: Path, tokenizer: Any, text_file: str) -> None:
    data = calibration_data([text_file], _encode(tokenizer), 8, 64)
    assert data.tokens.shape == (8, 64) and data.note is None
    stream = _encode(tokenizer)(Path(text_file).read_text())
    assert data.tokens.ravel().tolist() == stream[:8 * 64]
    few = calibration_data([text_file], _encode(tokenizer), 1000, 64)
    assert few.sequences == len(stream) // 64
    assert few.note is not None and f"holds {few.sequences} sequences" in few.note


@pytest.mark.parametrize("kind,expected", [
    ("directory", "is a directory"),
    ("missing", "no such file"),
    ("empty", "is empty"),
    ("spaces", "holds only whitespace"),
    ("nul", "is binary (a NUL byte at byte 6)"),
    ("latin1", "is not UTF-8 text (byte 3)"),
    ("short", "fewer than one sequence of 64"),
    ("fifo", "is not a regular file"),
])
def test_bad_calibration_data_refused(tmp_path: Path, tokenizer: Any, kind: str,
                                      expected: str) -> None:
    path = tmp_path / "data.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "spaces":
        path.write_bytes(b"  \n\n \t\n")
    elif kind == "nul":
        path.write_bytes(b"w1 w2 \0 w3")
    elif kind == "latin1":
        path.write_bytes(b"w1 \xe9 w2")  # latin-1
    elif kind == "short":
        path.write_text("w1 w2 w3 w4")
    elif kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(CalibrationDataError) as e:
        calibration_data([str(path)], _encode(tokenizer), 4, 64)
    message = str(e.value)
    assert expected in message and "\n" not in message
    if kind != "short":
        assert str(path) in message


# ----------------------------------------------------------------------------- export

def _load_with_autoround(path: str) -> Any:
    """Our checkpoint in transformers through auto-round's CPU kernels (QuantLinear of
    `auto_round_extension.torch`), in float32: auto-round casts a loaded model to float16,
    so every float tensor is put back from the checkpoint and the scales widened (exactly:
    they are float16 values)."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoRoundConfig

    kwargs = {}
    if read_quantized_checkpoint(path).quant_method == "gptq":
        kwargs["quantization_config"] = AutoRoundConfig(backend="torch")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                 **kwargs)
    stored: dict[str, np.ndarray] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        stored.update(load_file(str(f)))
    for name, p in model.named_parameters():
        p.data = torch.from_numpy(stored[name].astype(np.float32))
    for name, b in model.named_buffers():
        if name in stored:
            arr = stored[name]
            b.data = torch.from_numpy(arr.astype(np.float32) if arr.dtype.kind == "f" else arr)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model.eval()


def _consumer_weight(module: torch.nn.Module, k: int) -> np.ndarray:
    """The weight a QuantLinear computes with: its output for the identity, less its bias."""
    with torch.no_grad():
        out = module(torch.eye(k))
        if module.bias is not None:
            out = out - module.bias
    return out.numpy().T


@pytest.mark.slow
@pytest.mark.parametrize("arch,method,fmt,sym,ranges", [
    ("qwen2", "gptq", "auto_round", False, "minmax"),
    ("llama", "awq", "auto_round", False, "minmax"),
    ("llama", "gptq", "gptq", True, "minmax"),
    ("qwen2", "awq,gptq", "auto_round", False, "mse"),
    ("llama", "awq,gptq", "gptq", True, "minmax"),
    ("qwen2", "gptaq", "auto_round", False, "minmax"),
    ("llama", "awq,gptaq", "auto_round", False, "mse"),
])
def test_export_round_trip(arch: str, method: str, fmt: str, sym: bool, ranges: str,
                           tmp_path: Path, tokenizer: Any, text_file: str) -> None:
    """The exported checkpoint in auto-round's loader and in toptpu's reader gives exactly the
    calibration's dequantized weights; toptpu's w4f32 compile of it computes the logits of
    transformers' model of it."""
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model = _outlier_model(arch)
    produced: dict[str, QuantizedWeights] = {}
    out = str(tmp_path / "calibrated")
    calibrate(model, out, CalibrationRequest(method, QuantScheme(4, 32, sym), export_format=fmt,
                                             ranges=ranges),
              [text_file], sequences=8, sequence_length=64, tokenizer=tokenizer, progress=None,
              on_layer=lambda i, res: produced.update(
                  {f"model.layers.{i}.{n}": q for n, q in res.items()}))
    ck = read_quantized_checkpoint(out)
    assert set(ck.linears) == set(produced) and len(produced) == 14
    consumer = _load_with_autoround(out)
    for name, q in produced.items():
        ours = q.dequantize()
        assert np.array_equal(ck.linears[name].dequantize(), ours), name
        assert np.array_equal(_consumer_weight(consumer.get_submodule(name), ours.shape[1]),
                              ours), name
    model_file = str(tmp_path / "calibrated.toptpu")
    compile_model(out, model_file, mode="w4f32", seq_length=64, max_input_length=32,
                  progress=None)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 250, 30)]
    ours_logits = Runtime.open(model_file, "interpreter").sequence_logits(ids)
    with torch.no_grad():
        theirs = consumer(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours_logits, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
    shutil.rmtree(out)


def _transformers_perplexity(model: Any, ids: list[int], window: int) -> float:
    """Perplexity of `ids` in transformers, on `toptpu eval`'s windows (`eval_cli.windows`:
    non-overlapping, the first token of each context only), log-softmax in float64."""
    from toptpu.eval_cli import windows

    nll, n = 0.0, 0
    for s, e in windows(len(ids), window):
        with torch.no_grad():
            logits = model(torch.tensor([ids[s:e]])).logits[0].double()
        lp = torch.log_softmax(logits, -1)[:-1]
        nll -= float(lp[torch.arange(e - s - 1), torch.tensor(ids[s + 1:e])].sum())
        n += e - s - 1
    return float(np.exp(nll / n))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_export_perplexity_in_transformers_equals_toptpu_eval(
        method: str, tmp_path: Path, tokenizer: Any, text_file: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`toptpu compile FLOAT -q w4f32 --calibrate METHOD --save-calibrated DIR`: the perplexity
    of a held-back text in transformers loading DIR (auto-round's CPU kernels, float32) equals
    `toptpu eval`'s of the `--calibrate` model file and of DIR's own w4f32 compile, to 1e-3
    (absolute, on the same windows). The check is meaningful: the export's perplexity is
    more than ten times that tolerance away from the float model's and from
    round-to-nearest's on the same grid."""
    import json

    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.cli import main as toptpu_main

    src = tmp_path / "float"
    model = _outlier_model("qwen2")
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    rng = random.Random(1)
    held = tmp_path / "held.txt"
    held.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(5)))
    small = ["--seq-length", "64", "--max-input-length", "32", "--quiet"]
    ck, calibrated, again = tmp_path / "ck", tmp_path / "cal.toptpu", tmp_path / "again.toptpu"
    assert toptpu_main(["compile", str(src), "-q", "w4f32", "--group-size", "32",
                        "--calibrate", method, "--calibration-data", text_file,
                        "--calibration-samples", "8", "--calibration-seq-length", "64",
                        "--save-calibrated", str(ck), "-o", str(calibrated), *small]) == 0
    assert toptpu_main(["compile", str(ck), "-q", "w4f32", "-o", str(again), *small]) == 0
    capsys.readouterr()

    def toptpu_eval(path: Path) -> dict[str, Any]:
        assert toptpu_main(["eval", str(path), "--text", str(held), "--json", "--quiet"]) == 0
        return dict(json.loads(capsys.readouterr().out))

    ours = [toptpu_eval(calibrated), toptpu_eval(again)]
    ids = Runtime.open(str(calibrated), "interpreter").encode(held.read_text())
    assert ours[0]["text_tokens"] == len(ids) > 3 * 64 and ours[0]["window"] == 64
    theirs = _transformers_perplexity(_load_with_autoround(str(ck)), ids, 64)
    for res in ours:
        assert abs(res["perplexity"] - theirs) <= 1e-3, (res["perplexity"], theirs)
    floating = _transformers_perplexity(model, ids, 64)
    rtn_ck = str(tmp_path / "rtn")
    calibrate(model, rtn_ck, CalibrationRequest("rtn", QuantScheme(4, 32, False)), [text_file],
              sequences=8, sequence_length=64, tokenizer=tokenizer, progress=None)
    rounded = _transformers_perplexity(_load_with_autoround(rtn_ck), ids, 64)
    print(f"{method}: toptpu eval {ours[0]['perplexity']:.6f} (--calibrate file), "
          f"{ours[1]['perplexity']:.6f} (export's compile); transformers {theirs:.6f}; "
          f"float {floating:.6f}, RTN {rounded:.6f}")
    assert abs(theirs - floating) > 1e-2 and abs(theirs - rounded) > 1e-2, \
        (theirs, floating, rounded)


def _qwen3() -> Any:
    import transformers as tf

    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family,method", [("qwen3", "gptq"), ("qwen3", "awq"),
                                           ("qwen3", "signround"),
                                           ("qwen3_5", "gptq"), ("qwen3_5", "awq")])
def test_calibrated_families_compile_and_generate(family: str, method: str, tmp_path: Path,
                                                  tokenizer: Any, text_file: str) -> None:
    """Qwen3 (q/k norms) and Qwen3.5 (three linear-attention layers and one full-attention
    layer) calibrate, compile with -q w4bf16 and generate; the w4f32 compile's logits follow
    the float model's (cos >= 0.98 at every position). Qwen3.5's in_proj_b / in_proj_a (4
    outputs: not whole int32 words of zero points) stay float, so AWQ leaves the linear
    attention's input group unscaled."""
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model = _qwen3() if family == "qwen3" else build_model("qwen3_5")
    out = str(tmp_path / "calibrated")
    request = CalibrationRequest(method, QuantScheme(4, 32, False),
                                 signround=SignRoundOptions(iterations=10))
    report = calibrate(model, out, request, [text_file], sequences=8, sequence_length=64,
                       tokenizer=tokenizer, progress=None)
    if family == "qwen3_5":
        assert report.float_linears == [f"model.layers.{i}.linear_attn.in_proj_{p}"
                                        for i in range(3) for p in "ba"]
    else:
        assert report.float_linears == []
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 250, 30)]
    exact = str(tmp_path / "w4f32.toptpu")
    compile_model(out, exact, mode="w4f32", seq_length=64, max_input_length=32, progress=None)
    logits = Runtime.open(exact, "interpreter").sequence_logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    cos = (logits * ref).sum(-1) / np.linalg.norm(logits, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.98, cos.min()
    served = str(tmp_path / "w4bf16.toptpu")
    compile_model(out, served, mode="w4bf16", seq_length=64, max_input_length=32,
                  progress=None)
    res = Runtime.open(served).generate(ids[:8], 8, stop_on_eos=False)
    assert len(res.generated_ids) == 8


def test_request_for_compile_mode() -> None:
    """The request a compile's -q / --group-size / --symmetric imply; a float mode refused."""
    from toptpu.weight_calibration import CalibrationError, request_for_mode

    r = request_for_mode("gptq", "w4bf16")
    assert r.scheme == QuantScheme(4, 64, False) and r.export_format == "auto_round"
    assert r.ranges == "minmax"
    assert request_for_mode("awq,gptq", "w4bf16", ranges="mse").ranges == "mse"
    with pytest.raises(CalibrationError, match="the range search 'mse' is GPTQ's; "
                       "--calibrate awq finds its ranges its own way"):
        request_for_mode("awq", "w4bf16", ranges="mse")
    with pytest.raises(CalibrationError, match="range search 'max': one of minmax, mse"):
        CalibrationRequest("gptq", ranges="max")
    assert request_for_mode("awq", "w8f16", -1, True).scheme == QuantScheme(8, -1, True)
    with pytest.raises(CalibrationError, match="-q bf16 keeps them float"):
        request_for_mode("gptq", "bf16")


def test_streamed_checkpoint_calibrates_as_the_model_in_memory(tmp_path: Path, tokenizer: Any,
                                                               text_file: str) -> None:
    """A checkpoint directory read one layer at a time (bf16 shards: the streamed layers are
    its exact float32 values) gives the very checkpoint the same model gives in memory."""
    from safetensors.numpy import load_file

    model = _outlier_model("qwen2").to(torch.bfloat16).float()
    src = tmp_path / "float"
    model.to(torch.bfloat16).save_pretrained(src)
    model.float()
    tokenizer.save_pretrained(src)
    request = CalibrationRequest("gptq", QuantScheme(4, 32, False))
    for name, source in (("memory", model), ("streamed", str(src))):
        calibrate(source, str(tmp_path / name), request, [text_file], sequences=8,
                  sequence_length=64, tokenizer=tokenizer, progress=None)

    def tensors(d: str) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for f in sorted((tmp_path / d).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    memory, streamed = tensors("memory"), tensors("streamed")
    assert memory.keys() == streamed.keys()
    for name, arr in memory.items():
        other = streamed[name]
        if name.startswith("model.layers."):
            assert arr.dtype == other.dtype and np.array_equal(arr, other), name
        else:  # outside the layers: as the source stores them (float32 / bf16)
            assert np.array_equal(arr.astype(np.float32), other.astype(np.float32)), name


# ----------------------------------------------------------------------------- MoE experts

def _moe_first_layer(tok: Any, text: str, sequences: int = 8, length: int = 64
                     ) -> tuple[Any, LayerRunner, torch.Tensor]:
    """Layer 0 of the tiny Qwen3-MoE (8 experts, top-2), a copy, its runner and inputs."""
    from moe_checkpoints import build_model as build_moe

    model = build_moe("qwen3_moe")
    model.config._attn_implementation = "sdpa"
    data = calibration_data([text], _encode(tok), sequences, length)
    x = model.model.embed_tokens(torch.from_numpy(data.tokens)).detach()
    layer = copy.deepcopy(model.model.layers[0])
    return layer, LayerRunner(layer, model.model.rotary_emb, FULL_ATTENTION, length, 4096), x


def _routed_inputs(runner: LayerRunner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' call as the float layer makes it: (hidden [T, H], top-k [T, k])."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    experts = runner.layer.get_submodule("mlp.experts")
    handle = experts.register_forward_pre_hook(
        lambda _m, args: seen.append((args[0].clone(), args[1].clone())))
    try:
        with torch.no_grad():
            runner.forward(x)
    finally:
        handle.remove()
    (hidden, index), = seen
    return hidden, index


def test_gptq_expert_equals_algorithm_1_on_its_routed_inputs(tokenizer: Any,
                                                             text_file: str) -> None:
    """GPTQ of each routed expert of a tiny Qwen3-MoE layer (the attention left float, so
    the experts' inputs are the float layer's) equals the transcription of Algorithm 1 on
    the Hessian of the tokens the router sent that expert: gate and up on those tokens'
    hidden states, down on act(x gate_q^T) * (x up_q^T) with the expert's quantized gate and
    up; the router is not changed."""
    from toptpu.weight_calibration.experts import calibrate_experts

    layer, runner, x = _moe_first_layer(tokenizer, text_file)
    hidden, index = _routed_inputs(runner, x)
    experts = layer.get_submodule("mlp.experts")
    float_gate_up = experts.gate_up_proj.detach().clone()
    float_down = experts.down_proj.detach().clone()
    router = layer.mlp.gate.weight.detach().clone()
    scheme = QuantScheme(4, 32, False)
    res = calibrate_experts(runner, x, experts, scheme, "gptq", act_order=True,
                            dtype="float64")
    assert res.unrouted == []
    assert torch.equal(layer.mlp.gate.weight, router)
    inter = experts.gate_up_proj.shape[1] // 2
    checked = 0
    for e in range(experts.gate_up_proj.shape[0]):
        rows = torch.nonzero((index == e).any(-1)).reshape(-1)
        xe = hidden[rows]
        assert res.tokens[e] == len(rows) > 0

        def hessian(inputs: torch.Tensor) -> np.ndarray:
            return ((inputs.T @ inputs).double() * (2.0 / len(inputs))).numpy()

        h = hessian(xe)
        for proj, w in (("gate_proj", float_gate_up[e, :inter]),
                        ("up_proj", float_gate_up[e, inter:])):
            q, scale, zero = _algorithm_1(w.numpy(), h, 4, 32, False, True)
            got = res.weights[f"mlp.experts.{e}.{proj}"]
            assert np.array_equal(got.qweight, q.astype(np.uint8)), (e, proj)
            assert np.array_equal(got.scales.astype(np.float64), scale)
            assert np.array_equal(got.zeros, zero.astype(np.uint8))
        gate_up_q = torch.from_numpy(np.concatenate(
            [res.weights[f"mlp.experts.{e}.{p}"].dequantize() for p in ("gate_proj", "up_proj")]))
        g, u = torch.nn.functional.linear(xe, gate_up_q).chunk(2, dim=-1)
        q, scale, zero = _algorithm_1(float_down[e].numpy(),
                                      hessian(torch.nn.functional.silu(g) * u), 4, 32, False,
                                      True)
        got = res.weights[f"mlp.experts.{e}.down_proj"]
        assert np.array_equal(got.qweight, q.astype(np.uint8)), e
        assert np.array_equal(got.scales.astype(np.float64), scale)
        # the layer now computes with the dequantized integers
        assert torch.equal(experts.down_proj[e], torch.from_numpy(got.dequantize()))
        checked += 1
    assert checked == 8


def test_expert_no_token_chose_is_rounded_to_nearest_and_named(tmp_path: Path,
                                                               tokenizer: Any,
                                                               text_file: str) -> None:
    """Calibrated on one 4-token sequence (top-2 of 8 experts: some experts get no token),
    the experts no token was routed to are rounded to nearest (`rtn` on their float
    weights), named on the progress stream and in the checkpoint's config; the others are
    GPTQ's."""
    import io
    import json

    from moe_checkpoints import build_model as build_moe

    model = build_moe("qwen3_moe")
    progress = io.StringIO()
    out = tmp_path / "ck"
    scheme = QuantScheme(4, 32, False)
    report = calibrate(model, str(out), CalibrationRequest("gptq", scheme), [text_file],
                       sequences=1, sequence_length=4, tokenizer=tokenizer, progress=progress)
    assert report.rtn_experts, "every expert was chosen by 4 tokens' top-2"
    assert "rounded to nearest, not calibrated" in progress.getvalue()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["calibration"]["rtn_experts"] == report.rtn_experts
    ck = read_quantized_checkpoint(str(out))
    inter = model.config.moe_intermediate_size
    for name in report.rtn_experts:  # RTN of the model's own float weights
        i, e = int(name.split(".")[2]), int(name.split(".")[-1])
        fused = model.model.layers[i].mlp.experts
        for proj, w in (("gate_proj", fused.gate_up_proj[e, :inter]),
                        ("up_proj", fused.gate_up_proj[e, inter:]),
                        ("down_proj", fused.down_proj[e])):
            got = ck.linear(f"{name}.{proj}")
            assert got is not None
            assert np.array_equal(got.dequantize(),
                                  rtn(w.detach().numpy(), scheme).dequantize()), (name, proj)
    chosen = [e for e in range(8) if f"model.layers.0.mlp.experts.{e}" not in report.rtn_experts]
    assert chosen, "no expert of layer 0 was chosen"


def test_a_stages_damping_is_raised_tenfold_on_sums_made_again() -> None:
    """`sequential._damped` (GPTQ's and both GPTAQ stages'): a Hessian that is not positive
    definite at the requested damping is summed again and damped ten times more, up to
    100 %; one that stays singular is refused in one line naming the linear."""
    from toptpu.weight_calibration import CalibrationError
    from toptpu.weight_calibration.gptq import HessianAccumulator
    from toptpu.weight_calibration.sequential import _damped

    def sums(matrix: list[list[float]]) -> HessianAccumulator:
        acc = HessianAccumulator(2)
        acc.sum = torch.tensor(matrix, dtype=torch.float32)
        acc.rows = 2  # hessian() scales by 2 / rows: the matrix itself
        return acc

    made: list[int] = []

    def again() -> HessianAccumulator:
        made.append(1)
        return sums([[1.0, 1.2], [1.2, 1.0]])  # eigenvalues -0.2 and 2.2

    request = CalibrationRequest("gptq", QuantScheme(4, 2, False))
    prepared, rows = _damped("mlp.down_proj", request, again, sums([[1.0, 1.2], [1.2, 1.0]]))
    assert prepared.percdamp == 1.0 and rows == 2 and len(made) == 2  # 0.01, 0.1 fail
    prepared, _ = _damped("mlp.down_proj", request, again, sums([[1.0, 0.5], [0.5, 1.0]]))
    assert prepared.percdamp == request.percdamp and len(made) == 2
    with pytest.raises(CalibrationError, match="mlp.down_proj's inputs stays singular"):
        _damped("mlp.down_proj", request, lambda: sums([[1.0, 3.0], [3.0, 1.0]]))
