"""Weights streamed from the mapped model file: every executor's one mechanism.

A model file's weight blob (one device's section `weights`, or every device's `weights:<d>`
of a multi-device file) is memory mapped, and a net run reads its weights straight from the
mapping. Left alone, every page a run touched stays in the process's resident set, so a
run of the whole model holds the whole blob. When the weights are streamed (`WeightPages`
enabled: by default where the blobs the process maps are larger than
`model_file.STREAM_ABOVE`; `TOPTPU_STREAM_WEIGHTS=auto|on|off` overrides), after each net
run the pages of the weights it read are released (`ModelFile.release`, madvise
`MADV_DONTNEED`: they leave the resident set and stay in the page cache; the next run of
that layer maps them again, the same bytes), so the process holds one run's weights at a
time: one layer's chunk (on each device that runs it), not the model; checking the file's
checksums when it is opened releases each window it hashed the same way
(`model_file.streams_weights`, where the setting is read). The converted-weight
cache of a streaming executor is capped as well (`weight_cache.default_budget(True)`,
`STREAMING_CAP` in all: a device group splits it over its devices), and what it does not
keep is multiplied from the mapped bytes (`weight_cache.WeightCache`).

The machine executor, the device-group executor and the interpreter executor each hold one
`WeightPages` and hand it, after every run, the file extents of the weights that run read:
what is released and how much (`released_bytes`) is counted here, once.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Hashable, Iterable

from toptpu.backend.formats.model_file import ModelFile, streams_weights
from toptpu.backend.runtime.weight_cache import default_budget

__all__ = ["Extents", "WeightPages", "spans", "streams_weights"]

#: (file offset, bytes) of each weight a run read
Extents = Iterable[tuple[int, int]]


def spans(extents: Extents) -> tuple[tuple[int, int], ...]:
    """The file spans (offset, bytes) covering `extents`: extents less than a page apart
    joined (the pages between hold nothing else a run keeps), others apart."""
    out: list[list[int]] = []
    for start, nbytes in sorted(e for e in extents if e[1] > 0):
        if out and start <= out[-1][1] + mmap.PAGESIZE:
            out[-1][1] = max(out[-1][1], start + nbytes)
        else:
            out.append([start, start + nbytes])
    return tuple((a, b - a) for a, b in out)


class WeightPages:
    """The mapped pages of the weights each run reads, released after the run when the
    weights are streamed (see the module doc)."""

    def __init__(self, file: ModelFile, blob_bytes: int, stream: bool | None = None) -> None:
        self.file = file
        #: whether pages are released after each run
        self.enabled = streams_weights(blob_bytes) if stream is None else stream
        #: the bytes of mapped weight pages released so far
        self.released_bytes = 0
        self._spans: dict[Hashable, tuple[tuple[int, int], ...]] = {}

    def cache_budget(self, given: int | None) -> int:
        """The converted-weight budget: `given`, else the default (capped when streaming)."""
        return default_budget(self.enabled) if given is None else given

    def release(self, run: Hashable, extents: Callable[[], Extents]) -> None:
        """After a run: when streaming, release the pages of the weights it read. `run`
        names what the run read (net, device, layer: the same for every run of it), and
        `extents` gives the file extents of its weights (asked once per `run`)."""
        if not self.enabled:
            return
        where = self._spans.get(run)
        if where is None:
            where = self._spans[run] = spans(extents())
        for offset, nbytes in where:
            self.released_bytes += self.file.release(offset, nbytes)


class StreamedWeights:
    """An executor whose mapped weight pages a `WeightPages` (`pages`) releases after each
    run: what it tells of that."""

    pages: WeightPages

    @property
    def stream_weights(self) -> bool:
        """Whether each run's weight pages are released after it (`weight_pages`)."""
        return self.pages.enabled

    @property
    def released_bytes(self) -> int:
        """The bytes of mapped weight pages released after runs so far."""
        return self.pages.released_bytes
