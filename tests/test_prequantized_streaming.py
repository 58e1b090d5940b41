"""Pre-quantized checkpoints (GPTQ, AWQ, AutoRound written by the real auto-round package)
compiled by streaming (issue 13): the same model file as the whole load, every check done
before a net is compiled, a quantized linear's integers read only when its layer is written,
clear errors for a missing or truncated shard, and peak memory bounded by a few layers.

The many-layer checkpoint is made by auto-round too (round-to-nearest, ``iters=0``, sharded
with ``max_shard_size``), in a child process like `quant_fixtures` (auto-round sets
process-wide state): ``python tests/test_prequantized_streaming.py OUT_DIR`` writes
``OUT_DIR/big`` (`BIG_LAYERS` layers) and ``OUT_DIR/small`` (2 layers, the warm-up)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_fixtures import (
    _locked,
    quant_checkpoints,  # noqa: F401 - session fixture
)

pytestmark = pytest.mark.slow  # auto-round writes the checkpoints, then compiles

#: a GPTQ, an AWQ and an AutoRound export; each has a layer variant (a linear left in float,
#: or one at 8 bits), so the skeleton makes a second layer real
CASES = [
    ("qwen2_asym_g32", "auto_gptq"),  # GPTQ asym (v1 zero offset); layer 1 up_proj float
    ("qwen2_asym_g32", "auto_awq"),  # AWQ gemm
    ("llama_sym_g64", "auto_round"),  # AutoRound (auto_round:auto_gptq); an 8-bit layer
]

#: the many-layer checkpoint: Qwen2 at hidden 256, written in ~1 MB shards
BIG_LAYERS = 32
BIG_DIMS: dict[str, Any] = dict(vocab_size=256, hidden_size=256, intermediate_size=1024,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=256, tie_word_embeddings=False)
BIG_GROUP = 64
SHARD = "1MB"


def _compile(src: str | Any, out: str) -> Any:
    from toptpu.compiler import compile as compile_model

    return compile_model(src, out, mode=None, seq_length=64, max_input_length=16,
                         progress=None)


def _dir(ck: Any, recipe: str, fmt: str) -> str:
    return str(ck.path(recipe, fmt))


# ------------------------------------------------------------------ same bytes


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_streamed_compile_gives_the_bytes_of_the_whole_load(quant_checkpoints, tmp_path,  # noqa: F811
                                                            recipe: str, fmt: str) -> None:
    """A checkpoint directory compiled by streaming == the same checkpoint loaded whole
    (`load_model`: every integer read, the float model built) and compiled, byte for byte."""
    from toptpu.frontends.hf_loader import load_model

    src = _dir(quant_checkpoints, recipe, fmt)
    streamed, whole = str(tmp_path / "s.toptpu"), str(tmp_path / "w.toptpu")
    result = _compile(src, streamed)
    assert result.loaded.stream is not None and result.loaded.checkpoint is not None
    assert result.loaded.checkpoint.linears == {}  # nothing held: read layer by layer
    loaded = load_model(src)
    assert loaded.stream is None and loaded.checkpoint.linears
    _compile(loaded, whole)
    header = result.header
    assert len(set(header["layer_nets"]["block"])) == 2  # a layer variant was compiled
    assert header["checkpoint"]["quantized_layers"] == len(loaded.checkpoint.linears)
    assert Path(streamed).read_bytes() == Path(whole).read_bytes()


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_opened_checkpoint_reads_a_linear_only_when_asked(quant_checkpoints, recipe: str,  # noqa: F811
                                                          fmt: str) -> None:
    """`open_quantized_checkpoint` checks every layer without reading any qweight; each
    `linear(name)` then reads its own and equals what `read_quantized_checkpoint` gives."""
    from toptpu.dialects.checkpoint_reader import CheckpointReader
    from toptpu.frontends.quant import (
        open_quantized_checkpoint,
        read_quantized_checkpoint,
    )

    src = _dir(quant_checkpoints, recipe, fmt)
    whole = read_quantized_checkpoint(src)
    reader = CheckpointReader.open(src)
    read: list[str] = []
    tensor = reader.tensor

    def recording(name: str) -> np.ndarray:
        read.append(name)
        return tensor(name)

    reader.tensor = recording  # type: ignore[method-assign]
    opened = open_quantized_checkpoint(src, reader)
    assert not [n for n in read if n.endswith(".qweight")]
    assert any(n.endswith(".qzeros") for n in read)  # zero points are checked up front
    assert opened.layouts == whole.layouts and opened.linears == {}
    assert sorted(opened.float_names) == sorted(whole.float_tensors)
    for name, want in whole.linears.items():
        del read[:]
        got = opened.linear(name)
        assert got is not None
        assert f"{name}.qweight" in read
        for fld in ("qweight", "scales", "zeros", "g_idx", "bias"):
            a, b = getattr(got, fld), getattr(want, fld)
            assert (a is None) == (b is None), (name, fld)
            if a is not None:
                assert a.dtype == b.dtype and np.array_equal(a, b), (name, fld)
        assert (got.bits, got.group_size, got.sym) == (want.bits, want.group_size, want.sym)
    reader.close()


def _edit(path: Path, edit: Any) -> None:
    """Rewrite the checkpoint's safetensors file with `edit(tensors)` applied."""
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _bad_zero(tensors: dict[str, np.ndarray]) -> None:
    z = tensors["model.layers.1.mlp.up_proj.qzeros"]
    z[0, 0] ^= 1  # one zero point of a symmetric layer off by one


