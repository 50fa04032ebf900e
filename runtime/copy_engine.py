"""Copy engine: executes move plans in place on the paged K/V caches, the stats and the positions.

Supported K/V layouts (per layer):

    generic   K and V each [num_blocks, block_size, H_kv, D]   (one [2, NB, bs, H_kv, D] tensor or a
              (K, V) pair)       physical slot s = block * bs + offset, head h:
                  request granularity: row s of the view [NB*bs, H_kv*D]  (whole token, all heads)
                  head granularity:    row s*H_kv + h of the view [NB*bs*H_kv, D]
    vllm_cpu  [num_blocks, H_kv, block_size, 2*D]  (K = [..., :D], V = [..., D:])
                  row (block*H_kv + h)*bs + offset of the view [NB*H_kv*bs, 2D]  (K and V together)
    stats     [L, H_kv, S] per stat -> per layer the view [H_kv*S, 1], row h*S + s
    positions [R, S]                -> the view [R*S, 1], row r*S + s

Every job is "rows ``src`` of a 2-D view go to rows ``dst`` of the same view", run in chunks:
``index_select(view, 0, src_chunk, out=buf)`` then a scatter of the buffer's rows to ``dst_chunk``
(``view.index_copy_`` on GPU; on CPU numpy's row ``put`` over the same memory, which is faster for
scattered rows), with a buffer reused across chunks and plans (``chunk_bytes`` ~ L2/L3 sized). That is the torch path
(CPU fallback; CUDA when Triton is missing or ``gpu_runner="torch"``). On CPU, by default
(``cpu_path="auto"``, env ``VTOKEN_CPU_COPY``), a contiguous view instead goes through one pass of a numba
kernel (``_copy_kernels``): each row is copied src -> dst directly in plan order, with streaming stores
for jobs >= ``nt_min_bytes``; byte-identical to the torch path and ~2x its bandwidth (benchmarks/repack.py).

On CUDA, by default (``gpu_runner="auto"``, env ``VTOKEN_GPU_COPY``), a job runs on the Triton repack
kernel (``kernels/repack_triton.move_rows``) when Triton imports: ``planner_mode="ordered"`` (default,
correct for both planner modes: gather every source into a scratch buffer reused across jobs and
plans, then scatter) or ``"compact"`` (one in-place launch; only for compact plans, whose sources and
destinations are disjoint). Results are byte-identical to the torch path. ``gpu_runner="triton"`` forces
the kernel for any device, CPU tensors included (under ``TRITON_INTERPRET=1``: how CPU tests prove the
CUDA path's data movement); ``"torch"`` forces the torch path.

Why overlapping source and destination sets are safe
  * compact: destinations are holes below the new length n, sources are live slots at or above n,
    so dst ∩ src = ∅ (checked by the planner in debug mode): any order, any chunking is correct.
  * ordered: sets overlap, but moves of a row are emitted in ascending order and the k-th survivor
    moves to k <= its slot, so a slot is read by a move no later than the move that overwrites it
    (proof in planner.py). Chunks run in order and each chunk gathers all its sources into the buffer
    before scattering, so no source is overwritten before it is read. Grouping moves by layer uses a
    stable sort and different rows/requests never share a (view row), so per-row order is preserved.
  * naive: no moves.

Asynchrony: on CPU a single worker thread runs plans (torch kernels drop the GIL, so the engine
overlaps with Python bookkeeping); on CUDA a side stream plus an event. ``fence()`` waits for the
in-flight plan (CPU: joins the future and re-raises its error; CUDA: the current stream waits on the
event). At most one plan is in flight (the cache fences before submitting the next: I4). With
``async_copy=False`` a CUDA plan runs on the current stream (stream-ordered: nothing to fence).
``submit`` never synchronises the host with a CUDA device: the row ids of all jobs are packed into one
pinned host buffer and copied with one non-blocking H2D copy on the stream that runs the jobs; the
host buffer is kept referenced until the next ``fence``/``submit`` (and the caching host allocator
records the copy's event), the device copy is ``record_stream``-ed on that stream.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .slot_stats import SlotStore

log = logging.getLogger("vtoken.copy")

KV_LAYOUTS = ("generic", "vllm_cpu")
CPU_PATHS = ("auto", "numba", "torch")
GPU_RUNNERS = ("auto", "triton", "torch")
PLANNER_MODES = ("ordered", "compact")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class CopyPlan:
    """Physical moves: ``rows``/``src``/``dst`` are ``[M]`` int64 (rows all 0 at request granularity)."""

    rows: np.ndarray
    src: np.ndarray
    dst: np.ndarray

    @property
    def num_moves(self) -> int:
        return int(self.src.size)


_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One process-wide copy worker shared by all engines (no thread per cache; plans stay FIFO)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vtoken-copy")
        return _EXECUTOR


Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (view [N, W], src rows [m], dst rows [m])


def _np_rows(t: torch.Tensor) -> np.ndarray:
    """1-D numpy array of opaque rows aliasing a contiguous 2-D CPU tensor (any dtype, bf16 included)."""
    raw = t.view(torch.uint8).numpy()  # [N, W * element_size], shares memory
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(raw.shape[0])


_KERNELS: Any = None
_KERNEL_ERROR: str | None = None
_KERNELS_LOCK = threading.Lock()


def _cpu_kernels() -> Any:
    """The numba kernel module (imported and compiled lazily: numba import ~0.5 s), or None."""
    global _KERNELS, _KERNEL_ERROR
    if _KERNELS is None and _KERNEL_ERROR is None:
        with _KERNELS_LOCK:
            if _KERNELS is None and _KERNEL_ERROR is None:
                try:
                    from . import _copy_kernels

                    _KERNELS = _copy_kernels
                except Exception as e:  # numba missing or broken: the torch path still works
                    _KERNEL_ERROR = f"{type(e).__name__}: {e}"
    return _KERNELS


def _disable_cpu_kernels(e: Exception) -> None:
    """The kernel failed before moving anything (e.g. numba could not load its on-disk cache, written for the
    same file imported under another module name): every later job takes the torch path (``cpu_path="auto"``),
    with one warning, instead of failing every eviction."""
    global _KERNELS, _KERNEL_ERROR
    with _KERNELS_LOCK:
        if _KERNEL_ERROR is None:
            _KERNEL_ERROR = f"{type(e).__name__}: {e}"
            log.warning("vtoken: the numba copy kernel failed (%s); copies take the torch path from now on",
                        _KERNEL_ERROR)
        _KERNELS = None


_WARMED = False


def _warm_kernels() -> None:
    """Import numba and load/compile the kernels for the common word types (runs once, on the worker)."""
    k = _cpu_kernels()
    if k is None:
        return
    rows = np.zeros((4, 2 * k.NT_ALIGN), np.uint8)
    one = np.ones(1, np.int64)
    zero = np.zeros(1, np.int64)
    k.run(rows, zero, one, 0)  # streaming (a failure here is seen again by the first job: run_jobs falls back)
    k.run(rows, zero, one, 1 << 62)  # uint64 words (K/V rows, positions)
    k.run(np.zeros((4, 4), np.uint8), zero, one, 1 << 62)  # uint32 words (float32 stats)


_REPACK: Any = None
_REPACK_ERROR: str | None = None


def _repack_kernels() -> Any:
    """``kernels.repack_triton`` (imports triton: lazily, on first use), or None when it cannot import."""
    global _REPACK, _REPACK_ERROR
    if _REPACK is None and _REPACK_ERROR is None:
        with _KERNELS_LOCK:
            if _REPACK is None and _REPACK_ERROR is None:
                try:
                    from .kernels import repack_triton

                    _REPACK = repack_triton
                except Exception as e:  # triton missing or broken: the torch path still works
                    _REPACK_ERROR = f"{type(e).__name__}: {e}"
    return _REPACK


def _run_cpu_kernel(view: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, nt_min_bytes: int) -> None:
    """Single pass: row ``src[i]`` -> row ``dst[i]`` for i in plan order, over the view's raw memory
    (one read + one write per moved byte; ``_copy_kernels`` explains why plan order is exact in both
    planner modes). ``view`` is a contiguous 2-D CPU tensor of any dtype (bf16 included)."""
    if src.numel() == 0:
        return
    s = np.ascontiguousarray(src.numpy(), dtype=np.int64)
    d = np.ascontiguousarray(dst.numpy(), dtype=np.int64)
    if s.shape != d.shape:
        raise ValueError(f"copy job: {s.size} sources but {d.size} destinations")
    _cpu_kernels().run(view.view(torch.uint8).numpy(), s, d, nt_min_bytes)  # [N, W*el] bytes, shared


def kv_views(t: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_layout: str, head_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NB, bs, H_kv, D]`` (K, V) views of one layer's cache in ``kv_layout`` (strided for vllm_cpu:
    K = ``[..., :D]``, V = ``[..., D:]`` of ``[NB, H_kv, bs, 2D]``)."""
    if kv_layout == "vllm_cpu":
        if isinstance(t, tuple):
            raise ValueError("a vllm_cpu layer cache is one [NB, H_kv, bs, 2D] tensor, not a (K, V) pair")
        return t[..., :head_size].permute(0, 2, 1, 3), t[..., head_size:].permute(0, 2, 1, 3)
    return t if isinstance(t, tuple) else (t[0], t[1])


