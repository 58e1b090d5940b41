"""Several prefill chunk lengths in one model file (`--prefill-lengths`): the embedding and
prefill nets are compiled at each length, the runtime runs a chunk of n tokens at the
shortest length that holds n (block, then block_kv over the history), and every length
gives transformers' greedy tokens and the same bits on the machine and the interpreter
(Qwen2 and Qwen3.5's linear-attention layers, whose state carries across chunks of
different lengths). The header refuses lengths and nets that do not agree; the nets of
different lengths share every weight of a layer's chunk."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
from llm_fixtures import LONG_PROMPT, compiled, hf_generate
from quant_fixtures import quant_checkpoints  # noqa: F401 - session fixture

from toptpu.backend.contract import ContractError, StaticShapes
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader
from toptpu.backend.runtime.runtime import Runtime

pytestmark = pytest.mark.slow  # compiles model files and generates against transformers

SEQ, L = 96, 48  # default prefill lengths: 16, 32 and 48


def _recording(rt: Runtime) -> list[str]:
    """The nets `rt` runs from now on, in order (layer 0's runs only)."""
    ran: list[str] = []
    run: Callable = rt.ex.run

    def record(net: str, bindings, layer: int | None = None) -> None:  # noqa: ANN001
        if layer in (None, 0):
            ran.append(net)
        run(net, bindings, layer)

    rt.ex.run = record  # type: ignore[method-assign]
    return ran


def _prefill_nets(ran: list[str]) -> list[str]:
    return [n for n in ran if n.split(":")[0].split("@")[0] in ("embedding", "block",
                                                                  "block_kv")]


def test_default_lengths_and_the_shortest_that_holds_a_chunk() -> None:
    shapes = StaticShapes.make(SEQ, L)
    assert shapes.prefill_lengths == (16, 32, 48)
    assert [shapes.chunk_length(n) for n in (1, 16, 17, 32, 33, 48)] == [16, 16, 32, 32, 48, 48]
    assert StaticShapes.make(512).prefill_lengths == (16, 32, 64, 128)
    assert StaticShapes.make(2048, 1024).prefill_lengths == (16, 32, 64, 128, 256, 512, 1024)
    assert StaticShapes.make(64, 16).prefill_lengths == (16,)
    assert StaticShapes.make(512, prefill_lengths=[32, 256]).max_input_length == 256
    assert StaticShapes.make(512, 128, prefill_lengths=[8]).prefill_lengths == (8, 128)
    assert StaticShapes(64, 32, 64).prefill_lengths == (32,)  # a file of one length
    for args, message in (((64, None, None, [16, 16]), "names 16 twice"),
                          ((64, None, None, [128]), "must be between 1 and --seq-length 64"),
                          ((64, 32, None, [16, 48]), "48 is longer than --max-input-length"),
                          ((64, None, None, []), "names no length")):
        with pytest.raises(ContractError, match=message):
            StaticShapes.make(*args)


def test_the_runtime_runs_each_chunk_at_the_shortest_length(tmp_path_factory) -> None:
    """Prompts on both sides of each length, a second chunk through block_kv at 16, and a
    second turn: the nets each runs, and greedy tokens equal transformers'."""
    built = compiled(tmp_path_factory, "qwen2", "f32", seq=SEQ, input_len=L)
    rt = Runtime.open(built.model_file)
    assert rt.lengths == [16, 32, L]
    expect = {5: ["embedding:16", "block:16"], 16: ["embedding:16", "block:16"],
              17: ["embedding:32", "block:32"], 33: ["embedding", "block"],
              L: ["embedding", "block"],
              L + 5: ["embedding", "block", "embedding:16", "block_kv:16"],
              L + 17: ["embedding", "block", "embedding:32", "block_kv:32"],
              L + 33: ["embedding", "block", "embedding", "block_kv"]}
    for n, nets in expect.items():
        ids = [3 + (i * 7) % 300 for i in range(n)]
        ran = _recording(rt)
        res = rt.generate(ids, 8, stop_on_eos=False)
        assert _prefill_nets(ran) == nets, n
        assert res.generated_ids == hf_generate(built.model_dir, ids, 8), n
        rt.ex.run = type(rt.ex).run.__get__(rt.ex)  # type: ignore[method-assign]
    # a second turn feeds its few tokens through block_kv at the shortest length
    ids = rt.encode(LONG_PROMPT)
    first = rt.generate(ids, 6)
    more = rt.encode(" And then?", add_special_tokens=False)
    ran = _recording(rt)
    second = rt.generate(more, 6, keep_history=True)
    assert _prefill_nets(ran) == ["embedding:16", "block_kv:16"]
    convo = ids + first.generated_ids + more
    assert second.generated_ids == hf_generate(built.model_dir, convo, 6)


@pytest.mark.parametrize("mode", ["f32", "w4bf16"])
def test_machine_equals_interpreter_at_every_length(tmp_path_factory, mode: str) -> None:
    built = compiled(tmp_path_factory, "qwen2", mode, seq=SEQ, input_len=L)
    machine = Runtime.open(built.model_file, "machine")
    interp = Runtime.open(built.model_file, "interpreter")
    for n in (5, 16, 17, 33, L, L + 5, L + 17, L + 33):
        ids = [3 + (i * 5) % 300 for i in range(n)]
        a, b = machine.prompt_logits(ids), interp.prompt_logits(ids)
        assert a.dtype == b.dtype and np.array_equal(a, b), n


def test_linear_attention_carries_its_state_across_lengths(tmp_path_factory) -> None:
    """Qwen3.5 (three linear-attention layers to one full-attention layer, its own nets
    `block@3`, `block:16@3`, ...): a prompt at 16, one at 32, and one of block at 32 then
    block_kv at 16, equal to transformers on both executors and to each other."""
    built = compiled(tmp_path_factory, "qwen3_5", layers=4, input_len=32)
    machine = Runtime.open(built.model_file, "machine")
    interp = Runtime.open(built.model_file, "interpreter")
    assert machine.lengths == [16, 32]
    assert {"block:16@3", "block_kv:16@3", "block@3"} <= set(machine.nets)
    # opened with the nets every generation runs prepared (each layer kind's decode net),
    # the prefill nets left for the lengths a request uses
    decode = ["embedding_cache", "block_cache", "block_cache@3", "lm_head", "greedy_head"]
    assert machine.decode_nets() == decode
    assert set(machine.ex._loaded) == set(decode)  # type: ignore[attr-defined]
    assert set(interp.ex._plans) == set(decode)  # type: ignore[attr-defined]
    long = machine.encode(LONG_PROMPT)
    assert 32 < len(long) <= 48  # block at 32, then block_kv at 16
    for ids in (long[:5], long[:20], long):
        ran = _recording(machine)
        res = machine.generate(ids, 12)
        assert res.generated_ids == hf_generate(built.model_dir, ids, 12), len(ids)
        assert interp.generate(ids, 12).generated_ids == res.generated_ids
        machine.ex.run = type(machine.ex).run.__get__(machine.ex)  # type: ignore[method-assign]
        if len(ids) > 32:
            assert _prefill_nets(ran) == ["embedding", "block", "embedding:16",
                                          "block_kv:16"]
        a, b = machine.prompt_logits(ids), interp.prompt_logits(ids)
        assert np.array_equal(a, b), len(ids)


def test_nets_of_every_length_share_each_layers_weights(tmp_path_factory) -> None:
    """block:16 reads exactly block's tensors, from the same chunk: the blob is the size a
    file of one length has."""
    many = LlmFile(compiled(tmp_path_factory, "qwen2", "w4bf16", seq=SEQ, input_len=L)
                   .model_file)
    meta = many.meta
    for base in ("block", "block_kv", "embedding"):
        assert set(meta.nets[f"{base}:16"].weights) == set(meta.nets[base].weights)
    one = compiled(tmp_path_factory, "qwen2", "w4bf16", seq=SEQ, input_len=16)
    assert LlmFile(one.model_file).layout.size == many.layout.size


# ---------------------------------------------------------------------------- the header


def _edited(header: dict, edit: Callable[[dict], None]) -> dict:
    out = copy.deepcopy(header)
    edit(out)
    return out


def _drop(h: dict, net: str) -> None:
    del h["nets"][net]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda h: h["shapes"].update(prefill_lengths=[48, 16]),
     r"shapes\.prefill_lengths\[1\] is 16, not above 48"),
    (lambda h: h["shapes"].update(prefill_lengths=[16, 32]),
     r"shapes\.prefill_lengths is \[16, 32\]: the longest must be shapes\.max_input_length "
     r"48"),
    (lambda h: h["shapes"].update(prefill_lengths=[8, 16, 48]),
     r"nets lacks the nets \['embedding:8', 'block:8', 'block_kv:8'\]"),
    (lambda h: h["shapes"].update(prefill_lengths=[48]),
     r"nets\.\w+:16 is a net at chunk length 16, not one of the shorter prefill "
     r"lengths \[\]"),
    (lambda h: _drop(h, "block_kv:16"), r"nets lacks the nets \['block_kv:16'\]"),
    (lambda h: h["layer_nets"]["block"].__setitem__(0, "block:16"),
     r"layer_nets\.block\[0\] is 'block:16', not a block net"),
    (lambda h: h["nets"]["block:16"].update(inputs=h["nets"]["block"]["inputs"]),
     r"nets\.block:16\.inputs\[0\] is hidden float32 \[1, 48, 64\], the net contract .* is "
     r"hidden float32 \[1, 16, 64\]"),
])
def test_a_header_whose_lengths_and_nets_disagree_is_refused(tmp_path_factory, edit,
                                                              message: str) -> None:
    src = LlmFile(compiled(tmp_path_factory, "qwen2", "f32", seq=SEQ, input_len=L).model_file)
    LlmHeader.from_json(src.header)  # as written
    with pytest.raises(HeaderError, match=message):
        LlmHeader.from_json(_edited(src.header, edit))


