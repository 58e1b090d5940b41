"""Property-based fuzzing of the command line's argument values (hypothesis).

`toptpu run`: token id strings, seeds, temperatures, top-k/top-p, max-new-tokens and prompts
with arbitrary Unicode (lone surrogates included, as Python passes undecodable argv bytes).
`toptpu compile`: sequence lengths, group sizes, modes, chips and output paths (inside the
input directory, existing directories and files, missing parents, devices).

Every example ends in status 0 with a correct result (run: the tokens of the runtime API
for the same values; compile: a model file with the shapes asked for), or in one
`toptpu CMD: error:` line (status 1, or 2 for argparse's refusal of a value) — never a
traceback — and no file appears or changes anywhere but at the output path. Commands run
in process (`toptpu.cli.main`) against one small compiled model file. A compile that
passes every check reaches the model load; there one example in 25 (drawn with the
example, so a replay does the same) and one fixed example go on to compile for real, the
others stop: what is fuzzed is the checks, which must all come before the load.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
from typing import Any

import pytest
from fuzz import fuzz_settings
from hypothesis import event, example, given
from hypothesis import strategies as st
from llm_fixtures import compiled, tiny_dir
from test_cli_errors import SEQ64, assert_one_error, tree

from toptpu.backend.runtime.runtime import Runtime, SamplingConfig
from toptpu.cli import main

pytestmark = pytest.mark.slow  # hypothesis runs the command line many times


JUNK = ["", " ", "x", "nan", "-nan", "inf", "-inf", "1e999", "0x10", "1_0", "١٢", "+",
        "--", "9" * 5000, "1.5", "-0", "\udcff"]


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]
           ) -> st.SearchStrategy[str]:
    """A value's text: 5 in 6 from `valid`, else from `other` or junk that is no number."""
    return st.integers(0, 5).flatmap(lambda i: valid.map(str) if i else st.one_of(
        other.map(str), st.sampled_from(JUNK)))


def prompt_text() -> st.SearchStrategy[str]:
    """Short text over all of Unicode and control characters; one in three holds a lone
    surrogate (U+DC80..U+DCFF is how Python passes an undecodable argv byte)."""
    text = st.text(st.characters(exclude_characters="\x00"), max_size=16)
    surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    return st.integers(0, 2).flatmap(lambda i: text if i else st.tuples(
        text, surrogate, text).map("".join))


ID_TEXT = st.one_of(
    st.lists(st.integers(-3, 400), max_size=5).flatmap(
        lambda ids: st.sampled_from([", ", " ", ","]).map(lambda sep: sep.join(map(str, ids)))),
    st.text("0123456789 ,-+.x", max_size=10))

