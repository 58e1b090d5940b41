"""`toptpu eval`: perplexity in windows of SEQ equals transformers' on the same windows, a
model file against itself agrees exactly, w4bf16 against f32 differs consistently, and the
text's problems are one line each."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled, hf_model

from toptpu.cli import main
from toptpu.eval_cli import Totals, log_softmax, windows

#: SEQ 48 in chunks of 16 with a history of 24: a window runs two prefill chunks (block,
#: block_kv) and then the decode net token by token (positions 32..47): every path of
#: `Runtime._prefill`
SHAPES = {"seq": 48, "input_len": 16, "history": 24}

TEXT = ("The tensor processor runs the compiled model. Each layer is compiled once, and the "
        "weights stream from memory while the activations stay in local memory. ") * 3


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return compiled(tmp_path_factory, "qwen2", "f32", **SHAPES)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return compiled(tmp_path_factory, "qwen2", "w4bf16", **SHAPES)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def run_eval(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def eval_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_eval(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


_CACHE: dict[tuple[str, ...], dict] = {}


def cached_eval(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """One run per argument list in this module (the f32 evaluation is used twice)."""
    if argv not in _CACHE:
        _CACHE[argv] = eval_json(capsys, *argv)
    return _CACHE[argv]


def hf_perplexity(model_dir: str, ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean NLL) of transformers on non-overlapping windows (written out here, not
    through toptpu.eval_cli)."""
    import torch

    model = hf_model(model_dir)
    nll, n = 0.0, 0
    for s in range(0, len(ids), window):
        w = ids[s:s + window]
        if len(w) < 2:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([w])).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1)
        nll -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
        n += len(w) - 1
    return math.exp(nll / n), n


