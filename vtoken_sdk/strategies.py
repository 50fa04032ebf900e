"""Hypothesis strategies for policy batches and the check result types (used by ``vtoken_sdk.checks``
and re-exported by ``vtoken_sdk.testing``, the public entry point).

Strategies draw shapes, lengths, spans, budgets and a generation mode through hypothesis (so failures
shrink) and fill tensors from a seeded generator (so large batches stay fast). Modes: ``ties`` (few
distinct values), ``continuous``, ``special`` (NaN, +-inf, -0.0 mixed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from hypothesis import strategies as st

from .batch import StatsBatch
from .stats import CATALOG, STORED_STATS, VECTOR_STATS

MODES = ("ties", "continuous", "special")


@dataclass(frozen=True)
class BatchSpec:
    """What a drawn batch looks like (printed for falsifying examples)."""

    b: int
    layers: int
    heads: int
    n: int
    lengths: tuple[int, ...]
    gaps: tuple[int, ...]
    mode: str
    seed: int
    per_row_positions: bool
    spans: tuple[tuple[int, int, int], ...]
    budget: tuple[int, ...] | None
    head_dim: int = 4  # D of the vector statistics
    groups: int = 2  # G: query heads per KV head
    num_layers: int | None = None  # the model's layer count (s.num_layers); None: the batch's L

    def describe(self) -> str:
        return (f"B={self.b} L={self.layers} H={self.heads} N={self.n} lengths={list(self.lengths)} "
                f"evicted-before={list(self.gaps)} mode={self.mode} seed={self.seed} "
                f"per_row_positions={self.per_row_positions} spans={list(self.spans)} budget={self.budget} "
                f"D={self.head_dim} G={self.groups} num_layers={self.num_layers}")


def _vector(rng: np.random.Generator, mode: str, shape: tuple[int, ...]) -> np.ndarray:
    """Vector components: ``ties`` few distinct values (many equal dot products), ``continuous`` normal,
    ``special`` normal with a few NaN / +-inf / -0.0 components."""
    if mode == "ties":
        return (rng.integers(-2, 3, size=shape) / 2).astype(np.float32)
    v = rng.standard_normal(size=shape).astype(np.float32)
    if mode == "special":
        special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype=np.float32)
        pick = rng.random(size=shape) < 0.05
        v[pick] = rng.choice(special, size=int(pick.sum()))
    return v


def build_vectors(spec: BatchSpec, names: tuple[str, ...] = VECTOR_STATS) -> dict[str, torch.Tensor]:
    """The vector statistics of a :class:`BatchSpec` (``StatsBatch.vectors`` layout), deterministic in
    ``spec`` and independent of which scalar statistics are drawn. ``query_cov_future`` is symmetric
    positive semi-definite (``A A^T / D``) outside the ``special`` mode's NaN/inf entries."""
    rng = np.random.default_rng([spec.seed, 1])
    d, g = spec.head_dim, spec.groups
    rows = (spec.b, spec.layers, spec.heads)
    sizes = {"N": spec.n, "G": g, "D": d, "E": d}
    out: dict[str, torch.Tensor] = {}
    for name in VECTOR_STATS:  # fixed order: a name's values do not depend on the others asked for
        axes = CATALOG[name].axes
        if name == "query_cov_future":
            a = _vector(rng, "continuous" if spec.mode == "special" else spec.mode, (*rows, g, d, d))
            v = (np.einsum("...ij,...kj->...ik", a.astype(np.float64), a.astype(np.float64)) / d).astype(np.float32)
            if spec.mode == "special":
                pick = rng.random(size=v.shape) < 0.02
                v[pick] = rng.choice(np.array([np.nan, np.inf, -0.0], dtype=np.float32), size=int(pick.sum()))
        else:
            v = _vector(rng, spec.mode, (*rows, *(sizes[a] for a in axes)))
        if name in names:
            out[name] = torch.from_numpy(np.ascontiguousarray(v))
    return out


