"""The torch backend: policy IR -> batched keep-mask function, on any device torch runs on.

It is the production backend on CPU (and for mask policies everywhere), and the ground truth
the Triton kernels (``triton_backend``) are tested against, bit for bit. Elementwise ops use the
plain torch op of the same name; reductions add terms in a fixed order so that any backend can reproduce them exactly:

* pools: left to right along the window; head mean: head 0..H-1; group mean: g = 0..G-1;
  request-level mean: row 0..R-1;
* ``Dot`` / ``MatVec`` (head dimension): ``((p_0 + p_1) + p_2) + ... p_{D-1}``, products rounded
  before the add (no FMA);
* ``TokenReduce`` (tokens of a row): ``TOKEN_LANES`` interleaved lanes, lane ``j`` adds tokens
  ``j, j + W, j + 2W, ...`` in order starting from the identity (``-0.0`` for sums, ``-inf`` for max;
  padding contributes the identity), then the lanes are combined by a pairwise tree
  (``(l_0 + l_1), (l_2 + l_3), ...`` repeated); ``mean`` divides by the length;
* ``Chunk``: the chunk's tokens left to right from the identity, ``mean`` divides by the number of
  live tokens of the chunk.

Values are evaluated in one canonical 7-D layout ``[B, L, H, G, N, D, E]`` with size-1 dims for the
axes a value does not have (``ir.Node.axes``), so broadcasting is plain torch broadcasting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import ir
from .allocation import HeadClasses, allocate_counts, head_classes_keep, select_counts
from .batch import MaskContext, StatsBatch
from .errors import PolicyRuntimeError
from .protect import AnyOf, Predicate, Recent, Rule, Sinks, Span
from .selection import keep_counts, select
from .stats import CATALOG

if TYPE_CHECKING:
    from .policy import Policy

_M32 = 0xFFFFFFFF
TOKEN_LANES = ir.TOKEN_LANES
_CANON = ir.AXES  # dims 3.. of the canonical layout [B, L, H, G, N, D, E]


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
    """A derived statistic in the batch layout ``[B|1, L|1, H|1, *axes]``."""
    b, l_, h, n = batch.shape
    if name == "layer":
        return (torch.arange(l_, device=batch.device) + batch.layer_offset).to(torch.float32).reshape(1, l_, 1)
    if name == "num_layers":
        return torch.full((1, 1, 1), float(batch.model_layers()), dtype=torch.float32, device=batch.device)
    if name == "head":
        return (torch.arange(h, device=batch.device) + batch.head_offset).to(torch.float32).reshape(1, 1, h)
    if name == "head_dim":
        return torch.full((1, 1, 1), float(batch.dims()[0]), dtype=torch.float32, device=batch.device)
    pos = batch.positions.to(torch.int64)
    if name == "position":
        return pos.to(torch.float32)
    if name == "age":
        return (batch.seq_lens.to(torch.int64)[:, None, None, None] - 1 - pos).to(torch.float32)
    if name == "random":
        layer = (torch.arange(l_, device=batch.device) + batch.layer_offset)[None, :, None, None]
        head = (torch.arange(h, device=batch.device) + batch.head_offset)[None, None, :, None]
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
    """Centred window along the last dim; out-of-range / padding tokens: ignored (max) or 0 (avg)."""
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


def canonical(t: Tensor, axes: tuple[str, ...]) -> Tensor:
    """``[B, L, H, *axes]`` -> the canonical ``[B, L, H, G, N, D, E]`` (size-1 dims for absent axes).

    Vectors are stored D-major (then E-major): ``t[..., d, :]`` is one contiguous block, so the
    ordered reductions over D read contiguous slices (elementwise results keep that layout)."""
    idx = (slice(None),) * 3 + tuple(slice(None) if a in axes else None for a in _CANON)
    out = t[idx]
    if "D" in axes and out.shape[5] > 1:
        out = out.permute(5, 6, 0, 1, 2, 3, 4).contiguous().permute(2, 3, 4, 5, 6, 0, 1)
    return out


def _expand_dim(x: Tensor, dim: int, size: int) -> Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    return x.expand(shape)


def ordered_dot(a: Tensor, b: Tensor, dim: int = 5) -> Tensor:
    """``sum_d a[d] * b[d]`` along ``dim`` in order d = 0..D-1 (kept as a size-1 dim): products rounded,
    then added one at a time (``((p_0 + p_1) + p_2) + ...``)."""
    n = max(a.shape[dim], b.shape[dim])
    a_ = _expand_dim(a, dim, n).movedim(dim, 0).contiguous()  # one contiguous slice per d
    b_ = _expand_dim(b, dim, n).movedim(dim, 0).contiguous()
    acc = a_[0] * b_[0]
    tmp = torch.empty_like(acc)
    for d in range(1, n):
        torch.mul(a_[d], b_[d], out=tmp)
        acc.add_(tmp)
    return acc.unsqueeze(dim)


def lane_reduce(op: str, x: Tensor, lanes: int = TOKEN_LANES) -> Tensor:
    """Reduce the last dim (already masked with the identity) in the order of the module doc."""
    ident = -0.0 if op == "sum" else float("-inf")
    n = x.shape[-1]
    pad = (-n) % lanes
    if pad:
        x = torch.cat([x, torch.full((*x.shape[:-1], pad), ident, dtype=x.dtype, device=x.device)], dim=-1)
    tiles = x.reshape(*x.shape[:-1], -1, lanes)
    acc = torch.full((*x.shape[:-1], lanes), ident, dtype=x.dtype, device=x.device)
    for t in range(tiles.shape[-2]):
        acc = acc + tiles[..., t, :] if op == "sum" else torch.maximum(acc, tiles[..., t, :])
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2] if op == "sum" else torch.maximum(acc[..., 0::2], acc[..., 1::2])
    return acc


def _masked(x: Tensor, valid7: Tensor, ident: float) -> Tensor:
    return torch.where(valid7, x, torch.full((), ident, dtype=x.dtype, device=x.device))


def _token_reduce(op: str, x: Tensor, valid7: Tensor) -> Tensor:
    n = valid7.shape[4]
    ident = float("-inf") if op == "max" else -0.0
    xm = _masked(_expand_dim(x, 4, n), valid7, ident).movedim(4, -1)
    out = lane_reduce("max" if op == "max" else "sum", xm).movedim(-1, 4)
    if op == "mean":
        count = valid7.sum(dim=4, keepdim=True).to(torch.float32)
        out = out / count
    return out


def _chunk(op: str, x: Tensor, size: int, valid7: Tensor) -> Tensor:
    n = valid7.shape[4]
    ident = float("-inf") if op == "max" else -0.0
    xm = _masked(_expand_dim(x, 4, n), valid7, ident).movedim(4, -1)
    pad = (-n) % size
    if pad:
        xm = torch.cat([xm, torch.full((*xm.shape[:-1], pad), ident, dtype=xm.dtype, device=xm.device)], dim=-1)
    tiles = xm.reshape(*xm.shape[:-1], -1, size)
    acc = torch.full(tiles.shape[:-1], ident, dtype=xm.dtype, device=xm.device)
    for j in range(size):
        acc = acc + tiles[..., j] if op == "mean" else torch.maximum(acc, tiles[..., j])
    if op == "mean":
        v = valid7.movedim(4, -1).to(torch.float32)
        if pad:
            v = torch.cat([v, v.new_zeros((*v.shape[:-1], pad))], dim=-1)
        count = v.reshape(*v.shape[:-1], -1, size).sum(-1)  # live tokens per chunk (exact small ints)
        acc = acc / count
    return acc.repeat_interleave(size, dim=-1)[..., :n].movedim(-1, 4)


def _matvec(m: Tensor, x: Tensor) -> Tensor:
    """``y[d] = sum_e m[d, e] * x[e]`` in order e = 0..D-1: ``m`` [.., D, E], ``x`` [.., D, 1]."""
    return ordered_dot(m, x.transpose(5, 6), dim=6).contiguous()


def sqrt_rn(x: Tensor) -> Tensor:
    """Correctly rounded float32 square root (IEEE ``sqrt``, like ``tl.sqrt_rn``): torch's float32 CPU
    ``sqrt`` is not correctly rounded (off by one ulp for ~15% of inputs with torch 2.13); the float64 root
    rounded to float32 is (53 >= 2 * 24 + 2 bits)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


