"""The one base of toptpu's user-facing errors.

A `ToptpuError` means the input or the request is the problem, not toptpu: its message
names the thing (file, field, op, value) and what to do, and every command line reports it
as one line with exit status 1 (xDSL's `DiagnosticException` plays the same part for IR it
cannot parse or verify). Anything else that reaches a command line is a bug in toptpu and
is reported as one (exit 70). Each layer's errors derive from it (often together with the
built-in class they always were, `ValueError` for most), so a driver catches them with
one `except ToptpuError`, never with a tuple that must list every module's class.

A leaf module: every package may import it and it imports nothing of ours. The runtime's
errors live here too (`GenerationError`, `ImageError`, re-exported by
`toptpu.backend.runtime.errors` and `.vision`): the model families' host side
(`toptpu.families`), below the runtime, raises them.
"""

from __future__ import annotations


def one_line_reason(e: BaseException | str, limit: int = 400) -> str:
    """A foreign exception's message (transformers', a library's) as part of one error
    line: its whitespace and line breaks folded to single spaces and, when longer than
    `limit` characters, its middle left out — never its end, where such messages give the
    reason ("... must be equal to the number of `layer_types` (1000000)")."""
    text = " ".join(str(e).split())
    if len(text) <= limit:
        return text
    head = limit // 4
    return f"{text[:head]} … {text[len(text) - (limit - head - 3):]}"


class ToptpuError(Exception):
    """Bad input or a request toptpu cannot fulfil; the message says why and what to do."""


class CompileError(ToptpuError):
    """The model cannot be compiled as asked; the message names the problem and the fix."""


class GenerationError(ToptpuError):
    """Generation cannot proceed as asked; the message says why and what to do (the runtime
    raises it, and a model family's host side: `toptpu.families`)."""


class ImageError(GenerationError):
    """An image that cannot be read or that the compiled shapes cannot take."""


class AbortError(KeyboardInterrupt):
    """A command that cannot go on, told asynchronously (a signal handler raised it: a file
    the command maps was about to be truncated or written by another process). A
    `KeyboardInterrupt`, so no `except Exception` on the way swallows it and every
    `finally` runs; the command lines report its message as an error (exit status 1)."""
