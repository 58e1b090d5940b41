"""The LLM commands of the `toptpu` command line: compile, run, chat (and the generation
part of `toptpu demo`). `toptpu.cli` registers them; they live here to keep that file small.

Errors a user can cause (bad model directory, unknown mode or chip, corrupt model file,
prompt longer than the compiled shapes, ...) print one `toptpu <cmd>: error: ...` line on
stderr and exit with status 1; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions caused by the user's input, reported as one line."""
    from toptpu.backend.interpreter_executor import ExecutorError
    from toptpu.backend.model_file import ModelFileError
    from toptpu.backend.runtime import GenerationError
    from toptpu.compiler import CompileError
    from toptpu.frontends.hf_loader import ModelLoadError
    from toptpu.frontends.llm import SplitError

    errors: tuple[type[BaseException], ...] = (ModelLoadError, CompileError, ModelFileError,
                                               GenerationError, ExecutorError, SplitError)
    try:  # the machine executor's errors, where it is installed
        from toptpu.backend.machine import MachineTrap
        from toptpu.backend.machine_executor import MachineExecutorError

        errors += (MachineTrap, MachineExecutorError)
    except ImportError:
        pass
    return errors


def _fail(cmd: str, e: BaseException) -> int:
    print(f"toptpu {cmd}: error: {e}", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- arguments


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="Hugging Face model directory (config.json, *.safetensors, "
                   "tokenizer.json)")
    p.add_argument("-o", "--output", required=True, help="the model file to write")
    p.add_argument("-q", "--quantize", dest="mode", default=None,
                   help="f32 | f16 | bf16 | w8f16 | w8bf16 | w4f16 | w4bf16 | w8f32 | w4f32 | "
                   "auto (a pre-quantized checkpoint's bits and dtype); default: auto for "
                   "GPTQ/AWQ/AutoRound checkpoints, f32 otherwise")
    p.add_argument("--chip", default="bm1684x", help="target chip preset (bm1684x, bm1688)")
    p.add_argument("--seq-length", type=int, default=512, help="KV cache capacity SEQ")
    p.add_argument("--max-input-length", type=int, default=None,
                   help="prefill chunk L (default min(SEQ, 128))")
    p.add_argument("--max-history", type=int, default=None,
                   help="history Hh the prefill_kv net attends to (default SEQ)")
    p.add_argument("--group-size", type=int, default=64,
                   help="w4 quantization group size (-1: per channel)")
    p.add_argument("--symmetric", action="store_true", default=None,
                   help="symmetric weight quantization (default: w8 symmetric, w4 asymmetric)")
    p.add_argument("--dump-ir", metavar="DIR", help="write every net's IR after every pass")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", choices=["interpreter", "machine"], default="machine",
                   help="run the nets with the Tpu interpreter or on the reference machine")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the generation config's, greedy unless it "
                   "samples)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--penalty-window", type=int, default=64,
                   help="recent tokens the repetition penalty looks at")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")


def sampling_from_args(args: argparse.Namespace, generation: dict[str, Any]) -> Any:
    from toptpu.backend.runtime import SamplingConfig

    samples = bool(generation.get("do_sample", False))
    temp = args.temperature if args.temperature is not None else (
        float(generation.get("temperature", 1.0)) if samples else 0.0)
    top_k = args.top_k if args.top_k is not None else (
        int(generation.get("top_k", 0) or 0) if samples else 0)
    top_p = args.top_p if args.top_p is not None else (
        float(generation.get("top_p", 1.0)) if samples else 1.0)
    pen = args.repetition_penalty if args.repetition_penalty is not None else float(
        generation.get("repetition_penalty", 1.0))
    return SamplingConfig(temp, top_k, top_p, pen, args.penalty_window, args.seed)


