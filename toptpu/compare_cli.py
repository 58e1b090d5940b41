"""`toptpu compare`: the stages of a decoder layer or whole model (torch, MLIR, Top, Tpu) run
on one input and compared tensor by tensor."""

from __future__ import annotations

import argparse
import os
from typing import Any

from toptpu.cli_args import UsageError, int_at_least
from toptpu.compare import (
    THRESHOLDS,
    IRStage,
    MLIRStage,
    Stage,
    TorchStage,
    compare_stages,
    tpu_threshold,
)
from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.net_compiler import NetPlan, compile_net, top_net
from toptpu.paths import check_not_inside, check_output_dir
from toptpu.progress import progress_bar
from toptpu.request import CompileRequest, add_request_args

#: the stages `toptpu compare` knows
COMPARE_STAGES = ("torch", "mlir", "top", "tpu")

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




def add_compare_parser(sub: argparse._SubParsersAction) -> None:
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
