"""The weight store is explicit: passes get it from their context, and every module
toptpu-opt prints is self-contained (its `top.weight_store` file holds every tensor it
names), so a chain of separate toptpu-opt processes runs in the interpreter at every step,
bit for bit as the same passes in one process."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors import safe_open
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr, f32

from helpers import run_tool
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.compiler import print_ir
from toptpu.dialects import context, top
from toptpu.dialects.common import tensor
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import (
    STORE_ATTR,
    WeightsContext,
    WeightStore,
    WeightStoreError,
    needed_names,
    open_store,
    weights_of,
)
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.pipelines import run_passes, top_pipeline_passes
from toptpu.passes.quantize import CHECKPOINT_MODEL, checkpoint_key
from toptpu.passes.weight_reorder import WeightReorderPass


def _module_naming(uri: str) -> ModuleOp:
    m = ModuleOp([])
    m.attributes[STORE_ATTR] = StringAttr(uri)
    return m


# -- the store and the context ----------------------------------------------------------------

def test_a_pass_takes_the_store_from_its_context_and_it_must_be_the_module_s() -> None:
    store = WeightStore.from_arrays({"w": np.ones(2, np.float32)})
    m = _module_naming(store.uri)
    assert weights_of(WeightsContext.of(context(), store), m) is store
    other = WeightStore()
    with pytest.raises(WeightStoreError, match=f"names the weight store '{store.uri}' but its "
                                               f"passes were given '{other.uri}'"):
        weights_of(WeightsContext.of(context(), other), m)
    with pytest.raises(WeightStoreError, match="run it with a WeightsContext"):
        weights_of(Context(), m)  # a plain xDSL context carries no store
    with pytest.raises(WeightStoreError, match="lives in memory"):  # nobody handed it over
        weights_of(WeightsContext.of(context()), m)
    with pytest.raises(WeightStoreError, match="no 'top.weight_store' attribute"):
        weights_of(WeightsContext.of(context(), store), ModuleOp([]))


def test_the_context_opens_the_file_the_module_names_once(tmp_path) -> None:
    path = str(tmp_path / "w.safetensors")
    WeightStore.from_arrays({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}).save(path)
    ctx, m = WeightsContext.of(context()), _module_naming(path)
    first = weights_of(ctx, m)
    assert ctx.weights is first and weights_of(ctx, m) is first
    assert first.shape("w") == (2, 3) and first.derived_names() == set()
    first["w.t"] = first["w"].T
    assert first.derived_names() == {"w.t"}
    assert ctx.clone().weights is first  # xDSL clones contexts: the store stays the IR's
    with pytest.raises(WeightStoreError, match="lives in memory"):
        open_store(_module_naming(WeightStore().uri))


def test_needed_names_are_the_module_s_weights_with_their_annexes() -> None:
    arr = np.zeros(4, np.float32)
    store = WeightStore.from_arrays({
        "fc.weight": arr, checkpoint_key("fc.weight", "qweight"): arr, CHECKPOINT_MODEL: arr,
        "fc.weightx": arr, "other.weight": arr, checkpoint_key("other.weight", "scales"): arr})
    m = ModuleOp([top.WeightOp("fc.weight", tensor((4,), f32))])
    assert needed_names(m, store) == sorted(
        ["fc.weight", checkpoint_key("fc.weight", "qweight"), CHECKPOINT_MODEL])


def test_save_copies_tensors_that_share_memory(tmp_path) -> None:
    tied = np.arange(8, dtype=np.float32).reshape(2, 4)
    store = WeightStore.from_arrays({"embed": tied})
    store._arrays["lm_head"] = store["embed"]  # tied embeddings: one array under two names
    path = str(tmp_path / "w.safetensors")
    store.save(path)
    back = WeightStore.open(path)
    assert back.names() == ["embed", "lm_head"]
    assert np.array_equal(back["embed"], tied) and np.array_equal(back["lm_head"], tied)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# -- a chain of toptpu-opt processes ----------------------------------------------------------

def _outputs_bits(module: ModuleOp, store: WeightStore | None, feeds: dict) -> dict:
    out = Interpreter(module, store).run(feeds).outputs
    return {k: np.ascontiguousarray(v).view(np.uint8) for k, v in out.items()}


def _tensors_named(module: ModuleOp) -> list[str]:
    return sorted({op.tensor_name for op in module.walk() if isinstance(op, top.WeightBase)})


@pytest.mark.slow  # exports a layer and starts three toptpu-opt processes
def test_a_chain_of_toptpu_opt_processes_runs_at_every_step(tiny_models, tmp_path) -> None:
    """a.mlir -p top-pipeline -> b.mlir -> convert-top-to-tpu{mode=w4bf16} -> c.mlir ->
    weight-reorder -> d.mlir, each step a process of its own. The layer is a real Qwen2
    decoder layer with its q_proj written x @ W (a [K, N] weight, as GPT-2's Conv1D stores
    it), so each kind of step is there: top-pipeline derives no tensor (b keeps a's store),
    quantization derives the w4 tensors (c's companion), weight-reorder the transposed
    copy of the float matmul weight (d's companion). Each printed module runs in the
    interpreter on its own and gives the bits the same passes give in one process."""
    imp = import_decoder_layer(tiny_models("qwen2"), 8, top_pipeline=False,
                               mask_value=-10000.0)
    weights = str(tmp_path / "a.safetensors")
    imp.store.save(weights)
    imp.module.attributes[STORE_ATTR] = StringAttr(weights)
    text = print_ir(imp.module, generic=False)
    assert text.count("{transpose_b = true}") >= 1
    text = text.replace("{transpose_b = true}", "{}", 1)  # q_proj: x @ W
    paths = {s: str(tmp_path / f"{s}.mlir") for s in "abcd"}
    with open(paths["a"], "w") as f:
        f.write(text)

    # the same passes in one process, on one store (no file written)
    module = parse_ir(text, "a.mlir")
    store = WeightStore.open(weights)
    steps = {"b": top_pipeline_passes(), "c": [ConvertTopToTpuPass("w4bf16")],
             "d": [WeightReorderPass()]}
    want = {}
    for step, passes in steps.items():
        run_passes(module, passes, store=store)
        want[step] = _outputs_bits(module, store, imp.feeds)
    assert store.derived_names()  # quantized and transposed tensors

    commands = {"b": "top-pipeline", "c": "convert-top-to-tpu{mode=w4bf16}",
                "d": "weight-reorder"}
    for prev, (step, pipeline) in zip("abc", commands.items(), strict=True):
        res = run_tool("toptpu-opt", paths[prev], "-p", pipeline, "-o", paths[step])
        assert res.returncode == 0, res.stderr
    stores = {}
    for step in "bcd":
        with open(paths[step]) as f:
            m = parse_ir(f.read(), paths[step])
        attr = m.attributes[STORE_ATTR]
        assert isinstance(attr, StringAttr)
        stores[step] = attr.data
        # self-contained: the file holds every tensor the module names (a companion file
        # only those; b keeps a's file, which holds all of the imported layer's)
        with safe_open(attr.data, "pt") as f:
            held = sorted(f.keys())
        if step == "b":
            assert set(_tensors_named(m)) <= set(held)
        else:
            assert held == _tensors_named(m), step
        got = _outputs_bits(m, None, imp.feeds)  # the interpreter opens the module's file
        assert got.keys() == want[step].keys()
        for name in got:
            assert np.array_equal(got[name], want[step][name]), (step, name)
    assert stores == {"b": weights, "c": str(tmp_path / "c.weights.safetensors"),
                      "d": str(tmp_path / "d.weights.safetensors")}
    with safe_open(stores["d"], "pt") as f:
        assert any(n.endswith(".t") for n in f.keys())  # weight-reorder's transpose
