"""Expert parallelism (`toptpu.expert_parallel`): the experts split over chips, each chip's
share of every token's sum by the numpy kernels, combined by the all-reduce kernel, against
transformers' own experts; greedy generation of a tiny Qwen3-MoE whose experts run so over
2 and 4 chips against the model's own. The compiled and executed `--parallel ep`, and its
modelled step, are tests/test_moe_ep.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toptpu.backend.reference import kernels as K
from toptpu.expert_parallel import (
    expert_parallel_experts,
    expert_range,
    local_routing,
)
from toptpu.frontends.tiny_models import tiny_model


def test_expert_ranges_tile_the_experts() -> None:
    for n in (1, 2, 4, 8):
        ranges = [expert_range(d, n, 8) for d in range(n)]
        assert [e for r in ranges for e in r] == list(range(8))
    with pytest.raises(ValueError, match="do not divide"):
        expert_range(0, 3, 8)


def test_local_routing_keeps_only_the_chips_experts() -> None:
    w = np.array([[0.5, 0.3], [0.6, 0.4], [0.0, 0.0]], np.float32)
    i = np.array([[1, 6], [5, 4], [-1, -1]], np.int32)
    lw, li = local_routing(w, i, 1, 2, 8)  # chip 1 of 2 holds experts 4..7
    assert li.tolist() == [[-1, 2], [1, 0], [-1, -1]]
    assert lw.tolist() == [[0.0, np.float32(0.3)], [np.float32(0.6), np.float32(0.4)],
                           [0.0, 0.0]]


def _block_arrays(block: torch.nn.Module) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gate_up = block.experts.gate_up_proj.detach().numpy()
    down = block.experts.down_proj.detach().numpy()
    inter = down.shape[2]
    return gate_up[:, :inter].copy(), gate_up[:, inter:].copy(), down


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_shares_summed_equal_transformers_experts(devices: int, algorithm: str) -> None:
    """Every chip's share (its E/N experts' part of each token's weighted sum) added by the
    all-reduce kernel: transformers' experts module (and the one-chip kernel) within f32
    rounding; a padded row (index -1) adds nothing anywhere."""
    block = tiny_model("qwen3_moe", seed=1, layers=1).model.layers[0].mlp
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, w, i = block.gate(x)
        want = block.experts(x, i, w).numpy()
    gate, up, down = _block_arrays(block)
    wn, idx = w.numpy(), i.numpy().astype(np.int32)
    idx[-1], wn[-1] = -1, 0.0  # a padded row
    want[-1] = 0.0
    got = expert_parallel_experts(x.numpy(), gate, up, down, wn, idx, devices, algorithm)
    one = K.moe_experts(x.numpy(), gate, up, down, wn, idx)
    assert got.dtype == np.float32 and got.shape == one.shape
    np.testing.assert_allclose(got, one, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not got[-1].any()


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_greedy_tokens_with_experts_over_chips(devices: int) -> None:
    """A tiny Qwen3-MoE (4 layers, 8 experts, top-2) generating 32 greedy tokens after a
    40-token prompt with every layer's experts computed as `devices` chips would (shares by
    the kernels, the tree all-reduce): the tokens of the model itself."""
    model = tiny_model("qwen3_moe", seed=5, layers=4).eval()
    ids = torch.randint(3, 384, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=32, do_sample=False,
                              eos_token_id=None)[0, 40:].tolist()

    def spread(experts: torch.nn.Module):
        def forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                    ) -> torch.Tensor:
            gate_up = experts.gate_up_proj.detach().numpy()
            inter = gate_up.shape[1] // 2
            y = expert_parallel_experts(
                x.detach().numpy(), gate_up[:, :inter], gate_up[:, inter:],
                experts.down_proj.detach().numpy(), top_k_weights.detach().numpy(),
                top_k_index.numpy().astype(np.int32), devices, "tree")
            return torch.from_numpy(y)
        return forward

    calls = 0
    for layer in model.model.layers:
        experts = layer.mlp.experts
        inner = spread(experts)

        def counted(*args: torch.Tensor, _inner=inner) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return _inner(*args)
        experts.forward = counted
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=32, do_sample=False,
                             eos_token_id=None)[0, 40:].tolist()
    assert calls >= 4 * 32  # every layer's experts went through the shares
    assert got == want
