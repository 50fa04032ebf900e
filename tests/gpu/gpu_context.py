"""What every GPU check shares: the device context (:class:`CheckContext`: device, tiny shapes or not, seed,
timing rounds, CUDA-event or host timers), vLLM-style strided K/V layouts over one allocation, a
``VTokenCache`` over them, a LIFO block pool, bit views and random keep masks."""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch


class CheckContext:
    def __init__(self, dev: torch.device, smoke: bool, seed: int, rounds: int) -> None:
        self.dev, self.smoke, self.seed, self.rounds = dev, smoke, seed, rounds
        self.cuda = dev.type == "cuda"
        # CUDA: the engine picks Triton itself ("auto"); CPU: force it (interpreter) to run the same path
        self.runner = "auto" if self.cuda else "triton"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def layout_views(L: int, NB: int, H: int, bs: int, C: int, dtype: torch.dtype, dev: torch.device, layout: str,
                  guard: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation for all layers (L outermost) and each layer's logical ``[NB, H, bs, C]`` view."""
    per = NB * bs * H * C
    store = torch.zeros(L * per + guard, dtype=dtype, device=dev)
    strides = {"LBNHC": (bs * H * C, C, H * C, 1), "LBHNC": (H * bs * C, bs * C, C, 1)}[layout]
    return store, [torch.as_strided(store, (NB, H, bs, C), strides, li * per) for li in range(L)]


def layout_engine() -> tuple[Any, str, str | None]:
    """``(engine class, name, note)``: kv_layout.LayoutCopyEngine, or a local fallback (said in the JSON)."""
    try:
        from vtoken_runtime.kv_layout import LayoutCopyEngine

        return LayoutCopyEngine, "vtoken_runtime.kv_layout.LayoutCopyEngine", None
    except Exception as e:
        return (fallback_engine_class(), "gpu_check fallback: a CopyEngine subclass addressing LBNHC/LBHNC rows",
                f"vtoken_runtime.kv_layout not importable ({type(e).__name__}: {e})")


def fallback_engine_class() -> Any:
    from vtoken_runtime.copy_engine import CopyEngine

    class FallbackLayoutEngine(CopyEngine):
        """Rows of one layer's physical order (LBHNC contiguous, or LBNHC = logical view transposed)."""

        def _kv_views(self, t):  # type: ignore[no-untyped-def]
            H, bs, nb, C = self.H, self.bs, self.nb, 2 * self.D
            if t.is_contiguous():
                self._phys = "LBHNC"
                return [t.view(nb * H * bs, C)]
            self._phys = "LBNHC"
            return [t.transpose(1, 2).view(nb * bs * H, C)]

        def _kv_index(self, slots, heads):  # type: ignore[no-untyped-def]
            H, bs = self.H, self.bs
            if heads is None:
                slots, heads = np.repeat(slots, H), np.tile(np.arange(H, dtype=np.int64), slots.size)
            if self._phys == "LBNHC":
                return slots * H + heads
            return ((slots // bs) * H + heads) * bs + slots % bs

    return FallbackLayoutEngine


def make_cache(ctx: CheckContext, L: int, H: int, D: int, bs: int, NB: int, mode: str, gran: str, async_copy: bool,
                runner: str, pool: Any, max_requests: int, maxb: int, layout: str = "LBNHC") -> tuple[Any, dict]:
    """A VTokenCache over vLLM-style strided views (LayoutCopyEngine), or the contiguous vllm_cpu
    layout when kv_layout is not importable."""
    from vtoken_runtime.cache import VTokenCache

    kw: dict[str, Any] = dict(granularity=gran, mode=mode, dtype=torch.bfloat16, device=ctx.dev,
                              stat_names=("attn_sum",), max_requests=max_requests, max_blocks_per_request=maxb,
                              async_copy=async_copy, pool=pool)
    info: dict[str, Any] = {}
    try:
        from vtoken_runtime.kv_layout import KVLayoutAdapter, LayoutCopyEngine

        _, views = layout_views(L, NB, H, bs, 2 * D, torch.bfloat16, ctx.dev, layout)
        ads = [KVLayoutAdapter.from_view(v, D) for v in views]
        cache = VTokenCache(L, H, D, bs, NB, kv_layout="generic", kv_caches=views,
                            kv_views=[a.kv_views(v) for a, v in zip(ads, views, strict=True)],
                            copy_engine=partial(LayoutCopyEngine, adapters=ads), **kw)
        info["layout"] = f"{layout} via kv_layout.LayoutCopyEngine"
    except ImportError as e:
        cache = VTokenCache(L, H, D, bs, NB, kv_layout="vllm_cpu", **kw)
        info["layout"] = f"LBHNC (vllm_cpu, contiguous): kv_layout not importable ({e})"
    cache.engine.gpu_runner = runner
    cache.engine.planner_mode = "compact" if mode == "compact" else "ordered"
    return cache, info


def lifo_pool(num_blocks: int) -> Any:
    """A BlockPool that hands out the most recently freed blocks first, so a reclaim's freed blocks go to
    the very next ``reserve`` while the copy out of them may still be in flight (``hits`` counts them)."""
    from vtoken_runtime.block_pool import BlockPool

    class LifoPool(BlockPool):
        """LIFO order through the pool's public API: the blocks to hand out are chosen here and claimed with
        ``take``; what is left over comes from the pool's own order."""

        def __init__(self, n: int) -> None:
            super().__init__(n, debug=False)
            self.freed_order: list[int] = []  # blocks as freed, the most recent last (stale entries skipped)
            self.recently_freed: set[int] = set()
            self.hits = 0

        def allocate(self, n: int) -> list[int] | None:
            if n < 0 or n > self.num_free:
                return super().allocate(n)
            out: list[int] = []
            while self.freed_order and len(out) < n:
                b = self.freed_order.pop()
                if self.refcount(b) == 0 and b not in out:
                    out.append(b)
            self.take(out)
            rest = super().allocate(n - len(out)) if len(out) < n else []
            assert rest is not None
            out += rest
            hit = self.recently_freed.intersection(out)
            self.hits += len(hit)
            self.recently_freed -= hit
            return out

        def free(self, blocks: Any) -> None:
            super().free(blocks)
            for b in (int(x) for x in blocks):
                if self.refcount(b) == 0:
                    self.freed_order.append(b)
                    self.recently_freed.add(b)

    return LifoPool(num_blocks)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (bitwise comparison: NaN payloads and -0.0 count)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_keep(rng: np.random.Generator, pos: np.ndarray, pinned: int) -> np.ndarray | None:
    """Keep mask ``[R, n]``: the same number evicted in every row, positions < ``pinned`` kept."""
    R, n = pos.shape
    free = n - pinned
    if free < 2:
        return None
    e = int(rng.integers(1, max(2, free // 3) + 1))
    keep = np.ones((R, n), dtype=bool)
    for r in range(R):
        cand = np.nonzero(pos[r] >= pinned)[0]
        keep[r, rng.choice(cand, size=e, replace=False)] = False
    return keep