def test_perplexity_equals_transformers_on_the_same_windows(f32, text_file, capsys) -> None:  # noqa: ANN001
    from toptpu.backend.runtime.runtime import Runtime

    res = cached_eval(capsys, f32.model_file, "--text", text_file, "--quiet")
    ids = Runtime.open(f32.model_file).encode(TEXT)
    assert res["text_tokens"] == len(ids) > 2 * SHAPES["seq"]  # several windows
    assert res["window"] == SHAPES["seq"]
    assert res["windows"] == len(windows(len(ids), SHAPES["seq"])) >= 3
    ppl, n = hf_perplexity(f32.model_dir, ids, SHAPES["seq"])
    assert res["predicted_tokens"] == n
    assert res["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert res["perplexity"] == pytest.approx(math.exp(res["nll"]), rel=1e-12)
    assert res["reference"] is None and res["mode"] == "f32"


def test_against_hf_directory(f32, text_file, capsys) -> None:  # noqa: ANN001
    res = cached_eval(capsys, f32.model_file, "--text", text_file, "--hf", f32.model_dir,
                      "--quiet")
    ref = res["reference"]
    assert ref["kind"] == "hf"
    ppl, _ = hf_perplexity(f32.model_dir, text_ids(f32.model_file), SHAPES["seq"])
    assert ref["perplexity"] == pytest.approx(ppl, rel=1e-9)  # transformers itself
    assert ref["mean_kl"] < 1e-6 and ref["top1_agreement"] == 1.0
    g = ref["greedy"]
    assert g["first_disagreement"] is None and g["model_ids"] == g["reference_ids"]
    assert g["prompt_tokens"] == 8 and len(g["model_ids"]) == g["generated_tokens"] == 16


def text_ids(model_file: str) -> list[int]:
    from toptpu.backend.runtime.runtime import Runtime

    return Runtime.open(model_file).encode(TEXT)


def test_model_file_against_itself(f32, text_file, capsys) -> None:  # noqa: ANN001
    res = cached_eval(capsys, f32.model_file, "--text", text_file, "--reference",
                      f32.model_file, "--quiet")
    ref = res["reference"]
    assert ref["kind"] == "model_file" and ref["path"] == f32.model_file
    assert ref["mean_kl"] == 0.0 and ref["top1_agreement"] == 1.0
    assert ref["perplexity"] == res["perplexity"]
    assert ref["nll_difference"] == 0.0 and ref["nll_difference_stderr"] == 0.0
    usage = open(os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")).read()
    section = usage[usage.index("## `toptpu eval`"):usage.index("## The Python API")]
    for key in [*res, *ref, *ref["greedy"]]:  # every key is in the eval section's table
        assert f"| `{key}` |" in section, key
    assert ref["greedy"]["first_disagreement"] is None
    assert ref["greedy"]["agreeing_tokens"] == ref["greedy"]["generated_tokens"]


def test_w4bf16_against_f32_is_consistent(f32, w4, text_file, capsys) -> None:  # noqa: ANN001
    res = cached_eval(capsys, w4.model_file, "--text", text_file, "--reference",
                      f32.model_file, "--quiet")
    alone_w4 = cached_eval(capsys, w4.model_file, "--text", text_file, "--quiet")
    alone_f32 = cached_eval(capsys, f32.model_file, "--text", text_file, "--quiet")
    ref = res["reference"]
    # each side's perplexity is what it gets evaluated alone
    assert res["perplexity"] == pytest.approx(alone_w4["perplexity"], rel=1e-12)
    assert ref["perplexity"] == pytest.approx(alone_f32["perplexity"], rel=1e-12)
    assert res["mode"] == "w4bf16" and res["perplexity"] != ref["perplexity"]
    assert ref["mean_kl"] > 0
    assert 0.0 <= ref["top1_agreement"] <= 1.0
    # the paired difference is the two nlls' difference, its error finite and positive
    assert ref["nll_difference"] == pytest.approx(res["nll"] - ref["nll"], rel=1e-9)
    assert 0 < ref["nll_difference_stderr"] < abs(ref["nll_difference"]) + 1
    # top-1 agreement counts whole positions of the predicted tokens
    assert ref["top1_agreement"] * res["predicted_tokens"] == pytest.approx(
        round(ref["top1_agreement"] * res["predicted_tokens"]), abs=1e-9)
    g = ref["greedy"]
    d = g["first_disagreement"]
    assert d is None or (0 <= d < g["generated_tokens"]
                         and g["model_ids"][:d] == g["reference_ids"][:d]
                         and g["model_ids"][d] != g["reference_ids"][d])
    assert g["agreeing_tokens"] == sum(
        a == b for a, b in zip(g["model_ids"], g["reference_ids"], strict=True))


def test_the_nll_difference_and_its_error_are_numpy_s_over_the_positions() -> None:
    """Totals added in blocks give the mean and the standard error (ddof 1, over
    positions) of the per-position nll differences as numpy computes them at once."""
    rng = np.random.default_rng(3)
    lp, ref_lp = (log_softmax(rng.standard_normal((50, 11)) * 3) for _ in range(2))
    targets = rng.integers(0, 11, 50)
    tot = Totals()
    for r in (0, 7, 30):  # uneven blocks
        end = {0: 7, 7: 30, 30: 50}[r]
        tot.add(targets[r:end], lp[r:end], ref_lp[r:end])
    d = ref_lp[np.arange(50), targets] - lp[np.arange(50), targets]  # model nll - ref's
    mean, se = tot.nll_difference()
    assert mean == pytest.approx(d.mean(), rel=1e-12)
    assert se == pytest.approx(d.std(ddof=1) / math.sqrt(50), rel=1e-9)
    one = Totals()
    one.add(targets[:1], lp[:1], ref_lp[:1])
    assert one.nll_difference() == (pytest.approx(d[0], rel=1e-12), None)


def test_human_output_and_progress(f32, text_file, capsys) -> None:  # noqa: ANN001
    code, out, err = run_eval(capsys, f32.model_file, "--text", text_file, "--reference",
                              f32.model_file, "--max-tokens", "60")
    assert code == 0, err
    assert "perplexity" in out and "top-1 agreement 1.0000" in out
    assert "first disagreement never" in out
    assert "ln(perplexity / reference's) +0.00000 ± 0.00000 (standard error" in out
    assert "window 1/2 (48 tokens)" in err and "window 2/2 (12 tokens)" in err
    assert "Traceback" not in err


def test_max_tokens_bounds_the_work(f32, text_file, capsys) -> None:  # noqa: ANN001
    res = eval_json(capsys, f32.model_file, "--text", text_file, "--max-tokens", "49",
                    "--quiet")
    # 49 tokens: one window of 48 and a last window of one token, which predicts nothing
    assert res["text_tokens"] == 49 and res["windows"] == 1 and res["predicted_tokens"] == 47


def test_interpreter_executor_matches_machine(f32, text_file, capsys) -> None:  # noqa: ANN001
    a = eval_json(capsys, f32.model_file, "--text", text_file, "--max-tokens", "40",
                  "--quiet", "--executor", "interpreter")
    b = eval_json(capsys, f32.model_file, "--text", text_file, "--max-tokens", "40",
                  "--quiet")
    assert a["executor"] == "interpreter"
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-4)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"  \n\t ", "is empty"),
    (b"caf\xe9 au lait", "is not valid UTF-8 (byte 0xe9 at offset 3)"),
])
def test_bad_texts(content: bytes, message: str, f32, tmp_path, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    code, out, err = run_eval(capsys, f32.model_file, "--text", str(path))
    assert code == 1 and out == ""
    assert err.startswith("toptpu eval: error: --text ") and message in err
    assert str(path) in err and err.count("\n") == 1 and "Traceback" not in err


def test_text_too_short(f32, tmp_path, capsys) -> None:  # noqa: ANN001
    from toptpu.backend.runtime.runtime import Runtime

    one = next(w for w in ("Hello", "a", "The") if len(Runtime.open(f32.model_file).encode(w))
               == 1)
    path = tmp_path / "one.txt"
    path.write_text(one)
    code, out, err = run_eval(capsys, f32.model_file, "--text", str(path))
    assert code == 1 and out == ""
    assert "is 1 token long: perplexity needs at least two tokens" in err
    assert err.count("\n") == 1


def test_missing_and_directory_text(f32, tmp_path, capsys) -> None:  # noqa: ANN001
    code, _, err = run_eval(capsys, f32.model_file, "--text", str(tmp_path / "nope.txt"))
    assert code == 1 and "does not exist" in err and "nope.txt" in err
    code, _, err = run_eval(capsys, f32.model_file, "--text", str(tmp_path))
    assert code == 1 and "is a directory" in err


def test_bad_arguments(f32, text_file, tmp_path, capsys) -> None:  # noqa: ANN001
    code, _, err = run_eval(capsys, f32.model_file, "--text", text_file, "--max-tokens", "1")
    assert code == 2 and "--max-tokens" in err
    code, _, err = run_eval(capsys, f32.model_file, "--text", text_file, "--reference",
                            f32.model_file, "--hf", f32.model_dir)
    assert code == 2 and "not allowed with" in err
    code, _, err = run_eval(capsys, f32.model_file, "--text", text_file, "--hf",
                            str(tmp_path / "none"))
    assert code == 1 and "does not exist" in err and "Traceback" not in err
    code, _, err = run_eval(capsys, str(tmp_path / "none.toptpu"), "--text", text_file)
    assert code == 1 and "none.toptpu" in err and "Traceback" not in err


def test_reference_with_another_vocabulary(f32, text_file, tmp_path, capsys) -> None:  # noqa: ANN001
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    with quiet_transformers():
        other = save_tiny_model(str(tmp_path / "v512"), "qwen2", vocab_size=512)
    code, out, err = run_eval(capsys, f32.model_file, "--text", text_file, "--hf", other,
                              "--quiet")
    assert code == 1 and out == ""
    assert "has a vocabulary of 512 tokens, the model file 384" in err
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- properties


@fuzz_settings(200)
@given(n=st.integers(0, 500), size=st.integers(2, 64))
def test_windows_cover_the_text(n: int, size: int) -> None:
    ws = windows(n, size)
    assert all(2 <= e - s <= size for s, e in ws)
    assert all(a[1] == b[0] for a, b in zip(ws, ws[1:], strict=False))  # adjacent, no overlap
    covered = sum(e - s for s, e in ws)
    assert covered == n or (covered == n - 1 and n % size == 1)  # only a lone last token


@fuzz_settings(15)
@given(data=st.binary(max_size=64))
def test_any_bytes_are_a_result_or_one_line(data: bytes, f32, tmp_path_factory, capsys) -> None:  # noqa: ANN001
    path = os.path.join(str(tmp_path_factory.mktemp("fuzz")), "t.txt")
    with open(path, "wb") as f:
        f.write(data)
    code, out, err = run_eval(capsys, f32.model_file, "--text", path, "--quiet", "--json")
    assert "Traceback" not in err
    if code == 0:
        res = json.loads(out)
        assert res["predicted_tokens"] >= 1 and np.isfinite(res["nll"])
    else:
        assert code == 1 and err.startswith("toptpu eval: error: ") and err.count("\n") == 1


def test_row_blocks_do_not_change_the_numbers(f32, w4, text_file, capsys, monkeypatch) -> None:  # noqa: ANN001
    from toptpu import eval_cli

    argv = (w4.model_file, "--text", text_file, "--reference", f32.model_file, "--quiet")
    whole = cached_eval(capsys, *argv)
    monkeypatch.setattr(eval_cli, "ROWS", 5)  # windows of 47 positions in 10 blocks
    blocks = eval_json(capsys, *argv)
    for key in ("nll", "perplexity"):
        assert blocks[key] == pytest.approx(whole[key], rel=1e-12)
    for key in ("mean_kl", "top1_agreement", "perplexity"):
        assert blocks["reference"][key] == pytest.approx(whole["reference"][key], rel=1e-12)
