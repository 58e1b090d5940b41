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

Memory: one float32 layer, the layer inputs and outputs of the calibration set (2 x
sequences x length x hidden x 4 bytes), one forward's activations of a batch
(`batch_tokens`), and per method: GPTQ one Hessian at a time (K x K float64, K the widest
input: the MLP's intermediate size for down_proj) and its factor; AWQ the inputs of each
of the layer's linears for the search tokens (`AwqOptions.search_tokens` x (3 hidden +
intermediate) x 4 bytes). The checkpoint outside the layer is never read whole: the
embedding rows of the calibration tokens only (a streamed source).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch

from toptpu.dialects.common import DEFAULT_GROUP_SIZE
from toptpu.frontends.hf_loader import LoadedModel, dir_bytes, load_model
from toptpu.passes.convert_top_to_tpu import parse_mode
from toptpu.weight_calibration.awq import AwqOptions, awq_layer
from toptpu.weight_calibration.data import (
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_SEQUENCES,
    CalibrationData,
    calibration_data,
    tokenizer_encoder,
)
from toptpu.weight_calibration.export import (
    EXPORT_FORMATS,
    CheckpointWriter,
    gptq_tensors,
    quantization_config,
)
from toptpu.weight_calibration.gptq import HessianAccumulator, gptq, prepare_hessian
from toptpu.weight_calibration.grid import CalibrationError, QuantizedWeights, QuantScheme, rtn
from toptpu.weight_calibration.layers import (
    LayerPlan,
    LayerRunner,
    LayerSource,
    ModelLayers,
    StreamedLayers,
    layer_plan,
    open_layers,
)

METHODS = ("gptq", "awq", "rtn")


@dataclass(frozen=True)
class CalibrationRequest:
    """What to calibrate and how. `method`: gptq | awq | rtn (the same grid and export,
    round to nearest: the baseline). GPTQ: `act_order` (static groups), `percdamp`,
    `block_size`; AWQ: `awq`. `export_format`: gptq | auto_round (`export`)."""

    method: str = "gptq"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    act_order: bool = True
    percdamp: float = 0.01
    block_size: int = 128
    awq: AwqOptions = field(default_factory=AwqOptions)
    export_format: str = "auto_round"
    #: tokens a forward batch holds (whole sequences)
    batch_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CalibrationError(f"calibration method '{self.method}': one of "
                                   f"{', '.join(METHODS)}")
        if self.export_format not in EXPORT_FORMATS:
            raise CalibrationError(f"export format '{self.export_format}': one of "
                                   f"{', '.join(EXPORT_FORMATS)}")
        if not 0 < self.percdamp <= 1:
            raise CalibrationError(f"damping {self.percdamp}: a fraction in (0, 1]")


def request_for_mode(method: str, mode: str, group_size: int | None = None,
                     symmetric: bool | None = None) -> CalibrationRequest:
    """The request `toptpu compile -q MODE [--group-size G] [--symmetric] --calibrate METHOD`
    implies: MODE's weight bits, the group size (default the compiler's, 64; -1 per channel),
    asymmetric unless symmetric, exported in the `auto_round` format (`export`)."""
    try:
        bits = parse_mode(mode)[1]
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    if bits is None:
        raise CalibrationError(f"--calibrate quantizes weights: -q {mode} keeps them float; "
                               "choose a w4 or w8 mode")
    scheme = QuantScheme(bits, DEFAULT_GROUP_SIZE if group_size is None else group_size,
                         bool(symmetric))
    return CalibrationRequest(method, scheme)


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


class _StageSeen(Exception):
    """Stops a forward once the input of a GPTQ stage has been seen."""


def _linear_weight(layer: torch.nn.Module, name: str) -> torch.nn.Linear:
    m = layer.get_submodule(name)
    assert isinstance(m, torch.nn.Linear)
    return m


