"""The fast mode's joined slices (`machine.SliceJoin`): a sliced matmul computed as one host
product gives the checked mode's bytes, whether the join is used, refused by its bit-for-bit
check, or skipped because its input is written while its slices load."""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from toptpu.backend.formats.program import Program, write_program_file
from toptpu.backend.runtime import joins as joins_module
from toptpu.backend.runtime import steps as steps_module
from toptpu.backend.runtime.joins import LoadGuard, SliceJoin, WholeRows
from toptpu.backend.runtime.machine import Machine
from toptpu.backend.runtime.simulate import ProgramFile
from toptpu.backend.target.chips import get_chip
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes

#: a chip with little local memory: the layer's matmuls are sliced, by rows and by columns
SMALL = replace(get_chip("bm1684x"), lanes=2, lane_bytes=4096, dma_latency_cycles=8,
                compute_latency_cycles=4)
#: 4x the local memory: the residual add, the RMS norm and the matmuls after it share row
#: slices in one group
MID = replace(SMALL, lane_bytes=16384)
#: 6x: the o projection, the residual add, the norm and the MLP share row slices in one
#: group (as `block:16` of Qwen2.5-0.5B on bm1684x)
WIDE = replace(SMALL, lane_bytes=24576)
TOKENS = 16


def _compiled_layer(tiny_models, tmp_path_factory, chip,  # noqa: ANN001
                    tokens: int = TOKENS) -> tuple[str, Program, dict[str, np.ndarray]]:
    """A w4bf16 decoder layer of `tokens` tokens compiled for `chip`, written to a file."""
    imp = import_decoder_layer(tiny_models("qwen2"), tokens, mask_value=-10000.0)
    module = imp.module.clone()
    store = imp.store
    run_passes(module, tpu_pipeline_passes("w4bf16"), store=store)
    prog = compile_for_machine(module, chip)
    path = os.path.join(tmp_path_factory.mktemp("joins"), "layer.toptpu")
    write_program_file(path, {"layer": prog}, store, chip)
    return path, prog, dict(imp.feeds)


@pytest.fixture(scope="module")
def sliced_layer(tiny_models, tmp_path_factory) -> tuple[str, Program, dict[str, np.ndarray]]:
    return _compiled_layer(tiny_models, tmp_path_factory, SMALL)


@pytest.fixture(scope="module")
def mid_layer(tiny_models, tmp_path_factory) -> tuple[str, Program, dict[str, np.ndarray]]:
    return _compiled_layer(tiny_models, tmp_path_factory, MID)


@pytest.fixture(scope="module")
def wide_layer(tiny_models, tmp_path_factory) -> tuple[str, Program, dict[str, np.ndarray]]:
    return _compiled_layer(tiny_models, tmp_path_factory, WIDE)


@pytest.fixture(scope="module")
def attention_rows_layer(tiny_models, tmp_path_factory
                         ) -> tuple[str, Program, dict[str, np.ndarray]]:
    """32 tokens on 2 lanes of 8 KiB: the attention, the o projection, the residual add
    and the norm share row slices in one group (as `block_kv` of Qwen2.5-0.5B at 128
    tokens on bm1684x)."""
    return _compiled_layer(tiny_models, tmp_path_factory, replace(SMALL, lane_bytes=8192),
                           tokens=32)


@pytest.fixture(scope="module", params=["small", "mid", "wide", "attention"])
def any_sliced_layer(request) -> tuple[str, Program, dict[str, np.ndarray]]:  # noqa: ANN001
    """The layer compiled for `SMALL`, `MID` and `WIDE`, and the attention's rows."""
    return request.getfixturevalue({"small": "sliced_layer", "mid": "mid_layer",
                                    "wide": "wide_layer",
                                    "attention": "attention_rows_layer"}[request.param])


def _joins(pf: ProgramFile) -> list[SliceJoin]:
    plan = pf.nets["layer"].plan(pf.chip)
    found = {id(s.join): s.join for s in plan.steps
             if isinstance(s, steps_module.OpStep) and s.join is not None}
    return list(found.values())


def test_sliced_matmuls_are_found_by_rows_and_by_columns(sliced_layer) -> None:
    path, _, _ = sliced_layer
    joins = _joins(ProgramFile(path))
    assert {j.kind for j in joins} == {"rows", "cols"}
    for j in joins:
        assert len(j.steps) >= 2
        assert [s.join_at for s in j.steps] == list(range(len(j.steps)))


