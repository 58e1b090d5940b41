"""Expert parallelism for a mixture of experts: the decomposition and its modelled step.

**What is here**: how a MoE layer's experts are spread over N chips (`expert_range`: E/N
consecutive experts each), what each chip computes (`local_routing`, `partial_experts`: its
experts' share of every token's weighted sum, the numpy kernels' own arithmetic), how the
shares combine (`expert_parallel_experts`: an all-reduce in the order
`kernels.all_reduce` adds, ring or tree) and what a decode step costs on the chips' link and
DDR (`ExpertParallelLayer`, `decode_token`: `backend.target.link`'s collective times beside
the bytes each chip moves, against one chip and pipeline parallelism).

**The scheme modelled** (chosen to fit toptpu's SPMD tensor-parallel machinery, where it
would be a `Split(axis=0)` of the stacked experts):

- the attention, the norms and the router are **replicated** on every chip (at the
  35B-A3B's widths a layer's attention is ~37 MB in bf16 against 1.6 GB of experts): every
  chip computes the same hidden state and the same routing, so *dispatch moves nothing* —
  each chip takes the tokens its experts were chosen for from its own copy;
- chip d holds experts [d E/N, (d+1) E/N) and computes, for every token, the weighted sum
  over the token's chosen experts that live on it (an index elsewhere routes nowhere: -1);
- the **combine** is an all-reduce of the [T, H] partial sums (f32 here; the activation type
  on a chip), after which every chip holds the layer's output: the tokens' results come
  back over the link, log2 N steps of T x H values (tree) or 2 (N - 1) steps of 1/N of them
  (ring), whichever `best_algorithm` finds faster;
- the embedding and the lm_head on one chip (its hidden state sent to the others: one
  broadcast per token).

**Not built** (see docs/moe.md): `--parallel ep` in the compiler and the device executor —
the expert-sharded weights in each chip's blob, the per-chip expert offset in the nets, the
collective after the experts in the SPMD nets, and its run on the reference machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toptpu.backend.reference import kernels
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.link import LinkWork, best_algorithm, collective_seconds


def expert_range(device: int, devices: int, experts: int) -> range:
    """The experts chip `device` of `devices` holds: E/N consecutive ones (N divides E)."""
    if devices < 1 or experts % devices:
        raise ValueError(f"{experts} experts do not divide among {devices} devices")
    if not 0 <= device < devices:
        raise ValueError(f"device {device} of {devices}")
    per = experts // devices
    return range(device * per, (device + 1) * per)


def local_routing(weights: np.ndarray, indices: np.ndarray, device: int, devices: int,
                  experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The routing (`top.moe_route`'s weights [T, k], indices [T, k]) as chip `device` uses
    it: an index of one of its experts made local (minus its first expert), any other
    index -1 (it adds nothing there), its weight 0."""
    held = expert_range(device, devices, experts)
    idx = np.asarray(indices)
    mine = (idx >= held.start) & (idx < held.stop)
    local = np.where(mine, idx - held.start, -1).astype(np.int32)
    return np.where(mine, weights, np.zeros_like(weights)), local


def partial_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                    weights: np.ndarray, indices: np.ndarray, device: int, devices: int
                    ) -> np.ndarray:
    """Chip `device`'s share of `top.moe_experts` (gate/up [E, I, H], down [E, H, I] the
    whole model's stacked experts, of which it reads only its own): the f32 sum over each
    token's chosen experts that live on it (`kernels.moe_experts_part`)."""
    held = expert_range(device, devices, gate.shape[0])
    w, idx = local_routing(weights, indices, device, devices, gate.shape[0])
    part = slice(held.start, held.stop)
    return kernels.moe_experts_part(None, x, gate[part], up[part], down[part], w, idx)


def expert_parallel_experts(x: np.ndarray, gate: np.ndarray, up: np.ndarray,
                            down: np.ndarray, weights: np.ndarray, indices: np.ndarray,
                            devices: int, algorithm: str = "tree") -> np.ndarray:
    """`top.moe_experts` computed over `devices` chips: every chip's share
    (`partial_experts`), summed by an all-reduce (`kernels.all_reduce`'s order of adds,
    in f32) and rounded to x's dtype. Equal to the one-chip op up to the order the f32
    partial sums are added in."""
    parts = [partial_experts(x, gate, up, down, weights, indices, d, devices)
             for d in range(devices)]
    return kernels.moe_experts_finish(kernels.all_reduce(parts, algorithm), None, x)


# ====================================================================== the modelled step


