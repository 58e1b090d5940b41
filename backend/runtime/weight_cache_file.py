"""The weight cache file: a model file's converted weights, made once and kept beside it.

The executors multiply by f32 forms of the weights (`weight_cache`): a `tpu.a16_matmul`
weight dequantized (`kernels.dequantize`), a f16/bf16 `tpu.matmul` weight (the lm_head)
upcast (`kernels.f32`). Those forms depend only on the model file, yet each fresh process
made them again inside its first prefill: for a 24-layer Qwen2.5-0.5B in w4bf16 that was
most of the time to the first token. `toptpu cache MODEL_FILE` (`write_weight_cache`)
writes them once to `MODEL_FILE.wcache` (`cache_path`) — every weight's whole form, and
each reduction part a net's layer group reads of one (`FormEntry.part`: a K split's
window of the whole form, stored contiguous so the machine multiplies by it as it is);
`toptpu run` and `chat` map that file read-only when it is there (`StoredForms`), so the
first token multiplies by them without converting anything. The file is optional:
without it (or when it is refused) the weights are converted as before, with the same
bits. After such a run `toptpu run` and `chat` write it themselves (`write_if_missing`),
saying so with its size, when it fits TOPTPU_WEIGHT_CACHE_FILE's limit (`AUTO_LIMIT` by
default; `off`: never) and half the disk's free space.

The file is untrusted input like the model file, and is never trusted unless it is the
conversion of this very model file:

- it is a checksummed container (`backend.formats.model_file`: magic, version, header
  sha256, a section table placing every section, zero padding) written atomically with
  `dialects.output_file.open_output`, never over a path that is not a regular file;
- its header (`CacheHeader`, every field type- and range-checked) names the model file it
  was made from by that file's header sha256 (`ModelFile.digest`), which covers the
  sha256 of every section of the model file, checked when the model file is opened: a
  cache of another model file, or of an earlier compile of this one, is refused;
- every form names the tensors it was made from by their offsets in the model file's
  weight blob, each checked to be an entry of the weight table of the right dtype and
  shape (the qweight, its scales and zero points or float mins — the scale-and-min
  variant of a GGUF file's Q4_1, Q4_K, ... —, their group size and bits); each form's
  section is sized by its shape, and every section is some form's;
- the bytes of each form are checked against the model file when first used: some of
  its rows (the first, the last and ones spread between, `SAMPLED_ROWS`) are converted
  from the model file's bytes and compared bit for bit. A form that differs turns the
  whole file off for the rest of the process (`StoredForms.problem`), and the weights
  are converted as without it.

What the first-use check cannot see is a change in rows it does not sample: checking
every byte (`toptpu cache --check`, `StoredForms.verify`) costs about what converting
costs, which is what the file saves. A model file spread over several devices has one
weight blob per device and no weight cache file: writing or opening one for it is refused
(`WeightCacheFileError`). See docs/limits.md.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import numpy as np

from toptpu.backend.contract import NetName
from toptpu.backend.formats.commands import Compute, Load, Space
from toptpu.backend.formats.header_schema import (
    HeaderError,
    Name,
    Range,
    decode,
    encode,
)
from toptpu.backend.formats.llm_file import KIND as LLM_KIND
from toptpu.backend.formats.llm_file import LlmFile, WeightEntry
from toptpu.backend.formats.model_file import (
    HEADER_OFFSET,
    MAGIC,
    ModelFile,
    ModelFileError,
    StreamedSection,
    write_model_file,
)
from toptpu.backend.formats.program import Program
from toptpu.backend.reference import kernels as K
from toptpu.backend.runtime.steps import held_key, held_window
from toptpu.backend.runtime.weight_cache import parse_size
from toptpu.dialects import tpu
from toptpu.dialects.common import ShapedOp
from toptpu.dialects.output_file import OutputPathError, output_target
from toptpu.dialects.top import weight_name
from toptpu.errors import ToptpuError

#: the weight cache file of MODEL_FILE is MODEL_FILE + SUFFIX
SUFFIX = ".wcache"
KIND: Final = "toptpu-weight-cache"
#: 2: forms of reduction parts (`FormEntry.part`)
CACHE_FORMAT: Final = 2
#: how many rows of each form are converted again and compared on its first use
SAMPLED_ROWS = 8
#: most header bytes read to see what an existing file at the output path is
MAX_HEADER_READ = 64 << 20
#: the float dtypes whose matmul weights the executors upcast to f32 once
UPCAST_DTYPES = ("float16", "bfloat16")
#: the environment variable that bounds (or turns off) the weight cache file `toptpu run`
#: and `chat` write when there is none (`write_if_missing`)
AUTO_ENV_VAR = "TOPTPU_WEIGHT_CACHE_FILE"
#: the most bytes that file may take by default (a 24-layer Qwen2.5-0.5B in w4bf16:
#: 2.39 GB; a 7B model's, ~28 GB, is not written unless asked for)
AUTO_LIMIT = 4 << 30


class WeightCacheFileError(ToptpuError):
    """A weight cache file that cannot be used (or written); the message says why and what
    to do."""


def cache_path(model_path: str) -> str:
    """Where the weight cache file of a model file lies: beside it, `MODEL.wcache`."""
    return os.fspath(model_path) + SUFFIX


# =========================================================================== header

@dataclass(frozen=True)
class FormEntry:
    """One converted weight: the section holding its f32 form (`shape`), what it was made
    from (offsets in the model file's weight blob) and how.

    `a16`: `kernels.dequantize(qweight, scales, zeros, bits, group_size, mins)` of the
    packed weight at `source`, its scales at `scales`, zero points at `zeros` and float
    mins at `mins` (-1: none; a weight has zero points or mins, not both); `f32`:
    `kernels.f32` of the f16/bf16 weight at `source` (scales, zeros and mins -1, bits and
    group_size 0)."""

    section: Name
    form: Literal["a16", "f32"]
    source: int
    scales: Annotated[int, Range(-1)]
    zeros: Annotated[int, Range(-1)]
    mins: Annotated[int, Range(-1)]
    bits: Annotated[int, Range(0, 8)]
    group_size: int
    shape: tuple[Annotated[int, Range(1)], ...]
    #: a part of the weight's form (rows start, rows, columns start, columns), stored
    #: contiguous: a reduction part a net's layer group reads (its columns: a window of
    #: the whole form with rows of a few bytes); () the whole form
    part: tuple[Annotated[int, Range(0)], ...] = ()

    @property
    def key(self) -> tuple:
        """What a lookup names: the form, everything it is made from, and its part."""
        return (self.form, self.source, self.scales, self.zeros, self.mins, self.bits,
                self.group_size, self.part)

    @property
    def window(self) -> tuple[slice, slice]:
        """The part's index in the whole form (all of it without a part)."""
        if not self.part:
            return slice(None), slice(None)
        r0, rn, c0, cn = self.part
        return slice(r0, r0 + rn), slice(c0, c0 + cn)


@dataclass(frozen=True)
class CacheHeader:
    """The weight cache file's header (see the module doc)."""

    kind: Literal["toptpu-weight-cache"]
    cache_format: Literal[2]
    #: the header sha256 of the model file the forms were made from (`ModelFile.digest`)
    model_digest: str
    forms: tuple[FormEntry, ...]

    def check(self) -> None:
        if len(self.model_digest) != 64 or any(c not in "0123456789abcdef"
                                               for c in self.model_digest):
            raise HeaderError("model_digest", "is not 64 lowercase hex digits (a sha256)")
        keys: dict[tuple, int] = {}
        sections: set[str] = set()
        for i, f in enumerate(self.forms):
            where = f"forms[{i}]"
            if f.key in keys:
                raise HeaderError(where, f"converts the same weight as forms[{keys[f.key]}]")
            keys[f.key] = i
            if f.section in sections:
                raise HeaderError(f"{where}.section", f"is {f.section!r}, another form's")
            sections.add(f.section)
            if len(f.shape) != 2:
                raise HeaderError(f"{where}.shape", f"is {list(f.shape)}, not [rows, columns]")
            if f.part and (len(f.part) != 4 or (f.part[1], f.part[3]) != tuple(f.shape)):
                raise HeaderError(f"{where}.part", f"is {list(f.part)}, not [rows start, "
                                                   f"rows, columns start, columns] of its "
                                                   f"shape {list(f.shape)}")
            if f.form == "a16":
                if f.bits not in (4, 8):
                    raise HeaderError(f"{where}.bits", f"is {f.bits}, not 4 or 8")
                if f.group_size < 1 or f.shape[1] % f.group_size or (
                        f.part and f.part[2] % f.group_size):
                    raise HeaderError(f"{where}.group_size",
                                      f"is {f.group_size}, which does not divide the "
                                      f"{f.shape[1]} columns (from {list(f.part[2:3])})")
                if f.scales < 0:
                    raise HeaderError(f"{where}.scales", "is -1: a dequantized weight has "
                                                         "scales")
                if f.zeros >= 0 and f.mins >= 0:
                    raise HeaderError(where, "names zero points and mins: a weight has one "
                                             "or the other")
            elif (f.scales, f.zeros, f.mins, f.bits, f.group_size) != (-1, -1, -1, 0, 0):
                raise HeaderError(where, "is an upcast (f32) form with scales, zero points, "
                                         "mins, bits or a group size")


# =========================================================================== the forms a file needs


@dataclass(frozen=True)
class _Use:
    """A weight a net converts: by name (a16: the packed weight, its scales, zero points or
    mins)."""

    form: str
    source: str
    scales: str | None = None
    zeros: str | None = None
    mins: str | None = None
    bits: int = 0
    group_size: int = 0


def _uses(model: LlmFile, net: str) -> list[_Use]:
    """The weights net `net`'s Tpu IR converts (as the executors find them)."""
    out = []
    for op in model.net_module(net).walk():
        if not isinstance(op, ShapedOp) or (conv := op.converted_weight()) is None:
            continue
        groups = op.operand_groups()
        values = [groups[i] for i in conv.operands]
        names = [weight_name(v) for v in values]
        if any(v is not None and n is None for v, n in zip(values, names, strict=True)):
            continue  # not a weight the executors convert once
        source, *annexes = names
        assert source is not None
        scales, zeros, mins = (*annexes, None, None, None)[:3]
        out.append(_Use(conv.form, source, scales, zeros, mins, conv.bits, conv.group_size))
    return out


def _tables(model: LlmFile, net: str) -> list[dict[str, int]]:
    """Name -> absolute blob offset of the weights net `net` reads: once for a net shared
    by all layers, once per layer running it for a per-layer net."""
    layout, meta = model.layout, model.meta
    shared = {n: e.offset for n, e in layout.shared.items()}
    if not meta.nets[net].per_layer:
        return [shared]
    full = str(NetName.parse(net).layer_net)
    layers = [i for names in meta.layer_nets.values() for i, name in enumerate(names)
              if name == full]
    return [{**shared, **{n: layout.layer_start(i) + e.offset
                          for n, e in layout.chunk_of(i).items()}}
            for i in sorted(set(layers))]


def _parts(model: LlmFile, net: str, uses: list[_Use]
           ) -> list[tuple[_Use, tuple[int, ...]]]:
    """The reduction parts net `net`'s layer groups read of the weights it converts (a
    matmul's K split: each part's weights a window of the whole form, its columns): each
    use with its part of the form (rows start, rows, columns start, columns), as the
    machine's loads hold it (`_stored_window`)."""
    by_name = {u.source: u for u in uses}
    prog = Program.from_json(model.file.view(model.meta.nets[net].streams))
    writer: dict[int, Load] = {}  # local buffer -> the load that last wrote it
    found: dict[tuple, tuple[_Use, tuple[int, ...]]] = {}
    for c in prog.commands:
        if isinstance(c, Load):
            writer[c.local.buf] = c
            continue
        if not (isinstance(c, Compute) and c.parts > 1 and len(c.ins) > 1
                and c.kind in ("tpu.a16_matmul", "tpu.matmul")):
            continue
        first = c.ins[1]
        ld = writer.get(first.buf) if first is not None else None
        u = by_name.get(ld.tensor.name or "") if ld is not None else None
        if ld is None or u is None or ld.tensor.space is not Space.WEIGHT:
            continue
        refs = (list(c.ins[tpu.A16MatMulOp.WEIGHT_OPERANDS]) if u.form == "a16"
                else [first])
        provs: list[tuple | None] = []  # what the machine's loads hold (`LoadStep`)
        for r in refs:
            w = writer.get(r.buf) if r is not None else None
            provs.append(None if w is None else (0, *held_window(w)))
        if any(p is None for p, r in zip(provs, refs, strict=True) if r is not None):
            continue
        special = "a16" if u.form == "a16" else "f32w"
        window = _stored_window(special, held_key(provs), u.bits, u.group_size)
        part = () if window is None else form_part(window, ld.shape, special, u.bits)
        whole = form_part((slice(None), slice(None)), ld.shape, special, u.bits)
        if part and part != whole:
            found[(u.source, part)] = (u, part)
    return list(found.values())


def planned_forms(model: LlmFile) -> list[FormEntry]:
    """Every form the executors would make of `model`'s weights, once each, in blob
    order of their sources (sections `f0`, `f1`, ...): each weight's whole form, and each
    reduction part a net reads of it (`_parts`) stored contiguous beside it."""
    entries = _entries(model)
    found: dict[tuple, FormEntry] = {}
    for net in model.meta.nets:
        uses = _uses(model, net)
        if not uses:
            continue
        parts = _parts(model, net, uses)
        for table in _tables(model, net):
            for u, part in [*((u, ()) for u in uses), *parts]:
                src = table[u.source]
                e = entries[src]
                shape = (part[1], part[3]) if part else None
                if u.form == "a16":
                    assert u.scales is not None
                    k = e.shape[1] * 8 // u.bits
                    f = FormEntry("", "a16", src, table[u.scales],
                                  -1 if u.zeros is None else table[u.zeros],
                                  -1 if u.mins is None else table[u.mins], u.bits,
                                  u.group_size, shape or (e.shape[0], k), part)
                else:
                    f = FormEntry("", "f32", src, -1, -1, -1, 0, 0, shape or tuple(e.shape),
                                  part)
                found.setdefault(f.key, f)
    ordered = sorted(found.values(), key=lambda f: (f.source, f.part))
    return [FormEntry(f"f{i}", *_fields(f)[1:]) for i, f in enumerate(ordered)]


def _fields(f: FormEntry) -> tuple[Any, ...]:
    return (f.section, f.form, f.source, f.scales, f.zeros, f.mins, f.bits, f.group_size,
            f.shape, f.part)


def _entries(model: LlmFile) -> dict[int, WeightEntry]:
    """Every tensor of the weight blob by its absolute offset (shared and every layer's;
    a shared tensor stored once under several names is one entry)."""
    layout = model.layout
    out: dict[int, WeightEntry] = {e.offset: e for e in layout.shared.values()}
    for i in range(layout.num_layers):
        base = layout.layer_start(i)
        for e in layout.chunk_of(i).values():
            out[base + e.offset] = e
    return out


def _blob(model: LlmFile) -> np.ndarray:
    return np.frombuffer(model.file.view(model.layout.section), np.uint8)


def _tensor(blob: np.ndarray, offset: int, e: WeightEntry) -> np.ndarray:
    return blob[offset:offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.shape)


def convert(form: FormEntry, blob: np.ndarray, entries: dict[int, WeightEntry],
            rows: slice | np.ndarray | None = None) -> np.ndarray:
    """The f32 form of `form` from the model file's bytes (`rows` of it only), exactly as
    the executors' cache makes it."""
    def t(offset: int) -> np.ndarray:
        arr = _tensor(blob, offset, entries[offset])
        return arr if rows is None else arr[rows]

    if form.part:  # the part's rows of the whole form, then its columns
        r0, rn = form.part[0], form.part[1]
        rows = (np.arange(r0, r0 + rn) if rows is None
                else np.arange(r0, r0 + rn)[rows])
    if form.form == "f32":
        whole = K.f32(t(form.source))
    else:
        whole = K.dequantize(t(form.source), t(form.scales),
                             None if form.zeros < 0 else t(form.zeros), form.bits,
                             form.group_size, None if form.mins < 0 else t(form.mins))
    return whole[:, form.window[1]] if form.part else whole


# =========================================================================== windows


def _held_window(p: tuple) -> dict[int, tuple[int, int]]:
    """What part of its tensor a held window `p` (`held_key`: addr, shape, dtype, axis,
    start, length, cuts) holds: (start, length) by axis, the axes it holds whole left out."""
    shape = p[1]
    parts = [(p[3], p[4], p[5]), *((c.axis, c.start, c.length) for c in p[6])]
    return {axis: (start, length) for axis, start, length in parts
            if (start, length) != (0, shape[axis])}


def _stored_window(special: str, key: tuple, bits: int, group_size: int
                   ) -> tuple[slice, ...] | None:
    """The window of a stored f32 form that `key`'s windowed operands hold (`held_key`:
    (addr, shape, dtype, axis, start, length, cuts) each), None where they do not describe
    one: an upcast weight's window is the form's (its sliced axis and its cuts); an a16
    weight's packed window along its rows (output channels) is the same rows of the form,
    along its packed K bytes the columns they unpack to, with its scales and zero points or
    mins windowed over the same rows and the groups of those columns."""
    first = key[0]
    held = _held_window(first)
    index = [slice(None)] * len(first[1])
    if special != "a16":
        for axis, (start, length) in held.items():
            index[axis] = slice(start, start + length)
        return tuple(index)
    if len(first[1]) != 2 or (8 % bits):
        return None
    want: dict[int, tuple[int, int]] = {}  # the scales', zero points' or mins' window
    if 0 in held:
        start, length = want[0] = held[0]
        index[0] = slice(start, start + length)
    if 1 in held:
        per_byte = 8 // bits
        lo, n = held[1][0] * per_byte, held[1][1] * per_byte
        if group_size < 1 or lo % group_size or n % group_size:
            return None
        want[1] = (lo // group_size, n // group_size)
        index[1] = slice(lo, lo + n)
    if any(p is not None and (_held_window(p) if len(p) > 2 else {}) != want
           for p in key[1:]):
        return None
    return tuple(index)


def form_part(window: tuple[slice, ...], shape: tuple[int, ...], special: str, bits: int
              ) -> tuple[int, ...]:
    """A window of a weight's f32 form as `FormEntry.part` (rows start, rows, columns
    start, columns): `shape` the weight's own (packed for an a16 weight, `bits` a value);
    () where the form is not 2-D."""
    if len(shape) != 2 or len(window) != 2:
        return ()
    whole = (shape[0], shape[1] * 8 // bits) if special == "a16" else tuple(shape)
    (r0, r1, _), (c0, c1, _) = (w.indices(n) for w, n in zip(window, whole, strict=True))
    return (r0, r1 - r0, c0, c1 - c0)


# =========================================================================== writing


def write_weight_cache(model: str | LlmFile, output: str | None = None,
                       progress: Callable[[str], None] | None = None,
                       replaces: tuple[str, ...] = (),
                       planned: Callable[[int], None] | None = None) -> str:
    """Convert every weight the executors convert and write the forms to `output`
    (default `cache_path(model)`), atomically, one form at a time in memory. Returns the
    path written. WeightCacheFileError when the output cannot be written (a path that is
    not a regular file is never replaced). `replaces`: a weight cache file the running
    command opened (and refused, or found to differ) that this write may replace.
    `progress` is told each form once it is made, `planned` how many there are before the
    first."""
    llm = model if isinstance(model, LlmFile) else LlmFile(model)
    _refuse_devices(llm)
    path = output or cache_path(llm.path)
    try:
        real, kind = output_target(path, "the weight cache file", replaces=replaces)
    except OutputPathError as e:
        raise WeightCacheFileError(str(e)) from None
    if kind != "file" and kind != "new":
        raise WeightCacheFileError(f"the weight cache file '{path}' is not a regular file; "
                                   "it is left as it is: remove it or name another path")
    if kind == "file":
        other = _other_file(real)
        if other is not None:
            link = "" if real == os.path.abspath(path) else f" (a link to '{real}')"
            raise WeightCacheFileError(
                f"'{path}'{link} is {other}, not a weight cache file: toptpu cache replaces "
                "only a weight cache file; it is left as it is: remove it or name another "
                "path with -o")
    forms = planned_forms(llm)
    header = CacheHeader(KIND, CACHE_FORMAT, llm.file.digest, tuple(forms))
    header.check()
    blob, entries = _blob(llm), _entries(llm)
    if planned is not None:
        planned(len(forms))

    def section(form: FormEntry) -> StreamedSection:
        def pieces() -> Iterator[tuple[int, memoryview]]:
            arr = np.ascontiguousarray(convert(form, blob, entries), np.float32)
            if progress is not None:
                progress(f"{form.section}: {form.form} {list(form.shape)}")
            yield 0, arr.reshape(-1).view(np.uint8).data

        return StreamedSection(math.prod(form.shape) * 4, pieces)

    try:
        write_model_file(path, encode(header), {f.section: section(f) for f in forms},
                         replaces, "the weight cache file")
    except OutputPathError as e:
        raise WeightCacheFileError(str(e)) from None
    return path


def auto_limit() -> int:
    """The most bytes `write_if_missing` may write: TOPTPU_WEIGHT_CACHE_FILE (`auto` or
    unset: AUTO_LIMIT; `off` or 0: never; a size such as 8G); WeightCacheFileError for
    anything else."""
    raw = os.environ.get(AUTO_ENV_VAR, "").strip()
    if raw.lower() in ("", "auto"):
        return AUTO_LIMIT
    if raw.lower() == "off":
        return 0
    try:
        return parse_size(raw)
    except ValueError:
        raise WeightCacheFileError(
            f"{AUTO_ENV_VAR}={raw!r} is not a setting: give auto, off or the most bytes the "
            "weight cache file may take (e.g. 8G)") from None


def planned_bytes(model: LlmFile) -> int:
    """The bytes of the forms `write_weight_cache` would write for `model`."""
    return sum(math.prod(f.shape) * 4 for f in planned_forms(model))


def _shown(n: float) -> str:
    """Bytes as a person reads them: GB from 1 GB, MB below."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def write_if_missing(model: LlmFile, note: Callable[[str], None],
                     in_use: str | None) -> str | None:
    """After a run of `model` that read no weight cache file of it (`in_use`: the one it
    read, if any): write `cache_path(model.path)` so that the next run converts nothing,
    when TOPTPU_WEIGHT_CACHE_FILE allows it (`auto_limit`), its planned size is within
    that limit and within half the free space of its disk; a stale weight cache file there
    (another model file's, damaged, found to differ) is replaced, any other file left
    alone. `note` says what was written and its size against the model file's, or why
    nothing was. Returns the path written (None: nothing)."""
    limit = auto_limit()
    path = cache_path(model.path)
    if limit == 0 or model.meta.parallel is not None or in_use is not None:
        return None
    size = planned_bytes(model)
    if size == 0:  # nothing a run converts
        return None
    model_size = os.path.getsize(model.path)
    what = (f"the weight cache file '{path}' would take {_shown(size)} "
            f"({size / model_size:.1f}x the model file)")
    if size > limit:
        note(f"{what}, over the {_shown(limit)} {AUTO_ENV_VAR} allows: not written, so "
             f"each run converts the weights again; `toptpu cache {model.path}` writes it, "
             f"or {AUTO_ENV_VAR}=SIZE raises the limit")
        return None
    try:
        free = _free_bytes(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    if size > free // 2:
        note(f"{what}, more than half the {_shown(free)} free on its disk: not written")
        return None
    note(f"writing the weight cache file '{path}' ({_shown(size)}, "
         f"{size / model_size:.1f}x the model file's {_shown(model_size)}): later runs "
         f"of this model file read its converted weights instead of converting them "
         f"({AUTO_ENV_VAR}=off writes none; delete the file to free the space)")
    try:
        return write_weight_cache(model, path, replaces=(path,))
    except WeightCacheFileError as e:
        note(f"the weight cache file was not written: {e}")
        return None


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _other_file(path: str) -> str | None:
    """What the existing file `path` is when `write_weight_cache` may not replace it: a
    model file, or a file of another kind (a checkpoint, ...). None for an empty file or
    a weight cache file (a damaged one too: its header unreadable)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(HEADER_OFFSET)
            if not prefix:
                return None
            if not prefix.startswith(MAGIC) or len(prefix) < HEADER_OFFSET:
                return "a file of another kind"
            hlen = int.from_bytes(prefix[12:16], "little")
            head = f.read(min(hlen, MAX_HEADER_READ))
    except OSError:
        return None  # the write reports it
    try:
        kind = json.loads(head).get("kind", "")
    except (ValueError, AttributeError):
        return None  # a header cut short: a damaged file, replaced
    return None if kind == KIND else (
        "a toptpu model file" if kind == LLM_KIND else f"a toptpu file of kind {kind!r}")


# =========================================================================== reading


class StoredForms:
    """The forms of a weight cache file, mapped read-only, looked up by what they are
    made from (`a16`, `upcast`). Each form is checked on its first use (see the module
    doc); after a form differs, `problem` says why and every lookup misses."""

    def __init__(self, path: str, model: LlmFile, container: ModelFile,
                 header: CacheHeader) -> None:
        self.path = path
        self.model = model
        self._container = container
        self._forms = {f.key: f for f in header.forms}
        self._checked: dict[tuple, np.ndarray] = {}
        self._blob = _blob(model)
        self._entries = _entries(model)
        self.problem: str | None = None
        #: called once with `problem` when a form turns out not to match
        self.on_problem: Callable[[str], None] | None = None
        self.hits = 0

    def __len__(self) -> int:
        return len(self._forms)

    def a16(self, source: int, scales: int, zeros: int, bits: int, group_size: int,
            mins: int = -1, part: tuple[int, ...] = ()) -> np.ndarray | None:
        """The dequantized f32 form of the packed weight at blob offset `source` with its
        scales, zero points and mins at `scales`, `zeros`, `mins` (-1: none), or its part
        `part` (`FormEntry.part`) stored contiguous; None when the file has none (or is
        off)."""
        return self._get(("a16", source, scales, zeros, mins, bits, group_size, part))

    def upcast(self, source: int, part: tuple[int, ...] = ()) -> np.ndarray | None:
        """The f32 form of the f16/bf16 weight at blob offset `source` (or its `part`
        stored contiguous), or None."""
        return self._get(("f32", source, -1, -1, -1, 0, 0, part))

    def _get(self, key: tuple) -> np.ndarray | None:
        if self.problem is not None:
            return None
        hit = self._checked.get(key)
        if hit is None:
            form = self._forms.get(key)
            if form is None:
                return None
            hit = self._check(form)
            if hit is None:
                return None
        self.hits += 1
        return hit

    def _check(self, form: FormEntry) -> np.ndarray | None:
        """The form's array once its sampled rows match the model file's bytes."""
        arr = np.frombuffer(self._container.view(form.section), np.float32).reshape(
            form.shape)
        n = form.shape[0]
        rows = np.unique(np.linspace(0, n - 1, min(n, SAMPLED_ROWS)).astype(np.int64))
        want = convert(form, self._blob, self._entries, rows)
        have = arr[rows]
        if want.shape != have.shape or want.tobytes() != have.tobytes():
            self.problem = (f"the weight cache file '{self.path}' does not match the model "
                            f"file: form {form.section} ({form.form} of the weight at blob "
                            f"offset {form.source}) differs from the model file's bytes; it "
                            f"is not used (rewrite it with `toptpu cache {self.model.path}`)")
            if self.on_problem is not None:
                self.on_problem(self.problem)
            return None
        self._checked[form.key] = arr
        return arr

    def check_unchanged(self) -> None:
        """Refuse to go on with the file truncated or written in place since it was opened
        (its mapped forms would fault or be other numbers); one replaced at its path (a new
        `toptpu cache`) is harmless: the mapping holds the old one."""
        try:
            self._container.check_unchanged(replaced_too=False)
        except ModelFileError as e:
            raise WeightCacheFileError(f"the weight cache file {e}") from None

    def verify(self) -> None:
        """Check every byte: each form converted again from the model file and compared
        (as long as converting all; `toptpu cache --check`). WeightCacheFileError at the
        first form that differs."""
        for f in self._forms.values():
            arr = np.frombuffer(self._container.view(f.section), np.float32).reshape(f.shape)
            if convert(f, self._blob, self._entries).tobytes() != arr.tobytes():
                raise WeightCacheFileError(
                    f"the weight cache file '{self.path}' does not match the model file: "
                    f"form {f.section} ({f.form} of the weight at blob offset {f.source}) "
                    f"differs; rewrite it with `toptpu cache {self.model.path}`")

    def close(self) -> None:
        self._checked.clear()
        self._container.close()


def open_weight_cache(model: LlmFile, path: str | None = None) -> StoredForms:
    """The weight cache file at `path` (default `cache_path(model.path)`) of the loaded
    model file, every header field checked against it (see the module doc);
    WeightCacheFileError naming the problem otherwise."""
    _refuse_devices(model)
    path = path or cache_path(model.path)
    advice = f"rewrite it with `toptpu cache {model.path}` (or delete it)"

    def refuse(why: str) -> WeightCacheFileError:
        return WeightCacheFileError(f"the weight cache file '{path}' {why}; {advice}")

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise WeightCacheFileError(f"cannot read the weight cache file '{path}': "
                                   f"{e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise WeightCacheFileError(f"the weight cache file '{path}' is not a regular file; "
                                   "it is not read")
    try:
        container = ModelFile(path, verify_checksums=False)
    except ModelFileError as e:
        raise refuse(f"is unusable ({_container_problem(e, path)})") from None
    try:
        raw = container.header
        if raw.get("kind") != KIND:
            raise refuse(f"is not a weight cache file (kind {raw.get('kind')!r})")
        try:
            header = decode(CacheHeader, raw)
            header.check()
        except HeaderError as e:
            raise refuse(f"has an invalid header: {e}") from None
        if header.model_digest != model.file.digest:
            raise refuse("was made from another model file (or an earlier compile of this "
                         "one): the model file's header sha256 differs")
        _check_forms(header, model, container, refuse)
    except BaseException:
        container.close()
        raise
    return StoredForms(path, model, container, header)


def _refuse_devices(model: LlmFile) -> None:
    """A model file spread over several devices (a weight blob per device) has no weight
    cache file."""
    par = model.meta.parallel
    if par is not None:
        raise WeightCacheFileError(
            f"'{model.path}' is spread over {len(par.devices)} devices ({par.strategy}): "
            "toptpu has no weight cache file for a multi-device model file; run it without "
            "one (its devices convert their weights as they go)")


def _container_problem(e: ModelFileError, path: str) -> str:
    """The container's message without its model-file advice."""
    text = str(e).replace(f"'{path}' ", "", 1)
    for advice in ("; compile one with `toptpu compile`", "; recompile the model with "
                   "`toptpu compile`", "; upgrade toptpu or recompile the model"):
        text = text.replace(advice, "")
    return text.replace("toptpu model file", "toptpu file")


def _check_forms(header: CacheHeader, model: LlmFile, container: ModelFile,
                 refuse: Callable[[str], WeightCacheFileError]) -> None:
    """Each form against the model file's weight table and its own section."""
    entries = _entries(model)
    used = {f.section for f in header.forms}
    extra = sorted(set(container.sections) - used)
    if extra:
        raise refuse(f"has a section '{extra[0]}' that no form names")
    for i, f in enumerate(header.forms):
        where = f"forms[{i}]"
        if f.section not in container.sections:
            raise refuse(f"names a section '{f.section}' it does not have ({where})")
        size = container.sections[f.section].size
        if size != math.prod(f.shape) * 4:
            raise refuse(f"has {size} bytes in section '{f.section}', its f32 form "
                         f"{list(f.shape)} takes {math.prod(f.shape) * 4} ({where})")

        def tensor(offset: int, what: str, where: str = where) -> WeightEntry:
            e = entries.get(offset)
            if e is None:
                raise refuse(f"names {what} at blob offset {offset}, where the model file's "
                             f"weight table has no tensor ({where})")
            return e

        src = tensor(f.source, "a weight")
        whole = tuple(f.shape)
        if f.part:  # a part of the form the weight converts to: inside it
            whole = (tuple(src.shape) if f.form == "f32" or len(src.shape) != 2
                     else (src.shape[0], src.shape[1] * 8 // max(f.bits, 1)))
            r0, rn, c0, cn = f.part
            if len(whole) != 2 or r0 + rn > whole[0] or c0 + cn > whole[1]:
                raise refuse(f"has a part {list(f.part)} outside the {list(whole)} form of "
                             f"a {src.dtype} {list(src.shape)} weight ({where})")
        rows, cols = whole
        if f.form == "f32":
            if src.dtype not in UPCAST_DTYPES or tuple(src.shape) != whole:
                raise refuse(f"upcasts a {src.dtype} {list(src.shape)} weight to "
                             f"{list(whole)} ({where})")
            continue
        want_packed = (rows, cols * f.bits // 8)
        if src.dtype not in ("uint8", "int8") or tuple(src.shape) != want_packed:
            raise refuse(f"dequantizes a {src.dtype} {list(src.shape)} weight to "
                         f"{list(whole)} in {f.bits} bits ({where})")
        groups = (rows, cols // f.group_size)
        scales = tensor(f.scales, "scales")
        if tuple(scales.shape) != groups or scales.dtype not in ("float32", "float16",
                                                                "bfloat16"):
            raise refuse(f"names {scales.dtype} {list(scales.shape)} scales for "
                         f"{list(groups)} groups ({where})")
        if f.zeros >= 0:
            zeros = tensor(f.zeros, "zero points")
            if tuple(zeros.shape) != groups or not np.issubdtype(np.dtype(zeros.dtype),
                                                                   np.integer):
                raise refuse(f"names {zeros.dtype} {list(zeros.shape)} zero points for "
                             f"{list(groups)} groups ({where})")
        if f.mins >= 0:
            mins = tensor(f.mins, "mins")
            if tuple(mins.shape) != groups or mins.dtype not in ("float32", "float16",
                                                                "bfloat16"):
                raise refuse(f"names {mins.dtype} {list(mins.shape)} mins for "
                             f"{list(groups)} groups ({where})")


__all__ = ["CACHE_FORMAT", "KIND", "SUFFIX", "CacheHeader", "FormEntry", "StoredForms",
           "WeightCacheFileError", "cache_path", "open_weight_cache", "planned_forms",
           "write_weight_cache"]
