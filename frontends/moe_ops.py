"""The two fused operations of a sparse mixture-of-experts block (Qwen2-MoE, Qwen3-MoE,
Qwen3.5-MoE, Qwen3-VL-MoE), as torch custom ops, so that `torch.export` keeps each as ONE
node the FX importer maps to one Top op (`top.moe_route`, `top.moe_experts`), as
`linear_attention_ops` does for Gated DeltaNet: transformers' experts loop over the experts
some token chose (`expert_hit = ...nonzero()`, `torch.where(expert_mask[e])`), or sort the
tokens by expert (`grouped_mm`), which is data-dependent control flow export cannot keep
at static shapes; which experts a token needs is known only at run time.

- `toptpu::moe_route(logits [T, E], top_k, normalize, valid [T] | None) -> (weights [T, k],
  indices i32 [T, k])`: the router of transformers' `*TopKRouter` after its linear:
  `softmax(logits, dtype=float32)`, the k largest probabilities in descending order (ties:
  the lower expert index first), divided by their sum when `normalize`
  (`norm_topk_prob`; Qwen3.5-MoE and Qwen3-VL-MoE always), cast to the logits' dtype.
  `valid` is 1.0 for a real token and 0.0 for a padded row of a static chunk: a padded row
  routes nowhere (indices -1, weights 0).
- `toptpu::moe_experts(x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k],
  indices [T, k]) -> y [T, H]`: each token's weighted sum of its k experts' SwiGLU MLPs,
  `y[t] = sum_j weights[t, j] * down[e] @ (silu(g) * u)` with `e = indices[t, j]` and
  `g, u = chunk(gate_up[e] @ x[t], 2)` (the first I rows of an expert's `gate_up` are its
  gate projection, the next I its up projection: transformers' fused `gate_up_proj`,
  which its checkpoint conversion builds from the hub layout's per-expert `gate_proj` and
  `up_proj`). Exact: every token gets all its k experts (no capacity, nothing dropped); an
  index of -1 adds nothing (a padded row's y is 0). The contributions are added in f32 in
  ascending expert order (transformers' eager loop adds them in that order, its
  `grouped_mm` in slot order: the same sum up to float rounding), then rounded to x's
  dtype.

- `toptpu::moe_experts_list(x, gate_proj [E x [I, H]], up_proj [E x [I, H]], down_proj
  [E x [H, I]], weights, indices) -> y [T, H]`: `moe_experts` of a block whose experts are
  a list of modules (one linear per expert and projection), stacked as the fused module
  holds them; the importer stacks the weights once, under the fused name
  (`frontends.moe`).

The torch implementations here are the definitions (the numpy kernels in
`toptpu.backend.reference.kernels` compute the same); importing this module registers the
ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LIB = "toptpu"


@torch.library.custom_op(f"{_LIB}::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # descending, the lower index first among equals (torch.topk leaves ties open)
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, indices = values[:, :top_k], indices[:, :top_k]
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    values = values.to(logits.dtype)
    indices = indices.to(torch.int32)
    if valid is not None:
        real = (valid.reshape(-1, 1) > 0)
        values = torch.where(real, values, torch.zeros_like(values))
        indices = torch.where(real, indices, torch.full_like(indices, -1))
    return values.contiguous(), indices.contiguous()


@moe_route.register_fake
def _(logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None
      ) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return logits.new_empty(t, top_k), logits.new_empty(t, top_k, dtype=torch.int32)


@torch.library.custom_op(f"{_LIB}::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    idx = indices.long()
    for e in sorted({int(i) for i in idx.reshape(-1).tolist() if i >= 0}):
        tokens, slots = torch.where(idx == e)
        h = F.linear(x[tokens].float(), gate_up[e].float())
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, down[e].float()) * weights[tokens, slots, None].float()
        out[tokens] += y
    return out.to(x.dtype)


@moe_experts.register_fake
def _(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
      indices: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_LIB}::moe_experts_list", mutates_args=())
def moe_experts_list(x: torch.Tensor, gate_proj: list[torch.Tensor],
                     up_proj: list[torch.Tensor], down_proj: list[torch.Tensor],
                     weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gate_proj, up_proj, strict=True)])
    return moe_experts(x, gate_up, torch.stack(down_proj), weights, indices)


@moe_experts_list.register_fake
def _(x: torch.Tensor, gate_proj: list[torch.Tensor], up_proj: list[torch.Tensor],
      down_proj: list[torch.Tensor], weights: torch.Tensor, indices: torch.Tensor
      ) -> torch.Tensor:
    return x.new_empty(x.shape)
