"""The DMA side of the cost model: a transfer's window is a set of contiguous runs in its
global tensor, each moving whole DDR bursts (`cost.ddr_bytes`, `Chip.dma_burst_bytes`);
the layer group's planner charges every load its stream makes (a 2-D tile group's weight
blocks once per tile when the rows loop is outside); and a reduction split in parts
replaces a plan without them only beyond `REDUCTION_MARGIN`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from test_tiles import lane_without_single_axis, matmul_module, tile_groups

from toptpu.backend.formats.commands import Cut, GlobalRef, Load, LocalRef, Space
from toptpu.backend.runtime.machine import command_costs, command_cycles
from toptpu.backend.target.chips import get_chip
from toptpu.backend.target.cost import ddr_bytes, dma_cycles, net_timing, run_bytes
from toptpu.dialects.ir_text import parse_ir
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.layer_group import REDUCTION_MARGIN, _reduction_plans, plan_span
from toptpu.passes.slicing import SliceKind

CHIP = get_chip("bm1684x")
BURST = CHIP.dma_burst_bytes


def test_runs_of_windows() -> None:
    assert run_bytes((151936, 896), (151936, 896), 2) == 151936 * 896 * 2  # whole: one run
    assert run_bytes((151936, 896), (1024, 896), 2) == 1024 * 896 * 2  # leading rows
    assert run_bytes((151936, 896), (151936, 16), 2) == 32  # 16 columns of every row
    assert run_bytes((1, 16, 896), (1, 8, 896), 2) == 8 * 896 * 2
    assert run_bytes((2, 3, 4), (1, 3, 4), 4) == 48
    assert run_bytes((4, 6, 8), (4, 2, 8), 1) == 16  # cut in the middle axis


@fuzz_settings(50)
@given(runs=st.integers(1, 10_000), run=st.integers(1, 5000))
def test_every_run_moves_whole_bursts(runs: int, run: int) -> None:
    nbytes = runs * run
    moved = float(ddr_bytes(CHIP, nbytes, run))
    assert moved == runs * -(-run // BURST) * BURST
    assert nbytes <= moved < nbytes + runs * BURST
    if run % BURST == 0:
        assert moved == nbytes
    assert float(ddr_bytes(CHIP, nbytes)) == -(-nbytes // BURST) * BURST  # one run


def _load(shape: tuple[int, ...], axis: int, length: int, cuts: tuple[Cut, ...]) -> Load:
    part = list(shape)
    part[axis] = length
    for c in cuts:
        part[c.axis] = c.length
    nbytes = int(np.prod(part)) * 2
    return Load(id=0, name="w.load", deps=(), group=0, slice=0,
                tensor=GlobalRef(Space.WEIGHT, "w"), shape=shape, dtype="bfloat16",
                axis=axis, start=0, length=length, cuts=cuts,
                local=LocalRef(0, tuple(part), "bfloat16", 1, nbytes))


def test_a_strided_window_costs_its_bursts_on_the_machine_and_in_estimates() -> None:
    """The same bytes as a block of whole rows (one run) and as a column window of 32-byte
    runs (an lm_head's K part): the second moves twice the bytes through the DDR."""
    rows = _load((1792, 896), 0, 32, ())  # 32 rows x 1792 B
    cols = _load((1792, 896), 0, 1792, (Cut(1, 0, 16),))  # every row's 32 bytes
    assert rows.nbytes == cols.nbytes
    assert (rows.run, cols.run) == (32 * 1792, 32)
    lat = CHIP.dma_latency_cycles
    assert command_cycles(CHIP, cols) - lat == 2 * (command_cycles(CHIP, rows) - lat)
    assert command_cycles(CHIP, cols) == dma_cycles(CHIP, cols.nbytes, 32)
    # the estimates time streams from the same records (`command_costs`)
    (a,), (b,) = command_costs([rows]), command_costs([cols])
    assert net_timing([b], CHIP).cycles == command_cycles(CHIP, cols)
    assert net_timing([a], CHIP).cycles == command_cycles(CHIP, rows)
    assert net_timing([b], CHIP).dma_bytes == cols.nbytes  # bytes moved, not bursts


@fuzz_settings(12)
@given(m=st.sampled_from([16, 24, 48, 64]), n=st.sampled_from([32, 48, 64, 96]),
       k=st.sampled_from([32, 64, 128]), mode=st.sampled_from(["f32", "bf16", "w4bf16"]),
       chip=st.sampled_from(["bm1684x", "bm1688"]))
def test_a_tiles_plan_is_charged_every_load_its_stream_makes(m: int, n: int, k: int,
                                                             mode: str, chip: str) -> None:
    """The planner's cost of a 2-D tile group is at least its stream's DMA time: every
    block it loads again (the weight's for each tile when the rows loop is outside, the
    activation's for each tile when the channels loop is) is charged. (It once charged an
    operand by the loop that does not cut it: a weight block loaded R times was costed
    once, and a 16-row prefill's MLP was planned to load its weights twice.)"""
    module, _, _ = matmul_module(m, n, k, mode, silu=False)
    target = lane_without_single_axis(module, chip)
    prog = compile_for_machine(module, target, split_reduction="needed")
    (g,) = tile_groups(module)
    planned = g.attributes["cost"].value.data  # type: ignore[attr-defined]
    busy = net_timing(command_costs(prog.commands), target).dma_busy
    assert busy <= planned + 1, (busy, planned, g.tile_grid())


#: a decode lm_head's matmul (the FileCheck test's module)
LM_HEAD = Path(__file__).parent / "filecheck" / "layer_group_near_tie.mlir"


def test_a_near_tie_keeps_the_reduction_whole() -> None:
    """A decode lm_head (Qwen2.5's 151936 x 896 bf16) costs the same split over its
    vocabulary (64 blocks) or over 28 parts of its inputs (64-byte runs: whole bursts):
    within REDUCTION_MARGIN the vocabulary split is kept, no accumulator."""
    module = parse_ir(LM_HEAD.read_text(), "lm_head")
    op = next(iter(next(iter(module.ops)).body.block.ops)).next_op  # the matmul
    whole = plan_span([op], CHIP, kinds=(SliceKind.ROWS, SliceKind.COLS))
    best = plan_span([op], CHIP)
    assert whole is not None and best is not None
    assert (best.kind, best.parts) == (SliceKind.COLS, 1)
    parts = min(_reduction_plans([op], CHIP, None), key=lambda p: p.cost)
    assert parts.parts > 1
    assert whole.cost * (1 - REDUCTION_MARGIN) <= parts.cost < whole.cost * 1.01
