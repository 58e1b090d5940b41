"""The trace of a generation on the chip model: every net run, every host transfer and every
step of the runtime (prefill chunks, the choice of each token, each decode step), placed on
the modelled clock, written as a Chrome trace (opens in Perfetto).

The clock is the step accounting's (`toptpu.backend.runtime.accounting.Ledger`): each net run
takes its launch and its modelled engine time, each host<->device copy its transfer time,
one after the other, exactly what `toptpu run` reports as modelled time. So the spans of the
trace add up to the run's modelled time to first token and tokens/s.

- `RunRecorder` collects: the machine executor adds each net run (`NetRun`: its timeline
  kept by reference: a net's timeline is made once with its plan) and transfer
  (`Transfer`); the runtime adds its steps (`Span`, nested by time).
- `trace_events` turns a record into trace events: one process (the chip), a thread for the
  steps, one for the net runs, one for host transfers and, with `commands`, one per engine
  with every command of every net run (large: a decode step of a 24-layer model has tens of
  thousands of commands).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.machine import Timeline
from toptpu.backend.target.chips import Chip
from toptpu.dialects.output_file import open_text_output


@dataclass(frozen=True)
class NetRun:
    net: str
    layer: int | None
    start_s: float  # on the modelled clock
    costs: Costs  # its launch and engine time
    timeline: Timeline


@dataclass(frozen=True)
class Transfer:
    to_chip: bool
    nbytes: int
    start_s: float
    costs: Costs


@dataclass(frozen=True)
class PeerSend:
    """A copy from one device to another (a multi-device file's hidden state)."""

    src: int
    dst: int
    nbytes: int
    start_s: float
    costs: Costs


@dataclass(frozen=True)
class Span:
    """A step of the runtime: from the modelled clock at its start to that at its end."""

    name: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunRecorder:
    """What ran on the chip model, in order (see the module doc)."""

    chip: Chip
    runs: list[NetRun] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    peers: list[PeerSend] = field(default_factory=list)

    def net(self, net: str, layer: int | None, start_s: float, costs: Costs,
            timeline: Timeline) -> None:
        self.runs.append(NetRun(net, layer, start_s, costs, timeline))

    def transfer(self, to_chip: bool, nbytes: int, start_s: float, costs: Costs) -> None:
        self.transfers.append(Transfer(to_chip, nbytes, start_s, costs))

    def peer(self, src: int, dst: int, nbytes: int, start_s: float, costs: Costs) -> None:
        self.peers.append(PeerSend(src, dst, nbytes, start_s, costs))

    def span(self, name: str, start_s: float, end_s: float, **args: Any) -> None:
        self.spans.append(Span(name, start_s, end_s, args))


#: the trace's threads (tid: name)
STEPS, NETS, HOST, DMA, COMPUTE, LINK = 1, 2, 3, 4, 5, 6
THREADS = {STEPS: "generation steps", NETS: "net runs", HOST: "host transfers",
           DMA: "DMA commands", COMPUTE: "compute commands", LINK: "device to device"}


def _times(start_s: float, end_s: float) -> dict[str, float]:
    """`ts` and `dur` in microseconds, both ends on the nanosecond: a step and the runs
    inside it share their ends exactly, so the viewer nests them (float sums could put a
    child 1e-10 us past its parent)."""
    start, end = round(start_s * 1e9), round(end_s * 1e9)
    return {"ts": start / 1e3, "dur": (end - start) / 1e3}


def trace_events(rec: RunRecorder, commands: bool = False) -> Iterator[dict[str, Any]]:
    """The record as Chrome trace events (times in microseconds of modelled chip time)."""
    yield {"ph": "M", "pid": 1, "name": "process_name",
           "args": {"name": f"toptpu run, modelled on {rec.chip.name}"}}
    for tid, name in THREADS.items():
        if (commands or tid not in (DMA, COMPUTE)) and (rec.peers or tid != LINK):
            yield {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name",
                   "args": {"name": name}}
            yield {"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index",
                   "args": {"sort_index": tid}}
    # parents before children: by start, the longer first
    for s in sorted(rec.spans, key=lambda s: (s.start_s, -(s.end_s - s.start_s))):
        yield {"ph": "X", "pid": 1, "tid": STEPS, "name": s.name,
               **_times(s.start_s, s.end_s), "args": s.args}
    spc = rec.chip.seconds_per_cycle
    for r in rec.runs:
        c = r.costs
        yield {"ph": "X", "pid": 1, "tid": NETS,
               "name": r.net if r.layer is None else f"{r.net} layer {r.layer}",
               **_times(r.start_s, r.start_s + c.total_s),
               "args": {"net": r.net, "layer": r.layer, "launch_s": c.launch_s,
                        "engine_s": c.ddr_s + c.compute_s,
                        "bound": "ddr" if c.ddr_s else "compute" if c.compute_s else "none",
                        "dma_bytes": c.dma_bytes, "flops": c.flops}}
        if commands:
            offset = r.start_s + c.launch_s
            for e in r.timeline.events:
                yield {"ph": "X", "pid": 1, "tid": DMA if e.engine == "dma" else COMPUTE,
                       "name": e.name,
                       **_times(offset + e.start * spc, offset + e.end * spc),
                       "args": {"net": r.net, "cmd": e.cmd, "bytes": e.bytes,
                                "flops": e.flops}}
    for t in rec.transfers:
        where = "to the chip" if t.to_chip else "to the host"
        yield {"ph": "X", "pid": 1, "tid": HOST, "name": f"{t.nbytes} B {where}",
               **_times(t.start_s, t.start_s + t.costs.total_s),
               "args": {"bytes": t.nbytes, "to_chip": t.to_chip}}
    for p in rec.peers:
        yield {"ph": "X", "pid": 1, "tid": LINK,
               "name": f"{p.nbytes} B device {p.src} -> {p.dst}",
               **_times(p.start_s, p.start_s + p.costs.total_s),
               "args": {"bytes": p.nbytes, "src": p.src, "dst": p.dst}}


def write_run_trace(path: str, rec: RunRecorder, commands: bool = False,
                    other: dict[str, Any] | None = None) -> None:
    """The record as a Chrome trace JSON file, written event by event (a trace with every
    command is large)."""
    with open_text_output(path, "--trace") as f:
        f.write('{"displayTimeUnit": "ns", "otherData": ')
        f.write(json.dumps({"chip": rec.chip.name, "clock": "modelled chip time",
                            **(other or {})}))
        f.write(', "traceEvents": [\n')
        for i, e in enumerate(trace_events(rec, commands)):
            f.write((",\n" if i else "") + json.dumps(e))
        f.write("\n]}\n")
