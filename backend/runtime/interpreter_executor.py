"""The interpreter executor: runs a model file's nets with the Tpu interpreter's kernels.

It implements `toptpu.backend.runtime.executor.Executor` over a model file written by
`toptpu.compiler.compile` (layout documented in `toptpu.backend.formats.llm_file`):

- each net's Tpu IR (section `ir:<net>`, generic form) is parsed once, on first use, into
  a flat plan of kernel calls (the evaluators of `toptpu.backend.reference.interpreter`, i.e. the
  backend kernels: one numeric truth);
- weights are zero-copy numpy views of the memory-mapped weight blob; a per-layer net
  reads layer i's weights at its chunk's base plus each tensor's offset inside the
  chunk, laid out as layer i's kind (`LlmFile.layer_weights`);
- buffers are numpy arrays; `Buffer.slot` returns a view, so binding a net's output to a
  KV-cache slot writes the new keys/values straight into the cache.

A net reads all its inputs before it writes any output, so an output bound to a slot of a
buffer that is also an input (decode writes present_k into the cache it reads as
history_k) is safe: the slot being written is masked in that very run.

`tpu.a16_matmul` runs as the kernel's two halves, `kernels.dequantize` then
`kernels.matmul_dequantized`, and the dequantized weights of each (layer, weight) are kept
for later runs; likewise a f16/bf16 weight of `tpu.matmul` (e.g. the lm_head) is upcast to
f32 once (`kernels.f32`, exact) instead of at every call. Both share one bounded cache
(`toptpu.backend.runtime.weight_cache`: `weight_cache_bytes`, by default sized from the
host's free memory; beyond it a quantized weight is kept as its integer offsets, or
converted per call). A decode step then costs its matmuls, not a conversion of every
weight; the numbers are the kernels' own. With the model file's weight cache file open
(`use_weight_cache`, `weight_cache_file`) the forms are read from it instead: the first
prefill converts nothing.

There is no cost model: `modelled_seconds()` is 0.0 (the runtime prints "n/a").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from toptpu.backend.contract import NetInfo
from toptpu.backend.formats.llm_file import WEIGHTS_SECTION, LlmFile, LlmHeader
from toptpu.backend.formats.model_file import ModelFileError
from toptpu.backend.reference import blas_threads
from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import (
    EvalContext,
    Evaluator,
    NoEvaluatorError,
    evaluator_for,
    find_func,
)
from toptpu.backend.runtime.executor import Buffer, Executor, check_bindings, owned, value_for
from toptpu.backend.runtime.weight_cache import WeightCache
from toptpu.backend.runtime.weight_cache_file import StoredForms
from toptpu.backend.runtime.weight_pages import StreamedWeights, WeightPages
from toptpu.dialects.common import ShapedOp, elem_of, numpy_dtype, shape_of
from toptpu.dialects.ir_text import one_line
from toptpu.dialects.naming import input_names, output_names
from toptpu.dialects.top import constant_array, weight_name
from toptpu.errors import ToptpuError


class ExecutorError(ToptpuError, RuntimeError):
    """A net run that cannot proceed (bad binding, unknown net, ...); the message says why."""


@dataclass
class ArrayBuffer:
    """A device buffer of the interpreter executor: a numpy array (or a view of one)."""

    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def slot(self, axis: int, start: int, length: int) -> ArrayBuffer:
        n = self.array.shape[axis]
        if not (0 <= start and length >= 0 and start + length <= n):
            raise ExecutorError(
                f"slot [{start}:{start + length}] along axis {axis} is outside a buffer of "
                f"shape {list(self.shape)}")
        index: list[slice] = [slice(None)] * self.array.ndim
        index[axis] = slice(start, start + length)
        return ArrayBuffer(self.array[tuple(index)])


@dataclass
class _Step:
    op: Operation
    fn: Evaluator
    args: list[int | None]  # value ids of the operands (None: absent optional operand)
    results: list[int]
    qweight: str | None = None  # a16_matmul: the name of its packed weight (cache key)
    scales: str | None = None  # ... of its scales, zero points and mins (None: none)
    zeros: str | None = None
    mins: str | None = None
    float_weight: str | None = None  # matmul with a f16/bf16 weight operand: its name
    rows_product: bool = False  # ... x @ w.T: made a block of w's rows at a time if not kept
    bits: int = 0
    group_size: int = 0
    out_dtype: np.dtype | None = None


class _Plan:
    """A net's function flattened into kernel calls over numbered values."""

    def __init__(self, module: ModuleOp) -> None:
        fn: func.FuncOp = find_func(module)
        ids: dict[SSAValue, int] = {}

        def vid(v: SSAValue) -> int:
            if v not in ids:
                ids[v] = len(ids)
            return ids[v]

        self.inputs = [vid(a) for a in fn.body.block.args]
        #: the function's IO types (shape, numpy dtype name): the header states them too
        self.io_types = [(shape_of(t), numpy_dtype(elem_of(t)).name)
                         for t in (*fn.function_type.inputs, *fn.function_type.outputs)]
        self.input_names = input_names(fn)
        self.output_names = output_names(fn)
        self.weights: list[tuple[str, int, tuple[int, ...]]] = []
        self.constants: list[tuple[int, np.ndarray]] = []
        self.steps: list[_Step] = []
        self.outputs: list[int] = []
        for op in fn.body.block.ops:
            if isinstance(op, func.ReturnOp):
                self.outputs = [vid(v) for v in op.operands]
                break
            if isinstance(op, ShapedOp) and op.SOURCE:
                (r,) = op.results
                name, value = weight_name(r), constant_array(r)
                if name is not None:
                    self.weights.append((name, vid(r), shape_of(r)))
                elif value is not None:
                    self.constants.append((vid(r), value))
                continue
            try:
                fn_ = evaluator_for(op)
            except NoEvaluatorError as e:
                raise ExecutorError(str(e)) from None
            groups = op.operand_groups() if isinstance(op, ShapedOp) else list(op.operands)
            step = _Step(op, fn_, [vid(v) if v is not None else None for v in groups],
                         [vid(r) for r in op.results])
            conv = op.converted_weight() if isinstance(op, ShapedOp) else None
            names = [] if conv is None else [weight_name(groups[i]) for i in conv.operands]
            if conv is not None and conv.form == "a16" and names[0] is not None:
                step.qweight, step.scales, step.zeros, step.mins = names
                step.bits, step.group_size = conv.bits, conv.group_size
                step.out_dtype = numpy_dtype(elem_of(op.results[0]))
            elif conv is not None and conv.form == "f32" and names[0] is not None:
                step.float_weight = names[0]
                step.out_dtype = numpy_dtype(elem_of(op.results[0]))
                params = op.kernel_params() if isinstance(op, ShapedOp) else {}
                step.rows_product = bool(params.get("transpose_b")
                                         and not params.get("transpose_a"))
            self.steps.append(step)
        self.size = len(ids)
        #: every weight the function reads, layer group bodies included
        self.read_weights = sorted({name for op in fn.walk()
                                    if isinstance(op, ShapedOp) and op.SOURCE
                                    and (name := weight_name(op.results[0])) is not None})


