"""Real model sizes: the benchmark's checkpoint writer (bench/scale.py), the streaming
checkpoint reader and the streaming compile (issue 13)."""

from __future__ import annotations

import importlib.util
import json
import os

import ml_dtypes
import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader

_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "scale.py")


def bench_scale():  # noqa: ANN201 - the bench module
    spec = importlib.util.spec_from_file_location("bench_scale", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Qwen2.5 structure at tiny dimensions (many layers: a float32 copy is many layers' worth)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def test_bench_writer_is_a_checkpoint_transformers_loads(tmp_path):
    """bench/scale.py writes shards + index without a model object; transformers loads
    them with every tensor present, bf16, values in the ranges the writer promises."""
    import torch
    from transformers import AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    scale = bench_scale()
    cfg = scale.qwen25_config("7B", num_hidden_layers=3, **TINY)
    path = str(tmp_path / "ckpt")
    total = scale.write_checkpoint(path, cfg, shard_bytes=40_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == total
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)  # untied: lm_head is stored
    assert sum(t.numel() * 2 for t in state.values()) == total
    for name, t in state.items():
        mag = t.float().abs()
        lo, hi = (1.0, 2.0) if name.endswith("norm.weight") else (1 / 64, 1 / 32)
        assert float(mag.min()) >= lo and float(mag.max()) < hi, name
    q = state["model.layers.2.self_attn.q_proj.weight"].float()
    assert 0.3 < float((q > 0).float().mean()) < 0.7  # signs drawn, not constant


def test_bench_writer_moe_is_the_hub_layout(tmp_path):
    """A MoE checkpoint of bench/scale.py (a Qwen3-MoE config of the 35B-A3B's structure,
    widths cut) holds one tensor per expert and projection as `save_pretrained` writes
    them, and transformers loads it with every expert's values."""
    import torch
    from transformers import AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    scale = bench_scale()
    cfg = scale.qwen3_moe_config("35B-A3B-widths")
    for k, v in dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, head_dim=16,
                     num_attention_heads=4, vocab_size=512, num_hidden_layers=2).items():
        setattr(cfg, k, v)
    path = str(tmp_path / "moe")
    total = scale.write_checkpoint(path, cfg, shard_bytes=40_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    assert sum(n.startswith("model.layers.0.mlp.experts.") for n in names) == 8 * 3
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    state = model.state_dict()
    assert sum(t.numel() * 2 for t in state.values()) == total
    fused = state["model.layers.1.mlp.experts.gate_up_proj"].float().abs()
    assert float(fused.min()) >= 1 / 64 and float(fused.max()) < 1 / 32  # all written


def test_bench_random_bf16_is_bf16_bits():
    scale = bench_scale()
    x = scale.random_bf16(np.random.default_rng(0), (1000,), norm=False)
    assert x.dtype == ml_dtypes.bfloat16
    assert len(np.unique(x.view(np.uint16))) > 200


@pytest.mark.parametrize("shard_bytes, want", [(10, 3), (250, 1), (150, 2)])
def test_bench_plan_shards(shard_bytes, want):
    scale = bench_scale()
    tensors = {"a": (10, 5), "b": (20,), "c": (5, 5)}  # 100, 40, 50 bytes
    shards = scale.plan_shards(tensors, shard_bytes)
    assert len(shards) == want
    assert [n for s in shards for n in s] == ["a", "b", "c"]


# ------------------------------------------------------------------ the checkpoint reader


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory):
    """A real transformers Qwen2 model saved in bf16 in several shards (save_pretrained)."""
    import torch

    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import build_tokenizer, tiny_model

    model = tiny_model("qwen2", layers=6, **{k: v for k, v in TINY.items()
                                             if k != "vocab_size"})
    model = model.to(torch.bfloat16)
    path = str(tmp_path_factory.mktemp("ckpt") / "qwen2-bf16")
    with quiet_transformers():
        model.save_pretrained(path, max_shard_size="60KB")
    build_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path, {k: v.float().numpy() for k, v in model.state_dict().items()}


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_reader_reads_every_tensor_in_its_dtype(sharded_bf16):
    path, state = sharded_bf16
    with CheckpointReader.open(path) as reader:
        assert len(reader.shards) > 2
        assert set(reader.names()) == set(state)
        for name, want in state.items():
            got = reader.tensor(name)
            assert got.dtype == ml_dtypes.bfloat16 and not got.flags.writeable
            np.testing.assert_array_equal(got.astype(np.float32), want)
        reader.release()  # pages dropped; the views still read the file
        name = next(iter(state))
        np.testing.assert_array_equal(reader.tensor(name).astype(np.float32), state[name])


def _shards(path: str) -> list[str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def test_reader_missing_shard_is_named(sharded_bf16, tmp_path):
    path = _copy(sharded_bf16[0], str(tmp_path / "m"))
    middle = _shards(path)[1]
    os.unlink(os.path.join(path, middle))
    with pytest.raises(CheckpointError, match=f"shard.*'{middle}'.* missing"):
        CheckpointReader.open(path)


@pytest.mark.parametrize("cut", ["half", "header"])
def test_reader_truncated_shard_is_named(sharded_bf16, tmp_path, cut):
    path = _copy(sharded_bf16[0], str(tmp_path / "m"))
    middle = os.path.join(path, _shards(path)[1])
    size = os.path.getsize(middle)
    with open(middle, "r+b") as f:
        f.truncate(size // 2 if cut == "half" else 20)
    with pytest.raises(CheckpointError, match=f"shard '{_shards(path)[1]}' is truncated"):
        CheckpointReader.open(path)


def test_reader_truncated_after_open_is_an_error_not_a_crash(sharded_bf16, tmp_path):
    path = _copy(sharded_bf16[0], str(tmp_path / "m"))
    reader = CheckpointReader.open(path)
    last = _shards(path)[-1]
    name = next(n for n, t in reader.tensors.items() if t.shard == last)
    with open(os.path.join(path, last), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=f"shard '{last}' changed size"):
        reader.tensor(name)
    reader.close()


@pytest.mark.parametrize("shard", ["../model-00001-of-00003.safetensors", "/etc/passwd",
                                   "sub/x.safetensors", "x.bin", 3, ".hidden.safetensors"])
def test_reader_index_names_are_never_paths(sharded_bf16, tmp_path, shard):
    path = _copy(sharded_bf16[0], str(tmp_path / "m"))
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        raw = json.load(f)
    raw["weight_map"][next(iter(raw["weight_map"]))] = shard
    with open(index, "w") as f:
        json.dump(raw, f)
    with pytest.raises(CheckpointError, match="a shard is a plain"):
        CheckpointReader.open(path)


def _write_raw(path: str, header: object, data: bytes, hlen: int | None = None) -> None:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write((len(h) if hlen is None else hlen).to_bytes(8, "little") + h + data)


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "dtype"),
    ({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "spanning"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8,
     "data_offsets"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 6, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "after the"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9,
     "bytes after its last"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4,
     "not exactly"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ([1, 2], b"", "not an object"),
    (b'{"a": 1, "a": 2}', b"", "twice"),
    (b"\xff\xfe", b"", "not valid JSON"),
])
def test_reader_checks_every_header_field(tmp_path, header, data, match):
    _write_raw(str(tmp_path / "model.safetensors"), header, data)
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader.open(str(tmp_path))


def test_reader_header_length_beyond_the_file(tmp_path):
    _write_raw(str(tmp_path / "model.safetensors"), {}, b"", hlen=10**6)
    with pytest.raises(CheckpointError, match="truncated: its header needs"):
        CheckpointReader.open(str(tmp_path))


def test_reader_fuzzed_header_bytes_are_checkpoint_errors(tmp_path):
    """Any byte of a real shard's header changed: the reader accepts it or raises
    CheckpointError, never anything else."""
    good = {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
            "b": {"dtype": "I32", "shape": [1], "data_offsets": [12, 16]},
            "__metadata__": {"format": "pt"}}
    raw = json.dumps(good).encode()
    blob = len(raw).to_bytes(8, "little") + raw + bytes(range(16))
    target = tmp_path / "model.safetensors"

    @fuzz_settings(150)
    @given(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)),
                    min_size=1, max_size=4))
    def prop(edits: list[tuple[int, int]]) -> None:
        data = bytearray(blob)
        for at, byte in edits:
            data[at] = byte
        target.write_bytes(bytes(data))
        try:
            with CheckpointReader.open(str(tmp_path)) as reader:
                for name in reader.names():
                    reader.tensor(name)
        except CheckpointError:
            pass

    prop()


