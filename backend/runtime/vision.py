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

Nothing is resized or cropped beyond what the processor does: an image whose slice has
more patches than the compiled budget is an `ImageError` naming both numbers.

The processor objects and layouts come from `transformers` (Pillow backends: no
torchvision), imported when the first image is encoded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    ATTENTION_MASK,
    IMAGE_EMBEDS,
    PIXEL_VALUES,
    POSITION_IDS_VIT,
    VISION_KINDS,
    pack_slice,
)
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer, Executor


class ImageError(GenerationError):
    """An image that cannot be read or that the compiled shapes cannot take."""


def load_image(image: Any) -> Any:
    """A PIL image from a path (or a PIL image as is), fully decoded: a missing file, a
    file that is not an image, or a truncated one is an ImageError naming it."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    path = os.fspath(image)
    if not os.path.exists(path):
        raise ImageError(f"image '{path}' does not exist")
    if os.path.isdir(path):
        raise ImageError(f"image '{path}' is a directory, not an image file")
    try:
        img = Image.open(path)
        img.load()  # decode now: a truncated file fails here, not in the processor
    except UnidentifiedImageError as e:
        raise ImageError(f"'{path}' is not an image Pillow can read (PNG, JPEG, WebP, ...): "
                         f"{e}") from e
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

    def expand(self, text: str, images: list[EncodedImage], first_index: int = 0) -> str:
        """Replace the i-th marker of `text` by the i-th image's placeholder text (with its
        image id for MiniCPM-V, counted from `first_index`). Markers and images must pair."""
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
        t0, m0 = time.perf_counter(), self.ex.modelled_seconds()
        p = self.prepare(image)
        rows = np.concatenate([self._run(f)[0, :n] for f, n in zip(p.feeds, p.rows,
                                                                     strict=True)])
        t1, m1 = time.perf_counter(), self.ex.modelled_seconds()
        return EncodedImage(p.source, p.size, len(p.feeds), p.placeholder, rows, t1 - t0,
                            (m1 - m0) if m1 > 0 else None, p.grids)
