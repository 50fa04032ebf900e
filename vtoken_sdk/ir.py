"""The policy IR: what a score function is traced into at decoration time.

A score function is plain tensor math over :class:`~vtoken_sdk.stats.TokenStats`.
Decoration runs it once on symbolic statistics; every operation builds a node::

    h2o:     Stat(attn_sum)
    snapkv:  Pool(max, Binary(div, Stat(attn_window), Const(32.0)), size=7)
    tova:    HeadMean(Stat(attn_last))
    keydiff: neg(cosine(s.key, TokenReduce(mean, s.key / norm(s.key))))

Node kinds (all frozen, hashable, structural equality):

===========  ================================================================
Stat         a catalog statistic (shape from ``CATALOG[name].axes``)
Const        a Python number (hyper-parameters become constants)
Unary        neg abs log exp sqrt sigmoid tanh isnan not float
Binary       add sub mul div pow maximum minimum | lt le gt ge eq ne | and or
Where        where(cond, a, b)
Pool         max/avg over a centred window of ``size`` tokens along N
HeadMean     mean over the KV heads of a layer (result broadcasts over H)
Dot          sum over the head dimension D of ``a * b`` (vt.dot, vt.norm, vt.cosine)
MatVec       ``m @ x`` for a head-matrix ``m`` (vt.matvec, vt.quad)
TokenReduce  sum / max / mean over the live tokens of a row (vt.token_*, vt.softmax)
Chunk        mean / max over fixed chunks of ``size`` tokens (vt.chunk_mean, vt.chunk_max)
GroupMean    mean over the G query heads of a KV head (vt.group_mean)
===========  ================================================================

Shapes. Every node has ``axes`` (besides ``B, H``), a subset of ``G N D E`` in that order:
token-scalar ``(N,)`` ``[B, H, N]``, token-vector ``(N, D)`` ``[B, H, N, D]``, head-scalar ``()``
``[B, H, 1]``, head-vector ``(D,)`` ``[B, H, D]``, head-matrix ``(D, E)`` ``[B, H, D, D]``; ``G``
(per query head) may be added to any of them. Elementwise ops broadcast (a head-vector
broadcasts over the tokens, a scalar over D); a matrix combines only with scalars and other
matrices (never per token); a score must end up a token- or head-scalar. Shape mistakes raise
:class:`~vtoken_sdk.errors.PolicyDefinitionError` at decoration with file:line and the fix.

Everything else - Python control flow on tensor values, in-place updates, indexing, unknown
torch functions - raises the same error. Backends (torch_backend, Triton codegen) walk this
IR; they never run user code.
"""

from __future__ import annotations

import contextvars
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import PolicyDefinitionError, frame_in_file
from .stats import CATALOG

UNARY_FLOAT = ("neg", "abs", "log", "exp", "sqrt", "sigmoid", "tanh")
UNARY_TO_BOOL = ("isnan",)
BINARY_ARITH = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
BINARY_CMP = ("lt", "le", "gt", "ge", "eq", "ne")
BINARY_LOGIC = ("and", "or")
POOL_OPS = ("max", "avg")
MAX_POOL_SIZE = 63
TOKEN_REDUCE_OPS = ("sum", "max", "mean")
CHUNK_OPS = ("mean", "max")
MAX_CHUNK_SIZE = 128
AXES = ("G", "N", "D", "E")  # canonical order of the axes besides [B, H]
TOKEN_LANES = 256  # interleaved lanes of a token reduction (a power of two; every backend uses it)
# exp is a fixed sequence of IEEE float32 operations (Cephes expf: Cody-Waite range reduction, degree-5
# polynomial, scaling by two exact powers of two) so that every backend computes the same bits, within
# 1 ulp of the true value (torch_backend.exp_det, codegen_triton._exp_helper). All values are exact float32.
EXP_CONSTANTS = {
    "log2e": 1.4426950216293335, "c1": 0.693359375, "c2": -0.00021219444170128554,
    "p0": 0.00019875691214110702, "p1": 0.001398199936375022, "p2": 0.008333452045917511,
    "p3": 0.04166579619050026, "p4": 0.1666666567325592, "p5": 0.5,
    "hi": 88.72283935546875, "lo": -103.97208404541016,
}