# ------------------------------------------------------------------ streamed sections


def _pieces(data: bytes, cuts: list[int]):  # noqa: ANN202
    """(offset, bytes) pieces of `data` between sorted cut points, all-zero pieces left
    out (the writer fills gaps with zeros)."""
    bounds = [0, *sorted(set(cuts)), len(data)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a and any(data[a:b]):
            yield a, data[a:b]


@pytest.mark.parametrize("cuts", [[], [1, 4096, 4096, 9000, 12287], list(range(0, 12288, 999))])
def test_streamed_section_writes_the_same_file(tmp_path, cuts):
    """A section given as pieces with zero gaps gives the very bytes (digest, layout) of
    the same section given whole."""
    from toptpu.backend.formats.model_file import ModelFile, StreamedSection, write_model_file

    rng = np.random.default_rng(len(cuts))
    data = rng.integers(0, 256, 12288, dtype=np.uint8)
    data[2000:7000] = 0  # a zero run the pieces leave out
    data = data.tobytes()
    whole, streamed = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    header = {"kind": "test"}
    write_model_file(whole, header, {"x": b"abc", "blob": data, "y": b"z"})
    write_model_file(streamed, header, {
        "x": b"abc", "blob": StreamedSection(len(data), lambda: _pieces(data, cuts)),
        "y": b"z"})
    with open(whole, "rb") as f, open(streamed, "rb") as g:
        assert f.read() == g.read()
    with ModelFile(streamed) as m:
        assert m.read("blob") == data


def test_streamed_section_bad_pieces_leave_no_file(tmp_path):
    from toptpu.backend.formats.model_file import StreamedSection, write_model_file

    out = str(tmp_path / "m.bin")

    def overlapping():  # noqa: ANN202
        yield 0, b"abcd"
        yield 2, b"xy"

    with pytest.raises(ValueError, match="overlaps"):
        write_model_file(out, {}, {"blob": StreamedSection(8, overlapping)})
    with pytest.raises(ValueError, match="passes the section's end"):
        write_model_file(out, {}, {"blob": StreamedSection(3, lambda: iter([(0, b"abcd")]))})

    def failing():  # noqa: ANN202
        yield 0, b"ab"
        raise RuntimeError("the checkpoint went away")

    with pytest.raises(RuntimeError):
        write_model_file(out, {}, {"blob": StreamedSection(8, failing)})
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ quantization in blocks


@fuzz_settings(40)
@given(st.integers(1, 40), st.sampled_from([8, 16, 32]), st.sampled_from([4, 8]),
       st.booleans(), st.sampled_from(["float32", "float16", "bfloat16"]),
       st.integers(1, 200), st.integers(0, 2**31))
def test_quantize_in_row_blocks_gives_the_same_numbers(n, k, bits, symmetric, scale, block,
                                                       seed):
    """quantize_rtn in row blocks (any block size) == the whole weight at once."""
    from toptpu.passes import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :4] = 0  # a zero group
    sd = np.dtype(ml_dtypes.bfloat16) if scale == "bfloat16" else np.dtype(scale)
    gs = quantize.resolve_group_size(k, 8, bits)
    whole = quantize._quantize_rows(w, bits, gs, symmetric, sd)
    old = quantize.QUANT_BLOCK_ELEMENTS
    quantize.QUANT_BLOCK_ELEMENTS = block
    try:
        blocked = quantize.quantize_rtn(w, bits, 8, symmetric, sd)
    finally:
        quantize.QUANT_BLOCK_ELEMENTS = old
    for a, b in ((whole.qweight, blocked.qweight), (whole.scales, blocked.scales),
                 (whole.zeros, blocked.zeros)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


# ------------------------------------------------------------------ streaming compile


def _save_sharded(path: str, family: str, layers: int = 3, **overrides) -> str:
    """A real transformers model of `family` saved in bf16 in several shards."""
    import torch

    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import build_tokenizer, tiny_model

    model = tiny_model(family, layers=layers, **overrides).to(torch.bfloat16)
    with quiet_transformers():
        model.save_pretrained(path, max_shard_size="40KB")
    build_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


_SUBPROCESS_COMPILE = """
import os, resource, sys
from toptpu.compiler import compile as compile_model

def run(model_dir, out):
    compile_model(model_dir, out, mode=sys.argv[3], seq_length=int(sys.argv[4]),
                  max_input_length=int(sys.argv[5]), progress=None)

if sys.argv[6]:  # a warm-up compile: everything a compile imports and caches is loaded
    run(sys.argv[6], sys.argv[2])
    os.unlink(sys.argv[2])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run(sys.argv[1], sys.argv[2])
print(base * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _compile_in_subprocess(model_dir: str, out: str, mode: str, seq: int = 64,
                           input_len: int = 16, hash_seed: str = "1", warm_up: str = ""
                           ) -> tuple[int, int]:
    """Compile in a fresh process (after compiling `warm_up` when given): (peak RSS before,
    peak RSS after), in bytes."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS_COMPILE, model_dir, out, mode,
                           str(seq), str(input_len), warm_up], capture_output=True,
                          text=True, env=env, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base, peak = (int(x) for x in proc.stdout.split())
    return base, peak


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", [("qwen2", "f32"), ("qwen2", "w4bf16"),
                                          ("qwen3", "w4bf16"), ("qwen3_5", "w4bf16"),
                                          ("qwen3_moe", "w8bf16")])
