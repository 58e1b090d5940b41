"""What a command line's run reads and writes, kept safe for the time it runs.

`command_run()` is entered by `toptpu` (`toptpu.cli.run_command`) and `toptpu-opt` around
each command:

- its inputs are noted (`dialects.output_file.command_inputs`): no output of the command
  is written over a file it reads;
- standard output is checked (`checked_stdout`): a write that fails — a full disk,
  `/dev/full`, an I/O error — is one `StdoutError` naming it, not an `OSError`
  traceback, and what is left unwritten is dropped (no second error when Python flushes
  at exit). A reader that went away (a closed pipe) stays a `BrokenPipeError`, which the
  command lines end quietly.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from toptpu.dialects.output_file import command_inputs
from toptpu.errors import ToptpuError


class StdoutError(ToptpuError):
    """Standard output cannot be written (the message says why)."""


class _CheckedStdout:
    """A text stream writing to `inner` whose failed writes raise StdoutError; everything
    else is the inner stream's."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def _failed(self, e: OSError) -> StdoutError:
        return StdoutError(f"cannot write to standard output: {e.strerror or e}; the output "
                           "is incomplete: free space on its device or send it elsewhere")

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self._failed(e) from None

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def drop_stdout() -> None:
    """Point file descriptor 1 at /dev/null: what Python still holds for stdout goes
    nowhere at exit (after a closed pipe or a failed write, said once already)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@contextlib.contextmanager
def checked_stdout() -> Iterator[None]:
    """`sys.stdout` checked while the block runs (see the module doc); flushed at its end,
    inside the check. A StdoutError drops what stdout still buffers."""
    inner = sys.stdout
    if inner is None or isinstance(inner, _CheckedStdout):
        yield
        return
    sys.stdout = _CheckedStdout(inner)  # type: ignore[assignment]
    try:
        yield
        sys.stdout.flush()
    except StdoutError:
        drop_stdout()
        raise
    finally:
        sys.stdout = inner


@contextlib.contextmanager
def command_run() -> Iterator[None]:
    """A command's inputs noted and its stdout checked (see the module doc)."""
    with command_inputs(), checked_stdout():
        yield
