"""A `toptpu compile --dump-ir DIR` directory, read back: its nets, their stages, and the
replay of each stage through `toptpu-opt`.

`DIR/<net>/NN-<what>.mlir` is the net's IR after step NN (00: the import, then one file per
pass); `DIR/<net>/passes.json` lists the files in order with the pass that made each from the
file before it, as toptpu-opt's pipeline text (`convert-top-to-tpu{mode="w4bf16"}`); every
module names the store `DIR/weights.safetensors`, which holds every tensor any of them names
(a GGUF or pre-quantized compile's float weights included).

`replay(DIR)` runs each stage's pass with `toptpu-opt` (the command itself, in this process)
on the file before it, and compares the result with the stage's own file: the same IR text
but for the weight store the module names (the replay's derived tensors go to a companion
file of its own). A stage that does not replay is a bug: the dump is not what the passes make
of it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass

from toptpu import opt
from toptpu.errors import ToptpuError

#: the manifest of a net's dumped stages
PASSES_FILE = "passes.json"
#: the weight store of a dump directory
WEIGHTS_FILE = "weights.safetensors"

_STORE = re.compile(r'top\.weight_store = "[^"]*"')


class DumpError(ToptpuError):
    """A directory that is not a readable --dump-ir directory."""


@dataclass(frozen=True)
class Stage:
    """One dumped file of a net and the pass that made it from the stage before (None: the
    import)."""

    net: str
    path: str
    spec: str | None


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
            out[net] = [Stage(net, os.path.join(directory, net, e["file"]), e["pass"])
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
