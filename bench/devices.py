"""Models spread over several BM1684X: `toptpu estimate --devices N --parallel tp|pp` for
Qwen2.5-14B, QwQ-32B and Qwen2.5-72B shapes, against the published multi-device rows.

    python bench/devices.py                # all three tables
    python bench/devices.py --rows         # the published rows (bench/calibration/
                                           # bm1684x_multi_device.csv) beside the model
    python bench/devices.py --grid         # 14B / 32B / 72B on 1, 2, 4, 8 devices, tp and pp
    python bench/devices.py --link         # QwQ-32B over the link's bandwidth and latency:
                                           # where tp stops paying against pp
    python bench/devices.py --fit [--write]  # fit the link latency to the published tp rows
                                           # (and write it into chips.json)

Each net is compiled as `toptpu estimate` compiles it (one layer, placeholder weights; tp
cut by the tensor-parallel pass for each device count, pp from the one-device programs) and
kept in a cache (`--cache`, default under the system's temp directory): a rerun re-times the
compiled streams only. The time to first token is that of a prompt of SEQ tokens, as the
static bmodels of the published rows prefill (the largest prefill chunk that fits local
memory, `toptpu.calibration.Row.chunks`'s rule); the link sweep re-times the streams
compiled at the preset's link figures (the collectives keep the algorithm chosen there).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from toptpu.backend.contract import (
    BLOCK,
    BLOCK_CACHE,
    BLOCK_KV,
    EMBEDDING,
    EMBEDDING_CACHE,
    GREEDY_HEAD,
    LM_HEAD,
    StaticShapes,
)
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.devices import Parallel
from toptpu.dialects.common import QuantMode
from toptpu.errors import CompileError
from toptpu.estimate import (
    STEP_NETS,
    CompiledCosts,
    Estimate,
    compile_costs,
    compile_programs,
    estimate,
    model_shape,
    read_checked_config,
    spread_costs,
)
from toptpu.request import CompileRequest

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = os.path.join(HERE, "calibration", "bm1684x_multi_device.csv")
CACHE = os.path.join(tempfile.gettempdir(), "toptpu-bench-devices.json.gz")
CONFIGS = os.path.join(HERE, "configs")


@dataclass(frozen=True)
class Shape:
    """A Qwen2-family model's public shape."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @property
    def key(self) -> str:
        """The name and every dimension (the compile cache's key)."""
        return (f"{self.name}:{self.hidden}x{self.intermediate}x{self.layers}:{self.heads}/"
                f"{self.kv_heads}:{self.vocab}{':tied' if self.tied else ''}")

    def config(self, seq: int) -> Any:
        import transformers

        return transformers.Qwen2Config(
            hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
            tie_word_embeddings=self.tied, max_position_embeddings=max(32768, seq),
            rope_theta=1000000.0, rms_norm_eps=1e-6)


