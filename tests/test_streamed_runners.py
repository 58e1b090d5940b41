"""Weights streamed by every runner, as the one-device machine streams them
(`backend/runtime/weight_pages.py`, one mechanism): a file spread over several devices
(`--parallel pp|tp`) and the Tpu interpreter release the mapped pages of the weights each
run read and keep converted weights within a capped budget.

- tokens unchanged: a streamed multi-device file gives the one-device file's tokens (pp:
  its logits bit for bit), a streamed interpreter the machine's tokens and its own
  unstreamed logits bit for bit, with a weight cache kept to nothing or a fraction of the
  model;
- what is released is counted (every run's weights, on every device that ran it);
- the weight pages resident in the process (the mapping's `Rss` in /proc/self/smaps, read
  at the end of every run before its pages are released: the most a run holds) do not
  grow with the layers: a 2-layer and a 6-layer file's peaks are equal within a few pages,
  while unstreamed the 6-layer file's residency grows by its 4 further layers' bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from llm_fixtures import LONG_PROMPT, compiled, shared_dir

from toptpu.backend.formats import model_file
from toptpu.backend.formats.llm_file import WeightLayout
from toptpu.backend.formats.model_file import ModelFile
from toptpu.backend.runtime import weight_cache as wc
from toptpu.backend.runtime.device_executor import DeviceGroupExecutor, machine_executor
from toptpu.backend.runtime.executor import Executor
from toptpu.backend.runtime.interpreter_executor import InterpreterExecutor
from toptpu.backend.runtime.machine_executor import MachineExecutor
from toptpu.backend.runtime.runtime import Runtime

IDS = [3, 14, 15, 92, 65, 35, 89, 79]
PAGE = 4096
#: the mode each kind of file is compiled in: tp cuts a row-parallel matmul's input in
#: halves of 32, which a 4-bit group of 64 does not divide (8 bits are per channel)
MODE = {None: "w4bf16", "pp": "w4bf16", "tp": "w8bf16"}


def _logits(rt: Runtime, ids: list[int] = IDS, new: int = 4) -> np.ndarray:
    """The prompt's teacher-forced logits, then the ids of `new` greedy decode steps."""
    prompt = rt.sequence_logits(ids)
    gen = rt.generate(ids, new, stop_on_eos=False)
    return np.concatenate([prompt.reshape(-1), np.asarray(gen.generated_ids, np.float32)])


def _per_layer_runs(ex: MachineExecutor) -> int:
    return sum(ex.stats[n].runs for n in ex.stats if ex.nets()[n].per_layer)


# ---------------------------------------------------------------------- several devices


