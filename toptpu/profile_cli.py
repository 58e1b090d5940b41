"""`toptpu profile MODEL_FILE`: the machine's view of a compiled model.

Runs every net once on the reference machine (per-layer nets with layer 0's weights;
inputs are valid placeholders: token 0, positions 0.., masks that see everything) and
prints per net: modelled time, engine busy fractions, bytes moved, FLOPs, achieved DDR and
peak fractions and the roofline ratio. `--trace` writes a Chrome trace (open it in
Perfetto), `--png DIR` one timeline/roofline picture per net, `--json` the numbers.
Then the generation steps as `toptpu run` charges them (`accounting.StepModel` over the
profiled nets' times, each layer its own net): the time to first token and one decoded
token, itemized by net run and host transfer, so the nets' own times and run's modelled
tokens/s are seen to agree.

`toptpu profile FILE.mlir [--chip NAME]` does the same for grouped and addressed Tpu IR (a
`--dump-ir` file after address-assign, or `toptpu-opt -p tpu-pipeline` output): codegen
makes each function's command streams and the chip model times them — the timeline depends
on the commands and the chip alone — so a hand edit of the IR can be timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.utils.exceptions import DiagnosticException, ParseError

from toptpu.backend.codegen.streams import generate
from toptpu.backend.contract import PENALTY, TEMPERATURE, TOP_K, TOP_P, NetName
from toptpu.backend.formats.program import Program
from toptpu.backend.runtime.accounting import SAMPLERS, Charge, Spread, StepModel, total
from toptpu.backend.runtime.device_executor import machine_executor
from toptpu.backend.runtime.machine import LoadedNet, Timeline
from toptpu.backend.runtime.machine_executor import MachineExecutor, timing_of
from toptpu.backend.runtime.profile import (
    NetProfile,
    profile_timeline,
    profiles_json,
    summary_table,
    write_chrome_trace,
    write_timeline_png,
)
from toptpu.backend.target.chips import DEFAULT_CHIP, Chip, chip_names, get_chip
from toptpu.cli_args import UsageError, int_at_least
from toptpu.dialects import context, tpu
from toptpu.dialects.ir_text import IRVerifyError, one_line, parse_ir
from toptpu.dialects.output_file import note_input
from toptpu.errors import ToptpuError
from toptpu.families import vision_family
from toptpu.ir_dump import PASSES_FILE
from toptpu.passes.machine_verify import MachineIRError, verify_machine_ir
from toptpu.paths import OutputPathError, check_output_dir, check_output_file
from toptpu.progress import progress_bar

#: sampling inputs a profile run feeds 1 (temperature 1, no penalty, top-k 1, top-p 1): zeros
#: would divide 0 by 0 in sample_head; the timeline does not depend on the values
_ONES = (TEMPERATURE, PENALTY, TOP_K, TOP_P)


def _placeholder(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if name == "position_ids":  # [axes, n]: the same text positions on every axis
        return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
    if name in _ONES:
        return np.ones(shape, dtype)
    return np.zeros(shape, dtype)


def profile_model(path: str, nets: list[str] | None = None, quiet: bool = True,
                  ) -> tuple[MachineExecutor, list[NetProfile]]:
    """Each net of the model file `path` (or those of `nets`) run once on the machine, and
    its profile; a progress line over the nets on a terminal unless `quiet`."""
    ex = machine_executor(path)
    unknown = sorted(set(nets or []) - set(ex.nets()))
    if unknown:
        raise UsageError(f"--nets: the model file has no net {', '.join(unknown)}; it has "
                         f"{', '.join(ex.nets())}")
    profiles = []
    chosen = [(n, info) for n, info in ex.nets().items() if not nets or n in nets]
    with progress_bar(len(chosen), "toptpu profile", quiet=quiet, unit="net") as bar:
        for name, info in chosen:
            bar.set_postfix_str(name, refresh=False)
            profiles.append(_profile_net(ex, name, info))
            bar.update(1)
    return ex, profiles


def _profile_net(ex: MachineExecutor, name: str, info: Any) -> NetProfile:
    """One net run once on placeholder inputs, and its profile."""
    bindings = {}
    for spec in info.inputs:
        buf = ex.alloc(spec.shape, spec.dtype)
        ex.write(buf, _placeholder(spec.name, spec.shape, spec.dtype))
        bindings[spec.name] = buf
    for spec in info.outputs:
        bindings[spec.name] = ex.alloc(spec.shape, spec.dtype)
    ex.run(name, bindings, first_layer(ex.meta.layer_nets, name) if info.per_layer
           else None)
    prog = ex.program(name)
    tl = ex.stats[name].timelines[-1]
    fetched = ex.machine.fetched  # what the run's indexed loads read
    return profile_timeline(tl, ex.chip, prog.inherent_bytes(), prog.flops,
                            (sum(f.nbytes for f in fetched), prog.indexed_bytes()[1]))


def first_layer(layer_nets: Mapping[str, Sequence[str]], net: str) -> int:
    """The first layer that runs the per-layer net `net` (a variant `block@3` runs with its
    own layers' weights, whose chunk may be laid out for another layer kind; `block:16@3`
    the layers of `block@3`)."""
    full = str(NetName.parse(net).layer_net)
    return min((i for names in layer_nets.values() for i, n in enumerate(names) if n == full),
               default=0)


# --------------------------------------------------------------------------- the step bill


def step_model(ex: MachineExecutor) -> StepModel:
    """The generation loop's steps charged from the nets' profiled runs: what `toptpu run`
    charges (the machine executor's ledger) without generating."""
    timings = {net: timing_of(st.timelines[-1]) for net, st in ex.stats.items()}
    io = {net: (info.inputs, info.outputs) for net, info in ex.nets().items()}
    par = ex.meta.parallel
    spread = None if par is None else Spread(
        par.strategy, len(par.devices),
        tuple(d.layers for d in par.devices) if par.strategy == "pp" else ())
    return StepModel(ex.chip, io, timings, ex.file.num_layers, ex.meta.layer_nets, spread)


def bill_table(charges: Sequence[Charge], title: str) -> str:
    """A step's charges as a table: each net (its runs) and each host transfer, with its
    share of the step, then the total."""
    step = total(charges)
    width = max([len("what"), *(len(c.what) for c in charges)])
    lines = [title, f"  {'what':<{width}} {'count':>6} {'ms each':>9} {'ms':>9} {'share':>7}"]
    for c in charges:
        ms = c.costs.total_s * 1e3
        lines.append(f"  {c.what:<{width}} {c.count:>6} {ms / c.count:>9.4f} {ms:>9.4f} "
                     f"{c.costs.total_s / step.total_s:>7.1%}")
    lines.append(f"  {'total':<{width}} {'':>6} {'':>9} {step.total_s * 1e3:>9.4f} "
                 f"{1:>7.1%}")
    return "\n".join(lines)


def _figure(chip: Chip, name: str, value: str) -> str:
    """'2412.27 us (host_transfer_us, fitted)': a chip figure, named, with where it comes
    from (fitted to published speeds, assumed, set by the user)."""
    source = chip.sources.get(name, "")
    kind = next((k for k in ("fitted", "assumed", "set by the user") if source.startswith(k)),
                "")
    return f"{value} ({name}{', ' + kind if kind else ''})"


def step_summary(steps: StepModel, prompt_tokens: int, sampler: str) -> str:
    """The time to first token and per decoded token as `toptpu run` models them, itemized,
    and how they relate to the nets' own times (the figures outside the nets)."""
    chip = steps.chip
    first, per = (steps.first_token_charges(prompt_tokens, sampler),
                  steps.per_token_charges(sampler))
    how = {"greedy": "greedy_head picks the token on the chip",
           "sample": "sample_head draws it on the chip",
           "host": "the logits go back to the host"}[sampler]
    t_first, t_per = total(first), total(per)
    nets = t_per.ddr_s + t_per.compute_s
    alone = f"{1 / nets:.1f} tokens/s" if nets else "no time"
    lines = [
        bill_table(first, f"time to first token, a {prompt_tokens}-token prompt ({sampler}: "
                   f"{how}), as `toptpu run` charges it:"),
        bill_table(per, "one decoded token after it, as `toptpu run` charges it:"),
        f"time to first token: {t_first.total_s * 1e3:.4f} ms modelled "
        f"({t_first.bound}-bound)",
        f"decode: {t_per.total_s * 1e3:.4f} ms per token = {1 / t_per.total_s:.1f} tokens/s "
        f"modelled ({t_per.bound}-bound)",
        f"  the nets' engine time alone: {nets * 1e3:.4f} ms per token = {alone}; the rest is "
        "fixed per step on the chip model:",
        f"  {t_per.launches:g} net launches x "
        f"{_figure(chip, 'launch_us', f'{chip.launch_us:g} us')}, {t_per.transfers:g} host "
        "transfers x "
        f"{_figure(chip, 'host_transfer_us', f'{chip.host_transfer_us:g} us')} + their "
        f"{t_per.transfer_bytes:g} bytes at "
        f"{_figure(chip, 'host_gbps', f'{chip.host_gbps:g} GB/s')} on {chip.name} "
        "(docs/estimates.md)",
    ]
    if steps.batch > 1:  # the batch nets: a decode step of B conversations
        b = steps.batch
        charges = steps.batch_step_charges(sampler)
        step = total(charges).total_s
        lines += [bill_table(charges, f"one decode step of {b} conversations on the batch "
                                      "nets (`toptpu serve`):"),
                  f"decode at batch {b}: {step * 1e3:.4f} ms per step = {1 / step:.1f} "
                  f"tokens/s per user, {b / step:.1f} tokens/s in total "
                  f"({b / step * t_per.total_s:.2f}x batch 1)"]
    return "\n".join(lines)


def steps_json(steps: StepModel, prompt_tokens: int, sampler: str) -> dict[str, Any]:
    def bill(charges: Sequence[Charge]) -> dict[str, Any]:
        return {**total(charges).to_json(),
                "charges": [{"kind": c.kind, "what": c.what, "count": c.count,
                             "seconds": c.costs.total_s} for c in charges]}

    per = steps.per_token(sampler)
    batch = None
    if steps.batch > 1:
        step = steps.batch_step(sampler).total_s
        batch = {"batch": steps.batch, "step": bill(steps.batch_step_charges(sampler)),
                 "tokens_per_s_per_user": 1 / step, "tokens_per_s_total": steps.batch / step}
    return {"sampler": sampler, "prompt_tokens": prompt_tokens,
            "first_token": bill(steps.first_token_charges(prompt_tokens, sampler)),
            "per_decoded_token": bill(steps.per_token_charges(sampler)),
            "tokens_per_s": 1 / per.total_s if per.total_s else None,
            "batch": batch}


class ProfileIRError(ToptpuError):
    """IR that `toptpu profile FILE.mlir` does not time: it does not parse or verify, or it
    is not IR the machine could run (the message names where and why)."""


def read_machine_ir(path: str, chip: Chip) -> ModuleOp:
    """The grouped, allocated, addressed Tpu IR of `path`, checked as the machine needs it
    before anything is timed: it parses and verifies, every function has its addresses,
    and `passes.machine_verify` (lmem-verify's local memory checks, the slices, the global
    addresses against the regions, no empty tensor) holds. ProfileIRError otherwise."""
    if not os.path.isfile(path):
        raise UsageError(f"'{path}' is not a readable file")
    with open(path, "rb") as f:
        note_input(f.fileno(), path)
        data = f.read()
    try:
        module = parse_ir(data, path, context())
    except (ParseError, IRVerifyError, DiagnosticException) as e:
        line = one_line(e)
        raise ProfileIRError(line if line.startswith(path) else f"{path}: {line}") from None
    for fn in module.ops:
        if isinstance(fn, func.FuncOp) and tpu.regions_of(fn) is None:
            raise UsageError(f"{path}: @{fn.sym_name.data} is not grouped and addressed Tpu "
                             "IR: profile the output of tpu-pipeline{chip=...} (or of "
                             "machine-pipeline), e.g. the --dump-ir file after address-assign")
    try:
        verify_machine_ir(module, chip)
    except MachineIRError as e:
        raise ProfileIRError(f"{path}: {e}") from None
    return module


def ir_file_net(path: str) -> str:
    """The net an IR file holds, as its profile names it: the directory's name for a file of
    a `--dump-ir` directory (`DIR/<net>/NN-<pass>.mlir`, beside its passes.json), the file's
    own name without `.mlir` otherwise."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(folder, PASSES_FILE)):
        return os.path.basename(folder)
    stem = os.path.basename(path)
    return stem.removesuffix(".mlir") or stem or "main"


def png_file_name(net: str) -> str:
    """The PNG file of a net's timeline: the net's name with every character that is not a
    letter, digit, '.', '_', '-' or '@' replaced by '-' (`block:16` -> `block-16.png`; no
    ':', which Windows and some tools refuse in a file name)."""
    return re.sub(r"[^A-Za-z0-9._@-]", "-", net) + ".png"


def profile_ir(path: str, chip_name: str, quiet: bool = True
               ) -> tuple[Chip, list[NetProfile], list[Timeline], list[Program]]:
    """Profiles of every function of the Tpu IR file `path` on the chip `chip_name`, the IR
    checked first (`read_machine_ir`), and each function's command streams too; a progress
    line over the functions on a terminal unless `quiet`."""
    chip = get_chip(chip_name)
    module = read_machine_ir(path, chip)
    net = ir_file_net(path)
    profiles, timelines, programs = [], [], []
    functions = [fn for fn in module.ops if isinstance(fn, func.FuncOp)]
    with progress_bar(len(functions), "toptpu profile", quiet=quiet, unit="function") as bar:
        for fn in functions:
            prog = generate(module, fn, chip)
            name = net if len(module.ops) == 1 else f"{net}@{fn.sym_name.data}"
            try:
                prog.check()  # the checks of a model file's command streams
                tl = LoadedNet(prog, name).plan(chip).timeline
            except ToptpuError as e:
                raise ProfileIRError(f"{path}: @{fn.sym_name.data}: its command streams: "
                                     f"{e}") from None
            profiles.append(profile_timeline(tl, chip, prog.inherent_bytes(), prog.flops,
                                             prog.indexed_bytes()))
            timelines.append(tl)
            programs.append(prog)
            bar.update(1)
    if not profiles:
        raise UsageError(f"{path}: no function to profile")
    return chip, profiles, timelines, programs


def _cmd_profile_ir(args: argparse.Namespace) -> int:
    chip, profiles, timelines, programs = profile_ir(args.model_file, args.chip, args.quiet)
    if args.json:
        print(json.dumps({"chip": chip.name, "nets": profiles_json(profiles)}, indent=1))
    else:
        print(summary_table(profiles, chip))
    _write_pictures(args, profiles, timelines, chip, [p.commands for p in programs])
    return 0


def _write_pictures(args: argparse.Namespace, profiles: list[NetProfile],
                    timelines: list[Timeline], chip: Chip, commands: list[Any]) -> None:
    if args.trace:
        write_chrome_trace(args.trace, timelines, chip)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev)")
    if args.png:
        os.makedirs(args.png, exist_ok=True)
        for p, tl, cmds in zip(profiles, timelines, commands, strict=True):
            write_timeline_png(os.path.join(args.png, png_file_name(p.net)), tl, chip, p,
                               cmds)
        print(f"wrote {len(profiles)} timelines to {args.png}/")


def check_outputs(args: argparse.Namespace) -> None:
    """--trace (a file) and --png (a directory) can be written, and neither is the model
    file: checked before any net runs."""
    if args.trace:
        check_output_file(args.trace, "--trace", "trace.json")
        if os.path.exists(args.model_file) and os.path.exists(args.trace) and \
                os.path.samefile(args.trace, args.model_file):
            raise OutputPathError(f"--trace '{args.trace}' is the model file; name another "
                                  "file")
    if args.png:
        check_output_dir(args.png, "--png")


def cmd_profile(args: argparse.Namespace) -> int:
    """Run each net of a model file once on the machine and print the profile (or time
    the command streams of grouped, addressed Tpu IR: FILE.mlir)."""
    check_outputs(args)
    if args.model_file.endswith(".mlir"):
        return _cmd_profile_ir(args)
    nets = [n.strip() for n in args.nets.split(",")] if args.nets else None
    ex, profiles = profile_model(args.model_file, nets, args.quiet)
    layers = ex.file.num_layers
    steps = step_model(ex) if nets is None else None  # the step needs every net's time
    prompt = _prompt_tokens(args, ex)
    if args.json:
        print(json.dumps({"chip": ex.chip.name, "layers": layers,
                          "nets": profiles_json(profiles),
                          "steps": steps_json(steps, prompt, args.sampler) if steps else None,
                          "pipeline": pipeline_json(ex.header)},
                         indent=1))
    else:
        print(pipeline_line(ex.header))
        print(summary_table(profiles, ex.chip))
        if steps is not None:
            print(step_summary(steps, prompt, args.sampler))
        else:
            print("(--nets: the generation steps need every net; profile them all for the "
                  "time to first token and tokens/s)")
        vision = ex.header.get("vision")
        per = {p.net: p.seconds for p in profiles}
        if vision and vision["net"] in per:
            tile = per[vision["net"]]
            n = vision["max_tiles"] + (1 if vision["max_tiles"] > 1 else 0)
            what = vision_family(vision["kind"]).run
            print(f"vision ({vision['net']}, {vision['mode']}): one {vision['image_size']} px "
                  f"{what} {tile * 1e3:.3f} ms modelled; an image of {n} {what}s "
                  f"{n * tile * 1e3:.3f} ms")
    timelines = [ex.stats[p.net].timelines[-1] for p in profiles]
    _write_pictures(args, profiles, timelines, ex.chip,
                    [ex.program(p.net).commands for p in profiles])
    return 0


def pipeline_json(header: Mapping[str, Any]) -> dict[str, Any]:
    """The passes that made the file's nets (`NetEntry.pipeline`) and the compile's
    pipeline options, for `--json`."""
    return {"options": header["compile"].get("pipeline"),
            "from_ir": header["compile"].get("from_ir"),
            "nets": {name: net.get("pipeline") for name, net in header["nets"].items()}}


def pipeline_line(header: Mapping[str, Any]) -> str:
    """One line: the pipeline options the file was compiled with (and the edited dump
    files it was compiled from); `toptpu info` lists each net's passes."""
    info = header["compile"]
    line = f"compiled with pipeline options: {info.get('pipeline') or 'not recorded'}"
    from_ir = info.get("from_ir")
    if from_ir:
        edited = [st["file"] for st in from_ir["nets"].values() if st["edited"]]
        line += (f"; from the dump {from_ir['directory']}"
                 + (f" (edited {', '.join(edited)})" if edited else ""))
    return line + " (toptpu info FILE: each net's passes)"


def _prompt_tokens(args: argparse.Namespace, ex: MachineExecutor) -> int:
    shapes = ex.meta.shapes
    n = shapes.max_input_length if args.prompt_tokens is None else args.prompt_tokens
    if n > shapes.seq_length:
        raise UsageError(f"--prompt-tokens {n} does not fit the KV cache of the model file "
                         f"(seq_length {shapes.seq_length})")
    return n


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help=cmd_profile.__doc__)
    p.add_argument("model_file", help="a model file, or grouped and addressed Tpu IR (.mlir)")
    p.add_argument("--chip", default=DEFAULT_CHIP, choices=chip_names(),
                   help="the chip a .mlir file is timed on (a model file names its own)")
    p.add_argument("--nets", help="comma-separated nets (default: all)")
    p.add_argument("--trace", metavar="JSON", help="write a Chrome trace of the runs")
    p.add_argument("--png", metavar="DIR", help="write a timeline/roofline PNG per net")
    p.add_argument("--sampler", choices=list(SAMPLERS), default="greedy",
                   help="how the steps choose a token: greedy (greedy_head), sample "
                   "(sample_head) on the chip, or host (the logits read back)")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None,
                   help="the prompt of the time to first token (default: one chunk, the "
                   "model file's max_input_length)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--quiet", action="store_true",
                   help="no progress line (shown only when stderr is a terminal)")
    p.set_defaults(fn=cmd_profile)
