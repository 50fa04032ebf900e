"""Protection rules: tokens a policy must never evict (pins).

Rules compose as a union: ``protect=[vt.sinks(4), vt.recent(64)]`` or
``vt.sinks(4) | vt.recent(64)``. Per-request pinned spans (a system prompt, a tool
output) are passed at run time (``pinned`` in a :class:`~vtoken_sdk.batch.StatsBatch`,
``pinned_spans`` in the adapters) and are always honoured on top of these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __or__(self, other: Rule) -> AnyOf:
        return AnyOf(rules=(*_flat(self), *_flat(other)))


def _flat(r: Rule) -> tuple[Rule, ...]:
    return r.rules if isinstance(r, AnyOf) else (r,)


class Sinks(Rule):
    """The first ``n`` tokens of the request (attention sinks, StreamingLLM)."""

    n: int = Field(ge=0)


class Recent(Rule):
    """The ``n`` most recent tokens (positions >= seq_len - n)."""

    n: int = Field(ge=0)


class Span(Rule):
    """Positions ``[start, end)`` of every request (e.g. a fixed-size system prompt)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @model_validator(mode="after")
    def _order(self) -> Span:
        if self.end < self.start:
            raise ValueError(f"got span [{self.start}, {self.end}), expected start <= end")
        return self


class Predicate(Rule):
    """Tokens where a traced boolean expression over statistics holds."""

    fn: Callable[[Any], Any]
    node: Any = None  # the traced IR node (set by the policy decorator)


class AnyOf(Rule):
    rules: tuple[Rule, ...]


def sinks(n: int) -> Sinks:
    return Sinks(n=n)


def recent(n: int) -> Recent:
    return Recent(n=n)


def span(start: int, end: int) -> Span:
    return Span(start=start, end=end)


def protect_if(fn: Callable[[Any], Any]) -> Predicate:
    """Pin tokens where ``fn(s)`` is true, e.g. ``vt.protect_if(lambda s: s.key_norm > 8)``."""
    return Predicate(fn=fn)


def flatten(rules: Rule | list[Rule] | tuple[Rule, ...] | None) -> tuple[Rule, ...]:
    if rules is None:
        return ()
    if isinstance(rules, Rule):
        return _flat(rules)
    out: list[Rule] = []
    for r in rules:
        if not isinstance(r, Rule):
            raise TypeError(f"got {type(r).__name__} in protect=, expected vt.sinks/recent/span/protect_if rules")
        out.extend(_flat(r))
    return tuple(out)
