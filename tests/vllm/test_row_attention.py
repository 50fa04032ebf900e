"""vLLM's own CPU attention kernel over per-(request, KV head) rows of one-head pages
(``vtoken_runtime.vllm_plugin.row_attention``): exact against dense attention over each row's keys, pages of any
block, any head slot and (one page space) any layer, writes that touch only the step's slots, equal to vLLM's
stock call when every row of a request has the same length and the standard block layout, and a real engine's
caches form one page space."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vtoken_runtime.paged_attention import dense_attention  # noqa: E402
from vtoken_runtime.vllm_plugin.row_attention import (  # noqa: E402
    all_layer_pages,
    build_row_batch,
    move_tokens,
    one_head_pages,
    row_attention,
    vllm_pages,
    write_rows,
)

pytestmark = pytest.mark.vllm

BS, D = 32, 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n_q, G, D] against a row's k, v [n, D] (the runtime's ground truth, ``dense_attention``): the row's
    new tokens are its last ``n_q`` positions, so query i sees keys <= n - n_q + i."""
    n, nq = k.shape[0], q.shape[0]
    return dense_attention(q.float(), k[None], v[None], torch.arange(n - nq, n), torch.arange(n)[None], scale)


def _case(seed: int, r_n: int, h_n: int, g: int, dtype: torch.dtype, lens: np.ndarray, q: np.ndarray,
          nb: int, layers: int = 1) -> tuple[float, bool]:
    """Fill rows (history through vLLM's cache-write op, the step's tokens through ``write_rows``), run
    ``row_attention``; return (max error vs dense, every slot outside the rows unchanged). ``layers > 1``: the
    rows' pages come from one page space over ``layers`` caches allocated as vLLM's CPU worker does."""
    from vllm import _custom_ops as ops

    from vtoken_runtime.vllm_plugin.row_attention import _isa

    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(layers, nb, h_n, BS, 2 * D, generator=gen).to(dtype)  # one buffer, layer-major
    before = cache.clone()
    space = all_layer_pages(list(cache.unbind(0))) if layers > 1 else one_head_pages(cache[0])
    keys, values = space
    perm = torch.randperm(layers * nb * h_n, generator=gen).tolist()
    pages = []
    for n in lens.reshape(-1):
        pages.append([perm.pop() for _ in range(-(-int(n) // BS))])
    kk = [torch.randn(int(n), D, generator=gen).to(dtype) for n in lens.reshape(-1)]
    vv = [torch.randn(int(n), D, generator=gen).to(dtype) for n in lens.reshape(-1)]
    isa = _isa(dtype, BS, D)
    for i, n in enumerate(lens.reshape(-1)):  # history: all but the step's tokens
        hist = int(n) - int(q[i // h_n])
        if hist:
            pos = np.arange(hist)
            slots = torch.from_numpy(np.asarray(pages[i])[pos // BS] * BS + pos % BS)
            ops.cpu_attn_reshape_and_cache(kk[i][:hist, None], vv[i][:hist, None], keys, values, slots, isa)
    batch = build_row_batch(q.tolist(), lens, pages, BS)
    t_n = int(q.sum())
    key = torch.zeros(t_n, h_n, D, dtype=dtype)
    value = torch.zeros(t_n, h_n, D, dtype=dtype)
    starts = np.concatenate([[0], np.cumsum(q)[:-1]])
    for r in range(r_n):
        for h in range(h_n):
            n, qr = int(lens[r, h]), int(q[r])
            key[starts[r]:starts[r] + qr, h] = kk[r * h_n + h][n - qr:]
            value[starts[r]:starts[r] + qr, h] = vv[r * h_n + h][n - qr:]
    write_rows(key, value, space, batch)
    query = torch.randn(t_n, h_n * g, D, generator=gen).to(dtype)
    scale = D ** -0.5
    out = row_attention(query, space, batch, scale)
    err = 0.0
    for r in range(r_n):
        for h in range(h_n):
            qr = int(q[r])
            if not qr:
                continue
            sl = slice(starts[r], starts[r] + qr)
            ref = _dense(query[sl, h * g:(h + 1) * g], kk[r * h_n + h], vv[r * h_n + h], scale)
            err = max(err, (out[sl, h * g:(h + 1) * g].float() - ref).abs().max().item())
    used = set(p for ps in pages for p in ps)
    k_pages, v_pages = all_layer_pages(list(before.unbind(0))) if layers > 1 else one_head_pages(before[0])
    untouched = all(torch.equal(keys[p], k_pages[p]) and torch.equal(values[p], v_pages[p])
                    for p in range(layers * nb * h_n) if p not in used)
    return err, untouched


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), r_n=st.integers(1, 4), h_n=st.integers(1, 3), g=st.integers(1, 3),
       data=st.data())
def test_rows_of_different_lengths_equal_dense_attention_over_each_rows_keys(seed: int, r_n: int, h_n: int, g: int,
                                                                            data: st.DataObject) -> None:
    q = np.array(data.draw(st.lists(st.integers(0, 4), min_size=r_n, max_size=r_n)), dtype=np.int64)
    lens = np.array([[data.draw(st.integers(max(1, int(q[r])), 150)) for _ in range(h_n)] for r in range(r_n)],
                    dtype=np.int64)
    nb = int(sum(-(-int(n) // BS) for n in lens.reshape(-1))) // h_n + 2
    err, untouched = _case(seed, r_n, h_n, g, torch.float32, lens, q, nb)
    assert err < TOL[torch.float32]
    assert untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_chunk_rows_in_one_call(dtype: torch.dtype) -> None:
    """A decode request (one token), a prefill chunk (several) and a row far longer than its sibling heads."""
    lens = np.array([[77, 20, 5], [130, 3, 64]], dtype=np.int64)
    err, untouched = _case(1, 2, 3, 2, dtype, lens, np.array([1, 3]), nb=12)
    assert err < TOL[dtype]
    assert untouched


def test_rows_use_pages_of_any_layer_in_one_page_space() -> None:
    """Three layers in one buffer: rows take pages from all of them (the page of layer ``l``, block ``b``, head
    ``h`` is ``(l * NB + b) * H + h``), and a page number addresses exactly that layer's memory."""
    lens = np.array([[90, 7], [12, 140]], dtype=np.int64)
    err, untouched = _case(5, 2, 2, 2, torch.float32, lens, np.array([2, 1]), nb=3, layers=3)
    assert err < TOL[torch.float32]
    assert untouched
    cache = torch.zeros(3, 4, 2, BS, 2 * D)
    keys, values = all_layer_pages(list(cache.unbind(0)))
    keys[(2 * 4 + 1) * 2 + 1].fill_(1.0)  # layer 2, block 1, head 1: the page's first half (keys)
    values[(1 * 4 + 3) * 2 + 0].fill_(2.0)  # layer 1, block 3, head 0: its second half (values)
    assert cache[2, 1, 1].reshape(-1)[:BS * D].eq(1).all() and cache[1, 3, 0].reshape(-1)[BS * D:].eq(2).all()
    assert cache.ne(0).sum().item() == 2 * BS * D


def test_a_real_engines_caches_are_one_page_space(tmp_path) -> None:
    """vLLM's CPU worker allocates every layer's cache in one buffer, in layer order (what one page space for
    all layers relies on); separate tensors are refused."""
    from tests.vllm._vllm_helpers import engine, make_tiny_model, runner

    llm = engine(make_tiny_model(tmp_path / "tiny"), None, blocks=20)
    caches = runner(llm).kv_caches
    keys, _ = all_layer_pages(caches)
    nb, h = caches[0].shape[:2]
    assert keys.shape[0] == len(caches) * nb * h
    assert keys[nb * h].data_ptr() == caches[1].data_ptr()  # the first page of layer 1
    with pytest.raises(ValueError, match="one allocation"):
        all_layer_pages([torch.zeros(4, 2, BS, 2 * D), torch.zeros(4, 2, BS, 2 * D)])
    del llm


def test_equal_rows_on_the_standard_block_table_equal_vllms_stock_call() -> None:
    """Every row of a request as long as the request and page = block * H + head: the per-row call gives what
    vLLM's own call over the layer's block table gives, on the same memory."""
    from vllm import _custom_ops as ops

    from vtoken_runtime.vllm_plugin.row_attention import _isa

    h_n, g, nb = 2, 3, 8
    seq = [70, 33]
    q = np.array([1, 2])
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(nb, h_n, BS, 2 * D)
    kc, vc = cache.view(nb, h_n, 2 * BS, D).chunk(2, dim=2)
    blocks = [[0, 5, 2], [7, 1]]
    isa = _isa(torch.float32, BS, D)
    for r, n in enumerate(seq):
        pos = np.arange(n)
        slots = torch.from_numpy(np.asarray(blocks[r])[pos // BS] * BS + pos % BS)
        ops.cpu_attn_reshape_and_cache(torch.randn(n, h_n, D, generator=gen), torch.randn(n, h_n, D, generator=gen),
                                       kc, vc, slots, isa)
    query = torch.randn(int(q.sum()), h_n * g, D, generator=gen)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    table = torch.tensor([[0, 5, 2], [7, 1, 0]], dtype=torch.int32)
    stock = torch.empty_like(query)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=2, num_heads=h_n * g, num_kv_heads=h_n, head_dim=D,
                                               seq_lens=seq_t, dtype=torch.float32, query_start_loc=qsl, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=stock, query_start_loc=qsl,
                                    seq_lens=seq_t, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                                    block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    pages = [[b * h_n + h for b in blocks[r]] for r in range(2) for h in range(h_n)]
    lens = np.array([[seq[0]] * h_n, [seq[1]] * h_n])
    ours = row_attention(query, one_head_pages(cache), build_row_batch(q.tolist(), lens, pages, BS), D ** -0.5)
    assert (ours - stock).abs().max().item() < 1e-5


def test_bad_metadata_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="row 1 holds 40 tokens in 1 pages of 32"):
        build_row_batch([1], np.array([[10, 40]]), [[0], [1]], BS)
    with pytest.raises(ValueError, match="shorter than its request's new tokens"):
        build_row_batch([5], np.array([[10, 4]]), [[0], [1]], BS)
    with pytest.raises(ValueError, match="one per row"):
        build_row_batch([1], np.array([[10, 4]]), [[0]], BS)
    with pytest.raises(ValueError, match="vLLM's CPU layout"):
        one_head_pages(torch.zeros(4, 2, 32, 63))


@pytest.mark.parametrize("evict", [False, True])
def test_a_page_tables_rows_attend_through_vllms_kernel_layer_by_layer(evict: bool) -> None:
    """The HF side's ``PageTable`` lays out two requests with unequal rows over shared blocks (adopt, then a
    decode step's ``reserve``); its page ids, renumbered for vLLM's buffer (``vllm_pages``), address exactly the
    memory the bookkeeping says, and every layer's attention equals dense attention over each row's tokens.
    ``evict`` (before the decode step): each row keeps a random subset and the plan's moves (``move_tokens``, the probed layout) are
    applied to vLLM's buffer; the blocks it frees are written with garbage, which no row may read."""
    from vllm import _custom_ops as ops

    from vtoken_runtime.page_table import PageTable
    from vtoken_runtime.vllm_plugin.row_attention import _isa

    L, H, g, nb = 3, 2, 2, 10
    rng = np.random.default_rng(7)
    table = PageTable(L, H, BS, max_requests=4, debug=True)
    cache = torch.zeros(L, nb, H, BS, 2 * D)
    space = all_layer_pages(list(cache.unbind(0)))
    kv: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (req, row, position) -> (k, v)
    free_blocks = list(rng.permutation(nb))
    isa = _isa(torch.float32, BS, D)
    logical = {0: 150, 1: 90}
    for req, n in logical.items():
        table.add(req, np.zeros(0, np.int64))
        rows = [np.sort(rng.choice(n, size=int(rng.integers(1, n)), replace=False)) for _ in range(L * H)]
        blocks = [int(free_blocks.pop()) for _ in range(-(-sum(-(-r.size // BS) for r in rows) // (L * H)))]
        slots, spare = table.adopt(req, rows, blocks, n)
        free_blocks += spare
        for r, (pos, sl) in enumerate(zip(rows, slots, strict=True)):
            k, v = torch.randn(pos.size, D), torch.randn(pos.size, D)
            for i, p in enumerate(pos):
                kv[req, r, int(p)] = (k[i], v[i])
            pg = vllm_pages(np.asarray(sl) // BS, L, H, nb)
            ops.cpu_attn_reshape_and_cache(k[:, None], v[:, None], *space, torch.from_numpy(pg * BS + np.asarray(sl) % BS),
                                           isa)
    if evict:
        from vtoken_runtime.vllm_plugin.cpu_layout import probe_cpu_kv_layout

        kmap, vmap = probe_cpu_kv_layout(isa, torch.float32, BS, D)
        freed_total = 0
        for req in logical:
            keep = [rng.random(p.size) < 0.4 for p in table.get(req).pos]
            keep = [k if k.any() or not k.size else np.eye(1, k.size, dtype=bool)[0] for k in keep]
            plan = table.evict(req, keep)
            move_tokens(list(cache.unbind(0)), plan.src, plan.dst, kmap, vmap)
            for b in plan.freed:
                cache[:, b].fill_(1e4)  # a freed block is reused by someone else
            free_blocks += plan.freed
            freed_total += len(plan.freed)
        assert freed_total > 0
    for req in logical:  # one decode step: every row appends the next position
        new = [int(free_blocks.pop()) for _ in range(table.blocks_needed(req, 1))]
        table.reserve(req, 1, new)
    scale = D ** -0.5
    for layer in range(L):
        pt, lens = table.batch_tables([0, 1], slice(layer * H, (layer + 1) * H))
        pages = vllm_pages(pt, L, H, nb).reshape(2 * H, -1)  # the padded array form (-1 past a row's pages)
        batch = build_row_batch([1, 1], lens, pages, BS)
        key, value = torch.randn(2, H, D), torch.randn(2, H, D)
        write_rows(key, value, space, batch)
        for b, req in enumerate(logical):
            for h in range(H):
                kv[req, layer * H + h, logical[req]] = (key[b, h], value[b, h])
        query = torch.randn(2, H * g, D)
        out = row_attention(query, space, batch, scale)
        for b, req in enumerate(logical):
            for h in range(H):
                r = layer * H + h
                pos = table.get(req).pos[r]
                k = torch.stack([kv[req, r, int(p)][0] for p in pos])
                v = torch.stack([kv[req, r, int(p)][1] for p in pos])
                ref = _dense(query[b:b + 1, h * g:(h + 1) * g], k, v, scale)
                assert (out[b:b + 1, h * g:(h + 1) * g] - ref).abs().max().item() < 1e-5


def test_page_ids_renumber_between_the_page_table_and_vllms_buffer() -> None:
    L, H, nb = 3, 2, 5
    p = np.arange(nb * L * H)
    q = vllm_pages(p, L, H, nb)
    assert sorted(q.tolist()) == p.tolist()  # a bijection over the same pages
    b, rem = p // (L * H), p % (L * H)
    assert (q == ((rem // H) * nb + b) * H + rem % H).all()
    assert vllm_pages(np.array([-1, 3]), L, H, nb).tolist() == [-1, 11]  # page 3: block 0, layer 1, head 1
    with pytest.raises(ValueError, match="block >= 5"):
        vllm_pages(np.array([nb * L * H]), L, H, nb)
