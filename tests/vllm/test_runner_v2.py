"""Model Runner V2's input preparation with vToken's step rewrite (issue 40), checked on CPU.

``python -m vtoken_bench.v2_inputs_check`` runs V2's real ``GPUModelRunner`` methods (request states, staged
block tables, ``prepare_inputs``, ``prepare_attn``) with :class:`~vtoken_runtime.vllm_plugin.runner_v2.
VTokenV2InputsMixin`, V2's Triton kernels under the interpreter, over several steps with evictions, truncated
lists from the scheduler, a finished request's blocks handed to a new one and a request starting with a
prefix-cache hit. Its own process: the interpreter
must be set before any Triton kernel module is imported. Each mutation removes one part of the rewrite and must
be caught.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vtoken_runtime.vllm_plugin.runner_v2 import V2StepRewrite  # noqa: E402

pytestmark = pytest.mark.vllm


def _check(*args: str) -> tuple[int, dict]:
    res = subprocess.run([sys.executable, "-m", "vtoken_bench.v2_inputs_check", *args], capture_output=True,
                         text=True, timeout=600)
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-2000:]
    return res.returncode, json.loads(lines[-1])


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_v2s_input_preparation_carries_the_rewrite_through_evictions(layout: str) -> None:
    rc, got = _check("--layout", layout)
    assert rc == 0 and got["pass"], got
    c = got["checks"]
    assert c["steps"] == 16 and c["evictions"] > 10 and c["rows_sent"] > 0 and c["reused_blocks"] > 0
    assert c["prefix_hit_tokens"] == 16  # e starts on p's cached block, in place
    assert c["attention_rows"] > 500 and c["max_abs_err"] < 1e-4
    assert c["sampled"] > 30  # requests past their prompt each sampled one token per step
    assert got["interpreted"] == (not torch.cuda.is_available())


@pytest.mark.parametrize(("mutation", "caught"), [
    ("no-restore", "sampled"),  # cache lengths reach V2's sampler: evicted requests "still in prefill"
    ("no-rows", "block table"),
    ("no-slots", "slot mapping"),
])
def test_each_part_of_the_v2_rewrite_is_needed(mutation: str, caught: str) -> None:
    rc, got = _check("--mutate", mutation, "--steps", "6")
    assert rc == 1 and not got["pass"]
    assert any(caught in f for f in got["failures"]), got


def test_v2_rewrite_refuses_several_groups_unknown_rows_and_resumed_lists() -> None:
    with pytest.raises(ValueError, match="KV-cache groups"):
        V2StepRewrite(None, None, lambda r: None, 4, torch.device("cpu"), num_groups=2)
    rw = V2StepRewrite(None, None, lambda r: None, 4, torch.device("cpu"))
    so = SimpleNamespace(vtoken_rows={"x": [1, 2]},
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))
    with pytest.raises(RuntimeError, match="unknown to the runner"):
        rw.update(so, None, {})
    rw.rows["y"] = [3]
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=["y"], new_block_ids=[([3, 4],)],
                                                               resumed_req_ids={"y"}))
    with pytest.raises(RuntimeError, match="resumed"):  # V2's scheduler sends resumed requests as new ones
        rw.update(so, None, {"y": 0})
    assert rw.rows["y"] == [3]
