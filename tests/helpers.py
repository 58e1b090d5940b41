"""Test helpers: similarity metrics live in the product (toptpu.compare); this adds
shell helpers."""

from __future__ import annotations

import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def run_tool(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, name), *args], input=stdin, capture_output=True,
                          text=True, timeout=600)
