"""Cache facade: the picture from the brief, misuse -> ValueError, broken invariants -> RuntimeError naming
the invariant, static device addresses, externally owned K/V tensors, the debug switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken_runtime._debug import debug_enabled
from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.copy_engine import CopyPlan

from ._runtime_helpers import kv_values


def make(**kw: object) -> VTokenCache:
    args: dict[str, object] = dict(num_layers=2, num_kv_heads=2, head_size=4, block_size=4, num_blocks=16,
                                   stat_names=("acc",), debug=True, max_requests=8)
    args.update(kw)
    return VTokenCache(**args)  # type: ignore[arg-type]


def fill(c: VTokenCache, rid: str, n: int, uid: int = 1) -> np.ndarray:
    slots = c.reserve(rid, n)
    assert slots is not None
    start = c.logical_len(rid) - n
    for layer in range(c.num_layers):
        k, v = kv_values(uid, layer, c.num_kv_heads, np.arange(start, start + n), c.head_size)
        c.write_kv(layer, rid, k, v)
    return slots


def test_architecture_picture_12_tokens_evict_6() -> None:
    """bs 4, 12 tokens, evict 6: naive keeps 3 blocks, vToken 2 = ceil(6/4)."""
    for mode, held in (("naive", 3), ("compact", 2), ("ordered", 2)):
        c = make(mode=mode)
        c.add_request("a")
        fill(c, "a", 12)
        keep = np.array([1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0], bool)  # [a x b x] [x c x d] [e x f x]
        c.apply_keep_mask("a", keep)
        stats = c.reclaim()
        c.fence()
        assert c.held_blocks("a") == held and c.naive_held_blocks("a") == 3
        assert c.num_free_blocks == 16 - held
        if mode == "compact":
            assert stats.tokens_moved <= 6 and stats.blocks_freed == 1
        pos, _ = c.live_view("a")
        assert pos.tolist() == [[0, 2, 5, 7, 8, 10]]


def test_misuse_raises_value_error() -> None:
    c = make(granularity="head")
    with pytest.raises(ValueError, match="unknown request 'x'"):
        c.reserve("x", 1)
    c.add_request("a", pinned_positions=[0, 1])
    with pytest.raises(ValueError, match="already exists"):
        c.add_request("a")
    fill(c, "a", 6)
    k = torch.zeros(7, 2, 4)
    with pytest.raises(ValueError, match="past the 6 slots reserved"):
        c.write_kv(0, "a", k, k)
    with pytest.raises(ValueError, match="must be \\[T, 2, 4\\]"):
        c.write_kv(0, "a", torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="layer 5 out of range"):
        c.write_kv(5, "a", k[:1], k[:1])
    R = c.num_rows
    with pytest.raises(ValueError, match="shape"):
        c.apply_keep_mask("a", np.ones((R, 5), bool))
    with pytest.raises(ValueError, match="must be bool"):
        c.apply_keep_mask("a", np.ones((R, 6), np.int64))
    uneven = np.ones((R, 6), bool)
    uneven[0, 3] = False
    with pytest.raises(ValueError, match="same number of tokens"):
        c.apply_keep_mask("a", uneven)
    pin = np.ones((R, 6), bool)
    pin[:, 1] = False
    with pytest.raises(ValueError, match="pinned position"):
        c.apply_keep_mask("a", pin)
    assert c.live_tokens("a") == 6  # rejected masks changed nothing
    ok = np.ones((R, 6), bool)
    ok[:, 4] = False
    c.apply_keep_mask("a", ok)
    with pytest.raises(ValueError, match="past the 0 slots"):  # a keep mask invalidates the reservation
        c.write_kv(0, "a", k[:1], k[:1])
    with pytest.raises(ValueError, match="negative"):
        c.reserve("a", -1)
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        c.reserve("a", 10_000)
    c.free("a")
    with pytest.raises(ValueError, match="unknown request 'a'"):
        c.free("a")  # freeing twice
    with pytest.raises(ValueError, match="unknown granularity"):
        make(granularity="token")
    with pytest.raises(ValueError, match="unknown mode"):
        make(mode="lazy")


def test_out_of_blocks_returns_none_and_changes_nothing() -> None:
    c = make(num_blocks=3)
    c.add_request("a")
    c.add_request("b")
    fill(c, "a", 9)  # 3 blocks
    assert c.reserve("b", 1) is None
    assert c.held_blocks("b") == 0 and c.logical_len("b") == 0 and c.num_free_blocks == 0
    assert c.preempt("a") == 3
    assert c.reserve("b", 1) is not None
    c.add_request("a")  # re-added for recompute
    assert c.logical_len("a") == 0
    full = make(max_requests=1)
    full.add_request("x")
    assert full.add_request("y") is None


def test_broken_invariants_raise_runtime_error_naming_them() -> None:
    c = make()
    c.add_request("a")
    c.add_request("b")
    fill(c, "a", 5)
    fill(c, "b", 5)
    c.check_invariants()
    sa, sb = c.table.get("a"), c.table.get("b")

    saved = sb.blocks[0]
    sb.blocks[0] = sa.blocks[0]  # two requests own one block (and one block leaks)
    with pytest.raises(RuntimeError, match="POOL violated"):
        c.check_invariants()
    sb.blocks[0] = saved

    sa.pos[0, 1] = sa.pos[0, 0]  # one true position in two slots of a row
    with pytest.raises(RuntimeError, match="I2 violated"):
        c.check_invariants()
    sa.pos[0, 1] = 1

    c.table.cache_lens[sa.row] = 99  # device mirror out of sync
    with pytest.raises(RuntimeError, match="I3 violated: .*mirror"):
        c.check_invariants()
    c.table.sync_mirror(sa)
    c.check_invariants()


def test_set_pins_after_add_guards_present_and_future_positions() -> None:
    """``set_pins`` replaces a request's pins: a mask dropping one (present now, or reached later) is refused
    and changes nothing; an already evicted position cannot be pinned."""
    c = make(granularity="head")
    c.add_request("a")
    fill(c, "a", 8)
    c.set_pins("a", [6, 2, 9])  # 9: not reached yet
    assert c.pinned_positions("a").tolist() == [2, 6, 9]
    drop = np.ones((c.num_rows, 8), bool)
    drop[:, [4, 5]] = False
    drop[1, [2, 3, 4, 5]] = [False, False, True, True]  # row 1 drops pin 2
    with pytest.raises(ValueError, match="pinned"):
        c.apply_keep_mask("a", drop)
    assert c.live_tokens("a") == 8
    fill(c, "a", 2)  # positions 8, 9
    keep = np.ones((c.num_rows, 10), bool)
    keep[:, 9] = False
    with pytest.raises(ValueError, match="pinned"):
        c.apply_keep_mask("a", keep)
    keep = np.ones((c.num_rows, 10), bool)
    keep[:, 0] = False
    assert c.apply_keep_mask("a", keep) == c.num_rows
    with pytest.raises(ValueError, match="evicted positions \\[0\\]"):
        c.set_pins("a", [0, 2])
    assert c.pinned_positions("a").tolist() == [2, 6, 9]


def test_pins_invariant_named() -> None:
    c = make()
    c.add_request("a", pinned_positions=[3])
    fill(c, "a", 6)
    st = c.table.get("a")
    st.live[0, 3] = False  # the pinned token silently dropped (counts kept consistent)
    st.num_live = 5
    with pytest.raises(RuntimeError, match="PINS violated"):
        c.check_invariants()


def test_i3_and_i4_guards() -> None:
    c = make(granularity="head", async_copy=True)
    c.add_request("a")
    fill(c, "a", 16)
    R = c.num_rows
    keep = np.ones((R, 16), bool)
    keep[:, 1:9] = False
    c.apply_keep_mask("a", keep)
    stats = c.reclaim()
    assert stats.tokens_moved > 0 and c.engine.in_flight
    with pytest.raises(RuntimeError, match="I3 violated"):
        c.attention_metadata(["a"], fence=False)
    with pytest.raises(RuntimeError, match="I3 violated"):  # raised before the metadata is looked at
        c.attention(0, torch.zeros(1, 1, 2, 4), None, torch.zeros(1, 1))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="I4 violated"):
        c.engine.submit(CopyPlan(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)))
    c.fence()
    assert not c.in_flight
    md = c.attention_metadata(["a"], fence=False)  # fine once fenced
    assert int(md.cache_lens[0]) == 8


def test_device_mirror_addresses_never_change() -> None:
    c = make(num_blocks=64, granularity="head", mode="compact", max_requests=4, max_blocks_per_request=16)
    tensors = [c.table.block_tables, c.table.cache_lens, c.table.logical_lens, c.store.positions,
               c.store.stats["acc"], *[t for t in c.kv_caches]]
    ptrs = [t.data_ptr() for t in tensors]
    rng = np.random.default_rng(0)
    md_ptrs = None
    for step in range(60):
        for rid in ("a", "b", "c"):
            if rid not in c.request_ids:
                c.add_request(rid)
            if c.reserve(rid, int(rng.integers(1, 4))) is None or c.logical_len(rid) > 40:
                c.preempt(rid)
                continue
            if step % 4 == 3 and c.live_tokens(rid) > 2:
                pos, _ = c.live_view(rid)
                keep = np.zeros(pos.shape, bool)
                np.put_along_axis(keep, np.argsort(rng.random(pos.shape), axis=1)[:, : pos.shape[1] // 2],
                                  True, axis=1)
                c.apply_keep_mask(rid, keep)
        c.reclaim()
        md = c.attention_metadata(c.request_ids)
        now = (md.block_tables.data_ptr(), md.cache_lens.data_ptr(), md.rows.data_ptr())
        md_ptrs = md_ptrs or now
        assert now == md_ptrs
        assert [t.data_ptr() for t in tensors] == ptrs
        for rid in c.request_ids:  # the mirror tracks the table
            st = c.table.get(rid)
            assert c.table.block_tables[st.row, : len(st.blocks)].tolist() == st.blocks
    assert c.tokens_moved_total > 0


def test_external_vllm_cpu_tensors_are_used_in_place() -> None:
    nb, H, bs, D = 8, 2, 4, 4
    caches = [torch.zeros(nb, H, bs, 2 * D) for _ in range(2)]
    c = make(kv_layout="vllm_cpu", kv_caches=caches, num_blocks=nb, granularity="head")
    c.add_request("a")
    slots = fill(c, "a", 5)
    k, v = kv_values(1, 1, H, np.arange(5), D)
    b, o = slots // bs, slots % bs
    assert torch.equal(caches[1][b[2], :, o[2], :D], k[2]) and torch.equal(caches[1][b[2], :, o[2], D:], v[2])
    with pytest.raises(ValueError, match="vllm_cpu layer cache must be"):
        make(kv_layout="vllm_cpu", kv_caches=[torch.zeros(nb, bs, H, 2 * D)] * 2, num_blocks=nb)
    pair = [(torch.zeros(nb, bs, H, D), torch.zeros(nb, bs, H, D)) for _ in range(2)]
    g = make(kv_caches=pair, num_blocks=nb)
    g.add_request("a")
    fill(g, "a", 3)
    assert torch.equal(g.key_cache(0), pair[0][0]) and pair[0][0].abs().sum() > 0


def test_a_layout_without_views_moves_but_refuses_reads() -> None:
    """``kv_views`` None per layer (vLLM's CPU amx layout): eviction and compaction work, every access to cached
    K/V through views (reads, the reference ``write_kv``) raises a ValueError naming the layout, and asking for
    no vectors reads nothing."""
    c = make(kv_views=[None, None])
    c.add_request("a")
    assert c.reserve("a", 12) is not None  # the engine writes K/V itself (vLLM's reshape_and_cache)
    c.add_request("b")
    with pytest.raises(ValueError, match="cannot be read per token"):
        fill(c, "b", 4)
    c.apply_keep_mask("a", np.array([1, 0] * 6, bool))
    assert c.reclaim().tokens_moved > 0
    c.fence()
    assert c.held_blocks("a") == 2
    for read in (lambda: c.key_cache(0), lambda: c.value_cache(1), lambda: c.gather_kv(0, "a"),
                 lambda: c.gather_kv_vectors(["a"], ("key",))):
        with pytest.raises(ValueError, match="cannot be read per token"):
            read()
    assert c.gather_kv_vectors(["a"], ()) == {}


def test_element_map_readers_serve_vector_reads_after_moves() -> None:
    """``kv_views`` given as element-map readers (``vllm_plugin.cpu_layout.MappedKV``, vLLM's amx layout: no
    strided view): K/V written cell by cell through the maps (as vLLM's reshape_and_cache does), then evictions
    and compaction (moves through the same maps): ``gather_kv_vectors`` returns, for every live token, exactly
    the K and V written for its position, at both granularities; strided access still raises."""
    from functools import partial

    from vtoken_runtime.vllm_plugin.cpu_layout import VllmCpuCopyEngine, vllm_cpu_mapped

    L, H, D, bs = 2, 2, 32, 32
    t, d = np.arange(bs)[:, None], np.arange(D)[None, :]
    kmap = (t // 16) * 16 * D + (d // 2) * 32 + 2 * (t % 16) + d % 2  # amx (probed for bs 32, D 32)
    vmap = bs * D + (d // 16) * 16 * bs + (t // 2) * 32 + 2 * (d % 16) + t % 2
    assert np.array_equal(np.sort(np.concatenate([kmap.ravel(), vmap.ravel()])), np.arange(2 * bs * D))
    for granularity in ("request", "head"):
        kv = [torch.zeros(6, H, bs, 2 * D) for _ in range(L)]
        c = VTokenCache(L, H, D, bs, num_blocks=6, granularity=granularity, kv_layout="vllm_cpu", kv_caches=kv,
                        kv_views=vllm_cpu_mapped(kv, kmap, vmap), async_copy=False, debug=True,
                        copy_engine=partial(VllmCpuCopyEngine, kmap=kmap, vmap=vmap))
        written = {(layer, p): torch.randn(2, H, D) for layer in range(L) for p in range(70)}  # K, V per position
        c.add_request("a")
        slots = c.reserve("a", 70)
        assert slots is not None
        for layer in range(L):
            flat = kv[layer].view(-1)
            for p, s in enumerate(slots.tolist()):
                for h in range(H):
                    region = ((s // bs) * H + h) * 2 * bs * D
                    flat[region + torch.as_tensor(kmap[s % bs])] = written[layer, p][0, h]
                    flat[region + torch.as_tensor(vmap[s % bs])] = written[layer, p][1, h]
        rng = np.random.default_rng(0)
        c.apply_keep_mask("a", np.argsort(rng.random((c.num_rows, 70)), axis=1) < 28)  # 28 kept in every row
        assert c.reclaim().tokens_moved > 0
        got = c.gather_kv_vectors(["a"])
        pos, _ = c.live_slots("a")
        for layer in range(L):
            for h in range(H):
                row = pos[layer * H + h] if c.num_rows > 1 else pos[0]
                for j, p in enumerate(row.tolist()):
                    assert torch.equal(got["key"][0, layer, h, j], written[layer, p][0, h]), (granularity, layer, h, p)
                    assert torch.equal(got["value"][0, layer, h, j], written[layer, p][1, h]), (granularity, layer, h, p)
        with pytest.raises(ValueError, match="cannot be read per token"):
            c.key_cache(0)


def test_debug_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTOKEN_DEBUG", "1")
    assert debug_enabled() and not debug_enabled(False)
    assert make(debug=None).debug
    monkeypatch.setenv("VTOKEN_DEBUG", "0")
    assert not debug_enabled() and debug_enabled(True)


def test_worker_errors_surface_at_fence() -> None:
    c = make(async_copy=True)
    bad = CopyPlan(np.zeros(1, np.int64), np.array([10**9]), np.zeros(1, np.int64))
    c.engine.submit(bad)
    with pytest.raises((IndexError, RuntimeError)):
        c.fence()
