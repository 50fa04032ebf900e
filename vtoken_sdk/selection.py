"""The selection contract, identical in every backend (bit-exact).

Given scores ``[B, R, N]`` (R rows: layers x KV heads, or 1 at request granularity),
per-request ``lengths [B]``, pins ``[B, R, N]`` and budgets ``[B]``:

1. tokens at ``n >= lengths[b]`` (padding) are never kept;
2. every request keeps ``k[b] = min(lengths[b], max(budget[b], max_r pins[b, r]))``
   tokens in *every* row (one cache length per request, docs/decisions.md decision 4);
   when pins exceed the budget all pins are kept and the overflow is reported;
3. pinned tokens are always kept, then the highest scores among the rest;
4. NaN ranks as -inf, -0.0 equals +0.0, ties go to the more recent token
   (the larger index along N, which is ascending position).

Ranking uses an order-preserving integer key, the same one the Triton kernels use::

    bits = float32 bits of (score + 0.0)            # -0.0 -> +0.0
    key  = bits if bits >= 0 else bits ^ 0x7FFFFFFF  # int32, monotone in the float
    composite = key * 2**32 + n                      # unique per token; larger = keep
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_PIN_KEY = (2**31 - 1) * 2**32
_INVALID = -(2**63)


def ordered_key(scores: Tensor) -> Tensor:
    """int32 keys with ``key(a) < key(b)`` iff ``a < b`` (NaN -> -inf, -0.0 -> +0.0)."""
    s = scores.to(torch.float32) + 0.0
    s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
    bits = s.contiguous().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def keep_counts(lengths: Tensor, pins: Tensor, budget: Tensor) -> tuple[Tensor, Tensor]:
    """``(k [B], pin_overflow [B])``: tokens kept per row and how far pins exceed the budget."""
    n = pins.shape[-1]
    valid = torch.arange(n, device=pins.device) < lengths[:, None, None]
    npins = (pins & valid).sum(-1).amax(-1) if pins.shape[1] > 0 else torch.zeros_like(lengths)
    budget = budget.to(lengths.dtype).clamp(min=0)
    k = torch.minimum(lengths, torch.maximum(budget, npins))
    return k, (npins - budget).clamp(min=0)


def select(scores: Tensor, lengths: Tensor, pins: Tensor, budget: Tensor) -> Tensor:
    """Keep mask ``[B, R, N]`` bool under the selection contract (module doc).

    scores ``[B, R, N]`` float; lengths ``[B]`` int; pins ``[B, R, N]`` bool
    (broadcastable); budget ``[B]`` int.
    """
    b, r, n = scores.shape
    device = scores.device
    lengths = lengths.to(torch.int64)
    pins = pins.expand(b, r, n)
    idx = torch.arange(n, device=device, dtype=torch.int64)
    valid = idx < lengths[:, None, None]
    pins = pins & valid
    k, _ = keep_counts(lengths, pins, budget.to(torch.int64))
    comp = ordered_key(scores).to(torch.int64) * 2**32 + idx
    comp = torch.where(pins, _PIN_KEY + idx, comp)
    comp = torch.where(valid, comp, torch.full_like(comp, _INVALID))
    if device.type == "cpu":
        return _keep_top_k_threshold(comp, k) & valid
    return _keep_top_k_sorted(comp, k) & valid


def _keep_top_k_sorted(comp: Tensor, k: Tensor) -> Tensor:
    """``[B, R, N]`` True at the ``k[b]`` largest composite keys of every row (a full sort; no host sync)."""
    b, r, n = comp.shape
    order = torch.argsort(comp, dim=-1, descending=True)
    rank = torch.empty_like(order)
    idx = torch.arange(n, device=comp.device, dtype=torch.int64)
    rank.scatter_(-1, order, idx.expand(b, r, n).contiguous())
    return rank < k[:, None, None]


def _keep_top_k_threshold(comp: Tensor, k: Tensor) -> Tensor:
    """Same mask as :func:`_keep_top_k_sorted` (CPU tensors) by selection instead of a sort: the composite
    keys are unique per row, so the ``k``-th largest is a threshold that keeps exactly ``k`` tokens (one
    ``numpy.partition`` per distinct ``k``: ~9x faster than the sort at 90 rows x 800 tokens)."""
    b, r, n = comp.shape
    keep = torch.zeros(comp.shape, dtype=torch.bool)
    ks = k.tolist()
    for kv in sorted(set(ks)):
        if kv <= 0:
            continue
        rows = [i for i, x in enumerate(ks) if x == kv]
        c = comp[rows]
        thr = np.partition(c.numpy(), n - kv, axis=-1)[..., n - kv: n - kv + 1]  # the kv-th largest per row
        keep[rows] = c >= torch.from_numpy(thr)
    return keep
