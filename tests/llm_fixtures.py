"""Tiny model directories and compiled model files shared by the LLM tests.

Each (family, mode, shapes, layers) is saved and compiled once per test session and shared
between pytest-xdist workers through a directory next to the session's base temp dir,
guarded by a file lock (the pattern pytest-xdist documents for session-scoped data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
from filelock import FileLock

#: a prompt of 39 tokens with the tiny tokenizer: longer than max_input_length 16
LONG_PROMPT = ("Hello world! The tensor processor runs the compiled model. Each layer is "
               "compiled once.")


@dataclass(frozen=True)
class Built:
    model_dir: str
    model_file: str


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by all workers of this session
    path = os.path.join(str(root), "llm-models")
    os.makedirs(path, exist_ok=True)
    return path


def tiny_dir(tmp_path_factory: pytest.TempPathFactory, family: str, layers: int = 2) -> str:
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    base = shared_dir(tmp_path_factory)
    path = os.path.join(base, f"{family}-{layers}l")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            with quiet_transformers():
                save_tiny_model(path, family, layers=layers)
            open(os.path.join(path, "done"), "w").close()
    return path


def compiled(tmp_path_factory: pytest.TempPathFactory, family: str, mode: str = "f32",
             seq: int = 160, input_len: int = 16, history: int | None = None,
             layers: int = 2, devices: int = 1, parallel: str | None = None,
             batch: int = 1) -> Built:
    """A tiny model of `family` saved with save_pretrained and compiled to a model file
    (spread over `devices` devices by `parallel`, tp or pp, when given; with the batch nets
    at `batch` when above 1)."""
    from toptpu.compiler import compile as compile_model

    model_dir = tiny_dir(tmp_path_factory, family, layers)
    spread = "" if parallel is None else f"-{parallel}{devices}"
    spread += "" if batch == 1 else f"-b{batch}"
    name = f"{family}-{layers}l-{mode}-s{seq}-l{input_len}-h{history}{spread}.toptpu"
    path = os.path.join(shared_dir(tmp_path_factory), name)
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode=mode, seq_length=seq,
                          max_input_length=input_len, max_history=history, progress=None,
                          devices=devices, parallel=parallel, batch=batch)
    return Built(model_dir, path)


_HF: dict[str, Any] = {}


def hf_model(model_dir: str) -> Any:
    """The saved model loaded back by transformers (the reference for generate)."""
    if model_dir not in _HF:
        import torch
        from transformers import AutoModelForCausalLM

        from toptpu.frontends.hf_loader import quiet_transformers

        with quiet_transformers():
            _HF[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32).eval()
    return _HF[model_dir]


def hf_generate(model_dir: str, ids: list[int], n: int) -> list[int]:
    """transformers greedy `generate` of up to n new tokens after `ids`."""
    import torch

    with torch.no_grad():
        out = hf_model(model_dir).generate(torch.tensor([ids]), max_new_tokens=n,
                                           do_sample=False)
    return out[0, len(ids):].tolist()
