"""Chip presets (data in chips.json): the figures the compiler, the machine and the step
accounting share, each with its source.

A preset describes one chip as a deployment sees it:

- geometry: `lanes` x `lane_bytes` of local memory per core in `banks`, `align`;
- compute: `cores` TPU cores at `freq_ghz`, each with `tflops` dense peak per compute type;
  `compute_efficiency`, the fraction of that peak every compute command sustains (prefill,
  the one compute-bound phase, runs at ~50-65% of peak MACs on the real chips);
- memory: `ddr_gbps` nominal DDR bandwidth, `ddr_efficiency` the sustained fraction of it
  (decode of large models reaches ~75-80%), `core_ddr_gbps` what one core's DMA can draw
  (a second core adds bandwidth until the DDR is saturated; a one-core chip's is its
  nominal DDR bandwidth, above the sustained one, so it binds only where the DDR alone is
  raised past it: `toptpu sweep --ddr-gbps` moves it with the DDR), `ddr_bytes` capacity;
- per command: `dma_latency_cycles`, `compute_latency_cycles` (issue latency);
  `dma_burst_bytes`, the DDR's access granule: a transfer moves its window as contiguous
  runs (a strided window: one run per row it cuts), each run rounded up to whole bursts;
- per step, outside the nets: `launch_us` per net launch (launch, sync, interrupt: at least
  the 0.1 ms per interrupt of tpu-mlir's own estimator), `host_transfer_us` fixed cost of one
  host<->device copy (at most one such interrupt) and `host_gbps` its bandwidth (the
  position, mask and token ids each step); both fitted within those bounds;
- between chips (`LINK_FIGURES`, several devices): `link_gbps`, what one chip sends to
  another per direction over its chip-to-chip link, `link_latency_us`, the fixed cost of
  one transfer on it (DMA setup and the sync that ends it), `link_topology`, how the chips
  are connected (`pcie_switch`: every chip on its own port of one PCIe switch, so all
  pairs talk at once, each chip's port full duplex), and `max_devices`, the most chips one
  deployment joins. `toptpu.backend.target.link` turns them into the time of a collective
  (all-reduce, all-gather, broadcast) for the algorithm that moves it (ring or tree).

Two cores (BM1688): a net's work divides evenly between the cores, which run every command
in lockstep on their halves: compute at `cores` x the per-core peak, DMA at
min(`cores` x `core_ddr_gbps`, sustained DDR bandwidth) since the DDR is shared; the
per-command latencies are paid once (the cores overlap them). Local memory is planned per
core (`lanes` x `lane_bytes`).

`sources` names where each figure comes from: a public spec, an assumption, or the fit of
`bench/calibrate.py` to published speeds of real boards (`bench/calibration/`). The model is
not cycle-accurate; it is fitted so that whole-model decode speed and time to first token
come out near the real boards'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from functools import cache
from typing import Any

from toptpu.errors import ToptpuError


class UnknownChipError(ToptpuError, ValueError):
    pass


class ChipFigureError(ToptpuError, ValueError):
    """A chip figure out of range (a sweep or a preset); the message names it."""


@dataclass(frozen=True)
class Chip:
    name: str
    lanes: int
    lane_bytes: int
    banks: int
    align: int
    freq_ghz: float
    cores: int
    tflops: dict[str, float] = field(hash=False)  # per core, dense peak per compute type
    compute_efficiency: float
    ddr_gbps: float  # nominal
    ddr_efficiency: float  # sustained fraction of ddr_gbps
    core_ddr_gbps: float  # one core's DMA limit
    ddr_bytes: int
    dma_latency_cycles: int
    dma_burst_bytes: int  # every contiguous run of a transfer moves whole bursts
    compute_latency_cycles: int
    launch_us: float
    host_transfer_us: float
    host_gbps: float
    link_gbps: float  # chip-to-chip, per direction
    link_latency_us: float  # one transfer's fixed cost on the link
    link_topology: str  # LINK_TOPOLOGIES
    max_devices: int  # the most chips one deployment joins
    sources: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for f in ("lanes", "lane_bytes", "banks", "align", "cores", "max_devices",
                  "dma_burst_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ChipFigureError(f"chip {self.name}: {f} must be a positive integer, "
                                      f"got {v!r}")
        for f in ("freq_ghz", "ddr_gbps", "core_ddr_gbps", "host_gbps", "link_gbps"):
            if not _positive(getattr(self, f)):
                raise ChipFigureError(f"chip {self.name}: {f} must be a positive number, got "
                                      f"{getattr(self, f)!r}")
        for f in ("compute_efficiency", "ddr_efficiency"):
            v = getattr(self, f)
            if not (_positive(v) and v <= 1):
                raise ChipFigureError(f"chip {self.name}: {f} must be in (0, 1], got {v!r}")
        for f in ("dma_latency_cycles", "compute_latency_cycles", "launch_us",
                  "host_transfer_us", "link_latency_us"):
            v = getattr(self, f)
            if not (isinstance(v, int | float) and not isinstance(v, bool)
                    and 0 <= v < float("inf")):
                raise ChipFigureError(f"chip {self.name}: {f} must be a finite number >= 0, "
                                      f"got {v!r}")
        if not self.tflops or not all(_positive(v) for v in self.tflops.values()):
            raise ChipFigureError(f"chip {self.name}: tflops must map compute types to "
                                  f"positive numbers, got {self.tflops!r}")
        if self.link_topology not in LINK_TOPOLOGIES:
            raise ChipFigureError(f"chip {self.name}: link_topology must be one of "
                                  f"{', '.join(LINK_TOPOLOGIES)}, got {self.link_topology!r}")
        if self.lane_bytes % self.banks:
            raise ChipFigureError(f"chip {self.name}: lane_bytes {self.lane_bytes} is not a "
                                  f"multiple of banks {self.banks}")

    # ------------------------------------------------------------------ memory
    @property
    def bank_bytes(self) -> int:
        return self.lane_bytes // self.banks

    @property
    def local_bytes(self) -> int:
        return self.lanes * self.lane_bytes

    @property
    def sustained_gbps(self) -> float:
        """The DDR bandwidth a whole net can sustain: nominal x efficiency."""
        return self.ddr_gbps * self.ddr_efficiency

    @property
    def dma_gbps(self) -> float:
        """What the DMA of all cores draws together: their per-core limit, up to the
        sustained DDR bandwidth they share."""
        return min(self.cores * self.core_ddr_gbps, self.sustained_gbps)

    @property
    def bytes_per_cycle(self) -> float:
        """DMA bytes per cycle (`dma_gbps`)."""
        return self.dma_gbps / self.freq_ghz

    @property
    def sustained_bytes_per_cycle(self) -> float:
        return self.sustained_gbps / self.freq_ghz

    # ------------------------------------------------------------------ compute
    def flops_per_cycle(self, dtype: str) -> float:
        """Peak FLOPs per cycle of all cores for a compute type (f32 for unknown types)."""
        key = {"ui8": "int8", "i8": "int8"}.get(dtype, dtype)
        if key not in self.tflops:
            key = "f32"
        return self.cores * self.tflops[key] * 1e12 / (self.freq_ghz * 1e9)

    @property
    def peak_flops_per_cycle(self) -> float:
        return max(self.flops_per_cycle(k) for k in self.tflops)

    def per_lane(self, nbytes: int) -> int:
        """Bytes per lane a local buffer of `nbytes` occupies (split across all lanes)."""
        per = -(-nbytes // self.lanes)
        return -(-per // self.align) * self.align

    # ------------------------------------------------------------------ time
    @property
    def seconds_per_cycle(self) -> float:
        return 1.0 / (self.freq_ghz * 1e9)

    def with_figures(self, **figures: Any) -> Chip:
        """This chip with some figures changed (checked like a preset's); the changed
        figures' sources say so."""
        unknown = sorted(set(figures) - set(ALL_FIGURES))
        if unknown:
            raise ChipFigureError(f"unknown chip figures {unknown}; figures: "
                                  f"{', '.join(ALL_FIGURES)}")
        sources = {**self.sources, **{k: "set by the user" for k in figures}}
        return replace(self, **figures, sources=sources)

    def figures(self) -> dict[str, Any]:
        """The one-chip figures (everything but name, sources and the link between chips),
        JSON-ready: what a one-chip compile plans with."""
        return {k: getattr(self, k) for k in FIGURES}

    def link_figures(self) -> dict[str, Any]:
        """The figures of the link between chips (`LINK_FIGURES`)."""
        return {k: getattr(self, k) for k in LINK_FIGURES}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.figures(), **self.link_figures()}


