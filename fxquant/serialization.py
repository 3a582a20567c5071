"""Reading tensor files safely: loading never executes code from the file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from fxquant.errors import ArtifactError


def load_tensors(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``: a file that needs arbitrary unpickling is refused."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsupported content"
        raise ArtifactError(f"{path}: refused to load; it holds objects other than tensors ({first}). fxquant "
                            "never executes code from a file: save plain tensors / state dicts") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise ArtifactError(f"{path}: corrupt or truncated tensor file ({exc})") from None
