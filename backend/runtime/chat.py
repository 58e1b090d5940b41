"""The chat side of a model file: its tokenizer, its chat template rendered within bounds,
and a chat's turns.

- `Tokenizer`: encode/decode with the `tokenizers` library (what a transformers fast
  tokenizer runs underneath, without importing transformers); chat templates are rendered
  by transformers, loaded only when a template is applied.
- Chat templates are untrusted (they come with the model file) and render within
  `TEMPLATE_MAX_CHARS` (plus twice the conversation's own text), `TEMPLATE_MAX_SECONDS` and
  `TEMPLATE_MAX_MEMORY` (`render_bounded`): a `TemplateLimitError` names the limit.
- `ChatSession`: the messages of a multi-turn chat and the text that opens each new turn
  after the conversation held in the caches (found by rendering a probe conversation with
  the template: a new turn feeds only its new tokens).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer as _Backend

from toptpu.backend.runtime.errors import GenerationError

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

    class BoundedEnvironment(base):
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

        def concat(self, chunks: Any) -> str:
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



# =========================================================================== chat turns


@dataclass
class ChatSession:
    """A multi-turn chat over one conversation: its messages so far, how many images it
    has shown (MiniCPM-V numbers them), and whether the last reply ended with the end of
    turn (whose token then stands for the template's closing text)."""

    messages: list[dict[str, str]] = field(default_factory=list)
    images_seen: int = 0
    last_reply_closed: bool = False

    def reset(self) -> None:
        self.messages, self.images_seen, self.last_reply_closed = [], 0, False

    def first_turn(self, tok: Tokenizer, message: str, system: str | None) -> str:
        """The text of a conversation's first turn (with its system prompt), ready for the
        reply; the messages then hold the system prompt."""
        first = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": message}]
        text = tok.apply_chat_template(first, add_generation_prompt=True)
        self.messages = first[:-1]
        return text

    def turn_text(self, tok: Tokenizer, message: str, pending_text: str | None) -> str:
        """The text after the last reply that closes it and opens the next user turn,
        found by rendering a probe conversation with the chat template. `pending_text`: the
        text of the reply's last token when it is not in the caches yet (fed first)."""
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
        if self.last_reply_closed and pending_text is not None:
            if closing.startswith(pending_text):
                closing = closing[len(pending_text):]
        return closing + t2[len(t1):]

    def replied(self, message: str, reply: str, closed: bool) -> None:
        """Record a turn: the user's message and the reply (`closed`: it ended with the
        end-of-turn token)."""
        self.messages = [*self.messages, {"role": "user", "content": message},
                         {"role": "assistant", "content": reply}]
        self.last_reply_closed = closed
