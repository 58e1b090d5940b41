"""Typed headers from untrusted JSON: `decode` turns parsed JSON into dataclasses, checking
every value's type and range on the way, and `HeaderError` names the field that is wrong
(`nets.block.inputs[2].shape`). `encode` is the way back.

Schema types: dataclasses (exactly their fields; a field with a default may be absent),
bool, int (non-negative and at most MAX_INT unless annotated otherwise), float (finite),
str, `T | None`, Literal, enums (by value), a union of dataclasses told apart by a tag (a
`Literal` field they all have), `tuple[T, ...]`, `dict[str, T]`, `Any` (free-form JSON) and
`Annotated[T, check, ...]` with checks such as `Range`, `OneOf` and `NamePattern`.
"""

from __future__ import annotations

import functools
import math
import re
import types
from dataclasses import MISSING, dataclass, fields, is_dataclass
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from toptpu.errors import ToptpuError

#: the largest integer a header field may hold (exact in every JSON reader)
MAX_INT = 2**53 - 1


class HeaderError(ToptpuError, ValueError):
    """A header field that does not fit the schema: `field` is its path (`nets.block.ir`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field or 'the header'} {problem}")
        self.field = field


@dataclass(frozen=True)
class Range:
    """An annotation: the number lies in [lo, hi]."""

    lo: float = 0
    hi: float = MAX_INT

    def check(self, value: float, where: str) -> None:
        if not self.lo <= value <= self.hi:
            raise HeaderError(where, f"is {short(value)}, outside [{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class OneOf:
    """An annotation: the value is one of `choices` (`what` names them in errors)."""

    choices: tuple[Any, ...]
    what: str

    def check(self, value: Any, where: str) -> None:
        if value not in self.choices:
            raise HeaderError(where, f"is {short(value)}, not a known {self.what} "
                                     f"({', '.join(map(str, self.choices))})")


_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,255}")


@dataclass(frozen=True)
class NamePattern:
    """An annotation: a name (tensor, net, family, ...): letters, digits and `_.:@+-`."""

    def check(self, value: str, where: str) -> None:
        if not _NAME_RE.fullmatch(value):
            raise HeaderError(where, f"is {short(value)}, not a name (letters, digits, _.:@+-; at "
                                     "most 256 characters)")


Name = Annotated[str, NamePattern()]
Count = Annotated[int, Range(1)]


def join(where: str, key: str | int) -> str:
    """`where.key`, `where[3]`, or `where['odd key']` for a key that is not a name."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    if not _NAME_RE.fullmatch(key):
        return f"{where}[{short(key)}]"
    return f"{where}.{key}" if where else key


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def decode(tp: Any, value: Any, where: str = "") -> Any:
    """`value` (parsed JSON) as an instance of the schema type `tp`: dataclasses (exactly
    their fields; fields with a default may be absent), bool, int (non-negative unless
    annotated), float (finite), str, `T | None`, Literal, enums, tagged unions of
    dataclasses, `tuple[T, ...]`, `dict[str, T]`, `Annotated[T, check...]` and `Any`
    (free-form JSON). HeaderError names the field."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *checks = get_args(tp)
        out = _decode_plain_int(value, where) if base is int else decode(base, value, where)
        for check in checks:
            check.check(out, where)
        return out
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(get_args(tp)):
            return None
        if len(args) == 1:
            return decode(args[0], value, where)
        return _decode_tagged(tuple(args), value, where)
    if origin is Literal:
        if not any(type(value) is type(c) and value == c for c in get_args(tp)):
            raise HeaderError(where, f"is {short(value)}, not "
                                     f"{' or '.join(map(repr, get_args(tp)))}")
        return value
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _decode_enum(tp, value, where)
    if tp is bool:
        if type(value) is not bool:
            raise HeaderError(where, f"is {short(value)}, not true or false")
        return value
    if tp is int:
        out = _decode_plain_int(value, where)
        Range().check(out, where)
        return out
    if tp is float:
        if type(value) is int:
            return float(_decode_plain_int(value, where))
        if type(value) is not float or not math.isfinite(value):
            raise HeaderError(where, f"is {short(value)}, not a finite number")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise HeaderError(where, f"is {short(value)}, not a string")
        return value
    if origin is tuple:
        return _decode_tuple(get_args(tp), value, where)
    if origin is dict:
        return _decode_dict(get_args(tp), value, where)
    if is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, value, where)
    raise TypeError(f"unsupported schema type {tp}")


def _decode_enum(tp: type[Enum], value: Any, where: str) -> Enum:
    for member in tp:
        if type(value) is type(member.value) and value == member.value:
            return member
    raise HeaderError(where, f"is {short(value)}, not a known {tp.__name__} "
                             f"({', '.join(str(m.value) for m in tp)})")


@functools.cache
def _tags(options: tuple[type, ...]) -> tuple[str, dict[Any, type]]:
    """The tag field of a union of dataclasses (a Literal field every option has, with a
    different value in each) and the option of each tag value."""
    if not all(is_dataclass(o) for o in options):
        raise TypeError(f"unsupported schema union {options}: only T | None and unions of "
                        "tagged dataclasses")
    first = _hints(options[0])
    for name in (f.name for f in fields(options[0])):
        hints = [_hints(o).get(name) for o in options]
        if all(get_origin(h) is Literal and len(get_args(h)) == 1 for h in hints):
            by_tag = {get_args(h)[0]: o for h, o in zip(hints, options, strict=True)}
            if len(by_tag) == len(options):
                return name, by_tag
    raise TypeError(f"union {options} has no tag field (a Literal field of one value in each "
                    f"option; {sorted(first)})")


def _decode_tagged(options: tuple[type, ...], value: Any, where: str) -> Any:
    tag, by_tag = _tags(options)
    if not isinstance(value, dict):
        raise HeaderError(where, f"is {short(value)}, not an object")
    if tag not in value:
        raise HeaderError(join(where, tag), "is missing")
    option = next((o for t, o in by_tag.items() if type(t) is type(value[tag])
                   and t == value[tag]), None)
    if option is None:
        raise HeaderError(join(where, tag), f"is {short(value[tag])}, not "
                                            f"{' or '.join(map(repr, by_tag))}")
    return _decode_dataclass(option, value, where)


def _decode_plain_int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise HeaderError(where, f"is {short(value)}, not an integer")
    if abs(value) > MAX_INT:
        raise HeaderError(where, f"is {short(value)}, too large")
    return value


def _decode_tuple(args: tuple[Any, ...], value: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise HeaderError(where, f"is {short(value)}, not a list")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(decode(args[0], v, join(where, i)) for i, v in enumerate(value))
    if len(value) != len(args):
        raise HeaderError(where, f"has {len(value)} entries, not {len(args)}")
    return tuple(decode(a, v, join(where, i)) for i, (a, v) in enumerate(zip(args, value,
                                                                                 strict=True)))


def _decode_dict(args: tuple[Any, ...], value: Any, where: str) -> dict[str, Any]:
    key_type, value_type = args
    if not isinstance(value, dict):
        raise HeaderError(where, f"is {short(value)}, not an object")
    return {decode(key_type, k, join(where, k)): decode(value_type, v, join(where, k))
            for k, v in value.items()}


def _decode_dataclass(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise HeaderError(where, f"is {short(value)}, not an object")
    hints = _hints(cls)
    known = [f.name for f in fields(cls)]
    unknown = [k for k in value if k not in known]
    if unknown:
        raise HeaderError(join(where, unknown[0]), "is not a field of this header")
    kwargs = {}
    for f in fields(cls):
        if f.name not in value:
            if f.default is MISSING:
                raise HeaderError(join(where, f.name), "is missing")
            continue
        if f.default is None and value[f.name] is None:  # `encode` writes it by leaving it out
            raise HeaderError(join(where, f.name), "is null: an optional field is left out "
                                                   "when it has no value")
        kwargs[f.name] = decode(hints[f.name], value[f.name], join(where, f.name))
    return cls(**kwargs)


def short(value: Any) -> str:
    """`repr(value)`, cut to 60 characters (a header value quoted in an error message)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode(value: Any) -> Any:
    """The JSON form of a schema value (fields whose default is None are left out when
    None)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in fields(value)
                if not (f.default is None and getattr(value, f.name) is None)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value
