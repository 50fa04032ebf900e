"""Attention over per-row pages with vLLM's own CPU attention kernel (issue 39's first piece: no new kernel).

A row is one (request, KV head) of one layer, with its own length and its own list of pages. vLLM's CPU cache
for a layer is allocated ``[NB, H, bs, 2D]``: every (block, KV head) is one contiguous region of ``2 * bs * D``
elements, the keys of its ``bs`` positions in its first half and their values in the second (inside each half
in the layout ``cpu_attn_reshape_and_cache`` writes for the ISA: ``cpu_layout.probe_cpu_kv_layout``). So the
layer's cache *is* a pool of one-head pages::

    kv_cache [NB, H, bs, 2D]            one_head_pages(kv_cache)          page p = block * H + head
    block b: | head 0 | head 1 |  ->    [NB*H, 1, bs, D] keys   (first half of page p)
                                        [NB*H, 1, bs, D] values (second half of page p)

vLLM's kernel (``cpu_attention_with_kv_cache``) is then called with one *sequence* per row: ``num_kv_heads=1``,
``num_heads = H_q / H`` (the row's query heads), the row's length as ``seq_lens`` and its page ids as its
block-table row. Queries are packed row by row (request-major, then head) and the output unpacked the same way;
causality is by row order (a row's new tokens are its last ``q`` positions), as in ``RowCache.attention``.
Pages of one layer are interchangeable between heads, so a row may use any free page of its layer.

Every layer too: vLLM's CPU worker allocates the layers' caches as consecutive views of one buffer
(``[L, NB, H, bs, 2D]``, checked by :func:`all_layer_pages`), so the same view over the whole buffer is one
page space for every layer, ``page p = (layer * NB + block) * H + head``, and a row of any layer may use a
page of any layer's memory (PyramidKV and DuoAttention move budget between layers). A vLLM block id ``b``
is the pages ``{(l * NB + b) * H + h}``: it can return to vLLM's pool once all ``L x H`` of them are free.

Keys and values are written with vLLM's ``cpu_attn_reshape_and_cache`` through the same view (slot =
``page * bs + offset``): the kernel reads keys in the layout that op writes, not plain rows.

The HF side's :class:`~vtoken_runtime.page_table.PageTable` does the bookkeeping: :func:`vllm_pages` renumbers
its (block-major) page ids for this buffer and :func:`move_tokens` applies its eviction plans here.

Verified exact against a dense torch reference on vLLM's real kernel (``tests/vllm/test_row_attention.py``).
The worker runs row requests through it (:mod:`.rows`: per-layer metadata, the scheduler's accounting;
docs/vllm.md, "Unequal budgets inside vLLM").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

Pages = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each [pages, 1, bs, D]


def one_head_pages(kv_cache: torch.Tensor) -> Pages:
    """``[NB, H, bs, 2D]`` (a layer's vLLM CPU cache) -> ``(keys, values)``, each ``[NB*H, 1, bs, D]`` views of
    the same memory: page ``p = block * H + head`` (:func:`all_layer_pages` of the one layer). ValueError for
    another shape or a non-contiguous cache."""
    return all_layer_pages([kv_cache])


def _one_buffer(kv_caches: Sequence[torch.Tensor], layout: str) -> torch.Tensor:
    """Layer 0's cache after checking that the layers (each ``[NB, H, bs, 2D]``) are consecutive, equally shaped,
    contiguous views of one buffer, in layer order (how vLLM allocates one KV cache group); ValueError naming
    the layer otherwise. ``layout`` names the expected layout in the messages."""
    if not kv_caches:
        raise ValueError("vtoken: no layers")
    first = kv_caches[0]
    if first.dim() != 4 or first.shape[-1] % 2:
        raise ValueError(f"vtoken: kv_cache shape {tuple(first.shape)}; expected [blocks, kv_heads, block_size, "
                         f"2 * head_size] ({layout})")
    step = first.numel() * first.element_size()
    for i, c in enumerate(kv_caches):
        if c.shape != first.shape or c.dtype != first.dtype or not c.is_contiguous():
            raise ValueError(f"vtoken: layer {i}'s cache {tuple(c.shape)} {c.dtype}; expected {tuple(first.shape)} "
                             f"{first.dtype}, contiguous ({layout}, [NB, H, bs, 2D] as allocated)")
        if c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or \
                c.data_ptr() != first.data_ptr() + i * step:
            raise ValueError(f"vtoken: layer {i}'s cache is not the {i}-th consecutive view of one buffer; one page "
                             "space needs the layers in one allocation")
    return first


def all_layer_pages(kv_caches: Sequence[torch.Tensor]) -> Pages:
    """The layers' caches (each ``[NB, H, bs, 2D]``) -> one page space over all of them, ``[L*NB*H, 1, bs, D]``
    keys and values: page ``p = (layer * NB + block) * H + head``. ValueError unless the layers are consecutive,
    equally shaped, contiguous views of one buffer, in layer order (how vLLM's CPU worker allocates them)."""
    first = _one_buffer(kv_caches, "vLLM's CPU layout")
    nb, h, bs, d2 = first.shape
    whole = torch.as_strided(first, (len(kv_caches) * nb * h, 1, 2 * bs, d2 // 2),
                             (2 * bs * (d2 // 2), 2 * bs * (d2 // 2), d2 // 2, 1))
    keys, values = whole.chunk(2, dim=2)
    return keys, values


def hnd_layer_pages(kv_caches: Sequence[torch.Tensor]) -> Pages:
    """The GPU Triton backend's caches (vLLM 0.32: each layer's logical ``[NB, H, bs, 2D]``, a (head, slot)'s
    key then value in its last dim; physically HND, i.e. contiguous in that order) -> one page space over every
    layer, in the layout vLLM's Triton kernels take (``[pages, bs, 1, D]``: page, slot, head, dim), keys and
    values: page ``p = (layer * NB + block) * H + head``, its key of slot ``s`` at ``(p * bs + s) * 2D``, the
    value ``D`` further. ValueError unless the layers are consecutive, equally shaped, HND-contiguous views
    of one buffer (VLLM_KV_CACHE_LAYOUT=HND)."""
    first = _one_buffer(kv_caches, "vLLM's Triton-backend HND layout")
    nb, h, bs, d2 = first.shape
    d = d2 // 2
    pages = len(kv_caches) * nb * h
    keys = torch.as_strided(first, (pages, bs, 1, d), (bs * d2, d2, bs * d2, 1))
    values = torch.as_strided(first, (pages, bs, 1, d), (bs * d2, d2, bs * d2, 1),
                              storage_offset=first.storage_offset() + d)
    return keys, values


@dataclass(frozen=True)
class RowBatch:
    """One layer's step over rows: request ``r``'s ``q_r`` new tokens, its rows ``(r, 0..H-1)``.

    ``token_idx`` / ``head_idx`` ``[sum_r q_r * H]``: packed query ``i`` is ``query[token_idx[i], head group
    head_idx[i]]`` (request-major, then head, then token); ``query_start_loc [R*H + 1]``, ``seq_lens [R*H]``
    (each row's length after this step's tokens), ``block_table [R*H, P]`` (page ids, int32),
    ``slots [sum_r q_r * H]`` (where each packed token's key and value go: ``page * bs + offset``)."""

    num_kv_heads: int
    token_idx: torch.Tensor
    head_idx: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    max_seq_len: int

    def to(self, device: torch.device | str) -> RowBatch:
        """The same metadata with its tensors on ``device`` (the GPU path moves a step's batches once)."""
        return replace(self, **{f: getattr(self, f).to(device, non_blocking=True) for f in
                                ("token_idx", "head_idx", "query_start_loc", "seq_lens", "block_table", "slots")})


def build_row_batch(query_lens: Sequence[int], row_lens: np.ndarray,
                    row_pages: Sequence[Sequence[int]] | np.ndarray, block_size: int) -> RowBatch:
    """Metadata for one layer: ``query_lens [R]`` new tokens per request (its tokens are contiguous in the
    batch, request after request), ``row_lens [R, H]`` each row's length *including* those tokens,
    ``row_pages`` the pages that hold them: ``R*H`` lists (row ``r*H + h``) or an array ``[R*H, P]`` padded with
    ``-1`` (``PageTable.batch_tables``' form). Vectorized (numpy): no Python loop over rows. ValueError when a
    row is shorter than its new tokens or has too few pages."""
    lens = np.asarray(row_lens, dtype=np.int64)
    r_n, h_n = lens.shape
    rows = r_n * h_n
    q = np.asarray(query_lens, dtype=np.int64)
    if q.shape != (r_n,) or (q < 0).any():
        raise ValueError(f"vtoken: query_lens {q.tolist()}; expected {r_n} counts >= 0")
    if len(row_pages) != rows:
        raise ValueError(f"vtoken: {len(row_pages)} page lists; expected one per row ({r_n} x {h_n})")
    if (lens < q[:, None]).any():
        raise ValueError("vtoken: a row is shorter than its request's new tokens")
    if isinstance(row_pages, np.ndarray):
        table = row_pages.astype(np.int64, copy=False).reshape(rows, -1)
    else:
        width = max((len(p) for p in row_pages), default=0)
        table = np.full((rows, max(1, width)), -1, dtype=np.int64)
        for i, pg in enumerate(row_pages):
            table[i, :len(pg)] = pg
    have = (table >= 0).sum(axis=1)
    flat = lens.reshape(-1)
    need = -(-flat // block_size)
    if (have < need).any():
        i = int(np.argmax(have < need))
        raise ValueError(f"vtoken: row {i} holds {flat[i]} tokens in {have[i]} pages of {block_size}; "
                         f"expected >= {need[i]}")
    q_row = np.repeat(q, h_n)  # new tokens of every row
    row_of = np.repeat(np.arange(rows), q_row)  # the row of every packed token
    first = np.cumsum(q_row) - q_row
    within = np.arange(row_of.size) - first[row_of]
    starts = np.cumsum(q) - q  # a request's first token in the batch
    pos = flat[row_of] - q_row[row_of] + within
    slots = table[row_of, pos // block_size] * block_size + pos % block_size
    qsl = np.concatenate([[0], np.cumsum(q_row)])
    return RowBatch(num_kv_heads=h_n, token_idx=torch.from_numpy(starts[row_of // h_n] + within),
                    head_idx=torch.from_numpy(row_of % h_n),
                    query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
                    seq_lens=torch.from_numpy(flat.astype(np.int32)),
                    block_table=torch.from_numpy(np.maximum(table, 0).astype(np.int32)),
                    slots=torch.from_numpy(slots.astype(np.int64)), max_seq_len=int(flat.max(initial=0)))


def vllm_pages(pages: np.ndarray, num_layers: int, num_kv_heads: int, num_blocks: int) -> np.ndarray:
    """Page ids of :class:`~vtoken_runtime.page_table.PageTable` (block-major: ``b * (L * H) + l * H + h``, what
    its bookkeeping counts blocks by) -> the same pages in :func:`all_layer_pages`'s numbering
    (``(l * NB + b) * H + h``); ``-1`` (no page) stays ``-1``."""
    p = np.asarray(pages, dtype=np.int64)
    per_block = num_layers * num_kv_heads
    b, rem = p // per_block, p % per_block
    out = (rem // num_kv_heads * num_blocks + b) * num_kv_heads + rem % num_kv_heads
    if ((p >= 0) & (b >= num_blocks)).any():
        raise ValueError(f"vtoken: a page of block >= {num_blocks} (the cache's blocks)")
    return np.where(p < 0, -1, out)


def move_tokens(kv_caches: Sequence[torch.Tensor], src: np.ndarray, dst: np.ndarray, kmap: np.ndarray,
                vmap: np.ndarray) -> None:
    """Apply a :class:`~vtoken_runtime.page_table.PageTable` plan (``RowPlan.src`` -> ``dst``, page slots in its
    numbering) to vLLM's buffer: every token-head's K and V elements, at the offsets of the probed layout
    (``cpu_layout.probe_cpu_kv_layout``: ``kmap``, ``vmap [bs, D]`` inside one page), all sources read before
    any write (a plan's sources and destinations may share pages)."""
    if len(src) != len(dst):
        raise ValueError(f"vtoken: {len(src)} sources for {len(dst)} destinations")
    if not len(src):
        return
    from .cpu_layout import element_index

    all_layer_pages(kv_caches)  # validates: one buffer, layer order
    first = kv_caches[0]
    nb, h, bs, d2 = first.shape
    region = bs * d2  # elements of one page: K and V of bs positions
    flat = torch.as_strided(first, (len(kv_caches) * nb * h * region,), (1,))
    kv = np.concatenate([kmap, vmap], axis=1)  # [bs, 2D]: a token's K then V elements

    def elements(slots: np.ndarray) -> torch.Tensor:  # the copy engine's address rule, a page for a region
        s = np.asarray(slots, dtype=np.int64)
        page = vllm_pages(s // bs, len(kv_caches), h, nb)
        return torch.from_numpy(element_index(page, s % bs, 0, kv, 1, region)).reshape(-1)

    s_el, d_el = elements(src), elements(dst)
    flat[d_el] = flat[s_el].clone()


def move_hnd_tokens(pages: Pages, src: np.ndarray, dst: np.ndarray, num_layers: int, num_kv_heads: int,
                    num_blocks: int) -> None:
    """:func:`move_tokens` for :func:`hnd_layer_pages` (the GPU Triton backend's cache): a
    :class:`~vtoken_runtime.page_table.PageTable` plan's page slots (its numbering) -> ``(page, slot)`` of the
    page space, where a token-head's key and value are plain ``D`` elements (no ISA layout). All sources are
    read before any write (a plan's sources and destinations may share pages)."""
    if len(src) != len(dst):
        raise ValueError(f"vtoken: {len(src)} sources for {len(dst)} destinations")
    if not len(src):
        return
    keys, values = pages
    bs = int(keys.shape[1])
    dev = keys.device

    def where(slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        s = np.asarray(slots, dtype=np.int64)
        page = vllm_pages(s // bs, num_layers, num_kv_heads, num_blocks)
        return torch.from_numpy(page).to(dev), torch.from_numpy(s % bs).to(dev)

    (sp, so), (dp, do) = where(src), where(dst)
    k, v = keys[sp, so, 0].clone(), values[sp, so, 0].clone()  # [n, D] gathered first
    keys[dp, do, 0] = k
    values[dp, do, 0] = v


def _isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, "auto")


def write_rows(key: torch.Tensor, value: torch.Tensor, pages: Pages, batch: RowBatch, isa: str | None = None) -> None:
    """Write this step's keys and values ``[T, H, D]`` into their rows' pages (vLLM's own cache-write op);
    ``pages`` from :func:`one_head_pages` or :func:`all_layer_pages`; ``isa`` the layout the cache holds (the
    engine's ``layer.isa``; default: vLLM's automatic choice)."""
    from vllm import _custom_ops as ops

    keys, values = pages
    k = key[batch.token_idx, batch.head_idx].unsqueeze(1)  # [T*H, 1, D]
    v = value[batch.token_idx, batch.head_idx].unsqueeze(1)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, batch.slots, isa or _isa(keys.dtype, keys.shape[2], keys.shape[3]))


def row_attention(query: torch.Tensor, pages: Pages, batch: RowBatch, scale: float, isa: str | None = None
                  ) -> torch.Tensor:
    """``query [T, H_q, D]`` -> output ``[T, H_q, D]``: every query head attends to its row's keys (causal by
    row order) through vLLM's ``cpu_attention_with_kv_cache``, one sequence per row."""
    from vllm import _custom_ops as ops

    t_n, hq, d = query.shape
    h = batch.num_kv_heads
    if hq % h:
        raise ValueError(f"vtoken: {hq} query heads are not a multiple of {h} KV heads")
    g = hq // h
    keys, values = pages
    q4 = query.view(t_n, h, g, d)
    packed = q4[batch.token_idx, batch.head_idx].contiguous()  # [T*H, G, D]
    out = torch.empty_like(packed)
    rows = int(batch.seq_lens.shape[0])
    isa = isa or _isa(query.dtype, keys.shape[2], d)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=g, num_kv_heads=1, head_dim=d, seq_lens=batch.seq_lens, dtype=query.dtype,
        query_start_loc=batch.query_start_loc, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=packed, key_cache=keys, value_cache=values, output=out, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=batch.block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    result = torch.empty_like(q4)
    result[batch.token_idx, batch.head_idx] = out
    return result.view(t_n, hq, d)


def triton_write_rows(key: torch.Tensor, value: torch.Tensor, pages: Pages, batch: RowBatch) -> None:
    """:func:`write_rows` for the GPU Triton backend's pages (:func:`hnd_layer_pages`): vLLM's own
    ``triton_reshape_and_cache_flash`` with one head per page."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    keys, values = pages
    k = key[batch.token_idx, batch.head_idx].unsqueeze(1)  # [T*H, 1, D]
    v = value[batch.token_idx, batch.head_idx].unsqueeze(1)
    one = torch.ones((), dtype=torch.float32, device=key.device)
    triton_reshape_and_cache_flash(k, v, keys, values, batch.slots.to(key.device), "auto", one, one)


def triton_row_attention(query: torch.Tensor, pages: Pages, batch: RowBatch, scale: float) -> torch.Tensor:
    """:func:`row_attention` through the GPU Triton backend's kernel (vLLM's ``unified_attention``, the call
    ``TritonAttentionImpl.forward`` makes) over :func:`hnd_layer_pages`: one sequence per row, one KV head."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    t_n, hq, d = query.shape
    h = batch.num_kv_heads
    g = hq // h
    keys, values = pages
    dev = query.device
    q4 = query.view(t_n, h, g, d)
    packed = q4[batch.token_idx.to(dev), batch.head_idx.to(dev)].contiguous()  # [T*H, G, D]
    out = torch.empty_like(packed)
    qsl = batch.query_start_loc.to(dev)
    q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    max_q = int(q_lens.max()) if q_lens.numel() else 1
    unified_attention(packed, keys, values, out, qsl, max_q, batch.seq_lens.to(dev), batch.max_seq_len, scale, True,
                      (-1, -1),
                      batch.block_table.to(dev), 0, None, None, None)
    result = torch.empty_like(q4)
    result[batch.token_idx.to(dev), batch.head_idx.to(dev)] = out
    return result.view(t_n, hq, d)


__all__ = ["Pages", "RowBatch", "all_layer_pages", "build_row_batch", "hnd_layer_pages", "move_hnd_tokens",
           "move_tokens", "one_head_pages",
           "row_attention", "triton_row_attention", "triton_write_rows", "vllm_pages", "write_rows"]
