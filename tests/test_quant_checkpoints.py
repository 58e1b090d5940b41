"""Readers for pre-quantized checkpoints against REAL auto-round exports.

Every checkpoint comes from `auto-round` on the CPU (see quant_fixtures.py); the fake-quantized
float export of the same run is the reference. The readers must reproduce its weights
bit-exactly in float32 and its other tensors exactly (cast to the packed checkpoint's dtype:
auto_gptq / auto_awq exports store float tensors as float16).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quant_fixtures import (  # noqa: F401  (quant_checkpoints: the fixture)
    QuantCheckpoints,
    cache_key,
    check_reference_dtypes,
    quant_checkpoints,
    reusable_manifest,
)
from safetensors.numpy import load_file, save_file

from toptpu.frontends.quant import (
    AWQ_PACK_ORDER,
    QuantizedCheckpoint,
    QuantizedCheckpointError,
    QuantizedLinear,
    read_quantized_checkpoint,
    unpack_awq_columns,
    unpack_int32_columns,
    unpack_int32_rows,
)

pytestmark = pytest.mark.slow  # auto-round writes the checkpoints (tens of seconds)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEARS = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTN] + [
    f"model.layers.{i}.mlp.{p}" for i in range(2) for p in MLP
]
#: the layer the bad-input tests damage
LAYER = "model.layers.0.self_attn.q_proj"


@dataclass(frozen=True)
class Case:
    recipe: str
    fmt: str
    quant_method: str
    packing_format: str
    group_size: int  # -1: per channel
    sym: bool
    float_linears: tuple[str, ...] = ()
    eight_bit: tuple[str, ...] = ()
    eight_bit_sym: bool | None = None


CASES = {
    "gptq-asym-g32": Case(
        "qwen2_asym_g32", "auto_gptq", "gptq", "gptq", 32, False, ("model.layers.1.mlp.up_proj",)
    ),
    "awq-asym-g32": Case(
        "qwen2_asym_g32", "auto_awq", "awq", "awq_gemm", 32, False, ("model.layers.1.mlp.up_proj",)
    ),
    "autoround-awq-asym-g32": Case(
        "qwen2_asym_g32_autoround",
        "auto_round",
        "auto-round",
        "auto_round:auto_awq",
        32,
        False,
        ("model.layers.1.mlp.up_proj",),
    ),
    "gptq-sym-g64-llama": Case(
        "llama_sym_g64",
        "auto_gptq",
        "gptq",
        "gptq",
        64,
        True,
        eight_bit=("model.layers.0.mlp.down_proj",),
    ),
    "autoround-gptq-sym-g64-llama": Case(
        "llama_sym_g64",
        "auto_round",
        "auto-round",
        "auto_round:auto_gptq",
        64,
        True,
        eight_bit=("model.layers.0.mlp.down_proj",),
    ),
    "gptq-asym-perchannel": Case(
        "qwen2_asym_perchannel",
        "auto_gptq",
        "gptq",
        "gptq",
        -1,
        False,
        eight_bit=("model.layers.0.mlp.down_proj",),
        eight_bit_sym=True,
    ),
    "autoround-plain-asym-perchannel": Case(
        "qwen2_asym_perchannel",
        "auto_round",
        "auto-round",
        "auto_round",
        -1,
        False,
        eight_bit=("model.layers.0.mlp.down_proj",),
        eight_bit_sym=True,
    ),
}


def _load_dir(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_matches_reference(ck: QuantizedCheckpoint, ref: dict[str, np.ndarray]) -> None:
    """Every dequantized weight bit-exact in f32; every other tensor equal (in its dtype)."""
    for name, lin in ck.linears.items():
        w = lin.dequantize()
        assert w.dtype == np.float32 and w.shape == ref[f"{name}.weight"].shape, name
        r = ref[f"{name}.weight"]
        assert np.array_equal(w, r), (
            f"{name}: {(w != r).sum()} weights differ, max |diff| {np.abs(w - r).max()}"
        )
        if lin.bias is not None:
            assert np.array_equal(lin.bias, ref[f"{name}.bias"].astype(lin.bias.dtype)), name
        else:
            assert f"{name}.bias" not in ref, name
    for key, t in ck.float_tensors.items():
        assert key in ref, key
        assert np.array_equal(t, ref[key].astype(t.dtype)), key
    assert set(ck.dequantized_state_dict()) == set(ref)


# ----------------------------------------------------------------------------------------------
# real checkpoints vs their fake-quantized reference


@pytest.mark.parametrize("case_id", list(CASES))
def test_dequantize_equals_fake_quantized_reference(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    case_id: str,
) -> None:
    case = CASES[case_id]
    ck = read_quantized_checkpoint(quant_checkpoints.path(case.recipe, case.fmt))
    assert ck.quant_method == case.quant_method
    assert ck.packing_format == case.packing_format
    assert sorted(ck.linears) == sorted(set(ALL_LINEARS) - set(case.float_linears))
    for name in case.float_linears:
        assert f"{name}.weight" in ck.float_tensors
    for name, lin in ck.linears.items():
        bits = 8 if name in case.eight_bit else 4
        sym = (
            case.eight_bit_sym
            if (name in case.eight_bit and case.eight_bit_sym is not None)
            else case.sym
        )
        k = lin.in_features
        assert (lin.bits, lin.sym) == (bits, sym), name
        assert lin.group_size == (k if case.group_size == -1 else case.group_size), name
        assert lin.qweight.dtype == np.uint8 and int(lin.qweight.max()) < 2**bits
        assert lin.zeros.dtype == np.uint8 and lin.zeros.shape == lin.scales.shape
        assert lin.scales.shape == (lin.out_features, k // lin.group_size)
        assert lin.scales.dtype == np.float16  # auto-round stores scales in float16
        assert lin.g_idx is None  # auto-round never writes act-order
        if sym:
            assert np.all(lin.zeros == 2 ** (bits - 1))
    assert_matches_reference(ck, _load_dir(quant_checkpoints.reference(case.recipe)))


def test_autoround_rerun_is_bit_identical_to_the_reference_run(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
) -> None:
    """The auto_round (awq-packed) export comes from a second, identical run (see
    quant_fixtures.RECIPES); its packed tensors equal the first run's AWQ export, so the first
    run's fake export is its reference."""
    a = _load_dir(quant_checkpoints.path("qwen2_asym_g32", "auto_awq"))
    b = _load_dir(quant_checkpoints.path("qwen2_asym_g32_autoround", "auto_round"))
    assert set(a) == set(b)
    for key in a:
        if a[key].dtype == np.int32:
            assert np.array_equal(a[key], b[key]), key
        else:  # auto_awq writes float16, auto_round keeps float32 where it does not pack
            assert np.array_equal(a[key], b[key].astype(a[key].dtype)), key



