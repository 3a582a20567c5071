"""The bundled real-data example: a small CNN on scikit-learn's 8x8 handwritten digits (1,797 images).

The images ship inside scikit-learn, so tests and docs can measure what quantization does to accuracy on real data
with no download: train in about a second, calibrate on ``calib``, score on ``test``.

>>> model = train_digits_cnn()
>>> accuracy(model, digits_loader("test")) >= 0.95
True
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxquant.errors import ConfigError
from fxquant.models._blocks import seeded_generator

logger = logging.getLogger(__name__)

INPUT_SHAPE = (1, 8, 8)
SPLITS = ("train", "calib", "test")
# Stratified fractions of the whole set; the calibration split is held out from training so calibration data is
# as "unseen" as it would be in a real deployment.
_TEST_FRACTION = 0.2
_CALIB_FRACTION = 0.1


class DigitsCNN(nn.Module):
    """conv-bn-relu x2, maxpool, two linear layers: every pattern the pipeline fuses, on a model that really learns."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.pool(self.relu2(self.bn2(self.conv2(x))))
        return self.fc2(self.relu3(self.fc1(self.flatten(x))))


def digits_cnn(*, num_classes: int = 10) -> DigitsCNN:
    """An untrained ``DigitsCNN`` in eval mode (use :func:`train_digits_cnn` for a useful one)."""
    return DigitsCNN(num_classes).eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    # Uniform in [0, 1], the range of the real (scaled) images.
    return (torch.rand(batch_size, *INPUT_SHAPE, generator=seeded_generator(seed)),)


@functools.lru_cache(maxsize=4)
def _split_arrays(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    try:  # lazy: scikit-learn is a test extra, and importing fxquant must not need it
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError("the digits example needs scikit-learn: pip install 'fxquant[test]'") from exc
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]  # pixel values are 0..16
    labels = data.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(
        images, labels, test_size=_TEST_FRACTION, random_state=seed, stratify=labels
    )
    x_train, x_calib, y_train, y_calib = train_test_split(
        x_rest, y_rest, test_size=_CALIB_FRACTION / (1 - _TEST_FRACTION), random_state=seed, stratify=y_rest
    )
    return {"train": (x_train, y_train), "calib": (x_calib, y_calib), "test": (x_test, y_test)}


def load_digits_splits(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train", "calib", "test"}`` -> (images float32 Nx1x8x8 in [0, 1], labels int64 N); 70/10/20, stratified.

    The split is a pure function of ``seed``; tensors are fresh copies, so callers may modify them.
    """
    return {name: (torch.tensor(x), torch.tensor(y)) for name, (x, y) in _split_arrays(seed).items()}


def digits_loader(split: str, batch_size: int = 64, *, seed: int = 0) -> DataLoader:
    """Batches of (images, labels) from one split; only ``train`` is shuffled, with a generator seeded by ``seed``."""
    if split not in SPLITS:
        raise ConfigError(f"digits_loader: unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    images, labels = load_digits_splits(seed)[split]
    shuffle = split == "train"
    generator = seeded_generator(seed) if shuffle else None
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=shuffle, generator=generator)


def train_digits_cnn(*, epochs: int = 6, seed: int = 0, lr: float = 5e-3, batch_size: int = 128) -> DigitsCNN:
    """Train a ``DigitsCNN`` with Adam on the ``train`` split; deterministic for a given seed, eval mode on return.

    The global RNG is forked so seeding here does not change the random stream of the caller's code.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        loader = digits_loader("train", batch_size, seed=seed)
        model.train()
        for epoch in range(epochs):
            total, seen = 0.0, 0
            for images, labels in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                total, seen = total + loss.item() * len(labels), seen + len(labels)
            logger.debug("digits epoch %d: train loss %.4f", epoch + 1, total / seen)
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    """Top-1 accuracy over ``loader``; runs in eval mode and restores the model's previous mode afterwards."""
    was_training = model.training
    model.eval()
    correct = seen = 0
    try:
        for images, labels in loader:
            correct += int((model(images).argmax(dim=1) == labels).sum())
            seen += len(labels)
    finally:
        model.train(was_training)
    return correct / max(seen, 1)


# Zero-argument entry points, so the command line can name them (``--model fxquant.models.digits:trained_digits_cnn``,
# ``--data fxquant.models.digits:digits_calibration_data``).
@functools.lru_cache(maxsize=1)
def _trained_state() -> dict[str, torch.Tensor]:
    return train_digits_cnn().state_dict()


def trained_digits_cnn() -> DigitsCNN:
    """A ``DigitsCNN`` trained with the default seed (trained once per process, then copied)."""
    model = DigitsCNN()
    model.load_state_dict(_trained_state())
    return model.eval()


def digits_calibration_data() -> DataLoader:
    """``(images, labels)`` batches of the ``calib`` split, for ``fxquant calibrate --data``."""
    return digits_loader("calib")


def digits_eval_data() -> DataLoader:
    """``(images, labels)`` batches of the ``test`` split, for ``fxquant report --data``."""
    return digits_loader("test")
