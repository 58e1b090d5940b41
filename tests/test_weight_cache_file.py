"""The weight cache file (`toptpu cache`): a model file's converted weights made once and
read by later processes. With it the executors convert nothing (their in-memory caches stay
empty) and give the same bits as without it, on the machine (fast and checked) and the
interpreter. It is refused — left unused with a note, or an error when named — unless it is
this model file's: a cache of another file, a truncated or corrupt container, a header
whose forms do not name the model's tensors, bytes that differ from the model file's
conversion (found on first use, or by `--check`), a path that is not a regular file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from llm_fixtures import compiled

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.formats.model_file import ModelFile, write_model_file
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.weight_cache_file import (
    WeightCacheFileError,
    cache_path,
    open_weight_cache,
    planned_bytes,
    planned_forms,
    write_weight_cache,
)
from toptpu.cli import main

pytestmark = pytest.mark.slow  # compiles a model file

SEQ, L = 96, 48
IDS = [3 + (i * 7) % 300 for i in range(21)]  # block at 48: both lengths' nets get used


@pytest.fixture
def model(tmp_path_factory, tmp_path) -> str:
    """A private copy of a w4bf16 file (a16 weights and a bf16 lm_head), so the cache file
    written beside it is seen by this test only."""
    src = compiled(tmp_path_factory, "qwen2", "w4bf16", seq=SEQ, input_len=L).model_file
    path = str(tmp_path / "model.toptpu")
    shutil.copyfile(src, path)
    return path


def _uncached(path: str, executor: str = "machine") -> tuple[np.ndarray, list[int]]:
    rt = Runtime.open(path, executor, weight_cache=None)
    return rt.prompt_logits(IDS), rt.generate(IDS, 8, stop_on_eos=False).generated_ids


def test_the_cache_gives_the_same_bits_and_converts_nothing(model: str) -> None:
    want_logits, want_ids = _uncached(model)
    forms = planned_forms(LlmFile(model))
    assert {f.form for f in forms} == {"a16", "f32"}  # the layers' matmuls, the lm_head
    assert len([f for f in forms if f.form == "a16"]) == 2 * 7  # 2 layers x 7 projections
    path = write_weight_cache(model)
    assert path == cache_path(model) == model + ".wcache"
    for executor in ("machine", "interpreter"):
        rt = Runtime.open(model, executor)
        assert rt.weight_cache_file == path and rt.notes == []
        logits = rt.prompt_logits(IDS)
        assert logits.dtype == want_logits.dtype and np.array_equal(logits, want_logits)
        assert rt.generate(IDS, 8, stop_on_eos=False).generated_ids == want_ids
        cache = rt.ex.machine.cache if executor == "machine" else rt.ex.cache
        assert len(cache) == 0, executor  # nothing converted in this process
        assert rt.ex.stored.hits > 0
    # the checked machine (slices of the weights, windows of the stored forms)
    checked = Runtime(MachineExecutor(model, checked=True))
    checked.ex.use_weight_cache(open_weight_cache(checked.ex.file))
    assert np.array_equal(checked.prompt_logits(IDS), want_logits)
    assert len(checked.ex.machine.cache) == 0


def test_the_cli_writes_checks_and_uses_the_cache(model: str, capsys) -> None:
    assert main(["cache", model, "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().err
    assert main(["cache", model, "--check"]) == 0
    assert "each equal to the model file's conversion" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "toptpu.cli", "run", model, "--ids",
                          ",".join(map(str, IDS)), "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["weight_cache_file"] == cache_path(model)
    assert out.stderr == ""


def test_a_cache_of_another_model_file_is_refused(model: str, tmp_path_factory,
                                                  tmp_path) -> None:
    other = str(tmp_path / "other.toptpu")
    shutil.copyfile(compiled(tmp_path_factory, "qwen2", "w4bf16", seq=SEQ,
                             input_len=16).model_file, other)
    write_weight_cache(model, cache_path(other))  # the first file's forms beside the other
    rt = Runtime.open(other)
    assert rt.weight_cache_file is None
    assert len(rt.notes) == 1 and "was made from another model file" in rt.notes[0]
    assert "toptpu cache" in rt.notes[0]
    logits, ids = _uncached(other)
    assert np.array_equal(rt.prompt_logits(IDS), logits)
    with pytest.raises(WeightCacheFileError, match="was made from another model file"):
        Runtime.open(other, weight_cache=cache_path(other))


def _rewrite(path: str, edit) -> None:  # noqa: ANN001
    """Write the cache file again with its header edited by `edit` (checksums made anew:
    only the checks of the fields can refuse it)."""
    with ModelFile(path, verify_checksums=False) as f:
        header = json.loads(json.dumps(f.header))
        sections = {n: f.read(n) for n in f.sections}
    edit(header, sections)
    write_model_file(path, header, sections)


def _form(header: dict, i: int = 0) -> dict:
    return header["forms"][i]


@pytest.mark.parametrize(("damage", "message"), [
    ("truncate", r"is unusable \(is truncated"),
    ("header byte", r"is unusable \(is corrupt: checksum mismatch in the header\)"),
    ("model file", r"is not a weight cache file \(kind 'toptpu-llm'\)"),
    ("digest", r"has an invalid header: model_digest is not 64 lowercase hex digits"),
    ("source", r"names a weight at blob offset 1, where the model file's weight table has "
               r"no tensor \(forms\[0\]\)"),
    ("shape", r"upcasts a bfloat16 \[\d+, 64\] weight to \[\d+, 32\] \(forms\[0\]\)"),
    ("bits", r"forms\[1\]\.bits is 3, not 4 or 8"),
    ("section", r"has a section 'extra' that no form names"),
    ("twice", r"forms\[1\] converts the same weight as forms\[0\]"),
])
def test_a_damaged_cache_is_refused_naming_the_problem(model: str, damage: str,
                                                       message: str) -> None:
    path = write_weight_cache(model)
    if damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    elif damage == "header byte":
        with open(path, "r+b") as f:
            f.seek(60)
            byte = f.read(1)
            f.seek(60)
            f.write(bytes([byte[0] ^ 0x20]))
    elif damage == "model file":
        shutil.copyfile(model, path)
    else:
        def edit(h: dict, sections: dict) -> None:
            if damage == "digest":
                h["model_digest"] = "xyz"
            elif damage == "source":
                _form(h)["source"] = 1
            elif damage == "shape":
                _form(h)["shape"] = [_form(h)["shape"][0], 32]
                sections[_form(h)["section"]] = sections[_form(h)["section"]][
                    :len(sections[_form(h)["section"]]) // 2]
            elif damage == "bits":
                _form(h, 1)["bits"] = 3
            elif damage == "section":
                sections["extra"] = b"\0" * 8
            elif damage == "twice":
                h["forms"][1] = {**_form(h), "section": _form(h, 1)["section"]}

        _rewrite(path, edit)
    rt = Runtime.open(model)
    assert rt.weight_cache_file is None and len(rt.notes) == 1
    assert "toptpu cache" in rt.notes[0]
    with pytest.raises(WeightCacheFileError, match=message):
        open_weight_cache(LlmFile(model), path)


def test_bytes_that_differ_from_the_model_files_conversion_are_refused(model: str) -> None:
    """A changed sampled row is found on the form's first use: the file is turned off (a
    note says why) and the weights are converted, with the same bits. A change in a row no
    first use samples is found by `toptpu cache --check`."""
    want_logits, _ = _uncached(model)
    path = write_weight_cache(model)
    llm = LlmFile(model)
    stored = open_weight_cache(llm, path)
    form = next(f for f in stored._forms.values() if f.form == "a16")  # noqa: SLF001
    offset = stored._container.sections[form.section].offset  # noqa: SLF001
    stored.close()
    cols = form.shape[1]
    with open(path, "r+b") as f:  # row 0, column 0: sampled
        f.seek(offset)
        f.write(np.float32(1234.5).tobytes())
    rt = Runtime.open(model)
    assert rt.weight_cache_file == path  # the header is fine: found on first use
    logits = rt.prompt_logits(IDS)
    assert np.array_equal(logits, want_logits)
    assert rt.weight_cache_file is None
    assert len(rt.notes) == 1 and f"form {form.section}" in rt.notes[0]
    assert "does not match the model file" in rt.notes[0]
    # restore row 0; change row 1 (rows 0 and n-1 and ones spread between are sampled)
    path = write_weight_cache(model)
    with open(path, "r+b") as f:
        f.seek(offset + 4 * cols + 4)
        f.write(np.float32(1234.5).tobytes())
    with pytest.raises(WeightCacheFileError, match=f"form {form.section} .* differs"):
        open_weight_cache(LlmFile(model), path).verify()
    assert main(["cache", model, "--check"]) == 1


def test_a_cache_path_that_is_not_a_regular_file_is_neither_read_nor_replaced(
        model: str, capsys) -> None:
    path = cache_path(model)
    os.mkfifo(path)
    rt = Runtime.open(model)  # a FIFO there is not opened (it would block)
    assert rt.weight_cache_file is None
    assert len(rt.notes) == 1 and "is not a regular file" in rt.notes[0]
    assert main(["cache", model, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "is not a regular file" in err and "Traceback" not in err
    assert os.path.exists(path) and not os.path.isfile(path)  # still the FIFO
    os.unlink(path)
    os.mkdir(path)
    assert Runtime.open(model).weight_cache_file is None
    assert main(["cache", model, "--quiet"]) == 1
    assert "is a directory" in capsys.readouterr().err


def test_a_cache_written_in_place_while_in_use_stops_the_run(model: str) -> None:
    """Its mapped forms would fault or be other numbers: the next net run says so. A new
    `toptpu cache` renamed over it is harmless (the mapping holds the one opened)."""
    want_logits, _ = _uncached(model)
    path = write_weight_cache(model)
    rt = Runtime.open(model)
    assert np.array_equal(rt.prompt_logits(IDS), want_logits)
    write_weight_cache(model)  # replaced: the run goes on with the file it opened
    assert np.array_equal(rt.prompt_logits(IDS), want_logits)
    rt = Runtime.open(model)
    rt.prompt_logits(IDS)
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(WeightCacheFileError, match="weight cache file .* changed while in "
                                                   "use"):
        rt.prompt_logits(IDS)


def test_a_vocabulary_split_lm_head_reads_the_whole_form_from_the_cache(tmp_path) -> None:  # noqa: ANN001
    """At Qwen's vocabulary (151936) an lm_head of hidden 512 does not fit local memory
    whole. It is split over its vocabulary: a split along K (reduction parts, each part a
    strided window of the weight) costs the same to well within `REDUCTION_MARGIN`, so the
    reduction stays whole. Each slice's weights are rows of the stored f32 form; a decode
    step reads them from the cache file (the fast mode's one joined product over the
    whole form): the same bits as converting, fast and checked, nothing converted in
    memory. (The stored windows of K parts: tests/test_stored_form_windows.py.)"""
    import torch
    import transformers as tf

    from toptpu.backend.formats.commands import Compute
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.tiny_models import build_tokenizer

    cfg = tf.Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(0)
    path = str(tmp_path / "wide-vocab.toptpu")
    compile_model(tf.Qwen2ForCausalLM(cfg).eval(), path, mode="w4bf16", seq_length=32,
                  max_input_length=16, tokenizer=build_tokenizer(), progress=None)
    ex = MachineExecutor(path)
    heads = [c for c in ex.program("lm_head").commands
             if isinstance(c, Compute) and c.kind == "tpu.matmul"]
    assert len(heads) > 1 and {c.parts for c in heads} == {1}  # by vocabulary, K whole

    def last_logits(rt: Runtime) -> tuple[list[int], np.ndarray]:
        ids = rt.generate(IDS[:5], 4, stop_on_eos=False).generated_ids
        return ids, rt.ex.read(rt.sampler.logits)  # the last decode step's lm_head

    want_ids, want_logits = last_logits(Runtime.open(path, weight_cache=None))
    write_weight_cache(path)
    for checked in (False, True):
        rt = Runtime(MachineExecutor(path, checked=checked))
        rt.ex.use_weight_cache(open_weight_cache(rt.ex.file))
        ids, logits = last_logits(rt)
        assert ids == want_ids and np.array_equal(logits, want_logits)
        assert len(rt.ex.machine.cache) == 0  # every form read from the file
        assert rt.ex.stored.hits > 0


def test_a_gguf_file_of_scale_and_min_types_gives_the_same_bits_with_its_cache(
        tmp_path) -> None:  # noqa: ANN001
    """A GGUF whose linears are Q4_1 (layer 0) and Q4_K (layer 1), kept as they are (-q
    auto: 4-bit integers, f16 scales and f16 mins, `q * s + m`): every a16 form of the cache
    names its mins and is `kernels.dequantize(..., mins=...)` of the model file's bytes
    (`--check`); with it the machine (fast and checked) and the interpreter give the logits
    and tokens they give without it, converting nothing. A file spread over several
    devices is refused in one line."""
    from gguf_fixtures import gguf_dir

    from toptpu.compiler import compile as compile_model

    types = {f"blk.{i}.{lin}.weight": t for i, t in enumerate(("Q4_1", "Q4_K"))
             for lin in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                         "ffn_down")}
    d = gguf_dir(str(tmp_path / "src"), "llama2", "Q8_0", types=types, hidden_size=256,
                 intermediate_size=512)
    path = str(tmp_path / "mins.toptpu")
    compile_model(d, path, mode="auto", seq_length=48, max_input_length=16,
                  prefill_lengths=[8, 16], progress=None)
    forms = planned_forms(LlmFile(path))
    a16 = [f for f in forms if f.form == "a16"]
    assert len(a16) == 2 * 7 and all(f.mins >= 0 and f.zeros < 0 for f in a16)
    ids = IDS[:12]  # a chunk at 16, then decode
    want = {}
    for executor in ("machine", "interpreter"):
        rt = Runtime.open(path, executor, weight_cache=None)
        want[executor] = (rt.prompt_logits(ids[:5]),
                          rt.generate(ids, 6, stop_on_eos=False).generated_ids)
    assert want["machine"][1] == want["interpreter"][1]
    assert main(["cache", path, "--quiet"]) == 0
    assert main(["cache", path, "--check"]) == 0  # every byte: dequantize with mins
    for executor in ("machine", "interpreter"):
        rt = Runtime.open(path, executor)
        assert rt.weight_cache_file == cache_path(path) and rt.notes == []
        logits = rt.prompt_logits(ids[:5])
        assert logits.dtype == want[executor][0].dtype
        assert np.array_equal(logits, want[executor][0]), executor
        assert rt.generate(ids, 6, stop_on_eos=False).generated_ids == want[executor][1]
        cache = rt.ex.machine.cache if executor == "machine" else rt.ex.cache
        assert len(cache) == 0 and rt.ex.stored.hits > 0, executor
    checked = Runtime(MachineExecutor(path, checked=True))
    checked.ex.use_weight_cache(open_weight_cache(checked.ex.file))
    assert np.array_equal(checked.prompt_logits(ids[:5]), want["machine"][0])
    assert len(checked.ex.machine.cache) == 0 and checked.ex.stored.hits > 0


def test_a_multi_device_file_has_no_weight_cache_file(tmp_path_factory, capsys) -> None:
    """`toptpu cache` refuses a file spread over several devices in one line; `run` reads
    no cache for it (one placed beside it is refused with a note)."""
    built = compiled(tmp_path_factory, "qwen2", seq=64, input_len=16, devices=2,
                     parallel="pp")
    assert main(["cache", built.model_file, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "spread over 2 devices (pp)" in err and err.count("\n") == 1, err
    with pytest.raises(WeightCacheFileError, match="no weight cache file for a "
                                                   "multi-device model file"):
        write_weight_cache(built.model_file, str(tmp_path_factory.mktemp("c") / "x.wcache"))
    assert Runtime.open(built.model_file).weight_cache_file is None


def test_the_reduction_parts_a_net_reads_are_stored_contiguous(tmp_path) -> None:  # noqa: ANN001
    """Qwen2.5-0.5B's MLP widths (896, 4864) at 128 tokens: the down projection's K is
    split in parts (blocks of output channels x parts of its 4864 inputs). Each part's
    weights are a window of the whole form with rows of a few KB; the cache file stores
    every such part contiguous beside the whole forms, and the machine reads them there:
    nothing copied or converted in memory (fast and checked), the bits of converting, and
    `--check` compares every byte of them too."""
    import torch
    import transformers as tf

    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.tiny_models import build_tokenizer

    cfg = tf.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=1,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=384,
                         eos_token_id=2)
    torch.manual_seed(0)
    path = str(tmp_path / "mlp-widths.toptpu")
    compile_model(tf.Qwen2ForCausalLM(cfg).eval(), path, mode="w4bf16", seq_length=160,
                  max_input_length=128, prefill_lengths=[128], tokenizer=build_tokenizer(),
                  progress=None)
    forms = planned_forms(LlmFile(path))
    parts = [f for f in forms if f.part]
    # the parts tile the down projection: K (4864) cut in parts, the output channels in
    # blocks (how many of each the layer group chooses by cost on the default chip)
    (shape,) = {f.shape for f in parts}
    assert shape[1] < 4864 and 4864 % shape[1] == 0 and 896 % shape[0] == 0
    assert len(parts) == (896 // shape[0]) * (4864 // shape[1]) >= 4
    assert sorted((f.part[0], f.part[2]) for f in parts) == sorted(
        (r, c) for r in range(0, 896, shape[0]) for c in range(0, 4864, shape[1]))
    assert {f.source for f in parts} == {f.source for f in forms if not f.part
                                         and f.shape == (896, 4864)}  # the down projection
    ids = [3 + (i * 7) % 300 for i in range(100)]
    want = Runtime.open(path, weight_cache=None).prompt_logits(ids)
    write_weight_cache(path)
    assert main(["cache", path, "--check", "--quiet"]) == 0
    for checked in (False, True):
        rt = Runtime(MachineExecutor(path, checked=checked))
        rt.ex.use_weight_cache(open_weight_cache(rt.ex.file))
        got = rt.prompt_logits(ids)
        assert got.dtype == want.dtype and np.array_equal(got, want), checked
        assert len(rt.ex.machine.cache) == 0, checked  # no part copied, nothing converted
    # a part that is not inside its weight's form is refused when the file is opened

    def edit(h: dict, sections: dict) -> None:
        bad = next(f for f in h["forms"] if f["part"])
        bad["part"] = [0, shape[0], 4096, shape[1]]  # past the 4864 columns

    _rewrite(write_weight_cache(path), edit)
    with pytest.raises(WeightCacheFileError, match=rf"has a part \[0, {shape[0]}, 4096, "
                       rf"{shape[1]}\] outside the \[896, 4864\] form of a uint8 \[896, "
                       r"2432\] weight"):
        open_weight_cache(LlmFile(path))


# --------------------------------------------------------------------------- written by a run


def _shown(n: int) -> str:
    """A size as the notes print it: GB from 1 GB, MB below."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _run_cli(model: str, **env: str) -> tuple[dict, str]:
    """`toptpu run MODEL --json` in a fresh process with `env` added: (its JSON, stderr)."""
    out = subprocess.run([sys.executable, "-m", "toptpu.cli", "run", model, "--ids",
                          ",".join(map(str, IDS)), "--max-new-tokens", "4", "--json"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout), out.stderr


def test_a_run_writes_the_cache_for_the_next_run_and_says_its_size(model: str) -> None:
    want_logits, want_ids = _uncached(model)
    path = cache_path(model)
    first, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="auto")
    assert first["weight_cache_file"] is None  # this run converted its weights
    size = planned_bytes(LlmFile(model))
    assert f"writing the weight cache file '{path}' ({_shown(size)}, " in err
    assert "x the model file's" in err and "TOPTPU_WEIGHT_CACHE_FILE=off" in err
    assert os.path.isfile(path) and size <= os.path.getsize(path) < size + (1 << 20)
    second, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="auto")
    assert second["weight_cache_file"] == path and err == ""  # read, not written again
    assert second["generated_ids"] == first["generated_ids"] == want_ids[:4]
    rt = Runtime.open(model)
    assert rt.weight_cache_file == path
    assert np.array_equal(rt.prompt_logits(IDS), want_logits)