def test_references_are_float32_and_a_bf16_reference_is_refused(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The fixture's references are float32 on any CPU; one bf16 tensor in a reference (what
    auto-round's amp wrote on bf16-capable CPUs) makes the fixture refuse it, naming it."""
    import torch
    from safetensors.torch import load_file as load_pt
    from safetensors.torch import save_file as save_pt

    check_reference_dtypes(quant_checkpoints.manifest)
    ref = _copy(quant_checkpoints.reference("llama_sym_g64"), tmp_path / "fake")
    t = load_pt(str(ref / "model.safetensors"))
    assert {v.dtype for v in t.values()} == {torch.float32}
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.bfloat16)
    save_pt(t, str(ref / "model.safetensors"), metadata={"format": "pt"})
    manifest = {"runs": {"llama_sym_g64": {"fake": str(ref)}}}
    with pytest.raises(RuntimeError, match=r"llama_sym_g64: model\.norm\.weight .* is BF16"):
        check_reference_dtypes(manifest)


def test_a_manifest_of_other_code_or_producers_is_not_reused(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Only a manifest with the current key (fixture source hash, auto-round/torch/transformers
    versions) is reused: one written before the key existed, or by another auto-round, is not."""
    current = json.loads((quant_checkpoints.root / "manifest.json").read_text())
    assert current["key"] == cache_key()
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(current))
    assert reusable_manifest(path) == current
    old = {k: v for k, v in current.items() if k != "key"} | {"auto_round": "0.16.1"}
    path.write_text(json.dumps(old))
    assert reusable_manifest(path) is None
    path.write_text(json.dumps(current | {"key": current["key"] | {"auto-round": "0.16.0"}}))
    assert reusable_manifest(path) is None
    path.unlink()
    assert reusable_manifest(path) is None

# ----------------------------------------------------------------------------------------------
# derived from real checkpoints: act-order, gptq_v2, shards, config file placement


def _pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [K, N] -> int32 [K*bits/32, N], GPTQ qweight layout."""
    per = 32 // bits
    v = q.astype(np.uint32).reshape(q.shape[0] // per, per, q.shape[1])
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return np.ascontiguousarray(np.bitwise_or.reduce(v << shifts, axis=1)).view(np.int32)


def _pack_cols(z: np.ndarray, bits: int) -> np.ndarray:
    """uint [G, N] -> int32 [G, N*bits/32], GPTQ qzeros layout."""
    per = 32 // bits
    v = z.astype(np.uint32).reshape(z.shape[0], z.shape[1] // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.ascontiguousarray(np.bitwise_or.reduce(v << shifts, axis=2)).view(np.int32)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the quantization config in config.json and in the JSON beside it."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    edit(cfg["quantization_config"])
    cfg_path.write_text(json.dumps(cfg))
    for name in ("quantization_config.json", "quantize_config.json"):
        p = model_dir / name
        if p.is_file():
            qc = json.loads(p.read_text())
            edit(qc)
            p.write_text(json.dumps(qc))


def _edit_tensors(model_dir: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_gptq_act_order_g_idx_is_honoured(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    """auto-round always writes desc_act=false with a trivial g_idx, so the act-order case is
    derived from its real GPTQ export: each layer's input channels are permuted by a seeded
    permutation P, consistently in qweight (stored in the new channel order) and g_idx (group
    of new channel k = old group of channel P[k]) -- exactly the structure desc_act produces,
    groups being arbitrary sets of channels. The dequantized weight must be ref[:, P]."""
    src = quant_checkpoints.path("qwen2_asym_g32", "auto_gptq")
    ref = _load_dir(quant_checkpoints.reference("qwen2_asym_g32"))
    d = _copy(src, tmp_path / "act_order")
    rng = np.random.default_rng(1)
    perms: dict[str, np.ndarray] = {}

    def permute(t: dict[str, np.ndarray]) -> None:
        for name in [k[: -len(".qweight")] for k in t if k.endswith(".qweight")]:
            q = unpack_int32_rows(t[f"{name}.qweight"], 4)  # [K, N]
            p = rng.permutation(q.shape[0])
            perms[name] = p
            t[f"{name}.qweight"] = _pack_rows(q[p], 4)
            t[f"{name}.g_idx"] = t[f"{name}.g_idx"][p].astype(np.int32)

    _edit_tensors(d, permute)
    _edit_config(d, lambda qc: qc.update(desc_act=True))
    ck = read_quantized_checkpoint(d)
    assert set(ck.linears) == set(perms)
    for name, lin in ck.linears.items():
        assert lin.g_idx is not None and lin.g_idx.dtype == np.int32
        w = lin.dequantize()
        assert np.array_equal(w, ref[f"{name}.weight"][:, perms[name]]), name
        trivial = QuantizedLinear(**{**lin.__dict__, "g_idx": None})
        assert not np.array_equal(trivial.dequantize(), w), f"{name}: g_idx made no difference"

    # act-order without g_idx cannot be decoded
    _edit_tensors(d, lambda t: t.pop("model.layers.0.mlp.up_proj.g_idx"))
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.0\.mlp\.up_proj.*'g_idx'"):
        read_quantized_checkpoint(d)


@pytest.mark.parametrize("recipe", ["qwen2_asym_g32", "llama_sym_g64"])
def test_gptq_v2_zero_points_have_no_offset(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
    recipe: str,
) -> None:
    """checkpoint_format gptq_v2 (GPTQModel) stores the zero point itself: convert a real v1
    export (stored zero-1) by repacking zero+1, and the weights must not change."""
    src = quant_checkpoints.path(recipe, "auto_gptq")
    v1 = read_quantized_checkpoint(src)
    d = _copy(src, tmp_path / "v2")

    def to_v2(t: dict[str, np.ndarray]) -> None:
        for name, lin in v1.linears.items():
            t[f"{name}.qzeros"] = _pack_cols(lin.zeros.T, lin.bits)

    _edit_tensors(d, to_v2)
    _edit_config(d, lambda qc: qc.update(checkpoint_format="gptq_v2"))
    v2 = read_quantized_checkpoint(d)
    assert v2.packing_format == "gptq_v2"
    assert_matches_reference(v2, _load_dir(quant_checkpoints.reference(recipe)))


def test_sharded_checkpoint_with_index(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = quant_checkpoints.path("llama_sym_g64", "auto_gptq")
    d = _copy(src, tmp_path / "sharded")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in ks})
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_matches_reference(
        read_quantized_checkpoint(d), _load_dir(quant_checkpoints.reference("llama_sym_g64"))
    )

    # the index names a tensor no shard holds
    index["weight_map"]["model.layers.9.mlp.up_proj.qweight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.9\.mlp\.up_proj\.qweight"):
        read_quantized_checkpoint(d)
    # a shard is missing
    del index["weight_map"]["model.layers.9.mlp.up_proj.qweight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(QuantizedCheckpointError, match="model-00002-of-00002.safetensors"):
        read_quantized_checkpoint(d)


def test_quantization_config_beside_config_json(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = quant_checkpoints.path("qwen2_asym_g32", "auto_gptq")
    d = _copy(src, tmp_path / "beside")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    # auto-round writes quantization_config.json beside config.json
    assert read_quantized_checkpoint(d).quant_method == "gptq"
    # AutoGPTQ's quantize_config.json (which has no quant_method key)
    qc = json.loads((d / "quantization_config.json").read_text())
    (d / "quantization_config.json").unlink()
    del qc["quant_method"]
    (d / "quantize_config.json").write_text(json.dumps(qc))
    ck = read_quantized_checkpoint(d)
    assert ck.quant_method == "gptq" and len(ck.linears) == 13
    # none at all: a float checkpoint
    (d / "quantize_config.json").unlink()
    with pytest.raises(QuantizedCheckpointError, match="not a pre-quantized checkpoint"):
        read_quantized_checkpoint(d)


def test_bfloat16_tensors_keep_their_dtype(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Checkpoints of bf16 models store float tensors (and possibly scales) in bfloat16, which
    numpy lacks: they come back as ml_dtypes.bfloat16, and dequantize casts the scales' stored
    values to float32. (Derived from a real export by converting tensors with torch.)"""
    import ml_dtypes
    import torch
    from safetensors.torch import load_file as load_pt
    from safetensors.torch import save_file as save_pt

    src = quant_checkpoints.path("llama_sym_g64", "auto_round")
    d = _copy(src, tmp_path / "bf16")
    t = load_pt(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.bfloat16)
    t[f"{LAYER}.scales"] = t[f"{LAYER}.scales"].to(torch.bfloat16)
    save_pt(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    ck = read_quantized_checkpoint(d)
    norm = ck.float_tensors["model.norm.weight"]
    assert norm.dtype == ml_dtypes.bfloat16
    assert np.array_equal(norm.astype(np.float32), t["model.norm.weight"].float().numpy())
    lin = ck.linears[LAYER]
    assert lin.scales.dtype == ml_dtypes.bfloat16
    s32 = t[f"{LAYER}.scales"].float().numpy().T  # [N, G]
    expected = (
        lin.qweight.astype(np.float32) - lin.zeros.astype(np.float32)[:, lin.group_index()]
    ) * s32[:, lin.group_index()]
    assert np.array_equal(lin.dequantize(), expected)


def test_unpack_helpers_layouts() -> None:
    # GPTQ: value i of a word is row/column i of its group of 32 // bits
    words = np.array([[0x76543210]], dtype=np.uint32).view(np.int32)
    assert unpack_int32_rows(words, 4)[:, 0].tolist() == list(range(8))
    assert unpack_int32_columns(words, 4)[0].tolist() == list(range(8))
    assert unpack_int32_columns(np.array([[0x04030201]], np.uint32).view(np.int32), 8)[
        0
    ].tolist() == [1, 2, 3, 4]
    # AWQ: column c sits in nibble AWQ_PACK_ORDER[c]
    cols = np.arange(8)
    word = sum(int(c) << (4 * AWQ_PACK_ORDER[c]) for c in cols)
    assert unpack_awq_columns(np.array([[word]], np.uint32).view(np.int32))[0].tolist() == list(
        cols
    )


# ----------------------------------------------------------------------------------------------
# bad input: a clear QuantizedCheckpointError naming the layer and the field


def _del(key: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda t: t.pop(key)


def _set(
    key: str, fn: Callable[[np.ndarray], np.ndarray]
) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        t[key] = fn(t[key])

    return edit


BAD_TENSORS = {
    "missing-scales": ("auto_gptq", _del(f"{LAYER}.scales"), [LAYER, "'scales'", "missing"]),
    "missing-qzeros-awq": ("auto_awq", _del(f"{LAYER}.qzeros"), [LAYER, "'qzeros'", "missing"]),
    "missing-qweight": ("auto_gptq", _del(f"{LAYER}.qweight"), [LAYER, "'qweight'", "missing"]),
    "misshaped-qzeros": (
        "auto_gptq",
        _set(f"{LAYER}.qzeros", lambda a: a[:1]),
        [LAYER, "'qzeros'", "shape"],
    ),
    "misshaped-scales-awq": (
        "auto_awq",
        _set(f"{LAYER}.scales", lambda a: a[:, :-8]),
        [LAYER, "'scales'", "shape"],
    ),
    "misshaped-g_idx": (
        "auto_gptq",
        _set(f"{LAYER}.g_idx", lambda a: a[:-1]),
        [LAYER, "'g_idx'", "shape"],
    ),
    "g_idx-out-of-range": (
        "auto_gptq",
        _set(f"{LAYER}.g_idx", lambda a: a + 5),
        [LAYER, "'g_idx'", "groups"],
    ),
    "qweight-not-int32": (
        "auto_gptq",
        _set(f"{LAYER}.qweight", lambda a: a.astype(np.float32)),
        [LAYER, "'qweight'", "dtype"],
    ),
    "exllama-q_perm": (
        "auto_gptq",
        lambda t: t.update({f"{LAYER}.q_perm": np.arange(64, dtype=np.int16)}),
        [LAYER, "'q_perm'", "exllama"],
    ),
    "float-weight-beside-qweight": (
        "auto_awq",
        lambda t: t.update({f"{LAYER}.weight": np.zeros((64, 64), np.float16)}),
        [LAYER, "'weight'", "unexpected"],
    ),
}


@pytest.mark.parametrize("case_id", list(BAD_TENSORS))
def test_bad_tensors_name_layer_and_field(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
    case_id: str,
) -> None:
    fmt, edit, needles = BAD_TENSORS[case_id]
    d = _copy(quant_checkpoints.path("qwen2_asym_g32", fmt), tmp_path / case_id)
    _edit_tensors(d, edit)
    with pytest.raises(QuantizedCheckpointError) as e:
        read_quantized_checkpoint(d)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"


BAD_CONFIGS: dict[str, tuple[str, str, Callable[[dict[str, Any]], None], list[str]]] = {
    "bits-3": (
        "qwen2_asym_g32",
        "auto_gptq",
        lambda qc: qc.update(bits=3),
        ["'bits'", "3-bit", "4, 8"],
    ),
    "bits-3-autoround": (
        "llama_sym_g64",
        "auto_round",
        lambda qc: qc.update(bits=3),
        ["model.layers.0.mlp.gate_proj", "'bits'", "from quantization_config"],
    ),
    "bits-8-awq": ("qwen2_asym_g32", "auto_awq", lambda qc: qc.update(bits=8), ["'bits'", "AWQ"]),
    "unknown-quant-method": (
        "qwen2_asym_g32",
        "auto_gptq",
        lambda qc: qc.update(quant_method="hqq"),
        ["quant_method", "'hqq'", "gptq, awq, auto-round"],
    ),
    "gptq-marlin-layout": (
        "qwen2_asym_g32",
        "auto_gptq",
        lambda qc: qc.update(checkpoint_format="marlin"),
        ["checkpoint_format", "'marlin'", "gptq_v2"],
    ),
    "awq-exllama-layout": (
        "qwen2_asym_g32",
        "auto_awq",
        lambda qc: qc.update(version="exllama"),
        ["version", "'exllama'", "gemm"],
    ),
    "autoround-fp8-packing": (
        "llama_sym_g64",
        "auto_round",
        lambda qc: qc.update(packing_format="auto_round:fp8"),
        ["packing_format", "'auto_round:fp8'"],
    ),
    "autoround-no-packing-format": (
        "llama_sym_g64",
        "auto_round",
        lambda qc: qc.pop("packing_format"),
        ["packing_format"],
    ),
    "group-size-does-not-divide": (
        "qwen2_asym_perchannel",
        "auto_round",
        lambda qc: qc.update(group_size=48),
        ["'group_size'", "48", "does not divide"],
    ),
    "sym-contradicts-zero-points": (
        "qwen2_asym_g32",
        "auto_gptq",
        lambda qc: qc.update(sym=True),
        ["'qzeros'", "sym=true"],
    ),
    "v2-label-on-v1-zeros": (
        "llama_sym_g64",
        "auto_gptq",
        lambda qc: qc.update(checkpoint_format="gptq_v2"),
        ["'qzeros'", "offset"],
    ),
    "config-keeps-packed-layer-float": (
        "qwen2_asym_g32",
        "auto_gptq",
        lambda qc: qc.setdefault("dynamic", {}).update({"-:.*q_proj": {}}),
        [LAYER, "'qweight'", "dynamic"],
    ),
    "awq-not-convert-packed-layer": (
        "qwen2_asym_g32",
        "auto_awq",
        lambda qc: qc["modules_to_not_convert"].append("self_attn.q_proj"),
        [LAYER, "modules_to_not_convert"],
    ),
    "autoround-extra-config-quantizes-float-layer": (
        "qwen2_asym_g32_autoround",
        "auto_round",
        lambda qc: qc["extra_config"].update({"model.layers.1.mlp.up_proj": {"bits": 4}}),
        ["model.layers.1.mlp.up_proj", "extra_config", "float"],
    ),
    "activation-quantization": (
        "llama_sym_g64",
        "auto_round",
        lambda qc: qc.update(act_bits=8),
        ["'act_bits'", "weight-only"],
    ),
    "missing-bits": ("qwen2_asym_g32", "auto_gptq", lambda qc: qc.pop("bits"), ["'bits'"]),
}


@pytest.mark.parametrize("case_id", list(BAD_CONFIGS))
def test_bad_configs_are_clear_errors(
    quant_checkpoints: QuantCheckpoints,  # noqa: F811
    tmp_path: Path,
    case_id: str,
) -> None:
    recipe, fmt, edit, needles = BAD_CONFIGS[case_id]
    d = _copy(quant_checkpoints.path(recipe, fmt), tmp_path / case_id)
    _edit_config(d, edit)
    with pytest.raises(QuantizedCheckpointError) as e:
        read_quantized_checkpoint(d)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in: {e.value}"


def test_bad_files(quant_checkpoints: QuantCheckpoints, tmp_path: Path) -> None:  # noqa: F811
    src = quant_checkpoints.path("qwen2_asym_g32", "auto_gptq")
    d = _copy(src, tmp_path / "files")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantizedCheckpointError, match="corrupt or truncated"):
        read_quantized_checkpoint(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(QuantizedCheckpointError, match=r"no \*\.safetensors"):
        read_quantized_checkpoint(d)
    with pytest.raises(QuantizedCheckpointError, match="not a directory"):
        read_quantized_checkpoint(tmp_path / "nowhere")
