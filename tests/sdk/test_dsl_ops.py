"""Vector statistics and the reductions of the DSL: shapes, errors, and the torch backend's semantics
against naive per-row numpy computations (bit for bit where the order is specified)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vtoken_sdk as vt
from vtoken_sdk import ir
from vtoken_sdk.batch import StatsBatch
from vtoken_sdk.errors import PolicyDefinitionError
from vtoken_sdk.stats import CATALOG, VECTOR_STATS
from vtoken_sdk.testing import BatchSpec, batch_specs, build_batch
from vtoken_sdk.torch_backend import TorchPolicy, exp_det, lane_reduce, sqrt_rn

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
F32 = np.float32


def _scores(fn, batch: StatsBatch, granularity: str = "head") -> np.ndarray:  # type: ignore[no-untyped-def]
    pol = vt.policy(budget=vt.Budget(ratio=0.5), granularity=granularity, name="t")(fn)
    return TorchPolicy(pol).scores(batch).numpy()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    a, b = np.asarray(a, dtype=F32), np.asarray(b, dtype=F32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool((na == nb).all() and (a[~na].view(np.int32) == b[~nb].view(np.int32)).all())


def _rows(batch: StatsBatch):  # type: ignore[no-untyped-def]
    b, l_, h, _ = batch.shape
    for i in range(b):
        for j in range(l_):
            for k in range(h):
                yield i, j, k, int(batch.lengths[i])


def _vec(batch: StatsBatch, name: str) -> np.ndarray:
    b, l_, h, _ = batch.shape
    t = batch.vectors[name]
    return t.expand(b, l_, h, *t.shape[3:]).numpy()


def _ordered_dot(a, b):  # type: ignore[no-untyped-def]
    acc = F32(a[0]) * F32(b[0])
    for x, y in zip(a[1:], b[1:], strict=True):
        acc = F32(acc + F32(x) * F32(y))
    return acc


def _lanes(vals, op: str, lanes: int = ir.TOKEN_LANES):  # type: ignore[no-untyped-def]
    """The documented token-reduction order, one value at a time."""
    ident = F32(-0.0) if op == "sum" else F32(-np.inf)
    acc = [ident] * lanes
    for i, v in enumerate(vals):
        acc[i % lanes] = F32(acc[i % lanes] + F32(v)) if op == "sum" else np.maximum(acc[i % lanes], F32(v))
    while len(acc) > 1:
        acc = [F32(acc[2 * i] + acc[2 * i + 1]) if op == "sum" else np.maximum(acc[2 * i], acc[2 * i + 1])
               for i in range(len(acc) // 2)]
    return acc[0]


specs = batch_specs(max_b=3, max_layers=2, max_heads=3, max_n=24)
continuous = batch_specs(max_b=2, max_layers=2, max_heads=2, max_n=24, modes=("continuous",))


# --------------------------------------------------------------------------- shapes


SHAPES = [
    (lambda s: s.attn_sum, ("N",), "token-scalar [B,H,N]"),
    (lambda s: s.key, ("N", "D"), "token-vector [B,H,N,D]"),
    (lambda s: s.query_mean, ("D",), "head-vector [B,H,D]"),
    (lambda s: s.query_mean_future, ("G", "D"), "head-vector per query head [B,H,G,D]"),
    (lambda s: s.query_cov_future, ("G", "D", "E"), "head-matrix per query head [B,H,G,D,D]"),
    (lambda s: s.layer + s.head * s.head_dim, (), "head-scalar [B,H,1]"),
    (lambda s: vt.dot(s.key, s.query_mean), ("N",), None),
    (lambda s: vt.norm(s.query_mean), (), None),
    (lambda s: vt.cosine(s.key, s.value), ("N",), None),
    (lambda s: s.key * s.attn_sum + s.query_mean / 2.0, ("N", "D"), None),
    (lambda s: vt.token_mean(s.key / vt.norm(s.key)), ("D",), None),
    (lambda s: vt.token_max(s.attn_sum), (), None),
    (lambda s: vt.token_std(s.attn_sum) + vt.token_sum(s.age), (), None),
    (lambda s: vt.softmax(s.attn_sum), ("N",), None),
    (lambda s: vt.chunk_mean(s.attn_sum, 4), ("N",), None),
    (lambda s: vt.chunk_max(s.key, 4), ("N", "D"), None),
    (lambda s: vt.matvec(s.query_cov_future, s.key), ("G", "N", "D"), None),
    (lambda s: vt.matvec(s.query_cov_future * 0.5, s.query_mean), ("G", "D"), None),
    (lambda s: vt.quad(s.query_cov_future, s.key), ("G", "N"), None),
    (lambda s: vt.softmax(vt.dot(s.key, s.query_mean_future)), ("G", "N"), None),
    (lambda s: vt.group_mean(vt.softmax(vt.dot(s.key, s.query_mean_future))), ("N",), None),
    (lambda s: vt.head_mean(vt.token_mean(s.key)), ("D",), None),
    (lambda s: vt.where(s.attn_sum > 0, s.key, s.query_mean), ("N", "D"), None),
]


@pytest.mark.parametrize("i", range(len(SHAPES)))
def test_shape_inference(i: int) -> None:
    fn, axes, name = SHAPES[i]
    e = fn(ir.TracingStats())
    assert e.node.axes == axes
    if name is not None:
        assert e.shape == name


def test_catalog_entries_of_vector_statistics() -> None:
    assert set(VECTOR_STATS) == {"key", "value", "query_mean", "query_mean_future", "query_cov_future"}
    assert CATALOG["key"].source == CATALOG["value"].source == "kvcache"
    assert {CATALOG[n].source for n in ("query_mean", "query_mean_future", "query_cov_future")} == {"query"}
    assert CATALOG["query_mean"].config == ("obs_window",)
    assert CATALOG["query_cov_future"].config == ("obs_window", "future_window")
    assert CATALOG["key"].shape == "[B, H, N, D]" and CATALOG["query_cov_future"].shape == "[B, H, G, D, D]"
    assert CATALOG["layer"].kind == "derived" and CATALOG["layer"].shape == "[B, H, 1]"
    assert vt.StatsConfig().future_window == 512


def test_reads_split_into_stored_vector_and_derived() -> None:
    @vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
    def p(s: vt.TokenStats):
        return vt.dot(s.key, s.query_mean) * s.attn_sum + s.layer

    assert p.reads == {"key", "query_mean", "attn_sum", "layer"}
    assert p.stored_reads == {"attn_sum"} and p.vector_reads == {"key", "query_mean"}


# --------------------------------------------------------------------------- errors (file:line and the fix)

HERE = Path(__file__).resolve()
SRC = HERE.read_text().splitlines()


def _line(marker: str) -> int:
    return next(i + 1 for i, t in enumerate(SRC) if t.rstrip().endswith(f"# {marker}"))


def bad_dot(s):  # type: ignore[no-untyped-def]
    return vt.dot(s.attn_sum, s.key)  # E-dot


def bad_norm(s):  # type: ignore[no-untyped-def]
    return vt.norm(s.attn_sum)  # E-norm


def bad_cosine(s):  # type: ignore[no-untyped-def]
    return vt.cosine(s.key, 1.0)  # E-cosine


def bad_token_mean(s):  # type: ignore[no-untyped-def]
    return vt.token_mean(s.query_mean)  # E-token-mean


def bad_softmax(s):  # type: ignore[no-untyped-def]
    return vt.softmax(s.layer)  # E-softmax


def bad_chunk_size(s):  # type: ignore[no-untyped-def]
    return vt.chunk_mean(s.attn_sum, 0)  # E-chunk-size


def bad_chunk_float(s):  # type: ignore[no-untyped-def]
    return vt.chunk_max(s.attn_sum, 2.0)  # E-chunk-float


def bad_matvec_m(s):  # type: ignore[no-untyped-def]
    return vt.matvec(s.key, s.key)  # E-matvec-m


def bad_matvec_x(s):  # type: ignore[no-untyped-def]
    return vt.matvec(s.query_cov_future, s.attn_sum)  # E-matvec-x


def bad_token_matrix(s):  # type: ignore[no-untyped-def]
    return vt.quad(s.query_cov_future * s.attn_sum, s.key)  # E-token-matrix


def bad_matrix_vector(s):  # type: ignore[no-untyped-def]
    return vt.quad(s.query_cov_future + s.query_mean, s.key)  # E-matrix-vector


def bad_group_mean(s):  # type: ignore[no-untyped-def]
    return vt.group_mean(vt.dot(s.key, s.query_mean))  # E-group-mean


def bad_returns_vector(s):  # type: ignore[no-untyped-def]
    return s.key * 2.0  # E-return-vector


def bad_returns_grouped(s):  # type: ignore[no-untyped-def]
    return vt.dot(s.key, s.query_mean_future)  # E-return-grouped


def bad_sum_method(s):  # type: ignore[no-untyped-def]
    return s.key.sum()  # E-sum


def bad_matmul(s):  # type: ignore[no-untyped-def]
    return s.key @ s.query_mean  # E-matmul


ERRORS = [
    (bad_dot, "E-dot", "vt.dot expects two vectors of the same D, got token-scalar [B,H,N] as its first argument",
     "vt.dot / vt.norm / vt.cosine"),
    (bad_norm, "E-norm", "vt.norm expects a vector [.., D], got token-scalar [B,H,N]", "s.key"),
    (bad_cosine, "E-cosine", "vt.cosine expects two vectors of the same D, got head-scalar [B,H,1] as its second",
     "s.key"),
    (bad_token_mean, "E-token-mean", "vt.token_mean reduces over the tokens of a row and expects a per-token "
     "value [B,H,N..], got head-vector [B,H,D]", "already one value per head"),
    (bad_softmax, "E-softmax", "vt.softmax reduces over the tokens", "already one value per head"),
    (bad_chunk_size, "E-chunk-size", "got chunk size 0, expected an int in [1, 128]", "ChunkKV"),
    (bad_chunk_float, "E-chunk-float", "got chunk size 2.0, expected a Python int", "vt.chunk_max(s.attn_window, 8)"),
    (bad_matvec_m, "E-matvec-m", "vt.matvec expects a head-matrix [B,H,D,D] as its first argument, got "
     "token-vector [B,H,N,D]", "s.query_cov_future"),
    (bad_matvec_x, "E-matvec-x", "vt.matvec expects a vector as its second argument, got token-scalar", "vt.dot"),
    (bad_token_matrix, "E-token-matrix", "would be a per-token matrix [B,H,N,D,D], which is not supported",
     "vt.matvec(m, x) or vt.quad(m, x)"),
    (bad_matrix_vector, "E-matrix-vector", "'+' between a head-matrix [B,H,D,D] and a head-vector [B,H,D] is "
     "ambiguous", "vt.matvec(m, x)"),
    (bad_group_mean, "E-group-mean", "vt.group_mean averages over the G query heads of a KV head and expects a "
     "per-query-head value, got token-scalar [B,H,N]", "s.query_mean_future"),
    (bad_returns_vector, "E-return-vector", "returned a token-vector [B,H,N,D], expected one number per token",
     "vt.dot / vt.norm / vt.cosine"),
    (bad_returns_grouped, "E-return-grouped", "returned a token-scalar per query head [B,H,G,N]", "vt.group_mean"),
    (bad_sum_method, "E-sum", "unsupported tensor method .sum()", "vt.token_sum(x) over tokens"),
    (bad_matmul, "E-matmul", "'@' on a statistic", "vt.matvec"),
]


@pytest.mark.parametrize("fn, marker, message, hint", ERRORS, ids=[e[1] for e in ERRORS])
def test_shape_mistakes_name_file_line_and_fix(fn, marker: str, message: str, hint: str) -> None:
    with pytest.raises(PolicyDefinitionError) as ei:
        vt.policy(budget=vt.Budget(ratio=0.5))(fn)
    e = ei.value
    assert e.file == str(HERE) and e.line == _line(marker), (e.file, e.line)
    assert message in e.message, e.message
    assert e.hint is not None and hint in e.hint, e.hint
    assert f"{HERE}:{_line(marker)}: " in str(e)


def test_a_vector_predicate_is_refused() -> None:
    with pytest.raises(PolicyDefinitionError, match="returned a token-vector"):
        vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.protect_if(lambda s: s.key > 0.0)])(lambda s: s.attn_sum)


# --------------------------------------------------------------------------- torch backend semantics


@SETTINGS
@given(specs)
def test_dot_norm_cosine_add_over_d_in_order(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    got = _scores(lambda s: vt.dot(s.key, s.query_mean), batch)
    nrm = _scores(lambda s: vt.norm(s.value), batch)
    cos = _scores(lambda s: vt.cosine(s.key, s.value), batch)
    k, v, q = _vec(batch, "key"), _vec(batch, "value"), _vec(batch, "query_mean")
    for i, j, h, n in _rows(batch):
        for t in range(n):
            assert _same(got[i, j, h, t], _ordered_dot(k[i, j, h, t], q[i, j, h]))
            vv = _ordered_dot(v[i, j, h, t], v[i, j, h, t])
            assert _same(nrm[i, j, h, t], np.sqrt(vv))
            kk = np.sqrt(_ordered_dot(k[i, j, h, t], k[i, j, h, t]))
            want = F32(_ordered_dot(k[i, j, h, t], v[i, j, h, t]) / np.maximum(F32(kk * np.sqrt(vv)), F32(1e-8)))
            assert _same(cos[i, j, h, t], want)


@SETTINGS
@given(specs)
def test_matvec_quad_and_group_mean_in_order(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    got = _scores(lambda s: vt.group_mean(vt.quad(s.query_cov_future, s.key)), batch)
    k, c = _vec(batch, "key"), _vec(batch, "query_cov_future")
    g_ = spec.groups
    for i, j, h, n in _rows(batch):
        for t in range(n):
            x = k[i, j, h, t]
            per_g = []
            for g in range(g_):
                y = [_ordered_dot(c[i, j, h, g, d], x) for d in range(len(x))]
                per_g.append(_ordered_dot(x, y))
            acc = per_g[0]
            for q in per_g[1:]:
                acc = F32(acc + q)
            assert _same(got[i, j, h, t], F32(acc / F32(g_)))


@SETTINGS
@given(specs)
def test_token_reductions_count_live_tokens_only(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    x = batch.stats["attn_sum"].numpy()
    sums = _scores(lambda s: vt.token_sum(s.attn_sum), batch)
    means = _scores(lambda s: vt.token_mean(s.attn_sum), batch)
    maxes = _scores(lambda s: vt.token_max(s.attn_sum), batch)
    for i, j, h, n in _rows(batch):
        live = x[i, j, h, :n]
        assert _same(sums[i, j, h, 0], _lanes(live, "sum"))
        assert _same(maxes[i, j, h, 0], _lanes(live, "max"))
        assert _same(means[i, j, h, 0], F32(_lanes(live, "sum") / F32(n)) if n else F32(np.nan))
        assert (sums[i, j, h] == sums[i, j, h, 0]).all() or np.isnan(sums[i, j, h, 0])  # broadcast over N
        if spec.mode == "continuous" and n:
            assert math.isclose(float(sums[i, j, h, 0]), float(live.astype(np.float64).sum()), rel_tol=1e-5,
                                abs_tol=1e-5)
            assert maxes[i, j, h, 0] == live.max()


@SETTINGS
@given(specs, st.sampled_from(["nan", "huge"]))
def test_padding_never_contributes(spec: BatchSpec, junk: str) -> None:
    batch = build_batch(spec)
    n = spec.n
    pad = (torch.arange(n) >= batch.lengths[:, None])[:, None, None, :]
    fill = float("nan") if junk == "nan" else 1e30
    dirty_stats = {k: torch.where(pad, fill, v) for k, v in batch.stats.items()}
    dirty_vec = {k: (torch.where(pad[..., None], fill, v) if CATALOG[k].axes[0] == "N" else v)
                 for k, v in batch.vectors.items()}
    dirty = StatsBatch(stats=dirty_stats, lengths=batch.lengths, positions=batch.positions,
                       seq_lens=batch.seq_lens, pinned=batch.pinned, budget=batch.budget, vectors=dirty_vec)

    def fn(s):  # type: ignore[no-untyped-def]
        return (vt.softmax(s.attn_sum) + vt.token_std(s.attn_last) + vt.token_max(s.key_norm)
                + vt.dot(s.key, vt.token_mean(s.key)) + vt.chunk_mean(s.attn_sum, 3) + vt.chunk_max(s.attn_last, 2))

    a, b = _scores(fn, batch), _scores(fn, dirty)
    live = ~pad.expand(a.shape).numpy()
    assert _same(a[live], b[live])


@SETTINGS
@given(continuous)
def test_token_std_is_the_population_std_and_softmax_sums_to_one(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    x = batch.stats["attn_sum"].numpy().astype(np.float64)
    std = _scores(lambda s: vt.token_std(s.attn_sum), batch)
    sm = _scores(lambda s: vt.softmax(s.attn_sum * 3.0), batch)
    for i, j, h, n in _rows(batch):
        if n == 0:
            continue
        assert math.isclose(float(std[i, j, h, 0]), float(np.std(x[i, j, h, :n], ddof=0)), rel_tol=1e-4,
                            abs_tol=1e-6)
        e = np.exp(3.0 * x[i, j, h, :n] - (3.0 * x[i, j, h, :n]).max())
        np.testing.assert_allclose(sm[i, j, h, :n], e / e.sum(), rtol=1e-5, atol=1e-7)
        assert math.isclose(float(sm[i, j, h, :n].astype(np.float64).sum()), 1.0, rel_tol=1e-5)


@SETTINGS
@given(specs, st.integers(1, 9))
def test_chunks_are_aligned_to_the_first_live_token_and_add_in_order(spec: BatchSpec, size: int) -> None:
    batch = build_batch(spec)
    x = batch.stats["attn_sum"].numpy()
    mean = _scores(lambda s: vt.chunk_mean(s.attn_sum, size), batch)
    mx = _scores(lambda s: vt.chunk_max(s.attn_sum, size), batch)
    for i, j, h, n in _rows(batch):
        for t in range(n):
            c0 = t // size * size
            vals = x[i, j, h, c0:min(c0 + size, n)]
            acc, m = F32(-0.0), F32(-np.inf)
            for v in vals:
                acc, m = F32(acc + v), np.maximum(m, v)
            assert _same(mean[i, j, h, t], F32(acc / F32(len(vals))))
            assert _same(mx[i, j, h, t], m)


def test_token_reduction_lanes_over_several_tiles() -> None:
    """N > TOKEN_LANES: lane j adds tokens j, j + 256, ... in order, then a pairwise tree (bit for bit)."""
    n = 3 * ir.TOKEN_LANES + 77
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 1, 1, n, generator=g) * torch.logspace(-3, 3, n)).float()
    lengths = torch.tensor([n - 5])
    batch = StatsBatch(stats={"attn_sum": x}, lengths=lengths, seq_lens=lengths,
                       positions=StatsBatch.contiguous_positions(lengths, n))
    got = _scores(lambda s: vt.token_sum(s.attn_sum), batch)[0, 0, 0, 0]
    assert _same(got, _lanes(x[0, 0, 0, : n - 5].numpy(), "sum"))
    assert _same(lane_reduce("sum", x[0, 0, 0, : n - 5][None])[0, 0].numpy(), got)


@SETTINGS
@given(specs)
def test_layer_head_and_head_dim(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    batch = StatsBatch(**{**{f: getattr(batch, f) for f in batch.__dataclass_fields__}, "layer_offset": 5,
                          "num_layers": None if spec.num_layers is None else spec.num_layers + 5})
    got = _scores(lambda s: s.layer * 100.0 + s.head + s.head_dim / 1000.0 + s.num_layers * 10000.0, batch)
    b, l_, h, n = batch.shape
    model_layers = 5 + (l_ if spec.num_layers is None else spec.num_layers)  # None: the batch ends the model
    want = (np.arange(l_)[:, None] + 5) * 100.0 + np.arange(h)[None, :] + spec.head_dim / 1000.0
    want = want.astype(F32) + F32(model_layers * 10000.0)
    np.testing.assert_array_equal(got, np.broadcast_to(want.astype(F32)[None, :, :, None], (b, l_, h, n)))


@given(specs)
def test_head_and_random_mean_the_layers_head_under_a_head_offset(spec: BatchSpec) -> None:
    """Tensor parallelism hands a rank the layer's heads ``head_offset ..``: ``s.head`` and ``s.random`` of that
    part equal the whole batch's at those heads (one meaning per name on every rank)."""
    batch = build_batch(spec)
    b, l_, h, n = batch.shape
    fields = {f: getattr(batch, f) for f in StatsBatch.__dataclass_fields__}

    def part(lo: int, hi: int) -> StatsBatch:
        def cut(t):  # type: ignore[no-untyped-def]
            return t if t is None or t.dim() < 3 or t.shape[2] == 1 else t[:, :, lo:hi]
        return StatsBatch(**{**fields, "stats": {k: cut(v) for k, v in batch.stats.items()},
                             "positions": cut(batch.positions), "pinned": cut(batch.pinned),
                             "vectors": {k: cut(v) for k, v in batch.vectors.items()}, "head_offset": lo})

    fn = lambda s: s.head * 10.0 + s.random  # noqa: E731
    whole = _scores(fn, batch)
    for lo in range(h):
        got = _scores(fn, part(lo, h))
        assert _same(got, whole[:, :, lo:]), lo


