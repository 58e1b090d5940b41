"""Loading a causal LM for compilation: a local Hugging Face directory or an in-memory
`transformers` model, in float32, with its tokenizer files and generation config.

A directory must hold `config.json`, the weights as `*.safetensors` (one file, or shards
listed by `model.safetensors.index.json`), `tokenizer.json` (a fast tokenizer) with its
`tokenizer_config.json`, and optionally `generation_config.json`. Before anything is
loaded, the checkpoint's tensor names and shapes are checked against the parameters the
model expects (transformers only warns about missing or unexpected tensors; a compiler
must not silently run random weights), and the config is checked for what the compiler
cannot honour. Every problem is a `ModelLoadError` naming the thing and what to do.

Supported families (`model_type`): qwen2 (Qwen2, Qwen2.5), qwen3 (with q/k norm),
llama (Llama 2 and Llama 3, including llama3 rope scaling and tied embeddings).

`load_model` builds the whole model in float32; the compiler streams a float directory
instead (`frontends.streaming.load_streaming`: a skeleton, one layer's tensors at a time),
with the same checks (`read_model_dir`, `check_checkpoint`, `tokenizer_files`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import torch
from tokenizers import Tokenizer

from toptpu.backend.contract import (
    TOKENIZER_FILES,  # the tokenizer files a model file carries
    ModelDirFileError,
    check_model_dir_files,
    model_file_path,
    parse_strict_json,
    read_model_file,
)
from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader
from toptpu.errors import ToptpuError, one_line_reason
from toptpu.families import TEXT_FAMILIES, TEXT_MODEL_TYPES, text_family, text_family_of
from toptpu.frontends.moe import stacked_name, stacked_shapes
from toptpu.frontends.quant import (
    QuantizedCheckpointError,
    read_quantized_checkpoint,
)

#: model_type -> the family name used in model files (the text families' table,
#: `toptpu.families`)
SUPPORTED_MODEL_TYPES: dict[str, str] = {mt: f.name for mt, f in TEXT_MODEL_TYPES.items()}
#: model types toptpu knows of and does not compile (yet), with what to do instead
REFUSED_MODEL_TYPES: dict[str, str] = {
    mt: why for f in TEXT_FAMILIES.values() for mt, why in f.refused.items()}

#: rope types whose frequencies are fixed at load time (static shapes can honour them)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: checkpoint tensors the models recompute and that may be present without being used
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)

_MAX_LISTED = 8


class ModelLoadError(ToptpuError):
    """The model cannot be loaded or compiled as given; the message says what and why."""


@dataclass
class LoadedModel:
    """A causal LM ready for the splitter, with what the model file needs besides weights."""

    model: Any  # transformers PreTrainedModel, float32, eval mode
    family: str
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    #: a pre-quantized checkpoint (GPTQ/AWQ/AutoRound): its integers, scales and zeros by
    #: linear module path; `model` then holds the dequantized float weights
    checkpoint: Any = None  # frontends.quant.QuantizedCheckpoint
    checkpoint_dtype: str | None = None  # the checkpoint's torch dtype ("float16", ...)
    #: a streamed checkpoint (`frontends.streaming.StreamedWeights`): `model` is then a
    #: skeleton (layer 0 real, embedding and lm_head placeholders, other layers on meta)
    stream: Any = None

    @property
    def config(self) -> Any:
        return self.model.config


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars (loading/saving shards) for the duration."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------- config


def _unknown_model_type(model_type: object, where: str) -> ModelLoadError:
    if isinstance(model_type, str) and model_type in REFUSED_MODEL_TYPES:
        return ModelLoadError(f"model_type '{model_type}' in {where}: "
                              f"{REFUSED_MODEL_TYPES[model_type]}")
    return ModelLoadError(
        f"unknown model_type '{model_type}' in {where}: toptpu compiles "
        f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (Qwen2/2.5, Qwen3, Qwen3.5, Llama 2/3, "
        "Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE) models")


#: activations (`hidden_act`) the compiled nets implement
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")

#: config fields that are sizes: name -> (required, largest value accepted)
_SIZE_FIELDS: dict[str, tuple[bool, int]] = {
    "vocab_size": (True, 1 << 22), "hidden_size": (True, 1 << 18),
    "intermediate_size": (True, 1 << 20), "num_hidden_layers": (True, 4096),
    "num_attention_heads": (True, 4096), "num_key_value_heads": (False, 4096),
    "head_dim": (False, 1 << 14), "max_position_embeddings": (False, 1 << 31),
    "moe_intermediate_size": (False, 1 << 20), "num_experts": (False, 1 << 16),
}
#: size fields a mixture of experts may leave out: a MoE config without dense MLPs
#: (Qwen3.5-MoE) has no intermediate_size
_DENSE_ONLY_FIELDS = ("intermediate_size",)
#: config fields that are positive finite floats
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
#: config fields that are token ids (an int, a list of ints, or null)
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_config_values(raw: Any, where: str) -> None:
    """Every value of a (text) model's config.json that the compiler and `toptpu estimate`
    use, checked for type and range before transformers builds anything from it: sizes are
    positive integers within bounds, the heads divide the hidden size (without head_dim) and
    the kv heads divide the heads, eps and rope_theta are positive and finite, hidden_act is
    one the nets implement. The one validation of compile and estimate: a ModelLoadError
    naming the field, its value and what to do."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where} is not a JSON object (got {type(raw).__name__}): is it "
                             "a Hugging Face config?")

    def bad(key: str, want: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: {key} is {json.dumps(raw.get(key))[:60]}, "
                              f"expected {want}; fix config.json")

    for name, (required, limit) in _SIZE_FIELDS.items():
        v = raw.get(name)
        if v is None and (not required or (name in _DENSE_ONLY_FIELDS
                                           and "moe_intermediate_size" in raw)):
            continue
        if v is None and name not in raw:
            raise ModelLoadError(f"{where}: {name} is missing, expected a positive integer; "
                                 "fix config.json")
        if not _is_int(v) or not 1 <= v <= limit:
            raise bad(name, f"an integer from 1 to {limit}")
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or \
        raw["num_attention_heads"]
    if heads % kv:
        raise ModelLoadError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv}; fix config.json")
    if raw.get("head_dim") is None and raw["hidden_size"] % heads:
        raise ModelLoadError(
            f"{where}: hidden_size {raw['hidden_size']} is not a multiple of "
            f"num_attention_heads {heads} (and there is no head_dim); fix config.json")
    rope_parameters = raw.get("rope_parameters")
    rope = rope_parameters if isinstance(rope_parameters, dict) else {}
    for name in _POSITIVE_FLOATS:
        for key, v in ((name, raw.get(name)), (f"rope_parameters.{name}", rope.get(name))):
            if v is not None and not (_is_number(v) and math.isfinite(v) and v > 0):
                raise ModelLoadError(f"{where}: {key} is {json.dumps(v)[:60]}, expected a "
                                     "positive finite number; fix config.json")
    for name in ("rope_scaling", "rope_parameters"):
        v = raw.get(name)
        if v is not None and not isinstance(v, dict):
            raise bad(name, "an object or null")
        factor = (v or {}).get("factor")
        if factor is not None and not (_is_number(factor) and math.isfinite(factor)
                                       and factor > 0):
            raise ModelLoadError(f"{where}: {name}.factor is {json.dumps(factor)[:60]}, "
                                 "expected a positive finite number; fix config.json")
    act = raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{where}: hidden_act is {json.dumps(act)[:60]}, expected one "
                             f"the compiled nets implement ({', '.join(SUPPORTED_ACTIVATIONS)})")
    for name in _TOKEN_FIELDS:
        v = raw.get(name)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) and i >= 0 for i in ids):
            raise bad(name, "a token id (an integer >= 0), a list of them, or null")
    for name in ("tie_word_embeddings", "use_sliding_window"):
        if name in raw and not isinstance(raw[name], bool):
            raise bad(name, "true or false")


