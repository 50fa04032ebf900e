"""Budgets: how many tokens a request keeps, and when eviction runs."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Phase = Literal["chunk", "prefill", "decode"]
When = Literal["prefill", "decode", "both", "chunks"]

# phases in which each ``when`` evicts: "chunk" = after a prefill chunk that does not complete the
# prompt, "prefill" = after the step that completes it, "decode" = after a generated token
PHASES_OF: dict[str, tuple[str, ...]] = {"prefill": ("prefill",), "decode": ("decode",),
                                         "both": ("prefill", "decode"), "chunks": ("chunk", "prefill", "decode")}


Slack = int | Literal["block"]


def parse_slack(text: str | int) -> Slack:
    """A slack from a command line or a config value: ``"block"`` or an integer >= 0 (tokens)."""
    if text == "block":
        return "block"
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    if isinstance(text, str) and text.strip().isdigit():
        return int(text)
    raise ValueError(f"slack: got {text!r}, expected an integer >= 0 (tokens) or 'block'; try 32 or block")


class Budget(BaseModel):
    """How many tokens each request keeps.

    Exactly one of ``tokens`` (absolute) or ``ratio`` (keep ratio; the seed paper's
    *eviction ratio* is ``1 - ratio``, see :meth:`evict`).

    - ``min_tokens``: never shrink a request below this many tokens.
    - ``slack``: evict only when ``live > budget + slack`` (amortises work: one
      eviction frees ``slack`` tokens at once instead of one per decode step). ``slack="block"``:
      evict, down to the budget, only when the request would otherwise hold a block the budget does
      not need: after a step, when its last block is full (the next token would open a block) or it
      holds more blocks than ``ceil(budget / block_size)``. After every prefill and decode step it
      then holds exactly the blocks of ``slack=0`` (same memory, same concurrency, when each decode
      step adds one token), while the policy and the compaction run once per several decode steps.
      Prefill chunks (``when="chunks"``) evict as with ``slack=0``.
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
    slack: Annotated[int, Field(ge=0)] | Literal["block"] = 0
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
                 when: When | None = None, slack: Slack | None = None) -> Budget:
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

    def should_evict(self, live: int, seq_len: int, phase: Phase, budget: int | None = None,
                     block_size: int | None = None) -> bool:
        """True when a request with ``live`` cached tokens must be trimmed now (``budget``: a
        per-request override of :meth:`resolve`; ``block_size``: the cache's, read by ``slack="block"``
        only, which without it evicts as ``slack=0``)."""
        if phase not in PHASES_OF[self.when]:
            return False
        b = self.resolve(seq_len) if budget is None else budget
        if self.slack != "block":
            return live > b + self.slack
        if live <= b:
            return False
        if phase == "chunk" or not block_size:  # the next step may add many tokens: trim now
            return True
        # the next step adds one token: it opens a block only if the last one is full
        return live % block_size == 0 or -(-live // block_size) > -(-b // block_size)

    def chunked_prefill_peak(self, n: int, chunk: int) -> int:
        """The most tokens a request holds while it prefills ``n`` prompt tokens in chunks of at most
        ``chunk`` tokens (what a scheduler must find room for before it admits the request).

        Without ``when="chunks"`` nothing is evicted before the prompt is complete: ``n``. With it, after the
        chunk ending at ``s`` the request holds at most ``budget(s) + slack`` (``slack="block"`` trims chunks
        as slack 0 does, :meth:`should_evict`), and the next chunk adds ``x <= chunk`` tokens with
        ``s + x <= n``; ``budget(s) + x`` is largest at ``s = n - chunk`` because a budget grows by at most one
        token per token::

            peak = min(n, budget(n - chunk) + slack + chunk)

        an upper bound for every chunking, reached (slack 0 or ``"block"``) when the last chunk is full.
        """
        if n < 0 or chunk < 1:
            raise ValueError(f"chunked_prefill_peak: got n={n}, chunk={chunk}, expected n >= 0 and chunk >= 1")
        if self.when != "chunks":
            return n
        slack = self.slack if isinstance(self.slack, int) else 0
        return min(n, self.resolve(max(n - chunk, 0)) + slack + chunk)
