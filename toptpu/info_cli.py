"""`toptpu info MODEL_FILE`: what a model file is, from its header alone (nothing runs).

The model and where it came from, the chip, mode and static shapes, the weights, each net's
inputs and outputs, and the passes that made each net (`NetEntry.pipeline`: the pipeline
actually run, the compile's `--top-pipeline`/`--tpu-pipeline`/`--pass-after`/`--pass-before`
and plugin passes included), nets with the same passes listed together; for a file compiled
from a dump (`toptpu compile --from-ir`), the stage each net was picked up at and whether it
was edited; the plugins' ops the nets hold (the file is described without their plugins).
`--json` prints the whole header.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from toptpu.backend.contract import TensorSpec
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader


def _io(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in specs)


def describe(path: str, header: LlmHeader) -> str:
    """The text `toptpu info` prints."""
    m, s = header.model, header.shapes
    size = os.path.getsize(path)
    lines = [
        f"{path}: {size / 1e6:.1f} MB, toptpu model file (LLM format {header.llm_format})",
        f"model: {m.family}, {m.num_layers} layers, hidden {m.hidden_size}, heads "
        f"{m.num_heads}/{m.num_kv_heads} of {m.head_dim}, vocabulary {m.vocab_size}; from "
        f"{header.compile.source} by toptpu {header.compile.toptpu_version}",
        f"compiled for {header.chip} in {header.mode} (group size {header.group_size}"
        f"{'' if header.symmetric is None else f', symmetric {header.symmetric}'}): seq "
        f"{s.seq_length}, input {s.max_input_length}, history {s.max_history}, prefill "
        f"lengths {','.join(map(str, s.prefill_lengths))}",
    ]
    if header.weights is not None:
        w = header.weights
        lines.append(f"weights: {len(w.shared)} shared tensors ({w.shared_size / 1e6:.2f} MB) "
                     f"+ {len(w.layers)} layer chunks, {w.size / 1e6:.2f} MB in all")
    if header.parallel is not None:
        lines.append(f"devices: {len(header.parallel.devices)} ({header.parallel.strategy})")
    if header.checkpoint is not None:
        ck = header.checkpoint
        lines.append(f"checkpoint: {ck.quant_method} ({ck.packing_format}), {ck.bits}-bit, "
                     f"{ck.quantized_layers} quantized linears")
    lines.append(f"pipeline options: {header.compile.pipeline or 'not recorded'}")
    for op, info in (header.compile.plugin_ops or {}).items():
        lines.append(f"plugin op: {op} of the plugin '{info.plugin}' ({info.package})")
    from_ir = header.compile.from_ir
    if from_ir is not None:
        edited = [f"{st.file}" for st in from_ir.nets.values() if st.edited]
        lines.append(f"compiled from the dump {from_ir.directory}: "
                     + (f"edited {', '.join(edited)}" if edited else "no file edited"))
    lines.append("nets (inputs -> outputs, commands):")
    width = max(len(n) for n in header.nets)
    for name, net in header.nets.items():
        lines.append(f"  {name:<{width}}  {_io(net.inputs)} -> {_io(net.outputs)}, "
                     f"{net.commands} commands")
    lines.append("passes (as run, after the import):")
    groups: dict[str, list[str]] = {}
    for name, net in header.nets.items():
        groups.setdefault(net.pipeline or "(not recorded)", []).append(name)
    for text, names in groups.items():
        lines.append(f"  {', '.join(names)}:")
        lines.append(f"    {text}")
        if from_ir is not None:
            picked = [f"{n} from {from_ir.nets[n].file}"
                      f"{' (edited)' if from_ir.nets[n].edited else ''}"
                      for n in names if n in from_ir.nets]
            lines.append(f"    picked up at: {'; '.join(picked)}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    """Describe a model file from its header: model, chip, mode, shapes, nets and the passes
    that made each."""
    f = LlmFile(args.model_file, verify_checksums=False, plugin_ops=False)
    try:
        if args.json:
            print(json.dumps(f.header, indent=1))
        else:
            print(describe(args.model_file, f.meta))
    finally:
        f.file.close()
    return 0


def add_info_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help=cmd_info.__doc__)
    p.add_argument("model_file", help="a model file (toptpu compile's output)")
    p.add_argument("--json", action="store_true", help="print the whole header as JSON")
    p.set_defaults(fn=cmd_info)
