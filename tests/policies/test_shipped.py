"""Every shipped policy (and every case of the shared table) satisfies the contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vtoken_policies
from tests.cases import ALLOCATION_CASES, CASES, build, case_id, sizes
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


@sizes(fast=25, full=500)
@pytest.mark.parametrize("case", CASES + ALLOCATION_CASES, ids=case_id)
def test_contract_properties(case, examples: int) -> None:
    report = check_policy(build(case), examples=examples,
                          checks=("pins_kept", "exact_budget", "batch_invariant", "padding"))
    assert report.ok, report.summary()


@sizes(fast=8, full=100)
@pytest.mark.parametrize("case", CASES + ALLOCATION_CASES, ids=case_id)
def test_all_checks_pass(case, examples: int) -> None:
    report = check_policy(build(case), examples=examples)
    assert report.ok, report.summary()


@sizes(fast=8, full=60)
@pytest.mark.parametrize("name", vtoken_policies.names())
def test_every_shipped_policy_file_passes_all_checks(name: str, examples: int) -> None:
    """The shipped object itself (CASES may run a same-named DSL test policy instead)."""
    report = check_policy(vtoken_policies.load(name), examples=examples)
    assert report.ok, report.summary()


def test_every_shipped_file_is_registered() -> None:
    from vtoken_bench import ALL_POLICIES

    files = {p.stem for p in (ROOT / "policies").glob("*.py") if p.stem != "__init__"}
    assert files == {vtoken_policies.path(n).stem for n in vtoken_policies.names()}
    # bench blocks / eval / eval ruler (the HF session) run every shipped policy, unequal budgets included
    assert set(ALL_POLICIES) == set(vtoken_policies.names())
    assert set(vtoken_policies.names()) - set(vtoken_policies.uniform()) == {
        "ada_snapkv", "ada_expected_attention", "pyramidkv", "ada_snap_observed", "duo_attention"}


def readme_policies() -> list[str]:
    """The names in the first column of the README's "Shipped policies" table."""
    text = (ROOT / "README.md").read_text()
    assert "\nShipped policies " in text, "README.md lost its 'Shipped policies' table"
    section = text.split("\nShipped policies ", 1)[1].split("\n\n", 2)[1]  # the table after the intro line(s)
    return re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)


def test_readme_lists_exactly_the_shipped_policies() -> None:
    """README.md's list against the registry (``vtoken_policies``): neither side has one the other lacks."""
    listed = readme_policies()
    assert len(listed) == len(set(listed)), f"listed twice in README.md: {listed}"
    shipped = set(vtoken_policies.names())
    assert not shipped - set(listed), f"shipped but not in README.md: {sorted(shipped - set(listed))}"
    assert not set(listed) - shipped, f"in README.md but not shipped: {sorted(set(listed) - shipped)}"


def test_press_table_names_every_kvpress_pair() -> None:
    """docs/writing-a-policy.md's press table lists the file of every policy cross-checked with kvpress."""
    from vtoken_bench.kvpress_check import PAIRS

    table = (ROOT / "docs" / "writing-a-policy.md").read_text().split("## kvpress presses and their vtoken policies")[1]
    for policy, _ in PAIRS:
        assert f"`policies/{vtoken_policies.path(policy).name}`" in table, policy
