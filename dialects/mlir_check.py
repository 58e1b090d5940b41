"""Check what xDSL prints against real MLIR (the `mlir` python bindings, MLIR 22).

`roundtrip_through_mlir(module)` prints the module in generic form, parses and verifies it
with MLIR (unregistered dialects allowed: Top/Tpu are checked structurally here), prints
MLIR's generic form and parses that back into xDSL. It returns the module xDSL read back;
`check_roundtrip` also asserts that it is structurally identical to the original.

`run_mlir_pipeline(module, "canonicalize,cse")` runs an MLIR pass pipeline on a module in
real MLIR (top/tpu loaded from IRDL) and parses the result back into xDSL (the
`mlir{pipeline="..."}` pass of toptpu-opt).

`verify_with_irdl(module)` is the strict check: the `top` and `tpu` dialects are loaded
into MLIR from IRDL generated from their xDSL definitions (`toptpu.dialects.irdl_export`), and the
module must parse and verify with unregistered dialects *not* allowed. An error names the
op MLIR rejected. `mlir_context()` gives such a context for other uses (running MLIR
passes on toptpu modules).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, UnrankedTensorType
from xdsl.universe import Universe

from toptpu.dialects import all_dialects, context
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.irdl_export import export_irdl
from toptpu.errors import ToptpuError


class MlirCheckError(ToptpuError):
    pass


def mlir_parse_and_verify(text: str, allow_unregistered: bool = True) -> str:
    """Parse and verify `text` with real MLIR; return MLIR's generic print of it."""
    import mlir.ir as ir

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = allow_unregistered
    try:
        with ctx:
            m = ir.Module.parse(text)
            if not m.operation.verify():
                raise MlirCheckError("MLIR verification failed")
            return m.operation.get_asm(print_generic_op_form=True, enable_debug_info=True,
                                    use_local_scope=True)
    except ir.MLIRError as e:
        raise MlirCheckError(f"MLIR rejected the module: {e}") from e


def roundtrip_through_mlir(module: ModuleOp) -> ModuleOp:
    back = mlir_parse_and_verify(print_generic(module))
    return parse_ir(back, "mlir-roundtrip", context(), verify=False)


def check_roundtrip(module: ModuleOp) -> ModuleOp:
    back = roundtrip_through_mlir(module)
    if not back.is_structurally_equivalent(module):
        a, b = print_generic(module), print_generic(back)

        diff = "\n".join(list(difflib.unified_diff(a.splitlines(), b.splitlines(),
                                                   "xdsl", "mlir", lineterm=""))[:40])
        raise MlirCheckError(f"the module changed through MLIR:\n{diff}")
    return back


# --------------------------------------------------------------------------- IRDL


_IRDL_TEXT: dict[bool, str] = {}


def irdl_text(unranked: bool = False) -> str:
    """The IRDL of the top and tpu dialects (cached per process)."""
    if unranked not in _IRDL_TEXT:
        _IRDL_TEXT[unranked] = export_irdl(unranked=unranked).text
    return _IRDL_TEXT[unranked]


def mlir_context(unranked: bool = False) -> Any:  # mlir.ir.Context
    """A fresh MLIR context with top and tpu loaded from their IRDL; unregistered dialects
    are not allowed. Use it as `with ctx: ...`."""
    import mlir.ir as ir
    from mlir.dialects import irdl

    ctx = ir.Context()
    ctx.allow_unregistered_dialects = False
    with ctx:
        try:
            irdl.load_dialects(ir.Module.parse(irdl_text(unranked)))
        except (ir.MLIRError, RuntimeError) as e:
            raise MlirCheckError(f"MLIR could not load the IRDL of top/tpu: {e}") from e
    return ctx


_CONTEXTS: dict[bool, Any] = {}


def _shared_context(unranked: bool) -> Any:
    """One IRDL-loaded context per process for verification (parsing does not change it)."""
    if unranked not in _CONTEXTS:
        _CONTEXTS[unranked] = mlir_context(unranked)
    return _CONTEXTS[unranked]


def has_unranked_tensors(module: ModuleOp) -> bool:
    for op in module.walk():
        for v in (*op.results, *op.operands):
            if isinstance(v.type, UnrankedTensorType):
                return True
        for region in op.regions:
            for block in region.blocks:
                if any(isinstance(a.type, UnrankedTensorType) for a in block.args):
                    return True
    return False


