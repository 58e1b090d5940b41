"""Layer groups that split a reduction in parts (issue 32): a matmul's K (an a16_matmul's
whole quantization groups) and an attention's keys, each part folded into an f32
accumulator in local memory (`tpu.GroupOp` with three `tiles`).

The numbers: the machine gives the bytes of the interpreter running the same grouped IR
(both call the kernels' `matmul_part` / `attention_tile` in the same order); against the
ungrouped IR the parts' sums are added in another order. The tolerance of a K split is
stated by `k_split_bound` (the classic bound of two summation orders of the same K
products, plus the output's rounding), of a key split by ONLINE_TOLERANCE (test_tiles)."""

from __future__ import annotations

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import assume, example, given
from hypothesis import strategies as st
from test_tiles import (
    ONLINE_TOLERANCE,
    history_attention_module,
    matmul_module,
    run_all,
    the_matmul,
    tiny_chip,
)

from toptpu.backend.reference import kernels as K
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.dialects import tpu
from toptpu.dialects.common import QuantMode, numpy_dtype, read_ints, shape_of
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.layer_group import LayerGroupError, _candidates, _reduction_plans
from toptpu.passes.pipelines import run_passes, tpu_pipeline_passes
from toptpu.passes.slicing import SliceKind

U = 2.0 ** -24  # the unit roundoff of f32


def k_split_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, ref: np.ndarray
                  ) -> np.ndarray:
    """How far a matmul whose K is summed in parts may be from the one summed whole, per
    output element: each of the two f32 sums of the same K products lies within
    gamma_K * sum_k |x_k w_k| of the exact one (gamma_K = K u / (1 - K u), any summation
    order, with or without fused multiply-adds), the bias added to each rounds once more,
    and a half-precision output may round the two to neighbouring values (one of its ulps).
    `w` [N, K] is the weight the kernel multiplies by (dequantized for an a16_matmul)."""
    k = x.shape[-1]
    gamma = k * U / (1 - k * U)
    absprod = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    y = np.abs(ref.astype(np.float64))
    b = 0.0 if bias is None else np.abs(bias.astype(np.float64))
    bound = 2 * gamma * absprod + 2 * U * (y + b)
    if ref.dtype != np.float32:
        ulp = 2.0 ** -7 if ref.dtype == K.BF16 else 2.0 ** -10
        bound = bound + ulp * np.maximum(y, 2.0 ** -14) * 2
    return bound


def reduction_groups(module) -> list[tpu.GroupOp]:  # noqa: ANN001
    return [g for g in module.walk() if isinstance(g, tpu.GroupOp) and g.reduction_parts() > 1]


def lane_that_needs_parts(module, name: str) -> Chip:  # noqa: ANN001
    """The largest (aligned) lane of a two-lane `name` on which no plan of the module's
    matmul (or attention) without reduction parts fits, but one with them compiles (on
    lanes of a few hundred bytes the banks' rule may refuse what the bound allows)."""
    op = next(op for op in module.walk() if isinstance(op, tpu.REDUCTION_OPS))
    align = get_chip(name).align
    for lane in range(64 * align, align, -align):
        chip = tiny_chip(name, lane)
        if (any(_candidates([op], kind, chip, None) for kind in SliceKind)
                or not _reduction_plans([op], chip, None)):
            continue
        try:
            compile_for_machine(module.clone(), chip, split_reduction="needed")
        except LayerGroupError:
            continue
        return chip
    assume(False)  # no lane separates them for this shape
    raise AssertionError


def weight_of(module, store: WeightStore) -> tuple[np.ndarray, np.ndarray | None]:  # noqa: ANN001
    """The weight [N, K] the module's matmul multiplies by (dequantized) and its bias."""
    op = the_matmul(module)
    arrays = [store[v.owner.tensor_name] if v is not None  # type: ignore[union-attr]
              and isinstance(v.owner, tpu.WeightOp) else None for v in op.operand_groups()]
    if isinstance(op, tpu.A16MatMulOp):
        _, q, s, z, mins, b = arrays
        w = K.dequantize(q, s, z, op.weight_bits.value.data, op.group_size.value.data,
                         mins=mins)
        return w, b
    _, w, b = arrays
    return K.f32(w), b


