"""A GGUF file read as strictly as a safetensors checkpoint (issue 44, part 1): every array
taken as an array and bounded before anything reads it, the metadata of the kind each key
must be, the tensor data laid out as llama.cpp requires, the tokenizer against the
vocabulary, no NaN or infinity in a tensor, the context length bounding `--seq-length`, the
KV cache bounding it by the chip's memory, a FIFO or a missing `x.gguf` named as such.

The hostile files are written by the `gguf` package's own writer (`gguf_fixtures`): a
header-only one for the header checks (milliseconds), a tiny model for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc
from typing import Any

import gguf
import numpy as np
import pytest
from fuzz import fuzz_settings
from gguf_fixtures import SMALL_TOKENS, small_gguf, write_gguf
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import tiny_dir
from test_cli_errors import assert_one_error, cli

from toptpu.compile_options import check_compile_request
from toptpu.compiler import check_chat_template
from toptpu.errors import CompileError
from toptpu.frontends import gguf_loader
from toptpu.frontends.gguf_loader import (
    OTHER_ARRAY_ELEMENTS,
    GGUFError,
    check_metadata,
    gguf_file_of,
    load_gguf,
    scan_gguf,
)

V = gguf.GGUFValueType


def _refused(path: str, *needles: str) -> str:
    """The header scan and the metadata check refuse `path` in one line holding each
    needle (and the file's name)."""
    with pytest.raises(GGUFError) as info:
        check_metadata(scan_gguf(path))
    message = str(info.value)
    assert "\n" not in message and path in message, message
    for needle in needles:
        assert needle in message, message
    return message


def _request(model: str, out: str, seq: int, chip: str = "bm1684x") -> Any:
    return check_compile_request(model, out, mode=None, chip=chip, seq_length=seq,
                                 max_input_length=None, max_history=None, group_size=None,
                                 symmetric=None, dump_ir=None)


# --------------------------------------------------------------------------- arrays


@pytest.mark.parametrize("key, value, sub", [
    ("llama.block_count", [10**12], V.UINT64),  # the probe's hang: taken as 1 before
    ("llama.block_count", [2], V.UINT32),
    ("llama.context_length", [64], V.UINT32),
    ("llama.embedding_length", [32, 32], V.UINT32),
    ("llama.attention.head_count", [2], V.INT32),
    ("llama.rope.freq_base", [10000.0], V.FLOAT32),
    ("llama.attention.layer_norm_rms_epsilon", [1e-6], V.FLOAT32),
    ("tokenizer.ggml.eos_token_id", [2], V.UINT32),
    ("tokenizer.ggml.add_bos_token", [True], V.BOOL),
    ("tokenizer.ggml.model", ["gpt2"], V.STRING),
    ("general.alignment", [32], V.UINT32),
])
def test_an_array_never_passes_for_a_scalar(tmp_path, key: str, value: list[Any],
                                            sub: Any) -> None:
    """transformers takes a one-element array as its element: the header refuses any array
    where a scalar (or string) belongs, naming the key."""
    path = small_gguf(str(tmp_path / "a.gguf"), {key: (value, V.ARRAY, sub)})
    _refused(path, key, f"an array of {len(value)}")


def test_arrays_besides_the_tokenizers_are_bounded_before_reading(tmp_path) -> None:
    """An array of 200k bytes or of 100k empty strings (the probe's 2M / 400k cost 3 GB /
    1.6 GB in gguf's reader) is refused from its count, holding no element: the scan's
    allocations stay under a megabyte."""
    for key, value, sub in (("x.blob", bytes(200_000), V.UINT8),
                            ("x.strings", [""] * 100_000, V.STRING)):
        path = small_gguf(str(tmp_path / "b.gguf"), {key: (value, V.ARRAY, sub)})
        tracemalloc.start()
        try:
            _refused(path, key, f"at most {OTHER_ARRAY_ELEMENTS} elements")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
    ok = small_gguf(str(tmp_path / "c.gguf"), {"x.blob": (bytes(60_000), V.ARRAY, V.UINT8)})
    check_metadata(scan_gguf(ok))  # within the bound: read


@pytest.mark.parametrize("metadata, needles", [
    ({"tokenizer.ggml.tokens": (SMALL_TOKENS + ["x", "y"], V.ARRAY, V.STRING),
      "tokenizer.ggml.token_type": ([1] * 10, V.ARRAY, V.INT32)},
     ("10 tokens, more than the 8 rows of token_embd.weight",)),
    ({"tokenizer.ggml.token_type": ([1] * 7, V.ARRAY, V.INT32)},
     ("'tokenizer.ggml.token_type' has 7 elements", "one per token")),
    ({"tokenizer.ggml.scores": ([0.0] * 9, V.ARRAY, V.FLOAT32)},
     ("'tokenizer.ggml.scores' has 9 elements",)),
    ({"tokenizer.ggml.merges": (["a b"] * 33, V.ARRAY, V.STRING)},
     ("33 merges, more than 4 per row",)),
    ({"tokenizer.ggml.tokens": (list(range(8)), V.ARRAY, V.INT32)},
     ("'tokenizer.ggml.tokens' is an array of 8 int32 elements", "string expected")),
    ({"tokenizer.ggml.tokens": ("abc", V.STRING, None)},
     ("'tokenizer.ggml.tokens' is the string 'abc'", "an array of string expected")),
])
def test_the_tokenizer_is_checked_against_the_vocabulary(tmp_path, metadata,
                                                        needles: tuple[str, ...]) -> None:
    """The tokenizer's arrays: one element per token, no more tokens than the embedding's
    rows (the probe: ids 389, 483 >= 384 compiled and failed in `run`), merges bounded."""
    _refused(small_gguf(str(tmp_path / "t.gguf"), metadata), *needles)


@pytest.mark.parametrize("value, vtype, needle", [
    (2**32 - 1, V.UINT32, "is 4294967295, not one of the tokenizer's 8 token ids (0 to 7)"),
    (8, V.UINT32, "is 8, not one of the tokenizer's 8 token ids"),
    (-1, V.INT32, "is the int -1, a token id (an integer >= 0) expected"),
    ("2", V.STRING, "is the string '2', a token id"),
])
def test_special_token_ids_are_tokens(tmp_path, value: Any, vtype: Any, needle: str) -> None:
    """eos_token_id 2^32-1 (the probe: "list index out of range" from the tokenizer
    conversion) and its kin, refused naming the key."""
    path = small_gguf(str(tmp_path / "e.gguf"),
                      {"tokenizer.ggml.eos_token_id": (value, vtype, None)})
    _refused(path, "'tokenizer.ggml.eos_token_id'", needle)


# --------------------------------------------------------------------------- tensor data


def _two_tensors(tmp_path) -> tuple[bytes, str]:  # noqa: ANN001
    path = small_gguf(str(tmp_path / "two.gguf"), tensors={
        "token_embd.weight": np.zeros((8, 32), np.float32),
        "output_norm.weight": np.ones(32, np.float32)})
    with open(path, "rb") as f:
        return f.read(), path


def _with_offset(data: bytes, name: bytes, offset: int) -> bytes:
    at = data.rindex(name) + len(name)  # rank u32, dims u64 x rank, type u32, offset u64
    (rank,) = struct.unpack_from("<I", data, at)
    pos = at + 4 + 8 * rank + 4
    return data[:pos] + struct.pack("<Q", offset) + data[pos + 8:]


@pytest.mark.parametrize("name, offset, expected", [
    (b"output_norm.weight", 0, 1024),  # on the first tensor's bytes
    (b"output_norm.weight", 1024 - 32, 1024),  # inside them
    (b"token_embd.weight", 32, 0),  # a gap before it
])
def test_tensor_data_follows_the_layout_llama_cpp_requires(tmp_path, name: bytes, offset: int,
                                                           expected: int) -> None:
    """Each tensor's data starts where the one before it ends (aligned): two tensors on the
    same bytes (the probe moved attn_q onto attn_output in the real SmolLM2: it compiled
    and ran) or a gap are refused naming the tensor."""
    data, path = _two_tensors(tmp_path)
    header = scan_gguf(path)
    assert header.tensors["output_norm.weight"].offset - header.data_start == 8 * 32 * 4
    with open(path, "wb") as f:
        f.write(_with_offset(data, name, offset))
    _refused(path, f"tensor '{name.decode()}' has data offset {offset}, expected {expected}",
             "as llama.cpp requires")


# --------------------------------------------------------------------------- what it is


def test_a_fifo_or_a_missing_file_named_gguf(tmp_path, capsys) -> None:
    """`compile x.gguf` where x.gguf is a FIFO (the probe: "does not exist") or missing
    (the probe: "model directory ... does not exist"): one line saying what it is."""
    fifo = str(tmp_path / "x.gguf")
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match=r"is a FIFO, not a GGUF file"):
        gguf_file_of(fifo)
    out = str(tmp_path / "m.toptpu")
    code, _, err = cli(["compile", fifo, "-o", out], capsys)
    assert_one_error(code, err, "compile", "is a FIFO, not a GGUF file: pass a regular file")
    missing = str(tmp_path / "missing" / "x.gguf")
    code, _, err = cli(["compile", missing, "-o", out], capsys)
    assert_one_error(code, err, "compile", f"the GGUF file '{missing}' does not exist")
    assert "model directory" not in err and not os.path.exists(out)


