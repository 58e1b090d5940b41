"""The LLM runtime: generation, chat and images over an `Executor`, a facade over its parts.

Written once against `toptpu.backend.runtime.executor.Executor`, so the interpreter executor,
the reference machine and a device group run the same generation loop. The parts:

- `text_nets.TextNets`: the text nets and the static shapes read back from them (nothing
  is configured twice);
- `conversation.Conversation`: a conversation's caches (KV, and Qwen3.5's linear-attention
  states) and tokens, and its step loop (prefill chunks, decode steps), over an
  `conversation.Engine` (the executor, the shapes and the work buffers every conversation
  shares). The runtime holds one (`conversation`); a server may hold several, reuse one for
  a prompt sharing a prefix (`reusable_prefix`, `truncate`) and copy one (`fork`);
- `sampler.Sampler`: the next token from `lm_head`'s logits, chosen on the chip
  (`greedy_head`, `sample_head`) or on the host (`sample_token`);
- `chat`: the tokenizer, its chat template rendered within bounds, a chat's turns
  (`ChatSession`: a new turn feeds only its new tokens, plus the last generated token,
  whose k/v are not cached yet);
- images: the model file's vision net (`vision.VisionEncoder`) and the prompt layout of its
  vision family (`toptpu.families`: the rows that replace the image tokens' embeddings and,
  for a model whose rotary has a position per axis, the prompt's positions).

`Runtime` ties them together: `generate` (stopping on EOS ids and stop strings of the
generation config, `max_new_tokens`, or a full KV cache; text streamed UTF-8-safely by
`Utf8Streamer`), `chat`, `prompt_logits`, `sequence_logits`. With the machine executor
every net run and host transfer is charged to the step accounting
(`toptpu.backend.runtime.accounting`); a result carries the modelled time of its first
token and of each decoded token, split by where it goes
(`GenerationResult.modelled_breakdown`); `start_trace` records the runtime's steps, net runs
and transfers on that clock (`toptpu.backend.runtime.run_trace`, `toptpu run --trace`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from toptpu.backend.contract import BLOCK_CACHE, NetInfo
from toptpu.backend.formats.llm_file import LlmHeader
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.chat import (
    TEMPLATE_MAX_CHARS,
    TEMPLATE_MAX_MEMORY,
    TEMPLATE_MAX_SECONDS,
    ChatSession,
    TemplateLimitError,
    Tokenizer,
    render_bounded,
)
from toptpu.backend.runtime.conversation import Conversation, Engine
from toptpu.backend.runtime.device_executor import machine_executor
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.sampler import (
    SAMPLER_CHOICES,
    Sampler,
    SamplingConfig,
    recent_ids,
    sample_token,
)
from toptpu.backend.runtime.text_nets import TextNets
from toptpu.backend.runtime.vision import EncodedImage, VisionEncoder
from toptpu.backend.runtime.weight_cache_file import (
    StoredForms,
    WeightCacheFileError,
    cache_path,
    open_weight_cache,
)
from toptpu.families import vision_family
from toptpu.families.base import PromptLayout, VisionFamily, no_layout_error

__all__ = ["SAMPLER_CHOICES", "TEMPLATE_MAX_CHARS", "TEMPLATE_MAX_MEMORY", "TEMPLATE_MAX_SECONDS",
           "GenerationError", "GenerationResult", "PromptTooLongError", "Runtime",
           "SamplingConfig", "TemplateLimitError", "Tokenizer", "Utf8Streamer", "breakdown",
           "recent_ids", "render_bounded", "sample_token"]


class PromptTooLongError(GenerationError):
    """A prompt that does not fit the KV cache (with the conversation before it)."""


# =========================================================================== streaming


class Utf8Streamer:
    """Turns generated token ids into printable text without ever emitting half a
    multi-byte character: text is held back while its decoding ends in U+FFFD (an
    incomplete UTF-8 sequence) and released once the character completes."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        new = text[len(self.emitted):]
        self.emitted = text
        return new

    def flush(self) -> str:
        """Whatever is left at the end (an invalid tail stays U+FFFD)."""
        text = self.decode(self.ids)
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


# =========================================================================== results


