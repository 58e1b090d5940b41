"""Models spread over several devices, end to end: tiny Qwen2 (untied lm_head) and Llama 3
(tied) with GQA (4 query heads, 2 KV heads; 4 devices replicate each KV head on two)
compiled f32 for tensor parallelism over 2 and 4 devices and pipeline parallelism over 2,
run on one reference machine per device:

- greedy tokens equal transformers `generate` and the one-device file's (40 tokens after
  a 39-token prompt: three prefill chunks, the later ones through block_kv);
- the logits: pipeline parallelism runs the one-device programs, so bit-identical;
  tensor parallelism adds each row-parallel matmul's K in N parts and then the all-reduce,
  so within 1e-5 of the largest |logit|;
- each device's weight blob holds only its pieces (pp: only its layers), and the pieces of
  all devices make up the one-device file's tensors;
- the modelled time is at least each device's roofline time of the nets it ran plus the
  link time of its transfers;
- a model that does not fit one device is refused with the device count.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from llm_fixtures import LONG_PROMPT, compiled, hf_generate

from toptpu.backend.formats.commands import Collective
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader, WeightLayout
from toptpu.backend.runtime.device_executor import DeviceGroupExecutor
from toptpu.backend.runtime.run_trace import LINK, trace_events
from toptpu.backend.runtime.runtime import Runtime, SamplingConfig
from toptpu.backend.target.link import LinkWork
from toptpu.dialects.sharding import parse_shard_name, piece_of

pytestmark = pytest.mark.slow  # compiles model files and generates against transformers

CASES = [("qwen2", "tp", 2), ("qwen2", "tp", 4), ("llama3", "tp", 2), ("qwen2", "pp", 2),
         ("llama3", "pp", 2)]
N = 40


@pytest.mark.parametrize(("family", "parallel", "devices"), CASES)
def test_greedy_tokens_equal_transformers_and_the_one_device_file(
        tmp_path_factory: pytest.TempPathFactory, family: str, parallel: str,
        devices: int) -> None:
    one = compiled(tmp_path_factory, family)
    many = compiled(tmp_path_factory, family, devices=devices, parallel=parallel)
    rt1, rtn = Runtime.open(one.model_file), Runtime.open(many.model_file)
    assert isinstance(rtn.ex, DeviceGroupExecutor) and rtn.ex.n == devices
    ids = rtn.encode(LONG_PROMPT)
    res = rtn.generate(ids, N)
    assert len(res.generated_ids) >= 32
    assert res.generated_ids == hf_generate(many.model_dir, ids, N)
    assert res.generated_ids == rt1.generate(ids, N).generated_ids
    a, b = rt1.sequence_logits(ids), rtn.sequence_logits(ids)
    if parallel == "pp":
        assert np.array_equal(a, b)
    else:
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


@pytest.mark.parametrize(("parallel", "devices"), [("tp", 2), ("pp", 2)])
def test_sampled_tokens_on_the_chip_equal_the_one_device_files(
        tmp_path_factory: pytest.TempPathFactory, parallel: str, devices: int) -> None:
    """The sample head on several devices (tp: it gathers the vocabulary pieces of the
    logits first) draws what one device draws with the same seed; its repetition penalty
    reads ids from every device's piece."""
    one = compiled(tmp_path_factory, "qwen2")
    many = compiled(tmp_path_factory, "qwen2", devices=devices, parallel=parallel)
    rt1, rtn = Runtime.open(one.model_file), Runtime.open(many.model_file)
    cfg = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3,
                         seed=7, sampler="chip")
    ids = rtn.encode(LONG_PROMPT)
    a = rt1.generate(ids, 24, cfg, stop_on_eos=False)
    b = rtn.generate(ids, 24, cfg, stop_on_eos=False)
    assert b.sampler == "sample" and a.generated_ids == b.generated_ids


