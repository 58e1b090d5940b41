"""Calibration of the chip presets to published speeds of real boards.

`bench/calibration/bm168x_published.csv` lists decode tokens/s (and time to first token)
that Sophgo publishes for its own deployments on BM1684X and BM1688 boards, with each
model's shape and how its bmodel stores the lm_head (sources in
`bench/calibration/README.md`); `bm168x_heldout.csv` lists more such rows that the fit
never sees, the check of what it predicts. For every row the model's nets are compiled from
its shape as `toptpu estimate` compiles them (one layer, placeholder weights, the row's
mode, the lm_head quantized as the layers where the row's bmodel quantized it, `seq_length`
SEQ, prefill chunk L = SEQ as LLM-TPU compiles its prefill) and the step accounting charges
a decode step and a first token: the fit comes from the model's own accounting (the bytes,
FLOPs and commands the compiled nets really make, one launch per net run, the host
transfers the runtime makes), never from a formula outside it.

The free figures of each chip, fitted to its rows:

- decode (tokens/s): `ddr_efficiency` (sustained DDR bandwidth), `launch_us` (per net
  launch), `host_transfer_us` (per host<->device copy) and, for a chip with two cores,
  `core_ddr_gbps` (one core's DMA limit; the rows run with one and with two cores);
- time to first token: `compute_efficiency` (prefill is the compute-bound phase).

Fitting minimizes the sum of squared relative errors: the efficiencies by a grid search
(coarse, then fine), the fixed costs (linear in them) exactly at each grid point within
their bounds (`fixed_cost_bounds`: a launch at least one interrupt, 0.1 ms as tpu-mlir's
own estimator charges it, and at most what the published steps leave after their bytes at
the nominal DDR bandwidth; a host copy at most one interrupt). `physics_floor_s` is the
least time any work can take (its bytes at the nominal DDR bandwidth, its FLOPs at the
peak). Compiling the rows takes minutes; `CACHE` keeps each row's compiled command costs
(`estimate.CompiledCosts`) so a refit, the tables and the tests re-time them.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    LM_HEAD,
    StaticShapes,
)
from toptpu.backend.runtime.accounting import Costs, StepModel
from toptpu.backend.target.chips import PRESETS_PATH, Chip, get_chip
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.errors import CompileError, ToptpuError
from toptpu.estimate import STEP_NETS, CompiledCosts, compile_costs
from toptpu.families import text_family
from toptpu.paths import open_output, write_output
from toptpu.request import CompileRequest

HERE = os.path.dirname(os.path.abspath(__file__))
CALIBRATION_DIR = os.path.join(os.path.dirname(HERE), "bench", "calibration")
ROWS_CSV = os.path.join(CALIBRATION_DIR, "bm168x_published.csv")
#: published rows the fit never sees: the check of what it predicts
HELDOUT_CSV = os.path.join(CALIBRATION_DIR, "bm168x_heldout.csv")
CACHE = os.path.join(CALIBRATION_DIR, "compiled_costs.json.gz")

#: the goal of the fit (issue 15): median absolute error and the largest one, decode tok/s
GOAL_MEDIAN = 0.20
GOAL_MAX = 0.40

#: the figures each fit decides
DECODE_FIGURES = ("ddr_efficiency", "launch_us", "host_transfer_us")
MULTICORE_FIGURES = ("core_ddr_gbps",)
PREFILL_FIGURES = ("compute_efficiency",)
#: the nets a decode step runs (greedy)
DECODE_NETS = (EMBEDDING_CACHE, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD)


class CalibrationError(ToptpuError, ValueError):
    pass


# =========================================================================== rows


@dataclass(frozen=True)
class Row:
    """One published measurement with the model's shape."""

    chip: str
    cores: int
    model: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    quant: str
    group_size: int
    lm_head: str  # LM_HEAD_FORMS: half precision, or quantized as the layers are
    seq_length: int
    decode_tok_s: float
    ftl_s: float | None
    source: str

    @property
    def key(self) -> str:
        lm = "/lmq" if self.lm_head == "quantized" else ""
        return (f"{self.chip}/{self.cores}c/{self.model}/{self.quant}/g{self.group_size}/"
                f"s{self.seq_length}{lm}")

    @property
    def keep_float(self) -> str:
        """convert-top-to-tpu's keep-float for this row: the lm_head stays half precision
        unless the row's bmodel quantized it."""
        return "" if self.lm_head == "quantized" else "lm_head"

    @property
    def family(self) -> str:
        """The supported family with this model's structure: Qwen3 (q/k norms), MiniCPM and
        Baichuan2 (Llama's: no biases; Baichuan2's fused W_pack is q, k and v's bytes), and
        Qwen, GLM and DeepSeek-Qwen (biases on q/k/v) as Qwen2."""
        if self.model.startswith("Qwen3"):
            return "qwen3"
        if self.model.startswith(("MiniCPM", "Baichuan")):
            return "llama"
        return "qwen2"

    @property
    def compiled_vocab(self) -> int:
        """The vocabulary compiled: the row's, except a prime one (MiniCPM-2B's 122753)
        one smaller: layer-group tiles a matmul's output channels in equal slices only, so
        a prime vocabulary's lm_head could only stream one channel per slice. One token
        fewer changes the lm_head's bytes by 1/V."""
        return self.vocab - 1 if _is_prime(self.vocab) else self.vocab

    def config(self) -> Any:
        """A transformers config of this shape. A quantized lm_head of tied embeddings is
        compiled untied: the published bmodels export the lm_head as a net of its own with
        its own (quantized) copy of the table, and toptpu keeps a matmul whose weight also
        feeds the embedding's gather in the activation type."""
        import transformers

        cls = getattr(transformers, text_family(self.family).config_class)
        return cls(hidden_size=self.hidden, intermediate_size=self.intermediate,
                   num_hidden_layers=self.layers, num_attention_heads=self.heads,
                   num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                   vocab_size=self.compiled_vocab,
                   tie_word_embeddings=self.tied_embeddings and self.lm_head == "half",
                   max_position_embeddings=max(32768, self.seq_length))

    def shapes(self, chunk: int) -> StaticShapes:
        """KV capacity SEQ, prefill chunk `chunk` (the one prefill length: LLM-TPU's
        published speeds are of nets compiled at one), prefill history SEQ."""
        return StaticShapes.make(self.seq_length, chunk, self.seq_length, [chunk])

    @property
    def chunks(self) -> list[int]:
        """Prefill chunks to try, largest first: SEQ (LLM-TPU prefills SEQ in one net),
        then halves down to 64 (a smaller chunk prefills the prompt in several nets: block,
        then block_kv) should a chip's local memory not hold a plan of SEQ rows; with 2-D
        tiles and reduction parts every row of the published table compiles at SEQ."""
        out, n = [], self.seq_length
        while n >= 64:
            out.append(n)
            n //= 2
        return out


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


