"""Data never destroyed, and faults in the middle of work (issue 44, parts 3, 4 and 8).

- No output over a command's input (`dialects.output_file`: inputs noted by inode while a
  command runs, `open_output` refuses them): `toptpu cache M -o M`, a `M.wcache` linking
  to M, `-o` a symlink or a hard link to M, `toptpu-opt X.mlir -o STORE` with the store X
  names, `--weights-out X.mlir` onto the input IR; and `toptpu cache` replaces only a
  weight cache file (a link to a checkpoint elsewhere, a model file: left as they are).
  Each one line, the target untouched; `toptpu-opt X.mlir -o X.mlir` stays allowed.
- Standard output that cannot be written (/dev/full): one line, status 1.
- A mapped file truncated by another process while a command reads it: one line, never
  SIGBUS (`backend.formats.file_lease`).
- SIGINT / SIGTERM in `cache` and `eval` leave no temporary file and the earlier output as
  it was; two processes writing the same `-o` end with one complete file.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from llm_fixtures import compiled, tiny_dir
from test_cli_errors import SEQ64, assert_one_error, cli

from helpers import BIN
from toptpu.backend.formats.file_lease import FileInUseChanged, guard_mapped_files
from toptpu.backend.formats.model_file import ModelFile
from toptpu.command_io import StdoutError, checked_stdout
from toptpu.dialects.output_file import TEMP_MARK
from toptpu.opt import main as opt_main

HERE = os.path.dirname(os.path.abspath(__file__))
IR = os.path.join(HERE, "filecheck", "convert_top_to_tpu.mlir")
WEIGHTS = os.path.join(HERE, "filecheck", "Inputs", "weights.safetensors")


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def no_temp_files(directory: str) -> bool:
    return not [n for n in os.listdir(directory) if TEMP_MARK in n]


@pytest.fixture
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", **SEQ64).model_file


@pytest.fixture
def model(model_file: str, tmp_path) -> str:  # noqa: ANN001
    """A copy of the model file to be protected, in the test's directory."""
    path = str(tmp_path / "m.toptpu")
    shutil.copyfile(model_file, path)
    return path


# --------------------------------------------------------------------------- cache


@pytest.mark.parametrize("how", ["-o itself", "M.wcache links to M", "-o a link to M",
                                 "-o a hard link to M"])
def test_cache_never_writes_over_its_model_file(model: str, tmp_path, capsys,
                                                how: str) -> None:
    before = digest(model)
    argv = ["cache", model, "--quiet"]
    if how == "-o itself":
        argv += ["-o", model]
    elif how == "M.wcache links to M":
        os.symlink("m.toptpu", model + ".wcache")
    elif how == "-o a link to M":
        os.symlink(model, str(tmp_path / "L"))
        argv += ["-o", str(tmp_path / "L")]
    else:
        os.link(model, str(tmp_path / "H"))
        argv += ["-o", str(tmp_path / "H")]
    code, _, err = cli(argv, capsys)
    assert_one_error(code, err, "cache", "is a file this command reads")
    assert "writing it would destroy its input" in err
    assert digest(model) == before and no_temp_files(str(tmp_path))


def test_cache_replaces_only_a_weight_cache_file(model: str, tmp_path, capsys) -> None:
    """`M.wcache` a link to a checkpoint elsewhere (the probe: replaced through the link),
    `-o` another model file: left as they are. A weight cache file (a damaged one too) and
    an empty file are replaced."""
    ck = str(tmp_path / "elsewhere.safetensors")
    shutil.copyfile(WEIGHTS, ck)
    os.symlink(ck, model + ".wcache")
    code, _, err = cli(["cache", model, "--quiet"], capsys)
    assert_one_error(code, err, "cache", f"(a link to '{ck}') is a file of another kind, not "
                     "a weight cache file")
    assert digest(ck) == digest(WEIGHTS)
    os.unlink(model + ".wcache")
    other = str(tmp_path / "other.toptpu")
    shutil.copyfile(model, other)
    code, _, err = cli(["cache", model, "-o", other, "--quiet"], capsys)
    assert_one_error(code, err, "cache", "is a toptpu model file, not a weight cache file")
    assert digest(other) == digest(model)
    out = str(tmp_path / "c.wcache")
    open(out, "wb").close()
    for _ in range(2):  # empty, then a weight cache file
        code, _, err = cli(["cache", model, "-o", out, "--quiet"], capsys)
        assert code == 0, err
    whole = os.path.getsize(out)
    os.truncate(out, 60)  # damaged: its header cut
    code, _, err = cli(["cache", model, "-o", out, "--quiet"], capsys)
    assert code == 0 and os.path.getsize(out) == whole, err


# --------------------------------------------------------------------------- toptpu-opt