# ---------------------------------------------------------------------------- K split


@fuzz_settings(16)
@given(m=st.sampled_from([1, 3, 8, 16, 24, 48]), n=st.sampled_from([16, 32, 48, 64, 96]),
       k=st.sampled_from([64, 128, 256]), mode=st.sampled_from(QuantMode.names()),
       chip=st.sampled_from(["bm1684x", "bm1688"]), bias=st.booleans(),
       seed=st.integers(0, 3))
@example(m=1, n=32, k=256, mode="w8bf16", chip="bm1688", bias=True, seed=0)  # per channel
def test_k_split_on_the_machine_equals_the_interpreter(m: int, n: int, k: int, mode: str,
                                                       chip: str, bias: bool,
                                                       seed: int) -> None:
    """Where no plan without reduction parts fits a lane, the matmul's K is split: the
    machine (checked and fast) gives the grouped interpreter's bytes, within
    `k_split_bound` of the ungrouped matmul."""
    module, store, feeds = matmul_module(m, n, k, mode, seed, bias, silu=False)
    target = lane_that_needs_parts(module, chip)
    w, b = weight_of(module, store)
    out = run_all(module, store, feeds, target, split="needed")
    (g,) = reduction_groups(module)
    r, c, parts = read_ints(g.tiles)  # type: ignore[misc]
    assert parts > 1 and r * c * parts == g.slices.value.data
    assert np.array_equal(out["checked"], out["grouped"])
    assert np.array_equal(out["fast"], out["grouped"])
    bound = k_split_bound(feeds["input0"][0], w, b, out["ref"][0])
    diff = np.abs(out["grouped"][0].astype(np.float64) - out["ref"][0].astype(np.float64))
    assert (diff <= bound).all(), float((diff - bound).max())


# ---------------------------------------------------------------------------- key parts


def attention_module(mode: str, sq: int, sk: int, hq: int, hkv: int, d: int,
                     masked: bool, seed: int = 0) -> tuple:
    """Tpu IR of one attention of `sq` queries over `sk` keys (q, k, v and, `masked`, an
    additive mask [1, 1, sq, sk], all function inputs), its store and inputs."""
    qt, kt = f"tensor<1x{sq}x{hq}x{d}xf32>", f"tensor<1x{sk}x{hkv}x{d}xf32>"
    mt = f"tensor<1x1x{sq}x{sk}xf32>"
    seg = "1, 1, 1, 1, 0, 0" if masked else "1, 1, 1, 0, 0, 0"
    attrs = (f"scale = 0.25 : f64, q_heads = {hq} : i64, kv_heads = {hkv} : i64, "
             f"head_dim = {d} : i64, operandSegmentSizes = array<i32: {seg}>")
    args = f"%q: {qt}, %k: {kt}, %v: {kt}" + (f", %m: {mt}" if masked else "")
    ops = "%q, %k, %v" + (", %m" if masked else "")
    types = f"{qt}, {kt}, {kt}" + (f", {mt}" if masked else "")
    store = WeightStore.from_arrays({})
    text = f'''builtin.module attributes {{top.weight_store = "{store.uri}"}} {{
  func.func @main({args}) -> {qt} {{
    %a = "top.attention"({ops}) {{{attrs}}} : ({types}) -> {qt}
    func.return %a : {qt}
  }}
}}'''
    module = parse_ir(text, "attention")
    run_passes(module, tpu_pipeline_passes(mode), store=store)
    fn = next(iter(module.ops))
    rng = np.random.default_rng(seed)
    feeds = {}
    for i, a in enumerate(fn.body.block.args):  # type: ignore[attr-defined]
        x = rng.standard_normal(tuple(a.type.get_shape())).astype(np.float32)
        if i == 3:  # hidden keys; the last key of every row seen
            x = np.where(x < -0.5, -10000.0, 0.0)
            x[..., -1] = 0.0
        feeds[f"input{i}"] = x.astype(numpy_dtype(a.type.element_type))
    return module, store, feeds