def _computed(w: WholeRows) -> str:
    """A whole as an expression: `g<operand>` for a global tensor read whole,
    `join(<op>)` for a rows join's product, `<op>(...)` for a row-local op (`res`: a
    resident input)."""
    if w.product is not None:
        return f"join({w.product.steps[0].op.name})"
    if w.step is None:
        return f"g{w.g}"
    args = ", ".join(_computed(c) if c is not None else "res" for c in w.ins)
    return f"{w.step.op.name}({args})"


def test_a_rows_join_computes_its_input_through_the_groups_row_local_ops(
        sliced_layer, tiny_models, tmp_path_factory) -> None:
    """Where the group computes a matmul's input per slice (a reshape of the loaded rows;
    the residual add of two row-sliced tensors and the RMS norm after it), the join
    computes it on the whole tensors; the matmuls of one input share one whole."""
    small = {_computed(j.rows) for j in _joins(ProgramFile(sliced_layer[0])) if j.rows}
    assert any(e.startswith("tpu.reshape(g") for e in small), small
    path, _, _ = _compiled_layer(tiny_models, tmp_path_factory, MID)
    joins = [j for j in _joins(ProgramFile(path)) if j.rows is not None]
    normed = [j for j in joins if _computed(j.rows).startswith("tpu.rms_norm(tpu.add(g")]
    assert len(normed) >= 2, [_computed(j.rows) for j in joins]
    assert all(j.rows is normed[0].rows for j in normed)
    assert all(len(j.sources) == 2 for j in normed)  # both the add's inputs are guarded


def test_a_rows_join_computes_its_input_through_another_joins_product(wide_layer) -> None:
    """Where the o projection, the residual add, the norm and the MLP share row slices,
    the gate and up projections' joins compute their whole input from the o projection's
    whole product (computed at its first slice, before theirs), and the down projection's
    from the gate's and up's: every matmul of the group is one host product."""
    pf = ProgramFile(wide_layer[0])
    exprs = {_computed(j.rows) for j in _joins(pf) if j.rows is not None}
    assert "tpu.rms_norm(tpu.add(g4, join(tpu.a16_matmul)), res)" in exprs, exprs
    assert "tpu.mul(tpu.silu(join(tpu.a16_matmul)), join(tpu.a16_matmul))" in exprs, exprs
    plan = pf.nets["layer"].plan(pf.chip)
    ops = [s for s in plan.steps if isinstance(s, steps_module.OpStep) and s.special]
    count = Counter((s.cmd.group, s.cmd.op) for s in ops)
    sliced = [s for s in ops if count[(s.cmd.group, s.cmd.op)] > 1]
    assert len(sliced) >= 8 and all(s.join is not None for s in sliced)


def test_a_rows_join_computes_its_input_through_a_row_sliced_attention(
        attention_rows_layer) -> None:
    """An attention sliced by query rows (its mask by the same rows, keys and values
    resident) is computed whole for the o projection's join: each slice takes its rows
    of it (checked bit for bit on the first run), and every slice's o projection its
    part of one product."""
    path, _, feeds = attention_rows_layer
    pf = ProgramFile(path)
    exprs = {_computed(j.rows) for j in _joins(pf) if j.rows is not None}
    assert any(e.startswith("tpu.reshape(tpu.attention(g") and e.endswith(", res, res))")
               for e in exprs), exprs
    want = ProgramFile(path, checked=True).run("layer", feeds).outputs["out"]
    for run in range(2):
        got = pf.run("layer", feeds).outputs["out"]
        assert got.tobytes() == want.tobytes(), run
    attention = [w for w in _shared_wholes(pf) if w.step is not None
                 and w.step.op.name == "tpu.attention"]
    assert attention and all(len(w.slices) > 1 for w in attention)
    assert all(pf.machine.part_ok.get(w) for w in attention)


def test_joined_runs_are_bit_identical_to_the_checked_mode(any_sliced_layer,
                                                           monkeypatch) -> None:
    path, _, feeds = any_sliced_layer
    want = ProgramFile(path, checked=True).run("layer", feeds).outputs["out"]
    fast = ProgramFile(path)
    joins = _joins(fast)
    assert joins
    calls: list[SliceJoin] = []
    whole = SliceJoin._whole

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(self)
        return whole(self, *args)

    monkeypatch.setattr(SliceJoin, "_whole", counted)
    for run in range(3):
        got = fast.run("layer", feeds).outputs["out"]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), run
        # each join checked bit for bit on its first run; one whole product per join a run
        assert set(fast.machine.join_ok) == set(joins)
        assert sorted(map(id, calls)) == sorted(map(id, joins))
        calls.clear()


