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


def _manager(peak: dict[str, int] | None = None):
    """vLLM's ``KVCacheManager`` over one full-attention group with the vtoken role, and its evicting manager."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    block_manager.register()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec, role=block_manager.VTOKEN_ROLE)])
    kvm = KVCacheManager(kv_cache_config=cfg, max_model_len=2048, scheduler_block_size=BS, hash_block_size=BS,
                         enable_caching=False)
    (mgr,) = kvm.coordinator.single_type_managers
    assert isinstance(mgr, block_manager.EvictingAttentionManager)
    if peak is not None:
        mgr.bind_admission(lambda rid: peak[rid])
    return kvm, mgr


def _request(rid: str, n: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt_token_ids=list(range(3, 3 + n)), sampling_params=SamplingParams(max_tokens=8),
                   pooling_params=None)


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
