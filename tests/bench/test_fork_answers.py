"""``answer_forks`` (one shared prefill, a fork per configuration): each fork answers exactly as its
configuration run alone, in any grouping; EOS and ``done`` stop as documented; a failing policy is an error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken_bench.experiments import load_named_policy
from vtoken_bench.fork_answers import Fork, answer_forks
from vtoken_bench.models import tiny_llama
from vtoken_runtime.hf_adapter import HFSession


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3).eval()


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def _alone(model: torch.nn.Module, ctx: list[int], q: list[int], f: Fork, new: int, chunk: int) -> list[int]:
    """The configuration on its own session: prefill without eviction, evict once, question, greedy."""
    s = HFSession(model, block_size=16, num_blocks=64, granularity="head", max_requests=2, chunk_size=chunk,
                  policies=[f.policy] if f.policy is not None else [])
    try:
        s.add("r", f.policy, budget=f.budget)
        s.prefill(["r"], [ctx], evict=False)
        s.evict(["r"], "prefill")
        logits = s.forward(["r"], [q])
        out: list[int] = []
        for i in range(new):
            t = int(logits.argmax(-1)[0])
            out.append(t)
            if i < new - 1:
                logits = s.decode(["r"], [t], evict=False)
        return out
    finally:
        s.cache.close()


def _forks() -> list[Fork]:
    return [Fork("full", None), Fork("knorm", load_named_policy("knorm"), 40),
            Fork("h2o", load_named_policy("h2o"), 48), Fork("snapkv", load_named_policy("snapkv"), 36),
            Fork("knorm_small", load_named_policy("knorm"), 24)]


@pytest.mark.parametrize("group", [1, 2, 8])
def test_every_fork_answers_as_its_configuration_alone(model: torch.nn.Module, group: int) -> None:
    ctx, q = _tokens(90, 0), _tokens(7, 1)
    forks = _forks()
    got = answer_forks(model, ctx, q, forks, 6, group=group, chunk_size=32)
    for f in forks:
        assert got[f.label] == _alone(model, ctx, q, f, 6, 32), f.label
    assert got["full"] != got["knorm_small"] or got["full"] != got["snapkv"]  # eviction changed something


def test_eos_stops_a_fork_and_done_stops_the_group(model: torch.nn.Module) -> None:
    ctx, q = _tokens(70, 2), _tokens(5, 3)
    forks = _forks()[:3]
    free = answer_forks(model, ctx, q, forks, 8)
    eos = free["knorm"][2]
    stopped = answer_forks(model, ctx, q, forks, 8, eos_ids=[eos])
    for f in forks:
        ids = free[f.label]
        cut = ids.index(eos) + 1 if eos in ids else len(ids)
        assert stopped[f.label] == ids[:cut], f.label  # the EOS token kept, nothing after it
    early = answer_forks(model, ctx, q, forks, 8, done=lambda gen: all(len(v) >= 3 for v in gen.values()))
    assert {k: len(v) for k, v in early.items()} == {f.label: 3 for f in forks}
    assert all(early[f.label] == free[f.label][:3] for f in forks)


def test_a_policy_that_fails_is_an_error_naming_the_fork(model: torch.nn.Module) -> None:
    import vtoken_sdk as vt

    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
    def broken(s: vt.TokenStats, ctx: vt.MaskContext) -> torch.Tensor:
        raise ZeroDivisionError("policy bug")

    with pytest.raises(RuntimeError, match=r"failed at run time.*'bad'"):
        answer_forks(model, _tokens(60, 4), _tokens(4, 5), [Fork("ok", None), Fork("bad", broken, 30)], 3)


def test_labels_must_be_distinct(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="distinct"):
        answer_forks(model, _tokens(40, 6), _tokens(3, 7), [Fork("a", None), Fork("a", None)], 2)
