"""The input of a compiled policy: a batch of per-token statistics in logical order.

Layout (all on one device)::

    stats[name]  [B, L, H, N] float32   stored statistics (policy.stored_reads)
    positions    [B, L|1, H|1, N] int64 true positions, ascending along N in [0, lengths[b])
    lengths      [B] int64             valid (live) tokens of each request, same in every row
    seq_lens     [B] int64             tokens the request has processed (logical length)
    pinned       [B, L|1, H|1, N] bool  explicit per-request pins (spans), optional
    budget       [B] int64             overrides Budget.resolve(seq_len) when given

``L`` layers x ``H`` KV heads are the *rows* of a request. Entries at ``n >= lengths[b]``
are padding: never read by pooling, never kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class StatsBatch:
    stats: Mapping[str, Tensor]
    lengths: Tensor
    positions: Tensor
    seq_lens: Tensor
    pinned: Tensor | None = None
    budget: Tensor | None = None
    layer_offset: int = 0
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, L, H, N)``."""
        shapes = [t.shape for t in self.stats.values()] + [self.positions.shape]
        b = len(self.lengths)
        l_ = max(s[1] for s in shapes)
        h = max(s[2] for s in shapes)
        n = self.positions.shape[-1]
        return b, l_, h, n

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def select_requests(self, idx: list[int] | Tensor) -> StatsBatch:
        """A sub-batch of the given requests (used by the batch-invariance check)."""
        ix = torch.as_tensor(idx, dtype=torch.long, device=self.device)
        return StatsBatch(
            stats={k: v[ix] for k, v in self.stats.items()},
            lengths=self.lengths[ix],
            positions=self.positions[ix],
            seq_lens=self.seq_lens[ix],
            pinned=None if self.pinned is None else self.pinned[ix],
            budget=None if self.budget is None else self.budget[ix],
            layer_offset=self.layer_offset,
            meta=self.meta,
        )

    @staticmethod
    def contiguous_positions(lengths: Tensor, n: int, seq_lens: Tensor | None = None) -> Tensor:
        """``[B, 1, 1, N]`` positions for requests whose live tokens are the last ``lengths`` ones."""
        seq = lengths if seq_lens is None else seq_lens
        start = (seq - lengths).clamp(min=0)
        return (start[:, None] + torch.arange(n, device=lengths.device)[None, :])[:, None, None, :]


@dataclass(frozen=True)
class MaskContext:
    """What a ``@vt.mask_policy`` function receives besides the statistics.

    lengths ``[B]``, seq_lens ``[B]``, positions ``[B, L|1, H|1, N]``,
    keep_count ``[B]`` (what the contract requires every row to keep),
    pins ``[B, L, H, N]`` bool (must be kept), shape ``(B, L, H, N)``.
    """

    lengths: Tensor
    seq_lens: Tensor
    positions: Tensor
    keep_count: Tensor
    pins: Tensor
    shape: tuple[int, int, int, int]
