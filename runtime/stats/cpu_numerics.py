"""The numba statistics kernel's fp32 arithmetic: constants, ``exp``, the fused multiply-add and the vector dot
products (LLVM intrinsics), shared by the gathers (:mod:`.cpu_gather`), the passes (:mod:`.cpu_passes`) and the driver
(:mod:`.cpu_driver`).

Numerics: fp32 everywhere, IEEE operations (``fastmath=False``: no reassociation, no implicit contraction).
Dots accumulate over ``d`` in order from 0 with an explicit fused multiply-add per term
(``acc = fma(q_d, k_d, acc)``, ``llvm.fma``: one rounding per term, in every path: the tile loops, the in-place
vector dots and their scalar tails, so every path gives the same bits);
``exp`` is a Cephes-style fp32 polynomial (< 1 ulp measured; written inline so the loops vectorise), its
argument clamped at ``-87`` (``exp(-87)`` ~ 1.6e-38: a probability below that, after the division by
the row's sum, is reported as at most that instead of 0); probabilities are ``e * (1 / l)`` like
torch's CPU softmax; the low-attention threshold is ``(1 / n_vis) * (threshold * G)`` in fp32 and the
count weights ``decay ** k`` are fp32 (``decay = float32(1 - 1/history_window)``), as the collector
computes them. Results equal the collector within ``atol = 2e-6``, ``rtol = 1e-5``; a (query, key)
pair whose ``P`` lies within 1e-5 (relative) of the threshold may be counted on either side (as for
the Triton kernel, docs/kernels.md).

The functions here are plain Python; :func:`bind` (called by :func:`.cpu_driver.load` once numba is imported)
compiles them and builds the intrinsics (numba is not imported with this module).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# fp32 constants (numba types numpy scalars by their dtype: the arithmetic stays in float32)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_NEG = np.float32(-3.0e38)  # "no visible key yet" (finite: NEG - NEG = 0, never NaN)
_EXP_LO = np.float32(-87.0)  # exp(-87) ~ 1.65e-38 stays a normal number (no denormal slow paths)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # Cephes split of ln 2 (n * _LN2_HI is exact for |n| < 2^15)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)

DOT_ROWS = 4  # query rows (heads of a GQA group) per in-place dot-product call
LANES = 32  # running max (pass 1) and sum of exp (sum pass) lanes per row (a tile's keys fold onto them)


def _py_fexp(x):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """exp(x) for float32 x <= 0 (Cephes expf polynomial, IEEE fp32 ops; NaN and x < -87 -> exp(-87))."""
    x = x if x > _EXP_LO else _EXP_LO
    x = x if x < _F0 else _F0
    fx = np.floor(x * _LOG2E + _HALF)
    z = x - fx * _LN2_HI
    z = z - fx * _LN2_LO
    y = _P0 * z + _P1
    y = y * z + _P2
    y = y * z + _P3
    y = y * z + _P4
    y = y * z + _P5
    y = y * (z * z) + z + _F1
    e = np.uint32(np.int32(fx) + np.int32(127))
    return y * _as_f32(np.uint32(e << np.uint32(23)))  # noqa: F821 - bound by _load()


def _py_width(nt, BN):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Compute width of a tile holding ``nt`` keys: ``nt`` rounded up to 8, at most ``BN``."""
    return min(BN, (nt + 7) // 8 * 8)



def _intrinsics() -> dict[str, Any]:
    """The LLVM intrinsics of this module, by the names the compiled functions call them: ``_as_f32``, ``_fma32``,
    ``_dot8`` / ``_dot16`` / ``_dot32`` / ``_dot64`` (in-place dot products) and ``_exp_acc16``."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def as_f32(typingctx, x):  # type: ignore[no-untyped-def]
        """Reinterpret the bits of a 32-bit integer as float32."""
        if not isinstance(x, types.Integer) or x.bitwidth != 32:
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(x), codegen

    @intrinsic
    def fma32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
        """``a * b + c`` rounded once (llvm.fma.f32)."""
        if not all(isinstance(x, types.Float) and x.bitwidth == 32 for x in (a, b, c)):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.fma(*args)

        return types.float32(a, b, c), codegen

    def dot(nv: int, lanes: int) -> Any:
        """Intrinsic for ``nv`` groups of ``lanes`` keys (group ``v``: keys ``jj + v*lanes ...``, contiguous along
        the slot from ``base_v = rowb[jj + v*lanes]``, so the groups may lie in different segments or blocks) and
        ``nr`` (1 to ``DOT_ROWS``) query rows: ``out[o + r*ostr + v*lanes + u] = sum_d qb[qo + r*D + d] *
        key(kraw[base_v + d*k_sd + u])`` (u < lanes, v < nv, r < nr; keys' bf16
        bits widened into the high half of the fp32 bits), each sum fp32 from 0 over d in order (one fused
        multiply-add per term, ``llvm.fma.v{lanes}f32``: the scalar paths' bits). One loop per row count (a
        switch on ``nr``; any other ``nr`` writes nothing): ``nr * nv`` vector accumulators of ``lanes`` fp32 (8: 256-bit, 16: 512-bit; the
        same per-lane sums either way), one vector load per ``lanes`` keys and d shared by the rows, one store each at the end. ``pairs`` (32-bit words only:
        ``KF_PAIRS``): ``kraw[base_v + p*k_sd + u]`` holds dims 2p (low half) and 2p + 1 (high half) of key
        u; one load per ``lanes`` keys and pair, the two dims' terms added in order."""

        @intrinsic
        def dot_n(typingctx, qb, qo, nr, kraw, rowb, jj, k_sd, D, out, o, ostr, pairs):  # type: ignore[no-untyped-def]
            if not (isinstance(kraw, types.Array) and kraw.dtype in (types.uint32, types.uint16)
                    and isinstance(qb, types.Array) and qb.dtype == types.float32
                    and isinstance(rowb, types.Array) and rowb.dtype == types.int64
                    and isinstance(out, types.Array) and out.dtype == types.float32
                    and isinstance(pairs, types.Boolean)):
                return None

            def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
                qty, kty, rty, oty = (signature.args[n] for n in (0, 3, 4, 8))
                q_a = context.make_array(qty)(context, builder, args[0])
                k_a = context.make_array(kty)(context, builder, args[3])
                r_a = context.make_array(rty)(context, builder, args[4])
                o_a = context.make_array(oty)(context, builder, args[8])
                i64 = ir.IntType(64)
                qo_, nr_, jj_, ksd_, D_, o_, os_ = (
                    context.cast(builder, args[n], signature.args[n], types.int64) for n in (1, 2, 5, 6, 7, 9, 10))
                bases = [builder.load(builder.gep(r_a.data, [builder.add(jj_, ir.Constant(i64, lanes * v))]))
                         for v in range(nv)]  # of each vector's first key (dim 0)
                wide = kty.dtype == types.uint16
                elt = ir.IntType(16 if wide else 32)
                v32 = ir.VectorType(ir.IntType(32), lanes)
                vf = ir.VectorType(ir.FloatType(), lanes)
                zero = ir.Constant(vf, [0.0] * lanes)
                vfma = builder.module.globals.get(f"llvm.fma.v{lanes}f32") or ir.Function(
                    builder.module, ir.FunctionType(vf, [vf, vf, vf]), name=f"llvm.fma.v{lanes}f32")
                exit_ = builder.append_basic_block("dot.exit")

                def rows_loop(paired: bool) -> None:
                    """The switch on ``nr`` and its loops, from the current block to ``exit_``."""
                    tag = "p" if paired else "d"
                    n_d = builder.ashr(D_, ir.Constant(i64, 1)) if paired else D_  # loop trips
                    switch = builder.switch(nr_, exit_)
                    for nrows in range(1, DOT_ROWS + 1):
                        pre = builder.append_basic_block(f"dot.{tag}{nrows}")
                        switch.add_case(ir.Constant(i64, nrows), pre)
                        builder.position_at_end(pre)
                        loop = builder.append_basic_block(f"dot.{tag}{nrows}.loop")
                        done = builder.append_basic_block(f"dot.{tag}{nrows}.done")
                        builder.cbranch(builder.icmp_signed(">", n_d, ir.Constant(i64, 0)), loop, done)
                        builder.position_at_end(loop)
                        d = builder.phi(i64)
                        accs = [builder.phi(vf) for _ in range(nrows * nv)]
                        dk = builder.mul(d, ksd_)
                        kvs = []  # per dim of this trip (one, or the pair's two), the nv key vectors
                        for v in range(nv):
                            p = builder.gep(k_a.data, [builder.add(bases[v], dk)])
                            kv = builder.load(builder.bitcast(p, ir.VectorType(elt, lanes).as_pointer()),
                                              align=elt.width // 8)
                            if wide:
                                kv = builder.shl(builder.zext(kv, v32), ir.Constant(v32, [16] * lanes))
                            if paired:
                                kvs.append((builder.bitcast(builder.shl(kv, ir.Constant(v32, [16] * lanes)), vf),
                                            builder.bitcast(builder.and_(kv, ir.Constant(v32, [-65536] * lanes)),
                                                            vf)))
                            else:
                                kvs.append((builder.bitcast(kv, vf),))
                        nxt = list(accs)
                        for r in range(nrows):
                            for k in range(2 if paired else 1):
                                dd = builder.add(builder.shl(d, ir.Constant(i64, 1)), ir.Constant(i64, k)) \
                                    if paired else d
                                qi = builder.add(builder.add(qo_, builder.mul(D_, ir.Constant(i64, r))), dd)
                                qd = builder.load(builder.gep(q_a.data, [qi]))
                                qv = builder.shuffle_vector(
                                    builder.insert_element(ir.Constant(vf, ir.Undefined), qd,
                                                           ir.Constant(ir.IntType(32), 0)),
                                    ir.Constant(vf, ir.Undefined), ir.Constant(v32, [0] * lanes))
                                for v in range(nv):
                                    nxt[r * nv + v] = builder.call(vfma, [qv, kvs[v][k], nxt[r * nv + v]])
                        d1 = builder.add(d, ir.Constant(i64, 1))
                        d.add_incoming(ir.Constant(i64, 0), pre)
                        d.add_incoming(d1, loop)
                        for acc, n in zip(accs, nxt, strict=True):
                            acc.add_incoming(zero, pre)
                            acc.add_incoming(n, loop)
                        builder.cbranch(builder.icmp_signed("<", d1, n_d), loop, done)
                        builder.position_at_end(done)
                        res = [builder.phi(vf) for _ in range(nrows * nv)]
                        for rr, n in zip(res, nxt, strict=True):
                            rr.add_incoming(zero, pre)
                            rr.add_incoming(n, loop)
                        for r in range(nrows):
                            for v in range(nv):
                                off = builder.add(builder.add(o_, builder.mul(os_, ir.Constant(i64, r))),
                                                  ir.Constant(i64, lanes * v))
                                dst = builder.gep(o_a.data, [off])
                                builder.store(res[r * nv + v], builder.bitcast(dst, vf.as_pointer()), align=4)
                        builder.branch(exit_)

                if wide:  # 16-bit elements hold one dim each: no pairs
                    rows_loop(False)
                else:
                    b_pairs = builder.append_basic_block("dot.pairs")
                    b_dims = builder.append_basic_block("dot.dims")
                    builder.cbranch(context.cast(builder, args[11], signature.args[11], types.boolean),
                                    b_pairs, b_dims)
                    builder.position_at_end(b_pairs)
                    rows_loop(True)
                    builder.position_at_end(b_dims)
                    rows_loop(False)
                builder.position_at_end(exit_)
                return context.get_dummy_value()

            return types.void(qb, qo, nr, kraw, rowb, jj, k_sd, D, out, o, ostr, pairs), codegen

        return dot_n

    @intrinsic
    def exp_acc16(typingctx, buf, ab, vis, vo, ll, lo, mg):  # type: ignore[no-untyped-def]
        """16 keys of the sum pass at once (512-bit vectors; two 256-bit halves without AVX-512):
        ``e = exp(buf[ab + u] - mg)`` (:func:`_py_fexp`'s operations in its order: the same bits), 0 where
        ``vis[vo + u]`` is false; ``buf[ab + u] = e`` and ``ll[lo + u] += e`` for u < 16."""
        if not (isinstance(buf, types.Array) and buf.dtype == types.float32
                and isinstance(ll, types.Array) and ll.dtype == types.float32
                and isinstance(vis, types.Array) and vis.dtype == types.boolean):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            b_a = context.make_array(signature.args[0])(context, builder, args[0])
            v_a = context.make_array(signature.args[2])(context, builder, args[2])
            l_a = context.make_array(signature.args[4])(context, builder, args[4])
            ab_, vo_, lo_ = (context.cast(builder, args[n], signature.args[n], types.int64) for n in (1, 3, 5))
            f32, i32 = ir.FloatType(), ir.IntType(32)
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i32, 16)

            def splat(x: float) -> Any:
                return ir.Constant(vf, [float(np.float32(x))] * 16)

            def vptr(arr: Any, off: Any, ty: Any) -> Any:
                return builder.bitcast(builder.gep(arr.data, [off]), ty.as_pointer())

            mgv = builder.insert_element(ir.Constant(vf, ir.Undefined), args[6], ir.Constant(i32, 0))
            mgv = builder.shuffle_vector(mgv, ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * 16))
            p_buf = vptr(b_a, ab_, vf)
            x = builder.fsub(builder.load(p_buf, align=4), mgv)
            lo_c, zero = splat(_EXP_LO), splat(0.0)
            x = builder.select(builder.fcmp_ordered(">", x, lo_c), x, lo_c)
            x = builder.select(builder.fcmp_ordered("<", x, zero), x, zero)
            vfloor = builder.module.globals.get("llvm.floor.v16f32") or ir.Function(
                builder.module, ir.FunctionType(vf, [vf]), name="llvm.floor.v16f32")
            fx = builder.call(vfloor, [builder.fadd(builder.fmul(x, splat(_LOG2E)), splat(_HALF))])
            z = builder.fsub(x, builder.fmul(fx, splat(_LN2_HI)))
            z = builder.fsub(z, builder.fmul(fx, splat(_LN2_LO)))
            y = builder.fadd(builder.fmul(splat(_P0), z), splat(_P1))
            for c in (_P2, _P3, _P4, _P5):
                y = builder.fadd(builder.fmul(y, z), splat(c))
            y = builder.fadd(builder.fadd(builder.fmul(y, builder.fmul(z, z)), z), splat(1.0))
            n = builder.add(builder.fptosi(fx, vi), ir.Constant(vi, [127] * 16))
            e = builder.fmul(y, builder.bitcast(builder.shl(n, ir.Constant(vi, [23] * 16)), vf))
            vb = builder.load(vptr(v_a, vo_, ir.VectorType(ir.IntType(8), 16)), align=1)
            e = builder.select(builder.icmp_unsigned("!=", vb, ir.Constant(ir.VectorType(ir.IntType(8), 16),
                                                                            [0] * 16)), e, zero)
            builder.store(e, p_buf, align=4)
            p_ll = vptr(l_a, lo_, vf)
            builder.store(builder.fadd(builder.load(p_ll, align=4), e), p_ll, align=4)
            return context.get_dummy_value()

        return types.void(buf, ab, vis, vo, ll, lo, mg), codegen

    return {
        "_exp_acc16": exp_acc16,
        "_as_f32": as_f32,
        "_fma32": fma32,
        "_dot8": dot(1, 8),
        "_dot16": dot(1, 16),  # one 512-bit vector per 16 keys (two 256-bit halves on a CPU without AVX-512)
        "_dot32": dot(2, 16),
        "_dot64": dot(4, 16),
    }


def bind(numba: Any, opts: dict[str, Any], callees: dict[str, Any]) -> dict[str, Any]:
    """Compile this module's functions (numba compiles each on its first call) and bind them, with ``callees``,
    to the globals they are called by here; returns them by name (for the modules that call them)."""
    own = _intrinsics()
    own["_fexp"] = numba.njit(inline="always", **opts)(_py_fexp)
    own["_width"] = numba.njit(inline="always", **opts)(_py_width)
    globals().update(callees)
    globals().update(own)
    return own