RUN_OPTIONS = {
    "seed": mostly(st.integers(0, 2**70), st.integers(-2**70, -1)),
    "temperature": mostly(st.one_of(st.just(0.0), st.floats(0, 3), st.sampled_from(
        [1e-40, 5e-324, 1e30])), st.floats()),
    "top-k": mostly(st.integers(0, 500), st.integers(-2, -1)),
    "top-p": mostly(st.one_of(st.floats(0, 1, exclude_min=True), st.just(1e-300)),
                    st.floats(-0.5, 1.5)),
    "repetition-penalty": mostly(st.floats(0.5, 2.0), st.floats(-1, 1e6)),
    "max-new-tokens": mostly(st.one_of(st.integers(1, 4), st.just(10**6)), st.integers(-2, 0)),
}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shared compiled model, copied into a directory of its own: the tests check that
    nothing is written beside it, and other workers compile into the shared directory."""
    own = tmp_path_factory.mktemp("cli_fuzz_model")
    path = str(own / "model.toptpu")
    shutil.copyfile(compiled(tmp_path_factory, "qwen2", **SEQ64).model_file, path)
    return path


@pytest.fixture(scope="module")
def reference(model_file: str) -> Runtime:
    return Runtime.open(model_file, "interpreter")


def _parsed(text: str, kind: type) -> Any:
    """How Python itself reads the value (the test's independent reading)."""
    return kind(text.strip())


def _expected_run(rt: Runtime, source: tuple[str, str], options: dict[str, str]) -> Any:
    """The runtime API's result for the values the command accepted."""
    kind, text = source
    ids = ([int(x) for x in text.replace(",", " ").split()] if kind == "ids" else
           rt.encode(text))
    cfg = SamplingConfig(
        _parsed(options.get("temperature", "0"), float),
        _parsed(options.get("top-k", "0"), int),
        _parsed(options.get("top-p", "1"), float),
        _parsed(options.get("repetition-penalty", "1"), float),
        64, _parsed(options["seed"], int) if "seed" in options else None)
    return ids, cfg, _parsed(options.get("max-new-tokens", "128"), int)


@fuzz_settings(60)
@given(source=st.one_of(ID_TEXT.map(lambda t: ("ids", t)), prompt_text().map(
           lambda t: ("prompt", t))),
       options=st.dictionaries(st.sampled_from(sorted(RUN_OPTIONS)), st.just(None)).flatmap(
           lambda keys: st.fixed_dictionaries({k: RUN_OPTIONS[k] for k in keys})))
def test_run_arguments(model_file, reference, tmp_path, monkeypatch, capsys, source,
                       options) -> None:
    monkeypatch.chdir(tmp_path)
    files = tree(os.path.dirname(model_file)), tree(str(tmp_path))
    kind, text = source
    argv = ["run", model_file, "--json", "--executor", "interpreter", f"--{kind}={text}",
            *(f"--{k}={v}" for k, v in options.items())]
    code = main(argv)
    out, err = capsys.readouterr()
    event(f"status {code}" + (": " + err.splitlines()[-1][:60] if code else ""))
    assert (tree(os.path.dirname(model_file)), tree(str(tmp_path))) == files
    if code != 0:
        assert_one_error(code, err, "run", "", code)
        assert out == ""
        return
    assert "Traceback" not in err
    data = json.loads(out)
    ids, cfg, max_new = _expected_run(reference, source, options)
    assert data["prompt_ids"] == ids
    assert 1 <= len(data["generated_ids"]) <= max_new
    assert all(0 <= t < 384 for t in data["generated_ids"])
    if cfg.temperature == 0 or cfg.seed is not None:  # deterministic: the API's tokens
        res = reference.generate(ids, max_new, cfg)
        # the CLI's text leaves special tokens out (run --json schema 2)
        shown = reference.tokenizer.decode(res.generated_ids, skip_special_tokens=True)
        assert data["generated_ids"] == res.generated_ids and data["text"] == shown
        assert data["stop_reason"] == res.stop_reason


# --------------------------------------------------------------------------- compile


class StoppedAtLoad(Exception):  # noqa: N818 - a signal of the test, not an error
    """Raised in place of the model load by examples that do not compile for real."""


OUTPUTS = ["new", "existing_file", "inside_input", "inside_input_new", "input_dir",
           "existing_dir", "missing_parent", "file_parent", "dev_null", "empty", "trailing_sep"]
DUMPS = [None, None, "new_dir", "existing_file", "inside_input", "output_dir"]


@pytest.fixture
def workspace(tmp_path_factory: pytest.TempPathFactory, tmp_path) -> dict[str, str]:
    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_dir(tmp_path_factory, "qwen2"), ck)
    os.makedirs(tmp_path / "out")
    (tmp_path / "out" / "existing.toptpu").write_bytes(b"old")
    (tmp_path / "file.txt").write_text("x")
    return {"root": str(tmp_path), "ck": ck}


def _output(kind: str, ws: dict[str, str]) -> str:
    root, ck = ws["root"], ws["ck"]
    return {"new": f"{root}/out/m.toptpu", "existing_file": f"{root}/out/existing.toptpu",
            "inside_input": f"{ck}/model.safetensors", "inside_input_new": f"{ck}/m.toptpu",
            "input_dir": ck, "existing_dir": f"{root}/out",
            "missing_parent": f"{root}/nope/m.toptpu", "file_parent": f"{root}/file.txt/m",
            "dev_null": os.devnull, "empty": "", "trailing_sep": f"{root}/out/m.toptpu/"}[kind]


