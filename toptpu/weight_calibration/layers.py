"""What the calibration knows of a decoder layer, and where the layers come from.

`LayerPlan`: a layer kind's linears in GPTQ's sequential order (`stages`: the linears that
read one input, quantized together before the next stage's inputs are taken) and AWQ's
scaling groups (`ScalingGroup`: the linears whose input channels are scaled, the norm or
linear whose output channels absorb the inverse scale, and the module whose output the
scale search compares). A layer with a linear no plan names is refused. A mixture-of-experts
layer (Qwen3-MoE, Qwen2-MoE) has its attention's stages, its shared expert's (Qwen2-MoE:
`shared_expert` gate/up with `shared_expert_gate`, then down) and its fused routed experts
(`LayerPlan.experts`, calibrated per expert by `experts`); the router stays float.

`LayerRunner` runs one real float32 decoder layer (`frontends.hf_layers.DecoderLayerWithRope`:
the layer with its rotary embedding and an explicit causal mask, as the compiler exports it;
a linear-attention layer from a zero state) on a batch of calibration sequences, and the
modules inside it (`call`).

`ModelLayers` / `StreamedLayers` give the layers one at a time: from a transformers model in
memory (each layer copied: calibration changes weights) or from a float checkpoint directory
or GGUF file read one layer at a time (`frontends.streaming`): the embedding rows of the
calibration tokens, then one layer materialized in float32, calibrated, and let go.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from toptpu.frontends.gguf_loader import gguf_file_of, load_gguf
from toptpu.frontends.hf_layers import DecoderLayerWithRope, causal_mask
from toptpu.frontends.hf_loader import LoadedModel
from toptpu.frontends.streaming import load_streaming, materialize_layer, to_f32
from toptpu.weight_calibration.activations import LayerInputs
from toptpu.weight_calibration.experts import EXPERTS, MOE_BLOCK, expert_shapes, fused_experts
from toptpu.weight_calibration.grid import CalibrationError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ScalingGroup:
    """AWQ: `linears` (reading one input) scaled per input channel by s, `prev` (a norm, or a
    linear whose last output rows feed them) divided by s; `inspect` is the module (a path in
    the layer; "" the whole layer) whose output error the scale search minimizes."""

    prev: str
    linears: tuple[str, ...]
    inspect: str
    #: modules reading the same input whose weights take s too but stay float (a MoE
    #: layer's router and Qwen2-MoE's shared-expert gate: their outputs stay as they were)
    float_scaled: tuple[str, ...] = ()
    #: the module whose inputs the linears read, where not the first linear's stage (a MoE
    #: layer's "mlp"; "mlp.experts.E.down_proj" for one routed expert's down)
    inputs: str = ""


@dataclass(frozen=True)
class LayerPlan:
    kind: str
    #: GPTQ's sequential stages: the linears of one input, in the order the layer runs them
    stages: tuple[tuple[str, ...], ...]
    scaling: tuple[ScalingGroup, ...]
    #: the path of the layer's fused routed experts (`experts`), None without them
    experts: str | None = None

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for stage in self.stages for name in stage)


_MLP_STAGES = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
_MLP_SCALING = (ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
                ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))

PLANS: dict[str, LayerPlan] = {
    FULL_ATTENTION: LayerPlan(
        FULL_ATTENTION,
        (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         *_MLP_STAGES),
        (ScalingGroup("input_layernorm",
                      ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
         # AutoAWQ scales v -> o only where v's outputs are o's inputs one to one (no GQA)
         ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
         *_MLP_SCALING)),
    LINEAR_ATTENTION: LayerPlan(
        LINEAR_ATTENTION,
        (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
          "linear_attn.in_proj_a"), ("linear_attn.out_proj",), *_MLP_STAGES),
        (ScalingGroup("input_layernorm", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                                          "linear_attn.in_proj_b", "linear_attn.in_proj_a"), ""),
         *_MLP_SCALING)),
}


_SHARED_EXPERT_STAGES = (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                          "mlp.shared_expert_gate"), ("mlp.shared_expert.down_proj",))


def _moe_scaling(layer: torch.nn.Module) -> tuple[ScalingGroup, ...]:
    """AWQ's scaling groups of a MoE layer's MLP (`awq` module doc): one scale for every
    routed expert's gate/up and the shared expert's, folded into post_attention_layernorm,
    the router (and the shared expert's gate) scaled with them and left float, the whole
    MoE block inspected; then each expert's down scaled with its up as the previous op,
    on that expert's routed tokens; the shared expert's down likewise on every token."""
    n_experts = expert_shapes(layer.get_submodule(EXPERTS))[0]
    shared = hasattr(layer.mlp, "shared_expert")
    gate_up = tuple(f"{EXPERTS}.{e}.{p}" for e in range(n_experts)
                    for p in ("gate_proj", "up_proj"))
    shared_gate_up = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj") if shared \
        else ()
    router = ("mlp.gate", "mlp.shared_expert_gate") if shared else ("mlp.gate",)
    groups = [ScalingGroup("post_attention_layernorm", gate_up + shared_gate_up, MOE_BLOCK,
                           router, MOE_BLOCK)]
    for e in range(n_experts):
        down = f"{EXPERTS}.{e}.down_proj"
        groups.append(ScalingGroup(f"{EXPERTS}.{e}.up_proj", (down,), down, (), down))
    if shared:
        groups.append(ScalingGroup("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",),
                                   "mlp.shared_expert.down_proj"))
    return tuple(groups)


def _moe_plan(plan: LayerPlan, layer: torch.nn.Module) -> LayerPlan:
    """`plan` for a layer whose MLP is a mixture of experts: the attention's stages, the
    shared expert's if it has one, and the fused experts; AWQ's scaling groups of the
    attention and of the MoE block (`_moe_scaling`)."""
    attention = plan.stages[:-len(_MLP_STAGES)]
    shared = _SHARED_EXPERT_STAGES if hasattr(layer.mlp, "shared_expert") else ()
    scaling = tuple(g for g in plan.scaling if g not in _MLP_SCALING)
    return LayerPlan(plan.kind, (*attention, *shared), (*scaling, *_moe_scaling(layer)),
                     EXPERTS)


def layer_plan(layer: torch.nn.Module, kind: str, where: str) -> LayerPlan:
    """The plan of `layer` (of kind `kind`), checked: every linear it names exists, and the
    layer has no linear it does not name."""
    plan = PLANS.get(kind)
    if plan is None:
        raise CalibrationError(f"{where}: layers of kind '{kind}' cannot be calibrated")
    if fused_experts(layer) is not None:
        plan = _moe_plan(plan, layer)
    linears = {name for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted(linears - set(plan.linears))
    if unknown:
        listed = ", ".join(unknown[:4]) + (" ..." if len(unknown) > 4 else "")
        raise CalibrationError(f"{where}: linears the calibration does not know ({listed})")
    missing = sorted(set(plan.linears) - linears)
    if missing:
        raise CalibrationError(f"{where}: no {', '.join(missing)} in this {kind} layer")
    return plan


class _InputsSeen(Exception):
    """Stops a forward once a module's inputs have been seen (`LayerRunner.see_inputs`)."""


class LayerRunner:
    """One real decoder layer on calibration sequences of `length` tokens (module doc).

    A forward batch holds whole sequences: at most `batch_tokens` tokens, and at most
    `batch_bytes` of the layer's activations (4 bytes for each output of each linear and
    four hidden states per token): two 512-token sequences at Qwen2.5-7B's widths, sixteen
    256-token ones at SmolLM2-135M's."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module, kind: str,
                 length: int, batch_tokens: int, batch_bytes: int = 1 << 28) -> None:
        self.layer, self.kind = layer, kind
        self.block = DecoderLayerWithRope(layer, rotary).eval()
        self.mask = causal_mask(length)
        self.position_ids = torch.arange(length, dtype=torch.int64)[None]
        widths = sum(m.out_features for m in layer.modules() if isinstance(m, torch.nn.Linear))
        hidden = next((m.in_features for m in layer.modules()
                       if isinstance(m, torch.nn.Linear)), 0)
        per_token = 4 * (widths + 4 * hidden)
        fit = max(1, min(batch_tokens, batch_bytes // max(per_token, 1)) // length)
        #: sequences per batch (a linear-attention layer runs one sequence at a time)
        self.batch = 1 if kind == LINEAR_ATTENTION else fit
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def batches(self, n: int) -> Iterator[slice]:
        for start in range(0, n, self.batch):
            yield slice(start, min(start + self.batch, n))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on `x` [B, L, H]."""
        if self.kind == LINEAR_ATTENTION and x.shape[0] != 1:
            return torch.cat([self.forward(x[i:i + 1]) for i in range(x.shape[0])])
        return self.block(x, self.position_ids, self.mask)

    def see_inputs(self, module: torch.nn.Module, x: LayerInputs,
                   see: Callable[..., None], with_kwargs: bool = False) -> None:
        """Call `see` (a forward pre-hook's signature) with `module`'s inputs in each batch of
        `x`, every batch's forward stopped there."""

        def hook(*args: Any) -> None:
            see(*args)
            raise _InputsSeen

        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        try:
            for b in self.batches(x.shape[0]):
                try:
                    self.forward(x.read(b))
                except _InputsSeen:
                    pass
        finally:
            handle.remove()

    def rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's (cos, sin) at the sequence's positions (made once)."""
        if self._rope is None:
            self._rope = self.block.rotary(x[:1], self.position_ids)
        return self._rope

    @torch.no_grad()
    def call(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """The output of the module `path` of the layer ("" the layer itself) on its input."""
        if path == "":
            return self.forward(x)
        if path == "self_attn":
            attention = self.layer.get_submodule("self_attn")
            out = attention(hidden_states=x, position_embeddings=self.rope(x),
                            attention_mask=self.mask)
            return out[0] if isinstance(out, tuple) else out
        return self.layer.get_submodule(path)(x)


class LayerSource(Protocol):
    """The decoder layers of a float model, one at a time (module doc)."""

    config: Any
    num_layers: int
    rotary: torch.nn.Module

    def embed(self, tokens: np.ndarray) -> torch.Tensor: ...

    def layer(self, index: int) -> torch.nn.Module: ...

    def release(self, index: int) -> None: ...

    def layer_type(self, index: int) -> str: ...


def _layer_types(config: Any, n: int) -> list[str]:
    return list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * n)


def _use_sdpa(config: Any) -> None:
    config._attn_implementation = "sdpa"
    text = getattr(config, "text_config", None)
    if text is not None:
        text._attn_implementation = "sdpa"


class ModelLayers:
    """The layers of a float32 transformers causal LM in memory (each one copied when asked
    for: calibration changes the copy's weights, never the model's)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        _use_sdpa(self.config)
        self.num_layers = len(model.model.layers)
        self.rotary = model.model.rotary_emb
        self.types = _layer_types(self.config, self.num_layers)

    @torch.no_grad()
    def embed(self, tokens: np.ndarray) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.from_numpy(tokens)).float()

    def layer(self, index: int) -> torch.nn.Module:
        return copy.deepcopy(self.model.model.layers[index]).float().eval()

    def release(self, index: int) -> None:
        pass

    def layer_type(self, index: int) -> str:
        return self.types[index]


