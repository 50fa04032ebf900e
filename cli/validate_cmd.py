"""``vtoken-cli validate`` and ``vtoken-cli list``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def validate(
    files: Annotated[list[Path], typer.Argument(help="policy files (.py) to check", show_default=False)],
    examples: Annotated[int, typer.Option("--examples", "-n", min=1, help="hypothesis examples per property")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable report on stdout")] = False,
) -> None:
    """Import each FILE in isolation, find its policies and check them against the contract."""
    from vtoken_sdk.checks import CHECKS, run_checks
    from vtoken_sdk.loader import load_policy_file

    rows: list[dict[str, object]] = []
    failed = False
    for f in files:
        loaded = load_policy_file(f)
        if loaded.error is not None and f.name == "__init__.py" and loaded.error.message.startswith("no policy"):
            err.print(f"skipped {f} (package marker without policies)", highlight=False)
            continue
        if loaded.error is not None:
            failed = True
            e = loaded.error
            err.print(f"[bold red]error[/] {e.render()}", highlight=False, markup=True, soft_wrap=True)
            rows.append({"file": str(f), "policy": None, "check": e.check, "ok": False, "detail": e.message,
                         "location": e.location, "hint": e.hint})
            continue
        for pol in loaded.policies:
            report = run_checks(pol, examples=examples)
            for r in report.results:
                loc = f"{f}:{r.line or pol.line}"
                rows.append({"file": str(f), "policy": pol.name, "check": r.name, "ok": r.ok, "detail": r.detail,
                             "example": r.example or None, "location": loc})
                if not r.ok:
                    failed = True
                    err.print(f"[bold red]FAIL[/] {loc}: policy {pol.name!r} check {r.name}: {r.detail}",
                              highlight=False, soft_wrap=True)
                    if r.example:
                        err.print(f"  falsifying example: {r.example}", highlight=False, soft_wrap=True)
    if as_json:
        sys.stdout.write(json.dumps({"ok": not failed, "checks": CHECKS, "results": rows}, indent=2) + "\n")
    else:
        table = Table(title="vtoken-cli validate", show_lines=False)
        for col in ("file", "policy", "check", "result", "detail"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(str(r["file"]), str(r["policy"] or "-"), str(r["check"]),
                          "[green]PASS[/]" if r["ok"] else "[red]FAIL[/]", str(r["detail"])[:120])
        out.print(table)
        n_fail = sum(1 for r in rows if not r["ok"])
        out.print(f"{len(rows) - n_fail} passed, {n_fail} failed")
    raise typer.Exit(1 if failed else 0)


def list_policies(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable list on stdout")] = False,
) -> None:
    """Show the shipped policies with their parameters."""
    import vtoken_policies

    items = []
    for name in vtoken_policies.names():
        p = vtoken_policies.load(name)
        items.append({
            "name": p.name, "file": str(vtoken_policies.path(name)), "score": p.describe(),
            "reads": sorted(p.reads), "granularity": p.granularity,
            "budget": p.budget.model_dump(exclude_none=True),
            "protect": [type(r).__name__ + "(" + ", ".join(f"{k}={v}" for k, v in r.model_dump().items()
                                                         if k not in ("fn", "node")) + ")" for r in p.spec.protect],
            "stats": p.spec.stats.model_dump(), "doc": p.doc.splitlines()[0] if p.doc else "",
        })
    if as_json:
        sys.stdout.write(json.dumps(items, indent=2) + "\n")
        return
    table = Table(title="shipped policies")
    for col in ("name", "score", "budget", "protect", "granularity", "reads", "paper"):
        table.add_column(col, overflow="fold")
    for it in items:
        b = it["budget"]
        table.add_row(str(it["name"]), str(it["score"]), ", ".join(f"{k}={v}" for k, v in b.items()),  # type: ignore[union-attr]
                      ", ".join(it["protect"]), str(it["granularity"]), ", ".join(it["reads"]), str(it["doc"]))  # type: ignore[arg-type]
    out.print(table)
