"""The command line on a user's mistakes: every output path checked before any work (and
never inside the input model directory), bad argument values and inputs as one line,
Ctrl-C / SIGTERM as one line and status 130 / 143 with nothing left behind, and the chat's
commands, line editing and KV cache counter."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled, tiny_dir

from helpers import BIN
from toptpu.backend.runtime.runtime import GenerationError, Runtime, SamplingConfig, sample_token
from toptpu.cli import main
from toptpu.compiler import CompileError, check_quant_options
from toptpu.compiler import compile as compile_model
from toptpu.dialects.common import QuantMode

#: the model file the argument tests run (shared with test_llm_generate's edge paths)
SEQ64 = {"seq": 64, "input_len": 16, "history": 56}


# --------------------------------------------------------------------------- helpers


def tree(root: str) -> dict[str, str]:
    """Relative path -> content digest ('<dir>' for directories) of everything under root,
    hidden files included."""
    out: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = "<dir>"
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = file_digest(p)
    return out


def file_digest(path: str) -> str:
    """The content digest of one file (`tree`'s entry for it)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code: int, err: str, cmd: str, fragment: str, status: int = 1) -> None:
    """Status 1: exactly one `toptpu CMD: error:` line. Status 2 (argparse): its usage lines
    and one `toptpu CMD: error: argument ...` line. Never a traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == status, err
    assert "Traceback" not in err
    assert lines and lines[-1].startswith(f"toptpu {cmd}: error: "), err
    assert fragment in lines[-1], err
    if status == 1:
        assert len(lines) == 1, err
    else:
        assert lines[-1].startswith(f"toptpu {cmd}: error: argument "), err
        assert all("error" not in line for line in lines[:-1]), err


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if compile gets as far as loading the model: a refusal must come
    before any work."""
    def load(*args: Any, **kw: Any) -> None:
        raise AssertionError("compile loaded the model before refusing")

    monkeypatch.setattr("toptpu.compiler._load", load)


@pytest.fixture
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", **SEQ64).model_file


# --------------------------------------------------------------------------- outputs


@pytest.mark.slow  # compiles a model (each output check once)
def test_compile_outputs_are_checked_before_any_work(tmp_path, tmp_path_factory, capsys,
                                                     no_load) -> None:
    """Each bad output is one line before the model loads; the input checkpoint and the
    working directory are unchanged afterwards."""
    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_dir(tmp_path_factory, "qwen2"), ck)
    os.symlink(ck, tmp_path / "link")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "dump").mkdir()
    before = tree(str(tmp_path))
    out = str(tmp_path / "out.toptpu")
    cases = [
        (["-o", f"{ck}/model.safetensors"], "is inside the input model directory"),
        (["-o", f"{ck}/config.json"], "is inside the input model directory"),
        (["-o", f"{ck}/new.toptpu"], "toptpu never writes into its input"),
        (["-o", str(tmp_path / "link" / "model.safetensors")], "inside the input model"),
        (["-o", str(tmp_path / "outdir")], "is a directory; name the file to write"),
        (["-o", str(tmp_path / "outdir") + "/"], "is a directory"),
        (["-o", ""], "the path is empty"),
        (["-o", str(tmp_path / "nope" / "m.toptpu")], "does not exist; create it first"),
        (["-o", str(tmp_path / "file.txt" / "m.toptpu")], "is a file, not a directory"),
        (["-o", out, "--dump-ir", str(tmp_path / "file.txt")],
         "--dump-ir '" + str(tmp_path / "file.txt") + "' exists and is not a directory"),
        (["-o", out, "--dump-ir", f"{ck}/dumps"], "--dump-ir '" + ck + "/dumps' is inside"),
        (["-o", out, "--dump-ir", ck], "is inside the input model directory"),
        (["-o", str(tmp_path / "dump" / "m.toptpu"), "--dump-ir", str(tmp_path / "dump")],
         "which the IR dumps fill"),
    ]
    for args, fragment in cases:
        code, _, err = cli(["compile", ck, *args, "--seq-length", "32"], capsys)
        assert_one_error(code, err, "compile", fragment)
        assert tree(str(tmp_path)) == before, args
    # the library checks the same, before loading
    with pytest.raises(CompileError, match="inside the input model directory"):
        compile_model(ck, f"{ck}/model.safetensors", seq_length=32, progress=None)


