"""`toptpu compile --from-ir DIR` (`toptpu.from_ir`): a `--dump-ir` directory, edited at any
stage or not, compiled to a model file that run, eval, chat and profile take.

One dump of the tiny Qwen2 (f32) is made per session; each test edits a copy of it."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
from filelock import FileLock
from llm_fixtures import shared_dir, tiny_dir

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main
from toptpu.compiler import compile as compile_model

pytestmark = pytest.mark.slow

#: the block's silu in the Top IR after top-pipeline (as the dump prints it: its custom
#: form), and the hand edit in the generic form: x * sigmoid(x)
SILU = ('    %silu = top.silu %linear_4 : tensor<1x16x192xf32> -> tensor<1x16x192xf32> '
        'loc("layer.mlp.act_fn.silu"("transformers/activations.py":103:0))')
EXPANDED = ('    %gate = "top.sigmoid"(%linear_4) : (tensor<1x16x192xf32>) -> '
            'tensor<1x16x192xf32> loc("layer.mlp.act_fn.sigmoid")\n'
            '    %silu = "top.mul"(%linear_4, %gate) : (tensor<1x16x192xf32>, '
            'tensor<1x16x192xf32>) -> tensor<1x16x192xf32> loc("layer.mlp.act_fn.silu")')
TOP_FILE = os.path.join("block", "08-cse.mlir")
#: the block's last output in the signature, and without it
DROP_FROM = ', tensor<1x16x2x16xf32> {top.name = "present_v"})'
DROP_TO = ")"


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the dump directory, the model file of the compile that wrote it)."""
    base = os.path.join(shared_dir(tmp_path_factory), "from-ir")
    with FileLock(base + ".lock"):
        if not os.path.exists(os.path.join(base, "done")):
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base)
            compile_model(tiny_dir(tmp_path_factory, "qwen2"), os.path.join(base, "m.toptpu"),
                          seq_length=64, max_input_length=16,
                          dump_ir=os.path.join(base, "ir"), progress=None)
            open(os.path.join(base, "done"), "w").close()
    return os.path.join(base, "ir"), os.path.join(base, "m.toptpu")


def _copy(dump: str, tmp_path) -> str:  # noqa: ANN001
    out = str(tmp_path / "ir")
    shutil.copytree(dump, out)
    return out


