"""Where a decoding request's time per output token goes, from the engine steps of a run
(``run_trace(record_steps=True)``): engine-free, unit-tested in ``tests/bench/test_serve_steps.py``.

A request's TPOT is the mean duration of the steps it decodes in (plus steps it waits in, when it is not
scheduled). So each step counts once per request decoding in it: the token-weighted mean step time is what
the decoding requests of a run saw. It is split into

    plugin    the plugin's measured seconds in those steps (statistics collector, policy, compaction,
              input preparation; 0 for vanilla)
    prefill   the fitted cost of the prefill-chunk tokens sharing those steps (prompts admitted while
              others decode: each rides in the decode steps of every running request)
    decode    the fitted cost of the decoding requests themselves: the batch (``base + per_request x n``)

with ``step seconds - plugin seconds ~ base + per_request x decoding + per_token x prefill tokens`` fitted by
least squares over the steps of every run given (one cost model for the engines compared: same machine, model
and dtype). The three parts sum to the measured mean, up to the fit's residual (reported).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Step = tuple[float, int, int, float]  # (seconds, requests decoding, prefill tokens, plugin seconds)


def fit_step_cost(steps: Sequence[Step]) -> tuple[float, float, float]:
    """``(base_s, per_decoding_request_s, per_prefill_token_s)``: least squares of the steps' non-plugin seconds.
    Raises ValueError with fewer than 3 steps."""
    if len(steps) < 3:
        raise ValueError(f"{len(steps)} steps; expected >= 3 to fit a step cost")
    a = np.array([(1.0, n, p) for _, n, p, _ in steps])
    y = np.array([t - v for t, _, _, v in steps])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def tpot_parts(steps: Sequence[Step], cost: tuple[float, float, float]) -> dict[str, Any]:
    """The token-weighted mean step of a run and its parts (see the module docstring), in seconds; empty when
    no step decoded."""
    dec = [s for s in steps if s[1] > 0]
    w = np.array([s[1] for s in dec], dtype=float)
    if not w.sum():
        return {}
    t = np.array([s[0] for s in dec])
    n = np.array([s[1] for s in dec], dtype=float)
    p = np.array([s[2] for s in dec], dtype=float)
    v = np.array([s[3] for s in dec])
    mean = lambda x: float((w * x).sum() / w.sum())  # noqa: E731
    base, per_req, per_tok = cost
    parts = {"step_s": mean(t), "plugin_s": mean(v), "prefill_s": per_tok * mean(p),
             "decode_s": base + per_req * mean(n)}
    parts["residual_s"] = parts["step_s"] - parts["plugin_s"] - parts["prefill_s"] - parts["decode_s"]
    out: dict[str, Any] = {k: round(x, 5) for k, x in parts.items()}
    out.update(decoding_mean=round(mean(n), 2), prefill_tokens_mean=round(mean(p), 1),
               prefill_step_frac=round(mean((p > 0).astype(float)), 3), steps=len(steps), decode_steps=len(dec))
    return out


def compare_tpot_parts(runs: Mapping[str, Sequence[Step]]) -> dict[str, Any]:
    """One cost model fitted over every run's steps, and each run's :func:`tpot_parts` under it:
    ``{"cost": {base_s, per_request_s, per_prefill_token_s}, "runs": {label: parts}}`` (``{}`` when the
    runs have too few steps to fit)."""
    every = [s for v in runs.values() for s in v]
    try:
        cost = fit_step_cost(every)
    except ValueError:
        return {}
    return {"cost": {"base_s": round(cost[0], 5), "per_request_s": round(cost[1], 6),
                     "per_prefill_token_s": round(cost[2], 7)},
            "runs": {k: tpot_parts(v, cost) for k, v in runs.items()}}
