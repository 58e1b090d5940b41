"""The `toptpu` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence


def _op_histogram(module) -> str:  # noqa: ANN001
    counts = Counter(op.name for op in module.walk() if op.name.startswith(("top.", "tpu.")))
    return ", ".join(f"{n.split('.', 1)[1]}×{c}" for n, c in sorted(counts.items()))


def cmd_demo(args: argparse.Namespace) -> int:
    """The built-in tiny Qwen2 end to end: Top pipeline checked against torch, then compiled
    to a model file (f32 and w4bf16) and generated from, checked against transformers."""
    import torch

    from toptpu.backend.interpreter import Interpreter
    from toptpu.frontends.fx_importer import import_module
    from toptpu.frontends.hf_layers import DecoderStack, causal_mask
    from toptpu.frontends.tiny_models import build_tokenizer, tiny_model
    from toptpu.metrics import similarity
    from toptpu.passes.pipelines import run_passes, top_pipeline_passes

    model = tiny_model("qwen2")
    tok = build_tokenizer(model.config.vocab_size)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.int64)
    n = ids.shape[1]
    pos = torch.arange(n)[None]
    mask = causal_mask(n)
    cfg = model.config
    print(f"model: built-in tiny {cfg.model_type} (hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads} q/kv heads, vocab {cfg.vocab_size}), prompt {n} tokens")
    t = time.perf_counter()
    module, store = import_module(DecoderStack(model), (ids, pos, mask),
                                  input_names=["input_ids", "position_ids", "attention_mask"],
                                  output_names=["logits"])
    print(f"imported in {time.perf_counter() - t:.2f}s: {sum(1 for _ in module.walk())} ops, "
          f"{len(store)} weights ({store.nbytes() / 1e6:.2f} MB) in the weight store")
    print(f"  before: {_op_histogram(module)}")
    feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(),
             "attention_mask": mask.numpy()}
    before = Interpreter(module).run(feeds).outputs["logits"]

    def progress(p, m) -> None:  # noqa: ANN001
        print(f"  pass {p.name:<13} -> {sum(1 for _ in m.walk())} ops")

    t = time.perf_counter()
    run_passes(module, top_pipeline_passes(), after=progress)
    print(f"top-pipeline in {time.perf_counter() - t:.2f}s")
    print(f"  after:  {_op_histogram(module)}")
    if args.print_ir:
        print(module)
    after = Interpreter(module).run(feeds).outputs["logits"]
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
    from toptpu.llm_cli import demo_generation

    print("\n-- compile to a model file and generate")
    generated_ok = demo_generation(args.prompt, args.max_new_tokens)
    return 0 if ok and same and generated_ok else 1


def _load_causal_lm(path: str | None):  # noqa: ANN202
    import torch

    from toptpu.frontends.tiny_models import tiny_model

    if path is None:
        return tiny_model("qwen2")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare stages (torch, mlir, top, tpu) of a decoder layer or whole model on one input."""
    import torch

    from toptpu.compare import (
        THRESHOLDS,
        IRStage,
        MLIRStage,
        TorchStage,
        compare_stages,
        tpu_threshold,
    )
    from toptpu.frontends.fx_importer import import_exported
    from toptpu.frontends.hf_layers import DecoderStack, decoder_layer, layer_inputs
    from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes

    model = _load_causal_lm(args.model)
    cfg = model.config
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
    names = list(feeds)
    with torch.no_grad():
        ep = torch.export.export(net.eval(), tuple(feeds.values()), strict=False)
    module, _ = import_exported(ep, module=net, input_names=names, output_names=outs)
    top_module = module.clone()
    run_passes(top_module, top_pipeline_passes())
    stages = {"torch": TorchStage("torch", ep, names, outs, net),
              "top": IRStage("top", top_module),
              "mlir": MLIRStage("mlir", top_module)}
    if "tpu" in args.stages:
        tpu_module = top_module.clone()
        run_passes(tpu_module, tpu_pipeline_passes(args.mode, args.group_size, args.symmetric))
        stages["tpu"] = IRStage(f"tpu-{args.mode}", tpu_module)
    order = [s.strip() for s in args.stages.split(",")]
    for s in order:
        if s not in stages:
            raise SystemExit(f"toptpu compare: unknown stage '{s}' (torch, mlir, top, tpu)")
    if args.oracle == "mlir" and "mlir" not in order:
        # the MLIR-JIT oracle checks torch and becomes the reference of the next stage
        at = order.index("torch") + 1 if "torch" in order else 0
        order.insert(at, "mlir")
    arrays = {k: v.numpy() for k, v in feeds.items()}
    ok = True
    for a, b in zip(order, order[1:], strict=False):
        thr = THRESHOLDS["top-vs-torch"] if b in ("top", "mlir") else tpu_threshold(args.mode)
        dump = os.path.join(args.dump, f"{a}-vs-{b}") if args.dump else None
        rep = compare_stages(stages[a], stages[b], arrays, thr, args.compare_all, dump)
        print(rep.table())
        ok &= rep.ok
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toptpu", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help=cmd_demo.__doc__)
    d.add_argument("--prompt", default="Hello world! The tensor processor runs the model.")
    d.add_argument("--print-ir", action="store_true", help="print the Top IR after the pipeline")
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.set_defaults(fn=cmd_demo)

    from toptpu import llm_cli

    p = sub.add_parser("compile", help=llm_cli.cmd_compile.__doc__)
    llm_cli.add_compile_args(p)
    p.set_defaults(fn=llm_cli.cmd_compile)

    r = sub.add_parser("run", help=llm_cli.cmd_run.__doc__)
    r.add_argument("model_file")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text to continue")
    src.add_argument("--ids", help="prompt token ids, comma or space separated")
    r.add_argument("--chat-template", action="store_true",
                   help="wrap the prompt as a user message with the chat template")
    r.add_argument("--image", action="append", metavar="PATH",
                   help="an image for a vision-language model file (repeatable); the prompt "
                   "marks where it goes with the model's image token, else it goes first")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS ids")
    r.add_argument("--json", action="store_true", help="print one JSON object (ids, text, "
                   "time to first token and tokens/s, host and modelled)")
    llm_cli.add_sampling_args(r)
    r.set_defaults(fn=llm_cli.cmd_run)

    h = sub.add_parser("chat", help=llm_cli.cmd_chat.__doc__)
    h.add_argument("model_file")
    h.add_argument("--system", help="system prompt of the conversation")
    h.add_argument("--reset-if-full", action="store_true",
                   help="start over when a turn no longer fits the KV cache (default: say so)")
    llm_cli.add_sampling_args(h)
    h.set_defaults(fn=llm_cli.cmd_chat)

    from toptpu.profile_cli import add_profile_parser

    add_profile_parser(sub)

    c = sub.add_parser("compare", help=cmd_compare.__doc__)
    c.add_argument("model", nargs="?", help="Hugging Face model directory (default: built-in)")
    c.add_argument("--stages", default="torch,top,tpu",
                   help="comma-separated stages compared pairwise in order (torch, mlir, top, "
                   "tpu)")
    c.add_argument("--oracle", choices=["torch", "mlir"], default="torch",
                   help="mlir: also run the Top module compiled by real MLIR (linalg, LLVM "
                   "JIT) after torch, as the reference of the numpy interpreter")
    c.add_argument("--what", choices=["layer", "model"], default="layer",
                   help="one decoder layer (with rope) or the whole model to logits")
    c.add_argument("--layer", type=int, default=0)
    c.add_argument("--seq", type=int, default=16, help="static sequence length")
    c.add_argument("-q", "--mode", default="bf16", help="quantization mode of the tpu stage")
    c.add_argument("--group-size", type=int, default=64)
    c.add_argument("--symmetric", action="store_true", default=None)
    c.add_argument("--compare-all", action="store_true",
                   help="compare every intermediate tensor and name the first that drops")
    c.add_argument("--dump", metavar="DIR", help="write inputs, each stage's tensors (.npz) "
                   "and report.json")
    c.set_defaults(fn=cmd_compare)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
