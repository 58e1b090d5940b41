"""Linear attention's ops (Qwen3.5's Gated DeltaNet): top/tpu.causal_conv1d,
gated_delta_rule and softplus against their torch definitions
(`frontends.linear_attention_ops`), through the importer, the Top and Tpu interpreters,
convert-top-to-tpu's type decisions and the reference machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType, bf16
from xdsl.ir import Block, BlockArgument
from xdsl.utils.exceptions import VerifyException

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.target.chips import get_chip
from toptpu.dialects import top, tpu
from toptpu.dialects.common import dtype_name, elem_of, tensor
from toptpu.frontends import linear_attention_ops as la
from toptpu.frontends.fx_importer import UnsupportedOpError, import_module
from toptpu.metrics import similarity
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes

CHIP = get_chip("bm1684x")


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _delta_inputs(rng: np.random.Generator, t: int = 7, hk: int = 2, hv: int = 4,
                  dk: int = 8, dv: int = 6) -> dict[str, np.ndarray]:
    """Inputs as Gated DeltaNet makes them: q, k L2-normalised, g = -softplus (a decay),
    beta in (0, 1), a random f32 state."""
    q = _rand(rng, 1, t, hk, dk)
    k = _rand(rng, 1, t, hk, dk)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return {"q": q, "k": k, "v": _rand(rng, 1, t, hv, dv),
            "g": -np.log1p(np.exp(_rand(rng, 1, t, hv))).astype(np.float32),
            "beta": (1 / (1 + np.exp(-_rand(rng, 1, t, hv)))).astype(np.float32),
            "state": _rand(rng, 1, hv, dk, dv, scale=0.5)}


def _torch(*arrays: np.ndarray | None) -> list[torch.Tensor | None]:
    return [None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("with_state", [True, False])
def test_gated_delta_rule_kernel_matches_torch(with_state: bool) -> None:
    rng = np.random.default_rng(0)
    d = _delta_inputs(rng)
    state = d["state"] if with_state else None
    o, s = K.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], state, 0.35)
    to, ts = la.gated_delta_rule(*_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], state),
                                 0.35)
    assert o.dtype == np.float32 and s.dtype == np.float32
    np.testing.assert_allclose(o, to.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, ts.numpy(), rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_kernel_bf16_output_and_f32_state() -> None:
    rng = np.random.default_rng(1)
    d = _delta_inputs(rng)
    bf = {n: K.to_bf16(a) for n, a in d.items() if n != "state"}
    o, s = K.gated_delta_rule(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], d["state"],
                              0.5)
    to, ts = la.gated_delta_rule(*_torch(*(bf[n].astype(np.float32)
                                           for n in ("q", "k", "v", "g", "beta"))),
                                 torch.from_numpy(d["state"]), 0.5)
    assert o.dtype == K.BF16 and s.dtype == np.float32
    np.testing.assert_allclose(s, ts.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o.astype(np.float32), to.numpy(), rtol=1e-2, atol=1e-2)


def test_padded_tokens_leave_the_state_bit_identical() -> None:
    rng = np.random.default_rng(2)
    d = _delta_inputs(rng, t=9)
    n = 5  # real tokens; the rest padding: g = 0, beta = 0 (what the wrapper makes)
    padded = {name: a.copy() for name, a in d.items()}
    padded["g"][:, n:] = 0
    padded["beta"][:, n:] = 0
    args = [padded[x] for x in ("q", "k", "v", "g", "beta", "state")]
    _, s_padded = K.gated_delta_rule(*args, 0.3)
    real = [a[:, :n] for a in args[:5]]
    o_real, s_real = K.gated_delta_rule(*real, d["state"], 0.3)
    assert np.array_equal(s_padded.view(np.uint32), s_real.view(np.uint32))
    o_padded, _ = K.gated_delta_rule(*args, 0.3)
    assert np.array_equal(o_padded[:, :n], o_real)


def test_gated_delta_rule_heads_are_independent() -> None:
    """A slice of key heads with their value heads computes the same bits (the machine
    splits the rule by heads)."""
    rng = np.random.default_rng(3)
    d = _delta_inputs(rng, hk=2, hv=4)
    o, s = K.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], d["state"], 0.3)
    o1, s1 = K.gated_delta_rule(d["q"][:, :, 1:], d["k"][:, :, 1:], d["v"][:, :, 2:],
                                d["g"][:, :, 2:], d["beta"][:, :, 2:], d["state"][:, 2:], 0.3)
    assert np.array_equal(o[:, :, 2:], o1) and np.array_equal(s[:, 2:], s1)


@pytest.mark.parametrize("n_valid", [6, 2, 0])
@pytest.mark.parametrize("with_state", [True, False])
def test_causal_conv1d_kernel_matches_torch(n_valid: int, with_state: bool) -> None:
    rng = np.random.default_rng(4)
    t, c, k = 6, 5, 4
    x, w = _rand(rng, 1, t, c), _rand(rng, c, k)
    state = _rand(rng, 1, k - 1, c) if with_state else None
    valid = (np.arange(t) < n_valid).astype(np.float32)[None]
    y, ns = K.causal_conv1d(x, w, state, valid)
    ty, tns = la.causal_conv1d(*_torch(x, w, state, valid))
    np.testing.assert_allclose(y, ty.numpy(), rtol=1e-5, atol=1e-5)
    assert np.array_equal(ns, tns.numpy())  # the state is moved, not computed
    assert ns.shape == (1, k - 1, c)


def test_causal_conv1d_chunks_continue_through_the_state() -> None:
    """Two chunks through the state equal one chunk over all tokens."""
    rng = np.random.default_rng(5)
    x, w = _rand(rng, 1, 10, 3), _rand(rng, 3, 4)
    ones = np.ones((1, 10), np.float32)
    y, s = K.causal_conv1d(x, w, None, ones)
    y1, s1 = K.causal_conv1d(x[:, :6], w, None, ones[:, :6])
    y2, s2 = K.causal_conv1d(x[:, 6:], w, s1, ones[:, 6:])
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), y, rtol=1e-6, atol=1e-6)
    assert np.array_equal(s2, s)


def test_softplus_kernel_matches_torch() -> None:
    x = np.array([-100, -20, -3, -0.5, 0, 0.5, 3, 19.9, 20, 20.1, 80, 100], np.float32)
    got = K.unary("softplus", x)
    want = torch.nn.functional.softplus(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(got))


# --------------------------------------------------------------------------- a small net


class TinyGatedDeltaNet(torch.nn.Module):
    """A Gated DeltaNet layer's linear attention in the shape of Qwen3.5's (projections,
    short conv with its state, softplus decay, the delta rule with its state), small."""

    def __init__(self, hidden: int = 16, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 4,
                 conv_k: int = 4) -> None:
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.channels = 2 * hk * dk + hv * dv
        g = torch.Generator().manual_seed(0)
        self.in_proj = torch.nn.Linear(hidden, self.channels, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(self.channels, conv_k, generator=g)
                                              * 0.5)
        self.a_proj = torch.nn.Linear(hidden, hv, bias=False)
        self.b_proj = torch.nn.Linear(hidden, hv, bias=False)
        self.a_log = torch.nn.Parameter(torch.randn(hv, generator=g) * 0.1)
        self.dt_bias = torch.nn.Parameter(torch.randn(hv, generator=g) * 0.1)
        self.out_proj = torch.nn.Linear(hv * dv, hidden, bias=False)

    @staticmethod
    def _l2norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    def forward(self, hidden: torch.Tensor, valid: torch.Tensor, conv_state: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = hidden.shape[1]
        qkv = self.in_proj(hidden)
        y, new_conv = torch.ops.toptpu.causal_conv1d(qkv, self.conv_weight, conv_state, valid)
        y = torch.nn.functional.silu(y)
        nq = self.hk * self.dk
        q, k, v = torch.split(y, [nq, nq, self.hv * self.dv], dim=-1)
        q = self._l2norm(q.reshape(1, t, self.hk, self.dk))
        k = self._l2norm(k.reshape(1, t, self.hk, self.dk))
        v = v.reshape(1, t, self.hv, self.dv)
        mask = valid[..., None]
        beta = torch.sigmoid(self.b_proj(hidden)) * mask
        g = -torch.exp(self.a_log) * torch.nn.functional.softplus(self.a_proj(hidden)
                                                                  + self.dt_bias) * mask
        o, new_state = torch.ops.toptpu.gated_delta_rule(q, k, v, g, beta, state,
                                                         self.dk ** -0.5)
        return self.out_proj(o.reshape(1, t, self.hv * self.dv)), new_conv, new_state


NET_INPUTS = ["hidden", "valid", "conv_state", "state"]
NET_OUTPUTS = ["out", "new_conv_state", "new_state"]


def _net_feeds(net: TinyGatedDeltaNet, t: int = 8, n_valid: int = 6,
               seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"hidden": _rand(rng, 1, t, net.in_proj.in_features),
            "valid": (np.arange(t) < n_valid).astype(np.float32)[None],
            "conv_state": _rand(rng, 1, net.conv_weight.shape[1] - 1, net.channels),
            "state": _rand(rng, 1, net.hv, net.dk, net.dv, scale=0.3)}


def _import_net(net: TinyGatedDeltaNet, feeds: dict[str, np.ndarray]):
    args = tuple(torch.from_numpy(feeds[n]) for n in NET_INPUTS)
    module, store = import_module(net, args, input_names=NET_INPUTS,
                                  output_names=NET_OUTPUTS)
    with torch.no_grad():
        ref = [r.numpy() for r in net(*args)]
    return module, store, dict(zip(NET_OUTPUTS, ref, strict=True))


def test_importer_maps_the_custom_ops_and_softplus() -> None:
    net = TinyGatedDeltaNet()
    feeds = _net_feeds(net)
    module, _, _ = _import_net(net, feeds)
    module.verify()
    names = [op.name for op in module.walk()]
    for name in ("top.causal_conv1d", "top.gated_delta_rule", "top.softplus"):
        assert names.count(name) == 1, name
    (rule,) = [op for op in module.walk() if isinstance(op, top.GatedDeltaRuleOp)]
    assert rule.scale.value.data == pytest.approx(8 ** -0.5)
    assert isinstance(rule.state, BlockArgument)  # the function's state input, uncast


@pytest.mark.parametrize("n_valid", [8, 5])
def test_top_interpreter_matches_torch_before_and_after_pipeline(n_valid: int) -> None:
    net = TinyGatedDeltaNet()
    feeds = _net_feeds(net, n_valid=n_valid)
    module, store, ref = _import_net(net, feeds)
    got = Interpreter(module, store).run(feeds).outputs
    for name in NET_OUTPUTS:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
    run_passes(module, top_pipeline_passes(), store=store)
    after = Interpreter(module, store).run(feeds).outputs
    for name in NET_OUTPUTS:
        np.testing.assert_allclose(after[name], ref[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_softplus_with_other_parameters_is_refused() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.softplus(x, beta=2.0)

    with pytest.raises(UnsupportedOpError, match="beta=2.0"):
        import_module(Net(), (torch.zeros(2, 3),))


def _tpu_net(mode: str, n_valid: int = 6, t: int = 8):
    net = TinyGatedDeltaNet()
    feeds = _net_feeds(net, t=t, n_valid=n_valid)
    module, store, ref = _import_net(net, feeds)
    run_passes(module, tpu_pipeline_passes(mode, group_size=8), store=store)
    return module, store, feeds, ref


def _fn(module) -> func.FuncOp:
    (fn,) = [op for op in module.ops if isinstance(op, func.FuncOp)]
    return fn


@pytest.mark.parametrize("mode", ["f32", "bf16", "w8f16", "w4bf16"])
def test_tpu_types_and_interpreter(mode: str) -> None:
    module, store, feeds, ref = _tpu_net(mode)
    module.verify()
    act = {"f32": "f32", "bf16": "bf16", "w8f16": "f16", "w4bf16": "bf16"}[mode]
    fn = _fn(module)
    arg_types = dict(zip(NET_INPUTS, (dtype_name(elem_of(a)) for a in fn.body.block.args),
                         strict=True))
    assert arg_types == {"hidden": act, "valid": act, "conv_state": act, "state": "f32"}
    ret = fn.body.block.last_op
    assert ret is not None
    out_types = [dtype_name(elem_of(v)) for v in ret.operands]
    assert out_types == [act, act, "f32"]
    (conv,) = [op for op in module.walk() if isinstance(op, tpu.CausalConv1dOp)]
    (rule,) = [op for op in module.walk() if isinstance(op, tpu.GatedDeltaRuleOp)]
    (sp,) = [op for op in module.walk() if isinstance(op, tpu.SoftplusOp)]
    for op in (conv, rule, sp):
        assert dtype_name(op.attributes["compute"]) == "f32", op.name
    # the conv weight stays a float tpu.weight in f32, whatever the mode quantizes
    w = conv.weight.owner
    assert isinstance(w, tpu.WeightOp) and dtype_name(elem_of(conv.weight)) == "f32"
    assert rule.state is fn.body.block.args[3]
    assert dtype_name(elem_of(rule.new_state)) == "f32"
    got = Interpreter(module, store).run(
        {n: a.astype(K.BF16 if act == "bf16" and n != "state" else
                     np.float16 if act == "f16" and n != "state" else np.float32)
         for n, a in feeds.items()}).outputs
    for name in NET_OUTPUTS:
        if mode.startswith("w"):  # 4/8-bit projections of 16 channels: close, not equal
            assert similarity(got[name].astype(np.float32), ref[name]).cosine > 0.98, name
        else:
            tol = 1e-4 if mode == "f32" else 5e-2
            np.testing.assert_allclose(got[name].astype(np.float32), ref[name], rtol=tol,
                                       atol=tol, err_msg=name)


@pytest.mark.parametrize("mode", ["f32", "bf16"])
def test_sliced_by_heads_and_channels_on_the_machine(mode: str) -> None:
    """On a chip whose lanes cannot hold the delta rule or the conv whole, layer-group
    slices the rule by key heads (each with its value heads, the state by value heads) and
    the conv by channels; the machine, with each state bound in place (one buffer read and
    written), gives the Tpu interpreter's outputs and new states bit for bit (to f32
    rounding where the host's BLAS gives the in-projection's rows, tiled by tokens, other
    bits than the whole product's: `blas_threads.rows_keep_bits`)."""
    from dataclasses import replace

    from toptpu.backend.reference.blas_threads import rows_keep_bits
    from toptpu.backend.runtime.simulate import simulate
    from toptpu.machine_pipeline import compile_for_machine

    net = TinyGatedDeltaNet(hk=4, hv=8, dk=16, dv=16)
    feeds = _net_feeds(net, t=8, n_valid=6)
    module, store, _ = _import_net(net, feeds)
    run_passes(module, tpu_pipeline_passes(mode, group_size=8), store=store)
    fn = _fn(module)
    feeds = {n: a.astype(K.BF16) if dtype_name(elem_of(arg)) == "bf16" else a
             for (n, a), arg in zip(feeds.items(), fn.body.block.args, strict=True)}
    want = Interpreter(module, store).run(feeds).outputs
    chip = replace(CHIP, lanes=2, lane_bytes=12288 if mode == "f32" else 6144)
    program = compile_for_machine(module, chip)
    sliced = {op.name: g.attributes["slices"].value.data for g in module.walk()
              if isinstance(g, tpu.GroupOp) for op in g.body.walk()
              if isinstance(op, tpu.GatedDeltaRuleOp | tpu.CausalConv1dOp)}
    assert sliced["tpu.gated_delta_rule"] > 1 and sliced["tpu.causal_conv1d"] > 1, sliced
    got = simulate(program, store, feeds, chip,
                   in_place={"new_state": "state", "new_conv_state": "conv_state"}).outputs
    for name in NET_OUTPUTS:
        assert got[name].dtype == want[name].dtype, name
        assert (np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8))
                or not rows_keep_bits()), name
        np.testing.assert_allclose(got[name].astype(np.float32),
                                   want[name].astype(np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


# --------------------------------------------------------------------------- verifiers


def _values(*types: TensorType) -> tuple[BlockArgument, ...]:
    return Block(arg_types=list(types)).args


F32 = top.f32


@pytest.mark.parametrize(("shapes", "bad"), [
    ({"weight": (6, 4)}, "weight"),
    ({"state": (1, 2, 5)}, "state"),
    ({"valid": (1, 7)}, "valid"),
    ({"x": (2, 6, 5)}, "x"),
])
def test_causal_conv1d_verifier_names_the_bad_operand(shapes, bad: str) -> None:
    want = {"x": (1, 6, 5), "weight": (5, 4), "state": (1, 3, 5), "valid": (1, 6)}
    want.update(shapes)
    x, w, s, v = _values(*(tensor(want[n], F32) for n in ("x", "weight", "state", "valid")))
    with pytest.raises(VerifyException, match=f"causal_conv1d {bad} is"):
        top.CausalConv1dOp(x, w, s, v)


@pytest.mark.parametrize(("shapes", "bad"), [
    ({"q": (1, 5, 2, 4)}, "q is"),
    ({"v": (1, 5, 3, 6)}, "v has 3 heads"),
    ({"g": (1, 5, 2)}, "g is"),
    ({"beta": (1, 4, 4)}, "beta is"),
    ({"state": (1, 4, 6, 8)}, "state is"),
])
def test_gated_delta_rule_verifier_names_the_bad_operand(shapes, bad: str) -> None:
    want = {"q": (1, 5, 2, 8), "k": (1, 5, 2, 8), "v": (1, 5, 4, 6), "g": (1, 5, 4),
            "beta": (1, 5, 4), "state": (1, 4, 8, 6)}
    want.update(shapes)
    vals = _values(*(tensor(want[n], F32) for n in ("q", "k", "v", "g", "beta", "state")))
    with pytest.raises(VerifyException, match=f"gated_delta_rule {bad}"):
        top.GatedDeltaRuleOp(*vals, scale=0.5)


def test_gated_delta_rule_state_must_be_f32_and_flops() -> None:
    vals = _values(*(tensor(s, F32) for s in ((1, 5, 2, 8), (1, 5, 2, 8), (1, 5, 4, 6),
                                              (1, 5, 4), (1, 5, 4))), tensor((1, 4, 8, 6), bf16))
    with pytest.raises(VerifyException, match="state must be f32"):
        top.GatedDeltaRuleOp(*vals, scale=0.5)
    op = top.GatedDeltaRuleOp(*vals[:5], None, scale=0.5)
    assert op.flops() == 6 * 5 * 4 * 8 * 6
    assert dtype_name(elem_of(op.new_state)) == "f32"
    conv = top.CausalConv1dOp(*_values(tensor((1, 6, 5), F32), tensor((5, 4), F32)), None,
                              _values(tensor((1, 6), F32))[0])
    assert conv.flops() == 2 * 6 * 5 * 4


# --------------------------------------------------------------------------- transformers


def _hf_linear_attention():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _gated_delta_net_inputs(hk: int, hv: int, t: int, dk: int = 128, dv: int = 128,
                            seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v before the L2 norm; g and beta as Qwen3_5GatedDeltaNet makes them (A_log
    from its init range, dt_bias 1); a state as a previous chunk leaves it."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(1, t, hv, generator=g), torch.randn(1, t, hv, generator=g)
    a_log = torch.log(torch.empty(hv).uniform_(0.01, 16, generator=g))
    return {"q": torch.randn(1, t, hk, dk, generator=g),
            "k": torch.randn(1, t, hk, dk, generator=g),
            "v": torch.randn(1, t, hv, dv, generator=g),
            "g": -a_log.exp() * torch.nn.functional.softplus(a + torch.ones(hv)),
            "beta": b.sigmoid(),
            "state": torch.randn(1, hv, dk, dv, generator=g) * 0.1}


@pytest.mark.slow  # real small shapes: ~2 s per case on one core
@pytest.mark.parametrize(("hk", "hv"), [(16, 16), (16, 32)])
def test_gated_delta_rule_is_transformers_chunked_and_recurrent_rule(hk: int, hv: int) -> None:
    """At Qwen3.5's linear-attention shapes (heads of 128, 16 key heads; 16 or 32 value
    heads), over 70 tokens (more than transformers' chunk of 64), from a carried state:
    `toptpu::gated_delta_rule` on the L2-normalised q, k is transformers'
    `torch_recurrent_gated_delta_rule` (decode, and what it computes for any length) bit
    for bit in the state, and its `torch_chunk_gated_delta_rule` (prefill) to float32
    rounding; a decode step is the recurrent rule on one token; a chunk whose last tokens
    are padding (g = beta = 0) leaves the state of its real tokens."""
    hf = _hf_linear_attention()
    d = _gated_delta_net_inputs(hk, hv, 70)
    q, k, v, g, beta, state = (d[n] for n in ("q", "k", "v", "g", "beta", "state"))
    scale = 128 ** -0.5
    o, s = la.gated_delta_rule(hf.l2norm(q), hf.l2norm(k), v, g, beta, state, scale)
    kw = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    ro, rs = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert torch.equal(s, rs)
    torch.testing.assert_close(o, ro, rtol=1e-6, atol=1e-7)
    co, cs = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    torch.testing.assert_close(o, co, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, cs, rtol=1e-5, atol=1e-6)
    # decode: one token on the carried state
    one = [x[:, :1] for x in (q, k, v, g, beta)]
    o1, s1 = la.gated_delta_rule(hf.l2norm(one[0]), hf.l2norm(one[1]), *one[2:], state, scale)
    ro1, rs1 = hf.torch_recurrent_gated_delta_rule(*one, **kw)
    assert torch.equal(s1, rs1)
    torch.testing.assert_close(o1, ro1, rtol=1e-6, atol=1e-7)
    # a chunk of 50 real tokens padded to 70
    n = 50
    keep = (torch.arange(70) < n).float()[None, :, None]
    _, sp = la.gated_delta_rule(hf.l2norm(q), hf.l2norm(k), v, g * keep, beta * keep, state,
                                scale)
    _, cn = hf.torch_chunk_gated_delta_rule(*(x[:, :n] for x in (q, k, v, g, beta)), **kw)
    torch.testing.assert_close(sp, cn, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # transformers' modeling module imports in seconds
@pytest.mark.parametrize("n_valid", [9, 5])
def test_causal_conv1d_is_transformers_conv_with_its_cache(n_valid: int) -> None:
    """At Qwen3.5's conv width (C = 2*16*128 + 16*128 = 6144 channels, kernel 4):
    `toptpu::causal_conv1d` from a zero state is transformers' `causal_conv1d_fn` (prefill)
    and its new state the last K-1 inputs of the cache; on a carried state it is
    `causal_conv1d_update` (decode, one token, and a chunk), whose cache keeps K inputs of
    which the last K-1 are ours; a chunk padded after its real tokens gives their outputs
    and leaves their state."""
    hf = _hf_linear_attention()
    g = torch.Generator().manual_seed(1)
    t, c, kk = 9, 6144, 4
    x = torch.randn(1, t, c, generator=g)
    w = torch.randn(c, kk, generator=g) * 0.5
    valid = (torch.arange(t) < n_valid).float()[None]
    real = x[:, :n_valid]
    # prefill from a zero state
    y, ns = la.causal_conv1d(x, w, None, valid)
    hy = hf.causal_conv1d_fn(real.transpose(1, 2), w, None, activation=None).transpose(1, 2)
    torch.testing.assert_close(y[:, :n_valid], hy, rtol=1e-5, atol=1e-5)
    assert torch.equal(ns, real[:, -(kk - 1):])
    # on a carried state: transformers' cache holds K inputs [1, C, K]
    cache = torch.randn(1, c, kk, generator=g)
    ours_state = cache[:, :, 1:].transpose(1, 2).contiguous()
    for chunk, flags in ((x, valid), (x[:, :1], torch.ones(1, 1))):
        n = int(flags.sum())
        y, ns = la.causal_conv1d(chunk, w, ours_state, flags)
        hf_cache = cache.clone()
        hy = hf.causal_conv1d_update(chunk[:, :n].transpose(1, 2), hf_cache, w, None,
                                     None).transpose(1, 2)
        torch.testing.assert_close(y[:, :n], hy, rtol=1e-5, atol=1e-5)
        assert torch.equal(ns, hf_cache[:, :, 1:].transpose(1, 2))