@dataclass
class GenerationResult:
    """One generation request: ids, text, why it stopped, and timings."""

    prompt_ids: list[int]
    generated_ids: list[int]
    text: str
    stop_reason: str  # eos | stop_string | max_new_tokens | kv_cache_full
    prefill_tokens: int
    ttft_s: float  # host wall time to the first token
    decode_tokens_per_s: float | None  # host wall, over tokens after the first
    modelled_ttft_s: float | None  # modelled chip time (None: executor has no cost model)
    modelled_tokens_per_s: float | None
    position: int  # tokens in the conversation after this request
    timings: dict[str, float] = field(default_factory=dict)
    image_tokens: int = 0  # prompt positions whose embeddings came from the vision net
    vision_s: float | None = None  # host wall time of the vision net runs (None: no image)
    vision_modelled_s: float | None = None  # their modelled chip time
    sampler: str = "greedy"  # how tokens were chosen: greedy | sample (on the chip) | host
    #: modelled time of the first token and of each decoded token after it, by where it
    #: goes (`accounting.Costs.to_json`); None without a cost model
    modelled_breakdown: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _vision_costs(encoded: Sequence[EncodedImage]) -> Costs | None:
    """The modelled costs of the vision net runs of `encoded` (None: none, or no model)."""
    costs = [im.modelled_costs for im in encoded if im.modelled_costs is not None]
    if not encoded or len(costs) != len(encoded):
        return None
    total = Costs()
    for c in costs:
        total += c
    return total


def breakdown(first: Costs | None, decode: Costs | None, decoded: int,
              vision: Costs | None = None) -> dict[str, Any] | None:
    """The modelled time of the first token and of each decoded token after it (None
    without a cost model; decode None when only one token was generated), and of the
    vision net runs of the images given (`vision`, only when there are some: they run
    before the prompt's prefill, so the first token of a prompt with images comes after
    both)."""
    if first is None or decode is None:
        return None
    out: dict[str, Any] = {"first_token": first.to_json(),
                           "per_decoded_token": decode.to_json(decoded) if decoded else None}
    if vision is not None:
        out["vision"] = vision.to_json()
    return out


# =========================================================================== runtime


