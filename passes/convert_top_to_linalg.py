"""convert-top-to-linalg: lower Top to upstream `linalg`/`tensor`/`arith`/`math`/`func`.

The result is plain upstream MLIR (printed in generic form it parses in MLIR 22 with no
toptpu dialect loaded), which `toptpu.mlir_jit` bufferizes, lowers to LLVM with MLIR's own
passes and JIT-compiles: a numerical implementation of Top independent of the numpy
kernels (`toptpu.backend.reference.kernels`) and of torch.

- `top.weight` ops become extra function arguments (after the real inputs, one per
  distinct weight, with the arg attribute `top.weight = "<name>"`): weights never become
  dense attributes; the JIT runner feeds the arrays of the weight store at run time.
- Every compute op becomes `linalg.generic`s over `tensor.empty`/filled init tensors with
  affine indexing maps (broadcasting = constant-0 results, GQA = `h floordiv rep`, slices =
  `d * step + start`); data-dependent reads (gather, rope's rotated partner, concat,
  conv2d padding, slices) are `tensor.extract`s in the body (an indexing map that reads
  a larger operand with a pure loop dimension would redefine that loop's range). Reshapes
  are `tensor.collapse_shape` + `tensor.expand_shape`; small constants `arith.constant`.
- Recurrences: `top.gated_delta_rule` is an `scf.for` over the tokens whose iter_args are
  the f32 state (updated in place by each step's generics) and the output (each token's
  row a `tensor.insert_slice` at the loop index); `top.causal_conv1d` reads the state and
  the input by index and takes its new state from the count of real tokens (a reduction
  of `valid`).
- Options: `fast-math` (arith `reassoc,contract`: vectorizable reductions) and
  `expose-values` (every named intermediate tensor also returned, for `--compare-all`).
- Numerics follow the Top semantics (`toptpu.dialects.top`): f16/bf16 values are computed in f32 and
  rounded once at the end of an op; matmul, norms, softmax and attention accumulate in
  f32; softmax and attention subtract the row maximum; attention reads history keys and
  values separately (no concatenation) with one softmax over both.
- Booleans (i1 tensors) are stored as i8 (MLIR 22's memref-to-LLVM lowering asserts on
  sub-byte stores); function arguments and results of i1 tensors become i8 (same bytes as
  numpy bools).
- Not lowered (clear error): `top.topk` with k > 1 (a sort has no linalg form; k = 1, the
  LLM's argmax head, is a reduction carrying value and index), unsigned integer element
  types (arith is signless).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xdsl.builder import Builder, InsertPoint
from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects import math as mathd
from xdsl.dialects import tensor as tensord
from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    AffineMapAttr,
    AnyFloat,
    ArrayAttr,
    BFloat16Type,
    DenseIntOrFPElementsAttr,
    DictionaryAttr,
    Float16Type,
    Float32Type,
    Float64Type,
    FloatAttr,
    FunctionType,
    IndexType,
    IntegerAttr,
    IntegerType,
    ModuleOp,
    Signedness,
    StringAttr,
    TensorType,
    UnitAttr,
    f32,
    f64,
    i1,
    i8,
    i64,
)
from xdsl.dialects.linalg import attrs as linalg_attrs
from xdsl.dialects.linalg import ops as linalg
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue
from xdsl.ir.affine import AffineExpr, AffineMap
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from toptpu.dialects import top
from toptpu.dialects.common import (
    GeluApproximation,
    ReduceMode,
    RopeMode,
    elem_of,
    norm_axis,
    numel,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
)
from toptpu.dialects.naming import NAME_ATTR, op_name, output_names, value_name
from toptpu.errors import ToptpuError
from toptpu.passes.util import require_level

#: arg attribute naming the weight a function argument carries
WEIGHT_ARG_ATTR = "top.weight"

Shape = tuple[int, ...]


class LinalgLoweringError(ToptpuError):
    """A Top op or type convert-top-to-linalg cannot lower (names the op)."""


def _where(op: Operation) -> str:
    name = op_name(op)
    return f"'{op.name}'" + (f" ({name})" if name else "")


# =========================================================================== types


def _is_float(t: Attribute) -> bool:
    return isinstance(t, AnyFloat)


def _is_half(t: Attribute) -> bool:
    return isinstance(t, Float16Type | BFloat16Type)


_FLOAT_BITS: dict[type[Attribute], int] = {Float16Type: 16, BFloat16Type: 16, Float32Type: 32,
                                          Float64Type: 64}


def compute_type(t: Attribute) -> Attribute:
    """The scalar type an op computes in: f32 for f16/bf16 storage, else the type."""
    return f32 if _is_half(t) else t


def storage_type(t: Attribute) -> Attribute:
    """How a tensor element is stored in the lowered IR: booleans as i8 (MLIR 22's
    memref-to-LLVM lowering refuses sub-byte stores; numpy bools are bytes too)."""
    return i8 if t == i1 else t


def _storage_tensor(t: Attribute) -> Attribute:
    if isinstance(t, TensorType) and t.element_type == i1:
        return TensorType(i8, t.get_shape())
    return t


def _check_type(t: Attribute, op: Operation) -> None:
    if isinstance(t, IntegerType) and t.signedness.data != Signedness.SIGNLESS:
        raise LinalgLoweringError(
            f"{_where(op)}: element type {t} is not supported by convert-top-to-linalg "
            "(arith is signless); cast to a signless type first"
        )


# =========================================================================== affine maps


def _d(i: int) -> AffineExpr:
    return AffineExpr.dimension(i)


def _c(v: int) -> AffineExpr:
    return AffineExpr.constant(v)


def amap(num_dims: int, results: Sequence[AffineExpr]) -> AffineMapAttr:
    return AffineMapAttr(AffineMap(num_dims, 0, tuple(results)))


def identity(rank: int) -> AffineMapAttr:
    return amap(rank, [_d(i) for i in range(rank)])


def identity_of(rank: int, loops: int) -> AffineMapAttr:
    """The map reading the first `rank` loops of a `loops`-deep nest."""
    return amap(loops, [_d(d) for d in range(rank)])



def broadcast_results(src: Shape, dims: Sequence[int], full: Shape) -> list[AffineExpr]:
    """Map a source right-aligned (numpy broadcasting) onto loop dims `dims` (one per
    position of `full`): size-1 source axes that broadcast read index 0."""
    off = len(full) - len(src)
    out: list[AffineExpr] = []
    for i, s in enumerate(src):
        j = off + i
        out.append(_c(0) if s == 1 and full[j] != 1 else _d(dims[j]))
    return out


def broadcast_map(src: Shape, full: Shape) -> AffineMapAttr:
    return amap(len(full), broadcast_results(src, range(len(full)), full))


# =========================================================================== body builder


class Body:
    """Builds the scalar region of a `linalg.generic` (arith/math on its block args)."""

    def __init__(self, block: Block, fast_math: bool = False) -> None:
        self.block = block
        self.flags = arith.FastMathFlagsAttr(("reassoc", "contract")) if fast_math else None
        self.b = Builder(InsertPoint.at_end(block))

    @property
    def args(self) -> Sequence[SSAValue]:
        return self.block.args

    def _ins(self, op: Operation) -> SSAValue:
        self.b.insert(op)
        return op.results[0]

    # ------------------------------------------------------------------ constants, indices
    def const(self, value: float | int, t: Attribute) -> SSAValue:
        if _is_float(t):
            return self._ins(arith.ConstantOp(FloatAttr(float(value), t)))
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
        if _is_float(fr) and _is_float(to):
            if _is_half(fr) and _is_half(to):  # f16 <-> bf16 goes through f32
                return self.convert(self.convert(v, f32), to)
            wider = _FLOAT_BITS[type(to)] > _FLOAT_BITS[type(fr)]
            op = arith.ExtFOp(v, to) if wider else arith.TruncFOp(v, to)
            return self._ins(op)
        if isinstance(fr, IntegerType) and _is_float(to):
            op = arith.UIToFPOp(v, to) if fr == i1 else arith.SIToFPOp(v, to)
            return self._ins(op)
        if _is_float(fr) and isinstance(to, IntegerType):
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
        if _is_float(t):
            cls = {"add": arith.AddfOp, "sub": arith.SubfOp, "mul": arith.MulfOp,
                   "div": arith.DivfOp, "max": arith.MaximumfOp, "min": arith.MinimumfOp}[kind]
        elif isinstance(t, IntegerType | IndexType):
            cls = {"add": arith.AddiOp, "sub": arith.SubiOp, "mul": arith.MuliOp,
                   "div": arith.FloorDivSIOp, "max": arith.MaxSIOp, "min": arith.MinSIOp}[kind]
        else:
            raise LinalgLoweringError(f"no arithmetic on {t}")
        if self.flags is not None and _is_float(t):
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
        if _is_float(a.type):
            p = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt",
                 "ge": "oge"}[pred]
            return self._ins(arith.CmpfOp(a, b, p))
        p = {"eq": "eq", "ne": "ne", "lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge"}[pred]
        return self._ins(arith.CmpiOp(a, b, p))

    def select(self, c: SSAValue, a: SSAValue, b: SSAValue) -> SSAValue:
        return self._ins(arith.SelectOp(c, a, b))

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
            res = [_c(0) if i in red else _d(i) for i in range(len(full))]
        else:
            out_shape = tuple(d for i, d in enumerate(full) if i not in red)
            res = [_d(i) for i in range(len(full)) if i not in red]
        acc = init if isinstance(init, SSAValue) else self.fill(out_shape, acc_elem, init)
        its = ["reduction" if i in red else "parallel" for i in range(len(full))]
        return self.generic(ins, acc, amap(len(full), res), its,
                            lambda b: combine(b, b.args[-1]))


def _elem(v: SSAValue) -> Attribute:
    t = v.type
    assert isinstance(t, TensorType), t
    return t.element_type


def reduced_map(full_rank: int, axes: Sequence[int], keep_rank: bool) -> AffineMapAttr:
    """The map reading a reduction result back over the full loop space."""
    red = set(axes)
    if keep_rank:
        return amap(full_rank, [_c(0) if i in red else _d(i) for i in range(full_rank)])
    return amap(full_rank, [_d(i) for i in range(full_rank) if i not in red])


# =========================================================================== lowerings


def _unary_scalar(b: Body, kind: str, x: SSAValue, attrs: dict[str, Attribute]) -> SSAValue:
    t = x.type
    one = b.const(1.0, t)
    if kind in ("rsqrt", "sqrt", "exp", "cos", "sin", "tanh"):
        return b.math(kind, x)
    if kind == "sigmoid":
        return b.div(one, b.add(one, b.math("exp", b.neg(x))))
    if kind == "relu":
        return b.binary("max", x, b.const(0.0, t))
    if kind == "silu":
        return b.div(x, b.add(one, b.math("exp", b.neg(x))))
    if kind == "softplus":  # torch's: beta 1, x itself above the threshold 20
        big = b.cmp("gt", x, b.const(20.0, t))
        return b.select(big, x, b.math("log1p", b.math("exp", x)))
    if kind == "gelu":
        half = b.const(0.5, t)
        approximate = GeluApproximation.read(attrs.get("approximate"), GeluApproximation.NONE)
        if approximate == GeluApproximation.TANH:
            k = b.const(math.sqrt(2.0 / math.pi), t)
            x3 = b.mul(b.mul(x, x), x)
            inner = b.mul(k, b.add(x, b.mul(b.const(0.044715, t), x3)))
            return b.mul(b.mul(half, x), b.add(one, b.math("tanh", inner)))
        e = b.math("erf", b.mul(x, b.const(1.0 / math.sqrt(2.0), t)))
        return b.mul(b.mul(half, x), b.add(one, e))
    if kind == "pow":
        e = read_float(attrs["exponent"])
        if e == 2.0:
            return b.mul(x, x)
        return b.powf(x, b.const(e, t))
    raise LinalgLoweringError(f"unknown unary op {kind}")


#: the unary ops `lower_unary` lowers (a body per kind in `_unary_scalar`)
UNARY_OPS = (*top.UNARY_ELEMENTWISE, top.GeluOp, top.PowOp)


def lower_unary(e: Emitter, op: top.UnaryOp) -> SSAValue:
    kind = op.op_kind()
    out = elem_of(op.output)
    ct = compute_type(out) if _is_float(out) else f32
    attrs = dict(op.attributes)
    return e.elementwise([op.input], shape_of(op.output), out, lambda b: b.convert(
        _unary_scalar(b, kind, b.convert(b.args[0], ct), attrs), out))


def lower_const_binary(e: Emitter, op: top.ConstBinaryOp) -> SSAValue:
    kind = op.op_kind().removesuffix("_const")
    out = elem_of(op.output)
    # float tensors compute in f32; integer tensors with a float scalar in f64 (numpy)
    ct = compute_type(out) if _is_float(out) else f64
    value = read_float(op.value)
    reverse = read_bool(op.reverse)

    def body(b: Body) -> SSAValue:
        x, c = b.convert(b.args[0], ct), b.const(value, ct)
        a, y = (c, x) if reverse else (x, c)
        return b.convert(b.binary(kind, a, y), out)

    return e.elementwise([op.input], shape_of(op.output), out, body)


def lower_binary(e: Emitter, op: top.BinaryOp) -> SSAValue:
    kind = op.op_kind()
    out = elem_of(op.output)
    ct = compute_type(out)
    return e.elementwise([op.lhs, op.rhs], shape_of(op.output), out, lambda b: b.convert(
        b.binary(kind, b.convert(b.args[0], ct), b.convert(b.args[1], ct)), out))


def _common_type(a: Attribute, b: Attribute) -> Attribute:
    if a == b:
        return compute_type(a)
    if _is_float(a) or _is_float(b):
        return f64 if f64 in (a, b) else f32
    wa = a.width.data if isinstance(a, IntegerType) else 64
    wb = b.width.data if isinstance(b, IntegerType) else 64
    return a if wa >= wb else b


def lower_compare(e: Emitter, op: top.CompareBase) -> SSAValue:
    pred = op.compare_predicate
    ct = _common_type(elem_of(op.lhs), elem_of(op.rhs))
    return e.elementwise([op.lhs, op.rhs], shape_of(op.output), i1, lambda b: b.cmp(
        pred, b.convert(b.args[0], ct), b.convert(b.args[1], ct)))


def lower_where(e: Emitter, op: top.WhereBase) -> SSAValue:
    out = elem_of(op.output)
    return e.elementwise([op.cond, op.lhs, op.rhs], shape_of(op.output), out,
                         lambda b: b.select(b.convert(b.args[0], i1), b.args[1], b.args[2]))


def lower_cast(e: Emitter, op: top.CastBase) -> SSAValue:
    out = elem_of(op.output)
    return e.elementwise([op.input], shape_of(op.output), out,
                         lambda b: b.convert(b.args[0], out))


def lower_softmax(e: Emitter, op: top.SoftmaxBase) -> SSAValue:
    x = op.input
    shape = shape_of(x)
    axis = norm_axis(read_int(op.axis), len(shape))
    out = elem_of(op.output)
    ct = compute_type(out)
    full = identity(len(shape))
    red = reduced_map(len(shape), [axis], False)
    mx = e.reduce([(x, full)], shape, [axis], False, ct, -math.inf,
                  lambda b, acc: b.binary("max", acc, b.compute(b.args[0])))
    sm = e.reduce([(x, full), (mx, red)], shape, [axis], False, ct, 0.0,
                  lambda b, acc: b.add(acc, b.math("exp", b.sub(b.compute(b.args[0]),
                                                                 b.args[1]))))
    return e.map([(x, full), (mx, red), (sm, red)], shape, out, lambda b: b.convert(
        b.div(b.math("exp", b.sub(b.compute(b.args[0]), b.args[1])), b.args[2]), out))


def lower_reduce(e: Emitter, op: top.ReduceBase) -> SSAValue:
    x = op.input
    shape = shape_of(x)
    mode = op.reduce_mode
    axes = sorted({norm_axis(a, len(shape)) for a in read_ints(op.axes)})
    keep = read_bool(op.keepdims)
    out = elem_of(op.output)
    if mode == ReduceMode.MEAN and not _is_float(out):
        raise LinalgLoweringError(f"{_where(op)}: mean of integers is not lowered")
    ct = compute_type(out)
    if _is_float(ct):
        init = {ReduceMode.MEAN: 0.0, ReduceMode.SUM: 0.0, ReduceMode.MAX: -math.inf,
                ReduceMode.MIN: math.inf}[mode]
    else:
        w = ct.width.data if isinstance(ct, IntegerType) else 64
        init = {ReduceMode.SUM: 0, ReduceMode.MAX: -(2 ** (w - 1)),
                ReduceMode.MIN: 2 ** (w - 1) - 1}[mode]
    kind = {ReduceMode.MEAN: "add", ReduceMode.SUM: "add", ReduceMode.MAX: "max",
            ReduceMode.MIN: "min"}[mode]
    acc = e.reduce([(x, identity(len(shape)))], shape, axes, keep, ct, init,
                   lambda b, a: b.binary(kind, a, b.compute(b.args[0])))
    n = numel([shape[a] for a in axes])
    if mode == ReduceMode.MEAN:
        return e.elementwise([acc], shape_of(op.output), out, lambda b: b.convert(
            b.div(b.args[0], b.const(float(n), ct)), out))
    return e.convert(acc, out)


def lower_rms_norm(e: Emitter, op: top.RmsNormBase) -> SSAValue:
    x, w = op.input, op.weight
    shape = shape_of(x)
    r = len(shape)
    out = elem_of(op.output)
    ct = compute_type(out)
    eps, n = read_float(op.eps), shape[-1]
    full = identity(r)
    ss = e.reduce([(x, full)], shape, [r - 1], False, ct, 0.0,
                  lambda b, acc: b.add(acc, b.mul(b.compute(b.args[0]),
                                                  b.compute(b.args[0]))))
    ins = [(x, full), (ss, reduced_map(r, [r - 1], False))]
    if w is not None:
        ins.append((w, broadcast_map(shape_of(w), shape)))

    def body(b: Body) -> SSAValue:
        mean = b.div(b.args[1], b.const(float(n), ct))
        inv = b.math("rsqrt", b.add(mean, b.const(eps, ct)))
        y = b.mul(b.compute(b.args[0]), inv)
        if w is not None:
            y = b.mul(y, b.convert(b.args[2], ct))
        return b.convert(y, out)

    return e.map(ins, shape, out, body)


def lower_layer_norm(e: Emitter, op: top.LayerNormBase) -> SSAValue:
    x, w, bias = op.input, op.weight, op.bias
    shape = shape_of(x)
    r = len(shape)
    axis = norm_axis(read_int(op.axis), r)
    axes = list(range(axis, r))
    out = elem_of(op.output)
    ct = compute_type(out)
    eps, n = read_float(op.eps), numel(shape[axis:])
    full, red = identity(r), reduced_map(r, axes, False)
    s = e.reduce([(x, full)], shape, axes, False, ct, 0.0,
                 lambda b, acc: b.add(acc, b.compute(b.args[0])))

    def centered(b: Body) -> SSAValue:
        return b.sub(b.compute(b.args[0]), b.div(b.args[1], b.const(float(n), ct)))

    v = e.reduce([(x, full), (s, red)], shape, axes, False, ct, 0.0,
                 lambda b, acc: b.add(acc, b.mul(centered(b), centered(b))))
    ins = [(x, full), (s, red), (v, red)]
    if w is not None:
        ins.append((w, broadcast_map(shape_of(w), shape)))
    if bias is not None:
        ins.append((bias, broadcast_map(shape_of(bias), shape)))

    def body(b: Body) -> SSAValue:
        var = b.div(b.args[2], b.const(float(n), ct))
        y = b.div(centered(b), b.math("sqrt", b.add(var, b.const(eps, ct))))
        k = 3
        if w is not None:
            y = b.mul(y, b.convert(b.args[k], ct))
            k += 1
        if bias is not None:
            y = b.add(y, b.convert(b.args[k], ct))
        return b.convert(y, out)

    return e.map(ins, shape, out, body)


def lower_rope(e: Emitter, op: top.RopeBase) -> SSAValue:
    x, cos, sin = op.input, op.cos, op.sin
    shape = shape_of(x)
    r, dd = len(shape), shape[-1]
    mode = op.rope_mode
    out = elem_of(op.output)
    ct = compute_type(out)
    ins = [(x, identity(r)), (cos, broadcast_map(shape_of(cos), shape)),
           (sin, broadcast_map(shape_of(sin), shape))]

    def body(b: Body) -> SSAValue:
        idx = [b.index(i) for i in range(r)]
        last = idx[-1]
        if mode == RopeMode.HALF:
            h = b.idx(dd // 2)
            first = b.cmp("lt", last, h)  # rotate_half: [-x2, x1]
            partner = b.select(first, b.add(last, h), b.sub(last, h))
        else:
            even = b.cmp("eq", b._ins(arith.AndIOp(last, b.idx(1))), b.idx(0))
            partner = b._ins(arith.XOrIOp(last, b.idx(1)))  # pairs (x0, x1) -> (-x1, x0)
            first = even
        other = b.compute(b.extract(x, [*idx[:-1], partner]))
        rot = b.select(first, b.neg(other), other)
        xv = b.compute(b.args[0])
        y = b.add(b.mul(xv, b.convert(b.args[1], ct)), b.mul(rot, b.convert(b.args[2], ct)))
        return b.convert(y, out)

    return e.map(ins, shape, out, body)


def lower_matmul(e: Emitter, op: top.MatMulBase) -> SSAValue:
    a, bm, bias = op.lhs, op.rhs, op.bias
    ta, tb = read_bool(op.transpose_a), read_bool(op.transpose_b)
    sa, sb = shape_of(a), shape_of(bm)
    out_shape = shape_of(op.output)
    out = elem_of(op.output)
    ct = compute_type(out)
    nb = len(out_shape) - 2
    batch = out_shape[:nb]
    m_, n_, k_ = nb, nb + 1, nb + 2  # loop dims: batch..., m, n, k
    ndims = nb + 3

    def operand_map(s: Shape, rows: int, cols: int) -> AffineMapAttr:
        res = broadcast_results(s[:-2], list(range(nb)), batch) if nb else []
        return amap(ndims, [*res, _d(rows), _d(cols)])

    a_map = operand_map(sa, k_, m_) if ta else operand_map(sa, m_, k_)
    b_map = operand_map(sb, n_, k_) if tb else operand_map(sb, k_, n_)
    if bias is not None:
        init = e.elementwise([bias], out_shape, ct, lambda b: b.compute(b.args[0]))
    else:
        init = e.fill(out_shape, ct, 0.0 if _is_float(ct) else 0)
    acc = e.generic([(a, a_map), (bm, b_map)], init,
                    amap(ndims, [_d(i) for i in range(nb + 2)]),
                    ["parallel"] * (nb + 2) + ["reduction"],
                    lambda b: b.add(b.args[2], b.mul(b.compute(b.args[0]),
                                                     b.compute(b.args[1]))))
    return e.convert(acc, out)


def lower_attention(e: Emitter, op: top.AttentionBase) -> SSAValue:
    q, k, v = op.q, op.k, op.v
    bsz, sq, hq, dh = shape_of(q)
    hkv = shape_of(k)[2]
    dv = shape_of(v)[3]
    rep = hq // hkv
    scale = read_float(op.scale)
    causal = read_bool(op.causal)
    out = elem_of(op.output)
    ct = compute_type(out)
    parts: list[tuple[SSAValue, SSAValue]] = []
    if op.history_k is not None and op.history_v is not None:
        parts.append((op.history_k, op.history_v))
    parts.append((k, v))
    total = sum(shape_of(kk)[1] for kk, _ in parts)
    mask = op.mask
    mask_shape = shape_of(mask) if mask is not None else ()

    # 1. scores per part, [B, Hq, Sq, S_p]: scale * q.k + mask, causal -inf
    scores: list[SSAValue] = []
    off = 0
    for kk, _ in parts:
        sp = shape_of(kk)[1]
        shp = (bsz, hq, sq, sp)
        dot = e.generic(
            [(q, amap(5, [_d(0), _d(2), _d(1), _d(4)])),
             (kk, amap(5, [_d(0), _d(3), _d(1) // rep, _d(4)]))],
            e.fill(shp, ct, 0.0), amap(5, [_d(0), _d(1), _d(2), _d(3)]),
            ["parallel"] * 4 + ["reduction"],
            lambda b: b.add(b.args[2], b.mul(b.compute(b.args[0]), b.compute(b.args[1]))))
        ins = [(dot, identity(4))]

        def body(b: Body, off: int = off) -> SSAValue:
            s = b.mul(b.args[0], b.const(scale, ct))
            if mask is not None:
                # mask [.., Sh + Sk] broadcasts to [B, Hq, Sq, total]: read it by index
                idx = [b.index(i) for i in range(4)]
                idx[3] = b.add(idx[3], b.idx(off))
                lead = 4 - len(mask_shape)
                at = [idx[lead + i] if n != 1 else b.idx(0) for i, n in enumerate(mask_shape)]
                s = b.add(s, b.convert(b.extract(mask, at), ct))
            if causal:
                key = b.add(b.index(3), b.idx(off))
                limit = b.add(b.index(2), b.idx(total - sq))
                s = b.select(b.cmp("gt", key, limit), b.const(-math.inf, ct), s)
            return s

        scores.append(e.map(ins, shp, ct, body))
        off += sp

    # 2. row maximum and sum of exponentials over all parts (history first)
    row = amap(4, [_d(0), _d(1), _d(2)])
    mx: float | SSAValue = -math.inf
    for s in scores:
        mx = e.reduce([(s, identity(4))], shape_of(s), [3], False, ct, mx,
                      lambda b, acc: b.binary("max", acc, b.args[0]))
    assert isinstance(mx, SSAValue)
    sm: float | SSAValue = 0.0
    for s in scores:
        sm = e.reduce([(s, identity(4)), (mx, row)], shape_of(s), [3], False, ct, sm,
                      lambda b, acc: b.add(acc, b.math("exp", b.sub(b.args[0], b.args[1]))))
    assert isinstance(sm, SSAValue)

    # 3. weighted values, [B, Sq, Hq, Dv], loop dims (b, i, h, e, j)
    acc = e.fill((bsz, sq, hq, dv), ct, 0.0)
    for s, (_, vv) in zip(scores, parts, strict=True):
        acc = e.generic(
            [(s, amap(5, [_d(0), _d(2), _d(1), _d(4)])),
             (mx, amap(5, [_d(0), _d(2), _d(1)])),
             (vv, amap(5, [_d(0), _d(4), _d(2) // rep, _d(3)]))],
            acc, amap(5, [_d(0), _d(1), _d(2), _d(3)]), ["parallel"] * 4 + ["reduction"],
            lambda b: b.add(b.args[3], b.mul(b.math("exp", b.sub(b.args[0], b.args[1])),
                                             b.compute(b.args[2]))))
    return e.map([(acc, identity(4)), (sm, amap(4, [_d(0), _d(2), _d(1)]))],
                 (bsz, sq, hq, dv), out,
                 lambda b: b.convert(b.div(b.args[0], b.args[1]), out))


def lower_gather(e: Emitter, op: top.GatherBase) -> SSAValue:
    table, idx = op.table, op.indices
    ts, isz = shape_of(table), shape_of(idx)
    axis = norm_axis(read_int(op.axis), len(ts))
    out_shape = shape_of(op.output)
    out = elem_of(op.output)
    r = len(out_shape)
    ni = len(isz)
    idx_map = amap(r, [_d(axis + i) for i in range(ni)])

    def body(b: Body) -> SSAValue:
        i = b.convert(b.args[0], IndexType())
        n = ts[axis]
        ok = b._ins(arith.AndIOp(b.cmp("ge", i, b.idx(0)), b.cmp("lt", i, b.idx(n))))
        pos = b.clamp(i, 0, n - 1)
        before = [b.index(d) for d in range(axis)]
        after = [b.index(d) for d in range(axis + ni, r)]
        val = b.extract(table, [*before, pos, *after])
        if _is_float(out):  # an out-of-range index reads NaN, never a neighbour's row
            return b.select(ok, val, b.const(math.nan, out))
        return val

    return e.map([(idx, idx_map)], out_shape, out, body)


def _reassoc(groups: list[list[int]]) -> ArrayAttr:
    return ArrayAttr([ArrayAttr([IntegerAttr(i, i64) for i in g]) for g in groups])


def lower_reshape(e: Emitter, op: top.ReshapeBase) -> SSAValue:
    """collapse_shape to 1-D, then expand_shape to the target (MLIR folds the pair where
    a direct reassociation exists); rank 0 uses the empty reassociation."""
    x = op.input
    src, dst = shape_of(x), shape_of(op.output)
    elem = elem_of(x)
    if src == dst:
        return x

    def collapse(v: SSAValue, groups: list[list[int]], shape: Shape) -> SSAValue:
        return e.add(tensord.CollapseShapeOp(
            operands=[v], result_types=[TensorType(elem, list(shape))],
            properties={"reassociation": _reassoc(groups)})).results[0]

    def expand(v: SSAValue, groups: list[list[int]], shape: Shape) -> SSAValue:
        return e.add(tensord.ExpandShapeOp(v, [], _reassoc(groups), list(shape),
                                           TensorType(elem, list(shape)))).results[0]

    if not src:
        return expand(x, [], dst)
    if not dst:
        return collapse(x, [], dst)
    flat = x if len(src) == 1 else collapse(x, [list(range(len(src)))], (numel(src),))
    return flat if len(dst) == 1 else expand(flat, [list(range(len(dst)))], dst)


def lower_permute(e: Emitter, op: top.PermuteBase) -> SSAValue:
    order = read_ints(op.order)
    r = len(order)
    inv = [order.index(j) for j in range(r)]  # input axis j is output axis inv[j]
    return e.map([(op.input, amap(r, [_d(inv[j]) for j in range(r)]))],
                 shape_of(op.output), elem_of(op.output), lambda b: b.args[0])


def lower_expand(e: Emitter, op: top.ExpandBase) -> SSAValue:
    return e.elementwise([op.input], shape_of(op.output), elem_of(op.output),
                         lambda b: b.args[0])


def lower_slice(e: Emitter, op: top.SliceBase) -> SSAValue:
    """out[..., j, ...] = x[..., start + j * step, ...] (an extract: an indexing map that
    reads a larger operand with a pure loop dimension would redefine that loop's range)."""
    x = op.input
    r = len(shape_of(x))
    axis = norm_axis(read_int(op.axis), r)
    start, step = read_int(op.start), read_int(op.step)

    def body(b: Body) -> SSAValue:
        idx = [b.index(i) for i in range(r)]
        idx[axis] = b.add(b.mul(idx[axis], b.idx(step)), b.idx(start))
        return b.extract(x, idx)

    return e.map([], shape_of(op.output), elem_of(op.output), body)


def lower_concat(e: Emitter, op: top.ConcatBase) -> SSAValue:
    xs = list(op.inputs)
    out_shape = shape_of(op.output)
    r = len(out_shape)
    axis = norm_axis(read_int(op.axis), r)
    offsets, o = [], 0
    for x in xs:
        offsets.append(o)
        o += shape_of(x)[axis]

    def body(b: Body) -> SSAValue:
        idx = [b.index(i) for i in range(r)]

        def read(k: int) -> SSAValue:
            n = shape_of(xs[k])[axis]
            local = b.clamp(b.sub(idx[axis], b.idx(offsets[k])), 0, n - 1)
            return b.extract(xs[k], [*idx[:axis], local, *idx[axis + 1:]])

        val = read(len(xs) - 1)
        for k in range(len(xs) - 2, -1, -1):
            val = b.select(b.cmp("lt", idx[axis], b.idx(offsets[k + 1])), read(k), val)
        return val

    return e.map([], out_shape, elem_of(op.output), body)


def lower_conv2d(e: Emitter, op: top.Conv2dBase) -> SSAValue:
    x, w, bias = op.input, op.weight, op.bias
    _, _, h, wd = shape_of(x)
    o, cg, kh, kw = shape_of(w)
    sh, sw = read_ints(op.strides)
    pt, pl, _, _ = read_ints(op.pads)
    dh, dw = read_ints(op.dilations)
    g = read_int(op.groups)
    og = o // g
    out_shape = shape_of(op.output)
    out = elem_of(op.output)
    ct = compute_type(out)
    if bias is not None:
        init = e.map([(bias, amap(4, [_d(1)]))], out_shape, ct,
                     lambda b: b.compute(b.args[0]))
    else:
        init = e.fill(out_shape, ct, 0.0)

    # loop dims (n, o, oh, ow, c, i, j); padding reads zero
    def body(b: Body) -> SSAValue:
        on, oo, oy, ox, ci, ki, kj = (b.index(d) for d in range(7))
        chan = b.add(b.mul(b.div(oo, b.idx(og)), b.idx(cg)), ci)
        y = b.sub(b.add(b.mul(oy, b.idx(sh)), b.mul(ki, b.idx(dh))), b.idx(pt))
        xx = b.sub(b.add(b.mul(ox, b.idx(sw)), b.mul(kj, b.idx(dw))), b.idx(pl))
        inside = b._ins(arith.AndIOp(
            b._ins(arith.AndIOp(b.cmp("ge", y, b.idx(0)), b.cmp("lt", y, b.idx(h)))),
            b._ins(arith.AndIOp(b.cmp("ge", xx, b.idx(0)), b.cmp("lt", xx, b.idx(wd))))))
        val = b.compute(b.extract(x, [on, chan, b.clamp(y, 0, h - 1), b.clamp(xx, 0, wd - 1)]))
        val = b.select(inside, val, b.const(0.0, ct))
        return b.add(b.args[1], b.mul(val, b.compute(b.args[0])))

    acc = e.generic([(w, amap(7, [_d(1), _d(4), _d(5), _d(6)]))], init,
                    amap(7, [_d(0), _d(1), _d(2), _d(3)]),
                    ["parallel"] * 4 + ["reduction"] * 3, body)
    return e.convert(acc, out)


def lower_topk(e: Emitter, op: top.TopKBase) -> list[SSAValue]:
    """k = 1 (argmax / argmin): one reduction carrying the best value and its index; ties
    keep the lowest index, like the interpreter. Larger k (a sort) is not lowered."""
    k = read_int(op.k)
    if k != 1:
        raise LinalgLoweringError(f"{_where(op)}: only k = 1 (argmax/argmin) is lowered, "
                                  f"not k = {k} (sorting has no linalg form)")
    x = op.input
    shape = shape_of(x)
    r = len(shape)
    axis = norm_axis(read_int(op.axis), r)
    largest = read_bool(op.largest, True)
    val_elem, idx_elem = elem_of(op.values), elem_of(op.indices)
    ct = compute_type(val_elem)
    out_shape = shape_of(op.values)
    if _is_float(ct):
        worst: float | int = -math.inf if largest else math.inf
    else:
        w = ct.width.data if isinstance(ct, IntegerType) else 64
        worst = -(2 ** (w - 1)) if largest else 2 ** (w - 1) - 1
    red = reduced_map(r, [axis], True)
    init_v = e.fill(out_shape, ct, worst)
    init_i = e.fill(out_shape, idx_elem, 0)

    def body(b: Body) -> list[SSAValue]:
        xv, best, best_i = b.compute(b.args[0]), b.args[1], b.args[2]
        better = b.cmp("gt" if largest else "lt", xv, best)
        i = b._ins(arith.IndexCastOp(b.index(axis), idx_elem))
        return [b.select(better, xv, best), b.select(better, i, best_i)]

    val, idx = e.generic_n([(x, identity(r))], [(init_v, red), (init_i, red)],
                           ["reduction" if d == axis else "parallel" for d in range(r)], body)
    return [e.convert(val, val_elem), idx]


def lower_cumsum(e: Emitter, op: top.CumSumBase) -> SSAValue:
    """out[..., i, ...] = sum of x[..., j, ...] for j <= i along the axis: a reduction over
    a second loop j that adds only where j <= i, in order of j (f32, like the kernel)."""
    x = op.input
    shape = shape_of(x)
    r = len(shape)
    axis = norm_axis(read_int(op.axis), r)
    out = elem_of(op.output)
    ct = compute_type(out)
    x_map = amap(r + 1, [_d(r) if d == axis else _d(d) for d in range(r)])

    def body(b: Body) -> SSAValue:
        acc = b.args[1]
        keep = b.cmp("le", b.index(r), b.index(axis))
        return b.select(keep, b.add(acc, b.compute(b.args[0])), acc)

    acc = e.generic([(x, x_map)], e.fill(shape, ct, 0), identity_of(r, r + 1),
                    ["parallel"] * r + ["reduction"], body)
    return e.convert(acc, out)


def lower_scatter(e: Emitter, op: top.ScatterBase) -> SSAValue:
    """The input, then each update in order where its index names the position (a
    reduction over the updates: the last one for a position lands, like the kernel; an
    index out of range writes nothing)."""
    x, idx, upd = op.input, op.indices, op.updates
    r = len(shape_of(x))
    axis = norm_axis(read_int(op.axis), r)
    u_map = amap(r + 1, [_d(r) if d == axis else _d(d) for d in range(r)])

    def body(b: Body) -> SSAValue:
        hit = b.cmp("eq", b.convert(b.args[0], IndexType()), b.index(axis))
        return b.select(hit, b.args[1], b.args[2])

    return e.generic([(idx, u_map), (upd, u_map)], x, identity_of(r, r + 1),
                     ["parallel"] * r + ["reduction"], body)


def lower_constant(e: Emitter, op: top.ConstantBase) -> SSAValue:
    value = op.value
    assert isinstance(value, DenseIntOrFPElementsAttr)
    t = value.get_type()
    if isinstance(t, TensorType) and t.element_type == i1:
        value = DenseIntOrFPElementsAttr.from_list(
            TensorType(i8, t.get_shape()), [int(bool(v)) for v in value.get_values()])
    return e.add(arith.ConstantOp(value)).results[0]


def lower_causal_conv1d(e: Emitter, op: top.CausalConv1dBase) -> list[SSAValue]:
    """y[t, c] = sum_j w[c, j] * xs[t + j, c] over `xs = cat(state, x)` (read by index:
    positions before K-1 from the state, rounded to x's type as the kernel does, or zero
    without one), the taps summed in order in f32; new_state[i] = xs[n + i] with n the
    number of real tokens, counted from `valid` by a reduction (a prefix of ones)."""
    x, w, state, valid = op.x, op.weight, op.state, op.valid
    _, t, c = shape_of(x)
    k = shape_of(w)[1]
    xe = elem_of(x)
    ct = compute_type(elem_of(op.output))

    def xs_at(b: Body, pos: SSAValue, ch: SSAValue) -> SSAValue:
        """xs[pos, ch] in f32 (pos in [0, K-1+T))."""
        from_x = b.compute(b.extract(x, [b.idx(0), b.clamp(b.sub(pos, b.idx(k - 1)), 0, t - 1),
                                         ch]))
        if k == 1:
            return from_x
        if state is None:
            from_state = b.const(0.0, ct)
        else:
            s = b.extract(state, [b.idx(0), b.clamp(pos, 0, k - 2), ch])
            from_state = b.compute(b.convert(s, xe))
        return b.select(b.cmp("lt", pos, b.idx(k - 1)), from_state, from_x)

    # y: loop dims (0, t, c, j), reduction over the taps j
    def tap(b: Body) -> SSAValue:
        pos = b.add(b.index(1), b.index(3))
        return b.add(b.args[1], b.mul(xs_at(b, pos, b.index(2)), b.compute(b.args[0])))

    acc = e.generic([(w, amap(4, [_d(2), _d(3)]))], e.fill((1, t, c), ct, 0.0),
                    amap(4, [_d(0), _d(1), _d(2)]), ["parallel"] * 3 + ["reduction"], tap)
    y = e.convert(acc, elem_of(op.output))
    # n = the number of real tokens (valid > 0), [1, 1] i64
    n = e.reduce([(valid, identity(2))], (1, t), [1], True, i64, 0, lambda b, a: b.add(
        a, b.select(b.cmp("gt", b.compute(b.args[0]), b.const(0.0, compute_type(
            elem_of(valid)))), b.const(1, i64), b.const(0, i64))))
    state_elem = elem_of(op.new_state)

    def carried(b: Body) -> SSAValue:
        pos = b.add(b.convert(b.args[0], IndexType()), b.index(1))
        return b.convert(xs_at(b, pos, b.index(2)), state_elem)

    new_state = e.map([(n, amap(3, [_c(0), _c(0)]))], (1, k - 1, c), state_elem, carried)
    return [y, new_state]


def lower_gated_delta_rule(e: Emitter, op: top.GatedDeltaRuleBase) -> list[SSAValue]:
    """An `scf.for` over the tokens carrying the state [1, Hv, Dk, Dv] f32 and the output
    [1, T, Hv, Dv] f32 as iter_args; per token t (read by index; key head h // r for value
    head h): S = S * exp(g_t); kv = k_t S (sum over Dk in order); S = S + k_t^T (beta_t *
    (v_t - kv)); o_t = (scale * q_t) S, inserted as row t. The output rounds to v's type
    after the loop."""
    q, k, v, g, beta, state = op.q, op.k, op.v, op.g, op.beta, op.state
    _, t, hk, dk = shape_of(k)
    _, _, hv, dv = shape_of(v)
    r = hv // hk
    scale = read_float(op.scale)
    s_shape = (1, hv, dk, dv)
    s0 = e.fill(s_shape, f32, 0.0) if state is None else e.convert(state, f32)
    o0 = e.empty((1, t, hv, dv), f32)
    lb, ub, one = (e.add(arith.ConstantOp(IntegerAttr(i, IndexType()))).results[0]
                   for i in (0, t, 1))
    body = Block(arg_types=[IndexType(), s0.type, o0.type])
    i, s, o = body.args
    inner = Emitter(e.root, e.fast_math)

    def at(b: Body, x: SSAValue, *rest: SSAValue) -> SSAValue:
        """x[0, i, rest...] in f32."""
        return b.compute(b.extract(x, [b.idx(0), i, *rest]))

    # loop dims of the state: (0, h, a, d) with a over Dk and d over Dv; the state is
    # updated in place (each generic writes the tensor it reads element by element), so
    # the loop yields what it was given (one-shot bufferization wants them equivalent)
    all_parallel = ["parallel"] * 4
    decayed = inner.generic([], s, identity(4), all_parallel, lambda b: b.mul(
        b.args[0], b.math("exp", at(b, g, b.index(1)))))

    def key_head(b: Body) -> SSAValue:
        """The key head of the loop's value head (loop dim 1)."""
        return b.div(b.index(1), b.idx(r))

    # kv [1, Hv, 1, Dv]: loop dims (0, h, a, d), a reduced
    kv = inner.reduce([(decayed, identity(4))], s_shape, [2], True, f32, 0.0,
                      lambda b, acc: b.add(acc, b.mul(at(b, k, key_head(b), b.index(2)),
                                                      b.args[0])))

    def update(b: Body) -> SSAValue:
        h, a, d = b.index(1), b.index(2), b.index(3)
        delta = b.mul(b.sub(at(b, v, h, d), b.args[0]), at(b, beta, h))
        return b.add(b.args[1], b.mul(at(b, k, key_head(b), a), delta))

    updated = inner.generic([(kv, amap(4, [_c(0), _d(1), _c(0), _d(3)]))], decayed,
                            identity(4), all_parallel, update)
    scale_c = FloatAttr(scale, f32)

    def read_out(b: Body, acc: SSAValue) -> SSAValue:
        qs = b.mul(at(b, q, key_head(b), b.index(2)),
                   b._ins(arith.ConstantOp(scale_c)))
        return b.add(acc, b.mul(qs, b.args[0]))

    # o_t [1, 1, Hv, Dv]: loop dims (0, h, a, d), a reduced
    row = inner.generic([(updated, identity(4))], inner.fill((1, 1, hv, dv), f32, 0.0),
                        amap(4, [_d(0), _c(0), _d(1), _d(3)]),
                        ["parallel", "parallel", "reduction", "parallel"],
                        lambda b: read_out(b, b.args[1]))
    ins = tensord.InsertSliceOp.get(
        row, o, static_sizes=[1, 1, hv, dv], static_offsets=[0, DYNAMIC_INDEX, 0, 0],
        offsets=[i])
    placed = inner.add(ins).results[0]
    inner.add(scf.YieldOp(updated, placed))
    for op_ in inner.ops:
        body.add_op(op_)
    loop = e.add(scf.ForOp(lb, ub, one, [s0, o0], body))
    new_state, out = loop.results
    return [e.convert(out, elem_of(op.output)), new_state]


Lowering = Callable[[Emitter, Operation], SSAValue | list[SSAValue]]

#: Top op class -> its lowering (the patterns below dispatch through this table)
LOWERINGS: dict[type[Operation], Lowering] = {
    **{cls: lower_unary for cls in UNARY_OPS},
    top.AddConstOp: lower_const_binary,
    top.SubConstOp: lower_const_binary,
    top.MulConstOp: lower_const_binary,
    top.DivConstOp: lower_const_binary,
    top.AddOp: lower_binary,
    top.SubOp: lower_binary,
    top.MulOp: lower_binary,
    top.DivOp: lower_binary,
    top.MaxOp: lower_binary,
    top.MinOp: lower_binary,
    top.CompareOp: lower_compare,
    top.WhereOp: lower_where,
    top.CastOp: lower_cast,
    top.SoftmaxOp: lower_softmax,
    top.ReduceOp: lower_reduce,
    top.RmsNormOp: lower_rms_norm,
    top.LayerNormOp: lower_layer_norm,
    top.RopeOp: lower_rope,
    top.AttentionOp: lower_attention,
    top.MatMulOp: lower_matmul,
    top.GatherOp: lower_gather,
    top.Conv2dOp: lower_conv2d,
    top.ReshapeOp: lower_reshape,
    top.PermuteOp: lower_permute,
    top.ExpandOp: lower_expand,
    top.ConcatOp: lower_concat,
    top.SliceOp: lower_slice,
    top.ConstantOp: lower_constant,
    top.TopKOp: lower_topk,
    top.CumSumOp: lower_cumsum,
    top.ScatterOp: lower_scatter,
    top.CausalConv1dOp: lower_causal_conv1d,
    top.GatedDeltaRuleOp: lower_gated_delta_rule,
}  # type: ignore[dict-item]


def _rewrite(op: Operation, rewriter: PatternRewriter, fast_math: bool) -> None:
    fn = LOWERINGS[type(op)]
    for v in (*op.operands, *op.results):
        if not isinstance(v.type, TensorType):
            raise LinalgLoweringError(f"{_where(op)}: needs ranked tensors (run shape-infer)")
        _check_type(v.type.element_type, op)
    e = Emitter(op, fast_math)
    result = fn(e, op)
    rewriter.replace(op, e.ops, result if isinstance(result, list) else [result])


# =========================================================================== patterns


@dataclass(frozen=True)
class LowerElementwise(RewritePattern):
    """Unary, scalar, binary, compare, where and cast ops: one broadcasting generic."""

    fast_math: bool = False

    @op_type_rewrite_pattern
    def match_and_rewrite(
        self, op: top.UnaryOp | top.AddConstOp | top.SubConstOp | top.MulConstOp
        | top.DivConstOp | top.AddOp | top.SubOp | top.MulOp | top.DivOp | top.MaxOp
        | top.MinOp | top.CompareOp | top.WhereOp | top.CastOp,
        rewriter: PatternRewriter) -> None:
        if type(op) in LOWERINGS:  # Tpu ops derive from top.UnaryOp too: not lowered here
            _rewrite(op, rewriter, self.fast_math)


@dataclass(frozen=True)
class LowerReductions(RewritePattern):
    """softmax, reduce, rms_norm, layer_norm, cumsum: reductions with f32 accumulation; topk
    with k = 1 (argmax)."""

    fast_math: bool = False

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.SoftmaxOp | top.ReduceOp | top.RmsNormOp
                          | top.LayerNormOp | top.TopKOp | top.CumSumOp,
                          rewriter: PatternRewriter) -> None:
        _rewrite(op, rewriter, self.fast_math)


