"""Run a Top (or Tpu) module on numpy inputs, op by op, with the backend kernels.

`Interpreter(module).run(inputs)` returns the function outputs by name and, with
`keep_all=True`, every intermediate tensor by its location name (the names stage
comparison uses). Evaluators are looked up in a table by op name; the Tpu interpreter
adds its own entries to the same table mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue

from toptpu.backend.reference import kernels as K
from toptpu.dialects import top, tpu
from toptpu.dialects.common import (
    ShapedOp,
    constant_value,
    numpy_dtype,
    read_bool,
    read_float,
    read_int,
    read_ints,
    read_str,
    shape_of,
)
from toptpu.dialects.naming import input_names, output_names, value_name
from toptpu.dialects.weight_store import WeightStore, store_for

Arrays = list[np.ndarray | None]


@dataclass
class EvalContext:
    store: WeightStore | None


Evaluator = Callable[[Operation, Arrays, EvalContext], Sequence[np.ndarray]]

EVALUATORS: dict[str, Evaluator] = {}


def evaluates(*names: str) -> Callable[[Evaluator], Evaluator]:
    def deco(fn: Evaluator) -> Evaluator:
        for n in names:
            EVALUATORS[n] = fn
        return fn

    return deco


def _out_dtype(op: Operation, i: int = 0) -> np.dtype:
    t = op.results[i].type
    assert isinstance(t, TensorType)
    return numpy_dtype(t.element_type)


# --------------------------------------------------------------------------- Top evaluators


@evaluates("top.weight", "tpu.weight")
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


@evaluates("top.constant")
def _constant(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ConstantBase)
    return [constant_value(op.value)]


@evaluates(*(op.name for op in top.UNARY_ELEMENTWISE))
def _unary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """Every op of `top.UNARY_ELEMENTWISE`: the kernel of its kind (`top.silu` -> "silu")."""
    kind = op.name.split(".", 1)[1]
    assert args[0] is not None
    return [K.unary(kind, args[0], _out_dtype(op))]


@evaluates("top.gelu")
def _gelu(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.unary("gelu", args[0], _out_dtype(op),
                    approximate=read_str(op.attributes.get("approximate"), "none"))]


@evaluates("top.pow")
def _pow(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.unary("pow", args[0], _out_dtype(op),
                    exponent=read_float(op.attributes["exponent"]))]


@evaluates("top.add_const", "top.sub_const", "top.mul_const", "top.div_const")
def _const_binary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    kind = op.name.split(".", 1)[1].removesuffix("_const")
    assert args[0] is not None
    return [K.binary_const(kind, args[0], read_float(op.attributes["value"]),
                           read_bool(op.attributes.get("reverse")), _out_dtype(op))]


@evaluates("top.add", "top.sub", "top.mul", "top.div", "top.max", "top.min")
def _binary(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    kind = op.name.split(".", 1)[1]
    assert args[0] is not None and args[1] is not None
    return [K.binary(kind, args[0], args[1], _out_dtype(op))]


@evaluates("top.compare")
def _compare(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None and args[1] is not None
    return [K.compare(read_str(op.attributes["predicate"]), args[0], args[1])]


@evaluates("top.where")
def _where(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    c, a, b = args
    assert c is not None and a is not None and b is not None
    return [K.where(c, a, b, _out_dtype(op))]


@evaluates("top.cast")
def _cast(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.cast(args[0], _out_dtype(op))]


@evaluates("top.softmax")
def _softmax(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.softmax(args[0], read_int(op.attributes["axis"]), _out_dtype(op))]


@evaluates("top.reduce")
def _reduce(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    a = op.attributes
    return [K.reduce(args[0], read_str(a["mode"]), read_ints(a["axes"]),
                     read_bool(a["keepdims"]), _out_dtype(op))]


@evaluates("top.rms_norm")
def _rms_norm(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.rms_norm(args[0], args[1], read_float(op.attributes["eps"]), _out_dtype(op))]


@evaluates("top.layer_norm")
def _layer_norm(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.layer_norm(args[0], args[1], args[2], read_float(op.attributes["eps"]),
                         read_int(op.attributes["axis"]), _out_dtype(op))]


@evaluates("top.rope")
def _rope(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, c, s = args
    assert x is not None and c is not None and s is not None
    return [K.rope(x, c, s, read_str(op.attributes["mode"]), _out_dtype(op))]


@evaluates("top.attention")
def _attention(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    q, k, v, mask, hk, hv = args
    assert q is not None and k is not None and v is not None
    return [K.attention(q, k, v, mask, read_float(op.attributes["scale"]), hk, hv,
                        read_bool(op.attributes.get("causal")), _out_dtype(op))]


@evaluates("top.matmul")
def _matmul(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    a, b, bias = args
    assert a is not None and b is not None
    return [K.matmul(a, b, bias, read_bool(op.attributes.get("transpose_a")),
                     read_bool(op.attributes.get("transpose_b")), _out_dtype(op))]


@evaluates("top.gather")
def _gather(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    t, idx = args
    assert t is not None and idx is not None
    return [K.gather(t, idx, read_int(op.attributes["axis"]))]


@evaluates("top.topk")
def _topk(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    a = op.attributes
    vals, idx = K.topk(args[0], read_int(a["k"]), read_int(a["axis"]),
                       read_bool(a.get("largest"), True))
    return [vals, idx]


@evaluates("top.conv2d")
def _conv2d(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, w, b = args
    assert x is not None and w is not None
    a = op.attributes
    return [K.conv2d(x, w, b, read_ints(a["strides"]), read_ints(a["pads"]),
                     read_ints(a["dilations"]), read_int(a["groups"]), _out_dtype(op))]


@evaluates("top.reshape")
def _reshape(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.reshape(args[0], read_ints(op.attributes["shape"]))]


@evaluates("top.permute")
def _permute(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.permute(args[0], read_ints(op.attributes["order"]))]


@evaluates("top.expand")
def _expand(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    return [K.expand(args[0], read_ints(op.attributes["shape"]))]


@evaluates("top.concat")
def _concat(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    return [K.concat([a for a in args if a is not None], read_int(op.attributes["axis"]))]


@evaluates("top.slice")
def _slice(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert args[0] is not None
    a = op.attributes
    axis = read_int(a["axis"]) % args[0].ndim
    return [K.slice_(args[0], axis, read_int(a["start"]), read_int(a["end"]),
                     read_int(a["step"]))]


# --------------------------------------------------------------------------- Tpu evaluators

# Tpu ops share Top's operands and attributes; the result type carries the storage dtype
# the shared evaluators round to.
for _name in [n for n in EVALUATORS if n.startswith("top.")]:
    EVALUATORS["tpu." + _name[4:]] = EVALUATORS[_name]


@evaluates("tpu.a16_matmul")
def _a16_matmul(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    x, q, s, z, b = args
    assert x is not None and q is not None and s is not None
    return [K.a16_matmul(x, q, s, z, b, read_int(op.attributes["weight_bits"]),
                         read_int(op.attributes["group_size"]), _out_dtype(op))]


@evaluates("tpu.group")
def _group(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """Run a layer group slice by slice, as the machine does (without its memories)."""
    assert isinstance(op, tpu.GroupOp)
    block = op.body.block
    s = read_int(op.slices)
    env: dict[SSAValue, np.ndarray] = {}
    for a, v in zip(block.args, args, strict=True):
        assert v is not None
        env[a] = v
    outs: dict[SSAValue, np.ndarray] = {}
    for i in range(s):
        local: dict[SSAValue, np.ndarray] = dict(env)
        for inner in block.ops:
            if isinstance(inner, tpu.LoadOp):
                full = env[inner.input]
                ax = read_int(inner.slice_axis)
                local[inner.output] = full if ax == -1 else _take_slice(full, ax, i, s)
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
                    n = dst.shape[ax] // s
                    index = [slice(None)] * dst.ndim
                    index[ax] = slice(i * n, (i + 1) * n)
                    dst[tuple(index)] = part
            elif isinstance(inner, tpu.YieldOp):
                pass
            else:
                res = evaluate_op(inner, operand_arrays(inner, local), ctx)
                for r, arr in zip(inner.results, res, strict=True):
                    local[r] = arr
    term = block.last_op
    assert term is not None
    return [outs[v] for v in term.operands]


def _take_slice(x: np.ndarray, axis: int, i: int, s: int) -> np.ndarray:
    n = x.shape[axis] // s
    index = [slice(None)] * x.ndim
    index[axis] = slice(i * n, (i + 1) * n)
    return x[tuple(index)]


# --------------------------------------------------------------------------- driver


def operand_arrays(op: Operation, env: Mapping[SSAValue, np.ndarray]) -> Arrays:
    if isinstance(op, ShapedOp):
        return [env[v] if v is not None else None for v in op.operand_groups()]
    return [env[v] for v in op.operands]


def evaluate_op(op: Operation, args: Arrays, ctx: EvalContext,
                table: Mapping[str, Evaluator] = EVALUATORS) -> Sequence[np.ndarray]:
    fn = table.get(op.name)
    if fn is None:
        raise NotImplementedError(f"the interpreter has no evaluator for '{op.name}'")
    return fn(op, args, ctx)


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
                 table: Mapping[str, Evaluator] = EVALUATORS) -> None:
        """`store`: the module's weights; without it, the file the module names (a module
        without weights needs none)."""
        self.module = module
        self.ctx = EvalContext(store_for(module, store))
        self.table = table

    def run(self, inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
            func_name: str | None = None, keep_all: bool = False) -> RunResult:
        fn = find_func(self.module, func_name)
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
