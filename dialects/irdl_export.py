"""Export the Top and Tpu dialects as IRDL, generated from their xDSL definitions.

`export_irdl()` walks `get_irdl_definition()` of every op of the given dialects (default:
`top` and `tpu`) and builds an xDSL module of `irdl.dialect` / `irdl.operation` ops:

- operands and results with their names and variadicity (single / optional / variadic);
- their constraints: `AnyTensor` -> `irdl.base "!builtin.tensor"`, exact types ->
  `irdl.is`, unions of exact types -> `irdl.any_of`, xDSL constraint variables -> one
  shared IRDL constraint value (IRDL's own notion of a variable);
- required attributes with their kinds: IntegerAttr -> `irdl.base "#builtin.integer"`,
  FloatAttr, StringAttr, DenseArrayBase, DenseIntOrFPElementsAttr, element-type sets
  (`irdl.any_of(irdl.is f32, ...)`), enums of string values (`EnumAttr(RopeMode)` ->
  `irdl.any_of(irdl.is "half", irdl.is "interleaved")`) and `operandSegmentSizes`;
- variadic groups as `VARIADIC_LIMIT` optional segments, one value each (`mlir_form` gives
  a module's ops the `operandSegmentSizes` / `resultSegmentSizes` that say which are used):
  MLIR 22's IRDL binds one constraint variable per operand definition, so one variadic
  definition would make MLIR require every value of the group to have the same type (a
  `tpu.group`'s inputs: an activation and weights; a concat of differently shaped tensors),
  which xDSL does not;
- single regions (`irdl.region`, `with size 1` for single-block regions);
- the dialect's attributes (`tpu.regions`) as `irdl.attribute` with named parameters.

The printed module (custom IRDL syntax, which MLIR 22 parses) is what
`toptpu.dialects.mlir_check.verify_with_irdl` loads with `mlir.dialects.irdl.load_dialects`,
and what `mlir-opt --irdl-file=` loads; MLIR reads a module in `mlir_form` (the generic form
with the segment sizes of the variadic groups: `toptpu-opt FILE -t mlir-generic`).

What IRDL in MLIR 22 cannot say is recorded as an `IrdlGap` (printed as comments by
`python -m toptpu.dialects.irdl_export`), never silently dropped:

- optional attributes (`irdl.attributes` has no optionality; upstream PR #110981 is open):
  MLIR checks neither their presence nor their kind;
- a variadic group is at most `VARIADIC_LIMIT` values (`mlir_form` refuses more);
- `irdl.any_of` over `irdl.base` constraints aborts MLIR 22's loader (IRDLLoading.cpp
  `getBases` reaches `llvm_unreachable`; fixed upstream later), so "ranked or unranked
  tensor" cannot be written: the export says `!builtin.tensor` (every module the pipeline
  emits is ranked) or, with `unranked=True`, `irdl.any` (IR before `shape-infer`);
- builtin types cannot be taken apart (`irdl.parametric` needs an IRDL-defined base), so
  an element-type constraint on a builtin tensor stays a base constraint;
- "any type" as an attribute value has no IRDL constraint (`irdl.any` accepts any
  attribute); Top uses explicit element-type sets for that reason;
- traits with a verifier (HasParent, IsTerminator, IsolatedFromAbove, ...) are not
  checked by MLIR (IRDL has no traits); and since no IRDL op is a terminator, MLIR's block
  verifier refuses the body of every `tpu.group` ("block with no terminator, has
  "tpu.yield""): grouped Tpu IR (after layer-group) does not verify in MLIR 22.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from xdsl.builder import Builder, InsertPoint
from xdsl.dialects import irdl
from xdsl.dialects.builtin import (
    AffineMapAttr,
    ArrayAttr,
    BFloat16Type,
    ComplexType,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    DictionaryAttr,
    Float16Type,
    Float32Type,
    Float64Type,
    FloatAttr,
    FunctionType,
    IndexType,
    IntegerAttr,
    IntegerType,
    MemRefType,
    ModuleOp,
    NoneType,
    StringAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
    UnrankedTensorType,
    VectorType,
    i32,
)
from xdsl.ir import (
    Attribute,
    Block,
    Dialect,
    Operation,
    OpTrait,
    ParametrizedAttribute,
    Region,
    SSAValue,
)
from xdsl.irdl import (
    AllOf,
    AnyAttr,
    AnyOf,
    AttrConstraint,
    AttrSetConstraint,
    BaseAttr,
    EqAttrConstraint,
    IRDLOperation,
    MessageConstraint,
    OptionalDef,
    ParamAttrConstraint,
    RangeConstraint,
    RangeLengthConstraint,
    RangeOf,
    VarConstraint,
    VariadicDef,
)
from xdsl.irdl.operations import (
    OptAttributeDef,
    OptRegionDef,
    OptSingleBlockRegionDef,
    SingleBlockRegionDef,
    VarRegionDef,
    VarSingleBlockRegionDef,
)

from toptpu.dialects.common import EnumAttr
from toptpu.dialects.plugin_ops import extended
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu
from toptpu.errors import ToptpuError

#: xDSL attribute/type class -> MLIR's name of that builtin base (checked against MLIR by
#: tests/test_irdl.py: each name is verified with a sample value)
BUILTIN_BASES: dict[type[Attribute], str] = {
    TensorType: "!builtin.tensor",
    UnrankedTensorType: "!builtin.unranked_tensor",
    VectorType: "!builtin.vector",
    MemRefType: "!builtin.memref",
    IntegerType: "!builtin.integer",
    IndexType: "!builtin.index",
    Float16Type: "!builtin.f16",
    BFloat16Type: "!builtin.bf16",
    Float32Type: "!builtin.f32",
    Float64Type: "!builtin.f64",
    ComplexType: "!builtin.complex",
    FunctionType: "!builtin.function",
    NoneType: "!builtin.none",
    IntegerAttr: "#builtin.integer",
    FloatAttr: "#builtin.float",
    StringAttr: "#builtin.string",
    DenseArrayBase: "#builtin.dense_array",
    DenseIntOrFPElementsAttr: "#builtin.dense_int_or_fp_elements",
    ArrayAttr: "#builtin.array",
    DictionaryAttr: "#builtin.dictionary",
    UnitAttr: "#builtin.unit",
    SymbolRefAttr: "#builtin.symbol_ref",
    AffineMapAttr: "#builtin.affine_map",
}


#: the values of a variadic group MLIR can check (each one an optional segment of its own)
VARIADIC_LIMIT = 128


@dataclass(frozen=True)
class IrdlGap:
    """Something an xDSL definition says that the exported IRDL cannot (MLIR is looser or
    stricter there)."""

    op: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.op} {self.where}: {self.detail}"


@dataclass
class IrdlExport:
    module: ModuleOp
    gaps: list[IrdlGap] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The IRDL module in the custom syntax MLIR parses."""
        return str(self.module)

    def grouped_gaps(self) -> list[str]:
        """One line per (where, what), listing the ops it concerns."""
        groups: dict[tuple[str, str], list[str]] = {}
        for g in self.gaps:
            groups.setdefault((g.where, g.detail), []).append(g.op)
        return [f"{where} of {', '.join(ops)}: {detail}"
                for (where, detail), ops in groups.items()]

    def annotated(self) -> str:
        """The IRDL text preceded by comments listing the gaps."""
        lines = [f"// {line}" for line in self.grouped_gaps()]
        head = "// IRDL of toptpu's dialects, generated from the xDSL definitions.\n"
        if lines:
            head += "// Not expressible in IRDL (MLIR 22), see dialects/irdl_export.py:\n"
        return head + "\n".join(lines) + ("\n" if lines else "") + self.text + "\n"