def _lowest_bit_flipped(w: np.ndarray) -> np.ndarray:
    """A copy of `w` with the lowest mantissa bit of its first element flipped."""
    w = np.ascontiguousarray(w).copy()
    w.reshape(-1).view(np.uint8)[0] ^= 1
    return w


def _shared_wholes(pf: ProgramFile) -> list[WholeRows]:
    """The row-local ops whose slices take their parts of a join's whole."""
    plan = pf.nets["layer"].plan(pf.chip)
    found = {id(s.part_of): s.part_of for s in plan.steps
             if isinstance(s, steps_module.OpStep) and s.part_of is not None}
    return list(found.values())


def test_row_local_slices_take_their_parts_of_the_joins_wholes(mid_layer,
                                                               monkeypatch) -> None:
    """The RMS norm (and the residual add before it) that a rows join computes whole for
    its product, and the MLP's silu of the loaded gate and its product with the up
    projection's rows join, computed whole once: from the second run on, their slices take
    their parts of those wholes (each checked bit for bit on the first run) and do not
    compute again; the bytes stay the checked mode's."""
    path, _, feeds = mid_layer
    want = ProgramFile(path, checked=True).run("layer", feeds).outputs["out"]
    fast = ProgramFile(path)
    wholes = _shared_wholes(fast)
    names = {w.step.op.name for w in wholes}  # type: ignore[union-attr]
    assert names == {"tpu.rms_norm", "tpu.add", "tpu.silu", "tpu.mul"}, names
    exprs = {_computed(w) for w in wholes}
    assert "tpu.mul(tpu.silu(join(tpu.a16_matmul)), join(tpu.a16_matmul))" in exprs, exprs
    assert all(len(w.slices) >= 2 for w in wholes)
    sliced = {id(s) for w in wholes for s in w.slices}
    computed: list[int] = []
    compute = steps_module.OpStep.compute

    def counted(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        computed.append(id(self))
        return compute(self, *args, **kw)

    monkeypatch.setattr(steps_module.OpStep, "compute", counted)
    for run in range(3):
        got = fast.run("layer", feeds).outputs["out"]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), run
        assert fast.machine.part_ok == {w: True for w in wholes}
        own = sliced & set(computed)
        assert bool(own) == (run == 0), run  # the first run computes every slice
        computed.clear()


def test_a_part_whose_whole_differs_is_refused_and_its_slices_compute(
        mid_layer, monkeypatch) -> None:
    """The RMS norm's whole corrupted in its lowest bit: its slices' first run finds their
    parts differ, and they compute their own from then on (the add under it still takes
    its parts; the MLP's silu and product, whose wholes come from the products of the
    joins that norm feeds, are refused the same way); the bytes stay the checked mode's."""
    path, _, feeds = mid_layer
    want = ProgramFile(path, checked=True).run("layer", feeds).outputs["out"]
    value = WholeRows.value

    def norm_bit_flipped(self, m, views):  # noqa: ANN001, ANN202
        w = value(self, m, views)
        if self.step is not None and self.step.op.name == "tpu.rms_norm":
            w = _lowest_bit_flipped(w)
        return w

    monkeypatch.setattr(WholeRows, "value", norm_bit_flipped)
    fast = ProgramFile(path)
    for _ in range(2):
        got = fast.run("layer", feeds).outputs["out"]
        assert got.tobytes() == want.tobytes()
    verdicts = {w.step.op.name: ok for w, ok in fast.machine.part_ok.items()}  # type: ignore[union-attr]
    assert verdicts == {"tpu.rms_norm": False, "tpu.add": True, "tpu.silu": False,
                        "tpu.mul": False}


def test_a_join_whose_parts_differ_is_refused_and_its_slices_run(any_sliced_layer,
                                                                 monkeypatch) -> None:
    path, _, feeds = any_sliced_layer
    want = ProgramFile(path, checked=True).run("layer", feeds).outputs["out"]
    whole = SliceJoin._whole

    def last_bit_flipped(self, *args):  # noqa: ANN001, ANN002, ANN202
        w = whole(self, *args)
        return None if w is None else _lowest_bit_flipped(w)

    monkeypatch.setattr(SliceJoin, "_whole", last_bit_flipped)
    fast = ProgramFile(path)
    for _ in range(2):
        got = fast.run("layer", feeds).outputs["out"]
        assert got.tobytes() == want.tobytes()
    assert fast.machine.join_ok and not any(fast.machine.join_ok.values())


