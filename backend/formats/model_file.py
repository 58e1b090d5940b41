"""The model file: one file per compiled model.

Layout (all integers little endian), format version 2:

    offset 0   magic  b"TOPTPU\\x00\\x01" (8 bytes)
           8   format version (u32), header length H (u32)
          16   header sha256 (32 bytes): of bytes 0..16 and the H header bytes
          48   header: H bytes of UTF-8 JSON (an object)
      48 + H   sections, one after the other, each starting at the next multiple of ALIGN
               (4096) bytes; the bytes between them are zero; the file ends where the
               last section ends

The header holds everything that describes the model (chip, nets with their IO names,
shapes and dtypes, static shapes, model config, generation config, tokenizer) and, under
`sections`, the table of sections: name, offset, size, sha256. Sections hold bulk bytes:
command streams, the weight blob (aligned, so it can be memory mapped), tokenizer files,
IR text.

No byte of a file goes unchecked: the prefix and the header are covered by the header
checksum, every section by its own, and every other byte is alignment padding that must
be zero (the offsets are fixed by the section sizes, so a table that places a section
anywhere else is refused too).

Writing goes to a hidden temporary name in the same directory (`.NAME.tmp-PID`) and is
renamed into place, so a crash never leaves a half file under the real name; a section may
be streamed (`StreamedSection`: the weight blob of a big model, made layer by layer, is never
whole in memory), hashed as it is written, the header written after it; the magic is
written last, so a temporary file is never a model file. Temporary files of the same target
left behind by processes that no longer run (a compile killed with SIGKILL) are removed by
the next write. Loading checks magic, version, the header checksum, the section table,
every section's checksum and the padding, and names what is wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from toptpu.backend.contract import parse_strict_json
from toptpu.backend.formats.file_lease import hold_read_lease, release_read_lease
from toptpu.dialects.output_file import (
    is_regular,
    note_input,
    open_output,
)
from toptpu.dialects.output_file import (
    remove_stale_temp_files as remove_stale_temp_files,
)
from toptpu.dialects.output_file import (
    temp_path as temp_path,
)
from toptpu.errors import ToptpuError

MAGIC = b"TOPTPU\x00\x01"
FORMAT_VERSION = 2
ALIGN = 4096
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_DIGEST_SIZE = 32
#: where the header JSON starts (after magic, version, header length and header sha256)
HEADER_OFFSET = _PREFIX.size + _DIGEST_SIZE
#: the header key of the container's own section table
SECTIONS_KEY = "sections"
_ENTRY_KEYS = ("name", "offset", "size", "sha256")
#: the bytes of a section hashed at a time when a file is checked (each window's pages
#: released after: `ModelFile._section_digest`)
HASH_WINDOW = 64 << 20
#: files larger than this have each hashed window's pages released (a 7B model's), and so
#: has a file whose weights are streamed (`streams_weights`)
RELEASE_CHECKED_ABOVE = 4 << 30
#: weight blobs above this many bytes are streamed by default: the runners release the
#: mapped pages of the weights each run read (`toptpu.backend.runtime.weight_pages`)
STREAM_ABOVE = 2 << 30
#: the environment variable that says whether they are: auto (by STREAM_ABOVE), on, off
STREAM_ENV_VAR = "TOPTPU_STREAM_WEIGHTS"


class ModelFileError(ToptpuError):
    """A model file that cannot be used; the message names the problem."""


def streams_weights(blob_bytes: int) -> bool:
    """Whether weight blobs of `blob_bytes` in all are streamed (their pages released after
    each run, and while their checksums are checked): TOPTPU_STREAM_WEIGHTS `on`/`off`,
    else (`auto`, unset) above STREAM_ABOVE."""
    raw = os.environ.get(STREAM_ENV_VAR, "auto").strip().lower()
    if raw in ("on", "1", "yes"):
        return True
    if raw in ("off", "0", "no"):
        return False
    if raw != "auto":
        raise ModelFileError(f"{STREAM_ENV_VAR}={raw!r}: give auto, on or off")
    return blob_bytes > STREAM_ABOVE


@dataclass(frozen=True)
class SectionInfo:
    name: str
    offset: int
    size: int
    sha256: str


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header_digest(prefix: bytes, header: bytes) -> bytes:
    return hashlib.sha256(prefix + header).digest()


def _layout(header_length: int, sizes: list[int]) -> list[int]:
    """The offset of each section: each at the next ALIGN boundary after the previous."""
    offsets, offset = [], _align(HEADER_OFFSET + header_length)
    for size in sizes:
        offsets.append(offset)
        offset = _align(offset + size)
    return offsets


# ------------------------------------------------------------------ temporary files
# (the temporary files of a write, and the write itself, are `toptpu.dialects.output_file`'s:
# one policy for every output; `temp_path` and `remove_stale_temp_files` are re-exported)


# ------------------------------------------------------------------ writing


BytesLike = bytes | bytearray | memoryview


@dataclass(frozen=True)
class StreamedSection:
    """A section written from pieces as they are made, never whole in memory: `size` bytes,
    `pieces()` yields (offset in the section, bytes) in increasing, non-overlapping order;
    bytes no piece covers are zero."""

    size: int
    pieces: Callable[[], Iterable[tuple[int, BytesLike]]]


@dataclass(frozen=True)
class StreamedGroup:
    """Several sections written together from one stream of pieces, never whole in memory
    (every device's weight blob of a multi-device model: a layer's pieces for all devices
    are made from one read of its tensors): `sizes` by section name, `pieces()` yields
    (section, offset in it, bytes), each section's pieces in increasing, non-overlapping
    order (the sections' pieces may interleave). Each section of the group is named in the
    file's sections as a `GroupedSection`."""

    sizes: Mapping[str, int]
    pieces: Callable[[], Iterable[tuple[str, int, BytesLike]]]

    def members(self) -> dict[str, GroupedSection]:
        return {name: GroupedSection(self, size) for name, size in self.sizes.items()}


@dataclass(frozen=True)
class GroupedSection:
    """A section of a `StreamedGroup`."""

    group: StreamedGroup
    size: int


Section = BytesLike | StreamedSection | GroupedSection
#: zeros written (and hashed) at most this many at a time
_ZEROS = bytes(1 << 20)


def write_model_file(path: str, header: Mapping[str, Any], sections: Mapping[str, Section],
                     replaces: tuple[str, ...] = (), what: str = "the model file") -> None:
    """Write `header` (JSON-serializable, without a `sections` key) and named byte sections
    to `path` atomically (see the module doc for the layout). A `StreamedSection` is hashed
    as it is written: the header, whose length does not depend on the digests (64 hex
    digits each), is written once every section is. `replaces`: inputs of the running
    command this write may replace (`open_output`); `what` names the file in an error (a
    weight cache file is written in the same container)."""
    if SECTIONS_KEY in header:
        raise ValueError(f"the header key '{SECTIONS_KEY}' is the container's own")
    names = list(sections)
    views = {n: memoryview(s).cast("B") for n, s in sections.items()
             if not isinstance(s, StreamedSection | GroupedSection)}
    digests = {n: hashlib.sha256(v).hexdigest() for n, v in views.items()}
    sizes = [s.size if isinstance(s, StreamedSection | GroupedSection) else len(views[n])
             for n, s in sections.items()]
    offsets, _ = _header_and_offsets(header, names, sizes, digests)
    end = offsets[-1] + sizes[-1] if names else None
    with open_output(path, what, seekable=True, size=end, replaces=replaces) as f:
        at = dict(zip(names, offsets, strict=True))
        for offset, name in zip(offsets, names, strict=True):
            f.seek(offset)
            section = sections[name]
            if isinstance(section, GroupedSection):
                if name not in digests:
                    digests.update(_write_group(f, section.group, at))
            elif isinstance(section, StreamedSection):
                digests[name] = _write_streamed(f, name, section)
            else:
                f.write(views[name])
        again, hbytes = _header_and_offsets(header, names, sizes, digests)
        assert again == offsets  # digests are fixed-length: the layout cannot move
        f.seek(_PREFIX.size + _DIGEST_SIZE)
        f.write(hbytes)
        f.flush()
        if is_regular(f):  # not a device written through (/dev/null)
            f.truncate(end if end is not None else HEADER_OFFSET + len(hbytes))
            os.fsync(f.fileno())
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes))
        f.seek(0)  # the prefix is written last: until then the file has no magic
        f.write(prefix + _header_digest(prefix, hbytes))


