"""The LLM commands of the `toptpu` command line: compile, run, chat (and the generation
part of `toptpu demo`). `toptpu.cli` registers them; they live here to keep that file small.

Errors a user can cause (bad model directory, unknown mode or chip, corrupt model file,
prompt longer than the compiled shapes, ...) are `toptpu.errors.ToptpuError`s;
`toptpu.cli.main` prints them as one `toptpu <cmd>: error: ...` line on stderr and
exits with status 1; no traceback. Bad argument values are refused by argparse (status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from toptpu.backend.contract import REPETITION_PENALTY_RANGE
from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.run_trace import write_run_trace
from toptpu.backend.runtime.runtime import (
    SAMPLER_CHOICES,
    GenerationError,
    GenerationResult,
    PromptTooLongError,
    Runtime,
    SamplingConfig,
)
from toptpu.backend.runtime.vision import image_file
from toptpu.backend.runtime.weight_cache_file import (
    auto_limit,
    cache_path,
    open_weight_cache,
    write_if_missing,
    write_weight_cache,
)
from toptpu.cli_args import (
    UsageError,
    finite_float,
    int_at_least,
    token_ids,
    utf8_problem,
    utf8_text,
)
from toptpu.command_io import LineTooLong, message_limit, read_line
from toptpu.demo_dir import replaced_model_dir
from toptpu.errors import ToptpuError
from toptpu.paths import check_output_file
from toptpu.progress import progress_bar
from toptpu.request import CompileRequest, add_request_args

#: version of the `toptpu run --json` object (docs/usage.md: "toptpu run --json"); bumped when a
#: key changes meaning or goes away
RUN_JSON_SCHEMA = 2  # 2: `text` leaves special tokens out unless --special-tokens


# --------------------------------------------------------------------------- arguments


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?",
                   help="Hugging Face model directory (config.json, *.safetensors, "
                   "tokenizer.json), or a GGUF file (or a directory holding one); with "
                   "--from-ir: the model the dump was made from, when it has moved")
    p.add_argument("-o", "--output", required=True,
                   help="the model file to write (not inside the model directory)")
    add_request_args(p)  # every option of the compile request (`toptpu.request`)
    ir = p.add_argument_group("from IR (docs/usage.md: compile from a dump)")
    ir.add_argument("--from-ir", metavar="DIR",
                    help="compile from a --dump-ir directory whose IR may be edited at any "
                    "stage: each net from its edited file (or its last Tpu stage) through "
                    "the passes after it, with the dump's request and weight store")
    ir.add_argument("--ir-stage", action="append", metavar="NET=STAGE",
                    help="with --from-ir: pick NET up at STAGE (a file of DIR/NET, e.g. "
                    "block=08-cse.mlir, or its number, block=08); repeatable")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("model_file")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=utf8_text, help="text to continue")
    src.add_argument("--ids", type=token_ids, help="prompt token ids, comma or space separated")
    r.add_argument("--chat-template", action="store_true",
                   help="wrap the prompt as a user message with the chat template")
    r.add_argument("--image", action="append", metavar="PATH",
                   help="an image for a vision-language model file (repeatable); the prompt "
                   "marks where it goes with the model's image token, else it goes first")
    r.add_argument("--video", action="append", nargs="+", metavar="FRAME",
                   help="Qwen-VL: a video given as its frames (image files, in order; "
                   "repeatable for several videos); the prompt marks where it goes with the "
                   "video token, else it goes first")
    r.add_argument("--fps", type=finite_float(0.0, lo_open=True), default=2.0,
                   help="frames per second of the --video frames (default 2): Qwen2.5-VL "
                   "spaces the frames' positions by it, Qwen3-VL writes their timestamps")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS ids")
    r.add_argument("--special-tokens", action="store_true",
                   help="print special tokens (the end-of-turn marker, ...) in the text")
    r.add_argument("--json", action="store_true", help="print one JSON object (ids, text, "
                   "time to first token and tokens/s, host and modelled; schema in "
                   "docs/usage.md)")
    r.add_argument("--trace", metavar="JSON", help="write the Chrome trace (open it in "
                   "Perfetto) of the whole run on the modelled chip clock: the prefill chunks, "
                   "every decode step and token choice, every net run and host transfer")
    r.add_argument("--trace-commands", action="store_true",
                   help="--trace also holds every DMA and compute command of every net run "
                   "(large)")
    add_sampling_args(r)


def add_cache_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("model_file")
    c.add_argument("-o", "--output", default=None,
                   help="the weight cache file to write (default: MODEL_FILE.wcache, where "
                   "run and chat look for it)")
    c.add_argument("--check", action="store_true",
                   help="check an existing weight cache file byte for byte against the model "
                   "file instead of writing one")
    c.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_chat_args(h: argparse.ArgumentParser) -> None:
    h.add_argument("model_file")
    h.add_argument("--system", type=utf8_text, help="system prompt of the conversation")
    h.add_argument("--reset-if-full", action="store_true",
                   help="start over when a turn no longer fits the KV cache (default: say so)")
    h.add_argument("--fps", type=finite_float(0.0, lo_open=True), default=2.0,
                   help="frames per second of /video frames (default 2)")
    h.add_argument("--special-tokens", action="store_true",
                   help="print special tokens (the end-of-turn marker, ...) in the replies")
    add_sampling_args(h)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", choices=["interpreter", "machine"], default="machine",
                   help="run the nets with the Tpu interpreter or on the reference machine")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128,
                   help="stop after this many new tokens")
    p.add_argument("--temperature", type=finite_float(0.0, what=" (0: greedy)"), default=None,
                   help="0 = greedy (default: the generation config's, greedy unless it "
                   "samples)")
    p.add_argument("--top-k", type=int_at_least(0, " (0: off)"), default=None,
                   help="sample among the K most likely tokens, 0: off (default: the "
                   "generation config's when it samples, else 0)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True, what=" (1: off)"),
                   default=None, help="sample among the most likely tokens whose probability "
                   "adds up to P, 1: off (default: the generation config's when it samples, "
                   "else 1)")
    p.add_argument("--repetition-penalty", type=finite_float(*REPETITION_PENALTY_RANGE,
                                                             what=" (1: off)"), default=None,
                   help="make recent tokens less likely: their positive logits divided by "
                   "this, negative ones multiplied, 1: off (default: the generation config's, "
                   "else 1)")
    p.add_argument("--penalty-window", type=int_at_least(0), default=64,
                   help="recent tokens the repetition penalty looks at")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="seed of the sampler (default: a fresh one each run)")
    p.add_argument("--sampler", choices=list(SAMPLER_CHOICES), default="auto",
                   help="where the token is chosen: chip (greedy_head / sample_head nets, as "
                   "the real deployment), host (logits read back, numpy), auto (chip where "
                   "its heads can: greedy, or top-k between 1 and the head's K; else host)")


def sampling_from_args(args: argparse.Namespace, generation: dict[str, Any]
                       ) -> SamplingConfig:
    """The sampling settings: the arguments given, else the model file's generation config
    (greedy unless it samples)."""
    def stored(key: str, kind: type, default: float) -> Any:
        v = generation.get(key)
        try:
            return default if v is None else kind(v)
        except (TypeError, ValueError) as e:
            raise GenerationError(f"the model file's generation config has {key} {v!r}, not "
                                  "a number; pass --" + key.replace("_", "-")) from e

    samples = bool(generation.get("do_sample", False))
    temp = args.temperature if args.temperature is not None else (
        stored("temperature", float, 1.0) if samples else 0.0)
    top_k = args.top_k if args.top_k is not None else (
        stored("top_k", int, 0) if samples else 0)
    top_p = args.top_p if args.top_p is not None else (
        stored("top_p", float, 1.0) if samples else 1.0)
    pen = args.repetition_penalty if args.repetition_penalty is not None else stored(
        "repetition_penalty", float, 1.0)
    cfg = SamplingConfig(temp, top_k, top_p, pen, args.penalty_window, args.seed,
                         args.sampler)
    cfg.validate()
    return cfg


def _sampler_text(sampler: str) -> str:
    return {"greedy": "greedy_head on the chip", "sample": "sample_head on the chip",
            "host": "chosen on the host"}.get(sampler, sampler)


def _fmt(v: float | None, unit: str, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def stats_line(res: GenerationResult) -> str:
    vision = (f"vision {res.image_tokens} image tokens in {_fmt(res.vision_s, 's')} host, "
              f"{_fmt(res.vision_modelled_s, 's', 6)} modelled; " if res.image_tokens else "")
    return (f"[{len(res.generated_ids)} tokens, stop: {res.stop_reason}; "
            f"{_sampler_text(res.sampler)}; {vision}prefill "
            f"{res.prefill_tokens} tokens; time to first token {_fmt(res.ttft_s, 's')} host, "
            f"{_fmt(res.modelled_ttft_s, 's', 6)} modelled; decode "
            f"{_fmt(res.decode_tokens_per_s, ' tok/s', 1)} host, "
            f"{_fmt(res.modelled_tokens_per_s, ' tok/s', 1)} modelled]")


# --------------------------------------------------------------------------- commands


def _from_ir(args: argparse.Namespace) -> int:
    """`toptpu compile --from-ir DIR`: the request is the dump's; a request option given
    too is refused."""
    from toptpu.from_ir import compile_from_ir

    given = [o.flags[-1] for o in CompileRequest.options()
             if getattr(args, o.keyword, o.default) != o.default]
    if given:
        raise UsageError(f"--from-ir compiles with the request of the dump (its "
                         f"compile.json); drop {', '.join(given)}")
    compile_from_ir(args.from_ir, args.output, model=args.model, ir_stages=args.ir_stage,
                    progress=None if args.quiet else sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a Hugging Face model directory (or a --dump-ir directory, edited) to a model
    file."""
    from toptpu.compiler import compile as compile_model

    if args.from_ir is not None:
        return _from_ir(args)
    if args.ir_stage:
        raise UsageError("--ir-stage picks a net's stage of a --from-ir directory; give "
                         "--from-ir DIR")
    if args.model is None:
        raise UsageError("give the model to compile (a Hugging Face directory or a GGUF "
                         "file), or --from-ir DIR")

    compile_model(args.model, args.output, CompileRequest.from_args(args),
                  progress=None if args.quiet else sys.stderr)
    return 0


