"""Per-row pages (issue 38): the page table's invariants R1-R4 and the row cache's moves, by example and by a
hypothesis state machine over rows of different lengths.

The machine drives a :class:`RowCache` over a tiny ``kv_all`` whose every written element encodes
``(row, position)``; after every step it checks the table (R1, R2, R4, PINS, block ownership against the
pool) and the data: each row's page slots hold exactly that row's live positions, in order (I1 on the
bytes), and paged row attention equals dense attention over each row's tokens.
``VTOKEN_PT_EXAMPLES`` (default 700: 2,100 sequences over 3 shapes) for the slow test,
``VTOKEN_PT_QUICK_EXAMPLES`` (default 40) for the fast suite.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from vtoken_runtime._debug import InvariantError
from vtoken_runtime.block_pool import BlockPool
from vtoken_runtime.page_table import PageTable, cdiv
from vtoken_runtime.paged_attention import dense_attention
from vtoken_runtime.row_cache import RowCache

MAX_EXAMPLES = int(os.environ.get("VTOKEN_PT_EXAMPLES", "700"))
QUICK_EXAMPLES = int(os.environ.get("VTOKEN_PT_QUICK_EXAMPLES", "40"))


def test_docstring_example_layout() -> None:
    """The picture in page_table.py: L = H = 2, bs = 4, blocks [7, 3]."""
    t = PageTable(2, 2, 4, max_requests=2, debug=True)
    t.add("a", np.zeros(0, np.int64))
    pos = [np.array([0, 2, 3, 5, 8, 9]), np.array([1, 8, 9]), np.array([0, 1, 2, 3, 9]), np.array([4, 9])]
    slots, surplus = t.adopt("a", pos, [7, 3, 5], logical_len=10)
    st_ = t.get("a")
    assert surplus == [5] and st_.blocks == [7, 3]
    assert st_.pages == [[12, 13], [14], [15, 28], [29]] and sorted(st_.free) == [30, 31]
    assert slots[0].tolist() == [48, 49, 50, 51, 52, 53]
    assert t.ideal_blocks("a") == {"pages": 2, "per_layer": 2, "max_row": 2}
    # page slot -> the cache element of the uniform layout: page 12 = block 3, layer 0, head 0
    assert [x.tolist() for x in t.page_slot_address(np.array([12 * 4 + 1]))] == [[0], [3], [1], [0]]


def test_evict_repacks_pages_out_of_the_emptiest_block_and_frees_it() -> None:
    t = PageTable(1, 2, 4, max_requests=1, debug=True)  # P = 2 pages per block
    t.add("a", np.zeros(0, np.int64))
    t.adopt("a", [np.arange(8), np.arange(8)], [0, 1], logical_len=8)  # rows: pages [0, 1], [2, 3]
    keep = [np.zeros(8, bool), np.ones(8, bool)]
    keep[0][[1, 6]] = True  # row 0 keeps 2 tokens (1 page), row 1 all 8 (2 pages): 3 pages -> 2 blocks, no change
    plan = t.evict("a", keep)
    assert plan.freed == [] and t.get("a").pages[0] == [0] and plan.tokens_evicted == 6
    assert plan.src.tolist() == [1, 6] and plan.dst.tolist() == [0, 1]  # positions 1, 6 slide to slots 0, 1
    keep = [np.ones(2, bool), np.zeros(8, bool)]
    keep[1][:3] = True  # 1 + 1 pages: 1 block
    plan = t.evict("a", keep)
    assert len(plan.freed) == 1 and t.held_blocks("a") == 1
    assert t.ideal_blocks("a")["pages"] == 1


def test_evict_keeps_the_blocks_tensor_parallel_ranks_agreed_on() -> None:
    t = PageTable(1, 2, 4, max_requests=1, debug=True, release="tail")  # P = 2 pages per block
    t.add("a", np.zeros(0, np.int64))
    t.adopt("a", [np.arange(16), np.arange(16)], [0, 1, 2, 3], logical_len=16)  # 8 pages: 4 blocks
    keep = [np.zeros(16, bool), np.zeros(16, bool)]
    keep[0][:2] = keep[1][:2] = True  # 2 pages: 1 block needed
    plan = t.evict("a", keep, hold=3)  # another rank needs 3
    assert plan.freed == [3] and t.held_blocks("a") == 3
    with pytest.raises(ValueError, match="hold"):
        t.evict("a", [np.ones(2, bool), np.ones(2, bool)], hold=-1)
    plan = t.evict("a", [np.ones(2, bool), np.ones(2, bool)])  # no hold: down to the need
    assert plan.freed == [1, 2] and t.held_blocks("a") == 1


def test_misuse_raises_and_changes_nothing() -> None:
    with pytest.raises(ValueError, match="release must be 'emptiest' or 'tail'"):
        PageTable(1, 2, 4, max_requests=1, release="fullest")
    t = PageTable(1, 2, 4, max_requests=1, debug=True)
    t.add("a", np.array([0]))
    with pytest.raises(ValueError, match="pinned"):
        t.adopt("a", [np.arange(1, 5), np.arange(5)], [0, 1], logical_len=5)
    assert not t.get("a").blocks
    with pytest.raises(ValueError, match="ascending"):
        t.adopt("a", [np.array([0, 0, 2]), np.arange(5)], [0, 1], logical_len=5)
    t.adopt("a", [np.arange(5), np.arange(5)], [0, 1], logical_len=5)
    before = [p.copy() for p in t.get("a").pos]
    with pytest.raises(ValueError, match="pinned"):
        t.evict("a", [np.array([False, True, True, True, True]), np.ones(5, bool)])
    with pytest.raises(ValueError, match="bool"):
        t.evict("a", [np.ones(4, bool), np.ones(5, bool)])
    assert all((a == b).all() for a, b in zip(before, t.get("a").pos, strict=True))
    with pytest.raises(ValueError, match="needs 2 new blocks"):
        t.reserve("a", 8, [])
    with pytest.raises(ValueError, match="unknown"):
        t.get("b")


def test_a_broken_invariant_is_an_invariant_error() -> None:
    t = PageTable(1, 1, 4, max_requests=1, debug=True)
    t.add("a", np.zeros(0, np.int64))
    t.adopt("a", [np.arange(5)], [0, 1], logical_len=5)
    t.get("a").pages[0].append(t.get("a").pages[0][0])  # corrupt: a page listed twice, one too many
    with pytest.raises(InvariantError, match="I2"):
        t.check_request(t.get("a"))


class RowMachine(RuleBasedStateMachine):
    """A RowCache whose K holds ``1000 * row + position + 1`` at every live token (0 = never written)."""

    L, H, BS, NB, MAX_REQ, G = 2, 2, 4, 10, 3, 2
    RELEASE = "emptiest"

    def __init__(self) -> None:
        super().__init__()
        self.kv = torch.zeros(self.L, 2, self.NB, self.BS, self.H, 2)
        self.pool = BlockPool(self.NB)
        self.rc = RowCache(self.kv, self.pool, self.MAX_REQ, debug=True, release=self.RELEASE)
        self.R = self.L * self.H
        self.model: dict[int, list[np.ndarray]] = {}  # request -> live positions per row
        self.pins: dict[int, np.ndarray] = {}
        self.next_id = 0

    def _write(self, slots: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> None:
        layer, blk, off, head = (torch.as_tensor(x) for x in self.rc.table.page_slot_address(slots))
        code = torch.as_tensor(1000 * rows + pos + 1, dtype=torch.float32)
        self.kv[layer, 0, blk, off, head, 0] = code
        self.kv[layer, 1, blk, off, head, 0] = -code
        self.kv[layer, 0, blk, off, head, 1] = torch.as_tensor(np.sin(pos + rows), dtype=torch.float32)
        self.kv[layer, 1, blk, off, head, 1] = torch.as_tensor(np.cos(pos * 0.3 + rows), dtype=torch.float32)

    @precondition(lambda self: len(self.model) < self.MAX_REQ)
    @rule(n=st.integers(1, 30), data=st.data())
    def adopt(self, n: int, data: st.DataObject) -> None:
        """A request arrives from the uniform cache: ``n`` tokens in ``ceil(n / bs)`` of its blocks, each row
        keeping its own subset (the pins in every row)."""
        blocks = self.pool.allocate(cdiv(n, self.BS))
        if blocks is None:
            return
        rid = self.next_id
        self.next_id += 1
        pins = np.unique(np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=2)), np.int64))
        # uniform layout: position p of row r at block blocks[p // bs], offset p % bs
        kept, src = [], []
        for r in range(self.R):
            mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
            mask[pins] = True
            p = np.flatnonzero(mask).astype(np.int64)
            b = np.asarray(blocks, np.int64)[p // self.BS]
            g = self.rc.table.row_page_slots(b, p % self.BS, np.full(p.size, r))
            self._write(g, np.full(p.size, r), p)
            kept.append(p)
            src.append(g)
        # hold: blocks to keep beyond the rows' need (tensor-parallel ranks agree on the larger count)
        hold = data.draw(st.integers(0, len(blocks)))
        freed = self.rc.adopt(rid, pins, kept, src, list(blocks), n, hold=hold)
        assert freed == len(blocks) - self.rc.held_blocks(rid)
        assert self.rc.held_blocks(rid) >= hold
        self.model[rid], self.pins[rid] = kept, pins

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), n=st.integers(1, 6))
    def reserve(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        start = self.rc.logical_len(rid)
        slots = self.rc.reserve(rid, n)
        if slots is None:
            assert self.pool.num_free < self.rc.table.blocks_needed(rid, n)
            return
        for r in range(self.R):
            self._write(slots[r], np.full(n, r), np.arange(start, start + n))
            self.model[rid][r] = np.concatenate([self.model[rid][r], np.arange(start, start + n)])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), n=st.integers(1, 6), extra=st.integers(1, 2))
    def reserve_with_spare_blocks(self, data: st.DataObject, n: int, extra: int) -> None:
        """vLLM gave more blocks than these rows need (another tensor-parallel rank needed one): the rest are
        held as free pages (``hold``) and used by later tokens before any new block."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        start = self.rc.logical_len(rid)
        need = self.rc.table.blocks_needed(rid, n)
        new = self.pool.allocate(need + extra)
        if new is None:
            return
        before = self.rc.held_blocks(rid)
        slots = self.rc.table.reserve(rid, n, new, spare=True)[0]
        assert self.rc.held_blocks(rid) == before + need + extra
        for r in range(self.R):
            self._write(slots[r], np.full(n, r), np.arange(start, start + n))
            self.model[rid][r] = np.concatenate([self.model[rid][r], np.arange(start, start + n)])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        keep = []
        for r in range(self.R):
            p = self.model[rid][r]
            k = np.asarray(data.draw(st.lists(st.booleans(), min_size=p.size, max_size=p.size)), bool)
            keep.append(k | np.isin(p, self.pins[rid]))
        moved_before = self.rc.table.get(rid).tokens_moved
        blocks_before = list(self.rc.table.get(rid).blocks)
        # hold: tensor-parallel ranks keep the larger count (the decode re-eviction of streaming rows)
        hold = data.draw(st.integers(0, len(blocks_before)))
        plan = self.rc.evict(rid, keep, hold=hold)
        need = -(-sum(-(-int(k.sum()) // self.rc.block_size) for k in keep) // self.rc.table.pages_per_block)
        assert self.rc.held_blocks(rid) == max(need, hold)
        assert plan.num_moves == self.rc.table.get(rid).tokens_moved - moved_before
        if self.RELEASE == "tail":  # the freed blocks are the list's tail: the owner truncates
            kept = self.rc.table.get(rid).blocks
            assert blocks_before[:len(kept)] == kept and plan.freed == blocks_before[len(kept):]
        self.model[rid] = [p[k] for p, k in zip(self.model[rid], keep, strict=True)]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def bad_evict_changes_nothing(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        keep = [np.ones(p.size + 1, bool) for p in self.model[rid]]
        with pytest.raises(ValueError):
            self.rc.evict(rid, keep)

    @precondition(lambda self: bool(self.model) and len(self.model) < self.MAX_REQ)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A copy in new blocks: the same rows, and (the bytes invariant) the same data at its own slots."""
        src = data.draw(st.sampled_from(sorted(self.model)))
        dst = self.next_id
        self.next_id += 1
        if not self.rc.fork(src, dst):
            assert self.pool.num_free < self.rc.held_blocks(src)
            return
        self.model[dst] = [p.copy() for p in self.model[src]]
        self.pins[dst] = self.pins[src]
        mine = set(self.rc.table.get(dst).blocks)
        assert not mine & set(self.rc.table.get(src).blocks)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        held = self.rc.held_blocks(rid)
        assert self.rc.free(rid) == held
        del self.model[rid]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def attend(self, data: st.DataObject) -> None:
        """Row attention for every request of a layer equals dense attention over each head's own tokens."""
        rids = sorted(self.model)
        layer = data.draw(st.integers(0, self.L - 1))
        q = torch.randn(len(rids), 1, self.H * self.G, 2, generator=torch.Generator().manual_seed(len(rids)))
        out = self.rc.attention(layer, q, rids, torch.ones(len(rids), dtype=torch.int64))
        for b, rid in enumerate(rids):
            for h in range(self.H):
                p = self.model[rid][layer * self.H + h]
                if not p.size:
                    assert out[b, 0, h * self.G:(h + 1) * self.G].abs().max() == 0
                    continue
                r = layer * self.H + h
                keys = torch.stack([torch.as_tensor(1000.0 * r + p + 1), torch.as_tensor(np.sin(p + r))], -1).float()
                vals = torch.stack([torch.as_tensor(-(1000.0 * r + p + 1)),
                                    torch.as_tensor(np.cos(p * 0.3 + r))], -1).float()
                ref = dense_attention(q[b, :, h * self.G:(h + 1) * self.G], keys[None], vals[None],
                                      torch.tensor([10**6]), torch.as_tensor(p)[None])
                torch.testing.assert_close(out[b, :, h * self.G:(h + 1) * self.G], ref, rtol=1e-4, atol=1e-3)

    @invariant()
    def table_and_pool(self) -> None:
        held = {b for rid in self.model for b in self.rc.table.get(rid).blocks}
        self.rc.table.check_all(held)
        assert self.pool.num_used == len(held)
        for rid, rows in self.model.items():
            stt = self.rc.table.get(rid)
            assert all((a == b).all() for a, b in zip(stt.pos, rows, strict=True)), f"positions of {rid}"
            assert stt.pinned.size == 0 or all(np.isin(stt.pinned[stt.pinned < stt.logical_len], p).all()
                                               for p in stt.pos)

    @invariant()
    def bytes_follow_the_tokens(self) -> None:
        """I1 on the data: each row's page slots hold its own positions, in slot order."""
        for rid, rows in self.model.items():
            stt = self.rc.table.get(rid)
            for r, p in enumerate(rows):
                g = self.rc.table.slots(stt, r)
                layer, blk, off, head = (torch.as_tensor(x) for x in self.rc.table.page_slot_address(g))
                got = self.kv[layer, 0, blk, off, head, 0].numpy()
                assert (got == 1000 * r + p + 1).all(), f"request {rid} row {r}: {got[:6]} vs {p[:6]}"


SETTINGS = settings(max_examples=MAX_EXAMPLES, stateful_step_count=25, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SHAPES = {"L2H2": (2, 2, 4), "L3H1": (3, 1, 4), "L1H3bs2": (1, 3, 2)}


def _machine(name: str, release: str = "emptiest") -> type[RowMachine]:
    L, H, BS = SHAPES[name]
    return type(f"RowMachine_{name}_{release}", (RowMachine,), {"L": L, "H": H, "BS": BS, "RELEASE": release})


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_row_state_machine(shape: str) -> None:
    run_state_machine_as_test(_machine(shape), settings=SETTINGS)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_row_state_machine_quick(shape: str) -> None:
    run_state_machine_as_test(_machine(shape), settings=settings(SETTINGS, max_examples=QUICK_EXAMPLES))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_row_state_machine_releasing_the_tail(shape: str) -> None:
    """``release="tail"`` (what vLLM's block list needs): every invariant, the bytes, and every eviction frees
    exactly the tail of the request's block list."""
    run_state_machine_as_test(_machine(shape, "tail"), settings=settings(SETTINGS, max_examples=4 * QUICK_EXAMPLES))
