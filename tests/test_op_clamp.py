"""`top.clamp` end to end (the worked example of ARCHITECTURE.md, "How to add an op": an op
with attributes): a model with torch.clamp, clamp_min, clamp_max, hardtanh and relu6
imported into Top, lowered to Tpu and to linalg, and run by the numpy interpreter, the
reference machine and real MLIR, each against torch."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from xdsl.dialects.builtin import ModuleOp, f32, i32
from xdsl.ir import Block
from xdsl.transforms.canonicalize import CanonicalizePass
from xdsl.utils.exceptions import VerifyException

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.reference.kernels import unary
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.dialects import top, tpu
from toptpu.dialects.common import f64_attr, tensor, ui8
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.weight_store import WeightStore
from toptpu.frontends.fx_importer import UnsupportedOpError, import_module
from toptpu.machine_pipeline import compile_for_machine
from toptpu.metrics import similarity
from toptpu.mlir_jit import MLIRJit
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes


class ClampMlp(torch.nn.Module):
    """fc1, then each clamp form torch.export keeps as its own aten op, summed, then fc2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        clamped = (torch.clamp(h, -0.5, 0.75)  # aten.clamp
                   + torch.clamp(h, max=0.25)  # aten.clamp, min None
                   + torch.clamp_min(h, -0.1)  # aten.clamp_min
                   + torch.clamp_max(h, 0.3)  # aten.clamp_max
                   + torch.nn.functional.hardtanh(h, -0.4, 0.6)  # aten.hardtanh
                   + torch.nn.functional.relu6(8 * h)  # aten.relu6
                   + h.clip(0.5, -0.5))  # aten.clip, min > max: every element is max
        return self.fc2(clamped)


#: the bounds each clamp of `ClampMlp` imports with, in graph order
BOUNDS = [(-0.5, 0.75), (None, 0.25), (-0.1, None), (None, 0.3), (-0.4, 0.6), (0.0, 6.0),
          (0.5, -0.5)]


def _imported() -> tuple[ModuleOp, WeightStore, dict[str, np.ndarray], np.ndarray]:
    model = ClampMlp().eval()
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    module, store = import_module(model, (x,), input_names=["x"], output_names=["y"])
    run_passes(module, top_pipeline_passes(), store=store)
    with torch.no_grad():
        ref = model(x).numpy()
    return module, store, {"x": x.numpy()}, ref


# --------------------------------------------------------------------------- the kernel

SPECIAL = np.array([-2.0, -0.75, -0.5, -0.0, 0.0, 0.1, 0.5, 0.75, 3.0, np.inf, -np.inf, np.nan],
                   np.float32)


