"""Every Python block of docs/writing-a-policy.md runs (in order, one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-policy.md"


def test_doc_examples_run(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    src = tmp_path / "doc_examples.py"  # a real file, so tracing can locate lines
    src.write_text("\n".join(blocks))
    exec(compile(src.read_text(), str(src), "exec"), {"__name__": "doc_examples"})
