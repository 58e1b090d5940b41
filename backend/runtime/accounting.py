"""The modelled time of a generation step, in one place.

A step on the real deployment (LLM-TPU) is more than its nets' engine time: every net
launch costs a fixed launch/sync time, and the host moves data each step (the token id,
the position and the attention mask up; the chosen token back). The chip's figures for
these are in its preset (`Chip.launch_us`, `host_transfer_us`, `host_gbps`).

- `Ledger` is charged by the machine executor as the runtime runs: each net run (its
  modelled engine time, DDR-bound or compute-bound by its busier engine, plus one launch),
  each host<->device copy (`Executor.write` / `read`). `Costs` are its totals; two
  snapshots subtract to the costs of what ran between them (a first token, a decode step).
- `StepModel` charges the same things from per-net timings without running anything:
  what `toptpu estimate` and `toptpu sweep` report. It follows the runtime's generation
  loop (`toptpu.backend.runtime.runtime.Runtime`) step by step; a test checks that the two
  agree on a compiled model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from toptpu.backend.contract import (
    ATTENTION_MASK,
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    EMBEDDING,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    HIDDEN,
    HISTORY_K,
    INPUT_IDS,
    LM_HEAD,
    LOGITS,
    PENALTY,
    PER_LAYER_NETS,
    POSITION_IDS,
    PRESENT_K,
    PROBS,
    RECENT_IDS,
    SAMPLE_HEAD,
    TEMPERATURE,
    TOKEN,
    TOKEN_IDS,
    TOP_K,
    TOP_P,
    NetName,
    TensorSpec,
)
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import NetTiming
from toptpu.backend.target.link import LinkWork, collective_seconds

#: where time goes: nets whose DMA engine is the busier one, nets whose compute engine is,
#: fixed launch costs, host transfers, transfers between chips (collectives, peer copies)
CATEGORIES = ("ddr", "compute", "launch", "host", "link")

#: how the next token is chosen: greedy_head or sample_head on the chip, or on the host
#: from the logits read back
SAMPLERS = ("greedy", "sample", "host")


@dataclass(frozen=True)
class Costs:
    """Modelled time by where it goes, and what caused it."""

    ddr_s: float = 0.0  # engine time of DDR-bound net runs
    compute_s: float = 0.0  # engine time of compute-bound net runs
    launch_s: float = 0.0
    host_s: float = 0.0
    launches: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    dma_bytes: int = 0
    flops: int = 0
    link_s: float = 0.0  # collectives inside nets and copies between chips
    link_bytes: int = 0  # bytes one chip sent over its link

    @property
    def total_s(self) -> float:
        return self.ddr_s + self.compute_s + self.launch_s + self.host_s + self.link_s

    @property
    def bound(self) -> str:
        """The category most time goes to (ddr, compute, launch or host)."""
        times = {c: getattr(self, f"{c}_s") for c in CATEGORIES}
        return max(CATEGORIES, key=lambda c: times[c])

    def __add__(self, other: Costs) -> Costs:
        return Costs(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                        for f in fields(self)})

    def __sub__(self, other: Costs) -> Costs:
        return Costs(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                        for f in fields(self)})

    def times(self, n: int) -> Costs:
        return Costs(**{f.name: getattr(self, f.name) * n for f in fields(self)})

    def to_json(self, per: int = 1) -> dict[str, float | int | str]:
        """The costs (divided by `per`, e.g. per decoded token), their total and bound."""
        out: dict[str, float | int | str] = {k: v / per for k, v in asdict(self).items()}
        out["total_s"] = self.total_s / per
        out["bound"] = self.bound
        return out


@dataclass
class Ledger:
    """What ran on a chip so far (charged by the machine executor)."""

    chip: Chip
    totals: Costs = field(default_factory=Costs)
    per_net: dict[str, Costs] = field(default_factory=dict)

    def net(self, name: str, timing: NetTiming) -> Costs:
        """One launch of `name` with its modelled engine time; returns what it cost."""
        c = net_costs(self.chip, timing)
        self.totals += c
        self.per_net[name] = self.per_net.get(name, Costs()) + c
        return c

    def transfer(self, nbytes: int) -> Costs:
        """One host<->device copy of `nbytes`; returns what it cost."""
        c = transfer_costs(self.chip, nbytes)
        self.totals += c
        return c

    def device_copy(self, nbytes: int) -> Costs:
        """One copy of `nbytes` within the chip's memory; returns what it cost."""
        c = device_copy_costs(self.chip, nbytes)
        self.totals += c
        return c

    def peer(self, nbytes: int, seconds: float) -> Costs:
        """One copy of `nbytes` from a device to another over the link, taking `seconds`;
        returns what it cost."""
        c = Costs(link_s=seconds, link_bytes=nbytes)
        self.totals += c
        return c


