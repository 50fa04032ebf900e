"""snap_observed on any depth: its upper-layer term starts at ``s.num_layers / 2`` (the model's layer count,
supplied by the runtime) where it used to start at a constant 15, SmolLM2-135M's 30 layers halved. The kept
sets are those of the constant on SmolLM2, and of ``num_layers // 2`` on a model of another (even) depth."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import vtoken_policies
import vtoken_sdk as vt
from vtoken_policies.snap_observed import W
from vtoken_sdk.testing import BatchSpec, build_batch

SHIPPED = vtoken_policies.load("snap_observed")


def from_layer(first: int) -> vt.Policy:
    """snap_observed with the upper-layer term from the constant layer ``first`` on (the old definition)."""

    @vt.policy(budget=SHIPPED.budget, protect=list(SHIPPED.spec.protect), granularity=SHIPPED.granularity,
               stats=SHIPPED.spec.stats, name=f"snap_observed_from_{first}")
    def fixed(s: vt.TokenStats):
        vote = vt.max_pool(vt.where(s.age >= W, s.attn_window / W, 0.0), 5)
        return vote + vt.where(s.layer >= float(first), 2.0 * s.attn_sum / (s.age + 1.0), 0.0)

    return fixed


def _spec(layers: int, seed: int) -> BatchSpec:
    return BatchSpec(2, layers, 2, 96, (96, 80), (0, 40), "continuous", seed, False, (), None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thirty_layers_score_and_keep_as_the_constant_fifteen(seed: int) -> None:
    """SmolLM2-135M's depth, whole (L = 30) and in layer chunks (``layer_offset``, ``num_layers = 30``)."""
    names = tuple(sorted(SHIPPED.stored_reads))
    whole = build_batch(_spec(30, seed), names)
    chunk = replace(build_batch(_spec(7, seed), names), layer_offset=11, num_layers=30)
    old, new = from_layer(15).compile("torch"), SHIPPED.compile("torch")
    for batch in (whole, chunk):
        assert torch.equal(new.scores(batch), old.scores(batch))
        assert torch.equal(new.keep_mask(batch), old.keep_mask(batch))
    assert not torch.equal(from_layer(0).keep_mask(whole), old.keep_mask(whole))  # the layer split matters


def _kept_rows(model, policy: vt.Policy, prompt: list[int], **session) -> np.ndarray:
    from vtoken_runtime.hf_adapter import HFSession

    s = HFSession(model, policies=[policy], **session)
    s.add("a", policy)
    s.prefill(["a"], [prompt])
    assert not s.requests["a"].failures and s.cache.live_tokens("a") < len(prompt)
    return s.cache.live_view("a")[0]


def test_the_runtime_supplies_the_models_depth() -> None:
    """A 6-layer model through HFSession: the kept set of every (layer, KV head) row is that of the constant
    3, not that of the old constant (15: no layer of this model gets the upper-layer term)."""
    from vtoken_bench.models import tiny_llama

    model = tiny_llama(num_layers=6)
    prompt = torch.randint(0, 250, (3 * W,), generator=torch.Generator().manual_seed(5)).tolist()
    kept = _kept_rows(model, SHIPPED, prompt, block_size=16, num_blocks=128)
    assert np.array_equal(kept, _kept_rows(model, from_layer(3), prompt, block_size=16, num_blocks=128))
    assert not np.array_equal(kept, _kept_rows(model, from_layer(15), prompt, block_size=16, num_blocks=128))


def test_layer_chunks_see_the_models_depth_not_the_chunks() -> None:
    """A policy reading keys is evaluated in layer chunks (``layer_offset``): each chunk must get the model's
    depth (``StatsBatch.num_layers``), not ``layer_offset + its own L``. Same decisions chunked or not."""
    from vtoken_bench.models import tiny_llama
    from vtoken_runtime.hf_adapter import HFSession

    @vt.policy(budget=vt.Budget(ratio=0.5, when="prefill"), protect=[vt.sinks(2)], granularity="head")
    def depth_split(s: vt.TokenStats):
        return vt.where(s.layer >= s.num_layers / 2, vt.norm(s.key), -vt.norm(s.key))

    model = tiny_llama(num_layers=4)
    prompt = torch.randint(0, 250, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = []
    for chunk_bytes in (None, 1):
        s = HFSession(model, policies=[depth_split], block_size=8, num_blocks=64, record_keeps=True)
        if chunk_bytes is not None:
            s.driver.vector_chunk_bytes = chunk_bytes  # one layer per policy call
        s.add("a", depth_split)
        s.prefill(["a"], [prompt])
        assert not s.requests["a"].failures and s.requests["a"].keep_log
        runs.append(s.cache.live_view("a")[0])
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.slow
def test_smollm2_keeps_the_same_sets_as_the_constant_fifteen() -> None:
    """SmolLM2-135M itself (30 layers) on an essay prompt: every (layer, KV head) row keeps the same tokens."""
    from vtoken_bench.essays import load_essays
    from vtoken_bench.models import load_smollm2

    model, tok = load_smollm2()
    assert model.config.num_hidden_layers == 30
    prompt = tok.encode(load_essays()[0])[:384]
    kept = _kept_rows(model, SHIPPED, prompt, block_size=16, num_blocks=256)
    assert np.array_equal(kept, _kept_rows(model, from_layer(15), prompt, block_size=16, num_blocks=256))
