"""The chip presets against published speeds of real boards (toptpu.calibration).

`bench/calibrate.py` compiled every row of `bench/calibration/bm168x_published.csv` and of
`bm168x_heldout.csv` (one layer of its shape, placeholder weights, the lm_head as the row's
bmodel stores it) and kept the command costs in `bench/calibration/compiled_costs.json.gz`;
its fit (of the published rows only) wrote the free figures into `chips.json`. Here the
committed presets re-time those command streams: every fitted row's modelled decode speed
is within the goal and the held-out rows' median too, no modelled time beats physics (bytes
at the nominal DDR bandwidth, FLOPs at the peak), the fixed costs sit within their sourced
bounds, the cache was compiled with the presets' figures (layer-group plans with them), and
compiling a row again gives the cached streams.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from toptpu.backend.contract import BLOCK_CACHE, GREEDY_HEAD, LM_HEAD
from toptpu.backend.target.chips import get_chip
from toptpu.calibration import (
    DECODE_FIGURES,
    GOAL_MAX,
    GOAL_MEDIAN,
    HELDOUT_CSV,
    HOST_TRANSFER_US_MAX,
    LAUNCH_US_MIN,
    PREFILL_FIGURES,
    Row,
    _bounded_fixed_costs,
    compiled_rows,
    fixed_cost_bounds,
    load_cache,
    median_abs,
    read_rows,
    results,
    row_chip,
)
from toptpu.dialects.common import QuantMode
from toptpu.estimate import compile_costs
from toptpu.request import CompileRequest

RowsAndCache = tuple[list[Row], dict[str, Any]]


@pytest.fixture(scope="module")
def rows_and_cache() -> RowsAndCache:
    return read_rows(), load_cache()


@pytest.fixture(scope="module")
def heldout() -> list[Row]:
    return read_rows(HELDOUT_CSV)


def test_the_cache_holds_every_row_compiled_with_the_presets_figures(
        rows_and_cache: RowsAndCache) -> None:
    rows, cache = rows_and_cache
    assert len(rows) == 15
    for r in rows:
        assert r.key in cache, f"{r.key}: run python bench/calibrate.py --refresh"
        assert cache[r.key]["figures"] == row_chip(r).figures(), (
            f"{r.key} was compiled with other figures than chips.json's: run python "
            "bench/calibrate.py --refresh")


def test_the_calibration_rows_are_within_the_goal(rows_and_cache: RowsAndCache) -> None:
    rows, cache = rows_and_cache
    res = results(rows, compiled_rows(rows, cache))
    errors = [x.decode_error for x in res]
    assert median_abs(errors) <= GOAL_MEDIAN
    worst = max(res, key=lambda x: abs(x.decode_error))
    assert abs(worst.decode_error) <= GOAL_MAX, (
        f"{worst.row.key}: modelled {worst.modelled.tokens_per_s:.3g} tok/s, published "
        f"{worst.row.decode_tok_s:g}")


def test_the_fitted_figures_name_their_source() -> None:
    for name in ("bm1684x", "bm1688"):
        chip = get_chip(name)
        fitted = (*DECODE_FIGURES, *PREFILL_FIGURES,
                  *(("core_ddr_gbps",) if chip.cores > 1 else ()))
        for figure in fitted:
            assert chip.sources[figure].startswith("fitted by bench/calibrate.py to "
                                                   "bench/calibration/bm168x_published.csv"), (
                name, figure)


@pytest.mark.slow
def test_compiling_a_row_again_gives_its_cached_decode_nets(
        rows_and_cache: RowsAndCache) -> None:
    """The cache is what the compiler makes (the decode nets of the smallest row; its
    prefill block takes longer to compile)."""
    rows, cache = rows_and_cache
    row = min(rows, key=lambda r: r.hidden * r.intermediate)
    cached = compiled_rows([row], cache)[row.key]
    nets = (BLOCK_CACHE, LM_HEAD, GREEDY_HEAD)
    mode = QuantMode(row.quant)
    request = CompileRequest(mode=mode, chip=row_chip(row), shapes=cached.shapes,
                             group_size=row.group_size if mode.weight_bits == 4 else None,
                             keep_float=row.keep_float)
    again = compile_costs(row.config(), request, nets=nets)
    for net in nets:
        assert again.commands[net] == cached.commands[net], net


def test_the_cache_holds_every_heldout_row_compiled_with_the_presets_figures(
        rows_and_cache: RowsAndCache, heldout: list[Row]) -> None:
    _, cache = rows_and_cache
    assert heldout
    for r in heldout:
        assert r.key in cache, f"{r.key}: run python bench/calibrate.py --refresh"
        assert cache[r.key]["figures"] == row_chip(r).figures(), r.key


def test_the_heldout_rows_median_is_within_the_goal(rows_and_cache: RowsAndCache,
                                                    heldout: list[Row]) -> None:
    """Rows the fit never saw: their median decode error within the fit's own goal."""
    _, cache = rows_and_cache
    res = results(heldout, compiled_rows(heldout, cache))
    assert median_abs(x.decode_error for x in res) <= GOAL_MEDIAN


