"""Repack kernel: execute a :class:`~vtoken_runtime.copy_engine.CopyPlan` in place with Triton.

The copy engine turns a plan into *jobs*: "rows ``src`` of a 2-D view ``[rows, W]`` go to rows
``dst`` of the same view" (K/V rows of every layout, per-slot stats, positions;
``CopyEngine.build_jobs``). This module executes those jobs with one kernel, so addressing is
shared with the torch engine and only the data movement differs. Bytes are moved as integers of
the element's size (bf16/fp16 -> int16, fp32 -> int32, int64 -> int64): results are byte-identical
whatever the payload (NaN bit patterns included).

Modes
  compact   destinations (holes below the new length) and sources (live slots at or above it) are
            disjoint (planner invariant): one in-place launch, every move independent.
  ordered   sources and destinations overlap. The result must equal executing the moves of a
            row in ascending order, which (planner.py proof: a slot is read no later than it is
            written) equals *snapshot* semantics "dst[i] <- old src[i]". GPU programs run
            concurrently, so the kernel gathers every source into a scratch buffer first, then
            scatters (two launches over the same job; scratch = moves x row bytes).

Grid: ``cdiv(M, BLOCK_M)`` programs, each ``BLOCK_M`` moves x ``W`` elements in ``BLOCK_W`` chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = ("compact", "ordered")
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def move_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, M, W,
                     SRC_IDENTITY: tl.constexpr, DST_IDENTITY: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """``dst[dst_idx[m], :] = src[src_idx[m], :]`` for m < M (identity index when flagged)."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < M
    if SRC_IDENTITY:
        s = m
    else:
        s = tl.load(src_idx_ptr + m, mask=mm, other=0).to(tl.int64)
    if DST_IDENTITY:
        d = m
    else:
        d = tl.load(dst_idx_ptr + m, mask=mm, other=0).to(tl.int64)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        msk = mm[:, None] & (w < W)[None, :]
        x = tl.load(src_ptr + s[:, None] * W + w[None, :], mask=msk)
        tl.store(dst_ptr + d[:, None] * W + w[None, :], x, mask=msk)


def _blocks(width: int) -> tuple[int, int, int]:
    bw = min(triton.next_power_of_2(max(width, 1)), 256)
    bm = max(1, min(128, 4096 // bw))
    warps = 4 if bm * bw <= 4096 else 8
    return bm, bw, warps


def _as_int(view: torch.Tensor) -> torch.Tensor:
    dt = _INT_OF_SIZE[view.element_size()]
    return view if view.dtype == dt else view.view(dt)


def move_rows(view: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, mode: str = "ordered",
              scratch: torch.Tensor | None = None) -> None:
    """Move rows ``src`` -> ``dst`` of the contiguous 2-D ``view`` in place (see module doc)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if view.dim() != 2 or not view.is_contiguous():
        raise ValueError(f"view must be a contiguous 2-D tensor, got shape {tuple(view.shape)}")
    m = int(src.numel())
    if m == 0:
        return
    if dst.numel() != m:
        raise ValueError(f"src and dst differ in length: {m} vs {dst.numel()}")
    src = src.to(view.device, torch.int64).contiguous()
    dst = dst.to(view.device, torch.int64).contiguous()
    v = _as_int(view)
    width = v.shape[1]
    bm, bw, warps = _blocks(width)
    grid = (triton.cdiv(m, bm),)
    if mode == "compact":
        move_rows_kernel[grid](v, v, src, dst, m, width, SRC_IDENTITY=False, DST_IDENTITY=False,
                               BLOCK_M=bm, BLOCK_W=bw, num_warps=warps)
        return
    if scratch is None or scratch.numel() < m * width:
        buf = torch.empty((m, width), dtype=v.dtype, device=v.device)
    else:
        buf = _as_int(scratch).view(-1)[: m * width].view(m, width)
    move_rows_kernel[grid](v, buf, src, src, m, width, SRC_IDENTITY=False, DST_IDENTITY=True,
                           BLOCK_M=bm, BLOCK_W=bw, num_warps=warps)
    move_rows_kernel[grid](buf, v, dst, dst, m, width, SRC_IDENTITY=True, DST_IDENTITY=False,
                           BLOCK_M=bm, BLOCK_W=bw, num_warps=warps)


def run_jobs(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mode: str = "ordered") -> None:
    """Execute ``CopyEngine.build_jobs`` output with the Triton kernel (same order as the engine)."""
    for view, src, dst in jobs:
        move_rows(view, src, dst, mode)


def aot_specs(arch: int = 90) -> list[tuple[object, dict[str, str], dict[str, object], int, str]]:
    """(kernel, signature, constexprs, num_warps, label) at the default configurations."""
    out = []
    for width, dt, what in ((256, "i16", "kv bf16 vllm_cpu D=128 (2D=256)"), (1, "i32", "stats/positions")):
        bm, bw, warps = _blocks(width)
        sig = {"src_ptr": f"*{dt}", "dst_ptr": f"*{dt}", "src_idx_ptr": "*i64", "dst_idx_ptr": "*i64",
               "M": "i32", "W": "i32"}
        for sid, did, lab in ((False, False, "compact"), (False, True, "gather"), (True, False, "scatter")):
            out.append((move_rows_kernel, sig, {"SRC_IDENTITY": sid, "DST_IDENTITY": did, "BLOCK_M": bm,
                                                "BLOCK_W": bw}, warps, f"repack.{lab}[{what}]"))
    return out