EXP_CONSTANTS = ir.EXP_CONSTANTS


def exp_det(x: Tensor) -> Tensor:
    """Deterministic float32 ``exp`` (see ``EXP_CONSTANTS``): bit-identical to the generated kernels'."""
    x = x.to(torch.float32)

    def c(name: str) -> Tensor:
        return torch.tensor(EXP_CONSTANTS[name], dtype=torch.float32, device=x.device)

    k = torch.floor(x * c("log2e") + torch.tensor(0.5, device=x.device))
    k = torch.minimum(torch.maximum(k, torch.tensor(-150.0, device=x.device)), torch.tensor(128.0, device=x.device))
    r = x - k * c("c1")
    r = r - k * c("c2")
    z = r * r
    p = c("p0") * r + c("p1")
    for name in ("p2", "p3", "p4", "p5"):
        p = p * r + c(name)
    y = (p * z + r) + torch.tensor(1.0, device=x.device)
    k1 = torch.floor(k * torch.tensor(0.5, device=x.device))
    k2 = k - k1
    finite = torch.isfinite(k)
    s1 = ((torch.where(finite, k1, 0.0).to(torch.int32) + 127) << 23).view(torch.float32)
    s2 = ((torch.where(finite, k2, 0.0).to(torch.int32) + 127) << 23).view(torch.float32)
    y = (y * s1) * s2
    y = torch.where(x > c("hi"), torch.tensor(float("inf"), device=x.device), y)
    y = torch.where(x < c("lo"), torch.tensor(0.0, device=x.device), y)
    return torch.where(torch.isnan(x), x, y)


