"""Deterministic K/V/stat values for runtime tests: what was written is recomputable from
(request uid, layer, head, true position), so I1 checks need no copy of the data."""

from __future__ import annotations

import numpy as np
import torch


def kv_values(uid: int, layer: int, heads: int, positions: np.ndarray, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` each ``[T, heads, dim]`` float32 for true ``positions [T]``; values in [-1, 1]."""
    p = np.asarray(positions, dtype=np.float64)[:, None, None]
    h = np.arange(heads, dtype=np.float64)[None, :, None]
    d = np.arange(dim, dtype=np.float64)[None, None, :]
    base = uid * 12.9898 + layer * 78.233 + h * 37.719 + p * 4.1414 + d * 1.7
    return torch.from_numpy(np.sin(base).astype(np.float32)), torch.from_numpy(np.cos(base * 1.3).astype(np.float32))


def stat_values(uid: int, layer: int, heads: int, positions: np.ndarray) -> torch.Tensor:
    """``[heads, T]`` float32 per-slot statistic for ``positions [T]``."""
    p = np.asarray(positions, dtype=np.float64)[None, :]
    h = np.arange(heads, dtype=np.float64)[:, None]
    return torch.from_numpy(np.cos(uid * 3.1 + layer * 5.7 + h * 1.9 + p * 0.77).astype(np.float32))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
