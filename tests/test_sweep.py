"""`toptpu sweep`: a grid of chip figures, modes and sequence lengths -> CSV and PNGs."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import tiny_dir
from PIL import Image

from toptpu.backend.target.chips import get_chip
from toptpu.cli import main
from toptpu.sweep import (
    COLUMNS,
    CSV_NAME,
    SweepError,
    grid,
    point_chip,
    run_point,
    run_ray,
)
from toptpu.sweep_plots import (
    BREAKDOWN_PNG,
    COLORS,
    LEFT,
    PANEL_GAP,
    PANEL_H,
    PANEL_TOP,
    RIGHT,
    XAxis,
    is_log_grid,
    nice_ticks,
    plotted_columns,
    series_of,
    write_plots,
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
    for name in ("vs_ddr_gbps.png", "vs_lanes.png", BREAKDOWN_PNG):
        with Image.open(os.path.join(out, name)) as img:
            assert img.format == "PNG" and img.width > 400
    assert not [f for f in os.listdir(out) if ".tmp" in f]


@pytest.mark.slow
def test_a_hybrid_models_point_reports_its_state(tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """A Qwen3.5 config's row: the KV cache of its one full-attention layer and the state of
    its three linear-attention layers (conv state in bf16, recurrent state in f32), and a
    slower DDR makes its decode step slower."""
    from toptpu.frontends.tiny_models import tiny_config

    config = tiny_dir(tmp_path_factory, "qwen3_5", layers=4)
    c = tiny_config("qwen3_5", layers=4)
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim \
        + c.linear_num_value_heads * c.linear_value_head_dim
    state = (c.linear_conv_kernel_dim - 1) * conv * 2 + 4 * c.linear_num_value_heads \
        * c.linear_key_head_dim * c.linear_value_head_dim
    slow, fast = (run_point(p) for p in grid([config], ["w4bf16"], [64], "bm1684x",
                                             {"ddr_gbps": [1, 64]}))
    for row in (slow, fast):
        assert row["error"] == ""
        assert row["state_bytes"] == 3 * state
        assert row["kv_bytes"] == 2 * 1 * 64 * c.num_key_value_heads * c.head_dim * 2
    assert slow["tokens_per_s"] < fast["tokens_per_s"]


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
def test_a_sweep_of_a_mixture_of_experts_over_expert_parallel_chips(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: str) -> None:
    """A MoE config (tiny Qwen3-MoE: 8 experts, top-2) swept over one chip and ep over 2 at
    two DDR bandwidths: every point compiles; the link time is the ep rows' alone; more DDR
    bandwidth gives a faster decode on each; ep's decode moves half the experts a chip
    holds, so its weights on the fullest chip are below one chip's."""
    config = tiny_dir(tmp_path_factory, "qwen3_moe")
    out = os.path.join(str(tmp_path), "sweep")
    assert main(["sweep", config, "-o", out, "-q", "f32", "--seq-length", "64",
                 "--devices", "1", "2", "--parallel", "ep", "--ddr-gbps", "8", "64",
                 "--quiet"]) == 0
    rows = _rows(out)
    assert [(r["devices"], r["parallel"], r["ddr_gbps"]) for r in rows] == [
        ("1", "", "8.0"), ("1", "", "64.0"), ("2", "ep", "8.0"), ("2", "ep", "64.0")]
    assert all(not r["error"] for r in rows)
    by = {(r["devices"], r["ddr_gbps"]): r for r in rows}
    assert float(by[("1", "8.0")]["decode_link_s"]) == 0
    assert float(by[("2", "8.0")]["decode_link_s"]) > 0
    for d in ("1", "2"):
        assert float(by[(d, "64.0")]["tokens_per_s"]) > float(by[(d, "8.0")]["tokens_per_s"])
    assert int(by[("2", "8.0")]["device_bytes"]) < int(by[("1", "8.0")]["device_bytes"])


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


