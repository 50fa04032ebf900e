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
