"""The checks of a compile request against the model and the output paths, before any
work starts.

`toptpu.request.CompileRequest` checks every value of a request on its own;
`check_compile_request` adds what needs the model and the outputs: the output paths (not
inside the model directory, writable), `--dequantize` on a GGUF source, and the request
against the model's config.json (read; its weights are not). The checks of a mode against
a config (`check_seq_length`, `check_group_size`, `check_parallel_config`) are shared with
`toptpu estimate` and `toptpu compare`.
"""

from __future__ import annotations

import math
import os
from typing import Any

from toptpu.backend.contract import parse_strict_json
from toptpu.backend.target.chips import Chip, chip_names, get_chip
from toptpu.devices import Parallel
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.dialects.output_file import note_input
from toptpu.errors import CompileError
from toptpu.families import QWEN2_MOE, QWEN3_MOE, text_family_of
from toptpu.frontends.gguf_loader import gguf_file_of, gguf_text_config
from toptpu.frontends.hf_loader import (
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    ModelLoadError,
    check_config_values,
    check_model_dir,
    dir_bytes,
)
from toptpu.frontends.vlm import vlm_model_type
from toptpu.paths import (
    OutputPathError,
    check_not_inside,
    check_output_dir,
    check_output_file,
    is_inside,
)
from toptpu.request import (
    AUTO,
    AskedMode,
    CompileRequest,
    check_devices,
    check_quant_options,
    weight_bits,
)
from toptpu.weight_calibration.data import check_file


def known_chips() -> tuple[str, ...]:
    """Chip names `--chip` accepts: the presets of `toptpu.backend.target.chips`."""
    return tuple(chip_names())


def check_compile_request(model: Any, output: str, request: CompileRequest | None = None,
                          **keywords: Any) -> CompileRequest:
    """The request (`request`, or `CompileRequest.make(**keywords)`: every value checked)
    checked against the model and the output paths before any work starts (the model's
    config.json is read, its weights are not). Raises CompileError naming the problem."""
    if request is None:
        request = CompileRequest.make(**keywords)
    elif keywords:
        raise TypeError(f"give a CompileRequest or its keywords, not both ({', '.join(keywords)})")
    if request.dequantize is not None:
        _check_dequantize(model, request)
    if request.chip.name not in chip_names() or get_chip(request.chip.name) != request.chip:
        raise CompileError(f"the chip '{request.chip.name}' differs from its preset: a model "
                           "file names a chip preset (its figures are the preset's); compile "
                           "for a preset")
    try:
        _check_outputs(model, output, request.dump_ir)
    except OutputPathError as e:
        raise CompileError(str(e)) from e
    found = _text_config(model)
    if request.calibration is not None:
        _check_calibration(model, request, found)
    if found is not None:
        check_seq_length(*found, request.shapes.seq_length, request.mode)
        check_group_size(*found, request.mode, request.group_size)
        check_kv_cache_fits(*found, request.shapes.seq_length, request.mode, request.chip,
                            request.devices)
        check_parallel_config(*found, request.devices, request.parallel, request.mode,
                              request.group_size)
    return request


def check_parallel_config(cfg: dict[str, Any], where: str, devices: int,
                          parallel: Parallel | None, mode: AskedMode,
                          group_size: int | None) -> None:
    """The model can be spread as asked: tensor parallel needs the query heads, the
    intermediate size and the vocabulary to divide among the devices, the KV heads to
    divide or be divided by them, and a w4 group size to divide each device's part of a
    row-parallel matmul's input; pipeline parallel needs a layer per device at least."""
    if parallel is None:
        return
    layers = _positive(cfg, "num_hidden_layers")
    if parallel is Parallel.PP:
        if layers is not None and devices > layers:
            raise CompileError(f"--devices {devices} --parallel pp: {where} has {layers} "
                               f"layers, fewer than the devices")
        return
    if parallel is Parallel.EP:
        check_expert_parallel_config(cfg, where, devices)
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
    if weight_bits(mode) == 4 and group_size != -1:
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


