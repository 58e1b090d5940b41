"""toptpu-opt as mlir-opt users expect it: --help lists toptpu's pipelines and passes with
their options and defaults (xDSL's behind a flag), --time-passes and --print-between-passes
look inside the named pipelines and write to stderr (stdout holds the result alone), and the
output of -o keeps the locations."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import decoder_layer_ir
from toptpu import opt
from toptpu.dialects import context, top
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import WeightStore, store_uri


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = opt.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def top_ir(tiny_models, tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("opt_driver"))
    path = os.path.join(d, "top.mlir")
    with open(path, "w") as f:
        f.write(decoder_layer_ir(tiny_models("qwen2"), d))
    return path


def test_help_lists_pipelines_and_passes_with_options_and_defaults() -> None:
    text = opt.passes_help()
    pipelines, passes = text.split("toptpu passes")
    assert "tpu-pipeline" in pipelines and "top-pipeline" in pipelines
    assert re.search(r"\n\s+group-size: an integer \(default 64\)", pipelines)
    assert re.search(r"\n\s+chip: a string \(default bm1684x\)", pipelines)
    assert "convert-top-to-tpu" in passes and "keep-input-types: true or false (default false)" \
        in passes
    # xDSL's passes are not in the help, but a flag lists them
    assert "riscv" not in text and "stencil" not in text
    rc, out, _ = _run("--list-xdsl-passes")
    assert rc == 0 and "canonicalize" not in out.split() and len(out.split()) > 50


def test_time_passes_looks_inside_pipelines_and_goes_to_stderr(top_ir: str) -> None:
    rc, out, err = _run(top_ir, "-p", "top-pipeline,tpu-pipeline{mode=w4bf16}", "--time-passes",
                        "--weights-out", os.devnull)
    assert rc == 0, err
    rows = re.findall(r"^\s+[0-9.]+\s+[0-9.]+%\s+(\S+)$", err, re.M)
    simplify = ["canonicalize", "fold-constants", "cse"]
    assert rows == ["shape-infer", *simplify, "fuse", *simplify, "convert-top-to-tpu",
                    *simplify, "weight-reorder", "layer-group", "lmem-verify",
                    "address-assign", "total"]
    assert "took" not in out and "timing" not in out and out.lstrip().startswith("builtin.module")


def test_print_between_passes_shows_the_inner_passes_on_stderr(top_ir: str) -> None:
    rc, out, err = _run(top_ir, "-p", "top-pipeline", "--print-between-passes")
    assert rc == 0, err
    assert re.findall(r"// -----// IR after (\S+) //", err) == [
        "shape-infer", "canonicalize", "fold-constants", "cse", "fuse", "canonicalize",
        "fold-constants", "cse"]
    assert "IR after" not in out


def test_output_file_keeps_locations_unless_stripped(top_ir: str, tmp_path) -> None:
    kept, stripped = str(tmp_path / "kept.mlir"), str(tmp_path / "stripped.mlir")
    assert _run(top_ir, "-p", "top-pipeline", "-o", kept)[0] == 0
    assert _run(top_ir, "-p", "top-pipeline", "-o", stripped, "--strip-debuginfo")[0] == 0
    with open(kept) as f:
        text = f.read()
    assert 'loc("layer.self_attn.q_proj' in text and "modeling_qwen2.py" in text
    with open(stripped) as f:
        assert "loc(" not in f.read()
    rc, out, _ = _run(top_ir, "-p", "top-pipeline")  # stdout: as mlir-opt, without
    assert rc == 0 and "loc(" not in out


def test_loads_are_named_after_what_they_load(top_ir: str) -> None:
    """A load of an earlier group's result is named after the op that computed it, never
    after the group (`group.X.load` said nothing of what was loaded)."""
    rc, out, err = _run(top_ir, "-p", "top-pipeline,tpu-pipeline{mode=bf16}", "--weights-out",
                        os.devnull, "--print-debuginfo", "--print-op-generic")
    assert rc == 0, err
    names = re.findall(r'"tpu\.load".*loc\("([^"]+)"', out)
    assert names and not [n for n in names if n.startswith("group.")]
    assert any(n.startswith("layer.self_attn.") and n.endswith(".load") for n in names)


def test_ir_printed_between_passes_names_a_store_that_holds_its_tensors(top_ir: str,
                                                                         tmp_path) -> None:
    """Every module printed between passes can be cut out and run on its own: once the
    passes derived tensors (quantized weights, transposes), it names the companion file,
    which holds the tensors of every printed module, not only the result's."""
    out = str(tmp_path / "out.mlir")
    rc, _, err = _run(top_ir, "-p", "top-pipeline,tpu-pipeline{mode=w4bf16}",
                      "--print-between-passes", "-o", out)
    assert rc == 0, err
    printed = re.split(r"^// -----// IR after (\S+) //----- //$", err, flags=re.M)[1:]
    modules = dict(zip(printed[0::2], printed[1::2], strict=True))  # the last of a name
    assert "convert-top-to-tpu" in modules and "layer-group" in modules
    companion = os.path.abspath(str(tmp_path / "out.weights.safetensors"))
    for after, text in zip(printed[0::2], printed[1::2], strict=True):
        module = parse_ir(text.encode(), after, context())
        store = WeightStore.open(store_uri(module))
        named = {op.tensor_name for op in module.walk() if isinstance(op, top.WeightBase)}
        assert named and not named - set(store.names()), (after, sorted(named - set(
            store.names()))[:3])
        if after == "convert-top-to-tpu":
            assert store_uri(module) == companion
    # the module after convert-top-to-tpu, cut out, runs the next pass on its own
    cut = tmp_path / "after_convert.mlir"
    cut.write_text(modules["convert-top-to-tpu"])
    rc, _, err = _run(str(cut), "-p", "weight-reorder", "-o", str(tmp_path / "reordered.mlir"))
    assert rc == 0, err


