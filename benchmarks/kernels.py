"""Per-decode-step cost of the torch (CPU) path: select, repack and statistics vs attention.

    python benchmarks/kernels.py [--batch 4 --context 2048 --layers 30 --kv-heads 3 --q-heads 9 --json out.json]

One decode step of a SmolLM2-135M-shaped model (30 layers, 9 query / 3 KV heads, head size 64,
vLLM-CPU block size 32) over ``batch`` requests of ``context`` cached tokens:

  attention   torch paged attention (runtime.paged_attention, the implementation the cache uses), all layers
  statistics  the attention-statistics oracle, kernels.attn_stats_ref (probabilities + the four per-slot
              stats, the torch backend's rules), all layers
  select      the H2O policy's keep mask over [B, L, H_kv, N] (torch reference backend)
  repack      the copy engine executing a compact plan that evicts one block's worth of tokens
              (32) per (layer, KV head) row of every request (K/V rows + stats + positions)

Times are medians over ``repeats``; ratios are against the attention of the same step.

    python benchmarks/kernels.py --section stats [--rounds 7 --chunk 512 --context 1024]

One layer's attention-statistics step on CPU (``B`` requests x ``context`` cached tokens, vllm_cpu
layout, fp32; decode ``Q = 1`` and a prefill chunk of ``chunk`` queries, the chunk's keys already cached):

  attention      VTokenCache.attention without probabilities (torch paged attention)
  sdpa           torch scaled_dot_product_attention over the same keys/values, already dense
                 (the gather is not timed: a lower bound for a real CPU attention kernel)
  collector      StatsCollector.attention (torch backend: probabilities [B, H_kv, Q, L], then the rules)
  numba          vtoken_runtime.stats.cpu_kernel.update_attn_stats_cpu (two passes over the keys)

for ``attn_sum`` (H2O) and for all four attention statistics. Rounds are interleaved (A B C D A B C D
...) so machine noise hits every variant alike; medians with min/max, ratios of medians.

    python benchmarks/kernels.py --section layouts [--rounds 7 --batch 8 --context 1536 --chunk 64]

The numba statistics kernel (``attn_sum``) on the same bf16 keys in vLLM's two CPU layouts, interleaved:
``vec`` (K dim-major per block: a strided view) and ``amx`` (pairs of dims per 32-bit word in 16-token
segments, read in place as ``PairedKeys`` built by ``cpu_layout.amx_paired_keys``); decode and a prefill
chunk. Both give the same bits (tests/runtime/test_stats_cpu_kernel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run(batch: int, context: int, layers: int, kv_heads: int, q_heads: int, head_size: int, block_size: int,
        repeats: int) -> dict:
    import vtoken_policies
    from vtoken_runtime.copy_engine import CopyEngine, CopyPlan
    from vtoken_runtime.kernels.attn_stats_ref import apply_step_stats, step_stats
    from vtoken_runtime.paged_attention import paged_attention
    from vtoken_runtime.planner import plan_compact
    from vtoken_runtime.slot_stats import SlotStore
    from vtoken_sdk.batch import StatsBatch

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    B, L, Hkv, Hq, D, bs, N = batch, layers, kv_heads, q_heads, head_size, block_size, context
    nbpr = (N + bs) // bs + 1  # blocks per request (room for the new token)
    NB = B * nbpr + 1
    S = NB * bs
    kv = [torch.randn(NB, Hkv, bs, 2 * D, dtype=torch.float32) for _ in range(L)]  # vllm_cpu layout
    bt = torch.arange(B * nbpr, dtype=torch.int32).view(B, nbpr)
    lens = torch.full((B,), N + 1, dtype=torch.int32)
    store = SlotStore(L, Hkv, S, L * Hkv, ("attn_sum", "attn_last", "attn_window", "low_attn_count"))
    for b in range(B):
        slots = (bt[b, :, None] * bs + torch.arange(bs)).reshape(-1)[: N + 1]
        store.positions[:, slots] = torch.arange(N + 1)
    q = torch.randn(B, 1, Hq, D)
    qpos = torch.full((B, 1), N, dtype=torch.int64)

    def attention() -> None:
        for li in range(L):
            k = kv[li][..., :D].permute(0, 2, 1, 3)
            v = kv[li][..., D:].permute(0, 2, 1, 3)
            paged_attention(q, k, v, bt, lens, qpos, key_positions=store.layer_positions(li))

    def stats() -> None:
        for li in range(L):
            k = kv[li][..., :D].permute(0, 2, 1, 3)
            c = step_stats(q, k, k, bt, lens, qpos, store.layer_positions(li))
            apply_step_stats({n: store.stats[n][li] for n in store.stat_names}, c, bt, lens, qpos, bs)

    pol = vtoken_policies.load("h2o").compile("torch")
    sb_stats = {"attn_sum": torch.rand(B, L, Hkv, N + 1)}
    lengths = torch.full((B,), N + 1)
    sb = StatsBatch(stats=sb_stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, N + 1),
                    seq_lens=lengths)

    def select() -> None:
        pol.keep_mask(sb)

    engine = CopyEngine(kv, "vllm_cpu", Hkv, D, bs, NB, store, per_head=True, async_copy=False)
    rows, srcs, dsts = [], [], []
    for b in range(B):
        used = N + 1
        live = np.ones((L * Hkv, used), dtype=bool)
        for r in range(L * Hkv):
            live[r, rng.choice(used - 64, size=bs, replace=False) + 32] = False
        rr, s, d = plan_compact(live, used - bs)
        blocks = bt[b].numpy().astype(np.int64)
        rows.append(rr)
        srcs.append(blocks[s // bs] * bs + s % bs)
        dsts.append(blocks[d // bs] * bs + d % bs)
    plan = CopyPlan(np.concatenate(rows), np.concatenate(srcs), np.concatenate(dsts))
    back = CopyPlan(plan.rows, plan.dst, plan.src)
    flip = [True]

    def repack() -> None:  # alternate plan / inverse plan so every run moves live data
        engine.run_jobs(engine.build_jobs(plan if flip[0] else back))
        flip[0] = not flip[0]

    t_attn = _median_ms(attention, repeats)
    rows_out = [{"part": "attention (paged, all layers)", "ms": t_attn}]
    for name, fn in (("statistics (probs + 4 stats)", stats), ("select (h2o keep mask)", select),
                     ("repack (compact plan)", repack)):
        rows_out.append({"part": name, "ms": _median_ms(fn, repeats)})
    for r in rows_out:
        r["ratio_to_attention"] = r["ms"] / t_attn
    return {"shape": {"batch": B, "context": N, "layers": L, "kv_heads": Hkv, "q_heads": Hq, "head_size": D,
                      "block_size": bs, "moves_per_step": plan.num_moves, "torch_threads": torch.get_num_threads()},
            "rows": rows_out}


def _interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:  # type: ignore[type-arg]
    """Run ``fns`` (name -> callable) in turn, ``rounds`` times after one warm-up round: ms per call."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - t0) * 1e3)
    return out