def check_config(config: Any, where: str = "the model", family: str | None = None) -> str:
    """Raise ModelLoadError for a config the compiler cannot honour; return the family.
    `family`: the config is a VLM's text model of a type of its own (`qwen2_5_vl_text`) whose
    layers are those of this family (checked as such; the family returned is its type)."""
    mt = getattr(config, "model_type", None)
    if family is not None:
        mt_family = str(mt)
    elif mt not in SUPPORTED_MODEL_TYPES:
        raise _unknown_model_type(mt, where)
    else:
        mt_family = SUPPORTED_MODEL_TYPES[mt]
    if getattr(config, "quantization_config", None):
        qc = config.quantization_config
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(
            qc, "quant_method", "?")
        raise ModelLoadError(
            f"{where} is a pre-quantized ({method}) model: toptpu reads the packed integers, "
            "scales and zero points from the checkpoint directory; pass the directory the "
            "quantizer wrote (GPTQ, AWQ and AutoRound are supported)")
    try:
        values = config.to_dict()
    except Exception:  # noqa: BLE001 - a foreign object: the checks below read attributes
        values = None
    if isinstance(values, dict):
        check_config_values(values, where)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ModelLoadError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv}; fix config.json")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
        else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelLoadError(
            f"{where} uses rope_type '{rope_type}', which recomputes its frequencies from the "
            f"sequence length at run time; toptpu compiles static shapes and honours "
            f"{', '.join(STATIC_ROPE_TYPES)}")
    layer_types = getattr(config, "layer_types", None) or []
    if (text_family(family) if family is not None else TEXT_MODEL_TYPES[str(mt)]).hybrid:
        _check_hybrid(config, where)
    elif any(t != "full_attention" for t in layer_types) or (
            getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window",
                                                                     None)):
        raise ModelLoadError(
            f"{where} uses sliding-window attention (layer_types {sorted(set(layer_types))}); "
            "toptpu's nets attend to the whole KV cache: set use_sliding_window=false or use "
            "a full-attention checkpoint")
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        raise ModelLoadError(f"{where}: pretraining_tp={config.pretraining_tp} is not supported;"
                             " set it to 1 (it only changes the order of a training-time split)")
    return mt_family


