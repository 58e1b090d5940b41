"""A `toptpu compile --dump-ir DIR` directory: written (`DumpWriter`), read back (its nets,
their stages), and each stage replayed through `toptpu-opt`.

`DIR/<net>/NN-<what>.mlir` is the net's IR after step NN (00: the import, then one file per
pass); `DIR/<net>/passes.json` lists the files in order, each with the pass that made it from
the file before it, as toptpu-opt's pipeline text (`convert-top-to-tpu{mode="w4bf16"}`), the
stage of the compile the pass belongs to (top, tensor-parallel, convert, tpu, machine:
`toptpu.pass_pipeline`) and the sha256 of the text written (so an edited file is told from
one as dumped); every module names the store `DIR/weights.safetensors`, which holds every
tensor any of them names (a GGUF or pre-quantized compile's float weights included).
`DIR/compile.json`, written once every net is compiled, holds what `toptpu compile
--from-ir DIR` needs besides the IR (`toptpu.from_ir`): the model the dump was made from,
the compile request (`CompileRequest.keywords`) and each net's inputs and outputs at the
import and in the model file.

`replay(DIR)` runs each stage's pass with `toptpu-opt` (the command itself, in this process)
on the file before it, and compares the result with the stage's own file: the same IR text
but for the weight store the module names (the replay's derived tensors go to a companion
file of its own). A stage that does not replay is a bug: the dump is not what the passes make
of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.printer import Printer

from toptpu import opt
from toptpu.backend.contract import TensorSpec
from toptpu.dialects.output_file import write_output
from toptpu.dialects.weight_store import STORE_ATTR
from toptpu.errors import ToptpuError

#: the manifest of a net's dumped stages
PASSES_FILE = "passes.json"
#: the weight store of a dump directory
WEIGHTS_FILE = "weights.safetensors"
#: what --from-ir needs besides the IR
COMPILE_FILE = "compile.json"
#: the layout version of compile.json
COMPILE_FORMAT = 1

_STORE = re.compile(r'top\.weight_store = "[^"]*"')


class DumpError(ToptpuError):
    """A directory that is not a readable --dump-ir directory."""


def digest(text: str) -> str:
    """The sha256 of IR text as written (passes.json's `sha256`)."""
    return hashlib.sha256(text.encode()).hexdigest()


def print_ir(module: ModuleOp, generic: bool = False) -> str:
    """IR text with locations (a dump file; the generic form for a model file)."""
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic, print_debuginfo=True).print_op(module)
    out.write("\n")
    return out.getvalue()


