"""The text nets of a model file and the static shapes read back from them.

Nothing is configured twice: the KV capacity SEQ, the longest prefill chunk L, the history a
prefill chunk attends to Hh, the prefill chunk lengths (`block:16`, ...), the position axes
and sample_head's K are the nets' IO shapes (`toptpu.backend.contract`). Which net a layer
runs (a variant `block@3` for a layer of another kind or quantization) is the header's
`layer_nets`.
"""

from __future__ import annotations

from collections.abc import Mapping

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HIDDEN,
    HISTORY_K,
    LINEAR_ATTENTION,
    LM_HEAD,
    PER_LAYER_NETS,
    POSITION_IDS,
    PREFILL_NETS,
    PROBS,
    SAMPLE_HEAD,
    TEXT_NETS,
    NetInfo,
    NetName,
    TensorSpec,
)
from toptpu.backend.formats.llm_file import LlmHeader
from toptpu.backend.runtime.errors import GenerationError


class TextNets:
    """A model file's text nets, their static shapes and the net each layer runs."""

    def __init__(self, nets: Mapping[str, NetInfo], meta: LlmHeader) -> None:
        missing = [n for n in TEXT_NETS if n not in nets]
        if missing:
            raise GenerationError(f"the model file lacks the nets {missing}; recompile it")
        self.infos = dict(nets)
        self.layer_nets = meta.layer_nets
        self.num_layers = meta.model.num_layers
        #: which layers have a linear-attention state instead of a KV cache
        self.linear = [meta.model.layer_type(i) == LINEAR_ATTENTION
                       for i in range(self.num_layers)]
        #: the nets of the first full-attention layer: the KV shapes are read from them
        first = self.linear.index(False)
        self.attn_nets = {base: self.layer_net(base, first) for base in PER_LAYER_NETS}
        #: the longest prefill chunk
        self.L = self.spec(BLOCK, HIDDEN).shape[1]
        #: prefill chunk length -> the length tag of its nets (`block:16`: 16; L: 0), read
        #: back from the `block` nets' shapes; a chunk runs the shortest that holds it
        self.prefill_tags = {self.spec(name, HIDDEN).shape[1]: net.length
                             for name in nets for net in [NetName.parse(name)]
                             if net.base == BLOCK and not net.is_variant}
        self.lengths = sorted(self.prefill_tags)
        for length, tag in self.prefill_tags.items():
            for base in PREFILL_NETS:
                name = str(NetName(base, 0, tag))
                if name not in nets:
                    raise GenerationError(f"the model file has block at length {length} but "
                                          f"no {name}; recompile it")
        #: rows of position_ids: 1 (the cache slot), or 3 (T, H, W: a rotary per axis)
        self.position_axes = self.spec(self.attn_nets[BLOCK], POSITION_IDS).shape[0]
        #: the KV capacity (tokens)
        self.seq = self.spec(self.attn_nets[BLOCK_CACHE], HISTORY_K).shape[1]
        #: the history a prefill chunk attends to (`block_kv`)
        self.Hh = self.spec(self.attn_nets[BLOCK_KV], HISTORY_K).shape[1]
        #: sample_head's candidates
        self.sample_k = self.spec(SAMPLE_HEAD, PROBS).shape[1]
        #: the batch B of the batch nets (`block_cache.b4`: a decode step of B
        #: conversations; `toptpu compile --batch`), 1 without
        self.batch = max((NetName.parse(name).batch for name in nets), default=0) or 1

    def spec(self, net: str, name: str) -> TensorSpec:
        """The tensor `name` of `net` (an input or an output)."""
        info = self.infos[net]
        for s in (*info.inputs, *info.outputs):
            if s.name == name:
                return s
        raise GenerationError(f"net '{info.name}' has no tensor '{name}'")

    def layer_net(self, net: str, layer: int) -> str:
        """The net layer `layer` runs for `net`: layers of a pre-quantized checkpoint whose
        quantization differs from layer 0's, or of another kind, have their own
        (`block@3`, ...)."""
        table = self.layer_nets
        return table[net][layer] if net in table else net

    def batch_net(self, net: str, layer: int | None = None) -> str:
        """The batch net of `net` (`BATCH_NETS`; of layer `layer`'s variant for a per-layer
        net): `block_cache.b4@3`."""
        name = NetName.parse(net if layer is None else self.layer_net(net, layer))
        return str(name.at_batch(self.batch))

    def chunk_length(self, n: int) -> int:
        """The prefill length a chunk of `n` tokens runs at: the shortest that holds it."""
        return next(length for length in self.lengths if length >= n)

    def prefill_net(self, net: str, layer: int | None, length: int) -> str:
        """The prefill net `net` (`PREFILL_NETS`) at chunk length `length`, of layer
        `layer`'s variant (None: a net that is not per layer)."""
        name = NetName.parse(net if layer is None else self.layer_net(net, layer))
        return str(name.at_length(self.prefill_tags[length]))

    def decode_nets(self) -> list[str]:
        """The nets every generation runs whatever its prompt's length: a decode step's
        (the embedding, each layer's block_cache) and the greedy token's (the lm_head and
        its head)."""
        layers = sorted({self.layer_net(BLOCK_CACHE, i) for i in range(self.num_layers)})
        return [EMBEDDING_CACHE, *layers, LM_HEAD, GREEDY_HEAD]
