"""An op is one class: every op carries its kernel binding (or is declared structural),
every Tpu op of a Top op is derived from it, and the custom assembly formats print and parse
back. One module below holds every Top op, written in its custom form: it parses, runs on the
interpreter through the kernel bindings, lowers to Tpu (the twins' bindings give the same
bytes in f32), groups, and every stage prints and parses back to the same IR."""

from __future__ import annotations

import inspect
import os
import re

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.ir import Operation

from toptpu.backend.reference import interpreter
from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import EVALUATORS, Interpreter, evaluate_kernel
from toptpu.backend.target.chips import get_chip
from toptpu.dialects import dev, top, tpu
from toptpu.dialects.common import ShapedOp, numpy_dtype
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.weight_store import STORE_ATTR, WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.pipelines import run_passes

ALL_OPS: tuple[type[Operation], ...] = (*top.Top.operations, *tpu.Tpu.operations,
                                         *dev.Dev.operations)

#: the ops evaluated by dedicated code: weights (the store), constants (their attribute), a
#: layer group's loads and stores (run by the group), collectives (all devices together)
STRUCTURAL = {"top.weight", "top.constant", "tpu.weight", "tpu.constant", "tpu.load",
              "tpu.store", "dev.all_reduce", "dev.all_gather"}


def test_every_op_has_a_kernel_binding_or_is_declared_structural() -> None:
    shaped = [op for op in ALL_OPS if issubclass(op, ShapedOp)]
    assert {op.name for op in shaped if op.STRUCTURAL} == STRUCTURAL
    for op in shaped:
        if op.STRUCTURAL:
            continue
        kernel = interpreter.kernel_of(op)
        assert inspect.getmodule(kernel) is K, op.name
        assert EVALUATORS[op] is evaluate_kernel, op.name
        for name in op.REDUCTION_KERNELS or ():
            assert inspect.getmodule(interpreter.kernel_of(op, name)) is K, (op.name, name)
    # the structural ops a net holds at its top level have their own evaluator
    for op in shaped:
        if op.STRUCTURAL and op.name not in ("tpu.load", "tpu.store"):
            assert EVALUATORS[op] is not evaluate_kernel, op.name
    # the collectives' kernels (run by run_spmd) are bound too
    for op in dev.COLLECTIVES:
        assert inspect.getmodule(interpreter.kernel_of(op)) is K


def test_an_op_naming_a_kernel_that_does_not_exist_is_named() -> None:
    class NoSuchKernel(top.UnaryOp):
        name = "test.no_such_kernel"
        KERNEL = "no_such_kernel"

    with pytest.raises(interpreter.KernelBindingError, match="'test.no_such_kernel' names "
                                                            "the kernel 'no_such_kernel'"):
        interpreter.kernel_of(NoSuchKernel)


def test_every_tpu_twin_is_derived_from_its_top_op() -> None:
    source = inspect.getsource(tpu)
    top_ops = [op for op in top.Top.operations if issubclass(op, ShapedOp)]
    assert set(tpu.TPU_OF_TOP) == set(top_ops)
    for op in top_ops:
        twin = tpu.TPU_OF_TOP[op]
        assert twin.name == f"tpu.{op.op_kind()}" and twin.__name__ == op.__name__
        assert twin in tpu.Tpu.operations and issubclass(twin, tpu.TpuOp)
        # the Top op's base classes (operands, attributes, behaviour), not the Top op
        assert not issubclass(twin, top.TopOp) and not issubclass(twin, op)
        for base in op.__bases__:
            assert base is top.TopOp or issubclass(twin, base), (op.name, base)
        for k, v in vars(op).items():  # its class constants carry over
            if k.isupper():
                assert getattr(twin, k) == v, (op.name, k)
        assert getattr(tpu, op.__name__) is twin  # tpu.MatMulOp, ...
        assert f"class {op.__name__}(" not in source, f"{op.__name__} written out in tpu.py"
    # the Tpu-only attributes, declared once
    assert {"source", "part"} <= set(tpu.WeightOp.get_irdl_definition().attributes)
    assert "tpu.const_offset" in tpu.ConstantOp.get_irdl_definition().attributes


# --------------------------------------------------------------------------- every Top op

INPUTS = os.path.join(os.path.dirname(__file__), "filecheck", "Inputs")

WEIGHTS = {"fc.weight": (6, 8), "fc.bias": (6,), "norm.weight": (8,), "embed.weight": (5, 8),
           "conv.weight": (4, 3, 3, 3), "dconv.weight": (8, 3), "moe.gate": (6, 8, 8),
           "moe.up": (6, 8, 8), "moe.down": (6, 8, 8)}


def _custom(module: Operation) -> str:
    from io import StringIO

    from xdsl.printer import Printer

    out = StringIO()
    Printer(stream=out).print_op(module)
    return out.getvalue()


