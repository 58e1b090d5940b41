"""The import rules of the package, enforced (ARCHITECTURE.md, "Import rules").

Every module of the `toptpu` package is parsed (no import runs) and each of its imports,
at module level and inside functions, is checked:

- against `RULES`: which of our packages each package may import (the table of
  ARCHITECTURE.md; `test_the_architecture_page_states_these_rules` keeps the two equal);
- function-level imports only for heavy dependencies (`HEAVY`, or one of our modules that
  loads one when imported): anything else belongs at module level, where the edge is seen;
- the runtime side (contract, formats, target, reference, runtime) loads none of `NO_RUNTIME`
  when imported, and a function-level import of a heavy dependency there is one of the
  explicit `RUNTIME_LAZY` exceptions;
- no import cycle between modules.

A failure names file:line and the forbidden edge. A subprocess checks the runtime for real:
importing `Runtime` and generating from a model file loads no torch, transformers, passes,
frontends or codegen.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

import pytest
from llm_fixtures import compiled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: import name -> folder (pyproject.toml `package-dir`)
PACKAGE_DIRS = {"toptpu": "toptpu", "toptpu.dialects": "dialects", "toptpu.passes": "passes",
                "toptpu.frontends": "frontends", "toptpu.backend": "backend"}

#: package -> the packages of ours its modules may import (besides its own modules). The
#: package of a module is the longest key that prefixes it; "*" is anything.
RULES: dict[str, tuple[str, ...]] = {
    "toptpu.errors": (),
    "toptpu.dialects": ("toptpu.backend.contract",),
    "toptpu.backend.contract": (),
    # what differs per model family, torch-free: the runtime's host side reads it
    "toptpu.families": ("toptpu.backend.contract",),
    "toptpu.backend.target": ("toptpu.dialects",),
    "toptpu.backend.reference": ("toptpu.dialects",),
    "toptpu.backend.formats": ("toptpu.dialects", "toptpu.backend.target",
                               "toptpu.backend.contract", "toptpu.families"),
    "toptpu.passes": ("toptpu.dialects", "toptpu.backend.target", "toptpu.backend.reference"),
    "toptpu.frontends": ("toptpu.dialects", "toptpu.passes", "toptpu.backend.contract",
                         "toptpu.families"),
    # codegen reads the passes' decisions through the dialect's typed annotations, never
    # through a pass module
    "toptpu.backend.codegen": ("toptpu.dialects", "toptpu.backend.target",
                               "toptpu.backend.formats"),
    "toptpu.backend.runtime": ("toptpu.dialects", "toptpu.backend.target",
                               "toptpu.backend.reference", "toptpu.backend.contract",
                               "toptpu.backend.formats", "toptpu.families"),
    "toptpu.backend": (),
    "toptpu": ("*",),
}
#: modules every package may import: the one base of the user-facing errors (a leaf)
EVERYWHERE = ("toptpu.errors",)

#: dependencies heavy enough to import only where used (seconds of import time, or
#: optional in spirit: the runtime and the CLI's startup must not pay for them)
HEAVY = ("torch", "transformers", "torchvision", "mlir", "PIL", "safetensors.torch",
         "auto_round", "starlette", "uvicorn")
#: function-level imports of light modules that have a reason of their own
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("toptpu", "toptpu.backend.runtime.runtime"):
        "PEP 562 attribute of the package root, which runs before every submodule import",
    ("toptpu.llm_cli", "readline"):
        "importing readline turns on line editing for input(): only an interactive chat",
    ("toptpu.backend.runtime.chat", "jinja2"):
        "chat templates render with transformers and jinja2, only when applied",
    ("toptpu.sweep", "ray"):
        "an optional extra (pyproject `ray`), imported only for `toptpu sweep --ray`",
    ("toptpu.opt", "toptpu.opt_targets"):
        "toptpu-opt's `-t commands` and `-t mlir-generic`, imported when named, as xDSL "
        "registers targets: printing IR loads no codegen, machine or IRDL export (start-up)",
}
#: registries of named things, each imported when named (xDSL's `get_all_passes`): module ->
#: (the package whose modules it imports inside its functions, why)
LAZY_REGISTRIES: dict[str, tuple[str, str]] = {
    "toptpu.passes.registry": (
        "toptpu.passes", "every pass by name, its module imported when a pipeline names it: "
        "toptpu-opt loads only the passes it runs (start-up)"),
    "toptpu.cli": (
        "toptpu", "every subcommand by name, its module imported when the command line names "
        "it: `toptpu <cmd>` loads only that command's modules (start-up)"),
}

#: the packages that run a model file
RUNTIME_SIDE = ("toptpu.backend.contract", "toptpu.backend.formats", "toptpu.backend.target",
                "toptpu.backend.reference", "toptpu.backend.runtime", "toptpu.families")
#: what the runtime side never loads when imported
NO_RUNTIME = ("torch", "transformers", "xdsl.transforms", "mlir", "PIL")
#: (module, top-level package) -> why the runtime side needs it, lazily, at run time
RUNTIME_LAZY: dict[tuple[str, str], str] = {
    ("toptpu.backend.runtime.chat", "transformers"):
        "chat templates (PreTrainedTokenizerFast.apply_chat_template)",
    ("toptpu.backend.runtime.vision", "transformers"):
        "the VLMs' own Pillow image processors and placeholder layouts",
    ("toptpu.backend.runtime.vision", "PIL"): "reading images",
    ("toptpu.families.internvl", "transformers"):
        "InternVL's placeholder layout by its processor's own replace_image_token",
    ("toptpu.families.minicpmv", "transformers"):
        "MiniCPM-V's placeholder layout by its processor's own replace_image_token",
    ("toptpu.backend.runtime.profile", "PIL"): "PNG timelines of `toptpu profile --png`",
    ("toptpu.backend.contract", "torch"):
        "MiniCPM-V position ids by the model's own function (image encoding only), "
        "MiniCPM-V 4.7's canvas positions by torch's linspace (image prompts only)",
    ("toptpu.backend.contract", "transformers"):
        "MiniCPM-V position ids by the model's own function (image encoding only)",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the repository
    line: int
    in_function: bool
    target: str  # the imported module
    typing_only: bool = False  # under `if TYPE_CHECKING:`: never runs, so makes no cycle

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _modules() -> dict[str, str]:
    """Every module of the package -> its file (relative to the repository)."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, f), os.path.join(REPO, folder))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([package, *parts])] = os.path.relpath(os.path.join(root, f), REPO)
    return out


