"""Run one compiled Tpu module on a fresh machine (tests, benchmarks, `toptpu compare`).

`compile_for_machine` runs the machine part of the Tpu pipeline (layer-group, lmem-verify,
address-assign) and codegen; `simulate` maps the weights the program uses and the
inputs into global memory, runs the program and reads the outputs back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.codegen.streams import Program, generate
from toptpu.backend.runtime.machine import Binding, LoadedNet, Machine, Timeline
from toptpu.backend.target.chips import Chip
from toptpu.dialects.weight_store import WeightStore


def compile_for_machine(module: ModuleOp, chip: Chip, max_ops: int = 12) -> Program:
    """layer-group + lmem-verify + address-assign + codegen for the module's function."""
    from toptpu.passes.address_assign import assign_function
    from toptpu.passes.layer_group import layer_group_function
    from toptpu.passes.lmem import verify_group

    fns = [f for f in module.ops if isinstance(f, func.FuncOp)]
    for fn in fns:
        for g in layer_group_function(fn, chip, max_ops):
            verify_group(g, chip)
        assign_function(fn)
    module.verify()
    if len(fns) != 1:
        raise ValueError("simulate runs modules with exactly one function")
    return generate(module, fns[0], chip)


@dataclass
class SimResult:
    outputs: dict[str, np.ndarray]
    timeline: Timeline


def simulate(program: Program, store: WeightStore, inputs: Mapping[str, np.ndarray],
             chip: Chip, checked: bool = True, machine: Machine | None = None) -> SimResult:
    m = machine or Machine(chip, checked)
    net = LoadedNet(program)
    weights = {}
    for name in program.weights:
        weights[name] = m.gmem.map(f"w:{name}", np.ascontiguousarray(store[name]),
                                   writable=False).base
    io: dict[str, int] = {}
    for spec in program.inputs:
        arr = np.ascontiguousarray(np.asarray(inputs[spec["name"]]).astype(spec["dtype"]))
        if list(arr.shape) != spec["shape"]:
            raise ValueError(f"input '{spec['name']}' has shape {list(arr.shape)}, the net "
                             f"expects {spec['shape']}")
        io[spec["name"]] = m.gmem.map(f"io:{spec['name']}", arr.copy()).base
    outs = {}
    for spec in program.outputs:
        nb = int(np.prod(spec["shape"])) * np.dtype(spec["dtype"]).itemsize
        r = m.gmem.alloc(f"io:{spec['name']}", nb)
        io[spec["name"]] = r.base
        outs[spec["name"]] = r
    act = m.gmem.alloc("act", program.regions["activations"]).base
    const = m.gmem.alloc("const", program.regions["constants"]).base
    _fill_constants(m, program, const)
    tl = m.run(net, Binding(io, weights, act, const))
    outputs = {}
    for spec in program.outputs:
        r = outs[spec["name"]]
        outputs[spec["name"]] = m.gmem.tensor(r.base, tuple(spec["shape"]),
                                              np.dtype(spec["dtype"]), "read").copy()
    return SimResult(outputs, tl)


def constant_pool(program: Program) -> bytes:
    """The net's constants, at their address-assign offsets."""
    from toptpu.backend.reference.interpreter import constant_value
    from toptpu.dialects import tpu
    from toptpu.dialects.common import read_int
    from toptpu.dialects.ir_text import parse_ir

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


def _fill_constants(m: Machine, program: Program, base: int) -> None:
    pool = constant_pool(program)
    if pool:
        r, off = m.gmem.find(base, len(pool), "constants")
        r.data[off:off + len(pool)] = np.frombuffer(pool, np.uint8)


# ------------------------------------------------------------------ programs in a model file

NETS_KIND = "toptpu-nets"


def write_program_file(path: str, programs: Mapping[str, Program], store: WeightStore,
                       chip: Chip) -> None:
    """One model file holding compiled nets: their programs, constant pools and one aligned
    weight blob (every weight the programs read, 64-byte aligned)."""
    from toptpu.backend.formats.model_file import write_model_file

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


class ProgramFile:
    """A model file of compiled nets, run on one machine (weights mapped once)."""

    def __init__(self, path: str, checked: bool = False) -> None:
        from toptpu.backend.formats.model_file import ModelFile, ModelFileError
        from toptpu.backend.target.chips import chip_from_json

        self.file = ModelFile(path)
        h = self.file.header
        if h.get("kind") != NETS_KIND:
            raise ModelFileError(f"'{path}' holds '{h.get('kind')}', not compiled nets")
        self.chip = chip_from_json(h["chip"])
        self.machine = Machine(self.chip, checked)
        blob = np.frombuffer(self.file.view("weights"), np.uint8)
        region = self.machine.gmem.map("weights", blob, writable=False)
        self.weights = {n: region.base + w["offset"] for n, w in h["weights"].items()}
        self.programs = {n: Program.from_json(self.file.view(f"program:{n}"))
                         for n in h["nets"]}
        self.nets = {n: LoadedNet(p) for n, p in self.programs.items()}
        self.const = {}
        for n in self.programs:
            pool = self.file.read(f"const:{n}")
            r = self.machine.gmem.alloc(f"const:{n}", len(pool))
            r.data[:len(pool)] = np.frombuffer(pool, np.uint8)
            self.const[n] = r.base

    def run(self, net: str, inputs: Mapping[str, np.ndarray]) -> SimResult:
        prog = self.programs[net]
        m = self.machine
        io: dict[str, int] = {}
        mark = m.gmem._next  # noqa: SLF001 - per-run regions are released afterwards
        nregions = len(m.gmem.regions)
        for spec in prog.inputs:
            arr = np.ascontiguousarray(np.asarray(inputs[spec["name"]]).astype(spec["dtype"]))
            io[spec["name"]] = m.gmem.map(f"io:{spec['name']}", arr.copy()).base
        outs = {}
        for spec in prog.outputs:
            nb = int(np.prod(spec["shape"])) * np.dtype(spec["dtype"]).itemsize
            outs[spec["name"]] = r = m.gmem.alloc(f"io:{spec['name']}", nb)
            io[spec["name"]] = r.base
        act = m.gmem.alloc("act", prog.regions["activations"]).base
        tl = m.run(self.nets[net], Binding(io, self.weights, act, self.const[net]))
        outputs = {s["name"]: m.gmem.tensor(outs[s["name"]].base, tuple(s["shape"]),
                                            np.dtype(s["dtype"]), "read").copy()
                   for s in prog.outputs}
        del m.gmem.regions[nregions:]
        m.gmem._next = mark  # noqa: SLF001
        return SimResult(outputs, tl)
