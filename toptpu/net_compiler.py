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
    row_name,
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
from toptpu.pass_pipeline import CompilePipeline, Stage, spec_text
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.pipelines import machine_passes, run_passes
from toptpu.passes.tensor_parallel import ExpertParallelPass, TensorParallelPass
from toptpu.request import CompileRequest

if TYPE_CHECKING:
    from toptpu.frontends.llm import NetSpec

#: called after the import ("import") and after each pass (its name) with the module and,
#: after a pass, its pipeline text (options included: what `--dump-ir`'s passes.json records)
#: and the stage it belongs to (`toptpu.pass_pipeline.Stage`; "tensor-parallel" for the cut)
OnStep = Callable[[str, ModuleOp, str | None, str | None], None]

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
    #: the passes that made it, as pipeline text (what the model file records)
    pipeline: str = ""


def top_net(net: NetPlan, store: WeightStore, *, on_step: OnStep | None = None,
            exported: Any = None, passes: list[ModulePass] | None = None) -> ModuleOp:
    """The net imported into Top (from `exported`, its torch.export program, when given)
    and through the top stage (`passes`; default: `top-pipeline`'s), its inputs and outputs
    kept by every pass (`check_io`), its history and state inputs checked to be used in
    place."""
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
        on_step("import", module, None, None)
    if passes is None:
        passes = CompilePipeline().stages(ConvertTopToTpuPass(), [])["top"]
    run_stage(module, passes, net.name, "top", store, on_step)
    check_contract_uses(module, net)
    return module


def check_contract_uses(module: ModuleOp, net: NetPlan) -> None:
    """A linear-attention net updates its state in place, a history net attends to its KV
    cache in place (what the runtime's in-place bindings need of Top IR)."""
    if PRESENT_RECURRENT_STATE in net.spec.output_names:
        check_state_in_place(module, net.name)
    elif _contract_base(net.name) in HISTORY_NETS:
        check_reload_free(module, net.name)


def run_stage(module: ModuleOp, passes: list[ModulePass], net: str, stage: Stage,
              store: WeightStore | None, on_step: OnStep | None,
              check: bool = True) -> None:
    """Run a stage's passes on a net, each pass (with `check`) checked to keep the net's
    inputs and outputs as they were before the stage (the net contract the runtime binds by
    name, shape and type) and reported to `on_step`."""
    want = io_specs(module)

    def after(p: ModulePass, m: ModuleOp) -> None:
        if check:
            check_io(net, m, want, f"the pass '{p.name}'")
        if on_step is not None:
            on_step(p.name, m, str(p.pipeline_pass_spec()), stage)

    run_passes(module, passes, after=after, store=store)


def check_io(net: str, module: ModuleOp, want: tuple[list[TensorSpec], list[TensorSpec]],
             what: str) -> None:
    """Refuse a module whose function's inputs or outputs differ from `want` in name, shape,
    element type or number, in one line naming the net, `what` changed it and the input or
    output."""
    got = io_specs(module)
    for kind, w, g in (("input", want[0], got[0]), ("output", want[1], got[1])):
        problem = io_change(kind, w, g)
        if problem is not None:
            raise CompileError(f"net '{net}': {what} breaks the net contract: it {problem} "
                               "(the runtime binds each net's inputs and outputs by name, "
                               "shape and type: backend/contract.py)")


def io_change(kind: str, want: list[TensorSpec], got: list[TensorSpec]) -> str | None:
    """How the `kind`s (input/output) `got` differ from `want`, in a few words; None: not."""
    names_w, names_g = [s.name for s in want], [s.name for s in got]
    if len(want) != len(got):
        gone = [n for n in names_w if n not in names_g]
        new = [n for n in names_g if n not in names_w]
        if len(got) < len(want) and gone:
            return f"dropped {kind} '{gone[0]}'"
        if new:
            return f"added {kind} '{new[0]}'"
        return f"has {len(got)} {kind}s, not {len(want)}"
    for w, g in zip(want, got, strict=True):
        if w.name != g.name:
            return f"renamed {kind} '{w.name}' to '{g.name}'"
        if tuple(w.shape) != tuple(g.shape):
            return f"reshaped {kind} '{w.name}' from {list(w.shape)} to {list(g.shape)}"
        if w.dtype != g.dtype:
            return f"retyped {kind} '{w.name}' from {w.dtype} to {g.dtype}"
    return None


def compile_net(net: NetPlan, request: CompileRequest, store: WeightStore, *,
                on_step: OnStep | None = None, keep_top: bool = False, exported: Any = None,
                machine: bool = True) -> CompiledNet:
    """Compile one net as the request asks: `top_net` (the top stage), the tensor-parallel
    cut, the conversion in the net's mode and the tpu stage, then with `machine` the
    machine stage and codegen on a copy (the net's Tpu IR stays ungrouped); the stages'
    passes are the request's (`CompilePipeline.stages`), every pass checked to keep the
    net's inputs and outputs. `keep_top` keeps the Top module after the top stage."""
    t0 = time.perf_counter()
    stages = net_stages(net, request)
    module = top_net(net, store, on_step=on_step, exported=exported, passes=stages["top"])
    ran = [*stages["top"]]
    splits: dict[str, Split] = {}
    if request.parallel is Parallel.TP and _contract_base(net.name) in TP_NETS:
        splits, cut = cut_for_devices(module, request, store, on_step)
        ran.append(cut)
    elif request.parallel is Parallel.EP and net.spec.per_layer:
        ran.append(cut_experts(module, request, store, on_step))
    top_module = module.clone() if keep_top else None
    try:
        # the conversion chooses the Tpu types of the inputs and outputs: the tpu stage
        # keeps what it gives
        run_stage(module, stages["convert"], net.name, "convert", store, on_step,
                  check=False)
        run_stage(module, stages["tpu"], net.name, "tpu", store, on_step)
    except ToptpuError as e:  # lowering: a mode or weight the net cannot take
        if isinstance(e, CompileError) and str(e).startswith(f"net '{net.name}'"):
            raise
        raise CompileError(f"net '{net.name}': {e}") from e
    ran += stages["convert"] + stages["tpu"]
    program = None
    if machine:
        program = machine_program(net.name, module, request, stages["machine"], on_step)
        ran += stages["machine"]
    ins, outs = (_whole(specs, splits) for specs in io_specs(module))
    return CompiledNet(net.name, net.spec.per_layer, ins, outs, module, top_module, 0,
                       time.perf_counter() - t0, program, splits=splits,
                       pipeline=spec_text(ran))


