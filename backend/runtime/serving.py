"""Serving many requests over one model file: the prompts kept, a fair queue, batched decode.

What `toptpu serve` runs under its HTTP layer (`toptpu.serve`), torch-free and
transport-free, so tests and benchmarks drive it directly:

- `ConversationPool`: the conversations of recent requests, kept on the chip (their KV
  caches and linear-attention states) and reused for the longest common token prefix of a
  new prompt (a chat's next turn, a shared system prompt): the conversation is cut back to
  the shared prefix (`Conversation.truncate`) and only the new tokens are prefilled, on
  `block_kv` over the history. A conversation another request is using (or the preloaded
  system prompt's) is copied on the device instead (`Conversation.copy_from`). Memory is
  bounded: at most `capacity` conversations exist (each holds a KV cache of SEQ tokens), the
  least recently used idle one is reset and reused for a prompt that shares nothing. Image
  tokens match only where the same image (by its bytes' digest) stands, and a prompt is
  never cut inside an image's tokens.
- `ServingEngine`: one thread runs every net (the executor is not thread-safe). Requests
  wait in a bounded FIFO queue (`submit` refuses beyond it: `ServeError` 429); up to
  `slots` requests are active at once. Each step admits the requests at the head of the
  queue into free slots (each prefilled alone, its first token chosen), then advances every
  active request by one token: together in one batched step when the model file has batch
  nets (`batch.BatchDecoder`, `toptpu compile --batch B`), else one after the other. A
  request whose client went away (`Job.cancel`) frees its slot at the next step. Each
  request's events (`Started`, `Text`, `Finished`, `Failed`) go to its `emit` callback
  from the engine thread.
- Timings: each request's time to first token and decode rate, on the host clock and on
  the modelled chip clock (the executor's ledger: the costs of its own prefill, and of the
  decode steps it took part in), and the engine's totals (`metrics`).
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from toptpu.backend.contract import BLOCK_CACHE, CONV_STATE, HISTORY_K, RECURRENT_STATE
from toptpu.backend.formats.model_file import ModelFileError
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.batch import BatchDecoder, BatchRow
from toptpu.backend.runtime.conversation import Conversation
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.executor import Buffer
from toptpu.backend.runtime.runtime import Runtime, Utf8Streamer
from toptpu.backend.runtime.sampler import SamplingConfig
from toptpu.backend.runtime.vision import EncodedImage
from toptpu.errors import ToptpuError

# =========================================================================== requests


class ServeError(ToptpuError):
    """A request the server refuses: its HTTP status, OpenAI error type and code, and the
    request field at fault."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, and for a prompt with images: the encoded images in order, and
    for each image's tokens (from its first to its last placeholder token) the image's
    digest and the offset in its run (`image_keys`: position -> (digest, offset))."""

    ids: list[int]
    images: list[EncodedImage] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)
    image_keys: dict[int, tuple[str, int]] = field(default_factory=dict)


def image_prompt(ids: list[int], images: Sequence[EncodedImage], digests: Sequence[str],
                 image_token: int) -> Prompt:
    """The `Prompt` of `ids` whose image tokens (`image_token`) belong to `images` in order
    (each `image_tokens` of them); GenerationError when the counts differ."""
    where = [i for i, t in enumerate(ids) if t == image_token]
    need = sum(im.image_tokens for im in images)
    if len(where) != need:
        raise GenerationError(f"the prompt holds {len(where)} image tokens (id {image_token}) "
                              f"but its {len(images)} images fill {need}")
    keys: dict[int, tuple[str, int]] = {}
    starts = []
    at = 0
    for im, digest in zip(images, digests, strict=True):
        first, last = where[at], where[at + im.image_tokens - 1]
        starts.append(first)
        keys.update({p: (digest, p - first) for p in range(first, last + 1)})
        at += im.image_tokens
    return Prompt(ids, list(images), starts, keys)


def digest_of(data: bytes) -> str:
    """The digest that tells an image from another (its bytes)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Started:
    """The prompt is in the caches and the first token chosen: how many of its tokens were
    kept from an earlier request."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Text:
    """Generated text (what may be shown: never part of a stop sequence)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The request is done: why (`stop`: end of sequence or a stop sequence; `length`:
    max_tokens or the KV cache), its token counts and timings."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_ids: list[int]
    stats: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """The request could not be served (`status`: an HTTP status)."""

    status: int
    message: str
    code: str | None = None


