"""The machine's program of one net: its command streams and grouped Tpu IR (`Program`,
written by codegen, read by the machine), its constant pool, its text form, and the file of
compiled nets (`write_program_file`; `toptpu.backend.runtime.simulate.ProgramFile` runs one).

A program is stored as JSON (`Program.to_json`) with its schema version (`STREAM_SCHEMA`
of `toptpu.backend.formats.commands`); `Program.from_json` refuses another version (the
model must be recompiled) and decodes every field with the header schema decoder, then
checks the records across fields — a stream is as untrusted as a header.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.contract import TensorSpec
from toptpu.backend.formats.commands import (
    STREAM_SCHEMA,
    Command,
    Gather,
    Load,
    Shape,
    Space,
    check_command,
    command_text,
    numel,
)
from toptpu.backend.formats.header_schema import (
    HeaderError,
    Name,
    NamePattern,
    OneOf,
    decode,
    encode,
    join,
)
from toptpu.backend.formats.llm_file import KNOWN_DTYPES, DType
from toptpu.backend.formats.model_file import write_model_file
from toptpu.backend.target.chips import Chip
from toptpu.dialects import plugin_ops, tpu
from toptpu.dialects.common import constant_value
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import ToptpuError


class StreamError(ToptpuError, ValueError):
    """A program (command stream) that cannot be used; the message says which field and
    what to do."""


@dataclass(frozen=True)
class WeightSpec:
    """A weight the program reads (found by name in the weight blob)."""

    shape: Shape
    dtype: DType
    nbytes: int


@dataclass(frozen=True)
class Regions:
    """Bytes of the net's global regions (address-assign's `#tpu.regions`)."""

    activations: int
    constants: int
    weights: int
    io: int


@dataclass
class Program:
    """Everything the machine needs to run one net."""

    name: Name
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    regions: Regions
    weights: dict[Name, WeightSpec]
    commands: tuple[Command, ...] = ()
    ir: str = ""  # the grouped Tpu IR (generic form): compute commands index its ops
    flops: int = 0
    schema: int = field(default=STREAM_SCHEMA)

    def inherent_bytes(self) -> int:
        """Bytes the net cannot avoid moving: its weights, inputs and outputs; of a weight
        only gathers read (an embedding table), the rows they read."""
        gathered: dict[str, int] = {}  # weight -> bytes gathers read of it
        loaded: set[str] = set()  # weights a load reads (whole or sliced)
        for c in self.commands:
            if isinstance(c, Load) and c.tensor.space is Space.WEIGHT and c.tensor.name \
                    and c.index is not None:  # an indexed load: its modelled rows
                key = c.tensor.name
                gathered[key] = gathered.get(key, 0) + c.nbytes
            elif isinstance(c, Load) and c.tensor.space is Space.WEIGHT and c.tensor.name:
                loaded.add(c.tensor.name)
            elif isinstance(c, Gather) and c.table.tensor.space is Space.WEIGHT \
                    and c.table.tensor.name:
                key = c.table.tensor.name
                gathered[key] = gathered.get(key, 0) + c.nbytes
        return (sum(min(w.nbytes, gathered[n]) if n in gathered and n not in loaded
                    else w.nbytes for n, w in self.weights.items())
                + sum(t.nbytes for t in (*self.inputs, *self.outputs)))

    def indexed_bytes(self) -> tuple[int, int]:
        """The bytes its indexed loads (`Load.index`: a MoE layer's experts) are modelled
        to move, and what they would move if every row (expert) moved."""
        loads = [c for c in self.commands if isinstance(c, Load) and c.index is not None]
        return sum(c.nbytes for c in loads), sum(c.all_nbytes for c in loads)

    def to_json(self) -> bytes:
        return json.dumps(encode(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview) -> Program:
        """The program in `data`, checked (StreamError names the field that is wrong)."""
        try:
            raw = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StreamError(f"not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise StreamError("not a JSON object")
        version = raw.get("schema", 1)  # version 1 had no version field
        if version != STREAM_SCHEMA:
            raise StreamError(f"its command records are of schema version {version!r}; this "
                              f"toptpu runs version {STREAM_SCHEMA}: recompile the model")
        try:
            prog = decode(cls, raw)
            prog.check()
        except HeaderError as e:
            raise StreamError(str(e)) from None
        return prog

    def check(self) -> None:
        """The checks across fields (HeaderError names the field)."""
        for what in ("inputs", "outputs"):
            for i, spec in enumerate(getattr(self, what)):
                where = join(what, i)
                NamePattern().check(spec.name, join(where, "name"))
                OneOf(tuple(sorted(KNOWN_DTYPES)), "dtype").check(spec.dtype,
                                                                  join(where, "dtype"))
        for name, w in self.weights.items():
            need = numel(w.shape) * np.dtype(w.dtype).itemsize
            if w.nbytes != need:
                raise HeaderError(join(join("weights", name), "nbytes"),
                                  f"is {w.nbytes}, {w.dtype} {list(w.shape)} takes {need}")
        for i, c in enumerate(self.commands):
            check_command(c, i, join("commands", i))

    def text(self, cycles: Sequence[float] | None = None, timeline: str = "") -> str:
        """The program as text: a header line, then one line per command
        (`toptpu.backend.formats.commands.command_text`), each ending with its modelled
        `cycles` when given (and `timeline`, a line about the whole, after the header)."""
        r = self.regions
        io = ", ".join(f"{s.name} {list(s.shape)} {s.dtype}" for s in self.inputs)
        out = ", ".join(f"{s.name} {list(s.shape)} {s.dtype}" for s in self.outputs)
        head = [f"program @{self.name}: {len(self.commands)} commands, {self.flops} FLOPs; "
                f"regions " + ", ".join(f"{f.name} {getattr(r, f.name)}" for f in fields(r)),
                *([f"  {timeline}"] if timeline else []),
                f"  in: {io}", f"  out: {out}"]
        lines = [command_text(c) for c in self.commands]
        if cycles is not None:
            lines = [f"{line} cycles={n:.0f}" for line, n in zip(lines, cycles, strict=True)]
        return "\n".join([*head, *lines])


#: how many programs' parsed IR `program_module` keeps (the most recently parsed texts)
PROGRAM_MODULES = 32
_PROGRAM_MODULES: OrderedDict[tuple[str, tuple[plugin_ops.PluginOp, ...]], ModuleOp] = \
    OrderedDict()
_PROGRAM_MODULES_LOCK = threading.Lock()


def program_module(ir: str, name: str) -> ModuleOp:
    """A program's IR text parsed and verified (`parse_ir`; `name` names it in errors): the
    module of the same text parsed and verified earlier in this process when there is one.
    The model file's writer reads the constant pool from the text it writes and the machine
    parses the same text when it loads the net; a model file opened again (another executor,
    another device of a spread model) has the same texts: each is parsed and verified once,
    not at every load. Keyed by the text and the plugin ops registered (they decide what
    parses); a text that does not parse or verify is not kept (it raises at every load).
    The modules are shared: their users only read them."""
    key = (ir, plugin_ops.registered())
    with _PROGRAM_MODULES_LOCK:
        module = _PROGRAM_MODULES.get(key)
        if module is not None:
            _PROGRAM_MODULES.move_to_end(key)
            return module
    module = parse_ir(ir, name)
    with _PROGRAM_MODULES_LOCK:
        _PROGRAM_MODULES[key] = module
        while len(_PROGRAM_MODULES) > PROGRAM_MODULES:
            _PROGRAM_MODULES.popitem(last=False)
    return module


def constant_pool(program: Program) -> bytes:
    """The net's constants, at their address-assign offsets."""
    buf = bytearray(program.regions.constants)
    if not buf:
        return b""
    module = program_module(program.ir, f"net:{program.name}")
    for op in module.walk():
        if isinstance(op, tpu.ConstantOp) and op.pool_offset is not None:
            off = op.pool_offset
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
