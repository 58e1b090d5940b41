"""Readers for pre-quantized checkpoints: GPTQ, AWQ and AutoRound.

`read_quantized_checkpoint(model_dir)` reads a Hugging Face model directory (``config.json``
plus ``*.safetensors``, optionally sharded by ``model.safetensors.index.json``) whose
``quantization_config`` names a weight-only integer format, and returns every quantized
linear layer in one canonical, unpacked form (`QuantizedLinear`) next to the tensors that
stayed in floating point. `QuantizedLinear.dequantize` reproduces, bit-exactly in float32,
the weight the producing library defines: ``(q - zero) * scale`` with the scale stored in
its checkpoint dtype and cast to float32.

`open_quantized_checkpoint(model_dir, reader)` does every check of the same reader without
holding the tensors (a streaming compile): each quantized linear is checked from the shard
headers (`CheckpointReader`: fields, dtypes, shapes) and its small tensors (zero points,
g_idx) and described by a `QuantizedLayout`; `QuantizedCheckpoint.linear(name)` reads and
unpacks its integers when asked for. Both go through the one `_LayerReader`.

On-disk layouts (``K`` = in_features, ``N`` = out_features, ``G`` = number of groups,
``p = 32 // bits`` values per int32 word, value ``i`` of a word in bits
``[i*bits, (i+1)*bits)``):

GPTQ layout (AutoGPTQ / GPTQModel / optimum; AutoRound ``auto_round:auto_gptq``, plain
``auto_round`` and ``auto_round:gptqmodel``)
    ``qweight`` int32 ``[K / p, N]``: packed along K (rows); input channel ``k`` of output
    ``n`` is value ``k % p`` of ``qweight[k // p, n]``.
    ``qzeros``  int32 ``[G, N / p]``: packed along N (columns), value ``n % p`` of
    ``qzeros[g, n // p]``.
    ``scales``  float ``[G, N]``; ``bias`` ``[N]`` (optional).
    ``g_idx``   int32 ``[K]`` (optional): the group of each input channel. With act-order
    (``desc_act``) GPTQ quantizes channels in a permuted order, so groups are not
    contiguous ranges of K; the weights stay stored in the original channel order.
    Zero-point offset: GPTQ "v1" (``checkpoint_format`` ``gptq``, the default, AutoGPTQ and
    ``auto_round:auto_gptq``) stores ``zero - 1``; ``gptq_v2`` (GPTQModel), plain
    ``auto_round`` and ``auto_round:gptqmodel`` store the zero itself. (v1 cannot hold a
    zero of 0; auto-round's packer clamps the stored value to 0, i.e. zero 1. The reader
    decodes what is stored, as every GPTQ kernel does.)

AWQ GEMM layout (AutoAWQ ``version: gemm``; AutoRound ``auto_round:auto_awq``), 4-bit only
    ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``: both packed along N,
    with the columns of each word interleaved: nibble ``i`` (bits ``4i..4i+3``) of word
    ``j`` holds column ``8j + order[i]`` for ``order = 0, 2, 4, 6, 1, 3, 5, 7`` (equivalently
    column ``8j + c`` sits in nibble ``AWQ_PACK_ORDER[c]``, ``AWQ_PACK_ORDER = 0,4,1,5,2,6,3,7``).
    ``scales`` float ``[G, N]``; zeros are stored as is (no offset); no ``g_idx``.

Which layers are quantized is read from the tensors (a module with a ``qweight``), and
cross-checked with the configuration: GPTQ ``dynamic`` (``+:regex`` per-layer overrides,
``-:regex`` layers left in float), ``modules_in_block_to_quantize`` and ``lm_head``; AWQ
``modules_to_not_convert``; AutoRound ``extra_config`` (per-layer ``bits``/``group_size``/
``sym``, ``bits >= 16`` meaning "left at full precision"). Anything the reader cannot
decode exactly is a `QuantizedCheckpointError` naming the layer, the field and what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader

__all__ = [
    "AWQ_PACK_ORDER",
    "QuantizedCheckpoint",
    "QuantizedCheckpointError",
    "QuantizedLayout",
    "QuantizedLinear",
    "ReaderSource",
    "SUPPORTED_BITS",
    "open_quantized_checkpoint",
    "read_quantized_checkpoint",
    "unpack_awq_columns",
    "unpack_int32_columns",
    "unpack_int32_rows",
]

#: bit widths the readers decode (one value never straddles an int32 word)
SUPPORTED_BITS: tuple[int, ...] = (4, 8)

#: AWQ GEMM packing: column ``c`` (0..7) of a group of eight sits in nibble ``AWQ_PACK_ORDER[c]``
AWQ_PACK_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)

#: tensor fields of one quantized module, per layout
_GPTQ_FIELDS = frozenset({"qweight", "qzeros", "scales", "g_idx", "bias"})
_AWQ_FIELDS = frozenset({"qweight", "qzeros", "scales", "bias"})
#: field names that only occur in quantized modules (GPTQ/AWQ and exllama/marlin layouts)
_QUANT_ONLY_FIELDS = frozenset(
    {
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "q_perm",
        "q_invperm",
        "q_scale",
        "q_scale_max",
        "q_groups",
        "q_group_map",
    }
)

_SUPPORTED_QUANT_METHODS = ("gptq", "awq", "auto-round")
_AUTOROUND_GPTQ_V1 = ("auto_round:auto_gptq", "auto_round:gptq", "auto")
_AUTOROUND_GPTQ_V2 = ("auto_round", "auto_round:gptqmodel")
_AUTOROUND_AWQ = ("auto_round:auto_awq", "auto_round:awq")

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint that cannot be read exactly; the message names what and why."""