@torch.no_grad()
def gptq_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor, quantized: set[str],
               request: CalibrationRequest) -> tuple[dict[str, QuantizedWeights],
                                                     dict[str, float]]:
    """GPTQ of the layer's `quantized` linears, stage by stage (module doc); each linear's
    weight is replaced by its dequantized integers as soon as it is quantized."""
    out: dict[str, QuantizedWeights] = {}
    losses: dict[str, float] = {}
    for stage in plan.stages:
        names = [n for n in stage if n in quantized]
        if not names:
            continue
        first = _linear_weight(runner.layer, stage[0])
        acc = HessianAccumulator(first.in_features)

        def hook(_m: torch.nn.Module, args: tuple, acc: HessianAccumulator = acc) -> None:
            acc.add(args[0])
            raise _StageSeen

        handle = first.register_forward_pre_hook(hook)
        try:
            for b in runner.batches(x.shape[0]):
                try:
                    runner.forward(x[b])
                except _StageSeen:
                    pass
        finally:
            handle.remove()
        prepared = prepare_hessian(acc.hessian(), act_order=request.act_order,
                                   percdamp=request.percdamp)
        for name in names:
            lin = _linear_weight(runner.layer, name)
            res = gptq(lin.weight.detach().numpy(), prepared, request.scheme,
                       act_order=request.act_order, block_size=request.block_size)
            out[name] = res.weights
            losses[name] = res.loss
            lin.weight.data = torch.from_numpy(res.weights.dequantize())
    return out, losses


def calibrate_layer(runner: LayerRunner, plan: LayerPlan, x: torch.Tensor,
                    quantized: set[str], request: CalibrationRequest
                    ) -> tuple[dict[str, QuantizedWeights], dict[str, float]]:
    """The layer's `quantized` linears by the request's method; afterwards the layer holds
    their dequantized weights (and AWQ's folded scales)."""
    if request.method == "gptq":
        return gptq_layer(runner, plan, x, quantized, request)
    details: dict[str, float] = {}
    if request.method == "awq":
        report = awq_layer(runner, plan, x, request.scheme, request.awq, quantized)
        details = {f"ratio:{k}": v for k, v in report.ratios.items()}
    out = {}
    for name in sorted(quantized):
        lin = _linear_weight(runner.layer, name)
        out[name] = rtn(lin.weight.detach().numpy(), request.scheme)
        lin.weight.data = torch.from_numpy(out[name].dequantize())
    return out, details


