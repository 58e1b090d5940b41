"""A big model file run as a user runs it (`toptpu run`, `toptpu eval`, each a fresh process),
its decode time per token against this host's own limits, measured in the same run.

The limits, each the bytes one decode step moves over numpy's bandwidth measured here just
before and just after the runs (the best of a few passes over an array of BANDWIDTH_BYTES,
far larger than any cache):
- **read bound**: the bytes the step must read as the file stores them — every layer's
  weights (packed 4-bit weights, scales, zero points), the lm_head and final norm, one
  embedding row, the KV cache up to the step — over numpy's read bandwidth (a sum);
- **conversion bound**: the read bound plus the f32 form of every weight the step
  multiplies that the file does not store in f32 (each 4-bit weight, the bf16 lm_head: a
  numpy host cannot multiply them as stored, it must make a float of each), written once
  and read once, over numpy's copy bandwidth (`np.copyto`, bytes moved: read + written).
  It is the cost of converting through memory: a product that converts a cache-sized
  block at a time, or a weight whose f32 form the cache keeps, may go below it.
`decode s/token / bound` is how far the reference machine is from each (1.0: at it).

Printed: the run's TTFT, decode tok/s and s/token, the process's peak RSS (os.wait4's
ru_maxrss of that child: mapped file pages it held count), the bound and the ratio; with
`--parts ...,chat` one `toptpu chat` turn; with `--parts ...,eval --eval-tokens N` a
`toptpu eval` over the first N tokens of a text (one window when N is at most the model's
sequence length); with `--parts ...,phases` the model opened, the first token and `--new`
decode steps timed apart in one process (wall and CPU: the decode step's CPU seconds
against the bound hold on a loaded host); each process's wall time, CPU seconds (on a
loaded host the wall time is the CPU time over the share of a core it got) and peak RSS.
The model files come
from bench/scale.py (`--sizes 7B --keep`: Qwen2.5-7B-shaped, random weights).

The host is shared (2 cores, other jobs): the load average before and after is printed; the
bound is measured in the same run for that reason.

`--before-python PY --rounds N`: the `toptpu run` of another tree too (its environment's
Python runs its own code), before this tree's in each of N rounds, both from a neutral
directory, against the same bounds.

Run: python bench/big_model_run.py FILE [--ids 8] [--new 4] [--parts run,chat,eval]
         [--eval-tokens 512] [--env NAME=VALUE ...] [--before-python PY --rounds 2]
     python bench/big_model_run.py FILE --parts runners --pp PP_FILE [--budget 1G]
         [--before PKG]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from toptpu.backend.formats.llm_file import LlmFile

#: the array numpy's bandwidth is measured on (far beyond any cache)
BANDWIDTH_BYTES = 512 << 20


def _best_pass(pass_: Callable[[], object], clock: Callable[[], float], repeat: int
               ) -> float:
    """The shortest of `repeat` runs of `pass_` on `clock`."""
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        pass_()
        best = min(best, clock() - t)
    return best


def numpy_read_bandwidth(repeat: int = 5, clock: Callable[[], float] = time.perf_counter
                         ) -> float:
    """numpy's read bandwidth in bytes/s: the best of `repeat` sums over BANDWIDTH_BYTES of
    float32 (one pass reading each byte once), on the wall clock by default."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    return a.nbytes / _best_pass(lambda: a.sum(dtype=np.float32), clock, repeat)


def numpy_read_bandwidth_cpu(repeat: int = 5) -> float:
    """`numpy_read_bandwidth` timed in this process's CPU seconds (on a loaded host a wall
    clock also counts the time the process waited for a core): the bound to set against a
    decode step's CPU seconds."""
    return numpy_read_bandwidth(repeat, time.process_time)


def numpy_copy_bandwidth(repeat: int = 5, clock: Callable[[], float] = time.perf_counter
                         ) -> float:
    """numpy's copy bandwidth in bytes/s moved (read + write), the best of `repeat`."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / _best_pass(lambda: np.copyto(b, a), clock, repeat)


def numpy_copy_bandwidth_cpu(repeat: int = 5) -> float:
    """`numpy_copy_bandwidth` timed in this process's CPU seconds."""
    return numpy_copy_bandwidth(repeat, time.process_time)


