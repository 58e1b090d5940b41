"""Images for VLM model files: load with Pillow, preprocess with the model's own image
processor, run the `vit` net per tile, and lay out the image placeholder tokens.

The model file's `vision` header section (written by `toptpu.frontends.vlm`) names the
family, the image processor class and its config, the image special tokens and the static
shapes of the `vit` net. What differs between the families (InternVL's tiles, MiniCPM-V's
NaViT-packed slices, Qwen-VL's patch budget and videos; the prompt text standing for an
image) is each family's host side (`toptpu.families`, one module per family); this module
opens the images, builds the processor, checks the net against the header and runs it.

Nothing is resized or cropped beyond what the processor does: an image whose slice has
more patches than the compiled budget is an `ImageError` naming both numbers. Video frames
are given as images (a path or a PIL image each; no video decoder is installed: the video
processors of transformers need torchvision, which does not install beside torch 2.13).

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
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from toptpu.backend.contract import DEEPSTACK_EMBEDS, IMAGE_EMBEDS
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.dialects.output_file import note_input
from toptpu.errors import GenerationError, ImageError
from toptpu.families import vision_family
from toptpu.families.base import PreparedImage, VideoPatches

if TYPE_CHECKING:
    from PIL import Image

#: an image as the runtime takes it: a path, or a PIL image
ImageInput: TypeAlias = "str | os.PathLike[str] | Image.Image"

__all__ = ["EncodedImage", "ImageError", "ImagePreprocessor", "PreparedImage", "VideoPatches",
           "VisionEncoder", "load_image"]


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


def load_image(image: ImageInput) -> Image.Image:
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


class ImagePreprocessor:
    """The host side of a model file's vision net: preprocessing and placeholder layout
    from the header's `vision` section (no executor needed), by its family's rules."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self.kind: str = info["kind"]
        self.family = vision_family(self.kind)
        self.net: str = info["net"]
        self.image_token_id = int(info["image_token_id"])
        self._processor: Any = None

    # ------------------------------------------------------------------ text layout
    @property
    def marker(self) -> str:
        """The text that marks where an image goes in a prompt (the model's image token)."""
        return self.family.marker_of(self.info, "image")

    def marker_of(self, modality: str) -> str:
        """The token that marks an image (or a Qwen-VL video) in a prompt."""
        return self.family.marker_of(self.info, modality)

    def marker_text(self, modality: str) -> str:
        """What stands for an image (video) put before a prompt's text: the marker, inside
        the vision start/end tokens for Qwen-VL (as its chat template writes them)."""
        return self.family.marker_text(self.info, modality)

    def expand(self, text: str, images: list[EncodedImage], first_index: int = 0) -> str:
        """Replace the i-th marker of `text` by the i-th image's placeholder text (with its
        image id for MiniCPM-V, counted from `first_index`). Markers and images must pair.
        Qwen-VL: image markers pair with the images, video markers with the videos, each in
        their order."""
        return self.family.expand(self.info, text, images, first_index)

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

    def prepare(self, image: ImageInput) -> PreparedImage:
        """Preprocess `image` (a path or a PIL image) with the model's image processor: the
        vit inputs of each tile and the image's placeholder text (no net runs)."""
        source = str(image) if isinstance(image, str | os.PathLike) else "<image>"
        img = load_image(image)
        try:
            prepared = self.family.prepare(self.processor, self.info, img, source)
        except ImageError:
            raise
        except (ValueError, TypeError, OSError) as e:
            raise ImageError(f"the {self.info['processor_class']} cannot take image "
                             f"'{source}' ({img.mode} {img.width}x{img.height}): {e}") from e
        prepared.source, prepared.size = source, (img.width, img.height)
        return prepared

    def prepare_video(self, frames: list[ImageInput], fps: float) -> PreparedImage:
        """Preprocess a video given as its frames (paths or PIL images, `fps` frames a
        second; Qwen-VL: see `toptpu.families.qwen_vl`). No net runs."""
        images, source = self._frames(frames, fps)
        return self.family.prepare_video(self.processor, self.info, images, fps, source)

    def video_patches(self, frames: list[ImageInput], fps: float) -> VideoPatches:
        """A video given as its frames through the image processor, as the video processor
        lays it out: its patches in the processor's order, its grid, placeholder text and
        temporal step."""
        images, source = self._frames(frames, fps)
        return self.family.video_patches(self.processor, self.info, images, fps, source)

    def _frames(self, frames: list[ImageInput], fps: float) -> tuple[list[Image.Image], str]:
        """A video's frames opened (all of one size), and its name."""
        if not self.family.takes_video:
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
        return images, source


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
        want = self.family.vit_shapes(self.info, shapes)
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

    def encode(self, image: ImageInput) -> EncodedImage:
        """Preprocess `image` and run the vision net on each tile: its embedding rows."""
        _ = self.processor  # imports transformers once; not part of the image's time
        t0, c0 = time.perf_counter(), self.ex.modelled_costs()
        return self._encoded(self.prepare(image), t0, c0)

    def encode_video(self, frames: list[ImageInput], fps: float) -> EncodedImage:
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