class _OpExporter:
    """Builds the body of one `irdl.operation`."""

    def __init__(self, op_name: str, unranked: bool, gaps: list[IrdlGap]) -> None:
        self.op_name = op_name
        self.unranked = unranked
        self.gaps = gaps
        self.block = Block()
        self.builder = Builder(InsertPoint.at_end(self.block))
        self.variables: dict[str, SSAValue] = {}

    def gap(self, where: str, detail: str) -> None:
        self.gaps.append(IrdlGap(self.op_name, where, detail))

    # ------------------------------------------------------------------ constraints
    def constraint(self, c: AttrConstraint, where: str) -> SSAValue:
        """A fresh IRDL constraint value for `c` (fresh: IRDL unifies uses of one value)."""
        if isinstance(c, VarConstraint):
            if c.name not in self.variables:
                self.variables[c.name] = self.constraint(c.constraint, where)
            return self.variables[c.name]
        if isinstance(c, MessageConstraint):
            return self.constraint(c.constr, where)
        if isinstance(c, AnyAttr):
            return self._any()
        if isinstance(c, EqAttrConstraint):
            return self.builder.insert(irdl.IsOp(c.attr)).output
        if isinstance(c, AttrSetConstraint):
            return self._one_of(sorted(c.values, key=str))
        if isinstance(c, EnumAttr):
            return self._one_of([StringAttr(v) for v in c.values()])
        if isinstance(c, BaseAttr):
            return self._base(c.attr, where)
        if isinstance(c, ParamAttrConstraint):
            self.gap(where, f"parameters of {c.base_attr.__name__} are not checked (IRDL "
                     "cannot take builtin types apart)")
            return self._base(c.base_attr, where)
        if isinstance(c, AllOf):
            args = [self.constraint(a, where) for a in c.attr_constrs]
            return self.builder.insert(irdl.AllOfOp(args)).output
        if isinstance(c, AnyOf):
            return self._any_of(c, where)
        self.gap(where, f"constraint {type(c).__name__} is not translated (irdl.any)")
        return self._any()

    def _any(self) -> SSAValue:
        return self.builder.insert(irdl.AnyOp()).output

    def _one_of(self, values: Sequence[Attribute]) -> SSAValue:
        """`irdl.any_of(irdl.is v, ...)` (`irdl.is v` for one value)."""
        args = [self.builder.insert(irdl.IsOp(v)).output for v in values]
        if len(args) == 1:
            return args[0]
        return self.builder.insert(irdl.AnyOfOp(args)).output

    def _base(self, base: type[Attribute], where: str) -> SSAValue:
        name = BUILTIN_BASES.get(base)
        if name is None:
            self.gap(where, f"{base.__name__} has no builtin IRDL base name (irdl.any)")
            return self._any()
        return self.builder.insert(irdl.BaseOp(name)).output

    def _any_of(self, c: AnyOf, where: str) -> SSAValue:
        members = list(c.attr_constrs)
        if all(isinstance(m, EqAttrConstraint) for m in members):
            args = [self.constraint(m, where) for m in members]
            return self.builder.insert(irdl.AnyOfOp(args)).output
        bases = {m.attr for m in members if isinstance(m, BaseAttr)}
        if len(bases) == len(members) and bases == {TensorType, UnrankedTensorType}:
            if self.unranked:
                return self._any()
            return self._base(TensorType, where)
        # irdl.any_of over irdl.base aborts MLIR 22's loader: never emit it
        self.gap(where, "a union of base constraints is not expressible in MLIR 22 "
                 "(irdl.any)")
        return self._any()

    def range_constraint(self, c: RangeConstraint, where: str) -> SSAValue:
        if isinstance(c, RangeLengthConstraint):
            return self.range_constraint(c.constraint, where)
        if isinstance(c, RangeOf):
            return self.constraint(c.constr, where)
        self.gap(where, f"range constraint {type(c).__name__} is not translated (irdl.any)")
        return self._any()

    # ------------------------------------------------------------------ op parts
    @staticmethod
    def _variadicity(d: object) -> irdl.VariadicityAttr:
        if isinstance(d, OptionalDef):
            return irdl.VariadicityAttr(irdl.VariadicityEnum.OPTIONAL)
        if isinstance(d, VariadicDef):
            return irdl.VariadicityAttr(irdl.VariadicityEnum.VARIADIC)
        return irdl.VariadicityAttr(irdl.VariadicityEnum.SINGLE)

    def values(self, kind: str, defs: Sequence[tuple[str, object]]) -> None:
        if not defs:
            return
        args, var, names = [], [], []
        for name, d in defs:
            where = f"{kind[:-1]} '{name}'"
            v = self._variadicity(d)
            if v.data != irdl.VariadicityEnum.VARIADIC:
                # the ignore below: every def's constr
                args.append(self.range_constraint(d.constr, where))  # type: ignore[attr-defined]
                var.append(v)
                names.append(StringAttr(name))
                continue
            # one optional segment per value, each with a constraint value of its own
            optional = irdl.VariadicityAttr(irdl.VariadicityEnum.OPTIONAL)
            for i in range(VARIADIC_LIMIT):
                # the ignore below: every def's constr
                args.append(self.range_constraint(d.constr, where))  # type: ignore[attr-defined]
                var.append(optional)
                names.append(StringAttr(f"{name}_{i}"))
        op = irdl.OperandsOp if kind == "operands" else irdl.ResultsOp
        self.builder.insert(op(args, irdl.VariadicityArrayAttr(ArrayAttr(var)),
                               ArrayAttr(names)))

    def attributes(self, defs: dict[str, object]) -> None:
        required: dict[str, SSAValue] = {}
        for name, d in defs.items():
            if isinstance(d, OptAttributeDef):
                self.gap(f"attribute '{name}'", "optional: MLIR checks neither presence "
                         "nor kind (IRDL has no optional attributes)")
                continue
            # the ignore below: every def's constr
            required[name] = self.constraint(d.constr, f"attribute '{name}'")  # type: ignore[attr-defined]
        if required:
            self.builder.insert(irdl.AttributesOp.get(required))

    def regions(self, defs: Sequence[tuple[str, object]]) -> None:
        if not defs:
            return
        vals, names = [], []
        for name, d in defs:
            if isinstance(d, VarRegionDef | OptRegionDef | VarSingleBlockRegionDef
                          | OptSingleBlockRegionDef):
                self.gap(f"region '{name}'", "variadic/optional regions are exported as one "
                         "region")
            props: dict[str, Attribute] = {}
            if isinstance(d, SingleBlockRegionDef | VarSingleBlockRegionDef
                          | OptSingleBlockRegionDef):
                props["number_of_blocks"] = IntegerAttr(1, i32)
            vals.append(self.builder.insert(irdl.RegionOp.create(
                properties=props, result_types=[irdl.RegionType()])).output)
            names.append(StringAttr(name))
        self.builder.insert(irdl.RegionsOp(vals, ArrayAttr(names)))


