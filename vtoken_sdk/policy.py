"""``@vt.policy``: a KV-cache eviction policy as one decorated function.

::

    @vt.policy(budget=vt.Budget(ratio=0.5), protect=[vt.sinks(4), vt.recent(64)], granularity="head")
    def h2o(s: vt.TokenStats):
        return s.attn_sum          # [B, H, N], higher = keep

At decoration the function is traced once into the policy IR (``vtoken_sdk.ir``);
nothing else runs, nothing is patched. Budget, protection and granularity live in a
frozen pydantic :class:`PolicySpec`; ``policy.configure(...)`` re-traces a copy with
other settings without touching the file.

``@vt.mask_policy`` is the escape hatch for logic the IR cannot express: an eager
torch function returning the keep mask itself. It runs only on the torch backend and
``vtoken-cli validate`` checks its contract (pins, exact budget, padding, determinism,
batch invariance) with property tests.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor

from . import ir
from .allocation import ALLOCATIONS, Allocation, Uniform
from .budget import Budget
from .errors import PolicyDefinitionError, traceback_line_in_file
from .protect import Predicate, Rule, flatten
from .stats import CATALOG, STORED_STATS, VECTOR_STATS, StatsConfig

if TYPE_CHECKING:
    from .backend import CompiledPolicy

Granularity = Literal["request", "head"]


class Params(BaseModel):
    """Base for a policy's own hyper-parameters (frozen; subclass and add fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PolicySpec(BaseModel):
    """Everything about a policy except its score function."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    budget: Budget
    protect: tuple[Rule, ...] = ()
    granularity: Granularity = "request"
    stats: StatsConfig = StatsConfig()
    params: Params | None = None
    allocation: Allocation = Uniform()

    @property
    def uniform(self) -> bool:
        """Every (layer, KV head) row keeps the same number of tokens (decision 4; what the runtimes run)."""
        return isinstance(self.allocation, Uniform)


def _loc(fn: Callable[..., Any]) -> tuple[str, int]:
    """``(file, line of the def statement)`` (co_firstlineno points at the first decorator)."""
    code = fn.__code__
    line = code.co_firstlineno
    try:
        lines, start = inspect.getsourcelines(fn)
        for i, text in enumerate(lines):
            if text.lstrip().startswith(("def ", "async def ")):
                line = start + i
                break
    except (OSError, TypeError):
        pass
    return code.co_filename, line


def _trace(fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> ir.Node:
    file, line = _loc(fn)
    token = ir._TRACE_FILE.set(file)
    returned_at: list[int] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is fn.__code__:
            returned_at.append(frame.f_lineno)

    old = sys.getprofile()
    sys.setprofile(profiler)
    try:
        out = fn(*args)
    except PolicyDefinitionError:
        raise
    except Exception as e:
        tl = traceback_line_in_file(e.__traceback__, file) or line
        raise PolicyDefinitionError(f"{what} raised {type(e).__name__}: {e}", file=file, line=tl,
                                    hint="score functions may only use elementwise math on s.<stat>") from None
    finally:
        sys.setprofile(old)
        ir._TRACE_FILE.reset(token)
    if returned_at:
        line = returned_at[-1]
    if isinstance(out, ir.Expr):
        node = out.node
        if set(node.axes) - {"N"}:
            raise PolicyDefinitionError(
                f"{what} returned a {ir.kind_name(node.axes)}, expected one number per token [B,H,N] "
                "(or per head [B,H,1])", file=file, line=line,
                hint="reduce the head dimension with vt.dot / vt.norm / vt.cosine and the query heads with "
                     "vt.group_mean")
    elif isinstance(out, (int, float)) and not isinstance(out, bool):
        node = ir.Const(float(out))
    else:
        raise PolicyDefinitionError(
            f"{what} returned {type(out).__name__}, expected a score tensor expression [B, H, N] (higher = keep)",
            file=file, line=line, hint="return e.g. s.attn_sum; budgets and pins are applied by the framework")
    return node


def _check_signature(fn: Callable[..., Any], n_params: int, what: str) -> None:
    file, line = _loc(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:  # pragma: no cover - builtins
        raise PolicyDefinitionError(f"cannot inspect {what}: {e}", file=file, line=line) from None
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra = [p for p in sig.parameters.values() if p not in params and p.default is p.empty]
    if len(params) != n_params or extra:
        want = {1: "def score(s: vt.TokenStats)", 2: "def score(s: vt.TokenStats, p: Params)"}.get(
            n_params, f"{n_params} parameters")
        raise PolicyDefinitionError(f"{what} takes {len(params)} positional parameter(s), expected {n_params}",
                                    file=file, line=line, hint=f"write {want}")


class Policy:
    """A traced, validated eviction policy. Build with ``@vt.policy`` / ``@vt.mask_policy``."""

    def __init__(self, fn: Callable[..., Any], spec: PolicySpec, kind: Literal["score", "mask"] = "score",
                 declared_reads: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.spec = spec
        self.kind = kind
        self.file, self.line = _loc(fn)
        self.doc = inspect.getdoc(fn) or inspect.cleandoc(fn.__globals__.get("__doc__") or "")
        self._declared_reads = declared_reads
        reads: set[str] = set(declared_reads)
        if kind == "score":
            _check_signature(fn, 2 if spec.params is not None else 1, f"policy {spec.name!r}")
            args: tuple[Any, ...] = (ir.TracingStats(),) + ((spec.params,) if spec.params is not None else ())
            self.node: ir.Node | None = ir._to_float(_trace(fn, args, f"policy {spec.name!r}"))
            reads |= ir.stats_read(self.node)
        else:
            _check_signature(fn, 2, f"mask policy {spec.name!r}")
            self.node = None
        pin_rules: list[Rule] = []
        for rule in spec.protect:
            if isinstance(rule, Predicate):
                file, line = _loc(rule.fn) if hasattr(rule.fn, "__code__") else (self.file, self.line)
                node = _trace(rule.fn, (ir.TracingStats(),), "protect_if predicate")
                if node.dtype != "bool":
                    raise PolicyDefinitionError("protect_if predicate returned a float expression, expected a "
                                                "boolean", file=file, line=line, hint="e.g. lambda s: s.key_norm > 8")
                reads |= ir.stats_read(node)
                rule = Predicate(fn=rule.fn, node=node)
            pin_rules.append(rule)
        self.spec = spec.model_copy(update={"protect": tuple(pin_rules)})
        self.reads: frozenset[str] = frozenset(reads)
        self.stored_reads: frozenset[str] = frozenset(r for r in reads if r in STORED_STATS)
        # vector statistics the runtime gathers for this policy (StatsBatch.vectors)
        self.vector_reads: frozenset[str] = frozenset(r for r in reads if r in VECTOR_STATS)

    # --------------------------------------------------------------- metadata
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def budget(self) -> Budget:
        return self.spec.budget

    @property
    def granularity(self) -> Granularity:
        return self.spec.granularity

    @property
    def allocation(self) -> Allocation:
        return self.spec.allocation

    def __repr__(self) -> str:
        alloc = "" if self.spec.uniform else f", allocation={self.allocation!r}"
        return (f"Policy({self.name!r}, budget={self.budget!r}, granularity={self.granularity!r}{alloc}, "
                f"reads={sorted(self.reads)})")

    def describe(self) -> str:
        """The traced score expression (or ``<mask function>``)."""
        return repr(self.node) if self.node is not None else "<mask function>"

    # --------------------------------------------------------------- configure
    def configure(self, **changes: Any) -> Policy:
        """A copy with other settings, e.g. ``h2o.configure(budget=vt.Budget.evict(0.7))``.

        Keys: ``budget``, ``protect``, ``granularity``, ``stats``, ``allocation``, ``name``, or fields of
        the policy's ``Params`` model. The score function is re-traced.
        """
        spec_fields = set(PolicySpec.model_fields)
        update = {k: v for k, v in changes.items() if k in spec_fields}
        param_changes = {k: v for k, v in changes.items() if k not in spec_fields}
        if "protect" in update:
            update["protect"] = flatten(update["protect"])
        if param_changes:
            if self.spec.params is None:
                raise PolicyDefinitionError(f"unknown setting(s) {sorted(param_changes)} for policy {self.name!r}",
                                            file=self.file, line=self.line,
                                            hint=f"configurable: {sorted(spec_fields)}")
            try:
                update["params"] = self.spec.params.model_validate({**self.spec.params.model_dump(), **param_changes})
            except ValidationError as e:
                raise PolicyDefinitionError(_pydantic_message(e), file=self.file, line=self.line) from None
        if "allocation" in update:
            _check_allocation(update["allocation"], update.get("granularity", self.spec.granularity), self.kind,
                              self.file, self.line)
        elif update.get("granularity", "head") != "head" and not self.spec.uniform:
            _check_allocation(self.spec.allocation, update["granularity"], self.kind, self.file, self.line)
        try:
            spec = PolicySpec.model_validate({**dict(self.spec), **update})
        except ValidationError as e:
            raise PolicyDefinitionError(_pydantic_message(e), file=self.file, line=self.line) from None
        return Policy(self.fn, spec, self.kind, self._declared_reads)

    # --------------------------------------------------------------- backends
    def compile(self, backend: str | None = None, device: Any = None) -> CompiledPolicy:
        """The compiled policy for a backend (``"torch"`` or ``"triton"``; default: by ``device``). Compiled
        forms are cached by their backend (``vtoken_sdk.backend``), not on the policy."""
        from .backend import compile_policy

        return compile_policy(self, backend, device)

    def keep_mask(self, batch: Any) -> Tensor:
        """``[B, L, H, N]`` keep mask with the torch backend (see ``vtoken_sdk.selection``)."""
        return self.compile("torch").keep_mask(batch)


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        where = f"{e.title}.{loc}" if loc else e.title
        parts.append(f"{where}: {err.get('msg')} (got {err.get('input')!r})")
    return "; ".join(parts)


def _check_allocation(allocation: Any, granularity: Any, kind: str, file: str, line: int) -> None:
    """``allocation=`` is one of the frozen models; an unequal one needs per-head rows and a score function."""
    if not isinstance(allocation, ALLOCATIONS):
        raise PolicyDefinitionError(
            f"got allocation of type {type(allocation).__name__}, expected one of "
            f"{', '.join('vt.' + a.__name__ for a in ALLOCATIONS)}", file=file, line=line,
            hint="e.g. allocation=vt.AdaptiveLayer(floor=0.2) (AdaKV) or vt.Pyramid(beta=20) (PyramidKV)")
    if isinstance(allocation, Uniform):
        return
    if granularity != "head":
        raise PolicyDefinitionError(
            f"got allocation={allocation!r} with granularity={granularity!r}, expected granularity='head'",
            file=file, line=line, hint="unequal budgets share a request's tokens among its (layer, KV head) rows: "
                                       "write granularity='head'")
    if kind != "score":
        raise PolicyDefinitionError(
            f"got allocation={allocation!r} on a mask policy, expected a score policy",
            file=file, line=line, hint="a mask function chooses its kept sets itself; write @vt.policy with a "
                                       "score function to have the framework share the budget")


def _make_spec(fn: Callable[..., Any], name: str | None, budget: Any, protect: Any, granularity: Any,
               stats: Any, params: Any, allocation: Any = None, kind: str = "score") -> PolicySpec:
    file, line = fn.__code__.co_filename, fn.__code__.co_firstlineno  # the decorator line: settings live there
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        raise PolicyDefinitionError(f"got budget={budget!r}, expected a vt.Budget", file=file, line=line,
                                    hint="write budget=vt.Budget(ratio=0.5) or vt.Budget(tokens=1024)")
    if not isinstance(budget, Budget):
        raise PolicyDefinitionError(f"got budget of type {type(budget).__name__}, expected vt.Budget",
                                    file=file, line=line, hint="write budget=vt.Budget(ratio=0.5)")
    if granularity not in ("request", "head"):
        raise PolicyDefinitionError(f"got granularity={granularity!r}, expected 'request' or 'head'",
                                    file=file, line=line)
    if params is not None and not isinstance(params, Params):
        raise PolicyDefinitionError(f"got params of type {type(params).__name__}, expected a vt.Params instance",
                                    file=file, line=line, hint="class P(vt.Params): alpha: float = 1.0; params=P()")
    allocation = Uniform() if allocation is None else allocation
    _check_allocation(allocation, granularity, kind, file, line)
    try:
        rules = flatten(protect)
        return PolicySpec(name=name or fn.__name__, budget=budget, protect=rules, granularity=granularity,
                          stats=stats if stats is not None else StatsConfig(), params=params,
                          allocation=allocation)
    except (ValidationError, TypeError) as e:
        msg = _pydantic_message(e) if isinstance(e, ValidationError) else str(e)
        raise PolicyDefinitionError(msg, file=file, line=line) from None


def policy(*, budget: Budget, protect: Rule | list[Rule] | tuple[Rule, ...] | None = None,
           granularity: Granularity = "request", stats: StatsConfig | None = None, params: Params | None = None,
           name: str | None = None, allocation: Allocation | None = None) -> Callable[[Callable[..., Any]], Policy]:
    """Decorate a score function ``(s: TokenStats[, p: Params]) -> [B, H, N]`` (higher = keep).

    ``allocation``: how a request's budget is shared among its (layer, KV head) rows (``vt.Uniform()``, the
    default: every row keeps ``budget``; ``vt.AdaptiveLayer(floor=0.2)``: AdaKV; ``vt.Pyramid()``: PyramidKV;
    ``vt.LayerSchedule(weights=...)``; see ``vtoken_sdk.allocation``). Unequal allocations need
    ``granularity="head"``."""

    def wrap(fn: Callable[..., Any]) -> Policy:
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise PolicyDefinitionError(f"@vt.policy decorates a function, got {type(fn).__name__}")
        return Policy(fn, _make_spec(fn, name, budget, protect, granularity, stats, params, allocation), "score")

    return wrap


def mask_policy(*, budget: Budget, reads: tuple[str, ...] | list[str] = (),
                protect: Rule | list[Rule] | tuple[Rule, ...] | None = None, granularity: Granularity = "request",
                stats: StatsConfig | None = None, name: str | None = None) -> Callable[[Callable[..., Any]], Policy]:
    """Decorate an eager ``(s: TokenStats, ctx: MaskContext) -> bool [B, L, H, N]`` keep-mask function.

    ``reads`` lists the statistics it uses (the runtime collects only those).
    """

    def wrap(fn: Callable[..., Any]) -> Policy:
        file, line = _loc(fn)
        for r in reads:
            if r not in CATALOG:
                import difflib

                close = difflib.get_close_matches(r, list(CATALOG), n=1)
                raise PolicyDefinitionError(f"unknown statistic {r!r} in reads=", file=file, line=line,
                                            hint=f"did you mean {close[0]!r}?" if close else None)
        return Policy(fn, _make_spec(fn, name, budget, protect, granularity, stats, None, None, "mask"), "mask",
                      tuple(reads))

    return wrap