def _prompt_ids(rt: Runtime, args: argparse.Namespace) -> tuple[list[int], list[Any]]:
    """The prompt's token ids (and encoded images) as the arguments give them."""
    if args.ids is not None:
        if args.chat_template or args.image or args.video:
            raise UsageError("--chat-template, --image and --video apply to --prompt text, "
                             "not to --ids")
        return args.ids, []
    if args.image or args.video:
        return rt.image_prompt(args.prompt, args.image or [], args.chat_template,
                               videos=args.video, fps=args.fps)
    if args.chat_template:
        text = rt.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                add_generation_prompt=True)
        return rt.encode(text, add_special_tokens=False), []
    return rt.encode(args.prompt), []


def run_json(res: GenerationResult, executor: str, weight_cache_file: str | None = None
             ) -> dict[str, Any]:
    """The `toptpu run --json` object (schema RUN_JSON_SCHEMA, documented in docs/usage.md)."""
    return {
        "schema": RUN_JSON_SCHEMA,
        "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
        "text": res.text, "stop_reason": res.stop_reason,
        "ttft_s": res.ttft_s, "tokens_per_s": res.decode_tokens_per_s,
        "modelled_ttft_s": res.modelled_ttft_s,
        "modelled_tokens_per_s": res.modelled_tokens_per_s,
        "image_tokens": res.image_tokens, "vision_s": res.vision_s,
        "vision_modelled_s": res.vision_modelled_s,
        "executor": executor,
        "sampler": res.sampler,
        "modelled_breakdown": res.modelled_breakdown,
        "weight_cache_file": weight_cache_file,
    }


