"""The Triton repack kernel is byte-identical to the torch copy engine (TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken_runtime.copy_engine import CopyEngine, CopyPlan
from vtoken_runtime.planner import plan_compact, plan_ordered
from vtoken_runtime.slot_stats import SlotStore

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

L, H, D, BS, NB = 2, 2, 8, 4, 10
STATS = ("attn_sum", "low_attn_count")


def _world(layout: str, per_head: bool, seed: int, dtype: torch.dtype, triton_mode: str | None):
    g = torch.Generator().manual_seed(seed)
    if layout == "vllm_cpu":
        caches = [torch.randint(-2**15, 2**15, (NB, H, BS, 2 * D), generator=g, dtype=torch.int16) for _ in range(L)]
    else:
        caches = [torch.randint(-2**15, 2**15, (2, NB, BS, H, D), generator=g, dtype=torch.int16) for _ in range(L)]
    if dtype == torch.float32:
        caches = [c.view(torch.float32) if c.shape[-1] % 2 == 0 else c for c in caches]
    else:
        caches = [c.view(dtype) for c in caches]
    store = SlotStore(L, H, NB * BS, L * H if per_head else 1, STATS)
    for t in store.stats.values():
        t.copy_(torch.randn(t.shape, generator=g))
    store.positions.copy_(torch.randint(-1, 1000, store.positions.shape, generator=g))
    kw = dict(kv_caches=caches, kv_layout=layout, num_kv_heads=H, head_size=caches[0].shape[-1] // 2
              if layout == "vllm_cpu" else caches[0].shape[-1], block_size=BS, num_blocks=NB, slot_store=store,
              per_head=per_head, async_copy=False)
    if triton_mode is None:
        eng = CopyEngine(**kw, chunk_bytes=1 << 24)
    else:  # the engine's own Triton runner (what CUDA caches use), forced on CPU under the interpreter
        eng = CopyEngine(**kw, gpu_runner="triton", planner_mode=triton_mode)
    return caches, store, eng


def _plan(mode: str, per_head: bool, seed: int, used: int, keep: float) -> CopyPlan:
    rng = np.random.default_rng(seed)
    rows = L * H if per_head else 1
    n = max(1, int(round(used * keep)))
    live = np.zeros((rows, used), dtype=bool)
    for r in range(rows):
        live[r, rng.choice(used, size=n, replace=False)] = True
    r, s, d = plan_compact(live, n) if mode == "compact" else plan_ordered(live, n)
    blocks = rng.permutation(NB)[: (used + BS - 1) // BS]

    def phys(v: np.ndarray) -> np.ndarray:
        return blocks[v // BS] * BS + v % BS

    return CopyPlan(r, phys(s), phys(d))


def _bytes(caches, store) -> list[bytes]:  # type: ignore[no-untyped-def]
    out = [c.contiguous().view(torch.uint8).numpy().tobytes() for c in caches]
    out += [t.view(torch.uint8).numpy().tobytes() for t in store.stats.values()]
    return out + [store.positions.view(torch.uint8).numpy().tobytes()]


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["compact", "ordered"]), layout=st.sampled_from(["vllm_cpu", "generic"]),
       per_head=st.booleans(), seed=st.integers(0, 2**16), used=st.integers(1, NB * BS),
       keep=st.floats(0.05, 1.0), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_repack_byte_identical_to_copy_engine(mode, layout, per_head, seed, used, keep, dtype) -> None:
    plan = _plan(mode, per_head, seed, used, keep)
    ref_caches, ref_store, ref_eng = _world(layout, per_head, seed, dtype, None)
    tri_caches, tri_store, tri_eng = _world(layout, per_head, seed, dtype, mode)
    assert _bytes(ref_caches, ref_store) == _bytes(tri_caches, tri_store)
    ref_eng.submit(plan)
    ref_eng.fence()
    tri_eng.submit(plan)
    tri_eng.fence()
    assert _bytes(ref_caches, ref_store) == _bytes(tri_caches, tri_store)


def test_ordered_mode_is_sequential_semantics() -> None:
    """Overlapping ascending moves: the kernel equals applying them one by one in order."""
    from vtoken_runtime.kernels.repack_triton import move_rows

    view = torch.arange(40, dtype=torch.float32).view(20, 2).clone()
    src = torch.tensor([3, 4, 7, 9, 10, 15])
    dst = torch.tensor([1, 3, 4, 7, 9, 10])
    want = view.clone()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        want[d] = want[s]
    move_rows(view, src, dst, "ordered")
    assert torch.equal(view, want)
