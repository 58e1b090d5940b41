"""The LLM runtime: KV caches, chunked prefill, decode, chat and sampling over an `Executor`.

Written once against `toptpu.backend.runtime.executor.Executor`, so the interpreter executor and
the reference machine run the same generation loop:

- one K and one V buffer `[1, SEQ, kvH, D]` per layer, allocated on the executor;
- prefill in chunks of at most `max_input_length` L: the first chunk of a conversation runs
  `block`, later chunks run `block_kv` over the history so far (the first Hh cache slots,
  bound in place), each at the shortest prefill length that holds the chunk (`block:16`
  for a 5-token prompt when the file has it; the lengths are read back from the nets).
  Each chunk's `present_k`/`present_v` output is bound straight to its cache slots
  (through a scratch buffer only when the padded chunk would run past SEQ). When the
  history is longer than `max_history` the remaining prompt tokens go through the decode
  net one by one (exact, slower); nothing is clipped;
- decode runs `block_cache` per layer with the whole cache as history and the output
  `present_k`/`present_v` bound to `cache.slot(1, pos, 1)`: the new k/v land in their
  slot, no concatenated copy exists;
- the next token is chosen where the real deployment chooses it: `lm_head` computes the
  logits, then `greedy_head` (argmax) or `sample_head` (repetition penalty over a recent
  window, temperature, top-k, top-p; the host draws one of its K candidates) runs on the
  chip. `SamplingConfig.sampler` "host" reads the logits back and samples on the host
  (`sample_token`, numpy; also what "auto" does when the chip's head cannot: top-k off or
  above K); both samplers draw from the same distribution;
- stopping: EOS ids and stop strings of the generation config, `max_new_tokens`, or a full
  KV cache; text streams UTF-8-safely (`Utf8Streamer`);
- a multi-turn chat keeps the cache: a new turn feeds only its new tokens (plus the last
  generated token, whose k/v are not cached yet) through `block_kv`.
- positions: a token's text position is its cache slot, unless the full-attention nets
  take a position per rotary axis (position_ids [3, n]: MiniCPM-V 4.7). Then the prompt's
  positions are laid out by `contract.canvas_position_ids` (image tokens on a canvas of
  (row, column) positions, text continuing past it), counted from where the conversation
  stands (`next_position`), and every generated token takes the next position on all
  three axes, as the model's `rope_deltas` continue them.

Static shapes are read back from the nets' IO shapes (nothing is configured twice). With
the machine executor every net run and host transfer is charged to the step accounting
(`toptpu.backend.runtime.accounting`); a result carries the modelled time of its first token
and of each decoded token, split by where it goes (`GenerationResult.modelled_breakdown`);
`start_trace` records the runtime's steps, net runs and transfers on that clock
(`toptpu.backend.runtime.run_trace`, `toptpu run --trace`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _Backend

from toptpu.backend.contract import (
    ATTENTION_MASK,
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    CONV_STATE,
    DEEPSTACK,
    DEEPSTACK_NET,
    EMBEDDING,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_K,
    HISTORY_V,
    INPUT_IDS,
    LINEAR_ATTENTION,
    LM_HEAD,
    LOGITS,
    PENALTY,
    PER_LAYER_NETS,
    POSITION_IDS,
    PREFILL_NETS,
    PRESENT_CONV_STATE,
    PRESENT_K,
    PRESENT_RECURRENT_STATE,
    PRESENT_V,
    PROBS,
    RECENT_IDS,
    RECURRENT_STATE,
    REPETITION_PENALTY_RANGE,
    SAMPLE_HEAD,
    TEMPERATURE,
    TEXT_NETS,
    TOKEN,
    TOKEN_IDS,
    TOP_K,
    TOP_P,
    ContractError,
    NetInfo,
    NetName,
    TensorSpec,
    canvas_position_ids,
    decode_mask,
    mrope_position_ids,
    prefill_mask,
)
from toptpu.backend.formats.llm_file import LlmHeader
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.device_executor import machine_executor
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer, Executor
from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.vision import EncodedImage, VisionEncoder
from toptpu.backend.runtime.weight_cache_file import (
    StoredForms,
    WeightCacheFileError,
    cache_path,
    open_weight_cache,
)


class PromptTooLongError(GenerationError):
    pass


# =========================================================================== sampling


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    repetition_penalty: float = 1.0  # 1: off
    penalty_window: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None
    sampler: str = "auto"  # chip | host | auto (chip where its heads can, else host)

    def validate(self) -> None:
        """Refuse values that have no meaning (NaN, infinities, out of range)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"temperature must be a finite number >= 0 (0: greedy), got "
                                  f"{self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # False for NaN
            raise GenerationError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:  # False for NaN
            raise GenerationError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1: off), "
                                  f"got {self.repetition_penalty}")
        if not _is_int(self.penalty_window) or self.penalty_window < 0:
            raise GenerationError(f"penalty_window must be an integer >= 0, got "
                                  f"{self.penalty_window}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be an integer >= 0, got {self.seed}")
        if self.sampler not in SAMPLER_CHOICES:
            raise GenerationError(f"sampler must be one of {', '.join(SAMPLER_CHOICES)}, got "
                                  f"{self.sampler!r}")

    @property
    def greedy(self) -> bool:
        """Plain argmax without penalty: greedy_head suffices."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


#: where `SamplingConfig.sampler` may choose the token
SAMPLER_CHOICES = ("auto", "chip", "host")


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def sample_token(logits: np.ndarray, recent: Sequence[int], cfg: SamplingConfig,
                 rng: np.random.Generator) -> int:
    """Choose the next token from logits [V] (host-side sampling, numpy).

    Order as in transformers: repetition penalty (logit / p if positive, * p if negative,
    for each distinct id of the recent window), temperature, top-k, top-p, then a draw.
    """
    x = np.asarray(logits, dtype=np.float32).reshape(-1).copy()
    if cfg.repetition_penalty != 1.0 and recent and cfg.penalty_window:
        ids = np.unique(np.asarray(recent[-cfg.penalty_window:], dtype=np.int64))
        v = x[ids]
        x[ids] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
    if cfg.temperature == 0:
        return int(np.argmax(x))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = x / np.float32(cfg.temperature)
    if not np.isfinite(np.max(scaled)):
        # a temperature so low (or a penalty so strong) that the top logit overflows: all
        # the probability is on the argmax, the limit of the distribution as T -> 0
        return int(np.argmax(x))
    x = scaled
    if cfg.top_k and cfg.top_k < x.size:
        kth = np.partition(x, -cfg.top_k)[-cfg.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, cfg.top_p) + 1)  # the smallest set reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def recent_ids(window: Sequence[int], seq_length: int) -> np.ndarray:
    """sample_head's `recent_ids` [1, SEQ]: the window's ids, the slots after them repeating
    the first (penalized once, like the host's set of distinct ids)."""
    if not window or len(window) > seq_length:
        raise GenerationError(f"the penalty window holds {len(window)} ids; sample_head "
                              f"takes 1 to {seq_length}")
    out = np.full((1, seq_length), int(window[0]), np.int32)
    out[0, :len(window)] = window
    return out


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


def _vision_costs(encoded: Sequence[Any]) -> Costs | None:
    """The modelled costs of the vision net runs of `encoded` (None: none, or no model)."""
    costs = [getattr(im, "modelled_costs", None) for im in encoded]
    if not costs or any(c is None for c in costs):
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


# =========================================================================== tokenizer


class Tokenizer:
    """The model file's tokenizer: encode/decode with the `tokenizers` library (what a
    transformers fast tokenizer runs underneath, without importing transformers); chat
    templates are rendered by transformers, loaded only when a template is needed.

    Everything is built from the files' bytes in memory: no file is written, so the names
    of the files (untrusted, like every part of a model file) never become paths."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        if "tokenizer.json" not in files:
            raise GenerationError("the model file carries no tokenizer; pass token ids")
        self.files = dict(files)
        self.backend = self._backend()
        self._hf: Any = None

    def _backend(self) -> Any:
        try:
            return _Backend.from_str(self.files["tokenizer.json"].decode())
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise GenerationError(f"the model file's tokenizer.json cannot be loaded: {e}; "
                                  "recompile the model") from e

    def _json(self, name: str) -> dict[str, Any]:
        """A JSON object file of the tokenizer ({} when absent)."""
        if name not in self.files:
            return {}
        try:
            data = json.loads(self.files[name].decode())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise GenerationError(f"the model file's {name} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise GenerationError(f"the model file's {name} is not a JSON object")
        return data

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def config(self) -> dict[str, Any]:
        """`tokenizer_config.json` ({} when absent)."""
        return self._json("tokenizer_config.json")

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template, where transformers would find it: `chat_template.jinja`, else
        the processor's `chat_template.json`, else `tokenizer_config.json`."""
        if "chat_template.jinja" in self.files:
            try:
                return self.files["chat_template.jinja"].decode()
            except UnicodeDecodeError as e:
                raise GenerationError(f"the model file's chat_template.jinja is not UTF-8: "
                                      f"{e}") from e
        template = self._json("chat_template.json").get("chat_template",
                                                        self.config.get("chat_template"))
        return template if isinstance(template, str | dict) else None

    def special_tokens(self) -> dict[str, Any]:
        """The special tokens transformers' `from_pretrained` gives this tokenizer (what a
        chat template sees besides the messages): the named ones (`bos_token`, ...) and
        the model's own `*_token` attributes of `tokenizer_config.json`, with the legacy
        `special_tokens_map.json` on top when the config predates `added_tokens_decoder`."""
        from transformers import PreTrainedTokenizerFast

        named = PreTrainedTokenizerFast.SPECIAL_TOKENS_ATTRIBUTES
        values = dict(self.config)
        if "added_tokens_decoder" not in values:
            values.update(self._json("special_tokens_map.json"))
        tokens: dict[str, Any] = {k: _token_text(values[k]) for k in named
                                  if _token_text(values.get(k)) is not None}
        specific = {k: v for k, v in values.items()
                    if k not in named and k.endswith("_token") and isinstance(v, str)}
        extra = values.get("extra_special_tokens")
        if isinstance(extra, dict):
            specific.update({k: t for k, v in extra.items()
                             if (t := _token_text(v)) is not None})
        if specific:
            tokens["model_specific_special_tokens"] = specific
        return tokens

    @property
    def hf(self) -> Any:
        """A transformers fast tokenizer over the same `tokenizer.json`, with the chat
        template and special tokens of the files (for `apply_chat_template`)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(tokenizer_object=self._backend(),
                                               chat_template=self.chat_template,
                                               **self.special_tokens())
        return self._hf

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False) -> str:
        if not self.has_chat_template:
            raise GenerationError("this model's tokenizer has no chat template; use "
                                  "`toptpu run --prompt` (plain completion) instead")
        # chat templates render with transformers and its template engine, jinja2: the one
        # use of transformers in the runtime, loaded only when a template is applied
        from jinja2 import TemplateError

        hf = self.hf  # built outside the template's time budget (a large vocabulary: seconds)
        try:
            return render_bounded(lambda: str(hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)),
                messages)
        except (TemplateError, ValueError) as e:
            raise GenerationError(f"the model's chat template cannot render this "
                                  f"conversation: {e}") from e


# --------------------------------------------------------------------------- chat template bounds

#: a chat template's rendering may be at most this many characters beyond twice the
#: conversation's own (its messages' text): a template cannot blow up memory
TEMPLATE_MAX_CHARS = 1 << 20
#: ... and take at most this many seconds
TEMPLATE_MAX_SECONDS = 2.0
#: ... and grow the process by at most this many bytes while it renders (what the size
#: checks cannot see: a macro's buffer of many pieces, `~` in a loop; Linux)
TEMPLATE_MAX_MEMORY = 256 << 20
#: filters and string methods whose result can be much larger than their input
_EXPANDING = frozenset({"replace", "center", "ljust", "rjust", "zfill", "expandtabs",
                        "format", "join", "indent", "wordwrap"})
_FORMAT_WIDTH = re.compile(r"\d+")


class TemplateLimitError(GenerationError):
    """A chat template exceeded its size or time bound (`TEMPLATE_MAX_CHARS`,
    `TEMPLATE_MAX_SECONDS`)."""


def _resident_bytes() -> int | None:
    """The process's resident set size now (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class _Budget:
    chars: int
    deadline: float
    steps: int = 0
    resident: int | None = None  # at the start of the rendering


_BUDGET: ContextVar[_Budget | None] = ContextVar("toptpu_template_budget", default=None)


def _size_error(what: str, n: float, budget: _Budget) -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template's {what} would be {n:.3g} characters, over the limit of "
        f"{budget.chars} (TEMPLATE_MAX_CHARS {TEMPLATE_MAX_CHARS} + twice the conversation; "
        "docs/limits.md): the template is refused")


