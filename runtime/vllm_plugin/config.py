"""Plugin configuration (engine-wide, through ``additional_config["vtoken"]``) and per-request options
(``SamplingParams(extra_args={"vtoken": {...}})``).

Everything here is plain Python (no vLLM import), so the scheduler process, the worker processes and
the tests parse the same dictionaries the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("vtoken.vllm")

CONFIG_KEY = "vtoken"
MODES = ("compact", "ordered", "naive")
NO_POLICY = ("none", "", None)


@dataclass(frozen=True)
class PluginConfig:
    """Engine-wide settings of the plugin.

    policy          a shipped policy name (``"h2o"``), a policy file path, or ``"none"`` (no eviction:
                    the indirection runs, nothing is evicted; the overhead baseline)
    mode            ``compact`` (fill holes with tail tokens), ``ordered`` (slide survivors down, for
                    kernels that read the kv index) or ``naive`` (Naive-Evict: the same decisions and
                    outputs, but a block returns to the pool only when every token ever placed in it
                    is dead; the scheduler holds the naive block count)
    eviction_ratio  overrides the policy budget with ``Budget.evict(r)`` (keeps its slack/when/min)
    budget_tokens   overrides the policy budget with an absolute token count
    policy_name     which policy of a multi-policy file (default: the first)
    debug           full invariant checks of the token table after every step (slow)
    """

    policy: str | None = "none"
    mode: str = "compact"
    eviction_ratio: float | None = None
    budget_tokens: int | None = None
    policy_name: str | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vtoken: unknown mode {self.mode!r}; expected one of {MODES}")
        if self.eviction_ratio is not None and not 0.0 <= float(self.eviction_ratio) < 1.0:
            raise ValueError(f"vtoken: eviction_ratio must lie in [0, 1), got {self.eviction_ratio}")
        if self.budget_tokens is not None and int(self.budget_tokens) < 1:
            raise ValueError(f"vtoken: budget_tokens must be >= 1, got {self.budget_tokens}")

    @property
    def enabled(self) -> bool:
        return self.policy not in NO_POLICY

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "mode": self.mode, "eviction_ratio": self.eviction_ratio,
                "budget_tokens": self.budget_tokens, "policy_name": self.policy_name, "debug": self.debug}

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> PluginConfig:
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY)
        if raw is None:
            raise ValueError("vtoken: the vToken scheduler/worker was configured without "
                             "additional_config['vtoken']; build engine args with "
                             "vtoken_runtime.vllm_plugin.vllm_engine_args(policy=...)")
        if isinstance(raw, PluginConfig):
            return raw
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(raw) - known)
        if bad:
            raise ValueError(f"vtoken: unknown setting(s) {bad} in additional_config['vtoken']; known: {sorted(known)}")
        return cls(**raw)

    def load_policy(self) -> Any:
        """The configured ``vtoken_sdk.Policy`` (budget overrides applied) or None for ``"none"``."""
        if not self.enabled:
            return None
        pol = _load_policy(str(self.policy), self.policy_name)
        if self.eviction_ratio is not None or self.budget_tokens is not None:
            from vtoken_sdk import Budget

            b = pol.budget
            keep = {"min_tokens": b.min_tokens, "slack": b.slack, "when": b.when}
            budget = (Budget(tokens=int(self.budget_tokens), **keep) if self.budget_tokens is not None
                      else Budget.evict(float(self.eviction_ratio), **keep))
            pol = pol.configure(budget=budget)
        return pol


@lru_cache(maxsize=16)
def _load_policy(spec: str, name: str | None) -> Any:
    import vtoken_policies

    if spec in vtoken_policies.names():
        return vtoken_policies.load(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"vtoken: policy {spec!r} is neither a shipped policy "
                         f"({', '.join(vtoken_policies.names())}) nor a file")
    from vtoken_sdk.loader import load_policy_file

    loaded = load_policy_file(path)
    if loaded.error is not None:
        raise ValueError(f"vtoken: cannot load policy file: {loaded.error}")
    if not loaded.policies:
        raise ValueError(f"vtoken: {spec} defines no policy")
    if name is None:
        return loaded.policies[0]
    for p in loaded.policies:
        if p.name == name:
            return p
    raise ValueError(f"vtoken: {spec} has no policy named {name!r}; it has {[p.name for p in loaded.policies]}")


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options from ``SamplingParams(extra_args={"vtoken": {...}})``.

    enabled         False opts the request out of eviction (it still runs through the indirection)
    pinned_spans    ``[[start, end), ...]`` true positions never evicted (a system prompt, a tool output)
    budget_tokens   absolute budget for this request (overrides the policy budget)
    eviction_ratio  budget ``ratio = 1 - eviction_ratio`` of the processed length for this request
    """

    enabled: bool = True
    pinned_spans: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    budget_tokens: int | None = None
    eviction_ratio: float | None = None

    def budget(self, seq_len: int, default: int) -> int:
        if self.budget_tokens is not None:
            return int(self.budget_tokens)
        if self.eviction_ratio is not None:
            import math

            return int(math.floor((1.0 - float(self.eviction_ratio)) * seq_len + 0.5))
        return default

    @property
    def overrides_budget(self) -> bool:
        return self.budget_tokens is not None or self.eviction_ratio is not None


def request_options(sampling_params: Any) -> RequestOptions:
    """Parse ``sampling_params.extra_args["vtoken"]``; ValueError names the bad key."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    raw = extra.get(CONFIG_KEY)
    if raw is None:
        return RequestOptions()
    if raw is False:
        return RequestOptions(enabled=False)
    if not isinstance(raw, dict):
        raise ValueError(f"vtoken: extra_args['vtoken'] must be a dict or False, got {type(raw).__name__}")
    known = {"enabled", "opt_out", "pinned_spans", "budget_tokens", "eviction_ratio"}
    bad = sorted(set(raw) - known)
    if bad:
        raise ValueError(f"vtoken: unknown per-request option(s) {bad}; known: {sorted(known)}")
    enabled = bool(raw.get("enabled", True)) and not bool(raw.get("opt_out", False))
    spans = []
    for s in raw.get("pinned_spans", ()) or ():
        a, b = (int(x) for x in s)
        if not 0 <= a <= b:
            raise ValueError(f"vtoken: pinned span {s!r} must satisfy 0 <= start <= end")
        spans.append((a, b))
    bt = raw.get("budget_tokens")
    er = raw.get("eviction_ratio")
    if bt is not None and int(bt) < 1:
        raise ValueError(f"vtoken: budget_tokens must be >= 1, got {bt}")
    if er is not None and not 0.0 <= float(er) < 1.0:
        raise ValueError(f"vtoken: eviction_ratio must lie in [0, 1), got {er}")
    return RequestOptions(enabled=enabled, pinned_spans=tuple(spans), budget_tokens=None if bt is None else int(bt),
                          eviction_ratio=None if er is None else float(er))
