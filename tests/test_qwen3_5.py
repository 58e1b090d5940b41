"""Qwen3.5 hybrid models (three Gated DeltaNet linear-attention layers to one gated
full-attention layer) in all three stages against transformers: the block wrappers compute
what the model's own layers compute, greedy generation equals `generate` (a prompt longer
than the prefill chunk, so block_kv carries the state; a second turn), the machine equals
the interpreter bit for bit, a padded chunk leaves exactly the state of its real tokens, and
each state is updated in place."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from llm_fixtures import LONG_PROMPT, compiled, hf_generate, shared_dir

from toptpu.backend.contract import (
    CONV_STATE,
    LINEAR_ATTENTION,
    PRESENT_CONV_STATE,
    PRESENT_RECURRENT_STATE,
    RECURRENT_STATE,
    StaticShapes,
)
from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.runtime import Runtime
from toptpu.frontends.llm import check_block_matches_model, split_model
from toptpu.frontends.tiny_models import qwen3_5_small_config, tiny_model

pytestmark = pytest.mark.slow  # compiles model files and generates against transformers

N = 40


def _small_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3.5's real small shapes (hidden 1024, head_dim 256, 16+16 linear heads of 128) at
    four layers, saved once per session."""
    from filelock import FileLock
    from transformers import GenerationConfig

    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import build_tokenizer

    path = os.path.join(shared_dir(tmp_path_factory), "qwen3_5-small")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            model = tiny_model(config=qwen3_5_small_config())
            tok = build_tokenizer(model.config.vocab_size)
            model.generation_config = GenerationConfig(
                eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>")],
                pad_token_id=tok.pad_token_id, do_sample=False)
            with quiet_transformers():
                model.save_pretrained(path)
                tok.save_pretrained(path)
            open(os.path.join(path, "done"), "w").close()
    return path


def test_block_wrappers_compute_the_models_layers() -> None:
    """At the real small shapes: layer 0 (linear attention) and layer 3 (gated full
    attention with partial rotary) wrapped as `block` match the model's decoder layers."""
    model = tiny_model(config=qwen3_5_small_config())
    shapes = StaticShapes.make(64, 16)
    for layer in (0, 3):
        block = next(s for s in split_model(model, shapes, layer=layer) if s.name == "block")
        check_block_matches_model(model, block, layer_index=layer)


@pytest.mark.parametrize("executor", ["machine", "interpreter"])
def test_greedy_generation_equals_transformers(tmp_path_factory, executor: str) -> None:
    built = compiled(tmp_path_factory, "qwen3_5", layers=4)
    rt = Runtime.open(built.model_file, executor)
    assert rt.linear == [True, True, True, False]
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L  # three chunks: block, then block_kv carrying the state
    res = rt.generate(ids, N)
    assert len(res.generated_ids) >= 32
    assert res.generated_ids == hf_generate(built.model_dir, ids, N)
    ids2 = rt.encode(" What is the capital of France?", add_special_tokens=False)
    res2 = rt.generate(ids2, N, keep_history=True)
    conversation = ids + res.generated_ids + ids2
    assert len(res2.generated_ids) >= 32
    assert res2.generated_ids == hf_generate(built.model_dir, conversation, N)
    # /reset: a new conversation starts from a zero state
    rt.reset()
    assert rt.generate(ids, N).generated_ids == res.generated_ids


def test_real_small_shapes_equal_transformers(tmp_path_factory) -> None:
    """hidden 1024, head_dim 256, 8/2 heads, 16 key and 16 value linear heads of 128: 32
    greedy tokens after a prompt of three chunks, then 32 more in a second turn, equal
    transformers' generate on the whole conversation (machine, f32)."""
    from toptpu.compiler import compile as compile_model

    model_dir = _small_dir(tmp_path_factory)
    path = os.path.join(shared_dir(tmp_path_factory), "qwen3_5-small-f32-s160.toptpu")
    from filelock import FileLock
    with FileLock(path + ".lock"):
        if not os.path.exists(path):  # room for both turns: SEQ 160
            compile_model(model_dir, path, mode="f32", seq_length=160, max_input_length=16,
                          progress=None)
    rt = Runtime.open(path)
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L  # block, then block_kv on the carried state
    res = rt.generate(ids, 32)
    assert len(res.generated_ids) == 32
    assert res.generated_ids == hf_generate(model_dir, ids, 32)
    # a second turn on the state (and KV) the first one left
    ids2 = rt.encode(" What is the capital of France?", add_special_tokens=False)
    res2 = rt.generate(ids2, 32, keep_history=True)
    assert len(res2.generated_ids) == 32
    assert res2.generated_ids == hf_generate(model_dir, ids + res.generated_ids + ids2, 32)


