"""SignRound (`toptpu.weight_calibration.signround`): untuned it is round to nearest bit for
bit; its tuning equals a direct transcription of the published update rule (signed
gradient steps, linearly decaying learning rate, projected parameters, best-loss
parameters kept); on a real decoder layer it lowers the layer's output error below round
to nearest; the batches are seeded."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from toptpu.weight_calibration import CalibrationError, QuantScheme
from toptpu.weight_calibration.grid import rtn
from toptpu.weight_calibration.layers import FULL_ATTENTION, LayerRunner, layer_plan
from toptpu.weight_calibration.signround import (
    BatchSampler,
    SignRoundOptions,
    quantized_weights,
    tune_layer,
)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 64, False), (4, 32, True),
                                            (4, -1, False), (8, -1, True)])
def test_untuned_grid_is_round_to_nearest(bits: int, group: int, sym: bool) -> None:
    """Offsets 0 and range factors 1 give `grid.rtn`'s integers, scales and zero points
    exactly (a group of zeros and a group of one sign included)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((16, 128)) * rng.uniform(0.01, 0.2, (16, 1))).astype(np.float32)
    w[3] = 0.0
    w[5, :64] = np.abs(w[5, :64])
    scheme = QuantScheme(bits, group, sym)
    groups = 128 // scheme.group_length(128)
    ours = quantized_weights(torch.from_numpy(w), torch.zeros(16, 128), torch.ones(16, groups),
                             torch.ones(16, groups), scheme)
    ref = rtn(w, scheme)
    assert np.array_equal(ours.qweight, ref.qweight)
    assert np.array_equal(ours.zeros, ref.zeros)
    assert ours.scales.dtype == ref.scales.dtype and np.array_equal(ours.scales, ref.scales)
    assert np.array_equal(ours.dequantize(), ref.dequantize())


# ----------------------------------------------------------------------------- the update rule

