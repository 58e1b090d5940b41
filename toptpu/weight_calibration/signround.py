"""SignRound (Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs", arXiv 2309.05516), with auto-round's min-max tuning: the rounding of
every weight and the range of every group tuned per decoder layer, in torch (float32).

For each quantized linear (``W`` [N, K], groups of ``g`` input channels) the trainable
parameters are a rounding offset ``V`` [N, K] (starts 0, kept in [-0.5, 0.5]) and two range
factors per group, ``alpha`` for the maximum and ``beta`` for the minimum (start 1, kept in
[0, 1], as auto-round's ``minmax_scale_bound``). The dequantized weight the layer computes
with (`tuned_grid`, the grid of `grid` with the factors and the offset):

    lo = min(min(w), 0) * beta        hi = max(max(w), 0) * alpha
    scale = (hi - lo) / maxq, rounded to the scales' storage dtype (float16)
    zero  = clamp(round(-lo / scale), 0, maxq)
    q     = clamp(round(w / scale + V) + zero, 0, maxq)       w~ = (q - zero) * scale

(symmetric: ``hi = max(-lo, hi)``, ``zero = (maxq + 1) / 2``). Every ``round`` is
straight-through (its gradient the identity). With ``V = 0`` and the factors 1 this is round
to nearest, bit for bit (`grid.rtn`).

The loss is the mean squared error between the layer's output with every quantized linear
so tuned and the float layer's output (`tune_layer`). Its inputs are the previous layers'
outputs *as quantized*; its target the float layer's output on the float model's own
hidden states at that layer (auto-round's ``enable_quanted_input``: the driver keeps both
streams, `sequential`). Each iteration takes a batch of calibration sequences (`batch_size`,
default 8 as auto-round; sequences drawn from a seeded shuffle, reshuffled when fewer than
a batch are left), computes the loss and its gradient, keeps the parameters if the loss is
the lowest seen so far, then takes one signed-gradient step ``p -= lr_i * sign(dL/dp)`` with
``lr_i = lr * (1 - i / iterations)`` (linear decay to 0; ``lr`` default ``1 / iterations``
for the offsets and the factors alike) and projects the parameters into their ranges. After
`iterations` steps the best-loss parameters give the integers, scales and zero points
(`QuantizedWeights`), which go into the checkpoint as GPTQ's do.

Memory, per layer (`SignRoundOptions.bounded_memory`, the default; what it computes is the
same, bit for bit: the suite compares it with the whole graph held): the layer's float
weights (kept in bfloat16 where that holds every value exactly, as a bf16 checkpoint's do),
the float32 offsets ``V`` (as auto-round keeps them) and the tiny factors; the best step's
result as its integers, scales and zero points (1 byte a weight, not a float32 copy of
``V``: made when the loss is the lowest so far, from the same parameters); no gradient of
``V`` beyond one linear's: each parameter takes its signed step as soon as its gradient is
complete in the backward (`torch`'s post-accumulate-grad hook; the best was kept before);
and the dequantized weights are not held between the forward and the backward: a linear's
``w~`` is made for its forward without a graph (`TunedWeight`), made again when the
backward needs it (the linear's saved weight, through a saved-tensor hook), and its graph
to ``V`` and the factors is made in the backward in row blocks (`BLOCK_ELEMENTS`; every
row's grid is its own, so a block computes what the whole does). Beyond these, one
batch's activations with their gradients. With `bounded_memory` False the whole graph is
held (three float32 copies of the weights in ``V``, its gradient and the best ``V``, and
the dequantized weights' graphs): the published transcription, kept to check the default
against.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.utils import parametrize

from toptpu.weight_calibration.activations import LayerInputs, layer_inputs
from toptpu.weight_calibration.grid import CalibrationError, QuantizedWeights, QuantScheme
from toptpu.weight_calibration.layers import LINEAR_ATTENTION, LayerRunner

#: auto-round's (and the paper's) default number of tuning steps per layer
DEFAULT_ITERATIONS = 200
#: auto-round's default batch of calibration sequences per step
DEFAULT_BATCH_SIZE = 8
#: the bounds of the rounding offsets and of the range factors
OFFSET_BOUND = 0.5
FACTOR_BOUNDS = (0.0, 1.0)
#: the tuned grid of a large linear is made (and differentiated) in blocks of whole rows of
#: at most this many weights (`TunedWeight`)
BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SignRoundOptions:
    """`iterations` signed-gradient steps per layer on batches of `batch_size` sequences,
    learning rate `learning_rate` (None: ``1 / iterations``) for the offsets and
    `minmax_learning_rate` (None: the same) for the range factors, tuned only with
    `minmax_tuning`; the batches drawn with `seed`; torch's intra-op threads set to
    `threads` while tuning (two spin against each other on a loaded two-core host);
    `bounded_memory`: the memory of the module doc (False: the whole graph held; the same
    integers)."""

    iterations: int = DEFAULT_ITERATIONS
    batch_size: int = DEFAULT_BATCH_SIZE
    learning_rate: float | None = None
    minmax_learning_rate: float | None = None
    minmax_tuning: bool = True
    seed: int = 0
    threads: int = 1
    #: the same steps in bounded memory (module doc); False: the whole graph held
    bounded_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) \
                or self.iterations < 1:
            raise CalibrationError(f"SignRound iterations {self.iterations!r}: a whole number "
                                   "of steps, at least 1")
        if self.batch_size < 1:
            raise CalibrationError(f"SignRound batch size {self.batch_size}: at least 1")
        for name, lr in (("learning rate", self.learning_rate),
                         ("min-max learning rate", self.minmax_learning_rate)):
            if lr is not None and not (np.isfinite(lr) and lr > 0):
                raise CalibrationError(f"SignRound {name} {lr}: a positive number")
        if self.threads < 1:
            raise CalibrationError(f"SignRound threads {self.threads}: at least 1")

    @property
    def lr(self) -> float:
        return 1.0 / self.iterations if self.learning_rate is None else self.learning_rate

    @property
    def minmax_lr(self) -> float:
        return self.lr if self.minmax_learning_rate is None else self.minmax_learning_rate


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) (half to even) with the identity's gradient."""
    return x + (torch.round(x) - x).detach()


