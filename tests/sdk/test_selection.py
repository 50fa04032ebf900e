"""The selection contract (docs/decisions.md decision 2) against a brute-force oracle."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cases import sizes
from vtoken_sdk.selection import _keep_top_k_sorted, _keep_top_k_threshold, keep_counts, ordered_key, select


def oracle(scores: list[float], length: int, pins: list[bool], k: int) -> list[bool]:
    """Plain-Python contract: pins, then highest score (NaN=-inf, -0=+0), ties -> larger index."""

    def key(i: int) -> tuple[float, int]:
        s = scores[i]
        s = -math.inf if math.isnan(s) else s + 0.0
        return (s, i)

    keep = [False] * len(scores)
    for i in range(length):
        if pins[i]:
            keep[i] = True
    rest = sorted((i for i in range(length) if not pins[i]), key=key, reverse=True)
    for i in rest[: max(0, k - sum(keep))]:
        keep[i] = True
    return keep


floats = st.one_of(st.sampled_from([0.0, -0.0, 1.0, 0.5, math.nan, math.inf, -math.inf]),
                   st.floats(width=32, allow_nan=True))


@sizes(fast=60, full=500)
def test_select_matches_oracle(examples: int) -> None:
    settings(max_examples=examples, deadline=None)(given(st.data())(_select_matches_oracle))()


def _select_matches_oracle(data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 3))
    r = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 24))
    scores = [[data.draw(st.lists(floats, min_size=n, max_size=n)) for _ in range(r)] for _ in range(b)]
    pins = [[data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(r)] for _ in range(b)]
    lengths = data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    budget = data.draw(st.lists(st.integers(0, n + 3), min_size=b, max_size=b))
    s_t = torch.tensor(scores, dtype=torch.float32)
    p_t = torch.tensor(pins)
    got = select(s_t, torch.tensor(lengths), p_t, torch.tensor(budget))
    for i in range(b):
        npins = max(sum(p for p in pins[i][j][: lengths[i]]) for j in range(r))
        k = min(lengths[i], max(budget[i], npins))
        for j in range(r):
            f32 = [struct.unpack("f", struct.pack("f", x))[0] for x in scores[i][j]]
            assert got[i, j].tolist() == oracle(f32, lengths[i], pins[i][j], k)


@sizes(fast=40, full=300)
def test_threshold_and_sort_paths_keep_the_same_tokens(examples: int) -> None:
    """select() ranks by kthvalue on CPU and by a full sort elsewhere: equal masks on unique keys (ties,
    NaN, padding and pins included, through the composite key)."""
    settings(max_examples=examples, deadline=None)(given(st.data())(_threshold_and_sort_paths_agree))()


def _threshold_and_sort_paths_agree(data: st.DataObject) -> None:
    b, r, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 40))
    vals = data.draw(st.lists(floats, min_size=b * r * n, max_size=b * r * n))
    s = torch.tensor(vals, dtype=torch.float32).view(b, r, n)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b)))
    pins = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * r * n, max_size=b * r * n))).view(b, r, n)
    idx = torch.arange(n)
    valid = idx < lengths[:, None, None]
    comp = ordered_key(s).to(torch.int64) * 2**32 + idx
    comp = torch.where(pins & valid, (2**31 - 1) * 2**32 + idx, comp)
    comp = torch.where(valid, comp, torch.full_like(comp, -(2**63)))
    k = torch.minimum(lengths, torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b))))
    a, t = _keep_top_k_sorted(comp, k), _keep_top_k_threshold(comp, k)
    assert torch.equal(a, t)
    assert (t.sum(-1) == k[:, None]).all()


def one(scores: list[float], length: int | None = None, pins: list[bool] | None = None, budget: int = 2) -> list[bool]:
    n = len(scores)
    return select(torch.tensor([[scores]], dtype=torch.float32), torch.tensor([n if length is None else length]),
                  torch.tensor([[pins or [False] * n]]), torch.tensor([budget]))[0, 0].tolist()


def test_ties_go_to_the_more_recent_token() -> None:
    assert one([1.0, 1.0, 1.0, 1.0], budget=2) == [False, False, True, True]


def test_nan_ranks_lowest_and_ties_with_minus_inf() -> None:
    assert one([math.nan, 0.0, -math.inf, 5.0], budget=2) == [False, True, False, True]
    assert one([-math.inf, math.nan, 1.0], budget=2) == [False, True, True]


def test_negative_zero_equals_zero() -> None:
    assert one([0.0, -0.0], budget=1) == [False, True]


def test_budget_at_or_above_length_keeps_everything_valid() -> None:
    assert one([3.0, 1.0, 2.0], budget=3) == [True, True, True]
    assert one([3.0, 1.0, 2.0, 9.0], length=3, budget=10) == [True, True, True, False]


def test_pins_exceeding_budget_are_all_kept_and_reported() -> None:
    pins = [True, True, True, False]
    assert one([0.0, 0.0, 0.0, 9.0], pins=pins, budget=1) == [True, True, True, False]
    k, overflow = keep_counts(torch.tensor([4]), torch.tensor([[pins]]), torch.tensor([1]))
    assert k.tolist() == [3] and overflow.tolist() == [2]


def test_length_zero_keeps_nothing() -> None:
    assert one([1.0, 2.0], length=0, pins=[True, True], budget=2) == [False, False]


def test_rows_keep_the_same_count_when_pins_differ() -> None:
    s = torch.zeros(1, 2, 4)
    pins = torch.tensor([[[True, True, True, False], [False, False, False, False]]])
    m = select(s, torch.tensor([4]), pins, torch.tensor([1]))
    assert m.sum(-1).tolist() == [[3, 3]]


@pytest.mark.parametrize("vals", [[-3.5, -0.0, 0.0, 1e-30, 2.0, math.inf], [-math.inf, -1e38, -1e-38, 5.0]])
def test_ordered_key_is_monotone(vals: list[float]) -> None:
    k = ordered_key(torch.tensor(vals)).tolist()
    assert k == sorted(k)
