"""Mixture of experts (Qwen3-MoE, Qwen2-MoE): `top.moe_route` and `top.moe_experts` against
transformers' own router and experts modules and against their torch definitions
(`frontends.moe_ops`); the verifiers; the importer on transformers' MoE block (its fused
3-D experts) and on a block whose experts are a list of modules; the checkpoint's
one-tensor-per-expert layout (`save_pretrained`) checked and assembled; Top and Tpu on the
interpreter and the machine; and (slow) greedy generation equal to transformers'
`generate` through the compiled model file, on the interpreter and the machine."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from llm_fixtures import LONG_PROMPT, compiled, hf_generate, shared_dir
from xdsl.dialects.builtin import TensorType, f32, i32
from xdsl.ir import Block
from xdsl.utils.exceptions import VerifyException

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.target.chips import get_chip
from toptpu.dialects import top, tpu
from toptpu.dialects.common import dtype_name, elem_of, tensor
from toptpu.frontends import moe, moe_ops
from toptpu.frontends.fx_importer import import_module
from toptpu.frontends.tiny_models import tiny_model
from toptpu.passes.pipelines import run_passes, top_pipeline_passes, tpu_pipeline_passes

CHIP = get_chip("bm1684x")


def _moe_block(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    """Layer 0's MoE block of a tiny model of `family` (random weights)."""
    return tiny_model(family, seed=seed, layers=1).model.layers[0].mlp


def _stacked(block: torch.nn.Module) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fused block's experts as the nets read them: gate, up [E, I, H], down [E, H, I]."""
    gate_up = block.experts.gate_up_proj.detach().numpy()
    down = block.experts.down_proj.detach().numpy()
    inter = down.shape[2]
    return gate_up[:, :inter].copy(), gate_up[:, inter:].copy(), down


def _x(t: int, h: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_unnormalized", "qwen2_moe"])
def test_route_kernel_equals_transformers_router(family: str) -> None:
    """The router's weights and indices, as transformers' `*TopKRouter` gives them (top-k
    of the f32 softmax, renormalized when `norm_topk_prob`)."""
    block = _moe_block(family)
    x = _x(40)
    with torch.no_grad():
        logits, want_w, want_i = block.gate(x)
    shape = moe.moe_shape(block)
    assert shape.normalize == (family == "qwen3_moe")
    w, i = K.moe_route(logits.numpy(), None, shape.top_k, shape.normalize)
    assert i.dtype == np.int32 and w.dtype == np.float32
    assert np.array_equal(i, want_i.numpy())
    np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-6, atol=1e-7)
    if shape.normalize:
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    tw, ti = moe_ops.moe_route(logits, shape.top_k, shape.normalize, None)
    assert np.array_equal(ti.numpy(), i)
    np.testing.assert_allclose(tw.numpy(), w, rtol=1e-6, atol=1e-7)  # softmax: ulps apart


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_experts_kernel_equals_transformers_experts(family: str) -> None:
    block = _moe_block(family)
    x = _x(40)
    with torch.no_grad():
        _, w, i = block.gate(x)
        want = block.experts(x, i, w).numpy()
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    inter = down.shape[2]
    got = K.moe_experts(x.numpy(), gate_up[:, :inter].numpy(), gate_up[:, inter:].numpy(),
                        down.numpy(), w.numpy(), i.numpy().astype(np.int32))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    defined = moe_ops.moe_experts(x, gate_up, down, w, i.to(torch.int32)).numpy()
    np.testing.assert_allclose(got, defined, rtol=1e-5, atol=1e-6)  # numpy's and torch's
    # products round apart by ulps


def test_padded_rows_route_nowhere_and_add_nothing() -> None:
    block = _moe_block()
    x = _x(6)
    with torch.no_grad():
        logits = block.gate(x)[0].numpy()
    valid = np.array([1, 1, 1, 1, 0, 0], np.float32)
    w, i = K.moe_route(logits, valid, 2, True)
    assert (i[4:] == -1).all() and (w[4:] == 0).all() and (i[:4] >= 0).all()
    full_w, full_i = K.moe_route(logits, None, 2, True)
    assert np.array_equal(i[:4], full_i[:4]) and np.array_equal(w[:4], full_w[:4])
    gate, up, down = _stacked(block)
    y = K.moe_experts(x.numpy(), gate, up, down, w, i)
    assert (y[4:] == 0).all()
    real = K.moe_experts(x.numpy()[:4], gate, up, down, w[:4], i[:4])
    assert np.array_equal(y[:4], real)  # rows are independent: a slice gives the same bits