def op_to_irdl(op: type[IRDLOperation], unranked: bool = False,
               gaps: list[IrdlGap] | None = None) -> irdl.OperationOp:
    """The `irdl.operation` of one xDSL op definition."""
    opdef = op.get_irdl_definition()
    gaps = gaps if gaps is not None else []
    short = Dialect.split_name(opdef.name)[1]
    if short != short.lower():
        raise ValueError(f"IRDL-loaded MLIR dialects need lower-case op names: {opdef.name}")
    ex = _OpExporter(opdef.name, unranked, gaps)
    ex.values("operands", opdef.operands)
    ex.values("results", opdef.results)
    ex.attributes(dict(opdef.attributes))
    ex.regions(opdef.regions)
    checked = [type(t).__name__ for t in opdef.traits
               if type(t).verify is not OpTrait.verify]
    if checked:
        ex.gap("traits", f"{', '.join(sorted(checked))} not checked (IRDL has no traits)")
    for name in opdef.properties:
        ex.gap(f"property '{name}'", "IRDL-loaded ops take attributes, not properties")
    if opdef.successors:
        ex.gap("successors", "not exported")
    return irdl.OperationOp(short, Region([ex.block]))


def attr_to_irdl(attr: type[ParametrizedAttribute],
                 gaps: list[IrdlGap] | None = None) -> irdl.AttributeOp:
    """The `irdl.attribute` of one xDSL attribute definition: its parameters by name, each
    with a constraint value of its own (a shared value would make MLIR require them equal)."""
    adef = attr.get_irdl_definition()
    ex = _OpExporter(adef.name, False, gaps if gaps is not None else [])
    args = [ex.constraint(p.constr, f"parameter '{name}'") for name, p in adef.parameters]
    ex.builder.insert(irdl.ParametersOp(args, ArrayAttr(StringAttr(n)
                                                        for n, _ in adef.parameters)))
    return irdl.AttributeOp(Dialect.split_name(adef.name)[1], Region([ex.block]))


