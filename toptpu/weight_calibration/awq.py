"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"), as AutoAWQ does it,
on one decoder layer in float32 torch.

For each scaling group (`layers.ScalingGroup`: the linears reading one input, the norm or
linear before them, the module whose output is compared):

1. ``x_mean``: the mean |x| of every input channel over all calibration tokens; with
   duo scaling (AutoAWQ's default) also ``w_mean``: the mean over the linears' rows of
   |w| / max|w| of its group.
2. A grid of `grid` ratios r = 0, 1/grid, ...: ``s = x_mean^r / (w_mean^(1-r) + 1e-4)``
   (``s = x_mean^r`` without duo scaling), clamped at 1e-4, normalized by
   ``sqrt(max(s) min(s))``; the linears' weights become ``Q(W * s) / s`` (fake-quantized on
   the checkpoint's grid, `grid.rtn`) and the inspected module's output on the search
   tokens is compared with the float output (mean squared error). The best s is kept.
3. s is folded: the linears' input channels times s, the norm's weight divided by s (a
   ``(1 + weight)`` norm: ``(1 + weight) / s - 1``), or a linear's last output rows (and
   bias) divided by s (v -> o only where v's outputs are o's inputs one to one, as AutoAWQ:
   not under grouped-query attention). The layer computes the same function in float.
4. Clipping (optional, AutoAWQ's `apply_clip`): per output row and group, the max |w| shrunk
   by 0 .. `max_shrink` in steps of 1/`clip_grid` minimizing the error of that group's
   partial products on `clip_tokens` tokens of the (scaled) input; the weights clamped to
   it. Linears whose outputs are queries and keys are not clipped (AutoAWQ's rule).

The scale search and the clipping use a subset of the calibration sequences (at most
`search_tokens` tokens, spread over the set); ``x_mean`` uses them all.

Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE; `layers._moe_scaling`), as AutoAWQ's
qwen2_moe / qwen3_moe / mixtral models group them, with one difference:

- one scale s for every routed expert's gate and up (and Qwen2-MoE's shared expert's),
  searched on the MoE block's input (x_mean over all tokens; w_mean over all those
  linears), the loss the MoE block's output with those linears fake-quantized, folded into
  post_attention_layernorm. The router's weight (and Qwen2-MoE's one-output
  ``shared_expert_gate``) is multiplied by the same s and stays float, so its logits, and
  which experts each token goes to, are the float model's before rounding (AutoAWQ leaves
  the router out of the group: its input then changes by 1/s);
- each routed expert's down, scaled with that expert's up as the previous op, on the
  tokens of the search sequences the router sent that expert (x_mean over all the
  calibration tokens it was sent), the loss down's own output; the shared expert's down
  likewise on every token. Clipping: each expert's linears on its routed search tokens.

