"""Shared fixtures: tiny real `transformers` models with seeded random weights."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Compiled modules are kept (in __pycache__/, as Python does by default) even where the
# environment says PYTHONDONTWRITEBYTECODE: otherwise every `toptpu` subprocess of the suite
# compiles the package's sources again (+1.5 s CPU for `toptpu --help` alone, measured) and
# each xdist worker rewrites every test module's asserts anew (7 s of its collection's 12 s)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _threads_per_worker() -> int | None:
    """torch's threads for one pytest-xdist worker: the cores shared among the workers (None
    outside xdist). Each worker left at torch's default (every core) oversubscribes the host
    `-n` times over, and OpenMP's waiting threads spin: two workers of two threads on two
    cores spent 4.7x the CPU of one thread each on the same torch products (measured)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    # before torch is imported (it reads them once), inherited by the tests' subprocesses;
    # OpenBLAS (numpy) is left alone: toptpu chooses its threads per product
    # (backend/reference/blas_threads.py), and OMP_NUM_THREADS would cap its own count
    os.environ.setdefault("MKL_NUM_THREADS", str(_THREADS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_THREADS)

# The cyclic collector's full passes (its oldest generation: every object alive, torch's,
# transformers' and xDSL's IR among them, ~0.15 s each in a test process) one tenth as often
# (after 100 collections of the middle generation instead of 10; the young ones as Python
# has them). Measured in one process on tests/test_llm_generate.py: the collector's CPU
# 1.85 -> 0.77 s (its full passes 1.45 -> 0.32 s). The tests' own subprocesses keep
# Python's thresholds.
gc.set_threshold(*gc.get_threshold()[:2], 100)

import fuzz  # noqa: E402,F401 - registers the hypothesis profiles before the plugin loads one


def _dist_given(config: pytest.Config) -> bool:
    """Whether the command line (or PYTEST_ADDOPTS) names a pytest-xdist distribution."""
    args = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    return any(a in ("-d", "--dist") or a.startswith("--dist=") for a in map(str, args))


def _by_module() -> bool:
    """Whether this process is a worker of a `pytest -n N` run without --dist (see below)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and not _DIST_GIVEN


_DIST_GIVEN = False


def pytest_configure(config: pytest.Config) -> None:
    """`pytest -n N` (pytest-xdist's default distribution, `load`, unless --dist is given)
    runs the tests of one module on one worker (`loadfile`), the modules with the most slow
    tests first (`pytest_collection_modifyitems`, below). Under `load` the workers took
    turns at a module's tests, and each set up the module's fixtures (a compile, a model
    built and saved) and filled its own per-process caches (a transformers model loaded
    back, a model file opened) for them: tests/test_ir_dumps.py took 67.6 s CPU on two
    workers by `load`, 50.2 s by module (measured side by side). The modules of fast tests
    alone come last: no worker is left alone with a long test at the end."""
    global _DIST_GIVEN
    _DIST_GIVEN = _dist_given(config)
    if getattr(config.option, "dist", "no") == "load" and not _DIST_GIVEN:
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # the workers' order (below), not xdist's


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker of a by-module run: the modules ordered by their slow tests, most first
    (then by their tests), each module's tests in their own order."""
    if not _by_module():
        return
    slow: dict[str, int] = {}
    count: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        count[module] = count.get(module, 0) + 1
        slow[module] = slow.get(module, 0) + (item.get_closest_marker("slow") is not None)
    rank = {m: i for i, m in enumerate(sorted(count, key=lambda m: (-slow[m], -count[m], m)))}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


# `toptpu run` and `chat` write a model file's weight cache file beside it after a run that
# had none: the suite's model files are shared between tests, so it runs with that off
# (and subprocesses inherit it); the tests of that behaviour turn it on for their files
os.environ.setdefault("TOPTPU_WEIGHT_CACHE_FILE", "off")


@pytest.fixture(autouse=True)
def _transformers_weight_conversions_kept() -> Iterator[None]:
    """Each test leaves transformers' checkpoint conversion registry as it found it.

    auto-round's loader (``from_pretrained`` on one of its MoE checkpoints) calls
    ``disable_moe_conversion_mapping``, which re-registers the model type's conversions
    without the expert-merging ones, process-wide: every later load of a hub-layout
    ``qwen3_moe``/``qwen2_moe`` checkpoint in the same worker then leaves the fused experts
    randomly initialised. Restored here: the registry's entries (a shallow copy suffices,
    registering replaces a value) and the lookup function, which auto-round may also swap.
    """
    import transformers.conversion_mapping as mod
    import transformers.modeling_utils as modeling_utils

    lookups = (mod.get_checkpoint_conversion_mapping,
               getattr(modeling_utils, "get_checkpoint_conversion_mapping", None))
    cache = mod._checkpoint_conversion_mapping_cache
    entries = None if cache is None else dict(cache)
    yield
    mod.get_checkpoint_conversion_mapping = lookups[0]
    if lookups[1] is not None:
        modeling_utils.get_checkpoint_conversion_mapping = lookups[1]
    now = mod._checkpoint_conversion_mapping_cache
    if entries is not None and now is not None:
        now.clear()
        now.update(entries)
    elif entries is None and now is not None:
        mod._checkpoint_conversion_mapping_cache = None


@pytest.fixture(scope="session")
def tiny_models():
    """Cache of tiny causal LMs by family name."""
    from toptpu.frontends.tiny_models import tiny_model

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tiny_model(family)
        return cache[family]

    return get