_OP_IN_NOTE = re.compile(r'see current operation:\s*(?:%\S+ = )?"([\w.]+)"')


def describe_mlir_error(e: Any) -> str:
    """One line per MLIR diagnostic: `'op' at loc: message`, op from the attached note."""
    lines = []
    for d in getattr(e, "error_diagnostics", []) or []:
        op = None
        for n in d.notes:
            m = _OP_IN_NOTE.search(str(n.message))
            if m:
                op = m.group(1)
        where = str(d.location)
        lines.append(f"'{op or '?'}' at {where}: {d.message}")
    return "\n".join(lines) or str(e)


def verify_with_irdl(module: ModuleOp | str) -> None:
    """Parse and verify `module` (or its generic text) in MLIR with top/tpu loaded from
    IRDL and no unregistered dialects. Raises MlirCheckError naming the rejected op."""
    import mlir.ir as ir

    if isinstance(module, str):
        text, unranked = module, "tensor<*x" in module
    else:
        text, unranked = print_generic(module), has_unranked_tensors(module)
    ctx = _shared_context(unranked)
    with ctx:
        try:
            m = ir.Module.parse(text)
        except ir.MLIRError as e:
            msg = describe_mlir_error(e)
            raise MlirCheckError(f"MLIR (top/tpu from IRDL) rejected the module:\n{msg}"
                                 f"{_known_gaps_hint(msg)}") from e
        if not m.operation.verify():
            raise MlirCheckError("MLIR (top/tpu from IRDL): verification failed")


def _known_gaps_hint(message: str) -> str:
    """Name the documented IRDL gaps of the ops an MLIR error mentions."""
    named = set(re.findall(r"'((?:top|tpu)\.\w+)'", message))
    hints = [f"  known IRDL gap: {g}" for g in export_irdl().gaps
             if g.op in named and "variadic" in g.detail]
    return ("\n" + "\n".join(hints)) if hints else ""


# --------------------------------------------------------------------------- MLIR passes


def xdsl_context_for_mlir() -> Any:  # xdsl.context.Context
    """An xDSL context that reads what MLIR prints: toptpu's dialects and every dialect
    xDSL knows (loaded lazily)."""
    ctx = Context()
    ours = {d.name for d in all_dialects()}
    for d in all_dialects():
        ctx.register_dialect(d.name, lambda d=d: d)
    for name, factory in Universe.get_multiverse().all_dialects.items():
        if name not in ours:
            ctx.register_dialect(name, factory)
    return ctx


def run_mlir_pipeline(module: ModuleOp, pipeline: str) -> ModuleOp:
    """Run `pipeline` (MLIR pass-pipeline syntax, e.g. "canonicalize,cse" or
    "builtin.module(func.func(cse))") on `module` in real MLIR with top/tpu loaded from
    IRDL, and return MLIR's result parsed back into xDSL."""
    import mlir.ir as ir
    from mlir.passmanager import PassManager

    if not pipeline.strip():
        raise MlirCheckError("mlir: empty pass pipeline; use mlir{pipeline=\"canonicalize\"}")
    spec = pipeline if pipeline.lstrip().startswith("builtin.module(") else \
        f"builtin.module({pipeline})"
    ctx = mlir_context(has_unranked_tensors(module))
    with ctx:
        try:
            pm = PassManager.parse(spec)
        except (ValueError, ir.MLIRError) as e:
            raise MlirCheckError(f"MLIR does not understand the pipeline '{pipeline}': "
                                 f"{e}") from e
        try:
            m = ir.Module.parse(print_generic(module))
        except ir.MLIRError as e:
            raise MlirCheckError(f"MLIR (top/tpu from IRDL) rejected the module:\n"
                                 f"{describe_mlir_error(e)}") from e
        try:
            pm.run(m.operation)
        except ir.MLIRError as e:
            raise MlirCheckError(f"MLIR pipeline '{pipeline}' failed:\n"
                                 f"{describe_mlir_error(e)}") from e
        text = m.operation.get_asm(print_generic_op_form=True, enable_debug_info=True,
                                   use_local_scope=True)
    try:
        return parse_ir(text, "mlir-pipeline", xdsl_context_for_mlir(), verify=False)
    except Exception as e:  # noqa: BLE001 - xDSL's parse errors have several types
        raise MlirCheckError(f"xDSL cannot read back what MLIR's '{pipeline}' produced "
                             f"(an op or attribute xDSL does not define?): {e}") from e
