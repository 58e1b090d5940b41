"""Quantized model files: every net's outputs, run by the interpreter executor from the model
file, meet the thresholds of ARCHITECTURE.md against the Top f32 net (cos >= 0.99 bf16,
>= 0.98 w4) — for layer 0 (the layer the nets were compiled with) and layer 1 (weights
bound through the recipes). Also: the per-layer chunks are derived exactly by the
recipes."""

from __future__ import annotations

import numpy as np
import pytest
from llm_fixtures import tiny_dir

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.compare import tpu_threshold
from toptpu.compiler import CompileResult
from toptpu.compiler import compile as compile_model
from toptpu.dialects.weight_store import WeightStore
from toptpu.frontends.llm import LAYER_PREFIX, decode_mask, prefill_mask
from toptpu.layer_weights import float_of_layer
from toptpu.metrics import similarity
from toptpu.passes.weight_recipe import derive_weights, weight_recipes

pytestmark = pytest.mark.slow  # compiles quantized model files of three families


_RESULTS: dict[tuple[str, str], CompileResult] = {}
SEQ, L = 48, 8


def _compiled(tmp_path_factory, family: str, mode: str) -> CompileResult:
    key = (family, mode)
    if key not in _RESULTS:
        out = tmp_path_factory.mktemp("quant") / f"{family}-{mode}.toptpu"
        _RESULTS[key] = compile_model(tiny_dir(tmp_path_factory, family), str(out), mode=mode,
                                      seq_length=SEQ, max_input_length=L, max_history=16,
                                      progress=None, keep_modules=True)
    return _RESULTS[key]


#: sample_head's sampling parameters: a repetition penalty, temperature, top-k and top-p
SAMPLING_FEEDS = {"penalty": 1.3, "temperature": 0.8, "top_k": 5, "top_p": 0.9}


def _inputs(net: str, spec_in: tuple, rng: np.random.Generator, vocab: int
            ) -> dict[str, np.ndarray]:
    feeds = {}
    for s in spec_in:
        if s.name == "input_ids":
            feeds[s.name] = rng.integers(0, vocab, s.shape).astype(np.int32)
        elif s.name == "position_ids":
            n = s.shape[1]
            start = {"block": 0, "block_kv": 10, "block_cache": 20}[net]
            feeds[s.name] = np.arange(start, start + n, dtype=np.int32)[None]
        elif s.name == "attention_mask":
            if net == "block":
                feeds[s.name] = prefill_mask(L - 2, L)
            elif net == "block_kv":
                feeds[s.name] = prefill_mask(L - 2, L, 10, 16)
            else:
                feeds[s.name] = decode_mask(20, SEQ)
        elif s.name in SAMPLING_FEEDS:  # sample_head's parameters
            feeds[s.name] = np.full(s.shape, SAMPLING_FEEDS[s.name], s.dtype)
        elif s.name == "recent_ids":
            feeds[s.name] = rng.integers(0, vocab, s.shape).astype(np.int32)
        else:  # hidden states and history caches
            feeds[s.name] = rng.standard_normal(s.shape).astype(np.float32)
    return feeds


def _layer_store(result: CompileResult, layer: int) -> WeightStore:
    """The Top nets' float weights of `layer` (shared tensors as compiled)."""
    assert result.store is not None and result.loaded is not None
    get = float_of_layer(result.loaded.model, layer)
    arrays = {}
    for name in result.store.names():
        if name.startswith(LAYER_PREFIX) and ":" not in name:
            arrays[name] = get(name)
        elif ":" not in name:
            arrays[name] = result.store[name]
    return WeightStore.from_arrays(arrays)


@pytest.mark.parametrize("family,mode", [("qwen2", "bf16"), ("qwen3", "w4bf16"),
                                         ("llama3", "w4bf16")])
def test_every_net_meets_its_threshold_against_top(tmp_path_factory, family: str,
                                                   mode: str) -> None:
    result = _compiled(tmp_path_factory, family, mode)
    ex = InterpreterExecutor(result.path)
    vocab = result.header["model"]["vocab_size"]
    rng = np.random.default_rng(0)
    threshold = tpu_threshold(mode)
    checked = []
    for name, net in result.nets.items():
        info = ex.nets()[name]
        feeds = _inputs(name, info.inputs, rng, vocab)
        for layer in ([0, 1] if net.per_layer else [None]):
            assert net.top is not None
            store = _layer_store(result, layer) if layer is not None else result.store
            ref = Interpreter(net.top, store=store).run(feeds).outputs
            bufs = {s.name: ex.alloc(s.shape, s.dtype) for s in (*info.inputs, *info.outputs)}
            for s in info.inputs:
                ex.write(bufs[s.name], feeds[s.name])
            ex.run(name, bufs, layer=layer)
            for s in info.outputs:
                got = ex.read(bufs[s.name])
                if s.name == "token":  # greedy_head: the top-1 of the logits it was given
                    logits = ex.read(bufs["logits"]).astype(np.float32)
                    assert int(got.reshape(-1)[0]) == int(np.argmax(logits))
                    continue
                cos = similarity(got.astype(np.float32), ref[s.name].astype(np.float32)).cosine
                assert cos >= threshold, f"{family} {mode} {name}[{layer}] {s.name}: cos {cos}"
                checked.append((name, layer, s.name))
    assert ("block_cache", 1, "present_k") in checked and ("lm_head", None,
                                                           "logits") in checked


def test_layer_chunks_are_the_recipes_of_each_layer(tmp_path_factory) -> None:
    """Every layer chunk holds exactly what the recipes derive from that layer's float
    weights, at the same offsets in every chunk; the chunks differ between layers."""
    result = _compiled(tmp_path_factory, "qwen3", "w4bf16")
    f = LlmFile(result.path)
    layout = f.layout
    (chunk,) = layout.chunks  # one layer kind: one chunk layout
    assert all(la.offset % 64 == 0 for la in layout.layers) and layout.chunk_size(0) % 64 == 0
    assert all(e.offset % 64 == 0 for e in (*layout.shared.values(), *chunk.values()))
    recipes = {r.name: r for net in result.nets.values() if net.per_layer
               for r in weight_recipes(net.tpu) if r.source.startswith(LAYER_PREFIX)}
    assert set(recipes) == set(chunk)
    chunks = []
    for layer in range(f.num_layers):
        want = derive_weights(recipes.values(), float_of_layer(result.loaded.model, layer))
        got = f.layer_weights(layer)
        for name, arr in want.items():
            assert np.array_equal(got[name].view(np.uint8), arr.view(np.uint8)), name
        chunks.append(np.concatenate([got[n].view(np.uint8).reshape(-1) for n in sorted(got)]))
    assert not np.array_equal(chunks[0], chunks[1])
    # quantized matmuls have packed 4-bit weights; embedding and lm_head stay bf16
    kinds = {e.dtype for n, e in chunk.items() if n.endswith(".qweight")}
    assert kinds == {"uint8"}
    assert layout.shared["embed_tokens.weight:bf16"].dtype == "bfloat16"
    assert layout.shared["lm_head.weight:bf16"].dtype == "bfloat16"
    f.close()