#: how a row's bmodel stores its lm_head: half precision (`llm_convert.py`, and the samples
#: that deploy it with --quantize F16), or quantized as the layers (the samples whose
#: gen_bmodel.sh deploys lm_head.mlir with the blocks' --quantize)
LM_HEAD_FORMS = ("half", "quantized")


def _lm_head(value: str) -> str:
    if value not in LM_HEAD_FORMS:
        raise ValueError(f"lm_head must be one of {', '.join(LM_HEAD_FORMS)}, got {value!r}")
    return value


def read_rows(path: str = ROWS_CSV) -> list[Row]:
    rows = []
    with open(path, newline="") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            try:
                rows.append(Row(
                    chip=r["chip"], cores=int(r["cores"]), model=r["model"],
                    hidden=int(r["hidden"]), intermediate=int(r["intermediate"]),
                    layers=int(r["layers"]), heads=int(r["heads"]),
                    kv_heads=int(r["kv_heads"]), head_dim=int(r["head_dim"]),
                    vocab=int(r["vocab"]), tied_embeddings=r["tied_embeddings"] == "true",
                    quant=r["quant"], group_size=int(r["group_size"]),
                    lm_head=_lm_head(r["lm_head"]), seq_length=int(r["seq_length"]),
                    decode_tok_s=float(r["decode_tok_s"]),
                    ftl_s=float(r["ftl_s"]) if r["ftl_s"] else None, source=r["source"]))
            except (KeyError, ValueError) as e:
                raise CalibrationError(f"{path} line {i}: {e}") from e
    return rows


# =========================================================================== compiling


def row_chip(row: Row, figures: Mapping[str, Any] | None = None) -> Chip:
    """The row's chip with the cores it used (and `figures` changed)."""
    chip = get_chip(row.chip)
    return chip.with_figures(cores=row.cores, **(figures or {}))


