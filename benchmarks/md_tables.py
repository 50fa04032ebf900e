"""Render the JSON reports of ``vtoken-cli bench blocks`` / ``eval`` / ``bench serve`` as markdown tables.

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


def evaluation(d: dict) -> str:
    out = [f"model: {d['model']}; perplexity of {d['continuation']} tokens after a {d['context']}-token context "
           f"({d['ppl_requests']} windows); passkey cases: {len(d['passkey_cases']) // 2} per mode; {d['seconds']} s\n",
           "| policy | evict | perplexity, evict once | perplexity, evict every step | passkey, question in prompt "
           "| passkey, question after eviction |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['policy']} | {r['eviction_ratio']} | {r['perplexity_once']:.2f} | {r['perplexity_decode']:.2f} | "
                   f"{100 * r['passkey_in_prompt']:.0f}% | {100 * r['passkey_after_eviction']:.0f}% |")
    return "\n".join(out)


def serve(d: dict) -> str:
    rows = d["rows"]
    van = rows[0]
    out = ["| mode | policy | evict | max concurrency | vs vanilla | mean peak blocks/req | no-preemption concurrency "
           "| vs vanilla | SLA rps | p95 s | tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["max_concurrency"] / van["max_concurrency"]
        g2 = r.get("guaranteed_concurrency", 0) / max(1, van.get("guaranteed_concurrency", 0) or 1)
        out.append(f"| {r['mode']} | {r['policy']} | {r['eviction_ratio']} | {r['max_concurrency']} | {g:.2f}x | "
                   f"{r.get('mean_peak_blocks', '-')} | {r.get('guaranteed_concurrency', '-')} | {g2:.2f}x | "
                   f"{r['sla_throughput_rps'] if r['sla_throughput_rps'] is not None else '-'} | "
                   f"{r['p95_latency_s'] if r['p95_latency_s'] is not None else '-'} | {r['closed_loop_tok_s']} |")
    o = d["overhead"]
    out.append(f"\noverhead with policy none: vanilla {o['vanilla_tok_s']} tok/s, plugin {o['plugin_none_tok_s']} tok/s "
               f"({o['overhead_pct']}%); indirection {o.get('indirection_ms_per_step')} ms of a "
               f"{o.get('step_ms')} ms step")
    return "\n".join(out)


def main() -> None:
    for p in sys.argv[1:]:
        d = json.loads(Path(p).read_text())
        if "decode_steps" in d:
            print(blocks(d))
        elif "passkey_cases" in d:
            print(evaluation(d))
        else:
            print(serve(d))
        print()


if __name__ == "__main__":
    main()