# --------------------------------------------------------------------------------------------
# canonical form


@dataclass
class QuantizedLinear:
    """One weight-only quantized linear layer, unpacked (``y = x @ W.T + bias``).

    ``qweight[n, k]`` is the integer of output ``n``, input channel ``k``; its group is
    ``g_idx[k]`` when act-order permuted the groups, else ``k // group_size``.
    ``zeros`` are the real zero points: the format's offset (GPTQ v1 stores ``zero - 1``)
    is already resolved. They are uint8 unless a GPTQ v1 word decodes to 256 (int32 then).
    """

    name: str
    bits: int
    group_size: int
    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray | None
    bias: np.ndarray | None
    sym: bool

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[1])

    def group_index(self) -> np.ndarray:
        """int64 ``[K]``: the group of every input channel."""
        if self.g_idx is not None:
            return self.g_idx.astype(np.int64)
        return np.arange(self.in_features, dtype=np.int64) // self.group_size

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]`` = ``(q - zero) * scale``, scale cast from its stored dtype.

        This is the float32 weight GPTQ/AWQ/AutoRound define (and AutoRound's fake-quantized
        export writes): the integer difference is exact in float32, the product rounds once.
        """
        groups = self.group_index()
        q = self.qweight.astype(np.float32)
        z = self.zeros.astype(np.float32)[:, groups]
        s = self.scales.astype(np.float32)[:, groups]
        return (q - z) * s


@dataclass
class QuantizedCheckpoint:
    """A pre-quantized HF checkpoint: config, float tensors and quantized linears by name."""

    model_dir: Path
    config: dict[str, Any]
    quantization_config: dict[str, Any]
    #: normalised: "gptq", "awq" or "auto-round"
    quant_method: str
    #: on-disk layout: "gptq" (v1 zero offset), "gptq_v2", "awq_gemm",
    #: or AutoRound's packing_format ("auto_round:auto_gptq", "auto_round", ...)
    packing_format: str
    float_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)
    #: every quantized linear, checked, by module path (known before its integers are read)
    layouts: dict[str, QuantizedLayout] = field(default_factory=dict)
    #: the checkpoint tensors that are not part of a quantized linear
    float_names: list[str] = field(default_factory=list)
    #: where the tensors are read from (`linear`)
    source: TensorSource | None = None
    desc_act: bool = False

    def linear(self, name: str) -> QuantizedLinear | None:
        """The quantized linear `name` (a module path), unpacked: the one in `linears`, else
        read from `source` now; None for a module that is not quantized."""
        if name in self.linears:
            return self.linears[name]
        layout = self.layouts.get(name)
        if layout is None:
            return None
        if self.source is None:
            raise QuantizedCheckpointError(f"{self.model_dir}: layer '{name}' has no tensors")
        return _LayerReader(
            self.model_dir, self.packing_format, name, layout.tensors, self.source, self.desc_act
        ).read(layout)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of `dequantized_state_dict` (of an opened checkpoint, from the shard
        headers: nothing is read)."""
        source = self.source
        shapes = {name: tuple(int(d) for d in self.float_tensors[name].shape)
                  if source is None else source.spec(name)[0] for name in self.float_names}
        for name, layout in self.layouts.items():
            shapes[f"{name}.weight"] = (layout.out_features, layout.in_features)
            if "bias" in layout.tensors:
                shapes[f"{name}.bias"] = (layout.out_features,)
        return shapes

    def dequantized_state_dict(self) -> dict[str, np.ndarray]:
        """Float tensors plus ``<layer>.weight`` (float32) and ``<layer>.bias`` of every linear."""
        out = dict(self.float_tensors)
        for name, lin in self.linears.items():
            out[f"{name}.weight"] = lin.dequantize()
            if lin.bias is not None:
                out[f"{name}.bias"] = lin.bias
        return out


# --------------------------------------------------------------------------------------------
# bit unpacking


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not one of {SUPPORTED_BITS}")


