"""Compile at real model sizes: Qwen2.5-shaped checkpoints (0.5B, 1.5B, 7B, 14B, 72B) and
Qwen3.5-shaped ones (qwen3.5-2B, qwen3.5-4B, qwen3.5-9B: hybrid linear/full attention) with
random bf16 weights, compiled by streaming (one layer in memory at a time), for one device or
spread over several (`--devices N --parallel tp|pp`: every device's blob cut from one read
of each layer).

Checkpoints: the published Qwen2.5 base configs' dimensions and the Qwen3.5 text configs of
bench/configs (written from the configs, no download), random bf16 weights written shard by
shard like a real checkpoint (`model-0000i-of-0000n.safetensors` +
`model.safetensors.index.json`), without a model object:
the tensor names and shapes come from transformers' own model built on the meta device, and
every tensor is generated and written in row blocks, so writing takes memory bounded by one
block (`BLOCK_ELEMENTS`). The tokenizer is toptpu's tiny built-in byte-level BPE (384
tokens; the model's vocabulary stays the real one), so eos is that tokenizer's `<|im_end|>`.

Random weights: sign and 7 mantissa bits uniform, the exponent fixed, so matrices and biases
have magnitudes in [1/64, 1/32) and norms in [1, 2): cheap to draw (integers, no float
math), spread over every quantization group.

Mixtures of experts (`qwen3-30B-A3B`, `35B-A3B-widths`: `QWEN3_MOE`, `qwen3_moe` configs)
are written in the hub layout `save_pretrained` writes: one tensor per expert and
projection (`model.layers.N.mlp.experts.E.gate_proj.weight`), 768 tensors a layer at 256
experts.

Compile: each size in its own subprocess (`toptpu.compile`, w4bf16, seq 512 by default,
`--max-input-length` as compile's default unless given); wall time and the subprocess's
peak RSS (getrusage RUSAGE_CHILDREN), and the machine's load average before and after (the
machine may be shared). Printed: the table
(size | weights GB | compile s | peak RSS GB | file GB | largest layer MB) and the 7B / 1.5B
time ratio against their weight ratio (linear compile: time ratio / weight ratio near 1).

Run: python bench/scale.py [--sizes 0.5B,1.5B,7B] [--dir /work/scale-ckpt] [--mode w4bf16]
         [--seq 512] [--max-input-length L] [--keep]
         (checkpoints and model files are deleted unless --keep)
         [--layers N]            (the first N layers of each shape: a 72B's layers at a disk
                                  size this host has; memory is per layer either way)
         [--devices 8 --parallel tp|pp]
     python bench/scale.py --sizes qwen3.5-9B --seq 2048 --max-input-length 1024
     python bench/scale.py --sizes 35B-A3B-widths --layers 2     (and --layers 4)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from toptpu.paths import open_output, write_output

#: the published Qwen2.5 base models' dimensions (config.json of Qwen/Qwen2.5-*)
QWEN25: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False, rms_norm_eps=1e-6),
    "14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False, rms_norm_eps=1e-5),
    # the intermediate size as Qwen's quantized releases pad it (Qwen2.5-72B-Instruct-AWQ:
    # 29696, not 29568), so a w4 group of 64 divides each device's part on 8
    "72B": dict(hidden_size=8192, intermediate_size=29696, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False, rms_norm_eps=1e-5),
}
#: the Qwen3.5 text configs (bench/configs/<name>/config.json, their sources in its README)
QWEN35 = ("qwen3.5-2B", "qwen3.5-4B", "qwen3.5-9B")
#: mixtures of experts as `qwen3_moe` configs: Qwen3-30B-A3B's published config, and
#: Qwen3.5-35B-A3B's text widths (hidden 2048, 16/2 heads of 256, 256 experts of 512, top-8,
#: vocabulary 248320) in a Qwen3-MoE config (its linear-attention layers and shared expert
#: are not modelled: every layer full attention, no shared expert)
QWEN3_MOE: dict[str, dict[str, Any]] = {
    "qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, norm_topk_prob=True, rope_theta=1000000.0,
                          max_position_embeddings=40960, tie_word_embeddings=False,
                          rms_norm_eps=1e-6),
    "35B-A3B-widths": dict(hidden_size=2048, intermediate_size=6144,
                           moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                           num_hidden_layers=40, num_attention_heads=16,
                           num_key_value_heads=2, head_dim=256, vocab_size=248320,
                           norm_topk_prob=True, rope_theta=10000000.0,
                           max_position_embeddings=262144, tie_word_embeddings=False,
                           rms_norm_eps=1e-6),
}
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
#: what every Qwen2.5 base config shares
QWEN25_COMMON: dict[str, Any] = dict(
    model_type="qwen2", hidden_act="silu", max_position_embeddings=32768,
    max_window_layers=28, rope_theta=1000000.0, sliding_window=32768,
    use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
    use_cache=True, torch_dtype="bfloat16")

#: a shard holds at most this many bytes (the last tensor may not be split)
SHARD_BYTES = 4 * 10**9
#: tensors are drawn and written in row blocks of at most this many elements
BLOCK_ELEMENTS = 16 * 2**20
_MATRIX_EXPONENT = 121  # bf16 exponent field: magnitudes in [2^-6, 2^-5)
_NORM_EXPONENT = 127  # [1, 2)


def qwen25_config(size: str, **overrides: Any) -> Any:
    """A transformers Qwen2Config with Qwen2.5-`size`'s dimensions (`overrides` replace
    some, for small tests)."""
    import transformers as tf

    from toptpu.frontends.tiny_models import SPECIAL_TOKENS

    dims = {**QWEN25[size], **overrides}
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    fields = {k: v for k, v in QWEN25_COMMON.items() if k not in ("model_type", "torch_dtype")}
    return tf.Qwen2Config(**fields, **dims, bos_token_id=None, eos_token_id=eos,
                          pad_token_id=0, dtype="bfloat16")


def qwen35_config(name: str) -> Any:
    """The transformers Qwen3_5TextConfig of bench/configs/`name`, its eos and pad the tiny
    tokenizer's (the vocabulary stays the real one)."""
    import transformers as tf

    from toptpu.frontends.tiny_models import SPECIAL_TOKENS

    with open(os.path.join(CONFIGS_DIR, name, "config.json")) as f:
        raw = json.load(f)
    for key in ("architectures", "model_type", "transformers_version"):
        raw.pop(key, None)
    raw.update(bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
               pad_token_id=0, dtype="bfloat16")
    return tf.Qwen3_5TextConfig(**raw)


