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


def vllm_kv_views(layout: str, layers: int, blocks: int, heads: int, head_size: int, block_size: int, dtype: Any,
                  device: Any = "cpu") -> list[Any]:
    """Per-layer logical ``[NB, H, bs, 2D]`` views of one zeroed backing buffer in ``layout`` (``"LBNHC"``,
    ``"LBHNC"``), made by vLLM's own ``create_kv_cache_views`` (the layer-outermost allocation of a full-attention
    group)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    page = spec.page_size_bytes
    t = KVCacheTensor(size=layers * blocks * page, layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                      layer_stride=blocks * page, block_stride=page)
    return create_kv_cache_views(torch.zeros(t.size, dtype=torch.int8, device=device), spec, blocks,
                                 KVCacheLayout[layout], t)


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


def run_cache(steps: int = 6, seed: int = 0, tol: float = 1e-4) -> dict[str, Any]:
    """The worker's row cache on the Triton backend end to end (``VllmRowCache(backend="triton")``, what the GPU
    worker builds): K/V views made by vLLM's own ``create_kv_cache_views`` in the HND layout (LBHNC, one int8
    allocation), two requests laid out uniformly then handed to per-row pages with random unequal keeps
    (``adopt_uniform``: the K/V move in page space), one request left uniform in the same batch, ``steps``
    decode steps (``reserve`` + ``step``: per-layer metadata, vLLM's Triton write and attention kernels), one
    further per-row eviction midway (repacks pages across blocks), every query head of every row compared
    with dense attention over the row's kept keys; at the end every block is back in the pool."""
    dev, interpreted = _setup()
    import numpy as np
    import torch

    from vtoken_runtime.block_pool import BlockPool
    from vtoken_runtime.paged_attention import dense_attention
    from vtoken_runtime.vllm_plugin.rows import VllmRowCache

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    L, NB, H, BS, D, G = 3, 24, 2, 16, 32, 2
    R = L * H
    kv = vllm_kv_views("LBHNC", L, NB, H, D, BS, torch.float32, dev)
    pool = BlockPool(NB)
    rows = VllmRowCache(kv, None, None, pool, max_requests=8, backend="triton")
    scale = 1.0 / math.sqrt(D)
    hist: dict[tuple[str, int], tuple[list, list]] = {}  # (request, row) -> (keys, values): the row's kept tokens
    uni: dict[str, list[int]] = {}  # uniform requests: vLLM block list
    lens: dict[str, int] = {}

    def put(blocks: list[int], pos: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [H, D]
        b, o = blocks[pos // BS], pos % BS
        kv[layer][b, :, o, :D] = k
        kv[layer][b, :, o, D:] = v

    for name, n in (("a", 70), ("b", 45), ("u", 38)):  # prompts laid out uniformly, as vLLM's cache holds them
        blocks = pool.allocate(-(-n // BS))
        for pos in range(n):
            for layer in range(L):
                k, v = torch.randn(H, D, device=dev), torch.randn(H, D, device=dev)
                put(blocks, pos, layer, k, v)
                for h in range(H):
                    hist.setdefault((name, layer * H + h), ([], []))
                    hist[name, layer * H + h][0].append(k[h].clone())
                    hist[name, layer * H + h][1].append(v[h].clone())
        lens[name] = n
        if name == "u":
            uni[name] = blocks
            continue
        pinned = np.arange(4)  # sinks
        keep = rng.random((R, n)) < rng.uniform(0.2, 0.9, size=(R, 1))  # unequal rows
        keep[:, :4] = True
        pos = np.tile(np.arange(n), (R, 1))
        phys = np.asarray([blocks[p // BS] * BS + p % BS for p in range(n)])
        rows.adopt_uniform(name, pinned, pos, np.tile(phys, (R, 1)), keep, blocks, n)
        for r in range(R):
            ks, vs = hist[name, r]
            hist[name, r] = ([ks[i] for i in np.flatnonzero(keep[r])], [vs[i] for i in np.flatnonzero(keep[r])])
    worst, checked, freed_mid = 0.0, 0, 0
    order = ["a", "u", "b"]  # a uniform request between row requests: one batch, both kinds
    for step_i in range(steps):
        if step_i == steps // 2:  # a further eviction of request a: rows shrink unequally, pages repack
            keep = [rng.random(len(hist["a", r][0])) < 0.6 for r in range(R)]
            for r in range(R):
                keep[r][:4] = True
                ks, vs = hist["a", r]
                hist["a", r] = ([ks[i] for i in np.flatnonzero(keep[r])], [vs[i] for i in np.flatnonzero(keep[r])])
            freed_mid = len(rows.evict("a", keep).freed)
        for name in ("a", "b"):
            if rows.reserve(name, 1) is None:
                raise RuntimeError("pool out of blocks")
        n_u = lens["u"]
        if n_u % BS == 0:
            uni["u"] += pool.allocate(1)
        lens["u"] = n_u + 1
        for name in ("a", "b"):
            lens[name] += 1
        width = max(len(b) for b in uni.values())
        block_rows = np.zeros((len(order), width), np.int64)
        block_rows[1, :len(uni["u"])] = uni["u"]
        cache_lens = np.asarray([0, lens["u"], 0])
        step = rows.step(order, np.ones(len(order), np.int64), cache_lens, block_rows, "")
        for layer in range(L):
            key, value = torch.randn(len(order), H, D, device=dev), torch.randn(len(order), H, D, device=dev)
            query = torch.randn(len(order), H * G, D, device=dev)
            step.write(layer, key, value)
            out = torch.empty(len(order), H * G * D, device=dev)
            step.attend(layer, query, out, scale)
            out = out.view(len(order), H * G, D)
            for i, name in enumerate(order):
                for h in range(H):
                    ks, vs = hist[name, layer * H + h]
                    ks.append(key[i, h].clone())
                    vs.append(value[i, h].clone())
                    k, v = torch.stack(ks).cpu(), torch.stack(vs).cpu()
                    n = k.shape[0]
                    ref = dense_attention(query[i:i + 1, h * G:(h + 1) * G].float().cpu(), k[None], v[None],
                                          torch.tensor([n - 1]), torch.arange(n)[None], scale)
                    got = out[i, h * G:(h + 1) * G].float().cpu()
                    err = (got - ref.reshape(got.shape)).abs().nan_to_num(nan=float("inf")).max()
                    worst = max(worst, float(err))
                    checked += 1
    row_lens = sorted({len(hist[name, r][0]) for name in ("a", "b") for r in range(R)})
    for name in ("a", "b"):
        rows.free(name)
    pool.free(uni.pop("u"))
    back = pool.num_free == NB
    return {"device": str(dev), "interpreted": interpreted, "steps": steps, "rows_checked": checked,
            "row_lens": [row_lens[0], row_lens[-1]], "blocks_freed_midway": freed_mid, "all_blocks_back": back,
            "max_abs_err": worst, "tol": tol, "pass": worst <= tol and back and checked > 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--cache", action="store_true",
                    help="the worker's row cache end to end on the Triton backend (run_cache) instead of the kernels")
    ap.add_argument("--steps", type=int, default=6, help="decode steps of --cache")
    a = ap.parse_args(argv)
    res = run_cache(a.steps, a.seed, a.tol) if a.cache else run(a.cases, a.seed, a.tol)
    print(json.dumps(res))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
