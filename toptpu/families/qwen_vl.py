"""Qwen-VL: Qwen2.5-VL, Qwen3-VL and Qwen3.5, and the mixtures of experts Qwen3-VL-MoE and
Qwen3.5-MoE (images and videos, M-RoPE positions; the host side is the same for a MoE).

- An image: `Qwen2VLImageProcessorPil` resizes it within the vit net's patch budget (its
  `longest_edge`, set at compile time) and lays out its patches; one `vit` run per image
  over the budget (`toptpu.backend.contract.qwen_vit_inputs`), its merged rows put back in
  the model's order, and Qwen3-VL's DeepStack rows with them. The prompt text for the image
  is the processor's: the image pad token once per merged row, inside the chat template's
  `<|vision_start|>`/`<|vision_end|>`.
- A video: the frames are given as images (no video decoder is installed: the video
  processors of transformers need torchvision, which does not install beside torch 2.13).
  All frames must have one size. They are resized with the image processor (Pillow's
  bicubic, where the video processor resizes with torchvision: the pixels may differ
  slightly from a decoded video's) so that the video's patches fit the same budget (each
  frame gets an equal share), two consecutive frames make one temporal patch (an odd last
  frame is repeated, as the video processor pads), and the video runs the vit once. The
  placeholder is the processor's: Qwen2.5-VL's pad tokens (its positions spaced by
  `tokens_per_second` x seconds per temporal patch, from `fps`), Qwen3-VL's and Qwen3.5's
  `<t seconds>` timestamp and pads per temporal patch.
- Positions: every prompt (with images or not) is laid out by M-RoPE
  (`toptpu.backend.contract.mrope_position_ids`, the models' `get_rope_index` in numpy) from
  where the conversation stands; Qwen3-VL adds DeepStack rows to the first text layers
  (`deepstack_add`, in prefill chunks only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    DEEPSTACK_EMBEDS,
    IMAGE_EMBEDS,
    PIXEL_VALUES,
    POSITION_IDS_VIT,
    ContractError,
    mrope_position_ids,
    qwen_vit_inputs,
)
from toptpu.errors import GenerationError, ImageError
from toptpu.families.base import (
    PreparedImage,
    PromptLayout,
    VideoPatches,
    VisionFamily,
    VisionHeader,
    VisionItem,
    image_rows,
    markers_pattern,
)


class QwenVL(VisionFamily):
    name = "qwenvl"
    title = "Qwen-VL"
    model_types = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                   "qwen3_vl": "Qwen3VLForConditionalGeneration",
                   "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                   "qwen3_5": "Qwen3_5ForConditionalGeneration",
                   "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
    #: the model types whose videos space their frames in time (`tokens_per_second`);
    #: the others lay out each temporal patch as a grid of its own (`frames_apart`)
    spaced_video_types = ("qwen2_5_vl",)
    processor_class = "Qwen2VLImageProcessorPil"
    tokens = ("image_token", "video_token", "vision_start_token", "vision_end_token")
    marker = "image_token"
    run = "slice"
    header_keys = frozenset({"max_patches", "token_divisor", "qwen"})
    takes_video = True

    # ------------------------------------------------------------------ header section
    def position_axes(self, info: VisionHeader) -> int:
        """M-RoPE's T, H, W (a header without its `qwen` section is refused, first by its
        text nets' [3, n] positions)."""
        return 3 if info.qwen is not None else 1

    def header_token_ids(self, info: VisionHeader) -> dict[str, int]:
        q = info.qwen
        return {"qwen.video_token_id": q.video_token_id,
                "qwen.vision_start_token_id": q.vision_start_token_id,
                "qwen.vision_end_token_id": q.vision_end_token_id}

    def header_problems(self, info: VisionHeader) -> list[tuple[str, str]]:
        q = info.qwen
        if info.token_divisor != q.merge_size ** 2:
            return [("token_divisor", f"is {info.token_divisor}; a merge of {q.merge_size}x"
                                      f"{q.merge_size} patches makes {q.merge_size ** 2}")]
        if info.max_patches is not None and info.max_patches % (q.merge_size ** 2):
            return [("max_patches", f"is {info.max_patches}, not a multiple of "
                                    f"{info.token_divisor} (patches merged into a token)")]
        return []

    def vit_shapes(self, info: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
        n, q = int(info["max_patches"]), info["qwen"]
        rows = n // int(info["token_divisor"])
        width = shapes[IMAGE_EMBEDS][-1]
        want = {PIXEL_VALUES: (n, shapes[PIXEL_VALUES][-1]), POSITION_IDS_VIT: (n, 2),
                IMAGE_EMBEDS: (1, rows, width)}
        if int(q["deepstack_levels"]):
            want[DEEPSTACK_EMBEDS] = (rows, int(q["deepstack_levels"]), width)
        return want

    # ------------------------------------------------------------------ prompt text
    def marker_text(self, info: Mapping[str, Any], modality: str) -> str:
        """The marker inside the vision start/end tokens (as the chat template writes it)."""
        t = info["tokens"]
        return f"{t['vision_start_token']}{self.marker_of(info, modality)}" \
               f"{t['vision_end_token']}"

    def expand(self, info: Mapping[str, Any], text: str, items: Sequence[VisionItem],
               first_index: int = 0) -> str:
        """Image markers pair with the images, video markers with the videos, each in their
        order."""
        markers = {m: self.marker_of(info, m) for m in ("image", "video")}
        pattern = markers_pattern(list(markers.values()))
        queues = {m: [x for x in items if x.modality == m] for m in markers}
        found = {m: text.count(t) for m, t in markers.items()}
        for m, t in markers.items():
            if found[m] != len(queues[m]):
                raise GenerationError(
                    f"the prompt marks {found[m]} {m}(s) with {t!r} but {len(queues[m])} "
                    f"{m}(s) were given; put one marker per {m} (or none: they then go "
                    "before the text)")
        which = {t: m for m, t in markers.items()}
        return pattern.sub(lambda match: queues[which[match.group()]].pop(0).placeholder, text)

    # ------------------------------------------------------------------ preprocessing
    def _inputs(self, info: Mapping[str, Any], patches: np.ndarray,
                grid: tuple[int, int, int], what: str
                ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        q = info["qwen"]
        try:
            inputs = qwen_vit_inputs(patches, grid, int(info["max_patches"]),
                                     int(q["merge_size"]), patch_size=int(info["patch_size"]),
                                     window_size=q.get("window_size"),
                                     position_grid_side=q.get("position_grid_side"))
        except ContractError as e:
            raise ImageError(f"{what}: {e}; recompile with a larger --max-pixels (or "
                             "--max-patches)") from e
        return inputs.feeds, inputs.rows, inputs.tokens

    def prepare(self, processor: Any, info: Mapping[str, Any], image: Any, source: str
                ) -> PreparedImage:
        out = processor(image, return_tensors=None)
        pv = np.asarray(out[PIXEL_VALUES], np.float32)
        t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1))
        what = f"image '{source}' ({image.width}x{image.height})"
        feeds, order, tokens = self._inputs(info, pv, (t, h, w), what)
        pad = info["tokens"]["image_token"]
        return PreparedImage([feeds], [tokens], pad * tokens, order=order, grid_thw=(t, h, w))

    def prepare_video(self, processor: Any, info: Mapping[str, Any], images: list[Any],
                      fps: float, source: str) -> PreparedImage:
        video = self.video_patches(processor, info, images, fps, source)
        feeds, order, tokens = self._inputs(info, video.patches, video.grid, video.what)
        return PreparedImage([feeds], [tokens], video.placeholder, video.source, video.size,
                             order=order, modality="video", grid_thw=video.grid,
                             interval=video.interval, frames=video.frames)

    def video_patches(self, processor: Any, info: Mapping[str, Any], images: list[Any],
                      fps: float, source: str) -> VideoPatches:
        v, q = info, info["qwen"]
        p, tp, merge = int(v["patch_size"]), int(q["temporal_patch_size"]), int(q["merge_size"])
        steps = -(-len(images) // tp)
        size = dict(processor.size)
        share = int(v["max_patches"]) // steps * p * p  # each temporal patch an equal share
        if share < (merge * p) ** 2:
            raise ImageError(
                f"video '{source}' of {len(images)} frames makes {steps} temporal patches; the "
                f"vision net's budget of {v['max_patches']} patches leaves each less than one "
                f"merged token; give at most {int(v['max_patches']) // merge ** 2 * tp} frames "
                "or recompile with a larger --max-pixels")
        want = {"shortest_edge": min(int(size["shortest_edge"]), share), "longest_edge": share}
        try:
            out = processor(images, size=want, return_tensors=None)
        except (ValueError, TypeError, OSError) as e:
            raise ImageError(f"the {v['processor_class']} cannot take the frames of video "
                             f"'{source}': {e}") from e
        grids = np.asarray(out["image_grid_thw"]).reshape(-1, 3)
        _, h, w = (int(x) for x in grids[0])
        c = len(v["processor"].get("image_mean") or [0, 0, 0])
        # each frame's patches hold it twice in time (an image's temporal patch): keep one,
        # then pair consecutive frames as the video processor does (the last one repeated)
        frame = np.asarray(out[PIXEL_VALUES], np.float32).reshape(
            len(images), h * w, c, tp, p, p)[:, :, :, 0]
        frame = np.concatenate([frame, np.repeat(frame[-1:], steps * tp - len(images), 0)])
        pv = frame.reshape(steps, tp, h * w, c, p, p).transpose(0, 2, 3, 1, 4, 5)
        pv = np.ascontiguousarray(pv).reshape(steps * h * w, c * tp * p * p)
        what = f"video '{source}' ({len(images)} frames)"
        tokens = steps * h * w // merge ** 2
        t = v["tokens"]
        per_frame = tokens // steps
        if q.get("frames_apart"):  # Qwen3-VL, Qwen3.5: a timestamp before each temporal patch
            times = [i / fps for i in range(len(images))]
            times += [times[-1]] * (steps * tp - len(images))
            stamps = [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]
            placeholder = "".join(f"<{s:.1f} seconds>{t['vision_start_token']}"
                                  f"{t['video_token'] * per_frame}{t['vision_end_token']}"
                                  for s in stamps)
        else:
            placeholder = t["video_token"] * tokens
        interval = float(np.float32(q.get("tokens_per_second") or 1.0) * np.float32(tp / fps))
        return VideoPatches(pv, (steps, h, w), placeholder, interval, len(images), source,
                            images[0].size, what)

    # ------------------------------------------------------------------ prompt layout
    def lay_out(self, info: VisionHeader, ids: Sequence[int], skip: int,
                items: Sequence[VisionItem], next_position: int, axes: int) -> PromptLayout:
        """The image and video rows (and Qwen3-VL's DeepStack rows) of ids[skip:], and the
        M-RoPE positions of all `ids` from `next_position`, the image and video runs taking
        the items' grids."""
        q = info.qwen
        out = PromptLayout()
        for modality, token in (("image", info.image_token_id), ("video", q.video_token_id)):
            mine = [im for im in items if im.modality == modality]
            rows = image_rows(ids, skip, token, mine, modality,
                              "or chat(images=..., videos=...)")
            out.rows.update(rows)
            if rows and q.deepstack_levels:
                levels = np.concatenate([im.deepstack for im in mine], axis=1)
                out.deepstack.update({i: levels[:, k] for k, i in enumerate(sorted(rows))})
        kinds = {info.image_token_id: 1, q.video_token_id: 2}
        types = [kinds.get(int(t), 0) for t in ids]
        videos = [im for im in items if im.modality == "video"]
        try:
            out.positions, out.next_position = mrope_position_ids(
                types, [_grid(im) for im in items if im.modality == "image"],
                [_grid(im) for im in videos], q.merge_size, next_position,
                [im.interval for im in videos], frames_apart=q.frames_apart)
        except ContractError as e:
            raise GenerationError(f"cannot lay out the prompt's image positions: {e}") from e
        return out

    # ------------------------------------------------------------------ compile side
    def budget_error(self, need: int, seq_length: int, max_tiles: int, max_patches: int
                     ) -> str:
        return (f"an image at the vision net's budget of {max_patches} patches needs about "
                f"{need} tokens, more than --seq-length {seq_length}: raise --seq-length or "
                "lower --max-pixels (or --max-patches)")


def _grid(item: VisionItem) -> tuple[int, int, int]:
    """An encoded Qwen-VL image's (video's) patch grid (t, h, w)."""
    assert item.grid_thw is not None, "a Qwen-VL image is encoded with its grid"
    return item.grid_thw


FAMILY = QwenVL()