#: the linear-attention sizes of a hybrid config: name -> largest value accepted
_LINEAR_FIELDS = {"linear_conv_kernel_dim": 64, "linear_key_head_dim": 1 << 12,
                  "linear_value_head_dim": 1 << 12, "linear_num_key_heads": 1024,
                  "linear_num_value_heads": 1024}


def _check_hybrid(config: Any, where: str) -> None:
    """A Qwen3.5 config: `layer_types` one of full/linear attention per layer, with at least
    one full-attention layer (its KV cache sets the context); the linear-attention sizes
    positive (a conv kernel of at least 2), value heads a multiple of key heads."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ModelLoadError(
            f"{where}: layer_types must list 'full_attention' or 'linear_attention' for each "
            f"of the {n} layers (got {str(types)[:80]}); fix config.json")
    if "full_attention" not in types:
        raise ModelLoadError(f"{where}: no layer has full attention; toptpu's nets need one "
                             "(its KV cache is the context the model file is compiled for)")
    for name, limit in _LINEAR_FIELDS.items():
        v = getattr(config, name, None)
        low = 2 if name == "linear_conv_kernel_dim" else 1
        if not _is_int(v) or not low <= v <= limit:
            raise ModelLoadError(f"{where}: {name} is {json.dumps(v)[:40]}, expected an "
                                 f"integer from {low} to {limit}; fix config.json")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ModelLoadError(
            f"{where}: linear_num_value_heads {config.linear_num_value_heads} is not a "
            f"multiple of linear_num_key_heads {config.linear_num_key_heads}; fix config.json")


# --------------------------------------------------------------------------- checkpoint


def dir_file(path: str, name: str) -> str | None:
    """`contract.model_file_path` (a regular file inside the model directory, or None)
    with its error a ModelLoadError."""
    try:
        return model_file_path(path, name)
    except ModelDirFileError as e:
        raise ModelLoadError(str(e)) from None


def dir_bytes(path: str, name: str) -> bytes | None:
    """`contract.read_model_file` with its error a ModelLoadError."""
    try:
        return read_model_file(path, name)
    except ModelDirFileError as e:
        raise ModelLoadError(str(e)) from None


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    data = dir_bytes(path, "model.safetensors.index.json")
    if data is not None:
        try:
            weight_map = json.loads(data)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ModelLoadError(f"'{index}' is not a valid safetensors index: {e}") from e
        missing = [s for s in shards if not isinstance(s, str) or dir_file(path, s) is None]
        if missing:
            raise ModelLoadError(
                f"shard(s) {_listing(missing)} listed in '{index}' are missing from {path}: "
                "copy the complete checkpoint")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if dir_file(path, "model.safetensors"):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")
                   and dir_file(path, f))
    if found:
        return [os.path.join(path, f) for f in found]
    bins = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
    hint = (f" (found {_listing(bins)}: convert them to safetensors, e.g. load with "
            "transformers and save_pretrained(safe_serialization=True))") if bins else ""
    raise ModelLoadError(f"no *.safetensors weights in {path}{hint}")


#: safetensors dtypes a float checkpoint's tensors may have (loaded as float32)
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_tensors(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype such as 'F32') over every safetensors file
    of a checkpoint (headers only)."""
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _checkpoint_files(path):
        try:
            infos = CheckpointReader.file(file).tensors
        except CheckpointError as e:
            raise ModelLoadError(f"cannot read '{file}': {e}") from None
        for name, info in infos.items():
            if name in tensors:
                raise ModelLoadError(f"tensor '{name}' appears in more than one shard ({file})")
            tensors[name] = (info.shape, info.dtype)
    return tensors


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every safetensors file of a checkpoint (headers only)."""
    return {name: shape for name, (shape, _) in checkpoint_tensors(path).items()}


def expected_shapes(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(parameter name -> shape, names that may be absent because they are tied)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    tied: set[str] = set()
    if getattr(config, "tie_word_embeddings", False):
        out = model.get_output_embeddings()
        for k in shapes:
            if out is not None and k.startswith("lm_head."):
                tied.add(k)
    return shapes, tied


def shape_mismatches(have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]],
                     may_lack: set[str], may_add: set[str]) -> list[str]:
    """What differs between a checkpoint's tensors (`have`: name -> shape) and the model's
    parameters (`want`): missing ones (but those in `may_lack`), unexpected ones (but those
    in `may_add`) and mis-shaped ones, one phrase each, names sorted."""
    missing = sorted(k for k in want if k not in have and k not in may_lack)
    extra = sorted(k for k in have if k not in want and k not in may_add)
    bad = sorted(k for k in want if k in have and have[k] != want[k])
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    if bad:
        problems.append("mis-shaped tensors: " + _listing(
            [f"{k} is {list(have[k])}, expected {list(want[k])}" for k in bad]))
    return problems


def check_checkpoint(config: Any, path: str,
                     tensors: dict[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Compare the checkpoint's tensors (name -> (shape, safetensors dtype); default: read
    from the headers in `path`) with the model's parameters; raise on any mismatch."""
    tensors = checkpoint_tensors(path) if tensors is None else tensors
    have, expert_problems = stacked_shapes({name: shape for name, (shape, _) in
                                            tensors.items()})
    if expert_problems:
        raise ModelLoadError(f"the checkpoint in {path} does not hold its MoE experts "
                             "whole: " + "; ".join(expert_problems))
    want, optional = expected_shapes(config)
    text = text_family_of(getattr(config, "model_type", None))
    skipped = text.skipped_prefixes if text is not None else ()
    problems = shape_mismatches(
        have, want, optional, {k for k in have if k.endswith(_IGNORABLE_SUFFIXES)
                               or (skipped and k.startswith(skipped))})
    if problems:
        raise ModelLoadError(
            f"the checkpoint in {path} does not match its config.json "
            f"({config.model_type}, {config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}): " + "; ".join(problems)
            + ". Use the config.json that belongs to these weights.")
    not_float = sorted(k for k in tensors if (k in want or stacked_name(k) is not None)
                       and tensors[k][1] not in FLOAT_DTYPES)
    if not_float:
        raise ModelLoadError(
            f"the checkpoint in {path} holds weights that are not floating point: " + _listing(
                [f"{k} is {tensors[k][1]}" for k in not_float]) + f". A float checkpoint "
            f"holds {'/'.join(FLOAT_DTYPES)} tensors (nothing is cast); a quantized one "
            "declares its quantization_config (GPTQ, AWQ, AutoRound)")


