"""The weight blob's layer chunks of several kinds (`WeightLayout.chunks` / `.layers`): each
layer's chunk is laid out as its own kind's, not as a union of every kind's tensors.

- planning with two chunk kinds: sizes, offsets, alignment, `layer_offset`;
- `check()` refuses each inconsistent field, naming it;
- a model file round trip whose two layers have different chunk layouts (a tiny compiled
  model rewritten so layer 1's tensors sit at other offsets) generates the same tokens on
  both executors, and a header whose net reads a tensor its layer's chunk lacks is refused;
- a mixed pre-quantized checkpoint (auto-round, one layer quantized differently) compiles
  to one chunk per layer variant, a file smaller than the union layout would give, with the
  greedy tokens of the fake-quantized reference.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from llm_fixtures import compiled
from quant_fixtures import quant_checkpoints  # noqa: F401 - session fixture

from toptpu.backend.formats.header_schema import HeaderError, decode, encode
from toptpu.backend.formats.llm_file import (
    WEIGHTS_SECTION,
    LlmFile,
    LlmHeader,
    WeightEntry,
    WeightLayout,
    align,
    const_section,
    stream_section,
    write_llm_file,
)
from toptpu.backend.runtime.runtime import Runtime

SHARED = {"embed": ((3,), "float32"), "norm": ((5, 5), "float16")}
#: two layer kinds: different names, sizes and dtypes
KIND_A = {"layer.x": ((10,), "float32"), "layer.y": ((7,), "int8")}
KIND_B = {"layer.z": ((100,), "bfloat16")}
LAYER_KINDS = [0, 0, 0, 1, 0, 0, 0, 1]  # 3:1, as Qwen3.5 mixes its attention kinds


def _two_kinds() -> WeightLayout:
    return WeightLayout.plan(SHARED, [KIND_A, KIND_B], LAYER_KINDS)


def _union_size(layout: WeightLayout) -> int:
    """The blob size if every layer had one chunk holding every kind's tensors."""
    union = {n: (e.shape, e.dtype) for chunk in layout.chunks for n, e in chunk.items()}
    return _replan(layout.shared, [union], [0] * layout.num_layers).size


# ============================================================================ planning


def test_two_chunk_kinds_are_laid_out_each_with_its_own_layout() -> None:
    layout = _two_kinds()
    layout.check()
    # shared: embed 12 bytes at 0, norm 50 bytes at 64 -> 128
    assert layout.shared["norm"].offset == 64 and layout.shared_size == 128
    # kind A: x 40 bytes at 0, y 7 bytes at 64 -> 128; kind B: z 200 bytes -> 256
    assert [layout.chunk_size(c) for c in (0, 1)] == [128, 256]
    assert layout.chunks[0]["layer.y"] == WeightEntry(64, (7,), "int8", 7)
    assert layout.chunks[1]["layer.z"] == WeightEntry(0, (100,), "bfloat16", 200)
    starts = [128, 256, 384, 512, 768, 896, 1024, 1152]
    assert [la.offset for la in layout.layers] == starts
    assert [la.chunk for la in layout.layers] == LAYER_KINDS
    assert layout.size == 1152 + 256 and layout.num_layers == 8
    assert all(s % 64 == 0 for s in starts)
    assert layout.layer_offset(3, "layer.z") == 512
    assert layout.layer_offset(4, "layer.y") == 768 + 64
    assert layout.layer_size(3) == 256 and layout.layer_size(4) == 128
    assert layout.chunk_of(7) is layout.chunks[1]
    assert layout.chunk_layers(1) == [3, 7]
    with pytest.raises(KeyError):
        layout.layer_offset(3, "layer.x")  # a kind-B layer has no x
    # the union chunk would hold x, y and z in every layer: 8 x 384 bytes
    assert _union_size(layout) == 128 + 8 * 384 > layout.size


def test_one_kind_has_one_chunk_and_layers_follow_each_other_by_its_size() -> None:
    layout = WeightLayout.plan(SHARED, [KIND_A], [0] * 3)
    layout.check()
    assert len(layout.chunks) == 1
    assert [la.offset for la in layout.layers] == [128, 256, 384]
    assert layout.size == 128 + 3 * 128 == _union_size(layout)


