"""Every shipped policy (and every case of the shared table) satisfies the contract."""

from __future__ import annotations

from pathlib import Path

import pytest

import vtoken_policies
from tests.cases import CASES, build, case_id
from vtoken_sdk.testing import check_policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.name)
def test_policy_files_stay_under_50_lines(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n < 50, f"{path.name} has {n} lines; a policy file must stay under 50"


def test_every_shipped_policy_cites_a_paper() -> None:
    for name in vtoken_policies.names():
        p = vtoken_policies.load(name)
        assert "arXiv" in p.doc, f"{name} docstring must cite its paper"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_contract_properties_500_examples(case) -> None:
    report = check_policy(build(case), examples=500,
                          checks=("pins_kept", "exact_budget", "batch_invariant", "padding"))
    assert report.ok, report.summary()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_checks_pass(case) -> None:
    report = check_policy(build(case), examples=100)
    assert report.ok, report.summary()
