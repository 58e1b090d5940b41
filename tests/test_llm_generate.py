"""Greedy generation from compiled model files equals transformers `generate` (f32):
chunked prefill of a prompt longer than max_input_length, a second turn through block_kv,
and the edge paths (history beyond max_history, a chunk that runs past SEQ, a full cache)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from llm_fixtures import LONG_PROMPT, compiled, hf_generate

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.backend.runtime.runtime import PromptTooLongError, Runtime
from toptpu.dialects import tpu
from toptpu.dialects.naming import input_names

pytestmark = pytest.mark.slow  # compiles model files and generates against transformers


FAMILIES = ["qwen2", "qwen3", "llama2", "llama3"]
#: the second user turn (per family: one whose greedy continuation has >= 32 tokens)
SECOND = {"qwen2": " What is the capital of France?", "qwen3": " What is the capital of France?",
          "llama2": " One two three four five.", "llama3": " What is the capital of France?"}
N = 40


class _Spy:
    """Wraps an executor and records which nets run."""

    def __init__(self, ex: Executor) -> None:
        self.ex, self.calls = ex, list[str]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ex, name)

    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        self.calls.append(net)
        self.ex.run(net, bindings, layer)


@pytest.mark.parametrize("family,executor", [*((f, "machine") for f in FAMILIES),
                                             ("qwen2", "interpreter")])
def test_greedy_generation_equals_transformers(tmp_path_factory, family: str,
                                               executor: str) -> None:
    """On the reference machine (the command streams) and on the Tpu interpreter."""
    built = compiled(tmp_path_factory, family)
    rt = Runtime.open(built.model_file, executor)
    spy = _Spy(rt.ex)
    rt.ex = spy
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L  # three prefill chunks
    res = rt.generate(ids, N)
    assert len(res.generated_ids) >= 32
    assert res.generated_ids == hf_generate(built.model_dir, ids, N)
    # prefill: block for the first chunk, block_kv for the later ones, one run per layer
    n_layers = rt.num_layers
    assert spy.calls[:1] == ["embedding"]
    assert spy.calls.count("block") == n_layers and spy.calls.count("block_kv") == 2 * n_layers
    assert spy.calls.count("lm_head") == len(res.generated_ids)
    assert spy.calls.count("block_cache") == (len(res.generated_ids) - 1) * n_layers

    # the second turn continues the KV cache through block_kv
    spy.calls.clear()
    ids2 = rt.encode(SECOND[family], add_special_tokens=False)
    res2 = rt.generate(ids2, N, keep_history=True)
    assert res2.prefill_tokens == len(ids2) + 1  # the new ids and the pending last token
    assert spy.calls.count("block_kv") == n_layers and "block" not in spy.calls
    conversation = ids + res.generated_ids + ids2
    assert len(res2.generated_ids) >= 32
    assert res2.generated_ids == hf_generate(built.model_dir, conversation, N)


def test_history_nets_read_the_cache_in_place(tmp_path_factory) -> None:
    """In the compiled Tpu IR, block_kv and block_cache attend to their history inputs as
    attention history operands; no concat touches the caches (reload-free decode)."""
    f = LlmFile(compiled(tmp_path_factory, "qwen2").model_file)
    for net in ("block_kv", "block_cache"):
        module = f.net_module(net)
        fn = next(op for op in module.ops if op.name == "func.func")
        args = dict(zip(input_names(fn), fn.body.block.args, strict=True))
        (att,) = [op for op in module.walk() if isinstance(op, tpu.AttentionOp)]
        assert att.history_k is args["history_k"] and att.history_v is args["history_v"]
        assert not any(isinstance(op, tpu.ConcatOp) and any(
            v in (args["history_k"], args["history_v"]) for v in op.operands)
            for op in module.walk())
        cache = f.header["nets"][net]["inputs"][3]
        assert cache["name"] == "history_k"
    # decode reads the whole cache [1, SEQ, kvH, D]; its mask covers SEQ + 1 keys
    ins = {s["name"]: s["shape"] for s in f.header["nets"]["block_cache"]["inputs"]}
    assert ins["history_k"][1] == 160 and ins["attention_mask"] == [1, 1, 1, 161]
    f.close()


def test_edge_paths_equal_transformers(tmp_path_factory) -> None:
    """SEQ 64, L 16, Hh 56: a prefill chunk that runs past SEQ (scratch copy), history
    beyond max_history (the decode net feeds the prompt), a full KV cache, and a prompt
    that no longer fits."""
    built = compiled(tmp_path_factory, "qwen2", seq=64, input_len=16, history=56)
    rt = Runtime.open(built.model_file)
    ids = rt.encode(LONG_PROMPT)
    conversation = list(ids)
    res = rt.generate(ids, 12)
    assert res.generated_ids == hf_generate(built.model_dir, conversation, 12)
    conversation += res.generated_ids
    # turn 2 starts at 50: 50 + L > 64, block_kv writes through the scratch buffer
    turn = rt.encode(" One two", add_special_tokens=False)
    assert len(rt.tokens) == 50 and 50 + rt.L > rt.seq
    res = rt.generate(turn, 5, keep_history=True)
    conversation += turn
    assert res.generated_ids == hf_generate(built.model_dir, conversation, 5)
    conversation += res.generated_ids
    # turn 3 starts beyond max_history 56: fed by the decode net; runs until the cache is full
    turn = rt.encode(" three", add_special_tokens=False)
    assert len(rt.tokens) > rt.Hh
    res = rt.generate(turn, 40, keep_history=True)
    conversation += turn
    assert res.stop_reason == "kv_cache_full" and len(rt.tokens) == 64
    assert res.generated_ids == hf_generate(built.model_dir, conversation,
                                            len(res.generated_ids))
    with pytest.raises(PromptTooLongError, match="does not fit the KV cache.*seq_length 64"):
        rt.generate(turn, 4, keep_history=True)
    with pytest.raises(PromptTooLongError, match="65 tokens > seq_length 64"):
        rt.generate(list(np.arange(65) % 300), 4)
    # asked for: start over when it does not fit
    res = rt.generate(turn, 4, keep_history=True, reset_if_full=True)
    assert res.position == len(turn) + 4
