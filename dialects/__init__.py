"""toptpu.dialects: the Top and Tpu dialects and what they share."""

from __future__ import annotations

from collections.abc import Callable

from xdsl.context import Context
from xdsl.dialects import get_all_dialects
from xdsl.dialects.builtin import Builtin
from xdsl.dialects.func import Func
from xdsl.ir import Dialect

from toptpu.dialects.dev import Dev
from toptpu.dialects.plugin_ops import extended
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu


def all_dialects() -> list[Dialect]:
    """The dialects toptpu's IR is made of: builtin, func and its own (Top and Tpu with
    the ops of the plugins registered in this process: `plugin_ops.extended`)."""
    return [Builtin, Func, extended(Top), extended(Tpu), Dev]


def dialect_factory(dialect: Dialect) -> Callable[[], Dialect]:
    """`dialect` as `Context.register_dialect` takes it: a factory, called on first use
    (with the ops plugins registered by then: `plugin_ops.extended`)."""
    return lambda: extended(dialect)


def context() -> Context:
    """An xDSL context with builtin, func and toptpu's dialects loaded, and arith registered
    (loaded when IR uses it: the linalg lowering and MLIR's pipelines make it, nothing of
    toptpu's own IR does)."""
    ctx = Context()
    for d in all_dialects():
        ctx.load_dialect(d)
    ctx.register_dialect("arith", get_all_dialects()["arith"])
    return ctx
