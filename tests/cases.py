"""One table of (policy, settings) cases that every generic test runs over.

``CASES``: the shipped policies and the DSL test policies (they exercise chunk pooling, token reductions,
softmax, ``s.layer``/``s.head``, and the vector statistics of ``StatsBatch.vectors``: keys, values, query
summaries, which the runtime gathers for the HF adapter and the vLLM plugin).
"""

from __future__ import annotations

from typing import Any

import pytest

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
    ("chunkkv", {}),
    ("observed_attention", {}),
    ("attn_zscore", {"protect": [vt.sinks(1), vt.protect_if(lambda s: s.attn_last >= vt.token_max(s.attn_last))]}),
    ("layer_weighted", {}),
    ("keydiff", {}),
    ("keydiff", {"granularity": "request"}),
    ("query_dot", {}),
    ("expected_attention", {}),
    ("diverse_hitters", {}),
    ("snap_observed", {}),
]

# Unequal budgets (``allocation=``): the SDK's contract checks, the Triton kernels and the HF session's per-row
# pages (tests/runtime/test_hf_rows.py, with ``when="prefill"``) run these; the vLLM plugin refuses them
# (``vtoken_runtime.eviction.refuse_unequal``), so the runtime tests that take CASES do not. The shipped
# ada_snapkv / ada_expected_attention / pyramidkv / ... are in ``vtoken_policies.names()`` and run through
# every shipped-policy test of the SDK.
ALLOCATION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("h2o", {"allocation": vt.AdaptiveLayer(floor=0.2)}),
    ("knorm", {"allocation": vt.AdaptiveLayer(floor=0.0), "protect": [vt.sinks(2)]}),
    ("tova", {"allocation": vt.AdaptiveLayer(floor=1.0)}),
    ("h2o", {"allocation": vt.GlobalAllocation(floor=0.1), "protect": [vt.sinks(1), vt.recent(2)]}),
    ("knorm", {"allocation": vt.HeadClasses(retrieval=((0, 1), (1, 0), (5, 2)), sinks=2, recent=3)}),
    ("snapkv", {"allocation": vt.Pyramid(beta=4, window=2)}),
    ("random", {"allocation": vt.Pyramid(beta=1.5, window=0), "budget": vt.Budget(tokens=5, min_tokens=2)}),
]


def sizes(fast: int, full: int) -> pytest.MarkDecorator:
    """Parametrize a test's ``examples`` (hypothesis examples per property): ``fast`` in the fast suite
    (``make test-fast``, run after every edit), ``full`` marked slow (``make test``). The same property
    either way; only how many examples it draws differs."""
    return pytest.mark.parametrize("examples", [pytest.param(fast, id="fast"),
                                                pytest.param(full, id="full", marks=pytest.mark.slow)])


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, kw = case
    alloc = kw.get("allocation")
    return name + ("-" + "-".join(sorted(kw)) if kw else "") + (f"-{alloc.kind}" if alloc is not None else "")


def build(case: tuple[str, dict[str, Any]]) -> vt.Policy:
    name, kw = case
    from tests.sdk.dsl_policies import POLICIES

    p = POLICIES[name] if name in POLICIES else vtoken_policies.load(name)
    return p.configure(**kw) if kw else p