@dataclass(frozen=True)
class ExpertParallelLayer:
    """One MoE decoder layer's decode step of `tokens` tokens over `devices` chips:

    `dense_bytes`: the layer's weights outside the experts (attention, norms, router),
    read by every chip (replicated); `expert_bytes`: one expert's gate, up and down;
    `experts`, `top_k`; `hidden` and `act_bytes` (the combined [T, H] in the activation
    type); `all_experts_move`: today's machine loads every expert a chip holds each step
    (the indexed fetch, loading only the chosen ones, is not built yet): True charges a
    chip its E/N experts, False only the chosen ones on its busiest chip (`busiest`)."""

    experts: int
    top_k: int
    expert_bytes: int
    dense_bytes: int
    hidden: int
    act_bytes: int
    devices: int
    tokens: int = 1
    all_experts_move: bool = True

    def busiest(self) -> int:
        """Chosen experts on the busiest chip when the T x k choices spread evenly over the
        chips (distinct experts, at most the chip's E/N): ceil(T k / N), the balanced
        case; routing that piles a step's choices on one chip costs up to min(T k, E/N)."""
        per = self.experts // self.devices
        return min(per, -(-self.tokens * self.top_k // self.devices))

    def chip_expert_bytes(self) -> int:
        """Expert bytes the busiest chip moves in the step."""
        if self.all_experts_move:
            return self.experts // self.devices * self.expert_bytes
        return self.busiest() * self.expert_bytes

    def combine(self, chip: Chip) -> LinkWork:
        """The all-reduce of the [T, H] partial sums, by the faster algorithm."""
        nbytes = self.tokens * self.hidden * self.act_bytes
        return LinkWork("all_reduce", best_algorithm(chip, "all_reduce", self.devices, nbytes),
                        self.devices, nbytes)

    def link_seconds(self, chip: Chip) -> float:
        return 0.0 if self.devices == 1 else collective_seconds(chip, self.combine(chip))

    def ddr_seconds(self, chip: Chip) -> float:
        """The busiest chip's weight bytes over its sustained DDR bandwidth (decode is
        bound by them)."""
        return (self.dense_bytes + self.chip_expert_bytes()) / (chip.sustained_gbps * 1e9)

    def seconds(self, chip: Chip) -> float:
        return self.ddr_seconds(chip) + self.link_seconds(chip)


@dataclass(frozen=True)
class TokenTime:
    """A decode token's modelled time, how much of it is the link, and the bytes one chip
    sends over the link."""

    strategy: str
    devices: int
    seconds: float
    link_seconds: float
    link_bytes: int


def decode_token(chip: Chip, layer: ExpertParallelLayer, layers: int, head_bytes: int,
                 strategy: str) -> TokenTime:
    """One decode token of a MoE model of `layers` layers like `layer`, plus the lm_head
    and embedding row (`head_bytes`, read on one chip), under `strategy`:

    - `one`: one chip (layer.devices ignored);
    - `pp`: the layers in N contiguous stages, one chip working at a time: the one-chip
      time plus N - 1 sends of the [1, H] hidden state;
    - `ep`: every layer on every chip, its experts split (`ExpertParallelLayer`), and the
      lm_head's chip broadcasting the next token's hidden state (one per token)."""
    n = layer.devices
    hidden_bytes = layer.tokens * layer.hidden * layer.act_bytes
    head_s = head_bytes / (chip.sustained_gbps * 1e9)
    if strategy in ("one", "pp"):
        whole = ExpertParallelLayer(layer.experts, layer.top_k, layer.expert_bytes,
                                    layer.dense_bytes, layer.hidden, layer.act_bytes, 1,
                                    layer.tokens, layer.all_experts_move)
        sends = 0 if strategy == "one" else n - 1
        send = LinkWork("send", "tree", 2, hidden_bytes)
        link = sends * collective_seconds(chip, send)
        return TokenTime(strategy, 1 if strategy == "one" else n,
                         layers * whole.seconds(chip) + head_s + link, link,
                         sends * send.link_bytes())
    if strategy != "ep":
        raise ValueError(f"unknown strategy {strategy!r} (one, pp, ep)")
    bcast = LinkWork("broadcast", "tree", n, hidden_bytes)
    link = layers * layer.link_seconds(chip) + (collective_seconds(chip, bcast) if n > 1
                                                 else 0.0)
    sent = (layers * layer.combine(chip).link_bytes() + bcast.link_bytes()) if n > 1 else 0
    return TokenTime("ep", n, layers * layer.ddr_seconds(chip) + head_s + link, link, sent)


def token_table(chip: Chip, layer: ExpertParallelLayer, layers: int, head_bytes: int,
                devices: Sequence[int]) -> list[TokenTime]:
    """`decode_token` for one chip, then pp and ep over each count of `devices`."""
    out = [decode_token(chip, layer, layers, head_bytes, "one")]
    for n in devices:
        at = ExpertParallelLayer(layer.experts, layer.top_k, layer.expert_bytes,
                                 layer.dense_bytes, layer.hidden, layer.act_bytes, n,
                                 layer.tokens, layer.all_experts_move)
        out += [decode_token(chip, at, layers, head_bytes, s) for s in ("pp", "ep")]
    return out
