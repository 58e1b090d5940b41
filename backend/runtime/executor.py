"""The interface between the LLM runtime and whatever runs the compiled nets.

The runtime (prefill, decode, chat, sampling) is written once against `Executor`; two
executors implement it:

- the Tpu interpreter (numpy, op by op over the Tpu IR carried in the model file), and
- the reference machine (command streams, local/global memory, timeline).

Memory is explicit: the runtime allocates device buffers (`alloc`), writes/reads them
(`write`/`read`), takes sub-views (`Buffer.slot`, e.g. one token's slot of a KV cache), and
runs a net with every input and output *bound* to a buffer. That is how decode writes the
new token's k/v straight into its cache slot (no concatenated copy) and how each layer runs
the one compiled `block` net with its own weights (`layer=`).

Binding rules every executor follows (the runtime in `toptpu.backend.runtime.runtime` relies on
them; `toptpu.backend.runtime.interpreter_executor` is the reference implementation):

- `run` gets exactly the net's input and output names (IO names of a net are unique:
  the block nets' hidden output is `hidden_out`; see `toptpu.backend.contract`); anything
  missing or extra is an error.
- A bound buffer has the spec's dtype and the spec's shape up to size-1 axes (shapes
  equal after dropping 1s): `hidden[0, n-1:n]` ([1, 1, H]) binds the lm_head's [1, H].
- `Buffer.slot(1, start, n)` of a [1, S, ...] buffer is the contiguous rows start..start+n
  (all leading axes have size 1), an alias of the same memory, not a copy.
- A net reads its inputs as they are before the run and its outputs land in their buffers
  by the end of it. An output may alias an input: decode binds `history_k` to the whole
  cache and `present_k` to `cache.slot(1, pos, 1)`; prefill_kv binds `history_k` to
  `cache.slot(1, 0, Hh)` and `present_k` to `cache.slot(1, start, L)`. The aliased rows are
  masked in that very run, so they may be read before or after the write, as long as every
  value stays finite (caches start zeroed; padded rows compute finite values).
- `layer=` is required for a per-layer net (`NetInfo.per_layer`) and forbidden otherwise;
  layer i's weights are the i-th chunk of the model file's weight blob
  (`toptpu.backend.formats.llm_file`).
- `modelled_seconds()` only grows; an executor without a cost model returns 0.0 and the
  runtime reports modelled times as "n/a". `modelled_costs()` splits it by where it goes
  (`toptpu.backend.runtime.accounting.Costs`: net engine time, launches, host transfers;
  `write` and `read` are host<->device copies), None without a cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from toptpu.backend.contract import NetInfo
from toptpu.backend.formats.llm_file import LlmHeader
from toptpu.backend.runtime.accounting import Costs


class Buffer(Protocol):
    """A region of device memory holding one tensor (shape, dtype)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def slot(self, axis: int, start: int, length: int) -> Buffer:
        """A view of `length` entries along `axis` from `start` (axis 1 of [1, SEQ, ...] is
        contiguous per slot when all leading axes have size 1)."""
        ...


class Executor(Protocol):
    """Runs the nets of one compiled model."""

    #: the validated model file header (`toptpu.backend.formats.llm_file.LlmHeader`): config,
    #: static shapes, generation config, ...
    meta: LlmHeader
    header: dict  # its JSON form

    def nets(self) -> Mapping[str, NetInfo]: ...

    def alloc(self, shape: tuple[int, ...], dtype: str) -> Buffer: ...

    def write(self, buf: Buffer, value: np.ndarray) -> None: ...

    def read(self, buf: Buffer) -> np.ndarray: ...

    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        """Run `net` with each input/output name bound to a buffer; `layer` selects the
        weights of a per-layer net."""
        ...

    def modelled_seconds(self) -> float:
        """Chip time modelled so far (0.0 for executors without a cost model)."""
        ...

    def modelled_costs(self) -> Costs | None:
        """Chip time modelled so far by where it goes (None without a cost model)."""
        ...


# ---------------------------------------------------------------------- the binding rules


def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` without its size-1 axes: bindings must agree on this (see the module doc)."""
    return tuple(d for d in shape if d != 1)


def check_bindings(net: str, info: NetInfo, bindings: Mapping[str, Any],
                   owns: Callable[[Any], bool], error: type[Exception]) -> None:
    """The binding rules of the module doc, for every executor: exactly the net's input and
    output names, each bound to a buffer the executor `owns`, of the spec's dtype and of its
    shape up to size-1 axes. Raises `error` naming the first broken rule."""
    names = [s.name for s in (*info.inputs, *info.outputs)]
    missing = [n for n in names if n not in bindings]
    extra = [n for n in bindings if n not in names]
    if missing or extra:
        raise error(f"net '{net}' needs bindings for {names}: missing {missing}, "
                    f"unexpected {extra}")
    for spec in (*info.inputs, *info.outputs):
        buf = bindings[spec.name]
        if not owns(buf):
            raise error(f"'{spec.name}' of net '{net}' is bound to a {type(buf).__name__}, "
                        "not a buffer of this executor")
        if buf.dtype != np.dtype(spec.dtype) or squeezed(buf.shape) != squeezed(spec.shape):
            raise error(f"'{spec.name}' of net '{net}' is {spec.dtype} {list(spec.shape)} but "
                        f"is bound to a {buf.dtype} buffer of shape {list(buf.shape)}")


def value_for(buf: Buffer, value: Any, error: type[Exception]) -> np.ndarray:
    """`value` as the host writes it into `buf`: its shape up to size-1 axes, converted to
    the buffer's dtype within its kind (no integer <-> float conversion). Raises `error`."""
    value = np.asarray(value)
    if squeezed(value.shape) != squeezed(buf.shape):
        raise error(f"cannot write a {list(value.shape)} array into a buffer of shape "
                    f"{list(buf.shape)}")
    if np.issubdtype(value.dtype, np.integer) != np.issubdtype(buf.dtype, np.integer):
        raise error(f"cannot write {value.dtype} into a {buf.dtype} buffer")
    return value.astype(buf.dtype, copy=False).reshape(buf.shape)
