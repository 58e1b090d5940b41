"""The reference machine: compiled nets against the Tpu interpreter, traps on corrupted
allocations, rejected model files, and modelled time that respects physics."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from toptpu.backend.codegen.streams import generate
from toptpu.backend.formats.commands import STREAM_SCHEMA, Command, Compute, Load, Store
from toptpu.backend.formats.model_file import ModelFile, ModelFileError
from toptpu.backend.formats.program import Program, StreamError, write_program_file
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime import steps as steps_module
from toptpu.backend.runtime.machine import Machine, MachineTrap
from toptpu.backend.runtime.simulate import ProgramFile, simulate
from toptpu.backend.target.chips import get_chip
from toptpu.dialects import tpu
from toptpu.dialects.common import QuantMode, i64_array, read_ints
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.passes.layer_group import LayerGroupError, LayerGroupPass
from toptpu.passes.lmem import LocalMemoryError, verify_group
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes

CHIP = get_chip("bm1684x")
_TOP: dict[int, tuple] = {}


def _fast_only(modes: list[str], fast: tuple[str, ...]) -> list:
    """`modes` as parameters, those not in `fast` marked slow (the same path in other
    dtypes: the fast tier runs one float and one quantized mode)."""
    return [m if m in fast else pytest.param(m, marks=pytest.mark.slow) for m in modes]


def _top(tiny_models, length: int):
    if length not in _TOP:
        imp = import_decoder_layer(tiny_models("qwen2"), length, mask_value=-10000.0)
        _TOP[length] = (imp.module, imp.feeds, imp.store)
    return _TOP[length]


def _tpu(tiny_models, mode: str, length: int = 16):
    module, feeds, store = _top(tiny_models, length)
    m = module.clone()
    run_passes(m, tpu_pipeline_passes(mode), store=store)
    return m, feeds, store


@pytest.mark.parametrize("mode", _fast_only(QuantMode.names(), ("f32", "w4bf16")))
def test_model_file_on_machine_matches_tpu_interpreter(tiny_models, tmp_path, mode: str) -> None:
    module, feeds, store = _tpu(tiny_models, mode)
    ref = Interpreter(module, store).run(feeds).outputs["out"]
    prog = compile_for_machine(module, CHIP)
    path = os.path.join(tmp_path, "layer.toptpu")
    write_program_file(path, {"layer": prog}, store, CHIP)
    res = ProgramFile(path, checked=True).run("layer", feeds)
    out = res.outputs["out"]
    assert out.dtype == ref.dtype
    assert similarity(out.astype(np.float32), ref.astype(np.float32)).cosine >= 0.99999
    assert np.array_equal(out, ref)  # one slice per group here: the same reduction order


def test_sliced_groups_pipeline_and_match(tiny_models) -> None:
    # 64 tokens on a chip with little local memory and cheap DMAs: slicing pays off
    module, feeds, store = _tpu(tiny_models, "bf16", 64)
    ref = Interpreter(module, store).run(feeds).outputs["out"]
    small = replace(CHIP, lanes=4, lane_bytes=32768, dma_latency_cycles=8,
                    compute_latency_cycles=4)
    prog = compile_for_machine(module, small)
    groups = [op for op in module.walk() if isinstance(op, tpu.GroupOp)]
    assert any(g.slices.value.data > 1 for g in groups)
    res = simulate(prog, store, feeds, small, checked=True)
    assert similarity(res.outputs["out"].astype(np.float32),
                      ref.astype(np.float32)).cosine >= 0.99999
    tl = res.timeline
    # the DMA engine works while the compute engine works: loads of slice i+1 overlap
    dma = [(e.start, e.end) for e in tl.events if e.engine == "dma"]
    cmp_ = [(e.start, e.end) for e in tl.events if e.engine == "cmp"]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in dma for b0, b1 in cmp_)


def _grouped(tiny_models):
    module, feeds, store = _tpu(tiny_models, "f32")
    run_passes(module, [LayerGroupPass("bm1684x")])
    return module, feeds, store


def _overlap_two_live_buffers(module) -> str:
    """Give one buffer the address of another that is live at the same time."""
    for g in module.walk():
        if not isinstance(g, tpu.GroupOp):
            continue
        loads = [op for op in g.body.block.ops if isinstance(op, tpu.LoadOp)]
        if len(loads) >= 2:
            a, b = loads[0], loads[1]
            b.attributes["lmem"] = i64_array(read_ints(a.attributes["lmem"]))
            return g.name
    raise AssertionError("no group with two loads")


def test_verifier_rejects_overlapping_live_buffers(tiny_models) -> None:
    module, _, _ = _grouped(tiny_models)
    for g in module.walk():
        if isinstance(g, tpu.GroupOp):
            verify_group(g, CHIP)  # the compiler's allocation is valid
    _overlap_two_live_buffers(module)
    with pytest.raises(LocalMemoryError, match="live buffers overlap"):
        for g in module.walk():
            if isinstance(g, tpu.GroupOp):
                verify_group(g, CHIP)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
def test_machine_traps_on_overlapping_live_buffers(tiny_models, checked: bool) -> None:
    from toptpu.passes.address_assign import AddressAssignPass

    module, feeds, store = _grouped(tiny_models)
    _overlap_two_live_buffers(module)
    run_passes(module, [AddressAssignPass()])  # no lmem-verify: the machine must notice
    fn = next(op for op in module.ops)
    prog = generate(module, fn, CHIP)  # type: ignore[arg-type]
    with pytest.raises(MachineTrap, match="over the live buffer"):
        simulate(prog, store, feeds, CHIP, checked=checked)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
def test_shrunken_local_memory_traps_or_is_rejected(tiny_models, checked: bool) -> None:
    module, feeds, store = _tpu(tiny_models, "f32")
    prog = compile_for_machine(module, CHIP)
    need = max(c.local.addr + CHIP.per_lane(c.local.nbytes) for c in prog.commands
               if isinstance(c, Load))
    small = replace(CHIP, lane_bytes=max(CHIP.align, need // 2 // CHIP.align * CHIP.align))
    with pytest.raises(MachineTrap, match="outside the lane"):
        simulate(prog, store, feeds, small, checked=checked)
    # and the compiler refuses a chip that cannot hold even one slice of an op
    tiny = replace(CHIP, lane_bytes=256)
    module2, _, _ = _tpu(tiny_models, "f32")
    from toptpu.passes.layer_group import layer_group_function

    fn = next(op for op in module2.ops)
    with pytest.raises(LayerGroupError, match="cannot run from local memory|does not fit"):
        layer_group_function(fn, tiny)  # type: ignore[arg-type]


def _without(prog: Program, drop: Command) -> tuple[Command, ...]:
    """The program's commands without `drop`, renumbered."""
    return tuple(
        replace(c, id=i, deps=tuple(d - (d > drop.id) for d in c.deps if d != drop.id))
        for i, c in enumerate(c for c in prog.commands if c is not drop))