def test_the_off_switch_and_the_limit_are_honoured(model: str) -> None:
    path = cache_path(model)
    _, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="off")
    assert err == "" and not os.path.exists(path)
    size = planned_bytes(LlmFile(model))
    limit = size - 1  # one byte short
    _, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE=str(limit))
    assert f"would take {_shown(size)} " in err and "not written" in err
    assert f"toptpu cache {model}" in err and not os.path.exists(path)
    _, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE=str(size))
    assert "writing the weight cache file" in err and os.path.isfile(path)
    bad = subprocess.run([sys.executable, "-m", "toptpu.cli", "run", model, "--ids", "3",
                          "--max-new-tokens", "1"], capture_output=True, text=True,
                         env={**os.environ, "TOPTPU_WEIGHT_CACHE_FILE": "lots"})
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "toptpu run: error: TOPTPU_WEIGHT_CACHE_FILE='lots' is not a setting: give auto, off "
        "or the most bytes the weight cache file may take (e.g. 8G)"]


def test_a_stale_cache_is_refused_and_replaced_after_the_model_file_changes(
        model: str, tmp_path_factory) -> None:
    """The model file recompiled in place: the run refuses the old file's forms (a note),
    converts, and writes this file's; the next run reads those."""
    path = cache_path(model)
    write_weight_cache(model)
    old = open_weight_cache(LlmFile(model), path).model.file.digest
    other = compiled(tmp_path_factory, "qwen2", "w4bf16", seq=SEQ, input_len=16).model_file
    shutil.copyfile(other, model)  # "recompiled"
    assert LlmFile(model).file.digest != old
    want_logits, _ = _uncached(model)
    first, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="auto")
    assert first["weight_cache_file"] is None
    assert "was made from another model file" in err
    assert "writing the weight cache file" in err
    second, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="auto")
    assert second["weight_cache_file"] == path and err == ""
    rt = Runtime.open(model)
    assert np.array_equal(rt.prompt_logits(IDS), want_logits)


def test_a_file_of_another_kind_at_the_cache_path_is_left_alone(model: str) -> None:
    path = cache_path(model)
    with open(path, "wb") as f:
        f.write(b"not a weight cache file")
    _, err = _run_cli(model, TOPTPU_WEIGHT_CACHE_FILE="auto")
    assert "not written" in err and "not a weight cache file" in err
    with open(path, "rb") as f:
        assert f.read() == b"not a weight cache file"
