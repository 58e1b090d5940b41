"""The executors' cache of converted weights: bounded by a byte budget sized from the host's
free memory (or TOPTPU_WEIGHT_CACHE), never beyond it, and a bad setting is one clear
error."""

from __future__ import annotations

import numpy as np
import pytest

from toptpu.backend.runtime import weight_cache
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.weight_cache import (
    ENV_VAR,
    WeightCache,
    default_budget,
    mem_available,
    parse_size,
)


def test_sizes_parse_and_bad_ones_are_refused() -> None:
    assert parse_size("3G") == 3 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("2KiB") == 2048
    assert parse_size("1000") == 1000
    assert parse_size("0") == 0
    for bad in ("", "-1", "3X", "G", "1e9", "lots"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_budget_follows_the_hosts_available_memory(tmp_path, monkeypatch) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert mem_available(str(info)) == 8000000 * 1024
    assert mem_available(str(tmp_path / "absent")) is None
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(weight_cache, "mem_available", lambda: 8 << 30)
    assert default_budget() == 4 << 30  # half of what is available
    monkeypatch.setattr(weight_cache, "mem_available", lambda: None)
    assert default_budget() == weight_cache.FALLBACK_BYTES
    monkeypatch.setenv(ENV_VAR, "64M")
    assert default_budget() == 64 << 20
    monkeypatch.setenv(ENV_VAR, "a lot")
    with pytest.raises(GenerationError, match=f"{ENV_VAR}='a lot' is not a size"):
        default_budget()
    with pytest.raises(GenerationError, match="give 0 or more"):
        WeightCache(-1)


def test_cache_keeps_what_fits_and_converts_the_rest_each_time() -> None:
    cache = WeightCache(budget=3 * 800)  # three 100-element float64 arrays
    made: list[int] = []

    def make(i: int) -> np.ndarray:
        made.append(i)
        return np.full(100, i, np.float64)

    for _ in range(2):
        for i in range(5):
            assert np.array_equal(cache.get(i, lambda i=i: make(i)), np.full(100, i))
    assert made == [0, 1, 2, 3, 4, 3, 4]  # 0..2 kept, 3 and 4 made again
    assert len(cache) == 3 and cache.used == 3 * 800 <= cache.budget
    off = WeightCache(budget=0)
    off.get("w", lambda: make(9))
    off.get("w", lambda: make(9))
    assert len(off) == 0 and made[-2:] == [9, 9]
