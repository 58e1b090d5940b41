"""The compile request: what a compile is asked to build, as one frozen, typed value.

A `CompileRequest` holds every choice of a compile as a value, never as text: the
quantization mode (`QuantMode`, `AUTO` for a pre-quantized checkpoint's own, or None: f32,
or a checkpoint's own), the chip (`Chip`), the static shapes (`StaticShapes`), the spread
over devices (`Parallel`), and the rest. `toptpu compile`, `toptpu.compile`,
`toptpu estimate` and `toptpu compare` build it, and every compile step takes it.

Each field says once how it is asked for (`asked`): the `Option`s that spell it — the
Python keyword (also argparse's dest) and the command-line flags with their argparse type,
default and help — and the `parse` that turns the asked values into the field's value,
refusing a bad one with one line (`CompileError`) naming the option and what to do. So:

- `CompileRequest.make(**keywords)` builds it from Python keywords (`toptpu.compile`'s);
- `add_request_args(parser)` adds the options to a command line, and
  `CompileRequest.from_args(args)` builds it from argparse's namespace: the same parse;
- `CompileRequest(...)` takes typed values directly (tests, estimates, sweeps).

In every case `__post_init__` checks what lies across fields (a group size the mode does
not use, `--parallel` with one device, more devices than the chip joins, `-q` against
`--dequantize`), once. The checks that need the model or the output paths are
`toptpu.compile_options.check_compile_request`'s.

A new option is one field here: e.g. `batch: int = asked(Option("batch", ("--batch",),
1, "...", type=int_at_least(1)), parse=_count("--batch"))` (the batch nets) reaches the
CLI, the Python API and every step that takes the request.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeAlias, TypeGuard

from toptpu.backend.contract import StaticShapes
from toptpu.backend.target.chips import DEFAULT_CHIP, Chip, chip_names, get_chip
from toptpu.cli_args import chunk_lengths, group_size, int_at_least, pixel_size
from toptpu.devices import Parallel
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.errors import CompileError
from toptpu.pass_pipeline import DEFAULT_TOP, DEFAULT_TPU, CompilePipeline, PipelineTextError
from toptpu.passes.convert_top_to_tpu import ConversionError, quant_mode


class AutoMode(StrEnum):
    """`-q auto`: a pre-quantized checkpoint's own bits, with its dtype's activations."""

    AUTO = "auto"


AUTO = AutoMode.AUTO
#: a mode as asked: a mode, auto, or None (f32, or a pre-quantized checkpoint's own)
AskedMode: TypeAlias = QuantMode | AutoMode | None


def weight_bits(mode: AskedMode) -> int | None:
    """The weight bits of a mode (None: a float mode, auto, or no mode)."""
    return mode.weight_bits if isinstance(mode, QuantMode) else None


def activation_mode(mode: QuantMode) -> QuantMode:
    """The float mode of `mode`'s activations (bf16 for w4bf16): a vision net's default."""
    return QuantMode(mode.activation)


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One asked value of a request as the Python API and the command line spell it:
    `keyword` (the Python keyword and argparse's dest), `flags`, the `default` (both ways:
    what "not given" means), argparse's `type` and `choices` (a bad value ends in
    argparse's one line, status 2), `action`, `nargs`, `metavar` and `help`, and the
    argparse `group` it is listed in."""

    keyword: str
    flags: tuple[str, ...]
    default: Any
    help: str
    type: Callable[[str], Any] | None = None
    action: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    group: str | None = None
    nargs: str | None = None

    def add_to(self, parser: argparse.ArgumentParser | Any) -> None:
        kw: dict[str, Any] = {"dest": self.keyword, "default": self.default, "help": self.help}
        if self.action is not None:
            kw["action"] = self.action
        if self.type is not None:
            kw["type"] = self.type
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        if self.choices is not None:
            kw["choices"] = self.choices
        if self.nargs is not None:
            kw["nargs"] = self.nargs
        parser.add_argument(*self.flags, **kw)


@dataclass(frozen=True)
class Asked:
    """How a request field is asked for: its options and the parse of their values into
    the field's value (one option: its value; several: keywords by option keyword)."""

    options: tuple[Option, ...]
    parse: Callable[..., Any]

    def value(self, given: Mapping[str, Any]) -> Any:
        values = {o.keyword: given.get(o.keyword, o.default) for o in self.options}
        if len(values) == 1:
            return self.parse(*values.values())
        return self.parse(**values)

    def default(self) -> Any:
        return self.value({})