def test_profile_outputs_are_checked_before_any_net_runs(tmp_path, model_file, capsys,
                                                         monkeypatch) -> None:
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "outdir").mkdir()
    before = tree(str(tmp_path))
    digest = file_digest(model_file)  # the file alone: its directory is the shared one

    def run_nets(*args: Any) -> None:
        raise AssertionError("the nets ran before the outputs were checked")

    monkeypatch.setattr("toptpu.profile_cli.profile_model", run_nets)
    for args, fragment in (
            (["--png", str(tmp_path / "file.txt")], "exists and is not a directory"),
            (["--trace", str(tmp_path / "outdir")], "is a directory"),
            (["--trace", model_file], "is the model file"),
            (["--trace", str(tmp_path / "nope" / "t.json")], "does not exist")):
        code, _, err = cli(["profile", model_file, *args], capsys)
        assert_one_error(code, err, "profile", fragment)
    monkeypatch.undo()
    code, _, err = cli(["profile", model_file, "--nets", "embedding,bogus"], capsys)
    assert_one_error(code, err, "profile", "has no net bogus; it has block")
    assert tree(str(tmp_path)) == before
    assert file_digest(model_file) == digest


# --------------------------------------------------------------------------- values


ARGUMENT_CASES = [
    # (arguments after `run MODEL_FILE`, status, fragment of the error line)
    (["--ids", "1 x"], 2, "'x' is not a token id"),
    (["--ids", " , "], 2, "no token ids given"),
    (["--ids", "1.5"], 2, "'1.5' is not a token id"),
    (["--ids", "99999"], 1, "outside the vocabulary of 384"),
    (["--ids", "-3"], 1, "outside the vocabulary"),
    (["--ids", "1", "--chat-template"], 1, "apply to --prompt text, not to --ids"),
    (["--prompt", "hi", "--seed", "-1"], 2, "--seed: must be an integer >= 0"),
    (["--prompt", "hi", "--seed", "1e3"], 2, "--seed: must be an integer"),
    (["--prompt", "hi", "--temperature", "nan"], 2, "--temperature: must be a finite number"),
    (["--prompt", "hi", "--temperature", "inf"], 2, "--temperature: must be a finite number"),
    (["--prompt", "hi", "--temperature", "-0.5"], 2, ">= 0 (0: greedy), got '-0.5'"),
    (["--prompt", "hi", "--top-p", "0"], 2, "--top-p: must be a number in (0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], 2, "--top-p: must be a number in (0, 1]"),
    (["--prompt", "hi", "--top-p", "nan"], 2, "--top-p"),
    (["--prompt", "hi", "--top-k", "-1"], 2, "--top-k: must be an integer >= 0"),
    (["--prompt", "hi", "--max-new-tokens", "0"], 2, "--max-new-tokens: must be an integer >= 1"),
    (["--prompt", "hi", "--repetition-penalty", "0"], 2, "--repetition-penalty: must be"),
    (["--prompt", "hi", "--repetition-penalty", "nan"], 2, "--repetition-penalty"),
    (["--prompt", "hi", "--penalty-window", "-1"], 2, "--penalty-window"),
    (["--prompt", "\udcff\udcfehi"], 2, "not valid UTF-8 text (byte 0xff at character 0)"),
    (["--prompt", "a\ud800"], 2, "not valid UTF-8 text (U+D800 at character 1)"),
]


@pytest.mark.parametrize("args,status,fragment", ARGUMENT_CASES)
def test_run_argument_values(model_file, capsys, args, status, fragment) -> None:
    code, out, err = cli(["run", model_file, *args, "--executor", "interpreter"], capsys)
    assert_one_error(code, err, "run", fragment, status)
    assert out == ""


def test_other_commands_argument_values(tmp_path_factory, tmp_path, capsys, no_load) -> None:
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = str(tmp_path / "m.toptpu")
    for argv, status, fragment in (
            (["compile", ck, "-o", out, "--seq-length", "1"], 2, "--seq-length: must be an "
             "integer >= 2"),
            (["compile", ck, "-o", out, "--seq-length", "x"], 2, "got 'x'"),
            (["compile", ck, "-o", out, "--max-input-length", "0"], 2, "--max-input-length"),
            (["compile", ck, "-o", out, "--prefill-lengths", "0"], 2,
             "--prefill-lengths: '0' is not a chunk length"),
            (["compile", ck, "-o", out, "--prefill-lengths", "16,x"], 2,
             "'x' is not a chunk length"),
            (["compile", ck, "-o", out, "--prefill-lengths", "16,16"], 2, "16 is given twice"),
            (["compile", ck, "-o", out, "--prefill-lengths", "16,"], 2,
             "expected lengths separated by commas"),
            (["compile", ck, "-o", out, "--seq-length", "64", "--prefill-lengths", "16,128"],
             1, "--prefill-lengths 128 must be between 1 and --seq-length 64"),
            (["compile", ck, "-o", out, "--max-input-length", "32", "--prefill-lengths",
              "16,64"], 1, "--prefill-lengths 64 is longer than --max-input-length 32"),
            (["estimate", ck, "--prefill-lengths", "-4"], 2, "'-4' is not a chunk length"),
            (["estimate", ck, "--seq-length", "64", "--prefill-lengths", "100"], 1,
             "--prefill-lengths 100 must be between 1 and --seq-length 64"),
            (["compile", ck, "-o", out, "--group-size", "0"], 2, "positive integer or -1"),
            (["compile", ck, "-o", out, "--image-size", "0"], 2, "--image-size"),
            (["compare", "--seq", "0"], 2, "--seq: must be an integer >= 1"),
            (["compare", "--layer", "-1"], 2, "--layer: must be an integer >= 0"),
            (["compare", "--stages", "torch"], 1, "names one stage"),
            (["compare", "--stages", "torch,gpu"], 1, "unknown stage 'gpu'"),
            (["compare", "-q", "w3"], 1, "unknown quantization mode 'w3'"),
            (["demo", "--max-new-tokens", "0"], 2, "--max-new-tokens")):
        code, _, err = cli(argv, capsys)
        assert_one_error(code, err, argv[0], fragment, status)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # a real process loads the model
def test_invalid_utf8_prompt_in_a_real_process(model_file) -> None:
    """Bytes that are not UTF-8 in argv (Python passes them as surrogates)."""
    res = subprocess.run([os.path.join(BIN, "toptpu").encode(), b"run", model_file.encode(),
                          b"--prompt", b"\xff\xfehi"], capture_output=True, timeout=120)
    err = res.stderr.decode()
    assert_one_error(res.returncode, err, "run", "not valid UTF-8 text (byte 0xff", 2)


def test_model_directory_problems(tmp_path_factory, tmp_path, capsys) -> None:
    """A missing directory (no model hub), a file, a gpt2 directory (saved by transformers),
    an int32 weight in a float checkpoint: one line each, for compile and compare."""
    from safetensors.numpy import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    (tmp_path / "file.txt").write_text("x")
    gpt2 = str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                               n_positions=64)).save_pretrained(gpt2)
    ints = str(tmp_path / "int32")
    shutil.copytree(tiny_dir(tmp_path_factory, "qwen2"), ints)
    tensors = load_file(f"{ints}/model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = (tensors[name] * 100).astype(np.int32)
    save_file(tensors, f"{ints}/model.safetensors", metadata={"format": "pt"})
    out = str(tmp_path / "out" / "m.toptpu")
    os.makedirs(os.path.dirname(out))
    capsys.readouterr()  # transformers' warnings while saving gpt2
    for model, fragment in ((str(tmp_path / "missing"), "model directory '" +
                             str(tmp_path / "missing") + "' does not exist"),
                            (str(tmp_path / "file.txt"), "is a file, not a model directory"),
                            (gpt2, "unknown model_type 'gpt2'"),
                            (ints, f"not floating point: {name} is I32")):
        for argv in (["compile", model, "-o", out, "--seq-length", "32"], ["compare", model]):
            code, _, err = cli(argv, capsys)
            assert_one_error(code, err, argv[0], fragment)
    assert os.listdir(os.path.dirname(out)) == []


def test_sizes_checked_against_the_config(tmp_path_factory, tmp_path, capsys, no_load) -> None:
    ck = tiny_dir(tmp_path_factory, "qwen2")  # 2 layers, 2 kv heads x 16, 1024 positions
    out = str(tmp_path / "m.toptpu")
    for args, fragment in (
            (["--seq-length", "1000000000"], "--seq-length 1000000000 exceeds "
             "max_position_embeddings 1024 of " + ck + "/config.json; its KV cache alone would "
             "take 512.0 GB (2 x 2 layers x 1000000000 positions x 2 kv heads x 16 x 4 bytes, "
             "f32). Use --seq-length 1024 or less"),
            (["--seq-length", "2048", "-q", "w4bf16"], "524.3 kB (2 x 2 layers x 2048 positions x "
             "2 kv heads x 16 x 2 bytes, bf16)"),
            (["-q", "f32", "--group-size", "64"], "--group-size applies to round-to-nearest "
             "weight quantization in the w4f16, w4bf16, w4f32; -q f32 does not use it"),
            (["--group-size", "64"], "the default mode (f32, or a pre-quantized checkpoint's"),
            (["-q", "w8bf16", "--group-size", "32"], "(w8 quantizes per channel)"),
            (["-q", "w4f32", "--group-size", "7"], "--group-size 7 does not divide the input "
             "dimension of every matmul (hidden_size 64, intermediate_size 192, "
             "num_attention_heads x head_dim 64"),
            (["-q", "bf16", "--symmetric"], "--symmetric applies to round-to-nearest weight "
             "quantization in the w4 and w8 modes")):
        code, _, err = cli(["compile", ck, "-o", out, *args], capsys)
        assert_one_error(code, err, "compile", fragment)
    with pytest.raises(CompileError, match="pre-quantized checkpoint keeps its own"):
        check_quant_options(QuantMode.W4F16, 32, None, checkpoint="ck")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- sampling


def test_sampling_config_refuses_meaningless_values() -> None:
    for kw, fragment in (({"temperature": math.nan}, "temperature must be a finite"),
                         ({"temperature": math.inf}, "temperature"),
                         ({"top_p": math.nan}, "top_p"),
                         ({"top_k": 1.5}, "top_k must be an integer"),
                         ({"repetition_penalty": math.inf}, "repetition_penalty"),
                         ({"seed": -1}, "seed must be an integer >= 0")):
        with pytest.raises(GenerationError, match=fragment):
            SamplingConfig(**kw).validate()


@fuzz_settings(100)
@given(logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=12),
       temperature=st.one_of(st.floats(min_value=0, max_value=1e30, exclude_min=True),
                             st.sampled_from([5e-324, 1e-45, 1e-38, 1e-8])),
       top_k=st.integers(0, 20), top_p=st.floats(0, 1, exclude_min=True),
       penalty=st.floats(1e-4, 1e4), seed=st.integers(0, 2**64))