@pytest.mark.slow  # compiles multi-device model files
@pytest.mark.parametrize(("parallel", "devices"), [("pp", 2), ("tp", 2)])
def test_a_streamed_multi_device_file_gives_the_one_device_tokens(
        tmp_path_factory: pytest.TempPathFactory, parallel: str, devices: int) -> None:
    mode = MODE[parallel]
    one = compiled(tmp_path_factory, "qwen2", mode)
    many = compiled(tmp_path_factory, "qwen2", mode, devices=devices, parallel=parallel)
    rt1 = Runtime(MachineExecutor(one.model_file, weight_cache_bytes=1 << 40,
                                  stream_weights=False))
    ids = Runtime.open(one.model_file).encode(LONG_PROMPT)  # three prefill chunks
    want = _logits(rt1, ids, 8)
    want_ids = want[-8:]
    unstreamed = DeviceGroupExecutor(many.model_file, weight_cache_bytes=1 << 40,
                                     stream_weights=False)
    Runtime(unstreamed).generate(ids, 2, stop_on_eos=False)
    assert unstreamed.released_bytes == 0
    kept = sum(m.cache.used for m in unstreamed.machines)
    for budget in (0, kept // 4):
        ex = machine_executor(many.model_file, weight_cache_bytes=budget, stream_weights=True)
        assert isinstance(ex, DeviceGroupExecutor) and ex.n == devices and ex.stream_weights
        got = _logits(Runtime(ex), ids, 8)
        assert np.array_equal(got[-8:], want_ids)  # the one device's greedy tokens
        if parallel == "pp":  # the one-device programs: the one device's logits exactly
            assert got.tobytes() == want.tobytes()
        else:
            assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
        for m in ex.machines:
            assert m.cache.used <= m.cache.budget <= max(budget // devices, 0)
        # every per-layer run released its weights on each device that ran it: pp one
        # device a layer, tp every device (a chunk is at least a page here)
        runners = 1 if parallel == "pp" else devices
        assert ex.released_bytes >= _per_layer_runs(ex) * runners * PAGE


def _moe_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Tiny Qwen3-MoE (16 experts, f32) for one device and for ep over 2 (the files
    tests/test_moe_ep.py compiles, under the same names)."""
    from filelock import FileLock

    from toptpu.compiler import compile as compile_model
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_models import save_tiny_model

    model_dir = os.path.join(shared_dir(tmp_path_factory), "qwen3_moe-e16")
    with FileLock(model_dir + ".lock"):
        if not os.path.exists(os.path.join(model_dir, "done")):
            with quiet_transformers():
                save_tiny_model(model_dir, "qwen3_moe", layers=2, num_experts=16)
            open(os.path.join(model_dir, "done"), "w").close()
    paths = []
    for devices in (1, 2):
        spread = "" if devices == 1 else f"-ep{devices}"
        path = os.path.join(shared_dir(tmp_path_factory), f"qwen3_moe-e16-f32{spread}.toptpu")
        with FileLock(path + ".lock"):
            if not os.path.exists(path):
                compile_model(model_dir, path, mode="f32", seq_length=160,
                              max_input_length=16, progress=None, devices=devices,
                              parallel=None if devices == 1 else "ep")
        paths.append(path)
    return paths[0], paths[1]


@pytest.mark.slow  # compiles a mixture of experts for one device and for two
def test_a_streamed_expert_parallel_file_gives_the_one_device_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    one, ep = _moe_files(tmp_path_factory)
    rt1 = Runtime.open(one)
    ids = rt1.encode(LONG_PROMPT)
    want = rt1.generate(ids, 16, stop_on_eos=False).generated_ids
    ex = machine_executor(ep, weight_cache_bytes=0, stream_weights=True)
    assert isinstance(ex, DeviceGroupExecutor) and ex.parallel.strategy == "ep"
    assert Runtime(ex).generate(ids, 16, stop_on_eos=False).generated_ids == want
    # every device runs every layer's nets under ep, and releases its experts' pages
    assert ex.released_bytes >= _per_layer_runs(ex) * 2 * PAGE


def test_the_streaming_switch_and_budget_reach_the_device_group(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`TOPTPU_STREAM_WEIGHTS` decides for a multi-device file as for one device, on the
    sum of its devices' blobs, and its default budget is the streaming cap over the
    devices."""
    path = compiled(tmp_path_factory, "qwen2", "w4bf16", devices=2, parallel="pp").model_file
    monkeypatch.delenv(wc.ENV_VAR, raising=False)
    monkeypatch.setattr(wc, "mem_available", lambda: 64 << 30)
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "on")
    ex = DeviceGroupExecutor(path)
    assert ex.stream_weights
    assert [m.cache.budget for m in ex.machines] == [wc.STREAMING_CAP // 2] * 2
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "auto")  # a tiny file: under STREAM_ABOVE
    ex = DeviceGroupExecutor(path)
    assert not ex.stream_weights
    assert [m.cache.budget for m in ex.machines] == [(32 << 30) // 2] * 2
    sizes = sum(ex.file.file.sections[d.weights.section].size
                for d in ex.parallel.devices)
    monkeypatch.setattr(model_file, "STREAM_ABOVE", sizes - 1)
    assert DeviceGroupExecutor(path).stream_weights  # the devices' blobs together


# ---------------------------------------------------------------------- the interpreter


def test_the_streamed_interpreter_gives_the_machines_tokens_and_its_own_logits(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter streamed with no weight cache at all: its products made from the
    packed bytes, the bf16 lm_head a block of vocabulary rows at a time (several blocks
    here), its pages released after every run: the logits of the interpreter with every
    converted weight kept, bit for bit, and the machine's greedy tokens."""
    monkeypatch.setattr(wc, "STREAM_ROWS", 16)
    monkeypatch.setattr(wc, "CHECK_ROWS", 48)
    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    full = InterpreterExecutor(path, weight_cache_bytes=1 << 40, stream_weights=False)
    want = _logits(Runtime(full))
    assert full.released_bytes == 0 and full.cache.blocked == 0
    machine = _logits(Runtime(MachineExecutor(path, weight_cache_bytes=1 << 40,
                                              stream_weights=False)))
    assert np.array_equal(machine[-4:], want[-4:])  # the machine's greedy tokens
    for budget in (0, full.cache.used // 20):
        ex = InterpreterExecutor(path, weight_cache_bytes=budget, stream_weights=True)
        rt = Runtime(ex)
        for _ in range(2):
            got = _logits(rt)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        assert ex.cache.used <= ex.cache.budget == budget
        assert ex.cache.streamed > 0  # decode products from the packed bytes
        if budget == 0:
            assert ex.cache.blocked > 0 and len(ex.cache) == 0  # the lm_head in blocks
        layers = ex.file.num_layers
        assert ex.released_bytes >= 2 * layers * PAGE  # each layer's run, every step


def test_the_interpreter_streams_by_size_or_the_environment(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    path = compiled(tmp_path_factory, "qwen2", "w4bf16").model_file
    monkeypatch.delenv(wc.ENV_VAR, raising=False)
    monkeypatch.setattr(wc, "mem_available", lambda: 64 << 30)
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "on")
    ex = InterpreterExecutor(path)
    assert ex.stream_weights and ex.cache.budget == wc.STREAMING_CAP
    monkeypatch.setenv(wc.STREAM_ENV_VAR, "off")
    ex = InterpreterExecutor(path)
    assert not ex.stream_weights and ex.cache.budget == 32 << 30
    rt = Runtime.open(path, executor="interpreter")
    rt.generate(IDS, 2, stop_on_eos=False)
    assert rt.ex.released_bytes == 0  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- residency


def _resident(views: list[memoryview]) -> int:
    """The bytes of `views` (mapped file sections) whose pages are in this process's page
    tables: the present bit of each page's /proc/self/pagemap entry."""
    total = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for view in views:
            address = np.frombuffer(view, np.uint8).ctypes.data
            first, last = address // PAGE, (address + len(view) - 1) // PAGE
            pagemap.seek(first * 8)
            entries = np.frombuffer(pagemap.read((last - first + 1) * 8), np.uint64)
            total += int((entries >> np.uint64(63)).sum()) * PAGE
    return total


def _weight_sections(ex: Executor) -> list[str]:
    par = ex.meta.parallel
    return ["weights"] if par is None else [d.weights.section for d in par.devices]


@contextmanager
def _peak_resident(ex: Executor) -> Iterator[Callable[[], int]]:
    """The most of the weight blobs' pages resident at the end of any run, before its
    pages are released (streaming), or after the runs (not streaming). The blobs start
    released (opening the file checked their checksums, which maps them all)."""
    mapped = ex.file.file
    views = [mapped.view(name) for name in _weight_sections(ex)]
    for name in _weight_sections(ex):
        mapped.release(mapped.sections[name].offset, mapped.sections[name].size)
    assert _resident(views) <= len(views) * 2 * PAGE  # (the pages the blobs share)
    peak = [0]
    real = ModelFile.release

    def release(self: ModelFile, offset: int, nbytes: int) -> int:
        if self is mapped:
            peak[0] = max(peak[0], _resident(views))
        return real(self, offset, nbytes)

    ModelFile.release = release  # type: ignore[method-assign]
    try:
        yield lambda: max(peak[0], _resident(views))
    finally:
        ModelFile.release = real  # type: ignore[method-assign]


def _layouts(ex: Executor) -> list[WeightLayout]:
    par = ex.meta.parallel
    return [ex.file.layout] if par is None else [d.weights for d in par.devices]


def _largest_run(ex: Executor) -> int:
    """The most weight bytes one run reads on all its devices: a layer's chunk on each
    device (pp: on one) or the shared tensors (the embedding, the lm_head)."""
    layouts = _layouts(ex)
    layer = max(x.layer_size(0) for x in layouts)
    if ex.meta.parallel is not None and ex.meta.parallel.strategy == "tp":
        layer *= len(layouts)
    return max(layer, *(x.shared_size for x in layouts))


SHORT, LONG = 2, 10
RESIDENCY = [("interpreter", None),
             ("machine", None),
             pytest.param("machine", "pp", marks=pytest.mark.slow),
             pytest.param("machine", "tp", marks=pytest.mark.slow)]


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads the page map")
@pytest.mark.parametrize(("executor", "parallel"), RESIDENCY)
def test_resident_weight_pages_do_not_grow_with_the_layers(
        tmp_path_factory: pytest.TempPathFactory, executor: str, parallel: str | None
        ) -> None:
    """A 2-layer and a 10-layer file of the same layers, generated from with no weight
    cache: unstreamed, every layer's pages stay resident (the 10-layer file's 8 more
    layers' bytes); streamed, the most resident at the end of any run is that run's
    weights (one layer per device, or the shared tensors) and the pages two layers share,
    not the layers' bytes."""
    peaks: dict[tuple[int, bool], int] = {}
    layer: dict[int, int] = {}
    largest: dict[int, int] = {}
    spread = {} if parallel is None else {"devices": 2, "parallel": parallel}
    for layers in (SHORT, LONG):
        path = compiled(tmp_path_factory, "qwen2", MODE[parallel], layers=layers,
                        **spread).model_file  # type: ignore[arg-type]
        for stream in (False, True):
            ex: Executor = (
                InterpreterExecutor(path, weight_cache_bytes=0, stream_weights=stream)
                if executor == "interpreter" else
                machine_executor(path, weight_cache_bytes=0, stream_weights=stream))
            rt = Runtime(ex)
            with _peak_resident(ex) as peak:
                rt.generate(IDS, 3, stop_on_eos=False)
                peaks[layers, stream] = peak()
            # every layer's bytes, over all devices
            layer[layers] = sum(x.layer_size(0) * x.num_layers for x in _layouts(ex)) \
                // layers
            largest[layers] = _largest_run(ex)
    assert layer[SHORT] == layer[LONG] >= 4 * PAGE and largest[SHORT] == largest[LONG]
    more = (LONG - SHORT) * layer[LONG]
    assert peaks[LONG, False] - peaks[SHORT, False] >= more - 2 * PAGE
    # the kernel maps up to 16 pages around a fault from the page cache (fault-around):
    # a run's weights, plus at most that on either side; and a release drops the whole
    # pages of a run's weights only (`ModelFile.release`), so the page two neighbouring
    # layers' weights share stays mapped: one page a layer on each device, 4 KiB against a
    # layer's bytes (releasing it too maps more: each fault maps its 16-page window again)
    devices = 1 if parallel is None else 2
    slack = 2 * 16 * PAGE * devices

    def shared_pages(layers: int) -> int:
        return (layers + 1) * devices * PAGE

    for layers in (SHORT, LONG):
        assert peaks[layers, True] <= largest[LONG] + slack + shared_pages(layers)
    assert peaks[LONG, True] <= peaks[SHORT, True] + slack + shared_pages(LONG - SHORT)
    assert peaks[LONG, True] <= peaks[LONG, False] - more + slack + shared_pages(LONG)
    print(f"resident weight pages, {executor} {parallel or ''}: {peaks}")


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads the page map")
def test_checking_a_streamed_files_checksums_leaves_its_weights_released(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a file checks every section's checksum through the mapping: a streamed
    file's windows are released once hashed, so its first run starts from none of its
    weights resident (else the open alone would hold the whole blob, up to 4 GiB)."""
    path = compiled(tmp_path_factory, "qwen2", "w4bf16", layers=LONG).model_file
    resident = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(wc.STREAM_ENV_VAR, setting)
        with ModelFile(path) as f:
            resident[setting] = _resident([f.view("weights")])
            size = f.sections["weights"].size
    assert resident["off"] >= size - 2 * PAGE
    assert resident["on"] <= 2 * PAGE