def _union(*axes: tuple[str, ...]) -> tuple[str, ...]:
    have = set().union(*axes)
    return tuple(a for a in AXES if a in have)


def _minus(axes: tuple[str, ...], *drop: str) -> tuple[str, ...]:
    return tuple(a for a in axes if a not in drop)


def kind_name(axes: tuple[str, ...]) -> str:
    """``token-vector [B,H,N,D]``-style name of a shape (used in error messages and docs)."""
    base = "token-" if "N" in axes else "head-"
    base += "matrix" if "E" in axes else "vector" if "D" in axes else "scalar"
    if "G" in axes:
        base += " per query head"
    dims = ["B", "H", *("D" if a == "E" else a for a in axes)]
    if not axes:
        dims.append("1")
    return f"{base} [{','.join(dims)}]"


class Node:
    """Base of IR nodes. ``dtype`` is ``"f32"`` or ``"bool"``; ``axes`` the shape (module doc)."""

    dtype: str = "f32"
    axes: tuple[str, ...] = ()

    def children(self) -> tuple[Node, ...]:
        return ()

    def _set_axes(self, axes: tuple[str, ...]) -> None:
        object.__setattr__(self, "axes", axes)


def _axes_field() -> Any:
    return field(default=(), init=False, compare=False, repr=False)


@dataclass(frozen=True)
class Stat(Node):
    name: str
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        info = CATALOG.get(self.name)
        self._set_axes(_union(info.axes) if info is not None else ("N",))

    def __repr__(self) -> str:
        return f"s.{self.name}"


@dataclass(frozen=True)
class Const(Node):
    value: float
    axes: tuple[str, ...] = _axes_field()

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Unary(Node):
    op: str
    x: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(self.x.axes)

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return "bool" if self.op in ("isnan", "not") else "f32"

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"{self.op}({self.x!r})"


@dataclass(frozen=True)
class Binary(Node):
    op: str
    a: Node
    b: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_union(self.a.axes, self.b.axes))

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return "bool" if self.op in BINARY_CMP + BINARY_LOGIC else "f32"

    def children(self) -> tuple[Node, ...]:
        return (self.a, self.b)

    def __repr__(self) -> str:
        return f"{self.op}({self.a!r}, {self.b!r})"


@dataclass(frozen=True)
class Where(Node):
    cond: Node
    a: Node
    b: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_union(self.cond.axes, self.a.axes, self.b.axes))

    def children(self) -> tuple[Node, ...]:
        return (self.cond, self.a, self.b)

    def __repr__(self) -> str:
        return f"where({self.cond!r}, {self.a!r}, {self.b!r})"


@dataclass(frozen=True)
class Pool(Node):
    op: str
    x: Node
    size: int
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_union(self.x.axes, ("N",)))

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"{self.op}_pool({self.x!r}, {self.size})"


@dataclass(frozen=True)
class HeadMean(Node):
    x: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(self.x.axes)

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"head_mean({self.x!r})"


@dataclass(frozen=True)
class Dot(Node):
    """``sum_d a[d] * b[d]`` over the head dimension, added in order d = 0..D-1."""

    a: Node
    b: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_minus(_union(self.a.axes, self.b.axes), "D"))

    def children(self) -> tuple[Node, ...]:
        return (self.a, self.b)

    def __repr__(self) -> str:
        return f"dot({self.a!r}, {self.b!r})"


@dataclass(frozen=True)
class MatVec(Node):
    """``y[d] = sum_e m[d, e] * x[e]``, added in order e = 0..D-1."""

    m: Node
    x: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_union(_minus(self.m.axes, "E"), self.x.axes))

    def children(self) -> tuple[Node, ...]:
        return (self.m, self.x)

    def __repr__(self) -> str:
        return f"matvec({self.m!r}, {self.x!r})"