def test_printing_derived_ir_to_stderr_needs_a_weights_file(top_ir: str) -> None:
    """Without -o or --weights-out there is no file for the derived tensors a printed
    module names: one line saying so, before the result."""
    rc, out, err = _run(top_ir, "-p", "convert-top-to-tpu{mode=w8bf16},canonicalize",
                        "--print-between-passes")
    assert rc == 1 and out == ""
    assert "printed after convert-top-to-tpu" in err and "--weights-out" in err


def test_every_option_of_toptpu_opt_has_a_help_text() -> None:
    tool = opt.ToptpuOptMain(args=["in.mlir"])
    parser = argparse.ArgumentParser()
    tool.register_all_arguments(parser)
    bare = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
    assert not bare, bare


def test_a_layers_pipelines_import_no_torch_transformers_or_mlir(top_ir: str, tmp_path
                                                                 ) -> None:
    """The issue's path, in a fresh interpreter: a one-layer top-pipeline and tpu-pipeline
    (reading the weight store, deriving quantized weights) and the command streams with
    their cycles load none of the heavy packages (start-up stays well under a second)."""
    out = str(tmp_path / "tpu.mlir")
    script = f"""
import json, sys
from toptpu import opt
rc = opt.main([{top_ir!r}, "-p", "top-pipeline,tpu-pipeline{{mode=w4bf16}}", "-o", {out!r}])
rc2 = opt.main([{out!r}, "-t", "commands", "-o", {str(tmp_path / "cmds.txt")!r}])
print(json.dumps({{"rc": [rc, rc2], "modules": sorted(sys.modules)}}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rc"] == [0, 0]
    heavy = ("torch", "transformers", "mlir", "PIL", "jinja2", "tokenizers", "ray")
    loaded = [m for m in report["modules"] if m.split(".")[0] in heavy]
    assert not loaded, f"toptpu-opt loaded {loaded[:5]}"
    assert "cycles=" in (tmp_path / "cmds.txt").read_text()


#: what `toptpu-opt FILE -p top-pipeline` has no use for, and so never imports (its start-up,
#: issue 43): the Tpu level's passes, the linalg lowering and the dialects it makes, the
#: targets of -t commands / -t mlir-generic (codegen, the machine, the file formats, the IRDL
#: export), the frontends and the driver
TOP_PIPELINE_NEVER_LOADS = (
    "toptpu.passes.convert_top_to_tpu", "toptpu.passes.weight_reorder",
    "toptpu.passes.layer_group", "toptpu.passes.address_assign", "toptpu.passes.pipelines",
    "toptpu.passes.convert_top_to_linalg", "toptpu.passes.mlir_pipeline",
    "toptpu.passes.tensor_parallel", "xdsl.dialects.linalg", "xdsl.dialects.tensor",
    "xdsl.dialects.math", "xdsl.dialects.arith", "toptpu.opt_targets",
    "toptpu.backend.codegen", "toptpu.backend.formats.model_file",
    "toptpu.backend.formats.llm_file", "toptpu.backend.formats.program",
    "toptpu.backend.formats.commands", "toptpu.backend.runtime",
    "toptpu.dialects.irdl_export", "toptpu.frontends", "toptpu.compiler",
    "torch", "transformers", "mlir")


def test_a_top_pipeline_imports_only_the_passes_it_runs(top_ir: str) -> None:
    """In a fresh interpreter, `toptpu-opt FILE -p top-pipeline` imports the passes it runs
    (the registry names the others: their modules are imported when named) and nothing of
    `TOP_PIPELINE_NEVER_LOADS`; `-t commands` and `--help` still find what they need."""
    script = f"""
