"""A model file is untrusted input: every byte is checked, every header field is typed and
ranged, the tokenizer's names never become paths, and a killed write leaves nothing
behind for good.

The file under test is the small compiled qwen2 of `llm_fixtures` (compiled once per
session). Flips are made in place on a copy and undone after each load; header-field
mutations are written with `write_model_file`, which recomputes every checksum, so that
the schema is what refuses them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled, tiny_dir
from vlm_fixtures import vlm_dir

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.formats.model_file import (
    ALIGN,
    HEADER_OFFSET,
    ModelFile,
    ModelFileError,
    remove_stale_temp_files,
    temp_path,
    write_model_file,
)
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime, Tokenizer
from toptpu.cli import main

Json = Any


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2").model_file


@pytest.fixture(scope="module")
def parts(small_file: str) -> tuple[dict[str, Json], dict[str, bytes]]:
    """The small file's header (JSON) and sections."""
    with ModelFile(small_file) as f:
        return copy.deepcopy(f.header), {n: f.read(n) for n in f.sections}


def _header_end(path: str) -> int:
    with open(path, "rb") as f:
        _, _, hlen = struct.unpack("<8sII", f.read(16))
    return HEADER_OFFSET + hlen


def _flip(path: str, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def _refusal(path: str) -> str | None:
    """The one-line ModelFileError loading `path` gives, None if it loads (any other
    exception fails the test)."""
    try:
        LlmFile(path).close()
    except ModelFileError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(("'", "cannot open")), message
        assert path in message
        return message
    return None


def _refused_after_flip(path: str, pos: int, bit: int) -> str:
    _flip(path, pos, bit)
    try:
        message = _refusal(path)
    finally:
        _flip(path, pos, bit)
    assert message is not None, f"a flip of bit {bit} at byte {pos} was accepted"
    return message


# ------------------------------------------------------------------ bytes


@pytest.mark.slow  # loads the model file once per header byte
def test_every_header_byte_flipped_is_refused(small_file: str, tmp_path) -> None:
    """Each byte of the prefix and the header JSON, one bit flipped in turn: refused."""
    path = str(tmp_path / "m.toptpu")
    shutil.copy(small_file, path)
    end = _header_end(path)
    kinds: dict[str, int] = {}
    for pos in range(end):
        message = _refused_after_flip(path, pos, pos % 8)
        kind = next((k for k in ("checksum", "magic", "version", "truncated") if k in message),
                    message)
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"{end} header bytes flipped, all refused: {kinds}")
    assert _refusal(path) is None  # every flip was undone: the file loads again


@pytest.mark.slow  # hypothesis: many corrupted copies
@fuzz_settings(500)
@given(data=st.data())
def test_random_bit_flips_anywhere_are_refused(small_file: str, tmp_path_factory,
                                               data: st.DataObject) -> None:
    path = _work_copy(small_file, tmp_path_factory)
    size = os.path.getsize(path)
    bit = data.draw(st.integers(0, size * 8 - 1), label="bit of the file")
    _refused_after_flip(path, bit // 8, bit % 8)


_COPIES: dict[str, str] = {}


def _work_copy(src: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One copy per session to flip bits in (each flip is undone after its load)."""
    if src not in _COPIES:
        _COPIES[src] = str(tmp_path_factory.mktemp("flips") / "m.toptpu")
        shutil.copy(src, _COPIES[src])
    return _COPIES[src]


def test_one_byte_of_eos_ids_padding_and_tail_are_refused(small_file: str, tmp_path) -> None:
    """The cases of issue 11: an edited eos id (the header is checksummed now), a byte in
    the padding between sections, bytes after the last section, an old format version."""
    data = open(small_file, "rb").read()
    with ModelFile(small_file) as f:
        gap = next(s.offset + s.size for s in f.sections.values() if (s.offset + s.size) % ALIGN)
    assert data[gap:gap + 1] == b"\x00"
    eos = data.index(b'"eos_token_ids": [') + len(b'"eos_token_ids": [')
    cases = {
        "eos": (eos, b"3", "checksum mismatch in the header"),
        "padding": (gap, b"\x01", "nonzero bytes in the padding before section"),
        "tail": (len(data), b"\x00", "1 bytes follow the last section"),
        "old version": (8, b"\x01", "old format version 1 (this toptpu reads 2); recompile"),
    }
    for name, (pos, new, message) in cases.items():
        path = str(tmp_path / f"{name}.toptpu")
        with open(path, "wb") as f:
            f.write(data[:pos] + new + data[pos + len(new):])
        with pytest.raises(ModelFileError, match=re.escape(message)):
            LlmFile(path)
        with pytest.raises(ModelFileError, match=re.escape(message)):
            Runtime.open(path)


# ------------------------------------------------------------------ header fields


def _paths(node: Json, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into the header JSON (objects by key, lists by index)."""
    if prefix:
        yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _leaves(node: Json) -> Iterator[Json]:
    if isinstance(node, dict | list):
        for child in (node.values() if isinstance(node, dict) else node):
            yield from _leaves(child)
    else:
        yield node


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=3),
    max_leaves=6)