def test_sample_token_is_a_valid_id_for_any_valid_setting(logits, temperature, top_k, top_p,
                                                          penalty, seed) -> None:
    """Whatever finite values pass validation, the draw is an id in range (a temperature so
    low that the logits overflow gives the argmax, the limit of the distribution)."""
    cfg = SamplingConfig(temperature, top_k, top_p, penalty, 4, seed)
    cfg.validate()
    x = np.array(logits, np.float32)
    token = sample_token(x, [0, len(logits) - 1], cfg, np.random.default_rng(seed))
    assert 0 <= token < len(logits)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        overflows = not np.isfinite(np.max(x) / np.float32(temperature))
    if cfg.repetition_penalty == 1.0 and overflows:
        assert token == int(np.argmax(x))


# --------------------------------------------------------------------------- chat


def test_full_kv_cache_counts_seq_tokens(model_file, capsys, monkeypatch) -> None:
    """A reply that fills the cache: the conversation holds SEQ tokens, not SEQ + 1."""
    rt = Runtime.open(model_file, "interpreter")
    res = rt.generate(rt.encode("Hello there"), 200, stop_on_eos=False)
    assert res.stop_reason == "kv_cache_full"
    assert len(rt.tokens) == rt.seq == 64 and rt.position == 64 and res.position == 64
    with pytest.raises(GenerationError, match="64 tokens of history"):
        rt.generate([5], 2, keep_history=True)

    lines = iter(["Hello there", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", model_file, "--max-new-tokens", "200", "--executor",
                 "interpreter"]) == 0
    err = capsys.readouterr().err
    assert "stop: kv_cache_full" in err and "[64/64 tokens in the cache]" in err