@torch.no_grad()
def layer_outputs(runner: LayerRunner, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for b in runner.batches(x.shape[0]):
        out[b] = runner.forward(x[b])
    return out


def layer_tensors(layer: torch.nn.Module, prefix: str, results: dict[str, QuantizedWeights],
                  fmt: str) -> dict[str, np.ndarray]:
    """The checkpoint tensors of a calibrated layer: its quantized linears in the GPTQ layout,
    every other parameter in float32 (module doc of `export`)."""
    tensors: dict[str, np.ndarray] = {}
    for name, qw in results.items():
        lin = _linear_weight(layer, name)
        bias = None if lin.bias is None else lin.bias.detach().numpy()
        tensors.update(gptq_tensors(prefix + name, qw, bias, fmt))
    for pname, p in layer.named_parameters():
        module = pname.rsplit(".", 1)[0]
        if module in results:
            continue
        tensors[prefix + pname] = p.detach().numpy().astype(np.float32)
    return tensors


def _format_time(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _source_files(model: Any, tokenizer: Any) -> tuple[LayerSource, dict[str, bytes]]:
    """The layers of `model` and the files the checkpoint carries besides weights (tokenizer,
    generation config)."""
    if not isinstance(model, str | os.PathLike | LoadedModel):
        loaded = load_model(model, tokenizer)
        return ModelLayers(loaded.model), dict(loaded.tokenizer_files)
    source = open_layers(model)
    assert isinstance(source, StreamedLayers)
    files = dict(source.loaded.tokenizer_files)
    where = source.loaded.source
    gen = dir_bytes(where, "generation_config.json") if os.path.isdir(where) else None
    if gen is not None:
        files["generation_config.json"] = gen
    return source, files


def _shared_tensors(source: LayerSource) -> dict[str, np.ndarray]:
    """The tensors outside the decoder layers, as the source stores them."""
    if isinstance(source, StreamedLayers):
        reader = source.loaded.stream.reader
        out = {name: np.array(reader.tensor(name)) for name in reader.tensors
               if not name.startswith("model.layers.")}
        reader.release()
        return out
    assert isinstance(source, ModelLayers)
    model = source.model
    state = {n: p.detach().numpy().astype(np.float32) for n, p in model.named_parameters()
             if not n.startswith("model.layers.")}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def calibrate(model: Any, output: str, request: CalibrationRequest,
              data: CalibrationData | Sequence[str], *,
              sequences: int = DEFAULT_SEQUENCES,
              sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
              tokenizer: Any = None,
              progress: IO[str] | None = sys.stderr,
              on_layer: Callable[[int, dict[str, QuantizedWeights]], None] | None = None
              ) -> CalibrationReport:
    """Calibrate `model` (a float checkpoint directory or GGUF file, streamed; or a
    transformers causal LM in memory with its `tokenizer`) on `data` (text files, tokenized
    with the model's tokenizer into `sequences` x `sequence_length`, or a `CalibrationData`)
    and write the calibrated checkpoint directory `output` (`export`). Progress (layers
    done, time left) goes to `progress`; `on_layer(index, quantized linears)` is called as
    each layer is done."""
    t0 = time.perf_counter()
    source, files = _source_files(model, tokenizer)
    if not isinstance(data, CalibrationData):
        if "tokenizer.json" not in files:
            raise CalibrationError("the model has no tokenizer.json to tokenize the calibration "
                                   "text with")
        data = calibration_data(list(data), tokenizer_encoder(files["tokenizer.json"]),
                                sequences, sequence_length)
    if progress is not None and data.note:
        progress.write(f"calibrate: {data.note}\n")
    n_layers = source.num_layers
    writer = CheckpointWriter(output, n_layers + 1)
    scheme = request.scheme
    report = CalibrationReport(output, request.method, n_layers, data.sequences,
                               data.sequence_length, 0.0, [], 0, [], data.note)
    try:
        x = source.embed(data.tokens)
        for i in range(n_layers):
            t = time.perf_counter()
            layer = source.layer(i)
            kind = source.layer_type(i)
            plan = layer_plan(layer, kind, f"layer {i}")
            runner = LayerRunner(layer, source.rotary, kind, data.sequence_length,
                                 request.batch_tokens)
            quantized = set()
            for name in plan.linears:
                lin = _linear_weight(layer, name)
                if scheme.fits(lin.out_features, lin.in_features):
                    quantized.add(name)
                else:
                    report.float_linears.append(f"model.layers.{i}.{name}")
            results, details = calibrate_layer(runner, plan, x, quantized, request)
            x = layer_outputs(runner, x)
            if not torch.isfinite(x).all():
                raise CalibrationError(f"layer {i}'s outputs are not finite after calibration")
            writer.write_shard(layer_tensors(layer, f"model.layers.{i}.", results,
                                             request.export_format))
            report.quantized_linears += len(results)
            if on_layer is not None:
                on_layer(i, results)
            report.details.append(details)
            source.release(i)
            del layer, runner
            report.layer_seconds.append(time.perf_counter() - t)
            if progress is not None:
                mean = sum(report.layer_seconds) / len(report.layer_seconds)
                progress.write(f"calibrate ({request.method}): layer {i + 1}/{n_layers} done in "
                               f"{report.layer_seconds[-1]:.1f}s, about "
                               f"{_format_time(mean * (n_layers - i - 1))} left\n")
                progress.flush()
        writer.write_shard(_shared_tensors(source))
        config = source.config.to_dict()
        config.pop("quantization_config", None)
        config["quantization_config"] = quantization_config(
            scheme, request.export_format, request.method,
            request.act_order and request.method == "gptq", report.float_linears,
            {"sequences": data.sequences, "sequence_length": data.sequence_length})
        writer.finish(config, files)
    except BaseException:
        writer.abort()
        raise
    report.seconds = time.perf_counter() - t0
    if progress is not None:
        progress.write(f"calibrate ({request.method}): wrote {output} ({n_layers} layers, "
                       f"{report.quantized_linears} linears quantized) in "
                       f"{_format_time(report.seconds)}\n")
    return report
