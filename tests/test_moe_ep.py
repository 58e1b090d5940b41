"""Expert parallelism executed (`--parallel ep`): a mixture of experts compiled with each
device holding E/N of every layer's experts (the `expert-parallel` pass: the stacked experts
cut along E, the routing indices made local, an all-reduce after the experts), run by the
device-group executor on one reference machine per device. Greedy tokens equal the
one-device file's and transformers' (Qwen3-MoE, Qwen2-MoE with its shared expert); each
device's blob holds only its experts; what ep cannot take is refused in one line; the
step accounting and `estimate` spread ep as the executor runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from filelock import FileLock
from llm_fixtures import LONG_PROMPT, hf_generate, shared_dir, tiny_dir

from toptpu.backend.formats.commands import GlobalRef, Load, LocalRef, Space
from toptpu.backend.formats.llm_file import LlmFile, WeightLayout
from toptpu.backend.runtime.accounting import Spread
from toptpu.backend.target.cost import expected_distinct
from toptpu.compiler import CompileError
from toptpu.compiler import compile as compile_model

#: the tiny families with 16 experts (Qwen3-MoE and Qwen3.5-MoE top-2: up to 8 devices
#: hold 2 each; Qwen2-MoE top-4 and a shared expert: up to 4 devices hold 4 each)
EXPERTS = 16


def _moe_dir(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    path = os.path.join(shared_dir(tmp_path_factory), f"{family}-e{EXPERTS}")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            with quiet_transformers():
                save_tiny_model(path, family, layers=2, num_experts=EXPERTS)
            open(os.path.join(path, "done"), "w").close()
    return path


def _compiled(tmp_path_factory: pytest.TempPathFactory, family: str, devices: int = 1,
              mode: str = "f32") -> str:
    model_dir = _moe_dir(tmp_path_factory, family)
    spread = "" if devices == 1 else f"-ep{devices}"
    path = os.path.join(shared_dir(tmp_path_factory), f"{family}-e{EXPERTS}-{mode}{spread}"
                        ".toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode=mode, seq_length=160, max_input_length=16,
                          progress=None, devices=devices,
                          parallel=None if devices == 1 else "ep")
    return path


# --------------------------------------------------------------------------- refusals


def _refused(model_dir: str, tmp_path, message: str, **request) -> None:
    out = str(tmp_path / "never.toptpu")
    with pytest.raises(CompileError, match=message):
        compile_model(model_dir, out, seq_length=64, max_input_length=16, progress=None,
                      **request)
    assert not os.path.exists(out)


def test_ep_on_a_dense_model_is_refused(tmp_path_factory, tmp_path) -> None:
    _refused(tiny_dir(tmp_path_factory, "qwen3"), tmp_path,
             r"--devices 2 --parallel ep: .*config.json has no mixture-of-experts layers to "
             "spread expert by expert; use --parallel tp or pp", devices=2, parallel="ep")


def test_experts_that_do_not_divide_among_the_devices_are_refused(tmp_path_factory,
                                                                   tmp_path) -> None:
    _refused(tiny_dir(tmp_path_factory, "qwen3_moe"), tmp_path,
             r"--devices 3 --parallel ep: num_\w*experts 8 of .*config.json does not divide "
             "among 3 devices; use --devices 2 or 4 or 8, or --parallel pp",
             devices=3, parallel="ep")


def test_the_command_line_refuses_ep_in_one_line(tmp_path_factory, tmp_path) -> None:
    out = str(tmp_path / "never.toptpu")
    res = subprocess.run([sys.executable, "-m", "toptpu.cli", "compile",
                          tiny_dir(tmp_path_factory, "qwen3"), "-o", out, "--devices", "2",
                          "--parallel", "ep"], capture_output=True, text=True)
    assert res.returncode == 1 and not os.path.exists(out)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("toptpu compile: error: --devices 2 "
                                                   "--parallel ep: ")


# --------------------------------------------------------------------------- the model


def test_an_indexed_load_of_a_devices_share_moves_its_expected_part() -> None:
    """One token's k = 2 of 16 experts, a device holding 4 of them (`@shard0-4`): it
    moves 2 / 4 of an expert's rows in expectation; a whole tensor: exactly 2."""
    def load(name: str, rows: int) -> Load:
        return Load(id=1, name="l", deps=(0,), group=0, slice=0,
                    tensor=GlobalRef(Space("w"), name), shape=(rows, 8), dtype="float32",
                    axis=-1, local=LocalRef(0, (rows, 8), "float32", 2, rows * 32),
                    index=LocalRef(0, (1, 2), "int32", 1, 8))

    assert load("experts.gate_proj", 16).nbytes == 2 * 32
    share = load("experts.gate_proj@shard0-4:f32", 4)
    assert share.nbytes == round(expected_distinct(16, 1, 2) / 4 * 32) == 16


