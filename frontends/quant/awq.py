"""AWQ checkpoints (AutoAWQ): the GEMM layout, its unpacking and which layers its config
quantizes.

AWQ GEMM layout (AutoAWQ ``version: gemm``; AutoRound ``auto_round:auto_awq``), 4-bit only
    ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``: both packed along N,
    with the columns of each word interleaved: nibble ``i`` (bits ``4i..4i+3``) of word
    ``j`` holds column ``8j + order[i]`` for ``order = 0, 2, 4, 6, 1, 3, 5, 7`` (equivalently
    column ``8j + c`` sits in nibble ``AWQ_PACK_ORDER[c]``, ``AWQ_PACK_ORDER = 0,4,1,5,2,6,3,7``).
    ``scales`` float ``[G, N]``; zeros are stored as is (no offset); no ``g_idx``.

Which layers are quantized: all but ``modules_to_not_convert``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toptpu.frontends.quant.common import (
    LayerScheme,
    QuantizedCheckpointError,
    SchemeResolver,
    require,
    unpack_int32_columns,
)

#: AWQ GEMM packing: column ``c`` (0..7) of a group of eight sits in nibble ``AWQ_PACK_ORDER[c]``
AWQ_PACK_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)

#: tensor fields of one quantized module
AWQ_FIELDS = frozenset({"qweight", "qzeros", "scales", "bias"})


def unpack_awq_columns(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """``[R, C]`` int32 -> uint8 ``[R, C * 8]`` for the AWQ GEMM layout (4-bit): column
    ``8c + j`` is the nibble ``AWQ_PACK_ORDER[j]`` of word ``[r, c]``."""
    if bits != 4:
        raise ValueError(f"the AWQ GEMM layout is defined for 4 bits, not {bits}")
    nibbles = unpack_int32_columns(packed, 4).reshape(packed.shape[0], packed.shape[1], 8)
    return nibbles[:, :, list(AWQ_PACK_ORDER)].reshape(packed.shape[0], packed.shape[1] * 8)


def packing_format(model_dir: Path, qc: Mapping[str, Any]) -> str:
    """``awq_gemm``: other versions and checkpoints without zero points are errors."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizedCheckpointError(
            f"{model_dir}: quantization_config.version={qc.get('version')!r}: only the AWQ "
            "'gemm' layout is supported (gemv/gemv_fast/exllama/marlin/ipex layouts are "
            "kernel-specific); re-export with version 'gemm'"
        )
    if not qc.get("zero_point", True):
        raise QuantizedCheckpointError(
            f"{model_dir}: quantization_config.zero_point=false: AWQ gemm checkpoints without "
            "zero points are not supported; re-export with zero_point=true"
        )
    return "awq_gemm"


class AwqResolver(SchemeResolver):
    """AWQ's config: ``w_bit``/``q_group_size`` as aliases, ``zero_point`` for ``sym``,
    ``modules_to_not_convert`` left in float."""

    def default_scheme(self) -> LayerScheme:
        bits = require(self.model_dir, self.qc, "bits", "w_bit")
        group_size = require(self.model_dir, self.qc, "group_size", "q_group_size")
        zero_point = self.qc.get("zero_point", True)
        sym = bool(self.qc["sym"]) if "sym" in self.qc else not zero_point
        return LayerScheme(int(bits), int(group_size), sym)

    def resolve(self, layer: str, known_layers: Iterable[str]) -> tuple[LayerScheme | None, str]:
        for m in self.not_convert:
            if m in layer:
                return None, f"modules_to_not_convert '{m}'"
        return self._scheme({}, layer, "quantization_config"), "quantization_config"
