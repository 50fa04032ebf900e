"""vToken in a bf16 vLLM engine on CPU. With AMX tiles, vLLM's CPU attention (``amx`` ISA) stores K and V
in pairs (``cpu_layout.is_affine_layout``): moves go through the probed element maps, so policies that read
no cached keys keep the amx kernels; so do policies reading attention statistics, whose numba kernel reads
the amx keys in place (``cpu_layout.amx_paired_keys``), and policies reading key / value vectors, read through
the probed element maps (``cpu_layout.MappedKV``); only the torch statistics backend switches the engine's
attention to the ``vec`` kernels (affine).

Exactness of moves under the amx layout: a compact engine and a naive one (which never moves a token) run
the same steps; after the first eviction every live prompt token's K and V are bit-identical in both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.vllm._vllm_helpers import engine, generate, make_tiny_model, prompts, runner  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs a CPU with AMX tiles")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_bf16") / "tiny")


def _isas(llm) -> set[str]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    run = runner(llm)
    return {layer.isa for layer in get_layers_from_vllm_config(run.vllm_config, Attention).values()}


def test_policy_none_keeps_amx_and_matches_vanilla(tiny: Path) -> None:
    ps = prompts([100, 150, 70])
    vanilla = engine(tiny, None, dtype="bfloat16")
    assert _isas(vanilla) == {"amx"}
    ref = generate(vanilla, ps, 24)
    del vanilla
    llm = engine(tiny, {"policy": "none"}, dtype="bfloat16")
    assert _isas(llm) == {"amx"}
    assert generate(llm, ps, 24) == ref
    with pytest.raises(ValueError, match="cannot be read per token"):
        runner(llm).vtoken_cache.key_cache(0)


def _kv_at(llm, rid: str) -> dict[int, torch.Tensor]:
    """True position -> K and V of every layer and head ``[L, H, 2D]`` read
    through the engine's probed element maps (not through views: the amx layout has none)."""
    cache = runner(llm).vtoken_cache
    cache.fence()  # moves run asynchronously: wait for the last plan before reading the tensors
    eng = cache.engine
    pos, phys = cache.live_slots(rid)
    out: dict[int, torch.Tensor] = {}
    bs, H, D = cache.block_size, cache.num_kv_heads, cache.head_size
    R = 2 * bs * D
    for p, s in zip(pos[0].tolist(), phys[0].tolist(), strict=True):
        blk, off = divmod(int(s), bs)
        cells = torch.as_tensor(list(eng.kmap[off]) + list(eng.vmap[off]))
        rows = []
        for t in cache.kv_caches:
            flat = t.reshape(-1)
            rows.append(torch.stack([flat[(blk * H + h) * R + cells] for h in range(H)]))
        out[int(p)] = torch.stack(rows)
    return out


def _run_until_evicted(llm, prompt: list[int], steps: int) -> str:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    eng.add_request("q", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=40, temperature=0.0,
                                                                               ignore_eos=True))
    for _ in range(steps):
        eng.step()
    cache = runner(llm).vtoken_cache
    (rid,) = list(cache.table.requests)
    return rid


def test_amx_moves_are_exact_against_a_naive_engine(tiny: Path) -> None:
    (p,) = prompts([150], seed=3)
    got = {}
    for mode in ("compact", "naive"):
        llm = engine(tiny, {"policy": "streaming_llm", "mode": mode, "debug": True}, dtype="bfloat16",
                     max_num_batched_tokens=64)
        assert _isas(llm) == {"amx"}
        rid = _run_until_evicted(llm, p, steps=6)  # 3 prompt chunks, then decode steps that evict
        run = runner(llm)
        assert run.vtoken_counters["tokens_evicted"] > 0
        if mode == "compact":
            assert run.vtoken_counters["tokens_moved"] > 0
        got[mode] = _kv_at(llm, rid)
        llm.llm_engine.abort_request(["q"])
        del llm
    prompt_pos = [q for q in got["compact"] if q < len(p)]
    assert prompt_pos and sorted(got["compact"]) == sorted(got["naive"])
    for q in prompt_pos:
        assert torch.equal(got["compact"][q].view(torch.int16), got["naive"][q].view(torch.int16)), q


def test_amx_readers_give_the_keys_and_values_the_real_op_wrote() -> None:
    """Over a cache filled by vLLM's own ``cpu_attn_reshape_and_cache`` (isa amx): ``amx_paired_keys`` unpacks to
    exactly the keys written and the ``MappedKV`` readers index exactly the keys and values written, for every
    (block, slot, head); a layout that is not amx's gives no paired keys."""
    from vllm import _custom_ops as ops

    from vtoken_runtime.vllm_plugin.cpu_layout import amx_paired_keys, probe_cpu_kv_layout, vllm_cpu_mapped

    NB, H, bs, D = 3, 2, 32, 64
    kmap, vmap = probe_cpu_kv_layout("amx", torch.bfloat16, bs, D)
    kv = torch.zeros(NB, H, bs, 2 * D, dtype=torch.bfloat16)
    kc, vc = kv.view(NB, H, 2 * bs, D).chunk(2, dim=2)
    k, v = torch.randn(NB * bs, H, D).to(torch.bfloat16), torch.randn(NB * bs, H, D).to(torch.bfloat16)
    slots = torch.randperm(NB * bs)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "amx", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    (pk,) = amx_paired_keys([kv], kmap)
    want = torch.empty(NB * bs, H, D, dtype=torch.bfloat16)
    want[slots] = k
    assert torch.equal(pk.unpack().reshape(NB * bs, H, D).view(torch.int16), want.view(torch.int16))
    (mk, mv), = vllm_cpu_mapped([kv], kmap, vmap)
    s = torch.randperm(NB * bs)[:40]
    blk, off = s // bs, s % bs
    want_v = torch.empty_like(want)
    want_v[slots] = v
    for reader, ref in ((mk, want), (mv, want_v)):
        assert torch.equal(reader[blk, off].view(torch.int16), ref[s].view(torch.int16))  # [M, H, D]
        h = torch.randint(0, H, (3, 40))
        got = reader[blk.expand(3, 40), off.expand(3, 40), h]  # [3, M, D]
        assert torch.equal(got.view(torch.int16), ref[s.expand(3, 40), h].view(torch.int16))
    vec_kmap, _ = probe_cpu_kv_layout("vec", torch.bfloat16, bs, D)
    assert amx_paired_keys([kv], vec_kmap) is None


