"""What a command line's run reads and writes, kept safe for the time it runs.

`command_run()` is entered by `toptpu` (`toptpu.cli.run_command`) and `toptpu-opt` around
each command:

- its inputs are noted (`dialects.output_file.command_inputs`): no output of the command
  is written over a file it reads;
- the files it maps (a model file, a weight cache file) are guarded by read leases
  (`backend.formats.file_lease`): another process truncating one ends the command in one
  line instead of a SIGBUS;
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

from toptpu.backend.formats.file_lease import guard_mapped_files
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
    sys.stdout = _CheckedStdout(inner)
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
    """A command's inputs noted, the files it maps guarded, its stdout checked (see the
    module doc)."""
    with command_inputs(), guard_mapped_files(), checked_stdout():
        yield


# --------------------------------------------------------------------------- bounded input

#: a message's characters per token at most, times the longest token of the vocabulary:
#: a normalizer may compose characters (NFC: three Hangul jamo into one syllable), so a
#: token can stand for more text than its own length
CHARS_PER_TOKEN_MARGIN = 4


class LineTooLong(ValueError):
    """An input line longer than the reader takes; what was read of it is dropped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the line is longer than {limit} characters")
        self.limit = limit


def message_limit(vocabulary: Any, seq_length: int) -> int:
    """The most characters a message that fits `seq_length` tokens can have, for a
    vocabulary (token text -> id; its longest token): anything longer cannot fit the KV
    cache, so it is refused before it is tokenized (tokenizing takes ~200 bytes of memory
    per character)."""
    longest = max((len(t) for t in vocabulary), default=1)
    return max(1, seq_length) * max(1, longest) * CHARS_PER_TOKEN_MARGIN


def read_line(prompt: str, limit: int, stream: TextIO | None = None) -> str:
    """`input(prompt)` that never holds more than `limit` characters of a line: a longer
    line is read to its end and dropped (LineTooLong). A file or pipe is read so; a
    terminal (line editing; the terminal bounds its lines) or a stdin that is no file
    goes through `input()`. EOFError at the end of the input."""
    stream = sys.stdin if stream is None else stream
    if stream is sys.stdin and not _is_file(stream):
        line = input(prompt)
        if len(line) > limit:
            raise LineTooLong(limit)
        return line
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = stream.readline(limit + 1)
    if not line:
        raise EOFError
    if len(line) <= limit or (line.endswith("\n") and len(line) == limit + 1):
        return line.removesuffix("\n")
    while line and not line.endswith("\n"):  # the rest of the line, in bounded pieces
        line = stream.readline(1 << 16)
    raise LineTooLong(limit)


def _is_file(stream: Any) -> bool:
    """Whether `stream` reads a file or a pipe (not a terminal, not a stand-in object)."""
    try:
        return stream.fileno() >= 0 and not stream.isatty()
    except (OSError, ValueError, AttributeError):
        return False
