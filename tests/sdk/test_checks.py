"""run_checks: a falsifying example found by one check is tried first by the policy's later checks."""

from __future__ import annotations

import vtoken_sdk as vt
from vtoken_sdk.checks import run_checks


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
def crashes_on_short_rows(s: vt.TokenStats, ctx: vt.MaskContext):
    return s.attn_sum.reshape(-1, 7)  # a run-time error on (almost) every batch


@vt.policy(budget=vt.Budget(ratio=0.5))
def fine(s: vt.TokenStats):
    return s.attn_sum


def test_later_checks_reuse_the_first_falsifying_example() -> None:
    failing: list[object] = []
    first = run_checks(crashes_on_short_rows, examples=50, only=("score_shape",), failing=failing).results[0]
    assert first.status == "fail" and first.spec is not None and failing == [first.spec]
    later = run_checks(crashes_on_short_rows, examples=50, only=("pins_kept", "nan_inf"), failing=failing).results
    by_name = {r.name: r for r in later}
    # pins_kept draws the same modes: the stored example fails it as it is, no new search or shrink
    assert by_name["pins_kept"].status == "fail" and by_name["pins_kept"].spec == first.spec
    # nan_inf draws only "special" batches: the "ties" example is not offered, it finds its own
    assert by_name["nan_inf"].status == "fail" and by_name["nan_inf"].spec.mode == "special"
    assert first.spec.mode != "special" and len(failing) == 2


def test_a_stored_example_does_not_replace_the_drawn_ones() -> None:
    failing: list[object] = []
    run_checks(crashes_on_short_rows, examples=20, only=("score_shape",), failing=failing)
    report = run_checks(fine, examples=20, only=("pins_kept", "exact_budget"), failing=failing)
    assert [r.status for r in report.results] == ["pass", "pass"]
    assert all(r.detail == "20 examples" for r in report.results) and len(failing) == 1