def test_attention_policy_keeps_amx_and_reads_keys_in_place(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H2O (attention statistics only) keeps the amx kernels; every statistics call of the first steps equals the
    kernel run on the same keys unpacked into a plain tensor and the step's query rows gathered per (request, query),
    bit for bit; it evicts without a failure."""
    from vtoken_runtime.stats.collector import gather_query_rows
    from vtoken_runtime.stats.cpu_kernel import update_attn_stats_cpu

    llm = engine(tiny, {"policy": "h2o", "debug": True}, dtype="bfloat16")
    assert _isas(llm) == {"amx"}
    run = runner(llm)
    col, cache = run._vt_collector, run.vtoken_cache
    assert col is not None and col.backend == "numba" and col._keys is not None
    with pytest.raises(ValueError, match="cannot be read per token"):
        cache.key_cache(0)
    checked: list[bool] = []
    numba = col._numba

    def cross_checked(layer, query, md, query_pos, prompt_lens, scale, token_index):  # type: ignore[no-untyped-def]
        want = {n: cache.stats_tensor(n)[layer].clone() for n in col.attn}
        numba(layer, query, md, query_pos, prompt_lens, scale, token_index)
        if len(checked) < 60:
            assert token_index is not None and query.dim() == 3  # the step's query rows, read in place
            update_attn_stats_cpu(gather_query_rows(query, token_index), col._keys[layer].unpack(), md.block_tables, md.cache_lens, query_pos,
                                  cache.key_positions(layer), want, scale=scale, obs_window=col.cfg.obs_window,
                                  history_window=col.cfg.history_window,
                                  low_attn_threshold=col.cfg.low_attn_threshold, prompt_lens=prompt_lens)
            checked.append(all(torch.equal(want[n], cache.stats_tensor(n)[layer]) for n in col.attn))

    monkeypatch.setattr(col, "_numba", cross_checked)
    outs = generate(llm, prompts([100, 150, 70], seed=1), [30, 20, 25])
    assert [len(o) for o in outs] == [30, 20, 25]
    assert len(checked) == 60 and all(checked)
    assert run.vtoken_counters["tokens_evicted"] > 0 and run.vtoken_counters["policy_failures"] == 0


def test_key_reading_policy_keeps_amx_and_reads_keys_through_the_element_maps(tiny: Path) -> None:
    """KeyDiff (reads ``s.key``) keeps the amx kernels; mid-run, the keys the policy side reads for a live
    request (``gather_kv_vectors``, through ``MappedKV``) are exactly the keys of the paired-word view of the
    same cache at the same slots, after evictions and moves; it evicts without a failure."""
    from vtoken_runtime.vllm_plugin.cpu_layout import amx_paired_keys, probe_cpu_kv_layout

    (p,) = prompts([150], seed=3)
    llm = engine(tiny, {"policy": "keydiff", "debug": True}, dtype="bfloat16", max_num_batched_tokens=64)
    assert _isas(llm) == {"amx"}
    rid = _run_until_evicted(llm, p, steps=6)
    run = runner(llm)
    cache = run.vtoken_cache
    assert run.vtoken_counters["tokens_evicted"] > 0 and run.vtoken_counters["tokens_moved"] > 0
    assert run.vtoken_counters["policy_failures"] == 0
    got = cache.gather_kv_vectors([rid], ("key",))["key"][0]  # [L, H, N, D] float32
    _, phys = cache.live_slots(rid)
    bs, H = cache.block_size, cache.num_kv_heads
    kmap, _ = probe_cpu_kv_layout("amx", torch.bfloat16, bs, cache.head_size)
    for layer, pk in enumerate(amx_paired_keys(cache.kv_caches, kmap)):
        keys = pk.unpack()  # [NB, bs, H, D]
        for h in range(H):
            s = torch.as_tensor(phys[layer * H + h] if cache.num_rows > 1 else phys[0])
            assert torch.equal(got[layer, h, :len(s)], keys[s // bs, s % bs, h].float()), (layer, h)
    llm.llm_engine.abort_request(["q"])


def test_torch_statistics_backend_switches_attention_to_vec(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H2O with the torch statistics backend (which reads keys through strided views) switches the engine's
    attention to vec and evicts."""
    monkeypatch.setenv("VTOKEN_STATS_BACKEND", "torch")
    llm = engine(tiny, {"policy": "h2o", "debug": True}, dtype="bfloat16")
    assert _isas(llm) == {"vec"}
    run = runner(llm)
    assert run.vtoken_cache.key_cache(0).dtype == torch.bfloat16
    outs = generate(llm, prompts([100, 150, 70], seed=1), [30, 20, 25])
    assert [len(o) for o in outs] == [30, 20, 25]
    assert run.vtoken_counters["tokens_evicted"] > 0 and run.vtoken_counters["policy_failures"] == 0
