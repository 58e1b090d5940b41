"""docs/your-first-pass.md, tested: every `sh` block's commands run, in order, in one bash
(`set -euo pipefail`: a failing command or pipe stage fails the test), in a scratch directory
holding a copy of examples/ (the tutorial runs from the repository's root; pip builds in the
copy); the code it shows is the example plugin's code (its passes, its op and the op's
kernel), and its pyproject's entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOC = os.path.join(ROOT, "docs", "your-first-pass.md")
EXAMPLE = os.path.join(ROOT, "examples", "toptpu-plugin-example")


def _blocks(kind: str) -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        return re.findall(rf"^```{kind}\n(.*?)^```", f.read(), re.S | re.M)


def test_the_tutorial_shows_the_example_plugin_as_it_is() -> None:
    package = os.path.join(EXAMPLE, "toptpu_plugin_example")
    sources = []
    for name in ("__init__.py", "ops.py", "kernels.py"):
        with open(os.path.join(package, name)) as f:
            sources.append(f.read())
    blocks = _blocks("python")
    assert len(blocks) == 4  # the pass, the op, its kernel, the plugin object
    for code in blocks:
        assert any(code in source for source in sources), code[:200]
    (toml,) = _blocks("toml")
    with open(os.path.join(EXAMPLE, "pyproject.toml")) as f:
        assert toml in f.read()


@pytest.mark.slow
def test_every_command_of_the_tutorial_runs(tmp_path) -> None:
    script = "\n".join(_blocks("sh"))
    assert script.count("toptpu compile") == 4 and script.count("toptpu eval") == 2
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "toptpu-plugin-example",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "Output"))
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    assert "expand-silu" in out and "form: a string (default sigmoid)" in out  # --help
    assert out.count("= top.sigmoid ") == 1  # the block after expand-silu, on stdout
    # the compile recorded the pass; from the edited dump, only the block changed
    assert ",fuse,expand-silu,canonicalize," in out
    assert "compiled from the dump" in out and "block from block/08-cse.mlir (edited)" in out
    # your first op: the pass makes it, the Top IR computes the same, the model file records
    # it, and a process without the plugin refuses the file in one line
    assert "= top.silu_mul %" in out and "every element equal" in out
    assert ("plugin op: tpu.silu_mul of the plugin 'example' (toptpu-plugin-example 0.1.0)"
            in out)
    assert "refused: the plugin is not installed" in out
    assert ("toptpu run: error: 'fused.toptpu' uses the op 'tpu.silu_mul' of the plugin "
            "'example' (toptpu-plugin-example 0.1.0), which is not installed") in res.stderr
