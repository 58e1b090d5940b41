"""Top and Tpu verified by real MLIR through IRDL generated from the xDSL definitions.

What must hold (ARCHITECTURE.md, "Verification ladder"; issue 8): every module the pipeline
produces for a tiny Qwen2 and Llama model verifies in MLIR with the IRDL-loaded dialects
(no unregistered dialects), and where xDSL and MLIR disagree on a module that is a test
failure -- except for the documented IRDL gaps, which are tested as such so that they stay
known.
"""

from __future__ import annotations

import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    DenseArrayBase,
    FloatAttr,
    IntegerAttr,
    ModuleOp,
    StringAttr,
    TensorType,
    f32,
    i1,
    i64,
)
from xdsl.ir import Block, Operation, Region
from xdsl.utils.exceptions import DiagnosticException, VerifyException

from helpers import run_tool
from toptpu.dialects import top, tpu
from toptpu.dialects.common import ComparePredicate, ReduceMode, RopeMode
from toptpu.dialects.irdl_export import BUILTIN_BASES, export_irdl
from toptpu.dialects.mlir_check import MlirCheckError, verify_with_irdl
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes

pytestmark = pytest.mark.slow  # real MLIR verifies every pipeline stage of real decoder layers


FAMILIES = ["qwen2", "llama3"]
_STAGES: dict[str, list[tuple[str, ModuleOp]]] = {}


def pipeline_stages(tiny_models, family: str) -> list[tuple[str, ModuleOp]]:
    """(stage, module) for: import, after each Top pass, after convert-top-to-tpu in
    f32/bf16/w4bf16 and after the canonicalize that follows it."""
    if family not in _STAGES:
        imp = import_decoder_layer(tiny_models(family), 8, mask_value=-10000.0,
                                   top_pipeline=False)
        module, store = imp.module, imp.store
        stages = [("import", module.clone())]
        run_passes(module, top_pipeline_passes(), store=store,
                   after=lambda p, m: stages.append((f"top:{p.name}", m.clone())))
        for mode in ("f32", "bf16", "w4bf16"):
            low = module.clone()
            run_passes(low, tpu_pipeline_passes(mode), store=store,
                       after=lambda p, m, mode=mode: stages.append((f"{mode}:{p.name}",
                                                                    m.clone())))
        _STAGES[family] = stages
    return _STAGES[family]


# --------------------------------------------------------------------------- positive


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pipeline_stage_verifies_in_mlir(tiny_models, family: str) -> None:
    stages = pipeline_stages(tiny_models, family)
    names = [s for s, _ in stages]
    assert names[0] == "import" and "top:fuse" in names
    assert {"f32:convert-top-to-tpu", "bf16:canonicalize", "w4bf16:convert-top-to-tpu"} <= set(
        names)
    for stage, module in stages:
        try:
            verify_with_irdl(module)
        except MlirCheckError as e:
            pytest.fail(f"{family} {stage}: {e}")


def test_builtin_base_names_are_mlir_names() -> None:
    """Each base name of the export table accepts a sample value in MLIR (and a base
    constraint is not vacuous: a value of another kind is rejected)."""
    import mlir.ir as ir
    from mlir.dialects import irdl

    types = {"!builtin.tensor": "tensor<2xf32>", "!builtin.unranked_tensor": "tensor<*xf32>",
             "!builtin.vector": "vector<4xf32>", "!builtin.memref": "memref<2xf32>",
             "!builtin.integer": "i32", "!builtin.index": "index", "!builtin.f16": "f16",
             "!builtin.bf16": "bf16", "!builtin.f32": "f32", "!builtin.f64": "f64",
             "!builtin.complex": "complex<f32>", "!builtin.function": "((i32) -> i32)",
             "!builtin.none": "none"}
    attrs = {"#builtin.integer": "1 : i64", "#builtin.float": "1.0 : f32",
             "#builtin.string": '"s"', "#builtin.dense_array": "array<i64: 1>",
             "#builtin.dense_int_or_fp_elements": "dense<1.0> : tensor<2xf32>",
             "#builtin.array": "[1]", "#builtin.dictionary": "{a = 1}",
             "#builtin.unit": "unit", "#builtin.symbol_ref": "@foo",
             "#builtin.affine_map": "affine_map<(d0) -> (d0)>"}
    assert set(BUILTIN_BASES.values()) == set(types) | set(attrs)
    ops, uses = [], []
    everything = {**types, **attrs}
    for i, (base, sample) in enumerate(everything.items()):
        if base.startswith("!"):
            ops.append(f'irdl.operation @o{i} {{ %0 = irdl.base "{base}"\n'
                       f"irdl.results(r: %0) }}")
            uses.append(f'%r{i} = "probe.o{i}"() : () -> {sample}')
        else:
            ops.append(f'irdl.operation @o{i} {{ %0 = irdl.base "{base}"\n'
                       f'irdl.attributes {{"a" = %0}} }}')
            uses.append(f'"probe.o{i}"() {{a = {sample}}} : () -> ()')
    ctx = ir.Context()
    with ctx:
        irdl.load_dialects(ir.Module.parse("irdl.dialect @probe {\n" + "\n".join(ops) + "}"))
        ctx.allow_unregistered_dialects = False
        ir.Module.parse("\n".join(uses))  # raises if a base name is wrong
        with pytest.raises(ir.MLIRError, match="builtin.integer"):
            k = list(everything).index("#builtin.integer")
            ir.Module.parse(f'"probe.o{k}"() {{a = 1.0 : f32}} : () -> ()')


