"""The `.mlir` FileCheck tests of tests/filecheck, one pytest test per file, run by lit.

Every pass and named pipeline `toptpu-opt` registers has a file that runs it (checked
below), and each verifier has failing cases. lit runs in this interpreter (`lit.main`, not
the `lit` script, whose shebang may name another Python): lit.cfg.py puts the directory of
the interpreter running lit first on PATH, so the `toptpu-opt` under test is the one
installed beside the Python that runs pytest.

Every file is in the fast tier: `toptpu-opt` reads weight stores with the torch-free reader
(`toptpu.dialects.checkpoint_reader`), so a file costs its RUN lines' `toptpu-opt` processes
(about a second of CPU each) and no torch import.

A file that demonstrates a known bug says so and carries lit's `XFAIL: *`: lit passes it
while the bug is there and fails it (XPASS) once the bug is fixed, so the mark cannot
outlive the bug.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from xdsl.utils.arg_spec import parse_pipeline

from toptpu.opt import OptInputError, module_pipeline
from toptpu.passes.registry import all_passes

FILECHECK_DIR = os.path.join(os.path.dirname(__file__), "filecheck")
FILES = sorted(f for f in os.listdir(FILECHECK_DIR) if f.endswith(".mlir"))
LIT = "import sys; from lit.main import main; sys.exit(main())"


def _lit(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LIT, "-v", "-j", "1", *paths],
                          capture_output=True, text=True, timeout=600 * len(paths))


@pytest.fixture(scope="module")
def lit_all(request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    """One lit run of the files of the session's `test_filecheck`s (one lit process: its
    start and lit.cfg.py's imports once, not once per file; each file's RUN lines run as
    before): 48 lit processes fewer for the whole directory."""
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if getattr(item, "originalname", None) == "test_filecheck"
                    and hasattr(item, "callspec")})
    return _lit(*(os.path.join(FILECHECK_DIR, name) for name in names))


@pytest.mark.parametrize("name", FILES)  # all in the fast tier: toptpu-opt loads no torch
def test_filecheck(name: str, lit_all: subprocess.CompletedProcess) -> None:
    # the file's own lit run when the run of all files failed: its return code and output
    res = lit_all if lit_all.returncode == 0 else _lit(os.path.join(FILECHECK_DIR, name))
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
    # PASS, or XFAIL for a file that names a known bug; never FAIL, XPASS or UNSUPPORTED
    assert re.search(rf"^(PASS|XFAIL): toptpu :: {re.escape(name)} ", res.stdout, re.M), \
        res.stdout[-2000:]


def _run_lines(text: str) -> list[str]:
    """The RUN commands of a lit test file, continuation lines joined."""
    runs, cur = [], ""
    for line in text.splitlines():
        m = re.match(r"\s*//\s*RUN:\s?(.*)$", line)
        if not m:
            continue
        cur += m.group(1)
        if cur.endswith("\\"):
            cur = cur[:-1]
            continue
        runs.append(cur)
        cur = ""
    return runs


def _passes_run(command: str) -> set[str]:
    """Names of the passes each `toptpu-opt ... -p PIPELINE` of a RUN command runs."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    stages: list[list[str]] = [[]]
    for word in lexer:
        if word == "|":
            stages.append([])
        else:
            stages[-1].append(word)
    names: set[str] = set()
    for words in stages:
        if "toptpu-opt" not in words:
            continue
        for flag, value in zip(words, words[1:], strict=False):
            if flag in ("-p", "--passes", "--pass-pipeline"):
                try:
                    spec = module_pipeline(value)
                except OptInputError:  # a RUN line checking that a pipeline is refused
                    continue
                names |= {s.name for s in parse_pipeline(spec)}
        for word in words:
            if word.startswith("--pass-pipeline="):
                names |= {s.name for s in parse_pipeline(module_pipeline(word.split("=", 1)[1]))}
    return names


def test_every_pass_and_pipeline_has_a_filecheck_test() -> None:
    run: set[str] = set()
    for name in FILES:
        with open(os.path.join(FILECHECK_DIR, name)) as f:
            for command in _run_lines(f.read()):
                run |= _passes_run(command)
    missing = sorted(set(all_passes()) - run)
    assert not missing, f"passes no FileCheck test runs: {missing}"
