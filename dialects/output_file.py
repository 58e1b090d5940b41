"""Writing an output file: the one way every command writes what it makes.

`open_output(path)` decides by what `path` is (a symlink is resolved first and the rule
applied to its target, so a link stays a link and the file it names is what changes):

- a new path or an existing regular file: written to a temporary file next to it
  (`.NAME.tmp-PID`, created exclusively, never through a link planted there) and renamed
  over it in one step — a reader never sees half a file, a failure leaves none;
- an existing character or block device (`/dev/null`) or FIFO: opened and written through
  as it is, with no temporary file and no rename — the node stays what it is;
- anything else (a directory, a socket, a path in a missing directory, no permission):
  refused with `OutputPathError`, naming the path.

A full disk (ENOSPC, EDQUOT) or any other OS error while writing ends in one
`OutputPathError` naming the path and, for a full disk, how many bytes the file needed;
the temporary file is removed.

Never over an input: while a command runs (`command_inputs()`, entered by the command
lines), every file it reads is noted (`note_input`: the model file and its weight cache
file, a checkpoint's shards, a GGUF file, an IR file and the weight store it names, an
image, a text) by device and inode, and `open_output` refuses to write to a path that is
one of them — through a symlink or a hard link too — naming both: `toptpu cache M -o M`,
a `M.wcache` that links to M, `toptpu-opt X.mlir -o STORE` with the store X names. A
write that replaces its input on purpose (`toptpu-opt X.mlir -o X.mlir`: the input is
read whole first) names it in `replaces`.

It lives in `toptpu.dialects` (standard library only) because that is the package every
writer may import: the weight store, the model file format and the driver alike.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Literal

from toptpu.errors import ToptpuError

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: a temporary file of a write of `NAME` by process PID is `.NAME{TEMP_MARK}PID`
TEMP_MARK = ".tmp-"
_FULL = {errno.ENOSPC: "no space left on the device",
         getattr(errno, "EDQUOT", -1): "the disk quota is exceeded"}


class OutputPathError(ToptpuError):
    """An output path cannot be written as given; the message says why and what to do."""


Kind = Literal["new", "file", "through"]

#: the inputs of the commands running (innermost last): (device, inode) -> the path read
_INPUTS: list[dict[tuple[int, int], str]] = []


@contextlib.contextmanager
def command_inputs() -> Iterator[dict[tuple[int, int], str]]:
    """While the block runs, the files noted by `note_input` are inputs `open_output`
    never writes to (the command lines enter this around each command)."""
    inputs: dict[tuple[int, int], str] = {}
    _INPUTS.append(inputs)
    try:
        yield inputs
    finally:
        _INPUTS.remove(inputs)


def note_input(source: str | os.PathLike[str] | int, name: str | None = None) -> None:
    """Note a file the running command reads (a path, or an open file descriptor; `name`
    how messages call it, default the path): `open_output` will not write to it. Outside
    `command_inputs` (a library call) nothing is noted; a path that cannot be read is
    ignored (its reader reports it)."""
    if not _INPUTS:
        return
    try:
        st = os.fstat(source) if isinstance(source, int) else os.stat(source)
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(st.st_mode):  # a device (/dev/stdin) may be read and written
        return
    if name is None:
        name = f"fd {source}" if isinstance(source, int) else os.fspath(source)
        if isinstance(source, int):
            with contextlib.suppress(OSError):
                name = os.readlink(f"/proc/self/fd/{source}")
    _INPUTS[-1].setdefault((st.st_dev, st.st_ino), name)


def _input_at(real: str, replaces: tuple[str, ...]) -> str | None:
    """The noted input the existing file `real` is (None: not one, or one of `replaces`)."""
    if not _INPUTS:
        return None
    try:
        st = os.stat(real)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    for path in replaces:
        with contextlib.suppress(OSError):
            other = os.stat(path)
            if (other.st_dev, other.st_ino) == key:
                return None
    for inputs in reversed(_INPUTS):
        if key in inputs:
            return inputs[key]
    return None


def output_target(path: str, what: str = "output", seekable: bool = False,
                  replaces: tuple[str, ...] = ()) -> tuple[str, Kind]:
    """Where a write of `path` lands (symlinks resolved) and how: `new` or `file` (a
    temporary file renamed over it) or `through` (a device or FIFO, written as it is).
    OutputPathError for a path that cannot be written: empty, a directory, a socket,
    a missing or non-directory parent, a symlink loop, a FIFO when the writer seeks
    (`seekable`), and a file the running command reads (`note_input`; but those in
    `replaces`)."""
    if not path:
        raise OutputPathError(f"{what}: the path is empty; name the file to write")
    real = os.path.realpath(os.path.abspath(path))
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(real)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise OutputPathError(f"{what} '{path}': '{parent}' is a file, not a "
                                  "directory") from None
        if not os.path.isdir(parent):
            raise OutputPathError(f"{what} '{path}': the directory '{parent}' does not "
                                  "exist; create it first") from None
        return real, "new"
    except OSError as e:  # a symlink loop, a path through a file, no permission
        raise OutputPathError(f"{what} '{path}' cannot be written: "
                              f"{e.strerror or e}") from None
    if stat.S_ISREG(mode):
        source = _input_at(real, replaces)
        if source is not None:
            same = "" if os.path.abspath(path) == os.path.abspath(source) else \
                f" ('{source}')"
            raise OutputPathError(f"{what} '{path}' is a file this command reads{same}: "
                                  "writing it would destroy its input; name another path")
        return real, "file"
    if stat.S_ISFIFO(mode) and seekable:
        raise OutputPathError(f"{what} '{path}' is a FIFO, and this file is written with "
                              "seeks; name a regular file (or a device such as /dev/null)")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
        return real, "through"
    kind = "a directory" if stat.S_ISDIR(mode) else (
        "a socket" if stat.S_ISSOCK(mode) else "not a file, a device or a FIFO")
    raise OutputPathError(f"{what} '{path}' is {kind}; name the file to write")


def temp_path(path: str, pid: int | None = None) -> str:
    """The hidden temporary name a write of `path` by process `pid` goes through."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}{TEMP_MARK}{os.getpid() if pid is None else pid}")


