"""Backend selection: which compiled form of a policy runs.

``VTOKEN_BACKEND=torch|triton`` overrides; otherwise Triton is used for CUDA tensors
when it is importable, the torch reference elsewhere. Compiled policies are cached
on the policy object.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .policy import Policy


def default_backend(device: Any = None) -> str:
    env = os.environ.get("VTOKEN_BACKEND")
    if env:
        if env not in ("torch", "triton"):
            raise ValueError(f"got VTOKEN_BACKEND={env!r}, expected 'torch' or 'triton'")
        return env
    if device is not None and str(device).startswith("cuda"):
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def compile_policy(policy: Policy, backend: str | None = None) -> Any:
    backend = backend or default_backend()
    cached = policy._compiled.get(backend)
    if cached is not None:
        return cached
    if backend == "torch":
        from .reference import ReferencePolicy

        compiled: Any = ReferencePolicy(policy)
    elif backend == "triton":
        if policy.kind != "score":
            raise ValueError(f"policy {policy.name!r} is a mask policy: only the torch backend runs it")
        from .triton_backend import TritonPolicy  # type: ignore[import-not-found]

        compiled = TritonPolicy(policy)
    else:
        raise ValueError(f"got backend={backend!r}, expected 'torch' or 'triton'")
    policy._compiled[backend] = compiled
    return compiled
