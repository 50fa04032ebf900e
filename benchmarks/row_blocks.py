"""What each memory design would hold for unequal budgets: blocks per request from the SDK's kept sets.

Issue 38's runtime is not built; this measures, before building it, the blocks a request would hold under
each design (docs/decisions.md, decision 8), from the kept sets of the shipped policies at compression 0.5
after one uncompressed prefill of a passkey prompt (``kvpress_check.keep_sets_unequal``: the HF session's
statistics, the policy's keep mask; kvpress's query window for ExpectedAttention). ``block_size`` tokens
per block, ``live[l][h]`` the kept count of row (l, h), ``pages(x) = ceil(x / block_size)``:

    blocks_uniform     pages(k), k = int(n / 2): today's design, every row k tokens
    blocks_max_row     pages(max live): one block list per request (the shared list, rows padded)
    blocks_layer_pool  max over layers of ceil(sum_h pages(live[l][h]) / H): one-head pages pooled per
                       layer (a block frees when its pages of every head are free; layers apart)
    blocks_global_pool ceil(sum over all rows of pages(live) / (L x H)): pages of every (layer, head)
                       interchangeable, which needs one page space shared by every layer's cache (with a
                       cache tensor per layer, block index b is a page of every layer: a layer's pages can
                       only pack into the lowest indices, which is blocks_layer_pool)

    python -m vtoken_bench.row_blocks [--length 1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

POLICIES = ("snapkv", "ada_snapkv", "pyramidkv", "expected_attention", "ada_expected_attention", "snap_observed",
            "ada_snap_observed", "duo_attention")


def designs(live: list[list[int]], k: int, block_size: int) -> dict[str, int]:
    """The blocks each design holds for kept counts ``live[l][h]`` (module doc; the runtime's own bounds:
    ``vtoken_runtime.page_table.design_bounds``)."""
    from vtoken_runtime.page_table import design_bounds

    b = design_bounds(np.asarray(live, dtype=np.int64), block_size)
    flat = [x for row in live for x in row]
    return {"blocks_uniform": math.ceil(k / block_size), "blocks_max_row": b["max_row"],
            "blocks_layer_pool": b["per_layer"], "blocks_global_pool": b["pages"],
            "rows_live_min": min(flat), "rows_live_max": max(flat), "tokens_kept": sum(flat)}


def run(length: int = 1024, block_size: int = 16, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    from vtoken_bench.essays import build_passkey
    from vtoken_bench.kvpress_check import keep_sets_unequal, vtoken_policy
    from vtoken_bench.models import load_smollm2

    model, tok = load_smollm2()
    p = build_passkey(tok, length, 0.5, 48213)
    n, rows = len(p.context_ids), []
    k = n // 2
    for name in policies:
        press = "expected_attention" if "expected_attention" in name else name
        kept = keep_sets_unequal(model, vtoken_policy(name, press, n), p.context_ids, k)
        live = [[len(h) for h in layer] for layer in kept]
        rows.append({"policy": name, "context": n, "block_size": block_size, **designs(live, k, block_size)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = run(a.length, a.block_size)
    for r in rows:
        sys.stdout.write(json.dumps(r) + "\n")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