def _sigmoid(x: Tensor) -> Tensor:
    one = torch.ones((), dtype=torch.float32, device=x.device)
    return torch.div(one, one + exp_det(-x))


_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "log": torch.log, "exp": exp_det, "sqrt": sqrt_rn,
    "sigmoid": _sigmoid, "tanh": torch.tanh, "isnan": torch.isnan,
    "not": torch.logical_not, "float": lambda x: x.to(torch.float32),
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "eq": torch.eq, "ne": torch.ne, "and": torch.logical_and, "or": torch.logical_or,
}


def evaluate_canonical(node: ir.Node, env: dict[str, Tensor], shape: tuple[int, ...], valid: Tensor) -> Tensor:
    """Evaluate an IR graph; the result in the canonical layout ``[B, L, H, G, N, D, E]`` (broadcastable).

    ``env``: statistics in the batch layout ``[B|1, L|1, H|1, *axes]``; ``shape`` ``(B, L, H, N)``;
    ``valid`` ``[B, 1, 1, N]`` bool (token index < length)."""
    memo: dict[ir.Node, Tensor] = {}
    device = valid.device
    _, _, h, n = shape
    valid7 = valid.reshape(valid.shape[0], 1, 1, 1, valid.shape[-1], 1, 1)
    for nd in ir.walk(node):
        if isinstance(nd, ir.Stat):
            info = CATALOG.get(nd.name)
            out = canonical(env[nd.name], info.axes if info is not None else ("N",))
        elif isinstance(nd, ir.Const):
            out = torch.tensor(nd.value, dtype=torch.float32, device=device).reshape((1,) * 7)
        elif isinstance(nd, ir.Unary):
            out = _UNARY[nd.op](memo[nd.x])
        elif isinstance(nd, ir.Binary):
            out = _BINARY[nd.op](memo[nd.a], memo[nd.b])
        elif isinstance(nd, ir.Where):
            out = torch.where(memo[nd.cond], memo[nd.a], memo[nd.b])
        elif isinstance(nd, ir.Pool):
            x = _expand_dim(memo[nd.x].to(torch.float32), 4, n)
            x = x.expand(torch.broadcast_shapes(x.shape, valid7.shape))
            out = _pool(nd.op, x.movedim(4, -1), nd.size, valid7.movedim(4, -1)).movedim(-1, 4)
        elif isinstance(nd, ir.HeadMean):
            out = ordered_mean(_expand_dim(memo[nd.x], 2, h), dim=2)
        elif isinstance(nd, ir.GroupMean):
            out = ordered_mean(memo[nd.x], dim=3)
        elif isinstance(nd, ir.Dot):
            out = ordered_dot(memo[nd.a], memo[nd.b], dim=5)
        elif isinstance(nd, ir.MatVec):
            out = _matvec(memo[nd.m], memo[nd.x])
        elif isinstance(nd, ir.TokenReduce):
            out = _token_reduce(nd.op, memo[nd.x], valid7)
        elif isinstance(nd, ir.Chunk):
            out = _chunk(nd.op, memo[nd.x], nd.size, valid7)
        else:  # pragma: no cover - exhaustive
            raise TypeError(f"unknown IR node {nd!r}")
        memo[nd] = out
    return memo[node]


def evaluate(node: ir.Node, env: dict[str, Tensor], shape: tuple[int, ...], valid: Tensor) -> Tensor:
    """Evaluate a scalar IR graph (a score or a predicate) on ``[B, L, H, N]`` statistics (result broadcast
    to ``shape``)."""
    out = evaluate_canonical(node, env, shape, valid)
    return out[:, :, :, 0, :, 0, 0].expand(shape)


