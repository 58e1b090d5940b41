"""Quantized mixture-of-experts experts (`tpu.a16_moe_experts`): the stacked experts of
every weight-only mode quantized expert by expert (groups along each projection's input)
in `tpu.a16_matmul`'s layout and computed by one kernel that dequantizes the chosen
experts with the a16_matmul's own `dequantize`:

- the kernel equals the float experts' kernel on the dequantized weights, bit for bit
  (4 and 8 bits, zero points, symmetric, mins), and dequantizes only the chosen experts;
- the verifier; the lowering (the store's integers are `quantize_rtn` of each expert);
- a MoE block on the Tpu interpreter and the machine, bit for bit, in every weight-only
  mode, close to transformers' block;
- (slow) whole models: w8f32 greedy tokens equal transformers' `generate`; w4f32 tokens
  equal transformers' on the same model with its linears replaced by their dequantized
  4-bit values (the exact check of the w4 arithmetic); the f16/bf16 modes meet the suite's
  thresholds against the Top f32 nets for layers 0 and 1 (as the dense quantized models,
  tests/test_llm_quant.py); machine == interpreter bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from llm_fixtures import LONG_PROMPT, shared_dir, tiny_dir
from test_moe import CHIP, _import_block, _moe_block
from xdsl.dialects.builtin import IntegerType, Signedness, TensorType, f32, i32
from xdsl.ir import Block
from xdsl.utils.exceptions import VerifyException

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.dialects import tpu
from toptpu.dialects.common import dtype_name, elem_of, tensor
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
from toptpu.passes.quantize import checkpoint_parts, quantize_rtn

E, H, T, TOP_K = 6, 64, 10, 2
I = 32  # noqa: E741  (the experts' intermediate size, as the docs call it)
ui8 = IntegerType(8, Signedness.UNSIGNED)


def _stacked(bits: int, group: int, symmetric: bool, seed: int, mins: bool = False
             ) -> tuple[list[tuple[np.ndarray, ...]], list[np.ndarray], list[int]]:
    """Random gate, up [E, I, H] and down [E, H, I] quantized expert by expert: per
    projection (qweight, scales, zeros or None, mins or None), its dequantized f32 stack,
    and the group sizes. `mins`: the scale-and-min form (mins = -z * s, a float)."""
    rng = np.random.default_rng(seed)
    parts, floats, groups = [], [], []
    for shape in ((E, I, H), (E, I, H), (E, H, I)):
        w = rng.standard_normal(shape).astype(np.float32) * 0.1
        qw = quantize_rtn(w, bits, group, symmetric, np.dtype(np.float16))
        z, m = qw.zeros, None
        if mins:
            assert z is not None
            m = (-(z.astype(np.float32)) * qw.scales.astype(np.float32)).astype(np.float16)
            z = None
        parts.append((qw.qweight, qw.scales, z, m))
        floats.append(np.stack([K.dequantize(qw.qweight[e], qw.scales[e],
                                             None if z is None else z[e], bits, qw.group_size,
                                             None if m is None else m[e])
                                for e in range(shape[0])]))
        groups.append(qw.group_size)
    return parts, floats, groups


def _routing(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E - 1, TOP_K, replace=False) for _ in range(T)]).astype(np.int32)
    idx[-1] = -1  # a padded row routes nowhere
    w = rng.random((T, TOP_K)).astype(np.float32)
    return x, w, idx


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("bits,group,symmetric,mins", [
    (4, 32, False, False), (4, 16, True, False), (8, -1, True, False), (8, -1, False, False),
    (4, 32, False, True)])
def test_kernel_is_the_float_experts_on_the_dequantized_weights(bits: int, group: int,
                                                                symmetric: bool,
                                                                mins: bool) -> None:
    parts, floats, groups = _stacked(bits, group, symmetric, 0, mins)
    x, w, idx = _routing(1)
    flat = [a for p in parts for a in p]
    for dt in (np.float32, np.float16, K.BF16):
        got = K.a16_moe_experts(x.astype(dt), *flat, w.astype(dt), idx, bits=(bits,) * 3,
                                group_sizes=groups)
        want = K.moe_experts(x.astype(dt), *floats, w.astype(dt), idx)
        assert got.dtype == want.dtype == np.dtype(dt)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert not np.any(got[-1].astype(np.float32))  # the padded row


def test_kernel_dequantizes_only_the_chosen_experts(monkeypatch) -> None:
    parts, _, groups = _stacked(4, 32, False, 0)
    x, w, idx = _routing(1)
    idx[:] = np.where(idx >= 0, idx % 2, -1)  # experts 0 and 1 only
    seen: list[tuple[int, ...]] = []
    real = K.dequantize

    def counting(q, *args, **kw):
        seen.append(q.shape)
        return real(q, *args, **kw)

    monkeypatch.setattr(K, "dequantize", counting)
    K.a16_moe_experts(x, *[a for p in parts for a in p], w, idx, bits=(4, 4, 4),
                      group_sizes=groups)
    assert len(seen) == 2 * 3  # two experts, three projections each


def test_kernel_in_parts_of_the_intermediate_axis() -> None:
    """Parts over I (gate and up by rows, down by columns: whole groups) add up to the
    whole op (f32 sums in another order: close, not bitwise)."""
    parts, _, groups = _stacked(4, 16, False, 0)
    x, w, idx = _routing(1)
    whole = K.a16_moe_experts(x, *[a for p in parts for a in p], w, idx, bits=(4, 4, 4),
                              group_sizes=groups)
    acc = None
    for lo, hi in ((0, 16), (16, 32)):
        cut = []
        for n, (q, s, z, _) in enumerate(parts):
            if n < 2:
                cut.append((q[:, lo:hi], s[:, lo:hi], z[:, lo:hi], None))
            else:
                g0, g1 = lo // groups[2], hi // groups[2]
                cut.append((q[:, :, lo // 2:hi // 2], s[:, :, g0:g1], z[:, :, g0:g1], None))
        acc = K.a16_moe_experts_part(acc, x, *[a for p in cut for a in p], w, idx,
                                     bits=(4, 4, 4), group_sizes=groups)
    assert acc is not None
    np.testing.assert_allclose(K.moe_experts_finish(acc, np.float32), whole, rtol=1e-5,
                               atol=1e-6)


def test_kernel_in_parts_with_a_per_channel_down() -> None:
    """8 bits per channel (one group over all of I for down): each part of I takes down's
    columns and its whole scales (every part shares a channel's scale, one group of I /
    parts: `sliced_attributes`); the parts add up to the whole op."""
    parts, _, groups = _stacked(8, -1, True, 0)
    assert parts[2][1].shape == (E, H, 1) and groups[2] == I
    x, w, idx = _routing(1)
    whole = K.a16_moe_experts(x, *[a for p in parts for a in p], w, idx, bits=(8, 8, 8),
                              group_sizes=groups)
    acc = None
    for lo, hi in ((0, 16), (16, 32)):
        cut = [(q[:, lo:hi], s[:, lo:hi], None, None) for q, s, _, _ in parts[:2]]
        cut.append((parts[2][0][:, :, lo:hi], parts[2][1], None, None))
        acc = K.a16_moe_experts_part(acc, x, *[a for p in cut for a in p], w, idx,
                                     bits=(8, 8, 8), group_sizes=(*groups[:2], hi - lo))
    assert acc is not None
    np.testing.assert_allclose(K.moe_experts_finish(acc, np.float32), whole, rtol=1e-5,
                               atol=1e-6)


# --------------------------------------------------------------------------- the op


def _op(bits: int = 4, edit: dict | None = None) -> tpu.A16MoeExpertsOp:
    """An op over block arguments of the given types (`edit`: a type replaced)."""
    types: dict[str, TensorType] = {"x": tensor((T, H), f32)}
    packed = 2 if bits == 4 else 1
    q = ui8
    for name, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
        types[f"{name}_q"] = tensor((E, n, k // packed), q)
        types[f"{name}_s"] = tensor((E, n, k // 16), f32)
        types[f"{name}_z"] = tensor((E, n, k // 16), ui8)
    types["weights"] = tensor((T, TOP_K), f32)
    types["indices"] = tensor((T, TOP_K), i32)
    types.update(edit or {})
    block = Block(arg_types=list(types.values()))
    v = dict(zip(types, block.args, strict=True))
    projections = [(v[f"{p}_q"], v[f"{p}_s"], v[f"{p}_z"], None)
                   for p in ("gate", "up", "down")]
    return tpu.A16MoeExpertsOp(v["x"], projections, v["weights"], v["indices"],
                               weight_bits=[bits] * 3, group_size=[16] * 3)


def test_op_shapes_flops_and_reduction_count() -> None:
    op = _op()
    op.verify()
    assert op.experts == E and op.intermediate == I and op.top_k == TOP_K
    assert op.flops() == T * TOP_K * (2 * H * 2 * I + 2 * I * H + 6 * I + 2 * H)
    assert op.reduction_count() == I // 16
    assert op.row_rule(0) is not None
    assert op.reduction_operand_axes() == (None, 1, 1, 1, 1, 1, 1, 2, 2, 2, None, None)


@pytest.mark.parametrize("edit,message", [
    ({"down_q": tensor((E, H, I), ui8), "down_s": tensor((E, H, 4), f32),
      "down_z": tensor((E, H, 4), ui8)},
     "down \\[6, 64, 64\\] .* must be \\[E, I, 64\\], \\[E, I, 64\\], \\[E, 64, I\\]"),
    ({"up_s": tensor((E, I, 2), f32)}, "up scales must be float \\[6, 32, 4\\]"),
    ({"gate_z": tensor((E, I, 4), i32)}, "gate zeros must be ui8"),
    ({"gate_q": tensor((E, I, H // 2), i32)}, "4-bit qweight cannot be i32"),
    ({"indices": tensor((T, TOP_K), f32)}, "integer indices"),
    ({"weights": tensor((T, 0), f32), "indices": tensor((T, 0), i32)},
     "k at least 1"),
])
def test_verifier(edit: dict, message: str) -> None:
    with pytest.raises(VerifyException, match=message):
        _op(edit=edit).verify()


# --------------------------------------------------------------------------- a block


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("mode", ["w8f32", "w8bf16", "w4f16", "w4bf16", "w4f32"])
def test_block_on_interpreter_and_machine(family: str, mode: str) -> None:
    """Every weight-only mode quantizes the experts (the router stays float): the stored
    integers are `quantize_rtn` of each expert; the machine gives the Tpu interpreter's
    bits; the result is close to transformers' block (cos >= 0.99 w8, >= 0.98 w4)."""
    from toptpu.backend.runtime.machine import Machine
    from toptpu.backend.runtime.simulate import simulate
    from toptpu.machine_pipeline import compile_for_machine
    from toptpu.metrics import similarity

    block = _moe_block(family)
    module, store, feeds, ref, n = _import_block(block)
    group = 32 if mode.startswith("w4") else -1
    run_passes(module, tpu_pipeline_passes(mode, group_size=group), store=store)
    module.verify()
    assert not any(isinstance(op, tpu.MoeExpertsOp) for op in module.walk())
    (experts,) = [op for op in module.walk() if isinstance(op, tpu.A16MoeExpertsOp)]
    bits = int(mode[1])
    assert experts.quantized_weights()[2].bits == bits
    (route,) = [op for op in module.walk() if isinstance(op, tpu.MoeRouteOp)]
    assert isinstance(route.logits.owner, tpu.MatMulOp)  # the router: a float matmul
    gate_up = block.experts.gate_up_proj.detach().numpy()
    gate = gate_up[:, :gate_up.shape[1] // 2]
    act = mode[2:]
    scale_dtype = {"f32": np.float32, "f16": np.float16, "bf16": K.BF16}[act]
    want = quantize_rtn(gate, bits, group, bits == 8, np.dtype(scale_dtype))
    qname = store.names()
    gate_q = experts.gate_qweight.owner
    assert isinstance(gate_q, tpu.WeightOp) and gate_q.tensor_name in qname
    assert np.array_equal(store[gate_q.tensor_name], want.qweight)
    dt = {"f32": np.float32, "f16": np.float16, "bf16": K.BF16}[act]
    feeds = {k: v.astype(dt) for k, v in feeds.items()}
    y = Interpreter(module, store).run(feeds).outputs["y"]
    cos = similarity(y[0].astype(np.float32)[:n], ref[:n]).cosine
    assert cos >= (0.99 if bits == 8 else 0.98), cos
    program = compile_for_machine(module, CHIP)
    machine = Machine(CHIP, checked=True)
    got = simulate(program, store, feeds, CHIP, machine=machine).outputs["y"]
    assert dtype_name(elem_of(experts.output)) == act
    assert got.dtype == y.dtype and np.array_equal(got.view(np.uint8), y.view(np.uint8))
    # the stacked quantized weights are fetched by index: each expert some real row chose
    # is read once from every stacked operand (integers, scales, zero points), no other
    stacked = {op.tensor_name: store[op.tensor_name] for v in experts.operands[1:-2]
               if isinstance(op := v.owner, tpu.WeightOp)}
    assert len(stacked) == (6 if bits == 8 else 9)  # zero points at 4 bits (asymmetric)
    chosen = _chosen_experts(block, feeds["x"][0, :n].astype(np.float32))
    rows: dict[str, list[int]] = {name: [] for name in stacked}
    for f in machine.fetched:
        rows[str(f.tensor.name)] += list(f.rows)
        one = stacked[str(f.tensor.name)][0].nbytes
        assert f.nbytes == len(f.rows) * one, f.tensor.name
    assert all(sorted(r) == chosen for r in rows.values()), (rows, chosen)
    assert sum(f.nbytes for f in machine.fetched) == len(chosen) * sum(
        a[0].nbytes for a in stacked.values())


def _chosen_experts(block: torch.nn.Module, x: np.ndarray) -> list[int]:
    """The experts the block's router chooses for the rows `x` (the union, ascending)."""
    with torch.no_grad():
        logits = torch.nn.functional.linear(torch.from_numpy(x), block.gate.weight)
        _, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float32),
                            block.gate.top_k, dim=-1)
    return sorted({int(i) for i in idx.reshape(-1)})


