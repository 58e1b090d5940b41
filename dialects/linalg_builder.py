"""The builder a Top op's `lower_to_linalg` uses (`toptpu.dialects.linalg_interface`).

- `Emitter` collects the ops that replace one Top op (each named like it): empty and
  filled tensors, `linalg.generic`s (elementwise with numpy broadcasting, reductions, any
  maps and iterators), conversions, reshapes, constants, an `scf.for` loop;
- `Body` builds the scalar region of a generic: arith and math on its block arguments,
  conversions with Top's cast semantics, index arithmetic and `tensor.extract`s
  (data-dependent reads: gathers, rope's rotated partner, concat, padding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xdsl.builder import Builder, InsertPoint
from xdsl.dialects import arith, scf
from xdsl.dialects import math as mathd
from xdsl.dialects import tensor as tensord
from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    AffineMapAttr,
    ArrayAttr,
    BFloat16Type,
    DenseIntOrFPElementsAttr,
    Float16Type,
    Float32Type,
    Float64Type,
    FloatAttr,
    IndexType,
    IntegerAttr,
    IntegerType,
    TensorType,
    f32,
    i1,
    i8,
    i64,
)
from xdsl.dialects.linalg import attrs as linalg_attrs
from xdsl.dialects.linalg import ops as linalg
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue

from toptpu.dialects.common import shape_of
from toptpu.dialects.linalg_interface import (
    LinalgLoweringError,
    Shape,
    amap,
    broadcast_map,
    compute_type,
    const,
    dim,
    identity,
    is_float,
    is_half,
    storage_type,
)

FLOAT_BITS: dict[type[Attribute], int] = {Float16Type: 16, BFloat16Type: 16, Float32Type: 32,
                                         Float64Type: 64}


# =========================================================================== body


class Body:
    """Builds the scalar region of a `linalg.generic` (arith/math on its block args)."""

    def __init__(self, block: Block, fast_math: bool = False) -> None:
        self.block = block
        self.flags = arith.FastMathFlagsAttr(
            (arith.FastMathFlag.REASSOC, arith.FastMathFlag.ALLOW_CONTRACT)) if fast_math else None
        self.b = Builder(InsertPoint.at_end(block))

    @property
    def args(self) -> Sequence[SSAValue]:
        return self.block.args

    def _ins(self, op: Operation) -> SSAValue:
        self.b.insert(op)
        return op.results[0]

    # ------------------------------------------------------------------ constants, indices
    def const(self, value: float | int, t: Attribute) -> SSAValue:
        if is_float(t):
            return self._ins(arith.ConstantOp(FloatAttr(float(value), t)))
        assert isinstance(t, IntegerType | IndexType), f"no constant of type {t}"
        return self._ins(arith.ConstantOp(IntegerAttr(int(value), t)))

    def idx(self, value: int) -> SSAValue:
        return self._ins(arith.ConstantOp(IntegerAttr(int(value), IndexType())))

    def index(self, dim: int) -> SSAValue:
        return self._ins(linalg.IndexOp(dim))

    # ------------------------------------------------------------------ conversions
    def convert(self, v: SSAValue, to: Attribute) -> SSAValue:
        """Numeric conversion with Top's cast semantics (float -> int truncates, x -> i1
        is x != 0, i1 -> number is 0/1)."""
        fr = v.type
        if fr == to:
            return v
        if to == i1:
            zero = self.const(0, fr)
            return self.cmp("ne", v, zero)
        if is_float(fr) and is_float(to):
            if is_half(fr) and is_half(to):  # f16 <-> bf16 goes through f32
                return self.convert(self.convert(v, f32), to)
            wider = FLOAT_BITS[type(to)] > FLOAT_BITS[type(fr)]
            op: Operation = arith.ExtFOp(v, to) if wider else arith.TruncFOp(v, to)
            return self._ins(op)
        if isinstance(fr, IntegerType) and is_float(to):
            op = arith.UIToFPOp(v, to) if fr == i1 else arith.SIToFPOp(v, to)
            return self._ins(op)
        if is_float(fr) and isinstance(to, IntegerType):
            return self._ins(arith.FPToSIOp(v, to))
        if isinstance(fr, IntegerType) and isinstance(to, IntegerType):
            if to.width.data > fr.width.data:
                op = arith.ExtUIOp(v, to) if fr == i1 else arith.ExtSIOp(v, to)
                return self._ins(op)
            return self._ins(arith.TruncIOp(v, to))
        if isinstance(fr, IntegerType) and isinstance(to, IndexType):
            return self._ins(arith.IndexCastOp(v, to))
        raise LinalgLoweringError(f"cannot convert {fr} to {to}")

    def compute(self, v: SSAValue) -> SSAValue:
        """f16/bf16 -> f32 (the type Top computes in)."""
        return self.convert(v, compute_type(v.type))

    # ------------------------------------------------------------------ arithmetic
    def binary(self, kind: str, a: SSAValue, b: SSAValue) -> SSAValue:
        t = a.type
        cls: Callable[..., Operation]
        if is_float(t):
            cls = {"add": arith.AddfOp, "sub": arith.SubfOp, "mul": arith.MulfOp,
                   "div": arith.DivfOp, "max": arith.MaximumfOp, "min": arith.MinimumfOp}[kind]
        elif isinstance(t, IntegerType | IndexType):
            cls = {"add": arith.AddiOp, "sub": arith.SubiOp, "mul": arith.MuliOp,
                   "div": arith.FloorDivSIOp, "max": arith.MaxSIOp, "min": arith.MinSIOp}[kind]
        else:
            raise LinalgLoweringError(f"no arithmetic on {t}")
        if self.flags is not None and is_float(t):
            return self._ins(cls(a, b, self.flags))
        return self._ins(cls(a, b))

    def add(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.binary("add", a, b)

    def sub(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.binary("sub", a, b)

    def mul(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.binary("mul", a, b)

    def div(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.binary("div", a, b)

    def neg(self, a: SSAValue) -> SSAValue:
        return self._ins(arith.NegfOp(a))

    def math(self, fn: str, a: SSAValue) -> SSAValue:
        cls = {"exp": mathd.ExpOp, "cos": mathd.CosOp, "sin": mathd.SinOp,
               "tanh": mathd.TanhOp, "sqrt": mathd.SqrtOp, "rsqrt": mathd.RsqrtOp,
               "erf": mathd.ErfOp, "log1p": mathd.Log1pOp}[fn]
        return self._ins(cls(a))

    def powf(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self._ins(mathd.PowFOp(a, b))

    def cmp(self, pred: str, a: SSAValue, b: SSAValue) -> SSAValue:
        if is_float(a.type):
            p = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt",
                 "ge": "oge"}[pred]
            return self._ins(arith.CmpfOp(a, b, p))
        p = {"eq": "eq", "ne": "ne", "lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge"}[pred]
        return self._ins(arith.CmpiOp(a, b, p))

    def select(self, c: SSAValue, a: SSAValue, b: SSAValue) -> SSAValue:
        return self._ins(arith.SelectOp(c, a, b))

    def and_(self, a: SSAValue, b: SSAValue) -> SSAValue:
        """Bitwise and (of i1 conditions or indices)."""
        return self._ins(arith.AndIOp(a, b))

    def or_(self, a: SSAValue, b: SSAValue) -> SSAValue:
        """Bitwise or (of i1 conditions)."""
        return self._ins(arith.OrIOp(a, b))

    def xor(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self._ins(arith.XOrIOp(a, b))

    def index_cast(self, i: SSAValue, t: Attribute) -> SSAValue:
        """An index as the integer type `t` (or an integer as an index)."""
        return self._ins(arith.IndexCastOp(i, t))

    def clamp(self, i: SSAValue, lo: int, hi: int) -> SSAValue:
        """Clamp an index into [lo, hi] (keeps data-dependent reads in bounds)."""
        v = self._ins(arith.MaxSIOp(i, self.idx(lo)))
        return self._ins(arith.MinSIOp(v, self.idx(hi)))

    def extract(self, t: SSAValue, indices: Sequence[SSAValue]) -> SSAValue:
        tt = t.type
        assert isinstance(tt, TensorType)
        return self._ins(tensord.ExtractOp(t, list(indices), tt.element_type))


BodyFn = Callable[[Body], SSAValue]


# =========================================================================== emitter


class Emitter:
    """Collects the ops that replace one Top op (all named like it)."""

    def __init__(self, root: Operation, fast_math: bool = False) -> None:
        self.fast_math = fast_math
        self.root = root
        self.ops: list[Operation] = []

    def add(self, op: Operation) -> Operation:
        op.location = self.root.location
        self.ops.append(op)
        return op

    def empty(self, shape: Shape, elem: Attribute) -> SSAValue:
        return self.add(tensord.EmptyOp([], TensorType(storage_type(elem), list(shape)))
                        ).results[0]

    def generic(self, ins: Sequence[tuple[SSAValue, AffineMapAttr]], init: SSAValue,
                out_map: AffineMapAttr, iterators: Sequence[str], body: BodyFn) -> SSAValue:
        out_t = init.type
        assert isinstance(out_t, TensorType)
        arg_types = [_elem(v) for v, _ in ins] + [out_t.element_type]
        block = Block(arg_types=arg_types)
        bb = Body(block, self.fast_math)
        bb.b.insert(linalg.YieldOp(bb.convert(body(bb), out_t.element_type)))
        its = [linalg_attrs.IteratorTypeAttr(linalg_attrs.IteratorType(k)) for k in iterators]
        op = linalg.GenericOp([v for v, _ in ins], [init], Region(block),
                              [m for _, m in ins] + [out_map], its, [out_t])
        return self.add(op).results[0]

    def generic_n(self, ins: Sequence[tuple[SSAValue, AffineMapAttr]],
                  outs: Sequence[tuple[SSAValue, AffineMapAttr]], iterators: Sequence[str],
                  body: Callable[[Body], Sequence[SSAValue]]) -> list[SSAValue]:
        """A generic with several outputs (e.g. a value and its index)."""
        out_types = [v.type for v, _ in outs]
        elems = [_elem(v) for v, _ in outs]
        block = Block(arg_types=[_elem(v) for v, _ in ins] + elems)
        bb = Body(block, self.fast_math)
        ys = body(bb)
        bb.b.insert(linalg.YieldOp(*[bb.convert(y, t) for y, t in zip(ys, elems, strict=True)]))
        its = [linalg_attrs.IteratorTypeAttr(linalg_attrs.IteratorType(k)) for k in iterators]
        op = linalg.GenericOp([v for v, _ in ins], [v for v, _ in outs], Region(block),
                              [m for _, m in (*ins, *outs)], its, out_types)
        return list(self.add(op).results)

    def map(self, ins: Sequence[tuple[SSAValue, AffineMapAttr]], shape: Shape,
            elem: Attribute, body: BodyFn) -> SSAValue:
        """An all-parallel generic producing a fresh tensor of `shape`."""
        return self.generic(ins, self.empty(shape, elem), identity(len(shape)),
                            ["parallel"] * len(shape), body)

    def fill(self, shape: Shape, elem: Attribute, value: float | int) -> SSAValue:
        return self.map([], shape, elem, lambda b: b.const(value, elem))

    def elementwise(self, ins: Sequence[SSAValue], shape: Shape, elem: Attribute,
                    body: BodyFn) -> SSAValue:
        """A broadcasting elementwise op over `ins`."""
        return self.map([(v, broadcast_map(shape_of(v), shape)) for v in ins], shape, elem,
                        body)

    def convert(self, v: SSAValue, elem: Attribute) -> SSAValue:
        if _elem(v) == elem:
            return v
        return self.elementwise([v], shape_of(v), elem, lambda b: b.convert(b.args[0], elem))

    def reduce(self, ins: Sequence[tuple[SSAValue, AffineMapAttr]], full: Shape,
               axes: Sequence[int], keep_rank: bool, acc_elem: Attribute,
               init: float | SSAValue, combine: Callable[[Body, SSAValue], SSAValue]
               ) -> SSAValue:
        """Reduce over `axes` of the loop space `full`; `combine(body, acc)` returns the new
        accumulator from the block args (ins..., acc). `init` is a value to fill with or
        the tensor to accumulate into (chaining reductions over several parts)."""
        red = set(axes)
        if keep_rank:
            out_shape = tuple(1 if i in red else d for i, d in enumerate(full))
            res = [const(0) if i in red else dim(i) for i in range(len(full))]
        else:
            out_shape = tuple(d for i, d in enumerate(full) if i not in red)
            res = [dim(i) for i in range(len(full)) if i not in red]
        acc = init if isinstance(init, SSAValue) else self.fill(out_shape, acc_elem, init)
        its = ["reduction" if i in red else "parallel" for i in range(len(full))]
        return self.generic(ins, acc, amap(len(full), res), its,
                            lambda b: combine(b, b.args[-1]))


    # ------------------------------------------------------------------ tensors
    def constant(self, value: DenseIntOrFPElementsAttr) -> SSAValue:
        """A dense constant (booleans stored as i8, `storage_type`)."""
        t = value.get_type()
        if isinstance(t, TensorType) and t.element_type == i1:
            value = DenseIntOrFPElementsAttr.from_list(
                TensorType(i8, t.get_shape()), [int(bool(v)) for v in value.get_values()])
        return self.add(arith.ConstantOp(value)).results[0]

    def index_constant(self, value: int) -> SSAValue:
        return self.add(arith.ConstantOp(IntegerAttr(value, IndexType()))).results[0]

    def collapse_shape(self, v: SSAValue, groups: list[list[int]], shape: Shape) -> SSAValue:
        """`tensor.collapse_shape` of `v` to `shape`, its axes merged in `groups`."""
        return self.add(tensord.CollapseShapeOp(
            operands=[v], result_types=[TensorType(_elem(v), list(shape))],
            properties={"reassociation": _reassociation(groups)})).results[0]

    def expand_shape(self, v: SSAValue, groups: list[list[int]], shape: Shape) -> SSAValue:
        """`tensor.expand_shape` of `v` to `shape`, each of its axes split in a group."""
        return self.add(tensord.ExpandShapeOp(v, [], _reassociation(groups), list(shape),
                                              TensorType(_elem(v), list(shape)))).results[0]

    def insert_slice(self, source: SSAValue, dest: SSAValue, offsets: Sequence[int | SSAValue],
                     sizes: Sequence[int]) -> SSAValue:
        """`tensor.insert_slice` of `source` into `dest` at `offsets` (an index value where
        the offset is dynamic), of `sizes`, unit strides."""
        dynamic = [o for o in offsets if isinstance(o, SSAValue)]
        static = [DYNAMIC_INDEX if isinstance(o, SSAValue) else o for o in offsets]
        return self.add(tensord.InsertSliceOp.get(
            source, dest, static_sizes=list(sizes), static_offsets=static,
            offsets=dynamic)).results[0]

    def for_loop(self, count: int, inits: Sequence[SSAValue],
                 body: Callable[[Emitter, SSAValue, Sequence[SSAValue]], Sequence[SSAValue]]
                 ) -> list[SSAValue]:
        """An `scf.for` over 0 .. `count` - 1 carrying `inits`: `body(emitter, i, carried)`
        builds one iteration (with an emitter of its own) and returns what it yields."""
        lb, ub, step = (self.index_constant(i) for i in (0, count, 1))
        block = Block(arg_types=[IndexType(), *(v.type for v in inits)])
        inner = Emitter(self.root, self.fast_math)
        ys = body(inner, block.args[0], block.args[1:])
        inner.add(scf.YieldOp(*ys))
        for op in inner.ops:
            block.add_op(op)
        return list(self.add(scf.ForOp(lb, ub, step, list(inits), block)).results)


def _reassociation(groups: list[list[int]]
                   ) -> ArrayAttr[ArrayAttr[IntegerAttr[IntegerType | IndexType]]]:
    return ArrayAttr([ArrayAttr([IntegerAttr(i, i64) for i in g]) for g in groups])


def _elem(v: SSAValue) -> Attribute:
    t = v.type
    assert isinstance(t, TensorType), t
    return t.element_type


