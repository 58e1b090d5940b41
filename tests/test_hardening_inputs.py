"""Hardening of what is read from a model directory (issue 24, points 2, 3, 8, 9).

- Every file of a model directory is a regular file inside it (`contract.model_file_path`):
  a symbolic link out of it, a dangling link, a FIFO or a device is one error naming it,
  before anything (transformers included) opens a file; a link to another file of the
  directory is read. A FIFO never hangs a compile.
- The tokenizer files are loaded at compile time; a malformed one is named.
- Chat templates render within `TEMPLATE_MAX_CHARS` / `TEMPLATE_MAX_SECONDS`, refused fast
  and without allocating (at compile time too, before a model file is written).
- config.json values: one validation (`hf_loader.check_config_values`) for compile and
  estimate, a user error naming the field for every bad value, run before transformers.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import tiny_dir
from test_cli_errors import assert_one_error, cli

from toptpu.backend.contract import ModelDirFileError, model_file_path, read_model_file
from toptpu.backend.runtime.runtime import TemplateLimitError, Tokenizer
from toptpu.frontends.hf_loader import (
    ModelLoadError,
    check_config_values,
    check_model_dir,
    read_config,
)

SECRET = b"SECRET-KEY-0123456789-do-not-ship"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer tiny Qwen2 directory, saved once (shared with the rest of the suite)."""
    return tiny_dir(tmp_path_factory, "qwen2", layers=1)


@pytest.fixture(scope="module")
def config(tiny: str) -> dict[str, Any]:
    with open(os.path.join(tiny, "config.json")) as f:
        return json.load(f)


def _copy(tiny: str, dest: str) -> str:
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(tiny, dest, ignore=shutil.ignore_patterns("done"))
    return dest


