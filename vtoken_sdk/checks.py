"""The contract checks behind ``vtoken-cli validate`` and ``testing.check_policy``.

Each check is a hypothesis property over random batches; on failure the shrunk
falsifying batch is described (shapes, lengths, mode, seed, spans, budget) together
with the request/row that broke the contract.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings

from .allocation import (
    AdaptiveLayer,
    GlobalAllocation,
    HeadClasses,
    LayerSchedule,
    composite_keys,
    layer_counts,
    pyramid_counts,
)
from .batch import StatsBatch
from .errors import PolicyRuntimeError
from .policy import Policy
from .stats import CATALOG
from .strategies import CheckResult, PolicyReport, batch_specs, build_batch


class ContractViolation(AssertionError):
    pass


CHECKS: dict[str, str] = {
    "definition": "definition valid (traced / loaded)",
    "known_stats": "reads only known statistics",
    "score_shape": "scores [B,L,H,N] float32 / mask [B,L,H,N] bool",
    "pins_kept": "pinned tokens never dropped",
    "exact_budget": "kept == min(length, max(budget, pins)) in every row (unequal allocation: the allocation's "
                    "total, every row >= its floor and pins, each row its own top)",
    "padding": "nothing kept past a request's length",
    "deterministic": "same mask twice under a fixed seed",
    "batch_invariant": "a request's mask ignores the rest of the batch",
    "nan_inf": "NaN/inf statistics follow the contract",
    "backend_equal": "Triton kernels == torch reference (masks bit-identical; CUDA or TRITON_INTERPRET=1)",
}


def _mask(compiled: Any, batch: StatsBatch) -> torch.Tensor:
    return compiled.keep_mask(batch)


def _expected_budget(compiled: Any, batch: StatsBatch) -> torch.Tensor:
    """``[B]`` int64 budget per request, written out from the policy's declaration (the batch's override,
    else ``tokens`` or ``floor(ratio * seq_len + 0.5)``, at least ``min_tokens``) rather than taken from
    the backend (``compiled.budgets``) or ``Budget.resolve``, so a wrong resolution is caught too."""
    if batch.budget is not None:
        return batch.budget.to(torch.int64).cpu()
    spec = compiled.policy.spec.budget
    seq = batch.seq_lens.to(torch.int64).cpu()
    if spec.tokens is not None:
        base = torch.full_like(seq, int(spec.tokens))
    else:  # float64, the same IEEE product as the runtime's Python float arithmetic
        base = torch.floor(seq.to(torch.float64) * float(spec.ratio) + 0.5).to(torch.int64)
    return base.clamp(min=int(spec.min_tokens))


def _expected(compiled: Any, batch: StatsBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Pins ``[B, L, H, N]`` and the kept count per request ``[B]``: every row keeps
    ``min(length, max(budget, most pins in a row))`` (computed here, not by the selection code)."""
    b, l_, h, n = batch.shape
    pins = compiled.pins(batch)
    if compiled.policy.spec.granularity == "request":
        pins = pins.any(dim=(1, 2), keepdim=True).expand(b, l_, h, n)
    lengths = batch.lengths.to(torch.int64).cpu()
    valid = torch.arange(n)[None, None, None, :] < lengths[:, None, None, None]
    npins = (pins.cpu() & valid).sum(-1).reshape(b, -1).amax(-1) if n else torch.zeros(b, dtype=torch.int64)
    budget = _expected_budget(compiled, batch).clamp(min=0)
    k = torch.minimum(lengths, torch.maximum(budget, npins))
    return pins, k.to(batch.device)


def _where(mask: torch.Tensor) -> str:
    idx = mask.nonzero()
    if len(idx) == 0:
        return ""
    b, l_, h, n = (int(x) for x in idx[0])
    return f"request {b}, layer {l_}, head {h}, token {n}"


def prop_pins(compiled: Any, batch: StatsBatch) -> None:
    mask = _mask(compiled, batch)
    pins, _ = _expected(compiled, batch)
    dropped = pins & ~mask
    if dropped.any():
        raise ContractViolation(f"pinned token dropped at {_where(dropped)}")


