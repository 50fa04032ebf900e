"""Backend selection: which compiled form of a policy runs, chosen by device.

``compile_policy(policy, device=...)`` returns a :class:`CompiledPolicy`: the fused Triton kernels for
CUDA tensors (when Triton imports), the torch reference elsewhere. ``VTOKEN_BACKEND=torch|triton``
overrides the choice; ``backend=`` forces one. Compiled policies are cached on the policy object.

Import graph (no cycles): ``policy -> backend`` (lazily, in ``Policy.compile``), ``backend ->
reference | triton_backend``, ``triton_backend -> reference``; none of them imports ``policy`` at run time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from .batch import StatsBatch

if TYPE_CHECKING:
    from .policy import Policy

BACKENDS = ("torch", "triton")


@runtime_checkable
class CompiledPolicy(Protocol):
    """What every backend provides (shapes as in :class:`~vtoken_sdk.batch.StatsBatch`)."""

    policy: Any

    def keep_mask(self, batch: StatsBatch) -> Tensor:
        """``[B, L, H, N]`` bool under the selection contract."""
        ...

    def budgets(self, batch: StatsBatch) -> Tensor:
        """``[B]`` int64 tokens to keep per request."""
        ...

    def contract_violations(self, batch: StatsBatch, mask: Tensor) -> list[str | None]:
        """Per request: why ``mask`` breaks the selection contract, or None."""
        ...


def default_backend(device: Any = None) -> str:
    """``VTOKEN_BACKEND`` if set; else ``"triton"`` for a CUDA device when Triton imports; else ``"torch"``."""
    env = os.environ.get("VTOKEN_BACKEND")
    if env:
        if env not in BACKENDS:
            raise ValueError(f"got VTOKEN_BACKEND={env!r}, expected 'torch' or 'triton'")
        return env
    if device is not None and str(device).startswith("cuda"):
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def compile_policy(policy: Policy, backend: str | None = None, device: Any = None) -> CompiledPolicy:
    """The compiled ``policy`` for ``backend`` (default: :func:`default_backend` of ``device``). Mask
    policies (eager Python) always run on the torch reference."""
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"got backend={backend!r}, expected 'torch' or 'triton'")
    if policy.kind != "score":
        if backend == "triton" and os.environ.get("VTOKEN_BACKEND") != "triton" and device is not None:
            backend = "torch"  # chosen by device, not asked for: mask policies run eagerly
        elif backend == "triton":
            raise ValueError(f"policy {policy.name!r} is a mask policy: only the torch backend runs it")
    cached = policy._compiled.get(backend)
    if cached is not None:
        return cached
    if backend == "torch":
        from .reference import ReferencePolicy

        compiled: CompiledPolicy = ReferencePolicy(policy)
    else:
        from .triton_backend import TritonPolicy  # type: ignore[import-not-found]

        compiled = TritonPolicy(policy)
    policy._compiled[backend] = compiled
    return compiled
