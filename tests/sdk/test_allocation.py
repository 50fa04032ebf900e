"""Unequal budgets, the counts step (``vtoken_sdk.allocation``): kept sets equal to kvpress's AdaKV algorithm,
exact totals, floors and pins, batch invariance, and the per-row selection equal to the layer's top set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vtoken_sdk.allocation import (
    AdaptiveLayer,
    GlobalAllocation,
    LayerSchedule,
    Uniform,
    allocate_counts,
    composite_keys,
    layer_counts,
    select_counts,
)
from vtoken_sdk.selection import select


def kvpress_adakv_keep(scores: torch.Tensor, ratio: float, alpha: float) -> torch.Tensor:
    """kvpress 0.5.5 ``AdaKVPress.compress`` on one layer's scores ``[B, H, N]`` (its code, as a keep mask)."""
    scores = scores.clone()
    bsz, heads, k_len = scores.shape
    n_kept = int(k_len * (1 - ratio))  # kvpress.utils.compute_n_kept
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    top = torch.topk(scores, n_safe, dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    n_pruned = heads * (k_len - n_kept)
    idx = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices
    keep = torch.ones(bsz, heads * k_len, dtype=torch.bool)
    keep.scatter_(1, idx, False)
    return keep.reshape(bsz, heads, k_len)


@pytest.mark.parametrize(("heads", "n", "ratio", "alpha"),
                         [(3, 64, 0.5, 0.2), (4, 100, 0.75, 0.2), (2, 37, 0.25, 0.5), (8, 50, 0.875, 0.0),
                          (3, 64, 0.5, 1.0)])
def test_adaptive_layer_keeps_what_kvpress_adakv_keeps(heads: int, n: int, ratio: float, alpha: float) -> None:
    g = torch.Generator().manual_seed(heads * 1000 + n)
    b, nl = 3, 4
    scores = torch.randn(b, nl, heads, n, generator=g)  # distinct: kvpress's topk has no tie rule
    lengths = torch.full((b,), n)
    budget = torch.full((b,), int(n * (1 - ratio)))
    pins = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    counts, over = allocate_counts(scores, lengths, pins, budget, AdaptiveLayer(floor=alpha))
    keep = select_counts(scores, lengths, pins, counts)
    for layer in range(nl):
        want = kvpress_adakv_keep(scores[:, layer], ratio, alpha)
        assert torch.equal(keep[:, layer], want), layer
    assert int(over.sum()) == 0
    assert torch.equal(keep.sum(-1), counts)
    if alpha < 1.0:
        assert bool((counts != counts[..., :1]).any()), "the rows should keep unequal numbers of tokens"


def test_adaptive_floor_one_is_uniform() -> None:
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 3, 4, 40, generator=g)
    lengths, budget = torch.tensor([40, 31]), torch.tensor([12, 20])
    pins = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    ada, _ = allocate_counts(scores, lengths, pins, budget, AdaptiveLayer(floor=1.0))
    uni, _ = allocate_counts(scores, lengths, pins, budget, Uniform())
    assert torch.equal(ada, uni)


