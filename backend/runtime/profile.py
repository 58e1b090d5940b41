"""Profiles of machine runs: summary numbers, Chrome trace JSON (opens in Perfetto) and a
PNG timeline with a roofline chart.

For each net run: modelled cycles and seconds, busy cycles per engine, bytes moved by DMA,
FLOPs, the net's compute type (the type most of its FLOPs are computed in), the achieved
fraction of the sustained DDR bandwidth and of that type's peak compute, and the roofline
bound — the larger of the net's own bytes (weights, inputs, outputs: what it cannot avoid
moving; of a gathered table only the rows read) over the sustained DDR bandwidth and its
FLOPs over the chip's peak (each command's at the peak of its type, all cores) — with the
ratio bound / modelled (1.0 would be a perfect machine; modelled time is never below the
bound).

The PNG: the DMA and compute timelines coloured by what each command does, with a legend
(each colour's share of its engine's busy time) and time ticks in ns/us/ms as the span
needs; below, the net on the roofline (log-log, labelled axes) of its own compute type.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from toptpu.backend.formats.commands import Command, Gather, Load, Space, Store
from toptpu.backend.runtime.machine import Timeline
from toptpu.backend.target.chips import Chip
from toptpu.dialects.output_file import open_output, write_output


@dataclass
class NetProfile:
    net: str
    cycles: float
    seconds: float
    dma_busy: float
    compute_busy: float
    dma_bytes: int
    flops: int
    inherent_bytes: int
    compute_dtype: str | None  # the type most FLOPs are computed in; None: no compute
    peak_flops: float  # FLOP/s of compute_dtype on the chip (0.0 without compute)
    ddr_fraction: float
    compute_fraction: float
    roofline_cycles: float
    roofline_ratio: float
    runs: int = 1
    #: bytes the indexed loads (a MoE layer's experts) moved in the run, and what loading
    #: every expert would move (0, 0: no indexed load)
    fetched_bytes: int = 0
    fetched_all_bytes: int = 0

    def row(self, width: int = 14) -> str:
        """The net's line of `summary_table`, its name in a column `width` wide."""
        return (f"{self.net:<{width}} {self.runs:>5} {self.seconds * 1e3:>10.3f} "
                f"{self.dma_busy / max(self.cycles, 1):>6.1%} "
                f"{self.compute_busy / max(self.cycles, 1):>6.1%} "
                f"{self.dma_bytes / 1e6:>10.2f} {self.flops / 1e9:>9.3f} "
                f"{self.ddr_fraction:>6.1%} {self.compute_fraction:>6.1%} "
                f"{self.roofline_ratio:>6.2f} {self.compute_dtype or '-':>5}")


def header(width: int = 14) -> str:
    """The column heads of `summary_table`, the first `width` wide."""
    return (f"{'net':<{width}} {'runs':>5} {'ms/run':>10} {'dma':>6} {'cmp':>6} "
            f"{'MB moved':>10} {'GFLOP':>9} {'ddr':>6} {'peak':>6} {'roof':>6} {'type':>5}")


def compute_dtype(tl: Timeline) -> str | None:
    """The type a net computes in: the one its compute commands do most FLOPs in (a w4bf16
    block: bf16, though its norms run in f32); None for a net without FLOPs."""
    flops: dict[str, int] = {}
    for e in tl.events:
        if e.engine == "cmp" and e.flops > 0:
            flops[e.dtype] = flops.get(e.dtype, 0) + e.flops
    return max(sorted(flops), key=lambda t: flops[t]) if flops else None


