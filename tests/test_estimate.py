"""`toptpu estimate`: the modelled time of a model from its config alone.

- each net's modelled time is bounded below by the bytes it moves over the sustained DDR
  bandwidth and by its FLOPs over the chip's peak, on any chip (re-timed with hypothesis);
- the estimate from a config equals what the machine charges running the compiled model
  file of the same shapes: per net (`toptpu profile`), and the time to first token and the
  decode speed of a generation (`Runtime.generate`, the executor's ledger).
"""

from __future__ import annotations

import json
import math

import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled, tiny_dir

from toptpu.backend.contract import StaticShapes
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.target.chips import get_chip
from toptpu.cli import main
from toptpu.dialects.common import QuantMode
from toptpu.estimate import STEP_NETS, CompiledCosts, compile_costs, estimate, read_checked_config
from toptpu.profile_cli import profile_model
from toptpu.request import CompileRequest

pytestmark = pytest.mark.slow  # compiles tiny models

SEQ, CHUNK = 160, 16


@pytest.fixture(scope="module")
def tiny_costs(tmp_path_factory: pytest.TempPathFactory) -> CompiledCosts:
    """The step nets of the tiny Qwen2 in w4bf16 (weights quantized, bf16 compute)."""
    request = CompileRequest(mode=QuantMode.W4BF16, chip=get_chip("bm1684x"),
                             shapes=StaticShapes.make(SEQ, CHUNK))
    config = read_checked_config(tiny_dir(tmp_path_factory, "qwen2"), request)
    return compile_costs(config, request, nets=STEP_NETS)


@fuzz_settings(40)
@given(ddr_gbps=st.floats(1.0, 512.0), ddr_efficiency=st.floats(0.05, 1.0),
       core_ddr_gbps=st.floats(1.0, 512.0), cores=st.integers(1, 4),
       tflops=st.floats(0.1, 200.0), compute_efficiency=st.floats(0.05, 1.0),
       freq_ghz=st.floats(0.2, 3.0))
def test_each_nets_time_is_at_least_its_bytes_over_bandwidth_and_flops_over_peak(
        tiny_costs: CompiledCosts, ddr_gbps: float, ddr_efficiency: float,
        core_ddr_gbps: float, cores: int, tflops: float, compute_efficiency: float,
        freq_ghz: float) -> None:
    base = get_chip("bm1684x")
    scale = tflops / base.tflops["bf16"]
    chip = base.with_figures(ddr_gbps=ddr_gbps, ddr_efficiency=ddr_efficiency,
                             core_ddr_gbps=core_ddr_gbps, cores=cores,
                             tflops={k: v * scale for k, v in base.tflops.items()},
                             compute_efficiency=compute_efficiency, freq_ghz=freq_ghz)
    peak = cores * max(chip.tflops.values()) * 1e12
    for name, t in tiny_costs.timings(chip).items():
        seconds = t.seconds(chip)
        assert t.dma_bytes > 0 and seconds > 0, name
        assert seconds >= t.dma_bytes / (chip.sustained_gbps * 1e9) * (1 - 1e-9), name
        assert seconds >= t.flops / peak * (1 - 1e-9), name


def test_the_bounds_bind_where_each_engine_is_the_bottleneck(tiny_costs: CompiledCosts
                                                               ) -> None:
    """The lower bounds are not vacuous: on a chip with a slow DDR the decode layer's time
    is within 2x of bytes over bandwidth; with slow compute the prefill block's time is
    within 2x of FLOPs over the sustained bf16 peak (w4bf16's matmuls)."""
    base = get_chip("bm1684x")
    slow_ddr = base.with_figures(ddr_gbps=0.5, core_ddr_gbps=0.5)
    t = tiny_costs.timings(slow_ddr)["block_cache"]
    assert t.bound == "ddr"
    assert t.seconds(slow_ddr) < 2 * t.dma_bytes / (slow_ddr.sustained_gbps * 1e9)
    slow_mac = base.with_figures(tflops={k: v / 1e4 for k, v in base.tflops.items()})
    t = tiny_costs.timings(slow_mac)["block"]
    peak = slow_mac.tflops["bf16"] * 1e12 * slow_mac.compute_efficiency  # the mode's MACs
    assert t.bound == "compute"
    assert t.seconds(slow_mac) < 2 * t.flops / peak


