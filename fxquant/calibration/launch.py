"""Moved to :mod:`fxquant.cli.launch` (``torchrun ... -m fxquant.cli.launch``); this path works for one more release
(it was named in the docs)."""

import sys
import warnings

from fxquant.cli.launch import build_parser, main

__all__ = ["build_parser", "main"]

warnings.warn("fxquant.calibration.launch moved to fxquant.cli.launch; run torchrun ... -m fxquant.cli.launch",
              DeprecationWarning, stacklevel=2)
if __name__ == "__main__":
    sys.exit(main())
