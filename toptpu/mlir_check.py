"""Check what xDSL prints against real MLIR (the `mlir` python bindings, MLIR 22).

`roundtrip_through_mlir(module)` prints the module in generic form, parses and verifies it
with MLIR (unregistered dialects allowed: Top/Tpu are checked structurally here; the IRDL
check loads their definitions), prints MLIR's generic form and parses that back into
xDSL. It returns the module xDSL read back; `check_roundtrip` also asserts that it is
structurally identical to the original.
"""

from __future__ import annotations

import io

from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser
from xdsl.printer import Printer


class MlirCheckError(Exception):
    pass


def print_generic(module: ModuleOp, debuginfo: bool = True) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=True, print_debuginfo=debuginfo).print_op(module)
    return out.getvalue()


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
    from toptpu.dialects import context

    back = mlir_parse_and_verify(print_generic(module))
    return Parser(context(), back, "mlir-roundtrip").parse_module()


def check_roundtrip(module: ModuleOp) -> ModuleOp:
    back = roundtrip_through_mlir(module)
    if not back.is_structurally_equivalent(module):
        a, b = print_generic(module), print_generic(back)
        import difflib

        diff = "\n".join(list(difflib.unified_diff(a.splitlines(), b.splitlines(),
                                                   "xdsl", "mlir", lineterm=""))[:40])
        raise MlirCheckError(f"the module changed through MLIR:\n{diff}")
    return back
