"""Backend selection (``vtoken_sdk.backend``): the environment variable and where compiled state lives.

The Triton side of the compile cache (kernels generated once per policy, a dropped policy dropped with
its entry) is tested in ``tests/triton/test_policy_kernels.py``."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest

import vtoken_sdk as vt
from vtoken_sdk.backend import default_backend
from vtoken_sdk.torch_backend import TorchPolicy

# what a Policy holds: its definition and what tracing it found, nothing a backend produced
DESCRIPTION = {"fn", "spec", "kind", "file", "line", "doc", "_declared_reads", "node", "reads", "stored_reads",
               "vector_reads"}


def _policy() -> vt.Policy:
    @vt.policy(budget=vt.Budget(ratio=0.5), granularity="head")
    def by_norm(s: vt.TokenStats):
        return -s.key_norm

    return by_norm


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("VTOKEN_BACKEND", raising=False)
    monkeypatch.delenv("VTOKEN_POLICY_BACKEND", raising=False)
    return monkeypatch


def test_policy_backend_variable_selects_and_is_checked(clean_env: pytest.MonkeyPatch) -> None:
    assert default_backend() == "torch" and default_backend("cpu") == "torch"
    clean_env.setenv("VTOKEN_POLICY_BACKEND", "triton")
    assert default_backend("cpu") == "triton"
    clean_env.setenv("VTOKEN_POLICY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="VTOKEN_POLICY_BACKEND='cuda', expected 'torch' or 'triton'"):
        default_backend()


def test_the_old_variable_name_is_refused_with_the_new_one(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VTOKEN_BACKEND", "torch")
    with pytest.raises(ValueError, match="VTOKEN_BACKEND was renamed to VTOKEN_POLICY_BACKEND"):
        _policy().compile()
    clean_env.setenv("VTOKEN_POLICY_BACKEND", "torch")  # set both: still refused, the old one is a mistake
    with pytest.raises(ValueError, match="renamed to VTOKEN_POLICY_BACKEND"):
        default_backend()


def test_compiling_leaves_the_policy_a_plain_description(clean_env: pytest.MonkeyPatch) -> None:
    """Nothing is written onto the policy, and no compiled form keeps a dropped policy alive."""
    policy = _policy()
    assert set(vars(policy)) == DESCRIPTION
    before = {k: copy.copy(v) for k, v in vars(policy).items()}  # copies: a cache dict filled later differs
    compiled = vt.compile_policy(policy, "torch")
    assert isinstance(compiled, TorchPolicy) and compiled.policy is policy
    assert vars(policy) == before
    dropped = weakref.ref(policy)
    del policy, compiled
    gc.collect()
    assert dropped() is None
