"""Key layouts of the numba statistics kernel: the key formats, :class:`PairedKeys` (vLLM's CPU ``amx`` layout) and
the gather of a key tile through the block table (:func:`_py_gather`, compiled by :func:`bind`).

For every (request ``b``, KV head ``h``), over key tiles of ``BN`` virtual slots (``block_n``; default
128 for ``D <= 64``, else 64), gathered through the block table into transposed fp32 tiles ``[D, BN]`` (bf16 bits widened to fp32 in
the kernel; a pure copy of the bits, whatever the cache layout): a unit stride along D takes 8 x 8 blocks
(vector loads + an in-register transpose); a unit stride along the block slot (vLLM's CPU layout: K
dim-major per (block, head)) copies, per run of the tile's consecutive keys inside one block, one
contiguous slice per ``d``; any other layout is read element by element. A dim-major cache with a block size
that is a multiple of 8 and a request whose scores are cached (:mod:`.cpu_driver`) gathers no keys at all: pass 1
reads the keys in place, each vector load shared by up to ``DOT_ROWS`` query heads of the GQA group (the same
sums in the same order, so the same bits; the tile copy of 16-key runs cost more than the dot products it
feeds, decode and prefill alike). With 16-slot-aligned segments (a multiple of 16: vLLM's amx segments, fp32 /
vec blocks of 32) the tile's whole groups of 16 keys go 64 / 32 / 16 keys per call, one 512-bit load per
group and ``d``, the groups of one call taken from different segments or blocks: rows x groups independent
FMA chains (one 16-key segment x 3 rows per call left the dot products bound by the FMA latency: 1.4x
slower); the rest of a tile 32 / 16 / 8 keys per call inside one segment. vLLM's bf16 ``amx`` layout
stores K as pairs of dims per 32-bit word, dim-major by pair (:class:`PairedKeys`): the same paths read it, one
word (load) per pair of dims, split into the two dims' fp32 bits (low half: dim 2p, high half: 2p + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# key formats (``kfmt``): fp32 bits, one bf16 per 16-bit element (the value is the left shift that makes the fp32
# bits), or bf16 pairs of dims in one 32-bit word (vLLM's CPU ``amx`` layout: dim 2p in the low half, 2p+1 high)
KF_F32, KF_BF16, KF_PAIRS = 0, 16, 1
_HI16 = np.uint32(0xFFFF0000)


def _py_kbits(kraw, i, d, k_sd, kfmt):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The fp32 bits of dim ``d`` of the key whose dim 0 lies at ``kraw[i]`` (``k_sd``: the stride per dim, per
    pair of dims for ``KF_PAIRS``)."""
    if kfmt == KF_PAIRS:
        w = np.uint32(kraw[i + (d >> 1) * k_sd])
        return np.uint32(w & _HI16) if d & 1 else np.uint32(w << np.uint32(16))
    return np.uint32(np.uint32(kraw[i + d * k_sd]) << np.uint32(kfmt))


