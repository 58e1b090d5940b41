"""Reading a safetensors checkpoint one tensor at a time, memory mapped, in its storage dtype.

The one reader of `.safetensors` files (checkpoints, weight stores, pre-quantized
checkpoints), torch-free, in the lowest layer so that every user may import it; `serialize`
the one writer's bytes.

A checkpoint directory holds `model.safetensors`, or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file name), or (without an
index) any `*.safetensors` files. `CheckpointReader.open` reads the index and every shard's
header — nothing else — and checks all of it before any tensor is read, because a checkpoint
is untrusted input:

- the index is a JSON object whose `weight_map` maps names to shard *file names* (a plain
  name ending in `.safetensors`: never a path, never `..`); every shard it lists exists;
- a shard is at least 8 bytes, its header length fits the file (and safetensors' 100 MB
  limit), the header is strict UTF-8 JSON (an object, no duplicate keys, no NaN), its
  `__metadata__` maps strings to strings, and every tensor entry has exactly `dtype`,
  `shape` and `data_offsets`, a known dtype, a shape of non-negative integers, offsets
  whose difference is the shape's byte size; the tensors tile the data region from 0 with
  neither gaps nor overlaps and the file ends where the last one ends (shorter: truncated;
  longer: trailing bytes);
- a tensor appears in one shard only, and the index and the shards agree on who holds what.

Every problem is a `CheckpointError` naming the shard (its file name) and what is wrong.
`tensor(name)` then returns a read-only zero-copy view of the mapped bytes in the stored dtype
(bf16 as `ml_dtypes.bfloat16`); a shard truncated after it was opened is caught before a view
is made (never a SIGBUS). `release()` drops the mapped pages from this process (they stay in
the page cache), so reading a whole checkpoint tensor by tensor keeps the resident set bounded
by what the caller holds, not by the checkpoint's size.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save as _save_numpy

from toptpu.backend.contract import (
    ModelDirFileError,
    model_file_path,
    parse_strict_json,
    read_model_file,
)
from toptpu.dialects.output_file import note_input
from toptpu.errors import ToptpuError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SUFFIX = ".safetensors"
#: safetensors' own limit on a header's size
MAX_HEADER_BYTES = 100 * 2**20
_METADATA = "__metadata__"
_ENTRY_KEYS = ("data_offsets", "dtype", "shape")

#: safetensors dtype -> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
}


class CheckpointError(ToptpuError, ValueError):
    """A checkpoint that cannot be read as it is; the message names the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in its shard."""

    shard: str  # the shard's file name
    dtype: str  # safetensors dtype ("BF16", ...)
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _strict_json(data: bytes, where: str) -> Any:
    try:
        return parse_strict_json(data)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{where} is not valid JSON: {e}") from None


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


class Shard:
    """One safetensors file: its validated header and, once a tensor is read, its map."""

    def __init__(self, directory: str, name: str) -> None:
        self.name, self.path = name, os.path.join(directory, name)
        self._file: Any = None
        self._map: mmap.mmap | None = None
        try:
            if model_file_path(directory, name) is None:
                raise FileNotFoundError(self.path)
        except ModelDirFileError as e:
            raise CheckpointError(str(e)) from None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                note_input(f.fileno(), self.path)  # never an output of this command
                self.tensors, self.size = self._read_header(f, size), size
        except FileNotFoundError:
            raise CheckpointError(f"shard '{name}' is missing from {directory}: copy the "
                                  "complete checkpoint") from None
        except IsADirectoryError:
            raise CheckpointError(f"shard '{name}' in {directory} is a directory, not a "
                                  "safetensors file") from None
        except OSError as e:
            raise CheckpointError(f"cannot read shard '{name}' in {directory}: "
                                  f"{e.strerror}") from None

    def _err(self, what: str) -> CheckpointError:
        return CheckpointError(f"shard '{self.name}' {what}")

    def _read_header(self, f: Any, size: int) -> dict[str, TensorInfo]:
        if size < 8:
            raise self._err(f"is truncated: {size} bytes, not even a safetensors header "
                            "length; copy the complete checkpoint")
        hlen = int.from_bytes(f.read(8), "little")
        if hlen > MAX_HEADER_BYTES:
            raise self._err(f"declares a {hlen}-byte header, more than safetensors' "
                            f"{MAX_HEADER_BYTES}: it is not a safetensors file")
        if 8 + hlen > size:
            raise self._err(f"is truncated: its header needs {8 + hlen} bytes, the file has "
                            f"{size}; copy the complete checkpoint")
        header = _strict_json(f.read(hlen), f"the header of shard '{self.name}'")
        if not isinstance(header, dict):
            raise self._err(f"has a header that is a JSON {type(header).__name__}, not an "
                            "object")
        meta = header.pop(_METADATA, {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._err(f"has a '{_METADATA}' that is not an object of strings")
        base = 8 + hlen
        tensors = {name: self._entry(name, entry, base) for name, entry in header.items()}
        self._check_tiling(tensors, base, size)
        return tensors

    def _entry(self, name: str, entry: Any, base: int) -> TensorInfo:
        at = f"has tensor {name!r} with"
        if not name:
            raise self._err("has a tensor with an empty name")
        if not isinstance(entry, dict) or sorted(entry) != sorted(_ENTRY_KEYS):
            raise self._err(f"{at} an entry that is not exactly {list(_ENTRY_KEYS)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._err(f"{at} dtype {dtype!r}; toptpu reads {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._err(f"{at} shape {shape!r}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise self._err(f"{at} data_offsets {offsets!r}, not [begin, end] with "
                            "0 <= begin <= end")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise self._err(f"{at} data_offsets {offsets} spanning {offsets[1] - offsets[0]} "
                            f"bytes; {dtype} {shape} takes {nbytes}")
        return TensorInfo(self.name, dtype, tuple(shape), base + offsets[0], nbytes)

    def _check_tiling(self, tensors: dict[str, TensorInfo], base: int, size: int) -> None:
        end = base
        for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].nbytes)):
            if t.start != end:
                what = "overlaps the tensor before it" if t.start < end else \
                    f"starts {t.start - end} bytes after the tensor before it ends"
                raise self._err(f"has tensor {name!r} that {what}: the header is corrupt")
            end = t.start + t.nbytes
        if size < end:
            raise self._err(f"is truncated: its tensors need {end} bytes, the file has {size}; "
                            "copy the complete checkpoint")
        if size > end:
            raise self._err(f"has {size - end} bytes after its last tensor: the header does "
                            "not describe the file")

    def array(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of the tensor's bytes (the shard is mapped on first use)."""
        try:
            if self._map is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the map
                if os.fstat(self._file.fileno()).st_size != self.size:
                    raise self._err("changed size since its header was read: copy the "
                                    "complete checkpoint again")
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            elif os.fstat(self._file.fileno()).st_size < info.start + info.nbytes:
                raise self._err("was truncated while it was being read: copy the complete "
                                "checkpoint again")
        except FileNotFoundError:
            raise self._err("disappeared while the checkpoint was being read") from None
        except OSError as e:
            raise self._err(f"cannot be read: {e.strerror}") from None
        count = math.prod(info.shape)
        arr = np.frombuffer(self._map, dtype=info.numpy_dtype, count=count,
                            offset=info.start)
        return arr.reshape(info.shape)

    def release(self) -> None:
        """Drop the mapped pages from this process's resident set (they stay cached)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views still alive: the map goes when they do
                pass
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _shard_name(name: Any, index: str) -> str:
    """A shard name from the index, which must be a plain file name (never a path)."""
    ok = (isinstance(name, str) and name.endswith(SUFFIX) and name == os.path.basename(name)
          and name not in (".", "..") and "\\" not in name and "\0" not in name
          and not name.startswith("."))
    if not ok:
        raise CheckpointError(f"'{index}' names the shard {name!r}: a shard is a plain "
                              f"'*{SUFFIX}' file name in the checkpoint directory")
    return name


class CheckpointReader:
    """The tensors of a checkpoint directory by name (see the module doc)."""

    def __init__(self, directory: str, shards: dict[str, Shard]) -> None:
        self.directory, self.shards = directory, shards
        self.tensors: dict[str, TensorInfo] = {}
        for shard in shards.values():
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor '{name}' is in both shard '{self.tensors[name].shard}' and "
                        f"shard '{shard.name}': the checkpoint is inconsistent")
                self.tensors[name] = info

    @classmethod
    def open(cls, directory: str) -> CheckpointReader:
        """Read and check the index and every shard header of `directory`."""
        index = os.path.join(directory, INDEX_FILE)
        try:
            has_index = model_file_path(directory, INDEX_FILE) is not None
            has_single = model_file_path(directory, SINGLE_FILE) is not None
        except ModelDirFileError as e:
            raise CheckpointError(str(e)) from None
        if has_index:
            return cls._indexed(directory, index)
        if has_single:
            names = [SINGLE_FILE]
        else:
            names = sorted(f for f in os.listdir(directory) if f.endswith(SUFFIX))
        if not names:
            bins = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth")))
            hint = (f" (found {', '.join(bins[:4])}: convert them to safetensors, e.g. load "
                    "with transformers and save_pretrained(safe_serialization=True))"
                    if bins else "")
            raise CheckpointError(f"no *{SUFFIX} weights in {directory}{hint}")
        return cls(directory, {n: Shard(directory, n) for n in names})

    @classmethod
    def file(cls, path: str) -> CheckpointReader:
        """One safetensors file of any name (a weight store, one shard), its header checked."""
        directory, name = os.path.split(os.path.abspath(path))
        return cls(directory, {name: Shard(directory, name)})

    @classmethod
    def _indexed(cls, directory: str, index: str) -> CheckpointReader:
        try:
            data = read_model_file(directory, INDEX_FILE) or b""
        except ModelDirFileError as e:
            raise CheckpointError(str(e)) from None
        raw = _strict_json(data, f"'{index}'")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"'{index}' has no 'weight_map' object naming the shards")
        where: dict[str, str] = {}
        for tensor, shard in weight_map.items():
            where[tensor] = _shard_name(shard, index)
        names = sorted(set(where.values()))
        missing = [n for n in names if not os.path.exists(os.path.join(directory, n))]
        if missing:
            raise CheckpointError(
                f"shard(s) {', '.join(repr(m) for m in missing)} listed in '{index}' are "
                f"missing from {directory}: copy the complete checkpoint")
        reader = cls(directory, {n: Shard(directory, n) for n in names})
        for tensor, shard in where.items():
            held = reader.tensors.get(tensor)
            if held is None or held.shard != shard:
                raise CheckpointError(
                    f"'{index}' puts tensor '{tensor}' in shard '{shard}', which does not "
                    "hold it: the index does not belong to these shards")
        extra = sorted(set(reader.tensors) - set(where))
        if extra:
            raise CheckpointError(
                f"shard '{reader.tensors[extra[0]].shard}' holds tensor '{extra[0]}' that "
                f"'{index}' does not list: the index does not belong to these shards")
        return reader

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"the checkpoint in {self.directory} has no tensor '{name}'")
        return self.tensors[name]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor in its storage dtype: a read-only view of the mapped file."""
        info = self.info(name)
        return self.shards[info.shard].array(info)

    def renamed(self, names: dict[str, str]) -> CheckpointReader:
        """A reader of the same shards (the same maps) that holds the tensors of `names`
        (new name -> this reader's name) under their new names and no others: e.g. a VLM's
        text model under the names of a causal LM."""
        view = CheckpointReader(self.directory, {})
        view.shards = self.shards
        view.tensors = {new: self.info(old) for new, old in names.items()}
        return view

    def release(self) -> None:
        """Drop every mapped page from the resident set (views stay valid: a later read
        maps the page again from the page cache)."""
        for shard in self.shards.values():
            shard.release()

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serialize(arrays: dict[str, np.ndarray]) -> bytes:
    """`arrays` (bf16 as `ml_dtypes.bfloat16`) as the bytes of one safetensors file, by
    safetensors' own serializer: the bytes `safetensors.torch.save` gives for the same
    tensors, without torch."""
    return bytes(_save_numpy({n: np.ascontiguousarray(a) for n, a in arrays.items()}))
