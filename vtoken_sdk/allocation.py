"""How a request's budget is shared among its (layer, KV head) rows: the counts step of unequal budgets.

Issue 38 (design: docs/decisions.md, decision 8). ``@vt.policy(allocation=...)`` selects with it (torch
reference and Triton kernels); the runtimes (HF session, vLLM) still keep decision 4's equal counts and refuse
a policy with unequal allocation by name until their per-row pages exist.

Selection with an allocation is two steps, both exact and deterministic:

1. :func:`allocate_counts` gives every row its count ``[B, L, H]``;
2. :func:`select_counts` keeps, in every row, its ``count`` largest composite keys: the contract of
   :mod:`vtoken_sdk.selection` (pins first, then scores, NaN as -inf, ties to the more recent token) with a
   per-row count instead of one count per request.

Allocations (``budget`` below is the uniform share of a row, ``k = min(length, budget)``):

* :class:`Uniform`: every row keeps ``max(k, pins of its request's fullest row)``, today's rule.
* :class:`AdaptiveLayer` (AdaKV; kvpress ``AdaKVPress(press, alpha_safeguard=floor)``): a layer keeps
  ``H x k`` tokens; each row first keeps its own top ``max(1, int(k x floor))`` (and all its pins), the rest
  of the layer's total goes to the highest keys of all its rows. Ties between rows go to the lower head::

      layer l, H = 2, k = 4, floor 0.25 -> 1 lifted per row, 8 kept in the layer
      row h0 keys  9 8 7 6 2 1      lifted: 9         kept: 9 8 7 6 2   (5)
      row h1 keys  5 4 3 0 0 0      lifted: 5         kept: 5 4 3       (3)
                   layer top 8 after the lifted two: 9 5 | 8 7 6 4 3 2

  Pins beyond the layer's total are all kept (the total grows; the overflow is reported as in the
  uniform case).
* :class:`LayerSchedule`: layer ``l`` keeps ``counts[l]`` per head, ``counts`` apportioned from ``weights``
  by largest remainder so that ``sum_l H x counts[l] == L x H x k`` exactly (a row never keeps more than
  the length; what a full layer cannot take is not moved to another).
* :class:`GlobalAllocation`: :class:`AdaptiveLayer` over all ``L x H`` rows of the request at once (ties to
  the lower row ``layer x H + head``).
* :class:`HeadClasses` (DuoAttention): listed retrieval rows keep everything, the others sinks + recent
  (and pins); no counts step (:func:`head_classes_keep`).
* :class:`Pyramid` (PyramidKV; kvpress ``PyramidKVPress(window_size=window, beta=beta)``): layer ``l``
  keeps ``round(max_num - l x (max_num - min_num) / (L - 1))`` per head, kvpress's ``get_layer_budget``
  with ``q_len x (1 - compression_ratio)`` read as the uniform share ``k`` (equal to kvpress's whenever
  ``q_len x (1 - r)`` is a whole number); where the pyramid does not fit (``not q_len >= max_num >= min_num
  >= window``) every layer keeps ``k``. Its total is the sum of its rounded layers (within ``L / 2`` of
  ``L x H x k``), not ``L x H x k`` exactly.

Shapes: ``scores [B, L, H, N]`` float, ``lengths [B]`` int, ``pins [B, L, H, N]`` bool (broadcastable),
``budget [B]`` int (tokens per row at uniform allocation).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from .selection import _INVALID, _PIN_KEY, _keep_top_k_sorted, ordered_key

__all__ = ["ALLOCATIONS", "AdaptiveLayer", "Allocation", "GlobalAllocation", "HeadClasses", "LayerSchedule", "Pyramid", "Uniform",
           "allocate_counts", "head_classes_keep",
           "composite_keys", "layer_counts", "pyramid_counts", "select_counts"]


class Uniform(BaseModel):
    """Every (layer, KV head) row keeps the same number of tokens (decision 4; the default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["uniform"] = "uniform"


class AdaptiveLayer(BaseModel):
    """AdaKV: a layer's budget goes to the highest scores of all its heads, each head keeping at least
    ``max(1, int(floor x budget))`` of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["adaptive_layer"] = "adaptive_layer"
    floor: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2


class LayerSchedule(BaseModel):
    """Per-layer counts in proportion to ``weights`` (one per layer, >= 0, not all 0), the same for every
    head of a layer; :meth:`linear` is PyramidKV's shape (more to the lower layers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["layer_schedule"] = "layer_schedule"
    weights: tuple[float, ...]

    @field_validator("weights")
    @classmethod
    def _check(cls, w: tuple[float, ...]) -> tuple[float, ...]:
        if not w:
            raise ValueError("got weights=(), expected one weight per layer")
        if any(not (x >= 0.0) or x == float("inf") for x in w):
            raise ValueError(f"got weights={w}, expected finite numbers >= 0 (e.g. LayerSchedule.linear(30))")
        if sum(w) <= 0.0:
            raise ValueError("got weights that are all 0, expected at least one > 0")
        return w

    @classmethod
    def linear(cls, num_layers: int, ratio: float = 20.0) -> LayerSchedule:
        """A straight line from ``ratio`` (layer 0) down to 1 (the last layer): PyramidKV's pyramid with
        ``beta = ratio`` in shape (kvpress's ``get_layer_budget`` also reserves its observation window)."""
        if num_layers < 1:
            raise ValueError(f"got num_layers={num_layers}, expected >= 1")
        if not ratio >= 1.0:
            raise ValueError(f"got ratio={ratio}, expected >= 1 (1: uniform)")
        if num_layers == 1:
            return cls(weights=(1.0,))
        return cls(weights=tuple(ratio - (ratio - 1.0) * i / (num_layers - 1) for i in range(num_layers)))


class Pyramid(BaseModel):
    """PyramidKV's per-layer schedule (kvpress ``PyramidKVPress``): more tokens to the lower layers, the
    slope set by ``beta`` (>= 1; larger: steeper), ``window`` the observation window kvpress reserves."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["pyramid"] = "pyramid"
    beta: Annotated[float, Field(ge=1.0)] = 20.0
    window: Annotated[int, Field(ge=0)] = 64


class GlobalAllocation(BaseModel):
    """AdaptiveLayer over every (layer, KV head) row of a request at once (KVzip-style global ranking): the
    request keeps ``L x H x budget`` tokens, each row first its own top ``max(1, int(floor x budget))``, the
    rest to the highest scores of all rows (ties to the lower row, ``layer x H + head``). Scores of
    different layers must compare on one scale for this to mean anything (attention probabilities do)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["global"] = "global"
    floor: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2


class HeadClasses(BaseModel):
    """DuoAttention-style static head classes: the ``retrieval`` (layer, KV head) rows keep every token, every
    other row is a *streaming* row that keeps its ``sinks`` first and ``recent`` last positions (and its
    pins). Scores and the budget do not choose anything here; a request keeps what the classes give.
    ``num_layers`` / ``num_kv_heads``: the model the map was made for (rows outside a batch are ignored)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["head_classes"] = "head_classes"
    retrieval: tuple[tuple[int, int], ...]
    sinks: Annotated[int, Field(ge=0)] = 4
    recent: Annotated[int, Field(ge=0)] = 64
    num_layers: Annotated[int, Field(ge=1)] | None = None
    num_kv_heads: Annotated[int, Field(ge=1)] | None = None

    @field_validator("retrieval")
    @classmethod
    def _rows(cls, rows: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if any(li < 0 or hi < 0 for li, hi in rows):
            raise ValueError(f"got retrieval={rows}, expected (layer, kv_head) pairs >= 0")
        if len(set(rows)) != len(rows):
            raise ValueError("got a (layer, kv_head) pair twice in retrieval")
        return tuple(sorted(rows))

    def model_post_init(self, _: object) -> None:
        bad = [(li, hi) for li, hi in self.retrieval if (self.num_layers is not None and li >= self.num_layers)
               or (self.num_kv_heads is not None and hi >= self.num_kv_heads)]
        if bad:
            raise ValueError(f"got retrieval rows {bad} outside num_layers={self.num_layers}, "
                             f"num_kv_heads={self.num_kv_heads}")


Allocation = Uniform | AdaptiveLayer | LayerSchedule | Pyramid | GlobalAllocation | HeadClasses
ALLOCATIONS: tuple[type[BaseModel], ...] = get_args(Allocation)  # the models, for isinstance and messages


def head_classes_keep(alloc: HeadClasses, lengths: Tensor, positions: Tensor, seq_lens: Tensor, pins: Tensor,
                      shape: tuple[int, int, int, int], layer_offset: int = 0) -> Tensor:
    """Keep mask ``[B, L, H, N]`` of :class:`HeadClasses`: retrieval rows keep every valid token, streaming
    rows their pins and the positions ``< sinks`` or ``>= seq_len - recent``. ``positions [B, L|1, H|1, N]``
    true positions, ``seq_lens [B]``; ``layer_offset``: the batch's first layer (layer chunks)."""
    b, nl, h, n = shape
    dev = lengths.device
    valid = torch.arange(n, device=dev) < lengths.to(torch.int64)[:, None, None, None]
    ret = torch.zeros(nl, h, dtype=torch.bool, device=dev)
    for li, hi in alloc.retrieval:
        if layer_offset <= li < layer_offset + nl and hi < h:
            ret[li - layer_offset, hi] = True
    pos = positions.to(torch.int64)
    window = (pos < alloc.sinks) | (pos >= seq_lens.to(torch.int64)[:, None, None, None] - alloc.recent)
    return (ret[None, :, :, None] | pins | window).expand(b, nl, h, n) & valid


def pyramid_counts(pyr: Pyramid, num_layers: int, length: int, k: int) -> list[int]:
    """Per-layer counts of :class:`Pyramid` for a row of ``length`` tokens and a uniform share ``k``
    (kvpress 0.5.5 ``PyramidKVPress.get_layer_budget``, ``q_len x (1 - r)`` read as ``k``)."""
    w = pyr.window
    min_num = k / pyr.beta
    max_num = k * 2 - min_num
    if max_num >= length - w:
        max_num = length - w
        min_num = k * 2 - max_num
    if not (length >= max_num >= min_num >= w):
        return [max(1, k) if length else 0] * num_layers
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(max_num - i * steps) for i in range(num_layers)]


