"""Run the `.mlir` FileCheck tests (tests/filecheck, one per pass) through lit."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_filecheck_suite() -> None:
    lit = os.path.join(os.path.dirname(sys.executable), "lit")
    res = subprocess.run([lit, "-v", os.path.join(HERE, "filecheck")], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "Failed" not in res.stdout
