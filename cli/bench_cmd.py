"""``vtoken-cli bench``: reproducible experiments (tables on stdout, PNG plots, --json).

Heavy imports (transformers, vLLM) happen inside the commands, never at CLI start-up.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from vtoken_bench import ALL_POLICIES

from .bench_prefix_cmd import bench_prefix
from .bench_serve_cmd import bench_serve
from .bench_soak_cmd import bench_soak

bench_app = typer.Typer(no_args_is_help=True, help="benchmarks: masks, blocks, serve, prefix, soak")
bench_app.command("serve")(bench_serve)
bench_app.command("prefix")(bench_prefix)
bench_app.command("soak")(bench_soak)
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


@bench_app.command("masks")
def masks(
    n: Annotated[int, typer.Option(help="live tokens per request")] = 4096,
    batch: Annotated[int, typer.Option(help="requests per batch")] = 8,
    layers: Annotated[int, typer.Option(help="layers")] = 4,
    heads: Annotated[int, typer.Option(help="KV heads per layer")] = 3,
    head_dim: Annotated[int, typer.Option(min=1, help="D of the vector statistics (keys, values, queries)")] = 64,
    groups: Annotated[int, typer.Option(min=1, help="query heads per KV head")] = 3,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    as_json: Annotated[Path | None, typer.Option("--json", help="write results to this file")] = None,
) -> None:
    """Keep masks of every shipped policy on synthetic statistics: kept fraction and torch time (the vector
    statistics, keys, values and query summaries, for the policies that read them)."""
    import torch

    import vtoken_policies
    from vtoken_sdk.batch import StatsBatch
    from vtoken_sdk.stats import STORED_STATS, VECTOR_STATS
    from vtoken_sdk.strategies import BatchSpec, build_vectors

    g = torch.Generator().manual_seed(0)
    stats = {s: torch.rand(batch, layers, heads, n, generator=g) for s in STORED_STATS}
    lengths = torch.full((batch,), n)
    seq = torch.full((batch,), n)
    spec = BatchSpec(batch, layers, heads, n, tuple([n] * batch), tuple([0] * batch), "continuous", 0, False, (),
                     None, head_dim=head_dim, groups=groups)
    sb = StatsBatch(stats=stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n, seq),
                    seq_lens=seq, vectors=build_vectors(spec, tuple(VECTOR_STATS)), head_dim=head_dim)
    rows = []
    for name in vtoken_policies.names():
        pol = vtoken_policies.load(name)
        comp = pol.compile("torch")
        comp.keep_mask(sb)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            mask = comp.keep_mask(sb)
        dt = (time.perf_counter() - t0) / repeats
        kept = mask.float().mean().item()
        rows.append({"policy": name, "granularity": pol.granularity, "allocation": pol.allocation.kind,
                     "kept_fraction": round(kept, 4),
                     "ms_per_call": round(dt * 1e3, 2), "tokens": batch * layers * heads * n})
    table = Table(title=f"keep masks on synthetic stats [B={batch}, L={layers}, H={heads}, N={n}] (torch reference)")
    cols = ("policy", "granularity", "allocation", "kept_fraction", "ms_per_call")
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(r[c]) for c in cols))
    out.print(table)
    if as_json:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps({"rows": rows}, indent=2))


@bench_app.command("blocks")
def blocks(
    quick: Annotated[bool, typer.Option("--quick", help="one 512-token request, 256 decode steps (10 min for every "
                                                        "shipped policy with a CI run beside it)")] = False,
    policies: Annotated[str, typer.Option(help="comma-separated shipped policies (unequal budgets too: ada_snapkv, "
                                                "pyramidkv, duo_attention, ...)")] = ",".join(ALL_POLICIES),
    ratios: Annotated[str, typer.Option(help="comma-separated eviction ratios")] = "0.3,0.5,0.7",
    block_sizes: Annotated[str, typer.Option(help="comma-separated block sizes (first one runs the real cache)")]
    = "16,32,48",
    lengths: Annotated[str | None, typer.Option(help="comma-separated prompt lengths in tokens")] = None,
    requests: Annotated[int, typer.Option(min=1, help="requests per length")] = 1,
    decode: Annotated[int | None, typer.Option(min=0, help="greedy decode steps per request")] = None,
    plot: Annotated[Path, typer.Option(help="PNG plot path")] = Path("results/bench_blocks.png"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
    when: Annotated[str | None, typer.Option(help="override when every policy evicts: prefill | decode | both "
                                                  "(both: duo_attention's streaming rows are cut during decode "
                                                  "too)")] = None,
) -> None:
    """Held KV blocks per request on SmolLM2: no eviction vs Naive-Evict vs vToken vs ideal."""
    from rich.progress import Progress

    from vtoken_bench.blocks import plot_blocks, run_blocks, write_json

    lens = tuple(int(x) for x in lengths.split(",")) if lengths else ((512,) if quick else (1024, 2048, 4096))
    steps = decode if decode is not None else 256
    try:
        pol = tuple(p.strip() for p in policies.split(",") if p.strip())
        rts = tuple(float(x) for x in ratios.split(","))
        bss = tuple(int(x) for x in block_sizes.split(","))
    except ValueError as e:
        err.print(f"bad option value: {e}")
        raise typer.Exit(2) from None
    if when not in (None, "prefill", "decode", "both"):
        err.print(f"bad option value: --when {when!r}; expected prefill, decode or both")
        raise typer.Exit(2)
    try:
        with Progress(console=err, transient=True) as progress:
            result = run_blocks(pol, rts, bss, lens, requests, steps, progress, when=when)
    except ValueError as e:
        err.print(f"error: {e}")
        raise typer.Exit(1) from None
    table = Table(title=f"held KV blocks per request (mean over prefill + {steps} decode steps), "
                        f"{result['model']}, prompt lengths {list(lens)}")
    cols = ("policy", "evict", "bs", "full", "naive", "vtoken", "ideal", "vs naive", "peak naive", "peak vtoken",
            "moved/reclaimed blk")
    for c in cols:
        table.add_column(c, justify="right")
    for r in result["rows"]:
        table.add_row(r["policy"], f"{r['eviction_ratio']:.1f}", str(r["block_size"]), f"{r['blocks_full']:.1f}",
                      f"{r['blocks_naive']:.1f}", f"{r['blocks_vtoken']:.1f}", f"{r['blocks_ideal']:.1f}",
                      f"-{100 * r['reduction_vs_naive']:.1f}%", f"{r['peak_naive']:.0f}", f"{r['peak_vtoken']:.0f}",
                      "-" if r["tokens_moved_per_reclaimed_block"] is None
                      else f"{r['tokens_moved_per_reclaimed_block']:.1f}")
    out.print(table)
    rows_tab = [r for r in result["rows"] if "blocks_max_row" in r]
    if rows_tab:  # policies with unequal budgets per row: per-row pages (issue 38)
        t2 = Table(title="unequal budgets in per-row pages: held vs the designs' bounds (mean blocks per request)")
        for c in ("policy", "evict", "bs", "vtoken", "ideal (per layer)", "ideal (pages)", "max row (shared list)",
                  "row tokens min-max"):
            t2.add_column(c, justify="right")
        for r in rows_tab:
            t2.add_row(r["policy"], f"{r['eviction_ratio']:.1f}", str(r["block_size"]), f"{r['blocks_vtoken']:.1f}",
                       f"{r['blocks_ideal']:.1f}", f"{r['blocks_ideal_pages']:.1f}", f"{r['blocks_max_row']:.1f}",
                       f"{r['rows_live_min']}-{r['rows_live_max']}")
        out.print(t2)
    at = [r for r in result["rows"] if r["eviction_ratio"] == 0.5 and r["block_size"] == 16]
    if at:
        out.print("reduction vs Naive-Evict at eviction ratio 0.5, block size 16: " + ", ".join(
            f"{r['policy']} {100 * r['reduction_vs_naive']:.1f}%" for r in at) + " (seed paper: 27.2-72.3%)")
    out.print(f"{result['requests']} request(s), {result['seconds']} s")
    plot_blocks(result, plot)
    err.print(f"plot: {plot}")
    if as_json:
        write_json(result, as_json)
        err.print(f"json: {as_json}")


@bench_app.command("kvpress")
def kvpress(
    ratio: Annotated[float, typer.Option(min=0.0, max=0.95, help="kvpress compression ratio")] = 0.5,
    length: Annotated[int, typer.Option(min=128, help="passkey prompt length (tokens)")] = 400,
    new_tokens: Annotated[int, typer.Option(min=1, help="greedy tokens compared")] = 12,
    presses: Annotated[str | None, typer.Option(help="comma-separated kvpress presses (default: every pair)")] = None,
    as_json: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
) -> None:
    """Kept tokens per (layer, KV head) and greedy text: vtoken vs kvpress (needs `make kvpress`).

    The JSON report is ``{"pairs": [{"policy", "press", "rows_identical", "rows_total", "greedy_identical",
    "unequal", ...}], "unpaired": [{"press", "why"}], ...}``; ``greedy_identical`` is null for the
    unequal-budget pairs (AdaKV, PyramidKV), which compare kept sets only until the runtime runs them."""
    from vtoken_bench.essays import build_passkey
    from vtoken_bench.kvpress_check import LAGKV_WHY, PAIRS, compare
    from vtoken_bench.models import load_smollm2, smollm2_path

    pairs = PAIRS
    if presses is not None:
        want = [x.strip() for x in presses.split(",") if x.strip()]
        known = {pr for _, pr in PAIRS}
        bad = [x for x in want if x not in known]
        if bad:
            err.print(f"bad option value: --presses {','.join(bad)}; known: {', '.join(sorted(known))}")
            raise typer.Exit(2)
        pairs = tuple(pp for pp in PAIRS if pp[1] in want)
    t0 = time.perf_counter()
    model, tok = load_smollm2()
    p = build_passkey(tok, length, 0.5, 48213)
    rows = [compare(press, ratio, p.context_ids, p.question_ids, new_tokens, model, smollm2_path(), policy)
            for policy, press in pairs]
    table = Table(title=f"vtoken vs kvpress on SmolLM2, compression {ratio}, {len(p.context_ids)}-token context")
    for c in ("policy", "press", "kept", "(layer, head) rows identical", "tokens differing", "greedy equal",
              "kvpress text"):
        table.add_column(c)
    for r in rows:
        greedy = "SKIP (unequal budgets: no runtime yet)" if r["greedy_equal"] is None else str(r["greedy_equal"])
        kept = f"{r['n_kept_vtoken']} in all" if r["unequal"] else str(r["n_kept_vtoken"])
        table.add_row(r["policy"], r["press"], kept, f"{r['rows_identical']}/{r['rows']}",
                      str(r["tokens_differing"]), greedy, repr(r["peer_text"]))
    out.print(table)
    out.print(f"lagkv: no vtoken policy ({LAGKV_WHY})")
    if as_json:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps({"ratio": ratio, "context": len(p.context_ids), "new_tokens": new_tokens,
                                       "seconds": round(time.perf_counter() - t0, 1), "pairs": rows,
                                       "unpaired": [{"press": "lagkv", "why": LAGKV_WHY}]}, indent=2))
    # a greedy comparison that ran must agree; the unequal-budget pairs (no greedy yet) must keep the same sets
    ok = all(r["greedy_equal"] if r["greedy_equal"] is not None else r["rows_identical"] == r["rows"] for r in rows)
    raise typer.Exit(0 if ok else 1)
