"""Budget.resolve rounds half up: ``max(min_tokens, floor(ratio * seq_len + 0.5))`` (or ``tokens``).

Expectations are computed with exact rational / integer arithmetic, never by calling ``resolve``:
ratios that are exact in binary (k / 2**m, products exact in float64) must match to the token,
including the ties at .5 (ratio 0.5 with odd lengths, 0.25 / 0.75 with lengths 2 mod 4, ...); any
other float ratio must match the exact round-half-up of its (exact, dyadic) value times the length,
except within float64 rounding of a tie, where either neighbour is accepted. The contract check
behind ``vtoken-cli validate`` (``exact_budget``) must not trust a backend's own budget either.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vtoken_sdk as vt
from tests.cases import sizes
from vtoken_sdk.batch import StatsBatch
from vtoken_sdk.budget import parse_slack
from vtoken_sdk.checks import ContractViolation, prop_budget
from vtoken_sdk.torch_backend import TorchPolicy

LENGTHS = st.integers(0, 1 << 20)
MIN_TOKENS = st.one_of(st.just(0), st.integers(0, 64))


def half_up(x: Fraction) -> int:
    """floor(x + 1/2) for an exact rational x >= 0."""
    return math.floor(x + Fraction(1, 2))


@st.composite
def dyadic_ratios(draw: st.DrawFn) -> tuple[int, int]:
    """``(k, m)`` with ratio ``k / 2**m`` in (0, 1]: exact in binary."""
    m = draw(st.integers(0, 10))
    k = draw(st.integers(1, 1 << m))
    return k, m


@settings(max_examples=400, deadline=None)
@given(km=dyadic_ratios(), seq_len=LENGTHS, min_tokens=MIN_TOKENS)
def test_dyadic_ratio_rounds_half_up_exactly(km: tuple[int, int], seq_len: int, min_tokens: int) -> None:
    k, m = km
    b = vt.Budget(ratio=k / 2**m, min_tokens=min_tokens)
    # floor(k * s / 2**m + 1/2) in integers: floor((2 k s + 2**m) / 2**(m+1))
    want = (2 * k * seq_len + (1 << m)) >> (m + 1)
    assert b.resolve(seq_len) == max(min_tokens, want), (k, m, seq_len)


@settings(max_examples=200, deadline=None)
@given(
    case=st.one_of(
        # (ratio as k/2**m, length) whose product lies exactly on .5
        st.integers(0, 1 << 18).map(lambda j: ((1, 1), 2 * j + 1)),   # 0.5 x odd
        st.integers(0, 1 << 18).map(lambda j: ((1, 2), 4 * j + 2)),   # 0.25 x (2 mod 4)
        st.integers(0, 1 << 18).map(lambda j: ((3, 2), 4 * j + 2)),   # 0.75 x (2 mod 4)
        st.tuples(st.integers(0, 1 << 12), st.sampled_from([1, 3, 5, 7])).map(
            lambda t: ((t[1], 3), 8 * t[0] + 4)),                      # odd/8 x (4 mod 8)
    ),
    min_tokens=MIN_TOKENS,
)
def test_exact_ties_round_up(case: tuple[tuple[int, int], int], min_tokens: int) -> None:
    (k, m), seq_len = case
    exact = Fraction(k, 2**m) * seq_len
    assert exact.denominator == 2  # really a tie
    want = int(exact + Fraction(1, 2))  # the tie rounds up, not down and not to even
    assert vt.Budget(ratio=k / 2**m, min_tokens=min_tokens).resolve(seq_len) == max(min_tokens, want)


@settings(max_examples=400, deadline=None)
@given(ratio=st.floats(min_value=1e-6, max_value=1.0), seq_len=LENGTHS, min_tokens=MIN_TOKENS)
def test_any_float_ratio_rounds_half_up(ratio: float, seq_len: int, min_tokens: int) -> None:
    exact = Fraction(ratio) * seq_len  # a float is an exact dyadic rational
    got = vt.Budget(ratio=ratio, min_tokens=min_tokens).resolve(seq_len)
    frac = exact - math.floor(exact)
    near_tie = abs(frac - Fraction(1, 2)) <= Fraction(seq_len + 1, 2**50)  # float64 rounding of the product
    want = half_up(exact)
    if near_tie:
        assert got in {max(min_tokens, math.floor(exact)), max(min_tokens, math.floor(exact) + 1)}
    else:
        assert got == max(min_tokens, want), (ratio, seq_len, exact)


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 1 << 20), seq_len=LENGTHS, min_tokens=MIN_TOKENS)
def test_absolute_budget_ignores_length(tokens: int, seq_len: int, min_tokens: int) -> None:
    assert vt.Budget(tokens=tokens, min_tokens=min_tokens).resolve(seq_len) == max(min_tokens, tokens)


@settings(max_examples=200, deadline=None)
@given(km=dyadic_ratios(), seq_len=st.integers(0, 4096), live=st.integers(0, 4096), slack=st.integers(0, 16),
       override=st.one_of(st.none(), st.integers(0, 4096)))
def test_should_evict_uses_the_rounded_budget(km: tuple[int, int], seq_len: int, live: int, slack: int,
                                              override: int | None) -> None:
    k, m = km
    b = vt.Budget(ratio=k / 2**m, slack=slack)
    budget = ((2 * k * seq_len + (1 << m)) >> (m + 1)) if override is None else override
    assert b.should_evict(live, seq_len, "decode", override) == (live > budget + slack)


def test_hand_picked_values() -> None:
    assert [vt.Budget(ratio=0.5).resolve(n) for n in (0, 1, 2, 3, 4, 5)] == [0, 1, 1, 2, 2, 3]
    assert [vt.Budget(ratio=0.25).resolve(n) for n in (1, 2, 3, 6, 10)] == [0, 1, 1, 2, 3]
    assert vt.Budget(ratio=0.75).resolve(6) == 5  # 4.5 -> 5
    assert vt.Budget.evict(0.5).resolve(7) == 4


# ---------------------------------------------------------------------- the contract check's expectation


class _FloorBudgets(TorchPolicy):
    """A backend whose budget rounds down (the planted bug): its masks agree with its own budgets()."""

    def budgets(self, batch: StatsBatch) -> torch.Tensor:
        if batch.budget is not None:
            return batch.budget.to(torch.int64)
        r = self.policy.spec.budget.ratio
        return torch.tensor([math.floor(r * int(s)) for s in batch.seq_lens.tolist()], dtype=torch.int64)


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_exact_budget_check_does_not_trust_the_backend_budget(ratio: float) -> None:
    @vt.policy(budget=vt.Budget(ratio=ratio), granularity="head")
    def p(s: vt.TokenStats):
        return s.attn_sum

    n = 10
    lengths, seq = torch.tensor([n, n]), torch.tensor([15, 22])  # 0.5 x 15 = 7.5 -> 8; 0.25 x 22 = 5.5 -> 6
    batch = StatsBatch(stats={"attn_sum": torch.randn(2, 1, 2, n, generator=torch.Generator().manual_seed(0))},
                       lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n, seq), seq_lens=seq)
    prop_budget(TorchPolicy(p), batch)  # the real backend passes
    with pytest.raises(ContractViolation, match="expected"):
        prop_budget(_FloorBudgets(p), batch)


@pytest.mark.parametrize(("when", "phases"), [
    ("prefill", {"prefill"}), ("decode", {"decode"}), ("both", {"prefill", "decode"}),
    ("chunks", {"chunk", "prefill", "decode"}),
])
def test_when_selects_the_phases_that_evict(when: str, phases: set[str]) -> None:
    b = vt.Budget(ratio=0.5, when=when)
    for phase in ("chunk", "prefill", "decode"):
        assert b.should_evict(live=100, seq_len=100, phase=phase) == (phase in phases), (when, phase)
    assert not b.should_evict(live=50, seq_len=100, phase="chunk")  # at the budget: nothing to do


def test_override_keeps_or_replaces_when() -> None:
    b = vt.Budget(ratio=0.5, min_tokens=8, slack=4)
    assert b.override(when="chunks") == vt.Budget(ratio=0.5, min_tokens=8, slack=4, when="chunks")
    assert b.override(eviction_ratio=0.7, when="chunks").when == "chunks"
    assert b.override(when="chunks").override(tokens=64).when == "chunks"  # a size override keeps when
    with pytest.raises(ValueError):
        b.override(when="sometimes")  # type: ignore[arg-type]


def test_override_keeps_or_replaces_slack() -> None:
    b = vt.Budget(ratio=0.5, min_tokens=8, slack=4, when="chunks")
    assert b.override() is b
    assert b.override(slack=32) == vt.Budget(ratio=0.5, min_tokens=8, slack=32, when="chunks")
    assert b.override(eviction_ratio=0.7, slack=0) == vt.Budget.evict(0.7, min_tokens=8, slack=0, when="chunks")
    assert b.override(slack=32).override(tokens=64).slack == 32  # a size override keeps slack
    assert vt.Budget(tokens=100).override(slack=16) == vt.Budget(tokens=100, slack=16)
    with pytest.raises(ValueError):
        b.override(slack=-1)
    # the slack changes when eviction runs, not how much is kept
    s = b.override(slack=32)
    assert not s.should_evict(live=82, seq_len=100, phase="decode") and s.should_evict(83, 100, "decode")
    assert s.resolve(100) == b.resolve(100) == 50


def _simulate(b: vt.Budget, chunks: list[int], decode: int, bs: int) -> tuple[list[int], int]:
    """Simulate one request under ``b``: a prefill in ``chunks`` (tokens per step), then ``decode`` one-token
    steps, eviction down to the budget whenever ``should_evict`` says so. Returns the blocks it needs at every
    reservation and holds after every step (interleaved), and how many evictions ran."""
    live = seq = 0
    held: list[int] = []
    evictions = 0
    prompt = sum(chunks)
    for i, n in enumerate([*chunks, *[1] * decode]):
        held.append(-(-(live + n) // bs))  # at the reservation of the step's tokens
        live, seq = live + n, seq + n
        phase = "decode" if i >= len(chunks) else ("prefill" if seq == prompt else "chunk")
        if b.should_evict(live, seq, phase, block_size=bs):
            live, evictions = b.resolve(seq), evictions + 1
        held.append(-(-live // bs))  # after the step's eviction
    return held, evictions


def _held_blocks(b: vt.Budget, prompt: int, chunk: int, decode: int, bs: int) -> tuple[list[int], int]:
    """:func:`_simulate` with the prompt in chunks of ``chunk`` tokens (the last one partial)."""
    return _simulate(b, [min(chunk, prompt - i) for i in range(0, prompt, chunk)], decode, bs)


@sizes(fast=60, full=300)
def test_block_slack_holds_the_blocks_of_slack_zero(examples: int) -> None:
    """``slack="block"`` needs and holds exactly the blocks of ``slack=0`` at every reservation and after
    every step (one-token decode steps), and never evicts more often."""
    settings(max_examples=examples, deadline=None)(given(
        size=st.one_of(dyadic_ratios(), st.integers(1, 300)), min_tokens=MIN_TOKENS,
        when=st.sampled_from(["both", "chunks"]), prompt=st.integers(1, 600), chunk=st.integers(1, 256),
        decode=st.integers(0, 400), bs=st.sampled_from([1, 4, 16, 32]))(_block_slack_holds_slack_zeros_blocks))()


def _block_slack_holds_slack_zeros_blocks(size: tuple[int, int] | int, min_tokens: int, when: str, prompt: int,
                                          chunk: int, decode: int, bs: int) -> None:
    kw = {"tokens": size} if isinstance(size, int) else {"ratio": size[0] / 2**size[1]}
    exact = vt.Budget(**kw, min_tokens=min_tokens, when=when)  # type: ignore[arg-type]
    lazy = exact.override(slack="block")
    (want, n_exact), (got, n_lazy) = (_held_blocks(b, prompt, chunk, decode, bs) for b in (exact, lazy))
    assert got == want
    assert n_lazy <= n_exact


def test_block_slack_defers_decode_evictions_and_parses() -> None:
    b = vt.Budget(ratio=0.5, slack="block")
    assert _held_blocks(b, 1000, 128, 512, 32)[1] < _held_blocks(b.override(slack=0), 1000, 128, 512, 32)[1] // 3
    # seq 80: budget 40 = 2 blocks of 32; 50 live tokens fit in them, 64 fill them, 65 need a third
    assert [b.should_evict(n, 80, "decode", block_size=32) for n in (40, 50, 63, 64, 65)] == [False] * 3 + [True] * 2
    assert b.should_evict(50, 80, "decode") and b.override(when="chunks").should_evict(50, 80, "chunk", block_size=32)
    assert [parse_slack(x) for x in ("block", "0", "32", 7)] == ["block", 0, 32, 7]
    for bad in ("blocks", "-1", "1.5", -1, True, ""):
        with pytest.raises(ValueError, match="slack"):
            parse_slack(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        vt.Budget(ratio=0.5, slack="blocks")  # type: ignore[arg-type]


def _prefill_peak(b: vt.Budget, chunks: list[int]) -> int:
    """The most tokens held during a prefill in ``chunks`` (:func:`_simulate` with one-token blocks, counted
    when each chunk's tokens are reserved)."""
    return max(_simulate(b, chunks, 0, 1)[0][::2], default=0)


@sizes(fast=60, full=300)
def test_chunked_prefill_peak_bounds_every_chunking(examples: int) -> None:
    """No chunking of the prompt into chunks of at most ``chunk`` tokens holds more than the peak, and the
    chunking whose last chunk is full reaches it (slack 0 or "block": chunks are trimmed down to the budget)."""
    settings(max_examples=examples, deadline=None)(given(
        size=st.one_of(dyadic_ratios(), st.integers(1, 300)), min_tokens=MIN_TOKENS,
        when=st.sampled_from(["both", "prefill", "chunks"]), slack=st.one_of(st.integers(0, 40), st.just("block")),
        n=st.integers(0, 700), chunk=st.integers(1, 256), data=st.data())(_peak_bounds_every_chunking))()


def _peak_bounds_every_chunking(size: tuple[int, int] | int, min_tokens: int, when: str, slack: int | str, n: int,
                                chunk: int, data: st.DataObject) -> None:
    kw = {"tokens": size} if isinstance(size, int) else {"ratio": size[0] / 2**size[1]}
    b = vt.Budget(**kw, min_tokens=min_tokens, when=when, slack=slack)  # type: ignore[arg-type]
    peak = b.chunked_prefill_peak(n, chunk)
    cuts: list[int] = []
    left = n
    while left > 0:  # any chunking: sizes in [1, chunk]
        cuts.append(data.draw(st.integers(1, min(chunk, left))))
        left -= cuts[-1]
    assert _prefill_peak(b, cuts) <= peak <= n
    k = -(-n // chunk)
    last_full = [n - (k - 1) * chunk] + [chunk] * (k - 1) if n else []
    if slack in (0, "block") or when != "chunks":
        assert _prefill_peak(b, last_full) == peak


def test_chunked_prefill_peak_hand_picked() -> None:
    b = vt.Budget.evict(0.8, when="chunks")
    assert b.chunked_prefill_peak(400, 64) == 67 + 64  # floor(0.2 x 336 + 0.5) + one chunk
    assert b.override(slack=8).chunked_prefill_peak(400, 64) == 67 + 8 + 64
    assert b.override(slack="block").chunked_prefill_peak(400, 64) == 67 + 64  # chunks trimmed as slack 0
    assert b.override(tokens=100).chunked_prefill_peak(400, 64) == 100 + 64
    assert b.chunked_prefill_peak(100, 64) == 7 + 64 and b.chunked_prefill_peak(50, 64) == 50  # one chunk: all of it
    assert b.chunked_prefill_peak(0, 64) == 0
    assert b.override(when="both").chunked_prefill_peak(400, 64) == 400  # nothing evicted before the prompt ends
    for n, c in ((-1, 64), (400, 0)):
        with pytest.raises(ValueError, match="chunked_prefill_peak"):
            b.chunked_prefill_peak(n, c)