def _grid_rows(**axes: list) -> list[dict]:
    """Rows as a sweep writes them over the grid `axes` (the other columns fixed), with
    made-up times that depend on every axis."""
    import itertools

    base = {"config": "/m/qwen", "mode": "w4bf16", "seq_length": 512, "chip": "bm1684x",
            "lanes": 64, "lane_bytes": 262144, "ddr_gbps": 64.0, "tflops": 16.0, "cores": 1,
            "error": ""}
    out = []
    for combo in itertools.product(*axes.values()):
        r = {**base, **dict(zip(axes, combo, strict=True))}
        speed = (r["ddr_gbps"] ** 0.5) * (r["lane_bytes"] / 2**16) ** 0.1 * (
            2 if r["mode"] == "w4bf16" else 1)
        r.update(tokens_per_s=speed, ttft_s=1.0 / r["tflops"] / speed,
                 decode_step_s=1 / speed, decode_ddr_s=0.6 / speed, decode_compute_s=0.1 / speed,
                 decode_launch_s=0.1 / speed, decode_host_s=0.2 / speed)
        out.append(r)
    return out


def test_each_swept_parameter_gets_a_picture_with_it_on_x(tmp_path) -> None:
    """A lane-bytes x TFLOPS sweep: one picture per parameter, the parameter on x (not all
    points at x = 64 GB/s, as the bandwidth plot once put them), one line per value of
    the other, both panels."""
    rows = _grid_rows(lane_bytes=[65536, 131072, 262144], tflops=[8.0, 16.0, 32.0])
    assert plotted_columns(rows) == ["lane_bytes", "tflops"]
    names = write_plots(str(tmp_path), rows, "bm1684x")
    assert names == ["vs_lane_bytes.png", "vs_tflops.png", BREAKDOWN_PNG]
    axis = XAxis.of("lane_bytes", rows)
    assert axis.log and [label for _, label in axis.ticks()] == ["64 KiB", "128 KiB",
                                                                "256 KiB"]
    xs = [axis.frac(v) for v in (65536, 131072, 262144)]
    assert 0 < xs[0] < xs[1] < xs[2] < 1 and xs[1] - xs[0] == pytest.approx(xs[2] - xs[1])
    assert "log scale" in axis.label
    lines = series_of(rows, "lane_bytes")
    assert [s.label for s in lines] == ["tflops 8", "tflops 16", "tflops 32"]
    assert all(len(s.points) == 3 and s.same_as is None for s in lines)
    with Image.open(tmp_path / "vs_lane_bytes.png") as img:
        rgb = img.convert("RGB")
        # the first line's colour in the lower panel (TTFT, where the lines part): at each
        # swept value's x, and drawn from the first to the last
        lower = PANEL_TOP + PANEL_H + PANEL_GAP
        columns = {x for x in range(rgb.width) for y in range(lower, lower + PANEL_H)
                   if rgb.getpixel((x, y)) == COLORS[0]}
        at = [LEFT + (RIGHT - LEFT) * f for f in xs]
        assert all(any(abs(c - x) <= 6 for c in columns) for x in at)
        assert max(columns) - min(columns) >= at[2] - at[0] - 12


def test_log_scale_for_growing_grids_only() -> None:
    assert is_log_grid([16, 32, 64, 128]) and is_log_grid([65536, 262144])
    assert is_log_grid([1, 2, 4, 8, 12])  # still more even on a log axis
    assert not is_log_grid([10, 20, 30, 40]) and not is_log_grid([1, 2])
    assert not is_log_grid([0, 16, 32]) and not is_log_grid([64])


@fuzz_settings(200)
@given(st.floats(min_value=1e-9, max_value=1e12, allow_nan=False, allow_infinity=False))
def test_value_ticks_are_round_and_cover_the_largest_value(hi: float) -> None:
    ticks = nice_ticks(hi)
    assert ticks[0] == 0 and ticks[-1] >= hi * (1 - 1e-9) and 2 <= len(ticks) <= 11
    step = ticks[1]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6
    assert all(b - a == pytest.approx(step) for a, b in zip(ticks, ticks[1:], strict=False))


def test_a_sweep_of_modes_alone_plots_them_as_categories(tmp_path) -> None:
    rows = _grid_rows(mode=["w4bf16", "bf16"])
    assert plotted_columns(rows) == ["mode"]
    axis = XAxis.of("mode", rows)
    assert axis.categorical and [label for _, label in axis.ticks()] == ["w4bf16", "bf16"]
    assert write_plots(str(tmp_path), rows, "bm1684x") == ["vs_mode.png", BREAKDOWN_PNG]


