"""Weight recipes: how each `tpu.weight` of a compiled net is derived from float weights.

`convert-top-to-tpu` records on every `tpu.weight` the Top weight it came from (`source`)
and how (`part`: data | qweight | scales | zeros; later passes append transforms, e.g.
weight-reorder's ".t" = transposed, so "data.t"). Together with the consuming
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

from toptpu.dialects import tpu
from toptpu.dialects.common import elem_of, numpy_dtype, read_int, read_str, shape_of
from toptpu.passes.quantize import quantize_rtn


class RecipeError(ValueError):
    """A tpu.weight whose recipe cannot be followed; the message names it."""


@dataclass(frozen=True)
class WeightRecipe:
    """How to make the tensor of one `tpu.weight` from its source float tensor."""

    name: str  # the tpu.weight name
    source: str  # the Top weight name it derives from
    part: str  # data | qweight | scales | zeros, then ".t" transforms
    shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype of the tensor
    bits: int | None = None  # quantized parts: the consuming a16_matmul's parameters
    group_size: int | None = None
    symmetric: bool | None = None
    scale_dtype: np.dtype | None = None

    @property
    def base_part(self) -> str:
        return self.part.split(".", 1)[0]

    @property
    def checkpoint_field(self) -> str | None:
        """For checkpoint parts ("checkpoint.qweight" ...): the field; else None."""
        return self.part.split(".")[1] if self.base_part == "checkpoint" else None

    @property
    def transforms(self) -> list[str]:
        return self.part.split(".")[2 if self.base_part == "checkpoint" else 1:]

    @property
    def quant_key(self) -> tuple[str, int | None, int | None, bool | None, str]:
        return (self.source, self.bits, self.group_size, self.symmetric, str(self.scale_dtype))


def weight_recipes(module: ModuleOp) -> list[WeightRecipe]:
    """The recipe of every `tpu.weight` in `module`, in program order."""
    quant: dict[tpu.WeightOp, tuple[int, int, bool, np.dtype]] = {}
    for op in module.walk():
        if isinstance(op, tpu.A16MatMulOp):
            params = (read_int(op.weight_bits), read_int(op.group_size), op.zeros is None,
                      numpy_dtype(elem_of(op.scales)))
            for v in (op.qweight, op.scales, op.zeros):
                if v is not None and isinstance(v.owner, tpu.WeightOp):
                    quant[v.owner] = params
    out = []
    for op in module.walk():
        if not isinstance(op, tpu.WeightOp):
            continue
        name = op.tensor_name
        source, part = read_str(op.source), read_str(op.part)
        if not source or not part:
            raise RecipeError(f"tpu.weight '{name}' has no source/part: it cannot be derived "
                              "for other layers (was it made by convert-top-to-tpu?)")
        dt = numpy_dtype(elem_of(op.output))
        base, *transforms = part.split(".")
        if base == "checkpoint":
            if not transforms or transforms[0] not in ("qweight", "scales", "zeros", "perm"):
                raise RecipeError(f"tpu.weight '{name}' has part '{part}': checkpoint parts "
                                  "are qweight, scales, zeros or perm")
            transforms = transforms[1:]
        if any(t != "t" for t in transforms):
            raise RecipeError(f"tpu.weight '{name}' has part '{part}': the only transform "
                              "after the base part is '.t' (transpose)")
        if base in ("data", "checkpoint"):
            out.append(WeightRecipe(name, source, part, shape_of(op.output), dt))
        elif base in ("qweight", "scales", "zeros"):
            if op not in quant:
                raise RecipeError(f"quantized weight '{name}' ({part}) feeds no tpu.a16_matmul")
            bits, gs, sym, sdt = quant[op]
            out.append(WeightRecipe(name, source, part, shape_of(op.output), dt, bits, gs, sym,
                                    sdt))
        else:
            raise RecipeError(
                f"tpu.weight '{name}' has part '{part}': only data/qweight/scales/zeros can be "
                "re-derived per layer (pre-quantized checkpoint weights are not supported by "
                "the per-layer binder yet)")
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
        elif r.base_part == "data":
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
        for t in r.transforms:
            assert t == "t"
            arr = arr.T
        if tuple(arr.shape) != r.shape or arr.dtype != r.dtype:
            raise RecipeError(
                f"'{r.name}' derived from '{r.source}' {list(np.shape(w))} is "
                f"{list(arr.shape)} {arr.dtype}, but the compiled net expects {list(r.shape)} "
                f"{r.dtype}")
        out[r.name] = np.ascontiguousarray(arr)
    return out
