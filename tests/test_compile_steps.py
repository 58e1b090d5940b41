"""`compile()` is four steps a user can call one by one (check the request, plan, compile
nets, pack weights, write); called by hand they make the file `compile()` makes."""

from __future__ import annotations

import numpy as np
import pytest
from llm_fixtures import tiny_dir

from toptpu.backend.formats.model_file import ModelFile
from toptpu.compile_options import check_compile_request
from toptpu.compiler import compile as compile_model
from toptpu.compiler import compile_nets, pack_weights, plan, write
from toptpu.frontends.llm import LAYER_PREFIX

pytestmark = pytest.mark.slow  # compiles a model twice

REQUEST = {"mode": "w4bf16", "chip": "bm1684x", "seq_length": 48, "max_input_length": 8,
           "max_history": 16}


def test_the_steps_called_by_hand_make_the_file_compile_makes(tmp_path_factory) -> None:
    src = tiny_dir(tmp_path_factory, "qwen2")
    out = tmp_path_factory.mktemp("steps")
    whole, by_steps = str(out / "whole.toptpu"), str(out / "steps.toptpu")
    compile_model(src, whole, progress=None, **REQUEST)

    options = check_compile_request(src, by_steps, group_size=None, symmetric=None,
                                    dump_ir=None, **REQUEST)
    the_plan = plan(src, options)
    assert the_plan.mode == "w4bf16" and the_plan.num_layers == 2
    assert the_plan.variants == {0: [0, 1]}  # one float checkpoint: one layer variant
    names = [n.name for n in the_plan.nets]
    assert len(names) == len(set(names)) and all(not n.weight_prefix for n in the_plan.nets)

    compiled = compile_nets(the_plan)
    assert list(compiled.nets) == names
    for net in compiled.nets.values():
        assert net.program is not None and net.program.commands, net.name
    assert compiled.store.derived_names()  # the w4 tensors the nets read

    packed = pack_weights(the_plan, compiled)
    layout = packed.layout
    assert layout.num_layers == 2
    assert not any(n.startswith(LAYER_PREFIX) for n in layout.shared)  # layers in chunks
    pieces = [(offset, len(data)) for offset, data in packed.pieces()]
    assert all(a + n <= b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))
    starts = {offset for offset, _ in pieces}
    assert {layout.layer_start(i) for i in range(2)} <= starts
    blob = packed.blob()
    assert blob.nbytes == layout.size and blob[layout.layer_start(0):].any()

    header = write(the_plan, compiled, packed, by_steps)
    a, b = ModelFile(whole), ModelFile(by_steps)
    got, want = dict(b.header), dict(a.header)
    assert got == want  # the header records no time: the same bytes
    assert header.to_json()["nets"] == want["nets"]
    assert sorted(a.sections) == sorted(b.sections)
    for name in a.sections:
        assert a.read(name) == b.read(name), name
    assert np.array_equal(np.frombuffer(b.read("weights"), np.uint8), blob)