@dataclass(frozen=True)
class LowerContractions(RewritePattern):
    """matmul (+bias, transposes, batch broadcast), attention (GQA, history, mask, causal),
    conv2d."""

    fast_math: bool = False

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MatMulOp | top.AttentionOp | top.Conv2dOp,
                          rewriter: PatternRewriter) -> None:
        _rewrite(op, rewriter, self.fast_math)


@dataclass(frozen=True)
class LowerDataMovement(RewritePattern):
    """reshape, permute, expand, slice, concat, gather, scatter, rope, constant."""

    fast_math: bool = False

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.ReshapeOp | top.PermuteOp | top.ExpandOp
                          | top.SliceOp | top.ConcatOp | top.GatherOp | top.ScatterOp
                          | top.RopeOp | top.ConstantOp, rewriter: PatternRewriter) -> None:
        _rewrite(op, rewriter, self.fast_math)


@dataclass(frozen=True)
class LowerLinearAttention(RewritePattern):
    """causal_conv1d (taps by index over state and input, the new state from the count of
    real tokens) and gated_delta_rule (an `scf.for` over the tokens carrying the state)."""

    fast_math: bool = False

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.CausalConv1dOp | top.GatedDeltaRuleOp,
                          rewriter: PatternRewriter) -> None:
        _rewrite(op, rewriter, self.fast_math)