#: config keys whose positive value makes a model a mixture of experts
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: the mixture-of-experts families whose routed experts `--calibrate gptq` calibrates
CALIBRATED_MOE = (QWEN3_MOE, QWEN2_MOE)


def check_expert_parallel_config(cfg: dict[str, Any], where: str, devices: int) -> None:
    """Expert parallelism needs a mixture of experts whose experts divide among the
    devices (each device holds E / N of every layer's experts; a token's k experts may
    exceed them: the slots naming other devices' experts add nothing there). A GGUF file's
    metadata gives the expert count (`<arch>.expert_count`) before any tensor is read."""
    flag = f"--devices {devices} --parallel ep"
    key = next((k for k in _EXPERT_KEYS if (_positive(cfg, k) or 0) > 0), None)
    if key is None and "model_type" not in cfg:
        return  # a GGUF's metadata read so far: the loaded model is checked (compiler)
    if key is None:
        raise CompileError(f"{flag}: {where} has no mixture-of-experts layers to spread "
                           "expert by expert; use --parallel tp or pp")
    experts = cfg[key]
    if experts % devices:
        fits = [n for n in range(2, experts + 1) if experts % n == 0][:4]
        raise CompileError(f"{flag}: {key} {experts} of {where} does not divide among "
                           f"{devices} devices; use --devices "
                           f"{' or '.join(map(str, fits))}, or --parallel pp")


def _check_calibration(model: Any, request: CompileRequest,
                       found: tuple[dict[str, Any], str] | None) -> None:
    """`--calibrate` takes a float text model (a MoE one of `CALIBRATED_MOE`), text files
    that can be read (`weight_calibration.data.check_file`: each refused in one line naming
    it; noted as the command's inputs), and a new directory for `--save-calibrated` outside
    the model's."""
    cal = request.calibration
    assert cal is not None
    flag = f"--calibrate {cal.method}"
    if vlm_model_type(model) is not None:
        what = f"'{os.fspath(model)}'" if isinstance(model, str | os.PathLike) else "the model"
        raise CompileError(f"{flag}: {what} is a vision-language model, whose calibration "
                           "toptpu does not do yet; compile it without --calibrate")
    if found is not None:
        cfg, where = found
        experts = next((k for k in _EXPERT_KEYS if (_positive(cfg, k) or 0) > 0), None)
        if experts is not None:
            moe = f"{where} is a mixture-of-experts model ({experts} {cfg[experts]})"
            if cal.method == "signround":
                raise CompileError(f"{flag}: {moe}; SignRound does not tune routed experts: "
                                   "calibrate it with gptq or awq")
            if cal.method in ("awq,gptq", "gptaq", "awq,gptaq"):
                raise CompileError(f"{flag}: {moe}; {cal.method} does not calibrate routed "
                                   "experts: calibrate it with gptq or awq")
            if text_family_of(cfg.get("model_type")) not in CALIBRATED_MOE:
                raise CompileError(f"{flag}: {moe} of type '{cfg.get('model_type')}', whose "
                                   "experts toptpu does not calibrate (it calibrates "
                                   f"{' and '.join(f.name for f in CALIBRATED_MOE)}); "
                                   "compile it without --calibrate")
        method = (cfg.get("quantization_config") or {}).get("quant_method") \
            if isinstance(cfg.get("quantization_config"), dict) else None
        if method is not None:
            raise CompileError(f"{flag}: {where} is already quantized ({method}); calibration "
                               "starts from float weights: compile it with -q auto, or "
                               "calibrate its float original")
    for path in cal.data:
        check_file(path)
        note_input(path, f"--calibration-data '{path}'")
    if cal.save is not None:
        _check_new_dir(cal.save, model)


def _check_new_dir(path: str, model: Any) -> None:
    """`--save-calibrated DIR`: a new directory in an existing, writable one, outside the
    model's directory."""
    what = "--save-calibrated"
    if os.path.lexists(path):
        raise CompileError(f"{what} '{path}' exists; name a new directory for the calibrated "
                           "checkpoint")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CompileError(f"{what} '{path}': the directory '{parent}' does not exist; create "
                           "it first")
    try:
        check_output_dir(path, what)
        source = model.source if isinstance(model, LoadedModel) else model
        if isinstance(source, str | os.PathLike) and os.path.isdir(source):
            check_not_inside(path, os.fspath(source), what)
    except OutputPathError as e:
        raise CompileError(str(e)) from e


