"""Run a Top (or Tpu) module on numpy inputs, op by op, with the backend kernels.

`Interpreter(module).run(inputs)` returns the function outputs by name and, with
`keep_all=True`, every intermediate tensor by its location name (the names stage
comparison uses). Evaluators are looked up in a table by op class (`EVALUATORS`,
`evaluator_for`); a Tpu op shares the evaluator of its Top counterpart, the Tpu-only ops
register their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue

from toptpu.backend.reference import kernels as K
from toptpu.dialects import dev, top, tpu
from toptpu.dialects.common import (
    ShapedOp,
    constant_value,
    numpy_dtype,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
)
from toptpu.dialects.naming import input_names, output_names, value_name
from toptpu.dialects.weight_store import WeightStore, store_for
from toptpu.errors import ToptpuError

Arrays = list[np.ndarray | None]


@dataclass
class EvalContext:
    store: WeightStore | None


Evaluator = Callable[[Operation, Arrays, EvalContext], Sequence[np.ndarray]]

#: op class -> the function computing its results (a Tpu op shares its Top counterpart's,
#: see `tpu.TPU_OF_TOP`); look ops up with `evaluator_for`
EVALUATORS: dict[type[Operation], Evaluator] = {}


class NoEvaluatorError(NotImplementedError):
    """An op the interpreter has no evaluator for; the message names it."""


def evaluates(*ops: type[Operation]) -> Callable[[Evaluator], Evaluator]:
    """Register the decorated function as the evaluator of `ops` (op classes)."""

    def deco(fn: Evaluator) -> Evaluator:
        for op in ops:
            if op in EVALUATORS:
                raise ValueError(f"'{op.name}' has two evaluators: {EVALUATORS[op].__name__} "
                                 f"and {fn.__name__}")
            EVALUATORS[op] = fn
        return fn

    return deco


def evaluator_for(op: Operation, table: Mapping[type[Operation], Evaluator] = EVALUATORS
                  ) -> Evaluator:
    """The evaluator of `op`'s class; NoEvaluatorError naming the op when it has none."""
    fn = table.get(type(op))
    if fn is None:
        raise NoEvaluatorError(f"the interpreter has no evaluator for '{op.name}' "
                               f"({type(op).__module__}.{type(op).__qualname__}); register "
                               "one with @evaluates in backend/reference/interpreter.py")
    return fn


def _out_dtype(op: Operation, i: int = 0) -> np.dtype:
    t = op.results[i].type
    assert isinstance(t, TensorType)
    return numpy_dtype(t.element_type)


# --------------------------------------------------------------------------- Top evaluators


@evaluates(top.WeightOp, tpu.WeightOp)
def _weight(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.WeightBase)
    if ctx.store is None:
        raise ValueError("the module uses weights but no weight store was given")
    arr = ctx.store[op.tensor_name]
    want = shape_of(op.output)
    if tuple(arr.shape) != want:
        raise ValueError(
            f"weight '{op.tensor_name}' has shape {list(arr.shape)} in the store but "
            f"{list(want)} in the IR"
        )
    return [arr]


@evaluates(top.ConstantOp)
def _constant(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ConstantBase)
    return [constant_value(op.value)]


@evaluates(*top.UNARY_ELEMENTWISE)
def _unary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """Every op of `top.UNARY_ELEMENTWISE`: the kernel of its kind (`top.silu` -> "silu")."""
    assert isinstance(op, top.UnaryOp) and args[0] is not None
    return [K.unary(op.op_kind(), args[0], _out_dtype(op))]


@evaluates(top.GeluOp)
def _gelu(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.GeluBase) and args[0] is not None
    return [K.unary("gelu", args[0], _out_dtype(op), approximate=op.approximation)]


@evaluates(top.PowOp)
def _pow(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.PowBase) and args[0] is not None
    return [K.unary("pow", args[0], _out_dtype(op), exponent=read_float(op.exponent))]


@evaluates(top.AddConstOp, top.SubConstOp, top.MulConstOp, top.DivConstOp)
def _const_binary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ConstBinaryOp) and args[0] is not None
    kind = op.op_kind().removesuffix("_const")
    return [K.binary_const(kind, args[0], read_float(op.value), read_bool(op.reverse),
                           _out_dtype(op))]


@evaluates(top.AddOp, top.SubOp, top.MulOp, top.DivOp, top.MaxOp, top.MinOp)
def _binary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.BinaryOp) and args[0] is not None and args[1] is not None
    return [K.binary(op.op_kind(), args[0], args[1], _out_dtype(op))]


