"""numba in the runtime: the fix for vLLM next to it, and a fresh on-disk cache for a kernel spread over files.

The runtime has two numba kernels (the CPU copy path, ``_copy_kernels``; the CPU attention statistics,
``stats.cpu_kernel`` and the modules it is split into). vLLM scans ``sys.modules`` when a worker starts
(``init_worker`` -> ``register_triton_kernel_overrides`` -> ``vllm.triton_utils.dispatcher._rebind_kernels``)
and crashed on an object llvmlite creates; :func:`make_llvmlite_scan_safe` removes the cause. It runs right
after numba is imported (both kernels) and in the plugin's ``register()`` (every vLLM process, before any
engine starts).

numba's ``cache=True`` checks a compiled function against its own source file (time stamp and size) only,
while the compiled code holds its callees' code: a kernel whose functions live in several files keeps a
callee's old code when only the callee's file changed (numba does not track other files).
:func:`drop_stale_cache` removes the kernel's cache files whenever any of its files changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path


def make_llvmlite_scan_safe() -> bool:
    """Let vLLM's kernel-rebinding scan of ``sys.modules`` run after numba/llvmlite were imported.

    ``vllm.triton_utils.dispatcher._rebind_kernels`` evaluates ``vars(value).get("kernel")`` for every
    module attribute that has a ``__dict__``. ``llvmlite.binding.ffi.lib`` has ``__slots__`` only; its
    ``__getattr__`` looks names up in its function table (``_fntab``) and then wraps the ctypes library's
    attribute, so ``vars(lib)`` returns a ``_lib_fn_wrapper`` and ``.get`` raises AttributeError (the
    whole engine start fails). Seeding the table with ``"__dict__": {}`` makes ``vars(lib)`` an empty
    dict; llvmlite never reads ``lib.__dict__`` itself. ``llvmlite.binding.ffi`` is imported here if it is not
    yet: numba imports it lazily, at its first compilation, so a check of ``sys.modules`` right after
    ``import numba`` found nothing and the object appeared unseeded later (an engine built after another
    vToken engine in the same process then failed to start: ``vtoken-cli bench prefix``). Idempotent;
    returns False when llvmlite is missing or has another shape (nothing to do)."""
    try:
        import llvmlite.binding.ffi as ffi
    except Exception:  # llvmlite missing or broken: numba cannot run either
        return False
    lib = getattr(ffi, "lib", None)
    table = getattr(lib, "_fntab", None) if lib is not None else None
    if not isinstance(table, dict):
        return False
    if not isinstance(table.get("__dict__"), dict):
        table["__dict__"] = {}
    return True


def drop_stale_cache(cache_dir: str | os.PathLike[str] | None, sources: Sequence[Path], tag: str) -> bool:
    """Delete numba's cache files (``<module>.*.nbi`` / ``.nbc``) of the modules ``sources`` in ``cache_dir`` (a
    dispatcher's ``stats.cache_path``; None: not cached) unless they were written for the same contents of
    ``sources``, recorded in ``cache_dir/<tag>.sources`` (a sha256). Call it before the first call of any of
    their compiled functions. Returns True when the files were dropped (the sources changed, or no record);
    False when the record matches or the directory cannot be written (numba then caches nothing there)."""
    if cache_dir is None:
        return False
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    want = digest.hexdigest()
    folder = Path(cache_dir)
    record = folder / f"{tag}.sources"
    try:
        if record.read_text() == want:
            return False
    except OSError:
        pass  # no record yet: drop what may be there
    prefixes = tuple(f"{src.stem}." for src in sources)
    try:
        for f in folder.iterdir():
            if f.name.startswith(prefixes) and f.suffix in (".nbi", ".nbc"):
                f.unlink(missing_ok=True)
        tmp = folder / f"{record.name}.{os.getpid()}"
        tmp.write_text(want)
        os.replace(tmp, record)
    except OSError:
        return False
    return True
