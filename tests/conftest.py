"""Shared fixtures: tiny real `transformers` models with seeded random weights."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fuzz  # noqa: E402,F401 - registers the hypothesis profiles before the plugin loads one


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