class Runtime:
    """Generation over an executor (see the module doc). Not thread-safe."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer | None = None) -> None:
        self.meta: LlmHeader = executor.meta
        self.header = executor.header  # the JSON form of `meta`
        #: the text nets and their static shapes
        self.shapes = TextNets(executor.nets(), self.meta)
        gen = self.meta.generation
        self.eos_ids = set(gen.eos_token_ids)
        self.stop_strings = [s for s in gen.stop_strings if s]
        self.engine = Engine(executor, self.shapes,
                             gen.pad_token_id if gen.pad_token_id is not None else 0)
        #: the conversation held in the caches
        self.conversation = Conversation(self.engine)
        self.sampler = Sampler(self.engine)
        #: the chat's turns over `conversation`
        self.session = ChatSession()
        #: the vision family of a VLM's model file (None: a text model)
        self.family: VisionFamily | None = \
            vision_family(self.meta.vision.kind) if self.meta.vision is not None else None
        self._tokenizer = tokenizer
        self._tokenizer_files: dict[str, bytes] | None = None
        self._vision: VisionEncoder | None = None
        #: what the user should know but that does not stop generation (a weight cache
        #: file left unused, and why); the command line prints them on stderr
        self.notes: list[str] = []

    @property
    def ex(self) -> Executor:
        """The executor the nets run on."""
        return self.engine.ex

    @ex.setter
    def ex(self, executor: Executor) -> None:
        self.engine.ex = executor

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, path: str, executor: str = "machine",
             verify_checksums: bool = True, weight_cache: str | None = "auto") -> Runtime:
        """Load a model file with the `interpreter` executor (numpy over the Tpu IR) or the
        `machine` executor (the file's command streams on the reference machine; a file
        spread over several devices on one machine per device).

        `weight_cache`: the weight cache file to read converted weights from
        (`weight_cache_file`): "auto" reads `FILE.wcache` when there is one and it is this
        model file's (a file that is not is left unused, and `notes` says why); a path
        reads that one (WeightCacheFileError when it cannot be used); None reads none. A
        file spread over several devices reads none ("auto": a note if one is there) or
        refuses one (a path)."""
        ex: Executor
        if executor == "interpreter":
            ex = InterpreterExecutor(path, verify_checksums)
        elif executor == "machine":
            ex = machine_executor(path)
        else:
            raise GenerationError(f"unknown executor '{executor}' (interpreter, machine)")
        rt = cls(ex)
        rt._tokenizer_files = ex.file.tokenizer_files()
        if weight_cache is not None:
            rt.open_weight_cache(None if weight_cache == "auto" else weight_cache)
        ex.prepare(rt.shapes.decode_nets())  # parsed and planned with the model
        return rt

    def open_weight_cache(self, path: str | None = None) -> StoredForms | None:
        """Read converted weights from the weight cache file at `path` (which must be this
        model file's: WeightCacheFileError otherwise), or, with None, from `FILE.wcache`
        when it is there and is this model file's (else a note in `notes`, and None)."""
        file = self.ex.file
        where = path or cache_path(file.path)
        if path is None and not os.path.lexists(where):
            return None
        try:  # a multi-device file's is refused (WeightCacheFileError)
            stored = open_weight_cache(file, where)
        except WeightCacheFileError as e:
            if path is not None:
                raise
            self.notes.append(f"{e} (converting the weights instead)")
            return None
        stored.on_problem = self.notes.append
        self.ex.use_weight_cache(stored)
        return stored

    @property
    def weight_cache_file(self) -> str | None:
        """The weight cache file in use (None: none, or it was found not to match)."""
        stored = self.ex.stored
        return None if stored is None or stored.problem is not None else stored.path

    # ------------------------------------------------------------------ tokens
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if self._tokenizer_files is None:
                raise GenerationError("no tokenizer: pass one to Runtime(...) or token ids")
            self._tokenizer = Tokenizer(self._tokenizer_files)
        return self._tokenizer

    def _has_tokenizer(self) -> bool:
        return self._tokenizer is not None or bool(self._tokenizer_files and
                                                   "tokenizer.json" in self._tokenizer_files)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    # ------------------------------------------------------------------ the conversation
    def reset(self) -> None:
        """Forget the conversation (the cache contents become unreachable) and the chat."""
        self.conversation.reset()
        self.session.reset()

    @property
    def position(self) -> int:
        """Tokens in the conversation so far (cached plus the pending one): the KV cache
        slots it fills once the pending token is fed, at most `seq`."""
        return self.conversation.position

    def start_trace(self) -> RunRecorder:
        """Record from now on every net run, host transfer and step of the runtime where it
        falls on the modelled clock (`toptpu.backend.runtime.run_trace`; `toptpu run
        --trace`). Needs the machine executor: the interpreter has no cost model."""
        self.engine.recorder = self.ex.start_recording()
        return self.engine.recorder

    def _layout(self, ids: Sequence[int], skip: int, items: Sequence[EncodedImage]
                ) -> PromptLayout | None:
        """The layout of `ids` fed next (its first `skip` ids searched for no image): by the
        model's vision family (None: a text model whose positions are the cache slots)."""
        if self.family is None or self.meta.vision is None:
            if items:
                raise GenerationError("this model file has no vision net: images need a "
                                      "compiled InternVL or MiniCPM-V model")
            if self.shapes.position_axes != 1:
                raise no_layout_error()
            return None
        return self.family.lay_out(self.meta.vision, ids, skip, items,
                                   self.conversation.next_position, self.shapes.position_axes)

    def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
        """The next-token logits [V] after `ids` in a fresh conversation (f32)."""
        ids = [int(i) for i in ids]
        if not 0 < len(ids) <= self.shapes.seq:
            raise PromptTooLongError(f"{len(ids)} tokens do not fit the KV cache of "
                                     f"{self.shapes.seq}")
        self.reset()
        last = self.conversation.feed(ids, self._layout(ids, len(ids), []))
        out = self.sampler.logits_of(last)
        self.reset()
        return out

    def sequence_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [n, V] (f32) of `ids` in a fresh conversation: row i is
        the next-token distribution after ids[0..i] (the prefill chunks as `generate`
        runs them, lm_head on every row). At most `seq` ids."""
        ids = [int(i) for i in ids]
        if not 0 < len(ids) <= self.shapes.seq:
            raise PromptTooLongError(f"{len(ids)} tokens do not fit the KV cache of "
                                     f"{self.shapes.seq}")
        out: list[np.ndarray] = []

        def rows(hidden: Buffer, n: int) -> None:
            out.extend(self.sampler.logits_of(hidden.slot(1, r, 1)) for r in range(n))

        self.reset()
        try:
            self.conversation.feed(ids, self._layout(ids, len(ids), []), rows)
        finally:
            self.reset()
        return np.stack(out)

    # ------------------------------------------------------------------ generation
    def generate(self, ids: Sequence[int], max_new_tokens: int = 64,
                 sampling: SamplingConfig | None = None, *,
                 on_text: Callable[[str], None] | None = None, stop_on_eos: bool = True,
                 keep_history: bool = False, reset_if_full: bool = False,
                 images: Sequence[Any] | None = None,
                 skip_special_tokens: bool = False) -> GenerationResult:
        """Generate after `ids`.

        With `keep_history` the ids continue the conversation held in the KV cache (only
        the new ids, plus the pending last generated token, are prefilled); otherwise the
        conversation is reset first. A request that does not fit the KV cache raises
        PromptTooLongError unless `reset_if_full`, which resets and runs `ids` alone.
        `images` (VLMs): the encoded images (or paths) whose rows replace the embeddings
        of the image tokens in `ids`, in order (see `image_prompt`). With
        `skip_special_tokens` the streamed and returned text leaves out special tokens (the
        end-of-turn marker, ...); the ids keep them.
        """
        cfg = sampling or SamplingConfig()
        cfg.validate()
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = [int(i) for i in ids]
        conv, seq = self.conversation, self.shapes.seq
        if not ids and not (keep_history and conv.pending is not None):
            raise GenerationError("the prompt is empty")
        vocab = self.meta.model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
        encoded = self._encoded(images)
        self._layout(ids, 0, encoded)  # checks before the conversation changes
        if not keep_history:
            self.reset()
        feed = ([conv.pending] if conv.pending is not None else []) + ids
        if len(conv.tokens) + len(feed) > seq:
            if reset_if_full and len(ids) <= seq:
                self.reset()
                feed = ids
            else:
                where = (f"{len(conv.tokens)} tokens of history + {len(feed)} new"
                         if conv.tokens else f"{len(feed)} tokens")
                raise PromptTooLongError(
                    f"the prompt does not fit the KV cache: {where} > seq_length {seq}. "
                    "Start a new conversation (/reset), shorten the prompt, or recompile with "
                    "a larger --seq-length")
        conv.pending = None
        layout = self._layout(feed, len(feed) - len(ids), encoded)
        self.session.images_seen += len(encoded)
        rng = np.random.default_rng(cfg.seed)
        sampler = self.sampler.resolve(cfg)

        def text_of(ids: Sequence[int]) -> str:
            if skip_special_tokens:  # an end-of-sequence id the tokenizer calls no special
                ids = [i for i in ids if i not in self.eos_ids]
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

        # stop strings match the text with its special tokens; what is shown may leave them out
        streamer = Utf8Streamer(self.decode) if (on_text or self.stop_strings) else None
        shown = Utf8Streamer(text_of) if (on_text and skip_special_tokens) else None
        span = self.engine.span
        t0, c0 = time.perf_counter(), self.ex.modelled_costs()
        with span("time to first token", prompt_tokens=len(feed), sampler=sampler):
            if sampler == "sample":
                with span("sampling setup"):
                    self.sampler.setup(cfg)
            hidden = conv.feed(feed, layout)
            recent = list(conv.tokens)
            with span("choose token 0", sampler=sampler):
                token = self.sampler.next_token(hidden, cfg, sampler, rng, recent)
        t1, c1 = time.perf_counter(), self.ex.modelled_costs()
        generated = [token]
        reason = ""
        text = ""
        while True:
            if streamer is not None:
                piece = streamer.push(token)
                text += piece
                out = shown.push(token) if shown is not None else piece
                if on_text and out:
                    on_text(out)
            if stop_on_eos and token in self.eos_ids:
                reason = "eos"
            elif self.stop_strings and any(s in text for s in self.stop_strings):
                reason = "stop_string"
            elif len(generated) >= max_new_tokens:
                reason = "max_new_tokens"
            elif len(conv.tokens) >= seq:
                reason = "kv_cache_full"
            if reason:
                break
            recent.append(token)
            pos = len(conv.tokens)
            with span(f"decode token {len(generated)}", position=pos):
                with span(f"decode step: position {pos}", net=BLOCK_CACHE):
                    hidden = conv.step(token)
                with span(f"choose token {len(generated)}", sampler=sampler):
                    token = self.sampler.next_token(hidden, cfg, sampler, rng, recent)
            generated.append(token)
        t2, c2 = time.perf_counter(), self.ex.modelled_costs()
        if streamer is not None:
            tail = streamer.flush()
            if shown is not None:
                tail = shown.flush()
            if on_text and tail:
                on_text(tail)
        # the last token's k/v would go to the next cache slot; a full cache has none, so
        # the conversation ends with it (it stays in the reply, not in the conversation's
        # position: SEQ tokens, never SEQ + 1)
        conv.pending = None if reason == "kv_cache_full" else token
        n_dec = len(generated) - 1
        first = decode = None
        if c0 is not None and c1 is not None and c2 is not None:
            first, decode = c1 - c0, c2 - c1
        full_text = text_of(generated) if self._has_tokenizer() else ""
        return GenerationResult(
            prompt_ids=ids, generated_ids=generated, text=full_text, stop_reason=reason,
            prefill_tokens=len(feed), ttft_s=t1 - t0,
            decode_tokens_per_s=(n_dec / (t2 - t1)) if n_dec and t2 > t1 else None,
            modelled_ttft_s=first.total_s if first is not None else None,
            modelled_tokens_per_s=(n_dec / decode.total_s) if decode is not None and n_dec
            and decode.total_s > 0 else None,
            position=self.position,
            timings={"prefill_s": t1 - t0, "decode_s": t2 - t1},
            image_tokens=sum(int(im.image_tokens) for im in encoded),
            vision_s=sum(im.host_s for im in encoded) if encoded else None,
            vision_modelled_s=sum(im.modelled_s for im in encoded if im.modelled_s is not None)
            if encoded and all(im.modelled_s is not None for im in encoded) else None,
            sampler=sampler,
            modelled_breakdown=breakdown(first, decode, n_dec, _vision_costs(encoded)),
        )

    # ------------------------------------------------------------------ chat
    def chat(self, message: str, max_new_tokens: int = 256,
             sampling: SamplingConfig | None = None, *,
             on_text: Callable[[str], None] | None = None, system: str | None = None,
             reset_if_full: bool = False, images: Sequence[Any] | None = None,
             videos: Sequence[Sequence[Any]] | None = None, fps: float = 2.0,
             skip_special_tokens: bool = False) -> GenerationResult:
        """One chat turn: the user `message` is appended to the conversation in the KV cache
        (rendered with the tokenizer's chat template) and the reply generated. `images`
        (VLMs: paths, PIL images or encoded images) go where the message marks them with
        the model's image token, or before the message; `videos` (Qwen-VL: each a list of
        frames, `fps` frames a second) likewise with the video token. With
        `skip_special_tokens` the streamed and returned text leaves out special tokens (the
        end-of-turn marker, ...) as `generate`'s; the conversation keeps them."""
        tok, session, conv = self.tokenizer, self.session, self.conversation
        ids: list[int] = []
        encoded = self._encoded(images, videos, fps)
        message = self._with_markers(message, encoded)

        def expand(text: str, first: int) -> str:
            return self.vision.expand(text, encoded, first) if encoded else text

        keep = bool(session.messages)
        if keep:
            pending = None if conv.pending is None else self.decode([conv.pending])
            ids = self.encode(expand(session.turn_text(tok, message, pending),
                                     session.images_seen), add_special_tokens=False)
            if self.position + len(ids) > self.shapes.seq and reset_if_full:
                self.reset()
                keep = False
        if not keep:
            ids = self.encode(expand(session.first_turn(tok, message, system), 0),
                              add_special_tokens=False)
        res = self.generate(ids, max_new_tokens, sampling, on_text=on_text, keep_history=keep,
                            images=encoded, skip_special_tokens=skip_special_tokens)
        reply = res.generated_ids[:-1] if res.stop_reason == "eos" else res.generated_ids
        session.replied(message, self.decode(reply), res.stop_reason == "eos")
        return res

    # ------------------------------------------------------------------ images
    @property
    def is_vlm(self) -> bool:
        """True for a model file with a vision net (InternVL, MiniCPM-V, Qwen-VL)."""
        return self.meta.vision is not None

    @property
    def vision(self) -> VisionEncoder:
        """The model file's `toptpu.backend.runtime.vision.VisionEncoder` (GenerationError for a
        text-only model)."""
        if self._vision is None:
            self._vision = VisionEncoder(self.ex, self.header)
        return self._vision

    def encode_image(self, image: Any) -> EncodedImage:
        """Run the vision net on an image (a path or a PIL image): an `EncodedImage`."""
        with self.engine.span("vision: encode an image", image=str(image) if isinstance(
                image, str | os.PathLike) else type(image).__name__):
            return self.vision.encode(image)

    def encode_video(self, frames: Sequence[Any], fps: float = 2.0) -> EncodedImage:
        """Run the vision net on a video given as its frames (paths or PIL images, `fps`
        frames a second; Qwen-VL): an `EncodedImage` of modality 'video'."""
        with self.engine.span("vision: encode a video", frames=len(frames), fps=fps):
            return self.vision.encode_video(list(frames), fps)

    def _encoded(self, images: Sequence[Any] | None,
                 videos: Sequence[Sequence[Any]] | None = None, fps: float = 2.0
                 ) -> list[EncodedImage]:
        out = [im if isinstance(im, EncodedImage) else self.encode_image(im)
               for im in images or []]
        return out + [self.encode_video(v, fps) for v in videos or []]

    def _with_markers(self, text: str, images: list[EncodedImage]) -> str:
        """`text` with one image (video) marker per image (video) before it, unless it marks
        them itself."""
        if not images:
            return text
        front = ""
        for modality in ("image", "video"):
            items = [im for im in images if im.modality == modality]
            if items and self.vision.marker_of(modality) not in text:
                front += "".join(self.vision.marker_text(modality) for _ in items)
        return front + text

    def image_prompt(self, text: str, images: Sequence[Any], chat_template: bool = False, *,
                     videos: Sequence[Sequence[Any]] | None = None, fps: float = 2.0
                     ) -> tuple[list[int], list[EncodedImage]]:
        """Token ids of a prompt with images, and the encoded images for `generate`.

        Each image is marked in `text` by the model's image token (`rt.vision.marker`); a
        text without markers gets the images before it. With `chat_template` the text is
        one user message rendered with the tokenizer's chat template. Each marker becomes
        the placeholder text the model's processor lays out for that image. `videos`
        (Qwen-VL): each a list of frames (`fps` frames a second), marked by the video
        token (`rt.vision.marker_of('video')`) or put before the text."""
        encoded = self._encoded(images, videos, fps)
        text = self._with_markers(text, encoded)
        if chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
        if encoded:
            text = self.vision.expand(text, encoded)
        return self.encode(text, add_special_tokens=not chat_template), encoded

    # ------------------------------------------------------------------ views of the parts
    # (what the command lines and tests read of the shapes and the conversation)
    @property
    def nets(self) -> dict[str, NetInfo]:
        return self.shapes.infos

    @property
    def seq(self) -> int:
        return self.shapes.seq

    @property
    def L(self) -> int:  # noqa: N802 - the contract's name for the longest prefill chunk
        return self.shapes.L

    @property
    def Hh(self) -> int:  # noqa: N802 - the contract's name for the prefill history
        return self.shapes.Hh

    @property
    def lengths(self) -> list[int]:
        return self.shapes.lengths

    @property
    def num_layers(self) -> int:
        return self.shapes.num_layers

    @property
    def linear(self) -> list[bool]:
        return self.shapes.linear

    @property
    def position_axes(self) -> int:
        return self.shapes.position_axes

    def prefill_net(self, net: str, layer: int | None, length: int) -> str:
        return self.shapes.prefill_net(net, layer, length)

    def decode_nets(self) -> list[str]:
        return self.shapes.decode_nets()

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    @pad_id.setter
    def pad_id(self, value: int) -> None:
        self.engine.pad_id = value

    @property
    def tokens(self) -> list[int]:
        return self.conversation.tokens

    @property
    def pending(self) -> int | None:
        return self.conversation.pending

    @property
    def next_position(self) -> int:
        return self.conversation.next_position

    @property
    def cache_k(self) -> list[Buffer | None]:
        return self.conversation.cache_k

    @property
    def cache_v(self) -> list[Buffer | None]:
        return self.conversation.cache_v

    @property
    def states(self) -> list[dict[str, Buffer] | None]:
        return self.conversation.states

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.session.messages