class _Mlp(torch.nn.Module):
    """A tiny gated MLP block, ``down(silu(gate(x)) * up(x))``: the layer of the transcription
    test."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gate = torch.nn.Linear(64, 96, bias=False)
        self.up = torch.nn.Linear(64, 96, bias=False)
        self.down = torch.nn.Linear(96, 64, bias=False)

    def forward(self, x: torch.Tensor, *_: Any) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _published_qdq(w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                   group: int) -> torch.Tensor:
    """The paper's quantize-dequantize with auto-round's min-max tuning, asymmetric 4-bit:
    ``s = (max(W) alpha - min(W) beta) / 15`` (float16), ``zp = round(-min(W) beta / s)``,
    ``W~ = s (clip(round(W / s + V) + zp, 0, 15) - zp)``; round straight-through."""
    def ste(t: torch.Tensor) -> torch.Tensor:
        return t + (torch.round(t) - t).detach()

    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    wmin = torch.clamp(wg.min(-1).values, max=0) * beta
    wmax = torch.clamp(wg.max(-1).values, min=0) * alpha
    s = ((wmax - wmin) / 15).half().float()[..., None]
    zp = torch.clamp(ste(-wmin[..., None] / s), 0, 15)
    q = torch.clamp(ste(wg / s + v.reshape(n, k // group, group)) + zp, 0, 15)
    return (s * (q - zp)).reshape(n, k)


def _published_signround(block: _Mlp, x: torch.Tensor, y: torch.Tensor, iters: int,
                         group: int) -> tuple[dict[str, np.ndarray], float, int]:
    """SignRound as published, on the whole set each step: V, alpha, beta (0, 1, 1); loss
    MSE(block with W~, float outputs); keep (V, alpha, beta) when the loss is the lowest so
    far; ``p <- p - lr (1 - i/iters) sign(grad)`` with lr = 1/iters; V clipped to
    [-0.5, 0.5], alpha and beta to [0, 1]. The integers of the best parameters."""
    weights = {n: getattr(block, n).weight.detach().clone() for n in ("gate", "up", "down")}
    params = {n: [torch.zeros_like(w, requires_grad=True),
                  torch.ones(w.shape[0], w.shape[1] // group, requires_grad=True),
                  torch.ones(w.shape[0], w.shape[1] // group, requires_grad=True)]
              for n, w in weights.items()}
    lr = 1.0 / iters
    best, best_i, kept = float("inf"), 0, {}
    for i in range(iters):
        wq = {n: _published_qdq(weights[n], *params[n], group) for n in weights}
        out = torch.nn.functional.linear(
            torch.nn.functional.silu(torch.nn.functional.linear(x, wq["gate"]))
            * torch.nn.functional.linear(x, wq["up"]), wq["down"])
        loss = ((out - y) ** 2).mean()
        loss.backward()
        if loss.item() < best:
            best, best_i = loss.item(), i
            kept = {n: [p.detach().clone() for p in ps] for n, ps in params.items()}
        with torch.no_grad():
            for ps in params.values():
                for j, p in enumerate(ps):
                    p -= lr * (1 - i / iters) * torch.sign(p.grad)
                    p.clamp_(*((-0.5, 0.5) if j == 0 else (0.0, 1.0)))
                    p.grad = None
    ints = {}
    for n, w in weights.items():
        v, alpha, beta = kept[n]
        wg = w.reshape(w.shape[0], -1, group)
        wmin = torch.clamp(wg.min(-1).values, max=0) * beta
        wmax = torch.clamp(wg.max(-1).values, min=0) * alpha
        s = ((wmax - wmin) / 15).half().float()[..., None]
        zp = torch.clamp(torch.round(-wmin[..., None] / s), 0, 15)
        q = torch.clamp(torch.round(wg / s + v.reshape(wg.shape)) + zp, 0, 15)
        ints[n] = q.reshape(w.shape).numpy().astype(np.uint8)
    return ints, best, best_i


def test_tuning_equals_the_published_update_rule() -> None:
    """`tune_layer` on a small block, batch = the whole set (so no sampling), 12 steps:
    the integers of every linear, the best loss and its step equal a direct transcription
    of the published rule; the tuned integers differ from round to nearest."""
    block = _Mlp()
    torch.manual_seed(4)
    x = torch.randn(4, 16, 64)
    with torch.no_grad():
        y = block(x)
    ref = copy.deepcopy(block)
    runner = SimpleNamespace(layer=block, kind=FULL_ATTENTION, block=block, position_ids=None,
                             mask=None)
    scheme = QuantScheme(4, 32, False)
    res = tune_layer(runner, x, y, ["down", "gate", "up"], scheme,  # type: ignore[arg-type]
                     SignRoundOptions(iterations=12, batch_size=4))
    ints, best, best_i = _published_signround(ref, x, y, 12, 32)
    assert res.best_iteration == best_i and res.best_iteration > 0
    assert res.best_loss == pytest.approx(best, rel=1e-6)
    assert res.best_loss < res.initial_loss
    for name in ("gate", "up", "down"):
        assert np.array_equal(res.weights[name].qweight, ints[name]), name
        w = ref.get_submodule(name).weight.detach().numpy()
        assert not np.array_equal(res.weights[name].qweight, rtn(w, scheme).qweight)
        # the layer now computes with the tuned integers
        assert np.array_equal(block.get_submodule(name).weight.detach().numpy(),
                              res.weights[name].dequantize())


def test_tuning_is_deterministic() -> None:
    """Batches of 2 of 4 sequences (sampled): the same seed gives the same integers."""
    torch.manual_seed(5)
    x = torch.randn(4, 16, 64)
    results = []
    for _ in range(2):
        block = _Mlp()
        with torch.no_grad():
            y = block(x)
        runner = SimpleNamespace(layer=block, kind=FULL_ATTENTION, block=block,
                                 position_ids=None, mask=None)
        res = tune_layer(runner, x, y, ["gate", "up", "down"],  # type: ignore[arg-type]
                         QuantScheme(4, 32, False), SignRoundOptions(iterations=6, batch_size=2),
                         seed=3)
        results.append(res)
    assert results[0].best_loss == results[1].best_loss
    for name in ("gate", "up", "down"):
        assert np.array_equal(results[0].weights[name].qweight, results[1].weights[name].qweight)


# ----------------------------------------------------------------------------- a real layer

def _qwen3_layer() -> tuple[LayerRunner, Any, torch.Tensor]:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256)).eval()
    model.config._attn_implementation = "sdpa"
    layer = copy.deepcopy(model.model.layers[0]).float().eval()
    runner = LayerRunner(layer, model.model.rotary_emb, FULL_ATTENTION, 32, 4096)
    x = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(1))
    return runner, layer, x


def test_tuning_lowers_the_layer_error_below_round_to_nearest() -> None:
    """A real Qwen3 decoder layer: after 40 steps the layer's output error over the whole
    calibration set is below round to nearest's (and the float weights untouched in the
    layer's norms)."""
    runner, layer, x = _qwen3_layer()
    y = runner.forward(x)
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    scheme = QuantScheme(4, 32, False)
    norms = {n: p.detach().clone() for n, p in layer.named_parameters() if "norm" in n}
    rtn_layer = copy.deepcopy(layer)
    for name in plan.linears:
        lin = rtn_layer.get_submodule(name)
        lin.weight.data = torch.from_numpy(rtn(lin.weight.detach().numpy(), scheme).dequantize())
    rtn_runner = LayerRunner(rtn_layer, runner.block.rotary, FULL_ATTENTION, 32, 4096)
    rtn_error = float(((rtn_runner.forward(x) - y) ** 2).mean())
    res = tune_layer(runner, x, y, list(plan.linears), scheme,
                     SignRoundOptions(iterations=40, batch_size=4))
    tuned_error = float(((runner.forward(x) - y) ** 2).mean())
    assert res.initial_loss > 0 and res.best_loss < res.initial_loss
    assert tuned_error < 0.9 * rtn_error, (tuned_error, rtn_error)
    for n, p in layer.named_parameters():
        if n in norms:
            assert torch.equal(p, norms[n]), n
        assert not p.requires_grad or n in dict(runner.layer.named_parameters())