def dialect_to_irdl(dialect: Dialect, unranked: bool = False,
                    gaps: list[IrdlGap] | None = None) -> irdl.DialectOp:
    ops: list[Operation] = []
    for attr in dialect.attributes:
        if not issubclass(attr, ParametrizedAttribute):
            raise ValueError(f"{attr} is not a parametrized attribute")
        ops.append(attr_to_irdl(attr, gaps))
    for op in dialect.operations:
        if not issubclass(op, IRDLOperation):
            raise ValueError(f"{op} is not an IRDL operation")
        ops.append(op_to_irdl(op, unranked, gaps))
    return irdl.DialectOp(dialect.name, Region([Block(ops)]))


#: the attributes MLIR reads the segment sizes of an op's operands / results from
SEGMENT_ATTRS = {"operands": "operandSegmentSizes", "results": "resultSegmentSizes"}


class MlirFormError(ToptpuError, ValueError):
    """A module `mlir_form` cannot write for MLIR (a variadic group over the limit)."""


def _is_variadic(d: object) -> bool:
    """A variadic definition (xDSL's optional definitions are variadic ones too)."""
    return isinstance(d, VariadicDef) and not isinstance(d, OptionalDef)


def _exported_segments(op: IRDLOperation, kind: str) -> list[int] | None:
    """The segment sizes of `op`'s operands or results as the IRDL export declares them (a
    variadic group: `VARIADIC_LIMIT` optional segments, one per value, the rest empty); None
    when the op has no variadic group there (MLIR computes the sizes)."""
    opdef = op.get_irdl_definition()
    defs = opdef.operands if kind == "operands" else opdef.results
    if not any(_is_variadic(d) for _, d in defs):
        return None
    attr = SEGMENT_ATTRS[kind]
    own = op.properties.get(attr) or op.attributes.get(attr)
    if own is not None:  # the op's own segment sizes (more than one group that is not single)
        assert isinstance(own, DenseArrayBase)
        per_def = [int(v) for v in own.get_values()]
    else:  # one variadic group: the values the single definitions do not take
        count = len(op.operands if kind == "operands" else op.results)
        per_def = [count - len(defs) + 1 if _is_variadic(d) else 1 for _, d in defs]
    sizes: list[int] = []
    for (name, d), n in zip(defs, per_def, strict=True):
        if _is_variadic(d):
            if n > VARIADIC_LIMIT:
                raise MlirFormError(f"'{op.name}' has {n} {kind} in '{name}'; the IRDL export "
                                    f"checks at most {VARIADIC_LIMIT} values of a variadic group")
            sizes += [1] * n + [0] * (VARIADIC_LIMIT - n)
        else:
            sizes.append(n)
    return sizes


