"""KV layout adapter: vLLM 0.32's per-layer GPU KV cache views, in any physical layout, as copy-engine rows.

vLLM 0.32 backs every attention layer of a cache group with ONE int8 allocation and hands each layer a
4-D logical view (``vllm.v1.kv_cache_interface.create_kv_cache_views``)::

    view [NB, H, bs, C]     NB = num_blocks, H = num_kv_heads, bs = block_size (tokens),
                            C  = 2*D elements of the cache dtype: K = [..., :D], V = [..., D:]
    FlashAttention reads    K, V = view.transpose(1, 2).split(D, dim=-1)      each [NB, bs, H, D]

The physical order of the axes is a ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``): a stride
permutation of the 5-D backing ``[L, B, H, N, C]`` (L = layer). Strides in elements, C innermost::

    layout   memory order        sB (block)        sH (head)        sN (token)    layers
    LBHNC    [L][B][H][N][C]     H*bs*C            bs*C             C             one region each
    LBNHC    [L][B][N][H][C]     bs*H*C            C                H*C           one region each
    LHBNC    [L][H][B][N][C]     bs*C              NB*bs*C          C             one region each
    BLHNC    [B][L][H][N][C]     L*H*bs*C          bs*C             C             interleaved per block
    BLNHC    [B][L][N][H][C]     L*bs*H*C          C                H*C           interleaved per block
    BHLNC    [B][H][L][N][C]     H*L*bs*C          L*bs*C           C             interleaved per head

Every stride is a multiple of C and C has unit stride, so the C elements of one (block, head, token)
cell are one contiguous "row", and the whole layer is a subset of the rows of ONE contiguous 2-D
tensor starting at the view's storage offset::

    cell (b, h, n)  ->  element  off + b*sB + h*sH + n*sN   ..  + C - 1
                    ->  row      b*rB + h*rH + n*rN          (rX = sX / C)
    row_view  = as_strided(storage, (R, C), (C, 1), off)     R = (NB-1)*rB + (H-1)*rH + (bs-1)*rN + 1
    slot s (vLLM slot mapping, s = block*bs + offset), head h  ->  row (s // bs)*rB + h*rH + (s % bs)*rN

    e.g. LBNHC, H = 2, bs = 2 (rB = 4, rH = 1, rN = 2), one layer's region:
        row:   0        1        2        3      | 4        5        6        7      | ...
        cell: (0,h0,n0)(0,h1,n0)(0,h0,n1)(0,h1,n1)|(1,h0,n0)(1,h1,n0)(1,h0,n1)(1,h1,n1)| ...
              '------------- block 0 ------------''------------- block 1 ------------'

The copy engine's jobs are "rows ``src`` of a contiguous 2-D view go to rows ``dst``"
(:mod:`vtoken_runtime.copy_engine`), so :class:`LayoutCopyEngine` only supplies the row view and the
row ids; the planner's ordering argument (per-row ascending order, chunked gather-then-scatter) carries
over unchanged because the (block, head, token) -> row map is injective and keeps the plan's order.
Rows move as opaque bytes: the row view reinterprets the cache dtype as the unsigned/signed integer
type of the same element size (fp8, bf16 NaN payloads, ... move byte-exactly on CPU and GPU).

In block-outermost layouts (BL*, BH*) the rows of one layer are interleaved with other layers' rows;
the adapter still addresses them correctly (the row view spans the other layers' pages, which are
never named by a row id), but :func:`check_supported` refuses those layouts for the vLLM worker.

This module does not import vLLM: :func:`check_supported` works on plain strings/ints (the layout name,
block sizes, ``kv_cache_dtype``) so the worker calls it at start-up and tests call it without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .copy_engine import CopyEngine
from .slot_stats import SlotStore

# KVCacheLayout member name -> stride permutation of [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUT_ALIASES: dict[str, str] = {"NHD": "LBNHC", "HND": "LBHNC"}  # vllm.config.cache legacy names
SUPPORTED_LAYOUTS: tuple[str, ...] = tuple(n for n, o in LAYOUT_ORDERS.items() if o[0] != 1)  # L outermost
# kv_cache_dtype values whose pages hold plain K then V elements (fp8: one per-tensor scale, kept
# outside the cache, so rows move as bytes).
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float16", "half", "bfloat16", "float32", "float", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
)

_INT_OF_SIZE: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ================================================================================= start-up guard
def _layout_name(layout: Any) -> str:
    name = getattr(layout, "name", layout)  # a KVCacheLayout member or its name
    if not isinstance(name, str):
        raise ValueError(f"vtoken: KV cache layout must be a KVCacheLayout or its name, got {layout!r}")
    name = LAYOUT_ALIASES.get(name.upper(), name.upper())
    if name not in LAYOUT_ORDERS:
        raise ValueError(f"vtoken: unknown KV cache layout {layout!r}; known: {sorted(LAYOUT_ORDERS)} "
                         f"(aliases {LAYOUT_ALIASES})")
    return name


def is_block_outermost(layout: Any) -> bool:
    """``KVCacheLayout.is_block_outermost`` for a member or a name (aliases accepted)."""
    return LAYOUT_ORDERS[_layout_name(layout)][0] == 1


def check_supported(layout: Any, *, manager_block_size: int, kernel_block_size: int | None = None,
                    kv_cache_dtype: str = "auto", head_size: int | None = None,
                    head_size_v: int | None = None) -> str:
    """Refuse vLLM KV cache configurations the vtoken copy engine cannot move exactly.

    Pure function of strings and ints (no vLLM import). Returns the canonical layout name (aliases
    ``NHD``/``HND`` resolved). Raises ``ValueError`` listing every problem found, each with what was
    found, what is supported and what to set:

    * ``layout``: a ``KVCacheLayout`` member or name. Block-outermost layouts (BLHNC, BLNHC, BHLNC)
      interleave the pages of all layers inside each block; refused (set ``VLLM_KV_CACHE_LAYOUT=LBNHC``).
    * ``kernel_block_size`` != ``manager_block_size``: the attention kernel splits each manager block
      into smaller kernel blocks, so the layer view is ``[NB * ratio, H, kernel_bs, C]``; refused
      (set ``--block-size`` to the kernel block size). ``None`` means "no splitting".
    * ``kv_cache_dtype``: per-token-head quantisation (``int8_per_token_head``, ``fp8_per_token_head``,
      ``int4_per_token_head``) stores fp32 scales inline after each head's data, so C != 2*head_size;
      packed formats (nvfp4, turboquant, ultraquant, *_ds_mla) likewise. Refused. ``auto``, float16,
      bfloat16, float32 and the per-tensor fp8 types (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ``fp8_inc``)
      are supported; fp8 rows move as bytes.
    * ``head_size_v`` (if given) must equal ``head_size`` (K and V halves of equal width).
    """
    problems: list[str] = []
    try:
        name = _layout_name(layout)
    except ValueError as e:
        problems.append(str(e).removeprefix("vtoken: "))
        name = str(getattr(layout, "name", layout))
    else:
        if LAYOUT_ORDERS[name][0] == 1:
            problems.append(
                f"KV cache layout {name} is block-outermost (each block interleaves the pages of all layers); "
                f"supported: the layer-outermost layouts {', '.join(SUPPORTED_LAYOUTS)}. "
                "Set VLLM_KV_CACHE_LAYOUT=LBNHC (or another layer-outermost layout your attention backend "
                "supports).")
    kb = manager_block_size if kernel_block_size is None else int(kernel_block_size)
    if kb != int(manager_block_size):
        problems.append(
            f"the attention kernel block size is {kb} tokens but the KV cache manager's block size is "
            f"{manager_block_size} (vLLM splits each block into {manager_block_size // max(kb, 1)} kernel "
            f"blocks); vtoken needs them equal. Run with --block-size {kb}.")
    dt = str(kv_cache_dtype)
    if dt not in SUPPORTED_KV_CACHE_DTYPES:
        if "per_token_head" in dt:
            why = ("per-token-head quantisation stores fp32 scales inline after each head's K and V data "
                   "(content != 2*head_size elements)")
        else:
            why = "not a plain K/V element type (packed or block-scaled content)"
        problems.append(
            f"kv_cache_dtype={dt!r}: {why}; supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)} "
            "(fp8 = one per-tensor scale: rows move as bytes). Set --kv-cache-dtype fp8 or auto.")
    if head_size_v is not None and head_size is not None and int(head_size_v) != int(head_size):
        problems.append(f"head_size_v={head_size_v} != head_size={head_size}: vtoken needs K and V of equal "
                        "width (C = 2*head_size); use an attention backend with equal K/V head sizes.")
    if problems:
        raise ValueError("vtoken cannot run on this KV cache:\n  - " + "\n  - ".join(problems))
    return name


# ================================================================================= adapter
def _infer_name(sizes: Sequence[int], strides: Sequence[int], width: int) -> str:
    """``KVCacheLayout``-style name of a per-layer view from its (B, H, N) sizes and element strides.

    Axes are ordered by stride (ties: logical order B, H, N). L goes where a stride exceeds the extent
    of the axes inside it by an integer factor >= 2 (other layers' pages interleaved there); with no
    such gap the layer is one region (L outermost). A padded page (non-integer gap) reads as L outermost;
    one layer (or a padding factor of exactly 2) cannot be told apart from its neighbours: for logs only.
    """
    axes = sorted(zip("BHN", sizes, strides, strict=True), key=lambda a: -a[2])  # stable: ties B, H, N
    extent, name, placed = width, "C", False
    for letter, size, stride in reversed(axes):
        if size > 1 and not placed and stride > extent and stride % extent == 0 and stride // extent >= 2:
            name, placed = "L" + name, True
        name = letter + name
        extent = max(extent, stride * size)
    return name if placed else "L" + name


@dataclass(frozen=True)
class KVLayoutAdapter:
    """Row addressing of one cache group's per-layer logical views ``[NB, H, bs, 2D]`` (any KVCacheLayout).

    Offset-free: the layers of one ``KVCacheTensor`` share shape, strides and dtype and differ only by
    storage offset, so one adapter serves them all (each method takes the layer's view and checks it).

        cell (b, h, n)  ->  row  b*rB + h*rH + n*rN        row_strides = (rB, rH, rN) = strides / C
        slot s, head h  ->  row  (s // bs)*rB + h*rH + (s % bs)*rN
    """

    num_blocks: int  # NB
    num_heads: int  # H (KV heads)
    block_size: int  # bs (tokens per block of the view: the kernel block size)
    head_size: int  # D
    row_strides: tuple[int, int, int]  # (rB, rH, rN) in rows of C elements
    strides: tuple[int, int, int, int]  # the view's element strides (checked on every view)
    dtype: torch.dtype
    name: str  # KVCacheLayout-style physical order, e.g. "LBNHC" (inferred; for messages/logs)

    @classmethod
    def from_view(cls, view: torch.Tensor, head_size: int) -> KVLayoutAdapter:
        """Derive the addressing of ``view [NB, H, bs, C]`` (C = 2*head_size elements, any dtype).

        Requires unit stride on C, strides sB, sH, sN that are multiples of C (true for every
        KVCacheLayout without padding) and non-overlapping cells. Raises ``ValueError`` otherwise.
        """
        if view.dim() != 4:
            raise ValueError(f"vtoken: a layer's KV cache view must be 4-D [NB, H, bs, 2*D], got {tuple(view.shape)}")
        nb, h, bs, c = (int(x) for x in view.shape)
        if c != 2 * int(head_size):
            raise ValueError(f"vtoken: KV cache view content is {c} elements, expected 2*head_size = "
                             f"{2 * head_size} (K then V); per-token-head scales or packed formats are not "
                             "supported")
        if min(nb, h, bs) <= 0:
            raise ValueError(f"vtoken: empty KV cache view {tuple(view.shape)}")
        if view.element_size() not in _INT_OF_SIZE:
            raise ValueError(f"vtoken: unsupported KV cache element size {view.element_size()} ({view.dtype})")
        sb, sh, sn, sc = (int(x) for x in view.stride())
        if sc != 1:
            raise ValueError(f"vtoken: the content axis of the KV cache view must have unit stride, strides "
                             f"{tuple(view.stride())}")
        rows = []
        for what, size, s in (("block", nb, sb), ("head", h, sh), ("token", bs, sn)):
            if size == 1:
                rows.append(0)  # never stepped: any stride addresses the same row
            elif s <= 0 or s % c:
                raise ValueError(
                    f"vtoken: the {what} stride of the KV cache view ({s} elements, strides "
                    f"{tuple(view.stride())}) is not a multiple of the {c}-element K/V content; padded "
                    "pages are not supported (use a layout/backend without page padding)")
            else:
                rows.append(s // c)
        # Injectivity: sorted by stride, each axis must step past the whole extent of the axes inside it.
        extent = 1
        for r, size in sorted(((r, n) for r, n in zip(rows, (nb, h, bs), strict=True) if n > 1)):
            if r < extent:
                raise ValueError(f"vtoken: KV cache view cells overlap (strides {tuple(view.stride())})")
            extent = r * size
        name = _infer_name((nb, h, bs), (sb, sh, sn), c)
        return cls(nb, h, bs, int(head_size), (rows[0], rows[1], rows[2]), (sb, sh, sn, sc), view.dtype, name)

    # ------------------------------------------------------------------ derived sizes
    @property
    def width(self) -> int:
        """C = 2*D: elements per row (K then V of one (block, head, token))."""
        return 2 * self.head_size

    @property
    def num_rows(self) -> int:
        """R = max row id + 1: rows of :meth:`row_view` (more than NB*H*bs when rows are interleaved)."""
        rb, rh, rn = self.row_strides
        return (self.num_blocks - 1) * rb + (self.num_heads - 1) * rh + (self.block_size - 1) * rn + 1

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_dtype(self) -> torch.dtype:
        """Integer dtype of the cache's element size: rows move as opaque bytes."""
        return _INT_OF_SIZE[self.element_size]

    def check_view(self, view: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``view`` has this adapter's shape, strides and dtype."""
        shape = (self.num_blocks, self.num_heads, self.block_size, self.width)
        if tuple(view.shape) != shape or view.dtype != self.dtype:
            raise ValueError(f"vtoken: KV cache view {tuple(view.shape)} {view.dtype} does not match the "
                             f"adapter's {shape} {self.dtype}")
        if any(n > 1 and int(s) != e for n, s, e in zip(shape, view.stride(), self.strides, strict=True)):
            raise ValueError(f"vtoken: KV cache view strides {tuple(view.stride())} differ from the adapter's "
                             f"{self.strides} (layers of different layouts?)")

    # ------------------------------------------------------------------ views and row ids
    def row_view(self, view: torch.Tensor) -> torch.Tensor:
        """``[R, C]`` contiguous tensor over ``view``'s storage, row r = elements ``off + r*C ..`` (integer
        dtype of the cache's element size). Row ``row_index`` of cell (b, h, n) aliases ``view[b, h, n]``.

        In interleaved layouts the row view also covers other layers' pages; only row ids from
        :meth:`row_index` (this layer's cells) may be written.
        """
        self.check_view(view)
        v = view.view(self.row_dtype)  # same element size: same strides and storage offset
        return v.as_strided((self.num_rows, self.width), (self.width, 1), v.storage_offset())

    def row_index(self, slots: np.ndarray, heads: np.ndarray | None) -> np.ndarray:
        """int64 row ids of physical ``slots [m]`` (s = block*bs + offset).

        ``heads [m]`` given -> ``[m]`` rows (slot i, head heads[i]); ``heads`` None -> ``[m*H]`` rows, all
        heads of each slot, slot-major (row i*H + h = slot i, head h). Raises ``ValueError`` for slots
        outside ``[0, NB*bs)`` or heads outside ``[0, H)``.
        """
        s = np.asarray(slots, dtype=np.int64)
        if s.size and (int(s.min()) < 0 or int(s.max()) >= self.num_blocks * self.block_size):
            raise ValueError(f"vtoken: slot ids must lie in [0, {self.num_blocks * self.block_size})")
        rb, rh, rn = self.row_strides
        base = (s // self.block_size) * rb + (s % self.block_size) * rn
        if heads is None:
            return (base[:, None] + np.arange(self.num_heads, dtype=np.int64)[None, :] * rh).reshape(-1)
        h = np.asarray(heads, dtype=np.int64)
        if h.shape != s.shape:
            raise ValueError(f"vtoken: {h.size} heads for {s.size} slots")
        if h.size and (int(h.min()) < 0 or int(h.max()) >= self.num_heads):
            raise ValueError(f"vtoken: head ids must lie in [0, {self.num_heads})")
        return base + h * rh

    def kv_views(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` each ``[NB, bs, H, D]`` (cache dtype, strided): FlashAttention's
        ``view.transpose(1, 2).split(D, dim=-1)``."""
        self.check_view(view)
        k, v = view.transpose(1, 2).split(self.head_size, dim=-1)
        return k, v


# ================================================================================= copy engine
class LayoutCopyEngine(CopyEngine):
    """:class:`CopyEngine` over vLLM's per-layer logical views ``[NB, H, bs, 2D]`` in any layout.

    One job per layer on the adapter's contiguous row view ``[R, 2D]`` (K and V of a (block, head,
    token) move together); rows from :meth:`KVLayoutAdapter.row_index`. The base class's job building,
    chunked gather-then-scatter / single-pass numba kernel, async worker and CUDA side stream are
    unchanged. All layers must share one addressing (one KVCacheTensor): request-granularity jobs reuse
    the same row ids for every layer. ``kv_layout`` is accepted for the factory signature and ignored.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        kv_layout: str,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        slot_store: SlotStore,
        per_head: bool,
        async_copy: bool = True,
        chunk_bytes: int = 2 << 20,
        cpu_path: str | None = None,
        *,
        adapters: Sequence[KVLayoutAdapter] | None = None,
    ) -> None:
        caches = list(kv_caches)
        if not caches:
            raise ValueError("vtoken: LayoutCopyEngine needs at least one layer")
        if any(isinstance(t, tuple) for t in caches):
            raise ValueError("vtoken: LayoutCopyEngine takes one [NB, H, bs, 2D] view per layer, not (K, V) pairs")
        ads = list(adapters) if adapters is not None else [KVLayoutAdapter.from_view(t, head_size) for t in caches]
        if len(ads) != len(caches):
            raise ValueError(f"vtoken: {len(ads)} adapters for {len(caches)} layers")
        a = ads[0]
        if any(x != a for x in ads[1:]):
            raise ValueError("vtoken: all layers must share one KV layout (shape, strides, dtype); got "
                             f"{sorted({(x.name, x.strides, str(x.dtype)) for x in ads})}")
        if (a.num_heads, a.head_size) != (num_kv_heads, head_size):
            raise ValueError(f"vtoken: KV cache views have {a.num_heads} heads of size {a.head_size}, the "
                             f"engine expects {num_kv_heads} x {head_size}")
        if (a.num_blocks, a.block_size) != (num_blocks, block_size):
            hint = (" (the attention kernel splits blocks: see check_supported, --block-size)"
                    if a.num_blocks * a.block_size == num_blocks * block_size else "")
            raise ValueError(f"vtoken: KV cache views hold {a.num_blocks} blocks of {a.block_size} tokens, the "
                             f"engine expects {num_blocks} x {block_size}{hint}")
        self.adapter = a
        self.adapters = ads
        self.physical_layout = a.name
        super().__init__(caches, "generic", num_kv_heads, head_size, block_size, num_blocks, slot_store,
                         per_head=per_head, async_copy=async_copy, chunk_bytes=chunk_bytes, cpu_path=cpu_path)

    def _kv_views(self, t: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(t, tuple):
            raise ValueError("vtoken: LayoutCopyEngine takes one [NB, H, bs, 2D] view per layer")
        return [self.adapter.row_view(t)]

    def _kv_index(self, slots: np.ndarray, heads: np.ndarray | None) -> np.ndarray:
        return self.adapter.row_index(slots, heads)

    def row_bytes(self) -> int:
        """K/V bytes per row-token move: ``2*D*el`` per (layer, head); times H*L at request granularity."""
        per_lh = 2 * self.D * self.adapter.element_size
        return per_lh if self.per_head else per_lh * self.H * len(self._views)
