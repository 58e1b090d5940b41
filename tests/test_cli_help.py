"""The help of every toptpu command explains every option and states its default."""

from __future__ import annotations

import argparse

from toptpu.cli import build_parser


def test_every_option_with_a_default_says_it_in_its_help() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for command, parser in sub.choices.items():
        text = parser.format_help()
        for a in parser._actions:
            if (not a.option_strings or a.default is None or isinstance(a.default, bool)
                    or a.default is argparse.SUPPRESS):
                continue
            if a.help is None:
                missing.append(f"{command} {a.option_strings[-1]}: no help text")
            elif f"(default: {a.default}" not in " ".join(text.split()):
                missing.append(f"{command} {a.option_strings[-1]}: default {a.default!r} not "
                               "shown")
    assert not missing, "\n".join(missing)


def test_every_option_has_a_help_text() -> None:
    """An option without help (--top-k once) leaves its meaning and default unsaid."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{command} {a.option_strings[-1]}" for command, parser in sub.choices.items()
            for a in parser._actions if a.option_strings and not a.help]
    assert not bare, bare
