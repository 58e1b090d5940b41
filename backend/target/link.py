"""What moving data between chips costs: collectives over the chip-to-chip link.

A chip's link figures (`Chip.link_gbps`, `link_latency_us`, `link_topology`; see
`toptpu.backend.target.chips`) give the time of one transfer: latency + bytes / bandwidth.
The topology the presets model, `pcie_switch`, puts every chip on its own port of one PCIe
switch: every chip sends and receives at once (its port is full duplex), so in one *step*
of an algorithm all chips move their part concurrently and the step takes the time of one
transfer of that part.

A collective is a sequence of such steps, fixed by its algorithm (`ALGORITHMS`):

- **all-reduce** (the sum of one tensor of `nbytes` on every chip, on every chip):
  - `ring`: reduce-scatter then all-gather around a ring: 2 (N - 1) steps, each chip sending
    nbytes / N per step; each chip adds N - 1 received parts of nbytes / N;
  - `tree`: recursive doubling (TPU-MLIR's DevParallel sum: at step t chip i adds what chip
    i xor 2^t holds): log2 N steps of the whole tensor, an add of nbytes each. With N not a
    power of two the chips past the largest power of two P first send theirs in and get
    the sum back at the end: log2 P + 2 steps (`tree_rounds`).
  The adds run on each chip's DDR: reading two tensors and writing one, 3 x the bytes over
  its DMA bandwidth (as tpu-mlir's LlmProfile.py charges them).
- **all-gather** (each chip's part of `nbytes / N` to every chip, concatenated):
  - `ring`: N - 1 steps of one part;
  - `tree`: recursive doubling, `tree_rounds` steps of 1, 2, 4, ... parts.
- **broadcast** (one chip's tensor to every other): `tree`, ceil(log2 N) steps of the
  tensor (a chip that has it sends it on); `ring`, a chain of N - 1 steps.
- **send** (one chip's tensor to one other, the hidden state of pipeline parallelism): one
  step.

`collective_seconds` is the modelled time; `best_algorithm` the cheaper algorithm for a
collective (the tensor-parallel pass picks it per collective: the tree for the small
tensors of a decode step, where latency rules; the ring for a long prefill chunk, where
bytes do). The order an algorithm adds in is `toptpu.backend.reference.kernels.all_reduce`.

The model is not cycle-accurate: it assumes a non-blocking switch (every port at full rate
at once) and no overlap of a step's latency with the previous step's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toptpu.backend.target.chips import Chip

#: how a collective moves its data
ALGORITHMS = ("ring", "tree")
#: the collectives the link model times
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "send")


class LinkError(ValueError):
    """A collective the link model cannot time as asked (a bug of the caller)."""


def tree_rounds(devices: int) -> int:
    """Steps of a recursive-doubling all-reduce: log2 N for a power of two, else the fold
    into the largest power of two P, its log2 P doublings and the copy back."""
    if devices <= 1:
        return 0
    p = devices.bit_length() - 1
    return p if devices == 1 << p else p + 2


@dataclass(frozen=True)
class LinkWork:
    """One collective: its kind, algorithm, the chips taking part and the bytes of the
    tensor each chip holds at the end (`nbytes`: the reduced tensor of an all-reduce, the
    gathered whole of an all-gather, the tensor a broadcast or send moves)."""

    kind: str
    algorithm: str
    devices: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise LinkError(f"unknown collective {self.kind!r} ({', '.join(COLLECTIVES)})")
        if self.algorithm not in ALGORITHMS:
            raise LinkError(f"unknown algorithm {self.algorithm!r} ({', '.join(ALGORITHMS)})")
        if self.devices < 1 or self.nbytes < 0:
            raise LinkError(f"{self.kind} over {self.devices} chips of {self.nbytes} bytes")

    def steps(self) -> list[int]:
        """The bytes each chip sends in each step (all chips of a step at once)."""
        n, b = self.devices, self.nbytes
        if n == 1:
            return []
        part = -(-b // n)
        if self.kind == "send":
            return [b]
        if self.kind == "broadcast":
            return [b] * (math.ceil(math.log2(n)) if self.algorithm == "tree" else n - 1)
        if self.kind == "all_reduce":
            return [part] * (2 * (n - 1)) if self.algorithm == "ring" \
                else [b] * tree_rounds(n)
        # all_gather
        if self.algorithm == "ring":
            return [part] * (n - 1)
        return [min(part << t, b) for t in range(math.ceil(math.log2(n)))]

    def link_bytes(self) -> int:
        """Bytes one chip sends over its link in the whole collective."""
        return sum(self.steps())

    def reduce_bytes(self) -> int:
        """DDR bytes one chip's adds move (all-reduce only: read two, write one)."""
        if self.kind != "all_reduce" or self.devices == 1:
            return 0
        n, b = self.devices, self.nbytes
        if self.algorithm == "ring":
            return 3 * (n - 1) * -(-b // n)
        adds = n.bit_length() - 1 + (n & (n - 1) != 0)  # the doublings (and the fold)
        return 3 * adds * b


def collective_seconds(chip: Chip, work: LinkWork) -> float:
    """The modelled time of one collective on `chip`'s link: every step's latency and bytes
    over the link, and an all-reduce's adds over the chip's DMA bandwidth."""
    per = 1.0 / (chip.link_gbps * 1e9)
    link = sum(chip.link_latency_us * 1e-6 + b * per for b in work.steps())
    return link + work.reduce_bytes() / (chip.dma_gbps * 1e9)


def best_algorithm(chip: Chip, kind: str, devices: int, nbytes: int) -> str:
    """The algorithm under which the collective takes the least time (the tree on a tie)."""
    return min(reversed(ALGORITHMS),
               key=lambda a: collective_seconds(chip, LinkWork(kind, a, devices, nbytes)))
