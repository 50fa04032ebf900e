"""Shared plumbing of the real-model experiments (bench blocks, eval).

One prefill per prompt is shared by every (policy, ratio) configuration: the prompt is
prefilled once with no eviction, then forked into one request per configuration; all
configurations then decode together as one batch (each with its own greedy tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vtoken_bench import ALL_POLICIES  # noqa: F401 (re-exported)

PAPER_POLICIES = ("h2o", "scissorhands", "random")


@dataclass(frozen=True)
class Config:
    policy: str
    eviction_ratio: float

    @property
    def key(self) -> str:
        return f"{self.policy}@{self.eviction_ratio}"


def load_named_policy(name: str) -> Any:
    """A shipped policy by name, or the policy defined in a policy file (``name`` ending in ``.py``; the file
    must define exactly one), for the benchmarks that run the HF session. A bad file raises ``ValueError``
    with the loader's file:line message; so does a policy with unequal allocation that the session's per-row
    pages cannot take (one evicting after decode steps: ``vtoken_runtime.eviction.refuse_unequal``), before
    anything runs."""
    from vtoken_runtime.eviction import refuse_unequal

    if name.endswith(".py"):
        from vtoken_sdk.loader import load_policy_file

        lf = load_policy_file(name)
        if lf.error is not None:
            raise ValueError(lf.error.render())
        if len(lf.policies) != 1:
            raise ValueError(f"{name}: defines {len(lf.policies)} policies "
                             f"({', '.join(p.name for p in lf.policies)}); expected one per file")
        pol = lf.policies[0]
    else:
        import vtoken_policies

        pol = vtoken_policies.load(name)
    refuse_unequal(pol, rows=True)
    return pol


def configured_policy(name: str, eviction_ratio: float) -> Any:
    """A shipped policy (or a policy file, see :func:`load_named_policy`) with its budget set to keep
    ``1 - eviction_ratio`` of the tokens."""
    p = load_named_policy(name)
    return p.configure(budget=p.budget.model_copy(update={"ratio": 1.0 - eviction_ratio}))


def setup_torch() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)


def load_model() -> tuple[Any, Any]:
    from vtoken_bench.models import load_smollm2

    return load_smollm2()


def stat_union(policies: Sequence[Any]) -> tuple[str, ...]:
    out: set[str] = set()
    for p in policies:
        out |= set(p.stored_reads)
    return tuple(sorted(out))


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain(x: Any) -> Any:
    """``json.dumps``'s fallback for the numpy scalars a measurement can carry (``np.int64`` counts)."""
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_plain))


def decode_grouped(s: Any, keys: list[str], tokens: Sequence[int], groups: Sequence[Sequence[int]],
                   evict: bool = True) -> torch.Tensor:
    """``s.decode`` per group of requests of similar cache length (indices into ``keys``); returns the
    logits ``[len(keys), V]`` in ``keys`` order. The paged attention pads every request of a forward to
    the longest one, so grouping requests by eviction ratio saves about a third of the attention work."""
    out: list[torch.Tensor | None] = [None] * len(keys)
    for g in groups:
        lg = s.decode([keys[i] for i in g], [tokens[i] for i in g], evict=evict)
        for j, i in enumerate(g):
            out[i] = lg[j]
    return torch.stack([x for x in out if x is not None])


def ratio_groups(configs: Sequence[Config]) -> list[list[int]]:
    by: dict[float, list[int]] = {}
    for i, c in enumerate(configs):
        by.setdefault(c.eviction_ratio, []).append(i)
    return list(by.values())
