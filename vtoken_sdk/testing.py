"""Public property-testing helpers: hypothesis strategies and ``check_policy``.

Use them in your own pytest suite::

    from vtoken_sdk.testing import check_policy
    from mypolicies import my_policy

    def test_my_policy():
        report = check_policy(my_policy, examples=300)
        assert report.ok, report.summary()

Strategies draw shapes, lengths, spans, budgets, the head dimension ``D`` and query
heads per KV head ``G`` and a generation mode through hypothesis (so failures shrink)
and fill tensors from a seeded generator (so large batches stay fast): the stored
statistics, and keys / values / query summaries (``StatsBatch.vectors``) of one ``D``
and ``G`` per batch. Modes: ``ties`` (few distinct values), ``continuous``,
``special`` (NaN, +-inf, -0.0 mixed in).
"""

from __future__ import annotations

from typing import Any

from .checks import run_checks
from .strategies import (
    MODES,
    BatchSpec,
    CheckResult,
    PolicyReport,
    Status,
    batch_specs,
    build_batch,
    build_vectors,
    stats_batches,
)

__all__ = ["MODES", "BatchSpec", "CheckResult", "PolicyReport", "Status", "batch_specs", "build_batch",
           "build_vectors", "check_policy", "stats_batches"]


def check_policy(policy: Any, examples: int = 200, checks: tuple[str, ...] | None = None) -> PolicyReport:
    """Run every contract check (see :mod:`vtoken_sdk.checks`) on ``policy``."""
    return run_checks(policy, examples=examples, only=checks)
