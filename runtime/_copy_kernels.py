"""Single-pass CPU row movers (numba) used by :mod:`copy_engine` for CPU tensors.

Each kernel copies row ``src[i]`` straight onto row ``dst[i]`` for ``i = 0, 1, ..., m-1`` *in that
order*, over the raw memory of a contiguous ``[N, W]`` view (one read and one write of every moved
byte, no staging buffer: the torch path reads and writes everything twice). Every index is
range-checked before the first byte moves, so a bad plan raises ``IndexError`` and leaves the tensor
untouched, like ``index_select`` on the torch path.

* ``move_rows(words, width, src, dst)``: ``words`` = the 1-D word array (uint64/32/16/8) of the
  view, ``width`` = row width in words; ordinary cached stores (small jobs, stats, positions).
* ``move_rows_nt(raw, row_bytes, src, dst)``: ``raw`` = the 1-D uint8 array of the view, whose base
  address and ``row_bytes`` are multiples of 64: 64-byte vector loads + non-temporal (streaming)
  stores, then a full fence. Streaming stores skip the read-for-ownership of every destination line
  (3 -> 2 bytes of DRAM traffic per moved byte, like a large ``memcpy``) at the cost of leaving the
  destination out of cache, so the engine uses it only for large jobs (``CopyEngine.nt_min_bytes``).
  The fence orders the streaming stores before the worker reports completion (``fence()``).

Why a single sequential pass is exact for both planner modes (a move copies a whole row and
``src[i] != dst[i]`` for every move, so no move overlaps itself):
  * compact: the destination set (holes below the new length n) and the source set (live slots at or
    above n) are disjoint, so no move reads a row another move writes: any order gives the same bytes.
  * ordered: moves of a row arrive in ascending order (the engine keeps plan order: the per-layer
    grouping is a stable sort and the per-head expansion keeps moves in order for each head), and the
    k-th survivor moves to k <= its slot. If move j writes row x (dst[j] = x) and move i reads it
    (src[i] = x), then src[i] = dst[j] <= src[j], hence i <= j, and i != j since src[j] != dst[j]: the
    read (move i) comes before the overwrite (move j) in this loop, so every move reads the original
    bytes. Rows of different (layer, head) rows or different requests never share a view row.
Both facts are exactly what the torch gather/scatter path relies on, so the results are byte-identical.

Compiled lazily per array type with ``cache=True`` (on-disk cache in ``__pycache__`` next to this
file, or numba's user-wide cache directory when that is not writable) and ``nogil=True`` so the copy
worker thread overlaps with Python bookkeeping exactly as it does with the torch kernels.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uint64
from numba.extending import intrinsic

from ._numba_compat import make_llvmlite_scan_safe

make_llvmlite_scan_safe()  # vLLM's kernel-rebinding scan must survive llvmlite in sys.modules

NT_ALIGN = 64  # bytes: one cache line / one 512-bit vector


@intrinsic
def _copy_line_nt(typingctx, arr, s_off, d_off):  # type: ignore[no-untyped-def]
    """64 bytes ``base + s_off`` -> ``base + d_off`` (both 64-aligned) with a non-temporal store."""
    sig = types.void(arr, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        vec = ir.VectorType(ir.IntType(64), 8)
        base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        sp = builder.bitcast(builder.gep(base, [args[1]]), vec.as_pointer())
        dp = builder.bitcast(builder.gep(base, [args[2]]), vec.as_pointer())
        st = builder.store(builder.load(sp, align=NT_ALIGN), dp, align=NT_ALIGN)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _full_fence(typingctx):  # type: ignore[no-untyped-def]
    """``fence seq_cst`` (mfence on x86): streaming stores become globally visible before we return."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _check(n: int, src: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(src.size):  # validate the whole plan first: all-or-nothing like the torch path
        s = src[i]
        d = dst[i]
        if s < 0 or s >= n or d < 0 or d >= n:
            raise IndexError("copy plan row index out of range")


@njit(cache=True, nogil=True)
def move_rows(words: np.ndarray, width: int, src: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover
    _check(words.size // width, src, dst)
    w = uint64(width)
    for i in range(src.size):  # plan order: required by the ordered-mode argument above
        s = uint64(src[i]) * w  # unsigned: no negative-index wraparound in the inner loop
        d = uint64(dst[i]) * w
        for j in range(w):
            words[d + j] = words[s + j]


@njit(cache=True, nogil=True)
def move_rows_nt(raw: np.ndarray, row_bytes: int, src: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover
    _check(raw.size // row_bytes, src, dst)
    w = uint64(row_bytes)
    for i in range(src.size):  # plan order: required by the ordered-mode argument above
        s = uint64(src[i]) * w
        d = uint64(dst[i]) * w
        for k in range(uint64(0), w, uint64(NT_ALIGN)):
            _copy_line_nt(raw, s + k, d + k)
    _full_fence()


def run(rows: np.ndarray, src: np.ndarray, dst: np.ndarray, nt_min_bytes: int) -> None:
    """``rows`` = C-contiguous ``[N, B]`` uint8 array (the view's memory): move rows ``src`` -> ``dst``."""
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("copy kernel needs a C-contiguous [N, B] uint8 view of the tensor's memory")
    nbytes = rows.shape[1]
    addr = rows.ctypes.data
    flat = rows.reshape(-1)
    if nbytes % NT_ALIGN == 0 and addr % NT_ALIGN == 0 and src.size * nbytes >= nt_min_bytes:
        move_rows_nt(flat, nbytes, src, dst)
        return
    for w, dt in ((8, np.uint64), (4, np.uint32), (2, np.uint16)):
        if nbytes % w == 0 and addr % w == 0:
            move_rows(flat.view(dt), nbytes // w, src, dst)
            return
    move_rows(flat, nbytes, src, dst)