def _header_and_offsets(header: Mapping[str, Any], names: list[str], sizes: list[int],
                        digests: Mapping[str, str]) -> tuple[list[int], bytes]:
    """The sections' offsets and the header bytes with the section table (a digest not
    known yet is written as 64 zeros: the same length). The table lives in the header,
    whose length fixes where data starts: iterate until the length is stable (offsets only
    grow, so this converges in a few rounds)."""
    hbytes = b""
    while True:
        offsets = _layout(len(hbytes), sizes)
        table = [{"name": n, "offset": o, "size": s, "sha256": digests.get(n, "0" * 64)}
                 for n, o, s in zip(names, offsets, sizes, strict=True)]
        new = json.dumps({**header, SECTIONS_KEY: table}, sort_keys=True,
                         allow_nan=False).encode()
        if _layout(len(new), sizes) == offsets:
            return offsets, new
        hbytes = new


def _write_streamed(f: IO[bytes], name: str, section: StreamedSection) -> str:
    """Write a streamed section at the file's position; its sha256."""
    h = hashlib.sha256()
    at = 0

    def zeros(n: int) -> None:
        while n > 0:
            part = _ZEROS[:min(n, len(_ZEROS))]
            f.write(part)
            h.update(part)
            n -= len(part)

    for offset, data in section.pieces():
        view = memoryview(data).cast("B")
        if offset < at or offset + len(view) > section.size:
            raise ValueError(f"section '{name}': a piece at {offset} of {len(view)} bytes "
                             f"overlaps the previous one (which ended at {at}) or passes "
                             f"the section's end ({section.size})")
        zeros(offset - at)
        f.write(view)
        h.update(view)
        at = offset + len(view)
        del data, view  # the piece may be big: not held while the next one is made
    zeros(section.size - at)
    return h.hexdigest()