def _stacked_expert_loads(program) -> tuple[list, dict[str, int]]:
    """A program's loads of the stacked experts' tensors (`layer.mlp.experts.*`, or the
    block net's `experts.*`) and each such tensor's bytes of one expert."""
    from toptpu.backend.formats.commands import Load

    def expert_tensor(name: str) -> bool:
        return "experts." in name and "shared" not in name

    loads = [c for c in program.commands if isinstance(c, Load)
             and expert_tensor(str(c.tensor.name))]
    one = {}
    for c in loads:
        name = str(c.tensor.name)
        one[name] = program.weights[name].nbytes // c.shape[0]
    return loads, one


def _experts_fetched_by_index(rt, fields: set[str]) -> None:
    """In every text net of the machine runtime `rt`'s model file, each load of a stacked
    expert tensor is an indexed load, the tensors' `fields` (qweight, scales, zeros,
    mins) all among them; a decode step (`block_cache`) is modelled to move k of the E
    experts of each. (One exception: a per-channel down's scales [E, H, 1], whole in
    every reduction part, are loaded whole once where a prefill chunk's row blocks read
    them at different indices.)"""
    from toptpu.backend.formats.commands import Load

    for net in ("block", "block_kv", "block_cache"):
        program = rt.ex.program(net)
        loads, _ = _stacked_expert_loads(program)
        assert loads and all(
            c.index is not None or (net != "block_cache" and c.shape[2] == 1
                                    and ".down_proj" in str(c.tensor.name))
            for c in loads), net
        assert {str(c.tensor.name).rsplit(".", 1)[1] for c in loads} == fields, net
        if net == "block_cache":
            (k,) = {c.index.shape[-1] for c in loads if isinstance(c, Load) and c.index}
            (e,) = {c.shape[0] for c in loads}
            modelled, every = program.indexed_bytes()
            assert modelled * e == every * k, (modelled, every)


