"""Every output goes through one helper (`toptpu.dialects.output_file.open_output`), issue 24
points 1 and 10: a regular file (or a new path) is replaced by a temporary file renamed over
it; a device or FIFO is written through as it is (never replaced by a file); a directory or
a socket is refused; a full disk is one line naming the path and the bytes needed, with no
temporary file left. Also: `toptpu sweep -o` inside a config directory is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled, tiny_dir
from test_cli_errors import SEQ64, assert_one_error, tree

from toptpu.cli import main
from toptpu.dialects import output_file
from toptpu.dialects.output_file import OutputPathError, open_output, write_output
from toptpu.opt import main as opt_main
from toptpu.paths import OutputPathError as PathsOutputPathError

HERE = os.path.dirname(os.path.abspath(__file__))
IR = os.path.join(HERE, "filecheck", "convert_top_to_tpu.mlir")
WEIGHTS = os.path.join(HERE, "filecheck", "Inputs", "weights.safetensors")
DEV_NULL = os.stat(os.devnull)


# --------------------------------------------------------------------------- helpers


def make_chardev(path: str) -> None:
    """A character device with /dev/null's numbers; the test is skipped where not
    permitted."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node is not permitted here")


def is_chardev(path: str) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


def is_fifo(path: str) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def no_temp_files(directory: str) -> bool:
    return not [n for n in os.listdir(directory) if output_file.TEMP_MARK in n]


def assert_dev_null_untouched() -> None:
    st_ = os.stat(os.devnull)
    assert stat.S_ISCHR(st_.st_mode) and st_.st_rdev == DEV_NULL.st_rdev
    assert st_.st_ino == DEV_NULL.st_ino


@contextlib.contextmanager
def draining(fifo: str) -> Iterator[list[bytes]]:
    """A reader thread that reads `fifo` to its end; what it read is in the list."""
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        yield got
    finally:
        if t.is_alive() and not got:  # the writer never opened it: let the reader go
            with contextlib.suppress(OSError):
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
        t.join(10)
        assert not t.is_alive()


@pytest.fixture(scope="module")
def ir_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("ir") / "in.mlir"
    with open(IR) as f:
        path.write_text(f.read().replace("@WEIGHTS@", WEIGHTS))
    return str(path)


def full_disk(after: int = 0, code: int = errno.ENOSPC) -> Any:
    """The helper's system call `write`, which succeeds `after` times and then fails
    with `code` (ENOSPC: the disk is full)."""
    real = output_file._Raw._write_raw
    calls = [0]

    def write(self: Any, b: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(code, os.strerror(code))
        return real(self, b)

    return write


# --------------------------------------------------------------------------- the helper


def test_one_error_class() -> None:
    assert PathsOutputPathError is OutputPathError


def test_a_regular_file_is_replaced_and_keeps_its_mode(tmp_path: Any) -> None:
    p = tmp_path / "out.bin"
    p.write_bytes(b"old contents, longer than the new")
    os.chmod(p, 0o640)
    ino = os.stat(p).st_ino
    write_output(str(p), b"new")
    assert p.read_bytes() == b"new" and stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert os.stat(p).st_ino != ino  # renamed over, not rewritten in place
    assert no_temp_files(str(tmp_path))


def test_a_char_device_is_written_through(tmp_path: Any) -> None:
    dev = str(tmp_path / "null")
    make_chardev(dev)
    write_output(dev, b"x" * 100_000)
    with open_output(dev, seekable=True) as f:  # /dev/null seeks
        f.seek(10)
        f.write(b"y")
    assert is_chardev(dev) and no_temp_files(str(tmp_path))
    assert_dev_null_untouched()


def test_a_fifo_is_written_through_or_refused_when_the_writer_seeks(tmp_path: Any) -> None:
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    data = os.urandom(300_000)  # more than a pipe holds: the reader drains it meanwhile
    with draining(fifo) as got:
        write_output(fifo, data)
    assert got == [data] and is_fifo(fifo)
    with pytest.raises(OutputPathError, match=f"'{fifo}' is a FIFO, and this file is "
                       "written with seeks"):
        with open_output(fifo, seekable=True):
            raise AssertionError("opened")
    assert is_fifo(fifo) and no_temp_files(str(tmp_path))


def test_a_symlink_is_resolved_and_stays_a_link(tmp_path: Any) -> None:
    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_bytes(b"old")
    os.symlink(target, link)
    write_output(str(link), b"new")
    assert os.path.islink(link) and target.read_bytes() == b"new"
    dev, devlink = str(tmp_path / "null"), str(tmp_path / "devlink")
    make_chardev(dev)
    os.symlink(dev, devlink)
    write_output(devlink, b"data")
    assert os.path.islink(devlink) and is_chardev(dev) and no_temp_files(str(tmp_path))


def test_directories_and_sockets_are_refused(tmp_path: Any) -> None:
    sock_path = str(tmp_path / "s")
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock_path)
    try:
        for path, what in ((str(tmp_path), "is a directory"), (sock_path, "is a socket"),
                           (str(tmp_path / "nope" / "f"), "does not exist; create it")):
            with pytest.raises(OutputPathError, match=f"'{path}' .*{what}|'{path}': .*{what}"):
                write_output(path, b"x")
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    finally:
        s.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_path_and_the_bytes_and_leaves_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    p = tmp_path / "out.bin"
    p.write_bytes(b"old")
    monkeypatch.setattr(output_file._Raw, "_write_raw", full_disk(after=1, code=code))
    data = b"z" * 20_000
    with pytest.raises(OutputPathError) as e:
        with open_output(str(p), "the thing", size=len(data)) as f:
            for i in range(0, len(data), 5000):
                f.write(data[i:i + 5000])
                f.flush()
    msg = str(e.value)
    assert "\n" not in msg and f"the thing '{p}'" in msg and "after 5000 bytes" in msg
    assert f"it needs {len(data)} bytes" in msg and f"free space on '{tmp_path}'" in msg
    assert ("no space left" if code == errno.ENOSPC else "quota") in msg
    assert p.read_bytes() == b"old" and no_temp_files(str(tmp_path))
    monkeypatch.setattr(output_file._Raw, "_write_raw", full_disk(after=0, code=code))
    with pytest.raises(OutputPathError, match="after 0 bytes \\(it needs 9 bytes\\)"):
        write_output(str(p), b"123456789")
    with pytest.raises(OutputPathError, match="it needs at least 9001 bytes"):  # no size
        with open_output(str(p)) as f:
            f.write(b"a" * 9000 + b"b")
    assert p.read_bytes() == b"old" and no_temp_files(str(tmp_path))


