"""Chip presets (data in chips.json): the parameters the compiler and the machine share.

The figures approximate public numbers (BM1684X: 64 NPU lanes x 256 KiB local memory in
16 banks, ~16 TFLOPS f16/bf16, ~2 TFLOPS f32, ~32 TOPS int8, ~64 GB/s DDR; BM1688: 32 lanes x
128 KiB). They serve the cost model (`toptpu.backend.target.cost`) and the memory rules;
they are not a cycle-accurate description of either chip.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cache


class UnknownChipError(ValueError):
    pass


@dataclass(frozen=True)
class Chip:
    name: str
    lanes: int
    lane_bytes: int
    banks: int
    align: int
    freq_ghz: float
    tflops: dict[str, float] = field(hash=False)
    ddr_gbps: float
    ddr_bytes: int
    dma_latency_cycles: int
    compute_latency_cycles: int

    @property
    def bank_bytes(self) -> int:
        return self.lane_bytes // self.banks

    @property
    def local_bytes(self) -> int:
        return self.lanes * self.lane_bytes

    @property
    def bytes_per_cycle(self) -> float:
        return self.ddr_gbps / self.freq_ghz

    def flops_per_cycle(self, dtype: str) -> float:
        key = {"ui8": "int8", "i8": "int8"}.get(dtype, dtype)
        if key not in self.tflops:
            key = "f32"
        return self.tflops[key] * 1e12 / (self.freq_ghz * 1e9)

    @property
    def peak_flops_per_cycle(self) -> float:
        return max(self.flops_per_cycle(k) for k in self.tflops)

    def per_lane(self, nbytes: int) -> int:
        """Bytes per lane a local buffer of `nbytes` occupies (split across all lanes)."""
        per = -(-nbytes // self.lanes)
        return -(-per // self.align) * self.align

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@cache
def _presets() -> dict[str, dict]:
    with open(os.path.join(os.path.dirname(__file__), "chips.json")) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def chip_names() -> list[str]:
    return sorted(_presets())


def get_chip(name: str) -> Chip:
    presets = _presets()
    if name not in presets:
        raise UnknownChipError(f"unknown chip '{name}'; choose one of {', '.join(chip_names())}")
    return Chip(name=name, **presets[name])


def chip_from_json(d: dict) -> Chip:
    return Chip(**d)

