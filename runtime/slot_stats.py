"""Per-slot statistics and true positions, stored in *physical* slot layout.

    stats[name]   float32 [num_layers, num_kv_heads, num_blocks * block_size]   one tensor per stat
    positions     int64   [R, num_blocks * block_size]     R = 1 ("request") or L * H_kv ("head")

    physical slot s = block_id * block_size + offset      (same numbering as the K/V caches)

              slot:  0  1  2  3 | 4  5  6  7 | ...
    positions[r]:   [7  1 -1  3 | 0 -1 -1 -1 | ...]     -1 = empty or evicted (never attended)
    stats["acc"][l, h]: values of the token that sits in each slot

Both live next to K/V and are moved by the copy engine in the same plan (I1 covers stats and positions
too). They are allocated once at start-up and only ever updated in place (static addresses).
``positions`` is what lets attention mask causally by *true* position after holes were filled with
tail tokens, and what marks dead slots in ``naive`` mode (a slot with position < 0 is invalid).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def scatter_into(t: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, reduce: str = "sum") -> None:
    """Fold ``values [H_kv, M]`` into one layer's store ``t [H_kv, S]`` at physical ``slots [M]``, in place:
    add (``"sum"``), overwrite (``"set"``) or multiply (``"scale"``). Slots must be distinct for set/scale."""
    H, S = t.shape
    tv = t.view(-1)
    flat = (torch.arange(H, device=slots.device)[:, None] * S + slots[None, :]).reshape(-1)  # head-major
    vals = values.reshape(-1).to(torch.float32)
    if reduce == "sum":
        tv.index_add_(0, flat, vals)
    elif reduce == "set":
        tv.index_copy_(0, flat, vals)
    elif reduce == "scale":
        tv.index_copy_(0, flat, tv[flat] * vals)
    else:
        raise ValueError(f"reduce must be 'sum', 'set' or 'scale', got {reduce!r}")


class SlotStore:
    """Owns the stats tensors and the positions tensor; knows nothing about requests."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_slots: int,
        num_rows: int,
        stat_names: Sequence[str] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        names = list(stat_names)
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stat names in {names}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.stat_names: tuple[str, ...] = tuple(names)
        self.stats: dict[str, torch.Tensor] = {
            n: torch.zeros(num_layers, num_kv_heads, num_slots, dtype=torch.float32, device=device)
            for n in names
        }
        # [R, S] true position of the token in each slot; -1 = empty / evicted.
        self.positions = torch.full((num_rows, num_slots), -1, dtype=torch.int64, device=device)

    def tensor(self, name: str) -> torch.Tensor:
        """The store ``[L, H_kv, S]`` for ``name`` (ValueError for an undeclared stat). For reading; writers
        use :meth:`scatter` or :meth:`update_handles`."""
        try:
            return self.stats[name]
        except KeyError:
            raise ValueError(f"unknown stat {name!r}; declared stats are {list(self.stat_names)}") from None

    def scatter(self, name: str, layer: int, slots: torch.Tensor, values: torch.Tensor, reduce: str = "sum") -> None:
        """Fold ``values [H_kv, M]`` into stat ``name`` of ``layer`` at physical ``slots [M]`` (:func:`scatter_into`)."""
        scatter_into(self.tensor(name)[layer], slots, values, reduce)

    def update_handles(self, layer: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The write handles of the statistics kernels: name -> ``[H_kv, S]`` in-place store of ``layer``
        (views: what a kernel writes lands in the store). The caller fences first (the cache does)."""
        return {n: self.tensor(n)[layer] for n in names}

    def gather(self, names: Sequence[str], slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stats at physical ``slots [R, n]`` (R = 1: every head reads the same slot; R = L * H_kv: row
        ``l * H_kv + h`` its own) -> name -> ``[L, H_kv, n]``."""
        L, H = self.num_layers, self.num_kv_heads
        out = {}
        for name in names:
            t = self.tensor(name)
            out[name] = t[:, :, slots[0]] if slots.shape[0] == 1 else torch.gather(t, 2, slots.view(L, H, -1))
        return out

    def gather_batch(self, names: Sequence[str], slots: torch.Tensor, valid: torch.Tensor,
                     layers: tuple[int, int]) -> dict[str, torch.Tensor]:
        """A batch's stats in one gather per name: physical ``slots [B, R, N]`` (R = 1: every head reads the
        same slot; R = L * H_kv: row ``l * H_kv + h`` its own), ``valid [B, N]`` (False: padding, read as 0),
        layers ``[l0, l1)`` -> name -> ``[B, l1 - l0, H_kv, N]`` on the store's device."""
        l0, l1 = layers
        B, R, N = slots.shape
        H = self.num_kv_heads
        keep = valid[:, None, None, :]
        out = {}
        for name in names:
            t = self.tensor(name)[l0:l1]  # [Lc, H, S]
            if R == 1:
                g = t[:, :, slots[:, 0]].permute(2, 0, 1, 3)  # [Lc, H, B, N] -> [B, Lc, H, N]
            else:
                rows = slots[:, l0 * H:l1 * H].reshape(B, l1 - l0, H, N)
                g = torch.gather(t.unsqueeze(0).expand(B, -1, -1, -1), 3, rows)
            out[name] = torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))
        return out

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Positions rows of ``layer``: ``[H_kv, S]`` at head granularity, ``[1, S]`` (broadcast) otherwise."""
        if self.num_rows == 1:
            return self.positions
        h = self.num_kv_heads
        return self.positions[layer * h:(layer + 1) * h]

    # ---- deferred writes (applied by the cache at fence time, after in-flight copies) -------------
    def init_slots(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New tokens: ``positions`` [R or 1, T] written at physical ``slots`` [T]; stats zeroed."""
        self.positions[:, slots] = positions
        for t in self.stats.values():
            t[:, :, slots] = 0.0

    def kill_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Evicted tokens: mark ``(rows[i], slots[i])`` dead (position -1)."""
        self.positions[rows, slots] = -1
