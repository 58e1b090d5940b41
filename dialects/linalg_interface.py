"""The linalg lowering interface: each Top op lowers itself to upstream MLIR.

Every Top op (`top.TopOp`) is a `LinalgLowering`: its class implements `lower_to_linalg`,
building the upstream `linalg`/`tensor`/`arith`/`math`/`scf` ops that compute it with a
`toptpu.dialects.linalg_builder.Emitter` (which names them like the op), or says in
`LINALG_NOT_LOWERED` why it has none. convert-top-to-linalg (passes/convert_top_to_linalg.py)
walks a function and asks each op. An elementwise op declares only its scalar body
(`linalg_scalar`: `top.UnaryOp`, `top.BinaryOp`), the broadcasting generic around it is
shared.

The numerics are Top's (`toptpu.dialects.top`): f16/bf16 values are computed in f32
(`compute_type`) and rounded once at the end of an op; booleans are stored as i8
(`storage_type`).

This module holds what the op classes use at import time: the interface, its error, the
affine maps of the generics and the element types. It imports neither the builder
(`linalg_builder`, which loads the linalg, tensor, scf and math dialects) nor any op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeGuard

from xdsl.dialects.builtin import (
    AffineMapAttr,
    AnyFloat,
    BFloat16Type,
    Float16Type,
    IntegerType,
    f32,
    f64,
    i1,
    i8,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.ir.affine import AffineExpr, AffineMap

from toptpu.dialects.naming import op_name
from toptpu.errors import ToptpuError

if TYPE_CHECKING:
    from toptpu.dialects.linalg_builder import Emitter

Shape = tuple[int, ...]


class LinalgLoweringError(ToptpuError):
    """A Top op or type convert-top-to-linalg cannot lower (names the op)."""


def op_where(op: Operation) -> str:
    """The op as messages name it: its op name and, when it has one, its tensor name."""
    name = op_name(op)
    return f"'{op.name}'" + (f" ({name})" if name else "")


class LinalgLowering:
    """A Top op's lowering to upstream MLIR (see the module doc)."""

    #: why the op has no `lower_to_linalg` of its own (None: it has one)
    LINALG_NOT_LOWERED: ClassVar[str | None] = None

    def lower_to_linalg(self, e: Emitter) -> SSAValue | list[SSAValue]:
        """The values that replace the op's results, built with `e` (one value for an op
        of one result, else a list)."""
        assert isinstance(self, Operation)
        why = self.LINALG_NOT_LOWERED or "it declares no lower_to_linalg"
        raise LinalgLoweringError(f"convert-top-to-linalg cannot lower {op_where(self)}: {why}")


# =========================================================================== types


def is_float(t: Attribute) -> TypeGuard[AnyFloat]:
    return isinstance(t, AnyFloat)


def is_half(t: Attribute) -> bool:
    return isinstance(t, Float16Type | BFloat16Type)


def compute_type(t: Attribute) -> Attribute:
    """The scalar type an op computes in: f32 for f16/bf16 storage, else the type."""
    return f32 if is_half(t) else t


def common_type(a: Attribute, b: Attribute) -> Attribute:
    """The type two operands of different element types compare in: their compute type
    when equal, f64 with an f64, f32 with another float, else the wider integer."""
    if a == b:
        return compute_type(a)
    if is_float(a) or is_float(b):
        return f64 if f64 in (a, b) else f32
    wa = a.width.data if isinstance(a, IntegerType) else 64
    wb = b.width.data if isinstance(b, IntegerType) else 64
    return a if wa >= wb else b


def storage_type(t: Attribute) -> Attribute:
    """How a tensor element is stored in the lowered IR: booleans as i8 (MLIR 22's
    memref-to-LLVM lowering refuses sub-byte stores; numpy bools are bytes too)."""
    return i8 if t == i1 else t


# =========================================================================== affine maps


def dim(i: int) -> AffineExpr:
    """Loop dimension `i` of a generic's iteration space."""
    return AffineExpr.dimension(i)


def const(v: int) -> AffineExpr:
    """The constant index `v` (a broadcast axis reads index 0)."""
    return AffineExpr.constant(v)


def amap(num_dims: int, results: Sequence[AffineExpr]) -> AffineMapAttr:
    return AffineMapAttr(AffineMap(num_dims, 0, tuple(results)))


def identity(rank: int) -> AffineMapAttr:
    return amap(rank, [dim(i) for i in range(rank)])


def identity_of(rank: int, loops: int) -> AffineMapAttr:
    """The map reading the first `rank` loops of a `loops`-deep nest."""
    return amap(loops, [dim(d) for d in range(rank)])


def broadcast_results(src: Shape, dims: Sequence[int], full: Shape) -> list[AffineExpr]:
    """Map a source right-aligned (numpy broadcasting) onto loop dims `dims` (one per
    position of `full`): size-1 source axes that broadcast read index 0."""
    off = len(full) - len(src)
    out: list[AffineExpr] = []
    for i, s in enumerate(src):
        j = off + i
        out.append(const(0) if s == 1 and full[j] != 1 else dim(dims[j]))
    return out


def broadcast_map(src: Shape, full: Shape) -> AffineMapAttr:
    return amap(len(full), broadcast_results(src, range(len(full)), full))


def reduced_map(full_rank: int, axes: Sequence[int], keep_rank: bool) -> AffineMapAttr:
    """The map reading a reduction result back over the full loop space."""
    red = set(axes)
    if keep_rank:
        return amap(full_rank, [const(0) if i in red else dim(i) for i in range(full_rank)])
    return amap(full_rank, [dim(i) for i in range(full_rank) if i not in red])