@pytest.mark.parametrize("mode", ["w8f16", "w4bf16"])
def test_a_decode_step_fetches_the_selected_quantized_experts_only(mode: str) -> None:
    """A decode step (one token) of the quantized experts: every stacked tensor's load (the
    integers, scales and, asymmetric, zero points of gate, up and down) is an indexed load
    by the router's indices; the machine reads exactly the k chosen experts' bytes of each
    (never the other E - k), the program's modelled bytes are those k experts', and the
    result is the interpreter's bit for bit."""
    from test_moe import _fetch_run

    block = _moe_block("qwen3_moe")
    program, machine, idx, (got, want) = _fetch_run(block, t=1, n_valid=1, mode=mode,
                                                    group=32)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    e, k = block.experts.gate_up_proj.shape[0], block.gate.top_k
    chosen = sorted(int(i) for i in idx[0])
    assert len(chosen) == k
    loads, one = _stacked_expert_loads(program)
    assert len(one) == (6 if mode.startswith("w8") else 9)
    assert all(c.index is not None for c in loads)
    rows: dict[str, dict[int, int]] = {name: {} for name in one}
    for f in machine.fetched:
        per_row = f.nbytes // len(f.rows)
        for r in f.rows:
            rows[str(f.tensor.name)][r] = rows[str(f.tensor.name)].get(r, 0) + per_row
    for name, per_expert in one.items():
        assert sorted(rows[name]) == chosen, name
        assert all(b == per_expert for b in rows[name].values()), name
    assert sum(f.nbytes for f in machine.fetched) == k * sum(one.values())
    assert sum(c.nbytes for c in loads) == k * sum(one.values())
    # every expert's bytes are what a load of the whole part would move; the local
    # buffers hold the k experts the step fetches
    assert sum(c.all_nbytes for c in loads) == e * sum(one.values())
    assert sum(c.local.nbytes for c in loads) == k * sum(one.values())


