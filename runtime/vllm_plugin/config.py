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

from vtoken_sdk.budget import PHASES_OF, parse_slack

log = logging.getLogger("vtoken.vllm")

CONFIG_KEY = "vtoken"
MODES = ("compact", "ordered", "naive")
NO_POLICY = ("none", "", None)
# the engine's slack when neither the configuration nor the policy's budget gives one: "block" holds the blocks
# of slack 0 after every step with one policy call per several decode steps (what `bench serve` measures)
SERVING_SLACK = "block"


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
    when            overrides the budget's ``when`` (``chunks``: also evict after every prefill chunk)
    slack           overrides the budget's ``slack``: evict only once ``live > budget + slack``, then down
                    to the budget (one policy call and one reclaim per ``slack`` tokens instead of per
                    decode step; a request holds at most ``slack`` tokens more), or ``"block"``: evict
                    only when a step would otherwise leave the request a block more than the budget's
                    (the same blocks as slack 0 after every step; see ``Budget``). Default (None): the
                    policy's budget's slack if it sets one, else :data:`SERVING_SLACK` (``"block"``), the
                    setting ``bench serve`` measures; ``slack=0`` evicts at every decode step
    policy_name     which policy of a multi-policy file (default: the first)
    debug           full invariant checks of the token table after every step (slow)
    """

    policy: str | None = "none"
    mode: str = "compact"
    eviction_ratio: float | None = None
    budget_tokens: int | None = None
    policy_name: str | None = None
    debug: bool = False
    when: str | None = None
    slack: int | str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vtoken: unknown mode {self.mode!r}; expected one of {MODES}")
        if self.eviction_ratio is not None and not 0.0 <= float(self.eviction_ratio) < 1.0:
            raise ValueError(f"vtoken: eviction_ratio must lie in [0, 1), got {self.eviction_ratio}")
        if self.budget_tokens is not None and int(self.budget_tokens) < 1:
            raise ValueError(f"vtoken: budget_tokens must be >= 1, got {self.budget_tokens}")
        if self.when is not None and self.when not in PHASES_OF:
            raise ValueError(f"vtoken: unknown when {self.when!r}; expected one of {sorted(PHASES_OF)}")
        if self.slack is not None:
            try:
                object.__setattr__(self, "slack", parse_slack(self.slack))  # "32" from a JSON string -> 32
            except ValueError as e:
                raise ValueError(f"vtoken: {e}") from None

    @property
    def enabled(self) -> bool:
        return self.policy not in NO_POLICY

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "mode": self.mode, "eviction_ratio": self.eviction_ratio,
                "budget_tokens": self.budget_tokens, "policy_name": self.policy_name, "debug": self.debug, "when": self.when,
                "slack": self.slack}

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
        if isinstance(raw, str):  # {"vtoken": "h2o"}: a policy name (or file) with the defaults
            return cls(policy=raw)
        if not isinstance(raw, dict):
            raise ValueError(f"vtoken: additional_config['vtoken'] must be a policy name or a mapping of settings, "
                             f"got {raw!r}")
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
        slack = self.slack
        if slack is None and "slack" not in pol.budget.model_fields_set:
            slack = SERVING_SLACK  # the serving default, unless the policy's budget sets its own slack
        if any(x is not None for x in (self.eviction_ratio, self.budget_tokens, self.when, slack)):
            ratio = None if self.budget_tokens is not None else self.eviction_ratio  # budget_tokens wins
            pol = pol.configure(budget=pol.budget.override(self.budget_tokens, ratio, self.when,  # type: ignore[arg-type]
                                                           slack))
        if not pol.spec.uniform:  # per-row pages (the CPU worker, issue 39) take one eviction after the prompt
            from vtoken_runtime.eviction import refuse_unequal

            try:
                refuse_unequal(pol, rows=True)
            except ValueError as e:
                raise ValueError(f"vtoken: {e}") from None
        return pol


def describe_policy(policy: Any) -> str:
    """One line: policy, budget, granularity, statistics read (the start-up log line and ``vtoken-cli serve``)."""
    if policy is None:
        return "policy=none (no eviction; the indirection runs)"
    b = policy.budget
    size = f"tokens={b.tokens}" if b.tokens is not None else f"eviction_ratio={1.0 - float(b.ratio):g}"
    extra = "".join(f" {k}={getattr(b, k)}" for k in ("min_tokens", "slack") if getattr(b, k))
    return (f"policy={policy.name} budget({size}{extra} when={b.when}) granularity={policy.granularity} "
            f"statistics={sorted(policy.stored_reads) or 'none'}")


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
    """Per-request options, one flat vocabulary for HTTP (``vllm_xargs``) and Python
    (``SamplingParams(extra_args=...)``)::

        vtoken_enabled         bool     False opts the request out of eviction (it still runs through the
                                        indirection); JSON false arrives over HTTP as 0: 0/1 are accepted
        vtoken_budget_tokens   int >= 1 absolute budget for this request (overrides the policy's size)
        vtoken_eviction_ratio  float    in [0, 1): budget ``ratio = 1 - eviction_ratio`` of the processed length
        vtoken_pinned_spans    [int]    flat list read as [start, end) pairs of true positions never evicted
                                        (a system prompt, a tool output); clipped to the request
        vtoken_allocation      str      "policy" (default: the policy's own allocation) or "uniform": every
                                        (layer, KV head) row keeps the same count (the policy's uniform twin,
                                        in the token table; only changes a policy with unequal budgets)

    The nested ``{"vtoken": {"enabled", "budget_tokens", "eviction_ratio", "pinned_spans": [[s, e], ...]}}``
    stays as an alias (Python only: HTTP ``vllm_xargs`` values must be flat). Anything else that starts
    with ``vtoken`` is an error: options are rejected, never silently dropped.
    """

    enabled: bool = True
    pinned_spans: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    budget_tokens: int | None = None
    eviction_ratio: float | None = None
    allocation: str = "policy"

    def clipped_spans(self, length: int) -> list[tuple[int, int]]:
        """Spans clipped to a request of ``length`` positions (empty spans dropped)."""
        return [(a, min(b, length)) for a, b in self.pinned_spans if a < min(b, length)]


FLAT_KEYS = ("vtoken_enabled", "vtoken_budget_tokens", "vtoken_eviction_ratio", "vtoken_pinned_spans",
             "vtoken_allocation")
NESTED_KEYS = ("enabled", "budget_tokens", "eviction_ratio", "pinned_spans", "allocation")
ALLOCATIONS = ("policy", "uniform")
MAX_SPANS = 4096


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):  # HTTP: JSON true/false arrive as 1/0
        return bool(v)
    raise ValueError(f"vtoken: {key} must be a boolean (true/false), got {v!r}")


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not abs(v) <= 2**62 or v != int(v):
        raise ValueError(f"vtoken: {key} must be an integer >= {lo}, got {v!r}")
    if int(v) < lo:
        raise ValueError(f"vtoken: {key} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _ratio(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= float(v) < 1.0:
        raise ValueError(f"vtoken: {key} must be a number in [0, 1), got {v!r}")
    return float(v)


FLAT_SPANS = "a flat list of start,end pairs, e.g. [0, 16, 32, 40]"


def _spans(key: str, v: Any, nested: bool) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, list | tuple):
        raise ValueError(f"vtoken: {key}: got {v!r}; expected {FLAT_SPANS}")
    if nested and all(isinstance(x, list | tuple) for x in v):
        flat = [y for x in v for y in (x if len(x) == 2 else [None, None, None])]
    elif any(isinstance(x, list | tuple) for x in v):
        raise ValueError(f"vtoken: {key}: got a nested list {_short(v)}; expected {FLAT_SPANS}")
    else:
        flat = list(v)
    if len(flat) % 2 or len(flat) > 2 * MAX_SPANS:
        raise ValueError(f"vtoken: {key} must hold an even number of integers (at most {2 * MAX_SPANS}), "
                         f"read as [start, end) pairs; got {len(flat)} value(s); expected {FLAT_SPANS}")
    out = []
    for a, b in zip(flat[0::2], flat[1::2], strict=True):
        for what, x in (("start", a), ("end", b)):
            try:
                _int(key, x, 0)
            except ValueError:
                raise ValueError(f"vtoken: {key}: span {what} {_short(x)} in [{_short(a)}, {_short(b)}] must be an "
                                 f"integer >= 0; expected {FLAT_SPANS}") from None
        a, b = int(a), int(b)
        if a > b:
            raise ValueError(f"vtoken: {key}: span [{a}, {b}) must satisfy start <= end; expected {FLAT_SPANS}")
        out.append((a, b))
    return tuple(out)


def _short(v: Any, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters (an error line stays one short line)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def parse_request_options(extra_args: Any) -> RequestOptions:
    """Options from ``extra_args`` (a mapping; the flat keys and/or the nested ``"vtoken"`` alias).
    ValueError names the key and what it expects; unknown ``vtoken*`` keys are errors."""
    if extra_args is None:
        return RequestOptions()
    if not isinstance(extra_args, dict):
        raise ValueError(f"vtoken: extra_args must be a mapping, got {type(extra_args).__name__}")
    vals: dict[str, Any] = {}
    for k, v in extra_args.items():
        if not isinstance(k, str) or not k.startswith(CONFIG_KEY) or k == CONFIG_KEY:
            continue
        if k not in FLAT_KEYS:
            raise ValueError(f"vtoken: unknown per-request option {k!r}; known: {list(FLAT_KEYS)}")
        vals[k[len(CONFIG_KEY) + 1:]] = (k, v, False)
    nested = extra_args.get(CONFIG_KEY)
    if nested is not None:
        if nested is False:
            nested = {"enabled": False}
        if not isinstance(nested, dict):
            raise ValueError(f"vtoken: extra_args['vtoken'] must be a mapping or false, got {nested!r}")
        for k, v in nested.items():
            if k not in NESTED_KEYS:
                raise ValueError(f"vtoken: unknown per-request option 'vtoken.{k}'; known: {list(NESTED_KEYS)} "
                                 f"(or the flat keys {list(FLAT_KEYS)})")
            if k in vals:
                raise ValueError(f"vtoken: option {k!r} given both flat and nested")
            vals[k] = (f"vtoken.{k}", v, True)
    opts: dict[str, Any] = {}
    for name, (key, v, is_nested) in vals.items():
        if name == "enabled":
            opts["enabled"] = _bool(key, v)
        elif name == "budget_tokens":
            opts["budget_tokens"] = _int(key, v, 1)
        elif name == "eviction_ratio":
            opts["eviction_ratio"] = _ratio(key, v)
        elif name == "allocation":
            if v not in ALLOCATIONS:
                raise ValueError(f"vtoken: {key} must be one of {list(ALLOCATIONS)}, got {_short(v)}")
            opts["allocation"] = v
        else:
            opts["pinned_spans"] = _spans(key, v, is_nested)
    if "budget_tokens" in opts and "eviction_ratio" in opts:
        raise ValueError("vtoken: give at most one of vtoken_budget_tokens and vtoken_eviction_ratio")
    return RequestOptions(**opts)


def request_options(sampling_params: Any) -> RequestOptions:
    """Parse a request's ``sampling_params.extra_args``; ValueError names the bad key."""
    return parse_request_options(getattr(sampling_params, "extra_args", None))
