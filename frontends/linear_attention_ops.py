"""The two fused operations of linear attention (Qwen3.5's Gated DeltaNet layers), as torch
custom ops, so that `torch.export` keeps each as ONE node the FX importer maps to one Top op
(`top.causal_conv1d`, `top.gated_delta_rule`), as torch-mlir maps a custom op: the delta rule
is a loop over the tokens, which export would otherwise unroll into thousands of nodes, and
the conv state a chunk leaves depends on how many of its tokens are real.

Both take and return their state, and both leave the state exactly as the real tokens of a
padded static chunk leave it:

- `toptpu::causal_conv1d(x [1, T, C], weight [C, K], state [1, K-1, C] | None,
  valid [1, T]) -> (y [1, T, C], new_state [1, K-1, C])`: a depthwise causal convolution
  over `cat(state, x)` along the sequence (no activation, no bias): `y[t, c] =
  sum_j weight[c, j] * xs[t + j, c]` with `xs = cat(state, x)` ([K-1+T, C]; a missing
  state is zeros). `valid` is 1.0 for the real tokens (a prefix of n) and 0.0 for the
  padding after them; the new state is `xs[n : n + K-1]`, the last K-1 inputs up to the
  last real token. The state is sequence-major like the KV cache (HF keeps it as
  [C, K-1]).
- `toptpu::gated_delta_rule(q [1, T, Hk, Dk], k [1, T, Hk, Dk], v [1, T, Hv, Dv],
  g [1, T, Hv], beta [1, T, Hv], state [1, Hv, Dk, Dv] | None, scale) ->
  (o [1, T, Hv, Dv], new_state [1, Hv, Dk, Dv])`: the gated delta rule, recurrent over the
  tokens in float32 (HF's `torch_recurrent_gated_delta_rule` with q, k already
  L2-normalized): key head h serves value heads h*r .. h*r+r-1 (r = Hv / Hk); for each
  token t, `S = S * exp(g_t)`; `delta = beta_t * (v_t - k_t S)`; `S = S + k_t^T delta`;
  `o_t = (scale * q_t) S`. o has v's dtype, the state is float32. A token with g = 0 and
  beta = 0 leaves S exactly as it was (S * 1 + k^T 0): the wrapper zeroes both for padded
  tokens, so a padded chunk's state is the state of its real tokens, bit for bit.

The torch implementations here are the definitions (the numpy kernels in
`toptpu.backend.reference.kernels` compute the same); importing this module registers the
ops. Each op's gradient is its definition's, by autograd through the definition run again
(`_differentiable`): what SignRound's tuning backpropagates through a linear-attention layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIB = "toptpu"


def _differentiable(op: Any, definition: Callable[..., tuple[torch.Tensor, ...]]) -> None:
    """`op`'s gradient: autograd through `definition` (the op's own function) run again on
    the saved inputs, for every floating-point tensor input (None for the others)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.inputs = inputs

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        args = list(ctx.inputs)
        slots = [i for i, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and a.is_floating_point()]
        with torch.enable_grad():
            for i in slots:
                args[i] = args[i].detach().requires_grad_()
            outs = definition(*args)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                     if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in slots],
                                      [g for _, g in pairs], allow_unused=True) \
                if pairs else (None,) * len(slots)
        out: list[torch.Tensor | None] = [None] * len(args)
        for i, g in zip(slots, got, strict=True):
            out[i] = g
        return tuple(out)

    op.register_autograd(backward, setup_context=setup_context)


def _causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(1, k - 1, c)
    xs = torch.cat([state.to(x.dtype), x], dim=1)  # [1, K-1+T, C]
    y = torch.nn.functional.conv1d(xs.transpose(1, 2), weight[:, None, :].to(x.dtype),
                                   groups=c).transpose(1, 2)
    n = int(valid.reshape(-1).gt(0).sum())
    return y.contiguous(), xs[:, n:n + k - 1].contiguous()


causal_conv1d = torch.library.custom_op(f"{_LIB}::causal_conv1d", _causal_conv1d,
                                        mutates_args=())
_differentiable(causal_conv1d, _causal_conv1d)


@causal_conv1d.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
      valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = weight.shape[1]
    return x.new_empty(x.shape), x.new_empty(1, k - 1, x.shape[2])


def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor | None, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    _, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    f = torch.float32
    q = q.to(f).repeat_interleave(r, dim=2) * scale
    k = k.to(f).repeat_interleave(r, dim=2)
    vf, g, beta = v.to(f), g.to(f), beta.to(f)
    s = torch.zeros(1, hv, dk, dv, dtype=f) if state is None else state.to(f).clone()
    out = torch.empty(1, t, hv, dv, dtype=f)
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        kv = (s * k[:, i, :, :, None]).sum(dim=-2)
        delta = (vf[:, i] - kv) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = (s * q[:, i, :, :, None]).sum(dim=-2)
    return out.to(v.dtype), s


gated_delta_rule = torch.library.custom_op(f"{_LIB}::gated_delta_rule", _gated_delta_rule,
                                           mutates_args=())
_differentiable(gated_delta_rule, _gated_delta_rule)


@gated_delta_rule.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
      state: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    return v.new_empty(v.shape), v.new_empty(1, hv, dk, dv, dtype=torch.float32)
