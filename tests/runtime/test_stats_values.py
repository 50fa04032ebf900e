"""Values of every stored per-slot statistic (attn_sum, attn_last, attn_window, low_attn_count,
key_norm, value_norm) against the independent dense reference in ``tests/oracles/stats_reference.py``.

* HF adapter (``HFSession``, whose collector is ``vtoken_runtime.stats``: the catalog's unified
  rules): two batched requests of different lengths, chunked prefill (one prompt's observation window
  spans two chunks), decode steps; every step is compared, per (layer, KV head, position), with the
  ``"catalog"`` rules applied to the probabilities of HF's own eager attention over the full sequence
  (``output_attentions``) and the post-RoPE keys/values of HF's dense cache.
* vLLM path (``vtoken_runtime.vllm_plugin.collector.VTokenAttentionImpl`` around a stand-in attention
  impl, feeding the same collector; no vLLM engine): random Q/K/V as flat ``[T, H, D]`` tensors with
  vLLM's padding rows, a ``VTokenCache`` in the vllm_cpu layout, prompts split into chunks so the
  observation window spans chunks, mixed prefill + decode batches; compared with the ``"catalog"``
  rules on probabilities the reference computes itself from the dense Q/K.

Tolerance: atol 1e-5 + rtol 1e-4 (float32 runtime vs float64 reference over < 40 queries).
``low_attn_count`` may differ only by the weight of (query, key) pairs whose attention lies within
1e-5 (relative) of the low-attention threshold (float32 rounding decides their side); the tests
also check that such pairs are rare, so the allowance cannot hide a wrong count.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import vtoken_sdk as vt
from tests.oracles.stats_reference import (
    ATTENTION_STATS,
    NORM_STATS,
    RefParams,
    Semantics,
    Snapshot,
    dense_probs,
    mismatches,
    reference_stats,
    sum_query_heads,
)
from vtoken_bench.models import tiny_llama, tiny_qwen2
from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.hf_adapter import HFSession
from vtoken_runtime.stats import StatsCollector
from vtoken_runtime.vllm_plugin.collector import StepContext, VTokenAttentionImpl, build_step_index
from vtoken_sdk.stats import STORED_STATS

ALL_STATS = (*ATTENTION_STATS, *NORM_STATS)
assert set(ALL_STATS) == set(STORED_STATS), "a stored statistic of the catalog has no value test"

OBS, HIST, THR = 5, 7, 1.0
PARAMS = RefParams(obs_window=OBS, history_window=HIST, low_attn_threshold=THR)
# both adapters fold probabilities with vtoken_runtime.stats.StatsCollector (the catalog's rules)
HF_SEMANTICS: Semantics = "catalog"
VLLM_SEMANTICS: Semantics = "catalog"


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(got: dict[str, torch.Tensor], want: Snapshot, where: str) -> None:
    bad = mismatches(got, want, atol=1e-5, rtol=1e-4, names=ALL_STATS)
    assert not bad, f"{where}:\n" + "\n".join(bad)


def _check_not_vacuous(snaps: Sequence[Snapshot], where: str) -> None:
    """The comparisons above only mean something if the values are non-trivial and ties are rare."""
    low = snaps[-1].values["low_attn_count"]
    assert float(low.max()) > 1.0 and float(low.max() - low.min()) > 0.5, f"{where}: low_attn_count is trivial"
    for other in ("attn_last", "attn_sum"):
        assert any(not torch.allclose(s.values["attn_window"], s.values[other]) for s in snaps), \
            f"{where}: attn_window == {other} after every step"
    # key 0 always ties with query 0 (one visible key: P = G = the threshold, exactly, in any precision)
    ties = sum(float((s.low_attn_slack[..., 1:] > 0).double().mean()) for s in snaps) / len(snaps)
    assert ties < 0.02, f"{where}: {ties:.1%} of low_attn_count entries sit on the threshold"


# ----------------------------------------------------------------------------------------- HF adapter


def _record_steps(s: HFSession) -> list[tuple[list[Hashable], list[list[int]], dict[Hashable, Any]]]:
    """Wrap ``s.forward`` to record each step's (request ids, query positions, gathered stats after it)."""
    log: list[tuple[list[Hashable], list[list[int]], dict[Hashable, Any]]] = []
    inner: Callable[..., torch.Tensor] = s.forward

    def forward(req_ids: Sequence[Hashable], tokens: Sequence[Sequence[int]], *args: Any, **kw: Any) -> torch.Tensor:
        starts = [s.cache.logical_len(r) for r in req_ids]
        out = inner(req_ids, tokens, *args, **kw)
        pos = [list(range(a, a + len(t))) for a, t in zip(starts, tokens, strict=True)]
        log.append((list(req_ids), pos, {r: s.cache.gather_stats(r) for r in req_ids}))
        return out

    s.forward = forward  # type: ignore[method-assign]
    return log


