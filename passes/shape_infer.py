"""shape-infer: recompute every op's result types from its operands and attributes.

Static shapes flow from the function arguments; `top.weight` types are checked against
the weight store when one is attached. Function result types follow the returned values.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType, ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects.common import ShapedOp, shape_of
from toptpu.dialects.naming import op_name
from toptpu.dialects.top import weight_name
from toptpu.dialects.weight_store import STORE_ATTR, weights_of
from toptpu.passes.util import require_level


def _named(op: Operation) -> str:
    """' (name)' of an op with a location name, '' for one without (hand-written IR)."""
    name = op_name(op)
    return f" ({name})" if name else ""


@dataclass(frozen=True)
class ShapeInferPass(ModulePass):
    """Recompute result types from operands; check weights against the store."""

    name = "shape-infer"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        store = weights_of(ctx, op) if STORE_ATTR in op.attributes else None
        for fn in op.ops:
            if not isinstance(fn, func.FuncOp):
                continue
            for inner in fn.body.walk():
                name = weight_name(inner.results[0]) if inner.results else None
                if name is not None:
                    if store is not None:
                        if name not in store:
                            raise VerifyException(
                                f"weight '{name}' is not in the weight store {store.uri}"
                            )
                        got = store.shape(name)
                        if got != shape_of(inner.results[0]):
                            raise VerifyException(
                                f"weight '{name}' has shape {list(got)} in the store but "
                                f"{list(shape_of(inner.results[0]))} in the IR"
                            )
                    continue
                if not isinstance(inner, ShapedOp) or not inner.CHECK_INFERRED:
                    continue
                try:
                    types = inner.inferred_types()
                except VerifyException as e:
                    raise VerifyException(
                        f"shape inference failed at '{inner.name}'{_named(inner)}: {e}"
                    ) from e
                for r, t in zip(inner.results, types, strict=True):
                    if r.type != t:
                        r._type = t  # noqa: SLF001 - in-place retyping is this pass's job
            ret = fn.body.block.last_op
            if isinstance(ret, func.ReturnOp):
                fn.function_type = FunctionType.from_lists(
                    [a.type for a in fn.body.block.args], [v.type for v in ret.operands]
                )
