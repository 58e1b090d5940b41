"""The pictures of `toptpu sweep`: one per swept parameter, and where each step's time goes.

`vs_<parameter>.png` for each numeric column the grid varies (a chip figure, the sequence
length): the parameter on the x-axis (log scale for a grid whose values grow by a factor,
as doubling grids do; ticks at the swept values), decode tokens/s in the upper panel and
the time to first token in the lower one, one line per combination of the other varied
columns (model, mode, the other figures), labelled axes with round ticks. A grid that varies
no numeric column (only models or modes) gets one picture with them as categories on x.
Lines that lie on top of each other say so in the legend.

`breakdown.png`: each point's decoded token as a bar split by where the time goes.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toptpu.backend.runtime.accounting import CATEGORIES
from toptpu.paths import write_output

if TYPE_CHECKING:
    from PIL import Image, ImageDraw, ImageFont

    Font = ImageFont.FreeTypeFont | ImageFont.ImageFont

#: the numeric columns a sweep can vary, with what their axis says
NUMERIC = {
    "seq_length": ("sequence length SEQ", "tokens"),
    "lanes": ("NPU lanes per core", ""),
    "lane_bytes": ("local memory per lane", ""),  # the ticks say KiB / MiB
    "ddr_gbps": ("DDR bandwidth, nominal", "GB/s"),
    "core_ddr_gbps": ("one core's DMA limit", "GB/s"),
    "tflops": ("bf16 peak per core, the other types scaled with it", "TFLOPS"),
    "cores": ("TPU cores", ""),
    "devices": ("devices the model is spread over", ""),
    "link_gbps": ("chip-to-chip link bandwidth, per direction", "GB/s"),
    "link_latency_us": ("chip-to-chip link latency, per step", "us"),
}
#: the categorical columns (the model, the mode)
CATEGORICAL = {"config": "model (config directory)", "mode": "quantization mode",
               "parallel": "parallel strategy"}
BREAKDOWN_PNG = "breakdown.png"

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
MARKERS = ("circle", "square", "triangle", "diamond")
CATEGORY_COLORS = {"ddr": (31, 119, 180), "compute": (214, 39, 40), "launch": (255, 127, 14),
                   "host": (127, 127, 127), "link": (44, 160, 44)}


def plot_name(column: str) -> str:
    return f"vs_{column}.png"


def short(v: Any, column: str = "") -> str:
    """A value as a label: a directory by its name, bytes in KiB/MiB, numbers with %g."""
    if isinstance(v, str):
        return os.path.basename(v.rstrip("/")) or v or "-"
    if column == "lane_bytes":
        return _bytes(float(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def _bytes(n: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and (n / size).is_integer():
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


#: columns a sweep moves with another one (the DDR axis moves one core's DMA limit in
#: proportion): not a parameter of their own while they follow it
FOLLOWS = {"core_ddr_gbps": "ddr_gbps"}


def _varies(rows: Sequence[Mapping[str, Any]], column: str) -> bool:
    return len({str(r.get(column, "")) for r in rows}) > 1


def follow_ratio(rows: Sequence[Mapping[str, Any]], column: str) -> float | None:
    """The ratio `column` keeps to the column it follows (`FOLLOWS`) at every point, where
    that column varies and this one moves with it in proportion; None otherwise."""
    source = FOLLOWS.get(column)
    if source is None or not rows or not _varies(rows, source):
        return None
    try:
        ratios = [float(r[column]) / float(r[source]) for r in rows]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    same = all(math.isclose(x, ratios[0], rel_tol=1e-9) for x in ratios)
    return ratios[0] if same else None


def varying_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keys = (*CATEGORICAL, *NUMERIC)
    return [k for k in keys if _varies(rows, k) and follow_ratio(rows, k) is None]


def plotted_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The columns that get a picture: every numeric column the grid varies, else the
    categorical ones (one picture, the first of them on x), else none."""
    varying = varying_columns(rows)
    numeric = [k for k in varying if k in NUMERIC]
    return numeric or varying[:1]


def is_log_grid(values: Sequence[float]) -> bool:
    """Whether the values sit more evenly on a log axis than on a linear one (a grid that
    doubles, 16 32 64 128, does; 10 20 30 does not): all positive, spanning at least 4x."""
    v = sorted(set(values))
    if len(v) < 2 or v[0] <= 0 or v[-1] / v[0] < 4:
        return False
    if len(v) == 2:
        return True
    lin = [b - a for a, b in zip(v, v[1:], strict=False)]
    log = [math.log(b / a) for a, b in zip(v, v[1:], strict=False)]
    return max(log) / min(log) < max(lin) / min(lin)