def _specs(specs: list[TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in specs]


@dataclass
class DumpWriter:
    """`--dump-ir DIR` being written: DIR/<net>/NN-<pass>.mlir, every module pointing at
    DIR/weights.safetensors, DIR/<net>/passes.json after each file, DIR/compile.json at the
    end (`finish`)."""

    directory: str
    weights_path: str
    #: each net's inputs and outputs at the import (recorded by its writer)
    imported: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = field(
        default_factory=dict)

    @classmethod
    def make(cls, directory: str | None) -> DumpWriter | None:
        if directory is None:
            return None
        os.makedirs(directory, exist_ok=True)
        return cls(directory, os.path.abspath(os.path.join(directory, WEIGHTS_FILE)))

    def writer(self, net: str, io_of: Callable[[ModuleOp], tuple[list[TensorSpec],
                                                                 list[TensorSpec]]]
               ) -> Callable[..., None]:
        """`(module, what, spec=None, stage=None)` -> writes the net's next dump file (`spec`:
        the pipeline text of the pass that made it, `stage` its stage, for passes.json);
        `io_of` gives a module's inputs and outputs (recorded at the import)."""
        step = [0]
        stages: list[dict[str, str | None]] = []

        def dump(module: ModuleOp, what: str, spec: str | None = None,
                 stage: str | None = None) -> None:
            d = os.path.join(self.directory, net)
            os.makedirs(d, exist_ok=True)
            old = module.attributes.get(STORE_ATTR)
            module.attributes[STORE_ATTR] = StringAttr(self.weights_path)
            try:
                text = print_ir(module, generic=False)
            finally:
                if old is not None:
                    module.attributes[STORE_ATTR] = old
            if step[0] == 0:
                self.imported[net] = io_of(module)
            name = f"{step[0]:02d}-{what}.mlir"
            write_output(os.path.join(d, name), text, "--dump-ir")
            stages.append({"file": name, "pass": spec, "stage": stage or "import",
                           "sha256": digest(text)})
            write_output(os.path.join(d, PASSES_FILE), json.dumps(stages, indent=1) + "\n",
                         "--dump-ir")
            step[0] += 1

        return dump

    def finish(self, source: str | None, request: dict[str, Any],
               nets: dict[str, tuple[list[TensorSpec], list[TensorSpec]]]) -> None:
        """Write DIR/compile.json: the model `source` (an absolute path; None for an
        in-memory model), the request's keywords, each net's inputs and outputs at the
        import and in the model file (`nets`)."""
        data = {"format": COMPILE_FORMAT, "source": source, "request": request,
                "nets": {name: {"import": {"inputs": _specs(self.imported[name][0]),
                                           "outputs": _specs(self.imported[name][1])},
                                "model_file": {"inputs": _specs(ins),
                                               "outputs": _specs(outs)}}
                         for name, (ins, outs) in nets.items() if name in self.imported}}
        write_output(os.path.join(self.directory, COMPILE_FILE),
                     json.dumps(data, indent=1) + "\n", "--dump-ir")


@dataclass(frozen=True)
class Stage:
    """One dumped file of a net and the pass that made it from the stage before (None: the
    import), the compile's stage it belongs to and the sha256 of its text as dumped (None
    in a dump written before they were recorded)."""

    net: str
    path: str
    spec: str | None
    stage: str | None = None
    sha256: str | None = None

    @property
    def file(self) -> str:
        """`net/NN-pass.mlir`, as messages name it."""
        return f"{self.net}/{os.path.basename(self.path)}"

    def edited(self) -> bool:
        """Whether the file's text is no longer what the dump wrote (False when the dump
        recorded no sha256)."""
        if self.sha256 is None:
            return False
        with open(self.path, encoding="utf-8", errors="replace") as f:
            return digest(f.read()) != self.sha256


@dataclass(frozen=True)
class Replayed:
    """A stage replayed: its pass on the file before it; `problem` None when toptpu-opt
    made the stage's own IR text."""

    stage: Stage
    source: str
    problem: str | None


def stages(directory: str) -> dict[str, list[Stage]]:
    """The nets of a dump directory and their stages in order (from each passes.json)."""
    if not os.path.isdir(directory):
        raise DumpError(f"{directory} is not a directory (give a --dump-ir directory)")
    out: dict[str, list[Stage]] = {}
    for net in sorted(os.listdir(directory)):
        manifest = os.path.join(directory, net, PASSES_FILE)
        if not os.path.isfile(manifest):
            continue
        try:
            with open(manifest) as f:
                entries = json.load(f)
            out[net] = [Stage(net, os.path.join(directory, net, e["file"]), e["pass"],
                              e.get("stage"), e.get("sha256"))
                        for e in entries]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DumpError(f"{manifest} is not a passes manifest of --dump-ir ({e})") from None
    if not out:
        raise DumpError(f"{directory} holds no net of a --dump-ir directory (no "
                        f"<net>/{PASSES_FILE})")
    return out


def comparable(text: str) -> str:
    """IR text without the weight store it names."""
    return _STORE.sub('top.weight_store = "…"', text).rstrip() + "\n"


def run_opt(*argv: str) -> tuple[int, str]:
    """`toptpu-opt ARGV` in this process: its exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = opt.main(list(argv))
    return status, err.getvalue()


def replay_stage(before: Stage, stage: Stage, workdir: str) -> Replayed:
    """Run `stage`'s pass on `before`'s file with toptpu-opt and compare with its file."""
    assert stage.spec is not None
    out = os.path.join(workdir, f"{stage.net.replace(':', '_')}-{os.path.basename(stage.path)}")
    status, err = run_opt(before.path, "-p", stage.spec, "-o", out)
    if status != 0:
        return Replayed(stage, before.path, f"toptpu-opt exited {status}: {err.strip()}")
    with open(out) as f:
        got = comparable(f.read())
    with open(stage.path) as f:
        want = comparable(f.read())
    if got == want:
        return Replayed(stage, before.path, None)
    first = next(i for i, (a, b) in enumerate(zip(got.splitlines() + [""],
                                                  want.splitlines() + [""], strict=False))
                 if a != b)
    return Replayed(stage, before.path, f"the IR differs from line {first + 1}: "
                    f"{got.splitlines()[first:first + 1]} vs {want.splitlines()[first:first + 1]}")


def replay(directory: str, nets: list[str] | None = None) -> list[Replayed]:
    """Every stage of every net (or of `nets`) replayed from the stage before it."""
    found = stages(directory)
    with tempfile.TemporaryDirectory(prefix="toptpu-replay-") as work:
        done = []
        for net in nets or list(found):
            seq = found[net]
            for before, stage in zip(seq, seq[1:], strict=False):
                done.append(replay_stage(before, stage, work))
    return done
