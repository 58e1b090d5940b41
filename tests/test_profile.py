"""Profiles of machine runs: the net's compute type and its peak, the timeline's legend and
time ticks, the PNG (a real decoder layer of a tiny Qwen2, compiled for the machine)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled
from PIL import Image

from toptpu.backend.runtime.profile import (
    OTHER_COLOR,
    TIME_UNITS,
    command_category,
    format_seconds,
    legend,
    profile_timeline,
    time_ticks,
    write_timeline_png,
)
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.dialects.common import QuantMode
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes

CHIP = get_chip("bm1684x")
_RUNS: dict[str, tuple] = {}


def _run(tiny_models, mode: str):  # noqa: ANN001, ANN202
    """A tiny Qwen2 decoder layer (16 tokens) in `mode` run on the machine: (program,
    timeline, profile)."""
    if mode not in _RUNS:
        imp = import_decoder_layer(tiny_models("qwen2"), 16, mask_value=-10000.0)
        module = imp.module
        run_passes(module, tpu_pipeline_passes(mode), store=imp.store)
        prog = compile_for_machine(module, CHIP)
        tl = simulate(prog, imp.store, imp.feeds, CHIP).timeline
        _RUNS[mode] = (prog, tl, profile_timeline(tl, CHIP, prog.inherent_bytes(), prog.flops))
    return _RUNS[mode]


@pytest.mark.slow  # compiles and profiles three modes
@pytest.mark.parametrize("mode", ["f32", "w4bf16", "w4f32"])
def test_the_roofline_peak_is_that_of_the_nets_compute_type(tiny_models, mode: str) -> None:
    """An f32 net (w4f32 too: f32 activations) is measured against the f32 peak (not int8's,
    the chip's largest), a w4bf16 net against bf16's: the type most FLOPs are computed in."""
    _, _, prof = _run(tiny_models, mode)
    act = QuantMode(mode).activation
    assert prof.compute_dtype == act
    assert prof.peak_flops == pytest.approx(CHIP.tflops[act] * 1e12, rel=1e-12)
    assert prof.compute_fraction == pytest.approx(prof.flops / (prof.seconds * prof.peak_flops))
    if act == "f32":
        assert prof.peak_flops < max(CHIP.tflops.values()) * 1e12


@pytest.mark.parametrize("mode", ["f32", pytest.param("w4bf16", marks=pytest.mark.slow)])
def test_legend_names_what_each_engine_spent_its_time_on(tiny_models, tmp_path, mode: str
                                                          ) -> None:
    prog, tl, prof = _run(tiny_models, mode)
    for engine, must in (("dma", "load weights"), ("cmp", "matmul" if mode == "f32"
                                                          else "a16_matmul")):
        entries, colors = legend(tl, prog.commands, engine)
        labels = [e.label for e in entries]
        assert must in labels
        assert sum(e.busy for e in entries) == pytest.approx(1.0)
        named = [e.busy for e in entries if not e.label.startswith("other")]
        assert named == sorted(named, reverse=True)  # by busy time, "other" last
        events = [e for e in tl.events if e.engine == engine]
        assert set(colors) == {e.cmd for e in events}
        by_label = {e.label: e.color for e in entries}
        for e in events:  # one colour per category, the legend's
            cat = command_category(prog.commands[e.cmd])
            assert colors[e.cmd] == by_label.get(cat, OTHER_COLOR)
    path = tmp_path / f"{mode}.png"
    write_timeline_png(str(path), tl, CHIP, prof, prog.commands)
    with Image.open(path) as img:
        assert img.width == 1400
        drawn = {color for _, color in img.convert("RGB").getcolors(maxcolors=1 << 16)}
    for engine in ("dma", "cmp"):
        for entry in legend(tl, prog.commands, engine)[0]:
            assert entry.color in drawn, (engine, entry.label)


def test_cli_writes_a_png_per_net(tmp_path_factory, tmp_path, capsys) -> None:
    from toptpu.cli import main

    path = compiled(tmp_path_factory, "qwen2").model_file
    out = tmp_path / "png"
    assert main(["profile", path, "--nets", "block,embedding", "--png", str(out)]) == 0
    assert "wrote 2 timelines" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["block.png", "embedding.png"]
    for name in ("block.png", "embedding.png"):
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.width == 1400
    trace = tmp_path / "trace.json"
    assert main(["profile", path, "--nets", "block,embedding", "--trace", str(trace)]) == 0
    processes = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
                 if e.get("name") == "process_name"}
    assert processes == {"block (run 1)", "embedding (run 2)"}  # the nets, not "main"


def test_time_ticks_of_short_and_long_spans() -> None:
    # 1.33 us: tenths of a us, not "0us 0us 0us 1us ..."
    assert [label for _, label in time_ticks(1.329e-6)] == [
        f"{v / 10:.1f} us" for v in range(0, 14, 2)]
    assert [label for _, label in time_ticks(17.3e-6)] == [f"{v} us" for v in range(0, 18, 2)]
    assert [label for _, label in time_ticks(0.45e-6)][:3] == ["0 ns", "50 ns", "100 ns"]
    assert [label for _, label in time_ticks(2.5e-3)][-2:] == ["2.0 ms", "2.5 ms"]
    assert format_seconds(1.329e-6) == "1.33 us" and format_seconds(0.0123) == "12.3 ms"
    for bad in (0.0, -1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match="time span"):
            time_ticks(bad)


@fuzz_settings(200)
@given(st.floats(min_value=1e-10, max_value=1e4, allow_nan=False, allow_infinity=False))
def test_time_ticks_are_distinct_evenly_spaced_and_labelled_with_their_value(span: float
                                                                           ) -> None:
    ticks = time_ticks(span)
    assert 5 <= len(ticks) <= 11
    times = [t for t, _ in ticks]
    labels = [label for _, label in ticks]
    assert times[0] == 0.0 and times[-1] <= span * (1 + 1e-9)
    step = times[1]
    gaps = np.diff(times)
    assert np.allclose(gaps, step, rtol=1e-6, atol=0)
    assert len(set(labels)) == len(labels)
    scale = {name: s for name, s, _ in TIME_UNITS}
    for t, label in ticks:
        value, unit = label.split(" ")
        assert math.isclose(float(value) * scale[unit], t, rel_tol=1e-9, abs_tol=step * 1e-6)


def test_profile_of_every_net_prints_no_numpy_warning(tmp_path_factory, capsys) -> None:
    """The profile feeds placeholder inputs; sample_head's temperature and penalty of 0
    divided 0 by 0 and numpy's warning reached the user."""
    from toptpu.cli import main

    path = compiled(tmp_path_factory, "qwen2").model_file
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        assert main(["profile", path]) == 0
    assert "sample_head" in capsys.readouterr().out


def _profile_steps_equal_runs(path: str, prompt: list[int], sampler: str, capsys) -> None:
    from toptpu.backend.runtime.runtime import Runtime, SamplingConfig
    from toptpu.cli import main

    assert main(["profile", path, "--json", "--sampler", sampler, "--prompt-tokens",
                 str(len(prompt))]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    cfg = {"greedy": SamplingConfig(), "sample": SamplingConfig(0.8, 5, seed=0),
           "host": SamplingConfig(sampler="host")}[sampler]
    rt = Runtime.open(path)
    res = rt.generate(prompt, 5, cfg, stop_on_eos=False)
    assert res.sampler == sampler
    ran = res.modelled_breakdown
    for key in ("first_token", "per_decoded_token"):
        for field in ("total_s", "ddr_s", "compute_s", "launch_s", "host_s"):
            assert steps[key][field] == pytest.approx(ran[key][field], rel=1e-9), (key, field)
        for count in ("launches", "transfers", "transfer_bytes"):
            assert steps[key][count] == ran[key][count], (key, count)
        parts = steps[key]["charges"]  # the bill adds up to its total
        assert sum(c["seconds"] for c in parts) == pytest.approx(steps[key]["total_s"])
    assert steps["tokens_per_s"] == pytest.approx(res.modelled_tokens_per_s, rel=1e-9)
    per = [c for c in steps["per_decoded_token"]["charges"] if c["kind"] == "net"]
    assert sum(c["count"] for c in per if c["what"].startswith("block_cache")) == rt.num_layers


@pytest.mark.parametrize("sampler", ["greedy", "sample", "host"])
def test_profiles_step_totals_are_runs_modelled_times(tmp_path_factory, capsys,
                                                      sampler: str) -> None:
    """`toptpu profile`'s time to first token and per decoded token (its step bill from the
    nets' profiled runs) equal what `toptpu run` charges a generation of the same file, the
    same prompt length and the same sampler: the per-net times and run's tok/s, related."""
    path = compiled(tmp_path_factory, "qwen2").model_file
    _profile_steps_equal_runs(path, list(range(3, 3 + 21)), sampler, capsys)  # 2 chunks


@pytest.mark.slow  # compiles a Qwen3.5 model
def test_profiles_steps_of_a_model_with_two_layer_kinds_are_runs(tmp_path_factory, capsys
                                                                ) -> None:
    """Qwen3.5: linear-attention layers run `block*` nets, full-attention ones `block*@3`;
    each profiled with its own layer's weights, each layer charged its own net, and a
    chunk padded past SEQ copies the KV rows of the attention layers only."""
    path = compiled(tmp_path_factory, "qwen3_5", seq=40, input_len=16, layers=4).model_file
    _profile_steps_equal_runs(path, list(range(3, 3 + 36)), "greedy", capsys)


@pytest.mark.slow  # compiles a Qwen3.5 model for two devices
def test_profiles_steps_of_a_hybrid_model_over_pipeline_stages_are_runs(
        tmp_path_factory, capsys) -> None:
    """Qwen3.5 over 2 pipeline stages (its linear-attention layers 0-1 on device 0): the
    host writes position ids and masks to the second stage only, as the device group does."""
    path = compiled(tmp_path_factory, "qwen3_5", seq=40, input_len=16, layers=4, devices=2,
                    parallel="pp").model_file
    _profile_steps_equal_runs(path, list(range(3, 3 + 36)), "greedy", capsys)


def test_profile_text_columns_line_up(tmp_path_factory, capsys) -> None:
    """Every row of the net table and of the step bills has its columns where the header
    has them (`embedding_cache` once pushed its row one column right)."""
    from toptpu.cli import main

    assert main(["profile", compiled(tmp_path_factory, "qwen2").model_file]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.split()[:1] in (["net"], ["what"])]
    assert len(heads) == 3
    for i in heads:
        rows = []
        for line in lines[i + 1:]:
            if not line.strip() or line.split()[0] in ("dma/cmp:", "time", "one", "decode:"):
                break
            rows.append(line)
        assert len(rows) >= 4
        assert {len(r) for r in rows if not r.lstrip().startswith("total")} == {len(lines[i])}
