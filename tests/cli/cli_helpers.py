"""Functions the command line under test imports by name (``--model cli_helpers:...``, ``--data cli_helpers:...``).

The tests put this directory on ``PYTHONPATH`` (subprocesses) or ``sys.path`` (in-process runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from fxquant.models.digits import DigitsCNN, load_digits_splits

INTERRUPT_AFTER = 4  # batches


def failing_factory() -> torch.nn.Module:
    raise RuntimeError("checkpoint server unreachable")


class _DigitsWithSoftmax(DigitsCNN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(super().forward(x), dim=1)


def changed_digits_cnn() -> torch.nn.Module:
    """The same weights fit, but the graph changed (a softmax was added): a run prepared before must refuse it."""
    return _DigitsWithSoftmax().eval()


def calib_batches() -> list[torch.Tensor]:
    """Six fixed batches of 30 real digit images."""
    images = load_digits_splits()["calib"][0]
    return [images[i:i + 30] for i in range(0, 180, 30)]


def interrupted_batches() -> Iterator[torch.Tensor]:
    """The first batches of :func:`calib_batches`, then a Ctrl-C, as if the user stopped a long calibration."""
    for index, batch in enumerate(calib_batches()):
        if index == INTERRUPT_AFTER:
            raise KeyboardInterrupt
        yield batch


def unseeded_digits_cnn() -> torch.nn.Module:
    """Fresh random weights on every call, whatever torch's seed: a factory no run can be rebuilt from."""
    model = DigitsCNN().eval()
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        model.fc2.weight.copy_(torch.randn(model.fc2.weight.shape, generator=generator))
    return model


def pixels_to_unit_range(batch: dict) -> dict:
    """A ``--transform``: the HF test dataset stores 0..16 pixel values, the model wants [0, 1]."""
    return {**batch, "image": batch["image"].float() / 16.0}
