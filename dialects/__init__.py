"""toptpu.dialects: the Top and Tpu dialects and what they share."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects import get_all_dialects
from xdsl.dialects.builtin import Builtin
from xdsl.dialects.func import Func

from toptpu.dialects.dev import Dev
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu


def all_dialects() -> list:  # noqa: ANN201 - list[Dialect]
    """The dialects toptpu's IR is made of: builtin, func and its own."""
    return [Builtin, Func, Top, Tpu, Dev]


def context() -> Context:
    """An xDSL context with builtin, func and toptpu's dialects loaded, and arith registered
    (loaded when IR uses it: the linalg lowering and MLIR's pipelines make it, nothing of
    toptpu's own IR does)."""
    ctx = Context()
    for d in all_dialects():
        ctx.load_dialect(d)
    ctx.register_dialect("arith", get_all_dialects()["arith"])
    return ctx
