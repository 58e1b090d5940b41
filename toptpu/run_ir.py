"""`toptpu run-ir FILE.mlir`: run any IR file on given or seeded random inputs, as
`iree-run-module` runs a module, and compare two IR files output by output.

- What runs: the function of a Top, Tpu, or grouped and addressed Tpu module (`--function`
  picks one of several) with the weight store the module names (`top.weight_store`, e.g. the
  `weights.safetensors` of a `--dump-ir` directory; `--weights` another).
- `--executor interpreter` (the default): the numpy interpreter, Top and Tpu, grouped or not.
  `--executor machine`: the reference machine, on Tpu IR; IR the machine passes have not seen
  goes through them first (`machine-pipeline{chip}`: layer-group, lmem-verify,
  address-assign, on a copy), grouped and addressed IR straight to codegen; `--chip`.
- Inputs: `--input NAME=FILE.npy` (repeated), `--inputs FILE.npz` (by name); every input not
  given is seeded random (`--seed`): floats standard normal, integers in [0, 16). Each must
  have the function's shape and element type exactly (integers of another width are taken
  when every value fits).
- Outputs: printed per output (shape, type, mean, min, max) and, with `--output`, written:
  a directory (one NAME.npy per output) or a `.npz` file.
- `--compare OTHER.mlir`: OTHER runs on the same inputs (`--compare-executor`; a float input
  rounded to OTHER's float type where it takes another, as a Tpu net takes its activation
  type), and each
  output of the same name is compared: cosine, max |a - b| and where, the first element that
  differs (by more than `--atol`). Exit status 1 when an output's cosine is below `--min-cos`
  or its max |a - b| above `--max-abs`.

Bad input is one line `toptpu run-ir: error: ...` (exit 1): a missing or malformed IR file,
an unknown input name, a missing or unreadable array file, a wrong shape or type, IR the
executor cannot run, a weight the store lacks.
"""

from __future__ import annotations

import argparse
import io
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.utils.exceptions import DiagnosticException, ParseError

from toptpu.backend.codegen.streams import generate
from toptpu.backend.reference.interpreter import Interpreter, find_func
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import DEFAULT_CHIP, get_chip
from toptpu.cli_args import UsageError, finite_float, int_at_least
from toptpu.dialects import context, tpu
from toptpu.dialects.common import numpy_dtype
from toptpu.dialects.ir_text import IRTextError, one_line, parse_ir
from toptpu.dialects.naming import input_names, output_names
from toptpu.dialects.output_file import write_output
from toptpu.dialects.weight_store import WeightStore, store_for
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.paths import check_output_dir, check_output_file

EXECUTORS = ("interpreter", "machine")
#: seeded random integer inputs lie in [0, RANDOM_INT_HIGH)
RANDOM_INT_HIGH = 16


