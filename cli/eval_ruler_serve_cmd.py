"""``vtoken-cli eval ruler-serve``: RULER's own OpenAI client (``call_api.py``) against ``vtoken-cli serve``,
scored with RULER's scorer, beside the in-process path on the same samples (``vtoken_bench.ruler_serve``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)


def _fail(msg: str) -> None:
    err.print(f"eval ruler-serve: {' '.join(str(msg).split()).removeprefix('vtoken: ')}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def eval_ruler_serve(
    tasks: Annotated[str, typer.Option(help="comma-separated RULER tasks")] = "niah_single_1,qa_1",
    samples: Annotated[int, typer.Option(min=1, help="samples per task")] = 2,
    policy: Annotated[str, typer.Option(help="the server's --policy (a shipped name or a policy file); the "
                                             "in-process path runs the same")] = "streaming_llm",
    ratio: Annotated[float, typer.Option(min=0.0, max=0.999, help="the server's --eviction-ratio")] = 0.5,
    context_tokens: Annotated[int, typer.Option(min=2048, help="RULER max_seq_length (input + answer tokens)")
                              ] = 2048,
    seed: Annotated[int, typer.Option(min=0, help="the generators' random seed (RULER's prepare.py: 42)")] = 42,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="the server's port (default: a free one)")
                    ] = None,
    work_dir: Annotated[Path, typer.Option(help="samples, the client's predictions, the server's and client's "
                                                "logs")] = Path("results/ruler_serve"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """Start `vtoken-cli serve` (float32), run RULER's call_api.py (nvidia-long-context-eval) against it for each
    task, score with RULER's scorer, and compare with the in-process path (HFSession, same policy, budget and
    protocol): scores per task, identical predictions, and for a differing sample the first differing token and
    the logit gap between the two candidates on each side (stderr and the JSON)."""
    from vtoken_bench.ruler_serve import run_ruler_serve
    from vtoken_bench.ruler_tasks import RULER_TASKS

    names = tuple(t.strip() for t in tasks.split(",") if t.strip())
    unknown = [t for t in names if t not in RULER_TASKS]
    if not names or unknown:
        _fail(f"--tasks {tasks!r}: unknown {unknown or 'none given'}; valid tasks: {', '.join(RULER_TASKS)}")
    try:
        result = run_ruler_serve(names, samples, policy, ratio, context_tokens=context_tokens, seed=seed,
                                 work_dir=work_dir, port=port,
                                 log=lambda m: err.print(m, markup=False, highlight=False, soft_wrap=True))
    except (ValueError, RuntimeError, OSError, subprocess.SubprocessError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    cfg = result["config"]
    table = Table(title=f"RULER at {cfg['context_tokens']} tokens through the server: {policy} at eviction ratio "
                        f"{ratio:g}, {samples} sample(s) per task (RULER's call_api.py vs in process)")
    table.add_column("task")
    table.add_column("server", justify="right")
    table.add_column("in-process", justify="right")
    table.add_column("identical predictions", justify="right")
    table.add_column("evictions equal", justify="right")
    for t in names:
        rows = [r for r in result["samples"] if r["task"] == t]
        table.add_row(t, f"{result['scores']['server'][t]:.1f}", f"{result['scores']['in_process'][t]:.1f}",
                      f"{sum(r['identical'] for r in rows)}/{len(rows)}",
                      "yes" if result["evictions_equal"][t] else "NO")
    out.print(table)
    out.print(f"samples with identical predictions: {result['identical']}/{result['total']}")
    for r in result["samples"]:
        if not r["identical"]:
            x = r["explanation"]
            err.print(f"{r['task']}/{r['index']}: server {r['server_pred']!r} vs in process {r['in_process_pred']!r}; "
                      f"first differing token at step {x.get('first_diff_step')}: "
                      f"{x.get('server_token')} vs {x.get('in_process_token')}, gap server "
                      f"{x.get('server_gap')} / in process {x.get('in_process_gap')}", markup=False,
                      highlight=False, soft_wrap=True)
    err.print(f"wall times (s): {result['seconds']}", markup=False, highlight=False, soft_wrap=True)
    if as_json is not None:
        from vtoken_bench.experiments import write_json

        write_json(result, as_json)
        err.print(f"json: {as_json}", markup=False, highlight=False)
