"""Real pre-quantized checkpoints, made once per test session by `auto-round` on the CPU.

Each recipe quantizes a fresh tiny `transformers` model (real Qwen2 / Llama config classes,
seeded random weights, a WordLevel tokenizer built with `tokenizers`; nothing downloaded)
with ``AutoRound(model, tokenizer=..., scheme="W4A16", group_size=..., sym=..., iters=2,
dataset=[texts], device_map="cpu", seqlen=..., nsamples=...)`` and
``quantize_and_save(dir, format="<packed formats>,fake")``. The ``fake`` export of the same
run is the float reference: the fake-quantized weights in float32.

Generation runs in ONE child process for all recipes (auto-round sets process-wide state --
environment variables such as CUBLAS_WORKSPACE_CONFIG, torch thread counts and module patches
on some paths -- and the child keeps the test process clean), and only once per session even
under pytest-xdist: workers share a directory next to their base temp dirs and take a file
lock; the first one generates, the others reuse its manifest.

Run ``python tests/quant_fixtures.py OUT_DIR`` to make the checkpoints by hand.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
VOCAB = 256
SEQLEN = 32
NSAMPLES = 4
ITERS = 2
SEED = 0


@dataclass(frozen=True)
class Recipe:
    """One auto-round run: which model, which scheme, which export formats."""

    arch: str  # "qwen2" | "llama"
    group_size: int
    sym: bool
    formats: str
    layer_config: dict[str, dict[str, Any]] = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {
    # GPTQ asym (v1 zero-1 offset) + AWQ gemm, group 32; one layer left at full precision
    "qwen2_asym_g32": Recipe(
        "qwen2", 32, False, "auto_gptq,auto_awq,fake", {"model.layers.1.mlp.up_proj": {"bits": 16}}
    ),
    # The same run again, exported alone as "auto_round": for 4-bit asym, auto-round 0.16.1
    # packs it as auto_round:auto_awq. Exporting it together with "fake" crashes in 0.16.1
    # (the deferred packer calls WQLinear_GEMM(..., weight_dtype=...), which it does not
    # accept); a single-format run packs each block right after tuning and works. The run is
    # deterministic, so its reference is the fake export of "qwen2_asym_g32" (the tests check
    # that the packed tensors equal that run's AWQ export bit for bit).
    "qwen2_asym_g32_autoround": Recipe(
        "qwen2", 32, False, "auto_round", {"model.layers.1.mlp.up_proj": {"bits": 16}}
    ),
    # GPTQ sym + AutoRound (sym -> packing auto_round:auto_gptq), group 64, Llama, one 8-bit layer
    "llama_sym_g64": Recipe(
        "llama",
        64,
        True,
        "auto_gptq,auto_round,fake",
        {"model.layers.0.mlp.down_proj": {"bits": 8}},
    ),
    # per-channel asym; one 8-bit sym layer makes AutoRound fall back from auto_awq to the plain
    # "auto_round" packing (GPTQ layout, zero points stored without offset)
    "qwen2_asym_perchannel": Recipe(
        "qwen2",
        -1,
        False,
        "auto_gptq,auto_round,fake",
        {"model.layers.0.mlp.down_proj": {"bits": 8, "sym": True}},
    ),
}

#: recipe whose fake export is the reference of another recipe (same deterministic run)
REFERENCE_OF: dict[str, str] = {"qwen2_asym_g32_autoround": "qwen2_asym_g32"}


# ----------------------------------------------------------------------------------------------
# generation (runs in the child process)


def build_tokenizer() -> Any:
    """A WordLevel tokenizer over words w0..w252 plus <unk>, <s>, </s> (VOCAB entries)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(VOCAB - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def calibration_texts() -> list[str]:
    """NSAMPLES + 4 texts of SEQLEN + 16 words each (every text is longer than seqlen)."""
    import random

    rng = random.Random(SEED)
    words = [f"w{i}" for i in range(VOCAB - 3)]
    return [" ".join(rng.choice(words) for _ in range(SEQLEN + 16)) for _ in range(NSAMPLES + 4)]


def build_model(arch: str) -> Any:
    """A fresh tiny causal LM with seeded random weights."""
    import torch
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).eval()
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    raise ValueError(f"unknown arch {arch!r}")


def _label(folder: Path) -> str:
    """'fake', 'auto_gptq', 'auto_awq' or 'auto_round', from what the folder's config says."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if qc is None:
        return "fake"
    return {"gptq": "auto_gptq", "awq": "auto_awq", "auto-round": "auto_round"}[qc["quant_method"]]


def generate(out_root: Path) -> dict[str, Any]:
    """Run every recipe into out_root; return (and write) the manifest."""
    from auto_round import AutoRound, __version__

    tokenizer = build_tokenizer()
    texts = calibration_texts()
    manifest: dict[str, Any] = {"auto_round": __version__, "runs": {}, "seconds": {}}
    # auto-round calls gc.collect() often; freezing the imported heap makes a run ~3x faster
    gc.freeze()
    for name, recipe in RECIPES.items():
        t0 = time.perf_counter()
        ar = AutoRound(
            build_model(recipe.arch),
            tokenizer=tokenizer,
            scheme="W4A16",
            group_size=recipe.group_size,
            sym=recipe.sym,
            iters=ITERS,
            dataset=texts,
            device_map="cpu",
            seqlen=SEQLEN,
            nsamples=NSAMPLES,
            layer_config=dict(recipe.layer_config) or None,
        )
        _, folders = ar.quantize_and_save(str(out_root / name), format=recipe.formats)
        folders = [folders] if isinstance(folders, str) else list(folders)
        manifest["runs"][name] = {_label(Path(f)): str(f) for f in folders}
        manifest["seconds"][name] = round(time.perf_counter() - t0, 2)
        del ar
    gc.unfreeze()
    (out_root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/quant_fixtures.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    manifest = generate(out)
    print(json.dumps({"total_seconds": round(time.perf_counter() - t0, 2), **manifest}, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------
# the pytest side


@dataclass
class QuantCheckpoints:
    """Paths of the generated checkpoints: ``path(recipe, "auto_gptq")``, ``reference(recipe)``."""

    root: Path
    manifest: dict[str, Any]
    generate_seconds: float | None  # wall time of the child process, None when reused

    def path(self, recipe: str, fmt: str) -> Path:
        try:
            return Path(self.manifest["runs"][recipe][fmt])
        except KeyError:
            raise KeyError(
                f"no {fmt} export for recipe {recipe}: have {self.manifest['runs'].get(recipe)}"
            ) from None

    def reference(self, recipe: str) -> Path:
        return self.path(REFERENCE_OF.get(recipe, recipe), "fake")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_checkpoints(root: Path) -> QuantCheckpoints:
    """Generate into root (in a child process) unless a complete manifest is already there."""
    manifest_path = root / "manifest.json"
    with _locked(root.parent / (root.name + ".lock")):
        if manifest_path.is_file():
            return QuantCheckpoints(root, json.loads(manifest_path.read_text()), None)
        root.mkdir(parents=True, exist_ok=True)
        log = root / "generate.log"
        t0 = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), str(root)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": "1",  # nothing is downloaded
                    "HF_DATASETS_OFFLINE": "1",
                },
                check=False,
            )
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not manifest_path.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"auto-round checkpoint generation failed (see {log}):\n{tail}")
        return QuantCheckpoints(root, json.loads(manifest_path.read_text()), seconds)


@pytest.fixture(scope="session")
def quant_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> QuantCheckpoints:
    """All recipes' checkpoints, generated once per session (shared by xdist workers)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return make_checkpoints(shared / "quant_checkpoints")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