@dataclass(frozen=True)
class Arg:
    """A function argument: its name, shape and numpy element type."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class LoadedIR:
    """An IR file, its function and its weights."""

    path: str
    module: ModuleOp
    fn: func.FuncOp
    store: WeightStore | None

    @property
    def args(self) -> list[Arg]:
        out = []
        for name, t in zip(input_names(self.fn), self.fn.function_type.inputs.data,
                           strict=True):
            if not isinstance(t, TensorType):
                raise UsageError(f"{self.path}: input '{name}' is {t}, not a tensor")
            out.append(Arg(name, tuple(int(d) for d in t.get_shape()),
                           np.dtype(numpy_dtype(t.element_type))))
        return out

    @property
    def level(self) -> str:
        names = {op.name.split(".", 1)[0] for op in self.fn.walk()}
        return "tpu" if "tpu" in names else "top"


def load_ir(path: str, function: str | None = None, weights: str | None = None) -> LoadedIR:
    """Parse and verify an IR file; its function and weight store (one-line errors)."""
    if not os.path.exists(path):
        raise UsageError(f"'{path}' does not exist")
    if os.path.isdir(path):
        raise UsageError(f"'{path}' is a directory; give an IR file (.mlir)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read '{path}': {e.strerror or e}") from None
    try:
        module = parse_ir(data, path, context())
    except (ParseError, DiagnosticException) as e:
        raise UsageError(f"{one_line(e)}") from None
    except IRTextError as e:
        raise UsageError(str(e)) from None
    try:
        fn = find_func(module, function)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    store = WeightStore.open(weights) if weights is not None else store_for(module)
    return LoadedIR(path, module, fn, store)


# ------------------------------------------------------------------------------------ inputs


def _load_array(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise UsageError(f"{what}: '{path}' does not exist" if not os.path.exists(path)
                         else f"{what}: '{path}' is not a file")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"{what}: '{path}' is not a readable .npy file ({e})") from None
    if isinstance(arr, np.lib.npyio.NpzFile):
        arr.close()
        raise UsageError(f"{what}: '{path}' is an .npz archive; give it with --inputs")
    return arr


def _load_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise UsageError(f"--inputs: '{path}' does not exist" if not os.path.exists(path)
                         else f"--inputs: '{path}' is not a file")
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise UsageError(f"--inputs: '{path}' is one array, not an .npz archive; give it "
                             "with --input NAME=FILE.npy")
        with z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UsageError(f"--inputs: '{path}' is not a readable .npz file ({e})") from None


def _conform(arg: Arg, arr: np.ndarray, source: str) -> np.ndarray:
    """`arr` as the function takes input `arg`: the same shape and element type; integers
    of another width when every value fits (nothing else is converted)."""
    if tuple(arr.shape) != arg.shape:
        raise UsageError(f"input '{arg.name}' from {source} has shape {list(arr.shape)}; the "
                         f"function takes {list(arg.shape)}")
    if arr.dtype == arg.dtype:
        return arr
    if np.issubdtype(arr.dtype, np.integer) and np.issubdtype(arg.dtype, np.integer):
        info = np.iinfo(arg.dtype)
        if arr.size == 0 or (arr.min() >= info.min and arr.max() <= info.max):
            return arr.astype(arg.dtype)
        raise UsageError(f"input '{arg.name}' from {source} has values outside {arg.dtype} "
                         f"([{arr.min()}, {arr.max()}])")
    raise UsageError(f"input '{arg.name}' from {source} is {arr.dtype}; the function takes "
                     f"{arg.dtype}: save it as {arg.dtype}")


def random_input(arg: Arg, rng: np.random.Generator) -> np.ndarray:
    """A seeded random value for `arg`: floats standard normal, integers in [0, 16),
    booleans fair coins."""
    if arg.dtype == np.bool_:
        return rng.integers(0, 2, arg.shape).astype(np.bool_)
    if np.issubdtype(arg.dtype, np.integer):
        return rng.integers(0, RANDOM_INT_HIGH, arg.shape).astype(arg.dtype)
    return rng.standard_normal(arg.shape, dtype=np.float32).astype(arg.dtype)


def gather_inputs(args: list[Arg], given: list[str], npz: str | None, seed: int
                  ) -> tuple[dict[str, np.ndarray], list[str]]:
    """The inputs by name (given by --input / --inputs, the rest seeded random) and the
    names that were made up."""
    known = {a.name: a for a in args}
    names = ", ".join(known) or "none"
    raw: dict[str, tuple[np.ndarray, str]] = {}
    if npz is not None:
        for k, v in _load_npz(npz).items():
            if k not in known:
                raise UsageError(f"--inputs {npz}: '{k}' is not an input of the function "
                                 f"(its inputs: {names})")
            raw[k] = (v, npz)
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input '{item}': write NAME=FILE.npy")
        if name not in known:
            raise UsageError(f"--input {item}: '{name}' is not an input of the function (its "
                             f"inputs: {names})")
        if name in raw:
            raise UsageError(f"--input {item}: '{name}' is given twice")
        raw[name] = (_load_array(path, f"--input {name}"), path)
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    made: list[str] = []
    for a in args:  # the random ones drawn in argument order whatever was given
        drawn = random_input(a, rng)
        if a.name in raw:
            out[a.name] = _conform(a, *raw[a.name])
        else:
            out[a.name], made = drawn, [*made, a.name]
    return out, made


# ------------------------------------------------------------------------------------ running


def run(ir: LoadedIR, inputs: Mapping[str, np.ndarray], executor: str = "interpreter",
        chip: str = DEFAULT_CHIP) -> dict[str, np.ndarray]:
    """The function's outputs by name on `executor`."""
    if executor == "interpreter":
        result = Interpreter(ir.module, ir.store).run(dict(inputs), ir.fn.sym_name.data)
        return result.outputs
    if executor != "machine":
        raise UsageError(f"--executor {executor}: choose from {', '.join(EXECUTORS)}")
    if ir.level != "tpu":
        raise UsageError(f"{ir.path} is Top IR; the machine runs Tpu IR: lower it first "
                         "(toptpu-opt FILE -p 'tpu-pipeline{mode=...}'), or run it with "
                         "--executor interpreter")
    target = get_chip(chip)
    if tpu.regions_of(ir.fn) is not None:  # grouped and addressed: codegen only
        program = generate(ir.module, ir.fn, target)
    else:  # the machine passes first, on a copy holding the one function
        module = ir.module.clone()
        for f in [f for f in module.ops if isinstance(f, func.FuncOp)]:
            if f.sym_name.data != ir.fn.sym_name.data:
                f.erase()
        program = compile_for_machine(module, target)
    if ir.store is None:
        ir.store = WeightStore()  # a net without weights
    return simulate(program, ir.store, inputs, target).outputs