def nice_ticks(hi: float, target: int = 5) -> list[float]:
    """0 and multiples of a 1/2/5 x 10^k step up to the first at or above `hi`."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0, 1.0]
    raw = hi / target
    exp = math.floor(math.log10(raw))
    step = next(m * 10.0 ** exp for m in (1, 2, 5, 10) if m * 10.0 ** exp >= raw * (1 - 1e-9))
    n = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(n + 1)]


def linear_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round 1/2/5 ticks covering [lo, hi] (lo may be above 0)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / target
    exp = math.floor(math.log10(raw))
    step = next(m * 10.0 ** exp for m in (1, 2, 5, 10) if m * 10.0 ** exp >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def tick_label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:.6g}"


@dataclass(frozen=True)
class XAxis:
    """Where a value goes along the x-axis (0..1), its ticks and their labels."""

    column: str
    values: tuple[Any, ...]  # the swept values (numbers), or the categories in order
    log: bool
    categorical: bool

    @classmethod
    def of(cls, column: str, rows: Sequence[Mapping[str, Any]]) -> XAxis:
        if column in NUMERIC:
            vals = tuple(sorted({float(r[column]) for r in rows}))
            return cls(column, vals, is_log_grid(vals), False)
        seen: dict[str, None] = {}
        for r in rows:
            seen[str(r[column])] = None
        return cls(column, tuple(seen), False, True)

    @property
    def span(self) -> tuple[float, float]:
        if self.categorical:
            return -0.5, len(self.values) - 0.5
        lo, hi = self.values[0], self.values[-1]
        if self.log:
            lo, hi = math.log2(lo), math.log2(hi)
            pad = 0.08 * (hi - lo)
            return lo - pad, hi + pad
        ticks = linear_ticks(lo, hi) if hi > lo else [lo - 1, lo + 1]
        lo, hi = min(ticks[0], lo), max(ticks[-1], hi)
        pad = 0.03 * (hi - lo)  # a point on the last tick is not drawn on the frame
        return lo - pad, hi + pad

    def frac(self, value: Any) -> float:
        lo, hi = self.span
        if self.categorical:
            x = float(self.values.index(str(value)))
        else:
            x = math.log2(float(value)) if self.log else float(value)
        return (x - lo) / (hi - lo)

    def ticks(self) -> list[tuple[Any, str]]:
        if self.categorical:
            return [(v, short(v, self.column)) for v in self.values]
        if self.log:  # the swept values themselves, thinned to at most 10
            every = math.ceil(len(self.values) / 10)
            return [(v, short(v, self.column)) for v in self.values[::every]]
        lo, hi = self.values[0], self.values[-1]
        ticks = linear_ticks(lo, hi) if hi > lo else [lo]
        return [(t, short(t, self.column) if self.column == "lane_bytes" else tick_label(t))
                for t in ticks]

    @property
    def label(self) -> str:
        what, unit = NUMERIC.get(self.column) or (CATEGORICAL.get(self.column, self.column),
                                                  "")
        notes = [n for n in (unit, "log scale" if self.log else "") if n]
        return what + (f" ({', '.join(notes)})" if notes else "")


#: lines whose every point is within this of an earlier line's are drawn on top of it (on
#: a panel 300 pixels high, 0.1% of the value is well under a pixel)
SAME_WITHIN = 1e-3


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[Any, float, float], ...]  # (x value, tokens/s, TTFT s)
    same_as: str | None = None  # an earlier series with the same points (within SAME_WITHIN)


def series_of(rows: Sequence[Mapping[str, Any]], column: str) -> list[Series]:
    """A line per combination of the other varied columns, its points in x order; a line
    whose points equal an earlier one's names it."""
    others = [k for k in varying_columns(rows) if k != column]
    lines: dict[str, list[tuple[Any, float, float]]] = {}
    for r in rows:
        label = ", ".join(f"{k} {short(r[k], k)}" for k in others) or "all points"
        pts = lines.setdefault(label, [])
        if not r["error"]:
            x = r[column] if column in CATEGORICAL else float(r[column])
            pts.append((x, float(r["tokens_per_s"]), float(r["ttft_s"])))
    out: list[Series] = []
    for label, pts in lines.items():
        key = sorted(pts, key=lambda p: (str(p[0]) if column in CATEGORICAL else p[0]))
        same = next((s.label for s in out if s.same_as is None and len(s.points) == len(key)
                     and all(a[0] == b[0] and math.isclose(a[1], b[1], rel_tol=SAME_WITHIN)
                             and math.isclose(a[2], b[2], rel_tol=SAME_WITHIN)
                             for a, b in zip(s.points, key, strict=True))), None)
        out.append(Series(label, tuple(key), same))
    return out


