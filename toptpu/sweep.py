"""`toptpu sweep`: modelled speed over a grid of chips, modes, sequence lengths and models.

Every grid point (a config directory, a mode, a sequence length and a chip: a preset with
some of its figures changed) is an independent task: it compiles the model's nets for that
chip from the config alone and estimates them as `toptpu estimate` does
(`toptpu.estimate`). Layer-group plans with the chip's local memory and costs, so a point
compiles on its own chip; nothing is shared between points. Tasks run in a local process
pool (`--jobs`) or, with `--ray ADDRESS`, as Ray tasks on a cluster (Ray is an optional
extra: `pip install -e '.[ray]'`; the cluster's workers need toptpu installed too).

The sweep writes one CSV row per point (a point that cannot compile, e.g. a layer that does
not fit a smaller local memory, keeps its row with the error) and two pictures: decode
tokens/s against DDR bandwidth (a line per model, mode, sequence length and the other
figures) and where each point's decode step goes (DDR-bound nets, compute-bound nets,
launches, host transfers).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toptpu.backend.contract import StaticShapes
from toptpu.backend.runtime.accounting import CATEGORIES
from toptpu.backend.target.chips import (
    DEFAULT_CHIP,
    Chip,
    ChipFigureError,
    chip_names,
    get_chip,
)
from toptpu.cli_args import PARALLEL_STRATEGIES, UsageError, finite_float, int_at_least
from toptpu.errors import CompileError
from toptpu.estimate import (
    STEP_NETS,
    EstimateError,
    chip_with,
    compile_costs,
    estimate,
    read_checked_config,
)
from toptpu.paths import check_not_inside, check_output_dir, open_output, open_text_output

#: the chip figures a sweep varies (`--tflops` is the per-core half-precision peak; the
#: other compute types scale with it; the link's matter to a model on several devices)
AXES = ("lanes", "lane_bytes", "ddr_gbps", "tflops", "cores", "link_gbps", "link_latency_us")
#: the compute type `--tflops` names
TFLOPS_TYPE = "bf16"
CSV_NAME = "sweep.csv"
BANDWIDTH_PNG = "tokens_per_s_vs_bandwidth.png"
BREAKDOWN_PNG = "breakdown.png"
COLUMNS = ("config", "mode", "seq_length", "chip", "devices", "parallel", *AXES,
           "sustained_gbps", "weight_bytes", "kv_bytes", "device_bytes", "fits", "ttft_s",
           "tokens_per_s", "decode_step_s", *(f"decode_{c}_s" for c in CATEGORIES),
           "decode_bound", "error")


class SweepError(UsageError):
    """A sweep that cannot run as asked; the message says why."""


@dataclass(frozen=True)
class Point:
    """One grid point: what to compile and on which chip."""

    config_dir: str
    mode: str
    seq_length: int
    chip: str
    figures: tuple[tuple[str, float], ...]  # (axis, value) of the swept figures
    devices: int = 1
    parallel: str | None = None  # tp | pp over `devices` (None for one)

    def chip_model(self) -> Chip:
        return point_chip(get_chip(self.chip), dict(self.figures))


def point_chip(base: Chip, figures: Mapping[str, float]) -> Chip:
    """`base` with the swept figures; `tflops` scales every compute type's peak so that
    bf16 has the value given."""
    figures = dict(figures)
    if "tflops" in figures:
        scale = figures["tflops"] / base.tflops[TFLOPS_TYPE]
        figures["tflops"] = {k: v * scale for k, v in base.tflops.items()}
    return chip_with(base, figures)


def grid(config_dirs: Sequence[str], modes: Sequence[str], seq_lengths: Sequence[int],
         chip: str, axes: Mapping[str, Sequence[float]],
         spreads: Sequence[tuple[int, str | None]] = ((1, None),)) -> list[Point]:
    """Every combination, in a stable order (configs outermost, the last axis innermost);
    `spreads`: the (devices, parallel) pairs."""
    names = [a for a in AXES if axes.get(a)]
    values = [axes[a] for a in names]
    return [Point(c, m, s, chip, tuple(zip(names, combo, strict=True)), n, par)
            for c, m, s in itertools.product(config_dirs, modes, seq_lengths)
            for n, par in spreads
            for combo in itertools.product(*values)]


def spreads_of(devices: Sequence[int] | None, parallel: Sequence[str] | None
               ) -> list[tuple[int, str | None]]:
    """The (devices, parallel) pairs of `--devices` and `--parallel` (one device: no
    strategy; several: each strategy given, tp by default)."""
    out: list[tuple[int, str | None]] = []
    for n in devices or [1]:
        for par in ([None] if n == 1 else parallel or ["tp"]):
            if (n, par) not in out:
                out.append((n, par))
    return out


def check_points(points: Sequence[Point]) -> None:
    """Every chip of the grid is valid and every config reads and fits its mode and
    sequence length: checked before any task starts."""
    from toptpu.compile_options import check_devices

    for p in points:
        try:
            check_devices(p.devices, p.parallel, p.chip_model())
        except (ChipFigureError, ValueError) as e:
            raise SweepError(f"grid point {dict(p.figures)}: {e}") from e
    for c, m, s, n, par in sorted({(p.config_dir, p.mode, p.seq_length, p.devices,
                                    p.parallel or "") for p in points}):
        read_checked_config(c, m, s, devices=n, parallel=par or None)


def run_point(point: Point) -> dict[str, Any]:
    """One grid point's CSV row: compile on its chip, estimate (greedy, one full chunk)."""
    chip = point.chip_model()
    row: dict[str, Any] = {"config": point.config_dir, "mode": point.mode,
                           "seq_length": point.seq_length, "chip": point.chip,
                           "devices": point.devices, "parallel": point.parallel or "",
                           "lanes": chip.lanes, "lane_bytes": chip.lane_bytes,
                           "ddr_gbps": chip.ddr_gbps, "tflops": chip.tflops[TFLOPS_TYPE],
                           "cores": chip.cores, "link_gbps": chip.link_gbps,
                           "link_latency_us": chip.link_latency_us,
                           "sustained_gbps": chip.sustained_gbps}
    try:
        config = read_checked_config(point.config_dir, point.mode, point.seq_length,
                                     devices=point.devices, parallel=point.parallel)
        shapes = StaticShapes.make(point.seq_length)
        compiled = compile_costs(config, chip, point.mode, shapes, nets=STEP_NETS,
                                 devices=point.devices, parallel=point.parallel)
        est = estimate(compiled, chip)
    except (CompileError, EstimateError) as e:
        return {**row, "error": str(e)}
    per = est.per_token
    return {**row, "weight_bytes": compiled.weight_bytes, "kv_bytes": compiled.kv_bytes,
            "device_bytes": max(est.device_bytes), "fits": est.fits,
            "ttft_s": est.ttft_s, "tokens_per_s": est.tokens_per_s,
            "decode_step_s": per.total_s,
            **{f"decode_{c}_s": getattr(per, f"{c}_s") for c in CATEGORIES},
            "decode_bound": per.bound, "error": ""}