@pytest.mark.parametrize(("parallel", "devices"), [("tp", 2), ("pp", 2)])
def test_a_traced_run_records_every_net_transfer_and_send_on_the_modelled_clock(
        tmp_path_factory: pytest.TempPathFactory, parallel: str, devices: int) -> None:
    """`run --trace` of a multi-device file: the net runs, host transfers and sends
    between devices follow one another on the clock and add up to the modelled time."""
    many = compiled(tmp_path_factory, "qwen2", devices=devices, parallel=parallel)
    rt = Runtime.open(many.model_file)
    rec = rt.start_trace()
    rt.generate(rt.encode(LONG_PROMPT), 6)
    assert rec.peers and all(p.src != p.dst for p in rec.peers)
    if parallel == "pp":  # stage to stage
        assert {(p.src, p.dst) for p in rec.peers} == {(0, 1)}
    spans = sorted([(r.start_s, r.costs.total_s) for r in rec.runs]
                   + [(t.start_s, t.costs.total_s) for t in rec.transfers]
                   + [(p.start_s, p.costs.total_s) for p in rec.peers])
    clock = 0.0
    for start, dur in spans:
        assert start == pytest.approx(clock, abs=1e-12)
        clock = start + dur
    assert clock == pytest.approx(rt.ex.modelled_seconds(), rel=1e-12)
    events = list(trace_events(rec))
    assert sum(e.get("tid") == LINK and e["ph"] == "X" for e in events) == len(rec.peers)


def _tensor(f: LlmFile, layout: WeightLayout, name: str, layer: int | None) -> np.ndarray:
    blob = np.frombuffer(f.file.view(layout.section), np.uint8)
    e = layout.shared[name] if layer is None else layout.chunk_of(layer)[name]
    base = 0 if layer is None else layout.layer_start(layer)
    return blob[base + e.offset:base + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)


def _whole(name: str) -> str:
    """The one-device file's name of a shard weight's tensor (`W@shard0-2:bf16.t` ->
    `W:bf16.t`)."""
    return re.sub(r"@shard\d+-\d+", "", name)