@dataclass(frozen=True)
class TokenReduce(Node):
    """sum / max / mean of ``x`` over the live tokens of a row (``n < lengths[b]``)."""

    op: str
    x: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_minus(self.x.axes, "N"))

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"token_{self.op}({self.x!r})"


@dataclass(frozen=True)
class Chunk(Node):
    """mean / max of ``x`` over chunk ``n // size`` of the row's live tokens, broadcast to the chunk."""

    op: str
    x: Node
    size: int
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_union(self.x.axes, ("N",)))

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"chunk_{self.op}({self.x!r}, {self.size})"


@dataclass(frozen=True)
class GroupMean(Node):
    """Mean over the G query heads of a KV head, added in order g = 0..G-1."""

    x: Node
    axes: tuple[str, ...] = _axes_field()

    def __post_init__(self) -> None:
        self._set_axes(_minus(self.x.axes, "G"))

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"group_mean({self.x!r})"


def row_reductions(node: Node) -> list[TokenReduce]:
    """The token reductions of a graph, each after the reductions it depends on."""
    return [n for n in walk(node) if isinstance(n, TokenReduce)]


def walk(node: Node) -> list[Node]:
    """All distinct nodes of the graph, children before parents (topological order)."""
    seen: dict[Node, None] = {}

    def visit(n: Node) -> None:
        if n in seen:
            return
        for c in n.children():
            visit(c)
        seen[n] = None

    visit(node)
    return list(seen)


def stats_read(node: Node) -> frozenset[str]:
    return frozenset(n.name for n in walk(node) if isinstance(n, Stat))


def max_pool_radius(node: Node) -> int:
    """Total token-axis reach of nested pools (how far a score looks left/right)."""
    if isinstance(node, Pool):
        return node.size // 2 + max_pool_radius(node.x)
    return max((max_pool_radius(c) for c in node.children()), default=0)


# --------------------------------------------------------------------------- tracing

_TRACE_FILE: contextvars.ContextVar[str | None] = contextvars.ContextVar("vtoken_trace_file", default=None)


def fail(message: str, hint: str | None = None) -> PolicyDefinitionError:
    """Build a PolicyDefinitionError located at the user's line being traced."""
    file = _TRACE_FILE.get()
    line = frame_in_file(file) if file else None
    return PolicyDefinitionError(message, file=file, line=line, hint=hint)


def _as_node(x: Any, what: str = "operand") -> Node:
    if isinstance(x, Expr):
        return x.node
    if isinstance(x, bool):
        return Const(1.0 if x else 0.0)
    if isinstance(x, numbers.Real):
        return Const(float(x))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return Const(float(x.item()))
    if isinstance(x, torch.Tensor):
        raise fail(f"got a tensor of shape {list(x.shape)} as {what}, expected a statistic or a Python number",
                   "fixed-shape tensors cannot be captured in a policy; use a number or a statistic")
    raise fail(f"got {type(x).__name__} as {what}, expected a statistic expression or a number")


def _to_float(n: Node) -> Node:
    return Unary("float", n) if n.dtype == "bool" else n


def _to_bool(n: Node, what: str) -> Node:
    if n.dtype != "bool":
        raise fail(f"got a float expression as {what}, expected a boolean (a comparison)",
                   "compare first, e.g. s.key_norm > 1.0")
    return n


_OP_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "lt": "<", "le": "<=", "gt": ">",
              "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}


def _elementwise(what: str, *nodes: Node) -> None:
    """Shape check of an elementwise op (broadcasting): matrices never meet tokens or plain vectors."""
    union = _union(*(n.axes for n in nodes))
    if "E" not in union:
        return
    if "N" in union:
        tok = next(n for n in nodes if "N" in n.axes)
        raise fail(f"{what} between a head-matrix [B,H,D,D] and a {kind_name(tok.axes)} would be a per-token "
                   "matrix [B,H,N,D,D], which is not supported",
                   "reduce the matrix against a vector first: vt.matvec(m, x) or vt.quad(m, x)")
    for n in nodes:
        if "D" in n.axes and "E" not in n.axes:
            raise fail(f"{what} between a head-matrix [B,H,D,D] and a {kind_name(n.axes)} is ambiguous "
                       "(rows or columns?)", "use vt.matvec(m, x) for m @ x, vt.quad(m, x) for x^T m x")


