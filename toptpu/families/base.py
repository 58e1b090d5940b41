"""What a model family is: a text family (data: names, model types, what its layers are)
and a vision family (a class: its header section, its host side and the facts its compile
side needs). The table of them is `toptpu.families`.

Torch-free: the runtime imports this package. A vision family's host side calls the
model's own image processor (transformers, imported by the runtime's `vision.py` when the
first image is encoded) on an image already opened (`toptpu.backend.runtime.vision`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from toptpu.errors import GenerationError

# =========================================================================== text


@dataclass(frozen=True)
class TextFamily:
    """A family of text models: the layers toptpu's splitter cuts are the same for all its
    model types (what differs within a family, a bias or a q/k norm, the splitter reads
    from the modules)."""

    #: the family name model files carry (`model.family`)
    name: str
    #: how a message names it
    title: str
    #: the transformers `model_type`s of its text models
    model_types: tuple[str, ...]
    #: the transformers config class of its structure (`toptpu.calibration` builds configs)
    config_class: str
    #: text model types of VLMs (no causal LM of their own in transformers) whose layers
    #: are this family's
    vlm_text_types: tuple[str, ...] = ()
    #: layers of two kinds, full attention and linear attention (`layer_types`)
    hybrid: bool = False
    #: checkpoint tensor prefixes of parts toptpu does not compile
    skipped_prefixes: tuple[str, ...] = ()
    #: model types of its kin toptpu knows of and does not compile (yet) -> what to do
    refused: Mapping[str, str] = field(default_factory=dict)


# =========================================================================== vision

#: the keys of a model file's `vision` section that only some families carry
#: (`toptpu.backend.formats.llm_file.VisionInfo`)
FAMILY_KEYS = ("max_patches", "token_divisor", "merge_levels", "position_side", "qwen",
               "canvas_markers")


class VisionHeader(Protocol):
    """The model file's typed `vision` section as the layouts read it
    (`toptpu.backend.formats.llm_file.VisionInfo`)."""

    @property
    def kind(self) -> str: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def token_ids(self) -> dict[str, int]: ...

    @property
    def max_patches(self) -> int | None: ...

    @property
    def token_divisor(self) -> int | None: ...

    @property
    def canvas_markers(self) -> dict[str, int] | None: ...

    @property
    def qwen(self) -> Any: ...


class VisionItem(Protocol):
    """An image (or video) through the vision net, as a prompt layout reads it
    (`toptpu.backend.runtime.vision.EncodedImage`)."""

    @property
    def embeds(self) -> np.ndarray: ...

    @property
    def placeholder(self) -> str: ...

    @property
    def image_tokens(self) -> int: ...

    @property
    def modality(self) -> str: ...

    @property
    def grids(self) -> tuple[tuple[int, int], ...]: ...

    @property
    def grid_thw(self) -> tuple[int, int, int] | None: ...

    @property
    def deepstack(self) -> np.ndarray | None: ...

    @property
    def interval(self) -> float: ...


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


@dataclass
class PromptLayout:
    """What a prompt's images put into its prefill, by index in the prompt: the rows that
    replace the embeddings of its image (video) tokens, Qwen3-VL's DeepStack rows
    ([levels, H] each), and, when the text nets take a position per rotary axis, its
    positions [axes, n] and the position of the token after it."""

    rows: dict[int, np.ndarray] = field(default_factory=dict)
    deepstack: dict[int, np.ndarray] = field(default_factory=dict)
    positions: np.ndarray | None = None
    next_position: int = 0


def no_layout_error() -> GenerationError:
    return GenerationError("the model file's text nets take a position per axis but its "
                           "header has no canvas to lay them out; recompile it")


def image_rows(ids: Sequence[int], skip: int, token: int, items: Sequence[VisionItem],
               what: str, hint: str) -> dict[int, np.ndarray]:
    """Index in `ids` -> vision row for the tokens `token` of ids[skip:] (the `items`' rows
    in order); a GenerationError when their counts differ (`what`: image or video)."""
    where = [i for i in range(skip, len(ids)) if ids[i] == token]
    count = sum(int(im.image_tokens) for im in items)
    if len(where) != count:
        raise GenerationError(
            f"the prompt holds {len(where)} {what} tokens (id {token}) but the {len(items)} "
            f"{what}(s) give {count} embedding rows; build the prompt with "
            f"Runtime.image_prompt ({hint}), which lays out the tokens")
    if not count:
        return {}
    table = np.concatenate([im.embeds for im in items])
    return {i: table[k] for k, i in enumerate(where)}


class VisionFamily:
    """A family of VLMs: its vision net's header section, its host side (preprocessing an
    image for the `vit` net, the prompt text standing for it, the prompt's layout) and the
    facts its compile side needs (model types, processor, tokens). One subclass per family
    module; the torch side of compiling it (the `vit` wrapper, checked against the model's
    own image features) is `toptpu.frontends.vlm`'s for this family."""

    #: the family name model files carry (`vision.kind`)
    name: str
    #: how a message names it
    title: str
    #: VLM `model_type` -> the transformers class of the whole VLM
    model_types: Mapping[str, str]
    #: the Pillow image processor class in transformers (the torchvision-based ones do not
    #: install beside torch 2.13)
    processor_class: str
    #: the tokenizer attributes naming its image tokens (what its processor reads)
    tokens: tuple[str, ...]
    #: the one of `tokens` that marks an image in a prompt (config.image_token_id's token)
    marker: str
    #: what one run of the `vit` net takes (a message word)
    run: str = "tile"
    #: which of `FAMILY_KEYS` its `vision` header section must carry
    header_keys: frozenset[str] = frozenset()
    #: which of `FAMILY_KEYS` its `vision` header section may carry
    optional_keys: frozenset[str] = frozenset()
    #: it takes videos besides images
    takes_video: bool = False
    #: the model types whose text positions are a canvas of several axes (canvas M-RoPE)
    canvas_model_types: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<vision family {self.name}>"

    # ------------------------------------------------------------------ header section
    def position_axes(self, info: VisionHeader) -> int:
        """The text nets' position axes (`contract.POSITION_AXES`)."""
        return 1

    def header_token_ids(self, info: VisionHeader) -> dict[str, int]:
        """Token ids of the family's own header keys, by key path (checked against the
        vocabulary)."""
        return {}

    def header_problems(self, info: VisionHeader) -> list[tuple[str, str]]:
        """(key path, what is wrong) of the family's own header keys."""
        return []

    def vit_shapes(self, info: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
        """The `vit` net's IO shapes the header's numbers give (`shapes`: the net's own,
        for the widths the header does not hold)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ prompt text
    def marker_of(self, info: Mapping[str, Any], modality: str) -> str:
        """The token that marks an image (a video) in a prompt."""
        if modality == "video":
            if not self.takes_video:
                raise GenerationError(f"a {info['model_type']} model file takes images, not "
                                      "videos")
            return str(info["tokens"]["video_token"])
        return str(info["tokens"][self.marker])

    def marker_text(self, info: Mapping[str, Any], modality: str) -> str:
        """What stands for an image (video) put before a prompt's text."""
        return self.marker_of(info, modality) + "\n"

    def image_id(self, info: Mapping[str, Any], index: int) -> str:
        """The text numbering the `index`-th image of a conversation before its
        placeholder ("": none)."""
        return ""

    def expand(self, info: Mapping[str, Any], text: str, items: Sequence[VisionItem],
               first_index: int = 0) -> str:
        """Replace the i-th marker of `text` by the i-th image's placeholder text (with its
        image id, counted from `first_index`). Markers and images must pair."""
        marker = self.marker_of(info, "image")
        parts = text.split(marker)
        if len(parts) - 1 != len(items):
            raise GenerationError(
                f"the prompt marks {len(parts) - 1} image(s) with {marker!r} but "
                f"{len(items)} image(s) were given; put one marker per image (or none: the "
                "images then go before the text)")
        out = [parts[0]]
        for i, (img, rest) in enumerate(zip(items, parts[1:], strict=True)):
            out += [self.image_id(info, first_index + i) + img.placeholder, rest]
        return "".join(out)

    # ------------------------------------------------------------------ preprocessing
    def prepare(self, processor: Any, info: Mapping[str, Any], image: Any, source: str
                ) -> PreparedImage:
        """Preprocess an opened image (PIL) with the model's image `processor`: the vit
        inputs of each run and the image's placeholder text."""
        raise NotImplementedError

    def video_patches(self, processor: Any, info: Mapping[str, Any], images: list[Any],
                      fps: float, source: str) -> VideoPatches:
        """A video given as its opened frames (one size), as the video processor lays it
        out."""
        raise GenerationError(f"a {info['model_type']} model file takes images, not videos")

    def prepare_video(self, processor: Any, info: Mapping[str, Any], images: list[Any],
                      fps: float, source: str) -> PreparedImage:
        """A video given as its opened frames, preprocessed for the vision net."""
        raise GenerationError(f"a {info['model_type']} model file takes images, not videos")

    # ------------------------------------------------------------------ prompt layout
    def lay_out(self, info: VisionHeader, ids: Sequence[int], skip: int,
                items: Sequence[VisionItem], next_position: int, axes: int) -> PromptLayout:
        """The layout of the prompt `ids` (its first `skip` ids hold no image: the pending
        token of a conversation) with the encoded `items` in order, counted from the
        rotary position `next_position`; positions only for `axes` 3."""
        rows = image_rows(ids, skip, info.image_token_id, items, "image",
                          "or chat(images=...)")
        if axes != 1:
            raise no_layout_error()
        return PromptLayout(rows)

    # ------------------------------------------------------------------ compile side
    def budget_error(self, need: int, seq_length: int, max_tiles: int, max_patches: int
                     ) -> str:
        """The message for an image that needs more tokens than the KV cache holds."""
        return (f"an image of up to {max_tiles} tiles needs about {need} tokens, more than "
                f"--seq-length {seq_length}: raise --seq-length or lower --max-tiles "
                "(or --image-size)")


def markers_pattern(markers: Sequence[str]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in markers))