def run_stats_step(batch: int, context: int, kv_heads: int, q_heads: int, head_size: int, block_size: int,
                   chunk: int, rounds: int) -> dict:
    """One layer's statistics step: torch collector vs numba kernel vs the attention (module doc)."""
    import torch.nn.functional as F

    from vtoken_runtime.cache import VTokenCache
    from vtoken_runtime.stats import StatsCollector
    from vtoken_runtime.stats.cpu_kernel import STAT_NAMES, update_attn_stats_cpu
    from vtoken_sdk import StatsConfig

    torch.manual_seed(0)
    B, Hkv, Hq, D, bs, N = batch, kv_heads, q_heads, head_size, block_size, context
    G = Hq // Hkv
    cache = VTokenCache(1, Hkv, D, bs, num_blocks=B * (N // bs + 2) + 2, granularity="request",
                        kv_layout="vllm_cpu", stat_names=STAT_NAMES, async_copy=False)
    reqs = [f"r{b}" for b in range(B)]
    for r in reqs:
        cache.add_request(r)
        cache.reserve(r, N + 1)
        cache.write_kv(0, r, torch.randn(N + 1, Hkv, D), torch.randn(N + 1, Hkv, D))
    md = cache.attention_metadata(reqs)
    kc, kpos = cache.key_cache(0), cache.key_positions(0)
    mirror = {n: cache.stats_tensor(n)[0].clone() for n in STAT_NAMES}
    k_dense = torch.randn(B, Hkv, N + 1, D)
    v_dense = torch.randn(B, Hkv, N + 1, D)
    rows = []
    for what, Q in (("decode", 1), ("prefill chunk", chunk)):
        qpos = torch.arange(N + 1 - Q, N + 1)[None].repeat(B, 1)
        plen = torch.full((B,), N + 1 if Q > 1 else N - 64)
        q = torch.randn(B, Q, Hq, D)
        q_dense = q.transpose(1, 2)
        mask = (torch.arange(N + 1)[None, :] <= qpos[0][:, None]) if Q > 1 else None  # causal, bottom-right
        for label, names in (("attn_sum (H2O)", ("attn_sum",)), ("all 4 stats", STAT_NAMES)):
            col = StatsCollector(cache, names, StatsConfig(), G, backend="torch")  # auto would pick numba on CPU
            st = {n: mirror[n] for n in names}
            fns = {
                "attention": lambda q=q, qpos=qpos: cache.attention(0, q, md, qpos),
                "sdpa": lambda q_dense=q_dense, mask=mask: F.scaled_dot_product_attention(
                    q_dense, k_dense, v_dense, attn_mask=mask, enable_gqa=True),
                "collector": lambda col=col, q=q, qpos=qpos, plen=plen: col.attention(0, q, md, qpos, plen),
                "numba": lambda st=st, q=q, qpos=qpos, plen=plen: update_attn_stats_cpu(
                    q, kc, md.block_tables, md.cache_lens, qpos, kpos, st, prompt_lens=plen),
            }
            ts = _interleaved(fns, rounds)
            med = {k: statistics.median(v) for k, v in ts.items()}
            rows.append({"step": f"{what} Q={Q}", "stats": label, "collector_backend": col.backend,
                         **{f"{k}_ms": {"median": med[k], "min": min(v), "max": max(v)} for k, v in ts.items()},
                         "collector_vs_attention": med["collector"] / med["attention"],
                         "numba_vs_attention": med["numba"] / med["attention"],
                         "collector_vs_sdpa": med["collector"] / med["sdpa"],
                         "numba_vs_sdpa": med["numba"] / med["sdpa"],
                         "numba_speedup": med["collector"] / med["numba"]})
    return {"shape": {"batch": B, "context": N + 1, "kv_heads": Hkv, "q_heads": Hq, "head_size": D,
                      "block_size": bs, "rounds": rounds, "torch_threads": torch.get_num_threads()},
            "rows": rows}


def run_layouts(batch: int, context: int, kv_heads: int, q_heads: int, head_size: int, block_size: int,
                chunk: int, rounds: int) -> dict:
    """The numba kernel on bf16 keys in vLLM's vec and amx layouts (module doc): ms per call, interleaved."""
    from vtoken_runtime.stats.cpu_kernel import prepare_layer, prepare_step, run_prepared
    from vtoken_runtime.vllm_plugin.cpu_layout import amx_paired_keys

    torch.manual_seed(0)
    B, Hkv, D, bs, N = batch, kv_heads, head_size, block_size, context
    nb = -(-N // bs)
    NB = B * nb + 2
    t, d = np.arange(bs)[:, None], np.arange(D)[None, :]
    amx_kmap = (t // 16) * 16 * D + (d // 2) * 32 + 2 * (t % 16) + d % 2  # as probed (vLLM's amx, bs % 32 == 0)
    keys = torch.randn(NB, bs, Hkv, D).to(torch.bfloat16)
    vec_cache = torch.zeros(NB, Hkv, bs, 2 * D, dtype=torch.bfloat16)  # K[t, d] at d * bs + t, then V
    vec_cache.view(NB, Hkv, 2, D, bs)[:, :, 0] = keys.permute(0, 2, 3, 1)
    vec = vec_cache.view(NB, Hkv, 2, D, bs)[:, :, 0].permute(0, 3, 1, 2)
    amx_cache = torch.zeros(NB, Hkv, bs, 2 * D, dtype=torch.bfloat16)
    amx_cache.view(NB, Hkv, -1)[:, :, torch.as_tensor(amx_kmap).reshape(-1)] = keys.permute(0, 2, 1, 3).reshape(
        NB, Hkv, bs * D)
    paired = amx_paired_keys([amx_cache], amx_kmap)
    assert paired is not None and torch.equal(paired[0].unpack(), vec)
    bt = torch.arange(B * nb, dtype=torch.int32).reshape(B, nb)
    lens = torch.full((B,), N, dtype=torch.int32)
    kpos = torch.full((1, NB * bs), -1, dtype=torch.int64)
    kpos[0, :B * nb * bs] = torch.arange(nb * bs).repeat(B)
    kpos[0, :B * nb * bs].view(B, nb * bs)[:, N:] = -1
    stats = {"attn_sum": torch.zeros(Hkv, NB * bs)}
    layers = {"vec": prepare_layer(vec, kpos, stats), "amx": prepare_layer(paired[0], kpos, stats)}
    rows = []
    for what, Q in (("decode", 1), ("prefill chunk", chunk)):
        q = torch.randn(B, Q, q_heads, D).to(torch.bfloat16)
        step = prepare_step(bt, lens, torch.arange(N - Q, N).repeat(B, 1), torch.full((B,), N + 1))
        ts = _interleaved({k: lambda lay=lay, step=step, q=q: run_prepared(lay, step, q) for k, lay in layers.items()},
                          rounds)
        med = {k: statistics.median(v) for k, v in ts.items()}
        rows.append({"step": f"{what} Q={Q}", **{f"{k}_ms": {"median": med[k], "min": min(v), "max": max(v)}
                                                 for k, v in ts.items()}, "amx_vs_vec": med["amx"] / med["vec"]})
    return {"shape": {"batch": B, "context": N, "kv_heads": Hkv, "q_heads": q_heads, "head_size": D,
                      "block_size": bs, "rounds": rounds}, "rows": rows}


def _print_stats_step(res: dict) -> None:
    s = res["shape"]
    table = Table(title=f"one layer's statistics step on CPU: B={s['batch']} x {s['context']} cached tokens, "
                        f"H_q/H_kv={s['q_heads']}/{s['kv_heads']} D={s['head_size']} fp32, "
                        f"{s['rounds']} interleaved rounds (median \\[min-max] ms, {s['torch_threads']} thread(s))")
    for c in ("step", "stats", "attention", "sdpa", "collector", "numba", "collector / attn", "numba / attn",
              "collector / sdpa", "numba / sdpa"):
        table.add_column(c)

    def cell(d: dict) -> str:  # type: ignore[type-arg]
        return f"{d['median']:.2f} [{d['min']:.2f}-{d['max']:.2f}]"

    for r in res["rows"]:
        table.add_row(r["step"], r["stats"], cell(r["attention_ms"]), cell(r["sdpa_ms"]), cell(r["collector_ms"]),
                      cell(r["numba_ms"]), f"{r['collector_vs_attention']:.2f}", f"{r['numba_vs_attention']:.2f}",
                      f"{r['collector_vs_sdpa']:.2f}", f"{r['numba_vs_sdpa']:.2f}")
    Console(width=max(Console().width, 200)).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=("all", "step", "stats", "layouts"), default="all",
                    help="step: the per-decode-step table; stats: one layer's statistics step; all: both; "
                         "layouts: the numba kernel on bf16 keys in vLLM's vec and amx layouts")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=None,
                    help="cached tokens per request (default 2048 for step, 1024 for stats)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the stats section (>= 5)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the stats section")
    ap.add_argument("--json", type=Path, default=None, help="also write results to this file")
    a = ap.parse_args()
    out: dict = {}
    if a.section in ("all", "step"):
        res = run(a.batch, a.context or 2048, a.layers, a.kv_heads, a.q_heads, a.head_size, a.block_size,
                  a.repeats)
        s = res["shape"]
        table = Table(title=f"one decode step on CPU, torch path: B={s['batch']} N={s['context']} L={s['layers']} "
                            f"H_q/H_kv={s['q_heads']}/{s['kv_heads']} D={s['head_size']} bs={s['block_size']} "
                            f"({s['moves_per_step']} row moves, {s['torch_threads']} thread(s))")
        for c in ("part", "ms / step", "x attention"):
            table.add_column(c)
        for r in res["rows"]:
            table.add_row(r["part"], f"{r['ms']:.2f}", f"{r['ratio_to_attention']:.3f}")
        Console().print(table)
        out = res
    if a.section in ("all", "stats"):
        res_stats = run_stats_step(a.batch, a.context or 1024, a.kv_heads, a.q_heads, a.head_size, a.block_size,
                                   a.chunk, max(5, a.rounds))
        _print_stats_step(res_stats)
        out = {**out, "stats_step": res_stats} if out else {"stats_step": res_stats}
    if a.section == "layouts":
        res_l = run_layouts(a.batch, a.context or 1536, a.kv_heads, a.q_heads, a.head_size, a.block_size,
                            a.chunk if a.chunk != 512 else 64, max(5, a.rounds))
        s = res_l["shape"]
        table = Table(title=f"numba attn_sum, bf16 keys: vLLM's vec vs amx layout, B={s['batch']} x {s['context']} "
                            f"keys, H_q/H_kv={s['q_heads']}/{s['kv_heads']} D={s['head_size']} bs={s['block_size']}, "
                            f"{s['rounds']} interleaved rounds (median \\[min-max] ms)")
        for c in ("step", "vec", "amx (paired words)", "amx / vec"):
            table.add_column(c)
        for r in res_l["rows"]:
            table.add_row(r["step"], *(f"{r[k]['median']:.3f} [{r[k]['min']:.3f}-{r[k]['max']:.3f}]"
                                       for k in ("vec_ms", "amx_ms")), f"{r['amx_vs_vec']:.3f}")
        Console().print(table)
        out = {"layouts": res_l}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
