"""Small helpers for writing rewrite patterns over Top/Tpu IR."""

from __future__ import annotations

from typing import TypeVar

from xdsl.ir import Operation, OpResult, SSAValue
from xdsl.utils.exceptions import DiagnosticException

from toptpu.dialects.naming import op_name, set_name
from toptpu.errors import ToptpuError

OpT = TypeVar("OpT", bound=Operation)


def producer(value: SSAValue | None, cls: type[OpT]) -> OpT | None:
    """The op of type `cls` that defines `value`, or None."""
    if isinstance(value, OpResult) and isinstance(value.op, cls):
        return value.op
    return None


def has_one_use(value: SSAValue) -> bool:
    return value.has_one_use()


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


def inverse_permutation(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


class IRLevelError(ToptpuError, DiagnosticException):
    """A pass given IR of the other level (Tpu IR to a pass that takes Top IR, or the
    reverse): a mistake of the command line, named before the pass changes anything."""


#: what to run to get each level's IR
_HOW_TO_GET = {"top": "give it the IR of `toptpu compile --dump-ir` (or of top-pipeline)",
               "tpu": "run convert-top-to-tpu (or tpu-pipeline{chip=none}) first"}


def require_level(module: Operation, level: str, pass_name: str) -> None:
    """Refuse `module` unless it is IR of `level` ('top' or 'tpu'): no op of the other
    dialect anywhere in it (xDSL's and other dialects' ops are allowed)."""
    other = {"top": "tpu", "tpu": "top"}[level]
    for op in module.walk():
        if op.name.startswith(other + "."):
            where = op_name(op)
            found = f"'{op.name}'" + (f" ({where})" if where else "")
            raise IRLevelError(
                f"the input is {'already ' if other == 'tpu' else ''}{other.capitalize()} IR "
                f"(it holds {found}); {pass_name} takes {level.capitalize()} IR: "
                f"{_HOW_TO_GET[level]}")
