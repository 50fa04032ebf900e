"""Budgets: how many tokens a request keeps, and when eviction runs."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Phase = Literal["chunk", "prefill", "decode"]
When = Literal["prefill", "decode", "both", "chunks"]

# phases in which each ``when`` evicts: "chunk" = after a prefill chunk that does not complete the
# prompt, "prefill" = after the step that completes it, "decode" = after a generated token
PHASES_OF: dict[str, tuple[str, ...]] = {"prefill": ("prefill",), "decode": ("decode",),
                                         "both": ("prefill", "decode"), "chunks": ("chunk", "prefill", "decode")}


class Budget(BaseModel):
    """How many tokens each request keeps.

    Exactly one of ``tokens`` (absolute) or ``ratio`` (keep ratio; the seed paper's
    *eviction ratio* is ``1 - ratio``, see :meth:`evict`).

    - ``min_tokens``: never shrink a request below this many tokens.
    - ``slack``: evict only when ``live > budget + slack`` (amortises work: one
      eviction frees ``slack`` tokens at once instead of one per decode step).
    - ``when``: run eviction after prefill, during decode, ``both`` (default), or ``chunks``: also after
      every prefill chunk, so a long prompt never holds more than its budget plus one chunk. Opt-in:
      later prompt tokens then attend only to what the earlier chunks kept (beyond the seed paper,
      which evicts after prefill; its quality cost is measured by ``vtoken-cli eval --when chunks``).

    The budget of a request that has processed ``seq_len`` tokens is
    ``max(min_tokens, tokens)`` or ``max(min_tokens, floor(ratio * seq_len + 0.5))``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: int | None = Field(default=None, ge=1, description="absolute number of tokens kept")
    ratio: float | None = Field(default=None, gt=0.0, le=1.0, description="fraction of tokens kept")
    min_tokens: int = Field(default=0, ge=0)
    slack: int = Field(default=0, ge=0)
    when: When = "both"

    @model_validator(mode="after")
    def _one_of(self) -> Budget:
        if (self.tokens is None) == (self.ratio is None):
            raise ValueError(
                "got " + ("both" if self.tokens is not None else "neither")
                + " of tokens/ratio, expected exactly one; try Budget(ratio=0.5) or Budget(tokens=1024)"
            )
        return self

    @classmethod
    def evict(cls, eviction_ratio: float, **kw: object) -> Budget:
        """Budget from the seed paper's eviction ratio (fraction of tokens evicted)."""
        if not 0.0 <= eviction_ratio < 1.0:
            raise ValueError(f"got eviction_ratio={eviction_ratio}, expected 0 <= r < 1; try 0.5")
        return cls(ratio=1.0 - eviction_ratio, **kw)  # type: ignore[arg-type]

    def override(self, tokens: int | None = None, eviction_ratio: float | None = None,
                 when: When | None = None, slack: int | None = None) -> Budget:
        """This budget with its size replaced (a per-request override): ``tokens`` or ``eviction_ratio``
        (at most one), keeping ``min_tokens``, ``slack`` and ``when`` (unless ``when`` / ``slack`` are
        given). No argument: ``self``."""
        if tokens is not None and eviction_ratio is not None:
            raise ValueError("got both tokens and eviction_ratio, expected at most one")
        keep = {"min_tokens": self.min_tokens, "slack": self.slack if slack is None else slack,
                "when": when or self.when}
        if tokens is None and eviction_ratio is None:
            if when is None and slack is None:
                return self
            size = {"tokens": self.tokens} if self.tokens is not None else {"ratio": self.ratio}
            return Budget(**size, **keep)  # type: ignore[arg-type]  # validated (slack >= 0, when known)
        if tokens is not None:
            return Budget(tokens=int(tokens), **keep)  # type: ignore[arg-type]
        if eviction_ratio is not None:
            return Budget.evict(float(eviction_ratio), **keep)
        return self

    @property
    def eviction_ratio(self) -> float | None:
        return None if self.ratio is None else 1.0 - self.ratio

    def resolve(self, seq_len: int) -> int:
        """Number of tokens to keep for a request that has processed ``seq_len`` tokens."""
        if self.tokens is not None:
            base = self.tokens
        else:
            assert self.ratio is not None
            base = math.floor(self.ratio * seq_len + 0.5)
        return max(self.min_tokens, base)

    def should_evict(self, live: int, seq_len: int, phase: Phase, budget: int | None = None) -> bool:
        """True when a request with ``live`` cached tokens must be trimmed now (``budget``: a
        per-request override of :meth:`resolve`)."""
        if phase not in PHASES_OF[self.when]:
            return False
        return live > (self.resolve(seq_len) if budget is None else budget) + self.slack
