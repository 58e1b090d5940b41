# lit configuration of the example plugin's FileCheck tests, with the plugin installed beside
# toptpu: `lit examples/toptpu-plugin-example/tests` (tests/test_plugins.py installs and runs it)
import os
import sys

import lit.formats

config.name = "toptpu-plugin-example"  # noqa: F821
config.test_format = lit.formats.ShTest(execute_external=False)  # noqa: F821
config.suffixes = [".mlir"]  # noqa: F821
config.excludes = ["Inputs", "Output"]  # noqa: F821
config.test_source_root = os.path.dirname(__file__)  # noqa: F821
config.environment["PATH"] = (  # noqa: F821
    os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
if "PYTHONPATH" in os.environ:  # where the plugin is installed (a --target directory)
    config.environment["PYTHONPATH"] = os.environ["PYTHONPATH"]  # noqa: F821