def test_experts_kernel_refuses_an_index_out_of_range() -> None:
    x = np.zeros((2, 4), np.float32)
    gate, down = np.zeros((3, 2, 4), np.float32), np.zeros((3, 4, 2), np.float32)
    w = np.ones((2, 1), np.float32)
    with pytest.raises(IndexError, match="index 3 is out of range for 3 experts"):
        K.moe_experts(x, gate, gate, down, w, np.array([[0], [3]], np.int32))
    with pytest.raises(IndexError, match="index -2"):
        K.moe_experts(x, gate, gate, down, w, np.array([[-2], [0]], np.int32))


def test_experts_in_parts_of_the_intermediate_axis() -> None:
    """Reduction parts over I (what a layer group cuts): each part's rows of gate and up
    and columns of down folded into the f32 accumulator give the whole op's numbers (to
    f32 rounding of the partial sums)."""
    block = _moe_block()
    x = _x(9)
    with torch.no_grad():
        _, w, i = block.gate(x)
    gate, up, down = _stacked(block)
    whole = K.moe_experts(x.numpy(), gate, up, down, w.numpy(), i.numpy())
    acc = None
    for p in range(4):  # I = 32 in 4 parts of 8
        rows = slice(8 * p, 8 * (p + 1))
        acc = K.moe_experts_part(acc, x.numpy(), gate[:, rows], up[:, rows], down[:, :, rows],
                                 w.numpy(), i.numpy())
    parts = K.moe_experts_finish(acc, np.float32, x.numpy())
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(parts, np.zeros_like(parts))


def test_route_ties_go_to_the_lower_expert() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    _, i = K.moe_route(logits, None, 2, False)
    assert i.tolist() == [[1, 2], [0, 1]]
    _, ti = moe_ops.moe_route(torch.from_numpy(logits), 2, False, None)
    assert ti.tolist() == [[1, 2], [0, 1]]


# --------------------------------------------------------------------------- verifiers


def _args(*types: TensorType) -> list:
    return list(Block(arg_types=types).args)


@pytest.mark.parametrize("shapes,message", [
    (((5, 8, 3), None), "logits is \\[5, 8, 3\\]; it must be \\[T, E\\]"),
    (((5, 8), None, 9), "k is 9; it must be from 1 to the 8 experts"),
    (((5, 8), (4,)), "valid"),
])
def test_route_verifier(shapes, message: str) -> None:
    logits_shape, valid_shape, *k = shapes
    types = [tensor(logits_shape, f32)] + ([tensor(valid_shape, f32)] if valid_shape else [])
    vals = _args(*types)
    with pytest.raises(VerifyException, match=message):
        top.MoeRouteOp(vals[0], vals[1] if valid_shape else None, k=k[0] if k else 2,
                       normalize=True)


@pytest.mark.parametrize("edit,message", [
    ({"gate": (4, 3, 7)}, "gate is \\[4, 3, 7\\]; it must be \\[E, I, 8\\]"),
    ({"up": (4, 2, 8)}, "up"),
    ({"down": (4, 8, 2)}, "down"),
    ({"weights": (6, 0)}, "weights is \\[6, 0\\]; it must be \\[6, k\\] with k at least 1"),
    ({"indices": (6, 3)}, "indices"),
    ({"index_type": f32}, "indices must be integers"),
])
def test_experts_verifier(edit: dict, message: str) -> None:
    shapes = {"x": (6, 8), "gate": (4, 3, 8), "up": (4, 3, 8), "down": (4, 8, 3),
              "weights": (6, 2), "indices": (6, 2)}
    shapes.update({k: v for k, v in edit.items() if k != "index_type"})
    index_type = edit.get("index_type", i32)
    vals = _args(*(tensor(s, index_type if n == "indices" else f32) for n, s in
                   shapes.items()))
    with pytest.raises(VerifyException, match=message):
        top.MoeExpertsOp(*vals)


def test_shapes_and_flops() -> None:
    x, g, u, dn, logits = _args(tensor((6, 8), f32), tensor((4, 3, 8), f32),
                                tensor((4, 3, 8), f32), tensor((4, 8, 3), f32),
                                tensor((6, 4), f32))
    route = top.MoeRouteOp(logits, None, k=2, normalize=False)
    assert [r.type for r in route.results] == [tensor((6, 2), f32), tensor((6, 2), i32)]
    experts = top.MoeExpertsOp(x, g, u, dn, route.weights, route.indices)
    assert experts.reduction_count() == 3 and experts.reduction_sliceable()
    assert experts.reduction_operand_axes() == (None, 1, 1, 2, None, None)
    assert experts.output.type == tensor((6, 8), f32)
    # the k chosen experts of each token only: gate/up 2*8*2*3, down 2*3*8, silu/gating and
    # the weighted sum (not all 4 experts)
    assert experts.flops() == 6 * 2 * (2 * 8 * 2 * 3 + 2 * 3 * 8 + 6 * 3 + 2 * 8)


# --------------------------------------------------------------------------- importer


