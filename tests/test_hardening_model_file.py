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
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled

from toptpu.backend.formats.model_file import ModelFile, ModelFileError, write_model_file
from toptpu.backend.runtime.machine import MachineTrap
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime
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


# ------------------------------------------------------------------ 5, 6: stated twice


def _rederive_io(h: Json) -> None:
    """The header's nets' IO re-derived from its (edited) shapes and model, as a crafter
    keeping the header self-consistent would."""
    from toptpu.backend.contract import StaticShapes, net_io
    from toptpu.backend.formats.header_schema import decode, encode
    from toptpu.backend.formats.llm_file import ModelInfo

    activations = h["nets"]["embedding"]["outputs"][0]["dtype"]  # the hidden state's dtype
    io = net_io(decode(StaticShapes, h["shapes"]), decode(ModelInfo, h["model"]), activations)
    for name, net in h["nets"].items():
        if name in io:
            net["inputs"], net["outputs"] = encode(io[name][0]), encode(io[name][1])


def _set(section: str, key: str, value: Any) -> Callable[[Json], None]:
    def edit(h: Json) -> None:
        h[section][key] = value
        if key == "hidden_size":
            h["model"]["head_dim"] = value // h["model"]["num_heads"]
        _rederive_io(h)
    return edit


def _cmd(net: str, index: int, edit: Callable[[dict[str, Json]], None]
         ) -> tuple[str, Callable[[dict[str, Json]], None]]:
    def apply(prog: dict[str, Json]) -> None:
        edit(prog["commands"][index])
    return net, apply


def _first_compute_reads(dtype: str) -> Callable[[dict[str, Json]], None]:
    def edit(prog: dict[str, Json]) -> None:
        c = next(c for c in prog["commands"] if c["cmd"] == "compute"
                 and c["ins"][0]["dtype"] == "float16")
        c["ins"][0]["dtype"] = dtype
    return edit


def _weight_spec(prog: dict[str, Json]) -> None:
    (name,) = prog["weights"]  # the embedding table
    prog["weights"][name]["shape"] = [96, 256]


STATED_TWICE = {
    "hidden 128 vs 64": (dict(header=_set("model", "hidden_size", 128)),
                         ["(hidden float16 [1, 16, 64]; the header says hidden float16 "
                          "[1, 16, 128]", "model.hidden_size 128"]),
    "seq_length 4096 vs 64": (dict(header=_set("shapes", "seq_length", 4096)),
                              ["the header says attention_mask", "4097]",
                               "shapes.seq_length 4096"]),
    "vocab 500 vs 384 rows": (dict(header=_set("model", "vocab_size", 500)),
                              ["[1, 384]", "the header says", "[1, 500]",
                               "model.vocab_size 500"]),
    "num_heads 8 vs 4": (dict(header=lambda h: h["model"].__setitem__("num_heads", 8)),
                         ["its attention has q_heads 4 and kv_heads 2, not the same share "
                          "of model.num_heads 8"]),
    "smaller table in the stream": (
        dict(stream=_cmd("embedding", 1, lambda c: c["table"].__setitem__("shape", [100, 64]))),
        ["command 1, which moves 'embed_tokens.weight", "as float16 [100, 64] (it is float16 "
         "[384, 64])"]),
    "store into the net's input": (
        dict(stream=_cmd("embedding", 2, lambda c: c["tensor"].__setitem__("name",
                                                                           "input_ids"))),
        ["command 2, which stores into 'input_ids' (one of its inputs)"]),
    "weight spec vs table": (dict(stream=("embedding", _weight_spec)),
                             ["weight 'embed_tokens.weight", "(float16 [96, 256]; the weight "
                              "table has float16 [384, 64])"]),
    "bf16 buffer read as f16": (dict(stream=("block", _first_compute_reads("bfloat16"))),
                                ["float16 in the IR, the command's buffer holds bfloat16"]),
}


@pytest.mark.parametrize("case", list(STATED_TWICE))
def test_facts_stated_twice_must_agree(parts, tmp_path, capsys, case) -> None:
    """Before: each ran with exit 0 (or an IndexError traceback); now refused at load, one
    line naming the net and the two values."""
    edits, needles = STATED_TWICE[case]
    path = _write(str(tmp_path / "m.toptpu"), parts, **edits)  # type: ignore[arg-type]
    message = _load_error(path)
    for needle in needles:
        assert needle in message, (needle, message)
    assert "recompile the model" in message
    rc, err = _run(path, capsys)
    _one_line_error(rc, err, *needles)


