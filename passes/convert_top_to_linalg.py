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
- Each op lowers itself (`toptpu.dialects.linalg_interface.LinalgLowering`: the
  `lower_to_linalg` of its class, with the builder of `toptpu.dialects.linalg_builder`);
  this pass walks the functions and asks each Top op.
- Not lowered (clear error): `top.topk` with k > 1 (a sort has no linalg form; k = 1, the
  LLM's argmax head, is a reduction carrying value and index), unsigned integer element
  types (arith is signless).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    DictionaryAttr,
    FunctionType,
    IntegerType,
    ModuleOp,
    Signedness,
    StringAttr,
    TensorType,
    UnitAttr,
    i1,
    i8,
)
from xdsl.dialects.linalg import ops as linalg
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
)

from toptpu.dialects import top
from toptpu.dialects.common import shape_of
from toptpu.dialects.linalg_builder import Emitter
from toptpu.dialects.linalg_interface import (
    LinalgLowering,
    LinalgLoweringError,
    identity,
    op_where,
)
from toptpu.dialects.naming import NAME_ATTR, output_names, value_name
from toptpu.dialects.slicing_interface import SlicingInterface
from toptpu.passes.util import require_level

__all__ = ["ConvertTopToLinalgPass", "LinalgLoweringError", "WEIGHT_ARG_ATTR"]

#: arg attribute naming the weight a function argument carries
WEIGHT_ARG_ATTR = "top.weight"


def _storage_tensor(t: Attribute) -> Attribute:
    """A function argument's type as the lowered IR stores it (i1 tensors as i8)."""
    if isinstance(t, TensorType) and t.element_type == i1:
        return TensorType(i8, t.get_shape())
    return t


def _check_type(t: Attribute, op: Operation) -> None:
    if isinstance(t, IntegerType) and t.signedness.data != Signedness.SIGNLESS:
        raise LinalgLoweringError(
            f"{op_where(op)}: element type {t} is not supported by convert-top-to-linalg "
            "(arith is signless); cast to a signless type first"
        )


# =========================================================================== the pattern


@dataclass(frozen=True)
class LowerTopOp(RewritePattern):
    """A Top op replaced by what its `lower_to_linalg` builds (an op that declares why it
    has no lowering, `LINALG_NOT_LOWERED`, is left for the pass to report)."""

    fast_math: bool = False

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, LinalgLowering) or op.LINALG_NOT_LOWERED is not None:
            return
        for v in (*op.operands, *op.results):
            if not isinstance(v.type, TensorType):
                raise LinalgLoweringError(f"{op_where(op)}: needs ranked tensors (run "
                                          "shape-infer)")
            _check_type(v.type.element_type, op)
        e = Emitter(op, self.fast_math)
        result = op.lower_to_linalg(e)
        rewriter.replace(op, e.ops, result if isinstance(result, list) else [result])


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
            v = e.map([(v, identity(len(shape_of(v))))], shape_of(v), _element_type(v),
                      lambda b: b.args[0])
            block = ret.parent_block()
            assert block is not None
            for o in e.ops:
                o.location = ret.location
                block.insert_op_before(o, ret)
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
    op: Operation  # xDSL's BlockOps iterates untyped
    for op in fn.body.block.ops:
        if not isinstance(op, LinalgLowering) or (  # weights, constants
                isinstance(op, SlicingInterface) and op.GLOBAL_SOURCE):
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
            GreedyRewritePatternApplier([LowerTopOp(self.fast_math)]),
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
            why = o.LINALG_NOT_LOWERED if isinstance(o, LinalgLowering) else None
            raise LinalgLoweringError(
                f"convert-top-to-linalg cannot lower {op_where(o)}"
                + (f" ({why})" if why else "")
                + (f"; {len(left) - 1} more op(s) left" if len(left) > 1 else ""))


def _element_type(v: SSAValue) -> Attribute:
    t = v.type
    assert isinstance(t, TensorType), t
    return t.element_type