def asked(*options: Option, parse: Callable[..., Any] = lambda value: value) -> Any:
    """A request field asked for by `options`, its value `parse(value)` of one option's
    value, `parse(**values)` of several's (default: the one value as it is); its default
    is the parse of the options' defaults."""
    how = Asked(tuple(options), parse)
    return field(default_factory=how.default, metadata={"asked": how})


def _asked(f: Field[Any]) -> Asked:
    return f.metadata["asked"]


# ----------------------------------------------------------------------------- parses


def _mode(mode: Any) -> AskedMode:
    """-q: a mode, auto, or None."""
    if mode is None or isinstance(mode, QuantMode | AutoMode):
        return mode
    if mode == AUTO:
        return AUTO
    try:
        return quant_mode(mode)
    except ConversionError as e:
        raise CompileError(f"{e}, or auto (a pre-quantized checkpoint's own)") from e


def _flag_mode(flag: str) -> Callable[[Any], QuantMode | None]:
    """A mode option other than -q (auto is not one): `flag: unknown ...`."""
    def parse(mode: Any) -> QuantMode | None:
        if mode is None or isinstance(mode, QuantMode):
            return mode
        try:
            return quant_mode(mode)
        except ConversionError as e:
            raise CompileError(f"{flag}: {e}") from e

    return parse


def _chip(chip: object) -> Chip:
    """--chip: a preset's name, or a `Chip` (an estimate's chip with figures changed)."""
    if isinstance(chip, Chip):
        return chip
    names = chip_names()
    if not isinstance(chip, str) or chip not in names:
        raise CompileError(f"unknown chip '{chip}'; choose one of {', '.join(names)}")
    return get_chip(chip)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(flag: str, lo: int = 1) -> Callable[[object], int | None]:
    """An integer >= lo, or None (not given)."""
    def parse(value: object) -> int | None:
        if value is None:
            return None
        if not _is_int(value) or value < lo:
            raise CompileError(f"{flag} must be an integer >= {lo}, not {value!r}")
        return value

    return parse


def _shapes(seq_length: Any, max_input_length: Any, max_history: Any,
            prefill_lengths: Any) -> StaticShapes:
    """--seq-length, --max-input-length, --max-history, --prefill-lengths (the checks of
    `StaticShapes.make`, whose messages name the options)."""
    _count("--seq-length", 2)(seq_length)
    _count("--max-input-length")(max_input_length)
    _count("--max-history")(max_history)
    if prefill_lengths is not None and (isinstance(prefill_lengths, str | bytes) or not all(
            _is_int(n) for n in prefill_lengths)):
        raise CompileError(f"--prefill-lengths must be integers, not {prefill_lengths!r}")
    try:
        return StaticShapes.make(seq_length, max_input_length, max_history, prefill_lengths)
    except ValueError as e:
        raise CompileError(str(e)) from e


def _group_size(value: object) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or (value != -1 and value <= 0):
        raise CompileError(f"--group-size must be positive or -1 (per channel), not {value!r}")
    return value


def _keep_float(value: object) -> str:
    """--keep-float: a (possibly empty) part of a weight's name."""
    if not isinstance(value, str):
        raise CompileError(f"--keep-float is a part of a weight's name, not {value!r}")
    return value