class BlockNet(torch.nn.Module):
    """A MoE block as the splitter runs it (`frontends.moe.MoeMlp`), on [1, T, H] with
    the chunk's `valid` rows."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.moe = moe.MoeMlp(mlp)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.moe(x, valid)


class ListExperts(torch.nn.Module):
    """A block in transformers 4's form: the experts a list of SwiGLU MLPs, the router a
    linear, `top_k` and `norm_topk_prob` on the block."""

    class Mlp(torch.nn.Module):
        def __init__(self, h: int, i: int) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(h, i, bias=False)
            self.up_proj = torch.nn.Linear(h, i, bias=False)
            self.down_proj = torch.nn.Linear(i, h, bias=False)
            self.act_fn = torch.nn.SiLU()

    def __init__(self, fused: torch.nn.Module) -> None:
        super().__init__()
        e, two_i, h = fused.experts.gate_up_proj.shape
        i = two_i // 2
        self.top_k, self.norm_topk_prob = fused.gate.top_k, fused.gate.norm_topk_prob
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.gate.weight.data = fused.gate.weight.data.clone()
        self.experts = torch.nn.ModuleList(self.Mlp(h, i) for _ in range(e))
        for n, m in enumerate(self.experts):
            m.gate_proj.weight.data = fused.experts.gate_up_proj.data[n, :i].clone()
            m.up_proj.weight.data = fused.experts.gate_up_proj.data[n, i:].clone()
            m.down_proj.weight.data = fused.experts.down_proj.data[n].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers 4's loop: each token's k experts weighted by the router."""
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for j in range(self.top_k):
                m = self.experts[int(idx[t, j])]
                h = m.down_proj(m.act_fn(m.gate_proj(flat[t])) * m.up_proj(flat[t]))
                out[t] += w[t, j] * h
        return out.reshape(x.shape)


def _import_block(mlp: torch.nn.Module, t: int = 12, n_valid: int = 9):
    x = _x(t)[None]
    valid = (torch.arange(t) < n_valid).float()[None]
    net = BlockNet(mlp).eval()
    module, store = import_module(net, (x, valid), input_names=["x", "valid"],
                                  output_names=["y"])
    with torch.no_grad():
        ref = mlp(x)[0].numpy()
    return module, store, {"x": x.numpy(), "valid": valid.numpy()}, ref, n_valid


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_unnormalized", "qwen2_moe"])
def test_importer_maps_transformers_block_to_the_two_ops(family: str) -> None:
    """transformers' block (fused 3-D experts; Qwen2-MoE's shared expert as ordinary ops)
    imports to one moe_route and one moe_experts reading the module's stacked tensors;
    Top equals the block on the real rows, before and after top-pipeline, and a padded
    row's experts add nothing."""
    block = _moe_block(family)
    module, store, feeds, ref, n = _import_block(block)
    module.verify()
    names = [op.name for op in module.walk()]
    assert names.count("top.moe_route") == 1 and names.count("top.moe_experts") == 1
    (experts,) = [op for op in module.walk() if isinstance(op, top.MoeExpertsOp)]
    for operand, name in ((experts.gate, "gate_proj"), (experts.up, "up_proj"),
                          (experts.down, "down_proj")):
        assert top.weight_name(operand) == f"moe.mlp.experts.{name}"
    gate, up, down = _stacked(block)
    assert np.array_equal(store["moe.mlp.experts.gate_proj"], gate)
    assert np.array_equal(store["moe.mlp.experts.up_proj"], up)
    (route,) = [op for op in module.walk() if isinstance(op, top.MoeRouteOp)]
    assert route.valid is not None
    got = Interpreter(module, store).run(feeds).outputs["y"][0]
    np.testing.assert_allclose(got[:n], ref[:n], rtol=1e-5, atol=1e-6)
    run_passes(module, top_pipeline_passes(), store=store)
    after = Interpreter(module, store).run(feeds).outputs["y"][0]
    np.testing.assert_allclose(after[:n], ref[:n], rtol=1e-5, atol=1e-6)
    if family != "qwen2_moe":  # no shared expert: a padded row is exactly 0
        assert (after[n:] == 0).all()


def test_importer_stacks_a_list_of_expert_modules() -> None:
    """transformers 4's form (a ModuleList of experts): one moe_experts on the experts'
    weights stacked once, under the fused module's names, equal to the fused block."""
    fused = _moe_block("qwen3_moe")
    listed = ListExperts(fused).eval()
    assert moe.moe_shape(listed) == moe.MoeShape(8, 2, True, 64, 32, False, False)
    module, store, feeds, ref, n = _import_block(listed)
    (experts,) = [op for op in module.walk() if isinstance(op, top.MoeExpertsOp)]
    for operand, want in zip((experts.gate, experts.up, experts.down), _stacked(fused),
                             strict=True):
        name = top.weight_name(operand)
        assert name is not None and name.startswith("moe.mlp.experts.")
        np.testing.assert_array_equal(store[name], want)
    got = Interpreter(module, store).run(feeds).outputs["y"][0]
    np.testing.assert_allclose(got[:n], ref[:n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attr,message", [("has_bias", "has_bias"),
                                          ("is_transposed", "is_transposed")])
