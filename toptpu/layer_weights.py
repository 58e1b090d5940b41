"""Where each layer's tensors come from when the compiler fills its chunk of the weight blob.

The per-layer nets are compiled once, from layer 0 (or a layer variant's representative);
every other layer binds its own tensors to them, derived by the nets' weight recipes
(`toptpu.passes.weight_recipe`) from that layer's float weights and, for a pre-quantized
checkpoint, its integers and scales. A `LayerWeights` gives those per layer, by the Top
weight names the nets read ('layer.self_attn.q_proj.weight'); `ModelLayerWeights` reads
them from an in-memory transformers model (zero-copy); `frontends.streaming.StreamedWeights`
reads them from the checkpoint's shards, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from toptpu.compile_options import CompileError
from toptpu.dialects.weight_store import _torch_to_numpy
from toptpu.frontends.llm import layer_key
from toptpu.frontends.moe import expert_tensor
from toptpu.frontends.quant import QuantizedCheckpointError
from toptpu.passes.quantize import QuantizationError, checkpoint_parts

#: Top weight name -> a layer's float tensor
FloatOf = Callable[[str], np.ndarray]
#: Top weight name -> a layer's checkpoint parts as the lowering packs them (None: float)
CheckpointOf = Callable[[str], "dict[str, np.ndarray] | None"]

class LayerWeights(Protocol):
    """The tensors of each decoder layer, by the names the per-layer nets read."""

    def float_of(self, layer: int) -> FloatOf: ...

    def checkpoint_of(self, layer: int) -> CheckpointOf | None: ...


class ModelLayerWeights:
    """A transformers causal LM's layers (`model.model.layers`) and, for a pre-quantized
    model, its checkpoint's quantized linears (`frontends.quant`)."""

    def __init__(self, model: Any, checkpoint: Any = None) -> None:
        self.model, self.checkpoint = model, checkpoint

    def float_of(self, layer: int) -> FloatOf:
        return float_of_layer(self.model, layer)

    def checkpoint_of(self, layer: int) -> CheckpointOf | None:
        return None if self.checkpoint is None else checkpoint_of_layer(self.checkpoint, layer)


class StreamedLayerWeights:
    """A streamed checkpoint's layers (`frontends.streaming.StreamedWeights`, read from the
    shards) and, for a pre-quantized one, its quantized linears, each read and unpacked when
    its layer's chunk is made."""

    def __init__(self, stream: Any, checkpoint: Any = None) -> None:
        self.stream, self.checkpoint = stream, checkpoint

    def float_of(self, layer: int) -> FloatOf:
        return self.stream.float_of(layer)

    def checkpoint_of(self, layer: int) -> CheckpointOf | None:
        return None if self.checkpoint is None else checkpoint_of_layer(self.checkpoint, layer)


def float_of_layer(model: Any, layer: int) -> FloatOf:
    """Top weight name ('layer.…') -> layer `layer`'s float tensor (zero-copy)."""
    mod = model.model.layers[layer]
    state = dict(mod.named_parameters())
    state.update(dict(mod.named_buffers()))

    def get(source: str) -> np.ndarray:
        key = layer_key(source)
        if key is None:
            raise CompileError(f"'{source}' is not a per-layer weight")
        if key not in state:
            stacked = expert_tensor(key, state.__contains__,
                                    lambda k: _torch_to_numpy(state[k]))
            if stacked is not None:  # a MoE layer's experts stacked as the nets read them
                return stacked
            raise CompileError(f"layer {layer} has no tensor '{key}' (the net reads "
                               f"'{source}'); its layers are not all alike")
        return _torch_to_numpy(state[key])

    return get


def checkpoint_of_layer(checkpoint: Any, layer: int) -> CheckpointOf:
    """Top weight name ('layer.…weight') -> that layer's checkpoint parts, as the lowering
    packs them (`passes.quantize.checkpoint_parts`)."""

    def get(source: str) -> dict[str, np.ndarray] | None:
        key = layer_key(source)
        if key is None:
            return None
        name = f"model.layers.{layer}.{key}".removesuffix(".weight")
        try:
            ql = checkpoint.linear(name)
            if ql is None:  # a MoE layer's stacked experts ('…experts.gate_proj'), or float
                ql = checkpoint.stacked_experts(name)
            if ql is None:
                return None
            return checkpoint_parts(ql.qweight, ql.scales, ql.zeros, ql.g_idx, ql.bits,
                                    ql.group_size, name, ql.mins)
        except (QuantizationError, QuantizedCheckpointError) as e:
            raise CompileError(str(e)) from e

    return get
