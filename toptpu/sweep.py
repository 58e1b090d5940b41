"""`toptpu sweep`: modelled speed over a grid of chips, modes, sequence lengths and models.

Every grid point (a config directory, a mode, a sequence length and a chip: a preset with
some of its figures changed) is an independent task: it compiles the model's nets for that
chip from the config alone and estimates them as `toptpu estimate` does
(`toptpu.estimate`). Layer-group plans with the chip's local memory and costs, so a point
compiles on its own chip; nothing is shared between points. Tasks run in a local process
pool (`--jobs`) or, with `--ray ADDRESS`, as Ray tasks on a cluster (Ray is an optional
extra: `pip install -e '.[ray]'`; the cluster's workers need toptpu installed too).

The sweep writes one CSV row per point (a point that cannot compile, e.g. a layer that does
not fit a smaller local memory, keeps its row with the error) and the pictures of
`toptpu.sweep_plots`: for each swept parameter, decode tokens/s and the time to first token
against it (a line per combination of the others), and where each point's decode step goes
(DDR-bound nets, compute-bound nets, launches, host transfers).
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
from toptpu.paths import check_not_inside, check_output_dir, open_text_output
from toptpu.request import CompileRequest
from toptpu.sweep_plots import write_plots

#: the chip figures a sweep varies (`--tflops` is the per-core half-precision peak; the
#: other compute types scale with it; the link's matter to a model on several devices)
AXES = ("lanes", "lane_bytes", "ddr_gbps", "tflops", "cores", "link_gbps", "link_latency_us")
#: the compute type `--tflops` names
TFLOPS_TYPE = "bf16"
CSV_NAME = "sweep.csv"
COLUMNS = ("config", "mode", "seq_length", "chip", "devices", "parallel", *AXES,
           "sustained_gbps", "weight_bytes", "kv_bytes", "state_bytes", "device_bytes", "fits",
           "ttft_s", "tokens_per_s", "decode_step_s", *(f"decode_{c}_s" for c in CATEGORIES),
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

    def request(self, chip: Chip) -> CompileRequest:
        """What the point compiles, on `chip` (its chip model)."""
        return CompileRequest.make(mode=self.mode, chip=chip, seq_length=self.seq_length,
                                   devices=self.devices, parallel=self.parallel)


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
    unique = {(p.config_dir, p.mode, p.seq_length, p.devices, p.parallel or ""): p
              for p in points}
    for key in sorted(unique):
        read_checked_config(key[0], unique[key].request(unique[key].chip_model()))


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
        request = point.request(chip)
        config = read_checked_config(point.config_dir, request)
        compiled = compile_costs(config, request, nets=STEP_NETS)
        est = estimate(compiled, chip)
    except (CompileError, EstimateError) as e:
        return {**row, "error": str(e)}
    per = est.per_token
    return {**row, "weight_bytes": compiled.weight_bytes, "kv_bytes": compiled.kv_bytes,
            "state_bytes": compiled.state_bytes,
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
    pictures = write_plots(args.out, rows, args.chip)
    failed = [r for r in rows if r["error"]]
    print(f"wrote {csv_path} ({len(rows)} rows), {', '.join(pictures)} in "
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
