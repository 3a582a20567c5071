"""``python -m fxquant`` runs the command line."""

import sys

from fxquant.cli import main

sys.exit(main())
