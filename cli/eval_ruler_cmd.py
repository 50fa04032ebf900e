"""``vtoken-cli eval ruler``: RULER (its own generators and scorer) under eviction, vtoken and kvpress."""

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


def _split(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(x.strip() for x in value.split(",") if x.strip())


def _ensure_kvpress() -> None:
    """Make the peer venv if it is missing (``make kvpress``'s script; a few minutes, once)."""
    from vtoken_bench.kvpress_check import PEER_PY, ROOT

    if PEER_PY.exists():
        return
    script = ROOT / "scripts" / "setup_kvpress.sh"
    if not script.exists():
        raise FileNotFoundError(f"{PEER_PY} missing and {script} not found: make the kvpress venv (make kvpress)")
    err.print(f"kvpress peer venv missing: running {script} (once, a few minutes)")
    subprocess.run(["bash", str(script)], check=True, cwd=ROOT, stdout=sys.stderr)


def eval_ruler(
    quick: Annotated[bool, typer.Option("--quick", help="4 tasks (niah_single_1, niah_multikey_1, vt, qa_1) x 1 "
                                                        "sample, 5 policies, 5 presses, 5 ratios: about 15 minutes")] = False,
    context_tokens: Annotated[int, typer.Option(min=2048, help="RULER max_seq_length (input + answer tokens); "
                                                              "SmolLM2-135M's full cache scores ~30 at 2K and 4K")
                              ] = 2048,
    samples: Annotated[int | None, typer.Option(min=1, help="samples per task (default 5; --quick 1)")] = None,
    tasks: Annotated[str | None, typer.Option(help="comma-separated RULER tasks (default all 13)")] = None,
    policies: Annotated[str | None, typer.Option(help="comma-separated shipped policies or policy files "
                                                      "(default all shipped)")] = None,
    presses: Annotated[str | None, typer.Option(help="comma-separated kvpress methods (default: the shared ones, "
                                                     "lagkv, AdaKV, PyramidKV, CriticalAdaKV)")] = None,
    ratios: Annotated[str, typer.Option(help="comma-separated compression ratios (the full cache always runs)")
                      ] = "0.25,0.5,0.75,0.875",
    engines: Annotated[str, typer.Option(help="vtoken and/or kvpress")] = "vtoken,kvpress",
    seed: Annotated[int, typer.Option(help="the generators' random seed (RULER's prepare.py: 42)")] = 42,
    max_configs: Annotated[int, typer.Option(min=1, help="configurations forked and decoded as one batch")] = 8,
    work_dir: Annotated[Path, typer.Option(help="generated data, the kvpress peer's answers and log")
                        ] = Path("results/ruler"),
    resume: Annotated[bool, typer.Option("--resume", help="keep the answers already in --work-dir "
                                                          "(vtoken.jsonl, kvpress.jsonl) for these samples' token "
                                                          "ids and compute only the missing ones: continue an "
                                                          "interrupted run, or widen one by ratios, tasks or "
                                                          "methods")] = False,
    plot: Annotated[Path | None, typer.Option(help="PNG: score vs ratio per method")] = None,
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """RULER's 13 tasks (nvidia-long-context-eval's generators and scorer), kvpress's query-agnostic protocol:
    every policy (vtoken, in-process) and kvpress's presses (peer venv) on the same samples and token ids."""
    from vtoken_bench import ALL_POLICIES
    from vtoken_bench.ruler_eval import KVPRESS_METHODS, QUICK, RATIOS, mean_table, plot_ruler, run_ruler_eval
    from vtoken_bench.ruler_tasks import RULER_TASKS

    try:
        rts = tuple(float(x) for x in ratios.split(",") if x.strip()) or RATIOS
    except ValueError as e:
        err.print(f"bad option value: --ratios: {e}")
        raise typer.Exit(2) from None
    tsk = _split(tasks) or (QUICK.tasks if quick else RULER_TASKS)
    unknown = [t for t in tsk if t not in RULER_TASKS]
    if unknown:
        err.print(f"bad option value: --tasks {','.join(unknown)}; valid tasks: {', '.join(RULER_TASKS)}")
        raise typer.Exit(2)
    eng = _split(engines) or ()
    if not eng or any(e not in ("vtoken", "kvpress") for e in eng):
        err.print(f"bad option value: --engines {engines!r}; expected vtoken and/or kvpress")
        raise typer.Exit(2)
    if any(not 0.0 < r < 1.0 for r in rts):
        err.print(f"bad option value: --ratios {ratios!r}; expected ratios in (0, 1) (the full cache always runs)")
        raise typer.Exit(2)
    pol = _split(policies) or (QUICK.policies if quick else ALL_POLICIES)
    prs = _split(presses) or (QUICK.presses if quick else KVPRESS_METHODS)
    n = samples or (QUICK.samples if quick else 5)
    try:
        if "kvpress" in eng:
            _ensure_kvpress()
        result = run_ruler_eval(context_tokens=context_tokens, samples_per_task=n, tasks=tsk, policies=pol,
                                presses=prs, ratios=rts, engines=eng, seed=seed, max_configs=max_configs,
                                work_dir=work_dir, resume=resume,
                                log=lambda m: err.print(m, markup=False, highlight=False))
    except (ValueError, FileNotFoundError, RuntimeError, subprocess.CalledProcessError) as e:
        err.print(f"eval ruler: {e}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    cfg = result["config"]
    header, body = mean_table(result["rows"])
    table = Table(title=f"RULER at {cfg['context_tokens']} tokens, {cfg['model']}, {n} sample(s) x {len(tsk)} "
                        f"task(s): mean score (0-100) by compression ratio; {cfg['protocol']}")
    for c in header:
        table.add_column(c, justify="right")
    for row in body:
        table.add_row(*row)
    out.print(table)
    per = Table(title="per task (score at 0.5; full cache at 0)")
    per.add_column("engine")
    per.add_column("method")
    for t in tsk:
        per.add_column(t, justify="right")
    for e, m in dict.fromkeys((r["engine"], r["method"]) for r in result["rows"]):
        cells = {r["task"]: r["score"] for r in result["rows"]
                 if (r["engine"], r["method"]) == (e, m) and r["ratio"] in (0.0, 0.5)}
        per.add_row(e, m, *[f"{cells[t]:.0f}" if t in cells else "-" for t in tsk])
    out.print(per)
    for a in result["agreement"]:
        out.print(f"same answer text, vtoken vs kvpress, {a['method']}@{a['ratio']:g}: "
                  f"{a['identical']}/{a['samples']}" + (f" (differ: {', '.join(a['differ'])})" if a["differ"] else ""))
    out.print(f"{result['seconds']} s")
    if plot is not None:
        plot_ruler(result, plot)
        err.print(f"plot: {plot}")
    if as_json is not None:
        from vtoken_bench.experiments import write_json

        write_json(result, as_json)
        err.print(f"json: {as_json}")
