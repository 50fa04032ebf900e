"""vtoken policy SDK: write a KV-cache eviction policy as one decorated function.

    import vtoken_sdk as vt

    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(64)], granularity="head")
    def h2o(s: vt.TokenStats):
        return s.attn_sum
"""

from .allocation import AdaptiveLayer, GlobalAllocation, HeadClasses, LayerSchedule, Pyramid, Uniform
from .backend import CompiledPolicy, compile_policy
from .batch import MaskContext, StatsBatch
from .budget import Budget
from .errors import PolicyDefinitionError, PolicyRuntimeError, VTokenError
from .ir import (
    abs,
    avg_pool,
    chunk_max,
    chunk_mean,
    clamp,
    cosine,
    dot,
    exp,
    group_mean,
    head_mean,
    isnan,
    log,
    matvec,
    max_pool,
    maximum,
    minimum,
    norm,
    quad,
    sigmoid,
    softmax,
    sqrt,
    tanh,
    token_max,
    token_mean,
    token_std,
    token_sum,
    where,
)
from .policy import Params, Policy, PolicySpec, mask_policy, policy
from .protect import protect_if, recent, sinks, span
from .selection import select
from .stats import CATALOG, StatsConfig, TokenStats

__all__ = [
    "AdaptiveLayer", "GlobalAllocation", "HeadClasses", "LayerSchedule", "Pyramid", "Uniform",
    "CATALOG", "Budget", "CompiledPolicy", "compile_policy", "MaskContext", "Params", "Policy", "PolicyDefinitionError", "PolicyRuntimeError",
    "PolicySpec", "StatsBatch", "StatsConfig", "TokenStats", "VTokenError", "abs", "avg_pool", "clamp", "exp",
    "head_mean", "isnan", "log", "mask_policy", "max_pool", "maximum", "minimum", "policy", "protect_if", "recent",
    "select", "sigmoid", "sinks", "span", "sqrt", "tanh", "where",
    "chunk_max", "chunk_mean", "cosine", "dot", "group_mean", "matvec", "norm", "quad", "softmax", "token_max",
    "token_mean", "token_std", "token_sum",
]
__version__ = "0.1.0"
