"""Export the Top, Tpu and Dev dialects as MLIR ODS (TableGen), generated from their xDSL
definitions, for a native MLIR dialect plugin (`toptpu.dialects.mlir_plugin` builds it:
`mlir-tblgen`, then a C++ compiler against MLIR's headers and libMLIR).

What IRDL in MLIR 22 cannot say, ODS can, so the plugin checks more than the IRDL export
(`toptpu.dialects.irdl_export`), on the IR exactly as toptpu prints it (its generic form: no
`mlir_form` rewriting of variadic groups):

- the traits with a verifier: `IsTerminator` -> `Terminator` (a `tpu.group`'s body ends with
  `tpu.yield`), `HasParent` -> `HasParent<...>`, `IsolatedFromAbove`; `Pure` -> `Pure`;
- operands and results with their variadicity: single, `Optional<...>`, `Variadic<...>`
  (each value of a group its own type), `AttrSizedOperandSegments` /
  `AttrSizedResultSegments` where an op has two groups that are not single ones (MLIR then
  checks the op's segment sizes against its operands);
- "a ranked or unranked tensor" (`AnyTensor`), which IRDL 22 cannot write;
- required and optional attributes (`OptionalAttr`) with their kinds: `IntegerAttr`,
  `FloatAttr`, `StringAttr`, `DenseArrayAttr`, `DenseIntOrFPElementsAttr`, a type
  (`TypeAttr`), ...; sets of values (element types, enums of strings, flags) are checked
  by parsing each allowed value's text in the op's context and comparing
  (`toptpu_mlir::attrIn`, in the plugin's C++);
- the dialect's attributes (`#tpu.regions<...>`) with their parameters.

What it does not carry is recorded as an `OdsGap` (printed as comments by `python -m
toptpu.dialects.ods_export`): each op's own Python verifier (shapes, ranks, attribute
values: `verify_`) and an attribute's own `verify`, which have no ODS form; attributes an
op declares under a dialect prefix (`tpu.const_offset`: discardable in MLIR); the segment
sizes of an op with one variadic group (MLIR derives them, the IR's attribute is then
discardable).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from xdsl.dialects.builtin import (
    AffineMapAttr,
    ArrayAttr,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    DictionaryAttr,
    FloatAttr,
    IntegerAttr,
    StringAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
    UnrankedTensorType,
)
from xdsl.ir import Attribute, Dialect, OpTrait, ParametrizedAttribute, TypeAttribute
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
from xdsl.traits import HasParent, IsolatedFromAbove, IsTerminator, Pure

from toptpu.dialects.common import EnumAttr
from toptpu.dialects.dev import Dev
from toptpu.dialects.top import Top
from toptpu.dialects.tpu import Tpu

#: the C++ namespace of the generated dialects (`::toptpu_mlir::top::TopDialect`, ...)
NAMESPACE = "toptpu_mlir"

#: xDSL attribute class -> the MLIR C++ class an attribute of that kind is
MLIR_ATTR_CLASSES: dict[type[Attribute], str] = {
    IntegerAttr: "::mlir::IntegerAttr",
    FloatAttr: "::mlir::FloatAttr",
    StringAttr: "::mlir::StringAttr",
    DenseArrayBase: "::mlir::DenseArrayAttr",
    DenseIntOrFPElementsAttr: "::mlir::DenseIntOrFPElementsAttr",
    TypeAttribute: "::mlir::TypeAttr",
    ArrayAttr: "::mlir::ArrayAttr",
    DictionaryAttr: "::mlir::DictionaryAttr",
    UnitAttr: "::mlir::UnitAttr",
    SymbolRefAttr: "::mlir::SymbolRefAttr",
    AffineMapAttr: "::mlir::AffineMapAttr",
}

#: the segment-size attributes: ODS's AttrSized*Segments traits own them
SEGMENT_ATTRS = ("operandSegmentSizes", "resultSegmentSizes")


@dataclass(frozen=True)
class OdsGap:
    """Something an xDSL definition says that the ODS export does not."""

    op: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.op} {self.where}: {self.detail}"


@dataclass
class OdsExport:
    #: file name -> text: one `.td` per dialect (`TopOps.td`, ...)
    files: dict[str, str]
    #: the dialects exported: (name, C++ class prefix, has attributes)
    dialects: list[tuple[str, str, bool]]
    gaps: list[OdsGap] = field(default_factory=list)

    def grouped_gaps(self) -> list[str]:
        """One line per (where, what), listing the ops it concerns."""
        groups: dict[tuple[str, str], list[str]] = {}
        for g in self.gaps:
            groups.setdefault((g.where, g.detail), []).append(g.op)
        return [f"{where} of {', '.join(ops)}: {detail}"
                for (where, detail), ops in groups.items()]


def camel(name: str) -> str:
    """`add_const` -> `AddConst`; `a16_matmul` -> `A16Matmul` (a C++ class name)."""
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"[_.]", name) if p)


def cxx_string(text: str) -> str:
    """`text` as a C++ string literal."""
    out = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{out}"'


class _Constraints:
    """Translates xDSL constraints into ODS constraints of one op (recording gaps)."""

    def __init__(self, op: str, gaps: list[OdsGap]) -> None:
        self.op, self.gaps = op, gaps

    def gap(self, where: str, detail: str) -> None:
        self.gaps.append(OdsGap(self.op, where, detail))

    # -- types of operands and results ------------------------------------------------------
    def value_type(self, c: RangeConstraint, where: str) -> str:
        if isinstance(c, RangeLengthConstraint):
            return self.value_type(c.constraint, where)
        if isinstance(c, RangeOf):
            return self.type_of(c.constr, where)
        self.gap(where, f"range constraint {type(c).__name__} is not translated (AnyType)")
        return "AnyType"

    def type_of(self, c: AttrConstraint, where: str) -> str:
        if isinstance(c, VarConstraint | MessageConstraint):
            inner = c.constraint if isinstance(c, VarConstraint) else c.constr
            if isinstance(c, VarConstraint):
                self.gap(where, f"constraint variable {c.name}: each value is checked alone")
            return self.type_of(inner, where)
        if isinstance(c, AnyAttr):
            return "AnyType"
        if isinstance(c, BaseAttr) and c.attr is TensorType:
            return "AnyRankedTensor"
        if isinstance(c, BaseAttr) and c.attr is UnrankedTensorType:
            return "AnyUnrankedTensor"
        if isinstance(c, AnyOf) and {type(m) for m in c.attr_constrs} == {BaseAttr} and {
                m.attr for m in c.attr_constrs if isinstance(m, BaseAttr)} == {
                    TensorType, UnrankedTensorType}:
            return "AnyTensor"
        pred = self.predicate(c, where)
        return f'TT_Type<[{{ {pred} }}], "{_summary(c)}">'

    # -- attributes ---------------------------------------------------------------------------
    def attribute(self, c: AttrConstraint, where: str, optional: bool) -> str:
        pred = self.predicate(c, where)
        attr = "AnyAttr" if pred == "true" else f'TT_Attr<[{{ {pred} }}], "{_summary(c)}">'
        return f"OptionalAttr<{attr}>" if optional else attr

    def predicate(self, c: AttrConstraint, where: str) -> str:
        """A C++ boolean expression of `$_self` (an `::mlir::Attribute`, or an `::mlir::Type`
        for a type constraint) that holds when `c` does."""
        if isinstance(c, VarConstraint):
            self.gap(where, f"constraint variable {c.name}: each value is checked alone")
            return self.predicate(c.constraint, where)
        if isinstance(c, MessageConstraint):
            return self.predicate(c.constr, where)
        if isinstance(c, AnyAttr):
            return "true"
        if isinstance(c, EqAttrConstraint):
            return _one_of([c.attr])
        if isinstance(c, AttrSetConstraint):
            return _one_of(sorted(c.values, key=str))
        if isinstance(c, EnumAttr):
            return _one_of([StringAttr(v) for v in c.values()])
        if isinstance(c, BaseAttr):
            return self._base(c.attr, where)
        if isinstance(c, ParamAttrConstraint):
            self.gap(where, f"parameters of {c.base_attr.__name__} are not checked")
            return self._base(c.base_attr, where)
        if isinstance(c, AllOf):
            return "(" + " && ".join(self.predicate(a, where) for a in c.attr_constrs) + ")"
        if isinstance(c, AnyOf):
            return "(" + " || ".join(self.predicate(a, where) for a in c.attr_constrs) + ")"
        self.gap(where, f"constraint {type(c).__name__} is not translated (any)")
        return "true"

    def _base(self, base: type[Attribute], where: str) -> str:
        if base is TensorType:
            return "::llvm::isa<::mlir::RankedTensorType>($_self)"
        if base is UnrankedTensorType:
            return "::llvm::isa<::mlir::UnrankedTensorType>($_self)"
        cls = next((v for k, v in MLIR_ATTR_CLASSES.items() if issubclass(base, k)), None)
        if cls is None:
            self.gap(where, f"{base.__name__} has no MLIR class here (any)")
            return "true"
        return f"::llvm::isa<{cls}>($_self)"


def _one_of(values: Sequence[Attribute]) -> str:
    """`$_self` is one of `values` (each parsed from its text by MLIR, so a value compares
    as MLIR reads the IR: `f32` a TypeAttr, `true` a BoolAttr, `"half"` a StringAttr)."""
    texts = ", ".join(cxx_string(str(v)) for v in values)
    return f"::{NAMESPACE}::attrIn($_self, {{{texts}}})"


def _summary(c: AttrConstraint) -> str:
    """What `c` accepts, in words (deterministic: a set's values sorted)."""
    if isinstance(c, AttrSetConstraint):
        text = "one of " + ", ".join(sorted(str(v) for v in c.values))
    elif isinstance(c, EnumAttr):
        text = "one of " + ", ".join(c.values())
    elif isinstance(c, BaseAttr):
        text = c.attr.__name__
    else:
        text = type(c).__name__
    text = text if len(text) <= 160 else text[:157] + "..."
    return text.replace("\\", "\\\\").replace('"', "'")


_DIALECT_HEAD = """\
// The {name} dialect of toptpu in ODS, generated from its xDSL definitions by
// toptpu.dialects.ods_export (do not edit).
include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def {P}_Dialect : Dialect {{
  let name = "{name}";
  let cppNamespace = "::{ns}::{name}";
{dialect_extra}}}

// an attribute kind or value set as a C++ predicate of the attribute ($_self)
class TT_Attr<code pred, string summary> : Attr<CPred<pred>, summary> {{
  let storageType = [{{ ::mlir::Attribute }}];
  let returnType = [{{ ::mlir::Attribute }}];
  let convertFromStorage = [{{ $_self }}];
}}
// a type as a C++ predicate of the type ($_self)
class TT_Type<code pred, string summary> : Type<CPred<pred>, summary>;

class {P}_Op<string mnemonic, list<Trait> traits = []> : Op<{P}_Dialect, mnemonic, traits>;
"""


def _trait(t: OpTrait, dialect_of: dict[type, str], where: _Constraints) -> str | None:
    if isinstance(t, IsTerminator):
        return "Terminator"
    if isinstance(t, IsolatedFromAbove):
        return "IsolatedFromAbove"
    if isinstance(t, Pure):
        return "Pure"
    if isinstance(t, HasParent):
        parents = ", ".join(f'"{dialect_of[p]}"' for p in t.op_types)
        return f"HasParent<{parents}>" if len(t.op_types) == 1 else f"ParentOneOf<[{parents}]>"
    if type(t).verify is not OpTrait.verify:
        where.gap("traits", f"{type(t).__name__} is not checked (no ODS counterpart here)")
    return None


def _is_single(d: object) -> bool:
    return not isinstance(d, VariadicDef)


def _value(d: object, constraint: str) -> str:
    if isinstance(d, OptionalDef):
        return f"Optional<{constraint}>"
    if isinstance(d, VariadicDef):
        return f"Variadic<{constraint}>"
    return constraint


def op_to_ods(op: type[IRDLOperation], prefix: str, dialect_of: dict[type, str],
              gaps: list[OdsGap]) -> str:
    """The ODS `def` of one xDSL op definition."""
    opdef = op.get_irdl_definition()
    _, short = Dialect.split_name(opdef.name)
    c = _Constraints(opdef.name, gaps)
    # sorted: xDSL keeps an op's traits in a set (the text must not change run to run)
    traits = sorted(t for t in (_trait(t, dialect_of, c) for t in opdef.traits) if t)
    if sum(not _is_single(d) for _, d in opdef.operands) > 1:
        traits.append("AttrSizedOperandSegments")
    if sum(not _is_single(d) for _, d in opdef.results) > 1:
        traits.append("AttrSizedResultSegments")
    args = [f"{_value(d, c.value_type(d.constr, f'operand {n!r}'))}:${n}"
            for n, d in opdef.operands]
    for name, d in opdef.attributes.items():
        if name in SEGMENT_ATTRS:
            if name == "operandSegmentSizes" and "AttrSizedOperandSegments" not in traits:
                c.gap(f"attribute {name!r}", "one variadic group: MLIR derives the segments "
                      "(the attribute is discardable)")
            continue
        if "." in name:
            c.gap(f"attribute {name!r}", "a dialect attribute: discardable in MLIR, not "
                  "checked")
            continue
        optional = isinstance(d, OptAttributeDef)
        args.append(f"{c.attribute(d.constr, f'attribute {name!r}', optional)}:${name}")
    for name in opdef.properties:
        c.gap(f"property {name!r}", "not exported")
    results = [f"{_value(d, c.value_type(d.constr, f'result {n!r}'))}:${n}"
               for n, d in opdef.results]
    regions = []
    for name, region in opdef.regions:
        if isinstance(region, VarRegionDef | OptRegionDef | VarSingleBlockRegionDef
                      | OptSingleBlockRegionDef):
            c.gap(f"region {name!r}", "variadic/optional regions are exported as one region")
        sized = isinstance(region, SingleBlockRegionDef | VarSingleBlockRegionDef
                           | OptSingleBlockRegionDef)
        regions.append(f"{'SizedRegion<1>' if sized else 'AnyRegion'}:${name}")
    if opdef.successors:
        c.gap("successors", "not exported")
    if getattr(op, "verify_", None) is not IRDLOperation.verify_:
        c.gap("verifier", "the op's own Python verifier (verify_) is not carried over")
    lines = [f'def {prefix}_{camel(short)}Op : {prefix}_Op<"{short}", [{", ".join(traits)}]> {{']
    if args:
        lines.append("  let arguments = (ins\n    " + ",\n    ".join(args) + ");")
    if results:
        lines.append("  let results = (outs\n    " + ",\n    ".join(results) + ");")
    if regions:
        lines.append("  let regions = (region " + ", ".join(regions) + ");")
    lines.append("}")
    return "\n".join(lines)


def attr_to_ods(attr: type[ParametrizedAttribute], prefix: str, gaps: list[OdsGap]) -> str:
    """The ODS `AttrDef` of one xDSL attribute definition: its parameters by name, each an
    attribute of the kind its constraint names, in xDSL's form `#d.name<p1, p2, ...>`."""
    adef = attr.get_irdl_definition()
    _, short = Dialect.split_name(adef.name)
    c = _Constraints(adef.name, gaps)
    params = []
    for name, p in adef.parameters:
        cls = "::mlir::Attribute"
        if isinstance(p.constr, BaseAttr):
            cls = next((v for k, v in MLIR_ATTR_CLASSES.items() if issubclass(p.constr.attr, k)),
                       cls)
        if cls == "::mlir::Attribute":
            c.gap(f"parameter {name!r}", "any attribute (its constraint is not translated)")
        params.append(f'"{cls}":${name}')
    if attr.verify is not ParametrizedAttribute.verify:
        c.gap("verifier", "the attribute's own Python verifier is not carried over")
    fmt = " `,` ".join(f"${n}" for n, _ in adef.parameters)
    return "\n".join([
        f'def {prefix}_{camel(short)}Attr : AttrDef<{prefix}_Dialect, "{camel(short)}"> {{',
        f'  let mnemonic = "{short}";',
        "  let parameters = (ins " + ", ".join(params) + ");",
        f"  let assemblyFormat = \"`<` {fmt} `>`\";",
        "}"])


def export_ods(dialects: Sequence[Dialect] = (Top, Tpu, Dev)) -> OdsExport:
    """One `.td` per dialect, and the gaps."""
    dialect_of = {op: f"::{NAMESPACE}::{d.name}::{camel(Dialect.split_name(op.name)[1])}Op"
                  for d in dialects for op in d.operations}
    gaps: list[OdsGap] = []
    files: dict[str, str] = {}
    exported: list[tuple[str, str, bool]] = []
    for d in dialects:
        prefix = camel(d.name)
        attrs = list(d.attributes)
        extra = "  let useDefaultAttributePrinterParser = 1;\n" if attrs else ""
        parts = [_DIALECT_HEAD.format(name=d.name, P=prefix, ns=NAMESPACE, dialect_extra=extra)]
        for a in attrs:
            if not issubclass(a, ParametrizedAttribute):
                raise ValueError(f"{a} is not a parametrized attribute")
            parts.append(attr_to_ods(a, prefix, gaps))
        names: set[str] = set()
        for op in d.operations:
            if not issubclass(op, IRDLOperation):
                raise ValueError(f"{op} is not an IRDL operation")
            cls = camel(Dialect.split_name(op.name)[1])
            if cls in names:
                raise ValueError(f"two ops of {d.name} make the C++ class {cls}Op")
            names.add(cls)
            parts.append(op_to_ods(op, prefix, dialect_of, gaps))
        files[f"{prefix}Ops.td"] = "\n\n".join(parts) + "\n"
        exported.append((d.name, prefix, bool(attrs)))
    return OdsExport(files, exported, gaps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toptpu.dialects.ods_export",
        description="Write the ODS (.td) of toptpu's dialects, generated from the xDSL "
                    "definitions, into a directory; list what ODS does not carry.")
    ap.add_argument("directory")
    args = ap.parse_args(argv)
    export = export_ods()
    os.makedirs(args.directory, exist_ok=True)
    for name, text in export.files.items():
        with open(os.path.join(args.directory, name), "w") as f:
            f.write(text)
    for line in export.grouped_gaps():
        print(f"not carried: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
