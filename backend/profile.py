"""Profiles of machine runs: summary numbers, Chrome trace JSON (opens in Perfetto) and a
PNG timeline with a roofline chart.

For each net run: modelled cycles and seconds, busy cycles per engine, bytes moved by DMA,
FLOPs, the achieved fraction of DDR bandwidth and of peak compute, and the roofline bound —
the larger of the net's own bytes (weights, inputs, outputs: what it cannot avoid moving)
over DDR bandwidth and its FLOPs over the chip's peak — with the ratio bound / modelled
(1.0 would be a perfect machine; modelled time is never below the bound).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from toptpu.backend.chips import Chip
from toptpu.backend.machine import Timeline


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
    ddr_fraction: float
    compute_fraction: float
    roofline_cycles: float
    roofline_ratio: float
    runs: int = 1

    def row(self) -> str:
        return (f"{self.net:<14} {self.runs:>5} {self.seconds * 1e3:>10.3f} "
                f"{self.dma_busy / max(self.cycles, 1):>6.1%} "
                f"{self.compute_busy / max(self.cycles, 1):>6.1%} "
                f"{self.dma_bytes / 1e6:>10.2f} {self.flops / 1e9:>9.3f} "
                f"{self.ddr_fraction:>6.1%} {self.compute_fraction:>6.1%} "
                f"{self.roofline_ratio:>6.2f}")


HEADER = (f"{'net':<14} {'runs':>5} {'ms/run':>10} {'dma':>6} {'cmp':>6} {'MB moved':>10} "
          f"{'GFLOP':>9} {'ddr':>6} {'peak':>6} {'roof':>6}")


def profile_timeline(tl: Timeline, chip: Chip, inherent_bytes: int, flops: int | None = None
                     ) -> NetProfile:
    """Numbers of one run. The roofline's compute side counts every command's FLOPs at the
    peak of the type it computes in (a bf16 matmul at the bf16 peak, an f32 norm at f32)."""
    cycles = tl.cycles
    f = tl.flops if flops is None else flops
    bw = chip.bytes_per_cycle
    peak = chip.peak_flops_per_cycle
    compute_bound = sum(e.flops / chip.flops_per_cycle(e.dtype) for e in tl.events
                        if e.engine == "cmp")
    roof = max(inherent_bytes / bw, compute_bound)
    return NetProfile(
        net=tl.net,
        cycles=cycles,
        seconds=cycles / (chip.freq_ghz * 1e9),
        dma_busy=tl.busy("dma"),
        compute_busy=tl.busy("cmp"),
        dma_bytes=tl.dma_bytes,
        flops=f,
        inherent_bytes=inherent_bytes,
        ddr_fraction=tl.dma_bytes / (cycles * bw) if cycles else 0.0,
        compute_fraction=f / (cycles * peak) if cycles else 0.0,
        roofline_cycles=roof,
        roofline_ratio=roof / cycles if cycles else 0.0,
    )


def summary_table(profiles: list[NetProfile], chip: Chip) -> str:
    lines = [f"chip {chip.name}: {chip.lanes} lanes x {chip.lane_bytes // 1024} KiB, "
             f"{chip.ddr_gbps:g} GB/s DDR, peak {max(chip.tflops.values()):g} TFLOPS, "
             f"{chip.freq_ghz:g} GHz", HEADER]
    lines += [p.row() for p in profiles]
    lines.append("dma/cmp: engine busy fraction; ddr/peak: achieved fraction of DDR bandwidth "
                 "and peak compute; roof: roofline bound / modelled time")
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
                "args": {"cmd": e.cmd, "bytes": e.bytes, "flops": e.flops},
            })
        offset += tl.cycles
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"chip": chip.name}}


def write_chrome_trace(path: str, timelines: list[Timeline], chip: Chip) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines, chip), f)


def write_timeline_png(path: str, tl: Timeline, chip: Chip, profile: NetProfile,
                       width: int = 1400) -> None:
    """The two engines' timeline (top) and the net on the roofline (bottom)."""
    import math

    from PIL import Image, ImageDraw

    h = 420
    img = Image.new("RGB", (width, h), "white")
    d = ImageDraw.Draw(img)
    left, right = 90, width - 20
    span = max(tl.cycles, 1.0)

    def x(c: float) -> float:
        return left + (right - left) * c / span

    d.text((10, 8), f"{tl.net}: {profile.seconds * 1e6:.1f} us modelled on {chip.name} "
                    f"(roofline {profile.roofline_ratio:.2f})", fill="black")
    rows = {"dma": (40, 80), "cmp": (100, 140)}
    d.text((10, 52), "DMA", fill="black")
    d.text((10, 112), "compute", fill="black")
    palette = [(66, 133, 244), (52, 168, 83), (251, 188, 5), (234, 67, 53), (155, 89, 182)]
    for e in tl.events:
        y0, y1 = rows[e.engine]
        color = palette[hash(e.name.split(".")[0]) % len(palette)]
        d.rectangle([x(e.start), y0, max(x(e.end), x(e.start) + 1), y1], fill=color)
    for i in range(11):
        c = span * i / 10
        d.line([x(c), 145, x(c), 150], fill="black")
        d.text((x(c) - 12, 152), f"{c / (chip.freq_ghz * 1e3):.0f}us", fill="black")
    # roofline: attainable FLOP/s vs arithmetic intensity (log-log)
    top, bottom, rl, rr = 190, h - 30, left, left + 520
    peak = max(chip.tflops.values()) * 1e12
    bw = chip.ddr_gbps * 1e9
    ai_lo, ai_hi = 1e-2, 1e4
    p_lo, p_hi = peak / 1e5, peak * 2

    def px(ai: float) -> float:
        return rl + (rr - rl) * (math.log10(ai) - math.log10(ai_lo)) / (
            math.log10(ai_hi) - math.log10(ai_lo))

    def py(p: float) -> float:
        p = min(max(p, p_lo), p_hi)
        return bottom - (bottom - top) * (math.log10(p) - math.log10(p_lo)) / (
            math.log10(p_hi) - math.log10(p_lo))

    d.rectangle([rl, top, rr, bottom], outline="black")
    pts = [(px(a), py(min(peak, a * bw))) for a in
           [10 ** (math.log10(ai_lo) + k * 0.05) for k in range(int(
               (math.log10(ai_hi) - math.log10(ai_lo)) / 0.05) + 1)]]
    d.line(pts, fill="black", width=2)
    ai = profile.flops / max(profile.inherent_bytes, 1)
    achieved = profile.flops / max(profile.seconds, 1e-12)
    if profile.flops > 0:
        cx, cy = px(min(max(ai, ai_lo), ai_hi)), py(achieved)
        d.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=(234, 67, 53))
    d.text((rr + 20, top), "roofline: FLOP/s vs FLOP per byte (log-log)", fill="black")
    d.text((rr + 20, top + 20), f"intensity {ai:.2f} FLOP/B", fill="black")
    d.text((rr + 20, top + 40), f"achieved {achieved / 1e12:.3f} TFLOP/s", fill="black")
    d.text((rr + 20, top + 60), f"DDR {profile.ddr_fraction:.1%}, peak "
                                f"{profile.compute_fraction:.1%}", fill="black")
    img.save(path)


def profiles_json(profiles: list[NetProfile]) -> list[dict]:
    return [asdict(p) for p in profiles]