def _binary(op: str, a: Node, b: Node) -> Expr:
    _elementwise(f"'{_OP_SYMBOL.get(op, op)}'" if op in _OP_SYMBOL else f"vt.{op}", a, b)
    return Expr(Binary(op, a, b))


def _arith(op: str, a: Any, b: Any) -> Expr:
    return _binary(op, _to_float(_as_node(a)), _to_float(_as_node(b)))


def _cmp(op: str, a: Any, b: Any) -> Expr:
    return _binary(op, _to_float(_as_node(a)), _to_float(_as_node(b)))


def _logic(op: str, a: Any, b: Any) -> Expr:
    return _binary(op, _to_bool(_as_node(a), f"operand of '{op}'"), _to_bool(_as_node(b), f"operand of '{op}'"))


def _unary(op: str, x: Any) -> Expr:
    return Expr(Unary(op, _to_float(_as_node(x))))


def where(cond: Any, a: Any, b: Any) -> Expr:
    """Elementwise ``a if cond else b`` (use instead of Python ``if`` on tensors)."""
    c, x, y = _to_bool(_as_node(cond), "where() condition"), _to_float(_as_node(a)), _to_float(_as_node(b))
    _elementwise("vt.where", c, x, y)
    return Expr(Where(c, x, y))


def maximum(a: Any, b: Any) -> Expr:
    return _arith("maximum", a, b)


def minimum(a: Any, b: Any) -> Expr:
    return _arith("minimum", a, b)


def clamp(x: Any, min: float | None = None, max: float | None = None) -> Expr:  # noqa: A002
    out = x if isinstance(x, Expr) else Expr(_as_node(x))
    if min is not None:
        out = maximum(out, min)
    if max is not None:
        out = minimum(out, max)
    return out


def log(x: Any) -> Expr:
    return _unary("log", x)


def exp(x: Any) -> Expr:
    return _unary("exp", x)


def sqrt(x: Any) -> Expr:
    return _unary("sqrt", x)


def abs(x: Any) -> Expr:  # noqa: A001
    return _unary("abs", x)


def sigmoid(x: Any) -> Expr:
    return _unary("sigmoid", x)


def tanh(x: Any) -> Expr:
    return _unary("tanh", x)


def isnan(x: Any) -> Expr:
    return Expr(Unary("isnan", _to_float(_as_node(x))))


def _pool(op: str, x: Any, size: Any) -> Expr:
    if isinstance(size, Expr) or not isinstance(size, int) or isinstance(size, bool):
        raise fail(f"got pool size {size!r}, expected a Python int", "e.g. vt.max_pool(s.attn_window, 7)")
    if size < 1 or size % 2 == 0 or size > MAX_POOL_SIZE:
        raise fail(f"got pool size {size}, expected an odd int in [1, {MAX_POOL_SIZE}]",
                   "centred windows need an odd size, e.g. 5 or 7")
    return Expr(Pool(op, _to_float(_as_node(x)), size))


def max_pool(x: Any, size: int) -> Expr:
    """Max over a centred window of ``size`` tokens (tokens past the length are ignored)."""
    return _pool("max", x, size)


def avg_pool(x: Any, size: int) -> Expr:
    """Sum over a centred window of ``size`` tokens divided by ``size`` (missing tokens count 0)."""
    return _pool("avg", x, size)


def head_mean(x: Any) -> Expr:
    """Mean over the KV heads of a layer: every head then scores tokens alike."""
    return Expr(HeadMean(_to_float(_as_node(x))))


# --------------------------------------------------------------------------- vector ops (head dimension D)

_VECTORS_HINT = ("vectors are s.key, s.value (per token), s.query_mean, s.query_mean_future (per head); "
                 "scale a vector with * or /, reduce it to a scalar with vt.dot / vt.norm / vt.cosine")


