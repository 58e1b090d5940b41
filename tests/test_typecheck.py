"""mypy finds no error in the package `toptpu.*` at pyproject.toml's [tool.mypy] strictness
(every function annotated, every body checked), and the configuration stays that strict."""

from __future__ import annotations

import re
import tomllib

import pytest
from typecheck import ROOT, build_layout, run_mypy, source_path

PACKAGE_DIRS = ("toptpu", "dialects", "passes", "frontends", "backend")
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def test_the_strictness_is_stated_and_not_loosened() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for flag in ("disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs",
                 "warn_unused_ignores"):
        assert config.get(flag) is True, f"[tool.mypy] {flag} is not true"
    assert "ignore-without-code" in config["enable_error_code"]
    assert "ignore_errors" not in config
    for override in config.get("overrides", []):
        assert "ignore_errors" not in override, f"ignore_errors for {override['module']}"
        assert not any(m in ("*", "toptpu", "toptpu.*") for m in override["module"]), (
            f"an override names the package itself or every module: {override['module']}")


def test_the_layout_is_the_installed_package(tmp_path) -> None:
    layout = build_layout(ROOT, tmp_path / "layout")
    assert (layout / "toptpu" / "dialects" / "top.py").resolve() == ROOT / "dialects" / "top.py"
    assert (layout / "toptpu" / "backend" / "runtime").resolve() == ROOT / "backend" / "runtime"
    assert (layout / "toptpu" / "cli.py").resolve() == ROOT / "toptpu" / "cli.py"
    line = f"{layout.relative_to(ROOT) if layout.is_relative_to(ROOT) else layout}"
    assert source_path(f"{line}/toptpu/passes/fuse.py:3: error: x  [misc]") == (
        "passes/fuse.py:3: error: x  [misc]")


def test_every_ignore_names_its_error_code_and_why() -> None:
    """A `# type: ignore[code]` says why, after it or in a comment on the line above."""
    bare = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                found = IGNORE.search(line)
                if found is None:
                    continue
                above = lines[i - 1].strip() if i else ""
                if not found["codes"] or not (found["rest"].strip().startswith("#")
                                              or above.startswith("#")):
                    bare.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not bare, "ignores without an error code or a reason:\n" + "\n".join(bare)


@pytest.mark.slow
def test_mypy_finds_no_error_in_the_package() -> None:
    done = run_mypy()
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, (
        f"mypy (python tests/typecheck.py):\n{done.stdout}\n{done.stderr}")