def test_machine_equals_interpreter_bit_for_bit(tmp_path_factory) -> None:
    built = compiled(tmp_path_factory, "qwen3_5", layers=4)
    machine = Runtime.open(built.model_file, "machine")
    interp = Runtime.open(built.model_file, "interpreter")
    ids = machine.encode(LONG_PROMPT)
    a, b = machine.prompt_logits(ids), interp.prompt_logits(ids)
    assert a.dtype == b.dtype and np.array_equal(a, b)
    for layer in range(3):
        for name in (CONV_STATE, RECURRENT_STATE):
            sa = machine.ex.read(machine.states[layer][name])
            sb = interp.ex.read(interp.states[layer][name])
            assert np.array_equal(sa, sb), (layer, name)


def _hf_states(model_dir: str, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    from llm_fixtures import hf_model

    with torch.no_grad():
        out = hf_model(model_dir)(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    # transformers keeps the last K conv inputs [C, K] (the first one no longer matters)
    return [(cache.layers[i].conv_states[0][0].numpy(),
             cache.layers[i].recurrent_states[0][0].numpy()) for i in range(3)]


def test_padded_chunk_leaves_the_state_of_its_real_tokens(tmp_path_factory) -> None:
    """A chunk of n real tokens padded to L leaves the state bit-identical whatever the
    padding holds, and it is the state transformers' cache holds after those n tokens (the
    conv state: their last K-1 conv inputs)."""
    built = compiled(tmp_path_factory, "qwen3_5", layers=4)
    rt = Runtime.open(built.model_file)
    ids = rt.encode("Hello world! How are you")
    assert len(ids) < rt.L
    states = []
    for pad in (rt.pad_id, 7):
        rt.reset()
        rt.pad_id = pad
        rt.conversation.feed(ids)
        states.append([[rt.ex.read(rt.states[i][n]).copy() for n in (CONV_STATE,
                                                                     RECURRENT_STATE)]
                       for i in range(3)])
    for (c1, r1), (c2, r2) in zip(*states, strict=True):
        assert np.array_equal(c1, c2) and np.array_equal(r1, r2)
    for (conv, rec), (hconv, hrec) in zip(states[0], _hf_states(built.model_dir, ids),
                                          strict=True):
        # ours is sequence-major [1, K-1, C]; transformers keeps [C, K-1]
        np.testing.assert_allclose(conv[0].T, hconv[:, -conv.shape[1]:], rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(rec[0], hrec, rtol=1e-4, atol=1e-5)


def test_states_are_net_io_updated_in_place(tmp_path_factory) -> None:
    """The header lists each layer's kind; linear-attention layers run nets whose IO is the
    state (recurrent state float32), and the runtime binds each state's input and output to
    one buffer."""
    built = compiled(tmp_path_factory, "qwen3_5", layers=4)
    f = LlmFile(built.model_file)
    h = f.header
    assert h["model"]["layer_types"] == [LINEAR_ATTENTION] * 3 + ["full_attention"]
    assert h["layer_nets"]["block_cache"] == ["block_cache"] * 3 + ["block_cache@3"]
    cache = h["nets"]["block_cache"]
    ins = {s["name"]: s for s in cache["inputs"]}
    outs = {s["name"]: s for s in cache["outputs"]}
    assert ins[RECURRENT_STATE]["dtype"] == outs[PRESENT_RECURRENT_STATE]["dtype"] == "float32"
    assert ins[RECURRENT_STATE]["shape"] == [1, 4, 16, 16]
    assert ins[CONV_STATE]["shape"] == outs[PRESENT_CONV_STATE]["shape"] == [1, 3, 2 * 32 + 64]
    assert "history_k" in {s["name"] for s in h["nets"]["block_cache@3"]["inputs"]}
    f.close()
    rt = Runtime.open(built.model_file)
    bound = rt.conversation.state_bindings(0, True)
    assert bound[CONV_STATE] is bound[PRESENT_CONV_STATE]
    assert bound[RECURRENT_STATE] is bound[PRESENT_RECURRENT_STATE]
    assert rt.cache_k[0] is None and rt.cache_k[3] is not None  # no KV cache for linear layers


@pytest.mark.parametrize("edit,named", [
    (lambda h: h["model"].update(layer_types=h["model"]["layer_types"][:-1]),
     "model.layer_types"),
    (lambda h: h["model"].update(layer_types=["linear_attention"] * 4), "model.layer_types"),
    (lambda h: h["model"]["layer_types"].__setitem__(0, "sliding"), "model.layer_types[0]"),
    (lambda h: h["model"].update(linear=None), "model.linear"),
    (lambda h: h["model"]["linear"].update(num_k_heads=3), "model.linear.num_k_heads"),
    (lambda h: h["model"]["linear"].update(conv_kernel=1), "model.linear.conv_kernel"),
    (lambda h: h["layer_nets"]["block"].__setitem__(0, "block@3"), "layer_nets.block[0]"),
    (lambda h: h["layer_nets"]["block"].__setitem__(3, "block"), "layer_nets.block[3]"),
    # a linear-attention net whose IO is not its kind's contract
    (lambda h: h["nets"]["block_cache"]["inputs"][2].update(dtype="float16"),
     "nets.block_cache.inputs[2]"),
])
def test_a_header_whose_layer_kinds_disagree_is_refused(tmp_path_factory, edit, named) -> None:
    import copy

    from toptpu.backend.formats.header_schema import HeaderError
    from toptpu.backend.formats.llm_file import LlmHeader

    f = LlmFile(compiled(tmp_path_factory, "qwen3_5", layers=4).model_file)
    header = copy.deepcopy(f.header)
    f.close()
    LlmHeader.from_json(copy.deepcopy(header))  # as compiled: accepted
    edit(header)
    with pytest.raises(HeaderError) as e:
        LlmHeader.from_json(header)
    assert named in str(e.value)


def test_a_net_that_copies_a_state_is_refused() -> None:
    """check_state_in_place: a new state that is a copy of the op's result (here scaled by
    one), or an old state that something else reads too, could not be updated in place."""
    from toptpu.compiler import CompileError, check_state_in_place
    from toptpu.frontends import linear_attention_ops as ops
    from toptpu.frontends.fx_importer import import_module
    from toptpu.passes.pipelines import run_passes, top_pipeline_passes

    class Net(torch.nn.Module):
        def __init__(self, copy_out: bool, extra_read: bool) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))
            self.copy_out, self.extra_read = copy_out, extra_read

        def forward(self, x: torch.Tensor, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y, conv = ops.causal_conv1d(x, self.w, conv_state, torch.ones(1, x.shape[1]))
            q = y.reshape(1, -1, 2, 4)
            o, rec = ops.gated_delta_rule(q, q, q, -torch.ones(1, q.shape[1], 2),
                                          torch.ones(1, q.shape[1], 2) * 0.5,
                                          recurrent_state, 0.5)
            if self.copy_out:
                rec = torch.sigmoid(rec)
            if self.extra_read:
                o = o + conv_state.sum()
            return o.reshape(1, -1, 8), conv, rec

    args = (torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 2, 4, 4))
    names = ["hidden", "conv_state", "recurrent_state"]
    outs = ["hidden_out", "present_conv_state", "present_recurrent_state"]
    for copy_out, extra_read, ok in ((False, False, True), (True, False, False),
                                     (False, True, False)):
        module, store = import_module(Net(copy_out, extra_read).eval(), args,
                                      input_names=names, output_names=outs)
        run_passes(module, top_pipeline_passes(), store=store)
        if ok:
            check_state_in_place(module, "block_cache")
        else:
            with pytest.raises(CompileError, match="could not be updated in place"):
                check_state_in_place(module, "block_cache")