@torch.inference_mode()
def _hf_dense(factory: Callable[..., Any], ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                      list[torch.Tensor]]:
    """HF's eager attention over the whole sequence: per layer ``P [H_kv, T, T]`` (summed over the G
    query heads), post-RoPE ``keys`` and ``values [H_kv, T, D]``."""
    from transformers import DynamicCache

    model = factory(attn_implementation="eager")
    cfg = model.config
    cache = DynamicCache(config=cfg)
    T = len(ids)
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(T)[None], past_key_values=cache,
                use_cache=True, output_attentions=True)
    probs = [sum_query_heads(a[0], cfg.num_key_value_heads) for a in out.attentions]
    keys = [cache.layers[i].keys[0] for i in range(cfg.num_hidden_layers)]
    values = [cache.layers[i].values[0] for i in range(cfg.num_hidden_layers)]
    return probs, keys, values


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_hf_collector_matches_dense_reference_every_step(factory: Callable[..., Any]) -> None:
    model = factory()
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    assert G > 1, "the tiny model should use GQA"
    s = HFSession(model, block_size=4, num_blocks=64, stat_names=STORED_STATS, chunk_size=8,
                  stats_config=vt.StatsConfig(obs_window=OBS, history_window=HIST, low_attn_threshold=THR))
    prompts = {"a": _tokens(15, 1), "b": _tokens(11, 2)}
    decoded = {"a": _tokens(4, 3), "b": _tokens(4, 4)}
    for r in prompts:
        s.add(r, None)
    log = _record_steps(s)
    s.prefill(list(prompts), list(prompts.values()))
    for k in range(4):
        s.decode(list(prompts), [decoded[r][k] for r in prompts])
    # a prefill step longer than the observation window, so its window is a strict part of the step,
    # and a prompt whose window spans two prefill chunks
    assert any(len(p) > OBS for _, pos, _ in log for p in pos)
    plen = len(prompts["b"])
    assert sum(any(plen - OBS <= x < plen for x in pos[req_ids.index("b")])
               for req_ids, pos, _ in log if "b" in req_ids) > 1
    assert any(len(set(map(len, pos))) > 1 for _, pos, _ in log), "no batch with different chunk lengths"

    for r in prompts:
        ids = prompts[r] + decoded[r]
        probs, keys, values = _hf_dense(factory, ids)
        mine = [(pos[b], got[r]) for req_ids, pos, got in log for b, rr in enumerate(req_ids) if rr == r]
        snaps = reference_stats(probs, [p for p, _ in mine], G, PARAMS, len(prompts[r]), HF_SEMANTICS, keys=keys,
                                values=values)
        assert len(snaps) == len(mine) >= 6
        live, _ = s.cache.live_view(r)
        assert (live == np.arange(len(ids))).all(), "no eviction: every position is live, in order"
        for (pos, got), want in zip(mine, snaps, strict=True):
            _check(got, want, f"request {r}, step {pos[0]}..{pos[-1]}")
        _check_not_vacuous(snaps, f"request {r}")


# ----------------------------------------------------------------------------------------- vLLM path


class _PagedImpl:
    """Stands in for vLLM's attention impl: ``do_kv_cache_update`` is reshape_and_cache into the
    ``VTokenCache`` (slot -1 = padding token), ``forward`` returns ``output`` untouched."""

    def __init__(self, cache: VTokenCache, layer: int, scale: float) -> None:
        self.cache, self.layer, self.scale = cache, layer, scale

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: Any,
                           slot_mapping: torch.Tensor) -> None:
        n = int(slot_mapping.shape[0])
        ok = slot_mapping >= 0
        self.cache.write_kv_slots(self.layer, slot_mapping[ok], key[:n][ok], value[:n][ok])

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: Any,
                attn_metadata: Any, output: torch.Tensor, **kw: Any) -> torch.Tensor:
        return output