# =========================================================================== running


def run_local(points: Sequence[Point], jobs: int,
              task: Callable[[Point], dict[str, Any]] = run_point) -> list[dict[str, Any]]:
    """The points' rows in grid order, `jobs` tasks at a time in local processes."""
    if jobs == 1 or len(points) == 1:
        return [task(p) for p in points]
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(points))) as pool:
        return list(pool.map(task, points))


def run_ray(points: Sequence[Point], address: str,
            task: Callable[[Point], dict[str, Any]] = run_point) -> list[dict[str, Any]]:
    """The points' rows in grid order, one Ray task each on the cluster at `address`
    ('local' starts a Ray instance on this machine)."""
    try:
        import ray
    except ImportError as e:
        raise SweepError("--ray needs Ray, which is not installed: pip install -e '.[ray]' "
                         "(or leave out --ray for a local process pool)") from e
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address,
                 include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(task)
        return list(ray.get([remote.remote(p) for p in points]))
    finally:
        if started:
            ray.shutdown()


# =========================================================================== outputs


def write_csv(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """The rows with `COLUMNS` (written atomically)."""
    with open_text_output(path, "the sweep table", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})


def x_axis(varying: Sequence[str]) -> str:
    """The bandwidth the tokens/s plot runs along: the link's when only it varies, else the
    DDR's."""
    return "link_gbps" if "link_gbps" in varying and "ddr_gbps" not in varying \
        else "ddr_gbps"


def series_label(row: Mapping[str, Any], varying: Sequence[str]) -> str:
    """What tells a row's line apart from the others: the columns that vary, but the
    plot's bandwidth."""
    parts = [f"{k} {_short(row[k])}" for k in varying if k != x_axis(varying) and row[k] != ""]
    return ", ".join(parts) or "all points"


