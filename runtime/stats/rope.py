"""Rotary tables of a model, from its HF config: what the query statistics need to undo and average RoPE.

One function for every adapter (the HF adapter passes ``model.config``, the vLLM worker
``model_config.hf_config``): :func:`rotary_tables` computes the inverse frequencies and the attention
scaling exactly as transformers' rotary embedding does (``compute_default_rope_parameters`` for
``rope_type="default"``, ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for the scaled types),
and :class:`RotaryTables` evaluates the rotation the model applies::

    rope(q, p) = R(p) q,   R(p) = a (C(p) + S(p) J)     C, S = diag(cos, sin) of cat(p * inv_freq, p * inv_freq)
                                                        J x = rotate_half(x) = cat(-x2, x1),  a = attention scaling

``p * inv_freq``, ``cos`` and ``sin`` are computed in float32 as transformers (and vLLM's cos/sin cache) do.
``C`` and ``S`` commute with ``J`` (both halves carry the same angle), so ``R0 = C + S J`` is orthogonal and
``R(p)^-1 = (C - S J) / a``; the average rotation over ``F`` positions is ``Rbar = a (Cbar + Sbar J)``.

Supported rope types: the position-independent ones (``default``, ``linear``, ``llama3``, ``yarn``,
``proportional``) with the rotation on the whole head (``partial_rotary_factor`` 1, the rotate-half / NeoX
layout of Llama, Qwen2, Mistral, ...). Refused with :class:`UnsupportedRope` (a ``ValueError``):
``dynamic`` and ``longrope`` (their frequencies change with the sequence length), per-layer-type or
multimodal (``mrope_section``) parameters, and partial rotary dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class UnsupportedRope(ValueError):
    """The model's RoPE cannot be described by :class:`RotaryTables` (the message names why)."""


@dataclass(frozen=True)
class RotaryTables:
    """``inv_freq [D/2]`` float32 and the attention scaling ``a`` of a rotary embedding (see module doc)."""

    inv_freq: torch.Tensor
    attention_scaling: float
    head_dim: int
    rope_type: str

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[*positions.shape, D]`` float32, without the attention scaling
        (transformers' ``emb = cat(freqs, freqs)``, ``freqs = positions.float() * inv_freq``)."""
        inv = self.inv_freq.to(positions.device, torch.float32)
        freqs = positions.to(torch.float32)[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               dim: int = -1) -> torch.Tensor:
        """``R x`` (or ``R^-1 x``) along ``dim`` for tables ``cos/sin`` broadcasting against ``x`` (``D`` on
        ``dim``): ``a (x cos + rotate_half(x) sin)``; inverse: ``(x cos - rotate_half(x) sin) / a``."""
        if dim != -1:
            x = x.movedim(dim, -1)
        rh = rotate_half(x)
        out = (x * cos - rh * sin) / self.attention_scaling if inverse else (x * cos + rh * sin) * self.attention_scaling
        return out.movedim(-1, dim) if dim != -1 else out

    def mean_cos_sin(self, starts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cbar, sbar) [B, D]`` float32: the mean of ``cos`` / ``sin`` over positions
        ``[starts[b], starts[b] + count)`` (each term as the model computes it in float32, summed in float64)."""
        pos = starts.to(torch.int64)[:, None] + torch.arange(count, device=starts.device)[None, :]
        c, s = self.cos_sin(pos)  # [B, F, D]
        return c.double().mean(1).to(torch.float32), s.double().mean(1).to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``J x``: ``cat(-x2, x1)`` along the last dim (transformers' ``rotate_half``)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older configs: rope_theta + rope_scaling
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        params = {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
                  "rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    if not isinstance(params, dict):
        params = dict(params)
    if "rope_type" not in params and "rope_theta" not in params and params:
        raise UnsupportedRope(f"per-layer-type rope parameters ({sorted(params)}) are not supported by the query "
                              "statistics")
    return params


def rotary_tables(config: Any) -> RotaryTables:
    """The rotary tables of a model from its HF config (``PreTrainedConfig``); :class:`UnsupportedRope`
    when its RoPE is not one :class:`RotaryTables` describes (see module doc)."""
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    params = _rope_parameters(config)
    rope_type = str(params.get("rope_type", "default"))
    if params.get("mrope_section") is not None:
        raise UnsupportedRope("multimodal RoPE (mrope_section) is not supported by the query statistics")
    if rope_type not in STATIC_TYPES:
        why = ("its frequencies change with the sequence length" if rope_type in ("dynamic", "longrope")
               else "unknown rope type")
        raise UnsupportedRope(f"rope_type={rope_type!r} is not supported by query_mean_future / query_cov_future "
                              f"({why}); supported: {', '.join(STATIC_TYPES)}")
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and rope_type != "proportional":
        raise UnsupportedRope(f"partial_rotary_factor={partial} (RoPE on part of the head) is not supported by "
                              "query_mean_future / query_cov_future")
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    inv = inv.to(torch.float32).flatten()
    if 2 * inv.numel() != head_dim:
        raise UnsupportedRope(f"rotary dimension {2 * inv.numel()} != head_dim {head_dim} (partial RoPE) is not "
                              "supported by query_mean_future / query_cov_future")
    return RotaryTables(inv, float(scaling if scaling is not None else 1.0), head_dim, rope_type)
