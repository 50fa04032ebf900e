"""vToken inside vLLM (v1 engine, CPU build here; same hooks on CUDA): a plugin, no fork, no edits.

Enable it by configuration::

    from vllm import LLM
    from vtoken_runtime.vllm_plugin import vllm_engine_args
    llm = LLM(model=path, **vllm_engine_args(policy="h2o", mode="compact", eviction_ratio=0.5))

The OpenAI server: ``vtoken-cli serve MODEL --policy h2o --eviction-ratio 0.5 [any vLLM server flag]``
(``serve_flags(...)`` gives the plugin's flags for any other launcher). Per-request options, the same
flat keys over HTTP (``vllm_xargs``) and in Python (``SamplingParams(extra_args=...)``):
``vtoken_enabled``, ``vtoken_budget_tokens``, ``vtoken_eviction_ratio``, ``vtoken_pinned_spans``,
``vtoken_allocation`` (validated at admission: a bad value is an HTTP 400 / a ValueError). See docs/vllm.md.

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
GPU_WORKER_CLS = "vtoken_runtime.vllm_plugin.gpu_worker.VTokenGPUWorker"
FRONTEND_CLS = "vtoken_runtime.vllm_plugin.frontend:VTokenOptions"
HTTP_CHECK = "vtoken_runtime.vllm_plugin.frontend.VTokenRequestCheck"  # the server's per-request option check

log = logging.getLogger("vtoken.vllm")
_REGISTERED = False


def register() -> None:
    """``vllm.general_plugins`` entry point: cheap and idempotent; the plugin itself is switched on per
    engine by ``scheduler_cls`` / ``worker_cls`` / ``additional_config['vtoken']`` (so installing
    vtoken never changes a plain vLLM engine)."""
    global _REGISTERED
    from vtoken_runtime._numba_compat import make_llvmlite_scan_safe

    # Before every engine's worker init (vLLM calls register() there, then scans sys.modules): the
    # runtime's numba kernels (CPU copies, CPU statistics) may have imported llvmlite already.
    make_llvmlite_scan_safe()
    if _REGISTERED:
        return
    _REGISTERED = True
    from .metrics import use_vllm_logging

    use_vllm_logging()
    log.debug("vtoken plugin registered (enable per engine with vllm_engine_args())")


def _on_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def vllm_engine_args(policy: str | None = "none", mode: str = "compact", eviction_ratio: float | None = None,
                     budget_tokens: int | None = None, policy_name: str | None = None, debug: bool = False,
                     device: str | None = None, when: str | None = None, slack: int | str | None = None,
                     **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs(...)`` that enable vToken.

    ``policy``: shipped name (``h2o``, ``scissorhands``, ...), a policy file, or ``"none"``;
    ``mode``: ``compact`` | ``ordered`` | ``naive`` (Naive-Evict baseline); ``eviction_ratio`` /
    ``budget_tokens`` override the policy budget, ``when`` its eviction points (``"chunks"``: also after
    every prefill chunk), ``slack`` its slack (evict once ``live > budget + slack``, or ``"block"``); ``device``: ``"cpu"`` | ``"cuda"`` picks the worker
    (default: CUDA when torch sees a GPU). ``extra`` is merged (e.g. ``additional_config``). On CUDA a
    policy that reads statistics gets PIECEWISE CUDA graphs unless ``compilation_config`` is given (the
    GPU worker enforces it too; see ``gpu_worker``); so does a policy with unequal row budgets, which also gets
    ``attention_backend="TRITON_ATTN"`` (per-row pages on the GPU need it; the GPU worker asks for the HND layout).
    Prefix caching keeps vLLM's default (on; the cached prefix is frozen, docs/decisions.md decision 9), except for
    policies with unequal row budgets; so does asynchronous scheduling (the scheduler reads eviction reports a step
    late; vLLM's CPU platform switches it off itself). Both are the runner mixin's and the scheduler's logic, the
    same on CPU and CUDA, verified in the CPU worker (docs/vllm.md: no GPU engine has run them).
    """
    cfg = PluginConfig(policy=policy, mode=mode, eviction_ratio=eviction_ratio, budget_tokens=budget_tokens,
                       policy_name=policy_name, debug=debug, when=when, slack=slack)
    pol = cfg.load_policy()  # fail fast, in the caller's process, on a bad policy
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"vtoken: device {device!r}; expected 'cpu' or 'cuda'")
    cuda = _on_cuda() if device is None else device == "cuda"
    if cuda and int(extra.get("pipeline_parallel_size") or 1) > 1:
        raise ValueError("vtoken: pipeline parallelism runs in the CPU worker only (the GPU worker's stage "
                         "agreement is not verified); leave pipeline_parallel_size at 1 on CUDA")
    additional = dict(extra.pop("additional_config", None) or {})
    additional["vtoken"] = cfg.to_dict()
    procs = [p for p in (extra.pop("logits_processors", None) or []) if p != FRONTEND_CLS]
    args = {"scheduler_cls": SCHEDULER_CLS, "worker_cls": GPU_WORKER_CLS if cuda else WORKER_CLS,
            "additional_config": additional,
            "logits_processors": [FRONTEND_CLS, *procs]}  # validates per-request options at admission
    from vtoken_sdk.stats import ATTENTION_STATS, KV_STATS, QUERY_STATS

    collected = set(ATTENTION_STATS) | set(KV_STATS) | set(QUERY_STATS)  # gpu_worker.reads_statistics
    unequal = pol is not None and not pol.spec.uniform
    if cuda and pol is not None and (collected & set(pol.reads) or unequal) and "compilation_config" not in extra:
        # statistics run around the attention op; per-row pages write and attend in its wrapper
        args["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if cuda and unequal and "attention_backend" not in extra and "attention_config" not in extra:
        args["attention_backend"] = "TRITON_ATTN"  # per-row pages: the backend verified with one-head pages
    if pol is not None and not pol.spec.uniform:  # per-row pages repack the cached prefix too (scheduler)
        if extra.get("enable_prefix_caching"):
            raise ValueError("vtoken: prefix caching with a policy of unequal row budgets is not supported (its "
                             "handoff to per-row pages repacks every block of the request, the cached prefix's "
                             "too); leave enable_prefix_caching unset")
        args["enable_prefix_caching"] = False
    args.update(extra)  # vLLM's prefix caching and async scheduling defaults are kept unless extra says otherwise
    return args


def serve_flags(**kw: Any) -> list[str]:
    """The ``vllm serve`` command-line flags equivalent to :func:`vllm_engine_args` (same arguments), plus the
    HTTP check of per-request options (``--middleware``: a 400 before a stream starts, one line per key)."""
    import json

    a = vllm_engine_args(**kw)
    pc = a.get("enable_prefix_caching")
    return ["--scheduler-cls", a["scheduler_cls"], "--worker-cls", a["worker_cls"],
            *({False: ["--no-enable-prefix-caching"], True: ["--enable-prefix-caching"]}.get(pc, [])),
            *(["--no-async-scheduling"] if a.get("async_scheduling") is False else []),
            "--additional-config", json.dumps(a["additional_config"]),
            "--logits-processors", *a["logits_processors"], "--middleware", HTTP_CHECK,
            *(["--compilation-config", json.dumps(a["compilation_config"])] if "compilation_config" in a else []),
            *(["--attention-backend", str(a["attention_backend"])] if "attention_backend" in a else [])]
