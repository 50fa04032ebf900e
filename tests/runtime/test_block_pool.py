"""Block pool: all-or-nothing allocation, None when exhausted, tail-first free, POOL invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.block_pool import BlockPool


def test_allocate_until_exhausted_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4, debug=True)
    a = pool.allocate(3)
    assert a is not None and len(a) == 3 and pool.num_free == 1
    assert pool.allocate(2) is None
    assert pool.num_free == 1  # all-or-nothing
    assert pool.allocate(1) is not None and pool.num_free == 0


def test_free_is_tail_first_and_double_free_raises() -> None:
    pool = BlockPool(6, debug=True)
    blocks = pool.allocate(6)
    assert blocks is not None
    pool.free(blocks[2:])  # tail 5, 4, 3, 2 re-enter the queue in that order
    assert pool.allocate(2) == [blocks[5], blocks[4]]
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[2], blocks[2]])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([99])


def test_refcount_sharing() -> None:
    pool = BlockPool(2, debug=True)
    (b,) = pool.allocate(1) or [None]
    pool.incref([b])
    pool.free([b])
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="incref of a free block"):
        pool.incref([b])


def test_corruption_names_the_invariant() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool._ref[3] = 1  # a free block with a reference
    with pytest.raises(RuntimeError, match="POOL violated: free queue and refcounts disagree"):
        pool.check()
    pool = BlockPool(4)
    held = pool.allocate(2)
    assert held is not None
    with pytest.raises(RuntimeError, match="POOL violated: owners and refcounts disagree"):
        pool.check(held=held[:1])  # a leaked block (referenced, owned by nobody)


def test_take_named_blocks_keeps_queue_order_and_refuses_held_ones() -> None:
    """``take`` (another allocator chose the blocks): exactly those blocks, the rest of the queue keeps its
    order; a held block or one named twice is an InvariantError (POOL) and nothing is taken."""
    from vtoken_runtime._debug import InvariantError

    pool = BlockPool(8, debug=True)
    pool.take([5, 2])
    assert pool.refcount(5) == pool.refcount(2) == 1 and pool.num_free == 6
    assert pool.allocate(3) == [0, 1, 3]
    for bad in ([4, 5], [6, 6]):
        with pytest.raises(InvariantError, match="POOL violated"):
            pool.take(bad)
        assert pool.num_free == 3 and pool.refcount(4) == 0 and pool.refcount(6) == 0
    with pytest.raises(ValueError, match="out of range"):
        pool.take([8])
    pool.free([5, 2])  # tail first: 2 then 5 re-enter after 4 6 7
    assert pool.allocate(5) == [4, 6, 7, 2, 5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_conservation_under_random_ops(ops: list[tuple[bool, int]]) -> None:
    pool = BlockPool(8, debug=True)
    owned: list[list[int]] = []
    for alloc, n in ops:
        if alloc:
            got = pool.allocate(n)
            if got is None:
                assert n > pool.num_free
            else:
                owned.append(got)
        elif owned:
            pool.free(owned.pop(n % len(owned)))
        pool.check(held=[b for o in owned for b in o])
        assert pool.num_free + sum(len(o) for o in owned) == 8
