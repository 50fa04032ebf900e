"""The input of a compiled policy: a batch of per-token statistics in logical order.

Layout (all on one device)::

    stats[name]  [B, L, H, N] float32   stored statistics (policy.stored_reads)
    positions    [B, L|1, H|1, N] int64 true positions, ascending along N in [0, lengths[b])
    lengths      [B] int64             valid (live) tokens of each request, same in every row
    seq_lens     [B] int64             tokens the request has processed (logical length)
    pinned       [B, L|1, H|1, N] bool  explicit per-request pins (spans), optional
    budget       [B] int64             overrides Budget.resolve(seq_len) when given
    vectors[name] float32              vector statistics (policy.vector_reads), shape [B, L|1, H|1, *axes]:
        key, value          [B, L, H, N, D]     the cached key (post-RoPE) / value of every token,
                                                 in the same logical order as positions (padding: any value)
        query_mean          [B, L, H, D]        see vtoken_sdk.stats.CATALOG for the exact definitions
        query_mean_future   [B, L, H, G, D]
        query_cov_future    [B, L, H, G, D, D]
    head_dim     int                   D when no vector is given (a policy reading only s.head_dim)
    layer_offset int                   model layer of row layer 0 (the runtime may pass layer chunks)
    head_offset  int                   KV head of the layer of row head 0 (tensor parallelism: a rank's heads
                                       are the layer's heads head_offset .. head_offset + H - 1)
    num_layers   int                   layers of the model (``s.num_layers``); None: layer_offset + L, the
                                       batch ends at the model's last layer

``L`` layers x ``H`` KV heads are the *rows* of a request. Entries at ``n >= lengths[b]``
are padding: never read by pooling or token reductions, never kept.
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
    vectors: Mapping[str, Tensor] = field(default_factory=dict)
    head_dim: int | None = None
    num_layers: int | None = None
    head_offset: int = 0

    def model_layers(self) -> int:
        """The model's layer count: ``num_layers``, or ``layer_offset + L`` when None.

        Raises ValueError when ``num_layers`` is smaller than the layers the batch spans."""
        spans = self.layer_offset + self.shape[1]
        if self.num_layers is None:
            return spans
        if self.num_layers < spans:
            raise ValueError(f"got StatsBatch.num_layers={self.num_layers}, but the batch holds layers "
                             f"{self.layer_offset}..{spans - 1}: pass the model's layer count")
        return int(self.num_layers)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, L, H, N)``."""
        shapes = [t.shape for t in self.stats.values()] + [t.shape for t in self.vectors.values()] + \
            [self.positions.shape]
        b = len(self.lengths)
        l_ = max(s[1] for s in shapes)
        h = max(s[2] for s in shapes)
        n = self.positions.shape[-1]
        return b, l_, h, n

    def dims(self) -> tuple[int, int]:
        """``(D, G)``: head dimension and query heads per KV head, from the vectors (1 when absent).

        Raises ValueError when the vectors disagree (every vector of a batch has the same D)."""
        from .stats import CATALOG

        found: dict[str, set[int]] = {"D": set(), "G": set()}
        for name, t in self.vectors.items():
            info = CATALOG.get(name)
            if info is None:
                raise ValueError(f"unknown vector statistic {name!r} in StatsBatch.vectors")
            if t.dim() != 3 + len(info.axes):
                raise ValueError(f"StatsBatch.vectors[{name!r}] has shape {list(t.shape)}, expected "
                                 f"[B, L, H, {', '.join(info.axes)}]")
            for ax, size in zip(info.axes, t.shape[3:], strict=True):
                if ax in ("D", "E"):
                    found["D"].add(int(size))
                elif ax == "G":
                    found["G"].add(int(size))
        if self.head_dim is not None:
            found["D"].add(int(self.head_dim))
        for ax, sizes in found.items():
            if len(sizes) > 1:
                raise ValueError(f"StatsBatch.vectors disagree on {ax}: {sorted(sizes)}")
        return next(iter(found["D"]), 1), next(iter(found["G"]), 1)

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
            vectors={k: v[ix] for k, v in self.vectors.items()},
            head_dim=self.head_dim,
            num_layers=self.num_layers,
            head_offset=self.head_offset,
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
