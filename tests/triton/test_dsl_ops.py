"""The DSL's vector statistics and reductions compiled to Triton (TRITON_INTERPRET=1): masks and scores
bit-identical to the torch backend, on fixed and random batches, generated expressions, multi-tile rows;
and the policies AOT-compile for sm_90 without spills (``vtoken-cli compile``, started first: it runs in a
subprocess while the interpreter tests run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vtoken_sdk as vt
from tests.cases import CASES, build, case_id
from tests.sdk.dsl_policies import POLICIES
from vtoken_sdk.batch import StatsBatch
from vtoken_sdk.testing import BatchSpec, batch_specs, build_batch, check_policy
from vtoken_sdk.torch_backend import TorchPolicy
from vtoken_sdk.triton_backend import TritonPolicy

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
ROOT = Path(__file__).resolve().parents[2]
DSL_FILE = ROOT / "tests" / "sdk" / "dsl_policies.py"
RUN = "import typer; from vtoken_cli.compile_cmd import compile_policies; typer.run(compile_policies)"
NEW_CASES = [c for c in CASES if c[0] in POLICIES]  # the DSL test policies (tests/sdk/dsl_policies.py)
_TP: dict[tuple[int, int, int], TritonPolicy] = {}


@pytest.fixture(scope="module", autouse=True)
def aot_job():  # type: ignore[no-untyped-def]
    """``vtoken-cli compile tests/sdk/dsl_policies.py --target sm_90 --json``, running in the background."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(DSL_FILE), "--target", "sm_90", "--json",
                             "--no-runtime-kernels"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _tp(policy: vt.Policy, max_single: int = 2048, tile: int = 1024) -> TritonPolicy:
    key = (id(policy), max_single, tile)
    if key not in _TP:
        _TP[key] = TritonPolicy(policy, max_single=max_single, tile=tile)
    return _TP[key]


_BUILT: dict[str, vt.Policy] = {}


def _build(case) -> vt.Policy:  # type: ignore[no-untyped-def]
    key = case_id(case)
    if key not in _BUILT:
        _BUILT[key] = build(case)
    return _BUILT[key]


def _same_scores(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32)))


def _check(policy: vt.Policy, batch: StatsBatch, tp: TritonPolicy | None = None, scores: bool = True) -> None:
    tp = tp or _tp(policy)
    ref = TorchPolicy(policy)
    want, got = ref.keep_mask(batch), tp.keep_mask(batch)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{policy.name}: masks differ at {bad} ({batch.meta.get('spec')})")
    if scores:
        live = (torch.arange(batch.shape[-1]) < batch.lengths[:, None])[:, None, None, :].expand(batch.shape)
        assert _same_scores(tp.scores(batch)[live], ref.scores(batch)[live]), policy.name


FIXED = [
    BatchSpec(2, 2, 3, 100, (90, 37), (5, 60), "ties", 1, False, ((0, 10, 14),), None, 4, 2),
    BatchSpec(2, 2, 2, 77, (77, 0), (0, 3), "special", 2, True, (), (30, 5), 3, 3),
    BatchSpec(1, 1, 3, 64, (64,), (100,), "continuous", 3, False, (), (100,), 5, 1),
    BatchSpec(3, 1, 2, 40, (40, 12, 1), (0, 0, 7), "special", 4, False, ((1, 0, 8),), (0, 2, 0), 1, 2),
]


@pytest.mark.parametrize("case", NEW_CASES, ids=case_id)
def test_dsl_policies_bit_identical(case) -> None:
    policy = _build(case)
    tp = _tp(policy)
    assert tp.generated.exact, "every op of these policies is exactly rounded (softmax's exp included)"
    for spec in FIXED if case[0] != "expected_attention" else FIXED[1:3]:
        _check(policy, build_batch(spec), tp)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=st.sampled_from([c for c in NEW_CASES if c[0] != "expected_attention"]),
       spec=batch_specs(max_b=2, max_layers=2, max_heads=2, max_n=30, max_head_dim=5))
def test_hypothesis_batches_bit_identical(case, spec) -> None:
    _check(_build(case), build_batch(spec))


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=batch_specs(max_b=2, max_layers=1, max_heads=2, max_n=20, max_head_dim=3, max_groups=2))
def test_hypothesis_expected_attention_bit_identical(spec) -> None:
    _check(_build(("expected_attention", {})), build_batch(spec))


# --------------------------------------------------------------------------- generated expressions


