"""The BLAS threads of each product: chosen by size in the `auto` policy, a fixed count or the
BLAS's own under TOPTPU_BLAS_THREADS (or `set_policy`), seen by the BLAS itself while the
product runs; the same bits on one thread as on two where the BLAS keeps a row's bits
whatever the rows around it (else f32 rounding apart); a bad setting is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from toptpu.backend.reference import blas_threads as BT
from toptpu.backend.reference import kernels as K

needs_openblas = pytest.mark.skipif(not BT.controllable(),
                                    reason="numpy's BLAS threads cannot be set here")


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch) -> Iterator[None]:  # noqa: ANN001
    monkeypatch.delenv(BT.ENV_VAR, raising=False)
    BT.set_policy(None)
    yield
    monkeypatch.delenv(BT.ENV_VAR, raising=False)
    BT.set_policy(None)


def _threads_seen(monkeypatch, a: np.ndarray, b: np.ndarray) -> int:  # noqa: ANN001
    """The thread count the BLAS reports while `BT.matmul(a, b)` runs its product (the
    product itself not computed: `a` and `b` may be broadcast views of any size)."""
    seen: list[int] = []
    blas = BT._the_blas()

    def spy(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        seen.append(blas.get())
        return np.zeros((*x.shape[:-1], y.shape[-1]), np.float32)

    monkeypatch.setattr(np, "matmul", spy)
    try:
        BT.matmul(a, b)
    finally:
        monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


def _zeros(*shape: int) -> np.ndarray:
    return np.broadcast_to(np.float32(0), shape)  # any size, no memory


def test_policies_parse_and_bad_ones_are_refused() -> None:
    assert BT.parse_policy("auto") == BT.Policy("auto")
    assert BT.parse_policy(" BLAS ") == BT.Policy("blas")
    assert BT.parse_policy("1") == BT.Policy("fixed", 1)
    assert str(BT.parse_policy("3")) == "3"
    for bad in ("", "0", "-1", "two", "1.5", "auto1"):
        with pytest.raises(BT.BlasThreadsError, match=f"{BT.ENV_VAR}=.* is not a thread "
                                                      "policy: give auto"):
            BT.parse_policy(bad)


def test_the_environment_sets_the_policy(monkeypatch) -> None:  # noqa: ANN001
    assert BT.policy() == BT.Policy("auto")  # unset: auto
    monkeypatch.setenv(BT.ENV_VAR, "1")
    BT.set_policy(None)
    assert BT.policy() == BT.Policy("fixed", 1)
    monkeypatch.setenv(BT.ENV_VAR, "many")
    BT.set_policy(None)
    with pytest.raises(BT.BlasThreadsError, match="'many' is not a thread policy"):
        BT.policy()


def test_auto_puts_small_products_on_one_thread_and_large_single_rows_on_the_blas() -> None:
    BT.set_policy("auto")
    assert BT.threads_for(1, 896, 4864) == 1  # a decode projection
    assert BT.threads_for(128, 896, 4864) == 1  # a prefill chunk's
    assert BT.threads_for(1, 3584, 18944) == 0  # a 7B MLP row: the BLAS's own count
    assert BT.threads_for(BT.DEFAULT_THREADS_ROWS + 1, 3584, 18944) == 1
    BT.set_policy("blas")
    assert BT.threads_for(1, 896, 4864) == 0
    BT.set_policy("2")
    assert BT.threads_for(1, 8, 8) == 2


@needs_openblas
def test_the_blas_runs_each_product_on_the_chosen_threads(monkeypatch) -> None:  # noqa: ANN001
    inherited = BT.inherited_threads()
    small = (_zeros(1, 896), _zeros(896, 4864))
    large = (_zeros(1, 3584), _zeros(3584, 18944))
    BT.set_policy("auto")
    assert _threads_seen(monkeypatch, *small) == 1
    assert _threads_seen(monkeypatch, *large) == inherited
    assert _threads_seen(monkeypatch, _zeros(1, 14, 16, 64), _zeros(1, 14, 64, 32)) == 1
    BT.set_policy("3")
    assert _threads_seen(monkeypatch, *small) == 3
    assert _threads_seen(monkeypatch, *large) == 3
    BT.set_policy("blas")
    assert _threads_seen(monkeypatch, *small) == inherited
    assert BT._the_blas().get() == inherited  # restored after every product


@needs_openblas
def test_the_environment_override_reaches_the_kernels_products() -> None:
    """TOPTPU_BLAS_THREADS=1 in a fresh process: a kernel's large product (one the auto
    policy gives the BLAS's own count) runs on one thread."""
    code = (
        "import numpy as np\n"
        "from toptpu.backend.reference import blas_threads as BT, kernels as K\n"
        "seen = []\n"
        "real = np.matmul\n"
        "def spy(a, b):\n"
        "    seen.append(BT._the_blas().get())\n"
        "    return np.zeros((*a.shape[:-1], b.shape[-1]), np.float32)\n"
        "np.matmul = spy\n"
        "K.matmul_dequantized(np.broadcast_to(np.float32(1), (1, 3584)),\n"
        "                     np.broadcast_to(np.float32(1), (18944, 3584)), None)\n"
        "print(BT.policy(), seen, BT.inherited_threads())\n")
    for policy, want in (("1", "1 [1]"), ("auto", "auto [{n}]")):
        env = {**os.environ, BT.ENV_VAR: policy, "OPENBLAS_NUM_THREADS": "2"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, check=True)
        assert out.stdout.split()[:2] == want.format(n=2).split(), out.stdout


@needs_openblas
@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (1, 1536, 576), (1, 896, 4864),
                                      (1, 4864, 896), (16, 896, 896), (128, 576, 1536),
                                      (7, 3584, 512)])
def test_one_thread_and_two_give_the_same_bits_where_rows_keep_them(rows: int, k: int,
                                                                    n: int) -> None:
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k), np.float32).astype(K.BF16)
    w = rng.standard_normal((n, k), np.float32)
    got = {}
    for threads in ("1", "2"):
        BT.set_policy(threads)
        got[threads] = (K.matmul_dequantized(x, w, None, np.float32),
                        K.matmul(x, w, transpose_b=True, out_dtype=np.float32))
    for one, two in zip(got["1"], got["2"], strict=True):
        # the same bits on a BLAS whose rows keep their bits however many are multiplied
        # at once (two threads take half the rows each); else f32 rounding apart
        assert one.tobytes() == two.tobytes() or not BT.rows_keep_bits()
        np.testing.assert_allclose(one, two, rtol=1e-5, atol=1e-5 * np.abs(one).max())


@needs_openblas
def test_attention_gives_the_same_bits_on_one_thread_and_two() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 64, 14, 64), np.float32)
    k = rng.standard_normal((1, 64, 2, 64), np.float32)
    v = rng.standard_normal((1, 64, 2, 64), np.float32)
    got = {}
    for threads in ("1", "2"):
        BT.set_policy(threads)
        got[threads] = K.attention(q, k, v, None, 0.125, causal=True).tobytes()
    assert got["1"] == got["2"]


def test_describe_names_the_policy() -> None:
    BT.set_policy("1")
    assert "policy 1" in BT.describe()