def _moved(c: Command, shift: int) -> Command:
    """`c` with the first local buffer it reads or writes moved by `shift` bytes."""
    if isinstance(c, Load | Store):
        return replace(c, local=replace(c.local, addr=c.local.addr + shift))
    assert isinstance(c, Compute) and c.ins[0] is not None
    return replace(c, ins=(replace(c.ins[0], addr=c.ins[0].addr + shift), *c.ins[1:]))


def _first(prog: Program, kind: type) -> Command:
    return next(c for c in prog.commands if isinstance(c, kind))


def _last_store(prog: Program) -> Command:
    return next(c for c in reversed(prog.commands) if isinstance(c, Store) and c.free)


def _edit(prog: Program, old: Command, new: Command) -> tuple[Command, ...]:
    return tuple(new if c is old else c for c in prog.commands)


#: corruptions of a good program and the trap each must raise (in both modes)
BAD_STREAMS = {
    # the first load dropped: its consumer reads a buffer nothing wrote
    "unwritten": (lambda p: _without(p, _first(p, Load)), "nothing wrote|not live"),
    # a load at an address that breaks the chip's alignment
    "misaligned": (lambda p: _edit(p, _first(p, Load), _moved(_first(p, Load), 1)),
                   "not 64-byte aligned"),
    # a compute reading its input where it was not written
    "moved": (lambda p: _edit(p, _first(p, Compute), _moved(_first(p, Compute), 4 * CHIP.align)),
              "nothing wrote|was written at|not live"),
    # the last store no longer frees its buffer: it is still live when the net ends
    "leaked": (lambda p: _edit(p, _last_store(p), replace(_last_store(p), free=())),
               "ended with live local buffers"),
}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_bad_streams_trap_in_both_modes(tiny_models, case: str, checked: bool) -> None:
    module, feeds, store = _tpu(tiny_models, "f32")
    prog = compile_for_machine(module, CHIP)
    simulate(prog, store, feeds, CHIP, checked=checked)  # the good one runs
    edit, match = BAD_STREAMS[case]
    prog.commands = edit(prog)
    with pytest.raises(MachineTrap, match=match):
        simulate(prog, store, feeds, CHIP, checked=checked)