def _write_group(f: IO[bytes], group: StreamedGroup, offsets: Mapping[str, int]
                 ) -> dict[str, str]:
    """Write every section of a streamed group at its offset in the file; their sha256s."""
    hashes = {name: hashlib.sha256() for name in group.sizes}
    at = dict.fromkeys(group.sizes, 0)

    def zeros(name: str, n: int) -> None:
        while n > 0:
            part = _ZEROS[:min(n, len(_ZEROS))]
            f.write(part)
            hashes[name].update(part)
            n -= len(part)

    for name, offset, data in group.pieces():
        if name not in hashes:
            raise ValueError(f"a piece of section '{name}', which the group does not have")
        view = memoryview(data).cast("B")
        if offset < at[name] or offset + len(view) > group.sizes[name]:
            raise ValueError(f"section '{name}': a piece at {offset} of {len(view)} bytes "
                             f"overlaps the previous one (which ended at {at[name]}) or "
                             f"passes the section's end ({group.sizes[name]})")
        f.seek(offsets[name] + at[name])
        zeros(name, offset - at[name])
        f.write(view)
        hashes[name].update(view)
        at[name] = offset + len(view)
        del data, view
    for name, size in group.sizes.items():
        f.seek(offsets[name] + at[name])
        zeros(name, size - at[name])
    return {name: h.hexdigest() for name, h in hashes.items()}


# ------------------------------------------------------------------ reading


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What says a file is the one opened: device, inode, size, modification and change
    times (the change time cannot be set back by the writer)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