def _fmt(v: float | None, unit: str, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def stats_line(res: Any) -> str:
    return (f"[{len(res.generated_ids)} tokens, stop: {res.stop_reason}; prefill "
            f"{res.prefill_tokens} tokens; time to first token {_fmt(res.ttft_s, 's')} host, "
            f"{_fmt(res.modelled_ttft_s, 's', 6)} modelled; decode "
            f"{_fmt(res.decode_tokens_per_s, ' tok/s', 1)} host, "
            f"{_fmt(res.modelled_tokens_per_s, ' tok/s', 1)} modelled]")


# --------------------------------------------------------------------------- commands


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a Hugging Face model directory to a model file."""
    from toptpu.compiler import compile as compile_model

    try:
        compile_model(args.model, args.output, mode=args.mode, chip=args.chip,
                      seq_length=args.seq_length, max_input_length=args.max_input_length,
                      max_history=args.max_history, group_size=args.group_size,
                      symmetric=args.symmetric, dump_ir=args.dump_ir,
                      progress=None if args.quiet else sys.stderr)
    except _user_errors() as e:
        return _fail("compile", e)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Generate from a prompt with a compiled model file (needs nothing else)."""
    from toptpu.backend.runtime import Runtime

    try:
        rt = Runtime.open(args.model_file, args.executor)
        sampling = sampling_from_args(args, rt.header.get("generation", {}))
        if args.ids is not None:
            ids = [int(x) for x in args.ids.replace(",", " ").split()]
        elif args.chat_template:
            text = rt.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                    add_generation_prompt=True)
            ids = rt.encode(text, add_special_tokens=False)
        else:
            ids = rt.encode(args.prompt)
        stream = None
        if not args.json:
            sys.stdout.write(args.prompt if args.ids is None else "")

            def stream(piece: str) -> None:
                sys.stdout.write(piece)
                sys.stdout.flush()

        res = rt.generate(ids, args.max_new_tokens, sampling, on_text=stream,
                          stop_on_eos=not args.ignore_eos)
    except _user_errors() as e:
        return _fail("run", e)
    if args.json:
        print(json.dumps({
            "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
            "text": res.text, "stop_reason": res.stop_reason,
            "ttft_s": res.ttft_s, "tokens_per_s": res.decode_tokens_per_s,
            "modelled_ttft_s": res.modelled_ttft_s,
            "modelled_tokens_per_s": res.modelled_tokens_per_s,
            "executor": args.executor,
        }))
    else:
        print()
        print(stats_line(res), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat with a compiled model file; the KV cache keeps the conversation.
    /reset starts over, /exit (or end of input) quits."""
    from toptpu.backend.runtime import PromptTooLongError, Runtime

    try:
        rt = Runtime.open(args.model_file, args.executor)
        sampling = sampling_from_args(args, rt.header.get("generation", {}))
        _ = rt.tokenizer
    except _user_errors() as e:
        return _fail("chat", e)
    model = rt.header["model"]
    print(f"toptpu chat: {model['family']} ({model['num_layers']} layers), "
          f"{rt.header['mode']}, KV cache {rt.seq} tokens. /reset starts over, /exit quits.",
          file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        msg = line.strip()
        if not msg:
            continue
        if msg == "/exit":
            return 0
        if msg == "/reset":
            rt.reset()
            print("[conversation reset]", file=sys.stderr)
            continue

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            res = rt.chat(msg, args.max_new_tokens, sampling, on_text=stream,
                          system=args.system, reset_if_full=args.reset_if_full)
        except PromptTooLongError as e:
            print(f"[{e}]", file=sys.stderr)
            continue
        except _user_errors() as e:
            return _fail("chat", e)
        print()
        print(stats_line(res) + f" [{rt.position}/{rt.seq} tokens in the cache]",
              file=sys.stderr)


def demo_generation(prompt: str, max_new_tokens: int = 32) -> bool:
    """The end-to-end part of `toptpu demo`: compile the built-in tiny Qwen2 to a temporary
    model file (f32 and w4bf16), generate from it, and compare greedy tokens with
    transformers `generate`."""
    import torch

    from toptpu.backend.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    ok = True
    with tempfile.TemporaryDirectory() as tmp, quiet_transformers():
        model_dir = save_tiny_model(f"{tmp}/model", "qwen2")
        outs: dict[str, list[int]] = {}
        for mode in ("f32", "w4bf16"):
            path = f"{tmp}/tiny-qwen2-{mode}.toptpu"
            t = time.perf_counter()
            res_c = compile_model(model_dir, path, mode=mode, seq_length=128,
                                  max_input_length=32, progress=None)
            print(f"compiled {len(res_c.nets)} nets ({', '.join(res_c.nets)}) in {mode} to a "
                  f"model file in {time.perf_counter() - t:.1f}s")
            rt = Runtime.open(path)
            ids = rt.encode(prompt)
            res = rt.generate(ids, max_new_tokens)
            outs[mode] = res.generated_ids
            print(f"  {mode} generated: {res.text!r}")
            print(f"  {stats_line(res)}")
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = rt.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                              do_sample=False)[0, len(ids):].tolist()
        same = ref == outs["f32"]
        ok &= same
        agree = sum(a == b for a, b in zip(outs["w4bf16"], ref, strict=False))
        print(f"f32 model file vs transformers generate: {len(ref)} greedy tokens "
              f"{'identical' if same else 'DIFFERENT'}")
        print(f"w4bf16 model file agrees with transformers on {agree}/{len(ref)} tokens "
              "(4-bit weights: not expected to be identical)")
    return ok