def test_a_tp_header_with_a_device_lacking_a_cut_net_is_refused_when_opened(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tensor-parallel net (the lm_head, cut by vocabulary) run by fewer than all the
    devices is refused from the header, before anything runs (issue 44's U3: it was refused
    only mid-run, after printing a token)."""
    f = LlmFile(compiled(tmp_path_factory, "qwen2", devices=2, parallel="tp").model_file)
    data = f.meta.to_json()
    data["parallel"]["devices"][1]["nets"] = [
        n for n in data["parallel"]["devices"][1]["nets"] if n != "lm_head"]
    with pytest.raises(HeaderError, match=r"parallel\.devices .*run the tensor-parallel net "
                       r"'lm_head' on 1 of the 2 devices"):
        LlmHeader.from_json(data)


@pytest.mark.parametrize(("family", "devices"), [("qwen2", 4), ("llama3", 2)])
def test_each_tp_device_holds_only_its_pieces_and_together_they_are_the_weights(
        tmp_path_factory: pytest.TempPathFactory, family: str, devices: int) -> None:
    one = LlmFile(compiled(tmp_path_factory, family).model_file)
    f = LlmFile(compiled(tmp_path_factory, family, devices=devices, parallel="tp").model_file)
    par = f.meta.parallel
    assert par is not None and par.strategy == "tp" and len(par.devices) == devices
    cut = 0
    for region in ("shared", "layer"):
        layers: list[int | None] = [None] if region == "shared" else [0, 1]
        for layer in layers:
            names = par.devices[0].weights.shared if layer is None \
                else par.devices[0].weights.chunk_of(layer)
            for name in names:
                shard = parse_shard_name(re.sub(r"(@shard\d+-\d+).*", r"\1", name))
                if shard is None:
                    continue
                cut += 1
                if name.startswith("tp.offsets."):  # each device's first vocabulary id
                    vocab = f.meta.model.vocab_size
                    assert [int(_tensor(f, par.devices[d].weights, name, None)[0])
                            for d in range(devices)] == [d * vocab // devices
                                                         for d in range(devices)]
                    continue
                split = shard[1]
                whole = _tensor(one, one.layout, _whole(name), layer)
                pieces = [_tensor(f, par.devices[d].weights, name, layer)
                          for d in range(devices)]
                for d in range(devices):  # replicated pieces are identical
                    same = piece_of(d, devices, split.pieces)
                    assert np.array_equal(pieces[d], pieces[same * devices // split.pieces])
                distinct = [pieces[k * devices // split.pieces] for k in range(split.pieces)]
                assert pieces[0].size * split.pieces == whole.size, name
                assert any(np.array_equal(np.concatenate(distinct, axis=ax), whole)
                           for ax in range(whole.ndim)), name
    assert cut >= 8  # q, k, v, o, gate, up, down per layer; the lm_head; the offsets
    # device 0 alone has the embedding table, whole; every blob is smaller than the one file's
    assert "embed_tokens.weight" in par.devices[0].weights.shared
    assert all("embed_tokens.weight" not in d.weights.shared for d in par.devices[1:])
    assert all(d.weights.size < one.layout.size for d in par.devices)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_each_pp_stage_holds_only_its_layers(tmp_path_factory: pytest.TempPathFactory,
                                             family: str) -> None:
    one = LlmFile(compiled(tmp_path_factory, family).model_file)
    f = LlmFile(compiled(tmp_path_factory, family, devices=2, parallel="pp").model_file)
    par = f.meta.parallel
    assert par is not None and [list(d.layers) for d in par.devices] == [[0], [1]]
    first, last = par.devices
    assert "embedding" in first.nets and "lm_head" not in first.nets
    assert "lm_head" in last.nets and "embedding" not in last.nets
    for d, dev in enumerate(par.devices):
        assert dev.weights.num_layers == 1
        for name in dev.weights.chunk_of(0):
            assert np.array_equal(_tensor(f, dev.weights, name, 0),
                                  _tensor(one, one.layout, name, d)), name
    # the lm_head's weight lies on the last device only
    head = [w for w in f.meta.nets["lm_head"].weights if w in last.weights.shared
            and w not in first.weights.shared]
    assert head and all(np.array_equal(_tensor(f, last.weights, w, None),
                                       _tensor(one, one.layout, w, None)) for w in head)


def _roofline_s(ex: DeviceGroupExecutor, net: str) -> float:
    """A lower bound of one run of `net` on one device: its DMA bytes over the DMA
    bandwidth or its FLOPs over the peak (no efficiency), whichever is longer."""
    prog, chip = ex.program(net), ex.chip
    dma = sum(c.nbytes for c in prog.commands if c.engine == "dma")
    cmp = sum(c.flops / (chip.flops_per_cycle(c.dtype) * chip.freq_ghz * 1e9)
              for c in prog.commands if c.engine == "cmp")
    return max(dma / (chip.dma_gbps * 1e9), cmp)


def _link_s(ex: DeviceGroupExecutor, net: str) -> float:
    """The link time of `net`'s collectives on one device, from the link figures."""
    chip = ex.chip
    return sum(chip.link_latency_us * 1e-6 + b / (chip.link_gbps * 1e9)
               for c in ex.program(net).commands if isinstance(c, Collective)
               for b in LinkWork(c.kind, c.algorithm, c.devices, c.nbytes).steps())


@pytest.mark.parametrize(("parallel", "devices"), [("tp", 2), ("pp", 2)])
def test_the_modelled_time_covers_each_devices_nets_and_link_transfers(
        tmp_path_factory: pytest.TempPathFactory, parallel: str, devices: int) -> None:
    many = compiled(tmp_path_factory, "qwen2", devices=devices, parallel=parallel)
    rt = Runtime.open(many.model_file)
    ex = rt.ex
    assert isinstance(ex, DeviceGroupExecutor)
    runs: list[tuple[str, int | None]] = []
    run = ex.run

    def spy(net: str, bindings: Any, layer: int | None = None) -> None:
        runs.append((net, layer))
        run(net, bindings, layer)

    ex.run = spy  # type: ignore[method-assign]
    rt.generate(rt.encode("Hello world!"), 8)
    costs = ex.modelled_costs()
    engines = costs.total_s - costs.host_s - costs.launch_s  # the nets' and the link's time
    chip = ex.chip
    for d in range(devices):
        busy = sum(_roofline_s(ex, net) + _link_s(ex, net) for net, layer in runs
                   if d in ex.parallel.runners(net, layer))
        assert engines >= busy > 0
    if parallel == "tp":  # every block net's two all-reduces, on the link
        assert costs.link_s >= sum(_link_s(ex, net) for net, _ in runs) > 0
    else:  # the hidden state from stage 0 to stage 1, each step: one send of [1, *, H]
        assert ex.peer_copies >= 8
        assert costs.link_s >= ex.peer_copies * chip.link_latency_us * 1e-6


def test_a_model_that_does_not_fit_one_device_is_refused_with_the_device_count(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a chip of 0.5 MB the tiny Qwen2 (0.6 MB of f32 weights and its KV cache) fits
    no single device: refused, naming the devices it needs; over two pipeline stages it
    fits."""
    from llm_fixtures import tiny_dir

    from toptpu.backend.target import chips
    from toptpu.compiler import CompileError
    from toptpu.compiler import compile as compile_model

    presets = {k: dict(v) for k, v in chips._presets().items()}
    presets["bm1684x"]["ddr_bytes"] = 500_000
    monkeypatch.setattr(chips, "_presets", lambda: presets)
    model_dir = tiny_dir(tmp_path_factory, "qwen2")
    out = str(tmp_path_factory.mktemp("fit") / "m.toptpu")
    with pytest.raises(CompileError, match=r"does not fit one device: it needs 0\.\d+ GiB "
                                           r"\(weights .* \+ KV cache .*\), more than a "
                                           r"bm1684x's 0\.00 GiB; compile it for at least "
                                           r"--devices 2 --parallel tp or pp"):
        compile_model(model_dir, out, seq_length=64, progress=None)
    compile_model(model_dir, out, seq_length=64, progress=None, devices=2, parallel="pp")
    assert LlmFile(out).meta.parallel is not None


@pytest.mark.parametrize(("parallel", "devices"), [("tp", 2), ("tp", 4), ("pp", 2)])
def test_the_estimate_from_a_config_is_what_the_devices_charge_the_compiled_file(
        tmp_path_factory: pytest.TempPathFactory, parallel: str, devices: int) -> None:
    """`toptpu estimate --devices N --parallel P` from config.json alone: the modelled time
    to first token (a two-chunk prompt) and tokens/s of a generation on the device group,
    and each device's weight blob and KV cache."""
    from toptpu.estimate import compile_costs, estimate, read_checked_config
    from toptpu.request import CompileRequest

    built = compiled(tmp_path_factory, "qwen2", seq=64, input_len=16, devices=devices,
                     parallel=parallel)
    rt = Runtime.open(built.model_file)
    ex = rt.ex
    assert isinstance(ex, DeviceGroupExecutor)
    request = CompileRequest.make(mode="f32", chip=ex.chip, seq_length=64, max_input_length=16,
                                  devices=devices, parallel=parallel)
    config = read_checked_config(built.model_dir, request)
    costs = compile_costs(config, request, nets=list(ex.nets()))
    ids = list(range(3, 3 + 16 + 5))
    res = rt.generate(ids, 6, stop_on_eos=False)
    est = estimate(costs, ex.chip, prompt_tokens=len(ids), sampler=res.sampler)
    assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9)
    assert res.modelled_tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9)
    par = ex.parallel
    assert costs.device_weight_bytes == [d.weights.size for d in par.devices]
    caches = [0] * devices
    for root in {id(b.root): b.root for b in (*rt.cache_k, *rt.cache_v)}.values():
        for d, part in root.parts.items():
            caches[d] += part.nbytes
    assert costs.device_kv_bytes == caches
    assert est.per_token.link_s > 0