def test_chat_commands(model_file, capsys, monkeypatch) -> None:
    """Unknown commands are answered with the command list and not sent; '//' sends a
    message that starts with '/'; a line that is not UTF-8 is refused."""
    sent: list[str] = []
    chat = Runtime.chat

    def spy(self: Runtime, message: str, *args: Any, **kw: Any) -> Any:
        sent.append(message)
        return chat(self, message, *args, **kw)

    monkeypatch.setattr(Runtime, "chat", spy)
    lines = iter(["/foo bar", "//etc/hosts", "/help", "/reset now", "bad \udcff line",
                  "/image x.png", "   ", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", model_file, "--max-new-tokens", "2", "--executor",
                 "interpreter"]) == 0
    err = capsys.readouterr().err
    assert sent == ["/etc/hosts"]
    assert "[unknown command '/foo': /reset starts over, /exit quits, /help lists" in err
    assert "[/reset takes no argument:" in err and err.count("Start a message with //") == 4
    assert "[the line is not valid UTF-8 text (byte 0xff at character 4); not sent]" in err
    assert "[this model file has no vision net: images need a compiled InternVL" in err
    assert "Traceback" not in err


def _read_until(fd: int, marker: bytes, seen: bytearray, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while marker not in seen:
        left = end - time.monotonic()
        assert left > 0, f"no {marker!r} on the terminal; got {bytes(seen)!r}"
        if select.select([fd], [], [], left)[0]:
            seen += os.read(fd, 4096)


@pytest.mark.slow  # a chat in a pseudo-terminal
def test_chat_line_editing_and_history_in_a_terminal(model_file) -> None:
    """On a terminal, readline gives input() history: Up + Enter repeats /help."""
    pytest.importorskip("readline")
    master, slave = pty.openpty()
    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "chat", model_file, "--executor",
                             "interpreter"], stdin=slave,
                            stdout=slave, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    seen = bytearray()
    try:
        for keys in (b"/help\r", b"\x1b[A\r", b"/exit\r"):
            _read_until(master, b">>> ", seen)
            seen.clear()
            os.write(master, keys)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        os.close(master)
    assert proc.returncode == 0, err
    assert err.count("[/reset starts over") == 2, err