def _vector(fn: str, x: Any, which: str) -> Node:
    n = _to_float(_as_node(x, f"{which} argument of vt.{fn}"))
    if "D" not in n.axes or "E" in n.axes:
        raise fail(f"vt.{fn} expects two vectors of the same D, got {kind_name(n.axes)} as its {which} argument"
                   if fn in ("dot", "cosine") else
                   f"vt.{fn} expects a vector [.., D], got {kind_name(n.axes)}", _VECTORS_HINT)
    return n


def dot(a: Any, b: Any) -> Expr:
    """``sum_d a[d] * b[d]`` over the head dimension (in order d = 0..D-1). A token-vector and a
    head-vector broadcast: ``vt.dot(s.key, s.query_mean)`` is ``[B, H, N]``."""
    x, y = _vector("dot", a, "first"), _vector("dot", b, "second")
    return Expr(Dot(x, y))


def norm(x: Any) -> Expr:
    """L2 norm over the head dimension: ``sqrt(vt.dot(x, x))`` (exactly that, IEEE sqrt)."""
    n = _vector("norm", x, "only")
    return Expr(Unary("sqrt", Dot(n, n)))


def cosine(a: Any, b: Any, eps: float = 1e-8) -> Expr:
    """Cosine similarity over the head dimension:
    ``vt.dot(a, b) / vt.maximum(vt.norm(a) * vt.norm(b), eps)`` (torch's ``F.cosine_similarity``)."""
    x, y = _vector("cosine", a, "first"), _vector("cosine", b, "second")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise fail(f"got eps={eps!r}, expected a Python number", "e.g. vt.cosine(a, b, eps=1e-8)")
    na, nb = Unary("sqrt", Dot(x, x)), Unary("sqrt", Dot(y, y))
    return Expr(Binary("div", Dot(x, y), Binary("maximum", Binary("mul", na, nb), Const(float(eps)))))


def matvec(m: Any, x: Any) -> Expr:
    """``m @ x`` for a head-matrix ``m`` ``[B, H, (G,) D, D]`` and a vector ``x``: ``y[d] = sum_e m[d, e] * x[e]``
    (in order e = 0..D-1)."""
    mn = _to_float(_as_node(m, "first argument of vt.matvec"))
    if "E" not in mn.axes:
        raise fail(f"vt.matvec expects a head-matrix [B,H,D,D] as its first argument, got {kind_name(mn.axes)}",
                   "matrices: s.query_cov_future")
    xn = _to_float(_as_node(x, "second argument of vt.matvec"))
    if "D" not in xn.axes or "E" in xn.axes:
        raise fail(f"vt.matvec expects a vector as its second argument, got {kind_name(xn.axes)}", _VECTORS_HINT)
    return Expr(MatVec(mn, xn))


def quad(m: Any, x: Any) -> Expr:
    """The quadratic form ``x^T m x`` = ``vt.dot(x, vt.matvec(m, x))`` (exactly that order)."""
    y = matvec(m, x).node
    assert isinstance(y, MatVec)
    return Expr(Dot(y.x, y))


# --------------------------------------------------------------------------- token reductions and chunks


def _per_token(fn: str, x: Any) -> Node:
    n = _to_float(_as_node(x, f"argument of vt.{fn}"))
    if "N" not in n.axes:
        raise fail(f"vt.{fn} reduces over the tokens of a row and expects a per-token value [B,H,N..], "
                   f"got {kind_name(n.axes)}", "it is already one value per head; use it directly")
    return n


def token_sum(x: Any) -> Expr:
    """Sum over the live tokens of each row (``n < lengths[b]``; padding never contributes): one value
    per head, broadcast over the tokens. A token-vector gives a head-vector."""
    return Expr(TokenReduce("sum", _per_token("token_sum", x)))


def token_mean(x: Any) -> Expr:
    """``vt.token_sum(x) / length`` over the live tokens of each row (NaN for an empty row)."""
    return Expr(TokenReduce("mean", _per_token("token_mean", x)))


