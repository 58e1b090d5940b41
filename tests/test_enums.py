"""Enum-valued attributes: the values each may take, the verifier's message for any other,
the unchanged text form, and their IRDL export (real MLIR checks them in test_irdl.py)."""

from __future__ import annotations

import pytest
from xdsl.dialects import irdl
from xdsl.dialects.builtin import IntegerAttr, StringAttr, i64
from xdsl.irdl import BaseAttr, VerificationContext
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import top, tpu
from toptpu.dialects.common import (
    AttrEnum,
    ComparePredicate,
    EnumAttr,
    GeluApproximation,
    ReduceMode,
    RopeMode,
    WeightPart,
)
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.irdl_export import export_irdl

#: (op, attribute) -> the enum of its values, as the dialects must declare them
EXPECTED = {
    ("top.gelu", "approximate"): GeluApproximation,
    ("top.compare", "predicate"): ComparePredicate,
    ("top.reduce", "mode"): ReduceMode,
    ("top.rope", "mode"): RopeMode,
    ("tpu.weight", "part"): WeightPart,
    **{(f"tpu.{op}", attr): e for (op, attr), e in {
        ("gelu", "approximate"): GeluApproximation, ("compare", "predicate"): ComparePredicate,
        ("reduce", "mode"): ReduceMode, ("rope", "mode"): RopeMode}.items()},
}


def _string_attributes() -> tuple[dict[tuple[str, str], type[AttrEnum]], set[tuple[str, str]]]:
    """(op, attribute) of every enum attribute and of every free string attribute."""
    enums, strings = {}, set()
    for op in (*top.Top.operations, *tpu.Tpu.operations):
        for name, d in op.get_irdl_definition().attributes.items():
            if isinstance(d.constr, EnumAttr):
                enums[(op.name, name)] = d.constr.enum
            elif isinstance(d.constr, BaseAttr) and d.constr.attr is StringAttr:
                strings.add((op.name, name))
    return enums, strings


def test_every_enum_like_attribute_is_an_enum() -> None:
    """The only free-form strings left are names (of weights and their sources)."""
    enums, strings = _string_attributes()
    assert enums == EXPECTED
    assert strings == {("top.weight", "name"), ("tpu.weight", "name"), ("tpu.weight", "source")}


@pytest.mark.parametrize("enum", sorted(set(EXPECTED.values()), key=lambda e: e.__name__))
def test_constraint_accepts_the_members_and_names_them_for_anything_else(
        enum: type[AttrEnum]) -> None:
    c = EnumAttr(enum)
    for member in enum:
        c.verify(member.attr, VerificationContext())
        assert enum.read(member.attr) is member
    allowed = ", ".join(m.value for m in enum)
    for bad in (StringAttr("bogus"), StringAttr(""), IntegerAttr(1, i64)):
        with pytest.raises(VerifyException, match=f"is not one of {allowed}$"):
            c.verify(bad, VerificationContext())
    with pytest.raises(ValueError, match=f"unknown {enum.describe()} 'bogus'; expected one of "
                                         f"{allowed}$"):
        enum.parse("bogus")


def test_text_form_is_a_plain_string_and_parses_back_to_the_enum() -> None:
    text = """builtin.module {
  func.func @f(%x: tensor<2x8xf32>, %c: tensor<1x8xf32>) -> tensor<2x8xf32> {
    %0 = "top.rope"(%x, %c, %c) {mode = "interleaved"} :
        (tensor<2x8xf32>, tensor<1x8xf32>, tensor<1x8xf32>) -> tensor<2x8xf32>
    %1 = "top.gelu"(%0) : (tensor<2x8xf32>) -> tensor<2x8xf32>
    func.return %1 : tensor<2x8xf32>
  }
}"""
    module = parse_ir(text, "enums.mlir")
    rope, gelu = [op for op in module.walk() if isinstance(op, top.RopeOp | top.GeluOp)]
    assert isinstance(rope, top.RopeOp) and isinstance(gelu, top.GeluOp)
    assert rope.rope_mode is RopeMode.INTERLEAVED
    assert gelu.approximation is GeluApproximation.NONE  # absent: the default
    assert '{mode = "interleaved"}' in str(module)


def test_weight_parts() -> None:
    assert WeightPart.DATA.transpose() is WeightPart.DATA_T
    assert WeightPart.DATA_T.transposed and not WeightPart.DATA.transposed
    assert WeightPart.CHECKPOINT_PERM_T.untransposed is WeightPart.CHECKPOINT_PERM
    assert WeightPart.checkpoint("scales") is WeightPart.CHECKPOINT_SCALES
    assert [p.checkpoint_field for p in (WeightPart.CHECKPOINT_QWEIGHT_T, WeightPart.QWEIGHT)] \
        == ["qweight", None]
    for p in WeightPart:  # every part but a transposed one transposes, once
        if not p.transposed:
            assert p.transpose().untransposed is p
    with pytest.raises(ValueError, match="'data.t' is already transposed"):
        WeightPart.DATA_T.transpose()
    with pytest.raises(ValueError, match="unknown weight part 'checkpoint.g_idx'"):
        WeightPart.checkpoint("g_idx")


def test_irdl_export_lists_the_values() -> None:
    """A required enum attribute is `irdl.any_of` of `irdl.is "<value>"`, one per member (an
    optional one -- gelu's approximate, tpu.weight's part -- is an IRDL gap)."""
    exported = export_irdl()
    enums, _ = _string_attributes()
    ops = {f"{d.sym_name.data}.{o.sym_name.data}": o for d in exported.module.ops
           if isinstance(d, irdl.DialectOp) for o in d.body.block.ops
           if isinstance(o, irdl.OperationOp)}
    for (op_name, attr), enum in enums.items():
        attributes = [o for o in ops[op_name].body.block.ops
                      if isinstance(o, irdl.AttributesOp)]
        if op_name.endswith((".gelu", ".weight")):
            assert any(g.op == op_name and g.where == f"attribute '{attr}'"
                       for g in exported.gaps)
            assert all(attr not in [n.data for n in a.attribute_value_names]
                       for a in attributes)
            continue
        (attrs_op,) = attributes
        names = [n.data for n in attrs_op.attribute_value_names]
        any_of = attrs_op.attribute_values[names.index(attr)].owner
        assert isinstance(any_of, irdl.AnyOfOp)
        values = [v.owner.expected for v in any_of.args]  # type: ignore[attr-defined]
        assert values == [StringAttr(m.value) for m in enum]
