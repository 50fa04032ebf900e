"""HFSession behaviour a benchmark or a user relies on (regressions of issues 10 and 35): a shared prefill
forked into several policies equals running each policy directly, the session leaves the caller's model
usable, all-position logits, forking a request that has already evicted, pins set after ``add``, the
observation window however the prompt arrives, and the batched policy input."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from tests.cases import CASES, build, case_id
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


# ------------------------------------------------------------------ pins set after add (issue 35)
def _small(policy: vt.Policy) -> vt.Policy:
    """A policy's protection scaled to tiny prompts (as in test_hf_adapter)."""
    protect = [vt.recent(8)] if policy.name == "snapkv" else [vt.sinks(2), vt.recent(4)]
    return policy.configure(protect=protect, stats=vt.StatsConfig(obs_window=8, history_window=16))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pins_set_after_add_are_kept_by_every_policy(case) -> None:
    """``HFSession.set_pins`` (``VTokenCache.set_pins``) after ``add`` and after part of the sequence is
    cached: present pins in the middle (what recency and sink policies evict first) and future ones stay
    live through the prefill eviction and every decode eviction, in every (layer, KV head) row and in the
    follower cache."""
    model = tiny_llama()
    pol = _small(build(case))
    s = vt_session(model, pol, block_size=8, policies=[pol], follower_block_sizes=(16,), debug=True)
    s.add("a", pol)
    logits = s.prefill(["a"], [_prompt(48)], evict=False)
    pins = [9, 10, 11, 30, 50, 53]  # 50 and 53: not generated yet
    s.set_pins("a", pins)
    assert s.cache.pinned_positions("a").tolist() == pins
    s.evict(["a"], "prefill")
    for _ in range(10):
        logits = s.decode(["a"], logits.argmax(-1).tolist())
    assert not s.requests["a"].failures, s.requests["a"].failures
    assert s.cache.live_tokens("a") < s.cache.logical_len("a"), "the policy never evicted"
    for c in (s.cache, *s.followers.values()):
        kept = c.live_view("a")[0]
        assert all(np.isin(pins, row).all() for row in kept), c.block_size


def test_set_pins_refuses_an_evicted_position_and_changes_nothing() -> None:
    model = tiny_llama()
    pol = _small(vtoken_policies.load("streaming_llm"))
    s = vt_session(model, pol)
    s.add("a", pol, pinned_positions=[20])
    s.prefill(["a"], [_prompt(48)])
    gone = int(np.setdiff1d(np.arange(48), s.cache.live_view("a")[0][0])[0])
    with pytest.raises(ValueError, match="evicted positions"):
        s.set_pins("a", [20, gone])
    assert s.cache.pinned_positions("a").tolist() == [20]


# ------------------------------------------------------------------ the observation window (issue 35)
def _window_mass(s, r: str) -> torch.Tensor:
    return s.cache.gather_stats(r, ["attn_window"])["attn_window"]  # [L, H_kv, n_live]


def test_a_prompt_fed_in_two_calls_is_refused() -> None:
    """attn_window is the prompt's last obs_window queries: a session collecting it refuses, before running
    anything, tokens that would move the end of a prompt whose window was already collected (a second
    prefill, a forward after prefill(evict=False)) and tokens of a request with no prompt yet."""
    model = tiny_llama()
    pol = _snapkv()
    ids = _prompt(96)
    s = vt_session(model, pol)
    s.add("a", pol)
    s.prefill(["a"], [ids[:80]], evict=False)
    with pytest.raises(ValueError, match=r"prompt \(80 tokens.*one prefill\(\) call"):
        s.forward(["a"], [ids[80:]])
    with pytest.raises(ValueError, match="one prefill"):
        s.prefill(["a"], [ids[80:]])
    assert s.cache.logical_len("a") == 80  # nothing ran
    s.add("b", pol)
    with pytest.raises(ValueError, match="no prompt yet"):
        s.forward(["b"], [ids])
    assert s.cache.logical_len("b") == 0
    fork = vt_session(model, pol, policies=[pol])
    fork.add("src", None)
    fork.prefill(["src"], [ids[:80]])
    fork.fork("src", "dst", pol)
    with pytest.raises(ValueError, match="already hold tokens"):
        fork.prefill(["dst"], [ids[80:]])


