"""The generic contract checks over the cases that read vector statistics (a subset of ``tests.cases.CASES``,
which ``tests/policies/test_shipped.py`` also runs): pins kept, exact budget, padding, determinism, batch
invariance, NaN/inf, scores' shape - on random keys / values / query summaries of one D and G."""

from __future__ import annotations

import pytest

from tests.cases import CASES, build, case_id, sizes
from vtoken_sdk.checks import CHECKS
from vtoken_sdk.testing import check_policy

VECTOR_CASES = [c for c in CASES if build(c).vector_reads]


@sizes(fast=8, full=60)
@pytest.mark.parametrize("case", VECTOR_CASES, ids=case_id)
def test_vector_policies_hold_the_contract(case, examples: int) -> None:
    report = check_policy(build(case), examples=examples)
    assert report.ok, report.summary()
    assert {r.name for r in report.results} == set(CHECKS)


def test_every_new_op_is_in_a_generic_case() -> None:
    from vtoken_sdk import ir

    kinds = set()
    stats = set()
    assert len(VECTOR_CASES) >= 4
    for case in CASES:
        p = build(case)
        graphs = [p.node] + [r.node for r in p.spec.protect if getattr(r, "node", None) is not None]
        for g in graphs:
            for n in ir.walk(g):
                kinds.add(type(n).__name__ if not isinstance(n, ir.TokenReduce) else f"token_{n.op}")
                if isinstance(n, ir.Chunk):
                    kinds.add(f"chunk_{n.op}")
                if isinstance(n, ir.Stat):
                    stats.add(n.name)
    assert {"Dot", "MatVec", "GroupMean", "token_sum", "token_mean", "token_max", "chunk_mean",
            "chunk_max"} <= kinds
    assert {"key", "value", "query_mean", "query_mean_future", "query_cov_future", "layer", "head",
            "head_dim"} <= stats
