"""Run compiled programs on the reference machine (tests, benchmarks, `toptpu compare`).

`simulate` maps the weights one program uses and its inputs into the global memory of a
fresh machine, runs the program and reads the outputs back; `ProgramFile` runs the nets of
a file `toptpu.backend.formats.program.write_program_file` wrote. Compiling a module to a
program (the machine passes and codegen) is the driver's job:
`toptpu.machine_pipeline.compile_for_machine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from toptpu.backend.formats.model_file import ModelFile, ModelFileError
from toptpu.backend.formats.program import NETS_KIND, Program, StreamError, constant_pool
from toptpu.backend.runtime.machine import (
    Binding,
    LoadedNet,
    Machine,
    Timeline,
    run_together,
)
from toptpu.backend.target.chips import Chip, chip_from_json
from toptpu.dialects.weight_store import WeightStore


@dataclass
class SimResult:
    outputs: dict[str, np.ndarray]
    timeline: Timeline


def simulate(program: Program, store: WeightStore, inputs: Mapping[str, np.ndarray],
             chip: Chip, checked: bool = True, machine: Machine | None = None,
             in_place: Mapping[str, str] | None = None) -> SimResult:
    """Run `program` on a machine (a fresh one in checked mode unless given) with its
    weights from `store` and `inputs` by name; its outputs and timeline. `in_place`: output
    -> input it is written over (one buffer, as the runtime binds a linear-attention
    state); the output is read from that buffer after the run."""
    m = machine or Machine(chip, checked)
    net = LoadedNet(program)
    weights = {}
    for name in program.weights:
        weights[name] = m.gmem.map(f"w:{name}", np.ascontiguousarray(store[name]),
                                   writable=False).base
    io: dict[str, int] = {}
    io, outs = _map_io(m, program, inputs, in_place or {})
    act = m.gmem.alloc("act", program.regions.activations).base
    const = m.gmem.alloc("const", program.regions.constants).base
    _fill_constants(m, program, const)
    tl = m.run(net, Binding(io, weights, act, const))
    return SimResult(_read_outputs(m, program, outs), tl)


def simulate_devices(program: Program, stores: Sequence[WeightStore],
                     inputs: Sequence[Mapping[str, np.ndarray]], chip: Chip,
                     checked: bool = True) -> list[SimResult]:
    """Run a program of collectives on one machine per device (tensor parallel) together:
    device d with its weights `stores[d]` and its `inputs[d]`; each device's outputs (the
    timeline is every device's)."""
    net = LoadedNet(program)
    machines, bindings, outs = [], [], []
    for store, x in zip(stores, inputs, strict=True):
        m = Machine(chip, checked)
        weights = {name: m.gmem.map(f"w:{name}", np.ascontiguousarray(store[name]),
                                    writable=False).base for name in program.weights}
        io, o = _map_io(m, program, x)
        act = m.gmem.alloc("act", program.regions.activations).base
        const = m.gmem.alloc("const", program.regions.constants).base
        _fill_constants(m, program, const)
        machines.append(m)
        bindings.append(Binding(io, weights, act, const))
        outs.append(o)
    tl = run_together(machines, net, bindings)
    return [SimResult(_read_outputs(m, program, o), tl)
            for m, o in zip(machines, outs, strict=True)]


def _map_io(m: Machine, program: Program, inputs: Mapping[str, np.ndarray],
            in_place: Mapping[str, str] | None = None
            ) -> tuple[dict[str, int], dict[str, int]]:
    """Map the inputs (copies) and room for the outputs (an output `in_place` names: its
    input's buffer): the IO addresses by name and the outputs' addresses."""
    io: dict[str, int] = {}
    for spec in program.inputs:
        if spec.name not in inputs:
            raise ValueError(f"input '{spec.name}' is missing (the net takes "
                             f"{[s.name for s in program.inputs]})")
        arr = np.ascontiguousarray(np.asarray(inputs[spec.name]).astype(spec.dtype))
        if arr.shape != tuple(spec.shape):
            raise ValueError(f"input '{spec.name}' has shape {list(arr.shape)}, the net "
                             f"expects {list(spec.shape)}")
        io[spec.name] = m.gmem.map(f"io:{spec.name}", arr.copy()).base
    outs = {}
    for spec in program.outputs:
        if in_place and spec.name in in_place:
            outs[spec.name] = io[spec.name] = io[in_place[spec.name]]
            continue
        outs[spec.name] = io[spec.name] = m.gmem.alloc(f"io:{spec.name}", spec.nbytes).base
    return io, outs


def _read_outputs(m: Machine, program: Program, outs: Mapping[str, int]
                  ) -> dict[str, np.ndarray]:
    return {s.name: m.gmem.tensor(outs[s.name], tuple(s.shape), np.dtype(s.dtype),
                                  "read").copy() for s in program.outputs}


def _fill_constants(m: Machine, program: Program, base: int) -> None:
    pool = constant_pool(program)
    if pool:
        r, off = m.gmem.find(base, len(pool), "constants")
        r.data[off:off + len(pool)] = np.frombuffer(pool, np.uint8)


class ProgramFile:
    """A model file of compiled nets, run on one machine (weights mapped once)."""

    def __init__(self, path: str, checked: bool = False) -> None:
        """`checked`: the machine's checked mode (default: fast)."""
        self.file = ModelFile(path)
        h = self.file.header
        if h.get("kind") != NETS_KIND:
            raise ModelFileError(f"'{path}' holds '{h.get('kind')}', not compiled nets")
        self.chip = chip_from_json(h["chip"])
        self.machine = Machine(self.chip, checked)
        blob = np.frombuffer(self.file.view("weights"), np.uint8)
        region = self.machine.gmem.map("weights", blob, writable=False)
        self.weights = {n: region.base + w["offset"] for n, w in h["weights"].items()}
        self.programs = {n: _program(path, n, self.file.view(f"program:{n}"))
                         for n in h["nets"]}
        self.nets = {n: LoadedNet(p, n) for n, p in self.programs.items()}
        self.const = {}
        for n in self.programs:
            pool = self.file.read(f"const:{n}")
            r = self.machine.gmem.alloc(f"const:{n}", len(pool))
            r.data[:len(pool)] = np.frombuffer(pool, np.uint8)
            self.const[n] = r.base

    def run(self, net: str, inputs: Mapping[str, np.ndarray]) -> SimResult:
        prog = self.programs[net]
        m = self.machine
        mark = m.gmem.mark()  # per-run regions are released afterwards
        try:
            io, outs = _map_io(m, prog, inputs)
            act = m.gmem.alloc("act", prog.regions.activations).base
            tl = m.run(self.nets[net], Binding(io, self.weights, act, self.const[net]))
            return SimResult(_read_outputs(m, prog, outs), tl)
        finally:
            m.gmem.release(mark)


def _program(path: str, net: str, data: memoryview) -> Program:
    try:
        return Program.from_json(data)
    except StreamError as e:
        raise ModelFileError(f"'{path}': the command stream of net '{net}' is unusable: "
                             f"{e}") from None