@pytest.mark.slow
@pytest.mark.parametrize("mode,group", [("w4bf16", 64), ("w4f32", 64), ("w8bf16", -1)])
def test_published_widths_in_reduction_parts_fetch_the_selected_experts(
        monkeypatch, mode: str, group: int) -> None:
    """Qwen3-30B-A3B's widths (H 2048, 16 experts of 768, top-8) quantized: the experts
    do not fit local memory and stream through it in reduction parts of I (a part of each
    stacked tensor: gate's and up's rows, down's packed columns and groups). A decode
    step's parts are indexed loads reading, over the parts, each chosen expert's bytes of
    every tensor once: k / E of what moving every expert would (w4bf16 g64: 20.6 of
    41.3 MB). At 8 bits per channel, down's scales (one group over I) are whole in every
    part, each part's loads fetched by index. The indexed loads into buffers of the
    fetched experts change no bit: the machine's result equals the interpreter's on the
    grouped net it ran (its parts in its order). The parts sum I in another order than
    the interpreter's whole op, and the same block compiled with its experts loaded whole
    (buffers of all E) takes more parts, so those two agree to f32 rounding."""
    from test_moe import _fetch_run

    from toptpu.frontends.tiny_models import tiny_model

    block = tiny_model("qwen3_moe", layers=1, hidden_size=2048, moe_intermediate_size=768,
                       num_experts=16, num_experts_per_tok=8).model.layers[0].mlp
    program, machine, idx, (got, want, grouped) = _fetch_run(
        block, t=1, n_valid=1, h=2048, mode=mode, group=group, grouped=True)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2,
                               atol=1e-2 if mode.endswith("bf16") else 1e-5)
    assert got.dtype == grouped.dtype
    assert np.array_equal(got.view(np.uint8), grouped.view(np.uint8))
    chosen = sorted(int(i) for i in idx[0])
    loads, one = _stacked_expert_loads(program)
    assert all(c.index is not None for c in loads)
    assert len(loads) > len(one)  # reduction parts
    rows: dict[str, dict[int, int]] = {name: {} for name in one}
    for f in machine.fetched:
        per_row = f.nbytes // len(f.rows)
        for r in f.rows:
            rows[str(f.tensor.name)][r] = rows[str(f.tensor.name)].get(r, 0) + per_row
    for name, per_expert in one.items():
        assert sorted(rows[name]) == chosen, name
        assert all(b == per_expert for b in rows[name].values()), name
    every = sum(c.all_nbytes for c in loads)
    assert sum(f.nbytes for f in machine.fetched) == sum(c.nbytes for c in loads) \
        == 8 * sum(one.values()) == every // 2
    if mode == "w4bf16":  # 3 x 768 x 2048 weights an expert: half a byte each, a bf16
        # scale and a ui8 zero point a group of 64
        assert sum(one.values()) == 3 * 768 * 2048 // 2 + 3 * 768 * 2048 // 64 * (2 + 1)
    monkeypatch.setattr(tpu.A16MoeExpertsOp, "fetched_by_index", lambda self: {})
    whole_program, whole_machine, _, (whole, _) = _fetch_run(block, t=1, n_valid=1, h=2048,
                                                            mode=mode, group=group)
    assert not whole_machine.fetched and not any(
        getattr(c, "index", None) is not None for c in whole_program.commands)
    np.testing.assert_allclose(whole.astype(np.float32), got.astype(np.float32), rtol=1e-2,
                               atol=1e-2 if mode.endswith("bf16") else 1e-5)