def _pid_of_temp(name: str, base: str) -> int | None:
    """The PID in `name` if it is exactly a temporary name of target `base`."""
    prefix = f".{base}{TEMP_MARK}"
    digits = name[len(prefix):]
    if not name.startswith(prefix) or not digits.isascii() or not digits.isdigit():
        return None
    pid = int(digits)
    return pid if 0 < pid < 2**31 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_temp_files(path: str) -> list[str]:
    """Remove the temporary files of target `path` whose writer process no longer runs
    (left by a write killed before its rename). Only regular files named exactly
    `.NAME.tmp-PID` are touched; those of running processes are kept. Returns the paths
    removed."""
    directory, base = os.path.split(os.path.abspath(path))
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        pid = _pid_of_temp(entry.name, base)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    return removed


class _Raw(io.FileIO):
    """A file that remembers the furthest byte a write tried to reach (what a full disk
    reports as needed)."""

    attempted = 0

    def write(self, b: Buffer, /) -> int:
        n = memoryview(b).nbytes
        try:
            at = self.tell()
        except OSError:  # a FIFO: count what went through
            at = self.attempted
        self.attempted = max(self.attempted, at + n)
        return self._write_raw(b)

    def _write_raw(self, b: Buffer) -> int:
        """The system call (what a test makes fail)."""
        return super().write(b)


def _open_new(tmp: str) -> _Raw:
    """A new file at `tmp`, never through a symlink planted there: an earlier file of
    that name (a stale temporary file of an earlier process with this PID) is removed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    return _Raw(tmp, "xb", opener=lambda p, flags: os.open(p, flags | nofollow, 0o666))


def is_regular(f: IO[bytes] | IO[str]) -> bool:
    """Whether the open output `f` is a regular file (not a device or FIFO written
    through): only a regular file can be truncated or synced."""
    return stat.S_ISREG(os.fstat(f.fileno()).st_mode)


def _error(path: str, what: str, e: OSError, raw: _Raw | None, size: int | None
           ) -> OutputPathError:
    if e.errno in _FULL:
        written = 0
        if raw is not None and not raw.closed:
            with contextlib.suppress(OSError):
                written = os.fstat(raw.fileno()).st_size
        need = size if size is not None else (raw.attempted if raw is not None else 0)
        needed = (f"it needs {need} bytes" if size is not None else
                  f"it needs at least {need} bytes")
        return OutputPathError(
            f"{what} '{path}': {_FULL[e.errno]} after {written} bytes ({needed}); nothing "
            f"was written: free space on '{os.path.dirname(os.path.abspath(path))}' or "
            "write elsewhere")
    return OutputPathError(f"{what} '{path}' cannot be written: {e.strerror or e}")


@contextlib.contextmanager
def open_output(path: str, what: str = "output", *, seekable: bool = False,
                size: int | None = None, replaces: tuple[str, ...] = ()
                ) -> Iterator[IO[bytes]]:
    """A binary file to write `path` through, by the rules of the module doc. `seekable`:
    the writer seeks (a FIFO is then refused, as is a device that cannot seek). `size`,
    when known, is what a full disk reports as needed. `replaces`: inputs this write may
    replace (read whole before). On leaving the block the file is flushed, synced and (a
    regular file) renamed into place; on an exception the temporary file is removed and
    `path` is as it was."""
    real, kind = output_target(path, what, seekable, replaces)
    tmp = temp_path(real) if kind != "through" else None
    raw: _Raw | None = None
    f: io.BufferedWriter | None = None
    done = False
    try:
        try:
            if tmp is not None:
                remove_stale_temp_files(real)
                raw = _open_new(tmp)
                if kind == "file":  # the replaced file's permissions carry over
                    os.chmod(raw.fileno(), stat.S_IMODE(os.stat(real).st_mode))
            else:
                raw = _Raw(real, "wb")
                if seekable and not raw.seekable():
                    raise OutputPathError(f"{what} '{path}' is a device that cannot seek, "
                                          "and this file is written with seeks; name a "
                                          "regular file")
            f = io.BufferedWriter(raw)
            yield f
            f.flush()
            if tmp is not None:
                os.fsync(raw.fileno())
            f.close()
            if tmp is not None:
                os.replace(tmp, real)
            done = True
        except OSError as e:
            raise _error(path, what, e, raw, size) from None
    finally:
        if f is not None and not f.closed:  # a failed write: what is buffered goes too
            with contextlib.suppress(Exception):
                f.close()
        if raw is not None and not raw.closed:
            with contextlib.suppress(OSError):
                raw.close()
        if tmp is not None and not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_output(path: str, data: bytes | str, what: str = "output",
                 replaces: tuple[str, ...] = ()) -> None:
    """Write `data` (text as UTF-8) to `path` by `open_output`."""
    payload = data.encode() if isinstance(data, str) else data
    with open_output(path, what, size=len(payload), replaces=replaces) as f:
        f.write(payload)


@contextlib.contextmanager
def open_text_output(path: str, what: str = "output", newline: str | None = None
                     ) -> Iterator[IO[str]]:
    """`open_output` as UTF-8 text."""
    with open_output(path, what) as f:
        t = io.TextIOWrapper(f, encoding="utf-8", newline=newline)
        yield t
        t.flush()
        t.detach()