def _scale_dtype(scheme: QuantScheme) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32}[scheme.scale_dtype]


def _smallest_scale(scheme: QuantScheme) -> float:
    """The storage dtype's smallest positive value (`grid.round_scale`'s)."""
    dt = _scale_dtype(scheme)
    bits = torch.int32 if dt == torch.float32 else torch.int16
    return float(torch.tensor(1, dtype=bits).view(dt).float())


def tuned_grid(weight: torch.Tensor, offset: torch.Tensor | None, max_factor: torch.Tensor | None,
               min_factor: torch.Tensor | None, scheme: QuantScheme
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(integers q [N, G, g], scale [N, G, 1], zero [N, G, 1]) of `weight` [N, K] on the
    grid tuned by `offset` [N, K] and the factors [N, G] (module doc; None: 0 and 1), in
    float32, differentiable in the parameters through straight-through rounding.
    The grid is `grid.grid_params`' (empty groups -1..1, scales rounded to their storage
    dtype, a scale of 0 its smallest positive value)."""
    weight = weight.float()  # a weight kept in bfloat16 (bounded memory): exact
    n, k = weight.shape
    gs = scheme.group_length(k)
    w = weight.reshape(n, k // gs, gs)
    maxq = scheme.maxq
    lo = torch.clamp(w.amin(dim=-1), max=0.0)
    hi = torch.clamp(w.amax(dim=-1), min=0.0)
    empty = (lo == 0) & (hi == 0)
    if min_factor is not None:
        lo = lo * min_factor
    if max_factor is not None:
        hi = hi * max_factor
    if scheme.sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    lo = torch.where(empty, torch.full_like(lo, -1.0), lo)
    hi = torch.where(empty, torch.full_like(hi, 1.0), hi)
    scale = ((hi - lo) / maxq).to(_scale_dtype(scheme)).to(weight.dtype)
    scale = torch.clamp(scale, min=_smallest_scale(scheme))
    if scheme.sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.clamp(_round_ste(-lo / scale), 0, maxq)
    scale, zero = scale[..., None], zero[..., None]
    t = w / scale
    if offset is not None:
        t = t + offset.reshape(n, k // gs, gs)
    q = torch.clamp(_round_ste(t) + zero, 0, maxq)
    return q, scale, zero


def dequantized(weight: torch.Tensor, offset: torch.Tensor | None,
                max_factor: torch.Tensor | None, min_factor: torch.Tensor | None,
                scheme: QuantScheme) -> torch.Tensor:
    """The weights [N, K] the tuned grid gives (``(q - zero) * scale``)."""
    q, scale, zero = tuned_grid(weight, offset, max_factor, min_factor, scheme)
    return ((q - zero) * scale).reshape(weight.shape)


def quantized_weights(weight: torch.Tensor, offset: torch.Tensor | None,
                      max_factor: torch.Tensor | None, min_factor: torch.Tensor | None,
                      scheme: QuantScheme) -> QuantizedWeights:
    """The stored form of the tuned grid: uint8 integers, scales in their storage dtype,
    uint8 zero points; its `dequantize` is `dequantized` exactly."""
    with torch.no_grad():
        q, scale, zero = tuned_grid(weight, offset, max_factor, min_factor, scheme)
    n, k = weight.shape
    return QuantizedWeights(
        q.reshape(n, k).numpy().astype(np.uint8),
        scale[..., 0].double().numpy().astype(scheme.numpy_scale_dtype),
        zero[..., 0].numpy().astype(np.uint8), scheme)


def row_blocks(rows: int, cols: int) -> Iterator[slice]:
    """Runs of whole rows of at most `BLOCK_ELEMENTS` weights (at least one row)."""
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def quantized_weights_blocked(weight: torch.Tensor, offset: torch.Tensor,
                              max_factor: torch.Tensor, min_factor: torch.Tensor,
                              scheme: QuantScheme) -> QuantizedWeights:
    """`quantized_weights`, made in row blocks (each row's grid is its own: the same
    integers, scales and zero points, without the whole linear's float32 temporaries)."""
    n, k = weight.shape
    groups = k // scheme.group_length(k)
    q = np.empty((n, k), np.uint8)
    scales = np.empty((n, groups), scheme.numpy_scale_dtype)
    zeros = np.empty((n, groups), np.uint8)
    for rows in row_blocks(n, k):
        part = quantized_weights(weight[rows], offset[rows], max_factor[rows], min_factor[rows],
                                 scheme)
        q[rows], scales[rows], zeros[rows] = part.qweight, part.scales, part.zeros
    return QuantizedWeights(q, scales, zeros, scheme)


class _RemadeWeights:
    """The dequantized weights a forward made (`TunedWeight`), not held for the backward:
    a saved-tensor hook stores, in place of such a weight (or a view of it, as a linear
    saves its weight's transpose), how to make it again, and makes it when the backward
    unpacks it (`torch.autograd.graph.saved_tensors_hooks`). The parameters have not moved
    by then: a linear's backward runs before its parameters' gradients are complete."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], Callable[[], torch.Tensor]]] = {}

    def register(self, weight: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
        self.made = {k: v for k, v in self.made.items() if v[0]() is not None}
        self.made[weight.untyped_storage().data_ptr()] = (weakref.ref(weight), make)

    def pack(self, t: torch.Tensor) -> Any:
        entry = self.made.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None:
            return t
        return (entry[1], t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        make, size, stride, offset = packed
        return make().as_strided(size, stride, offset)


def _tuned_weight(weight: torch.Tensor, offset: torch.Tensor, max_factor: torch.Tensor,
                  min_factor: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The dequantized weights [N, K] float32 without gradients, made in row blocks."""
    n, k = weight.shape
    out = torch.empty(n, k)
    with torch.no_grad():
        for rows in row_blocks(n, k):
            out[rows] = dequantized(weight[rows], offset[rows], max_factor[rows],
                                    min_factor[rows], scheme)
    return out


class TunedWeight(torch.autograd.Function):
    """A linear's dequantized tuned weights (`dequantized`) as one autograd node: made
    without a graph in the forward; in the backward the grid's graph is made again row
    block by row block and the weights' gradient taken through it to the offsets and the
    factors (the same operations on the same values as the whole graph: the same
    gradients)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, offset: torch.Tensor,
                max_factor: torch.Tensor, min_factor: torch.Tensor, scheme: QuantScheme,
                remade: _RemadeWeights) -> torch.Tensor:
        ctx.scheme = scheme
        ctx.save_for_backward(weight, offset, max_factor, min_factor)
        out = _tuned_weight(weight, offset, max_factor, min_factor, scheme)
        remade.register(out, lambda: _tuned_weight(weight, offset, max_factor, min_factor,
                                                   scheme))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight, offset, max_factor, min_factor = ctx.saved_tensors
        need = ctx.needs_input_grad[1:4]
        params = (offset, max_factor, min_factor)
        grads = [torch.empty_like(p) if nd else None for p, nd in zip(params, need, strict=True)]
        n, k = weight.shape
        for rows in row_blocks(n, k):
            with torch.enable_grad():
                parts = [p[rows].detach().requires_grad_(nd)
                         for p, nd in zip(params, need, strict=True)]
                made = dequantized(weight[rows], parts[0], parts[1], parts[2], ctx.scheme)
                wanted = [p for p, nd in zip(parts, need, strict=True) if nd]
                got = iter(torch.autograd.grad(made, wanted, grad[rows], allow_unused=True))
            for g, nd in zip(grads, need, strict=True):
                if nd:
                    part = next(got)
                    assert g is not None
                    g[rows] = 0.0 if part is None else part
        return (None, *grads, None, None)


def _silu_times(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u``, made in blocks of rows (elementwise: the same values, without a
    whole ``silu(g)`` beside the product)."""
    out = torch.empty_like(g)
    g2, u2, o2 = (t.view(-1, t.shape[-1]) for t in (g, u, out))
    for rows in row_blocks(*g2.shape):
        o2[rows] = torch.nn.functional.silu(g2[rows]) * u2[rows]
    return out


class _SiluTimes(torch.autograd.Function):
    """``silu(g) * u`` (a gated MLP's product) saving only `g` and `u`: ``silu(g)`` is made
    again in the backward, and the product, which the down projection saves, is made again
    when it is unpacked (`_RemadeWeights`). The backward is autograd's own for ``silu`` and
    ``*`` (`aten.silu_backward`, the product rule), in blocks of rows: the same
    gradients."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor,
                remade: _RemadeWeights) -> torch.Tensor:
        g, u = g.contiguous(), u.contiguous()
        ctx.save_for_backward(g, u)
        out = _silu_times(g, u)
        remade.register(out, lambda: _silu_times(g, u))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g, u = ctx.saved_tensors
        grad = grad.contiguous()
        grad_g, grad_u = torch.empty_like(g), torch.empty_like(u)
        g2, u2, d2, gg, gu = (t.view(-1, t.shape[-1]) for t in (g, u, grad, grad_g, grad_u))
        for rows in row_blocks(*g2.shape):
            gu[rows] = d2[rows] * torch.nn.functional.silu(g2[rows])
            gg[rows] = torch.ops.aten.silu_backward(d2[rows] * u2[rows], g2[rows])
        return grad_g, grad_u, None


#: the activations whose gated MLP `_SiluTimes` computes (`torch.nn.SiLU`, transformers')
_SILU = ("SiLU", "SiLUActivation")


def _lean_mlp(layer: torch.nn.Module, remade: _RemadeWeights) -> Callable[[], None] | None:
    """Bounded memory: the layer's gated MLP (``down(silu(gate(x)) * up(x))``, as
    transformers' Qwen/Llama MLPs) with its product through `_SiluTimes`; returns what puts
    the MLP's own forward back (None: the layer has no such MLP)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or type(getattr(mlp, "act_fn", None)).__name__ not in _SILU or not all(
            isinstance(getattr(mlp, n, None), torch.nn.Linear)
            for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    if "forward" in vars(mlp) or type(mlp).__name__ not in ("Qwen2MLP", "Qwen3MLP",
                                                            "Qwen3_5MLP", "LlamaMLP"):
        return None

    def forward(x: torch.Tensor) -> torch.Tensor:
        g = mlp.gate_proj(x)
        return mlp.down_proj(_SiluTimes.apply(g, mlp.up_proj(x), remade))

    mlp.forward = forward

    def restore() -> None:
        del mlp.forward

    return restore


class TunedRounding(torch.nn.Module):
    """A linear's weight parametrized by SignRound's offset and range factors (module doc):
    `torch.nn.utils.parametrize` calls it with the float weight."""

    def __init__(self, out_features: int, in_features: int, scheme: QuantScheme,
                 minmax_tuning: bool) -> None:
        super().__init__()
        self.scheme = scheme
        groups = in_features // scheme.group_length(in_features)
        self.offset = torch.nn.Parameter(torch.zeros(out_features, in_features))
        self.max_factor = torch.nn.Parameter(torch.ones(out_features, groups),
                                             requires_grad=minmax_tuning)
        self.min_factor = torch.nn.Parameter(torch.ones(out_features, groups),
                                             requires_grad=minmax_tuning)
        #: bounded memory (`bound`): the weights made again for the backward; the
        #: learning rates of the step each parameter takes when its gradient is complete
        self.remade: _RemadeWeights | None = None
        self.rates = (0.0, 0.0)
        self.hooks: list[Any] = []

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.remade is not None:
            return TunedWeight.apply(weight, self.offset, self.max_factor, self.min_factor,
                                     self.scheme, self.remade)
        return dequantized(weight, self.offset, self.max_factor, self.min_factor, self.scheme)

    def bound(self, remade: _RemadeWeights) -> None:
        """Bounded memory (module doc): `TunedWeight`, and each parameter's signed step
        taken as soon as its gradient is complete (its gradient then let go)."""
        self.remade = remade
        for p, bounds in ((self.offset, (-OFFSET_BOUND, OFFSET_BOUND)),
                          (self.max_factor, FACTOR_BOUNDS), (self.min_factor, FACTOR_BOUNDS)):
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(
                    lambda q, b=bounds, first=p is self.offset: self._step_one(q, b, first)))

    @torch.no_grad()
    def _step_one(self, p: torch.Tensor, bounds: tuple[float, float], offset: bool) -> None:
        if p.grad is not None:
            p.sub_((self.rates[0] if offset else self.rates[1]) * torch.sign(p.grad))
            p.clamp_(*bounds)
            p.grad = None

    def unbind(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.remade = None

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.offset.detach().clone(), self.max_factor.detach().clone(),
                self.min_factor.detach().clone())

    @torch.no_grad()
    def load(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.offset.copy_(state[0])
        self.max_factor.copy_(state[1])
        self.min_factor.copy_(state[2])

    @torch.no_grad()
    def step(self, lr: float, minmax_lr: float) -> None:
        """One signed-gradient step, then the parameters projected into their ranges."""
        if self.offset.grad is not None:
            self.offset.sub_(lr * torch.sign(self.offset.grad))
            self.offset.clamp_(-OFFSET_BOUND, OFFSET_BOUND)
        for p in (self.max_factor, self.min_factor):
            if p.requires_grad and p.grad is not None:
                p.sub_(minmax_lr * torch.sign(p.grad))
                p.clamp_(*FACTOR_BOUNDS)
        for p in (self.offset, self.max_factor, self.min_factor):
            p.grad = None


class BatchSampler:
    """Batches of `batch` sequence indices out of `n`: consecutive runs of a shuffle
    (numpy's generator seeded with `seed`), reshuffled when fewer than a batch are left."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch = n, min(batch, n)
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n)
        self.at = 0

    def next(self) -> np.ndarray:
        if self.at + self.batch > self.n:
            self.order, self.at = self.rng.permutation(self.n), 0
        out = np.sort(self.order[self.at:self.at + self.batch])
        self.at += self.batch
        return out


def _forward(runner: LayerRunner, x: torch.Tensor) -> torch.Tensor:
    """The layer's output on `x` [B, L, H] with gradients (a linear-attention layer one
    sequence at a time, as `LayerRunner.forward`)."""
    if runner.kind == LINEAR_ATTENTION and x.shape[0] != 1:
        return torch.cat([_forward(runner, x[i:i + 1]) for i in range(x.shape[0])])
    return runner.block(x, runner.position_ids, runner.mask)


@dataclass
class SignRoundResult:
    weights: dict[str, QuantizedWeights]
    #: the loss at round to nearest (iteration 0's batch), the best loss and its iteration
    initial_loss: float
    best_loss: float
    best_iteration: int


def tune_layer(runner: LayerRunner, inputs: torch.Tensor | LayerInputs,
               targets: torch.Tensor | LayerInputs, linears: list[str], scheme: QuantScheme,
               options: SignRoundOptions, seed: int = 0,
               on_iteration: Callable[[int], None] | None = None) -> SignRoundResult:
    """SignRound on the `linears` of `runner`'s layer (module doc): `inputs` the layer's
    (quantized) inputs, `targets` the float layer's outputs, both [n, L, H]. Afterwards each
    linear holds its dequantized tuned weights (the layer computes as quantized). The
    batches are drawn with ``options.seed + seed`` (the driver passes the layer's index)."""
    x, y = layer_inputs(inputs), layer_inputs(targets)
    layer = runner.layer
    before = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    grads = [(p, p.requires_grad) for p in layer.parameters()]
    layer.requires_grad_(False)
    tuned: dict[str, TunedRounding] = {}
    remade = _RemadeWeights() if options.bounded_memory else None
    restore_mlp: Callable[[], None] | None = None
    # the heap's handling where row blocks are made (a linear above `BLOCK_ELEMENTS`)
    heap = _HeapReturned() if options.bounded_memory and any(
        layer.get_parameter(f"{name}.weight").numel() > BLOCK_ELEMENTS for name in linears) \
        else None
    if heap is not None:
        heap.__enter__()
    try:
        for name in linears:
            lin = layer.get_submodule(name)
            assert isinstance(lin, torch.nn.Linear)
            if lin.in_features % scheme.group_length(lin.in_features):
                raise CalibrationError(f"{name}: group size {scheme.group_size} does not divide "
                                       f"its {lin.in_features} inputs")
            tuned[name] = TunedRounding(lin.out_features, lin.in_features, scheme,
                                        options.minmax_tuning)
            parametrize.register_parametrization(lin, "weight", tuned[name], unsafe=True)
            if remade is not None:
                tuned[name].bound(remade)
                _keep_bf16(_original_parameter(lin))
        if remade is not None:
            restore_mlp = _lean_mlp(layer, remade)
        sampler = BatchSampler(x.shape[0], options.batch_size, options.seed + seed)
        best_loss, best_iteration, initial = float("inf"), 0, float("nan")
        best: dict[str, Any] = {name: t.state() for name, t in tuned.items()} \
            if remade is None else {}
        for i in range(options.iterations):
            index = sampler.next()
            decay = 1.0 - i / options.iterations
            if remade is None:
                value = _plain_step(runner, x.take(index), y.take(index))
            else:
                for t in tuned.values():
                    t.rates = (options.lr * decay, options.minmax_lr * decay)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        remade.pack, remade.unpack):
                    loss = torch.nn.functional.mse_loss(_forward(runner, x.take(index)),
                                                        y.take(index))
                value = float(loss.detach())
            if not np.isfinite(value):
                raise CalibrationError(f"SignRound's loss is not finite at step {i} (linears "
                                       f"{', '.join(linears)})")
            if i == 0:
                initial = value
            if value < best_loss:
                best_loss, best_iteration = value, i
                best = {name: t.state() for name, t in tuned.items()} if remade is None else {
                    name: quantized_weights_blocked(_original(layer.get_submodule(name)),
                                                    t.offset, t.max_factor, t.min_factor,
                                                    scheme)
                    for name, t in tuned.items()}
            if remade is None:
                for t in tuned.values():
                    t.step(options.lr * decay, options.minmax_lr * decay)
            else:  # each parameter steps as its gradient is complete (`TunedRounding.bound`)
                with torch.enable_grad():
                    loss.backward()
                del loss
                remade.made.clear()
                if heap is not None:
                    heap.trim()
            if on_iteration is not None:
                on_iteration(i)
        out: dict[str, QuantizedWeights] = {}
        for name, t in tuned.items():
            lin = layer.get_submodule(name)
            t.unbind()
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
            assert isinstance(lin, torch.nn.Linear)
            if remade is None:
                t.load(best[name])
                out[name] = quantized_weights(lin.weight.detach(), t.offset, t.max_factor,
                                              t.min_factor, scheme)
            else:
                out[name] = best[name]
            lin.weight.data = torch.from_numpy(out[name].dequantize())
        tuned.clear()
        return SignRoundResult(out, initial, best_loss, best_iteration)
    finally:
        if heap is not None:
            heap.__exit__()
        if restore_mlp is not None:
            restore_mlp()
        for name, t in tuned.items():  # an error: the float weights back
            t.unbind()
            lin = layer.get_submodule(name)
            if parametrize.is_parametrized(lin, "weight"):
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
            lin.weight.data = lin.weight.data.float()
        for p, g in grads:
            p.requires_grad_(g)
        torch.set_num_threads(before)