def test_a_group_size_that_does_not_divide_the_experts_is_refused() -> None:
    """The tiny experts are 32 wide: groups of 64 do not divide down's input."""
    from toptpu.passes.convert_top_to_tpu import ConversionError

    module, store, _, _, _ = _import_block(_moe_block("qwen3_moe"))
    with pytest.raises(ConversionError, match="down_proj.*group size 64 does not divide"):
        run_passes(module, tpu_pipeline_passes("w4bf16", group_size=64), store=store)


# --------------------------------------------------------------------------- models

FAMILIES = ["qwen3_moe", "qwen3_moe_unnormalized", "qwen2_moe"]


def _compiled(tmp_path_factory, family: str, mode: str) -> tuple[str, str]:
    from filelock import FileLock

    from toptpu.compiler import compile as compile_model

    model_dir = tiny_dir(tmp_path_factory, family)
    path = os.path.join(shared_dir(tmp_path_factory), f"{family}-moe-quant-{mode}.toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode=mode, seq_length=160, max_input_length=16,
                          progress=None, **({"group_size": 32} if mode[1] == "4" else {}))
    return model_dir, path


def _fake_quantized(model_dir: str, bits: int, group: int) -> torch.nn.Module:
    """transformers' model of `model_dir` with every linear toptpu quantizes (attention,
    the experts expert by expert, the shared expert and its gate; not the router, the
    embedding or lm_head) replaced by its dequantized round-to-nearest values."""
    from transformers import AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.layers.") or p.dim() < 2 or name.endswith(
                    "mlp.gate.weight"):
                continue
            w = p.detach().numpy()
            qw = quantize_rtn(w, bits, group, bits == 8, np.dtype(np.float32))
            flat = w.reshape(-1, w.shape[-1])
            deq = K.dequantize(qw.qweight.reshape(flat.shape[0], -1),
                               qw.scales.reshape(flat.shape[0], -1),
                               None if qw.zeros is None else qw.zeros.reshape(flat.shape[0], -1),
                               bits, qw.group_size)
            p.copy_(torch.from_numpy(deq.reshape(w.shape)))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [8, 4])