def _bad_scales(tensors: dict[str, np.ndarray]) -> None:
    name = "model.layers.1.mlp.up_proj.scales"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :-1])


@pytest.mark.parametrize("edit, match", [
    (_bad_zero, r"layer 'model\.layers\.1\.mlp\.up_proj', field 'qzeros': sym=true"),
    (_bad_scales, r"layer 'model\.layers\.1\.mlp\.up_proj', field 'scales': shape"),
])
def test_a_bad_last_layer_is_refused_before_any_net_is_compiled(quant_checkpoints, tmp_path,  # noqa: F811
                                                                edit: Any, match: str) -> None:
    """The last layer's tensors are checked when the checkpoint is opened (`plan`), not
    when that layer's chunk would be written: the error names the layer and the field."""
    from toptpu.compile_options import check_compile_request
    from toptpu.compiler import plan
    from toptpu.frontends.hf_loader import ModelLoadError

    src = tmp_path / "ckpt"
    shutil.copytree(_dir(quant_checkpoints, "llama_sym_g64", "auto_gptq"), src)
    _edit(src, edit)
    out = str(tmp_path / "m.toptpu")
    options = check_compile_request(str(src), out, mode=None, chip="bm1684x", seq_length=64,
                                    max_input_length=16, max_history=None, group_size=None,
                                    symmetric=None, dump_ir=None)
    with pytest.raises(ModelLoadError, match=match):
        plan(str(src), options)
    assert not os.path.exists(out)


# ------------------------------------------------------------------ many layers, sharded


def generate(out: Path) -> None:
    """(child process) auto-round RTN checkpoints of `BIG_DIMS`, sharded: `out/big` with
    `BIG_LAYERS` layers, `out/small` with 2."""
    import gc

    import torch
    import transformers as tf
    from auto_round import AutoRound
    from quant_fixtures import RECIPES, build_model, build_tokenizer, calibration_texts

    torch.set_float32_matmul_precision("highest")
    gc.freeze()  # auto-round calls gc.collect() often
    for name, layers in (("small", 2), ("big", BIG_LAYERS)):
        torch.manual_seed(0)
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=layers, **BIG_DIMS))
        ar = AutoRound(model.eval(), tokenizer=build_tokenizer(), scheme="W4A16",
                       group_size=BIG_GROUP, sym=False, iters=0, dataset=calibration_texts(),
                       device_map="cpu", seqlen=32, nsamples=4, amp=False,
                       enable_torch_compile=False, disable_opt_rtn=True)
        _, folder = ar.quantize_and_save(str(out / f"{name}.run"), format="auto_round",
                                         max_shard_size=SHARD)
        os.rename(folder if isinstance(folder, str) else folder[0], out / name)
        del ar
    # a GPTQ checkpoint whose lm_head is quantized too (`lm_head: true`)
    recipe = next(iter(RECIPES.values()))
    ar = AutoRound(build_model(recipe.arch), tokenizer=build_tokenizer(), scheme="W4A16",
                   group_size=32, sym=True, iters=0, dataset=calibration_texts(),
                   device_map="cpu", seqlen=32, nsamples=4, amp=False,
                   enable_torch_compile=False, quant_lm_head=True)
    _, folder = ar.quantize_and_save(str(out / "lm_head.run"), format="auto_gptq")
    os.rename(folder if isinstance(folder, str) else folder[0], out / "lm_head")