def unpack_int32_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R * 32 // bits, C]``: value ``i`` of word ``[r, c]`` is row
    ``r * (32 // bits) + i`` (the GPTQ ``qweight`` layout, packed along K)."""
    _check_bits(bits)
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    vals = (words[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(words.shape[0] * per, words.shape[1]).astype(np.uint8)


def unpack_int32_columns(packed: np.ndarray, bits: int) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R, C * 32 // bits]``: value ``i`` of word ``[r, c]`` is column
    ``c * (32 // bits) + i`` (the GPTQ ``qzeros`` layout, packed along N)."""
    _check_bits(bits)
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(words.shape[0], words.shape[1] * per).astype(np.uint8)


def unpack_awq_columns(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R, C * 8]`` for the AWQ GEMM layout (4-bit): column
    ``8c + j`` is the nibble ``AWQ_PACK_ORDER[j]`` of word ``[r, c]``."""
    if bits != 4:
        raise ValueError(f"the AWQ GEMM layout is defined for 4 bits, not {bits}")
    nibbles = unpack_int32_columns(packed, 4).reshape(packed.shape[0], packed.shape[1], 8)
    return nibbles[:, :, list(AWQ_PACK_ORDER)].reshape(packed.shape[0], packed.shape[1] * 8)


# --------------------------------------------------------------------------------------------
# files


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise QuantizedCheckpointError(
            f"{path}: not valid JSON ({e}); fix or re-export the file"
        ) from e
    if not isinstance(data, dict):
        raise QuantizedCheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QuantizedCheckpointError(
                f"{index}: no 'weight_map'; the shard index is damaged, re-export the checkpoint"
            )
        files = []
        for fname in dict.fromkeys(weight_map.values()):
            path = model_dir / str(fname)
            if not path.is_file():
                raise QuantizedCheckpointError(
                    f"{index}: shard '{fname}' is listed but missing from {model_dir}; "
                    "copy the complete checkpoint"
                )
            files.append(path)
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        hint = f" (found {', '.join(other)}: convert them to safetensors)" if other else ""
        raise QuantizedCheckpointError(f"{model_dir}: no *.safetensors weights{hint}")
    return files


def _read_file(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as read-only views of the mapped file, in their
    stored dtypes (bfloat16 as ml_dtypes.bfloat16)."""
    reader = CheckpointReader.file(str(path))
    return {key: reader.tensor(key) for key in reader.names()}


def _load_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    index_path = model_dir / "model.safetensors.index.json"
    expected: dict[str, str] | None = None
    if index_path.is_file():
        expected = {str(k): str(v) for k, v in _load_json(index_path)["weight_map"].items()}
    tensors: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for path in _safetensors_files(model_dir):
        try:
            part = _read_file(path)
        except CheckpointError as e:
            raise QuantizedCheckpointError(f"{path}: {e}") from None
        for key, t in part.items():
            if key in tensors:
                raise QuantizedCheckpointError(
                    f"{model_dir}: tensor '{key}' is stored twice ({where[key]} and "
                    f"{path.name}); remove the stale file"
                )
            tensors[key] = t
            where[key] = path.name
    if expected is not None:
        missing = sorted(k for k in expected if k not in tensors)
        if missing:
            raise QuantizedCheckpointError(
                f"{index_path}: {len(missing)} tensor(s) listed in the index are in no shard "
                f"(first: '{missing[0]}' expected in {expected[missing[0]]}); the checkpoint is "
                "incomplete"
            )
    return tensors


def _read_quantization_config(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise QuantizedCheckpointError(
                f"{model_dir / 'config.json'}: 'quantization_config' must be an object"
            )
        return dict(qc)
    for fname in ("quantization_config.json", "quantize_config.json"):
        path = model_dir / fname
        if path.is_file():
            qc = _load_json(path)
            # quantize_config.json is AutoGPTQ's file: it predates the quant_method key
            if fname == "quantize_config.json" and "quant_method" not in qc:
                qc["quant_method"] = "gptq"
            return qc
    raise QuantizedCheckpointError(
        f"{model_dir}: no 'quantization_config' in config.json and no quantization_config.json "
        "or quantize_config.json beside it; this is not a pre-quantized checkpoint (load it as a "
        "float model, or add the quantization config the producer wrote)"
    )


# --------------------------------------------------------------------------------------------
# per-layer configuration


@dataclass(frozen=True)
class _LayerScheme:
    bits: int
    group_size: int
    sym: bool
    source: str = "quantization_config"


def _normalize_quant_method(model_dir: Path, qc: Mapping[str, Any]) -> str:
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method in ("auto-round", "intel/auto-round"):
        return "auto-round"
    if method in ("gptq", "awq"):
        return method
    raise QuantizedCheckpointError(
        f"{model_dir}: quantization_config.quant_method={qc.get('quant_method')!r} is not "
        f"supported; supported: {', '.join(_SUPPORTED_QUANT_METHODS)} (convert the checkpoint to "
        "one of them, or load the float model and quantize it with -q)"
    )


def _require(model_dir: Path, qc: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in qc and qc[key] is not None:
            return qc[key]
    raise QuantizedCheckpointError(
        f"{model_dir}: quantization_config has no '{keys[0]}'; it is required to decode the "
        "packed weights (add it as the producer set it)"
    )


class _SchemeResolver:
    """Answers "how is layer X quantized (or is it float)?" from the quantization_config."""

    def __init__(self, model_dir: Path, method: str, qc: Mapping[str, Any]):
        self.model_dir = model_dir
        self.method = method
        self.qc = qc
        if method == "awq":
            bits = _require(model_dir, qc, "bits", "w_bit")
            group_size = _require(model_dir, qc, "group_size", "q_group_size")
            zero_point = qc.get("zero_point", True)
            sym = bool(qc["sym"]) if "sym" in qc else not zero_point
        else:
            bits = _require(model_dir, qc, "bits")
            group_size = _require(model_dir, qc, "group_size")
            sym = bool(_require(model_dir, qc, "sym"))
        self.default = _LayerScheme(int(bits), int(group_size), sym)
        self.dynamic: list[tuple[str, re.Pattern[str], dict[str, Any]]] = []
        if method == "gptq":
            for key, override in (qc.get("dynamic") or {}).items():
                sign, pattern = (
                    ("-", key[2:])
                    if key.startswith("-:")
                    else (("+", key[2:]) if key.startswith("+:") else ("+", key))
                )
                self.dynamic.append((sign, self._compile(pattern, "dynamic"), dict(override or {})))
        self.extra: dict[str, dict[str, Any]] = {}
        if method == "auto-round":
            self.extra = {str(k): dict(v or {}) for k, v in (qc.get("extra_config") or {}).items()}
        self.not_convert = [str(m) for m in (qc.get("modules_to_not_convert") or [])]
        mib = qc.get("modules_in_block_to_quantize")
        self.modules_in_block: list[str] | None = None
        if mib:
            flat: list[str] = []
            for item in mib:
                flat.extend(item if isinstance(item, list) else [item])
            self.modules_in_block = [str(m) for m in flat]
        # blocks (e.g. "model.layers") whose linears the default scheme covers
        blocks = qc.get("block_name_to_quantize") or qc.get("to_quant_block_names")
        if isinstance(blocks, str):
            blocks = blocks.split(",")
        self.blocks: list[str] = []
        for item in blocks or []:
            self.blocks.extend(item if isinstance(item, list) else [item])
        self.blocks = [str(b).strip() for b in self.blocks if str(b).strip()]

    def _outside_blocks(self, layer: str) -> bool:
        return bool(self.blocks) and not any(layer.startswith(b + ".") for b in self.blocks)

    def _compile(self, pattern: str, field_name: str) -> re.Pattern[str]:
        try:
            return re.compile(pattern)
        except re.error as e:
            raise QuantizedCheckpointError(
                f"{self.model_dir}: quantization_config.{field_name} pattern {pattern!r} is not a "
                f"valid regular expression ({e}); fix the config"
            ) from e

    def _scheme(self, override: Mapping[str, Any], layer: str, source: str) -> _LayerScheme | None:
        bits = int(override.get("bits", self.default.bits))
        if bits >= 16:
            return None
        data_type = str(override.get("data_type", self.qc.get("data_type", "int")))
        if not data_type.startswith("int"):
            raise QuantizedCheckpointError(
                f"{self.model_dir}: layer '{layer}', field 'data_type': {data_type!r} (from "
                f"{source}) is not an integer format; only int weight-only quantization is read"
            )
        act_bits = override.get("act_bits", self.qc.get("act_bits"))
        if act_bits is not None and int(act_bits) < 16:
            raise QuantizedCheckpointError(
                f"{self.model_dir}: layer '{layer}', field 'act_bits': activations quantized to "
                f"{act_bits} bits (from {source}); only weight-only checkpoints (act_bits 16) are "
                "supported"
            )
        return _LayerScheme(
            bits,
            int(override.get("group_size", self.default.group_size)),
            bool(override.get("sym", self.default.sym)),
            source,
        )

    def resolve(self, layer: str, known_layers: Iterable[str]) -> tuple[_LayerScheme | None, str]:
        """(scheme or None for float, where the decision came from)."""
        if self.method == "gptq":
            for sign, pattern, override in self.dynamic:
                if pattern.match(layer):
                    if sign == "-":
                        return None, f"dynamic '-:{pattern.pattern}'"
                    where = f"dynamic '+:{pattern.pattern}'"
                    return self._scheme(override, layer, where), where
            if layer.split(".")[-1] == "lm_head":
                if not self.qc.get("lm_head", False):
                    return None, "lm_head: false"
                return self._scheme({}, layer, "quantization_config"), "lm_head: true"
            if self._outside_blocks(layer):
                return None, f"block_name_to_quantize {self.blocks}"
            if self.modules_in_block is not None and not any(
                re.search(m, layer) for m in self.modules_in_block
            ):
                return None, "modules_in_block_to_quantize"
            return self._scheme({}, layer, "quantization_config"), "quantization_config"
        if self.method == "awq":
            for m in self.not_convert:
                if m in layer:
                    return None, f"modules_to_not_convert '{m}'"
            return self._scheme({}, layer, "quantization_config"), "quantization_config"
        # auto-round: exact names first, then regex keys (re.search, as auto-round does)
        known = set(known_layers)
        if layer in self.extra:
            where = f"extra_config['{layer}']"
            return self._scheme(self.extra[layer], layer, where), where
        for key, override in self.extra.items():
            if key in known:
                continue
            if self._compile(key, "extra_config").search(layer):
                where = f"extra_config['{key}']"
                return self._scheme(override, layer, where), where
        for m in self.not_convert:
            if m in layer:
                return None, f"modules_to_not_convert '{m}'"
        if self._outside_blocks(layer):
            return None, f"block_name_to_quantize {self.blocks}"
        return self._scheme({}, layer, "quantization_config"), "quantization_config"


# --------------------------------------------------------------------------------------------
# layouts


def _packing_format(model_dir: Path, method: str, qc: Mapping[str, Any]) -> str:
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizedCheckpointError(
                f"{model_dir}: quantization_config.checkpoint_format={fmt!r} is a kernel-specific "
                "(exllama/marlin/bitblas-style) layout that cannot be decoded here; re-export the "
                "model in checkpoint_format 'gptq' or 'gptq_v2'"
            )
        return fmt
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizedCheckpointError(
                f"{model_dir}: quantization_config.version={qc.get('version')!r}: only the AWQ "
                "'gemm' layout is supported (gemv/gemv_fast/exllama/marlin/ipex layouts are "
                "kernel-specific); re-export with version 'gemm'"
            )
        if not qc.get("zero_point", True):
            raise QuantizedCheckpointError(
                f"{model_dir}: quantization_config.zero_point=false: AWQ gemm checkpoints without "
                "zero points are not supported; re-export with zero_point=true"
            )
        return "awq_gemm"
    fmt = qc.get("packing_format")
    if fmt is None:
        raise QuantizedCheckpointError(
            f"{model_dir}: AutoRound quantization_config has no 'packing_format'; set it to one "
            f"of {', '.join(_AUTOROUND_GPTQ_V1 + _AUTOROUND_GPTQ_V2 + _AUTOROUND_AWQ)}"
        )
    fmt = str(fmt)
    if fmt not in _AUTOROUND_GPTQ_V1 + _AUTOROUND_GPTQ_V2 + _AUTOROUND_AWQ:
        raise QuantizedCheckpointError(
            f"{model_dir}: AutoRound packing_format={fmt!r} is not supported; supported: "
            f"{', '.join(_AUTOROUND_GPTQ_V1 + _AUTOROUND_GPTQ_V2 + _AUTOROUND_AWQ)} (re-export "
            "with format auto_round, auto_gptq or auto_awq)"
        )
    return fmt


def _is_awq_layout(fmt: str) -> bool:
    return fmt == "awq_gemm" or fmt in _AUTOROUND_AWQ


def _stores_zero_minus_one(fmt: str) -> bool:
    return fmt == "gptq" or fmt in _AUTOROUND_GPTQ_V1


class TensorSource(Protocol):
    """The tensors of a checkpoint by name: their shape and dtype from the header alone,
    their values on demand (`release` lets go of what was read)."""

    def names(self) -> Iterable[str]: ...

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]: ...

    def array(self, name: str) -> np.ndarray: ...

    def release(self) -> None: ...


class _DictSource:
    """Tensors already in memory (`_load_tensors`)."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        t = self.tensors[name]
        return tuple(int(d) for d in t.shape), t.dtype

    def array(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def release(self) -> None:
        pass


class ReaderSource:
    """The memory-mapped shards of a `CheckpointReader`: a tensor is read when asked for, and
    `release` drops its pages from the resident set (a streaming compile)."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

    def names(self) -> Iterable[str]:
        return self.reader.names()

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        info = self.reader.info(name)
        return info.shape, info.numpy_dtype

    def array(self, name: str) -> np.ndarray:
        try:
            return self.reader.tensor(name)
        except CheckpointError as e:
            raise QuantizedCheckpointError(str(e)) from e

    def release(self) -> None:
        self.reader.release()


@dataclass(frozen=True)
class QuantizedLayout:
    """What a quantized linear is, checked before its integers are read: its scheme, its
    shape (``K`` in, ``N`` out), whether act-order permutes its groups (a ``g_idx`` that is
    not ``k // group_size``) and the checkpoint tensors of its fields."""

    name: str
    bits: int
    group_size: int
    sym: bool
    in_features: int
    out_features: int
    act_order: bool
    #: field ("qweight", "qzeros", "scales", "g_idx", "bias") -> checkpoint tensor name
    tensors: Mapping[str, str]
    source: str = "quantization_config"  # where the scheme came from

    @property
    def scheme(self) -> _LayerScheme:
        return _LayerScheme(self.bits, self.group_size, self.sym, self.source)


class _LayerReader:
    """One quantized linear's tensors: `layout` checks everything the headers say (fields,
    dtypes, shapes against bits and group size) and the small tensors' values (zero points,
    g_idx); `read` then unpacks its integers."""

    def __init__(
        self,
        model_dir: Path,
        fmt: str,
        layer: str,
        tensors: Mapping[str, str],
        source: TensorSource,
        desc_act: bool = False,
    ):
        self.model_dir = model_dir
        self.desc_act = desc_act
        self.fmt = fmt
        self.layer = layer
        self.tensors = tensors
        self.source = source

    def error(self, fld: str, problem: str, fix: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(
            f"{self.model_dir}: layer '{self.layer}', field '{fld}': {problem}; {fix}"
        )

    def spec(
        self, fld: str, dtypes: tuple[np.dtype, ...], what: str
    ) -> tuple[tuple[int, ...], np.dtype]:
        if fld not in self.tensors:
            raise self.error(
                fld,
                f"tensor '{self.layer}.{fld}' is missing (a {self.fmt} layer needs {what})",
                "the checkpoint is incomplete or not in this format; re-export it",
            )
        shape, dtype = self.source.spec(self.tensors[fld])
        if dtype not in dtypes:
            raise self.error(
                fld,
                f"dtype {dtype} (expected {' or '.join(str(d) for d in dtypes)})",
                "the tensor is not in the layout the config names; re-export the checkpoint",
            )
        return shape, dtype

    def array(self, fld: str) -> np.ndarray:
        return self.source.array(self.tensors[fld])

    def shape(self, fld: str, shape: tuple[int, ...], expected: tuple[int, ...], why: str) -> None:
        if tuple(shape) != expected:
            raise self.error(
                fld,
                f"shape {list(shape)} but {why} requires {list(expected)}",
                "the tensor is mis-shaped for the configured bits/group_size; check the config or "
                "re-export the checkpoint",
            )

    def layout(self, scheme: _LayerScheme) -> QuantizedLayout:
        """Check the layer (see the class doc) and say what it is."""
        bits = scheme.bits
        if bits not in SUPPORTED_BITS:
            raise self.error(
                "bits",
                f"{bits}-bit weights (from {scheme.source}) are not supported (supported: "
                f"{', '.join(map(str, SUPPORTED_BITS))})",
                "re-quantize the model to 4 or 8 bits",
            )
        awq = _is_awq_layout(self.fmt)
        if awq and bits != 4:
            raise self.error(
                "bits", f"{bits}-bit in the AWQ gemm layout", "AWQ gemm is defined for 4 bits only"
            )
        allowed = _AWQ_FIELDS if awq else _GPTQ_FIELDS
        extra = sorted(set(self.tensors) - allowed)
        if extra:
            raise self.error(
                extra[0],
                f"unexpected tensor(s) {', '.join(extra)} next to qweight (a kernel-specific, e.g. "
                "exllama or marlin, layout, or a float weight left beside the packed one)",
                f"only {', '.join(sorted(allowed))} are read for {self.fmt}; re-export the "
                "checkpoint in the plain layout",
            )
        int32 = (np.dtype(np.int32), np.dtype(np.uint32))
        per = 32 // bits
        qweight, _ = self.spec("qweight", int32, "a packed int32 qweight")
        qzeros, _ = self.spec("qzeros", int32, "packed int32 zero points")
        scales, _ = self.spec("scales", _FLOAT_DTYPES, "float scales")
        if len(qweight) != 2:
            raise self.error("qweight", f"{len(qweight)}-d tensor", "expected a 2-d int32 tensor")
        if awq:
            k, n = int(qweight[0]), int(qweight[1]) * per
        else:
            k, n = int(qweight[0]) * per, int(qweight[1])
        gs = k if scheme.group_size in (-1, 0) else scheme.group_size
        if gs <= 0:
            raise self.error("group_size", f"{scheme.group_size}", "group_size must be -1 or > 0")
        has_g_idx = "g_idx" in self.tensors
        if not has_g_idx and self.desc_act:
            raise self.error(
                "g_idx",
                f"desc_act=true (act-order) but tensor '{self.layer}.g_idx' is missing",
                "act-order groups cannot be reconstructed without g_idx; re-export the checkpoint",
            )
        if not has_g_idx and k % gs:
            raise self.error(
                "group_size",
                f"group size {gs} does not divide in_features {k}",
                "the config does not match the tensors; fix group_size",
            )
        groups = math.ceil(k / gs)
        self.shape("scales", scales, (groups, n), f"in_features {k}, group_size {gs}, out {n}")
        self.shape(
            "qzeros", qzeros, (groups, n // per), f"{groups} groups, {n} outputs at {bits} bits"
        )
        layout = QuantizedLayout(
            self.layer, bits, gs, scheme.sym, k, n, False, dict(self.tensors), scheme.source
        )
        self.zeros(layout)
        act_order = self.g_idx(layout) is not None
        if "bias" in self.tensors:
            bias, dtype = self.source.spec(self.tensors["bias"])
            if dtype not in _FLOAT_DTYPES:
                raise self.error("bias", f"dtype {dtype}", "bias must be a float tensor")
            self.shape("bias", bias, (n,), f"out_features {n}")
        return replace(layout, act_order=act_order)

    def zeros(self, layout: QuantizedLayout) -> np.ndarray:
        """The real zero points ``[N, G]`` (the format's offset resolved), checked against
        ``sym``."""
        bits = layout.bits
        qzeros = self.array("qzeros")
        if _is_awq_layout(self.fmt):
            zeros = unpack_awq_columns(qzeros, bits).T
        else:
            zeros = unpack_int32_columns(qzeros, bits).T
        zeros = np.ascontiguousarray(zeros)
        if _stores_zero_minus_one(self.fmt):
            z = zeros.astype(np.int32) + 1
            zeros = z.astype(np.uint8) if int(z.max(initial=0)) <= 255 else z

        if layout.sym and not np.all(zeros == (1 << (bits - 1))):
            bad = np.argwhere(zeros != (1 << (bits - 1)))[0]
            raise self.error(
                "qzeros",
                f"sym=true but zero point [{bad[0]}, {bad[1]}] is {int(zeros[bad[0], bad[1]])}, "
                f"not {1 << (bits - 1)} (wrong zero-point offset convention for "
                f"'{self.fmt}'?)",
                "check checkpoint_format/packing_format (gptq stores zero-1, gptq_v2 and plain "
                "auto_round store the zero) and sym in the config",
            )
        return zeros

    def g_idx(self, layout: QuantizedLayout) -> np.ndarray | None:
        """int32 ``[K]``: the group of each input channel when act-order permutes them (None
        when the groups are contiguous)."""
        if "g_idx" not in self.tensors:
            return None
        k, gs = layout.in_features, layout.group_size
        groups = math.ceil(k / gs)
        g_idx_raw = self.array("g_idx")
        if g_idx_raw.dtype.kind not in "iu":
            raise self.error("g_idx", f"dtype {g_idx_raw.dtype}", "g_idx must be integer")
        self.shape("g_idx", g_idx_raw.shape, (k,), f"in_features {k}")
        gi = g_idx_raw.astype(np.int64)
        if gi.size and (gi.min() < 0 or gi.max() >= groups):
            raise self.error(
                "g_idx",
                f"group indices span [{gi.min()}, {gi.max()}] but there are {groups} groups",
                "g_idx does not match scales/qzeros; re-export the checkpoint",
            )
        if np.array_equal(gi, np.arange(k) // gs):
            return None
        return gi.astype(np.int32)

    def read(self, layout: QuantizedLayout) -> QuantizedLinear:
        """The layer's tensors, unpacked (`layout` as `layout()` made it)."""
        qweight = self.array("qweight")
        if _is_awq_layout(self.fmt):
            q = unpack_awq_columns(qweight, layout.bits).T
        else:
            q = unpack_int32_rows(qweight, layout.bits).T
        bias = self.array("bias") if "bias" in self.tensors else None
        return QuantizedLinear(
            name=self.layer,
            bits=layout.bits,
            group_size=layout.group_size,
            qweight=np.ascontiguousarray(q),
            scales=np.ascontiguousarray(self.array("scales").T),
            zeros=self.zeros(layout),
            g_idx=self.g_idx(layout),
            bias=None if bias is None else np.array(bias),
            sym=layout.sym,
        )


# --------------------------------------------------------------------------------------------
# entry points


def _root_and_config(model_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    root = Path(model_dir)
    if not root.is_dir():
        raise QuantizedCheckpointError(f"{root}: not a directory (expected a HF model directory)")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise QuantizedCheckpointError(
            f"{root}: no config.json; not a Hugging Face model directory"
        )
    return root, _load_json(config_path)


def read_quantized_checkpoint(model_dir: str | os.PathLike[str]) -> QuantizedCheckpoint:
    """Read a GPTQ / AWQ / AutoRound checkpoint directory into `QuantizedCheckpoint`, every
    tensor in memory (`linears`, `float_tensors`).

    Raises `QuantizedCheckpointError` (naming the layer, the field and the remedy) for
    anything that cannot be decoded exactly: unknown ``quant_method``, unsupported bits or
    packing layout, missing / mis-shaped / unexpected tensors, a config that contradicts
    the tensors.
    """
    root, config = _root_and_config(model_dir)
    ck = _open(root, config, lambda: _DictSource(_load_tensors(root)))
    for name in ck.layouts:
        ck.linears[name] = ck.linear(name)
    ck.float_tensors = {name: ck.source.array(name) for name in ck.float_names}
    ck.source = None  # the packed integers go: `linears` holds them unpacked
    return ck


def open_quantized_checkpoint(
    model_dir: str | os.PathLike[str], reader: CheckpointReader
) -> QuantizedCheckpoint:
    """A GPTQ / AWQ / AutoRound checkpoint directory whose shards `reader` maps: every check
    of `read_quantized_checkpoint` done (config, schemes, fields, dtypes, shapes, zero points,
    g_idx), `layouts` filled, and each quantized linear read only when asked for
    (`QuantizedCheckpoint.linear`), its pages dropped from the resident set once checked."""
    root, config = _root_and_config(model_dir)
    return _open(root, config, lambda: ReaderSource(reader))


def _open(
    root: Path, config: dict[str, Any], make_source: Callable[[], TensorSource]
) -> QuantizedCheckpoint:
    """The checks and layouts of a checkpoint (see `open_quantized_checkpoint`); the config
    is checked before `make_source` gives the tensors."""
    qc = _read_quantization_config(root, config)
    method = _normalize_quant_method(root, qc)
    fmt = _packing_format(root, method, qc)
    resolver = _SchemeResolver(root, method, qc)
    desc_act = method == "gptq" and bool(qc.get("desc_act"))
    source = make_source()

    # group tensors by module: "<module>.<field>"
    modules: dict[str, dict[str, str]] = {}
    for key in source.names():
        module, _, fld = key.rpartition(".")
        modules.setdefault(module, {})[fld] = key
    quant_modules = sorted(m for m, fields in modules.items() if "qweight" in fields and m)
    for module, fields in modules.items():
        if "qweight" not in fields and fields.keys() & (_QUANT_ONLY_FIELDS - {"scales"}):
            fld = sorted(fields.keys() & _QUANT_ONLY_FIELDS)[0]
            raise QuantizedCheckpointError(
                f"{root}: layer '{module}', field 'qweight': tensor '{module}.qweight' is missing "
                f"but '{module}.{fld}' is present; the checkpoint is incomplete or in a "
                "kernel-specific layout, re-export it"
            )
    known_layers = [m for m in modules if m]

    layouts: dict[str, QuantizedLayout] = {}
    consumed: set[str] = set()
    for module in quant_modules:
        scheme, where = resolver.resolve(module, known_layers)
        if scheme is None:
            raise QuantizedCheckpointError(
                f"{root}: layer '{module}', field 'qweight': the layer is packed but the "
                f"quantization_config keeps it in float ({where}); the config and the tensors "
                "disagree, fix the config"
            )
        reader = _LayerReader(root, fmt, module, modules[module], source, desc_act)
        layouts[module] = reader.layout(scheme)
        source.release()
        consumed.update(modules[module].values())

    # a layer the config names explicitly as quantized must not be stored in float
    explicit: list[str] = list(resolver.extra)
    for module in explicit:
        if module in modules and module not in layouts and "weight" in modules[module]:
            scheme, _ = resolver.resolve(module, known_layers)
            if scheme is not None:
                raise QuantizedCheckpointError(
                    f"{root}: layer '{module}', field 'qweight': extra_config quantizes it to "
                    f"{scheme.bits} bits but only a float '{module}.weight' is stored; fix the "
                    "config or re-export the checkpoint"
                )

    float_names = [k for k in source.names() if k not in consumed]
    for key in float_names:
        if source.spec(key)[1].kind in "iu" and key.endswith(".weight"):
            raise QuantizedCheckpointError(
                f"{root}: tensor '{key}' is an integer weight outside any GPTQ/AWQ layer; "
                "the layout is not recognised"
            )
    return QuantizedCheckpoint(
        model_dir=root,
        config=config,
        quantization_config=qc,
        quant_method=method,
        packing_format=fmt,
        layouts=layouts,
        float_names=float_names,
        source=source,
        desc_act=desc_act,
    )
