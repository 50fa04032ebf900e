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

bench_app = typer.Typer(no_args_is_help=True, help="benchmarks: masks, blocks, serve")
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


@bench_app.command("masks")
def masks(
    n: Annotated[int, typer.Option(help="live tokens per request")] = 4096,
    batch: Annotated[int, typer.Option(help="requests per batch")] = 8,
    layers: Annotated[int, typer.Option(help="layers")] = 4,
    heads: Annotated[int, typer.Option(help="KV heads per layer")] = 3,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    as_json: Annotated[Path | None, typer.Option("--json", help="write results to this file")] = None,
) -> None:
    """Keep masks of every shipped policy on synthetic statistics: kept fraction and torch time."""
    import torch
    import vtoken_policies

    from vtoken_sdk.batch import StatsBatch
    from vtoken_sdk.stats import STORED_STATS

    g = torch.Generator().manual_seed(0)
    stats = {s: torch.rand(batch, layers, heads, n, generator=g) for s in STORED_STATS}
    lengths = torch.full((batch,), n)
    seq = torch.full((batch,), n)
    sb = StatsBatch(stats=stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n, seq),
                    seq_lens=seq)
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
        rows.append({"policy": name, "granularity": pol.granularity, "kept_fraction": round(kept, 4),
                     "ms_per_call": round(dt * 1e3, 2), "tokens": batch * layers * heads * n})
    table = Table(title=f"keep masks on synthetic stats [B={batch}, L={layers}, H={heads}, N={n}] (torch reference)")
    for c in ("policy", "granularity", "kept_fraction", "ms_per_call"):
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("policy", "granularity", "kept_fraction", "ms_per_call")))
    out.print(table)
    if as_json:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps({"rows": rows}, indent=2))