@pytest.fixture
def ir(tmp_path) -> tuple[str, str]:  # noqa: ANN001
    """(an IR file, the weight store it names), both copies in the test's directory."""
    store = str(tmp_path / "w.safetensors")
    shutil.copyfile(WEIGHTS, store)
    path = str(tmp_path / "x.mlir")
    with open(IR) as f, open(path, "w") as g:
        g.write(f.read().replace("@WEIGHTS@", store))
    return path, store


def test_opt_never_writes_over_the_weight_store_or_the_input(ir, tmp_path, capsys) -> None:
    """`-o` the store the IR names (the probe: overwritten with MLIR text), also through a
    hard link, and `--weights-out` the input IR (the probe: overwritten with safetensors
    bytes): one line, nothing written. `-o` the input IR itself rewrites it in place."""
    path, store = ir
    before = {p: digest(p) for p in (path, store)}
    os.link(store, str(tmp_path / "h.safetensors"))
    for argv, needle in (
            ([path, "-p", "canonicalize", "-o", store], f"-o '{store}' is a file this command "
                                                         "reads"),
            ([path, "-p", "canonicalize", "-o", str(tmp_path / "h.safetensors")],
             "is a file this command reads"),
            ([path, "-p", "convert-top-to-tpu{mode=bf16}", "--weights-out", path],
             f"--weights-out '{path}' is a file this command reads")):
        assert opt_main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.strip().startswith("toptpu-opt: ") and needle in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert {p: digest(p) for p in (path, store)} == before
    assert sorted(os.listdir(tmp_path)) == ["h.safetensors", "w.safetensors", "x.mlir"]
    assert opt_main([path, "-p", "canonicalize", "-o", path]) == 0  # in place: allowed
    assert digest(store) == before[store]


# --------------------------------------------------------------------------- stdout


class _FullStream(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_checked_stdout_turns_a_write_error_into_one_error(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdout", _FullStream())
    with pytest.raises(StdoutError, match="cannot write to standard output: No space left on "
                                          "device; the output is incomplete"), \
            checked_stdout():
        print("x")
    assert isinstance(sys.stdout, _FullStream)  # restored


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_stdout_on_dev_full_is_one_line(model_file: str, tmp_path_factory, tmp_path) -> None:
    """run, eval --json, estimate and toptpu-opt with stdout on /dev/full (the probe: an
    OSError traceback each): one line, status 1."""
    text = str(tmp_path / "t.txt")
    with open(text, "w") as f:
        f.write("Hello world! The tensor processor runs the compiled model.\n")
    ir = str(tmp_path / "x.mlir")
    with open(IR) as f, open(ir, "w") as g:
        g.write(f.read().replace("@WEIGHTS@", WEIGHTS))
    commands = {
        "run": ["toptpu", "run", model_file, "--prompt", "Hello", "--max-new-tokens", "2",
                "--executor", "interpreter"],
        "eval": ["toptpu", "eval", model_file, "--text", text, "--json", "--quiet",
                 "--executor", "interpreter"],
        "estimate": ["toptpu", "estimate", tiny_dir(tmp_path_factory, "qwen2"),
                     "--seq-length", "64"],
        "toptpu-opt": ["toptpu-opt", ir, "-p", "canonicalize"],
    }
    for name, argv in commands.items():
        with open("/dev/full", "w") as full:
            res = subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], stdout=full,
                                 stderr=subprocess.PIPE, text=True, timeout=300)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 1, (name, res.stderr)
        assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, name
        assert lines[-1].endswith("cannot write to standard output: No space left on device; "
                                  "the output is incomplete: free space on its device or send "
                                  "it elsewhere"), (name, res.stderr)
        assert sum("error" in line or "cannot write" in line for line in lines) == 1, name


# --------------------------------------------------------------------------- leases


def test_a_mapped_file_being_truncated_stops_the_command_first(model: str) -> None:
    """Inside `guard_mapped_files` an open model file holds a read lease: another process
    truncating it waits, and this one is told (FileInUseChanged) before any byte it maps
    changes; once it lets go, the truncation goes through."""
    with guard_mapped_files():
        f = ModelFile(model)
        size = os.path.getsize(model)
        proc = subprocess.Popen([sys.executable, "-c",
                                 f"import os; os.truncate({model!r}, 100)"])
        try:
            with pytest.raises(FileInUseChanged, match="is being written or truncated by "
                                                       "another process while this command "
                                                       "reads it"):
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    time.sleep(0.01)
            assert proc.poll() is None and os.path.getsize(model) == size  # held back
        finally:
            f.close()
        assert proc.wait(timeout=30) == 0
    assert os.path.getsize(model) == 100


def test_outside_the_guard_no_lease_is_taken(model: str) -> None:
    """A library caller (no command line around it) keeps its signal handlers: no lease,
    a truncation goes through at once (`check_unchanged` before each net run names it)."""
    f = ModelFile(model)
    try:
        subprocess.run([sys.executable, "-c", f"import os; os.truncate({model!r}, 100)"],
                       timeout=30, check=True)
        assert os.path.getsize(model) == 100
    finally:
        f.close()