def decode_step_bytes(path: str, position: int) -> dict[str, int]:
    """The bytes a decode step at `position` reads: the layers' weights, the shared ones but
    the embedding table (one row of it), the KV cache of every layer up to `position`."""
    f = LlmFile(path, verify_checksums=False)
    try:
        layout, m = f.layout, f.meta.model
        layers = sum(layout.layer_size(i) for i in range(layout.num_layers))
        shared = sum(t.nbytes for t in layout.shared.values())
        row = 0
        embeds = [t for n, t in layout.shared.items() if "embed" in n]
        if embeds and any("lm_head" in n for n in layout.shared):  # untied: one row read
            shared -= embeds[0].nbytes
            row = embeds[0].nbytes // embeds[0].shape[0]
        kv = 2 * m.num_layers * position * m.num_kv_heads * m.head_dim * 2  # bf16 K and V
        return {"layers": layers, "shared": shared, "embedding_row": row, "kv": kv}
    finally:
        f.close()


def decode_step_f32_bytes(path: str) -> int:
    """The bytes of the f32 forms a decode step multiplies by that the file stores in
    another form: every quantized weight (a `.qweight` tensor: 2 weights a byte in a w4
    mode, 1 in a w8 mode) and the f16/bf16 lm_head (or the tied embedding table), 4 bytes
    a weight."""
    f = LlmFile(path, verify_checksums=False)
    try:
        layout = f.layout
        per_byte = 2 if str(f.meta.mode).startswith("w4") else 1
        weights = sum(per_byte * e.nbytes for i in range(layout.num_layers)
                      for n, e in layout.chunk_of(i).items() if n.endswith(".qweight"))
        heads = [e for n, e in layout.shared.items() if "lm_head" in n] or [
            e for n, e in layout.shared.items() if "embed" in n]
        head = heads[0] if heads else None
        if head is not None and head.dtype in ("bfloat16", "float16"):
            weights += head.nbytes // 2
        return 4 * weights
    finally:
        f.close()