def test_a_chunk_index_out_of_range_is_a_planning_error() -> None:
    with pytest.raises(ValueError, match="layer 1: chunk 2 of 2"):
        WeightLayout.plan(SHARED, [KIND_A, KIND_B], [0, 2])


def test_the_header_form_round_trips() -> None:
    layout = _two_kinds()
    data = json.loads(json.dumps(encode(layout)))
    assert sorted(data) == ["alignment", "chunks", "layers", "section", "shared", "size"]
    assert data["layers"][3] == {"chunk": 1, "offset": 512}
    back = decode(WeightLayout, data, "weights")
    back.check()
    assert back == layout


# ============================================================================ check()


def _set(path: list[Any], value: Any):  # noqa: ANN202 - a header mutation
    def mutate(d: dict[str, Any]) -> None:
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def _alias_in_chunk(d: dict[str, Any]) -> None:
    d["chunks"][0]["layer.y"] = dict(d["chunks"][0]["layer.x"])


def _swap_layers(d: dict[str, Any]) -> None:
    d["layers"][2], d["layers"][3] = d["layers"][3], d["layers"][2]


def _drop_chunk_use(d: dict[str, Any]) -> None:
    d["chunks"].append({"layer.w": {"offset": 0, "shape": [4], "dtype": "float32",
                                    "nbytes": 16}})


def _shared_name_in_chunk(d: dict[str, Any]) -> None:
    d["chunks"][1]["embed"] = {"offset": 256, "shape": [1], "dtype": "float32", "nbytes": 4}


REFUSALS = [
    (_set(["layers", 2, "chunk"], 2), r"weights\.layers\[2\]\.chunk is 2, the file has 2 "),
    (_set(["layers", 1, "offset"], 320),
     r"weights\.layers\[1\]\.offset is 320, layer 0's chunk ends at 256"),
    (_set(["layers", 0, "offset"], 64),
     r"weights\.layers\[0\]\.offset is 64, the shared region ends at 128"),
    (_swap_layers, r"weights\.layers\[2\]\.offset is 512, layer 1's chunk ends at 384"),
    (_set(["chunks", 1, "layer.z", "offset"], 64),
     r"weights\.chunks\[1\]\.layer\.z\.offset is 64, the tensor before it ends at 0"),
    (_set(["chunks", 0, "layer.x", "nbytes"], 41),
     r"weights\.chunks\[0\]\.layer\.x\.nbytes is 41, float32 \[10\] takes 40"),
    (_alias_in_chunk, r"weights\.chunks\[0\]\.layer\.y\.offset is 0, the tensor before it "
                      r"ends at 64"),
    (_shared_name_in_chunk, r"weights\.chunks\[1\]\.embed is also a shared tensor"),
    (_drop_chunk_use, r"weights\.chunks\[2\] is the chunk of no layer"),
    (_set(["size"], 1152 + 128), r"weights\.size is 1280, the weight table gives 1408"),
    (_set(["shared", "norm", "offset"], 32),
     r"weights\.shared\.norm\.offset is 32, the tensor before it ends at 64"),
]


@pytest.mark.parametrize("mutate,message", REFUSALS)
def test_check_names_the_bad_field(mutate, message: str) -> None:  # noqa: ANN001
    data = json.loads(json.dumps(encode(_two_kinds())))
    mutate(data)
    with pytest.raises(HeaderError, match=message):
        decode(WeightLayout, data, "weights").check()


def test_decoding_refuses_a_negative_chunk_index_and_the_old_fields() -> None:
    data = json.loads(json.dumps(encode(_two_kinds())))
    bad = copy.deepcopy(data)
    bad["layers"][0]["chunk"] = -1
    with pytest.raises(HeaderError, match=r"weights\.layers\[0\]\.chunk is -1"):
        decode(WeightLayout, bad, "weights")
    old = {**data, "layer_stride": 128}  # a format-1 field
    with pytest.raises(HeaderError, match=r"weights\.layer_stride is not a field"):
        decode(WeightLayout, old, "weights")


# ============================================================================ model file


