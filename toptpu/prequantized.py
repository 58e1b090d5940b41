"""Pre-quantized (GPTQ / AWQ / AutoRound) checkpoints in a compile: the mode they imply,
the layers that need nets of their own, and their tensors in the compile-time weight store.

A checkpoint's integers are used as they are, never re-quantized: `resolve_mode` refuses a
mode of other bits; `layer_variants` gives layers whose linears are quantized differently
(bits, group size, act-order, or left in float) nets of their own; `add_checkpoint_tensors`
puts each quantized linear's tensors beside its float weight (as annexes
`passes.quantize.checkpoint_key(weight, field)`), where convert-top-to-tpu finds them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import CompileError
from toptpu.frontends.hf_loader import LoadedModel
from toptpu.frontends.llm import NetSpec
from toptpu.passes.quantize import CHECKPOINT_MODEL, checkpoint_key
from toptpu.request import AUTO, AskedMode

#: checkpoint torch dtype -> the activation type `-q auto` picks
AUTO_ACTIVATIONS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def checkpoint_bits(checkpoint: Any) -> int:
    """The weight bits of most of the checkpoint's quantized layers."""
    counts = Counter(layout.bits for layout in checkpoint.layouts.values())
    if not counts:
        raise CompileError("the checkpoint has no quantized layers")
    return counts.most_common(1)[0][0]


def resolve_mode(mode: AskedMode, loaded: LoadedModel) -> QuantMode:
    """The mode a compile uses: none given -> f32 for a float model, the checkpoint's own
    for a pre-quantized one; `-q auto` -> the checkpoint's bits and dtype; and a mode
    contradicting a pre-quantized checkpoint is an error (its integers are used as they
    are, never re-quantized)."""
    ck = loaded.checkpoint
    if mode is None:
        mode = QuantMode.F32 if ck is None else AUTO
    if ck is None:
        if mode is AUTO:
            raise CompileError(f"-q auto takes a pre-quantized (GPTQ/AWQ/AutoRound) checkpoint; "
                               f"{loaded.source} is a float model: choose a mode such as "
                               "w4bf16")
        assert isinstance(mode, QuantMode)
        return mode
    bits = checkpoint_bits(ck)
    desc = f"{loaded.source} is a {bits}-bit {ck.quant_method} checkpoint"
    if mode is AUTO:
        act = AUTO_ACTIVATIONS.get(str(loaded.checkpoint_dtype), "f16")
        return QuantMode(f"w{bits}{act}")
    assert isinstance(mode, QuantMode)
    if mode.weight_bits != bits:
        raise CompileError(f"-q {mode} contradicts the checkpoint: {desc}; use -q auto or "
                           f"w{bits}f16 / w{bits}bf16 / w{bits}f32 (activation type of your "
                           "choice)")
    return mode


def layer_variants(hf: Any, checkpoint: Any) -> dict[int, list[int]]:
    """Representative layer -> the layers compiled with its nets. Layers of different kinds
    (`layer_types`: full or linear attention) never share nets; within a kind, without a
    checkpoint all layers share the first one's nets, and with one, layers whose linears
    differ in quantization (bits, group size, act-order, zero points or mins, the scales'
    dtype, or left in float: `QuantizedLayout.net_form`) get nets of their own."""
    layers = hf.model.layers
    types = list(getattr(hf.config, "layer_types", None) or ["full_attention"] * len(layers))

    def signature(i: int) -> tuple:
        sig: list[Any] = [types[i]]
        if checkpoint is not None:
            for lin, m in layers[i].named_modules():
                if isinstance(m, torch.nn.Linear):
                    q = checkpoint.layouts.get(f"model.layers.{i}.{lin}")
                    sig.append((lin, None if q is None else q.net_form))
            for proj in ("gate_proj", "up_proj", "down_proj"):  # MoE experts: per expert
                for form in (f"0.{proj}", proj):  # (auto-round) or stacked (GGUF)
                    q = checkpoint.layouts.get(f"model.layers.{i}.mlp.experts.{form}")
                    sig.append((form, None if q is None else q.net_form))
        return tuple(sig)

    groups: dict[tuple, list[int]] = {}
    for i in range(len(layers)):
        groups.setdefault(signature(i), []).append(i)
    return {members[0]: members for members in groups.values()}


def add_checkpoint_tensors(store: WeightStore, specs: list[NetSpec], hf: Any,
                           checkpoint: Any, prefixes: dict[str, str]) -> None:
    """Put the checkpoint tensors of every quantized linear the nets read (layer 0 for
    per-layer nets) into the weight store next to the float weight, under the names
    `passes.quantize.checkpoint_key(weight, field)`: convert-top-to-tpu then uses them."""
    store[CHECKPOINT_MODEL] = np.ones(1, np.int8)
    hf_names = {id(p): n for n, p in hf.named_parameters()}
    for spec in specs:
        for top_name, p in spec.module.named_parameters():
            hf_name = hf_names.get(id(p), "")
            for weight, ql in _quantized_weights(checkpoint, prefixes[spec.name] + top_name,
                                                 hf_name):
                for fld, arr in _checkpoint_fields(ql).items():
                    store[checkpoint_key(weight, fld)] = arr


def _quantized_weights(checkpoint: Any, top_name: str, hf_name: str) -> list[tuple[str, Any]]:
    """The Top weights a model parameter gives the nets, with their quantized linears: a
    linear's weight; a MoE layer's fused `experts.gate_up_proj` the stacked gate and up
    projections (`…experts.gate_proj`, `…experts.up_proj`), its `experts.down_proj` itself,
    each from the checkpoint's per-expert linears (`QuantizedCheckpoint.stacked_experts`)."""
    if hf_name.endswith(".weight"):
        ql = checkpoint.linear(hf_name.removesuffix(".weight"))
        return [] if ql is None else [(top_name, ql)]
    pairs: list[tuple[str, str]] = []
    if hf_name.endswith("experts.gate_up_proj"):
        top_base, hf_base = top_name.rpartition(".")[0], hf_name.rpartition(".")[0]
        pairs = [(f"{top_base}.{p}", f"{hf_base}.{p}") for p in ("gate_proj", "up_proj")]
    elif hf_name.endswith("experts.down_proj"):
        pairs = [(top_name, hf_name)]
    found = [(top, checkpoint.stacked_experts(hf)) for top, hf in pairs]
    return [(top, ql) for top, ql in found if ql is not None]


def _checkpoint_fields(ql: Any) -> dict[str, np.ndarray]:
    out = {"qweight": ql.qweight, "scales": ql.scales,
           "meta": np.array([ql.bits, ql.group_size], np.int32)}
    if ql.mins is not None:
        out["mins"] = ql.mins
    else:
        out["zeros"] = ql.zeros
    if ql.g_idx is not None:
        out["g_idx"] = ql.g_idx
    return out
