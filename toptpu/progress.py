"""The live progress line of the long commands (compile's weights, cache, eval, compare,
profile): `tqdm` on stderr, shown only on a terminal and never under `--quiet`.

A progress line is for a person watching: a log, a pipe or a test reads stderr without it
(those commands' own one-line-per-step reports stay as they are, see each command). The
bar counts what the command knows the total of (layers written, weights converted,
tokens scored, stages run, nets profiled) and tqdm adds the elapsed and remaining time.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from tqdm import tqdm


def progress_shown(quiet: bool = False, stream: IO[str] | None = None) -> bool:
    """Whether a progress line is drawn: not `quiet` and `stream` (stderr) a terminal."""
    stream = sys.stderr if stream is None else stream
    if quiet or stream is None:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def progress_bar(total: int | None, desc: str, *, quiet: bool = False, unit: str = "it",
                 stream: IO[str] | None = None, shown: bool | None = None,
                 bar_format: str | None = None) -> Any:
    """A tqdm bar of `total` `unit`s labelled `desc` on `stream` (stderr), drawn only when
    `progress_shown(quiet, stream)` (or `shown`, when given); a disabled bar otherwise,
    whose calls do nothing. The bar is removed from the screen when closed (`leave=False`):
    what the command prints afterwards stands alone."""
    stream = sys.stderr if stream is None else stream
    draw = progress_shown(quiet, stream) if shown is None else shown
    # the terminal's size when it has one; a terminal that says 0 columns or rows (a pty
    # nobody sized: `script`, some CI) gets 100 x 24, where tqdm would draw nothing
    columns, rows = _terminal_size(stream)
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not draw,
                leave=False, ncols=columns, nrows=rows, dynamic_ncols=False,
                mininterval=0.2, bar_format=bar_format)


def _terminal_size(stream: IO[str]) -> tuple[int, int]:
    """(columns, rows) of the terminal `stream` writes to: its own size, else $COLUMNS,
    else 100 columns; 24 rows unless it says more."""
    try:
        size = os.get_terminal_size(stream.fileno())
        columns, rows = size.columns, size.lines
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        columns, rows = 0, 0
    if columns <= 0 and os.environ.get("COLUMNS", "").isdigit():
        columns = int(os.environ["COLUMNS"])
    return (columns if columns > 0 else 100), (rows if rows > 0 else 24)


@contextmanager
def elapsed_line(desc: str, *, quiet: bool = False, stream: IO[str] | None = None,
                 shown: bool | None = None, every: float = 0.5) -> Iterator[None]:
    """For a step whose size is not known beforehand (loading a model): `desc` and the
    time spent so far, redrawn every `every` seconds while the block runs (a daemon
    thread), on the terms of `progress_bar`; removed when the block ends."""
    bar = progress_bar(None, desc, quiet=quiet, stream=stream, shown=shown,
                       bar_format="{desc} [{elapsed}]")
    if bar.disable:
        yield
        return
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(every):
            bar.refresh()

    ticker = threading.Thread(target=redraw, name="toptpu-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
