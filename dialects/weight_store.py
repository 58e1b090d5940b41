"""Weight stores: named tensors that `top.weight` / `tpu.weight` ops refer to by name.

Weights never live in the IR. A module names its store in the module attribute
`top.weight_store`: the path of a `.safetensors` file, or `memory:<id>` for a store that
only lives in the process that made it (an import, a compile). There is no process-wide
table of stores: whoever runs passes or the interpreter on a module holds its store and
hands it over explicitly.

- Passes get the store from their context (`WeightsContext`, `weights_of`): the driver
  puts the store in the context once, or the context opens the file the module names on
  the first pass that asks. A pass that derives tensors (quantization, weight reorder)
  adds them to that store; the store remembers which tensors were derived.
- `toptpu-opt` then saves what the resulting module needs (`needed_names`) to a
  companion file and points the module's `top.weight_store` at it, so every printed
  module is self-contained: its file holds every tensor it names.
- The interpreter takes the store as an argument, or opens the file the module names.

Names: a tensor `W#…` belongs to the weight `W` (a pre-quantized checkpoint's integers
and scales for the float weight `W`, see `passes.quantize.checkpoint_key`), and a tensor
`#…` describes the whole store (the pre-quantized marker): both travel with the weights
they belong to when a module's tensors are saved.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr

from toptpu.dialects import top
from toptpu.dialects.checkpoint_reader import CheckpointError, CheckpointReader, serialize
from toptpu.dialects.output_file import open_output
from toptpu.errors import ToptpuError

if TYPE_CHECKING:
    import torch

STORE_ATTR = "top.weight_store"
#: the prefix of a store that lives in this process only
MEMORY = "memory:"
#: `W#field` belongs to the weight W; `#name` to the whole store
ANNEX = "#"


class WeightStoreError(ToptpuError, ValueError):
    """A weight store that cannot be used (the module names none, a file that cannot be
    read, a store of another process, a store other than the one the passes were given)."""


class MissingWeightError(WeightStoreError, KeyError):
    """The IR names a tensor its weight store does not hold (a user's mismatch of IR and
    store, not a bug; a KeyError too, for the mapping protocol)."""

    def __init__(self, name: str, uri: str) -> None:
        super().__init__(f"weight '{name}' is not in the weight store {uri}: the IR names "
                         "a tensor the store does not hold (point top.weight_store at the "
                         "file the IR was exported with)")

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0])


_COUNTER = itertools.count()


def _torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _open_file(path: str) -> CheckpointReader:
    """A safetensors file, its header checked; WeightStoreError if it is not one."""
    if not os.path.exists(path):
        raise WeightStoreError(f"weight store '{path}' does not exist")
    if not os.path.isfile(path):
        raise WeightStoreError(f"weight store '{path}' is not a file")
    try:
        return CheckpointReader.file(path)
    except CheckpointError as e:
        raise WeightStoreError(f"weight store '{path}' is not a readable .safetensors file "
                               f"({e})") from None


class WeightStore:
    """Name -> numpy array, backed by safetensors files (read by name on first use, memory
    mapped) and by arrays in memory. Tensors set after construction are *derived*
    (`derived_names`): a file-backed store knows what its file does not hold."""

    def __init__(self, uri: str | None = None, placeholders: bool = False) -> None:
        self.uri = uri or f"{MEMORY}{os.getpid()}-{next(_COUNTER)}"
        #: a store of placeholder weights (`toptpu estimate`: zeros, of which only the
        #: shapes matter): a tensor derived from them is zeros too, never computed
        #: (`derive`), so no pass writes a page of it
        self.placeholders = placeholders
        self._arrays: dict[str, np.ndarray] = {}
        self._file: CheckpointReader | None = None  # the file of the lazy tensors
        self._lazy: set[str] = set()  # names still only in the file
        self._derived: set[str] = set()

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, path: str) -> WeightStore:
        """A store over a safetensors file (tensors are read on first use)."""
        path = os.path.abspath(path)
        store = cls(path)
        store._file = _open_file(path)
        store._lazy = set(store._file.names())
        return store

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> WeightStore:
        store = cls()
        for k, v in arrays.items():
            store[k] = v
        return store

    @property
    def in_memory(self) -> bool:
        return self.uri.startswith(MEMORY)

    # ------------------------------------------------------------------ mapping
    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._lazy

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._arrays:
            return self._arrays[name]
        if name in self._lazy and self._file is not None:
            try:  # a read-only view of the mapped file
                arr = self._file.tensor(name)
            except CheckpointError as e:
                raise WeightStoreError(f"weight store '{self.uri}': {e}") from None
            self._arrays[name] = arr
            return arr
        raise MissingWeightError(name, self.uri)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading a tensor that is still in its file."""
        if name in self._arrays:
            return tuple(self._arrays[name].shape)
        if name in self._lazy and self._file is not None:
            return self._file.info(name).shape
        raise MissingWeightError(name, self.uri)

    def __delitem__(self, name: str) -> None:
        """Forget a tensor (a compile lets go of what it will not write)."""
        if name not in self:
            raise MissingWeightError(name, self.uri)
        self._arrays.pop(name, None)
        self._lazy.discard(name)
        self._derived.discard(name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = np.ascontiguousarray(value)
        self._lazy.discard(name)
        self._derived.add(name)

    def derive(self, shape: tuple[int, ...], dtype: np.dtype | type,
               make: Callable[[], np.ndarray]) -> np.ndarray:
        """A tensor a pass derives from the store's: `make()`, or in a store of
        `placeholders` zeros of `shape` and `dtype` on untouched pages (no memory until
        read: the estimate's experts cost no memory per expert)."""
        if self.placeholders:
            return np.zeros(shape, dtype)
        value = make()
        if value.shape != tuple(shape) or value.dtype != np.dtype(dtype):
            raise WeightStoreError(f"a derived tensor is {value.dtype} {list(value.shape)}, "
                                   f"not the {np.dtype(dtype)} {list(shape)} said")
        return value

    def names(self) -> list[str]:
        return sorted(set(self._arrays) | set(self._lazy))

    def derived_names(self) -> set[str]:
        """Tensors set in this process (for a store opened from a file: not in the file)."""
        return set(self._derived)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(set(self._arrays) | set(self._lazy))

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return sum(int(self[n].nbytes) for n in (names if names is not None else self.names()))

    def unique_name(self, base: str) -> str:
        if base not in self:
            return base
        for i in itertools.count(1):
            if f"{base}.{i}" not in self:
                return f"{base}.{i}"
        raise AssertionError

    def save(self, path: str, names: Iterable[str] | None = None) -> None:
        """Write (a subset of) the store to one safetensors file by `open_output` (atomically:
        a temporary name in the same directory, then a rename; a device written through).
        Tensors that share memory (tied embeddings) are copied: safetensors stores no
        aliases."""
        arrays: dict[str, np.ndarray] = {}
        for name in (list(names) if names is not None else self.names()):
            arr = self[name]
            if any(np.may_share_memory(arr, seen) for seen in arrays.values()):
                arr = arr.copy()
            arrays[name] = arr
        data = serialize(arrays)  # bytes: written by the one output policy (a device as it is)
        with open_output(path, "the weights file", size=len(data)) as f:
            f.write(data)


# ---------------------------------------------------------------------- modules and stores

def store_uri(module: ModuleOp) -> str:
    """The store the module names in `top.weight_store`; WeightStoreError without one."""
    attr = module.attributes.get(STORE_ATTR)
    if not isinstance(attr, StringAttr):
        raise WeightStoreError(
            f"the module has no '{STORE_ATTR}' attribute naming its weight store; "
            "import the model with toptpu (or add the attribute with a .safetensors path)"
        )
    return attr.data


def open_store(module: ModuleOp) -> WeightStore:
    """Open the safetensors file the module names. A `memory:` store is only reachable
    through whoever holds it, so naming one here is an error that says so."""
    uri = store_uri(module)
    if uri.startswith(MEMORY):
        raise WeightStoreError(
            f"weight store '{uri}' lives in memory, with whoever made the module: pass that "
            f"store along with the module, or save it (WeightStore.save, --dump-ir) and point "
            f"'{STORE_ATTR}' at the file"
        )
    return WeightStore.open(uri)


def store_for(module: ModuleOp, store: WeightStore | None = None) -> WeightStore | None:
    """The store to run `module` with: `store` when given, else the file the module names
    (`open_store`); None for a module without weights."""
    if store is not None:
        return store
    if not any(isinstance(op, top.WeightBase) for op in module.walk()):
        return None
    return open_store(module)


def attach_store(module: ModuleOp, store: WeightStore) -> None:
    module.attributes[STORE_ATTR] = StringAttr(store.uri)


def needed_names(module: ModuleOp, store: WeightStore) -> list[str]:
    """The store's tensors `module` needs: every weight it names, the tensors that belong
    to those weights (`W#…`) and the store-wide ones (`#…`)."""
    weights = {op.tensor_name for op in module.walk() if isinstance(op, top.WeightBase)}
    return [n for n in store.names()
            if n in weights or n.startswith(ANNEX) or n.split(ANNEX, 1)[0] in weights]


# ---------------------------------------------------------------------- passes

@dataclass
class WeightsContext(Context):
    """An xDSL context that also carries the weight store of the module its passes run on.

    Every pass gets `(ctx, module)` and nested pipelines hand their context on, so the
    store travels with the pipeline without a field on each pass (pass fields are
    command-line options) and without a process-wide table. `weights` is set by the driver
    (the compiler hands its in-memory store), or on the first `weights_of` from the file
    the module names (toptpu-opt); the driver reads it back after the passes to see what
    they derived."""

    weights: WeightStore | None = None

    @classmethod
    def of(cls, ctx: Context, weights: WeightStore | None = None) -> WeightsContext:
        """`ctx`'s dialects with a weight store."""
        return cls(ctx.allow_unregistered, ctx._loaded_dialects.copy(),  # noqa: SLF001
                   ctx._loaded_ops.copy(), ctx._loaded_attrs.copy(),  # noqa: SLF001
                   ctx._loaded_types.copy(), ctx._registered_dialects.copy(),  # noqa: SLF001
                   weights)

    def clone(self) -> WeightsContext:
        return WeightsContext.of(self, self.weights)  # the same store: it belongs to the IR


def _same_store(a: str, b: str) -> bool:
    if a.startswith(MEMORY) or b.startswith(MEMORY):
        return a == b
    return os.path.abspath(a) == os.path.abspath(b)


def weights_of(ctx: Context, module: ModuleOp) -> WeightStore:
    """The weight store a pass reads and derives tensors in: the one in its context, which
    must be the store the module names."""
    uri = store_uri(module)
    if not isinstance(ctx, WeightsContext):
        raise WeightStoreError(
            "this pass reads weights: run it with a WeightsContext holding the module's "
            "store (toptpu-opt, or toptpu.passes.pipelines.run_passes(..., store=))")
    if ctx.weights is None:
        ctx.weights = open_store(module)
    elif not _same_store(ctx.weights.uri, uri):
        raise WeightStoreError(f"the module names the weight store '{uri}' but its passes "
                               f"were given '{ctx.weights.uri}'")
    return ctx.weights