class TorchPolicy:
    """The torch backend of a policy: ``keep_mask(batch) -> [B, L, H, N] bool``."""

    backend = "torch"

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    # ------------------------------------------------------------------ inputs
    def env(self, batch: StatsBatch) -> dict[str, Tensor]:
        """The statistics the policy reads, in the batch layout ``[B|1, L|1, H|1, *axes]`` float32."""
        env: dict[str, Tensor] = {}
        if self.policy.vector_reads or "head_dim" in self.policy.reads:
            batch.dims()  # D / G agree across the vectors
        for name in sorted(self.policy.reads):
            if name in self.policy.stored_reads:
                if name not in batch.stats:
                    raise ValueError(f"batch lacks statistic {name!r} that policy {self.policy.name!r} reads; "
                                     f"collect policy.stored_reads = {sorted(self.policy.stored_reads)}")
                env[name] = batch.stats[name].to(torch.float32)
            elif name in self.policy.vector_reads:
                if name not in batch.vectors:
                    raise ValueError(f"batch lacks vector statistic {name!r} that policy {self.policy.name!r} "
                                     f"reads; gather policy.vector_reads = {sorted(self.policy.vector_reads)} "
                                     "into StatsBatch.vectors")
                env[name] = batch.vectors[name].to(torch.float32)
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
        alloc = self.policy.spec.allocation
        if isinstance(alloc, HeadClasses):  # positions decide, not scores
            return head_classes_keep(alloc, batch.lengths, batch.positions, batch.seq_lens, pins, (b, l_, h, n),
                                     batch.layer_offset)
        scores = self.scores(batch, env)
        if not self.policy.spec.uniform:  # unequal budgets: counts per row, then each row's top (allocation)
            counts = self.counts(batch, scores, pins, budget)
            return select_counts(scores, batch.lengths, pins, counts)
        if self.policy.spec.granularity == "request":
            rows = scores.reshape(b, l_ * h, n)
            s1 = ordered_mean(rows, dim=1)
            p1 = pins.reshape(b, l_ * h, n).any(dim=1, keepdim=True)
            keep = select(s1, batch.lengths, p1, budget)
            return keep[:, :, None, :].expand(b, l_, h, n).contiguous()
        keep = select(scores.reshape(b, l_ * h, n), batch.lengths, pins.reshape(b, l_ * h, n), budget)
        return keep.reshape(b, l_, h, n)

    def counts(self, batch: StatsBatch, scores: Tensor | None = None, pins: Tensor | None = None,
               budget: Tensor | None = None) -> Tensor:
        """``[B, L, H]`` int64: tokens every row keeps under the policy's allocation (vtoken_sdk.allocation)."""
        env = self.env(batch) if scores is None or pins is None else None
        scores = self.scores(batch, env) if scores is None else scores
        pins = self.pins(batch, env) if pins is None else pins
        budget = self.budgets(batch) if budget is None else budget
        alloc = self.policy.spec.allocation
        if isinstance(alloc, HeadClasses):
            return head_classes_keep(alloc, batch.lengths, batch.positions, batch.seq_lens, pins, tuple(batch.shape),
                                     batch.layer_offset).sum(-1)
        counts, _ = allocate_counts(scores, batch.lengths, pins, budget, alloc)
        return counts

    def contract_violations(self, batch: StatsBatch, mask: Tensor) -> list[str | None]:
        """Per request: why ``mask [B, L, H, N]`` breaks the selection contract, or None.

        Used by the runtime to refuse a mask policy's output for one request only."""
        b, l_, h, n = batch.shape
        pins = self.pins(batch)
        if self.policy.spec.granularity == "request":
            pins = pins.any(dim=(1, 2), keepdim=True).expand(b, l_, h, n)
        k, _ = keep_counts(batch.lengths.to(torch.int64), pins.reshape(b, l_ * h, n), self.budgets(batch))
        want = None if self.policy.spec.uniform else self.counts(batch, pins=pins)
        valid = _valid(batch, n)
        out: list[str | None] = []
        for i in range(b):
            m = mask[i]
            if (pins[i] & ~m).any():
                out.append("drops a pinned token")
            elif (m & ~valid[i]).any():
                out.append("keeps padding past the request's length")
            elif want is not None:
                bad = m.sum(-1) != want[i]
                out.append(None if not bad.any() else
                           f"keeps {int(m.sum(-1)[bad][0])} tokens in row {tuple(int(x) for x in bad.nonzero()[0])}, "
                           f"expected {int(want[i][bad][0])} ({self.policy.spec.allocation!r})")
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
