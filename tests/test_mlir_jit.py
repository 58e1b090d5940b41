"""The MLIR oracle: Top lowered to linalg by convert-top-to-linalg, compiled by real MLIR
(bufferization, LLVM lowering, ExecutionEngine) and run beside torch and the numpy
interpreter (ARCHITECTURE.md, "Verification ladder")."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, bf16, f16, f32, i32, i64
from xdsl.ir import Block, Region, SSAValue

from helpers import run_tool
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.dialects import top
from toptpu.dialects.common import (
    bool_attr,
    dense_attr,
    f64_attr,
    i64_array,
    i64_attr,
    shape_of,
    str_attr,
    tensor,
)
from toptpu.dialects.naming import make_loc, name_dicts
from toptpu.dialects.weight_store import WeightStore, attach_store
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.metrics import similarity
from toptpu.mlir_jit import MLIRJit, MLIRJitError
from toptpu.passes.convert_top_to_linalg import ConvertTopToLinalgPass, LinalgLoweringError

pytestmark = pytest.mark.slow  # real MLIR compiles and runs decoder layers


class Fn:
    """A tiny builder of one-function Top modules (inputs, weights, named outputs)."""

    def __init__(self, **inputs: tuple[tuple[int, ...], object]) -> None:
        self.names = list(inputs)
        self.types = [tensor(s, t) for s, t in inputs.values()]
        self.block = Block(arg_types=self.types)
        self.args = dict(zip(self.names, self.block.args, strict=True))
        self.store = WeightStore()

    def op(self, cls: type, operands: list, attrs: dict | None = None) -> SSAValue:
        o = cls.build(operands, attrs or {})
        o.location = make_loc(f"{cls.name}.{len(self.block.ops)}")
        self.block.add_op(o)
        return o.results[0]

    def weight(self, name: str, arr: np.ndarray) -> SSAValue:
        from toptpu.dialects.common import element_type_of_numpy

        self.store[name] = arr
        o = top.WeightOp(name, tensor(arr.shape, element_type_of_numpy(arr.dtype)))
        self.block.add_op(o)
        return o.results[0]

    def module(self, outputs: dict[str, SSAValue]) -> ModuleOp:
        self.block.add_op(func.ReturnOp(*outputs.values()))
        fn = func.FuncOp("main", (self.types, [v.type for v in outputs.values()]),
                         Region(self.block))
        fn.arg_attrs = name_dicts(self.names)
        fn.res_attrs = name_dicts(list(outputs))
        m = ModuleOp([fn])
        attach_store(m, self.store)
        m.verify()
        return m


def _check_against_interpreter(module: ModuleOp, store: WeightStore, feeds: dict,
                               opt_level: int = 0) -> int:
    ref = Interpreter(module, store).run(feeds).outputs
    got = MLIRJit(module, store, opt_level=opt_level).run(feeds).outputs
    assert set(got) == set(ref)
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.dtype, r.dtype)
        if r.dtype == ml_dtypes.bfloat16:
            np.testing.assert_allclose(g.astype(np.float32), r.astype(np.float32),
                                       rtol=2e-2, atol=2e-2, err_msg=name)
        elif np.issubdtype(r.dtype, np.floating):
            np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(g, r, err_msg=name)
    return len(ref)


def test_every_lowered_op_matches_the_interpreter() -> None:
    rng = np.random.default_rng(0)
    f = Fn(x=((2, 3, 8), f32), y=((3, 8), f32), ids=((2, 3), i64), x4=((1, 3, 2, 8), f32),
           img=((1, 4, 6, 6), f32), sidx=((2, 3, 2), i64), upd=((2, 3, 2), f32))
    x, y, ids, x4, img = (f.args[n] for n in ("x", "y", "ids", "x4", "img"))
    out: dict[str, SSAValue] = {}
    out["scatter"] = f.op(top.ScatterOp, [x, f.args["sidx"], f.args["upd"]],
                          {"axis": i64_attr(2)})
    out["cumsum"] = f.op(top.CumSumOp, [x], {"axis": i64_attr(2)})
    pos = f.op(top.ExpOp, [x])
    for cls in top.UNARY_ELEMENTWISE:  # every one, as declared (rsqrt and sqrt of x > 0)
        out[cls.name] = f.op(cls, [pos if cls in (top.RsqrtOp, top.SqrtOp) else x])
    out["gelu"] = f.op(top.GeluOp, [x], {"approximate": str_attr("none")})
    out["gelu_tanh"] = f.op(top.GeluOp, [x], {"approximate": str_attr("tanh")})
    out["pow2"] = f.op(top.PowOp, [x], {"exponent": f64_attr(2.0)})
    out["pow3"] = f.op(top.PowOp, [pos], {"exponent": f64_attr(1.5)})
    out["clamp"] = f.op(top.ClampOp, [x], {"min": f64_attr(-0.5), "max": f64_attr(0.75)})
    out["int_clamp"] = f.op(top.ClampOp, [ids], {"max": f64_attr(4.0)})
    for cls in (top.AddConstOp, top.SubConstOp, top.MulConstOp, top.DivConstOp):
        out[cls.name] = f.op(cls, [x], {"value": f64_attr(0.75), "reverse": bool_attr(True)})
        out[cls.name + "_fwd"] = f.op(cls, [x], {"value": f64_attr(-1.5)})
    for cls in (top.AddOp, top.SubOp, top.MulOp, top.DivOp, top.MaxOp, top.MinOp):
        out[cls.name] = f.op(cls, [x, y])
    out["int_add"] = f.op(top.AddOp, [ids, ids])
    out["int_div"] = f.op(top.DivOp, [ids, f.op(top.ConstantOp, [], {
        "value": dense_attr(np.array([[2, 3, 4]], np.int64))})])
    cmp = f.op(top.CompareOp, [x, y], {"predicate": str_attr("gt")})
    out["compare"] = cmp
    out["where"] = f.op(top.WhereOp, [cmp, x, y])
    out["cast_f2i"] = f.op(top.CastOp, [f.op(top.MulConstOp, [x], {"value": f64_attr(10.0)})],
                           {"dtype": i32})
    out["cast_i2f"] = f.op(top.CastOp, [ids], {"dtype": f32})
    out["cast_bool"] = f.op(top.CastOp, [cmp], {"dtype": f32})
    xb = f.op(top.CastOp, [x], {"dtype": bf16})
    out["bf16_silu"] = f.op(top.SiluOp, [xb])
    out["bf16_add"] = f.op(top.AddOp, [xb, xb])
    out["f16_gelu"] = f.op(top.GeluOp, [f.op(top.CastOp, [x], {"dtype": f16})],
                           {"approximate": str_attr("none")})
    out["softmax"] = f.op(top.SoftmaxOp, [x], {"axis": i64_attr(1)})
    for mode, axes, keep in (("mean", [2], True), ("sum", [0, 2], False), ("max", [1], True),
                             ("min", [-1], False)):
        out[f"reduce_{mode}"] = f.op(top.ReduceOp, [x], {
            "mode": str_attr(mode), "axes": i64_array(axes), "keepdims": bool_attr(keep)})
    w8 = f.weight("w8", rng.standard_normal(8).astype(np.float32))
    b8 = f.weight("b8", rng.standard_normal(8).astype(np.float32))
    out["rms_norm"] = f.op(top.RmsNormOp, [x, w8], {"eps": f64_attr(1e-6)})
    out["rms_norm_bf16"] = f.op(top.RmsNormOp, [xb, w8], {"eps": f64_attr(1e-6)})
    out["rms_norm_plain"] = f.op(top.RmsNormOp, [x, None], {"eps": f64_attr(1e-6)})
    out["layer_norm"] = f.op(top.LayerNormOp, [x, w8, b8], {"eps": f64_attr(1e-5),
                                                            "axis": i64_attr(-1)})
    out["layer_norm_2axes"] = f.op(top.LayerNormOp, [x, None, None], {
        "eps": f64_attr(1e-5), "axis": i64_attr(1)})
    cs = f.weight("cos", rng.standard_normal((1, 3, 1, 8)).astype(np.float32))
    sn = f.weight("sin", rng.standard_normal((1, 3, 1, 8)).astype(np.float32))
    for mode in ("half", "interleaved"):
        out[f"rope_{mode}"] = f.op(top.RopeOp, [x4, cs, sn], {"mode": str_attr(mode)})
    q = f.weight("q", rng.standard_normal((1, 4, 4, 8)).astype(np.float32))
    k = f.weight("k", rng.standard_normal((1, 4, 2, 8)).astype(np.float32))
    v = f.weight("v", rng.standard_normal((1, 4, 2, 6)).astype(np.float32))
    hk = f.weight("hk", rng.standard_normal((1, 3, 2, 8)).astype(np.float32))
    hv = f.weight("hv", rng.standard_normal((1, 3, 2, 6)).astype(np.float32))
    mask = f.weight("mask", np.where(rng.random((1, 1, 4, 7)) < 0.3, -1e4, 0.0)
                    .astype(np.float32))
    row_mask = f.weight("row_mask", rng.standard_normal((4, 1)).astype(np.float32))
    att = {"scale": f64_attr(0.35), "q_heads": i64_attr(4), "kv_heads": i64_attr(2),
           "head_dim": i64_attr(8)}
    out["attention_history_mask"] = f.op(top.AttentionOp, [q, k, v, mask, hk, hv], att)
    out["attention_causal"] = f.op(top.AttentionOp, [q, k, v, None, None, None],
                                   {**att, "causal": bool_attr(True)})
    out["attention_causal_history"] = f.op(top.AttentionOp, [q, k, v, row_mask, hk, hv],
                                           {**att, "causal": bool_attr(True)})
    wt = f.weight("wt", rng.standard_normal((5, 8)).astype(np.float32))
    b5 = f.weight("b5", rng.standard_normal(5).astype(np.float32))
    out["linear"] = f.op(top.MatMulOp, [x, wt, b5], {"transpose_b": bool_attr(True)})
    bb = f.weight("bb", rng.standard_normal((2, 8, 4)).astype(np.float32))
    out["batch_matmul"] = f.op(top.MatMulOp, [x, bb, None])
    a_t = f.op(top.PermuteOp, [x], {"order": i64_array([0, 2, 1])})
    b84 = f.weight("b84", rng.standard_normal((8, 4)).astype(np.float32))
    out["matmul_ta"] = f.op(top.MatMulOp, [a_t, b84, None], {"transpose_a": bool_attr(True)})
    out["matmul_bf16"] = f.op(top.MatMulOp, [xb, f.op(top.CastOp, [wt], {"dtype": bf16}),
                                             None], {"transpose_b": bool_attr(True)})
    table = f.weight("table", rng.standard_normal((10, 8)).astype(np.float32))
    out["gather"] = f.op(top.GatherOp, [table, ids], {"axis": i64_attr(0)})
    idx = f.op(top.ConstantOp, [], {"value": dense_attr(np.array([7, 0, 3], np.int32))})
    out["gather_axis2"] = f.op(top.GatherOp, [x, idx], {"axis": i64_attr(2)})
    out["reshape"] = f.op(top.ReshapeOp, [x], {"shape": i64_array([6, 8])})
    out["reshape_flat"] = f.op(top.ReshapeOp, [x], {"shape": i64_array([48])})
    out["reshape_split"] = f.op(top.ReshapeOp, [x], {"shape": i64_array([2, 3, 2, 4])})
    out["permute"] = f.op(top.PermuteOp, [x], {"order": i64_array([2, 0, 1])})
    y1 = f.op(top.SliceOp, [y], {"axis": i64_attr(1), "start": i64_attr(2), "end": i64_attr(3),
                                 "step": i64_attr(1)})
    out["expand"] = f.op(top.ExpandOp, [y1], {"shape": i64_array([2, 3, 4])})
    out["slice_step"] = f.op(top.SliceOp, [x], {"axis": i64_attr(2), "start": i64_attr(1),
                                                "end": i64_attr(7), "step": i64_attr(2)})
    out["concat"] = f.op(top.ConcatOp, [[x, out["slice_step"], x]], {"axis": i64_attr(2)})
    out["concat0"] = f.op(top.ConcatOp, [[x, x]], {"axis": i64_attr(0)})
    cw = f.weight("cw", rng.standard_normal((4, 2, 3, 3)).astype(np.float32))
    cb = f.weight("cb", rng.standard_normal(4).astype(np.float32))
    out["conv2d"] = f.op(top.Conv2dOp, [img, cw, cb], {
        "strides": i64_array([2, 1]), "pads": i64_array([1, 0, 1, 2]),
        "dilations": i64_array([1, 2]), "groups": i64_attr(2)})
    c = f.op(top.ConstantOp, [], {"value": dense_attr(np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
                                                                 7.0, 8.0]], np.float32))})
    out["constant_add"] = f.op(top.AddOp, [x, c])
    # linear attention: the conv over state + input (with and without a state, f32 and
    # bf16 input with an f32 state, a chunk padded after 3 of 5 tokens and a full one),
    # the gated delta rule (GQA 2 key heads for 4 value heads, with and without a state)
    t, ch, taps = 5, 6, 4
    cx = f.weight("cx", rng.standard_normal((1, t, ch)).astype(np.float32))
    cstate = f.weight("cstate", rng.standard_normal((1, taps - 1, ch)).astype(np.float32))
    padded = f.weight("padded", (np.arange(t) < 3).astype(np.float32)[None])
    full = f.weight("full", np.ones((1, t), np.float32))
    cw = f.weight("conv_w", rng.standard_normal((ch, taps)).astype(np.float32))
    cx_bf16 = f.op(top.CastOp, [cx], {"dtype": bf16})
    for name, xin, state, valid in (("conv_state_padded", cx, cstate, padded),
                                    ("conv_zero_state_full", cx, None, full),
                                    ("conv_zero_state_padded", cx, None, padded),
                                    ("conv_bf16_f32_state", cx_bf16, cstate, padded)):
        conv = top.CausalConv1dOp(xin, cw, state, valid)
        f.block.add_op(conv)
        out[name], out[name + "_new_state"] = conv.results
    hk, hv, dk, dv = 2, 4, 3, 5
    rq, rk = (f.weight(n, rng.standard_normal((1, t, hk, dk)).astype(np.float32))
              for n in ("rq", "rk"))
    rv = f.weight("rv", rng.standard_normal((1, t, hv, dv)).astype(np.float32))
    rg = f.weight("rg", -rng.random((1, t, hv)).astype(np.float32))
    rbeta = f.weight("rbeta", rng.random((1, t, hv)).astype(np.float32))
    rstate = f.weight("rstate", rng.standard_normal((1, hv, dk, dv)).astype(np.float32))
    for name, state in (("delta_rule_state", rstate), ("delta_rule_zero_state", None)):
        rule = top.GatedDeltaRuleOp(rq, rk, rv, rg, rbeta, state, scale=0.4)
        f.block.add_op(rule)
        out[name], out[name + "_new_state"] = rule.results
    # mixture of experts: the router's top 2 of 5 (renormalized or not, a padded row
    # routed nowhere) and the experts on them (6 tokens, H 8, I 3)
    mx = f.weight("moe_x", rng.standard_normal((6, 8)).astype(np.float32))
    logits = f.weight("moe_logits", rng.standard_normal((6, 5)).astype(np.float32))
    moe_valid = f.weight("moe_valid", np.array([1, 1, 1, 1, 1, 0], np.float32))
    gate = f.weight("moe_gate", rng.standard_normal((5, 3, 8)).astype(np.float32))
    up = f.weight("moe_up", rng.standard_normal((5, 3, 8)).astype(np.float32))
    down = f.weight("moe_down", rng.standard_normal((5, 8, 3)).astype(np.float32))
    for name, valid, normalize in (("moe_norm_valid", moe_valid, True),
                                   ("moe_plain", None, False)):
        route = top.MoeRouteOp(logits, valid, k=2, normalize=normalize)
        f.block.add_op(route)
        experts = top.MoeExpertsOp(mx, gate, up, down, route.weights, route.indices)
        f.block.add_op(experts)
        out[name + "_weights"], out[name + "_indices"] = route.results
        out[name] = experts.output
    for largest in (True, False):  # topk with k = 1: argmax / argmin, ties to the lowest
        tk = top.TopKOp.build([f.op(top.MulConstOp, [x], {"value": f64_attr(3.0)})],
                              {"k": i64_attr(1), "axis": i64_attr(1),
                               "largest": bool_attr(largest)})
        f.block.add_op(tk)
        out[f"top1_{largest}_values"], out[f"top1_{largest}_indices"] = tk.results
    module = f.module(out)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32),
             "y": rng.standard_normal((3, 8)).astype(np.float32),
             "ids": rng.integers(0, 10, (2, 3)).astype(np.int64),
             "x4": rng.standard_normal((1, 3, 2, 8)).astype(np.float32),
             "img": rng.standard_normal((1, 4, 6, 6)).astype(np.float32),
             # distinct positions per row: which of two updates to one position lands is
             # left open (torch.scatter)
             "sidx": np.stack([rng.permutation(8)[:2] for _ in range(6)]).reshape(2, 3, 2),
             "upd": rng.standard_normal((2, 3, 2)).astype(np.float32)}
    assert _check_against_interpreter(module, f.store, feeds) == len(out)
    names = {op.name for op in module.walk()}
    assert names >= {cls.name for cls in top.Top.operations}


def test_the_delta_rule_leaves_its_state_argument_alone() -> None:
    """The lowered recurrence updates a state of its own: the caller's state array is not
    written (one-shot bufferization makes function arguments writable), so a second run
    on the same inputs gives the same outputs."""
    rng = np.random.default_rng(1)
    f = Fn(q=((1, 3, 1, 4), f32), k=((1, 3, 1, 4), f32), v=((1, 3, 2, 4), f32),
           g=((1, 3, 2), f32), beta=((1, 3, 2), f32), state=((1, 2, 4, 4), f32))
    a = f.args
    rule = top.GatedDeltaRuleOp(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"],
                                scale=0.5)
    f.block.add_op(rule)
    m = f.module({"o": rule.output, "new_state": rule.new_state})
    feeds = {n: rng.standard_normal(shape_of(v)).astype(np.float32) for n, v in a.items()}
    feeds["g"] = -np.abs(feeds["g"])
    kept = {n: x.copy() for n, x in feeds.items()}
    jit = MLIRJit(m, f.store, opt_level=0)
    first = jit.run(feeds).outputs
    assert all(np.array_equal(feeds[n], kept[n]) for n in feeds)
    second = jit.run(feeds).outputs
    assert all(np.array_equal(first[n], second[n]) for n in first)
    assert not np.array_equal(first["new_state"], feeds["state"])


# --------------------------------------------------------------------------- decoder layers

_LAYERS: dict[str, tuple[ModuleOp, dict[str, np.ndarray], np.ndarray]] = {}


def _layer(tiny_models, family: str
           ) -> tuple[ModuleOp, WeightStore, dict[str, np.ndarray], np.ndarray]:
    """A tiny decoder layer after top-pipeline, its inputs and torch's output."""
    if family not in _LAYERS:
        imp = import_decoder_layer(tiny_models(family), 8)
        _LAYERS[family] = (imp.module, imp.store, imp.feeds, imp.reference)
    return _LAYERS[family]


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_jit_decoder_layer_matches_torch(tiny_models, family: str) -> None:
    module, store, feeds, ref = _layer(tiny_models, family)
    jit = MLIRJit(module, store)
    got = jit.run(feeds)["out"]
    assert similarity(got, ref).cosine >= 0.99999
    numpy_out = Interpreter(module, store).run(feeds)["out"]
    assert similarity(got, numpy_out).cosine >= 0.99999
    # a second call reuses the compiled code and the fed weights
    assert np.array_equal(jit.run(feeds)["out"], got)
    if family == "qwen2":  # reassociated sums (vectorized reductions) stay within the bar
        fast = MLIRJit(module, store, fast_math=True).run(feeds)["out"]
        assert similarity(fast, ref).cosine >= 0.99999


