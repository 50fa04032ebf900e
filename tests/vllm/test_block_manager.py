"""The scheduler-side owner of vLLM's block lists (``EvictingAttentionManager``), driven through vLLM's own
``KVCacheManager`` exactly as vLLM's scheduler calls it (no engine): vLLM builds the manager from the group's
role, admission asks for the blocks of the request's peak (rounded UP to whole blocks), allocation follows
the cache length, a truncation frees the tail blocks, and finishing forgets the eviction count."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vtoken_runtime.token_table import cdiv  # noqa: E402
from vtoken_runtime.vllm_plugin import block_manager  # noqa: E402
from vtoken_runtime.vllm_plugin.report import Truncation  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
NB = 24  # block 0 is vLLM's null block: 23 usable


def _manager(peak: dict[str, int] | None = None, caching: bool = False):
    """vLLM's ``KVCacheManager`` over one full-attention group with the vtoken role, and its evicting manager
    (``caching``: vLLM's prefix caching on)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    block_manager.register()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec, role=block_manager.VTOKEN_ROLE)])
    kvm = KVCacheManager(kv_cache_config=cfg, max_model_len=2048, scheduler_block_size=BS, hash_block_size=BS,
                         enable_caching=caching)
    (mgr,) = kvm.coordinator.single_type_managers
    assert isinstance(mgr, block_manager.EvictingAttentionManager)
    if peak is not None:
        mgr.bind_admission(lambda rid, frozen=0: frozen + peak[rid])
    return kvm, mgr


def _request(rid: str, n: int, hashed: bool = False, base: int = 3):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = None
    if hashed:  # block hashes, as the engine gives requests when prefix caching is on
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(BS, sha256)
    return Request(rid, prompt_token_ids=list(range(base, base + n)), sampling_params=SamplingParams(max_tokens=8),
                   pooling_params=None, block_hasher=hasher)


def _occupy(kvm, free: int):
    """A running request holding all but ``free`` blocks."""
    filler = _request("filler", (kvm.block_pool.get_num_free_blocks() - free) * BS)
    assert kvm.allocate_slots(filler, filler.num_tokens) is not None
    assert kvm.block_pool.get_num_free_blocks() == free
    return filler


@pytest.mark.parametrize("peak", [5 * BS + 3, 5 * BS + 1, 6 * BS - 1])
def test_admission_needs_the_peak_rounded_up_to_whole_blocks(peak: int) -> None:
    """A 400-token request whose peak is ``peak`` tokens needs ``cdiv(peak, BS)`` free blocks at admission
    (vLLM's full-sequence gate): one block fewer refuses it, exactly that many admits it, and the first chunk
    is allocated either way by cache length."""
    need = cdiv(peak, BS)
    for free, admitted in ((need - 1, False), (need, True)):
        kvm, mgr = _manager({"r": peak, "filler": 10**9})
        _occupy(kvm, free)
        req = _request("r", 400)
        assert mgr.admission_blocks("r", req.num_tokens) == need
        got = kvm.allocate_slots(req, 2 * BS, full_sequence_must_fit=True, has_scheduled_reqs=False)
        assert (got is not None) == admitted, (peak, free)
        assert mgr.held_blocks("r") == (2 if admitted else 0)


def test_without_a_bound_admission_needs_the_whole_sequence() -> None:
    for free, admitted in ((cdiv(200, BS) - 1, False), (cdiv(200, BS), True)):
        kvm, _ = _manager()
        _occupy(kvm, free)
        got = kvm.allocate_slots(_request("r", 200), 2 * BS, full_sequence_must_fit=True, has_scheduled_reqs=False)
        assert (got is not None) == admitted, free


def test_a_report_a_step_late_keeps_the_blocks_of_the_tokens_scheduled_since() -> None:
    """Two batches in flight (pipeline parallelism): chunk 2 (32 tokens) is scheduled, with the eviction count
    before chunk 1's report, and only then chunk 1's report (true length 96, cache length 40) arrives. The worker
    already placed chunk 2 after its 40 kept tokens: 72 tokens, 5 blocks, must stay (cache length alone: 3)."""
    kvm, mgr = _manager()
    req = _request("r", 200)
    assert kvm.allocate_slots(req, 96) is not None
    req.num_computed_tokens = 96  # chunk 1 scheduled (vLLM counts it at schedule time)
    assert kvm.allocate_slots(req, 32) is not None
    req.num_computed_tokens = 128  # chunk 2 scheduled before chunk 1's report
    assert mgr.held_blocks("r") == cdiv(128, BS) == 8
    freed = mgr.truncate("r", Truncation(true_len=96, cache_len=40), computed=req.num_computed_tokens)
    assert mgr.held_blocks("r") == cdiv(40 + 32, BS) == 5 and freed == 3
    assert mgr.evicted_tokens("r") == 56  # then chunk 2's report: the worker holds 72, evicts to 50
    assert mgr.truncate("r", Truncation(true_len=128, cache_len=50), computed=128) == 5 - cdiv(50, BS)


def test_truncate_frees_the_tail_and_allocation_follows_the_cache_length() -> None:
    kvm, mgr = _manager()
    req = _request("r", 100)
    assert kvm.allocate_slots(req, 100) is not None
    req.num_computed_tokens = 100
    row = list(kvm.get_block_ids("r")[0])
    assert len(row) == cdiv(100, BS) == 7
    free = kvm.block_pool.get_num_free_blocks()
    assert mgr.truncate("r", Truncation(true_len=100, cache_len=40)) == 7 - cdiv(40, BS)
    assert list(kvm.get_block_ids("r")[0]) == row[:3]
    assert kvm.block_pool.get_num_free_blocks() == free + 4
    assert mgr.evicted_tokens("r") == 60 and req.num_computed_tokens == 100  # the true length is untouched
    assert mgr.rows_to_resend(["other"]) == set() and mgr.rows_to_resend(["r", "other"]) == {"r"}
    assert mgr.rows_to_resend(["r"]) == set()  # sent once
    # 9 more tokens: cache length 49 -> cdiv(49, 16) = 4 blocks, one new block (by the true length: 7 held, 0 new)
    new = kvm.allocate_slots(req, 9)
    assert new is not None and len(new.get_block_ids()[0]) == 1 and mgr.held_blocks("r") == 4
    # a report about a request no longer held (finished since) is ignored
    kvm.free(req)
    assert mgr.evicted_tokens("r") == 0 and mgr.truncate("r", Truncation(200, 10)) == 0
    assert kvm.block_pool.get_num_free_blocks() == NB - 1


def test_a_report_longer_than_the_request_is_refused() -> None:
    kvm, mgr = _manager()
    req = _request("r", 40)
    assert kvm.allocate_slots(req, 40) is not None
    with pytest.raises(RuntimeError, match="cache length 41"):
        mgr.truncate("r", Truncation(true_len=40, cache_len=41))


# ----------------------------------------------------------------------------------------- prefix caching


def _hits(kvm, n: int) -> int:
    """Tokens a new request with the same first ``n`` prompt tokens finds in the prefix cache."""
    return kvm.get_computed_blocks(_request(f"probe{n}", n, hashed=True))[1]


def test_prefix_caching_offers_a_block_only_after_the_step_that_computed_it_and_below_the_first_eviction() -> None:
    """The frozen-prefix rule (``vllm_plugin.prefix``) on vLLM's own manager and block pool: a request that may
    evict offers its blocks one step late (after the worker had its chance to evict in them) and never at or
    past its first evicted position; what is left is offered when it finishes. A request that never evicts
    (opted out) is cached the way vLLM caches it."""
    kvm, mgr = _manager(caching=True)
    mgr.bind_prefix_rule(lambda req: req.request_id != "optout")
    req = _request("r", 160, hashed=True)
    assert kvm.allocate_slots(req, 128) is not None  # step 1: a chunk of 128 tokens (8 blocks)
    assert _hits(kvm, 160) == 0  # vLLM would offer the chunk now; nothing is, its step has not run
    req.num_computed_tokens = 128
    mgr.truncate("r", Truncation(true_len=128, cache_len=100, intact=70))  # the worker evicted from 70 on
    assert kvm.allocate_slots(req, 32) is not None  # step 2: the last 32 tokens
    assert _hits(kvm, 160) == 64  # min(128 computed, 70 intact) -> 4 whole blocks
    assert mgr.intact_prefix("r") == 70
    req.num_computed_tokens = 160
    mgr.truncate("r", Truncation(true_len=160, cache_len=120, intact=90))  # a later eviction cannot raise it
    kvm.free(req)
    assert _hits(kvm, 160) == 64 and mgr.intact_prefix("r") > 10**9  # forgotten with the request
    # a report without the position (-1) after an eviction: nothing more is offered
    req2 = _request("s", 160, hashed=True, base=400)  # another prefix
    assert kvm.allocate_slots(req2, 160) is not None
    req2.num_computed_tokens = 160
    mgr.truncate("s", Truncation(true_len=160, cache_len=100))
    kvm.free(req2)
    assert mgr.num_cached_block.get("s") is None and kvm.get_computed_blocks(req2)[1] == 0
    # opted out: vLLM's rule (the step's blocks are offered when scheduled)
    out = _request("optout", 96, hashed=True, base=700)
    assert kvm.allocate_slots(out, 96) is not None
    probe = _request("p", 96, hashed=True, base=700)
    assert kvm.get_computed_blocks(probe)[1] == 80  # 6 blocks, less the last (recomputed for its logits)


def test_prefix_caching_refuses_a_report_that_would_free_an_offered_block_and_a_hit_counts_for_admission() -> None:
    """A truncation never frees a block offered to the prefix cache (a report that would is a broken invariant,
    RuntimeError, nothing freed), and a waiting request's admission bound counts its prefix-cache hits as held:
    ``frozen + peak(n - frozen)`` tokens."""
    peak = {"a": 10**6, "b": 40}
    kvm, mgr = _manager(peak=peak, caching=True)
    mgr.bind_prefix_rule(lambda req: True)
    a = _request("a", 128, hashed=True)
    assert kvm.allocate_slots(a, 128) is not None
    a.num_computed_tokens = 128
    kvm.coordinator.cache_blocks(a, 128)  # what the next step's allocation offers
    assert mgr.num_cached_block["a"] == 8
    free = kvm.block_pool.get_num_free_blocks()
    with pytest.raises(RuntimeError, match="offered"):
        mgr.truncate("a", Truncation(true_len=128, cache_len=60, intact=128))
    assert mgr.held_blocks("a") == 8 and kvm.block_pool.get_num_free_blocks() == free
    # "b": the same 128-token prefix plus 72 new tokens: 8 hit blocks held by "a" (shared: none taken from the
    # free queue); admission needs cdiv(128 + 40, BS) = 11 blocks in all, 3 new (vLLM: cdiv(200, BS) - 8 = 5)
    b = _request("b", 200, hashed=True)
    hits, n_hit, _ = kvm.get_computed_blocks(b)
    assert n_hit == 128
    n = mgr.get_num_blocks_to_allocate("b", 200, hits.blocks[0], n_hit, n_hit, 200, apply_admission_cap=True)
    assert n == cdiv(128 + 40, BS) - 8 == 3
    kvm.free(a)  # now the 8 blocks sit in the free queue, cached: a hit takes them from it
    n = mgr.get_num_blocks_to_allocate("b", 200, hits.blocks[0], n_hit, n_hit, 200, apply_admission_cap=True)
    assert n == 3 + 8
