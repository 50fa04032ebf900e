"""``vtoken-cli eval niah``: needle-in-a-haystack heatmap (needle depth x context length) on SmolLM2,
full cache vs policies at one eviction ratio (query-agnostic: the context is compressed once, the
question is not). See :mod:`vtoken_bench.niah_heatmap`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)


def _fail(msg: str) -> typer.Exit:
    err.print(f"bad option value: {msg}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(2)


def eval_niah(
    quick: Annotated[bool, typer.Option("--quick", help="quick grid: 1K and 2K tokens x 5 depths, 1 sample "
                                                        "(~2 min); default: 1K, 2K, 4K x 11 depths (~10 min)")] = False,
    lengths: Annotated[str | None, typer.Option(help="comma-separated context lengths in tokens (whole prompt), "
                                                     "128..8192, e.g. 1024,2048")] = None,
    depths: Annotated[str | None, typer.Option(help="comma-separated needle depths in [0, 1], e.g. 0,0.5,1")] = None,
    samples: Annotated[int | None, typer.Option(help="samples per cell (own passkey and filler offset)")] = None,
    policies: Annotated[str, typer.Option(help="comma-separated shipped policies (the full cache always runs)")
                        ] = "snapkv,knorm",
    ratio: Annotated[float, typer.Option(help="eviction ratio of every policy, in [0, 1)")] = 0.5,
    seed: Annotated[int, typer.Option(help="seed of the passkeys and filler offsets")] = 0,
    answer_tokens: Annotated[int, typer.Option(help="greedy answer tokens at most")] = 8,
    chunk_size: Annotated[int, typer.Option(help="prefill tokens per forward")] = 256,
    plot: Annotated[Path, typer.Option(help="PNG heatmap path")] = Path("results/niah/niah_heatmap.png"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """Needle in a haystack: passkey retrieval per (depth, context length), full cache vs each policy."""
    from rich.progress import Progress

    from vtoken_bench.niah_heatmap import (
        make_grid,
        niah_table,
        parse_list,
        plot_heatmap,
        run_niah,
        write_result,
    )

    try:  # everything is checked before the model loads
        grid = make_grid(quick, lengths=parse_list(lengths, int, "--lengths") if lengths is not None else None,
                         depths=parse_list(depths, float, "--depths") if depths is not None else None,
                         samples=samples, policies=parse_list(policies, str, "--policies"), ratio=ratio, seed=seed,
                         answer_tokens=answer_tokens, chunk_size=chunk_size)
    except ValueError as e:
        raise _fail(str(e)) from None
    err.print(f"niah: {len(grid.lengths)} length(s) x {len(grid.depths)} depth(s) x {grid.samples} sample(s) = "
              f"{grid.prompts} prompts; methods {', '.join(grid.methods)} (eviction ratio {grid.ratio:g})",
              highlight=False, soft_wrap=True)
    with Progress(console=err, transient=True) as progress:
        result = run_niah(grid, progress=progress,
                          log=lambda line: progress.console.print(line, markup=False, highlight=False, soft_wrap=True))
    out.print(niah_table(result))
    out.print(f"{result['seconds']} s")
    plot_heatmap(result, plot)
    err.print(f"plot: {plot}", highlight=False, soft_wrap=True)
    if as_json:
        write_result(result, as_json)
        err.print(f"json: {as_json}", highlight=False, soft_wrap=True)
