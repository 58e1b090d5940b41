"""Round-to-nearest weight quantization into the `tpu.a16_matmul` format.

- 8 bit, symmetric (default): per output channel, s = max|w| / 127, q = round(w / s) in
  [-127, 127] stored i8, no zero point.
- 8 bit, asymmetric: per channel, s = (max - min) / 255, z = round(-min / s), q ui8.
- 4 bit, asymmetric (default): per group of `group_size` input channels,
  s = (max - min) / 15, z = clamp(round(-min / s), 0, 15), q = clamp(round(w / s) + z, 0, 15).
- 4 bit, symmetric: s = max|w| / 7, z = 8 (implicit), q = clamp(round(w / s) + 8, 0, 15).

Scales are rounded to their storage type (the activation type: f32, f16 or bf16) *before*
q is computed, so q is the best integer for the scale the kernel will really use.
Dequantization (the kernel's math) lives in `toptpu.backend.reference.kernels.dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toptpu.dialects.weight_store import ANNEX, WeightStore
from toptpu.errors import ToptpuError


def pack_int4(q: np.ndarray) -> np.ndarray:
    """ui8 [N, K] with values < 16 -> ui8 [N, K/2] (inverse of `unpack_int4`)."""
    q = np.asarray(q, dtype=np.uint8)
    if q.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd K={q.shape[-1]} into nibbles")
    if q.size and q.max() > 15:
        raise ValueError("4-bit values must be < 16")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


class QuantizationError(ToptpuError, ValueError):
    pass


@dataclass
class QuantizedWeight:
    qweight: np.ndarray  # ui8 [N, K/2] (4 bit) | i8 [N, K] (8 bit sym) | ui8 [N, K]
    scales: np.ndarray  # [N, K / group_size], storage dtype
    zeros: np.ndarray | None  # ui8 [N, K / group_size] or None
    bits: int
    group_size: int


def resolve_group_size(k: int, group_size: int, bits: int) -> int:
    """-1 means per channel (group = K); 8-bit weights are always per channel."""
    gs = k if group_size == -1 or bits == 8 else group_size
    if gs <= 0 or k % gs:
        raise QuantizationError(
            f"group size {group_size} does not divide the input dimension K={k}; "
            "use a divisor of K or -1 for per-channel scales"
        )
    return gs


#: quantize_rtn works through a weight in row blocks of about this many elements: every
#: step is per element or per group of a row, so the blocks give the very same numbers,
#: with temporaries that stay in cache instead of several copies of a big weight
QUANT_BLOCK_ELEMENTS = 1 << 20


def quantize_rtn(w: np.ndarray, bits: int, group_size: int, symmetric: bool,
                 scale_dtype: np.dtype) -> QuantizedWeight:
    """Quantize a float weight [N, K] (nn.Linear layout) round-to-nearest; a stack of
    them [E, N, K] (a mixture of experts' projection) is quantized expert by expert,
    each of its parts [E, N, ...] (the groups lie along K, so the stack's rows are
    quantized as the rows of one [E * N, K] weight)."""
    if bits not in (4, 8):
        raise QuantizationError(f"weight bits must be 4 or 8, got {bits}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim == 3:
        e, n, k = w.shape
        flat = quantize_rtn(w.reshape(e * n, k), bits, group_size, symmetric, scale_dtype)
        return QuantizedWeight(
            flat.qweight.reshape(e, n, -1), flat.scales.reshape(e, n, -1),
            None if flat.zeros is None else flat.zeros.reshape(e, n, -1), bits,
            flat.group_size)
    if w.ndim != 2:
        raise QuantizationError(f"only 2-D weights (or stacks of them) can be quantized, "
                                f"got {list(w.shape)}")
    n, k = w.shape
    gs = resolve_group_size(k, group_size, bits)
    step = max(1, QUANT_BLOCK_ELEMENTS // max(k, 1))
    if n <= step:
        return _quantize_rows(w, bits, gs, symmetric, scale_dtype)
    blocks = [_quantize_rows(w[r:r + step], bits, gs, symmetric, scale_dtype)
              for r in range(0, n, step)]
    zeros = None if blocks[0].zeros is None else np.concatenate([b.zeros for b in blocks])
    return QuantizedWeight(np.concatenate([b.qweight for b in blocks]),
                           np.concatenate([b.scales for b in blocks]), zeros, bits, gs)


def placeholder_quantized(w: np.ndarray, bits: int, group_size: int, symmetric: bool,
                          scale_dtype: np.dtype) -> QuantizedWeight:
    """`quantize_rtn`'s result for a placeholder weight (a store of `placeholders`: only
    the shapes matter): zeros on untouched pages of the shapes and types that quantizing
    one row gives, for every row of `w` (its leading axes kept)."""
    one = quantize_rtn(np.zeros((1, w.shape[-1]), np.float32), bits, group_size, symmetric,
                       scale_dtype)
    lead = tuple(w.shape[:-1])

    def like(a: np.ndarray) -> np.ndarray:
        return np.zeros((*lead, a.shape[-1]), a.dtype)

    return QuantizedWeight(like(one.qweight), like(one.scales),
                           None if one.zeros is None else like(one.zeros), bits,
                           one.group_size)


def _quantize_rows(w: np.ndarray, bits: int, gs: int, symmetric: bool,
                   scale_dtype: np.dtype) -> QuantizedWeight:
    """`quantize_rtn` of some rows of a weight (group size resolved)."""
    n, k = w.shape
    g = w.reshape(n, k // gs, gs)
    qmax = (1 << bits) - 1
    if symmetric:
        half = 127 if bits == 8 else 7
        s = np.max(np.abs(g), axis=-1) / half
        s = np.where(s == 0, 1.0, s).astype(np.float32)
        s = s.astype(scale_dtype).astype(np.float32)
        s = np.where(s == 0, np.float32(np.finfo(np.float16).tiny), s)
        if bits == 8:
            q = np.clip(np.rint(g / s[..., None]), -127, 127).astype(np.int8)
            return QuantizedWeight(q.reshape(n, k), s.astype(scale_dtype), None, 8, gs)
        q = np.clip(np.rint(g / s[..., None]) + 8, 0, 15).astype(np.uint8)
        return QuantizedWeight(pack_int4(q.reshape(n, k)), s.astype(scale_dtype), None, 4, gs)
    lo = np.minimum(np.min(g, axis=-1), 0.0)
    hi = np.maximum(np.max(g, axis=-1), 0.0)
    s = (hi - lo) / qmax
    s = np.where(s == 0, 1.0, s).astype(np.float32)
    s = s.astype(scale_dtype).astype(np.float32)
    s = np.where(s == 0, np.float32(np.finfo(np.float16).tiny), s)
    z = np.clip(np.rint(-lo / s), 0, qmax).astype(np.uint8)
    q = np.clip(np.rint(g / s[..., None]) + z[..., None], 0, qmax).astype(np.uint8)
    q = q.reshape(n, k)
    packed = pack_int4(q) if bits == 4 else q
    return QuantizedWeight(packed, s.astype(scale_dtype), z, bits, gs)


# --------------------------------------------------------------------------- checkpoints

#: weight-store names of a pre-quantized checkpoint's tensors for the float weight `w`:
#: f"{w}{CHECKPOINT_TAG}{field}" with field qweight (ui8 [N, K] unpacked), scales [N, G],
#: zeros (ui8 [N, G]) or mins (float [N, G], the scale-and-min form), g_idx (i32 [K],
#: act-order only) and meta (i32 [bits, group_size]);
#: annexes of `w` in the store's naming (they travel with `w` when a module is saved)
CHECKPOINT_TAG = f"{ANNEX}checkpoint."
#: present in a weight store whose model came pre-quantized: weights without checkpoint
#: tensors were left at full precision by the quantizer and stay float (never re-quantized)
CHECKPOINT_MODEL = f"{ANNEX}checkpoint"


def checkpoint_key(weight: str, field: str) -> str:
    return f"{weight}{CHECKPOINT_TAG}{field}"


def checkpoint_parts(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                     g_idx: np.ndarray | None, bits: int, group_size: int,
                     where: str = "a checkpoint layer",
                     mins: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A pre-quantized layer's integers, scales and zero points (or mins), as
    `tpu.a16_matmul` reads them — nothing re-quantized, nothing rounded:

    - qweight: packed two nibbles a byte (4 bit) or ui8 (8 bit);
    - scales: in the checkpoint's own dtype (f16 scales stay f16 under bf16 activations);
    - zeros: ui8, always explicit (so both GPTQ's symmetric 8 / 128 and asymmetric zeros are
      exactly the checkpoint's);
    - mins (instead of zeros, the scale-and-min form): float, in their own dtype;
    - perm (act-order): the input-channel order that makes every group contiguous; the
      compiled net gathers the activations in this order before the matmul.
    """
    if bits not in (4, 8):
        raise QuantizationError(f"{where}: {bits}-bit weights are not supported (4 or 8)")
    q = np.asarray(qweight)
    if q.ndim == 3:  # a mixture of experts' projection, stacked by expert [E, N, K]
        if g_idx is not None:
            raise QuantizationError(f"{where}: act-order experts are not supported")
        experts = [checkpoint_parts(q[e], np.asarray(scales)[e],
                                    None if zeros is None else np.asarray(zeros)[e], None,
                                    bits, group_size, f"{where} expert {e}",
                                    None if mins is None else np.asarray(mins)[e])
                   for e in range(q.shape[0])]
        return {f: np.stack([parts[f] for parts in experts]) for f in experts[0]}
    n, k = q.shape
    if q.size and int(q.max()) >= (1 << bits):
        raise QuantizationError(f"{where}: qweight has values >= 2**{bits}")
    if (zeros is None) == (mins is None):
        raise QuantizationError(f"{where}: a checkpoint layer has zero points or mins "
                                "(exactly one of them)")
    z = None if zeros is None else np.asarray(zeros)
    if z is not None and z.size and (int(z.max()) > 255 or int(z.min()) < 0):
        raise QuantizationError(f"{where}: a zero point of {int(z.max())} does not fit 8 bits")
    groups = (n, k // group_size) if group_size > 0 and k % group_size == 0 else None
    if mins is not None and (groups is None or np.shape(mins) != groups
                             or np.asarray(mins).dtype.kind != "f"):
        raise QuantizationError(f"{where}: mins must be float [N, K / group size], not "
                                f"{np.asarray(mins).dtype} {list(np.shape(mins))}")
    if group_size <= 0 or k % group_size:
        raise QuantizationError(f"{where}: group size {group_size} does not divide K={k}")
    out: dict[str, np.ndarray] = {}
    if g_idx is not None:
        gi = np.asarray(g_idx).astype(np.int64)
        perm = np.argsort(gi, kind="stable")
        counts = np.bincount(gi, minlength=k // group_size)
        if len(counts) != k // group_size or np.any(counts != group_size):
            raise QuantizationError(
                f"{where}: g_idx does not give every group exactly {group_size} channels; "
                "this act-order layout cannot be made contiguous")
        q = q[:, perm]
        out["perm"] = perm.astype(np.int32)
    q = np.ascontiguousarray(q.astype(np.uint8))
    out["qweight"] = pack_int4(q) if bits == 4 else q
    out["scales"] = np.ascontiguousarray(scales)
    if z is not None:
        out["zeros"] = np.ascontiguousarray(z.astype(np.uint8))
    else:
        out["mins"] = np.ascontiguousarray(mins)
    return out


def checkpoint_parts_of_store(store: WeightStore, weight: str) -> dict[str, np.ndarray] | None:
    """The a16_matmul parts of `weight` when the store holds its checkpoint tensors."""
    meta_key = checkpoint_key(weight, "meta")
    if meta_key not in store:
        return None
    bits, gs = (int(x) for x in store[meta_key])
    g_idx = store[checkpoint_key(weight, "g_idx")] if checkpoint_key(
        weight, "g_idx") in store else None
    zeros_key, mins_key = checkpoint_key(weight, "zeros"), checkpoint_key(weight, "mins")
    parts = checkpoint_parts(store[checkpoint_key(weight, "qweight")],
                             store[checkpoint_key(weight, "scales")],
                             store[zeros_key] if zeros_key in store else None, g_idx, bits,
                             gs, weight, store[mins_key] if mins_key in store else None)
    parts["meta"] = np.array([bits, gs], np.int32)
    return parts