def _run_vllm_path(schedule: Sequence[dict[str, int]], prompt_len: dict[str, int], Hkv: int, G: int, D: int,
                   L: int, scale: float, seed: int) -> tuple[dict[str, list[Snapshot]],
                                                             dict[str, list[dict[str, torch.Tensor]]]]:
    """Drive the vLLM attention wrapper as the worker does (reserve -> metadata -> per layer
    ``do_kv_cache_update`` + ``forward`` on flat ``[T, H, D]`` tensors with vLLM's padding rows) over
    ``schedule`` (one dict request -> new tokens per engine step); returns the reference snapshots and
    the gathered runtime values after every step of each request."""
    total = {r: sum(step.get(r, 0) for step in schedule) for r in prompt_len}
    g = torch.Generator().manual_seed(seed)
    data = {r: {"q": torch.randn(L, total[r], G * Hkv, D, generator=g) * 2,
                "k": torch.randn(L, total[r], Hkv, D, generator=g),
                "v": torch.randn(L, total[r], Hkv, D, generator=g)} for r in prompt_len}
    cache = VTokenCache(L, Hkv, D, block_size=4, num_blocks=64, kv_layout="vllm_cpu", stat_names=STORED_STATS,
                        max_requests=8)
    col = StatsCollector(cache, STORED_STATS, vt.StatsConfig(obs_window=OBS, history_window=HIST,
                                                             low_attn_threshold=THR), G)
    runner = SimpleNamespace(_vt_collector=col, _vt_step=None, _vt_rowstep=None)  # no request in per-row pages
    impls = [VTokenAttentionImpl(_PagedImpl(cache, layer, scale), runner, layer) for layer in range(L)]
    steps: dict[str, list[list[int]]] = {r: [] for r in prompt_len}
    got: dict[str, list[dict[str, torch.Tensor]]] = {r: [] for r in prompt_len}
    for r in prompt_len:
        cache.add_request(r)
    for sched in schedule:
        reqs = list(sched)
        starts = [cache.logical_len(r) for r in reqs]
        slots = [cache.reserve(r, sched[r]) for r in reqs]
        md = cache.attention_metadata(reqs)
        pos = [np.arange(a, a + sched[r]) for a, r in zip(starts, reqs, strict=True)]
        qsl = np.concatenate([[0], np.cumsum([sched[r] for r in reqs])])
        tok, qpos = build_step_index(qsl, np.concatenate(pos), list(range(len(reqs))))
        plen = torch.as_tensor([prompt_len[r] for r in reqs], dtype=torch.int64)
        runner._vt_step = StepContext(reqs, md, tok, qpos, plen, True)
        slot_mapping = torch.as_tensor(np.concatenate([*slots, [-1]]))  # one padding token
        for layer, impl in enumerate(impls):
            flat = {x: torch.cat([*(data[r][x][layer, p] for r, p in zip(reqs, pos, strict=True)),
                                  torch.full((2, *data[reqs[0]][x].shape[2:]), 7.0)])  # vLLM's padding rows
                    for x in "qkv"}
            impl.do_kv_cache_update(None, flat["k"], flat["v"], None, slot_mapping)
            impl.forward(None, flat["q"], flat["k"], flat["v"], None, md, torch.empty(0))
        runner._vt_step = None
        for r, p in zip(reqs, pos, strict=True):
            steps[r].append(p.tolist())
            got[r].append(cache.gather_stats(r))
    snaps = {}
    for r in prompt_len:
        probs = [dense_probs(data[r]["q"][layer].transpose(0, 1), data[r]["k"][layer].transpose(0, 1), scale)
                 for layer in range(L)]
        snaps[r] = reference_stats(probs, steps[r], G, PARAMS, prompt_len[r], VLLM_SEMANTICS,
                                   keys=[k.transpose(0, 1) for k in data[r]["k"]],
                                   values=[v.transpose(0, 1) for v in data[r]["v"]])
    return snaps, got


# a: prompt of 13 in chunks 4, 4, 3, 2 (obs window 8..12 spans two chunks, history window 6..12 three);
# b: prompt of 6 in one chunk (longer than the obs window), then decodes next to a's prefill chunks;
# c: prompt of 9 in chunks 8, 1 (windows span a long chunk and a one-token chunk).
SCHEDULE = [
    {"a": 4, "b": 6, "c": 8},
    {"b": 1, "a": 4, "c": 1},
    {"a": 3, "b": 1, "c": 1},
    {"a": 2, "b": 1},
    {"a": 1, "b": 1, "c": 1},
    {"c": 1, "a": 1},
]
PROMPT_LEN = {"a": 13, "b": 6, "c": 9}


@pytest.mark.parametrize("G", [1, 3], ids=["mha", "gqa3"])
def test_vllm_path_matches_dense_reference_every_step(G: int) -> None:
    snaps, got = _run_vllm_path(SCHEDULE, PROMPT_LEN, Hkv=2, G=G, D=16, L=2, scale=0.3, seed=G)
    for r, w in (("a", OBS), ("c", OBS)):  # the prompt's observation window spans prefill chunks
        plen = PROMPT_LEN[r]
        assert sum(any(plen - w <= p < plen for p in sn.step) for sn in snaps[r]) > 1
    for r in PROMPT_LEN:
        assert len(got[r]) == len(snaps[r]) >= 4
        for k, (g, want) in enumerate(zip(got[r], snaps[r], strict=True)):
            _check(g, want, f"request {r}, step {k} (positions {want.step[0]}..{want.step[-1]})")
        _check_not_vacuous(snaps[r], f"request {r}")