def _seconds_unit(hi: float) -> tuple[str, float]:
    return ("s", 1.0) if hi >= 1.0 else ("ms", 1e3) if hi >= 1e-3 else ("us", 1e6)


def style(i: int) -> tuple[tuple[int, int, int], str]:
    """The colour and marker of the i-th line: both change from line to line, so points of
    lines drawn on each other still show each line's marker."""
    return COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]


def _marker(d: ImageDraw.ImageDraw, kind: str, x: float, y: float, color: tuple[int, int, int],
            r: int = 4) -> None:
    if kind == "square":
        d.rectangle([x - r, y - r, x + r, y + r], fill=color)
    elif kind == "triangle":
        d.polygon([(x, y - r - 1), (x - r - 1, y + r), (x + r + 1, y + r)], fill=color)
    elif kind == "diamond":
        d.polygon([(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)], fill=color)
    else:
        d.ellipse([x - r, y - r, x + r, y + r], fill=color)


def _panel(d: ImageDraw.ImageDraw, box: tuple[int, int, int, int], axis: XAxis,
           series: Sequence[Series], which: int, title: str, fonts: tuple[Font, Font]) -> None:
    """One chart: `which` picks tokens/s (1) or TTFT (2) from each point."""
    font, small = fonts
    left, top, right, bottom = box
    values = [p[which] for s in series for p in s.points]
    hi = max(values, default=1.0)
    unit, scale = ("tokens/s", 1.0) if which == 1 else _seconds_unit(hi)
    yticks = nice_ticks(hi * scale)
    ymax = yticks[-1] or 1.0

    def at(x: Any, y: float) -> tuple[float, float]:
        return (left + (right - left) * axis.frac(x),
                bottom - (bottom - top) * (y * scale) / ymax)

    d.text((left, top - 22), f"{title} ({unit})", fill="black", font=font)
    for t in yticks:
        _, py = at(axis.values[0], t / scale)
        d.line([left, py, right, py], fill=(232, 232, 232))
        d.line([left - 5, py, left, py], fill="black")
        label = tick_label(t)
        d.text((left - 9 - d.textlength(label, font=small), py - 7), label, fill="black",
               font=small)
    for v, label in axis.ticks():
        px = left + (right - left) * axis.frac(v)
        d.line([px, bottom, px, bottom + 5], fill="black")
        d.text((px - d.textlength(label, font=small) / 2, bottom + 7), label, fill="black",
               font=small)
    d.rectangle([left, top, right, bottom], outline="black")
    for i, s in enumerate(series):
        color, marker = style(i)
        pts = [at(p[0], p[which]) for p in s.points]
        if len(pts) > 1:
            d.line(pts, fill=color, width=2)
        for x, y in pts:
            _marker(d, marker, x, y, color, r=6 - min(i, 3))  # later ones smaller: all show


#: the layout of a `vs_*.png`: width, the panels' left and right edges, the top of the first
#: panel, a panel's height and the space below it
WIDTH, LEFT, RIGHT, PANEL_TOP, PANEL_H, PANEL_GAP = 1000, 90, 970, 100, 300, 70


def axis_image(rows: Sequence[Mapping[str, Any]], column: str, fixed: str) -> Image.Image:
    """Decode tokens/s and the time to first token against `column` (see the module doc);
    `fixed` says what the whole sweep holds constant (the chip preset, ...)."""
    from PIL import Image, ImageDraw, ImageFont

    font, small = ImageFont.load_default(size=14), ImageFont.load_default(size=12)
    axis = XAxis.of(column, rows)
    series = series_of(rows, column)
    failed = sum(1 for r in rows if r["error"])
    width, left, right, panel_h = WIDTH, LEFT, RIGHT, PANEL_H
    legend_h = 20 * len(series) + 10
    height = PANEL_TOP + 2 * (panel_h + PANEL_GAP) + 40 + legend_h
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    what = NUMERIC[column][0] if column in NUMERIC else CATEGORICAL.get(column, column)
    d.text((10, 10), f"toptpu sweep: modelled decode speed and time to first token against "
                     f"{what}", fill="black", font=font)
    notes = _wrapped(d, fixed, small, width - 20)
    if failed:
        notes.append(f"{failed} point(s) did not compile: not drawn (the CSV's error column "
                     "says why)")
    for i, line in enumerate(notes[:3]):
        d.text((10, 30 + 15 * i), line, fill=(80, 80, 80), font=small)
    top = PANEL_TOP
    for which, title in ((1, "decode speed"), (2, "time to first token")):
        _panel(d, (left, top, right, top + panel_h), axis, series, which, title,
               (font, small))
        d.text(((left + right) / 2 - d.textlength(axis.label, font=small) / 2,
                top + panel_h + 24), axis.label, fill="black", font=small)
        top += panel_h + PANEL_GAP
    y = top + 10
    for i, s in enumerate(series):
        color, marker = style(i)
        d.line([left, y + 8, left + 24, y + 8], fill=color, width=2)
        _marker(d, marker, left + 12, y + 8, color)
        text = s.label + (f"  (within {SAME_WITHIN:.1%} of {s.same_as} at every point: drawn "
                          "on it)" if s.same_as else "") + ("  (no point compiled)" if not s.points
                                                   else "")
        d.text((left + 34, y), text, fill="black", font=small)
        y += 20
    return img