#: how chips may be connected: every chip on its own port of one PCIe switch
LINK_TOPOLOGIES = ("pcie_switch",)
#: the figures of the link between chips (they change no one-chip compile)
LINK_FIGURES = ("link_gbps", "link_latency_us", "link_topology", "max_devices")
#: the one-chip figures of a preset (every one needs a source)
FIGURES = tuple(f.name for f in fields(Chip)
                if f.name not in ("name", "sources", *LINK_FIGURES))
#: every figure of a preset
ALL_FIGURES = (*FIGURES, *LINK_FIGURES)


def _positive(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0 and v < float("inf")


PRESETS_PATH = os.path.join(os.path.dirname(__file__), "chips.json")


@cache
def _presets() -> dict[str, dict]:
    with open(PRESETS_PATH) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}


#: the chip a command compiles for when none is named
DEFAULT_CHIP = "bm1684x"


def chip_names() -> list[str]:
    return sorted(_presets())


def get_chip(name: str) -> Chip:
    presets = _presets()
    if name not in presets:
        raise UnknownChipError(f"unknown chip '{name}'; choose one of {', '.join(chip_names())}")
    return chip_from_json({"name": name, **presets[name]})


def chip_from_json(d: dict) -> Chip:
    """A chip from its JSON form (a preset, or `Chip.to_json` as program files keep it)."""
    missing = [k for k in ALL_FIGURES if k not in d]
    extra = [k for k in d if k not in ALL_FIGURES and k not in ("name", "sources")]
    if missing or extra:
        raise ChipFigureError(f"chip {d.get('name')!r}: figures missing {missing}, unknown "
                              f"{extra}")
    return Chip(**d)