def test_the_oracle_names_a_broken_numpy_kernel(tiny_models, monkeypatch) -> None:
    """Compare every intermediate tensor of the numpy interpreter with the MLIR-compiled
    ones: a kernel that goes wrong (here rope, off by 0.5) is the first tensor named."""
    from toptpu.backend.reference import interpreter
    from toptpu.compare import IRStage, MLIRStage, compare_stages

    module, store, feeds, _ = _layer(tiny_models, "qwen2")
    good = interpreter.EVALUATORS[top.RopeOp]
    monkeypatch.setitem(interpreter.EVALUATORS, top.RopeOp,
                        lambda op, args, ctx: [good(op, args, ctx)[0] + 0.5])
    rep = compare_stages(MLIRStage("mlir", module, store), IRStage("top", module, store), feeds,
                         0.99999, compare_all=True)
    drop = rep.first_drop
    assert drop is not None and drop.name == "layer.self_attn.add_1", rep.table()
    assert {r.name for r in rep.tensors} >= {"layer.self_attn.scaled_dot_product_attention",
                                              "layer.mlp.act_fn.silu"}


# --------------------------------------------------------------------------- bad input


def test_topk_beyond_argmax_is_refused_with_the_op_named() -> None:
    f = Fn(x=((2, 8), f32))
    v = f.op(top.TopKOp, [f.args["x"]], {"k": i64_attr(2), "axis": i64_attr(1)})
    m = f.module({"v": v})
    with pytest.raises(LinalgLoweringError, match=r"'top.topk' \(top.topk.0\).*k = 2"):
        ConvertTopToLinalgPass().apply(None, m)  # type: ignore[arg-type]