Event = Started | Text | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request: its prompt (or `prepare`, which makes it on the engine thread: a
    prompt with images runs the vision net), how to sample and when to stop, and where its
    events go (`emit`, called on the engine thread)."""

    emit: Callable[[Event], None]
    prompt: Prompt | None = None
    prepare: Callable[[], Prompt] | None = None
    max_tokens: int | None = None  # None: until the KV cache is full
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # ---- the engine's
    cancelled: threading.Event = field(default_factory=threading.Event)
    conv: Conversation | None = None
    cached: int = 0
    generated: list[int] = field(default_factory=list)
    recent: list[int] = field(default_factory=list)
    sampler: str = "greedy"
    rng: Any = None
    streamer: Utf8Streamer | None = None
    text: str = ""
    sent: int = 0
    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    modelled_first: Costs | None = None
    modelled_decode: Costs = field(default_factory=Costs)
    decode_host_s: float = 0.0
    batch_rows: int = 0  # rows of the decode steps it took part in, summed

    def cancel(self) -> None:
        """The client went away: drop the request at the engine's next step."""
        self.cancelled.set()

    @property
    def last(self) -> int:
        return self.generated[-1]


# =========================================================================== the pool


class ConversationPool:
    """The conversations kept on the chip (see the module doc): at most `capacity`, each
    idle, busy (a request is using it) or pinned (a preloaded prompt, only copied)."""

    def __init__(self, rt: Runtime, capacity: int) -> None:
        self.rt = rt
        self.capacity = capacity
        self.idle: OrderedDict[int, Conversation] = OrderedDict()  # least recent first
        self.busy: dict[int, Conversation] = {}
        self.pinned: list[Conversation] = []
        self.image_keys: dict[int, dict[int, tuple[str, int]]] = {}
        #: the length of the prompt each conversation last took (what follows: its answer)
        self.prompt_lengths: dict[int, int] = {}
        self.reused = self.copied = self.cold = self.evicted = 0

    @property
    def count(self) -> int:
        return len(self.idle) + len(self.busy) + len(self.pinned)

    def conversation_bytes(self) -> int:
        """What one conversation holds on the chip (its caches and states)."""
        conv = next(iter([*self.idle.values(), *self.busy.values(), *self.pinned]), None)
        if conv is None:
            return conversation_bytes(self.rt)
        return _bytes_of(conv)

    def shared(self, conv: Conversation, prompt: Prompt) -> int:
        """How many of the prompt's first tokens `conv` can keep: the same ids (and the
        same images), not inside an image's tokens, where the conversation can be cut
        exactly, and one token left to feed."""
        toks, ids = conv.tokens, prompt.ids
        mine, theirs = self.image_keys.get(id(conv), {}), prompt.image_keys
        m = 0
        for i in range(min(len(toks), len(ids) - 1)):
            if toks[i] != ids[i] or mine.get(i) != theirs.get(i):
                break
            m += 1
        key = theirs.get(m)
        if key is not None and key[1] > 0:  # the first token fed is inside an image
            m -= key[1]
        while m > 0 and not conv.can_truncate(m):
            m -= 1
        return m

    def acquire(self, prompt: Prompt) -> tuple[Conversation, int]:
        """A conversation for `prompt`, holding its first n tokens: (it, n). Uses the idle
        conversation sharing the longest prefix, or copies a longer one from a busy or
        pinned conversation, or resets the least recently used idle one (or makes a new
        one while under `capacity`). An idle conversation the prompt branches from inside
        its own earlier prompt (another question after a shared system prompt) is copied
        too while under `capacity`, so both branches stay kept; one the prompt continues
        past its earlier prompt (a chat's next turn, the same prompt again) is cut and
        taken."""
        best_idle, n_idle = None, 0
        for conv in reversed(self.idle.values()):  # the most recent first on ties
            n = self.shared(conv, prompt)
            if n > n_idle:
                best_idle, n_idle = conv, n
        source, n_src = None, 0
        for conv in [*self.pinned, *self.busy.values()]:
            n = self.shared(conv, prompt)
            if n > n_src:
                source, n_src = conv, n
        branches = best_idle is not None and self.count < self.capacity and \
            n_idle + 1 < self.prompt_lengths.get(id(best_idle), 0)
        if best_idle is not None and n_idle >= n_src and branches:
            source, n_src = best_idle, n_idle
        elif best_idle is not None and n_idle >= n_src:
            del self.idle[id(best_idle)]
            best_idle.truncate(n_idle)
            self._cut_keys(best_idle, n_idle)
            self.busy[id(best_idle)] = best_idle
            self.reused += 1
            return best_idle, n_idle
        conv = self._free()
        if source is not None and n_src > 0:
            conv.copy_from(source, n_src)
            self.image_keys[id(conv)] = {p: k for p, k in
                                         self.image_keys.get(id(source), {}).items()
                                         if p < n_src}
            self.copied += 1
            n = n_src
        else:
            conv.reset()
            self.image_keys.pop(id(conv), None)
            self.prompt_lengths.pop(id(conv), None)
            self.cold += 1
            n = 0
        self.busy[id(conv)] = conv
        return conv, n

    def _free(self) -> Conversation:
        """A conversation nobody uses: a new one under `capacity`, else the least recently
        used idle one."""
        if self.count < self.capacity:
            return Conversation(self.rt.engine)
        if not self.idle:
            raise GenerationError(f"all {self.capacity} conversations are in use "
                                  "(--max-cached-conversations)")
        _, conv = self.idle.popitem(last=False)
        self.evicted += 1
        return conv

    def _cut_keys(self, conv: Conversation, n: int) -> None:
        keys = self.image_keys.get(id(conv))
        if keys:
            self.image_keys[id(conv)] = {p: k for p, k in keys.items() if p < n}

    def fed(self, conv: Conversation, prompt: Prompt, start: int) -> None:
        """`conv` now holds `prompt` from token `start` on: its image keys."""
        self.prompt_lengths[id(conv)] = len(prompt.ids)
        keys = {p: k for p, k in prompt.image_keys.items() if p >= start}
        if keys:
            self.image_keys.setdefault(id(conv), {}).update(keys)

    def release(self, conv: Conversation) -> None:
        """The request is done with `conv`: it stays, as the most recently used."""
        self.busy.pop(id(conv), None)
        self.idle[id(conv)] = conv

    def discard(self, conv: Conversation) -> None:
        """`conv` is in no known state (a request failed in it): reset, kept idle."""
        conv.reset()
        self.image_keys.pop(id(conv), None)
        self.prompt_lengths.pop(id(conv), None)
        self.release(conv)
        self.idle.move_to_end(id(conv), last=False)

    def pin(self, ids: list[int]) -> Conversation:
        """A conversation holding `ids`, never handed to a request (only copied from)."""
        conv = self._free()
        conv.reset()
        self.pinned.append(conv)
        return conv


