"""HFSession behaviour a benchmark or a user relies on (regressions of issue 10): a shared prefill forked
into several policies equals running each policy directly, the session leaves the caller's model
usable, all-position logits, and forking a request that has already evicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from vtoken_bench.models import tiny_llama


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _snapkv(window: int = 12) -> vt.Policy:
    return vtoken_policies.load("snapkv").configure(protect=[vt.recent(window)],
                                                     stats=vt.StatsConfig(obs_window=window))


def _kept(s, r: str) -> np.ndarray:
    return s.cache.live_view(r)[0]


def test_forked_snapkv_keeps_the_same_sets_as_snapkv_run_directly() -> None:
    """The shared-prefill path of `vtoken-cli eval` / `bench blocks`: the base request is prefilled with no
    policy, then forked. The observation window must be SnapKV's own (12 here), not the default 32."""
    model = tiny_llama()
    pol = _snapkv()
    ids = _prompt(96)
    direct = vt_session(model, pol)
    direct.add("a", pol)
    direct.prefill(["a"], [ids])
    shared = vt_session(model, pol, policies=[pol])
    shared.add("base", None)
    shared.prefill(["base"], [ids], evict=False)
    shared.fork("base", "a", pol)
    shared.evict(["a"], "prefill")
    assert direct.cache.live_tokens("a") < len(ids)
    assert np.array_equal(_kept(direct, "a"), _kept(shared, "a"))  # every (layer, KV head) row


def test_policy_needing_other_collector_parameters_after_a_forward_is_refused() -> None:
    model = tiny_llama()
    pol = _snapkv()
    s = vt_session(model, pol)  # collects attn_window with the default obs_window=32
    s.add("base", None)
    s.prefill(["base"], [_prompt(40)], evict=False)
    with pytest.raises(ValueError, match="obs_window=12.*policies="):
        s.fork("base", "a", pol)


def vt_session(model, pol: vt.Policy, **kw):
    from vtoken_runtime.hf_adapter import HFSession

    kw = {"block_size": 16, "num_blocks": 64, "chunk_size": 32, **kw}
    return HFSession(model, stat_names=pol.stored_reads, **kw)


def test_session_leaves_the_model_usable() -> None:
    model = tiny_llama()
    ids = torch.tensor([_prompt(20)])
    before = model(input_ids=ids).logits
    s = vt_session(model, vtoken_policies.load("h2o"))
    s.add("a", None)
    s.prefill(["a"], [ids[0].tolist()])
    after = model(input_ids=ids).logits  # a plain forward still works, with the model's own attention
    torch.testing.assert_close(before, after)


def test_forward_returns_every_position_logits() -> None:
    model = tiny_llama()
    ids = _prompt(30)
    s = vt_session(model, vtoken_policies.load("h2o"))
    s.add("a", None)
    s.add("b", None)
    out = s.forward(["a", "b"], [ids, ids[:20]], all_logits=True)
    dense = model(input_ids=torch.tensor([ids])).logits[0].float()
    assert out.shape[:2] == (2, 30)
    torch.testing.assert_close(out[0], dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1, :20], dense[:20], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("granularity", ["head", "request"])
def test_fork_after_eviction_continues_like_its_source(granularity: str) -> None:
    model = tiny_llama()
    pol = vtoken_policies.load("h2o").configure(protect=[vt.sinks(2), vt.recent(4)], granularity=granularity)
    s = vt_session(model, pol, granularity=granularity, debug=True)
    s.add("a", pol, pinned_positions=[5])
    logits = s.prefill(["a"], [_prompt(70)])
    assert s.cache.live_tokens("a") < 70
    s.fork("a", "b", pol)
    assert np.array_equal(_kept(s, "a"), _kept(s, "b"))
    assert s.cache.held_blocks("b") == s.cache.held_blocks("a")
    nxt = [int(logits[0].argmax())] * 2
    for _ in range(6):
        logits = s.decode(["a", "b"], nxt)
        torch.testing.assert_close(logits[0], logits[1])
        nxt = logits.argmax(-1).tolist()
        assert np.array_equal(_kept(s, "a"), _kept(s, "b"))
    assert not s.requests["a"].failures and not s.requests["b"].failures


@pytest.mark.parametrize("name", ["scissorhands", "h2o"])
def test_naive_evict_makes_the_same_decisions_as_compaction(name: str) -> None:
    """Decision 5: Naive-Evict differs in memory only. Dead slots inside a naive cache length are not
    'visible' keys, so statistics such as Scissorhands' uniform-share threshold are unchanged."""
    model = tiny_llama()
    pol = vtoken_policies.load(name).configure(protect=[vt.sinks(2), vt.recent(4)],
                                                stats=vt.StatsConfig(obs_window=5, history_window=7))
    logs = {}
    for mode in ("compact", "naive"):
        s = vt_session(model, pol, block_size=4, num_blocks=64, mode=mode, record_keeps=True)
        s.add("a", pol)
        out = s.generate(["a"], [_prompt(60)], 30)
        logs[mode] = (out, s.requests["a"].keep_log)
    (out_c, log_c), (out_n, log_n) = logs["compact"], logs["naive"]
    assert out_c == out_n and len(log_c) == len(log_n) > 10
    for (lc, kc), (ln, kn) in zip(log_c, log_n, strict=True):
        assert lc == ln and np.array_equal(kc, kn), f"decisions diverge at logical length {lc}"
