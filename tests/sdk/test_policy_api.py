"""The @policy decorator, tracing, configure(), and the errors authors see."""

from __future__ import annotations

import pytest
import torch

import vtoken_sdk as vt
from vtoken_sdk import ir
from vtoken_sdk.batch import StatsBatch
from vtoken_sdk.errors import PolicyDefinitionError


def _batch(n: int = 8, b: int = 1, l_: int = 2, h: int = 3, seq: int | None = None) -> StatsBatch:
    g = torch.Generator().manual_seed(0)
    stats = {name: torch.rand(b, l_, h, n, generator=g) for name in vt.stats.STORED_STATS}
    lengths = torch.full((b,), n)
    seq_lens = torch.full((b,), seq or n)
    return StatsBatch(stats=stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n, seq_lens),
                      seq_lens=seq_lens)


def test_decorator_traces_and_records_reads() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(64)], granularity="head")
    def h2o(s: vt.TokenStats):
        """Heavy hitters."""
        return s.attn_sum

    assert h2o.name == "h2o" and h2o.reads == {"attn_sum"} and h2o.stored_reads == {"attn_sum"}
    assert h2o.node == ir.Stat("attn_sum")
    assert h2o.doc == "Heavy hitters."


def test_torch_functions_and_where_trace_into_ir() -> None:
    @vt.policy(budget=vt.Budget(tokens=4))
    def mix(s: vt.TokenStats):
        x = torch.log(s.attn_sum + 1e-6) - 0.5 * s.key_norm.sqrt()
        return vt.where(s.age < 8, x + 100.0, vt.max_pool(x, 3))

    assert mix.reads == {"attn_sum", "key_norm", "age"}
    assert mix.stored_reads == {"attn_sum", "key_norm"}
    batch = _batch()
    scores = mix.compile("torch").scores(batch)
    assert scores.shape == (1, 2, 3, 8)
    manual = torch.log(batch.stats["attn_sum"] + 1e-6) - 0.5 * batch.stats["key_norm"].sqrt()
    assert torch.equal(scores[..., -1], manual[..., -1] + 100.0)


def test_params_and_configure_retrace() -> None:
    class P(vt.Params):
        alpha: float = 1.0

    @vt.policy(budget=vt.Budget(ratio=0.5), params=P())
    def blend(s: vt.TokenStats, p: P):
        return s.attn_sum + p.alpha * s.value_norm

    assert "1.0" in blend.describe()
    b2 = blend.configure(alpha=3.0, budget=vt.Budget.evict(0.7))
    assert "3.0" in b2.describe() and b2.budget.ratio == pytest.approx(0.3)
    assert blend.budget.ratio == 0.5  # original untouched (frozen spec)
    with pytest.raises(PolicyDefinitionError, match="alpha"):
        blend.configure(alpha="x")
    with pytest.raises(PolicyDefinitionError, match="unknown setting"):
        vt.policy(budget=vt.Budget(ratio=0.5))(lambda s: s.attn_sum).configure(beta=1)


def test_spec_is_frozen_and_forbids_extra() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        vt.Budget(ratio=0.5, typo=1)  # type: ignore[call-arg]
    b = vt.Budget(ratio=0.5)
    with pytest.raises(ValidationError):
        b.ratio = 0.3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("return s.nope", "unknown statistic s.nope"),
        ("return s.attn_sum if s.attn_sum > 0 else s.key_norm", "control flow"),
        ("return s.attn_sum[0]", "indexing"),
        ("return s.attn_sum.add_(1)", "in-place"),
        ("return torch.softmax(s.attn_sum, -1)", "torch.softmax is not supported"),
        ("return (s.attn_sum > 1) | s.key_norm", "expected a boolean"),
        ("return vt.max_pool(s.attn_sum, 4)", "odd int"),
        ("return [s.attn_sum]", "returned list"),
        ("return len(s.attn_sum)", "len()"),
        ("return s.attn_sum.topk(3)", "unsupported tensor method .topk"),
    ],
)
def test_unsupported_constructs_raise_with_location(tmp_path, body: str, match: str) -> None:
    f = tmp_path / "pol.py"
    f.write_text("import torch\nimport vtoken_sdk as vt\n\n@vt.policy(budget=vt.Budget(ratio=0.5))\n"
                 f"def p(s):\n    {body}\n")
    from vtoken_sdk.loader import load_policy_file

    loaded = load_policy_file(f)
    assert loaded.error is not None
    assert match in loaded.error.message or match in str(loaded.error)
    assert loaded.error.line == 6, loaded.error.render()


