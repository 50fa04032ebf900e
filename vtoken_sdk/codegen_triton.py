"""Policy IR -> Triton source: one fused score+select kernel per policy.

``generate(policy)`` returns a :class:`GeneratedPolicy` whose ``source`` is a complete, importable
Python module (``vtoken-cli compile FILE --emit triton`` prints it). It holds:

``_score(l, h, o, ...)``   the policy's score for tokens ``o`` of row (layer ``l``, KV head ``h``),
                           straight from the IR: stored statistics are loaded, derived ones
                           (``position``, ``age``, ``random``, ``layer``, ``num_layers``, ``head``,
                           ``head_dim``) computed;
                           pools reload the shifted window (no intermediate tensor), head means loop
                           over heads. Vector values are evaluated one component at a time: ``vt.dot``
                           loops ``d = 0..D-1`` (``acc = -0.0; acc = acc + a_d * b_d``), ``vt.matvec``
                           loops ``e``, ``vt.group_mean`` loops ``g = 0..G-1``, chunks loop over their
                           ``size`` tokens; loop-invariant subexpressions are hoisted out of each loop.
``rowval_kernel_<i>``      one pre-pass per token reduction (``vt.token_*``, ``vt.softmax``), grid
                           ``(B, L*H)``, in dependency order: ``TOKEN_LANES`` lanes over the live tokens
                           (tiles of ``TOKEN_LANES`` tokens added in order), a pairwise tree over the
                           lanes (``tl.reshape`` + ``tl.split``), stored to the ``[B, L*H, RV_K]`` scratch
                           that ``_score`` loads (every component ``g``, ``d`` of a vector value).
``_pins(l, h, o, ...)``    the protection rules (sinks, recent, spans, predicates) | batch pins.
``_tile(r, o, ...)``       ``(u, valid)``: the selection key of every token of output row ``r`` as
                           an unsigned int (see below); at request granularity the ordered mean of
                           all ``L*H`` rows' scores and the union of their pins.
``pin_count_kernel``       pre-pass, grid ``(B, R_OUT)``: pinned valid tokens per row.
``select_kernel``          grid ``(B, R_OUT)``: ``k = min(len, max(budget, max_r pins))``, then a
                           4-pass radix select (8 bits per pass, ``tl.histogram``) of the k-th
                           largest key and a last pass that keeps the larger indices among ties.
``scores_kernel``          debug: writes the scores (not used by ``keep_mask``).

Selection key (same contract as :mod:`vtoken_sdk.selection`): ``s = score + 0.0``, NaN -> -inf,
``key = bits if bits >= 0 else bits ^ 0x7FFFFFFF`` (int32, monotone), ``u = key ^ 0x80000000``
(uint32, same order, unsigned), pinned tokens ``u = 0xFFFFFFFF`` (above every finite or infinite
score). Keeping the k largest ``(u, index)`` pairs is exactly the torch backend's composite-key top-k.

Exactness: arithmetic uses IEEE-rounded ops only (``tl.div_rn``, ``tl.sqrt_rn``, add/sub/mul with FP
contraction disabled at launch), constants are emitted as exact float32 bit patterns, reductions add
in the torch backend's order. ``exp`` (and ``sigmoid``, ``vt.softmax``) is a fixed sequence of such ops
shared with the torch backend (``torch_backend.exp_det``), so it is exact too. ``log``/``tanh``/``pow`` use
libdevice on GPUs (and numpy-backed Triton ops under the interpreter): within a few ulp, not
bit-exact (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from . import ir
from .protect import AnyOf, Predicate, Recent, Rule, Sinks, Span
from .stats import CATALOG

if TYPE_CHECKING:
    from .policy import Policy

CODEGEN_VERSION = "3"
APPROX_UNARY = ("log", "tanh")
EXP_UNARY = ("exp", "sigmoid")  # exact: a fixed IEEE sequence shared with the torch backend (torch_backend.exp_det)
APPROX_BINARY = ("pow",)
RADIX_PASSES = ((0x00000000, 24), (0xFF000000, 16), (0xFFFF0000, 8), (0xFFFFFF00, 0))


@dataclass(frozen=True)
class GeneratedPolicy:
    name: str
    key: str  # cache key: IR + protection + granularity + seed + codegen version
    source: str
    stats: tuple[str, ...]  # stored statistics, in kernel argument order
    granularity: str
    exact: bool  # False when an approximate (transcendental) op is used
    args: tuple[tuple[str, str], ...] = ()  # shared kernel arguments (name, triton type), see kernel_args
    vectors: tuple[str, ...] = ()  # vector statistics, in kernel argument order
    reductions: tuple[tuple[str, ...], ...] = ()  # axes of each row value (rowval_kernel_<i>), in launch order
    heavy: bool = False  # loops per token (D, chunks, query heads): launched with twice the warps

    def rv_size(self, d: int, g: int) -> int:
        """``RV_K``: floats of row values per row for head dimension ``d`` and ``g`` query heads per KV head."""
        return sum((g if "G" in ax else 1) * (d if "D" in ax else 1) for ax in self.reductions)


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _rules(rules: tuple[Rule, ...]) -> list[Rule]:
    out: list[Rule] = []
    for r in rules:
        out.extend(_rules(r.rules) if isinstance(r, AnyOf) else [r])
    return out


def _rule_repr(r: Rule) -> str:
    if isinstance(r, Predicate):
        return f"Predicate({r.node!r})"
    return repr(r)


def policy_key(policy: Policy) -> str:
    spec = policy.spec
    text = "|".join([CODEGEN_VERSION, repr(policy.node), ";".join(_rule_repr(r) for r in _rules(spec.protect)),
                     spec.granularity, str(spec.stats.seed)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hash_seed(seed: int) -> int:
    return (seed * 0x9E3779B1) & 0xFFFFFFFF


class Ctx(NamedTuple):
    """Where a node is evaluated: code for the layer, KV head, query head (G), tokens (N), and the
    head-dimension indices (D, E); ``None`` for an axis not bound here."""

    l: str  # noqa: E741 - the layer, as in the generated code
    h: str
    g: str | None = None
    o: str | None = None
    d: str | None = None
    e: str | None = None


_AXIS_FIELD = {"G": "g", "N": "o", "D": "d", "E": "e"}
_NEG_ZERO = -0.0


def _bound_by(node: ir.Node) -> frozenset[str]:
    """Axes whose index a node rebinds for its children (their loops)."""
    if isinstance(node, ir.Dot):
        return frozenset({"D"})
    if isinstance(node, ir.MatVec):
        return frozenset({"D", "E"})
    if isinstance(node, (ir.Pool, ir.Chunk)):
        return frozenset({"N"})
    if isinstance(node, ir.GroupMean):
        return frozenset({"G"})
    return frozenset()


class _Emitter:
    """Emits straight-line Triton code for IR nodes evaluated at a context :class:`Ctx`.

    Token-level values (``N`` in ``node.axes``) are ``[BLOCK]`` tensors; head-level ones may be 0-d
    (broadcast). Vector/matrix nodes are evaluated one component at a time (``ctx.d``/``ctx.e``); the
    reductions over D, E, G, chunks and pools loop over the index in the torch backend's order. Token
    reductions are row values computed by the ``rowval_kernel_<i>`` pre-passes and loaded here.
    """

    def __init__(self, seed: int, reductions: list[ir.TokenReduce] | None = None) -> None:
        self.lines: list[str] = []
        self.depth = 1
        self.count = 0
        self.scopes: list[dict[object, str]] = [{}]
        self.seed = seed
        self.approx = False
        self.uses_exp = False
        self.reductions = reductions or []

    def emit(self, s: str) -> None:
        self.lines.append("    " * self.depth + s)

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def _get(self, key: object) -> str | None:
        for sc in reversed(self.scopes):
            if key in sc:
                return sc[key]
        return None

    def _put(self, key: object, var: str) -> str:
        self.scopes[-1][key] = var
        return var

    def push(self) -> None:
        self.scopes.append({})
        self.depth += 1

    def pop(self) -> None:
        self.scopes.pop()
        self.depth -= 1

    # ------------------------------------------------------------------ leaves
    def const(self, v: float) -> str:
        key = ("const", _f32_bits(v))
        got = self._get(key)
        if got:
            return got
        var = self.fresh("c")
        self.emit(f"{var} = tl.full([BLOCK], {_f32_bits(v)}, tl.int32).to(tl.float32, bitcast=True)  # {v!r}")
        return self._put(key, var)

    def inb(self, o: str) -> str:
        key = ("inb", o)
        got = self._get(key)
        if got:
            return got
        var = self.fresh("inb")
        self.emit(f"{var} = ({o} >= 0) & ({o} < N)")
        return self._put(key, var)

    def pos(self, ctx: Ctx) -> str:
        key = ("pos", ctx.l, ctx.h, ctx.o)
        got = self._get(key)
        if got:
            return got
        assert ctx.o is not None
        var = self.fresh("pos")
        self.emit(f"{var} = tl.load(pos_ptr + b * pos_sb + {ctx.l} * pos_sl + {ctx.h} * pos_sh + {ctx.o}, "
                  f"mask={self.inb(ctx.o)}, other=0)")
        return self._put(key, var)

    # ------------------------------------------------------------------ nodes
    @staticmethod
    def _key(node: ir.Node, ctx: Ctx) -> tuple[object, ...]:
        return (node, ctx.l, ctx.h, *(getattr(ctx, _AXIS_FIELD[a]) for a in ir.AXES if a in node.axes))

    def gen(self, node: ir.Node, ctx: Ctx) -> str:
        if isinstance(node, ir.Const):
            return self.const(node.value)
        key = self._key(node, ctx)
        got = self._get(key)
        if got:
            return got
        var = self._gen(node, ctx)
        return self._put(key, var)

    def pregen(self, node: ir.Node, ctx: Ctx, axis: str, bound: frozenset[str] = frozenset()) -> None:
        """Generate, before a loop over ``axis``, every subexpression of ``node`` that does not depend on
        it (nor on an index rebound deeper in the graph), so the loop body reuses it."""
        if isinstance(node, (ir.TokenReduce, ir.HeadMean)):
            return
        kb = bound | _bound_by(node)
        for c in node.children():
            if isinstance(c, ir.Const):
                continue
            if axis not in c.axes and not (kb & set(c.axes)):
                self.gen(c, ctx)
            else:
                self.pregen(c, ctx, axis, kb)

    def _stat(self, node: ir.Stat, ctx: Ctx, var: str) -> None:
        info = CATALOG.get(node.name)
        if node.name == "position":
            self.emit(f"{var} = {self.pos(ctx)}.to(tl.float32)")
        elif node.name == "age":
            self.emit(f"{var} = (seq_len - 1 - {self.pos(ctx)}).to(tl.float32)")
        elif node.name == "random":
            self.emit(f"{var} = _hash_uniform({_hash_seed(self.seed)}, {ctx.l} + layer_offset, {ctx.h} + head_offset, "
                      f"{self.pos(ctx)})")
        elif node.name == "layer":
            self.emit(f"{var} = (tl.zeros([BLOCK], dtype=tl.int32) + ({ctx.l}) + layer_offset).to(tl.float32)")
        elif node.name == "num_layers":
            self.emit(f"{var} = (tl.zeros([BLOCK], dtype=tl.int32) + num_layers).to(tl.float32)")
        elif node.name == "head":
            self.emit(f"{var} = (tl.zeros([BLOCK], dtype=tl.int32) + ({ctx.h}) + head_offset).to(tl.float32)")
        elif node.name == "head_dim":
            self.emit(f"{var} = (tl.zeros([BLOCK], dtype=tl.int32) + D).to(tl.float32)")
        elif info is not None and info.kind == "vector":
            p = f"v_{node.name}"
            addr = f"{p}_ptr + b * {p}_sb + {ctx.l} * {p}_sl + {ctx.h} * {p}_sh"
            for a in info.axes:
                idx = getattr(ctx, _AXIS_FIELD[a])
                assert idx is not None, (node, a, ctx)
                addr += f" + {idx} * {p}_s{a.lower()}"
            if "N" in info.axes:
                assert ctx.o is not None
                self.emit(f"{var} = tl.load({addr}, mask={self.inb(ctx.o)}, other=0.0)")
            else:
                self.emit(f"{var} = tl.load({addr})")
        else:
            assert ctx.o is not None
            p = f"s_{node.name}"
            self.emit(f"{var} = tl.load({p}_ptr + b * {p}_sb + {ctx.l} * {p}_sl + {ctx.h} * {p}_sh + {ctx.o}, "
                      f"mask={self.inb(ctx.o)}, other=0.0)")

    def _gen(self, node: ir.Node, ctx: Ctx) -> str:
        o = ctx.o
        var = self.fresh("v")
        if isinstance(node, ir.Stat):
            self._stat(node, ctx, var)
            return var
        if isinstance(node, ir.Unary):
            x = self.gen(node.x, ctx)
            op = node.op
            if op in APPROX_UNARY:
                self.approx = True
            if op in EXP_UNARY:
                self.uses_exp = True
            one = self.const(1.0) if op == "sigmoid" else ""
            expr = {
                "neg": f"({x}.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)",
                "abs": f"tl.abs({x})", "sqrt": f"tl.sqrt_rn({x})", "log": f"_log({x})",
                "exp": f"_exp({x})", "tanh": f"_tanh({x})", "isnan": f"{x} != {x}", "not": f"~{x}",
                "float": f"{x}.to(tl.float32)",
                "sigmoid": f"tl.div_rn({one}, {one} + _exp(-{x}))",
            }[op]
            self.emit(f"{var} = {expr}")
            return var
        if isinstance(node, ir.Binary):
            a, b_ = self.gen(node.a, ctx), self.gen(node.b, ctx)
            if node.op in APPROX_BINARY:
                self.approx = True
            expr = {
                "add": f"{a} + {b_}", "sub": f"{a} - {b_}", "mul": f"{a} * {b_}", "div": f"tl.div_rn({a}, {b_})",
                "pow": f"_pow({a}, {b_})",
                "maximum": f"tl.maximum({a}, {b_}, propagate_nan=tl.PropagateNan.ALL)",
                "minimum": f"tl.minimum({a}, {b_}, propagate_nan=tl.PropagateNan.ALL)",
                "lt": f"{a} < {b_}", "le": f"{a} <= {b_}", "gt": f"{a} > {b_}", "ge": f"{a} >= {b_}",
                "eq": f"{a} == {b_}", "ne": f"{a} != {b_}", "and": f"{a} & {b_}", "or": f"{a} | {b_}",
            }[node.op]
            self.emit(f"{var} = {expr}")
            return var
        if isinstance(node, ir.Where):
            c, a, b_ = self.gen(node.cond, ctx), self.gen(node.a, ctx), self.gen(node.b, ctx)
            self.emit(f"{var} = tl.where({c}, {a}, {b_})")
            return var
        if isinstance(node, ir.Pool):
            assert o is not None
            r = node.size // 2
            fill = self.const(float("-inf") if node.op == "max" else 0.0)
            self.pregen(node, ctx, "N")
            o0 = self.fresh("o")
            self.emit(f"{o0} = {o} - {r}")
            t0 = self.gen(node.x, ctx._replace(o=o0))
            self.emit(f"{var} = tl.where(({o0} >= 0) & ({o0} < n_len), {t0}, {fill})")
            d, o1 = self.fresh("d"), self.fresh("o")
            self.emit(f"for {d} in range({1 - r}, {r + 1}):")
            self.push()
            self.emit(f"{o1} = {o} + {d}")
            t1 = self.gen(node.x, ctx._replace(o=o1))
            term = self.fresh("t")
            self.emit(f"{term} = tl.where(({o1} >= 0) & ({o1} < n_len), {t1}, {fill})")
            if node.op == "max":
                self.emit(f"{var} = tl.maximum({var}, {term}, propagate_nan=tl.PropagateNan.ALL)")
            else:
                self.emit(f"{var} = {var} + {term}")
            self.pop()
            if node.op == "avg":
                self.emit(f"{var} = tl.div_rn({var}, {self.const(float(node.size))})")
            return var
        if isinstance(node, ir.HeadMean):
            t0 = self.gen(node.x, ctx._replace(h="0"))
            self.emit(f"{var} = {t0}")
            hh = self.fresh("hh")
            self.emit(f"for {hh} in range(1, H):")
            self.push()
            t1 = self.gen(node.x, ctx._replace(h=hh))
            self.emit(f"{var} = {var} + {t1}")
            self.pop()
            zero = self.const(0.0)
            self.emit(f"{var} = tl.div_rn({var}, {zero} + H)")
            return var
        if isinstance(node, ir.GroupMean):
            self.pregen(node, ctx, "G")
            t0 = self.gen(node.x, ctx._replace(g="0"))
            self.emit(f"{var} = {t0}")
            gg = self.fresh("gg")
            self.emit(f"for {gg} in range(1, G):")
            self.push()
            t1 = self.gen(node.x, ctx._replace(g=gg))
            self.emit(f"{var} = {var} + {t1}")
            self.pop()
            self.emit(f"{var} = tl.div_rn({var}, {self.const(0.0)} + G)")
            return var
        if isinstance(node, ir.Dot):
            self.pregen(node, ctx, "D")
            self.emit(f"{var} = {self.const(_NEG_ZERO)}")
            dd = self.fresh("dd")
            self.emit(f"for {dd} in range(0, D):")
            self.push()
            inner = ctx._replace(d=dd)
            ta, tb = self.gen(node.a, inner), self.gen(node.b, inner)
            self.emit(f"{var} = {var} + {ta} * {tb}")
            self.pop()
            return var
        if isinstance(node, ir.MatVec):
            assert ctx.d is not None
            self.pregen(node, ctx, "E")
            self.emit(f"{var} = {self.const(_NEG_ZERO)}")
            ee = self.fresh("ee")
            self.emit(f"for {ee} in range(0, D):")
            self.push()
            tm = self.gen(node.m, ctx._replace(e=ee))
            tx = self.gen(node.x, ctx._replace(d=ee, e=None))
            self.emit(f"{var} = {var} + {tm} * {tx}")
            self.pop()
            return var
        if isinstance(node, ir.Chunk):
            assert o is not None
            ident = self.const(float("-inf") if node.op == "max" else _NEG_ZERO)
            self.pregen(node, ctx, "N")
            c0 = self.fresh("c0")
            self.emit(f"{c0} = ({o} // {node.size}) * {node.size}")
            self.emit(f"{var} = {ident}")
            jj, oj = self.fresh("jj"), self.fresh("o")
            self.emit(f"for {jj} in range(0, {node.size}):")
            self.push()
            self.emit(f"{oj} = {c0} + {jj}")
            t = self.gen(node.x, ctx._replace(o=oj))
            term = self.fresh("t")
            self.emit(f"{term} = tl.where({oj} < n_len, {t}, {ident})")
            if node.op == "max":
                self.emit(f"{var} = tl.maximum({var}, {term}, propagate_nan=tl.PropagateNan.ALL)")
            else:
                self.emit(f"{var} = {var} + {term}")
            self.pop()
            if node.op == "mean":
                self.emit(f"{var} = tl.div_rn({var}, tl.minimum(tl.maximum(n_len - {c0}, 0), {node.size})"
                          ".to(tl.float32))")
            return var
        if isinstance(node, ir.TokenReduce):
            i = self.reductions.index(node)
            self.emit(f"{var} = tl.load({_rv_addr(i, self.reductions, ctx)})")
            return var
        raise TypeError(f"unknown IR node {node!r}")  # pragma: no cover - exhaustive

    def pins(self, rules: list[Rule], ctx: Ctx) -> str:
        l_, h, o = ctx.l, ctx.h, ctx.o
        assert o is not None
        var = "pin"
        inb = self.inb(o)
        self.emit(f"{var} = tl.zeros([BLOCK], dtype=tl.int1)")
        self.emit("if HAS_PINNED:")
        self.emit(f"    {var} = {var} | (tl.load(pin_ptr + b * pin_sb + {l_} * pin_sl + {h} * pin_sh + {o}, "
                  f"mask={inb}, other=0) != 0)")
        for r in rules:
            if isinstance(r, Sinks):
                self.emit(f"{var} = {var} | ({self.pos(ctx)} < {r.n})")
            elif isinstance(r, Recent):
                self.emit(f"{var} = {var} | ({self.pos(ctx)} >= seq_len - {r.n})")
            elif isinstance(r, Span):
                p = self.pos(ctx)
                self.emit(f"{var} = {var} | (({p} >= {r.start}) & ({p} < {r.end}))")
            elif isinstance(r, Predicate):
                self.emit(f"{var} = {var} | {self.gen(r.node, ctx)}")
            else:  # pragma: no cover
                raise TypeError(f"unknown protection rule {r!r}")
        return var


def _rv_size(axes: tuple[str, ...]) -> str:
    parts = [a for a in ("G", "D") if a in axes]
    return " * ".join(parts) if parts else "1"


def _rv_addr(i: int, reductions: list[ir.TokenReduce], ctx: Ctx) -> str:
    """Address of row value ``i`` (component ``ctx.g``, ``ctx.d``) of row (``ctx.l``, ``ctx.h``)."""
    off = " + ".join(["0"] + [_rv_size(r.axes) for r in reductions[:i]])
    axes = reductions[i].axes
    idx = ""
    if "G" in axes:
        assert ctx.g is not None
        idx += f" + {ctx.g} * {'D' if 'D' in axes else '1'}"
    if "D" in axes:
        assert ctx.d is not None
        idx += f" + {ctx.d}"
    return f"rv_ptr + b * rv_sb + ({ctx.l} * H + {ctx.h}) * RV_K + ({off}){idx}"


_PRELUDE = '''\
import os

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _hash_uniform(seed_mix, layer, head, pos):
    """vtoken_sdk.torch_backend.hash_uniform with uint32 wrap-around arithmetic."""
    x = (pos * 0 + seed_mix).to(tl.uint32)
    x = x ^ ((pos * 0 + layer).to(tl.uint32) * 0x85EBCA77)
    x = x ^ ((pos * 0 + head).to(tl.uint32) * 0xC2B2AE3D)
    x = x ^ (pos.to(tl.uint32) * 0x27D4EB2F)
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)
'''

_APPROX_HELPERS = '''

if _INTERPRET:  # numpy-backed ops: the interpreter has no libdevice

    @triton.jit
    def _log(x):
        return tl.log(x)

    @triton.jit
    def _tanh(x):
        t = tl.exp(-2.0 * tl.abs(x))
        y = tl.div_rn(1.0 - t, 1.0 + t)
        return tl.where(x < 0, -y, y)

    @triton.jit
    def _pow(a, b):
        r = tl.exp(b * tl.log(tl.abs(a)))
        is_int = b == tl.floor(b)
        odd = is_int & (tl.floor(b * 0.5) * 2.0 != b)
        neg = tl.where(is_int, tl.where(odd, -r, r), float("nan"))
        return tl.where(b == 0.0, 1.0, tl.where(a < 0, neg, r))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _log(x):
        return libdevice.log(x)

    @triton.jit
    def _tanh(x):
        return libdevice.tanh(x)

    @triton.jit
    def _pow(a, b):
        return libdevice.pow(a, b)
'''


def _exp_helper() -> str:
    c = ir.EXP_CONSTANTS
    return f'''

@triton.jit
def _exp(x):
    """vtoken_sdk.torch_backend.exp_det: a fixed sequence of IEEE float32 ops (bit-identical everywhere)."""
    k = tl.floor(x * {c["log2e"]!r} + 0.5)
    k = tl.minimum(tl.maximum(k, -150.0), 128.0)
    r = x - k * {c["c1"]!r}
    r = r - k * {c["c2"]!r}
    z = r * r
    p = {c["p0"]!r} * r + {c["p1"]!r}
    p = p * r + {c["p2"]!r}
    p = p * r + {c["p3"]!r}
    p = p * r + {c["p4"]!r}
    p = p * r + {c["p5"]!r}
    y = (p * z + r) + 1.0
    k1 = tl.floor(k * 0.5)
    k2 = k - k1
    fin = (k == k) & (tl.abs(k) != float("inf"))
    s1 = ((tl.where(fin, k1, 0.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((tl.where(fin, k2, 0.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    y = (y * s1) * s2
    y = tl.where(x > {c["hi"]!r}, float("inf"), y)
    y = tl.where(x < {c["lo"]!r}, 0.0, y)
    return tl.where(x != x, x, y)
'''


def _select_body(single: bool, request: bool) -> list[str]:
    """The radix select + write pass (shared text; ``single`` keeps the row in registers)."""
    lines: list[str] = []

    def w(depth: int, s: str) -> None:
        lines.append("    " * depth + s)

    bins = "tl.arange(0, 256)"
    call = "_tile(r, o, L, ARGS_CALL)"
    if single:
        w(2, "o = tl.arange(0, BLOCK)")
        w(2, f"u, valid = {call}")
    for mask, shift in RADIX_PASSES:
        if single:
            w(2, f"m = valid & ((u & {mask}) == thr)")
            w(2, f"hist = tl.histogram(((u >> {shift}) & 255).to(tl.int32), 256, mask=m)")
        else:
            w(2, "hist = tl.zeros([256], dtype=tl.int32)")
            w(2, "for t0 in range(0, N, BLOCK):")
            w(3, "o = t0 + tl.arange(0, BLOCK)")
            w(3, f"u, valid = {call}")
            w(3, f"m = valid & ((u & {mask}) == thr)")
            w(3, f"hist += tl.histogram(((u >> {shift}) & 255).to(tl.int32), 256, mask=m)")
        w(2, "cs = tl.cumsum(hist, axis=0, reverse=True)")
        w(2, f"dsel = tl.max(tl.where(cs >= rem, {bins}, -1), axis=0)")
        w(2, f"rem -= tl.sum(tl.where({bins} > dsel, hist, 0), axis=0)")
        w(2, f"thr = thr | (dsel.to(tl.uint32) << {shift})")
    # keep u > thr, and the `rem` largest indices among u == thr
    if single:
        w(2, "tie = valid & (u == thr)")
        w(2, "c = tl.cumsum(tie.to(tl.int32), axis=0, reverse=True)")
        w(2, "keep = valid & ((u > thr) | (tie & (c <= rem)))")
        _store(w, 2, request)
    else:
        w(2, "carry = tl.zeros([], dtype=tl.int32)")
        w(2, "ntiles = tl.cdiv(N, BLOCK)")
        w(2, "for i in range(0, ntiles):")
        w(3, "o = (ntiles - 1 - i) * BLOCK + tl.arange(0, BLOCK)")
        w(3, f"u, valid = {call}")
        w(3, "tie = valid & (u == thr)")
        w(3, "ti = tie.to(tl.int32)")
        w(3, "c = carry + tl.cumsum(ti, axis=0, reverse=True)")
        w(3, "keep = valid & ((u > thr) | (tie & (c <= rem)))")
        w(3, "carry += tl.sum(ti, axis=0)")
        _store(w, 3, request)
    return lines


def _store(w, depth: int, request: bool) -> None:  # type: ignore[no-untyped-def]
    if request:
        w(depth, "for rr in range(0, L * H):")
        w(depth + 1, "tl.store(out_ptr + b * out_sb + rr * N + o, keep.to(tl.int8), mask=o < N)")
    else:
        w(depth, "tl.store(out_ptr + b * out_sb + r * N + o, keep.to(tl.int8), mask=o < N)")


def kernel_args(policy: Policy) -> tuple[tuple[str, str], ...]:
    """``(name, triton type)`` of the arguments every generated kernel takes after its own (in order):
    shapes, positions, pins, stored statistics, then - for policies using them - the head dimension and
    query-group sizes, the model's layer count (``num_layers``), the first KV head's index in its layer
    (``head_offset``, policies reading ``head`` or ``random``), the vector statistics (``v_<name>_ptr``
    and an int64 stride per dim of ``[B, L, H, *axes]``) and the row-value scratch
    (``rv_ptr [B, L*H, RV_K]``)."""
    args: list[tuple[str, str]] = [("N", "i32"), ("L", "i32"), ("H", "i32"), ("layer_offset", "i32"),
                                   ("pos_ptr", "*i64"), ("pos_sb", "i32"), ("pos_sl", "i32"), ("pos_sh", "i32"),
                                   ("pin_ptr", "*i8"), ("pin_sb", "i32"), ("pin_sl", "i32"), ("pin_sh", "i32")]
    for n in sorted(policy.stored_reads):
        args += [(f"s_{n}_ptr", "*fp32"), (f"s_{n}_sb", "i32"), (f"s_{n}_sl", "i32"), (f"s_{n}_sh", "i32")]
    if _uses_dims(policy):
        args += [("D", "i32"), ("G", "i32")]
    if "num_layers" in policy.reads:
        args += [("num_layers", "i32")]
    if {"head", "random"} & set(policy.reads):
        args += [("head_offset", "i32")]
    for n in sorted(policy.vector_reads):
        args += [(f"v_{n}_ptr", "*fp32"), (f"v_{n}_sb", "i64"), (f"v_{n}_sl", "i64"), (f"v_{n}_sh", "i64")]
        args += [(f"v_{n}_s{a.lower()}", "i64") for a in CATALOG[n].axes]
    if _reductions(policy):
        args += [("rv_ptr", "*fp32"), ("rv_sb", "i64"), ("RV_K", "i32")]
    return tuple(args)


def _graphs(policy: Policy) -> list[ir.Node]:
    assert policy.node is not None
    return [policy.node] + [r.node for r in _rules(policy.spec.protect) if isinstance(r, Predicate)]


def _reductions(policy: Policy) -> list[ir.TokenReduce]:
    """Every token reduction of the score and the predicates, each after those it depends on."""
    out: list[ir.TokenReduce] = []
    for g in _graphs(policy):
        for r in ir.row_reductions(g):
            if r not in out:
                out.append(r)
    return out


def _uses_dims(policy: Policy) -> bool:
    return bool(policy.vector_reads) or any(
        isinstance(n, (ir.Dot, ir.MatVec, ir.GroupMean)) or (isinstance(n, ir.Stat) and n.name == "head_dim")
        or (isinstance(n, ir.TokenReduce) and set(n.axes) & {"G", "D"})
        for g in _graphs(policy) for n in ir.walk(g))


def _tree_reduce(em: _Emitter, acc: str, op: str) -> str:
    """Pairwise tree over the ``TOKEN_LANES`` lanes of ``acc``: ``(l0 + l1), (l2 + l3), ...`` repeated."""
    w = acc
    size = ir.TOKEN_LANES
    while size > 1:
        pair, a, b = em.fresh("w"), em.fresh("wa"), em.fresh("wb")
        em.emit(f"{pair} = tl.reshape({w}, [{size // 2}, 2])")
        em.emit(f"{a}, {b} = tl.split({pair})")
        nxt = em.fresh("w")
        if op == "max":
            em.emit(f"{nxt} = tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)")
        else:
            em.emit(f"{nxt} = {a} + {b}")
        w = nxt
        size //= 2
    return w


def _rowval_kernel(i: int, red: ir.TokenReduce, reductions: list[ir.TokenReduce], seed: int, kargs: str,
                   prologue: list[str]) -> tuple[list[str], _Emitter]:
    """Pre-pass ``i``, grid (B, L*H): row value ``i`` (every G/D component) of each row, into ``rv``."""
    em = _Emitter(seed, reductions)
    ctx = Ctx("l", "h")
    loops = [("G", "g"), ("D", "d")]
    for axis, field in loops:
        if axis in red.axes:
            var = em.fresh(field * 2)
            em.emit(f"for {var} in range(0, {axis}):")
            em.push()
            ctx = ctx._replace(**{field: var})
    ident = em.const(float("-inf") if red.op == "max" else _NEG_ZERO)
    em.pregen(red.x, ctx, "N")
    acc = em.fresh("acc")
    em.emit(f"{acc} = {ident}")
    em.emit("for t0 in range(0, n_len, BLOCK):")
    em.push()
    em.emit("o = t0 + tl.arange(0, BLOCK)")
    x = em.gen(red.x, ctx._replace(o="o"))
    if red.op == "max":
        em.emit(f"{acc} = tl.maximum({acc}, tl.where(o < n_len, {x}, {ident}), propagate_nan=tl.PropagateNan.ALL)")
    else:
        em.emit(f"{acc} = {acc} + tl.where(o < n_len, {x}, {ident})")
    em.pop()
    w = _tree_reduce(em, acc, red.op)
    if red.op == "mean":
        em.emit(f"{w} = tl.div_rn({w}, tl.zeros([1], dtype=tl.float32) + n_len.to(tl.float32))")
    em.emit(f"tl.store({_rv_addr(i, reductions, ctx)} + tl.arange(0, 1), {w})")
    lines = ["@triton.jit",
             f"def rowval_kernel_{i}(lengths_ptr, seq_ptr, {kargs}, BLOCK: tl.constexpr, HAS_PINNED: tl.constexpr):",
             f'    """Pre-pass {i}, grid (B, L*H), BLOCK = {ir.TOKEN_LANES}: {red!r}"""',
             *prologue, "    l = r // H", "    h = r % H", *em.lines]
    return lines, em


def generate(policy: Policy) -> GeneratedPolicy:
    """Triton source of ``policy``'s kernels (see module doc)."""
    if policy.kind != "score" or policy.node is None:
        raise ValueError(f"policy {policy.name!r} is a mask policy: it has no IR to compile")
    spec = policy.spec
    rules = _rules(spec.protect)
    stored = tuple(sorted(policy.stored_reads))
    request = spec.granularity == "request"
    reductions = _reductions(policy)
    args = kernel_args(policy)
    extra = [n for n, _ in args[12:] if not n.startswith("s_")]

    stat_args = "".join(f", s_{n}_ptr, s_{n}_sb, s_{n}_sl, s_{n}_sh" for n in stored)
    extra_args = "".join(f", {n}" for n in extra)
    common = ("b, n_len, seq_len, N, H, layer_offset, pos_ptr, pos_sb, pos_sl, pos_sh, "
              f"pin_ptr, pin_sb, pin_sl, pin_sh{stat_args}{extra_args}")
    common_sig = common + ", BLOCK: tl.constexpr, HAS_PINNED: tl.constexpr"
    common_call = common + ", BLOCK, HAS_PINNED"

    # _score
    em = _Emitter(spec.stats.seed, reductions)
    ctx = Ctx("l", "h", o="o")
    out = em.gen(policy.node, ctx)
    if "N" not in policy.node.axes:  # a per-head score: broadcast over the block (x + -0.0 == x)
        em.emit(f"{out} = {out} + {em.const(_NEG_ZERO)}")
    score_lines = [f"@triton.jit\ndef _score(l, h, o, {common_sig}):",
                   f'    """score = {policy.node!r}"""', *em.lines, f"    return {out}"]
    approx, uses_exp = em.approx, em.uses_exp

    # _pins
    ep = _Emitter(spec.stats.seed, reductions)
    pv = ep.pins(rules, ctx)
    pin_lines = ["@triton.jit", f"def _pins(l, h, o, {common_sig}):",
                 f'    """pins = {" | ".join(_rule_repr(r) for r in rules) or "batch pins only"}"""',
                 *ep.lines, f"    return {pv}"]
    approx, uses_exp = approx or ep.approx, uses_exp or ep.uses_exp
    # _tile
    tile = ["@triton.jit", f"def _tile(r, o, L, {common_sig}):",
            '    """(u, valid): uint32 selection keys of output row r (pins -> 0xFFFFFFFF)."""']
    if request:
        tile += [f"    s = _score(0, 0, o, {common_call})",
                 f"    p = _pins(0, 0, o, {common_call})",
                 "    for rr in range(1, L * H):",
                 f"        s = s + _score(rr // H, rr % H, o, {common_call})",
                 f"        p = p | _pins(rr // H, rr % H, o, {common_call})",
                 "    s = tl.div_rn(s, tl.zeros([BLOCK], dtype=tl.float32) + L * H)"]
    else:
        tile += ["    l = r // H", "    h = r % H",
                 f"    s = _score(l, h, o, {common_call})",
                 f"    p = _pins(l, h, o, {common_call})"]
    tile += ["    s = s + 0.0",
             "    s = tl.where(s != s, tl.full([BLOCK], -8388608, tl.int32).to(tl.float32, bitcast=True), s)",
             "    bits = s.to(tl.int32, bitcast=True)",
             "    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)",
             "    u = key.to(tl.uint32, bitcast=True) ^ 0x80000000",
             "    valid = o < n_len",
             "    u = tl.where(p, 0xFFFFFFFF, u)",
             "    return u, valid"]

    kargs = ", ".join(n for n, _ in args)
    prologue = ["    b = tl.program_id(0).to(tl.int64)",
                "    r = tl.program_id(1)",
                "    n_len = tl.load(lengths_ptr + b).to(tl.int32)",
                "    seq_len = tl.load(seq_ptr + b)"]

    pin_kernel = ["@triton.jit",
                  f"def pin_count_kernel(npins_ptr, lengths_ptr, seq_ptr, R_OUT, {kargs}, BLOCK: tl.constexpr, "
                  "HAS_PINNED: tl.constexpr):",
                  '    """Pre-pass, grid (B, R_OUT): pinned valid tokens of each output row."""',
                  *prologue,
                  "    cnt = tl.zeros([], dtype=tl.int32)",
                  "    for t0 in range(0, N, BLOCK):",
                  "        o = t0 + tl.arange(0, BLOCK)"]
    if request:
        pin_kernel += [f"        p = _pins(0, 0, o, {common_call})",
                       "        for rr in range(1, L * H):",
                       f"            p = p | _pins(rr // H, rr % H, o, {common_call})"]
    else:
        pin_kernel += [f"        p = _pins(r // H, r % H, o, {common_call})"]
    pin_kernel += ["        cnt += tl.sum((p & (o < n_len)).to(tl.int32), axis=0)",
                   "    tl.store(npins_ptr + b * R_OUT + r, cnt)"]

    sel = ["@triton.jit",
           f"def select_kernel(out_ptr, out_sb, npins_ptr, budget_ptr, lengths_ptr, seq_ptr, R_OUT, {kargs}, "
           "BLOCK: tl.constexpr, HAS_PINNED: tl.constexpr, SINGLE: tl.constexpr, RBLOCK: tl.constexpr, "
           "PER_ROW: tl.constexpr):",
           '    """Grid (B, R_OUT): keep exactly k tokens of each row (vtoken_sdk.selection contract); PER_ROW: k is',
           '    budget_ptr[b, r], a count per row from the allocation step (vtoken_sdk.allocation)."""',
           *prologue,
           "    if PER_ROW:",
           "        rem = tl.minimum(n_len, tl.load(budget_ptr + b * R_OUT + r).to(tl.int32))",
           "    else:",
           "        mp = tl.zeros([], dtype=tl.int32)",
           "        for r0 in range(0, R_OUT, RBLOCK):",
           "            ro = r0 + tl.arange(0, RBLOCK)",
           "            mp = tl.maximum(mp, tl.max(tl.load(npins_ptr + b * R_OUT + ro, mask=ro < R_OUT, other=0), "
           "axis=0))",
           "        budget = tl.load(budget_ptr + b).to(tl.int32)",
           "        rem = tl.minimum(n_len, tl.maximum(budget, mp))  # k",
           "    # then: rem is what is still to pick at the threshold",
           "    thr = tl.zeros([], dtype=tl.uint32)",
           "    if SINGLE:"]
    sel += _select_body(True, request)
    sel += ["    else:"]
    sel += _select_body(False, request)

    dbg = ["@triton.jit",
           f"def scores_kernel(out_ptr, out_sb, lengths_ptr, seq_ptr, {kargs}, BLOCK: tl.constexpr, "
           "HAS_PINNED: tl.constexpr):",
           '    """Debug, grid (B, L*H, cdiv(N, BLOCK)): the scores themselves."""',
           *prologue,
           "    o = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)",
           f"    s = _score(r // H, r % H, o, {common_call})",
           "    tl.store(out_ptr + b * out_sb + r * N + o, s, mask=o < N)"]

    def sub(lines: list[str]) -> str:
        return "\n".join(lines).replace("ARGS_CALL", common_call)

    stage_parts: list[str] = []
    for i, red in enumerate(reductions):
        lines, rem = _rowval_kernel(i, red, reductions, spec.stats.seed, kargs, prologue)
        approx, uses_exp = approx or rem.approx, uses_exp or rem.uses_exp
        stage_parts.append("\n\n\n" + "\n".join(lines))

    header = (f'"""Generated by vtoken_sdk.codegen_triton {CODEGEN_VERSION} for policy {policy.name!r} '
              f'(key {policy_key(policy)}).\n\n'
              f"score:       {policy.node!r}\n"
              f"protect:     {', '.join(_rule_repr(r) for r in rules) or '-'}\n"
              f"granularity: {spec.granularity}\n"
              f"stats:       {', '.join(stored) or '-'} (stored), derived from positions otherwise\n"
              f"vectors:     {', '.join(sorted(policy.vector_reads)) or '-'}\n"
              f"row values:  {len(reductions)} token reduction pre-pass(es)\n"
              '"""\n')
    parts = [header, _PRELUDE]
    if uses_exp:
        parts.append(_exp_helper())
    if approx:
        parts.append(_APPROX_HELPERS)
    parts += ["\n\n" + "\n".join(score_lines), "\n\n\n" + "\n".join(pin_lines), "\n\n\n" + sub(tile),
              *stage_parts, "\n\n\n" + sub(pin_kernel), "\n\n\n" + sub(sel), "\n\n\n" + sub(dbg), "\n"]
    return GeneratedPolicy(name=policy.name, key=policy_key(policy), source="".join(parts), stats=stored,
                           granularity=spec.granularity, exact=not approx, args=args,
                           vectors=tuple(sorted(policy.vector_reads)),
                           reductions=tuple(r.axes for r in reductions),
                           heavy=any(isinstance(n, (ir.Dot, ir.MatVec, ir.Chunk, ir.GroupMean))
                                     for g in _graphs(policy) for n in ir.walk(g)))


def source(policy: Policy) -> str:
    """The generated Triton source of ``policy`` (what ``vtoken-cli compile --emit triton`` prints)."""
    return generate(policy).source