@pytest.mark.slow  # compiles a w4 model with a weight cache file and generates in a process
@pytest.mark.parametrize("target", ["weight cache file", "model file"])
def test_run_with_its_files_truncated_ends_in_one_line(tmp_path_factory, tmp_path,
                                                       target: str) -> None:
    """The probe: the weight cache file truncated while `run` reads it → SIGBUS (status
    -7). Now the run ends in one line, status 1, and the truncation waits for it."""
    built = compiled(tmp_path_factory, "qwen2", mode="w4bf16", seq=256)
    model = str(tmp_path / "m.toptpu")
    shutil.copyfile(built.model_file, model)
    assert subprocess.run([os.path.join(BIN, "toptpu"), "cache", model, "--quiet"],
                          timeout=300).returncode == 0
    victim = model + ".wcache" if target == "weight cache file" else model
    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "run", model, "--prompt", "Hello",
                             "--max-new-tokens", "240", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(5)  # "Hello": the nets run
    os.truncate(victim, 4096)
    _, err = proc.communicate(timeout=120)
    text = err.decode()
    assert proc.returncode == 1, text
    assert text.strip().splitlines()[-1].startswith("toptpu run: error: ") and \
        "is being written or truncated by another process" in text, text


# --------------------------------------------------------------------------- interrupts


_SLOW_REPLACE = """
import os, sys, time
real = os.replace
def slow(src, dst):  # the output is complete in its temporary file: hold it there
    if str(dst).endswith(sys.argv[1]):
        open(sys.argv[2], "w").close()
        time.sleep(120)
    return real(src, dst)
os.replace = slow
from toptpu.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)


@pytest.mark.slow  # caches in processes, then signals them
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_cache_writes_leaves_the_earlier_cache(tmp_path_factory, tmp_path,
                                                              sig: signal.Signals) -> None:
    built = compiled(tmp_path_factory, "qwen2", mode="w4bf16", seq=64)
    work = tmp_path / "w"
    work.mkdir()
    model = str(work / "m.toptpu")
    shutil.copyfile(built.model_file, model)
    assert subprocess.run([os.path.join(BIN, "toptpu"), "cache", model, "--quiet"],
                          timeout=300).returncode == 0
    before = digest(model + ".wcache")
    flag = str(tmp_path / "writing")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_REPLACE, ".wcache", flag, "cache",
                             model, "--quiet"], stderr=subprocess.PIPE, text=True)
    _wait_for(flag, proc)
    assert not no_temp_files(str(work))  # the new cache sits in its temporary file
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + sig, err
    assert err.strip() == f"toptpu cache: interrupted ({sig.name})"
    assert sorted(os.listdir(work)) == ["m.toptpu", "m.toptpu.wcache"]
    assert digest(model + ".wcache") == before


@pytest.mark.slow  # evaluates in a process, then interrupts it
def test_a_signal_during_eval_is_one_line(model_file: str, tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Hello world! The tensor processor runs the compiled model.\n" * 200)
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "eval", model_file, "--text",
                             str(text), "--executor", "interpreter"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # the first window's progress: it evaluates
    assert line.startswith("toptpu eval: window 1/"), line + proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "toptpu eval: interrupted (SIGTERM)"
    assert "Traceback" not in err and out == ""
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.slow  # two processes cache at once
def test_two_processes_writing_one_cache_end_with_one_complete_file(tmp_path_factory,
                                                                    tmp_path) -> None:
    built = compiled(tmp_path_factory, "qwen2", mode="w4bf16", seq=64)
    out = str(tmp_path / "c.wcache")
    argv = [os.path.join(BIN, "toptpu"), "cache", built.model_file, "-o", out, "--quiet"]
    results: list[subprocess.CompletedProcess] = []

    def one() -> None:
        results.append(subprocess.run(argv, capture_output=True, text=True, timeout=300))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert os.listdir(tmp_path) == ["c.wcache"]
    check = subprocess.run([*argv[:3], "-o", out, "--check"], capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0 and "each equal to the model file's conversion" in \
        check.stdout, check.stderr


def test_a_fifo_or_a_directory_named_as_a_model_file(tmp_path, capsys) -> None:
    """`run x.toptpu` where x.toptpu is a FIFO hung on its open; a directory: one line."""
    fifo = str(tmp_path / "x.toptpu")
    os.mkfifo(fifo)
    code, _, err = cli(["run", fifo, "--prompt", "hi"], capsys)
    assert_one_error(code, err, "run", f"'{fifo}' is a FIFO, not a toptpu model file")
    code, _, err = cli(["run", str(tmp_path), "--prompt", "hi"], capsys)
    assert_one_error(code, err, "run", "is a directory, not a toptpu model file")
