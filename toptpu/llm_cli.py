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
    v = p.add_argument_group("vision-language models (InternVL, MiniCPM-V 4.6)")
    v.add_argument("--image-size", type=int, default=None,
                   help="tile (InternVL) / slice (MiniCPM-V) size in pixels the vit net is "
                   "compiled for (default: the checkpoint's, e.g. 448)")
    v.add_argument("--max-tiles", type=int, default=None,
                   help="most tiles per image, plus a thumbnail (InternVL; default 12) / most "
                   "slices besides the source image (MiniCPM-V; default 9)")
    v.add_argument("--max-patches", type=int, default=None,
                   help="MiniCPM-V: static patch budget of one slice (default: the largest "
                   "slice of any image up to aspect ratio 10)")
    v.add_argument("--vision-quantize", default=None,
                   help="mode of the vit net (default: the activation type of -q, e.g. bf16 "
                   "for w4bf16: weight-only quantization is for the text model)")
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
    vision = (f"vision {res.image_tokens} image tokens in {_fmt(res.vision_s, 's')} host, "
              f"{_fmt(res.vision_modelled_s, 's', 6)} modelled; " if res.image_tokens else "")
    return (f"[{len(res.generated_ids)} tokens, stop: {res.stop_reason}; {vision}prefill "
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
                      progress=None if args.quiet else sys.stderr, image_size=args.image_size,
                      max_tiles=args.max_tiles, max_patches=args.max_patches,
                      vision_mode=args.vision_quantize)
    except _user_errors() as e:
        return _fail("compile", e)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Generate from a prompt with a compiled model file (needs nothing else); VLMs take
    --image PATH (repeatable)."""
    from toptpu.backend.runtime import GenerationError, Runtime

    try:
        rt = Runtime.open(args.model_file, args.executor)
        sampling = sampling_from_args(args, rt.header.get("generation", {}))
        images: list[Any] = []
        if args.image:
            if args.prompt is None:
                raise GenerationError("--image needs --prompt (the image tokens are laid out "
                                      "in the prompt text)")
            ids, images = rt.image_prompt(args.prompt, args.image, args.chat_template)
        elif args.ids is not None:
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
                          stop_on_eos=not args.ignore_eos, images=images)
    except _user_errors() as e:
        return _fail("run", e)
    if args.json:
        print(json.dumps({
            "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
            "text": res.text, "stop_reason": res.stop_reason,
            "ttft_s": res.ttft_s, "tokens_per_s": res.decode_tokens_per_s,
            "modelled_ttft_s": res.modelled_ttft_s,
            "modelled_tokens_per_s": res.modelled_tokens_per_s,
            "image_tokens": res.image_tokens, "vision_s": res.vision_s,
            "vision_modelled_s": res.vision_modelled_s,
            "executor": args.executor,
        }))
    else:
        print()
        print(stats_line(res), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat with a compiled model file; the KV cache keeps the conversation.
    /reset starts over, /exit (or end of input) quits; VLMs: /image PATH [message] attaches
    an image to the message (or to the next one)."""
    from toptpu.backend.runtime import PromptTooLongError, Runtime

    try:
        rt = Runtime.open(args.model_file, args.executor)
        sampling = sampling_from_args(args, rt.header.get("generation", {}))
        _ = rt.tokenizer
    except _user_errors() as e:
        return _fail("chat", e)
    model = rt.header["model"]
    vlm = " /image PATH [message] attaches an image." if rt.is_vlm else ""
    print(f"toptpu chat: {model['family']} ({model['num_layers']} layers), "
          f"{rt.header['mode']}, KV cache {rt.seq} tokens. /reset starts over, /exit quits."
          f"{vlm}", file=sys.stderr)
    images: list[Any] = []
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
            images = []
            print("[conversation reset]", file=sys.stderr)
            continue
        if msg == "/image" or msg.startswith("/image "):
            try:
                path, msg = _image_command(msg)
                enc = rt.encode_image(path)
            except (ValueError, *_user_errors()) as e:  # bad image, text-only model file
                print(f"[{e}]", file=sys.stderr)
                continue
            images.append(enc)
            print(f"[image {path}: {enc.size[0]}x{enc.size[1]}, {enc.tiles} tiles, "
                  f"{enc.image_tokens} image tokens]", file=sys.stderr)
            if not msg:
                continue

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            res = rt.chat(msg, args.max_new_tokens, sampling, on_text=stream,
                          system=args.system, reset_if_full=args.reset_if_full, images=images)
        except PromptTooLongError as e:
            print(f"[{e}]", file=sys.stderr)
            images = []
            continue
        except _user_errors() as e:
            return _fail("chat", e)
        images = []
        print()
        print(stats_line(res) + f" [{rt.position}/{rt.seq} tokens in the cache]",
              file=sys.stderr)


def _image_command(line: str) -> tuple[str, str]:
    """'/image PATH [message]' -> (PATH, message); a PATH with spaces is quoted."""
    rest = line[len("/image"):].strip()
    if not rest:
        raise ValueError("usage: /image PATH [message]")
    if rest[0] in "\"'":
        end = rest.find(rest[0], 1)
        if end < 0:
            raise ValueError(f"unclosed quote in /image {rest}")
        return rest[1:end], rest[end + 1:].strip()
    path, _, msg = rest.partition(" ")
    return path, msg.strip()


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
