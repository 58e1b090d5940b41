"""Layer groups of 2-D tiles (issue 32): one weight matmul sliced along its token rows and its
output channels at once, where neither a rows slice (the weight resident) nor a cols slice
(the activation resident) fits local memory. The tiles are visible in the IR, codegen emits
every tile's loads, compute and store, and the machine (checked and fast) gives the bytes
of the interpreter running the same grouped IR; against the ungrouped IR the numbers are
the same sums over the same K (BLAS may round another way per shape, as for any slicing)."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import assume, example, given
from hypothesis import strategies as st

from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.dialects import tpu
from toptpu.dialects.common import QuantMode, i64_array, numpy_dtype, read_ints
from toptpu.dialects.ir_text import parse_ir, print_generic
from toptpu.dialects.weight_store import WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.layer_group import LayerGroupError, LayerGroupPass, plan_span
from toptpu.passes.lmem import LocalMemoryError, verify_group
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
from toptpu.passes.slicing import SliceKind

GROUP = 32


def tiny_chip(name: str, lane_bytes: int) -> Chip:
    """A preset with two lanes of `lane_bytes` and cheap latencies: tiny shapes need tiles."""
    return replace(get_chip(name), lanes=2, lane_bytes=lane_bytes, dma_latency_cycles=8,
                   compute_latency_cycles=4)


def matmul_text(m: int, n: int, k: int, weights: str, bias: bool = False,
                silu: bool = True) -> str:
    """Top IR of x[1, m, k] @ W[n, k]^T (+ b), followed by a silu (the matmul's result is
    then not the function's), its weights in the store `weights`."""
    xt, wt, yt, bt = (f"tensor<1x{m}x{k}xf32>", f"tensor<{n}x{k}xf32>",
                      f"tensor<1x{m}x{n}xf32>", f"tensor<{n}xf32>")
    b_def = f'%b = "top.weight"() {{name = "fc.bias"}} : () -> {bt}' if bias else ""
    b_use, b_type, seg = (", %b", f", {bt}", "1, 1, 1") if bias else ("", "", "1, 1, 0")
    attrs = f"transpose_b = true, operandSegmentSizes = array<i32: {seg}>"
    return f'''builtin.module attributes {{top.weight_store = "{weights}"}} {{
  func.func @main(%x: {xt}) -> {yt} {{
    %w = "top.weight"() {{name = "fc.weight"}} : () -> {wt}
    {b_def}
    %y = "top.matmul"(%x, %w{b_use}) {{{attrs}}} : ({xt}, {wt}{b_type}) -> {yt}
    {'%z = "top.silu"(%y) : (' + yt + ') -> ' + yt if silu else ''}
    func.return {'%z' if silu else '%y'} : {yt}
  }}
}}'''


def matmul_module(m: int, n: int, k: int, mode: str, seed: int = 0, bias: bool = False,
                  silu: bool = True) -> tuple:
    """`matmul_text` in Tpu IR (`mode`), its weight store and an input."""
    rng = np.random.default_rng(seed)
    arrays = {"fc.weight": rng.standard_normal((n, k)).astype(np.float32)}
    if bias:
        arrays["fc.bias"] = rng.standard_normal((n,)).astype(np.float32)
    store = WeightStore.from_arrays(arrays)
    module = parse_ir(matmul_text(m, n, k, store.uri, bias, silu), "matmul")
    run_passes(module, tpu_pipeline_passes(mode, group_size=GROUP), store=store)
    fn = next(iter(module.ops))
    xt = fn.body.block.args[0].type  # type: ignore[attr-defined]
    x = rng.standard_normal((1, m, k)).astype(numpy_dtype(xt.element_type))
    return module, store, {"input0": x}


def the_matmul(module) -> object:  # noqa: ANN001
    return next(op for op in module.walk() if isinstance(op, tpu.MatMulOp | tpu.A16MatMulOp))


def lane_without_single_axis(module, name: str) -> Chip:  # noqa: ANN001
    """The largest (aligned) lane on which neither a rows nor a cols slicing of the matmul
    fits, but 2-D tiles do (K whole), and the module's other ops fit."""
    op = the_matmul(module)
    others = [o for o in next(iter(module.ops)).body.block.ops  # type: ignore[attr-defined]
              if o is not op and isinstance(o, tpu.TpuOp)
              and not isinstance(o, tpu.WeightOp | tpu.ConstantOp)]
    base = get_chip(name)
    align = base.align
    lane = 64 * align
    while lane > align:
        chip = tiny_chip(name, lane)
        single = plan_span([op], chip, kinds=(SliceKind.ROWS, SliceKind.COLS))
        tiles = plan_span([op], chip, kinds=(SliceKind.TILES,), split="needed")
        if (single is None and tiles is not None and tiles.parts == 1  # K whole
                and all(plan_span([o], chip) is not None for o in others)):
            return chip
        lane -= align
    assume(False)  # no lane size separates the kinds for this shape
    raise AssertionError


def tile_groups(module) -> list[tpu.GroupOp]:  # noqa: ANN001
    return [g for g in module.walk() if isinstance(g, tpu.GroupOp) and g.tiles is not None]


def run_all(module, store, feeds, chip: Chip, split: str = "cost") -> dict:  # noqa: ANN001
    """Interpreter on the Tpu IR, compile (`split`: layer-group's split-reduction),
    interpreter on the grouped IR, machine checked and fast."""
    ref = Interpreter(module, store).run(feeds).outputs["output0"]
    prog = compile_for_machine(module, chip, split_reduction=split)
    grouped = Interpreter(module, store).run(feeds).outputs["output0"]
    out = {"ref": ref, "grouped": grouped, "prog": prog}
    for checked in (True, False):
        res = simulate(prog, store, feeds, chip, checked=checked)
        out["checked" if checked else "fast"] = res.outputs["output0"]
    return out


def assert_close_to_ungrouped(got: np.ndarray, ref: np.ndarray) -> None:
    """The same sums over K in the same order per output element; a host BLAS may still
    round the products of other shapes differently (f32: a few ulps of the sums)."""
    g, r = got.astype(np.float64), ref.astype(np.float64)
    scale = float(np.abs(r).max()) or 1.0
    assert np.abs(g - r).max() <= 1e-5 * scale if got.dtype == np.float32 else \
        np.abs(g - r).max() <= 2e-2 * scale


# ---------------------------------------------------------------------------- the IR


def test_matmul_that_fits_neither_axis_gets_2d_tiles_in_the_ir() -> None:
    module, store, feeds = matmul_module(64, 64, 64, "f32")
    chip = tiny_chip("bm1684x", 8192)
    op = the_matmul(module)
    # before: neither kind fits (main refused this op: "even one slice of it needs more")
    assert plan_span([op], chip, kinds=(SliceKind.ROWS, SliceKind.COLS)) is None
    out = run_all(module, store, feeds, chip, split="needed")  # the whole K: 2-D tiles
    (g,) = tile_groups(module)
    r, c, outer = g.tile_grid()  # type: ignore[misc]
    assert r > 1 and c > 1 and r * c == g.slices.value.data and outer in ("rows", "cols")
    text = print_generic(module)
    assert f"tiles = array<i64: {r}, {c}>" in text  # (attributes print in name order)
    assert f"tile_outer = {('rows', 'cols').index(outer)}" in text
    loads, _, stores = g.template()
    assert [read_ints(ld.tile_axes) for ld in loads] == [[1, -1], [-1, 0]]
    assert read_ints(stores[0].tile_axes) == [1, 2]
    # codegen: one compute per tile, the x blocks loaded once per row block (rows outer)
    # or once per tile (cols outer), a store per tile
    cmds = [cm for cm in out["prog"].commands if cm.group == 0]
    computes = [cm for cm in cmds if cm.engine == "cmp"]
    assert len(computes) == r * c
    x_loads = [cm for cm in cmds if cm.cmd == "load" and cm.name == "x.load"]
    w_loads = [cm for cm in cmds if cm.cmd == "load" and cm.name == "fc.weight.load"]
    assert (len(x_loads), len(w_loads)) == ((r, r * c) if outer == "rows" else (r * c, c))
    assert len([cm for cm in cmds if cm.cmd == "store"]) == r * c
    for k in ("grouped", "checked", "fast"):
        assert np.array_equal(out[k], out["grouped"]), k
    assert np.array_equal(out["checked"], out["grouped"])
    assert_close_to_ungrouped(out["checked"], out["ref"])


@pytest.mark.parametrize("split", ["cost", "needed"])
def test_toptpu_opt_shows_the_tiles(tmp_path, split: str) -> None:  # noqa: ANN001
    """On the bm1688 preset (32 lanes x 128 KiB) a 256 x 256 x 16384 f32 matmul fits
    neither a rows nor a cols slicing (either operand alone fills the local memory):
    toptpu-opt prints its group's tiles and its loads' and store's tile axes. By the cost
    model its K is split in reduction parts (bigger tiles: fewer bytes per FLOP, 40% below
    the best plan without them); `split-reduction=needed` keeps K whole where a plan
    without parts fits: 2-D tiles."""
    from safetensors.numpy import save_file

    from helpers import run_tool

    m, n, k = 256, 256, 16384
    weights = tmp_path / "w.safetensors"
    save_file({"fc.weight": np.zeros((n, k), np.float32)}, str(weights))
    path = tmp_path / "big.mlir"
    path.write_text(matmul_text(m, n, k, str(weights)))
    res = run_tool("toptpu-opt", str(path), "-p",
                   "convert-top-to-tpu{mode=f32},weight-reorder,"
                   f"layer-group{{chip=bm1688 split-reduction={split}}},"
                   "lmem-verify{chip=bm1688}", "--weights-out", str(tmp_path / "o.safetensors"))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    if split == "needed":
        assert re.search(r"tiles = array<i64: \d+, \d+>, tile_outer = [01] : i64", out), out
        assert "tile_axes = array<i64: 1, -1>" in out  # the activation by rows
        assert "tile_axes = array<i64: -1, 0>" in out  # the weight by output channels
        assert "tile_axes = array<i64: 1, 2>" in out  # the result by both
        assert "acc = " not in out
        return
    assert re.search(r"tiles = array<i64: \d+, \d+, \d+>, tile_outer = [01] : i64, "
                     r"acc = \d+ : i64", out), out
    assert "tile_axes = array<i64: 1, -1, 2>" in out  # the activation by rows and K
    assert "tile_axes = array<i64: -1, 0, 1>" in out  # the weight by channels and K
    assert "tile_axes = array<i64: 1, 2, -1>" in out  # the result by both, after all of K


def test_verifier_catches_an_x_block_sharing_a_weight_tile_copy() -> None:
    """The x block of a rows-outer tile group lives across the inner loop: a weight tile
    copy at its address overlaps it in time (the longer period is checked against every
    instance it overlaps)."""
    module, store, _ = matmul_module(64, 64, 64, "f32")
    chip = tiny_chip("bm1684x", 8192)
    LayerGroupPass.for_chip(chip).apply(None, module)  # type: ignore[arg-type]
    (g,) = tile_groups(module)
    verify_group(g, chip)
    x_ld, w_ld = g.template()[0]
    xa = read_ints(x_ld.lmem)
    wa = list(read_ints(w_ld.lmem))
    wa[1] = xa[0]
    w_ld.lmem = i64_array(wa)
    with pytest.raises(LocalMemoryError, match="live buffers overlap"):
        verify_group(g, chip)


def test_tile_group_verifier_rejects_bad_tiles() -> None:
    module, _, _ = matmul_module(64, 64, 64, "f32")
    LayerGroupPass.for_chip(tiny_chip("bm1684x", 8192)).apply(None, module)  # type: ignore[arg-type]
    (g,) = tile_groups(module)
    g.tiles = i64_array([3, 5])
    with pytest.raises(Exception, match="product is its"):
        g.verify()


def test_what_does_not_fit_says_by_how_much() -> None:
    module, _, _ = matmul_module(64, 64, 64, "f32")
    chip = tiny_chip("bm1684x", 256)
    with pytest.raises(LayerGroupError) as e:
        LayerGroupPass.for_chip(chip).apply(None, module)  # type: ignore[arg-type]
    msg = str(e.value)
    assert msg.startswith("'tpu.matmul' (top.matmul) cannot run from local memory on bm1684x")
    # the finest: 64 x 64 tiles of one element, each in 64 reduction parts of one product:
    # two copies of each part and of the result, and the accumulator (7 aligned lanes)
    assert "even its finest slicing (64 x 64 tiles of 64 reduction parts) still needs 448 B" \
        in msg, msg
    need = int(re.search(r"still needs (\d+) B per lane", msg).group(1))  # type: ignore[union-attr]
    assert f"{need - 256} B more than a lane's 256 B" in msg


# ---------------------------------------------------------------------------- properties


@fuzz_settings(20)
@given(m=st.sampled_from([8, 16, 24, 48, 64]), n=st.sampled_from([16, 32, 48, 64, 96]),
       k=st.sampled_from([32, 64, 128]), mode=st.sampled_from(QuantMode.names()),
       chip=st.sampled_from(["bm1684x", "bm1688"]), bias=st.booleans(),
       seed=st.integers(0, 3))
def test_tiled_matmul_on_machine_equals_interpreter(m: int, n: int, k: int, mode: str,
                                                    chip: str, bias: bool, seed: int) -> None:
    module, store, feeds = matmul_module(m, n, k, mode, seed, bias)
    target = lane_without_single_axis(module, chip)
    out = run_all(module, store, feeds, target, split="needed")  # K whole: 2-D tiles
    assert tile_groups(module), "the matmul was not tiled"
    for g in module.walk():
        if isinstance(g, tpu.GroupOp):
            verify_group(g, target)
    assert np.array_equal(out["checked"], out["grouped"])
    assert np.array_equal(out["fast"], out["grouped"])
    assert_close_to_ungrouped(out["checked"], out["ref"])


# ---------------------------------------------------------------------------- attention


@pytest.fixture(scope="module")
def attention_layer() -> tuple:
    """A decoder layer of a tiny Qwen2 with 4 KV heads (8 query heads) over 64 tokens, in
    Top IR, with its store and inputs."""
    from toptpu.frontends.hf_layers import import_decoder_layer
    from toptpu.frontends.tiny_models import tiny_model

    model = tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=4)
    imp = import_decoder_layer(model, 64, mask_value=-10000.0)
    return imp.module, imp.store, dict(imp.feeds)


