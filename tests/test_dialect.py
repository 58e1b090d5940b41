"""Top dialect: verifiers, shape inference and FLOP counts."""

from __future__ import annotations

import pytest
from xdsl.dialects.builtin import f32, i32
from xdsl.ir import Block
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import top
from toptpu.dialects.common import f64_attr, i64_array, i64_attr, str_attr, tensor


def _args(*types):
    return Block(arg_types=list(types)).args


def test_matmul_shape_and_flops() -> None:
    x, w = _args(tensor([2, 8, 64], f32), tensor([32, 64], f32))
    from toptpu.dialects.common import bool_attr

    op = top.MatMulOp.build([x, w, None], {"transpose_b": bool_attr(True)})
    assert op.output.type == tensor([2, 8, 32], f32)
    assert op.flops() == 2 * 2 * 8 * 64 * 32
    with pytest.raises(VerifyException, match="contraction mismatch"):
        top.MatMulOp.build([x, w, None])


def test_attention_verifier() -> None:
    q, k, v, m = _args(tensor([1, 8, 4, 16], f32), tensor([1, 8, 2, 16], f32),
                       tensor([1, 8, 2, 16], f32), tensor([1, 1, 8, 8], f32))
    attrs = {"scale": f64_attr(0.25), "q_heads": i64_attr(4), "kv_heads": i64_attr(2),
             "head_dim": i64_attr(16)}
    op = top.AttentionOp.build([q, k, v, m, None, None], attrs)
    op.verify()
    assert op.output.type == tensor([1, 8, 4, 16], f32)
    bad = dict(attrs, kv_heads=i64_attr(3))
    with pytest.raises(VerifyException, match="kv_heads=3"):
        top.AttentionOp.build([q, k, v, m, None, None], bad)
    (m2,) = _args(tensor([1, 1, 8, 9], f32))
    with pytest.raises(VerifyException, match="mask"):
        top.AttentionOp.build([q, k, v, m2, None, None], attrs)


def test_result_type_is_checked_against_inference() -> None:
    (x,) = _args(tensor([2, 3], f32))
    op = top.PermuteOp.create(operands=[x], attributes={"order": i64_array([1, 0])},
                              result_types=[tensor([2, 3], f32)])
    with pytest.raises(VerifyException, match="inferred"):
        op.verify()


@pytest.mark.parametrize("start,end", [(0, 9), (5, 4)])
def test_slice_out_of_range_is_an_error_not_a_clip(start: int, end: int) -> None:
    (x,) = _args(tensor([8], f32))
    attrs = {"axis": i64_attr(0), "start": i64_attr(start), "end": i64_attr(end),
             "step": i64_attr(1)}
    with pytest.raises(VerifyException, match="out of range"):
        top.SliceOp.build([x], attrs)


def test_misc_shapes() -> None:
    x, ids = _args(tensor([100, 16], f32), tensor([1, 5], i32))
    assert top.GatherOp.build([x, ids], {"axis": i64_attr(0)}).output.type == tensor(
        [1, 5, 16], f32)
    topk = top.TopKOp.build([x], {"k": i64_attr(3), "axis": i64_attr(1)})
    assert topk.values.type == tensor([100, 3], f32) and topk.indices.type == tensor([100, 3], i32)
    img, w = _args(tensor([1, 3, 28, 28], f32), tensor([8, 3, 14, 14], f32))
    conv = top.Conv2dOp.build([img, w, None], {
        "strides": i64_array([14, 14]), "pads": i64_array([0, 0, 0, 0]),
        "dilations": i64_array([1, 1]), "groups": i64_attr(1)})
    assert conv.output.type == tensor([1, 8, 2, 2], f32)
    assert conv.flops() == 2 * 8 * 2 * 2 * 3 * 14 * 14
    rope = top.RopeOp.create(operands=[img, img, img], result_types=[img.type],
                             attributes={"mode": str_attr("spiral")})
    with pytest.raises(VerifyException, match='rope mode "spiral" is not one of half, '
                                              'interleaved'):
        rope.verify()