def _expected_rows(compiled: Any, batch: StatsBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Unequal allocation, written out from the allocation's definition (not the selection code):
    ``(at_least [B, L, H], exact [B, L, H] or None, layer_total [B, L])`` (GlobalAllocation: ``[B, 1]``, the
    request's total over all rows, ``max(L x H x k, sum of the floors)``). AdaptiveLayer: a layer keeps
    ``max(H x k, sum of its rows' floors)``, a row at least ``min(length, max(floor, its pins))`` with
    ``floor = max(1, int(k x floor))``; a schedule: every row exactly ``min(length, max(its layer's count,
    its pins))``."""
    b, l_, h, n = batch.shape
    pins = compiled.pins(batch).cpu()
    lengths = batch.lengths.to(torch.int64).cpu()
    valid = torch.arange(n)[None, None, None, :] < lengths[:, None, None, None]
    npins = (pins & valid).sum(-1)  # [B, L, H]
    budget = _expected_budget(compiled, batch).clamp(min=0)
    k = torch.minimum(lengths, budget)
    alloc = compiled.policy.spec.allocation
    if isinstance(alloc, (AdaptiveLayer, GlobalAllocation)):
        floor = torch.tensor([max(1, int(int(x) * alloc.floor)) if int(x) > 0 and alloc.floor > 0 else 0
                              for x in k], dtype=torch.int64)
        least = torch.minimum(torch.maximum(floor[:, None, None], npins), lengths[:, None, None])
        if isinstance(alloc, GlobalAllocation):  # one total over every row: [B, 1]
            return least, None, torch.maximum(l_ * h * k, least.sum((1, 2)))[:, None]
        return least, None, torch.maximum(h * k[:, None], least.sum(-1))
    per = torch.tensor([layer_counts(alloc, l_, int(k[i])) if isinstance(alloc, LayerSchedule)
                        else pyramid_counts(alloc, l_, int(lengths[i]), int(k[i])) for i in range(b)],
                       dtype=torch.int64).reshape(b, l_)
    exact = torch.minimum(torch.maximum(per[:, :, None], npins), lengths[:, None, None])
    return exact, exact, exact.sum(-1)


def _prop_rows(compiled: Any, batch: StatsBatch, mask: torch.Tensor) -> None:
    """The unequal-allocation contract (:func:`_expected_rows`), and every row keeps its own top tokens
    (pins, then scores, NaN as -inf, ties to the more recent token)."""
    least, exact, total = _expected_rows(compiled, batch)
    b, l_, h, n = batch.shape
    glob = isinstance(compiled.policy.spec.allocation, GlobalAllocation)
    if glob:  # one group of all L x H rows: the layer-wide checks below run over the whole request
        least = least.reshape(b, 1, l_ * h)
        mask = mask.reshape(b, 1, l_ * h, n)
    kept = mask.cpu().sum(-1)  # [B, L, H]
    bad = kept < least if exact is None else kept != exact
    if bad.any():
        bi, li, hi = (int(x) for x in bad.nonzero()[0])
        what = "at least" if exact is None else "exactly"
        raise ContractViolation(f"request {bi} layer {li} head {hi} keeps {int(kept[bi, li, hi])} tokens, expected "
                                f"{what} {int(least[bi, li, hi])} ({compiled.policy.spec.allocation!r})")
    bad_l = kept.sum(-1) != total
    if bad_l.any():
        bi, li = (int(x) for x in bad_l.nonzero()[0])
        raise ContractViolation(f"request {bi} layer {li} keeps {int(kept[bi, li].sum())} tokens in all, expected "
                                f"{int(total[bi, li])} ({compiled.policy.spec.allocation!r})")
    comp = composite_keys(compiled.scores(batch).cpu(), batch.lengths.cpu(), compiled.pins(batch).cpu())
    comp = comp.reshape(b, 1, l_ * h, n) if glob else comp
    m = mask.cpu()
    lo = torch.where(m, comp, torch.full_like(comp, 2**63 - 1)).amin(-1)  # the weakest kept key of a row
    hi = torch.where(~m, comp, torch.full_like(comp, -(2**63))).amax(-1)  # the strongest dropped one
    worse = (lo < hi) & m.any(-1) & (~m).any(-1)
    if worse.any():
        bi, li, hi_ = (int(x) for x in worse.nonzero()[0])
        raise ContractViolation(f"request {bi} layer {li} head {hi_} drops a token that ranks above one it keeps")
    if exact is None:  # AdaptiveLayer: past each row's own floor, the layer keeps its highest keys of all rows
        n = comp.shape[-1]
        rank = torch.empty_like(comp)
        rank.scatter_(-1, comp.argsort(-1, descending=True), torch.arange(n).expand_as(comp).contiguous())
        rest = (rank >= least[..., None]) & (comp != -(2**63))  # valid tokens beyond the row's floor
        lo = torch.where(m & rest, comp, torch.full_like(comp, 2**63 - 1)).flatten(2).amin(-1)  # [B, L]
        hi = torch.where(~m & rest, comp, torch.full_like(comp, -(2**63))).flatten(2).amax(-1)
        bad_l = lo < hi
        if bad_l.any():
            bi, li = (int(x) for x in bad_l.nonzero()[0])
            raise ContractViolation(f"request {bi} layer {li} drops a token that ranks above one another head of "
                                    f"the layer keeps beyond its floor ({compiled.policy.spec.allocation!r})")


def _prop_head_classes(compiled: Any, batch: StatsBatch, mask: torch.Tensor) -> None:
    """HeadClasses (DuoAttention): a retrieval row keeps every token of the request, a streaming row exactly
    its pins, its first ``sinks`` and its last ``recent`` positions (written out here, row by row)."""
    alloc = compiled.policy.spec.allocation
    b, l_, h, n = batch.shape
    pins = compiled.pins(batch).cpu()
    pos = batch.positions.cpu().to(torch.int64).expand(b, l_, h, n)
    retrieval = set(alloc.retrieval)
    m = mask.cpu()
    for bi in range(b):
        length, seq = int(batch.lengths[bi]), int(batch.seq_lens[bi])
        for li in range(l_):
            for hi in range(h):
                want = torch.zeros(n, dtype=torch.bool)
                if (batch.layer_offset + li, hi) in retrieval:
                    want[:length] = True
                else:
                    p = pos[bi, li, hi, :length]
                    want[:length] = pins[bi, li, hi, :length] | (p < alloc.sinks) | (p >= seq - alloc.recent)
                if not torch.equal(m[bi, li, hi], want):
                    kind = "retrieval" if (batch.layer_offset + li, hi) in retrieval else "streaming"
                    raise ContractViolation(f"request {bi} layer {li} head {hi} ({kind}) keeps {int(m[bi, li, hi].sum())} "
                                            f"tokens, expected {int(want.sum())} ({alloc!r})")


def prop_budget(compiled: Any, batch: StatsBatch) -> None:
    mask = _mask(compiled, batch)
    if isinstance(compiled.policy.spec.allocation, HeadClasses):
        _prop_head_classes(compiled, batch, mask)
        return
    if not compiled.policy.spec.uniform:
        _prop_rows(compiled, batch, mask)
        return
    _, k = _expected(compiled, batch)
    kept = mask.sum(-1)  # [B, L, H]
    bad = kept != k[:, None, None]
    if bad.any():
        bi, li, hi = (int(x) for x in bad.nonzero()[0])
        raise ContractViolation(f"request {bi} layer {li} head {hi} keeps {int(kept[bi, li, hi])} tokens, "
                                f"expected {int(k[bi])} (length {int(batch.lengths[bi])})")


def prop_padding(compiled: Any, batch: StatsBatch) -> None:
    mask = _mask(compiled, batch)
    n = batch.shape[-1]
    pad = (torch.arange(n) >= batch.lengths[:, None])[:, None, None, :]
    bad = mask & pad
    if bad.any():
        raise ContractViolation(f"padding token kept at {_where(bad)}")


def prop_deterministic(compiled: Any, batch: StatsBatch) -> None:
    a = _mask(compiled, batch)
    b = _mask(compiled, batch)
    if not torch.equal(a, b):
        raise ContractViolation(f"masks differ between two identical calls at {_where(a != b)}")


def prop_batch_invariant(compiled: Any, batch: StatsBatch) -> None:
    full = _mask(compiled, batch)
    nb = batch.shape[0]
    rev = _mask(compiled, batch.select_requests(list(range(nb))[::-1])).flip(0)
    if not torch.equal(full, rev):
        raise ContractViolation(f"mask changes when the batch order is reversed at {_where(full != rev)}")
    for i in range(nb):
        alone = _mask(compiled, batch.select_requests([i]))
        if not torch.equal(alone[0], full[i]):
            raise ContractViolation(f"request {i}'s mask differs when it runs alone "
                                    f"({int((alone[0] != full[i]).sum())} tokens)")


def prop_score_shape(compiled: Any, batch: StatsBatch) -> None:
    b, l_, h, n = batch.shape
    if compiled.policy.kind == "score":
        s = compiled.scores(batch)
        if tuple(s.shape) != (b, l_, h, n) or s.dtype != torch.float32:
            raise ContractViolation(f"scores have shape {list(s.shape)} dtype {s.dtype}, expected "
                                    f"{[b, l_, h, n]} float32")
    m = _mask(compiled, batch)
    if tuple(m.shape) != (b, l_, h, n) or m.dtype != torch.bool:
        raise ContractViolation(f"mask has shape {list(m.shape)} dtype {m.dtype}, expected {[b, l_, h, n]} bool")


def prop_nan_inf(compiled: Any, batch: StatsBatch) -> None:
    prop_pins(compiled, batch)
    prop_budget(compiled, batch)
    prop_padding(compiled, batch)


def _triton_runnable() -> str | None:
    """Why the Triton backend cannot run here (None when it can: CUDA, or TRITON_INTERPRET=1)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    return None


def _to(batch: StatsBatch, device: Any) -> StatsBatch:
    from dataclasses import replace

    def mv(t: Any) -> Any:
        return None if t is None else t.to(device)

    return replace(batch, stats={k: v.to(device) for k, v in batch.stats.items()}, lengths=batch.lengths.to(device),
                   positions=batch.positions.to(device), seq_lens=batch.seq_lens.to(device), pinned=mv(batch.pinned),
                   budget=mv(batch.budget), vectors={k: v.to(device) for k, v in batch.vectors.items()})


def prop_backend_equal(compiled: Any, batch: StatsBatch) -> None:
    """The Triton kernels against the torch reference: bit-identical masks (and scores) for policies of
    exactly rounded ops; for ``log``/``tanh``/``pow`` scores within 1e-5 and the Triton mask holds the
    contract (masks may then differ where two scores are within a few ulp)."""
    tp = compiled.policy.compile("triton")
    dev = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"
    got = tp.keep_mask(_to(batch, dev)).cpu()
    want = compiled.keep_mask(batch)
    if tp.generated.exact:
        if not torch.equal(got, want):
            raise ContractViolation(f"Triton mask differs from the torch reference at {_where(got != want)}")
        return
    s_t, s_r = tp.scores(_to(batch, dev)).cpu(), compiled.scores(batch)
    valid = (torch.arange(batch.shape[-1]) < batch.lengths[:, None])[:, None, None, :]
    if not torch.allclose(s_t[valid.expand_as(s_t)], s_r[valid.expand_as(s_r)], rtol=1e-5, atol=1e-5,
                          equal_nan=True):
        raise ContractViolation("Triton scores differ from the torch reference by more than 1e-5")
    prop_pins(_Fixed(compiled, got), batch)
    prop_budget(_Fixed(compiled, got), batch)


class _Fixed:
    """A compiled policy whose keep_mask is a given mask (to check another backend's mask)."""

    def __init__(self, compiled: Any, mask: torch.Tensor) -> None:
        self.policy, self.pins, self.mask = compiled.policy, compiled.pins, mask
        self.scores = getattr(compiled, "scores", None)  # unequal allocation: each row its own top (_prop_rows)

    def keep_mask(self, batch: StatsBatch) -> torch.Tensor:
        return self.mask


PROPS: dict[str, tuple[Callable[[Any, StatsBatch], None], tuple[str, ...]]] = {
    "score_shape": (prop_score_shape, ("ties", "continuous")),
    "pins_kept": (prop_pins, ("ties", "continuous", "special")),
    "exact_budget": (prop_budget, ("ties", "continuous", "special")),
    "padding": (prop_padding, ("ties", "continuous", "special")),
    "deterministic": (prop_deterministic, ("ties", "continuous", "special")),
    "batch_invariant": (prop_batch_invariant, ("ties", "continuous", "special")),
    "nan_inf": (prop_nan_inf, ("special",)),
    "backend_equal": (prop_backend_equal, ("ties", "continuous", "special")),
}


def run_property(policy: Policy, prop: Callable[[Any, StatsBatch], None], modes: tuple[str, ...],
                 examples: int, first: Sequence[Any] = ()) -> CheckResult:
    """Run ``prop`` on ``examples`` drawn batches (hypothesis, derandomized, shrunk on failure).

    ``first``: batch specs to try before any drawn one (the falsifying examples of the policy's earlier
    checks, those of a mode this check draws): a policy that crashes fails here at once instead of every
    check drawing and shrinking its own copy of the same crash; the drawn examples still all run."""
    compiled = policy.compile("torch")
    stat_names = tuple(sorted(policy.stored_reads)) + tuple(sorted(policy.vector_reads))
    last: dict[str, Any] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(batch_specs(modes=modes))
    def drawn(spec: Any) -> None:
        batch = build_batch(spec, stat_names)
        try:
            prop(compiled, batch)
        except (ContractViolation, PolicyRuntimeError) as e:
            last["spec"], last["err"] = spec, e
            raise
        except Exception as e:
            last["spec"], last["err"] = spec, e
            raise ContractViolation(f"{type(e).__name__}: {e}") from e

    run = drawn
    for spec in first:
        if spec.mode in modes:
            run = example(spec)(run)
    try:
        run()
    except Exception as e:  # hypothesis re-raises the (shrunk) failure last
        err = last.get("err", e)
        spec = last.get("spec")
        line = err.line if isinstance(err, PolicyRuntimeError) else None
        return CheckResult("", "fail", str(err), spec.describe() if spec is not None else "", line, spec)
    return CheckResult("", "pass", f"{examples} examples")


def run_checks(policy: Policy, examples: int = 200, only: tuple[str, ...] | None = None,
               failing: list[Any] | None = None) -> PolicyReport:
    """Run the checks ``only`` names (default: all) on ``policy``.

    ``failing``: the falsifying batch specs found so far, tried first by every later property check and
    appended to here (pass the same list to calls that check one policy piecemeal, as the CLI does)."""
    report = PolicyReport(policy.name)
    wanted = only or tuple(CHECKS)
    if "definition" in wanted:
        report.results.append(CheckResult("definition", "pass", policy.describe()))
    if "known_stats" in wanted:
        unknown = sorted(set(policy.reads) - set(CATALOG))
        report.results.append(CheckResult("known_stats", "fail" if unknown else "pass",
                                          f"unknown {unknown}" if unknown else f"reads {sorted(policy.reads)}"))
    failing = [] if failing is None else failing
    for name, (prop, modes) in PROPS.items():
        if name not in wanted:
            continue
        if name == "backend_equal":
            why = "a mask policy runs on the torch backend only" if policy.kind != "score" else _triton_runnable()
            if why is not None:
                report.results.append(CheckResult(name, "skip", f"did not run: {why}"))
                continue
            res = run_property(policy, prop, modes, min(examples, 25))
            res.name = name
            report.results.append(res)
            continue
        res = run_property(policy, prop, modes, examples, failing)
        res.name = name
        report.results.append(res)
        if res.spec is not None and res.spec not in failing:
            failing.append(res.spec)
    return report
