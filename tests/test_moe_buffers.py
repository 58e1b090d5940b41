"""The experts' local buffers hold the experts a step fetches, not all E (layer-group's
buffers of the fetched experts, `top.moe_experts` `fetched_from`): a decode step's buffers
are k experts, a prefill chunk's min(E, T x k); the machine executes that bit for bit as
the interpreter; the one-chip modelled decode no longer grows with E at fixed k."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_moe import _fetch_run, _moe_block, _x

from toptpu.backend.formats.commands import Compute, Load
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.machine import command_costs
from toptpu.backend.target.chips import get_chip
from toptpu.backend.target.cost import net_timing
from toptpu.estimate import compile_programs
from toptpu.frontends.hf_loader import read_config
from toptpu.passes import layer_group
from toptpu.request import CompileRequest

CONFIG = os.path.join(os.path.dirname(__file__), "..", "bench", "configs", "qwen3-30B-A3B",
                      "config.json")


def _indexed(program) -> list[Load]:
    return [c for c in program.commands if isinstance(c, Load) and c.index is not None]


def test_a_prefill_chunk_of_few_tokens_holds_the_experts_they_can_name() -> None:
    """3 rows of top-2 over 8 experts can name at most 6: the buffers hold 6 rows; the
    machine's result is the interpreter's bit for bit and it reads each chosen expert once
    (a padded row routes nowhere: with 2 real rows, at most 4 are read)."""
    block = _moe_block("qwen3_moe")
    e, k = block.experts.gate_up_proj.shape[0], block.gate.top_k
    assert 3 * k < e
    for valid in (3, 2):
        program, machine, idx, (got, want) = _fetch_run(block, t=3, n_valid=valid)
        assert np.array_equal(got, want)
        loads = _indexed(program)
        assert len(loads) == 3
        assert all(ld.local.shape[0] == 3 * k and ld.part_shape()[0] == e for ld in loads)
        chosen = sorted({int(i) for i in idx.reshape(-1)})
        for f in machine.fetched:
            assert list(f.rows) == chosen


def test_row_slices_of_loaded_indices_fetch_their_own_experts(monkeypatch) -> None:
    """A group that slices the chunk's rows while the experts' weights are not sliced
    (here: a chip of 3584 B per lane, 32 rows of top-2 over 8 experts) holds, per slice,
    the experts the slice's rows can name (4 of 8): the indexed loads are issued again
    for each slice's indices (before, codegen refused the plan: "a buffer of an indexed
    load would serve slices of different indices", as it did for Qwen3.5-35B-A3B's
    widths in w4bf16). The machine's result is the interpreter's on the grouped net bit
    for bit; every fetch reads chosen experts only, all of them."""
    import dataclasses

    import test_moe

    block = _moe_block("qwen3_moe")
    e, k = block.experts.gate_up_proj.shape[0], block.gate.top_k
    monkeypatch.setattr(test_moe, "CHIP", dataclasses.replace(test_moe.CHIP, lane_bytes=3584))
    # the plan where blocks of experts do not fit or cost more: turned off here, where
    # they would be chosen (tests/test_moe_expert_major.py)
    monkeypatch.setattr(layer_group, "_expert_block_axes", lambda op: None)
    program, machine, idx, (got, _, grouped) = _fetch_run(block, t=32, n_valid=29,
                                                          grouped=True)
    assert np.array_equal(got, grouped)
    loads = _indexed(program)
    assert len(loads) > 3 and all(ld.local.shape[0] < e == ld.part_shape()[0]
                                  for ld in loads)
    chosen = {int(i) for i in idx.reshape(-1)}
    fetched = [set(f.rows) for f in machine.fetched]
    assert len(fetched) == len(loads)
    assert all(f <= chosen and len(f) <= loads[0].local.shape[0] for f in fetched)
    assert set().union(*fetched) == chosen
    assert loads[0].local.shape[0] % k == 0


def test_the_experts_kernel_reads_fetched_rows_in_ascending_order() -> None:
    """`fetched_from`: the weights' rows are the chosen experts in ascending order; the
    result is the one over every expert's rows bit for bit; more chosen experts than rows
    is an IndexError, as is an index past `fetched_from`."""
    block = _moe_block("qwen3_moe")
    gate_up = block.experts.gate_up_proj.detach().numpy()
    down = block.experts.down_proj.detach().numpy()
    inter = down.shape[2]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    x = _x(2).numpy()
    weights = np.array([[0.7, 0.3], [0.6, 0.4]], np.float32)
    indices = np.array([[5, 1], [1, -1]], np.int32)
    whole = K.moe_experts(x, gate, up, down, weights, indices)
    rows = [1, 5]
    held = np.zeros((3, *gate.shape[1:]), gate.dtype)
    held_up, held_down = held.copy(), np.zeros((3, *down.shape[1:]), down.dtype)
    held[:2], held_up[:2], held_down[:2] = gate[rows], up[rows], down[rows]
    got = K.moe_experts(x, held, held_up, held_down, weights, indices, fetched_from=8)
    assert np.array_equal(got, whole)
    with pytest.raises(IndexError, match="name 2 experts, its weights hold 1"):
        K.moe_experts(x, held[:1], held_up[:1], held_down[:1], weights, indices,
                      fetched_from=8)
    with pytest.raises(IndexError, match="index 8 is out of range for 8 experts"):
        K.moe_experts(x, held, held_up, held_down, weights, np.array([[8, 1], [1, 0]]),
                      fetched_from=8)


def _decode_net(tmp_path, experts: int, fetched: bool = True):
    """Qwen3-30B-A3B's decode net (block_cache, bf16, one bm1684x) with `experts` experts
    (placeholder weights): its program and modelled seconds; `fetched` False: the layer
    group's buffers of all E (`_fetched_ops` making none)."""
    with open(CONFIG) as f:
        raw = json.load(f)
    raw["num_experts"] = experts
    d = tmp_path / f"e{experts}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    config, _ = read_config(str(d))
    req = CompileRequest.make(mode="bf16", seq_length=512, max_input_length=128)
    saved = layer_group._fetched_ops
    if not fetched:
        layer_group._fetched_ops = lambda p: {}
    try:
        program = compile_programs(config, req, nets=["block_cache"])["block_cache"]
    finally:
        layer_group._fetched_ops = saved
    chip = get_chip("bm1684x")
    return program, net_timing(command_costs(program.commands), chip).seconds(chip)


