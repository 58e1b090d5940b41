"""`toptpu profile MODEL_FILE`: the machine's view of a compiled model.

Runs every net once on the reference machine (per-layer nets with layer 0's weights;
inputs are valid placeholders: token 0, positions 0.., masks that see everything) and
prints per net: modelled time, engine busy fractions, bytes moved, FLOPs, achieved DDR and
peak fractions and the roofline ratio. `--trace` writes a Chrome trace (open it in
Perfetto), `--png DIR` one timeline/roofline picture per net, `--json` the numbers.

`toptpu profile FILE.mlir [--chip NAME]` does the same for grouped and addressed Tpu IR (a
`--dump-ir` file after address-assign, or `toptpu-opt -p tpu-pipeline` output): codegen
makes each function's command streams and the chip model times them — the timeline depends
on the commands and the chip alone — so a hand edit of the IR can be timed.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
from xdsl.dialects import func

from toptpu.backend.codegen.streams import generate
from toptpu.backend.contract import PENALTY, TEMPERATURE, TOP_K, TOP_P
from toptpu.backend.formats.program import Program
from toptpu.backend.runtime.device_executor import machine_executor
from toptpu.backend.runtime.machine import LoadedNet, Timeline
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.profile import (
    NetProfile,
    profile_timeline,
    profiles_json,
    summary_table,
    write_chrome_trace,
    write_timeline_png,
)
from toptpu.backend.target.chips import DEFAULT_CHIP, Chip, chip_names, get_chip
from toptpu.cli_args import UsageError
from toptpu.dialects import context, tpu
from toptpu.dialects.ir_text import parse_ir
from toptpu.paths import OutputPathError, check_output_dir, check_output_file

#: sampling inputs a profile run feeds 1 (temperature 1, no penalty, top-k 1, top-p 1): zeros
#: would divide 0 by 0 in sample_head; the timeline does not depend on the values
_ONES = (TEMPERATURE, PENALTY, TOP_K, TOP_P)


def _placeholder(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if name == "position_ids":
        n = shape[-1]
        return np.arange(n, dtype=dtype).reshape(shape)
    if name in _ONES:
        return np.ones(shape, dtype)
    return np.zeros(shape, dtype)


def profile_model(path: str, nets: list[str] | None = None
                  ) -> tuple[MachineExecutor, list[NetProfile]]:
    ex = machine_executor(path)
    unknown = sorted(set(nets or []) - set(ex.nets()))
    if unknown:
        raise UsageError(f"--nets: the model file has no net {', '.join(unknown)}; it has "
                         f"{', '.join(ex.nets())}")
    profiles = []
    for name, info in ex.nets().items():
        if nets and name not in nets:
            continue
        bindings = {}
        for spec in info.inputs:
            buf = ex.alloc(spec.shape, spec.dtype)
            ex.write(buf, _placeholder(spec.name, spec.shape, spec.dtype))
            bindings[spec.name] = buf
        for spec in info.outputs:
            bindings[spec.name] = ex.alloc(spec.shape, spec.dtype)
        ex.run(name, bindings, 0 if info.per_layer else None)
        prog = ex.program(name)
        tl = ex.stats[name].timelines[-1]
        profiles.append(profile_timeline(tl, ex.chip, prog.inherent_bytes(), prog.flops))
    return ex, profiles


def profile_ir(path: str, chip_name: str) -> tuple[Chip, list[NetProfile], list[Timeline],
                                                  list[Program]]:
    """Profiles of every function of the Tpu IR file `path` on the chip `chip_name`."""
    if not os.path.isfile(path):
        raise UsageError(f"'{path}' is not a readable file")
    with open(path, "rb") as f:
        module = parse_ir(f.read(), path, context())
    chip = get_chip(chip_name)
    net = os.path.basename(os.path.dirname(os.path.abspath(path))) or "main"
    profiles, timelines, programs = [], [], []
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        if tpu.regions_of(fn) is None:
            raise UsageError(f"{path}: @{fn.sym_name.data} is not grouped and addressed Tpu "
                             "IR: profile the output of tpu-pipeline{chip=...} (or of "
                             "machine-pipeline), e.g. the --dump-ir file after address-assign")
        prog = generate(module, fn, chip)
        name = net if len(module.ops) == 1 else f"{net}@{fn.sym_name.data}"
        tl = LoadedNet(prog, name).plan(chip).timeline
        profiles.append(profile_timeline(tl, chip, prog.inherent_bytes(), prog.flops))
        timelines.append(tl)
        programs.append(prog)
    if not profiles:
        raise UsageError(f"{path}: no function to profile")
    return chip, profiles, timelines, programs


def _cmd_profile_ir(args: argparse.Namespace) -> int:
    chip, profiles, timelines, programs = profile_ir(args.model_file, args.chip)
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
            write_timeline_png(os.path.join(args.png, f"{p.net}.png"), tl, chip, p, cmds)
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
    ex, profiles = profile_model(args.model_file, nets)
    layers = ex.file.num_layers
    if args.json:
        print(json.dumps({"chip": ex.chip.name, "layers": layers,
                          "nets": profiles_json(profiles)}, indent=1))
    else:
        print(summary_table(profiles, ex.chip))
        per = {p.net: p.seconds for p in profiles}
        if "block_cache" in per:
            decode = layers * per["block_cache"] + per.get("embedding_cache", 0.0) + per.get(
                "lm_head", 0.0)
            print(f"one decode step ({layers} layers + embedding + lm_head): "
                  f"{decode * 1e3:.3f} ms modelled, {1 / decode:.1f} tokens/s")
        vision = ex.header.get("vision")
        if vision and vision["net"] in per:
            tile = per[vision["net"]]
            n = vision["max_tiles"] + (1 if vision["max_tiles"] > 1 else 0)
            what = "tile" if vision["kind"] == "internvl" else "slice"
            print(f"vision ({vision['net']}, {vision['mode']}): one {vision['image_size']} px "
                  f"{what} {tile * 1e3:.3f} ms modelled; an image of {n} {what}s "
                  f"{n * tile * 1e3:.3f} ms")
    timelines = [ex.stats[p.net].timelines[-1] for p in profiles]
    _write_pictures(args, profiles, timelines, ex.chip,
                    [ex.program(p.net).commands for p in profiles])
    return 0


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help=cmd_profile.__doc__)
    p.add_argument("model_file", help="a model file, or grouped and addressed Tpu IR (.mlir)")
    p.add_argument("--chip", default=DEFAULT_CHIP, choices=chip_names(),
                   help="the chip a .mlir file is timed on (a model file names its own)")
    p.add_argument("--nets", help="comma-separated nets (default: all)")
    p.add_argument("--trace", metavar="JSON", help="write a Chrome trace of the runs")
    p.add_argument("--png", metavar="DIR", help="write a timeline/roofline PNG per net")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(fn=cmd_profile)
