"""One table of (policy, settings) cases that every generic test runs over."""

from __future__ import annotations

from typing import Any

import vtoken_policies
import vtoken_sdk as vt

CASES: list[tuple[str, dict[str, Any]]] = [
    ("h2o", {}),
    ("h2o", {"granularity": "request", "budget": vt.Budget.evict(0.7)}),
    ("scissorhands", {}),
    ("random", {}),
    ("random", {"budget": vt.Budget(tokens=5, min_tokens=2)}),
    ("streaming_llm", {}),
    ("snapkv", {}),
    ("tova", {}),
    ("tova", {"protect": [vt.sinks(2), vt.protect_if(lambda s: s.attn_last > 1.0)]}),
    ("knorm", {}),
    ("knorm", {"granularity": "request", "budget": vt.Budget.evict(0.3)}),
]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, kw = case
    return name + ("-" + "-".join(sorted(kw)) if kw else "")


def build(case: tuple[str, dict[str, Any]]) -> vt.Policy:
    name, kw = case
    p = vtoken_policies.load(name)
    return p.configure(**kw) if kw else p
