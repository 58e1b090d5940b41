"""A prefill chunk's experts in blocks of experts (the expert-major schedule: layer-group's
tiles plans whose reduction parts are blocks of consecutive experts, `expert_blocks`):
where a layer's experts do not fit local memory, each expert some row chose is loaded
once for the chunk's rows, an expert nobody chose never, and the blocks fold into one f32
accumulator in ascending order — the machine's result is the interpreter's bit for bit,
and the whole op's. Small chips (a few KB a lane) make the tiny experts not fit."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import test_moe
from test_moe import _fetch_run

from toptpu.backend.formats.commands import Compute, Load
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.machine import LoadedNet
from toptpu.backend.runtime.profile import profile_timeline, summary_table
from toptpu.frontends.tiny_models import tiny_model


def _block(inter: int) -> object:
    """A tiny Qwen3-MoE block (8 experts, top-2, hidden 64) with experts of `inter`."""
    return tiny_model("qwen3_moe", layers=1, moe_intermediate_size=inter).model.layers[0].mlp


def _indexed(program) -> list[Load]:
    return [c for c in program.commands if isinstance(c, Load) and c.index is not None]


def _check_each_chosen_expert_once(program, machine, idx: np.ndarray, tensors: int) -> None:
    """Every indexed load is one block's (its rows a block of the experts), each chosen
    expert read exactly once per stacked tensor over the chunk, no other expert read."""
    program.check()  # a model file's checks of its command streams
    loads = _indexed(program)
    assert any(ld.part_first_row > 0 for ld in loads)  # blocks of experts
    chosen = {int(i) for i in idx.reshape(-1) if i >= 0}
    per_tensor: dict[str, Counter] = {}
    for f in machine.fetched:
        per_tensor.setdefault(str(f.tensor.name), Counter()).update(f.rows)
    assert len(per_tensor) == tensors
    for name, count in per_tensor.items():
        assert set(count) == chosen, name
        assert set(count.values()) == {1}, name  # each once
    # what the loads hold of every expert: the experts once (the profile's denominator)
    all_rows: Counter = Counter()
    for ld in loads:
        all_rows[str(ld.tensor.name)] += ld.part_shape()[0]
    assert set(all_rows.values()) == {8}
    # `profile`'s expert bytes of the step: what the run read, of a layer's experts once
    read = sum(f.nbytes for f in machine.fetched)
    every = sum(np.prod(ld.shape) * np.dtype(ld.dtype).itemsize
                for ld in {ld.tensor.name: ld for ld in loads}.values())
    p = profile_timeline(machine.timeline_of_run(LoadedNet(program)), test_moe.CHIP,
                         program.inherent_bytes(), program.flops,
                         (read, program.indexed_bytes()[1]))
    assert (p.fetched_bytes, p.fetched_all_bytes) == (read, every)
    assert f"experts fetched by index {read / 1e6:.2f} MB a run" in summary_table(
        [p], test_moe.CHIP)


@pytest.mark.parametrize("valid", [29, 3])
def test_f32_experts_in_blocks_load_each_chosen_expert_once(monkeypatch, valid: int) -> None:
    """f32 experts of 32 over hidden 64 (24 KB an expert), a chip of 2048 B a lane (8
    experts need 3072): the layer group cuts the 32-row chunk's experts in blocks (before:
    16 row slices of 2 rows, each fetching its rows' experts again: 2 to 4 of 8 each).
    Each chosen expert is read once per projection, the unchosen (3 real rows of 32 choose
    at most 6 of 8; the padded rows route nowhere) never; machine = interpreter on the
    grouped net = the ungrouped interpreter, bit for bit."""
    monkeypatch.setattr(test_moe, "CHIP", dataclasses.replace(test_moe.CHIP, lane_bytes=2048))
    program, machine, idx, (got, want, grouped) = _fetch_run(_block(32), t=32, n_valid=valid,
                                                            grouped=True)
    assert np.array_equal(got, grouped)
    assert np.array_equal(got, want)
    if valid == 3:
        assert len({int(i) for i in idx.reshape(-1)}) < 8
    _check_each_chosen_expert_once(program, machine, idx, 3)


def test_4bit_experts_in_blocks_load_each_chosen_expert_once(monkeypatch) -> None:
    """4-bit experts (w4f32, group 32: integers, scales and zero points of gate, up and
    down, 9 stacked tensors) of 256 over hidden 64, a chip of 3072 B a lane: the blocks of
    experts, each chosen expert's 9 tensors read once; machine = interpreter bit for
    bit."""
    monkeypatch.setattr(test_moe, "CHIP", dataclasses.replace(test_moe.CHIP, lane_bytes=3072))
    program, machine, idx, (got, want, grouped) = _fetch_run(
        _block(256), t=32, n_valid=29, mode="w4f32", group=32, grouped=True)
    assert np.array_equal(got, grouped)
    assert np.array_equal(got, want)
    parts = {c.parts for c in program.commands
             if isinstance(c, Compute) and c.kind.endswith("moe_experts")}
    assert parts == {8}
    _check_each_chosen_expert_once(program, machine, idx, 9)


def test_expert_blocks_folded_in_order_are_the_whole_op_bit_for_bit() -> None:
    """The part kernel over blocks of experts (`block`: first, count), folded into one
    accumulator in ascending order, is the whole op bit for bit — with each block's
    weights at their places or packed (its chosen experts only, ascending); a block whose
    weights hold fewer rows than its chosen experts is an IndexError."""
    rng = np.random.default_rng(0)
    e, inter, h, t, k = 8, 16, 32, 12, 2
    gate, up = (rng.standard_normal((e, inter, h), np.float32) for _ in range(2))
    down = rng.standard_normal((e, h, inter), np.float32)
    x = rng.standard_normal((t, h), np.float32)
    weights = rng.random((t, k), np.float32)
    indices = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    indices[-2:] = -1  # padded rows
    whole = K.moe_experts(x, gate, up, down, weights, indices)
    for count in (1, 2, 4):
        acc = acc_packed = None
        for first in range(0, e, count):
            lo, hi = first, first + count
            at_place = (gate[lo:hi], up[lo:hi], down[lo:hi])
            acc = K.moe_experts_part(acc, x, *at_place, weights, indices, fetched_from=e,
                                     block=(first, count))
            rows = np.unique(indices[(indices >= lo) & (indices < hi)])
            # packed: a buffer of fewer rows than the block, its chosen experts ascending
            held = (gate[rows], up[rows], down[rows]) if 0 < rows.size < count else at_place
            acc_packed = K.moe_experts_part(acc_packed, x, *held, weights, indices,
                                            fetched_from=e, block=(first, count))
            if rows.size > 1:
                with pytest.raises(IndexError, match="its weights hold"):
                    K.moe_experts_part(None, x, *(w[:rows.size - 1] for w in held),
                                       weights, indices, fetched_from=e,
                                       block=(first, count))
        assert np.array_equal(K.moe_experts_finish(acc, like=x), whole), count
        assert np.array_equal(K.moe_experts_finish(acc_packed, like=x), whole), count


def test_experts_too_large_for_local_memory_stream_in_blocks_times_parts_of_i(
        monkeypatch) -> None:
    """f32 experts of 256 over hidden 64 (192 KB an expert, 3 KB a lane) on a chip of
    4096 B a lane: not one expert fits twice, so each block of experts streams in parts of
    its intermediate axis (`tiles` R, C, blocks, parts of I): each chosen expert's every
    part is read once — the chunk's expert bytes are the chosen experts' bytes once, the
    unchosen's none; machine = interpreter on the grouped net bit for bit."""
    monkeypatch.setattr(test_moe, "CHIP", dataclasses.replace(test_moe.CHIP, lane_bytes=4096))
    block = _block(256)
    program, machine, idx, (got, want, grouped) = _fetch_run(block, t=32, n_valid=5,
                                                            grouped=True)
    assert np.array_equal(got, grouped)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # parts of I: f32 sums
    ops = [c for c in program.commands
           if isinstance(c, Compute) and c.kind.endswith("moe_experts")]
    assert ops[0].parts > 8  # 8 blocks of one expert, each in parts of I
    chosen = {int(i) for i in idx.reshape(-1) if i >= 0}
    assert len(chosen) < 8
    expert = 256 * 64 * 4  # bytes of one expert's gate, up or down
    moved: Counter = Counter()
    for f in machine.fetched:
        assert set(f.rows) <= chosen
        moved[str(f.tensor.name)] += f.nbytes
    assert len(moved) == 3 and set(moved.values()) == {len(chosen) * expert}
    reads = Counter((str(f.tensor.name), r) for f in machine.fetched for r in f.rows)
    assert set(reads.values()) == {ops[0].parts // 8}  # each part of I once
