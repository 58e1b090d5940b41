"""`toptpu compile --from-ir DIR -o FILE`: a model file from a `--dump-ir` directory whose IR
a researcher may have edited at any stage (TPU-MLIR deploys from its Top `.mlir`:
`model_deploy.py --mlir`).

What a dump directory holds (`toptpu.ir_dump`): every net's IR after every pass, each file's
pass, stage and sha256 (`passes.json`), the weight store the files name
(`weights.safetensors`: the shared tensors and the representative layers' tensors, as
compiled), and `compile.json` (the model it was made from, the compile request, each net's
inputs and outputs at the import and in the model file).

For each net of the model (the request's nets, split again from the model: they must be the
dump's):

1. the stage it is picked up at: the one file `--ir-stage NET=STAGE` names; else the one
   file edited since the dump (its sha256 differs); else, nothing being edited, the last
   ungrouped Tpu stage (the IR a model file keeps). Two edited files of one net are refused
   (which edit counts is the user's to say: `--ir-stage`);
2. the file parsed (its weights from DIR/weights.safetensors, wherever the directory now
   is) and checked against the net contract as the dump recorded it: the import's inputs and
   outputs for Top IR, the model file's for Tpu IR (one line naming the net, the file and the
   input or output renamed, reshaped, retyped, dropped or added);
3. the passes after it in passes.json run in their stages (the top stage, the conversion,
   the tpu stage), every pass checked to keep the inputs and outputs; the machine stage
   (layer-group, lmem-verify, address-assign, as the dump ran them) and codegen make the
   program. A net picked up at a grouped stage keeps that grouped IR in the model file.

Then the weights are packed as `toptpu compile` packs them: the shared tensors and the
representative layers from the dump's store (each representative layer checked bit for bit
against its tensors derived again from the model, so an edited store cannot go unnoticed),
every other layer derived by the nets' weight recipes from the model's own tensors, read one
layer at a time from the checkpoint `compile.json` names (or the MODEL given, when it
moved). The
header records each net's passes (`NetEntry.pipeline`) and where it was picked up
(`CompileInfo.from_ir`).

Not supported (refused in one line): a dump of a tensor- or expert-parallel compile (its
nets' cuts are not re-derived from IR yet), a dump written before passes.json recorded stages.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import DiagnosticException, ParseError

from toptpu.backend.contract import TensorSpec
from toptpu.backend.formats.llm_file import FromIrInfo, IrStageInfo
from toptpu.compile_options import check_compile_request
from toptpu.compiler import (
    CompiledNets,
    CompilePlan,
    CompileResult,
    Progress,
    finish,
    plan,
    progress_steps,
)
from toptpu.devices import Parallel
from toptpu.dialects import context
from toptpu.dialects.ir_text import IRTextError, one_line, parse_ir
from toptpu.dialects.weight_store import STORE_ATTR, WeightStore, WeightStoreError
from toptpu.errors import CompileError, ToptpuError
from toptpu.ir_dump import COMPILE_FILE, COMPILE_FORMAT, WEIGHTS_FILE, DumpError, Stage, stages
from toptpu.net_compiler import (
    CompiledNet,
    NetPlan,
    OnStep,
    check_contract_uses,
    check_io,
    io_specs,
    machine_program,
    run_stage,
)
from toptpu.pass_pipeline import PipelineTextError, pass_of_spec, spec_text
from toptpu.plugins import available_passes
from toptpu.request import CompileRequest

IO_SPECS = tuple[list[TensorSpec], list[TensorSpec]]
#: the stages of passes.json whose passes run on Top IR (the import has none)
TOP_STAGES = ("import", "top")


@dataclass(frozen=True)
class Dump:
    """A `--dump-ir` directory read for `--from-ir`: its nets' stages, compile.json."""

    directory: str
    stages: dict[str, list[Stage]]
    source: str | None
    request: dict[str, Any]
    #: each net's inputs and outputs: at the import ("import") and in the model file
    io: dict[str, dict[str, IO_SPECS]]

    @property
    def weights_path(self) -> str:
        return os.path.join(self.directory, WEIGHTS_FILE)


def _specs(data: Any, where: str) -> list[TensorSpec]:
    try:
        return [TensorSpec(d["name"], tuple(int(x) for x in d["shape"]), str(d["dtype"]))
                for d in data]
    except (TypeError, KeyError, ValueError) as e:
        raise DumpError(f"{where} is not a list of tensors ({e})") from None


