"""`toptpu serve`: the OpenAI HTTP API over a compiled model file.

A maintained ASGI stack does the HTTP (Starlette routes and responses, uvicorn the server);
this module is the API's surface: each request's JSON checked field by field (an OpenAI
error object with the right 4xx status and a message naming the field otherwise), the
prompt rendered with the model's chat template and tokenized, then queued on the serving
engine (`toptpu.backend.runtime.serving.ServingEngine`), which runs every net on one
thread, keeps the conversations of recent requests for the next prompt that shares their
prefix, and decodes up to a batch of requests at once. Answers come back whole or as
server-sent events (`stream: true`) ending in `data: [DONE]`.

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /health` (200, or 503 once the model file changed on disk or
the server shuts down), `GET /metrics` (the engine's totals as JSON: tokens kept and
prefilled, host and modelled seconds, decode steps by batch size) and `GET /` (a chat page
over the same API). docs/serving.md has the fields, the extensions and the limits.

Safety: loopback by default; binding any other address needs `--api-key` (a Bearer token
every `/v1` and `/metrics` request must carry); a body larger than `--max-body-bytes` is
refused from its Content-Length (or once that many bytes arrived), before it is read whole;
an image is taken only from a `data:` URL (a remote URL is refused, never fetched); the
queue is bounded (429 when full).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import json
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from toptpu.backend.contract import parse_strict_json
from toptpu.backend.runtime.runtime import Runtime, SamplingConfig
from toptpu.backend.runtime.serving import (
    Event,
    Failed,
    Finished,
    Job,
    Prompt,
    PromptError,
    ServeError,
    ServingEngine,
    Started,
    Text,
    digest_of,
    image_prompt,
)
from toptpu.errors import GenerationError
from toptpu.serve_page import PAGE

#: the most stop sequences a request may give (OpenAI's limit)
MAX_STOP = 4
#: an image's most pixels (its declared size, checked before it is decoded)
MAX_IMAGE_PIXELS = 64 << 20

# =========================================================================== errors


def error_body(message: str, status: int, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = {401: "authentication_error", 404: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, status: int, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code, param), status_code=status)


def bad(message: str, param: str | None = None, code: str | None = None,
        status: int = 400) -> ServeError:
    return ServeError(status, message, code, param)


# =========================================================================== the body


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object, refused (413) when its declared or actual size passes
    `limit` before it is read whole, and (400) when it is not one JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad(f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise bad(f"the request body is {int(declared)} bytes, more than the server "
                      f"takes ({limit} bytes, --max-body-bytes)", status=413,
                      code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise bad(f"the request body is more than the server takes ({limit} bytes, "
                          "--max-body-bytes)", status=413, code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise bad("the client went away before sending the whole body") from None
    try:
        body = parse_strict_json(b"".join(chunks))
    except ValueError as e:
        raise bad(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, not {type(body).__name__}",
                  code="invalid_json")
    return body


# =========================================================================== fields


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v),
                                                                       type(v).__name__)


def _integer(body: dict[str, Any], key: str, lo: int | None = None,
             hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer, not {_type_name(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{key}' must be {span}, got {v}", key)
    return v


def _number(body: dict[str, Any], key: str, lo: float, hi: float,
            lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"'{key}' must be a number, not {_type_name(v)}", key)
    if not math.isfinite(v):  # 1e400 reads as infinity
        raise bad(f"'{key}' must be a finite number, not {v}", key)
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad(f"'{key}' must be in {left}{lo:g}, {hi:g}], got {v}", key)
    return float(v)


def _boolean(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, not {_type_name(v)}", key)
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' holds {len(stops)} sequences; at most {MAX_STOP}", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' sequences must not be empty", "stop")
    return tuple(stops)


#: fields a request may carry that change nothing here at their default (refused otherwise)
_DEFAULTS: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False,
                             "top_logprobs": 0, "logit_bias": {}, "best_of": 1, "echo": False,
                             "suffix": None, "parallel_tool_calls": None,
                             "response_format": {"type": "text"}}
#: fields taken and not acted on (they say who asks, or ask for storage toptpu has not)
_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
            "prompt_cache_key")
#: fields this server does not implement
_REFUSED = {"tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
            "function_call": "function calls", "audio": "audio output",
            "modalities": "other modalities than text", "prediction": "predicted outputs",
            "web_search_options": "web search", "reasoning_effort": "reasoning effort"}
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
           "stop", "n", "top_k", "repetition_penalty", "ignore_eos", "return_token_ids")


def _check_keys(body: dict[str, Any], own: Sequence[str]) -> None:
    for key, value in body.items():
        if key in _COMMON or key in own or key in _IGNORED:
            continue
        if key in _REFUSED:
            if value in (None, [], False):
                continue
            raise bad(f"'{key}': {_REFUSED[key]} are not supported by toptpu serve", key,
                      "unsupported_parameter")
        if key in _DEFAULTS:
            if value is None or value == _DEFAULTS[key]:
                continue
            raise bad(f"'{key}' {json.dumps(value)[:60]} is not supported by toptpu serve "
                      f"(only {json.dumps(_DEFAULTS[key])})", key, "unsupported_parameter")
        raise bad(f"unrecognized request argument supplied: {key}", key,
                  "unrecognized_argument")


@dataclass
class Common:
    """What chat and completion requests share."""

    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: SamplingConfig
    stop: tuple[str, ...]
    ignore_eos: bool
    return_token_ids: bool


def _common(body: dict[str, Any], state: ServeState, max_key: str = "max_tokens") -> Common:
    model = body.get("model")
    if model is None:
        raise bad("'model' is required (GET /v1/models lists it)", "model")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, not {_type_name(model)}", "model")
    if model != state.model_id:
        raise bad(f"the model '{model[:200]}' does not exist: this server serves "
                  f"'{state.model_id}'", "model", "model_not_found", 404)
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise bad(f"'n' {n}: toptpu serve generates one choice per request (n=1)", "n")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true",
                      "stream_options")
        unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
        if unknown:
            raise bad(f"unrecognized stream option {unknown[0]!r}", "stream_options")
        include_usage = _boolean(options, "include_usage")
    max_tokens = _integer(body, max_key, 1)
    gen = state.rt.meta.generation
    samples = gen.do_sample
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", 0)
    penalty = _number(body, "repetition_penalty", 1e-4, 1e4)
    seed = _integer(body, "seed")
    if seed is not None and seed < 0:  # any integer is a seed: its bits as an unsigned one
        seed %= 1 << 64
    cfg = SamplingConfig(
        temperature=temperature if temperature is not None else (
            float(gen.temperature or 1.0) if samples else 0.0),
        top_k=top_k if top_k is not None else (int(gen.top_k or 0) if samples else 0),
        top_p=top_p if top_p is not None else (float(gen.top_p or 1.0) if samples else 1.0),
        repetition_penalty=penalty if penalty is not None else float(
            gen.repetition_penalty or 1.0),
        seed=seed)
    try:
        cfg.validate()
    except GenerationError as e:
        raise bad(str(e)) from None
    return Common(stream, include_usage, max_tokens, cfg, _stops(body),
                  _boolean(body, "ignore_eos"), _boolean(body, "return_token_ids"))


# --------------------------------------------------------------------------- chat messages


@dataclass
class ChatPrompt:
    """A chat request's messages as the chat template takes them (text, with the image
    marker where an image goes) and its images (bytes, in order)."""

    messages: list[dict[str, str]]
    images: list[bytes] = field(default_factory=list)


_ROLES = ("system", "developer", "user", "assistant")


def chat_prompt(body: dict[str, Any], state: ServeState) -> ChatPrompt:
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    out: list[dict[str, str]] = []
    images: list[bytes] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, not {_type_name(m)}", where)
        role = m.get("role")
        if role not in _ROLES:
            what = json.dumps(role)[:40]
            raise bad(f"'{where}.role' {what} is not one of {', '.join(_ROLES)}"
                      + (" (tool messages are not supported)" if role in ("tool", "function")
                         else ""), f"{where}.role")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise bad(f"'{where}' has the unsupported field {unknown[0]!r}",
                      f"{where}.{unknown[0]}", "unsupported_parameter")
        content = m.get("content")
        text = _content(content, f"{where}.content", role, images, state)
        out.append({"role": "system" if role == "developer" else role, "content": text})
    if state.system_prompt is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": state.system_prompt})
    return ChatPrompt(out, images)


def _content(content: Any, where: str, role: str, images: list[bytes],
             state: ServeState) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or an array of content parts, not "
                  f"{_type_name(content)}", where)
    text = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(f"'{at}' must be an object, not {_type_name(part)}", at)
        kind = part.get("type")
        if kind == "text":
            value = part.get("text")
            if not isinstance(value, str):
                raise bad(f"'{at}.text' must be a string, not {_type_name(value)}", f"{at}.text")
            text.append(value)
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise bad(f"'{at}.image_url.url' must be a string", f"{at}.image_url")
            data = data_url_bytes(url, f"{at}.image_url.url")
            if role != "user":
                raise bad(f"'{at}': images go in user messages", at)
            if not state.rt.is_vlm:
                raise bad(f"'{at}': this model file has no vision net (a text model): it "
                          "takes no images", at, "images_not_supported")
            images.append(data)
            text.append(state.rt.vision.marker_text("image"))
        else:
            raise bad(f"'{at}.type' {json.dumps(kind)[:40]} is not supported (text, "
                      "image_url)", f"{at}.type", "unsupported_parameter")
    return "".join(text)


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a `data:` URL (base64); anything else refused (a remote URL is never
    fetched)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:20] if ":" in url else "a relative"
        raise bad(f"'{where}': a {scheme} URL is not fetched: send the image inline as a "
                  "data: URL (data:image/png;base64,...)", where, "remote_url_refused")
    head, comma, data = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise bad(f"'{where}': a data: URL of an image must be base64 "
                  "(data:image/png;base64,...)", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad(f"'{where}': the data: URL is not valid base64: {e}", where) from None


def open_image(data: bytes, where: str) -> Any:
    """A PIL image from bytes, its declared size checked before it is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise bad(f"'{where}' is not an image Pillow can read: {e}", where) from None
    if img.width * img.height > MAX_IMAGE_PIXELS:
        raise bad(f"'{where}' is {img.width}x{img.height} pixels, more than the "
                  f"{MAX_IMAGE_PIXELS} this server decodes", where)
    try:
        img.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise bad(f"'{where}' is corrupt or truncated: {e}", where) from None
    return img