def test_a_rows_join_skips_a_run_whose_input_is_stored_while_it_loads() -> None:
    """The guard: an operand stored between the first and last load of the input's slices
    that overlaps the input's global bytes makes the run compute the slices alone."""
    m = Machine(SMALL)
    x = np.zeros((1, 8, 4), np.float32)
    join = SliceJoin("rows", [], [], [0], [1], WholeRows(g=0))
    overlapping = [(x, True, 1000), (np.zeros(4, np.float32), True, 1000 + x.nbytes - 4)]
    assert join._whole(m, None, [], overlapping) is None  # type: ignore[arg-type]

    class Step:
        def compute(self, m, args, key=None):  # noqa: ANN001, ANN201
            return [args[0] * 2]

    apart = [(x + 1, True, 1000), (np.zeros(4, np.float32), True, 1000 + x.nbytes)]
    got = join._whole(m, Step(), [x], apart)  # type: ignore[arg-type]
    assert got is not None and np.array_equal(got, (x + 1) * 2)


def test_a_join_is_refused_when_its_resident_buffer_is_written_between_slices(
        sliced_layer) -> None:
    """A cols join's input (a rows join's weight) must hold one value across the slices: a
    step writing that buffer between them (here a load inserted into the real plan) makes
    the analysis refuse the join."""
    path, _, _ = sliced_layer
    pf = ProgramFile(path)
    plan = pf.nets["layer"].plan(pf.chip)
    steps = list(plan.steps)
    for kind in ("cols", "rows"):
        join = next(j for j in _joins(pf) if j.kind == kind)
        chain = [(steps.index(s), s) for s in join.steps]
        first, last = chain[0][0], chain[-1][0]
        assert not joins_module._written_between(steps, first, last, join.resident)
        resident = join.steps[0].ins[0] if kind == "cols" else join.steps[0].ins[1]
        load = copy.copy(next(s for s in steps if isinstance(s, steps_module.LoadStep)))
        load.local = resident
        at = chain[1][0]
        edited = [*steps[:at], load, *steps[at:]]
        assert joins_module._written_between(edited, first, last + 1, join.resident)


def test_a_chains_parts_follow_its_load_guard_and_its_joins_products() -> None:
    """A chain of row-local slices with no join of its own (the MLP's silu and product)
    takes its parts only while no store of the run overlaps the global tensor its slices
    load (`LoadGuard`), and only in runs where the rows join whose product it reads
    computed that product (else the whole is unknown and the slices compute their own)."""
    x = np.arange(16, dtype=np.float32).reshape(1, 8, 2)
    guard = LoadGuard([0], [1])
    store = np.zeros(4, np.float32)
    assert not guard.inputs_stable([(x, True, 1000), (store, True, 1000 + x.nbytes - 4)])
    assert guard.inputs_stable([(x, True, 1000), (store, True, 1000 + x.nbytes)])
    assert LoadGuard([], [1]).inputs_stable([(x, True, 1000), (store, True, 1000)])
    m = Machine(SMALL)
    join = SliceJoin("rows", [], [], [], [])
    product = WholeRows(product=join)
    assert product.value(m, []) is None  # the join computed no whole in this run
    m.joined[join] = x
    assert product.value(m, []) is x


def test_open_checks_the_decode_nets_joins_without_accounting(tmp_path) -> None:  # noqa: ANN001
    """A vocabulary large enough that the lm_head is sliced by output channels: opening the
    model runs it once on seeded inputs, so its join is checked before the first request
    (nothing charged to the modelled clock); the tokens equal the interpreter's."""
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.tiny_models import build_tokenizer, tiny_model

    path = str(tmp_path / "qwen-vocab.toptpu")
    compile_model(tiny_model("qwen2", vocab_size=151936), path, mode="w4bf16", seq_length=64,
                  max_input_length=16, tokenizer=build_tokenizer(), progress=None)
    rt = Runtime.open(path, "machine")
    ex = rt.ex
    plan = ex._loaded["lm_head"].plan(ex.chip)  # type: ignore[attr-defined]
    joins = {id(s.join): s.join for s in plan.steps
             if isinstance(s, steps_module.OpStep) and s.join is not None}
    assert joins and all(ex.machine.join_ok.get(j) is not None  # type: ignore[attr-defined]
                         for j in joins.values())
    assert ex.modelled_seconds() == 0.0 and not ex.stats  # type: ignore[attr-defined]
    ids = [5, 17, 300, 41, 9]
    got = rt.generate(ids, 6, stop_on_eos=False).generated_ids
    assert got == Runtime.open(path, "interpreter").generate(ids, 6,
                                                             stop_on_eos=False).generated_ids