def token_max(x: Any) -> Expr:
    """Max over the live tokens of each row (``-inf`` for an empty row; NaN if any is NaN)."""
    return Expr(TokenReduce("max", _per_token("token_max", x)))


def token_std(x: Any) -> Expr:
    """Population standard deviation over the live tokens of each row (divides by the length, not
    length - 1): ``sqrt(token_mean((x - token_mean(x)) * (x - token_mean(x))))``."""
    n = _per_token("token_std", x)
    d = Binary("sub", n, TokenReduce("mean", n))
    return Expr(Unary("sqrt", TokenReduce("mean", Binary("mul", d, d))))


def softmax(x: Any) -> Expr:
    """Softmax over the live tokens of each row: ``e / vt.token_sum(e)`` with
    ``e = exp(x - vt.token_max(x))`` (padding never contributes)."""
    n = _per_token("softmax", x)
    e = Unary("exp", Binary("sub", n, TokenReduce("max", n)))
    return Expr(Binary("div", e, TokenReduce("sum", e)))


def _chunk(op: str, x: Any, size: Any) -> Expr:
    if isinstance(size, Expr) or not isinstance(size, int) or isinstance(size, bool):
        raise fail(f"got chunk size {size!r}, expected a Python int", f"e.g. vt.chunk_{op}(s.attn_window, 8)")
    if size < 1 or size > MAX_CHUNK_SIZE:
        raise fail(f"got chunk size {size}, expected an int in [1, {MAX_CHUNK_SIZE}]", "ChunkKV uses 10 or 20")
    return Expr(Chunk(op, _per_token(f"chunk_{op}", x), size))


def chunk_mean(x: Any, size: int) -> Expr:
    """Mean of ``x`` over the live tokens of its chunk: chunk k = row indices [k*size, (k+1)*size) of the
    logical view (aligned to the first live token); every token gets its chunk's value."""
    return _chunk("mean", x, size)


def chunk_max(x: Any, size: int) -> Expr:
    """Max of ``x`` over the live tokens of its chunk (see vt.chunk_mean)."""
    return _chunk("max", x, size)


def group_mean(x: Any) -> Expr:
    """Mean over the G query heads of a KV head (in order g = 0..G-1), e.g. of a per-query-head softmax."""
    n = _to_float(_as_node(x, "argument of vt.group_mean"))
    if "G" not in n.axes:
        raise fail(f"vt.group_mean averages over the G query heads of a KV head and expects a per-query-head "
                   f"value, got {kind_name(n.axes)}", "per-query-head statistics: s.query_mean_future, "
                   "s.query_cov_future")
    return Expr(GroupMean(n))


_TORCH_FUNCS: dict[Callable[..., Any], Callable[..., Expr]] = {}


def _register_torch() -> None:
    t = torch
    pairs: list[tuple[Any, Callable[..., Expr]]] = [
        (t.log, log), (t.exp, exp), (t.sqrt, sqrt), (t.abs, abs), (t.sigmoid, sigmoid), (t.tanh, tanh),
        (t.isnan, isnan), (t.where, where), (t.maximum, maximum), (t.minimum, minimum), (t.clamp, clamp),
        (t.neg, lambda x: -x), (t.add, lambda a, b: _arith("add", a, b)), (t.sub, lambda a, b: _arith("sub", a, b)),
        (t.mul, lambda a, b: _arith("mul", a, b)), (t.div, lambda a, b: _arith("div", a, b)),
        (t.pow, lambda a, b: _arith("pow", a, b)),
        (t.Tensor.log, log), (t.Tensor.exp, exp), (t.Tensor.sqrt, sqrt), (t.Tensor.abs, abs),
        (t.Tensor.sigmoid, sigmoid), (t.Tensor.tanh, tanh), (t.Tensor.clamp, clamp),
        (t.nn.functional.sigmoid, sigmoid) if hasattr(t.nn.functional, "sigmoid") else (t.sigmoid, sigmoid),
    ]
    for f, g in pairs:
        _TORCH_FUNCS[f] = g


_register_torch()

