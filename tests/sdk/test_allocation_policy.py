"""``@vt.policy(allocation=...)``: the decorator's checks, the torch backend's per-row selection, the contract
checks of ``vtoken-cli validate`` (and that they catch a broken mask), and PyramidKV's counts against kvpress's
``get_layer_budget``."""

from __future__ import annotations

import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from vtoken_sdk.allocation import allocate_counts, pyramid_counts, select_counts
from vtoken_sdk.checks import ContractViolation, _Fixed, prop_budget
from vtoken_sdk.testing import BatchSpec, build_batch
from vtoken_sdk.torch_backend import TorchPolicy


def _score(s: vt.TokenStats):  # noqa: ANN202
    return s.key_norm


def test_allocation_needs_head_granularity_and_a_score_function() -> None:
    with pytest.raises(vt.PolicyDefinitionError, match="granularity='head'") as e:
        vt.policy(budget=vt.Budget(ratio=0.5), allocation=vt.AdaptiveLayer())(_score)
    assert e.value.line is not None
    with pytest.raises(vt.PolicyDefinitionError, match="expected one of vt.Uniform"):
        vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", allocation="adakv")(_score)  # type: ignore[arg-type]
    p = vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")(_score)
    assert p.spec.uniform and isinstance(p.allocation, vt.Uniform)
    ada = p.configure(allocation=vt.AdaptiveLayer(floor=0.3))
    assert not ada.spec.uniform and ada.allocation.floor == 0.3 and "allocation=AdaptiveLayer" in repr(ada)
    with pytest.raises(vt.PolicyDefinitionError, match="granularity='head'"):
        ada.configure(granularity="request")
    with pytest.raises(vt.PolicyDefinitionError, match="floor"):
        p.configure(allocation={"kind": "adaptive_layer", "floor": 2.0})


def test_mask_policies_take_no_allocation() -> None:
    with pytest.raises(TypeError, match="allocation"):
        vt.mask_policy(budget=vt.Budget(ratio=0.5), allocation=vt.AdaptiveLayer())  # type: ignore[call-arg]
    m = vt.mask_policy(budget=vt.Budget(ratio=0.5), granularity="head")(lambda s, ctx: ctx.pins)
    with pytest.raises(vt.PolicyDefinitionError, match="mask policy"):
        m.configure(allocation=vt.AdaptiveLayer())


SPEC = BatchSpec(2, 3, 4, 60, (60, 41), (0, 9), "continuous", 3, True, ((0, 2, 6),), (30, 12))


@pytest.mark.parametrize("alloc", [vt.AdaptiveLayer(floor=0.2), vt.AdaptiveLayer(floor=0.0), vt.Pyramid(beta=3, window=2)])
def test_keep_mask_is_counts_then_each_rows_top(alloc: vt.Uniform) -> None:
    p = vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", protect=[vt.sinks(2)], allocation=alloc)(_score)
    batch = build_batch(SPEC, ("key_norm",))
    tp = TorchPolicy(p)
    scores, pins, budget = tp.scores(batch), tp.pins(batch), tp.budgets(batch)
    counts, _ = allocate_counts(scores, batch.lengths, pins, budget, alloc)
    mask = tp.keep_mask(batch)
    assert torch.equal(mask, select_counts(scores, batch.lengths, pins, counts))
    flat = counts.flatten(1)
    assert torch.equal(mask.sum(-1), counts) and bool((flat != flat[:, :1]).any())  # unequal rows
    assert tp.contract_violations(batch, mask) == [None, None]
    prop_budget(tp, batch)  # the validate check passes on the real mask