def cmd_cache(args: argparse.Namespace) -> int:
    """Write the weight cache file of a model file (its weights converted once, read by run
    and chat so the first token converts nothing), or --check one."""
    llm = LlmFile(args.model_file)
    path = args.output or cache_path(args.model_file)
    if args.check:
        stored = open_weight_cache(llm, path)
        stored.verify()
        print(f"{path}: {len(stored)} converted weights, each equal to the model file's "
              "conversion")
        stored.close()
        return 0
    t = time.perf_counter()
    with progress_bar(None, "toptpu cache", quiet=args.quiet, unit="weight") as bar:
        if bar.disable:  # no terminal: one line per converted weight, unless --quiet
            note = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr))
            written = write_weight_cache(llm, path, note)
        else:
            def planned(n: int) -> None:
                bar.reset(total=n)

            written = write_weight_cache(llm, path, lambda _: bar.update(1), planned=planned)
    print(f"wrote {written} ({os.path.getsize(written) / 1e6:.1f} MB) in "
          f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0


def _print_notes(rt: Runtime) -> None:
    """What the runtime noted (a weight cache file left unused), once each, on stderr."""
    for note in rt.notes:
        print(f"toptpu: note: {note}", file=sys.stderr)
    rt.notes.clear()


def _keep_weight_cache(rt: Any) -> None:
    """After a run that converted its weights: the model file's weight cache file written
    for the next one, within TOPTPU_WEIGHT_CACHE_FILE's limit, its size said on stderr."""
    if rt.meta.parallel is None:
        write_if_missing(rt.ex.file, lambda line: print(f"toptpu: note: {line}",
                                                         file=sys.stderr),
                         rt.weight_cache_file)


def cmd_run(args: argparse.Namespace) -> int:
    """Generate from a prompt with a compiled model file (needs nothing else); VLMs take
    --image PATH (repeatable)."""
    if args.trace_commands and not args.trace:
        raise UsageError("--trace-commands adds to --trace: give --trace FILE.json too")
    if args.trace:
        check_output_file(args.trace, "--trace", "trace.json")
        if os.path.exists(args.trace) and os.path.samefile(args.trace, args.model_file):
            raise UsageError(f"--trace '{args.trace}' is the model file; name another file")
    for path in [*(args.image or []), *(f for video in args.video or [] for f in video)]:
        image_file(path)  # each a regular file, before the model file is read
    auto_limit()  # a bad TOPTPU_WEIGHT_CACHE_FILE: an error before any work
    rt = Runtime.open(args.model_file, args.executor)
    _print_notes(rt)
    sampling = sampling_from_args(args, rt.header.get("generation", {}))
    recorder = rt.start_trace() if args.trace else None
    ids, images = _prompt_ids(rt, args)
    stream = None
    if not args.json:
        # a completion continues the prompt's text; a chat reply (or a VLM's) stands alone
        plain = args.ids is None and not args.chat_template and not args.image and \
            not args.video
        sys.stdout.write(args.prompt if plain else "")

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

    res = rt.generate(ids, args.max_new_tokens, sampling, on_text=stream,
                      stop_on_eos=not args.ignore_eos, images=images,
                      skip_special_tokens=not args.special_tokens)
    if recorder is not None:
        write_run_trace(args.trace, recorder, args.trace_commands,
                        {"modelled_ttft_s": res.modelled_ttft_s,
                         "modelled_tokens_per_s": res.modelled_tokens_per_s,
                         "generated_tokens": len(res.generated_ids)})
    _print_notes(rt)
    if args.json:
        print(json.dumps(run_json(res, args.executor, rt.weight_cache_file)))
    else:
        print()
        print(stats_line(res), file=sys.stderr)
    if recorder is not None:
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev)", file=sys.stderr)
    _keep_weight_cache(rt)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat with a compiled model file; the KV cache keeps the conversation.
    /reset starts over, /exit (or end of input) quits, /help lists the commands, a message
    that starts with '/' is typed as '//...'; VLMs: /image PATH [message] attaches an image
    to the message (or to the next one). Ctrl-C quits (status 130)."""
    auto_limit()  # a bad TOPTPU_WEIGHT_CACHE_FILE: an error before any work
    rt = Runtime.open(args.model_file, args.executor)
    _print_notes(rt)
    sampling = sampling_from_args(args, rt.header.get("generation", {}))
    _ = rt.tokenizer
    model = rt.header["model"]
    print(f"toptpu chat: {model['family']} ({model['num_layers']} layers), "
          f"{rt.header['mode']}, KV cache {rt.seq} tokens. {_chat_help(rt.is_vlm)}",
          file=sys.stderr)
    _prepare_input()
    try:
        code = _chat_loop(rt, args, sampling)
        _keep_weight_cache(rt)
        return code
    except KeyboardInterrupt:
        print()  # end the prompt or the reply's line; toptpu.cli prints why it stopped
        raise


def _chat_help(vlm: bool) -> str:
    image = (" /image PATH [message] attaches an image; /video FRAME,FRAME,... [message] a "
             "video given as its frames (Qwen-VL).") if vlm else ""
    return (f"/reset starts over, /exit quits, /help lists the commands.{image} Start a "
            "message with // to send one that begins with '/'.")


def _prepare_input() -> None:
    """Line editing and an in-memory history (arrow keys) for `input()` on a terminal:
    importing the standard `readline` module is what turns them on (a local import for
    that reason, and because some platforms lack it); no history file is read or written.
    A line that is not valid UTF-8 is read with its bad bytes as surrogates (and then
    refused), so a decoding error never loses the lines after it."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:  # undecodable bytes arrive as surrogates, nothing is lost
        reconfigure(errors="surrogateescape")
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401
    except ImportError:
        pass


