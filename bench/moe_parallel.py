"""A MoE's decode over several BM1684X: one chip, pipeline parallel (`--parallel pp`) and
expert parallel (`--parallel ep`), from compiled nets — no second model of the step.

1. **The compiled file, executed.** A Qwen3-30B-A3B-shaped model (`tiny_models.
   qwen3_moe_real_config`: hidden 2048, 32/4 heads of 128, experts of 768, top-8; its 128
   experts cut to `--experts`, 48 layers to 2, the vocabulary to the tiny tokenizer's) is
   saved, compiled in bf16 for one chip, pp over N and ep over N, and each file generates
   `--tokens` greedy tokens on the device-group executor (one reference machine per chip).
   Printed: the modelled decode ms/token (the step accounting over the machines' timelines:
   under ep a layer's net takes its slowest chip's time, timed with the experts its loads
   really fetched, plus the all-reduce on the link) and the bytes each chip's DMA moved in
   the last decode step's layer nets.
2. **`toptpu estimate` at 48 layers** (`estimate.compile_costs`: one layer compiled with
   placeholder weights as the compile cuts it, the step accounting of the device group):
   decode ms/token, the link's share, a chip's weights, and the decode net's MB a layer on
   one chip — the same cost model the executed run uses.

Run: python bench/moe_parallel.py [--experts 16] [--devices 2] [--tokens 8]
     [--skip-run] [--skip-estimate]
(ep needs E divisible by the chips; a chip may hold fewer than the k = 8 experts a token
takes: 16 experts over 4 chips hold 4 each.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from toptpu.backend.target.chips import get_chip

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "qwen3-30B-A3B", "config.json")


def _save(path: str, experts: int) -> None:
    from transformers import GenerationConfig

    from toptpu.frontends import tiny_models as tm
    from toptpu.frontends.hf_loader import quiet_transformers

    model = tm.tiny_model(config=tm.qwen3_moe_real_config(layers=2, experts=experts))
    tok = tm.build_tokenizer(model.config.vocab_size)
    model.generation_config = GenerationConfig(do_sample=False)
    with quiet_transformers():
        model.save_pretrained(path)
        tok.save_pretrained(path)


def executed(experts: int, devices: int, tokens: int, work: str) -> None:
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model_dir = os.path.join(work, f"q30-e{experts}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        _save(model_dir, experts)
    print(f"\n1. compiled file: Qwen3-30B-A3B widths, {experts} experts, 2 layers, bf16; "
          f"{tokens} decode tokens after a 20-token prompt")
    print("| strategy | chips | decode ms/token (modelled) | of which link ms | MB the "
          "last decode step's 2 layer nets moved (the slowest chip's) | compile s |")
    print("|---|---|---|---|---|---|")
    ids = list(range(3, 23))
    # (pp over at most the file's 2 layers)
    for strategy, n in (("one", 1), ("pp", min(devices, 2)), ("ep", devices)):
        path = os.path.join(work, f"q30-e{experts}-{strategy}{n}.toptpu")
        t = time.perf_counter()
        if not os.path.exists(path):
            compile_model(model_dir, path, mode="bf16", seq_length=64, max_input_length=16,
                          progress=None, devices=n,
                          parallel=None if strategy == "one" else strategy)
        secs = time.perf_counter() - t
        rt = Runtime.open(path)
        rt.generate(ids, 2, stop_on_eos=False)  # warm
        rec = rt.start_trace()
        res = rt.generate(ids, tokens, stop_on_eos=False)
        assert res.modelled_tokens_per_s is not None and res.modelled_breakdown is not None
        per = res.modelled_breakdown["per_decoded_token"]
        last = [r for r in rec.runs if r.net.startswith("block_cache")][-2:]  # 2 layers
        moved = sum(r.timeline.dma_bytes for r in last) / 1e6
        print(f"| {strategy} | {n} | {1e3 / res.modelled_tokens_per_s:.2f} "
              f"| {per.get('link_s', 0.0) * 1e3:.2f} | "
              f"{moved:.1f} | {secs:.0f} |")


def estimated(experts: int, devices: int, work: str) -> None:

    from toptpu.compile_options import check_parallel_config
    from toptpu.devices import Parallel
    from toptpu.estimate import compile_costs, estimate, estimate_nets
    from toptpu.request import CompileRequest

    config, raw = _experts_config(experts, work)
    chip = get_chip("bm1684x")
    print(f"\n2. toptpu estimate: Qwen3-30B-A3B (48 layers), {experts} of its 128 experts, "
          "bf16, seq 512, bm1684x")
    print("| strategy | chips | decode ms/token | of which link ms | weights GB on the "
          "fullest chip | block_cache MB a layer on a chip |")
    print("|---|---|---|---|---|---|")
    for strategy, n in (("one", 1), ("pp", devices), ("ep", devices)):
        par = None if strategy == "one" else Parallel(strategy)
        req = CompileRequest.make(mode="bf16", seq_length=512, max_input_length=128,
                                  devices=n, parallel=par)
        check_parallel_config(raw, "config", n, par, "bf16", None)
        nets = estimate_nets(req.shapes, 16, "greedy")
        est = estimate(compile_costs(config, req, nets=nets), chip, 16, "greedy")
        t = est.per_token
        cache = est.nets["block_cache"].dma_bytes / 1e6
        print(f"| {strategy} | {n} | {t.total_s * 1e3:.2f} | {t.link_s * 1e3:.2f} "
              f"| {max(est.compiled.device_weight_bytes or [est.compiled.weight_bytes]) / 1e9:.2f}"
              f" | {cache:.1f} |")


def _experts_config(experts: int, work: str) -> tuple[object, dict]:
    """Qwen3-30B-A3B's config.json with its experts cut to `experts` (transformers' config
    read from a copy in `work`) and the raw dict."""
    import json

    from toptpu.frontends.hf_loader import read_config

    with open(CONFIG) as f:
        raw = json.load(f)
    raw["num_experts"] = experts
    config_dir = os.path.join(work, f"config-e{experts}")
    os.makedirs(config_dir, exist_ok=True)
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(raw, f)
    return read_config(config_dir)[0], raw


def buffers(experts_list: list[int], work: str) -> None:
    """The experts' local buffers sized for the experts a decode step fetches (k rows)
    against buffers of all E (the layer group as it was: `layer_group._fetched_ops`
    returning nothing), both compiled in this one run: the decode net's reduction parts
    of the experts op, its experts' local bytes, and the modelled one-chip decode ms/token
    at 48 layers (`toptpu estimate`'s model)."""
    from unittest import mock

    from toptpu.backend.formats.commands import Compute, Load
    from toptpu.estimate import compile_programs, estimate, estimate_nets, model_shape, spread_costs
    from toptpu.passes import layer_group
    from toptpu.request import CompileRequest

    chip = get_chip("bm1684x")
    print("\n3. local buffers of the fetched experts vs of all E: Qwen3-30B-A3B widths, "
          "48 layers, bf16, one bm1684x, seq 512, a 16-token prompt")
    print("| experts | buffers | decode experts op: parts | its experts' local MB a part "
          "| block_cache MB moved | decode ms/token | TTFT s | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for experts in experts_list:
        config, _ = _experts_config(experts, work)
        req = CompileRequest.make(mode="bf16", seq_length=512, max_input_length=128)
        nets = estimate_nets(req.shapes, 16, "greedy")
        for how in ("all E", "fetched"):
            t = time.perf_counter()
            with mock.patch.object(layer_group, "_fetched_ops",
                                   (lambda p: {}) if how == "all E"
                                   else layer_group._fetched_ops):
                programs = compile_programs(config, req, nets)
            secs = time.perf_counter() - t
            costs = spread_costs(programs, model_shape(config), req.fixed_mode("estimate"),
                                 req.shapes, req.devices, req.parallel, req.chip)
            est = estimate(costs, chip, 16, "greedy")
            prog = programs["block_cache"]
            parts = max((c.parts for c in prog.commands
                         if isinstance(c, Compute) and c.kind.endswith("moe_experts")),
                        default=0)
            local = sum(c.local.nbytes for c in prog.commands
                        if isinstance(c, Load) and c.index is not None)
            n = max(parts, 1)
            print(f"| {experts} | {how} | {parts} | {local / n / 1e6:.2f} "
                  f"| {est.nets['block_cache'].dma_bytes / 1e6:.1f} "
                  f"| {est.per_token.total_s * 1e3:.2f} | {est.ttft_s:.3f} | {secs:.0f} |",
                  flush=True)


def expert_major(config_dirs: list[str], modes: list[str], prompt: int) -> None:
    """A prefill chunk's experts (the `block` net, 128 rows) at the published widths, the
    layer group with blocks of experts (the expert-major schedule: each chosen expert
    loaded once per row block) against without them (`layer_group._expert_block_axes`
    answering None: row blocks that each fetch their rows' experts, the plan before),
    both compiled in this one run with `toptpu estimate`'s placeholder weights: the
    experts op's plan, the modelled bytes its indexed loads move per chunk and layer
    (`Load.nbytes`: each block's share of the expected distinct experts the chunk
    chooses) over one layer's experts, the block net's modelled ms a layer and the time
    to first token of a `prompt`-token prompt (48/40/94 layers)."""
    from unittest import mock

    import numpy as np

    from toptpu.backend.formats.commands import Compute, Load
    from toptpu.backend.runtime.machine import command_costs
    from toptpu.backend.target.cost import net_timing
    from toptpu.estimate import compile_programs, estimate, estimate_nets, model_shape, spread_costs
    from toptpu.frontends.hf_loader import read_config
    from toptpu.passes import layer_group
    from toptpu.request import CompileRequest

    chip = get_chip("bm1684x")
    print(f"\n5. a prefill chunk's experts, blocks of experts vs row blocks: {chip.name}, "
          f"seq 512, 128-row chunk, a {prompt}-token prompt")
    print("| model | mode | schedule | experts op: row blocks x parts | expert bytes "
          "a chunk and layer, GB | x a layer's experts | block net ms a layer | TTFT s "
          "| compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in config_dirs:
        config, _ = read_config(path)
        name = os.path.basename(path.rstrip("/"))
        for mode in modes:
            req = CompileRequest.make(mode=mode, seq_length=512, max_input_length=128)
            nets = estimate_nets(req.shapes, prompt, "greedy")
            for how in ("row blocks", "expert blocks"):
                t = time.perf_counter()
                with mock.patch.object(layer_group, "_expert_block_axes",
                                       (lambda op: None) if how == "row blocks"
                                       else layer_group._expert_block_axes):
                    programs = compile_programs(config, req, nets)
                secs = time.perf_counter() - t
                costs = spread_costs(programs, model_shape(config), req.fixed_mode("estimate"),
                                     req.shapes, req.devices, req.parallel, req.chip)
                est = estimate(costs, chip, prompt, "greedy")
                prog = programs["block"]
                loads = [c for c in prog.commands if isinstance(c, Load) and c.index is not None]
                moved = sum(c.nbytes for c in loads)
                tensors = {c.tensor.name: c for c in loads}.values()  # a layer's experts
                whole = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize
                            for c in tensors)
                ops = [c for c in prog.commands
                       if isinstance(c, Compute) and c.kind.endswith("moe_experts")]
                parts = ops[0].parts if ops else 1
                first = next(iter(tensors)).tensor.name
                blocks = len({c.part_first_row for c in loads if c.tensor.name == first})
                tiles = (f"{len(ops) // parts} x {blocks} expert blocks x {parts // blocks} "
                         "parts of I" if blocks > 1
                         else f"{len(ops) // parts} x {parts} parts of I")
                block_s = net_timing(command_costs(prog.commands), chip).seconds(chip)
                print(f"| {name} | {mode} | {how} | {tiles} | {moved / 1e9:.2f} | "
                      f"{moved / whole:.2f}x | {block_s * 1e3:.1f} | {est.ttft_s:.2f} | "
                      f"{secs:.0f} |", flush=True)


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def table(config_dirs: list[str], devices: list[int], prompt: int) -> None:
    """README's MoE table: `toptpu estimate`'s model of each config at its published
    expert count (bf16, bm1684x, seq 512, a `prompt`-token prompt): one compile for one
    chip and pp (the programs serve every device count), one per device count for ep
    (each chip E/N of the experts); decode tok/s and time to first token beside the bound
    (`moe_bound.active_bytes` over one chip's sustained DDR bandwidth; under ep the bytes
    of the chip holding the lm_head, its k/N share of the experts), the weights on the
    fullest chip; the wall time of each compile and this process's peak RSS so far."""
    import json

    from moe_bound import active_bytes

    from toptpu.compile_options import check_parallel_config
    from toptpu.devices import Parallel
    from toptpu.estimate import (
        compile_programs,
        estimate,
        estimate_nets,
        model_shape,
        spread_costs,
    )
    from toptpu.frontends.hf_loader import read_config
    from toptpu.request import CompileRequest

    chip = get_chip("bm1684x")
    bw = chip.sustained_gbps * 1e9
    print(f"\n4. toptpu estimate at the published expert counts: bf16, {chip.name}, seq 512, "
          f"a {prompt}-token prompt")
    print("| model | chips | parallel | decode (modelled) | bound: active bytes / DDR | TTFT "
          "(modelled) | weights GB on the fullest chip | compile s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in config_dirs:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        config, _ = read_config(path)
        name = os.path.basename(path.rstrip("/"))
        shape = model_shape(config)
        runs: list[tuple[str, list[int]]] = [("pp", devices)]
        runs += [("ep", [n]) for n in devices
                 if n > 1 and raw["num_experts"] % n == 0
                 and raw["num_experts_per_tok"] <= raw["num_experts"] // n]
        for strategy, counts in runs:
            par = Parallel(strategy)
            req = CompileRequest.make(mode="bf16", seq_length=512, max_input_length=128,
                                      devices=counts[0] if strategy == "ep" else 1,
                                      parallel=par if strategy == "ep" else None)
            nets = estimate_nets(req.shapes, prompt, "greedy")
            t = time.perf_counter()
            programs = compile_programs(config, req, nets)
            secs = time.perf_counter() - t
            for n in counts:
                p = par if n > 1 else None
                # a chip's bound: under ep it moves its k/N share of the experts
                share = 1 / n if strategy == "ep" else 1.0
                bound = bw / active_bytes(raw, 2.0, 512, expert_share=share)["token"]
                check_parallel_config(raw, "config", n, p, "bf16", None)
                costs = spread_costs(programs, shape, req.fixed_mode("estimate"), req.shapes,
                                     n, p, chip)
                est = estimate(costs, chip, prompt, "greedy")
                fullest = max(costs.device_weight_bytes or [costs.weight_bytes]) / 1e9
                print(f"| {name} | {n} | {strategy if n > 1 else '-'} | "
                      f"{est.tokens_per_s:.2f} tok/s | {bound:.2f} tok/s | {est.ttft_s:.2f} s | "
                      f"{fullest:.1f} | {secs:.0f} | {_peak_gb():.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--work", default=None, help="directory for the model and its files")
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--skip-estimate", action="store_true")
    ap.add_argument("--buffers", type=int, nargs="*", default=None,
                    help="only compare the experts' buffers of the fetched experts with "
                    "buffers of all E, at these expert counts (e.g. 16 32 64)")
    ap.add_argument("--table", nargs="*", default=None, metavar="CONFIG_DIR",
                    help="only print README's MoE table for these config directories")
    ap.add_argument("--table-devices", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--expert-major", nargs="*", default=None, metavar="CONFIG_DIR",
                    help="only compare a prefill chunk's experts in blocks of experts with "
                    "row blocks, for these config directories")
    ap.add_argument("--modes", nargs="+", default=["bf16"],
                    help="the modes of --expert-major")
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    if args.table:
        table(args.table, args.table_devices, args.prompt)
        return
    if args.expert_major:
        expert_major(args.expert_major, args.modes, args.prompt)
        return
    chip = get_chip("bm1684x")
    print(f"{chip.name}: sustained DDR {chip.sustained_gbps:.1f} GB/s, link {chip.link_gbps} "
          f"GB/s + {chip.link_latency_us} us a step")
    work = args.work or tempfile.mkdtemp(prefix="moe-parallel-")
    if args.buffers:
        buffers(args.buffers, work)
        return
    if not args.skip_run:
        executed(args.experts, args.devices, args.tokens, work)
    if not args.skip_estimate:
        estimated(args.experts, args.devices, work)


if __name__ == "__main__":
    main()