def _rewrite(src: LlmFile, path: str, header_json: dict[str, Any], blob: np.ndarray) -> None:
    """`src`'s nets, streams and tokenizer with another header and weight blob."""
    meta = LlmHeader.from_json(header_json)
    irs = {n: src.net_ir(n) for n in meta.nets}
    streams = {}
    for n in meta.nets:
        streams[stream_section(n)] = src.file.read(stream_section(n))
        streams[const_section(n)] = src.file.read(const_section(n))
    write_llm_file(path, meta, irs, src.tokenizer_files(), blob, extra_sections=streams)


def _replan(shared: dict[str, WeightEntry], chunks: list[dict[str, Any]],
            layer_chunks: list[int]) -> WeightLayout:
    """A layout with `shared` as it is (aliases kept) and the chunks planned anew."""
    unique: dict[WeightEntry, str] = {}
    for name, e in sorted(shared.items(), key=lambda kv: kv[1].offset):
        unique.setdefault(e, name)
    layout = WeightLayout.plan({n: (e.shape, e.dtype) for e, n in unique.items()}, chunks,
                               layer_chunks)
    assert all(layout.shared[n] == e for e, n in unique.items())
    layout.shared = dict(shared)
    layout.check()
    return layout


def _second_kind(src: LlmFile) -> tuple[dict[str, Any], np.ndarray]:
    """`src` (two layers of one chunk layout) with layer 1 laid out differently: a chunk
    of its own, its tensors in reverse order after a 1000-byte pad, so every one of layer 1's
    tensors lies at another offset in its chunk than layer 0's."""
    layout = src.layout
    (kind,) = layout.chunks
    specs = {n: (e.shape, e.dtype) for n, e in kind.items()}
    other = {"layer.pad:extra": ((1000,), "uint8"),
             **{n: specs[n] for n in reversed(list(specs))}}
    new = _replan(layout.shared, [specs, other], [0, 1])
    old_blob = np.asarray(src.file.view(WEIGHTS_SECTION), np.uint8)
    blob = np.zeros(new.size, np.uint8)
    blob[:layout.shared_size] = old_blob[:layout.shared_size]
    for layer in range(2):
        for name, e in kind.items():
            a, b = layout.layer_offset(layer, name), new.layer_offset(layer, name)
            blob[b:b + e.nbytes] = old_blob[a:a + e.nbytes]
    pad = new.layer_offset(1, "layer.pad:extra")
    blob[pad:pad + 1000] = 0xA5
    header = copy.deepcopy(src.header)
    header["weights"] = encode(new)
    return header, blob


def test_a_file_whose_layers_have_different_chunk_layouts_round_trips(tmp_path_factory,
                                                                       tmp_path) -> None:
    built = compiled(tmp_path_factory, "qwen2", "f32", seq=64)
    src = LlmFile(built.model_file)
    header, blob = _second_kind(src)
    path = str(tmp_path / "two-kinds.toptpu")
    _rewrite(src, path, header, blob)
    f = LlmFile(path)
    assert len(f.layout.chunks) == 2 and f.layout.chunk_layers(1) == [1]
    assert f.layout.layer_offset(1, "layer.pad:extra") == f.layout.layer_start(1)
    for layer in range(2):  # the same tensors, read through each layer's own chunk layout
        want, got = src.layer_weights(layer), f.layer_weights(layer)
        assert set(got) - set(want) == ({"layer.pad:extra"} if layer else set())
        for name, arr in want.items():
            assert np.array_equal(got[name], arr), (layer, name)
    assert f.layout.size == src.layout.size + align(1000)
    prompt = "Hello world! The tensor processor runs"
    for executor in ("interpreter", "machine"):
        tokens = []
        for p in (built.model_file, path):
            rt = Runtime.open(p, executor=executor)
            tokens.append(rt.generate(rt.encode(prompt), 8, stop_on_eos=False).generated_ids)
        assert tokens[0] == tokens[1], executor
    f.close()
    src.close()


