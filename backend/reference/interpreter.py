"""Run a Top (or Tpu) module on numpy inputs, op by op, with the backend kernels.

`Interpreter(module).run(inputs)` returns the function outputs by name and, with
`keep_all=True`, every intermediate tensor by its location name (the names stage
comparison uses). An op is evaluated through its kernel binding (`ShapedOp.KERNEL`,
`kernel_arguments`: the function of `kernels` it names, or of its plugin's module for an
op a plugin adds, called with its operand values and parameters; `evaluate_kernel`), a
structural op (weights, constants, layer groups, collectives) by the evaluator registered
for its class (`@evaluates`). `EVALUATORS` (op class -> evaluator, looked up with
`evaluator_for`) is derived from both; a plugin's ops, registered later, are looked up as
bound (`bound_evaluator`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Dialect, Operation, SSAValue

from toptpu.backend.reference import kernels as K
from toptpu.dialects import dev, top, tpu
from toptpu.dialects.common import (
    ShapedOp,
    constant_value,
    numpy_dtype,
    read_int,
    shape_of,
)
from toptpu.dialects.naming import input_names, output_names, value_name
from toptpu.dialects.plugin_ops import is_plugin_op
from toptpu.dialects.slicing_interface import SlicingInterface
from toptpu.dialects.weight_store import WeightStore, store_for
from toptpu.errors import ToptpuError

Arrays = list[np.ndarray | None]


@dataclass
class EvalContext:
    store: WeightStore | None


Evaluator = Callable[[Operation, Arrays, EvalContext], Sequence[np.ndarray]]

#: op class -> the function computing its results: `evaluate_kernel` for every op of the
#: dialects with a kernel binding, the registered evaluator (`@evaluates`) of a structural
#: op; look ops up with `evaluator_for`
EVALUATORS: dict[type[Operation], Evaluator] = {}


class NoEvaluatorError(NotImplementedError):
    """An op the interpreter has no evaluator for; the message names it."""


def evaluates(*ops: type[Operation]) -> Callable[[Evaluator], Evaluator]:
    """Register the decorated function as the evaluator of `ops` (op classes without a
    kernel binding: `ShapedOp.STRUCTURAL`, or ops of other dialects)."""

    def deco(fn: Evaluator) -> Evaluator:
        for op in ops:
            if op in EVALUATORS:
                raise ValueError(f"'{op.name}' has two evaluators: {EVALUATORS[op].__name__} "
                                 f"and {fn.__name__}")
            EVALUATORS[op] = fn
        return fn

    return deco


def bound_evaluator(cls: type[Operation],
                    table: Mapping[type[Operation], Evaluator] = EVALUATORS
                    ) -> Evaluator | None:
    """The evaluator of op class `cls`: the table's, or `evaluate_kernel` for an op a
    plugin registered (`dialects/plugin_ops.py`: its kernel binding names the plugin's
    kernel); None when it has none."""
    fn = table.get(cls)
    if fn is None and is_plugin_op(cls):
        return evaluate_kernel
    return fn


def evaluator_for(op: Operation, table: Mapping[type[Operation], Evaluator] = EVALUATORS
                  ) -> Evaluator:
    """The evaluator of `op`'s class; NoEvaluatorError naming the op when it has none."""
    fn = bound_evaluator(type(op), table)
    if fn is None:
        raise NoEvaluatorError(f"the interpreter has no evaluator for '{op.name}' "
                               f"({type(op).__module__}.{type(op).__qualname__}); give its "
                               "class a kernel binding (`ShapedOp.KERNEL`) or register one "
                               "with @evaluates in backend/reference/interpreter.py")
    return fn


# --------------------------------------------------------------------------- kernel binding


class KernelBindingError(LookupError):
    """An op class that names a function its kernel module does not have."""


@functools.cache
def kernel_of(cls: type[ShapedOp], which: str | None = None) -> Callable[..., object]:
    """The function of its `KERNEL_MODULE` (`kernels`, or a plugin's module) op class `cls`
    names: its kernel (`ShapedOp.kernel_name`), or `which` (one of its
    `REDUCTION_KERNELS`)."""
    name = cls.kernel_name() if which is None else which
    where = ("backend/reference/kernels.py" if cls.KERNEL_MODULE == K.__name__
             else cls.KERNEL_MODULE)
    module = K if cls.KERNEL_MODULE == K.__name__ else importlib.import_module(
        cls.KERNEL_MODULE)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise KernelBindingError(f"'{cls.name}' names the kernel '{name}', which "
                                 f"{where} does not define")
    return fn


def _results(out: object) -> Sequence[np.ndarray]:
    """A kernel's result as the op's results: an array, or a tuple of them."""
    return out if isinstance(out, tuple) else (out,)


