"""The net lists of the README, ARCHITECTURE.md and docs/model-file.md name exactly the
nets a model file holds (the eight text nets; `vit` for a vision-language model, and
Qwen3-VL's `deepstack_add`)."""

from __future__ import annotations

import os
import re

import pytest
from llm_fixtures import compiled

from toptpu.backend.contract import DEEPSTACK_NET, VISION_NET
from toptpu.backend.runtime.machine_executor import MachineExecutor

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z_]+", text))


def _listed() -> dict[str, set[str]]:
    """Each document's list of nets."""
    readme = re.search(r"split into nets \(([^)]*)\)", _read("README.md"), re.S)
    arch = _read("ARCHITECTURE.md")
    flow = re.search(r"split into the nets of the net contract:(.*?)\ntorch\.export", arch,
                     re.S)
    assert readme and flow, "the net lists moved: update this test"
    flow_text = " ".join(line.split("│", 1)[-1].split("▼", 1)[-1] for line in
                         flow.group(1).splitlines())

    def table(text: str, heading: str) -> set[str]:
        section = text.split(heading, 1)[1]
        rows = re.findall(r"^\| `([a-z_]+)`", section.split("\n\n|", 1)[1].split("\n\n")[0],
                          re.M)
        return set(rows)

    return {
        "README how it works": _words(readme.group(1)) - {"a", "s", "wen"},
        "ARCHITECTURE data flow": _words(flow_text) - {"the", "eight", "text", "nets", "and",
                                                       "a", "s", "wen"},
        "ARCHITECTURE net contract": table(arch, "## The net contract"),
        "model-file.md the nets": table(_read("docs/model-file.md"), "## The nets"),
    }


def test_the_docs_name_the_nets_a_model_file_holds(tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    held = set(MachineExecutor(compiled(tmp_path_factory, "qwen2").model_file).nets())
    assert len(held) == 8  # "eight text nets", as the docs say
    want = held | {VISION_NET, DEEPSTACK_NET}
    wrong = {doc: (sorted(nets - want), sorted(want - nets))
             for doc, nets in _listed().items() if nets != want}
    assert not wrong, f"(named but not held, held but not named): {wrong}"