def _with_timeout(fn: Any, seconds: float = 30.0) -> Any:
    """fn() in a daemon thread: the result, or a failure (not a hang) after `seconds`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# =========================================================================== model directory files

#: the files toptpu or transformers may read from a model directory
DIR_FILES = ["config.json", "generation_config.json", "model.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
             "preprocessor_config.json", "quantize_config.json", "vocab.json", "merges.txt"]
KINDS = ["link_outside", "dangling", "fifo", "device", "socket", "link_inside", "relative_out"]


def _plant(d: str, name: str, kind: str, outside: str) -> str | None:
    """Put a `kind` under `name` in `d`; the fragment the refusal must hold (None: allowed)."""
    path = os.path.join(d, name)
    if os.path.lexists(path):
        os.remove(path)
    if kind == "link_outside":
        os.symlink(outside, path)
        return f"is a symbolic link to {os.path.realpath(outside)}, outside the model directory"
    if kind == "relative_out":
        os.symlink(os.path.join("..", os.path.basename(outside)), path)
        return "outside the model directory"
    if kind == "dangling":
        os.symlink(os.path.join(d, "no-such-file"), path)
        return "does not exist"
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO, not a regular file"
    if kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null
        except OSError:  # not permitted here (not root): nothing to check
            return "<skip>"
        return "is a character device, not a regular file"
    if kind == "socket":
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(path)
        except OSError:  # the path is too long for a unix socket
            return "<skip>"
        finally:
            s.close()
        return "is a socket, not a regular file"
    assert kind == "link_inside"
    real = os.path.join(d, "real-" + name)
    with open(real, "wb") as f:
        f.write(b'{"inside": true}')
    os.symlink("real-" + name, path)
    return None


@fuzz_settings(40)
@given(name=st.sampled_from(DIR_FILES), kind=st.sampled_from(KINDS))
def test_model_dir_files_are_regular_files_inside(tmp_path_factory, tiny, name, kind) -> None:
    """Property: for every model-dir file name and every kind of non-file, the directory
    check refuses it naming the path (within seconds: a FIFO is never opened), and the
    per-file helper agrees; a link to a file inside the directory is read."""
    base = tmp_path_factory.mktemp("d")
    outside = base / "secret"
    outside.write_bytes(SECRET)
    d = _copy(tiny, str(base / "m"))
    fragment = _plant(d, name, kind, str(outside))
    path = os.path.join(d, name)
    if fragment == "<skip>":
        return
    if fragment is None:
        _with_timeout(lambda: check_model_dir(d))
        assert read_model_file(d, name) == b'{"inside": true}'
        return
    with pytest.raises(ModelLoadError) as e:
        _with_timeout(lambda: check_model_dir(d))
    msg = str(e.value)
    assert f"'{path}'" in msg and fragment in msg, msg
    assert "\n" not in msg and SECRET.decode() not in msg
    with pytest.raises(ModelDirFileError):
        _with_timeout(lambda: read_model_file(d, name))
    if kind == "device":  # the node is left as it was
        assert stat.S_ISCHR(os.lstat(path).st_mode)


def test_hub_cache_snapshot_links_are_allowed(tmp_path, tiny) -> None:
    """A Hugging Face hub cache snapshot links its files to `<repo>/blobs`: allowed."""
    repo = tmp_path / "models--x--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(tiny):
        if name == "done":
            continue
        shutil.copy(os.path.join(tiny, name), blobs / ("h-" + name))
        os.symlink(os.path.join("..", "..", "blobs", "h-" + name), snap / name)
    check_model_dir(str(snap))
    assert model_file_path(str(snap), "config.json") == str(snap / "config.json")
    config, raw = read_config(str(snap))
    assert raw["model_type"] == "qwen2"


def test_index_shard_names_stay_inside(tmp_path, tiny) -> None:
    """A shard listed by the index is held to the same rule (a link out is refused)."""
    d = _copy(tiny, str(tmp_path / "m"))
    (tmp_path / "outside.safetensors").write_bytes(SECRET)
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "s1.safetensors"))
    os.symlink(str(tmp_path / "outside.safetensors"), os.path.join(d, "s2.safetensors"))
    from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader

    with pytest.raises(ModelLoadError, match="s2.safetensors' is a symbolic link"):
        check_model_dir(d)
    with pytest.raises(CheckpointError, match="s2.safetensors' is a symbolic link"):
        CheckpointReader.open(d)


@pytest.mark.parametrize("target", ["chat_template.jinja", "tokenizer.json"])
def test_compile_refuses_a_link_out_and_writes_nothing(tmp_path, tiny, capsys, target) -> None:
    """`tokenizer.json -> secret`, `chat_template.jinja -> secret`: one error naming the link
    and its target; no model file (so the secret's bytes are nowhere)."""
    d = _copy(tiny, str(tmp_path / "m"))
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    os.remove(os.path.join(d, target))
    os.symlink(str(secret), os.path.join(d, target))
    out = tmp_path / "out.toptpu"
    code, _, err = cli(["compile", d, "-o", str(out), "--quiet"], capsys)
    assert_one_error(code, err, "compile", f"{target}' is a symbolic link to {secret}")
    assert "copy the file in" in err
    assert not out.exists() and not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_compile_and_estimate_refuse_a_fifo_without_hanging(tmp_path, tiny, capsys) -> None:
    """A FIFO named config.json: compile and estimate give one error, no hang (in process,
    under a timeout)."""
    d = _copy(tiny, str(tmp_path / "m"))
    os.remove(os.path.join(d, "config.json"))
    os.mkfifo(os.path.join(d, "config.json"))
    for argv, cmd in (([("compile"), d, "-o", str(tmp_path / "o.toptpu")], "compile"),
                      (["estimate", d, "--quiet"], "estimate")):
        code, _, err = _with_timeout(lambda a=argv: cli(a, capsys), 60)
        assert_one_error(code, err, cmd, "config.json' is a FIFO, not a regular file")
    assert not (tmp_path / "o.toptpu").exists()
    assert stat.S_ISFIFO(os.lstat(os.path.join(d, "config.json")).st_mode)


@pytest.mark.slow  # three compiles in subprocesses
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_compile_cli_fifo_subprocess(tmp_path, tiny, name) -> None:
    """The `toptpu compile` command itself, in a subprocess with a timeout, for each of the
    three FIFOs the issue names."""
    d = _copy(tiny, str(tmp_path / "m"))
    os.remove(os.path.join(d, name))
    os.mkfifo(os.path.join(d, name))
    r = subprocess.run([sys.executable, "-m", "toptpu.cli", "compile", d, "-o",
                        str(tmp_path / "o.toptpu")], capture_output=True, text=True,
                       timeout=120)
    assert_one_error(r.returncode, r.stderr, "compile", f"{name}' is a FIFO")


# =========================================================================== tokenizer files


@pytest.mark.slow  # loads the model (the check runs after the load)
@pytest.mark.parametrize(("name", "content", "fragment"), [
    ("tokenizer.json", b'{"version": "1.0", "model": 5}', "tokenizer.json cannot be loaded"),
    ("tokenizer.json", b"not json", "tokenizer.json cannot be loaded"),
    ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json cannot be loaded: it is not "
     "a JSON object"),
    ("chat_template.jinja", b"\xff\xfe", "chat_template.jinja cannot be loaded"),
])
def test_malformed_tokenizer_files_are_refused_at_compile(tmp_path, tiny, capsys, name,
                                                          content, fragment) -> None:
    d = _copy(tiny, str(tmp_path / "m"))
    with open(os.path.join(d, name), "wb") as f:
        f.write(content)
    out = tmp_path / "o.toptpu"
    code, _, err = cli(["compile", d, "-o", str(out), "--quiet"], capsys)
    assert_one_error(code, err, "compile", fragment)
    assert not out.exists()