def _dump(kind: str | None, ws: dict[str, str]) -> str | None:
    root, ck = ws["root"], ws["ck"]
    return None if kind is None else {"new_dir": f"{root}/dump", "existing_file":
                                      f"{root}/file.txt", "inside_input": f"{ck}/dump",
                                      "output_dir": f"{root}/out"}[kind]


@fuzz_settings(100)
@given(seq=mostly(st.integers(2, 40), st.one_of(st.integers(-2, 1),
                                                 st.sampled_from([1024, 1025, 10**9]))),
       input_len=st.none() | mostly(st.integers(1, 40), st.integers(-1, 0)),
       group=st.none() | st.sampled_from(["-1", "0", "-2", "7", "16", "64", "x", "1e2"]),
       mode=st.none() | st.sampled_from(["f32", "bf16", "w8f16", "w4f32", "w4bf16", "w3",
                                         "auto", "F32", ""]),
       chip=st.none() | st.sampled_from(["bm1684x", "bm1688", "h100", ""]),
       symmetric=st.booleans(), output=st.sampled_from(OUTPUTS), dump=st.sampled_from(DUMPS),
       real=st.integers(0, 24).map(lambda i: i == 0))
@example(seq="24", input_len="8", group="32", mode="w4bf16", chip="bm1688", symmetric=False,
         output="existing_file", dump="new_dir", real=True)
def test_compile_arguments(workspace, monkeypatch, capsys, seq, input_len, group, mode, chip,
                           symmetric, output, dump, real) -> None:
    import toptpu.compiler

    real_load = toptpu.compiler._load

    def load(*args: Any, **kw: Any) -> Any:
        if not real:
            raise StoppedAtLoad
        return real_load(*args, **kw)

    monkeypatch.setattr(toptpu.compiler, "_load", load)
    root = workspace["root"]
    before = tree(root)
    out, dump_dir = _output(output, workspace), _dump(dump, workspace)
    argv = ["compile", workspace["ck"], f"-o={out}", f"--seq-length={seq}", "--quiet"]
    for flag, value in (("--max-input-length", input_len), ("--group-size", group),
                        ("-q", mode), ("--chip", chip), ("--dump-ir", dump_dir)):
        if value is not None:
            argv.append(f"{flag}={value}")
    if symmetric:
        argv.append("--symmetric")
    try:
        code = main(argv)
    except StoppedAtLoad:  # every check passed; nothing may have been written yet
        event("passed the checks, stopped at the load")
        capsys.readouterr()
        assert tree(root) == before
        return
    _, err = capsys.readouterr()
    event(f"status {code}" + (": " + err.splitlines()[-1][:60] if code else ""))
    after = tree(root)
    if code != 0:
        assert_one_error(code, err, "compile", "", code)
        assert after == before
        return
    if output == "dev_null":  # written through: nothing changed, still the device
        assert after == before and stat.S_ISCHR(os.stat(out).st_mode)
        return
    # a real compile: the model file has the shapes asked for, and nothing else changed
    rel_out = os.path.relpath(out, root)
    rel_dump = os.path.relpath(dump_dir, root) if dump_dir else None
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert rel_out in changed
    assert all(p == rel_out or (rel_dump and (p + "/").startswith(rel_dump + "/"))
               for p in changed), changed
    rt = Runtime.open(out, "interpreter")
    seq_length = int(seq)
    assert rt.seq == seq_length and rt.L == (int(input_len) if input_len else
                                             min(seq_length, 128))
    assert rt.header["mode"] == (mode or "f32") and rt.header["chip"] == (chip or "bm1684x")
    assert math.isfinite(rt.prompt_logits([1, 2]).sum())
    # restore the workspace for the next example
    if output == "existing_file":
        with open(out, "wb") as f:
            f.write(b"old")
    else:
        os.remove(out)
    if dump == "new_dir":
        shutil.rmtree(dump_dir)
    assert tree(root) == before
