"""InternVL (InternVL2.5/3 in transformers' `internvl` form): the image tiled.

`GotOcr2ImageProcessorPil` tiles an image into up to `max_tiles` tiles of the compiled size
plus a thumbnail (`crop_to_patches`, as `InternVLProcessor` asks it to) and normalizes them;
each tile runs `vit` once and gives `tokens_per_tile` rows. The prompt text for the image is
the processor's own `replace_image_token`: `<img>` + `<IMG_CONTEXT>` x rows + `</img>`. The
text positions are the cache slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from toptpu.backend.contract import IMAGE_EMBEDS, PIXEL_VALUES
from toptpu.families.base import PreparedImage, VisionFamily


class InternVL(VisionFamily):
    name = "internvl"
    title = "InternVL"
    model_types = {"internvl": "InternVLForConditionalGeneration"}
    processor_class = "GotOcr2ImageProcessorPil"
    tokens = ("start_image_token", "end_image_token", "context_image_token")
    marker = "context_image_token"
    run = "tile"

    def vit_shapes(self, info: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
        size = info["image_size"]
        return {PIXEL_VALUES: (1, 3, size, size),
                IMAGE_EMBEDS: (1, info["tokens_per_tile"], shapes[IMAGE_EMBEDS][-1])}

    def prepare(self, processor: Any, info: Mapping[str, Any], image: Any, source: str
                ) -> PreparedImage:
        from transformers.models.internvl.processing_internvl import InternVLProcessor

        out = processor(image, crop_to_patches=True, max_patches=int(info["max_tiles"]),
                        return_tensors=None)  # crop_to_patches: as InternVLProcessor
        tiles = [np.asarray(t, np.float32) for t in out[PIXEL_VALUES]]
        t = info["tokens"]
        layout = SimpleNamespace(start_image_token=t["start_image_token"],
                                 end_image_token=t["end_image_token"],
                                 image_token=t["context_image_token"],
                                 image_seq_length=int(info["tokens_per_tile"]))
        placeholder = InternVLProcessor.replace_image_token(
            layout, {"num_patches": [len(tiles)]}, 0)
        return PreparedImage([{PIXEL_VALUES: x[None]} for x in tiles],
                             [int(info["tokens_per_tile"])] * len(tiles), placeholder)


FAMILY = InternVL()
