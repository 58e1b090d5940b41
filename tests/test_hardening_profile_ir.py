"""`toptpu profile FILE.mlir` checks what it times (issue 44, part 6; issue 39): IR whose
local or global addresses, slices, regions or tensor sizes the machine could not run is
refused in one located line before codegen (`passes.machine_verify`, lmem-verify among
them), never timed with the unedited IR's numbers, never looped over 99999999999 slices,
never a ParseError traceback.

The IR is made by `toptpu-opt` itself: the machine pipeline over a Tpu net too big for
local memory in one piece (so it is sliced) and over a small net with weights.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import pytest
from test_cli_errors import assert_one_error, cli

from toptpu.opt import main as opt_main

HERE = os.path.dirname(os.path.abspath(__file__))
SLICED = os.path.join(HERE, "filecheck", "Inputs", "sliced_silu.mlir")
TOP = os.path.join(HERE, "filecheck", "convert_top_to_tpu.mlir")
WEIGHTS = os.path.join(HERE, "filecheck", "Inputs", "weights.safetensors")


@pytest.fixture(scope="module")
def nets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> the text of grouped, allocated, addressed Tpu IR (bm1684x)."""
    d = tmp_path_factory.mktemp("machine-ir")
    top = d / "top.mlir"
    top.write_text(open(TOP).read().replace("@WEIGHTS@", WEIGHTS))
    out = {}
    for name, src, passes in (
            ("sliced", SLICED, "machine-pipeline{chip=bm1684x}"),
            ("net", str(top), "convert-top-to-tpu{mode=f32},canonicalize,weight-reorder,"
                              "machine-pipeline{chip=bm1684x}")):
        path = str(d / f"{name}.mlir")
        # the generic form: the edits below are on its quoted op names
        assert opt_main([src, "-p", passes, "--print-op-generic", "-o", path]) == 0
        out[name] = open(path).read()
    assert re.search(r"slices = ([2-9]|\d\d+) :", out["sliced"]), "the silu is not sliced"
    assert re.search(r"gaddrs = array<i64: \d+", out["net"]), "no activation in global memory"
    return out


def _first(pattern: str, text: str) -> re.Match[str]:
    m = re.search(pattern, text)
    assert m is not None, pattern
    return m


def _sub_first(pattern: str, repl: Callable[[re.Match[str]], str], text: str) -> str:
    m = _first(pattern, text)
    return text[:m.start()] + repl(m) + text[m.end():]


def _loads_at_zero(text: str) -> str:
    """Every load of the first group with two or more loads at local address 0."""
    start = text.index('"tpu.group"')
    end = text.index("tpu.yield", start)
    body = re.sub(r'("tpu.load".*?lmem = array<i64: )\d+>', r"\g<1>0>", text[start:end])
    return text[:start] + body + text[end:]


#: name -> (the net, the edit, a fragment of the one line that refuses it)
CASES: dict[str, tuple[str, Callable[[str], str], str]] = {
    "negative local address": (
        "net", lambda t: _sub_first(r'("tpu.load".*?lmem = array<i64: )\d+', lambda m:
                                    m.group(1) + "-64", t), "at [-64, "),
    "local address 99999999999": (
        "net", lambda t: _sub_first(r'("tpu.load".*?lmem = array<i64: )\d+', lambda m:
                                    m.group(1) + "99999999999", t), "at 99999999999"),
    "three loads at one local address": ("net", _loads_at_zero, "live buffers overlap"),
    "a global address near 2^63": (
        "net", lambda t: _sub_first(r"gaddrs = array<i64: (\d+)", lambda m:
                                    "gaddrs = array<i64: 9223372036854775000", t),
        "at global address 9223372036854775000 is not inside the activation region"),
    "an activation region smaller than what is placed in it": (
        "net", lambda t: re.sub(r"tpu\.regions<\d+ : i64", "tpu.regions<64 : i64", t,
                                count=1), "is not inside the activation region of 64 bytes"),
    "a weight region smaller than its weights": (
        "net", lambda t: re.sub(r"(tpu\.regions<\d+ : i64, \d+ : i64, )\d+", r"\g<1>64", t,
                                count=1),
        "its weights region of 64 bytes is smaller than the"),
    "negative regions": (
        "net", lambda t: re.sub(r"tpu\.regions<\d+ : i64", "tpu.regions<-5 : i64", t,
                                count=1), "tpu.regions: activations size -5 is negative"),
    "99999999999 slices of a sliced group": (
        "sliced", lambda t: re.sub(r"slices = \d+ :", "slices = 99999999999 :", t, count=1),
        "in a group of 99999999999 slices it moves"),
    "99999999999 slices of a group that slices nothing": (
        "net", lambda t: re.sub(r"slices = 1 :", "slices = 99999999999 :", t, count=1),
        "a group of 99999999999 slices slices nothing"),
    "a zero-size tensor": (
        "sliced", lambda t: t.replace("1x4096x2048", "1x0x2048"),
        "of type tensor<1x0x2048xf32> has no elements"),
}


def test_valid_ir_is_timed(nets, tmp_path, capsys) -> None:  # noqa: ANN001
    for name, text in nets.items():
        path = tmp_path / f"{name}.mlir"
        path.write_text(text)
        code, out, err = cli(["profile", str(path), "--json"], capsys)
        assert code == 0, err
        assert json.loads(out)["nets"][0]["cycles"] > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_ir_the_machine_could_not_run_is_refused_in_one_line(nets, tmp_path, capsys,
                                                             case: str) -> None:
    """Each edit of the probe (each profiled before with the unedited IR's numbers, or a
    hang, or a traceback): one `toptpu profile: error:` line naming the file and what is
    wrong, before anything is timed."""
    net, edit, needle = CASES[case]
    text = edit(nets[net])
    assert text != nets[net]
    path = str(tmp_path / "edited.mlir")
    with open(path, "w") as f:
        f.write(text)
    code, out, err = cli(["profile", path], capsys)
    assert_one_error(code, err, "profile", needle)
    assert path in err and out == ""
