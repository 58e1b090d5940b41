"""toptpu: an MLIR-style LLM compiler on xDSL and a numpy reference tensor processor.

The public API, imported lazily on first use (PEP 562): this package runs before every
`import toptpu.<anything>`, so an import here would load the compiler (and torch) or the
runtime into every process that imports any part of toptpu, and make every module depend on
them. `toptpu.compile(model, output, mode=..., seq_length=...)` (see `toptpu.compiler`),
`toptpu.Runtime.open(model_file)` (see `toptpu.backend.runtime.runtime`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Runtime", "compile"]


def __getattr__(name: str) -> Any:
    if name == "compile":
        from toptpu.compiler import compile as compile_model

        return compile_model
    if name == "Runtime":
        from toptpu.backend.runtime.runtime import Runtime

        return Runtime
    raise AttributeError(f"module 'toptpu' has no attribute '{name}'")
