"""The machine's two modes give the same numbers: every net of the test models (per-layer
nets at their first and last layer; the prefill nets at each prefill length) run on the
fast and the checked machine with the same inputs gives bit-identical outputs, on the first
run and on a second one (when the fast mode's cached conversions of the weights are used),
and with the fast machine reading the weight cache file's forms instead."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from llm_fixtures import compiled

from toptpu.backend.contract import TensorSpec
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.weight_cache_file import open_weight_cache, write_weight_cache

pytestmark = pytest.mark.slow

#: (family, mode, compile options): f32 and w4bf16 (the dequantized-weight cache), one
#: with a history (block_kv)
MODELS = [("qwen2", "f32", {}), ("qwen2", "w4bf16", {}),
          ("qwen2", "f32", {"seq": 64, "input_len": 16, "history": 56}),
          ("qwen2", "w4bf16", {"seq": 96, "input_len": 48, "cached": True})]


def _value(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(np.dtype(spec.dtype), np.integer):
        return rng.integers(0, 16, spec.shape).astype(spec.dtype)
    return rng.standard_normal(spec.shape).astype(spec.dtype)


def _run(ex: MachineExecutor, net: str, feeds: dict[str, np.ndarray],
         layer: int | None) -> dict[str, np.ndarray]:
    info = ex.nets()[net]
    bufs = {s.name: ex.alloc(tuple(s.shape), s.dtype) for s in (*info.inputs, *info.outputs)}
    for name, value in feeds.items():
        ex.write(bufs[name], value)
    ex.run(net, bufs, layer)
    return {s.name: ex.read(bufs[s.name]) for s in info.outputs}


@pytest.mark.parametrize(("family", "mode", "options"), MODELS,
                         ids=[f"{f}-{m}{'-' + '-'.join(o) if o else ''}"
                              for f, m, o in MODELS])
def test_fast_and_checked_mode_are_bit_identical_on_every_net(
        tmp_path_factory, tmp_path, family: str, mode: str, options: dict) -> None:
    options = dict(options)
    cached = options.pop("cached", False)
    path = compiled(tmp_path_factory, family, mode, **options).model_file
    if cached:  # the fast machine reads the forms from a weight cache file (a private copy)
        path = shutil.copyfile(path, str(tmp_path / "model.toptpu"))
        write_weight_cache(path)
    fast, checked = MachineExecutor(path), MachineExecutor(path, checked=True)
    if cached:
        fast.use_weight_cache(open_weight_cache(fast.file))
    assert not fast.machine.checked and checked.machine.checked
    rng = np.random.default_rng(0)
    layers = fast.file.layout.num_layers
    compared = 0
    for net, info in fast.nets().items():
        for layer in ((0, layers - 1) if info.per_layer else (None,)):
            feeds = {s.name: _value(s, rng) for s in info.inputs}
            want = _run(checked, net, feeds, layer)
            for _ in range(2):  # the second run uses the converted weights kept by the first
                got = _run(fast, net, feeds, layer)
                for name, value in want.items():
                    assert got[name].dtype == value.dtype, (net, layer, name)
                    assert got[name].tobytes() == value.tobytes(), (net, layer, name)
            compared += 1
    assert {"embedding", "block", "block_cache", "lm_head"} <= set(fast.nets())
    if "history" in options:
        assert "block_kv" in fast.nets()
    if cached:
        assert {"embedding:16", "block:16", "block_kv:16"} <= set(fast.nets())
        assert len(fast.machine.cache) == 0 and fast.stored is not None and fast.stored.hits
    assert compared >= len(fast.nets())


@pytest.mark.parametrize("executor", ["fast", "interpreter"])
def test_a_cache_too_small_for_the_f32_weights_keeps_offsets_and_the_tokens(
        tmp_path_factory, executor: str) -> None:
    """With a weight cache that holds the f32 forms of only some of the quantized weights,
    the rest are kept as their integer offsets (and the last f32 forms give way to them):
    the generated tokens are those of an unbounded cache, on the machine and on the
    interpreter alike."""
    from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
    from toptpu.backend.runtime.runtime import Runtime

    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file

    def runtime(budget: int | None) -> Runtime:
        if executor == "fast":
            return Runtime(MachineExecutor(path, weight_cache_bytes=budget))
        return Runtime(InterpreterExecutor(path, weight_cache_bytes=budget))

    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    full = runtime(1 << 40)
    want = full.generate(ids, 6, stop_on_eos=False).generated_ids
    cache = full.ex.machine.cache if executor == "fast" else full.ex.cache  # type: ignore[attr-defined]
    assert cache.forms()["offsets"] == 0
    small = runtime(cache.used // 3)
    for _ in range(3):  # the first passes settle which weights keep which form
        assert small.generate(ids, 6, stop_on_eos=False).generated_ids == want
    cache = small.ex.machine.cache if executor == "fast" else small.ex.cache  # type: ignore[attr-defined]
    forms = cache.forms()
    assert forms["converted"] > 0 and forms["offsets"] > 0, forms
    assert cache.used <= cache.budget