def point_label(row: Mapping[str, Any], varying: Sequence[str]) -> str:
    return ", ".join(f"{k} {_short(row[k])}" for k in varying) or "the point"


def varying_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keys = ("config", "mode", "seq_length", "devices", "parallel", *AXES)
    return [k for k in keys if len({str(r[k]) for r in rows}) > 1]


def _short(v: Any) -> str:
    if isinstance(v, str):
        return os.path.basename(v.rstrip("/")) or v
    return f"{v:g}" if isinstance(v, float) else str(v)


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
CATEGORY_COLORS = {"ddr": (31, 119, 180), "compute": (214, 39, 40), "launch": (255, 127, 14),
                   "host": (127, 127, 127), "link": (44, 160, 44)}


def _save_png(img: Any, path: str) -> None:
    with open_output(path, "the sweep plot") as f:
        img.save(f, format="PNG")


def write_bandwidth_png(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Decode tokens/s (y) against nominal DDR GB/s (x; the link's GB/s when only it
    varies): a line per series."""
    from PIL import Image, ImageDraw, ImageFont

    ok = [r for r in rows if not r["error"]]
    varying = varying_columns(rows)
    axis = x_axis(varying)
    what = "DDR" if axis == "ddr_gbps" else "chip-to-chip link"
    series: dict[str, list[tuple[float, float]]] = {}
    for r in ok:
        series.setdefault(series_label(r, varying), []).append(
            (float(r[axis]), float(r["tokens_per_s"])))
    w, h, left, top, plot_w, plot_h = 900, 560 + 18 * len(series), 80, 40, 780, 420
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    d.text((10, 10), f"decode tokens/s against {what} bandwidth (modelled, toptpu sweep)",
           fill="black", font=font)
    xs = [x for pts in series.values() for x, _ in pts] or [0.0, 1.0]
    ys = [y for pts in series.values() for _, y in pts] or [1.0]
    x0, x1 = 0.0, max(xs) * 1.05
    y0, y1 = 0.0, max(ys) * 1.1

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + plot_w * (x - x0) / (x1 - x0), top + plot_h * (1 - (y - y0) / (y1 - y0)))

    d.rectangle([left, top, left + plot_w, top + plot_h], outline="black")
    for i in range(6):
        xv, yv = x0 + (x1 - x0) * i / 5, y0 + (y1 - y0) * i / 5
        px, _ = at(xv, y0)
        _, py = at(x0, yv)
        d.text((px - 12, top + plot_h + 6), f"{xv:.3g}", fill="black", font=font)
        d.text((10, py - 7), f"{yv:.4g}", fill="black", font=font)
    d.text((left + plot_w // 2 - 60, top + plot_h + 24),
           "DDR GB/s (nominal)" if axis == "ddr_gbps" else "link GB/s (per direction)",
           fill="black", font=font)
    for i, (label, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        pts = sorted(pts)
        if len(pts) > 1:
            d.line([at(x, y) for x, y in pts], fill=color, width=2)
        for x, y in pts:
            cx, cy = at(x, y)
            d.ellipse([cx - 4, cy - 4, cx + 4, cy + 4], fill=color)
        ly = top + plot_h + 50 + 18 * i
        d.rectangle([left, ly + 2, left + 12, ly + 12], fill=color)
        d.text((left + 18, ly), label, fill="black", font=font)
    if not ok:
        d.text((left + 20, top + 20), "no point compiled (see the CSV's error column)",
               fill="black", font=font)
    _save_png(img, path)


def write_breakdown_png(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Each point's decode step as a bar split by where the time goes."""
    from PIL import Image, ImageDraw, ImageFont

    varying = varying_columns(rows)
    ok = [r for r in rows if not r["error"]]
    label_w, bar_w, top = 420, 440, 60
    h = top + 22 * max(len(rows), 1) + 40
    img = Image.new("RGB", (label_w + bar_w + 120, h), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=13)
    d.text((10, 10), "where a decoded token's time goes (modelled, ms)", fill="black",
           font=font)
    lx = 10
    for c in CATEGORIES:
        d.rectangle([lx, 34, lx + 12, 46], fill=CATEGORY_COLORS[c])
        d.text((lx + 18, 32), c, fill="black", font=font)
        lx += 100
    longest = max((float(r["decode_step_s"]) for r in ok), default=1.0)
    for i, r in enumerate(rows):
        y = top + 22 * i
        d.text((10, y + 2), point_label(r, varying)[:60], fill="black", font=font)
        if r["error"]:
            d.text((label_w, y + 2), "did not compile: " + str(r["error"])[:60],
                   fill="black", font=font)
            continue
        x = float(label_w)
        for c in CATEGORIES:
            part = bar_w * float(r[f"decode_{c}_s"]) / longest
            d.rectangle([x, y, x + part, y + 16], fill=CATEGORY_COLORS[c])
            x += part
        d.text((x + 6, y + 2), f"{float(r['decode_step_s']) * 1e3:.3g}", fill="black",
               font=font)
    _save_png(img, path)


# =========================================================================== the command


def cmd_sweep(args: argparse.Namespace) -> int:
    """Modelled decode speed and time to first token over a grid of chip figures, modes,
    sequence lengths and models: a CSV and two PNG plots."""
    check_output_dir(args.out, "--out")
    axes = {a: getattr(args, a) for a in AXES}
    points = grid(args.config_dirs, args.mode or ["w4bf16"], args.seq_length or [512],
                  args.chip, axes, spreads_of(args.devices, args.parallel))
    check_points(points)
    for d in args.config_dirs:  # as `compile -o`: nothing is written into an input
        if os.path.isdir(d):
            check_not_inside(args.out, d, "--out")
    print(f"toptpu sweep: {len(points)} points "
          f"({'Ray at ' + args.ray if args.ray else f'{args.jobs} local processes'})",
          file=sys.stderr)
    rows = run_ray(points, args.ray) if args.ray else run_local(points, args.jobs)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, CSV_NAME)
    write_csv(csv_path, rows)
    write_bandwidth_png(os.path.join(args.out, BANDWIDTH_PNG), rows)
    write_breakdown_png(os.path.join(args.out, BREAKDOWN_PNG), rows)
    failed = [r for r in rows if r["error"]]
    print(f"wrote {csv_path} ({len(rows)} rows), {BANDWIDTH_PNG} and {BREAKDOWN_PNG} in "
          f"{args.out}" + (f"; {len(failed)} points did not compile (the error column says "
                           "why)" if failed else ""))
    return 0


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help=cmd_sweep.__doc__)
    p.add_argument("config_dirs", nargs="+", metavar="CONFIG_DIR",
                   help="directories with a model's config.json (weights are not needed)")
    p.add_argument("-o", "--out", required=True, help="directory for sweep.csv and the PNGs")
    p.add_argument("--chip", choices=chip_names(), default=DEFAULT_CHIP,
                   help="the preset whose figures the grid changes")
    p.add_argument("-q", "--mode", action="append", help="a quantization mode (repeatable; "
                   "default w4bf16)")
    p.add_argument("--seq-length", type=int_at_least(2), action="append",
                   help="a sequence length (repeatable; default 512)")
    many = {"nargs": "+", "default": None}
    p.add_argument("--lanes", type=int_at_least(1), help="NPU lanes per core", **many)
    p.add_argument("--lane-bytes", type=int_at_least(1), help="local memory bytes per lane",
                   **many)
    p.add_argument("--ddr-gbps", type=finite_float(0, lo_open=True),
                   help="nominal DDR GB/s", **many)
    p.add_argument("--tflops", type=finite_float(0, lo_open=True),
                   help=f"per-core {TFLOPS_TYPE} peak TFLOPS (other types scale with it)",
                   **many)
    p.add_argument("--cores", type=int_at_least(1), help="TPU cores", **many)
    p.add_argument("--link-gbps", type=finite_float(0, lo_open=True),
                   help="chip-to-chip GB/s per direction (several devices)", **many)
    p.add_argument("--link-latency-us", type=finite_float(0),
                   help="one chip-to-chip transfer's fixed cost, microseconds", **many)
    p.add_argument("--devices", type=int_at_least(1), help="chips the model is spread over "
                   "(default 1)", **many)
    p.add_argument("--parallel", choices=PARALLEL_STRATEGIES, action="append",
                   help="with --devices above 1: tp and/or pp (repeatable; default tp)")
    p.add_argument("--jobs", type=int_at_least(1), default=os.cpu_count() or 1,
                   help="local processes (default: the CPUs)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run the points as Ray tasks on the cluster at ADDRESS ('local': a "
                   "Ray instance on this machine); needs the optional extra: pip install "
                   "-e '.[ray]'")
    p.set_defaults(fn=cmd_sweep)
