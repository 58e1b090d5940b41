"""The serving engine under `toptpu serve` without HTTP, and the batch nets it decodes with:
`compile --batch B` nets that compute what B single decode steps compute, a batch step
charged as the step accounting models it, the kept conversations bounded and reused
(Qwen3.5's linear-attention states included), the modelled and host time of a kept
prompt."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from llm_fixtures import LONG_PROMPT, compiled

from toptpu.backend.contract import ContractError, NetName, StaticShapes, batch_net_io
from toptpu.backend.formats.header_schema import HeaderError
from toptpu.backend.formats.llm_file import LlmHeader
from toptpu.backend.runtime.batch import BatchDecoder, BatchRow
from toptpu.backend.runtime.conversation import Conversation
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.sampler import SamplingConfig
from toptpu.backend.runtime.serving import (
    Failed,
    Finished,
    Job,
    Prompt,
    ServeError,
    ServingEngine,
    Started,
    Text,
)

BATCH = 4
PROMPTS = ["Hello world! The tensor", "Each layer is compiled once and", "The chip runs"]


# =========================================================================== the nets


def test_batch_net_names() -> None:
    name = NetName.parse("block_cache.b4@3")
    assert (name.base, name.layer, name.length, name.batch) == ("block_cache", 3, 0, 4)
    assert str(name) == "block_cache.b4@3" and str(name.layer_net) == "block_cache@3"
    assert str(NetName.parse("lm_head").at_batch(8)) == "lm_head.b8"
    for bad in ("block.b4", "lm_head.b1", "lm_head.b04", "embedding:16.b2", "block_cache.b"):
        with pytest.raises(ContractError):
            NetName.parse(bad)
    io = batch_net_io(StaticShapes.make(32, 8), _Widths(), "float32", 2)
    ins, outs = io["block_cache.b2"]
    assert [s.name for s in ins] == ["hidden", "position_ids", "attention_mask", "history_k.0",
                                     "history_v.0", "history_k.1", "history_v.1"]
    assert [s.shape for s in ins[:3]] == [(1, 2, 16), (1, 2), (1, 1, 2, 33)]
    assert [(s.name, s.shape) for s in outs[1:3]] == [("present_k.0", (1, 1, 2, 4)),
                                                     ("present_v.0", (1, 1, 2, 4))]
    assert io["sample_head.b2"][0][1].shape == (2, 32)  # each row its own recent ids


class _Widths:
    hidden_size, num_kv_heads, head_dim, vocab_size = 16, 2, 4, 100


def test_the_batch_block_computes_each_rows_decode_step() -> None:
    """`BatchBlock` (block_cache.bB's module): row b is the decode step of conversation b
    over its own cache, as `BlockWithHistory` (block_cache's module) computes it."""
    from toptpu.backend.contract import decode_mask
    from toptpu.frontends.llm import (
        BatchBlock,
        BlockWithHistory,
        LlmArch,
        model_apply_rotary,
    )
    from toptpu.frontends.tiny_models import tiny_model

    model = tiny_model("qwen2")
    arch = LlmArch.of(model)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    one = BlockWithHistory(layer, rotary, model_apply_rotary(model), arch).eval()
    many = BatchBlock(layer, rotary, model_apply_rotary(model), arch).eval()
    g = torch.Generator().manual_seed(0)
    seq, B = 24, 3
    hidden = torch.randn(1, B, arch.hidden_size, generator=g)
    positions = [5, 0, 17]
    caches = [torch.randn(1, seq, arch.num_kv_heads, arch.head_dim, generator=g)
              for _ in range(2 * B)]
    masks = [torch.from_numpy(decode_mask(p, seq)) for p in positions]
    with torch.no_grad():
        out = many(hidden, torch.tensor([positions], dtype=torch.int32), torch.cat(masks, 2),
                   *caches)
        for b, p in enumerate(positions):
            h, k, v = one(hidden[:, b:b + 1], torch.tensor([[p]], dtype=torch.int32),
                          masks[b], caches[2 * b], caches[2 * b + 1])
            torch.testing.assert_close(out[0][:, b:b + 1], h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[1 + 2 * b], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[2 + 2 * b], v, rtol=1e-5, atol=1e-5)


# =========================================================================== a compiled file


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", "f32", batch=BATCH).model_file


@pytest.fixture(scope="module")
def rt(model_file: str) -> Runtime:
    return Runtime.open(model_file)


@pytest.mark.slow
def test_the_header_names_the_batch_nets(model_file: str) -> None:
    """A file with batch nets has all of them, at one batch, each with the contract's IO;
    the checks refuse one missing or at another batch."""
    from toptpu.backend.formats.llm_file import LlmFile

    header = LlmFile(model_file).meta
    assert header.batch == BATCH
    data = header.to_json()
    entry = data["nets"].pop("lm_head.b4")
    with pytest.raises(HeaderError, match="lacks the nets"):
        LlmHeader.from_json(data)
    data["nets"]["lm_head.b4"] = entry
    data["nets"]["lm_head.b2"] = entry
    with pytest.raises(HeaderError, match="at batch 2"):
        LlmHeader.from_json(data)


@pytest.mark.slow
def test_a_batch_step_decodes_as_single_steps(rt: Runtime) -> None:
    """Three conversations in a batch of four (one row left over): greedy, sampled on the
    chip and on the host, each row gets the tokens its conversation gets alone."""
    configs = [(SamplingConfig(), "greedy"),
               (SamplingConfig(temperature=0.8, top_k=5, seed=3), "sample"),
               (SamplingConfig(temperature=0.9, top_p=0.9, seed=4), "host")]
    n = 8
    want = []
    for text, (cfg, kind) in zip(PROMPTS, configs, strict=True):
        res = rt.generate(rt.encode(text), n, cfg)
        assert res.sampler == kind
        want.append(res.generated_ids)
    batch = BatchDecoder(rt.engine)
    convs = [Conversation(rt.engine) for _ in PROMPTS]
    rngs = [np.random.default_rng(cfg.seed) for cfg, _ in configs]
    got, recent = [], []
    for conv, text, (cfg, kind), rng in zip(convs, PROMPTS, configs, rngs, strict=True):
        hidden = conv.feed(rt.encode(text))
        recent.append(list(conv.tokens))
        if kind == "sample":
            rt.sampler.setup(cfg)
        got.append([rt.sampler.next_token(hidden, cfg, kind, rng, recent[-1])])
    for _ in range(n - 1):
        for r, g in zip(recent, got, strict=True):
            r.append(g[-1])
        tokens = batch.step([BatchRow(c, g[-1], cfg, kind, rng, r) for c, g, (cfg, kind), rng, r
                             in zip(convs, got, configs, rngs, recent, strict=True)])
        for g, t in zip(got, tokens, strict=True):
            g.append(t)
    assert got == want


@pytest.mark.slow
def test_a_batch_step_costs_what_the_step_model_charges(model_file: str, rt: Runtime) -> None:
    """The ledger's charge of one batch step is `StepModel.batch_step` over the profiled
    nets (what `toptpu profile` and `estimate` report), for each sampler."""
    from toptpu.profile_cli import profile_model, step_model

    steps = step_model(profile_model(model_file)[0])
    assert steps.batch == BATCH
    batch = BatchDecoder(rt.engine)
    convs = [Conversation(rt.engine) for _ in range(2)]
    for c in convs:
        c.feed(rt.encode("Hello"))
    for kind, cfg in (("greedy", SamplingConfig()),
                      ("sample", SamplingConfig(temperature=0.7, top_k=4)),
                      ("host", SamplingConfig(temperature=0.7))):
        c0 = rt.ex.modelled_costs()
        batch.step([BatchRow(c, 5, cfg, kind, np.random.default_rng(0), [5]) for c in convs])
        spent = rt.ex.modelled_costs() - c0
        model = steps.batch_step(kind)
        assert spent.total_s == pytest.approx(model.total_s, rel=1e-9)
        assert (spent.launches, spent.transfers) == (model.launches, model.transfers)
    # launch- and host-bound tiny nets: a step of B costs about one step of one
    assert steps.batch_step("greedy").total_s < 1.1 * steps.per_token("greedy").total_s


@pytest.mark.slow
def test_estimate_of_the_batch_nets_is_what_the_file_charges(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """`toptpu estimate --batch B` from the config alone: the batch step's modelled time is
    what the compiled file's batch step costs (`profile`'s step model); tok/s per user is
    one over it, in total B over it."""
    import json

    from toptpu.cli import main
    from toptpu.profile_cli import profile_model, step_model

    built = compiled(tmp_path_factory, "qwen2", "f32", batch=BATCH)
    steps = step_model(profile_model(built.model_file)[0])
    assert main(["estimate", built.model_dir, "-q", "f32", "--seq-length", "160",
                 "--max-input-length", "16", "--batch", str(BATCH), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["batch"]
    step = steps.batch_step("greedy").total_s
    assert out["batch"] == BATCH
    assert out["step"]["total_s"] == pytest.approx(step, rel=1e-9)
    assert out["tokens_per_s_per_user"] == pytest.approx(1 / step, rel=1e-9)
    assert out["tokens_per_s_total"] == pytest.approx(BATCH / step, rel=1e-9)
    assert main(["estimate", built.model_dir, "-q", "f32", "--seq-length", "160",
                 "--max-input-length", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] is None


# =========================================================================== the engine


class Collector:
    """A job's events, gathered on the engine thread."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.done = threading.Event()

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    def result(self) -> Any:
        assert self.done.wait(120)
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Text))


def serve(engine: ServingEngine, ids: list[int], n: int, **kw: Any) -> tuple[Any, Collector]:
    got = Collector()
    engine.submit(Job(got, Prompt(list(ids)), max_tokens=n, **kw))
    return got.result(), got


@pytest.mark.slow
def test_the_kept_conversations_are_bounded_and_reused(rt: Runtime) -> None:
    """At most `max_conversations` are held; the least recently used idle one is reset for
    a prompt that shares nothing; a repeated prompt keeps all but its last token and gives
    the tokens of a cold run, for less modelled time to first token."""
    engine = ServingEngine(rt, slots=1, max_queue=4, max_conversations=2)
    engine.start()
    try:
        prompts = [rt.encode(t) for t in (LONG_PROMPT, *PROMPTS[1:], "Zebras cross")]
        cold = [rt.generate(p, 6).generated_ids for p in prompts]
        first, _ = serve(engine, prompts[0], 6)
        assert (first.cached_tokens, first.token_ids) == (0, cold[0])
        again, _ = serve(engine, prompts[0], 6)
        assert (again.cached_tokens, again.token_ids) == (len(prompts[0]) - 1, cold[0])
        assert again.stats["modelled_ttft_s"] < first.stats["modelled_ttft_s"]
        assert again.stats["prefilled_tokens"] == 1
        for p, want in zip(prompts[1:], cold[1:], strict=True):
            res, got = serve(engine, p, 6)
            assert res.token_ids == want and isinstance(got.events[0], Started)
        m = engine.metrics()
        assert m["conversations"]["held"] == 2 and m["conversations"]["evicted"] >= 2
        assert m["cached_tokens"] == len(prompts[0]) - 1
        # the first prompt's conversation was dropped: it starts cold again
        res, _ = serve(engine, prompts[0], 6)
        assert (res.cached_tokens, res.token_ids) == (0, cold[0])
        with pytest.raises(ServeError, match="max-queue"):
            small = ServingEngine(rt, slots=1, max_queue=0, max_conversations=1)
            small.submit(Job(Collector(), Prompt(prompts[0]), max_tokens=1))
    finally:
        engine.shutdown(0)
        engine.join(30)


@pytest.mark.slow
def test_a_branch_inside_a_kept_prompt_keeps_both(rt: Runtime) -> None:
    """Two prompts sharing a long start (a system prompt, then other questions): the second
    copies the first's shared caches instead of cutting them, so the first's chat can still
    continue from its whole prompt; every answer is a cold run's."""
    import os

    engine = ServingEngine(rt, slots=1, max_queue=4, max_conversations=3)
    engine.start()
    try:
        system = rt.encode(LONG_PROMPT)
        a = system + rt.encode(" The first question")
        b = system + rt.encode(" Another question entirely")
        shared = len(os.path.commonprefix([a, b]))
        assert len(system) - 2 <= shared < len(a) - 1
        first, _ = serve(engine, a, 4)
        other, _ = serve(engine, b, 4)
        assert other.cached_tokens == shared
        assert other.token_ids == list(rt.generate(b, 4).generated_ids)
        turn = a + first.token_ids + rt.encode(" And then?")
        nxt, _ = serve(engine, turn, 4)
        assert nxt.cached_tokens >= len(a)
        assert nxt.token_ids == list(rt.generate(turn, 4).generated_ids)
        m = engine.metrics()["conversations"]
        assert (m["copied"], m["held"]) == (1, 2)
    finally:
        engine.shutdown(0)
        engine.join(30)


@pytest.mark.slow
def test_a_hybrid_models_chat_continues_from_its_states(tmp_path_factory) -> None:
    """Qwen3.5: a prompt that continues an earlier request's conversation (its prompt and
    its reply) starts from the states where that conversation stands; the tokens are a
    cold run's."""
    rt = Runtime.open(compiled(tmp_path_factory, "qwen3_5", layers=4).model_file)
    engine = ServingEngine(rt, slots=1, max_conversations=2)
    engine.start()
    try:
        ids = rt.encode(LONG_PROMPT)
        first, _ = serve(engine, ids, 5)
        follow = ids + first.token_ids + rt.encode(" And then?", add_special_tokens=False)
        res, _ = serve(engine, follow, 5)
        assert res.cached_tokens == len(ids) + len(first.token_ids) - 1
        assert res.token_ids == rt.generate(follow, 5).generated_ids
    finally:
        engine.shutdown(0)
        engine.join(30)


@pytest.mark.slow
def test_stop_sequences_and_a_failed_prompt(rt: Runtime) -> None:
    engine = ServingEngine(rt, slots=2, max_conversations=2, batch=BatchDecoder(rt.engine))
    engine.start()
    try:
        ids = rt.encode(PROMPTS[0])
        full, got = serve(engine, ids, 12)
        text = got.text
        assert full.finish_reason == "length" and len(full.token_ids) == 12
        stop = next((text[i:i + 2] for i in range(1, len(text) - 2)
                     if "\ufffd" not in text[i:i + 2]), None)
        if stop is not None:
            res, cut = serve(engine, ids, 12, stop=(stop,))
            assert res.finish_reason == "stop" and cut.text == text[:text.index(stop)]
        res, _ = serve(engine, list(range(rt.seq + 1)), 1)
        assert isinstance(res, Failed) and res.status == 400
        assert f"longer than this model's sequence of {rt.seq} tokens" in res.message
        assert serve(engine, ids, 12)[0].token_ids == full.token_ids  # still serving
    finally:
        engine.shutdown(0)
        engine.join(30)
