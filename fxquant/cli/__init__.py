"""The ``fxquant`` command line: thin argparse handlers over the Python API.

Exit status: 0 success, 1 a regression found by ``regress``, 2 bad input (one line on stderr; ``--debug`` for the
full traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence

from fxquant.cli import commands
from fxquant.errors import FxQuantError

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxquant", description="Post-training INT8 quantization on CPU.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register(sub)
    return parser


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
        print(f"fxquant {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"fxquant {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