def test_irdl_export_prints_loadable_irdl_with_its_gaps() -> None:
    res = run_tool("python", "-m", "toptpu.dialects.irdl_export")
    assert res.returncode == 0, res.stderr
    assert "irdl.dialect @top" in res.stdout and "irdl.dialect @tpu" in res.stdout
    gap = next(line for line in res.stdout.splitlines()
               if line.startswith("// attribute 'transpose_b' of ") and "top.matmul" in line)
    assert "optional: MLIR checks neither presence nor kind" in gap
    assert "variadic group" not in res.stdout.split("irdl.dialect")[0]  # no longer a gap
    import mlir.ir as ir
    from mlir.dialects import irdl

    with ir.Context():
        irdl.load_dialects(ir.Module.parse(res.stdout))


# --------------------------------------------------------------------------- agreement


def _xdsl_accepts(module: ModuleOp) -> bool:
    try:
        module.verify()
        return True
    except (VerifyException, DiagnosticException):
        return False


def _agree(module: ModuleOp, op_name: str, what: str) -> None:
    """xDSL and MLIR both accept or both reject; MLIR's error names the op."""
    xdsl_ok = _xdsl_accepts(module)
    try:
        verify_with_irdl(module)
        mlir_ok, msg = True, ""
    except MlirCheckError as e:
        mlir_ok, msg = False, str(e)
    assert xdsl_ok == mlir_ok, f"{what}: xDSL {'accepts' if xdsl_ok else 'rejects'}, " \
                               f"MLIR {'accepts' if mlir_ok else 'rejects'} {msg}"
    if not mlir_ok:
        assert f"'{op_name}'" in msg, msg


def _wrap(op: Operation, arg_types: list) -> ModuleOp:
    block = Block(arg_types=arg_types)
    block.add_op(op)
    block.add_op(func.ReturnOp())
    return ModuleOp([func.FuncOp("main", (arg_types, []), Region(block))])


@pytest.mark.parametrize("dialect", ["top", "tpu"])
def test_bare_ops_are_rejected_by_both(dialect: str) -> None:
    """Every op with required operands or attributes, built with none: xDSL rejects it and
    so does MLIR, naming the op. (Ops without required parts, e.g. terminators, are only
    constrained by traits, which IRDL cannot express: a listed gap.)"""
    d = top.Top if dialect == "top" else tpu.Tpu
    t = TensorType(f32, [2, 4])
    checked = 0
    for cls in d.operations:
        opdef = cls.get_irdl_definition()
        if not any(type(o).__name__ == "OperandDef" for _, o in opdef.operands) and not any(
                type(a).__name__ == "AttributeDef" for a in opdef.attributes.values()):
            assert any(g.op == cls.name and g.where == "traits" for g in export_irdl().gaps)
            continue
        checked += 1
        n_res = sum(1 for _, r in opdef.results if type(r).__name__ == "ResultDef")
        regions = [Region(Block()) for _ in opdef.regions]
        op = cls.create(result_types=[t] * n_res, regions=regions)
        module = _wrap(op, [])
        assert not _xdsl_accepts(module), cls.name
        _agree(module, cls.name, f"bare {cls.name}")
    assert checked >= 40


def _isolated(op: Operation) -> ModuleOp:
    """A module holding a copy of `op` alone, its operands as function arguments."""
    block = Block(arg_types=[v.type for v in op.operands])
    new = op.clone()
    new.operands = list(block.args)
    block.add_op(new)
    block.add_op(func.ReturnOp())
    return ModuleOp([func.FuncOp("main", ([v.type for v in op.operands], []),
                                 Region(block))])


