"""Hypothesis state machine over random interleavings of the cache's operations.

Checked after every step (invariant): POOL (free + held == total, no leak / double owner), I2 (bookkeeping
uniqueness), pins never evicted, the logical view equals an independent model, compact/ordered block
counts (== ceil(live / bs) after reclaim), the Naive-Evict rule (independent per-token model), and -
whenever no copy plan is in flight - I1 (K/V bytes, stats and true positions of every live token equal
what was written). While a plan is in flight, I3 is checked instead: attention metadata without a
fence must raise. Moves <= evictions is checked at every reclaim in compact mode; attention over
the paged cache equals dense attention over the model's kept tokens at every ``attend`` step.

6 parametrizations (granularity x mode) x MAX_EXAMPLES sequences; K/V layout, async copies, the CPU copy
path (the numba single-pass kernel or the torch gather/scatter path) and a tiny copy chunk (forcing many
chunks of the torch path, which the ordered-mode overlap argument depends on) are drawn, and so is
``debug`` (the runtime's own invariant checks after every operation, in about half the sequences). A
reclaim may be followed at once by a fence and a read of every token (a fence that does not wait for the
copies shows there). Only public API is used: the copy path is chosen through the constructor's
``copy_path`` (or, where the constructor lacks it, the documented ``VTOKEN_CPU_COPY`` read at construction).

Example counts: ``VTOKEN_SM_EXAMPLES`` (default 350: 2,100 sequences in ``make test``) for the slow test,
``VTOKEN_SM_QUICK_EXAMPLES`` (default 60) for the quick one that the fast suite runs.
"""

from __future__ import annotations

import inspect
import itertools
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.paged_attention import dense_attention

from ._runtime_helpers import cdiv, kv_values, stat_values

L, H, D, BS, NB, MAX_REQ, MAX_LEN, GQA = 2, 2, 2, 4, 12, 4, 160, 2
MAX_EXAMPLES = int(os.environ.get("VTOKEN_SM_EXAMPLES", "350"))  # x 6 parametrizations = 2,100 sequences
QUICK_EXAMPLES = int(os.environ.get("VTOKEN_SM_QUICK_EXAMPLES", "60"))  # x 6, the fast suite
STEPS = int(os.environ.get("VTOKEN_SM_STEPS", "30"))


COPY_PATHS = ("torch", "numba")
_HAS_COPY_PATH = "copy_path" in inspect.signature(VTokenCache).parameters


def make_cache(copy_path: str, **kw: object) -> VTokenCache:
    """A cache whose CPU copy engine takes ``copy_path``: the ``copy_path`` constructor argument, or the
    documented ``VTOKEN_CPU_COPY`` environment variable (read when the engine is built) where the
    constructor does not have it yet."""
    if _HAS_COPY_PATH:
        return VTokenCache(L, H, D, BS, NB, copy_path=copy_path, **kw)  # type: ignore[arg-type]
    old = os.environ.get("VTOKEN_CPU_COPY")
    os.environ["VTOKEN_CPU_COPY"] = copy_path
    try:
        return VTokenCache(L, H, D, BS, NB, **kw)  # type: ignore[arg-type]
    finally:
        if old is None:
            del os.environ["VTOKEN_CPU_COPY"]
        else:
            os.environ["VTOKEN_CPU_COPY"] = old


class ModelRequest:
    """Independent model of one request: liveness per (row, position) and Naive-Evict blocks."""

    def __init__(self, uid: int, pins: set[int], rows: int) -> None:
        self.uid = uid
        self.pins = pins
        self.rows = rows
        self.logical_len = 0
        self.live = np.zeros((rows, 0), dtype=bool)
        self.naive_blocks: list[list[int]] = []  # per-token Python on purpose: independent of the runtime
        self.dirty = False

    def append(self, n: int) -> np.ndarray:
        p = np.arange(self.logical_len, self.logical_len + n)
        self.live = np.concatenate([self.live, np.ones((self.rows, n), bool)], axis=1)
        for q in p.tolist():
            if self.naive_blocks and len(self.naive_blocks[-1]) < BS:
                self.naive_blocks[-1].append(q)
            else:
                self.naive_blocks.append([q])
        self.logical_len += n
        return p

    def live_positions(self) -> np.ndarray:
        """[R, n] ascending per row."""
        return np.stack([np.nonzero(self.live[r])[0] for r in range(self.rows)]) if self.rows else None

    def naive_reclaim(self) -> None:
        any_live = self.live.any(axis=0)
        self.naive_blocks = [b for b in self.naive_blocks if any(any_live[q] for q in b)]
        self.dirty = False


