"""Triton backend: a policy compiled to fused score + select kernels (vtoken_sdk.codegen_triton).

``TritonPolicy(policy).keep_mask(batch)`` is bit-identical to ``TorchPolicy(policy).keep_mask(batch)``
(for policies using exactly-rounded ops; see docs/kernels.md). Two launches per call:

1. ``pin_count_kernel`` grid ``(B, R_OUT)``: pinned valid tokens of each row (k needs the max over
   the rows of a request);
2. ``select_kernel`` grid ``(B, R_OUT)``: scores -> keys -> radix select -> keep mask. Rows of at
   most ``max_single`` tokens stay in registers (one read of the statistics); longer rows are tiled
   (``tile`` tokens per step) and re-read the statistics on each of the 6 passes; no intermediate
   tensor is written to global memory either way.

A policy with unequal allocation (``allocation=vt.AdaptiveLayer(...)``, ...) first gets its per-row counts
``[B, L*H]`` from the allocation step (``vtoken_sdk.allocation.allocate_counts``, torch ops on the device
over this backend's scores, which equal the reference's bit for bit), then the same ``select_kernel`` with
``PER_ROW=True`` keeps each row's own count. ``vt.HeadClasses`` (DuoAttention) does not rank at all: its
kept sets come from positions and pins, computed by the torch reference's ops on the device.

``R_OUT`` = ``L*H`` at head granularity, 1 at request granularity (the kernel then writes the same
row to every (layer, head)). Policies with token reductions (``vt.token_*``, ``vt.softmax``) first run
one ``rowval_kernel_<i>`` per reduction, grid ``(B, L*H)``, in dependency order; they write the row
values (``[B, L*H, RV_K]`` float32 scratch) that the score then loads. Vector statistics
(``StatsBatch.vectors``) are read in place through their strides. Runs on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1`` (set it before this module is imported).

Caches, all owned here: the generated source of each policy object (``generated_for``: weak keys, so a
dropped policy is dropped with it; nothing is stored on the policy), the imported modules per (policy IR
key, triton version, interpreter flag); Triton's own JIT cache then keys the binaries by the constexpr
parameters (BLOCK, SINGLE, HAS_PINNED, RBLOCK).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import codegen_triton
from .allocation import HeadClasses
from .batch import StatsBatch
from .ir import TOKEN_LANES
from .torch_backend import TorchPolicy

if TYPE_CHECKING:
    from .policy import Policy

DEFAULT_MAX_SINGLE = 2048  # rows up to this many tokens are selected in registers
DEFAULT_TILE = 1024  # tile of the multi-pass path
MIN_BLOCK = 256  # = histogram bins

_MODULES: dict[tuple[str, str, bool], ModuleType] = {}
_LOCK = threading.Lock()
# the generated kernels of each policy object; the values hold no reference to their key
_GENERATED: weakref.WeakKeyDictionary[Policy, codegen_triton.GeneratedPolicy] = weakref.WeakKeyDictionary()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cache_dir() -> Path:
    base = os.environ.get("VTOKEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vtoken")
    return Path(base) / "triton"


def load_generated(gen: codegen_triton.GeneratedPolicy, interpret: bool | None = None) -> ModuleType:
    """Import a generated module (written to the cache dir: Triton reads kernel source from files).

    ``interpret`` overrides ``TRITON_INTERPRET`` while the module is executed (``False`` for AOT
    compiles from a process that runs the interpreter)."""
    import triton

    interp = interpreting() if interpret is None else bool(interpret)
    key = (gen.key, triton.__version__, interp)
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is not None:
            return mod
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"policy_{gen.name}_{gen.key}.py"
        if not path.exists() or path.read_text() != gen.source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(gen.source)
            tmp.replace(path)
        name = f"vtoken_gen_{gen.key}_{'i' if key[2] else 'g'}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interp else "0"
        try:
            spec.loader.exec_module(mod)
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        _MODULES[key] = mod
        return mod


def generated_for(policy: Policy) -> codegen_triton.GeneratedPolicy:
    """``policy``'s generated kernels, generated once per policy object (cached with a weak key)."""
    with _LOCK:
        gen = _GENERATED.get(policy)
    if gen is None:
        gen = codegen_triton.generate(policy)
        with _LOCK:
            gen = _GENERATED.setdefault(policy, gen)
    return gen


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _row_view(t: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """``t`` broadcast to ``[B, L, H, N]`` with a unit stride along N (broadcast dims keep stride 0)."""
    t = t.expand(shape)
    if shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


class TritonPolicy:
    """The Triton backend of a score policy: same ``keep_mask``/``scores``/``pins``/``budgets`` API."""

    backend = "triton"

    def __init__(self, policy: Policy, max_single: int = DEFAULT_MAX_SINGLE, tile: int = DEFAULT_TILE,
                 num_warps: int | None = None, interpret: bool | None = None,
                 generated: codegen_triton.GeneratedPolicy | None = None) -> None:
        """``generated``: ``generated_for(policy)`` (what ``compile_policy`` passes); generated here when
        None."""
        if policy.kind != "score":
            raise ValueError(f"policy {policy.name!r} is a mask policy: only the torch backend runs it")
        if tile < MIN_BLOCK or tile & (tile - 1):
            raise ValueError(f"tile must be a power of two >= {MIN_BLOCK}, got {tile}")
        self.policy = policy
        self.torch = TorchPolicy(policy)
        self.generated = codegen_triton.generate(policy) if generated is None else generated
        self.module = load_generated(self.generated, interpret)
        self.max_single = int(max_single)
        self.tile = int(tile)
        self.num_warps = num_warps

    @property
    def source(self) -> str:
        return self.generated.source

    # ------------------------------------------------------------------ delegated (host-side) parts
    def env(self, batch: StatsBatch) -> dict[str, Tensor]:
        return self.torch.env(batch)

    def budgets(self, batch: StatsBatch) -> Tensor:
        return self.torch.budgets(batch)

    def pins(self, batch: StatsBatch, env: dict[str, Tensor] | None = None) -> Tensor:
        return self.torch.pins(batch, env)

    # ------------------------------------------------------------------ launch helpers
    def config(self, n: int) -> dict[str, Any]:
        """Constexpr parameters for rows of ``n`` tokens."""
        if n <= self.max_single:
            block = max(MIN_BLOCK, _next_pow2(n))
            single = True
        else:
            block, single = self.tile, False
        # loops over D / chunks / query heads keep more values live per token: fewer tokens per thread
        per_warp = 128 if self.generated.heavy else 256
        warps = self.num_warps or max(4, min(16, block // per_warp))
        return {"BLOCK": block, "SINGLE": single, "num_warps": warps}

    def _args(self, batch: StatsBatch) -> tuple[list[Any], bool]:
        shape = batch.shape
        gen = self.generated
        pos = _row_view(batch.positions.to(torch.int64), shape)
        args: list[Any] = [shape[3], shape[1], shape[2], int(batch.layer_offset),
                           pos, pos.stride(0), pos.stride(1), pos.stride(2)]
        has_pinned = batch.pinned is not None
        if has_pinned:
            assert batch.pinned is not None
            pin = _row_view(batch.pinned.to(torch.bool), shape).view(torch.int8)
            args += [pin, pin.stride(0), pin.stride(1), pin.stride(2)]
        else:
            args += [pos, 0, 0, 0]
        for name in gen.stats:
            if name not in batch.stats:
                raise ValueError(f"batch lacks statistic {name!r} that policy {self.policy.name!r} reads; "
                                 f"collect policy.stored_reads = {sorted(self.policy.stored_reads)}")
            t = _row_view(batch.stats[name].to(torch.float32), shape)
            args += [t, t.stride(0), t.stride(1), t.stride(2)]
        names = {n for n, _ in gen.args}
        d, g = batch.dims() if "D" in names else (1, 1)
        if "D" in names:
            args += [d, g]
        if "num_layers" in names:
            args.append(batch.model_layers())
        if "head_offset" in names:
            args.append(int(batch.head_offset))
        for name in gen.vectors:
            if name not in batch.vectors:
                raise ValueError(f"batch lacks vector statistic {name!r} that policy {self.policy.name!r} reads; "
                                 f"gather policy.vector_reads = {sorted(self.policy.vector_reads)} into "
                                 "StatsBatch.vectors")
            t = batch.vectors[name].to(torch.float32)
            t = t.expand(shape[0], shape[1], shape[2], *t.shape[3:])
            args += [t, *(int(x) for x in t.stride())]
        if gen.reductions:
            k = max(1, gen.rv_size(d, g))
            rv = torch.empty((shape[0], shape[1] * shape[2], k), dtype=torch.float32, device=batch.device)
            args += [rv, rv.stride(0), k]
        return args, has_pinned

    def _launch_inputs(self, batch: StatsBatch) -> tuple[list[Any], bool, Tensor, Tensor]:
        """Kernel arguments shared by every launch: ``(args, has_pinned, lengths [B], seq_lens [B])``;
        runs the row-value pre-passes (token reductions) first."""
        args, has_pinned = self._args(batch)
        dev = batch.device
        lengths = batch.lengths.to(device=dev, dtype=torch.int64).contiguous()
        seq = batch.seq_lens.to(device=dev, dtype=torch.int64).contiguous()
        b, l_, h, _ = batch.shape
        for i in range(len(self.generated.reductions)):
            getattr(self.module, f"rowval_kernel_{i}")[(b, l_ * h)](
                lengths, seq, *args, BLOCK=TOKEN_LANES, HAS_PINNED=has_pinned, num_warps=4, enable_fp_fusion=False)
        return args, has_pinned, lengths, seq

    # ------------------------------------------------------------------ outputs
    def keep_mask(self, batch: StatsBatch) -> Tensor:
        """``[B, L, H, N]`` bool keep mask under the selection contract (vtoken_sdk.selection)."""
        b, l_, h, n = batch.shape
        dev = batch.device
        out = torch.zeros((b, l_, h, n), dtype=torch.bool, device=dev)
        if b == 0 or n == 0 or l_ * h == 0:
            return out
        if isinstance(self.policy.spec.allocation, HeadClasses):  # positions and pins decide, not scores: the
            return self.torch.keep_mask(batch)  # same torch ops on the device (vtoken_sdk.allocation)
        args, has_pinned, lengths, seq = self._launch_inputs(batch)
        budget = self.budgets(batch).to(device=dev, dtype=torch.int64).clamp(min=0, max=2**31 - 1).contiguous()
        r_out = 1 if self.generated.granularity == "request" else l_ * h
        per_row = not self.policy.spec.uniform
        if per_row:  # the counts step (torch, on the device, over this backend's scores); then per-row select
            counts = self.torch.counts(batch, self.scores(batch), self.pins(batch), budget)
            budget = counts.reshape(b, r_out).clamp(max=2**31 - 1).contiguous()
        npins = torch.empty((b, r_out), dtype=torch.int32, device=dev)
        cfg = self.config(n)
        grid = (b, r_out)
        m = self.module
        m.pin_count_kernel[grid](npins, lengths, seq, r_out, *args, BLOCK=cfg["BLOCK"], HAS_PINNED=has_pinned,
                                 num_warps=cfg["num_warps"], enable_fp_fusion=False)
        m.select_kernel[grid](out.view(torch.int8), l_ * h * n, npins, budget, lengths, seq, r_out, *args,
                              BLOCK=cfg["BLOCK"], HAS_PINNED=has_pinned, SINGLE=cfg["SINGLE"],
                              RBLOCK=min(1024, _next_pow2(r_out)), PER_ROW=per_row, num_warps=cfg["num_warps"],
                              enable_fp_fusion=False)
        return out

    def scores(self, batch: StatsBatch, env: dict[str, Tensor] | None = None) -> Tensor:
        """``[B, L, H, N]`` float32 scores from the debug kernel (``keep_mask`` never materialises them)."""
        b, l_, h, n = batch.shape
        dev = batch.device
        out = torch.zeros((b, l_, h, n), dtype=torch.float32, device=dev)
        if b == 0 or n == 0 or l_ * h == 0:
            return out
        args, has_pinned, lengths, seq = self._launch_inputs(batch)
        block = min(1024, max(MIN_BLOCK, _next_pow2(n)))
        grid = (b, l_ * h, (n + block - 1) // block)
        self.module.scores_kernel[grid](out, l_ * h * n, lengths, seq, *args, BLOCK=block, HAS_PINNED=has_pinned,
                                        enable_fp_fusion=False)
        return out


# ---------------------------------------------------------------------------- ahead-of-time compile


class KernelReport(dict):  # plain dict (JSON-ready): name, config, registers, spill_*, shared_bytes, ...
    pass


def ptxas_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def aot_compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int = 90,
                num_warps: int = 4, label: str | None = None) -> KernelReport:
    """Compile ``fn`` for ``sm_<arch>`` without a GPU and report ptxas' resource usage.

    ``signature`` maps every non-constexpr argument to a Triton type (``*fp32``, ``i32``...),
    ``constexprs`` the constexpr ones to values. FP contraction is disabled, as at launch.
    """
    import re
    import subprocess
    import tempfile
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    t0 = time.perf_counter()
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": False})
    compile_s = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    m = re.search(r"\.target\s+(sm_\w+)", ptx)
    sm = m.group(1) if m else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        Path(p).write_text(ptx)
        res = subprocess.run([ptxas_path(), f"-arch={sm}", "-v", p, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    info = res.stderr + res.stdout

    def num(pattern: str) -> int:
        mm = re.search(pattern, info)
        return int(mm.group(1)) if mm else 0

    name = getattr(fn, "__name__", None) or fn.fn.__name__
    return KernelReport(
        kernel=label or name, arch=sm, num_warps=num_warps,
        constexprs={k: (v if isinstance(v, (int, float, bool, str)) else str(v)) for k, v in constexprs.items()},
        registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"), stack_bytes=num(r"(\d+) bytes stack frame"),
        shared_bytes=int(compiled.metadata.shared), ptxas_smem=num(r"(\d+) bytes smem"),
        compile_s=round(compile_s, 2), ptxas=info.strip(),
    )


def aot_kernels(policy: Policy, arch: int = 90, max_single: int = DEFAULT_MAX_SINGLE,
                tile: int = DEFAULT_TILE) -> list[KernelReport]:
    """AOT-compile a policy's kernels at the default configuration: row-value pre-passes (token
    reductions, if any), pin count, select (rows in registers at ``max_single`` tokens, and the tiled
    multi-pass path), debug scores."""
    tp = TritonPolicy(policy, max_single=max_single, tile=tile, interpret=False)
    m = tp.module
    kargs: dict[str, str] = dict(tp.generated.args)
    head = {"lengths_ptr": "*i64", "seq_ptr": "*i64"}
    reports = []
    for i in range(len(tp.generated.reductions)):
        reports.append(aot_compile(getattr(m, f"rowval_kernel_{i}"), {**head, **kargs},
                                   {"BLOCK": TOKEN_LANES, "HAS_PINNED": True}, arch, 4, f"{policy.name}.rowval[{i}]"))
    single = tp.config(max_single)
    tiled = tp.config(max_single + 1)
    reports.append(aot_compile(m.pin_count_kernel, {"npins_ptr": "*i32", **head, "R_OUT": "i32", **kargs},
                               {"BLOCK": tiled["BLOCK"], "HAS_PINNED": True}, arch, tiled["num_warps"],
                               f"{policy.name}.pin_count"))
    sel_sig = {"out_ptr": "*i8", "out_sb": "i32", "npins_ptr": "*i32", "budget_ptr": "*i64", **head,
               "R_OUT": "i32", **kargs}
    per_row = not policy.spec.uniform
    for cfg, label in ((single, "select[single]"), (tiled, "select[tiled]")):
        reports.append(aot_compile(m.select_kernel, sel_sig,
                                   {"BLOCK": cfg["BLOCK"], "HAS_PINNED": True, "SINGLE": cfg["SINGLE"],
                                    "RBLOCK": 128, "PER_ROW": per_row}, arch, cfg["num_warps"],
                                   f"{policy.name}.{label}"))
    reports.append(aot_compile(m.scores_kernel, {"out_ptr": "*fp32", "out_sb": "i32", **head, **kargs},
                               {"BLOCK": 1024, "HAS_PINNED": True}, arch, 4, f"{policy.name}.scores[debug]"))
    return reports