class StreamedLayers:
    """The layers of a streamed float checkpoint (`LoadedModel` with a `stream`, as
    `frontends.streaming.load_streaming` or `frontends.gguf_loader.load_gguf` make it): each
    materialized in float32 from the checkpoint when asked for and put back on the meta
    device when released."""

    def __init__(self, loaded: LoadedModel) -> None:
        if loaded.stream is None or loaded.checkpoint is not None:
            raise CalibrationError(f"{loaded.source} is not a float checkpoint read by streaming")
        self.loaded = loaded
        self.model = loaded.model
        self.config = self.model.config
        _use_sdpa(self.config)
        self.num_layers = len(self.model.model.layers)
        self.rotary = self.model.model.rotary_emb
        self.types = _layer_types(self.config, self.num_layers)

    def embed(self, tokens: np.ndarray) -> torch.Tensor:
        """The embedding rows of `tokens` [n, L] -> [n, L, H] float32 (only the rows used
        are converted)."""
        stream = self.loaded.stream
        name = "model.embed_tokens.weight"
        stored = stream.reader.tensor(name)
        ids, inverse = np.unique(tokens, return_inverse=True)
        if ids.size and (ids[0] < 0 or ids[-1] >= stored.shape[0]):
            raise CalibrationError(f"token id {int(ids[-1])} is outside the embedding of "
                                   f"{stored.shape[0]} rows: the tokenizer and the model differ")
        rows = to_f32(np.asarray(stored[ids]))
        stream.release()
        return torch.from_numpy(rows[inverse.reshape(tokens.shape)])

    def layer(self, index: int) -> torch.nn.Module:
        return materialize_layer(self.model, index, self.loaded.stream.tensor_f32).eval()

    def release(self, index: int) -> None:
        self.model.model.layers[index].to_empty(device="meta")
        self.loaded.stream.release()

    def layer_type(self, index: int) -> str:
        return self.types[index]