def test_lines_on_top_of_each_other_say_so_and_failed_points_are_left_out(tmp_path) -> None:
    rows = _grid_rows(ddr_gbps=[16.0, 32.0, 64.0], cores=[1, 2])  # cores change nothing here
    same = series_of(rows, "ddr_gbps")
    assert [s.label for s in same] == ["cores 1", "cores 2"] and same[1].same_as == "cores 1"
    rows[0] = {**rows[0], "error": "does not fit", "tokens_per_s": "", "ttft_s": ""}
    lines = series_of(rows, "ddr_gbps")  # the failed point is not drawn
    assert [len(s.points) for s in lines] == [2, 3] and lines[1].same_as is None
    assert write_plots(str(tmp_path), rows, "bm1684x")[0] == "vs_ddr_gbps.png"


# --------------------------------------------------------------------------- the DDR axis


@pytest.mark.parametrize("name", ["bm1684x", "bm1688"])
def test_the_ddr_axis_moves_one_cores_dma_limit_with_it(name: str) -> None:
    """Doubling the nominal DDR doubles what the cores draw (the sustained bandwidth and the
    per-core limit both move), where the preset's per-core limit would cap it; a swept
    --core-ddr-gbps is what the point gets."""
    base = get_chip(name)
    for ddr in (base.ddr_gbps, 2 * base.ddr_gbps, 4 * base.ddr_gbps):
        chip = point_chip(base, {"ddr_gbps": ddr})
        assert chip.core_ddr_gbps / chip.ddr_gbps == pytest.approx(
            base.core_ddr_gbps / base.ddr_gbps)
        assert chip.dma_gbps == pytest.approx(base.dma_gbps * ddr / base.ddr_gbps)
    capped = base.with_figures(ddr_gbps=4 * base.ddr_gbps)  # one figure moved alone
    assert capped.dma_gbps < point_chip(base, {"ddr_gbps": 4 * base.ddr_gbps}).dma_gbps
    held = point_chip(base, {"ddr_gbps": 4 * base.ddr_gbps, "core_ddr_gbps": 8.0})
    assert held.core_ddr_gbps == 8.0 and held.dma_gbps == pytest.approx(
        min(base.cores * 8.0, held.sustained_gbps))


def test_the_csv_and_the_fixed_line_say_what_the_ddr_axis_moves(tmp_path) -> None:
    """Rows as the DDR axis makes them: core_ddr_gbps follows ddr_gbps, so it is no
    parameter of its own (no picture, no line per value) and the line under the title says
    it moved; swept on its own it is a parameter; held, the line gives its value."""
    from toptpu.sweep_plots import fixed_description

    base = get_chip("bm1684x")
    rows = []
    for ddr in (32.0, 64.0, 128.0):
        chip = point_chip(base, {"ddr_gbps": ddr})
        rows += [{**r, "ddr_gbps": ddr, "core_ddr_gbps": chip.core_ddr_gbps,
                  "dma_gbps": chip.dma_gbps} for r in _grid_rows(ddr_gbps=[ddr])]
    assert plotted_columns(rows) == ["ddr_gbps"]
    assert [s.label for s in series_of(rows, "ddr_gbps")] == ["all points"]
    line = fixed_description(rows, "bm1684x")
    assert "core_ddr_gbps moved with ddr_gbps (1 x it)" in line
    held = [{**r, "core_ddr_gbps": 64.0} for r in rows]
    assert "core_ddr_gbps 64" in fixed_description(held, "bm1684x")
    swept = [{**r, "core_ddr_gbps": c} for r, c in zip(rows, (16.0, 16.0, 32.0),
                                                         strict=True)]
    assert plotted_columns(swept) == ["ddr_gbps", "core_ddr_gbps"]
    csv_header = __import__("toptpu.sweep", fromlist=["csv_text"]).csv_text(rows).split(
        "\r\n")[0].split(",")
    assert {"ddr_gbps", "core_ddr_gbps", "sustained_gbps", "dma_gbps"} <= set(csv_header)


