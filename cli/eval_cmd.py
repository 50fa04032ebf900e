"""``vtoken-cli eval``: perplexity and passkey retrieval on SmolLM2 under eviction."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from vtoken_bench import ALL_POLICIES

out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def evaluate(
    ctx_: typer.Context,
    quick: Annotated[bool, typer.Option("--quick", help="1K context, 64 scored tokens, passkey at 2K")] = False,
    policies: Annotated[str, typer.Option(help="comma-separated shipped policies or policy files (*.py)")
                        ] = ",".join(ALL_POLICIES),
    ratios: Annotated[str, typer.Option(help="comma-separated eviction ratios")] = "0.3,0.5,0.7",
    context: Annotated[int | None, typer.Option(min=16, help="perplexity context tokens")] = None,
    continuation: Annotated[int | None, typer.Option(min=1, help="scored tokens after the context")] = None,
    requests: Annotated[int | None, typer.Option(min=1, help="perplexity windows")] = None,
    passkey_lengths: Annotated[str, typer.Option(help="comma-separated passkey prompt lengths")] = "2048",
    depths: Annotated[str, typer.Option(help="comma-separated needle depths")] = "0.1,0.5,0.9",
    plot: Annotated[Path, typer.Option(help="PNG plot path")] = Path("results/eval.png"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
    when: Annotated[str, typer.Option(help="prefill: evict once the prompt is complete; chunks: also after "
                                           "every prefill chunk (Budget(when='chunks'))")] = "prefill",
    chunk_size: Annotated[int, typer.Option(min=1, help="prefill chunk (tokens per forward)")] = 512,
    window_offset: Annotated[int, typer.Option(min=0, help="essay token offset of the perplexity windows (other "
                                                         "values: held-out text to design a policy on)")] = 60_000,
    filler_offset: Annotated[int, typer.Option(min=0, help="essay token offset of the passkey fillers")
                             ] = 20_000,
    protocols: Annotated[str, typer.Option(help="perplexity protocols, comma-separated: once (evict once after the "
                                                "context, score the continuation in one forward) and/or every-step "
                                                "(teacher-forced, evicting every step); once alone skips the "
                                                "token-by-token continuation, most of a window's time")] = "once,every-step",
    paired_with: Annotated[str | None, typer.Option(help="also compare every row with this policy window by window "
                                                         "(mean log-perplexity difference, standard error, windows "
                                                         "lower); it must be among --policies")] = None,
) -> None:
    """Quality under eviction: full cache vs each policy at each eviction ratio (perplexity, passkey).
    Subcommands: ``ruler`` (RULER, vtoken and kvpress side by side), ``niah`` (needle heatmap)."""
    if ctx_.invoked_subcommand is not None:
        return
    from vtoken_bench.eval_quality import PROTOCOLS, paired, plot_eval, run_eval, write_json
    from vtoken_bench.md_tables import ppl_text

    try:
        pol = tuple(p.strip() for p in policies.split(",") if p.strip())
        rts = tuple(float(x) for x in ratios.split(","))
        pls = tuple(int(x) for x in passkey_lengths.split(","))
        dps = tuple(float(x) for x in depths.split(","))
    except ValueError as e:
        err.print(f"bad option value: {e}")
        raise typer.Exit(2) from None
    prots = tuple(p.strip() for p in protocols.split(",") if p.strip())
    if not prots or any(p not in PROTOCOLS for p in prots):
        err.print(f"bad option value: --protocols {protocols!r}; expected one or both of {', '.join(PROTOCOLS)}")
        raise typer.Exit(2)
    if paired_with is not None and paired_with not in pol:
        err.print(f"bad option value: --paired-with {paired_with!r} is not among --policies; add it there")
        raise typer.Exit(2)
    if when not in ("prefill", "chunks"):
        err.print(f"bad option value: --when {when!r}; expected prefill or chunks")
        raise typer.Exit(2)
    ctx = context or (1024 if quick else 2048)
    cont = continuation or (64 if quick else 256)
    nreq = requests or (1 if quick else 2)
    try:
        with Progress(console=err, transient=True) as progress:
            result = run_eval(pol, rts, ctx, cont, nreq, pls, dps, progress=progress, when=when,
                              chunk_size=chunk_size, window_offset=window_offset, filler_offset=filler_offset,
                              protocols=prots)
    except ValueError as e:  # an unknown policy or a bad policy file (file:line)
        err.print(f"eval: {e}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    table = Table(title=f"quality under eviction, {result['model']}: perplexity of {cont} tokens after a "
                        f"{ctx}-token evicted context ({nreq} window(s)); passkey at lengths {list(pls)}, "
                        f"depths {list(dps)}; eviction after {'every prefill chunk' if when == 'chunks' else 'prefill'}"
                        f" (chunks of {chunk_size})")
    for c in ("policy", "evict", "ppl (evict once)", "ppl (evict every step)", "passkey (question in prompt)",
              "passkey (question after eviction)"):
        table.add_column(c, justify="right")
    for r in result["rows"]:
        table.add_row(r["policy"], f"{r['eviction_ratio']:.1f}", ppl_text(r["perplexity_once"]),
                      ppl_text(r["perplexity_decode"]),
                      f"{100 * r['passkey_in_prompt']:.0f}%", f"{100 * r['passkey_after_eviction']:.0f}%")
    out.print(table)
    if paired_with is not None:
        prot = "every-step" if "every-step" in prots else "once"
        result["paired"] = paired(result, paired_with, prot)
        pt = Table(title=f"window by window against {paired_with} ({prot}; {nreq} windows): mean difference of log "
                         "perplexity (< 0: lower than the reference) +- its standard error")
        for c in ("policy", "evict", "mean d log ppl", "+- se", "windows lower"):
            pt.add_column(c, justify="right")
        for q in result["paired"]:
            pt.add_row(q["policy"], f"{q['eviction_ratio']:.1f}", f"{q['mean_dlogppl']:+.4f}", f"{q['se']:.4f}",
                       f"{q['lower']}/{q['windows']}")
        out.print(pt)
    out.print(f"{result['seconds']} s")
    plot_eval(result, plot)
    err.print(f"plot: {plot}")
    if as_json:
        write_json(result, as_json)
        err.print(f"json: {as_json}")