# =========================================================================== chat templates

HOSTILE = [
    ("{{ 'a' * 4000000000 }}", "TEMPLATE_MAX_CHARS"),
    ("{{ 4000000000 * 'a' }}", "TEMPLATE_MAX_CHARS"),
    ("{{ ['a'] * 4000000000 }}", "TEMPLATE_MAX_CHARS"),
    ("{{ 'a'|center(4000000000) }}", "TEMPLATE_MAX_CHARS"),
    ("{{ 'a'.ljust(4000000000) }}", "TEMPLATE_MAX_CHARS"),
    ("{{ '%4000000000s' % 'a' }}", "TEMPLATE_MAX_CHARS"),
    ("{{ '{:>4000000000}'.format(1) }}", "TEMPLATE_MAX_CHARS"),
    ("{{ 10 ** 100000000 }}", "TEMPLATE_MAX_CHARS"),
    ("{{ (['a'] * 100000)|join('b' * 100000) }}", "TEMPLATE_MAX_CHARS"),
    ("{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}", "TEMPLATE_MAX_CHARS"),
    ("{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "TEMPLATE_MAX_CHARS"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "TEMPLATE_MAX_SECONDS"),
    # pieces each within the size bound, piling up in a macro's buffer: time or memory
    ("{% macro m() %}{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}{% endmacro %}"
     "{{ m()|length }}", "TEMPLATE_MAX_(SECONDS|MEMORY)"),
    ("{% set b = 'a' * 500000 %}{% macro m() %}{% for i in range(100000) %}{{ b ~ b }}"
     "{% endfor %}{% endmacro %}{{ m()|length }}", "TEMPLATE_MAX_(SECONDS|MEMORY)"),
]


@pytest.fixture(scope="module")
def tokenizer_files(tiny: str) -> dict[str, bytes]:
    return {n: open(os.path.join(tiny, n), "rb").read() for n in os.listdir(tiny)
            if n.startswith(("tokenizer", "chat_template"))}


@pytest.mark.parametrize(("template", "limit"), HOSTILE)
def test_hostile_templates_fail_fast_without_allocating(tokenizer_files, template,
                                                        limit) -> None:
    tok = Tokenizer({**tokenizer_files, "chat_template.jinja": template.encode()})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    with pytest.raises(TemplateLimitError, match=limit) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], True)
    assert time.monotonic() - t < 6.0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert grown_mb < 600, f"{grown_mb:.0f} MB allocated"  # GBs before the bounds
    assert "docs/limits.md" in str(e.value)