def _read_message(limit: int = 1 << 20) -> str | None:
    """The next non-empty input line, stripped; None at the end of input. A line that is
    not valid UTF-8, or longer than `limit` characters (read to its end, never held), is
    refused (and not sent)."""
    while True:
        try:
            line = read_line(">>> ", limit)
        except EOFError:
            print(file=sys.stderr)
            return None
        except LineTooLong as e:
            print(f"[{e}, more than fits the KV cache; not sent]", file=sys.stderr)
            continue
        problem = utf8_problem(line)
        if problem:
            print(f"[the line {problem}; not sent]", file=sys.stderr)
            continue
        if line.strip():
            return line.strip()


def _chat_loop(rt: Runtime, args: argparse.Namespace, sampling: SamplingConfig) -> int:
    images: list[Any] = []
    limit = message_limit(rt.tokenizer.backend.get_vocab(), rt.seq)
    while True:
        msg = _read_message(limit)
        if msg is None or msg == "/exit":
            return 0
        if msg.startswith("//"):  # the escape of a message that starts with '/'
            msg = msg[1:]
        elif msg == "/reset":
            rt.reset()
            images = []
            print("[conversation reset]", file=sys.stderr)
            continue
        elif msg == "/help":
            print(f"[{_chat_help(rt.is_vlm)}]", file=sys.stderr)
            continue
        elif msg == "/image" or msg.startswith("/image "):
            try:
                path, msg = _image_command(msg)
                enc = rt.encode_image(path)
            except (ValueError, ToptpuError) as e:  # bad image, text-only model file
                print(f"[{e}]", file=sys.stderr)
                continue
            images.append(enc)
            print(f"[image {path}: {enc.size[0]}x{enc.size[1]}, {enc.tiles} tiles, "
                  f"{enc.image_tokens} image tokens]", file=sys.stderr)
            if not msg:
                continue
        elif msg == "/video" or msg.startswith("/video "):
            try:
                path, msg = _image_command(msg, "/video")
                frames = [f for f in path.split(",") if f]
                enc = rt.encode_video(frames, args.fps)
            except (ValueError, ToptpuError) as e:  # bad frames, a model without video
                print(f"[{e}]", file=sys.stderr)
                continue
            images.append(enc)
            print(f"[video {len(frames)} frames at {args.fps:g} fps: {enc.size[0]}x"
                  f"{enc.size[1]}, grid {'x'.join(map(str, enc.grid_thw or ()))}, "
                  f"{enc.image_tokens} video tokens]", file=sys.stderr)
            if not msg:
                continue
        elif msg.startswith("/"):
            name = msg.split()[0]
            why = (f"{name} takes no argument" if name in ("/exit", "/reset", "/help") else
                   f"unknown command {name!r}")
            print(f"[{why}: {_chat_help(rt.is_vlm)}]", file=sys.stderr)
            continue

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            res = rt.chat(msg, args.max_new_tokens, sampling, on_text=stream,
                          system=args.system, reset_if_full=args.reset_if_full, images=images,
                          skip_special_tokens=not args.special_tokens)
        except PromptTooLongError as e:
            print(f"[{e}]", file=sys.stderr)
            images = []
            continue
        images = []
        print()
        _print_notes(rt)
        print(stats_line(res) + f" [{rt.position}/{rt.seq} tokens in the cache]",
              file=sys.stderr)