class ModelFile:
    """A validated, memory-mapped model file."""

    def __init__(self, path: str, verify_checksums: bool = True) -> None:
        self.path = path
        try:  # without blocking: a FIFO is refused below, never read (it would hang)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise ModelFileError(f"cannot open model file '{path}': {e.strerror}") from e
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(mode) else (
                "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file")
            raise ModelFileError(f"'{path}' is {kind}, not a toptpu model file; pass the file "
                                 "`toptpu compile` wrote")
        self._file = os.fdopen(fd, "rb")  # kept open for the mmap
        note_input(self._file.fileno(), path)  # never an output of this command
        self._map: mmap.mmap | None = None
        try:
            self._load(verify_checksums)
        except BaseException:
            self.close()
            raise

    def _err(self, msg: str) -> ModelFileError:
        return ModelFileError(f"'{self.path}' {msg}")

    def _load(self, verify_checksums: bool) -> None:
        st = os.fstat(self._file.fileno())
        self.identity = _identity(st)  # what `check_unchanged` compares with
        size = st.st_size
        if size == 0:
            raise self._err("is empty, not a toptpu model file; compile one with "
                            "`toptpu compile`")
        if size < _PREFIX.size:
            raise self._err(f"is not a toptpu model file (only {size} bytes)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        hold_read_lease(self._file.fileno(), self.path)  # told before it is truncated
        magic, version, hlen = _PREFIX.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise self._err(f"is not a toptpu model file (bad magic {magic!r}); compile one "
                            "with `toptpu compile`")
        if version > FORMAT_VERSION:
            raise self._err(f"has format version {version}, newer than this toptpu "
                            f"understands ({FORMAT_VERSION}); upgrade toptpu or recompile the "
                            "model")
        if version < FORMAT_VERSION:
            raise self._err(f"has the old format version {version} (this toptpu reads "
                            f"{FORMAT_VERSION}); recompile the model with `toptpu compile`")
        end = HEADER_OFFSET + hlen
        if end > size:
            raise self._err(f"is truncated: the header needs bytes up to {end}, the file has "
                            f"{size}")
        hbytes = bytes(self._map[HEADER_OFFSET:end])
        digest = bytes(self._map[_PREFIX.size:HEADER_OFFSET])
        if _header_digest(bytes(self._map[:_PREFIX.size]), hbytes) != digest:
            raise self._err("is corrupt: checksum mismatch in the header")
        #: the header's sha256 (hex): it covers every section's sha256, so it names the
        #: file's whole content once the sections are checked against them
        self.digest = digest.hex()
        try:
            header = parse_strict_json(hbytes)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise self._err(f"has a corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise self._err(f"has a corrupt header: a JSON {type(header).__name__}, not an "
                            "object")
        table = header.pop(SECTIONS_KEY, None)
        self.header: dict[str, Any] = header
        self.sections = self._section_table(table, hlen)
        self._check_extent(size, hlen)
        if verify_checksums:
            for info in self.sections.values():
                if self._section_digest(info) != info.sha256:
                    raise self._err(f"is corrupt: checksum mismatch in section '{info.name}'")

    def _section_digest(self, info: SectionInfo) -> str:
        """A section's sha256, hashed a window of HASH_WINDOW bytes at a time; in a file
        larger than RELEASE_CHECKED_ABOVE or whose weights are streamed (`streams_weights`
        of its size) each window's pages are released once hashed (`release`): checking a
        6 GB weight blob keeps one window of it resident, not the blob, and a streamed
        run starts from none of it (a smaller file's pages stay mapped: its runs read them
        again soon)."""
        h = hashlib.sha256()
        view = self.view(info.name)
        size = len(self._map or b"")
        release = size > RELEASE_CHECKED_ABOVE or streams_weights(size)
        for start in range(0, info.size, HASH_WINDOW):
            h.update(view[start:start + HASH_WINDOW])
            if release:
                self.release(info.offset + start, min(HASH_WINDOW, info.size - start))
        return h.hexdigest()

    def release(self, offset: int, nbytes: int) -> int:
        """Drop this process's mapping of the whole pages within bytes [offset, offset +
        nbytes) of the file (madvise MADV_DONTNEED: they leave its resident set and stay in
        the page cache; a later read maps them again, the same bytes). Returns the bytes
        released (0 where the platform has no madvise)."""
        if self._map is None or not hasattr(self._map, "madvise") \
                or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = min(offset + nbytes, len(self._map)) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start

    def _section_table(self, table: Any, hlen: int) -> dict[str, SectionInfo]:
        where = f"header field '{SECTIONS_KEY}'"
        if not isinstance(table, list):
            raise self._err(f"has a corrupt header: {where} is missing or not a list")
        sections: dict[str, SectionInfo] = {}
        for i, entry in enumerate(table):
            at = f"{where}[{i}]"
            if not isinstance(entry, dict) or sorted(entry) != sorted(_ENTRY_KEYS):
                raise self._err(f"has a corrupt header: {at} must have exactly the keys "
                                f"{list(_ENTRY_KEYS)}")
            name, offset, size, digest = (entry[k] for k in _ENTRY_KEYS)
            if not isinstance(name, str) or not name or name in sections:
                raise self._err(f"has a corrupt header: {at}.name {name!r} is not a new "
                                "non-empty string")
            for key, value in (("offset", offset), ("size", size)):
                if type(value) is not int or value < 0:
                    raise self._err(f"has a corrupt header: {at}.{key} is {value!r}, not a "
                                    "non-negative integer")
            if not (isinstance(digest, str) and len(digest) == 64
                    and all(c in "0123456789abcdef" for c in digest)):
                raise self._err(f"has a corrupt header: {at}.sha256 is not 64 hex digits")
            sections[name] = SectionInfo(name, offset, size, digest)
        infos = list(sections.values())
        for info, offset in zip(infos, _layout(hlen, [s.size for s in infos]), strict=True):
            if info.offset != offset:
                raise self._err(f"has a corrupt header: section '{info.name}' is at offset "
                                f"{info.offset}, the layout puts it at {offset}")
        return sections

    def _check_extent(self, size: int, hlen: int) -> None:
        """The file ends where the last section ends; every gap byte is zero."""
        assert self._map is not None
        infos = list(self.sections.values())
        end = infos[-1].offset + infos[-1].size if infos else HEADER_OFFSET + hlen
        if size < end:
            last = infos[-1].name
            raise self._err(f"is truncated: section '{last}' needs bytes up to {end}, the "
                            f"file has {size}")
        if size > end:
            raise self._err(f"is corrupt: {size - end} bytes follow the last section")
        start = HEADER_OFFSET + hlen
        for info in infos:
            gap = self._map[start:info.offset]
            if gap.count(0) != len(gap):
                raise self._err(f"is corrupt: nonzero bytes in the padding before section "
                                f"'{info.name}' (offsets {start}..{info.offset})")
            start = info.offset + info.size

    def check_unchanged(self, replaced_too: bool = True) -> None:
        """Refuse to go on with a file changed since it was opened: truncated or written in
        place (its mapped bytes would fault with SIGBUS or silently be other weights) or,
        with `replaced_too`, replaced at its path. Two stat calls: cheap enough before each
        net run. (A change between this check and the read that follows still faults:
        Python cannot turn a SIGBUS inside numpy into an exception.)"""
        try:
            st = os.fstat(self._file.fileno())
            there = _identity(os.stat(self.path)) if replaced_too else self.identity
        except OSError as e:
            raise self._err(f"can no longer be checked ({e.strerror}); it was removed or "
                            "its directory changed while in use: reopen it") from None
        now = _identity(st)
        if there[:2] != self.identity[:2]:  # (unlinking the old one changed its ctime)
            raise self._err("was replaced by another file while in use (a recompile?); "
                            "reopen it to use the new one")
        if not replaced_too and st.st_nlink == 0:  # replaced (or removed): its ctime moved
            now = (*now[:4], self.identity[4])
        if now != self.identity:
            raise self._err(f"changed while in use (now {now[2]} bytes, modified "
                            f"{_when(now[3])}; it was {self.identity[2]} bytes): it was "
                            "truncated or written in place; stop whatever writes it and "
                            "reopen the model file")

    def view(self, name: str) -> memoryview:
        """Zero-copy bytes of a section (backed by the memory map)."""
        if name not in self.sections:
            raise self._err(f"has no section '{name}' (it has {sorted(self.sections)})")
        assert self._map is not None
        info = self.sections[name]
        return memoryview(self._map)[info.offset:info.offset + info.size]

    def read(self, name: str) -> bytes:
        return bytes(self.view(name))

    def close(self) -> None:
        """Unmap and close; while zero-copy views of the map are alive the mapping stays
        until they are garbage collected."""
        with contextlib.suppress(OSError, ValueError):
            release_read_lease(self._file.fileno())
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass
        self._file.close()

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