# =========================================================================== the state


@dataclass
class ServeState:
    """What every request handler reads: the runtime (for its tokenizer and shapes), the
    engine, the served model's id, and the limits."""

    rt: Runtime
    engine: ServingEngine
    model_id: str
    created: int
    api_key: str | None
    max_body: int
    system_prompt: str | None = None
    #: one thread renders chat templates and tokenizes (off the event loop, in order)
    prep: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="toptpu-prep"))
    shutting_down: bool = False

    def prompt_ids(self, text: str, special: bool) -> list[int]:
        return self.rt.encode(text, add_special_tokens=special)

    def check_room(self, n: int, max_tokens: int | None, key: str, prompt_key: str) -> None:
        """A prompt of `n` tokens and `max_tokens` (the field `key`) must fit the KV cache
        (400 naming both lengths otherwise)."""
        seq = self.rt.seq
        if n > seq:
            raise bad(str(PromptError(n, seq)), prompt_key, "context_length_exceeded")
        if max_tokens is not None and n + max_tokens - 1 > seq:
            raise bad(f"this model's sequence is {seq} tokens: the prompt's {n} and "
                      f"'{key}' {max_tokens} need {n + max_tokens - 1} (the last token's "
                      f"k/v are not cached); ask for at most {seq - n + 1}", key,
                      "context_length_exceeded")