def test_tokens_equal_transformers_on_the_quantized_weights(tmp_path_factory, family: str,
                                                            bits: int) -> None:
    """w8f32 / w4f32 compute the quantized weights exactly in f32: a prompt of three
    prefill chunks and 32 decode steps on the machine give the greedy tokens of
    transformers' `generate` on the same model whose quantized linears (the experts
    among them) hold their dequantized values; the interpreter's logits are the
    machine's, bit for bit."""
    from toptpu.backend.runtime.runtime import Runtime

    model_dir, path = _compiled(tmp_path_factory, family, f"w{bits}f32")
    rt = Runtime.open(path, "machine")
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L and len(ids) % rt.L  # the last chunk has padded rows
    model = _fake_quantized(model_dir, bits, 32 if bits == 4 else -1)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=32,
                              do_sample=False)[0, len(ids):].tolist()
    got = rt.generate(ids, 32).generated_ids
    assert got == want
    _experts_fetched_by_index(rt, {"qweight", "scales"} | ({"zeros"} if bits == 4 else set()))
    interp = Runtime.open(path, "interpreter")
    a, b = rt.prompt_logits(ids), interp.prompt_logits(ids)
    assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [("qwen3_moe", "w4bf16"), ("qwen2_moe", "w8bf16"),
                                         ("qwen2_moe", "w4f16")])
def test_every_net_meets_its_threshold_against_top(tmp_path_factory, family: str,
                                                   mode: str) -> None:
    """As the dense quantized models (tests/test_llm_quant.py): every net's outputs from
    the model file (layers 0 and 1, layer 1's experts quantized by the recipes) against
    the Top f32 nets, at the suite's thresholds (cos >= 0.99 w8, >= 0.98 w4)."""
    from test_llm_quant import SEQ, L, _inputs, _layer_store

    from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
    from toptpu.compare import tpu_threshold
    from toptpu.compiler import compile as compile_model
    from toptpu.metrics import similarity

    out = tmp_path_factory.mktemp("moe-quant") / f"{family}-{mode}.toptpu"
    result = compile_model(tiny_dir(tmp_path_factory, family), str(out), mode=mode,
                           seq_length=SEQ, max_input_length=L, max_history=16,
                           progress=None, keep_modules=True,
                           **({"group_size": 32} if mode[1] == "4" else {}))
    ex = InterpreterExecutor(result.path)
    vocab = result.header["model"]["vocab_size"]
    rng = np.random.default_rng(0)
    threshold = tpu_threshold(mode)
    checked = []
    for name, net in result.nets.items():
        if not net.per_layer:
            continue
        info = ex.nets()[name]
        feeds = _inputs(name, info.inputs, rng, vocab)
        for layer in (0, 1):
            assert net.top is not None
            ref = Interpreter(net.top, store=_layer_store(result, layer)).run(feeds).outputs
            bufs = {s.name: ex.alloc(s.shape, s.dtype) for s in (*info.inputs, *info.outputs)}
            for s in info.inputs:
                ex.write(bufs[s.name], feeds[s.name])
            ex.run(name, bufs, layer=layer)
            for s in info.outputs:
                got = ex.read(bufs[s.name]).astype(np.float32)
                cos = similarity(got, ref[s.name].astype(np.float32)).cosine
                assert cos >= threshold, f"{family} {mode} {name}[{layer}] {s.name}: {cos}"
                checked.append((name, layer, s.name))
    assert ("block_cache", 1, "present_k") in checked and ("block", 1, "present_v") in checked


# --------------------------------------------------------------------------- auto-round


