"""The quality eval runs its configurations in groups of policies (one batched session each, bounded
memory): the groups cover every policy once, in order, and a grouped run gives the rows a single session
gives (the same windows and prompts; rows are independent requests)."""

from __future__ import annotations

import pytest

from vtoken_bench.eval_quality import policy_groups, run_eval


def test_policy_groups_cover_every_policy_once_in_order() -> None:
    pols = tuple(f"p{i}" for i in range(13))
    for max_configs in (1, 2, 3, 12, 40):
        groups = policy_groups(pols, (0.3, 0.5, 0.7), max_configs)
        assert tuple(p for g in groups for p in g) == pols
        assert all(1 <= len(g) <= max(1, max_configs // 3) for g in groups)
    assert policy_groups((), (0.5,), 12) == [()]


@pytest.mark.slow
def test_grouped_eval_equals_one_session() -> None:
    kw = dict(ratios=(0.5,), context=96, continuation=6, ppl_requests=1, passkey_lengths=(300,), depths=(0.5,),
              answer_tokens=4)
    one = run_eval(("h2o", "streaming_llm", "tova"), max_configs=12, **kw)
    split = run_eval(("h2o", "streaming_llm", "tova"), max_configs=1, **kw)
    assert split["session_groups"] == [["h2o"], ["streaming_llm"], ["tova"]]
    assert [(r["policy"], r["eviction_ratio"]) for r in split["rows"]] == [
        ("full", 0.0), ("h2o", 0.5), ("streaming_llm", 0.5), ("tova", 0.5)]
    for a, b in zip(one["rows"], split["rows"], strict=True):
        assert a["policy"] == b["policy"]
        for k in ("perplexity", "perplexity_once"):
            assert a[k] == pytest.approx(b[k], rel=1e-4), (a, b)
        for k in ("passkey_in_prompt", "passkey_after_eviction"):
            assert a[k] == b[k], (a, b)