class InterpreterExecutor(StreamedWeights, Executor):
    """Runs the nets of a model file with the numpy interpreter (see the module doc)."""

    def __init__(self, model: str | LlmFile, verify_checksums: bool = True,
                 weight_cache_bytes: int | None = None,
                 stream_weights: bool | None = None) -> None:
        blas_threads.policy()  # a bad TOPTPU_BLAS_THREADS is an error now, not mid-run
        self.file = model if isinstance(model, LlmFile) else LlmFile(model, verify_checksums)
        if self.file.meta.parallel is not None:
            n = len(self.file.meta.parallel.devices)
            raise ExecutorError(
                f"'{self.file.path}' is spread over {n} devices; the interpreter runs one: "
                "run it on the machine (executor 'machine')")
        section = self.file.file.sections[WEIGHTS_SECTION]
        self._blob_at = section.offset  # where the weight blob starts in the file
        #: the weight pages released after each run when streaming (`weight_pages`: the
        #: machine's mechanism), and the converted-weight budget capped then as the machine's
        self.pages = WeightPages(self.file.file, section.size, stream_weights)
        self.cache = WeightCache(self.pages.cache_budget(weight_cache_bytes))
        self.meta: LlmHeader = self.file.meta
        self.header: dict[str, Any] = self.file.header  # the JSON form of `meta`
        self._nets = self.file.net_infos()
        self._plans: dict[str, _Plan] = {}
        self._shared = self.file.shared_weights()
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        self._stored: StoredForms | None = None

    def use_weight_cache(self, stored: StoredForms | None) -> None:
        """Read converted weights from this model file's weight cache file (None: stop)."""
        if stored is not None and stored.model is not self.file:
            raise ExecutorError("the weight cache file was opened for another model file")
        self._stored = stored

    @property
    def stored(self) -> StoredForms | None:
        return self._stored

    def _offset(self, layer: int | None, name: str) -> int:
        """The blob offset of weight `name` as layer `layer` reads it (None: shared)."""
        layout = self.file.layout
        if layer is not None and name in layout.chunk_of(layer):
            return layout.layer_offset(layer, name)
        return layout.shared[name].offset

    # ------------------------------------------------------------------ Executor
    def nets(self) -> Mapping[str, NetInfo]:
        return self._nets

    def alloc(self, shape: tuple[int, ...], dtype: str) -> ArrayBuffer:
        return ArrayBuffer(np.zeros(tuple(int(d) for d in shape), np.dtype(dtype)))

    def write(self, buf: Buffer, value: np.ndarray) -> None:
        mine = owned(buf, ArrayBuffer, ExecutorError)
        np.copyto(mine.array, value_for(mine, value, ExecutorError))

    def read(self, buf: Buffer) -> np.ndarray:
        return np.array(owned(buf, ArrayBuffer, ExecutorError).array, copy=True)

    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        info = self._nets.get(net)
        if info is None:
            raise ExecutorError(f"the model has no net '{net}' (it has {sorted(self._nets)})")
        self.file.file.check_unchanged()  # truncated or rewritten under us: one line
        if self.stored is not None:
            self.stored.check_unchanged()
        weights = self._weights_for(info, layer)
        plan = self._plan(net)
        check_bindings(net, info, bindings, lambda b: isinstance(b, ArrayBuffer), ExecutorError)
        mine = cast(Mapping[str, ArrayBuffer], bindings)  # checked just above
        try:
            self._run(net, info, plan, mine, weights, layer)
        finally:
            self._release_weights(net, plan, weights, layer)

    def _run(self, net: str, info: NetInfo, plan: _Plan, mine: Mapping[str, ArrayBuffer],
             weights: Mapping[str, np.ndarray], layer: int | None) -> None:
        vals: list[Any] = [None] * plan.size
        for spec, i in zip(info.inputs, plan.inputs, strict=True):
            vals[i] = mine[spec.name].array.reshape(spec.shape)
        for name, i, shape in plan.weights:
            arr = weights.get(name)
            if arr is None:
                raise ExecutorError(f"net '{net}' reads weight '{name}', which is not in the "
                                    "model file's weight table (corrupt or mismatched file)")
            if arr.shape != shape:
                raise ExecutorError(f"weight '{name}' is {list(arr.shape)} in the blob but "
                                    f"{list(shape)} in net '{net}'")
            vals[i] = arr
        for i, arr in plan.constants:
            vals[i] = arr
        # ops nested in regions (e.g. tpu.group bodies) read weights through the context
        ctx = EvalContext(weights)  # type: ignore[arg-type]  # a name -> array mapping
        for step in plan.steps:
            args = [vals[a] if a is not None else None for a in step.args]
            if step.qweight is not None:
                vals[step.results[0]] = self._a16_matmul(step, args, layer)
                continue
            if step.float_weight is not None:
                blocked = self._float_matmul(step, args, layer)
                if blocked is not None:
                    vals[step.results[0]] = blocked
                    continue
            try:
                res = step.fn(step.op, args, ctx)
            except IndexError as e:  # a gather's index past its table (kernels.gather)
                if not (isinstance(step.op, ShapedOp) and step.op.INDEXES_TABLE):
                    raise
                raise ExecutorError(f"net '{net}': '{step.op.name}': {e}; the ids must be "
                                    "below the table's rows") from None
            for r, arr in zip(step.results, res, strict=True):
                vals[r] = arr
        results = [vals[i] for i in plan.outputs]  # all computed before any write
        for spec, arr in zip(info.outputs, results, strict=True):
            buf = mine[spec.name]
            np.copyto(buf.array, np.asarray(arr).reshape(buf.shape))

    # ------------------------------------------------------------------ internals
    def _release_weights(self, net: str, plan: _Plan, weights: Mapping[str, np.ndarray],
                         layer: int | None) -> None:
        """Release the mapped pages of the weights a run of `net` at `layer` read (when
        streaming: `WeightPages`, as the machine)."""
        def extents() -> list[tuple[int, int]]:
            return [(self._blob_at + self._offset(layer, name), weights[name].nbytes)
                    for name in plan.read_weights if name in weights]

        self.pages.release((net, layer), extents)

    def _float_matmul(self, step: _Step, args: list[Any], layer: int | None
                      ) -> np.ndarray | None:
        """A matmul's f16/bf16 weight in f32 as the machine takes it: the weight cache
        file's form, the cache's (kept while the budget allows), or where the cache keeps
        none the product itself made a block of the weight's rows at a time (returned:
        `WeightCache.f32_rows_product`, a 14B lm_head never converted whole), else the
        whole f32 form made for this call. Sets `args[1]` to the form, or returns the
        product."""
        assert step.float_weight is not None
        weight = args[1]
        assert weight is not None  # the matmul's weight operand
        stored = None if self.stored is None else self.stored.upcast(
            self._offset(layer, step.float_weight))
        if stored is not None:
            args[1] = stored
            return None
        form = self.cache.f32_form((layer, step.float_weight), weight)
        if form is None and step.rows_product:
            x = args[0]
            blocked = self.cache.f32_rows_product(x, weight)
            if blocked is not None:
                return K.matmul_finish(blocked, args[2], step.out_dtype, x)
        args[1] = K.f32(weight) if form is None else form
        return None

    def _a16_matmul(self, step: _Step, args: list[Any], layer: int | None) -> np.ndarray:
        """`kernels.a16_matmul` in its two halves, the dequantized weight kept per layer."""
        x, q, s, z, m, bias = args
        assert step.qweight is not None
        if self.stored is not None and step.scales is not None:
            off = self._offset
            w = self.stored.a16(off(layer, step.qweight), off(layer, step.scales),
                                -1 if step.zeros is None else off(layer, step.zeros),
                                step.bits, step.group_size,
                                -1 if step.mins is None else off(layer, step.mins))
            if w is not None:
                return K.matmul_dequantized(x, w, bias, step.out_dtype)
        return self.cache.a16_product((layer, step.qweight), x, q, s, z, step.bits,
                                      step.group_size, bias, step.out_dtype, mins=m)

    def prepare(self, nets: Sequence[str]) -> None:
        """Parse and check `nets` now (each is otherwise prepared on its first run; see
        `MachineExecutor.prepare`). Unknown names are left out."""
        for net in nets:
            if net in self._nets:
                self._plan(net)

    def _plan(self, net: str) -> _Plan:
        if net not in self._plans:
            try:
                self._plans[net] = _Plan(self.file.net_module(net))
            except ModelFileError:
                raise
            except Exception as e:  # noqa: BLE001 - parse/verify errors of a bad section
                raise ModelFileError(f"'{self.file.path}': the IR of net '{net}' is unusable: "
                                     f"{one_line(e)}; recompile the model") from e
            info, plan = self._nets[net], self._plans[net]
            if (plan.input_names != [s.name for s in info.inputs]
                    or plan.output_names != [s.name for s in info.outputs]):
                raise ModelFileError(f"'{self.file.path}': the IR of net '{net}' does not "
                                     "match the net's IO in the header")
            specs = [(tuple(s.shape), s.dtype) for s in (*info.inputs, *info.outputs)]
            for spec, (have, want) in zip((*info.inputs, *info.outputs),
                                          zip(plan.io_types, specs, strict=True), strict=True):
                if have != want:
                    raise ModelFileError(
                        f"'{self.file.path}': the IR of net '{net}' and the header disagree on "
                        f"'{spec.name}': {have[1]} {list(have[0])} in the IR, {want[1]} "
                        f"{list(want[0])} in the header (from model.hidden_size "
                        f"{self.meta.model.hidden_size}, model.vocab_size "
                        f"{self.meta.model.vocab_size}, shapes.seq_length "
                        f"{self.meta.shapes.seq_length}); recompile the model")
        return self._plans[net]

    def _weights_for(self, info: NetInfo, layer: int | None) -> Mapping[str, np.ndarray]:
        if not info.per_layer:
            if layer is not None:
                raise ExecutorError(f"net '{info.name}' is shared by all layers; run it "
                                    "without layer=")
            return self._shared
        n = self.file.num_layers
        if layer is None or not 0 <= layer < n:
            raise ExecutorError(f"net '{info.name}' is per layer: pass layer= in 0..{n - 1}")
        if layer not in self._layers:
            self._layers[layer] = {**self._shared, **self.file.layer_weights(layer)}
        return self._layers[layer]