def test_unsigned_types_are_refused() -> None:
    from toptpu.dialects.common import ui8

    f = Fn(x=((2, 8), ui8))
    m = f.module({"y": f.op(top.CastOp, [f.args["x"]], {"dtype": f32})})
    with pytest.raises(LinalgLoweringError, match="ui8.*signless"):
        MLIRJit(m)


def test_jit_checks_its_inputs() -> None:
    f = Fn(x=((2, 8), f32))
    jit = MLIRJit(f.module({"y": f.op(top.SiluOp, [f.args["x"]])}), opt_level=0)
    with pytest.raises(ValueError, match="missing \\['x'\\]"):
        jit.run({"z": np.zeros((2, 8), np.float32)})
    with pytest.raises(ValueError, match="shape \\[2, 7\\]"):
        jit.run({"x": np.zeros((2, 7), np.float32)})
    with pytest.raises(MLIRJitError, match="@other"):
        jit.run({"x": np.zeros((2, 8), np.float32)}, func_name="other")


def test_gather_out_of_range_reads_nan_not_a_neighbour() -> None:
    f = Fn(ids=((3,), i32))
    t = f.weight("t", np.arange(8, dtype=np.float32).reshape(4, 2))
    m = f.module({"g": f.op(top.GatherOp, [t, f.args["ids"]], {"axis": i64_attr(0)})})
    got = MLIRJit(m, f.store, opt_level=0).run({"ids": np.array([1, 4, -1], np.int32)})["g"]
    assert np.array_equal(got[0], [2.0, 3.0]) and np.isnan(got[1:]).all()


# --------------------------------------------------------------------------- the shell


def test_compare_with_the_mlir_oracle_from_the_shell() -> None:
    res = run_tool("toptpu", "compare", "--oracle", "mlir", "--stages", "torch,top",
                   "--seq", "8", "--compare-all")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mlir vs torch" in res.stdout and "top vs mlir" in res.stdout
    assert res.stdout.count("PASS") == 2
    top_vs_mlir = res.stdout.split("top vs mlir")[1]
    assert "layer.self_attn.scaled_dot_product_attention" in top_vs_mlir
    assert "first tensor below threshold: none" in top_vs_mlir