def compile_row(row: Row, chip: Chip | None = None, progress: Any = None) -> CompiledCosts:
    """The row's decode and first-token nets compiled for its chip (one layer), with the
    largest prefill chunk that fits local memory (`Row.chunks`)."""
    chip = chip or row_chip(row)
    config = row.config()
    for chunk in row.chunks:
        nets = (BLOCK, *(n for n in STEP_NETS if n != BLOCK))  # the block fails first
        if chunk < row.seq_length:
            nets = (BLOCK, BLOCK_KV, *nets[1:])
        try:
            mode = QuantMode(row.quant)
            group = row.group_size if row.group_size > 0 else DEFAULT_GROUP_SIZE
            request = CompileRequest(mode=mode, chip=chip, shapes=row.shapes(chunk),
                                     group_size=group if mode.weight_bits == 4 else None,
                                     keep_float=row.keep_float)
            return compile_costs(config, request, nets=nets, progress=progress)
        except CompileError as e:
            if "local memory" not in str(e) or chunk == row.chunks[-1]:
                raise
            if progress is not None:
                progress.write(f"  prefill chunk {chunk} does not fit local memory; trying "
                               f"{chunk // 2}\n")
    raise AssertionError("unreachable")


def load_cache(path: str = CACHE) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with gzip.open(path, "rt") as f:
        return json.load(f)


def save_cache(entries: Mapping[str, Any], path: str = CACHE) -> None:
    data = json.dumps(entries, separators=(",", ":"), sort_keys=True).encode()
    with open_output(path, "the calibration cache") as f, \
            gzip.GzipFile(fileobj=f, mode="wb") as z:
        z.write(data)


def cache_entry(row: Row, chip: Chip, compiled: CompiledCosts) -> dict[str, Any]:
    """What the cache keeps of a row: the compiled costs and the chip figures the compile
    planned with (layer-group plans with the cost model)."""
    return {"figures": chip.figures(), "costs": compiled.to_json()}


def compiled_rows(rows: Sequence[Row], cache: Mapping[str, Any]) -> dict[str, CompiledCosts]:
    missing = [r.key for r in rows if r.key not in cache]
    if missing:
        raise CalibrationError(f"{len(missing)} rows are not compiled ({missing[0]}, ...): "
                               "run python bench/calibrate.py --refresh")
    return {r.key: CompiledCosts.from_json(cache[r.key]["costs"]) for r in rows}


# =========================================================================== the model


@dataclass(frozen=True)
class Modelled:
    """A row's modelled decode speed and time to first token on a chip, and the least
    time physics allows each (`physics_floor_s`)."""

    tokens_per_s: float
    ttft_s: float
    decode_bound: str
    decode_floor_s: float = 0.0
    ttft_floor_s: float = 0.0


def physics_floor_s(costs: Costs, chip: Chip) -> float:
    """The least time work of `costs` can take on `chip`: its DMA bytes at the nominal DDR
    bandwidth, or its FLOPs at the peak of all cores in the fastest compute type,
    whichever is longer (no launch, no host transfer, no latency)."""
    peak = chip.peak_flops_per_cycle * chip.freq_ghz * 1e9
    return max(costs.dma_bytes / (chip.ddr_gbps * 1e9), costs.flops / peak)


def modelled(row: Row, compiled: CompiledCosts, chip: Chip) -> Modelled:
    """What the model says of the row: the step accounting of its compiled nets."""
    steps = StepModel(chip, compiled.io(), compiled.timings(chip),
                      compiled.model.num_layers, compiled.model.layer_nets())
    per_token = steps.per_token("greedy")
    first = steps.first_token(row.seq_length, "greedy")
    return Modelled(1.0 / per_token.total_s, first.total_s, per_token.bound,
                    physics_floor_s(per_token, chip), physics_floor_s(first, chip))


def relative_error(model: float, published: float) -> float:
    return (model - published) / published


# =========================================================================== fitting