@pytest.mark.parametrize(("mode", "lane"), [("bf16", 4096),
                                             pytest.param("f32", 8192, marks=pytest.mark.slow)])
def test_attention_tiles_by_rows_and_heads_and_matches(attention_layer, mode: str,
                                                       lane: int) -> None:
    """With 4 KiB lanes (bf16) the attention fits neither by rows (every KV head resident) nor by
    heads (the mask of every row resident): it tiles by rows x KV heads; q and the output
    move as parts sliced along both axes (row block at an offset, heads within it)."""
    top_module, store, feeds = attention_layer
    module = top_module.clone()
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    chip = tiny_chip("bm1684x", lane)
    att = next(op for op in module.walk() if isinstance(op, tpu.AttentionOp))
    assert plan_span([att], chip, kinds=(SliceKind.ROWS, SliceKind.HEADS)) is None
    ref = Interpreter(module, store).run(feeds).outputs["out"]
    prog = compile_for_machine(module, chip, split_reduction="needed")  # all keys at once
    (g,) = [g for g in tile_groups(module)
            if any(isinstance(op, tpu.AttentionOp) for op in g.body.block.ops)]
    r, c, _ = g.tile_grid()  # type: ignore[misc]
    assert r > 1 and c > 1
    inner = next(op for op in g.body.block.ops if isinstance(op, tpu.AttentionOp))
    assert (inner.q_heads.value.data, inner.kv_heads.value.data) == (8 // c, 4 // c)
    loads, _, stores = g.template()
    assert [read_ints(ld.tile_axes) for ld in loads] == [[1, 2], [-1, 2], [-1, 2], [2, -1]]
    assert read_ints(stores[0].tile_axes) == [1, 2]
    grouped = Interpreter(module, store).run(feeds).outputs["out"]
    for checked in (True, False):
        out = simulate(prog, store, feeds, chip, checked=checked).outputs["out"]
        assert np.array_equal(out, grouped), checked
    assert_close_to_ungrouped(grouped, ref)


# ---------------------------------------------------------------------------- real shapes

#: Qwen2.5-7B and -14B's public shapes (transformers' configs); main refused their prefill
#: layers at max-input-length 512 and above (7B) and 2048 (14B) for local memory
REAL_SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "qwen2.5-14b": dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=13824, vocab_size=152064),
    # R1-Distill-Qwen-1.5B's shape (LLM-TPU publishes its FTL at seq 8192)
    "qwen2.5-1.5b": dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mode", "length", "chip", "nets"), [
    ("qwen2.5-7b", "w4bf16", 512, "bm1684x", ("block_kv",)),
    ("qwen2.5-7b", "w4bf16", 1024, "bm1688", ("block_kv",)),
    ("qwen2.5-7b", "w4bf16", 2048, "bm1684x", ("block",)),
    ("qwen2.5-14b", "w4bf16", 512, "bm1688", ("block_kv",)),
    ("qwen2.5-14b", "w4bf16", 1024, "bm1684x", ("block_kv",)),
    ("qwen2.5-14b", "w4bf16", 2048, "bm1688", ("block",)),
    ("qwen2.5-7b", "f32", 1024, "bm1688", ("block", "block_kv"))])