@fuzz_settings(20)
@given(sq=st.sampled_from([1, 2, 4, 8, 16]), sk=st.sampled_from([8, 16, 24, 48]),
       kv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 3]), d=st.sampled_from([8, 16]),
       mode=st.sampled_from(["f32", "bf16", "f16"]), masked=st.booleans(),
       chip=st.sampled_from(["bm1684x", "bm1688"]), seed=st.integers(0, 3))
@example(sq=1, sk=48, kv=2, rep=1, d=16, mode="f32", masked=True, chip="bm1688", seed=0)
def test_attention_over_key_parts_equals_the_untiled_attention(
        sq: int, sk: int, kv: int, rep: int, d: int, mode: str, masked: bool, chip: str,
        seed: int) -> None:
    """Where no plan over all keys at once fits a lane, an attention's keys are split in
    parts (online softmax in the group's accumulator; one query row: decode): the machine
    gives the grouped interpreter's bytes, within ONLINE_TOLERANCE of the untiled kernel
    (f32; a half-precision result one of its ulps on top)."""
    module, store, feeds = attention_module(mode, sq, sk, kv * rep, kv, d, masked, seed)
    target = lane_that_needs_parts(module, chip)
    ref = Interpreter(module, store).run(feeds).outputs["output0"]
    prog = compile_for_machine(module, target, split_reduction="needed")
    (g,) = reduction_groups(module)
    assert read_ints(g.tiles)[2] > 1
    loads, (att,), stores = g.template()
    assert isinstance(att, tpu.AttentionOp)
    assert shape_of(att.k)[1] * read_ints(g.tiles)[2] == sk  # each part a share of keys
    grouped = Interpreter(module, store).run(feeds).outputs["output0"]
    for checked in (True, False):
        out = simulate(prog, store, feeds, target, checked=checked).outputs["output0"]
        assert np.array_equal(out, grouped), checked
    v_max = float(np.abs(feeds["input2"].astype(np.float64)).max())
    diff = np.abs(grouped.astype(np.float64) - ref.astype(np.float64))
    tol = ONLINE_TOLERANCE * v_max
    if mode != "f32":  # the result's own rounding
        tol += (2.0 ** -7 if mode == "bf16" else 2.0 ** -10) * v_max
    assert diff.max() <= tol, (diff.max(), tol)


def test_attention_over_a_long_history_is_split_in_two_parts_each_over_key_parts() -> None:
    """An attention over a history whose parts (history's keys, new keys) do not fit
    whole either: each part runs over key parts in its group (the online softmax in
    local memory), and the two are merged by their log-sum-exp (between groups): the
    machine gives the grouped interpreter's bytes, within ONLINE_TOLERANCE of the
    untiled attention (main refused Qwen2.5-7B f32 at max-input-length 1024 on bm1688
    this way: its attention needed more than two key parts)."""
    module, store, feeds = history_attention_module("f32", length=16, hist=96)
    ref = Interpreter(module, store).run(feeds).outputs["output0"]
    chip = tiny_chip("bm1684x", 2048)
    prog = compile_for_machine(module, chip)
    names = [op.name for op in module.walk() if op.name.startswith("tpu.attention")]
    assert names == ["tpu.attention_part", "tpu.attention_part", "tpu.attention_merge"]
    parts = [g for g in reduction_groups(module)
             if isinstance(g.template()[1][0], tpu.AttentionPartOp)]
    assert len(parts) == 2  # both parts over key parts
    grouped = Interpreter(module, store).run(feeds).outputs["output0"]
    for checked in (True, False):
        out = simulate(prog, store, feeds, chip, checked=checked).outputs["output0"]
        assert np.array_equal(out, grouped), checked
    v_max = float(max(np.abs(feeds["input2"]).max(), np.abs(feeds["input5"]).max()))
    assert np.abs(grouped - ref).max() <= ONLINE_TOLERANCE * v_max