def test_experts_toptpu_cannot_compute_are_named(attr: str, message: str) -> None:
    block = _moe_block()
    setattr(block.experts, attr, True)
    with pytest.raises(moe.MoeError, match=message):
        moe.moe_shape(block)


# --------------------------------------------------------------------------- Tpu, machine


@pytest.mark.parametrize("mode", ["f32", "bf16"])
def test_tpu_interpreter_and_machine(mode: str) -> None:
    """convert-top-to-tpu: both ops compute in f32, the router's indices stay i32; the
    machine gives the Tpu interpreter's bits."""
    from toptpu.backend.runtime.simulate import simulate
    from toptpu.machine_pipeline import compile_for_machine

    module, store, feeds, ref, n = _import_block(_moe_block("qwen2_moe"))
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    module.verify()
    (experts,) = [op for op in module.walk() if isinstance(op, tpu.MoeExpertsOp)]
    (route,) = [op for op in module.walk() if isinstance(op, tpu.MoeRouteOp)]
    assert dtype_name(experts.attributes["compute"]) == "f32"
    assert dtype_name(route.attributes["compute"]) == "f32"
    assert dtype_name(elem_of(route.indices)) == "i32"
    if mode == "bf16":
        feeds = {k: v.astype(K.BF16) for k, v in feeds.items()}
    want = Interpreter(module, store).run(feeds).outputs["y"]
    got_ref = want[0].astype(np.float32)[:n]
    if mode == "f32":
        np.testing.assert_allclose(got_ref, ref[:n], rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(got_ref, ref[:n], rtol=5e-2, atol=5e-2)
    program = compile_for_machine(module, CHIP)
    got = simulate(program, store, feeds, CHIP).outputs["y"]
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


# --------------------------------------------------------------------------- checkpoints


def test_hub_layout_shapes_and_assembly() -> None:
    """`save_pretrained`'s one tensor per expert and projection: the fused shapes the
    module holds (what the checkpoint is checked against), each stacked tensor the nets
    read made exactly from either form, and a missing expert named."""
    block = _moe_block()
    gate, up, down = _stacked(block)
    fused = block.experts.gate_up_proj.detach().numpy()
    hub = {}
    for e in range(8):
        hub[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate[e]
        hub[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = up[e]
        hub[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    shapes, problems = moe.stacked_shapes({k: v.shape for k, v in hub.items()})
    assert problems == []
    assert shapes == {"model.layers.0.mlp.experts.gate_up_proj": fused.shape,
                      "model.layers.0.mlp.experts.down_proj": down.shape}
    fused_source = {"model.layers.0.mlp.experts.gate_up_proj": fused,
                    "model.layers.0.mlp.experts.down_proj": down}
    base = "model.layers.0.mlp.experts."
    for source in (hub, fused_source):
        for name, want in (("gate_proj", gate), ("up_proj", up), ("down_proj", down),
                           ("gate_up_proj", fused)):
            assert moe.has_expert_tensor(base + name, source.__contains__)
            got = moe.expert_tensor(base + name, source.__contains__, source.__getitem__)
            assert got is not None and np.array_equal(got, want), name
    assert moe.expert_tensor(base + "other", hub.__contains__, hub.__getitem__) is None
    del hub["model.layers.0.mlp.experts.5.up_proj.weight"]
    _, problems = moe.stacked_shapes({k: v.shape for k, v in hub.items()})
    assert problems == ["missing expert tensors: model.layers.0.mlp.experts.5.up_proj.weight"]


def _saved(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    from llm_fixtures import tiny_dir

    return tiny_dir(tmp_path_factory, family)


def test_save_pretrained_writes_one_tensor_per_expert(tmp_path_factory) -> None:
    from toptpu.frontends.hf_loader import checkpoint_shapes

    shapes = checkpoint_shapes(_saved(tmp_path_factory, "qwen3_moe"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in shapes
    assert "model.layers.0.mlp.experts.gate_up_proj" not in shapes


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path_factory, tmp_path) -> None:
    """A checkpoint with one expert's tensor gone: one line naming it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from toptpu.frontends.hf_loader import ModelLoadError
    from toptpu.frontends.streaming import load_streaming

    d = tmp_path / "broken"
    shutil.copytree(_saved(tmp_path_factory, "qwen3_moe"), d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing expert tensors: "
                       "model.layers.1.mlp.experts.3.down_proj.weight"):
        load_streaming(str(d))


def test_streamed_layer_assembles_the_hub_layout(tmp_path_factory) -> None:
    """The streaming compile's skeleton layer and every layer's stacked experts equal what
    transformers loads from the same directory (which converts the hub layout itself)."""
    from llm_fixtures import hf_model

    from toptpu.frontends.streaming import load_streaming

    path = _saved(tmp_path_factory, "qwen3_moe")
    loaded = load_streaming(path)
    ref = hf_model(path)
    for layer in (0, 1):
        get = loaded.stream.float_of(layer)
        gate, up, down = _stacked(ref.model.layers[layer].mlp)
        for key, want in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            assert np.array_equal(get("layer.mlp.experts." + key), want), (layer, key)
    # the skeleton's stacked experts are placeholders (zero pages) until filled, as the
    # embedding's are; filled, they are transformers' tensors
    experts = loaded.model.model.layers[0].mlp.experts
    assert not experts.gate_up_proj.any() and not experts.down_proj.any()
    loaded.stream.fill_placeholders(loaded.model)
    skel = loaded.model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(skel, ref.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(experts.down_proj, ref.model.layers[0].mlp.experts.down_proj)


# --------------------------------------------------------------------------- generation

FAMILIES = ["qwen3_moe", "qwen3_moe_unnormalized", "qwen2_moe"]


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["machine", "interpreter"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(tmp_path_factory, family: str,
                                               executor: str) -> None:
    """f32, a prompt of three prefill chunks (block, then block_kv twice, the last one
    padded), 32 decode steps: the tokens of transformers' `generate` on the directory
    `save_pretrained` wrote (one tensor per expert), then a second turn on the caches."""
    from toptpu.backend.runtime.runtime import Runtime

    built = compiled(tmp_path_factory, family)
    rt = Runtime.open(built.model_file, executor)
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L and len(ids) % rt.L  # the last chunk has padded rows
    res = rt.generate(ids, 32)
    assert len(res.generated_ids) == 32
    assert res.generated_ids == hf_generate(built.model_dir, ids, 32)
    ids2 = rt.encode(" What is the capital of France?", add_special_tokens=False)
    res2 = rt.generate(ids2, 32, keep_history=True)
    assert res2.generated_ids == hf_generate(built.model_dir, ids + res.generated_ids + ids2,
                                             32)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_machine_equals_interpreter_bit_for_bit(tmp_path_factory, family: str) -> None:
    from toptpu.backend.runtime.runtime import Runtime

    built = compiled(tmp_path_factory, family)
    machine = Runtime.open(built.model_file, "machine")
    interp = Runtime.open(built.model_file, "interpreter")
    ids = machine.encode(LONG_PROMPT)
    a, b = machine.prompt_logits(ids), interp.prompt_logits(ids)
    assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.slow
def test_model_file_from_the_command_line(tmp_path_factory) -> None:
    """`toptpu compile` then `toptpu run` on the machine: the tokens of transformers."""
    import subprocess
    import sys

    from toptpu.backend.runtime.runtime import Runtime

    built = compiled(tmp_path_factory, "qwen2_moe")
    out = os.path.join(shared_dir(tmp_path_factory), "qwen2_moe-cli.toptpu")
    cli = [sys.executable, "-m", "toptpu.cli"]
    subprocess.run([*cli, "compile", built.model_dir, "-o", out, "-q", "f32",
                    "--seq-length", "160", "--max-input-length", "16"], check=True,
                   capture_output=True)
    rt = Runtime.open(out, "machine")
    ids = rt.encode(LONG_PROMPT)
    assert rt.generate(ids, 32).generated_ids == hf_generate(built.model_dir, ids, 32)


def _real_dir(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    """A model of `family`'s published shape (`tiny_models.qwen3_moe_real_config`,
    `qwen2_moe_real_config`: hidden 2048, the real heads, expert widths and top-k; experts,
    layers and vocabulary cut), saved by `save_pretrained` once per session."""
    from filelock import FileLock
    from transformers import GenerationConfig

    from toptpu.frontends import tiny_models as tm
    from toptpu.frontends.hf_loader import quiet_transformers

    path = os.path.join(shared_dir(tmp_path_factory), f"{family}-real")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            config = (tm.qwen3_moe_real_config() if family == "qwen3_moe"
                      else tm.qwen2_moe_real_config())
            model = tm.tiny_model(config=config)
            tok = tm.build_tokenizer(model.config.vocab_size)
            model.generation_config = GenerationConfig(
                eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>")],
                pad_token_id=tok.pad_token_id, do_sample=False)
            with quiet_transformers():
                model.save_pretrained(path)
                tok.save_pretrained(path)
            open(os.path.join(path, "done"), "w").close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_published_shapes_equal_transformers(tmp_path_factory, family: str) -> None:
    """At the published widths (Qwen3-30B-A3B: 16 of its 128 experts of 768, top-8;
    Qwen1.5-MoE-A2.7B: 8 of its 60 experts of 1408, top-4, a shared expert of 5632) the
    experts (100 MB and more per layer in f32) do not fit local memory: layer-group cuts
    their intermediate axis in reduction parts. 32 greedy tokens on the machine after a
    prompt of three chunks equal transformers' `generate`."""
    from filelock import FileLock

    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model

    model_dir = _real_dir(tmp_path_factory, family)
    path = os.path.join(shared_dir(tmp_path_factory), f"{family}-real-f32.toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode="f32", seq_length=160, max_input_length=16,
                          progress=None)
    rt = Runtime.open(path, "machine")
    ids = rt.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L
    res = rt.generate(ids, 32, stop_on_eos=False)
    assert res.generated_ids == hf_generate(model_dir, ids, 32)


def test_tensor_parallel_is_refused_for_experts(tmp_path_factory) -> None:
    from toptpu.compiler import CompileError
    from toptpu.compiler import compile as compile_model

    model_dir = _saved(tmp_path_factory, "qwen3_moe")
    out = os.path.join(shared_dir(tmp_path_factory), "never-written.toptpu")
    with pytest.raises(CompileError, match="is a mixture of experts, whose experts toptpu "
                       "does not cut over devices by tensor parallelism; use --parallel ep or pp"):
        compile_model(model_dir, out, mode="f32", seq_length=64, max_input_length=16,
                      progress=None, devices=2, parallel="tp")
    assert not os.path.exists(out)


@pytest.mark.slow
def test_pipeline_parallel_gives_the_one_device_tokens(tmp_path_factory) -> None:
    from toptpu.backend.runtime.runtime import Runtime

    one = compiled(tmp_path_factory, "qwen3_moe")
    two = compiled(tmp_path_factory, "qwen3_moe", devices=2, parallel="pp")
    ids = Runtime.open(one.model_file).encode(LONG_PROMPT)
    want = Runtime.open(one.model_file).generate(ids, 32).generated_ids
    assert Runtime.open(two.model_file).generate(ids, 32).generated_ids == want


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_pipeline_parallel_up_to_eight_devices(tmp_path_factory, devices: int) -> None:
    """An 8-layer tiny Qwen3-MoE over 4 and 8 BM1684X (LLM-TPU deploys a 35B-A3B over 7):
    every device holds its contiguous layers (8 devices: one each), and 32 greedy tokens
    after a prompt of three chunks equal the one-device file's and transformers'."""
    from toptpu.backend.formats.llm_file import LlmFile
    from toptpu.backend.runtime.runtime import Runtime

    one = compiled(tmp_path_factory, "qwen3_moe", layers=8)
    spread = compiled(tmp_path_factory, "qwen3_moe", layers=8, devices=devices,
                      parallel="pp")
    par = LlmFile(spread.model_file).meta.parallel
    assert par is not None and len(par.devices) == devices
    assert all(len(d.layers) > 0 for d in par.devices)
    assert [i for d in par.devices for i in d.layers] == list(range(8))
    ids = Runtime.open(one.model_file).encode(LONG_PROMPT)
    want = Runtime.open(one.model_file).generate(ids, 32, stop_on_eos=False).generated_ids
    ref = hf_generate(one.model_dir, ids, 32)  # (transformers stops at eos)
    assert ref and want[:len(ref)] == ref
    assert len(ref) == 32 or ref[-1] in Runtime.open(one.model_file).eos_ids
    got = Runtime.open(spread.model_file).generate(ids, 32, stop_on_eos=False)
    assert got.generated_ids == want


@pytest.mark.slow
def test_an_in_memory_model_compiles_from_its_fused_experts(tmp_path) -> None:
    """A transformers model object (its experts fused 3-D parameters, no checkpoint): every
    layer's gate, up and down cut from them; 32 greedy tokens equal its `generate`."""
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.tiny_models import build_tokenizer

    model = tiny_model("qwen3_moe_unnormalized", seed=3)
    tok = build_tokenizer(model.config.vocab_size)
    out = str(tmp_path / "m.toptpu")
    compile_model(model, out, tokenizer=tok, mode="f32", seq_length=96, max_input_length=16,
                  progress=None)
    rt = Runtime.open(out, "machine")
    ids = rt.encode(LONG_PROMPT)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert rt.generate(ids, 32, stop_on_eos=False).generated_ids == want


@pytest.mark.parametrize("mode", ["w8bf16", "w4f16"])
def test_the_router_stays_float_in_weight_only_modes(mode: str) -> None:
    """The router's linear keeps a float weight (its logits choose the experts); the shared
    expert's linears are quantized as usual."""
    module, store, _, _, _ = _import_block(_moe_block("qwen2_moe"))
    run_passes(module, tpu_pipeline_passes(mode, group_size=32), store=store)
    (route,) = [op for op in module.walk() if isinstance(op, tpu.MoeRouteOp)]
    router = route.logits.owner
    assert isinstance(router, tpu.MatMulOp), type(router)
    assert dtype_name(elem_of(router.rhs)) == mode[2:]
    assert any(isinstance(op, tpu.A16MatMulOp) for op in module.walk())


# --------------------------------------------------------------------------- indexed fetch


def _fetch_run(block: torch.nn.Module, t: int, n_valid: int, h: int = 64, mode: str = "f32",
               group: int | None = None, grouped: bool = False):
    """The block's Tpu net in `mode` (`group`: its group size) for `t` rows (`n_valid`
    real) run on a checked machine: the program, the machine (its `fetched` records), the
    router's indices per row (the kernel on Top's router logits) and the machine's and
    the interpreter's results (`grouped`: and the interpreter's on the grouped net the
    machine ran, its slices and parts in the machine's order)."""
    from toptpu.backend.runtime.machine import Machine
    from toptpu.backend.runtime.simulate import simulate
    from toptpu.machine_pipeline import compile_for_machine

    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3))[None]
    valid = (torch.arange(t) < n_valid).float()[None]
    module, store = import_module(BlockNet(block).eval(), (x, valid),
                                  input_names=["x", "valid"], output_names=["y"])
    activations = mode[2:] if mode.startswith("w") else mode  # w4bf16: bf16
    act = {"f32": np.float32, "f16": np.float16, "bf16": K.BF16}[activations]
    feeds = {"x": x.numpy().astype(act), "valid": valid.numpy().astype(act)}
    run_passes(module, tpu_pipeline_passes(mode, **({} if group is None else
                                                     {"group_size": group})), store=store)
    want = Interpreter(module, store).run(feeds).outputs["y"]
    program = compile_for_machine(module, CHIP)
    machine = Machine(CHIP, checked=True)
    got = simulate(program, store, feeds, CHIP, machine=machine).outputs["y"]
    results: tuple[np.ndarray, ...] = (got, want)
    if grouped:  # compile_for_machine grouped `module` in place
        results = (got, want, Interpreter(module, store).run(feeds).outputs["y"])
    with torch.no_grad():
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
        _, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float32),
                            block.gate.top_k, dim=-1)
    return program, machine, idx[:n_valid].numpy(), results


def _expert_bytes(block: torch.nn.Module) -> dict[str, int]:
    """Bytes of one expert of each stacked projection (f32)."""
    e, two_i, h = block.experts.gate_up_proj.shape
    one = two_i // 2 * h * 4
    return {"gate_proj": one, "up_proj": one, "down_proj": one}


def _fetched_per_expert(machine, names: dict[str, int]) -> dict[str, dict[int, int]]:
    """Bytes the machine read per projection and expert, from its indexed loads."""
    out: dict[str, dict[int, int]] = {n: {} for n in names}
    for f in machine.fetched:
        proj = str(f.tensor.name).rsplit(".", 1)[-1]
        per_row = f.nbytes // len(f.rows) if f.rows else 0
        for r in f.rows:
            out[proj][r] = out[proj].get(r, 0) + per_row
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_decode_step_fetches_the_selected_experts_only(family: str) -> None:
    """A decode step (one token): the experts' loads are indexed loads by the router's
    indices; the machine reads exactly the k chosen experts of each projection from
    global memory (k x an expert's bytes, never the other E - k), the program's modelled
    bytes are those k experts', and the result is the interpreter's bit for bit."""
    block = _moe_block(family)
    program, machine, idx, (got, want) = _fetch_run(block, t=1, n_valid=1)
    assert np.array_equal(got, want)
    k = block.gate.top_k
    chosen = sorted(int(i) for i in idx[0])
    assert len(chosen) == k
    per_expert = _expert_bytes(block)
    fetched = _fetched_per_expert(machine, per_expert)
    for proj, one in per_expert.items():
        assert sorted(fetched[proj]) == chosen, proj
        assert all(b == one for b in fetched[proj].values()), proj
    assert sum(f.nbytes for f in machine.fetched) == k * sum(per_expert.values())
    indexed = [c for c in program.commands if getattr(c, "index", None) is not None]
    assert len(indexed) == 3  # gate, up, down: whole (the tiny experts fit)
    assert sum(c.nbytes for c in indexed) == k * sum(per_expert.values())
    # the experts' local buffers hold the k experts a step fetches, not all E
    e = block.experts.gate_up_proj.shape[0]
    assert k < e
    assert sum(c.all_nbytes for c in indexed) == e * sum(per_expert.values())
    assert sum(c.local.nbytes for c in indexed) == k * sum(per_expert.values())


def test_a_prefill_chunk_loads_each_chosen_expert_once() -> None:
    """A prefill chunk of 12 rows, 9 real: the experts some real token chose are read
    once each (their bytes once, whatever how many tokens chose them); an expert only
    padded rows would pick, or none, is not read."""
    block = _moe_block("qwen3_moe")
    _, machine, idx, (got, want) = _fetch_run(block, t=12, n_valid=9)
    assert np.array_equal(got, want)
    chosen = sorted({int(i) for i in idx.reshape(-1)})
    per_expert = _expert_bytes(block)
    fetched = _fetched_per_expert(machine, per_expert)
    for proj, one in per_expert.items():
        assert sorted(fetched[proj]) == chosen, proj
        assert all(b == one for b in fetched[proj].values()), proj


@pytest.mark.slow
def test_experts_in_reduction_parts_are_fetched_by_index() -> None:
    """Experts too large for local memory (16 of 2048 x 256 f32: 100 MB; a decode step's
    4 of them 25 MB, more than local memory even in the buffers of the fetched experts)
    stream through it in reduction parts of I: each part's load is an indexed load; a
    decode step reads exactly each chosen expert's bytes once over the parts, a prefill
    chunk each chosen expert once. The parts sum I in another order than the
    interpreter's whole op, so the results agree to f32 rounding."""
    block = tiny_model("qwen3_moe", layers=1, hidden_size=256, moe_intermediate_size=2048,
                       num_experts=16, num_experts_per_tok=4).model.layers[0].mlp
    for t, n_valid in ((1, 1), (8, 6)):
        program, machine, idx, (got, want) = _fetch_run(block, t=t, n_valid=n_valid, h=256)
        np.testing.assert_allclose(got[0, :n_valid], want[0, :n_valid], rtol=1e-4,
                                   atol=1e-5)
        indexed = [c for c in program.commands if getattr(c, "index", None) is not None]
        assert len(indexed) > 3  # parts
        chosen = sorted({int(i) for i in idx.reshape(-1)})
        per_expert = _expert_bytes(block)
        fetched = _fetched_per_expert(machine, per_expert)
        for proj, one in per_expert.items():
            assert sorted(fetched[proj]) == chosen, (t, proj)
            assert all(b == one for b in fetched[proj].values()), (t, proj)
        if t == 1:
            assert sum(c.nbytes for c in indexed) == 4 * sum(per_expert.values())


def test_profile_shows_the_experts_fetched() -> None:
    """`profile`'s numbers of a decode step: the bytes its indexed loads moved (the k
    chosen experts) beside those of every expert, a line in the summary; the run's
    timeline moves those bytes and the roofline's own bytes count only them."""
    from toptpu.backend.runtime.machine import LoadedNet
    from toptpu.backend.runtime.profile import profile_timeline, summary_table

    block = _moe_block("qwen3_moe")
    program, machine, _, _ = _fetch_run(block, t=1, n_valid=1)
    fetched = sum(f.nbytes for f in machine.fetched)
    modelled, every = program.indexed_bytes()
    e, k = block.experts.gate_up_proj.shape[0], block.gate.top_k
    assert fetched == modelled and every == fetched * e // k
    tl = machine.timeline_of_run(LoadedNet(program))
    assert tl.dma_bytes == sum(c.nbytes for c in program.commands if c.engine == "dma")
    whole = sum(w.nbytes for w in program.weights.values())
    assert program.inherent_bytes() == whole - every + modelled + sum(
        t.nbytes for t in (*program.inputs, *program.outputs))
    p = profile_timeline(tl, CHIP, program.inherent_bytes(), program.flops,
                         (fetched, every))
    assert (p.fetched_bytes, p.fetched_all_bytes) == (fetched, every)
    assert (f"experts fetched by index {fetched / 1e6:.2f} MB a run"
            in summary_table([p], CHIP))


def test_a_prefill_runs_timeline_moves_the_experts_it_read() -> None:
    """A prefill chunk's command streams model the expected distinct experts (12 rows of
    top-2 among 8: 8 * (1 - (3/4)^12)); the machine's run is timed with the experts its
    tokens really chose."""
    from toptpu.backend.runtime.machine import LoadedNet
    from toptpu.backend.target.cost import expected_distinct

    block = _moe_block("qwen3_moe")
    program, machine, idx, _ = _fetch_run(block, t=12, n_valid=9)
    indexed = [c for c in program.commands if getattr(c, "index", None) is not None]
    assert expected_distinct(8, 12, 2) == pytest.approx(8 * (1 - 0.75 ** 12))
    for c in indexed:
        assert c.nbytes == round(expected_distinct(8, 12, 2) * c.row_nbytes)
    others = sum(c.nbytes for c in program.commands if c.engine == "dma" and c not in indexed)
    fetched = sum(f.nbytes for f in machine.fetched)
    assert fetched == len({int(i) for i in idx.reshape(-1)}) * sum(
        c.row_nbytes for c in indexed)
    assert machine.timeline_of_run(LoadedNet(program)).dma_bytes == others + fetched
