"""TokenTable.live_view: the sort-free path equals the stable-argsort path on every table layout."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.token_table import RequestState, TokenTable


def _state(rows: int, cache_len: int, logical: int, live: int, extra: int, seed: int) -> RequestState:
    """A request whose ``rows`` rows each hold ``live`` live tokens at distinct true positions below
    ``logical``, scattered over the first ``cache_len`` virtual slots (holes between them), capacity
    ``cache_len + extra``."""
    rng = np.random.default_rng(seed)
    s = RequestState(req_id="r", row=0, num_rows=rows, block_size=4, pinned=np.zeros(0, np.int64))
    s.grow(cache_len + extra)
    for r in range(rows):
        slots = rng.permutation(cache_len)[:live]
        s.pos[r, slots] = np.sort(rng.choice(logical, live, replace=False))[rng.permutation(live)]
        s.live[r, slots] = True
        dead = np.setdiff1d(np.arange(cache_len), slots)
        s.pos[r, dead] = rng.integers(0, logical, dead.size)  # dead slots keep stale positions
    s.cache_len, s.logical_len, s.num_live = cache_len, logical, live
    return s


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 12), cache_len=st.integers(0, 60), wide=st.integers(1, 6), frac=st.floats(0.0, 1.0),
       extra=st.integers(0, 9), seed=st.integers(0, 2**31 - 1))
def test_live_view_equals_sorted_view(rows: int, cache_len: int, wide: int, frac: float, extra: int, seed: int) -> None:
    logical = max(cache_len, 1) * wide  # wide > 4: the sort path; else the scatter path
    live = int(frac * cache_len)
    s = _state(rows, cache_len, logical, live, extra, seed)
    pos, vs = TokenTable.live_view(s)
    ref_pos, ref_vs = TokenTable.live_view_sorted(s)
    assert pos.shape == vs.shape == (rows, live)
    assert pos.dtype == ref_pos.dtype == np.int64 and vs.dtype == ref_vs.dtype == np.int64
    np.testing.assert_array_equal(pos, ref_pos)
    np.testing.assert_array_equal(vs, ref_vs)
    assert (np.diff(pos, axis=1) > 0).all()  # ascending by true position
    np.testing.assert_array_equal(np.take_along_axis(s.pos, vs, axis=1), pos)


def test_live_view_memo_follows_every_table_change() -> None:
    """The memoised view is read-only and is recomputed after reserve and mark_dead (the version bumps)."""
    t = TokenTable(num_rows=2, block_size=4, max_requests=2, max_blocks_per_request=8)
    t.add("a", np.zeros(0, np.int64))
    t.reserve("a", 6, [0, 1])
    pos, vs = t.live_view(t.get("a"))
    assert not pos.flags.writeable and not vs.flags.writeable
    assert t.live_view(t.get("a"))[0] is pos  # unchanged table: the memo
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 4, 5]] * 2)
    keep = np.ones((2, 6), bool)
    keep[0, 1] = keep[1, 4] = False
    t.mark_dead("a", keep)
    pos2, _ = t.live_view(t.get("a"))
    np.testing.assert_array_equal(pos2, [[0, 2, 3, 4, 5], [0, 1, 2, 3, 5]])
    t.reserve("a", 3, [2])
    pos3, _ = t.live_view(t.get("a"))
    np.testing.assert_array_equal(pos3, [[0, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 5, 6, 7, 8]])
    np.testing.assert_array_equal(pos3, TokenTable.live_view_sorted(t.get("a"))[0])