def test_real_prefill_layers_compile(model: str, mode: str, length: int, chip: str,
                                     nets: tuple[str, ...]) -> None:
    """Prefill nets of one layer of Qwen2.5-7B and -14B at max-input-length 512, 1024 and
    2048 (seq 2048: block_kv attends to a history of 2048) compile, each size on one of the
    two chips (`toptpu estimate` compiles every size on both: docs/benchmarks.md). Main
    refused the 7B's block_kv in f32 at 1024 on bm1688 (its attention's history part did
    not fit in one piece): its parts now run over key parts."""
    from toptpu.estimate import compile_costs
    from toptpu.frontends.tiny_models import qwen25_05b_config
    from toptpu.request import CompileRequest

    config = qwen25_05b_config(layers=1, tie_word_embeddings=False, **REAL_SHAPES[model])
    costs = compile_costs(config, CompileRequest.make(mode=mode, chip=chip, seq_length=2048,
                                                      max_input_length=length), nets=nets)
    assert set(costs.commands) == set(nets)
    assert all(costs.commands[n] for n in costs.commands)


@pytest.mark.slow
def test_the_15b_attention_over_an_8192_history_compiles() -> None:
    """R1-Distill-Qwen-1.5B's shape at seq 8192 (LLM-TPU publishes its first-token latency
    there): block_kv's attention over an 8192-token history compiles in key parts."""
    from toptpu.estimate import compile_costs
    from toptpu.frontends.tiny_models import qwen25_05b_config
    from toptpu.request import CompileRequest

    config = qwen25_05b_config(layers=1, tie_word_embeddings=False,
                               **REAL_SHAPES["qwen2.5-1.5b"])
    costs = compile_costs(config, CompileRequest.make(mode="w4bf16", seq_length=8192,
                                                      max_input_length=8192),
                          nets=("block_kv",))
    assert costs.commands["block_kv"]