def test_header_sizes_are_checked_when_the_file_is_opened(parts, tmp_path) -> None:
    """The header's sizes against every net's stream: at open, before any net runs."""
    path = _write(str(tmp_path / "m.toptpu"), parts, header=_set("model", "vocab_size", 500))
    with pytest.raises(ModelFileError, match="model.vocab_size 500"):
        MachineExecutor(path)


def test_the_interpreter_checks_the_ir_against_the_header(parts, tmp_path, capsys) -> None:
    """Found when the model is opened: the runtime prepares the nets every generation runs
    then, the decode step's embedding first."""
    path = _write(str(tmp_path / "m.toptpu"), parts, header=_set("model", "hidden_size", 128))
    rc, err = _run(path, capsys, "--executor", "interpreter")
    _one_line_error(rc, err, "the IR of net 'embedding_cache' and the header disagree on "
                    "'hidden': float16 [1, 1, 64] in the IR, float16 [1, 1, 128] in the header")


@pytest.mark.parametrize("executor", ["machine", "interpreter"])
def test_a_gather_past_its_table_traps(small_file, executor) -> None:
    """Before: IndexError from the kernel; now the executor's one-line error naming the
    command and the table."""
    from toptpu.backend.runtime.interpreter_executor import ExecutorError, InterpreterExecutor

    ex = MachineExecutor(small_file) if executor == "machine" else InterpreterExecutor(
        small_file)
    ids, hidden = ex.alloc((1, 16), "int32"), ex.alloc((1, 16, 64), "float16")
    ex.write(ids, np.full((1, 16), 999))
    with pytest.raises((MachineTrap, ExecutorError)) as info:
        ex.run("embedding", {"input_ids": ids, "hidden": hidden})
    message = str(info.value)
    assert "\n" not in message and "gather index 999 is out of range for axis of size 384" \
        in message and "below the table's rows" in message
    if executor == "machine":
        assert isinstance(info.value, MachineTrap)
        assert message.startswith("command 1 (embed_tokens.embedding)") and \
            "w:embed_tokens.weight" in message


# ------------------------------------------------------------------ sampling fields


def test_a_repetition_penalty_out_of_range_is_refused_everywhere(parts, small_file, tmp_path,
                                                                 capsys) -> None:
    """Before: a header (or --repetition-penalty) of 1e300 ran and printed numpy's
    RuntimeWarnings; now one range, [1e-4, 1e4], in the header, the CLI and the runtime."""
    from toptpu.backend.runtime.errors import GenerationError
    from toptpu.backend.runtime.runtime import SamplingConfig

    for bad in (1e300, 1e-300):
        path = _write(str(tmp_path / "m.toptpu"), parts,
                      header=lambda h, v=bad: h["generation"].__setitem__("repetition_penalty",
                                                                          v))
        rc, err = _run(path, capsys)
        _one_line_error(rc, err, "generation.repetition_penalty is", "outside [0.0001, 10000.0]")
        assert "RuntimeWarning" not in err
        assert main(["run", small_file, "--ids", "1", "--repetition-penalty", repr(bad)]) == 2
        assert "must be a number in [0.0001, 10000]" in capsys.readouterr().err
        with pytest.raises(GenerationError, match=r"repetition_penalty must be in \[0.0001, "):
            SamplingConfig(repetition_penalty=bad).validate()
    rt = Runtime.open(small_file)
    for sampler in ("chip", "host"):  # the bounds themselves run without a warning
        for penalty in (1e-4, 1e4):
            with np.errstate(over="raise", invalid="raise"):
                rt.generate([1, 2, 3], 2, SamplingConfig(repetition_penalty=penalty,
                                                         sampler=sampler))


# ------------------------------------------------------------------ 7: changed while in use


