"""The `toptpu` command line.

Each subcommand's module is imported when the command line names it (`COMMANDS`): a
`toptpu <cmd>` process loads that command's modules only, `toptpu --help` (or a command
line without a known command) every command's.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from toptpu.cli_args import ArgumentParser
from toptpu.command_io import command_run, drop_stdout
from toptpu.errors import AbortError, ToptpuError
from toptpu.memory_advice import out_of_memory_advice

Subparsers = argparse._SubParsersAction


def _demo(sub: Subparsers) -> None:
    from toptpu.demo_cli import add_demo_parser

    add_demo_parser(sub)


def _compile(sub: Subparsers) -> None:
    from toptpu import llm_cli

    p = sub.add_parser("compile", help=llm_cli.cmd_compile.__doc__)
    llm_cli.add_compile_args(p)
    p.set_defaults(fn=llm_cli.cmd_compile)


def _run(sub: Subparsers) -> None:
    from toptpu import llm_cli

    r = sub.add_parser("run", help=llm_cli.cmd_run.__doc__)
    llm_cli.add_run_args(r)
    r.set_defaults(fn=llm_cli.cmd_run)


def _chat(sub: Subparsers) -> None:
    from toptpu import llm_cli

    h = sub.add_parser("chat", help=llm_cli.cmd_chat.__doc__)
    llm_cli.add_chat_args(h)
    h.set_defaults(fn=llm_cli.cmd_chat)


def _serve(sub: Subparsers) -> None:
    from toptpu import serve_cli

    s = sub.add_parser("serve", help=serve_cli.cmd_serve.__doc__)
    serve_cli.add_serve_args(s)
    s.set_defaults(fn=serve_cli.cmd_serve)


def _cache(sub: Subparsers) -> None:
    from toptpu import llm_cli

    w = sub.add_parser("cache", help=llm_cli.cmd_cache.__doc__)
    llm_cli.add_cache_args(w)
    w.set_defaults(fn=llm_cli.cmd_cache)


def _info(sub: Subparsers) -> None:
    from toptpu.info_cli import add_info_parser

    add_info_parser(sub)


def _profile(sub: Subparsers) -> None:
    from toptpu.profile_cli import add_profile_parser

    add_profile_parser(sub)


def _run_ir(sub: Subparsers) -> None:
    from toptpu.run_ir import add_run_ir_parser

    add_run_ir_parser(sub)


def _estimate(sub: Subparsers) -> None:
    from toptpu.estimate import add_estimate_parser

    add_estimate_parser(sub)


def _sweep(sub: Subparsers) -> None:
    from toptpu.sweep import add_sweep_parser

    add_sweep_parser(sub)


def _eval(sub: Subparsers) -> None:
    from toptpu.eval_cli import add_eval_parser

    add_eval_parser(sub)


def _compare(sub: Subparsers) -> None:
    from toptpu.compare_cli import add_compare_parser

    add_compare_parser(sub)


#: the subcommands in `toptpu --help`'s order: name -> what adds its parser (importing its
#: module: `toptpu <name>` imports no other command's)
COMMANDS: dict[str, Callable[[Subparsers], None]] = {
    "demo": _demo, "compile": _compile, "run": _run, "chat": _chat, "serve": _serve,
    "cache": _cache, "info": _info, "profile": _profile, "run-ir": _run_ir,
    "estimate": _estimate, "sweep": _sweep, "eval": _eval, "compare": _compare,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of the one named `only` (only its module imported;
    its parsing, help and errors are the same as in the whole parser)."""
    ap = ArgumentParser(prog="toptpu", description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return ap


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (a KeyboardInterrupt, so `except Exception` never
    swallows it and every `finally` on the way out runs)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the command runs, SIGINT and SIGTERM raise `Interrupted` in the main thread:
    cleanups run (the model file writer removes its temp file) instead of the process
    dying where it stands. Later signals are ignored until the command is done, so a second
    Ctrl-C cannot break a cleanup. Outside the main thread (no signals) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    watched = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        for s in watched:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in watched}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; what a user can cause ends in one line on stderr: status 1
    for an error, 128 + the signal for SIGINT (130) or SIGTERM (143)."""
    cmd = f"toptpu {args.command}"
    with signals_interrupt():
        try:
            with command_run():  # its inputs never written over, its stdout checked
                return int(args.fn(args))
        except AbortError as e:  # raised asynchronously: a file in use changed under it
            print(f"{cmd}: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            print(f"{cmd}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
        except ToptpuError as e:
            print(f"{cmd}: error: {e}", file=sys.stderr)
            return 1
        except MemoryError as e:  # the advice names the size behind the buffer
            print(f"{cmd}: error: {out_of_memory_advice(e, args)}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # the reader went away (`toptpu run ... | head`)
            drop_stdout()  # no second error when Python flushes
            return 1


def main(argv: Sequence[str] | None = None) -> int:
    """The `toptpu` command; returns the exit status (argparse's 2 for a bad argument or 0
    for --help instead of raising SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # a command line that starts with a command's name parses as in the whole parser (the
    # top-level parser has no option but --help, which lists every command)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(only).parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
