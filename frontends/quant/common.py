"""What the pre-quantized checkpoint readers share (GPTQ, AWQ, AutoRound): the error, the
canonical unpacked form (`QuantizedLinear`), the int32 bit unpacking, the files (config,
shards, `quantization_config`), the per-layer scheme and the rules every format's resolver
applies, and where tensors come from (`TensorSource`).

On-disk layouts (``K`` = in_features, ``N`` = out_features, ``G`` = number of groups,
``p = 32 // bits`` values per int32 word, value ``i`` of a word in bits
``[i*bits, (i+1)*bits)``):
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from toptpu.backend.contract import ModelDirFileError, model_file_path, read_model_file
from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader
from toptpu.errors import ToptpuError

#: bit widths the readers decode (one value never straddles an int32 word)
SUPPORTED_BITS: tuple[int, ...] = (4, 8)

#: field names that only occur in quantized modules (GPTQ/AWQ and exllama/marlin layouts)
QUANT_ONLY_FIELDS = frozenset(
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

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


class QuantizedCheckpointError(ToptpuError, ValueError):
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
    A scale-and-min layer (llama.cpp's Q4_1, Q5_1, Q4_K, Q5_K) has float ``mins`` [N, G]
    instead and no zero points: ``W = q * scale + min``, the product rounded first.
    """

    name: str
    bits: int
    group_size: int
    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    g_idx: np.ndarray | None
    bias: np.ndarray | None
    sym: bool
    mins: np.ndarray | None = None

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
        """float32 ``[N, K]`` = ``(q - zero) * scale``, scale cast from its stored dtype
        (``q * scale + min`` with mins).

        This is the float32 weight GPTQ/AWQ/AutoRound define (and AutoRound's fake-quantized
        export writes): the integer difference is exact in float32, the product rounds once.
        """
        groups = self.group_index()
        q = self.qweight.astype(np.float32)
        s = self.scales.astype(np.float32)[:, groups]
        if self.mins is not None:
            return q * s + self.mins.astype(np.float32)[:, groups]
        assert self.zeros is not None
        z = self.zeros.astype(np.float32)[:, groups]
        return (q - z) * s


# --------------------------------------------------------------------------------------------
# bit unpacking


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not one of {SUPPORTED_BITS}")


