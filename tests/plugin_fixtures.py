"""Plugins for the tests: the repository's example plugin really installed, and small
hand-made plugin packages.

- `example_plugin(tmp_path_factory)`: `examples/toptpu-plugin-example` installed with pip
  (`--no-deps --no-build-isolation --target DIR`, from a copy, so the source tree gets no
  build files) once per session into a directory shared by the xdist workers: a real
  install, its entry point in the `*.dist-info` setuptools made from the package's own
  pyproject.toml. Nothing of the venv changes; a test puts DIR on `sys.path` (`on_path`) or
  on a subprocess's PYTHONPATH (`path_env`).
- `write_plugin(dir, ...)`: a package and the `*.dist-info` an installer would write
  (METADATA, entry_points.txt), for the plugins a test needs to be broken in one way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from filelock import FileLock
from llm_fixtures import shared_dir

from toptpu.dialects import plugin_ops
from toptpu.plugins import ENTRY_POINT_GROUP, load_plugins

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = os.path.join(ROOT, "examples", "toptpu-plugin-example")


def example_plugin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The directory the example plugin is installed in (see the module doc)."""
    target = os.path.join(shared_dir(tmp_path_factory), "example-plugin")
    with FileLock(target + ".lock"):
        if not os.path.exists(os.path.join(target, "done")):
            shutil.rmtree(target, ignore_errors=True)
            source = target + "-src"
            shutil.rmtree(source, ignore_errors=True)
            shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns(
                "build", "*.egg-info", "__pycache__"))
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--no-build-isolation", "--no-index", "--target", target, source],
                           check=True, capture_output=True, text=True, timeout=600)
            open(os.path.join(target, "done"), "w").close()
    return target


def write_plugin(directory: str, package: str, source: str, entry: str = "plugin") -> str:
    """Write `package` (its `__init__.py` is `source`) and its dist-info declaring the
    entry point `package = package:entry` in the plugin group; `directory` is returned (put
    it on the path)."""
    os.makedirs(os.path.join(directory, package), exist_ok=True)
    with open(os.path.join(directory, package, "__init__.py"), "w") as f:
        f.write(source)
    info = os.path.join(directory, f"{package}-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[{ENTRY_POINT_GROUP}]\n{package} = {package}:{entry}\n")
    return directory


@contextlib.contextmanager
def on_path(*directories: str) -> Iterator[None]:
    """`directories` first on sys.path and the plugins (and their ops) loaded again; both
    undone after."""
    saved = list(sys.path)
    sys.path[:0] = list(directories)
    load_plugins.cache_clear()
    plugin_ops.clear()
    try:
        yield
    finally:
        sys.path[:] = saved
        roots = [os.path.abspath(d) + os.sep for d in directories]
        for name, module in list(sys.modules.items()):
            where = os.path.abspath(getattr(module, "__file__", None) or os.sep)
            if any(where.startswith(r) for r in roots):
                del sys.modules[name]
        load_plugins.cache_clear()
        plugin_ops.clear()  # the plugins' ops are gone with them


def path_env(*directories: str) -> dict[str, str]:
    """The environment of a subprocess with `directories` first on its PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*directories, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env