def test_ordinary_templates_still_render(tokenizer_files) -> None:
    tok = Tokenizer(tokenizer_files)
    long = "x" * 300_000  # long messages are not the template's size
    text = tok.apply_chat_template([{"role": "user", "content": long}], True)
    assert long in text and text.endswith("assistant\n")
    tok = Tokenizer({**tokenizer_files, "chat_template.jinja":
                     b"{% for m in messages %}{{ m.content|replace('x', 'yz') }}{% endfor %}"})
    assert tok.apply_chat_template([{"role": "user", "content": "axb"}]) == "ayzb"


def test_the_template_budget_starts_after_the_tokenizer_is_built(tokenizer_files,
                                                                  monkeypatch) -> None:
    """Building the transformers tokenizer the template renders with takes seconds for a
    large vocabulary (SmolLM2's 49152 tokens: ~2 s under load); that is not the template's
    time, so a first render does not count it."""
    from transformers import PreTrainedTokenizerFast

    import toptpu.backend.runtime.runtime as rt_module

    monkeypatch.setattr(rt_module, "TEMPLATE_MAX_SECONDS", 0.2)
    real_init = PreTrainedTokenizerFast.__init__

    def slow_init(self, *args, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
        time.sleep(0.5)
        real_init(self, *args, **kw)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__init__", slow_init)
    tok = Tokenizer(tokenizer_files)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], True)
    assert "hi" in text and text.endswith("assistant\n")


@pytest.mark.slow  # loads the model (the check runs after the load)
def test_compile_refuses_a_hostile_template_before_writing(tmp_path, tiny, capsys) -> None:
    d = _copy(tiny, str(tmp_path / "m"))
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{{ 'a' * 4000000000 }}")
    out = tmp_path / "o.toptpu"
    t = time.monotonic()
    code, _, err = cli(["compile", d, "-o", str(out), "--quiet"], capsys)
    assert_one_error(code, err, "compile", "chat_template.jinja: the chat template's '*' "
                     "result would be 4e+09 characters, over the limit")
    assert "TEMPLATE_MAX_CHARS" in err and time.monotonic() - t < 60
    assert not out.exists()


# =========================================================================== config values

INT_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings"]
REQUIRED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads"}
FLOAT_FIELDS = ["rms_norm_eps", "rope_theta"]

BAD_INTS = st.one_of(st.integers(max_value=0), st.integers(min_value=1 << 32),
                     st.floats(allow_nan=True), st.text(max_size=5), st.booleans(),
                     st.just([1]), st.just({"a": 1}), st.sampled_from(["nan", "inf", "64"]),
                     st.just("<missing>"))
BAD_FLOATS = st.one_of(st.floats(max_value=0), st.just(math.inf), st.just(-math.inf),
                       st.just(math.nan), st.text(max_size=5), st.booleans(),
                       st.just([1e-6]), st.sampled_from(["nan", "1e-6"]))