import json, sys
from toptpu import opt
rc = opt.main([{top_ir!r}, "-p", "top-pipeline", "-o", {os.devnull!r}])
print(json.dumps({{"rc": rc, "modules": sorted(sys.modules)}}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert {"toptpu.passes.shape_infer", "toptpu.passes.fold_constants",
            "toptpu.passes.fuse"} <= set(report["modules"])  # the pipeline ran
    loaded = [m for m in report["modules"] if any(
        m == n or m.startswith(n + ".") for n in TOP_PIPELINE_NEVER_LOADS)]
    assert not loaded, f"toptpu-opt -p top-pipeline loaded {loaded}"


def test_the_pass_registry_names_each_pass_by_its_own_name() -> None:
    """Every registered name imports the pass of that name; the named pipelines are the
    passes with `inner_passes`."""
    from toptpu.passes.registry import PASSES, PIPELINE_NAMES

    for name, get in PASSES.items():
        assert get().name == name
    from toptpu.pass_pipeline import (
        CONVERT,
        DEFAULT_TPU,
        MACHINE_PASS_NAMES,
        default_tpu_passes,
        spec_text,
    )

    assert {CONVERT, *MACHINE_PASS_NAMES} <= set(PASSES)  # the compile's stages name them
    assert DEFAULT_TPU == spec_text(default_tpu_passes())
    assert {n for n, get in PASSES.items() if hasattr(get(), "inner_passes")} == set(
        PIPELINE_NAMES)


def test_help_lists_mlir_opts_words() -> None:
    """--help names mlir-opt's flags toptpu-opt takes (FileCheck tests: opt_print_ir.mlir,
    opt_pipeline_syntax.mlir, verify_diagnostics.mlir)."""
    tool = opt.ToptpuOptMain(args=["in.mlir"])
    parser = argparse.ArgumentParser()
    tool.register_all_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag in ("--mlir-print-ir-before PASS", "--mlir-print-ir-after PASS",
                 "--mlir-print-ir-before-all", "--mlir-print-ir-after-all",
                 "--pass-pipeline PIPELINE", "--split-input-file", "--verify-diagnostics",
                 "--print-between-passes", "mlir-generic"):
        assert flag in text, flag
    assert "'-' or none: stdin" in text and "builtin.module(top-pipeline," in text
    assert "expected-" in text and "@above" in text
