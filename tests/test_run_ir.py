"""`toptpu run-ir`: any IR file run on given or seeded random inputs with its weight store,
its outputs written, two files compared output by output; bad input in one line.

Small hand-written modules over the FileCheck weights (tests/filecheck/Inputs), checked
against numpy computed here from the same safetensors file; test_ir_dumps.py runs it on the
files of a compile's --dump-ir directory."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from toptpu.cli import main

INPUTS = os.path.join(os.path.dirname(__file__), "filecheck", "Inputs")
WEIGHTS = os.path.join(INPUTS, "weights.safetensors")

LINEAR = """builtin.module attributes {{top.weight_store = "{store}"}} {{
  func.func @main(%x: tensor<1x8x64xf32> {{top.name = "x"}})
      -> (tensor<1x8x32xf32> {{top.name = "y"}}) {{
    %w = "top.weight"() {{name = "fc.weight"}} : () -> tensor<32x64xf32>
    %b = "top.weight"() {{name = "fc.bias"}} : () -> tensor<32xf32>
    %0 = "top.{act}"(%x) : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    %1 = "top.matmul"(%0, %w, %b) {{transpose_b = true,
                                    operandSegmentSizes = array<i32: 1, 1, 1>}}
        : (tensor<1x8x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    func.return %1 : tensor<1x8x32xf32>
  }}
}}
"""


def _ir(tmp_path, act: str = "silu", name: str = "linear.mlir") -> str:
    path = tmp_path / name
    path.write_text(LINEAR.format(store=WEIGHTS, act=act))
    return str(path)


def _reference(x: np.ndarray, act: str = "silu") -> np.ndarray:
    w = load_file(WEIGHTS)
    h = x / (1 + np.exp(-x)) if act == "silu" else 1 / (1 + np.exp(-x))
    return h @ w["fc.weight"].T + w["fc.bias"]


def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


def test_given_inputs_run_with_the_weight_store_and_outputs_are_written(tmp_path,
                                                                         capsys) -> None:
    ir = _ir(tmp_path)
    x = np.random.default_rng(3).standard_normal((1, 8, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out_dir, out_npz = tmp_path / "outs", tmp_path / "outs.npz"
    assert main(["run-ir", ir, "--input", f"x={tmp_path / 'x.npy'}", "--output",
                 str(out_dir)]) == 0
    assert "y: float32[1x8x32]" in capsys.readouterr().out
    y = np.load(out_dir / "y.npy")
    np.testing.assert_allclose(y, _reference(x), rtol=1e-5, atol=1e-5)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["run-ir", ir, "--inputs", str(tmp_path / "in.npz"), "--output",
                 str(out_npz)]) == 0
    with np.load(out_npz) as z:
        np.testing.assert_array_equal(z["y"], y)


def test_random_inputs_are_seeded(tmp_path, capsys) -> None:
    ir = _ir(tmp_path)
    runs = {}
    for seed in (0, 0, 1):
        out = tmp_path / f"o{seed}.npz"
        assert main(["run-ir", ir, "--seed", str(seed), "--output", str(out)]) == 0
        assert f"random inputs (seed {seed}): x" in capsys.readouterr().out
        with np.load(out) as z:
            runs.setdefault(seed, []).append(z["y"])
    np.testing.assert_array_equal(runs[0][0], runs[0][1])
    assert not np.array_equal(runs[0][0], runs[1][0])
    x = np.random.default_rng(0).standard_normal((1, 8, 64), dtype=np.float32)
    np.testing.assert_allclose(runs[0][0], _reference(x), rtol=1e-5, atol=1e-5)


def test_compare_reports_each_output_and_fails_past_the_threshold(tmp_path, capsys) -> None:
    a, same, other = _ir(tmp_path), _ir(tmp_path, name="b.mlir"), _ir(tmp_path, "sigmoid",
                                                                       "c.mlir")
    assert main(["run-ir", a, "--compare", same, "--max-abs", "0"]) == 0
    out = capsys.readouterr().out
    assert "y: cos=1.0000000 max|a-b|=0 at [0,0,0], every element equal" in out
    assert "all outputs within cos >= 0.99, max|a-b| <= 0.0" in out
    assert main(["run-ir", a, "--compare", other]) == 1
    out = capsys.readouterr().out
    m = re.search(r"y: cos=(-?[0-9.]+) max\|a-b\|=([0-9.e+-]+) at \[(\d+),(\d+),(\d+)\], first "
                  r"mismatch at \[(\d+),(\d+),(\d+)\]: ([-0-9.e+]+) vs ([-0-9.e+]+)  FAIL", out)
    assert m, out
    x = np.random.default_rng(0).standard_normal((1, 8, 64), dtype=np.float32)
    ya, yb = _reference(x, "silu"), _reference(x, "sigmoid")
    cos = float((ya * yb).sum() / np.linalg.norm(ya) / np.linalg.norm(yb))
    assert float(m.group(1)) == pytest.approx(cos, abs=1e-6)
    diff = np.abs(ya - yb)
    assert float(m.group(2)) == pytest.approx(diff.max(), rel=1e-4)
    assert tuple(int(i) for i in m.group(3, 4, 5)) == np.unravel_index(diff.argmax(), diff.shape)
    assert tuple(int(i) for i in m.group(6, 7, 8)) == (0, 0, 0)  # every element differs
    assert "outputs outside cos >= 0.99" in out


def test_the_machine_runs_tpu_ir_through_the_machine_passes(tmp_path, capsys) -> None:
    """Ungrouped Tpu IR on the machine (layer-group, lmem-verify, address-assign, then
    codegen) gives the interpreter's bits."""
    ir = os.path.join(INPUTS, "ungrouped.mlir")
    assert main(["run-ir", ir, "--executor", "machine", "--compare", ir, "--max-abs",
                 "0"]) == 0
    assert "every element equal" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["{ir}", "--input", "x={d}/missing.npy"], "--input x: '{d}/missing.npy' does not exist"),
    (["{ir}", "--input", "z={d}/x.npy"], "'z' is not an input of the function (its inputs: x)"),
    (["{ir}", "--input", "x"], "--input 'x': write NAME=FILE.npy"),
    (["{ir}", "--input", "x={d}/short.npy"],
     "input 'x' from {d}/short.npy has shape [1, 4, 64]; the function takes [1, 8, 64]"),
    (["{ir}", "--input", "x={d}/f64.npy"],
     "input 'x' from {d}/f64.npy is float64; the function takes float32: save it as float32"),
    (["{ir}", "--inputs", "{d}/x.npy"], "is one array, not an .npz archive"),
    (["{d}/broken.mlir"], "broken.mlir:2:"),
    (["{d}/nothing.mlir"], "'{d}/nothing.mlir' does not exist"),
    (["{ir}", "--executor", "machine"],
     "is Top IR; the machine runs Tpu IR: lower it first"),
    (["{d}/nostore.mlir"], "weight store"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, fragment) -> None:
    d = str(tmp_path)
    ir = _ir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((1, 8, 64), np.float32))
    np.save(tmp_path / "short.npy", np.zeros((1, 4, 64), np.float32))
    np.save(tmp_path / "f64.npy", np.zeros((1, 8, 64), np.float64))
    (tmp_path / "broken.mlir").write_text("builtin.module {\n  func.func @f( {\n")
    (tmp_path / "nostore.mlir").write_text(LINEAR.format(store=f"{d}/gone.safetensors",
                                                         act="silu"))
    code = main(["run-ir", *(a.format(d=d, ir=ir) for a in args)])
    err = _err(capsys)
    assert code == 1 and err.count("\n") == 0 and err.startswith("toptpu run-ir: error: "), err
    assert fragment.format(d=d) in err, err