def _bad_config(config: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    raw = dict(config)
    if value == "<missing>":
        raw.pop(field, None)
    else:
        raw[field] = value
    return raw


def _assert_refused(raw: dict[str, Any], field: str, tmp: str) -> None:
    """The validation, compile's pre-load check and the loader (compile and estimate) all
    name `field`."""
    with pytest.raises(ModelLoadError, match=field) as e:
        check_config_values(raw, "config.json")
    assert "\n" not in str(e.value)
    try:
        data = json.dumps(raw, allow_nan=False)
    except ValueError:
        return  # NaN/inf are not JSON: the strict reader refuses the file itself
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write(data)
    from toptpu.compile_options import check_compile_request

    with pytest.raises(ModelLoadError, match=field):
        check_compile_request(tmp, os.path.join(os.path.dirname(tmp), "o.toptpu"), mode=None,
                              chip="bm1684x", seq_length=64, max_input_length=None,
                              max_history=None, group_size=None, symmetric=None,
                              dump_ir=None)
    with pytest.raises(ModelLoadError, match=field):
        read_config(tmp)  # what compile's loader and `toptpu estimate` read it with


@fuzz_settings(80)
@given(data=st.data())
def test_config_values_are_checked_naming_the_field(tmp_path_factory, tiny, config,
                                                    data) -> None:
    """Property: a bad value in any checked field (0, negative, huge, a float or a string
    or a list where an int is expected, null for a required field, NaN, missing) is one
    user error naming the field, from the validation and from compile's and estimate's
    readers alike."""
    field = data.draw(st.sampled_from(INT_FIELDS + FLOAT_FIELDS + ["hidden_act"]))
    if field in INT_FIELDS:
        value = data.draw(BAD_INTS)
        if value == "<missing>" and field not in REQUIRED:
            value = 0
        if value is None:
            value = 0
    elif field in FLOAT_FIELDS:
        value = data.draw(BAD_FLOATS)
    else:
        value = data.draw(st.one_of(st.text(max_size=8).filter(
            lambda s: s not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")),
            st.integers(), st.none().map(lambda _: 0)))
    tmp = _copy(tiny, str(tmp_path_factory.mktemp("c") / "m"))
    _assert_refused(_bad_config(config, field, value), field, tmp)


@pytest.mark.parametrize(("change", "fragment"), [
    ({"num_attention_heads": 3}, "num_attention_heads 3 is not a multiple of "
     "num_key_value_heads"),
    ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 65, "head_dim": None}, "hidden_size 65 is not a multiple of "
     "num_attention_heads"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "rope_scaling.factor"),
])
def test_config_relations(config, change, fragment) -> None:
    raw = {**config, **change}
    if raw.get("head_dim") is None:
        raw.pop("head_dim", None)
    with pytest.raises(ModelLoadError, match=fragment):
        check_config_values(raw, "config.json")


def test_the_tiny_config_passes(config) -> None:
    check_config_values(config, "config.json")


@pytest.mark.parametrize(("cmd", "field", "value"), [
    ("compile", "num_attention_heads", 0), ("compile", "vocab_size", 0),
    ("compile", "max_position_embeddings", -1), ("compile", "hidden_act", "foo"),
    ("estimate", "num_key_value_heads", 0), ("estimate", "rms_norm_eps", -1),
    ("estimate", "rope_theta", -1), ("estimate", "hidden_size", 1.5),
])
def test_cli_config_values(tmp_path, tiny, config, capsys, cmd, field, value) -> None:
    d = _copy(tiny, str(tmp_path / "m"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**config, field: value}, f)
    out = tmp_path / "o.toptpu"
    argv = ["compile", d, "-o", str(out)] if cmd == "compile" else ["estimate", d, "--quiet"]
    code, _, err = cli(argv, capsys)
    assert_one_error(code, err, cmd, f"{field} is {json.dumps(value)}")
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["compile", "estimate"])
@pytest.mark.parametrize(("content", "fragment"), [
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested deeper than 64 levels"),
    ("[1, 2]", "is not a JSON object"),
])
def test_cli_config_shape(tmp_path, tiny, capsys, cmd, content, fragment) -> None:
    d = _copy(tiny, str(tmp_path / "m"))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(content)
    argv = ["compile", d, "-o", str(tmp_path / "o")] if cmd == "compile" else [
        "estimate", d, "--quiet"]
    code, _, err = cli(argv, capsys)
    assert_one_error(code, err, cmd, fragment)


@pytest.mark.slow  # loads the model (the check runs after the load)
def test_nan_weights_are_named(tmp_path, tiny, capsys) -> None:
    """NaN in a weight: named, not 'the block wrapper differs ... by nan'."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    t = tensors[name].copy()
    t[0, 0] = np.nan
    tensors[name] = t
    save_file(tensors, path, metadata={"format": "pt"})
    out = tmp_path / "o.toptpu"
    code, _, err = cli(["compile", d, "-o", str(out), "--quiet"], capsys)
    assert_one_error(code, err, "compile", f"weights are not finite (NaN or infinity in {name})")
    assert "differs" not in err and not out.exists()
