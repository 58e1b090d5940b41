"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): the layout, its packing formats and
which layers its config quantizes.

GPTQ layout (AutoGPTQ / GPTQModel / optimum; AutoRound ``auto_round:auto_gptq``, plain
``auto_round`` and ``auto_round:gptqmodel``; ``K`` = in_features, ``N`` = out_features,
``G`` = number of groups, ``p = 32 // bits`` values per int32 word, value ``i`` of a word in
bits ``[i*bits, (i+1)*bits)``)
    ``qweight`` int32 ``[K / p, N]``: packed along K (rows); input channel ``k`` of output
    ``n`` is value ``k % p`` of ``qweight[k // p, n]`` (`unpack_int32_rows`).
    ``qzeros``  int32 ``[G, N / p]``: packed along N (columns), value ``n % p`` of
    ``qzeros[g, n // p]`` (`unpack_int32_columns`).
    ``scales``  float ``[G, N]``; ``bias`` ``[N]`` (optional).
    ``g_idx``   int32 ``[K]`` (optional): the group of each input channel. With act-order
    (``desc_act``) GPTQ quantizes channels in a permuted order, so groups are not
    contiguous ranges of K; the weights stay stored in the original channel order.
    Zero-point offset: GPTQ "v1" (``checkpoint_format`` ``gptq``, the default, AutoGPTQ and
    ``auto_round:auto_gptq``) stores ``zero - 1``; ``gptq_v2`` (GPTQModel), plain
    ``auto_round`` and ``auto_round:gptqmodel`` store the zero itself. (v1 cannot hold a
    zero of 0; auto-round's packer clamps the stored value to 0, i.e. zero 1. The reader
    decodes what is stored, as every GPTQ kernel does.)

Which layers are quantized: GPTQ ``dynamic`` (``+:regex`` per-layer overrides, ``-:regex``
layers left in float), ``block_name_to_quantize``, ``modules_in_block_to_quantize`` and
``lm_head``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from toptpu.frontends.quant.common import LayerScheme, QuantizedCheckpointError, SchemeResolver

#: tensor fields of one quantized module
GPTQ_FIELDS = frozenset({"qweight", "qzeros", "scales", "g_idx", "bias"})


def packing_format(model_dir: Path, qc: Mapping[str, Any]) -> str:
    """``gptq`` (v1: zero - 1 stored) or ``gptq_v2``; kernel-specific layouts are errors."""
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizedCheckpointError(
            f"{model_dir}: quantization_config.checkpoint_format={fmt!r} is a kernel-specific "
            "(exllama/marlin/bitblas-style) layout that cannot be decoded here; re-export the "
            "model in checkpoint_format 'gptq' or 'gptq_v2'"
        )
    return fmt


class GptqResolver(SchemeResolver):
    """GPTQ's config: ``dynamic`` overrides first, then ``lm_head``, the blocks and
    ``modules_in_block_to_quantize``."""

    def __init__(self, model_dir: Path, qc: Mapping[str, Any]):
        super().__init__(model_dir, qc)
        self.dynamic: list[tuple[str, re.Pattern[str], dict[str, Any]]] = []
        for key, override in (qc.get("dynamic") or {}).items():
            sign, pattern = (
                ("-", key[2:])
                if key.startswith("-:")
                else (("+", key[2:]) if key.startswith("+:") else ("+", key))
            )
            self.dynamic.append((sign, self._compile(pattern, "dynamic"), dict(override or {})))

    def resolve(self, layer: str, known_layers: Iterable[str]) -> tuple[LayerScheme | None, str]:
        for sign, pattern, override in self.dynamic:
            if pattern.match(layer):
                if sign == "-":
                    return None, f"dynamic '-:{pattern.pattern}'"
                where = f"dynamic '+:{pattern.pattern}'"
                return self._scheme(override, layer, where), where
        if layer.split(".")[-1] == "lm_head":
            if not self.qc.get("lm_head", False):
                return None, "lm_head: false"
            return self._scheme({}, layer, "quantization_config"), "lm_head: true"
        if self._outside_blocks(layer):
            return None, f"block_name_to_quantize {self.blocks}"
        if self.modules_in_block is not None and not any(
            re.search(m, layer) for m in self.modules_in_block
        ):
            return None, "modules_in_block_to_quantize"
        return self._scheme({}, layer, "quantization_config"), "quantization_config"