@pytest.fixture(scope="session")
def many_layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The many-layer checkpoints, made once per session (xdist workers share them as they
    share `quant_fixtures`': the first one makes them under a file lock)."""
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "many_layers"
    with _locked(out.parent / "many_layers.lock"):
        if not (out / "done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True,
                                  text=True, check=False, timeout=900,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
            assert proc.returncode == 0, proc.stderr[-3000:]
            (out / "done").write_text("")
    big = out / "big"
    assert len(_shards(big)) > 4
    assert json.loads((big / "config.json").read_text())["quantization_config"][
        "quant_method"] == "auto-round"
    return {"big": str(big), "small": str(out / "small"), "lm_head": str(out / "lm_head")}


def _shards(path: Path) -> list[str]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_missing_shard_is_a_clear_error_and_leaves_no_file(many_layers, tmp_path) -> None:
    from toptpu.frontends.hf_loader import ModelLoadError

    src = Path(shutil.copytree(many_layers["big"], tmp_path / "ckpt"))
    middle = _shards(src)[len(_shards(src)) // 2]
    (src / middle).unlink()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelLoadError, match=f"'{middle}'.*missing"):
        _compile(str(src), str(out / "m.toptpu"))
    assert os.listdir(out) == []


def test_shard_truncated_mid_compile_is_a_clear_error_and_leaves_no_file(many_layers,
                                                                        tmp_path) -> None:
    """The shard holding a late layer's integers (and none of the shared tensors) is cut
    after the nets are compiled, while the layers are written: an error naming the shard,
    and no model file."""
    from toptpu.compile_options import check_compile_request
    from toptpu.compiler import CompileError, compile_nets, pack_weights, plan, write

    src = Path(shutil.copytree(many_layers["big"], tmp_path / "ckpt"))
    out = tmp_path / "out"
    out.mkdir()
    options = check_compile_request(str(src), str(out / "m.toptpu"), mode=None,
                                    chip="bm1684x", seq_length=64, max_input_length=16,
                                    max_history=None, group_size=None, symmetric=None,
                                    dump_ir=None)
    the_plan = plan(str(src), options)
    compiled = compile_nets(the_plan)
    packed = pack_weights(the_plan, compiled)
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shared = {where[n] for n in ("model.embed_tokens.weight", "lm_head.weight")}
    shard = next(where[name] for layer in range(BIG_LAYERS - 1, 0, -1)
                 if where[name := f"model.layers.{layer}.mlp.down_proj.qweight"] not in shared)
    with open(src / shard, "r+b") as f:
        f.truncate(64)
    with pytest.raises(CompileError, match=f"shard '{shard}'"):
        write(the_plan, compiled, packed, str(out / "m.toptpu"))
    assert os.listdir(out) == []


_SUBPROCESS_COMPILE = """
import os, resource, sys
from toptpu.compiler import compile as compile_model

def run(model_dir):
    compile_model(model_dir, sys.argv[2], mode=None, seq_length=64, max_input_length=16,
                  progress=None)

run(sys.argv[3])  # a warm-up compile: everything a compile imports and caches is loaded
os.unlink(sys.argv[2])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run(sys.argv[1])
print(base * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_streamed_compile_memory_is_bounded_by_a_few_layers(many_layers, tmp_path) -> None:
    """Peak RSS of a streaming compile (getrusage in a fresh process) of the 32-layer
    auto-round checkpoint, after the same process compiled its 2-layer twin: it grows by
    less than 8 layers' float32 plus the embedding and lm_head in float32, a quarter of the
    float32 model (the whole load holds it twice over: the model and the dequantized state,
    besides every layer's unpacked integers)."""
    hidden, inter = BIG_DIMS["hidden_size"], BIG_DIMS["intermediate_size"]
    kv = hidden // BIG_DIMS["num_attention_heads"] * BIG_DIMS["num_key_value_heads"]
    layer = 4 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    shared = 4 * 2 * BIG_DIMS["vocab_size"] * hidden
    whole = BIG_LAYERS * layer + shared
    bound = 8 * layer + shared
    assert whole > 3.5 * bound
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS_COMPILE, many_layers["big"],
                           str(tmp_path / "m.toptpu"), many_layers["small"]],
                          capture_output=True, text=True, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base, peak = (int(x) for x in proc.stdout.split())
    assert peak - base < bound, (f"peak RSS {peak / 1e6:.0f} MB is {(peak - base) / 1e6:.0f} "
                                 f"MB above the {base / 1e6:.0f} MB of the warm-up; bound "
                                 f"{bound / 1e6:.0f} MB (float32 model {whole / 1e6:.0f} MB)")


if __name__ == "__main__":
    generate(Path(sys.argv[1]))


@pytest.mark.slow
def test_a_quantized_lm_head_is_loaded_whole_and_compiles(many_layers, tmp_path) -> None:
    """A checkpoint that quantizes the lm_head (GPTQ `lm_head: true`, written by auto-round)
    is not streamed — the embedding and lm_head placeholders stand for float tensors — but
    loaded whole, and compiles to a model file that generates."""
    from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.dialects.checkpoint_reader import CheckpointReader
    from toptpu.frontends.streaming import load_streaming

    path = many_layers["lm_head"]
    qc = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True and qc["quant_method"] == "gptq"
    index = CheckpointReader.open(path)
    assert "lm_head.qweight" in index.tensors and "lm_head.weight" not in index.tensors
    index.close()
    loaded = load_streaming(path)
    assert loaded.stream is None and loaded.checkpoint is not None
    assert "lm_head" in loaded.checkpoint.linears
    out = str(tmp_path / "m.toptpu")
    _compile(path, out)
    result = Runtime(InterpreterExecutor(out)).generate([1, 2, 3], 3, stop_on_eos=False)
    assert len(result.generated_ids) == 3
