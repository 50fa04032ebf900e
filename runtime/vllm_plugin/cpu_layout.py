"""vLLM's CPU KV cache layout: probed element maps, the copy engine and the strided K/V views the torch paths read.

vLLM's CPU attention stores each layer as ``[NB, H_kv, bs, 2D]`` but the order of K and V elements
inside one (block, head) region depends on the kernel ISA, so it is measured once with the real op
(:func:`probe_cpu_kv_layout`) instead of assumed. The GPU backends' layouts are described by their
strides instead (``vtoken_runtime.kv_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vtoken_runtime.copy_engine import CopyEngine
from vtoken_runtime.stats.cpu_gather import PairedKeys


def probe_cpu_kv_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Where vLLM's CPU ``reshape_and_cache`` puts token t, dim d of K and V inside one (block, head)
    region of ``2 * block_size * head_size`` elements: ``(kmap, vmap)`` int64 ``[block_size, head_size]``.

    The layout depends on the kernel ISA (with ``vec`` fp32, K is stored dim-major ``[D, bs]`` and V
    token-major ``[bs, D]``), so it is measured once with the real op instead of assumed.
    """
    from vllm import _custom_ops as ops

    bs, D = block_size, head_size
    R = 2 * bs * D

    def run(kfill: torch.Tensor, vfill: torch.Tensor) -> torch.Tensor:
        kv = torch.zeros(1, 1, bs, 2 * D, dtype=dtype)
        view = kv.view(1, 1, 2 * bs, D)
        kc, vc = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(kfill.to(dtype).contiguous(), vfill.to(dtype).contiguous(), kc, vc, torch.arange(bs, dtype=torch.int64),
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return kv.reshape(-1).float()

    t_code = (torch.arange(bs, dtype=torch.float32) + 1)[:, None, None].expand(bs, 1, D)
    d_code = (torch.arange(D, dtype=torch.float32) + 1)[None, None, :].expand(bs, 1, D)
    zero = torch.zeros(bs, 1, D)
    maps = []
    for is_k in (True, False):
        ft = run(t_code, zero) if is_k else run(zero, t_code)
        fd = run(d_code, zero) if is_k else run(zero, d_code)
        pos = torch.nonzero(ft != 0).flatten()
        if pos.numel() != bs * D:
            raise RuntimeError(f"vtoken: cannot probe the CPU KV layout for isa={isa!r} (found {pos.numel()} cells)")
        m = np.full((bs, D), -1, dtype=np.int64)
        m[(ft[pos] - 1).long().numpy(), (fd[pos] - 1).long().numpy()] = pos.numpy()
        if (m < 0).any() or np.unique(m).size != bs * D or m.max() >= R:
            raise RuntimeError(f"vtoken: CPU KV layout for isa={isa!r} is not a permutation of the block")
        maps.append(m)
    return maps[0], maps[1]


def element_index(blk: Any, off: Any, heads: Any, emap: Any, H: int, R: int) -> Any:
    """Flat element ids of a probed map's cells in vLLM's CPU cache ``[NB, H, bs, 2D]`` (one region of ``R =
    2 * bs * D`` elements per (block, head)): ``((blk * H + heads) * R)[..., None] + emap[off]``, numpy arrays or
    torch tensors alike; ``blk``, ``off``, ``heads`` broadcast, ``emap [bs, W]`` gives the last axis (K's
    or V's map, or both side by side). The one address rule of the copy engine and the readers."""
    return ((blk * H + heads) * R)[..., None] + emap[off]


class VllmCpuCopyEngine(CopyEngine):
    """Copy engine for vLLM's CPU KV tensors ``[NB, H, bs, 2D]`` whose inner layout was probed
    (:func:`probe_cpu_kv_layout`). Moves single elements of a flat view: a token-head move is
    ``2 * D`` element moves (K and V), whatever the ISA's layout."""

    def __init__(self, *args: Any, kmap: np.ndarray, vmap: np.ndarray, **kwargs: Any) -> None:
        self.kmap, self.vmap = kmap, vmap
        self._kvmap = np.concatenate([kmap, vmap], axis=1)  # [bs, 2D]: a token-head's K then V elements
        super().__init__(*args, **kwargs)

    def _kv_views(self, t: Any) -> list[torch.Tensor]:
        if isinstance(t, tuple) or tuple(t.shape) != (self.nb, self.H, self.bs, 2 * self.D):
            raise ValueError(f"vLLM CPU layer cache must be [{self.nb}, {self.H}, {self.bs}, {2 * self.D}]")
        if not t.is_contiguous():
            raise ValueError("vLLM CPU layer cache must be contiguous to be moved in place")
        return [t.view(-1, 1)]

    def _kv_index(self, slots: np.ndarray, heads: np.ndarray | None) -> np.ndarray:
        H, bs = self.H, self.bs
        R = 2 * bs * self.D
        blk, off = slots // bs, slots % bs
        if heads is None:  # a token's elements in every head: [m, H, 2D]
            return element_index(blk[:, None], off[:, None], np.arange(H, dtype=np.int64), self._kvmap, H, R).reshape(-1)
        return element_index(blk, off, heads, self._kvmap, H, R).reshape(-1)  # [m, 2D]

    def row_bytes(self) -> int:
        el = self._views[0][0].element_size() if self._views else 4
        per_lh = 2 * self.D * el
        return per_lh if self.per_head else per_lh * self.H * len(self._views)


def _affine(m: np.ndarray) -> tuple[int, int, int] | None:
    """``(offset, stride_t, stride_d)`` if ``m[t, d] = offset + t * st + d * sd``, else None."""
    o = int(m[0, 0])
    st = int(m[1, 0] - o) if m.shape[0] > 1 else 0
    sd = int(m[0, 1] - o) if m.shape[1] > 1 else 0
    t = np.arange(m.shape[0])[:, None]
    d = np.arange(m.shape[1])[None, :]
    return (o, st, sd) if bool((m == o + t * st + d * sd).all()) else None


def is_affine_layout(kmap: np.ndarray, vmap: np.ndarray) -> bool:
    """Whether a probed layout (:func:`probe_cpu_kv_layout`) is affine per (block, head) region, i.e. K and
    V can be viewed as strided ``[NB, bs, H, D]`` tensors. True for the ``vec`` ISA (fp32, bf16); false for
    ``amx`` (bf16 on CPUs with AMX tiles), which interleaves pairs::

        amx   K[t, d] at (t // 16) * 16 * D + (d // 2) * 32 + 2 * (t % 16) + d % 2
                      (segments of 16 tokens; pairs of dims, token-major inside: amx_paired_keys)
              V[t, d] at bs * D + (d // 16) * 16 * bs + (t // 2) * 32 + 2 * (d % 16) + t % 2
                      (segments of 16 dims; pairs of tokens, dim-major inside)
        vec   K[t, d] at d * bs + t          V[t, d] at bs * D + t * D + d

    (measured for bs = 32, 64, 128 and D = 32, 64, 128; the amx kernels need bs % 32 == 0)
    """
    return _affine(kmap) is not None and _affine(vmap) is not None


class MappedKV:
    """K or V of one layer of vLLM's CPU cache ``[NB, H, bs, 2D]`` read through its probed element map (for a
    layout no strided view expresses: ``amx``): the reads :meth:`CacheQueries.gather_kv_vectors` makes, as
    indexing ``x[blk, off]`` -> ``[..., H, D]`` and ``x[blk, off, h]`` -> ``[..., D]`` (index tensors broadcast).
    Read-only: nothing writes vLLM's cache through it (vLLM writes new tokens, the copy engine moves them)."""

    def __init__(self, cache: torch.Tensor, emap: np.ndarray) -> None:
        if not cache.is_contiguous():
            raise ValueError("MappedKV: the layer cache must be contiguous")
        self.flat = cache.reshape(-1)
        self.dtype = cache.dtype
        self.H = int(cache.shape[1])
        bs, D = emap.shape
        self.R = 2 * bs * D  # elements per (block, head) region
        self.emap = torch.as_tensor(emap, dtype=torch.int64, device=cache.device)  # [bs, D]

    def __getitem__(self, idx: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(idx) == 2:  # every head: [..., H, D]
            blk, off = idx
            h = torch.arange(self.H, device=blk.device)
            return self.flat[element_index(blk[..., None], off[..., None], h, self.emap, self.H, self.R)]
        blk, off, h = idx  # [..., D]
        return self.flat[element_index(blk, off, h, self.emap, self.H, self.R)]


def vllm_cpu_mapped(kv_caches: Sequence[torch.Tensor], kmap: np.ndarray, vmap: np.ndarray
                    ) -> list[tuple[MappedKV, MappedKV]]:
    """Per layer, (K, V) :class:`MappedKV` readers of vLLM's CPU caches for any probed layout."""
    return [(MappedKV(t, kmap), MappedKV(t, vmap)) for t in kv_caches]


def amx_paired_keys(kv_caches: Sequence[torch.Tensor], kmap: np.ndarray) -> list[PairedKeys] | None:
    """The keys of vLLM's CPU caches ``[NB, H, bs, 2D]`` in the ``amx`` layout as :class:`PairedKeys` (one per
    layer; the numba statistics kernel reads them in place), or None when the probed ``kmap`` is not that
    layout: 2-byte elements in segments of ``T`` tokens (the AMX tile's 16 rows; ``T`` divides ``bs``), pairs of
    dims per segment, ``K[t, d]`` at ``o + (t // T) * T * D + (d // 2) * 2 * T + 2 * (t % T) + d % 2``, ``o``
    even::

        one (block, head) region in 32-bit words (R = bs * D; K's bs * D / 2 words, then V's):
        | segment 0: T * D / 2 words                      | segment 1 ...
        | word p * T + t = K[t, 2p] (low) | K[t, 2p + 1] (high)   p < D / 2, t < T
        -> strides (H * R, 1, R, T), segment T, segment stride T * D / 2
    """
    bs, D = kmap.shape
    o = int(kmap[0, 0])
    runs = np.nonzero(kmap[:, 0] != o + 2 * np.arange(bs))[0]
    T = int(runs[0]) if runs.size else bs
    t = np.arange(bs)[:, None]
    d = np.arange(D)[None, :]
    want = o + (t // T) * T * D + (d // 2) * 2 * T + 2 * (t % T) + d % 2
    if D % 2 or o % 2 or bs % T or not bool((kmap == want).all()):
        return None
    out = []
    for c in kv_caches:
        if c.element_size() != 2 or not c.is_contiguous() or c.storage_offset() % 2:
            return None
        H = c.shape[1]
        w = c.view(torch.int32)  # [NB, H, bs, D] words: 2D 16-bit elements -> D words per row
        R = bs * D
        first = torch.as_strided(w, (1,), (1,), w.storage_offset() + o // 2)
        out.append(PairedKeys(first, (c.shape[0], bs, H, D), (H * R, 1, R, T), T, T * D // 2))
    return out


def vllm_cpu_views(kv_caches: Sequence[torch.Tensor], kmap: np.ndarray, vmap: np.ndarray
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[NB, bs, H, D]`` (K, V) views of vLLM's CPU caches ``[NB, H, bs, 2D]`` for the probed layout
    (:func:`probe_cpu_kv_layout`), which must be affine per block (:func:`is_affine_layout`: the ``vec`` ISA,
    fp32 or bf16)."""
    ka, va = _affine(kmap), _affine(vmap)
    if ka is None or va is None:
        raise ValueError(f"vtoken: the CPU KV layout of {kv_caches[0].dtype} is not affine per block; "
                         "no strided K/V view (the torch paths') can address it (use the vec ISA: float32, or bfloat16 with a policy that "
                         "reads the cache, which selects it)")
    bs, D = kmap.shape
    out = []
    for t in kv_caches:
        H = t.shape[1]
        R = 2 * bs * D
        out.append(tuple(t.as_strided((t.shape[0], bs, H, D), (H * R, st, R, sd), t.storage_offset() + o)
                         for o, st, sd in (ka, va)))
    return out  # type: ignore[return-value]
