"""A model on several devices: how layers are spread and how many devices a model needs.

The compiler (`toptpu.compiler`) spreads a model over `--devices N` chips:

- **tensor parallel** (`tp`): every layer on every device, each device its piece of each
  weight and KV head (`toptpu.passes.tensor_parallel`), the collectives in the nets; the
  embeddings run on device 0, whose hidden state the others receive;
- **pipeline parallel** (`pp`): contiguous layers per device (`balance_layers`), the
  embeddings on the first, the lm_head and the heads on the last; the hidden state is sent
  from device to device where a stage ends;
- **expert parallel** (`ep`, mixtures of experts): every layer on every device, attention,
  norms, router and shared expert replicated, each device its E/N of the stacked experts
  (`toptpu.passes.tensor_parallel.ExpertParallelPass`) and an all-reduce of the experts'
  partial sums; the embeddings, the lm_head and the heads on device 0.

Every device's weights and KV cache must fit its memory: a model that does not is refused
with the number of devices it needs (`devices_needed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from toptpu.backend.target.chips import Chip


class Parallel(StrEnum):
    """How a model is spread over several devices (`--parallel`)."""

    TP = "tp"  # tensor parallel
    PP = "pp"  # pipeline parallel
    EP = "ep"  # expert parallel (mixtures of experts)


def balance_layers(costs: Sequence[float], first: float, last: float, devices: int
                   ) -> list[range]:
    """Contiguous layer ranges, one per device, that make the slowest device fastest: device
    d's time is the sum of its layers' `costs`, plus `first` on the first device and
    `last` on the last (ties: the earlier split). Every device gets a layer at least."""
    n, parts = len(costs), devices
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} devices for {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(i: int, j: int, d: int) -> float:
        return prefix[j] - prefix[i] + (first if d == 0 else 0.0) + \
            (last if d == parts - 1 else 0.0)

    # best[d][j]: the least max time of devices 0..d holding layers 0..j-1
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts)]
    for j in range(1, n + 1):
        best[0][j] = span(0, j, 0)
    for d in range(1, parts):
        for j in range(d + 1, n + 1):
            for i in range(d, j):
                t = max(best[d - 1][i], span(i, j, d))
                if t < best[d][j] - 1e-15:
                    best[d][j], cut[d][j] = t, i
    bounds = [n]
    for d in range(parts - 1, 0, -1):
        bounds.append(cut[d][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[d], bounds[d + 1]) for d in range(parts)]


def devices_needed(need: int, devices: int, chip: Chip) -> str:
    """What to do about a device that needs `need` bytes when the model is on `devices`
    devices: the device count that spreads it within the chip's memory, assuming a
    device's bytes shrink with the count."""
    want = math.ceil(devices * need / chip.ddr_bytes)
    want = max(want, devices + 1)
    if want > chip.max_devices:
        return (f"it needs about {want} devices, more than a {chip.name} deployment joins "
                f"({chip.max_devices}): use a smaller -q mode or --seq-length")
    flag = "--parallel tp or pp" if devices == 1 else "(or a smaller -q mode)"
    return f"compile it for at least --devices {want} {flag}"
