"""Weight recipes: how each `tpu.weight` of a compiled net is derived from float weights.

`convert-top-to-tpu` records on every `tpu.weight` the Top weight it came from (`source`)
and how (`part`, a `WeightPart`: data | qweight | scales | zeros | checkpoint.<field>, with
".t" when weight-reorder stored it transposed, e.g. "data.t"). Together with the consuming
`tpu.a16_matmul` (weight_bits, group_size, whether it has zero points, the scale storage
type) that is a complete recipe: given *another* layer's float tensor for the same source,
`derive_weights` produces that layer's tensors for the very same compiled net. This is how
every layer binds its own weights to a net compiled once.

Quantization is `toptpu.passes.quantize.quantize_rtn`, the same function the lowering
calls, so layer 0 derived here is bit-identical to what the compiler stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import tpu
from toptpu.dialects.common import (
    ShapedOp,
    WeightPart,
    elem_of,
    numpy_dtype,
    read_str,
    shape_of,
)
from toptpu.dialects.top import weight_name
from toptpu.errors import ToptpuError
from toptpu.passes.quantize import quantize_rtn


class RecipeError(ToptpuError, ValueError):
    """A tpu.weight whose recipe cannot be followed; the message names it."""


@dataclass(frozen=True)
class WeightRecipe:
    """How to make the tensor of one `tpu.weight` from its source float tensor."""

    name: str  # the tpu.weight name
    source: str  # the Top weight name it derives from
    part: WeightPart  # data | qweight | scales | zeros | checkpoint.<field>, maybe ".t"
    shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype of the tensor
    bits: int | None = None  # quantized parts: the consuming a16_matmul's parameters
    group_size: int | None = None
    symmetric: bool | None = None
    scale_dtype: np.dtype | None = None

    @property
    def base_part(self) -> WeightPart:
        """The part without its ".t" (data, qweight, ..., checkpoint.qweight, ...)."""
        return self.part.untransposed

    @property
    def checkpoint_field(self) -> str | None:
        """For checkpoint parts ("checkpoint.qweight" ...): the field; else None."""
        return self.part.checkpoint_field

    @property
    def quant_key(self) -> tuple[str, int | None, int | None, bool | None, str]:
        return (self.source, self.bits, self.group_size, self.symmetric, str(self.scale_dtype))


def weight_recipes(module: ModuleOp) -> list[WeightRecipe]:
    """The recipe of every `tpu.weight` in `module`, in program order."""
    quant: dict[Operation, tuple[int, int, bool, np.dtype]] = {}  # a weight -> its params
    for op in module.walk():
        if not isinstance(op, ShapedOp):
            continue
        for conv in op.quantized_weights():
            q, scales, zeros, mins = (op.operand_groups()[i] for i in conv.operands)
            assert scales is not None
            params = (conv.bits, conv.group_size, zeros is None,
                      numpy_dtype(elem_of(scales)))
            for v in (q, scales, zeros, mins):
                if v is not None and weight_name(v) is not None:
                    owner = v.owner
                    assert isinstance(owner, Operation)  # a named weight is an op's result
                    quant[owner] = params
    out = []
    for op in module.walk():
        if not isinstance(op, tpu.WeightOp):
            continue
        name = op.tensor_name
        try:
            part = op.weight_part
        except VerifyException as e:
            raise RecipeError(f"tpu.weight '{name}': {e}") from None
        source = read_str(op.source)
        if not source or part is None:
            raise RecipeError(f"tpu.weight '{name}' has no source/part: it cannot be derived "
                              "for other layers (was it made by convert-top-to-tpu?)")
        dt = numpy_dtype(elem_of(op.output))
        if part.untransposed == WeightPart.DATA or part.checkpoint_field is not None:
            out.append(WeightRecipe(name, source, part, shape_of(op.output), dt))
        else:  # qweight, scales, zeros: quantized by the consuming a16_matmul's parameters
            if op not in quant:
                raise RecipeError(f"quantized weight '{name}' ({part}) feeds no tpu.a16_matmul")
            bits, gs, sym, sdt = quant[op]
            out.append(WeightRecipe(name, source, part, shape_of(op.output), dt, bits, gs, sym,
                                    sdt))
    return out


def derive_weights(recipes: Iterable[WeightRecipe],
                   float_of: Callable[[str], np.ndarray],
                   checkpoint_of: Callable[[str], Mapping[str, np.ndarray] | None] | None = None
                   ) -> dict[str, np.ndarray]:
    """Tensors for `recipes` from the float tensors `float_of(source)` (one layer's) and,
    for weights taken from a pre-quantized checkpoint, its parts `checkpoint_of(source)`
    (as `passes.quantize.checkpoint_parts` makes them)."""
    out: dict[str, np.ndarray] = {}
    quantized: dict[tuple, dict[str, np.ndarray | None]] = {}
    for r in recipes:
        field = r.checkpoint_field
        if field is not None:
            parts = checkpoint_of(r.source) if checkpoint_of is not None else None
            if parts is None or field not in parts:
                raise RecipeError(f"'{r.name}' comes from the checkpoint, which has no "
                                  f"'{field}' for '{r.source}' in this layer")
            w = parts[field]
            arr = np.asarray(w)
        elif r.base_part == WeightPart.DATA:
            w = float_of(r.source)
            arr = np.asarray(w).astype(r.dtype)
        else:
            w = float_of(r.source)
            assert r.bits is not None and r.group_size is not None and r.scale_dtype is not None
            key = r.quant_key
            if key not in quantized:
                qw = quantize_rtn(w, r.bits, r.group_size, bool(r.symmetric), r.scale_dtype)
                quantized[key] = {"qweight": qw.qweight, "scales": qw.scales, "zeros": qw.zeros}
            arr_or_none = quantized[key][r.base_part]
            if arr_or_none is None:
                raise RecipeError(f"'{r.name}' asks for zeros of a symmetric quantization")
            arr = arr_or_none
        if r.part.transposed:
            arr = arr.T
        if tuple(arr.shape) != r.shape or arr.dtype != r.dtype:
            raise RecipeError(
                f"'{r.name}' derived from '{r.source}' {list(np.shape(w))} is "
                f"{list(arr.shape)} {arr.dtype}, but the compiled net expects {list(r.shape)} "
                f"{r.dtype}")
        out[r.name] = np.ascontiguousarray(arr)
    return out