@pytest.fixture(scope="module")
def autoround_moe(tmp_path_factory) -> dict:
    """The MoE checkpoints auto-round writes (tests/moe_checkpoints.py), once a session."""
    from pathlib import Path

    from moe_checkpoints import make

    return make(Path(shared_dir(tmp_path_factory)) / "autoround_moe")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_autoround_moe_checkpoint(tmp_path_factory, autoround_moe: dict, family: str) -> None:
    """A MoE checkpoint auto-round wrote (one GPTQ-packed linear per expert, the router
    float): the stacked experts toptpu reads dequantize to the fake-quantized reference's
    experts bit for bit; `-q auto` (w4f16, the checkpoint's f16) and `w4f32` compiles give
    the reference's 16 greedy tokens on the machine, logits close (cos >= 0.99), the
    interpreter's logits bit for bit; transformers with auto-round's own loader (its
    QuantLinear kernels) gives the same tokens."""
    from transformers import AutoModelForCausalLM

    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.quant import read_quantized_checkpoint
    from toptpu.metrics import similarity

    packed, fake = (autoround_moe["runs"][family][k] for k in ("packed", "fake"))
    with quiet_transformers():
        ref = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32).eval()
    ck = read_quantized_checkpoint(packed)
    assert "model.layers.1.mlp.experts.7.down_proj" in ck.layouts
    assert "model.layers.1.mlp.gate" not in ck.layouts  # the router stays float
    for layer in (0, 1):
        experts = ref.model.layers[layer].mlp.experts
        gate_up = experts.gate_up_proj.detach().numpy()
        inter = gate_up.shape[1] // 2
        want = {"gate_proj": gate_up[:, :inter], "up_proj": gate_up[:, inter:],
                "down_proj": experts.down_proj.detach().numpy()}
        for proj, w in want.items():
            stacked = ck.stacked_experts(f"model.layers.{layer}.mlp.experts.{proj}")
            assert stacked is not None and stacked.qweight.shape[0] == 8
            parts = checkpoint_parts(stacked.qweight, stacked.scales, stacked.zeros, None, 4,
                                     32)  # as the lowering packs them
            deq = np.stack([K.dequantize(parts["qweight"][e], parts["scales"][e],
                                         parts["zeros"][e], 4, 32) for e in range(8)])
            assert np.array_equal(deq, w), (layer, proj)
    ids = list(range(3, 42))  # three prefill chunks of 16, the last padded
    with torch.no_grad():
        want_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(ids):].tolist()
        want_logits = ref(torch.tensor([ids])).logits[0, -1].numpy()
    for mode in ("auto", "w4f32"):
        path = os.path.join(shared_dir(tmp_path_factory), f"autoround-{family}-{mode}.toptpu")
        compile_model(packed, path, mode=mode, seq_length=160, max_input_length=16,
                      progress=None)
        rt = Runtime.open(path, "machine")
        assert rt.generate(ids, 16, stop_on_eos=False).generated_ids == want_tokens, mode
        _experts_fetched_by_index(rt, {"qweight", "scales", "zeros"})
        logits = rt.prompt_logits(ids)
        got = np.asarray(logits, np.float32).reshape(-1)
        assert similarity(got, want_logits).cosine >= 0.99, mode
        other = Runtime.open(path, "interpreter").prompt_logits(ids)
        assert np.array_equal(np.asarray(logits), np.asarray(other)), mode
    with quiet_transformers():
        loaded = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = loaded.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None)[0, len(ids):].tolist()
    assert theirs == want_tokens


# --------------------------------------------------------------------------- GGUF


