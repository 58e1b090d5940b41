"""Canonicalization on the op: the trait through which xDSL's `canonicalize` finds an op
class's patterns, and the helpers the patterns (and other rewrites) share.

An op class that has canonicalization patterns says so in its body, as xDSL's own dialects
do (`xdsl.traits.HasCanonicalizationPatternsTrait`):

    traits = traits_def(CanonicalizationPatterns())

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        return (FoldNoOpReshape(), ComposeReshapes())

xDSL's `canonicalize` pass (`xdsl.transforms.canonicalize`) then applies them to every op of
that class and its subclasses: a `*Base` class's patterns serve its Top op and its Tpu twin.
Each pattern has the op as its root. Constant folding evaluates ops with the numpy kernels,
which the dialects do not import: it is a pass of its own (passes/fold_constants.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from xdsl.ir import Attribute, Dialect, Operation, OpResult, SSAValue
from xdsl.pattern_rewriter import RewritePattern
from xdsl.traits import HasCanonicalizationPatternsTrait

from toptpu.dialects.naming import op_name, set_name

OpT = TypeVar("OpT", bound=Operation)


@dataclass(frozen=True)
class CanonicalizationPatterns(HasCanonicalizationPatternsTrait):
    """The op class's canonicalization patterns: its `get_canonicalization_patterns()`
    classmethod (what xDSL's `HasCanonicalizationPatternsInterface` reads, as a trait the
    class body declares)."""

    def verify(self, op: Operation) -> None:
        return

    def get_patterns(self, op: type[Operation]) -> tuple[RewritePattern, ...]:
        patterns = getattr(op, "get_canonicalization_patterns", None)
        if patterns is None:
            raise TypeError(f"{op.__name__} declares CanonicalizationPatterns but has no "
                            "get_canonicalization_patterns classmethod")
        return patterns()

    @classmethod
    def get_canonicalization_patterns(cls) -> tuple[RewritePattern, ...]:
        return ()


def producer(value: SSAValue | None, cls: type[OpT]) -> OpT | None:
    """The op of type `cls` that defines `value`, or None."""
    if isinstance(value, OpResult) and isinstance(value.op, cls):
        return value.op
    return None


def named_like(new: OpT, root: Operation, suffix: str = "") -> OpT:
    """Give `new` the name (and source position) of the op it replaces."""
    base = op_name(root) or root.name
    set_name(new, f"{base}{suffix}", like=root)
    hint = root.results[0].name_hint if root.results else None
    if hint:
        tag = "".join(c if c.isalnum() else "_" for c in suffix)
        for r in new.results:
            r.name_hint = f"{hint}{tag}"
    return new


def attributes_of(op: Operation) -> dict[str, Attribute]:
    """The op's attributes without the operand segment sizes (rebuilt from the operands)."""
    return {k: v for k, v in op.attributes.items() if k != "operandSegmentSizes"}


def sibling_op(like: Operation, base: type[OpT]) -> type[OpT]:
    """The op class of `base`'s family in `like`'s dialect: `tpu.ReshapeOp` for a Tpu op and
    `top.ReshapeBase`, `top.ReshapeOp` for a Top op (a rewrite that makes another kind of
    op stays at the level of the op it rewrites)."""
    dialect = Dialect.split_name(like.name)[0]
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        name = getattr(cls, "name", None)
        if isinstance(name, str) and Dialect.split_name(name)[0] == dialect:
            return cls
        todo += cls.__subclasses__()
    raise LookupError(f"no {base.__name__} op in the dialect of '{like.name}'")
