"""The tensor-parallel pass: every net of a real transformers model (random weights) cut for
2 and 4 devices, run on every device at once in the interpreter (`run_spmd`), gives what the
uncut net gives; the collectives' kernels add in their algorithm's order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import (
    CollectiveError,
    Interpreter,
    find_func,
    run_spmd,
)
from toptpu.dialects import dev, top
from toptpu.dialects.naming import input_names, output_names
from toptpu.dialects.sharding import (
    Split,
    arg_split,
    device_tensor,
    parse_shard_name,
    piece_of,
    result_split,
    set_arg_split,
    shard_name,
    take_piece,
)
from toptpu.dialects.weight_store import WeightStore

# ---------------------------------------------------------------------- the kernels


def test_a_ring_all_reduce_adds_each_chunk_around_the_ring_from_its_own_device() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(12).astype(np.float32) * 10 ** i for i in range(3)]
    got = K.all_reduce(parts, "ring")
    for c, (lo, hi) in enumerate(((0, 4), (4, 8), (8, 12))):
        want = parts[c][lo:hi]
        for j in (1, 2):
            want = want + parts[(c + j) % 3][lo:hi]
        assert np.array_equal(got[lo:hi], want)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_a_tree_all_reduce_sums_every_part_once(n: int) -> None:
    rng = np.random.default_rng(n)
    parts = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(n)]
    got = K.all_reduce(parts, "tree")
    assert np.allclose(got, np.sum(parts, axis=0), atol=1e-5)
    if n == 4:  # ((p0 + p1) + (p2 + p3)): recursive doubling
        assert np.array_equal(got, (parts[0] + parts[1]) + (parts[2] + parts[3]))


def test_an_all_reduce_of_bf16_rounds_every_add() -> None:
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    parts = [np.array([1.0], bf16), np.array([2.0 ** -9], bf16)]
    assert K.all_reduce(parts, "tree").dtype == bf16
    assert float(K.all_reduce(parts, "tree")[0]) == 1.0  # 1 + 2^-9 rounds back to 1


def test_a_collective_alone_is_refused() -> None:
    from xdsl.dialects.builtin import TensorType, f32
    from xdsl.ir import Block

    arg = Block(arg_types=[TensorType(f32, [2])]).args[0]
    op = dev.AllReduceOp(arg, 2, "ring")
    from toptpu.backend.reference.interpreter import EvalContext, evaluate_op

    with pytest.raises(CollectiveError, match="run the net on all of them"):
        evaluate_op(op, [np.zeros(2, np.float32)], EvalContext(None))


# ---------------------------------------------------------------------- names and pieces


def test_shard_names_and_pieces() -> None:
    s = Split(0, 2)
    assert shard_name("layer.q.weight", s) == "layer.q.weight@shard0-2"
    assert parse_shard_name("layer.q.weight@shard0-2") == ("layer.q.weight", s)
    assert parse_shard_name("layer.q.weight") is None
    # 2 pieces over 4 devices: devices 0 and 1 share piece 0
    assert [piece_of(d, 4, 2) for d in range(4)] == [0, 0, 1, 1]
    a = np.arange(8).reshape(4, 2)
    assert np.array_equal(take_piece(a, s, 3, 4), a[2:])


# ---------------------------------------------------------------------- nets of a real model


def _nets(family: str) -> dict[str, Any]:
    """(Top module after top-pipeline, its store) of each text net of a tiny model."""
    from toptpu.backend.contract import StaticShapes
    from toptpu.frontends.fx_importer import import_module
    from toptpu.frontends.llm import split_model
    from toptpu.frontends.tiny_models import tiny_model
    from toptpu.passes.pipelines import run_passes, top_pipeline_passes

    model = tiny_model(family, num_attention_heads=4, num_key_value_heads=2)
    out = {}
    for spec in split_model(model, StaticShapes.make(32, 8)):
        store = WeightStore()
        module, _ = import_module(spec.module, spec.args, store=store,
                                  input_names=spec.input_names,
                                  output_names=spec.output_names)
        run_passes(module, top_pipeline_passes(), store=store)
        out[spec.name] = (module, store, spec)
    return out


@pytest.fixture(scope="module")
def qwen2_nets() -> dict[str, Any]:
    return _nets("qwen2")


def _inputs(spec: Any) -> dict[str, np.ndarray]:
    return {n: a.detach().numpy() for n, a in zip(spec.input_names, spec.args, strict=True)}


def _spmd(module: Any, store: WeightStore, inputs: dict[str, np.ndarray], n: int
          ) -> dict[str, np.ndarray]:
    """Cut `module` for `n` devices, run it on all of them, put the outputs back whole."""
    from toptpu.passes.pipelines import run_passes
    from toptpu.passes.tensor_parallel import TensorParallelPass

    run_passes(module, [TensorParallelPass(n)], store=store)
    fn = find_func(module)
    names = {op.tensor_name for op in module.walk() if isinstance(op, top.WeightOp)}
    stores, ins = [], []
    for d in range(n):
        s = WeightStore()
        for w in names:
            s[w] = np.ascontiguousarray(device_tensor(w, lambda b: store[b], d, n))
        stores.append(s)
        ins.append({name: (x if (sp := arg_split(fn, i)) is None else take_piece(x, sp, d, n))
                    for i, (name, x) in enumerate((k, inputs[k]) for k in input_names(fn))})
    outs = run_spmd(module, stores, ins)
    whole = {}
    for i, name in enumerate(output_names(fn)):
        sp = result_split(fn, i)
        if sp is None:
            assert all(np.array_equal(o[name], outs[0][name]) for o in outs)
            whole[name] = outs[0][name]
        else:
            whole[name] = np.concatenate([outs[d][name] for d in range(0, n, n // sp.pieces)],
                                         axis=sp.axis)
    return whole


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("net", ["block", "block_kv", "block_cache", "lm_head", "greedy_head",
                                 "sample_head"])
def test_each_net_cut_for_n_devices_computes_what_the_whole_net_computes(
        qwen2_nets: dict[str, Any], net: str, n: int) -> None:
    """Outputs of the column-parallel parts (the KV cache, the logits, the heads' tokens)
    are bit-identical; a row-parallel matmul's sum is added in another order (K in n
    parts, then the all-reduce): within 1e-5 of the largest |value|."""
    module, store, spec = qwen2_nets[net]
    inputs = _inputs(spec)
    ref = Interpreter(module, store).run(inputs).outputs
    cut = module.clone()
    if net in ("greedy_head", "sample_head"):  # they take the lm_head's split logits
        set_arg_split(find_func(cut), 0, Split(1, n))
    got = _spmd(cut, store, inputs, n)
    for name, want in ref.items():
        if name == "hidden_out":
            scale = float(np.abs(want).max())
            assert np.abs(got[name] - want).max() <= 1e-5 * scale, name
        else:
            assert np.array_equal(got[name], want), name
    kinds = {type(op) for op in cut.walk() if isinstance(op, dev.CollectiveOp)}
    want_kinds = {"block": {dev.AllReduceOp}, "block_kv": {dev.AllReduceOp},
                  "block_cache": {dev.AllReduceOp}, "lm_head": set(),
                  "greedy_head": {dev.AllGatherOp}, "sample_head": {dev.AllGatherOp}}[net]
    assert kinds == want_kinds


def _device_stores(module: Any, store: WeightStore, n: int) -> list[WeightStore]:
    """Every device's tensors of a lowered net, derived by the weight recipes from its
    pieces of the float weights (as the compiler derives them); device 0's are the ones the
    passes stored."""
    from toptpu.passes.weight_recipe import derive_weights, weight_recipes

    recipes = weight_recipes(module)
    stores = []
    for d in range(n):
        s = WeightStore()
        derived = derive_weights(recipes, lambda src, d=d: device_tensor(
            src, lambda b: store[b], d, n))
        for name, arr in derived.items():
            s[name] = arr
            if d == 0:
                assert np.array_equal(arr, store[name]), name
        stores.append(s)
    return stores


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "n"), [("f32", 2), ("bf16", 4)])
def test_the_cut_nets_run_on_n_machines_together(qwen2_nets: dict[str, Any], mode: str,
                                                 n: int) -> None:
    """Lowered, grouped and compiled to command streams, a cut block_cache runs on one
    machine per device, the all-reduces on the link engine: the KV cache bit-identical to
    one machine's uncut net, the hidden state within the mode's rounding (f32: 1e-5 of the
    largest |value|; bf16 sums each device's partial sum rounded to bf16: 2e-2), and the
    modelled time includes the collectives."""
    from toptpu.backend.runtime.simulate import simulate, simulate_devices
    from toptpu.backend.target.chips import get_chip
    from toptpu.machine_pipeline import compile_for_machine
    from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
    from toptpu.passes.tensor_parallel import TensorParallelPass

    chip = get_chip("bm1684x")
    module, store, spec = qwen2_nets["block_cache"]
    inputs = _inputs(spec)
    one = module.clone()
    run_passes(one, tpu_pipeline_passes(mode), store=store)
    ref = simulate(compile_for_machine(one.clone(), chip), store, inputs, chip)
    cut = module.clone()
    run_passes(cut, [TensorParallelPass(n)], store=store)
    fn = find_func(cut)
    splits = {name: arg_split(fn, i) for i, name in enumerate(input_names(fn))}
    run_passes(cut, tpu_pipeline_passes(mode), store=store)
    prog = compile_for_machine(cut.clone(), chip)
    ins = [{k: v if splits[k] is None else take_piece(v, splits[k], d, n)
            for k, v in inputs.items()} for d in range(n)]
    res = simulate_devices(prog, _device_stores(cut, store, n), ins, chip)
    for name in ("present_k", "present_v"):  # 2 KV heads: cut in 2 pieces
        step = max(n // 2, 1)
        got = np.concatenate([res[d].outputs[name] for d in range(0, n, step)], axis=2)
        assert np.array_equal(got, ref.outputs[name])
    want = ref.outputs["hidden_out"].astype(np.float32)
    got = res[0].outputs["hidden_out"].astype(np.float32)
    tol = 1e-5 if mode == "f32" else 2e-2
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    tl = res[0].timeline
    from toptpu.backend.formats.commands import Collective
    from toptpu.backend.target.link import LinkWork, collective_seconds

    works = [LinkWork(c.kind, c.algorithm, c.devices, c.nbytes) for c in prog.commands
             if isinstance(c, Collective)]
    assert len(works) == 2  # after o_proj and after down_proj
    link = sum(collective_seconds(chip, w) for w in works) / chip.seconds_per_cycle
    assert tl.busy("link") == pytest.approx(link)
    assert tl.cycles > link  # the groups around them wait for the collectives
