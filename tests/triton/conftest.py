"""Triton kernels run under the interpreter on CPU tensors (set before any kernel module import)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"vtoken-test-{os.getuid()}"))

pytest.importorskip("triton")
