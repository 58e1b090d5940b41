"""The calibration driver: a float model in, a calibrated pre-quantized checkpoint directory
out, one decoder layer at a time (`calibrate`).

Sequential, as GPTQ prescribes: the calibration tokens are embedded once; each layer is then
materialized in float32, calibrated on its inputs, its linears replaced by their quantized
(dequantized) weights, and run again to give the next layer's inputs: every layer is
calibrated on the outputs of the layers before it *as quantized*. Within a layer GPTQ is
sequential too: the linears of one input (q/k/v; o; gate/up; down) are quantized before the
next input is taken, from a forward through the already quantized ones (stopped as soon as
that input is seen). The forwards are torch float32 on the Hugging Face layer module
(`layers.LayerRunner`). The layer's shard of the checkpoint is written and the layer let go
before the next one is read.

Memory (GPTQ): the float32 layer, its linears quantized so far held as their integers
(`IntegersUntilRun`: 1 byte a weight; each dequantized only while it runs), one forward's
activations of a batch (`batch_tokens`, `batch_bytes`), and one stage's Hessian (K x K
float32, K its input width) factored in its own memory (`gptq.inverse_cholesky_upper`),
with one working copy of the weights of the linear GPTQ is on. At Qwen2.5-7B's widths the
peak is down_proj's stage: its 1.4 GB Hessian beside down_proj's own 0.27 GB of float32
weights, one dequantized gate/up while the stage's inputs are taken, and the 0.2 GB of
integers (`bench/calibration_memory_7b.py` measures it per phase). GPTAQ: the same, and
the float layer (its weights in bfloat16); a stage whose Hessian and dXX^T would take more
than `GPTAQ_TWO_MATRICES_BYTES` together (Qwen2.5-7B's down_proj) holds one K x K matrix,
its inputs spilled to scratch files (`_gptaq_stage_in_one`). AWQ: the float32
layer and the inputs of each of the layer's linears for the search tokens
(`AwqOptions.search_tokens` x (3 hidden + intermediate) x 4 bytes); a MoE layer's also a
copy of every expert's gate/up while their shared scale is searched, and each expert's
down inputs on its routed search tokens (`awq` module doc). SignRound: the layer (its
weights in bfloat16 where exact), the float32 offsets, the best step's integers, one
linear's gradient and dequantized weights at a time, and one batch's activations with their
gradients (`signround` module doc); its targets are
the float model's own hidden states, kept in a second scratch file beside the quantized
ones and run through each float layer before it is tuned. The calibration set's
hidden states live in a scratch file (`activations`); the checkpoint outside the layer is
never read whole: the embedding rows of the calibration tokens only (a streamed source).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

import numpy as np
import torch

from toptpu.dialects.common import DEFAULT_GROUP_SIZE
from toptpu.frontends.hf_loader import LoadedModel, dir_bytes, load_model
from toptpu.passes.convert_top_to_tpu import parse_mode
from toptpu.weight_calibration.activations import (
    Activations,
    InMemory,
    LayerInputs,
    Spill,
    layer_inputs,
)
from toptpu.weight_calibration.awq import AwqOptions, awq_layer
from toptpu.weight_calibration.data import (
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_SEQUENCES,
    CalibrationData,
    calibration_data,
    tokenizer_encoder,
)
from toptpu.weight_calibration.experts import (
    EXPERTS,
    ExpertsResult,
    calibrate_experts,
    expert_shapes,
    experts_fit,
    fused_experts,
)
from toptpu.weight_calibration.export import (
    EXPORT_FORMATS,
    CheckpointWriter,
    gptq_tensors,
    quantization_config,
)
from toptpu.weight_calibration.gptq import (
    DAMPING_STEPS,
    GPTQ_DTYPES,
    AsymmetryAccumulator,
    AsymmetryInFactor,
    HessianAccumulator,
    NotPositiveDefinite,
    PreparedHessian,
    asymmetry_rows,
    asymmetry_term,
    gptq,
    permute_columns,
    prepare_hessian,
)
from toptpu.weight_calibration.grid import (
    RANGE_SEARCHES,
    CalibrationError,
    QuantizedWeights,
    QuantScheme,
    rtn,
)
from toptpu.weight_calibration.layers import (
    LayerPlan,
    LayerRunner,
    LayerSource,
    ModelLayers,
    StreamedLayers,
    layer_plan,
    open_layers,
)
from toptpu.weight_calibration.signround import (
    SignRoundOptions,
    return_free_memory,
    tune_layer,
)

#: "awq,gptq": AWQ's scales searched and folded, then GPTQ on the scaled weights; "gptaq":
#: GPTQ matching the float model's outputs; "awq,gptaq": AWQ's scales, then GPTAQ
#: (`calibrate_layer`)
METHODS = ("gptq", "awq", "signround", "rtn", "awq,gptq", "gptaq", "awq,gptaq")
#: the methods GPTQ quantizes with (and `CalibrationRequest.ranges` shapes)
GPTQ_METHODS = ("gptq", "awq,gptq", "gptaq", "awq,gptaq")
#: the methods that keep the float model's hidden states beside the quantized ones
FLOAT_STATES = ("signround", "gptaq", "awq,gptaq")


@dataclass(frozen=True)
class CalibrationRequest:
    """What to calibrate and how. `method`: gptq | awq | signround | rtn (the same grid and
    export, round to nearest: the baseline) | awq,gptq | gptaq | awq,gptaq
    (`calibrate_layer`). GPTQ:
    `act_order` (static groups), `percdamp`, `block_size`, `ranges` (each group's range:
    min/max or the MSE grid, `grid.RANGE_SEARCHES`); AWQ: `awq`; SignRound: `signround`.
    `export_format`: gptq | auto_round (`export`)."""

    method: str = "gptq"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    act_order: bool = True
    percdamp: float = 0.01
    block_size: int = 128
    ranges: str = "minmax"
    awq: AwqOptions = field(default_factory=AwqOptions)
    signround: SignRoundOptions = field(default_factory=SignRoundOptions)
    export_format: str = "auto_round"
    #: GPTQ's dtype (`gptq`): float32 as the reference code, or float64
    gptq_dtype: str = "float32"
    #: a forward batch holds whole sequences: at most this many tokens and this many bytes
    #: of activations (`layers.LayerRunner`)
    batch_tokens: int = 4096
    batch_bytes: int = 1 << 28

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CalibrationError(f"calibration method '{self.method}': one of "
                                   f"{', '.join(METHODS)}")
        if self.export_format not in EXPORT_FORMATS:
            raise CalibrationError(f"export format '{self.export_format}': one of "
                                   f"{', '.join(EXPORT_FORMATS)}")
        if self.gptq_dtype not in GPTQ_DTYPES:
            raise CalibrationError(f"GPTQ dtype '{self.gptq_dtype}': one of "
                                   f"{', '.join(GPTQ_DTYPES)}")
        if self.ranges not in RANGE_SEARCHES:
            raise CalibrationError(f"range search '{self.ranges}': one of "
                                   f"{', '.join(RANGE_SEARCHES)}")
        if self.ranges != "minmax" and self.method not in GPTQ_METHODS:
            raise CalibrationError(f"the range search '{self.ranges}' is GPTQ's; --calibrate "
                                   f"{self.method} finds its ranges its own way (drop it)")
        if not 0 < self.percdamp <= 1:
            raise CalibrationError(f"damping {self.percdamp}: a fraction in (0, 1]")


def request_for_mode(method: str, mode: str, group_size: int | None = None,
                     symmetric: bool | None = None, iterations: int | None = None,
                     ranges: str | None = None) -> CalibrationRequest:
    """The request `toptpu compile -q MODE [--group-size G] [--symmetric] --calibrate METHOD
    [--calibration-iterations N] [--calibration-ranges R]` implies, as the compiler's own
    weight quantization would be shaped: w4 in groups (default the compiler's, 64; -1 per
    channel), asymmetric unless symmetric; w8 per channel and symmetric (the compiler's w8);
    SignRound's steps per layer `iterations` (None: its default); GPTQ's range search
    `ranges` (None: min/max); exported in the `auto_round` format (`export`)."""
    try:
        bits = parse_mode(mode)[1]
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    if bits is None:
        raise CalibrationError(f"--calibrate quantizes weights: -q {mode} keeps them float; "
                               "choose a w4 or w8 mode")
    if bits == 8:
        scheme = QuantScheme(8, -1 if group_size is None else group_size,
                             True if symmetric is None else symmetric)
    else:
        scheme = QuantScheme(bits, DEFAULT_GROUP_SIZE if group_size is None else group_size,
                             bool(symmetric))
    options = SignRoundOptions() if iterations is None else SignRoundOptions(iterations)
    return CalibrationRequest(method, scheme, signround=options,
                              ranges="minmax" if ranges is None else ranges)


@dataclass
class CalibrationReport:
    output: str
    method: str
    layers: int
    sequences: int
    sequence_length: int
    seconds: float
    layer_seconds: list[float]
    quantized_linears: int
    float_linears: list[str]
    note: str | None = None
    #: per layer: GPTQ's loss per linear, or AWQ's ratio per scaling group
    details: list[dict[str, float]] = field(default_factory=list)
    #: MoE experts rounded to nearest: under GPTQ those no calibration token was routed
    #: to, under AWQ those no search token was (`awq` module doc)
    rtn_experts: list[str] = field(default_factory=list)


def _linear_weight(layer: torch.nn.Module, name: str) -> torch.nn.Linear:
    m = layer.get_submodule(name)
    assert isinstance(m, torch.nn.Linear)
    return m


def _stage_hessian(runner: LayerRunner, first: torch.nn.Linear, x: LayerInputs,
                   dtype: str) -> HessianAccumulator:
    """The Hessian of the inputs of `first` over all sequences: each batch's forward is
    stopped as soon as it has been seen."""
    acc = HessianAccumulator(first.in_features, dtype)

    def hook(_m: torch.nn.Module, args: tuple) -> None:
        acc.add(args[0])

    runner.see_inputs(first, x, hook)
    return acc


def _damped(first: str, request: CalibrationRequest,
            hessian: Callable[[], HessianAccumulator],
            first_sums: HessianAccumulator | None = None) -> tuple[PreparedHessian, int]:
    """A stage's Hessian prepared in its own memory (`gptq.prepare_hessian` with
    overwrite) and the rows it was summed over: the sums `first_sums` (or `hessian()`'s)
    first; where the damping is too small, the sums are made again (`hessian()`) and the
    damping raised tenfold (up to 100 %)."""
    damp = request.percdamp
    acc, first_sums = first_sums, None  # the sums dropped before any are made again
    for _ in range(DAMPING_STEPS):
        if acc is None:
            acc = hessian()
        rows = acc.rows
        try:
            return prepare_hessian(acc.hessian(), act_order=request.act_order,
                                   percdamp=damp, overwrite=True), rows
        except NotPositiveDefinite:
            damp = min(damp * 10, 1.0)
        finally:
            acc = None
    raise CalibrationError(f"the Hessian of {first}'s inputs stays singular with {damp:.0%} "
                           "damping: the calibration inputs do not determine this linear "
                           "(more or more varied calibration text)")


def _prepared_stage(runner: LayerRunner, first: str, x: LayerInputs,
                    request: CalibrationRequest) -> PreparedHessian:
    """The stage's Hessian prepared in its own memory, its damping raised where too small
    (`_damped`)."""
    return _damped(first, request, lambda: _stage_hessian(
        runner, _linear_weight(runner.layer, first), x, request.gptq_dtype))[0]


class IntegersUntilRun:
    """The layer's linears quantized so far, held as their integers while GPTQ goes on
    through the layer: each one's float32 weights (its `QuantizedWeights.dequantize`, the
    values the layer computes with) are made just before it runs and dropped after it
    ran, so a stage's Hessian, factor and GPTQ share memory with one such linear at most,
    not all of them (at Qwen2.5-7B's widths gate/up/q/o are 0.65 GB of float32 beside
    down_proj's 1.4 GB Hessian). `restore` gives every linear its float32 weights back."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.held: dict[str, QuantizedWeights] = {}
        self.handles: list[Any] = []

    def hold(self, name: str, weights: QuantizedWeights) -> None:
        linear = _linear_weight(self.layer, name)
        self.held[name] = weights

        def made(module: torch.nn.Module, _args: tuple) -> None:
            module.weight.data = torch.from_numpy(weights.dequantize())

        def dropped(module: torch.nn.Module, _args: tuple, _out: Any) -> None:
            module.weight.data = _NO_WEIGHTS

        linear.weight.data = _NO_WEIGHTS
        self.handles.append(linear.register_forward_pre_hook(made))
        self.handles.append(linear.register_forward_hook(dropped))

    def unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def restore(self) -> None:
        self.unhook()
        for name, weights in self.held.items():
            _linear_weight(self.layer, name).weight.data = torch.from_numpy(
                weights.dequantize())
        self.held.clear()


#: the weights of a linear held as its integers (`IntegersUntilRun`)
_NO_WEIGHTS = torch.empty(0)


@torch.no_grad()
def _quantize_stages(runner: LayerRunner, plan: LayerPlan, quantized: set[str],
                     request: CalibrationRequest, on_stage: Callable[[str], None] | None,
                     integers: IntegersUntilRun,
                     prepare: Callable[[str], tuple[PreparedHessian,
                                                    np.ndarray | AsymmetryInFactor | None]]
                     ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """The layer's `quantized` linears stage by stage (module doc): each stage's prepared
    Hessian (and GPTAQ's P, or None) from `prepare(first linear of the stage)`, its linears
    by `gptq` and held as integers until they run (`integers`), so the next stage's inputs
    are the layer's as quantized so far. `on_stage` is told each stage's first linear."""
    out: dict[str, QuantizedWeights] = {}
    losses: dict[str, float] = {}
    for stage in plan.stages:
        names = [n for n in stage if n in quantized]
        if not names:
            continue
        if on_stage is not None:
            on_stage(stage[0])
        prepared, asymmetry = prepare(stage[0])
        for name in names:
            res = gptq(_linear_weight(runner.layer, name).weight.detach().numpy(), prepared,
                       request.scheme, act_order=request.act_order,
                       block_size=request.block_size, ranges=request.ranges,
                       asymmetry=asymmetry)
            out[name] = res.weights
            losses[name] = res.loss
            integers.hold(name, res.weights)
        del prepared, asymmetry  # the stage's K x K matrices
    return out, losses


def gptq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
               quantized: set[str], request: CalibrationRequest,
               on_stage: Callable[[str], None] | None = None,
               experts_out: list[ExpertsResult] | None = None
               ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """GPTQ of the layer's `quantized` linears, stage by stage (module doc); each stage's
    linears get their dequantized integers as soon as the stage is quantized. `on_stage`
    is told the name of each stage's first linear as it starts. A MoE layer's routed
    experts (`plan.experts`, when in `quantized`) come last, per expert
    (`experts.calibrate_experts`); their result is appended to `experts_out`."""
    x = layer_inputs(x)
    integers = IntegersUntilRun(runner.layer)
    try:
        out, losses = _quantize_stages(
            runner, plan, quantized, request, on_stage, integers,
            lambda first: (_prepared_stage(runner, first, x, request), None))
        if plan.experts is not None and plan.experts in quantized:
            if on_stage is not None:
                on_stage(plan.experts)
            _experts(runner, plan.experts, x, request, "gptq", out, losses, experts_out)
        integers.restore()  # the Hessians are gone: the layer's float32 weights back
    finally:
        integers.unhook()
    return out, losses


def _experts(runner: LayerRunner, path: str, x: LayerInputs, request: CalibrationRequest,
             method: str, out: dict[str, QuantizedWeights], losses: dict[str, float],
             experts_out: list[ExpertsResult] | None) -> None:
    experts = runner.layer.get_submodule(path)
    res = calibrate_experts(runner, x, experts, request.scheme, method,
                            act_order=request.act_order, percdamp=request.percdamp,
                            block_size=request.block_size, dtype=request.gptq_dtype,
                            prefix=path, ranges=request.ranges)
    out.update(res.weights)
    losses.update(res.losses)
    if experts_out is not None:
        experts_out.append(res)


def calibrate_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
                    quantized: set[str], request: CalibrationRequest,
                    on_stage: Callable[[str], None] | None = None,
                    experts_out: list[ExpertsResult] | None = None,
                    targets: torch.Tensor | LayerInputs | None = None, index: int = 0
                    ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """The layer's `quantized` linears by the request's method; afterwards the layer holds
    their dequantized weights (and AWQ's folded scales). A MoE layer's routed experts:
    GPTQ per expert; AWQ's scales (`awq` module doc) then rounded to nearest; or rounded
    to nearest (`rtn`); SignRound refuses them. Under AWQ the experts no search token was
    routed to are the result's `unrouted` (appended to `experts_out`). SignRound tunes
    against `targets` (the float layer's outputs; None: the layer's own float outputs on
    `x`), its batches seeded with the layer's `index`."""
    if request.method == "gptq":
        return gptq_layer(runner, plan, x, quantized, request, on_stage, experts_out)
    if request.method == "awq,gptq":
        return _awq_gptq_layer(runner, plan, x, quantized, request, on_stage)
    if request.method in ("gptaq", "awq,gptaq"):
        if targets is None:
            raise CalibrationError("GPTAQ needs the float model's inputs of the layer")
        if request.method == "gptaq":
            return _gptaq_layer(runner, plan, x, quantized, request, on_stage, targets)
        return _awq_gptaq_layer(runner, plan, x, quantized, request, on_stage, targets)
    if request.method == "signround":
        return _signround_layer(runner, plan, x, quantized, request, on_stage, targets, index)
    details: dict[str, float] = {}
    unscaled: list[int] = []
    tokens: list[int] = []
    if request.method == "awq":
        report = awq_layer(runner, plan, x, request.scheme, request.awq, quantized)
        details = {f"ratio:{k}": v for k, v in report.ratios.items()}
        unscaled, tokens = report.unscaled_experts, report.expert_tokens
    out = {}
    for name in sorted(quantized - {plan.experts}):
        lin = _linear_weight(runner.layer, name)
        out[name] = rtn(lin.weight.detach().numpy(), request.scheme)
        lin.weight.data = torch.from_numpy(out[name].dequantize())
    if plan.experts is not None and plan.experts in quantized:
        routed: list[ExpertsResult] = []
        _experts(runner, plan.experts, layer_inputs(x), request, "rtn", out, {}, routed)
        routed[0].unrouted, routed[0].tokens = unscaled, tokens
        if experts_out is not None:
            experts_out.extend(routed)
    return out, details


def _awq_gptq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
                    quantized: set[str], request: CalibrationRequest,
                    on_stage: Callable[[str], None] | None
                    ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """AWQ then GPTQ (the recipe llm-compressor runs as an AWQ modifier before a GPTQ one):
    AWQ's scales searched and folded (`awq.awq_layer`, its clipping left to GPTQ, which
    chooses the integers and, with ``ranges="mse"``, the ranges itself), so the layer
    computes the same float function; then GPTQ on the scaled weights, its Hessians from
    the scaled layer's inputs (`gptq_layer`)."""
    if plan.experts is not None and plan.experts in quantized:
        raise CalibrationError("--calibrate awq,gptq does not calibrate a mixture-of-experts "
                               "layer's routed experts; calibrate this model with gptq or awq")
    report = awq_layer(runner, plan, x, request.scheme, replace(request.awq, clip=False),
                       quantized)
    out, losses = gptq_layer(runner, plan, x, quantized, request, on_stage)
    return out, {**{f"ratio:{k}": v for k, v in report.ratios.items()}, **losses}


def _awq_gptaq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
                     quantized: set[str], request: CalibrationRequest,
                     on_stage: Callable[[str], None] | None, targets: torch.Tensor | LayerInputs
                     ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """AWQ then GPTAQ: AWQ's scales searched on the layer's (quantized model's) inputs and
    folded, its clipping left to GPTAQ, as `_awq_gptq_layer`; the folded layer computes the
    same float function, so its float twin (`_gptaq_layer`) is the float layer; then GPTAQ
    on the scaled weights, matched to that float layer on the float model's hidden states
    `targets`."""
    if plan.experts is not None and plan.experts in quantized:
        raise CalibrationError("--calibrate awq,gptaq does not calibrate a mixture-of-experts "
                               "layer's routed experts; calibrate this model with gptq or awq")
    report = awq_layer(runner, plan, x, request.scheme, replace(request.awq, clip=False),
                       quantized)
    out, losses = _gptaq_layer(runner, plan, x, quantized, request, on_stage, targets)
    return out, {**{f"ratio:{k}": v for k, v in report.ratios.items()}, **losses}


def _float_twin(runner: LayerRunner, directory: str | None = None) -> LayerRunner:
    """A runner of a copy of `runner`'s layer as it is now (its float weights); its linears
    whose float32 weights are bfloat16 values (a bf16 checkpoint's) held as bfloat16, the
    others (AWQ's folded weights: awq,gptaq) in a scratch file in `directory`
    (`HeldOutOfMemory`)."""
    twin = copy.copy(runner)
    twin.block = copy.deepcopy(runner.block)
    twin.layer = twin.block.layer
    HeldOutOfMemory(twin.layer, directory)
    return twin


class HeldOutOfMemory:
    """The float32 weights of a layer's linears held outside the process between runs: those
    that are bfloat16 values as bfloat16 (half the memory: 0.47 GB instead of 0.93 at
    Qwen2.5-7B's widths), the others written to a scratch file (`activations.Spill`, one a
    width: no memory; AWQ's folded weights are no bfloat16 values); each made float32 again
    (exactly: the same values) just before its linear runs and dropped after it ran. The
    layer keeps the hooks for its life (GPTAQ's float twin, used and then dropped, its
    scratch files with it)."""

    def __init__(self, layer: torch.nn.Module, directory: str | None = None) -> None:
        self.spills: dict[int, Spill] = {}
        for module in layer.modules():
            if not isinstance(module, torch.nn.Linear) or module.weight.dtype != torch.float32:
                continue
            weight = module.weight.data
            half = weight.to(torch.bfloat16)
            load: Callable[[], torch.Tensor]
            if torch.equal(half.float(), weight):
                load = half.float
            else:
                del half
                width = weight.shape[1]
                spill = self.spills.get(width)
                if spill is None:
                    spill = self.spills[width] = Spill(width, directory)
                load = functools.partial(spill.read, len(spill))
                spill.append(weight)

            def made(m: torch.nn.Module, _args: tuple,
                     load: Callable[[], torch.Tensor] = load) -> None:
                m.weight.data = load()

            def dropped(m: torch.nn.Module, _args: tuple, _out: Any) -> None:
                m.weight.data = _NO_WEIGHTS

            module.weight.data = _NO_WEIGHTS
            del weight
            module.register_forward_pre_hook(made)
            module.register_forward_hook(dropped)


#: a GPTAQ stage whose Hessian and dXX^T take more than this together (two K x K matrices in
#: the Hessian's dtype) is calibrated holding one K x K matrix (`_gptaq_stage_in_one`)
GPTAQ_TWO_MATRICES_BYTES = 1 << 29
#: bytes of dXX^T's rows summed per pass over the stage's spilled inputs
#: (`_gptaq_stage_in_one`)
GPTAQ_CROSS_ROWS_BYTES = 1 << 26


def _gptaq_stage(runner: LayerRunner, float_runner: LayerRunner, first: str, x: LayerInputs,
                 xf: LayerInputs, request: CalibrationRequest
                 ) -> tuple[PreparedHessian, np.ndarray | AsymmetryInFactor]:
    """A stage's prepared Hessian of the quantized inputs and GPTAQ's P (`gptq` module doc):
    each batch's inputs of `first` taken twice, from the float layer on the float model's
    hidden states `xf` and from the layer as quantized so far on `x`. The Hessian is
    prepared in its own memory (as `_prepared_stage`: where the damping is too small it is
    made again, from the quantized inputs alone, and the damping raised tenfold) and P made
    in dXX^T's (`gptq.asymmetry_term`): two K x K matrices at most. Where those two take
    more than `GPTAQ_TWO_MATRICES_BYTES` (Qwen2.5-7B's down_proj: 2.7 GiB),
    `_gptaq_stage_in_one`."""
    k = _linear_weight(runner.layer, first).in_features
    itemsize = 8 if request.gptq_dtype == "float64" else 4
    if k * k * (itemsize + 4) > GPTAQ_TWO_MATRICES_BYTES:
        return _gptaq_stage_in_one(runner, float_runner, first, x, xf, request)
    cross = AsymmetryAccumulator(k)

    def inputs(run: LayerRunner, xb: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        run.see_inputs(_linear_weight(run.layer, first), layer_inputs(xb),
                       lambda _m, args: seen.append(args[0]))
        return seen[0]

    def summed() -> HessianAccumulator:  # H's and dXX^T's sums in one pass
        acc = HessianAccumulator(k, request.gptq_dtype)
        for b in runner.batches(x.shape[0]):
            xq = inputs(runner, x.read(b))
            acc.add(xq)
            cross.add(inputs(float_runner, xf.read(b)), xq)
            del xq
        return acc

    prepared, _ = _damped(first, request, lambda: _stage_hessian(
        runner, _linear_weight(runner.layer, first), x, request.gptq_dtype), summed())
    return prepared, asymmetry_term(cross.cross(), prepared)


def _cross_rows(xs: Spill, ds: Spill, prepared: PreparedHessian, r0: int, r1: int,
                rows: int) -> np.ndarray:
    """Rows r0:r1 of ``dXX^T`` in GPTQ's order (rows and columns permuted, dead columns
    zeroed, in the factor's dtype), summed over the spilled batches of quantized inputs
    `xs` and float-less-quantized differences `ds` as `AsymmetryAccumulator` sums them (the
    same products of the same batches, its rows only), scaled by 2 / `rows`."""
    k = prepared.upper.shape[0]
    idx = torch.from_numpy(np.ascontiguousarray(prepared.perm[r0:r1]))
    part = torch.zeros(r1 - r0, k, dtype=torch.float32)
    for i in range(len(xs)):
        d = ds.read(i)[:, idx]  # this batch's differences in these rows' channels alone
        part.addmm_(d.T, xs.read(i))
        del d
    part.mul_(2.0 / rows)
    out = part.numpy()
    if out.dtype != prepared.upper.dtype:
        out = out.astype(prepared.upper.dtype)
    permute_columns(out, prepared.perm)
    out[:, prepared.dead[prepared.perm]] = 0.0
    return out


def _gptaq_stage_in_one(runner: LayerRunner, float_runner: LayerRunner, first: str,
                        x: LayerInputs, xf: LayerInputs, request: CalibrationRequest
                        ) -> tuple[PreparedHessian, AsymmetryInFactor]:
    """`_gptaq_stage` holding one K x K matrix: the stage's inputs spilled to scratch files
    beside the calibration's hidden states (`activations.Spill`: the quantized inputs
    ``X`` and the differences ``X_float - X``, batch by batch: 2 x tokens x K x 4 bytes of
    disk, 0.6 GB for 8 x 512 tokens at Qwen2.5-7B's down_proj, 9.9 GB for 128 x 512), each
    layer's forward run once; the Hessian summed from the spilled ``X`` (the same sums),
    prepared in its own memory, then P made a run of rows at a time into the factor's lower
    triangle (`gptq.asymmetry_rows`), each run's rows of ``dXX^T`` summed from the spilled
    batches (`_cross_rows`: the same products; one read of the spills per run of
    `GPTAQ_CROSS_ROWS_BYTES`)."""
    linear = _linear_weight(runner.layer, first)
    k = linear.in_features
    directory = x.directory if isinstance(x, Activations) else None
    with Spill(k, directory) as xs, Spill(k, directory) as ds:
        runner.see_inputs(linear, x, lambda _m, args: xs.append(
            args[0].detach().reshape(-1, k).to(torch.float32)))

        def difference(_m: torch.nn.Module, args: tuple) -> None:
            xq = xs.read(len(ds))
            ds.append(args[0].detach().reshape(-1, k).to(torch.float32) - xq)

        float_runner.see_inputs(_linear_weight(float_runner.layer, first), xf, difference)
        if len(ds) != len(xs):
            raise CalibrationError(f"{first}: the float layer ran {len(ds)} batches, the "
                                   f"quantized one {len(xs)}")

        def hessian() -> HessianAccumulator:
            acc = HessianAccumulator(k, request.gptq_dtype)
            for i in range(len(xs)):
                acc.add(xs.read(i))
            return acc

        prepared, rows = _damped(first, request, hessian)
        step = max(1, GPTAQ_CROSS_ROWS_BYTES // (k * prepared.upper.itemsize))
        for r0 in range(0, k, step):
            r1 = min(r0 + step, k)
            asymmetry_rows(_cross_rows(xs, ds, prepared, r0, r1, rows), r0, prepared)
    return prepared, AsymmetryInFactor()


@torch.no_grad()
def _gptaq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
                 quantized: set[str], request: CalibrationRequest,
                 on_stage: Callable[[str], None] | None, targets: torch.Tensor | LayerInputs
                 ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """GPTAQ (`gptq` module doc) stage by stage as `gptq_layer`: each stage's linears on
    the inputs of the layer as quantized so far (held as integers until they run, as
    `gptq_layer`'s), matched to the float layer's on the float model's hidden states
    `targets` (this layer's float inputs), which are then advanced through the float layer
    (a copy of it made first, `_float_twin`: at most one more layer in memory, as bfloat16)."""
    if plan.experts is not None and plan.experts in quantized:
        raise CalibrationError("--calibrate gptaq does not calibrate a mixture-of-experts "
                               "layer's routed experts; calibrate this model with gptq or awq")
    x, xf = layer_inputs(x), layer_inputs(targets)
    float_runner = _float_twin(runner, x.directory if isinstance(x, Activations) else None)
    integers = IntegersUntilRun(runner.layer)
    try:
        out, losses = _quantize_stages(
            runner, plan, quantized, request, on_stage, integers,
            lambda first: _gptaq_stage(runner, float_runner, first, x, xf, request))
        integers.restore()
    finally:
        integers.unhook()
    layer_outputs(float_runner, xf, "the float layer")
    return out, losses


def _signround_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor | LayerInputs,
                     quantized: set[str], request: CalibrationRequest,
                     on_stage: Callable[[str], None] | None,
                     targets: torch.Tensor | LayerInputs | None, index: int
                     ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    if plan.experts is not None and plan.experts in quantized:
        raise CalibrationError("--calibrate signround does not tune a mixture-of-experts "
                               "layer's routed experts; calibrate this model with gptq or awq")
    x = layer_inputs(x)
    if targets is None:
        targets = InMemory(torch.empty(x.shape))
        for b in runner.batches(x.shape[0]):
            targets.write(b, runner.forward(x.read(b)))
    options = request.signround
    every = max(1, options.iterations // 20)

    def step(i: int) -> None:
        if on_stage is not None and ((i + 1) % every == 0 or i + 1 == options.iterations):
            on_stage(f"tuning step {i + 1}/{options.iterations}")

    res = tune_layer(runner, x, targets, sorted(quantized), request.scheme, options,
                     seed=index, on_iteration=step)
    return res.weights, {"loss:rtn": res.initial_loss, "loss:best": res.best_loss,
                         "best_iteration": float(res.best_iteration)}


@torch.no_grad()
def layer_outputs(runner: LayerRunner, x: torch.Tensor | LayerInputs, where: str = "the layer"
                  ) -> None:
    """The layer's outputs written over its inputs `x`, batch by batch (a sequence's output
    depends on that sequence alone); outputs that are not finite are refused."""
    x = layer_inputs(x)
    for b in runner.batches(x.shape[0]):
        y = runner.forward(x.read(b))
        if not bool(torch.isfinite(y).all()):
            raise CalibrationError(f"{where}'s outputs are not finite after calibration")
        x.write(b, y)


def layer_tensors(layer: torch.nn.Module, prefix: str, results: dict[str, QuantizedWeights],
                  fmt: str) -> dict[str, np.ndarray]:
    """The checkpoint tensors of a calibrated layer: its quantized linears in the GPTQ layout,
    every other parameter in float32 (module doc of `export`)."""
    tensors: dict[str, np.ndarray] = {}
    # a MoE layer's routed experts quantized: one linear per expert (no bias), in place
    # of the fused parameters
    fused = EXPERTS if fused_experts(layer) is not None and any(
        r.startswith(EXPERTS + ".") for r in results) else None
    for name, qw in results.items():
        if fused is not None and name.startswith(fused + "."):
            bias = None
        else:
            lin = _linear_weight(layer, name)
            bias = None if lin.bias is None else lin.bias.detach().numpy()
        tensors.update(gptq_tensors(prefix + name, qw, bias, fmt))
    for pname, p in layer.named_parameters():
        module = pname.rsplit(".", 1)[0]
        if module in results or module == fused:
            continue
        tensors[prefix + pname] = p.detach().numpy().astype(np.float32)
    return tensors


def _format_time(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LayerProgress:
    """Layers done and time left on `stream` (None: quiet): on a terminal one live line,
    updated as each layer (and each GPTQ stage within it) goes; otherwise one line per
    layer."""

    def __init__(self, stream: IO[str] | None, method: str, layers: int) -> None:
        self.stream, self.method, self.layers = stream, method, layers
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.seconds: list[float] = []
        self.started = time.perf_counter()

    def _left(self, done: int) -> str:
        if not self.seconds:
            return "time left: after the first layer"
        mean = sum(self.seconds) / len(self.seconds)
        return f"about {_format_time(mean * (self.layers - done))} left"

    def stage(self, layer: int, what: str) -> None:
        if self.tty and self.stream is not None:
            self.stream.write(f"\r\x1b[2Kcalibrate ({self.method}): layer {layer + 1}/"
                              f"{self.layers} {what}, {self._left(layer)}")
            self.stream.flush()

    def layer_done(self, layer: int, seconds: float) -> None:
        self.seconds.append(seconds)
        if self.stream is None:
            return
        line = (f"calibrate ({self.method}): {layer + 1}/{self.layers} layers done (layer "
                f"{layer} in {seconds:.1f}s), {self._left(layer + 1)}")
        if self.tty:
            self.stream.write(f"\r\x1b[2K{line}")
            if layer + 1 == self.layers:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(f"calibrate: {text}\n")
            self.stream.flush()


def _source_files(model: Any, tokenizer: Any, dequantize: str | None
                  ) -> tuple[LayerSource, dict[str, bytes]]:
    """The layers of `model` and the files the checkpoint carries besides weights (tokenizer,
    generation config)."""
    if not isinstance(model, str | os.PathLike | LoadedModel):
        loaded = load_model(model, tokenizer)
        return ModelLayers(loaded.model), dict(loaded.tokenizer_files)
    source = open_layers(model, dequantize)
    assert isinstance(source, StreamedLayers)
    files = dict(source.loaded.tokenizer_files)
    where = source.loaded.source
    gen = dir_bytes(where, "generation_config.json") if os.path.isdir(where) else None
    if gen is not None:
        files["generation_config.json"] = gen
    return source, files


def _shared_names(source: LayerSource) -> list[str]:
    """The checkpoint tensors outside the decoder layers."""
    if isinstance(source, StreamedLayers):
        return sorted(n for n in source.loaded.stream.reader.tensors
                      if not n.startswith("model.layers."))
    assert isinstance(source, ModelLayers)
    model = source.model
    names = [n for n, _ in model.named_parameters() if not n.startswith("model.layers.")]
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in names:
        names.remove("lm_head.weight")
    return sorted(names)


def _shared_tensor(source: LayerSource, name: str) -> np.ndarray:
    """A tensor outside the decoder layers, as the source stores it (a streamed one is read
    when its shard is written)."""
    if isinstance(source, StreamedLayers):
        return source.loaded.stream.reader.tensor(name)
    assert isinstance(source, ModelLayers)
    return source.model.get_parameter(name).detach().numpy().astype(np.float32)


def _release_shared(source: LayerSource) -> None:
    if isinstance(source, StreamedLayers):
        source.loaded.stream.reader.release()


def calibrate(model: Any, output: str, request: CalibrationRequest,
              data: CalibrationData | Sequence[str], *,
              sequences: int = DEFAULT_SEQUENCES,
              sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
              tokenizer: Any = None,
              progress: IO[str] | None = sys.stderr,
              on_layer: Callable[[int, dict[str, QuantizedWeights]], None] | None = None,
              dequantize: str | None = "f32"
              ) -> CalibrationReport:
    """Calibrate `model` (a float checkpoint directory or GGUF file, streamed; or a
    transformers causal LM in memory with its `tokenizer`) on `data` (text files, tokenized
    with the model's tokenizer into `sequences` x `sequence_length`, or a `CalibrationData`)
    and write the calibrated checkpoint directory `output` (`export`). Progress (layers
    done, time left: `LayerProgress`) goes to `progress`; `on_layer(index, quantized
    linears)` is called as each layer is done. A GGUF file's quantized tensors are
    dequantized unless `dequantize` is None (then such a file is refused). The layers'
    hidden states live in a scratch file beside `output` (`activations`), removed however
    the calibration ends."""
    t0 = time.perf_counter()
    source, files = _source_files(model, tokenizer, dequantize)
    if not isinstance(data, CalibrationData):
        if "tokenizer.json" not in files:
            raise CalibrationError("the model has no tokenizer.json to tokenize the calibration "
                                   "text with")
        data = calibration_data(list(data), tokenizer_encoder(files["tokenizer.json"]),
                                sequences, sequence_length)
    n_layers = source.num_layers
    bar = LayerProgress(progress, request.method, n_layers)
    if data.note:
        bar.note(data.note)
    shared = _shared_names(source)
    writer = CheckpointWriter(output, n_layers + len(shared))
    scheme = request.scheme
    report = CalibrationReport(output, request.method, n_layers, data.sequences,
                               data.sequence_length, 0.0, [], 0, [], data.note)
    hidden = int(source.config.hidden_size)
    n, length = data.sequences, data.sequence_length
    try:
        with contextlib.ExitStack() as scratch:
            x = scratch.enter_context(Activations(n, length, hidden, writer.directory))
            # SignRound's targets, GPTAQ's float inputs: the float model's own hidden states
            xf = scratch.enter_context(Activations(n, length, hidden, writer.directory)) \
                if request.method in FLOAT_STATES else None
            step = max(1, request.batch_tokens // length)
            for s0 in range(0, n, step):
                rows = slice(s0, min(s0 + step, n))
                embedded = source.embed(data.tokens[rows])
                x.write(rows, embedded)
                if xf is not None:
                    xf.write(rows, embedded)
            for i in range(n_layers):
                t = time.perf_counter()
                bar.stage(i, "loading")
                layer = source.layer(i)
                kind = source.layer_type(i)
                plan = layer_plan(layer, kind, f"layer {i}")
                runner = LayerRunner(layer, source.rotary, kind, length, request.batch_tokens,
                                     request.batch_bytes)
                quantized = set()
                for name in plan.linears:
                    lin = _linear_weight(layer, name)
                    if scheme.fits(lin.out_features, lin.in_features):
                        quantized.add(name)
                    else:
                        report.float_linears.append(f"model.layers.{i}.{name}")
                if plan.experts is not None:
                    experts = layer.get_submodule(plan.experts)
                    if not experts_fit(experts, scheme):
                        raise CalibrationError(
                            f"layer {i}: its experts ({expert_shapes(experts)[1]} x "
                            f"{expert_shapes(experts)[2]}) "
                            f"do not fit {scheme.bits}-bit groups of {scheme.group_size}; "
                            "choose a group size that divides the expert widths")
                    quantized.add(plan.experts)
                if xf is not None and request.method == "signround":
                    bar.stage(i, "running the float layer")
                    layer_outputs(runner, xf, f"the float layer {i}")
                bar.stage(i, "searching scales" if request.method.startswith("awq") else "")
                routed: list[ExpertsResult] = []
                results, details = calibrate_layer(
                    runner, plan, x, quantized, request,
                    on_stage=functools.partial(bar.stage, i), experts_out=routed,
                    targets=xf, index=i)
                for res in routed:
                    if res.unrouted and request.method in ("gptq", "awq"):
                        names = [f"model.layers.{i}.{plan.experts}.{e}" for e in res.unrouted]
                        report.rtn_experts += names
                        what = ("calibration token", "rounded to nearest, not calibrated") \
                            if request.method == "gptq" else \
                            ("search token", "rounded to nearest, not calibrated (gate/up "
                             "under the layer's shared scale, down unscaled, none clipped)")
                        bar.note(f"layer {i}: {len(res.unrouted)} of {len(res.tokens)} experts "
                                 f"chosen by no {what[0]} (experts "
                                 f"{', '.join(map(str, res.unrouted))}): {what[1]}")
                bar.stage(i, "running the quantized layer")
                layer_outputs(runner, x, f"layer {i}")
                writer.write_shard(layer_tensors(layer, f"model.layers.{i}.", results,
                                                 request.export_format))
                report.quantized_linears += len(results)
                if on_layer is not None:
                    on_layer(i, results)
                report.details.append(details)
                source.release(i)
                del layer, runner, results
                return_free_memory()  # what the layer's work left free in the heap
                report.layer_seconds.append(time.perf_counter() - t)
                bar.layer_done(i, report.layer_seconds[-1])
        for name in shared:
            writer.write_shard({name: _shared_tensor(source, name)})
            _release_shared(source)
        config = source.config.to_dict()
        config.pop("quantization_config", None)
        config["quantization_config"] = quantization_config(
            scheme, request.export_format, request.method,
            request.act_order and request.method in GPTQ_METHODS, report.float_linears,
            {"sequences": data.sequences, "sequence_length": data.sequence_length,
             **({"ranges": request.ranges} if request.method in GPTQ_METHODS else {}),
             **({"rtn_experts": report.rtn_experts} if report.rtn_experts else {}),
             **({"iterations": request.signround.iterations,
                 "batch_size": request.signround.batch_size}
                if request.method == "signround" else {})})
        writer.finish(config, files)
    except BaseException:
        writer.abort()
        raise
    report.seconds = time.perf_counter() - t0
    bar.note(f"wrote {output} ({n_layers} layers, {report.quantized_linears} linears "
             f"quantized by {request.method}) in {_format_time(report.seconds)}")
    return report