def open_layers(model: Any, dequantize: str | None = "f32") -> LayerSource:
    """The layers of `model`: a float checkpoint directory or GGUF file (streamed), a
    streamed `LoadedModel`, or a transformers causal LM in memory. A GGUF file's quantized
    tensors are dequantized when `dequantize` names a mode (None: such a file is refused,
    as the compile refuses it without --dequantize)."""
    if isinstance(model, str | os.PathLike):
        path = os.fspath(model)
        if gguf_file_of(path) is not None:
            loaded = load_gguf(path, dequantize="f32" if dequantize else None)
            if loaded.checkpoint is not None:
                types = sorted({layout.source for layout in
                                loaded.checkpoint.layouts.values()})
                raise CalibrationError(
                    f"{path} holds quantized linears ({', '.join(types)}); "
                    "calibration starts from float weights: add --dequantize with the mode "
                    "to calibrate their dequantized values")
            return StreamedLayers(loaded)
        loaded = load_streaming(path)
        if loaded.checkpoint is not None:
            raise CalibrationError(f"{path} is already quantized ({loaded.checkpoint.quant_method}"
                                   "); calibration starts from a float checkpoint")
        return StreamedLayers(loaded)
    if isinstance(model, LoadedModel):
        return StreamedLayers(model)
    return ModelLayers(model)
