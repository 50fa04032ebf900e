"""Per-row pages through the GPU Triton backend's own kernels (issue 39): ``python -m vtoken_bench.gpu_rows_check``.

vLLM 0.32's Triton attention backend keeps each layer's cache as ``[NB, H, bs, 2D]`` (a (head, slot)'s key then
its value), physically HND: every (block, KV head) is one contiguous region, the same one-head page the CPU
path uses (:func:`vtoken_runtime.vllm_plugin.row_attention.hnd_layer_pages`). This check writes a step's keys
and values with vLLM's ``triton_reshape_and_cache_flash`` and attends with vLLM's ``unified_attention`` (the
call ``TritonAttentionImpl.forward`` makes), one sequence per (request, KV head) over pages of any layer, for
random rows of unequal lengths, decode and chunk queries, and compares every query head's output with the
dense reference over its row's keys (the runtime's ``dense_attention``).

On a CUDA device it runs the compiled kernels. Without one it runs them under the Triton interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported; vLLM's CPU build replaces Triton with a placeholder,
so the real module is put back for this process only): the same kernels, the same arguments. Prints one JSON
line ``{"device", "interpreted", "cases", "max_abs_err", "pass"}``; exit 0 when every case is within
``--tol``, 1 otherwise. Needs vLLM (not on the lent GPU machine, which has no vLLM: there the plain
``tests/gpu`` checks run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any


def _setup() -> tuple[Any, bool]:
    """``(torch device, interpreted)``; on a machine without CUDA: the Triton interpreter, and vLLM's Triton
    shim pointed at the real Triton before any vLLM Triton kernel module is imported."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), False
    os.environ["TRITON_INTERPRET"] = "1"
    if any(m.startswith("vllm.v1.attention.ops.triton") for m in sys.modules):
        raise RuntimeError("vLLM's Triton kernels were imported before the interpreter was set up; run this check "
                           "in its own process")
    import triton
    import triton.language
    import vllm.triton_utils as vtu

    vtu.triton, vtu.tl, vtu.HAS_TRITON = triton, triton.language, True
    # the write wrapper picks a tile size from the device's compute capability: the interpreter stands for 9.0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    return torch.device("cpu"), True


def run(cases: int = 12, seed: int = 0, tol: float = 1e-4) -> dict[str, Any]:
    dev, interpreted = _setup()
    import numpy as np
    import torch

    from vtoken_runtime.paged_attention import dense_attention
    from vtoken_runtime.vllm_plugin.row_attention import (
        build_row_batch,
        hnd_layer_pages,
        triton_row_attention,
        triton_write_rows,
    )

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    L, NB, H, BS, D, G = 3, 12, 2, 16, 32, 2
    worst = 0.0
    for _ in range(cases):
        buf = torch.zeros(L, NB, H, BS, 2 * D, device=dev)
        pages = hnd_layer_pages([buf[layer] for layer in range(L)])
        keys, values = pages
        layer = int(rng.integers(L))
        r_n = int(rng.integers(1, 4))
        q = rng.integers(1, 4, size=r_n)  # new tokens per request (decode: 1; chunks: 2-3)
        lens = rng.integers(q[:, None], q[:, None] + 40, size=(r_n, H))  # each row's length after the step
        free = rng.permutation(L * NB * H).tolist()  # any page of any layer
        row_pages = [[free.pop() for _ in range(-(-int(n) // BS))] for n in lens.reshape(-1)]
        batch = build_row_batch(q.tolist(), lens, row_pages, BS)
        hist = {}  # (request, head) -> (keys [n, D], values [n, D]) of the whole row
        for r in range(r_n):
            for h in range(H):
                n = int(lens[r, h])
                k, v = torch.randn(n, D, device=dev), torch.randn(n, D, device=dev)
                hist[r, h] = (k, v)
                pg = torch.as_tensor(row_pages[r * H + h], device=dev)
                old = torch.arange(n - int(q[r]), device=dev)  # earlier tokens: written directly
                keys[pg[old // BS], old % BS, 0] = k[old]
                values[pg[old // BS], old % BS, 0] = v[old]
        t_n = int(q.sum())
        key = torch.zeros(t_n, H, D, device=dev)
        value = torch.zeros(t_n, H, D, device=dev)
        starts = np.cumsum(q) - q
        for r in range(r_n):
            for h in range(H):
                k, v = hist[r, h]
                key[starts[r]:starts[r] + q[r], h] = k[-int(q[r]):]
                value[starts[r]:starts[r] + q[r], h] = v[-int(q[r]):]
        query = torch.randn(t_n, H * G, D, device=dev)
        triton_write_rows(key, value, pages, batch)  # the step's tokens: vLLM's Triton write kernel
        scale = 1.0 / math.sqrt(D)
        out = triton_row_attention(query, pages, batch, scale)
        for r in range(r_n):
            for h in range(H):
                k, v = hist[r, h]
                n, nq = k.shape[0], int(q[r])
                qs = query[starts[r]:starts[r] + nq, h * G:(h + 1) * G]  # [nq, G, D]
                ref = dense_attention(qs.float().cpu(), k.cpu()[None], v.cpu()[None], torch.arange(n - nq, n),
                                      torch.arange(n)[None], scale)
                got = out[starts[r]:starts[r] + nq, h * G:(h + 1) * G].float().cpu()
                worst = max(worst, float((got - ref.reshape(got.shape)).abs().nan_to_num(nan=float("inf")).max()))  # NaN fails
        del layer
    return {"device": str(dev), "interpreted": interpreted, "cases": cases, "max_abs_err": worst, "tol": tol,
            "pass": worst <= tol}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    res = run(a.cases, a.seed, a.tol)
    print(json.dumps(res))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