def profile_timeline(tl: Timeline, chip: Chip, inherent_bytes: int, flops: int | None = None,
                     fetched: tuple[int, int] = (0, 0)) -> NetProfile:
    """Numbers of one run. The roofline's compute side counts every command's FLOPs at the
    peak of the type it computes in (a bf16 matmul at the bf16 peak, an f32 norm at f32).
    `fetched`: the bytes the run's indexed loads moved and those of every row (expert)."""
    cycles = tl.cycles
    f = tl.flops if flops is None else flops
    bw = chip.sustained_bytes_per_cycle
    ctype = compute_dtype(tl)
    peak = chip.flops_per_cycle(ctype) if ctype else 0.0
    compute_bound = sum(e.flops / chip.flops_per_cycle(e.dtype) for e in tl.events
                        if e.engine == "cmp")
    roof = max(inherent_bytes / bw, compute_bound)
    return NetProfile(
        net=tl.net,
        cycles=cycles,
        seconds=cycles * chip.seconds_per_cycle,
        dma_busy=tl.busy("dma"),
        compute_busy=tl.busy("cmp"),
        dma_bytes=tl.dma_bytes,
        flops=f,
        inherent_bytes=inherent_bytes,
        compute_dtype=ctype,
        peak_flops=peak * chip.freq_ghz * 1e9,
        ddr_fraction=tl.dma_bytes / (cycles * bw) if cycles else 0.0,
        compute_fraction=f / (cycles * peak) if cycles and peak else 0.0,
        roofline_cycles=roof,
        roofline_ratio=roof / cycles if cycles else 0.0,
        fetched_bytes=fetched[0],
        fetched_all_bytes=fetched[1],
    )


def summary_table(profiles: list[NetProfile], chip: Chip) -> str:
    lines = [f"chip {chip.name}: {chip.cores} core(s) of {chip.lanes} lanes x "
             f"{chip.lane_bytes // 1024} KiB, DDR {chip.ddr_gbps:g} GB/s nominal, "
             f"{chip.sustained_gbps:.3g} GB/s sustained, peak TFLOPS per core "
             + ", ".join(f"{t} {v:g}" for t, v in chip.tflops.items())
             + f", {chip.freq_ghz:g} GHz"]
    width = max([len("net"), *(len(p.net) for p in profiles)])
    lines.append(header(width))
    lines += [p.row(width) for p in profiles]
    lines.append("dma/cmp: engine busy fraction; ddr/peak: achieved fraction of the sustained "
                 "DDR bandwidth and of the peak of the net's compute type; roof: roofline "
                 "bound / modelled time; type: the type most FLOPs are computed in")
    for p in profiles:
        if p.fetched_all_bytes:
            lines.append(f"{p.net}: experts fetched by index {p.fetched_bytes / 1e6:.2f} MB "
                         f"a run (the experts the tokens chose), "
                         f"{p.fetched_all_bytes / 1e6:.2f} MB if every expert moved")
    return "\n".join(lines)


def chrome_trace(timelines: list[Timeline], chip: Chip) -> dict:
    """Chrome trace events: one process per net run, one thread per engine (µs)."""
    us = 1e6 / (chip.freq_ghz * 1e9)
    events: list[dict] = []
    offset = 0.0
    for pid, tl in enumerate(timelines, start=1):
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"{tl.net} (run {pid})"}})
        for tid, eng in ((1, "DMA"), (2, "compute")):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": eng}})
        for e in tl.events:
            events.append({
                "ph": "X", "pid": pid, "tid": 1 if e.engine == "dma" else 2,
                "name": e.name, "ts": (offset + e.start) * us, "dur": (e.end - e.start) * us,
                "args": {"cmd": e.cmd, "bytes": e.bytes, "flops": e.flops, "group": e.group,
                         "slice": e.slice, **({"reduction part": e.part} if e.part else {})},
            })
        offset += tl.cycles
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"chip": chip.name}}


def write_chrome_trace(path: str, timelines: list[Timeline], chip: Chip) -> None:
    write_output(path, json.dumps(chrome_trace(timelines, chip)), "--trace")


