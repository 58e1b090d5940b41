"""Weight stores: named tensors that `top.weight` / `tpu.weight` ops refer to by name.

Weights never live in the IR. A module names its store in the module attribute
`top.weight_store` (a file path of a `.safetensors` file, or `memory:<id>` for a store
that only lives in this process). Passes that create tensors (quantization, weight
reorder) add them to the same store; `save` writes everything to one safetensors file
atomically (temporary name, then rename).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from xdsl.dialects.builtin import ModuleOp, StringAttr

STORE_ATTR = "top.weight_store"

_REGISTRY: dict[str, WeightStore] = {}


class WeightStoreError(ValueError):
    """A weight store file (named by a module's `top.weight_store`) that cannot be read."""


_COUNTER = itertools.count()


def _torch_to_numpy(t) -> np.ndarray:  # noqa: ANN001 - torch is imported lazily
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _numpy_to_torch(a: np.ndarray):  # noqa: ANN202
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class WeightStore:
    """Name -> numpy array, backed by safetensors files (lazily, memory mapped) and memory."""

    def __init__(self, uri: str | None = None) -> None:
        self.uri = uri or f"memory:{os.getpid()}-{next(_COUNTER)}"
        self._arrays: dict[str, np.ndarray] = {}
        self._lazy: dict[str, str] = {}  # name -> safetensors path
        _REGISTRY[self.uri] = self

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, path: str) -> WeightStore:
        """Open a safetensors file (tensors are read on first use)."""
        path = os.path.abspath(path)
        if path in _REGISTRY:
            return _REGISTRY[path]
        if not os.path.exists(path):
            raise WeightStoreError(f"weight store '{path}' does not exist")
        if not os.path.isfile(path):
            raise WeightStoreError(f"weight store '{path}' is not a file")
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise WeightStoreError(f"weight store '{path}' is not a readable .safetensors file "
                                   f"({e})") from None
        store = cls(path)
        store._lazy = dict.fromkeys(names, path)
        return store

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> WeightStore:
        store = cls()
        for k, v in arrays.items():
            store[k] = v
        return store

    # ------------------------------------------------------------------ mapping
    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._lazy

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._arrays:
            return self._arrays[name]
        if name in self._lazy:
            with safe_open(self._lazy[name], framework="pt") as f:
                arr = _torch_to_numpy(f.get_tensor(name))
            self._arrays[name] = arr
            return arr
        raise KeyError(f"weight '{name}' is not in the weight store {self.uri}")

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = np.ascontiguousarray(value)
        self._lazy.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._arrays) | set(self._lazy))

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
        """Write (a subset of) the store to one safetensors file, atomically."""
        from safetensors.torch import save_file

        keep = list(names) if names is not None else self.names()
        tensors = {n: _numpy_to_torch(self[n]) for n in keep}
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            save_file(tensors, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def store_of(module: ModuleOp) -> WeightStore:
    """The weight store a module refers to; a file path is opened on first use."""
    attr = module.attributes.get(STORE_ATTR)
    if not isinstance(attr, StringAttr):
        raise WeightStoreError(
            f"the module has no '{STORE_ATTR}' attribute naming its weight store; "
            "import the model with toptpu (or add the attribute with a .safetensors path)"
        )
    uri = attr.data
    if uri in _REGISTRY:
        return _REGISTRY[uri]
    if uri.startswith("memory:"):
        raise WeightStoreError(
            f"weight store '{uri}' lived in another process; save the weights with "
            f"--dump-ir (or WeightStore.save) and point '{STORE_ATTR}' at the file"
        )
    return WeightStore.open(uri)


def attach_store(module: ModuleOp, store: WeightStore) -> None:
    module.attributes[STORE_ATTR] = StringAttr(store.uri)