def test_metadata_that_would_not_fit_memory_is_refused_before_reading(tmp_path,
                                                                      monkeypatch) -> None:
    """What reading the arrays takes (gguf's reader and transformers, ~2 KB an element) is
    checked against the host's available memory first."""
    path = small_gguf(str(tmp_path / "m.gguf"))
    monkeypatch.setattr(gguf_loader, "mem_available", lambda: 40_000)
    message = _refused(path, "array elements, which take about", "available memory")
    assert "more than half" in message


# --------------------------------------------------------------------------- kinds


_SCALARS = {  # key -> the kind it must be
    **{f"llama.{k}": "positive int" for k in gguf_loader._ARCH_INTS},
    **{f"llama.{k}": "positive number" for k in gguf_loader._ARCH_FLOATS},
    **{k: "bool" for k in gguf_loader._BOOLS},
    "general.name": "string", "tokenizer.ggml.pre": "string",
    "tokenizer.chat_template": "string",
}
_VALUES = st.one_of(
    st.tuples(st.integers(0, 2**40), st.just(V.UINT64)),
    st.tuples(st.integers(-2**31, 2**31 - 1), st.just(V.INT32)),
    st.tuples(st.floats(width=32), st.just(V.FLOAT32)),
    st.tuples(st.booleans(), st.just(V.BOOL)),
    st.tuples(st.text(max_size=8), st.just(V.STRING)),
    st.tuples(st.lists(st.integers(0, 2**31), min_size=1, max_size=3), st.just(V.ARRAY)),
)


