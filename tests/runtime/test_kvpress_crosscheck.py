"""vtoken vs NVIDIA kvpress (the peer, in .venv-kvpress) on SmolLM2: same kept tokens, same greedy text.

One test per (vtoken policy, kvpress press) pair of ``vtoken_bench.kvpress_check.PAIRS`` (the unequal-budget
pairs, AdaKV and PyramidKV, ``UNEQUAL``, run in the session's per-row pages); LagKVPress has no
vtoken policy (``LAGKV_WHY``), so only its peer run is checked."""

from __future__ import annotations

import pytest

from vtoken_bench.kvpress_check import (
    CHUNK_LENGTH,
    PAIRS,
    PEER_PY,
    UNEQUAL,
    compare,
    kvpress_budget,
    run_peer,
    whole_share,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PEER_PY.exists(), reason="run `make kvpress`")]


@pytest.fixture(scope="module")
def setup():
    from vtoken_bench.essays import build_passkey
    from vtoken_bench.models import load_smollm2, smollm2_path

    model, tok = load_smollm2()
    return model, tok, build_passkey(tok, 400, 0.5, 48213), smollm2_path()


@pytest.mark.parametrize(("policy", "press"), PAIRS, ids=[pr for _, pr in PAIRS])
def test_same_kept_tokens_and_greedy_continuation(setup, policy: str, press: str) -> None:
    model, _, p, model_dir = setup
    r = compare(press, 0.5, p.context_ids, p.question_ids, 12, model, model_dir, policy)
    assert r["n_kept_peer"] == r["n_kept_peer_min"] == r["n_kept_vtoken"], r
    assert not r["failures"], r
    if press == "knorm":
        # key norms are computed from each side's own forward (eager HF vs paged attention): fp32
        # rounding may flip a near-tie; everything else must agree
        assert r["tokens_differing"] <= 0.002 * r["rows"] * r["n_kept_vtoken"], r
        assert r["rows_identical"] >= 0.95 * r["rows"], r
    else:
        assert r["rows_identical"] == r["rows"], r
    assert r["greedy_equal"], r
    if press in UNEQUAL:  # per-row pages: rows of unequal sizes
        assert r["row_kept_min"] < r["row_kept_max"], r


def test_whole_share_is_the_longest_prefix_with_a_whole_kvpress_share() -> None:
    assert [whole_share(387, 0.5), whole_share(386, 0.5), whole_share(387, 0.75), whole_share(387, 0.875)] == [
        386, 386, 384, 384]


def test_chunkkv_budget_is_whole_chunks() -> None:
    # 387 tokens: 19 chunks of 20 + 7; int(20 * 0.5) = 10 chunks, the partial one among them
    assert kvpress_budget("chunkkv", 387, 0.5) == 9 * CHUNK_LENGTH + 7
    assert kvpress_budget("chunkkv", 400, 0.5) == 10 * CHUNK_LENGTH
    assert kvpress_budget("knorm", 387, 0.5) == 193


def test_lagkv_peer_runs(setup) -> None:
    _, _, p, model_dir = setup
    r = run_peer("lagkv", 0.5, p.context_ids, p.question_ids, 4, model_dir)
    assert r["n_kept"][0] == 193 and r["topk_agrees"]