# ---------------------------------------------------------------------------- online softmax

#: attention over key tiles sums the exponentials in another order (rescaled per tile):
#: within this of the untiled kernel, relative to the largest value magnitude (f32)
ONLINE_TOLERANCE = 1e-5


@fuzz_settings(60)
@given(sq=st.integers(1, 12), sk=st.integers(1, 20), hist=st.sampled_from([0, 3, 16]),
       kv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 3]), d=st.sampled_from([4, 8]),
       tile=st.integers(1, 9), causal=st.booleans(), masked=st.booleans(),
       seed=st.integers(0, 9))
def test_online_softmax_attention_equals_the_untiled_kernel(
        sq: int, sk: int, hist: int, kv: int, rep: int, d: int, tile: int, causal: bool,
        masked: bool, seed: int) -> None:
    from toptpu.backend.reference import kernels as K

    assume(not causal or sk + hist >= sq)
    rng = np.random.default_rng(seed)
    hq = kv * rep
    q = rng.standard_normal((1, sq, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, sk, kv, d)).astype(np.float32) for _ in range(2))
    hk, hv = ((rng.standard_normal((1, hist, kv, d)).astype(np.float32) for _ in range(2))
              if hist else (None, None))
    mask = None
    if masked:  # additive, finite, a per-head mask half the time
        heads = hq if seed % 2 else 1
        mask = np.where(rng.random((1, heads, sq, hist + sk)) < 0.3, -10000.0,
                        0.0).astype(np.float32)
    want = K.attention(q, k, v, mask, 0.3, hk, hv, causal)
    seen: list[int] = []
    real_tile = K.attention_tile

    def spy(state, q_, k_, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(k_.shape[1])
        return real_tile(state, q_, k_, *args, **kw)

    K.attention_tile = spy  # type: ignore[assignment]
    try:
        got = K.attention_online(q, k, v, mask, 0.3, hk, hv, causal, tile=tile)
    finally:
        K.attention_tile = real_tile  # type: ignore[assignment]
    assert max(seen) <= tile and sum(seen) == sk + hist  # never all the keys at once
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = float(np.abs(v).max()) if hv is None else float(max(np.abs(v).max(),
                                                                np.abs(hv).max()))
    live = _rows_that_see_a_key(mask, sq, hist + sk, hq, causal)
    assert np.isfinite(got).all()
    assert np.abs(got - want)[0][live].max(initial=0.0) <= ONLINE_TOLERANCE * scale


def test_online_softmax_attention_bf16_output() -> None:
    from toptpu.backend.reference import kernels as K

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 64, 8, 16)).astype(K.BF16)
    k, v = (rng.standard_normal((1, 64, 4, 16)).astype(K.BF16) for _ in range(2))
    want = K.attention(q, k, v, None, 0.25, causal=True, out_dtype=K.BF16)
    got = K.attention_online(q, k, v, None, 0.25, causal=True, out_dtype=K.BF16, tile=16)
    assert got.dtype == want.dtype
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    assert diff.max() <= 2 ** -7 * np.abs(want.astype(np.float32)).max()  # one bf16 ulp


