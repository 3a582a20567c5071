"""docs/backends.md runs as written: its Python blocks execute in order."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "backends.md"


def test_backends_doc_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 2
    for index, block in enumerate(blocks):
        namespace: dict[str, object] = {}
        exec(compile(block, f"{DOC.name}[python block {index}]", "exec"), namespace)
        assert "qmodel" in namespace, f"python block {index} should build a quantized model"
