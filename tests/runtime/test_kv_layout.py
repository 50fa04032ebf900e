"""KV layout adapter over vLLM 0.32's real KV cache views (``allocate_kv_cache``), every KVCacheLayout.

Views are made exactly as vLLM's worker makes them: a ``FullAttentionSpec``, vLLM's own
``get_kv_cache_config_from_groups`` (KVCacheTensor strides/offsets for the layout) and
``allocate_kv_cache`` (one int8 buffer, one ``[NB, H, bs, 2D]`` view per layer). Checked:
  * the start-up guard (block-outermost layouts, kernel block splitting, per-token-head dtypes),
    cross-checked against vLLM's own enum properties and dtype names;
  * the adapter's rows alias exactly the cells ``view[b, h, n]``, its K/V views are FlashAttention's
    split, and a row write changes exactly that cell of that layer (layers share one buffer);
  * moves are byte-exact over the whole raw buffer (random bytes: NaN payloads, fp8), for plans from
    the real planner in both modes and both granularities, torch and numba CPU paths, sync and async;
  * the torch reference attention over the adapter's K/V views after eviction + reclaim equals dense
    attention over the kept tokens (driving a real VTokenCache with a LayoutCopyEngine).
"""

from __future__ import annotations

import types
import typing
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.copy_engine import CopyPlan
from vtoken_runtime.kv_layout import (
    LAYOUT_ALIASES,
    LAYOUT_ORDERS,
    SUPPORTED_LAYOUTS,
    KVLayoutAdapter,
    LayoutCopyEngine,
    check_supported,
    is_block_outermost,
)
from vtoken_runtime.planner import plan_compact, plan_ordered

ALL_LAYOUTS = tuple(LAYOUT_ORDERS)
# name -> (spec dtype, kv_cache_dtype): vLLM's "fp8" cache is a uint8 spec (viewed as fp8 by the kernels),
# "fp8_inc" a float8_e4m3fn spec.
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "auto"),
    "bfloat16": (torch.bfloat16, "bfloat16"),
    "fp8": (torch.uint8, "fp8"),
    "fp8_inc": (torch.float8_e4m3fn, "fp8_inc"),
}


# ================================================================================= vLLM allocation
def _vllm() -> types.SimpleNamespace:
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return types.SimpleNamespace(config_from_groups=get_kv_cache_config_from_groups, Spec=FullAttentionSpec,
                                 Group=KVCacheGroupSpec, QuantMode=KVQuantMode, Layout=KVCacheLayout,
                                 allocate=allocate_kv_cache)