@pytest.mark.slow
def test_internvl_at_internvit_300m_shapes_generates_transformers_tokens(
        tmp_path_factory) -> None:  # noqa: ANN001
    """InternVL with the vision tower at InternViT-300M's shapes (448 px tile: 1025 rows,
    hidden 1024, MLP 4096, 16 heads; two of its 24 layers) and a tiny text model, compiled
    f32: main refused the vit net (`mlp.fc2`); its matmuls now tile in 2-D tiles (a K
    split in reduction parts is within `REDUCTION_MARGIN` of them on bm1684x here, so K
    stays whole). The image features equal the model's own and greedy generation equals
    transformers."""
    from vlm_fixtures import hf_generate, hf_image_features, hf_image_inputs, make_image

    from toptpu.backend.formats.llm_file import LlmFile
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_vlms import save_tiny_vlm
    from toptpu.metrics import similarity

    root = tmp_path_factory.mktemp("internvit300m")
    model_dir = str(root / "model")
    with quiet_transformers():
        save_tiny_vlm(model_dir, "internvl", max_tiles=1, hidden_size=1024,
                      num_attention_heads=16, intermediate_size=4096, image_size=448,
                      patch_size=14, num_hidden_layers=2)
    image = str(root / "image.png")
    make_image(448, 448).save(image)
    path = str(root / "model.toptpu")
    compile_model(model_dir, path, mode="f32", seq_length=320, max_input_length=64,
                  progress=None)
    lf = LlmFile(path)  # the vit net's program (its grouped IR) shows the tiles
    stream = lf.file.read(lf.meta.nets["vit"].streams)
    assert re.search(rb"tiles = array<i64: \d+, \d+>", stream)  # 2-D tiles
    rt = Runtime.open(path, "machine")
    enc = rt.encode_image(image)
    inputs, _ = hf_image_inputs(model_dir, image)
    ref = hf_image_features(model_dir, inputs)
    assert enc.embeds.shape == ref.shape == (256, ref.shape[1])
    assert similarity(np.asarray(enc.embeds, np.float32), ref).cosine >= 0.99999
    ids, images = rt.image_prompt("Describe the image.", [image])
    res = rt.generate(ids, 12, images=images)
    assert res.generated_ids == hf_generate(model_dir, ids, inputs, 12)


