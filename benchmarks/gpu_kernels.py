"""Achieved memory bandwidth of the fused select, repack and statistics kernels on one GPU.

    python benchmarks/gpu_kernels.py [--json out.json]          # CUDA device, < 5 minutes
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke  # CPU dry run of every code path

For each kernel: (1) checks the result against the torch reference on the same device (select:
bit-identical mask; repack: byte-identical; stats: within tolerance), (2) times it with CUDA events
(median of ``--iters`` after warm-up), (3) counts the bytes it must move at least once (inputs read
+ outputs written) and divides by the time, and (4) times a plain device copy of the same number of
bytes (``dst.copy_(src)``, which reads and writes each byte: ``2 * bytes`` of traffic) for the
"x copy" column = kernel bandwidth / copy bandwidth.

Shapes (Llama-3-8B-like decode on one GPU): 32 layers, 8 KV heads, 32 query heads, head size 128,
bf16 cache, block size 16.
  select[single]  h2o keep mask, B=16 requests x 32x8 rows x N=2048 tokens (rows fit in registers)
  select[tiled]   h2o keep mask, B=2 x 32x8 rows x N=32768 (multi-pass radix select, 6 passes)
  repack          compact plan on one layer's [NB, H, bs, 2D] bf16 cache: 25% of 64K slots per head move
  stats           decode step (Q=1), B=32 requests x 4096 cached tokens, all four statistics, one layer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def timer(dev: torch.device, iters: int):  # type: ignore[no-untyped-def]
    def measure(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(3):
            fn()
        if dev.type != "cuda":
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)

    return measure


def _copy_bw(nbytes: int, dev: torch.device, measure) -> float:  # type: ignore[no-untyped-def]
    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src))
    return 2 * nbytes / t  # read + write


def bench_select(dev: torch.device, measure, smoke: bool) -> list[dict]:  # type: ignore[no-untyped-def]
    import vtoken_policies
    from vtoken_sdk.batch import StatsBatch
    from vtoken_sdk.torch_backend import TorchPolicy
    from vtoken_sdk.triton_backend import TritonPolicy

    out = []
    pol = vtoken_policies.load("h2o")
    shapes = [("select[single]", 16, 32, 8, 2048), ("select[tiled]", 2, 32, 8, 32768)]
    if smoke:
        shapes = [("select[single]", 2, 1, 2, 300), ("select[tiled]", 1, 1, 2, 600)]
    for label, B, L, H, N in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        st = {"attn_sum": (torch.randint(0, 1000, (B, L, H, N), generator=g) / 37.0).float().to(dev)}
        lengths = torch.full((B,), N, device=dev)
        seq = lengths + 100
        batch = StatsBatch(stats=st, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, N, seq),
                           seq_lens=seq)
        tp = TritonPolicy(pol, max_single=0 if "tiled" in label else 2048, tile=256 if smoke else 1024)
        ok = bool(torch.equal(tp.keep_mask(batch), TorchPolicy(pol).keep_mask(batch)))
        t = measure(lambda tp=tp, batch=batch: tp.keep_mask(batch))
        nbytes = B * L * H * N * 4 + B * L * H * N * 1 + B * N * 8  # stats read, mask written, positions
        out.append({"kernel": label, "check": ok, "ms": t * 1e3, "bytes": nbytes, "GBps": nbytes / t / 1e9,
                    "copy_GBps": _copy_bw(nbytes, dev, measure) / 1e9})
    return out


def bench_repack(dev: torch.device, measure, smoke: bool) -> list[dict]:  # type: ignore[no-untyped-def]
    from vtoken_runtime.kernels.repack_triton import move_rows

    H, D, bs = (8, 128, 16) if not smoke else (2, 8, 4)
    NB = 4096 if not smoke else 16
    S = NB * bs
    cache = torch.randn(NB, H, bs, 2 * D, device=dev).to(torch.bfloat16)
    view = cache.view(NB * H * bs, 2 * D)
    rng = np.random.default_rng(0)
    m_per_head = S // 4
    rows_src, rows_dst = [], []
    for h in range(H):
        slots = rng.permutation(S)[: 2 * m_per_head]
        s, d = slots[:m_per_head], slots[m_per_head:]  # disjoint: a compact plan
        rows_src.append(((s // bs) * H + h) * bs + s % bs)
        rows_dst.append(((d // bs) * H + h) * bs + d % bs)
    src = torch.as_tensor(np.concatenate(rows_src), device=dev)
    dst = torch.as_tensor(np.concatenate(rows_dst), device=dev)
    want = view.clone()
    want[dst] = want[src]
    got = view.clone()
    move_rows(got, src, dst, "compact")
    ok = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
    out = []
    for mode in ("compact", "ordered"):
        t = measure(lambda mode=mode: move_rows(view, src, dst, mode))
        moved = src.numel() * 2 * D * 2
        nbytes = 2 * moved + 2 * src.numel() * 8  # rows read + written, indices read
        out.append({"kernel": f"repack[{mode}]", "check": ok, "ms": t * 1e3, "bytes": nbytes,
                    "GBps": nbytes / t / 1e9, "copy_GBps": _copy_bw(moved, dev, measure) / 1e9})
    return out


def bench_stats(dev: torch.device, measure, smoke: bool) -> list[dict]:  # type: ignore[no-untyped-def]
    from vtoken_runtime.kernels.attn_stats_ref import STAT_NAMES, apply_step_stats, step_stats
    from vtoken_runtime.kernels.attn_stats_triton import update_attn_stats

    B, Hq, Hkv, D, bs, N = (32, 32, 8, 128, 16, 4096) if not smoke else (2, 4, 2, 16, 4, 40)
    nbpr = N // bs + 1
    NB = B * nbpr
    S = NB * bs
    cache = (torch.randn(NB, Hkv, bs, 2 * D, device=dev)).to(torch.bfloat16)
    key_cache = cache[..., :D].permute(0, 2, 1, 3)
    bt = torch.arange(NB, dtype=torch.int32, device=dev).view(B, nbpr)
    lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    kpos = torch.full((Hkv, S), -1, dtype=torch.int64, device=dev)
    j = torch.arange(N, device=dev)
    for b in range(B):
        kpos[:, (bt[b, j // bs].long() * bs + j % bs)] = j
    q = torch.randn(B, 1, Hq, D, device=dev).to(torch.bfloat16)
    qpos = torch.full((B, 1), N - 1, dtype=torch.int64, device=dev)
    stats = {n: torch.zeros(Hkv, S, device=dev) for n in STAT_NAMES}
    ref = {n: torch.zeros(Hkv, S, device=dev) for n in STAT_NAMES}
    update_attn_stats(q, key_cache, bt, lens, qpos, kpos, stats)
    c = step_stats(q, key_cache, key_cache, bt, lens, qpos, kpos)
    apply_step_stats(ref, c, bt, lens, qpos, bs)
    ok = all(bool(torch.allclose(stats[n], ref[n], atol=1e-4, rtol=1e-3)) for n in ("attn_sum", "attn_last"))
    t = measure(lambda: update_attn_stats(q, key_cache, bt, lens, qpos, kpos, stats))
    keys = B * N * Hkv * D * 2
    nbytes = keys + B * N * Hkv * 8 + B * N * Hkv * 4 * (2 + 1 + 1 + 2)  # keys, positions, stats r/w
    return [{"kernel": "attn_stats[decode]", "check": ok, "ms": t * 1e3, "bytes": nbytes,
             "GBps": nbytes / t / 1e9, "copy_GBps": _copy_bw(nbytes, dev, measure) / 1e9}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        dev = torch.device("cpu")
        iters = 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on a GPU machine, or use TRITON_INTERPRET=1 ... --smoke")
        dev = torch.device("cuda")
        iters = a.iters
    measure = timer(dev, iters)
    t0 = time.time()
    rows = bench_select(dev, measure, a.smoke) + bench_repack(dev, measure, a.smoke) + bench_stats(dev, measure,
                                                                                                   a.smoke)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}   total {time.time() - t0:.1f} s")
    print(f"{'kernel':22} {'check':>6} {'ms':>9} {'MB':>9} {'GB/s':>9} {'copy GB/s':>10} {'x copy':>7}")
    for r in rows:
        r["x_copy"] = r["GBps"] / r["copy_GBps"] if r["copy_GBps"] else 0.0
        print(f"{r['kernel']:22} {('ok' if r['check'] else 'FAIL'):>6} {r['ms']:9.3f} {r['bytes'] / 1e6:9.2f} "
              f"{r['GBps']:9.1f} {r['copy_GBps']:10.1f} {r['x_copy']:7.2f}")
    if a.json:
        a.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    if not all(r["check"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