# =========================================================================== requests


def _auth(request: Request, state: ServeState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             state.api_key.encode()):
        raise bad("a valid API key is required: send 'Authorization: Bearer KEY'",
                  status=401, code="invalid_api_key")


def _state(request: Request) -> ServeState:
    state: ServeState = request.app.state.serve
    return state


async def _run_prep(state: ServeState, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.prep, fn)


def _job(state: ServeState, common: Common, emit: Callable[[Event], None]) -> Job:
    return Job(emit=emit, max_tokens=common.max_tokens, sampling=common.sampling,
               stop=common.stop, ignore_eos=common.ignore_eos)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    _auth(request, state)
    body = await read_json(request, state.max_body)
    _check_keys(body, ("messages", "max_completion_tokens"))
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("give 'max_completion_tokens' or 'max_tokens', not both",
                  "max_completion_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    common = _common(body, state, key)
    chat = chat_prompt(body, state)
    rt = state.rt
    if not rt._has_tokenizer() or not rt.tokenizer.has_chat_template:
        raise bad("this model file has no chat template: use /v1/completions",
                  code="no_chat_template")

    def render() -> str:
        return rt.tokenizer.apply_chat_template(chat.messages, add_generation_prompt=True)

    if not chat.images:
        ids = await _run_prep(state, lambda: state.prompt_ids(render(), False))
        state.check_room(len(ids), common.max_tokens, key, "messages")
        return await _serve(request, state, common, "chat", prompt=Prompt(ids))
    pil = [open_image(data, f"messages: image {i}") for i, data in enumerate(chat.images)]
    digests = [digest_of(d) for d in chat.images]

    def prepare() -> Prompt:  # on the engine thread: the vision net runs
        encoded = [rt.encode_image(im) for im in pil]
        text = rt.vision.expand(render(), encoded)
        ids = state.prompt_ids(text, False)
        state.check_room(len(ids), common.max_tokens, key, "messages")
        return image_prompt(ids, encoded, digests, int(rt.vision.image_token_id))

    return await _serve(request, state, common, "chat", prepare=prepare)


async def completions(request: Request) -> Response:
    state = _state(request)
    _auth(request, state)
    body = await read_json(request, state.max_body)
    _check_keys(body, ("prompt",))
    common = _common(body, state)
    if common.max_tokens is None:
        common.max_tokens = 16  # the completions API's default
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    rt = state.rt
    if isinstance(prompt, str):
        if not rt._has_tokenizer():
            raise bad("this model file has no tokenizer: give 'prompt' as token ids",
                      "prompt")
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        ids = await _run_prep(state, lambda: state.prompt_ids(prompt, True))
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = rt.meta.model.vocab_size
        wrong = [t for t in prompt if not 0 <= t < vocab]
        if wrong:
            raise bad(f"'prompt' holds token ids outside the vocabulary of {vocab}: "
                      f"{wrong[:5]}", "prompt")
        ids = list(prompt)
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string, an array of token ids, or an array of one of "
                  "them (toptpu serve completes one prompt per request)", "prompt")
    state.check_room(len(ids), common.max_tokens, "max_tokens", "prompt")
    return await _serve(request, state, common, "completion", prompt=Prompt(ids))