def test_batches_are_seeded_shuffles() -> None:
    """Each run of batches is a shuffle of the sequences (no repeats until the set is
    used), the same for the same seed, another for another."""
    a, b, c = BatchSampler(10, 4, 7), BatchSampler(10, 4, 7), BatchSampler(10, 4, 8)
    first = [a.next() for _ in range(2)]
    assert len(set(np.concatenate(first).tolist())) == 8
    assert all(np.array_equal(p, b.next()) for p in first)
    assert any(not np.array_equal(p, c.next()) for p in first)
    assert len(BatchSampler(3, 8, 0).next()) == 3


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_iterations_refused(value: Any) -> None:
    with pytest.raises(CalibrationError, match="SignRound iterations"):
        SignRoundOptions(iterations=value)


def test_linear_attention_ops_backpropagate_as_their_definitions() -> None:
    """Qwen3.5's two fused ops (torch custom ops) carry their definitions' gradients: the
    op's gradients equal autograd through the definition run directly."""
    from toptpu.frontends import linear_attention_ops as ops

    gen = torch.Generator().manual_seed(0)

    def inputs() -> list[torch.Tensor]:
        gen.manual_seed(0)
        return [torch.randn(1, 5, 2, 4, generator=gen), torch.randn(1, 5, 2, 4, generator=gen),
                torch.randn(1, 5, 4, 3, generator=gen).requires_grad_(),
                (-torch.rand(1, 5, 4, generator=gen)).requires_grad_(),
                torch.rand(1, 5, 4, generator=gen).requires_grad_()]

    grads = []
    for fn in (ops.gated_delta_rule, ops._gated_delta_rule):
        args = inputs()
        o, s = fn(*args, None, 0.5)
        (o.square().sum() + s.sum()).backward()
        grads.append([a.grad for a in args[2:]])
    for ours, theirs in zip(*grads, strict=True):
        assert ours is not None and torch.equal(ours, theirs)
    conv = []
    for fn in (ops.causal_conv1d, ops._causal_conv1d):
        x = torch.randn(1, 6, 3, generator=gen.manual_seed(1)).requires_grad_()
        y, state = fn(x, torch.randn(3, 4, generator=gen.manual_seed(2)), None,
                      torch.ones(1, 6))
        (y.square().sum() + 3 * state.sum()).backward()
        conv.append(x.grad)
    assert conv[0] is not None and torch.equal(conv[0], conv[1])


@pytest.mark.parametrize("block_elements,bf16", [(1 << 22, False), (200, False), (200, True)])
def test_bounded_memory_equals_the_whole_graph(monkeypatch: pytest.MonkeyPatch,
                                               block_elements: int, bf16: bool) -> None:
    """The default (bounded memory: best kept as integers, steps taken in the backward,
    dequantized weights made again, their graphs in row blocks, bf16-exact weights kept in
    bf16) gives the integers, losses and best step of the whole graph held, bit for bit: on
    a real Qwen3 layer, whole linears, row blocks of a few rows, and weights that are bf16
    values."""
    from toptpu.weight_calibration import signround

    monkeypatch.setattr(signround, "BLOCK_ELEMENTS", block_elements)
    runner, layer, x = _qwen3_layer()
    plan = layer_plan(layer, FULL_ATTENTION, "layer 0")
    if bf16:
        for name in plan.linears:
            lin = layer.get_submodule(name)
            lin.weight.data = lin.weight.data.to(torch.bfloat16).float()
    y = runner.forward(x) * 1.01  # a target the float layer does not meet
    scheme = QuantScheme(4, 32, False)
    results, weights = [], []
    for bounded in (False, True):
        layer_copy = copy.deepcopy(layer)
        run = LayerRunner(layer_copy, runner.block.rotary, FULL_ATTENTION, 32, 4096)
        results.append(tune_layer(run, x, y, list(plan.linears), scheme,
                                  SignRoundOptions(iterations=8, batch_size=4,
                                                   bounded_memory=bounded), seed=2))
        weights.append({n: p.detach().clone() for n, p in layer_copy.named_parameters()})
    plain, bounded_res = results
    assert (plain.initial_loss, plain.best_loss, plain.best_iteration) == \
        (bounded_res.initial_loss, bounded_res.best_loss, bounded_res.best_iteration)
    assert plain.best_iteration > 0
    for name in plan.linears:
        a, b = plain.weights[name], bounded_res.weights[name]
        assert np.array_equal(a.qweight, b.qweight), name
        assert np.array_equal(a.scales, b.scales) and np.array_equal(a.zeros, b.zeros), name
    for n, p in weights[0].items():  # the layers compute the same, in float32
        assert weights[1][n].dtype == torch.float32 and torch.equal(p, weights[1][n]), n