# --------------------------------------------------------------------------- generation


def generation_settings(gen: Any, config: Any) -> dict[str, Any]:
    """The generation config as the runtime uses it (JSON-serializable)."""

    def get(name: str, default: Any = None) -> Any:
        v = getattr(gen, name, None) if gen is not None else None
        return default if v is None else v

    eos = get("eos_token_id", getattr(config, "eos_token_id", None))
    eos_ids = [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])
               if e is not None]
    stops = get("stop_strings", [])
    stops = [stops] if isinstance(stops, str) else [str(s) for s in stops]
    return {
        "eos_token_ids": eos_ids,
        "stop_strings": stops,
        "pad_token_id": get("pad_token_id", getattr(config, "pad_token_id", None)),
        "bos_token_id": get("bos_token_id", getattr(config, "bos_token_id", None)),
        "do_sample": bool(get("do_sample", False)),
        "temperature": float(get("temperature", 1.0)),
        "top_k": int(get("top_k", 50)),
        "top_p": float(get("top_p", 1.0)),
        "repetition_penalty": float(get("repetition_penalty", 1.0)),
    }


def _tokenizer_files_of(tokenizer: Any) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return _read_tokenizer_files(tmp, required=True, what="the tokenizer")


def check_tokenizer_files(files: dict[str, bytes], where: str) -> None:
    """The tokenizer files a model file will carry load as `toptpu run` loads them:
    tokenizer.json with the `tokenizers` library, the JSON files as JSON objects, the chat
    template as UTF-8 (a ModelLoadError naming the file otherwise, at compile time)."""
    for name, data in files.items():
        try:
            text = data.decode("utf-8")
            if name.endswith(".json") and not isinstance(parse_strict_json(data), dict):
                raise ValueError("it is not a JSON object")
            if name == "tokenizer.json":
                Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ModelLoadError(f"{os.path.join(where, name)} cannot be loaded: "
                                 f"{str(e)[:300]}; replace it with the file the model's "
                                 "tokenizer saves (save_pretrained)") from None