#: timeline colours, in the order a net's categories take them (by busy time); the rest
#: share OTHER_COLOR. DMA and compute draw from different sets, so a colour means one thing.
DMA_COLORS = [(31, 119, 180), (23, 190, 207), (148, 103, 189), (140, 86, 75), (188, 189, 34)]
CMP_COLORS = [(214, 39, 40), (255, 127, 14), (44, 160, 44), (227, 119, 194), (255, 187, 120),
              (152, 223, 138), (255, 152, 150), (197, 176, 213)]
OTHER_COLOR = (190, 190, 190)
#: what a DMA command moves, by direction and global memory space
DMA_LABELS = {("load", Space.WEIGHT): "load weights", ("load", Space.IO): "load inputs",
              ("load", Space.ACT): "load activations", ("load", Space.CONST): "load constants",
              ("store", Space.IO): "store outputs", ("store", Space.ACT): "store activations"}
#: tick units: (name, seconds, power of ten)
TIME_UNITS = [("ns", 1e-9, -9), ("us", 1e-6, -6), ("ms", 1e-3, -3), ("s", 1.0, 0)]


def command_category(cmd: Command) -> str:
    """What a command does, as the timeline's legend names it: a DMA's direction and memory
    ("load weights", "store outputs", "gather"), a compute command's op ("a16_matmul")."""
    if isinstance(cmd, Gather):
        return "gather"
    if isinstance(cmd, Load | Store):
        space = cmd.tensor.space
        return DMA_LABELS.get((cmd.cmd, space), f"{cmd.cmd} {space.value}")
    return cmd.kind.removeprefix("tpu.")


@dataclass(frozen=True)
class LegendEntry:
    label: str
    color: tuple[int, int, int]
    busy: float  # fraction of the engine's busy time


def legend(tl: Timeline, commands: Sequence[Command], engine: str
           ) -> tuple[list[LegendEntry], dict[int, tuple[int, int, int]]]:
    """The engine's categories by busy time (the first ones get their own colour, the rest
    one "other" entry) and the colour of each of its commands (by command id)."""
    busy: dict[str, float] = {}
    for e in tl.events:
        if e.engine == engine:
            cat = command_category(commands[e.cmd])
            busy[cat] = busy.get(cat, 0.0) + (e.end - e.start)
    total = sum(busy.values()) or 1.0
    palette = DMA_COLORS if engine == "dma" else CMP_COLORS
    ranked = sorted(busy, key=lambda c: (-busy[c], c))
    colors = {c: palette[i] if i < len(palette) else OTHER_COLOR for i, c in enumerate(ranked)}
    entries = [LegendEntry(c, colors[c], busy[c] / total) for c in ranked[:len(palette)]]
    rest = ranked[len(palette):]
    if rest:
        entries.append(LegendEntry(f"other ({len(rest)} kinds)", OTHER_COLOR,
                                   sum(busy[c] for c in rest) / total))
    by_cmd = {e.cmd: colors[command_category(commands[e.cmd])] for e in tl.events
              if e.engine == engine}
    return entries, by_cmd


def _time_unit(seconds: float) -> tuple[str, float, int]:
    """The largest unit in which `seconds` is at least 1 (ns for anything shorter)."""
    fitting = [u for u in TIME_UNITS if seconds >= u[1]]
    return fitting[-1] if fitting else TIME_UNITS[0]


def time_ticks(span_s: float, target: int = 10) -> list[tuple[float, str]]:
    """Ticks over [0, span_s] seconds: a 1/2/5 x 10^k step giving about `target` intervals,
    labelled in the unit that suits the span (ns, us, ms, s) with the decimals the step
    needs, so neighbouring labels always differ."""
    if not span_s > 0 or not math.isfinite(span_s):
        raise ValueError(f"time span must be a positive number of seconds, not {span_s}")
    exp = math.floor(math.log10(span_s / target))
    frac = span_s / target / 10.0 ** exp
    mult = next((m for m in (1, 2, 5) if frac <= m * (1 + 1e-9)), None)
    if mult is None:
        mult, exp = 1, exp + 1
    unit, _, unit_exp = _time_unit(span_s)
    decimals = max(0, unit_exp - exp)
    step = mult * 10.0 ** exp
    ticks = []
    k = 0
    while k * step <= span_s * (1 + 1e-9):
        value = k * mult * 10.0 ** (exp - unit_exp)  # in the unit
        ticks.append((k * step, f"{value:.{decimals}f} {unit}"))
        k += 1
    return ticks