@pytest.mark.parametrize("mode", ["f32", "w4bf16"])
def test_the_estimate_from_a_config_is_what_the_machine_charges_the_compiled_file(
        tmp_path_factory: pytest.TempPathFactory, mode: str) -> None:
    built = compiled(tmp_path_factory, "qwen2", mode, seq=SEQ, input_len=CHUNK)
    ex, profiles = profile_model(built.model_file)
    chip = ex.chip
    request = CompileRequest.make(mode=mode, chip=chip, seq_length=SEQ, max_input_length=CHUNK)
    config = read_checked_config(built.model_dir, request)
    costs = compile_costs(config, request, nets=list(ex.nets()))
    # per net: the profile's modelled time, bytes and FLOPs of one run
    timings = costs.timings(chip)
    assert {p.net for p in profiles} == set(timings)
    for p in profiles:
        t = timings[p.net]
        assert t.seconds(chip) == pytest.approx(p.seconds, rel=1e-12), p.net
        assert t.flops == p.flops, p.net
    # a generation: the first token (prefill of a two-chunk prompt) and the decoded ones
    rt = Runtime.open(built.model_file)
    ids = list(range(3, 3 + CHUNK + 5))
    res = rt.generate(ids, 6, stop_on_eos=False)
    assert res.sampler == "greedy"
    est = estimate(costs, chip, prompt_tokens=len(ids), sampler=res.sampler)
    assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9)
    assert res.modelled_tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9)
    # the model file's weight blob and KV caches are the sizes the estimate reports
    assert costs.weight_bytes == ex.meta.weights.size
    assert costs.kv_bytes == sum(math.prod(b.shape) * b.dtype.itemsize
                                 for b in (*rt.cache_k, *rt.cache_v))


def test_estimate_and_run_agree_at_every_prefill_length(tmp_path_factory) -> None:
    """A file with prefill lengths 16, 32 and 48: the modelled time to first token of prompts
    at 16, at 32, at 48, and of 48 + 5 (block_kv at 16) is what the machine charges, and a
    short prompt costs less than one that needs a longer chunk."""
    seq, chunk = 96, 48
    built = compiled(tmp_path_factory, "qwen2", "w4bf16", seq=seq, input_len=chunk)
    rt = Runtime.open(built.model_file)
    chip = rt.ex.chip
    shapes = StaticShapes.make(seq, chunk)
    assert shapes.prefill_lengths == (16, 32, chunk)
    request = CompileRequest(mode=QuantMode.W4BF16, chip=chip, shapes=shapes)
    config = read_checked_config(built.model_dir, request)
    costs = compile_costs(config, request, nets=list(rt.ex.nets()))
    ttft = {}
    for n in (5, 20, 40, chunk + 5):
        res = rt.generate(list(range(3, 3 + n)), 3, stop_on_eos=False)
        est = estimate(costs, chip, prompt_tokens=n, sampler=res.sampler)
        assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9), n
        ttft[n] = est.ttft_s
    assert ttft[5] < ttft[20] < ttft[40] < ttft[chunk + 5]


