"""The GPU path, as far as a CPU machine can test it with vLLM's real GPU sources.

* the GPU worker / runner classes compose with vLLM's ``gpu_worker.Worker`` / ``GPUModelRunner``;
* every unsupported configuration is refused with its message, and CUDA-graph modes are forced to
  PIECEWISE exactly for policies that read statistics;
* an emulated engine (vLLM's block manager by cache length, the runner's step rewrite
  ``place_new_tokens``, the block manager's truncation after eviction, sent to the runner's row) over K/V views made by vLLM's own
  ``create_kv_cache_views`` in the GPU layouts: vLLM's real FlashAttention and Triton metadata builders
  (``build()`` on CPU tensors) see the rewritten lengths, slots and block rows, and FlashAttention's
  rule over that metadata (keys in slot order, ``j <= seq_len - query_len + i``, here the torch paged
  reference) equals dense attention over the kept tokens, step after step, through random evictions.
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.vllm._vllm_helpers import make_tiny_model, set_env

pytestmark = pytest.mark.vllm

L, H, G, D, BS, NB = 2, 2, 2, 32, 16, 48


# ---------------------------------------------------------------- classes and guards
def test_gpu_worker_and_runner_compose_with_vllm() -> None:
    set_env()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vtoken_runtime.vllm_plugin.gpu_worker import VTokenGPURunnerMixin, VTokenGPUWorker
    from vtoken_runtime.vllm_plugin.worker import VTokenRunnerMixin

    assert issubclass(VTokenGPUWorker, Worker)
    runner = type("R", (VTokenGPURunnerMixin, GPUModelRunner), {})
    for hook in ("_update_states", "_prepare_inputs", "sample_tokens", "initialize_kv_cache"):
        mine, theirs = getattr(VTokenRunnerMixin, hook), getattr(GPUModelRunner, hook)
        assert getattr(runner, hook) is mine, hook
        p_mine = list(inspect.signature(mine).parameters)
        p_theirs = list(inspect.signature(theirs).parameters)
        assert p_mine[: len(p_mine) - ("args" in p_mine) - ("kwargs" in p_mine)] == p_theirs[: len(p_mine) - (
            "args" in p_mine) - ("kwargs" in p_mine)], (hook, p_mine, p_theirs)
    # the step rewrite writes into buffers GPUModelRunner owns
    src = inspect.getsource(GPUModelRunner.__init__)
    for attr in ("self.seq_lens", "self.optimistic_seq_lens_cpu", "self.query_start_loc", "self.query_pos"):
        assert attr in src, attr


GOOD = dict(use_v2_model_runner=False, impl_names=["FlashAttentionImpl"], alibi=False, sliding_window=False,
            cache_dtype="auto", layout="LBNHC", kernel_block_size=16, manager_block_size=16, reads_attention=True)


@pytest.mark.parametrize(("change", "message"), [
    ({"use_v2_model_runner": True}, "VLLM_USE_V2_MODEL_RUNNER=0"),
    ({"impl_names": ["FlashInferImpl"]}, "--attention-backend FLASH_ATTN or TRITON_ATTN"),
    ({"alibi": True}, "ALiBi"),
    ({"sliding_window": True}, "sliding-window"),
    ({"cache_dtype": "fp8_per_token_head"}, "per-token-head"),
    ({"cache_dtype": "fp8"}, "quantised KV cache"),
    ({"layout": "BLNHC"}, "VLLM_KV_CACHE_LAYOUT=LBNHC"),
    ({"kernel_block_size": 16, "manager_block_size": 32}, "--block-size 16"),
    ({"cache_dtype": "nvfp4"}, "--kv-cache-dtype fp8 or auto"),
])
def test_each_unsupported_configuration_is_refused_with_its_fix(change: dict, message: str) -> None:
    from vtoken_runtime.vllm_plugin.gpu_worker import check_gpu_config

    check_gpu_config(**GOOD)
    check_gpu_config(**{**GOOD, "impl_names": ["TritonAttentionImpl"], "cache_dtype": "bfloat16"})
    check_gpu_config(**{**GOOD, "cache_dtype": "fp8", "reads_attention": False})  # moved as bytes
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check_gpu_config(**{**GOOD, **change})


@pytest.mark.parametrize(("policy", "mode", "expect"), [
    ("h2o", "FULL_AND_PIECEWISE", "PIECEWISE"),
    ("h2o", "FULL", "PIECEWISE"),
    ("h2o", "PIECEWISE", "PIECEWISE"),
    ("knorm", "FULL_AND_PIECEWISE", "PIECEWISE"),       # key norms: collected in the KV-update hook
    ("streaming_llm", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),  # positions only: full graphs kept
    ("duo_attention", "FULL_AND_PIECEWISE", "PIECEWISE"),  # positions only, but per-row pages: the wrapper runs
    ("duo_attention", "NONE", "NONE"),
    ("h2o", "NONE", "NONE"),
])
def test_cuda_graph_mode_is_forced_piecewise_only_for_statistics(policy: str, mode: str, expect: str) -> None:
    set_env()
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vtoken_runtime.vllm_plugin.config import PluginConfig
    from vtoken_runtime.vllm_plugin.gpu_worker import force_piecewise_graphs

    pol = PluginConfig(policy=policy).load_policy()
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode])
    cc.splitting_ops = [*cc._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    changed = force_piecewise_graphs(cc, pol)
    assert cc.cudagraph_mode == CUDAGraphMode[expect]
    assert changed == (mode != expect)


def test_statistics_with_attention_captured_in_the_graph_are_refused() -> None:
    set_env()
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vtoken_runtime.vllm_plugin.config import PluginConfig
    from vtoken_runtime.vllm_plugin.gpu_worker import force_piecewise_graphs

    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL)
    cc.splitting_ops = []
    with pytest.raises(ValueError, match="splitting_ops"):
        force_piecewise_graphs(cc, PluginConfig(policy="h2o").load_policy())


def test_engine_args_pick_the_gpu_worker_and_piecewise_graphs_on_cuda() -> None:
    from vtoken_runtime.vllm_plugin import GPU_WORKER_CLS, WORKER_CLS, serve_flags, vllm_engine_args

    a = vllm_engine_args(policy="h2o", eviction_ratio=0.5, device="cuda")
    assert a["worker_cls"] == GPU_WORKER_CLS and a["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "compilation_config" not in vllm_engine_args(policy="streaming_llm", device="cuda")
    duo = vllm_engine_args(policy="duo_attention", device="cuda")  # unequal rows: the wrapper, the Triton backend
    assert duo["compilation_config"] == {"cudagraph_mode": "PIECEWISE"} and duo["attention_backend"] == "TRITON_ATTN"
    assert "attention_backend" not in vllm_engine_args(policy="duo_attention", device="cpu")
    assert "attention_backend" not in vllm_engine_args(policy="h2o", device="cuda")
    flags = serve_flags(policy="ada_snapkv", device="cuda")
    assert flags[flags.index("--attention-backend") + 1] == "TRITON_ATTN"
    mine = {"cudagraph_mode": "FULL"}  # the user's choice is kept (the worker still enforces PIECEWISE)
    assert vllm_engine_args(policy="h2o", device="cuda", compilation_config=mine)["compilation_config"] is mine
    assert vllm_engine_args(policy="h2o", device="cpu")["worker_cls"] == WORKER_CLS
    flags = serve_flags(policy="h2o", device="cuda")
    assert flags[flags.index("--worker-cls") + 1] == GPU_WORKER_CLS
    assert flags[flags.index("--compilation-config") + 1] == '{"cudagraph_mode": "PIECEWISE"}'
    with pytest.raises(ValueError, match="device"):
        vllm_engine_args(device="tpu")


@pytest.mark.parametrize("worker", ["cpu", "cuda"])
def test_the_scheduler_keeps_vllms_defaults_for_either_worker(worker: str) -> None:
    """Prefix caching and asynchronous scheduling (vLLM's defaults on GPUs) start with the GPU worker as with the CPU
    one: the scheduler refuses only prefix caching with unequal row budgets."""
    from types import SimpleNamespace

    from vtoken_runtime.vllm_plugin import vllm_engine_args
    from vtoken_runtime.vllm_plugin.scheduler import check_supported

    def cfg(policy: str) -> SimpleNamespace:
        a = vllm_engine_args(policy=policy, device=worker)
        return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True),
                               scheduler_config=SimpleNamespace(async_scheduling=True),
                               parallel_config=SimpleNamespace(worker_cls=a["worker_cls"]),
                               additional_config=a["additional_config"], speculative_config=None,
                               kv_transfer_config=None)

    check_supported(cfg("h2o"))
    with pytest.raises(ValueError, match="unequal row budgets"):
        check_supported(cfg("ada_snapkv"))


# ---------------------------------------------------------------- emulated engine + real builders
def _views(layout_name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-layer logical [NB, H, bs, 2D] views of one backing buffer, made by vLLM's create_kv_cache_views."""
    from vtoken_bench.gpu_rows_check import vllm_kv_views

    return vllm_kv_views(layout_name, L, NB, H, D, BS, dtype)


class EmulatedEngine:
    """vLLM's side of a step, as the plugin sees it: block rows allocated by CACHE length (the vToken
    scheduler's block manager), the runner's step rewrite, ``reshape_and_cache`` through the slot mapping, and
    the truncation after eviction (the block manager returns the tail blocks to the free list; the next
    scheduler output gives the runner the truncated row)."""

    def __init__(self, views: list[torch.Tensor], granularity: str, max_reqs: int = 6) -> None:
        from vtoken_runtime.cache import VTokenCache
        from vtoken_runtime.kv_layout import KVLayoutAdapter, LayoutCopyEngine
        from vtoken_runtime.vllm_plugin.worker import ExternalPool

        adapters = [KVLayoutAdapter.from_view(v, D) for v in views]
        self.views = views
        self.pool = ExternalPool(NB)
        self.cache = VTokenCache(L, H, D, BS, NB, granularity=granularity, mode="compact", dtype=views[0].dtype,
                                 kv_caches=views, async_copy=True, pool=self.pool, max_requests=max_reqs,
                                 kv_views=[a.kv_views(v) for a, v in zip(adapters, views, strict=True)],
                                 copy_engine=partial(LayoutCopyEngine, adapters=adapters))
        self.free = list(range(1, NB))  # block 0: vLLM's null block
        self.rows: dict[str, list[int]] = {}
        self.max_blocks = NB

    def schedule(self, rid: str, n: int) -> None:
        row = self.rows.setdefault(rid, [])
        used = self.cache.cache_len(rid) if self.cache.has_request(rid) else 0
        while len(row) * BS < used + n:
            row.append(self.free.pop(0))

    def step(self, batch: list[tuple[str, int]]) -> dict:
        from vtoken_runtime.vllm_plugin.step_inputs import place_new_tokens, true_positions

        cache = self.cache
        cache.fence()  # _update_states: before vLLM zeroes or reuses blocks
        rids = [r for r, _ in batch]
        n = np.array([k for _, k in batch], dtype=np.int32)
        for r, k in batch:
            self.schedule(r, int(k))
        computed = np.array([cache.logical_len(r) if cache.has_request(r) else 0 for r in rids], dtype=np.int32)
        rows = np.zeros((len(rids), self.max_blocks), dtype=np.int32)
        per_row = np.zeros(len(rids), dtype=np.int32)
        for i, r in enumerate(rids):
            rows[i, : len(self.rows[r])] = self.rows[r]
            per_row[i] = len(self.rows[r])
        qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        slots = np.full(int(qsl[-1]), -1, dtype=np.int64)
        seq = place_new_tokens(cache, self.pool, rids, n, computed, rows, per_row, qsl, slots,
                               lambda r: cache.add_request(r))
        cache.fence()
        return {"rids": rids, "n": n, "qsl": qsl, "slots": slots, "seq": seq, "rows": rows,
                "positions": true_positions(computed, n)}

    def write_kv(self, layer: int, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's reshape_and_cache_flash: token t -> view[slot // bs, :, slot % bs, :D | D:]."""
        s = torch.as_tensor(slots)
        view = self.views[layer]
        view[s // BS, :, s % BS, :D] = k.to(view.dtype)
        view[s // BS, :, s % BS, D:] = v.to(view.dtype)

    def truncate(self, rid: str) -> None:
        keep = -(-self.cache.cache_len(rid) // BS)
        row = self.rows[rid]
        self.free += row[keep:]
        del row[keep:]


def _common_metadata(st: dict) -> object:
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    B = len(st["rids"])
    qsl = torch.as_tensor(st["qsl"], dtype=torch.int32)
    seq = torch.as_tensor(st["seq"], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq.clone(), num_reqs=B,
        num_actual_tokens=int(qsl[-1]), max_query_len=int(st["n"].max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.as_tensor(st["rows"]), slot_mapping=torch.as_tensor(st["slots"]),
        seq_lens_cpu_upper_bound=seq.clone(), positions=torch.as_tensor(st["positions"]),
        is_prefilling=torch.zeros(B, dtype=torch.bool))


def _builders() -> list:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model = make_tiny_model(Path("/tmp") / "vtoken-tests-tiny-gpu-path")
    vc = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True,
                                             max_model_len=512), cache_config=CacheConfig(block_size=BS))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    with set_current_vllm_config(vc):
        return [B(spec, names, vc, torch.device("cpu")) for B in (FlashAttentionMetadataBuilder,
                                                                  TritonAttentionMetadataBuilder)]


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_real_builders_see_the_rewrite_and_attention_equals_dense_over_kept(layout: str, granularity: str) -> None:
    set_env()
    from vtoken_runtime.paged_attention import paged_attention

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    builders = _builders()
    views = _views(layout, torch.float32)
    eng = EmulatedEngine(views, granularity)
    cache = eng.cache
    prompts = {"a": 70, "b": 41, "c": 23}
    dense: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {r: {} for r in prompts}  # per layer K,V
    chunk = 32
    checked_builds = evictions = 0
    for _step in range(14):
        batch = []
        for r, plen in prompts.items():
            done = cache.logical_len(r) if cache.has_request(r) else 0
            batch.append((r, min(chunk, plen - done) if done < plen else 1))
        st = eng.step(batch)
        T = int(st["qsl"][-1])
        q = torch.randn(L, T, H * G, D)
        for layer in range(L):
            k, v = torch.randn(T, H, D), torch.randn(T, H, D)
            eng.write_kv(layer, st["slots"], k, v)
            for t, pos in enumerate(st["positions"]):
                rid = st["rids"][int(np.searchsorted(st["qsl"], t, side="right") - 1)]
                dense[rid].setdefault(int(pos), [None] * L)[layer] = (k[t], v[t])
        for b in builders:
            md = b.build(0, _common_metadata(st))
            # the builders carry the rewritten lengths, slots and rows (and max_seq_len from them)
            want = [cache.cache_len(r) for r in st["rids"]]
            assert md.seq_lens.tolist() == want and int(md.max_seq_len) == max(want)
            assert torch.equal(md.slot_mapping[:T].long(), torch.as_tensor(st["slots"]))
            ours = cache.attention_metadata(st["rids"])
            for i, r in enumerate(st["rids"]):
                held = cache.held_blocks(r)
                assert md.block_table[i, :held].tolist() == ours.block_tables[i, :held].tolist() == eng.rows[r]
            checked_builds += 1
        # FlashAttention's rule over the FA metadata == dense attention over each query's kept keys
        md = builders[0].build(0, _common_metadata(st))
        B, Q = len(st["rids"]), int(st["n"].max())
        qpos = torch.full((B, Q), -1, dtype=torch.int64)
        for layer in range(L):
            kc, vc = views[layer].transpose(1, 2).split(D, dim=-1)  # exactly FlashAttentionImpl's split
            qb = torch.zeros(B, Q, H * G, D)
            for i in range(B):
                a, e = int(st["qsl"][i]), int(st["qsl"][i + 1])
                qb[i, : e - a] = q[layer, a:e]
                qpos[i, : e - a] = torch.as_tensor(st["positions"][a:e])
            out, _ = paged_attention(qb, kc, vc, md.block_table, md.seq_lens, qpos)
            for i, r in enumerate(st["rids"]):
                live_pos = cache.live_view(r)[0]  # [R, n] true positions kept per row
                for j in range(int(st["n"][i])):
                    p = int(qpos[i, j])
                    for h in range(H):
                        row = live_pos[0] if live_pos.shape[0] == 1 else live_pos[layer * H + h]
                        keys = sorted(int(x) for x in row if x <= p)
                        K = torch.stack([dense[r][x][layer][0][h] for x in keys])
                        V = torch.stack([dense[r][x][layer][1][h] for x in keys])
                        qh = qb[i, j, h * G:(h + 1) * G]
                        ref = torch.softmax(qh @ K.T / math.sqrt(D), -1) @ V
                        torch.testing.assert_close(out[i, j, h * G:(h + 1) * G], ref, atol=1e-5, rtol=1e-5)
        # the runner's eviction: requests past their prompt evict ~30% at random (newest kept), reclaim,
        # rows truncated to the blocks the scheduler's block manager keeps
        for r, plen in prompts.items():
            n_live = cache.live_tokens(r)
            if cache.logical_len(r) < plen or n_live < 8:
                continue
            R = 1 if granularity == "request" else L * H
            keep = np.ones((R, n_live), dtype=bool)
            for row in range(R):
                keep[row, rng.choice(n_live - 1, size=n_live * 3 // 10, replace=False)] = False
            cache.apply_keep_mask(r, keep)
            evictions += 1
        cache.reclaim()
        for r in prompts:
            eng.truncate(r)
        cache.check_invariants()
    assert evictions >= 10 and checked_builds == 28
    assert cache.tokens_moved_total > 0 and cache.blocks_freed_total > 0
