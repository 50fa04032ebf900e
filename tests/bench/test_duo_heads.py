"""The DuoAttention head split of ``policies/duo_attention.py`` is what its documented procedure gives."""

from __future__ import annotations

import pytest
import torch

import vtoken_policies
from vtoken_bench.duo_heads import DEFAULTS, retrieval_heads, run


def test_retrieval_heads_are_the_top_fraction_ties_to_the_lower_row() -> None:
    s = torch.tensor([[0.1, 0.9, 0.5], [0.5, 0.0, 0.2]], dtype=torch.float64)
    assert retrieval_heads(s, 0.5) == [[0, 1], [0, 2], [1, 0]]  # 0.5 at (0, 2) and (1, 0): both in, by rank
    assert retrieval_heads(s, 1 / 6) == [[0, 1]]
    assert retrieval_heads(s, 0.0) == [[0, 1]]  # at least one


@pytest.mark.slow
def test_the_shipped_split_is_the_procedures_result() -> None:
    """One float32 eager forward per prompt on SmolLM2 (about 2 minutes here), the shipped defaults."""
    rep = run(**DEFAULTS)  # type: ignore[arg-type]
    shipped = vtoken_policies.load("duo_attention").allocation
    assert [tuple(x) for x in rep["retrieval"]] == list(shipped.retrieval)
    assert (rep["num_layers"], rep["num_kv_heads"]) == (shipped.num_layers, shipped.num_kv_heads)
    scores = torch.tensor(rep["scores"])
    ret = torch.zeros_like(scores, dtype=torch.bool)
    for li, hi in shipped.retrieval:
        ret[li, hi] = True
    assert float(scores[ret].min()) > 2 * float(scores[~ret].median())  # a clear split, not noise
