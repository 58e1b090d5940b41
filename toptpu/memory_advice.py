"""What an out-of-memory error of a command says: which size made the buffer too big.

numpy's MemoryError names the shape it could not allocate ("Unable to allocate 954. GiB for
an array with shape (4000000000, 64) ..."); each dimension is matched against the command's
integer options (`--seq-length 512`) and the integer fields of the model's config.json
(`vocab_size`, `hidden_size`, ...), and the advice names the size behind the largest one:
lower the option, or (a config size) the model is too big for this host. Without a shape or
a match the advice stays general; it never claims a cause it did not find.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

_SHAPE = re.compile(r"shape \(([0-9, ]+)\)")

#: the attributes of a command's arguments that name model directories
_MODEL_DIRS = ("model", "config_dir", "config_dirs")

#: config.json is read only when it is a regular file at most this big
_MAX_CONFIG_BYTES = 1 << 20

#: sizes this small match too much to be named as a cause
_MIN_DIM = 2

#: a dimension within this fraction of a large size is that size plus a margin (a buffer of
#: seq_length + 128 positions is the sequence's)
_NEAR = 0.01


def _matches(dim: int, size: int) -> bool:
    return dim == size or (size >= 1024 and abs(dim - size) <= size * _NEAR)


def _config_sizes(path: str) -> list[tuple[str, int]]:
    """The integer fields of a config.json (one level of nested configs too)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > _MAX_CONFIG_BYTES:
            return []
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(cfg, dict):
        return []
    sizes: list[tuple[str, int]] = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            sizes += [(f"{key}.{k}", v) for k, v in value.items()
                      if isinstance(v, int) and not isinstance(v, bool)]
        elif isinstance(value, int) and not isinstance(value, bool):
            sizes.append((key, value))
    return sizes


def _sizes(args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(the command's integer options as --flags, the config fields as 'key of PATH')."""
    options = [(f"--{k.replace('_', '-')}", v) for k, v in vars(args).items()
               if isinstance(v, int) and not isinstance(v, bool)]
    fields: list[tuple[str, int]] = []
    for attr in _MODEL_DIRS:
        dirs: Any = getattr(args, attr, None)
        for d in dirs if isinstance(dirs, list) else [dirs]:
            if isinstance(d, str):
                path = os.path.join(d, "config.json")
                fields += [(f"{k} of {path}", v) for k, v in _config_sizes(path)]
    return options, fields


def out_of_memory_advice(error: MemoryError, args: argparse.Namespace) -> str:
    """The one-line message of a command that ran out of memory."""
    text = str(error)
    detail = f" ({text})" if text else ""
    m = _SHAPE.search(text)
    dims = [int(x) for x in m.group(1).split(",") if x.strip()] if m else []
    options, fields = _sizes(args)
    named: list[tuple[int, list[str], bool]] = []  # dim, its names, whether an option
    for d in sorted(set(dims), reverse=True):
        if d < _MIN_DIM:
            continue
        opts = [n for n, v in options if _matches(d, v)]
        cfgs = [n for n, v in fields if _matches(d, v)]
        if opts or cfgs:
            named.append((d, opts + cfgs, bool(opts)))
    if not named:
        return (f"out of memory{detail}; lower the sizes the command was given or free "
                "memory")
    cause = "; ".join(f"{d} comes from {' or '.join(names)}" for d, names, _ in named)
    biggest, names, is_option = named[0]
    if is_option:
        flag = next(n for n in names if n.startswith("--"))
        advice = f"lower {flag} or free memory"
    else:
        advice = (f"{names[0].split(' of ')[0]} {biggest} makes the model too big for this "
                  "host's memory: use a smaller model (or a config.json with that size "
                  "lowered) or a host with more memory")
    return f"out of memory{detail}: in that shape {cause}; {advice}"
