"""``vtoken-cli bench prefix``: serving with prefix caching on, vanilla vLLM against vToken (issue 40).

Registered by ``cli/bench_cmd.py``. Heavy imports (vLLM) happen inside the command."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)


def token_range(text: str) -> tuple[int, int]:
    """``"LO,HI"`` -> ``(LO, HI)``: two integers, ``1 <= LO <= HI`` (``ValueError`` saying what is wrong)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError("expected two integers LO,HI, e.g. 256,320")
    lo, hi = int(parts[0]), int(parts[1])
    if not 1 <= lo <= hi:
        raise ValueError(f"expected 1 <= LO <= HI, got {lo},{hi}")
    return lo, hi


def bench_prefix(
    quick: Annotated[bool, typer.Option("--quick", help="a 512-token system prompt, 8 requests and 3 two-turn chats, "
                                                        "shorter questions and answers")] = False,
    policy: Annotated[str, typer.Option(help="the evicting engine's shipped policy (uniform budgets)")] = "h2o",
    ratio: Annotated[float, typer.Option(min=0.0, max=0.95, help="its eviction ratio")] = 0.5,
    rounds: Annotated[int | None, typer.Option(min=1, help="interleaved rounds of the shared trace (default 3)")
                      ] = None,
    system_tokens: Annotated[int | None, typer.Option(min=32, help="the shared system prompt (default 1024)")
                             ] = None,
    question_tokens: Annotated[str | None, typer.Option(metavar="LO,HI", help="each request's own question, drawn "
                                                                            "in [LO, HI] tokens (default 1536,2048)")
                               ] = None,
    output_tokens: Annotated[str | None, typer.Option(metavar="LO,HI", help="each answer, drawn in [LO, HI] tokens "
                                                                          "(default 64,96; e.g. 256,320: decode-heavy)")
                             ] = None,
    goodput: Annotated[bool, typer.Option("--goodput/--no-goodput",
                                          help="also search goodput on the shared trace (open loop, SLOs from "
                                               "vanilla's requests alone; about 15 min, --quick about 8)")] = True,
    closed_loop: Annotated[bool, typer.Option("--closed-loop/--no-closed-loop",
                                              help="the closed-loop traces (--no-closed-loop: goodput alone)")
                           ] = True,
    ttft_slo_factor: Annotated[float | None, typer.Option(min=1.0, help="TTFT SLO = this x vanilla's unloaded mean "
                                                                         "TTFT (default 5)")] = None,
    tpot_slo_factor: Annotated[float | None, typer.Option(min=1.0, help="TPOT SLO = this x vanilla's unloaded mean "
                                                                         "TPOT (default 3)")] = None,
    goodput_requests: Annotated[int | None, typer.Option(min=4, help="requests per goodput probe (default 16, "
                                                                      "quick 10)")] = None,
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """Prefix caching on: a shared system prompt and multi-turn chats, vanilla vLLM (prefix caching on) against
    vToken with policy none (overhead, interleaved) and an evicting policy (the system prompt pinned): hit rate,
    running peak, closed-loop throughput, and goodput under TTFT / TPOT SLOs."""
    from vtoken_bench.models import smollm2_path
    from vtoken_bench.serve_prefix import QUICK, PrefixConfig, run_prefix_bench

    cfg = QUICK if quick else PrefixConfig()
    ranges = {"--question-tokens": (question_tokens, cfg.question_tokens),
              "--output-tokens": (output_tokens, cfg.output_tokens)}
    got = {}
    for flag, (text, default) in ranges.items():
        try:
            got[flag] = default if text is None else token_range(text)
        except ValueError as e:
            err.print(f"bad option value: {flag} {text!r}: {e}", markup=False, highlight=False)
            raise typer.Exit(2) from None
    cfg = replace(cfg, policy=policy, ratio=ratio, rounds=rounds or cfg.rounds,
                  question_tokens=got["--question-tokens"], output_tokens=got["--output-tokens"],
                  system_tokens=system_tokens or cfg.system_tokens, goodput=goodput,
                  goodput_requests=goodput_requests or cfg.goodput_requests, closed_loop=closed_loop,
                  ttft_slo_factor=ttft_slo_factor or cfg.ttft_slo_factor,
                  tpot_slo_factor=tpot_slo_factor or cfg.tpot_slo_factor)
    import vtoken_policies

    if policy not in vtoken_policies.names():
        err.print(f"bad option value: --policy {policy!r}; shipped: {', '.join(vtoken_policies.names())}")
        raise typer.Exit(2)
    try:
        result = run_prefix_bench(str(smollm2_path()), cfg, log=lambda m: err.print(m, markup=False, highlight=False))
    except ValueError as e:
        err.print(f"bench prefix: {e}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    evict = f"{cfg.policy}@{cfg.ratio:g}"
    t = Table(title=f"prefix caching on, SmolLM2, KV cache {result['config']['kv_blocks']} blocks, system prompt "
                    f"{cfg.system_tokens} tokens (pinned by the evicting engine's requests): medians over rounds")
    for c in ("trace", "engine", "hit rate", "running peak", "preemptions", "req/s (cpu)", "tok/s (cpu)",
              "blocks freed", "peak vs vanilla", "req/s vs vanilla"):
        t.add_column(c, justify="right")
    for trace, s in result["summary"].items():
        for eng in ("vanilla", "none", evict):
            m = s["median"][eng]
            v = s["median"]["vanilla"]
            t.add_row(trace, eng, f"{100 * m['hit_rate']:.1f}%", f"{m['max_running']:g}", f"{m['preemptions']:g}",
                      f"{m['rps']:.3f}", f"{m['tok_s']:.1f}", f"{m['blocks_freed']:g}",
                      f"{m['max_running'] / v['max_running']:.2f}x" if v["max_running"] else "-",
                      f"{m['rps'] / v['rps']:.2f}x" if v["rps"] else "-")
    if result["summary"]:
        out.print(t)
    o = result["overhead_none"]
    if o:
        out.print(f"policy none / vanilla, CPU seconds of the shared trace, {len(o['ratios'])} interleaved rounds: "
                  f"median {o['median']:.4f}x [{o['min']:.4f}, {o['max']:.4f}]")
    gp = result.get("goodput")
    if gp:
        slo = gp["slo"]
        g = Table(title=f"goodput, shared trace open loop ({gp['requests']} requests per probe, Poisson): SLOs TTFT "
                        f"{slo['ttft_slo_s']}s, TPOT {1e3 * slo['tpot_slo_s']:.0f}ms, {slo['attainment']:.0%} of "
                        f"requests, {slo['clock']} clock")
        for c in ("engine", "goodput rps", "bracket", "vs vanilla", "probes: rps -> attainment (running peak)",
                  "confirm"):
            g.add_column(c, justify="right")
        van = gp["engines"]["vanilla"]["goodput_rps"]
        for eng, e in gp["engines"].items():
            lo, hi = e["bracket"]
            g.add_row(eng, f"{e['goodput_rps']:.3f}{'+' if e['saturated'] else ''}",
                      f"[{lo:.3f}, {'-' if hi is None else f'{hi:.3f}'}]",
                      f"{e['goodput_rps'] / van:.2f}x" if van else "-",
                      ", ".join(f"{p['rate_rps']:.3f}->{p['attainment']:.2f} ({p['running_peak']})" for p in e["probes"]),
                      "; ".join(f"{r}: {', '.join(f'{a:.2f}' for a in v)}" for r, v in e["confirm"].items()))
        out.print(g)
    if as_json is not None:
        from vtoken_bench.experiments import write_json

        write_json(result, as_json)
        err.print(f"json: {as_json}")