def _check_dequantize(model: Any, request: CompileRequest) -> None:
    """`--dequantize MODE` applies to a GGUF source only."""
    try:
        is_gguf = gguf_file_of(model) is not None
    except ModelLoadError as e:
        raise CompileError(str(e)) from e
    if not is_gguf:
        what = f"'{os.fspath(model)}'" if isinstance(model, str | os.PathLike) \
            else f"a {type(model).__name__}"
        raise CompileError(f"--dequantize applies to GGUF files; {what} is not one")


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


def _kv_cache_bytes(cfg: dict[str, Any], seq_length: int, mode: AskedMode
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
    act = mode.activation if isinstance(mode, QuantMode) else (
        "f16/bf16" if mode is AUTO else "f32")
    width = 4 if act == "f32" else 2
    total = 2 * layers * seq_length * kv * head_dim * width
    return total, (f"2 x {layers} layers x {seq_length} positions x {kv} kv heads x "
                   f"{head_dim} x {width} bytes, {act}")


def kv_cache_size(cfg: dict[str, Any], seq_length: int, mode: AskedMode) -> str | None:
    """'X (2 x layers x SEQ x kv heads x head_dim x bytes)': the KV cache's size for a
    config dict, None when the config lacks the sizes."""
    found = _kv_cache_bytes(cfg, seq_length, mode)
    return None if found is None else f"{_human_bytes(found[0])} ({found[1]})"


def check_kv_cache_fits(cfg: dict[str, Any], where: str, seq_length: int,
                        mode: AskedMode, chip: str | Chip, devices: int = 1) -> None:
    """The KV cache of `seq_length` positions fits the chip's memory (spread over
    `devices`, each holding its share at best), refused before anything is allocated for
    it (the nets are exported with their KV inputs of that size); the compile's
    `check_fits` later checks the weights and the cache of each device exactly."""
    found = _kv_cache_bytes(cfg, seq_length, mode)
    if found is None:
        return
    total, how = found
    the_chip = chip if isinstance(chip, Chip) else get_chip(chip)
    if total <= the_chip.ddr_bytes * devices:
        return
    per_position = total // seq_length
    fits = the_chip.ddr_bytes * devices // per_position
    on = f"a {the_chip.name}'s" if devices == 1 else f"{devices} {the_chip.name}s'"
    raise CompileError(
        f"--seq-length {seq_length}: the KV cache alone would take {_human_bytes(total)} "
        f"({how}) for {where}, more than {on} {_human_bytes(the_chip.ddr_bytes * devices)} "
        f"of memory; use --seq-length {fits} or less (the weights need room too)")


def check_seq_length(cfg: dict[str, Any], where: str, seq_length: int, mode: AskedMode,
                     flag: str = "--seq-length", kv_cache: bool = True) -> None:
    """`seq_length` within the config's max_position_embeddings (with `kv_cache` the error
    says how much memory the KV cache would take)."""
    limit = _positive(cfg, "max_position_embeddings")
    if limit is not None and seq_length > limit:
        size = kv_cache_size(cfg, seq_length, mode) if kv_cache else None
        kv = f"; its KV cache alone would take {size}" if size else ""
        raise CompileError(f"{flag} {seq_length} exceeds max_position_embeddings {limit} of "
                           f"{where}{kv}. Use {flag} {limit} or less")


def check_group_size(cfg: dict[str, Any], where: str, mode: AskedMode,
                     group_size: int | None) -> None:
    """A given w4 group size divides the input dimension of every matmul of the config."""
    if group_size is None or group_size == -1 or weight_bits(mode) != 4:
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




__all__ = ["CompileRequest", "check_compile_request", "check_devices",
           "check_expert_parallel_config", "check_group_size", "check_parallel_config",
           "check_quant_options", "check_seq_length", "known_chips", "kv_cache_size"]