class _HeapReturned:
    """While tuning a layer whose linears are made in row blocks (glibc only): blocks of
    1 MiB and more are mapped and unmapped on their own (``mallopt(M_MMAP_THRESHOLD)``)
    instead of coming from the heap, where the tuning's many row-block temporaries (16 MiB)
    left it fragmented (about 0.3 GB resident beyond what is in use at Qwen2.5-7B's
    widths); free heap pages are given back after each step (``malloc_trim``). Afterwards
    the threshold is glibc's usual 32 MiB (where its dynamic threshold settles once such a
    block was freed)."""

    M_MMAP_THRESHOLD = -3

    def __init__(self) -> None:
        self.libc: Any = None
        try:
            libc = ctypes.CDLL(None)
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                self.libc = libc
        except OSError:
            pass

    def __enter__(self) -> _HeapReturned:
        if self.libc is not None:
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 1 << 20)
        return self

    def trim(self) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)

    def __exit__(self, *exc: object) -> None:
        if self.libc is not None:
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 32 << 20)
            self.libc.malloc_trim(0)


def return_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): the calibration driver calls it after each layer."""
    _HeapReturned().trim()


def _plain_step(runner: LayerRunner, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss of a batch and its gradients, the whole graph held (`bounded_memory`
    False)."""
    with torch.enable_grad():
        loss = torch.nn.functional.mse_loss(_forward(runner, x), y)
        loss.backward()
    return float(loss.detach())


def _original_parameter(lin: torch.nn.Module) -> torch.nn.Parameter:
    """The float weights of a linear under the tuned rounding (`parametrize`'s original)."""
    original = lin.get_parameter("parametrizations.weight.original")
    assert isinstance(original, torch.nn.Parameter)
    return original


def _original(lin: torch.nn.Module) -> torch.Tensor:
    return _original_parameter(lin).detach()


def _keep_bf16(weight: torch.nn.Parameter) -> None:
    """Keep `weight` in bfloat16 where that holds every value exactly (a bf16 checkpoint's
    weights; the grid converts them back: the same values)."""
    half = weight.data.to(torch.bfloat16)
    if torch.equal(half.float(), weight.data):
        weight.data = half