async def _serve(request: Request, state: ServeState, common: Common, kind: str, *,
                 prompt: Prompt | None = None,
                 prepare: Callable[[], Prompt] | None = None) -> Response:
    """Queue the request on the engine and answer it: whole, or as server-sent events."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:  # on the engine thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    job = _job(state, common, emit)
    job.prompt, job.prepare = prompt, prepare
    state.engine.submit(job)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    try:
        first = await _next(events, request, job)
    except BaseException:
        job.cancel()
        raise
    if first is None:  # the client went away while waiting
        return Response(status_code=499)
    if isinstance(first, Failed):
        return error_response(first.message, first.status, first.code)
    assert isinstance(first, Started)
    if common.stream:
        return StreamingResponse(_stream(events, request, job, kind, rid, created, state,
                                         common),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    text = []
    while True:
        event = await _next(events, request, job)
        if event is None:
            return Response(status_code=499)
        if isinstance(event, Text):
            text.append(event.text)
        elif isinstance(event, Failed):
            return error_response(event.message, event.status, event.code)
        elif isinstance(event, Finished):
            return JSONResponse(_whole(kind, rid, created, state.model_id, "".join(text),
                                       event, common))


async def _next(events: asyncio.Queue[Event], request: Request, job: Job) -> Event | None:
    """The job's next event, or None (and the job cancelled) when the client is gone."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), 0.25)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return None