def test_a_variant_without_its_shorter_nets_is_refused(tmp_path_factory) -> None:
    src = LlmFile(compiled(tmp_path_factory, "qwen3_5", layers=4, input_len=32).model_file)
    with pytest.raises(HeaderError, match=r"nets\.block@3 is a variant without the net "
                                          r"'block:16@3'"):
        LlmHeader.from_json(_edited(src.header, lambda h: _drop(h, "block:16@3")))
    with pytest.raises(HeaderError, match=r"nets\.block:16@2 names an unknown net|"
                                          r"block:16@2 is a variant without the net "
                                          r"'block@2'"):
        LlmHeader.from_json(_edited(src.header, lambda h: h["nets"].update(
            {"block:16@2": h["nets"]["block:16@3"]})))


def test_a_mixed_prequantized_checkpoint_runs_its_variants_at_every_length(
        quant_checkpoints, tmp_path) -> None:  # noqa: ANN001, F811
    """An auto-round checkpoint whose layer 1 is quantized otherwise (a float up_proj):
    `block@1` has its nets at 16 too (`block:16@1`, `block_kv:16@1`), and prompts at 16, at
    32 and of 32 + 4 (block_kv at 16) give the fake-quantized reference's greedy tokens, the
    same bits on the machine and the interpreter."""
    import torch
    from transformers import AutoModelForCausalLM

    from toptpu.compiler import compile as compile_model

    runs = quant_checkpoints.manifest["runs"]["qwen2_asym_g32"]
    path = str(tmp_path / "mixed.toptpu")
    compile_model(runs["auto_gptq"], path, mode="w4f32", seq_length=64, max_input_length=32,
                  progress=None)
    machine = Runtime.open(path, "machine")
    interp = Runtime.open(path, "interpreter")
    assert machine.meta.layer_nets["block"] == ("block", "block@1")
    assert {"block:16@1", "block_kv:16@1", "block_kv@1"} <= set(machine.nets)
    ref = AutoModelForCausalLM.from_pretrained(runs["fake"], dtype=torch.float32).eval()
    for n in (7, 20, 36):
        ids = [3 + (i * 11) % 250 for i in range(n)]
        res = machine.generate(ids, 10, stop_on_eos=False)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False)[0, n:].tolist()
        assert res.generated_ids == want, n
        assert np.array_equal(machine.prompt_logits(ids), interp.prompt_logits(ids)), n


