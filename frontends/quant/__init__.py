"""Readers for pre-quantized checkpoints: GPTQ, AWQ and AutoRound.

One module per format (`gptq`, `awq`, `autoround`: its packing formats, its layout, which
layers its config quantizes), what they share (`common`: the error, the canonical form, the
files, the scheme rules, the tensor sources) and the entry points (`checkpoint`:
`read_quantized_checkpoint`, `open_quantized_checkpoint`, `QuantizedCheckpoint`). The names
below are the API; import them from here.

Which layers are quantized is read from the tensors (a module with a ``qweight``), and
cross-checked with the configuration. Anything the reader cannot decode exactly is a
`QuantizedCheckpointError` naming the layer, the field and what to do.
"""

from __future__ import annotations

from toptpu.frontends.quant.awq import AWQ_PACK_ORDER, unpack_awq_columns
from toptpu.frontends.quant.checkpoint import (
    QuantizedCheckpoint,
    open_quantized_checkpoint,
    read_quantized_checkpoint,
)
from toptpu.frontends.quant.common import (
    SUPPORTED_BITS,
    QuantizedCheckpointError,
    QuantizedLayout,
    QuantizedLinear,
    ReaderSource,
    unpack_int32_columns,
    unpack_int32_rows,
)

__all__ = [
    "AWQ_PACK_ORDER",
    "QuantizedCheckpoint",
    "QuantizedCheckpointError",
    "QuantizedLayout",
    "QuantizedLinear",
    "ReaderSource",
    "SUPPORTED_BITS",
    "open_quantized_checkpoint",
    "read_quantized_checkpoint",
    "unpack_awq_columns",
    "unpack_int32_columns",
    "unpack_int32_rows",
]
