"""Top ops a plugin adds, with their Tpu twins, beside toptpu's own.

An installed plugin (the entry-point group `toptpu.plugins`; `toptpu/plugins.py`) may
declare Top op classes (`Plugin.ops`) written as toptpu's own are: an xDSL op class
deriving from `top.TopOp`, named `top.<kind>`, with its verifier and shape inference
(`infer`), its kernel binding (`KERNEL` in `KERNEL_MODULE`: the plugin's module holds the
numpy kernel), its slicing answers (`SlicingInterface`) and its linalg lowering
(`lower_to_linalg`), everything the Tpu level needs on a base class its twin derives from
(see `tpu.derive_twin`). `register` checks the declaration (`declaration_problem`: one
line), derives the op's Tpu twin as every in-tree twin is derived, and from then on, in
this process:

- every context toptpu parses with holds both ops (`toptpu.dialects.all_dialects`: the Top
  and Tpu dialects with their op sets extended, `extended`). An xDSL `Dialect` is its name
  and its op classes, so the extended dialect is `Dialect("top", [*Top.operations, *the
  plugins' ops])`; the ops keep the names `top.<kind>` and `tpu.<kind>`, on which every
  stage keys (the level checks, `convert-top-to-tpu`'s leftovers, the command streams'
  kinds, profiles), so no stage treats a plugin's op apart;
- `convert-top-to-tpu` lowers the op to its twin (`twin_of`), as it lowers every op;
- the interpreters and the machine run both through their kernel binding
  (`backend/reference/interpreter.py`, `evaluator_for`).

A model file records the plugin ops its nets hold (`used_in`, the header's
`compile.plugin_ops`); opening it (`require`) loads the installed plugins' ops when one is
not registered yet (`load_installed`), and refuses the file in one line naming the op and
its plugin when no installed plugin declares it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from xdsl.ir import Dialect, Operation
from xdsl.irdl import IRDLOperation

from toptpu.dialects import top, tpu
from toptpu.dialects.common import ShapedOp
from toptpu.errors import ToptpuError

#: the entry-point group a plugin package declares its `toptpu.plugins.Plugin` in
ENTRY_POINT_GROUP = "toptpu.plugins"


class OpDeclarationError(ToptpuError, ValueError):
    """A plugin's op class toptpu cannot take (the message says why, in one line)."""


class PluginOpMissingError(ToptpuError, LookupError):
    """IR or a model file holds a plugin's op that no installed plugin declares."""


@dataclass(frozen=True)
class PluginOp:
    """A plugin's Top op registered, its Tpu twin, and the plugin that declares it."""

    top: type[ShapedOp]
    tpu: type[ShapedOp]
    plugin: str  # the plugin's name
    package: str  # its distribution: "toptpu-plugin-example 0.1.0" ("?" when unknown)

    def origin(self) -> str:
        """How messages name the op's plugin: "the plugin 'example' (package 0.1.0)"."""
        return f"the plugin '{self.plugin}' ({self.package})"


#: Top op class -> its registration; `_BY_NAME`: both op names -> the same
_REGISTERED: dict[type, PluginOp] = {}
_BY_NAME: dict[str, PluginOp] = {}


def _kernel_problem(cls: type[ShapedOp]) -> str | None:
    """Why the kernel binding of `cls` does not resolve (None: it does)."""
    module_name = cls.KERNEL_MODULE
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - foreign code: any failure is the one line
        return f"its kernel module '{module_name}' does not import ({type(e).__name__}: {e})"
    for name in (cls.kernel_name(), *(cls.REDUCTION_KERNELS or ())):
        if not callable(getattr(module, name, None)):
            return (f"it has no kernel: its KERNEL_MODULE '{module_name}' defines no "
                    f"function '{name}' (set KERNEL_MODULE to the plugin's module of "
                    "kernels and KERNEL to the function's name)")
    return None