#: the fixed costs' bounds, each with the source it rests on (chips.json's sources repeat
#: them). A net launch costs at least one interrupt: tpu-mlir's own LLM estimator
#: (`python/llm/LlmProfile.py`) charges 0.1 ms per PCIe interrupt, two per layer and step,
#: and LLM-TPU's `models/Qwen2_5/python_demo_opt` exports all blocks as one net to cut
#: that overhead. A host<->device copy of a few bytes (the token id, the position, the
#: mask row, the token back) is one small DMA that completes with one such interrupt: at
#: most 0.1 ms. The upper bound of a launch is what the published rows leave
#: (`launch_ceiling_us`).
LAUNCH_US_MIN = 100.0
HOST_TRANSFER_US_MAX = 100.0
BOUND_SOURCES = {
    "launch_us": "at least one interrupt, 0.1 ms (tpu-mlir python/llm/LlmProfile.py "
                 "pcie_avg_ms; LLM-TPU models/Qwen2_5/python_demo_opt merges the blocks into "
                 "one net to cut it)",
    "host_transfer_us": "at most one interrupt-completed DMA of a few bytes, 0.1 ms "
                        "(tpu-mlir python/llm/LlmProfile.py)",
}


def _decode_parts(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts], chip_of:
                  Callable[[Row], Chip]) -> np.ndarray:
    """Per row: decode step seconds without fixed costs, launches, transfers, DMA bytes."""
    out = []
    for r in rows:
        chip = chip_of(r).with_figures(launch_us=0.0, host_transfer_us=0.0)
        c = compiled[r.key]
        steps = StepModel(chip, c.io(), c.timings(chip, DECODE_NETS), c.model.num_layers,
                          c.model.layer_nets())
        t = steps.per_token("greedy")
        out.append((t.total_s, t.launches, t.transfers, t.dma_bytes))
    return np.array(out, dtype=np.float64)


def launch_ceiling_us(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts], chip: Chip
                      ) -> float:
    """The most a launch can cost on `chip`: what the fastest-per-launch published step
    leaves after moving its DMA bytes at the chip's nominal DDR bandwidth (no deployment
    moves them faster), shared by its launches (the host transfers taken as free)."""
    parts = _decode_parts(rows, compiled, row_chip)
    left = [(1.0 / r.decode_tok_s - p[3] / (chip.ddr_gbps * 1e9)) / p[1]
            for r, p in zip(rows, parts, strict=True)]
    return max(LAUNCH_US_MIN, min(left) * 1e6)


def fixed_cost_bounds(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts], chip: Chip
                      ) -> dict[str, tuple[float, float]]:
    """The bounds (microseconds) the fit keeps `launch_us` and `host_transfer_us` in."""
    return {"launch_us": (LAUNCH_US_MIN, launch_ceiling_us(rows, compiled, chip)),
            "host_transfer_us": (0.0, HOST_TRANSFER_US_MAX)}


def _bounded_fixed_costs(parts: np.ndarray, target: np.ndarray,
                         bounds: tuple[tuple[float, float], tuple[float, float]]
                         ) -> tuple[float, float, float]:
    """Launch and transfer seconds (a, b) within `bounds` minimizing the squared relative
    error of parts[:, 0] + n_launch * a + n_transfer * b against `target`; returns
    (a, b, error). The error is a convex quadratic in (a, b): its minimum over the box is
    the free minimum if inside, else on an edge (each edge a clipped 1-D minimum)."""
    w = 1.0 / target
    cols = np.stack([parts[:, 1] * w, parts[:, 2] * w], axis=1)
    rhs = (target - parts[:, 0]) * w

    def err(ab: np.ndarray) -> float:
        return float(np.sum((cols @ ab - rhs) ** 2))

    candidates = []
    free, *_ = np.linalg.lstsq(cols, rhs, rcond=None)
    candidates.append(free)
    for i in (0, 1):  # the other variable at each of its bounds, this one clipped
        j = 1 - i
        for at in bounds[j]:
            c = cols[:, i]
            v = float(c @ (rhs - cols[:, j] * at) / (c @ c)) if c @ c > 0 else bounds[i][0]
            ab = np.zeros(2)
            ab[i], ab[j] = min(max(v, bounds[i][0]), bounds[i][1]), at
            candidates.append(ab)
    inside = [ab for ab in candidates
              if all(lo - 1e-12 <= x <= hi + 1e-12 for x, (lo, hi) in zip(ab, bounds,
                                                                          strict=True))]
    best = min(inside, key=err)
    return float(best[0]), float(best[1]), err(best)


def _grid(lo: float, hi: float, n: int) -> np.ndarray:
    return np.linspace(lo, hi, n)