def _read_tokenizer_files(path: str, required: bool, what: str) -> dict[str, bytes]:
    files = {}
    for name in TOKENIZER_FILES:
        data = dir_bytes(path, name)
        if data is not None:
            files[name] = data
    check_tokenizer_files(files, path)
    if required and "tokenizer.json" not in files:
        raise ModelLoadError(
            f"{what} has no tokenizer.json: toptpu carries a fast tokenizer in the model file; "
            "load the tokenizer with transformers (AutoTokenizer, use_fast=True) and "
            "save_pretrained it next to the weights")
    return files


# --------------------------------------------------------------------------- entry point


def load_model(source: str | os.PathLike[str] | Any, tokenizer: Any = None,
               generation_config: Any = None, *, need_tokenizer: bool = True) -> LoadedModel:
    """Load a model for compilation.

    `source` is a local Hugging Face directory (read with local files only; nothing is
    downloaded) or an in-memory `transformers` causal LM (then `tokenizer` optionally gives
    its tokenizer, `generation_config` its generation config; default: the model's own).
    `need_tokenizer=False` loads a directory without tokenizer.json (stage comparisons
    need no tokenizer; a model file does).
    """
    if isinstance(source, str | os.PathLike):
        return _load_dir(os.fspath(source), need_tokenizer)
    model = source
    if not hasattr(model, "config") or not hasattr(model, "model"):
        raise ModelLoadError(
            f"expected a transformers causal LM (e.g. Qwen2ForCausalLM) or a model directory, "
            f"got {type(model).__name__}")
    family = check_config(model.config, f"the {type(model).__name__}")
    model = model.float().eval()
    gen = generation_config if generation_config is not None else getattr(
        model, "generation_config", None)
    files = _tokenizer_files_of(tokenizer) if tokenizer is not None else {}
    return LoadedModel(model, family, files, generation_settings(gen, model.config))