def test_streamed_compile_gives_the_bytes_of_the_in_memory_compile(tmp_path, family, mode):
    """A sharded bf16 checkpoint compiled by streaming (a directory) == the same weights
    loaded whole into a float32 transformers model and compiled in memory, byte for byte;
    and the streaming compile is reproducible: again in another process (another hash
    seed), the same bytes. qwen3 ties its embeddings (one placeholder for two nets);
    qwen3_5 has layers of two kinds (three linear attention, one full), each kind's
    representative layer made real from the shards."""
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import load_model

    path = _save_sharded(str(tmp_path / "ckpt"), family, layers=4 if family == "qwen3_5" else 3)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    streamed, again, whole = (str(tmp_path / f"{n}.toptpu") for n in ("s", "a", "w"))
    result = compile_model(path, streamed, mode=mode, seq_length=64, max_input_length=16,
                           progress=None)
    assert result.loaded is not None and result.loaded.stream is not None  # it streamed
    loaded = load_model(path)
    assert loaded.stream is None
    compile_model(loaded, whole, mode=mode, seq_length=64, max_input_length=16,
                  progress=None)
    _compile_in_subprocess(path, again, mode, hash_seed="12345")
    with open(streamed, "rb") as f:
        data = f.read()
    with open(whole, "rb") as f:
        assert f.read() == data
    with open(again, "rb") as f:
        assert f.read() == data