def test_a_hybrid_model_spreads_by_pipeline_stages_and_refuses_tensor_parallel(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3.5 (three linear-attention layers, then a full-attention one) over 2 pipeline
    stages: greedy tokens equal transformers and the one-device file's, the logits
    bit-identical; the estimate from config.json charges what the device group charges (a
    stage of linear-attention layers is sent no position ids or mask) and gives each
    device's blob and its layers' KV cache and state. Tensor parallelism is refused by
    compile and estimate in one line naming the linear-attention layers."""
    from llm_fixtures import tiny_dir

    from toptpu.compiler import CompileError
    from toptpu.compiler import compile as compile_model
    from toptpu.estimate import EstimateError, compile_costs, estimate, read_checked_config
    from toptpu.request import CompileRequest

    one = compiled(tmp_path_factory, "qwen3_5", layers=4)
    many = compiled(tmp_path_factory, "qwen3_5", layers=4, devices=2, parallel="pp")
    rt1, rtn = Runtime.open(one.model_file), Runtime.open(many.model_file)
    ex = rtn.ex
    assert isinstance(ex, DeviceGroupExecutor)
    assert [d.layers for d in ex.parallel.devices] == [range(0, 2), range(2, 4)]
    ids = rtn.encode(LONG_PROMPT)
    res = rtn.generate(ids, 32, stop_on_eos=False)
    assert res.generated_ids == hf_generate(many.model_dir, ids, 32)
    assert res.generated_ids == rt1.generate(ids, 32, stop_on_eos=False).generated_ids
    assert np.array_equal(rt1.sequence_logits(ids), rtn.sequence_logits(ids))

    request = CompileRequest.make(mode="f32", chip=ex.chip, seq_length=160,
                                  max_input_length=16, devices=2, parallel="pp")
    config = read_checked_config(many.model_dir, request)
    costs = compile_costs(config, request, nets=list(ex.nets()))
    est = estimate(costs, ex.chip, prompt_tokens=len(ids), sampler=res.sampler)
    assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9)
    assert res.modelled_tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9)
    assert costs.device_weight_bytes == [d.weights.size for d in ex.parallel.devices]
    caches = [0] * 2
    bufs = [*rtn.cache_k, *rtn.cache_v, *(b for st in rtn.states if st for b in st.values())]
    for root in {id(b.root): b.root for b in bufs if b is not None}.values():
        for d, part in root.parts.items():
            caches[d] += part.nbytes
    assert costs.device_kv_bytes == caches
    assert sum(caches) == costs.kv_bytes + costs.state_bytes

    refusal = r"--devices 2 --parallel tp: .* linear-attention layers.*; use --parallel pp"
    with pytest.raises(CompileError, match=refusal):
        compile_model(many.model_dir, str(tmp_path_factory.mktemp("tp") / "m.toptpu"),
                      seq_length=64, progress=None, devices=2, parallel="tp")
    with pytest.raises(CompileError, match=refusal):
        read_checked_config(tiny_dir(tmp_path_factory, "qwen3_5", 4),
                            CompileRequest.make(mode="f32", seq_length=64, devices=2,
                                                parallel="tp"))
    with pytest.raises(EstimateError, match=refusal):
        compile_costs(config, CompileRequest.make(mode="f32", chip=ex.chip, seq_length=64,
                                                  max_input_length=16, devices=2,
                                                  parallel="tp"), nets=["block_cache"])


def test_a_gguf_of_scale_and_min_types_spreads_by_pipeline_stages_only(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A GGUF whose linears keep their exact forms (Q4_1 / Q5_1 / Q4_K / Q5_K: scales and
    mins; each layer of other types, so nets of its own) over 2 pipeline stages: each stage
    holds its own layer's chunk with its mins, greedy tokens and logits equal the
    one-device file's bit for bit. Tensor parallelism refuses a pre-quantized checkpoint
    (its packed integers, scales and mins are not cut) in one line."""
    import os

    from test_gguf import exact_types_gguf

    from toptpu.compiler import CompileError
    from toptpu.compiler import compile as compile_model

    root = tmp_path_factory.mktemp("gguf-pp")
    d = exact_types_gguf(str(root / "src"), "llama2")
    one, pp = str(root / "one.toptpu"), str(root / "pp.toptpu")
    # the 20-token prompt and its 12 new tokens: prefill at 32, as at the default shapes
    shapes = {"seq_length": 64, "max_input_length": 32}
    compile_model(d, one, mode="w8f32", progress=None, **shapes)
    compile_model(d, pp, mode="w8f32", progress=None, devices=2, parallel="pp", **shapes)
    rt1, rtn = Runtime.open(one), Runtime.open(pp)
    devices = rtn.meta.parallel.devices
    assert [dv.layers for dv in devices] == [range(0, 1), range(1, 2)]
    for dv, prefix in zip(devices, ("layer.", "v1.layer."), strict=True):
        (chunk,) = dv.weights.chunks
        mins = [n for n in chunk if n.endswith(":ckpt.mins")]
        assert len(mins) == 4 and all(n.startswith(prefix) for n in mins), mins
    ids = list(range(5, 25))
    assert rtn.generate(ids, 12, stop_on_eos=False).generated_ids == \
        rt1.generate(ids, 12, stop_on_eos=False).generated_ids
    assert np.array_equal(rt1.sequence_logits(ids), rtn.sequence_logits(ids))
    with pytest.raises(CompileError, match=r"--devices 2 --parallel tp: .*model\.gguf is a "
                                           r"pre-quantized checkpoint.*; use --parallel pp"):
        compile_model(d, os.path.join(root, "tp.toptpu"), mode="w8f32", progress=None,
                      devices=2, parallel="tp")
