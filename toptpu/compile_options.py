"""What `toptpu.compile` is asked to do, checked before any work starts.

`check_compile_request` checks every argument and output path (the model's config.json is
read, its weights are not) and returns the `CompileOptions` the compile steps use; the
checks of a mode against a config (`check_seq_length`, `check_group_size`,
`check_quant_options`) are shared with `toptpu compare`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from toptpu.backend.contract import StaticShapes, parse_strict_json
from toptpu.backend.target.chips import Chip, chip_names, get_chip
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.errors import CompileError
from toptpu.frontends.gguf_loader import gguf_file_of, gguf_text_config
from toptpu.frontends.hf_loader import (
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    ModelLoadError,
    check_config_values,
    check_model_dir,
    dir_bytes,
)
from toptpu.passes.convert_top_to_tpu import parse_mode
from toptpu.paths import (
    OutputPathError,
    check_not_inside,
    check_output_dir,
    check_output_file,
    is_inside,
)


def known_chips() -> tuple[str, ...]:
    """Chip names `--chip` accepts: the presets of `toptpu.backend.target.chips`."""
    return tuple(chip_names())


# ------------------------------------------------------------------ request checks

_W4_MODES = ", ".join(QuantMode.names(bits=4))


def _bits(mode: str | None) -> int | None:
    """The weight bits of a named mode (None: a float mode, auto, or no mode)."""
    named = QuantMode.named(mode) if mode else None
    return named.weight_bits if named else None


def check_quant_options(mode: str | None, group_size: int | None, symmetric: bool | None,
                        checkpoint: str | None = None) -> None:
    """Refuse `group_size` / `symmetric` where they would be ignored: the group size shapes
    round-to-nearest quantization in the w4 modes only (w8 is per channel), symmetric in
    the w4 and w8 modes; a pre-quantized `checkpoint` keeps its own (None: not known yet).
    None means "not given"."""
    if group_size is not None and group_size != -1 and group_size <= 0:
        raise CompileError(f"--group-size must be positive or -1 (per channel), not {group_size}")
    bits = _bits(mode)
    what = "-q auto" if mode == "auto" else (f"-q {mode}" if mode else "the default mode (f32, "
                                             "or a pre-quantized checkpoint's own)")
    for flag, given, applies in (("--group-size", group_size is not None, bits == 4),
                                 ("--symmetric", bool(symmetric is not None),
                                  bits in (4, 8))):
        if not given:
            continue
        if checkpoint is not None:
            raise CompileError(f"{flag} does not apply to {checkpoint}: a pre-quantized "
                               "checkpoint keeps its own group size and zero points; drop "
                               f"{flag}")
        if not applies:
            modes = _W4_MODES if flag == "--group-size" else "w4 and w8 modes"
            why = " (w8 quantizes per channel)" if flag == "--group-size" and bits == 8 else ""
            raise CompileError(f"{flag} applies to round-to-nearest weight quantization in "
                               f"the {modes}; {what} does not use it{why}: drop {flag} or "
                               "choose such a mode")


@dataclass(frozen=True)
class CompileOptions:
    """A checked compile request: what to compile the model to."""

    mode: str | None  # as asked; None (f32, or a checkpoint's own) and auto: see `plan`
    chip: str
    shapes: StaticShapes
    group_size: int | None  # as asked (None: DEFAULT_GROUP_SIZE in the w4 modes)
    symmetric: bool | None
    dump_ir: str | None = None
    vision_mode: str | None = None  # VLMs: the vit net's mode (None: mode's activations)
    image_size: int | None = None  # VLMs: tile size, tiles / slices, patches per slice
    max_tiles: int | None = None
    max_patches: int | None = None
    #: Qwen-VL: the pixel budget W x H of the vision net (`--max-pixels W,H`)
    max_pixels: tuple[int, int] | None = None
    #: a GGUF file's quantized tensors dequantized and compiled in this mode (`--dequantize`)
    dequantize: str | None = None
    #: how many chips the model is spread over, and how (`tp` / `pp`; None for one chip)
    devices: int = 1
    parallel: str | None = None

    @property
    def quant_group_size(self) -> int:
        """The group size round-to-nearest w4 quantization uses."""
        return DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size


def check_compile_request(model: Any, output: str, *, mode: str | None, chip: str,
                          seq_length: int, max_input_length: int | None,
                          max_history: int | None, group_size: int | None,
                          symmetric: bool | None, dump_ir: str | None,
                          vision_mode: str | None = None, image_size: int | None = None,
                          max_tiles: int | None = None,
                          max_patches: int | None = None,
                          dequantize: str | None = None,
                          max_pixels: tuple[int, int] | None = None, devices: int = 1,
                          parallel: str | None = None,
                          prefill_lengths: Sequence[int] | None = None) -> CompileOptions:
    """Check `compile`'s arguments and output paths before any work starts (the model's
    config.json is read, its weights are not). Raises CompileError naming the problem."""
    if dequantize is not None:
        mode = _check_dequantize(model, mode, dequantize)
    if mode not in (None, "auto"):
        try:
            parse_mode(mode)
        except ValueError as e:
            raise CompileError(f"{e}, or auto (a pre-quantized checkpoint's own)") from e
    if vision_mode is not None:
        try:
            parse_mode(vision_mode)
        except ValueError as e:
            raise CompileError(f"--vision-quantize: {e}") from e
    if max_pixels is not None and (len(max_pixels) != 2 or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in max_pixels)):
        raise CompileError(f"--max-pixels {max_pixels}: give the width and height of the "
                           "pixel budget as two positive integers (W,H)")
    chips = known_chips()
    if chip not in chips:
        raise CompileError(f"unknown chip '{chip}'; choose one of {', '.join(chips)}")
    check_quant_options(mode, group_size, symmetric)
    parallel = check_devices(devices, parallel, chip)
    try:
        shapes = StaticShapes.make(seq_length, max_input_length, max_history, prefill_lengths)
    except ValueError as e:
        raise CompileError(str(e)) from e
    try:
        _check_outputs(model, output, dump_ir)
    except OutputPathError as e:
        raise CompileError(str(e)) from e
    found = _text_config(model)
    if found is not None:
        _check_against_config(*found, shapes, mode, group_size)
        check_kv_cache_fits(*found, shapes.seq_length, mode, chip, devices)
        check_parallel_config(*found, devices, parallel, mode, group_size)
    return CompileOptions(mode, chip, shapes, group_size, symmetric, dump_ir, vision_mode,
                          image_size, max_tiles, max_patches,
                          None if max_pixels is None else (int(max_pixels[0]),
                                                           int(max_pixels[1])), dequantize,
                          devices, parallel)


def check_devices(devices: int, parallel: str | None, chip: str | Chip) -> str | None:
    """`--devices` within the chip's `max_devices`, `--parallel` given only with several;
    the strategy (tp by default for several devices, None for one)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise CompileError(f"--devices must be an integer >= 1, not {devices!r}")
    if parallel is not None and parallel not in ("tp", "pp"):
        raise CompileError(f"--parallel must be tp or pp, not {parallel!r}")
    if devices == 1:
        if parallel is not None:
            raise CompileError(f"--parallel {parallel} spreads a model over several chips; "
                               "give --devices 2 or more (or drop --parallel)")
        return None
    the_chip = chip if isinstance(chip, Chip) else get_chip(chip)
    limit = the_chip.max_devices
    if devices > limit:
        raise CompileError(f"--devices {devices}: a {the_chip.name} deployment joins at most "
                           f"{limit} chip{'s' if limit != 1 else ''} (its preset's "
                           "max_devices)")
    return parallel or "tp"