def test_num_layers_smaller_than_the_batch_is_refused() -> None:
    spec = BatchSpec(1, 3, 1, 4, (4,), (0,), "ties", 0, False, (), None)
    batch = StatsBatch(**{**{f: getattr(build_batch(spec), f) for f in StatsBatch.__dataclass_fields__},
                          "layer_offset": 2, "num_layers": 4})
    with pytest.raises(ValueError, match="StatsBatch.num_layers=4, but the batch holds layers 2..4"):
        _scores(lambda s: s.attn_sum * s.num_layers, batch)


def test_exp_is_deterministic_and_within_one_ulp() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200000, generator=g) * 30, torch.linspace(-110, 90, 20001)])
    y = exp_det(x).double()
    t = torch.exp(x.double())
    ok = (t < 3.4e38) & (t > 1.2e-38)  # normal float32 results
    ulp = torch.from_numpy(np.spacing(t.float().numpy()).astype(np.float64))
    assert ((y - t).abs()[ok] / ulp[ok]).max() <= 1.0
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 89.0, -104.0])
    out = exp_det(special)
    assert out[:4].tolist() == [1.0, 1.0, float("inf"), 0.0] and math.isnan(out[4])
    assert out[5] == float("inf") and out[6] == 0.0


def test_sqrt_is_correctly_rounded() -> None:
    x = torch.rand(100000, generator=torch.Generator().manual_seed(1)) * 100
    assert torch.equal(sqrt_rn(x), torch.from_numpy(np.sqrt(x.numpy())))