def test_budget_semantics() -> None:
    b = vt.Budget(ratio=0.5, min_tokens=3, slack=2, when="decode")
    assert b.resolve(10) == 5 and b.resolve(2) == 3
    assert not b.should_evict(7, 10, "decode") and b.should_evict(8, 10, "decode")
    assert not b.should_evict(100, 10, "prefill")
    assert vt.Budget.evict(0.3).ratio == pytest.approx(0.7)
    assert vt.Budget(tokens=7).resolve(1000) == 7
    with pytest.raises(ValueError):
        vt.Budget()
    with pytest.raises(ValueError):
        vt.Budget.evict(1.0)


def test_protection_rules_compose() -> None:
    @vt.policy(budget=vt.Budget(tokens=1), protect=vt.sinks(2) | vt.recent(1) | vt.span(4, 6))
    def p(s: vt.TokenStats):
        return s.attn_sum

    batch = _batch(n=10)
    pins = p.compile("torch").pins(batch)[0, 0, 0].tolist()
    assert pins == [True, True, False, False, True, True, False, False, False, True]
    mask = p.keep_mask(batch)
    assert mask[0, 0, 0].tolist() == pins  # budget 1 < 5 pins: exactly the pins


def test_request_pins_and_predicates() -> None:
    @vt.policy(budget=vt.Budget(tokens=2), protect=[vt.protect_if(lambda s: s.key_norm > 0.9)], granularity="head")
    def p(s: vt.TokenStats):
        return s.attn_sum

    batch = _batch(n=12)
    pinned = torch.zeros(1, 1, 1, 12, dtype=torch.bool)
    pinned[..., 3] = True
    batch = StatsBatch(stats=batch.stats, lengths=batch.lengths, positions=batch.positions, seq_lens=batch.seq_lens,
                       pinned=pinned)
    mask = p.keep_mask(batch)
    pred = batch.stats["key_norm"] > 0.9
    assert mask[..., 3].all()
    assert (mask | ~pred).all()
    counts = mask.sum(-1)
    assert (counts == counts.flatten()[0]).all()  # same count in every (layer, head)


def test_request_granularity_shares_one_mask() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.5), granularity="request")
    def p(s: vt.TokenStats):
        return s.attn_sum

    mask = p.keep_mask(_batch(n=16))
    assert (mask == mask[:, :1, :1]).all() and int(mask[0, 0, 0].sum()) == 8


def test_head_mean_gives_one_decision_per_layer() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.25), granularity="head")
    def p(s: vt.TokenStats):
        return vt.head_mean(s.attn_last)

    mask = p.keep_mask(_batch(n=16))
    assert (mask == mask[:, :, :1]).all()
    assert not (mask[:, 0] == mask[:, 1]).all()


def test_random_stat_is_deterministic_and_batch_independent() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.5))
    def p(s: vt.TokenStats):
        return s.random

    batch = _batch(n=64, b=2)
    s1 = p.compile("torch").scores(batch)
    assert torch.equal(s1, p.compile("torch").scores(batch))
    assert torch.equal(s1[1:], p.compile("torch").scores(batch.select_requests([1])))
    assert 0.4 < float(s1.mean()) < 0.6
    other = p.configure(stats=vt.StatsConfig(seed=7)).compile("torch").scores(batch)
    assert not torch.equal(s1, other)
