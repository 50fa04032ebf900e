"""numba next to vLLM in one process: the one compatibility fix (used by every numba kernel of the runtime).

The runtime has two numba kernels (the CPU copy path, ``_copy_kernels``; the CPU attention statistics,
``stats.cpu_kernel``). vLLM scans ``sys.modules`` when a worker starts (``init_worker`` ->
``register_triton_kernel_overrides`` -> ``vllm.triton_utils.dispatcher._rebind_kernels``) and crashed
on an object llvmlite creates; :func:`make_llvmlite_scan_safe` removes the cause. It runs right after
numba is imported (both kernel modules) and in the plugin's ``register()`` (every vLLM process, before
any engine starts).
"""

from __future__ import annotations


def make_llvmlite_scan_safe() -> bool:
    """Let vLLM's kernel-rebinding scan of ``sys.modules`` run after numba/llvmlite were imported.

    ``vllm.triton_utils.dispatcher._rebind_kernels`` evaluates ``vars(value).get("kernel")`` for every
    module attribute that has a ``__dict__``. ``llvmlite.binding.ffi.lib`` has ``__slots__`` only; its
    ``__getattr__`` looks names up in its function table (``_fntab``) and then wraps the ctypes library's
    attribute, so ``vars(lib)`` returns a ``_lib_fn_wrapper`` and ``.get`` raises AttributeError (the
    whole engine start fails). Seeding the table with ``"__dict__": {}`` makes ``vars(lib)`` an empty
    dict; llvmlite never reads ``lib.__dict__`` itself. Idempotent; returns False when llvmlite is not
    imported or has another shape (nothing to do)."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    table = getattr(lib, "_fntab", None) if lib is not None else None
    if not isinstance(table, dict):
        return False
    if not isinstance(table.get("__dict__"), dict):
        table["__dict__"] = {}
    return True
