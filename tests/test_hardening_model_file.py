"""A model file crafted with valid checksums is still untrusted (issue 24, points 4-7): the IR
inside each command stream is verified, the header and the streams must agree on every fact
stated twice, a gather past its table traps, the sampling fields are ranged, and a model file
changed under a running generation is detected.

The file under test is the tiny qwen2 of `llm_fixtures` compiled once (w4f16: its stream has
`tpu.a16_matmul` ops with `weight_bits` and `group_size`). Mutations rewrite a section in
memory and write a new file with `write_model_file`, which recomputes every checksum.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
from llm_fixtures import compiled

from toptpu.backend.formats.model_file import ModelFile, ModelFileError, write_model_file
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.cli import main

Json = Any
Parts = tuple[dict[str, Json], dict[str, bytes]]


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", mode="w4f16", seq=64, input_len=16).model_file


@pytest.fixture(scope="module")
def parts(small_file: str) -> Parts:
    """The small file's header (JSON, without the section table) and sections."""
    with ModelFile(small_file) as f:
        return copy.deepcopy(f.header), {n: f.read(n) for n in f.sections}


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test here


def _stream(sections: dict[str, bytes], net: str) -> dict[str, Json]:
    return json.loads(sections[f"stream:{net}"])


def _write(path: str, parts: Parts, *, header: Callable[[Json], None] | None = None,
           stream: tuple[str, Callable[[dict[str, Json]], None]] | None = None) -> str:
    """A copy of `parts` with the header and/or one net's stream edited, checksums
    recomputed."""
    h, sections = copy.deepcopy(parts[0]), dict(parts[1])
    if header is not None:
        header(h)
    if stream is not None:
        net, edit = stream
        prog = _stream(sections, net)
        edit(prog)
        sections[f"stream:{net}"] = json.dumps(prog, separators=(",", ":")).encode()
    write_model_file(path, h, sections)
    return path


def _sub_ir(pattern: str, repl: str) -> Callable[[dict[str, Json]], None]:
    def edit(prog: dict[str, Json]) -> None:
        new, n = re.subn(pattern, repl, prog["ir"], count=1)
        assert n == 1, pattern
        prog["ir"] = new
    return edit


def _load_error(path: str, net: str | None = None) -> str:
    """The one-line ModelFileError opening `path` and loading its nets gives."""
    with pytest.raises(ModelFileError) as info:
        ex = MachineExecutor(path)
        for name in ([net] if net else ex.nets()):
            ex.program(name)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"'{path}': "), message
    return message


def _run(path: str, capsys: pytest.CaptureFixture, *extra: str) -> tuple[int, str]:
    rc = main(["run", path, "--ids", "1,2,3", "--max-new-tokens", "2", *extra])
    out = capsys.readouterr()
    return rc, out.err


def _one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1, err
    assert err.startswith("toptpu run: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


# ------------------------------------------------------------------ 4: stream IR verified

STREAM_IR_CASES = [
    ("block", r"group_size = 64 : i64", "group_size = 0 : i64",
     ["'tpu.a16_matmul' (%linear)", "group_size 0 does not divide K=64"]),
    ("block", r"weight_bits = 4 : i64", "weight_bits = 3 : i64",
     ["'tpu.a16_matmul' (%linear)", "weight_bits must be 4 or 8, got 3"]),
    ("block", r"eps = [^,]+ : f64, ", "", ["'tpu.rms_norm'", "attribute 'eps' expected"]),
    ("block", r"eps = [^,]+ : f64", 'eps = "x"', ["'tpu.rms_norm'", "float"]),
    ("block", r"eps = [^,]+ : f64", "eps = -1.000000e+03 : f64",
     ["'tpu.rms_norm'", "eps is -1000.0; it must be positive and finite"]),
    ("greedy_head", r"axis = 1 : i64", "axis = 5 : i64",
     ["'tpu.topk'", "axis 5 is out of range for rank 2"]),
    ("block", r'"tpu.rms_norm"', '"tpu.rms_nor"', ["Operation tpu.rms_nor is not registered"]),
]


@pytest.mark.parametrize("net,pattern,repl,needles", STREAM_IR_CASES,
                         ids=[f"{c[0]}:{c[2] or 'no eps'}" for c in STREAM_IR_CASES])
def test_a_bad_attribute_in_a_stream_is_one_model_file_error(parts, tmp_path, capsys, net,
                                                             pattern, repl, needles) -> None:
    """Before: ZeroDivisionError, KeyError, AssertionError, AxisError tracebacks (or a run
    with eps=-1000); now one line naming the net, the op (line:col in its stream) and what
    is wrong with the attribute."""
    path = _write(str(tmp_path / "m.toptpu"), parts, stream=(net, _sub_ir(pattern, repl)))
    message = _load_error(path, net)
    assert f"the command stream of net '{net}' is unusable: stream:{net}:" in message
    for needle in needles:
        assert needle in message, (needle, message)
    rc, err = _run(path, capsys)
    _one_line_error(rc, err, f"net '{net}'", *needles)


def test_a_parse_error_in_a_net_ir_section_is_one_line(parts, tmp_path, capsys) -> None:
    """The interpreter's `ir:<net>` sections: the same one line (was the line quoted with
    carets: 4-6 lines)."""
    h, sections = copy.deepcopy(parts[0]), dict(parts[1])
    sections["ir:block"] = sections["ir:block"].replace(b"weight_bits = 4", b"weight_bits = 3",
                                                        1)
    path = str(tmp_path / "m.toptpu")
    write_model_file(path, h, sections)
    rc, err = _run(path, capsys, "--executor", "interpreter")
    _one_line_error(rc, err, "the IR of net 'block' is unusable", ":block:",
                    "weight_bits must be 4 or 8, got 3")