# ------------------------------------------------------------------------------------ outputs


def describe(name: str, arr: np.ndarray) -> str:
    shape = "x".join(str(d) for d in arr.shape) or "scalar"
    if arr.size == 0:
        return f"{name}: {arr.dtype}[{shape}] (empty)"
    f = arr.astype(np.float64)
    return (f"{name}: {arr.dtype}[{shape}] mean={f.mean():.6g} min={f.min():.6g} "
            f"max={f.max():.6g}")


def write_outputs(path: str, outputs: Mapping[str, np.ndarray]) -> list[str]:
    """`--output`: a .npz file, or a directory of NAME.npy files; the paths written."""
    if path.endswith(".npz"):
        buf = io.BytesIO()
        # Any: numpy's stub would take an array keyword for its allow_pickle option
        named: dict[str, Any] = dict(outputs)
        np.savez(buf, **named)
        write_output(path, buf.getvalue(), "--output")
        return [path]
    os.makedirs(path, exist_ok=True)
    written = []
    for name, arr in outputs.items():
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        file = os.path.join(path, f"{name.replace('/', '_')}.npy")
        write_output(file, buf.getvalue(), "--output")
        written.append(file)
    return written


@dataclass(frozen=True)
class Comparison:
    """One output of two runs compared."""

    name: str
    cosine: float
    max_abs: float
    max_at: tuple[int, ...]
    first_mismatch: tuple[int, ...] | None
    a: float | None
    b: float | None
    degenerate: str | None

    def line(self) -> str:
        where = ",".join(str(i) for i in self.max_at)
        text = f"{self.name}: cos={self.cosine:.7f} max|a-b|={self.max_abs:.6g} at [{where}]"
        if self.degenerate:
            text += f" ({self.degenerate})"
        if self.first_mismatch is None:
            return text + ", every element equal"
        at = ",".join(str(i) for i in self.first_mismatch)
        return text + f", first mismatch at [{at}]: {self.a:.6g} vs {self.b:.6g}"


def compare_arrays(name: str, a: np.ndarray, b: np.ndarray, atol: float = 0.0) -> Comparison:
    """Cosine, max |a - b| (and where), first element differing by more than `atol`."""
    if a.shape != b.shape:
        raise UsageError(f"output '{name}' has shape {list(a.shape)} in one file and "
                         f"{list(b.shape)} in the other")
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    sim = similarity(fa, fb)
    diff = np.abs(fa - fb)
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number: a mismatch
    both_nan = np.isnan(fa) & np.isnan(fb)
    diff = np.where(both_nan, 0.0, diff)
    if diff.size == 0:
        return Comparison(name, sim.cosine, 0.0, (), None, None, None, sim.degenerate)
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    bad = np.flatnonzero(diff > atol)
    first = np.unravel_index(int(bad[0]), diff.shape) if bad.size else None
    return Comparison(name, sim.cosine, float(diff[at]), tuple(int(i) for i in at),
                      tuple(int(i) for i in first) if first is not None else None,
                      float(fa[first]) if first is not None else None,
                      float(fb[first]) if first is not None else None, sim.degenerate)


def _kind(dtype: np.dtype) -> str:
    return "float" if np.issubdtype(dtype, np.floating) or dtype.kind == "V" else dtype.kind


def check_same_inputs(mine: list[Arg], theirs: list[Arg], a: str, b: str) -> None:
    """Two functions compared take the same inputs: names, shapes, kinds of element type
    (a float input may be of another float type: a Tpu net takes its activation type)."""
    sig_a = [(x.name, x.shape, _kind(x.dtype)) for x in mine]
    sig_b = [(x.name, x.shape, _kind(x.dtype)) for x in theirs]
    if sig_a != sig_b:
        show = [(x.name, list(x.shape), str(x.dtype)) for x in theirs]
        own = [(x.name, list(x.shape), str(x.dtype)) for x in mine]
        raise UsageError(f"{b} takes other inputs than {a}: {show} vs {own}")