VALUES = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, float("nan"), -0.0])  # ties, NaN and -0.0 on purpose


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes, lengths and budgets drawn; scores and pins from a drawn seed (cheap to generate)."""
    b, nl, h, n = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = VALUES[torch.randint(len(VALUES), (b, nl, h, n), generator=g)]
    pins = torch.rand(b, nl, h, n, generator=g) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    lengths = torch.tensor(draw(st.lists(st.integers(0, n), min_size=b, max_size=b)))
    budget = torch.tensor(draw(st.lists(st.integers(0, n + 2), min_size=b, max_size=b)))
    return scores, lengths, pins, budget


ALLOCATIONS = [Uniform(), AdaptiveLayer(floor=0.0), AdaptiveLayer(floor=0.2), AdaptiveLayer(floor=0.7),
               GlobalAllocation(floor=0.0), GlobalAllocation(floor=0.3)]


def _contracts(scores: torch.Tensor, lengths: torch.Tensor, pins: torch.Tensor, budget: torch.Tensor) -> None:
    b, nl, h, n = scores.shape
    valid = torch.arange(n) < lengths[:, None, None, None]
    k = torch.minimum(lengths, budget)
    for alloc in ALLOCATIONS:
        counts, over = allocate_counts(scores, lengths, pins, budget, alloc)
        keep = select_counts(scores, lengths, pins, counts)
        assert torch.equal(keep.sum(-1), counts)  # each row keeps its count
        assert not bool((keep & ~valid).any())  # never padding
        assert not bool((pins & valid & ~keep).any())  # every pin kept
        assert bool((counts <= lengths[:, None, None]).all())
        # the total is the budget's exactly, unless pins overflow it (then it is reported)
        assert torch.equal(counts.sum((1, 2)), nl * h * k + over)
        if isinstance(alloc, (AdaptiveLayer, GlobalAllocation)):
            floor = torch.where((k > 0) & (alloc.floor > 0), (k.double() * alloc.floor).long().clamp(min=1), 0)
            assert bool((counts >= torch.minimum(floor, lengths)[:, None, None]).all())
        for i in range(b):  # batch invariance: a request alone gets the counts it gets in the batch
            alone, _ = allocate_counts(scores[i:i + 1], lengths[i:i + 1], pins[i:i + 1], budget[i:i + 1], alloc)
            assert torch.equal(alone[0], counts[i])


def test_contracts_hold_for_every_allocation() -> None:
    settings(max_examples=150, deadline=None)(given(cases())(lambda c: _contracts(*c)))()


def _uniform_is_todays_selection(scores, lengths, pins, budget) -> None:  # noqa: ANN001
    b, nl, h, n = scores.shape
    counts, _ = allocate_counts(scores, lengths, pins, budget, Uniform())
    got = select_counts(scores, lengths, pins, counts)
    want = select(scores.reshape(b, nl * h, n), lengths, pins.reshape(b, nl * h, n), budget)
    assert torch.equal(got.reshape(b, nl * h, n), want)


def test_uniform_is_todays_selection_bit_for_bit() -> None:
    settings(max_examples=300, deadline=None)(given(cases())(lambda c: _uniform_is_todays_selection(*c)))()


def test_adaptive_layer_picks_the_layer_top_set_ties_to_the_lower_head() -> None:
    # the module doc's picture: H = 2, k = 4, floor 0.25
    s = torch.tensor([[[[9, 8, 7, 6, 2, 1], [5, 4, 3, 0, 0, 0]]]], dtype=torch.float32)
    pins = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    counts, _ = allocate_counts(s, torch.tensor([6]), pins, torch.tensor([4]), AdaptiveLayer(floor=0.25))
    assert counts.tolist() == [[[5, 3]]]
    # equal scores: the more recent token first, then (same score, same index) the lower head
    same = torch.ones(1, 1, 2, 4)
    counts, _ = allocate_counts(same, torch.tensor([4]), pins[..., :4], torch.tensor([2]), AdaptiveLayer(floor=0.0))
    assert counts.tolist() == [[[2, 2]]]
    assert select_counts(same, torch.tensor([4]), pins[..., :4], counts)[0, 0].tolist() == [[False, False, True, True]] * 2
    tie = torch.tensor([[[[5, 5], [5, 0]]]], dtype=torch.float32)  # h0 (5@1), then h0 (5@0) and h1 (5@0) tie
    counts, _ = allocate_counts(tie, torch.tensor([2]), pins[..., :2], torch.tensor([1]), AdaptiveLayer(floor=0.0))
    assert counts.tolist() == [[[2, 0]]]


def test_layer_schedule_totals_are_exact_and_linear_is_a_pyramid() -> None:
    sch = LayerSchedule.linear(30, ratio=20)
    assert sch.weights[0] == 20 and sch.weights[-1] == 1 and list(sch.weights) == sorted(sch.weights, reverse=True)
    for k in (0, 1, 7, 100, 1023):
        per = layer_counts(sch, 30, k)
        assert sum(per) == 30 * k and per == sorted(per, reverse=True)
    scores = torch.zeros(2, 3, 2, 50)
    counts, over = allocate_counts(scores, torch.tensor([50, 50]), torch.zeros(1, 1, 1, 50, dtype=torch.bool),
                                   torch.tensor([10, 4]), LayerSchedule(weights=(2, 1, 1)))
    assert counts[:, :, 0].tolist() == [[15, 8, 7], [6, 3, 3]] and over.tolist() == [0, 0]


@pytest.mark.parametrize(("kwargs", "field"), [({"floor": 1.5}, "floor"), ({"floor": -0.1}, "floor"),
                                               ({"floor": 0.2, "extra": 1}, "extra")])
def test_adaptive_layer_rejects_with_the_field_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        AdaptiveLayer(**kwargs)


@pytest.mark.parametrize("weights", [(), (1.0, -1.0), (0.0, 0.0), (1.0, float("nan")), (float("inf"),)])
def test_layer_schedule_rejects_bad_weights(weights: tuple[float, ...]) -> None:
    with pytest.raises(ValidationError, match="weights"):
        LayerSchedule(weights=weights)


def test_layer_counts_needs_one_weight_per_layer() -> None:
    with pytest.raises(ValueError, match="one per layer"):
        layer_counts(LayerSchedule(weights=(1.0, 2.0)), 3, 10)


def test_composite_keys_order_pins_scores_padding() -> None:
    s = torch.tensor([[[[0.5, float("nan"), 2.0, -0.0]]]])
    pins = torch.tensor([[[[False, True, False, False]]]])
    c = composite_keys(s, torch.tensor([3]), pins)[0, 0, 0]
    assert c[1] > c[2] > c[0] > c[3]  # the pin, then 2.0, then 0.5; index 3 is padding


def test_global_allocation_is_one_ranking_over_every_row() -> None:
    """GlobalAllocation == AdaptiveLayer over the request's L x H rows as one layer; the kept set is the
    request's top L x H x k keys beyond the floors, so rows of different layers end up with different counts."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 2, 30, generator=g) * torch.tensor([4.0, 1.0, 0.25])[None, :, None, None]
    lengths, budget = torch.tensor([30, 22]), torch.tensor([10, 6])
    pins = torch.zeros(1, 1, 1, 30, dtype=torch.bool)
    got, over = allocate_counts(scores, lengths, pins, budget, GlobalAllocation(floor=0.0))
    flat, _ = allocate_counts(scores.reshape(2, 1, 6, 30), lengths, pins, budget, AdaptiveLayer(floor=0.0))
    assert torch.equal(got.reshape(2, 1, 6), flat) and int(over.sum()) == 0
    assert got.sum((1, 2)).tolist() == [60, 36] and bool((got.sum(-1)[:, 0] > got.sum(-1)[:, 2]).all())
    keep = select_counts(scores, lengths, pins, got)
    for i in range(2):  # the request's top keys: every kept score above every dropped one (no floor, no pins)
        s, k = scores[i, ..., : int(lengths[i])], keep[i, ..., : int(lengths[i])]
        assert float(s[k].min()) > float(s[~k].max())