def fit_decode(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts], chip: Chip
               ) -> dict[str, float]:
    """ddr_efficiency, launch_us, host_transfer_us (and core_ddr_gbps with two cores) of
    one chip from its rows' decode speeds; the fixed costs within their bounds
    (`LAUNCH_US_MIN`, `launch_ceiling_us`, `HOST_TRANSFER_US_MAX`)."""
    target = np.array([1.0 / r.decode_tok_s for r in rows])
    multicore = chip.cores > 1
    limits = fixed_cost_bounds(rows, compiled, chip)
    bounds = ((limits["launch_us"][0] * 1e-6, limits["launch_us"][1] * 1e-6),
              (limits["host_transfer_us"][0] * 1e-6, limits["host_transfer_us"][1] * 1e-6))

    def evaluate(eff: float, core: float) -> tuple[float, float, float]:
        figures = {"ddr_efficiency": eff}
        if multicore:
            figures["core_ddr_gbps"] = core
        parts = _decode_parts(rows, compiled, lambda r: row_chip(r, figures))
        return _bounded_fixed_costs(parts, target, bounds)

    effs = _grid(0.40, 1.0, 31)
    cores = _grid(0.1 * chip.ddr_gbps, chip.ddr_gbps, 19) if multicore else [chip.core_ddr_gbps]
    best: tuple[float, float, tuple[float, float, float]] | None = None
    for _ in range(2):  # coarse grid, then a finer one around the best point
        for e in effs:
            for c in cores:
                res = evaluate(float(e), float(c))
                if best is None or res[2] < best[2][2]:
                    best = (float(e), float(c), res)
        assert best is not None
        de = (effs[1] - effs[0]) if len(effs) > 1 else 0.0
        effs = _grid(max(0.05, best[0] - de), min(1.0, best[0] + de), 21)
        if multicore:
            dc = cores[1] - cores[0]
            cores = _grid(max(0.5, best[1] - dc), min(chip.ddr_gbps, best[1] + dc), 21)
    assert best is not None
    e, c, (launch, host, _) = best
    out = {"ddr_efficiency": round(e, 4), "launch_us": round(launch * 1e6, 2),
           "host_transfer_us": round(host * 1e6, 2)}
    if multicore:
        out["core_ddr_gbps"] = round(c, 3)
    return out


def fit_prefill(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts],
                figures: Mapping[str, float]) -> dict[str, float]:
    """compute_efficiency of one chip from its rows' times to first token (golden-section
    search on the squared relative error; the decode figures fixed)."""
    timed = [r for r in rows if r.ftl_s is not None]
    if not timed:
        return {}

    def err(f: float) -> float:
        fig = {**figures, "compute_efficiency": f}
        return sum(relative_error(modelled(r, compiled[r.key], row_chip(r, fig)).ttft_s,
                                  r.ftl_s or 1.0) ** 2 for r in timed)

    lo, hi = 0.05, 1.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = err(a), err(b)
    for _ in range(30):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = err(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = err(b)
    return {"compute_efficiency": round((lo + hi) / 2, 4)}


def fit_chip(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts], chip: str
             ) -> dict[str, float]:
    """All free figures of one chip: decode first, then prefill, then decode again with
    the fitted compute efficiency (decode computes a little too)."""
    mine = [r for r in rows if r.chip == chip]
    preset = get_chip(chip)
    figures: dict[str, float] = {}
    for _ in range(2):
        figures.update(fit_decode(mine, compiled, preset.with_figures(**figures)))
        figures.update(fit_prefill(mine, compiled, figures))
    return figures


# =========================================================================== results


@dataclass(frozen=True)
class Result:
    row: Row
    modelled: Modelled

    @property
    def decode_error(self) -> float:
        return relative_error(self.modelled.tokens_per_s, self.row.decode_tok_s)

    @property
    def ttft_error(self) -> float | None:
        if self.row.ftl_s is None:
            return None
        return relative_error(self.modelled.ttft_s, self.row.ftl_s)


def results(rows: Sequence[Row], compiled: Mapping[str, CompiledCosts],
            figures: Mapping[str, Mapping[str, float]] | None = None) -> list[Result]:
    """Every row modelled with its chip's figures (the presets' unless given)."""
    return [Result(r, modelled(r, compiled[r.key], row_chip(r, (figures or {}).get(r.chip))))
            for r in rows]


def median_abs(errors: Iterable[float]) -> float:
    return float(np.median(np.abs(list(errors))))


