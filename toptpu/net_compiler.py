"""One net, compiled: the one way a net of the net contract becomes Tpu IR and a program.

`compile_net` imports a net into Top (torch.export), runs `top-pipeline`, checks that a
history net attends to its KV cache in place (reload-free) and that a linear-attention net
updates its state in place, cuts it over the devices of a tensor-parallel request, runs
`tpu-pipeline` in the net's mode, then the machine pipeline and codegen on the request's
chip (`toptpu.machine_pipeline`). `toptpu compile` compiles every net of a model file with
it, `toptpu estimate` the nets whose command streams it times (one layer, placeholder
weights), `toptpu compare` its Top and Tpu stages (`top_net`, `compile_net(...,
machine=False)`): the same IR and the same programs everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import BlockArgument, Operation
from xdsl.passes import ModulePass

from toptpu.backend.contract import (
    CONV_STATE,
    GREEDY_HEAD,
    HISTORY_K,
    HISTORY_NETS,
    HISTORY_V,
    LM_HEAD,
    LOGITS,
    PER_LAYER_NETS,
    PRESENT_RECURRENT_STATE,
    RECURRENT_STATE,
    SAMPLE_HEAD,
    STATE_IN_PLACE,
    ContractError,
    NetName,
    TensorSpec,
)
from toptpu.backend.formats.program import Program
from toptpu.devices import Parallel
from toptpu.dialects import top
from toptpu.dialects.common import QuantMode, numpy_dtype
from toptpu.dialects.naming import input_names, output_names
from toptpu.dialects.sharding import (
    ShardingError,
    Split,
    arg_split,
    result_split,
    set_arg_split,
)
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import CompileError, ToptpuError
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes
from toptpu.passes.tensor_parallel import TensorParallelPass
from toptpu.request import CompileRequest

if TYPE_CHECKING:
    from toptpu.frontends.llm import NetSpec

#: called after the import ("import") and after each pass (its name) with the module and,
#: after a pass, its pipeline text (options included: what `--dump-ir`'s passes.json records)
OnStep = Callable[[str, ModuleOp, str | None], None]

#: the nets tensor parallelism cuts over the devices (the embeddings run on device 0)
TP_NETS = (*PER_LAYER_NETS, LM_HEAD, GREEDY_HEAD, SAMPLE_HEAD)


@dataclass(frozen=True)
class NetPlan:
    """One net to compile: what to export, in which mode, under which weight-name prefix
    ("v3." for the nets of the layer variant whose representative is layer 3)."""

    spec: NetSpec
    mode: QuantMode
    weight_prefix: str = ""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class CompiledNet:
    name: str
    per_layer: bool
    inputs: list[TensorSpec]  # the net contract's (a tensor-parallel net's whole tensors)
    outputs: list[TensorSpec]
    tpu: ModuleOp
    top: ModuleOp | None = None  # the Top module after top-pipeline, when kept
    ir_bytes: int = 0
    seconds: float = 0.0
    program: Program | None = None  # the machine's command streams
    stream_bytes: int = 0
    #: a tensor-parallel net's inputs and outputs cut over the devices (by IO name)
    splits: dict[str, Split] = field(default_factory=dict)


def top_net(net: NetPlan, store: WeightStore, *, on_step: OnStep | None = None,
            exported: Any = None) -> ModuleOp:
    """The net imported into Top (from `exported`, its torch.export program, when given)
    and through `top-pipeline`, its history and state inputs checked to be used in place."""
    from toptpu.frontends.fx_importer import ImportError_, import_exported, import_module

    spec = net.spec
    try:
        if exported is None:
            module, _ = import_module(spec.module, spec.args, store=store,
                                      weight_prefix=net.weight_prefix,
                                      input_names=spec.input_names,
                                      output_names=spec.output_names)
        else:
            module, _ = import_exported(exported, module=spec.module, store=store,
                                        weight_prefix=net.weight_prefix,
                                        input_names=spec.input_names,
                                        output_names=spec.output_names)
    except ImportError_ as e:
        raise CompileError(f"net '{net.name}': {e}") from e
    if on_step is not None:
        on_step("import", module, None)
    run_passes(module, top_pipeline_passes(), after=_after(on_step), store=store)
    if PRESENT_RECURRENT_STATE in spec.output_names:
        check_state_in_place(module, net.name)
    elif _contract_base(net.name) in HISTORY_NETS:
        check_reload_free(module, net.name)
    return module


def compile_net(net: NetPlan, request: CompileRequest, store: WeightStore, *,
                on_step: OnStep | None = None, keep_top: bool = False, exported: Any = None,
                machine: bool = True) -> CompiledNet:
    """Compile one net as the request asks (`top_net`, the tensor-parallel cut, tpu-pipeline
    in the net's mode, then with `machine` the machine pipeline and codegen on a copy: the
    net's Tpu IR stays ungrouped). `keep_top` keeps the Top module after top-pipeline."""
    t0 = time.perf_counter()
    module = top_net(net, store, on_step=on_step, exported=exported)
    after = _after(on_step)
    splits: dict[str, Split] = {}
    if request.parallel is Parallel.TP and _contract_base(net.name) in TP_NETS:
        splits = cut_for_devices(module, request, store, after)
    top_module = module.clone() if keep_top else None
    try:
        run_passes(module, tpu_pipeline_passes(net.mode, request.quant_group_size,
                                               request.symmetric,
                                               keep_float=request.keep_float,
                                               keep_input_types=net.spec.keep_input_types),
                   after=after, store=store)
    except ToptpuError as e:  # lowering: a mode or weight the net cannot take
        raise CompileError(f"net '{net.name}': {e}") from e
    program = None
    if machine:
        try:  # on a copy: the net's Tpu IR in the model file is the ungrouped one
            program = compile_for_machine(module.clone(), request.chip, after=after)
        except ToptpuError as e:  # the machine passes and codegen: what the chip cannot hold
            raise CompileError(f"net '{net.name}' on {request.chip.name}: {e}") from e
    ins, outs = (_whole(specs, splits) for specs in _io_specs(module))
    return CompiledNet(net.name, net.spec.per_layer, ins, outs, module, top_module, 0,
                       time.perf_counter() - t0, program, splits=splits)


def _contract_base(name: str) -> str | None:
    """The net contract's base name of a net (`block` of `block:16@3`); None for a net
    outside the contract (`toptpu compare`'s decoder layer or whole model)."""
    try:
        return NetName.parse(name).base
    except ContractError:
        return None


def _after(on_step: OnStep | None) -> Callable[[ModulePass, ModuleOp], None] | None:
    if on_step is None:
        return None
    return lambda p, module: on_step(p.name, module, str(p.pipeline_pass_spec()))


def cut_for_devices(module: ModuleOp, request: CompileRequest, store: WeightStore,
                    after: Callable[[ModulePass, ModuleOp], None] | None) -> dict[str, Split]:
    """Run the tensor-parallel pass on a net (the heads take the lm_head's logits cut by
    vocabulary); how its inputs and outputs end up cut, by name."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    n = request.devices
    names = input_names(fn)
    if LOGITS in names:  # the heads read the lm_head's logits, cut by vocabulary
        set_arg_split(fn, names.index(LOGITS), Split(1, n))
    try:
        run_passes(module, [TensorParallelPass(n, request.chip.name)], after=after,
                   store=store)
    except ShardingError as e:
        raise CompileError(f"--parallel tp: {e}") from e
    out = {name: s for i, name in enumerate(input_names(fn))
           if (s := arg_split(fn, i)) is not None}
    out.update({name: s for i, name in enumerate(output_names(fn))
                if (s := result_split(fn, i)) is not None})
    return out


def _whole(specs: list[TensorSpec], splits: dict[str, Split]) -> list[TensorSpec]:
    """The IO specs of a net's whole tensors (a device's piece made whole again)."""
    return [replace(s, shape=splits[s.name].whole_shape(s.shape)) if s.name in splits else s
            for s in specs]


def _io_specs(module: ModuleOp) -> tuple[list[TensorSpec], list[TensorSpec]]:
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))

    def spec(name: str, t: Any) -> TensorSpec:
        assert isinstance(t, TensorType)
        return TensorSpec(name, tuple(int(d) for d in t.get_shape()),
                          numpy_dtype(t.element_type).name)

    ins = [spec(n, t) for n, t in zip(input_names(fn), fn.function_type.inputs.data,
                                      strict=True)]
    outs = [spec(n, t) for n, t in zip(output_names(fn), fn.function_type.outputs.data,
                                       strict=True)]
    return ins, outs


def check_reload_free(module: ModuleOp, net: str) -> None:
    """A history net must attend to `history_k`/`history_v` as they are (function
    arguments as attention history operands), never through a concatenated copy."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    names = input_names(fn)
    args = {names[a.index]: a for a in fn.body.block.args}
    atts = [op for op in module.walk() if isinstance(op, top.AttentionOp)]
    ok = len(atts) == 1 and atts[0].history_k is args.get(HISTORY_K) and \
        atts[0].history_v is args.get(HISTORY_V)
    concat_of_cache = [op for op in module.walk() if isinstance(op, top.ConcatOp) and any(
        isinstance(v, BlockArgument) and names[v.index] in (HISTORY_K, HISTORY_V)
        for v in op.operands)]
    if not ok or concat_of_cache:
        raise CompileError(
            f"net '{net}': the fuse pass did not turn attention over concat(history, new) into "
            "top.attention with history operands, so decode would copy and reload the KV "
            "cache. The model's attention does not have the form the splitter expects.")