def qwen3_moe_config(name: str) -> Any:
    """A transformers Qwen3MoeConfig of `QWEN3_MOE[name]`, eos and pad the tiny
    tokenizer's."""
    import transformers as tf

    from toptpu.frontends.tiny_models import SPECIAL_TOKENS

    dims = dict(QWEN3_MOE[name])
    theta = dims.pop("rope_theta")
    return tf.Qwen3MoeConfig(**dims, rope_parameters={"rope_type": "default",
                                                      "rope_theta": theta},
                             bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
                             pad_token_id=0, dtype="bfloat16")


def model_config(size: str) -> Any:
    """The config of a size of `--sizes` (a Qwen2.5 size, a Qwen3.5 or a MoE name)."""
    if size in QWEN3_MOE:
        return qwen3_moe_config(size)
    return qwen35_config(size) if size in QWEN35 else qwen25_config(size)


def checkpoint_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the checkpoint of `config`, as transformers names them (its
    model built on the meta device; a tied lm_head is not stored)."""
    from toptpu.frontends.hf_loader import expected_shapes

    shapes, tied = expected_shapes(config)
    return hub_layout({n: s for n, s in shapes.items() if n not in tied})


def hub_layout(tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The module's fused experts ('…experts.gate_up_proj' [E, 2I, H], '…experts.down_proj'
    [E, H, I]) as `save_pretrained` writes them: one tensor per expert and projection
    ('…experts.7.gate_proj.weight' [I, H], up [I, H], down [H, I]), experts in order."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in tensors.items():
        base, _, last = name.rpartition(".")
        if base.endswith(".experts") and last == "gate_up_proj":
            experts, inter, hidden = shape[0], shape[1] // 2, shape[2]
            for e in range(experts):
                out[f"{base}.{e}.gate_proj.weight"] = (inter, hidden)
                out[f"{base}.{e}.up_proj.weight"] = (inter, hidden)
                out[f"{base}.{e}.down_proj.weight"] = (hidden, inter)
        elif base.endswith(".experts") and last == "down_proj":
            continue  # written with the gate and up above, expert by expert
        else:
            out[name] = shape
    return out


def plan_shards(tensors: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES
                ) -> list[list[str]]:
    """Tensors (in their order) into shards of at most `shard_bytes` (a bigger tensor gets a
    shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], norm: bool
                ) -> np.ndarray:
    """Random bf16 values (see the module doc) as a ml_dtypes.bfloat16 array."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    if norm:
        bits &= np.uint16(0x007F)  # positive
        bits |= np.uint16(_NORM_EXPONENT << 7)
    else:
        bits &= np.uint16(0x807F)
        bits |= np.uint16(_MATRIX_EXPONENT << 7)
    return bits.view(ml_dtypes.bfloat16)


def _row_blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """The shapes of the row blocks a tensor is written in."""
    if len(shape) < 2:
        yield shape
        return
    row = math.prod(shape[1:])
    step = max(1, BLOCK_ELEMENTS // row)
    for r in range(0, shape[0], step):
        yield (min(step, shape[0] - r), *shape[1:])


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def write_shard(path: str, tensors: dict[str, tuple[int, ...]], rng: np.random.Generator
                ) -> None:
    """One safetensors file of random bf16 tensors, written block by block."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open_output(path, "the checkpoint shard", size=8 + len(data) + offset) as f:
        f.write(struct.pack("<Q", len(data)))
        f.write(data)
        for name, shape in tensors.items():
            for block in _row_blocks(shape):
                f.write(random_bf16(rng, block, _is_norm(name)).tobytes())