def _gguf_reference(model_dir: str, family: str) -> torch.nn.Module:
    """transformers' own GGUF loader on the file (it dequantizes every tensor with
    `gguf.quants.dequantize`). Its GGUF config mapping does not read the experts' width
    (`expert_feed_forward_length`, `expert_shared_feed_forward_length`) and would build
    experts of its default width: the config is completed from the file's metadata, as
    toptpu's loader completes it."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from toptpu.frontends.hf_loader import quiet_transformers

    path = os.path.join(model_dir, "model.gguf")
    fields = gguf.GGUFReader(path).fields
    arch = "qwen2moe" if family == "qwen2_moe" else "qwen3moe"

    def meta(key: str) -> int:
        return int(fields[f"{arch}.{key}"].contents())

    with quiet_transformers():
        cfg = AutoConfig.from_pretrained(model_dir, gguf_file="model.gguf")
        cfg.moe_intermediate_size = meta("expert_feed_forward_length")
        if arch == "qwen2moe":
            cfg.shared_expert_intermediate_size = meta("expert_shared_feed_forward_length")
        return AutoModelForCausalLM.from_pretrained(model_dir, gguf_file="model.gguf",
                                                    config=cfg, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family,qtype,mode", [
    ("qwen3_moe", "Q8_0", "w8f32"), ("qwen3_moe", "Q4_0", "w4f32"),
    ("qwen3_moe", "Q4_1", "w4f32"), ("qwen2_moe", "Q8_0", "auto"),
    ("qwen2_moe", "Q5_0", "w8f32")])
def test_gguf_moe_file(tmp_path, family: str, qtype: str, mode: str) -> None:
    """A qwen3moe / qwen2moe GGUF file the `gguf` package writes (llama.cpp's tensor names:
    `ffn_gate_exps` [E, I, H] ... 3-D, `ffn_gate_inp` the router in F32, the shared
    expert's `ffn_*_shexp` and `ffn_gate_inp_shexp`): the experts are taken exactly
    (their integers and scales, zero points or mins, in `tpu.a16_moe_experts`: the
    dequantized stack equals `gguf.quants.dequantize` bit for bit) and the compiled model
    gives the 16 greedy tokens of transformers' own GGUF loader, machine == interpreter."""
    from gguf_fixtures import gguf_dir

    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.gguf_loader import load_gguf

    d = gguf_dir(str(tmp_path / "gguf"), family, qtype)
    loaded = load_gguf(d)
    ck = loaded.checkpoint
    assert ck is not None and loaded.stream is not None
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        stacked = ck.stacked_experts(name)
        assert stacked is not None and stacked.qweight.ndim == 3
        parts = checkpoint_parts(stacked.qweight, stacked.scales, stacked.zeros, None,
                                 stacked.bits, stacked.group_size, name, stacked.mins)
        deq = np.stack([K.dequantize(parts["qweight"][e], parts["scales"][e],
                                     parts["zeros"][e] if "zeros" in parts else None,
                                     stacked.bits, stacked.group_size,
                                     parts["mins"][e] if "mins" in parts else None)
                        for e in range(stacked.qweight.shape[0])])
        assert np.array_equal(deq, loaded.stream.reader.tensor(name)), proj
    loaded.stream.reader.close()
    ref = _gguf_reference(d, family)
    ids = list(range(3, 42))
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                            eos_token_id=None)[0, len(ids):].tolist()
    path = str(tmp_path / "m.toptpu")
    compile_model(d, path, mode=mode, seq_length=160, max_input_length=16, progress=None)
    rt = Runtime.open(path, "machine")
    assert rt.generate(ids, 16, stop_on_eos=False).generated_ids == want
    # the file's zero points (Q8_0's 128, Q4_0's 8, Q5_0's 16) or Q4_1's mins
    _experts_fetched_by_index(rt, {"qweight", "scales", "mins" if qtype == "Q4_1" else "zeros"})
    a = rt.prompt_logits(ids)
    b = Runtime.open(path, "interpreter").prompt_logits(ids)
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("metadata,message", [
    ({"qwen3moe.expert_feed_forward_length": (None, None, None)},
     "'qwen3moe.expert_feed_forward_length' is missing"),
    ({"qwen3moe.expert_count": (0, "UINT32", None)},
     "'qwen3moe.expert_count' is the int 0, a positive integer expected"),
    ({"qwen3moe.expert_used_count": (9, "UINT32", None)},
     "'qwen3moe.expert_used_count' \\(9\\) is more than its 8 experts"),
])
def test_gguf_moe_metadata_is_checked(tmp_path, metadata: dict, message: str) -> None:
    import gguf
    from gguf_fixtures import write_gguf

    from toptpu.frontends.gguf_loader import GGUFError, load_gguf

    typed = {k: (v, None if t is None else gguf.GGUFValueType[t], s)
             for k, (v, t, s) in metadata.items()}
    path = write_gguf(str(tmp_path / "m.gguf"), "qwen3_moe", "Q8_0", metadata=typed)
    with pytest.raises(GGUFError, match=message):
        load_gguf(path, need_tokenizer=False)


@pytest.mark.slow
def test_published_widths_w4f32_tokens_equal_transformers_on_the_dequantized_weights(
        tmp_path_factory) -> None:
    """Qwen3-30B-A3B's widths (16 of its 128 experts of 768, top-8, 2 layers): the w4
    experts (group 64) do not fit local memory, layer-group cuts their intermediate axis
    in reduction parts of whole groups, each part's loads fetched by index; 32 greedy
    tokens on the machine equal transformers' on the dequantized weights."""
    _published_widths_tokens(tmp_path_factory, 4)


@pytest.mark.slow
def test_published_widths_w8f32_tokens_equal_transformers_on_the_dequantized_weights(
        tmp_path_factory) -> None:
    """The same at 8 bits per channel: down's scales (one group over I) whole in each
    reduction part, every part's loads fetched by index."""
    _published_widths_tokens(tmp_path_factory, 8)


def _published_widths_tokens(tmp_path_factory, bits: int) -> None:
    """32 greedy tokens of Qwen3-30B-A3B's widths compiled w{bits}f32 (group 64 at 4 bits,
    per channel at 8) on the machine == transformers' on the dequantized weights."""
    from filelock import FileLock
    from test_moe import _real_dir

    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model_dir = _real_dir(tmp_path_factory, "qwen3_moe")
    path = os.path.join(shared_dir(tmp_path_factory), f"qwen3_moe-real-w{bits}f32.toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode=f"w{bits}f32", seq_length=160,
                          max_input_length=16, progress=None)
    rt = Runtime.open(path, "machine")
    _experts_fetched_by_index(rt, {"qweight", "scales"} | ({"zeros"} if bits == 4 else set()))
    ids = rt.encode(LONG_PROMPT)
    got = rt.generate(ids, 32, stop_on_eos=False).generated_ids
    model = _fake_quantized(model_dir, bits, 64 if bits == 4 else -1)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert got == want
