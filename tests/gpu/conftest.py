"""The GPU checks' set-up and report (see ``tests/gpu/__init__.py`` for the checks and how to run them).

Set-up happens here, at import, before any test module imports numpy, torch or triton: the plain-tree
set-up of :mod:`tests.gpu.tree_setup` (wheels, package aliases) and, for a smoke run on CPU,
``TRITON_INTERPRET=1``. Settings come from the environment (``scripts/gpu_check.sh`` sets them):

    VTOKEN_GPU_SMOKE=1          tiny shapes; on CPU under the Triton interpreter (a CUDA device is used if present)
    VTOKEN_GPU_DEVICE=auto      auto | cuda (no CUDA: every check errors) | cpu (CPU even where CUDA is present)
    VTOKEN_GPU_JSON=PATH        write the report (one JSON document) there
    VTOKEN_GPU_WHEELS=DIR       folder of *.whl for missing dependencies (see tree_setup)
    VTOKEN_GPU_ROUNDS=5         A/B rounds of the decode timing (>= 3)
    VTOKEN_GPU_SEED=0

Without CUDA and without ``VTOKEN_GPU_SMOKE=1`` every check is SKIPPED (with the reason), never passed.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .tree_setup import setup_environment

SMOKE = os.environ.get("VTOKEN_GPU_SMOKE", "0") == "1"
SETUP = setup_environment(SMOKE, os.environ.get("VTOKEN_GPU_DEVICE", "auto"),
                          Path(os.environ["VTOKEN_GPU_WHEELS"]) if os.environ.get("VTOKEN_GPU_WHEELS") else None)
GOAL_CHECKS = ("kernels", "decode_overhead")  # checks whose performance goals the report carries
REPORT: dict[str, Any] = {"checks": {}, "tests": {}, "t0": time.perf_counter()}


@pytest.fixture(scope="session")
def ctx() -> Any:
    """The checks' :class:`~tests.gpu.gpu_context.CheckContext`; skips every check without CUDA (unless
    smoke), errors on a set-up that cannot run them."""
    if "error" in SETUP:
        pytest.fail(f"GPU check set-up: {SETUP['error']}", pytrace=False)
    if "skip" in SETUP:
        pytest.skip(SETUP["skip"])
    import torch

    from .gpu_context import CheckContext

    rounds = max(3, int(os.environ.get("VTOKEN_GPU_ROUNDS", "5")))
    return CheckContext(torch.device(SETUP["device"]), SMOKE, int(os.environ.get("VTOKEN_GPU_SEED", "0")), rounds)


@pytest.fixture(scope="session")
def record() -> Callable[[str, dict[str, Any]], None]:
    """``record(check, result)``: the result goes into the report's ``checks`` (a list per check)."""
    def add(check: str, result: dict[str, Any]) -> None:
        REPORT["checks"].setdefault(check, []).append(result)

    return add


@pytest.fixture(autouse=True)
def _reset_cuda_state() -> Any:
    """After every check: sync-debug mode back to default, pending work finished, cached memory freed."""
    yield
    if SETUP.get("device") == "cuda":
        import contextlib

        import torch

        torch.cuda.set_sync_debug_mode("default")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's outcome: a failure in any phase wins, then a skip or error at set-up, then the call's."""
    if report.outcome == "failed":
        REPORT["tests"][report.nodeid] = "failed"
    elif report.when == "call" or report.outcome != "passed":
        REPORT["tests"].setdefault(report.nodeid, report.outcome)


def _clean(x: Any) -> Any:
    """JSON-safe: numpy/torch scalars to Python, non-finite floats to strings."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    import numpy as np
    import torch

    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, torch.Tensor):
        x = x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def report() -> dict[str, Any]:
    """The report: versions, set-up, every check's measured results, goals, and each test's outcome."""
    doc: dict[str, Any] = {"python": platform.python_version(), "smoke": SMOKE, "setup": SETUP}
    if "skip" not in SETUP and "error" not in SETUP:
        import torch
        import triton

        cuda = SETUP["device"] == "cuda"
        doc.update(device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)", torch=torch.__version__,
                   triton=triton.__version__, cuda=torch.version.cuda)
    checks = REPORT["checks"]
    doc["checks"] = checks
    doc["goals"] = {k: all(r.get("goal_met") for r in checks[k]) for k in GOAL_CHECKS if k in checks}
    doc["goals_meaningful"] = SETUP.get("device") == "cuda" and not SMOKE and not SETUP.get("triton_interpret")
    outcomes = list(REPORT["tests"].values())
    doc["tests"] = REPORT["tests"]
    doc.update({k: outcomes.count(k) for k in ("passed", "failed", "skipped")})
    doc["seconds"] = time.perf_counter() - REPORT["t0"]
    return _clean(doc)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("VTOKEN_GPU_JSON")
    if path and REPORT["tests"]:
        import json

        Path(path).write_text(json.dumps(report(), indent=1) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT["tests"]:
        return
    doc = report()
    tr = terminalreporter
    tr.section("GPU checks")
    tr.write_line(f"device: {doc.get('device', SETUP.get('device'))}, smoke: {SMOKE}, "
                  f"triton interpreter: {SETUP.get('triton_interpret')}")
    tr.write_line(f"{doc['passed']} passed, {doc['failed']} failed, {doc['skipped']} skipped")
    for name, met in doc["goals"].items():
        tr.write_line(f"goal {name}: {'met' if met else 'NOT met'}"
                      f"{'' if doc['goals_meaningful'] else ' (not meaningful: smoke or interpreter run)'}")
    if os.environ.get("VTOKEN_GPU_JSON"):
        tr.write_line(f"report: {os.environ['VTOKEN_GPU_JSON']}")