def test_a_header_whose_net_reads_a_tensor_its_layers_chunk_lacks_is_refused(
        tmp_path_factory) -> None:
    built = compiled(tmp_path_factory, "qwen2", "f32", seq=64)
    src = LlmFile(built.model_file)
    # layer 1's chunk without one of the tensors its nets read (the rest tiles anew)
    (kind,) = src.layout.chunks
    specs = {n: (e.shape, e.dtype) for n, e in kind.items()}
    name = next(iter(specs))
    lacking = {n: s for n, s in specs.items() if n != name}
    header = copy.deepcopy(src.header)
    header["weights"] = encode(_replan(src.layout.shared, [specs, lacking], [0, 1]))
    reader = next(n for n, net in header["nets"].items() if name in net["weights"])
    with pytest.raises(HeaderError, match=rf"layer_nets\.\w+\[1\] is '{reader}', which "
                                          rf"reads '{name}': not in layer 1's chunk "
                                          rf"\(weights\.chunks\[1\]\)"):
        LlmHeader.from_json(header)
    # ... and with no chunk holding it, the first layer that runs the net is named
    header["weights"] = encode(_replan(src.layout.shared, [lacking], [0, 0]))
    with pytest.raises(HeaderError, match=rf"layer_nets\.\w+\[0\] is '{reader}', which "
                                          rf"reads '{name}': not in layer 0's chunk"):
        LlmHeader.from_json(header)
    short = copy.deepcopy(src.header)
    short["weights"]["layers"] = short["weights"]["layers"][:1]
    short["weights"]["size"] = short["weights"]["layers"][0]["offset"] + src.layout.chunk_size(0)
    with pytest.raises(HeaderError, match=r"weights\.layers has 1 entries, model\.num_layers "
                                          r"is 2"):
        LlmHeader.from_json(short)
    for old_format in (1, 2):  # one chunk layout for all layers; one prefill length
        old = {**copy.deepcopy(src.header), "llm_format": old_format}
        with pytest.raises(HeaderError, match=rf"llm_format is {old_format}, not 3"):
            LlmHeader.from_json(old)
    src.close()


# ============================================================================ end to end

#: mixed auto-round checkpoints (`quant_fixtures.RECIPES`): qwen2_asym_g32 leaves layer 1's
#: up_proj in float, llama_sym_g64 quantizes layer 0's down_proj to 8 bits
MIXED = [("qwen2_asym_g32", "auto_gptq"), ("llama_sym_g64", "auto_gptq")]


@pytest.mark.slow  # auto-round writes the checkpoints, then compile and generate
@pytest.mark.parametrize("recipe,fmt", MIXED)
def test_a_mixed_checkpoint_has_a_chunk_per_layer_variant_and_a_smaller_file(
        quant_checkpoints, tmp_path, recipe: str, fmt: str) -> None:  # noqa: ANN001, F811
    import torch
    from transformers import AutoModelForCausalLM

    from toptpu.compiler import compile as compile_model

    runs = quant_checkpoints.manifest["runs"]
    path = str(tmp_path / f"{recipe}.toptpu")
    compile_model(runs[recipe][fmt], path, mode="w4f32", seq_length=64, max_input_length=16,
                  progress=None)
    f = LlmFile(path)
    layout, h = f.layout, f.header
    # one chunk per layer variant: layer 0 runs block, layer 1 block@1, each with its chunk
    assert h["layer_nets"]["block"] == ["block", "block@1"]
    assert len(layout.chunks) == 2 and [la.chunk for la in layout.layers] == [0, 1]
    for layer, net in enumerate(h["layer_nets"]["block"]):
        reads = {w for n in h["layer_nets"] for w in h["nets"][h["layer_nets"][n][layer]]
                 ["weights"] if w not in layout.shared}
        assert set(layout.chunk_of(layer)) == reads, net  # its own tensors, nothing else
    names = [set(c) for c in layout.chunks]
    assert not names[0] & names[1]  # the variants' tensors differ (v1.-prefixed)
    union = _union_size(layout)
    saved = union - layout.size
    print(f"{recipe}: blob {layout.size} bytes, the union layout {union} "
          f"({saved / union:.1%} smaller); chunks {layout.chunk_size(0)} and "
          f"{layout.chunk_size(1)} bytes")
    assert saved == sum(layout.chunk_size(1 - la.chunk) for la in layout.layers) > 0
    # the greedy tokens of the fake-quantized reference (test_llm_prequantized's oracle)
    rt = Runtime.open(path)
    ids = rt.encode("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    res = rt.generate(ids, 16, stop_on_eos=False)
    ref_model = AutoModelForCausalLM.from_pretrained(runs[recipe]["fake"],
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False)
    assert res.generated_ids == ref[0, len(ids):].tolist()
    f.close()
