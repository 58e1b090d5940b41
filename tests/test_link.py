"""The chip-to-chip link model: a collective's steps and time from the chip's link figures."""

from __future__ import annotations

import math

import pytest

from toptpu.backend.target.chips import (
    LINK_FIGURES,
    ChipFigureError,
    chip_from_json,
    get_chip,
)
from toptpu.backend.target.link import (
    LinkError,
    LinkWork,
    best_algorithm,
    collective_seconds,
)

CHIP = get_chip("bm1684x")


def test_every_preset_has_link_figures_with_a_source() -> None:
    for name in ("bm1684x", "bm1688"):
        chip = get_chip(name)
        for figure in LINK_FIGURES:
            assert chip.sources.get(figure), f"{name}: {figure} has no source"
    assert CHIP.link_topology == "pcie_switch" and CHIP.max_devices == 8
    assert get_chip("bm1688").max_devices == 1  # no multi-chip deployment published


def test_link_figures_round_trip_through_json_and_are_checked() -> None:
    assert chip_from_json(CHIP.to_json()) == CHIP
    for bad in ({"link_gbps": 0.0}, {"link_latency_us": -1.0}, {"max_devices": 0},
                {"link_topology": "nvlink"}):
        with pytest.raises(ChipFigureError, match=next(iter(bad))):
            CHIP.with_figures(**bad)


def test_one_chips_figures_leave_the_link_out() -> None:
    """A one-chip compile plans with `figures()`: the link is not among them (the
    calibration cache keys on them)."""
    assert not set(LINK_FIGURES) & set(CHIP.figures())
    assert set(LINK_FIGURES) <= set(CHIP.to_json())


@pytest.mark.parametrize("devices", [2, 3, 4, 6, 8])
def test_steps_of_each_algorithm(devices: int) -> None:
    b = 8 * 4096
    rounds = math.ceil(math.log2(devices))
    part = -(-b // devices)
    assert LinkWork("all_reduce", "ring", devices, b).steps() == [part] * (2 * (devices - 1))
    doublings = {2: 1, 3: 3, 4: 2, 6: 4, 8: 3}[devices]  # 3 and 6: fold in, double, copy back
    assert LinkWork("all_reduce", "tree", devices, b).steps() == [b] * doublings
    assert LinkWork("all_gather", "ring", devices, b).steps() == [part] * (devices - 1)
    tree = LinkWork("all_gather", "tree", devices, b).steps()
    assert len(tree) == rounds and tree[0] == part and tree[-1] <= b
    assert LinkWork("send", "tree", devices, b).steps() == [b]
    assert LinkWork("all_reduce", "ring", 1, b).steps() == []


def test_time_is_latency_per_step_plus_bytes_over_the_link_plus_the_adds() -> None:
    b = 1 << 20
    w = LinkWork("all_reduce", "tree", 4, b)
    want = 2 * (CHIP.link_latency_us * 1e-6 + b / (CHIP.link_gbps * 1e9)) \
        + 3 * 2 * b / (CHIP.dma_gbps * 1e9)
    assert collective_seconds(CHIP, w) == pytest.approx(want)
    g = LinkWork("all_gather", "ring", 4, b)
    assert g.reduce_bytes() == 0
    assert collective_seconds(CHIP, g) == pytest.approx(
        3 * (CHIP.link_latency_us * 1e-6 + b / 4 / (CHIP.link_gbps * 1e9)))


def test_the_tree_wins_small_tensors_and_the_ring_large_ones() -> None:
    """Latency rules a decode step's hidden state, bytes a long prefill chunk's."""
    assert best_algorithm(CHIP, "all_reduce", 8, 2 * 5120) == "tree"
    assert best_algorithm(CHIP, "all_reduce", 8, 2 * 5120 * 2048) == "ring"
    # two chips: both send the same bytes; the ring adds half as many, the tree pays one
    # latency instead of two
    assert best_algorithm(CHIP, "all_reduce", 2, 2 * 5120) == "tree"
    assert best_algorithm(CHIP, "all_reduce", 2, 1 << 24) == "ring"
    faster = CHIP.with_figures(link_gbps=CHIP.link_gbps * 10)
    w = LinkWork("all_reduce", "ring", 8, 1 << 24)
    assert collective_seconds(faster, w) < collective_seconds(CHIP, w)


def test_unknown_collectives_are_refused() -> None:
    with pytest.raises(LinkError, match="unknown collective"):
        LinkWork("scatter", "ring", 2, 4)
    with pytest.raises(LinkError, match="unknown algorithm"):
        LinkWork("all_reduce", "mesh", 2, 4)
