"""vToken inside vLLM (v1 engine, CPU build here; same hooks on CUDA): a plugin, no fork, no edits.

Enable it by configuration::

    from vllm import LLM
    from vtoken_runtime.vllm_plugin import vllm_engine_args
    llm = LLM(model=path, **vllm_engine_args(policy="h2o", mode="compact", eviction_ratio=0.5))

``vllm serve``: ``vllm serve MODEL --scheduler-cls vtoken_runtime.vllm_plugin.scheduler.VTokenScheduler
--worker-cls vtoken_runtime.vllm_plugin.worker.VTokenCPUWorker --no-enable-prefix-caching
--no-async-scheduling --additional-config '{"vtoken": {"policy": "h2o", "mode": "compact"}}'``
(``serve_flags(...)`` prints exactly that). Per-request options: ``SamplingParams(extra_args={"vtoken":
{"pinned_spans": [[0, 64]], "budget_tokens": 512, "enabled": False}})``. See docs/vllm.md.

Importing this package does not import vLLM; ``register()`` is the ``vllm.general_plugins`` entry
point (vLLM calls it in every process before building engines).
"""

from __future__ import annotations

import logging
from typing import Any

from .config import PluginConfig, RequestOptions, request_options

__all__ = ["PluginConfig", "RequestOptions", "register", "request_options", "serve_flags", "vllm_engine_args"]

SCHEDULER_CLS = "vtoken_runtime.vllm_plugin.scheduler.VTokenScheduler"
WORKER_CLS = "vtoken_runtime.vllm_plugin.worker.VTokenCPUWorker"

log = logging.getLogger("vtoken.vllm")
_REGISTERED = False


def register() -> None:
    """``vllm.general_plugins`` entry point: cheap and idempotent; the plugin itself is switched on per
    engine by ``scheduler_cls`` / ``worker_cls`` / ``additional_config['vtoken']`` (so installing
    vtoken never changes a plain vLLM engine)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    log.debug("vtoken plugin registered (enable per engine with vllm_engine_args())")


def vllm_engine_args(policy: str | None = "none", mode: str = "compact", eviction_ratio: float | None = None,
                     budget_tokens: int | None = None, policy_name: str | None = None, debug: bool = False,
                     **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs(...)`` that enable vToken.

    ``policy``: shipped name (``h2o``, ``scissorhands``, ...), a policy file, or ``"none"``;
    ``mode``: ``compact`` | ``ordered`` | ``naive`` (Naive-Evict baseline); ``eviction_ratio`` /
    ``budget_tokens`` override the policy budget. ``extra`` is merged (e.g. ``additional_config``).
    """
    cfg = PluginConfig(policy=policy, mode=mode, eviction_ratio=eviction_ratio, budget_tokens=budget_tokens,
                       policy_name=policy_name, debug=debug)
    cfg.load_policy()  # fail fast, in the caller's process, on a bad policy
    if extra.get("enable_prefix_caching"):
        raise ValueError("vtoken: prefix caching is not supported with token eviction (a shared block would be "
                         "compacted under another request); leave enable_prefix_caching unset")
    if extra.get("async_scheduling"):
        raise ValueError("vtoken: async scheduling is not supported; leave async_scheduling unset")
    additional = dict(extra.pop("additional_config", None) or {})
    additional["vtoken"] = cfg.to_dict()
    args = {"scheduler_cls": SCHEDULER_CLS, "worker_cls": WORKER_CLS, "enable_prefix_caching": False,
            "async_scheduling": False, "additional_config": additional}
    args.update(extra)
    return args


def serve_flags(**kw: Any) -> list[str]:
    """The ``vllm serve`` command-line flags equivalent to :func:`vllm_engine_args` (same arguments)."""
    import json

    a = vllm_engine_args(**kw)
    return ["--scheduler-cls", a["scheduler_cls"], "--worker-cls", a["worker_cls"], "--no-enable-prefix-caching",
            "--no-async-scheduling", "--additional-config", json.dumps(a["additional_config"])]