def _mutate(header: Json, path: tuple[Any, ...], op: str, value: Json) -> None:
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    key, old = path[-1], parent[path[-1]]
    if op == "delete":
        del parent[key]
    elif op == "nudge" and type(old) in (int, float) and type(value) is int and value:
        parent[key] = old + value
    elif op == "append" and isinstance(old, list):
        old.append(value)
    elif op == "append" and isinstance(old, dict):
        old[f"extra{len(old)}"] = value
    else:
        parent[key] = value


def _header_mutations(header: Json) -> st.SearchStrategy[tuple[tuple[Any, ...], str, Json]]:
    paths = sorted(_paths(header), key=repr)
    own_values = sorted({json.dumps(v) for v in _leaves(header)})
    value = _JSON | st.sampled_from(own_values).map(json.loads) | st.integers(-3, 3)
    return st.tuples(st.sampled_from(paths),
                     st.sampled_from(["replace", "nudge", "delete", "append"]), value)


@pytest.fixture(scope="module")
def mutations(parts: tuple[dict[str, Json], dict[str, bytes]]) -> st.SearchStrategy:
    return _header_mutations(parts[0])


@pytest.mark.slow  # hypothesis: many mutated headers
@fuzz_settings(120)
@given(data=st.data())
def test_header_field_mutations_are_refused_or_valid(parts, mutations, tmp_path_factory,
                                                     monkeypatch, data: st.DataObject) -> None:
    """One header field deleted, replaced by any JSON value or one of the header's own,
    nudged by a few units, or given an extra entry; checksums recomputed. Either the load
    (or the machine's loading of a net's command stream) is refused with a one-line
    message, or the file loads with exactly the values written and generates tokens."""
    header, sections = parts
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test here
    path_, op, value = data.draw(mutations, label="mutation")
    mutated = copy.deepcopy(header)
    _mutate(mutated, path_, op, value)
    path = str(tmp_path_factory.getbasetemp() / "mutated.toptpu")
    write_model_file(path, mutated, sections)
    if _refusal(path) is not None:
        return
    f = LlmFile(path)
    assert f.header == mutated  # nothing coerced, clipped or filled in
    try:  # the machine checks each net's command stream against the header when it loads it
        res = Runtime(MachineExecutor(f)).generate(list(range(1, 21)), 2)  # every text net
    except ModelFileError as e:
        assert "\n" not in str(e) and str(e).startswith(f"'{path}': "), e
        return
    assert 1 <= len(res.generated_ids) <= 2
    f.close()


def test_a_field_error_names_the_field(parts, tmp_path) -> None:
    header, sections = parts
    vocab = header["model"]["vocab_size"]
    cases: list[tuple[Callable[[Json], None], str]] = [
        (lambda h: h["generation"]["eos_token_ids"].append(vocab),
         rf"generation.eos_token_ids\[2\] is {vocab}, outside the vocabulary of {vocab}"),
        (lambda h: h["nets"]["block"]["inputs"][2]["shape"].__setitem__(3, 17),
         r"nets.block.inputs\[2\] is attention_mask float32 \[1, 1, 16, 17\], the net "
         r"contract .* is attention_mask float32 \[1, 1, 16, 16\]"),
        (lambda h: h["nets"]["lm_head"]["outputs"][0].__setitem__("dtype", "float128"),
         r"nets.lm_head.outputs\[0\].dtype is 'float128', not a known dtype"),
        (lambda h: h["nets"]["lm_head"].__setitem__("weights", ["norm.weight", "nope"]),
         r"nets.lm_head.weights\[1\] is 'nope', which the weight table does not have"),
        (lambda h: h["model"].__setitem__("num_layers", 2.0),
         r"model.num_layers is 2.0, not an integer"),
        (lambda h: h["shapes"].pop("max_history"), r"shapes.max_history is missing"),
        (lambda h: h["nets"]["lm_head"].__setitem__("pipeline", None),  # found by hypothesis
         r"nets.lm_head.pipeline is null: an optional field is left out when it has no "
         r"value"),
        (lambda h: h["nets"].__setitem__("rm -rf", h["nets"]["lm_head"]),
         r"nets\['rm -rf'\] is 'rm -rf', not a name"),
    ]
    for i, (edit, message) in enumerate(cases):
        bad = copy.deepcopy(header)
        edit(bad)
        path = str(tmp_path / f"{i}.toptpu")
        write_model_file(path, bad, sections)
        with pytest.raises(ModelFileError, match=f"invalid header: {message}"):
            LlmFile(path)


