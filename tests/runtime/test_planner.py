"""Planner properties on random liveness (vectorized numpy, checked against the definitions)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.planner import plan_compact, plan_naive, plan_ordered


@st.composite
def liveness(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    rows = draw(st.integers(1, 4))
    cache_len = draw(st.integers(0, 40))
    n = draw(st.integers(0, cache_len))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    live = np.zeros((rows, cache_len), bool)
    for r in range(rows):  # test-side construction; equal live count per row
        live[r, rng.choice(cache_len, n, replace=False)] = True
    return live, n


def apply(live: np.ndarray, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Ids of tokens per slot after executing the moves sequentially in the given order."""
    ids = np.where(live, np.arange(live.size).reshape(live.shape), -1)
    for r, s, d in zip(rows, src, dst, strict=True):
        ids[r, d] = ids[r, s]
    return ids


@settings(max_examples=300, deadline=None)
@given(liveness())
def test_compact(case: tuple[np.ndarray, int]) -> None:
    live, n = case
    rows, src, dst = plan_compact(live, n)
    assert src.size <= int((~live).sum())  # moves <= evicted
    assert (dst < n).all() and (src >= n).all()  # disjoint: any execution order is safe
    ids = apply(live, rows, src, dst)
    before = np.sort(np.where(live, np.arange(live.size).reshape(live.shape), -1), axis=1)[:, live.shape[1] - n:]
    assert (np.sort(ids[:, :n], axis=1) == before).all()  # [0, n) holds exactly the live tokens


@settings(max_examples=300, deadline=None)
@given(liveness())
def test_ordered_preserves_order_even_sequentially(case: tuple[np.ndarray, int]) -> None:
    live, n = case
    rows, src, dst = plan_ordered(live, n)
    ids = apply(live, rows, src, dst)  # sequential in emitted order: the copy engine's chunk order
    expected = np.stack([np.nonzero(live[r])[0] + r * live.shape[1] for r in range(live.shape[0])])
    assert (ids[:, :n] == expected).all()


@settings(max_examples=200, deadline=None)
@given(liveness(), st.integers(1, 8))
def test_naive_keeps_blocks_with_a_live_token(case: tuple[np.ndarray, int], bs: int) -> None:
    live, _ = case
    cache_len = live.shape[1]
    nb = -(-cache_len // bs)
    padded = np.zeros((live.shape[0], nb * bs), bool)
    padded[:, :cache_len] = live
    keep = plan_naive(padded, cache_len, bs)
    for b in range(nb):
        assert keep[b] == padded[:, b * bs:(b + 1) * bs].any()