def _parts(program) -> int:
    return max(c.parts for c in program.commands
               if isinstance(c, Compute) and c.kind.endswith("moe_experts"))


def test_the_decode_buffers_hold_k_experts_and_the_time_does_not_grow_with_e(tmp_path) -> None:
    """At Qwen3-30B-A3B's widths (experts of 768 over H 2048, top-8, bf16) a decode step's
    experts stream through local memory in reduction parts: the buffers hold the 8 experts
    the step fetches whatever E (16 or 32), so the parts and the modelled time of the
    decode net stay (the router's E columns aside); with buffers of all E (the layer
    group before) the parts double with E and the time grows."""
    k = 8
    nets = {e: _decode_net(tmp_path, e) for e in (16, 32)}
    for e, (program, _) in nets.items():
        loads = _indexed(program)
        assert loads and all(ld.local.shape[0] == k and ld.part_shape()[0] == e
                             for ld in loads), e
        assert sum(ld.nbytes for ld in loads) * e == sum(ld.all_nbytes for ld in loads) * k
    assert _parts(nets[16][0]) == _parts(nets[32][0])
    assert nets[32][1] <= nets[16][1] * 1.01
    old = {e: _decode_net(tmp_path, e, fetched=False) for e in (16, 32)}
    assert all(ld.local.shape[0] == 32 for ld in _indexed(old[32][0]))
    assert _parts(old[32][0]) == 2 * _parts(old[16][0])
    assert old[32][1] > old[16][1] * 1.1
    assert nets[32][1] < old[32][1]