MODULES = _modules()


def _imports_of(module: str, path: str) -> Iterator[Import]:
    with open(os.path.join(REPO, path)) as f:
        yield from _imports_in(module, path, f.read())


def _imports_in(module: str, path: str, source: str) -> Iterator[Import]:
    """The imports of `source`, the text of `module` at `path`."""
    tree = ast.parse(source, path)

    def typing_block(node: ast.AST) -> bool:
        return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING")

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                              | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, path, child.lineno, in_function, alias.name,
                                 typing_only)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0 and child.module, f"{path}:{child.lineno}: relative import"
                for alias in child.names:  # `from pkg import mod` imports the module pkg.mod
                    sub = f"{child.module}.{alias.name}"
                    yield Import(module, path, child.lineno, in_function,
                                 sub if sub in MODULES else child.module, typing_only)
            yield from visit(child, inner, typing_only or typing_block(child))

    yield from visit(tree, False, False)


@cache
def all_imports() -> tuple[Import, ...]:
    return tuple(i for m, p in sorted(MODULES.items()) for i in _imports_of(m, p))


def ours(name: str) -> bool:
    return name == "toptpu" or name.startswith("toptpu.")


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def package_of(module: str) -> str:
    return max((p for p in RULES if within(module, p)), key=len)


@cache
def loaded_at_import(module: str) -> frozenset[str]:
    """What importing `module` loads: its module-level imports, transitively through ours
    (third-party modules as named, not their own imports; a typing-only import never runs)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        for i in all_imports():
            if i.module == m and not i.in_function and not i.typing_only \
                    and i.target not in seen:
                seen.add(i.target)
                if ours(i.target):
                    todo.append(i.target)
    return frozenset(seen)


def is_heavy(target: str) -> bool:
    names = loaded_at_import(target) | {target} if ours(target) else {target}
    return any(within(n, h) for n in names for h in HEAVY)


# =========================================================================== the tests


def forbidden_imports(imports: Iterable[Import]) -> list[str]:
    """The imports of ours that break the package table (RULES)."""
    bad = []
    for i in imports:
        if not ours(i.target):
            continue
        pkg = package_of(i.module)
        allowed = RULES[pkg]
        if "*" in allowed or within(i.target, pkg) and package_of(i.target) == pkg:
            continue
        if i.target in EVERYWHERE:
            continue
        if not any(within(i.target, a) and package_of(i.target) == a for a in allowed):
            bad.append(f"{i.where()}: {i.module} ({pkg}) imports {i.target} "
                       f"({package_of(i.target)}); {pkg} may import only "
                       f"{', '.join(allowed) or 'nothing of ours'}")
    return bad


def light_function_level_imports(imports: Iterable[Import]) -> list[str]:
    """Function-level imports of modules that are not heavy and have no listed reason."""
    return [f"{i.where()}: {i.module} imports {i.target} inside a function; move it to the "
            "module level (a function-level import is for torch, transformers, MLIR or PIL)"
            for i in imports
            if i.in_function and not is_heavy(i.target)
            and (i.module, i.target) not in LAZY_EXCEPTIONS
            and not (i.module in LAZY_REGISTRIES
                     and within(i.target, LAZY_REGISTRIES[i.module][0]))]


def import_graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it runs (a typing-only import, which
    only a type checker follows, is left out: the layer rules still apply to it)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in imports:
        if ours(i.target) and i.target != i.module and not i.typing_only:
            graph.setdefault(i.module, set()).add(i.target)
    return graph


def test_every_import_follows_the_rules() -> None:
    bad = forbidden_imports(all_imports())
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_function_level_imports_only_for_heavy_dependencies() -> None:
    bad = light_function_level_imports(all_imports())
    assert not bad, "\n".join(bad)


def test_the_runtime_side_loads_no_compiler_dependency_when_imported() -> None:
    bad = []
    for module in MODULES:
        if not any(within(module, p) for p in RUNTIME_SIDE):
            continue
        for name in sorted(loaded_at_import(module)):
            if any(within(name, n) for n in NO_RUNTIME) or (
                    ours(name) and not any(within(name, p) for p in (*RUNTIME_SIDE, *EVERYWHERE,
                                                                       "toptpu.dialects"))):
                bad.append(f"{MODULES[module]}: importing {module} loads {name}")
    assert not bad, "\n".join(bad)


def test_the_runtime_side_imports_heavy_dependencies_only_where_listed() -> None:
    bad = [f"{i.where()}: {i.module} imports {i.target}; the runtime side may load it only "
           "for a reason listed in RUNTIME_LAZY"
           for i in all_imports()
           if i.in_function and any(within(i.module, p) for p in RUNTIME_SIDE)
           and is_heavy(i.target)
           and (i.module, i.target.split(".")[0]) not in RUNTIME_LAZY]
    assert not bad, "\n".join(bad)
    used = {(i.module, i.target.split(".")[0]) for i in all_imports() if i.in_function}
    assert set(RUNTIME_LAZY) <= used, f"stale exceptions: {set(RUNTIME_LAZY) - used}"
    assert set(LAZY_EXCEPTIONS) <= {(i.module, i.target) for i in all_imports()
                                    if i.in_function}
    assert set(LAZY_REGISTRIES) <= {i.module for i in all_imports() if i.in_function
                                    and i.module in LAZY_REGISTRIES
                                    and within(i.target, LAZY_REGISTRIES[i.module][0])}


def test_no_import_cycles() -> None:
    cycles = _strongly_connected(import_graph(all_imports()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


#: a module planted among the real ones: each of its imports breaks one rule
PLANTED = """
from toptpu.passes.layer_group import LayerGroupPass      # runtime may not import passes
from toptpu.backend.runtime.machine import Machine        # fine: its own package
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toptpu.backend.runtime.runtime import Runtime    # typing only: no cycle


