"""`toptpu-opt --verify-diagnostics`: the diagnostics a chunk of IR produces, checked against
the `expected-*` comments in it, as mlir-opt checks them.

An expectation is a comment anywhere on a line:

    // expected-error {{substring of the message}}          on this line
    // expected-error @+1 {{...}}   @-2 {{...}}            N lines below / above this one
    // expected-error @below {{...}}                        the next line without expectations
    // expected-error @above {{...}}                        the last line without expectations
    // expected-error @unknown {{...}}                      a diagnostic that names no line
    // expected-error-re {{literal text {{regex}} more}}    `{{...}}` inside is a regex

with `error`, `warning`, `note` or `remark`. Every diagnostic produced must match one
expectation (its kind, its line, the text contained in its message) and every expectation must
be matched once; otherwise one line per mismatch, in mlir-opt's words (`unexpected error: ...`,
`expected error "..." was not produced`), and the chunk fails.

toptpu-opt produces errors only (no warnings, notes or remarks: an expectation of those is
never produced), at most one per chunk (the first problem stops the chunk): a parse error at
its token's line, a verifier error at the failing op's line, a pass refusing the IR at no line
(`@unknown`: toptpu's passes name the op in the message, not its place in the file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toptpu.errors import ToptpuError

#: mlir-opt's expectation syntax (SourceMgrDiagnosticVerifierHandler)
_EXPECTED = re.compile(
    r"expected-(error|warning|note|remark)(-re)?\s*(@(?:[+-][0-9]+|above|below|unknown))?"
    r"\s*\{\{(.*)\}\}\s*$")
#: a comment that starts as an expectation but is not in the syntax above (a typo must not
#: pass unnoticed; prose that mentions `expected-error` mid-comment is prose)
_MENTION = re.compile(r"//\s*expected-(error|warning|note|remark)")


class ExpectationSyntaxError(ToptpuError, ValueError):
    """An `expected-*` comment that does not parse (line, what is wrong)."""


@dataclass
class Expected:
    """One `expected-KIND` comment: where it was written and what it expects."""

    kind: str
    line: int | None  # 1-based line in the chunk; None: @unknown
    text: str
    regex: re.Pattern[str] | None
    written_at: int  # the comment's own line
    matched: bool = False

    def matches(self, message: str) -> bool:
        if self.regex is not None:
            return self.regex.search(message) is not None
        return self.text in message


@dataclass(frozen=True)
class Diagnostic:
    """A diagnostic toptpu-opt produced for a chunk: its kind, line (None: none known) and
    message (one line)."""

    kind: str
    line: int | None
    message: str


def _regex_of(text: str) -> re.Pattern[str]:
    """`-re`: literal text with `{{regex}}` parts."""
    parts, pos = [], 0
    for m in re.finditer(r"\{\{(.*?)\}\}", text):
        parts.append(re.escape(text[pos:m.start()]))
        parts.append(f"(?:{m.group(1)})")
        pos = m.end()
    parts.append(re.escape(text[pos:]))
    return re.compile("".join(parts))


def parse_expectations(text: str) -> list[Expected]:
    """The `expected-*` comments of a chunk, with the line each refers to (1-based, in the
    chunk). Raises ExpectationSyntaxError for a malformed one or an offset off the chunk."""
    lines = text.split("\n")
    out: list[Expected] = []
    below: list[Expected] = []
    last_plain: int | None = None
    for number, line in enumerate(lines, start=1):
        found = _EXPECTED.search(line)
        if found is None:
            if _MENTION.search(line):
                raise ExpectationSyntaxError(
                    f"line {number}: malformed expectation (write `expected-error @+1 "
                    "{{message}}`: kind, optional @+N/@-N/@above/@below/@unknown, then the "
                    "message in double braces at the end of the line)")
            if line.strip():  # the designator lines do not count for @above / @below
                last_plain = number
                for e in below:
                    e.line = number
                below.clear()
            continue
        kind, is_re, where, message = found.groups()
        try:
            regex = _regex_of(message) if is_re else None
        except re.error as bad:
            raise ExpectationSyntaxError(f"line {number}: invalid regex in expected-{kind}-re: "
                                         f"{bad}") from None
        e = Expected(kind, number, message, regex, number)
        if where is None:  # the line the comment is on
            pass
        elif where == "@unknown":
            e.line = None
        elif where == "@above":
            if last_plain is None:
                raise ExpectationSyntaxError(f"line {number}: expected-{kind} @above, but no "
                                             "line above it")
            e.line = last_plain
        elif where == "@below":
            below.append(e)
        else:
            target = number + int(where[1:])
            if not 1 <= target <= len(lines):
                raise ExpectationSyntaxError(f"line {number}: expected-{kind} {where} points "
                                             f"to line {target}, outside the chunk")
            e.line = target
        out.append(e)
    if below:
        raise ExpectationSyntaxError(f"line {below[0].written_at}: expected-{below[0].kind} "
                                     "@below, but no line below it")
    return out


def check(expected: list[Expected], produced: list[Diagnostic], name: str,
          line_offset: int = 0) -> list[str]:
    """The mismatches between what a chunk produced and what it expected, one line each
    (`name:LINE: error: ...`, the line counted in the whole file: chunk line + `line_offset`);
    empty when every diagnostic was expected and every expectation produced."""
    problems: list[str] = []

    def where(line: int | None) -> str:
        return f"{name}:{line + line_offset}" if line is not None else name

    for d in produced:
        hit = next((e for e in expected if not e.matched and e.kind == d.kind
                    and e.line == d.line and e.matches(d.message)), None)
        if hit is not None:
            hit.matched = True
            continue
        problems.append(f"{where(d.line)}: error: unexpected {d.kind}: {d.message}")
    for e in expected:
        if not e.matched:
            at = "" if e.line is not None else " (@unknown)"
            problems.append(f"{where(e.written_at)}: error: expected {e.kind}{at} "
                            f"\"{e.text}\" was not produced"
                            + (f" at line {e.line + line_offset}"
                               if e.line is not None and e.line != e.written_at else ""))
    return problems
