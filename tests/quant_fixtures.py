"""Real pre-quantized checkpoints, made once per test session by `auto-round` on the CPU.

Each recipe quantizes a fresh tiny `transformers` model (real Qwen2 / Llama config classes,
seeded random weights, a WordLevel tokenizer built with `tokenizers`; nothing downloaded)
with ``AutoRound(model, tokenizer=..., scheme="W4A16", group_size=..., sym=..., iters=2,
dataset=[texts], device_map="cpu", seqlen=..., nsamples=..., amp=False,
enable_torch_compile=False)`` and ``quantize_and_save(dir, format="<packed formats>,fake")``.
The ``fake`` export of the same run is the float reference: the fake-quantized weights in
float32.

The same on every CPU: by default auto-round tunes and exports in bfloat16 when the CPU has
bf16 instructions (avx512_bf16 / AMX; ``amp=True`` casts the model to bf16 there, to float32
elsewhere), so ``amp=False`` keeps the model, the tuning and every export in float32;
``enable_torch_compile=False`` keeps inductor's ISA-specific kernels out (auto-round turns it
off by itself below 10 iters, but that is a heuristic); torch's float32 matmuls stay at
"highest" precision (no oneDNN bf16 path). Every float tensor of every reference is checked to
be float32 when the fixture is made, so a CPU-dependent reference cannot come back unnoticed.

Generation runs in ONE child process for all recipes (auto-round sets process-wide state --
environment variables such as CUBLAS_WORKSPACE_CONFIG, torch thread counts and module patches
on some paths -- and the child keeps the test process clean), and only once per session even
under pytest-xdist: workers share a directory next to their base temp dirs and take a file
lock; the first one generates, the others reuse its manifest. A manifest is reused only if its
``key`` (this file's hash and the versions of auto-round, torch and transformers) is the
current one; any other is deleted with its checkpoints and made again.

Run ``python tests/quant_fixtures.py OUT_DIR`` to make the checkpoints by hand.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

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

    arch: str  # "qwen2" | "llama" | "qwen3_5"
    group_size: int
    sym: bool
    formats: str
    layer_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: tuning iterations; 0 is round-to-nearest (with `disable_opt_rtn`: plain RTN)
    iters: int = ITERS


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
    # Qwen3.5 (three linear-attention layers, one full-attention layer), round-to-nearest:
    # auto-round 0.16.1's tuning (iters > 0) cannot run a Qwen3.5 model with transformers
    # 5.24 (it feeds every block the first block's 2-D mask, which the full-attention
    # layer's sdpa refuses; docs/limits.md), its RTN mode runs no block forward and writes
    # the checkpoint. GPTQ sym + AutoRound (auto_round:auto_gptq packing), group 32; it
    # leaves in_proj_a/in_proj_b (4 outputs each) in float by itself.
    "qwen3_5_sym_g32_rtn": Recipe("qwen3_5", 32, True, "auto_gptq,auto_round,fake", iters=0),
}

#: recipe whose fake export is the reference of another recipe (same deterministic run)
REFERENCE_OF: dict[str, str] = {"qwen2_asym_g32_autoround": "qwen2_asym_g32"}

#: the dtype of every float tensor of a reference (safetensors' name)
REFERENCE_DTYPE = "F32"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def cache_key() -> dict[str, str]:
    """What the checkpoints depend on: this file (recipes, sizes, options) and the producers."""
    return {
        "fixtures_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        **{pkg: version(pkg) for pkg in ("auto-round", "torch", "transformers")},
    }


def check_reference_dtypes(manifest: dict[str, Any]) -> None:
    """Every float tensor of every fake (reference) export is float32, else RuntimeError."""
    for recipe, folders in manifest["runs"].items():
        if "fake" not in folders:
            continue
        files = sorted(Path(folders["fake"]).glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"reference of {recipe}: no .safetensors in {folders['fake']}")
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    dtype = f.get_slice(key).get_dtype()
                    if dtype in _FLOAT_DTYPES and dtype != REFERENCE_DTYPE:
                        raise RuntimeError(
                            f"reference of {recipe}: {key} in {file} is {dtype}, not "
                            f"{REFERENCE_DTYPE}: auto-round tuned or exported in another dtype "
                            "(amp on a bf16-capable CPU?); the fixture must be float32 everywhere"
                        )


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
    if arch == "qwen3_5":
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, head_dim=16)
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
            **{**common, "num_hidden_layers": 4}, **linear,
            layer_types=["linear_attention"] * 3 + ["full_attention"])).eval()
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
    import torch
    from auto_round import AutoRound

    torch.set_float32_matmul_precision("highest")  # the default, stated: no bf16 matmuls
    tokenizer = build_tokenizer()
    texts = calibration_texts()
    manifest: dict[str, Any] = {"key": cache_key(), "runs": {}, "seconds": {}}
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
            iters=recipe.iters,
            **({"disable_opt_rtn": True} if recipe.iters == 0 else {}),  # plain RTN
            dataset=texts,
            device_map="cpu",
            seqlen=SEQLEN,
            nsamples=NSAMPLES,
            layer_config=dict(recipe.layer_config) or None,
            amp=False,  # float32 on every CPU (else bf16 where the CPU has bf16 instructions)
            enable_torch_compile=False,
        )
        _, folders = ar.quantize_and_save(str(out_root / name), format=recipe.formats)
        folders = [folders] if isinstance(folders, str) else list(folders)
        manifest["runs"][name] = {_label(Path(f)): str(f) for f in folders}
        manifest["seconds"][name] = round(time.perf_counter() - t0, 2)
        del ar
    gc.unfreeze()
    check_reference_dtypes(manifest)
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


def reusable_manifest(manifest_path: Path) -> dict[str, Any] | None:
    """The manifest at manifest_path if it was made by this code and these producers."""
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    return manifest if manifest.get("key") == cache_key() else None


def make_checkpoints(root: Path) -> QuantCheckpoints:
    """Generate into root (in a child process) unless a current manifest is already there."""
    manifest_path = root / "manifest.json"
    with _locked(root.parent / (root.name + ".lock")):
        manifest = reusable_manifest(manifest_path)
        if manifest is not None:
            check_reference_dtypes(manifest)
            return QuantCheckpoints(root, manifest, None)
        shutil.rmtree(root, ignore_errors=True)  # stale or half-made: never mixed with new
        root.mkdir(parents=True)
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
        manifest = json.loads(manifest_path.read_text())
        check_reference_dtypes(manifest)
        return QuantCheckpoints(root, manifest, seconds)


@pytest.fixture(scope="session")
def quant_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> QuantCheckpoints:
    """All recipes' checkpoints, generated once per session (shared by xdist workers)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return make_checkpoints(shared / "quant_checkpoints")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


#: the words of the calibration and held-back texts the tests write (each a token of the tiny
#: tokenizer `build_tokenizer` trains)
WORDS = [f"w{i}" for i in range(240)]


def write_words(path: Any, rng: Any, lines: int) -> None:
    """`lines` lines of 40 words drawn by `rng` (a random.Random) from WORDS into `path`."""
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(40))
                              for _ in range(lines)))
