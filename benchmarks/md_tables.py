"""Render the JSON reports of ``vtoken-cli bench blocks`` / ``eval`` / ``bench serve`` / ``eval ruler`` as
markdown tables.

    python benchmarks/md_tables.py results/bench_blocks.json [results/eval.json] [results/bench_serve.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def blocks(d: dict) -> str:
    out = [f"model: {d['model']}; prompt lengths {d['lengths']}, {d['decode_steps']} decode steps, "
           f"{d['requests']} request(s) per configuration, {d['seconds']} s\n",
           "| policy | evict | bs | full | Naive-Evict | vToken | ideal | vToken vs naive | peak naive | peak vToken "
           "| moved / reclaimed block |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        m = r["tokens_moved_per_reclaimed_block"]
        out.append(f"| {r['policy']} | {r['eviction_ratio']} | {r['block_size']} | {r['blocks_full']:.1f} | "
                   f"{r['blocks_naive']:.1f} | {r['blocks_vtoken']:.1f} | {r['blocks_ideal']:.1f} | "
                   f"-{100 * r['reduction_vs_naive']:.1f}% | {r['peak_naive']:.0f} | {r['peak_vtoken']:.0f} | "
                   f"{'-' if m is None else f'{m:.1f}'} |")
    return "\n".join(out)


def ppl_text(x: float | None) -> str:
    """A perplexity with two decimals, ``-`` for a protocol that did not run (``eval --protocols``)."""
    return "-" if x is None else f"{x:.2f}"


def evaluation(d: dict) -> str:
    out = [f"model: {d['model']}; perplexity of {d['continuation']} tokens after a {d['context']}-token context "
           f"({d['ppl_requests']} windows); passkey cases: {len(d['passkey_cases']) // 2} per mode; {d['seconds']} s\n",
           "| policy | evict | perplexity, evict once | perplexity, evict every step | passkey, question in prompt "
           "| passkey, question after eviction |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['policy']} | {r['eviction_ratio']} | {ppl_text(r['perplexity_once'])} | "
                   f"{ppl_text(r['perplexity_decode'])} | "
                   f"{100 * r['passkey_in_prompt']:.0f}% | {100 * r['passkey_after_eviction']:.0f}% |")
    return "\n".join(out)


def spread_text(d: dict, key: str) -> str:
    """``[min, max]`` of ``d[key + "_spread"]`` (the spread over a benchmark's rounds)."""
    sp = d.get(f"{key}_spread") or {}
    return f"[{sp.get('min')}, {sp.get('max')}]"


def stats_cost_text(s: dict) -> str:
    """The statistics cost (``bench serve``'s ``stats_cost``: H2O vs policy none, paired rounds) in one line, as
    both the markdown report and ``vtoken-cli bench serve`` print it."""
    return (f"H2O ({s['mode']} {s['eviction_ratio']}) vs policy none ({s['rounds']} rounds, {s['requests']} request(s)): "
            f"{s['h2o_s']} s vs {s['none_s']} s = {s['ratio']}x {spread_text(s, 'ratio')} wall, {s['ratio_cpu']}x "
            f"{spread_text(s, 'ratio_cpu')} CPU"
            + (f"; H2O with slack {s['slack_variant']}: {s['h2o_slack_s']} s = {s['ratio_slack']}x "
               f"{spread_text(s, 'ratio_slack')} wall, {s['ratio_slack_cpu']}x {spread_text(s, 'ratio_slack_cpu')} CPU"
               if "ratio_slack" in s else ""))


def serve(d: dict) -> str:
    c = d["config"]
    out = [f"trace: {c['num_requests']} essay prompts of {c['prompt_tokens'][0]}-{c['prompt_tokens'][1]} tokens "
           f"(mean {c['prompt_tokens_mean']}), outputs {c['output_tokens'][0]}-{c['output_tokens'][1]} (mean "
           f"{c['output_tokens_mean']}); KV budget {c['kv_blocks']} blocks of {c['block_size']}; eviction "
           f"when={c['when']}, chunks of {c['chunk_tokens']}, steps of {c.get('step_tokens') or c['chunk_tokens']} tokens, slack "
           f"{c.get('slack', 0)}; SLOs TTFT {c['ttft_slo_s']} s ({c['ttft_slo_factor']}x), TPOT "
           f"{1e3 * c['tpot_slo_s']:.1f} ms ({c['tpot_slo_factor']}x), {c['slo_attainment']:.0%} attainment; "
           f"statistics backend {c.get('stats_backend')}; {d['seconds']} s\n",
           "| mode | policy | evict | running peak | vs vanilla | mean peak blocks/req | guaranteed (no preemption) "
           "| vs vanilla | preemptions | closed-loop tok/s | goodput rps | vs vanilla |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        def x(v: object) -> str:
            return "-" if v is None else f"{v:.2f}x"
        out.append(f"| {r['mode']} | {r['policy']} | {r['eviction_ratio']} | {r['max_concurrency']} | "
                   f"{x(r.get('concurrency_gain'))} | {r['mean_peak_blocks']} | {r['guaranteed_concurrency']} | "
                   f"{x(r.get('guaranteed_gain'))} | {r['preemptions']} | {r['closed_loop_tok_s']} | "
                   f"{'-' if r.get('goodput_rps') is None else r['goodput_rps']} | {x(r.get('goodput_gain'))} |")
    t = d.get("throughput")
    if t:
        out.append(f"\nclosed loop, {t['rounds']} lockstep rounds: vanilla {t['vanilla_tok_s']} tok/s "
                   f"{spread_text(t, 'vanilla_tok_s')}, vToken H2O {t['eviction_ratio']} {t['vtoken_tok_s']} tok/s "
                   f"{spread_text(t, 'vtoken_tok_s')}: {t['ratio']}x {spread_text(t, 'ratio')}")
    o, s = d["overhead"], d["stats_cost"]
    out.append(f"\noverhead, policy none vs vanilla ({o['rounds']} interleaved rounds, {o['requests']} request(s)): "
               f"vanilla {o['vanilla_tok_s']} tok/s {spread_text(o, 'vanilla_tok_s')}, plugin {o['plugin_none_tok_s']} tok/s "
               f"{spread_text(o, 'plugin_none_tok_s')}: {o['overhead_pct']}% {spread_text(o, 'overhead_pct')} wall, "
               f"{o['overhead_pct_cpu']}% {spread_text(o, 'overhead_pct_cpu')} CPU; A/A control {o.get('aa_pct_cpu')}% "
               f"{spread_text(o, 'aa_pct_cpu')}; indirection {o.get('indirection_ms_per_step')} ms of a {o.get('step_ms')} ms step")
    out.append(f"\nstatistics cost, {stats_cost_text(s)}")
    return "\n".join(out)


def ruler(d: dict) -> str:
    """``eval ruler --json``: the method x ratio table of mean scores (both engines, :func:`mean_table`), the
    answers the two engines gave alike per shared method (every ratio together), and the score per task at 0.5
    (the full cache at 0)."""
    from vtoken_bench.ruler_eval import mean_table

    rows, cfg = d["rows"], d["config"]
    header, body = mean_table(rows)
    same: dict[str, list[int]] = {}
    for a in d.get("agreement", []):
        s = same.setdefault(a["method"], [0, 0])
        s[0] += a["identical"]
        s[1] += a["samples"]
    out = [f"RULER at {cfg['context_tokens']} tokens, {cfg['model']}, {cfg['samples_per_task']} sample(s) x "
           f"{len(cfg['tasks'])} task(s); mean score (0-100)\n",
           "| " + " | ".join([*header, "same answer text"]) + " |", "|" + "---|" * (len(header) + 1)]
    for row in body:
        s = same.get(row[1])
        out.append("| " + " | ".join([*row, f"{s[0]}/{s[1]}" if s and row[0] == "vtoken" else ""]) + " |")
    tasks = list(cfg["tasks"])
    out += ["", "Per task at 0.5 (full cache: ratio 0)\n", "| engine | method | " + " | ".join(tasks) + " |",
            "|" + "---|" * (len(tasks) + 2)]
    for e, m in dict.fromkeys((r["engine"], r["method"]) for r in rows):
        cells = {r["task"]: r["score"] for r in rows if (r["engine"], r["method"]) == (e, m) and r["ratio"] in (0.0, 0.5)}
        out.append(f"| {e} | {m} | " + " | ".join(f"{cells[t]:.0f}" if t in cells else "-" for t in tasks) + " |")
    return "\n".join(out)


def main() -> None:
    for p in sys.argv[1:]:
        d = json.loads(Path(p).read_text())
        if "decode_steps" in d:
            print(blocks(d))
        elif "passkey_cases" in d:
            print(evaluation(d))
        elif "rows" in d and "protocol" in d.get("config", {}):
            print(ruler(d))
        else:
            print(serve(d))
        print()


if __name__ == "__main__":
    main()
