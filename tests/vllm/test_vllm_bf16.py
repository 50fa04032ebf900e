"""vToken in a bf16 vLLM engine on CPU. With AMX tiles, vLLM's CPU attention (``amx`` ISA) stores K and V
in pairs (``cpu_layout.is_affine_layout``): moves go through the probed element maps, so policies that read
no cached keys keep the amx kernels; a policy reading attention statistics or key / value vectors switches
the engine's attention to the ``vec`` kernels (affine), whose layout the statistics kernels read in place.

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


def test_reading_policy_switches_attention_to_vec(tiny: Path) -> None:
    llm = engine(tiny, {"policy": "h2o", "debug": True}, dtype="bfloat16")
    assert _isas(llm) == {"vec"}
    run = runner(llm)
    assert run.vtoken_cache.key_cache(0).dtype == torch.bfloat16
    outs = generate(llm, prompts([100, 150, 70], seed=1), [30, 20, 25])
    assert [len(o) for o in outs] == [30, 20, 25]
    assert run.vtoken_counters["tokens_evicted"] > 0 and run.vtoken_counters["policy_failures"] == 0
