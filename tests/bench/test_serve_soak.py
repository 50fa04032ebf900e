"""``vtoken_bench.serve_soak`` without a server: where the RSS growth of a run happened."""

from __future__ import annotations

from vtoken_bench.serve_soak import rss_trajectory


def _samples(totals: list[int]) -> list[tuple[float, dict[str, int]]]:
    return [(5.0 * i, {"VLLM::EngineCore[2]": t - 100, "python[1]": 100}) for i, t in enumerate(totals)]


def test_a_leak_climbs_every_quarter_a_high_water_mark_steps_once() -> None:
    leak = rss_trajectory(_samples([1000 + 10 * i for i in range(40)]), 1000)["quarters_pct"]
    assert leak == sorted(leak) and leak[3] - leak[2] > 5 and leak[1] - leak[0] > 5
    step = rss_trajectory(_samples([1000] * 5 + [1080] * 35), 1000)["quarters_pct"]
    assert step[1:] == [8.0, 8.0, 8.0]


def test_no_samples_or_no_baseline_give_an_empty_trajectory() -> None:
    assert rss_trajectory([], 1000) == {}
    assert rss_trajectory(_samples([1, 2]), 0) == {}
