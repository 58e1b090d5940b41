"""The model file: one file per compiled model.

Layout (all integers little endian):

    offset 0   magic  b"TOPTPU\\x00\\x01" (8 bytes)
           8   format version (u32), header length H (u32)
          16   header: H bytes of UTF-8 JSON
      16 + H   sections, each starting at a multiple of ALIGN (4096) bytes

The header holds everything that describes the model (chip, nets with their IO names,
shapes and dtypes, static shapes, model config, generation config, tokenizer) and a table
of sections: name, offset, size, sha256. Sections hold bulk bytes: command streams,
the weight blob (aligned, so it can be memory mapped), tokenizer files, IR text.

Writing goes to a temporary name in the same directory and is renamed into place, so a
crash never leaves a half file under the real name. Loading checks magic, version, the
header, every section's bounds and checksum, and names what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAGIC = b"TOPTPU\x00\x01"
FORMAT_VERSION = 1
ALIGN = 4096
_PREFIX = struct.Struct("<8sII")


class ModelFileError(Exception):
    """A model file that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class SectionInfo:
    name: str
    offset: int
    size: int
    sha256: str


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_model_file(path: str, header: Mapping[str, Any],
                     sections: Mapping[str, bytes | bytearray | memoryview]) -> None:
    """Write `header` (JSON-serializable) and named byte sections to `path` atomically."""
    names = list(sections)
    views = {n: memoryview(sections[n]).cast("B") for n in names}
    digests = {n: hashlib.sha256(views[n]).hexdigest() for n in names}
    # the section table lives in the header, whose length fixes where data starts: iterate
    # until the start is stable (offsets only grow, so this converges in a few rounds)
    start = _align(_PREFIX.size)
    while True:
        table: list[dict[str, Any]] = []
        offset = start
        for name in names:
            table.append({"name": name, "offset": offset, "size": len(views[name]),
                          "sha256": digests[name]})
            offset = _align(offset + len(views[name]))
        full = {**header, "format_version": FORMAT_VERSION, "sections": table}
        hbytes = json.dumps(full, sort_keys=True).encode()
        need = _align(_PREFIX.size + len(hbytes))
        if need <= start:
            break
        start = need
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes)))
            f.write(hbytes)
            for entry, name in zip(table, names, strict=True):
                f.seek(entry["offset"])
                f.write(views[name])
            end = max((e["offset"] + e["size"] for e in table), default=f.tell())
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class ModelFile:
    """A validated, memory-mapped model file."""

    def __init__(self, path: str, verify_checksums: bool = True) -> None:
        self.path = path
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - kept open for the mmap
        except OSError as e:
            raise ModelFileError(f"cannot open model file '{path}': {e.strerror}") from e
        size = os.fstat(self._file.fileno()).st_size
        if size < _PREFIX.size:
            raise ModelFileError(f"'{path}' is not a toptpu model file (only {size} bytes)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        magic, version, hlen = _PREFIX.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise ModelFileError(
                f"'{path}' is not a toptpu model file (bad magic {magic!r}); compile one with "
                "`toptpu compile`"
            )
        if version > FORMAT_VERSION:
            raise ModelFileError(
                f"'{path}' has format version {version}, newer than this toptpu understands "
                f"({FORMAT_VERSION}); upgrade toptpu or recompile the model"
            )
        if version < FORMAT_VERSION:
            raise ModelFileError(
                f"'{path}' has the old format version {version} (this toptpu reads "
                f"{FORMAT_VERSION}); recompile the model"
            )
        if _PREFIX.size + hlen > size:
            raise ModelFileError(f"'{path}' is truncated: the header runs past the end")
        try:
            self.header: dict[str, Any] = json.loads(
                bytes(self._map[_PREFIX.size:_PREFIX.size + hlen]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(f"'{path}' has a corrupt header: {e}") from e
        self.sections: dict[str, SectionInfo] = {}
        for entry in self.header.get("sections", []):
            info = SectionInfo(entry["name"], int(entry["offset"]), int(entry["size"]),
                               entry["sha256"])
            if info.offset + info.size > size:
                raise ModelFileError(
                    f"'{path}' is truncated: section '{info.name}' needs bytes up to "
                    f"{info.offset + info.size}, the file has {size}"
                )
            self.sections[info.name] = info
        if verify_checksums:
            for info in self.sections.values():
                digest = hashlib.sha256(self.view(info.name)).hexdigest()
                if digest != info.sha256:
                    raise ModelFileError(
                        f"'{path}' is corrupt: checksum mismatch in section '{info.name}'"
                    )

    def view(self, name: str) -> memoryview:
        """Zero-copy bytes of a section (backed by the memory map)."""
        if name not in self.sections:
            raise ModelFileError(
                f"'{self.path}' has no section '{name}' (it has {sorted(self.sections)})"
            )
        info = self.sections[name]
        return memoryview(self._map)[info.offset:info.offset + info.size]

    def read(self, name: str) -> bytes:
        return bytes(self.view(name))

    def close(self) -> None:
        self._map.close()
        self._file.close()

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