@pytest.mark.parametrize("case", ["misaligned", "leaked"])
def test_fast_mode_finds_local_traps_once_per_plan(tiny_models, case: str,
                                                   monkeypatch) -> None:
    """The fast mode does not track where buffers live while it runs: the plan finds the
    first local-memory trap from the command stream alone (the step it fires at and the
    checked mode's message), the run executes the steps before it and raises it there;
    a good stream's plan has none."""
    module, feeds, store = _tpu(tiny_models, "f32")
    prog = compile_for_machine(module, CHIP)
    m, net, binding = _loaded(prog, store, feeds)
    assert net.plan(CHIP).local_trap is None
    prog.commands = BAD_STREAMS[case][0](prog)
    messages = []
    for checked in (True, False):
        m, net, binding = _loaded(prog, store, feeds, checked)
        with pytest.raises(MachineTrap) as trap:
            m.run(net, binding)
        messages.append(str(trap.value))
    plan = net.plan(CHIP)
    assert plan.local_trap is not None and plan.local_trap[1] == messages[0] == messages[1]
    at = plan.local_trap[0]
    assert (at == len(plan.steps)) == (case == "leaked")
    index = {id(step): i for i, step in enumerate(plan.steps)}
    ran: list[int] = []
    for kind in (steps_module.LoadStep, steps_module.StoreStep, steps_module.OpStep):
        def counted(self, m, views, run=kind.run):  # noqa: ANN001, ANN202
            ran.append(index[id(self)])
            return run(self, m, views)
        monkeypatch.setattr(kind, "run", counted)
    with pytest.raises(MachineTrap):
        m.run(net, binding)
    assert ran == list(range(at))


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
def test_bad_bindings_trap_in_both_modes(tiny_models, checked: bool) -> None:
    module, feeds, store = _tpu(tiny_models, "f32")
    prog = compile_for_machine(module, CHIP)
    machine, net, binding = _loaded(prog, store, feeds, checked)
    out = prog.outputs[0].name
    unbound = replace(binding, io={k: v for k, v in binding.io.items() if k != out})
    with pytest.raises(MachineTrap, match=f"IO tensor '{out}' is not bound"):
        machine.run(net, unbound)
    ro = machine.gmem.map("read-only out", np.zeros(prog.outputs[0].nbytes, np.uint8),
                          writable=False).base
    with pytest.raises(MachineTrap, match="write to read-only region 'read-only out'"):
        machine.run(net, replace(binding, io={**binding.io, out: ro}))
    with pytest.raises(MachineTrap, match="outside every mapped region"):
        machine.run(net, replace(binding, io={**binding.io, out: machine.gmem.capacity - 64}))
    machine.run(net, binding)  # and the machine still runs the net after a trap
    with pytest.raises(MachineTrap, match=f"IO tensor '{out}' is not bound"):
        machine.run(net, unbound)  # a trap is not kept as a resolved binding


def _outputs(m: Machine, prog, io: dict[str, int]) -> list[bytes]:  # noqa: ANN001
    return [m.gmem.tensor(io[o.name], tuple(o.shape), np.dtype(o.dtype), "test").tobytes()
            for o in prog.outputs]


