"""`toptpu run --trace`: the Chrome trace of a whole generation on the modelled chip clock:
the prefill chunks, every decode step and token choice, every net run and host transfer;
its steps add up to run's modelled time to first token and tokens/s."""

from __future__ import annotations

import json
import math

import pytest
from llm_fixtures import compiled

from toptpu.backend.runtime.run_trace import COMPUTE, DMA, HOST, NETS, STEPS
from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main

PROMPT = list(range(3, 3 + 21))  # two chunks of 16
NEW = 6


def _inside(e: dict, span: dict) -> bool:
    eps = 1e-3  # us: the trace's times are on the nanosecond
    return span["ts"] - eps <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + eps


def _run(path: str, trace: str, capsys, *extra: str) -> tuple[dict, dict]:
    assert main(["run", path, "--ids", " ".join(map(str, PROMPT)), "--max-new-tokens",
                 str(NEW), "--ignore-eos", "--json", "--trace", trace, *extra]) == 0
    res = json.loads(capsys.readouterr().out)
    with open(trace) as f:
        return res, json.load(f)


def test_the_trace_has_every_step_and_adds_up_to_runs_modelled_times(
        tmp_path_factory: pytest.TempPathFactory, tmp_path, capsys) -> None:
    path = compiled(tmp_path_factory, "qwen2").model_file
    layers = Runtime.open(path).num_layers
    res, trace = _run(path, str(tmp_path / "run.json"), capsys)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["tid"] == STEPS]
    nets = [e for e in events if e["tid"] == NETS]
    host = [e for e in events if e["tid"] == HOST]
    assert not [e for e in events if e["tid"] in (DMA, COMPUTE)]  # only with --trace-commands
    (ttft,) = [e for e in steps if e["name"] == "time to first token"]
    us = {"abs": 1e-2}  # the trace's times are rounded to the nanosecond
    assert ttft["ts"] == 0 and ttft["dur"] == pytest.approx(res["modelled_ttft_s"] * 1e6, **us)
    chunks = [e for e in steps if e["name"].startswith("prefill ")]
    assert [e["args"]["net"] for e in chunks] == ["block", "block_kv"]
    assert [e["args"]["tokens"] for e in chunks] == [16, 5]
    assert all(_inside(e, ttft) for e in chunks)
    tokens = [e for e in steps if e["name"].startswith("decode token ")]
    assert len(tokens) == NEW - 1
    per_token_us = 1e6 / res["modelled_tokens_per_s"]
    for i, tok in enumerate(tokens):  # one after the other, each the modelled per-token time
        assert tok["dur"] == pytest.approx(per_token_us, **us)
        before = ttft if i == 0 else tokens[i - 1]
        assert tok["ts"] == pytest.approx(before["ts"] + before["dur"], abs=1e-6)  # no gap
        inside = [e for e in nets if _inside(e, tok)]
        runs = sorted((e["args"]["net"], e["args"]["layer"]) for e in inside)
        assert runs == sorted([("block_cache", i) for i in range(layers)] + [
            ("embedding_cache", None), ("greedy_head", None), ("lm_head", None)])
        moved = [e for e in host if _inside(e, tok)]
        assert sorted(e["args"]["to_chip"] for e in moved) == [False, True, True, True]
        # the clock has no gaps: the step is its net runs and transfers
        assert sum(e["dur"] for e in inside + moved) == pytest.approx(tok["dur"], **us)
        names = [e["name"] for e in steps if _inside(e, tok) and e is not tok]
        assert names == [f"decode step: position {len(PROMPT) + i}", f"choose token {i + 1}"]
    total = ttft["dur"] + sum(t["dur"] for t in tokens)
    assert sum(e["dur"] for e in nets + host) == pytest.approx(total, rel=1e-6)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"generation steps", "net runs", "host transfers"}


def test_trace_commands_places_every_command_inside_its_net_run(
        tmp_path_factory: pytest.TempPathFactory, tmp_path, capsys) -> None:
    path = compiled(tmp_path_factory, "qwen2").model_file
    _, trace = _run(path, str(tmp_path / "run.json"), capsys, "--trace-commands")
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    runs = [e for e in events if e["tid"] == NETS]
    cmds = [e for e in events if e["tid"] in (DMA, COMPUTE)]
    rt = Runtime.open(path)
    per_net = {n: len(rt.ex.program(n).commands) for n in rt.ex.nets()}
    assert len(cmds) == sum(per_net[r["args"]["net"]] for r in runs)
    starts = sorted(r["ts"] for r in runs)
    for c in cmds[::7]:
        run = next(r for r in runs if r["ts"] == starts[max(
            i for i, s in enumerate(starts) if s <= c["ts"] + 1e-9)])
        assert _inside(c, run) and c["args"]["net"] == run["args"]["net"]
        assert math.isfinite(c["dur"]) and c["dur"] >= 0


def test_trace_refusals(tmp_path_factory: pytest.TempPathFactory, tmp_path, capsys) -> None:
    path = compiled(tmp_path_factory, "qwen2").model_file
    base = ["run", path, "--ids", "3 4 5", "--max-new-tokens", "2"]
    assert main([*base, "--trace", str(tmp_path / "t.json"), "--executor",
                 "interpreter"]) == 1
    assert "machine executor" in capsys.readouterr().err
    assert main([*base, "--trace-commands"]) == 1
    assert "--trace FILE.json" in capsys.readouterr().err
    assert main([*base, "--trace", str(tmp_path)]) == 1  # a directory
    assert "--trace" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
