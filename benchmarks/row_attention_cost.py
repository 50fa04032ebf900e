"""What one sequence per (request, KV head) costs in vLLM's CPU attention kernel (issue 39's open question).

The same attention (every row of a request as long as the request, the standard block table) is computed
two ways on the same memory: vLLM's stock call (one sequence per request, ``H`` KV heads) and
``row_attention`` (one sequence per (request, KV head) over one-head pages, ``H`` times more, shorter
sequences). Interleaved rounds (stock, rows, stock, rows, ...), median and spread per shape::

    OMP_NUM_THREADS=1 .venv/bin/python -m vtoken_bench.row_attention_cost [--rounds 7]

Shapes are SmolLM2-135M's (3 KV heads, 9 query heads, head size 64, blocks of 32): a decode step of 8
requests and a prefill chunk of 256 tokens, at 1K and 4K tokens of context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _shape(requests: int, context: int, q: int, h: int, g: int, d: int, bs: int, rounds: int) -> dict[str, float]:
    from vllm import _custom_ops as ops

    from vtoken_runtime.vllm_plugin.row_attention import _isa, build_row_batch, one_head_pages, row_attention

    per = -(-context // bs)
    nb = requests * per
    cache = torch.randn(nb, h, bs, 2 * d)
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    table = torch.arange(nb, dtype=torch.int32).view(requests, per)
    seq = torch.full((requests,), context, dtype=torch.int32)
    qsl = torch.arange(0, (requests + 1) * q, q, dtype=torch.int32)
    query = torch.randn(requests * q, h * g, d)
    isa = _isa(torch.float32, bs, d)
    scale = d ** -0.5
    pages = [[b * h + hh for b in table[r].tolist()] for r in range(requests) for hh in range(h)]
    lens = np.full((requests, h), context)

    def stock() -> None:
        out = torch.empty_like(query)
        meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=requests, num_heads=h * g, num_kv_heads=h, head_dim=d,
                                                   seq_lens=seq, dtype=torch.float32, query_start_loc=qsl, causal=True,
                                                   sliding_window_size=-1, isa=isa, enable_kv_split=False)
        ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                        seq_lens=seq, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                        block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)

    def rows() -> None:
        batch = build_row_batch([q] * requests, lens, pages, bs)  # metadata is part of a step's cost
        row_attention(query, one_head_pages(cache), batch, scale)

    for f in (stock, rows):
        f()
    t: dict[str, list[float]] = {"stock": [], "rows": []}
    for _ in range(rounds):
        for name, f in (("stock", stock), ("rows", rows)):
            s = time.perf_counter()
            f()
            t[name].append(time.perf_counter() - s)
    ratios = [b / a for a, b in zip(t["stock"], t["rows"], strict=True)]
    return {"stock_ms": statistics.median(t["stock"]) * 1e3, "rows_ms": statistics.median(t["rows"]) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("| step | context | stock ms | rows ms | rows / stock, median [min, max] |")
    print("|---|---|---|---|---|")
    for label, requests, q in (("decode, 8 requests", 8, 1), ("prefill chunk of 256", 1, 256)):
        for context in (1024, 4096):
            r = _shape(requests, context, q, h=3, g=3, d=64, bs=32, rounds=args.rounds)
            print(f"| {label} | {context} | {r['stock_ms']:.2f} | {r['rows_ms']:.2f} | "
                  f"{r['ratio']:.2f}x [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] |", flush=True)


if __name__ == "__main__":
    main()