def as_inputs_of(args: list[Arg], inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same inputs for the compared function: a float input rounded to its float type
    (what the runtime feeds a net of that type), the rest as they are."""
    return {a.name: inputs[a.name].astype(a.dtype) if inputs[a.name].dtype != a.dtype
            else inputs[a.name] for a in args}


# ------------------------------------------------------------------------------------ command


def cmd_run_ir(args: argparse.Namespace) -> int:
    """Run an IR file (Top, Tpu, grouped and addressed Tpu) on given or seeded random inputs
    with its weight store; print (and write) its outputs; compare with another IR file."""
    if args.output is not None:
        if args.output.endswith(".npz"):
            check_output_file(args.output, "--output", "outputs.npz")
        else:
            check_output_dir(args.output, "--output")
    get_chip(args.chip)  # an unknown chip: refused before any work
    ir = load_ir(args.file, args.function, args.weights)
    other = load_ir(args.compare, args.function, args.compare_weights) \
        if args.compare is not None else None
    arg_specs = ir.args
    if other is not None:
        check_same_inputs(arg_specs, other.args, args.file, args.compare)
    inputs, made = gather_inputs(arg_specs, args.input or [], args.inputs, args.seed)
    if made:
        print(f"random inputs (seed {args.seed}): {', '.join(made)}")
    outputs = run(ir, inputs, args.executor, args.chip)
    for name in output_names(ir.fn):
        print(describe(name, outputs[name]))
    if args.output is not None:
        for path in write_outputs(args.output, outputs):
            print(f"wrote {path}")
    if other is None:
        return 0
    theirs = run(other, as_inputs_of(other.args, inputs), args.compare_executor, args.chip)
    missing = [n for n in outputs if n not in theirs]
    if missing:
        raise UsageError(f"{args.compare} has no output {missing[0]!r} (its outputs: "
                         f"{', '.join(theirs)})")
    print(f"compare {args.file} ({args.executor}) with {args.compare} "
          f"({args.compare_executor}):")
    ok = True
    for name in outputs:
        c = compare_arrays(name, outputs[name], theirs[name], args.atol)
        good = c.cosine >= args.min_cos and not c.degenerate and (
            args.max_abs is None or c.max_abs <= args.max_abs)
        if c.degenerate and c.first_mismatch is None:
            good = args.max_abs is None or c.max_abs <= args.max_abs  # equal zeros are equal
        ok &= good
        print(f"  {c.line()}{'' if good else '  FAIL'}")
    limits = f"cos >= {args.min_cos}" + (f", max|a-b| <= {args.max_abs}"
                                         if args.max_abs is not None else "")
    print(f"{'all outputs within' if ok else 'outputs outside'} {limits}")
    return 0 if ok else 1


def add_run_ir_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-ir", help=cmd_run_ir.__doc__, description=cmd_run_ir.__doc__)
    p.add_argument("file", help="the IR file (.mlir): Top, Tpu, or grouped and addressed Tpu")
    p.add_argument("--function", default=None,
                   help="the function to run (default: the module's first)")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy",
                   help="an input from a .npy file (repeat for each; the rest seeded random)")
    p.add_argument("--inputs", metavar="FILE.npz",
                   help="inputs by name from an .npz archive")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed of the random inputs (floats standard normal, integers in "
                        f"[0, {RANDOM_INT_HIGH}))")
    p.add_argument("--output", metavar="DIR|FILE.npz",
                   help="write the outputs: one NAME.npy each in DIR, or one .npz")
    p.add_argument("--executor", choices=EXECUTORS, default="interpreter",
                   help="the numpy interpreter (Top and Tpu) or the reference machine (Tpu; "
                        "the machine passes run first on IR that has not been through them)")
    p.add_argument("--chip", default=DEFAULT_CHIP, help="the machine's chip")
    p.add_argument("--weights", metavar="FILE.safetensors",
                   help="the weight store (default: the one the module names)")
    p.add_argument("--compare", metavar="OTHER.mlir",
                   help="run OTHER on the same inputs and compare the outputs of the same name")
    p.add_argument("--compare-executor", choices=EXECUTORS, default="interpreter",
                   help="the executor of OTHER")
    p.add_argument("--compare-weights", metavar="FILE.safetensors",
                   help="OTHER's weight store (default: the one it names)")
    p.add_argument("--min-cos", type=finite_float(-1.0, 1.0), default=0.99,
                   help="fail (exit 1) when an output's cosine similarity is below this")
    p.add_argument("--max-abs", type=finite_float(0.0), default=None,
                   help="fail (exit 1) when an output's max |a - b| is above this")
    p.add_argument("--atol", type=finite_float(0.0), default=0.0,
                   help="elements closer than this do not count as the first mismatch")
    p.set_defaults(fn=cmd_run_ir)
