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

The DDR axis moves every DDR limit it implies: `--ddr-gbps X` sets the nominal bandwidth
(the sustained one is X times the preset's `ddr_efficiency`) and one core's DMA limit
`core_ddr_gbps` in proportion (X times the preset's core_ddr_gbps / ddr_gbps), unless
`--core-ddr-gbps` sweeps that limit itself; the CSV has both columns and what the cores
draw together (`dma_gbps`).

A grid's size is checked before anything is built (`--max-points`); the points run with a
progress line on a terminal (none with --quiet or when stderr is not a terminal); the CSV
and the pictures are written as one set: all rendered first, each written to a temporary
file beside its target, then renamed into place with SIGINT/SIGTERM held off, so an
interrupt or a full disk leaves the previous outputs as they were and no temporary file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import io
import itertools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import IO, Any

from toptpu.backend.runtime.accounting import CATEGORIES
from toptpu.backend.target.chips import (
    DEFAULT_CHIP,
    Chip,
    ChipFigureError,
    chip_names,
    get_chip,
)
from toptpu.cli_args import PARALLEL_STRATEGIES, UsageError, finite_float, int_at_least
from toptpu.dialects.output_file import is_regular
from toptpu.errors import CompileError
from toptpu.estimate import (
    STEP_NETS,
    EstimateError,
    chip_with,
    compile_costs,
    estimate,
    read_checked_config,
)
from toptpu.paths import check_not_inside, check_output_dir, open_output
from toptpu.request import CompileRequest
from toptpu.sweep_plots import render_plots

#: the chip figures a sweep varies (`--tflops` is the per-core half-precision peak; the
#: other compute types scale with it; `--ddr-gbps` moves `core_ddr_gbps` with it unless
#: `--core-ddr-gbps` is swept too; the link's matter to a model on several devices)
AXES = ("lanes", "lane_bytes", "ddr_gbps", "core_ddr_gbps", "tflops", "cores", "link_gbps",
        "link_latency_us")
#: the compute type `--tflops` names
TFLOPS_TYPE = "bf16"
CSV_NAME = "sweep.csv"
COLUMNS = ("config", "mode", "seq_length", "chip", "devices", "parallel", *AXES,
           "sustained_gbps", "dma_gbps", "weight_bytes", "kv_bytes", "state_bytes",
           "device_bytes", "fits", "ttft_s", "tokens_per_s", "decode_step_s",
           *(f"decode_{c}_s" for c in CATEGORIES), "decode_bound", "error")
#: the most grid points a sweep runs unless --max-points says more (a point compiles a
#: model's nets: seconds each, so 1000 points are hours on a small host)
MAX_POINTS = 1000


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
    bf16 has the value given; `ddr_gbps` without `core_ddr_gbps` moves one core's DMA
    limit in proportion (a faster DDR is not capped at the preset's per-core limit)."""
    out: dict[str, Any] = dict(figures)
    if "ddr_gbps" in out and "core_ddr_gbps" not in out:
        out["core_ddr_gbps"] = base.core_ddr_gbps * out["ddr_gbps"] / base.ddr_gbps
    if "tflops" in out:
        scale = out["tflops"] / base.tflops[TFLOPS_TYPE]
        out["tflops"] = {k: v * scale for k, v in base.tflops.items()}
    return chip_with(base, out)


def grid_size(config_dirs: Sequence[str], modes: Sequence[str], seq_lengths: Sequence[int],
              axes: Mapping[str, Sequence[float] | None],
              spreads: Sequence[tuple[int, str | None]] = ((1, None),)) -> int:
    """How many points `grid` makes of these (counted, nothing built)."""
    return math.prod([len(config_dirs), len(modes), len(seq_lengths), len(spreads),
                      *(len(v) for v in axes.values() if v)])


def check_grid_size(points: int, limit: int) -> None:
    if points > limit:
        raise SweepError(f"the grid has {points} points, over the limit of {limit} (each "
                         "point compiles the model's nets, seconds each): narrow the grid, "
                         f"or raise the limit with --max-points {points}")


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
                           "ddr_gbps": chip.ddr_gbps, "core_ddr_gbps": chip.core_ddr_gbps,
                           "tflops": chip.tflops[TFLOPS_TYPE],
                           "cores": chip.cores, "link_gbps": chip.link_gbps,
                           "link_latency_us": chip.link_latency_us,
                           "sustained_gbps": chip.sustained_gbps, "dma_gbps": chip.dma_gbps}
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


class Progress:
    """`done/total points` with the elapsed and the estimated remaining time, on one line
    of stderr rewritten in place (tqdm-style); silent unless `shown`."""

    def __init__(self, total: int, shown: bool, stream: IO[str] | None = None) -> None:
        self.total, self.shown, self.done = total, shown, 0
        self.stream = stream or sys.stderr
        self.start = time.monotonic()
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        if not self.shown:
            return
        spent = time.monotonic() - self.start
        left = (f", about {_duration(spent / self.done * (self.total - self.done))} left"
                if self.done else "")
        self.stream.write(f"\rtoptpu sweep: {self.done}/{self.total} points, "
                          f"{_duration(spent)}{left}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60}:{s % 60:02d}"


def _worker_init() -> None:
    """A pool process leaves SIGINT to the sweep's process, which ends the pool (a Ctrl-C
    reaching the whole process group does not kill workers mid-task), and dies on SIGTERM
    as a process does (it inherited the command's handler)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_local(points: Sequence[Point], jobs: int,
              task: Callable[[Point], dict[str, Any]] = run_point,
              progress: Progress | None = None) -> list[dict[str, Any]]:
    """The points' rows in grid order, `jobs` tasks at a time in local processes; on an
    interrupt or error the pool's processes are ended before it propagates."""
    bar = progress or Progress(len(points), False)
    if jobs == 1 or len(points) == 1:
        rows = []
        for p in points:
            rows.append(task(p))
            bar.update()
        return rows
    out: dict[int, dict[str, Any]] = {}
    pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(points)),
                                                  initializer=_worker_init)
    try:
        futures = {pool.submit(task, p): i for i, p in enumerate(points)}
        for done in concurrent.futures.as_completed(futures):
            out[futures[done]] = done.result()
            bar.update()
    except BrokenProcessPool as e:
        _end(pool)
        raise SweepError("a sweep process died (killed from outside, or out of memory): "
                         "run again with fewer --jobs") from e
    except BaseException:
        _end(pool)
        raise
    pool.shutdown()
    return [out[i] for i in range(len(points))]


def _end(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop a pool now: its queued tasks cancelled, its processes terminated and reaped."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def run_ray(points: Sequence[Point], address: str,
            task: Callable[[Point], dict[str, Any]] = run_point,
            progress: Progress | None = None) -> list[dict[str, Any]]:
    """The points' rows in grid order, one Ray task each on the cluster at `address`
    ('local' starts a Ray instance on this machine)."""
    try:
        import ray
    except ImportError as e:
        raise SweepError("--ray needs Ray, which is not installed: pip install -e '.[ray]' "
                         "(or leave out --ray for a local process pool)") from e
    bar = progress or Progress(len(points), False)
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address,
                 include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(task)
        refs = [remote.remote(p) for p in points]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            bar.update(len(done))
        return list(ray.get(refs))
    finally:
        if started:
            ray.shutdown()


# =========================================================================== outputs


def csv_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows with `COLUMNS`, as the CSV file holds them."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in COLUMNS})
    return buf.getvalue()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held off (blocked; delivered on leaving) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def write_together(files: Sequence[tuple[str, bytes, str]]) -> None:
    """Write every (path, data, what) or none: each to a temporary file beside its target
    (`open_output`: symlinks followed, devices written through), flushed and synced, so
    a full disk or an interrupt fails before any target changes and removes them all;
    then every temporary file renamed over its target with SIGINT/SIGTERM held off."""
    with contextlib.ExitStack() as stack:
        for path, data, what in files:
            f = stack.enter_context(open_output(path, what, size=len(data)))
            f.write(data)
            f.flush()
            if is_regular(f):
                os.fsync(f.fileno())
        with signals_held():
            stack.close()


def write_outputs(out: str, rows: Sequence[Mapping[str, Any]], chip: str) -> list[str]:
    """sweep.csv and the pictures in `out` (created if missing), as one set
    (`write_together`); a directory this call created is removed again if the set is not
    written. Returns the file names."""
    files = [(CSV_NAME, csv_text(rows).encode(), "the sweep table"),
             *((name, data, "the sweep plot") for name, data in render_plots(rows, chip))]
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        write_together([(os.path.join(out, n), d, what) for n, d, what in files])
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    return [n for n, _, _ in files]


# =========================================================================== the command


def cmd_sweep(args: argparse.Namespace) -> int:
    """Modelled decode speed and time to first token over a grid of chip figures, modes,
    sequence lengths and models: a CSV and PNG plots."""
    check_output_dir(args.out, "--out")
    axes = {a: getattr(args, a) for a in AXES}
    modes, seqs = args.mode or ["w4bf16"], args.seq_length or [512]
    spreads = spreads_of(args.devices, args.parallel)
    size = grid_size(args.config_dirs, modes, seqs, axes, spreads)
    check_grid_size(size, args.max_points)
    points = grid(args.config_dirs, modes, seqs, args.chip, axes, spreads)
    check_points(points)
    for d in args.config_dirs:  # as `compile -o`: nothing is written into an input
        if os.path.isdir(d):
            check_not_inside(args.out, d, "--out")
    if not args.quiet:
        print(f"toptpu sweep: {len(points)} points "
              f"({'Ray at ' + args.ray if args.ray else f'{args.jobs} local processes'})",
              file=sys.stderr)
    bar = Progress(len(points), not args.quiet and sys.stderr.isatty())
    try:
        rows = (run_ray(points, args.ray, progress=bar) if args.ray
                else run_local(points, args.jobs, progress=bar))
    finally:
        bar.close()
    names = write_outputs(args.out, rows, args.chip)
    failed = [r for r in rows if r["error"]]
    print(f"wrote {os.path.join(args.out, CSV_NAME)} ({len(rows)} rows), "
          f"{', '.join(names[1:])} in {args.out}"
          + (f"; {len(failed)} points did not compile (the error column says why)"
             if failed else ""))
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
                   help="nominal DDR GB/s (one core's DMA limit moves with it in proportion, "
                   "unless --core-ddr-gbps is given)", **many)
    p.add_argument("--core-ddr-gbps", type=finite_float(0, lo_open=True),
                   help="one core's DMA limit, GB/s (what a core draws; the cores together "
                   "draw at most the sustained DDR bandwidth)", **many)
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
                   help="with --devices above 1: tp, pp and/or ep (repeatable; default tp)")
    p.add_argument("--jobs", type=int_at_least(1), default=os.cpu_count() or 1,
                   help="local processes (default: the CPUs)")
    p.add_argument("--max-points", type=int_at_least(1), default=MAX_POINTS,
                   help=f"refuse a grid of more points (default {MAX_POINTS})")
    p.add_argument("--quiet", action="store_true", help="no start line and no progress "
                   "(progress is shown only when stderr is a terminal)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run the points as Ray tasks on the cluster at ADDRESS ('local': a "
                   "Ray instance on this machine); needs the optional extra: pip install "
                   "-e '.[ray]'")
    p.set_defaults(fn=cmd_sweep)