@pytest.mark.parametrize("lower, upper", [(-0.5, 0.75), (None, 0.25), (-0.1, None),
                                          (0.5, -0.5), (-np.inf, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clamp_kernel_is_torch_clamp(lower: float | None, upper: float | None,
                                     dtype: torch.dtype) -> None:
    """The same bytes as torch (a NaN stays NaN; in a half type the quiet NaN of its sign,
    as every kernel rounds one), min > max gives max, a bound rounded once to a half
    type."""
    x = torch.from_numpy(np.concatenate([SPECIAL, np.linspace(-1, 1, 37, dtype=np.float32)]))
    x = x.to(dtype)
    want = torch.clamp(x, lower, upper)
    arr = x.numpy() if dtype != torch.bfloat16 else x.view(torch.int16).numpy().view(
        ml_dtypes.bfloat16)
    got = unary("clamp", arr, min=lower, max=upper)
    assert got.dtype == arr.dtype
    nan = torch.isnan(want).numpy()
    assert np.isnan(got.astype(np.float32)).tolist() == nan.tolist()
    want_bits = want.view(torch.int16 if dtype != torch.float32 else torch.int32).numpy()
    assert got.view(want_bits.dtype)[~nan].tolist() == want_bits[~nan].tolist()


def test_clamp_kernel_is_exact_on_integers() -> None:
    """Integers clamp in their own type: nothing goes through f32 (2**30 + 1 is no f32)."""
    x = np.array([-(2**31), -7, 0, 3, 2**30 + 1, 2**31 - 1], np.int32)
    for lower, upper in [(-5, 2**30 + 3), (0, None), (None, -(2**30) - 1)]:
        got = unary("clamp", x, min=lower, max=upper)
        assert got.dtype == np.int32
        assert got.tolist() == torch.clamp(torch.from_numpy(x), lower, upper).tolist()


# --------------------------------------------------------------------------- the op


def test_the_op_checks_its_bounds() -> None:
    block = Block(arg_types=[tensor((2, 3), f32), tensor((2, 3), i32), tensor((2, 3), ui8)])
    x, ids, raw = block.args
    good = top.ClampOp(x, -1, 2.5)
    assert good.bounds == (-1.0, 2.5) and good.flops() == 12
    assert top.ClampOp(x, max=1.0).bounds == (None, 1.0) and top.ClampOp(x, max=1.0).flops() == 6
    assert top.ClampOp(ids, 0, 7).result_dtype() == np.int32
    for op, message in [
            (lambda: top.ClampOp(x), "top.clamp has neither a min nor a max"),
            (lambda: top.ClampOp(x, float("nan")), "top.clamp bound is NaN"),
            (lambda: top.ClampOp(ids, 0.5), "top.clamp of an i32 tensor has i32 bounds"),
            (lambda: top.ClampOp(ids, None, 2.0**31), "has i32 bounds"),
            (lambda: top.ClampOp(raw, 0, 3), "takes a float or signed integer tensor")]:
        with pytest.raises(VerifyException, match=message):
            op()
    with pytest.raises(TypeError, match="top.clamp min must be a number"):
        top.ClampOp(x, "0")  # type: ignore[arg-type]
    # the generic form builds the same op
    built = top.ClampOp.build([x], {"min": f64_attr(-1.0), "max": f64_attr(2.5)})
    assert built.attributes == good.attributes


def test_the_custom_form_prints_and_parses_back() -> None:
    text = """builtin.module {
  func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %y = top.clamp %x {min = 0xFFF0000000000000 : f64, max = 6.000000e+00 : f64}
      : tensor<4xf32> -> tensor<4xf32>
    func.return %y : tensor<4xf32>
  }
}"""
    module = parse_ir(text, "clamp.mlir")
    op = next(o for o in module.walk() if isinstance(o, top.ClampOp))
    assert op.bounds == (-np.inf, 6.0)
    assert parse_ir(print_generic(module), "generic.mlir").is_structurally_equivalent(module)
    got = Interpreter(module).run([np.array([-1e30, -1, 5, 7], np.float32)]).outputs
    assert list(got.values())[0].tolist() == [np.float32(-1e30), -1, 5, 6]


# --------------------------------------------------------------------------- canonicalization

BOUND_CHOICES = [None, -1.0, -0.25, 0.0, 0.3, 2.0]


def _f64(v: float) -> str:
    """An f64 attribute in MLIR text (an infinity as its bits, MLIR has no `inf` literal)."""
    if math.isinf(v):
        return f"0x{np.array(v, np.float64).view(np.uint64):016X} : f64"
    return f"{float(v)!r} : f64"


def _clamp_pairs(elem: str, pairs: list[tuple[tuple[float | None, float | None],
                                               tuple[float | None, float | None]]]) -> ModuleOp:
    """One function: for each (inner, outer) pair of bounds, clamp(clamp(x, inner), outer)
    as a result of its own."""
    def attrs(bounds: tuple[float | None, float | None]) -> str:
        return ", ".join(f"{k} = {_f64(v)}" for k, v in zip(("min", "max"), bounds, strict=True)
                         if v is not None)
    t = f"tensor<64x{elem}>"
    body = "".join(f"""    %a{i} = "top.clamp"(%x) {{{attrs(inner)}}} : ({t}) -> {t}
    %b{i} = "top.clamp"(%a{i}) {{{attrs(outer)}}} : ({t}) -> {t}
""" for i, (inner, outer) in enumerate(pairs))
    results = ", ".join(f"%b{i}" for i in range(len(pairs)))
    types = ", ".join([t] * len(pairs))
    return parse_ir(f"""builtin.module {{
  func.func @main(%x: {t}) -> ({types}) {{
{body}    func.return {results} : {types}
  }}
}}""", "clamp_pairs.mlir")


@pytest.mark.parametrize("elem", ["f32", "bf16", "i32"])
def test_a_clamp_of_a_clamp_is_one_clamp_with_the_same_bits(elem: str) -> None:
    """Every pair of bound pairs (each bound given or not, min > max included): the
    canonicalized module has one clamp per pair and gives the bits of the two clamps, NaN
    and infinities included."""
    values = np.concatenate([SPECIAL, np.linspace(-3, 3, 52, dtype=np.float32)])
    if elem == "i32":
        x = np.arange(-32, 32, dtype=np.int32)
    else:
        x = values.astype(ml_dtypes.bfloat16 if elem == "bf16" else np.float32)
    bounds = [(lo, hi) for lo in BOUND_CHOICES for hi in BOUND_CHOICES
              if lo is not None or hi is not None]
    if elem == "i32":  # integer bounds for an integer tensor
        bounds = [(None if lo is None else round(4 * lo), None if hi is None else round(4 * hi))
                  for lo, hi in bounds]
    pairs = [(inner, outer) for inner in bounds for outer in bounds]
    module = _clamp_pairs(elem, pairs)
    want = list(Interpreter(module).run([x]).outputs.values())
    run_passes(module, [CanonicalizePass()])
    assert sum(isinstance(op, top.ClampOp) for op in module.walk()) == len(pairs)
    got = list(Interpreter(module).run([x]).outputs.values())
    bits = np.int32 if elem != "bf16" else np.int16
    for pair, g, w in zip(pairs, got, want, strict=True):
        assert g.dtype == w.dtype
        assert g.view(bits).tolist() == w.view(bits).tolist(), pair


def test_clamps_that_bound_nothing_fold_away_and_a_shared_clamp_stays() -> None:
    module = _clamp_pairs("f32", [((-np.inf, None), (None, np.inf))])
    run_passes(module, [CanonicalizePass()])
    assert not [op for op in module.walk() if isinstance(op, top.ClampOp)]
    shared = parse_ir("""builtin.module {
  func.func @main(%x: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %a = top.clamp %x {min = 0.0 : f64} : tensor<4xf32> -> tensor<4xf32>
    %b = top.clamp %a {max = 1.0 : f64} : tensor<4xf32> -> tensor<4xf32>
    func.return %a, %b : tensor<4xf32>, tensor<4xf32>
  }
}""", "shared.mlir")
    run_passes(shared, [CanonicalizePass()])
    assert [op.bounds for op in shared.walk() if isinstance(op, top.ClampOp)] == [
        (0.0, None), (None, 1.0)]


# --------------------------------------------------------------------------- end to end


def test_top_clamp_imported_and_interpreted_as_torch() -> None:
    module, store, feeds, ref = _imported()
    clamps = [op for op in module.walk() if isinstance(op, top.ClampOp)]
    assert [op.bounds for op in clamps] == BOUNDS
    got = Interpreter(module, store).run(feeds).outputs["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["f32", "bf16", "w8bf16"])
def test_tpu_clamp_on_the_interpreter_and_the_machine(mode: str) -> None:
    module, store, feeds, ref = _imported()
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    assert sum(op.name == "tpu.clamp" for op in module.walk()) == len(BOUNDS)
    tpu_out = Interpreter(module, store).run(feeds).outputs["y"]
    assert similarity(tpu_out, ref).cosine >= (0.99999 if mode == "f32" else 0.99)
    chip = get_chip("bm1684x")
    machine = simulate(compile_for_machine(module, chip), store, feeds, chip, checked=True)
    assert similarity(machine.outputs["y"], tpu_out).cosine >= 0.99999
    # the clamps run inside layer groups (sliced as their base class says); no group sums a
    # reduction in parts here, so the machine gives the interpreter's bits (docs/machine.md)
    groups = [op for op in module.walk() if isinstance(op, tpu.GroupOp)]
    assert all(isinstance(op.parent_op(), tpu.GroupOp)
               for op in module.walk() if op.name == "tpu.clamp")
    assert groups and all(g.reduction_parts() == 1 for g in groups)
    assert machine.outputs["y"].dtype == tpu_out.dtype
    assert np.array_equal(machine.outputs["y"], tpu_out)
    if mode == "f32":
        np.testing.assert_allclose(machine.outputs["y"], ref, rtol=1e-5, atol=1e-5)


def test_top_clamp_through_linalg_and_real_mlir() -> None:
    module, store, feeds, ref = _imported()
    got = MLIRJit(module, store).run(feeds)["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


class ClampIds(torch.nn.Module):
    """An integer clamp (ids kept in a range), as position ids and bucket indices are."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.clamp(ids, 0, 2**30 + 3) + torch.clamp_max(ids, -5)


def test_an_integer_clamp_is_exact_on_the_interpreter_and_in_mlir() -> None:
    ids = torch.tensor([[-(2**30) - 7, -6, 0, 9, 2**30 + 1, 2**30 + 9]], dtype=torch.int32)
    module, store = import_module(ClampIds(), (ids,), input_names=["ids"],
                                  output_names=["y"])
    assert [op.bounds for op in module.walk() if isinstance(op, top.ClampOp)] == [
        (0.0, 2.0**30 + 3), (None, -5.0)]
    want = ClampIds()(ids).numpy()
    feeds = {"ids": ids.numpy()}
    assert Interpreter(module, store).run(feeds).outputs["y"].tolist() == want.tolist()
    assert MLIRJit(module, store).run(feeds)["y"].tolist() == want.tolist()


class TensorBounds(torch.nn.Module):
    def forward(self, x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, lo)


def test_tensor_bounds_are_refused_by_name() -> None:
    x, lo = torch.randn(4), torch.zeros(4)
    with pytest.raises(UnsupportedOpError, match="aten.clamp.Tensor"):
        import_module(TensorBounds(), (x, lo), input_names=["x", "lo"], output_names=["y"])


class NanBound(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, float("nan"), 1.0)


def test_a_nan_bound_is_refused_with_the_ops_reason() -> None:
    """The importer reads aten.clamp from its schema and passes the bounds to top.clamp's
    constructor, whose refusal it reports with the aten op and the model line."""
    with pytest.raises(UnsupportedOpError, match=r"aten.clamp.default'.*top.clamp bound is "
                                                 r"NaN; give a number at .*test_op_clamp.py"):
        import_module(NanBound(), (torch.randn(4),), input_names=["x"], output_names=["y"])
