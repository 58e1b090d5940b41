"""convert-top-to-tpu on real decoder layers: every mode against Top (ARCHITECTURE.md thresholds),
quantization checked against an independent torch computation, and `--compare-all`
naming the op a broken lowering breaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.compare import IRStage, compare_stages, tpu_threshold
from toptpu.dialects import top, tpu
from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.frontends.hf_layers import import_decoder_layer
from toptpu.metrics import similarity
from toptpu.passes.convert_top_to_tpu import ConversionError
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
from toptpu.passes.quantize import QuantizationError, quantize_rtn

_CACHE: dict[str, tuple] = {}


def _top_layer(tiny_models, family: str):
    if family not in _CACHE:
        imp = import_decoder_layer(tiny_models(family), 16, mask_value=-10000.0)
        _CACHE[family] = (imp.module, imp.store, imp.feeds,
                          Interpreter(imp.module, imp.store).run(imp.feeds).outputs["out"])
    return _CACHE[family]


def _lower(module, store, mode: str, **kw):
    m = module.clone()
    run_passes(m, tpu_pipeline_passes(mode, **kw), store=store)
    return m


@pytest.mark.parametrize("mode", QuantMode.names())
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_every_mode_meets_its_threshold(tiny_models, family: str, mode: str) -> None:
    module, store, feeds, ref = _top_layer(tiny_models, family)
    low = _lower(module, store, mode)
    names = {op.name for op in low.walk()}
    assert not any(n.startswith("top.") for n in names)
    if mode.startswith(("w4", "w8")):
        assert "tpu.a16_matmul" in names and "tpu.matmul" not in names
    out = Interpreter(low, store).run(feeds).outputs["out"]
    act = QuantMode(mode).activation
    assert out.dtype == {"f32": np.float32, "f16": np.float16}.get(act, out.dtype)
    cos = similarity(out.astype(np.float32), ref).cosine
    assert cos >= tpu_threshold(mode), f"{family} {mode}: cosine {cos}"


@pytest.mark.parametrize("mode", ["w4f32", "w8f32"])
def test_f32_activation_modes_equal_top_on_dequantized_weights(tiny_models, mode: str) -> None:
    module, store, feeds, _ = _top_layer(tiny_models, "qwen2")
    low = _lower(module, store, mode)
    # rebuild each quantized matmul's float weight from the stored integers and scales
    deq = WeightStore.from_arrays({n: store[n] for n in store.names()})
    for op in low.walk():
        if isinstance(op, tpu.A16MatMulOp):
            parts = {}
            for v in (op.qweight, op.scales, op.zeros):
                if v is not None:
                    w = v.owner
                    assert isinstance(w, tpu.WeightOp)
                    parts[w.part.data] = store[w.tensor_name]
                    source = w.source.data
            deq[source] = K.dequantize(parts["qweight"], parts["scales"], parts.get("zeros"),
                                       op.weight_bits.value.data, op.group_size.value.data)
            assert not np.array_equal(deq[source], store[source])  # really quantized
    ref = Interpreter(module, deq).run(feeds).outputs["out"]
    out = Interpreter(low, store).run(feeds).outputs["out"]
    assert similarity(out, ref).cosine >= 0.99999


def _torch_fake_quant(w: torch.Tensor, bits: int, gs: int, sym: bool) -> torch.Tensor:
    """Independent reference: fake quantization with torch ops."""
    n, k = w.shape
    g = w.reshape(n, k // gs, gs)
    if sym:
        half = 127 if bits == 8 else 7
        s = g.abs().amax(-1, keepdim=True) / half
        q = torch.clamp(torch.round(g / s), -half if bits == 8 else -8, half)
        return (q * s).reshape(n, k)
    lo = torch.clamp(g.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(g.amax(-1, keepdim=True), min=0)
    qmax = 2**bits - 1
    s = (hi - lo) / qmax
    z = torch.clamp(torch.round(-lo / s), 0, qmax)
    q = torch.clamp(torch.round(g / s) + z, 0, qmax)
    return ((q - z) * s).reshape(n, k)


@pytest.mark.parametrize("bits,gs,sym", [
    (4, 32, False), (4, 32, True), (4, 96, False),  # group size = K
    (4, -1, False), (4, -1, True),  # per channel
    (8, -1, True), (8, -1, False),
])
def test_packing_and_dequantization_match_torch(bits: int, gs: int, sym: bool) -> None:
    rng = np.random.default_rng(bits * 100 + gs)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    w[3] = 0.0  # an all-zero row must not divide by zero
    qw = quantize_rtn(w, bits, gs, sym, np.dtype(np.float32))
    eff_gs = 96 if gs == -1 or bits == 8 else gs
    assert qw.group_size == eff_gs
    if bits == 4:
        assert qw.qweight.dtype == np.uint8 and qw.qweight.shape == (24, 48)
        # two nibbles per byte, k = 2j in the low nibble
        unpacked = K.unpack_int4(qw.qweight)
        assert np.array_equal(qw.qweight, (unpacked[:, 0::2] | (unpacked[:, 1::2] << 4)))
    else:
        assert qw.qweight.dtype == (np.int8 if sym else np.uint8)
    assert (qw.zeros is None) == (sym)
    ours = K.dequantize(qw.qweight, qw.scales, qw.zeros, bits, eff_gs)
    ref = _torch_fake_quant(torch.from_numpy(w), bits, eff_gs, sym).numpy()
    np.testing.assert_allclose(ours, np.nan_to_num(ref), rtol=1e-6, atol=1e-6)
    # and the kernel multiplies by exactly these weights
    x = rng.standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_allclose(K.a16_matmul(x, qw.qweight, qw.scales, qw.zeros, None, bits,
                                            eff_gs), x @ ours.T, rtol=1e-5, atol=1e-5)


def test_bad_group_size_and_mode_are_clear_errors(tiny_models) -> None:
    module, store, _, _ = _top_layer(tiny_models, "qwen2")
    with pytest.raises(ConversionError, match="group size 48 does not divide.*K=64"):
        _lower(module, store, "w4bf16", group_size=48)
    with pytest.raises(ConversionError, match="unknown quantization mode 'int4'"):
        _lower(module, store, "int4")
    with pytest.raises(QuantizationError):
        quantize_rtn(np.ones((4, 4), np.float32), 3, -1, True, np.dtype(np.float32))


def test_compare_all_names_the_op_a_broken_lowering_breaks(tiny_models, monkeypatch) -> None:
    module, store, feeds, _ = _top_layer(tiny_models, "qwen2")
    good = _lower(module, store, "bf16")
    rep = compare_stages(IRStage("top", module, store), IRStage("tpu", good, store), feeds,
                         0.99, True)
    assert rep.ok and rep.first_drop is None
    # a deliberately broken lowering: silu lowered to sigmoid
    monkeypatch.setitem(tpu.TPU_OF_TOP, top.SiluOp, tpu.SigmoidOp)
    bad = _lower(module, store, "bf16")
    rep = compare_stages(IRStage("top", module, store), IRStage("tpu", bad, store), feeds,
                         0.99, True)
    assert not rep.ok
    assert rep.first_drop is not None and rep.first_drop.name == "layer.mlp.act_fn.silu"
    assert "first tensor below threshold: layer.mlp.act_fn.silu" in rep.table()


@pytest.mark.slow  # runs toptpu compare in a process
def test_compare_cli_dumps_npz(tmp_path) -> None:
    from helpers import run_tool

    res = run_tool("toptpu", "compare", "-q", "w8bf16", "--compare-all", "--dump",
                   str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "tpu-w8bf16 vs top" in res.stdout and "PASS" in res.stdout
    data = np.load(tmp_path / "top-vs-tpu" / "tpu-w8bf16.npz")
    assert "output:hidden_out" in data.files and "layer.mlp.act_fn.silu" in data.files
    assert (tmp_path / "torch-vs-top" / "report.json").exists()