def unpack_int32_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R * 32 // bits, C]``: value ``i`` of word ``[r, c]`` is row
    ``r * (32 // bits) + i`` (the GPTQ ``qweight`` layout, packed along K)."""
    check_bits(bits)
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    vals = (words[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(words.shape[0] * per, words.shape[1]).astype(np.uint8)


def unpack_int32_columns(packed: np.ndarray, bits: int) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R, C * 32 // bits]``: value ``i`` of word ``[r, c]`` is column
    ``c * (32 // bits) + i`` (the GPTQ ``qzeros`` layout, packed along N)."""
    check_bits(bits)
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(words.shape[0], words.shape[1] * per).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# files


def load_json(path: Path) -> dict[str, Any]:
    try:
        raw = read_model_file(str(path.parent), path.name)
        if raw is None:
            raise QuantizedCheckpointError(f"{path}: missing")
        data = json.loads(raw.decode("utf-8"))
    except ModelDirFileError as e:
        raise QuantizedCheckpointError(str(e)) from None
    except RecursionError:
        raise QuantizedCheckpointError(f"{path}: nested too deeply to be a config") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantizedCheckpointError(
            f"{path}: not valid JSON ({e}); fix or re-export the file"
        ) from e
    if not isinstance(data, dict):
        raise QuantizedCheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def is_model_file(model_dir: Path, name: str) -> bool:
    """`name` is a regular file of `model_dir` (`contract.model_file_path`: a link out of
    the directory, a FIFO or a device is an error naming it)."""
    try:
        return model_file_path(str(model_dir), name) is not None
    except ModelDirFileError as e:
        raise QuantizedCheckpointError(str(e)) from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if is_model_file(model_dir, index.name):
        weight_map = load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QuantizedCheckpointError(
                f"{index}: no 'weight_map'; the shard index is damaged, re-export the checkpoint"
            )
        files = []
        for fname in dict.fromkeys(weight_map.values()):
            path = model_dir / str(fname)
            if not is_model_file(model_dir, str(fname)):
                raise QuantizedCheckpointError(
                    f"{index}: shard '{fname}' is listed but missing from {model_dir}; "
                    "copy the complete checkpoint"
                )
            files.append(path)
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    files = [f for f in files if is_model_file(model_dir, f.name)]
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


def load_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    index_path = model_dir / "model.safetensors.index.json"
    expected: dict[str, str] | None = None
    if is_model_file(model_dir, index_path.name):
        expected = {str(k): str(v) for k, v in load_json(index_path)["weight_map"].items()}
    tensors: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for path in _safetensors_files(model_dir):
        try:
            part = _read_file(path)
        except CheckpointError as e:
            raise QuantizedCheckpointError(
                f"{path}: not a readable safetensors file ({e}); the file is corrupt or "
                "truncated, re-download or re-export it"
            ) from None
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


def read_quantization_config(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise QuantizedCheckpointError(
                f"{model_dir / 'config.json'}: 'quantization_config' must be an object"
            )
        return dict(qc)
    for fname in ("quantization_config.json", "quantize_config.json"):
        path = model_dir / fname
        if is_model_file(model_dir, fname):
            qc = load_json(path)
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
class LayerScheme:
    bits: int
    group_size: int
    sym: bool
    source: str = "quantization_config"


def require(model_dir: Path, qc: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in qc and qc[key] is not None:
            return qc[key]
    raise QuantizedCheckpointError(
        f"{model_dir}: quantization_config has no '{keys[0]}'; it is required to decode the "
        "packed weights (add it as the producer set it)"
    )


class SchemeResolver(ABC):
    """Answers "how is layer X quantized (or is it float)?" from the quantization_config:
    the rules every format shares (its default scheme, per-layer overrides, the blocks and
    modules left out); each format's subclass says how its config names them (`resolve`)."""

    def __init__(self, model_dir: Path, qc: Mapping[str, Any]):
        self.model_dir = model_dir
        self.qc = qc
        self.default = self.default_scheme()
        #: layers the config names explicitly (AutoRound's extra_config)
        self.extra: dict[str, dict[str, Any]] = {}
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

    def default_scheme(self) -> LayerScheme:
        """The scheme of a layer no override names (GPTQ's and AutoRound's keys)."""
        bits = require(self.model_dir, self.qc, "bits")
        group_size = require(self.model_dir, self.qc, "group_size")
        sym = bool(require(self.model_dir, self.qc, "sym"))
        return LayerScheme(int(bits), int(group_size), sym)

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

    def _scheme(self, override: Mapping[str, Any], layer: str, source: str) -> LayerScheme | None:
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
        return LayerScheme(
            bits,
            int(override.get("group_size", self.default.group_size)),
            bool(override.get("sym", self.default.sym)),
            source,
        )

    @abstractmethod
    def resolve(self, layer: str, known_layers: Iterable[str]) -> tuple[LayerScheme | None, str]:
        """(scheme or None for float, where the decision came from)."""


# --------------------------------------------------------------------------------------------
# where tensors come from


class TensorSource(Protocol):
    """The tensors of a checkpoint by name: their shape and dtype from the header alone,
    their values on demand (`release` lets go of what was read)."""

    def names(self) -> Iterable[str]: ...

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]: ...

    def array(self, name: str) -> np.ndarray: ...

    def release(self) -> None: ...


class DictSource:
    """Tensors already in memory (`load_tensors`)."""

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
    #: the scale-and-min form (float mins, no zero points: GGUF's Q4_1, Q5_1, Q4_K, Q5_K)
    mins: bool = False
    #: the scales' (and mins') dtype where layers of one checkpoint differ in it (GGUF)
    scale_dtype: str = ""

    @property
    def scheme(self) -> LayerScheme:
        return LayerScheme(self.bits, self.group_size, self.sym, self.source)

    @property
    def net_form(self) -> tuple[int, int, bool, bool, str]:
        """What the compiled net of a layer depends on: layers whose linears differ in it
        need nets of their own (bits, group size, act-order, mins, scale dtype)."""
        return (self.bits, self.group_size, self.act_order, self.mins, self.scale_dtype)
