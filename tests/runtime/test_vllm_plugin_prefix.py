"""The frozen-prefix rule of prefix caching with eviction (``vtoken_runtime.vllm_plugin.prefix``; no vLLM
needed), and ``EvictionDriver.freeze_prefix`` on a real cache: the pins it adds hold through evictions and
compaction, and the budget still counts them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.vllm_plugin.prefix import NEVER, first_evicted, frozen_in_place, frozen_tokens


@given(st.integers(0, 5000), st.integers(0, 5000), st.sampled_from([1, 16, 32]))
def test_frozen_tokens_is_whole_blocks_below_both_bounds(computed: int, first: int, bs: int) -> None:
    f = frozen_tokens(computed, first, bs)
    assert f % bs == 0 and f <= min(computed, first) < f + bs
    assert frozen_tokens(computed, NEVER, bs) == computed // bs * bs


def test_frozen_tokens_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        frozen_tokens(-1, 0, 16)
    with pytest.raises(ValueError):
        frozen_tokens(10, 0, 0)


@settings(max_examples=200)
@given(st.integers(1, 60), st.integers(1, 4), st.data())
def test_first_evicted_is_the_smallest_position_missing_from_any_row(n: int, rows: int, data: st.DataObject) -> None:
    """Against the definition, over rows that keep equal counts of distinct positions (the token table's rows)."""
    total = n + data.draw(st.integers(0, 20))
    pos = np.stack([np.sort(np.asarray(data.draw(st.permutations(range(total)))[:n])) for _ in range(rows)])
    want = min(min(set(range(total + 1)) - set(r.tolist())) for r in pos)
    assert first_evicted(pos) == want


def test_frozen_in_place_checks_positions_and_slots() -> None:
    bs, blocks = 4, np.array([7, 2, 9])
    pos = np.tile(np.arange(10), (2, 1))
    phys = np.tile(np.concatenate([7 * bs + np.arange(4), 2 * bs + np.arange(4), 9 * bs + np.arange(2)]), (2, 1))
    assert frozen_in_place(pos, phys, blocks, 8, bs) and frozen_in_place(pos, phys, blocks, 0, bs)
    moved = phys.copy()
    moved[1, 5] = 9 * bs + 3  # a frozen token moved in one row
    assert not frozen_in_place(pos, moved, blocks, 8, bs) and frozen_in_place(pos, moved, blocks, 4, bs)
    gone = pos.copy()
    gone[0, 3:] += 1  # position 3 evicted in one row
    assert not frozen_in_place(gone, phys, blocks, 4, bs)


def test_freeze_prefix_pins_hold_through_evictions_and_the_budget_counts_them() -> None:
    """A real cache and driver (policy keeping the most recent tokens): after ``freeze_prefix(r, 64)`` no eviction
    touches positions below 64 nor moves them; the budget (here 40 tokens) is not shifted: the request keeps its
    64 frozen tokens and nothing else; freezing is monotone; freezing an evicted position is refused."""
    import vtoken_sdk as vt
    from vtoken_runtime.cache import VTokenCache
    from vtoken_runtime.eviction import EvictionDriver

    @vt.policy(budget=vt.Budget(tokens=40))
    def recent(s: vt.TokenStats):
        return s.position.float()

    bs = 16
    cache = VTokenCache(num_layers=2, num_kv_heads=2, head_size=8, block_size=bs, num_blocks=32, debug=True)
    drv = EvictionDriver(cache)
    cache.add_request("r", None)
    drv.add("r", recent)
    assert cache.reserve("r", 100) is not None
    assert drv.freeze_prefix("r", 64) and not drv.freeze_prefix("r", 32)
    blocks = list(cache.table.get("r").blocks)
    drv.step(["r"], "prefill")
    pos, phys = cache.live_slots("r")
    assert pos.shape[1] == 64 and frozen_in_place(pos, phys, np.asarray(blocks), 64, bs)
    assert cache.reserve("r", 30) is not None
    drv.step(["r"], "decode")
    pos, _ = cache.live_slots("r")
    assert pos.shape[1] == 64 and (pos == np.arange(64)).all()
    with pytest.raises(ValueError):
        drv.freeze_prefix("r", 96)  # positions 64.. were evicted
    assert drv.requests["r"].frozen == 64