# =========================================================================== the pass


def weights_to_arguments(fn: func.FuncOp) -> list[str]:
    """Turn each distinct `top.weight` of `fn` into a trailing function argument (arg
    attribute `top.weight = name`); returns the weight names in argument order."""
    block = fn.body.block
    by_name: dict[str, SSAValue] = {}
    names: list[str] = []
    for op in list(fn.body.walk()):
        if not isinstance(op, top.WeightOp):
            continue
        name = op.tensor_name
        if name not in by_name:
            by_name[name] = block.insert_arg(op.output.type, len(block.args))
            names.append(name)
        op.output.replace_all_uses_with(by_name[name])
        op.detach()
        op.erase()
    if names:
        n_in = len(fn.function_type.inputs.data)
        old = list(fn.arg_attrs.data) if fn.arg_attrs is not None else [
            DictionaryAttr({}) for _ in range(n_in)]
        new = old + [DictionaryAttr({WEIGHT_ARG_ATTR: StringAttr(n), NAME_ATTR: StringAttr(n)})
                     for n in names]
        fn.arg_attrs = ArrayAttr(new)
        fn.function_type = FunctionType.from_lists(
            [a.type for a in block.args], list(fn.function_type.outputs.data))
    return names


def own_buffers(ret: func.ReturnOp) -> None:
    """Give every returned tensor a buffer of its own: a value returned twice, a function
    argument, a reshaped view or a constant is copied by an identity generic first (MLIR
    22's buffer-results-to-out-params crashes on returned views of arguments)."""
    seen: set[SSAValue] = set()
    operands = []
    for v in ret.operands:
        if not isinstance(v.owner, linalg.GenericOp) or v in seen:
            e = Emitter(ret)
            v = e.map([(v, identity(len(shape_of(v))))], shape_of(v), _elem(v),
                      lambda b: b.args[0])
            for o in e.ops:
                o.location = ret.location
                ret.parent_block().insert_op_before(o, ret)  # type: ignore[union-attr]
        seen.add(v)
        operands.append(v)
    ret.operands = operands