def _bytes_of(conv: Conversation) -> int:
    bufs: list[Buffer] = [b for b in (*conv.cache_k, *conv.cache_v) if b is not None]
    bufs += [b for st in conv.states if st is not None for b in st.values()]
    return sum(int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize for b in bufs)


def conversation_bytes(rt: Runtime) -> int:
    """What one conversation of `rt`'s model file holds on the chip (from the nets'
    shapes, nothing allocated)."""
    nets = rt.shapes
    total = 0
    for i, lin in enumerate(nets.linear):
        net = nets.layer_net(BLOCK_CACHE, i)
        if lin:
            total += sum(nets.spec(net, n).nbytes for n in (CONV_STATE, RECURRENT_STATE))
        else:
            total += 2 * nets.spec(net, HISTORY_K).nbytes
    return total


# =========================================================================== the engine


@dataclass
class Totals:
    """What the engine has served (`ServingEngine.metrics`)."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_host_s: float = 0.0
    decode_host_s: float = 0.0
    prefill_modelled_s: float = 0.0
    decode_modelled_s: float = 0.0
    decode_steps: dict[int, int] = field(default_factory=dict)  # rows -> steps


class ServingEngine:
    """Runs the requests of one model file on one thread (see the module doc)."""

    def __init__(self, rt: Runtime, *, slots: int = 1, max_queue: int = 16,
                 max_conversations: int = 8, batch: BatchDecoder | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        if slots < 1 or max_queue < 0:
            raise GenerationError("a server needs at least one slot and a queue of >= 0")
        if batch is not None and slots > batch.size:
            raise GenerationError(f"{slots} slots do not fit the batch nets of {batch.size}")
        if max_conversations < slots:
            raise GenerationError(f"--max-cached-conversations {max_conversations} is less "
                                  f"than the {slots} requests decoded at once")
        self.rt = rt
        self.slots = slots
        self.max_queue = max_queue
        self.batch = batch
        self.pool = ConversationPool(rt, max_conversations)
        self.log = log or (lambda line: None)
        self.totals = Totals()
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline: float | None = None
        #: why the engine can serve no more (the model file changed under it), else None
        self.broken: str | None = None
        self._head_cfg: SamplingConfig | None = None
        _ = rt.tokenizer if rt._has_tokenizer() else None  # built once, before any thread

    # ------------------------------------------------------------------ outside
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="toptpu-serve-engine",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); ServeError 429 when the queue is full, 503 when the server
        shuts down or cannot serve."""
        with self._cv:
            if self.broken is not None:
                raise ServeError(503, self.broken, "model_unavailable")
            if self._stopping:
                raise ServeError(503, "the server is shutting down", "shutting_down")
            if len(self._queue) >= self.max_queue:
                self.totals.refused += 1
                raise ServeError(429, f"the server is busy: {len(self._queue)} requests wait "
                                 f"(--max-queue {self.max_queue}) and {len(self._active)} run; "
                                 "retry later", "queue_full")
            job.submitted = time.perf_counter()
            self._queue.append(job)
            self._cv.notify()

    def shutdown(self, grace_s: float) -> None:
        """Stop taking requests; those queued fail (503), those running finish within
        `grace_s` seconds, then fail too. Thread-safe, idempotent."""
        with self._cv:
            if not self._stopping:
                self._stopping = True
                self._deadline = time.perf_counter() + grace_s
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    def preload(self, ids: list[int]) -> tuple[float, float | None]:
        """Prefill `ids` once into a pinned conversation (a system prompt every request
        may start with; before `start`): returns its host and modelled seconds."""
        if not 0 < len(ids) < self.rt.seq:
            raise GenerationError(f"the preloaded prompt has {len(ids)} tokens; the KV cache "
                                  f"holds {self.rt.seq}")
        conv = self.pool.pin(ids)
        t0, c0 = time.perf_counter(), self.rt.ex.modelled_costs()
        conv.feed(ids, self.rt._layout(ids, len(ids), []))
        if conv.hybrid:
            conv.checkpoint()
        c1 = self.rt.ex.modelled_costs()
        return time.perf_counter() - t0, (c1 - c0).total_s if c0 and c1 else None

    def metrics(self) -> dict[str, Any]:
        t, p = self.totals, self.pool
        steps = dict(sorted(t.decode_steps.items()))
        rows = sum(k * v for k, v in steps.items())
        return {
            "requests": t.requests, "failed": t.failed, "cancelled": t.cancelled,
            "refused_queue_full": t.refused, "queued": self.queued, "active": self.active,
            "slots": self.slots, "batch": self.batch.size if self.batch else 1,
            "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
            "prefilled_tokens": t.prompt_tokens - t.cached_tokens,
            "completion_tokens": t.completion_tokens,
            "prefill_host_s": t.prefill_host_s, "prefill_modelled_s": t.prefill_modelled_s,
            "decode_host_s": t.decode_host_s, "decode_modelled_s": t.decode_modelled_s,
            "decode_steps_by_batch": {str(k): v for k, v in steps.items()},
            "decode_modelled_tokens_per_s": rows / t.decode_modelled_s
            if t.decode_modelled_s > 0 else None,
            "decode_host_tokens_per_s": rows / t.decode_host_s if t.decode_host_s > 0
            else None,
            "conversations": {"held": p.count, "capacity": p.capacity,
                              "pinned": len(p.pinned), "bytes_each": p.conversation_bytes(),
                              "reused": p.reused, "copied": p.copied, "cold": p.cold,
                              "evicted": p.evicted},
            "unavailable": self.broken,
        }

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._active or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    while self._queue:
                        self._fail(self._queue.popleft(), 503, "the server is shutting down",
                                   "shutting_down")
                    if not self._active:
                        return
                    if self._deadline is not None and time.perf_counter() > self._deadline:
                        for job in list(self._active):
                            self._abort(job, 503, "the server shut down before the request "
                                        "finished", "shutting_down")
                        return
                admit: list[Job] = []
                while self._queue and len(self._active) + len(admit) < self.slots:
                    admit.append(self._queue.popleft())
            for job in admit:
                self._guarded(job, self._admit)
            for job in [j for j in self._active if j.cancelled.is_set()]:
                self.totals.cancelled += 1
                self._release(job)
            if self._active:
                self._decode_step()

    def _guarded(self, job: Job, step: Callable[[Job], None]) -> None:
        """Run `step` of `job`; what goes wrong fails the job, not the server."""
        try:
            step(job)
        except ModelFileError as e:
            self.broken = (f"the model file can no longer be used: {e}; restart toptpu serve "
                           "to load it again")
            self.log(f"toptpu serve: error: {self.broken}")
            self._abort(job, 503, self.broken, "model_unavailable")
        except ToptpuError as e:
            self._abort(job, 400, str(e), None)
        except Exception as e:  # noqa: BLE001 - a bug: this request fails, the server stays
            self.log("toptpu serve: internal error:\n" + traceback.format_exc())
            self._abort(job, 500, f"internal error: {type(e).__name__}: {e}", None)

    def _abort(self, job: Job, status: int, message: str, code: str | None) -> None:
        if job.conv is not None:
            self.pool.discard(job.conv)
            job.conv = None
        if job in self._active:
            self._active.remove(job)
        self._fail(job, status, message, code)

    def _fail(self, job: Job, status: int, message: str, code: str | None) -> None:
        self.totals.failed += 1
        job.emit(Failed(status, message, code))

    def _release(self, job: Job) -> None:
        if job in self._active:
            self._active.remove(job)
        if job.conv is not None:
            self.pool.release(job.conv)
            job.conv = None

    def _admit(self, job: Job) -> None:
        """Prefill the job's prompt (after what a kept conversation shares with it) and
        choose its first token."""
        if job.cancelled.is_set():
            self.totals.cancelled += 1
            return
        rt = self.rt
        job.admitted = time.perf_counter()
        c0 = rt.ex.modelled_costs()
        if job.prompt is None:
            assert job.prepare is not None
            job.prompt = job.prepare()
        prompt = job.prompt
        ids = prompt.ids
        if len(ids) > rt.seq:
            raise PromptError(len(ids), rt.seq)
        job.sampling.validate()
        job.sampler = rt.sampler.resolve(job.sampling)
        c_start = rt.ex.modelled_costs()
        t_start = time.perf_counter()
        conv, n = self.pool.acquire(prompt)
        job.conv, job.cached = conv, n
        feed = ids[n:]
        items = [im for im, s in zip(prompt.images, prompt.image_starts, strict=True) if s >= n]
        layout = None
        if rt.family is not None and rt.meta.vision is not None:
            layout = rt.family.lay_out(rt.meta.vision, feed, 0, items, conv.next_position,
                                       rt.shapes.position_axes)
        elif items:
            raise GenerationError("this model file has no vision net: images need a "
                                  "compiled vision-language model")
        hidden = conv.feed(feed, layout)
        self.pool.fed(conv, prompt, n)
        if conv.hybrid:
            conv.checkpoint()  # another request with this prompt can start here
        job.rng = np.random.default_rng(job.sampling.seed)
        job.recent = list(conv.tokens)
        token = self._choose_one(job, hidden)
        t1, c1 = time.perf_counter(), rt.ex.modelled_costs()
        job.first_token = t1
        if c0 is not None and c1 is not None and c_start is not None:
            job.modelled_first = c1 - c_start
            self.totals.prefill_modelled_s += (c1 - c0).total_s
        self.totals.prefill_host_s += t1 - t_start
        self.totals.requests += 1
        self.totals.prompt_tokens += len(ids)
        self.totals.cached_tokens += n
        job.streamer = Utf8Streamer(lambda t: rt.tokenizer.decode(t, skip_special_tokens=True)) \
            if rt._has_tokenizer() else None
        job.emit(Started(len(ids), n))
        self._active.append(job)
        self._accept(job, token)

    def _choose_one(self, job: Job, hidden: Buffer) -> int:
        """The job's next token from one hidden row, with the unbatched heads."""
        sampler = self.rt.sampler
        if job.sampler == "sample" and self._head_cfg is not job.sampling:
            sampler.setup(job.sampling)
            self._head_cfg = job.sampling
        return sampler.next_token(hidden, job.sampling, job.sampler, job.rng, job.recent)

    def _decode_step(self) -> None:
        """One token for every active job: one batched step, or one step each."""
        jobs = list(self._active)
        rt = self.rt
        t0, c0 = time.perf_counter(), rt.ex.modelled_costs()
        if self.batch is not None and len(jobs) > 1:
            rows = []
            for job in jobs:
                assert job.conv is not None
                job.recent.append(job.last)
                rows.append(BatchRow(job.conv, job.last, job.sampling, job.sampler, job.rng,
                                     job.recent))
            try:
                tokens = self.batch.step(rows)
            except Exception as e:  # noqa: BLE001 - every job of the step fails alike
                for job in jobs:
                    self._guarded(job, _raise(e))
                return
            t1, c1 = time.perf_counter(), rt.ex.modelled_costs()
            self._charge(jobs, t1 - t0, c1 - c0 if c0 is not None and c1 is not None
                         else None)
            for job, token in zip(jobs, tokens, strict=True):
                self._guarded(job, partial(self._accept, token=token))
            return
        # one step each, in turn: a job waits for the whole round between its tokens, so
        # the round's time is what each is charged (the rate its client sees)
        stepped: list[tuple[Job, int]] = []
        for job in jobs:
            chosen: list[int] = []
            self._guarded(job, partial(self._step_into, chosen))
            if chosen:  # else it failed
                stepped.append((job, chosen[0]))
        if not stepped:
            return
        t1, c1 = time.perf_counter(), rt.ex.modelled_costs()
        self._charge([job for job, _ in stepped], t1 - t0,
                     c1 - c0 if c0 is not None and c1 is not None else None, batched=False)
        for job, token in stepped:
            self._guarded(job, partial(self._accept, token=token))

    def _step_into(self, out: list[int], job: Job) -> None:
        out.append(self._step_one(job))

    def _step_one(self, job: Job) -> int:
        """A decode step of the job's last token alone: its next token."""
        assert job.conv is not None
        job.recent.append(job.last)
        hidden = job.conv.step(job.last)
        return self._choose_one(job, hidden)

    def _charge(self, jobs: list[Job], host_s: float, costs: Costs | None,
                batched: bool = True) -> None:
        """The time of one decode round: one batched step of `jobs`, or (not `batched`)
        one step of each in turn; every job is charged all of it (it waited for it)."""
        n = len(jobs) if batched else 1
        steps = 1 if batched else len(jobs)
        self.totals.decode_steps[n] = self.totals.decode_steps.get(n, 0) + steps
        self.totals.decode_host_s += host_s
        if costs is not None:
            self.totals.decode_modelled_s += costs.total_s
        for job in jobs:
            job.decode_host_s += host_s
            job.batch_rows += n
            if costs is not None:
                job.modelled_decode += costs

    def _accept(self, job: Job, token: int) -> None:
        """`token` is the job's next: its text, then whether the job is done."""
        rt, conv = self.rt, job.conv
        assert conv is not None
        job.generated.append(int(token))
        if job.streamer is not None:
            job.text += job.streamer.push(token)
        reason = None
        cut = -1
        if not job.ignore_eos and token in rt.eos_ids:
            reason = "stop"
        elif job.stop:
            cut = _first_stop(job.text, job.stop, max(0, job.sent - _longest(job.stop)))
            if cut >= 0:
                reason = "stop"
        if reason is None and job.max_tokens is not None and \
                len(job.generated) >= job.max_tokens:
            reason = "length"
        if reason is None and len(conv.tokens) >= rt.seq:
            reason = "length"
        if reason is None:
            safe = len(job.text) - (_longest(job.stop) - 1 if job.stop else 0)
            if safe > job.sent:
                job.emit(Text(job.text[job.sent:safe]))
                job.sent = safe
            return
        if cut < 0 and job.streamer is not None:
            job.text += job.streamer.flush()
            if job.stop:
                cut = _first_stop(job.text, job.stop, 0)
        if cut >= 0:
            job.text = job.text[:cut]
        if len(job.text) > job.sent:
            job.emit(Text(job.text[job.sent:]))
            job.sent = len(job.text)
        self._finish(job, reason)

    def _finish(self, job: Job, reason: str) -> None:
        conv = job.conv
        assert conv is not None and job.prompt is not None
        # the last token's k/v would go to the next cache slot: it stays pending (a chat's
        # next turn feeds it first), unless the cache is full
        conv.pending = None if len(conv.tokens) >= self.rt.seq else job.last
        self._release(job)
        self.totals.completion_tokens += len(job.generated)
        job.emit(Finished(reason, len(job.prompt.ids), len(job.generated), job.cached,
                          list(job.generated), self._stats(job)))

    def _stats(self, job: Job) -> dict[str, Any]:
        """The request's timings: host and modelled (the `toptpu` field of a response)."""
        assert job.prompt is not None
        decoded = len(job.generated) - 1
        first = job.modelled_first
        dec = job.modelled_decode
        host_decode = job.decode_host_s
        stats: dict[str, Any] = {
            "cached_tokens": job.cached,
            "prefilled_tokens": len(job.prompt.ids) - job.cached,
            "queue_s": job.admitted - job.submitted,
            "ttft_s": job.first_token - job.admitted,
            "modelled_ttft_s": first.total_s if first is not None else None,
            "decode_tokens_per_s": decoded / host_decode if decoded and host_decode > 0
            else None,
            "modelled_tokens_per_s": decoded / dec.total_s if decoded and dec.total_s > 0
            else None,
            "mean_batch": job.batch_rows / decoded if decoded else None,
            "sampler": job.sampler,
        }
        self.log(f"request: {stats['prefilled_tokens']} of {len(job.prompt.ids)} prompt "
                 f"tokens prefilled ({job.cached} kept), {len(job.generated)} generated; "
                 f"first token {1e3 * stats['ttft_s']:.1f} ms host"
                 + (f", {1e3 * stats['modelled_ttft_s']:.3f} ms modelled"
                    if stats["modelled_ttft_s"] is not None else ""))
        return stats


class PromptError(GenerationError):
    """A prompt longer than the model's sequence."""

    def __init__(self, prompt: int, seq: int) -> None:
        super().__init__(f"the prompt is {prompt} tokens, longer than this model's sequence "
                         f"of {seq} tokens (its KV cache, --seq-length); shorten it")


def _raise(e: Exception) -> Callable[[Job], None]:
    def step(job: Job) -> None:
        raise e

    return step


def _longest(stops: Sequence[str]) -> int:
    return max((len(s) for s in stops), default=0)


def _first_stop(text: str, stops: Sequence[str], start: int) -> int:
    """Where the first stop sequence begins in `text` (searched from `start`), or -1."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1