def _flat(t: torch.Tensor, rows: int, width: int, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous to be moved in place (shape {tuple(t.shape)})")
    return t.view(rows, width)


class CopyEngine:
    """Moves K/V rows plus their stats and positions for a :class:`CopyPlan`."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
        kv_layout: str,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        slot_store: SlotStore,
        per_head: bool,
        async_copy: bool = True,
        chunk_bytes: int = 2 << 20,
        cpu_path: str | None = None,
        gpu_runner: str | None = None,
        planner_mode: str = "ordered",
    ) -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown kv_layout {kv_layout!r}; expected one of {KV_LAYOUTS}")
        self.layout = kv_layout
        self.H, self.D, self.bs, self.nb = num_kv_heads, head_size, block_size, num_blocks
        self.S = num_blocks * block_size
        self.store = slot_store
        self.per_head = per_head
        self.chunk_bytes = int(chunk_bytes)
        self._views: list[list[torch.Tensor]] = [self._kv_views(t) for t in kv_caches]
        self._stat_views: list[list[torch.Tensor]] = [
            [t[li].view(self.H * self.S, 1) for t in slot_store.stats.values()] for li in range(len(kv_caches))
        ]
        self._pos_view = slot_store.positions.view(-1, 1)
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.device = slot_store.positions.device
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._async = bool(async_copy)
        self._future: Future[None] | None = None
        self._event: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device) if self._cuda else None
        self._lock = threading.Lock()
        # CPU jobs: "auto" = single-pass numba kernel when numba imports (else torch), "numba" (required),
        # "torch" = the gather/scatter reference path.
        self.cpu_path: str = cpu_path or os.environ.get("VTOKEN_CPU_COPY", "auto")
        if self.cpu_path not in CPU_PATHS:
            raise ValueError(f"copy path {self.cpu_path!r} (cpu_path / VTOKEN_CPU_COPY); expected one of {CPU_PATHS}")
        # Which runner moves a job's rows: "auto" = the Triton repack kernel for CUDA tensors when triton
        # imports (else torch); "triton" = the kernel for every device (CPU tensors: TRITON_INTERPRET=1);
        # "torch" = the gather/scatter path (CPU: cpu_path decides). Attributes: may be set after
        # construction (e.g. ``cache.engine.gpu_runner = "triton"``).
        self.gpu_runner: str = gpu_runner or os.environ.get("VTOKEN_GPU_COPY", "auto")
        if self.gpu_runner not in GPU_RUNNERS:
            raise ValueError(f"gpu_runner {self.gpu_runner!r} (gpu_runner / VTOKEN_GPU_COPY); expected one of "
                             f"{GPU_RUNNERS}")
        # Mode of the Triton kernel: "ordered" (gather to scratch, then scatter) is exact for both planner
        # modes; "compact" (one in-place launch) only when every plan is compact (disjoint sets).
        self.planner_mode: str = planner_mode
        if self.planner_mode not in PLANNER_MODES:
            raise ValueError(f"planner_mode {planner_mode!r}; expected one of {PLANNER_MODES}")
        self._scratch: dict[tuple[int, str, int], torch.Tensor] = {}  # (element size, device, stream) -> rows
        self._keepalive: list[torch.Tensor] = []  # index buffers of the last CUDA plan (until fence/submit)
        self.jobs_run: dict[str, int] = {}  # runner -> jobs executed ("triton", "torch", "numba")
        # Kernel jobs moving at least this many bytes use streaming (non-temporal) stores: ~1.5x the
        # bandwidth for plans much larger than the caches, but the moved rows end up out of cache.
        self.nt_min_bytes = 4 << 20
        global _WARMED
        if not self._cuda and self.cpu_path != "torch" and not _WARMED:
            # First use costs ~0.4 s (numba import) + ~0.4 s (cache load; ~1 s to compile without
            # the on-disk cache): pay it once per process on the copy worker, off the caller's path.
            _WARMED = True
            _executor().submit(_warm_kernels)
        self.plans_executed = 0
        self.bytes_moved = 0  # K/V bytes only (what the benchmark reports)

    # ------------------------------------------------------------------ layout
    def _kv_views(self, t: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        H, D, bs, nb = self.H, self.D, self.bs, self.nb
        if self.layout == "vllm_cpu":
            if isinstance(t, tuple) or tuple(t.shape) != (nb, H, bs, 2 * D):
                raise ValueError(f"vllm_cpu layer cache must be [{nb}, {H}, {bs}, {2 * D}]")
            return [_flat(t, nb * H * bs, 2 * D, "kv cache")]
        pair = t if isinstance(t, tuple) else (t[0], t[1])
        out = []
        for x in pair:
            if tuple(x.shape) != (nb, bs, H, D):
                raise ValueError(f"generic K/V cache must be [{nb}, {bs}, {H}, {D}], got {tuple(x.shape)}")
            out.append(_flat(x, nb * bs * H, D, "kv cache") if self.per_head else _flat(x, nb * bs, H * D, "kv"))
        return out

    def _kv_index(self, slots: np.ndarray, heads: np.ndarray | None) -> np.ndarray:
        """Row ids in the K/V views for physical ``slots`` [m] (and ``heads`` [m] at head granularity)."""
        H, bs = self.H, self.bs
        if heads is None:  # request granularity: a token's rows for every head
            if self.layout == "generic":
                return slots
            h = np.arange(H, dtype=np.int64)
            return (((slots // bs)[:, None] * H + h) * bs + (slots % bs)[:, None]).reshape(-1)
        if self.layout == "generic":
            return slots * H + heads
        return ((slots // bs) * H + heads) * bs + slots % bs

    def _stat_index(self, slots: np.ndarray, heads: np.ndarray | None) -> np.ndarray:
        if heads is None:
            return (np.arange(self.H, dtype=np.int64)[None, :] * self.S + slots[:, None]).reshape(-1)
        return heads * self.S + slots

    def row_bytes(self) -> int:
        """K/V bytes moved per row-token move (all layers at request granularity, one (l, h) otherwise)."""
        el = self._views[0][0].element_size() if self._views else 4
        per_lh = 2 * self.D * el
        return per_lh if self.per_head else per_lh * self.H * len(self._views)

    def build_jobs(self, plan: CopyPlan) -> list[Job]:
        """Turn a plan into per-view index jobs (vectorized numpy; no per-token loop)."""
        if plan.num_moves == 0:
            return []
        jobs: list[Job] = []
        t = torch.as_tensor
        if not self.per_head:
            s, d = plan.src, plan.dst
            ks, kd = t(self._kv_index(s, None)), t(self._kv_index(d, None))
            ss, sd = t(self._stat_index(s, None)), t(self._stat_index(d, None))
            for li, views in enumerate(self._views):
                jobs += [(v, ks, kd) for v in views]
                jobs += [(v, ss, sd) for v in self._stat_views[li]]
            jobs.append((self._pos_view, t(s), t(d)))
        else:
            layer = plan.rows // self.H
            order = np.argsort(layer, kind="stable")  # stable: per-row ascending order preserved
            layer, rows = layer[order], plan.rows[order]
            s, d, heads = plan.src[order], plan.dst[order], rows % self.H
            bounds = np.searchsorted(layer, np.arange(len(self._views) + 1))
            for li, views in enumerate(self._views):
                a, b = bounds[li], bounds[li + 1]
                if a == b:
                    continue
                ks, kd = t(self._kv_index(s[a:b], heads[a:b])), t(self._kv_index(d[a:b], heads[a:b]))
                ss, sd = t(self._stat_index(s[a:b], heads[a:b])), t(self._stat_index(d[a:b], heads[a:b]))
                jobs += [(v, ks, kd) for v in views]
                jobs += [(v, ss, sd) for v in self._stat_views[li]]
            jobs.append((self._pos_view, t(rows * self.S + s), t(rows * self.S + d)))
        return jobs

    # ------------------------------------------------------------------ execution
    def _buffer(self, dtype: torch.dtype, width: int, device: torch.device) -> torch.Tensor:
        key = (dtype, width)
        buf = self._buffers.get(key)
        if buf is None:
            el = torch.empty(0, dtype=dtype).element_size()
            rows = max(1, self.chunk_bytes // (width * el))
            buf = self._buffers[key] = torch.empty(rows, width, dtype=dtype, device=device)
        return buf

    def _use_kernel(self, view: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """Whether the single-pass CPU kernel runs this job (else the torch gather/scatter path)."""
        if self.cpu_path == "torch" or view.device.type != "cpu" or src.device.type != "cpu":
            return False
        if dst.device.type != "cpu" or view.dim() != 2 or not view.is_contiguous():
            return False
        if _cpu_kernels() is None:
            if self.cpu_path == "numba":
                raise RuntimeError(f"cpu_path='numba' but numba cannot be imported: {_KERNEL_ERROR}")
            return False
        return True

    def _use_triton(self, view: torch.Tensor) -> bool:
        """Whether the Triton repack kernel runs this job (see ``gpu_runner``)."""
        runner = self.gpu_runner
        if runner not in GPU_RUNNERS:
            raise ValueError(f"gpu_runner {runner!r}; expected one of {GPU_RUNNERS}")
        if runner == "torch" or (runner == "auto" and view.device.type != "cuda"):
            return False
        if _repack_kernels() is None:
            if runner == "triton":
                raise RuntimeError(f"gpu_runner='triton' but the repack kernel cannot be imported: {_REPACK_ERROR}")
            return False
        if view.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(f"gpu_runner='triton' on {view.device.type} tensors needs TRITON_INTERPRET=1 "
                               "(set before triton is imported)")
        return True

    def _scratch_rows(self, view: torch.Tensor, rows: int) -> torch.Tensor:
        """Scratch of at least ``rows x view.shape[1]`` integers of the view's element size, reused across
        jobs and plans (one per element size, device and stream: the stream orders its reuse)."""
        el, dev = view.element_size(), view.device
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        key = (el, str(dev), stream)
        need = rows * view.shape[1]
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < need:
            size = max(need, 2 * buf.numel() if buf is not None else 0, 1 << 16)
            buf = self._scratch[key] = torch.empty(size, dtype=_INT_OF_SIZE[el], device=dev)
        return buf

    def _run_triton(self, view: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        m = src.numel()
        if m == 0:
            return
        if src.device != view.device:
            src, dst = src.to(view.device, non_blocking=True), dst.to(view.device, non_blocking=True)
        if self.planner_mode not in PLANNER_MODES:
            raise ValueError(f"planner_mode {self.planner_mode!r}; expected one of {PLANNER_MODES}")
        if self.planner_mode == "compact":
            _repack_kernels().move_rows(view, src, dst, "compact")
        else:
            _repack_kernels().move_rows(view, src, dst, "ordered", scratch=self._scratch_rows(view, m))

    def run_jobs(self, jobs: list[Job]) -> None:
        """Execute jobs synchronously on the calling thread / current stream."""
        for view, src, dst in jobs:
            if self._use_triton(view):
                self._run_triton(view, src, dst)
                self.jobs_run["triton"] = self.jobs_run.get("triton", 0) + 1
                continue
            if self._use_kernel(view, src, dst):
                try:
                    _run_cpu_kernel(view, src, dst, self.nt_min_bytes)
                    self.jobs_run["numba"] = self.jobs_run.get("numba", 0) + 1
                    continue
                except (IndexError, ValueError):  # a bad plan or view, refused before any byte moved
                    raise
                except Exception as e:  # the kernel could not load or compile: it moved nothing
                    if self.cpu_path == "numba":
                        raise RuntimeError(f"cpu_path='numba' but the copy kernel failed: {type(e).__name__}: {e}") from e
                    _disable_cpu_kernels(e)  # this job and the later ones take the torch path
            self.jobs_run["torch"] = self.jobs_run.get("torch", 0) + 1
            if src.device != view.device:
                src, dst = src.to(view.device, non_blocking=True), dst.to(view.device, non_blocking=True)
            buf = self._buffer(view.dtype, view.shape[1], view.device)
            step = buf.shape[0]
            m = src.numel()
            rows_np = _np_rows(view) if view.device.type == "cpu" else None
            buf_np = _np_rows(buf) if rows_np is not None else None
            dst_np = dst.numpy() if rows_np is not None else None
            for i in range(0, m, step):  # chunks in order: required by the ordered-mode argument
                j = min(m, i + step)
                b = buf[: j - i]
                torch.index_select(view, 0, src[i:j], out=b)  # gather every source of the chunk ...
                if rows_np is not None:  # ... before scattering any destination
                    # CPU: numpy's row put (whole rows as opaque bytes) is ~1.5x faster than
                    # index_copy_ for scattered rows; same memory, no copy of the tensor.
                    np.put(rows_np, dst_np[i:j], buf_np[: j - i])
                else:
                    view.index_copy_(0, dst[i:j], b)

    def _device_jobs(self, jobs: list[Job]) -> list[Job]:
        """The jobs with their row ids on the device, on the current stream, without a host sync: every
        distinct index tensor is packed into ONE pinned host buffer and copied with ONE non-blocking H2D
        copy. Both buffers stay referenced until the next ``fence``/``submit`` (``_keepalive``); the device
        buffer is also ``record_stream``-ed on the current stream."""
        uniq: dict[int, torch.Tensor] = {}
        for _, s, d in jobs:
            uniq.setdefault(id(s), s)
            uniq.setdefault(id(d), d)
        offsets, total = {}, 0
        for k, t in uniq.items():
            offsets[k] = total
            total += t.numel()
        host = torch.empty(max(total, 1), dtype=torch.int64, pin_memory=True)
        hv = host.numpy()
        for k, t in uniq.items():
            hv[offsets[k]:offsets[k] + t.numel()] = t.numpy()
        dev = host.to(self.device, non_blocking=True)
        dev.record_stream(torch.cuda.current_stream(self.device))
        self._keepalive = [host, dev]

        def on_dev(t: torch.Tensor) -> torch.Tensor:
            o = offsets[id(t)]
            return dev[o:o + t.numel()]

        return [(v, on_dev(s), on_dev(d)) for v, s, d in jobs]

    def submit(self, plan: CopyPlan) -> None:
        """Start executing ``plan`` (asynchronously when enabled). The caller fenced the previous plan."""
        if self.in_flight:
            raise RuntimeError("I4 violated: a plan was submitted while another is still in flight")
        jobs = self.build_jobs(plan)
        if not jobs:
            return
        self.bytes_moved += plan.num_moves * self.row_bytes()
        self.plans_executed += 1
        if self._cuda and self._async:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self.run_jobs(self._device_jobs(jobs))
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        elif self._cuda:  # synchronous: stream-ordered on the caller's stream, nothing to fence
            self.run_jobs(self._device_jobs(jobs))
        elif self._async:
            self._future = _executor().submit(self.run_jobs, jobs)
        else:
            self.run_jobs(jobs)

    @property
    def in_flight(self) -> bool:
        """True from :meth:`submit` until :meth:`fence` (even if the worker already finished)."""
        return self._future is not None or self._event is not None

    def fence(self) -> None:
        """Wait until the in-flight plan has landed (I3). Re-raises an error raised by the worker."""
        with self._lock:
            if self._future is not None:
                fut, self._future = self._future, None
                fut.result()
            if self._event is not None:
                ev, self._event = self._event, None
                torch.cuda.current_stream(self.device).wait_event(ev)
            self._keepalive = []  # the current stream now orders every later use after the copies

    def close(self) -> None:
        self.fence()