def net_costs(chip: Chip, timing: NetTiming) -> Costs:
    """One launch of a net: its engine time (the part the link engine ran collectives as
    link time, the rest DDR- or compute-bound by its busier engine) and the launch."""
    seconds = timing.seconds(chip)
    link = min(timing.link_busy * chip.seconds_per_cycle, seconds)
    rest = seconds - link
    ddr = timing.bound == "ddr"
    return Costs(ddr_s=rest if ddr else 0.0, compute_s=0.0 if ddr else rest,
                 launch_s=chip.launch_us * 1e-6, launches=1, dma_bytes=timing.dma_bytes,
                 flops=timing.flops, link_s=link, link_bytes=timing.link_bytes)


def transfer_costs(chip: Chip, nbytes: int) -> Costs:
    return Costs(host_s=chip.host_transfer_us * 1e-6 + nbytes / (chip.host_gbps * 1e9),
                 transfers=1, transfer_bytes=nbytes)


def device_copy_costs(chip: Chip, nbytes: int) -> Costs:
    """One copy of `nbytes` from DDR to DDR (a runtime's device-to-device memcpy, one
    launch): the bytes read and written at the sustained DDR bandwidth."""
    return Costs(ddr_s=2 * nbytes / (chip.sustained_gbps * 1e9), launch_s=chip.launch_us * 1e-6,
                 launches=1, dma_bytes=2 * nbytes)


def send_costs(chip: Chip, nbytes: int) -> Costs:
    """One copy of `nbytes` from a device to another over the link."""
    return Costs(link_s=collective_seconds(chip, LinkWork("send", "tree", 2, nbytes)),
                 link_bytes=nbytes)


@dataclass(frozen=True)
class Spread:
    """How a model is spread over devices, as the step accounting needs it (what the
    device-group executor, `toptpu.backend.runtime.device_executor`, does each step):

    - `tp`: the embeddings on device 0, every other net on all `devices`: the host writes
      a per-layer net's or a head's inputs to every device, reads the lm_head's logits in
      `devices` pieces, and device 0's embedding goes to the other devices (a send each);
    - `pp`: the embeddings on the first device, the lm_head and heads on the last, each
      stage's layers on its device: the host writes the per-layer nets' inputs to every
      stage whose layers' nets take them (`stages`: each device's layers; a hybrid model's
      linear-attention layers take no position ids or mask; none given: every stage), the
      hidden state goes from stage to stage (a send per boundary);
    - `ep`: the embeddings, the lm_head and the heads on device 0, every per-layer net on
      all `devices` (each its share of the experts; the all-reduce inside the net): the
      host writes a per-layer net's inputs to every device, device 0's embedding goes to
      the other devices (a send each), the logits are read whole from device 0."""

    strategy: str
    devices: int
    stages: tuple[range, ...] = ()  # pp: each device's layers

    def holders(self, net: str) -> int:
        """How many devices a host write of `net`'s inputs reaches."""
        base = NetName.parse(net).base  # `block:16` is a `block`
        if base in (EMBEDDING, EMBEDDING_CACHE):
            return 1
        if self.strategy in ("pp", "ep") and base not in PER_LAYER_NETS:
            return 1
        return self.devices

    @property
    def hidden_sends(self) -> int:
        """Sends of the hidden state in one pass over the layers."""
        return self.devices - 1

    @property
    def logits_pieces(self) -> int:
        return self.devices if self.strategy == "tp" else 1


# =========================================================================== the step model


@dataclass(frozen=True)
class Charge:
    """One line of a step's bill: a net (its runs) or a host transfer (of one tensor), how
    often, and what that cost in all."""

    kind: str  # "net", "transfer" (host<->device) or "send" (device to device)
    what: str  # the net, or the tensor moved and where ("input_ids to the chip")
    count: int
    costs: Costs


def total(charges: Sequence[Charge]) -> Costs:
    """The costs of a bill."""
    out = Costs()
    for c in charges:
        out += c.costs
    return out