# ---------------------------------------------------------------------------- real shapes

#: the linears (N, K) of Qwen2.5-0.5B, -7B and -14B (q/o, k/v, gate/up, down)
LINEARS = [(896, 896), (128, 896), (4864, 896), (896, 4864),
           (3584, 3584), (512, 3584), (18944, 3584), (3584, 18944),
           (5120, 5120), (1024, 5120), (13824, 5120), (5120, 13824)]


def tpu_matmul_text(m: int, n: int, k: int, mode: str, group: int, bias: bool) -> str:
    """The Tpu IR convert-top-to-tpu and weight-reorder make of x[1, m, k] @ W[n, k]^T
    (+ b) in `mode` (w4: asymmetric groups of `group`; w8: symmetric per channel), written
    out without weights: the machine passes plan from shapes alone, so a 14B-sized layer
    compiles in seconds (checked against the real passes at a small shape below)."""
    qm = QuantMode(mode)
    act = qm.activation
    xt, yt, bt = f"tensor<1x{m}x{k}x{act}>", f"tensor<1x{m}x{n}x{act}>", f"tensor<{n}xf32>"
    lines = []

    def weight(value: str, name: str, part: str, t: str) -> None:
        lines.append(f'{value} = "tpu.weight"() {{name = "{name}", source = "fc.weight", '
                     f'part = "{part}"}} : () -> {t}')

    if qm.weight_bits is None:
        wt = f"tensor<{n}x{k}x{act}>"
        weight("%w", "fc.weight" if act == "f32" else f"fc.weight:{act}", "data", wt)
        operands, types = ["%x", "%w"], [xt, wt]
        head, attrs = '"tpu.matmul"', "transpose_b = true, compute = f32"
    else:
        bits = qm.weight_bits
        g = group if bits == 4 else k
        tag = f"fc.weight:q{bits}g{g}{'a' if bits == 4 else 's'}:{act}"
        wts = [("%0", "qweight", f"tensor<{n}x{k // 2 if bits == 4 else k}x"
                                 f"{'ui8' if bits == 4 else 'i8'}>"),
               ("%1", "scales", f"tensor<{n}x{k // g}x{act}>")]
        if bits == 4:
            wts.append(("%2", "zeros", f"tensor<{n}x{k // g}xui8>"))
        for value, part, t in wts:
            weight(value, f"{tag}.{part}", part, t)
        operands, types = ["%x", *(v for v, _, _ in wts)], [xt, *(t for _, _, t in wts)]
        seg = f"1, 1, 1, {1 if bits == 4 else 0}, 0, {1 if bias else 0}"
        head = '"tpu.a16_matmul"'
        attrs = (f"weight_bits = {bits} : i64, group_size = {g} : i64, compute = f32, "
                 f"operandSegmentSizes = array<i32: {seg}>")
    if bias:
        lines.append(f'%b = "tpu.weight"() {{name = "fc.bias", source = "fc.bias", '
                     f'part = "data"}} : () -> {bt}')
        operands.append("%b")
        types.append(bt)
    lines.append(f'%y = {head}({", ".join(operands)}) {{{attrs}}} : ({", ".join(types)}) '
                 f'-> {yt}')
    body = "\n    ".join(lines)
    return f'''"builtin.module"() ({{
  "func.func"() <{{sym_name = "main", function_type = ({xt}) -> {yt}}}> ({{
  ^bb0(%x: {xt}):
    {body}
    "func.return"(%y) : ({yt}) -> ()
  }}) : () -> ()
}}) : () -> ()'''


