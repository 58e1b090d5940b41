"""Calibration data: plain text files, tokenized with the model's own tokenizer and cut into
sequences of one length.

The files' tokens (each file tokenized on its own, without special tokens, in the order the
files are given) are concatenated and cut into consecutive, non-overlapping sequences of
`sequence_length` tokens; the first `sequences` of them are the calibration set. Text that
holds fewer full sequences than asked gives as many as it holds, and the result says so
(`CalibrationData.note`); text shorter than one sequence is refused. A file is read in
blocks and only as far as the sequences need, so a large file costs what is used of it.

Every file is untrusted: a missing path, a directory, a device or FIFO, an empty file, a file
of whitespace only, and binary data (a NUL byte, or bytes that are not UTF-8) are refused
with one line naming the file.

Without files the calibration runs on a text every Python installation ships, nothing
downloaded (`write_default_text`): Python's own documentation, the topics `help()` shows
(`pydoc_data.topics`, about 465 kB of English prose and code examples; 100k tokens at
SmolLM2's tokenizer, more than the default 128 x 512).
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from toptpu.request import (
    DEFAULT_CALIBRATION_SAMPLES,
    DEFAULT_CALIBRATION_SEQ_LENGTH,
    DEFAULT_CALIBRATION_TEXT,
)
from toptpu.weight_calibration.grid import CalibrationError

_PYDOC_TOPICS: dict[str, str] | None
try:
    from pydoc_data.topics import topics as _pydoc_topics

    _PYDOC_TOPICS = _pydoc_topics
except ImportError:  # a Python built without its documentation topics
    _PYDOC_TOPICS = None

#: the calibration set asked for by default: sequences x tokens (`--calibration-samples`,
#: `--calibration-seq-length`)
DEFAULT_SEQUENCES = DEFAULT_CALIBRATION_SAMPLES
DEFAULT_SEQUENCE_LENGTH = DEFAULT_CALIBRATION_SEQ_LENGTH
#: bytes read from a file at a time
READ_BLOCK = 1 << 20

#: text -> token ids, without special tokens
Encode = Callable[[str], Sequence[int]]


class CalibrationDataError(CalibrationError):
    """Calibration data that cannot be used; the message names the file and what to do."""


@dataclass
class CalibrationData:
    """The calibration sequences: token ids ``[n, sequence_length]``."""

    tokens: np.ndarray
    files: tuple[str, ...]
    #: what differs from the request (fewer sequences than asked), else None
    note: str | None = None

    @property
    def sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def sequence_length(self) -> int:
        return int(self.tokens.shape[1])


def check_file(path: str) -> None:
    """`path` is a readable, non-empty file whose first block is UTF-8 text without NUL
    bytes; a CalibrationDataError naming it otherwise."""
    what = f"calibration data '{path}'"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CalibrationDataError(f"{what}: no such file") from None
    except OSError as e:
        raise CalibrationDataError(f"{what} cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise CalibrationDataError(f"{what} is a directory; name the text files in it")
    if not stat.S_ISREG(mode):
        raise CalibrationDataError(f"{what} is not a regular file; give a plain text file")
    try:
        with open(path, "rb") as f:
            head = f.read(READ_BLOCK)
    except OSError as e:
        raise CalibrationDataError(f"{what} cannot be read: {e.strerror or e}") from None
    if not head:
        raise CalibrationDataError(f"{what} is empty")
    _check_text(head, 0, what)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise CalibrationDataError(f"{what} is not UTF-8 text (byte {e.start}); give a UTF-8 "
                                   "text file") from None


def _check_text(raw: bytes, offset: int, what: str) -> None:
    nul = raw.find(b"\0")
    if nul >= 0:
        raise CalibrationDataError(f"{what} is binary (a NUL byte at byte {offset + nul}); "
                                   "give a UTF-8 text file")


def file_tokens(path: str, encode: Encode, needed: int) -> list[int]:
    """The tokens of the text file `path` (checked by `check_file`), read block by block
    until `needed` tokens are reached (each block cut after its last line break, the rest
    carried to the next one)."""
    what = f"calibration data '{path}'"
    decoder = codecs.getincrementaldecoder("utf-8")()
    tokens: list[int] = []
    carry = ""
    offset = 0
    seen_text = False
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise CalibrationDataError(f"{what} cannot be read: {e.strerror or e}") from None
    with f:
        while len(tokens) < needed:
            raw = f.read(READ_BLOCK)
            last = not raw
            _check_text(raw, offset, what)
            try:
                text = carry + decoder.decode(raw, final=last)
            except UnicodeDecodeError as e:
                raise CalibrationDataError(f"{what} is not UTF-8 text (byte {offset + e.start})"
                                           "; give a UTF-8 text file") from None
            offset += len(raw)
            cut = len(text) if last else text.rfind("\n") + 1
            if cut <= 0 and not last:  # no line break yet: wait for more text
                carry = text
                continue
            chunk, carry = text[:cut], text[cut:]
            if chunk.strip():
                seen_text = True
                tokens.extend(int(t) for t in encode(chunk))
            if last:
                break
    if not seen_text:
        raise CalibrationDataError(f"{what} holds only whitespace")
    return tokens


def calibration_data(files: Sequence[str], encode: Encode,
                     sequences: int = DEFAULT_SEQUENCES,
                     sequence_length: int = DEFAULT_SEQUENCE_LENGTH) -> CalibrationData:
    """The calibration sequences of `files` (module doc)."""
    if not files:
        raise CalibrationDataError("no calibration data: give one or more text files")
    if sequences < 1 or sequence_length < 1:
        raise CalibrationDataError(f"{sequences} sequences of {sequence_length} tokens: both "
                                   "must be at least 1")
    for path in files:
        check_file(path)
    needed = sequences * sequence_length
    tokens: list[int] = []
    for path in files:
        tokens += file_tokens(path, encode, needed - len(tokens))
        if len(tokens) >= needed:
            break
    names = ", ".join(f"'{p}'" for p in files)
    have = len(tokens) // sequence_length
    if have == 0:
        raise CalibrationDataError(
            f"calibration data {names} holds {len(tokens)} tokens, fewer than one sequence of "
            f"{sequence_length}; give more text or shorter sequences")
    note = None
    if have < sequences:
        note = (f"the calibration text holds {have} sequences of {sequence_length} tokens "
                f"({len(tokens)} tokens), not the {sequences} asked: calibrating on {have}")
    n = min(have, sequences)
    arr = np.asarray(tokens[:n * sequence_length], dtype=np.int64).reshape(n, sequence_length)
    return CalibrationData(arr, tuple(files), note)


def tokenizer_encoder(tokenizer_json: bytes) -> Encode:
    """The encoder of a model's `tokenizer.json` (the `tokenizers` library, as the runtime
    tokenizes), without special tokens."""
    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return encode


def write_default_text(path: str) -> str:
    """Write the default calibration text (module doc) to the new file `path`; returns
    `path`."""
    if _PYDOC_TOPICS is None:
        raise CalibrationDataError(
            f"the default calibration text, {DEFAULT_CALIBRATION_TEXT}, is missing from this "
            "Python; give --calibration-data FILE...")
    text = "\n\n".join(_PYDOC_TOPICS[k] for k in sorted(_PYDOC_TOPICS))
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CalibrationDataError(f"cannot write the default calibration text to '{path}': "
                                   f"{e.strerror or e}") from None
    return path
