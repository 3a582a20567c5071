"""Safe artifacts: save and rebuild quantized models from plain tensors and a JSON manifest; TorchScript export."""

from fxquant.artifacts.export import export
from fxquant.artifacts.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, read_manifest
from fxquant.artifacts.model_io import load, save

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "export", "load", "read_manifest", "save"]
