"""The runtime in parts: the abstract executor every executor derives from, and the
conversation state a server keeps several of (`toptpu.backend.runtime.conversation`): a
prefix kept, truncated to and continued gives what a cold run gives."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from llm_fixtures import LONG_PROMPT, compiled

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.conversation import Conversation
from toptpu.backend.runtime.device_executor import DeviceGroupExecutor
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Executor
from toptpu.backend.runtime.interpreter_executor import ExecutorError, InterpreterExecutor
from toptpu.backend.runtime.machine_executor import MachineExecutor, MachineExecutorError
from toptpu.backend.runtime.runtime import Runtime
from toptpu.families.base import PromptLayout

N = 12


# =========================================================================== the executors


def _satisfies_the_interface(ex: Executor, cls: type[Executor]) -> None:
    """`ex` is a `cls`, an `Executor` with no abstract method left, whose methods take the
    interface's parameters; it refuses a buffer of another executor."""
    assert isinstance(ex, cls) and isinstance(ex, Executor)
    assert not cls.__abstractmethods__
    for name in ("nets", "alloc", "write", "read", "run", "modelled_seconds",
                 "modelled_costs", "prepare", "use_weight_cache", "start_recording"):
        ours = inspect.signature(getattr(Executor, name))
        theirs = inspect.signature(getattr(cls, name))
        assert list(theirs.parameters) == list(ours.parameters), (cls.__name__, name)
    spec = next(iter(ex.nets()["lm_head"].outputs))
    buf = ex.alloc(spec.shape, spec.dtype)
    ex.write(buf, np.ones(spec.shape, spec.dtype))
    assert np.array_equal(ex.read(buf), np.ones(spec.shape, spec.dtype))


def test_the_interpreter_executor_is_an_executor(tmp_path_factory) -> None:
    path = compiled(tmp_path_factory, "qwen2").model_file
    ex = InterpreterExecutor(path)
    _satisfies_the_interface(ex, InterpreterExecutor)
    assert ex.modelled_costs() is None and ex.modelled_seconds() == 0.0  # the defaults
    with pytest.raises(GenerationError, match="a trace needs the machine executor"):
        ex.start_recording()
    other = MachineExecutor(path)
    with pytest.raises(ExecutorError, match="not a buffer of this executor"):
        ex.read(other.alloc((1, 4), "float32"))


def test_the_machine_executor_is_an_executor(tmp_path_factory) -> None:
    path = compiled(tmp_path_factory, "qwen2").model_file
    ex = MachineExecutor(path)
    _satisfies_the_interface(ex, MachineExecutor)
    assert ex.start_recording() is ex.recorder is not None
    with pytest.raises(MachineExecutorError, match="not a buffer of this executor"):
        ex.write(InterpreterExecutor(path).alloc((1, 4), "float32"), np.zeros((1, 4)))


@pytest.mark.slow  # compiles a model file spread over two devices
def test_the_device_group_executor_is_an_executor(tmp_path_factory) -> None:
    path = compiled(tmp_path_factory, "qwen2", devices=2, parallel="tp").model_file
    ex = DeviceGroupExecutor(LlmFile(path))
    _satisfies_the_interface(ex, DeviceGroupExecutor)
    with pytest.raises(MachineExecutorError, match="not a buffer of this executor"):
        ex.read(MachineExecutor(compiled(tmp_path_factory, "qwen2").model_file)
                .alloc((1, 4), "float32"))


# =========================================================================== conversations


def _cold(rt: Runtime, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """The logits after `ids` and the greedy tokens, in a fresh conversation (left reset)."""
    logits = rt.prompt_logits(ids)
    tokens = rt.generate(ids, N).generated_ids
    rt.reset()
    return logits, tokens


def test_a_truncated_prefix_continues_as_a_cold_run(tmp_path_factory) -> None:
    """A conversation that fed a prompt's prefix and then something else keeps the prefix
    (`reusable_prefix`, `truncate`) and continues with the rest: the logits are the cold
    run's bit for bit when the cut falls on a chunk boundary (the same chunks run), and
    the greedy tokens are the cold run's at any cut."""
    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file, "interpreter")
    ids = rt.encode(LONG_PROMPT)
    L = rt.shapes.L
    assert len(ids) > 2 * L
    want_logits, want_tokens = _cold(rt, ids)
    conv = rt.conversation
    other = rt.encode(" Something else entirely, said at length before the cut.",
                      add_special_tokens=False)
    for cut in (L, L + 5, 3):
        rt.reset()
        conv.feed(ids[:cut] + other)
        assert conv.reusable_prefix(ids) == cut
        conv.truncate(cut)
        assert conv.tokens == ids[:cut] and conv.pending is None
        logits = rt.sampler.logits_of(conv.feed(ids[cut:]))
        if cut == L:
            assert np.array_equal(logits, want_logits)
        else:
            np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-4)
        conv.truncate(cut)
        res = rt.generate(ids[cut:], N, keep_history=True)
        assert res.prefill_tokens == len(ids) - cut
        assert res.generated_ids == want_tokens, cut


