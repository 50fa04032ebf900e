"""Copy engine: moves K/V, stats and positions exactly as the plan says (simultaneous-assignment
semantics), for both layouts and granularities, with overlapping ordered-mode moves split into tiny
chunks, synchronously and on the worker thread; the single-pass CPU kernel is byte-identical to the
torch gather/scatter path (hypothesis: modes, layouts, granularities, dtypes, streaming stores)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.copy_engine import CopyPlan, _cpu_kernels
from vtoken_runtime.planner import plan_compact, plan_ordered

L, H, D, BS, NB = 2, 3, 4, 4, 10


@pytest.mark.parametrize("cpu_path", ["torch", "auto"])
@pytest.mark.parametrize("async_copy", [False, True])
@pytest.mark.parametrize("chunk", [8, 1 << 20])
@pytest.mark.parametrize("planner", ["ordered", "compact"])
@pytest.mark.parametrize("layout", ["generic", "vllm_cpu"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_moves_match_reference(granularity: str, layout: str, planner: str, chunk: int, async_copy: bool,
                               cpu_path: str) -> None:
    c = VTokenCache(L, H, D, BS, NB, granularity=granularity, kv_layout=layout, stat_names=("a", "b"),
                    async_copy=async_copy, copy_chunk_bytes=chunk)
    c.engine.cpu_path = cpu_path  # torch gather/scatter, or the single-pass kernel (chunking unused)
    g = torch.Generator().manual_seed(0)
    for layer in range(L):
        c.kv_caches[layer].copy_(torch.randn(c.kv_caches[layer].shape, generator=g))
    for t in c.store.stats.values():
        t.copy_(torch.randn(t.shape, generator=g))
    c.store.positions.copy_(torch.randint(0, 1000, c.store.positions.shape, generator=g))
    rng = np.random.default_rng(1)
    R, U, n = c.num_rows, 4 * BS, 7
    live = np.zeros((R, U), bool)
    for r in range(R):
        live[r, rng.choice(U, n, replace=False)] = True
    rows, src, dst = (plan_ordered if planner == "ordered" else plan_compact)(live, n)
    blocks = np.array([7, 2, 9, 4])  # a request's (scattered) blocks
    ps, pd = blocks[src // BS] * BS + src % BS, blocks[dst // BS] * BS + dst % BS
    old_k = [c.key_cache(layer).clone() for layer in range(L)]
    old_v = [c.value_cache(layer).clone() for layer in range(L)]
    old_s = {k: t.clone() for k, t in c.store.stats.items()}
    old_p = c.store.positions.clone()
    c.engine.submit(CopyPlan(rows, ps, pd))
    c.fence()
    for layer in range(L):
        ek, ev = old_k[layer].clone(), old_v[layer].clone()
        es = {k: t[layer].clone() for k, t in old_s.items()}
        for r, s, d in zip(rows.tolist(), ps.tolist(), pd.tolist(), strict=True):
            if R > 1 and r // H != layer:
                continue
            hs = [r % H] if R > 1 else list(range(H))
            for h in hs:
                ek[d // BS, d % BS, h] = old_k[layer][s // BS, s % BS, h]
                ev[d // BS, d % BS, h] = old_v[layer][s // BS, s % BS, h]
                for k in es:
                    es[k][h, d] = old_s[k][layer, h, s]
        assert torch.equal(c.key_cache(layer), ek) and torch.equal(c.value_cache(layer), ev)
        for k in es:
            assert torch.equal(c.store.stats[k][layer], es[k])
    ep = old_p.clone()
    for r, s, d in zip(rows.tolist(), ps.tolist(), pd.tolist(), strict=True):
        ep[r, d] = old_p[r, s]
    assert torch.equal(c.store.positions, ep)
    assert c.engine.bytes_moved == rows.size * c.engine.row_bytes()


# ---------------------------------------------------------------- single-pass CPU kernel vs torch path
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _random_bytes(t: torch.Tensor, g: torch.Generator) -> None:
    """Fill ``t`` with random bytes (NaN/inf payloads included: the comparison is bytewise)."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _make_cache(path: str, seed: int, **kw: object) -> VTokenCache:
    c = VTokenCache(**kw)  # type: ignore[arg-type]
    c.engine.cpu_path = path
    g = torch.Generator().manual_seed(seed)
    for t in c.kv_caches:
        for x in t if isinstance(t, tuple) else (t,):
            _random_bytes(x, g)
    for t in c.store.stats.values():
        _random_bytes(t, g)
    c.store.positions.copy_(torch.randint(-1, 1 << 40, c.store.positions.shape, generator=g))
    return c