#: written last into a checkpoint directory: it is complete
COMPLETE = ".complete"


def write_checkpoint(path: str, config: Any, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES) -> int:
    """A Hugging Face checkpoint directory of `config` with random bf16 weights (sharded
    with an index when more than one shard), tokenizer and generation config; returns the
    weight bytes. Nothing is held beyond one row block. A directory already completed
    (`COMPLETE`) for the same config is kept as it is."""
    from transformers import GenerationConfig

    from toptpu.frontends.tiny_models import build_tokenizer

    tensors = checkpoint_tensors(config)
    total = sum(2 * math.prod(s) for s in tensors.values())
    marker = os.path.join(path, COMPLETE)
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == config.to_json_string():
                return total
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    shards = plan_shards(tensors, shard_bytes)
    rng = np.random.default_rng(seed)
    n = len(shards)
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map: dict[str, str] = {}
    for file, shard in zip(names, shards, strict=True):
        write_shard(os.path.join(path, file), {t: tensors[t] for t in shard}, rng)
        weight_map.update(dict.fromkeys(shard, file))
    if n > 1:
        write_output(os.path.join(path, "model.safetensors.index.json"),
                     json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                indent=2))
    config.save_pretrained(path)
    tok = build_tokenizer()
    tok.save_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(eos_token_id=[eos], pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(path)
    write_output(marker, config.to_json_string())
    return total


# ------------------------------------------------------------------ compile and measure

_COMPILE = """
import json, sys
from toptpu.compiler import compile as compile_model
L = int(sys.argv[5]) if sys.argv[5] != "-" else None
n, par = int(sys.argv[6]), sys.argv[7] or None
r = compile_model(sys.argv[1], sys.argv[2], mode=sys.argv[3], seq_length=int(sys.argv[4]),
                  max_input_length=L, devices=n, parallel=par)
blobs = ([r.header["weights"]] if par is None
         else [d["weights"] for d in r.header["parallel"]["devices"]])
stride = 0
for w in blobs:
    layers = w["layers"]
    ends = [la["offset"] for la in layers[1:]] + [w["size"]]
    stride = max([stride] + [e - la["offset"] for la, e in zip(layers, ends)])
print(json.dumps({"layer_stride": stride, "size": max(w["size"] for w in blobs),
                  "timings": r.timings}))
"""


def compile_measured(model_dir: str, output: str, mode: str, seq: int,
                     max_input_length: int | None = None, devices: int = 1,
                     parallel: str | None = None) -> dict[str, Any]:
    """Compile in a subprocess: wall seconds, CPU seconds (user + system: what a shared
    host's load does not inflate), its peak RSS, the load average before and after, and
    what it reports."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COMPILE, model_dir, output, mode, str(seq),
                           "-" if max_input_length is None else str(max_input_length),
                           str(devices), parallel or ""],
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    load_after = os.getloadavg()[0]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kb, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu_before
    if proc.returncode:
        raise SystemExit(f"compile of {model_dir} failed:\n{proc.stderr[-4000:]}")
    if peak_kb <= before:
        print(f"note: peak RSS of {model_dir}'s compile is not above an earlier child's "
              f"({before / 1e6:.2f} GB); run the sizes in increasing order", file=sys.stderr)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(wall=wall, cpu=cpu, peak_rss=peak_kb * 1024, file=os.path.getsize(output),
               load=(load_before, load_after))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5B,1.5B,7B",
                    help=f"comma-separated, of {', '.join((*QWEN25, *QWEN35, *QWEN3_MOE))} "
                    "(increasing "
                    "order)")
    ap.add_argument("--dir", default="/work/scale-ckpt", help="checkpoints and model files")
    ap.add_argument("--mode", default="w4bf16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-input-length", type=int, default=None,
                    help="the prefill chunk L (default: compile's)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and model files")
    ap.add_argument("--write-only", action="store_true", help="only write the checkpoints")
    ap.add_argument("--layers", type=int, default=None,
                    help="the first LAYERS layers of each shape (default: all)")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--parallel", choices=("tp", "pp"), default=None)
    args = ap.parse_args()
    if args.devices > 1 and args.parallel is None:
        args.parallel = "tp"
    sizes = args.sizes.split(",")
    known = (*QWEN25, *QWEN35, *QWEN3_MOE)
    unknown = [s for s in sizes if s not in known]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(known)}")
    rows = []
    for size in sizes:
        name = size if size in QWEN35 or size in QWEN3_MOE else f"qwen2.5-{size}"
        tag = "" if args.layers is None else f"-{args.layers}l"
        ckpt = os.path.join(args.dir, f"{name}{tag}")
        output = os.path.join(args.dir, f"{name}{tag}-{args.mode}.toptpu")
        t = time.perf_counter()
        config = model_config(size)
        if args.layers is not None:
            config.num_hidden_layers = args.layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:args.layers]
        weights = write_checkpoint(ckpt, config)
        written = time.perf_counter() - t
        print(f"{size}: {weights / 1e9:.2f} GB of bf16 weights ready in {written:.0f}s",
              file=sys.stderr, flush=True)
        if args.write_only:
            continue
        try:
            r = compile_measured(ckpt, output, args.mode, args.seq, args.max_input_length,
                                 args.devices, args.parallel)
        finally:
            if not args.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        if not args.keep and os.path.exists(output):
            os.unlink(output)
        rows.append((size, weights, r))
        print(f"{size}: compiled in {r['wall']:.1f}s ({r['cpu']:.1f}s CPU), peak RSS "
              f"{r['peak_rss'] / 1e9:.2f} GB, "
              f"timings {json.dumps({k: round(v, 1) for k, v in r['timings'].items()})}",
              file=sys.stderr, flush=True)
    if not rows:
        return
    chunk = "" if args.max_input_length is None else f", input {args.max_input_length}"
    spread = "" if args.parallel is None else f", {args.devices} devices {args.parallel}"
    layers = "" if args.layers is None else f", the first {args.layers} layers"
    print(f"\n{args.mode}, seq {args.seq}{chunk}{spread}: checkpoints of the published "
          f"shapes{layers}, random bf16 weights (largest layer: of the largest device's "
          f"blob); {os.cpu_count()} CPUs\n")
    print("| size | weights GB | compile s | compile CPU s | peak RSS GB | file GB "
          "| largest layer MB | load avg before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for size, weights, r in rows:
        print(f"| {size} | {weights / 1e9:.2f} | {r['wall']:.1f} | {r['cpu']:.1f} "
              f"| {r['peak_rss'] / 1e9:.2f} "
              f"| {r['file'] / 1e9:.2f} | {r['layer_stride'] / 1e6:.1f} "
              f"| {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    by = {size: (weights, r) for size, weights, r in rows}
    if "1.5B" in by and "7B" in by:
        (w15, r15), (w7, r7) = by["1.5B"], by["7B"]
        time_ratio, weight_ratio = r7["wall"] / r15["wall"], w7 / w15
        cpu_ratio = r7["cpu"] / r15["cpu"]
        print(f"\n7B / 1.5B: time x{time_ratio:.2f} (CPU x{cpu_ratio:.2f}), weights "
              f"x{weight_ratio:.2f} (time ratio / weight ratio = "
              f"{time_ratio / weight_ratio:.2f}, CPU {cpu_ratio / weight_ratio:.2f})")


if __name__ == "__main__":
    main()