def test_no_modelled_time_beats_physics(rows_and_cache: RowsAndCache,
                                        heldout: list[Row]) -> None:
    """Every row's modelled decode step and first token take longer than their DMA bytes
    at the nominal DDR bandwidth and their FLOPs at the peak of all cores."""
    rows, cache = rows_and_cache
    every = [*rows, *heldout]
    for x in results(every, compiled_rows(every, cache)):
        m = x.modelled
        assert m.decode_floor_s > 0 and m.ttft_floor_s > 0
        assert 1.0 / m.tokens_per_s > m.decode_floor_s, x.row.key
        assert m.ttft_s > m.ttft_floor_s, x.row.key


def test_the_fixed_costs_sit_within_their_sourced_bounds(rows_and_cache: RowsAndCache
                                                         ) -> None:
    """launch_us and host_transfer_us of each preset lie within the bounds the fit kept
    them in (a launch: at least one interrupt, at most what the published steps leave;
    a host copy: at most one interrupt), and their sources say so."""
    rows, cache = rows_and_cache
    for name in ("bm1684x", "bm1688"):
        chip = get_chip(name)
        mine = [r for r in rows if r.chip == name]
        bounds = fixed_cost_bounds(mine, compiled_rows(mine, cache), chip)
        assert bounds["launch_us"][0] == LAUNCH_US_MIN < bounds["launch_us"][1]
        assert bounds["host_transfer_us"] == (0.0, HOST_TRANSFER_US_MAX)
        for figure, (lo, hi) in bounds.items():
            assert lo - 0.01 <= getattr(chip, figure) <= hi + 0.01, (name, figure)
            assert "within [" in chip.sources[figure] and "LlmProfile" in chip.sources[
                figure], (name, figure)


def test_a_quantized_lm_head_moves_the_bytes_of_its_4_bit_weights(
        rows_and_cache: RowsAndCache) -> None:
    """A row whose bmodel quantized its lm_head: the compiled decode lm_head reads its
    weights at 4 bits plus a scale and zero per group (not 16 bits)."""
    rows, cache = rows_and_cache
    row = next(r for r in rows if r.lm_head == "quantized" and r.quant == "w4bf16")
    c = compiled_rows([row], cache)[row.key]
    read = c.timings(row_chip(row), [LM_HEAD])[LM_HEAD].dma_bytes
    weights = row.vocab * row.hidden
    assert weights * (0.5 + 2 / row.group_size) <= read <= weights * (0.5 + 4 / row.group_size) \
        + row.vocab * 8


@fuzz_settings(100)
@given(st.lists(st.tuples(st.floats(1e-3, 0.2), st.integers(3, 60), st.integers(1, 6),
                          st.floats(0.5, 2.0)), min_size=2, max_size=8),
       st.floats(0.0, 1e-3), st.floats(1e-4, 2e-3), st.floats(0.0, 2e-4))
def test_the_bounded_fit_of_the_fixed_costs_is_the_boxes_least_error(
        data: list[tuple[float, int, int, float]], a_lo: float, a_span: float,
        b_hi: float) -> None:
    """Against a fine grid over the box: the solver's point is inside and no grid point
    has a smaller error."""
    parts = np.array([(base, nl, nt, 0.0) for base, nl, nt, _ in data])
    target = np.array([base * f + 1e-3 for base, _, _, f in data])
    bounds = ((a_lo, a_lo + a_span), (0.0, b_hi))
    a, b, err = _bounded_fixed_costs(parts, target, bounds)
    assert bounds[0][0] - 1e-15 <= a <= bounds[0][1] + 1e-15
    assert bounds[1][0] - 1e-15 <= b <= bounds[1][1] + 1e-15
    w = 1.0 / target
    for ga in np.linspace(*bounds[0], 41):
        for gb in np.linspace(*bounds[1], 41):
            e = float(np.sum(((parts[:, 0] + parts[:, 1] * ga + parts[:, 2] * gb) * w
                              - 1.0) ** 2))
            assert err <= e * (1 + 1e-9) + 1e-15