# ---------------------------------------------------------------------------- key parts


def _rows_that_see_a_key(mask: np.ndarray | None, sq: int, keys: int, hq: int,
                         causal: bool) -> np.ndarray:
    """[Sq, Hq]: the (query, head) rows that see at least one key. A row that sees none is
    padding (the contract: finite, any value): its scores all sit at the mask value, where
    float32 keeps only ~1e-3 of them, and tiled and untiled kernels round them differently."""
    visible = np.ones((1, sq, keys), bool) if mask is None else mask[0] > -1
    if causal:  # key j hidden from query i when j > i + (keys - sq)
        visible = visible & (np.arange(keys)[None, :] <= np.arange(sq)[:, None] + keys - sq)
    return np.broadcast_to(visible.any(-1).T, (sq, hq))


@fuzz_settings(40)
@given(sq=st.integers(1, 10), sk=st.integers(1, 12), hist=st.integers(1, 12),
       kv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), causal=st.booleans(),
       seed=st.integers(0, 9))
@example(sq=4, sk=1, hist=2, kv=1, rep=1, causal=False, seed=2)  # a row that sees no key
def test_attention_parts_merge_to_the_untiled_kernel(sq: int, sk: int, hist: int, kv: int,
                                                     rep: int, causal: bool,
                                                     seed: int) -> None:
    """An attention over a history as two parts (history's keys, new keys) merged by their
    log-sum-exp equals the untiled kernel within ONLINE_TOLERANCE."""
    from toptpu.backend.reference import kernels as K

    assume(not causal or sk >= sq)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, sq, kv * rep, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, sk, kv, 8)).astype(np.float32) for _ in range(2))
    hk, hv = (rng.standard_normal((1, hist, kv, 8)).astype(np.float32) for _ in range(2))
    mask = np.where(rng.random((1, 1, sq, hist + sk)) < 0.3, -10000.0, 0.0).astype(np.float32)
    want = K.attention(q, k, v, mask, 0.3, hk, hv, causal)
    parts = [K.attention_part(q, hk, hv, mask[..., :hist], 0.3),
             K.attention_part(q, k, v, mask[..., hist:], 0.3, causal)]
    assert parts[0].shape == (*want.shape[:3], 9) and parts[0].dtype == np.float32
    got = K.attention_merge(parts, np.float32)
    scale = float(max(np.abs(v).max(), np.abs(hv).max()))
    live = _rows_that_see_a_key(mask, sq, hist + sk, kv * rep, causal)
    assert np.isfinite(got).all()
    assert np.abs(got - want)[0][live].max(initial=0.0) <= ONLINE_TOLERANCE * scale


