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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from toptpu.weight_calibration.activations import LayerInputs, layer_inputs
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
    s32, z32 = scale.float()[:, None], zero.float()[:, None]
    q = torch.round(g / s32).add_(z32).clamp_(0, maxq)
    return q.sub_(z32).mul_(s32).reshape(n, k)


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


@torch.no_grad()
def collect_inputs(runner: LayerRunner, plan: LayerPlan, x: LayerInputs, rows: np.ndarray
                   ) -> tuple[dict[str, StageInputs], torch.Tensor]:
    """One float forward of the layer over all sequences `x` [n, L, H]: each stage's input
    statistics and search inputs (by its first linear), and the layer inputs of the search
    sequences."""
    stages = {stage[0]: StageInputs(torch.zeros(0), 0, []) for stage in plan.stages}
    n = x.shape[0]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.from_numpy(rows)] = True
    current: dict[str, torch.Tensor] = {}
    hooks = []
    for name, rec in stages.items():
        def hook(_m: torch.nn.Module, args: tuple, rec: StageInputs = rec) -> None:
            inp = args[0].detach()
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
    return stages, x.take(rows)


def _linear(runner: LayerRunner, name: str) -> torch.nn.Linear:
    m = runner.layer.get_submodule(name)
    if not isinstance(m, torch.nn.Linear):
        raise CalibrationError(f"'{name}' is a {type(m).__name__}, not a linear")
    return m


def _stage_of(plan: LayerPlan, linear: str) -> str:
    return next(stage[0] for stage in plan.stages if linear in stage)


def _batched(runner: LayerRunner, path: str, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([runner.call(path, x[b]) for b in runner.batches(x.shape[0])])


def _w_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    w = torch.cat(weights, dim=0)
    gs = scheme.group_length(w.shape[1])
    g = w.abs().reshape(-1, gs)
    g = g / (g.amax(dim=1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(dim=0)


def _folder(runner: LayerRunner, group: ScalingGroup, k: int
            ) -> Callable[[torch.Tensor], None] | None:
    """How to divide `group.prev`'s output channels by s (None: it cannot absorb them)."""
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


def _scaled_quantized(w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Q(W * s) / s: the weights the search tries for scale s."""
    return fake_quantize(w * s[None, :], scheme) / s[None, :]


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
    linears = [_linear(runner, n) for n in group.linears]
    originals = [m.weight.data.clone() for m in linears]
    x_mean = inputs.mean.to(torch.float32)
    w_mean = _w_mean(originals, scheme) if options.duo_scaling else None
    reference = _batched(runner, group.inspect, inspect_input)
    losses = []
    try:
        for ratio, s in _candidates(x_mean, w_mean, options):
            for m, w in zip(linears, originals, strict=True):
                m.weight.data = _scaled_quantized(w, s, scheme)
            out = _batched(runner, group.inspect, inspect_input)
            losses.append((float((out - reference).pow(2).mean(dtype=torch.float64)), ratio, s))
    finally:
        for m, w in zip(linears, originals, strict=True):
            m.weight.data = w
    return _first_least(losses)


@torch.no_grad()
def search_scale(runner: LayerRunner, group: ScalingGroup, inputs: StageInputs,
                 inspect_input: torch.Tensor, scheme: QuantScheme, options: AwqOptions
                 ) -> tuple[torch.Tensor, float]:
    """`search_scale_direct`'s choice. Where the inspected module is the group's one linear
    (down_proj after up_proj; o_proj after v_proj), its output error on inputs X [T, K] is
    linear in the weight error D = W' - W [N, K]: mean((X D^T)^2) = sum((D X^T X) * D) /
    (T N) (a bias cancels). X^T X is formed once (float64) and a ratio costs N K^2 instead
    of a forward's T N K. Other groups (the inspected module is not linear in the weights:
    attention, the MLP) rerun the module per ratio, as by definition."""
    if len(group.linears) != 1 or group.inspect != group.linears[0]:
        return search_scale_direct(runner, group, inputs, inspect_input, scheme, options)
    w = _linear(runner, group.inspect).weight.data
    x = inspect_input.reshape(-1, inspect_input.shape[-1])
    gram = _input_gram(x)
    x_mean = inputs.mean.to(torch.float32)
    w_mean = _w_mean([w], scheme) if options.duo_scaling else None
    w64 = w.double()
    denominator = x.shape[0] * w.shape[0]
    losses = []
    for ratio, s in _candidates(x_mean, w_mean, options):
        d = _scaled_quantized(w, s, scheme).double().sub_(w64)
        losses.append((float((d @ gram).mul_(d).sum()) / denominator, ratio, s))
    return _first_least(losses)


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
    stages, layer_input = collect_inputs(runner, plan, x, rows)
    search_inputs = {name: rec.stacked() for name, rec in stages.items()}
    report = AwqLayerReport({}, [])
    for group in plan.scaling:
        if not set(group.linears) <= quantized:
            report.skipped.append(group.prev)
            continue
        stage = _stage_of(plan, group.linears[0])
        k = search_inputs[stage].shape[-1]
        fold = _folder(runner, group, k)
        if fold is None:
            report.skipped.append(group.prev)
            continue
        inspect_input = layer_input if group.inspect == "" else search_inputs[stage]
        s, ratio = search(runner, group, stages[stage], inspect_input, scheme, options)
        for name in group.linears:
            _linear(runner, name).weight.data *= s[None, :]
        fold(s)
        search_inputs[stage] = search_inputs[stage] / s
        report.ratios[group.prev] = ratio
    if options.clip:
        for name in sorted(quantized):
            if name.rsplit(".", 1)[-1] in NOT_CLIPPED:
                continue
            m = _linear(runner, name)
            xin = search_inputs[_stage_of(plan, name)]
            m.weight.data = clip(m.weight.data, xin.reshape(-1, xin.shape[-1]), scheme, options)
    return report