def _mutations(module: ModuleOp) -> list[tuple[str, str, ModuleOp]]:
    """One instance of every op kind of `module`, alone in a module: unchanged, then with
    structural breakages."""
    out: list[tuple[str, str, ModuleOp]] = []
    seen: set[str] = set()
    for op in module.walk():
        if not op.name.startswith(("top.", "tpu.")) or op.name in seen:
            continue
        seen.add(op.name)
        opdef = type(op).get_irdl_definition()
        kinds = [type(d).__name__ for _, d in opdef.operands]
        n_single = kinds.count("OperandDef")
        n_max = None if "VarOperandDef" in kinds else len(kinds)
        base = _isolated(op)

        def mutate(fn, base: ModuleOp = base) -> ModuleOp:  # noqa: ANN001
            m = base.clone()
            fn(m.body.block.first_op.body.block.first_op)  # type: ignore[union-attr]
            return m

        out.append((op.name, "unchanged", base))
        for name, d in opdef.attributes.items():
            if type(d).__name__ == "AttributeDef" and name in op.attributes:
                out.append((op.name, f"drop '{name}'",
                            mutate(lambda o, n=name: o.attributes.pop(n))))
                bad = IntegerAttr(1, i64) if isinstance(op.attributes[name], StringAttr) \
                    else StringAttr("x")
                out.append((op.name, f"'{name}' of the wrong kind",
                            mutate(lambda o, n=name, b=bad: o.attributes.__setitem__(n, b))))
        if n_max is not None and op.operands:
            extra = n_max - len(op.operands) + 1
            out.append((op.name, "too many operands", mutate(
                lambda o, k=extra: setattr(o, "operands", [*o.operands] + [o.operands[0]] * k))))
        if n_single and len(op.operands) == n_single:
            out.append((op.name, "an operand missing",
                        mutate(lambda o: setattr(o, "operands", list(o.operands)[1:]))))
        if op.results:
            out.append((op.name, "a result of a non-tensor type",
                        mutate(lambda o: setattr(o.results[0], "_type", f32))))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_xdsl_and_mlir_agree_on_broken_ops(tiny_models, family: str) -> None:
    """For every op kind in every pipeline stage: drop or mistype a required attribute,
    add or remove operands, give a result a non-tensor type -- xDSL and MLIR agree."""
    checked = 0
    for stage, module in pipeline_stages(tiny_models, family):
        if stage not in ("import", "top:canonicalize", "w4bf16:canonicalize",
                         "bf16:canonicalize"):
            continue
        for op_name, what, m in _mutations(module):
            _agree(m, op_name, f"{stage} {op_name} {what}")
            checked += 1
    assert checked > 40


def test_cast_dtype_is_an_element_type_on_both_sides() -> None:
    t = TensorType(f32, [2])
    for dtype, ok in ((f32, True), (IntegerAttr(3, i64), False), (FloatAttr(1.0, f32), False)):
        block = Block(arg_types=[t])
        op = top.CastOp.create(operands=[block.args[0]], result_types=[t],
                               attributes={"dtype": dtype})
        block.add_op(op)
        block.add_op(func.ReturnOp())
        m = ModuleOp([func.FuncOp("main", ([t], []), Region(block))])
        assert _xdsl_accepts(m) == ok
        _agree(m, "top.cast", f"cast dtype {dtype}")


@pytest.mark.parametrize("dialect", ["top", "tpu"])
def test_enum_values_are_checked_on_both_sides(dialect: str) -> None:
    """A required enum attribute (compare predicate, reduce mode, rope mode): its values
    verify in xDSL and in MLIR (irdl.any_of of irdl.is "<value>"); an unknown value is
    rejected by both, MLIR naming the op."""
    d = top if dialect == "top" else tpu
    x, c = TensorType(f32, [1, 2, 2, 8]), TensorType(f32, [1, 2, 1, 8])
    m = TensorType(f32, [1, 2, 2, 1])
    cases = [(d.CompareOp, [x, x], TensorType(i1, [1, 2, 2, 8]), "predicate", ComparePredicate,
              {}),
             (d.ReduceOp, [x], m, "mode", ReduceMode,
              {"axes": DenseArrayBase.from_list(i64, [3]), "keepdims": IntegerAttr(1, i1)}),
             (d.RopeOp, [x, c, c], x, "mode", RopeMode, {})]
    for cls, arg_types, result, attr, enum, others in cases:
        for value in [*(m.value for m in enum), "bogus"]:
            block = Block(arg_types=arg_types)
            op = cls.create(operands=list(block.args), result_types=[result],
                            attributes={attr: StringAttr(value), **others})
            block.add_op(op)
            block.add_op(func.ReturnOp())
            module = ModuleOp([func.FuncOp("main", (arg_types, []), Region(block))])
            assert _xdsl_accepts(module) == (value != "bogus"), (cls.name, value)
            _agree(module, cls.name, f"{cls.name} {attr} = {value!r}")