def test_the_validate_check_catches_a_broken_allocation() -> None:
    """Mutations of the mask: today's equal counts, a row's kept token swapped for a better dropped one."""
    p = vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", allocation=vt.AdaptiveLayer(floor=0.2))(_score)
    batch = build_batch(SPEC, ("key_norm",))
    tp = TorchPolicy(p)
    uniform = TorchPolicy(p.configure(allocation=vt.Uniform())).keep_mask(batch)
    with pytest.raises(ContractViolation, match="keeps"):
        prop_budget(_Fixed(tp, uniform), batch)
    assert any(x is not None for x in tp.contract_violations(batch, uniform))
    mask = tp.keep_mask(batch).clone()
    row = mask[0, 0, 0]
    kept, dropped = row.nonzero().flatten(), (~row[:60]).nonzero().flatten()
    scores = tp.scores(batch)[0, 0, 0]
    best_dropped = dropped[scores[dropped].argmax()]
    worst_kept = kept[scores[kept].argmin()]
    row[best_dropped], row[worst_kept] = True, False  # the same count, the wrong token
    with pytest.raises(ContractViolation, match="ranks above"):
        prop_budget(_Fixed(tp, mask), batch)


def kvpress_layer_budget(q_len: int, ratio: float, layer: int, num_layers: int, window: int = 64,
                         beta: float = 20) -> int:
    """kvpress 0.5.5 ``PyramidKVPress.get_layer_budget``, its code."""
    max_capacity_prompt = window + q_len * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return max(1, round(q_len * (1 - ratio)))
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(max_num - layer * steps)


@pytest.mark.parametrize(("q_len", "ratio"), [(3000, 0.5), (4096, 0.75), (4096, 0.875), (1000, 0.25), (600, 0.5),
                                              (200, 0.5), (130, 0.5), (64, 0.5), (2048, 0.5)])
@pytest.mark.parametrize("num_layers", [30, 1, 2])
def test_pyramid_counts_are_kvpress_get_layer_budget(q_len: int, ratio: float, num_layers: int) -> None:
    k = int(q_len * (1 - ratio))
    assert k == q_len * (1 - ratio)  # whole shares: there the two agree exactly (module doc)
    got = pyramid_counts(vt.Pyramid(), num_layers, q_len, k)
    assert got == [kvpress_layer_budget(q_len, ratio, i, num_layers) for i in range(num_layers)]


def test_shipped_unequal_policies_are_what_their_kvpress_twins_run() -> None:
    ada = vtoken_policies.load("ada_snapkv")
    assert ada.allocation == vt.AdaptiveLayer(floor=0.2)  # kvpress AdaKVPress(alpha_safeguard=0.20)
    assert ada.node == vtoken_policies.load("snapkv").node  # SnapKVPress's score
    pyr = vtoken_policies.load("pyramidkv")
    assert pyr.allocation == vt.Pyramid(beta=20, window=64) and pyr.node == vtoken_policies.load("snapkv").node
    ea = vtoken_policies.load("ada_expected_attention")
    assert ea.allocation == vt.AdaptiveLayer(floor=0.2) and ea.reads == vtoken_policies.load("expected_attention").reads
    assert set(vtoken_policies.uniform()) == set(vtoken_policies.names()) - {
        "ada_snapkv", "pyramidkv", "ada_expected_attention", "ada_snap_observed", "duo_attention"}
    aso = vtoken_policies.load("ada_snap_observed")
    assert aso.allocation == vt.AdaptiveLayer(floor=0.2) and aso.node == vtoken_policies.load("snap_observed").node


def test_the_validate_check_catches_a_per_layer_mask_under_global_allocation() -> None:
    """AdaptiveLayer's sets have the right total but not the request-wide top: the global check fails."""
    g = vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", allocation=vt.GlobalAllocation(floor=0.1))(_score)
    batch = build_batch(SPEC, ("key_norm",))
    tp = TorchPolicy(g)
    prop_budget(tp, batch)
    per_layer = TorchPolicy(g.configure(allocation=vt.AdaptiveLayer(floor=0.1))).keep_mask(batch)
    with pytest.raises(ContractViolation, match="ranks above"):
        prop_budget(_Fixed(tp, per_layer), batch)
