"""Images for VLM model files: load with Pillow, preprocess with the model's own image
processor, run the `vit` net per tile, and lay out the image placeholder tokens.

The model file's `vision` header section (written by `toptpu.frontends.vlm`) names the
family, the image processor class and its config, the image special tokens and the static
shapes of the `vit` net. For one image:

- InternVL: `GotOcr2ImageProcessorPil` tiles the image into up to `max_tiles` tiles of the
  compiled size plus a thumbnail (`crop_to_patches`, as `InternVLProcessor` asks it to) and
  normalizes them; each tile runs `vit` once and gives `tokens_per_tile` rows. The prompt
  text for the image is the processor's own `replace_image_token`:
  `<img>` + `<IMG_CONTEXT>` x rows + `</img>`.
- MiniCPM-V 4.6 and 4.7: `MiniCPMV4_6ImageProcessorPil` (4.7 uses 4.6's) makes the
  source image and its slices
  (its slice scheme, `max_slice_nums`), each NaViT-packed with its own patch grid; each
  runs `vit` once, reordered and padded to the net's patch budget
  (`toptpu.backend.contract.pack_slice`), and gives h*w/16 rows. The prompt text is
  the processor's `replace_image_token` (image and slice start/end tokens, one row of
  slices per line) with the `<image_id>i</image_id>` prefix of `use_image_id`. Each
  crop's patch grid (`grids`) is kept: MiniCPM-V 4.7 lays its image tokens out on a canvas
  of positions from them (`toptpu.backend.contract.canvas_position_ids`).

- Qwen2.5-VL, Qwen3-VL and Qwen3.5 (`qwenvl`): `Qwen2VLImageProcessorPil` resizes the
  image within the vit net's patch budget (its `longest_edge`, set at compile time) and
  lays out its patches; one `vit` run per image over the budget
  (`toptpu.backend.contract.qwen_vit_inputs`), its merged rows put back in the model's
  order, and Qwen3-VL's DeepStack rows with them. The prompt text for the image is the
  processor's: the image pad token once per merged row, inside the chat template's
  `<|vision_start|>`/`<|vision_end|>`.
- Video (`qwenvl`): the frames are given as images (a path or a PIL image each; no video
  decoder is installed: the video processors of transformers need torchvision, which does
  not install beside torch 2.13). All frames must have one size. They are resized with the
  image processor (Pillow's bicubic, where the video processor resizes with torchvision:
  the pixels may differ slightly from a decoded video's) so that the video's patches fit
  the same budget (each frame gets an equal share), two consecutive frames make one
  temporal patch (an odd last frame is repeated, as the video processor pads), and the
  video runs the vit once. The placeholder is the processor's: Qwen2.5-VL's pad tokens
  (its positions spaced by `tokens_per_second` x seconds per temporal patch, from
  `fps`), Qwen3-VL's and Qwen3.5's `<t seconds>` timestamp and pads per temporal patch.

Nothing is resized or cropped beyond what the processor does: an image whose slice has
more patches than the compiled budget is an `ImageError` naming both numbers.

The processor objects and layouts come from `transformers` (Pillow backends: no
torchvision), imported when the first image is encoded.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    ATTENTION_MASK,
    DEEPSTACK_EMBEDS,
    IMAGE_EMBEDS,
    PIXEL_VALUES,
    POSITION_IDS_VIT,
    VISION_KINDS,
    ContractError,
    pack_slice,
    qwen_vit_inputs,
)
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.dialects.output_file import note_input


class ImageError(GenerationError):
    """An image that cannot be read or that the compiled shapes cannot take."""


#: most pixels of an image toptpu decodes (8192 x 8192, 64 Mpx): the processors resize
#: every image to the vision net's budget anyway, and an image file can claim any size in
#: a few bytes (a 92-byte PNG of 50000 x 50000 would take 7.5 GB to decode)
MAX_IMAGE_PIXELS = 8192 * 8192
_BOMB_SIZE = re.compile(r"\((\d+) pixels\)")


def image_file(path: str) -> str:
    """`path` checked as an image file before anything is read from it: it exists and is
    a regular file (a FIFO would block the read forever, a device never end); an
    ImageError naming it otherwise."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ImageError(f"image '{path}' does not exist") from None
    except OSError as e:
        raise ImageError(f"image '{path}' cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise ImageError(f"image '{path}' is a directory, not an image file")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise ImageError(f"image '{path}' is {kind}, not an image file: pass a regular file")
    return path


def load_image(image: Any) -> Any:
    """A PIL image from a path (or a PIL image as is), fully decoded: a missing file, a
    file that is not a regular file (a FIFO), not an image, or a truncated one is an
    ImageError naming it, and so is one that claims more than MAX_IMAGE_PIXELS (refused
    from its header, before it is decoded)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    path = image_file(os.fspath(image))
    too_big = (f"more than toptpu decodes ({MAX_IMAGE_PIXELS} pixels, 8192x8192): "
               "downscale it first")
    try:  # without blocking: a FIFO swapped in after the check cannot hang
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ImageError(f"image '{path}' cannot be read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageError(f"image '{path}' is not a regular file: pass an image file")
        note_input(fd, path)
        try:
            with warnings.catch_warnings():  # the size is checked here, not warned about
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(f)  # the header only
                width, height = img.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"image '{path}' is {width}x{height} "
                                     f"({width * height} pixels), {too_big}")
                img.load()  # decode now: a truncated file fails here, not in the processor
        except Image.DecompressionBombError as e:  # beyond PIL's own limit: its header
            m = _BOMB_SIZE.search(str(e))
            size = f"{m.group(1)} pixels" if m else "a size"
            raise ImageError(f"image '{path}' claims {size}, {too_big}") from None
        except UnidentifiedImageError as e:
            raise ImageError(f"'{path}' is not an image Pillow can read (PNG, JPEG, WebP, "
                             f"...): {e}") from e
        except (OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"image '{path}' is corrupt or truncated: {e}") from e
    if img.width < 1 or img.height < 1:
        raise ImageError(f"image '{path}' is empty ({img.width}x{img.height})")
    return img


@dataclass
class EncodedImage:
    """One image through the vision net: the rows that replace its placeholder tokens."""

    source: str
    size: tuple[int, int]  # (width, height) of the input image
    tiles: int  # vit runs (tiles + thumbnail, or source + slices)
    placeholder: str  # the prompt text standing for the image (without an image id)
    embeds: np.ndarray  # [image_tokens, H] f32, in placeholder order
    host_s: float
    modelled_s: float | None  # None: the executor has no cost model
    #: MiniCPM-V: the patch grid (h, w) of each crop (source, then slices), in order
    grids: tuple[tuple[int, int], ...] = ()
    #: Qwen-VL: "image" or "video", the patch grid (t, h, w), Qwen3-VL's DeepStack rows
    #: [K, tokens, H], a video's temporal position step (Qwen2.5-VL) and frame count
    modality: str = "image"
    grid_thw: tuple[int, int, int] | None = None
    deepstack: np.ndarray | None = None
    interval: float = 1.0
    frames: int = 1
    #: the modelled chip time of the vision net runs by where it goes (None: no cost model)
    modelled_costs: Costs | None = None

    @property
    def image_tokens(self) -> int:
        return int(self.embeds.shape[0])


@dataclass
class PreparedImage:
    """One image preprocessed for the vision net (before any run)."""

    feeds: list[dict[str, np.ndarray]]  # the vit inputs of each tile / slice
    rows: list[int]  # how many leading output rows of each run are image tokens
    placeholder: str
    source: str = ""
    size: tuple[int, int] = (0, 0)
    grids: tuple[tuple[int, int], ...] = ()  # MiniCPM-V: each crop's patch grid (h, w)
    #: Qwen-VL: the order that puts the net's rows in the model's (`QwenVitInputs.rows`),
    #: the modality, the grid (t, h, w), a video's temporal step and frame count
    order: np.ndarray | None = None
    modality: str = "image"
    grid_thw: tuple[int, int, int] | None = None
    interval: float = 1.0
    frames: int = 1


@dataclass
class VideoPatches:
    """A video's frames through the image processor, as the video processor lays them out:
    `patches` [t*h*w, C*T*P*P] in its order, the `grid` (t, h, w), the placeholder text,
    the temporal position step of Qwen2.5-VL (`interval`: tokens_per_second x seconds per
    temporal patch) and the number of frames given."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    placeholder: str
    interval: float
    frames: int
    source: str
    size: tuple[int, int]
    what: str


class ImagePreprocessor:
    """The host side of a model file's vision net: preprocessing and placeholder layout
    from the header's `vision` section (no executor needed)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.kind: str = info["kind"]
        self.net: str = info["net"]
        self.image_token_id = int(info["image_token_id"])
        self._processor: Any = None

    # ------------------------------------------------------------------ text layout
    @property
    def marker(self) -> str:
        """The text that marks where an image goes in a prompt (the model's image token)."""
        _, _, marker = VISION_KINDS[self.kind]
        return str(self.info["tokens"][marker])

    def marker_of(self, modality: str) -> str:
        """The token that marks an image (or a Qwen-VL video) in a prompt."""
        if modality == "video":
            if self.kind != "qwenvl":
                raise GenerationError(f"a {self.info['model_type']} model file takes images, "
                                      "not videos")
            return str(self.info["tokens"]["video_token"])
        return self.marker

    def marker_text(self, modality: str) -> str:
        """What stands for an image (video) put before a prompt's text: the marker, inside
        the vision start/end tokens for Qwen-VL (as its chat template writes them)."""
        marker = self.marker_of(modality)
        if self.kind == "qwenvl":
            t = self.info["tokens"]
            return f"{t['vision_start_token']}{marker}{t['vision_end_token']}"
        return marker + "\n"

    def expand(self, text: str, images: list[EncodedImage], first_index: int = 0) -> str:
        """Replace the i-th marker of `text` by the i-th image's placeholder text (with its
        image id for MiniCPM-V, counted from `first_index`). Markers and images must pair.
        Qwen-VL: image markers pair with the images, video markers with the videos, each in
        their order."""
        if self.kind == "qwenvl":
            return self._expand_qwen(text, images)
        parts = text.split(self.marker)
        if len(parts) - 1 != len(images):
            raise GenerationError(
                f"the prompt marks {len(parts) - 1} image(s) with {self.marker!r} but "
                f"{len(images)} image(s) were given; put one marker per image (or none: the "
                "images then go before the text)")
        out = [parts[0]]
        for i, (img, rest) in enumerate(zip(images, parts[1:], strict=True)):
            out += [self._image_id(first_index + i) + img.placeholder, rest]
        return "".join(out)

    def _expand_qwen(self, text: str, items: list[EncodedImage]) -> str:
        markers = {m: self.marker_of(m) for m in ("image", "video")}
        pattern = re.compile("|".join(re.escape(t) for t in markers.values()))
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

    def _image_id(self, index: int) -> str:
        if self.kind != "minicpmv" or not self.info["processor"].get("use_image_id", True):
            return ""
        t = self.info["tokens"]
        return f"{t['image_id_start_token']}{index}{t['image_id_end_token']}"

    # ------------------------------------------------------------------ encoding
    @property
    def processor(self) -> Any:
        if self._processor is None:
            import transformers

            cls = getattr(transformers, self.info["processor_class"])
            cfg = {k: v for k, v in self.info["processor"].items()
                   if k != "image_processor_type"}
            try:
                self._processor = cls(**cfg)
            except (TypeError, ValueError) as e:
                raise GenerationError(f"the model file's image processor config does not "
                                      f"make a {cls.__name__}: {e}; recompile it") from e
        return self._processor

    def prepare(self, image: Any) -> PreparedImage:
        """Preprocess `image` (a path or a PIL image) with the model's image processor: the
        vit inputs of each tile and the image's placeholder text (no net runs)."""
        source = str(image) if isinstance(image, str | os.PathLike) else "<image>"
        img = load_image(image)
        try:
            if self.kind == "internvl":
                prepared = self._internvl(img)
            elif self.kind == "qwenvl":
                prepared = self._qwen_image(img, source)
            else:
                prepared = self._minicpmv(img, source)
        except ImageError:
            raise
        except (ValueError, TypeError, OSError) as e:
            raise ImageError(f"the {self.info['processor_class']} cannot take image "
                             f"'{source}' ({img.mode} {img.width}x{img.height}): {e}") from e
        prepared.source, prepared.size = source, (img.width, img.height)
        return prepared

    def _internvl(self, img: Any) -> PreparedImage:
        from transformers.models.internvl.processing_internvl import InternVLProcessor

        v = self.info
        out = self.processor(img, crop_to_patches=True, max_patches=int(v["max_tiles"]),
                             return_tensors=None)  # crop_to_patches: as InternVLProcessor
        tiles = [np.asarray(t, np.float32) for t in out[PIXEL_VALUES]]
        t = v["tokens"]
        layout = SimpleNamespace(start_image_token=t["start_image_token"],
                                 end_image_token=t["end_image_token"],
                                 image_token=t["context_image_token"],
                                 image_seq_length=int(v["tokens_per_tile"]))
        placeholder = InternVLProcessor.replace_image_token(
            layout, {"num_patches": [len(tiles)]}, 0)
        return PreparedImage([{PIXEL_VALUES: x[None]} for x in tiles],
                             [int(v["tokens_per_tile"])] * len(tiles), placeholder)

    # ------------------------------------------------------------------ Qwen-VL
    def _qwen_inputs(self, patches: np.ndarray, grid: tuple[int, int, int], what: str
                     ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        v, q = self.info, self.info["qwen"]
        try:
            inputs = qwen_vit_inputs(patches, grid, int(v["max_patches"]), int(q["merge_size"]),
                                     patch_size=int(v["patch_size"]),
                                     window_size=q.get("window_size"),
                                     position_grid_side=q.get("position_grid_side"))
        except ContractError as e:
            raise ImageError(f"{what}: {e}; recompile with a larger --max-pixels (or "
                             "--max-patches)") from e
        return inputs.feeds, inputs.rows, inputs.tokens

    def _qwen_image(self, img: Any, source: str) -> PreparedImage:
        out = self.processor(img, return_tensors=None)
        pv = np.asarray(out[PIXEL_VALUES], np.float32)
        t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1))
        what = f"image '{source}' ({img.width}x{img.height})"
        feeds, order, tokens = self._qwen_inputs(pv, (t, h, w), what)
        pad = self.info["tokens"]["image_token"]
        return PreparedImage([feeds], [tokens], pad * tokens, order=order, grid_thw=(t, h, w))

    def prepare_video(self, frames: list[Any], fps: float) -> PreparedImage:
        """Preprocess a video given as its frames (paths or PIL images, `fps` frames a
        second): see the module doc. No net runs."""
        video = self.video_patches(frames, fps)
        feeds, order, tokens = self._qwen_inputs(video.patches, video.grid, video.what)
        return PreparedImage([feeds], [tokens], video.placeholder, video.source, video.size,
                             order=order, modality="video", grid_thw=video.grid,
                             interval=video.interval, frames=video.frames)

    def video_patches(self, frames: list[Any], fps: float) -> VideoPatches:
        """A video given as its frames through the image processor, as the video processor
        lays it out (see the module doc): its patches in the processor's order, its grid,
        placeholder text and temporal step."""
        if self.kind != "qwenvl":
            raise GenerationError(f"a {self.info['model_type']} model file takes images, not "
                                  "videos")
        if not frames:
            raise ImageError("a video needs at least one frame")
        if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
            raise ImageError(f"a video's frame rate must be a positive number, got {fps!r}")
        images = [load_image(f) for f in frames]
        sizes = {(im.width, im.height) for im in images}
        source = str(frames[0]) if isinstance(frames[0], str | os.PathLike) else "<video>"
        if len(sizes) != 1:
            raise ImageError(f"the frames of video '{source}' have different sizes "
                             f"{sorted(sizes)}; give frames of one size")
        v, q = self.info, self.info["qwen"]
        p, tp, merge = int(v["patch_size"]), int(q["temporal_patch_size"]), int(q["merge_size"])
        steps = -(-len(images) // tp)
        size = dict(self.processor.size)
        share = int(v["max_patches"]) // steps * p * p  # each temporal patch an equal share
        if share < (merge * p) ** 2:
            raise ImageError(
                f"video '{source}' of {len(images)} frames makes {steps} temporal patches; the "
                f"vision net's budget of {v['max_patches']} patches leaves each less than one "
                f"merged token; give at most {int(v['max_patches']) // merge ** 2 * tp} frames "
                "or recompile with a larger --max-pixels")
        want = {"shortest_edge": min(int(size["shortest_edge"]), share), "longest_edge": share}
        try:
            out = self.processor(images, size=want, return_tensors=None)
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
        t = self.info["tokens"]
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

    def _minicpmv(self, img: Any, source: str) -> PreparedImage:
        from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

        v = self.info
        out = self.processor(img, return_tensors=None)
        pv = np.asarray(out[PIXEL_VALUES], np.float32)[0]  # [C, P, total * P]
        sizes = np.asarray(out["target_sizes"]).reshape(-1, 2)
        p, budget, div = int(v["patch_size"]), int(v["max_patches"]), int(v["token_divisor"])
        levels = [tuple(k) for k in v["merge_levels"]]
        for h, w in sizes:
            if h * w > budget:
                raise ImageError(
                    f"image '{source}' ({img.width}x{img.height}) becomes a slice of {h}x{w} = "
                    f"{h * w} patches in the {v['processor_class']}, more than the vit net's "
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


class VisionEncoder(ImagePreprocessor):
    """Encodes images with a model file's `vit` net on an executor (see the module doc)."""

    def __init__(self, executor: Executor, header: dict[str, Any]) -> None:
        if "vision" not in header:
            raise GenerationError("this model file has no vision net: images need a "
                                  "compiled InternVL or MiniCPM-V model")
        super().__init__(header["vision"])
        self.ex = executor
        nets = executor.nets()
        if self.net not in nets:
            raise GenerationError(f"the model file names the vision net '{self.net}' but has "
                                  f"no such net; recompile it")
        self.net_info = nets[self.net]
        self._buffers: dict[str, Buffer] | None = None
        self._check_shapes()

    def _check_shapes(self) -> None:
        """The header's numbers must be the net's static shapes (they are read back from
        the net; a file whose header disagrees is refused)."""
        shapes = {s.name: s.shape for s in (*self.net_info.inputs, *self.net_info.outputs)}
        v = self.info
        if self.kind == "internvl":
            want = {PIXEL_VALUES: (1, 3, v["image_size"], v["image_size"]),
                    IMAGE_EMBEDS: (1, v["tokens_per_tile"], shapes[IMAGE_EMBEDS][-1])}
        elif self.kind == "qwenvl":
            n, q = int(v["max_patches"]), v["qwen"]
            rows = n // int(v["token_divisor"])
            width = shapes[IMAGE_EMBEDS][-1]
            want = {PIXEL_VALUES: (n, shapes[PIXEL_VALUES][-1]), POSITION_IDS_VIT: (n, 2),
                    IMAGE_EMBEDS: (1, rows, width)}
            if int(q["deepstack_levels"]):
                want[DEEPSTACK_EMBEDS] = (rows, int(q["deepstack_levels"]), width)
        else:
            n, p = int(v["max_patches"]), int(v["patch_size"])
            want = {PIXEL_VALUES: (1, 3, p, n * p), POSITION_IDS_VIT: (1, n),
                    IMAGE_EMBEDS: (1, n // int(v["token_divisor"]), shapes[IMAGE_EMBEDS][-1])}
        bad = [f"{k} is {list(shapes.get(k, ()))}, the header says {list(s)}"
               for k, s in want.items() if tuple(shapes.get(k, ())) != tuple(s)]
        if bad:
            raise GenerationError(f"the vision net '{self.net}' does not match the model "
                                  f"file's vision header ({'; '.join(bad)}); recompile it")

    def _bufs(self) -> dict[str, Buffer]:
        if self._buffers is None:
            self._buffers = {s.name: self.ex.alloc(s.shape, s.dtype)
                             for s in (*self.net_info.inputs, *self.net_info.outputs)}
        return self._buffers

    def _run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        b = self._bufs()
        for name, arr in feeds.items():
            self.ex.write(b[name], arr)
        self.ex.run(self.net, b)
        return self.ex.read(b[IMAGE_EMBEDS]).astype(np.float32)

    def encode(self, image: Any) -> EncodedImage:
        """Preprocess `image` and run the vision net on each tile: its embedding rows."""
        _ = self.processor  # imports transformers once; not part of the image's time
        t0, c0 = time.perf_counter(), self.ex.modelled_costs()
        return self._encoded(self.prepare(image), t0, c0)

    def encode_video(self, frames: list[Any], fps: float) -> EncodedImage:
        """Preprocess a video given as frames (Qwen-VL) and run the vision net on it."""
        _ = self.processor
        t0, c0 = time.perf_counter(), self.ex.modelled_costs()
        return self._encoded(self.prepare_video(frames, fps), t0, c0)

    def _encoded(self, p: PreparedImage, t0: float, c0: Costs | None) -> EncodedImage:
        deepstack = None
        if p.order is not None:  # Qwen-VL: one run, its rows back in the model's order
            (feeds,), (n,) = p.feeds, p.rows
            rows = self._run(feeds)[0, p.order[:n]]
            if DEEPSTACK_EMBEDS in self._bufs():
                levels = self.ex.read(self._bufs()[DEEPSTACK_EMBEDS]).astype(np.float32)
                deepstack = levels[p.order[:n]].transpose(1, 0, 2)  # [K, tokens, H]
        else:
            rows = np.concatenate([self._run(f)[0, :n] for f, n in zip(p.feeds, p.rows,
                                                                         strict=True)])
        t1, c1 = time.perf_counter(), self.ex.modelled_costs()
        costs = c1 - c0 if c0 is not None and c1 is not None else None
        return EncodedImage(p.source, p.size, len(p.feeds), p.placeholder, rows, t1 - t0,
                            costs.total_s if costs is not None else None, p.grids,
                            p.modality, p.grid_thw, deepstack, p.interval, p.frames, costs)