def _overwrite_tail(path: str) -> None:
    """Rewrite the last 64 KiB in place (same size, same inode): other weights."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 65536)
        f.write(bytes(65536))


@pytest.mark.parametrize("executor", ["machine", "interpreter"])
def test_a_model_file_written_in_place_stops_the_generation(small_file, tmp_path,
                                                            executor) -> None:
    """Before: the next step ran on the new bytes (NaN warnings, other tokens, exit 0)."""
    path = str(tmp_path / "m.toptpu")
    shutil.copy(small_file, path)
    rt = Runtime.open(path, executor)
    rt.generate([1, 2, 3], 2)
    _overwrite_tail(path)
    with pytest.raises(ModelFileError) as info:
        rt.generate([1, 2, 3], 2)
    message = str(info.value)
    assert message.startswith(f"'{path}' changed while in use") and "\n" not in message
    assert "truncated or written in place" in message


def test_a_model_file_replaced_at_its_path_is_said(small_file, tmp_path) -> None:
    path = str(tmp_path / "m.toptpu")
    shutil.copy(small_file, path)
    rt = Runtime.open(path)
    shutil.copy(small_file, path + ".new")
    os.replace(path + ".new", path)  # a recompile's atomic rename
    with pytest.raises(ModelFileError, match="was replaced by another file while in use"):
        rt.generate([1, 2, 3], 2)


CHAT_THEN_TRUNCATE = """
import os, subprocess, sys
path, toptpu = sys.argv[1:3]
p = subprocess.Popen([toptpu, "chat", path, "--max-new-tokens", "2"], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
p.stdin.write("hello\\n"); p.stdin.flush()
while True:  # the first turn's statistics line: the model file is mapped and in use
    line = p.stderr.readline()
    if "tokens in the cache" in line or not line:
        break
os.truncate(path, os.path.getsize(path) // 2)
out, err = p.communicate("again\\n", timeout=120)
print(p.returncode); print(err, end="")
"""


@pytest.mark.slow  # a chat in a subprocess
def test_truncating_the_model_file_under_a_chat_is_one_line(small_file, tmp_path) -> None:
    """Before: SIGBUS (exit 135, no message); now the model file error, exit 1."""
    path = str(tmp_path / "m.toptpu")
    shutil.copy(small_file, path)
    toptpu = os.path.join(os.path.dirname(sys.executable), "toptpu")
    proc = subprocess.run([sys.executable, "-c", CHAT_THEN_TRUNCATE, path, toptpu],
                          capture_output=True, text=True, timeout=300)
    rc, _, err = proc.stdout.partition("\n")
    assert rc == "1", proc.stdout
    # the read lease on the mapped file reports the truncation as it happens; where no
    # lease could be taken, the next read finds the file changed
    assert err.startswith((f"toptpu chat: error: '{path}' changed while in use (now ",
                           f"toptpu chat: error: '{path}' is being written or truncated by "
                           "another process")), err
    assert err.count("\n") == 1 and "Traceback" not in err


# ------------------------------------------------------------------ properties

#: an integer or float attribute of an op in a stream's IR: `name = value : i64|f64`
_ATTR = re.compile(r"\b([a-z_]+) = (-?[0-9][0-9.e+-]*|0x[0-9A-F]+) : (i64|f64)")
_SKIP = ("tpu.load", "tpu.store", "tpu.group", "tpu.yield", "tpu.weight", "func.")


@pytest.fixture(scope="module")
def stream_attrs(parts: Parts) -> list[tuple[str, int, int, int]]:
    """Every integer/float attribute of a compute op in every stream: (net, line, start and
    end of `value : type` in that line)."""
    found = []
    for name in sorted(parts[1]):
        if not name.startswith("stream:"):
            continue
        net = name[len("stream:"):]
        for i, line in enumerate(_stream(parts[1], net)["ir"].splitlines()):
            if '"tpu.' not in line or any(f'"{s}' in line for s in _SKIP):
                continue
            attrs = line[line.index("{"):line.index("}")] if "{" in line else ""
            offset = line.index("{") if attrs else 0
            for m in _ATTR.finditer(attrs):
                found.append((net, i, offset + m.start(2), offset + m.end(3)))
    assert len(found) > 50
    return found


_BAD_VALUES = st.one_of(
    st.integers(-3, 3), st.integers(-2**40, 2**40), st.sampled_from([2**62, -2**62]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, -1e3, 1e300]),
    st.sampled_from(['"x"', "true", "array<i64: 1>", "DELETE"]))


def _attr_text(value: Any, kind: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            bits = {"nan": "0x7FF8000000000000", "inf": "0x7FF0000000000000",
                    "-inf": "0xFFF0000000000000"}[repr(value)]
            return f"{bits} : f64"
        return f"{value:e} : f64"
    return f"{value} : {kind}"


def _refused_or_runs(path: str) -> str | None:
    """The one-line error loading and running every net of `path` gives, or None if it
    runs; any other exception fails the property."""
    from toptpu.backend.runtime.errors import GenerationError
    from toptpu.backend.runtime.machine_executor import MachineExecutorError

    try:
        ex = MachineExecutor(path)
        for net in ex.nets():
            ex.program(net)
            ex._load(net)  # noqa: SLF001 - the IR of every net, parsed and verified
        Runtime(ex).generate(list(range(1, 21)), 2)  # every text net runs
    except (ModelFileError, MachineTrap, GenerationError, MachineExecutorError) as e:
        message = str(e)
        assert "\n" not in message, message
        return message
    return None


@pytest.mark.slow  # hypothesis: many crafted model files
@fuzz_settings(25)
@given(data=st.data())
def test_stream_ir_attribute_mutations_are_refused_or_run(parts, stream_attrs, tmp_path_factory,
                                                          data: st.DataObject) -> None:
    """(a) An integer or float attribute of a random op in a random net's stream set to a
    drawn bad value (or deleted), checksums recomputed: the one model-file error (or the
    machine's trap), or a file that runs; never another exception."""
    net, line_no, start, end = data.draw(st.sampled_from(stream_attrs), label="attribute")
    value = data.draw(_BAD_VALUES, label="value")
    kind = "f64" if parts and _stream(parts[1], net)["ir"].splitlines()[line_no][
        start:end].endswith("f64") else "i64"

    def edit(prog: dict[str, Json]) -> None:
        lines = prog["ir"].splitlines()
        line = lines[line_no]
        if value == "DELETE":
            name_start = line.rindex(", ", 0, start) + 2 if ", " in line[:start] else \
                line.rindex("{", 0, start) + 1
            tail = line[end:]
            lines[line_no] = line[:name_start] + tail.removeprefix(", ").removeprefix(",")
        else:
            lines[line_no] = line[:start] + _attr_text(value, kind) + line[end:]
        prog["ir"] = "\n".join(lines) + "\n"

    path = str(tmp_path_factory.getbasetemp() / "stream-attr.toptpu")
    _write(path, parts, stream=(net, edit))
    _refused_or_runs(path)


_SIZES = [("model", "hidden_size"), ("model", "vocab_size"), ("model", "num_heads"),
          ("model", "num_kv_heads"), ("model", "head_dim"), ("shapes", "seq_length"),
          ("shapes", "max_input_length"), ("shapes", "max_history")]


@pytest.mark.slow  # hypothesis: many crafted model files
@fuzz_settings(25)
@given(field_=st.sampled_from([*_SIZES, ("config", "rms_norm_eps")]),
       value=st.one_of(st.integers(1, 4096), st.floats(1e-12, 1.0)),
       rederive=st.booleans())
def test_header_sizes_that_differ_from_the_nets_are_refused(parts, tmp_path_factory, field_,
                                                            value, rederive) -> None:
    """(b) One size of the header (or the config's eps) changed, the nets' IO re-derived
    from it or not, checksums recomputed: refused at load, one line naming the field; a
    value equal to the nets' own runs."""
    section, key = field_
    h = parts[0]
    old = h["model"]["config"][key] if section == "config" else h[section][key]
    value = float(value) if section == "config" else int(value)

    def edit(header: Json) -> None:
        if section == "config":
            header["model"]["config"][key] = value
        else:
            header[section][key] = value
            if rederive:
                _rederive_io(header)

    path = str(tmp_path_factory.getbasetemp() / "header-size.toptpu")
    try:
        _write(path, parts, header=edit)
    except ValueError:  # a header whose contract cannot be derived (heads not dividing...)
        return
    message = _refused_or_runs(path)
    if value == old:
        assert message is None, message
        return
    assert message is not None, f"{section}.{key} = {value} (was {old}) was accepted"
    # the field itself is named (`model.vocab_size ...`, `model.num_heads is ...`,
    # `config.rms_norm_eps is ...`), or the net IO tensor the header shapes from it
    assert key in message or "nets." in message, message


@pytest.mark.slow  # compiles a model whose attention a layer group slices by heads
def test_an_attention_sliced_by_heads_agrees_with_the_header(tmp_path) -> None:
    """A layer group may give each slice a share of the heads (bm1688, a 1024-row prefill
    on top of 1024 history positions): the check that the streams and the header agree on
    the heads takes that as agreement, and the file runs (it was refused as 'q_heads 2,
    model.num_heads is 4')."""
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.tiny_models import save_tiny_model

    src, out = str(tmp_path / "m"), str(tmp_path / "m.toptpu")
    save_tiny_model(src, "qwen2", layers=1)
    compile_model(src, out, mode="f32", chip="bm1688", seq_length=1024,
                  max_input_length=1024)
    with ModelFile(out) as f:
        heads = {net: set(re.findall(r"q_heads = (\d+)", f.read(f"stream:{net}").decode()))
                 for net in ("block", "block_kv")}
    assert heads["block_kv"] == {"2"}, heads  # sliced: the header says 4
    rt = Runtime.open(out, "machine")
    assert len(rt.generate([1, 2, 3], 2, stop_on_eos=False).generated_ids) == 2