def _wrapped(d: ImageDraw.ImageDraw, text: str, font: Font, width: float) -> list[str]:
    """`text` in lines of at most `width` pixels, broken after commas."""
    lines, line = [], ""
    for part in text.split(", "):
        candidate = f"{line}, {part}" if line else part
        if line and d.textlength(candidate, font=font) > width:
            lines.append(line + ",")
            candidate = part
        line = candidate
    return [*lines, line]


def fixed_description(rows: Sequence[Mapping[str, Any]], chip: str) -> str:
    """What every point of the sweep shares: the preset and the columns not varied (a
    column that moves with a varied one says so)."""
    varying = set(varying_columns(rows))
    parts = [f"chip preset {chip}"]
    if rows:
        for k in (*CATEGORICAL, *NUMERIC):
            ratio = follow_ratio(rows, k)
            if ratio is not None:
                parts.append(f"{k} moved with {FOLLOWS[k]} ({ratio:.3g} x it)")
            elif k not in varying and rows[0].get(k, "") != "":
                parts.append(f"{k} {short(rows[0][k], k)}")
    return "held fixed: " + ", ".join(parts)


def breakdown_image(rows: Sequence[Mapping[str, Any]]) -> Image.Image:
    """Each point's decode step as a bar split by where the time goes."""
    from PIL import Image, ImageDraw, ImageFont

    varying = varying_columns(rows)
    ok = [r for r in rows if not r["error"]]
    font = ImageFont.load_default(size=13)
    labels = [", ".join(f"{k} {short(r[k], k)}" for k in varying) or "the point" for r in rows]
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = int(max((probe.textlength(t, font=font) for t in labels), default=100)) + 30
    bar_w, top = 480, 60
    h = top + 22 * max(len(rows), 1) + 40
    img = Image.new("RGB", (label_w + bar_w + 120, h), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), "where a decoded token's time goes (modelled, ms)", fill="black",
           font=font)
    lx = 10
    for c in CATEGORIES:
        d.rectangle([lx, 34, lx + 12, 46], fill=CATEGORY_COLORS[c])
        d.text((lx + 18, 32), c, fill="black", font=font)
        lx += 100
    longest = max((float(r["decode_step_s"]) for r in ok), default=1.0)
    for i, (r, label) in enumerate(zip(rows, labels, strict=True)):
        y = top + 22 * i
        d.text((10, y + 2), label, fill="black", font=font)
        if r["error"]:
            d.text((label_w, y + 2), "did not compile: " + str(r["error"])[:60],
                   fill="black", font=font)
            continue
        x = float(label_w)
        for c in CATEGORIES:
            part = bar_w * float(r.get(f"decode_{c}_s") or 0) / longest
            d.rectangle([x, y, x + part, y + 16], fill=CATEGORY_COLORS[c])
            x += part
        d.text((x + 6, y + 2), f"{float(r['decode_step_s']) * 1e3:.3g}", fill="black",
               font=font)
    return img


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def render_plots(rows: Sequence[Mapping[str, Any]], chip: str) -> list[tuple[str, bytes]]:
    """Every picture of the sweep: (file name, PNG bytes), nothing written."""
    out = []
    fixed = fixed_description(rows, chip)
    for column in plotted_columns(rows):
        out.append((plot_name(column), _png(axis_image(rows, column, fixed))))
    out.append((BREAKDOWN_PNG, _png(breakdown_image(rows))))
    return out


def write_plots(out: str, rows: Sequence[Mapping[str, Any]], chip: str) -> list[str]:
    """Every picture of the sweep in `out`, each written atomically; returns their file
    names (`toptpu sweep` writes them with the CSV as one set)."""
    names = []
    for name, data in render_plots(rows, chip):
        write_output(os.path.join(out, name), data, "the sweep plot")
        names.append(name)
    return names