def run() -> None:
    from toptpu.backend.formats import commands           # light: belongs at module level
    import torch                                          # heavy: allowed here
"""


def test_the_checkers_catch_a_planted_bad_module() -> None:
    """The checkers run on the real imports plus a planted module report exactly the planted
    forbidden edge, the planted light function-level import and a planted cycle."""
    planted = list(_imports_in("toptpu.backend.runtime.planted", "backend/runtime/planted.py",
                               PLANTED))
    imports = [*all_imports(), *planted]
    assert forbidden_imports(imports) == [
        "backend/runtime/planted.py:2: toptpu.backend.runtime.planted (toptpu.backend.runtime) "
        "imports toptpu.passes.layer_group (toptpu.passes); toptpu.backend.runtime may import "
        "only toptpu.dialects, toptpu.backend.target, toptpu.backend.reference, "
        "toptpu.backend.contract, toptpu.backend.formats, toptpu.families"]
    assert [i.target for i in planted if i.typing_only] == ["toptpu.backend.runtime.runtime"]
    light = light_function_level_imports(imports)
    assert len(light) == 1 and light[0].startswith(
        "backend/runtime/planted.py:11: toptpu.backend.runtime.planted imports "
        "toptpu.backend.formats.commands inside a function")
    # a cycle through a real module: machine -> planted (planted imports machine)
    cyclic = [*imports, Import("toptpu.backend.runtime.machine", "backend/runtime/machine.py",
                               1, False, "toptpu.backend.runtime.planted")]
    cycles = _strongly_connected(import_graph(cyclic))
    assert [sorted(c) for c in cycles] == [["toptpu.backend.runtime.machine",
                                            "toptpu.backend.runtime.planted"]]
    assert not _strongly_connected(import_graph(imports))
    # runtime -> planted and planted's typing-only import of runtime make no cycle; the
    # same import made at run time does
    back = Import("toptpu.backend.runtime.runtime", "backend/runtime/runtime.py", 1, False,
                  "toptpu.backend.runtime.planted")
    assert not _strongly_connected(import_graph([*imports, back]))
    at_run_time = [dataclasses.replace(i, typing_only=False) for i in planted]
    assert [sorted(c) for c in _strongly_connected(import_graph(
        [*all_imports(), *at_run_time, back]))] == [
        ["toptpu.backend.runtime.planted", "toptpu.backend.runtime.runtime"]]


def _page_rules() -> dict[str, frozenset[str]]:
    """The import-rule table of ARCHITECTURE.md: its `| package | may import | why |` rows."""
    with open(os.path.join(REPO, "ARCHITECTURE.md")) as f:
        text = f.read()
    section = text.split("\n## Import rules\n", 1)[1].split("\n## ", 1)[0]
    return {package: frozenset(re.findall(r"`([\w.*]+)`", allowed))
            for package, allowed in re.findall(r"^\| `([\w.]+)` \| (.*?) \|", section, re.M)}


def test_the_architecture_page_states_these_rules() -> None:
    assert _page_rules() == {k: frozenset(v) for k, v in RULES.items()}


def test_running_a_model_file_loads_no_torch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Import the runtime and generate from a model file on both executors, in a fresh
    interpreter: no torch, no transformers, nothing of the compiler."""
    path = compiled(tmp_path_factory, "qwen2").model_file
    script = f"""
import json, sys
from toptpu.backend.runtime.runtime import Runtime
for executor in ("machine", "interpreter"):
    rt = Runtime.open({path!r}, executor)
    res = rt.generate(rt.encode("Hello world"), 3)
    assert len(res.generated_ids) == 3
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=300)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "toptpu.backend.runtime.machine" in loaded  # the run happened in this process
    forbidden = [m for m in loaded if any(within(m, n) for n in (
        *NO_RUNTIME, "toptpu.passes", "toptpu.frontends", "toptpu.backend.codegen",
        "toptpu.compiler"))]
    assert not forbidden, f"running a model file loaded {forbidden}"
