"""Shared fixtures: tiny real `transformers` models with seeded random weights."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fuzz  # noqa: E402,F401 - registers the hypothesis profiles before the plugin loads one

# `toptpu run` and `chat` write a model file's weight cache file beside it after a run that
# had none: the suite's model files are shared between tests, so it runs with that off
# (and subprocesses inherit it); the tests of that behaviour turn it on for their files
os.environ.setdefault("TOPTPU_WEIGHT_CACHE_FILE", "off")


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