def check_model_dir(path: str) -> None:
    """`path` is an existing directory (a file or a missing path is named as such)."""
    if os.path.isfile(path):
        raise ModelLoadError(f"'{path}' is a file, not a model directory: pass the Hugging "
                             "Face directory that holds config.json and the weights")
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory '{path}' does not exist")
    try:  # before anything (transformers included) opens one of its files
        check_model_dir_files(path)
    except ModelDirFileError as e:
        raise ModelLoadError(str(e)) from None


def read_config(path: str) -> tuple[Any, dict[str, Any]]:
    """A model directory's config (transformers) and its raw JSON, for a supported
    model_type; nothing else of the directory is read."""
    from transformers import AutoConfig

    check_model_dir(path)
    cfg_path = os.path.join(path, "config.json")
    data = dir_bytes(path, "config.json")
    if data is None:
        raise ModelLoadError(f"{path} has no config.json: is it a Hugging Face model directory?")
    try:
        raw = parse_strict_json(data)
    except ValueError as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_path} is not a JSON object: is it a Hugging Face config?")
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise _unknown_model_type(raw.get("model_type"), cfg_path)
    check_config_values(raw, cfg_path)  # before transformers builds anything from it
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"transformers cannot read {cfg_path}: "
                             f"{one_line_reason(e)}") from e
    return config, raw


def placeholder_model(config: Any, layers: int = 1,
                      build: Callable[[Any], Any] | None = None) -> Any:
    """The causal LM of `config` with `layers` layers and placeholder weights: zeros,
    allocated lazily (untouched pages take no memory), tied weights still tied. For
    what depends on shapes alone (the compiled nets' command streams and their costs),
    without a checkpoint. `build` makes the causal LM of a config transformers has no
    causal-LM class for (a VLM's text model; default `AutoModelForCausalLM`)."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:layers]
    with torch.device("meta"):
        model = build(cfg) if build is not None else AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32)
    zeros: dict[int, torch.nn.Parameter] = {}  # by the meta parameter: ties stay ties
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):  # noqa: SLF001 - re-materialized
            if p is None:
                continue
            if id(p) not in zeros:
                zeros[id(p)] = torch.nn.Parameter(
                    torch.from_numpy(np.zeros(tuple(p.shape), np.float32)), requires_grad=False)
            mod._parameters[name] = zeros[id(p)]  # noqa: SLF001
    rotary = model.model.rotary_emb  # its buffers are computed, not loaded: make them real
    model.model.rotary_emb = type(rotary)(config=cfg)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ModelLoadError(f"a placeholder {cfg.model_type} model has buffers toptpu does not "
                             f"know how to make: {left[:3]}")
    return model.eval()


@dataclass
class ModelDir:
    """What a model directory says besides its weights."""

    path: str
    raw: dict[str, Any]  # config.json as read
    config: Any  # the transformers config
    generation: Any  # transformers GenerationConfig or None

    @property
    def prequantized(self) -> bool:
        return _is_prequantized(self.path, self.raw)


def read_model_dir(path: str) -> ModelDir:
    """Read and check a model directory's config.json and generation config (not its
    weights, not its tokenizer: `tokenizer_files`, once the weights are checked)."""
    config, raw = read_config(path)
    return ModelDir(path, raw, config, read_generation_config(path))


def read_generation_config(path: str) -> Any:
    """The directory's generation_config.json as transformers reads it, None without one."""
    from transformers import GenerationConfig

    if not dir_file(path, "generation_config.json"):
        return None
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read {path}/generation_config.json: {e}") from e


