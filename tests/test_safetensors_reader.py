"""The one safetensors reader and writer (`toptpu.dialects.checkpoint_reader`), used by the
weight store, the HF loader and the pre-quantized checkpoint reader: torch-free, checked.

- `serialize` gives the bytes `safetensors.torch.save` gives (f32, f16, bf16, ints);
- a weight store reads its file through the reader (read-only memory-mapped views, bf16 as
  `ml_dtypes.bfloat16`) and a corrupt file is a `WeightStoreError` naming the file;
- `toptpu-opt` on a module whose store is a `.safetensors` file runs without importing torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from toptpu.dialects.checkpoint_reader import CheckpointReader, serialize
from toptpu.dialects.weight_store import WeightStore, WeightStoreError
from toptpu.frontends.hf_loader import ModelLoadError, checkpoint_tensors

FILECHECK_INPUTS = os.path.join(os.path.dirname(__file__), "filecheck", "Inputs")


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5))
    return {
        "a.f32": x.astype(np.float32),
        "b.f16": x.astype(np.float16),
        "c.bf16": x.astype(ml_dtypes.bfloat16),
        "d.i8": rng.integers(-128, 127, (7,)).astype(np.int8),
        "e.u8": rng.integers(0, 255, (2, 2)).astype(np.uint8),
        "f.i32": rng.integers(0, 1000, (4,)).astype(np.int32),
        "#marker": np.ones(1, np.int8),
    }


def _write(arrays: dict[str, np.ndarray], path: str) -> None:
    with open(path, "wb") as f:
        f.write(serialize(arrays))


def test_serialize_gives_the_bytes_safetensors_torch_gives(tmp_path: object) -> None:
    import torch
    from safetensors.torch import save as save_torch

    arrays = _arrays()
    theirs = save_torch({n: (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                             if a.dtype == ml_dtypes.bfloat16 else torch.from_numpy(a))
                         for n, a in arrays.items()})
    assert serialize(arrays) == theirs
    path = os.path.join(tmp_path, "w.safetensors")
    WeightStore.from_arrays(arrays).save(path)  # the weight store writes those bytes
    with open(path, "rb") as f:
        assert f.read() == theirs


def test_a_weight_store_reads_and_writes_without_torch(tmp_path: object) -> None:
    path = os.path.join(tmp_path, "w.safetensors")
    arrays = _arrays()
    WeightStore.from_arrays(arrays).save(path)
    store = WeightStore.open(path)
    assert store.names() == sorted(arrays)
    assert store.derived_names() == set()
    for name, a in arrays.items():
        assert store.shape(name) == a.shape
        got = store[name]
        assert got.dtype == a.dtype and np.array_equal(got.view(np.uint8), a.view(np.uint8))
        assert not got.flags.writeable  # a view of the mapped file, not a copy
    # tied tensors (one array under two names) are written as two tensors
    tied = WeightStore.from_arrays({"x": arrays["a.f32"]})
    tied["y"] = tied["x"]
    tied.save(os.path.join(tmp_path, "tied.safetensors"))
    again = WeightStore.open(os.path.join(tmp_path, "tied.safetensors"))
    assert np.array_equal(again["x"], again["y"])


def test_a_corrupt_weight_store_is_an_error_naming_the_file(tmp_path: object) -> None:
    path = os.path.join(tmp_path, "w.safetensors")
    _write(_arrays(), path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(WeightStoreError) as e:
        WeightStore.open(path)
    msg = str(e.value)
    assert f"weight store '{path}' is not a readable .safetensors file" in msg
    assert "truncated" in msg and "copy the complete" in msg


def test_the_loader_reads_shard_headers_through_the_reader(tmp_path: object) -> None:
    _write(_arrays(), os.path.join(tmp_path, "model.safetensors"))
    tensors = checkpoint_tensors(str(tmp_path))
    assert tensors["c.bf16"] == ((3, 5), "BF16") and tensors["a.f32"] == ((3, 5), "F32")
    with open(os.path.join(tmp_path, "model.safetensors"), "ab") as f:
        f.write(b"junk")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*4 bytes after its last "):
        checkpoint_tensors(str(tmp_path))


def test_the_reader_reads_the_filecheck_inputs() -> None:
    reader = CheckpointReader.file(os.path.join(FILECHECK_INPUTS, "checkpoint.safetensors"))
    assert reader.info("fc.weight#checkpoint.scales").dtype == "F16"
    assert reader.tensor("fc.weight#checkpoint.g_idx").dtype == np.int32


def test_toptpu_opt_on_a_safetensors_store_does_not_import_torch(tmp_path: object) -> None:
    """A pass that reads and derives weights, its result saved to a companion file, in a
    fresh interpreter: torch is never imported."""
    src = os.path.join(os.path.dirname(__file__), "filecheck", "convert_top_to_tpu.mlir")
    with open(src) as f:
        text = f.read().replace("@WEIGHTS@", os.path.join(FILECHECK_INPUTS,
                                                          "weights.safetensors"))
    inp, out = os.path.join(tmp_path, "in.mlir"), os.path.join(tmp_path, "out.mlir")
    with open(inp, "w") as f:
        f.write(text)
    script = f"""
import json, sys
sys.argv = ["toptpu-opt", {inp!r}, "-p",
            "convert-top-to-tpu{{mode=w4bf16 group-size=32}},weight-reorder", "-o", {out!r}]
from toptpu.opt import main
rc = main()
print(json.dumps({{"rc": rc, "modules": sorted(sys.modules)}}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rc"] in (0, None)
    loaded = [m for m in report["modules"]
              if m.split(".")[0] in ("torch", "transformers") or m == "safetensors.torch"]
    assert not loaded, f"toptpu-opt loaded {loaded[:5]}"
    # it did the work: the result names its companion store, which holds the derived tensors
    companion = os.path.join(tmp_path, "out.weights.safetensors")
    with open(out) as f:
        assert companion in f.read()
    derived = WeightStore.open(companion).names()
    assert any(":q4" in n for n in derived), derived