def format_seconds(seconds: float) -> str:
    """A duration in the unit that suits it, 3 significant digits ("1.33 us")."""
    unit, scale, _ = _time_unit(seconds)
    return f"{seconds / scale:.3g} {unit}"


def _si(value: float, unit: str) -> str:
    """1.6e13, "FLOP/s" -> "16 TFLOP/s"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def write_timeline_png(path: str, tl: Timeline, chip: Chip, profile: NetProfile,
                       commands: Sequence[Command], width: int = 1400) -> None:
    """The two engines' timeline with a legend (top) and the net on the roofline of its own
    compute type (bottom)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, 1000), "white")  # cropped to what was drawn
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    left, right = 90, width - 30
    span = max(tl.cycles, 1.0)
    seconds_per_cycle = chip.seconds_per_cycle

    def x(c: float) -> float:
        return left + (right - left) * c / span

    what = (f"computes in {profile.compute_dtype}" if profile.compute_dtype
            else "no compute commands")
    d.text((10, 8), f"{tl.net}: {format_seconds(profile.seconds)} modelled on {chip.name}, "
                    f"{what}; roofline bound / modelled {profile.roofline_ratio:.2f}",
           fill="black", font=font)
    rows = {"dma": (40, 80), "cmp": (100, 140)}
    d.text((10, 52), "DMA", fill="black", font=font)
    d.text((10, 112), "compute", fill="black", font=font)
    legends = {eng: legend(tl, commands, eng) for eng in rows}
    for e in tl.events:
        y0, y1 = rows[e.engine]
        d.rectangle([x(e.start), y0, max(x(e.end), x(e.start) + 1), y1],
                    fill=legends[e.engine][1][e.cmd])
    for t, label in time_ticks(span * seconds_per_cycle):
        tx = x(t / seconds_per_cycle)
        d.line([tx, 142, tx, 148], fill="black")
        w = d.textlength(label, font=small)
        d.text((min(max(tx - w / 2, 2), width - w - 2), 150), label, fill="black", font=small)
    y = 175
    for eng, name in (("dma", "DMA"), ("cmp", "compute")):
        entries = legends[eng][0]
        d.text((10, y), name, fill="black", font=small)
        lx: float = left
        for entry in entries or [LegendEntry("(none)", (255, 255, 255), 0.0)]:
            text = f"{entry.label} {entry.busy:.0%}" if entries else entry.label
            tw = d.textlength(text, font=small)
            if lx + 16 + tw > right:
                lx, y = left, y + 18
            if entries:
                d.rectangle([lx, y + 1, lx + 11, y + 12], fill=entry.color)
            d.text((lx + 16, y), text, fill="black", font=small)
            lx += 16 + tw + 18
        y += 20
    bottom = _draw_roofline(d, profile, chip, top=y + 40, left=left, font=font, small=small)
    with open_output(path, "--png") as f:
        img.crop((0, 0, width, bottom)).save(f, format="PNG")


