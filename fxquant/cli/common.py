"""Helpers shared by the subcommands: output (text or ``--json``), option types, config, data and trust options."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

from torch import nn

from fxquant.cli.data import DataOptions
from fxquant.cli.hf import PREFIX, is_hf_spec, load_tokenizer
from fxquant.cli.source import TrustOptions
from fxquant.cli.text import check_seq_len
from fxquant.config import QuantConfig


def emit(args: argparse.Namespace, text: str, data: dict[str, Any]) -> None:
    """Print ``text`` for people, or ``data`` as JSON with ``--json`` (stdout carries nothing else then)."""
    if args.json:
        print(json.dumps({"ok": True, "command": args.command, **data}, indent=2, default=str))
    elif text:
        print(text)


def printable(text: str) -> str:
    """``text`` with control characters escaped: a run directory from someone else must not drive the terminal."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def load_config(path: str | None) -> QuantConfig:
    return QuantConfig.from_file(path) if path else QuantConfig()


def add_data_arguments(parser: argparse.ArgumentParser, *, split: str) -> None:
    """``--data`` and the options that shape it (see :mod:`fxquant.cli.data`)."""
    parser.add_argument("--data", required=True, metavar="SPEC",
                        help="PKG.MODULE:FUNCTION, a save_to_disk directory, a hub dataset name, or .npy/.npz/.pt")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="rows per batch for tensor files and datasets (default: 32)")
    parser.add_argument("--columns", metavar="A,B", help="dataset columns / .npz arrays to feed, in order")
    parser.add_argument("--transform", metavar="PKG.MODULE:FUNCTION", help="applied to each batch")
    parser.add_argument("--split", default=split, help=f"dataset split (default: {split})")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="the data is text (a UTF-8 file, or a dataset's text column named by --columns, default "
                             "text): windows of N tokens, --batch-size windows per batch")
    parser.add_argument("--tokenizer", metavar="FOLDER",
                        help="the tokenizer for --seq-len (default: the one saved beside a transformers:FOLDER model)")


def data_options(args: argparse.Namespace, *, targets: bool = False) -> DataOptions:
    """``--data`` and its options; ``targets``: text batches carry their own ids as the target (next-token
    metrics)."""
    columns = tuple(c.strip() for c in args.columns.split(",") if c.strip()) if args.columns else ()
    return DataOptions(args.data, args.batch_size, columns, args.transform, args.split, args.seq_len, targets)


def text_tokenizer(args: argparse.Namespace, model_spec: str, model: nn.Module) -> Callable[[], Any] | None:
    """What makes the tokenizer of ``--seq-len`` text, after the run's model was authorized and rebuilt (so a run
    directory never names a folder that is opened unasked), with the window checked against the model's context."""
    if args.seq_len is None:
        return None
    check_seq_len(args.seq_len, model)
    if args.tokenizer is not None:
        return functools.partial(load_tokenizer, PREFIX + args.tokenizer)
    return functools.partial(load_tokenizer, model_spec) if is_hf_spec(model_spec) else None


TRUST_SPEC_HELP = ("import and call the model factory RUN_DIR names without --model; what is imported is printed to "
                   "stderr first (docs/cli.md, Trust)")


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` / ``--weights`` / ``--trust-model-spec``: needed for a RUN_DIR you did not prepare here."""
    group = parser.add_argument_group("a run directory you did not prepare here (docs/cli.md, Trust)")
    group.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                       help="the run's model factory, named again: imported only if it is the one RUN_DIR was "
                            "prepared from")
    group.add_argument("--weights", metavar="FILE", help="the weights file RUN_DIR was prepared with (checked by "
                                                         "SHA-256)")
    group.add_argument("--trust-model-spec", action="store_true", help=TRUST_SPEC_HELP)


def trust_options(args: argparse.Namespace) -> TrustOptions:
    return TrustOptions(args.model, args.weights, args.trust_model_spec)