def merged(charges: Sequence[Charge]) -> list[Charge]:
    """The bill with the lines of the same net or transfer added up, in first-seen order."""
    out: dict[tuple[str, str], Charge] = {}
    for c in charges:
        key = (c.kind, c.what)
        seen = out.get(key)
        out[key] = c if seen is None else Charge(c.kind, c.what, seen.count + c.count,
                                                  seen.costs + c.costs)
    return list(out.values())


@dataclass(frozen=True)
class StepModel:
    """The generation loop's steps from per-net timings (what `Runtime` does, charged
    without running it).

    `io`: each text net's inputs and outputs (`contract.net_io`); `timings`: one run of
    each net (per-layer nets: one layer's); `layers`: how many layers run the per-layer
    nets; `layer_nets`: for a model whose layers run different nets (`block@3`: another
    layer kind or quantization), each per-layer net's net per layer (`LlmHeader.layer_nets`).

    Each step is itemized (`*_charges`: one `Charge` per net run and host transfer, as the
    machine executor's ledger charges them); the Costs methods are their totals."""

    chip: Chip
    io: Mapping[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]
    timings: Mapping[str, NetTiming]
    layers: int
    layer_nets: Mapping[str, Sequence[str]] = field(default_factory=dict)
    spread: Spread | None = None  # several devices (`Spread`)

    def _spec(self, net: str, name: str) -> TensorSpec:
        """The IO `name` of `net` or, where its layers differ, of the first of its layers'
        nets that has it (a linear-attention `block_cache` has no KV history; the
        full-attention variant's tells the cache length)."""
        for n in (net, *self._variants(net)):
            ins, outs = self.io[n]
            for s in (*ins, *outs):
                if s.name == name:
                    return s
        raise KeyError(f"no net of '{net}' has '{name}'")

    def _variants(self, net: str) -> list[str]:
        """The nets each layer runs for per-layer net `net` (`layer_nets`; a prefill net at
        a shorter length `block:16`: its layers' nets at that length); [] where all run
        `net`."""
        name = NetName.parse(net)
        names = self.layer_nets.get(str(name.layer_net), ())
        return [str(NetName.parse(n).at_length(name.length).at_batch(name.batch))
                for n in names]

    def _layer_names(self, net: str) -> Sequence[str]:
        return self._variants(net) or [net] * self.layers

    def _net(self, net: str) -> Charge:
        return Charge("net", net, 1, net_costs(self.chip, self.timings[net]))

    def _layers(self, net: str) -> list[Charge]:
        """Every layer's run of the per-layer net `net` (each layer's own net)."""
        return merged([self._net(n) for n in self._layer_names(net)])

    def _move(self, net: str, name: str, to_chip: bool, nbytes: int | None = None,
              copies: int = 1) -> Charge:
        """`copies` host transfers of `net`'s IO `name` (of `nbytes` each: its whole by
        default)."""
        nbytes = self._spec(net, name).nbytes if nbytes is None else nbytes
        where = "to the chip" if to_chip else "to the host"
        return Charge("transfer", f"{name} {where}", copies,
                      transfer_costs(self.chip, nbytes).times(copies))

    def _up(self, net: str, *names: str) -> list[Charge]:
        """The host writes `net`'s inputs `names` (to every device that runs it)."""
        return [self._move(net, n, True, copies=self._holders(net, n)) for n in names]

    def _holders(self, net: str, name: str) -> int:
        """How many devices a host write of `net`'s input `name` reaches: a pipeline
        stage's copy only if one of its layers' nets takes it."""
        if self.spread is None:
            return 1
        if not self.spread.stages or NetName.parse(net).base not in PER_LAYER_NETS:
            return self.spread.holders(net)
        nets = self._layer_names(net)
        return sum(any(s.name == name for i in r for s in self.io[nets[i]][0])
                   for r in self.spread.stages)

    def _down(self, net: str, *names: str) -> list[Charge]:
        """The host reads `net`'s outputs `names` (from one device)."""
        return [self._move(net, n, False) for n in names]

    def _sends(self, net: str, name: str) -> list[Charge]:
        """The hidden state `name` of `net` sent on to the devices that need it."""
        if self.spread is None:
            return []
        n = self.spread.hidden_sends
        to = "the next stage" if self.spread.strategy == "pp" else "the other devices"
        return [Charge("send", f"{name} to {to}", n,
                       send_costs(self.chip, self._spec(net, name).nbytes).times(n))]

    @property
    def seq(self) -> int:
        return self._spec(BLOCK_CACHE, HISTORY_K).shape[1]

    @property
    def chunk(self) -> int:
        return self._spec(BLOCK, POSITION_IDS).shape[1]

    @property
    def prefill_tags(self) -> dict[int, int]:
        """Prefill chunk length -> the length tag of its nets (as `Runtime.prefill_tags`:
        read back from the `block` nets' shapes)."""
        out = {}
        for name in self.io:
            net = NetName.parse(name)
            if net.base == BLOCK and not net.is_variant:
                out[self._spec(name, HIDDEN).shape[1]] = net.length
        return out

    def chunk_net(self, base: str, n: int) -> tuple[str, int]:
        """The prefill net `base` a chunk of `n` tokens runs (the shortest prefill length
        that holds it, `Runtime.chunk_length`) and that length."""
        tags = self.prefill_tags
        length = min(length for length in tags if length >= n)
        return str(NetName(base, 0, tags[length])), length

    @property
    def history(self) -> int:
        return self._spec(BLOCK_KV, HISTORY_K).shape[1]

    def decode_step_charges(self) -> list[Charge]:
        """Feed one token: its id, position and mask up, embedding_cache, the layers'
        block_cache (`Runtime._decode_step`)."""
        return [*self._up(EMBEDDING_CACHE, INPUT_IDS), self._net(EMBEDDING_CACHE),
                *self._up(BLOCK_CACHE, POSITION_IDS, ATTENTION_MASK),
                *self._sends(EMBEDDING_CACHE, HIDDEN), *self._layers(BLOCK_CACHE)]

    def next_token_charges(self, sampler: str) -> list[Charge]:
        """Choose a token from the last hidden row (`Runtime._next_token`): lm_head, then
        greedy_head and the token back, or sample_head (the recent ids up) and its
        candidates back, or the logits back to the host."""
        c = [self._net(LM_HEAD)]
        if sampler == "greedy":
            return [*c, self._net(GREEDY_HEAD), *self._down(GREEDY_HEAD, TOKEN)]
        if sampler == "sample":
            return [*c, *self._up(SAMPLE_HEAD, RECENT_IDS), self._net(SAMPLE_HEAD),
                    *self._down(SAMPLE_HEAD, PROBS, TOKEN_IDS)]
        if sampler == "host":  # the logits read in pieces where the devices hold pieces
            pieces = 1 if self.spread is None else self.spread.logits_pieces
            logits = self._spec(LM_HEAD, LOGITS).nbytes
            return [*c, self._move(LM_HEAD, LOGITS, False, logits // pieces, pieces)]
        raise ValueError(f"unknown sampler '{sampler}' ({', '.join(SAMPLERS)})")

    @property
    def batch(self) -> int:
        """The batch B of the batch nets (`block_cache.b4`), 1 without."""
        return max((NetName.parse(n).batch for n in self.io), default=0) or 1

    def batch_step_charges(self, sampler: str = "greedy") -> list[Charge]:
        """One decode step of B conversations on the batch nets
        (`toptpu.backend.runtime.batch.BatchDecoder.step`): the B ids, positions and mask
        rows up, embedding_cache.bB (expert parallel: its B hidden rows sent from device 0
        to the others), each layer's block_cache.bB, lm_head.bB, then the
        tokens back from greedy_head.bB, or sample_head.bB's parameter rows up and its
        candidates back, or the logits back to the host."""
        B = self.batch
        if B < 2:
            raise ValueError("the nets have no batch nets (toptpu compile --batch B)")

        def name(base: str) -> str:
            return str(NetName(base, batch=B))

        c = [*self._up(name(EMBEDDING_CACHE), INPUT_IDS), self._net(name(EMBEDDING_CACHE)),
             *self._up(name(BLOCK_CACHE), POSITION_IDS, ATTENTION_MASK),
             *self._sends(name(EMBEDDING_CACHE), HIDDEN),
             *self._layers(name(BLOCK_CACHE)), self._net(name(LM_HEAD))]
        if sampler == "greedy":
            c += [self._net(name(GREEDY_HEAD)), *self._down(name(GREEDY_HEAD), TOKEN)]
        elif sampler == "sample":
            head = name(SAMPLE_HEAD)
            c += [*self._up(head, RECENT_IDS, PENALTY, TEMPERATURE, TOP_K, TOP_P),
                  self._net(head), *self._down(head, PROBS, TOKEN_IDS)]
        elif sampler == "host":
            c += self._down(name(LM_HEAD), LOGITS)
        else:
            raise ValueError(f"unknown sampler '{sampler}' ({', '.join(SAMPLERS)})")
        return merged(c)

    def batch_step(self, sampler: str = "greedy") -> Costs:
        return total(self.batch_step_charges(sampler))

    def sampling_setup_charges(self, sampler: str) -> list[Charge]:
        """Once per generation: sample_head's parameters up."""
        if sampler != "sample":
            return []
        return self._up(SAMPLE_HEAD, PENALTY, TEMPERATURE, TOP_K, TOP_P)

    def prefill_charges(self, tokens: int, at_full: range = range(0)) -> list[Charge]:
        """Feed a prompt of `tokens` into an empty cache (`Runtime._prefill`): chunks of L
        through block (the first) and block_kv (while the history fits max_history), each
        at the shortest prefill length that holds it (one holding a position of `at_full`,
        the positions of DeepStack rows: at L), the rest token by token through the decode
        net."""
        if not 0 < tokens <= self.seq:
            raise ValueError(f"a prompt of {tokens} tokens does not fit the KV cache of "
                             f"{self.seq}")
        L, Hh, done = self.chunk, self.history, 0
        out: list[Charge] = []
        while done < tokens:
            if done == 0 or done <= Hh:
                n = min(L, tokens - done)
                full = any(p in at_full for p in range(done, done + n))
                out += self._chunk(done, L if full else n, n)
                done += n
            else:
                out += self.decode_step_charges()
                done += 1
        return merged(out)

    def _chunk(self, start: int, rows: int, n: int) -> list[Charge]:
        """One chunk of `n` tokens at `start` (`Runtime._prefill_chunk`): at the shortest
        prefill length that holds `rows` (>= n)."""
        emb, length = self.chunk_net(EMBEDDING, rows)
        net, _ = self.chunk_net(BLOCK if start == 0 else BLOCK_KV, rows)
        block, _ = self.chunk_net(BLOCK, rows)
        c = [*self._up(emb, INPUT_IDS), self._net(emb),
             *self._up(block, POSITION_IDS), *self._up(net, ATTENTION_MASK),
             *self._sends(emb, HIDDEN), *self._layers(net)]
        if start + length > self.seq:  # the padded chunk runs past SEQ: each attention
            # layer's n rows go from the scratch output into the cache through the host (a
            # cache cut by heads: each device's piece)
            scratch = self._spec(block, PRESENT_K)
            rows = scratch.nbytes // scratch.shape[1] * n
            # (tp: each device's piece; ep: every device's whole copy written)
            strategy = None if self.spread is None else self.spread.strategy
            parts = self.spread.devices if self.spread is not None and strategy == "tp" \
                else 1
            copies = self.spread.devices if self.spread is not None and strategy == "ep" \
                else 1
            layers = sum(any(s.name == PRESENT_K for s in self.io[name][1])
                         for name in self._layer_names(net))
            caches = 2 * parts * layers
            c += [Charge("transfer", "present_k/v to the host (past SEQ)", caches,
                         transfer_costs(self.chip, scratch.nbytes // parts).times(caches)),
                  Charge("transfer", "present_k/v rows to the cache", caches * copies,
                         transfer_costs(self.chip, rows // parts).times(caches * copies))]
        return c

    def first_token_charges(self, prompt_tokens: int, sampler: str,
                            at_full: range = range(0)) -> list[Charge]:
        """Time to first token: the sampler's setup, the prompt's prefill (`at_full`:
        `prefill_charges`), the choice."""
        return merged([*self.sampling_setup_charges(sampler),
                       *self.prefill_charges(prompt_tokens, at_full),
                       *self.next_token_charges(sampler)])

    def per_token_charges(self, sampler: str) -> list[Charge]:
        """One decoded token after the first: a decode step and the choice."""
        return merged([*self.decode_step_charges(), *self.next_token_charges(sampler)])

    def decode_step(self) -> Costs:
        return total(self.decode_step_charges())

    def next_token(self, sampler: str) -> Costs:
        return total(self.next_token_charges(sampler))

    def sampling_setup(self, sampler: str) -> Costs:
        return total(self.sampling_setup_charges(sampler))

    def prefill(self, tokens: int) -> Costs:
        return total(self.prefill_charges(tokens))

    def first_token(self, prompt_tokens: int, sampler: str) -> Costs:
        return total(self.first_token_charges(prompt_tokens, sampler))

    def per_token(self, sampler: str) -> Costs:
        return total(self.per_token_charges(sampler))


def tokens_per_s(per_token: Costs) -> float:
    return 1.0 / per_token.total_s if per_token.total_s > 0 else math.inf