# --------------------------------------------------------------------------- signals


_SLOW_WRITE = """
import os, sys, time
real = os.replace
def slow(src, dst):  # the model file is complete in its temp file: hold it there
    if str(dst).endswith("out.toptpu"):
        open(sys.argv[1], "w").close()
        time.sleep(120)
    return real(src, dst)
os.replace = slow
from toptpu.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)


def _interrupted(proc: subprocess.Popen, err: str, cmd: str, sig: signal.Signals) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and lines[-1] == f"toptpu {cmd}: interrupted ({sig.name})"
    assert sum("interrupted" in line or "error" in line for line in lines) == 1, err


@pytest.mark.slow  # compiles in a process, then kills it
def test_sigterm_while_writing_leaves_no_temp_file(tmp_path_factory, tmp_path) -> None:
    """A real process, SIGTERM while the model file sits complete in its temp file."""
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    flag = str(tmp_path / "writing")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, flag, "compile", ck, "-o",
                             str(out_dir / "out.toptpu"), "--seq-length", "32",
                             "--max-input-length", "8", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    _wait_for(flag, proc)
    assert any(n.startswith(".out.toptpu.tmp-") for n in os.listdir(out_dir))
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    _interrupted(proc, err, "compile", signal.SIGTERM)
    assert err.strip() == "toptpu compile: interrupted (SIGTERM)"
    assert os.listdir(out_dir) == []


@pytest.mark.slow  # compiles and chats in processes, then interrupts them
def test_ctrl_c_mid_compile_and_in_chat(tmp_path_factory, tmp_path, model_file) -> None:
    """SIGINT after the first net compiled: status 130, one line, no output; and at the
    chat prompt."""
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = tmp_path / "m.toptpu"
    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "compile", ck, "-o", str(out),
                             "--seq-length", "32", "--max-input-length", "8"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    progress = []
    for line in proc.stderr:
        progress.append(line)
        if line.startswith("toptpu compile: "):  # loaded; the nets compile next
            break
    proc.send_signal(signal.SIGINT)
    err = "".join(progress) + proc.communicate(timeout=60)[1]
    _interrupted(proc, err, "compile", signal.SIGINT)
    assert os.listdir(tmp_path) == []

    proc = subprocess.Popen([os.path.join(BIN, "toptpu"), "chat", model_file, "--executor",
                             "interpreter"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    banner = proc.stderr.readline()
    assert banner.startswith("toptpu chat:")
    time.sleep(0.5)  # at the prompt
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    _interrupted(proc, err, "chat", signal.SIGINT)


# --------------------------------------------------------------------------- run --json


def test_run_json_has_a_schema_version(model_file, capsys) -> None:
    code, out, err = cli(["run", model_file, "--ids", "1,2 3", "--max-new-tokens", "3",
                          "--json", "--executor", "interpreter"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == 2 and data["prompt_ids"] == [1, 2, 3]
    assert data["executor"] == "interpreter" and data["modelled_ttft_s"] is None
    assert set(data) == {"schema", "prompt_ids", "generated_ids", "text", "stop_reason",
                         "ttft_s", "tokens_per_s", "modelled_ttft_s", "modelled_tokens_per_s",
                         "image_tokens", "vision_s", "vision_modelled_s", "executor",
                         "sampler", "modelled_breakdown", "weight_cache_file"}
    assert data["sampler"] == "greedy" and data["modelled_breakdown"] is None
    assert data["weight_cache_file"] is None  # none written beside this model file
    usage = open(os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")).read()
    for key in data:  # every key is documented in the usage page's schema table
        assert f"| `{key}` |" in usage, key


def test_run_with_the_chat_template_prints_the_reply_alone(model_file, capsys) -> None:
    """A chat reply stands alone on stdout (the templated prompt is not echoed before it) and
    the end-of-turn marker is left out unless --special-tokens; a completion still continues
    its prompt."""
    from toptpu.backend.runtime.runtime import Runtime

    prompt = "What is the capital of France?"
    args = ["run", model_file, "--prompt", prompt, "--max-new-tokens", "8", "--ignore-eos",
            "--executor", "interpreter"]
    code, reply, err = cli([*args, "--chat-template"], capsys)
    assert code == 0, err
    code, with_special, err = cli([*args, "--chat-template", "--special-tokens"], capsys)
    assert code == 0, err
    code, completion, err = cli(args, capsys)
    assert code == 0, err
    assert not reply.startswith(prompt) and completion.startswith(prompt)
    rt = Runtime.open(model_file, "interpreter")
    ids = json.loads(cli([*args, "--chat-template", "--json"], capsys)[1])["generated_ids"]
    assert with_special.rstrip("\n") == rt.decode(ids)
    assert reply.rstrip("\n") == rt.tokenizer.decode(ids, skip_special_tokens=True)
    specials = [t for t in ("<|im_end|>", "<|endoftext|>") if t in with_special]
    assert all(t not in reply for t in specials)
