"""Test helpers: similarity metrics live in the product (toptpu.compare); this adds
shell helpers."""

from __future__ import annotations

import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def run_tool(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, name), *args], input=stdin, capture_output=True,
                          text=True, timeout=600)


def decoder_layer_ir(model: object, directory: str) -> str:
    """A decoder layer of `model` imported at 8 tokens (before top-pipeline), its weights saved
    as `directory`/weights.safetensors and named by the module: the IR text `--dump-ir`
    writes after import."""
    from xdsl.dialects.builtin import StringAttr

    from toptpu.compiler import print_ir
    from toptpu.dialects.weight_store import STORE_ATTR
    from toptpu.frontends.hf_layers import import_decoder_layer

    imp = import_decoder_layer(model, 8, top_pipeline=False)
    weights = os.path.join(directory, "weights.safetensors")
    imp.store.save(weights)
    imp.module.attributes[STORE_ATTR] = StringAttr(weights)
    return print_ir(imp.module, generic=False)
