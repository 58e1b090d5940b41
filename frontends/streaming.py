"""A float checkpoint compiled by streaming: the nets from a skeleton, every layer's weights
read from the shards when its chunk of the weight blob is made.

The nets are static per layer (`frontends.llm`): they are exported once, from layer 0, and
every layer binds its own tensors through the weight recipes. So the model never needs to
be in memory: `load_streaming` builds a *skeleton* — the transformers model on the meta
device, with

- layer 0 materialized in float32 from the checkpoint (the per-layer nets are exported and
  checked against it, and its recipes are checked against what the compiler stored) — but
  a MoE layer's stacked experts (3-D `…mlp.experts.gate_up_proj` / `…down_proj`: 3.2 GB in
  float32 at Qwen3.5-35B-A3B's 256 experts) are placeholders on zero pages like the
  embedding, derived from the checkpoint only when the layer's chunk is written (the nets'
  IR depends on their shape, not their values; `StreamedWeights.layer_placeholders`),
- the final norm and the rotary embedding real (small),
- the embedding and the lm_head as float32 *placeholders* of their real shape backed by
  untouched zero pages (`np.zeros`: the kernel maps them lazily, so they take no memory
  until written): the shared nets' IR depends on shapes, not values, and their tensors are
  derived from the checkpoint when the blob is written (`StreamedWeights.shared`), row block
  by row block, in the stored dtype until converted;
- every other layer left on the meta device.

`StreamedWeights` then gives each layer's tensors by the names the nets read (float32,
converted one tensor at a time from the stored dtype: exactly what `model.float()` of the
same checkpoint holds) and drops the shard pages it read (`CheckpointReader.release`), so
the resident set stays near one layer plus the largest shared tensor, whatever the layer
count.

A pre-quantized (GPTQ / AWQ / AutoRound) checkpoint streams the same way
(`load_prequantized_streaming`): its quantized linears are all checked when it is opened
(`quant.open_quantized_checkpoint`), the skeleton's real layers hold their
dequantized weights, and each layer's integers are read and unpacked when its chunk is
made (`QuantizedCheckpoint.linear`, through `layer_weights.StreamedLayerWeights`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import torch

from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader
from toptpu.dialects.sharding import base_name, parse_shard_name, piece_of
from toptpu.frontends.hf_loader import (
    LoadedModel,
    ModelDir,
    ModelLoadError,
    check_checkpoint,
    check_config,
    check_prequantized_shapes,
    expected_shapes,
    generation_settings,
    quiet_transformers,
    read_model_dir,
    tokenizer_files,
)
from toptpu.frontends.llm import LAYER_PREFIX, layer_key
from toptpu.frontends.moe import expert_tensor, has_expert_tensor, split_names, stacked_shapes
from toptpu.frontends.quant import (
    QuantizedCheckpoint,
    QuantizedCheckpointError,
    open_quantized_checkpoint,
)
from toptpu.passes.weight_recipe import WeightRecipe, derive_weights

BF16 = np.dtype(ml_dtypes.bfloat16)
#: a shared tensor is derived in row blocks of about this many elements
BLOCK_ELEMENTS = 8 * 2**20
#: the skeleton's modules whose weights are placeholders (checkpoint name prefixes)
PLACEHOLDER_MODULES = ("model.embed_tokens", "lm_head")


def load_streaming(path: str, need_tokenizer: bool = True) -> LoadedModel:
    """A checkpoint directory as a skeleton with its `StreamedWeights` (see the module doc);
    a pre-quantized one through `load_prequantized_streaming`."""
    d = read_model_dir(path)
    if d.prequantized:
        return load_prequantized_streaming(d, need_tokenizer)
    family = check_config(d.config, os.path.join(path, "config.json"))
    reader = _open_reader(path)
    check_checkpoint(d.config, path, {n: (t.shape, t.dtype) for n, t in reader.tensors.items()})
    files = tokenizer_files(path, need_tokenizer)
    model, placeholders = skeleton(d.config, lambda name: _f32(reader, name),
                                   expert_placeholders=True)
    stream = StreamedWeights(reader, placeholders, materialized={
        LAYER_PREFIX: model.model.layers[0]}, expert_placeholders=True)
    stream.layer_placeholders |= expert_top_names(model.model.layers[0], LAYER_PREFIX)
    return LoadedModel(model, family, files,
                       generation_settings(d.generation, d.config), path, stream=stream)


def load_prequantized_streaming(d: ModelDir, need_tokenizer: bool = True) -> LoadedModel:
    """A GPTQ / AWQ / AutoRound checkpoint directory as a skeleton whose layer 0 holds the
    exactly dequantized weights (`hf_loader.load_model` builds the whole model from the same),
    its every quantized linear checked up front (`quant.open_quantized_checkpoint`)
    and read, unpacked and let go one layer at a time when the blob is written. A checkpoint
    that quantizes a linear outside the decoder layers (a GPTQ ``lm_head: true``) is loaded
    whole: the embedding and lm_head placeholders stand for float tensors only."""
    from toptpu.frontends.hf_loader import load_model

    path, config = d.path, d.config
    reader = _open_reader(path)
    try:
        ck = open_quantized_checkpoint(path, reader)
    except QuantizedCheckpointError as e:
        raise ModelLoadError(str(e)) from e
    if any(not name.startswith("model.layers.") for name in ck.layouts):
        reader.close()
        return load_model(path, need_tokenizer=need_tokenizer)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    family = check_config(config, os.path.join(path, "config.json"))
    want, tied = expected_shapes(config)
    have, expert_problems = stacked_shapes(ck.state_shapes())
    if expert_problems:
        reader.close()
        raise ModelLoadError(f"the {ck.quant_method} checkpoint in {path} does not hold its "
                             "MoE experts whole: " + "; ".join(expert_problems))
    check_prequantized_shapes(have, want, tied, ck.quant_method, path)
    files = tokenizer_files(path, need_tokenizer)
    stream = StreamedWeights(reader, {}, checkpoint=ck)
    model, stream.placeholders = skeleton(config, stream.tensor_f32)
    stream.materialized[LAYER_PREFIX] = model.model.layers[0]
    dtype = d.raw.get("torch_dtype") or d.raw.get("dtype")
    return LoadedModel(model, family, files, generation_settings(d.generation, config), path,
                       checkpoint=ck, checkpoint_dtype=str(dtype) if dtype else None,
                       stream=stream)


def _open_reader(path: str) -> CheckpointReader:
    try:
        return CheckpointReader.open(path)
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e


def layer_tensor_name(layer: int, key: str) -> str:
    """'self_attn.q_proj.weight' of layer 3 -> the checkpoint's
    'model.layers.3.self_attn.q_proj.weight'."""
    return f"model.layers.{layer}.{key}"


class TensorReader(Protocol):
    """What the streamed weights read tensors from: a `CheckpointReader`, or a GGUF file's
    `GGUFTensors`."""

    def __contains__(self, name: str) -> bool: ...

    def tensor(self, name: str) -> np.ndarray: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


def has_tensor(reader: TensorReader, name: str) -> bool:
    """The checkpoint holds `name`, or (a MoE layer's stacked experts,
    '…mlp.experts.gate_proj') the tensors it is made of (`frontends.moe.expert_tensor`)."""
    return has_expert_tensor(name, reader.__contains__)


def _f32(reader: TensorReader, name: str) -> np.ndarray:
    """One checkpoint tensor converted to float32 (a copy; the stored dtype is read once,
    and its pages are dropped from the resident set right after). A MoE layer's stacked
    experts ('…mlp.experts.gate_proj' [E, I, H] ..., '…gate_up_proj' [E, 2I, H]) stored
    otherwise (fused, or one tensor per expert and projection) are made from those, one at a
    time (`frontends.moe.expert_tensor`)."""
    if name not in reader:
        stacked = expert_tensor(name, reader.__contains__, lambda part: _f32(reader, part))
        if stacked is not None:
            return stacked
    try:
        out = to_f32(reader.tensor(name))
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e
    reader.release()
    return out


def to_f32(stored: np.ndarray) -> np.ndarray:
    """A stored tensor as float32, exactly (bf16 by moving its bits into the high half of a
    float32: what every bf16 -> f32 conversion does, ~5x faster than a ml_dtypes cast)."""
    if stored.dtype == BF16:
        return (stored.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(stored, dtype=np.float32).copy() if stored.dtype == np.float32 \
        else np.asarray(stored, dtype=np.float32)


def skeleton(config: Any, tensor_f32: Callable[[str], np.ndarray], tied: bool | None = None,
             build: Callable[[Any], Any] | None = None, expert_placeholders: bool = False
             ) -> tuple[Any, dict[int, str]]:
    """The skeleton model (see the module doc), its real tensors from `tensor_f32`
    (checkpoint name -> float32), and its placeholders: id(parameter) -> the checkpoint
    tensor it stands for. `tied`: the lm_head is the embedding (default: the config's
    tie_word_embeddings; a VLM's own config decides for its text model). `build`: makes
    the causal LM of `config` (default transformers' `AutoModelForCausalLM`; a VLM's text
    model without such a class has a view of its own), on the meta device.
    `expert_placeholders`: layer 0's stacked experts are placeholders too (`is_stacked_
    experts`)."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), torch.device("meta"):
        model = build(config) if build is not None else AutoModelForCausalLM.from_config(
            config, dtype=torch.float32)
    inner = model.model
    placeholders: dict[int, str] = {}
    materialize_layer(model, 0, tensor_f32, placeholders if expert_placeholders else None)
    norm = inner.norm.to_empty(device="cpu")
    for name, p in norm.named_parameters():
        p.data = torch.from_numpy(tensor_f32(f"model.norm.{name}"))
    inner.rotary_emb = type(inner.rotary_emb)(config=config)
    embed = _placeholder(inner.embed_tokens.weight.shape)
    inner.embed_tokens.weight = embed
    placeholders[id(embed)] = "model.embed_tokens.weight"
    if getattr(config, "tie_word_embeddings", False) if tied is None else tied:
        model.lm_head.weight = embed
    else:
        head = _placeholder(model.lm_head.weight.shape)
        model.lm_head.weight = head
        placeholders[id(head)] = "lm_head.weight"
    if model.lm_head.bias is not None:
        raise ModelLoadError("an lm_head with a bias is not supported by the streaming "
                             "compile")
    return model.eval(), placeholders


def materialize_layer(model: Any, layer: int, tensor_f32: Callable[[str], np.ndarray],
                      placeholders: dict[int, str] | None = None) -> torch.nn.Module:
    """The skeleton's decoder layer `layer` made real in float32 from `tensor_f32`; with
    `placeholders` (id(parameter) -> checkpoint name, added to), its stacked experts are
    placeholders on zero pages instead (`is_stacked_experts`)."""
    mod = model.model.layers[layer].to_empty(device="cpu")
    if any(True for _ in mod.buffers()):
        raise ModelLoadError(f"{type(mod).__name__} has buffers, which the streaming "
                             "compile cannot rebuild from the checkpoint")
    for name, p in mod.named_parameters():
        if placeholders is not None and is_stacked_experts(name, p):
            p.data = torch.from_numpy(np.zeros(tuple(p.shape), np.float32))
            placeholders[id(p)] = layer_tensor_name(layer, name)
            continue
        p.data = torch.from_numpy(tensor_f32(layer_tensor_name(layer, name)))
    return mod


def is_stacked_experts(name: str, param: torch.nn.Parameter) -> bool:
    """A decoder layer's parameter `name` is a MoE block's experts stacked in one 3-D tensor
    (transformers 5's fused '…mlp.experts.gate_up_proj' [E, 2I, H], '…experts.down_proj')."""
    base, _, last = name.rpartition(".")
    return param.dim() == 3 and (base == "experts" or base.endswith(".experts")) \
        and last in ("gate_up_proj", "down_proj")


def expert_top_names(layer: torch.nn.Module, prefix: str) -> set[str]:
    """The Top weight names the per-layer nets give `layer`'s stacked experts (its
    parameters under `prefix`, 'layer.'), and the gate and up halves the importer makes
    of a fused gate|up (`frontends.moe.split_names`)."""
    names = set()
    for name, p in layer.named_parameters():
        if is_stacked_experts(name, p):
            names.add(prefix + name)
            halves = split_names(prefix + name)
            names.update(halves or ())
    return names


def _placeholder(shape: torch.Size) -> torch.nn.Parameter:
    """A float32 parameter of `shape` on zero pages nobody writes (no resident memory)."""
    return torch.nn.Parameter(torch.from_numpy(np.zeros(tuple(shape), np.float32)),
                              requires_grad=False)


@dataclass
class StreamedWeights:
    """The tensors of a checkpoint as the compiler asks for them: a layer's by the Top
    names of the per-layer nets, the shared ones of placeholders by recipe."""

    reader: TensorReader
    #: id(skeleton parameter) -> checkpoint tensor name, for the placeholders
    placeholders: dict[int, str]
    #: Top weight name of a shared net -> checkpoint tensor name (`bind_shared`)
    shared_sources: dict[str, str] = field(default_factory=dict)
    #: a pre-quantized checkpoint (`quant.open_quantized_checkpoint`): its
    #: quantized linears' float weights are their dequantized integers
    checkpoint: QuantizedCheckpoint | None = None
    #: the skeleton's real decoder layers by the Top name prefix of their weights (layer 0:
    #: 'layer.'; a layer variant's representative: 'v3.layer.'), until the nets are compiled
    materialized: dict[str, torch.nn.Module] = field(default_factory=dict)
    #: the skeleton's real layers hold their stacked experts as placeholders
    #: (`materialize_layer`): the Top names of those (and of what the importer makes of
    #: them), whose compile-time tensors are zeros and are derived per layer when written
    expert_placeholders: bool = False
    layer_placeholders: set[str] = field(default_factory=set)

    def tensor_f32(self, name: str) -> np.ndarray:
        """The checkpoint tensor `name` in float32; a quantized linear's 'weight' dequantized
        (`QuantizedLinear.dequantize`: what the in-memory path's model holds)."""
        module = name.removesuffix(".weight")
        if self.checkpoint is not None and name.endswith(".weight") \
                and module in self.checkpoint.layouts:
            try:
                linear = self.checkpoint.linear(module)
            except QuantizedCheckpointError as e:
                raise ModelLoadError(str(e)) from e
            assert linear is not None
            out = linear.dequantize()
            self.reader.release()
            return out
        if self.checkpoint is not None and name not in self.reader:
            # a MoE layer's experts, quantized one linear per expert ('…experts.E.up_proj')
            stacked = expert_tensor(name, self._has, self.tensor_f32)
            if stacked is not None:
                return stacked
        return _f32(self.reader, name)

    def _has(self, name: str) -> bool:
        """The checkpoint holds `name`: a stored tensor or a quantized linear's weight."""
        return name in self.reader or (
            self.checkpoint is not None and name.endswith(".weight")
            and name.removesuffix(".weight") in self.checkpoint.layouts)

    def materialize(self, model: Any, layer: int, weight_prefix: str) -> None:
        """Make the skeleton's layer `layer` real (a layer variant's representative, whose
        nets are exported from it); its weights are named `weight_prefix` + 'layer.…'."""
        self.materialized[weight_prefix + LAYER_PREFIX] = mod = materialize_layer(
            model, layer, self.tensor_f32,
            self.placeholders if self.expert_placeholders else None)
        if self.expert_placeholders:
            self.layer_placeholders |= expert_top_names(mod, weight_prefix + LAYER_PREFIX)

    # ------------------------------------------------------------------ layers
    def float_of(self, layer: int) -> Callable[[str], np.ndarray]:
        """Top weight name ('layer.…') -> layer `layer`'s tensor in float32."""
        last: dict[str, np.ndarray] = {}

        def get(source: str) -> np.ndarray:
            key = layer_key(source)
            if key is None:
                raise ModelLoadError(f"'{source}' is not a per-layer weight")
            name = layer_tensor_name(layer, key)
            if not has_expert_tensor(name, self._has):
                raise ModelLoadError(f"the checkpoint has no '{name}' (the per-layer nets read "
                                     f"'{source}'): its layers are not all alike")
            if name not in last:  # the quantized parts of one weight ask for it in a row
                last.clear()
                last[name] = self.tensor_f32(name)
            return last[name]

        return get

    def release(self) -> None:
        """Drop the shard pages read so far from the resident set."""
        self.reader.release()

    def free_layers(self) -> list[str]:
        """Once the per-layer nets are compiled: let the skeleton's float32 layers go (layer 0
        and any representative; their tensors are empty afterwards); the Top names of their
        parameters, which the caller's weight store holds too."""
        names = []
        for prefix, module in self.materialized.items():
            names += [prefix + n for n, _ in module.named_parameters()]
            for p in module.parameters():
                p.data = torch.empty(0)
        self.materialized.clear()
        return names

    def fill_placeholders(self, model: torch.nn.Module) -> None:
        """Give the skeleton's placeholders their checkpoint tensors in float32 (what the
        in-memory path's model holds): for a compile whose weight store is written out with
        its IR (`--dump-ir`), so every dumped module names true tensors. Memory: the shared
        tensors whole."""
        for p in model.parameters():
            name = self.placeholders.get(id(p))
            if name is not None:
                p.data = torch.from_numpy(self.tensor_f32(name))

    # ------------------------------------------------------------------ shared tensors
    def bind_shared(self, module: torch.nn.Module, weight_prefix: str = "") -> None:
        """Record which Top weights of a shared net's `module` are placeholders (by the
        parameter names the importer gives them)."""
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.placeholders:
                self.shared_sources[weight_prefix + name] = self.placeholders[id(p)]

    def is_placeholder(self, source: str) -> bool:
        """`source` (a Top weight name, or a shard weight's cut from one) stands for a
        placeholder."""
        return base_name(source) in self.shared_sources

    def placeholder_of(self, source: str) -> str:
        """The checkpoint tensor a placeholder source (or a shard of one) stands for."""
        return self.shared_sources[base_name(source)]

    def from_placeholder(self, name: str, layers: bool = True) -> bool:
        """`name` (a weight-store tensor) is a placeholder (shared, or with `layers` a
        layer's stacked experts) or derived from one by a pass: the passes name what they
        derive from `W` `W:…`, `W.…`, `W#…` or `W@…` (a shard)."""
        sources = (*self.shared_sources, *self.layer_placeholders) if layers \
            else self.shared_sources
        return any(name == src or name.startswith((f"{src}:", f"{src}.", f"{src}#",
                                                   f"{src}@"))
                   for src in sources)

    def shared(self, recipes: Iterable[WeightRecipe], device: int = 0, devices: int = 1
               ) -> dict[str, np.ndarray]:
        """The tensors of `recipes` (all of one placeholder source) from the checkpoint,
        derived in row blocks: a block of rows converted to float32 at a time. A shard
        source (`W@shard0-<pieces>`, the lm_head cut by vocabulary) gives device `device`'s
        rows of `devices`."""
        recipes = list(recipes)
        sources = {r.source for r in recipes}
        if len(sources) != 1:
            raise ValueError(f"recipes of one source expected, got {sorted(sources)}")
        source = sources.pop()
        name = self.placeholder_of(source)
        try:
            stored = self.reader.tensor(name)
        except CheckpointError as e:
            raise ModelLoadError(str(e)) from e
        cut = parse_shard_name(source)
        if cut is not None:
            split = cut[1]
            if split.axis != 0 or stored.shape[0] % split.pieces:
                raise ModelLoadError(f"'{source}': a streamed shared tensor is cut by rows "
                                     "only")
            rows = stored.shape[0] // split.pieces
            k = piece_of(device, devices, split.pieces)
            stored = stored[k * rows:(k + 1) * rows]
        out = {r.name: np.empty(r.shape, r.dtype) for r in recipes}
        for rows in _row_blocks(stored.shape):
            block = to_f32(stored[rows])
            self.reader.release()
            n = block.shape[0]
            parts = derive_weights([_block_recipe(r, n) for r in recipes],
                                   functools.partial(_the_block, block))
            for r in recipes:
                target = out[r.name]
                if r.part.transposed:
                    target[:, rows] = parts[r.name]
                else:
                    target[rows] = parts[r.name]
        self.reader.release()
        return out


def _row_blocks(shape: tuple[int, ...]) -> Iterator[slice]:
    row = math.prod(shape[1:])
    step = max(1, BLOCK_ELEMENTS // max(row, 1))
    for start in range(0, shape[0], step):
        yield slice(start, min(start + step, shape[0]))


def _the_block(block: np.ndarray, _source: str) -> np.ndarray:
    """`derive_weights`' float tensor of every source: the rows block being derived."""
    return block


def _block_recipe(r: WeightRecipe, rows: int) -> WeightRecipe:
    """`r` for a block of `rows` rows of its source: the rows are the output's first axis,
    or its second when it is stored transposed."""
    if len(r.shape) != 2:
        raise ValueError(f"'{r.name}': only 2-D shared tensors are derived in blocks")
    shape = (r.shape[0], rows) if r.part.transposed else (rows, r.shape[1])
    return replace(r, shape=shape)
