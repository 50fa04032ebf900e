"""Policy IR -> Triton source: one fused score+select kernel per policy.

``generate(policy)`` returns a :class:`GeneratedPolicy` whose ``source`` is a complete, importable
Python module (``vtoken-cli compile FILE --emit triton`` prints it). It holds:

``_score(l, h, o, ...)``   the policy's score for tokens ``o`` of row (layer ``l``, KV head ``h``),
                           straight from the IR: stored statistics are loaded, derived ones
                           (``position``, ``age``, ``random``) computed from positions; pools reload
                           the shifted window (no intermediate tensor), head means loop over heads.
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
score). Keeping the k largest ``(u, index)`` pairs is exactly the reference's composite-key top-k.

Exactness: arithmetic uses IEEE-rounded ops only (``tl.div_rn``, ``tl.sqrt_rn``, add/sub/mul with FP
contraction disabled at launch), constants are emitted as exact float32 bit patterns, reductions add
in the reference's order. ``exp``/``log``/``sigmoid``/``tanh``/``pow`` use libdevice on GPUs (and
numpy-backed Triton ops under the interpreter): within a few ulp, not bit-exact (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import ir
from .protect import AnyOf, Predicate, Recent, Rule, Sinks, Span

if TYPE_CHECKING:
    from .policy import Policy

CODEGEN_VERSION = "1"
APPROX_UNARY = ("log", "exp", "sigmoid", "tanh")
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


class _Emitter:
    """Emits straight-line Triton code for IR nodes evaluated at a context ``(l, h, o)``."""

    def __init__(self, seed: int) -> None:
        self.lines: list[str] = []
        self.depth = 1
        self.count = 0
        self.scopes: list[dict[object, str]] = [{}]
        self.seed = seed
        self.approx = False

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

    def pos(self, ctx: tuple[str, str, str]) -> str:
        key = ("pos", ctx)
        got = self._get(key)
        if got:
            return got
        l_, h, o = ctx
        var = self.fresh("pos")
        self.emit(f"{var} = tl.load(pos_ptr + b * pos_sb + {l_} * pos_sl + {h} * pos_sh + {o}, "
                  f"mask={self.inb(o)}, other=0)")
        return self._put(key, var)

    # ------------------------------------------------------------------ nodes
    def gen(self, node: ir.Node, ctx: tuple[str, str, str]) -> str:
        key = (node, ctx)
        got = self._get(key)
        if got:
            return got
        var = self._gen(node, ctx)
        return self._put(key, var)

    def _gen(self, node: ir.Node, ctx: tuple[str, str, str]) -> str:
        l_, h, o = ctx
        if isinstance(node, ir.Const):
            return self.const(node.value)
        var = self.fresh("v")
        if isinstance(node, ir.Stat):
            if node.name == "position":
                self.emit(f"{var} = {self.pos(ctx)}.to(tl.float32)")
            elif node.name == "age":
                self.emit(f"{var} = (seq_len - 1 - {self.pos(ctx)}).to(tl.float32)")
            elif node.name == "random":
                self.emit(f"{var} = _hash_uniform({_hash_seed(self.seed)}, {l_} + layer_offset, {h}, "
                          f"{self.pos(ctx)})")
            else:
                p = f"s_{node.name}"
                self.emit(f"{var} = tl.load({p}_ptr + b * {p}_sb + {l_} * {p}_sl + {h} * {p}_sh + {o}, "
                          f"mask={self.inb(o)}, other=0.0)")
            return var
        if isinstance(node, ir.Unary):
            x = self.gen(node.x, ctx)
            op = node.op
            if op in APPROX_UNARY:
                self.approx = True
            expr = {
                "neg": f"({x}.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)", "abs": f"tl.abs({x})", "sqrt": f"tl.sqrt_rn({x})", "log": f"_log({x})",
                "exp": f"_exp({x})", "tanh": f"_tanh({x})", "isnan": f"{x} != {x}", "not": f"~{x}",
                "float": f"{x}.to(tl.float32)",
                "sigmoid": f"tl.div_rn({self.const(1.0)}, {self.const(1.0)} + _exp(-{x}))",
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
            r = node.size // 2
            fill = self.const(float("-inf") if node.op == "max" else 0.0)
            o0 = self.fresh("o")
            self.emit(f"{o0} = {o} - {r}")
            t0 = self.gen(node.x, (l_, h, o0))
            self.emit(f"{var} = tl.where(({o0} >= 0) & ({o0} < n_len), {t0}, {fill})")
            d, o1 = self.fresh("d"), self.fresh("o")
            self.emit(f"for {d} in range({1 - r}, {r + 1}):")
            self.push()
            self.emit(f"{o1} = {o} + {d}")
            t1 = self.gen(node.x, (l_, h, o1))
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
            t0 = self.gen(node.x, (l_, "0", o))
            self.emit(f"{var} = {t0}")
            hh = self.fresh("hh")
            self.emit(f"for {hh} in range(1, H):")
            self.push()
            t1 = self.gen(node.x, (l_, hh, o))
            self.emit(f"{var} = {var} + {t1}")
            self.pop()
            zero = self.const(0.0)
            self.emit(f"{var} = tl.div_rn({var}, {zero} + H)")
            return var
        raise TypeError(f"unknown IR node {node!r}")  # pragma: no cover - exhaustive

    def pins(self, rules: list[Rule], ctx: tuple[str, str, str]) -> str:
        l_, h, o = ctx
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


_PRELUDE = '''\
import os

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _hash_uniform(seed_mix, layer, head, pos):
    """vtoken_sdk.reference.hash_uniform with uint32 wrap-around arithmetic."""
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
    def _exp(x):
        return tl.exp(x)

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
    def _exp(x):
        return libdevice.exp(x)

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


def generate(policy: Policy) -> GeneratedPolicy:
    """Triton source of ``policy``'s kernels (see module doc)."""
    if policy.kind != "score" or policy.node is None:
        raise ValueError(f"policy {policy.name!r} is a mask policy: it has no IR to compile")
    spec = policy.spec
    rules = _rules(spec.protect)
    stored = tuple(sorted(policy.stored_reads))
    request = spec.granularity == "request"

    stat_args = "".join(f", s_{n}_ptr, s_{n}_sb, s_{n}_sl, s_{n}_sh" for n in stored)
    common = ("b, n_len, seq_len, N, H, layer_offset, pos_ptr, pos_sb, pos_sl, pos_sh, "
              f"pin_ptr, pin_sb, pin_sl, pin_sh{stat_args}")
    common_sig = common + ", BLOCK: tl.constexpr, HAS_PINNED: tl.constexpr"
    common_call = common + ", BLOCK, HAS_PINNED"

    # _score
    em = _Emitter(spec.stats.seed)
    ctx = ("l", "h", "o")
    out = em.gen(policy.node, ctx)
    score_lines = [f"@triton.jit\ndef _score(l, h, o, {common_sig}):",
                   f'    """score = {policy.node!r}"""', *em.lines, f"    return {out}"]
    approx = em.approx

    # _pins
    ep = _Emitter(spec.stats.seed)
    pv = ep.pins(rules, ctx)
    pin_lines = ["@triton.jit", f"def _pins(l, h, o, {common_sig}):",
                 f'    """pins = {" | ".join(_rule_repr(r) for r in rules) or "batch pins only"}"""',
                 *ep.lines, f"    return {pv}"]
    approx = approx or ep.approx

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

    kargs = ("N, L, H, layer_offset, pos_ptr, pos_sb, pos_sl, pos_sh, pin_ptr, pin_sb, pin_sl, pin_sh"
             f"{stat_args}")
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
           "BLOCK: tl.constexpr, HAS_PINNED: tl.constexpr, SINGLE: tl.constexpr, RBLOCK: tl.constexpr):",
           '    """Grid (B, R_OUT): keep exactly k tokens of each row (vtoken_sdk.selection contract)."""',
           *prologue,
           "    mp = tl.zeros([], dtype=tl.int32)",
           "    for r0 in range(0, R_OUT, RBLOCK):",
           "        ro = r0 + tl.arange(0, RBLOCK)",
           "        mp = tl.maximum(mp, tl.max(tl.load(npins_ptr + b * R_OUT + ro, mask=ro < R_OUT, other=0), axis=0))",
           "    budget = tl.load(budget_ptr + b).to(tl.int32)",
           "    rem = tl.minimum(n_len, tl.maximum(budget, mp))  # k; then: still to pick at the threshold",
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

    header = (f'"""Generated by vtoken_sdk.codegen_triton {CODEGEN_VERSION} for policy {policy.name!r} '
              f'(key {policy_key(policy)}).\n\n'
              f"score:       {policy.node!r}\n"
              f"protect:     {', '.join(_rule_repr(r) for r in rules) or '-'}\n"
              f"granularity: {spec.granularity}\n"
              f"stats:       {', '.join(stored) or '-'} (stored), derived from positions otherwise\n"
              '"""\n')
    parts = [header, _PRELUDE]
    if approx:
        parts.append(_APPROX_HELPERS)
    parts += ["\n\n" + "\n".join(score_lines), "\n\n\n" + "\n".join(pin_lines), "\n\n\n" + sub(tile),
              "\n\n\n" + sub(pin_kernel), "\n\n\n" + sub(sel), "\n\n\n" + sub(dbg), "\n"]
    return GeneratedPolicy(name=policy.name, key=policy_key(policy), source="".join(parts), stats=stored,
                           granularity=spec.granularity, exact=not approx)


def source(policy: Policy) -> str:
    """The generated Triton source of ``policy`` (what ``vtoken-cli compile --emit triton`` prints)."""
    return generate(policy).source