def _size(v: Any) -> int:
    return len(v) if isinstance(v, str | bytes | list | tuple | dict) else 0


def _check_expanding(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> None:
    """Refuse a call of an expanding filter or method whose result could exceed the budget
    (an upper bound from its arguments: nothing is allocated first)."""
    budget = _BUDGET.get()
    if budget is None or name not in _EXPANDING:
        return
    factor = 1
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            factor += max(a, 0)
        else:
            factor += _size(a)
    if isinstance(value, str) and name == "format":  # '%4000000000s' / '{:>4000000000}'
        factor += sum(int(d) for d in _FORMAT_WIDTH.findall(value) if len(d) < 30) \
            if len(value) < 65536 else len(value)
    bound = (_size(value) + 1) * factor
    if bound > budget.chars:
        raise _size_error(f"'{name}' result", bound, budget)


def _bounded_environment(base: type) -> type:
    """`base` (transformers' sandboxed Jinja environment) with the budget enforced: the
    string/list operators `*`, `+`, `**`, `%`, the expanding filters and methods are refused
    when their result could exceed the size bound, the output is joined chunk by chunk
    against it, and the template's own frames check the deadline (`_deadline_tracer`)."""
    if getattr(base, "toptpu_bounded", False):
        return base

    class BoundedEnvironment(base):  # type: ignore[misc, valid-type]
        toptpu_bounded = True
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for name, f in list(self.filters.items()):
                if name in _EXPANDING:
                    self.filters[name] = _bounded_filter(name, f)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _BUDGET.get()
            if budget is not None:
                n = 0.0
                if operator == "*":
                    if isinstance(right, int) and _size(left):
                        n = _size(left) * float(right)
                    elif isinstance(left, int) and _size(right):
                        n = _size(right) * float(left)
                elif operator == "+":
                    n = float(_size(left) + _size(right))
                elif operator == "%" and isinstance(left, str):
                    _check_expanding("format", left, (right,), {})
                elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                        and abs(left) > 1 and right > 0:
                    n = right * math.log10(abs(left))  # the digits of the result
                if n > budget.chars:
                    raise _size_error(f"'{operator}' result", n, budget)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            owner = value.__self__

            def bounded(*args: Any, **kwargs: Any) -> str:
                _check_expanding("format", owner, args, kwargs)
                return str(wrapped(*args, **kwargs))

            return bounded

        def call(__self, __context: Any, __obj: Any, *args: Any,  # noqa: N805
                 **kwargs: Any) -> Any:
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str | list):
                _check_expanding(getattr(__obj, "__name__", ""), owner, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def concat(self, chunks: Any) -> str:  # type: ignore[override]
            budget = _BUDGET.get()
            out: list[str] = []
            total = 0
            for chunk in chunks:
                total += len(chunk)
                if budget is not None:
                    if total > budget.chars:
                        raise _size_error("rendering", total, budget)
                    budget.steps += 1
                    if budget.steps % 64 == 0:
                        _check_deadline(budget)
                out.append(chunk)
            return "".join(out)

    return BoundedEnvironment


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    passes = getattr(f, "jinja_pass_arg", None)

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        rest = args[1:] if passes is not None else args  # the context first
        if rest:
            _check_expanding(name, rest[0], tuple(rest[1:]), kwargs)
        return f(*args, **kwargs)

    return bounded


def _check_deadline(budget: _Budget) -> None:
    if time.monotonic() > budget.deadline:
        raise TemplateLimitError(
            f"the chat template took more than {TEMPLATE_MAX_SECONDS:g} s to render "
            "(TEMPLATE_MAX_SECONDS; docs/limits.md): the template is refused")
    now = _resident_bytes() if budget.resident is not None else None
    if now is not None and budget.resident is not None and \
            now - budget.resident > TEMPLATE_MAX_MEMORY:
        raise TemplateLimitError(
            f"the chat template took more than {TEMPLATE_MAX_MEMORY >> 20} MiB of memory to "
            "render (TEMPLATE_MAX_MEMORY; docs/limits.md): the template is refused")


def _deadline_tracer(budget: _Budget) -> Callable[..., Any]:
    """A `sys.settrace` function that checks the deadline on the lines of compiled template
    code only (a template's loops run there; nothing else is traced)."""

    def local(frame: Any, event: str, arg: Any) -> Any:
        budget.steps += 1
        if budget.steps % 64 == 0:
            _check_deadline(budget)
        if event == "line":  # what `~` or a filter built and the template keeps
            for v in frame.f_locals.values():
                attrs = getattr(v, "_Namespace__attrs", None)  # a jinja2 namespace()
                for x in (attrs.values() if isinstance(attrs, dict) else (v,)):
                    if _size(x) > budget.chars:
                        raise _size_error("variable", _size(x), budget)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename.startswith("<"):
            _check_deadline(budget)
            return local
        return None

    return tracer


def _install_bounds() -> None:
    """Render every chat template of this process (transformers' `apply_chat_template`)
    in the bounded environment."""
    from transformers.utils import chat_template_utils as ctu

    env = getattr(ctu, "ImmutableSandboxedEnvironment", None)
    if env is None:
        raise GenerationError("this transformers has no sandboxed chat template environment "
                              "toptpu can bound; install the version pyproject.toml pins")
    if not getattr(env, "toptpu_bounded", False):
        ctu.ImmutableSandboxedEnvironment = _bounded_environment(env)
        ctu._compile_jinja_template.cache_clear()  # noqa: SLF001 - compiled before the bounds


def render_bounded(render: Callable[[], str], messages: Sequence[Mapping[str, Any]]) -> str:
    """`render()` (a chat template rendering) within `TEMPLATE_MAX_CHARS` (plus twice the
    messages' text) and `TEMPLATE_MAX_SECONDS`; a `TemplateLimitError` naming the limit."""
    _install_bounds()
    own = sum(len(str(m.get("content", ""))) for m in messages)
    budget = _Budget(TEMPLATE_MAX_CHARS + 2 * own, time.monotonic() + TEMPLATE_MAX_SECONDS,
                     resident=_resident_bytes())
    token = _BUDGET.set(budget)
    previous = sys.gettrace()
    sys.settrace(_deadline_tracer(budget))
    try:
        out = render()
    except RecursionError:
        raise TemplateLimitError("the chat template recurses too deeply: the template is "
                                 "refused") from None
    finally:
        sys.settrace(previous)
        _BUDGET.reset(token)
    if len(out) > budget.chars:
        raise _size_error("rendering", len(out), budget)
    return out


def _token_text(value: Any) -> str | None:
    """A special token's text: a string, or the `content` of a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# =========================================================================== runtime


def _spec(info: NetInfo, name: str) -> TensorSpec:
    for s in (*info.inputs, *info.outputs):
        if s.name == name:
            return s
    raise GenerationError(f"net '{info.name}' has no tensor '{name}'")


REQUIRED_NETS = TEXT_NETS


class Runtime:
    """Generation over an executor (see the module doc). Not thread-safe."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer | None = None) -> None:
        self.ex = executor
        self.meta: LlmHeader = executor.meta
        self.header = executor.header  # the JSON form of `meta`
        nets = dict(executor.nets())
        missing = [n for n in REQUIRED_NETS if n not in nets]
        if missing:
            raise GenerationError(f"the model file lacks the nets {missing}; recompile it")
        self.nets = nets
        self.num_layers = self.meta.model.num_layers
        #: which layers have a linear-attention state instead of a KV cache
        self.linear = [self.meta.model.layer_type(i) == LINEAR_ATTENTION
                       for i in range(self.num_layers)]
        #: the nets of the first full-attention layer: the KV shapes are read from them
        first = self.linear.index(False)
        self.attn_nets = {base: self.layer_net(base, first) for base in PER_LAYER_NETS}
        self.L = _spec(nets[BLOCK], HIDDEN).shape[1]
        #: prefill chunk length -> the length tag of its nets (`block:16`: 16; L: 0), read
        #: back from the `block` nets' shapes; a chunk runs the shortest that holds it
        self.prefill_tags = {_spec(nets[name], HIDDEN).shape[1]: net.length
                             for name in nets for net in [NetName.parse(name)]
                             if net.base == BLOCK and not net.is_variant}
        self.lengths = sorted(self.prefill_tags)
        for length, tag in self.prefill_tags.items():
            for base in PREFILL_NETS:
                name = str(NetName(base, 0, tag))
                if name not in nets:
                    raise GenerationError(f"the model file has block at length {length} but "
                                          f"no {name}; recompile it")
        #: rows of position_ids: 1 (the cache slot), or 3 (T, H, W: a canvas per image)
        self.position_axes = _spec(nets[self.attn_nets[BLOCK]], POSITION_IDS).shape[0]
        self.seq = _spec(nets[self.attn_nets[BLOCK_CACHE]], HISTORY_K).shape[1]
        self.Hh = _spec(nets[self.attn_nets[BLOCK_KV]], HISTORY_K).shape[1]
        gen = self.meta.generation
        self.eos_ids = set(gen.eos_token_ids)
        self.stop_strings = [s for s in gen.stop_strings if s]
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else 0
        self._tokenizer = tokenizer
        self._tokenizer_files: dict[str, bytes] | None = None
        try:
            self._alloc_buffers()
        except MemoryError as e:
            kv = _spec(nets[self.attn_nets[BLOCK_CACHE]], HISTORY_K)
            need = 2 * self.linear.count(False) * kv.nbytes
            raise GenerationError(
                f"this host cannot hold the KV cache of {self.num_layers} layers x "
                f"{self.seq} tokens ({need / 2**30:.2f} GiB); recompile with a smaller "
                "--seq-length") from e
        self.tokens: list[int] = []  # ids whose k/v are in the cache (positions 0..n-1)
        self._image_rows: dict[int, np.ndarray] = {}  # position -> vision embedding row
        #: position axes 3: the rotary position of the next token fed (a generated token
        #: or the next prompt's first), and the positions [3, n] of the ids being prefilled
        #: from their first cache slot
        self.next_position = 0
        self._layout: tuple[int, np.ndarray] | None = None
        self._crop_grids: list[tuple[int, int]] = []  # the images' crops being prefilled
        #: Qwen-VL: the images and videos being prefilled (their grids lay out M-RoPE), and
        #: Qwen3-VL's DeepStack rows by position ([levels, H] each)
        self._vision_items: list[EncodedImage] = []
        self._deepstack_rows: dict[int, np.ndarray] = {}
        self._vision: VisionEncoder | None = None
        self.images_seen = 0  # images in the conversation (MiniCPM-V numbers them)
        self.pending: int | None = None  # the last generated token, not yet in the cache
        self.messages: list[dict[str, str]] = []
        self._last_reply_closed = False
        #: what the user should know but that does not stop generation (a weight cache
        #: file left unused, and why); the command line prints them on stderr
        self.notes: list[str] = []
        #: records the generation's steps, net runs and transfers (`start_trace`)
        self.recorder: RunRecorder | None = None

    def _alloc_buffers(self) -> None:
        """The KV caches and the IO buffers of every net the generation loop binds."""
        executor, nets = self.ex, self.nets

        def alloc(net: str, name: str) -> Buffer:
            s = _spec(nets[net], name)
            return executor.alloc(s.shape, s.dtype)

        attn = self.attn_nets
        kv = _spec(nets[attn[BLOCK_CACHE]], HISTORY_K)
        # one K and one V cache per full-attention layer; one conv and one recurrent state
        # per linear-attention layer (each updated in place: its input and output buffer)
        self.cache_k: list[Buffer | None] = [
            None if lin else executor.alloc(kv.shape, kv.dtype) for lin in self.linear]
        self.cache_v: list[Buffer | None] = [
            None if lin else executor.alloc(kv.shape, kv.dtype) for lin in self.linear]
        self.states: list[dict[str, Buffer] | None] = [
            {name: alloc(self.layer_net(BLOCK_CACHE, i), name)
             for name in (CONV_STATE, RECURRENT_STATE)} if lin else None
            for i, lin in enumerate(self.linear)]
        attn_at = {length: {base: str(NetName.parse(attn[base]).at_length(tag))
                            for base in (BLOCK, BLOCK_KV)}
                   for length, tag in self.prefill_tags.items()}
        self.b = {
            # the prefill chunk's buffers, one set per length (not slots of the longest: a
            # device group keeps a buffer's current value per device for the whole buffer,
            # and sends or host-writes it whole)
            "ids_L": {n: alloc(self.prefill_net(EMBEDDING, None, n), INPUT_IDS)
                      for n in self.lengths},
            "ids_1": alloc(EMBEDDING_CACHE, INPUT_IDS),
            "h_L": {n: [alloc(self.prefill_net(EMBEDDING, None, n), HIDDEN),
                        alloc(attn_at[n][BLOCK], HIDDEN_OUT)] for n in self.lengths},
            "h_1": [alloc(EMBEDDING_CACHE, HIDDEN), alloc(BLOCK_CACHE, HIDDEN_OUT)],
            # position_ids [axes, n] (3 axes: not a slot of a longer one): one per length
            "pos_L": {n: alloc(attn_at[n][BLOCK], POSITION_IDS) for n in self.lengths},
            "pos_1": alloc(attn[BLOCK_CACHE], POSITION_IDS),
            # the masks' rows and columns both follow the chunk length: one per length
            "mask_L": {n: alloc(attn_at[n][BLOCK], ATTENTION_MASK) for n in self.lengths},
            "mask_kv": {n: alloc(attn_at[n][BLOCK_KV], ATTENTION_MASK) for n in self.lengths},
            "mask_1": alloc(attn[BLOCK_CACHE], ATTENTION_MASK),
            "scratch_k": {n: alloc(attn_at[n][BLOCK], PRESENT_K) for n in self.lengths},
            "scratch_v": {n: alloc(attn_at[n][BLOCK], PRESENT_V) for n in self.lengths},
            "logits": alloc(LM_HEAD, LOGITS),
            "token": alloc(GREEDY_HEAD, TOKEN),
            **{name: alloc(SAMPLE_HEAD, name) for name in (
                RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P, PROBS, TOKEN_IDS)},
        }
        self.sample_k = _spec(nets[SAMPLE_HEAD], PROBS).shape[1]

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
        ex: InterpreterExecutor | MachineExecutor
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
        ex.prepare(rt.decode_nets())  # parsed and planned with the model, not per request
        return rt

    def open_weight_cache(self, path: str | None = None) -> StoredForms | None:
        """Read converted weights from the weight cache file at `path` (which must be this
        model file's: WeightCacheFileError otherwise), or, with None, from `FILE.wcache`
        when it is there and is this model file's (else a note in `notes`, and None)."""
        use = getattr(self.ex, "use_weight_cache", None)
        file = getattr(self.ex, "file", None)
        if file is None:
            raise GenerationError("this executor reads no weight cache file")
        where = path or cache_path(file.path)
        if path is None and not os.path.lexists(where):
            return None
        try:  # a multi-device file's is refused (WeightCacheFileError) before `use`
            if use is None and file.meta.parallel is None:
                raise GenerationError("this executor reads no weight cache file")
            stored = open_weight_cache(file, where)
        except WeightCacheFileError as e:
            if path is not None:
                raise
            self.notes.append(f"{e} (converting the weights instead)")
            return None
        assert use is not None
        stored.on_problem = self.notes.append
        use(stored)
        return stored

    @property
    def weight_cache_file(self) -> str | None:
        """The weight cache file in use (None: none, or it was found not to match)."""
        stored = getattr(self.ex, "stored", None)
        return None if stored is None or stored.problem is not None else stored.path

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if self._tokenizer_files is None:
                raise GenerationError("no tokenizer: pass one to Runtime(...) or token ids")
            self._tokenizer = Tokenizer(self._tokenizer_files)
        return self._tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def reset(self) -> None:
        """Forget the conversation (the cache contents become unreachable)."""
        self.tokens, self.pending, self.messages = [], None, []
        self.images_seen = 0
        self.next_position = 0
        self._last_reply_closed = False

    @property
    def position(self) -> int:
        """Tokens in the conversation so far (cached plus the pending one): the KV cache
        slots it fills once the pending token is fed, at most `seq`."""
        return len(self.tokens) + (self.pending is not None)

    # ------------------------------------------------------------------ tracing
    def start_trace(self) -> RunRecorder:
        """Record from now on every net run, host transfer and step of the runtime where it
        falls on the modelled clock (`toptpu.backend.runtime.run_trace`; `toptpu run
        --trace`). Needs the machine executor: the interpreter has no cost model."""
        if not isinstance(self.ex, MachineExecutor):
            raise GenerationError("a trace needs the machine executor (the Tpu interpreter "
                                  "has no cost model, so no timeline): use --executor "
                                  "machine")
        self.recorder = self.ex.recorder = RunRecorder(self.ex.chip)
        return self.recorder

    @contextlib.contextmanager
    def _span(self, name: str, **args: Any) -> Iterator[None]:
        """A step of the runtime in the trace (nothing without `start_trace`)."""
        rec = self.recorder
        start = self.ex.modelled_seconds() if rec is not None else 0.0
        yield
        if rec is not None:
            rec.span(name, start, self.ex.modelled_seconds(), **args)

    # ------------------------------------------------------------------ nets
    def _run_layers(self, net: str, h: list[Buffer], extra: Callable[[int], dict[str, Buffer]],
                    deepstack: Callable[[int, Buffer, Buffer], bool] | None = None,
                    length: int | None = None) -> Buffer:
        """Run a per-layer net over all layers, ping-ponging the hidden buffers; after each
        layer `deepstack(layer, hidden, other)`, if given, may write the layer's hidden
        plus its DeepStack rows into the other buffer (True: it did). `length`: a prefill
        net's chunk length (`prefill_net`)."""
        src, dst = h[0], h[1]
        for layer in range(self.num_layers):
            self.ex.run(self.layer_net(net, layer) if length is None
                        else self.prefill_net(net, layer, length),
                        {HIDDEN: src, HIDDEN_OUT: dst, **extra(layer)}, layer=layer)
            src, dst = dst, src
            if deepstack is not None and deepstack(layer, src, dst):
                src, dst = dst, src
        return src

    def _deepstack_adder(self, start: int, n: int) -> Callable[[int, Buffer, Buffer], bool] | None:
        """Qwen3-VL: the hook that adds DeepStack level k's rows to the hidden rows of the
        chunk at start..start+n-1 after text layer k (`deepstack_add`), or None when the
        chunk holds no image rows."""
        rows = self._deepstack_rows
        if not self._holds_deepstack(start, n):
            return None
        levels = next(iter(rows.values())).shape[0]
        buf = self.b.get("deepstack")
        if buf is None:
            spec = _spec(self.nets[DEEPSTACK_NET], DEEPSTACK)
            buf = self.b["deepstack"] = self.ex.alloc(spec.shape, spec.dtype)
        ex = self.ex

        def add(layer: int, hidden: Buffer, out: Buffer) -> bool:
            if layer >= levels:
                return False
            table = np.zeros((1, self.L, int(buf.shape[-1])), np.float32)
            for i in range(n):
                if start + i in rows:
                    table[0, i] = rows[start + i][layer]
            ex.write(buf, table)
            ex.run(DEEPSTACK_NET, {HIDDEN: hidden, DEEPSTACK: buf, HIDDEN_OUT: out})
            return True

        return add

    def _holds_deepstack(self, start: int, n: int) -> bool:
        """Whether the chunk at start..start+n-1 holds image rows with DeepStack rows: it
        runs at `max_input_length` (`deepstack_add` is compiled at that length only)."""
        rows = self._deepstack_rows
        return bool(rows) and any(start + i in rows for i in range(n))

    def decode_nets(self) -> list[str]:
        """The nets every generation runs whatever its prompt's length: a decode step's
        (the embedding, each layer's block_cache) and the greedy token's (the lm_head and
        its head)."""
        layers = sorted({self.layer_net(BLOCK_CACHE, i) for i in range(len(self.linear))})
        return [EMBEDDING_CACHE, *layers, LM_HEAD, GREEDY_HEAD]

    def layer_net(self, net: str, layer: int) -> str:
        """The net layer `layer` runs for `net`: layers of a pre-quantized checkpoint whose
        quantization differs from layer 0's have their own (`block@3`, ...)."""
        table = self.meta.layer_nets
        return table[net][layer] if net in table else net

    def _state(self, layer: int, carried: bool) -> dict[str, Buffer]:
        """A linear-attention layer's state bindings: the new state written over the old
        one in place, and read first when it is `carried` (block_kv, block_cache; block
        starts from a zero state)."""
        st = self.states[layer]
        assert st is not None
        out = {PRESENT_CONV_STATE: st[CONV_STATE], PRESENT_RECURRENT_STATE: st[RECURRENT_STATE]}
        return {**st, **out} if carried else out

    def chunk_length(self, n: int) -> int:
        """The prefill length a chunk of `n` tokens runs at: the shortest that holds it."""
        return next(length for length in self.lengths if length >= n)

    def prefill_net(self, net: str, layer: int | None, length: int) -> str:
        """The prefill net `net` (`PREFILL_NETS`) at chunk length `length`, of layer
        `layer`'s variant (None: a net that is not per layer)."""
        name = NetName.parse(net if layer is None else self.layer_net(net, layer))
        return str(name.at_length(self.prefill_tags[length]))

    def _prefill_chunk(self, ids: Sequence[int]) -> Buffer:
        """Run one chunk (≤ L tokens) at the current position, at the shortest prefill
        length that holds it (a chunk with DeepStack rows: at L); returns the final hidden
        [1, length, H] buffer (row i belongs to ids[i])."""
        n, start = len(ids), len(self.tokens)
        L = self.L if self._holds_deepstack(start, n) else self.chunk_length(n)
        assert 0 < n <= L and start + n <= self.seq
        padded = np.full((1, L), self.pad_id, np.int32)
        padded[0, :n] = ids
        ex, b = self.ex, self.b
        ids_buf = b["ids_L"][L]
        hidden = b["h_L"][L]
        pos = b["pos_L"][L]
        ex.write(ids_buf, padded)
        ex.run(self.prefill_net(EMBEDDING, None, L), {INPUT_IDS: ids_buf, HIDDEN: hidden[0]})
        self._put_image_rows(hidden[0], start, n)
        ex.write(pos, self._positions(start, n, L))
        direct = start + L <= self.seq
        scratch_k, scratch_v = b["scratch_k"][L], b["scratch_v"][L]

        def present(layer: int) -> dict[str, Buffer]:
            if direct:
                return {PRESENT_K: self.cache_k[layer].slot(1, start, L),
                        PRESENT_V: self.cache_v[layer].slot(1, start, L)}
            return {PRESENT_K: scratch_k, PRESENT_V: scratch_v}

        if start == 0:
            mask = b["mask_L"][L]
            ex.write(mask, prefill_mask(n, L))
            net = BLOCK

            def extra(layer: int) -> dict[str, Buffer]:
                if self.linear[layer]:
                    return {ATTENTION_MASK: mask, **self._state(layer, False)}
                return {POSITION_IDS: pos, ATTENTION_MASK: mask, **present(layer)}
        else:
            mask = b["mask_kv"][L]
            ex.write(mask, prefill_mask(n, L, start, self.Hh))
            net = BLOCK_KV

            def extra(layer: int) -> dict[str, Buffer]:
                if self.linear[layer]:
                    return {ATTENTION_MASK: mask, **self._state(layer, True)}
                return {POSITION_IDS: pos, ATTENTION_MASK: mask,
                        HISTORY_K: self.cache_k[layer].slot(1, 0, self.Hh),
                        HISTORY_V: self.cache_v[layer].slot(1, 0, self.Hh),
                        **present(layer)}

        deepstack = self._deepstack_adder(start, n)
        if direct:
            out = self._run_layers(net, hidden, extra, deepstack, L)
        else:  # the padded chunk runs past SEQ: copy the n real rows into the cache
            src, dst = hidden
            for layer in range(self.num_layers):
                ex.run(self.prefill_net(net, layer, L),
                       {HIDDEN: src, HIDDEN_OUT: dst, **extra(layer)}, layer=layer)
                if not self.linear[layer]:
                    for cache, scratch in ((self.cache_k, scratch_k),
                                           (self.cache_v, scratch_v)):
                        ex.write(cache[layer].slot(1, start, n), ex.read(scratch)[:, :n])
                src, dst = dst, src
                if deepstack is not None and deepstack(layer, src, dst):
                    src, dst = dst, src
            out = src
        self.tokens.extend(int(i) for i in ids)
        return out
        self.tokens.extend(int(i) for i in ids)
        return src

    def _decode_step(self, token: int) -> Buffer:
        """Feed one token at the next position; returns the final hidden [1, 1, H]."""
        pos = len(self.tokens)
        if pos >= self.seq:
            raise GenerationError(f"the KV cache is full ({self.seq} tokens)")
        ex, b = self.ex, self.b
        if pos in self._deepstack_rows:
            raise GenerationError(
                f"image token at position {pos} falls past the prefill history of {self.Hh} "
                "(--max-history), where the decode net takes the prompt one token at a time: "
                "DeepStack's rows are added in prefill chunks only; recompile with a larger "
                "--max-history or put the image earlier in the conversation")
        ex.write(b["ids_1"], np.array([[token]], np.int32))
        ex.run(EMBEDDING_CACHE, {INPUT_IDS: b["ids_1"], HIDDEN: b["h_1"][0]})
        self._put_image_rows(b["h_1"][0], pos, 1)
        ex.write(b["pos_1"], self._positions(pos, 1, 1))
        ex.write(b["mask_1"], decode_mask(pos, self.seq))

        def extra(layer: int) -> dict[str, Buffer]:
            if self.linear[layer]:
                return self._state(layer, True)
            return {POSITION_IDS: b["pos_1"], ATTENTION_MASK: b["mask_1"],
                    HISTORY_K: self.cache_k[layer], HISTORY_V: self.cache_v[layer],
                    PRESENT_K: self.cache_k[layer].slot(1, pos, 1),
                    PRESENT_V: self.cache_v[layer].slot(1, pos, 1)}

        out = self._run_layers(BLOCK_CACHE, b["h_1"], extra)
        self.tokens.append(int(token))
        if self._layout is None:  # a generated token: the next one is one position later
            self.next_position += 1
        return out

    def _positions(self, start: int, n: int, length: int) -> np.ndarray:
        """position_ids [axes, length] i32 of the n tokens fed at cache slots start.., the
        padding past them continuing (its rows are masked)."""
        if self.position_axes == 1:
            return np.arange(start, start + length, dtype=np.int32)[None]
        if self._layout is not None:  # a prompt being prefilled
            first, table = self._layout
            cols = table[:, start - first:start - first + n]
        else:  # a generated token: text, at the next position on every axis
            cols = np.full((self.position_axes, n), self.next_position, np.int64)
        out = np.empty((self.position_axes, length), np.int64)
        out[:, :n] = cols
        out[:, n:] = cols[:, -1:] + np.arange(1, length - n + 1)
        return out.astype(np.int32)

    def _lay_out(self, ids: Sequence[int]) -> None:
        """The positions of `ids` fed after the cached tokens (position axes 3): the
        canvas of the images whose rows are bound (`_image_rows`, `_crop_grids`)."""
        if self.position_axes == 1:
            return
        vision = self.meta.vision
        start = len(self.tokens)
        if vision is not None and vision.qwen is not None:
            self._lay_out_mrope(ids, start, vision)
            return
        if vision is None or vision.canvas_markers is None or vision.token_divisor is None:
            raise GenerationError("the model file's text nets take a position per axis but "
                                  "its header has no canvas to lay them out; recompile it")
        is_image = [start + i in self._image_rows for i in range(len(ids))]
        try:
            table, self.next_position = canvas_position_ids(
                ids, is_image, vision.canvas_markers, self._crop_grids,
                math.isqrt(vision.token_divisor), self.next_position)
        except ContractError as e:
            raise GenerationError(f"cannot lay out the prompt's image positions: {e}") from e
        self._layout = (start, table)

    def _lay_out_mrope(self, ids: Sequence[int], start: int, vision: Any) -> None:
        """Qwen-VL: the M-RoPE positions of `ids` (`contract.mrope_position_ids`) from where
        the conversation stands, the image and video runs taking the grids of the items
        being prefilled."""
        q = vision.qwen
        kinds = {vision.image_token_id: 1, q.video_token_id: 2}
        types = [kinds.get(int(t), 0) for t in ids]
        items = self._vision_items
        videos = [im for im in items if im.modality == "video"]
        try:
            table, self.next_position = mrope_position_ids(
                types, [im.grid_thw for im in items if im.modality == "image"],
                [im.grid_thw for im in videos], q.merge_size, self.next_position,
                [im.interval for im in videos], frames_apart=q.frames_apart)
        except ContractError as e:
            raise GenerationError(f"cannot lay out the prompt's image positions: {e}") from e
        self._layout = (start, table)

    # ------------------------------------------------------------------ choosing tokens
    def resolve_sampler(self, cfg: SamplingConfig) -> str:
        """How `cfg` chooses tokens here: 'greedy' (greedy_head), 'sample' (sample_head) or
        'host' (logits read back). A chip request the heads cannot serve is an error
        naming why; 'auto' then falls back to the host."""
        if cfg.sampler == "host":
            return "host"
        if cfg.greedy:
            return "greedy"
        if cfg.temperature == 0 or 1 <= cfg.top_k <= self.sample_k:
            return "sample"
        if cfg.sampler == "auto":
            return "host"
        why = "off (0)" if cfg.top_k == 0 else f"{cfg.top_k}"
        raise GenerationError(
            f"the chip's sample_head keeps the {self.sample_k} most likely tokens, so "
            f"sampling on the chip needs a top-k between 1 and {self.sample_k} (top-k is "
            f"{why}); pass --top-k in that range, or --sampler host to sample from the "
            "whole vocabulary")

    def _sampling_setup(self, cfg: SamplingConfig) -> None:
        """sample_head's parameters, once per generation (temperature 0 with a penalty:
        the top candidate of temperature 1, top-k 1)."""
        ex, b = self.ex, self.b
        greedy = cfg.temperature == 0
        ex.write(b[PENALTY], np.array([[cfg.repetition_penalty if cfg.penalty_window
                                         else 1.0]], np.float32))
        ex.write(b[TEMPERATURE], np.array([[1.0 if greedy else cfg.temperature]], np.float32))
        ex.write(b[TOP_K], np.array([[1 if greedy else cfg.top_k]], np.int32))
        ex.write(b[TOP_P], np.array([[1.0 if greedy else cfg.top_p]], np.float32))

    def _next_token(self, hidden_row: Buffer, cfg: SamplingConfig, sampler: str,
                    rng: np.random.Generator, recent: Sequence[int]) -> int:
        ex, b = self.ex, self.b
        ex.run(LM_HEAD, {HIDDEN: hidden_row, LOGITS: b["logits"]})
        if sampler == "host":
            return sample_token(ex.read(b["logits"]), recent, cfg, rng)
        if sampler == "greedy":
            ex.run(GREEDY_HEAD, {LOGITS: b["logits"], TOKEN: b["token"]})
            return int(ex.read(b["token"]).reshape(-1)[0])
        window = list(recent[-cfg.penalty_window:]) if cfg.penalty_window else []
        ex.write(b[RECENT_IDS], recent_ids(window, self.seq))
        probs, ids = self._run_sample_head()
        if cfg.temperature == 0:  # greedy with a penalty: the top candidate
            return int(ids[0])
        if not np.all(np.isfinite(probs)):
            # a temperature so low that the scaled logits overflow: all the probability is
            # on the top penalized logit (as on the host). Candidates tied at +inf come in
            # no order, so the head runs once more at temperature 1, top-k 1 for it.
            ex.write(b[TEMPERATURE], np.array([[1.0]], np.float32))
            ex.write(b[TOP_K], np.array([[1]], np.int32))
            _, ids = self._run_sample_head()
            self._sampling_setup(cfg)
            return int(ids[0])
        return int(ids[rng.choice(probs.size, p=probs / probs.sum())])

    def _run_sample_head(self) -> tuple[np.ndarray, np.ndarray]:
        """sample_head on the logits buffer: (probabilities f64, candidate ids). Overflow in
        the chip's arithmetic (a tiny temperature) is a result the caller handles, not a
        warning for the user."""
        ex, b = self.ex, self.b
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ex.run(SAMPLE_HEAD, {LOGITS: b["logits"], **{n: b[n] for n in (
                RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P, PROBS, TOKEN_IDS)}})
        return (ex.read(b[PROBS]).reshape(-1).astype(np.float64),
                ex.read(b[TOKEN_IDS]).reshape(-1))

    def _prefill(self, ids: Sequence[int],
                 rows: Callable[[Buffer, int], None] | None = None) -> Buffer:
        """Feed `ids` after the cached tokens; returns the hidden row of the last one.
        `rows(hidden, n)`, if given, sees the final hidden rows of every chunk (or decode
        step) before the next one reuses the buffer: rows 0..n-1 belong to the n ids fed."""
        self._lay_out(ids)
        try:
            return self._prefill_laid_out(ids, rows)
        finally:
            self._layout = None

    def _prefill_laid_out(self, ids: Sequence[int],
                          rows: Callable[[Buffer, int], None] | None) -> Buffer:
        last: Buffer | None = None
        i = 0
        while i < len(ids):
            start = len(self.tokens)
            if start == 0 or start <= self.Hh:
                chunk = ids[i:i + self.L]
                length = self.chunk_length(len(chunk))
                net = self.prefill_net(BLOCK if start == 0 else BLOCK_KV, None, length)
                with self._span(f"prefill {net}: positions {start}..{start + len(chunk) - 1}",
                                net=net, start=start, tokens=len(chunk), padded_to=length):
                    h = self._prefill_chunk(chunk)
                last = h.slot(1, len(chunk) - 1, 1)
                if rows is not None:
                    rows(h, len(chunk))
                i += len(chunk)
            else:  # history beyond max_history: the decode net takes the rest one by one
                with self._span(f"prefill {BLOCK_CACHE}: position {start}", net=BLOCK_CACHE,
                                start=start, tokens=1):
                    last = self._decode_step(ids[i])
                if rows is not None:
                    rows(last, 1)
                i += 1
        assert last is not None
        return last

    def _put_image_rows(self, hidden: Buffer, start: int, n: int) -> None:
        """Overwrite the embeddings of image placeholder positions start..start+n-1 in
        `hidden` [1, n', H] with their vision rows (contiguous runs in one write each)."""
        if not self._image_rows:
            return
        i = 0
        while i < n:
            if start + i not in self._image_rows:
                i += 1
                continue
            j = i
            while j < n and start + j in self._image_rows:
                j += 1
            rows = np.stack([self._image_rows[start + k] for k in range(i, j)])
            self.ex.write(hidden.slot(1, i, j - i), rows[None])
            i = j

    # ------------------------------------------------------------------ images
    @property
    def is_vlm(self) -> bool:
        """True for a model file with a vision net (InternVL, MiniCPM-V)."""
        return self.meta.vision is not None

    @property
    def vision(self) -> VisionEncoder:
        """The model file's `toptpu.backend.runtime.vision.VisionEncoder` (GenerationError for a
        text-only model)."""
        if self._vision is None:
            self._vision = VisionEncoder(self.ex, self.header)
        return self._vision

    def encode_image(self, image: Any) -> Any:
        """Run the vision net on an image (a path or a PIL image): an `EncodedImage`."""
        with self._span("vision: encode an image", image=str(image) if isinstance(
                image, str | os.PathLike) else type(image).__name__):
            return self.vision.encode(image)

    def encode_video(self, frames: Sequence[Any], fps: float = 2.0) -> Any:
        """Run the vision net on a video given as its frames (paths or PIL images, `fps`
        frames a second; Qwen-VL): an `EncodedImage` of modality 'video'."""
        with self._span("vision: encode a video", frames=len(frames), fps=fps):
            return self.vision.encode_video(list(frames), fps)

    def _encoded(self, images: Sequence[Any] | None, videos: Sequence[Sequence[Any]] | None = None,
                 fps: float = 2.0) -> list[Any]:
        out = [im if isinstance(im, EncodedImage) else self.encode_image(im)
               for im in images or []]
        return out + [self.encode_video(v, fps) for v in videos or []]

    def _with_markers(self, text: str, images: list[Any]) -> str:
        """`text` with one image (video) marker per image (video) before it, unless it marks
        them itself."""
        if not images:
            return text
        front = ""
        for modality in ("image", "video"):
            items = [im for im in images if getattr(im, "modality", "image") == modality]
            if items and self.vision.marker_of(modality) not in text:
                front += "".join(self.vision.marker_text(modality) for _ in items)
        return front + text

    def image_prompt(self, text: str, images: Sequence[Any], chat_template: bool = False, *,
                     videos: Sequence[Sequence[Any]] | None = None, fps: float = 2.0
                     ) -> tuple[list[int], list[Any]]:
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

    def _image_positions(self, ids: list[int], offset: int, images: Sequence[Any]
                         ) -> dict[int, np.ndarray]:
        """Conversation position -> vision row for the image tokens of `ids` (at `offset`)."""
        vision = self.meta.vision
        if vision is not None and vision.qwen is not None:
            return self._qwen_positions(ids, offset, images)[0]
        token = self.meta.vision.image_token_id if self.meta.vision is not None else None
        where = [i for i, t in enumerate(ids) if t == token]
        rows = sum(int(im.image_tokens) for im in images)
        if images and not self.is_vlm:
            raise GenerationError("this model file has no vision net: images need a "
                                  "compiled InternVL or MiniCPM-V model")
        if len(where) != rows:
            raise GenerationError(
                f"the prompt holds {len(where)} image tokens (id {token}) but the "
                f"{len(images)} image(s) give {rows} embedding rows; build the prompt with "
                "Runtime.image_prompt (or chat(images=...)), which lays out the tokens")
        if not rows:
            return {}
        table = np.concatenate([im.embeds for im in images])
        return {offset + i: table[k] for k, i in enumerate(where)}

    def _qwen_positions(self, ids: list[int], offset: int, items: Sequence[Any]
                        ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Qwen-VL: position -> vision row for the image tokens of `ids` (the images' rows in
        order) and the video tokens (the videos'), and position -> DeepStack rows."""
        vision = self.meta.vision
        assert vision is not None and vision.qwen is not None
        rows: dict[int, np.ndarray] = {}
        deep: dict[int, np.ndarray] = {}
        for modality, token in (("image", vision.image_token_id),
                                ("video", vision.qwen.video_token_id)):
            where = [i for i, t in enumerate(ids) if t == token]
            mine = [im for im in items if getattr(im, "modality", "image") == modality]
            count = sum(int(im.image_tokens) for im in mine)
            if len(where) != count:
                raise GenerationError(
                    f"the prompt holds {len(where)} {modality} tokens (id {token}) but the "
                    f"{len(mine)} {modality}(s) give {count} embedding rows; build the prompt "
                    "with Runtime.image_prompt (or chat(images=..., videos=...)), which lays "
                    "out the tokens")
            if not count:
                continue
            table = np.concatenate([im.embeds for im in mine])
            rows.update({offset + i: table[k] for k, i in enumerate(where)})
            if vision.qwen.deepstack_levels:
                levels = np.concatenate([im.deepstack for im in mine], axis=1)
                deep.update({offset + i: levels[:, k] for k, i in enumerate(where)})
        return rows, deep

    def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
        """The next-token logits [V] after `ids` in a fresh conversation (f32)."""
        ids = [int(i) for i in ids]
        if not 0 < len(ids) <= self.seq:
            raise PromptTooLongError(f"{len(ids)} tokens do not fit the KV cache of {self.seq}")
        self.reset()
        last = self._prefill(ids)
        self.ex.run(LM_HEAD, {HIDDEN: last, LOGITS: self.b["logits"]})
        out = self.ex.read(self.b["logits"]).reshape(-1).astype(np.float32)
        self.reset()
        return out

    def sequence_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [n, V] (f32) of `ids` in a fresh conversation: row i is
        the next-token distribution after ids[0..i] (the prefill chunks as `generate`
        runs them, lm_head on every row). At most `seq` ids."""
        ids = [int(i) for i in ids]
        if not 0 < len(ids) <= self.seq:
            raise PromptTooLongError(f"{len(ids)} tokens do not fit the KV cache of {self.seq}")
        out: list[np.ndarray] = []
        ex, logits = self.ex, self.b["logits"]

        def rows(hidden: Buffer, n: int) -> None:
            for r in range(n):
                ex.run(LM_HEAD, {HIDDEN: hidden.slot(1, r, 1), LOGITS: logits})
                out.append(ex.read(logits).reshape(-1).astype(np.float32))

        self.reset()
        try:
            self._prefill(ids, rows)
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
        if not ids and not (keep_history and self.pending is not None):
            raise GenerationError("the prompt is empty")
        vocab = self.meta.model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
        encoded = self._encoded(images)
        self._image_positions(ids, 0, encoded)  # checks before the conversation changes
        if not keep_history:
            self.reset()
        feed = ([self.pending] if self.pending is not None else []) + ids
        if len(self.tokens) + len(feed) > self.seq:
            if reset_if_full and len(ids) <= self.seq:
                self.reset()
                feed = ids
            else:
                where = (f"{len(self.tokens)} tokens of history + {len(feed)} new"
                         if self.tokens else f"{len(feed)} tokens")
                raise PromptTooLongError(
                    f"the prompt does not fit the KV cache: {where} > seq_length {self.seq}. "
                    "Start a new conversation (/reset), shorten the prompt, or recompile with "
                    "a larger --seq-length")
        self.pending = None
        at = len(self.tokens) + len(feed) - len(ids)
        self._image_rows = self._image_positions(ids, at, encoded)
        self._crop_grids = [g for im in encoded for g in im.grids]
        if self.meta.vision is not None and self.meta.vision.qwen is not None:
            self._deepstack_rows = self._qwen_positions(ids, at, encoded)[1]
            self._vision_items = list(encoded)
        self.images_seen += len(encoded)
        rng = np.random.default_rng(cfg.seed)
        sampler = self.resolve_sampler(cfg)
        def text_of(ids: Sequence[int]) -> str:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

        # stop strings match the text with its special tokens; what is shown may leave them out
        streamer = Utf8Streamer(self.decode) if (on_text or self.stop_strings) else None
        shown = Utf8Streamer(text_of) if (on_text and skip_special_tokens) else None
        t0, c0 = time.perf_counter(), self.ex.modelled_costs()
        with self._span("time to first token", prompt_tokens=len(feed), sampler=sampler):
            if sampler == "sample":
                with self._span("sampling setup"):
                    self._sampling_setup(cfg)
            try:
                hidden = self._prefill(feed)
            finally:
                self._image_rows, self._crop_grids = {}, []
                self._vision_items, self._deepstack_rows = [], {}
            recent = list(self.tokens)
            with self._span("choose token 0", sampler=sampler):
                token = self._next_token(hidden, cfg, sampler, rng, recent)
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
            elif len(self.tokens) >= self.seq:
                reason = "kv_cache_full"
            if reason:
                break
            recent.append(token)
            pos = len(self.tokens)
            with self._span(f"decode token {len(generated)}", position=pos):
                with self._span(f"decode step: position {pos}", net=BLOCK_CACHE):
                    hidden = self._decode_step(token)
                with self._span(f"choose token {len(generated)}", sampler=sampler):
                    token = self._next_token(hidden, cfg, sampler, rng, recent)
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
        self.pending = None if reason == "kv_cache_full" else token
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
            vision_modelled_s=sum(im.modelled_s for im in encoded)
            if encoded and all(im.modelled_s is not None for im in encoded) else None,
            sampler=sampler,
            modelled_breakdown=breakdown(first, decode, n_dec, _vision_costs(encoded)),
        )

    def _has_tokenizer(self) -> bool:
        return self._tokenizer is not None or bool(self._tokenizer_files and
                                                   "tokenizer.json" in self._tokenizer_files)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------ chat
    def chat(self, message: str, max_new_tokens: int = 256,
             sampling: SamplingConfig | None = None, *,
             on_text: Callable[[str], None] | None = None, system: str | None = None,
             reset_if_full: bool = False, images: Sequence[Any] | None = None,
             videos: Sequence[Sequence[Any]] | None = None, fps: float = 2.0
             ) -> GenerationResult:
        """One chat turn: the user `message` is appended to the conversation in the KV cache
        (rendered with the tokenizer's chat template) and the reply generated. `images`
        (VLMs: paths, PIL images or encoded images) go where the message marks them with
        the model's image token, or before the message; `videos` (Qwen-VL: each a list of
        frames, `fps` frames a second) likewise with the video token."""
        tok = self.tokenizer
        ids: list[int] = []
        encoded = self._encoded(images, videos, fps)
        message = self._with_markers(message, encoded)

        def expand(text: str, first: int) -> str:
            return self.vision.expand(text, encoded, first) if encoded else text

        keep = bool(self.messages)
        if keep:
            ids = self.encode(expand(self._turn_text(message), self.images_seen),
                              add_special_tokens=False)
            if self.position + len(ids) > self.seq and reset_if_full:
                self.reset()
                keep = False
        if not keep:
            first = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": message}]
            text = tok.apply_chat_template(first, add_generation_prompt=True)
            ids = self.encode(expand(text, 0), add_special_tokens=False)
            self.messages = first[:-1]
        res = self.generate(ids, max_new_tokens, sampling, on_text=on_text, keep_history=keep,
                            images=encoded)
        reply = res.generated_ids[:-1] if res.stop_reason == "eos" else res.generated_ids
        self.messages = [*self.messages, {"role": "user", "content": message},
                         {"role": "assistant", "content": self.decode(reply)}]
        self._last_reply_closed = res.stop_reason == "eos"
        return res

    def _turn_text(self, message: str) -> str:
        """The text after the last reply that closes it and opens the next user turn,
        found by rendering a probe conversation with the chat template."""
        tok = self.tokenizer
        probe_a = "\x00A\x00"
        base = [{"role": "user", "content": "\x00U\x00"}, {"role": "assistant",
                                                           "content": probe_a}]
        t1 = tok.apply_chat_template(base)
        t2 = tok.apply_chat_template([*base, {"role": "user", "content": message}],
                                     add_generation_prompt=True)
        if not t2.startswith(t1) or probe_a not in t1:
            raise GenerationError("the chat template does not render turns incrementally; "
                                  "use /reset between questions")
        closing = t1[t1.rindex(probe_a) + len(probe_a):]
        if self._last_reply_closed and self.pending is not None:
            eos_text = self.decode([self.pending])
            if closing.startswith(eos_text):
                closing = closing[len(eos_text):]
        return closing + t2[len(t1):]
