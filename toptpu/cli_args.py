"""Argument types of the `toptpu` command line.

Each converts and checks one value, so a bad value ends in argparse's one line
`toptpu CMD: error: argument --x: ...` (exit status 2) before any work starts: numbers are
strict ASCII integers or finite floats in their range, token ids are integers, and text is
valid UTF-8 (Python hands over undecodable argv bytes as lone surrogates).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from toptpu.devices import Parallel
from toptpu.errors import ToptpuError

_INT = re.compile(r"[+-]?[0-9]+")


class UsageError(ToptpuError):
    """Arguments that do not go together or name nothing; the message says what to do."""


def _one_value(action: argparse.Action, parser: argparse.ArgumentParser, values: Any,
               option_string: str | None) -> None:
    """Refuse the empty list argparse hands over for `--x=--` (the value '--' is dropped as
    the end-of-options marker and the argument's type is never called; no type here
    returns an empty list)."""
    if action.nargs is None and isinstance(values, list) and not values:
        parser.error(f"argument {option_string or action.dest}: expected one value")


class _StoreOne(argparse._StoreAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        _one_value(self, parser, values, option_string)
        super().__call__(parser, namespace, values, option_string)


class _AppendOne(argparse._AppendAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        _one_value(self, parser, values, option_string)
        super().__call__(parser, namespace, values, option_string)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that states each option's default where it has one (not for flags, nor where
    the default is None: "not given", which the option's help explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """The command line's parser (its subcommands' too): every stored value went through
    its type; help texts show the defaults."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kw)
        self.register("action", None, _StoreOne)
        self.register("action", "store", _StoreOne)
        self.register("action", "append", _AppendOne)


def _int(text: str) -> int | None:
    """A strict decimal integer (ASCII digits; no '1_000', no Unicode digits), or None."""
    text = text.strip()
    if not _INT.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # beyond Python's digit limit
        return None


def int_at_least(lo: int, what: str = "") -> Callable[[str], int]:
    """An integer >= lo; `what` says what the bound means (e.g. '-1: per channel')."""
    def parse(text: str) -> int:
        v = _int(text)
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {lo}{what}, got {text!r}")
        return v

    parse.__name__ = f"int >= {lo}"
    return parse


def group_size(text: str) -> int:
    """-1 (per channel) or a positive integer."""
    v = _int(text)
    if v is None or (v != -1 and v < 1):
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or -1 (per channel), got {text!r}")
    return v


def finite_float(lo: float, hi: float = math.inf, lo_open: bool = False,
                 what: str = "") -> Callable[[str], float]:
    """A finite float in [lo, hi] ((lo, hi] with `lo_open`)."""
    bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else (
        f"{'>' if lo_open else '>='} {lo:g}")
    kind = "a number in " if math.isfinite(hi) else "a finite number "

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"must be {kind}{bounds}{what}, got {text!r}")
        return v

    parse.__name__ = "number"
    return parse


def utf8_problem(text: str) -> str | None:
    """Why `text` is not valid UTF-8 text (a lone surrogate, which is how Python passes an
    undecodable byte of argv or stdin), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        return f"is not valid UTF-8 text ({what} at character {e.start})"
    return None


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8."""
    problem = utf8_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}; pass UTF-8 text")
    return text


def pixel_size(text: str) -> tuple[int, int]:
    """'W,H' or 'WxH' (positive integers) -> (W, H): a pixel budget such as 768,768."""
    parts = text.lower().replace("x", ",").split(",")
    values = [_int(p.strip()) for p in parts] if len(parts) == 2 else []
    if len(values) != 2 or any(v is None or v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"must be a width and a height in pixels, W,H or WxH (e.g. 768,768), got {text!r}")
    return int(values[0]), int(values[1])  # type: ignore[arg-type]  # None refused above


def token_ids(text: str) -> list[int]:
    """Token ids separated by commas or spaces: '1, 2 3' -> [1, 2, 3]."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given: pass integers separated by "
                                         "commas or spaces")
    ids = []
    for part in parts:
        v = _int(part)
        if v is None:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a token id: pass integers separated by commas or spaces")
        ids.append(v)
    return ids


def chunk_lengths(text: str) -> list[int]:
    """Prefill chunk lengths separated by commas: '16,64' -> [16, 64] (each >= 1, none
    twice; their range against the other shapes is `StaticShapes.make`'s check)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected lengths separated by commas (e.g. 16,64), "
                                         f"got {text!r}")
    out = []
    for part in parts:
        v = _int(part)
        if v is None or v < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a chunk length (an integer "
                                             ">= 1)")
        if v in out:
            raise argparse.ArgumentTypeError(f"{v} is given twice")
        out.append(v)
    return out


#: how a model is spread over several devices (`--parallel`; `toptpu.devices.Parallel`)
PARALLEL_STRATEGIES = tuple(p.value for p in Parallel)
