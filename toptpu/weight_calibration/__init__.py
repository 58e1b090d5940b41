"""Calibrated weight quantization at compile time: GPTQ, AWQ and SignRound, one layer at a
time.

A float model (a checkpoint directory or GGUF file, read one layer at a time; or a
transformers model in memory) and plain text files in, a pre-quantized checkpoint directory
out (the GPTQ layout, `export`), which the compiler takes as it takes any GPTQ / AutoRound
checkpoint (`frontends.quant`): its integers go into `tpu.a16_matmul` as they are.

- `grid`: the integer grid (GPTQ's), `QuantScheme`, round to nearest;
- `gptq`: GPTQ on one linear (Hessian, damping, act-order with static groups, lazy batches);
- `awq`: AWQ's scale search, folding and clipping on one layer (a MoE layer's experts too);
- `signround`: SignRound's tuned rounding offsets and group ranges (signed gradient descent
  on the layer's output error, in torch);
- `experts`: a mixture-of-experts layer's routed experts, GPTQ per expert on its tokens;
- `data`: calibration text files -> token sequences, bad data refused;
- `layers`: what is calibrated in a layer (`LayerPlan`), running a layer, the layer sources;
- `export`: the checkpoint directory (GPTQ layout, `gptq` or `auto_round` format);
- `sequential`: the driver, `calibrate(model, output, request, data)`.
"""

from __future__ import annotations

from toptpu.weight_calibration.awq import AwqOptions
from toptpu.weight_calibration.data import (
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_SEQUENCES,
    CalibrationData,
    CalibrationDataError,
    calibration_data,
)
from toptpu.weight_calibration.grid import CalibrationError, QuantScheme
from toptpu.weight_calibration.sequential import (
    METHODS,
    CalibrationReport,
    CalibrationRequest,
    calibrate,
    request_for_mode,
)
from toptpu.weight_calibration.signround import SignRoundOptions

__all__ = [
    "DEFAULT_SEQUENCES",
    "DEFAULT_SEQUENCE_LENGTH",
    "METHODS",
    "AwqOptions",
    "CalibrationData",
    "CalibrationDataError",
    "CalibrationError",
    "CalibrationReport",
    "CalibrationRequest",
    "QuantScheme",
    "SignRoundOptions",
    "calibrate",
    "calibration_data",
    "request_for_mode",
]