def _image_command(line: str, command: str = "/image") -> tuple[str, str]:
    """'/image PATH [message]' -> (PATH, message); a PATH with spaces is quoted. /video's
    PATH is its frames, separated by commas."""
    rest = line[len(command):].strip()
    if not rest:
        what = "FRAME,FRAME,..." if command == "/video" else "PATH"
        raise ValueError(f"usage: {command} {what} [message]")
    if rest[0] in "\"'":
        end = rest.find(rest[0], 1)
        if end < 0:
            raise ValueError(f"unclosed quote in {command} {rest}")
        return rest[1:end], rest[end + 1:].strip()
    path, _, msg = rest.partition(" ")
    return path, msg.strip()


#: the tiny demo's model directory and model files, inside the demo's directory
TINY_DEMO_MODEL = "tiny-qwen2"
TINY_DEMO_MODES = ("f32", "w4bf16")


def tiny_demo_file(mode: str) -> str:
    return f"{TINY_DEMO_MODEL}-{mode}.toptpu"


def demo_generation(prompt: str, max_new_tokens: int = 32,
                    directory: str | None = None) -> bool:
    """The end-to-end part of `toptpu demo`: save the built-in tiny Qwen2 as a Hugging Face
    directory and compile it to model files (f32 and w4bf16) in `directory` (a temporary
    one when None, removed afterwards), generate from each, and compare greedy tokens with
    transformers `generate`."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return _demo_generation(prompt, max_new_tokens, tmp)
    return _demo_generation(prompt, max_new_tokens, directory)


def _demo_generation(prompt: str, max_new_tokens: int, directory: str) -> bool:
    import torch

    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    ok = True
    with quiet_transformers():
        with replaced_model_dir(directory, TINY_DEMO_MODEL) as tmp:
            save_tiny_model(tmp, "qwen2")
        model_dir = os.path.join(directory, TINY_DEMO_MODEL)
        outs: dict[str, list[int]] = {}
        for mode in TINY_DEMO_MODES:
            path = os.path.join(directory, tiny_demo_file(mode))
            t = time.perf_counter()
            res_c = compile_model(model_dir, path, mode=mode, seq_length=128,
                                  max_input_length=32, progress=None)
            print(f"compiled {len(res_c.nets)} nets ({', '.join(res_c.nets)}) in {mode} to a "
                  f"model file in {time.perf_counter() - t:.1f}s")
            rt = Runtime.open(path)
            ids = rt.encode(prompt)
            res = rt.generate(ids, max_new_tokens, skip_special_tokens=True)
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