# --------------------------------------------------------------------------- commands


def test_toptpu_opt_writes_through_a_device_and_a_fifo(tmp_path: Any, ir_file: str,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    dev, fifo = str(tmp_path / "null"), str(tmp_path / "pipe")
    make_chardev(dev)
    os.mkfifo(fifo)
    assert opt_main([ir_file, "-o", dev]) == 0
    with draining(fifo) as got:
        assert opt_main([ir_file, "-o", fifo]) == 0
    assert got and b"top.weight" in got[0]
    out = str(tmp_path / "out.mlir")
    assert opt_main([ir_file, "-p", "convert-top-to-tpu{mode=bf16}", "--weights-out", dev,
                     "-o", out]) == 0
    assert opt_main([ir_file, "-p", "convert-top-to-tpu{mode=bf16}", "--weights-out", dev,
                     "-o", dev]) == 0  # a device takes both
    # derived weights next to a device would land in its directory: asked for instead
    assert opt_main([ir_file, "-p", "convert-top-to-tpu{mode=bf16}", "-o", dev]) == 1
    err = capsys.readouterr().err
    assert f"-o {dev} is a device or FIFO" in err and "give --weights-out" in err
    assert is_chardev(dev) and is_fifo(fifo) and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["null", "out.mlir", "pipe"]
    assert_dev_null_untouched()


def test_toptpu_opt_full_disk_is_one_line(tmp_path: Any, ir_file: str,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.mlir"
    out.write_text("old")
    monkeypatch.setattr(output_file._Raw, "_write_raw", full_disk())
    assert opt_main([ir_file, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"toptpu-opt: -o '{out}': no space left on the device after 0 "
                          "bytes (it needs ") and "\n" not in err, err
    assert out.read_text() == "old" and no_temp_files(str(tmp_path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_dir(tmp_path_factory, "qwen2")


@pytest.mark.slow
def test_compile_writes_through_a_device_and_refuses_a_fifo(
        tmp_path: Any, model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    dev, fifo = str(tmp_path / "null"), str(tmp_path / "pipe")
    make_chardev(dev)
    os.mkfifo(fifo)
    assert main(["compile", model_dir, "-o", dev, "--seq-length", "32", "--quiet"]) == 0
    assert main(["compile", model_dir, "-o", os.devnull, "--seq-length", "32",
                 "--quiet"]) == 0
    code = main(["compile", model_dir, "-o", fifo, "--seq-length", "32", "--quiet"])
    assert_one_error(code, capsys.readouterr().err, "compile",
                     f"'{fifo}' is a FIFO, and this file is written with seeks")
    assert is_chardev(dev) and is_fifo(fifo) and sorted(os.listdir(tmp_path)) == [
        "null", "pipe"]
    assert_dev_null_untouched()


@pytest.mark.slow
def test_compile_full_disk_is_one_line_and_leaves_no_file(
        tmp_path: Any, model_dir: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "m.toptpu")
    monkeypatch.setattr(output_file._Raw, "_write_raw", full_disk(after=2))
    code = main(["compile", model_dir, "-o", out, "--seq-length", "32", "--quiet"])
    err = capsys.readouterr().err
    assert_one_error(code, err, "compile", f"the model file '{out}': no space left on the "
                     "device after ")
    assert "bytes (it needs " in err and "free space on" in err
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", **SEQ64).model_file


@pytest.mark.slow
def test_profile_trace_writes_through_a_device_and_a_fifo(
        tmp_path: Any, model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    dev, fifo = str(tmp_path / "null"), str(tmp_path / "pipe")
    make_chardev(dev)
    os.mkfifo(fifo)
    assert main(["profile", model_file, "--nets", "embedding", "--trace", dev]) == 0
    with draining(fifo) as got:
        assert main(["profile", model_file, "--nets", "embedding", "--trace", fifo]) == 0
    assert got and got[0].startswith(b'{"traceEvents"')
    assert is_chardev(dev) and is_fifo(fifo) and sorted(os.listdir(tmp_path)) == [
        "null", "pipe"]
    assert "Traceback" not in capsys.readouterr().err


def test_sweep_out_inside_a_config_directory_is_refused(
        tmp_path: Any, model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(model_dir, ck)
    os.symlink(ck, tmp_path / "link")
    before = tree(str(tmp_path))
    for out in (os.path.join(ck, "sweep"), ck, str(tmp_path / "link" / "s")):
        code = main(["sweep", ck, "-o", out, "--seq-length", "64"])
        assert_one_error(code, capsys.readouterr().err, "sweep",
                         f"--out '{out}' is inside the input model directory '{ck}'")
    assert tree(str(tmp_path)) == before


# --------------------------------------------------------------------------- the property

KINDS = ["missing", "file", "dir", "fifo", "chardev", "socket", "missing_dir",
         "file_parent", "readonly_dir"]


def _make(kind: str, d: str, sockets: list[socket.socket]) -> str:
    """A target of `kind` in directory `d` (None where it cannot be made here)."""
    p = os.path.join(d, "t")
    if kind == "file":
        with open(p, "wb") as f:
            f.write(b"old bytes")
    elif kind == "dir":
        os.mkdir(p)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "chardev":
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(p)
        sockets.append(s)
    elif kind == "missing_dir":
        p = os.path.join(d, "nope", "t")
    elif kind == "file_parent":
        with open(os.path.join(d, "f"), "wb") as f:
            f.write(b"a file")
        p = os.path.join(d, "f", "t")
    elif kind == "readonly_dir":
        os.mkdir(os.path.join(d, "ro"))
        p = os.path.join(d, "ro", "t")
        os.chmod(os.path.join(d, "ro"), 0o555)
    return p


def _kind(path: str) -> str:
    try:
        m = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    return {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFIFO: "fifo",
            stat.S_IFCHR: "chardev", stat.S_IFSOCK: "socket", stat.S_IFLNK: "link"}.get(
                stat.S_IFMT(m), "other")


@fuzz_settings(60)
@given(kind=st.sampled_from(KINDS), via_link=st.booleans(), data=st.binary(max_size=3000),
       seekable=st.booleans(), full_at=st.none() | st.integers(0, 2))
def test_the_helper_writes_or_refuses_by_the_kind_of_target(
        tmp_path: Any, kind: str, via_link: bool, data: bytes, seekable: bool,
        full_at: int | None) -> None:
    if kind == "readonly_dir" and os.geteuid() == 0:
        kind = "missing"  # root writes anywhere: the case cannot be made
    d = tempfile.mkdtemp(dir=tmp_path)
    sockets: list[socket.socket] = []
    try:
        try:
            target = _make(kind, d, sockets)
        except PermissionError:
            return  # a device node is not permitted here
        path = target
        if via_link:
            path = os.path.join(d, "link")
            os.symlink(target, path)
        before = _kind(target)
        reader = None
        if kind == "fifo":  # a reader, so that opening for writing does not block
            reader = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
        mp = pytest.MonkeyPatch()
        if full_at is not None:
            mp.setattr(output_file._Raw, "_write_raw", full_disk(after=full_at))
        try:
            with open_output(path, "the output", seekable=seekable) as f:
                for i in range(0, len(data), 1000):  # some writes, each flushed
                    f.write(data[i:i + 1000])
                    f.flush()
            error = None
        except OutputPathError as e:
            error = str(e)
        finally:
            mp.undo()
        got = b""
        if reader is not None:
            with contextlib.suppress(BlockingIOError):
                got = os.read(reader, 1 << 20)
            os.close(reader)
        # never another exception; a refusal names the path, in one line
        if error is not None:
            assert f"'{path}'" in error and "\n" not in error, error
        refused = kind in ("dir", "socket", "missing_dir", "file_parent") or (
            kind == "fifo" and seekable)
        writes = [data[i:i + 1000] for i in range(0, len(data), 1000)]
        full = full_at is not None and len(writes) > full_at
        if refused:
            assert error is not None and "no space" not in error
        elif full:
            assert error is not None and "no space left on the device" in error
        else:
            assert error is None
        # the node keeps its kind; a link stays a link; no temporary file anywhere
        assert _kind(target) == ("file" if kind == "missing" and error is None else before)
        if via_link:
            assert os.path.islink(path)
        for _root, _, files in os.walk(d):
            assert not [n for n in files if output_file.TEMP_MARK in n], files
        if _kind(target) == "file":
            with open(target, "rb") as f:
                content = f.read()
            assert content == (data if error is None else b"old bytes")
        if kind == "fifo" and error is None:
            assert got == data
    finally:
        for s in sockets:
            s.close()
        ro = os.path.join(d, "ro")
        if os.path.isdir(ro):
            os.chmod(ro, 0o755)