@evaluates(top.CompareOp)
def _compare(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.CompareBase) and args[0] is not None and args[1] is not None
    return [K.compare(op.compare_predicate, args[0], args[1])]


@evaluates(top.WhereOp)
def _where(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    c, a, b = args
    assert c is not None and a is not None and b is not None
    return [K.where(c, a, b, _out_dtype(op))]


@evaluates(top.CastOp)
def _cast(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.cast(args[0], _out_dtype(op))]


@evaluates(top.SoftmaxOp)
def _softmax(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.SoftmaxBase) and args[0] is not None
    return [K.softmax(args[0], read_int(op.axis), _out_dtype(op))]


@evaluates(top.ReduceOp)
def _reduce(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ReduceBase) and args[0] is not None
    return [K.reduce(args[0], op.reduce_mode, read_ints(op.axes), read_bool(op.keepdims),
                     _out_dtype(op))]


@evaluates(top.RmsNormOp)
def _rms_norm(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.RmsNormBase) and args[0] is not None
    return [K.rms_norm(args[0], args[1], read_float(op.eps), _out_dtype(op))]


@evaluates(top.LayerNormOp)
def _layer_norm(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.LayerNormBase) and args[0] is not None
    return [K.layer_norm(args[0], args[1], args[2], read_float(op.eps), read_int(op.axis),
                         _out_dtype(op))]


@evaluates(top.RopeOp)
def _rope(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, c, s = args
    assert isinstance(op, top.RopeBase)
    assert x is not None and c is not None and s is not None
    return [K.rope(x, c, s, op.rope_mode, _out_dtype(op))]


@evaluates(top.AttentionOp)
def _attention(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    q, k, v, mask, hk, hv = args
    assert isinstance(op, top.AttentionBase)
    assert q is not None and k is not None and v is not None
    return [K.attention(q, k, v, mask, read_float(op.scale), hk, hv, read_bool(op.causal),
                        _out_dtype(op))]


@evaluates(tpu.AttentionPartOp)
def _attention_part(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    q, k, v, mask, _, _ = args
    assert isinstance(op, tpu.AttentionPartOp)
    assert q is not None and k is not None and v is not None
    return [K.attention_part(q, k, v, mask, read_float(op.scale), read_bool(op.causal))]


@evaluates(tpu.AttentionMergeOp)
def _attention_merge(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, tpu.AttentionMergeOp)
    parts = [a for a in args if a is not None]
    return [K.attention_merge(parts, _out_dtype(op))]


@evaluates(top.MatMulOp)
def _matmul(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    a, b, bias = args
    assert isinstance(op, top.MatMulBase) and a is not None and b is not None
    return [K.matmul(a, b, bias, read_bool(op.transpose_a), read_bool(op.transpose_b),
                     _out_dtype(op))]


@evaluates(top.GatherOp)
def _gather(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    t, idx = args
    assert isinstance(op, top.GatherBase) and t is not None and idx is not None
    return [K.gather(t, idx, read_int(op.axis))]


@evaluates(top.TopKOp)
def _topk(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.TopKBase) and args[0] is not None
    vals, idx = K.topk(args[0], read_int(op.k), read_int(op.axis),
                       read_bool(op.largest, True))
    return [vals, idx]


@evaluates(top.ScatterOp)
def _scatter(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, idx, upd = args
    assert isinstance(op, top.ScatterBase) and x is not None and idx is not None \
        and upd is not None
    return [K.scatter(x, idx, upd, read_int(op.axis))]


@evaluates(top.CumSumOp)
def _cumsum(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.CumSumBase) and args[0] is not None
    return [K.cumsum(args[0], read_int(op.axis), _out_dtype(op))]


@evaluates(top.Conv2dOp)
def _conv2d(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, w, b = args
    assert isinstance(op, top.Conv2dBase) and x is not None and w is not None
    return [K.conv2d(x, w, b, read_ints(op.strides), read_ints(op.pads),
                     read_ints(op.dilations), read_int(op.groups), _out_dtype(op))]


@evaluates(top.CausalConv1dOp)
def _causal_conv1d(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, w, state, valid = args
    assert isinstance(op, top.CausalConv1dBase)
    assert x is not None and w is not None and valid is not None
    y, new_state = K.causal_conv1d(x, w, state, valid, _out_dtype(op, 0), _out_dtype(op, 1))
    return [y, new_state]


@evaluates(top.GatedDeltaRuleOp)
def _gated_delta_rule(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    q, k, v, g, beta, state = args
    assert isinstance(op, top.GatedDeltaRuleBase)
    assert q is not None and k is not None and v is not None and g is not None \
        and beta is not None
    o, new_state = K.gated_delta_rule(q, k, v, g, beta, state, read_float(op.scale),
                                      _out_dtype(op, 0))
    return [o, new_state]


@evaluates(top.ReshapeOp)
def _reshape(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ReshapeBase) and args[0] is not None
    return [K.reshape(args[0], read_ints(op.shape))]


@evaluates(top.PermuteOp)
def _permute(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.PermuteBase) and args[0] is not None
    return [K.permute(args[0], read_ints(op.order))]


@evaluates(top.ExpandOp)
def _expand(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ExpandBase) and args[0] is not None
    return [K.expand(args[0], read_ints(op.shape))]


@evaluates(top.ConcatOp)
def _concat(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ConcatBase)
    return [K.concat([a for a in args if a is not None], read_int(op.axis))]


@evaluates(top.SliceOp)
def _slice(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.SliceBase) and args[0] is not None
    axis = read_int(op.axis) % args[0].ndim
    return [K.slice_(args[0], axis, read_int(op.start), read_int(op.end), read_int(op.step))]


# --------------------------------------------------------------------------- Tpu evaluators

# Tpu ops share Top's operands and attributes; the result type carries the storage dtype
# the shared evaluators round to.
for _top_op, _tpu_op in tpu.TPU_OF_TOP.items():
    if _top_op in EVALUATORS and _tpu_op not in EVALUATORS:
        EVALUATORS[_tpu_op] = EVALUATORS[_top_op]


@evaluates(tpu.A16MatMulOp)
def _a16_matmul(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, q, s, z, m, b = args
    assert isinstance(op, tpu.A16MatMulOp)
    assert x is not None and q is not None and s is not None
    return [K.a16_matmul(x, q, s, z, b, read_int(op.weight_bits), read_int(op.group_size),
                         _out_dtype(op), m)]


# ------------------------------------------------------------------ reduction parts


def reduction_part(op: Operation, args: Arrays, acc: np.ndarray | None,
                   first_key: int = 0) -> np.ndarray:
    """Fold one reduction part of `op` (one of `tpu.REDUCTION_OPS`, its operands `args` the
    part's: K columns of a matmul, keys of an attention numbered from `first_key`) into its
    f32 accumulator (`tpu.accumulator_type`; None: the first part); returns the new one."""
    if isinstance(op, tpu.A16MatMulOp):
        x, q, s, z, mins, _ = args
        assert x is not None and q is not None and s is not None
        return K.a16_matmul_part(acc, x, q, s, z, read_int(op.weight_bits),
                                 read_int(op.group_size), mins)
    if isinstance(op, top.MatMulBase):
        a, b, _ = args
        assert a is not None and b is not None
        return K.matmul_part(acc, a, b, read_bool(op.transpose_a), read_bool(op.transpose_b))
    assert isinstance(op, top.AttentionBase)
    q, k, v, mask = args[:4]
    assert q is not None and k is not None and v is not None
    state = (K.attention_start(q, k, v.shape[-1]) if acc is None
             else K.OnlineSoftmax.unpacked(acc))
    K.attention_tile(state, q, k, v, mask, read_float(op.scale), first_key)
    return state.packed()


def reduction_finish(op: Operation, args: Arrays, acc: np.ndarray) -> np.ndarray:
    """The result of `op` from its accumulator after the last reduction part (`args`: that
    part's operands): a matmul's sum plus its bias, rounded; an attention's weighted
    values over the sum (with the log-sum-exp for a `tpu.attention_part`)."""
    if isinstance(op, tpu.A16MatMulOp | top.MatMulBase):
        x = args[0]
        assert x is not None
        bias = args[5] if isinstance(op, tpu.A16MatMulOp) else args[2]
        return K.matmul_finish(acc, bias, _out_dtype(op), x)
    q = args[0]
    assert q is not None
    state = K.OnlineSoftmax.unpacked(acc)
    if isinstance(op, tpu.AttentionPartOp):
        return K.attention_part_finish(state, q)
    return K.attention_finish(state, q, _out_dtype(op))


@evaluates(tpu.GroupOp)
def _group(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """Run a layer group slice by slice, as the machine does (without its memories): a
    group with reduction parts folds each part into its accumulator and has each tile's
    result after its last part (`tpu.GroupOp`)."""
    assert isinstance(op, tpu.GroupOp)
    block = op.body.block
    s = read_int(op.slices)
    parts = op.reduction_parts()
    env: dict[SSAValue, np.ndarray] = {}
    for a, v in zip(block.args, args, strict=True):
        assert v is not None
        env[a] = v
    outs: dict[SSAValue, np.ndarray] = {}
    acc: np.ndarray | None = None
    for i in range(s):
        local: dict[SSAValue, np.ndarray] = dict(env)
        at = op.reduction_part(i)
        for inner in block.ops:
            if isinstance(inner, tpu.LoadOp):
                full = env[inner.input]
                ax = read_int(inner.slice_axis)
                local[inner.output] = full if ax == -1 else full[
                    op.slice_window(inner, i, full.shape)]
            elif parts > 1 and isinstance(inner, tpu.REDUCTION_OPS):
                operands = operand_arrays(inner, local)
                acc = reduction_part(inner, operands, None if at == 0 else acc,
                                     at * _part_keys(inner))
                if at == parts - 1:
                    local[inner.results[0]] = reduction_finish(inner, operands, acc)
            elif isinstance(inner, tpu.StoreOp) and at < parts - 1:
                pass  # the tile's result exists after its last part
            elif isinstance(inner, tpu.StoreOp):
                ax = read_int(inner.slice_axis)
                if inner.output not in outs:
                    t = inner.output.type
                    assert isinstance(t, TensorType)
                    outs[inner.output] = np.zeros(tuple(t.get_shape()),
                                                  numpy_dtype(t.element_type))
                dst = outs[inner.output]
                part = local[inner.input]
                if ax == -1:
                    dst[...] = part
                else:
                    dst[op.slice_window(inner, i, dst.shape)] = part
            elif isinstance(inner, tpu.YieldOp):
                pass
            else:
                res = evaluate_op(inner, operand_arrays(inner, local), ctx)
                for r, arr in zip(inner.results, res, strict=True):
                    local[r] = arr
    term = block.last_op
    assert term is not None
    return [outs[v] for v in term.operands]


def _part_keys(op: Operation) -> int:
    """The keys of one reduction part of an attention (0 for a matmul: no key numbers)."""
    return shape_of(op.k)[1] if isinstance(op, top.AttentionBase) else 0


# --------------------------------------------------------------------------- collectives


class CollectiveError(ToptpuError, ValueError):
    """A collective run where its devices are not (a module cut over devices run as one
    device's, devices that disagree)."""


@evaluates(*dev.COLLECTIVES)
def _collective_alone(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, dev.CollectiveOp)
    raise CollectiveError(f"'{op.name}' combines the values of {op.device_count} devices: "
                          "run the net on all of them together (run_spmd)")


def collective_result(op: dev.CollectiveOp, parts: Sequence[np.ndarray]) -> np.ndarray:
    """What every device holds after the collective `op` of `parts` (one per device, in
    device order): the kernels' sum or concatenation."""
    if len(parts) != op.device_count:
        raise CollectiveError(f"'{op.name}' joins {op.device_count} devices, {len(parts)} "
                              "ran it")
    if isinstance(op, dev.AllReduceOp):
        return K.all_reduce(parts, op.algorithm_name)
    assert isinstance(op, dev.AllGatherOp)
    return K.all_gather(parts, op.gather_axis)


# --------------------------------------------------------------------------- driver


def operand_arrays(op: Operation, env: Mapping[SSAValue, np.ndarray]) -> Arrays:
    if isinstance(op, ShapedOp):
        return [env[v] if v is not None else None for v in op.operand_groups()]
    return [env[v] for v in op.operands]


def evaluate_op(op: Operation, args: Arrays, ctx: EvalContext,
                table: Mapping[type[Operation], Evaluator] = EVALUATORS
                ) -> Sequence[np.ndarray]:
    return evaluator_for(op, table)(op, args, ctx)


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]


def find_func(module: ModuleOp, name: str | None = None) -> func.FuncOp:
    funcs = [op for op in module.ops if isinstance(op, func.FuncOp)]
    if not funcs:
        raise ValueError("the module has no func.func to run")
    if name is None:
        return funcs[0]
    for f in funcs:
        if f.sym_name.data == name:
            return f
    raise ValueError(f"no function @{name}; the module has {[f.sym_name.data for f in funcs]}")


class Interpreter:
    """Evaluate a module's function op by op (Top ops; Tpu adds evaluators)."""

    def __init__(self, module: ModuleOp, store: WeightStore | None = None,
                 table: Mapping[type[Operation], Evaluator] = EVALUATORS) -> None:
        """`store`: the module's weights; without it, the file the module names (a module
        without weights needs none)."""
        self.module = module
        self.ctx = EvalContext(store_for(module, store))
        self.table = table

    def run(self, inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
            func_name: str | None = None, keep_all: bool = False) -> RunResult:
        fn = find_func(self.module, func_name)
        env, values = bind_inputs(fn, inputs, keep_all)
        outputs: dict[str, np.ndarray] = {}
        for op in fn.body.block.ops:
            if isinstance(op, func.ReturnOp):
                for oname, v in zip(output_names(fn), op.operands, strict=True):
                    outputs[oname] = env[v]
                break
            results = evaluate_op(op, operand_arrays(op, env), self.ctx, self.table)
            for r, arr in zip(op.results, results, strict=True):
                env[r] = arr
                if keep_all:
                    n = value_name(r)
                    if n is not None:
                        values[n] = arr
        return RunResult(outputs, values)


def bind_inputs(fn: func.FuncOp, inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
                keep_all: bool = False
                ) -> tuple[dict[SSAValue, np.ndarray], dict[str, np.ndarray]]:
    """The function's arguments bound to `inputs` (by name or in order), each checked
    against its type: the environment, and the inputs by name when `keep_all`."""
    names = input_names(fn)
    args = fn.body.block.args
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            raise ValueError(
                f"inputs do not match @{fn.sym_name.data}({', '.join(names)}): "
                f"missing {missing}, unexpected {extra}"
            )
        seq = [inputs[n] for n in names]
    else:
        seq = list(inputs)
        if len(seq) != len(names):
            raise ValueError(f"@{fn.sym_name.data} takes {len(names)} inputs, got {len(seq)}")
    env: dict[SSAValue, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for name, arg, arr in zip(names, args, seq, strict=True):
        t = arg.type
        assert isinstance(t, TensorType)
        want_shape, want_dt = tuple(t.get_shape()), numpy_dtype(t.element_type)
        arr = np.asarray(arr)
        if tuple(arr.shape) != want_shape:
            raise ValueError(
                f"input '{name}' has shape {list(arr.shape)}, the function expects "
                f"{list(want_shape)}"
            )
        if arr.dtype != want_dt:
            if np.issubdtype(arr.dtype, np.integer) != np.issubdtype(want_dt, np.integer):
                raise ValueError(f"input '{name}' is {arr.dtype}, expected {want_dt}")
            arr = arr.astype(want_dt)
        env[arg] = arr
        if keep_all:
            values[name] = arr
    return env, values


def run_spmd(module: ModuleOp, stores: Sequence[WeightStore | None],
             inputs: Sequence[Mapping[str, np.ndarray] | Sequence[np.ndarray]],
             func_name: str | None = None,
             table: Mapping[type[Operation], Evaluator] = EVALUATORS
             ) -> list[dict[str, np.ndarray]]:
    """Run one function on several devices at once (tensor parallelism): device d with its
    weights `stores[d]` and `inputs[d]`; every op runs on each device, a collective
    (`dev.*`) combines the devices' values (`collective_result`). Returns each device's
    outputs by name."""
    if len(stores) != len(inputs) or not stores:
        raise CollectiveError(f"{len(stores)} weight stores for {len(inputs)} devices' inputs")
    fn = find_func(module, func_name)
    ctxs = [EvalContext(store_for(module, s)) for s in stores]
    envs = [bind_inputs(fn, x)[0] for x in inputs]
    outputs: list[dict[str, np.ndarray]] = [{} for _ in stores]
    for op in fn.body.block.ops:
        if isinstance(op, func.ReturnOp):
            for env, out in zip(envs, outputs, strict=True):
                for oname, v in zip(output_names(fn), op.operands, strict=True):
                    out[oname] = env[v]
            break
        if isinstance(op, dev.CollectiveOp):
            whole = collective_result(op, [env[op.input] for env in envs])
            for env in envs:
                env[op.output] = whole.copy()
            continue
        for env, ctx in zip(envs, ctxs, strict=True):
            results = evaluate_op(op, operand_arrays(op, env), ctx, table)
            for r, arr in zip(op.results, results, strict=True):
                env[r] = arr
    return outputs