def test_estimate_json_has_the_issue_keys(tmp_path_factory: pytest.TempPathFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tiny_dir(tmp_path_factory, "qwen2")
    assert main(["estimate", model_dir, "-q", "w4bf16", "--seq-length", str(SEQ),
                 "--max-input-length", str(CHUNK), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"modelled_ttft_s", "modelled_tokens_per_s", "weight_bytes", "kv_bytes",
            "breakdown"} <= set(out)
    per = out["breakdown"]["per_decoded_token"]
    assert out["modelled_tokens_per_s"] == pytest.approx(1 / per["total_s"])
    # a decode step launches 2 layers + embedding, lm_head and head; the tiny model's step
    # is dominated by the fixed launch and host-transfer costs, not by its nets
    assert per["launches"] == 2 + 3 and per["bound"] in ("launch", "host")
    assert per["launch_s"] + per["host_s"] > per["ddr_s"] + per["compute_s"]
    m = out["model"]
    assert out["kv_bytes"] == 2 * m["num_layers"] * SEQ * m["num_kv_heads"] * m["head_dim"] * 2


def test_a_hybrid_models_estimate_is_what_the_machine_charges(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen3.5 config (three linear-attention layers, one full-attention layer): the
    estimate compiles the nets of both kinds (`block_cache`, `block_cache@3`), charges each
    layer its kind's nets, and equals what the machine charges running the compiled file
    (per net, the first token of a two-chunk prompt, decode); the KV cache is the one
    full-attention layer's, the state every linear layer's, and each linear layer's decode
    net moves its state in and out every step."""
    from toptpu.backend.contract import CONV_STATE, RECURRENT_STATE

    built = compiled(tmp_path_factory, "qwen3_5", "w4bf16", seq=SEQ, input_len=CHUNK,
                     layers=4)
    ex, profiles = profile_model(built.model_file)
    chip = ex.chip
    request = CompileRequest(mode=QuantMode.W4BF16, chip=chip,
                             shapes=StaticShapes.make(SEQ, CHUNK))
    config = read_checked_config(built.model_dir, request)
    costs = compile_costs(config, request, nets=[*STEP_NETS, "block_kv"])
    assert {"block", "block@3", "block_cache", "block_cache@3"} <= set(costs.commands)
    assert costs.model.layer_nets()["block_cache"] == ["block_cache"] * 3 + ["block_cache@3"]
    timings = costs.timings(chip)
    assert set(timings) <= {p.net for p in profiles}
    for p in profiles:
        if p.net in timings:
            assert timings[p.net].seconds(chip) == pytest.approx(p.seconds, rel=1e-12), p.net
    rt = Runtime.open(built.model_file)
    ids = list(range(3, 3 + CHUNK + 5))
    res = rt.generate(ids, 6, stop_on_eos=False)
    est = estimate(costs, chip, prompt_tokens=len(ids), sampler=res.sampler)
    assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9)
    assert res.modelled_tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9)
    assert est.per_token.launches == 3 + 1 + 3  # 3 linear + 1 full layer, emb, lm_head, head
    assert costs.weight_bytes == ex.meta.weights.size
    assert costs.kv_bytes == sum(math.prod(b.shape) * b.dtype.itemsize
                                 for b in (*rt.cache_k, *rt.cache_v) if b is not None)
    state = [rt.states[i][n] for i in range(3) for n in (CONV_STATE, RECURRENT_STATE)]
    assert costs.state_bytes == sum(math.prod(b.shape) * b.dtype.itemsize for b in state)
    per_layer_state = costs.state_bytes // 3
    assert timings["block_cache"].dma_bytes >= 2 * per_layer_state
    nets = est.net_json()
    assert nets["block_cache"]["runs_per_step"] == 3
    assert nets["block_cache@3"]["runs_per_step"] == 1
    # the command line says the same
    assert main(["estimate", built.model_dir, "-q", "w4bf16", "--seq-length", str(SEQ),
                 "--max-input-length", str(CHUNK), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "4 layers (3 linear attention, 1 full attention)" in out
    assert f"linear-attention state {costs.state_bytes / 1e6:.1f} MB (3 layers" in out
    # toptpu profile charges the same steps from the file's nets (each layer its kind's)
    assert main(["profile", built.model_file, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert steps["tokens_per_s"] == pytest.approx(est.tokens_per_s, rel=1e-9)
