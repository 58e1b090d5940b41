"""The BLAS threads of each product: chosen by the product's size, not inherited.

numpy's BLAS (OpenBLAS in numpy's wheels) runs every product on as many threads as the
host has cores, unless told otherwise (OPENBLAS_NUM_THREADS) before the process starts.
Most of a model's products are too small for that: a decode step's projections (a row
times a weight of a few million multiply-adds) and a prefill chunk's must wake a second
thread for every product, and on a host whose other cores are busy it waits for one. On
the loaded 2-core host this was measured on (`bench/blas_threads.py`, load average 7-12),
two threads made a SmolLM2 or Qwen2.5-0.5B projection 12-270x slower than one, and every
product of 4 rows or more was faster on one thread but a few within noise; two threads
won only a single row times a large weight (the lm_head of Qwen2.5-0.5B, a 7B model's MLP:
1.3-1.4x, memory-bound: two cores read more bytes per second). So each product of the
kernels (`kernels.py`: `np.matmul` through `matmul` here) runs on one thread, except a
product of at most `DEFAULT_THREADS_ROWS` rows with at least `DEFAULT_THREADS_FROM`
multiply-adds, which runs on the BLAS's own count. OpenBLAS splits a product's outputs among its
threads, never the sum of one output, so the bits are the same either way on a BLAS whose
row of a product has the same bits however many rows are multiplied at once
(`rows_keep_bits`: OpenBLAS 0.3.31 on the hosts this was first measured on). Not every
BLAS does: on an AMD EPYC with AVX-512 (OpenBLAS 0.3.31 choosing its Haswell kernels) a
16-row product split over two threads, like a product tiled by rows on the machine,
differs from the whole in the last bits of some outputs (f32 rounding, 1-2 ulp);
`tests/test_blas_threads.py` checks the bits on a host that keeps them and the rounding
on one that does not.

The environment variable `TOPTPU_BLAS_THREADS` overrides the choice for the process:
`auto` (the default: by size, as above), a thread count (`1`: every product on one thread;
`2`, ...), or `blas` (leave the BLAS alone: its own count for every product, as numpy
does). `set_policy` does the same from Python. Where numpy's BLAS is not an OpenBLAS this
module can drive (it finds the library numpy loaded and its `*set_num_threads*` symbol),
the products run with the BLAS's own threads whatever the policy says
(`controllable()` is False). The count is the process's: products run at once by several
Python threads may run on each other's choice (the same bits, another speed).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from toptpu.errors import ToptpuError

ENV_VAR = "TOPTPU_BLAS_THREADS"
#: in the `auto` policy a product runs on the BLAS's own threads only when it has at most
#: this many rows and at least DEFAULT_THREADS_FROM multiply-adds (m * k * n per matrix);
#: every other product on one thread. Measured with bench/blas_threads.py
#: (docs/benchmarks.md): one row x 1536 x 576 ... 3584 x 3584 (0.9M-13M) was 12-100x
#: slower on two threads under load; one row x 896 x 151936 (136M) and x 3584 x 18944
#: (68M) 1.26-1.40x faster; one row x 576 x 49152 (28M) a tie.
DEFAULT_THREADS_ROWS = 1
DEFAULT_THREADS_FROM = 50_000_000

#: the symbols that set and get OpenBLAS's thread count, in the builds numpy ships
#: (scipy-openblas, 64-bit integers) and the plain ones
_SET_NAMES = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
              "openblas_set_num_threads")
_GET_NAMES = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
              "openblas_get_num_threads")


class BlasThreadsError(ToptpuError, ValueError):
    """A thread policy that is not one (the message says what to give)."""


@dataclass(frozen=True)
class Policy:
    """How products pick their threads: `auto` (by size), `blas` (the BLAS's own count)
    or a fixed count (`threads`)."""

    kind: str  # "auto", "blas" or "fixed"
    threads: int = 0

    def __str__(self) -> str:
        return str(self.threads) if self.kind == "fixed" else self.kind


def parse_policy(text: str) -> Policy:
    """'auto', 'blas' or a thread count >= 1; BlasThreadsError for anything else."""
    t = text.strip().lower()
    if t in ("auto", "blas"):
        return Policy(t)
    if re.fullmatch(r"\d+", t) and int(t) >= 1:
        return Policy("fixed", int(t))
    raise BlasThreadsError(f"{ENV_VAR}={text!r} is not a thread policy: give auto (threads "
                           "by product size), blas (the BLAS's own count) or a thread "
                           "count such as 1")


class _OpenBlas:
    """numpy's OpenBLAS as loaded in this process, or nothing where it cannot be found."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._set: Callable[[int], None] | None = None
        self._get: Callable[[], int] | None = None
        for path in _loaded_libraries("openblas"):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            setter = next((getattr(lib, n) for n in _SET_NAMES if hasattr(lib, n)), None)
            getter = next((getattr(lib, n) for n in _GET_NAMES if hasattr(lib, n)), None)
            if setter is None or getter is None:
                continue
            setter.argtypes, setter.restype = [ctypes.c_int], None
            getter.argtypes, getter.restype = [], ctypes.c_int
            self.path, self._set, self._get = path, setter, getter
            break
        #: the count the BLAS had when found: what every product inherits without us
        self.inherited = self.get() if self._get is not None else 0
        self.current = self.inherited

    def get(self) -> int:
        return int(self._get()) if self._get is not None else 0

    def set(self, threads: int) -> None:
        if self._set is not None and threads != self.current:
            self._set(threads)
            self.current = threads


def _loaded_libraries(word: str) -> list[str]:
    """The shared libraries of this process whose file name holds `word` (Linux: from
    /proc/self/maps; elsewhere none)."""
    seen: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if word in os.path.basename(path).lower() and ".so" in path \
                            and path not in seen:
                        seen.append(path)
    except OSError:
        return []
    return seen


_blas: _OpenBlas | None = None
_policy: Policy | None = None


def _the_blas() -> _OpenBlas:
    global _blas
    if _blas is None:
        np.ones((2, 2)) @ np.ones((2, 2))  # numpy's BLAS is loaded once it was used
        _blas = _OpenBlas()
    return _blas


def policy() -> Policy:
    """The process's policy: set by `set_policy`, else TOPTPU_BLAS_THREADS, else auto."""
    global _policy
    if _policy is None:
        raw = os.environ.get(ENV_VAR)
        _policy = Policy("auto") if raw is None or not raw.strip() else parse_policy(raw)
    return _policy


def set_policy(value: str | Policy | None) -> None:
    """Use `value` ('auto', 'blas', a count; None: TOPTPU_BLAS_THREADS again, read on the
    next product) from now on."""
    global _policy
    _policy = parse_policy(value) if isinstance(value, str) else value


def controllable() -> bool:
    """Whether this process can set its BLAS's threads (an OpenBLAS it found)."""
    return _the_blas()._set is not None


def inherited_threads() -> int:
    """The BLAS's own thread count (0 where it cannot be read)."""
    return _the_blas().inherited


#: the products `rows_keep_bits` compares with their rows taken a few at a time: (rows,
#: k, n, rows at once), sizes the models make (a 1-row slice runs OpenBLAS's gemv)
_ROW_PROBES = ((8, 16, 256, 2), (16, 896, 896, 8), (128, 576, 1536, 64), (12, 64, 96, 4))
_rows_keep_bits: bool | None = None


def rows_keep_bits() -> bool:
    """Whether this host's BLAS gives every row of a product the same bits whether the
    rows are multiplied all at once or a few at a time (probed once per process on a few
    products of the models' sizes, on one thread). Where it does, a product tiled by rows
    (the machine's layer groups) or split over threads keeps the whole product's bits;
    where it does not, they agree to f32 rounding (DESIGN.md: machine against
    interpreter cos >= 0.99999, bit-equal where tiling keeps order)."""
    global _rows_keep_bits
    if _rows_keep_bits is None:
        rng = np.random.default_rng(0)
        same = True
        with _threads(1):
            for m, k, n, step in _ROW_PROBES:
                a = rng.standard_normal((m, k), np.float32)
                b = rng.standard_normal((n, k), np.float32).T
                whole = np.matmul(a, b)
                parts = [np.matmul(np.array(a[i:i + step]), b) for i in range(0, m, step)]
                same = same and whole.tobytes() == np.concatenate(parts).tobytes()
        _rows_keep_bits = same
    return _rows_keep_bits


@contextmanager
def _threads(count: int) -> Iterator[None]:
    """Within: the BLAS on `count` threads where this process can set them."""
    blas = _the_blas()
    if blas._set is None or count == blas.inherited:
        yield
        return
    blas.set(count)
    try:
        yield
    finally:
        blas.set(blas.inherited)


def threads_for(m: int, k: int, n: int) -> int:
    """The threads an [m, k] x [k, n] product runs on (0: the BLAS's own count, as
    without us)."""
    p = policy()
    if p.kind == "blas":
        return 0
    if p.kind == "fixed":
        return p.threads
    return 0 if m <= DEFAULT_THREADS_ROWS and m * k * n >= DEFAULT_THREADS_FROM else 1


def workers(m: int, k: int, n: int) -> int:
    """How many Python threads a product made a block of rows at a time (the 4-bit and
    bf16 weights' decode products: `kernels.matmul_packed`, ...) splits its blocks over:
    the count `threads_for` chooses for the whole [m, k] x [k, n] product (0: the BLAS's
    own count), each block's own product then on one BLAS thread. The same blocks, so
    the same bits, on any count."""
    threads = threads_for(m, k, n)
    if threads == 0:
        threads = _the_blas().inherited or os.cpu_count() or 1
    return max(1, threads)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`np.matmul(a, b)` on the threads `threads_for` chooses for one of its matrices
    (a stack of products: each product's size); the BLAS's count is restored after."""
    m = a.shape[-2] if a.ndim > 1 else 1
    k = a.shape[-1]
    n = b.shape[-1] if b.ndim > 1 else 1
    threads = threads_for(m, k, n)
    blas = _the_blas()
    if threads == 0 or blas._set is None or threads == blas.inherited:
        return np.matmul(a, b)
    blas.set(threads)
    try:
        return np.matmul(a, b)
    finally:
        blas.set(blas.inherited)


@contextmanager
def products(m: int, k: int, n: int) -> Iterator[None]:
    """Within: numpy's products run on the threads `threads_for(m, k, n)` chooses (the
    BLAS's count restored after), set once for many products of that size (a tiled
    product's tiles: `matmul` sets and restores the count around each product)."""
    threads = threads_for(m, k, n)
    if threads == 0:
        yield
        return
    with _threads(threads):
        yield


def describe() -> str:
    """One line: the policy and what it does on this host."""
    blas = _the_blas()
    if blas._set is None:
        return (f"policy {policy()}; numpy's BLAS threads cannot be set here (no OpenBLAS "
                "found): every product on the BLAS's own threads")
    p = policy()
    what = {"auto": f"a product of {DEFAULT_THREADS_ROWS} row(s) and "
                    f"{DEFAULT_THREADS_FROM:,} multiply-adds or more on the BLAS's "
                    f"{blas.inherited} threads, every other on 1",
            "blas": f"every product on the BLAS's {blas.inherited} threads",
            "fixed": f"every product on {p.threads} thread(s)"}[p.kind]
    return f"policy {p} ({ENV_VAR}): {what}"