@pytest.mark.slow
def test_missing_shard_is_a_clear_error_and_leaves_no_file(tmp_path):
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import ModelLoadError

    path = _save_sharded(str(tmp_path / "ckpt"), "qwen2")
    middle = _shards(path)[1]
    os.unlink(os.path.join(path, middle))
    out = str(tmp_path / "out" / "m.toptpu")
    os.makedirs(os.path.dirname(out))
    with pytest.raises(ModelLoadError, match=f"'{middle}'.*missing"):
        compile_model(path, out, mode="w4bf16", seq_length=64, max_input_length=16,
                      progress=None)
    assert os.listdir(os.path.dirname(out)) == []


def _cut_shard_while_writing(path: str, out_dir: str, tensor: str, seq_length: int) -> None:
    """Compile `path` step by step and cut the shard holding `tensor` after the nets are
    compiled, while the layers are being written: the write fails naming the shard and
    leaves no file in `out_dir`."""
    from toptpu.compile_options import check_compile_request
    from toptpu.compiler import compile_nets, pack_weights, plan, write
    from toptpu.frontends.hf_loader import ModelLoadError

    out = os.path.join(out_dir, "m.toptpu")
    os.makedirs(out_dir)
    options = check_compile_request(path, out, mode="w4bf16", chip="bm1684x",
                                    seq_length=seq_length, max_input_length=16,
                                    max_history=None, group_size=None, symmetric=None,
                                    dump_ir=None)
    the_plan = plan(path, options)
    assert the_plan.loaded.stream is not None
    compiled = compile_nets(the_plan)
    packed = pack_weights(the_plan, compiled)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][tensor]
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(64)
    with pytest.raises(ModelLoadError, match=f"shard '{shard}'"):
        write(the_plan, compiled, packed, out)
    assert os.listdir(out_dir) == []


