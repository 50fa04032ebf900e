"""Torch reference compiler: policy IR -> batched keep-mask function.

This is the ground truth every other backend (the Triton kernels) is tested
against, bit for bit. Elementwise ops use the plain torch op of the same name;
reductions (pooling, head mean, request-level mean) add terms in a fixed order
(left to right along the window, head 0..H-1, row 0..R-1) so that any backend
can reproduce them exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import ir
from .batch import MaskContext, StatsBatch
from .errors import PolicyRuntimeError
from .protect import AnyOf, Predicate, Recent, Rule, Sinks, Span
from .selection import keep_counts, select

if TYPE_CHECKING:
    from .policy import Policy

_M32 = 0xFFFFFFFF


def hash_uniform(seed: int, layer: Tensor, head: Tensor, position: Tensor) -> Tensor:
    """Uniform [0, 1) from a 32-bit counter hash (murmur3 finaliser), float32.

    All arithmetic is modulo 2**32 so a uint32 kernel reproduces it exactly.
    """
    x = (seed * 0x9E3779B1) & _M32
    x = x ^ ((layer.to(torch.int64) * 0x85EBCA77) & _M32)
    x = x ^ ((head.to(torch.int64) * 0xC2B2AE3D) & _M32)
    x = x ^ ((position.to(torch.int64) * 0x27D4EB2F) & _M32)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * (1.0 / 16777216.0)


def _valid(batch: StatsBatch, n: int) -> Tensor:
    """``[B, 1, 1, N]`` bool: token index < length."""
    return (torch.arange(n, device=batch.device) < batch.lengths[:, None])[:, None, None, :]


def derived_stat(name: str, batch: StatsBatch, seed: int) -> Tensor:
    b, l_, h, n = batch.shape
    pos = batch.positions.to(torch.int64)
    if name == "position":
        return pos.to(torch.float32)
    if name == "age":
        return (batch.seq_lens.to(torch.int64)[:, None, None, None] - 1 - pos).to(torch.float32)
    if name == "random":
        layer = (torch.arange(l_, device=batch.device) + batch.layer_offset)[None, :, None, None]
        head = torch.arange(h, device=batch.device)[None, None, :, None]
        return hash_uniform(seed, layer, head, pos.expand(b, l_, h, n))
    raise KeyError(name)


def _shift(x: Tensor, d: int, fill: float | bool) -> Tensor:
    """``y[..., i] = x[..., i + d]`` where in range, else ``fill``."""
    n = x.shape[-1]
    if d == 0:
        return x
    out = torch.full_like(x, fill)
    if abs(d) < n:
        if d > 0:
            out[..., : n - d] = x[..., d:]
        else:
            out[..., -d:] = x[..., : n + d]
    return out


def _pool(op: str, x: Tensor, size: int, valid: Tensor) -> Tensor:
    """Centred window along N; out-of-range / padding tokens: ignored (max) or 0 (avg)."""
    x.shape[-1]
    r = size // 2
    fill = float("-inf") if op == "max" else 0.0
    acc: Tensor | None = None
    validx = valid.expand_as(x)
    for d in range(-r, r + 1):
        xs, vs = _shift(x, d, fill), _shift(validx, d, False)
        term = torch.where(vs, xs, torch.full_like(xs, fill))
        if acc is None:
            acc = term
        else:
            acc = torch.maximum(acc, term) if op == "max" else acc + term
    assert acc is not None
    return acc if op == "max" else acc / float(size)


def ordered_mean(x: Tensor, dim: int) -> Tensor:
    """Mean along ``dim`` adding terms in index order (reproducible by any backend)."""
    acc = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        acc = acc + x.select(dim, i)
    return (acc / float(x.shape[dim])).unsqueeze(dim)


_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "log": torch.log, "exp": torch.exp, "sqrt": torch.sqrt,
    "sigmoid": lambda x: 1.0 / (1.0 + torch.exp(-x)), "tanh": torch.tanh, "isnan": torch.isnan,
    "not": torch.logical_not, "float": lambda x: x.to(torch.float32),
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "eq": torch.eq, "ne": torch.ne, "and": torch.logical_and, "or": torch.logical_or,
}


def evaluate(node: ir.Node, env: dict[str, Tensor], shape: tuple[int, ...], valid: Tensor) -> Tensor:
    """Evaluate an IR graph on ``[B, L, H, N]`` statistics (result broadcast to ``shape``)."""
    memo: dict[ir.Node, Tensor] = {}
    device = valid.device
    for nd in ir.walk(node):
        if isinstance(nd, ir.Stat):
            out = env[nd.name]
        elif isinstance(nd, ir.Const):
            out = torch.tensor(nd.value, dtype=torch.float32, device=device)
        elif isinstance(nd, ir.Unary):
            out = _UNARY[nd.op](memo[nd.x])
        elif isinstance(nd, ir.Binary):
            out = _BINARY[nd.op](memo[nd.a], memo[nd.b])
        elif isinstance(nd, ir.Where):
            out = torch.where(memo[nd.cond], memo[nd.a], memo[nd.b])
        elif isinstance(nd, ir.Pool):
            out = _pool(nd.op, memo[nd.x].expand(shape).to(torch.float32), nd.size, valid)
        elif isinstance(nd, ir.HeadMean):
            out = ordered_mean(memo[nd.x].expand(shape), dim=2)
        else:  # pragma: no cover - exhaustive
            raise TypeError(f"unknown IR node {nd!r}")
        memo[nd] = out
    return memo[node].expand(shape)


class ReferencePolicy:
    """The torch backend of a policy: ``keep_mask(batch) -> [B, L, H, N] bool``."""

    backend = "torch"

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    # ------------------------------------------------------------------ inputs
    def env(self, batch: StatsBatch) -> dict[str, Tensor]:
        env: dict[str, Tensor] = {}
        for name in sorted(self.policy.reads):
            if name in self.policy.stored_reads:
                if name not in batch.stats:
                    raise ValueError(f"batch lacks statistic {name!r} that policy {self.policy.name!r} reads; "
                                     f"collect policy.stored_reads = {sorted(self.policy.stored_reads)}")
                env[name] = batch.stats[name].to(torch.float32)
            else:
                env[name] = derived_stat(name, batch, self.policy.spec.stats.seed)
        return env

    def budgets(self, batch: StatsBatch) -> Tensor:
        if batch.budget is not None:
            return batch.budget.to(torch.int64)
        b = self.policy.spec.budget
        return torch.tensor([b.resolve(int(s)) for s in batch.seq_lens.tolist()], dtype=torch.int64,
                            device=batch.device)

    def pins(self, batch: StatsBatch, env: dict[str, Tensor] | None = None) -> Tensor:
        """``[B, L, H, N]`` bool: tokens protected by the policy's rules or the batch's spans."""
        shape = batch.shape
        env = self.env(batch) if env is None else env
        pos = batch.positions.to(torch.int64)
        seq = batch.seq_lens.to(torch.int64)[:, None, None, None]
        valid = _valid(batch, shape[-1])
        out = torch.zeros(shape, dtype=torch.bool, device=batch.device)
        if batch.pinned is not None:
            out |= batch.pinned.to(torch.bool).expand(shape)
        for rule in self.policy.spec.protect:
            out |= self._rule(rule, pos, seq, env, shape, valid)
        return out & valid

    def _rule(self, rule: Rule, pos: Tensor, seq: Tensor, env: dict[str, Tensor], shape: tuple[int, ...],
              valid: Tensor) -> Tensor:
        if isinstance(rule, Sinks):
            return (pos < rule.n).expand(shape)
        if isinstance(rule, Recent):
            return (pos >= seq - rule.n).expand(shape)
        if isinstance(rule, Span):
            return ((pos >= rule.start) & (pos < rule.end)).expand(shape)
        if isinstance(rule, Predicate):
            return evaluate(rule.node, env, shape, valid).to(torch.bool)
        if isinstance(rule, AnyOf):
            out = torch.zeros(shape, dtype=torch.bool, device=valid.device)
            for r in rule.rules:
                out |= self._rule(r, pos, seq, env, shape, valid)
            return out
        raise TypeError(f"unknown protection rule {rule!r}")

    # ------------------------------------------------------------------ outputs
    def scores(self, batch: StatsBatch, env: dict[str, Tensor] | None = None) -> Tensor:
        """``[B, L, H, N]`` float32 scores (higher = keep)."""
        node = self.policy.node
        if node is None:
            raise TypeError(f"policy {self.policy.name!r} is a mask policy: it has no scores")
        env = self.env(batch) if env is None else env
        shape = batch.shape
        return evaluate(node, env, shape, _valid(batch, shape[-1])).to(torch.float32).contiguous()

    def keep_mask(self, batch: StatsBatch) -> Tensor:
        """``[B, L, H, N]`` bool keep mask under the selection contract."""
        b, l_, h, n = batch.shape
        env = self.env(batch)
        pins = self.pins(batch, env)
        budget = self.budgets(batch)
        if self.policy.kind == "mask":
            return self._custom_mask(batch, env, pins, budget)
        scores = self.scores(batch, env)
        if self.policy.spec.granularity == "request":
            rows = scores.reshape(b, l_ * h, n)
            s1 = ordered_mean(rows, dim=1)
            p1 = pins.reshape(b, l_ * h, n).any(dim=1, keepdim=True)
            keep = select(s1, batch.lengths, p1, budget)
            return keep[:, :, None, :].expand(b, l_, h, n).contiguous()
        keep = select(scores.reshape(b, l_ * h, n), batch.lengths, pins.reshape(b, l_ * h, n), budget)
        return keep.reshape(b, l_, h, n)

    def contract_violations(self, batch: StatsBatch, mask: Tensor) -> list[str | None]:
        """Per request: why ``mask [B, L, H, N]`` breaks the selection contract, or None.

        Used by the runtime to refuse a mask policy's output for one request only."""
        b, l_, h, n = batch.shape
        pins = self.pins(batch)
        if self.policy.spec.granularity == "request":
            pins = pins.any(dim=(1, 2), keepdim=True).expand(b, l_, h, n)
        k, _ = keep_counts(batch.lengths.to(torch.int64), pins.reshape(b, l_ * h, n), self.budgets(batch))
        valid = _valid(batch, n)
        out: list[str | None] = []
        for i in range(b):
            m = mask[i]
            if (pins[i] & ~m).any():
                out.append("drops a pinned token")
            elif (m & ~valid[i]).any():
                out.append("keeps padding past the request's length")
            elif not (m.sum(-1) == k[i]).all():
                out.append(f"keeps {sorted(set(m.sum(-1).flatten().tolist()))} tokens per row, expected {int(k[i])}")
            else:
                out.append(None)
        return out

    def _custom_mask(self, batch: StatsBatch, env: dict[str, Tensor], pins: Tensor, budget: Tensor) -> Tensor:
        from .stats import TokenStats

        b, l_, h, n = batch.shape
        if self.policy.spec.granularity == "request":
            pins = pins.any(dim=(1, 2), keepdim=True).expand(b, l_, h, n)
        k, _ = keep_counts(batch.lengths.to(torch.int64), pins.reshape(b, l_ * h, n), budget)
        ctx = MaskContext(lengths=batch.lengths, seq_lens=batch.seq_lens, positions=batch.positions,
                          keep_count=k, pins=pins, shape=(b, l_, h, n))
        try:
            out = self.policy.fn(TokenStats(env), ctx)
        except Exception as e:  # the policy's own bug: report where, keep the engine alive
            from .errors import traceback_line_in_file

            raise PolicyRuntimeError(self.policy.name, f"{type(e).__name__}: {e}", file=self.policy.file,
                                     line=traceback_line_in_file(e.__traceback__, self.policy.file)) from e
        if not isinstance(out, torch.Tensor):
            raise PolicyRuntimeError(self.policy.name, f"returned {type(out).__name__}, expected a bool tensor "
                                     f"[B, L, H, N] = {[b, l_, h, n]}", file=self.policy.file, line=self.policy.line)
        if tuple(out.shape) != (b, l_, h, n) or out.dtype != torch.bool:
            raise PolicyRuntimeError(self.policy.name, f"returned shape {list(out.shape)} dtype {out.dtype}, "
                                     f"expected {[b, l_, h, n]} torch.bool", file=self.policy.file,
                                     line=self.policy.line)
        return out