An expert no search token was routed to has no inputs to search on: its gate and up take
the shared s (the norm they read is shared) and its down no scale, none of its linears is
clipped, and all three are rounded to nearest (`AwqLayerReport.unscaled_experts`, named by
the calibration as GPTQ names its unrouted experts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from toptpu.weight_calibration.activations import LayerInputs, layer_inputs
from toptpu.weight_calibration.experts import (
    MOE_BLOCK,
    expert_intermediate,
    expert_linear,
    expert_linears,
    expert_shapes,
    expert_weight,
    routed_inputs,
    routed_rows,
)
from toptpu.weight_calibration.grid import CalibrationError, QuantScheme
from toptpu.weight_calibration.layers import LayerPlan, LayerRunner, ScalingGroup

#: linears AutoAWQ never clips (their outputs are attention queries and keys)
NOT_CLIPPED = ("q_proj", "k_proj", "in_proj_qkv")


@dataclass(frozen=True)
class AwqOptions:
    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512
    search_tokens: int = 4096
    #: torch threads for the search and clipping (restored after): one, as measured on the
    #: shared 2-core host (`bench/awq_speed.py`: two threads took 3x the CPU time and more
    #: wall time); None leaves torch's setting
    threads: int | None = 1


_TORCH_SCALE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """`w` [N, K] on the checkpoint's grid and back, in float32 torch: what the search and
    the clipping compare. The grid is `grid.grid_params`' (min/max per group, the scale
    rounded to its storage dtype first, the zero point an integer), the rounding in float32
    (the stored integers are `grid.rtn`'s, from float64: they differ only where w / scale
    lies within float32 rounding of a half)."""
    n, k = w.shape
    gs = scheme.group_length(k)
    g = w.reshape(-1, gs)
    maxq = scheme.maxq
    lo = g.amin(dim=1).clamp(max=0).double()
    hi = g.amax(dim=1).clamp(min=0).double()
    scale, zero = _grid(lo, hi, scheme)
    s32, z32 = scale.float()[:, None], zero.float()[:, None]
    q = torch.round(g / s32).add_(z32).clamp_(0, maxq)
    return q.sub_(z32).mul_(s32).reshape(n, k)


def _grid(lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) in float64 of groups whose min and max are `lo`, `hi`."""
    maxq = scheme.maxq
    if scheme.sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo = torch.where(empty, -1.0, lo)
    hi = torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / maxq).to(_TORCH_SCALE[scheme.scale_dtype]).double()
    scale = torch.where(scale == 0, _smallest(scheme), scale)
    if scheme.sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def _smallest(scheme: QuantScheme) -> float:
    """The smallest positive value of the scale's storage dtype (`grid.round_scale`)."""
    dt = _TORCH_SCALE[scheme.scale_dtype]
    bits = torch.int32 if dt == torch.float32 else torch.int16
    return float(torch.tensor([1], dtype=bits).view(dt)[0])


@dataclass
class StageInputs:
    """What the search needs of one input of the layer: the sum of |x| per channel over all
    tokens, and the inputs of the search sequences."""

    abs_sum: torch.Tensor
    tokens: int
    search: list[torch.Tensor]

    @property
    def mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

    def stacked(self) -> torch.Tensor:
        return torch.cat(self.search)


def search_rows(n: int, length: int, search_tokens: int) -> np.ndarray:
    """The calibration sequences the search uses: at most `search_tokens` tokens' worth,
    spread evenly over the `n` sequences."""
    m = max(1, min(n, search_tokens // max(length, 1)))
    return np.unique(np.linspace(0, n - 1, m).round().astype(np.int64))


def _input_modules(plan: LayerPlan) -> list[str]:
    """The modules whose inputs the search needs: each stage's first linear, and the
    scaling groups' own `inputs` that are modules (a MoE layer's block)."""
    keys = [stage[0] for stage in plan.stages]
    for group in plan.scaling:
        if group.inputs and expert_linear(group.inputs) is None and group.inputs not in keys:
            keys.append(group.inputs)
    return keys


def _down_key(plan: LayerPlan, expert: int) -> str:
    return f"{plan.experts}.{expert}.down_proj"


@torch.no_grad()
def collect_inputs(runner: LayerRunner, plan: LayerPlan, x: LayerInputs, rows: np.ndarray
                   ) -> tuple[dict[str, StageInputs], torch.Tensor, torch.Tensor | None]:
    """One float forward of the layer over all sequences `x` [n, L, H]: each stage's input
    statistics and search inputs (by its first linear), and the layer inputs of the search
    sequences. A MoE layer also: the top-k experts of each search token ([T, k], in the
    order of the MoE block's search inputs), and for each expert the statistics of its
    down's inputs over every token routed to it (`_down_key`; their search inputs are made
    when that expert is searched)."""
    stages = {key: StageInputs(torch.zeros(0), 0, []) for key in _input_modules(plan)}
    n, length = x.shape[0], x.shape[1]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.from_numpy(rows)] = True
    current: dict[str, torch.Tensor] = {}
    hooks = []
    routing: list[torch.Tensor] = []
    if plan.experts is not None:
        experts = runner.layer.get_submodule(plan.experts)
        n_experts, inter, _ = expert_shapes(experts)
        downs = {e: StageInputs(torch.zeros(inter, dtype=torch.float64), 0, [])
                 for e in range(n_experts)}

        def route(_m: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden, index = routed_inputs(args, kwargs)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            routing.append(index[current["keep"].repeat_interleave(length)].clone())
            for e, rec in downs.items():
                sent = routed_rows(index, e)
                if sent.numel():
                    inner = expert_intermediate(experts, e, hidden[sent])
                    rec.abs_sum += inner.abs().sum(dim=0).to(torch.float64)
                    rec.tokens += int(sent.numel())
        hooks.append(experts.register_forward_pre_hook(route, with_kwargs=True))
        stages.update({_down_key(plan, e): rec for e, rec in downs.items()})
    for name in _input_modules(plan):
        rec = stages[name]

        def hook(_m: torch.nn.Module, args: tuple, rec: StageInputs = rec) -> None:
            inp = args[0].detach()
            inp = inp.reshape(-1, length, inp.shape[-1])  # a MoE block's [T, K] per sequence
            s = inp.abs().sum(dim=(0, 1)).to(torch.float64)
            rec.abs_sum = s if rec.tokens == 0 else rec.abs_sum + s
            rec.tokens += inp.shape[0] * inp.shape[1]
            sel = current["keep"]
            if bool(sel.any()):
                rec.search.append(inp[sel].clone())
        hooks.append(runner.layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for b in runner.batches(n):
            current["keep"] = keep[b]
            runner.forward(x.read(b))
    finally:
        for h in hooks:
            h.remove()
    return stages, x.take(rows), torch.cat(routing) if routing else None


def _weight(runner: LayerRunner, name: str) -> torch.Tensor:
    """The weight [N, K] of the linear `name` (a routed expert's: a view into the fused
    parameters, `experts.expert_weight`; the router's parameter): writing it writes the
    layer's."""
    expert = expert_linear(name)
    if expert is not None:
        fused = runner.layer.get_submodule(name.rsplit(".", 2)[0])
        return expert_weight(fused, *expert)
    m = runner.layer.get_submodule(name)
    weight = getattr(m, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise CalibrationError(f"'{name}' is a {type(m).__name__}, not a linear")
    return weight.data


def _stage_of(plan: LayerPlan, linear: str) -> str:
    return next(stage[0] for stage in plan.stages if linear in stage)


def _batched(runner: LayerRunner, path: str, x: torch.Tensor) -> torch.Tensor:
    """The output of the module `path` on `x` (a routed expert's linear: its weight's
    product, on its tokens [T, K])."""
    if expert_linear(path) is not None:
        return torch.nn.functional.linear(x, _weight(runner, path))
    return torch.cat([runner.call(path, x[b]) for b in runner.batches(x.shape[0])])


def _w_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    w = torch.cat(weights, dim=0)  # a copy: made |w| / max|w| in place (one weight's memory)
    gs = scheme.group_length(w.shape[1])
    g = w.abs_().reshape(-1, gs)
    g.div_(g.amax(dim=1, keepdim=True) + 1e-6)
    return w.mean(dim=0)


def _folder(runner: LayerRunner, group: ScalingGroup, k: int
            ) -> Callable[[torch.Tensor], None] | None:
    """How to divide `group.prev`'s output channels by s (None: it cannot absorb them)."""
    if expert_linear(group.prev) is not None:  # a routed expert's up: all its rows
        up = _weight(runner, group.prev)
        if up.shape[0] != k:
            return None

        def fold_up(s: torch.Tensor) -> None:
            up.div_(s[:, None])
        return fold_up
    prev = runner.layer.get_submodule(group.prev)
    weight = getattr(prev, "weight", None)
    if weight is None:
        return None
    if isinstance(prev, torch.nn.Linear):
        if weight.shape[0] != k:
            return None

        def fold_linear(s: torch.Tensor) -> None:
            prev.weight.data[-k:] /= s[:, None]
            if prev.bias is not None:
                prev.bias.data[-k:] /= s
        return fold_linear
    if weight.dim() != 1 or weight.shape[0] != k:
        return None
    return lambda s: _fold_norm(prev, s, group.prev)


@torch.no_grad()
def _fold_norm(norm: torch.nn.Module, s: torch.Tensor, name: str) -> None:
    """Divide a norm's output by s, found by probing its form: ``x * w`` or ``x * (1 + w)``."""
    weight: torch.Tensor = getattr(norm, "weight")  # noqa: B009 - a Module attribute
    bias: torch.Tensor | None = getattr(norm, "bias", None)
    probe = torch.randn(2, weight.shape[0], generator=torch.Generator().manual_seed(0))
    want = norm(probe) / s
    original = weight.data.clone()
    for candidate in (original / s, (1 + original) / s - 1):
        weight.data = candidate
        if torch.allclose(norm(probe), want, rtol=1e-4, atol=1e-6):
            if bias is not None:
                bias.data /= s
            return
    weight.data = original
    raise CalibrationError(f"'{name}' ({type(norm).__name__}) is not a norm AWQ can fold a "
                           "scale into (x * w or x * (1 + w))")


def _ratio_scale(ratio: float, x_mean: torch.Tensor, w_mean: torch.Tensor | None
                 ) -> torch.Tensor:
    """The candidate scale of one grid ratio (module doc, step 2)."""
    if w_mean is not None:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    s[~torch.isfinite(s)] = 1
    return s


def _candidates(x_mean: torch.Tensor, w_mean: torch.Tensor | None, options: AwqOptions
                ) -> list[tuple[float, torch.Tensor]]:
    return [(i / options.grid, _ratio_scale(i / options.grid, x_mean, w_mean))
            for i in range(options.grid)]


def _scaled_quantized(w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Q(W * s) / s: the weights the search tries for scale s; made in `out` (a contiguous
    tensor of w's shape) when given, with no other temporary of w's size."""
    if out is None:
        return fake_quantize(w * s[None, :], scheme) / s[None, :]
    torch.mul(w, s[None, :], out=out)
    _fake_quantize_(out, scheme)
    return out.div_(s[None, :])


def _fake_quantize_(w: torch.Tensor, scheme: QuantScheme) -> None:
    """`fake_quantize` in place: the same operations on the same values (the same bits)."""
    n, k = w.shape
    g = w.view(-1, scheme.group_length(k))
    lo = g.amin(dim=1).clamp(max=0).double()
    hi = g.amax(dim=1).clamp(min=0).double()
    scale, zero = _grid(lo, hi, scheme)
    s32, z32 = scale.float()[:, None], zero.float()[:, None]
    g.div_(s32).round_().add_(z32).clamp_(0, scheme.maxq).sub_(z32).mul_(s32)


def _first_least(losses: list[tuple[float, float, torch.Tensor]]
                 ) -> tuple[torch.Tensor, float]:
    """(scale, ratio) of the first candidate of least loss (ties go to the smaller ratio)."""
    best = losses[0]
    for candidate in losses[1:]:
        if candidate[0] < best[0]:
            best = candidate
    return best[2], best[1]


def _input_gram(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """X^T X in float64 of inputs `x` [T, K], accumulated over blocks of tokens."""
    k = x.shape[-1]
    gram = torch.zeros(k, k, dtype=torch.float64)
    for t0 in range(0, x.shape[0], block):
        xb = x[t0:t0 + block].double()
        gram.addmm_(xb.T, xb)
    return gram


@torch.no_grad()
def search_scale_direct(runner: LayerRunner, group: ScalingGroup, inputs: StageInputs,
                        inspect_input: torch.Tensor, scheme: QuantScheme, options: AwqOptions
                        ) -> tuple[torch.Tensor, float]:
    """The best scale of `group` and its ratio (module doc, steps 1-2), by definition: for
    every ratio the linears get their fake-quantized weights and the inspected module runs
    again on the search inputs; the loss is the mean squared difference of its output from
    the float output. `search_scale` makes the same choice faster."""
    weights = [_weight(runner, n) for n in group.linears]
    originals = [w.clone() for w in weights]
    x_mean = inputs.mean.to(torch.float32)
    w_mean = _w_mean(originals, scheme) if options.duo_scaling else None
    reference = _batched(runner, group.inspect, inspect_input)
    losses = []
    try:
        for ratio, s in _candidates(x_mean, w_mean, options):
            for weight, w in zip(weights, originals, strict=True):
                if weight.is_contiguous():  # made in the layer's own weight
                    _scaled_quantized(w, s, scheme, out=weight)
                else:
                    weight.copy_(_scaled_quantized(w, s, scheme))
            out = _batched(runner, group.inspect, inspect_input)
            losses.append((float((out - reference).pow(2).mean(dtype=torch.float64)), ratio, s))
    finally:
        for weight, w in zip(weights, originals, strict=True):
            weight.copy_(w)
    return _first_least(losses)


@torch.no_grad()
def search_scale(runner: LayerRunner, group: ScalingGroup, inputs: StageInputs,
                 inspect_input: torch.Tensor, scheme: QuantScheme, options: AwqOptions
                 ) -> tuple[torch.Tensor, float]:
    """`search_scale_direct`'s choice. Where the inspected module is the group's one linear
    (down_proj after up_proj; o_proj after v_proj), its output error on inputs X [T, K] is
    linear in the weight error D = W' - W [N, K]: mean((X D^T)^2) = sum((D X^T X) * D) /
    (T N) (a bias cancels). X^T X is formed once (float64) and a ratio costs N K^2 instead
    of a forward's T N K. With fewer search tokens than input channels (T < K: Qwen2.5-7B's
    down_proj, K = 18944, on 4096 tokens) the loss is sum((X D^T)^2) / (T N) instead, in
    float64 over blocks of D's rows (`product_losses`): fewer operations (T N K a ratio
    against N K^2) and no K x K matrix (2.9 GB at that down_proj); the losses are the same
    sums in another order (equal to float64 rounding), the ratio chosen the same. Other
    groups (the inspected module is not linear in the weights: attention, the MLP) rerun the
    module per ratio, as by definition."""
    if len(group.linears) != 1 or group.inspect != group.linears[0]:
        return search_scale_direct(runner, group, inputs, inspect_input, scheme, options)
    w = _weight(runner, group.inspect)
    x = inspect_input.reshape(-1, inspect_input.shape[-1])
    x_mean = inputs.mean.to(torch.float32)
    w_mean = _w_mean([w], scheme) if options.duo_scaling else None
    candidates = _candidates(x_mean, w_mean, options)
    losses = (product_losses if x.shape[0] < x.shape[1] else gram_losses)(w, x, candidates,
                                                                          scheme)
    return _first_least([(loss, ratio, s)
                         for loss, (ratio, s) in zip(losses, candidates, strict=True)])


def gram_losses(w: torch.Tensor, x: torch.Tensor, candidates: list[tuple[float, torch.Tensor]],
                scheme: QuantScheme) -> list[float]:
    """Each candidate scale's loss mean((X D^T)^2) (`search_scale`) as sum((D X^T X) * D) /
    (T N), X^T X formed once in float64 (K x K)."""
    gram = _input_gram(x)
    w64 = w.double()
    denominator = x.shape[0] * w.shape[0]
    losses = []
    for _, s in candidates:
        d = _scaled_quantized(w, s, scheme).double().sub_(w64)
        losses.append(float((d @ gram).mul_(d).sum()) / denominator)
    return losses


def product_losses(w: torch.Tensor, x: torch.Tensor,
                   candidates: list[tuple[float, torch.Tensor]], scheme: QuantScheme,
                   block_bytes: int = 1 << 26) -> list[float]:
    """`gram_losses` as sum((X D^T)^2) / (T N) in float64, D made `block_bytes` of rows at a
    time (a row's groups are its own: a block's fake-quantized rows are the whole weight's):
    memory X in float64 and one block, no K x K matrix."""
    n, k = w.shape
    x64 = x.double()
    rows = max(1, block_bytes // (8 * k))
    denominator = x.shape[0] * n
    scratch = torch.empty(min(rows, n), k)
    losses = []
    for _, s in candidates:
        total = 0.0
        for r0 in range(0, n, rows):
            wb = w[r0:r0 + rows]
            d = _scaled_quantized(wb, s, scheme, out=scratch[:wb.shape[0]]).double()
            d.sub_(wb.double())
            total += float((x64 @ d.T).square_().sum())
        losses.append(total / denominator)
    return losses


def _shrinks(org_max: torch.Tensor, options: AwqOptions) -> list[torch.Tensor]:
    """The clipping candidates: max |w| times 1, 1 - 1/clip_grid, ... above 1 - max_shrink."""
    return [org_max * (1 - i / options.clip_grid)
            for i in range(int(options.max_shrink * options.clip_grid))]


@torch.no_grad()
def clip_weight_direct(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme,
                       options: AwqOptions, rows_per_batch: int = 256) -> torch.Tensor:
    """`w` [N, K] clamped per (row, group) to the max |w| that best keeps the group's partial
    products on inputs `x` [T, K] (module doc, step 4), by definition: each shrink's partial
    products computed and compared. `clip_weight` computes the same faster."""
    n, k = w.shape
    gs = scheme.group_length(k)
    g = k // gs
    step = max(1, x.shape[0] // options.clip_tokens)
    xs = x[::step].reshape(-1, g, gs)
    out = torch.empty_like(w)
    for r0 in range(0, n, rows_per_batch):
        wb = w[r0:r0 + rows_per_batch]
        wg = wb.reshape(-1, g, gs)
        org_max = wg.abs().amax(dim=-1, keepdim=True)
        reference = torch.einsum("tgj,ngj->ntg", xs, wg)
        best_err = torch.full(org_max.shape[:2], float("inf"))
        best_max = org_max.clone()
        for max_val in _shrinks(org_max, options):
            clipped = torch.clamp(wg, -max_val, max_val)
            q = fake_quantize(clipped.reshape(wb.shape), scheme).reshape(wg.shape)
            err = (torch.einsum("tgj,ngj->ntg", xs, q) - reference).pow(2).mean(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], max_val, best_max)
        out[r0:r0 + rows_per_batch] = torch.clamp(wg, -best_max, best_max).reshape(wb.shape)
    return out


@torch.no_grad()
def clip_weight(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, options: AwqOptions,
                rows_per_batch: int = 256) -> torch.Tensor:
    """`clip_weight_direct`'s clamp from each group's input products: a group's partial-product
    error on inputs X_g [T, gs] is mean_t((X_g d)^2) = d X_g^T X_g d / T for one row's
    weight error d = q - w, so the gs x gs products are formed once per group (float64) and
    a shrink costs gs^2 per (row, group) instead of T gs."""
    n, k = w.shape
    gs = scheme.group_length(k)
    g = k // gs
    step = max(1, x.shape[0] // options.clip_tokens)
    xs = x[::step].reshape(-1, g, gs).double()
    tokens = xs.shape[0]
    grams = torch.einsum("tgj,tgk->gjk", xs, xs)
    out = torch.empty_like(w)
    for r0 in range(0, n, rows_per_batch):
        wb = w[r0:r0 + rows_per_batch]
        wg = wb.reshape(-1, g, gs)
        w64 = wg.double()
        org_max = wg.abs().amax(dim=-1, keepdim=True)
        best_err = torch.full(org_max.shape[:2], float("inf"), dtype=torch.float64)
        best_max = org_max.clone()
        for max_val in _shrinks(org_max, options):
            clipped = torch.clamp(wg, -max_val, max_val)
            q = fake_quantize(clipped.reshape(wb.shape), scheme).reshape(wg.shape)
            d = q.double() - w64
            err = torch.einsum("ngj,gjk,ngk->ng", d, grams, d).div_(tokens)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], max_val, best_max)
        out[r0:r0 + rows_per_batch] = torch.clamp(wg, -best_max, best_max).reshape(wb.shape)
    return out


@dataclass
class AwqLayerReport:
    #: scaling group prev -> the ratio chosen (groups that could not be folded are absent)
    ratios: dict[str, float]
    skipped: list[str]
    #: a MoE layer's experts no search token was routed to (module doc)
    unscaled_experts: list[int] = field(default_factory=list)
    #: a MoE layer's calibration tokens routed to each expert
    expert_tokens: list[int] = field(default_factory=list)


@torch.no_grad()
def awq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
              scheme: QuantScheme, options: AwqOptions, quantized: set[str],
              direct: bool = False) -> AwqLayerReport:
    """AWQ's scales searched and folded into the layer, and its clipping applied (module doc):
    the layer's float weights are changed in place; `quantized` are the linears that will be
    quantized (the others are left out of the search). `direct`: by the definitions
    (`search_scale_direct`, `clip_weight_direct`: slower, the same choices)."""
    threads = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    try:
        return _awq_layer(runner, plan, x, scheme, options, quantized, direct)
    finally:
        torch.set_num_threads(threads)


def _awq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
               scheme: QuantScheme, options: AwqOptions, quantized: set[str], direct: bool
               ) -> AwqLayerReport:
    search = search_scale_direct if direct else search_scale
    clip = clip_weight_direct if direct else clip_weight
    x = layer_inputs(x)
    rows = search_rows(x.shape[0], x.shape[1], options.search_tokens)
    stages, layer_input, routing = collect_inputs(runner, plan, x, rows)
    search_inputs = {name: rec.stacked() for name, rec in stages.items() if rec.search}
    for rec in stages.values():
        rec.search = []  # held once: stacked
    names = _quantized_names(runner, plan, quantized)
    report = AwqLayerReport({}, [])
    if plan.experts is not None:
        n_experts = expert_shapes(runner.layer.get_submodule(plan.experts))[0]
        report.expert_tokens = [stages[_down_key(plan, e)].tokens for e in range(n_experts)]

    def routed_search_inputs(expert: int) -> torch.Tensor | None:
        """The MoE block's search inputs [T_e, H] the router sent `expert` (None: none)."""
        sent = routed_rows(routing, expert) if routing is not None else None
        if sent is None or sent.numel() == 0:
            return None
        block = search_inputs[MOE_BLOCK]
        return block.reshape(-1, block.shape[-1])[sent]

    for group in plan.scaling:
        if not set(group.linears) <= names:
            report.skipped.append(group.prev)
            continue
        key = group.inputs or _stage_of(plan, group.linears[0])
        expert = expert_linear(key)
        if expert is not None and key not in search_inputs:  # a routed expert's down
            routed = routed_search_inputs(expert[0])
            if routed is None:
                report.unscaled_experts.append(expert[0])
                report.skipped.append(group.prev)
                continue
            fused = runner.layer.get_submodule(key.rsplit(".", 2)[0])
            search_inputs[key] = expert_intermediate(fused, expert[0], routed)
        k = search_inputs[key].shape[-1]
        fold = _folder(runner, group, k)
        if fold is None:
            report.skipped.append(group.prev)
            continue
        inspect_input = layer_input if group.inspect == "" else search_inputs[key]
        s, ratio = search(runner, group, stages[key], inspect_input, scheme, options)
        for name in (*group.linears, *group.float_scaled):
            _weight(runner, name).mul_(s[None, :])
        fold(s)
        search_inputs[key].div_(s)  # the same as x / s, without a second copy
        report.ratios[group.prev] = ratio
    if options.clip:
        reads = {name: group.inputs for group in plan.scaling if group.inputs
                 for name in group.linears}
        for name in sorted(names):
            if name.rsplit(".", 1)[-1] in NOT_CLIPPED:
                continue
            expert = expert_linear(name)
            if expert is not None and expert[1] != "down_proj":
                xin = routed_search_inputs(expert[0])
            else:
                xin = search_inputs.get(reads.get(name) or _stage_of(plan, name))
            if xin is None:  # an expert no search token was routed to
                continue
            w = _weight(runner, name)
            w.copy_(clip(w, xin.reshape(-1, xin.shape[-1]), scheme, options))
    return report


def _quantized_names(runner: LayerRunner, plan: LayerPlan, quantized: set[str]) -> set[str]:
    """`quantized` with a MoE layer's fused experts (`plan.experts`) as their per-expert
    linears."""
    if plan.experts is None or plan.experts not in quantized:
        return set(quantized)
    fused = runner.layer.get_submodule(plan.experts)
    return (set(quantized) - {plan.experts}) | set(expert_linears(fused, plan.experts))