def _draw_roofline(d: Any, profile: NetProfile, chip: Chip, top: int, left: int,
                   font: Any, small: Any) -> int:
    """Attainable FLOP/s over arithmetic intensity (log-log) at the peak of the net's compute
    type, and the net's point: its FLOPs over its inherent bytes, at its achieved FLOP/s.
    Returns the lowest y drawn on."""
    rl, rr, bottom = left, left + 560, top + 300
    tx = rr + 30
    if profile.compute_dtype is None:
        d.text((rl, top - 20), "no roofline: the net has no compute commands (it only moves "
                               f"data); DDR {profile.ddr_fraction:.1%} of "
                               f"{chip.sustained_gbps:.3g} GB/s sustained", fill="black",
           font=font)
        return top + 10
    peak = profile.peak_flops
    bw = chip.sustained_gbps * 1e9
    ai_lo, ai_hi = 1e-2, 1e4
    p_lo = 10.0 ** math.floor(math.log10(peak / 1e5))
    p_hi = 10.0 ** math.ceil(math.log10(peak * 2))
    lx0, lx1, ly0, ly1 = (math.log10(v) for v in (ai_lo, ai_hi, p_lo, p_hi))

    def px(ai: float) -> float:
        return rl + (rr - rl) * (math.log10(ai) - lx0) / (lx1 - lx0)

    def py(p: float) -> float:
        p = min(max(p, p_lo), p_hi)
        return bottom - (bottom - top) * (math.log10(p) - ly0) / (ly1 - ly0)

    d.text((rl - 80, top - 22), "attainable FLOP/s (log)", fill="black", font=small)
    d.rectangle([rl, top, rr, bottom], outline="black")
    for k in range(round(lx0), round(lx1) + 1):
        gx = px(10.0 ** k)
        d.line([gx, bottom, gx, bottom + 5], fill="black")
        label = f"{10.0 ** k:g}"
        d.text((gx - d.textlength(label, font=small) / 2, bottom + 7), label, fill="black",
               font=small)
    for k in range(round(ly0), round(ly1) + 1):
        gy = py(10.0 ** k)
        d.line([rl - 5, gy, rl, gy], fill="black")
        label = _si(10.0 ** k, "")
        d.text((rl - 9 - d.textlength(label, font=small), gy - 6), label, fill="black",
               font=small)
    xlabel = "arithmetic intensity: FLOP per byte (log)"
    d.text(((rl + rr) / 2 - d.textlength(xlabel, font=small) / 2, bottom + 22), xlabel,
           fill="black", font=small)
    steps = 200
    pts = [(px(a), py(min(peak, a * bw))) for a in
           (10 ** (lx0 + (lx1 - lx0) * k / steps) for k in range(steps + 1))]
    d.line(pts, fill="black", width=2)
    ridge = peak / bw
    d.text((px(min(ridge, ai_hi)) + 6, py(peak) - 16),
           f"{profile.compute_dtype} peak {_si(peak, 'FLOP/s')}", fill="black", font=small)
    d.text((rl + 8, py(bw * ai_lo * 10) - 22), f"DDR {chip.sustained_gbps:.3g} GB/s sustained",
           fill="black", font=small)
    ai = profile.flops / max(profile.inherent_bytes, 1)
    achieved = profile.flops / max(profile.seconds, 1e-12)
    cx, cy = px(min(max(ai, ai_lo), ai_hi)), py(achieved)
    d.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=(214, 39, 40))
    lines = [
        (f"roofline of {chip.name} for {profile.compute_dtype} (log-log)", font),
        (f"net: {profile.flops:,} FLOP over {profile.inherent_bytes:,} inherent bytes", small),
        (f"intensity {ai:.3g} FLOP/byte (red dot)", small),
        (f"achieved {_si(achieved, 'FLOP/s')}: {profile.compute_fraction:.1%} of the "
         f"{profile.compute_dtype} peak {_si(peak, 'FLOP/s')}", small),
        (f"DDR {profile.ddr_fraction:.1%} of {chip.sustained_gbps:.3g} GB/s sustained", small),
        (f"roofline bound / modelled time {profile.roofline_ratio:.2f}", small),
    ]
    for i, (text, f) in enumerate(lines):
        d.text((tx, top + 4 + 20 * i), text, fill="black", font=f)
    return bottom + 45


def profiles_json(profiles: list[NetProfile]) -> list[dict]:
    return [asdict(p) for p in profiles]
