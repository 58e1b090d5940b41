"""Tensor names: every op carries a location `loc("name")` (a NameLoc, optionally wrapping
the model source position); function inputs/outputs carry `top.name` in their arg/result
attributes. Stage comparison maps tensors between stages by these names.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    DictionaryAttr,
    FileLineColLoc,
    IntAttr,
    NameLoc,
    NoneAttr,
    StringAttr,
)
from xdsl.ir import Attribute, BlockArgument, Operation, OpResult, SSAValue

NAME_ATTR = "top.name"


def make_loc(name: str, file: str | None = None, line: int = 0, col: int = 0) -> NameLoc:
    child: Attribute = (
        FileLineColLoc(StringAttr(file), IntAttr(line), IntAttr(col)) if file else NoneAttr()
    )
    return NameLoc(StringAttr(name), child)


def op_name(op: Operation) -> str | None:
    loc = op.location
    if isinstance(loc, NameLoc):
        return loc.desc.data
    return None


def source_of(op: Operation) -> str | None:
    """'file:line' of the model source line the op came from, when known."""
    loc: Attribute = op.location
    if isinstance(loc, NameLoc):
        loc = loc.location
    if isinstance(loc, FileLineColLoc):
        return f"{loc.filename.data}:{loc.line.data}"
    return None


def set_name(op: Operation, name: str, like: Operation | None = None) -> None:
    """Name an op, keeping the source position of `like` (the op it replaces)."""
    child: Attribute = NoneAttr()
    if like is not None and isinstance(like.location, NameLoc):
        child = like.location.location
    op.location = NameLoc(StringAttr(name), child)


def value_name(value: SSAValue) -> str | None:
    if isinstance(value, OpResult):
        base = op_name(value.op)
        if base is None:
            return None
        return base if len(value.op.results) == 1 else f"{base}:{value.index}"
    if isinstance(value, BlockArgument):
        fn = value.block.parent_op()
        if isinstance(fn, func.FuncOp):
            return input_names(fn)[value.index]
    return None


def _names_from(attrs: ArrayAttr | None, n: int, prefix: str) -> list[str]:
    out = []
    for i in range(n):
        name = None
        if attrs is not None and i < len(attrs.data):
            d = attrs.data[i]
            attr = d.data.get(NAME_ATTR) if isinstance(d, DictionaryAttr) else None
            if isinstance(attr, StringAttr):
                name = attr.data
        out.append(name or f"{prefix}{i}")
    return out


def input_names(fn: func.FuncOp) -> list[str]:
    return _names_from(fn.arg_attrs, len(fn.function_type.inputs.data), "input")


def output_names(fn: func.FuncOp) -> list[str]:
    return _names_from(fn.res_attrs, len(fn.function_type.outputs.data), "output")


def name_dicts(names: list[str]) -> ArrayAttr[DictionaryAttr]:
    return ArrayAttr([DictionaryAttr({NAME_ATTR: StringAttr(n)}) for n in names])
