"""The ``fxquant`` command line: thin argparse handlers over the Python API.

Exit status: 0 success, 1 a regression found by ``regress``, 2 bad input (one line on stderr; ``--debug`` for the
full traceback), 130 interrupted (Ctrl-C). ``--debug``, ``--quiet`` and ``--json`` are accepted before or after the
subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from fxquant.cli import calibrate, commands, convert, prepare, results
from fxquant.cli.common import printable
from fxquant.errors import FxQuantError

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
_FLAGS = (
    ("--debug", "show full tracebacks on errors"),
    ("--quiet", "no progress bars, warnings only"),
    ("--json", "print machine-readable JSON on stdout (errors too)"),
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line too (status 2), like every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _flags_parser(default: object) -> argparse.ArgumentParser:
    """The global flags; subcommands get them with a suppressed default so they do not reset a value given first."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag, text in _FLAGS:
        parser.add_argument(flag, action="store_true", default=default, help=text)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxquant", parents=[_flags_parser(False)],
                                     description="Post-training INT8 quantization on CPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _flags_parser(argparse.SUPPRESS)
    prepare.register(sub, common)
    calibrate.register(sub, common)  # one process, or --distributed
    convert.register(sub, common)  # plain, or within an accuracy budget
    results.register(sub, common)
    commands.register(sub, common)
    return parser


def _one_line(exc: BaseException) -> str:
    return printable(" ".join(line.strip() for line in str(exc).splitlines() if line.strip())) or type(exc).__name__


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    print(f"fxquant {args.command}: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "command": args.command, "exit_code": status, "error": message}))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxquant`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        return int(args.handler(args) or EXIT_OK)
    except FxQuantError as exc:
        if args.debug:
            traceback.print_exc()
        return _fail(args, f"error: {_one_line(exc)}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # stdout closed early (``fxquant graph RUN | head``): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