@pytest.mark.parametrize("family,parallel,layers,input_len", [
    ("qwen2", "tp", 2, L), ("qwen2", "pp", 2, L), ("qwen3_5", "pp", 4, 32)])
def test_several_devices_run_each_length_as_one_device_does(
        tmp_path_factory, family: str, parallel: str, layers: int, input_len: int) -> None:
    """A file over 2 devices (tp, pp; a hybrid Qwen3.5 over 2 pipeline stages) has every
    prefill net at each length on the devices that run its layers, gives the one-device
    file's logits (bit for bit over pipeline stages; to f32 rounding under tp, whose
    all-reduce adds partial sums in another order) and its greedy tokens at every length
    and its modelled time
    to first token is the estimate's (the step model's sends and host writes of each
    chunk at its length)."""
    from toptpu.backend.runtime.device_executor import DeviceGroupExecutor
    from toptpu.estimate import compile_costs, estimate, read_checked_config
    from toptpu.request import CompileRequest

    one = compiled(tmp_path_factory, family, layers=layers, seq=SEQ, input_len=input_len)
    many = compiled(tmp_path_factory, family, layers=layers, seq=SEQ, input_len=input_len,
                    devices=2, parallel=parallel)
    rt, ref = Runtime.open(many.model_file), Runtime.open(one.model_file)
    ex = rt.ex
    assert isinstance(ex, DeviceGroupExecutor) and rt.lengths == sorted({16, 32, input_len})
    par = ex.parallel
    for net in ("block:16", "block_kv:16"):  # each layer's net at 16 on its devices
        for layer in range(layers):
            want = 1 if parallel == "pp" else 2
            assert len(par.runners(rt.prefill_net(net.split(":")[0], layer, 16), layer)) \
                == want, (net, layer)
    request = CompileRequest.make(mode="f32", chip=ex.chip, seq_length=SEQ,
                                  max_input_length=input_len, devices=2, parallel=parallel)
    config = read_checked_config(many.model_dir, request)
    costs = compile_costs(config, request, nets=list(ex.nets()))
    for n in (5, input_len, input_len + 5):
        ids = [3 + (i * 7) % 300 for i in range(n)]
        ran = _recording(rt)
        a, b = rt.prompt_logits(ids), ref.prompt_logits(ids)
        assert a.dtype == b.dtype, n
        if parallel == "pp":
            assert np.array_equal(a, b), n
        else:
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), n
        assert _prefill_nets(ran)[:2] == (["embedding:16", "block:16"] if n <= 16
                                          else ["embedding", "block"]), n
        rt.ex.run = type(rt.ex).run.__get__(rt.ex)  # type: ignore[method-assign]
        res = rt.generate(ids, 4, stop_on_eos=False)
        assert res.generated_ids == ref.generate(ids, 4, stop_on_eos=False).generated_ids
        est = estimate(costs, ex.chip, prompt_tokens=n, sampler=res.sampler)
        assert res.modelled_ttft_s == pytest.approx(est.ttft_s, rel=1e-9), n
        assert res.modelled_tokens_per_s == pytest.approx(est.tokens_per_s, rel=1e-9), n