def _fits(kind: str, value: Any, vtype: Any) -> bool:
    if vtype == V.ARRAY:
        return False
    if kind == "positive int":
        return vtype in (V.UINT64, V.INT32) and value > 0
    if kind == "positive number":
        return vtype in (V.UINT64, V.INT32, V.FLOAT32) and np.isfinite(value) and value > 0
    if kind == "bool":
        return vtype == V.BOOL
    return vtype == V.STRING


@fuzz_settings(60)
@given(key=st.sampled_from(sorted(_SCALARS)), value=_VALUES)
def test_every_mapped_key_is_of_its_kind(tmp_path_factory, key: str,
                                         value: tuple[Any, Any]) -> None:
    """Any value of any GGUF type under a key transformers maps into the config or the
    tokenizer: accepted when it is of the key's kind, else refused naming the key (never a
    one-element array taken as its element, a negative size, a NaN epsilon)."""
    v, vtype = value
    sub = V.UINT32 if vtype == V.ARRAY else None
    path = small_gguf(os.path.join(str(tmp_path_factory.getbasetemp()), "k.gguf"),
                      {key: (v, vtype, sub)})
    if _fits(_SCALARS[key], v, vtype):
        check_metadata(scan_gguf(path))
    else:
        _refused(path, f"'{key}'", "expected")