def _token(draw, depth: int):  # type: ignore[no-untyped-def]
    """A random token-scalar expression over the new ops (as a function of s)."""
    kind = draw(st.sampled_from(["stat", "dot"] if depth <= 0 else
                                ["stat", "dot", "cos", "norm", "red", "chunk", "soft", "group", "arith", "where"]))
    if kind == "stat":
        name = draw(st.sampled_from(["attn_sum", "attn_last", "key_norm", "age"]))
        return lambda s: getattr(s, name)
    if kind == "dot":
        a = draw(st.sampled_from(["key", "value"]))
        b = draw(st.sampled_from(["key", "value", "query_mean"]))
        return lambda s: vt.dot(getattr(s, a), getattr(s, b))
    if kind == "cos":
        return lambda s: vt.cosine(s.key, vt.token_mean(s.value) * 2.0 - s.query_mean)
    if kind == "norm":
        return lambda s: vt.norm(s.key - vt.token_mean(s.key)) * s.head + s.layer
    if kind == "group":
        return lambda s: vt.group_mean(vt.dot(s.key, s.query_mean_future) + vt.quad(s.query_cov_future, s.value))
    x = _token(draw, depth - 1)
    if kind == "red":
        red = draw(st.sampled_from([vt.token_mean, vt.token_max, vt.token_std, vt.token_sum]))
        return lambda s: x(s) - red(x(s))
    if kind == "chunk":
        size = draw(st.sampled_from([1, 3, 8]))
        op = draw(st.sampled_from([vt.chunk_mean, vt.chunk_max]))
        return lambda s: op(x(s), size)
    if kind == "soft":
        return lambda s: vt.softmax(x(s))
    y = _token(draw, depth - 1)
    if kind == "where":
        return lambda s: vt.where(x(s) > y(s), x(s), vt.max_pool(y(s), 3))
    op = draw(st.sampled_from(["add", "mul", "div", "max"]))
    f = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b, "max": vt.maximum}[op]
    return lambda s: f(x(s), y(s))


@st.composite
def generated_policies(draw):  # type: ignore[no-untyped-def]
    body = _token(draw, draw(st.integers(0, 2)))
    gran = draw(st.sampled_from(["head", "request"]))
    protect = draw(st.sampled_from([[], [vt.sinks(2)], [vt.protect_if(lambda s: vt.dot(s.key, s.query_mean) > 0.5)],
                                    [vt.protect_if(lambda s: s.attn_sum >= vt.token_max(s.attn_sum))]]))
    return vt.policy(budget=vt.Budget(ratio=0.5), protect=protect, granularity=gran, name="gen")(body)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(policy=generated_policies(), spec=batch_specs(max_b=2, max_layers=2, max_heads=2, max_n=20, max_head_dim=3,
                                                      max_groups=2))
def test_generated_expressions_bit_identical(policy, spec) -> None:
    _check(policy, build_batch(spec), tp=TritonPolicy(policy))


# --------------------------------------------------------------------------- long rows, the validator


@pytest.mark.parametrize("name", ["keydiff", "attn_zscore", "chunkkv"])
def test_rows_over_several_lane_tiles_and_the_tiled_select(name: str) -> None:
    """N > TOKEN_LANES (the token reductions loop over several tiles of lanes) with the multi-pass select."""
    policy = _build((name, {}))
    spec = BatchSpec(2, 1, 2, 700, (700, 533), (0, 40), "continuous", 9, True, ((0, 100, 108),), (301, 17), 3, 2)
    batch = build_batch(spec)
    _check(policy, batch, tp=_tp(policy, max_single=0, tile=256), scores=False)
    _check(policy, batch)


def test_head_and_random_follow_the_head_offset_as_in_torch() -> None:
    """``StatsBatch.head_offset`` (a tensor-parallel rank's first KV head) reaches the kernel: ``s.head`` and
    ``s.random`` and the keep mask are bit-identical to the torch backend's with an offset."""
    pol = vt.policy(budget=vt.Budget(ratio=0.5), granularity="head", name="head_random")(
        lambda s: s.head * 10.0 + s.random + s.attn_sum)
    batch = build_batch(FIXED[0])
    shifted = StatsBatch(**{**{f: getattr(batch, f) for f in StatsBatch.__dataclass_fields__}, "head_offset": 5})
    _check(pol, shifted, tp=TritonPolicy(pol))
    assert not torch.equal(TorchPolicy(pol).scores(shifted), TorchPolicy(pol).scores(batch))


def test_validator_runs_the_backend_check_under_the_interpreter() -> None:
    report = check_policy(_build(("keydiff", {"granularity": "request"})), examples=5, checks=("backend_equal",))
    assert [r.status for r in report.results] == ["pass"], report.summary()


def test_generated_source_has_row_value_pre_passes() -> None:
    tp = _tp(_build(("attn_zscore", {})))
    src = tp.source
    assert "def rowval_kernel_0" in src and "tl.split(" in src and "def _exp(x):" in src
    assert len(tp.generated.reductions) >= 4 and tp.generated.rv_size(4, 2) == len(tp.generated.reductions)
    kd = _tp(_build(("keydiff", {}))).generated
    assert kd.reductions == (("D",),) and kd.rv_size(7, 3) == 7 and kd.vectors == ("key",)


# --------------------------------------------------------------------------- AOT (last: joins the background job)


def test_aot_compile_sm90_without_spills(aot_job) -> None:
    out, err = aot_job.communicate(timeout=600)
    assert aot_job.returncode == 0, err
    report = json.loads(out)
    names = {k["kernel"] for k in report["kernels"]}
    for pol in POLICIES:
        assert {f"{pol}.pin_count", f"{pol}.select[single]", f"{pol}.select[tiled]"} <= names, pol
    assert {"keydiff.rowval[0]", "expected_attention.rowval[1]"} <= names
    assert report["spilling"] == [], report["spilling"]
    assert all(k["registers"] > 0 and k["arch"] == "sm_90a" for k in report["kernels"])
    # every CASES policy that reads vectors is AOT-compiled here or, if shipped, by tests/triton/test_aot.py
    import vtoken_policies

    assert {c[0] for c in CASES if build(c).vector_reads} <= set(POLICIES) | set(vtoken_policies.names())
    assert len(NEW_CASES) == 8
