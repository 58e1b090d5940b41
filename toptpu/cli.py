"""The `toptpu` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence


def _op_histogram(module) -> str:  # noqa: ANN001
    counts = Counter(op.name for op in module.walk() if op.name.startswith(("top.", "tpu.")))
    return ", ".join(f"{n.split('.', 1)[1]}×{c}" for n, c in sorted(counts.items()))


def cmd_demo(args: argparse.Namespace) -> int:
    """Import the built-in tiny Qwen2 model, run the Top pipeline, check against torch."""
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
    return 0 if ok and same else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="toptpu", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help=cmd_demo.__doc__)
    d.add_argument("--prompt", default="Hello world! The tensor processor runs the model.")
    d.add_argument("--print-ir", action="store_true", help="print the Top IR after the pipeline")
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