# --------------------------------------------------------------------------- the request


def test_the_context_length_bounds_seq_length(tmp_path) -> None:
    """`llama.context_length` bounds --seq-length as max_position_embeddings does for a
    directory (the probe: context_length 1 with --seq-length 64 compiled; SmolLM2's 8192
    with --seq-length 99999 wrote 168 MB), before any weight is read."""
    path = small_gguf(str(tmp_path / "c.gguf"))
    out = str(tmp_path / "m.toptpu")
    _request(path, out, 64)
    with pytest.raises(CompileError, match=r"--seq-length 65 exceeds max_position_embeddings "
                                           r"64 of .*c\.gguf \(its llama\.\* metadata\)"):
        _request(path, out, 65)
    one = small_gguf(str(tmp_path / "one.gguf"), {"llama.context_length": (1, V.UINT32, None)})
    with pytest.raises(CompileError, match="exceeds max_position_embeddings 1 of"):
        _request(one, out, 64)


def test_the_kv_cache_bounds_seq_length_by_the_chips_memory(tmp_path_factory,
                                                            tmp_path) -> None:
    """--seq-length 100000000 (the probe: torch's allocator failing on 12.8 GB) is refused
    before anything is allocated, naming the KV cache's size and the chip's, for a
    directory whose max_position_embeddings allows it and for a GGUF file."""
    d = str(tmp_path / "ck")
    shutil.copytree(tiny_dir(tmp_path_factory, "qwen2"), d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 2**30
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = str(tmp_path / "m.toptpu")
    with pytest.raises(CompileError) as info:
        _request(d, out, 100_000_000)
    message = str(info.value)
    assert "the KV cache alone would take 51.2 GB (2 x 2 layers x 100000000 positions" in \
        message and "more than a bm1684x's 12.9 GB of memory" in message, message
    assert "use --seq-length" in message
    _request(d, out, 1_000_000)  # 512 MB: fits
    g = small_gguf(str(tmp_path / "g.gguf"), {"llama.context_length": (2**30, V.UINT32, None)})
    with pytest.raises(CompileError, match=r"KV cache alone would take .* more than a "
                                           r"bm1684x's"):
        _request(g, out, 500_000_000)


# --------------------------------------------------------------------------- with a model


def test_nan_or_infinite_scales_are_refused_naming_the_tensor(tmp_path) -> None:
    """A NaN scale in the Q8_0 embedding (also the lm_head; the probe: compiled, and `eval`
    printed "perplexity": Infinity) and an infinite one in a layer's linear: reading the
    tensor is refused, naming it."""
    path = write_gguf(str(tmp_path / "q.gguf"), "llama2", "Q8_0", layers=2)
    header = scan_gguf(path)
    data = bytearray(open(path, "rb").read())
    struct.pack_into("<H", data, header.tensors["token_embd.weight"].offset, 0x7E00)  # NaN
    struct.pack_into("<H", data, header.tensors["blk.1.attn_q.weight"].offset, 0x7C00)  # inf
    with open(path, "wb") as f:
        f.write(bytes(data))
    loaded = load_gguf(path)  # layer 0 (read now) is intact
    assert loaded.stream is not None
    tensors = loaded.stream.reader
    with pytest.raises(GGUFError, match=r"tensor 'token_embd.weight' \(Q8_0\) has NaN or "
                                        r"infinite scales or mins"):
        tensors.tensor("model.embed_tokens.weight")
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.attn_q.weight' \(Q8_0\) has NaN or "
                                        r"infinite scales"):
        tensors.blocks("model.layers.1.self_attn.q_proj.weight")
    tensors.blocks("model.layers.1.self_attn.v_proj.weight")  # the others read as they are


