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
