"""The interface between the LLM runtime and whatever runs the compiled nets.

The runtime (prefill, decode, chat, sampling) is written once against `Executor`, an
abstract base class; three executors derive from it:

- `InterpreterExecutor`: the Tpu interpreter (numpy, op by op over the Tpu IR carried in the
  model file),
- `MachineExecutor`: the reference machine (command streams, local/global memory, timeline),
- `DeviceGroupExecutor` (a `MachineExecutor`): a file spread over several devices, one
  machine per device.

What every executor must do is abstract (`nets`, `alloc`, `write`, `read`, `run`); what
only some can do is a method with a default, never a probe for an attribute: the cost model
(`modelled_seconds` 0.0, `modelled_costs` None), a copy between buffers (`copy`: through
the host), planning ahead (`prepare`: nothing), the weight cache file (`use_weight_cache`:
refused, `stored`: None) and a trace on the modelled clock (`start_recording`: refused).

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

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from toptpu.backend.contract import NetInfo
from toptpu.backend.formats.llm_file import LlmFile, LlmHeader
from toptpu.backend.runtime.accounting import Costs
from toptpu.backend.runtime.errors import GenerationError
from toptpu.backend.runtime.run_trace import RunRecorder
from toptpu.backend.runtime.weight_cache_file import StoredForms


class Buffer(Protocol):
    """A region of device memory holding one tensor (shape, dtype)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def slot(self, axis: int, start: int, length: int) -> Buffer:
        """A view of `length` entries along `axis` from `start` (axis 1 of [1, SEQ, ...] is
        contiguous per slot when all leading axes have size 1)."""
        ...


class Executor(ABC):
    """Runs the nets of one compiled model file (see the module doc)."""

    #: the model file it runs
    file: LlmFile
    #: the validated model file header (`toptpu.backend.formats.llm_file.LlmHeader`): config,
    #: static shapes, generation config, ...
    meta: LlmHeader
    header: dict[str, Any]  # its JSON form

    # ------------------------------------------------------------------ what every one does
    @abstractmethod
    def nets(self) -> Mapping[str, NetInfo]:
        """The model file's nets by name."""

    @abstractmethod
    def alloc(self, shape: tuple[int, ...], dtype: str) -> Buffer:
        """A zeroed device buffer."""

    @abstractmethod
    def write(self, buf: Buffer, value: np.ndarray) -> None:
        """Copy `value` from the host into `buf`, a buffer of this executor."""

    @abstractmethod
    def read(self, buf: Buffer) -> np.ndarray:
        """A host copy of `buf`, a buffer of this executor."""

    @abstractmethod
    def run(self, net: str, bindings: Mapping[str, Buffer], layer: int | None = None) -> None:
        """Run `net` with each input/output name bound to a buffer; `layer` selects the
        weights of a per-layer net."""

    # ------------------------------------------------------------------ what some can do
    def copy(self, dst: Buffer, src: Buffer) -> None:
        """Copy `src` into `dst` (buffers of this executor, of one shape and dtype). By
        default through the host (`read`, then `write`); an executor that can copies on the
        device."""
        self.write(dst, self.read(src))

    def modelled_seconds(self) -> float:
        """Chip time modelled so far (0.0: no cost model)."""
        return 0.0

    def modelled_costs(self) -> Costs | None:
        """Chip time modelled so far by where it goes (None: no cost model)."""
        return None

    def prepare(self, nets: Sequence[str]) -> None:  # noqa: B027 - an optional step
        """Parse, check and plan `nets` now rather than on their first run (unknown names
        are left out). By default each net is prepared on its first run."""

    def use_weight_cache(self, stored: StoredForms | None) -> None:
        """Read converted weights from this model file's weight cache file (None: stop)."""
        raise GenerationError("this executor reads no weight cache file")

    @property
    def stored(self) -> StoredForms | None:
        """The weight cache file in use (None: none)."""
        return None

    def start_recording(self) -> RunRecorder:
        """Record every run and host transfer on the modelled clock from now on
        (`toptpu.backend.runtime.run_trace`). Needs a cost model."""
        raise GenerationError("a trace needs the machine executor (the Tpu interpreter has "
                              "no cost model, so no timeline): use --executor machine")


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


BufferT = TypeVar("BufferT")


def owned(buf: Buffer, kind: type[BufferT], error: type[Exception]) -> BufferT:
    """`buf` as this executor's buffer type `kind`; `error` when it is another's."""
    if not isinstance(buf, kind):
        raise error(f"a {type(buf).__name__} is not a buffer of this executor (a "
                    f"{kind.__name__})")
    return buf
