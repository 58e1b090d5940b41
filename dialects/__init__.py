"""toptpu.dialects: the Top and Tpu dialects and what they share."""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.arith import Arith
from xdsl.dialects.builtin import Builtin
from xdsl.dialects.func import Func

from toptpu.dialects.dev import Dev
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu


def all_dialects() -> list:  # noqa: ANN201 - list[Dialect]
    """The dialects toptpu works with: builtin, func, arith and its own."""
    return [Builtin, Func, Arith, Top, Tpu, Dev]


def context() -> Context:
    """An xDSL context with builtin, func and toptpu's dialects loaded."""
    ctx = Context()
    for d in all_dialects():
        ctx.load_dialect(d)
    return ctx
