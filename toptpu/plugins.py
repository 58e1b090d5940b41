"""Plugins: passes and ops an installed package adds to toptpu.

A package declares one entry point in the group `toptpu.plugins` whose object is a
`Plugin` (or a function of no arguments returning one):

```toml
[project.entry-points."toptpu.plugins"]
my_plugin = "my_package:plugin"
```

```python
from toptpu.plugins import Plugin
plugin = Plugin("my-plugin", passes=(FuseSiluMulPass,), ops=(SiluMulOp,), description="...")
```

Each of its `passes` is an xDSL `ModulePass` class with a `name` (how `-p` and the compile's
pipeline text call it) and its options as dataclass fields (`expand-silu{form=tanh}`), as
toptpu's own passes are. Once installed, a plugin's passes run everywhere a pipeline is text:
`toptpu-opt -p` (and `--help` lists them with their options), `toptpu compile
--top-pipeline/--tpu-pipeline/--pass-after/--pass-before`, `toptpu estimate`, and the
`--from-ir` compile of a dump that ran them.

Each of its `ops` is a Top op class written as toptpu's own are (verifier, shape inference,
kernel binding with the kernel in the plugin's module, slicing answers, linalg lowering);
loading the plugin registers it and its derived Tpu twin (`toptpu.dialects.plugin_ops`): the
IR of every command parses them, `convert-top-to-tpu` lowers the op to its twin, the
interpreters and the machine run both through their kernel binding, and a model file
records the plugin ops it holds, so that a process running it loads the installed plugins'
ops (or refuses the file in one line naming the op and its plugin).

Loading is lazy (only commands that read pipeline text load plugins; running IR or a model
file that holds a plugin's op loads the plugins' ops) and forgiving: a plugin whose module
does not import, whose object is not a `Plugin`, one of whose passes is not a pass or takes
a name toptpu or xDSL already has, or one of whose ops cannot be taken (no kernel, a name
an op already has, ...: `plugin_ops.declaration_problem`) is one line
(`PluginProblem.line`) that the command prints as a warning; the good passes of a plugin
whose passes are broken, the other plugins and every other command go on. A plugin with an
op that cannot be taken is not loaded at all (its passes may need its ops).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xdsl.passes import ModulePass
from xdsl.transforms import get_all_passes
from xdsl.universe import Universe

from toptpu.dialects.plugin_ops import (
    ENTRY_POINT_GROUP,
    OpDeclarationError,
    distribution_of,
)
from toptpu.dialects.plugin_ops import register as register_ops
from toptpu.passes.registry import PASSES


@dataclass(frozen=True)
class Plugin:
    """What a plugin package adds: `passes` (ModulePass classes, each with its `name` and
    its options as dataclass fields) and `ops` (Top op classes with their kernels and
    lowerings: see the module doc). `name` is how messages and `toptpu-opt --help` call
    it."""

    name: str
    passes: tuple[type[ModulePass], ...] = ()
    ops: tuple[type, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LoadedPlugin:
    """A plugin loaded: the entry point it came from and the distribution that declares it."""

    plugin: Plugin
    entry_point: str  # "name = module:object"
    distribution: str  # "package 1.0", or "?" when the entry point names none


@dataclass(frozen=True)
class PluginProblem:
    """A plugin (or one of its passes) that could not be loaded, and why."""

    entry_point: str
    problem: str

    def line(self) -> str:
        return f"plugin {self.entry_point}: {self.problem}"


@dataclass(frozen=True)
class Plugins:
    """Every installed plugin loaded: the good ones, their passes by name, and the problems."""

    loaded: tuple[LoadedPlugin, ...] = ()
    passes: dict[str, tuple[type[ModulePass], LoadedPlugin]] = field(default_factory=dict)
    problems: tuple[PluginProblem, ...] = ()


def _describe(ep: metadata.EntryPoint) -> str:
    return f"'{ep.name}' ({ep.group}: {ep.value})"


def _distribution(ep: metadata.EntryPoint) -> str:
    return distribution_of(ep)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _pass_problem(cls: Any, taken: dict[str, str]) -> str | None:
    """Why `cls` cannot be a plugin pass (None: it can)."""
    if not (isinstance(cls, type) and issubclass(cls, ModulePass)):
        return f"{cls!r} is not a pass (an xDSL ModulePass class)"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        return f"the pass {cls.__name__} has no name"
    if not dataclasses.is_dataclass(cls):
        return f"the pass '{name}' is not a dataclass (its options are its fields)"
    if name in taken:
        return f"the pass '{name}' is not loaded: {taken[name]} already has a pass of that name"
    return None


def _load_one(ep: metadata.EntryPoint) -> Plugin:
    obj = ep.load()
    if not isinstance(obj, Plugin) and callable(obj) and not isinstance(obj, type):
        obj = obj()
    if not isinstance(obj, Plugin):
        raise TypeError(f"the entry point's object is {type(obj).__name__}, not a "
                        "toptpu.plugins.Plugin (or a function returning one)")
    return obj


@functools.cache
def load_plugins() -> Plugins:
    """Load every plugin of the `toptpu.plugins` entry-point group once (per process;
    `load_plugins.cache_clear()` looks again). Nothing raises: a problem is a line."""
    taken = {name: "toptpu" for name in PASSES}
    taken.update({name: "xDSL" for name in get_all_passes()})
    loaded: list[LoadedPlugin] = []
    passes: dict[str, tuple[type[ModulePass], LoadedPlugin]] = {}
    problems: list[PluginProblem] = []
    seen: set[tuple[str, str]] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if (ep.name, ep.value) in seen:  # one distribution seen on two path entries
            continue
        seen.add((ep.name, ep.value))
        where = _describe(ep)
        try:
            plugin = _load_one(ep)
        except Exception as e:  # noqa: BLE001 - any failure of foreign code is one line
            problems.append(PluginProblem(where, f"failed to load: {_one_line(e)}"))
            continue
        try:  # its ops first: its passes may make them
            register_ops(plugin.ops, plugin.name, _distribution(ep))
        except OpDeclarationError as e:
            problems.append(PluginProblem(where, f"{e}; the plugin is not loaded (its "
                                                 "passes may need its ops)"))
            continue
        entry = LoadedPlugin(plugin, f"{ep.name} = {ep.value}", _distribution(ep))
        loaded.append(entry)
        for cls in plugin.passes:
            problem = _pass_problem(cls, taken)
            if problem is not None:
                problems.append(PluginProblem(where, problem))
                continue
            passes[cls.name] = (cls, entry)
            taken[cls.name] = f"the plugin '{plugin.name}'"
    return Plugins(tuple(loaded), passes, tuple(problems))


def available_passes(plugins: Plugins | None = None
                     ) -> dict[str, Callable[[], type[ModulePass]]]:
    """Every pass a pipeline text may name, as xDSL's opt registers them (name -> a function
    returning the class): xDSL's own and those of `xdsl.universe` packages, toptpu's (which
    win over a same-named xDSL pass), and the plugins' (`load_plugins`)."""
    out: dict[str, Callable[[], type[ModulePass]]] = dict(get_all_passes())
    out.update(Universe.get_multiverse().all_passes)
    out.update(PASSES)  # ours: each module imported when its pass is named
    for name, (cls, _) in (plugins or load_plugins()).passes.items():
        out[name] = returning(cls)
    return out


def returning(cls: type[ModulePass]) -> Callable[[], type[ModulePass]]:
    """A pass registry's entry for `cls` (xDSL registers passes as functions returning
    their class)."""
    return lambda: cls


def pass_origin(name: str) -> str | None:
    """'the plugin NAME (package VERSION)' for a plugin's pass, None for any other."""
    found = load_plugins().passes.get(name)
    if found is None:
        return None
    _, entry = found
    return f"the plugin '{entry.plugin.name}' ({entry.distribution})"