def history_attention_module(mode: str, length: int = 32, hist: int = 32, hq: int = 4,
                             hkv: int = 2, d: int = 16) -> tuple:
    """Tpu IR of one attention of `length` queries over as many new keys and a history of
    `hist` (all function inputs, mask included), followed by a silu; its store and inputs."""
    qt, kt, ht, mt = (f"tensor<1x{length}x{hq}x{d}xf32>", f"tensor<1x{length}x{hkv}x{d}xf32>",
                      f"tensor<1x{hist}x{hkv}x{d}xf32>",
                      f"tensor<1x1x{length}x{hist + length}xf32>")
    attrs = (f"scale = 0.25 : f64, q_heads = {hq} : i64, kv_heads = {hkv} : i64, "
             f"head_dim = {d} : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>")
    store = WeightStore.from_arrays({})
    text = f'''builtin.module attributes {{top.weight_store = "{store.uri}"}} {{
  func.func @main(%q: {qt}, %k: {kt}, %v: {kt}, %m: {mt}, %hk: {ht}, %hv: {ht}) -> {qt} {{
    %a = "top.attention"(%q, %k, %v, %m, %hk, %hv) {{{attrs}}} :
        ({qt}, {kt}, {kt}, {mt}, {ht}, {ht}) -> {qt}
    %z = "top.silu"(%a) : ({qt}) -> {qt}
    func.return %z : {qt}
  }}
}}'''
    module = parse_ir(text, "history")
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    fn = next(iter(module.ops))
    rng = np.random.default_rng(0)
    feeds = {}
    for i, a in enumerate(fn.body.block.args):  # type: ignore[attr-defined]
        x = rng.standard_normal(tuple(a.type.get_shape())).astype(np.float32)
        if i == 3:
            x = np.where(x < -0.5, -10000.0, 0.0)
        feeds[f"input{i}"] = x.astype(numpy_dtype(a.type.element_type))
    return module, store, feeds


