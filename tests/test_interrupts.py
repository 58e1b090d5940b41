"""SIGINT and SIGTERM during `compile` (issue 44): one line, status 130 / 143, no partial or
temporary file, and the previous output byte for byte. The real command in a process, the
signal sent while it works (mid-nets) or while its output sits complete in its temporary
file (held there by a patched rename / fsync). `sweep`'s are in tests/test_sweep.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from llm_fixtures import tiny_dir
from test_cli_errors import _SLOW_WRITE, _interrupted, _wait_for

from helpers import BIN

PREVIOUS = b"an earlier model file, kept byte for byte"


def _earlier_output(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, "out.toptpu")
    with open(out, "wb") as f:
        f.write(PREVIOUS)
    return out


def _kept(out: str) -> None:
    assert sorted(os.listdir(os.path.dirname(out))) == ["out.toptpu"]  # no temporary file
    with open(out, "rb") as f:
        assert f.read() == PREVIOUS


@pytest.mark.slow  # compiles in a process, then interrupts it
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_compile_writes_keeps_the_previous_file(tmp_path_factory, tmp_path,
                                                               sig: signal.Signals) -> None:
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = _earlier_output(str(tmp_path / "out"))
    flag = str(tmp_path / "writing")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, flag, "compile", ck, "-o",
                             out, "--seq-length", "32", "--max-input-length", "8", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    _wait_for(flag, proc)
    assert any(n.startswith(".out.toptpu.tmp-") for n in os.listdir(os.path.dirname(out)))
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    _interrupted(proc, err, "compile", sig)
    _kept(out)


@pytest.mark.slow  # compiles in a process, then interrupts it
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_compile_keeps_the_previous_file(tmp_path_factory, tmp_path,
                                                      sig: signal.Signals) -> None:
    """After the model loaded, while the nets compile."""
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = _earlier_output(str(tmp_path / "out"))
    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "compile", ck, "-o", out,
                             "--seq-length", "32", "--max-input-length", "8"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    progress = []
    for line in proc.stderr:
        progress.append(line)
        if line.startswith("toptpu compile: "):  # loaded; the nets compile next
            break
    proc.send_signal(sig)
    err = "".join(progress) + proc.communicate(timeout=60)[1]
    _interrupted(proc, err, "compile", sig)
    _kept(out)