def _bindings(m: Machine) -> int:
    """How many bindings (IO included) have their operands resolved and kept (the entries
    keyed without the IO are the operands but the IO tensors, shared by them)."""
    return sum(len(k) == 5 for k in m.gmem.resolved)


def test_resolved_operands_are_kept_per_binding_and_dropped_on_release(tiny_models) -> None:
    """A net's operands are resolved once per binding (a decode step reruns each layer's
    with the last step's addresses); other addresses are resolved anew, and unmapping
    drops them all: a run after `release` reads what is mapped now, not the old views."""
    module, feeds, store = _tpu(tiny_models, "f32")
    prog = compile_for_machine(module, CHIP)
    m, net, binding = _loaded(prog, store, feeds)
    m.run(net, binding)
    m.run(net, binding)
    assert _bindings(m) == 1
    want = _outputs(m, prog, dict(binding.io))

    def mapped(values: dict[str, np.ndarray]) -> dict[str, int]:
        io = {s.name: m.gmem.map(s.name, np.asarray(values[s.name]).astype(s.dtype)).base
              for s in prog.inputs}
        io |= {s.name: m.gmem.alloc(s.name, int(np.prod(s.shape)) * 4).base
               for s in prog.outputs}
        return io

    mark = m.gmem.mark()
    io = mapped(feeds)
    m.run(net, replace(binding, io=io))
    assert _bindings(m) == 2 and _outputs(m, prog, io) == want
    # the operands but the IO tensors resolved once for both (the weights, the regions)
    assert sum(len(k) == 4 for k in m.gmem.resolved) == 1
    m.gmem.release(mark)
    assert not m.gmem.resolved
    halved = {k: v * 0.5 if np.issubdtype(np.asarray(v).dtype, np.floating) else v
              for k, v in feeds.items()}
    io_again = mapped(halved)
    assert io_again == io  # the same addresses, new bytes
    m.run(net, replace(binding, io=io_again))
    fresh, fresh_net, fresh_binding = _loaded(prog, store, halved)
    fresh.run(fresh_net, fresh_binding)
    got = _outputs(m, prog, io_again)
    assert got == _outputs(fresh, prog, dict(fresh_binding.io)) and got != want


def _model_file(tiny_models, tmp_path) -> str:
    module, _, store = _tpu(tiny_models, "w4bf16")
    prog = compile_for_machine(module, CHIP)
    path = os.path.join(tmp_path, "m.toptpu")
    write_program_file(path, {"layer": prog}, store, CHIP)
    return path


