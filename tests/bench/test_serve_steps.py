"""Where a decoding request's time goes (``serve_steps``): the fitted step cost and its split, on synthetic
steps whose cost is known."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken_bench.serve_steps import compare_tpot_parts, fit_step_cost, tpot_parts


def _steps(n: int, base: float, per_req: float, per_tok: float, plugin: float, seed: int = 0,
           max_dec: int = 8) -> list[tuple[float, int, int, float]]:
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        d = int(g.integers(0, max_dec + 1))
        p = int(g.choice([0, 0, 64, 128]))
        v = plugin * d
        out.append((base + per_req * d + per_tok * p + v, d, p, v))
    return out


def test_fit_recovers_a_known_step_cost() -> None:
    base, per_req, per_tok = fit_step_cost(_steps(200, 0.02, 0.004, 0.0003, 0.001))
    assert base == pytest.approx(0.02) and per_req == pytest.approx(0.004) and per_tok == pytest.approx(0.0003)
    with pytest.raises(ValueError, match=">= 3"):
        fit_step_cost([(1.0, 1, 0, 0.0)])


def test_parts_sum_to_the_token_weighted_step_and_split_by_cause() -> None:
    """A run with more decoding requests and more prefill tokens per step: its extra time shows under decode and
    prefill, the plugin's under plugin, and the parts add up (residual 0 for an exact cost model)."""
    van = _steps(150, 0.02, 0.004, 0.0003, 0.0, seed=1, max_dec=3)
    row = _steps(150, 0.02, 0.004, 0.0003, 0.002, seed=2, max_dec=9)
    got = compare_tpot_parts({"vanilla": van, "row": row})
    v, r = got["runs"]["vanilla"], got["runs"]["row"]
    for p in (v, r):
        assert p["residual_s"] == pytest.approx(0.0, abs=1e-4)
        assert p["step_s"] == pytest.approx(p["decode_s"] + p["prefill_s"] + p["plugin_s"] + p["residual_s"], abs=2e-5)
    assert v["plugin_s"] == 0.0 and r["plugin_s"] > 0.0
    assert r["decode_s"] > v["decode_s"] and r["decoding_mean"] > v["decoding_mean"]
    # token weighting: a step counts once per request decoding in it
    w = [(0.1, 1, 0, 0.0), (0.3, 3, 0, 0.0), (0.2, 0, 128, 0.0)]
    assert tpot_parts(w, (0.0, 0.1, 0.0))["step_s"] == pytest.approx((0.1 + 3 * 0.3) / 4)


def test_nothing_to_split_without_decoding_steps_or_enough_steps() -> None:
    assert tpot_parts([(0.2, 0, 128, 0.0)], (0.0, 0.0, 0.001)) == {}
    assert compare_tpot_parts({"a": [(0.1, 1, 0, 0.0)]}) == {}


def test_prefill_step_fraction_is_token_weighted() -> None:
    w = [(0.1, 1, 0, 0.0), (0.5, 3, 128, 0.0), (0.2, 0, 128, 0.0)]  # the prefill-only step decodes nothing
    assert tpot_parts(w, (0.0, 0.1, 0.001))["prefill_step_frac"] == pytest.approx(3 / 4)


def test_parts_by_rate_share_one_cost_model_and_come_in_rate_order() -> None:
    from vtoken_bench.serve_goodput import tpot_parts_by_rate

    steps = {0.2: {"vanilla": _steps(60, 0.02, 0.004, 0.0003, 0.0, seed=3),
                   "row": _steps(60, 0.02, 0.004, 0.0003, 0.001, seed=4)},
             0.1: {"vanilla": _steps(60, 0.02, 0.004, 0.0003, 0.0, seed=5), "row": []}}
    got = tpot_parts_by_rate(steps)
    assert [g["rate_rps"] for g in got] == [0.1, 0.2]
    assert got[0]["cost"] == got[1]["cost"]
    assert got[0]["cost"]["per_prefill_token_s"] == pytest.approx(0.0003, rel=1e-3)
    assert got[0]["runs"]["row"] == {} and got[1]["runs"]["row"]["plugin_s"] > 0
    assert tpot_parts_by_rate({0.1: {"vanilla": [], "row": []}}) == []