def tokenizer_files(path: str, need_tokenizer: bool = True) -> dict[str, bytes]:
    """The tokenizer files of a model directory (tokenizer.json required unless
    `need_tokenizer` is False)."""
    return _read_tokenizer_files(path, required=need_tokenizer, what=path)


def _load_dir(path: str, need_tokenizer: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    d = read_model_dir(path)
    config = d.config
    if d.prequantized:
        return _load_prequantized(d, need_tokenizer)
    family = check_config(config, os.path.join(path, "config.json"))
    check_checkpoint(config, path)
    files = tokenizer_files(path, need_tokenizer)
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, config=config,
                                                         dtype=torch.float32,
                                                         local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"transformers could not load the weights in {path}: {e}") from e
    return LoadedModel(model.eval(), family, files, generation_settings(d.generation, config),
                       path)


# --------------------------------------------------------------------------- pre-quantized


def _is_prequantized(path: str, raw: dict[str, Any]) -> bool:
    return bool(raw.get("quantization_config")) or any(
        dir_file(path, n)
        for n in ("quantize_config.json", "quantization_config.json"))


def check_prequantized_shapes(have: dict[str, tuple[int, ...]],
                              want: dict[str, tuple[int, ...]], tied: set[str], method: str,
                              path: str) -> None:
    """The dequantized state of a pre-quantized checkpoint (`have`: name -> shape) against
    the model's parameters (`want`; `tied` may be absent): missing, unexpected or
    mis-shaped tensors are a ModelLoadError."""
    problems = shape_mismatches(have, want, tied, set())
    if problems:
        raise ModelLoadError(f"the {method} checkpoint in {path} does not match its "
                             f"config: {'; '.join(problems)}")


def _load_prequantized(d: ModelDir, need_tokenizer: bool = True) -> LoadedModel:
    """A GPTQ / AWQ / AutoRound checkpoint: read its packed tensors (nothing re-quantized),
    build the float model from the exactly dequantized weights (Top and the float reference
    see those), and keep the checkpoint for the lowering to use its integers as they are."""
    from transformers import AutoModelForCausalLM

    path, raw, config = d.path, d.raw, d.config
    try:
        ck = read_quantized_checkpoint(path)
    except QuantizedCheckpointError as e:
        raise ModelLoadError(str(e)) from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    family = check_config(config, os.path.join(path, "config.json"))
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    check_prequantized_shapes(ck.state_shapes(),
                              {k: tuple(v.shape) for k, v in model.state_dict().items()},
                              tied, ck.quant_method, path)
    state = ck.dequantized_state_dict()
    with torch.no_grad():
        model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32))
                               for k, v in state.items()}, strict=False)
        if "lm_head.weight" in tied:
            model.tie_weights()
    files = tokenizer_files(path, need_tokenizer)
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return LoadedModel(model.eval(), family, files,
                       generation_settings(d.generation, config), path,
                       checkpoint=ck, checkpoint_dtype=str(dtype) if dtype else None)
