"""Where `toptpu demo` keeps what it makes, and the commands it prints to go on with.

The demo writes into one directory it names (`--dir`, default `./toptpu-demo`): the tiny
model's Hugging Face directory and model files, or SmolLM2's model files and the text its
quality is measured on. Running the demo again replaces its own files there and nothing
else: a path the demo would write that holds something else (a directory with other
files, a link, a file where a directory goes) is refused before any work, naming it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from toptpu.errors import ToptpuError
from toptpu.paths import check_output_dir, check_output_file

#: the directory the demo writes when --dir is not given (relative to the working directory)
DEFAULT_DEMO_DIR = "toptpu-demo"


class DemoDirError(ToptpuError):
    """The demo's directory cannot hold what the demo makes (the message says why)."""


def check_demo_dir(directory: str, files: Sequence[str], model_dirs: Sequence[str] = ()
                   ) -> None:
    """`directory` can hold the demo's `files` (replaced if they exist) and `model_dirs`
    (each a directory of a previous demo run, or new): checked before any work."""
    check_output_dir(directory, "--dir")
    if not os.path.isdir(directory):
        return  # made by the demo: nothing in it yet
    for name in files:
        check_output_file(os.path.join(directory, name), "--dir")
    for name in model_dirs:
        path = os.path.join(directory, name)
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            raise DemoDirError(f"--dir '{directory}': '{path}' exists and is not a directory "
                               "of the demo; remove it or name another --dir")


@contextmanager
def replaced_model_dir(directory: str, name: str) -> Iterator[str]:
    """A fresh temporary directory inside `directory` to save a model directory into; when
    the block ends without an error it replaces `directory/name` (a previous demo's: the
    same file names, no others), else it is removed. DemoDirError when `directory/name`
    holds a file the demo does not write (it is left as it is)."""
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # as os.makedirs would make it, not mkdtemp's 0700
    try:
        yield tmp
        final = os.path.join(directory, name)
        if os.path.lexists(final):
            theirs = set(os.listdir(final)) - set(os.listdir(tmp)) \
                if os.path.isdir(final) and not os.path.islink(final) else {name}
            if theirs:
                raise DemoDirError(f"'{final}' holds {', '.join(sorted(theirs)[:3])}, which the "
                                   "demo does not write: it is left as it is; name another "
                                   "--dir")
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def next_commands(lines: Sequence[tuple[str, Sequence[str]]]) -> str:
    """The 'go on with' block: each (what it does, the command's words), quoted for a
    POSIX shell."""
    out = ["next, on what the demo kept:"]
    for what, cmd in lines:
        out += [f"  # {what}", f"  {shlex.join(cmd)}"]
    return "\n".join(out)