def test_the_step_accounting_runs_the_heads_on_device_zero() -> None:
    ep = Spread("ep", 4)
    assert [ep.holders(n) for n in ("embedding", "block_cache", "lm_head", "greedy_head")] \
        == [1, 4, 1, 1]
    assert ep.hidden_sends == 3 and ep.logits_pieces == 1


# --------------------------------------------------------------------------- executed


@pytest.mark.slow
@pytest.mark.parametrize("family,devices", [("qwen3_moe", 2), ("qwen3_moe", 4),
                                            ("qwen3_moe", 8), ("qwen2_moe", 2),
                                            ("qwen2_moe", 4), ("qwen3_5_moe", 2)])
def test_ep_gives_the_one_device_tokens(tmp_path_factory, family: str, devices: int) -> None:
    """f32, a prompt of three prefill chunks (block, block_kv twice, the last padded), 32
    greedy decode steps: the one-device file's tokens and transformers' `generate`; then a
    second turn on the caches. Qwen3.5-MoE's text model: its hybrid layers (linear
    attention with its state, gated attention) replicated, a shared expert. Each device
    ran every layer's nets (the experts' all-reduce inside them), device 0's embedding was
    sent to the others."""
    from toptpu.backend.runtime.runtime import Runtime

    one = Runtime.open(_compiled(tmp_path_factory, family))
    path = _compiled(tmp_path_factory, family, devices)
    par = LlmFile(path).meta.parallel
    assert par is not None and par.strategy == "ep" and len(par.devices) == devices
    rt = Runtime.open(path)
    ids = one.encode(LONG_PROMPT)
    assert len(ids) > 2 * rt.L and len(ids) % rt.L
    want = one.generate(ids, 32, stop_on_eos=False).generated_ids
    rec = rt.start_trace()
    got = rt.generate(ids, 32, stop_on_eos=False).generated_ids
    assert got == want
    if family != "qwen3_5_moe":  # (its one-device tokens against transformers':
        # test_moe_families.py)
        ref = hf_generate(_moe_dir(tmp_path_factory, family), ids, 32)  # (stops at eos)
        assert ref and got[:len(ref)] == ref
    assert {(p.src, p.dst) for p in rec.peers} == {(0, d) for d in range(1, devices)}
    ids2 = one.encode(" What is the capital of France?", add_special_tokens=False)
    assert rt.generate(ids2, 16, keep_history=True, stop_on_eos=False).generated_ids == \
        one.generate(ids2, 16, keep_history=True, stop_on_eos=False).generated_ids


def _tensor(f: LlmFile, layout: WeightLayout, name: str, layer: int) -> np.ndarray:
    blob = np.frombuffer(f.file.view(layout.section), np.uint8)
    e = layout.chunk_of(layer)[name]
    base = layout.layer_start(layer)
    return blob[base + e.offset:base + e.offset + e.nbytes].view(e.dtype).reshape(e.shape)


@pytest.mark.slow
def test_each_devices_blob_holds_only_its_experts(tmp_path_factory) -> None:
    """Over 4 devices each device's chunk of a layer holds its 4 of the 16 experts (the
    one-device file's rows [4d, 4d + 4), byte for byte) and the attention, norms and router
    whole; its blob is the one-device file's less 12 experts a layer (and, but on device 0,
    the embeddings and lm_head)."""
    one = LlmFile(_compiled(tmp_path_factory, "qwen3_moe"))
    spread = LlmFile(_compiled(tmp_path_factory, "qwen3_moe", 4))
    assert one.meta.weights is not None and spread.meta.parallel is not None
    whole = one.meta.weights
    devices = spread.meta.parallel.devices
    for layer in range(2):
        mine = whole.chunk_of(layer)
        expert_names = [n for n in mine if ".experts." in n]
        assert len(expert_names) == 3
        expert_bytes = sum(mine[n].nbytes for n in expert_names)
        for d, dev in enumerate(devices):
            chunk = dev.weights.chunk_of(layer)
            cut = {n for n in chunk if "@shard0-4" in n}
            assert {re.sub(r"@shard0-4", "", n) for n in cut} == set(expert_names)
            for name in chunk:
                got = _tensor(spread, dev.weights, name, layer)
                base = re.sub(r"@shard0-4", "", name)
                ref = _tensor(one, whole, base, layer)
                if name in cut:
                    assert got.shape[0] == EXPERTS // 4
                    assert np.array_equal(got.view(np.uint8),
                                          ref[4 * d:4 * d + 4].view(np.uint8)), name
                else:
                    assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), name
            held = sum(chunk[n].nbytes for n in chunk if n in cut)
            assert held * 4 == expert_bytes
    # the embeddings and the lm_head on device 0 only; the others hold what their
    # per-layer nets share (the rotary frequencies, each device's first expert)
    for d, dev in enumerate(devices):
        big = {n for n in dev.weights.shared if dev.weights.shared[n].nbytes > 4096}
        assert (big != set()) == (d == 0), (d, sorted(big))