def test_a_conversation_continues_a_longer_prompt_and_forks(tmp_path_factory) -> None:
    """A conversation whose tokens are a prefix of a longer prompt keeps them all; a fork
    holds the same tokens in caches of its own (the original is untouched by it); the
    pending token of a generation is part of the conversation but not of its caches, and
    truncation refuses what it cannot keep."""
    rt = Runtime.open(compiled(tmp_path_factory, "qwen2").model_file, "interpreter")
    ids = rt.encode(LONG_PROMPT)
    want_logits, want_tokens = _cold(rt, ids)
    cut = 2 * rt.shapes.L  # the cold run's chunks
    conv = rt.conversation
    conv.feed(ids[:cut])
    assert conv.reusable_prefix(ids) == cut
    assert conv.reusable_prefix(ids[:cut]) == cut - 1  # the last one is fed: its logits
    twin = conv.fork()
    assert isinstance(twin, Conversation) and twin.tokens == conv.tokens
    assert twin.cache_k[0] is not conv.cache_k[0]
    for a, b in ((twin.cache_k[0], conv.cache_k[0]), (twin.cache_v[1], conv.cache_v[1])):
        np.testing.assert_array_equal(rt.ex.read(a.slot(1, 0, cut)), rt.ex.read(b.slot(1, 0, cut)))
    twin.feed(rt.encode(" and now something else", add_special_tokens=False))
    assert np.array_equal(rt.sampler.logits_of(conv.feed(ids[cut:])), want_logits)
    with pytest.raises(GenerationError, match="cannot truncate a conversation"):
        conv.truncate(len(conv.tokens) + 1)
    res = rt.generate(ids, N)
    assert res.generated_ids == want_tokens
    assert conv.sequence == ids + want_tokens and conv.position == len(ids) + N
    assert conv.tokens == ids + want_tokens[:-1] and conv.pending == want_tokens[-1]
    conv.truncate(len(ids))
    assert conv.sequence == ids and conv.pending is None


@pytest.mark.slow  # compiles the hybrid model
def test_a_hybrid_conversation_truncates_to_a_checkpoint(tmp_path_factory) -> None:
    """Qwen3.5's linear-attention states hold every token: its conversation truncates only
    to where it stands, to the start, or to a checkpoint it took; there it continues as a
    cold run does."""
    rt = Runtime.open(compiled(tmp_path_factory, "qwen3_5", layers=4).model_file,
                      "interpreter")
    ids = rt.encode(LONG_PROMPT)
    want_logits, want_tokens = _cold(rt, ids)
    L = rt.shapes.L
    conv = rt.conversation
    conv.feed(ids[:L])
    conv.checkpoint()
    conv.feed(rt.encode(" Something else.", add_special_tokens=False))
    assert not conv.can_truncate(L - 1)
    with pytest.raises(GenerationError, match="linear-attention states"):
        conv.truncate(L - 1)
    assert conv.reusable_prefix(ids) == L
    conv.truncate(L)
    assert np.array_equal(rt.sampler.logits_of(conv.feed(ids[L:])), want_logits)
    conv.truncate(L)
    assert rt.generate(ids[L:], N, keep_history=True).generated_ids == want_tokens


def test_feeding_a_multi_axis_model_needs_its_positions() -> None:
    """A prompt layout carries what the feed needs; without positions a model whose
    rotary has a position per axis refuses the feed (checked before any net runs)."""

    class Shapes:
        seq, position_axes, linear = 8, 3, [False]

    class Engine:
        nets = Shapes()

    conv = Conversation.__new__(Conversation)
    conv.engine, conv.tokens = Engine(), []  # type: ignore[assignment]
    with pytest.raises(GenerationError, match="needs its positions"):
        conv.feed([1, 2], PromptLayout())
