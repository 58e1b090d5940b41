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

from toptpu.backend.chips import Chip
from toptpu.backend.codegen import Program, generate
from toptpu.backend.machine import Binding, LoadedNet, Machine, Timeline
from toptpu.dialects.weight_store import WeightStore


def compile_for_machine(module: ModuleOp, chip: Chip, max_ops: int = 12) -> Program:
    """layer-group + lmem-verify + address-assign + codegen for the module's function."""
    from toptpu.passes.address_assign import AddressAssignPass
    from toptpu.passes.layer_group import LayerGroupPass, LmemVerifyPass
    from toptpu.passes.pipelines import run_passes

    run_passes(module, [LayerGroupPass(chip.name, max_ops), LmemVerifyPass(chip.name),
                        AddressAssignPass()])
    fns = [f for f in module.ops if isinstance(f, func.FuncOp)]
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
    from xdsl.parser import Parser

    from toptpu.backend.interpreter import constant_value
    from toptpu.dialects import context, tpu
    from toptpu.dialects.common import read_int

    buf = bytearray(program.regions["constants"])
    if not buf:
        return b""
    module = Parser(context(), program.ir, "consts").parse_module()
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