_CONTROL_FLOW_HINT = "use vt.where(cond, a, b) for value-dependent choices; Python if/and/or/bool() cannot see tensor values"


class Expr:
    """A symbolic ``[B, H, N]`` tensor handed to a score function while it is traced."""

    __slots__ = ("node",)
    __array_priority__ = 1000

    def __init__(self, node: Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        return f"Expr({self.node!r})"

    # arithmetic
    def __add__(self, o: Any) -> Expr: return _arith("add", self, o)
    def __radd__(self, o: Any) -> Expr: return _arith("add", o, self)
    def __sub__(self, o: Any) -> Expr: return _arith("sub", self, o)
    def __rsub__(self, o: Any) -> Expr: return _arith("sub", o, self)
    def __mul__(self, o: Any) -> Expr: return _arith("mul", self, o)
    def __rmul__(self, o: Any) -> Expr: return _arith("mul", o, self)
    def __truediv__(self, o: Any) -> Expr: return _arith("div", self, o)
    def __rtruediv__(self, o: Any) -> Expr: return _arith("div", o, self)
    def __pow__(self, o: Any) -> Expr: return _arith("pow", self, o)
    def __rpow__(self, o: Any) -> Expr: return _arith("pow", o, self)
    def __neg__(self) -> Expr: return _unary("neg", self)
    def __pos__(self) -> Expr: return self
    def __abs__(self) -> Expr: return _unary("abs", self)

    # comparisons
    def __lt__(self, o: Any) -> Expr: return _cmp("lt", self, o)
    def __le__(self, o: Any) -> Expr: return _cmp("le", self, o)
    def __gt__(self, o: Any) -> Expr: return _cmp("gt", self, o)
    def __ge__(self, o: Any) -> Expr: return _cmp("ge", self, o)
    def __eq__(self, o: Any) -> Expr: return _cmp("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Expr: return _cmp("ne", self, o)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]

    # logic
    def __and__(self, o: Any) -> Expr: return _logic("and", self, o)
    def __rand__(self, o: Any) -> Expr: return _logic("and", o, self)
    def __or__(self, o: Any) -> Expr: return _logic("or", self, o)
    def __ror__(self, o: Any) -> Expr: return _logic("or", o, self)

    def __invert__(self) -> Expr:
        return Expr(Unary("not", _to_bool(self.node, "operand of '~'")))

    # tensor-style methods
    def log(self) -> Expr: return log(self)
    def exp(self) -> Expr: return exp(self)
    def sqrt(self) -> Expr: return sqrt(self)
    def abs(self) -> Expr: return abs(self)
    def sigmoid(self) -> Expr: return sigmoid(self)
    def tanh(self) -> Expr: return tanh(self)
    def isnan(self) -> Expr: return isnan(self)
    def clamp(self, min: float | None = None, max: float | None = None) -> Expr:  # noqa: A002
        return clamp(self, min, max)
    def float(self) -> Expr: return Expr(_to_float(self.node))

    # what is refused, with the fix
    def __bool__(self) -> bool:
        raise fail("Python control flow on a tensor value (if/while/and/or/not/bool())", _CONTROL_FLOW_HINT)

    def __len__(self) -> int:
        raise fail("len() of a statistic: the token count is not known while tracing",
                   "scores are elementwise; the framework applies the budget")

    def __iter__(self) -> Any:
        raise fail("iterating over a statistic", "write elementwise math; use vt.max_pool/vt.avg_pool for neighbours")

    def __index__(self) -> int:
        raise fail("a statistic used as an integer/index", "scores cannot index; use vt.where")

    def __int__(self) -> int:
        raise fail("int() of a statistic", _CONTROL_FLOW_HINT)

    def __float__(self) -> float:
        raise fail("float() of a statistic", _CONTROL_FLOW_HINT)

    def __getitem__(self, item: Any) -> Expr:
        raise fail("indexing/slicing a statistic", "scores are elementwise over [B, H, N]; use vt.max_pool/vt.avg_pool "
                   "for neighbouring tokens, vt.head_mean across heads, vt.token_mean/token_max over the row, "
                   "vt.dot/vt.norm over the head dimension")

    @property
    def shape(self) -> str:
        """The symbolic shape, e.g. ``token-vector [B,H,N,D]``."""
        return kind_name(self.node.axes)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise fail("in-place assignment into a statistic", "build a new value: x = vt.where(mask, new, x)")

    def __matmul__(self, o: Any) -> Expr:
        raise fail("'@' on a statistic", "use vt.dot(a, b) for vectors, vt.matvec(m, x) / vt.quad(m, x) for matrices")

    __rmatmul__ = __matmul__

    def _inplace(self, *args: Any, **kw: Any) -> Expr:
        raise fail("in-place operation on a statistic", "write x = x + y instead of x += y / x.add_(y)")

    __iadd__ = __isub__ = __imul__ = __itruediv__ = __ipow__ = __iand__ = __ior__ = _inplace  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_") and not name.startswith("_"):
            raise fail(f"in-place method .{name}() on a statistic", "use the out-of-place form, e.g. x.add(y) -> x + y")
        hint = {"sum": "vt.token_sum(x) over tokens, vt.dot(x, y) over D", "mean": "vt.token_mean(x) over tokens, "
                "vt.head_mean(x) over heads, vt.group_mean(x) over query heads", "max": "vt.token_max(x) over "
                "tokens, vt.maximum(a, b) elementwise", "std": "vt.token_std(x) (population)", "norm": "vt.norm(x)",
                "softmax": "vt.softmax(x) over the tokens of a row", "matmul": "vt.matvec(m, x)",
                "dot": "vt.dot(a, b)"}.get(name)
        raise fail(f"unsupported tensor method .{name}() in a policy score",
                   hint or "supported: + - * / ** comparisons & | ~, .log .exp .sqrt .abs .sigmoid .tanh .clamp, "
                   "vt.where/maximum/minimum/max_pool/avg_pool/head_mean, vt.dot/norm/cosine/matvec/quad, "
                   "vt.token_sum/token_mean/token_max/token_std/softmax, vt.chunk_mean/chunk_max, vt.group_mean")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        impl = _TORCH_FUNCS.get(func)
        if impl is None:
            name = getattr(func, "__name__", repr(func))
            hint = {"cosine_similarity": "use vt.cosine(a, b)", "softmax": "use vt.softmax(x) (over the tokens of a "
                    "row)", "norm": "use vt.norm(x)", "dot": "use vt.dot(a, b)", "matmul": "use vt.matvec(m, x)",
                    "mean": "use vt.token_mean / vt.head_mean / vt.group_mean", "sum": "use vt.token_sum / vt.dot",
                    "std": "use vt.token_std (population)", "amax": "use vt.token_max", "max": "use vt.token_max "
                    "over tokens, vt.maximum elementwise"}.get(name)
            raise fail(f"torch.{name} is not supported in a policy score",
                       hint or "scores are elementwise; the framework does top-k, budgets and pins. Supported: "
                       "log exp sqrt abs sigmoid tanh isnan where maximum minimum clamp add sub mul div pow; "
                       "vt.dot/norm/cosine/matvec/quad, vt.token_sum/token_mean/token_max/token_std/softmax, "
                       "vt.chunk_mean/chunk_max, vt.group_mean")
        return impl(*args, **kwargs)


class TracingStats:
    """The symbolic TokenStats handed to a score function at decoration time."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Expr:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in CATALOG:
            import difflib

            close = difflib.get_close_matches(name, list(CATALOG), n=1)
            hint = f"did you mean s.{close[0]}?" if close else "known: " + ", ".join(CATALOG)
            raise fail(f"unknown statistic s.{name}", hint)
        self.read.append(name)
        return Expr(Stat(name))


def source_hash(node: Node) -> str:
    import hashlib

    return hashlib.sha256(repr(node).encode()).hexdigest()[:16]


def is_finite_const(node: Node) -> bool:
    return isinstance(node, Const) and math.isfinite(node.value)
