"""The LLM model file: compile time and IR stay flat with the layer count (weights grow),
the header carries what `toptpu run` needs, a corrupt file is a clear error, and the
command line runs from the file alone."""

from __future__ import annotations

import json
import shutil

import pytest
from llm_fixtures import LONG_PROMPT, compiled, tiny_dir

from helpers import run_tool
from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.formats.model_file import ModelFileError, write_model_file
from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main
from toptpu.compiler import compile as compile_model
from toptpu.passes.pipelines import top_pipeline_passes, tpu_pipeline_passes

pytestmark = pytest.mark.slow  # compiles model files up to 8 layers and runs the CLI in processes


def test_nets_compiled_and_ir_stay_flat_from_2_to_8_layers(tmp_path_factory, tmp_path) -> None:
    """8 layers compile the same nets as 2 (one per layer variant, not one per layer) to the
    same IR, and their weights grow by whole layer chunks. The compile times are printed
    (bench/scale.py measures them), not asserted: a loaded host makes any bound flaky."""
    results = {}
    for layers in (2, 8):
        results[layers] = compile_model(tiny_dir(tmp_path_factory, "qwen2", layers),
                                        str(tmp_path / f"{layers}.toptpu"), mode="w4bf16",
                                        seq_length=64, max_input_length=16, progress=None)
    small, big = results[2], results[8]
    # each net is compiled once: the same nets, their IR (what codegen turns into
    # commands) identical
    assert sorted(big.nets) == sorted(small.nets)
    for name, net in small.nets.items():
        assert big.nets[name].ir_bytes == net.ir_bytes, name
    f2, f8 = LlmFile(small.path), LlmFile(big.path)
    for name in small.nets:
        assert f2.net_ir(name) == f8.net_ir(name)
    # weights grow by whole layer chunks of the same layout
    assert f2.layout.chunks == f8.layout.chunks
    assert f2.layout.shared_size == f8.layout.shared_size
    assert f8.layout.size - f2.layout.size == 6 * f2.layout.chunk_size(0)
    net_time = {n: sum(v for k, v in r.timings.items() if k.startswith("net:"))
                for n, r in results.items()}
    print(f"net compile time: 2 layers {net_time[2]:.2f}s, 8 layers {net_time[8]:.2f}s; "
          f"weights {small.timings['weights']:.3f}s vs {big.timings['weights']:.3f}s")
    f2.close()
    f8.close()


def test_header_carries_shapes_config_generation_and_tokenizer(tmp_path_factory) -> None:
    f = LlmFile(compiled(tmp_path_factory, "llama3").model_file)
    h = f.header
    assert h["kind"] == "toptpu-llm" and h["chip"] == "bm1684x" and h["mode"] == "f32"
    assert h["shapes"] == {"seq_length": 160, "max_input_length": 16, "max_history": 160,
                           "prefill_lengths": [16]}
    assert h["model"]["family"] == "llama" and h["model"]["tied_embeddings"]
    assert h["model"]["config"]["rope_parameters"]["rope_type"] == "llama3"
    assert h["generation"]["eos_token_ids"] == [2, 0]
    assert "tokenizer.json" in h["tokenizer"]["files"]
    # every net carries its command streams and constant pool for the machine
    assert all(n["streams"] == f"stream:{name}" and n["consts"] == f"const:{name}"
               and n["commands"] > 0 for name, n in h["nets"].items())
    assert {n for n, d in h["nets"].items() if d["per_layer"]} == {"block", "block_kv",
                                                                    "block_cache"}
    # tied embeddings: the f32 embedding table and lm_head weight are stored once
    sh = f.layout.shared
    assert sh["embed_tokens.weight"].offset == sh["lm_head.weight"].offset
    f.close()


def _corrupt(src: str, dst: str, offset_from_end: int) -> None:
    shutil.copy(src, dst)
    with open(dst, "r+b") as fh:
        fh.seek(-offset_from_end, 2)
        b = fh.read(1)
        fh.seek(-offset_from_end, 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_truncated_and_foreign_files_are_clear_errors(tmp_path_factory, tmp_path
                                                              ) -> None:
    good = compiled(tmp_path_factory, "qwen2").model_file
    bad = str(tmp_path / "bad.toptpu")
    _corrupt(good, bad, 100)  # inside the weight blob, the last section
    with pytest.raises(ModelFileError, match="checksum mismatch in section 'weights'"):
        Runtime.open(bad)
    short = str(tmp_path / "short.toptpu")
    with open(good, "rb") as fh, open(short, "wb") as out:
        out.write(fh.read()[:-4096])
    with pytest.raises(ModelFileError, match="truncated"):
        Runtime.open(short)
    other = str(tmp_path / "other.toptpu")
    write_model_file(other, {"kind": "something else"}, {"x": b"123"})
    with pytest.raises(ModelFileError, match="not an LLM model file"):
        Runtime.open(other)
    res = run_tool("toptpu", "run", bad, "--prompt", "Hello")
    assert res.returncode == 1
    assert "toptpu run: error:" in res.stderr and "checksum mismatch" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_compile_and_run_json(tmp_path_factory, tmp_path, capsys) -> None:
    """`toptpu compile` (in process), then `toptpu run --json` in a fresh process on the
    file alone: the same greedy tokens as the runtime API, with the timing fields."""
    model_dir = tiny_dir(tmp_path_factory, "qwen3")
    out = str(tmp_path / "m.toptpu")
    dump = tmp_path / "dump"
    code = main(["compile", model_dir, "-q", "w4bf16", "--chip", "bm1684x", "--seq-length",
                 "64", "--max-input-length", "16", "-o", out, "--dump-ir", str(dump)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "8/8 sample_head" in err and "wrote" in err
    assert (dump / "weights.safetensors").exists()
    passes = len(top_pipeline_passes()) + len(tpu_pipeline_passes("w4bf16", chip="bm1684x"))
    dumps = sorted(p.name for p in (dump / "block_cache").iterdir() if p.suffix == ".mlir")
    assert len(dumps) == 1 + passes and dumps[0] == "00-import.mlir"
    assert (dump / "block_cache" / "passes.json").is_file()  # the pass of each file
    first = (dump / "block" / "00-import.mlir").read_text()
    assert str(dump / "weights.safetensors") in first and "top.matmul" in first
    res = run_tool("toptpu", "run", out, "--prompt", LONG_PROMPT, "--max-new-tokens", "8",
                   "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) >= {"prompt_ids", "generated_ids", "text", "ttft_s", "tokens_per_s",
                         "modelled_ttft_s", "modelled_tokens_per_s"}
    # the default executor is the machine: modelled chip time, which physics bounds below
    assert data["executor"] == "machine" and data["modelled_tokens_per_s"] > 0
    rt = Runtime.open(out, "interpreter")
    ours = rt.generate(rt.encode(LONG_PROMPT), 8)
    assert data["generated_ids"] == ours.generated_ids and data["prompt_ids"] == ours.prompt_ids
    assert data["text"] == rt.tokenizer.decode(ours.generated_ids, skip_special_tokens=True)
    for args, message in (
            (["-q", "w3"], "unknown quantization mode 'w3'"),
            (["--chip", "h100"], "unknown chip 'h100'"),
            (["--seq-length", "32", "--max-input-length", "64"],
             "--max-input-length 64 must be between 1")):
        assert main(["compile", model_dir, *args, "-o", out]) == 1
        err = capsys.readouterr().err
        assert f"toptpu compile: error: {message}" in err and "Traceback" not in err