# ------------------------------------------------------------------ tokenizer names


EVIL_NAMES = ["../../PWNED", "sub/tokenizer.json", "..", "tokenizer.json\x00x",
              "TOKENIZER.JSON"]


def test_crafted_tokenizer_names_are_refused_and_nothing_is_written(
        parts, tmp_path, monkeypatch, capsys) -> None:
    """A model file whose tokenizer entries carry path names (valid checksums, so the name
    check is what refuses it), and the tokenizer built from such entries directly: nothing
    is written anywhere (not outside, not in a temporary directory)."""
    header, sections = parts
    outside = tmp_path / "outside"
    outside.mkdir()
    scratch, cwd = tmp_path / "tmp", tmp_path / "cwd" / "deeper"
    scratch.mkdir()
    cwd.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where a temp dir would go
    monkeypatch.chdir(cwd)  # where relative names would land
    names = [str(outside / "PWNED"), *EVIL_NAMES]
    for i, name in enumerate(names):
        bad, secs = copy.deepcopy(header), dict(sections)
        files = bad["tokenizer"]["files"]
        files.append(name)
        secs[f"tokenizer:{name}"] = b"owned\n"
        path = str(tmp_path / f"evil{i}.toptpu")
        write_model_file(path, bad, secs)
        pos = len(files) - 1
        with pytest.raises(ModelFileError, match=rf"tokenizer.files\[{pos}\] is .*not a known "
                                                 r"tokenizer file name"):
            Runtime.open(path)
    assert main(["run", path, "--chat-template", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("toptpu run: error: ") and "not a known tokenizer file name" in err
    assert err.count("\n") == 1
    # the runtime's tokenizer never writes its files, whatever their names
    files = {n[len("tokenizer:"):]: d for n, d in sections.items() if n.startswith("tokenizer:")}
    tok = Tokenizer({**files, **{n: b"owned\n" for n in names}})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True)
    assert text.endswith("assistant\n")
    assert list(outside.iterdir()) == [] and list(scratch.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "cwd").rglob("*")) == ["deeper"]


def _today(files: dict[str, bytes], directory: str) -> Any:
    """The tokenizer as toptpu built it before (files written out, then from_pretrained):
    the reference the in-memory build must match."""
    from transformers import AutoTokenizer

    os.makedirs(directory)
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


PROBE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}"
         + "".join("{{ " + k + " | default('-') }}," for k in (
             "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
             "mask_token", "image_token", "video_token"))
         + "{% if add_generation_prompt %}GEN{% endif %}")


