"""AutoRound checkpoints: its packing formats (the GPTQ and AWQ layouts, see `gptq` and
`awq`) and which layers its config quantizes.

Which layers are quantized: ``extra_config`` (per-layer ``bits``/``group_size``/``sym``,
exact layer names first, then regex keys; ``bits >= 16`` meaning "left at full precision"),
then ``modules_to_not_convert`` and the blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from toptpu.frontends.quant.common import LayerScheme, QuantizedCheckpointError, SchemeResolver

#: packing formats in the GPTQ layout storing ``zero - 1`` (v1), the zero itself (v2), and
#: in the AWQ GEMM layout
AUTOROUND_GPTQ_V1 = ("auto_round:auto_gptq", "auto_round:gptq", "auto")
AUTOROUND_GPTQ_V2 = ("auto_round", "auto_round:gptqmodel")
AUTOROUND_AWQ = ("auto_round:auto_awq", "auto_round:awq")


def packing_format(model_dir: Path, qc: Mapping[str, Any]) -> str:
    """The config's ``packing_format``, one of the three families above."""
    fmt = qc.get("packing_format")
    if fmt is None:
        raise QuantizedCheckpointError(
            f"{model_dir}: AutoRound quantization_config has no 'packing_format'; set it to one "
            f"of {', '.join(AUTOROUND_GPTQ_V1 + AUTOROUND_GPTQ_V2 + AUTOROUND_AWQ)}"
        )
    fmt = str(fmt)
    if fmt not in AUTOROUND_GPTQ_V1 + AUTOROUND_GPTQ_V2 + AUTOROUND_AWQ:
        raise QuantizedCheckpointError(
            f"{model_dir}: AutoRound packing_format={fmt!r} is not supported; supported: "
            f"{', '.join(AUTOROUND_GPTQ_V1 + AUTOROUND_GPTQ_V2 + AUTOROUND_AWQ)} (re-export "
            "with format auto_round, auto_gptq or auto_awq)"
        )
    return fmt


class AutoRoundResolver(SchemeResolver):
    """AutoRound's config: ``extra_config`` overrides (exact names, then regex keys with
    ``re.search`` as auto-round does), ``modules_to_not_convert``, the blocks."""

    def __init__(self, model_dir: Path, qc: Mapping[str, Any]):
        super().__init__(model_dir, qc)
        self.extra = {str(k): dict(v or {}) for k, v in (qc.get("extra_config") or {}).items()}

    def resolve(self, layer: str, known_layers: Iterable[str]) -> tuple[LayerScheme | None, str]:
        known = set(known_layers)
        if layer in self.extra:
            where = f"extra_config['{layer}']"
            return self._scheme(self.extra[layer], layer, where), where
        for key, override in self.extra.items():
            if key in known:
                continue
            if self._compile(key, "extra_config").search(layer):
                where = f"extra_config['{key}']"
                return self._scheme(override, layer, where), where
        for m in self.not_convert:
            if m in layer:
                return None, f"modules_to_not_convert '{m}'"
        if self._outside_blocks(layer):
            return None, f"block_name_to_quantize {self.blocks}"
        return self._scheme({}, layer, "quantization_config"), "quantization_config"