@pytest.mark.slow
def test_a_weight_only_mode_under_ep(tmp_path_factory) -> None:
    """w8f32 (the experts quantized per expert after the cut): the one-device w8f32
    file's tokens over 2 devices."""
    from toptpu.backend.runtime.runtime import Runtime

    one = Runtime.open(_compiled(tmp_path_factory, "qwen3_moe", mode="w8f32"))
    two = Runtime.open(_compiled(tmp_path_factory, "qwen3_moe", 2, mode="w8f32"))
    ids = one.encode(LONG_PROMPT)
    assert two.generate(ids, 32, stop_on_eos=False).generated_ids == \
        one.generate(ids, 32, stop_on_eos=False).generated_ids


@pytest.mark.slow
def test_estimate_charges_the_all_reduce_and_each_chips_own_experts(tmp_path_factory
                                                                     ) -> None:
    """`toptpu estimate --parallel ep` (the nets compiled as the compile cuts them): the
    decode net of a layer holds one all-reduce of the token's [1, H] over the devices on the
    link, a decode step is charged the link's time for it in every layer plus the hidden
    state's sends from device 0, a device's decode net fetches its expected share of the
    k experts (k / N of them), and device 1 holds its 1/N of the experts and no
    embeddings."""
    from toptpu.backend.runtime.accounting import Costs
    from toptpu.backend.target.chips import get_chip
    from toptpu.backend.target.link import LinkWork, collective_seconds
    from toptpu.estimate import compile_costs, estimate
    from toptpu.frontends.hf_loader import read_config
    from toptpu.request import CompileRequest

    config, raw = read_config(_moe_dir(tmp_path_factory, "qwen3_moe"))
    chip = get_chip("bm1684x")
    nets = ("embedding", "embedding_cache", "block", "block_cache", "lm_head",
            "greedy_head")

    def costs(devices: int):
        req = CompileRequest.make(mode="f32", seq_length=64, max_input_length=16,
                                  devices=devices, parallel=None if devices == 1 else "ep")
        return compile_costs(config, req, nets=nets)

    one, two = costs(1), costs(2)
    h = raw["hidden_size"]
    links = [c for c in two.commands["block_cache"] if c.link is not None]
    assert [(c.link, c.nbytes) for c in links] == [(("all_reduce", "tree", 2), h * 4)]
    assert not any(c.link for c in one.commands["block_cache"])
    per_token: Costs = estimate(two, chip, 16).per_token
    layers = raw["num_hidden_layers"]
    reduce = collective_seconds(chip, LinkWork("all_reduce", "tree", 2, h * 4))
    send = collective_seconds(chip, LinkWork("send", "tree", 2, h * 4))
    assert per_token.link_s == pytest.approx(layers * reduce + send, rel=1e-9)
    expert = 3 * raw["moe_intermediate_size"] * h * 4  # gate, up and down of one, f32
    k = raw["num_experts_per_tok"]
    fetched = sum(c.nbytes for c in two.commands["block_cache"] if c.dma) \
        - sum(c.nbytes for c in one.commands["block_cache"] if c.dma)
    # (k / 2 experts fewer; the local indices' few bytes more)
    assert fetched == pytest.approx(-k * expert / 2, abs=0.05 * expert)
    w0, w1 = two.device_weight_bytes
    assert w0 - w1 > 2 * raw["vocab_size"] * h * 4 * 0.99  # the embeddings and lm_head
    assert one.weight_bytes - w0 == pytest.approx(layers * EXPERTS // 2 * expert, rel=1e-3)