def _usage(event: Finished) -> dict[str, Any]:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def _whole(kind: str, rid: str, created: int, model: str, text: str, event: Finished,
           common: Common) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": event.finish_reason,
                              "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if common.return_token_ids:
        choice["token_ids"] = event.token_ids
    out = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
           "created": created, "model": model, "choices": [choice], "usage": _usage(event),
           "system_fingerprint": None, "toptpu": event.stats}
    return out


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream(events: asyncio.Queue[Event], request: Request, job: Job, kind: str,
                  rid: str, created: int, state: ServeState, common: Common
                  ) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(piece: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if kind == "chat":
            choice["delta"] = piece
        else:
            choice["text"] = piece.get("content", "")
        out = {"id": rid, "object": obj, "created": created, "model": state.model_id,
               "choices": [choice], "system_fingerprint": None}
        if common.include_usage:
            out["usage"] = None
        return out

    try:
        if kind == "chat":
            yield _sse(chunk({"role": "assistant", "content": ""}))
        while True:
            event = await events.get()
            if isinstance(event, Text):
                yield _sse(chunk({"content": event.text}))
            elif isinstance(event, Failed):
                yield _sse(error_body(event.message, event.status, event.code))
                break
            elif isinstance(event, Finished):
                last = chunk({}, event.finish_reason)
                last["toptpu"] = event.stats
                if common.return_token_ids:
                    last["choices"][0]["token_ids"] = event.token_ids
                yield _sse(last)
                if common.include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created,
                                "model": state.model_id, "choices": [],
                                "usage": _usage(event), "toptpu": event.stats})
                break
        yield _sse("[DONE]")
    finally:  # done, or the client went away (the task is cancelled): free the slot
        job.cancel()


async def list_models(request: Request) -> Response:
    state = _state(request)
    _auth(request, state)
    return JSONResponse({"object": "list", "data": [_model(state)]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    _auth(request, state)
    name = request.path_params["model"]
    if name != state.model_id:
        raise bad(f"the model '{name[:200]}' does not exist: this server serves "
                  f"'{state.model_id}'", "model", "model_not_found", 404)
    return JSONResponse(_model(state))


def _model(state: ServeState) -> dict[str, Any]:
    meta = state.rt.meta
    return {"id": state.model_id, "object": "model", "created": state.created,
            "owned_by": "toptpu",
            "toptpu": {"family": meta.model.family, "mode": meta.mode, "chip": meta.chip,
                       "seq_length": state.rt.seq, "batch": state.engine.slots,
                       "vision": state.rt.is_vlm}}


async def health(request: Request) -> Response:
    state = _state(request)
    if state.engine.broken is not None:
        return JSONResponse({"status": "unavailable", "reason": state.engine.broken},
                            status_code=503)
    if state.shutting_down:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.model_id,
                         "queued": state.engine.queued, "active": state.engine.active})


async def metrics(request: Request) -> Response:
    state = _state(request)
    _auth(request, state)
    return JSONResponse(state.engine.metrics())


async def index(request: Request) -> Response:
    return HTMLResponse(PAGE)


async def _serve_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServeError)
    return error_response(str(exc), exc.status, exc.code, exc.param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = {404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(what, exc.status_code, "not_found" if exc.status_code == 404 else None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    print(f"toptpu serve: internal error on {request.url.path}: {type(exc).__name__}: {exc}",
          file=sys.stderr, flush=True)
    return error_response(f"internal error: {type(exc).__name__}", 500)


def build_app(state: ServeState) -> Starlette:
    """The Starlette application over `state`."""
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", index, methods=["GET"]),
    ], exception_handlers={ServeError: _serve_error, HTTPException: _http_error,
                           Exception: _internal_error})
    app.state.serve = state
    return app


# =========================================================================== the server


class _Server(uvicorn.Server):
    """uvicorn's server that tells the engine to stop on SIGTERM / SIGINT and says when it
    listens."""

    def __init__(self, config: uvicorn.Config, state: ServeState, grace: float,
                 ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.serve_state = state
        self.grace = grace
        self.ready = ready

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.serve_state.shutting_down = True
        self.serve_state.engine.shutdown(self.grace)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.ready()


def run_server(state: ServeState, sock: socket.socket, *, grace: float, log_level: str,
               concurrency: int, ready: Callable[[], None]) -> None:
    """Serve `state` on the listening socket `sock` until SIGTERM or SIGINT (which let the
    running requests finish within `grace` seconds, then abort them); the engine stopped
    and joined on the way out."""
    config = uvicorn.Config(build_app(state), log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=int(math.ceil(grace)) + 5,
                            limit_concurrency=concurrency)
    server = _Server(config, state, grace, ready)
    state.engine.start()
    got: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    watched = (signal.SIGINT, signal.SIGTERM)
    # uvicorn re-raises the signal it stopped for once it is done: it lands here, not in
    # the command line's handler (which would end the process with 128 + the signal)
    previous = {s: signal.signal(s, lambda n, f: got.append(n)) for s in watched} \
        if main else {}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        state.engine.shutdown(0.0)
        state.engine.join(timeout=30)
        state.prep.shutdown(wait=False)
