"""SLOs and goodput (DistServe's definition): TTFT / TPOT attainment, the goodput search over Poisson
arrival rates. Engine-free: unit-tested in ``tests/bench/test_serve_bench.py``."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import numpy as np


def allowed_misses(n_requests: int, attainment: float) -> int:
    """How many of ``n_requests`` may miss their SLO with the attainment still ``>= attainment``."""
    return int(math.floor((1.0 - attainment) * n_requests + 1e-9))


def meets_slo(ttft: float | None, tpot: float | None, ttft_slo: float, tpot_slo: float) -> bool:
    """A request meets the SLO when it has a first token within ``ttft_slo`` and a TPOT within
    ``tpot_slo`` (None: never produced / never finished = a miss)."""
    return bool(ttft is not None and tpot is not None and ttft <= ttft_slo and tpot <= tpot_slo)


def attainment(ttfts: Sequence[float | None], tpots: Sequence[float | None], ttft_slo: float,
               tpot_slo: float) -> float:
    """Fraction of the requests meeting BOTH SLOs (DistServe's SLO attainment)."""
    if len(ttfts) != len(tpots):
        raise ValueError("one TTFT and one TPOT per request")
    if not ttfts:
        return 0.0
    return float(sum(meets_slo(a, b, ttft_slo, tpot_slo) for a, b in zip(ttfts, tpots, strict=True)) / len(ttfts))


def miss_counts(ttfts: Sequence[float | None], tpots: Sequence[float | None], ttft_slo: float,
                tpot_slo: float) -> dict[str, int]:
    """What the misses of a run missed: ``ttft`` counts the requests with no first token within
    ``ttft_slo`` (None included), ``tpot`` those with a first token whose TPOT is over ``tpot_slo`` or
    that never finished. A request late on both counts in both."""
    if len(ttfts) != len(tpots):
        raise ValueError("one TTFT and one TPOT per request")
    return {"ttft": int(sum(bool(a is None or a > ttft_slo) for a in ttfts)),
            "tpot": int(sum(bool(a is not None and (b is None or b > tpot_slo))
                            for a, b in zip(ttfts, tpots, strict=True)))}


def tpot_of(first: float, finish: float, n_out: int) -> float:
    """Time per output token after the first: ``(finish - first) / (n_out - 1)`` (0 for one token)."""
    return (finish - first) / (n_out - 1) if n_out > 1 else 0.0


@dataclass
class GoodputSearch:
    goodput: float
    probes: list[tuple[float, float]]  # (rate, attainment) in the order run
    bracket: tuple[float, float | None]  # highest passing rate, lowest failing rate above it (None: unbounded)

    @property
    def saturated(self) -> bool:
        """True when the ladder never found a failing rate (the goodput is a lower bound)."""
        return self.bracket[1] is None and self.goodput > 0


def _search_steps(start: float, target: float, factor: float, max_ladder: int, bisect_steps: int,
                  min_rate: float) -> Generator[float, float, GoodputSearch]:
    """The goodput search as a generator: yields the next rate to probe, is sent its attainment, returns the
    :class:`GoodputSearch` (see :func:`search_goodput`). One search can so be driven alone or in turn with
    others (:func:`search_goodput_paired`)."""
    if start <= 0 or factor <= 1:
        raise ValueError(f"start={start}, factor={factor}; expected start > 0, factor > 1")
    probes: list[tuple[float, float]] = []

    def ok(rate: float, a: float) -> bool:
        probes.append((rate, float(a)))
        return float(a) >= target - 1e-12

    lo: float | None = None
    hi: float | None = None
    r = start
    if ok(r, (yield r)):
        lo = r
        for _ in range(max_ladder):
            r *= factor
            if not ok(r, (yield r)):
                hi = r
                break
            lo = r
    else:
        hi = r
        for _ in range(max_ladder):
            r /= factor
            if r < min_rate:
                break
            if ok(r, (yield r)):
                lo = r
                break
            hi = r
    if lo is None:
        return GoodputSearch(0.0, probes, (0.0, hi))
    if hi is not None:
        for _ in range(bisect_steps):
            mid = math.sqrt(lo * hi)
            if ok(mid, (yield mid)):
                lo = mid
            else:
                hi = mid
    return GoodputSearch(lo, probes, (lo, hi))


def search_goodput(run: Callable[[float], float], start: float, target: float, *, factor: float = 2.0,
                   max_ladder: int = 4, bisect_steps: int = 2, min_rate: float = 0.0) -> GoodputSearch:
    """Highest rate whose ``run(rate) -> attainment`` is ``>= target``, assuming attainment falls with the
    rate. A geometric ladder from ``start`` (``x factor`` up while passing, ``/ factor`` down while
    failing, at most ``max_ladder`` steps and never below ``min_rate``) brackets it; ``bisect_steps``
    geometric bisections narrow the bracket. Returns 0 when the lowest rate probed fails."""
    return search_goodput_paired(lambda _label, rate: run(rate), ("",), start, target, factor=factor,
                                 max_ladder=max_ladder, bisect_steps=bisect_steps, min_rate=min_rate)[""]


def search_goodput_paired(run: Callable[[str, float], float], labels: Sequence[str], start: float, target: float,
                          *, factor: float = 2.0, max_ladder: int = 4, bisect_steps: int = 2,
                          min_rate: float = 0.0) -> dict[str, GoodputSearch]:
    """:func:`search_goodput` of several engines at once, in turn: every round, each engine whose search is
    still open probes its next rate (``run(label, rate)``), in an order rotated from round to round (A B, B A,
    ...), so a change of load on the machine falls on all of them alike. All start at ``start`` and step on the
    same geometric grid, so while their brackets overlap they probe the same rates one after the other.
    Returns each label's search."""
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"labels {list(labels)}; expected distinct names")
    gens = {k: _search_steps(start, target, factor, max_ladder, bisect_steps, min_rate) for k in labels}
    pending = {k: next(g) for k, g in gens.items()}  # label -> the rate it probes next
    done: dict[str, GoodputSearch] = {}
    order = list(labels)
    while pending:
        for k in [k for k in order if k in pending]:
            try:
                pending[k] = gens[k].send(run(k, pending[k]))
            except StopIteration as stop:
                done[k] = stop.value
                del pending[k]
        order = order[1:] + order[:1]
    return {k: done[k] for k in labels}


def poisson_arrivals(n: int, rate: float | None, seed: int = 1) -> np.ndarray:
    """Arrival times (s) of ``n`` requests, the first at 0: Poisson at ``rate`` req/s, or all at 0 for
    ``rate=None``. The same seed gives the same pattern scaled by ``1 / rate`` (rates compare alike)."""
    if not rate:
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0, size=n) / rate
    return np.cumsum(gaps) - gaps[0]