def table(res: Sequence[Result]) -> str:
    """model | chip | quant | published | modelled | error, decode tok/s and TTFT."""
    lines = ["| model | chip | cores | quant | seq | published tok/s | modelled tok/s | error "
             "| bound | published TTFT s | modelled TTFT s | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in res:
        r, m = x.row, x.modelled
        ttft = (f"{r.ftl_s:g} | {m.ttft_s:.3g} | {x.ttft_error:+.0%}" if r.ftl_s is not None
                else f"- | {m.ttft_s:.3g} | -")
        lines.append(f"| {r.model} | {r.chip} | {r.cores} | {r.quant} | {r.seq_length} | "
                     f"{r.decode_tok_s:g} | {m.tokens_per_s:.3g} | {x.decode_error:+.0%} | "
                     f"{m.decode_bound} | {ttft} |")
    dec = [x.decode_error for x in res]
    ttfts = [e for x in res if (e := x.ttft_error) is not None]
    lines.append("")
    lines.append(f"decode tok/s: median absolute error {median_abs(dec):.1%}, largest "
                 f"{max(abs(e) for e in dec):.1%} ({len(dec)} rows; goal median <= "
                 f"{GOAL_MEDIAN:.0%}, none above {GOAL_MAX:.0%})")
    if ttfts:
        lines.append(f"time to first token: median absolute error {median_abs(ttfts):.1%}, "
                     f"largest {max(abs(e) for e in ttfts):.1%} ({len(ttfts)} rows)")
    return "\n".join(lines)


def write_presets(fitted: Mapping[str, Mapping[str, float]], res: Sequence[Result],
                  bounds: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
                  path: str = PRESETS_PATH) -> None:
    """Put the fitted figures into chips.json, each with its source (a fixed cost with
    the bounds it was fitted in, `fixed_cost_bounds`, and theirs)."""
    with open(path) as f:
        data = json.load(f)
    for chip, figures in fitted.items():
        mine = [x for x in res if x.row.chip == chip]
        dec = median_abs(x.decode_error for x in mine)
        ttfts = [e for x in mine if (e := x.ttft_error) is not None]
        for name, value in figures.items():
            data[chip][name] = value
            what = (f"time to first token ({len(ttfts)} rows, median error "
                    f"{median_abs(ttfts):.0%})" if name in PREFILL_FIGURES else
                    f"decode tok/s ({len(mine)} rows, median error {dec:.0%})")
            source = (f"fitted by bench/calibrate.py to "
                      f"bench/calibration/bm168x_published.csv: {what}")
            limits = (bounds or {}).get(chip, {}).get(name)
            if limits is not None:
                lo, hi = limits
                at = " (at its lower bound)" if value <= lo + 0.005 else \
                    " (at its upper bound)" if value >= hi - 0.005 else ""
                ceiling = ("the upper, what the published step with the least time per "
                           "launch leaves after its DMA bytes at the nominal DDR bandwidth"
                           if name == "launch_us" else "")
                source += (f"; within [{lo:g}, {hi:.4g}] us{at}: {BOUND_SOURCES[name]}"
                           + (f"; {ceiling}" if ceiling else ""))
            data[chip]["sources"][name] = source
    text = _presets_text(data)

    write_output(path, text, "the chip presets")


def _presets_text(data: Mapping[str, Any]) -> str:
    """chips.json as people read it: one figure per line, tflops on one line."""
    out = ["{"]
    chips = list(data.items())
    for i, (name, preset) in enumerate(chips):
        if name.startswith("_"):
            out.append(f"  {json.dumps(name)}: {json.dumps(preset)},")
            continue
        out.append(f"  {json.dumps(name)}: {{")
        items = list(preset.items())
        for j, (k, v) in enumerate(items):
            comma = "," if j < len(items) - 1 else ""
            if k == "sources":
                out.append('    "sources": {')
                srcs = list(v.items())
                for n, (sk, sv) in enumerate(srcs):
                    c = "," if n < len(srcs) - 1 else ""
                    out.append(f"      {json.dumps(sk)}: {json.dumps(sv)}{c}")
                out.append(f"    }}{comma}")
            else:
                out.append(f"    {json.dumps(k)}: {json.dumps(v)}{comma}")
        out.append("  }" + ("," if i < len(chips) - 1 else ""))
    out.append("}")
    return "\n".join(out) + "\n"
