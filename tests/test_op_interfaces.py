"""An op is one class: every Top and Tpu op answers the interfaces the passes dispatch
through (layer-group's slicing, convert-top-to-linalg's lowering, xDSL's canonicalize), by
its own answer or the interface's default, and a new elementwise op lowers to linalg with
nothing but its scalar body (no edit of passes/convert_top_to_linalg.py)."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, f32, i32
from xdsl.ir import Block, Region, SSAValue
from xdsl.irdl import irdl_op_definition
from xdsl.traits import HasCanonicalizationPatternsTrait
from xdsl.transforms.canonicalize import CanonicalizePass

from toptpu.dialects import context, top, tpu
from toptpu.dialects.common import ShapedOp, i64_array, i64_attr, tensor
from toptpu.dialects.linalg_builder import Body
from toptpu.dialects.linalg_interface import LinalgLowering
from toptpu.dialects.naming import name_dicts
from toptpu.dialects.slicing_interface import RowRule, SliceKind, SlicingInterface
from toptpu.dialects.weight_store import WeightStore, attach_store
from toptpu.passes.convert_top_to_linalg import ConvertTopToLinalgPass
from toptpu.passes.registry import all_passes

TOP_OPS = list(top.Top.operations)
TPU_OPS = list(tpu.Tpu.operations)


def _own(method: str, ops: list[type]) -> list[str]:
    """The names of the op classes that answer `method` themselves (not the default)."""
    default = getattr(SlicingInterface, method)
    return sorted(c.name for c in ops if getattr(c, method) is not default)


# --------------------------------------------------------------------------- slicing


def test_every_op_answers_the_slicing_interface() -> None:
    """Every Top and Tpu compute op is a SlicingInterface; which answer for themselves is
    the table layer-group plans with (rows: elementwise ops, norms, rope, matmuls,
    attention, gather, shape ops, reduce, softmax, topk; cols: the weight matmuls; heads:
    attention and linear attention; reduction parts: matmuls, attention and the MoE
    experts)."""
    assert all(issubclass(c, SlicingInterface) for c in TOP_OPS)
    assert [c.name for c in TPU_OPS if not issubclass(c, SlicingInterface)] == [
        "tpu.group", "tpu.yield"]  # structure, not compute
    unary = {"top." + c.op_kind() for c in top.UNARY_ELEMENTWISE}
    assert set(_own("row_rule", TOP_OPS)) == unary | {
        "top.add", "top.sub", "top.mul", "top.div", "top.max", "top.min", "top.add_const",
        "top.sub_const", "top.mul_const", "top.div_const", "top.gelu", "top.pow", "top.clamp",
        "top.compare", "top.where", "top.cast", "top.softmax", "top.reduce", "top.rms_norm",
        "top.layer_norm", "top.rope", "top.attention", "top.matmul", "top.gather",
        "top.topk", "top.reshape", "top.permute", "top.expand", "top.concat", "top.slice",
        "top.moe_route", "top.moe_experts"}
    assert {c.name for c in TOP_OPS if c.row_rule is SlicingInterface.row_rule} == {
        "top.weight", "top.constant", "top.scatter", "top.cumsum", "top.conv2d",
        "top.causal_conv1d", "top.gated_delta_rule"}
    assert _own("col_sliceable", TOP_OPS) == ["top.matmul"]
    assert _own("heads_count", TOP_OPS) == ["top.attention", "top.causal_conv1d",
                                            "top.gated_delta_rule"]
    assert _own("reduction_sliceable", TOP_OPS) == ["top.attention", "top.matmul",
                                                     "top.moe_experts"]
    assert _own("row_gather_table", TOP_OPS) == ["top.gather"]
    assert sorted(c.name for c in TOP_OPS if c.GLOBAL_SOURCE) == ["top.constant",
                                                                  "top.weight"]
    # the Tpu-only ops answer for themselves where they slice
    top_names = {c.op_kind() for c in TOP_OPS}
    tpu_only = [c for c in TPU_OPS if issubclass(c, ShapedOp) and c.op_kind() not in top_names]
    assert _own("row_rule", tpu_only) == ["tpu.a16_matmul", "tpu.a16_moe_experts",
                                          "tpu.attention_merge", "tpu.attention_part"]
    assert _own("reduction_sliceable", tpu_only) == ["tpu.a16_matmul", "tpu.a16_moe_experts",
                                                     "tpu.attention_part"]


def test_ops_answer_how_they_slice() -> None:
    """The answers of a weight matmul, a matmul of two activations, an elementwise op, an
    embedding gather, an attention and a reshape (the rules layer-group plans with)."""
    block = Block(arg_types=[tensor((1, 8, 64), f32), tensor((1, 8), i32),
                             tensor((1, 8, 4, 16), f32), tensor((1, 8, 2, 16), f32),
                             tensor((1, 1, 8, 8), f32)])
    x, ids, q, k, m = block.args
    w = top.WeightOp("w", tensor((32, 64), f32))
    emb = top.WeightOp("e", tensor((100, 64), f32))
    mm = top.MatMulOp(x, w.output, transpose_b=True)
    act_mm = top.MatMulOp(mm.output, mm.output, transpose_b=True)
    silu = top.SiluOp(mm.output)
    gather = top.GatherOp(emb.output, ids, 0)
    att = top.AttentionOp(q, k, k, m, scale=0.25, q_heads=4, kv_heads=2, head_dim=16)
    reshape = top.ReshapeOp(x, (8, 64))
    block.add_ops([w, emb, mm, act_mm, silu, gather, att, reshape])

    assert mm.row_rule(1) == RowRule((1, None), (1,)) and mm.row_rule(2) is None
    assert mm.col_sliceable() and not act_mm.col_sliceable()  # a weight [N, K], transposed
    assert mm.reduction_sliceable() and mm.reduction_count() == 64
    assert mm.reduction_operand_axes() == (2, 1) and mm.tile_loop() == SliceKind.COLS
    assert silu.row_rule(1) == RowRule((1,), (1,))
    assert gather.row_rule(1) == RowRule((None, 1), (1,))
    assert gather.row_gather_table() is emb.output
    assert att.heads_count() == 2 and att.HEADS_UNIT == "KV-head"
    assert att.heads_operand_axes() == (2, 2, 2, None)  # the mask has no head axis
    assert att.row_rule(1) == RowRule((1, None, None, 2), (1,))  # the mask by its rows
    assert att.tile_loop() == SliceKind.HEADS and att.reduction_count() == 8
    assert att.sliced_attributes([], heads=2) == {"q_heads": i64_attr(2),
                                                  "kv_heads": i64_attr(1)}
    assert reshape.row_rule(0) == RowRule((1,), (0,))
    assert reshape.sliced_attributes([tensor((4, 64), f32)]) == {"shape": i64_array([4, 64])}
    # the defaults: no slicing at all
    assert w.GLOBAL_SOURCE and w.row_rule(0) is None and not w.col_sliceable()
    assert w.heads_count() == 1 and not w.reduction_sliceable() and w.sliced_attributes([]) == {}


# --------------------------------------------------------------------------- linalg


def test_every_top_op_has_a_linalg_lowering_or_says_why_not() -> None:
    """Each Top op lowers itself (`lower_to_linalg`; an elementwise op through its scalar
    body, `linalg_scalar`) or names the reason it has no lowering of its own."""
    missing, both = [], []
    for cls in TOP_OPS:
        assert issubclass(cls, LinalgLowering)
        own = cls.lower_to_linalg is not LinalgLowering.lower_to_linalg
        for base in (top.UnaryOp, top.BinaryOp):
            if issubclass(cls, base) and cls.lower_to_linalg is base.lower_to_linalg:
                own = cls.linalg_scalar is not base.linalg_scalar or base is top.BinaryOp
        reason = cls.LINALG_NOT_LOWERED
        if not own and not reason:
            missing.append(cls.name)
        if own and reason:
            both.append(cls.name)
    assert not missing and not both, (missing, both)
    assert [c.name for c in TOP_OPS if c.LINALG_NOT_LOWERED] == ["top.weight"]
    assert "argument" in top.WeightOp.LINALG_NOT_LOWERED


@irdl_op_definition
class CubeOp(top.UnaryOp, top.TopOp):
    """x * x * x: an elementwise op added by declaring its scalar body only."""

    name = "top.test_cube"

    def linalg_scalar(self, b: Body, x: SSAValue) -> SSAValue:
        return b.mul(b.mul(x, x), x)


@irdl_op_definition
class HypotOp(top.BinaryOp, top.TopOp):
    """sqrt(x^2 + y^2): a binary elementwise op added by declaring its scalar body only."""

    name = "top.test_hypot"

    def linalg_scalar(self, b: Body, x: SSAValue, y: SSAValue) -> SSAValue:
        return b.math("sqrt", b.add(b.mul(x, x), b.mul(y, y)))


def _new_ops_module() -> ModuleOp:
    t = tensor((2, 3), f32)
    block = Block(arg_types=[t, tensor((3,), f32)])
    cube = CubeOp(block.args[0])
    hyp = HypotOp(cube.output, block.args[1])
    block.add_ops([cube, hyp, func.ReturnOp(hyp.output)])
    fn = func.FuncOp("main", ([t, tensor((3,), f32)], [t]), Region(block))
    fn.arg_attrs = name_dicts(["x", "y"])
    fn.res_attrs = name_dicts(["out"])
    m = ModuleOp([fn])
    attach_store(m, WeightStore())
    m.verify()
    return m


def test_a_new_elementwise_op_lowers_with_only_its_scalar_body() -> None:
    m = _new_ops_module()
    ConvertTopToLinalgPass().apply(context(), m)
    text = str(m)
    assert [op.name for op in m.walk() if op.name.startswith("top.")] == []
    generics = text.split("linalg.generic")[1:]
    assert len(generics) == 2
    assert generics[0].count("arith.mulf") == 2  # x * x * x
    assert "arith.addf" in generics[1] and "math.sqrt" in generics[1]  # y broadcast
    assert "affine_map<(d0, d1) -> (d1)>" in text


@pytest.mark.slow  # real MLIR compiles and runs the lowered function
def test_a_new_elementwise_op_runs_in_mlir() -> None:
    from toptpu.mlir_jit import MLIRJit

    m = _new_ops_module()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    y = rng.standard_normal(3).astype(np.float32)
    got = MLIRJit(m, WeightStore()).run({"x": x, "y": y}).outputs["out"]
    np.testing.assert_allclose(got, np.hypot(x * x * x, y), rtol=1e-6)


# --------------------------------------------------------------------------- canonicalization


def test_canonicalize_is_xdsls_and_runs_the_ops_patterns() -> None:
    """toptpu-opt's `canonicalize` is xDSL's own pass (not a toptpu pass of that name); it
    finds each op's patterns through the op class, a Top op and its Tpu twin alike."""
    assert all_passes()["canonicalize"] is CanonicalizePass
    assert "fold-constants" in all_passes()

    def patterns(cls: type) -> list[str]:
        return [type(p).__name__ for t in cls.get_traits_of_type(HasCanonicalizationPatternsTrait)
                for p in t.get_patterns(cls)]

    declared = {c.name: patterns(c) for c in TOP_OPS if patterns(c)}
    assert declared == {
        **{f"top.{k}_const": ["FoldIdentityScalarOp", "ComposeScalarMuls"]
           for k in ("add", "sub", "mul", "div")},
        "top.cast": ["FoldNoOpShapeOp"], "top.expand": ["FoldNoOpShapeOp"],
        "top.slice": ["FoldNoOpShapeOp"], "top.concat": ["FoldSingleConcat"],
        "top.clamp": ["ComposeClamps"],
        "top.reshape": ["FoldNoOpReshape", "ComposeReshapes"],
        "top.permute": ["FoldNoOpPermute", "ComposePermutes", "PermuteOfUnitAxesIsReshape"]}
    for name, pats in declared.items():
        twin = next(c for c in TPU_OPS if c.name == name.replace("top.", "tpu.", 1))
        assert patterns(twin) == pats
