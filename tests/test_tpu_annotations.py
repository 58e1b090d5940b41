"""The layer-group and address annotations are typed in the Tpu dialect and read through it.

`#tpu.regions<activations, constants, weights, io>` on a function, `tpu.const_offset` on a
constant and `lmem` (each result's local buffer copies) on the ops of a group are what
address-assign and layer-group hand to codegen; the dialect declares, verifies and reads
them, so codegen depends on the dialect, never on a pass's private format.
"""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import context, tpu
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.irdl_export import export_irdl

_FN = ('"func.func"() <{{function_type = () -> (), sym_name = "f"}}> ({{ "func.return"() : '
       '() -> () }}) {{tpu.regions = {regions}}} : () -> ()')


def _fn_with(regions: str) -> ModuleOp:
    return parse_ir(_FN.format(regions=regions), "test", context())


def test_regions_parse_print_and_read_back() -> None:
    fn = func.FuncOp("f", ((), ()))
    fn.body.block.add_op(func.ReturnOp())
    attr = tpu.set_regions(fn, 4096, 192, 8192, 3072)
    assert isinstance(attr, tpu.RegionsAttr)
    text = print_generic(ModuleOp([fn]))
    assert "tpu.regions = #tpu.regions<4096 : i64, 192 : i64, 8192 : i64, 3072 : i64>" in text
    back = parse_ir(text, "test", context())
    (fn2,) = back.ops
    assert isinstance(fn2, func.FuncOp)
    assert tpu.regions_of(fn2) == {"activations": 4096, "constants": 192, "weights": 8192,
                                   "io": 3072}


def test_regions_before_address_assign_read_as_none() -> None:
    fn = func.FuncOp("f", ((), ()))
    assert tpu.regions_of(fn) is None


@pytest.mark.parametrize("bad, message", [
    ("#tpu.regions<1 : i64, 2 : i64, 3 : i64>", "4"),  # a parameter missing
    ("#tpu.regions<-1 : i64, 0 : i64, 0 : i64, 0 : i64>", "activations size -1 is negative"),
    ('#tpu.regions<"a", 0 : i64, 0 : i64, 0 : i64>', "parameter 'activations' does not verify"),
])
def test_malformed_regions_are_refused(bad: str, message: str) -> None:
    with pytest.raises(Exception, match=message):
        _fn_with(bad)


def test_constant_pool_offset_is_a_declared_attribute() -> None:
    op = tpu.ConstantOp(np.array([0.5, 1.0], np.float32))
    assert op.pool_offset is None
    op.pool_offset = 128
    assert op.attributes["tpu.const_offset"] == IntegerAttr(128, i64)
    op.attributes["tpu.const_offset"] = StringAttr("x")  # the declared kind is checked
    with pytest.raises(VerifyException, match="const_offset"):
        op.verify()


def test_irdl_export_declares_the_regions_attribute_by_name() -> None:
    text = export_irdl().text
    block = text[text.index("irdl.attribute @regions"):]
    block = block[:block.index("}")]
    assert "irdl.parameters(activations: %" in block
    assert ", constants: %" in block and ", weights: %" in block and ", io: %" in block
    # four distinct constraint values: one shared value would make MLIR require them equal
    assert block.count('irdl.base "#builtin.integer"') == 4