@pytest.mark.slow
def test_shard_truncated_mid_compile_is_a_clear_error_and_leaves_no_file(tmp_path):
    """The shard holding the last layer is cut after the nets are compiled, while the
    layers are being written: an error naming the shard, and no model file."""
    path = _save_sharded(str(tmp_path / "ckpt"), "qwen2", layers=4)
    _cut_shard_while_writing(path, str(tmp_path / "out"), "model.layers.3.mlp.down_proj.weight",
                             seq_length=64)


@pytest.mark.slow
def test_streamed_compile_memory_is_bounded_by_a_layer(tmp_path):
    """Peak RSS of a streaming compile (getrusage in a fresh process) of a 40-layer bf16
    checkpoint, after the same process compiled a 2-layer one of the same shape (so that
    what a compile imports and caches is already there): it grows by less than 12 layers'
    float32 (layer 0 for the nets, a layer derived, a layer written) plus the embedding
    and lm_head in float32 — a third of the float32 model the in-memory path holds."""
    scale = bench_scale()
    dims = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=2048)
    config = scale.qwen25_config("7B", num_hidden_layers=40, **dims)
    path, small = str(tmp_path / "ckpt"), str(tmp_path / "small")
    scale.write_checkpoint(path, config, shard_bytes=8 * 10**6)
    scale.write_checkpoint(small, scale.qwen25_config("7B", num_hidden_layers=2, **dims))
    tensors = scale.checkpoint_tensors(config)
    f32 = {name: 4 * int(np.prod(shape)) for name, shape in tensors.items()}
    layer = sum(n for name, n in f32.items() if name.startswith("model.layers.0."))
    shared = f32["model.embed_tokens.weight"] + f32["lm_head.weight"]
    whole = sum(f32.values())
    bound = 12 * layer + shared
    assert whole > 3 * bound  # the float32 model is far above the bound
    base, peak = _compile_in_subprocess(path, str(tmp_path / "m.toptpu"), "w4bf16",
                                        warm_up=small)
    assert peak - base < bound, (f"peak RSS {peak / 1e6:.0f} MB is {(peak - base) / 1e6:.0f} "
                                 f"MB above the {base / 1e6:.0f} MB of the warm-up; bound "
                                 f"{bound / 1e6:.0f} MB (float32 model {whole / 1e6:.0f} MB)")