@pytest.mark.parametrize("mode", ["f32", "bf16"])
def test_attention_over_a_history_that_does_not_fit_is_split_in_key_parts(mode: str) -> None:
    """On a lane where no slicing of the attention fits (its keys and values, history's
    and new, resident at once), layer-group splits it into a part over the history's keys,
    a part over the new ones (the mask sliced to each) and their merge: the machine gives
    the grouped interpreter's bytes, within ONLINE_TOLERANCE of the untiled attention."""
    module, store, feeds = history_attention_module(mode)
    ref = Interpreter(module, store).run(feeds).outputs["output0"]
    att = next(op for op in module.walk() if isinstance(op, tpu.AttentionOp))
    base = get_chip("bm1684x")
    chip = None
    for lane in range(16384, base.align, -base.align):  # the largest that splits
        c = tiny_chip("bm1684x", lane)
        if plan_span([att], c) is None:
            chip = c
            break
    assert chip is not None
    prog = compile_for_machine(module, chip)
    names = [op.name for op in module.walk() if op.name.startswith("tpu.attention")]
    assert names == ["tpu.attention_part", "tpu.attention_part", "tpu.attention_merge"]
    grouped = Interpreter(module, store).run(feeds).outputs["output0"]
    for checked in (True, False):
        out = simulate(prog, store, feeds, chip, checked=checked).outputs["output0"]
        assert np.array_equal(out, grouped), checked
    g, r = grouped.astype(np.float64), ref.astype(np.float64)
    v_max = float(max(np.abs(feeds["input2"].astype(np.float64)).max(),
                      np.abs(feeds["input5"].astype(np.float64)).max()))
    # f32: the online-softmax tolerance; bf16: the result's own rounding (one ulp) on top
    tol = ONLINE_TOLERANCE * v_max if mode == "f32" else 2 ** -7 * v_max
    assert np.abs(g - r).max() <= tol
