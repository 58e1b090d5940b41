"""Runtime pieces: host-side sampling, UTF-8-safe streaming, masks, executor bindings,
and a chat over the chat template that keeps the KV cache."""

from __future__ import annotations

import numpy as np
import pytest
from llm_fixtures import compiled, hf_generate

from toptpu.backend.contract import MASK_VALUE, decode_mask, prefill_mask
from toptpu.backend.runtime.interpreter_executor import ExecutorError, InterpreterExecutor
from toptpu.backend.runtime.runtime import (
    GenerationError,
    Runtime,
    SamplingConfig,
    Utf8Streamer,
    sample_token,
)


def test_sampling_filters_and_penalty() -> None:
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.9, -1.0, 0.5], np.float32)
    assert sample_token(logits, [], SamplingConfig(), rng) == 1  # greedy
    assert {sample_token(logits, [], SamplingConfig(temperature=5.0, top_k=1), rng)
            for _ in range(20)} == {1}
    assert {sample_token(logits, [], SamplingConfig(temperature=1.0, top_p=0.3), rng)
            for _ in range(20)} == {1}
    two = {sample_token(logits, [], SamplingConfig(temperature=1.0, top_k=2), rng)
           for _ in range(100)}
    assert two == {1, 2}
    # the penalty divides positive logits of recent tokens: 3.0 / 1.2 = 2.5 < 2.9
    assert sample_token(logits, [1], SamplingConfig(repetition_penalty=1.2), rng) == 2
    # ... only within the recent window
    assert sample_token(logits, [1, 4, 4], SamplingConfig(repetition_penalty=1.2,
                                                          penalty_window=2), rng) == 1
    # high temperature spreads the draws; a seed makes them reproducible
    cfg = SamplingConfig(temperature=50.0, seed=3)
    draws = [sample_token(logits, [], cfg, np.random.default_rng(3)) for _ in range(3)]
    assert len(set(draws)) == 1
    many = {sample_token(logits, [], cfg, rng) for _ in range(200)}
    assert many == {0, 1, 2, 3, 4}
    with pytest.raises(GenerationError, match="top_p"):
        SamplingConfig(top_p=0.0).validate()