def _variants(files: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    """The tokenizer files as saved, and as older checkpoints lay them out: the template in
    tokenizer_config.json with AddedToken dicts, special tokens in special_tokens_map.json,
    model-specific tokens; with a template that prints every special token."""
    config = json.loads(files["tokenizer_config.json"])
    legacy = {**config, "chat_template": PROBE, "image_token": "<|im_start|>",
              "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>",
                            "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}}
    tokens = {k: v for k, v in config.items() if k.endswith("_token")}
    return {
        "as saved": files,
        "probe": {**files, "chat_template.jinja": PROBE.encode()},
        "template in config": {"tokenizer.json": files["tokenizer.json"],
                               "tokenizer_config.json": json.dumps(legacy).encode()},
        "special_tokens_map": {
            "tokenizer.json": files["tokenizer.json"], "chat_template.jinja": PROBE.encode(),
            "tokenizer_config.json": json.dumps(
                {k: v for k, v in config.items() if k not in tokens}).encode(),
            "special_tokens_map.json": json.dumps(
                {**tokens, "unk_token": "<|endoftext|>", "video_token": "<v>"}).encode()},
    }


@pytest.mark.slow  # builds a vision-language model
@pytest.mark.parametrize("family", ["qwen2", "minicpmv"])
def test_chat_template_in_memory_renders_as_from_pretrained(tmp_path_factory, tmp_path,
                                                            family: str) -> None:
    """The text (and so the token ids) of a chat are those transformers renders from the
    tokenizer directory, for the tiny LM's tokenizer and a VLM's (with its image tokens),
    as saved and in older layouts."""
    model_dir = (tiny_dir if family == "qwen2" else vlm_dir)(tmp_path_factory, family)
    files = {n: open(os.path.join(model_dir, n), "rb").read() for n in os.listdir(model_dir)
             if n.startswith(("tokenizer", "chat_template", "special_tokens"))}
    conversations = [
        [{"role": "user", "content": "Hello <|im_end|> there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}],
    ]
    for name, variant in _variants(files).items():
        ours = Tokenizer(variant)
        ref = _today(variant, str(tmp_path / family / name.replace(" ", "-")))
        for messages in conversations:
            for gen in (False, True):
                want = ref.apply_chat_template(messages, add_generation_prompt=gen,
                                               tokenize=False)
                assert ours.apply_chat_template(messages, gen) == want, (name, messages, gen)


# ------------------------------------------------------------------ temporary files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path) -> None:
    target = str(tmp_path / "m.toptpu")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead, live = temp_path(target, _dead_pid()), temp_path(target, sleeper.pid)
        others = [str(tmp_path / n) for n in (".m.toptpu.tmp-12x", ".m.toptpu.tmp-",
                                              ".other.toptpu.tmp-1", "m.toptpu.tmp-1")]
        for p in (dead, live, *others):
            open(p, "wb").write(b"half a model file")
        write_model_file(target, {"kind": "test"}, {"x": b"123"})
        assert not os.path.exists(dead) and os.path.exists(live)
        assert all(os.path.exists(p) for p in others)
        assert remove_stale_temp_files(target) == []
        ModelFile(target).close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_temp_files(target) == [live]


def test_a_symlink_at_the_temporary_name_is_not_followed(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    target = str(tmp_path / "m.toptpu")
    os.symlink(victim, temp_path(target))  # planted at this process's temporary name
    write_model_file(target, {"kind": "test"}, {"x": b"123"})
    assert victim.read_bytes() == b"keep me"
    ModelFile(target).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.toptpu", "victim"]


KILLED_WRITER = """
import os, signal, sys
from toptpu.backend.formats import model_file
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed before the rename
model_file.write_model_file(sys.argv[1], {"kind": "test"}, {"x": b"123" * 5000})
"""


def test_a_killed_write_leaves_no_model_file_and_is_cleaned_up(tmp_path) -> None:
    target = str(tmp_path / "m.toptpu")
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, target], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir()]
    assert left.name.startswith(".m.toptpu.tmp-") and not os.path.exists(target)
    with pytest.raises(ModelFileError, match="not a toptpu model file"):  # no magic yet
        ModelFile(str(left))
    write_model_file(target, {"kind": "test"}, {"x": b"1"})
    assert [p.name for p in tmp_path.iterdir()] == ["m.toptpu"]


# ------------------------------------------------------------------ toptpu profile


def test_profile_on_a_missing_empty_or_truncated_file_is_one_line(small_file, tmp_path,
                                                                  capsys) -> None:
    empty = tmp_path / "empty.toptpu"
    empty.write_bytes(b"")
    short = tmp_path / "short.toptpu"
    short.write_bytes(open(small_file, "rb").read()[:20000])
    for path, message in ((tmp_path / "missing.toptpu", "No such file or directory"),
                          (empty, "is empty, not a toptpu model file"),
                          (short, "is truncated"), (tmp_path, "is a directory")):
        assert main(["profile", str(path)]) == 1
        out = capsys.readouterr()
        assert out.err.startswith("toptpu profile: error: ") and message in out.err
        assert out.err.count("\n") == 1 and "Traceback" not in out.err and not out.out
