"""`toptpu serve` driven by the real `openai` client on loopback: chat and completions,
streaming and not; greedy tokens equal `toptpu run`'s; the prompt kept (a chat's second
turn, a shared system prompt) with the tokens of a cold run; concurrent clients, batched
and not; bad requests answered with OpenAI error objects while the server stays up; a
client that goes away; SIGTERM mid-stream; a model file replaced under the server.

One tiny Qwen2 (f32, SEQ 160, batch nets at 4) is compiled once per session; each server
is a `toptpu serve` subprocess on a free port, shared by the tests of its configuration.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from llm_fixtures import compiled

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

SEQ = 160
BATCH = 4
PROMPTS = ["Hello world! The tensor", "Each layer is compiled once and", "The chip runs",
           "Tokens stream back to the client while"]
SYSTEM = "You are the assistant of a tensor processor. Answer in short sentences."


@pytest.fixture(scope="session")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", "f32", seq=SEQ, input_len=16,
                    batch=BATCH).model_file


class Server:
    """A `toptpu serve` subprocess on a free loopback port."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toptpu.cli", "serve", model, "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(180):
            self.stop()
            raise AssertionError("toptpu serve did not start:\n" + "".join(self.lines))
        if not self.url:
            raise AssertionError("toptpu serve exited:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def client(self, key: str = "none") -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=120)

    def get(self, path: str, key: str | None = None) -> tuple[int, Any]:
        return request(f"{self.url}{path}", key=key)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def request(url: str, body: bytes | None = None, key: str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, JSON) of a GET (or a POST of `body`)."""
    req = urllib.request.Request(url, data=body, headers=headers or {})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(model_file: str) -> Iterator[Server]:
    s = Server(model_file, "--max-cached-conversations", "8", "--max-body-bytes",
               str(1 << 20))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def unbatched(model_file: str) -> Iterator[Server]:
    s = Server(model_file, "--no-batch-nets", "--max-batch", str(BATCH))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def system_server(model_file: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("serve") / "system.txt"
    path.write_text(SYSTEM)
    s = Server(model_file, "--system-prompt-file", str(path), "--max-batch", "1",
               "--max-queue", "1", "--api-key", "sesame")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def runtime(model_file: str) -> Any:
    from toptpu.backend.runtime.runtime import Runtime

    return Runtime.open(model_file)


def cold(rt: Any, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of a fresh conversation (what `toptpu run` generates)."""
    return list(rt.generate(ids, n).generated_ids)


def chat_ids(rt: Any, messages: list[dict[str, str]]) -> list[int]:
    text = rt.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(rt.encode(text, add_special_tokens=False))


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    from toptpu.cli import main

    capsys.readouterr()
    assert main(["run", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- the API


def test_models_health_and_page(server: Server, model_file: str) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [os.path.basename(model_file)]
    assert server.get("/health") == (200, {"status": "ok", "model": models.data[0].id,
                                           "queued": 0, "active": 0})
    with urllib.request.urlopen(server.url + "/", timeout=30) as r:
        page = r.read().decode()
    assert "/v1/chat/completions" in page and "stream: true" in page


def test_greedy_tokens_equal_toptpu_run(server: Server, model_file: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Completion and chat, whole and streamed: the tokens and text `toptpu run` gives."""
    client = server.client()
    model = os.path.basename(model_file)
    ref = run_json(capsys, model_file, "--prompt", PROMPTS[0], "--max-new-tokens", "8")
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref["generated_ids"]
    assert out.choices[0].text == ref["text"]
    assert out.usage.prompt_tokens == len(ref["prompt_ids"])
    assert out.usage.completion_tokens == len(ref["generated_ids"])
    assert out.choices[0].finish_reason == ("stop" if ref["stop_reason"] == "eos"
                                            else "length")
    streamed = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref["text"]

    ref = run_json(capsys, model_file, "--prompt", PROMPTS[1], "--chat-template",
                   "--max-new-tokens", "8")
    messages = [{"role": "user", "content": PROMPTS[1]}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                         extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref["generated_ids"]
    assert out.choices[0].message.content == ref["text"]
    assert out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(ref["generated_ids"])
    assert chunks[-1].usage.prompt_tokens == len(ref["prompt_ids"])


def test_stop_sequences_and_max_tokens(server: Server, model_file: str,
                                       runtime: Any) -> None:
    """A stop sequence ends the text before it (finish_reason stop), whole and streamed;
    max_tokens ends it with finish_reason length."""
    client = server.client()
    model = os.path.basename(model_file)
    full = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2)
                 if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip(f"no two-character stop sequence in {text!r}")
    cut = text[:text.index(stop)]
    out = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_a_chat_turn_and_a_repeated_prompt_are_kept(server: Server, model_file: str,
                                                    runtime: Any) -> None:
    """The second turn of a chat reuses the first turn's caches (cached_tokens > 0) and
    generates what a cold run of the whole conversation generates."""
    client = server.client()
    model = os.path.basename(model_file)
    first = [{"role": "user", "content": "Tell me about the reference machine."}]
    a = client.chat.completions.create(model=model, messages=first, max_tokens=10,
                                       extra_body={"return_token_ids": True})
    second = [*first, {"role": "assistant", "content": a.choices[0].message.content},
              {"role": "user", "content": "And about its local memory?"}]
    b = client.chat.completions.create(model=model, messages=second, max_tokens=10,
                                       extra_body={"return_token_ids": True})
    ids = chat_ids(runtime, second)
    assert b.usage.prompt_tokens == len(ids)
    kept = b.usage.prompt_tokens_details.cached_tokens
    assert kept >= len(chat_ids(runtime, first)) - 1
    assert b.model_extra["toptpu"]["prefilled_tokens"] == len(ids) - kept
    assert b.choices[0].model_extra["token_ids"] == cold(runtime, ids, 10)
    # the same request again: all but its last token are kept, the answer is the same
    c = client.chat.completions.create(model=model, messages=second, max_tokens=10,
                                       extra_body={"return_token_ids": True})
    assert c.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert c.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    # the modelled chip time of the first token shows the gain
    assert c.model_extra["toptpu"]["modelled_ttft_s"] < b.model_extra["toptpu"][
        "modelled_ttft_s"] or kept >= len(ids) - 1
    status, m = server.get("/metrics")
    assert status == 200 and m["cached_tokens"] >= kept + len(ids) - 1
    assert m["conversations"]["held"] <= m["conversations"]["capacity"] == 8


def test_a_preloaded_system_prompt_is_kept(system_server: Server, model_file: str,
                                           runtime: Any) -> None:
    """`--system-prompt-file`: prefilled once at start; chats without a system message get
    it and start from its caches, with the tokens of a cold run; the API key is needed."""
    model = os.path.basename(model_file)
    with pytest.raises(openai.AuthenticationError):
        system_server.client("wrong").models.list()
    client = system_server.client("sesame")
    for question in ("What runs first?", "Which net decodes?"):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=6,
            extra_body={"return_token_ids": True})
        ids = chat_ids(runtime, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": question}])
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.prompt_tokens_details.cached_tokens >= len(ids) // 2
        assert out.choices[0].model_extra["token_ids"] == cold(runtime, ids, 6)
    status, m = system_server.get("/metrics", key="sesame")
    assert m["conversations"]["pinned"] == 1 and m["conversations"]["copied"] >= 1


def test_a_shared_system_prompt_is_kept(server: Server, model_file: str, runtime: Any) -> None:
    """Two chats that share a long system message (no --system-prompt-file): the second
    starts from the first's caches (cached_tokens covers the system prompt) and generates
    what a cold run of its whole prompt generates."""
    client = server.client()
    model = os.path.basename(model_file)
    system = "You are a serving test. Every chat that starts with this prompt shares it."
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": question}]
             for question in ("What is kept?", "Which tokens are prefilled again?")]
    shared = len(os.path.commonprefix([chat_ids(runtime, m) for m in chats]))
    assert shared > 30
    for i, messages in enumerate(chats):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                             extra_body={"return_token_ids": True})
        ids = chat_ids(runtime, messages)
        assert out.usage.prompt_tokens == len(ids)
        kept = out.usage.prompt_tokens_details.cached_tokens
        if i == 1:
            assert shared - 1 <= kept <= shared, (kept, shared)
            assert out.model_extra["toptpu"]["prefilled_tokens"] == len(ids) - kept
        assert out.choices[0].model_extra["token_ids"] == cold(runtime, ids, 8)


def test_sse_ends_with_done_and_sampling_follows_the_seed(server: Server, model_file: str,
                                                          runtime: Any) -> None:
    """The raw event stream is `data: {...}` events ending in `data: [DONE]`; a sampled
    request with a seed gives what `Runtime.generate` gives with that seed, every time;
    `max_completion_tokens` bounds a chat's answer."""
    from toptpu.backend.runtime.runtime import SamplingConfig

    model = os.path.basename(model_file)
    req = urllib.request.Request(
        server.url + "/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": PROMPTS[0], "max_tokens": 5,
                         "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    client = server.client()
    ids = runtime.encode(PROMPTS[1])
    want = list(runtime.generate(ids, 10, SamplingConfig(
        temperature=0.9, top_k=0, top_p=0.95, repetition_penalty=1.0, seed=7)).generated_ids)
    for _ in range(2):
        out = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0.9, top_p=0.95,
            seed=7, extra_body={"return_token_ids": True, "top_k": 0,
                                "repetition_penalty": 1.0})
        assert out.choices[0].model_extra["token_ids"] == want
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count."}], max_completion_tokens=3,
        extra_body={"ignore_eos": True})
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (3, "length")


@pytest.mark.parametrize("which", ["batched", "unbatched"])
def test_four_concurrent_clients(which: str, request: pytest.FixtureRequest, model_file: str,
                                 runtime: Any) -> None:
    """Four clients at once all get their own greedy tokens; with the batch nets their
    decode steps run together."""
    srv: Server = request.getfixturevalue("server" if which == "batched" else "unbatched")
    model = os.path.basename(model_file)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            results[i] = srv.client().completions.create(
                model=model, prompt=PROMPTS[i], max_tokens=12,
                extra_body={"return_token_ids": True})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    before = srv.get("/metrics")[1]["decode_steps_by_batch"]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == 4
    for i, out in results.items():
        want = cold(runtime, runtime.encode(PROMPTS[i]), 12)
        assert out.choices[0].model_extra["token_ids"] == want, PROMPTS[i]
    steps = srv.get("/metrics")[1]["decode_steps_by_batch"]
    grown = {k: v - before.get(k, 0) for k, v in steps.items() if v - before.get(k, 0)}
    if which == "batched":
        assert any(int(k) > 1 for k in grown), grown
    else:
        assert set(grown) == {"1"}


def test_a_vlm_chat_with_a_data_url_image(tmp_path_factory: pytest.TempPathFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny MiniCPM-V: an image sent as a data: URL content part before the text gives
    the tokens of `toptpu run --image --chat-template`; the same image and text again keep
    the image's tokens; another image keeps nothing of the first one's."""
    import base64

    from vlm_fixtures import PROMPT, image_path, make_image, vlm_file

    path = vlm_file(tmp_path_factory, "minicpmv")
    image = image_path(tmp_path_factory, "minicpmv")
    other = str(tmp_path_factory.mktemp("serve_vlm") / "other.png")
    make_image(150, 260, seed=1).save(other)
    model = os.path.basename(path)

    def content(png: str) -> list[dict[str, Any]]:
        with open(png, "rb") as f:
            url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
        return [{"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": PROMPT}]

    refs = [run_json(capsys, path, "--image", png, "--prompt", PROMPT, "--chat-template",
                     "--max-new-tokens", "6") for png in (image, other)]
    srv = Server(path)
    try:
        client = srv.client()
        answers = []
        for png in (image, image, other):
            answers.append(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content(png)}],
                max_tokens=6, extra_body={"return_token_ids": True}))
        first, again, second = answers
        for out, ref in ((first, refs[0]), (again, refs[0]), (second, refs[1])):
            assert out.choices[0].model_extra["token_ids"] == ref["generated_ids"]
            assert out.usage.prompt_tokens == len(ref["prompt_ids"])
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        # the two prompts' ids are the same (placeholders); the images tell them apart
        assert refs[0]["prompt_ids"] == refs[1]["prompt_ids"]
        from toptpu.backend.runtime.runtime import Runtime

        image_start = refs[0]["prompt_ids"].index(int(Runtime.open(path).vision.image_token_id))
        assert 0 < second.usage.prompt_tokens_details.cached_tokens <= image_start
    finally:
        assert srv.stop() == 0


# --------------------------------------------------------------------------- bad requests


def _post(srv: Server, path: str, body: Any, raw: bool = False) -> tuple[int, Any]:
    data = body if raw else json.dumps(body).encode()
    return request(srv.url + path, data, headers={"Content-Type": "application/json"})


def test_bad_requests_are_4xx_and_the_server_stays_up(server: Server, model_file: str) -> None:
    model = os.path.basename(model_file)
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, Any, int, str]] = [
        (chat, b'{"model": "x", "messages": [', 400, "not valid JSON"),
        (chat, b"[1, 2]", 400, "JSON object"),
        (chat, {"model": model, "messages": "hi"}, 400, "'messages' must be"),
        (chat, {"model": model, "messages": msgs, "temperature": "hot"}, 400,
         "'temperature' must be a number"),
        (chat, {"model": model, "messages": msgs, "max_tokens": 0}, 400, "'max_tokens'"),
        (chat, b'{"model": "%s", "messages": [], "top_p": 1e400}' % model.encode(), 400,
         "'top_p' must be a finite number, not inf"),
        (chat, b'{"model": "%s", "messages": [], "top_p": NaN}' % model.encode(), 400,
         "not a JSON number"),
        (chat, b'{"model": "%s", "model": "%s"}' % (model.encode(), model.encode()), 400,
         "the key 'model' twice"),
        (chat, b"[" * 10000 + b"]" * 10000, 400, "nested deeper"),
        (chat, {"model": model, "messages": [{"role": "user", "content": None}]}, 400,
         "must be a string or an array of content parts, not null"),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2.0}, 400,
         "'max_tokens' must be an integer, not a number"),
        (chat, {"model": model, "messages": msgs, "n": 2}, 400, "'n' 2"),
        (chat, {"model": model, "messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, 400,
         "at most 4"),
        (chat, {"model": model, "messages": msgs, "tools": [{"type": "function"}]}, 400,
         "not supported"),
        (chat, {"model": model, "messages": msgs, "bogus": 1}, 400, "unrecognized"),
        (chat, {"model": model, "messages": [{"role": "robot", "content": "x"}]}, 400,
         "role"),
        (chat, {"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
         400, "not fetched"),
        (chat, {"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         400, "no vision net"),
        (chat, {"model": "other", "messages": msgs}, 404, "does not exist"),
        ("/v1/completions", {"model": model, "prompt": [99999]}, 400, "vocabulary"),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": SEQ + 5}, 400,
         f"sequence is {SEQ} tokens"),
        ("/v1/nothing", {}, 404, "no such endpoint"),
    ]
    for path, body, status, words in cases:
        got, answer = _post(server, path, body, raw=isinstance(body, bytes))
        assert got == status, (body, answer)
        assert words in answer["error"]["message"], (words, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    # a prompt longer than the model's sequence names both lengths
    long = " ".join(["tensor processor"] * SEQ)
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=model, prompt=long)
    assert f"of {SEQ} tokens" in str(e.value) and re.search(r"the prompt is \d+ tokens",
                                                             str(e.value))
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": long}])
    assert f"of {SEQ} tokens" in str(e.value) and re.search(r"the prompt is \d+ tokens",
                                                             str(e.value))
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    # an oversized body: refused from its Content-Length before the body is sent, and
    # once more than the limit streamed in (chunked: no length declared)
    for declared in (True, False):
        conn = http.client.HTTPConnection(server.url[len("http://"):], timeout=60)
        conn.putrequest("POST", chat)
        if declared:
            conn.putheader("Content-Length", str(2 << 20))
            conn.endheaders()
            conn.send(b'{"model": ')  # the rest never comes
        else:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for _ in range(33):  # 33 x 32 KiB: just past the server's 1 MiB
                conn.send(b"8000\r\n" + b" " * 0x8000 + b"\r\n")
        reply = conn.getresponse()
        answer = json.loads(reply.read())
        conn.close()
        assert reply.status == 413, answer
        assert "more than the server takes (1048576 bytes" in answer["error"]["message"]
    assert server.get("/health")[0] == 200
    out = server.client().completions.create(model=model, prompt="still up", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_a_full_queue_is_429(system_server: Server, model_file: str) -> None:
    """One slot, a queue of one: a third request while two are in is refused with 429."""
    client = system_server.client("sesame")
    model = os.path.basename(model_file)
    stream = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=120,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the first request runs
    waiting = threading.Thread(target=lambda: client.completions.create(
        model=model, prompt="queued", max_tokens=2))
    waiting.start()
    for _ in range(200):
        if system_server.get("/health")[1]["queued"] == 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the second request never queued")
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=model, prompt="refused", max_tokens=2)
    assert "--max-queue 1" in str(e.value)
    assert sum(1 for _ in chunks) > 0
    waiting.join(120)


# --------------------------------------------------------------------------- lifecycle


def test_a_client_that_goes_away_frees_its_slot(server: Server, model_file: str) -> None:
    model = os.path.basename(model_file)
    before = server.get("/metrics")[1]["cancelled"]
    stream = server.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a long answer please"}],
        max_tokens=120, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    for _ in range(200):
        m = server.get("/metrics")[1]
        if m["cancelled"] > before and m["active"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the request kept its slot: {m}")
    assert m["completion_tokens"] < 120 * m["requests"]


def test_sigterm_mid_stream_finishes_and_exits_0(model_file: str) -> None:
    srv = Server(model_file, "--shutdown-grace", "30")
    try:
        stream = srv.client().completions.create(
            model=os.path.basename(model_file), prompt=PROMPTS[0], max_tokens=100,
            stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    assert any("stopped" in line for line in srv.lines)


def test_sigterm_aborts_what_outlives_the_grace(model_file: str) -> None:
    srv = Server(model_file, "--shutdown-grace", "0")
    try:
        stream = srv.client().completions.create(
            model=os.path.basename(model_file), prompt=PROMPTS[0], max_tokens=140,
            stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            list(it)
        assert "shut down" in str(e.value)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_a_replaced_model_file_is_detected(model_file: str, tmp_path: Any) -> None:
    path = str(tmp_path / "model.toptpu")
    shutil.copyfile(model_file, path)
    srv = Server(path)
    try:
        client = srv.client()
        assert client.completions.create(model="model.toptpu", prompt="a",
                                         max_tokens=2).usage.completion_tokens == 2
        shutil.copyfile(model_file, path + ".new")
        os.replace(path + ".new", path)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="model.toptpu", prompt="b", max_tokens=2)
        assert e.value.status_code == 503 and "replaced" in str(e.value)
        status, health = srv.get("/health")
        assert status == 503 and "restart" in health["reason"]
    finally:
        assert srv.stop() == 0


def test_serving_beyond_loopback_needs_an_api_key(model_file: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from toptpu.cli import main

    env = os.environ.pop("TOPTPU_API_KEY", None)
    try:
        assert main(["serve", model_file, "--host", "0.0.0.0"]) == 1
    finally:
        if env is not None:
            os.environ["TOPTPU_API_KEY"] = env
    err = capsys.readouterr().err
    assert "toptpu serve: error: --host 0.0.0.0 is not a loopback address" in err