def test_utf8_streaming_never_splits_a_character(tmp_path_factory) -> None:
    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file)
    text = "héllo 你好 🙂 ok"
    ids = rt.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several byte-level tokens
    streamer = Utf8Streamer(rt.decode)
    pieces = [streamer.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + streamer.flush() == text
    assert sum(1 for p in pieces if p == "") >= 3  # held back inside characters


def test_masks_are_additive_and_finite() -> None:
    m = prefill_mask(3, 5, start=2, history=4)[0, 0]
    assert m.shape == (5, 9)
    assert (m[:3, :2] == 0).all() and (m[:3, 2:4] == MASK_VALUE).all()
    assert (m[:3, 4:7] == np.where(np.tril(np.ones((3, 3))) > 0, 0, MASK_VALUE)).all()
    assert (m[3:] == MASK_VALUE).all() and (m[:, 7:] == MASK_VALUE).all()  # padding
    d = decode_mask(2, 6)[0, 0, 0]
    assert list(d == 0) == [True, True, False, False, False, False, True]
    with pytest.raises(ValueError, match="outside the KV cache"):
        decode_mask(6, 6)


@pytest.mark.parametrize("executor", ["interpreter", "machine"])
def test_both_executors_check_bindings_by_the_same_rules(tmp_path_factory,
                                                         executor: str) -> None:
    """The binding rules of `toptpu.backend.runtime.executor` are written once and hold for
    the interpreter and the machine alike: exactly the net's names, buffers of this executor,
    the spec's dtype and shape up to size-1 axes; host writes keep within their kind."""
    from toptpu.backend.runtime.machine_executor import MachineExecutor, MachineExecutorError

    path = compiled(tmp_path_factory, "qwen2").model_file
    ex, other, error = ((InterpreterExecutor(path), MachineExecutor(path), ExecutorError)
                        if executor == "interpreter" else
                        (MachineExecutor(path), InterpreterExecutor(path), MachineExecutorError))
    info = ex.nets()["block_cache"]
    bufs = {s.name: ex.alloc(s.shape, s.dtype) for s in (*info.inputs, *info.outputs)}
    with pytest.raises(error, match="missing \\['present_v'\\], unexpected \\[\\]"):
        ex.run("block_cache", {k: v for k, v in bufs.items() if k != "present_v"}, layer=0)
    with pytest.raises(error, match="missing \\[\\], unexpected \\['extra'\\]"):
        ex.run("block_cache", dict(bufs, extra=bufs["hidden"]), layer=0)
    foreign = other.alloc(info.inputs[0].shape, info.inputs[0].dtype)
    with pytest.raises(error, match=f"'{info.inputs[0].name}' of net 'block_cache' is bound to "
                       "a .*, not a buffer of this executor"):
        ex.run("block_cache", {**bufs, info.inputs[0].name: foreign}, layer=0)
    with pytest.raises(error, match="'present_k' of net 'block_cache' is float32"):
        ex.run("block_cache", dict(bufs, present_k=bufs["history_k"].slot(1, 0, 2)), layer=0)
    with pytest.raises(error, match="cannot write a \\[2, 64\\] array"):
        ex.write(bufs["hidden"], np.ones((2, 64), np.float32))
    with pytest.raises(error, match="cannot write float32 into a int32 buffer"):
        ex.write(bufs["position_ids"], np.ones((1, 1), np.float32))
    ex.write(bufs["hidden"], np.ones((64,), np.float64))  # size-1 axes and float kinds agree
    assert ex.read(bufs["hidden"]).dtype == np.float32


def test_executor_bindings_are_checked(tmp_path_factory) -> None:
    ex = InterpreterExecutor(compiled(tmp_path_factory, "qwen2").model_file)
    info = ex.nets()["block_cache"]
    bufs = {s.name: ex.alloc(s.shape, s.dtype) for s in (*info.inputs, *info.outputs)}
    with pytest.raises(ExecutorError, match="per layer: pass layer= in 0..1"):
        ex.run("block_cache", bufs)
    with pytest.raises(ExecutorError, match="missing \\['present_v'\\]"):
        ex.run("block_cache", {k: v for k, v in bufs.items() if k != "present_v"}, layer=0)
    bad = dict(bufs, present_k=bufs["history_k"].slot(1, 0, 2))
    with pytest.raises(ExecutorError, match="'present_k' of net 'block_cache' is float32"):
        ex.run("block_cache", bad, layer=0)
    with pytest.raises(ExecutorError, match="outside a buffer"):
        bufs["history_k"].slot(1, 159, 2)
    with pytest.raises(ExecutorError, match="no net 'vit'"):
        ex.run("vit", {})
    # the output bound to a cache slot lands in the cache, in place
    ex.write(bufs["hidden"], np.ones((1, 1, 64), np.float32))
    ex.write(bufs["attention_mask"], decode_mask(5, 160))
    cache = bufs["history_k"]
    ex.run("block_cache", dict(bufs, present_k=cache.slot(1, 5, 1)), layer=1)
    assert np.abs(ex.read(cache)[0, 5]).sum() > 0 and not ex.read(cache)[0, 6].any()


@pytest.mark.slow  # generates over two chat turns
def test_chat_keeps_the_cache_between_turns(tmp_path_factory) -> None:
    built = compiled(tmp_path_factory, "qwen2")
    rt = Runtime.open(built.model_file)
    rt.chat("Hello! How are you today?", max_new_tokens=12)
    n1 = rt.position
    second = rt.chat("What is the capital of France?", max_new_tokens=12)
    gen = second.generated_ids
    conversation = [*rt.tokens, rt.pending]
    assert rt.position == len(conversation) and conversation[-len(gen):] == gen
    # only the new turn was prefilled (plus the first reply's last token, not yet cached)
    assert rt.position == n1 + (second.prefill_tokens - 1) + len(gen)
    # the cache holds exactly the conversation: transformers continues it the same way
    assert gen == hf_generate(built.model_dir, conversation[:-len(gen)], 12)
    assert [m["role"] for m in rt.messages] == ["user", "assistant", "user", "assistant"]
    rt.reset()
    assert rt.position == 0 and rt.messages == []


def test_stopping_and_the_sampling_path(tmp_path_factory) -> None:
    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file)
    ids = rt.encode("Hello world! The tensor processor")
    ref = rt.generate(ids, 20, stop_on_eos=False).generated_ids
    # greedy through the logits net and the host sampler (top-1) equals the fused top-1 net
    assert rt.generate(ids, 20, SamplingConfig(temperature=1.0, top_k=1),
                       stop_on_eos=False).generated_ids == ref
    # a seeded sampling run is reproducible
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.3, seed=7)
    a = rt.generate(ids, 12, cfg, stop_on_eos=False).generated_ids
    assert rt.generate(ids, 12, cfg, stop_on_eos=False).generated_ids == a
    # EOS ids of the generation config stop after the EOS token
    rt.eos_ids = {ref[6]}
    res = rt.generate(ids, 20)
    first = ref.index(ref[6])
    assert res.stop_reason == "eos" and res.generated_ids == ref[:first + 1]
    rt.eos_ids = set()
    # stop strings stop at the token that completes one
    text = rt.decode(ref)
    stop = text[len(rt.decode(ref[:8])):][:3]
    assert stop
    rt.stop_strings = [stop]
    res = rt.generate(ids, 20)
    assert res.stop_reason == "stop_string" and stop in res.text
    assert stop not in rt.decode(res.generated_ids[:-1])


def test_chat_command(tmp_path_factory, monkeypatch, capsys) -> None:
    from toptpu.cli import main

    lines = iter(["Hello!", "/reset", "What is the capital of France?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    path = compiled(tmp_path_factory, "qwen2").model_file
    assert main(["chat", path, "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert err.count("6 tokens, stop: max_new_tokens") == 2 and "[conversation reset]" in err
    assert "tokens in the cache" in err and "tok/s modelled" in err  # on the machine


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_a_temperature_that_overflows_picks_the_top_token_on_the_chip_as_on_the_host(
        tmp_path_factory, penalty: float) -> None:
    """logits / 1e-40 overflow f32: the chip's sample_head gives candidates tied at +inf in
    no order and NaN probabilities; the token must be the top penalized logit, as the host
    sampler's, and no floating-point warning reaches the user."""
    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file)
    ids = rt.encode("Hello world! The tensor processor")
    tokens = {}
    for sampler in ("chip", "host"):
        cfg = SamplingConfig(temperature=1e-40, top_k=5, repetition_penalty=penalty, seed=3,
                             sampler=sampler)
        with np.errstate(over="raise", invalid="raise", divide="raise"):  # numpy's warnings
            tokens[sampler] = rt.generate(ids, 6, cfg, stop_on_eos=False).generated_ids
    greedy = SamplingConfig(temperature=1.0, top_k=1, repetition_penalty=penalty,
                            sampler="host")
    assert tokens["chip"] == tokens["host"]
    assert tokens["host"] == rt.generate(ids, 6, greedy, stop_on_eos=False).generated_ids
