"""The machine's program of one net: its command streams and grouped Tpu IR (`Program`,
written by codegen, read by the machine), its constant pool, and the file of compiled nets
(`write_program_file`; `toptpu.backend.runtime.simulate.ProgramFile` runs one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toptpu.backend.formats.model_file import write_model_file
from toptpu.backend.target.chips import Chip
from toptpu.dialects import tpu
from toptpu.dialects.common import constant_value, read_int
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import WeightStore


@dataclass
class Program:
    """Everything the machine needs to run one net (JSON-serializable)."""

    name: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    regions: dict[str, int]
    weights: dict[str, dict[str, Any]]  # name -> shape, dtype, nbytes
    commands: list[dict[str, Any]] = field(default_factory=list)
    ir: str = ""  # the grouped Tpu IR (generic form): compute commands index its ops
    flops: int = 0

    def inherent_bytes(self) -> int:
        """Bytes the net cannot avoid moving: its weights, inputs and outputs; of a weight
        only gathers read (an embedding table), the rows they read."""
        def size(spec: dict[str, Any]) -> int:
            return int(np.prod(spec["shape"])) * np.dtype(spec["dtype"]).itemsize

        gathered: dict[str, int] = {}  # weight -> bytes gathers read of it
        loaded: set[str] = set()  # weights a load reads (whole or sliced)
        for c in self.commands:
            if c.get("dir") == "load" and c["g"]["sp"] == "w":
                loaded.add(c["g"]["key"])
            elif c.get("dir") == "gather":
                for r in c["ins"]:
                    if r and "global" in r and r["global"]["sp"] == "w":
                        key = r["global"]["key"]
                        gathered[key] = gathered.get(key, 0) + c["bytes"]
        return (sum(min(w["nbytes"], gathered[n]) if n in gathered and n not in loaded
                    else w["nbytes"] for n, w in self.weights.items())
                + sum(size(t) for t in (*self.inputs, *self.outputs)))

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview) -> Program:
        return cls(**json.loads(bytes(data)))


def constant_pool(program: Program) -> bytes:
    """The net's constants, at their address-assign offsets."""
    buf = bytearray(program.regions["constants"])
    if not buf:
        return b""
    module = parse_ir(program.ir, f"net:{program.name}", verify=False)
    for op in module.walk():
        if isinstance(op, tpu.ConstantOp) and "tpu.const_offset" in op.attributes:
            off = read_int(op.attributes["tpu.const_offset"])
            data = np.ascontiguousarray(constant_value(op.value)).view(np.uint8).reshape(-1)
            buf[off:off + data.size] = data.tobytes()
    return bytes(buf)


# ------------------------------------------------------------------ programs in a model file

NETS_KIND = "toptpu-nets"


def write_program_file(path: str, programs: Mapping[str, Program], store: WeightStore,
                       chip: Chip) -> None:
    """One model file holding compiled nets: their programs, constant pools and one aligned
    weight blob (every weight the programs read, 64-byte aligned)."""
    table: dict[str, dict] = {}
    chunks: list[bytes] = []
    off = 0
    for prog in programs.values():
        for name in prog.weights:
            if name in table:
                continue
            arr = np.ascontiguousarray(store[name])
            table[name] = {"offset": off, "shape": list(arr.shape), "dtype": str(arr.dtype),
                           "nbytes": int(arr.nbytes)}
            pad = (-arr.nbytes) % 64
            chunks.append(arr.view(np.uint8).tobytes() + b"\0" * pad)
            off += arr.nbytes + pad
    sections: dict[str, bytes] = {"weights": b"".join(chunks)}
    for name, prog in programs.items():
        sections[f"program:{name}"] = prog.to_json()
        sections[f"const:{name}"] = constant_pool(prog)
    header = {"kind": NETS_KIND, "chip": chip.to_json(), "nets": list(programs),
              "weights": table}
    write_model_file(path, header, sections)
