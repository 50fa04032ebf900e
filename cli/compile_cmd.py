"""``vtoken-cli compile FILE... --target sm_90|sm_80 [--emit triton] [--json]``.

Compiles every policy of the given files to its Triton kernels ahead of time (no GPU needed:
``triton.compile(..., target=GPUTarget("cuda", 90, 32))``), plus the runtime's repack and
attention-statistics kernels, and reports registers, spills and shared memory per kernel from the
ptxas bundled with Triton. ``--emit triton`` prints the generated kernel source instead.
Exit codes: 0 success, 1 a file failed to load or a kernel failed to compile.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

TARGETS = {"sm_90": 90, "sm_80": 80}
_RUNTIME_KERNEL_MODULES = ("vtoken_runtime.kernels.repack_triton", "vtoken_runtime.kernels.attn_stats_triton")


@contextlib.contextmanager
def _no_interpreter() -> Iterator[None]:
    """AOT needs real JIT functions: build kernels with TRITON_INTERPRET off, restore it after."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _fresh_module(name: str) -> ModuleType:
    """A private copy of a kernel module (so an interpreted copy in sys.modules stays untouched)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    pkg, _, leaf = name.rpartition(".")
    copy = importlib.util.spec_from_file_location(f"{pkg}._aot_{leaf}", spec.origin)
    assert copy is not None and copy.loader is not None
    mod = importlib.util.module_from_spec(copy)
    sys.modules[copy.name] = mod
    copy.loader.exec_module(mod)
    return mod


def _runtime_reports(arch: int) -> list[dict[str, Any]]:
    from vtoken_sdk.triton_backend import aot_compile

    reports = []
    for name in _RUNTIME_KERNEL_MODULES:
        mod = _fresh_module(name)
        for fn, sig, consts, warps, label in mod.aot_specs(arch):
            reports.append(aot_compile(fn, sig, consts, arch, warps, label))
    return reports


def compile_policies(
    files: Annotated[list[Path], typer.Argument(help="policy files (.py) to compile")],
    target: Annotated[str, typer.Option(help="GPU architecture: sm_90 (H100/H200) or sm_80 (A100)")] = "sm_90",
    emit: Annotated[str | None, typer.Option(help="print generated source instead of compiling: 'triton'")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable report on stdout")] = False,
    runtime_kernels: Annotated[bool, typer.Option(help="also compile the repack and attention-stats kernels")] = True,
) -> None:
    """Compile policies to Triton kernels ahead of time; report registers / spills / shared memory."""
    out = Console(width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True)
    if target not in TARGETS:
        err.print(f"[red]error[/]: got --target {target!r}, expected one of {', '.join(TARGETS)}")
        raise typer.Exit(2)
    if emit not in (None, "triton"):
        err.print(f"[red]error[/]: got --emit {emit!r}, expected 'triton'")
        raise typer.Exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        err.print("[red]error[/]: triton is not installed (pip install 'vtoken[triton]')")
        raise typer.Exit(1) from None
    from vtoken_sdk import codegen_triton
    from vtoken_sdk.loader import load_policy_file
    from vtoken_sdk.triton_backend import aot_kernels

    arch = TARGETS[target]
    failed = False
    results: list[dict[str, Any]] = []
    sources: list[dict[str, str]] = []
    for f in files:
        loaded = load_policy_file(f)
        if loaded.error is not None:
            err.print(f"[red]error[/]: {loaded.error}")
            failed = True
            continue
        for pol in loaded.policies:
            if pol.kind != "score":
                err.print(f"[yellow]skip[/]: {f}: {pol.name} is a mask policy (torch backend only)")
                continue
            if emit == "triton":
                sources.append({"file": str(f), "policy": pol.name, "source": codegen_triton.source(pol)})
                continue
            try:
                with _no_interpreter():
                    reports = aot_kernels(pol, arch)
                for r in reports:
                    results.append({"file": str(f), "policy": pol.name, **r})
            except Exception as e:  # noqa: BLE001 - report and continue with the other policies
                err.print(f"[red]error[/]: {f}: {pol.name}: compile failed: {type(e).__name__}: {e}")
                failed = True
    if emit == "triton":
        if as_json:
            print(json.dumps({"sources": sources}, indent=2))
        else:
            for s in sources:
                print(f"# ===== {s['file']} :: {s['policy']} =====")
                print(s["source"])
        raise typer.Exit(1 if failed else 0)
    if runtime_kernels:
        try:
            with _no_interpreter():
                results += [{"file": "-", "policy": "-", **r} for r in _runtime_reports(arch)]
        except Exception as e:  # noqa: BLE001
            err.print(f"[red]error[/]: runtime kernels failed to compile: {type(e).__name__}: {e}")
            failed = True
    spills = [r["kernel"] for r in results if r["spill_stores"] or r["spill_loads"]]
    if as_json:
        print(json.dumps({"target": target, "kernels": [{k: v for k, v in r.items() if k != "ptxas"} for r in results],
                          "spilling": spills, "ok": not failed}, indent=2))
    else:
        table = Table(title=f"Triton kernels for {target} (ptxas -v)")
        for c in ("kernel", "warps", "constexprs", "registers", "spill st/ld (B)", "shared (B)", "compile s"):
            table.add_column(c)
        for r in results:
            cx = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items() if k in ("BLOCK", "SINGLE", "BLOCK_N",
                                                                                       "BLOCK_Q", "BLOCK_M", "BLOCK_W"))
            sp = f"{r['spill_stores']}/{r['spill_loads']}"
            table.add_row(escape(r["kernel"]), str(r["num_warps"]), cx, str(r["registers"]),
                          f"[red]{sp}[/]" if sp != "0/0" else sp, str(r["shared_bytes"]), str(r["compile_s"]))
        out.print(table)
        if spills:
            err.print(f"[yellow]warning[/]: register spills in {', '.join(spills)}")
    raise typer.Exit(1 if failed else 0)
