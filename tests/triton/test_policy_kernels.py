"""Fused score+select kernels (TRITON_INTERPRET=1) are bit-identical to the torch backend."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vtoken_sdk as vt
from tests.cases import ALLOCATION_CASES, CASES, build, case_id
from vtoken_sdk import codegen_triton
from vtoken_sdk.batch import StatsBatch
from vtoken_sdk.testing import BatchSpec, batch_specs, build_batch
from vtoken_sdk.torch_backend import TorchPolicy
from vtoken_sdk.triton_backend import MIN_BLOCK, TritonPolicy, load_generated

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_COMPILED: dict[tuple[int, int, int], TritonPolicy] = {}


def _tp(policy: vt.Policy, max_single: int = 2048, tile: int = 1024) -> TritonPolicy:
    key = (id(policy), max_single, tile)
    if key not in _COMPILED:
        _COMPILED[key] = TritonPolicy(policy, max_single=max_single, tile=tile)
    return _COMPILED[key]


def _same_scores(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, every NaN equal to every NaN (selection maps all NaN to -inf)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32)))


def _check(policy: vt.Policy, batch: StatsBatch, tp: TritonPolicy | None = None, scores: bool = True) -> None:
    tp = tp or _tp(policy)
    ref = TorchPolicy(policy)
    want = ref.keep_mask(batch)
    got = tp.keep_mask(batch)
    assert got.dtype == torch.bool and got.shape == want.shape
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{policy.name}: masks differ at {bad} ({batch.meta.get('spec')})")
    if scores and tp.generated.exact:
        assert _same_scores(tp.scores(batch), ref.scores(batch)), policy.name


FIXED = [
    BatchSpec(2, 2, 3, 100, (90, 37), (5, 60), "ties", 1, False, ((0, 10, 14),), None),
    BatchSpec(2, 2, 2, 77, (77, 0), (0, 3), "special", 2, True, (), (30, 5)),
    BatchSpec(1, 1, 3, 64, (64,), (100,), "continuous", 3, False, (), (100,)),  # budget >= length
    BatchSpec(3, 1, 2, 40, (40, 12, 1), (0, 0, 7), "special", 4, False, ((1, 0, 8),), (0, 2, 0)),  # pins > budget
    BatchSpec(2, 2, 2, 50, (50, 33), (0, 9), "continuous", 5, False, (), None, num_layers=3),  # a deeper model
]


@pytest.mark.parametrize("case", CASES + ALLOCATION_CASES, ids=case_id)
def test_shipped_policy_cases_bit_identical(case) -> None:
    policy = build(case)
    for spec in FIXED:
        _check(policy, build_batch(spec))


@SETTINGS
@given(case=st.sampled_from(CASES + ALLOCATION_CASES),
       spec=batch_specs(max_b=3, max_layers=2, max_heads=3, max_n=40))
def test_hypothesis_statistics_bit_identical(case, spec) -> None:
    _check(build(case), build_batch(spec), scores=False)


# --------------------------------------------------------------------------- generated IR

_EXACT_UNARY = ("neg", "abs", "sqrt")
_EXACT_BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
_STATS = ("attn_sum", "attn_last", "key_norm", "position", "age", "random")


def _expr(draw, depth: int):  # type: ignore[no-untyped-def]
    """A random exactly-rounded score expression (as a function of s)."""
    kind = draw(st.sampled_from(["stat", "const"] if depth <= 0 else
                                ["stat", "unary", "binary", "where", "pool", "head_mean", "binary"]))
    if kind == "stat":
        name = draw(st.sampled_from(_STATS))
        return lambda s: getattr(s, name)
    if kind == "const":
        c = draw(st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, 1e-3, float("inf")]))
        return lambda s: c
    a = _expr(draw, depth - 1)
    if kind == "unary":
        op = draw(st.sampled_from(_EXACT_UNARY))
        f = {"neg": lambda x: -x, "abs": vt.abs, "sqrt": vt.sqrt}[op]
        return lambda s: f(a(s) if not isinstance(a(s), float) else vt.maximum(s.attn_sum, a(s)))
    if kind == "pool":
        size = draw(st.sampled_from([1, 3, 5]))
        pool = draw(st.sampled_from([vt.max_pool, vt.avg_pool]))
        return lambda s: pool(a(s) if not isinstance(a(s), float) else s.attn_sum, size)
    if kind == "head_mean":
        return lambda s: vt.head_mean(a(s) if not isinstance(a(s), float) else s.key_norm)
    b = _expr(draw, depth - 1)
    if kind == "where":
        cmp = draw(st.sampled_from(["lt", "ge", "eq", "isnan"]))
        if cmp == "isnan":
            return lambda s: vt.where(vt.isnan(s.attn_sum) | (s.key_norm > 0.5), a(s), b(s))
        return lambda s: vt.where({"lt": lambda x, y: x < y, "ge": lambda x, y: x >= y,
                                   "eq": lambda x, y: x == y}[cmp](s.attn_last, 0.5), a(s), b(s))
    op = draw(st.sampled_from(_EXACT_BINARY))
    f2 = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
          "div": lambda x, y: x / y, "maximum": vt.maximum, "minimum": vt.minimum}[op]

    def g(s):  # type: ignore[no-untyped-def]
        x, y = a(s), b(s)
        if isinstance(x, float) and isinstance(y, float):
            x = s.attn_sum
        return f2(x, y)
    return g


@st.composite
def generated_policies(draw):  # type: ignore[no-untyped-def]
    body = _expr(draw, draw(st.integers(1, 3)))
    gran = draw(st.sampled_from(["head", "request"]))
    protect = draw(st.sampled_from([[], [vt.sinks(2)], [vt.recent(3), vt.span(5, 9)],
                                    [vt.protect_if(lambda s: s.key_norm > 1.0)]]))
    budget = draw(st.sampled_from([vt.Budget(ratio=0.5), vt.Budget(tokens=7)]))

    def score(s):  # type: ignore[no-untyped-def]
        out = body(s)
        return out if not isinstance(out, float) else s.attn_sum + out

    return vt.policy(budget=budget, protect=protect, granularity=gran)(score)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy=generated_policies(), spec=batch_specs(max_b=2, max_layers=2, max_heads=2, max_n=24))
def test_generated_ir_bit_identical(policy, spec) -> None:
    _check(policy, build_batch(spec), tp=TritonPolicy(policy))


# --------------------------------------------------------------------------- multi-pass rows


@SETTINGS
@given(case=st.sampled_from(CASES), spec=batch_specs(max_b=2, max_layers=1, max_heads=2, max_n=700,
                                                    modes=("ties", "special")))
def test_multipass_rows_forced_small_tile(case, spec) -> None:
    policy = build(case)
    _check(policy, build_batch(spec), tp=_tp(policy, max_single=0, tile=256), scores=False)


@pytest.mark.parametrize("case", ALLOCATION_CASES, ids=case_id)
def test_per_row_counts_on_the_tiled_path(case) -> None:
    """Unequal allocation: the tiled select (PER_ROW counts) equals the reference too."""
    policy = build(case)
    for spec in FIXED:
        _check(policy, build_batch(spec), tp=_tp(policy, max_single=0, tile=MIN_BLOCK), scores=False)


def test_multipass_equals_single_pass_on_heavy_ties() -> None:
    policy = build(("h2o", {}))
    spec = BatchSpec(2, 1, 2, 900, (900, 611), (0, 40), "ties", 7, True, ((0, 100, 108),), (333, 17))
    batch = build_batch(spec)
    single = _tp(policy).keep_mask(batch)
    tiled = _tp(policy, max_single=0, tile=256).keep_mask(batch)
    assert torch.equal(single, tiled)
    assert torch.equal(single, TorchPolicy(policy).keep_mask(batch))


def test_row_of_128k_tokens() -> None:
    n = 131072 + 37
    policy = build(("h2o", {})).configure(budget=vt.Budget(tokens=4099))
    g = torch.Generator().manual_seed(0)
    stats = {"attn_sum": (torch.randint(0, 50, (1, 1, 1, n), generator=g) / 7.0).float()}
    lengths = torch.tensor([n - 5])
    seq = torch.tensor([n + 100])
    batch = StatsBatch(stats=stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n, seq),
                       seq_lens=seq)
    got = TritonPolicy(policy, tile=4096).keep_mask(batch)
    want = TorchPolicy(policy).keep_mask(batch)
    assert int(got.sum()) == 4099 and torch.equal(got, want)


# --------------------------------------------------------------------------- edges, approx ops, cache


def test_length_zero_and_all_nan_rows() -> None:
    policy = build(("h2o", {})).configure(protect=[])
    n = 16
    stats = {"attn_sum": torch.full((2, 1, 2, n), float("nan"))}
    lengths = torch.tensor([0, 10])
    batch = StatsBatch(stats=stats, lengths=lengths, positions=StatsBatch.contiguous_positions(lengths, n),
                       seq_lens=lengths, budget=torch.tensor([3, 4]))
    got = _tp(policy).keep_mask(batch)
    assert not got[0].any()
    assert got[1].sum(-1).eq(4).all() and got[1, ..., 6:10].all()  # NaN = -inf: ties -> most recent
    assert torch.equal(got, TorchPolicy(policy).keep_mask(batch))


def test_transcendental_ops_match_on_continuous_data() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.4), protect=[vt.sinks(1)], granularity="head")
    def fancy(s):  # type: ignore[no-untyped-def]
        return vt.log(vt.abs(s.attn_sum) + 1.0) + vt.sigmoid(s.key_norm) * vt.tanh(s.attn_last) - vt.exp(
            -s.age / 50.0) + s.attn_window ** 2.0

    tp = TritonPolicy(fancy)
    assert not tp.generated.exact
    batch = build_batch(BatchSpec(2, 2, 2, 64, (64, 50), (0, 9), "continuous", 11, False, (), None))
    ref = TorchPolicy(fancy)
    torch.testing.assert_close(tp.scores(batch), ref.scores(batch), rtol=1e-5, atol=1e-5)
    assert torch.equal(tp.keep_mask(batch), ref.keep_mask(batch))


def test_generated_source_is_inspectable_and_cached() -> None:
    policy = build(("snapkv", {}))
    src = codegen_triton.source(policy)
    assert "def select_kernel" in src and "tl.histogram" in src and "avg_pool" in src
    gen = codegen_triton.generate(policy)
    assert load_generated(gen) is load_generated(gen)
    other = codegen_triton.generate(policy.configure(protect=[vt.recent(8)]))
    assert other.key != gen.key


def test_backend_selection(monkeypatch) -> None:
    policy = build(("knorm", {})).configure(name="knorm_backend_test")
    monkeypatch.setenv("VTOKEN_POLICY_BACKEND", "triton")
    assert isinstance(policy.compile(), TritonPolicy)
    monkeypatch.setenv("VTOKEN_POLICY_BACKEND", "torch")
    assert isinstance(policy.compile(), TorchPolicy)


def test_compile_cache_is_the_backends_and_drops_a_dropped_policy(monkeypatch) -> None:
    """Compiling twice generates the kernels once; the policy object is not written to; a configured copy
    with the same name gets its own kernels; the cache does not keep a policy nobody holds alive."""
    calls: list[str] = []
    real = codegen_triton.generate
    monkeypatch.setattr(codegen_triton, "generate", lambda p: calls.append(p.name) or real(p))
    policy = build(("knorm", {})).configure(name="knorm_cache_test")
    before = {k: copy.copy(v) for k, v in vars(policy).items()}  # copies: a cache dict filled later differs
    a, b = vt.compile_policy(policy, "triton"), vt.compile_policy(policy, "triton")
    assert a.generated is b.generated and calls == ["knorm_cache_test"]
    assert vars(policy) == before  # no compiled state on the policy
    other = policy.configure(protect=[vt.recent(8)])  # same name, other IR
    c = vt.compile_policy(other, "triton")
    assert c.generated.key != a.generated.key and calls == ["knorm_cache_test"] * 2
    assert torch.equal(c.keep_mask(_cache_batch()), TorchPolicy(other).keep_mask(_cache_batch()))
    dropped = weakref.ref(other)
    del other, c
    gc.collect()
    assert dropped() is None, "the compile cache keeps a dropped policy alive"
    vt.compile_policy(policy, "triton")
    assert calls == ["knorm_cache_test"] * 2  # the held policy's entry survived


def _cache_batch() -> StatsBatch:
    return build_batch(BatchSpec(2, 2, 2, 24, (24, 17), (0, 5), "continuous", 3, False, (), None),
                       ("key_norm",))
