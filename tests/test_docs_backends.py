"""docs/backends.md, docs/amx.md, docs/quantization.md, docs/models.md and docs/export.md run as written: their
Python blocks execute in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


PAGES = [("backends.md", 2), ("amx.md", 1), ("quantization.md", 1), ("models.md", 1), ("export.md", 1)]


@pytest.mark.parametrize(("name", "least"), PAGES)
def test_backend_doc_examples_run(name: str, least: int) -> None:
    doc = DOCS / name
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) >= least
    for index, block in enumerate(blocks):
        namespace: dict[str, object] = {}
        exec(compile(block, f"{doc.name}[python block {index}]", "exec"), namespace)
        assert "qmodel" in namespace, f"python block {index} should build a quantized model"
