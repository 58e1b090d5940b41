"""The chip presets against published speeds of real boards (toptpu.calibration).

`bench/calibrate.py` compiled every row of `bench/calibration/bm168x_published.csv` (one
layer of its shape, placeholder weights) and kept the command costs in
`bench/calibration/compiled_costs.json.gz`; its fit wrote the free figures into
`chips.json`. Here the committed presets re-time those command streams: every row's
modelled decode speed is within the goal, the cache was compiled with the presets'
figures (layer-group plans with them), and compiling a row again gives the cached streams.
"""

from __future__ import annotations

from typing import Any

import pytest

from toptpu.backend.contract import BLOCK_CACHE, GREEDY_HEAD, LM_HEAD
from toptpu.backend.target.chips import get_chip
from toptpu.calibration import (
    DECODE_FIGURES,
    GOAL_MAX,
    GOAL_MEDIAN,
    PREFILL_FIGURES,
    Row,
    compiled_rows,
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
                             group_size=row.group_size if mode.weight_bits == 4 else None)
    again = compile_costs(row.config(), request, nets=nets)
    for net in nets:
        assert again.commands[net] == cached.commands[net], net