@pytest.mark.slow
def test_a_ddr_sweep_above_the_presets_per_core_limit_keeps_getting_faster(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: str) -> None:
    """The real command over 64 -> 128 -> 256 GB/s: each row's DMA rate is the sustained
    bandwidth (never the preset's 64 GB/s per-core limit), and the DDR-bound part of the
    decode step halves with each doubling."""
    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "sweep")
    assert main(["sweep", config, "-o", out, "-q", "f32", "--seq-length", "64",
                 "--ddr-gbps", "64", "128", "256", "--jobs", "1", "--quiet"]) == 0
    rows = _rows(out)
    eff = get_chip("bm1684x").ddr_efficiency
    for r in rows:
        assert float(r["core_ddr_gbps"]) == float(r["ddr_gbps"])
        assert float(r["dma_gbps"]) == pytest.approx(float(r["ddr_gbps"]) * eff)
    ddr = [float(r["decode_ddr_s"]) + float(r["decode_compute_s"]) for r in rows]
    assert ddr[0] > ddr[1] > ddr[2]


# --------------------------------------------------------------------------- the grid's size


def test_a_grid_over_the_limit_is_refused_before_anything_is_built(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """10^4 points (and 10^9: nothing is built, so no memory goes to it) end in one line
    with the count and the flag that raises the limit; nothing written."""
    import toptpu.sweep as sweep

    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "o")

    def no_grid(*a: object, **k: object) -> None:
        raise AssertionError("the grid was built")

    monkeypatch.setattr(sweep, "grid", no_grid)
    values = [str(v) for v in range(1, 101)]
    assert main(["sweep", config, "-o", out, "--ddr-gbps", *values, "--lanes", *values]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("toptpu sweep: error: the grid has 10000 points, over the limit of 1000 "
                   "(each point compiles the model's nets, seconds each): narrow the grid, "
                   "or raise the limit with --max-points 10000")
    values = [str(v) for v in range(1, 1001)]
    assert main(["sweep", config, "-o", out, "--ddr-gbps", *values, "--lanes", *values,
                 "--tflops", *values]) == 1
    assert "the grid has 1000000000 points" in capsys.readouterr().err
    assert main(["sweep", config, "-o", out, "--ddr-gbps", "1", "2", "--max-points",
                 "1"]) == 1
    assert "--max-points 2" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_progress_is_a_line_rewritten_in_place_and_silent_when_not_shown() -> None:
    import io

    from toptpu.sweep import Progress

    shown = io.StringIO()
    bar = Progress(3, True, shown)
    bar.update()
    bar.update(2)
    bar.close()
    frames = shown.getvalue().split("\r")[1:]
    assert [f.split(",")[0] for f in frames] == [
        "toptpu sweep: 0/3 points", "toptpu sweep: 1/3 points", "toptpu sweep: 3/3 points"]
    assert "left" in frames[1] and shown.getvalue().endswith("\n")
    quiet = io.StringIO()
    bar = Progress(3, False, quiet)
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_no_progress_when_stderr_is_no_terminal_and_no_word_with_quiet(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "o")
    args = ["sweep", config, "-o", out, "-q", "f32", "--seq-length", "64", "--jobs", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err == "toptpu sweep: 1 points (1 local processes)\n"
    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- whole or nothing


def _previous(out: str) -> dict[str, bytes]:
    """An earlier sweep's outputs in `out`."""
    os.makedirs(out, exist_ok=True)
    files = {CSV_NAME: b"config,mode\nold,old\n", "vs_ddr_gbps.png": b"old picture",
             BREAKDOWN_PNG: b"old breakdown"}
    for name, data in files.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    return files


def _as_before(out: str, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(out)) == sorted(files)  # no temporary file either
    for name, data in files.items():
        with open(os.path.join(out, name), "rb") as f:
            assert f.read() == data, name


def test_a_full_disk_changes_no_output_and_leaves_nothing(
        tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third file of the set hits a full disk: the CSV and the first picture were in
    their temporary files, not yet renamed; all go, the earlier outputs stay; a new
    directory the sweep made is removed."""
    import errno

    from toptpu.dialects import output_file
    from toptpu.dialects.output_file import OutputPathError
    from toptpu.sweep import write_outputs

    rows = _grid_rows(ddr_gbps=[16.0, 32.0])
    out = os.path.join(str(tmp_path), "o")
    files = _previous(out)
    real, calls = output_file._Raw._write_raw, [0]

    def full(self: object, b: object) -> object:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, b)  # type: ignore[arg-type]

    monkeypatch.setattr(output_file._Raw, "_write_raw", full)
    with pytest.raises(OutputPathError, match="no space left"):
        write_outputs(out, rows, "bm1684x")
    _as_before(out, files)
    fresh = os.path.join(str(tmp_path), "new")
    calls[0] = 0
    with pytest.raises(OutputPathError, match="no space left"):
        write_outputs(fresh, rows, "bm1684x")
    assert not os.path.exists(fresh)
    monkeypatch.undo()
    assert write_outputs(fresh, rows, "bm1684x") == [CSV_NAME, "vs_ddr_gbps.png",
                                                     BREAKDOWN_PNG]


def test_a_signal_while_the_set_is_renamed_waits_for_the_whole_set(tmp_path: str,
                                                                  monkeypatch) -> None:
    """SIGTERM arrives as the first file is renamed into place: it is held off until every
    file is in place, then interrupts."""
    import signal

    import toptpu.sweep as sweep
    from toptpu.cli import Interrupted, signals_interrupt

    rows = _grid_rows(ddr_gbps=[16.0, 32.0])
    out = os.path.join(str(tmp_path), "o")
    _previous(out)
    real = os.replace
    seen: list[str] = []

    def replace(src: str, dst: str) -> None:
        if not seen:
            signal.raise_signal(signal.SIGTERM)
        real(src, dst)
        seen.append(os.path.basename(dst))

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Interrupted), signals_interrupt():
        sweep.write_outputs(out, rows, "bm1684x")
    assert sorted(seen) == sorted([CSV_NAME, "vs_ddr_gbps.png", BREAKDOWN_PNG])
    assert _rows(out)[0]["config"] == "/m/qwen"  # the new table, not the old one
    assert not [n for n in os.listdir(out) if n.startswith(".")]


_HOLD = """
import os, sys, time
import toptpu.sweep as sweep
flag, where = sys.argv[1], sys.argv[2]
if where == "points":  # each point's process says it is at work, then works slowly
    real_compile = sweep.compile_costs
    def compile_costs(*a, **k):
        open(f"{flag}.{os.getpid()}", "w").close()
        time.sleep(120)
        return real_compile(*a, **k)
    sweep.compile_costs = compile_costs
else:  # the second file of the set is complete in its temporary file: hold it there
    real_fsync, calls = os.fsync, [0]
    def fsync(fd):
        real_fsync(fd)
        calls[0] += 1
        if calls[0] == 2:
            open(flag, "w").close()
            time.sleep(120)
    os.fsync = fsync
from toptpu.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # runs the command in processes, then kills it
@pytest.mark.parametrize("where", ["points", "writing"])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_leaves_the_previous_outputs_and_no_process_or_file(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: str, where: str,
        signame: str) -> None:
    """The real command (two local processes), SIGTERM or SIGINT (Ctrl-C) while the points
    run or while the set's files sit in their temporary files: status 143 / 130, one line,
    the earlier outputs byte for byte, no temporary file, no pool process left."""
    import signal
    import subprocess
    import time

    config = tiny_dir(tmp_path_factory, "qwen2")
    out = os.path.join(str(tmp_path), "o")
    files = _previous(out)
    flag = os.path.join(str(tmp_path), "flag")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, flag, where, "sweep", config, "-o",
                             out, "-q", "f32", "--seq-length", "64", "--ddr-gbps", "16", "32",
                             "--jobs", "2"], stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 300
    workers: list[int] = []
    while True:
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        if where == "points":
            workers = [int(n.rsplit(".", 1)[1]) for n in os.listdir(str(tmp_path))
                       if n.startswith("flag.")]
            if len(workers) == 2:
                break
        elif os.path.exists(flag):
            assert any(".tmp-" in n for n in os.listdir(out))  # the set is half-way
            break
        time.sleep(0.05)
    sig = getattr(signal, signame)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == f"toptpu sweep: interrupted ({signame})"
    assert "Traceback" not in err
    _as_before(out, files)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)