@pytest.mark.parametrize("mode", QuantMode.names())
def test_the_real_shape_template_is_what_the_passes_make(mode: str) -> None:
    from test_tiles import GROUP

    from toptpu.dialects.ir_text import print_generic
    from toptpu.dialects.weight_store import STORE_ATTR

    for bias in (False, True):
        module, _, _ = matmul_module(8, 96, 128, mode, bias=bias, silu=False)
        module.attributes.pop(STORE_ATTR)
        want = print_generic(module, debuginfo=False)
        got = print_generic(parse_ir(tpu_matmul_text(8, 96, 128, mode, GROUP, bias), "t"),
                            debuginfo=False)
        assert got == want


@fuzz_settings(16)
@given(m=st.sampled_from([1, 64, 512, 1024, 2048]), linear=st.sampled_from(LINEARS),
       mode=st.sampled_from(QuantMode.names()), chip=st.sampled_from(["bm1684x", "bm1688"]),
       bias=st.booleans())
@example(m=1024, linear=(3584, 18944), mode="f32", chip="bm1688", bias=False)
@example(m=2048, linear=(13824, 5120), mode="w4bf16", chip="bm1684x", bias=False)
def test_matmuls_of_real_shapes_fit_local_memory(m: int, linear: tuple[int, int], mode: str,
                                                 chip: str, bias: bool) -> None:
    """Every matmul of the 0.5B, 7B and 14B layers, at up to 2048 rows, in every mode, on
    both chips: layer-group finds a plan (2-D tiles, reduction parts) whose allocation
    lmem-verify checks again, and address-assign places it (no codegen: the layers'
    command streams are compiled by test_tiles' and this file's layer tests)."""
    from toptpu.passes.pipelines import machine_passes

    n, k = linear
    module = parse_ir(tpu_matmul_text(m, n, k, mode, 64, bias), "real")
    run_passes(module, machine_passes(chip))
    groups = [g for g in module.walk() if isinstance(g, tpu.GroupOp)]
    assert groups and not any(isinstance(op, tpu.REDUCTION_OPS) for op in next(
        iter(module.ops)).body.block.ops)  # type: ignore[attr-defined]


def test_a_causal_attention_is_not_sliced_by_rows() -> None:
    """An attention with the causal flag (no mask) hides key j from query i past the
    diagonal of the whole query block: a slice of rows would put its own diagonal there
    (main row-sliced it and moved its outputs by up to 1.6). On every lane it fits, it is
    sliced by heads or not at all, and gives the interpreter's bytes."""
    qt = "tensor<1x32x4x8xf32>"
    store = WeightStore.from_arrays({})
    text = f'''builtin.module attributes {{top.weight_store = "{store.uri}"}} {{
  func.func @main(%q: {qt}, %k: {qt}, %v: {qt}) -> {qt} {{
    %a = "top.attention"(%q, %k, %v) {{scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 4 :
        i64, head_dim = 8 : i64, causal = true, operandSegmentSizes = array<i32: 1, 1, 1, 0,
        0, 0>}} : ({qt}, {qt}, {qt}) -> {qt}
    func.return %a : {qt}
  }}
}}'''
    rng = np.random.default_rng(0)
    feeds = {f"input{i}": rng.standard_normal((1, 32, 4, 8)).astype(np.float32)
             for i in range(3)}
    slices = set()
    for lane in range(8192, 0, -1024):
        module = parse_ir(text, "causal")
        run_passes(module, tpu_pipeline_passes("f32"), store=store)
        ref = Interpreter(module, store).run(feeds).outputs["output0"]
        chip = tiny_chip("bm1684x", lane)
        try:
            prog = compile_for_machine(module, chip)
        except LayerGroupError as e:
            assert "cannot run from local memory" in str(e)
            break
        (g,) = [g for g in module.walk() if isinstance(g, tpu.GroupOp)]
        (att,) = g.template()[1]
        assert shape_of(att.q)[1] == 32  # every row in each slice
        slices.add(g.slices.value.data)
        out = simulate(prog, store, feeds, chip, checked=True).outputs["output0"]
        assert np.array_equal(out, ref)
    assert len(slices) > 1  # heads slices on the smaller lanes