def check_parallel_config(cfg: dict[str, Any], where: str, devices: int,
                          parallel: str | None, mode: str | None,
                          group_size: int | None) -> None:
    """The model can be spread as asked: tensor parallel needs the query heads, the
    intermediate size and the vocabulary to divide among the devices, the KV heads to
    divide or be divided by them, and a w4 group size to divide each device's part of a
    row-parallel matmul's input; pipeline parallel needs a layer per device at least."""
    if parallel is None:
        return
    layers = _positive(cfg, "num_hidden_layers")
    if parallel == "pp":
        if layers is not None and devices > layers:
            raise CompileError(f"--devices {devices} --parallel pp: {where} has {layers} "
                               f"layers, fewer than the devices")
        return
    if "linear_attention" in (cfg.get("layer_types") or []):
        raise CompileError(f"--devices {devices} --parallel tp: {where} has linear-attention "
                           "layers (Qwen3.5), which toptpu does not cut over devices yet; use "
                           "--parallel pp")
    heads, hidden = _positive(cfg, "num_attention_heads"), _positive(cfg, "hidden_size")
    kv = _positive(cfg, "num_key_value_heads") or heads
    head_dim = _positive(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    inter, vocab = _positive(cfg, "intermediate_size"), _positive(cfg, "vocab_size")
    for what, v in (("num_attention_heads", heads), ("intermediate_size", inter),
                    ("vocab_size", vocab)):
        if v is not None and v % devices:
            raise CompileError(f"--devices {devices} --parallel tp: {what} {v} of {where} "
                               f"does not divide among {devices} devices; use a divisor of "
                               f"{v} or --parallel pp")
    if kv is not None and kv % devices and devices % kv:
        raise CompileError(f"--devices {devices} --parallel tp: num_key_value_heads {kv} of "
                           f"{where} neither divides among {devices} devices nor divides "
                           "them (each KV head on an equal number of devices)")
    if _bits(mode) == 4 and group_size != -1:
        g = DEFAULT_GROUP_SIZE if group_size is None else group_size
        parts = {"num_attention_heads x head_dim": heads * head_dim
                 if heads and head_dim else None, "intermediate_size": inter}
        bad = {k: v // devices for k, v in parts.items() if v is not None
               and (v // devices) % g}
        if bad:
            raise CompileError(
                f"--devices {devices} --parallel tp: group size {g} does not divide each "
                f"device's part of a row-parallel matmul's input ("
                + ", ".join(f"{k} / {devices} = {v}" for k, v in bad.items())
                + f" in {where}); use --group-size dividing it or -1 (per channel)")


def _check_dequantize(model: Any, mode: str | None, dequantize: str) -> str:
    """`--dequantize MODE`: a GGUF source, a valid mode, not contradicting -q; the mode."""
    try:
        parse_mode(dequantize)
    except ValueError as e:
        raise CompileError(f"--dequantize: {e}") from e
    try:
        is_gguf = gguf_file_of(model) is not None
    except ModelLoadError as e:
        raise CompileError(str(e)) from e
    if not is_gguf:
        what = f"'{os.fspath(model)}'" if isinstance(model, str | os.PathLike) \
            else f"a {type(model).__name__}"
        raise CompileError(f"--dequantize applies to GGUF files; {what} is not one")
    if mode not in (None, dequantize):
        raise CompileError(f"-q {mode} contradicts --dequantize {dequantize}: give one of them")
    return dequantize


def _check_outputs(model: Any, output: str, dump_ir: str | None) -> None:
    """The model file and the IR dump directory can be written, neither inside the input
    model directory, and the model file not inside the dumps (which fill DIR/<net>/ and
    DIR/weights.safetensors)."""
    check_output_file(output, "the output file (-o)", seekable=True)
    if dump_ir is not None:
        check_output_dir(dump_ir, "--dump-ir")
        if is_inside(output, dump_ir):
            raise CompileError(f"the output file (-o) '{output}' is inside --dump-ir "
                               f"'{dump_ir}', which the IR dumps fill: write it elsewhere")
    source = model.source if isinstance(model, LoadedModel) else model
    if isinstance(source, str | os.PathLike) and os.path.isfile(source) \
            and os.path.exists(output) and os.path.samefile(source, output):
        raise CompileError(f"the output file (-o) '{output}' is the input model file")
    if isinstance(source, str | os.PathLike) and os.path.isdir(source):
        check_not_inside(output, os.fspath(source), "the output file (-o)")
        if dump_ir is not None:
            check_not_inside(dump_ir, os.fspath(source), "--dump-ir")


def _text_config(model: Any) -> tuple[dict[str, Any], str] | None:
    """The (text) model's config as a dict, and where it is from, without loading weights;
    None when it cannot be read (the loader then says why)."""
    gguf_path = gguf_file_of(model)
    if gguf_path is not None:
        return gguf_text_config(gguf_path)  # its metadata, checked (not its tensors)
    if isinstance(model, str | os.PathLike):
        where = os.path.join(os.fspath(model), "config.json")
        check_model_dir(os.fspath(model))  # its files regular and inside it, before any read
        try:
            raw = parse_strict_json(dir_bytes(os.fspath(model), "config.json") or b"")
        except ValueError:
            return None
        if isinstance(raw, dict) and raw.get("model_type") in SUPPORTED_MODEL_TYPES:
            check_config_values(raw, where)  # a text model's (the loader checks the rest)
    else:
        config = getattr(model, "config", None)
        try:
            raw = config.to_dict() if config is not None else None
        except Exception:  # noqa: BLE001 - a foreign object; the loader reports it
            return None
        where = "the model's config"
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    return (text if isinstance(text, dict) else raw), where


def _positive(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _kv_cache_bytes(cfg: dict[str, Any], seq_length: int, mode: str | None
                    ) -> tuple[int, str] | None:
    """The KV cache's bytes for a config dict and how they add up ('2 x layers x SEQ x kv
    heads x head_dim x bytes, dtype'); None when the config lacks the sizes."""
    layers, heads = _positive(cfg, "num_hidden_layers"), _positive(cfg, "num_attention_heads")
    hidden = _positive(cfg, "hidden_size")
    if layers is None or heads is None:
        return None
    kv = _positive(cfg, "num_key_value_heads") or heads
    head_dim = _positive(cfg, "head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        return None
    named = QuantMode.named(mode) if mode else None
    act = named.activation if named else ("f16/bf16" if mode == "auto" else "f32")
    width = 4 if act == "f32" else 2
    total = 2 * layers * seq_length * kv * head_dim * width
    return total, (f"2 x {layers} layers x {seq_length} positions x {kv} kv heads x "
                   f"{head_dim} x {width} bytes, {act}")


def kv_cache_size(cfg: dict[str, Any], seq_length: int, mode: str | None) -> str | None:
    """'X (2 x layers x SEQ x kv heads x head_dim x bytes)': the KV cache's size for a
    config dict, None when the config lacks the sizes."""
    found = _kv_cache_bytes(cfg, seq_length, mode)
    return None if found is None else f"{_human_bytes(found[0])} ({found[1]})"


def check_kv_cache_fits(cfg: dict[str, Any], where: str, seq_length: int,
                        mode: str | None, chip: str, devices: int = 1) -> None:
    """The KV cache of `seq_length` positions fits the chip's memory (spread over
    `devices`, each holding its share at best), refused before anything is allocated for
    it (the nets are exported with their KV inputs of that size); the compile's
    `check_fits` later checks the weights and the cache of each device exactly."""
    found = _kv_cache_bytes(cfg, seq_length, mode)
    if found is None:
        return
    total, how = found
    the_chip = get_chip(chip)
    if total <= the_chip.ddr_bytes * devices:
        return
    per_position = total // seq_length
    fits = the_chip.ddr_bytes * devices // per_position
    on = f"a {the_chip.name}'s" if devices == 1 else f"{devices} {the_chip.name}s'"
    raise CompileError(
        f"--seq-length {seq_length}: the KV cache alone would take {_human_bytes(total)} "
        f"({how}) for {where}, more than {on} {_human_bytes(the_chip.ddr_bytes * devices)} "
        f"of memory; use --seq-length {fits} or less (the weights need room too)")


def _check_against_config(cfg: dict[str, Any], where: str, shapes: StaticShapes,
                          mode: str | None, group_size: int | None) -> None:
    check_seq_length(cfg, where, shapes.seq_length, mode)
    check_group_size(cfg, where, mode, group_size)


def check_seq_length(cfg: dict[str, Any], where: str, seq_length: int, mode: str | None,
                     flag: str = "--seq-length", kv_cache: bool = True) -> None:
    """`seq_length` within the config's max_position_embeddings (with `kv_cache` the error
    says how much memory the KV cache would take)."""
    limit = _positive(cfg, "max_position_embeddings")
    if limit is not None and seq_length > limit:
        size = kv_cache_size(cfg, seq_length, mode) if kv_cache else None
        kv = f"; its KV cache alone would take {size}" if size else ""
        raise CompileError(f"{flag} {seq_length} exceeds max_position_embeddings {limit} of "
                           f"{where}{kv}. Use {flag} {limit} or less")


def check_group_size(cfg: dict[str, Any], where: str, mode: str | None,
                     group_size: int | None) -> None:
    """A given w4 group size divides the input dimension of every matmul of the config."""
    if group_size is None or group_size == -1 or _bits(mode) != 4:
        return
    heads, hidden = _positive(cfg, "num_attention_heads"), _positive(cfg, "hidden_size")
    head_dim = _positive(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    dims = {"hidden_size": hidden, "intermediate_size": _positive(cfg, "intermediate_size"),
            "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None}
    bad = {k: v for k, v in dims.items() if v is not None and v % group_size}
    if bad:
        divisor = math.gcd(*(v for v in dims.values() if v is not None))
        raise CompileError(
            f"--group-size {group_size} does not divide the input dimension of every matmul "
            f"({', '.join(f'{k} {v}' for k, v in bad.items())} in {where}); use a divisor of "
            f"{divisor} or -1 (per channel)")


