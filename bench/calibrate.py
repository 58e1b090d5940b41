"""Fit the chip presets to published speeds of real boards (toptpu.calibration).

    python bench/calibrate.py                 # tables of the rows with the presets as they are
    python bench/calibrate.py --fit           # fit, print the tables with the fitted figures
    python bench/calibrate.py --fit --write   # ... and write them into chips.json
    python bench/calibrate.py --refresh       # compile the rows missing from the cache, or
                                              # compiled with other figures than the presets'

Each row's nets are compiled from its shape as `toptpu estimate` compiles them (one layer,
placeholder weights; the lm_head quantized where the row's bmodel quantized it) and kept in
bench/calibration/compiled_costs.json.gz; the fit and the tables re-time those command
streams with the step accounting. The fit sees bench/calibration/bm168x_published.csv only;
bm168x_heldout.csv (published rows the fit never sees) is the check of what it predicts.
Prints, per row, the published and modelled decode tokens/s and time to first token with
their errors, and the median absolute error (goal: <= 20%, no row off by more than 40%).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from collections.abc import Sequence
from typing import Any

from toptpu.backend.target.chips import get_chip
from toptpu.calibration import (
    HELDOUT_CSV,
    Row,
    cache_entry,
    compile_row,
    compiled_rows,
    fit_chip,
    fixed_cost_bounds,
    load_cache,
    read_rows,
    results,
    row_chip,
    save_cache,
    table,
    write_presets,
)


def _compile(row: Row) -> tuple[str, dict[str, Any], float]:
    """A process pool task: the row's cache entry and the seconds its compile took."""
    chip = row_chip(row)
    t = time.perf_counter()
    compiled = compile_row(row, chip)
    return row.key, cache_entry(row, chip, compiled), time.perf_counter() - t


def refresh(rows: Sequence[Row], cache: dict[str, Any], force: bool, jobs: int) -> None:
    """Compile the rows missing from `cache` or compiled with other figures (all with
    `force`), `jobs` at a time, saving the cache after each; entries of no row are
    dropped."""
    for key in set(cache) - {r.key for r in rows}:
        del cache[key]
    todo = list({r.key: r for r in rows if force or r.key not in cache
                 or cache[r.key]["figures"] != row_chip(r).figures()}.values())
    if not todo:
        save_cache(cache)
        return
    # the longest compile last time first, so the others run beside it
    todo.sort(key=lambda r: -cache.get(r.key, {}).get("costs", {}).get("compile_s", 0.0))
    print(f"compiling {len(todo)} rows ({jobs} at a time) ...", file=sys.stderr)
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for done in concurrent.futures.as_completed([pool.submit(_compile, r) for r in todo]):
            key, entry, seconds = done.result()
            cache[key] = entry
            save_cache(cache)  # each row as it is compiled
            print(f"  {key}: {seconds:.0f}s", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="fit the free figures of each chip")
    ap.add_argument("--write", action="store_true", help="write the fitted figures into "
                    "chips.json (with --fit)")
    ap.add_argument("--refresh", action="store_true", help="compile rows missing from the "
                    "cache or compiled with other figures than the presets'")
    ap.add_argument("--force", action="store_true", help="with --refresh: compile every row")
    ap.add_argument("--jobs", type=int, default=1, help="rows compiled at a time")
    a = ap.parse_args()
    rows = read_rows()
    held = read_rows(HELDOUT_CSV)
    cache = load_cache()
    if a.refresh:
        refresh([*rows, *held], cache, a.force, a.jobs)
    stale = [r.key for r in [*rows, *held] if r.key in cache
             and cache[r.key]["figures"] != row_chip(r).figures()]
    if stale:
        print(f"note: {len(stale)} rows were compiled with other chip figures than the "
              "presets' (layer-group plans with them); --refresh recompiles them",
              file=sys.stderr)
    compiled = compiled_rows([*rows, *held], cache)
    figures = None
    chips = sorted({r.chip for r in rows})
    bounds = {c: fixed_cost_bounds([r for r in rows if r.chip == c], compiled, get_chip(c))
              for c in chips}
    if a.fit:
        t = time.perf_counter()
        figures = {chip: fit_chip(rows, compiled, chip) for chip in chips}
        print(f"fitted in {time.perf_counter() - t:.1f}s:")
        for chip, fig in figures.items():
            before = get_chip(chip).figures()
            print(f"  {chip}: " + ", ".join(f"{k} {before[k]:g} -> {v:g}"
                                            for k, v in fig.items()))
            print("    bounds: " + ", ".join(f"{k} [{lo:g}, {hi:.4g}]"
                                              for k, (lo, hi) in bounds[chip].items()))
    res = results(rows, compiled, figures)
    print("The rows the fit sees (bench/calibration/bm168x_published.csv):")
    print(table(res))
    print("\nHeld-out rows, never fitted (bench/calibration/bm168x_heldout.csv):")
    print(table(results(held, compiled, figures)))
    if a.write:
        if figures is None:
            ap.error("--write needs --fit")
        write_presets(figures, res, bounds)
        print("wrote the fitted figures into backend/target/chips.json")


if __name__ == "__main__":
    main()