def _py_gather(kraw, kfmt, k_snb, k_sbs, k_sh, k_sd, k_seg, k_sseg, bt, b, h, j0, nt, bs, kpos, kp_off, ktu, kp, slots, rowb,
               BN, D, copy):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Key tile: virtual slots ``j0 .. j0+nt-1`` of request ``b``, KV head ``h`` -> ``ktu[d*BN + jj]`` (the fp32
    tile's bits: fp32 bits as they are, bf16 bits shifted into the high half; zeros up to the tile's
    compute width; only if ``copy``), true positions ``kp`` (-1 past ``nt``), physical ``slots`` and the
    keys' offsets ``rowb`` in ``kraw`` (of d = 0). A block's slots are stored in segments of ``k_seg`` slots
    (``k_sseg`` apart; ``k_seg = bs`` for a plain strided layout, 16 for vLLM's amx). Returns the tile's smallest
    valid position (2**62 if none)."""
    kmin = np.int64(1) << np.int64(62)
    bi = j0 // bs  # block-table column, offset of key jj, its segment's offset and its offset there (no division
    off = j0 - bi * bs  # per key)
    seg_off = (off // k_seg) * k_sseg
    so = off % k_seg
    blk = np.int64(bt[b, bi])
    for jj in range(nt):
        if off == bs:
            bi += 1
            off = 0
            seg_off = 0
            so = 0
            blk = np.int64(bt[b, bi])
        elif so == k_seg:
            seg_off += k_sseg
            so = 0
        slot = blk * bs + off
        slots[jj] = slot
        p = kpos[kp_off + slot]
        kp[jj] = p
        if p >= 0 and p < kmin:
            kmin = p
        rowb[jj] = blk * k_snb + seg_off + so * k_sbs + h * k_sh
        off += 1
        so += 1
    for jj in range(nt, BN):
        kp[jj] = -1
        slots[jj] = 0
    if not copy:
        return kmin
    sh = np.uint32(kfmt)
    BNe = _width(nt, BN)  # noqa: F821
    if k_sbs == 1 and k_sd != 1:
        # dim-major blocks (vLLM's CPU layouts): the tile's keys inside one segment of a block are contiguous
        # along the slot for every d (every pair of dims: amx) -> per run of consecutive keys in one segment,
        # D (D / 2) contiguous row copies
        jj0 = 0
        while jj0 < nt:
            run = min(k_seg - (j0 + jj0) % k_seg, nt - jj0)
            base = rowb[jj0]
            if kfmt == KF_PAIRS:
                for p in range(D // 2):
                    src = kraw[base + p * k_sd:base + p * k_sd + run]
                    d_lo = ktu[2 * p * BN + jj0:2 * p * BN + jj0 + run]
                    d_hi = ktu[(2 * p + 1) * BN + jj0:(2 * p + 1) * BN + jj0 + run]
                    for u in range(run):
                        w = np.uint32(src[u])
                        d_lo[u] = w << np.uint32(16)
                        d_hi[u] = w & _HI16
            else:
                for d in range(D):
                    src = kraw[base + d * k_sd:base + d * k_sd + run]
                    dst = ktu[d * BN + jj0:d * BN + jj0 + run]
                    for u in range(run):
                        dst[u] = np.uint32(src[u]) << sh
            jj0 += run
        n_done = nt
    else:
        n_done = 0
    # vector path: unit stride along D (else the scalar loop below)
    n8 = nt - nt % 8 if k_sd == 1 and kfmt != KF_PAIRS else 0
    D8 = D - D % 8
    for jb in range(0, n8, 8):  # 8 x 8 blocks: vector loads + in-register transpose
        for d0 in range(0, D8, 8):
            _tr8(kraw, rowb, jb, d0, ktu, BN)  # noqa: F821
    for d in range(D):
        row = ktu[d * BN:(d + 1) * BN]
        for jj in range(max(n_done, n8 if d < D8 else 0), nt):
            row[jj] = _kbits(kraw, rowb[jj], d, k_sd, kfmt)  # noqa: F821
        for jj in range(nt, BNe):
            row[jj] = np.uint32(0)
    return kmin



def _tr8_intrinsic() -> Any:
    """``_tr8``: the 8 x 8 transposing block copy of the unit-stride-along-D gather (an LLVM intrinsic)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tr8(typingctx, kraw, rowb, jb, d0, ktu, bn):  # type: ignore[no-untyped-def]
        """8 keys x 8 dims, transposed: ``ktu[(d0+u)*bn + jb + i] = bits(kraw[rowb[jb+i] + d0 + u])`` for
        i, u < 8 (bf16 bits widened into the high half of the fp32 bits): 8 vector loads, a 24-shuffle
        transpose, 8 vector stores."""
        if not (isinstance(kraw, types.Array) and kraw.dtype in (types.uint32, types.uint16)
                and isinstance(ktu, types.Array) and ktu.dtype == types.uint32):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            kty, rty, jty, dty, oty, bty = signature.args
            k_a = context.make_array(kty)(context, builder, args[0])
            r_a = context.make_array(rty)(context, builder, args[1])
            o_a = context.make_array(oty)(context, builder, args[4])
            i64 = ir.IntType(64)
            jb_, d0_, bn_ = (context.cast(builder, args[n], t, types.int64)
                             for n, t in ((2, jty), (3, dty), (5, bty)))
            wide = kty.dtype == types.uint16
            elt = ir.IntType(16 if wide else 32)
            v32 = ir.VectorType(ir.IntType(32), 8)
            rows = []
            for i in range(8):
                rb = builder.load(builder.gep(r_a.data, [builder.add(jb_, ir.Constant(i64, i))]))
                p = builder.gep(k_a.data, [builder.add(rb, d0_)])
                v = builder.load(builder.bitcast(p, ir.VectorType(elt, 8).as_pointer()), align=elt.width // 8)
                if wide:
                    v = builder.shl(builder.zext(v, v32), ir.Constant(v32, [16] * 8))
                rows.append(v)

            def shuf(a, b, idx):  # type: ignore[no-untyped-def]
                return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), idx))

            lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
            t = [shuf(rows[2 * (n // 2)], rows[2 * (n // 2) + 1], lo if n % 2 == 0 else hi) for n in range(8)]
            p0, p1 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
            s_ = [shuf(t[0], t[2], p0), shuf(t[0], t[2], p1), shuf(t[1], t[3], p0), shuf(t[1], t[3], p1),
                  shuf(t[4], t[6], p0), shuf(t[4], t[6], p1), shuf(t[5], t[7], p0), shuf(t[5], t[7], p1)]
            q0, q1 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
            for u in range(4):  # dims u and u + 4
                for du, idx in ((u, q0), (u + 4, q1)):
                    off = builder.add(builder.mul(builder.add(d0_, ir.Constant(i64, du)), bn_), jb_)
                    dst = builder.bitcast(builder.gep(o_a.data, [off]), v32.as_pointer())
                    builder.store(shuf(s_[u], s_[u + 4], idx), dst, align=4)
            return context.get_dummy_value()

        return types.void(kraw, rowb, jb, d0, ktu, bn), codegen
    return tr8


def bind(numba: Any, opts: dict[str, Any], callees: dict[str, Any]) -> dict[str, Any]:
    """Compile this module's functions (numba compiles each on its first call) and bind them, with ``callees``
    (:func:`.cpu_numerics.bind`'s), to the globals they are called by here; returns them by name."""
    own = {"_tr8": _tr8_intrinsic(), "_kbits": numba.njit(inline="always", **opts)(_py_kbits),
           "_gather": numba.njit(**opts)(_py_gather)}
    globals().update(callees)
    globals().update(own)
    return own


@dataclass(frozen=True)
class PairedKeys:
    """A bf16 key cache stored as pairs of dims in 32-bit words, which no strided bf16 view can address (vLLM's
    CPU ``amx`` layout, ``vtoken_runtime.vllm_plugin.cpu_layout.amx_paired_keys``). A block's ``bs`` slots are
    stored in segments of ``segment`` slots, ``segment_stride`` words apart; inside a segment, ``strides`` (in
    words: block, slot, head, pair) address the words::

        words[o + n * s_nb + (t // segment) * segment_stride + (t % segment) * s_t + h * s_h + p * s_p]
            = bits(K[n, t, h, 2p]) | bits(K[n, t, h, 2p + 1]) << 16          (o = words.storage_offset())

    The kernel reads it in place (``KF_PAIRS``) with the bits and the results of the plain layouts."""

    words: torch.Tensor  # int32, its first element is K word 0 of block 0, head 0
    shape: tuple[int, int, int, int]  # (NB, bs, H_kv, D) of the keys
    strides: tuple[int, int, int, int]
    segment: int
    segment_stride: int = 0

    def __post_init__(self) -> None:
        NB, bs, H, D = self.shape
        if self.words.dtype != torch.int32 or D % 2 or self.segment < 1 or bs % self.segment:
            raise ValueError(f"PairedKeys: words must be int32 ({self.words.dtype}), D even ({D}) and the segment "
                             f"({self.segment}) must divide the block size ({bs})")
        if self.words.storage_offset() + self.span() > self.words.untyped_storage().nbytes() // 4:
            raise ValueError("PairedKeys: the strides address words past the end of the storage")

    @property
    def device(self) -> torch.device:
        return self.words.device

    def span(self) -> int:
        """Words from the first one to the last one addressed, inclusive."""
        NB, bs, H, D = self.shape
        dims = (NB, self.segment, H, D // 2)
        return 1 + sum((n - 1) * st for n, st in zip(dims, self.strides, strict=True)) \
            + (bs // self.segment - 1) * self.segment_stride

    def segments(self) -> list[torch.Tensor]:
        """``[NB, segment, H_kv, D // 2]`` int32 views of the words, one per segment of the blocks."""
        NB, bs, H, D = self.shape
        o = self.words.storage_offset()
        return [torch.as_strided(self.words, (NB, self.segment, H, D // 2), self.strides, o + i * self.segment_stride)
                for i in range(bs // self.segment)]

    def unpack(self) -> torch.Tensor:
        """``[NB, bs, H_kv, D]`` bf16 copy of the keys (for oracles and tests)."""
        w = torch.cat(self.segments(), dim=1)
        halves = torch.stack([(w & 0xFFFF).to(torch.int16), (w >> 16).to(torch.int16)], dim=-1)
        return halves.reshape(*self.shape).view(torch.bfloat16)
