"""MiniCPM-V 4.6 and 4.7: an image sliced, each slice NaViT-packed; 4.7's canvas positions.

`MiniCPMV4_6ImageProcessorPil` (4.7 uses 4.6's) makes the source image and its slices (its
slice scheme, `max_slice_nums`), each NaViT-packed with its own patch grid; each runs `vit`
once, reordered and padded to the net's patch budget (`toptpu.backend.contract.pack_slice`),
and gives h*w/16 rows. The prompt text is the processor's `replace_image_token` (image and
slice start/end tokens, one row of slices per line) with the `<image_id>i</image_id>` prefix
of `use_image_id`. Each crop's patch grid is kept: MiniCPM-V 4.7 lays its image tokens out
on a canvas of positions from them (`toptpu.backend.contract.canvas_position_ids`: the
header's `canvas_markers`, the text nets taking a position per axis T, H, W).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    ATTENTION_MASK,
    CANVAS_MARKERS,
    IMAGE_EMBEDS,
    PIXEL_VALUES,
    POSITION_IDS_VIT,
    ContractError,
    canvas_position_ids,
    pack_slice,
)
from toptpu.errors import GenerationError, ImageError
from toptpu.families.base import (
    PreparedImage,
    PromptLayout,
    VisionFamily,
    VisionHeader,
    VisionItem,
    image_rows,
    no_layout_error,
)


class MiniCPMV(VisionFamily):
    name = "minicpmv"
    title = "MiniCPM-V"
    model_types = {"minicpmv4_6": "MiniCPMV4_6ForConditionalGeneration",
                   "minicpmv4_7": "MiniCPMV4_7ForConditionalGeneration"}
    canvas_model_types = ("minicpmv4_7",)
    processor_class = "MiniCPMV4_6ImageProcessorPil"
    tokens = ("image_token", "image_start_token", "image_end_token", "slice_start_token",
              "slice_end_token", "image_id_start_token", "image_id_end_token")
    marker = "image_token"
    run = "slice"
    header_keys = frozenset({"max_patches", "token_divisor", "merge_levels", "position_side"})
    optional_keys = frozenset({"canvas_markers"})

    # ------------------------------------------------------------------ header section
    def position_axes(self, info: VisionHeader) -> int:
        return 3 if info.canvas_markers is not None else 1

    def header_token_ids(self, info: VisionHeader) -> dict[str, int]:
        return {f"canvas_markers.{k}": v for k, v in (info.canvas_markers or {}).items()}

    def header_problems(self, info: VisionHeader) -> list[tuple[str, str]]:
        if info.canvas_markers is None:
            return []
        if sorted(info.canvas_markers) != sorted(CANVAS_MARKERS):
            return [("canvas_markers", f"names {sorted(info.canvas_markers)}, a canvas needs "
                                       f"{sorted(CANVAS_MARKERS)}")]
        if info.token_divisor not in (4, 16):
            return [("token_divisor", f"is {info.token_divisor}; a canvas merges 2x2 or 4x4 "
                                      "patches into a token (4 or 16)")]
        return []

    def vit_shapes(self, info: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
        n, p = int(info["max_patches"]), int(info["patch_size"])
        return {PIXEL_VALUES: (1, 3, p, n * p), POSITION_IDS_VIT: (1, n),
                IMAGE_EMBEDS: (1, n // int(info["token_divisor"]), shapes[IMAGE_EMBEDS][-1])}

    # ------------------------------------------------------------------ prompt text
    def image_id(self, info: Mapping[str, Any], index: int) -> str:
        if not info["processor"].get("use_image_id", True):
            return ""
        t = info["tokens"]
        return f"{t['image_id_start_token']}{index}{t['image_id_end_token']}"

    # ------------------------------------------------------------------ preprocessing
    def prepare(self, processor: Any, info: Mapping[str, Any], image: Any, source: str
                ) -> PreparedImage:
        from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

        v = info
        out = processor(image, return_tensors=None)
        pv = np.asarray(out[PIXEL_VALUES], np.float32)[0]  # [C, P, total * P]
        sizes = np.asarray(out["target_sizes"]).reshape(-1, 2)
        p, budget, div = int(v["patch_size"]), int(v["max_patches"]), int(v["token_divisor"])
        levels = [(int(a), int(b)) for a, b in v["merge_levels"]]
        for h, w in sizes:
            if h * w > budget:
                raise ImageError(
                    f"image '{source}' ({image.width}x{image.height}) becomes a slice of {h}x{w}"
                    f" = {h * w} patches in the {v['processor_class']}, more than the vit net's "
                    f"static budget of {budget} patches; recompile with --max-patches "
                    f"{-(-int(h * w) // div) * div} or larger (or use an image of a less "
                    "extreme aspect ratio)")
        feeds, rows, start = [], [], 0
        for h, w in sizes:
            n = int(h * w)
            packed = pack_slice(pv[:, :, start * p:(start + n) * p], int(h), int(w), budget,
                                levels, int(v["position_side"]))
            feeds.append(dict(zip((PIXEL_VALUES, POSITION_IDS_VIT, ATTENTION_MASK),
                                  packed, strict=True)))
            rows.append(n // div)
            start += n
        t = v["tokens"]
        layout = SimpleNamespace(slice_mode=bool(v["processor"].get("slice_mode", True)),
                                 **{k: t[k] for k in ("image_token", "image_start_token",
                                                      "image_end_token", "slice_start_token",
                                                      "slice_end_token")})
        placeholder = MiniCPMV4_6Processor.replace_image_token(
            layout, {"grids": out["grids"], "num_patches_per_image":
                     out["num_patches_per_image"], "target_sizes": sizes}, 0,
            image_token_divisor=div)
        return PreparedImage(feeds, rows, placeholder,
                             grids=tuple((int(h), int(w)) for h, w in sizes))

    # ------------------------------------------------------------------ prompt layout
    def lay_out(self, info: VisionHeader, ids: Sequence[int], skip: int,
                items: Sequence[VisionItem], next_position: int, axes: int) -> PromptLayout:
        """MiniCPM-V 4.7 (position axes 3): the canvas of the images' crops, the text
        continuing past it."""
        rows = image_rows(ids, skip, info.image_token_id, items, "image",
                          "or chat(images=...)")
        if axes == 1:
            return PromptLayout(rows)
        if info.canvas_markers is None or info.token_divisor is None:
            raise no_layout_error()
        is_image = [i in rows for i in range(len(ids))]
        grids = [g for im in items for g in im.grids]
        try:
            table, after = canvas_position_ids(ids, is_image, info.canvas_markers, grids,
                                               math.isqrt(info.token_divisor), next_position)
        except ContractError as e:
            raise GenerationError(f"cannot lay out the prompt's image positions: {e}") from e
        return PromptLayout(rows, positions=table, next_position=after)


FAMILY = MiniCPMV()
