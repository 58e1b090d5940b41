"""`top.relu` end to end (the worked example of ARCHITECTURE.md, "How to add an op"): an
MLP with torch's relu imported into Top, lowered to Tpu and to linalg, and run by the numpy
interpreter, the reference machine and real MLIR, each against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.reference.kernels import unary
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.dialects.weight_store import WeightStore
from toptpu.frontends.fx_importer import import_module
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.mlir_jit import MLIRJit
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes


class ReluMlp(torch.nn.Module):
    """An OPT-style MLP: fc1, relu, fc2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _imported() -> tuple[ModuleOp, WeightStore, dict[str, np.ndarray], np.ndarray]:
    model = ReluMlp().eval()
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    module, store = import_module(model, (x,), input_names=["x"], output_names=["y"])
    run_passes(module, top_pipeline_passes(), store=store)
    with torch.no_grad():
        ref = model(x).numpy()
    return module, store, {"x": x.numpy()}, ref


def test_relu_kernel_is_torch_relu() -> None:
    x = np.array([[-2.0, -0.0, 0.0, 0.5, np.inf, -np.inf, np.nan]], np.float32)
    got = unary("relu", x)
    want = torch.relu(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, want)  # NaN stays NaN, as in torch
    assert got.dtype == np.float32


def test_top_relu_imported_and_interpreted_as_torch() -> None:
    module, store, feeds, ref = _imported()
    assert [op.name for op in module.walk()].count("top.relu") == 1
    got = Interpreter(module, store).run(feeds).outputs["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["f32", "bf16", "w8bf16"])
def test_tpu_relu_on_the_interpreter_and_the_machine(mode: str) -> None:
    module, store, feeds, ref = _imported()
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    assert any(op.name == "tpu.relu" for op in module.walk())
    tpu_out = Interpreter(module, store).run(feeds).outputs["y"]
    assert similarity(tpu_out, ref).cosine >= (0.99999 if mode == "f32" else 0.99)
    chip = get_chip("bm1684x")
    machine = simulate(compile_for_machine(module, chip), store, feeds, chip)
    assert similarity(machine.outputs["y"], tpu_out).cosine >= 0.99999


def test_top_relu_through_linalg_and_real_mlir() -> None:
    module, store, feeds, ref = _imported()
    got = MLIRJit(module, store).run(feeds)["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
