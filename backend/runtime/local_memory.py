"""The reference machine's local memory: a local buffer as a step uses it (`Local`), the live
buffers' intervals (`LiveBuffers`), and the two representations of the lanes' bytes: a real
byte array (`CheckedLocal`, the checked mode) or a reference to each live buffer's value
(`FastLocal`, the fast mode) — with the same traps (see `toptpu.backend.runtime.machine`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from toptpu.backend.formats.commands import (
    LocalRef,
)
from toptpu.backend.runtime.errors import MachineTrap
from toptpu.backend.target.chips import Chip

# ====================================================================== local memory


@dataclass(frozen=True, slots=True)
class Local:
    """A local buffer as a step uses it: its per-lane range [lo, hi), and the trap its
    address deserves (misaligned, outside the lane), raised when a command touches it."""

    lo: int
    hi: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    buf: int
    error: str | None

    @classmethod
    def of(cls, ref: LocalRef, chip: Chip) -> Local:
        per = chip.per_lane(ref.nbytes)
        lo, hi = ref.addr, ref.addr + per
        error = None
        if lo % chip.align:
            error = f"local address {lo} is not {chip.align}-byte aligned"
        elif lo < 0 or hi > chip.lane_bytes:
            error = f"local access [{lo}, {hi}) is outside the lane ({chip.lane_bytes} B)"
        return cls(lo, hi, ref.nbytes, np.dtype(ref.dtype), tuple(ref.shape), ref.buf, error)


class LiveBuffers:
    """The live local buffers: their per-lane intervals (disjoint), kept sorted by start so
    a new buffer is checked against its one possible neighbour, and each buffer's payload
    (the fast mode's value)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.by_start: dict[int, int] = {}  # lo -> buf
        self.live: dict[int, tuple[int, int, str, Any]] = {}  # buf -> (lo, hi, who, payload)

    def clear(self) -> None:
        self.starts.clear()
        self.by_start.clear()
        self.live.clear()

    def claim(self, ref: Local, who: str, payload: Any) -> None:
        """Make `ref` live (its own earlier instance aside, it must overlap nothing live)."""
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        if ref.buf in self.live:
            self.release(ref.buf)
        lo, hi = ref.lo, ref.hi
        i = bisect.bisect_left(self.starts, hi)
        if i:
            other = self.live[self.by_start[self.starts[i - 1]]]
            if other[1] > lo:
                raise MachineTrap(f"{who}: writes local [{lo}, {hi}) over the live buffer "
                                  f"{other[2]} [{other[0]}, {other[1]})")
        self.starts.insert(i, lo)
        self.by_start[lo] = ref.buf
        self.live[ref.buf] = (lo, hi, who, payload)

    def release(self, buf: int) -> None:
        entry = self.live.pop(buf, None)
        if entry is not None:
            lo = entry[0]
            del self.starts[bisect.bisect_left(self.starts, lo)]
            del self.by_start[lo]

    def entry(self, ref: Local, who: str) -> tuple[int, int, str, Any]:
        """The live entry a read of `ref` finds (traps: bad address, not live, not where
        the buffer was written)."""
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        e = self.live.get(ref.buf)
        if e is None:
            raise MachineTrap(f"{who}: reads buffer {ref.buf} that is not live")
        if e[0] != ref.lo or e[1] != ref.hi:
            raise MachineTrap(f"{who}: reads buffer {ref.buf} at local [{ref.lo}, {ref.hi}) "
                              f"but it was written at [{e[0]}, {e[1]})")
        return e


class CheckedLocal:
    """Local memory as bytes: values live at their addresses; unwritten bytes trap."""

    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        self.bytes = np.zeros((chip.lanes, chip.lane_bytes), np.uint8)
        self.written = np.zeros(chip.lane_bytes, bool)
        self.buffers = LiveBuffers()

    def begin(self) -> None:
        self.buffers.clear()
        self.written[:] = False

    def release(self, buf: int) -> None:
        self.buffers.release(buf)

    def read(self, ref: Local, who: str) -> np.ndarray:
        lo, hi = ref.lo, ref.hi
        if ref.error:
            raise MachineTrap(f"{who}: {ref.error}")
        if not self.written[lo:hi].all():
            raise MachineTrap(f"{who}: reads local [{lo}, {hi}) that nothing wrote")
        self.buffers.entry(ref, who)
        raw = self.bytes[:, lo:hi].reshape(-1)[:ref.nbytes]
        return raw.view(ref.dtype).reshape(ref.shape)

    def write(self, ref: Local, value: np.ndarray, who: str, copy: bool = False) -> None:
        arr = np.ascontiguousarray(value, dtype=ref.dtype)
        if arr.nbytes != ref.nbytes:
            raise MachineTrap(f"{who}: result has {arr.nbytes} B, its buffer {ref.nbytes} B")
        self.buffers.claim(ref, who, None)
        per = ref.hi - ref.lo
        flat = np.zeros(self.chip.lanes * per, np.uint8)
        flat[:ref.nbytes] = arr.reshape(-1).view(np.uint8)
        self.bytes[:, ref.lo:ref.hi] = flat.reshape(self.chip.lanes, per)
        self.written[ref.lo:ref.hi] = True


class FastLocal:
    """Local memory as each live buffer's value (a view of a read-only region for loaded
    weights: no copy). Where the buffers live does not depend on the data, so the traps
    about it (overlap, alignment, lane, reads of buffers not live or not where they were
    written, leaks) are found once per plan (`first_local_trap`) and raised at their step."""

    def __init__(self, chip: Chip) -> None:
        self.values: dict[int, np.ndarray] = {}

    def begin(self) -> None:
        self.values.clear()

    def release(self, buf: int) -> None:
        self.values.pop(buf, None)

    def read(self, ref: Local, who: str) -> np.ndarray:
        value = self.values[ref.buf]
        if value.dtype != ref.dtype or value.shape != ref.shape:  # the bytes, reinterpreted
            value = value.reshape(-1).view(np.uint8)[:ref.nbytes].view(ref.dtype)
            value = value.reshape(ref.shape)
        return value

    def write(self, ref: Local, value: np.ndarray, who: str, copy: bool = False) -> None:
        """Keep `value` as the buffer's contents; `copy` when its source may change (a
        load from a writable region)."""
        if copy:
            arr = np.array(value, dtype=ref.dtype, order="C")
        elif value.dtype == ref.dtype and value.shape == ref.shape:
            arr = value  # kept as it is, strided or not (a joined slice's part of the whole)
        else:
            arr = np.ascontiguousarray(value, dtype=ref.dtype)
        if arr.nbytes != ref.nbytes:
            raise MachineTrap(f"{who}: result has {arr.nbytes} B, its buffer {ref.nbytes} B")
        self.values[ref.buf] = arr if arr.shape == ref.shape else arr.reshape(ref.shape)


LocalMemory = CheckedLocal | FastLocal


def local_trap(buffers: LiveBuffers, net: str) -> str | None:
    """The trap of a net that ends with `buffers` live (None: nothing is live); clears
    them."""
    if not buffers.live:
        return None
    names = sorted({e[2] for e in buffers.live.values()})[:4]
    buffers.clear()
    return f"net '{net}' ended with live local buffers {names}"