#: result attribute marking a function result added by `expose-values` (an intermediate)
VALUE_RES_ATTR = "top.value"


def expose_values(fn: func.FuncOp) -> list[str]:
    """Return every named intermediate of `fn` (each Top op result with a location name,
    except weights and constants) as an extra function result (result attributes
    `top.name = name`, `top.value`), so a JIT run yields the tensors stage comparison
    matches by name. Returns the names in result order."""
    ret = fn.body.block.last_op
    if not isinstance(ret, func.ReturnOp):
        return []
    seen = set(output_names(fn))
    names: list[str] = []
    values: list[SSAValue] = []
    for op in fn.body.block.ops:
        if not op.name.startswith("top.") or isinstance(op, top.WeightOp | top.ConstantOp):
            continue
        for r in op.results:
            n = value_name(r)
            if n is not None and n not in seen:
                seen.add(n)
                names.append(n)
                values.append(r)
    if values:
        n_out = len(ret.operands)
        old = list(fn.res_attrs.data) if fn.res_attrs is not None else [
            DictionaryAttr({}) for _ in range(n_out)]
        ret.operands = [*ret.operands, *values]
        fn.res_attrs = ArrayAttr(old + [DictionaryAttr({NAME_ATTR: StringAttr(n),
                                                        VALUE_RES_ATTR: UnitAttr()})
                                        for n in names])
    return names


