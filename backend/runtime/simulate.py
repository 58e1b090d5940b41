"""Run compiled programs on the reference machine (tests, benchmarks, `toptpu compare`).

`simulate` maps the weights one program uses and its inputs into the global memory of a
fresh machine, runs the program and reads the outputs back; `ProgramFile` runs the nets of
a file `toptpu.backend.formats.program.write_program_file` wrote. Compiling a module to a
program (the machine passes and codegen) is the driver's job:
`toptpu.machine_pipeline.compile_for_machine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from toptpu.backend.formats.model_file import ModelFile, ModelFileError
from toptpu.backend.formats.program import NETS_KIND, Program, constant_pool
from toptpu.backend.runtime.machine import Binding, LoadedNet, Machine, Timeline
from toptpu.backend.target.chips import Chip, chip_from_json
from toptpu.dialects.weight_store import WeightStore


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


def _fill_constants(m: Machine, program: Program, base: int) -> None:
    pool = constant_pool(program)
    if pool:
        r, off = m.gmem.find(base, len(pool), "constants")
        r.data[off:off + len(pool)] = np.frombuffer(pool, np.uint8)


class ProgramFile:
    """A model file of compiled nets, run on one machine (weights mapped once)."""

    def __init__(self, path: str, checked: bool = False) -> None:
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
