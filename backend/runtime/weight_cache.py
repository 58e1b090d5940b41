"""The executors' cache of converted weights: dequantized `tpu.a16_matmul` weights and f32
forms of f16/bf16 matmul weights (the lm_head), kept across net runs so a decode step costs
its matmuls, not a conversion of every weight. The numbers are the kernels' own: a cached
weight is exactly what the kernel would compute again.

The cache is bounded by a byte budget sized from the host's free memory: by default half of
`MemAvailable` (/proc/meminfo) read when the executor starts (2 GiB where that is not
known), for an executor that streams its weights (below: a blob above STREAM_ABOVE) at
most STREAMING_CAP (2.5 GiB: a 7B model's run stays within 6 GB; the weights that do not
fit are kept in no converted form and multiplied straight from the mapped file); the
environment variable `TOPTPU_WEIGHT_CACHE` (bytes, or a number with K, M or G:
`TOPTPU_WEIGHT_CACHE=3G`; 0 turns the cache off) or the executors' `weight_cache_bytes`
argument override it. A weight that does not fit the rest of the budget is converted for
each use and not kept (a decode step visits the weights cyclically: keeping the ones that
fit beats evicting the oldest).

Quantized weights (`WeightCache.dequantized`) have a second, smaller form: their integer
offsets q - z (`kernels.weight_offsets`: int8 for 4-bit weights, a quarter of the f32
form), from which the f32 form is one product per weight (`kernels.dequantize_offsets`,
about half the time of dequantizing the packed bytes; the same bits). Where the f32
forms of all weights do not fit the budget (a 7B model's take 26 GB), a weight whose f32
form does not fit keeps its offsets, and to make room gives up the f32 forms kept last
(once each: a weight given up keeps room for its offsets and is kept as offsets from then
on). After two passes over the model every weight is kept in one form or the other while
the offsets of all fit: f32 for the first weights, offsets for the rest. A conversion with
no smaller form (the f32 form of a bf16 lm_head) may take the room of quantized weights'
f32 forms the same way, but a float weight's f32 form (`f32_form`) is kept only while the
budget holds it beside the offsets of every quantized weight seen (`offsets_needed`), and
given up as soon as it does not: a byte of budget saves a decode step more as a 4-bit
weight's offsets than as a bf16 weight's f32 form (a Qwen2.5-7B layer's products: ~150 ms
CPU from the packed bytes, ~100 ms from 233 MB of offsets; the bf16 lm_head's 2.2 GB f32
form saves it ~0.04 s CPU a step (0.10 against 0.14 s a block of rows at a time), the
same bytes as offsets ~0.45 s). A decode step's product with a weight kept as offsets
(`WeightCache.a16_product`) expands it a block of rows at a time, never writing its f32
form to memory (about 2x faster), once that was found bit-identical for the shape — from
the product that first keeps the offsets on (that product makes no whole f32 form). A
decode step's product with a weight kept in no form (the budget is full) is made the same
way from the packed bytes (`streamed_product`: a 4-bit weight's offsets made a block at a
time in cache, `kernels.matmul_packed`; others' STREAM_ROWS rows' offsets at a time: the
same blocks, so the same bits), never holding the weight's offsets or f32 form whole. A
float weight whose f32 form does not fit (`f32_form`: a 14B model's bf16 lm_head, 3.1 GB
in f32) is multiplied by one row STREAM_ROWS of its rows at a time, each block converted
in cache (`f32_rows_product`, checked per shape), never converted whole.

Weight pages: an executor whose weight blob is larger than STREAM_ABOVE releases the mapped
pages of the weights each run read once it is done (TOPTPU_STREAM_WEIGHTS=auto|on|off;
`machine_executor.MachineExecutor`), so the mapped file does not stay resident either.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Hashable

import numpy as np

from toptpu.backend.formats.model_file import (  # noqa: F401 - where streaming is decided
    STREAM_ABOVE,
    STREAM_ENV_VAR,
)
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.errors import GenerationError
from toptpu.dialects.host_memory import mem_available

ENV_VAR = "TOPTPU_WEIGHT_CACHE"
#: the share of the host's available memory the cache may take by default
DEFAULT_FRACTION = 0.5
#: the budget where the available memory is not known
FALLBACK_BYTES = 2 << 30
#: the default budget's cap for an executor that streams its weights (TOPTPU_WEIGHT_CACHE
#: sets any other budget)
STREAMING_CAP = 5 << 29
#: the rows of a weight kept in no form whose offsets a decode step's product makes at a
#: time (a multiple of `kernels.matmul_offsets`' block: the same blocks as the whole's)
STREAM_ROWS = 1024
#: the first product of a shape made from a float weight's blocks of rows (`f32_rows_product`)
#: is checked against one product over this many of the weight's first rows
CHECK_ROWS = 4 * STREAM_ROWS
#: products with weights kept as offsets expand them a block at a time (no whole f32
#: weight) for inputs of at most this many rows: a decode step's
FUSED_ROWS = 8
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'3G' -> 3 GiB, '512M', '1.5G', '1000000' (bytes); ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


    return None


def default_budget(streaming: bool = False) -> int:
    """The cache budget: TOPTPU_WEIGHT_CACHE if set, else half the available memory (at
    most STREAMING_CAP for an executor that streams its weights)."""
    raw = os.environ.get(ENV_VAR)
    if raw is not None:
        try:
            return parse_size(raw)
        except ValueError:
            raise GenerationError(f"{ENV_VAR}={raw!r} is not a size: give bytes or a number "
                                  "with K, M or G (e.g. 3G; 0 turns the cache off)") from None
    avail = mem_available()
    budget = FALLBACK_BYTES if avail is None else int(avail * DEFAULT_FRACTION)
    return min(budget, STREAMING_CAP) if streaming else budget


def packed_int8(zeros: np.ndarray | None) -> bool:
    """Whether a 4-bit weight's offsets q - z are int8 for these zero points (None: the
    implied 8, or 0 with mins): what `kernels.matmul_packed` takes."""
    if zeros is None or zeros.size == 0:
        return True
    return -112 <= int(zeros.min()) and int(zeros.max()) <= 127


def _rows(a: np.ndarray | None, start: int, end: int) -> np.ndarray | None:
    return None if a is None else a[start:end]


class WeightCache:
    """Converted weights by key, within a byte budget (see the module doc)."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = default_budget() if budget is None else budget
        if self.budget < 0:
            raise GenerationError(f"the weight cache budget is {self.budget} bytes; give 0 "
                                  "or more")
        self.used = 0
        self._items: dict[Hashable, np.ndarray] = {}
        self._offsets: dict[Hashable, np.ndarray] = {}  # quantized weights kept as q - z
        #: their f32 forms in the order kept, with their bytes and their offsets'
        self._f32_quantized: list[tuple[Hashable, int, int]] = []
        self._givable = 0  # the room giving them all up would make
        self._given_up: set[Hashable] = set()  # f32 forms given up for others' offsets
        self._reserved: dict[Hashable, int] = {}  # ... and the room kept for their offsets
        self._reserved_total = 0
        #: the offsets' bytes of every quantized weight asked for so far (int8: one a weight)
        self._quantized_seen: dict[Hashable, int] = {}
        self.offsets_needed = 0
        #: float weights' f32 forms kept by `f32_form`, with their bytes
        self._float_forms: dict[Hashable, int] = {}
        #: whether a 4-bit weight's zero points make int8 offsets (`packed_int8`), by key
        self._zeros_int8: dict[Hashable, bool] = {}
        #: whether `kernels.matmul_offsets` gives `matmul_dequantized`'s bits, by shape
        self.fused_ok: dict[tuple, bool] = {}
        self.streamed = 0  # decode products made from packed weights kept in no form
        #: products with float weights whose f32 form is not kept, made a block at a time
        self.blocked = 0

    def get(self, key: Hashable, make: Callable[[], np.ndarray],
            keep: bool = True) -> np.ndarray:
        """The weight under `key`, made (and kept, while the budget allows) on a miss. A
        conversion that has no smaller form (a bf16 lm_head's f32 form: remaking it reads
        its source bytes again, 1.1 GB a token for a 7B model) may take the room of
        quantized weights' f32 forms, which then keep their offsets. `keep=False`: made
        on a miss, not kept."""
        hit = self._items.get(key)
        if hit is None:
            hit = make()
            if not keep:
                return hit
            self._make_room(hit.nbytes)
            self._keep(self._items, key, hit)
        return hit

    def f32_form(self, key: Hashable, w: np.ndarray, keep: bool = True) -> np.ndarray | None:
        """The f32 form of the float weight `w` under `key` (`kernels.f32`) where it is
        kept, or where the budget keeps it (made and kept now, `get`); None where it would
        not be kept (larger than the budget allows: a 14B model's bf16 lm_head, 3.1 GB in
        f32; or `keep=False` and not kept): its products are then made a block of rows
        at a time (`f32_rows_product`), never holding the whole f32 form."""
        hit = self._items.get(key)
        if hit is not None:
            return hit
        if keep and self._free() + self._givable >= 4 * w.size \
                and self.budget - sum(self._float_forms.values()) - 4 * w.size \
                >= self.offsets_needed:
            form = self.get(key, lambda: np.ascontiguousarray(K.f32(w)))
            if key in self._items:
                self._float_forms[key] = form.nbytes
            return form
        return None

    def f32_rows_product(self, x: np.ndarray, w: np.ndarray) -> np.ndarray | None:
        """x @ f32(w).T in f32 (no bias) for one row `x` (the lm_head net's: a decode
        step's, or each row of `sequence_logits`) and a weight `w` [N, K] whose f32 form is
        not kept: STREAM_ROWS rows converted at a time (`kernels.matmul_weight_rows`). The
        first product of each shape is checked against one product over the first
        CHECK_ROWS rows of the weight (the whole where it has no more; its whole f32 form
        is what this avoids): None where the bits differ (`fused_ok` keeps the verdict),
        for the caller to make the product whole as before. None too for an `x` of several
        rows: this host's BLAS (OpenBLAS 0.3.31) gives such products other bits for
        fewer output columns at small sizes (a one-row product's outputs were the same at
        every size tried: vocabularies of 96-152064, widths 128-5120)."""
        if not (x.flags.c_contiguous and w.ndim == 2 and math.prod(x.shape[:-1]) == 1):
            return None
        shape = ("f32w", x.shape, x.dtype.str, w.shape, w.dtype.str)
        verdict = self.fused_ok.get(shape)
        if verdict is False:
            return None
        if verdict is None:
            p = min(w.shape[0], CHECK_ROWS)
            head = w[:p]
            one = K.matmul(x, K.f32(head), transpose_b=True, out_dtype=np.float32)
            blocked = K.matmul_weight_rows(x, head, STREAM_ROWS)
            self.fused_ok[shape] = ok = one.tobytes() == blocked.tobytes()
            if not ok:
                return None
        self.blocked += 1
        return K.matmul_weight_rows(x, w, STREAM_ROWS)

    def dequantized(self, key: Hashable, qweight: np.ndarray, scales: np.ndarray,
                    zeros: np.ndarray | None, bits: int, group_size: int,
                    keep: bool = True, mins: np.ndarray | None = None) -> np.ndarray:
        """`kernels.dequantize(qweight, scales, zeros, bits, group_size, mins)` under `key`:
        its f32 form where kept, else made from its offsets where kept, else made and kept
        in the form the budget allows (see the module doc; `keep=False`: not kept)."""
        self._seen(key, qweight, bits)
        hit = self._items.get(key)
        if hit is not None:
            return hit
        off = self._offsets.get(key)
        if off is not None:
            return K.dequantize_offsets(off, scales, group_size, mins)
        if not keep:
            return K.dequantize(qweight, scales, zeros, bits, group_size, mins)
        off = K.weight_offsets(qweight, zeros, bits, group_size, mins is not None)
        w = K.dequantize_offsets(off, scales, group_size, mins)
        self._reserved_total -= self._reserved.pop(key, 0)
        if key not in self._given_up and self._keep(self._items, key, w):
            self._f32_quantized.append((key, w.nbytes, off.nbytes))
            self._givable += w.nbytes - off.nbytes
            return w
        self._make_room(off.nbytes)
        self._keep(self._offsets, key, off)
        return w

    def a16_product(self, key: Hashable, x: np.ndarray, qweight: np.ndarray,
                    scales: np.ndarray, zeros: np.ndarray | None, bits: int, group_size: int,
                    bias: np.ndarray | None, out_dtype: np.dtype | None,
                    keep: bool = True, mins: np.ndarray | None = None) -> np.ndarray:
        """`kernels.a16_matmul` with the weight under `key` (`dequantized`). Where the weight
        is kept as offsets and `x` has at most FUSED_ROWS rows (a decode step), the product
        expands the weight a block of rows at a time (`kernels.matmul_offsets`), once its
        bits were found equal to the whole weight's product for this shape on this host
        (the first product of each shape computes both; `fused_ok` holds the verdicts). A
        decode step's product with a weight kept in no form yet that `dequantized` would
        keep as offsets (its f32 form does not fit) keeps the offsets itself and is made
        from them the same way: its whole f32 form is not made for it."""
        self._seen(key, qweight, bits)
        off = self._offsets.get(key)
        rows = math.prod(x.shape[:-1])
        if off is None and rows <= FUSED_ROWS and key not in self._items:
            if not self._room_for_offsets(key, qweight, bits, keep):
                return self.streamed_product(x, qweight, scales, zeros, bits, group_size,
                                             bias, out_dtype, mins, key)
            if not self._f32_fits(key, qweight, bits):
                # kept as offsets (as `dequantized` would keep it), and this product made
                # from them a block at a time: its whole f32 form is never made
                off = K.weight_offsets(qweight, zeros, bits, group_size, mins is not None)
                self._reserved_total -= self._reserved.pop(key, 0)
                self._make_room(off.nbytes)
                self._keep(self._offsets, key, off)
        if off is None or rows > FUSED_ROWS:  # (a weight kept as offsets has no f32 form)
            w = self.dequantized(key, qweight, scales, zeros, bits, group_size, keep, mins)
            return K.matmul_dequantized(x, w, bias, out_dtype)
        shape = (x.shape, off.shape, off.dtype.str, group_size, scales.dtype.str,
                 None if mins is None else mins.dtype.str, None if bias is None else bias.shape)
        verdict = self.fused_ok.get(shape)
        if verdict:
            return K.matmul_offsets(x, off, scales, group_size, bias, out_dtype, mins=mins)
        whole = K.matmul_dequantized(x, K.dequantize_offsets(off, scales, group_size, mins),
                                     bias, out_dtype)
        if verdict is None:
            fused = K.matmul_offsets(x, off, scales, group_size, bias, out_dtype, mins=mins)
            self.fused_ok[shape] = (fused.dtype == whole.dtype
                                    and fused.tobytes() == whole.tobytes())
        return whole

    def _seen(self, key: Hashable, qweight: np.ndarray, bits: int) -> None:
        """Count the offsets' bytes of the quantized weight under `key` (once): what
        `offsets_needed` sums."""
        if key in self._quantized_seen:
            return
        n = qweight.shape[0]
        self._quantized_seen[key] = n * qweight.shape[-1] * (2 if bits == 4 else 1)
        self.offsets_needed += self._quantized_seen[key]
        if self.budget - sum(self._float_forms.values()) < self.offsets_needed:
            for kept in self._float_forms:  # the quantized weights' offsets need the room
                self.used -= self._items.pop(kept).nbytes
            self._float_forms.clear()

    def _f32_fits(self, key: Hashable, qweight: np.ndarray, bits: int) -> bool:
        """Whether `dequantized` would keep the weight under `key` as its f32 form: not
        given up before, and its f32 bytes within the free budget (its own reservation
        counted free, as `dequantized` releases it first)."""
        if key in self._given_up:
            return False
        n = qweight.shape[0]
        k = qweight.shape[-1] * (2 if bits == 4 else 1)
        return self._free() + self._reserved.get(key, 0) >= 4 * n * k

    def _room_for_offsets(self, key: Hashable, qweight: np.ndarray, bits: int,
                          keep: bool) -> bool:
        """Whether `dequantized` would keep the weight under `key` in some form: its f32
        form or (after giving up others' f32 forms) its offsets, int8 for 4-bit weights
        (an int16 form, which only wide zero points make, is counted as int8: the
        product then keeps it or not as `dequantized` decides)."""
        if not keep:
            return False
        n = qweight.shape[0]
        k = qweight.shape[-1] * (2 if bits == 4 else 1)
        return self._free() + self._givable + self._reserved.get(key, 0) >= n * k

    def streamed_product(self, x: np.ndarray, qweight: np.ndarray, scales: np.ndarray,
                         zeros: np.ndarray | None, bits: int, group_size: int,
                         bias: np.ndarray | None, out_dtype: np.dtype | None,
                         mins: np.ndarray | None = None, key: Hashable | None = None
                         ) -> np.ndarray:
        """`kernels.a16_matmul` of a few rows `x` without keeping anything of the weight:
        STREAM_ROWS rows' offsets (`kernels.weight_offsets`) at a time multiplied by
        `kernels.matmul_offsets`, whose blocks of rows are then those of the whole
        offsets' product, so its bits are `matmul_offsets`' (checked once per shape
        against the whole f32 weight's product, as `a16_product` checks; a shape whose
        bits differ is computed whole). `key`: the weight's (what the buffers hold), under
        which whether its zero points make int8 offsets is kept (checked once, not at
        every step)."""
        self.streamed += 1
        n = qweight.shape[0]
        first: np.ndarray | None = None
        narrow = bits == 4 and (self._zeros_int8.get(key) if key is not None else None)
        if bits == 4 and narrow is None:
            narrow = packed_int8(zeros)
            if key is not None:
                self._zeros_int8[key] = narrow
        if narrow:
            k, dtype = 2 * qweight.shape[-1], np.dtype(np.int8)  # weight_offsets' too
        else:
            first = K.weight_offsets(qweight[:STREAM_ROWS], _rows(zeros, 0, STREAM_ROWS),
                                     bits, group_size, mins is not None)
            k, dtype = first.shape[1], first.dtype
        shape = (x.shape, (n, k), dtype.str, group_size, scales.dtype.str,
                 None if mins is None else mins.dtype.str, None if bias is None else bias.shape)
        verdict = self.fused_ok.get(shape)
        if not verdict:
            whole = K.matmul_dequantized(
                x, K.dequantize(qweight, scales, zeros, bits, group_size, mins), bias,
                out_dtype)
            if verdict is None:
                fused = self._streamed(x, first, qweight, scales, zeros, bits, group_size,
                                       bias, out_dtype, mins, bool(narrow))
                self.fused_ok[shape] = (fused.dtype == whole.dtype
                                        and fused.tobytes() == whole.tobytes())
            return whole
        return self._streamed(x, first, qweight, scales, zeros, bits, group_size, bias,
                              out_dtype, mins, bool(narrow))

    @staticmethod
    def _streamed(x: np.ndarray, first: np.ndarray | None, qweight: np.ndarray,
                  scales: np.ndarray, zeros: np.ndarray | None, bits: int, group_size: int,
                  bias: np.ndarray | None, out_dtype: np.dtype | None,
                  mins: np.ndarray | None, narrow: bool = False) -> np.ndarray:
        """`streamed_product`'s blocks: a 4-bit weight's from its packed bytes a block at a
        time (`kernels.matmul_packed`: `matmul_offsets`' blocks and bits) where `first` is
        None; else STREAM_ROWS rows' offsets at a time, the first block's `first`.
        `narrow`: the zero points were found to make int8 offsets (`packed_int8`)."""
        if first is None:
            got = K.matmul_packed(x, qweight, scales, zeros, group_size, bias, out_dtype,
                                  mins=mins, zeros_checked=narrow)
            if got is not None:
                return got
            first = K.weight_offsets(qweight[:STREAM_ROWS], _rows(zeros, 0, STREAM_ROWS),
                                     bits, group_size, mins is not None)
        n = qweight.shape[0]
        out = np.empty((*x.shape[:-1], n), np.float32)
        for r0 in range(0, n, STREAM_ROWS):
            r1 = min(n, r0 + STREAM_ROWS)
            off = first if r0 == 0 else K.weight_offsets(
                qweight[r0:r1], _rows(zeros, r0, r1), bits, group_size, mins is not None)
            out[..., r0:r1] = K.matmul_offsets(x, off, scales[r0:r1], group_size, None,
                                               np.dtype(np.float32),
                                               mins=_rows(mins, r0, r1))
        return K._biased(out, bias, out_dtype, x)

    def _keep(self, store: dict[Hashable, np.ndarray], key: Hashable,
              value: np.ndarray) -> bool:
        """Keep `value` under `key` in `store` if it fits the free budget."""
        if self._free() < value.nbytes:
            return False
        store[key] = value
        self.used += value.nbytes
        return True

    def _make_room(self, nbytes: int) -> None:
        """Give up the quantized weights' f32 forms kept last until `nbytes` fit, keeping
        room for each one's offsets for when it comes again; none where all of them
        would not make the room."""
        if self._free() + self._givable < nbytes:
            return
        while self._free() < nbytes:
            last, f32_bytes, off_bytes = self._f32_quantized.pop()
            self.used -= self._items.pop(last).nbytes
            self._givable -= f32_bytes - off_bytes
            self._given_up.add(last)
            self._reserved[last] = off_bytes
            self._reserved_total += off_bytes

    def _free(self) -> int:
        """The budget not used nor reserved for the offsets of given-up weights."""
        return self.budget - self.used - self._reserved_total

    def forms(self) -> dict[str, int]:
        """How many weights are kept in each form: 'converted' (f32 and other converted
        forms), 'offsets' (quantized weights as q - z)."""
        return {"converted": len(self._items), "offsets": len(self._offsets)}

    def __len__(self) -> int:
        return len(self._items) + len(self._offsets)