def _why_not(cls: type[IRDLOperation], name: str) -> str | None:
    """Why the op class `cls` named `name` (`top.<kind>`) cannot be taken (None: it can)."""
    if not issubclass(cls, top.TopOp):
        return "it does not derive from toptpu.dialects.top.TopOp"
    try:
        cls.get_irdl_definition()
    except Exception:  # noqa: BLE001 - not made by irdl_op_definition
        return "it is not an op definition (decorate it @irdl_op_definition)"
    for taken, dialect in ((name, top.Top), (f"tpu.{cls.op_kind()}", tpu.Tpu)):
        if any(op.name == taken for op in dialect.operations):
            return f"toptpu already has an op '{taken}'"
        other = _BY_NAME.get(taken)
        if other is not None and other.top is not cls:
            return f"{other.origin()} already has an op '{taken}'"
    if cls.STRUCTURAL or cls.SOURCE:
        return "it is structural or a source (a plugin's op is computed by its kernel)"
    if next(c for c in cls.__mro__ if "infer" in vars(c)) is ShapedOp:  # its default
        return "it has no shape inference (a classmethod infer)"
    return _kernel_problem(cls)


def declaration_problem(cls: object) -> str | None:
    """Why `cls` cannot be a plugin's Top op, in one line (None: it can): it must be an xDSL
    op class deriving from `top.TopOp`, named `top.<kind>` where neither `top.<kind>` nor
    `tpu.<kind>` is an op already, computed by a kernel (not structural, not a source)
    that resolves, with its own shape inference."""
    if not (isinstance(cls, type) and issubclass(cls, IRDLOperation)):
        return f"{cls!r} is not an op class (an xDSL IRDLOperation)"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.startswith("top.") or not name[4:].isidentifier():
        return f"the op class {cls.__name__} is named {name!r}, not 'top.<kind>'"
    why = _why_not(cls, name)
    return None if why is None else f"the op '{name}' is not loaded: {why}"


def register(ops: Sequence[object], plugin: str, package: str = "?"
             ) -> tuple[PluginOp, ...]:
    """Register a plugin's ops, all or none: OpDeclarationError (one line naming the op and
    what is wrong) when one cannot be taken. An op registered already by the same plugin
    is kept as it is."""
    fresh: list[type[ShapedOp]] = []
    for cls in ops:
        known = _REGISTERED.get(cls) if isinstance(cls, type) else None
        if known is not None and known.plugin == plugin:
            continue
        problem = declaration_problem(cls)
        if problem is not None:
            raise OpDeclarationError(problem)
        assert isinstance(cls, type) and issubclass(cls, ShapedOp)  # as checked
        if any(c.name == cls.name for c in fresh):
            raise OpDeclarationError(f"the op '{cls.name}' is not loaded: it is declared "
                                     "twice")
        fresh.append(cls)
    made: list[PluginOp] = []
    for cls in fresh:
        try:
            twin = tpu.derive_twin(cls, cls.__module__)
        except Exception as e:  # noqa: BLE001 - the twin of a foreign class
            raise OpDeclarationError(f"the op '{cls.name}' has no Tpu twin: "
                                     f"{type(e).__name__}: {e}") from None
        made.append(PluginOp(cls, twin, plugin, package))
    for entry in made:
        _REGISTERED[entry.top] = entry
        _BY_NAME[entry.top.name] = entry
        _BY_NAME[entry.tpu.name] = entry
    return tuple(_REGISTERED[cls] for cls in ops if isinstance(cls, type))


def clear() -> None:
    """Forget every registered plugin op (and that the installed plugins were loaded)."""
    _REGISTERED.clear()
    _BY_NAME.clear()
    load_installed.cache_clear()


def registered() -> tuple[PluginOp, ...]:
    """The plugin ops registered in this process, in registration order."""
    return tuple(_REGISTERED.values())


def plugin_op(name: str) -> PluginOp | None:
    """The registration of the plugin op called `name` (`top.<kind>` or `tpu.<kind>`)."""
    return _BY_NAME.get(name)