def read_dump(directory: str) -> Dump:
    """The dump directory's nets and compile.json, checked; DumpError naming what is
    missing or malformed."""
    found = stages(directory)
    path = os.path.join(directory, COMPILE_FILE)
    if not os.path.isfile(path):
        raise DumpError(f"{directory} has no {COMPILE_FILE}: it is not the --dump-ir directory "
                        "of a compile that finished (compile again with --dump-ir)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != COMPILE_FORMAT:
            raise DumpError(f"{path} is of format {data.get('format')!r}, not "
                            f"{COMPILE_FORMAT}: dump again with this toptpu")
        request = dict(data["request"])
        io = {net: {key: (_specs(v[key]["inputs"], f"{path}: nets.{net}.{key}"),
                          _specs(v[key]["outputs"], f"{path}: nets.{net}.{key}"))
                    for key in ("import", "model_file")}
              for net, v in data["nets"].items()}
        source = data["source"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DumpError(f"{path} is not the compile.json of --dump-ir ({e})") from None
    for net, seq in found.items():
        if any(s.stage is None for s in seq):
            raise DumpError(f"{directory}/{net}/passes.json records no stages: the dump was "
                            "written by an older toptpu; dump again")
    if not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        raise DumpError(f"{directory} has no {WEIGHTS_FILE} (the weight store its IR names)")
    return Dump(os.path.abspath(directory), found, source if isinstance(source, str) else None,
                request, io)


def parse_stage_picks(values: list[str] | Mapping[str, str] | None) -> dict[str, str]:
    """`--ir-stage NET=STAGE` values as net -> stage."""
    if values is None:
        return {}
    if isinstance(values, Mapping):
        return dict(values)
    out: dict[str, str] = {}
    for v in values:
        net, eq, stage = v.partition("=")
        if not eq or not net or not stage:
            raise CompileError(f"--ir-stage '{v}': give NET=STAGE, e.g. --ir-stage "
                               "block=08-cse.mlir (or block=08)")
        out[net] = stage
    return out


def pick_stage(net: str, seq: list[Stage], asked: str | None) -> tuple[int, bool]:
    """The index of the stage `net` is picked up at, and whether its file was edited."""
    edited = [i for i, s in enumerate(seq) if s.edited()]
    if asked is not None:
        want = asked.removesuffix(".mlir")
        hits = [i for i, s in enumerate(seq)
                if os.path.basename(s.path).removesuffix(".mlir") == want
                or os.path.basename(s.path).split("-", 1)[0] == want]
        if len(hits) != 1:
            names = ", ".join(os.path.basename(s.path) for s in seq)
            raise CompileError(f"--ir-stage {net}={asked}: the net has no such stage (its "
                               f"files: {names})")
        return hits[0], hits[0] in edited
    if len(edited) > 1:
        files = ", ".join(seq[i].file for i in edited)
        raise CompileError(f"net '{net}': {len(edited)} files are edited ({files}); name the "
                           f"one to compile from with --ir-stage {net}=NN")
    if edited:
        return edited[0], True
    ungrouped = [i for i, s in enumerate(seq) if s.stage != "machine"]
    return ungrouped[-1], False


def _load_module(stage: Stage, store: WeightStore) -> ModuleOp:
    try:
        with open(stage.path, "rb") as f:
            module = parse_ir(f.read(), stage.file, context())
    except OSError as e:
        raise CompileError(f"{stage.file}: cannot read it ({e.strerror or e})") from None
    except IRTextError as e:
        raise CompileError(str(e)) from None
    except (ParseError, DiagnosticException) as e:  # located: file:line:column
        raise CompileError(one_line(e)) from None
    module.attributes[STORE_ATTR] = StringAttr(store.uri)
    return module


def _passes(net: str, rest: list[Stage]) -> list[ModulePass]:
    available = available_passes()
    out = []
    for s in rest:
        assert s.spec is not None
        try:
            out.append(pass_of_spec(s.spec, available))
        except PipelineTextError as e:
            raise CompileError(f"net '{net}': {s.file} was made by the pass '{s.spec}', "
                               f"which cannot run here: {e}") from None
    return out


def resume_net(net: NetPlan, dump: Dump, asked: str | None, request: CompileRequest,
               store: WeightStore, on_step: OnStep) -> tuple[CompiledNet, IrStageInfo]:
    """One net compiled from its picked stage (see the module doc)."""
    t0 = time.perf_counter()
    seq = dump.stages[net.name]
    at, edited = pick_stage(net.name, seq, asked)
    picked = seq[at]
    module = _load_module(picked, store)
    level_top = picked.stage in TOP_STAGES
    want = dump.io[net.name]["import" if level_top else "model_file"]
    what = f"{'the edited' if edited else 'the'} file {picked.file}"
    check_io(net.name, module, want, what)
    rest = seq[at + 1:]
    by_stage = {kind: _passes(net.name, [s for s in rest if s.stage == kind])
                for kind in ("top", "convert", "tpu", "machine")}
    unknown = sorted({str(s.stage) for s in rest} - {"top", "convert", "tpu", "machine"})
    if unknown:
        raise CompileError(f"net '{net.name}': passes.json has passes of the stage "
                           f"{unknown[0]}, which --from-ir does not run")
    try:
        run_stage(module, by_stage["top"], net.name, "top", store, on_step)
        if level_top:
            check_contract_uses(module, net)
        run_stage(module, by_stage["convert"], net.name, "convert", store, on_step,
                  check=False)
        run_stage(module, by_stage["tpu"], net.name, "tpu", store, on_step)
    except CompileError:
        raise
    except ToptpuError as e:
        raise CompileError(f"net '{net.name}': {e}") from e
    if not level_top or by_stage["convert"]:
        check_io(net.name, module, dump.io[net.name]["model_file"],
                 f"the passes after {picked.file}")
    program = machine_program(net.name, module, request, by_stage["machine"], on_step)
    ran = [s.spec for s in seq[1:at + 1] if s.spec is not None]
    ran += [spec_text(by_stage[k]) for k in ("top", "convert", "tpu", "machine")
            if by_stage[k]]
    ins, outs = io_specs(module)
    compiled = CompiledNet(net.name, net.spec.per_layer, ins, outs, module, None, 0,
                           time.perf_counter() - t0, program, pipeline=",".join(ran))
    return compiled, IrStageInfo(picked.file, edited)


def compile_from_ir(directory: str, output: str, *, model: str | None = None,
                    ir_stages: list[str] | Mapping[str, str] | None = None,
                    progress: IO[str] | None = sys.stderr) -> CompileResult:
    """A model file at `output` from the `--dump-ir` directory `directory` (see the module
    doc); `model` the model the dump was made from when it is no longer where compile.json
    says; `ir_stages` the stage of some nets (`NET=STAGE`)."""
    t0 = time.perf_counter()
    dump = read_dump(directory)
    picks = parse_stage_picks(ir_stages)
    source = model or dump.source
    if source is None:
        raise CompileError(f"{directory} was dumped from an in-memory model: give the model "
                           "its other layers' weights come from (toptpu compile MODEL "
                           "--from-ir DIR)")
    if not os.path.exists(source):
        raise CompileError(f"{directory}/{COMPILE_FILE} names the model {source}, which no "
                           "longer exists: give its path (toptpu compile MODEL --from-ir DIR)")
    try:
        request = CompileRequest.make(**{**dump.request, "dump_ir": None})
    except TypeError as e:
        raise CompileError(f"{directory}/{COMPILE_FILE}: its request is not one this toptpu "
                           f"takes ({e})") from None
    if request.parallel in (Parallel.TP, Parallel.EP):
        what = "tensor" if request.parallel is Parallel.TP else "expert"
        raise CompileError(f"{directory} is the dump of a {what}-parallel compile; --from-ir "
                           "does not cut nets over devices yet")
    request = check_compile_request(source, output, request)
    if os.path.abspath(output) == os.path.abspath(dump.weights_path):
        raise CompileError(f"-o {output} is the dump's weight store")
    the_plan: CompilePlan = plan(source, request, output=output, progress=progress)
    names = [n.name for n in the_plan.nets]
    if sorted(names) != sorted(dump.stages):
        missing = sorted(set(names) - set(dump.stages))
        extra = sorted(set(dump.stages) - set(names))
        raise CompileError(f"{directory} does not hold the nets of {source} as compiled now "
                           f"(missing: {', '.join(missing) or 'none'}; not of the model: "
                           f"{', '.join(extra) or 'none'})")
    unknown = sorted(set(picks) - set(names))
    if unknown:
        raise CompileError(f"--ir-stage {unknown[0]}=...: the model has no net "
                           f"'{unknown[0]}' (its nets: {', '.join(names)})")
    try:
        store = WeightStore.open(dump.weights_path)
    except (WeightStoreError, OSError) as e:
        raise CompileError(f"{dump.weights_path}: {e}") from None
    bar = Progress(len(the_plan.nets), progress)
    nets: dict[str, CompiledNet] = {}
    where: dict[str, IrStageInfo] = {}
    for net in the_plan.nets:
        bar.start(net.name)
        nets[net.name], where[net.name] = resume_net(
            net, dump, picks.get(net.name), request, store, progress_steps(bar, None))
        bar.finish(nets[net.name].seconds)
    edited = [f"{w.file}" for w in where.values() if w.edited]
    bar.note(f"from {directory}: " + (f"edited {', '.join(edited)}" if edited
                                      else "no file edited"))
    timings = {"load": the_plan.load_seconds}
    timings.update({f"net:{name}": net.seconds for name, net in nets.items()})
    return finish(the_plan, CompiledNets(nets, store), output, bar, timings, t0,
                  from_ir=FromIrInfo(dump.directory, where))