def net_stages(net: NetPlan, request: CompileRequest) -> dict[Stage, list[ModulePass]]:
    """The passes of each stage of one net: the request's pipeline with the net's
    conversion (its mode, the request's group size and symmetry, its input types) and the
    chip's machine passes."""
    convert = ConvertTopToTpuPass(net.mode, request.quant_group_size, request.symmetric,
                                  request.keep_float, net.spec.keep_input_types)
    return request.pipeline.stages(convert, machine_passes(request.chip))


def machine_program(name: str, module: ModuleOp, request: CompileRequest,
                    passes: list[ModulePass], on_step: OnStep | None) -> Program:
    """The machine stage and codegen on a copy of a net's Tpu module (the model file keeps
    the ungrouped IR), every pass checked to keep its inputs and outputs."""
    want = io_specs(module)

    def after(p: ModulePass, m: ModuleOp) -> None:
        check_io(name, m, want, f"the pass '{p.name}'")
        if on_step is not None:
            on_step(p.name, m, str(p.pipeline_pass_spec()), "machine")

    try:
        return compile_for_machine(module.clone(), request.chip, after=after, passes=passes)
    except CompileError:
        raise
    except ToptpuError as e:  # the machine passes and codegen: what the chip cannot hold
        raise CompileError(f"net '{name}' on {request.chip.name}: {e}") from e


def _contract_base(name: str) -> str | None:
    """The net contract's base name of a net (`block` of `block:16@3`); None for a net
    outside the contract (`toptpu compare`'s decoder layer or whole model)."""
    try:
        return NetName.parse(name).base
    except ContractError:
        return None


def _batch_of(name: str) -> int:
    """The batch of a batch net (`block_cache.b4`: 4), else 0."""
    try:
        return NetName.parse(name).batch
    except ContractError:
        return 0


def cut_for_devices(module: ModuleOp, request: CompileRequest, store: WeightStore,
                    on_step: OnStep | None) -> tuple[dict[str, Split], ModulePass]:
    """Run the tensor-parallel pass on a net (the heads take the lm_head's logits cut by
    vocabulary); how its inputs and outputs end up cut, by name, and the pass."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    n = request.devices
    names = input_names(fn)
    if LOGITS in names:  # the heads read the lm_head's logits, cut by vocabulary
        set_arg_split(fn, names.index(LOGITS), Split(1, n))
    cut = TensorParallelPass(n, request.chip.name)
    _run_cut(module, cut, "tp", store, on_step)
    out = {name: s for i, name in enumerate(input_names(fn))
           if (s := arg_split(fn, i)) is not None}
    out.update({name: s for i, name in enumerate(output_names(fn))
                if (s := result_split(fn, i)) is not None})
    return out, cut


def cut_experts(module: ModuleOp, request: CompileRequest, store: WeightStore,
                on_step: OnStep | None) -> ModulePass:
    """Run the expert-parallel pass on a per-layer net (its IO stays whole); the pass."""
    cut = ExpertParallelPass(request.devices, request.chip.name)
    _run_cut(module, cut, "ep", store, on_step)
    return cut


def _run_cut(module: ModuleOp, cut: ModulePass, strategy: str, store: WeightStore,
             on_step: OnStep | None) -> None:
    """Run a cut over devices on a net, each step reported to `on_step` (under the
    tensor-parallel stage, as the dumps name it); a ShardingError as `--parallel`'s."""

    def after(p: ModulePass, m: ModuleOp) -> None:
        if on_step is not None:
            on_step(p.name, m, str(p.pipeline_pass_spec()), "tensor-parallel")

    try:
        run_passes(module, [cut], after=after, store=store)
    except ShardingError as e:
        raise CompileError(f"--parallel {strategy}: {e}") from e


def _whole(specs: list[TensorSpec], splits: dict[str, Split]) -> list[TensorSpec]:
    """The IO specs of a net's whole tensors (a device's piece made whole again)."""
    return [replace(s, shape=splits[s.name].whole_shape(s.shape)) if s.name in splits else s
            for s in specs]


def io_specs(module: ModuleOp) -> tuple[list[TensorSpec], list[TensorSpec]]:
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
    batch = _batch_of(net)
    # a batch net's row r attends to its own cache (`history_k.r`)
    caches = [(HISTORY_K, HISTORY_V)] if not batch else \
        [(row_name(HISTORY_K, r), row_name(HISTORY_V, r)) for r in range(batch)]
    ok = len(atts) == len(caches) and all(
        att.history_k is args.get(k) and att.history_v is args.get(v)
        for att, (k, v) in zip(atts, caches, strict=True))
    cache_names = {n for pair in caches for n in pair}
    concat_of_cache = [op for op in module.walk() if isinstance(op, top.ConcatOp) and any(
        isinstance(v, BlockArgument) and names[v.index] in cache_names
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