def evaluate_kernel(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """The evaluator of every op with a kernel binding: its kernel called with
    `op.kernel_arguments(args)` (the result types are among its parameters)."""
    assert isinstance(op, ShapedOp)
    positional, keywords = op.kernel_arguments(args)
    return _results(kernel_of(type(op))(*positional, **keywords))


def _bound_ops() -> list[type[ShapedOp]]:
    """The op classes of the dialects with a kernel binding."""
    dialects: tuple[Dialect, ...] = (top.Top, tpu.Tpu, dev.Dev)
    return [op for d in dialects for op in d.operations
            if issubclass(op, ShapedOp) and not op.STRUCTURAL]


# --------------------------------------------------------------------------- structural ops


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


@evaluates(top.ConstantOp, tpu.ConstantOp)
def _constant(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    assert isinstance(op, top.ConstantBase)
    return [constant_value(op.value)]


# ------------------------------------------------------------------ reduction parts


def reduction_part(op: Operation, args: Arrays, acc: np.ndarray | None, part: int = 0
                   ) -> np.ndarray:
    """Fold reduction part `part` of `op` (whose class declares `REDUCTION_KERNELS`, its
    operands `args` the part's: K columns of a matmul, keys of an attention) into its f32
    accumulator (`tpu.accumulator_type`; None: the first part); returns the new one."""
    assert isinstance(op, ShapedOp) and op.REDUCTION_KERNELS is not None
    positional, keywords = op.reduction_part_arguments(args, part)
    fold = kernel_of(type(op), op.REDUCTION_KERNELS[0])
    return fold(acc, *positional, **keywords)  # type: ignore[return-value]  # an array


def reduction_finish(op: Operation, args: Arrays, acc: np.ndarray) -> np.ndarray:
    """The result of `op` from its accumulator after the last reduction part (`args`: that
    part's operands): a matmul's sum plus its bias, rounded; an attention's weighted
    values over the sum (with the log-sum-exp for a `tpu.attention_part`)."""
    assert isinstance(op, ShapedOp) and op.REDUCTION_KERNELS is not None
    positional, keywords = op.reduction_finish_arguments(args)
    finish = kernel_of(type(op), op.REDUCTION_KERNELS[1])
    return finish(acc, *positional, **keywords)  # type: ignore[return-value]  # an array


@evaluates(tpu.GroupOp)
def _group(op: Operation, args: Arrays, ctx: EvalContext) -> Sequence[np.ndarray]:
    """Run a layer group slice by slice, as the machine does (without its memories): a
    group with reduction parts folds each part into its accumulator and has each tile's
    result after its last part (`tpu.GroupOp`). Each slice runs the group's template: its
    loads, compute ops and stores, each in program order (a load reads only the group's
    inputs, a store writes only its results)."""
    assert isinstance(op, tpu.GroupOp)
    block = op.body.block
    loads, computes, stores = op.template()
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
        fetched = []  # buffers of the fetched experts: filled once their indices exist
        for load in loads:
            full = env[load.input]
            at_window = (tuple(slice(None) for _ in full.shape)
                         if read_int(load.slice_axis) == -1
                         else op.slice_window(load, i, full.shape))
            window = full[at_window]
            first = (at_window[0].start or 0) if at_window else 0  # a block's first row
            if load.by_index is not None and shape_of(load.output)[0] != window.shape[0]:
                fetched.append((load, window, first))
            else:
                local[load.output] = window
        for inner in computes:
            for load, window, first in fetched:
                if load.output not in local and load.output in inner.operands:
                    local[load.output] = fetched_rows(load, window, local, first)
            operands = operand_arrays(inner, local)
            if parts > 1:  # the group's one op, a reduction split in parts
                acc = reduction_part(inner, operands, None if at == 0 else acc, at)
                if at == parts - 1:
                    local[inner.results[0]] = reduction_finish(inner, operands, acc)
                continue
            res = evaluate_op(inner, operands, ctx)
            for r, arr in zip(inner.results, res, strict=True):
                local[r] = arr
        if at < parts - 1:
            continue  # the tile's result exists after its last part
        for store in stores:
            if store.output not in outs:
                t = store.output.type
                assert isinstance(t, TensorType)
                outs[store.output] = np.zeros(tuple(t.get_shape()),
                                              numpy_dtype(t.element_type))
            dst = outs[store.output]
            part = local[store.input]
            if read_int(store.slice_axis) == -1:
                dst[...] = part
            else:
                dst[op.slice_window(store, i, dst.shape)] = part
    term = block.last_op
    assert term is not None
    return [outs[v] for v in term.operands]


def fetched_rows(load: tpu.LoadOp, window: np.ndarray, local: Mapping[SSAValue, np.ndarray],
                 first: int = 0) -> np.ndarray:
    """A buffer of the fetched experts (`tpu.load` `by_index` with fewer rows than its
    window, the rows `first` .. of its input): the rows of `window` its consumer's indices
    name, ascending, in its first rows, the others zero (what the machine's indexed load
    writes)."""
    (use, *_) = load.output.uses
    consumer = use.operation
    assert isinstance(consumer, SlicingInterface)
    index = consumer.operands[consumer.fetched_by_index()[use.index]]
    picks = np.asarray(local[index]).astype(np.int64)
    rows = np.unique(picks[(picks >= first) & (picks < first + window.shape[0])]) - first
    out = np.zeros((shape_of(load.output)[0], *window.shape[1:]), window.dtype)
    if rows.size > out.shape[0]:
        raise IndexError(f"{load.name}: the indices name {rows.size} rows, its buffer holds "
                         f"{out.shape[0]}")
    out[:rows.size] = window[rows]
    return out


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
    device order): its kernel's sum or concatenation."""
    if len(parts) != op.device_count:
        raise CollectiveError(f"'{op.name}' joins {op.device_count} devices, {len(parts)} "
                              "ran it")
    positional, keywords = op.kernel_arguments(parts)
    # the ignore below: a collective's kernel returns one array
    return kernel_of(type(op))(*positional, **keywords)  # type: ignore[return-value]


for _op in _bound_ops():
    evaluates(_op)(evaluate_kernel)


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