def test_corrupt_truncated_and_newer_model_files_are_rejected(tiny_models, tmp_path) -> None:
    path = _model_file(tiny_models, tmp_path)
    with ModelFile(path) as f:
        info = f.sections["weights"]
    data = bytearray(open(path, "rb").read())
    # a flipped byte in the weight blob
    bad = bytearray(data)
    bad[info.offset + 5] ^= 0xFF
    p1 = os.path.join(tmp_path, "corrupt.toptpu")
    open(p1, "wb").write(bad)
    with pytest.raises(ModelFileError, match="checksum mismatch in section 'weights'"):
        ModelFile(p1)
    p2 = os.path.join(tmp_path, "short.toptpu")
    open(p2, "wb").write(data[: info.offset + 10])
    with pytest.raises(ModelFileError, match="truncated"):
        ModelFile(p2)
    newer = bytearray(data)
    newer[8:12] = (99).to_bytes(4, "little")
    p3 = os.path.join(tmp_path, "newer.toptpu")
    open(p3, "wb").write(newer)
    with pytest.raises(ModelFileError, match="version 99, newer"):
        ModelFile(p3)
    p4 = os.path.join(tmp_path, "magic.toptpu")
    open(p4, "wb").write(b"GGUF" + data[4:])
    with pytest.raises(ModelFileError, match="not a toptpu model file"):
        ModelFile(p4)
    # the good file still loads and no temporary file was left behind
    ModelFile(path).close()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_command_records_round_trip_and_bad_streams_are_refused(tiny_models) -> None:
    module, _, _ = _tpu(tiny_models, "w4bf16")
    prog = compile_for_machine(module, CHIP)
    data = prog.to_json()
    back = Program.from_json(data)
    assert back == prog and back.to_json() == data
    raw = json.loads(data)
    assert raw["schema"] == STREAM_SCHEMA

    def refused(edit, match: str) -> None:
        bad = json.loads(data)
        edit(bad)
        with pytest.raises(StreamError, match=match):
            Program.from_json(json.dumps(bad).encode())

    load = next(i for i, c in enumerate(raw["commands"]) if c["cmd"] == "load")
    # a stream of the old dict records (no version field), or of a newer version
    refused(lambda r: r.pop("schema"), "schema version 1.*recompile the model")
    refused(lambda r: r.update(schema=STREAM_SCHEMA + 1), "recompile the model")
    # a wrong field is named with its place
    refused(lambda r: r["commands"][load]["local"].update(nbytes=3),
            rf"commands\[{load}\]\.local\.nbytes is 3")
    refused(lambda r: r["commands"][load]["tensor"].update(space="disk"),
            rf"commands\[{load}\]\.tensor\.space is .disk., not a known Space")
    refused(lambda r: r["commands"][load].update(cmd="teleport"), r"cmd.*not 'load' or")
    refused(lambda r: r["commands"][load].update(deps=[load]), r"deps.*earlier commands")
    refused(lambda r: r["commands"][load].update(axis=9), rf"commands\[{load}\]\.axis is 9")
    with pytest.raises(StreamError, match="not JSON"):
        Program.from_json(b"{")


@pytest.mark.parametrize("length", [1, 16])
@pytest.mark.parametrize("mode", _fast_only(["bf16", "w4bf16", "f32"], ("w4bf16",)))
def test_modelled_time_respects_physics(tiny_models, mode: str, length: int) -> None:
    module, feeds, store = _tpu(tiny_models, mode, length)
    prog = compile_for_machine(module, CHIP)
    machine, net, binding = _loaded(prog, store, feeds)
    tl = machine.run(net, binding)
    bw = CHIP.bytes_per_cycle
    assert tl.cycles >= prog.inherent_bytes() / bw
    assert tl.cycles >= prog.flops / CHIP.peak_flops_per_cycle
    assert tl.cycles >= tl.dma_bytes / bw  # moved bytes too (>= the inherent ones)


def _loaded(prog, st, feeds, checked: bool = False):  # noqa: ANN202
    """A machine with the net's weights and IO mapped, the LoadedNet and its Binding."""
    from toptpu.backend.runtime.machine import Binding, LoadedNet

    m = Machine(CHIP, checked)
    w = {n: m.gmem.map(n, np.ascontiguousarray(st[n])).base for n in prog.weights}
    io = {}
    for spec in prog.inputs:
        io[spec.name] = m.gmem.map(spec.name, np.asarray(feeds[spec.name]).astype(
            spec.dtype)).base
    for spec in prog.outputs:
        io[spec.name] = m.gmem.alloc(spec.name, int(np.prod(spec.shape)) * 4).base
    act = m.gmem.alloc("act", prog.regions.activations).base
    const = m.gmem.alloc("const", prog.regions.constants).base
    return m, LoadedNet(prog), Binding(io, w, act, const)


def test_a_program_text_is_parsed_and_verified_once_and_a_bad_one_at_every_load() -> None:
    """`program_module` (the model file's writer and the machine's loads): a text that parsed
    and verified gives the module already made; one that does not verify is refused at every
    load (nothing of it is kept), and a text that differs from a kept one is parsed anew."""
    from toptpu.backend.formats.program import program_module
    from toptpu.dialects.ir_text import IRVerifyError

    head = "func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
    good = head + "  func.return %x : tensor<2xf32>\n}\n"
    bad = head + "  func.return\n}\n"
    first = program_module(good, "stream:f")
    assert program_module(good, "stream:g") is first
    assert program_module(good.replace("%x", "%y"), "stream:f") is not first
    for _ in range(2):
        with pytest.raises(IRVerifyError):
            program_module(bad, "stream:f")
