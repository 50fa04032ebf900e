"""Backend selection: which compiled form of a policy runs, chosen by device.

``compile_policy(policy, device=...)`` returns a :class:`CompiledPolicy`: the fused Triton kernels for
CUDA tensors (when Triton imports), the torch backend (``torch_backend``) elsewhere.
``VTOKEN_POLICY_BACKEND=torch|triton`` overrides the choice; ``backend=`` forces one. (The statistics
collector has its own variable, ``VTOKEN_STATS_BACKEND``; the old name ``VTOKEN_BACKEND`` is refused.)

What compiling produces is cached by the backend that produced it, never on the policy (a policy is a
plain description): the Triton backend keeps each policy's generated kernels in a weak-keyed cache
(``triton_backend.generated_for``), so a policy nobody holds any more is dropped with its entry. The
torch backend interprets the IR on every call and has nothing to cache.

Import graph (no cycles): ``policy -> backend`` (lazily, in ``Policy.compile``), ``backend ->
torch_backend | triton_backend``, ``triton_backend -> torch_backend``; none of them imports ``policy``
at run time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from .batch import StatsBatch

if TYPE_CHECKING:
    from .policy import Policy

BACKENDS = ("torch", "triton")
ENV = "VTOKEN_POLICY_BACKEND"
RENAMED_ENV = "VTOKEN_BACKEND"  # the old name (it read as "the statistics backend" too)


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


def requested_backend() -> str | None:
    """``VTOKEN_POLICY_BACKEND`` (``"torch"`` / ``"triton"``), or None when unset.

    Raises ValueError for another value, and when the old name ``VTOKEN_BACKEND`` is set."""
    if os.environ.get(RENAMED_ENV):
        raise ValueError(f"{RENAMED_ENV} was renamed to {ENV} (the policy selection backend, torch|triton; "
                         f"the statistics backend is VTOKEN_STATS_BACKEND): set {ENV} instead")
    env = os.environ.get(ENV)
    if env and env not in BACKENDS:
        raise ValueError(f"got {ENV}={env!r}, expected 'torch' or 'triton'")
    return env or None


def default_backend(device: Any = None) -> str:
    """``VTOKEN_POLICY_BACKEND`` if set; else ``"triton"`` for a CUDA device when Triton imports; else
    ``"torch"``."""
    env = requested_backend()
    if env:
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
    policies (eager Python) always run on the torch backend."""
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"got backend={backend!r}, expected 'torch' or 'triton'")
    if policy.kind != "score":
        if backend == "triton" and requested_backend() != "triton" and device is not None:
            backend = "torch"  # chosen by device, not asked for: mask policies run eagerly
        elif backend == "triton":
            raise ValueError(f"policy {policy.name!r} is a mask policy: only the torch backend runs it")
    if backend == "torch":
        from .torch_backend import TorchPolicy

        return TorchPolicy(policy)
    from .triton_backend import TritonPolicy, generated_for  # type: ignore[import-not-found]

    return TritonPolicy(policy, generated=generated_for(policy))
