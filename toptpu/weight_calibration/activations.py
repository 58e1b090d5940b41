"""The calibration set's hidden states between two layers, kept on disk.

`Activations` holds ``[sequences, length, hidden]`` float32 (the layer inputs, then, written
over batch by batch, the layer outputs: a sequence's output depends on that sequence alone)
in an anonymous scratch file: created already unlinked in the directory asked for (the
calibrated checkpoint's), so nothing is left behind however the process ends. Batches are
read and written with `os.preadv` / `os.pwrite`: the file's pages live in the page cache,
not in the process, so the calibration's memory does not grow with the number of
calibration tokens (at Qwen2.5-7B's hidden size and the default 128 x 512 tokens the file
holds 0.94 GB).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Self

import numpy as np
import torch

from toptpu.weight_calibration.grid import CalibrationError


class ScratchFile:
    """An anonymous scratch file in `directory` (module doc) read and written by offset:
    what `Activations` and `Spill` share."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        try:
            self.file = tempfile.TemporaryFile(dir=directory, prefix=".calibration-")
        except OSError as e:
            raise CalibrationError(f"cannot create the calibration's scratch file in "
                                   f"'{directory}': {e.strerror or e}") from None
        self.fd = self.file.fileno()

    def _write(self, view: memoryview, offset: int, what: str) -> None:
        """`view`'s bytes at `offset`; a failure is one line naming `what` was written."""
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as e:
            raise CalibrationError(
                f"cannot write {what} to a scratch file in '{self.directory}': "
                f"{e.strerror or e}; free space there or calibrate on fewer tokens") from None

    def _read(self, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """A float32 tensor of `shape` read from `offset`."""
        out = np.empty(shape, np.float32)
        view = out.data.cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise CalibrationError("the calibration's scratch file ended early (was it "
                                       "truncated?)")
            done += got
        return torch.from_numpy(out)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Activations(ScratchFile):
    """``[n, length, hidden]`` float32 hidden states in a scratch file (module doc)."""

    def __init__(self, n: int, length: int, hidden: int, directory: str) -> None:
        super().__init__(directory)
        self.shape = (n, length, hidden)
        self.row_bytes = length * hidden * 4

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def _rows(self, rows: slice) -> tuple[int, int]:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1 or stop <= start:
            raise ValueError(f"rows {rows}: a non-empty run of sequences")
        return start, stop

    def read(self, rows: slice) -> torch.Tensor:
        """The hidden states of the sequences `rows` (a contiguous run)."""
        start, stop = self._rows(rows)
        return self._read((stop - start, *self.shape[1:]), start * self.row_bytes)

    def take(self, index: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The hidden states of the sequences `index` (any order), stacked."""
        return torch.cat([self.read(slice(int(i), int(i) + 1)) for i in index])

    def write(self, rows: slice, x: torch.Tensor) -> None:
        """Write `x` [len(rows), length, hidden] as the hidden states of `rows`."""
        start, stop = self._rows(rows)
        data = np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)
        if data.shape != (stop - start, *self.shape[1:]):
            raise ValueError(f"hidden states of shape {list(data.shape)} for rows "
                             f"{start}:{stop} of {list(self.shape)}")
        self._write(data.data.cast("B"), start * self.row_bytes,
                    f"the calibration's hidden states ({self.nbytes / 1e9:.2f} GB in all)")


class Spill(ScratchFile):
    """Float32 tensors ``[rows, width]`` appended to a scratch file (anonymous, as
    `Activations`': in `directory`, or the system's temporary directory for None) and read
    back by their index: what a pass over the calibration set made, read by later passes
    without holding it in the process."""

    def __init__(self, width: int, directory: str | None) -> None:
        super().__init__(directory or tempfile.gettempdir())
        self.width = width
        self.parts: list[tuple[int, int]] = []  # (offset, rows) of each tensor
        self.end = 0

    def __len__(self) -> int:
        return len(self.parts)

    def append(self, x: torch.Tensor) -> None:
        data = np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)
        if data.ndim != 2 or data.shape[1] != self.width:
            raise ValueError(f"a spilled tensor of shape {list(data.shape)}: [rows, "
                             f"{self.width}]")
        view = data.data.cast("B")
        self._write(view, self.end, f"{self.end + len(view)} bytes of calibration inputs")
        self.parts.append((self.end, data.shape[0]))
        self.end += len(view)

    def read(self, i: int) -> torch.Tensor:
        offset, rows = self.parts[i]
        return self._read((rows, self.width), offset)


class InMemory:
    """Hidden states held in a tensor ``[n, length, hidden]``, with `Activations`' reads and
    writes (small sets, and tests that hand a layer its inputs)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.shape = tuple(x.shape)

    def read(self, rows: slice) -> torch.Tensor:
        return self.x[rows]

    def take(self, index: Sequence[int] | np.ndarray) -> torch.Tensor:
        return self.x[torch.as_tensor(np.asarray(index, dtype=np.int64))]

    def write(self, rows: slice, x: torch.Tensor) -> None:
        self.x[rows] = x


#: the hidden states a layer is calibrated on: in a scratch file or in memory
LayerInputs = Activations | InMemory


def layer_inputs(x: torch.Tensor | LayerInputs) -> LayerInputs:
    """`x` as `LayerInputs` (a tensor held in memory as it is)."""
    return InMemory(x) if isinstance(x, torch.Tensor) else x
