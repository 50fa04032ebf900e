"""The policy IR: what a score function is traced into at decoration time.

A score function is plain tensor math over :class:`~vtoken_sdk.stats.TokenStats`.
Decoration runs it once on symbolic statistics; every operation builds a node::

    h2o:    Stat(attn_sum)
    snapkv: Pool(max, Binary(div, Stat(attn_window), Const(32.0)), size=7)
    tova:   HeadMean(Stat(attn_last))

Node kinds (all frozen, hashable, structural equality):

=========  ================================================================
Stat       a catalog statistic, ``[B, H, N]``
Const      a Python number (hyper-parameters become constants)
Unary      neg abs log exp sqrt sigmoid tanh isnan not float
Binary     add sub mul div pow maximum minimum | lt le gt ge eq ne | and or
Where      where(cond, a, b)
Pool       max/avg over a centred window of ``size`` tokens along N
HeadMean   mean over the KV heads of a layer (result broadcasts over H)
=========  ================================================================

Everything else - Python control flow on tensor values, in-place updates,
indexing, reductions over N, unknown torch functions - raises
:class:`~vtoken_sdk.errors.PolicyDefinitionError` naming file:line and the fix.
Backends (torch reference, Triton codegen) walk this IR; they never run user code.
"""

from __future__ import annotations

import contextvars
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import PolicyDefinitionError, frame_in_file

UNARY_FLOAT = ("neg", "abs", "log", "exp", "sqrt", "sigmoid", "tanh")
UNARY_TO_BOOL = ("isnan",)
BINARY_ARITH = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
BINARY_CMP = ("lt", "le", "gt", "ge", "eq", "ne")
BINARY_LOGIC = ("and", "or")
POOL_OPS = ("max", "avg")
MAX_POOL_SIZE = 63


class Node:
    """Base of IR nodes. ``dtype`` is ``"f32"`` or ``"bool"``."""

    dtype: str = "f32"

    def children(self) -> tuple[Node, ...]:
        return ()


@dataclass(frozen=True)
class Stat(Node):
    name: str

    def __repr__(self) -> str:
        return f"s.{self.name}"


@dataclass(frozen=True)
class Const(Node):
    value: float

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Unary(Node):
    op: str
    x: Node

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

    def children(self) -> tuple[Node, ...]:
        return (self.cond, self.a, self.b)

    def __repr__(self) -> str:
        return f"where({self.cond!r}, {self.a!r}, {self.b!r})"


@dataclass(frozen=True)
class Pool(Node):
    op: str
    x: Node
    size: int

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"{self.op}_pool({self.x!r}, {self.size})"


@dataclass(frozen=True)
class HeadMean(Node):
    x: Node

    def children(self) -> tuple[Node, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"head_mean({self.x!r})"


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


def _arith(op: str, a: Any, b: Any) -> Expr:
    return Expr(Binary(op, _to_float(_as_node(a)), _to_float(_as_node(b))))


def _cmp(op: str, a: Any, b: Any) -> Expr:
    return Expr(Binary(op, _to_float(_as_node(a)), _to_float(_as_node(b))))


def _logic(op: str, a: Any, b: Any) -> Expr:
    return Expr(Binary(op, _to_bool(_as_node(a), f"operand of '{op}'"), _to_bool(_as_node(b), f"operand of '{op}'")))


def _unary(op: str, x: Any) -> Expr:
    return Expr(Unary(op, _to_float(_as_node(x))))


def where(cond: Any, a: Any, b: Any) -> Expr:
    """Elementwise ``a if cond else b`` (use instead of Python ``if`` on tensors)."""
    return Expr(Where(_to_bool(_as_node(cond), "where() condition"), _to_float(_as_node(a)), _to_float(_as_node(b))))


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
                   "for neighbouring tokens and vt.head_mean across heads")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise fail("in-place assignment into a statistic", "build a new value: x = vt.where(mask, new, x)")

    def _inplace(self, *args: Any, **kw: Any) -> Expr:
        raise fail("in-place operation on a statistic", "write x = x + y instead of x += y / x.add_(y)")

    __iadd__ = __isub__ = __imul__ = __itruediv__ = __ipow__ = __iand__ = __ior__ = _inplace  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_") and not name.startswith("_"):
            raise fail(f"in-place method .{name}() on a statistic", "use the out-of-place form, e.g. x.add(y) -> x + y")
        raise fail(f"unsupported tensor method .{name}() in a policy score",
                   "supported: + - * / ** comparisons & | ~, .log .exp .sqrt .abs .sigmoid .tanh .clamp, "
                   "vt.where/maximum/minimum/max_pool/avg_pool/head_mean")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        impl = _TORCH_FUNCS.get(func)
        if impl is None:
            name = getattr(func, "__name__", repr(func))
            raise fail(f"torch.{name} is not supported in a policy score",
                       "scores are elementwise; the framework does top-k, budgets and pins. Supported: "
                       "log exp sqrt abs sigmoid tanh isnan where maximum minimum clamp add sub mul div pow")
        return impl(*args, **kwargs)


class TracingStats:
    """The symbolic TokenStats handed to a score function at decoration time."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Expr:
        from .stats import CATALOG

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