def composite_keys(scores: Tensor, lengths: Tensor, pins: Tensor) -> Tensor:
    """int64 keys ``[..., N]`` of the selection contract: larger = keep, unique within a row, pins above
    every score, padding (``n >= lengths[b]``) below everything. ``scores [B, ..., N]``."""
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device, dtype=torch.int64)
    shape = (scores.shape[0],) + (1,) * (scores.dim() - 1)
    valid = idx < lengths.to(torch.int64).view(shape)
    comp = ordered_key(scores).to(torch.int64) * 2**32 + idx
    comp = torch.where(pins.expand_as(scores) & valid, _PIN_KEY + idx, comp)
    return torch.where(valid, comp, torch.full_like(comp, _INVALID))


def layer_counts(schedule: LayerSchedule, num_layers: int, k: int) -> list[int]:
    """Per-layer counts of ``schedule`` for a uniform share ``k`` (each <= ``k``'s length cap is the
    caller's): ``sum == num_layers x k`` exactly, by largest remainder (ties to the lower layer)."""
    w = schedule.weights
    if len(w) != num_layers:
        raise ValueError(f"got {len(w)} weights, expected one per layer ({num_layers})")
    total = num_layers * k
    s = sum(w)
    exact = [total * x / s for x in w]
    base = [int(e) for e in exact]
    left = total - sum(base)
    order = sorted(range(num_layers), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return base


def allocate_counts(scores: Tensor, lengths: Tensor, pins: Tensor, budget: Tensor,
                    allocation: Allocation) -> tuple[Tensor, Tensor]:
    """``(counts [B, L, H] int64, pin_overflow [B] int64)``: ``pin_overflow`` is how many tokens the request
    keeps beyond its total budget ``L x H x min(length, budget)`` because of its pins (module doc)."""
    if scores.dim() != 4:
        raise ValueError(f"got scores of shape {tuple(scores.shape)}, expected [B, L, H, N]")
    b, nl, h, n = scores.shape
    lengths = lengths.to(torch.int64)
    pins = pins.expand(b, nl, h, n)
    idx = torch.arange(n, device=scores.device)
    valid = idx < lengths[:, None, None, None]
    npins = (pins & valid).sum(-1)  # [B, L, H]
    k = torch.minimum(lengths, budget.to(torch.int64).clamp(min=0))  # [B]
    if isinstance(allocation, Uniform):
        kk = torch.maximum(k, npins.flatten(1).amax(1) if nl * h else k)
        counts = torch.minimum(kk, lengths)[:, None, None].expand(b, nl, h).clone()
        return counts, nl * h * (kk - k).clamp(min=0)
    if isinstance(allocation, (LayerSchedule, Pyramid)):
        counts = torch.empty(b, nl, h, dtype=torch.int64, device=scores.device)
        base = torch.empty(b, dtype=torch.int64)
        for i in range(b):
            ki, li = int(k[i]), int(lengths[i])
            per_l = (layer_counts(allocation, nl, ki) if isinstance(allocation, LayerSchedule)
                     else pyramid_counts(allocation, nl, li, ki))
            per = torch.tensor(per_l, dtype=torch.int64, device=scores.device)
            base[i] = h * int(per.clamp(max=li).sum())
            counts[i] = torch.minimum(torch.maximum(per[:, None], npins[i]), lengths[i])
        over = (counts.sum((1, 2)).cpu() - base).clamp(min=0).to(scores.device)
        return counts, over
    if isinstance(allocation, HeadClasses):
        raise TypeError("HeadClasses' kept sets come from positions, not counts: use head_classes_keep")
    if isinstance(allocation, GlobalAllocation):  # one "layer" of all L x H rows
        counts, over = allocate_counts(scores.reshape(b, 1, nl * h, n), lengths, pins.reshape(b, 1, nl * h, n),
                                       budget, AdaptiveLayer(floor=allocation.floor))
        return counts.reshape(b, nl, h), over
    if isinstance(allocation, AdaptiveLayer):
        comp = composite_keys(scores, lengths, pins)  # [B, L, H, N]
        safe = (k.to(torch.float64) * allocation.floor).to(torch.int64)
        safe = torch.where((k > 0) & (allocation.floor > 0), safe.clamp(min=1), torch.zeros_like(safe))
        lifted_n = torch.minimum(torch.maximum(safe[:, None, None], npins), lengths[:, None, None])  # [B, L, H]
        # rank of every entry inside its row, by composite key (pins first): the top lifted_n are lifted
        order = torch.argsort(comp, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, idx.to(torch.int64).expand(b, nl, h, n).contiguous())
        lifted = (rank < lifted_n[..., None]) & valid
        total = torch.maximum(h * k[:, None], lifted_n.sum(-1))  # [B, L]
        # the layer's order: lifted first, then the composite key, then the lower head
        flat_comp = comp.reshape(b, nl, h * n)
        flat_lift = lifted.reshape(b, nl, h * n)
        o1 = torch.argsort(flat_comp, dim=-1, descending=True, stable=True)  # ties: the lower head first
        o2 = torch.argsort(torch.gather(flat_lift, -1, o1).to(torch.int8), dim=-1, descending=True, stable=True)
        order_l = torch.gather(o1, -1, o2)  # [B, L, H*N] flat indices, best first
        taken = torch.arange(h * n, device=scores.device) < total[..., None]
        rows = torch.div(order_l, n, rounding_mode="floor")
        counts = torch.zeros(b, nl, h, dtype=torch.int64, device=scores.device)
        counts.scatter_add_(-1, rows, taken.to(torch.int64))
        return counts, (total.sum(-1) - nl * h * k).clamp(min=0)
    raise TypeError(f"got allocation {allocation!r}, expected Uniform(), AdaptiveLayer(...), LayerSchedule(...), "
                    "Pyramid(...) or GlobalAllocation(...)")


def select_counts(scores: Tensor, lengths: Tensor, pins: Tensor, counts: Tensor) -> Tensor:
    """Keep mask ``[B, L, H, N]``: in every row its ``counts[b, l, h]`` largest composite keys (pins first).
    A count above a row's length keeps the whole row; padding is never kept."""
    b, nl, h, n = scores.shape
    comp = composite_keys(scores, lengths, pins.expand(b, nl, h, n))
    keep = _keep_top_k_sorted(comp.reshape(b * nl * h, 1, n), counts.reshape(-1).to(torch.int64))
    valid = torch.arange(n, device=scores.device) < lengths.to(torch.int64)[:, None, None, None]
    return keep.reshape(b, nl, h, n) & valid