def _exported(op: Operation, dialects: Sequence[Dialect]) -> bool:
    return isinstance(op, IRDLOperation) and any(type(op) in d.operations for d in dialects)


def mlir_form(module: ModuleOp, dialects: Sequence[Dialect] | None = None) -> ModuleOp:
    """A copy of `module` as MLIR checks it with the exported IRDL: every op with a variadic
    group carries `operandSegmentSizes` / `resultSegmentSizes` for the export's one-value
    segments (the rest of the module is the same)."""
    dialects = dialects or default_dialects()
    out = module.clone()
    for op in out.walk():
        if not _exported(op, dialects):
            continue
        opdef = op.get_irdl_definition()  # type: ignore[attr-defined]  # an IRDL op
        for kind, attr in SEGMENT_ATTRS.items():
            sizes = _exported_segments(op, kind)  # type: ignore[arg-type]  # an IRDL op
            if sizes is not None:  # where the op keeps its own sizes, if it does
                container = op.properties if attr in opdef.properties else op.attributes
                container[attr] = DenseArrayBase.from_list(i32, sizes)
    return out


def from_mlir_form(module: ModuleOp, dialects: Sequence[Dialect] | None = None) -> None:
    """Undo `mlir_form` in place (a module read back from MLIR): the segment sizes it added
    go; an op whose own definition keeps segment sizes gets them back from its values."""
    dialects = dialects or default_dialects()
    for op in module.walk():
        if not _exported(op, dialects):
            continue
        opdef = op.get_irdl_definition()  # type: ignore[attr-defined]  # an IRDL op
        for kind, attr in SEGMENT_ATTRS.items():
            defs = opdef.operands if kind == "operands" else opdef.results
            if not any(_is_variadic(d) for _, d in defs):
                continue
            container = op.properties if attr in opdef.properties else op.attributes
            sizes = container.pop(attr, None)
            if attr not in opdef.attributes and attr not in opdef.properties:
                continue
            # the op's own segment sizes: the exported one-value segments summed per group
            assert isinstance(sizes, DenseArrayBase)
            flat, compact = list(sizes.get_values()), []
            for _, d in defs:
                width = VARIADIC_LIMIT if _is_variadic(d) else 1
                compact.append(sum(flat[:width]))
                flat = flat[width:]
            container[attr] = DenseArrayBase.from_list(i32, compact)


def default_dialects() -> list[Dialect]:
    """Top and Tpu, with the ops plugins registered in this process (`plugin_ops`)."""
    return [extended(Top), extended(Tpu)]


def export_irdl(dialects: Sequence[Dialect] | None = None, unranked: bool = False
                ) -> IrdlExport:
    """IRDL of `dialects` (default: top and tpu). `unranked=True` lets tensor operands and
    results be unranked too (then MLIR no longer checks that they are tensors)."""
    gaps: list[IrdlGap] = []
    ds = [dialect_to_irdl(d, unranked, gaps) for d in (dialects or default_dialects())]
    return IrdlExport(ModuleOp(ds), gaps)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toptpu.dialects.irdl_export",
        description="print the IRDL of the top and tpu dialects (load it with "
                    "mlir-opt --irdl-file=...)")
    ap.add_argument("--unranked", action="store_true",
                    help="accept unranked tensors (IR before shape-infer)")
    args = ap.parse_args(argv)
    sys.stdout.write(export_irdl(unranked=args.unranked).annotated())
    return 0


if __name__ == "__main__":
    sys.exit(main())