def test_a_file_truncated_after_its_scan_is_an_error_not_a_sigbus(tmp_path) -> None:
    path = write_gguf(str(tmp_path / "t.gguf"), "llama2", "F16", layers=1)
    loaded = load_gguf(path)
    assert loaded.stream is not None
    tensors = loaded.stream.reader
    info = tensors.by_hf["model.norm.weight"]
    os.truncate(path, info.offset)
    with pytest.raises(GGUFError, match="was truncated while it was being read"):
        tensors.tensor("model.norm.weight")


def test_a_chat_template_that_does_not_parse_is_refused_at_compile(tmp_path_factory) -> None:
    """The probe's template compiled and `chat` failed at the first message: refused when
    the model file would be written, naming where it is and the line."""
    d = tiny_dir(tmp_path_factory, "qwen2")
    files = {n: open(os.path.join(d, n), "rb").read()
             for n in ("tokenizer.json", "tokenizer_config.json")}
    check_chat_template({**files, "chat_template.jinja": b"{{ messages[0].content }}"}, d)
    bad = {**files, "chat_template.jinja": b"{% for m in messages %}{{ m.content }"}
    with pytest.raises(CompileError, match=r"chat_template\.jinja: the chat template does not "
                                           r"parse \(line 1: unexpected '}'\)"):
        check_chat_template(bad, d)
    gguf_file = str(tmp_path_factory.mktemp("tmpl") / "t.gguf")
    open(gguf_file, "wb").close()
    with pytest.raises(CompileError, match=r"t\.gguf \(tokenizer\.chat_template\): the chat "
                                           "template does not parse"):
        check_chat_template(bad, gguf_file)


@pytest.mark.slow  # compiles through the command line
@pytest.mark.parametrize("case", ["template", "nan", "overlap"])
def test_hostile_gguf_files_compile_to_one_line(tmp_path, capsys, case: str) -> None:
    """The probe's cases end to end: `toptpu compile` says one line, writes nothing."""
    path = str(tmp_path / f"{case}.gguf")
    if case == "template":
        write_gguf(path, "llama2", "F32", layers=1, metadata={
            "tokenizer.chat_template": ("{% if %}{{ messages }", V.STRING, None)})
        needle = "(tokenizer.chat_template): the chat template does not parse"
    else:
        write_gguf(path, "llama2", "Q8_0", layers=1)
        header = scan_gguf(path)
        data = bytearray(open(path, "rb").read())
        if case == "nan":
            struct.pack_into("<H", data, header.tensors["token_embd.weight"].offset, 0x7E00)
            needle = "tensor 'token_embd.weight' (Q8_0) has NaN or infinite scales"
        else:
            q, o = (header.tensors[f"blk.0.attn_{n}.weight"] for n in ("q", "output"))
            data = bytearray(_with_offset(bytes(data), b"blk.0.attn_q.weight",
                                          o.offset - header.data_start))
            assert q.nbytes == o.nbytes
            needle = "tensor 'blk.0.attn_q.weight' has data offset"
        with open(path, "wb") as f:
            f.write(bytes(data))
    out = str(tmp_path / "m.toptpu")
    code, _, err = cli(["compile", path, "-o", out, "--seq-length", "32",
                        "--max-input-length", "8", "--quiet"], capsys)
    assert_one_error(code, err, "compile", needle)
    assert sorted(os.listdir(tmp_path)) == [f"{case}.gguf"]
