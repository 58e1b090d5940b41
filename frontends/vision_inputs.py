"""The static-shape inputs of the MiniCPM-V `vit` net (numpy only, shared by the compiler's
check and the runtime).

MiniCPM-V packs each image slice NaViT-style: `pixel_values` [C, P, n * P] holds the n
patches of an h x w patch grid side by side in raster order, and the vision tower runs on
exactly those n patches (n varies with the slice's aspect ratio). Its window-attention
merger then regroups the tokens window by window (`get_vision_window_index`) and merges
each 2 x 2 window into one token; the downsample MLP merger merges 2 x 2 again.

A static net cannot take a varying n, nor gather by a data-dependent window index. Both
go away with one host-side permutation of the patches (`merge_order`): every attention
before, between and after the merges treats tokens as a set (it is permutation
equivariant, and the only mask is which tokens are real), patch embedding and position
embedding are per patch, so the patches may enter in any order. In *merge order* each
window of the innermost merge is 4 consecutive tokens, each window of the next merge is 4
consecutive merged tokens, and the final tokens come out in raster order of the merged
grid, exactly as the model's merger emits them. The slice is then padded to the net's
static patch budget N with masked tokens (`pack_slice`); n is a multiple of 16, so the
padding is whole windows at every level and the real tokens stay a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toptpu.frontends.masks import MASK_VALUE


def merge_order(h: int, w: int, levels: Sequence[tuple[int, int]]) -> np.ndarray:
    """Raster patch indices of an h x w grid in merge order for `levels` (innermost merge
    kernel (kh, kw) first): windows of each level are consecutive, row-major inside."""
    kh = int(np.prod([k[0] for k in levels])) if levels else 1
    kw = int(np.prod([k[1] for k in levels])) if levels else 1
    if h % kh or w % kw:
        raise ValueError(f"a {h}x{w} patch grid is not divisible by the merge kernels "
                         f"{list(levels)} ({kh}x{kw})")
    offsets = [(0, 0)]
    size = (1, 1)
    for lh, lw in levels:  # grow the block outwards: sub-blocks in raster order
        offsets = [(sy * size[0] + dy, sx * size[1] + dx)
                   for sy in range(lh) for sx in range(lw) for dy, dx in offsets]
        size = (size[0] * lh, size[1] * lw)
    block = np.array(offsets, np.int64)  # [kh*kw, 2]
    rows = np.arange(h // kh)[:, None, None] * kh + block[None, None, :, 0]
    cols = np.arange(w // kw)[None, :, None] * kw + block[None, None, :, 1]
    return (rows * w + cols).reshape(-1)


def nearest_position_ids(h: int, w: int, num_patches_per_side: int) -> np.ndarray:
    """The position-embedding rows of an h x w patch grid in raster order: the model's own
    `transformers.vision_utils.get_vision_nearest_position_ids` (bucketize of i/h on the
    learned side x side grid)."""
    import torch
    from transformers.vision_utils import get_vision_nearest_position_ids

    ids = get_vision_nearest_position_ids(torch.tensor([[h, w]]), num_patches_per_side)
    return ids.numpy().astype(np.int64)


def pack_slice(patches: np.ndarray, h: int, w: int, budget: int,
               levels: Sequence[tuple[int, int]], num_patches_per_side: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slice's NaViT patches [C, P, h*w*P] -> the vit net inputs at `budget` patches:
    pixel_values [1, C, P, budget*P] in merge order, position ids i32 [1, budget] and the
    key mask [1, 1, 1, budget] (0 for the h*w real patches, MASK_VALUE for padding)."""
    c, p, total = patches.shape
    n = h * w
    if total != n * p:
        raise ValueError(f"slice of {total // p} patches does not match its grid {h}x{w}")
    if n > budget:
        raise ValueError(f"slice of {n} patches exceeds the budget of {budget}")
    order = merge_order(h, w, levels)
    grid = patches.reshape(c, p, n, p)[:, :, order, :]
    pixels = np.zeros((c, p, budget, p), np.float32)
    pixels[:, :, :n] = grid
    pos = np.zeros((1, budget), np.int32)
    pos[0, :n] = nearest_position_ids(h, w, num_patches_per_side)[order]
    mask = np.full((1, 1, 1, budget), MASK_VALUE, np.float32)
    mask[..., :n] = 0.0
    return pixels.reshape(1, c, p, budget * p), pos, mask