def is_plugin_op(cls: type[Operation]) -> bool:
    """Whether `cls` is a registered plugin op or the twin of one."""
    entry = _BY_NAME.get(getattr(cls, "name", ""))
    return entry is not None and cls in (entry.top, entry.tpu)


def twin_of(cls: type[Operation]) -> type[ShapedOp] | None:
    """The Tpu twin of Top op class `cls`: in-tree (`tpu.TPU_OF_TOP`) or a plugin's; None
    when it has none."""
    if not issubclass(cls, ShapedOp):
        return None
    found = tpu.TPU_OF_TOP.get(cls)
    if found is not None:
        return found
    entry = _REGISTERED.get(cls)
    return None if entry is None else entry.tpu


def extended(dialect: Dialect) -> Dialect:
    """`dialect` with the registered plugin ops of its name it does not hold yet (itself
    when there are none)."""
    ops = list(dialect.operations)
    extra = [op for entry in _REGISTERED.values() for op in (entry.top, entry.tpu)
             if Dialect.split_name(op.name)[0] == dialect.name and op not in ops]
    if not extra:
        return dialect
    return Dialect(dialect.name, [*ops, *extra], list(dialect.attributes))


def used_in(modules: Iterable[Operation]) -> dict[str, PluginOp]:
    """The plugin ops the `modules` hold, by op name (sorted)."""
    found: dict[str, PluginOp] = {}
    for module in modules:
        for op in module.walk():
            entry = _BY_NAME.get(op.name)
            if entry is not None and type(op) in (entry.top, entry.tpu):
                found[op.name] = entry
    return dict(sorted(found.items()))


def _plugin_object(ep: metadata.EntryPoint) -> object:
    """The object an entry point of the group names (called when it is a function)."""
    obj = ep.load()
    if callable(obj) and not isinstance(obj, type) and not hasattr(obj, "ops"):
        obj = obj()
    return obj


def distribution_of(ep: metadata.EntryPoint) -> str:
    """'package version' of the distribution declaring `ep` ("?" when it names none)."""
    dist = getattr(ep, "dist", None)
    return "?" if dist is None else f"{dist.metadata['Name']} {dist.version}"


@functools.cache
def load_installed() -> tuple[str, ...]:
    """Register the ops of every installed plugin (once per process; `clear` forgets):
    what a process that runs IR needs when the IR holds a plugin's op and no command
    loaded the plugins (`toptpu.plugins.load_plugins`, which registers them too, loads
    their passes besides). A plugin that does not load, or whose ops cannot be taken, is
    one line of the result, and its ops are not registered."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if (ep.name, ep.value) in seen:
            continue
        seen.add((ep.name, ep.value))
        try:
            obj = _plugin_object(ep)
            ops = tuple(getattr(obj, "ops", ()))
            if ops:
                register(ops, str(getattr(obj, "name", ep.name)), distribution_of(ep))
        except Exception as e:  # noqa: BLE001 - foreign code: any failure is one line
            problems.append(f"plugin '{ep.name}' ({ep.group}: {ep.value}): "
                            f"{type(e).__name__}: {' '.join(str(e).split())}")
    return tuple(problems)


def require(ops: Mapping[str, tuple[str, str]], what: str) -> None:
    """Make sure every plugin op of `ops` (op name -> (plugin, package), as a model file
    records them) is registered, loading the installed plugins' ops when one is not;
    PluginOpMissingError naming `what` (the file), the op and its plugin otherwise."""
    missing = [n for n in ops if n not in _BY_NAME]
    if missing:
        problems = load_installed()
        missing = [n for n in ops if n not in _BY_NAME]
    if not missing:
        return
    name = missing[0]
    plugin, package = ops[name]
    why = (f"; an installed plugin failed to load: {problems[0]}" if problems else "")
    raise PluginOpMissingError(
        f"{what} uses the op '{name}' of the plugin '{plugin}' ({package}), which is not "
        f"installed: install that plugin (its package {package.split(' ')[0]}) to run "
        f"it{why}")
