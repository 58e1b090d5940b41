"""`toptpu sweep`: a grid of chip figures, modes and sequence lengths -> CSV and PNGs."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys

import pytest
from llm_fixtures import tiny_dir
from PIL import Image

from toptpu.backend.target.chips import get_chip
from toptpu.cli import main
from toptpu.sweep import (
    BANDWIDTH_PNG,
    BREAKDOWN_PNG,
    COLUMNS,
    CSV_NAME,
    SweepError,
    grid,
    point_chip,
    run_point,
    run_ray,
)


def _rows(out: str) -> list[dict[str, str]]:
    with open(os.path.join(out, CSV_NAME), newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        return list(reader)


@pytest.mark.slow
def test_a_2x2_sweep_gives_4_rows_and_two_pictures(tmp_path_factory: pytest.TempPathFactory,
                                                   tmp_path: str) -> None:
    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "sweep")
    assert main(["sweep", config, "-o", out, "--seq-length", "64", "--ddr-gbps", "1", "64",
                 "--lanes", "32", "64", "--jobs", "2"]) == 0
    rows = _rows(out)
    assert len(rows) == 4 and not any(r["error"] for r in rows)
    assert [(r["lanes"], r["ddr_gbps"]) for r in rows] == [  # the axes in AXES order
        ("32", "1.0"), ("32", "64.0"), ("64", "1.0"), ("64", "64.0")]
    # 1 GB/s nominal makes the decode step's DDR-bound nets and the step slower
    by = {(float(r["ddr_gbps"]), int(r["lanes"])): r for r in rows}
    for lanes in (32, 64):
        slow, fast = by[(1.0, lanes)], by[(64.0, lanes)]
        assert float(slow["tokens_per_s"]) < float(fast["tokens_per_s"])
        assert float(slow["decode_ddr_s"]) > float(fast["decode_ddr_s"])
    for r in rows:  # the breakdown adds up to the step
        parts = sum(float(r[f"decode_{c}_s"]) for c in ("ddr", "compute", "launch", "host"))
        assert parts == pytest.approx(float(r["decode_step_s"]))
        assert float(r["tokens_per_s"]) == pytest.approx(1 / float(r["decode_step_s"]))
    for name in (BANDWIDTH_PNG, BREAKDOWN_PNG):
        with Image.open(os.path.join(out, name)) as img:
            assert img.format == "PNG" and img.width > 400
    assert not [f for f in os.listdir(out) if ".tmp" in f]


@pytest.mark.slow
def test_a_sweep_over_devices_and_the_link(tmp_path_factory: pytest.TempPathFactory,
                                           tmp_path: str) -> None:
    """One device and tp over 2, at 1 and 10 GB/s of link: the link time is the tp rows'
    alone, shrinks with the link's bandwidth, and the breakdown still adds up."""
    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "sweep")
    assert main(["sweep", config, "-o", out, "-q", "f32", "--seq-length", "64",
                 "--devices", "1", "2", "--link-gbps", "1", "10", "--jobs", "2"]) == 0
    rows = _rows(out)
    assert [(r["devices"], r["parallel"], r["link_gbps"]) for r in rows] == [
        ("1", "", "1.0"), ("1", "", "10.0"), ("2", "tp", "1.0"), ("2", "tp", "10.0")]
    assert all(not r["error"] and r["fits"] == "True" for r in rows)
    link = {(r["devices"], r["link_gbps"]): float(r["decode_link_s"]) for r in rows}
    assert link[("1", "1.0")] == link[("1", "10.0")] == 0
    assert link[("2", "1.0")] > link[("2", "10.0")] > 0
    for r in rows:
        parts = sum(float(r[f"decode_{c}_s"]) for c in ("ddr", "compute", "launch", "host",
                                                         "link"))
        assert parts == pytest.approx(float(r["decode_step_s"]))


@pytest.mark.slow
def test_a_point_that_does_not_fit_keeps_its_row_with_the_error(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = tiny_dir(tmp_path_factory, "qwen2")
    (point,) = grid([config], ["f32"], [64], "bm1684x", {"lane_bytes": [256]})
    row = run_point(point)
    assert "local memory" in row["error"] and "tokens_per_s" not in row


def test_tflops_scales_every_compute_type() -> None:
    base = get_chip("bm1684x")
    chip = point_chip(base, {"tflops": 32.0})
    assert chip.tflops["bf16"] == 32.0
    assert chip.tflops["int8"] == pytest.approx(2 * base.tflops["int8"])
    assert chip.tflops["f32"] == pytest.approx(2 * base.tflops["f32"])


def test_grid_is_every_combination_in_order() -> None:
    points = grid(["a", "b"], ["f32"], [64, 128], "bm1684x",
                  {"ddr_gbps": [16.0, 32.0], "cores": None})
    assert len(points) == 8
    assert [(p.config_dir, p.seq_length, p.figures) for p in points[:3]] == [
        ("a", 64, (("ddr_gbps", 16.0),)), ("a", 64, (("ddr_gbps", 32.0),)),
        ("a", 128, (("ddr_gbps", 16.0),))]


def test_bad_grid_values_are_one_line_errors(tmp_path_factory: pytest.TempPathFactory,
                                             tmp_path: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "o")
    assert main(["sweep", config, "-o", out, "--lane-bytes", "1000"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("toptpu sweep: error: grid point {'lane_bytes': 1000}") and \
        "multiple of banks" in err and "\n" not in err
    assert main(["sweep", config, "-o", out, "--ddr-gbps", "0"]) == 2
    assert "--ddr-gbps" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path), "-o", out]) == 1
    assert "config.json" in capsys.readouterr().err
    assert not os.path.exists(out)  # nothing written when the grid is refused


def test_ray_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SweepError, match=r"--ray needs Ray, which is not installed: pip "
                       r"install -e '\.\[ray\]'"):
        run_ray(grid(["a"], ["f32"], [64], "bm1684x", {}), "local")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is an optional extra (pip install -e '.[ray]')")
def test_ray_runs_the_points_as_tasks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Ray on this machine ('local' starts an instance) gives the rows of the local run."""
    config = tiny_dir(tmp_path_factory, "qwen2")
    points = grid([config], ["f32"], [64], "bm1684x", {"ddr_gbps": [8.0, 64.0]})
    rows = run_ray(points, "local")
    assert rows == [run_point(p) for p in points]
