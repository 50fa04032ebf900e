"""Attention statistics on CPU (numba): ``attn_sum`` / ``attn_last`` / ``attn_window`` / ``low_attn_count``.

:func:`update_attn_stats_cpu` has the signature and the semantics of the Triton kernel
(``vtoken_runtime.kernels.attn_stats_triton.update_attn_stats``; the rules are
``vtoken_runtime.stats.torch_stats``') for CPU tensors, without materialising probabilities: the torch
collector builds ``[B, H_kv, G*Q, L]`` probabilities (and gathered ``[B, H_kv, L, D]`` keys) per layer,
this kernel keeps each query's scores (or ``O(LANES)`` state per (query, head) row) and makes three passes
over them.

The kernel in modules by function; this one is its host API (validation, zero-copy numpy views, the call):

    cpu_numerics   fp32 constants, exp, fused multiply-add, vector dot products (LLVM intrinsics)
    cpu_gather     key formats and layouts (:class:`PairedKeys`), the key tile gather through the block table
    cpu_passes     the three passes over a key tile (scores and row max, sum of exponentials, probabilities)
    cpu_driver     per request and KV head: the needed queries, the scratch and score cache, the passes, the fold
                   into the per-slot stores; :func:`~.cpu_driver.load` compiles it (numba imported on the first call)

Queries: ``query [B, Q, H_q, D]``, or (:func:`prepare_step`'s ``token_index``) the step's flat query rows
``[T, H_q, D]`` read in place, e.g. vLLM's query tensor (no padded copy); bf16 queries are read as their bits
and widened in the kernel (exact), fp32 as they are.

numba is imported on the first call (not at module import; ``ImportError`` with the fix if it is
missing). The kernels are compiled once per argument-type combination (fp32 / bf16 cache: ~5-10 s each)
and cached on disk (``cache=True``, ``__pycache__``); they release the GIL (``nogil=True``; all scratch
is allocated per call, so concurrent calls on different stores are safe) and are single-threaded
(``parallel=False``: vLLM's CPU workers here run with ``OMP_NUM_THREADS=1`` and one core per worker).

Importing numba into a process that later builds a vLLM engine used to crash vLLM's kernel-rebinding
scan (``vllm.triton_utils.dispatcher._rebind_kernels``, run by ``init_worker`` ->
``register_triton_kernel_overrides``): for every module attribute ``value`` with a ``__dict__`` it calls
``vars(value).get("kernel")``, and llvmlite's ``llvmlite.binding.ffi.lib`` (a ``__slots__`` object
whose ``__getattr__`` forwards to the ctypes library) answers ``__dict__`` with a ``_lib_fn_wrapper``,
which has no ``.get``. :func:`make_llvmlite_scan_safe` gives that object a plain ``{}`` for ``__dict__``
(it is never otherwise read); it runs right after numba is imported (:func:`.cpu_driver.load`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._numba_compat import make_llvmlite_scan_safe
from .cpu_driver import load
from .cpu_gather import KF_BF16, KF_F32, KF_PAIRS, PairedKeys
from .torch_stats import ATTENTION_STATS

STAT_NAMES = ATTENTION_STATS

__all__ = ["STAT_NAMES", "PairedKeys", "PreparedLayer", "kernels_available", "make_llvmlite_scan_safe", "prepare_layer",
           "prepare_step", "run_prepared", "update_attn_stats_cpu"]

_MAX_TILE = 256
# key tiles (transposed fp32 keys) kept between the passes of one (request, KV head); a longer request
# re-gathers its earlier tiles in the sum pass and pass 2 (the chunk the previous pass ended on is reused)
SCRATCH_BYTES = 32 << 20
# the scores of a block of a request's needed queries (as many as fit, at least one), kept across the passes
# when the request's key tiles fit in one scratch chunk; else every pass recomputes them (same bits)
SCORE_BYTES = 16 << 20


def kernels_available() -> bool:
    """True when numba imports (the kernel can run); does not compile anything."""
    try:
        load()
    except ImportError:
        return False
    return True


def _flat(t: torch.Tensor, as_dtype: torch.dtype | None = None) -> np.ndarray:
    """1-D numpy array (zero copy) over the memory a tensor spans, from its first element; ``as_dtype``
    reinterprets the bits (same element size)."""
    if as_dtype is not None and as_dtype != t.dtype:
        t = t.view(as_dtype)
    if t.is_contiguous():
        return t.numpy().reshape(-1)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return torch.as_strided(t, (span,), (1,)).numpy()


_UNUSED = np.zeros(1, np.float32)


def _tile(D: int, block_n: int | None) -> int:
    if block_n is not None:
        if not 1 <= int(block_n) <= _MAX_TILE:
            raise ValueError(f"block_n must be in [1, {_MAX_TILE}], got {block_n}")
        return int(block_n)
    return 128 if D <= 64 else 64


class PreparedLayer:
    """What the kernel reads of one layer's cache tensors, as zero-copy numpy views, validated once
    (:func:`prepare_layer`): the keys ``[NB, bs, H_kv, D]`` (raw bits and strides), the key positions and
    the statistic stores. A caller that runs the kernel every step keeps one per layer while those tensors
    stay the same (``StatsCollector``: ~60 us of Python per call saved in the serving engine)."""

    __slots__ = ("D", "Hkv", "bs", "do", "kfmt", "kp_rs", "kpos", "kraw", "kseg", "kstrides", "outs", "rs")

    def __init__(self, kraw: np.ndarray, kfmt: int, kstrides: tuple[int, int, int, int], kseg: tuple[int, int],
                 bs: int, Hkv: int, D: int, kpos: np.ndarray, kp_rs: int, outs: tuple[np.ndarray, ...],
                 do: tuple[bool, ...], rs: int) -> None:
        self.kraw, self.kfmt, self.kstrides, self.kseg, self.bs, self.Hkv, self.D = kraw, kfmt, kstrides, kseg, bs, Hkv, D
        self.kpos, self.kp_rs, self.outs, self.do, self.rs = kpos, kp_rs, outs, do, rs




def prepare_layer(key_cache: torch.Tensor | PairedKeys, key_positions: torch.Tensor,
                  stats: dict[str, torch.Tensor]) -> PreparedLayer:
    """Validate one layer's tensors (the arguments of :func:`update_attn_stats_cpu`) and view them as numpy
    arrays over the same memory. ``stats`` must not be empty."""
    unknown = set(stats) - set(STAT_NAMES)
    if unknown:
        raise ValueError(f"unknown attention statistics {sorted(unknown)}; known: {STAT_NAMES}")
    NB, bs, Hkv, D = key_cache.shape
    if key_cache.device.type != "cpu":
        raise ValueError("update_attn_stats_cpu takes CPU tensors (the Triton kernel runs on GPUs)")
    kraw: np.ndarray
    kseg = (bs, 0)
    if isinstance(key_cache, PairedKeys):  # strides in words, one per pair of dims along the last axis
        w = key_cache.words.detach()
        kraw = torch.as_strided(w, (key_cache.span(),), (1,), w.storage_offset()).numpy().view(np.uint32)
        kfmt, kstrides, kseg = KF_PAIRS, key_cache.strides, (key_cache.segment, key_cache.segment_stride)
    elif key_cache.dtype == torch.float32:
        kraw, kfmt, kstrides = _flat(key_cache.detach(), torch.int32).view(np.uint32), KF_F32, key_cache.stride()
    elif key_cache.dtype == torch.bfloat16:
        kraw, kfmt, kstrides = _flat(key_cache.detach(), torch.int16).view(np.uint16), KF_BF16, key_cache.stride()
    else:
        raise ValueError(f"key_cache dtype {key_cache.dtype} not supported (float32, bfloat16)")
    if key_positions.shape[0] not in (1, Hkv):
        raise ValueError(f"key_positions rows must be 1 or H_kv={Hkv}, got {key_positions.shape[0]}")
    outs: list[np.ndarray] = []
    rs = None
    for n in STAT_NAMES:
        t = stats.get(n)
        if t is None:
            outs.append(_UNUSED)  # never written (its flag is off)
            continue
        if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] != Hkv or t.stride(1) != 1
                or t.device.type != "cpu" or (rs is not None and t.stride(0) != rs)):
            raise ValueError("stats must be [H_kv, S] float32 CPU tensors with unit stride along S and equal strides")
        rs = t.stride(0)
        outs.append(_flat(t))
    if rs is None:
        raise ValueError("prepare_layer needs at least one statistic")
    kp = key_positions.detach()
    if kp.dtype != torch.int64 or kp.stride(-1) != 1:
        # a converted copy would not see later writes: the kernel needs the store itself
        raise ValueError(f"key_positions must be int64 with unit stride along S, got {kp.dtype}, strides {kp.stride()}")
    per_head = kp.shape[0] == Hkv and Hkv > 1
    return PreparedLayer(kraw, kfmt, tuple(kstrides), kseg, bs, Hkv, D, _flat(kp), kp.stride(0) if per_head else 0,
                         tuple(outs), tuple(n in stats for n in STAT_NAMES), rs)


Step = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]  # see prepare_step


def prepare_step(block_tables: torch.Tensor, cache_lens: torch.Tensor, query_pos: torch.Tensor,
                 prompt_lens: torch.Tensor | None, token_index: torch.Tensor | None = None) -> Step:
    """The step's metadata as the kernel reads it (the same for every layer of a step):
    ``(block_tables int32 [B, max_blocks], cache_lens int32 [B], query_pos int64 [B, Q], prompt_lens int64 [B],
    token_index int64 [B, Q] or None)``. ``token_index`` (-1 = padding): the row of (request ``b``, query ``q``) in
    the flat query rows :func:`run_prepared` then takes (``[T, H_q, D]``, e.g. vLLM's query tensor of the step, read
    in place: no padded ``[B, Q, H_q, D]`` copy); None: :func:`run_prepared` takes ``query [B, Q, H_q, D]``."""
    bt = np.ascontiguousarray(block_tables.numpy(), dtype=np.int32)
    lens = np.ascontiguousarray(cache_lens.numpy(), dtype=np.int32)
    qpos = np.ascontiguousarray(query_pos.numpy(), dtype=np.int64)
    if prompt_lens is None:
        plen = qpos.max(1) + 1 if qpos.size else np.zeros(qpos.shape[0], np.int64)
    else:
        plen = np.ascontiguousarray(prompt_lens.numpy(), dtype=np.int64)
    tok = None
    if token_index is not None:
        if tuple(token_index.shape) != qpos.shape:
            raise ValueError(f"token_index {tuple(token_index.shape)}; expected query_pos's shape {qpos.shape}")
        tok = np.ascontiguousarray(token_index.numpy(), dtype=np.int64)
    return bt, lens, qpos, plen, tok


def _query_rows(rows: torch.Tensor) -> tuple[np.ndarray, bool]:
    """``rows [T, H_q, D]`` as the kernel reads them: ``(C-contiguous array, bf16 bits)``: bf16 as its uint16 bits
    (widened exactly in the kernel; no fp32 copy), fp32 as it is, another dtype converted to fp32."""
    r = rows.detach()
    if r.dtype == torch.bfloat16:
        return r.contiguous().view(torch.int16).numpy().view(np.uint16), True
    return r.to(torch.float32).contiguous().numpy(), False


def run_prepared(layer: PreparedLayer, step: Step, query: torch.Tensor, scale: float | None = None,
                 obs_window: int = 32, history_window: int = 64, low_attn_threshold: float = 1.0,
                 block_n: int | None = None) -> None:
    """:func:`update_attn_stats_cpu` on a :func:`prepare_layer` / :func:`prepare_step` pair: ``query [B, Q, H_q, D]``,
    or, with the step's ``token_index``, the flat query rows ``[T, H_q, D]`` it indexes (only the rows of valid
    queries are read)."""
    bt, lens, qpos, plen, tok = step
    if tok is None:
        if query.dim() != 4:
            raise ValueError(f"query {tuple(query.shape)}; expected [B, Q, H_q, D] (or rows [T, H_q, D] with a "
                             "token_index in prepare_step)")
        B, Q, Hq, D = query.shape
        rows = query.reshape(B * Q, Hq, D)
        tok = np.arange(B * Q, dtype=np.int64).reshape(B, Q)
    else:
        if query.dim() != 3:
            raise ValueError(f"query {tuple(query.shape)}; expected rows [T, H_q, D] (the step has a token_index)")
        (B, Q), (T, Hq, D) = tok.shape, query.shape
        if tok.size and int(tok.max()) >= T:
            raise ValueError(f"token_index reaches row {int(tok.max())} of {T} query rows")
        rows = query
    Hkv = layer.Hkv
    if D != layer.D or Hq % Hkv:
        raise ValueError(f"query {tuple(query.shape)} does not match the key cache (H_kv {Hkv}, D {layer.D})")
    if query.device.type != "cpu":
        raise ValueError("update_attn_stats_cpu takes CPU tensors (the Triton kernel runs on GPUs)")
    if B == 0 or Q == 0:
        return
    G = Hq // Hkv
    BN = _tile(D, block_n)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qf, q_bits = _query_rows(rows)
    s_nb, s_bs, s_h, s_d = layer.kstrides
    o_sum, o_last, o_win, o_low = layer.outs
    f_sum, f_last, f_win, f_low = layer.do
    decay = np.float32(1.0 - 1.0 / int(history_window))
    thr_g = np.float32(float(low_attn_threshold) * G)  # the collector's threshold * group_size, in fp32
    load()(qf, tok, q_bits, layer.kraw, layer.kfmt, s_nb, s_bs, s_h, s_d, *layer.kseg, bt, lens, qpos, plen, layer.kpos,
            layer.kp_rs, layer.bs, Hkv, o_sum, o_last, o_win, o_low, layer.rs, f_sum, f_last, f_win, f_low,
            np.float32(scale), int(obs_window), decay, thr_g, BN, max(1, SCRATCH_BYTES // (D * BN * 4 + BN * 16)),
            SCORE_BYTES // 4)


def update_attn_stats_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor | PairedKeys,
    block_tables: torch.Tensor,
    cache_lens: torch.Tensor,
    query_pos: torch.Tensor,
    key_positions: torch.Tensor,
    stats: dict[str, torch.Tensor],
    scale: float | None = None,
    obs_window: int = 32,
    history_window: int = 64,
    low_attn_threshold: float = 1.0,
    prompt_lens: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Update ``stats[name]`` (``[H_kv, S]`` float32 CPU tensors, names from :data:`STAT_NAMES`; only those
    present are computed) in place for one layer and one step, exactly like the Triton
    ``update_attn_stats`` (same arguments): ``query [B, Q, H_q, D]``, ``key_cache [NB, bs, H_kv, D]``
    (float32 or bfloat16, any strides: a unit stride along D takes the vectorised 8 x 8 gather, a unit stride
    along the block slot (vLLM's CPU layout stores K dim-major) contiguous per-dim copies or, with a block size
    that is a multiple of 8 and cached scores, no copy (dot products read the cache), another the scalar one;
    same bits; or :class:`PairedKeys`, bf16 pairs of dims in 32-bit words, read the same ways),
    ``block_tables [B, max_blocks]``, ``cache_lens [B]``, ``query_pos [B, Q]`` (-1 = padding),
    ``key_positions [H_kv or 1, S]`` (-1 = dead), ``prompt_lens [B]`` (default: the end of this step).
    ``block_n`` = key tile width (default 128 for D <= 64, else 64); ``num_warps`` is ignored (GPU only)."""
    del num_warps
    if not stats:
        return
    kp = key_positions
    if kp.dtype != torch.int64 or kp.stride(-1) != 1:
        kp = kp.to(torch.int64).contiguous()  # read-only here: a converted copy is fine
    run_prepared(prepare_layer(key_cache, kp, stats), prepare_step(block_tables, cache_lens, query_pos, prompt_lens),
                 query, scale, obs_window, history_window, low_attn_threshold, block_n)
