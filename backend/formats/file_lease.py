"""Mapped files guarded against being truncated or written while in use (Linux leases).

A model file and its weight cache file are memory mapped: their pages are read where
they lie. If another process truncates such a file (or writes it in place) while a command
reads it, the next read of a page past the new end faults with SIGBUS, which Python cannot
turn into an exception: the process dies (exit status 135) in the middle of a numpy
operation. Checking the file's size before each use narrows that window but cannot close
it: the truncation mostly lands during a net run.

A read lease closes it. While a command line runs (`guard_mapped_files()`, entered by the
command lines around each command), every model-file container opened takes a read lease
on its file (`hold_read_lease`). A process that then opens the file for writing or
truncates it is held back by the kernel (for up to `/proc/sys/fs/lease-break-time`, 45 s
by default; one opening it without blocking gets EAGAIN) and this process is told first,
by SIGIO: the handler raises `FileInUseChanged` (an `AbortError`: a KeyboardInterrupt, so
no `except Exception` on the way swallows it) naming the file, the command ends in one
line, and once it has exited (its mapping gone) the writer goes on. A file replaced at its
path (a new compile renamed over it) opens no file for writing and breaks no lease: the
mapping keeps the old file, as before.

Where a lease cannot be taken (another process has the file open for writing, a file
system without leases, a file of another owner without CAP_LEASE, outside the main
thread, outside `guard_mapped_files`) nothing changes: the executors' check before each
net run (`ModelFile.check_unchanged`) is what remains.
"""

from __future__ import annotations

import contextlib
import fcntl
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from toptpu.errors import AbortError

#: Linux's lease commands (Linux's numbers where the `fcntl` module lacks them)
F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)

#: the leased files: file descriptor -> the path read
_LEASED: dict[int, str] = {}
#: whether `guard_mapped_files` is active (and the SIGIO handler it installed)
_GUARD: list[Any] = []


class FileInUseChanged(AbortError):
    """Another process opened a mapped input for writing (or truncated it) while the command
    used it."""


def _on_sigio(signum: int, frame: FrameType | None) -> None:
    for fd, path in list(_LEASED.items()):
        try:
            lease = fcntl.fcntl(fd, F_GETLEASE)
        except OSError:
            continue
        if lease != fcntl.F_RDLCK:  # a break is pending: someone writes or truncates it
            raise FileInUseChanged(
                f"'{path}' is being written or truncated by another process while this "
                "command reads it (memory mapped); stopped before reading changed bytes "
                "(the other process goes on once this one has exited): run again when the "
                "file is complete")
    previous = _GUARD[-1] if _GUARD else None
    if callable(previous):
        previous(signum, frame)


@contextlib.contextmanager
def guard_mapped_files() -> Iterator[None]:
    """While the block runs (in the main thread), model-file containers opened take read
    leases and a lease break ends the command (see the module doc); on leaving, every
    lease still held is released and SIGIO's handler restored. Outside the main thread, a
    no-op."""
    if threading.current_thread() is not threading.main_thread() or _GUARD \
            or not hasattr(signal, "SIGIO"):
        yield
        return
    previous = signal.signal(signal.SIGIO, _on_sigio)
    _GUARD.append(previous)
    try:
        yield
    finally:
        for fd in list(_LEASED):
            release_read_lease(fd)
        _GUARD.clear()
        signal.signal(signal.SIGIO, previous)


def hold_read_lease(fd: int, path: str) -> bool:
    """Take a read lease on the open (read-only) file `fd` inside `guard_mapped_files`;
    whether one is held (False where it cannot be: see the module doc)."""
    if not _GUARD:
        return False
    try:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN (open for writing elsewhere), EINVAL, EACCES: no lease
        return False
    _LEASED[fd] = path
    return True


def release_read_lease(fd: int) -> None:
    """Give up the lease on `fd` (before closing it: a mapping of the file would keep the
    lease alive, and a later writer would wait out the lease-break time)."""
    if _LEASED.pop(fd, None) is None:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