def build_batch(spec: BatchSpec, stat_names: tuple[str, ...] = STORED_STATS + VECTOR_STATS) -> StatsBatch:
    """Materialise a :class:`BatchSpec` into tensors (deterministic in ``spec``): the stored statistics
    and the vector statistics (``StatsBatch.vectors``) named in ``stat_names``."""
    rng = np.random.default_rng(spec.seed)
    b, l_, h, n = spec.b, spec.layers, spec.heads, spec.n
    shape = (b, l_, h, n)
    stats: dict[str, torch.Tensor] = {}
    vector_names = tuple(x for x in stat_names if x in VECTOR_STATS)
    for name in stat_names:
        if name in VECTOR_STATS:
            continue
        if spec.mode == "ties":
            v = rng.integers(0, 4, size=shape).astype(np.float32) / 2
        elif spec.mode == "continuous":
            v = rng.standard_normal(size=shape).astype(np.float32)
        else:
            v = rng.standard_normal(size=shape).astype(np.float32)
            special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype=np.float32)
            pick = rng.random(size=shape) < 0.3
            v[pick] = rng.choice(special, size=int(pick.sum()))
        if name in ("low_attn_count",):
            v = np.where(np.isfinite(v), np.abs(np.round(v * 3)), v).astype(np.float32)
        stats[name] = torch.from_numpy(v)
    lengths = torch.tensor(spec.lengths, dtype=torch.int64)
    seq_lens = torch.tensor([ln + g for ln, g in zip(spec.lengths, spec.gaps, strict=True)], dtype=torch.int64)
    rows = (l_, h) if spec.per_row_positions else (1, 1)
    pos = np.zeros((b, *rows, n), dtype=np.int64)
    for i, (ln, sl) in enumerate(zip(spec.lengths, seq_lens.tolist(), strict=True)):
        for r in np.ndindex(*rows):
            chosen = np.sort(rng.choice(sl, size=ln, replace=False)) if ln else np.zeros(0, dtype=np.int64)
            pos[(i, *r)][:ln] = chosen
            pos[(i, *r)][ln:] = sl + np.arange(n - ln)  # padding: beyond the request
    pinned = torch.zeros((b, 1, 1, n), dtype=torch.bool)
    positions = torch.from_numpy(pos)
    for req, start, end in spec.spans:
        pinned[req] |= (positions[req] >= start) & (positions[req] < end) if rows == (1, 1) else False
    budget = None if spec.budget is None else torch.tensor(spec.budget, dtype=torch.int64)
    vectors = build_vectors(spec, vector_names) if vector_names else {}
    return StatsBatch(stats=stats, lengths=lengths, positions=positions, seq_lens=seq_lens,
                      pinned=pinned if spec.spans else None, budget=budget, meta={"spec": spec}, vectors=vectors,
                      head_dim=spec.head_dim, num_layers=spec.num_layers)


@st.composite
def batch_specs(draw: Any, max_b: int = 4, max_layers: int = 2, max_heads: int = 3, max_n: int = 48,
                modes: tuple[str, ...] = MODES, allow_budget_override: bool = True, max_head_dim: int = 6,
                max_groups: int = 3) -> BatchSpec:
    b = draw(st.integers(1, max_b))
    layers = draw(st.integers(1, max_layers))
    heads = draw(st.integers(1, max_heads))
    n = draw(st.integers(1, max_n))
    lengths = tuple(draw(st.lists(st.integers(0, n), min_size=b, max_size=b)))
    gaps = tuple(draw(st.lists(st.integers(0, 2 * n), min_size=b, max_size=b)))
    mode = draw(st.sampled_from(modes))
    seed = draw(st.integers(0, 2**16))
    per_row = draw(st.booleans())
    spans: tuple[tuple[int, int, int], ...] = ()
    if not per_row and draw(st.booleans()):
        spans = tuple(draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, 3 * n), st.integers(0, 8)).map(
            lambda t: (t[0], t[1], t[1] + t[2])), max_size=3)))
    budget = None
    if allow_budget_override and draw(st.booleans()):
        budget = tuple(draw(st.lists(st.integers(0, n + 2), min_size=b, max_size=b)))
    head_dim = draw(st.integers(1, max_head_dim))
    groups = draw(st.integers(1, max_groups))
    # the model's depth past the batch's layers, from the seed rather than a draw of its own (an extra draw
    # would change every example hypothesis generates for the other fields): None = the batch's L
    num_layers = None if seed % 3 == 0 else layers + (seed // 3) % 41
    return BatchSpec(b, layers, heads, n, lengths, gaps, mode, seed, per_row, spans, budget, head_dim, groups,
                     num_layers)


def stats_batches(stat_names: tuple[str, ...] = STORED_STATS, **kw: Any) -> st.SearchStrategy[StatsBatch]:
    """Strategy of :class:`StatsBatch` with the given stored and vector statistics (key / value /
    query summaries of one consistent D and G per batch)."""
    return batch_specs(**kw).map(lambda s: build_batch(s, stat_names))


# ---------------------------------------------------------------------------- check_policy


Status = Literal["pass", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "fail", "skip")


@dataclass
class CheckResult:
    """One check of one policy. ``status``: ``"pass"`` (it ran and held), ``"fail"`` (it ran and broke,
    or could not run because the policy is broken), ``"skip"`` (it did not run; ``detail`` says why)."""

    name: str
    status: Status
    detail: str = ""
    example: str = ""
    line: int | None = None
    spec: BatchSpec | None = field(default=None, repr=False, compare=False)  # the falsifying batch, if any

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"got CheckResult.status={self.status!r}, expected one of {STATUSES}")


@dataclass
class PolicyReport:
    policy: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks did not run: see :meth:`count`)."""
        return not any(r.status == "fail" for r in self.results)

    def count(self, status: Status) -> int:
        """How many checks ended with ``status``."""
        return sum(r.status == status for r in self.results)

    def summary(self) -> str:
        lines = [f"policy {self.policy}: " + ", ".join(
            f"{self.count(st)} {word}" for st, word in zip(STATUSES, ("passed", "failed", "skipped"), strict=True))]
        for r in self.results:
            lines.append(f"  [{r.status.upper()}] {r.name} {r.detail}")
            if r.example:
                lines.append(f"      falsifying example: {r.example}")
        return "\n".join(lines)