def _state_bytes(c: VTokenCache) -> list[torch.Tensor]:
    out = []
    for t in c.kv_caches:
        out += [x.view(torch.uint8).clone() for x in (t if isinstance(t, tuple) else (t,))]
    out += [t.view(torch.uint8).clone() for t in c.store.stats.values()]
    return out + [c.store.positions.clone()]


def _random_plan(c: VTokenCache, planner: str, rng: np.random.Generator, n_req: int, blocks_per_req: int,
                 keep: float) -> CopyPlan:
    """Plans of ``n_req`` requests on disjoint, scattered block lists (what ``reclaim`` submits)."""
    bs, R = c.block_size, c.num_rows
    U = blocks_per_req * bs
    perm = rng.permutation(c.num_blocks)
    rows, srcs, dsts = [], [], []
    for i in range(n_req):
        blocks = perm[i * blocks_per_req:(i + 1) * blocks_per_req]
        n = max(1, int(U * keep))
        live = np.zeros((R, U), bool)
        for r in range(R):
            live[r, rng.choice(U, n, replace=False)] = True
        r_, s_, d_ = (plan_ordered if planner == "ordered" else plan_compact)(live, n)
        rows.append(r_)
        srcs.append(blocks[s_ // bs] * bs + s_ % bs)
        dsts.append(blocks[d_ // bs] * bs + d_ % bs)
    return CopyPlan(np.concatenate(rows), np.concatenate(srcs).astype(np.int64), np.concatenate(dsts).astype(np.int64))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["generic", "vllm_cpu"]),
    granularity=st.sampled_from(["request", "head"]),
    planner=st.sampled_from(["compact", "ordered"]),
    dtype=st.sampled_from(sorted(DTYPES)),
    L=st.integers(1, 3),
    H=st.integers(1, 4),
    D=st.sampled_from([1, 3, 4, 8, 32, 64]),
    bs=st.sampled_from([1, 2, 4, 16]),
    n_req=st.integers(1, 3),
    keep=st.floats(0.05, 0.95),
    streaming=st.booleans(),
    async_copy=st.booleans(),
    pair=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cpu_kernel_matches_torch_path(layout: str, granularity: str, planner: str, dtype: str, L: int, H: int,
                                        D: int, bs: int, n_req: int, keep: float, streaming: bool,
                                        async_copy: bool, pair: bool, seed: int) -> None:
    """The single-pass numba kernel (cached or streaming stores) is byte-identical to the torch
    gather/scatter path for compact (disjoint) and ordered (overlapping, ascending) plans."""
    rng = np.random.default_rng(seed)
    blocks_per_req = int(rng.integers(1, 4))
    NB = n_req * blocks_per_req + int(rng.integers(0, 3))
    kw: dict[str, object] = dict(num_layers=L, num_kv_heads=H, head_size=D, block_size=bs, num_blocks=NB,
                                 granularity=granularity, kv_layout=layout, dtype=DTYPES[dtype],
                                 stat_names=("a", "b"), async_copy=async_copy, copy_chunk_bytes=64)
    if layout == "generic" and pair:  # a (K, V) pair of separate tensors instead of one [2, ...]
        kw["kv_caches"] = [(torch.empty(NB, bs, H, D, dtype=DTYPES[dtype]),
                            torch.empty(NB, bs, H, D, dtype=DTYPES[dtype])) for _ in range(L)]
    ref, new = _make_cache("torch", seed, **kw), _make_cache("numba", seed, **kw)
    new.engine.nt_min_bytes = 0 if streaming else 1 << 62
    assert all(torch.equal(a, b) for a, b in zip(_state_bytes(ref), _state_bytes(new), strict=True))
    plan = _random_plan(ref, planner, rng, n_req, blocks_per_req, keep)
    before = _state_bytes(ref)
    for c in (ref, new):
        c.engine.submit(plan)
        c.fence()
    after_ref, after_new = _state_bytes(ref), _state_bytes(new)
    for a, b in zip(after_ref, after_new, strict=True):
        assert torch.equal(a, b)
    if plan.num_moves:
        assert any(not torch.equal(a, b) for a, b in zip(before, after_ref, strict=True))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["generic", "vllm_cpu"])
def test_cpu_kernel_is_default_and_streaming_path_runs(layout: str, dtype: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Large jobs take the streaming-store kernel by default and still match the torch path."""
    k = _cpu_kernels()
    calls = []
    nt = k.move_rows_nt
    monkeypatch.setattr(k, "move_rows_nt", lambda *a: (calls.append(1), nt(*a)))
    kw: dict[str, object] = dict(num_layers=2, num_kv_heads=2, head_size=64, block_size=16, num_blocks=64,
                                 granularity="request", kv_layout=layout, dtype=DTYPES[dtype], stat_names=("a",))
    ref, new = _make_cache("torch", 3, **kw), _make_cache("auto", 3, **kw)
    assert new.engine.cpu_path == "auto" and _cpu_kernels() is not None
    view, src, dst = new.engine.build_jobs(CopyPlan(np.zeros(1, np.int64), np.ones(1, np.int64),
                                                    np.zeros(1, np.int64)))[0]
    assert new.engine._use_kernel(view, src, dst)
    new.engine.nt_min_bytes = 1  # every K/V job streams
    plan = _random_plan(ref, "ordered", np.random.default_rng(0), 4, 8, 0.4)
    for c in (ref, new):
        c.engine.submit(plan)
        c.fence()
    for a, b in zip(_state_bytes(ref), _state_bytes(new), strict=True):
        assert torch.equal(a, b)
    assert len(calls) == sum(len(v) for v in new.engine._views)  # every K/V job streamed (stats: too narrow)


@pytest.mark.parametrize("streaming", [False, True])
def test_cpu_kernel_rejects_out_of_range_plan_untouched(streaming: bool) -> None:
    c = _make_cache("numba", 5, num_layers=1, num_kv_heads=2, head_size=32, block_size=4, num_blocks=4,
                    stat_names=("a",))
    c.engine.nt_min_bytes = 0 if streaming else 1 << 62
    before = _state_bytes(c)
    bad = CopyPlan(np.zeros(2, np.int64), np.array([1, 16], np.int64), np.array([0, 2], np.int64))
    c.engine.submit(bad)
    with pytest.raises(IndexError):
        c.fence()
    for a, b in zip(before, _state_bytes(c), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("warmed", [False, True])
@pytest.mark.parametrize("cpu_path", ["auto", "numba"])
def test_a_kernel_that_cannot_load_falls_back_to_torch(cpu_path: str, warmed: bool, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A kernel failing before it moves anything (here: numba's cache written for the file under another module
    name, as seen on this machine) does not fail the copy: with ``cpu_path="auto"`` the job and every later one
    take the torch path (one warning, the same bytes); a required ``"numba"`` path raises and moves nothing.
    Whether the worker's warm-up (a new process) already failed on it or not."""
    import vtoken_runtime.copy_engine as ce

    k = _cpu_kernels()
    assert k is not None
    monkeypatch.setattr(ce, "_KERNELS", k)
    monkeypatch.setattr(ce, "_KERNEL_ERROR", None)
    monkeypatch.setattr(ce, "_WARMED", warmed)

    def broken(*a: object) -> None:
        raise ModuleNotFoundError("No module named 'runtime'")

    monkeypatch.setattr(k, "run", broken)
    kw: dict[str, object] = dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_blocks=16,
                                 granularity="head", kv_layout="vllm_cpu", stat_names=("a",), async_copy=True)
    ref, new = _make_cache("torch", 7, **kw), _make_cache(cpu_path, 7, **kw)
    plan = _random_plan(ref, "ordered", np.random.default_rng(1), 3, 4, 0.5)
    assert plan.num_moves
    before = _state_bytes(new)
    ref.engine.submit(plan)
    ref.fence()
    new.engine.submit(plan)
    if cpu_path == "numba":
        with pytest.raises(RuntimeError, match="copy kernel failed"):
            new.fence()
        assert all(torch.equal(a, b) for a, b in zip(before, _state_bytes(new), strict=True))
        return
    with caplog.at_level("WARNING", logger="vtoken.copy"):
        new.fence()
    assert all(torch.equal(a, b) for a, b in zip(_state_bytes(ref), _state_bytes(new), strict=True))
    assert new.engine.jobs_run.get("numba", 0) == 0 and new.engine.jobs_run["torch"] > 0
    assert ce._KERNELS is None and "runtime" in (ce._KERNEL_ERROR or "")
    assert sum("torch path" in r.getMessage() for r in caplog.records) == 1
