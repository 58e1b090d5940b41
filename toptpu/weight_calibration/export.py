"""A calibrated model as a pre-quantized checkpoint directory, written one layer at a time.

The directory is a Hugging Face checkpoint in the GPTQ layout (`frontends.quant.gptq`:
``qweight`` int32 ``[K / p, N]`` packed along K, ``qzeros`` int32 ``[G, N / p]``, ``scales``
``[G, N]``, ``g_idx`` int32 ``[K]`` = ``k // group_size``, ``bias``), one shard per decoder
layer plus one for the rest (``model.safetensors.index.json``), ``config.json`` with its
``quantization_config``, the tokenizer files and ``generation_config.json``. Two formats:

- ``gptq``: ``quant_method: gptq``, ``checkpoint_format: gptq`` (AutoGPTQ's v1: the stored
  zero point is ``zero - 1``). v1 cannot store a zero point of 0 (an asymmetric group whose
  weights are all >= 0); such a group is refused with a message naming the other format.
- ``auto_round``: ``quant_method: auto-round``, ``packing_format: auto_round`` (the same
  layout, zero points stored as they are), which holds every zero point.

Linears left in float (a shape the layout cannot hold) stay ``weight`` tensors, named in
the config (GPTQ ``dynamic`` ``-:`` rules, AutoRound ``extra_config`` ``bits: 16``). The
layers' other float tensors (norms, biases: AWQ may have changed them) are written in
float32, exactly as calibrated; the tensors outside the layers as the source stores them.
The shards are written as safetensors files tensor by tensor from the arrays as they are
(`write_safetensors`: no copy of a shard is made in memory; a tensor outside the layers gets
a shard of its own, read from the source when its shard is written). The directory is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from toptpu.dialects.checkpoint_reader import INDEX_FILE
from toptpu.weight_calibration.grid import CalibrationError, QuantizedWeights, QuantScheme

EXPORT_FORMATS = ("gptq", "auto_round")


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[N, K]`` -> int32 ``[K * bits / 32, N]``: input channel k of output n is value
    ``k % p`` of word ``[k // p, n]`` (inverse of `frontends.quant.unpack_int32_rows`)."""
    per = 32 // bits
    n, k = q.shape
    vals = q.T.astype(np.uint32).reshape(k // per, per, n)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(vals << shifts, axis=1).view(np.int32)


def pack_columns(z: np.ndarray, bits: int) -> np.ndarray:
    """uint ``[G, N]`` -> int32 ``[G, N * bits / 32]``: value ``n % p`` of word ``[g, n // p]``
    (inverse of `frontends.quant.unpack_int32_columns`)."""
    per = 32 // bits
    g, n = z.shape
    vals = z.astype(np.uint32).reshape(g, n // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(vals << shifts, axis=2).view(np.int32)


def gptq_tensors(name: str, qw: QuantizedWeights, bias: np.ndarray | None, fmt: str
                 ) -> dict[str, np.ndarray]:
    """The checkpoint tensors of the quantized linear `name` (a module path)."""
    bits = qw.scheme.bits
    zeros = qw.zeros.astype(np.int32)
    if fmt == "gptq":
        if zeros.size and int(zeros.min()) == 0:
            raise CalibrationError(f"'{name}' has a group whose zero point is 0, which the GPTQ "
                                   "v1 format (zero - 1 stored) cannot hold; export in the "
                                   "auto_round format")
        zeros = zeros - 1
    n, k = qw.qweight.shape
    out = {f"{name}.qweight": pack_rows(qw.qweight, bits),
           f"{name}.qzeros": pack_columns(zeros.T, bits),
           f"{name}.scales": np.ascontiguousarray(qw.scales.T)}
    if fmt == "gptq":  # AutoGPTQ writes g_idx; the auto_round packing has none
        out[f"{name}.g_idx"] = (np.arange(k) // qw.scheme.group_length(k)).astype(np.int32)
    if bias is not None:
        out[f"{name}.bias"] = np.asarray(bias, dtype=np.float32)
    return out


def quantization_config(scheme: QuantScheme, fmt: str, method: str, act_order: bool,
                        float_linears: list[str], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``quantization_config`` (module doc)."""
    common: dict[str, Any] = {"bits": scheme.bits, "group_size": scheme.group_size,
                              "sym": scheme.sym}
    tool = {"tool": "toptpu", "method": method, **extra}
    if fmt == "gptq":
        qc: dict[str, Any] = {"quant_method": "gptq", **common, "desc_act": act_order,
                              "static_groups": act_order, "checkpoint_format": "gptq",
                              "true_sequential": True, "lm_head": False,
                              "calibration": tool}
        if float_linears:
            qc["dynamic"] = {f"-:^{re.escape(n)}$": {} for n in float_linears}
        return qc
    qc = {"quant_method": "auto-round", "packing_format": "auto_round", **common,
          "data_type": "int", "calibration": tool}
    if float_linears:
        qc["extra_config"] = {n: {"bits": 16} for n in float_linears}
    return qc


#: numpy dtype -> safetensors dtype name
SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                      np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64",
                      np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
                      np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
                      np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    """One safetensors file of `tensors` (in this order), written tensor by tensor from the
    arrays' own memory (a non-contiguous array is copied one at a time): the header JSON
    with each tensor's dtype, shape and data offsets, padded with spaces to 8 bytes, as
    safetensors writes it."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        dtype = SAFETENSORS_DTYPES.get(np.dtype(arr.dtype))
        if dtype is None:
            raise CalibrationError(f"tensor '{name}' has dtype {arr.dtype}, which a "
                                   "safetensors checkpoint does not hold")
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(data)))
        f.write(data)
        for arr in tensors.values():
            if arr.size:
                f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


class CheckpointWriter:
    """Writes the directory (module doc): `write_shard` per layer, then `finish`."""

    def __init__(self, output: str, shards: int) -> None:
        self.output = os.path.abspath(output)
        if os.path.lexists(self.output):
            raise CalibrationError(f"output '{output}' exists; name a new directory for the "
                                   "calibrated checkpoint")
        parent = os.path.dirname(self.output)
        if not os.path.isdir(parent):
            raise CalibrationError(f"output '{output}': the directory '{parent}' does not "
                                   "exist; create it first")
        #: the directory the checkpoint is written in (and its scratch files are made in)
        self.directory = parent
        self.tmp = os.path.join(parent, f".{os.path.basename(self.output)}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.shards = shards
        self.count = 0
        self.weight_map: dict[str, str] = {}

    def write_shard(self, tensors: Mapping[str, np.ndarray]) -> None:
        self.count += 1
        name = f"model-{self.count:05d}-of-{self.shards:05d}.safetensors"
        try:
            write_safetensors(os.path.join(self.tmp, name), tensors)
        except OSError as e:
            raise CalibrationError(f"cannot write the calibrated checkpoint in "
                                   f"'{os.path.dirname(self.tmp)}': {e.strerror or e}") from None
        for t in tensors:
            if t in self.weight_map:
                raise CalibrationError(f"tensor '{t}' written twice")
            self.weight_map[t] = name

    def finish(self, config: dict[str, Any], files: Mapping[str, bytes]) -> str:
        """The index, config.json and `files` (tokenizer, generation config) written; the
        directory renamed to its name."""
        if self.count != self.shards:
            raise CalibrationError(f"{self.count} shards written of {self.shards}")
        index = {"metadata": {}, "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.tmp, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        with open(os.path.join(self.tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        for name, data in files.items():
            with open(os.path.join(self.tmp, name), "wb") as f:
                f.write(data)
        os.rename(self.tmp, self.output)
        return self.output

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