def _symmetric(value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise CompileError(f"--symmetric is true, false or not given, not {value!r}")
    return value


def _devices(value: object) -> int:
    if not _is_int(value) or value < 1:
        raise CompileError(f"--devices must be an integer >= 1, not {value!r}")
    return value


def _batch(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise CompileError(f"--batch must be an integer >= 1, not {value!r}")
    return value


def _parallel(value: Any) -> Parallel | None:
    if value is None or isinstance(value, Parallel):
        return value
    try:
        return Parallel(value)
    except ValueError:
        raise CompileError(f"--parallel must be tp, pp or ep, not {value!r}") from None


def _max_pixels(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != 2 \
            or any(not _is_int(v) or v < 1 for v in value):
        raise CompileError(f"--max-pixels {value}: give the width and height of the "
                           "pixel budget as two positive integers (W,H)")
    return int(value[0]), int(value[1])


def _path(flag: str) -> Callable[[object], str | None]:
    def parse(value: object) -> str | None:
        if value is not None and not isinstance(value, str):
            raise CompileError(f"{flag} is a path, not {value!r}")
        return value

    return parse


# ----------------------------------------------------------------------------- calibration

#: the methods `--calibrate` takes (`toptpu.weight_calibration`)
CALIBRATION_METHODS = ("gptq", "awq", "signround", "awq,gptq", "gptaq", "awq,gptaq")
#: the methods `--calibration-ranges` shapes (GPTQ's grids)
GPTQ_CALIBRATIONS = ("gptq", "awq,gptq", "gptaq", "awq,gptaq")
#: `--calibration-ranges`: each group's range as min/max, or GPTQ's MSE grid (gptq methods)
CALIBRATION_RANGES = ("minmax", "mse")
#: the calibration set by default: samples x tokens (as AutoGPTQ and AutoAWQ use)
DEFAULT_CALIBRATION_SAMPLES = 128
DEFAULT_CALIBRATION_SEQ_LENGTH = 512
#: what the calibration runs on without --calibration-data (`weight_calibration.data`)
DEFAULT_CALIBRATION_TEXT = "Python's own documentation (pydoc_data.topics, shipped with Python)"
CALIBRATION = "calibrated quantization (GPTQ / AWQ / SignRound at compile time)"


@dataclass(frozen=True)
class Calibration:
    """`--calibrate`: the method, the plain text files it runs on (none: the default text,
    `DEFAULT_CALIBRATION_TEXT`), the calibration set (`samples` x `sequence_length` tokens
    of that text), and where the calibrated checkpoint is kept (None: removed once the
    model file is written)."""

    method: str
    data: tuple[str, ...] = ()
    samples: int = DEFAULT_CALIBRATION_SAMPLES
    sequence_length: int = DEFAULT_CALIBRATION_SEQ_LENGTH
    save: str | None = None
    #: SignRound's tuning steps per layer (None: its default, 200)
    iterations: int | None = None
    #: GPTQ's range search per group (None: min/max; `CALIBRATION_RANGES`)
    ranges: str | None = None


def _calibration(calibrate: Any, calibration_data: Any, calibration_samples: Any,
                 calibration_seq_length: Any, save_calibrated: Any,
                 calibration_iterations: Any, calibration_ranges: Any = None
                 ) -> Calibration | None:
    """--calibrate, --calibration-data, --calibration-samples, --calibration-seq-length,
    --save-calibrated, --calibration-iterations, --calibration-ranges."""
    if calibrate is None:
        given = [flag for flag, v in (("--calibration-data", calibration_data),
                                      ("--calibration-samples", calibration_samples),
                                      ("--calibration-seq-length", calibration_seq_length),
                                      ("--save-calibrated", save_calibrated),
                                      ("--calibration-iterations", calibration_iterations),
                                      ("--calibration-ranges", calibration_ranges))
                 if v is not None]
        if given:
            raise CompileError(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} "
                               "the calibration of --calibrate; give --calibrate "
                               f"{'|'.join(CALIBRATION_METHODS)} or drop {' and '.join(given)}")
        return None
    if isinstance(calibrate, str) and "," in calibrate and calibrate not in CALIBRATION_METHODS:
        raise CompileError(f"--calibrate {calibrate}: the combinations are awq,gptq and "
                           "awq,gptaq (AWQ's scales folded, then GPTQ or GPTAQ on the scaled "
                           "weights)")
    if calibrate not in CALIBRATION_METHODS:
        raise CompileError(f"--calibrate must be {' or '.join(CALIBRATION_METHODS)}, not "
                           f"{calibrate!r}")
    if calibration_ranges is not None and calibration_ranges not in CALIBRATION_RANGES:
        raise CompileError(f"--calibration-ranges must be {' or '.join(CALIBRATION_RANGES)}, "
                           f"not {calibration_ranges!r}")
    if calibration_ranges not in (None, "minmax") and calibrate not in GPTQ_CALIBRATIONS:
        raise CompileError(f"--calibration-ranges {calibration_ranges}: GPTQ's range search; "
                           f"--calibrate {calibrate} finds its ranges its own way (drop it or "
                           f"use --calibrate {', '.join(GPTQ_CALIBRATIONS)})")
    files: Any = () if calibration_data is None else calibration_data
    if isinstance(files, str | os.PathLike):
        files = [files]
    if isinstance(files, bytes) or not isinstance(files, Sequence) or not all(
            isinstance(f, str | os.PathLike) and isinstance(os.fspath(f), str) for f in files):
        raise CompileError(f"--calibration-data is text file paths, not {calibration_data!r}")
    if calibration_data is not None and not files:
        raise CompileError("--calibration-data names no file; give one or more plain text "
                           "files (or drop it to calibrate on the default text)")
    iterations = _count("--calibration-iterations")(calibration_iterations)
    if iterations is not None and calibrate != "signround":
        raise CompileError(f"--calibration-iterations: the tuning steps of --calibrate "
                           f"signround; --calibrate {calibrate} has none (drop it)")
    samples = _count("--calibration-samples")(calibration_samples)
    length = _count("--calibration-seq-length")(calibration_seq_length)
    save = _path("--save-calibrated")(save_calibrated)
    if save == "":
        raise CompileError("--save-calibrated: the path is empty; name a new directory")
    return Calibration(calibrate, tuple(os.fspath(f) for f in files),
                       DEFAULT_CALIBRATION_SAMPLES if samples is None else samples,
                       DEFAULT_CALIBRATION_SEQ_LENGTH if length is None else length, save,
                       iterations, calibration_ranges)


def _pipeline(top_pipeline: Any, tpu_pipeline: Any, pass_after: Any, pass_before: Any
              ) -> CompilePipeline:
    """--top-pipeline, --tpu-pipeline, --pass-after, --pass-before: the passes of each net,
    every text parsed and every pass found (the installed plugins' too)."""
    try:
        return CompilePipeline.make(top_pipeline, tpu_pipeline, pass_after, pass_before)
    except PipelineTextError as e:
        raise CompileError(str(e)) from None


# ----------------------------------------------------------------------------- the request

PIPELINES = ("pass pipelines (passes of installed plugins too: toptpu-opt --help lists "
             "them; docs/your-first-pass.md)")
VISION = ("vision-language models (InternVL, MiniCPM-V 4.6/4.7, Qwen2.5-VL, Qwen3-VL, "
          "Qwen3.5)")


@dataclass(frozen=True)
class CompileRequest:
    """What to compile a model to, checked (see the module doc)."""

    #: the quantization mode as asked; None (f32, or a checkpoint's own) and auto are
    #: resolved against the model (`toptpu.prequantized.resolve_mode`)
    mode: AskedMode = asked(Option(
        "mode", ("-q", "--quantize"), None,
        f"{' | '.join(QuantMode.names())} | auto (a pre-quantized checkpoint's bits and "
        "dtype); default: auto for GPTQ/AWQ/AutoRound checkpoints and GGUF files with "
        "quantized linears, f32 otherwise"),
        parse=_mode)
    #: a GGUF file's quantized tensors dequantized and compiled in this mode (the mode then)
    dequantize: QuantMode | None = asked(Option(
        "dequantize", ("--dequantize",), None,
        "a GGUF file: dequantize every quantized tensor and compile in MODE (e.g. f32); "
        "without it the exact types (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K) are "
        "compiled as they are and any other type (Q2_K, Q3_K, IQ*, ...) is refused",
        metavar="MODE"),
        parse=_flag_mode("--dequantize"))
    chip: Chip = asked(Option(
        "chip", ("--chip",), DEFAULT_CHIP, f"target chip preset ({', '.join(chip_names())})"),
        parse=_chip)
    shapes: StaticShapes = asked(
        Option("seq_length", ("--seq-length",), 512,
               "KV cache capacity SEQ (at most the model's max_position_embeddings)",
               type=int_at_least(2)),
        Option("max_input_length", ("--max-input-length",), None,
               "prefill chunk L (default min(SEQ, 128))", type=int_at_least(1)),
        Option("max_history", ("--max-history",), None,
               "history Hh the prefill_kv net attends to (default SEQ)",
               type=int_at_least(1)),
        Option("prefill_lengths", ("--prefill-lengths",), None,
               "the chunk lengths the prefill nets are also compiled at; a prompt chunk runs "
               "the shortest that holds it (default 16, 32, 64, ... below L; the longest is "
               "L, or L is their largest when --max-input-length is not given)",
               type=chunk_lengths, metavar="N,N,..."),
        parse=_shapes)
    #: how many chips the model is spread over, and how (None for one chip)
    devices: int = asked(Option(
        "devices", ("--devices",), 1,
        "chips to spread the model over (at most the chip preset's max_devices)",
        type=int_at_least(1)), parse=_devices)
    parallel: Parallel | None = asked(Option(
        "parallel", ("--parallel",), None,
        f"with --devices 2 or more: {Parallel.TP} (tensor parallel: every layer cut over all "
        f"devices, collectives between), {Parallel.PP} (pipeline parallel: contiguous "
        f"layers per device, the hidden state sent on) or {Parallel.EP} (expert parallel, "
        "mixtures of experts: each device its share of every layer's experts, the rest "
        "replicated); default tp",
        choices=tuple(p.value for p in Parallel)), parse=_parallel)
    #: conversations one decode step advances together (1: no batch nets)
    batch: int = asked(Option(
        "batch", ("--batch",), 1,
        "also compile the decode nets (embedding_cache, block_cache, lm_head and the heads) "
        "for B conversations at once, each with its own KV cache: `toptpu serve` advances B "
        "requests in one step (default 1: none)", type=int_at_least(1), metavar="B"),
        parse=_batch)
    #: as asked (None: DEFAULT_GROUP_SIZE in the w4 modes; `quant_group_size`)
    group_size: int | None = asked(Option(
        "group_size", ("--group-size",), None,
        f"w4 modes: quantization group size (default {DEFAULT_GROUP_SIZE}; -1: per channel)",
        type=group_size), parse=_group_size)
    symmetric: bool | None = asked(Option(
        "symmetric", ("--symmetric",), None,
        "w4/w8 modes: symmetric weight quantization (default: w8 symmetric, w4 asymmetric)",
        action="store_true"), parse=_symmetric)
    #: weights whose name contains this stay in the activation type when quantizing
    keep_float: str = asked(Option(
        "keep_float", ("--keep-float",), "lm_head",
        "w4/w8 modes: weights whose name contains TEXT stay in the activation type "
        "(default: lm_head; '' quantizes the lm_head too, as some published bmodels do)",
        metavar="TEXT"), parse=_keep_float)
    #: every net's IR after every pass is written there
    dump_ir: str | None = asked(Option(
        "dump_ir", ("--dump-ir",), None, "write every net's IR after every pass",
        metavar="DIR"), parse=_path("--dump-ir"))
    #: VLMs: tile size, tiles / slices, patches per slice, the pixel budget W x H (Qwen-VL)
    image_size: int | None = asked(Option(
        "image_size", ("--image-size",), None,
        "tile (InternVL) / slice (MiniCPM-V) size in pixels the vit net is compiled for "
        "(default: the checkpoint's, e.g. 448)", type=int_at_least(1), group=VISION),
        parse=_count("--image-size"))
    max_tiles: int | None = asked(Option(
        "max_tiles", ("--max-tiles",), None,
        "most tiles per image, plus a thumbnail (InternVL; default 12) / most slices "
        "besides the source image (MiniCPM-V; default 9)", type=int_at_least(1),
        group=VISION), parse=_count("--max-tiles"))
    max_patches: int | None = asked(Option(
        "max_patches", ("--max-patches",), None,
        "MiniCPM-V: static patch budget of one slice (default: the largest slice of any "
        "image up to aspect ratio 10); Qwen-VL: patches per image or video (instead of "
        "--max-pixels)", type=int_at_least(1), group=VISION), parse=_count("--max-patches"))
    max_pixels: tuple[int, int] | None = asked(Option(
        "max_pixels", ("--max-pixels",), None,
        "Qwen-VL: the vision net's pixel budget, width x height (default 768,768): every "
        "image (and video) is resized by the model's processor to at most W*H pixels and "
        "the vit net is compiled for W*H/patch^2 patches", type=pixel_size, metavar="W,H",
        group=VISION), parse=_max_pixels)
    #: VLMs: the vit net's mode (None: the activations of the text model's mode)
    vision_mode: QuantMode | None = asked(Option(
        "vision_mode", ("--vision-quantize",), None,
        "mode of the vit net (default: the activation type of -q, e.g. bf16 for w4bf16: "
        "weight-only quantization is for the text model)", metavar="MODE", group=VISION),
        parse=_flag_mode("--vision-quantize"))

    #: calibrated weight quantization (GPTQ / AWQ) instead of round-to-nearest
    calibration: Calibration | None = asked(
        Option("calibrate", ("--calibrate",), None,
               "quantize the weights of the w4/w8 mode by a calibrated method instead of "
               "rounding them to nearest: gptq, awq, signround (tuned rounding and "
               "ranges), awq,gptq (AWQ's scales, then GPTQ), gptaq (GPTQ matching the "
               "float model's outputs) or awq,gptaq (AWQ's scales, then GPTAQ), one layer "
               "at a time on the outputs of the layers before it as quantized (a float "
               "model; --group-size and --symmetric shape it)", choices=CALIBRATION_METHODS,
               metavar="METHOD", group=CALIBRATION),
        Option("calibration_data", ("--calibration-data",), None,
               "--calibrate: the plain UTF-8 text files to calibrate on, tokenized with the "
               "model's tokenizer in the order given (default: "
               f"{DEFAULT_CALIBRATION_TEXT})", action="extend", nargs="+", metavar="FILE",
               group=CALIBRATION),
        Option("calibration_samples", ("--calibration-samples",), None,
               f"--calibrate: sequences in the calibration set (default "
               f"{DEFAULT_CALIBRATION_SAMPLES}; fewer when the text holds fewer)",
               type=int_at_least(1), metavar="N", group=CALIBRATION),
        Option("calibration_seq_length", ("--calibration-seq-length",), None,
               f"--calibrate: tokens per calibration sequence (default "
               f"{DEFAULT_CALIBRATION_SEQ_LENGTH})", type=int_at_least(1), metavar="L",
               group=CALIBRATION),
        Option("save_calibrated", ("--save-calibrated",), None,
               "--calibrate: keep the calibrated checkpoint in DIR, a new directory (GPTQ "
               "layout, auto-round format: transformers and `toptpu compile DIR` load it); "
               "without it the checkpoint is removed once the model file is written",
               metavar="DIR", group=CALIBRATION),
        Option("calibration_iterations", ("--calibration-iterations",), None,
               "--calibrate signround: signed-gradient steps per layer (default 200, as "
               "the paper and auto-round)", type=int_at_least(1), metavar="N",
               group=CALIBRATION),
        Option("calibration_ranges", ("--calibration-ranges",), None,
               "--calibrate gptq, awq,gptq, gptaq or awq,gptaq: each group's range: minmax "
               "(default: its min and max) or mse (the GPTQ reference's grid: the range "
               "times 1, 0.99, ..., 0.21, keeping the least sum of |error|^2.4)",
               choices=CALIBRATION_RANGES, metavar="R", group=CALIBRATION),
        parse=_calibration)

    #: the passes each net runs (`toptpu.pass_pipeline`): the top and tpu stages' passes
    #: replaced or passes inserted; the model file records them per net
    pipeline: CompilePipeline = asked(
        Option("top_pipeline", ("--top-pipeline",), None,
               "the passes of the top stage (Top IR), as toptpu-opt's -p takes them, "
               f"replacing the default '{DEFAULT_TOP}'", metavar="PIPELINE", group=PIPELINES),
        Option("tpu_pipeline", ("--tpu-pipeline",), None,
               "the passes of the tpu stage (Tpu IR, after convert-top-to-tpu and before "
               f"the machine passes), replacing the default '{DEFAULT_TPU}'",
               metavar="PIPELINE", group=PIPELINES),
        Option("pass_after", ("--pass-after",), None,
               "run PIPELINE after every run of PASS (any stage's pass: fuse, "
               "convert-top-to-tpu, layer-group, ...); repeatable, e.g. --pass-after "
               "fuse=expand-silu", action="append", metavar="PASS=PIPELINE", group=PIPELINES),
        Option("pass_before", ("--pass-before",), None,
               "run PIPELINE before every run of PASS; repeatable", action="append",
               metavar="PASS=PIPELINE", group=PIPELINES),
        parse=_pipeline)

    def __post_init__(self) -> None:
        if not isinstance(self.chip, Chip) or not isinstance(self.shapes, StaticShapes):
            raise TypeError("a CompileRequest's chip is a Chip and its shapes StaticShapes "
                            "(CompileRequest.make takes them as asked)")
        if self.dequantize is not None:
            if self.mode not in (None, self.dequantize):
                raise CompileError(f"-q {self.mode} contradicts --dequantize "
                                   f"{self.dequantize}: give one of them")
            object.__setattr__(self, "mode", self.dequantize)  # frozen: set once, here
        check_quant_options(self.mode, self.group_size, self.symmetric,
                            keep_float=self.keep_float)
        object.__setattr__(self, "parallel",
                           check_devices(self.devices, self.parallel, self.chip))
        if self.calibration is not None:
            check_calibration(self.calibration, self.mode, self.parallel)
        if self.batch > 1 and self.devices > 1 and self.parallel is not Parallel.EP:
            raise CompileError(f"--batch {self.batch} with --devices {self.devices}: the batch "
                               "nets are compiled for one chip; give one of them (or "
                               "--parallel ep for a mixture of experts)")

    # --------------------------------------------------------------------- building

    @classmethod
    def make(cls, **keywords: Any) -> CompileRequest:
        """The request from the Python keywords (`options()`; "not given" is each one's
        default), every value checked (CompileError naming the option)."""
        known = {o.keyword for o in cls.options()}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise TypeError(f"unknown compile option(s) {', '.join(unknown)}; the options: "
                            f"{', '.join(sorted(known))}")
        return cls(**{f.name: _asked(f).value(keywords) for f in fields(cls)})

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> CompileRequest:
        """The request from a command line's parsed arguments: every option of the request
        the namespace holds (those `add_request_args` added, or a command's own spelling
        of one under the same dest), `overrides` (keywords as `make` takes them) instead
        of the namespace's; the others are not given."""
        given = {o.keyword: getattr(args, o.keyword) for o in cls.options()
                 if hasattr(args, o.keyword)}
        return cls.make(**{**given, **overrides})

    @classmethod
    def options(cls, names: Sequence[str] | None = None) -> Iterator[Option]:
        """The options of the fields `names` (default: every field), in field order."""
        for f in fields(cls):
            if names is None or f.name in names:
                yield from _asked(f).options

    def keywords(self) -> dict[str, Any]:
        """The Python keywords (`make`'s, every option) that ask for this request, as JSON
        values: `make(**request.keywords())` is an equal request (a `--dump-ir` directory
        records them for `toptpu compile --from-ir`). The chip must be a preset."""
        if self.chip.name not in chip_names() or get_chip(self.chip.name) != self.chip:
            raise CompileError(f"the chip '{self.chip.name}' is not a preset's figures; a "
                               "request is written down with a preset chip only")
        s = self.shapes

        def text(v: Any) -> Any:
            return None if v is None else str(v)

        return {"mode": text(self.mode), "dequantize": text(self.dequantize),
                "chip": self.chip.name, "seq_length": s.seq_length,
                "max_input_length": s.max_input_length, "max_history": s.max_history,
                "prefill_lengths": list(s.prefill_lengths), "devices": self.devices,
                "parallel": text(self.parallel), "group_size": self.group_size,
                "symmetric": self.symmetric, "dump_ir": self.dump_ir,
                "image_size": self.image_size, "max_tiles": self.max_tiles,
                "max_patches": self.max_patches,
                "max_pixels": None if self.max_pixels is None else list(self.max_pixels),
                "vision_mode": text(self.vision_mode), **self.pipeline.keywords()}

    def __repr__(self) -> str:
        """The fields, the chip by its name (and `*` when its figures differ from the
        preset's)."""
        def shown(name: str) -> str:
            if name != "chip":
                return repr(getattr(self, name))
            preset = self.chip.name in chip_names() and get_chip(self.chip.name) == self.chip
            return f"<Chip {self.chip.name}{'' if preset else '*'}>"

        return f"CompileRequest({', '.join(f'{f.name}={shown(f.name)}' for f in fields(self))})"

    # --------------------------------------------------------------------- derived

    @property
    def quant_group_size(self) -> int:
        """The group size round-to-nearest w4 quantization uses."""
        return DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size

    def fixed_mode(self, command: str) -> QuantMode:
        """The mode, for a command that compiles without a checkpoint's weights (estimate,
        compare): auto is refused."""
        if isinstance(self.mode, QuantMode):
            return self.mode
        raise CompileError(f"-q {self.mode or AUTO} takes a pre-quantized checkpoint's own "
                           f"mode, which {command} does not read; choose one of "
                           f"{', '.join(QuantMode.names())}")

    def vision_mode_for(self, mode: QuantMode) -> QuantMode:
        """The vit net's mode when the text model compiles in `mode`."""
        return self.vision_mode or activation_mode(mode)


def add_request_args(parser: argparse.ArgumentParser,
                     names: Sequence[str] | None = None) -> None:
    """Add the options of the request fields `names` (default: all) to `parser`, each in
    its argparse group (one group per title)."""
    groups: dict[str, Any] = {}
    for option in CompileRequest.options(names):
        target: Any = parser
        if option.group is not None:
            if option.group not in groups:
                groups[option.group] = parser.add_argument_group(option.group)
            target = groups[option.group]
        option.add_to(target)


# ----------------------------------------------------------------------------- checks


_W4_MODES = ", ".join(QuantMode.names(bits=4))


def check_quant_options(mode: AskedMode, group_size: int | None, symmetric: bool | None,
                        checkpoint: str | None = None, keep_float: str = "lm_head") -> None:
    """Refuse `group_size` / `symmetric` / `keep_float` where they would be ignored: the
    group size shapes round-to-nearest quantization in the w4 modes only (w8 is per
    channel), symmetric and the weights kept float in the w4 and w8 modes; a pre-quantized
    `checkpoint` keeps its own (None: not known yet). None (for keep_float its default)
    means "not given"."""
    if group_size is not None and group_size != -1 and group_size <= 0:
        raise CompileError(f"--group-size must be positive or -1 (per channel), not {group_size}")
    bits = weight_bits(mode)
    what = "-q auto" if mode is AUTO else (f"-q {mode}" if mode else "the default mode (f32, "
                                           "or a pre-quantized checkpoint's own)")
    for flag, given, applies in (("--group-size", group_size is not None, bits == 4),
                                 ("--symmetric", bool(symmetric is not None),
                                  bits in (4, 8)),
                                 ("--keep-float", keep_float != "lm_head", bits in (4, 8))):
        if not given:
            continue
        if checkpoint is not None:
            raise CompileError(f"{flag} does not apply to {checkpoint}: a pre-quantized "
                               "checkpoint keeps its own quantization (group size, zero "
                               f"points, the layers left float); drop {flag}")
        if not applies:
            modes = _W4_MODES if flag == "--group-size" else "w4 and w8 modes"
            if flag == "--keep-float":
                raise CompileError(f"--keep-float applies to weight quantization in the {modes}"
                                   f"; {what} quantizes no weight: drop --keep-float or "
                                   "choose such a mode")
            why = " (w8 quantizes per channel)" if flag == "--group-size" and bits == 8 else ""
            raise CompileError(f"{flag} applies to round-to-nearest weight quantization in "
                               f"the {modes}; {what} does not use it{why}: drop {flag} or "
                               "choose such a mode")


def check_calibration(calibration: Calibration, mode: AskedMode,
                      parallel: Parallel | None) -> None:
    """`--calibrate` quantizes the weights of a w4 or w8 mode, for one chip or a pipeline
    (the calibrated integers are not cut over tensor-parallel devices yet)."""
    if not isinstance(calibration, Calibration):
        raise TypeError("a CompileRequest's calibration is a Calibration (CompileRequest.make "
                        "takes it as asked)")
    flag = f"--calibrate {calibration.method}"
    if weight_bits(mode) is None:
        what = "-q auto takes a pre-quantized checkpoint's own weights" if mode is AUTO else (
            f"-q {mode} keeps the weights float" if mode is not None
            else "the default mode (f32) keeps the weights float")
        raise CompileError(f"{flag} quantizes weights: {what}; choose a w4 or w8 mode (e.g. "
                           "-q w4bf16)")
    if parallel is Parallel.TP:
        raise CompileError(f"{flag} with --parallel tp: the calibrated integers are not cut "
                           "over devices yet; use --parallel pp")


def check_devices(devices: int, parallel: Parallel | str | None, chip: Chip
                  ) -> Parallel | None:
    """`--devices` within the chip's `max_devices`, `--parallel` given only with several;
    the strategy (tp by default for several devices, None for one)."""
    devices, parallel = _devices(devices), _parallel(parallel)
    if devices == 1:
        if parallel is not None:
            raise CompileError(f"--parallel {parallel} spreads a model over several chips; "
                               "give --devices 2 or more (or drop --parallel)")
        return None
    limit = chip.max_devices
    if devices > limit:
        raise CompileError(f"--devices {devices}: a {chip.name} deployment joins at most "
                           f"{limit} chip{'s' if limit != 1 else ''} (its preset's "
                           "max_devices)")
    return parallel or Parallel.TP
