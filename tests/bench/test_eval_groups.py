"""The quality eval runs its configurations in groups of policies (one batched session each, bounded
memory): the groups cover every policy once, in order, and a grouped run gives the rows a single session
gives (the same windows and prompts; rows are independent requests)."""

from __future__ import annotations

import pytest

from vtoken_bench.eval_quality import paired, policy_groups, run_eval


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


def _result(rows: list[tuple[str, float, list[float]]]) -> dict:
    return {"rows": [{"policy": p, "eviction_ratio": r, "perplexity_once_windows": w,
                      "perplexity_decode_windows": []} for p, r, w in rows]}


def test_paired_is_the_window_by_window_log_difference() -> None:
    import math

    res = _result([("full", 0.0, [10.0, 20.0, 30.0]), ("a", 0.5, [11.0, 21.0, 30.0]),
                   ("b", 0.5, [10.0, 22.0, 33.0]), ("a", 0.3, [10.5, 20.5, 30.5]), ("b", 0.3, [10.0, 20.0, 30.0])])
    got = {(q["policy"], q["eviction_ratio"]): q for q in paired(res, "b")}
    d = [math.log(11 / 10), math.log(21 / 22), math.log(30 / 33)]  # a vs b at 0.5
    mean = sum(d) / 3
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 2 / 3)
    a5 = got[("a", 0.5)]
    assert (a5["windows"], a5["lower"], a5["reference"], a5["protocol"]) == (3, 2, "b", "once")
    assert a5["mean_dlogppl"] == pytest.approx(mean) and a5["se"] == pytest.approx(se)
    assert got[("a", 0.3)]["lower"] == 0 and got[("a", 0.3)]["mean_dlogppl"] > 0  # paired at its own ratio
    assert got[("b", 0.5)]["mean_dlogppl"] == 0.0 and got[("b", 0.5)]["se"] == 0.0
    full = got[("full", 0.0)]  # against the reference's first row (b at 0.5)
    assert full["mean_dlogppl"] == pytest.approx(2 * math.log(10 / 11) / 3) and full["lower"] == 2
    with pytest.raises(ValueError, match="no row of 'c'"):
        paired(res, "c")
    with pytest.raises(ValueError, match="every-step per-window"):
        paired(res, "b", "every-step")
    with pytest.raises(ValueError, match="protocol='twice'"):
        paired(res, "b", "twice")
    with pytest.raises(ValueError, match="protocols="):
        run_eval(("h2o",), protocols=("twice",))