#: the public shapes of the models the issue names (their config.json). Qwen2.5-72B's
#: intermediate size 29568 leaves 3696 per device on 8, which no w4 group of 32 or more
#: divides; Qwen's own quantized releases (Qwen2.5-72B-Instruct-AWQ / -GPTQ-Int4) pad it to
#: 29696 (zero rows and columns), and so does this grid.
MODELS = {
    "Qwen2.5-14B": Shape("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064),
    "QwQ-32B": Shape("QwQ-32B", 5120, 27648, 64, 40, 8, 152064),
    "Qwen2.5-72B": Shape("Qwen2.5-72B", 8192, 29696, 80, 64, 8, 152064),
}


# =========================================================================== compiling


def chunks(seq: int) -> list[int]:
    """Prefill chunks to try, largest first (SEQ, then halves down to 64)."""
    out, n = [], seq
    while n >= 64:
        out.append(n)
        n //= 2
    return out


class Compiler:
    """Compiles (or takes from the cache) a shape's programs for tp over N, or one device
    (which pp spreads), with the largest prefill chunk that fits local memory."""

    def __init__(self, path: str, chip: Chip) -> None:
        self.path, self.chip = path, chip
        self.cache: dict[str, Any] = {}
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                self.cache = json.load(f)

    def save(self) -> None:
        tmp = self.path + f".tmp-{os.getpid()}"
        with gzip.open(tmp, "wt") as f:
            json.dump(self.cache, f)
        os.replace(tmp, self.path)

    def costs(self, shape: Shape, mode: str, group: int, seq: int, devices: int,
              parallel: str | None, prefill: bool = True) -> CompiledCosts:
        """The costs of `shape` spread over `devices` by `parallel` (None: one device)."""
        tp = devices if parallel == "tp" else 1
        key = f"{shape.key}/{mode}/g{group}/s{seq}/tp{tp}/{'prefill' if prefill else 'decode'}"
        if key not in self.cache:
            self.cache[key] = self._compile(shape, mode, group, seq, tp, prefill)
            self.save()
        entry = self.cache[key]
        one = CompiledCosts.from_json(entry["costs"])
        if parallel is None or devices == 1:
            return one
        return CompiledCosts(
            model=one.model, mode=one.mode, shapes=one.shapes, commands=one.commands,
            weight_bytes=sum(entry["bytes"][parallel][str(devices)][0]),
            kv_bytes=sum(entry["bytes"][parallel][str(devices)][1]), devices=devices,
            parallel=Parallel(parallel),
            device_weight_bytes=entry["bytes"][parallel][str(devices)][0],
            device_kv_bytes=entry["bytes"][parallel][str(devices)][1])

    def _compile(self, shape: Shape, mode: str, group: int, seq: int, tp: int,
                 prefill: bool) -> dict[str, Any]:
        print(f"compiling {shape.name} {mode} seq {seq}"
              + (f" tp {tp}" if tp > 1 else "") + " ...", file=sys.stderr, flush=True)
        config = shape.config(seq)
        for chunk in chunks(seq) if prefill else [min(seq, 128)]:
            nets = [EMBEDDING, EMBEDDING_CACHE, BLOCK_CACHE, LM_HEAD, GREEDY_HEAD]
            if prefill:
                nets = [BLOCK, *([BLOCK_KV] if chunk < seq else []), *nets]
            else:
                nets = [BLOCK, *nets]
            request = CompileRequest(
                mode=QuantMode(mode), chip=self.chip, shapes=StaticShapes.make(seq, chunk, seq),
                group_size=group if QuantMode(mode).weight_bits == 4 else None, devices=tp,
                parallel=Parallel.TP if tp > 1 else None)
            try:
                progs = compile_programs(config, request, nets)
                break
            except CompileError as e:
                if "local memory" not in str(e) or chunk == 64:
                    raise
        m = model_shape(config)
        shapes = StaticShapes.make(seq, chunk, seq)
        one = spread_costs(progs, m, request.mode, shapes)
        spreads: dict[str, dict[str, Any]] = {"tp": {}, "pp": {}}
        if tp > 1:
            c = spread_costs(progs, m, request.mode, shapes, tp, Parallel.TP, self.chip)
            spreads["tp"][str(tp)] = [c.device_weight_bytes, c.device_kv_bytes]
        else:
            for n in (2, 4, 8):
                c = spread_costs(progs, m, request.mode, shapes, n, Parallel.PP, self.chip)
                spreads["pp"][str(n)] = [c.device_weight_bytes, c.device_kv_bytes]
        return {"costs": one.to_json(), "bytes": spreads}


def modelled(compiler: Compiler, shape: Shape, mode: str, group: int, seq: int,
             devices: int, parallel: str | None, chip: Chip | None = None,
             prefill: bool = True) -> Estimate:
    costs = compiler.costs(shape, mode, group, seq, devices, parallel, prefill)
    return estimate(costs, chip or compiler.chip, prompt_tokens=seq if prefill else None)


# =========================================================================== tables


def rows_table(compiler: Compiler) -> None:
    """Each published row beside the model's figures."""
    print("| model | board | devices | parallel | quant | seq | published tok/s | modelled "
          "tok/s | error | published FTL s | modelled TTFT s | error | collectives ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    with open(ROWS, newline="") as f:
        for r in csv.DictReader(f):
            n, par = int(r["devices"]), r["parallel"] or None
            head = (f"| {r['model']} | {r['board']} | {n} | {par or '-'} | {r['quant']} "
                    f"| {r['seq_length']} | {float(r['decode_tok_s']):g} |")
            static = r["prefill"] == "static"
            if r["hidden"]:
                shape = Shape(r["model"], int(r["hidden"]), int(r["intermediate"]),
                              int(r["layers"]), int(r["heads"]), int(r["kv_heads"]),
                              int(r["vocab"]), r["tied_embeddings"] == "true")
                est = modelled(compiler, shape, r["quant"], int(r["group_size"]),
                               int(r["seq_length"]), n, par, prefill=static)
            elif config_dir(r["model"]) is not None:  # a shape of bench/configs (Qwen3.5)
                est = config_estimate(config_dir(r["model"]), compiler.chip, r["quant"],
                                      int(r["seq_length"]), n, par)
            else:
                print(f"{head} not modelled (no shape here) | | {r['ftl_s'] or '-'} | | | |")
                continue
            pub = float(r["decode_tok_s"])
            err = est.tokens_per_s / pub - 1
            errors.append(abs(err))
            ftl = float(r["ftl_s"]) if r["ftl_s"] else None
            ttft = (f"{est.ttft_s:.3g} | {est.ttft_s / ftl - 1:+.0%}" if static and ftl
                    else "- | -")
            print(f"{head} {est.tokens_per_s:.3g} | {err:+.0%} | {ftl or '-'} | {ttft} | "
                  f"{est.per_token.link_s * 1e3:.2f} |")
    if errors:
        errors.sort()
        print(f"\ndecode tok/s: median absolute error {errors[len(errors) // 2]:.0%}, "
              f"largest {errors[-1]:.0%} ({len(errors)} rows)")


def config_dir(model: str) -> str | None:
    """The directory of bench/configs holding `model`'s config.json (names compared
    without case), if any."""
    for name in sorted(os.listdir(CONFIGS)):
        if name.lower() == model.lower() and os.path.isfile(
                os.path.join(CONFIGS, name, "config.json")):
            return os.path.join(CONFIGS, name)
    return None


def config_estimate(path: str, chip: Chip, mode: str, seq: int, devices: int,
                    parallel: str | None) -> Estimate:
    """`toptpu estimate` of a config of bench/configs (a hybrid Qwen3.5: its layer kinds'
    nets; not cached), prefill chunk as estimate's default."""
    print(f"compiling {path} {mode} seq {seq} ...", file=sys.stderr, flush=True)
    request = CompileRequest.make(mode=mode, chip=chip, seq_length=seq, devices=devices,
                                  parallel=parallel)
    config = read_checked_config(path, request)
    costs = compile_costs(config, request, nets=STEP_NETS)
    return estimate(costs, chip)


def _published(compiler: Compiler) -> list[tuple[dict[str, str], Shape]]:
    with open(ROWS, newline="") as f:
        return [(r, Shape(r["model"], int(r["hidden"]), int(r["intermediate"]),
                          int(r["layers"]), int(r["heads"]), int(r["kv_heads"]),
                          int(r["vocab"]), r["tied_embeddings"] == "true"))
                for r in csv.DictReader(f) if r["hidden"]]


def fit_latency(compiler: Compiler) -> tuple[float, list[float]]:
    """The link latency (us) that makes the tensor-parallel rows' decode tok/s closest to
    the published (least squares of the relative errors; golden-section search over
    0..2000 us, the other figures the preset's), and the rows' errors with it."""
    rows = [(r, s) for r, s in _published(compiler) if r["parallel"] == "tp"]

    def errors(lat: float) -> list[float]:
        chip = compiler.chip.with_figures(link_latency_us=lat)
        return [modelled(compiler, s, r["quant"], int(r["group_size"]), int(r["seq_length"]),
                         int(r["devices"]), "tp", chip, prefill=r["prefill"] == "static"
                         ).tokens_per_s / float(r["decode_tok_s"]) - 1 for r, s in rows]

    def loss(lat: float) -> float:
        return sum(e * e for e in errors(lat))

    lo, hi = 0.0, 2000.0
    g = (5 ** 0.5 - 1) / 2
    for _ in range(40):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if loss(a) <= loss(b):
            hi = b
        else:
            lo = a
    lat = round((lo + hi) / 2, 1)
    return lat, errors(lat)


def write_latency(lat: float, errors: list[float]) -> None:
    """The fitted latency into chips.json (bm1684x), with its source."""
    from toptpu.backend.target.chips import PRESETS_PATH
    from toptpu.calibration import _presets_text
    from toptpu.dialects.output_file import write_output

    with open(PRESETS_PATH) as f:
        data = json.load(f)
    med = sorted(abs(e) for e in errors)[len(errors) // 2]
    data["bm1684x"]["link_latency_us"] = lat
    data["bm1684x"]["sources"]["link_latency_us"] = (
        "fitted by bench/devices.py --fit to bench/calibration/bm1684x_multi_device.csv: "
        f"decode tok/s of the tensor-parallel rows ({len(errors)} rows, median error "
        f"{med:.0%}); the fixed cost of one step of a collective (DMA setup, the sync and "
        "the subnet launch around it)")
    write_output(PRESETS_PATH, _presets_text(data), "the chip presets")


def grid_table(compiler: Compiler, mode: str, group: int, seq: int) -> None:
    """The three models on 1, 2, 4, 8 devices, tp and pp."""
    chip = compiler.chip
    print(f"{mode} (group {group}), seq {seq}, TTFT of a {seq}-token prompt; bm1684x "
          f"({chip.ddr_bytes / 2**30:.0f} GiB per device, link {chip.link_gbps:g} GB/s, "
          f"{chip.link_latency_us:g} us)\n")
    print("| model | devices | parallel | tok/s | TTFT s | GB per device (largest) | fits | "
          "collectives+sends ms/token | link share of a token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in MODELS.values():
        for n in (1, 2, 4, 8):
            for par in ([None] if n == 1 else ["tp", "pp"]):
                est = modelled(compiler, shape, mode, group, seq, n, par)
                per = est.per_token
                print(f"| {shape.name} | {n} | {par or '-'} | {est.tokens_per_s:.3g} | "
                      f"{est.ttft_s:.3g} | {max(est.device_bytes) / 1e9:.2f} | "
                      f"{'yes' if est.fits else 'NO'} | {per.link_s * 1e3:.2f} | "
                      f"{per.link_s / per.total_s:.0%} |")


def link_table(compiler: Compiler, mode: str, group: int, seq: int, name: str,
               figure: str) -> None:
    """tok/s of `name` over one link figure (`link_gbps` or `link_latency_us`), tp against
    pp, on 2, 4 and 8 devices; then where tp stops paying (decode and TTFT)."""
    shape, base = MODELS[name], compiler.chip
    values = {"link_gbps": [0.25, 0.5, 1.0, 2.0, 3.0, 6.0, 12.0, 24.0, 48.0],
              "link_latency_us": sorted({5.0, 20.0, 50.0, 100.0, base.link_latency_us, 500.0,
                                         1000.0, 2000.0})}[figure]  # the preset's among them
    other = ("link_latency_us", "us") if figure == "link_gbps" else ("link_gbps", "GB/s")
    print(f"{name} {mode}, seq {seq}: decode tok/s (TTFT s) over {figure} "
          f"({other[0]} {getattr(base, other[0]):g} {other[1]})\n")
    print(f"| {figure} | " + " | ".join(f"tp {n} | pp {n}" for n in (2, 4, 8)) + " |")
    print("|---|" + "---|---|" * 3)
    table: dict[tuple[int, str], list[Estimate]] = {}
    for v in values:
        chip = base.with_figures(**{figure: v})
        cells = []
        for n in (2, 4, 8):
            for par in ("tp", "pp"):
                est = modelled(compiler, shape, mode, group, seq, n, par, chip)
                table.setdefault((n, par), []).append(est)
                cells.append(f"{est.tokens_per_s:.3g} ({est.ttft_s:.3g})")
        print(f"| {v:g} | " + " | ".join(cells) + " |")
    print()
    for n in (2, 4, 8):
        tp, pp = table[(n, "tp")], table[(n, "pp")]
        for what, better in (("decode", lambda a, b: a.tokens_per_s > b.tokens_per_s),
                             ("TTFT", lambda a, b: a.ttft_s < b.ttft_s)):
            wins = [v for v, a, b in zip(values, tp, pp, strict=True) if better(a, b)]
            if len(wins) == len(values):
                where = "at every value"
            elif not wins:
                where = "at no value"
            elif figure == "link_gbps":
                where = f"from {min(wins):g} GB/s"
            else:
                where = f"up to {max(wins):g} us"
            print(f"{n} devices: tp beats pp in {what} {where}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", action="store_true", help="the published rows")
    p.add_argument("--grid", action="store_true", help="14B / 32B / 72B on 1-8 devices")
    p.add_argument("--link", action="store_true",
                   help="QwQ-32B over the link's bandwidth and latency")
    p.add_argument("--fit", action="store_true", help="fit the link latency to the tp rows")
    p.add_argument("--write", action="store_true", help="with --fit: write it to chips.json")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("-q", "--mode", default="w4bf16")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--cache", default=CACHE, help="the compiled streams' cache")
    args = p.parse_args(argv)
    compiler = Compiler(args.cache, get_chip("bm1684x"))
    if args.fit:
        lat, errors = fit_latency(compiler)
        print(f"link_latency_us {lat:g}: decode errors "
              + ", ".join(f"{e:+.0%}" for e in errors))
        if args.write:
            write_latency(lat, errors)
            print("written to chips.json")
        return 0
    every = not (args.rows or args.grid or args.link)
    if args.rows or every:
        rows_table(compiler)
        print()
    if args.grid or every:
        grid_table(compiler, args.mode, args.group_size, args.seq_length)
        print()
    if args.link or every:
        link_table(compiler, args.mode, args.group_size, args.seq_length, "QwQ-32B",
                   "link_gbps")
        print()
        link_table(compiler, args.mode, args.group_size, args.seq_length, "QwQ-32B",
                   "link_latency_us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
