"""ARCHITECTURE.md's file map ("Where each thing lives") names every module of the package.

Each `.py` file under the package folders (pyproject.toml's `package-dir`) belongs to the
map's row whose folder is the longest prefix of its path (`backend/runtime/` for
`backend/runtime/conversation.py`, `toptpu/` for `toptpu/weight_calibration/gptq.py`), and
that row names it in backticks, as `conversation.py` or `conversation` (a module in a
subfolder of the row's folder: its subfolder too, as `weight_calibration/`). An
`__init__.py` that only re-exports (imports, `__all__`, a docstring) is its package and
needs no name; one that defines something is named as `__init__.py`.
"""

from __future__ import annotations

import ast
import os
import re
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_folders() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return sorted(set(dirs.values()))


def _modules() -> list[str]:
    """Every .py file of the package, relative to the repository."""
    out = []
    for folder in _package_folders():
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out += [os.path.relpath(os.path.join(root, f), REPO).replace(os.sep, "/")
                    for f in files if f.endswith(".py")]
    return sorted(out)


def _map_rows() -> dict[str, str]:
    """The file map's rows: folder (or file) -> the row's text."""
    with open(os.path.join(REPO, "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Where each thing lives", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|(.*)$", section, re.M)
    assert rows, "the file map moved: update this test"
    return {folder: row for folder, row in rows}


def _defines_something(path: str) -> bool:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "__all__"]:
            continue
        return True
    return False


def _named(row: str, name: str) -> bool:
    return re.search(r"`(?:[\w./]*/)?" + re.escape(name) + r"`", row) is not None


def _unnamed(modules: list[str], rows: dict[str, str]) -> list[str]:
    missing = []
    for path in modules:
        if path.endswith("/__init__.py") and not _defines_something(path):
            continue  # a package that only re-exports: its folder's row stands for it
        owners = [f for f in rows if path == f or (f.endswith("/") and path.startswith(f))]
        if not owners:
            missing.append(f"{path} (no row of the map holds its folder)")
            continue
        folder = max(owners, key=len)
        if folder == path:
            continue  # a row of its own (`backend/contract.py`)
        row = rows[folder]
        *subfolders, file = path[len(folder):].split("/")
        if file == "__init__.py":
            names = ["__init__.py"]
        else:
            names = [file, file.removesuffix(".py")]
        if not any(_named(row, n) for n in names):
            missing.append(f"{path} (row `{folder}`: name `{file}`)")
        missing += [f"{path} (row `{folder}`: name `{d}/`)" for d in subfolders
                    if not _named(row, d + "/")]
    return missing


def test_the_file_map_names_every_module_of_the_package() -> None:
    modules = _modules()
    assert "backend/runtime/conversation.py" in modules and len(modules) > 100
    missing = _unnamed(modules, _map_rows())
    assert not missing, "ARCHITECTURE.md's file map does not name:\n" + "\n".join(missing)


def test_the_check_finds_a_module_the_map_does_not_name() -> None:
    rows = _map_rows()
    assert _unnamed(["backend/runtime/not_in_the_map.py", "toptpu/nowhere/compiler.py"],
                    rows) == ["backend/runtime/not_in_the_map.py (row `backend/runtime/`: "
                              "name `not_in_the_map.py`)",
                              "toptpu/nowhere/compiler.py (row `toptpu/`: name `nowhere/`)"]
