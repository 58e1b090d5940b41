"""`toptpu profile FILE.mlir` times grouped, addressed Tpu IR as `toptpu profile` times the
model file it came from: the same cycles, bytes and FLOPs per net."""

from __future__ import annotations

import glob
import json
import os

import pytest

from toptpu.cli import main


@pytest.mark.slow  # compiles a model with --dump-ir
def test_the_profile_of_a_dump_equals_the_model_files(tmp_path, capsys) -> None:
    from toptpu.frontends.tiny_models import save_tiny_model

    src, out, dump = str(tmp_path / "m"), str(tmp_path / "m.toptpu"), str(tmp_path / "ir")
    save_tiny_model(src, "qwen2", layers=1)
    assert main(["compile", src, "-q", "w4bf16", "--seq-length", "64", "-o", out,
                 "--dump-ir", dump, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["profile", out, "--json"]) == 0
    from_file = {n["net"]: n for n in json.loads(capsys.readouterr().out)["nets"]}
    for net in ("block", "block_cache", "lm_head"):
        (last,) = glob.glob(os.path.join(dump, net, "*-address-assign.mlir"))
        assert main(["profile", last, "--json", "--chip", "bm1684x"]) == 0
        (got,) = json.loads(capsys.readouterr().out)["nets"]
        want = from_file[net]
        assert got["net"] == net
        for key in ("cycles", "dma_bytes", "flops", "dma_busy", "compute_busy"):
            assert got[key] == want[key], (net, key)
    # IR before the machine passes is refused, naming what to profile instead
    (early,) = glob.glob(os.path.join(dump, "block", "*-weight-reorder.mlir"))
    assert main(["profile", early]) == 1
    assert "is not grouped and addressed Tpu IR" in capsys.readouterr().err
