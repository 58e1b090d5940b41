"""The `toptpu serve` command line: its arguments and checks (the HTTP stack, Starlette and
uvicorn, is imported only when the command runs: `toptpu.serve`)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import sys

from toptpu.backend.runtime.batch import BatchDecoder
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.serving import ServingEngine, conversation_bytes
from toptpu.cli_args import UsageError, int_at_least
from toptpu.errors import GenerationError

#: the default bound of a request body (images come inside it as data URLs)
DEFAULT_MAX_BODY = 16 << 20
#: the largest --system-prompt-file
MAX_SYSTEM_PROMPT = 1 << 24


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only; "
                   "any other needs --api-key)")
    p.add_argument("--port", type=int_at_least(0), default=8000,
                   help="the port (default 8000; 0: a free one, printed when ready)")
    p.add_argument("--api-key", default=os.environ.get("TOPTPU_API_KEY"),
                   help="the key clients send as 'Authorization: Bearer KEY' (default: "
                   "$TOPTPU_API_KEY); required to listen beyond loopback")
    p.add_argument("--model-name", default=None,
                   help="the model id clients name (default: the model file's name)")
    p.add_argument("--executor", choices=["machine", "interpreter"], default="machine",
                   help="run the nets on the reference machine (default: modelled times) or "
                   "the Tpu interpreter")
    p.add_argument("--max-batch", type=int_at_least(1), default=None,
                   help="requests decoded at once (default: the model file's batch, "
                   "toptpu compile --batch; 1 without batch nets, where more take turns "
                   "step by step)")
    p.add_argument("--no-batch-nets", action="store_true",
                   help="decode the active requests one after the other even where the "
                   "model file has batch nets (to compare)")
    p.add_argument("--max-queue", type=int_at_least(0), default=32,
                   help="requests that may wait for a slot; more are refused with 429 "
                   "(default 32)")
    p.add_argument("--max-cached-conversations", type=int_at_least(1), default=8,
                   help="conversations kept on the chip for the prompts of later requests, "
                   "each a KV cache of the model's sequence (default 8; at least the batch)")
    p.add_argument("--cache-bytes", type=int_at_least(1), default=None,
                   help="at most this many bytes of kept conversations (lowers "
                   "--max-cached-conversations to what fits)")
    p.add_argument("--system-prompt-file", default=None,
                   help="a system prompt (UTF-8 text) prefilled once at start and kept: a chat "
                   "request without a system message gets it, and every request whose prompt "
                   "starts with it reuses its caches")
    p.add_argument("--max-body-bytes", type=int_at_least(1), default=DEFAULT_MAX_BODY,
                   help=f"largest request body (default {DEFAULT_MAX_BODY >> 20} MiB; images "
                   "come inside it)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds SIGTERM leaves running requests to finish before they are "
                   "aborted (default 10)")
    p.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                   help="log level (info: a line per request; warning: errors only)")


def is_loopback(host: str) -> bool:
    """`host` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_system_prompt(path: str | None) -> str | None:
    """--system-prompt-file's text (UTF-8, not empty, at most 16 MiB)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SYSTEM_PROMPT + 1)
    except OSError as e:
        raise UsageError(f"--system-prompt-file '{path}': {e.strerror}") from None
    if len(data) > MAX_SYSTEM_PROMPT:
        raise UsageError(f"--system-prompt-file '{path}' is over {MAX_SYSTEM_PROMPT >> 20} MiB")
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise UsageError(f"--system-prompt-file '{path}' is not UTF-8 text: {e}") from None
    if not text.strip():
        raise UsageError(f"--system-prompt-file '{path}' is empty")
    return text


def system_prefix_ids(rt: Runtime, system: str) -> list[int]:
    """The tokens every chat with `system` as its system message starts with: the chat
    template's rendering up to where the first user message begins, tokenized, its last
    token left out (it may merge with the text after it)."""
    if not rt.tokenizer.has_chat_template:
        raise GenerationError("--system-prompt-file needs a chat template; this model "
                              "file has none")
    probe = "\x00U\x00"
    text = rt.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": probe}],
        add_generation_prompt=True)
    if probe not in text:
        raise GenerationError("the chat template does not show the user's message")
    ids = rt.encode(text[:text.index(probe)], add_special_tokens=False)
    return ids[:-1]


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model file over the OpenAI HTTP API (chat and completions, streaming), keeping
    the prompts of recent requests and decoding several requests at once."""
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} is not a loopback address: give --api-key KEY "
                         "(or $TOPTPU_API_KEY; clients send it as 'Authorization: Bearer "
                         "KEY') to serve beyond this machine")
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):
        raise UsageError("--shutdown-grace must be a number of seconds >= 0")
    system = read_system_prompt(args.system_prompt_file)
    from toptpu.serve import ServeState, run_server  # Starlette and uvicorn: only here

    rt = Runtime.open(args.model_file, args.executor)
    for note in rt.notes:
        _note(f"toptpu: note: {note}")
    file_batch = rt.shapes.batch
    slots = args.max_batch or (1 if args.no_batch_nets else file_batch)
    batch = None
    if file_batch > 1 and not args.no_batch_nets and slots > 1:
        if slots > file_batch:
            raise UsageError(f"--max-batch {slots}: the model file's batch nets take "
                             f"{file_batch} requests; give at most {file_batch} (or "
                             "--no-batch-nets)")
        batch = BatchDecoder(rt.engine)
    capacity = args.max_cached_conversations
    each = conversation_bytes(rt)
    if args.cache_bytes is not None:
        capacity = min(capacity, args.cache_bytes // each)
    pinned = 1 if system is not None else 0
    if capacity < slots + pinned:
        raise UsageError(f"the kept conversations ({capacity} of {each} bytes each: "
                         "--max-cached-conversations / --cache-bytes) must hold the "
                         f"{slots} requests decoded at once"
                         + (" and the system prompt" if pinned else ""))
    engine = ServingEngine(rt, slots=slots, max_queue=args.max_queue,
                           max_conversations=capacity, batch=batch,
                           log=_note if args.log_level != "warning" else None)
    if system is not None:
        ids = system_prefix_ids(rt, system)
        host_s, modelled_s = engine.preload(ids)
        _note(f"toptpu serve: system prompt of {len(ids)} tokens prefilled once in "
              f"{host_s:.3f} s host" + (f", {modelled_s * 1e3:.3f} ms modelled"
                                        if modelled_s is not None else ""))
    model_id = args.model_name or os.path.basename(args.model_file)
    state = ServeState(rt, engine, model_id, int(os.path.getmtime(args.model_file)),
                       args.api_key, args.max_body_bytes, system)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        where = f"[{host}]" if ":" in host else host
        _note(f"toptpu serve: {model_id} ({rt.meta.model.family}, {rt.meta.mode}, KV cache "
              f"{rt.seq} tokens, {slots} at once{', batch nets' if batch else ''}) listening "
              f"on http://{where}:{port}")

    try:
        run_server(state, sock, grace=args.shutdown_grace, log_level=args.log_level,
                   concurrency=args.max_queue + slots + 64, ready=ready)
    finally:
        sock.close()
    _note("toptpu serve: stopped")
    return 0