# --------------------------------------------------------------------------- researchers' policies


@SETTINGS
@given(continuous)
def test_keydiff_is_kvpress_keydiff(spec: BatchSpec) -> None:
    from tests.sdk.dsl_policies import keydiff

    batch = build_batch(spec)
    got = TorchPolicy(keydiff).scores(batch)
    k = batch.vectors["key"].double()
    for i in range(spec.b):
        n = int(batch.lengths[i])
        if n == 0:
            continue
        keys = k[i, :, :, :n]
        anchor = torch.nn.functional.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
        want = -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)
        torch.testing.assert_close(got[i, ..., :n].double(), want, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(continuous)
def test_expected_attention_is_kvpress_formula(spec: BatchSpec) -> None:
    """kvpress ExpectedAttentionPress.score with the statistics already rotated (query_*_future)."""
    from tests.sdk.dsl_policies import expected_attention

    batch = build_batch(spec)
    got = TorchPolicy(expected_attention).scores(batch)
    k, v = batch.vectors["key"].double(), batch.vectors["value"].double()
    mu, cov = batch.vectors["query_mean_future"].double(), batch.vectors["query_cov_future"].double()
    d = spec.head_dim
    for i in range(spec.b):
        n = int(batch.lengths[i])
        if n == 0:
            continue
        keys = k[i, :, :, :n]  # [L, H, n, D]
        logits = torch.einsum("lhnd,lhgd->lhgn", keys, mu[i]) / math.sqrt(d)
        logits = logits + torch.einsum("lhnd,lhgde,lhne->lhgn", keys, cov[i], keys) / d / 2
        scores = torch.softmax(logits, dim=-1).mean(dim=2) * v[i, :, :, :n].norm(dim=-1)
        torch.testing.assert_close(got[i, ..., :n].double(), scores, rtol=1e-4, atol=1e-6)


def test_observed_attention_is_kvpress_normalisation() -> None:
    """kvpress ObservedAttentionPress divides the attention sum by the number of queries that saw the key
    (n_tokens - j at prefill = seq_len - position = age + 1)."""
    from tests.sdk.dsl_policies import observed_attention

    n = 12
    attn = torch.rand(1, 2, 3, n, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([n])
    batch = StatsBatch(stats={"attn_sum": attn}, lengths=lengths, seq_lens=lengths,
                       positions=StatsBatch.contiguous_positions(lengths, n))
    got = TorchPolicy(observed_attention).scores(batch)
    assert torch.equal(got, attn / torch.arange(n, 0, -1).float())


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch_specs(max_b=2, max_layers=1, max_heads=2, max_n=48, modes=("continuous", "ties"),
                   allow_budget_override=False), st.sampled_from([2, 4, 8]), st.integers(1, 6))
def test_chunk_selection_keeps_whole_chunks_but_one(spec: BatchSpec, size: int, chunks: int) -> None:
    """Without pins, top-k over chunk scores keeps whole chunks and at most one partial chunk (its most
    recent tokens: ties go to the larger index); exactly whole chunks when k is a multiple of the size."""
    batch = build_batch(spec)
    pol = vt.policy(budget=vt.Budget(tokens=chunks * size), granularity="head")(
        lambda s: vt.chunk_mean(s.attn_sum, size))
    pol2 = pol.configure(budget=vt.Budget(tokens=chunks * size + 1))
    for p, whole in ((pol, True), (pol2, False)):
        mask = p.keep_mask(batch)
        for i, j, h, n in _rows(batch):
            m = mask[i, j, h, :n].tolist()
            partial = []
            for c0 in range(0, n, size):
                part = m[c0:c0 + size]
                if 0 < sum(part) < len(part):
                    partial.append(c0)
                    assert part == sorted(part), "a partial chunk keeps its most recent tokens"
            assert len(partial) <= 1
            if whole and n % size == 0:
                assert not partial


# --------------------------------------------------------------------------- batches


def test_batch_dims_and_missing_vectors() -> None:
    spec = BatchSpec(2, 1, 2, 8, (8, 5), (0, 1), "continuous", 0, False, (), None, 5, 3)
    batch = build_batch(spec)
    assert batch.dims() == (5, 3)
    assert batch.vectors["key"].shape == (2, 1, 2, 8, 5) and batch.vectors["query_cov_future"].shape == (2, 1, 2, 3, 5, 5)
    cov = batch.vectors["query_cov_future"]
    assert torch.allclose(cov, cov.transpose(-1, -2)) and (torch.linalg.eigvalsh(cov.double()) > -1e-6).all()
    sub = batch.select_requests([1])
    assert sub.vectors["key"].shape == (1, 1, 2, 8, 5) and torch.equal(sub.vectors["key"][0], batch.vectors["key"][1])
    bad = StatsBatch(stats={}, lengths=batch.lengths, positions=batch.positions, seq_lens=batch.seq_lens,
                     vectors={"key": batch.vectors["key"], "query_mean": torch.zeros(2, 1, 2, 4)})
    with pytest.raises(ValueError, match="disagree on D"):
        bad.dims()
    from tests.sdk.dsl_policies import query_dot

    missing = StatsBatch(stats={}, lengths=batch.lengths, positions=batch.positions, seq_lens=batch.seq_lens,
                         vectors={"key": batch.vectors["key"]})
    with pytest.raises(ValueError, match=r"gather policy.vector_reads = \['key', 'query_mean', 'value'\]"):
        query_dot.keep_mask(missing)


def test_mask_policy_receives_vectors_in_batch_layout() -> None:
    seen = {}

    @vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("key", "query_mean"))
    def eager(s: vt.TokenStats, ctx: vt.MaskContext):
        seen["key"], seen["q"] = s.key.shape, s.query_mean.shape
        score = (s.key * s.query_mean[..., None, :]).sum(-1)
        top = score.argsort(-1, descending=True).argsort(-1)
        return top < ctx.keep_count[:, None, None, None]

    spec = BatchSpec(1, 2, 2, 6, (6,), (0,), "continuous", 0, False, (), None, 3, 1)
    mask = eager.keep_mask(build_batch(spec))
    assert seen == {"key": (1, 2, 2, 6, 3), "q": (1, 2, 2, 3)} and mask.sum(-1).eq(3).all()
    assert eager.vector_reads == {"key", "query_mean"}


def test_doc_of_every_op_states_its_order() -> None:
    for fn in (vt.dot, vt.matvec, vt.group_mean, vt.token_std, vt.softmax, vt.chunk_mean, vt.quad, vt.cosine):
        assert inspect.getdoc(fn), fn
    assert "population" in inspect.getdoc(vt.token_std).lower()