def _allocate(layout: str, dtype: str, *, L: int, NB: int, H: int, bs: int, D: int,
              kernel_block_size: int | None = None, pad_bytes: int = 0, seed: int | None = 0
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(raw uint8 [size] over vLLM's whole KV buffer, per-layer views [NB, H, bs, 2D]) as vLLM's worker
    allocates them for ``layout``; the buffer is filled with random bytes unless ``seed`` is None."""
    v = _vllm()
    tdt, cache_dtype = DTYPES[dtype]
    quant = v.QuantMode.FP8_PER_TENSOR if cache_dtype.startswith("fp8") else v.QuantMode.NONE
    page = H * bs * 2 * D * tdt.itemsize
    spec = v.Spec(block_size=bs, num_kv_heads=H, head_size=D, dtype=tdt, kv_quant_mode=quant,
                  page_size_padded=page + pad_bytes if pad_bytes else None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    lay = v.Layout[layout]
    # The slice of VllmConfig the engine core's config builder reads (num_gpu_blocks_override = NB).
    cfg = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay, num_gpu_blocks_override=NB,
                                           prefix_cache_retention_interval=None),
        attention_config=types.SimpleNamespace(hisparse_config=None))
    kv_config = v.config_from_groups(cfg, [v.Group(names, spec)], available_memory=1 << 30)
    assert kv_config.num_blocks == NB
    kbs = None if kernel_block_size is None else [kernel_block_size]
    by_name = v.allocate(kv_config, torch.device("cpu"), lay, kernel_block_sizes=kbs)
    views = [by_name[n] for n in names]
    raw = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage())
    assert raw.numel() == kv_config.kv_cache_tensors[0].size
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return raw, views


def _cell_bytes(views: list[torch.Tensor], layer: np.ndarray, b: np.ndarray, h: np.ndarray, n: np.ndarray
                ) -> np.ndarray:
    """``[m, C*el]`` byte offsets into the raw buffer of cells (layer, b, h, n), from the views' own
    strides and offsets (independent of the adapter)."""
    el = views[0].element_size()
    sb, sh, sn, sc = views[0].stride()
    assert sc == 1 and all(x.stride() == views[0].stride() for x in views)
    off = np.array([x.storage_offset() for x in views], dtype=np.int64)[layer]
    start = (off + b * sb + h * sh + n * sn) * el
    return start[:, None] + np.arange(views[0].shape[-1] * el, dtype=np.int64)[None, :]


def _expected_after(old: np.ndarray, views: list[torch.Tensor], plan: CopyPlan, per_head: bool, bs: int
                    ) -> np.ndarray:
    """The raw buffer after ``plan``: moves applied one by one, in plan order, on a dense numpy copy
    (and checked equal to simultaneous assignment, the plan's semantics)."""
    L, H = len(views), views[0].shape[1]
    exp = old.copy()
    sim = old.copy()
    lh = np.stack(np.meshgrid(np.arange(L), np.arange(H), indexing="ij"), -1).reshape(-1, 2)
    for r, s, d in zip(plan.rows.tolist(), plan.src.tolist(), plan.dst.tolist(), strict=True):
        lay, hd = (np.array([r // H]), np.array([r % H])) if per_head else (lh[:, 0], lh[:, 1])
        sb_ = _cell_bytes(views, lay, np.full(lay.shape, s // bs), hd, np.full(lay.shape, s % bs))
        db_ = _cell_bytes(views, lay, np.full(lay.shape, d // bs), hd, np.full(lay.shape, d % bs))
        exp[db_] = exp[sb_]
        sim[db_] = old[sb_]
    assert np.array_equal(exp, sim), "plan is not order-safe (planner property violated)"
    return exp


def _random_plan(R: int, NB: int, bs: int, mode: str, rng: np.random.Generator, n_req: int, blocks_per_req: int,
                 keep: float) -> CopyPlan:
    """What ``reclaim`` submits: real planner plans of ``n_req`` requests on disjoint scattered blocks."""
    U = blocks_per_req * bs
    perm = rng.permutation(NB)
    rows, srcs, dsts = [], [], []
    for i in range(n_req):
        blocks = perm[i * blocks_per_req:(i + 1) * blocks_per_req]
        n = max(1, int(U * keep))
        live = np.zeros((R, U), bool)
        for r in range(R):
            live[r, rng.choice(U, n, replace=False)] = True
        r_, s_, d_ = (plan_ordered if mode == "ordered" else plan_compact)(live, n)
        rows.append(r_)
        srcs.append(blocks[s_ // bs] * bs + s_ % bs)
        dsts.append(blocks[d_ // bs] * bs + d_ % bs)
    return CopyPlan(np.concatenate(rows).astype(np.int64), np.concatenate(srcs).astype(np.int64),
                    np.concatenate(dsts).astype(np.int64))


# ================================================================================= guard
def test_guard_layouts_match_vllm() -> None:
    v = _vllm()
    from vllm.config import cache as vcache

    assert {m.name: m.value for m in v.Layout} == LAYOUT_ORDERS
    assert vcache._LAYOUT_COMPAT_ALIASES == LAYOUT_ALIASES
    for m in v.Layout:
        assert is_block_outermost(m) == m.is_block_outermost == is_block_outermost(m.name)
        if m.is_block_outermost:
            for what in (m, m.name):
                with pytest.raises(ValueError, match=rf"{m.name} is block-outermost.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
                    check_supported(what, manager_block_size=16, kernel_block_size=16)
        else:
            assert m.name in SUPPORTED_LAYOUTS
            assert check_supported(m, manager_block_size=16, kernel_block_size=16, kv_cache_dtype="fp8") == m.name
    assert check_supported("NHD", manager_block_size=16) == "LBNHC"
    assert check_supported("hnd", manager_block_size=16) == "LBHNC"
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        check_supported("XYZ", manager_block_size=16)


def test_guard_kv_cache_dtypes_match_vllm() -> None:
    """Every vLLM cache dtype name: per-token-head ones (vLLM's own predicate) are refused, fp8 per-tensor
    and plain types pass, packed/block-scaled formats are refused."""
    _vllm()
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import get_kv_quant_mode, kv_cache_uses_per_token_head_scales

    names = typing.get_args(CacheDType)
    assert "fp8_per_token_head" in names
    for name in names:
        plain = get_kv_quant_mode(name).name in ("NONE", "FP8_PER_TENSOR") and name != "fp8_ds_mla"
        if plain:
            assert check_supported("LBNHC", manager_block_size=16, kv_cache_dtype=name) == "LBNHC"
        else:
            pattern = "per-token-head" if kv_cache_uses_per_token_head_scales(name) else "not a plain K/V"
            with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}': {pattern}.*--kv-cache-dtype fp8"):
                check_supported("LBNHC", manager_block_size=16, kv_cache_dtype=name)


def test_guard_block_sizes_and_all_problems_at_once() -> None:
    assert check_supported("LBHNC", manager_block_size=32, kernel_block_size=None) == "LBHNC"
    with pytest.raises(ValueError, match=r"kernel block size is 16 .* block size is 64 .*--block-size 16"):
        check_supported("LBNHC", manager_block_size=64, kernel_block_size=16)
    with pytest.raises(ValueError) as e:
        check_supported("BHLNC", manager_block_size=32, kernel_block_size=16, kv_cache_dtype="int8_per_token_head",
                        head_size=128, head_size_v=64)
    msg = str(e.value)
    assert msg.count("\n  - ") == 4 and "VLLM_KV_CACHE_LAYOUT" in msg and "--block-size 16" in msg
    assert "per-token-head" in msg and "head_size_v=64" in msg


# ================================================================================= addressing
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_rows_alias_cells_and_kv_views_are_flash_split(layout: str, dtype: str) -> None:
    L, NB, H, bs, D = 3, 5, 3, 4, 8
    raw, views = _allocate(layout, dtype, L=L, NB=NB, H=H, bs=bs, D=D, seed=zlib.crc32(f"{layout}{dtype}".encode()))
    ads = [KVLayoutAdapter.from_view(v, D) for v in views]
    assert all(a == ads[0] for a in ads[1:])  # offset-free: one adapter per KVCacheTensor
    a = ads[0]
    assert a.name == layout and a.width == 2 * D and a.row_dtype.itemsize == views[0].element_size()
    slots = np.arange(NB * bs, dtype=np.int64)
    for li, v in enumerate(views):
        rv = a.row_view(v)
        assert rv.is_contiguous() and rv.shape == (a.num_rows, 2 * D)
        assert rv.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        # all heads of every slot, slot-major: row i*H + h = cell (s_i // bs, h, s_i % bs)
        got = rv[torch.as_tensor(a.row_index(slots, None))].view(torch.uint8)
        ref = v.permute(0, 2, 1, 3).reshape(NB * bs * H, 2 * D).view(torch.uint8)  # [(b, n, h), C]
        assert torch.equal(got, ref)
        heads = np.random.default_rng(li).integers(0, H, slots.size)
        got = rv[torch.as_tensor(a.row_index(slots, heads))].view(torch.uint8)
        assert torch.equal(got, v[slots // bs, heads, slots % bs].view(torch.uint8))
        # K/V views: exactly FlashAttention's split (same storage, offsets and strides)
        k, vv = a.kv_views(v)
        fk, fv = v.transpose(1, 2).split(D, dim=-1)
        for x, y in ((k, fk), (vv, fv)):
            assert (x.shape, x.stride(), x.data_ptr(), x.dtype) == (y.shape, y.stride(), y.data_ptr(), y.dtype)
            assert x.shape == (NB, bs, H, D)
    # a row write changes exactly that cell of that layer (the layers share one buffer)
    rng = np.random.default_rng(7)
    for li, v in enumerate(views):
        b, h, n = int(rng.integers(NB)), int(rng.integers(H)), int(rng.integers(bs))
        before = raw.numpy().copy()
        row = int(a.row_index(np.array([b * bs + n]), np.array([h]))[0])
        rv = a.row_view(v)
        new = (~rv[row].view(torch.uint8)).view(rv.dtype)  # every byte changes
        rv[row] = new
        changed = np.nonzero(raw.numpy() != before)[0]
        cell = _cell_bytes(views, np.array([li]), np.array([b]), np.array([h]), np.array([n]))[0]
        assert np.array_equal(changed, cell)  # that cell's bytes, nothing else in the buffer
        assert torch.equal(v[b, h, n].view(torch.uint8), new.view(torch.uint8))
        B, Hh, N = np.meshgrid(np.arange(NB), np.arange(H), np.arange(bs), indexing="ij")
        for lj in range(L):  # the other layers' cells (interleaved with this layer's in BL*/BH*)
            if lj != li:
                cells = _cell_bytes(views, np.full(B.size, lj), B.ravel(), Hh.ravel(), N.ravel())
                assert np.array_equal(raw.numpy()[cells], before[cells])
    with pytest.raises(ValueError, match="slot ids"):
        a.row_index(np.array([NB * bs]), None)
    with pytest.raises(ValueError, match="head ids"):
        a.row_index(np.array([0]), np.array([H]))


def test_adapter_rejects_unaddressable_views() -> None:
    D = 4
    with pytest.raises(ValueError, match="2\\*head_size"):
        KVLayoutAdapter.from_view(torch.zeros(2, 2, 2, 2 * D), D + 1)
    with pytest.raises(ValueError, match="unit stride"):
        KVLayoutAdapter.from_view(torch.zeros(2, 2, 2, 2 * D * 2)[..., ::2], D)
    with pytest.raises(ValueError, match="not a multiple"):
        KVLayoutAdapter.from_view(torch.zeros(2 * 2 * 2 * 2 * D + 4).as_strided((2, 2, 2, 2 * D),
                                                                                (2 * 2 * 2 * D + 2, 2 * 2 * D, 2 * D, 1)), D)
    with pytest.raises(ValueError, match="overlap"):
        KVLayoutAdapter.from_view(torch.zeros(64).as_strided((2, 2, 2, 2 * D), (2 * D, 2 * D, 2 * D, 1)), D)
    a = KVLayoutAdapter.from_view(torch.zeros(2, 2, 2, 2 * D), D)
    with pytest.raises(ValueError, match="does not match"):
        a.row_view(torch.zeros(2, 2, 2, 2 * D, dtype=torch.float16))
    with pytest.raises(ValueError, match="strides"):
        a.row_view(torch.zeros(2, 2, 2, 2 * D).transpose(1, 2))


def test_kernel_block_splitting_and_padding() -> None:
    """vLLM splits a 8-token block into kernel blocks of 4 (view [2*NB, H, 4, C]): the adapter addresses
    it (slot s -> kernel block s // 4), but the engine and the guard refuse it. Padded pages: a pad of
    whole rows is addressable (pad rows never touched), any other pad is refused."""
    L, NB, H, D = 2, 6, 2, 4
    raw, views = _allocate("LBNHC", "float32", L=L, NB=NB, H=H, bs=8, D=D, kernel_block_size=4)
    assert tuple(views[0].shape) == (2 * NB, H, 4, 2 * D)
    a = KVLayoutAdapter.from_view(views[0], D)
    s = np.arange(NB * 8)
    got = a.row_view(views[1])[torch.as_tensor(a.row_index(s, None))].view(torch.uint8)
    assert torch.equal(got, views[1].permute(0, 2, 1, 3).reshape(-1, 2 * D).view(torch.uint8))
    with pytest.raises(ValueError, match="kernel block size is 4 .*--block-size 4"):
        check_supported("LBNHC", manager_block_size=8, kernel_block_size=4)
    with pytest.raises(ValueError, match="splits blocks"):
        VTokenCache(L, H, D, 8, NB, kv_caches=views, kv_views=[a.kv_views(v) for v in views],
                    copy_engine=LayoutCopyEngine, async_copy=False)
    for layout in ("LBHNC", "LBNHC"):  # page padding needs L and B outermost (vLLM asserts it: not LHBNC)
        raw, views = _allocate(layout, "bfloat16", L=L, NB=NB, H=H, bs=4, D=D, pad_bytes=2 * D * 2)
        a = KVLayoutAdapter.from_view(views[0], D)
        assert a.row_strides[0] == H * 4 + 1
        c = VTokenCache(L, H, D, 4, NB, granularity="head", kv_caches=views, kv_views=[a.kv_views(v) for v in views],
                        copy_engine=LayoutCopyEngine, async_copy=False)
        plan = _random_plan(L * H, NB, 4, "ordered", np.random.default_rng(3), 2, 3, 0.4)
        old = raw.numpy().copy()
        c.engine.submit(plan)
        c.fence()
        assert np.array_equal(raw.numpy(), _expected_after(old, views, plan, True, 4))
        _, views = _allocate(layout, "bfloat16", L=L, NB=NB, H=H, bs=4, D=D, pad_bytes=6)
        with pytest.raises(ValueError, match="padded pages"):
            KVLayoutAdapter.from_view(views[0], D)


# ================================================================================= moves
def _check_moves(layout: str, dtype: str, granularity: str, mode: str, L: int, H: int, D: int, bs: int,
                 n_req: int, blocks_per_req: int, keep: float, cpu_path: str, chunk: int, async_copy: bool,
                 seed: int) -> None:
    NB = n_req * blocks_per_req + 2
    raw, views = _allocate(layout, dtype, L=L, NB=NB, H=H, bs=bs, D=D, seed=seed)
    a = KVLayoutAdapter.from_view(views[0], D)
    per_head = granularity == "head"
    c = VTokenCache(L, H, D, bs, NB, granularity=granularity, mode=mode, dtype=views[0].dtype, kv_caches=views,
                    kv_views=[a.kv_views(v) for v in views], copy_engine=LayoutCopyEngine, async_copy=async_copy,
                    copy_chunk_bytes=chunk, copy_path=cpu_path)
    assert isinstance(c.engine, LayoutCopyEngine)
    # the inferred name is exact unless a size-1 axis makes layouts physically identical
    assert c.engine.physical_layout == layout if H > 1 and bs > 1 else c.engine.physical_layout in ALL_LAYOUTS
    g = torch.Generator().manual_seed(seed)
    c.store.positions.copy_(torch.randint(-1, 1 << 40, c.store.positions.shape, generator=g))
    plan = _random_plan(c.num_rows, NB, bs, mode, np.random.default_rng(seed), n_req, blocks_per_req, keep)
    old = raw.numpy().copy()
    old_pos = c.store.positions.clone()
    c.engine.submit(plan)
    c.fence()
    exp = _expected_after(old, views, plan, per_head, bs)
    assert np.array_equal(raw.numpy(), exp)  # moved cells = their sources' old bytes, nothing else changed
    ep = old_pos.clone()
    ep[plan.rows, plan.dst] = old_pos[plan.rows, plan.src]
    assert torch.equal(c.store.positions, ep)
    el = views[0].element_size()
    assert c.engine.row_bytes() == 2 * D * el * (1 if per_head else H * L)
    assert c.engine.bytes_moved == plan.num_moves * c.engine.row_bytes()


@pytest.mark.parametrize("mode", ["compact", "ordered"])
@pytest.mark.parametrize("granularity", ["request", "head"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_moves_byte_exact_sweep(layout: str, dtype: str, granularity: str, mode: str) -> None:
    seed = zlib.crc32(f"{layout}{dtype}{granularity}{mode}".encode())
    for cpu_path, chunk in (("torch", 64), ("auto", 2 << 20)):  # tiny chunks: ordered overlap across chunks
        _check_moves(layout, dtype, granularity, mode, L=3, H=3, D=4, bs=4, n_req=2, blocks_per_req=4, keep=0.4,
                     cpu_path=cpu_path, chunk=chunk, async_copy=cpu_path == "auto", seed=seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(SUPPORTED_LAYOUTS), dtype=st.sampled_from(sorted(DTYPES)),
       granularity=st.sampled_from(["request", "head"]), mode=st.sampled_from(["compact", "ordered"]),
       L=st.integers(1, 3), H=st.integers(1, 4), D=st.sampled_from([1, 2, 4, 16]), bs=st.sampled_from([1, 2, 4, 16]),
       n_req=st.integers(1, 3), blocks_per_req=st.integers(1, 4), keep=st.floats(0.05, 0.95),
       cpu_path=st.sampled_from(["torch", "auto"]), chunk=st.sampled_from([1, 96, 2 << 20]),
       async_copy=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_moves_byte_exact_property(layout: str, dtype: str, granularity: str, mode: str, L: int, H: int, D: int,
                                   bs: int, n_req: int, blocks_per_req: int, keep: float, cpu_path: str, chunk: int,
                                   async_copy: bool, seed: int) -> None:
    _check_moves(layout, dtype, granularity, mode, L, H, D, bs, n_req, blocks_per_req, keep, cpu_path, chunk,
                 async_copy, seed)


def test_engine_rejects_mixed_or_mismatched_views() -> None:
    D = 4
    _, a_views = _allocate("LBNHC", "float32", L=2, NB=4, H=2, bs=4, D=D)
    _, b_views = _allocate("LBHNC", "float32", L=2, NB=4, H=2, bs=4, D=D)
    mixed = [a_views[0], b_views[1]]
    kw: dict[str, Any] = {"kv_views": [KVLayoutAdapter.from_view(v, D).kv_views(v) for v in mixed],
                          "copy_engine": LayoutCopyEngine, "async_copy": False}
    with pytest.raises(ValueError, match="share one KV layout"):
        VTokenCache(2, 2, D, 4, 4, kv_caches=mixed, **kw)
    with pytest.raises(ValueError, match="2 heads of size 4"):
        VTokenCache(2, 4, D, 4, 4, kv_caches=a_views, **{**kw, "kv_views": None})


# ================================================================================= attention
class _CheckedEngine(LayoutCopyEngine):
    """Checks every submitted plan byte-exactly against the dense expectation (sync CPU engine)."""

    def __init__(self, kv_caches: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_caches, *args, **kwargs)
        self.layer_views = list(kv_caches)
        self.raw = torch.empty(0, dtype=torch.uint8).set_(self.layer_views[0].untyped_storage())
        self.plans_checked = 0

    def submit(self, plan: CopyPlan) -> None:
        old = self.raw.numpy().copy()
        super().submit(plan)
        self.fence()
        exp = _expected_after(old, self.layer_views, plan, self.per_head, self.bs)
        assert np.array_equal(self.raw.numpy(), exp)
        self.plans_checked += plan.num_moves > 0


@pytest.mark.parametrize("mode", ["compact", "ordered"])
@pytest.mark.parametrize("granularity", ["request", "head"])
@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_attention_over_adapter_views_equals_dense(layout: str, granularity: str, mode: str) -> None:
    from . import test_attention as ta

    d = ta.Driver(granularity, mode, "generic", seed=zlib.crc32(f"{layout}{granularity}{mode}".encode()))
    _, views = _allocate(layout, "float32", L=ta.L, NB=ta.NB, H=ta.H, bs=ta.BS, D=ta.D, seed=None)
    a = KVLayoutAdapter.from_view(views[0], ta.D)
    d.c = VTokenCache(ta.L, ta.H, ta.D, ta.BS, ta.NB, granularity=granularity, mode=mode, stat_names=("acc",),
                      debug=True, kv_caches=views, kv_views=[a.kv_views(v) for v in views],
                      copy_engine=_CheckedEngine, async_copy=False)
    lens = {"a": 29, "b": 17}
    for r in lens:
        d.add(r)
    for r, n in lens.items():  # chunked prefill with evictions between chunks
        done = 0
        while done < n:
            chunk = min(n - done, int(d.rng.integers(3, 11)))
            pos = d.append(r, chunk)
            assert d.check({r: pos}, index_rule=True) <= ta.TOL
            done += chunk
            if done < n:
                d.evict(r, 0.3)
                d.c.reclaim()
    for step in range(6):  # decode, evicting every other step
        q = {r: d.append(r, 1) for r in lens}
        assert d.check(q, index_rule=True) <= ta.TOL
        if step % 2 == 1:
            for r in lens:
                d.evict(r, 0.4)
            d.c.reclaim()
    assert d.c.engine.plans_checked >= 4
    for r in lens:
        assert d.c.held_blocks(r) == -(-int(d.live[r][0].sum()) // ta.BS)
