"""Writes weights.safetensors for the FileCheck tests (deterministic; rerun to regenerate)."""

import os

import numpy as np
from safetensors.numpy import save_file

rng = np.random.default_rng(0)
save_file({
    "fc.weight": rng.standard_normal((32, 64)).astype(np.float32),
    "fc.bias": rng.standard_normal((32,)).astype(np.float32),
    "norm.weight": rng.standard_normal((64,)).astype(np.float32),
    "embed.weight": rng.standard_normal((16, 64)).astype(np.float32),
    "inv_freq": (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32),
}, os.path.join(os.path.dirname(__file__), "weights.safetensors"))
