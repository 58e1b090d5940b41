"""Typed op constructors (`top.MatMulOp(x, w, transpose_b=True)`): each builds the op the
generic form (`build(operands, attributes)`) builds, a Tpu op takes its Top counterpart's
constructor, and a value of the wrong kind is refused naming the attribute."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerType, ModuleOp, Signedness, f32, i32
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import top, tpu
from toptpu.dialects.common import (
    ComparePredicate,
    GeluApproximation,
    ReduceMode,
    RopeMode,
    bool_attr,
    dense_attr,
    f64_attr,
    i64_array,
    i64_attr,
    str_attr,
    tensor,
)
from toptpu.dialects.ir_text import parse_ir

X = tensor([2, 4, 8], f32)       # activations
W = tensor([6, 8], f32)          # a linear weight [N, K]
Q = tensor([1, 3, 4, 8], f32)    # attention q/k/v [B, S, H, D]
IMG = tensor([1, 3, 6, 6], f32)  # an image [N, C, H, W]


def _args() -> dict[str, SSAValue]:
    types = {"x": X, "y": X, "w": W, "b": tensor([6], f32), "g": tensor([8], f32),
             "c": X,
             "q": Q, "k": Q, "v": Q, "img": IMG, "cw": tensor([5, 3, 3, 3], f32),
             "idx": tensor([2, 3], i32)}
    block = Block(arg_types=list(types.values()))
    return dict(zip(types, block.args, strict=True))


#: (typed constructor, the same op in the generic form) over the arguments of `_args`
Case = tuple[Callable[[dict[str, SSAValue]], Operation], Callable[[dict[str, SSAValue]],
                                                                 Operation]]
CASES: dict[str, Case] = {
    "constant": (lambda a: top.ConstantOp(np.arange(3, dtype=np.float32)),
                 lambda a: top.ConstantOp.build([], {"value": dense_attr(
                     np.arange(3, dtype=np.float32))})),
    "silu": (lambda a: top.SiluOp(a["x"]), lambda a: top.SiluOp.build([a["x"]])),
    "gelu": (lambda a: top.GeluOp(a["x"], GeluApproximation.TANH),
             lambda a: top.GeluOp.build([a["x"]], {"approximate": str_attr("tanh")})),
    "pow": (lambda a: top.PowOp(a["x"], 2),
            lambda a: top.PowOp.build([a["x"]], {"exponent": f64_attr(2.0)})),
    "sub_const": (lambda a: top.SubConstOp(a["x"], 1.5, reverse=True),
                  lambda a: top.SubConstOp.build([a["x"]], {"value": f64_attr(1.5),
                                                            "reverse": bool_attr(True)})),
    "mul_const": (lambda a: top.MulConstOp(a["x"], np.float32(-1.0)),
                  lambda a: top.MulConstOp.build([a["x"]], {"value": f64_attr(-1.0)})),
    "add": (lambda a: top.AddOp(a["x"], a["y"]), lambda a: top.AddOp.build([a["x"], a["y"]])),
    "compare": (lambda a: top.CompareOp(a["x"], a["y"], ComparePredicate.LT),
                lambda a: top.CompareOp.build([a["x"], a["y"]], {"predicate": str_attr("lt")})),
    "where": (lambda a: top.WhereOp(a["c"], a["x"], a["y"]),
              lambda a: top.WhereOp.build([a["c"], a["x"], a["y"]])),
    "cast": (lambda a: top.CastOp(a["x"], i32),
             lambda a: top.CastOp.build([a["x"]], {"dtype": i32})),
    "softmax": (lambda a: top.SoftmaxOp(a["x"], -1),
                lambda a: top.SoftmaxOp.build([a["x"]], {"axis": i64_attr(-1)})),
    "reduce": (lambda a: top.ReduceOp(a["x"], ReduceMode.MEAN, [2], True),
               lambda a: top.ReduceOp.build([a["x"]], {"mode": str_attr("mean"),
                                                      "axes": i64_array([2]),
                                                      "keepdims": bool_attr(True)})),
    "rms_norm": (lambda a: top.RmsNormOp(a["x"], a["g"], 1e-6),
                 lambda a: top.RmsNormOp.build([a["x"], a["g"]], {"eps": f64_attr(1e-6)})),
    "layer_norm": (lambda a: top.LayerNormOp(a["x"], a["g"], None, eps=1e-5, axis=2),
                   lambda a: top.LayerNormOp.build([a["x"], a["g"], None],
                                                   {"eps": f64_attr(1e-5),
                                                    "axis": i64_attr(2)})),
    "rope": (lambda a: top.RopeOp(a["x"], a["y"], a["y"], RopeMode.HALF),
             lambda a: top.RopeOp.build([a["x"], a["y"], a["y"]], {"mode": str_attr("half")})),
    "attention": (lambda a: top.AttentionOp(a["q"], a["k"], a["v"], scale=0.25, q_heads=4,
                                            kv_heads=4, head_dim=8, causal=True),
                  lambda a: top.AttentionOp.build(
                      [a["q"], a["k"], a["v"], None, None, None],
                      {"scale": f64_attr(0.25), "q_heads": i64_attr(4), "kv_heads": i64_attr(4),
                       "head_dim": i64_attr(8), "causal": bool_attr(True)})),
    "matmul": (lambda a: top.MatMulOp(a["x"], a["w"], a["b"], transpose_b=True),
               lambda a: top.MatMulOp.build([a["x"], a["w"], a["b"]],
                                            {"transpose_b": bool_attr(True)})),
    "gather": (lambda a: top.GatherOp(a["w"], a["idx"], 0),
               lambda a: top.GatherOp.build([a["w"], a["idx"]], {"axis": i64_attr(0)})),
    "topk": (lambda a: top.TopKOp(a["x"], 3, 2, largest=False),
             lambda a: top.TopKOp.build([a["x"]], {"k": i64_attr(3), "axis": i64_attr(2),
                                                   "largest": bool_attr(False)})),
    "conv2d": (lambda a: top.Conv2dOp(a["img"], a["cw"], None, strides=[1, 1],
                                      pads=[1, 1, 1, 1], dilations=[1, 1], groups=1),
               lambda a: top.Conv2dOp.build([a["img"], a["cw"], None],
                                            {"strides": i64_array([1, 1]),
                                             "pads": i64_array([1, 1, 1, 1]),
                                             "dilations": i64_array([1, 1]),
                                             "groups": i64_attr(1)})),
    "reshape": (lambda a: top.ReshapeOp(a["x"], (8, 8)),
                lambda a: top.ReshapeOp.build([a["x"]], {"shape": i64_array([8, 8])})),
    "permute": (lambda a: top.PermuteOp(a["x"], [0, 2, 1]),
                lambda a: top.PermuteOp.build([a["x"]], {"order": i64_array([0, 2, 1])})),
    "expand": (lambda a: top.ExpandOp(a["g"], [3, 8]),
               lambda a: top.ExpandOp.build([a["g"]], {"shape": i64_array([3, 8])})),
    "concat": (lambda a: top.ConcatOp([a["x"], a["y"]], 1),
               lambda a: top.ConcatOp.build([[a["x"], a["y"]]], {"axis": i64_attr(1)})),
    "slice": (lambda a: top.SliceOp(a["x"], 2, 0, 8, 2),
              lambda a: top.SliceOp.build([a["x"]], {"axis": i64_attr(2), "start": i64_attr(0),
                                                    "end": i64_attr(8), "step": i64_attr(2)})),
}


@pytest.mark.parametrize("case", CASES)
def test_a_typed_constructor_builds_the_generic_op(case: str) -> None:
    typed, generic = CASES[case]
    args = _args()
    a, b = typed(args), generic(args)
    a.verify()
    assert type(a) is type(b)
    assert str(a) == str(b)


def test_a_tpu_op_takes_its_top_counterpart_s_constructor() -> None:
    args = _args()
    for top_op, tpu_op in ((top.MatMulOp, tpu.MatMulOp), (top.SiluOp, tpu.SiluOp)):
        operands = [args["x"], args["w"]] if top_op is top.MatMulOp else [args["x"]]
        kw = {"transpose_b": True} if top_op is top.MatMulOp else {}
        a, b = top_op(*operands, **kw), tpu_op(*operands, **kw)
        assert isinstance(b, tpu_op)
        assert str(b) == str(a).replace(top_op.name, tpu_op.name)


def test_a_weight_is_built_by_name_and_type() -> None:
    op = top.WeightOp("model.w", W)
    assert op.tensor_name == "model.w" and op.output.type == W
    with pytest.raises(TypeError, match="a top.weight names its tensor"):
        top.WeightOp("", W)


@pytest.mark.parametrize("build, error, message", [
    (lambda a: top.GeluOp(a["x"], "fast"), ValueError,  # type: ignore[arg-type]
     "unknown gelu approximation 'fast'; expected one of none, tanh"),
    (lambda a: top.CompareOp(a["x"], a["y"], "less"), ValueError,  # type: ignore[arg-type]
     "unknown compare predicate 'less'; expected one of eq, ne, lt, le, gt, ge"),
    (lambda a: top.ReduceOp(a["x"], "avg", [0], False), ValueError,  # type: ignore[arg-type]
     "unknown reduce mode 'avg'"),
    (lambda a: top.ReduceOp(a["x"], ReduceMode.SUM, [0], 1), TypeError,  # type: ignore[arg-type]
     "top.reduce keepdims must be a bool, not 1"),
    (lambda a: top.RopeOp(a["x"], a["y"], a["y"], "spiral"), ValueError,  # type: ignore[arg-type]
     "unknown rope mode 'spiral'"),
    (lambda a: top.SliceOp(a["x"], 1.5, 0, 2), TypeError,  # type: ignore[arg-type]
     "top.slice axis must be an integer, not 1.5"),
    (lambda a: top.ReshapeOp(a["x"], [8, 8.0]), TypeError,  # type: ignore[list-item]
     "top.reshape shape must be an integer, not 8.0"),
    (lambda a: top.PermuteOp(a["x"], "021"), TypeError,  # type: ignore[arg-type]
     "top.permute order must be a sequence of integers, not '021'"),
    (lambda a: top.MatMulOp(a["x"], a["w"], transpose_b="yes"), TypeError,  # type: ignore
     "top.matmul transpose_b must be a bool, not 'yes'"),
    (lambda a: top.SoftmaxOp(a["x"], True), TypeError,  # type: ignore[arg-type]
     "top.softmax axis must be an integer, not True"),
    (lambda a: top.PowOp(a["x"], "2"), TypeError,  # type: ignore[arg-type]
     "top.pow exponent must be a number, not '2'"),
    (lambda a: top.AttentionOp(a["q"], a["k"], a["v"], scale=0.25, q_heads=4, kv_heads=3,
                               head_dim=8), VerifyException, "kv_heads=3"),
    (lambda a: top.ReshapeOp(a["x"], [5, 5]), VerifyException,
     r"cannot reshape \[2, 4, 8\] to \[5, 5\]"),
])
def test_a_constructor_rejects_a_wrong_attribute_value(
        build: Callable[[dict[str, SSAValue]], Operation], error: type[Exception],
        message: str) -> None:
    with pytest.raises(error, match=message):
        build(_args())


def test_ops_with_typed_constructors_still_parse_and_clone() -> None:
    """The parser and `clone` create ops without calling `__init__`."""
    block = Block(arg_types=[X, W])
    x, w = block.args
    mm = top.MatMulOp(x, w, transpose_b=True)
    sm = top.SoftmaxOp(mm.output, -1)
    block.add_ops([mm, sm, func.ReturnOp(sm.output)])
    fn = func.FuncOp("f", ((X, W), (sm.output.type,)), Region(block))
    module = ModuleOp([fn])
    text = str(module)
    again = parse_ir(text, "test")
    assert str(again) == text
    assert str(module.clone()) == text


def test_a16_matmul_is_built_by_its_parameters() -> None:
    ui8 = IntegerType(8, Signedness.UNSIGNED)
    x, q, s = Block(arg_types=[tensor([2, 8], f32), tensor([6, 4], ui8),
                               tensor([6, 1], f32)]).args
    op = tpu.A16MatMulOp(x, q, s, None, None, weight_bits=4, group_size=8)
    op.verify()
    generic = tpu.A16MatMulOp.build([x, q, s, None, None, None], {
        "weight_bits": i64_attr(4), "group_size": i64_attr(8), "compute": f32})
    assert str(op) == str(generic)
    m = Block(arg_types=[tensor([6, 1], f32)]).args[0]
    with_mins = tpu.A16MatMulOp(x, q, s, None, None, weight_bits=4, group_size=8, mins=m)
    with_mins.verify()
    assert with_mins.mins is m and with_mins.zeros is None and with_mins.bias is None
    with pytest.raises(VerifyException, match="weight_bits must be 4 or 8, got 3"):
        tpu.A16MatMulOp(x, q, s, None, None, weight_bits=3, group_size=8)
    with pytest.raises(TypeError, match="tpu.a16_matmul group_size must be an integer"):
        tpu.A16MatMulOp(x, q, s, None, None, weight_bits=4, group_size=8.0)  # type: ignore