def run_child(cmd: list[str], env: dict[str, str], stdin: bytes = b"",
              cwd: str | None = None) -> tuple[str, float, float, int, int]:
    """Run `cmd` (`stdin` its input, in `cwd`); its stdout, wall seconds, CPU seconds (user
    + system, all its threads), peak RSS bytes (its own: os.wait4) and exit code."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as inp:
        inp.write(stdin)
        inp.seek(0)
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stdin=inp, env=env, cwd=cwd)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        cpu = usage.ru_utime + usage.ru_stime
        return out.read().decode(), wall, cpu, usage.ru_maxrss * 1024, p.returncode


#: the runners `--parts runners` sets side by side: (name, which file, executor)
RUNNERS = (("one device, machine", "one", "machine"),
           ("one device, interpreter", "one", "interpreter"),
           ("pp over 2, machine", "pp", "machine"))


def runners(one: str, pp: str, ids: str, new: int, budget: str, before: str | None,
            env: dict[str, str], only: frozenset[str] = frozenset()) -> None:
    """`--parts runners`: every runner of RUNNERS not streamed and streamed at `budget`,
    streamed at the default budget, and (`before`) streamed with another toptpu; a table
    of peak RSS, TTFT, decode tok/s and token equality with the first runner's first row
    (see the module doc). `only`: the runners of these files (one, pp) or executors."""
    base = {**env, "TOPTPU_WEIGHT_CACHE_FILE": "off"}
    base.pop("TOPTPU_WEIGHT_CACHE", None)
    configs: list[tuple[str, dict[str, str], str | None]] = [
        (f"not streamed, cache {budget}",
         {"TOPTPU_STREAM_WEIGHTS": "off", "TOPTPU_WEIGHT_CACHE": budget}, None),
        (f"streamed, cache {budget}",
         {"TOPTPU_STREAM_WEIGHTS": "on", "TOPTPU_WEIGHT_CACHE": budget}, None),
        ("streamed, default cache", {"TOPTPU_STREAM_WEIGHTS": "on"}, None)]
    if before is not None:
        configs.insert(2, (f"streamed, cache {budget}, before", configs[1][1], before))
    files = {"one": one, "pp": pp}
    reference: list[int] | None = None
    rows = []
    for name, which, executor in RUNNERS:
        if only and which not in only and executor not in only:
            continue
        for label, extra, package in configs:
            cmd = [sys.executable, "-m", "toptpu.cli", "run", files[which], "--ids", ids,
                   "--max-new-tokens", str(new), "--ignore-eos", "--json",
                   "--executor", executor]
            child = {**base, **extra}
            cwd = None
            if package is not None:  # the other tree, imported from a neutral directory
                child["PYTHONPATH"] = package
                cwd = tempfile.gettempdir()
            out, wall, cpu, rss, rc = run_child(cmd, child, cwd=cwd)
            if rc != 0:
                sys.exit(f"toptpu run ({name}, {label}) failed (exit {rc})")
            res = json.loads(out)
            if reference is None:
                reference = res["generated_ids"]
            same = "yes" if res["generated_ids"] == reference else "NO"
            rows.append((name, label, rss, res["ttft_s"], res["tokens_per_s"], wall, cpu,
                         same))
            print(f"  {name}, {label}: peak RSS {rss / 1e9:.2f} GB, ids "
                  f"{res['generated_ids']}", file=sys.stderr, flush=True)
    print(f"\nruns of {os.path.basename(one)} ({os.path.getsize(one) / 1e9:.2f} GB) and "
          f"{os.path.basename(pp)} ({os.path.getsize(pp) / 1e9:.2f} GB): {len(ids.split(','))} "
          f"ids, {new} new tokens\n")
    print("| runner | weights | peak RSS GB | TTFT s | decode tok/s | process s wall / CPU "
          "| ids = one device's |")
    print("|---|---|---|---|---|---|---|")
    for name, label, rss, ttft, tps, wall, cpu, same in rows:
        print(f"| {name} | {label} | {rss / 1e9:.2f} | {ttft:.1f} | {tps:.3f} | "
              f"{wall:.0f} / {cpu:.0f} | {same} |")


def phases(path: str, ids: list[int], new: int) -> None:
    """(In a child process) open `path`; the first token after `ids`; then, the
    conversation reset each time, the same first token again (warm) and the same prompt
    with `new` more tokens decoded after the first: each phase's wall and CPU seconds
    (process time: every thread) as one JSON line. The decode phase's wall time is the
    last generation's own decode time (after its first token); its CPU is the last
    generation's less the warm first token's. (Continuing the first generation
    instead would feed its pending token through the prefill net first: a prefill_kv chunk,
    not a decode step.)"""
    from toptpu.backend.runtime.runtime import Runtime

    out: dict[str, float] = {}
    w, c = time.perf_counter(), time.process_time()

    def mark(name: str) -> None:
        nonlocal w, c
        out[f"{name}_wall_s"] = time.perf_counter() - w
        out[f"{name}_cpu_s"] = time.process_time() - c
        w, c = time.perf_counter(), time.process_time()

    rt = Runtime.open(path)
    mark("open")
    rt.generate(ids, 1, stop_on_eos=False)
    mark("first_token")
    rt.generate(ids, 1, stop_on_eos=False)  # keep_history False: a fresh start, warm
    mark("first_token_again")
    res = rt.generate(ids, 1 + new, stop_on_eos=False)
    mark("with_decode")
    out["decode_wall_s"] = res.timings["decode_s"]
    out["decode_cpu_s"] = out["with_decode_cpu_s"] - out["first_token_again_cpu_s"]
    out["decode_steps"] = new
    print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["--phases-child"]:
        phases(sys.argv[2], [int(i) for i in sys.argv[3].split(",")], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_file")
    ap.add_argument("--ids", type=int, default=8, help="prompt length (token ids)")
    ap.add_argument("--new", type=int, default=4, help="tokens generated")
    ap.add_argument("--eval-tokens", type=int, default=0,
                    help="`toptpu eval` over this many tokens (with --parts ...,eval)")
    ap.add_argument("--parts", default="run", help="comma-separated of run (`toptpu run`), "
                    "phases (open, first token and decode timed apart, wall and CPU, in "
                    "one process), chat (one `toptpu chat` turn), eval (`toptpu eval`, "
                    "--eval-tokens)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the runs")
    ap.add_argument("--pp", help="(--parts runners) the same model compiled --devices 2 "
                    "--parallel pp")
    ap.add_argument("--budget", default="1G", help="(--parts runners) the converted-weight "
                    "budget of the rows not streamed and streamed (TOPTPU_WEIGHT_CACHE)")
    ap.add_argument("--only", default="", help="(--parts runners) comma-separated: only "
                    "the runners of these files (one, pp) or executors (machine, "
                    "interpreter)")
    ap.add_argument("--before-python", help="(--parts run) the Python of another toptpu "
                    "tree's environment (e.g. /work/main/.venv/bin/python): its `toptpu run` "
                    "too, before this tree's in each round")
    ap.add_argument("--rounds", type=int, default=1, help="(--parts run) rounds of runs")
    ap.add_argument("--before", help="(--parts runners) a package directory of another "
                    "toptpu tree to run the streamed rows with too (see the module doc)")
    args = ap.parse_args()
    args.parts = {p.strip() for p in args.parts.split(",")}
    env = dict(os.environ)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    toptpu = [sys.executable, "-m", "toptpu.cli"]
    size = os.path.getsize(args.model_file)
    load_before = os.getloadavg()[0]
    read_bw, copy_bw = numpy_read_bandwidth(), numpy_copy_bandwidth()
    ids = ",".join(str(3 + (7 * i) % 300) for i in range(args.ids))
    print(f"{args.model_file}: {size / 1e9:.2f} GB; {os.cpu_count()} CPUs, load average "
          f"{load_before:.1f} before", flush=True)
    if "run" in args.parts:
        trees = [("now", sys.executable)]
        if args.before_python:
            trees.insert(0, ("before", args.before_python))
        runs = []
        for rnd in range(args.rounds):
            for label, python in trees:  # each tree's own interpreter runs its own code
                out, wall, cpu, rss, rc = run_child(
                    [python, "-m", "toptpu.cli", "run", os.path.abspath(args.model_file),
                     "--ids", ids, "--max-new-tokens", str(args.new), "--ignore-eos",
                     "--json"], env, cwd=tempfile.gettempdir())
                if rc != 0:
                    sys.exit(f"toptpu run ({label}) failed (exit {rc})")
                runs.append((label, rnd, json.loads(out), wall, cpu, rss, os.getloadavg()[0]))
        step = decode_step_bytes(args.model_file, args.ids + args.new // 2)
        total = sum(step.values())
        f32_bytes = decode_step_f32_bytes(args.model_file)
        read_bw2, copy_bw2 = numpy_read_bandwidth(), numpy_copy_bandwidth()
        bw, cbw = max(read_bw, read_bw2), max(copy_bw, copy_bw2)
        bound = total / bw
        conv = bound + 2 * f32_bytes / cbw
        print(f"numpy read bandwidth {read_bw / 1e9:.2f} / {read_bw2 / 1e9:.2f} GB/s, copy "
              f"{copy_bw / 1e9:.2f} / {copy_bw2 / 1e9:.2f} GB/s moved (before / after the "
              "runs)")
        print(f"decode step reads {total / 1e9:.3f} GB ("
              + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in step.items())
              + f"): read bound {bound:.3f} s/token at {bw / 1e9:.2f} GB/s; converts "
              f"{f32_bytes / 1e9:.2f} GB of f32 weights: conversion bound {conv:.3f} s/token "
              f"(+ written and read once at {cbw / 1e9:.2f} GB/s moved)")
        for label, rnd, res, wall, cpu, rss, load in runs:
            ttft, tps = res["ttft_s"], res["tokens_per_s"]
            s_per_token = 1 / tps if tps else float("nan")
            tree = f"{label} (round {rnd + 1}) " if len(runs) > 1 else ""
            print(f"toptpu run {tree}({args.ids} ids, {args.new} new): TTFT {ttft:.1f} s, "
                  f"decode {tps:.3f} tok/s = {s_per_token:.2f} s/token = "
                  f"{s_per_token / bound:.2f}x the read bound, {s_per_token / conv:.2f}x the "
                  f"conversion bound; peak RSS {rss / 1e9:.2f} GB; process {wall:.1f} s wall, "
                  f"{cpu:.1f} s CPU; load {load:.1f}", flush=True)
    if "runners" in args.parts:
        if not args.pp:
            ap.error("--parts runners needs --pp PP_FILE")
        runners(args.model_file, args.pp, ids, args.new, args.budget,
                os.path.abspath(args.before) if args.before else None, env,
                frozenset(w for w in args.only.split(",") if w))
    if "phases" in args.parts:
        out, wall, cpu, rss, rc = run_child([sys.executable, os.path.abspath(__file__),
                                             "--phases-child", args.model_file, ids,
                                             str(args.new)], env)
        if rc != 0:
            sys.exit(f"the phases child failed (exit {rc})")
        ph = json.loads(out.strip().splitlines()[-1])
        step = decode_step_bytes(args.model_file, args.ids + args.new // 2)
        bw = max(read_bw, numpy_read_bandwidth())
        cbw = max(copy_bw, numpy_copy_bandwidth())
        f32_bytes = decode_step_f32_bytes(args.model_file)
        bound = sum(step.values()) / bw
        conv = bound + 2 * f32_bytes / cbw
        cpu_bw, cpu_cbw = numpy_read_bandwidth_cpu(), numpy_copy_bandwidth_cpu()
        cpu_bound = sum(step.values()) / cpu_bw
        cpu_conv = cpu_bound + 2 * f32_bytes / cpu_cbw
        n = ph["decode_steps"]
        wall_tok, cpu_tok = ph["decode_wall_s"] / n, ph["decode_cpu_s"] / n
        print(f"phases (Runtime in one process): open {ph['open_wall_s']:.1f} s wall / "
              f"{ph['open_cpu_s']:.1f} s CPU; first token {ph['first_token_wall_s']:.1f} / "
              f"{ph['first_token_cpu_s']:.1f}; decode {wall_tok:.2f} s/token wall "
              f"({wall_tok / bound:.2f}x the read bound {bound:.3f} s, {wall_tok / conv:.2f}x "
              f"the conversion bound {conv:.3f} s), {cpu_tok:.2f} s/token CPU "
              f"({cpu_tok / cpu_bound:.2f}x the CPU-timed read bound {cpu_bound:.3f} s at "
              f"{cpu_bw / 1e9:.2f} GB/s, {cpu_tok / cpu_conv:.2f}x the CPU-timed conversion "
              f"bound {cpu_conv:.3f} s at {cpu_cbw / 1e9:.2f} GB/s moved); peak RSS "
              f"{rss / 1e9:.2f} GB", flush=True)
    if "chat" in args.parts:
        out, wall, cpu, rss, rc = run_child([*toptpu, "chat", args.model_file, "--max-new-tokens",
                                        str(args.new)], env, b"hello there\n")
        if rc != 0:
            sys.exit(f"toptpu chat failed (exit {rc})")
        print(f"toptpu chat (one turn, {args.new} new tokens at most): {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU, peak RSS {rss / 1e9:.2f} GB", flush=True)
    if "eval" in args.parts and args.eval_tokens:
        text = " ".join(f"word{i % 97} and text {i}" for i in range(4 * args.eval_tokens))
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as t:
            t.write(text)
        try:
            out, wall, cpu, rss, rc = run_child([*toptpu, "eval", args.model_file, "--text", t.name,
                                            "--max-tokens", str(args.eval_tokens), "--json",
                                            "--quiet"], env)
        finally:
            os.unlink(t.name)
        if rc != 0:
            sys.exit(f"toptpu eval failed (exit {rc})")
        ev = json.loads(out)
        print(f"toptpu eval ({ev.get('text_tokens', args.eval_tokens)} tokens, "
              f"{ev.get('windows', '?')} window(s)): {wall / 60:.1f} min wall, {cpu / 60:.1f} "
              f"min CPU, peak RSS "
              f"{rss / 1e9:.2f} GB, perplexity {ev.get('perplexity')}")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
