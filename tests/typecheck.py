"""mypy over the installed package `toptpu.*`, at the strictness of pyproject.toml's [tool.mypy].

The source tree does not have the package's layout (pyproject's package-dir maps the top-level
folders `dialects`, `passes`, `frontends` and `backend` to `toptpu.dialects` etc.), and mypy
cannot follow the import hook of an editable install. So this builds the package's layout out of
symlinks under .mypy_cache/ (rebuilt on every run from pyproject's mapping, so a new module is
never missed), runs `python -m mypy -p toptpu` on it and prints mypy's lines with the source
paths (dialects/top.py, not .mypy_cache/.../toptpu/dialects/top.py).

    python tests/typecheck.py        # exit 0 and "Success: ..." when the package is clean
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache"
LAYOUT = CACHE / "toptpu-layout"
_PATH = re.compile(r"^(?P<path>[^:\s]+\.pyi?)(?P<rest>:.*)$")


def build_layout(root: Path = ROOT, layout: Path = LAYOUT) -> Path:
    """The package `toptpu` as pyproject.toml installs it, made of symlinks to the source files
    under `layout`; returns `layout` (the directory to put on mypy's path)."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    if layout.exists():
        shutil.rmtree(layout)
    package = layout / "toptpu"
    package.mkdir(parents=True)
    top_source = root / package_dir.get("toptpu", "toptpu")
    for entry in sorted(top_source.iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in sorted(package_dir.items()):
        if name == "toptpu":
            continue
        target = layout / name.replace(".", "/")
        if target.exists() or target.is_symlink():
            raise SystemExit(f"typecheck: error: {name} is both a folder of toptpu/ and mapped "
                             f"to {folder}/ by pyproject.toml's package-dir")
        target.symlink_to(root / folder)
    return layout


def source_path(line: str, root: Path = ROOT) -> str:
    """mypy's output line with its file named by its path in the source tree."""
    match = _PATH.match(line)
    if not match:
        return line
    real = Path(os.path.realpath(root / match["path"]))
    try:
        return f"{real.relative_to(root)}{match['rest']}"
    except ValueError:
        return line


def run_mypy(root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m mypy -p toptpu` on the symlinked layout, configured by pyproject.toml; its
    stdout has source paths."""
    layout = build_layout(root)
    env = dict(os.environ, MYPYPATH=str(layout))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"),
         "--cache-dir", str(CACHE), "-p", "toptpu"],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )
    stdout = "\n".join(source_path(line, root) for line in done.stdout.splitlines())
    return subprocess.CompletedProcess(done.args, done.returncode, stdout, done.stderr)


def main() -> int:
    done = run_mypy()
    print(done.stdout)
    if done.stderr:
        print(done.stderr, file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