# --------------------------------------------------------------------------- known gaps


def test_a_variadic_group_of_different_types_verifies() -> None:
    """MLIR 22's IRDL binds one constraint variable per operand definition, so the export
    gives a variadic group one optional segment per value (`mlir_form` says which are used):
    a concat of differently shaped tensors verifies in MLIR as in xDSL, and no variadic gap
    is listed any more."""
    a, b = TensorType(f32, [1, 2]), TensorType(f32, [1, 3])
    block = Block(arg_types=[a, b])
    op = top.ConcatOp.build([[block.args[0], block.args[1]]], {"axis": IntegerAttr(1, i64)})
    block.add_op(op)
    block.add_op(func.ReturnOp(op.results[0]))
    m = ModuleOp([func.FuncOp("main", ([a, b], [op.results[0].type]), Region(block))])
    assert _xdsl_accepts(m)
    verify_with_irdl(m)
    assert not any("variadic" in g.detail for g in export_irdl().gaps)


def test_known_gap_optional_attributes_are_unchecked() -> None:
    """IRDL (MLIR 22) has no optional attributes: MLIR accepts `transpose_b = "yes"`."""
    x, w = TensorType(f32, [2, 4]), TensorType(f32, [3, 4])
    block = Block(arg_types=[x, w])
    op = top.MatMulOp.create(operands=[block.args[0], block.args[1]],
                             result_types=[TensorType(f32, [2, 3])],
                             attributes={"transpose_b": StringAttr("yes")})
    block.add_op(op)
    block.add_op(func.ReturnOp())
    m = ModuleOp([func.FuncOp("main", ([x, w], []), Region(block))])
    assert not _xdsl_accepts(m)
    verify_with_irdl(m)
    assert any(g.op == "top.matmul" and "transpose_b" in g.where for g in export_irdl().gaps)


def test_unranked_modules_use_the_unranked_export() -> None:
    t = TensorType(f32, [2])
    from xdsl.dialects.builtin import UnrankedTensorType

    u = UnrankedTensorType(f32)
    block = Block(arg_types=[t])
    op = top.SiluOp.create(operands=[block.args[0]], result_types=[u])
    block.add_op(op)
    block.add_op(func.ReturnOp())
    m = ModuleOp([func.FuncOp("main", ([t], []), Region(block))])
    assert _xdsl_accepts(m)
    verify_with_irdl(m)


def test_regions_attribute_is_checked_by_mlir_too() -> None:
    """`#tpu.regions` is IRDL-defined: MLIR parses it with its four integer parameters and
    refuses one with a parameter missing or of another kind."""
    fn = ('"func.func"() <{{function_type = () -> (), sym_name = "f"}}> ({{ "func.return"() '
          ': () -> () }}) {{tpu.regions = {}}} : () -> ()')
    verify_with_irdl(fn.format("#tpu.regions<4096 : i64, 192 : i64, 8192 : i64, 3072 : i64>"))
    for bad in ("#tpu.regions<1 : i64, 2 : i64, 3 : i64>",
                '#tpu.regions<"a", 0 : i64, 0 : i64, 0 : i64>'):
        with pytest.raises(MlirCheckError, match="rejected"):
            verify_with_irdl(fn.format(bad))


def test_a16_matmul_with_mins_is_checked_by_mlir_too() -> None:
    """The scale-and-min a16_matmul (float mins instead of zero points, GGUF's Q4_1 / Q4_K)
    verifies in MLIR through the IRDL export, and a mutation of it (an extra operand, the
    mins' segment dropped) is refused by both."""
    from xdsl.dialects.builtin import IntegerType, Signedness, f16

    ui8 = IntegerType(8, Signedness.UNSIGNED)
    types = [TensorType(f32, [1, 4, 64]), TensorType(ui8, [32, 32]), TensorType(f16, [32, 2]),
             TensorType(f16, [32, 2])]
    block = Block(arg_types=types)
    x, q, s, m = block.args
    op = tpu.A16MatMulOp(x, q, s, None, None, weight_bits=4, group_size=32, mins=m)
    block.add_op(op)
    block.add_op(func.ReturnOp())
    module = ModuleOp([func.FuncOp("main", (types, []), Region(block))])
    assert _xdsl_accepts(module)
    verify_with_irdl(module)
    for name, what, mutated in _mutations(module):
        _agree(mutated, name, f"a16_matmul with mins: {what}")
