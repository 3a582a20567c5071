"""Fixtures for the command-line tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # in-process runs import cli_helpers by name, like the subprocesses do


@pytest.fixture(scope="session")
def digits_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dict of the trained digits CNN (trained once per session: ~1 s on an idle core, ~95% accuracy)."""
    from fxquant.models.digits import train_digits_cnn

    path = tmp_path_factory.mktemp("weights") / "digits.pt"
    torch.save(train_digits_cnn(epochs=2).state_dict(), path)
    return path
