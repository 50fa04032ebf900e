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


@pytest.mark.parametrize("name", vtoken_policies.names())
def test_every_shipped_policy_file_passes_all_checks(name: str) -> None:
    """The shipped object itself (CASES may run a same-named DSL test policy instead)."""
    report = check_policy(vtoken_policies.load(name), examples=60)
    assert report.ok, report.summary()


def test_every_shipped_file_is_registered() -> None:
    from vtoken_bench import ALL_POLICIES

    files = {p.stem for p in (ROOT / "policies").glob("*.py") if p.stem != "__init__"}
    assert files == {vtoken_policies.path(n).stem for n in vtoken_policies.names()}
    assert set(ALL_POLICIES) == set(vtoken_policies.names())  # bench blocks / eval run every shipped policy


def test_press_table_names_every_kvpress_pair() -> None:
    """docs/writing-a-policy.md's press table lists the file of every policy cross-checked with kvpress."""
    from vtoken_bench.kvpress_check import PAIRS

    table = (ROOT / "docs" / "writing-a-policy.md").read_text().split("## kvpress presses and their vtoken policies")[1]
    for policy, _ in PAIRS:
        assert f"`policies/{vtoken_policies.path(policy).name}`" in table, policy
