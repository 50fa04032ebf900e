"""The shipped policies, one file each (installed as ``vtoken_policies``).

Nothing is imported eagerly: ``load(name)`` imports one policy module on demand and ``names()`` lists
them, so importing this package costs nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# name -> module (the file is the name but for random_evict.py), in the order of the README's table
MODULES = {n: "random_evict" if n == "random" else n for n in (
    "h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm", "observed_attention", "keydiff",
    "expected_attention", "chunkkv", "cur", "diverse_hitters", "snap_observed", "ada_snapkv",
    "ada_expected_attention", "pyramidkv", "ada_snap_observed", "duo_attention")}


def names() -> list[str]:
    return list(MODULES)


def uniform() -> list[str]:
    """The shipped policies whose every (layer, KV head) row keeps the same number of tokens: those the vLLM
    plugin runs. The others (``allocation=``: AdaKV, PyramidKV, DuoAttention) run in the HF session's per-row
    pages; vLLM refuses them by name until issue 39. Imports every policy."""
    return [n for n in MODULES if load(n).spec.uniform]


def path(name: str) -> Path:
    return _HERE / f"{MODULES[name]}.py"


def files() -> list[Path]:
    return [path(n) for n in MODULES]


def load(name: str) -> Any:
    """The shipped policy called ``name`` (a ``vtoken_sdk.Policy``)."""
    if name not in MODULES:
        raise ValueError(f"unknown policy {name!r}; shipped: {', '.join(MODULES)}")
    mod = importlib.import_module(f"{__name__}.{MODULES[name]}")
    from vtoken_sdk import Policy

    found = [v for v in vars(mod).values() if isinstance(v, Policy)]
    return found[0]
