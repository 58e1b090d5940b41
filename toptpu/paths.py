"""Checks of the paths a command writes, made before any work starts.

Every output a command takes (`compile -o` and `--dump-ir`, `profile --trace` and `--png`,
`compare --dump`) is checked here first, so a mistake costs a one-line error instead of a
traceback after minutes of compiling. Nothing is written into the input: an output path
inside the input model directory (at any depth, symlinks resolved) is refused — writing
there could overwrite the checkpoint, and a new `*.safetensors` file would change what
the directory loads as next time.

Light on purpose (standard library only): `toptpu profile` uses it without the compiler.
Writing is `toptpu.dialects.output_file`'s (`open_output`, re-exported here): the one
policy every output follows (a temporary file renamed over a regular file; a device or
FIFO written through as it is), in the lowest package every writer may import.
"""

from __future__ import annotations

import os

from toptpu.dialects.output_file import OutputPathError as OutputPathError
from toptpu.dialects.output_file import open_output as open_output
from toptpu.dialects.output_file import open_text_output as open_text_output
from toptpu.dialects.output_file import output_target
from toptpu.dialects.output_file import write_output as write_output


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def is_inside(path: str, directory: str) -> bool:
    """True if `path` is `directory` or lies below it (both resolved through symlinks)."""
    p, d = _real(path), _real(directory)
    try:
        return os.path.commonpath([p, d]) == d
    except ValueError:  # different drives
        return False


def _writable_dir(directory: str, what: str, path: str) -> None:
    if not os.path.exists(directory):
        raise OutputPathError(f"{what} '{path}': the directory '{directory}' does not exist; "
                              "create it first")
    if not os.path.isdir(directory):
        raise OutputPathError(f"{what} '{path}': '{directory}' is a file, not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} '{path}': no permission to write in '{directory}'")


def check_output_file(path: str, what: str, example: str = "out.toptpu",
                      seekable: bool = False) -> None:
    """`path` can be written as a file (`open_output`'s rules, symlinks resolved): a new
    path or a regular file in an existing writable directory, or a device or FIFO (written
    through as it is; not a FIFO when the file is written with seeks, `seekable`); never a
    directory or a socket."""
    if not path:
        raise OutputPathError(f"{what}: the path is empty; name the file to write")
    if path.endswith((os.sep, os.altsep or os.sep)) or os.path.isdir(path):
        raise OutputPathError(f"{what} '{path}' is a directory; name the file to write, e.g. "
                              f"'{os.path.join(path, example)}'")
    real, kind = output_target(path, what, seekable)
    if kind != "through":
        _writable_dir(os.path.dirname(real), what, path)


def check_output_dir(path: str, what: str) -> None:
    """`path` can be used as an output directory: an existing writable directory, or a
    path whose nearest existing ancestor is a writable directory (it is created later)."""
    if not path:
        raise OutputPathError(f"{what}: the path is empty; name the directory to write")
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputPathError(f"{what} '{path}' exists and is not a directory; name a "
                              "directory (it is created if missing)")
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        parent = os.path.dirname(ancestor)
        if parent == ancestor:
            break
        ancestor = parent
    _writable_dir(ancestor, what, path)


def check_not_inside(path: str, directory: str, what: str) -> None:
    """Refuse an output `path` inside the input model `directory`."""
    if is_inside(path, directory):
        raise OutputPathError(
            f"{what} '{path}' is inside the input model directory '{directory}'; toptpu never "
            "writes into its input: write it elsewhere")
