"""Stage comparison: run two stages (torch / Top / Tpu) on the same inputs and compare.

Each stage yields its outputs and, with `compare_all`, every intermediate tensor by name
(location names: the FX node a Top op came from; Tpu ops keep the names of the Top ops they
lower). Tensors present in both stages are compared with cosine, euclidean similarity and
SQNR; the report names the first tensor (in the second stage's execution order) whose
cosine drops below the threshold.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Protocol

import numpy as np

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.dialects.output_file import open_output, write_output
from toptpu.dialects.weight_store import WeightStore
from toptpu.metrics import Similarity, similarity
from toptpu.mlir_jit import MLIRJit

#: the verification ladder (ARCHITECTURE.md, "Verification ladder")
THRESHOLDS = {
    "top-vs-torch": 0.99999,
    "tpu-f32": 0.99999,
    "tpu-f16": 0.99,
    "tpu-bf16": 0.99,
    "tpu-w8": 0.99,
    "tpu-w4": 0.98,
}


def tpu_threshold(mode: str) -> float:
    """Cosine a Tpu stage in `mode` must reach against Top."""
    if mode in ("f32",):
        return THRESHOLDS["tpu-f32"]
    if mode.startswith("w4"):
        return THRESHOLDS["tpu-w4"]
    if mode.startswith("w8"):
        return THRESHOLDS["tpu-w8"]
    return THRESHOLDS[f"tpu-{mode}"]


@dataclass
class StageResult:
    outputs: dict[str, np.ndarray]
    values: dict[str, np.ndarray] = field(default_factory=dict)  # execution order


class Stage(Protocol):
    name: str

    def run(self, inputs: Mapping[str, np.ndarray], keep_all: bool) -> StageResult: ...


@dataclass
class IRStage:
    """A Top or Tpu module run by the numpy interpreter."""

    name: str
    module: Any  # ModuleOp
    store: WeightStore | None = None  # its weights (None: the file the module names)
    func_name: str | None = None

    def run(self, inputs: Mapping[str, np.ndarray], keep_all: bool) -> StageResult:
        res = Interpreter(self.module, self.store).run(inputs, self.func_name,
                                                        keep_all=keep_all)
        return StageResult(res.outputs, res.values)


@dataclass
class MLIRStage:
    """A Top module lowered to linalg and compiled by real MLIR (`toptpu.mlir_jit`): the
    numerical oracle independent of the numpy kernels. With `keep_all` it is compiled to
    also return every named intermediate tensor (compiled once per variant)."""

    name: str
    module: Any  # ModuleOp (Top)
    store: WeightStore | None = None  # its weights (None: the file the module names)
    func_name: str | None = None
    jits: dict[bool, Any] = field(default_factory=dict)  # keep_all -> MLIRJit

    def run(self, inputs: Mapping[str, np.ndarray], keep_all: bool) -> StageResult:
        if keep_all not in self.jits:
            self.jits[keep_all] = MLIRJit(self.module, self.store, func_name=self.func_name,
                                          keep_all=keep_all)
        res = self.jits[keep_all].run(inputs, keep_all=keep_all)
        return StageResult(res.outputs, res.values)


@dataclass
class TorchStage:
    """The exported torch program, run node by node (intermediates by Top's names)."""

    name: str
    exported: Any  # torch.export.ExportedProgram
    input_names: list[str]
    output_names: list[str]
    module: Any = None  # the nn.Module, for non-persistent buffers

    def run(self, inputs: Mapping[str, np.ndarray], keep_all: bool) -> StageResult:
        import torch

        from toptpu.frontends.fx_importer import tensor_name

        ep = self.exported
        buffers = dict(self.module.named_buffers()) if self.module is not None else {}
        args: list[Any] = []
        user = iter(self.input_names)
        for spec in ep.graph_signature.input_specs:
            if spec.kind.name == "USER_INPUT":
                args.append(torch.from_numpy(np.asarray(inputs[next(user)])))
            elif spec.target in ep.state_dict:
                args.append(ep.state_dict[spec.target])
            elif spec.target in ep.constants:
                args.append(ep.constants[spec.target])
            else:
                args.append(buffers[spec.target])
        values: dict[str, np.ndarray] = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                out = super().run_node(n)
                if keep_all and n.op == "call_function" and isinstance(out, torch.Tensor):
                    values[tensor_name(n)] = out.detach().float().numpy()
                return out

        with torch.no_grad():
            outs = Recorder(ep.graph_module).run(*args)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        outputs = {n: o.detach().float().numpy() for n, o in zip(self.output_names, outs,
                                                                  strict=True)}
        return StageResult(outputs, values)


@dataclass
class TensorReport:
    name: str
    shape: list[int]
    cosine: float
    euclidean: float
    sqnr_db: float
    ok: bool


@dataclass
class CompareReport:
    stage_a: str
    stage_b: str
    threshold: float
    outputs: list[TensorReport]
    tensors: list[TensorReport]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.outputs)

    @property
    def first_drop(self) -> TensorReport | None:
        return next((r for r in self.tensors if not r.ok), None)

    def table(self) -> str:
        """The report as text: every tensor's whole name (the column as wide as the longest),
        the intermediates' count below the threshold and the first of them, and the
        verdict, which judges the outputs only (an intermediate informs: quantization moves
        some far more than the outputs it feeds)."""
        width = max([52, *(len(r.name) for r in (*self.outputs, *self.tensors))])
        lines = [f"{self.stage_b} vs {self.stage_a} (cosine threshold {self.threshold})",
                 f"{'tensor':<{width}} {'shape':<18} {'cosine':>9} {'euclid':>9} "
                 f"{'sqnr dB':>8}"]
        for title, rows in (("outputs", self.outputs), ("intermediates", self.tensors)):
            if not rows:
                continue
            lines.append(f"-- {title}")
            for r in rows:
                mark = "" if r.ok else "   <-- below threshold"
                lines.append(f"{r.name:<{width}} {str(r.shape):<18} {r.cosine:9.6f} "
                             f"{r.euclidean:9.6f} {r.sqnr_db:8.1f}{mark}")
        drop = self.first_drop
        if self.tensors:
            below = sum(not r.ok for r in self.tensors)
            lines.append(f"first tensor below threshold: {drop.name if drop else 'none'} "
                         f"({below} of {len(self.tensors)} intermediates below; they inform, "
                         "only the outputs are judged)")
        bad = [r.name for r in self.outputs if not r.ok]
        lines.append(f"PASS: every output at or above {self.threshold}" if self.ok else
                     f"FAIL: output {', '.join(bad)} below {self.threshold}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        drop = self.first_drop
        d["first_drop"] = drop.name if drop else None
        return d


def _row(name: str, x: np.ndarray, ref: np.ndarray, threshold: float) -> TensorReport:
    """A tensor passes when it is as similar as the threshold asks, or exactly equal (an
    intermediate that is legitimately all zero in both stages, e.g. position ids at 0)."""
    s: Similarity = similarity(x, ref)
    return TensorReport(name, list(np.shape(ref)), s.cosine, s.euclidean, s.sqnr_db,
                        s.cosine >= threshold or s.exact)


def _save_npz(f: IO[bytes], arrays: Mapping[str, np.ndarray]) -> None:
    """`arrays` as an .npz file by name (np.savez's keywords, none of them its options)."""
    # Any: numpy's stub would take an array keyword for its allow_pickle option
    named: dict[str, Any] = dict(arrays)
    np.savez(f, **named)


def compare_stages(a: Stage, b: Stage, inputs: Mapping[str, np.ndarray], threshold: float,
                   compare_all: bool = False, dump_dir: str | None = None) -> CompareReport:
    """Run `a` (the reference) and `b` on `inputs` and compare them tensor by tensor."""
    ra, rb = a.run(inputs, compare_all), b.run(inputs, compare_all)
    outputs = []
    for name, ref in ra.outputs.items():
        if name not in rb.outputs:
            raise KeyError(f"stage {b.name} has no output '{name}' ({list(rb.outputs)})")
        outputs.append(_row(name, rb.outputs[name], ref, threshold))
    tensors = []
    if compare_all:
        for name, x in rb.values.items():
            expected = ra.values.get(name)
            if expected is None or np.shape(expected) != np.shape(x) or name in inputs:
                continue
            tensors.append(_row(name, np.asarray(x, dtype=np.float32),
                                np.asarray(expected, dtype=np.float32), threshold))
    report = CompareReport(a.name, b.name, threshold, outputs, tensors)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        with open_output(os.path.join(dump_dir, "inputs.npz"), "--dump") as f:
            _save_npz(f, {k: np.asarray(v) for k, v in inputs.items()})
        for stage, res in ((a.name, ra), (b.name, rb)):
            arrays = {**{f"output:{k}": v for k, v in res.outputs.items()}, **res.values}
            with open_output(os.path.join(dump_dir, f"{stage}.npz"), "--dump") as f:
                _save_npz(f, {k: np.asarray(v, dtype=np.float32) if _is_halfish(v) else v
                              for k, v in arrays.items()})
        write_output(os.path.join(dump_dir, "report.json"),
                     json.dumps(report.to_json(), indent=1), "--dump")
    return report


def _is_halfish(v: np.ndarray) -> bool:
    return np.asarray(v).dtype.name in ("bfloat16", "float16")
