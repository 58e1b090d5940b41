"""The native MLIR dialect plugin of top/tpu/dev (`toptpu.dialects.mlir_plugin`, from the ODS
export `toptpu.dialects.ods_export`): the real `mlir-opt --load-dialect-plugin` verifies IR
as toptpu prints it, traits included, and refuses what breaks the definitions. The plugin is
built once per content into the build directory (~/.cache/toptpu/mlir-plugin or
$TOPTPU_MLIR_PLUGIN_DIR) and reused by later runs. Every file of a `--dump-ir` directory,
grouped and addressed stages included: tests/test_ir_dumps.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from toptpu.dialects.dev import Dev
from toptpu.dialects.mlir_plugin import build_plugin, main, run_mlir_opt_with_plugin
from toptpu.dialects.ods_export import export_ods
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu


def test_the_ods_export_defines_every_op_with_its_traits() -> None:
    export = export_ods()
    assert export.files == export_ods().files  # the same text each time: one build cached
    for seed in ("1", "2"):  # and in every process (xDSL keeps traits and value sets in sets)
        other = subprocess.run(
            [sys.executable, "-c", "import json; from toptpu.dialects.ods_export import "
             "export_ods; print(json.dumps(export_ods().files))"], capture_output=True,
            text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(other.stdout) == export.files
    td = "\n".join(export.files.values())
    for dialect in (Top, Tpu, Dev):
        for op in dialect.operations:
            assert f'_Op<"{op.name.split(".", 1)[1]}", [' in td, op.name
    tpu = export.files["TpuOps.td"]
    assert 'Tpu_YieldOp : Tpu_Op<"yield", [HasParent<"::toptpu_mlir::tpu::GroupOp">, ' \
           "Pure, Terminator]>" in tpu
    assert 'Tpu_GroupOp : Tpu_Op<"group", [IsolatedFromAbove' in tpu
    assert "SizedRegion<1>:$body" in tpu and "Variadic<AnyTensor>:$inputs" in tpu
    assert 'def Tpu_RegionsAttr : AttrDef<Tpu_Dialect, "Regions">' in tpu
    # what ODS does not carry is listed, not dropped
    gaps = "\n".join(export.grouped_gaps())
    assert "Python verifier" in gaps and "tpu.const_offset" in gaps


@pytest.fixture(scope="module")
def plugin() -> str:
    return build_plugin()


def _func(body: str, args: str = "%x: tensor<1x8x64xf32>, %w: tensor<64xf32>",
          results: str = "tensor<*xf32>") -> str:
    return f"func.func @f({args}) -> {results} {{\n{body}\n}}\n"


RMS = '%0 = "top.rms_norm"(%x, %w) {{eps = {eps}}} : (tensor<1x8x64xf32>, tensor<64xf32>) ' \
      "-> tensor<*xf32>\nfunc.return %0 : tensor<*xf32>"
ROPE = ('%0 = "top.rope"(%x, %c, %s) {{mode = {mode}}} : '
        "(tensor<1x8x2x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<1x8x2x16xf32>\n"
        "func.return %0 : tensor<1x8x2x16xf32>")
ROPE_ARGS = "%x: tensor<1x8x2x16xf32>, %c: tensor<8x16xf32>, %s: tensor<8x16xf32>"

#: (IR, None when MLIR verifies it, else what its error says)
CASES = {
    "unranked results (IR before shape-infer)": (_func(RMS.format(eps="1.0e-06 : f64")), None),
    "an attribute of the wrong kind": (
        _func(RMS.format(eps='"x"')), "attribute 'eps' failed to satisfy constraint: "
                                      "FloatAttr"),
    "a required attribute missing": (
        _func(RMS.format(eps="1.0e-06 : f64").replace(" {eps = 1.0e-06 : f64}", "")),
        "requires attribute 'eps'"),
    "an operand that is no tensor": (
        _func('%0 = "top.exp"(%x) : (i32) -> tensor<*xf32>\nfunc.return %0 : tensor<*xf32>',
              args="%x: i32"), "operand #0 must be tensor of any type values"),
    "an enum's value": (_func(ROPE.format(mode='"half"'), ROPE_ARGS,
                              "tensor<1x8x2x16xf32>"), None),
    "a value outside an enum": (_func(ROPE.format(mode='"sideways"'), ROPE_ARGS,
                                      "tensor<1x8x2x16xf32>"),
                                "attribute 'mode' failed to satisfy constraint: one of half, "
                                "interleaved"),
    "an op the dialect does not have": (
        _func('%0 = "top.frobnicate"(%x) : (tensor<1x8x64xf32>) -> tensor<*xf32>\n'
              "func.return %0 : tensor<*xf32>"), "unregistered operation 'top.frobnicate'"),
    "tpu.yield outside a tpu.group": (
        _func('"tpu.yield"(%x) : (tensor<1x8x64xf32>) -> ()\nfunc.return',
              results="()"), "'tpu.yield' op expects parent op 'tpu.group'"),
    "tpu.regions of the wrong kind of parameter": (
        'func.func @f() attributes {tpu.regions = #tpu.regions<"x", 0 : i64, 0 : i64, '
        "0 : i64>} {\nfunc.return\n}\n", "invalid kind of attribute specified"),
    "two optional operands: the segment sizes checked": (
        _func('%0 = "top.layer_norm"(%x, %w) {eps = 1.0e-05 : f64, axis = -1 : i64, '
              "operandSegmentSizes = array<i32: 1, 1, 1>} : "
              "(tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<*xf32>\n"
              "func.return %0 : tensor<*xf32>"), "operandSegmentSizes"),
}


@pytest.mark.slow  # builds the plugin (about a minute of CPU) unless a build is cached
@pytest.mark.parametrize("case", list(CASES))
def test_mlir_opt_with_the_plugin_verifies_and_refuses(plugin: str, case: str) -> None:
    text, error = CASES[case]
    res = run_mlir_opt_with_plugin(text, "-o", os.devnull, plugin=plugin)
    if error is None:
        assert res.returncode == 0, res.stderr[-1500:]
    else:
        assert res.returncode != 0 and error in res.stderr, res.stderr[-1500:]


@pytest.mark.slow
def test_the_command_names_each_file_mlir_refuses(plugin: str, tmp_path, capsys) -> None:
    good, bad = tmp_path / "good.mlir", tmp_path / "bad.mlir"
    good.write_text(_func(RMS.format(eps="1.0e-06 : f64")))
    bad.write_text(_func('"tpu.yield"(%x) : (tensor<1x8x64xf32>) -> ()\nfunc.return',
                         results="()"))
    assert main([str(good)]) == 0
    assert capsys.readouterr().out.strip() == plugin
    assert main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: mlir-opt refuses it" in out and str(good) + ":" not in out