@dataclass(frozen=True)
class ConvertTopToLinalgPass(ModulePass):
    """Lower Top to linalg/tensor/arith/math (weights become function arguments)."""

    name = "convert-top-to-linalg"

    #: `arith.fastmath<reassoc,contract>` on float arithmetic: LLVM may vectorize the
    #: reductions (sums in another order, fused multiply-adds); never nnan/ninf (masks
    #: are -inf)
    fast_math: bool = False

    #: also return every named intermediate tensor (result attribute `top.value`): what
    #: `toptpu compare --compare-all` compares against the numpy interpreter's tensors
    expose_values: bool = False

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        funcs = [fn for fn in op.ops if isinstance(fn, func.FuncOp)]
        for fn in funcs:
            if self.expose_values:
                expose_values(fn)
            weights_to_arguments(fn)
            for arg in fn.body.block.args:
                arg._type = _storage_tensor(arg.type)  # noqa: SLF001 - i1 -> i8 storage
        PatternRewriteWalker(
            GreedyRewritePatternApplier([LowerElementwise(self.fast_math),
                                         LowerReductions(self.fast_math),
                                         LowerContractions(self.fast_math),
                                         LowerDataMovement(self.fast_math),
                                         LowerLinearAttention(self.fast_math)]),
            apply_recursively=False,
        ).rewrite_module(op)
        for fn in funcs:
            ret = fn.body.block.last_op
            if isinstance(ret, func.ReturnOp):
                own_buffers(ret)
            outs = [v.type for v in ret.operands] if isinstance(ret, func.ReturnOp) else \
                list(fn.function_type.outputs.data)
            fn.function_type = FunctionType.from_lists(
                [a.type for a in fn.body.block.args], outs)
        left = [o for o in op.walk() if o.name.startswith(("top.", "tpu."))]
        if left:
            o = left[0]
            raise LinalgLoweringError(
                f"convert-top-to-linalg cannot lower {_where(o)}"
                + (f"; {len(left) - 1} more op(s) left" if len(left) > 1 else ""))
