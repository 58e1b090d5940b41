"""Shared fixtures: tiny real `transformers` models with seeded random weights."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fuzz  # noqa: E402,F401 - registers the hypothesis profiles before the plugin loads one

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
