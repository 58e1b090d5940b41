"""Pre-quantized mixture-of-experts checkpoints written by the real `auto-round`, on the CPU.

A tiny Qwen3-MoE and Qwen2-MoE (`transformers` config classes, seeded random weights, the
WordLevel tokenizer and calibration texts of `quant_fixtures`; nothing downloaded) are
quantized by ``AutoRound(model, scheme="W4A16", group_size=32, sym=True, iters=2, ...,
amp=False, enable_torch_compile=False)`` and saved with ``format="auto_round,fake"``:
auto-round unfuses transformers' fused experts into one linear per expert and writes them
as GPTQ-packed tensors (``model.layers.N.mlp.experts.E.gate_proj.qweight`` ..., packing
``auto_round:auto_gptq``); the router (``mlp.gate``) and Qwen2-MoE's
``shared_expert_gate`` stay float. ``fake`` is the float reference of the same run.
Symmetric: auto-round 0.16.1's export of an asymmetric MoE (packing ``auto_round:auto_awq``)
fails in its AWQ packer (``WQLinear_GEMM.__init__() got an unexpected keyword argument
'weight_dtype'``), so the asymmetric form of a MoE is not written by the producer here.

Generation runs in a child process (as `quant_fixtures`), once per session: a manifest in
the shared directory is reused when its key (this file's hash and the producers' versions)
is current. ``python tests/moe_checkpoints.py OUT_DIR`` makes them by hand.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ARCHS = ("qwen3_moe", "qwen2_moe")
GROUP = 32


def calibrated_linears(arch: str, layers: int = 2, experts: int = 8) -> set[str]:
    """The quantized linears a calibrated tiny MoE checkpoint of `arch` holds: each layer's
    attention projections, every routed expert's three and (Qwen2-MoE) the shared
    expert's three."""
    attention = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    routed = [f"mlp.experts.{e}.{p}" for e in range(experts)
              for p in ("gate_proj", "up_proj", "down_proj")]
    shared = [f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")] \
        if arch == "qwen2_moe" else []
    return {f"model.layers.{i}.{n}" for i in range(layers) for n in attention + routed + shared}


def cache_key() -> dict[str, str]:
    return {"file": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
            **{p: version(p) for p in ("auto-round", "torch", "transformers")}}


def build_model(arch: str) -> Any:
    import torch
    import transformers as tf
    from quant_fixtures import VOCAB

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, num_experts=8)
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)).eval()
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **common, num_experts_per_tok=4, shared_expert_intermediate_size=128)).eval()


def generate(out_root: Path) -> dict[str, Any]:
    import torch
    from auto_round import AutoRound
    from quant_fixtures import build_tokenizer, calibration_texts

    torch.set_float32_matmul_precision("highest")
    manifest: dict[str, Any] = {"key": cache_key(), "runs": {}, "seconds": {}}
    gc.freeze()
    for arch in ARCHS:
        t0 = time.perf_counter()
        ar = AutoRound(build_model(arch), tokenizer=build_tokenizer(), scheme="W4A16",
                       group_size=GROUP, sym=True, iters=2, dataset=calibration_texts(),
                       device_map="cpu", seqlen=32, nsamples=4, amp=False,
                       enable_torch_compile=False)
        _, folders = ar.quantize_and_save(str(out_root / arch), format="auto_round,fake")
        runs = {}
        for f in ([folders] if isinstance(folders, str) else list(folders)):
            qc = json.loads((Path(f) / "config.json").read_text()).get("quantization_config")
            runs["fake" if qc is None else "packed"] = str(f)
        manifest["runs"][arch] = runs
        manifest["seconds"][arch] = round(time.perf_counter() - t0, 2)
        del ar
    gc.unfreeze()
    (out_root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def make(root: Path) -> dict[str, Any]:
    """The checkpoints in `root` (made in a child process unless current ones are there):
    the manifest, ``runs[arch]["packed" | "fake"]`` their directories."""
    from filelock import FileLock

    manifest_path = root / "manifest.json"
    with FileLock(str(root) + ".lock"):
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("key") == cache_key():
                return manifest
        root.mkdir(parents=True, exist_ok=True)
        log = root / "generate.log"
        with open(log, "w") as out:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), str(root)], stdout=out,
                stderr=subprocess.STDOUT, check=False,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                     "HF_DATASETS_OFFLINE": "1"})
        if proc.returncode != 0 or not manifest_path.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"auto-round MoE checkpoint generation failed ({log}):\n{tail}")
        return json.loads(manifest_path.read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(generate(out), indent=1))