def _every_top_op() -> tuple[ModuleOp, WeightStore, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    store = WeightStore.from_arrays({n: rng.standard_normal(s).astype(np.float32)
                                     for n, s in WEIGHTS.items()})
    with open(os.path.join(INPUTS, "every_top_op.mlir")) as f:
        module = parse_ir(f.read(), "every_top_op.mlir")
    module.attributes[STORE_ATTR] = StringAttr(store.uri)
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    inputs: list[np.ndarray] = []
    for arg in fn.body.block.args:
        t = arg.type
        assert isinstance(t, TensorType)
        shape, dt = tuple(t.get_shape()), numpy_dtype(t.element_type)
        if np.issubdtype(dt, np.integer):  # (gather ids: the table has 5 rows)
            inputs.append(rng.integers(0, 5, shape).astype(dt))
        elif arg.name_hint == "valid":  # (causal_conv1d: every token real)
            inputs.append(np.ones(shape, dt))
        else:
            inputs.append(rng.standard_normal(shape).astype(dt))
    return module, store, inputs


def test_every_top_op_is_in_the_module() -> None:
    module, _, _ = _every_top_op()
    used = {op.name for op in module.walk()}
    assert {op.name for op in top.Top.operations} <= used


def test_every_top_op_runs_through_its_kernel_binding_and_its_twin_s() -> None:
    """Each op's kernel binding fits its kernel: the module runs, each output has its IR type
    and is finite; lowered in f32, the twins' bindings give the same bytes."""
    module, store, inputs = _every_top_op()
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp))
    want = list(fn.function_type.outputs)
    got = Interpreter(module, store).run(inputs).outputs
    assert len(got) == len(want)
    for (name, arr), t in zip(got.items(), want, strict=True):
        assert isinstance(t, TensorType)
        assert arr.shape == tuple(t.get_shape()) and arr.dtype == numpy_dtype(t.element_type), \
            name
        assert np.isfinite(arr.astype(np.float64)).all(), name
    lowered = module.clone()
    run_passes(lowered, [ConvertTopToTpuPass(mode="f32")], store=store)
    assert not [op.name for op in lowered.walk() if op.name.startswith("top.")]
    tpu_got = Interpreter(lowered, store).run(inputs).outputs
    for name, arr in got.items():
        assert tpu_got[name].tobytes() == arr.tobytes(), name


def _round_trip(module: ModuleOp) -> str:
    """The module's custom form, checked to parse back to the same IR (and generic form)."""
    text = _custom(module)
    back = parse_ir(text, "custom.mlir")
    assert back.is_structurally_equivalent(module)
    assert _custom(back) == text
    again = parse_ir(print_generic(back), "generic.mlir")
    assert again.is_structurally_equivalent(module)
    return text


#: the ops a reader meets most print in their custom form, not xDSL's generic one
READABLE = ("top.weight", "top.matmul", "top.add", "top.mul", "top.rms_norm", "top.rope",
            "top.attention", "top.reshape", "tpu.weight", "tpu.matmul", "tpu.a16_matmul",
            "tpu.add", "tpu.mul", "tpu.rms_norm", "tpu.rope", "tpu.attention", "tpu.reshape",
            "tpu.group", "tpu.load", "tpu.store", "tpu.yield")


def test_the_custom_forms_print_and_parse_back_at_every_level() -> None:
    module, store, _ = _every_top_op()
    top_text = _round_trip(module)
    assert re.search(r"= top\.matmul %ln, %w bias %b \{transpose_b = true\} : ", top_text)
    assert '%w = top.weight "fc.weight" : tensor<6x8xf32>' in top_text
    assert "top.attention %ro, %k, %v mask %mask history %hk, %hv {" in top_text
    generic = [m for m in re.findall(r'"((?:top|tpu)\.\w+)"\(', top_text)]
    assert generic == ["top.constant"]  # the one op without a custom form
    lowered = module.clone()
    run_passes(lowered, [ConvertTopToTpuPass(mode="w4f32", group_size=8)], store=store)
    tpu_text = _round_trip(lowered)
    assert re.search(r"tpu\.a16_matmul %\w+, %\w+, %\w+ zeros %\w+ bias %\w+ \{weight_bits = 4",
                     tpu_text)
    assert re.search(r"tpu\.a16_moe_experts %\w+, gate\(%\w+, %\w+ zeros %\w+\), up\(", tpu_text)
    assert not {m for m in re.findall(r'"((?:top|tpu)\.\w+)"\(', tpu_text)} & set(READABLE)


def test_a_grouped_net_prints_and_parses_back() -> None:
    rng = np.random.default_rng(1)
    store = WeightStore.from_arrays({
        "norm.weight": rng.standard_normal(64).astype(np.float32),
        "fc.weight": rng.standard_normal((32, 64)).astype(np.float32)})
    with open(os.path.join(INPUTS, "grouped_net.mlir")) as f:
        module = parse_ir(f.read(), "grouped_net.mlir")
    module.attributes[STORE_ATTR] = StringAttr(store.uri)
    inputs = [rng.standard_normal((1, 8, 64)).astype(np.float32),
              rng.standard_normal((1, 8, 32)).astype(np.float32)]
    run_passes(module, [ConvertTopToTpuPass(mode="w8f32")], store=store)
    (want,) = Interpreter(module, store).run(inputs).outputs.values()
    compile_for_machine(module, get_chip("bm1684x"))
    text = _round_trip(module)
    for name in ("tpu.group", "tpu.load", "tpu.store", "tpu.yield", "tpu.a16_matmul",
                 "tpu.rms_norm", "tpu.mul", "tpu.add"):
        assert re.search(rf"(= |^\s*){re.escape(name)}[ (]", text, re.M), name
        assert f'"{name}"' not in text, name
    back = parse_ir(text, "grouped.mlir")
    (got,) = Interpreter(back, store).run(inputs).outputs.values()
    assert got.tobytes() == want.tobytes()
