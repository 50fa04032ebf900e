"""The memory designs' block counts (``vtoken_bench.row_blocks.designs``) on hand-made kept counts."""

from __future__ import annotations

from vtoken_bench.row_blocks import designs


def test_designs_on_unequal_rows() -> None:
    # 2 layers x 2 heads, block 4: layer 0 rows 10 and 2 (pages 3 + 1), layer 1 rows 4 and 4 (1 + 1)
    d = designs([[10, 2], [4, 4]], k=5, block_size=4)
    assert d["blocks_uniform"] == 2  # 5 tokens a row
    assert d["blocks_max_row"] == 3  # the 10-token row sets the shared list
    assert d["blocks_layer_pool"] == 2  # layer 0: ceil(4 pages / 2 heads)
    assert d["blocks_global_pool"] == 2  # ceil(6 pages / 4 rows)
    assert (d["rows_live_min"], d["rows_live_max"], d["tokens_kept"]) == (2, 10, 20)


def test_retrieval_heads_in_one_layer_keep_its_pool_full() -> None:
    # DuoAttention-like: layer 0 all retrieval (16 each), layer 1 streaming (2 each), block 4
    d = designs([[16, 16], [2, 2]], k=9, block_size=4)
    assert d["blocks_layer_pool"] == 4 and d["blocks_global_pool"] == 3 and d["blocks_max_row"] == 4