class CacheMachine(RuleBasedStateMachine):
    GRAN = "request"
    MODE = "compact"

    @initialize(layout=st.sampled_from(["generic", "vllm_cpu"]), async_copy=st.booleans(),
                chunk=st.sampled_from([8, 64, 1 << 20]), copy_path=st.sampled_from(COPY_PATHS),
                debug=st.booleans())
    def setup(self, layout: str, async_copy: bool, chunk: int, copy_path: str, debug: bool) -> None:
        # debug: the runtime's own checks after every operation. Drawn, not always on: they run right
        # after a plan is submitted and give the copy worker time to land it, which hides a fence that
        # does not wait (measured: with debug always on such a race needed ~2x the examples to show).
        self.cache = make_cache(copy_path, granularity=self.GRAN, mode=self.MODE, kv_layout=layout,
                                stat_names=("acc",), max_requests=MAX_REQ, async_copy=async_copy, debug=debug,
                                copy_chunk_bytes=chunk)
        self.async_copy = async_copy
        self.plan_pending = False  # the model's view: a reclaim submitted moves and nothing fenced since
        self.R = self.cache.num_rows
        self.model: dict[str, ModelRequest] = {}
        self.uids = itertools.count(1)
        self.names = itertools.count()

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()

    # ------------------------------------------------------------------ helpers
    def _pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.model)))

    def _row(self, layer: int, head: int) -> int:
        return layer * H + head if self.R > 1 else 0

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.model) < MAX_REQ)
    @rule(data=st.data(), pins=st.sets(st.integers(0, 5), max_size=3), prefill=st.integers(0, 14))
    def add_request(self, data: st.DataObject, pins: set[int], prefill: int) -> None:
        rid = f"r{next(self.names)}"
        assert self.cache.add_request(rid, pinned_positions=sorted(pins)) is not None
        self.model[rid] = ModelRequest(next(self.uids), pins, self.R)
        if prefill:
            self._append(data, rid, prefill, split=prefill > 4)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.sampled_from([1, 2, 3, 5, 9]), split=st.booleans(), decode_all=st.booleans())
    def append_tokens(self, data: st.DataObject, n: int, split: bool, decode_all: bool) -> None:
        """A prefill chunk for one request (n > 1) or a decode step for one / all requests."""
        if decode_all:
            for rid in sorted(self.model):
                if rid in self.model:  # an earlier one may have been preempted
                    self._append(data, rid, 1, False)
        else:
            self._append(data, self._pick(data), n, split)

    def _append(self, data: st.DataObject, rid: str, n: int, split: bool) -> None:
        """Reserve, then write K/V and stats (in two parts when ``split``)."""
        m = self.model[rid]
        if m.logical_len + n > MAX_LEN:
            return
        c = self.cache
        if c.cache_len(rid) + n > NB * BS:  # past the block table (max_blocks_per_request = NB): misuse
            before = (c.cache_len(rid), c.logical_len(rid), c.held_blocks(rid), c.num_free_blocks)
            with pytest.raises(ValueError):
                c.reserve(rid, n)
            assert (c.cache_len(rid), c.logical_len(rid), c.held_blocks(rid), c.num_free_blocks) == before
            return
        need = cdiv(c.cache_len(rid) + n, BS) - c.held_blocks(rid)
        free_before = c.num_free_blocks
        slots = c.reserve(rid, n)
        if slots is None:
            assert need > free_before, "reserve returned None although blocks were free"
            if data.draw(st.booleans()):  # the scheduler preempts
                c.preempt(rid)
                del self.model[rid]
            return
        assert slots.shape == (n,)
        pos = m.append(n)
        cut = n // 2 if split and n > 1 else n
        for layer in range(L):
            k, v = kv_values(m.uid, layer, H, pos, D)
            c.write_kv(layer, rid, k[:cut], v[:cut])
            if cut < n:
                c.write_kv(layer, rid, k[cut:], v[cut:], offset=cut)
            c.scatter_stats("acc", layer, torch.as_tensor(slots), stat_values(m.uid, layer, H, pos))
        self.plan_pending = False  # write_kv / scatter_stats fence

    @precondition(lambda self: any(m.live.shape[1] and m.live[0].any() for m in self.model.values()))
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), try_bad=st.booleans(), then_reclaim=st.booleans(),
          read_now=st.booleans())
    def evict(self, data: st.DataObject, seed: int, try_bad: bool, then_reclaim: bool, read_now: bool) -> None:
        """A policy decision (random keep mask respecting pins), optionally reclaimed right away."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.model.items() if m.live[0].any())))
        m, c = self.model[rid], self.cache
        pos, _ = c.live_view(rid)
        R, n = pos.shape
        pinned = np.isin(pos, sorted(m.pins))
        n_pins = int(pinned[0].sum())
        rng = np.random.default_rng(seed)
        if try_bad:  # misuse: unequal counts or an evicted pin -> ValueError, nothing changes
            bad = np.ones((R, n), bool)
            if n_pins:
                bad[pinned] = False
            elif R > 1 and n > 1:
                bad[0, -1] = False
            else:
                bad = None
            if bad is not None:
                with pytest.raises(ValueError):
                    c.apply_keep_mask(rid, bad)
                assert (c.live_view(rid)[0] == pos).all()
        k = data.draw(st.integers(n_pins, n))
        score = rng.random((R, n)) + 2.0 * pinned
        order = np.argsort(-score, axis=1)[:, :k]
        keep = np.zeros((R, n), bool)
        np.put_along_axis(keep, order, True, axis=1)
        evicted = c.apply_keep_mask(rid, keep)
        assert evicted == int((~keep).sum())
        rows, cols = np.nonzero(~keep)
        m.live[rows, pos[rows, cols]] = False
        m.dirty = m.dirty or evicted > 0
        if then_reclaim:
            self._reclaim(None, read_now)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), subset=st.booleans(), read_now=st.booleans())
    def reclaim(self, data: st.DataObject, subset: bool, read_now: bool) -> None:
        ids = sorted(data.draw(st.sets(st.sampled_from(sorted(self.model)), min_size=1))) if subset else None
        self._reclaim(ids, read_now)

    def _reclaim(self, ids: list[str] | None, read_now: bool = False) -> None:
        """Reclaim; ``read_now``: fence and read the moved tokens at once (the fence must wait for the copies)."""
        c = self.cache
        targets = [r for r in (ids or self.model) if self.model[r].dirty]
        moved_before = c.tokens_moved_total
        stats = c.reclaim(ids)  # fences the previous plan, submits this one's moves
        self.plan_pending = self.async_copy and stats.tokens_moved > 0
        if read_now:  # e.g. the next attention: right behind the copies
            c.fence()
            self.plan_pending = False
            self._check_tokens(sorted(self.model))
        assert stats.requests == len(targets)
        assert c.tokens_moved_total - moved_before == stats.tokens_moved
        if self.MODE == "compact":
            assert stats.tokens_moved <= stats.tokens_evicted
        if self.MODE == "naive":
            assert stats.tokens_moved == 0
        for r in targets:
            self.model[r].naive_reclaim()
            live = int(self.model[r].live[0].sum())
            if self.MODE == "naive":
                assert c.held_blocks(r) == len(self.model[r].naive_blocks)
            else:
                assert c.held_blocks(r) == cdiv(live, BS) and c.cache_len(r) == live

    @rule()
    def fence(self) -> None:
        self.cache.fence()
        self.plan_pending = False
        assert not self.cache.in_flight

    @precondition(lambda self: any(m.live.shape[1] and m.live[0].any() for m in self.model.values()))
    @rule(data=st.data(), q=st.integers(1, 3), layer=st.integers(0, L - 1))
    def attend(self, data: st.DataObject, q: int, layer: int) -> None:
        """Paged attention over the cache == dense attention over the model's kept tokens."""
        cand = sorted(r for r, m in self.model.items() if m.live[0].any())
        ids = sorted(data.draw(st.sets(st.sampled_from(cand), min_size=1, max_size=2)))
        c = self.cache
        md = c.attention_metadata(ids)  # compact/ordered: reclaims requests with holes first; fences
        self.plan_pending = False
        if self.MODE != "naive":
            for r in ids:
                if self.model[r].dirty:
                    self.model[r].naive_reclaim()
        gen = torch.Generator().manual_seed(len(ids) * 7 + q)
        query = torch.randn(len(ids), q, H * GQA, D, generator=gen)
        qpos = torch.full((len(ids), q), -1, dtype=torch.int64)
        for b, r in enumerate(ids):
            ln = self.model[r].logical_len
            p = torch.arange(max(0, ln - q), ln)
            qpos[b, : p.numel()] = p
        out, probs = c.attention(layer, query, md, qpos, return_probs=True)
        for b, r in enumerate(ids):
            m = self.model[r]
            lp = m.live_positions()  # [R, n]
            rows = lp[layer * H:(layer + 1) * H] if self.R > 1 else np.repeat(lp, H, axis=0)
            ks, vs = zip(*[kv_values(m.uid, layer, H, rows[h], D) for h in range(H)], strict=True)
            keys = torch.stack([ks[h][:, h] for h in range(H)])  # [H, n, D]
            vals = torch.stack([vs[h][:, h] for h in range(H)])
            nq = int((qpos[b] >= 0).sum())
            ref = dense_attention(query[b, :nq], keys, vals, qpos[b, :nq], torch.as_tensor(rows))
            assert torch.allclose(out[b, :nq], ref, atol=1e-5, rtol=0), (out[b, :nq] - ref).abs().max()
        # probabilities of a query sum to 1 per query head (GQA per KV head), 0 if it sees no key
        tot = probs.sum(-1)
        assert bool(((tot - GQA).abs() < 1e-5).logical_or(tot == 0).all())

    @precondition(lambda self: self.model)
    @rule(data=st.data(), finish=st.booleans())
    def end_request(self, data: st.DataObject, finish: bool) -> None:
        """Preempt (for recompute) or finish a request; either returns every block it held."""
        rid = self._pick(data)
        c = self.cache
        held, free = c.held_blocks(rid), c.num_free_blocks
        assert (c.free(rid) if finish else c.preempt(rid)) == held
        assert c.num_free_blocks == free + held
        del self.model[rid]
        with pytest.raises(ValueError, match="unknown request"):
            c.free(rid)  # double free

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Unknown request / writing past the reservation -> ValueError; reading in flight -> I3."""
        c = self.cache
        with pytest.raises(ValueError, match="unknown request"):
            c.reserve("nope", 1)
        with pytest.raises(ValueError, match="unknown request"):
            c.live_view("nope")
        if self.model:
            rid = self._pick(data)
            k = torch.zeros(1, H, D)
            with pytest.raises(ValueError, match="past the"):
                c.write_kv(0, rid, k, k, offset=10_000)
            if c.in_flight:
                with pytest.raises(RuntimeError, match="I3 violated"):
                    c.attention_metadata(sorted(self.model)[:1], fence=False)

    # ------------------------------------------------------------------ invariants
    def _check_tokens(self, rids: list[str]) -> None:
        """I1: K/V bytes, stats and true positions of every live token equal what was written."""
        c = self.cache
        for rid in rids:
            m = self.model[rid]
            stats = c.gather_stats(rid, ["acc"])["acc"]
            for layer in range(L):
                kpos, k, v = c.gather_kv(layer, rid)
                for h in range(H):
                    p = kpos[h if kpos.shape[0] > 1 else 0].numpy()
                    ek, ev = kv_values(m.uid, layer, H, p, D)
                    assert torch.equal(k[h], ek[:, h]) and torch.equal(v[h], ev[:, h]), f"I1 K/V {rid} l{layer} h{h}"
                    assert torch.equal(stats[layer, h], stat_values(m.uid, layer, H, p)[h]), f"I1 stats {rid}"

    @invariant()
    def invariants(self) -> None:
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.check_invariants()
        assert c.num_free_blocks + sum(c.held_blocks(r) for r in self.model) == NB  # POOL
        assert sorted(c.request_ids) == sorted(self.model)
        for rid, m in self.model.items():
            pos, vslots = c.live_view(rid)
            exp = m.live_positions() if m.live.shape[1] else np.zeros((self.R, 0), np.int64)
            assert pos.shape == exp.shape and (pos == exp).all(), f"logical view of {rid} differs"
            present = [p for p in m.pins if p < m.logical_len]
            assert np.isin(present, pos).all() if pos.size else not present  # pins never evicted
            assert c.logical_len(rid) == m.logical_len and c.live_tokens(rid) == pos.shape[1]
            assert c.naive_held_blocks(rid) == len(m.naive_blocks)
            if self.MODE == "naive":
                assert c.held_blocks(rid) == len(m.naive_blocks)
            elif not m.dirty:
                assert c.held_blocks(rid) == cdiv(pos.shape[1], BS) <= len(m.naive_blocks)
                assert c.cache_len(rid) == pos.shape[1]
        if c.in_flight and self.model:  # I3: nobody may read the cache before the fence
            with pytest.raises(RuntimeError, match="I3 violated"):
                c.attention_metadata(sorted(self.model)[:1], fence=False)
        if self.plan_pending and c.in_flight:
            return  # keep the plan in flight: the next rules interleave with it
        c.fence()  # only deferred slot writes pending: no plan interleaving is lost
        self._check_tokens(sorted(self.model))
        if not self.model:
            return
        # true position per physical slot (key_positions) at the live slots, -1 at the dead ones (holes:
        # never attended); physical slots from the block tables the attention kernels read
        ids = sorted(self.model)
        md = c.attention_metadata(ids, reclaim_holes=False)  # fenced above: changes nothing
        bt = md.block_tables.numpy().astype(np.int64)
        for b, rid in enumerate(ids):
            pos, vs = c.live_view(rid)
            cache_len = c.cache_len(rid)
            for r in range(self.R):
                dead = np.setdiff1d(np.arange(cache_len), vs[r])
                for layer in ([r // H] if self.R > 1 else range(L)):
                    kp = c.key_positions(layer)[r % H if self.R > 1 else 0].numpy()
                    assert (kp[bt[b, vs[r] // BS] * BS + vs[r] % BS] == pos[r]).all(), f"positions {rid} row {r}"
                    assert (kp[bt[b, dead // BS] * BS + dead % BS] == -1).all(), f"dead slots {rid} row {r}"


# report_multiple_bugs=False: a planted bug breaks several checks at once; shrinking one of them is enough
SETTINGS = settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compact", "ordered", "naive"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_cache_state_machine(granularity: str, mode: str) -> None:
    machine = type(f"Machine_{granularity}_{mode}", (CacheMachine,), {"GRAN": granularity, "MODE": mode})
    run_state_machine_as_test(machine, settings=SETTINGS)


@pytest.mark.parametrize("mode", ["compact", "ordered", "naive"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_cache_state_machine_quick(granularity: str, mode: str) -> None:
    """A short run of the same machine for the fast suite (`-m "not slow"`)."""
    machine = type(f"Quick_{granularity}_{mode}", (CacheMachine,), {"GRAN": granularity, "MODE": mode})
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=QUICK_EXAMPLES))