#: the Top ops that take a linear-attention state and return the new one (result 1)
STATE_OPS = {CONV_STATE: "top.causal_conv1d", RECURRENT_STATE: "top.gated_delta_rule"}


def check_state_in_place(module: ModuleOp, net: str) -> None:
    """A linear-attention net must return each new state straight from the one op that
    updates it (`STATE_OPS`), and that op must read the state input as it is: the runtime
    binds a state's input and output to one buffer (updated in place, as the KV cache is),
    so no copy of a state may exist and nothing else may read it."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    ins, outs = input_names(fn), output_names(fn)
    ret = fn.body.block.last_op
    assert ret is not None
    returned = dict(zip(outs, ret.operands, strict=True))
    args = {ins[a.index]: a for a in fn.body.block.args}
    for out, state in STATE_IN_PLACE.items():
        value = returned.get(out)
        owner = getattr(value, "owner", None)
        op_name = STATE_OPS[state]
        arg = args.get(state)
        ok = (isinstance(owner, Operation) and owner.name == op_name
              and len(owner.results) == 2 and owner.results[1] is value)
        if ok and arg is not None and isinstance(owner, Operation):
            ok = arg in owner.operands and all(use.operation is owner for use in arg.uses)
        if not ok:
            raise CompileError(
                f"net '{net}': '{out}' is not the new state of a {op_name} that reads "
                f"'{state}' directly, so the state could not be updated in place (the "
                "fuse/import of the linear-attention layer does not have the form the "
                "splitter emits)")
