"""Expert parallelism (`--parallel ep`) beyond float checkpoints: a pre-quantized MoE
checkpoint auto-round wrote (GPTQ-packed experts) and a GGUF `qwen3moe` file the `gguf`
package wrote, their packed experts cut along E (each device its E/N experts' integers,
scales and zero points or mins, byte for byte the one-device file's); a token's k experts
above a device's E/N (Qwen2-MoE's top-4 over 4 devices of 2 experts); `--batch B` and
`toptpu profile` of an ep file. Greedy tokens (f32 activations, 32 tokens, a prompt longer
than the prefill chunk) equal the one-device file's; what ep still cannot take is refused
in one line, the GGUF expert count before any tensor is read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock
from llm_fixtures import LONG_PROMPT, shared_dir, tiny_dir
from xdsl.dialects.builtin import f32, i32
from xdsl.ir import Block
from xdsl.utils.exceptions import VerifyException

from toptpu.backend.formats.commands import GlobalRef, Load, LocalRef, Space
from toptpu.backend.formats.llm_file import LlmFile, WeightLayout
from toptpu.backend.target.cost import expected_distinct
from toptpu.compiler import CompileError
from toptpu.compiler import compile as compile_model
from toptpu.dialects import top
from toptpu.dialects.common import tensor

#: a prompt of three prefill chunks of 16 (the last padded)
IDS = list(range(3, 42))


def _compile(source: str, path: str, devices: int, **request) -> str:
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(source, path, seq_length=160, max_input_length=16, progress=None,
                          devices=devices, parallel=None if devices == 1 else "ep",
                          **request)
    return path


def _pair(source: str, name: str, devices: int, tmp_path_factory, **request
          ) -> tuple[str, str]:
    """The one-device file and the ep file of `source` (compiled once a session)."""
    base = os.path.join(shared_dir(tmp_path_factory), name)
    return (_compile(source, f"{base}-1.toptpu", 1, **request),
            _compile(source, f"{base}-ep{devices}.toptpu", devices, **request))


def _same_tokens(one: str, spread: str, ids: list[int] | None = None) -> None:
    from toptpu.backend.runtime.runtime import Runtime

    par = LlmFile(spread).meta.parallel
    assert par is not None and par.strategy == "ep"
    a, b = Runtime.open(one), Runtime.open(spread)
    ids = IDS if ids is None else ids
    assert len(ids) > 2 * b.L and len(ids) % b.L
    want = a.generate(ids, 32, stop_on_eos=False).generated_ids
    assert b.generate(ids, 32, stop_on_eos=False).generated_ids == want


def _tensor(f: LlmFile, layout: WeightLayout, name: str, layer: int) -> np.ndarray:
    blob = np.frombuffer(f.file.view(layout.section), np.uint8)
    e = layout.chunk_of(layer)[name]
    base = layout.layer_start(layer)
    return blob[base + e.offset:base + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)


def _each_device_holds_its_experts(one_path: str, spread_path: str, fields: set[str]
                                   ) -> None:
    """Each device's chunk of a layer holds its E/N experts of every expert tensor (the
    one-device file's rows [d E/N, (d + 1) E/N), byte for byte: the checkpoint's
    `fields`), every other tensor whole and equal, and no whole expert tensor."""
    one, spread = LlmFile(one_path), LlmFile(spread_path)
    assert one.meta.weights is not None and spread.meta.parallel is not None
    whole = one.meta.weights
    devices = spread.meta.parallel.devices
    n = len(devices)
    cut_tag = f"@shard0-{n}"
    for layer in range(one.num_layers):
        experts = [nm for nm in whole.chunk_of(layer) if ".experts." in nm]
        assert {nm.rpartition(":ckpt.")[2] for nm in experts} == fields
        e = _tensor(one, whole, experts[0], layer).shape[0]
        per = e // n
        for d, dev in enumerate(devices):
            chunk = dev.weights.chunk_of(layer)
            cut = {nm for nm in chunk if cut_tag in nm}
            assert {nm.replace(cut_tag, "") for nm in cut} == set(experts)
            for name in chunk:
                got = _tensor(spread, dev.weights, name, layer)
                ref = _tensor(one, whole, name.replace(cut_tag, ""), layer)
                if name in cut:
                    assert got.shape[0] == per
                    ref = ref[d * per:(d + 1) * per]
                assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), (d, name)


# --------------------------------------------------------------------------- the local op


def test_the_local_experts_op_takes_k_above_its_experts() -> None:
    """A device's experts op holding 2 experts takes a token's 4 slots (those naming other
    devices' experts are -1): it verifies, and its FLOPs charge at most its 2 experts a
    row; k of 0 is still refused."""
    from toptpu.dialects.common import ShapedOp

    def op(k: int) -> top.MoeExpertsOp:
        vals = Block(arg_types=[tensor((3, 8), f32), tensor((2, 5, 8), f32),
                                tensor((2, 5, 8), f32), tensor((2, 8, 5), f32),
                                tensor((3, k), f32), tensor((3, k), i32)]).args
        return top.MoeExpertsOp(*vals)

    four, two = op(4), op(2)
    assert isinstance(four, ShapedOp)
    four.verify()
    assert (four.top_k, four.experts) == (4, 2)
    assert four.flops() == two.flops()
    with pytest.raises(VerifyException, match="k at least 1"):
        op(0).verify()


def test_an_indexed_load_of_k_above_a_devices_experts_moves_at_most_them() -> None:
    """One token's 4 of 8 experts, a device holding 2 of them (`@shard0-4`): it moves its
    expected part (1 expert's rows), never more than the 2 it holds, whatever the tokens."""
    def load(tokens: int) -> Load:
        return Load(id=1, name="l", deps=(0,), group=0, slice=0,
                    tensor=GlobalRef(Space("w"), "experts.gate_proj@shard0-4:f32"),
                    shape=(2, 8), dtype="float32", axis=-1,
                    local=LocalRef(0, (2, 8), "float32", 2, 2 * 32),
                    index=LocalRef(0, (tokens, 4), "int32", 1, tokens * 16))

    assert load(1).nbytes == round(expected_distinct(8, 1, 4) / 4 * 32) == 32
    for tokens in (2, 16, 256):
        assert 32 < load(tokens).nbytes <= 2 * 32


# --------------------------------------------------------------------------- refusals


def test_a_gguf_whose_experts_do_not_divide_is_refused_before_loading(tmp_path, monkeypatch
                                                                      ) -> None:
    """The expert count of a GGUF's metadata (`qwen3moe.expert_count`, 8) against
    `--devices 3`: refused in one line before a tensor is read (the loader never runs)."""
    from gguf_fixtures import write_gguf

    import toptpu.compiler as compiler

    path = write_gguf(str(tmp_path / "m.gguf"), "qwen3_moe", "Q8_0")

    def never(*args, **kw):
        raise AssertionError("the GGUF file was loaded")

    monkeypatch.setattr(compiler, "load_gguf", never)
    out = str(tmp_path / "never.toptpu")
    with pytest.raises(CompileError, match=re.escape(
            f"--devices 3 --parallel ep: num_experts 8 of {path} (its qwen3moe.* metadata) "
            "does not divide among 3 devices; use --devices 2 or 4 or 8, or --parallel pp")):
        compile_model(path, out, mode="w8f32", seq_length=64, max_input_length=16,
                      progress=None, devices=3, parallel="ep")
    assert not os.path.exists(out)


def test_batch_with_tensor_or_pipeline_parallel_is_still_refused(tmp_path_factory,
                                                                  tmp_path) -> None:
    out = str(tmp_path / "never.toptpu")
    with pytest.raises(CompileError, match="--batch 2 with --devices 2: the batch nets are "
                       r"compiled for one chip; give one of them \(or --parallel ep"):
        compile_model(tiny_dir(tmp_path_factory, "qwen3_moe"), out, seq_length=64,
                      max_input_length=16, progress=None, devices=2, parallel="pp", batch=2)
    assert not os.path.exists(out)


# --------------------------------------------------------------------------- executed


@pytest.mark.slow
def test_an_autoround_moe_checkpoint_over_two_devices(tmp_path_factory) -> None:
    """auto-round's GPTQ-packed Qwen3-MoE (8 experts, top-2, 4-bit group 32) under w4f32
    over 2 devices: the one-device file's 32 tokens, each device's blob its 4 experts'
    integers, scales and zero points exactly."""
    from moe_checkpoints import make

    runs = make(Path(shared_dir(tmp_path_factory)) / "autoround_moe")["runs"]
    one, two = _pair(runs["qwen3_moe"]["packed"], "autoround-qwen3_moe-w4f32", 2,
                     tmp_path_factory, mode="w4f32")
    _same_tokens(one, two)
    _each_device_holds_its_experts(one, two, {"qweight", "scales", "zeros"})


@pytest.mark.slow
def test_a_gguf_qwen3moe_over_two_devices(tmp_path_factory) -> None:
    """A qwen3moe GGUF of Q4_1 experts (scales and mins) under w4f32 over 2 devices: the
    one-device file's 32 tokens, each device's blob its experts' bytes exactly."""
    from gguf_fixtures import gguf_dir

    root = os.path.join(shared_dir(tmp_path_factory), "ep-gguf-qwen3_moe-q4_1")
    with FileLock(root + ".lock"):
        if not os.path.exists(os.path.join(root, "model.gguf")):
            gguf_dir(root, "qwen3_moe", "Q4_1")
    one, two = _pair(root, "ep-gguf-qwen3_moe-q4_1-w4f32", 2, tmp_path_factory, mode="w4f32")
    _same_tokens(one, two)
    _each_device_holds_its_experts(one, two, {"qweight", "scales", "mins"})


@pytest.mark.slow
def test_a_tokens_experts_above_a_devices_share(tmp_path_factory) -> None:
    """Qwen2-MoE top-4 of 8 experts over 4 devices of 2 (and its shared expert), f32: the
    one-device file's 32 tokens for a prompt of three chunks; each device's decode step
    read at most its 2 experts of a stacked tensor."""
    from toptpu.backend.runtime.runtime import Runtime

    model = tiny_dir(tmp_path_factory, "qwen2_moe")
    one, four = _pair(model, "qwen2_moe-8e-f32", 4, tmp_path_factory, mode="f32")
    ids = Runtime.open(one).encode(LONG_PROMPT)
    _same_tokens(one, four, ids)
    rt = Runtime.open(four, "machine")
    seen: list[list] = [[] for _ in rt.ex.machines]  # each device's indexed loads, every run

    def recording(m, d):
        steps = m.steps

        def run(*args, **kw):
            yield from steps(*args, **kw)
            seen[d].extend(f for f in m.fetched if ".experts." in f.tensor.name)
        return run

    for d, m in enumerate(rt.ex.machines):
        m.steps = recording(m, d)
    rt.generate(ids[:20], 2, stop_on_eos=False)
    for fetched in seen:
        assert fetched and all(len(f.rows) <= 2 and f.nbytes <= f.all_nbytes
                               for f in fetched)
    assert any(len(f.rows) == 2 for f in seen[0])  # a chunk's tokens chose both


@pytest.mark.slow
def test_batch_and_profile_of_an_ep_file(tmp_path_factory) -> None:
    """`--batch 2` over 2 devices (ep): a batch step of two conversations gives each the
    one-device file's greedy tokens; the ledger charges a batch step the step model's
    launches, host transfers and link time (the hidden rows sent from device 0) — its net
    times differ only by the experts the tokens chose (fetched by index); `toptpu
    profile` of the file prints the step bill with the sends to the other devices."""
    from toptpu.backend.runtime.batch import BatchDecoder, BatchRow
    from toptpu.backend.runtime.conversation import Conversation
    from toptpu.backend.runtime.runtime import Runtime
    from toptpu.backend.runtime.sampler import SamplingConfig
    from toptpu.profile_cli import profile_model, step_model

    model = tiny_dir(tmp_path_factory, "qwen3_moe")
    one = _compile(model, os.path.join(shared_dir(tmp_path_factory), "qwen3_moe-8e-f32-1"
                                       ".toptpu"), 1, mode="f32")
    path = _compile(model, os.path.join(shared_dir(tmp_path_factory),
                                        "qwen3_moe-8e-f32-ep2-b2.toptpu"), 2, mode="f32",
                    batch=2)
    ref = Runtime.open(one)
    prompts = [ref.encode(LONG_PROMPT), ref.encode("Hello there, how are you?")]
    want = [ref.generate(p, 8, stop_on_eos=False).generated_ids for p in prompts]
    rt = Runtime.open(path)
    batch = BatchDecoder(rt.engine)
    convs = [Conversation(rt.engine) for _ in prompts]
    greedy = SamplingConfig()
    got = [[rt.sampler.next_token(c.feed(p), greedy, "greedy", np.random.default_rng(0),
                                  list(c.tokens))] for c, p in zip(convs, prompts, strict=True)]
    steps = step_model(profile_model(path)[0])
    for _ in range(7):
        c0 = rt.ex.modelled_costs()
        tokens = batch.step([BatchRow(c, g[-1], greedy, "greedy", np.random.default_rng(0),
                                      [g[-1]]) for c, g in zip(convs, got, strict=True)])
        spent, model_cost = rt.ex.modelled_costs() - c0, steps.batch_step("greedy")
        assert (spent.launches, spent.transfers) == (model_cost.launches, model_cost.transfers)
        assert spent.link_s == pytest.approx(model_cost.link_s, rel=1e-9) and spent.link_s > 0
        for g, t in zip(got, tokens, strict=True):
            g.append(t)
    assert got == want
    res = subprocess.run([sys.executable, "-m", "toptpu.cli", "profile", path, "--quiet"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "hidden to the other devices" in res.stdout and "block_cache.b2" in res.stdout