def _edit(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert text.count(old) == 1, f"{path} no longer holds the line this test edits"
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def _differing(a: str, b: str) -> list[str]:
    fa, fb = LlmFile(a).file, LlmFile(b).file
    assert sorted(fa.sections) == sorted(fb.sections)
    return sorted(s for s in fa.sections if fa.read(s) != fb.read(s))


def test_an_unedited_dump_compiles_to_the_model_file_the_dump_came_with(
        dumped: tuple[str, str], tmp_path) -> None:
    dump, original = dumped
    out = str(tmp_path / "again.toptpu")
    assert main(["compile", "--from-ir", dump, "-o", out, "--quiet"]) == 0
    assert _differing(original, out) == []  # every IR, stream, constant pool and weight
    a, b = LlmFile(original).meta, LlmFile(out).meta
    assert a.nets == b.nets  # IO, weights, commands, and the passes each net ran
    assert b.compile.from_ir is not None and not any(
        s.edited for s in b.compile.from_ir.nets.values())
    assert b.compile.from_ir.nets["block"].file == "block/13-weight-reorder.mlir"


def test_an_edited_top_ir_compiles_and_runs_differing_only_as_the_edit_implies(
        dumped: tuple[str, str], tmp_path, capsys) -> None:
    dump, original = dumped
    edited = _copy(dump, tmp_path)
    _edit(os.path.join(edited, TOP_FILE), SILU, EXPANDED)
    out = str(tmp_path / "edited.toptpu")
    assert main(["compile", "--from-ir", edited, "-o", out]) == 0
    assert f"from {edited}: edited block/08-cse.mlir" in capsys.readouterr().err
    # only the block net changed, and only by the edit: sigmoid and mul for silu
    assert _differing(original, out) == ["ir:block", "stream:block"]
    f = LlmFile(out)
    ir = f.net_ir("block")
    assert "tpu.silu" not in ir and ir.count("tpu.sigmoid") == 1
    assert "tpu.silu" in LlmFile(original).net_ir("block")
    assert f.meta.compile.from_ir is not None
    picked = f.meta.compile.from_ir.nets["block"]
    assert picked.file == "block/08-cse.mlir" and picked.edited
    # the same function computed another way: prefill logits to f32 rounding, not bit-equal
    ra, rb = Runtime.open(original), Runtime.open(out)
    ids = ra.encode("Hello world! The tensor processor runs the model.")[:16]
    la, lb = ra.sequence_logits(ids), rb.sequence_logits(ids)
    assert not np.array_equal(la, lb) and np.abs(la - lb).max() < 1e-4
    # usable by run, eval, profile and chat
    assert main(["run", out, "--prompt", "Hello world", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generated_ids"]) == 4
    text = tmp_path / "t.txt"
    text.write_text("The tensor processor runs the compiled model. " * 3)
    assert main(["eval", out, "--text", str(text), "--reference", original, "--json",
                 "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reference"]["top1_agreement"] == 1.0 and result["reference"]["mean_kl"] < 1e-6
    assert main(["profile", out]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"compiled with pipeline options: default; from the dump {edited} "
                            "(edited block/08-cse.mlir)")
    assert main(["info", out]) == 0
    assert "block from block/08-cse.mlir (edited)" in capsys.readouterr().out


def test_an_edit_that_breaks_the_contract_is_refused_in_one_line(
        dumped: tuple[str, str], tmp_path, capsys) -> None:
    dump, _ = dumped
    out = tmp_path / "bad.toptpu"
    for old, new, problem in [
            ('{top.name = "hidden_out"}', '{top.name = "out"}',
             "renamed output 'hidden_out' to 'out'"),
            (DROP_FROM, DROP_TO, "dropped output 'present_v'"),
            ("%attention_mask: tensor<1x1x16x16xf32>", "%attention_mask: tensor<1x1x16x16xf16>",
             None)]:
        edited = _copy(dump, tmp_path / str(len(os.listdir(tmp_path))))
        if old is DROP_FROM:  # the last output gone from the signature and the return
            _edit(os.path.join(edited, TOP_FILE), old, new)
            path = os.path.join(edited, TOP_FILE)
            with open(path) as f:
                text = re.sub(r"(func\.return [^:]*), %\w+ : (.*), tensor<1x16x2x16xf32>",
                              r"\1 : \2", f.read())
            with open(path, "w") as f:
                f.write(text)
        else:
            _edit(os.path.join(edited, TOP_FILE), old, new)
        code = main(["compile", "--from-ir", edited, "-o", str(out), "--quiet"])
        err = capsys.readouterr().err
        assert code == 1 and not out.exists() and err.count("\n") == 1, err
        if problem is not None:
            assert err == ("toptpu compile: error: net 'block': the edited file "
                           f"block/08-cse.mlir breaks the net contract: it {problem} (the "
                           "runtime binds each net's inputs and outputs by name, shape and "
                           "type: backend/contract.py)\n")
        else:  # a retyped input whose uses no longer verify: the file is refused as it is
            assert err.startswith("toptpu compile: error: block/08-cse.mlir:"), err


def test_which_stage_each_net_is_picked_up_at(dumped: tuple[str, str], tmp_path,
                                              capsys) -> None:
    dump, original = dumped
    edited = _copy(dump, tmp_path)
    _edit(os.path.join(edited, TOP_FILE), SILU, EXPANDED)
    tpu_file = os.path.join(edited, "block", "13-weight-reorder.mlir")
    with open(tpu_file, "a") as f:
        f.write("// a comment: the file differs from what the dump wrote\n")
    out = str(tmp_path / "m.toptpu")
    assert main(["compile", "--from-ir", edited, "-o", out, "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "toptpu compile: error: net 'block': 2 files are edited (block/08-cse.mlir, "
        "block/13-weight-reorder.mlir); name the one to compile from with --ir-stage "
        "block=NN\n")
    # named: the Tpu file (the same IR as dumped but for the comment), the grouped IR of
    # another net
    assert main(["compile", "--from-ir", edited, "-o", out, "--quiet", "--ir-stage",
                 "block=13", "--ir-stage", "block_cache=16-address-assign.mlir"]) == 0
    assert _differing(original, out) == ["ir:block_cache"]  # grouped IR kept, same streams
    f = LlmFile(out)
    assert "tpu.group" in f.net_ir("block_cache")
    for executor in ("interpreter", "machine"):
        rt, ref = Runtime.open(out, executor), Runtime.open(original, executor)
        ids = rt.encode("Hello world")
        assert rt.generate(ids, 6).generated_ids == ref.generate(ids, 6).generated_ids
    for argv, message in [
            (["--ir-stage", "block=99"], "--ir-stage block=99: the net has no such stage"),
            (["--ir-stage", "nothing=01"], "--ir-stage nothing=...: the model has no net "
             "'nothing'"),
            (["--ir-stage", "block"], "--ir-stage 'block': give NET=STAGE"),
            (["-q", "bf16"], "--from-ir compiles with the request of the dump (its "
             "compile.json); drop --quantize")]:
        assert main(["compile", "--from-ir", edited, "-o", out, "--quiet", *argv]) in (1, 2)
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_a_dump_without_what_from_ir_needs_is_one_line(dumped: tuple[str, str], tmp_path,
                                                       capsys, tmp_path_factory) -> None:
    dump, _ = dumped
    out = str(tmp_path / "m.toptpu")
    moved = _copy(dump, tmp_path)
    with open(os.path.join(moved, "compile.json")) as f:
        data = json.load(f)
    data["source"] = str(tmp_path / "gone")
    with open(os.path.join(moved, "compile.json"), "w") as f:
        json.dump(data, f)
    assert main(["compile", "--from-ir", moved, "-o", out, "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"toptpu compile: error: {moved}/compile.json names the model {tmp_path / 'gone'}, "
        "which no longer exists: give its path (toptpu compile MODEL --from-ir DIR)\n")
    tiny = data["source"] = tiny_dir(tmp_path_factory, "qwen2")  # given: found
    assert main(["compile", tiny, "--from-ir", moved, "-o", out, "--quiet"]) == 0
    assert LlmFile(out).meta.compile.source == tiny
    os.remove(os.path.join(moved, "compile.json"))
    os.remove(out)
    assert main(["compile", "--from-ir", moved, "-o", out, "--quiet"]) == 1
    assert "has no compile.json: it is not the --dump-ir directory of a compile that " \
        "finished" in capsys.readouterr().err
    assert main(["compile", "--from-ir", str(tmp_path / "nowhere"), "-o", out]) == 1
    assert "is not a directory (give a --dump-ir directory)" in capsys.readouterr().err
    assert not os.path.exists(out)
