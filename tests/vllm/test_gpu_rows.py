"""Per-row pages through the GPU Triton backend's own kernels (issue 39), checked on CPU.

``python -m vtoken_bench.gpu_rows_check`` runs vLLM's ``triton_reshape_and_cache_flash`` and ``unified_attention``
(the Triton attention backend's write and attention calls) over one-head pages of an HND cache, one sequence per
(request, KV head), pages of any layer, under the Triton interpreter here (compiled on a CUDA device), and
compares with dense attention over each row's keys. Its own process: the interpreter must be set before any
Triton kernel module is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vtoken_bench.gpu_rows_check import vllm_kv_views  # noqa: E402
from vtoken_runtime.vllm_plugin.row_attention import hnd_layer_pages  # noqa: E402

pytestmark = pytest.mark.vllm


def test_vllms_triton_kernels_attend_exactly_over_per_row_pages_of_an_hnd_cache() -> None:
    res = subprocess.run([sys.executable, "-m", "vtoken_bench.gpu_rows_check", "--cases", "12"], capture_output=True,
                         text=True, timeout=600)
    line = res.stdout.strip().splitlines()[-1]
    got = json.loads(line)
    assert res.returncode == 0 and got["pass"], (res.returncode, line, res.stderr[-2000:])
    assert got["cases"] == 12 and got["max_abs_err"] < 1e-4
    assert got["interpreted"] == (not torch.cuda.is_available())


def test_hnd_pages_are_one_page_space_and_refuse_other_layouts() -> None:
    buf = torch.arange(2 * 3 * 2 * 4 * 6, dtype=torch.float32).view(2, 3, 2, 4, 6)  # [L, NB, H, bs, 2D]
    keys, values = hnd_layer_pages([buf[0], buf[1]])
    assert keys.shape == values.shape == (2 * 3 * 2, 4, 1, 3)
    page = (1 * 3 + 2) * 2 + 1  # layer 1, block 2, head 1
    assert torch.equal(keys[page, :, 0], buf[1, 2, 1, :, :3]) and torch.equal(values[page, :, 0], buf[1, 2, 1, :, 3:])
    with pytest.raises(ValueError, match="consecutive view"):
        hnd_layer_pages([buf[1], buf[0]])
    with pytest.raises(ValueError, match="HND layout"):
        hnd_layer_pages([buf[0].transpose(1, 2), buf[1].transpose(1, 2)])


def test_the_workers_row_cache_runs_on_the_triton_backend_end_to_end() -> None:
    """``VllmRowCache(backend="triton")`` over vLLM's own HND views: handoff (K/V moved in page space), mixed
    batches with a uniform request, a repacking eviction midway, every row exact; every block back."""
    res = subprocess.run([sys.executable, "-m", "vtoken_bench.gpu_rows_check", "--cache", "--steps", "6"],
                         capture_output=True, text=True, timeout=600)
    line = res.stdout.strip().splitlines()[-1]
    got = json.loads(line)
    assert res.returncode == 0 and got["pass"], (res.returncode, line, res.stderr[-2000:])
    assert got["rows_checked"] == 6 * 3 * 3 * 2  # steps x layers x requests x KV heads
    assert got["row_lens"][0] < got["row_lens"][1]  # unequal rows
    assert got["blocks_freed_midway"] >= 1 and got["all_blocks_back"]
    assert got["max_abs_err"] < 1e-4


def _views(layout: str) -> list[torch.Tensor]:
    return vllm_kv_views(layout, 2, 8, 2, 32, 16, torch.float32)


def _gpu_runner(impl: type) -> tuple[object, object]:
    """What ``VTokenRunnerMixin._vt_row_cache`` reads of a GPU runner (no probed CPU maps) and one layer."""
    from types import SimpleNamespace

    from vtoken_runtime.block_pool import BlockPool
    from vtoken_runtime.vllm_plugin.config import PluginConfig

    runner = SimpleNamespace(
        _vt_policy=PluginConfig(policy="ada_snapkv").load_policy(), _vt_kvmaps=None,
        _vt_cfg=SimpleNamespace(mode="compact", debug=True), _vt_pp=1, _vt_hybrid=False, _vt_pool=BlockPool(8),
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4)))
    return runner, SimpleNamespace(impl=object.__new__(impl))


def test_gpu_worker_builds_triton_row_pages_and_serves_other_backends_and_layouts_uniformly(
        caplog: pytest.LogCaptureFixture) -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vtoken_runtime.vllm_plugin.worker import VTokenRunnerMixin

    runner, layer = _gpu_runner(TritonAttentionImpl)
    rows = VTokenRunnerMixin._vt_row_cache(runner, _views("LBHNC"), layer)
    assert rows.backend == "triton" and rows.num_layers == 2 and rows.num_blocks == 8
    assert not runner._vt_policy.spec.uniform  # the policy as configured
    for impl, layout in ((TritonAttentionImpl, "LBNHC"), (FlashAttentionImpl, "LBHNC")):
        runner, layer = _gpu_runner(impl)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vtoken.vllm"):
            assert VTokenRunnerMixin._vt_row_cache(runner, _views(layout), layer) is None
        assert runner._vt_policy.spec.uniform and runner._vt_policy.name == "ada_snapkv"  # its uniform twin
        assert "served with equal budgets" in caplog.text and "TRITON_ATTN" in caplog.text, caplog.text
    runner, layer = _gpu_runner(TritonAttentionImpl)
    runner._vt_policy = runner._vt_policy.configure(allocation=__import__("vtoken_sdk").Uniform())
    assert VTokenRunnerMixin._vt_row_cache(runner, _views("LBHNC"), layer) is None  # uniform: no row pages


def test_gpu_worker_asks_for_the_hnd_layout_only_for_unequal_budgets() -> None:
    from vtoken_runtime.vllm_plugin.config import PluginConfig
    from vtoken_runtime.vllm_plugin.gpu_worker import VTokenGPUWorker, prefer_row_layout

    names = ["LBNHC", "LBHNC", "BLNHC"]
    assert prefer_row_layout(names, PluginConfig(policy="ada_snapkv").load_policy()) == ["LBHNC", "LBNHC", "BLNHC"]
    assert prefer_row_layout(names, PluginConfig(policy="h2o").load_policy()) == names
    assert prefer_row_layout(names, None) == names
    assert prefer_row_layout(["LBNHC"], PluginConfig(policy="duo_attention").load_policy()) == ["LBNHC"]
    assert "get_supported_kv_cache_layouts" in VTokenGPUWorker.__dict__  # the hook vLLM's engine core calls