def test_window_is_the_prompts_last_queries_however_the_prompt_arrives() -> None:
    """The window mass is the same for one chunk and many, and tokens after the prompt (a forward after the
    prompt ended, or decode steps) add nothing to it: they are generated tokens (catalog: decode keeps 0)."""
    model = tiny_llama()
    pol = _snapkv()
    ids = _prompt(96)
    masses = {}
    for chunk in (96, 20):
        s = vt_session(model, pol, chunk_size=chunk, policies=[pol])
        s.add("a", None)
        s.prefill(["a"], [ids])
        masses[chunk] = _window_mass(s, "a")
    torch.testing.assert_close(masses[20], masses[96], atol=1e-5, rtol=1e-5)
    assert float(masses[96][..., -16:].sum()) > 0  # the prompt's own last keys are in its window
    after = {}
    for how in ("forward", "decode"):
        s = vt_session(model, pol, policies=[pol])
        s.add("a", None)
        s.prefill(["a"], [ids[:80]], evict=False)
        s.evict(["a"], "prefill")  # the prompt ends here
        before = _window_mass(s, "a")
        if how == "forward":
            s.forward(["a"], [ids[80:]])
        else:
            for t in ids[80:]:
                s.decode(["a"], [t])
        after[how] = _window_mass(s, "a")
        assert torch.equal(after[how][..., :80], before)  # generated queries leave the window alone
        assert float(after[how][..., 80:].abs().sum()) == 0.0
    assert torch.equal(after["forward"], after["decode"])


# ------------------------------------------------------------------ the policy input, batched (issue 35)
@pytest.mark.parametrize("granularity", ["head", "request"])
def test_stats_batch_is_one_gather_per_statistic_for_the_whole_batch(granularity: str, monkeypatch) -> None:
    """The driver builds a step's policy input with one slot-store gather per statistic for all B requests
    (on the statistics' device) and its keep masks reach the host in one transfer; the result equals the
    per-request reads of the cache's public ``gather_stats``, padding 0."""
    from vtoken_runtime.slot_stats import SlotStore

    model = tiny_llama()
    pol = _small(vtoken_policies.load("tova")).configure(granularity=granularity)
    s = vt_session(model, pol, granularity=granularity)
    rids = ["a", "b", "c", "d"]
    for r in rids:
        s.add(r, pol)
    s.prefill(rids, [_prompt(40 + 7 * i, seed=i) for i in range(len(rids))], evict=False)
    s.evict(rids[:1], "prefill")  # unequal live counts and orders in the batch
    calls = {"batch": 0, "single": 0, "to_host": 0}
    batch_gather, single_gather, numpy = SlotStore.gather_batch, SlotStore.gather, torch.Tensor.numpy

    def counted(kind: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[kind] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(SlotStore, "gather_batch", counted("batch", batch_gather))
    monkeypatch.setattr(SlotStore, "gather", counted("single", single_gather))
    batch, ns = s.driver.stats_batch(rids)
    assert (calls["batch"], calls["single"]) == (len(pol.stored_reads), 0)
    monkeypatch.undo()
    for b, (r, n) in enumerate(zip(rids, ns, strict=True)):
        for name, t in s.cache.gather_stats(r, pol.stored_reads).items():
            assert torch.equal(batch.stats[name][b, ..., :n], t), (r, name)
            assert not batch.stats[name][b, ..., n:].any()

    def driver_to_host(t: torch.Tensor, *a, **k):  # noqa: ANN002, ANN003, ANN202 - the driver's own reads
        if sys._getframe(1).f_globals.get("__name__") == "vtoken_runtime.eviction":
            calls["to_host"] += 1
        return numpy(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", driver_to_host)
    report = s.driver.step(rids[1:], "prefill")
    monkeypatch.undo()
    assert len(report.evicted) == 3 and calls["to_host"] == 1, (report.evicted, calls)


@pytest.mark.parametrize("name", ["ada_snapkv", "pyramidkv", "ada_expected_attention"])
def test_a_policy_with_unequal_budgets_is_refused_by_name_and_changes_nothing(name: str) -> None:
    """A request-granularity session has one row per request, so no per-row pages (decision 8): it
    refuses the policy at ``add`` with the reason and the way out, and the request is not half-added.
    (Head-granularity sessions run them: tests/runtime/test_hf_rows.py.)"""
    pol = vtoken_policies.load(name)
    s = vt_session(tiny_llama(), pol, granularity="request")
    with pytest.raises(ValueError, match=f"policy '{name}' has allocation=.*allocation=vt.Uniform"):
        s.add("r", pol)
    assert "r" not in s.requests and "r" not in s.driver.requests
    s.add("r", pol.configure(allocation=vt.Uniform()))  # the way out the message names
    s.prefill(["r"], [_prompt(40)])
