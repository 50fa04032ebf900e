"""The copy engine's Triton runner (its CUDA path, forced onto CPU tensors under TRITON_INTERPRET=1) is
byte-identical to the torch path, and the GPU checks (``tests/gpu``) run the way a user runs them:
``scripts/gpu_check.sh --smoke`` runs every check tiny on CPU (the CUDA-only parts show as skipped), without
``--smoke`` and without CUDA every check is skipped (none passes), and ``python -S -m pytest tests/gpu`` runs
from the plain tree with only torch, numpy, triton and pytest importable (package aliases + pydantic from
wheel files, as on the GPU machine)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from vtoken_runtime.cache import VTokenCache
from vtoken_runtime.copy_engine import CopyEngine, CopyPlan
from vtoken_runtime.planner import plan_compact, plan_ordered

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/gpu_check.sh"
TESTS = "tests/gpu/test_gpu_path.py::"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# item 6 (per-row pages through vLLM's Triton kernels) needs vLLM: it runs here with it, and skips without
ROW_PAGES = {f"{TESTS}test_row_pages_through_vllms_triton_backend[{m}]" for m in ("kernels", "cache")}
CHECKS = {"copy_layouts", "async_steps", "cuda_graph", "kernels", "decode_overhead"} | (
    {"row_pages_kernels", "row_pages_cache"} if HAS_VLLM else set())
CUDA_ONLY = {f"{TESTS}test_copy_engine_never_synchronises_the_host[{p}]" for p in ("compact-head", "ordered-request")
             } | {f"{TESTS}test_cuda_graph_replays_over_evictions"}
SKIPPED_HERE = CUDA_ONLY | (set() if HAS_VLLM else ROW_PAGES)


# ---------------------------------------------------------------- the engine's Triton runner
def _cache(runner: str, planner: str, layout: str, granularity: str, async_copy: bool, dtype: torch.dtype
           ) -> VTokenCache:
    c = VTokenCache(2, 3, 4, 4, 10, granularity=granularity, kv_layout=layout, stat_names=("a", "b"),
                    async_copy=async_copy, dtype=dtype)
    c.engine.gpu_runner = runner
    c.engine.planner_mode = planner if runner == "triton" else "ordered"
    g = torch.Generator().manual_seed(0)
    for t in c.kv_caches:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))  # NaN payloads too
    for t in c.store.stats.values():
        t.copy_(torch.randn(t.shape, generator=g))
    c.store.positions.copy_(torch.randint(-1, 1000, c.store.positions.shape, generator=g))
    return c


def _state(c: VTokenCache) -> list[bytes]:
    out = [t.view(torch.uint8).numpy().tobytes() for t in c.kv_caches]
    out += [t.numpy().tobytes() for t in c.store.stats.values()]
    return out + [c.store.positions.numpy().tobytes()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("async_copy", [False, True])
@pytest.mark.parametrize("planner", ["compact", "ordered"])
@pytest.mark.parametrize("layout", ["generic", "vllm_cpu"])
@pytest.mark.parametrize("granularity", ["request", "head"])
def test_triton_runner_byte_identical_to_torch_path(granularity: str, layout: str, planner: str, async_copy: bool,
                                                    dtype: torch.dtype) -> None:
    ref = _cache("torch", planner, layout, granularity, async_copy, dtype)
    new = _cache("triton", planner, layout, granularity, async_copy, dtype)
    assert _state(ref) == _state(new)
    rng = np.random.default_rng(1)
    R, U, n = ref.num_rows, 16, 7
    live = np.zeros((R, U), bool)
    for r in range(R):
        live[r, rng.choice(U, n, replace=False)] = True
    rows, src, dst = (plan_ordered if planner == "ordered" else plan_compact)(live, n)
    blocks = np.array([7, 2, 9, 4])
    plan = CopyPlan(rows, blocks[src // 4] * 4 + src % 4, blocks[dst // 4] * 4 + dst % 4)
    before = _state(ref)
    scratch = []
    for _ in range(2):  # the second plan reuses the scratch buffers
        for c in (ref, new):
            c.engine.submit(plan)
            c.fence()
        assert _state(ref) == _state(new)
        scratch.append({k: t.data_ptr() for k, t in new.engine._scratch.items()})
    assert _state(ref) != before
    assert set(new.engine.jobs_run) == {"triton"} and "triton" not in ref.engine.jobs_run
    # ordered: one scratch per element size (K/V, float32 stats, int64 positions), reused across jobs and plans
    assert scratch[0] == scratch[1] and len(scratch[0]) == (0 if planner == "compact" else len(
        {t.element_size() for t in (new.kv_caches[0], new.store.positions, *new.store.stats.values())}))


def test_gpu_runner_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _cache("torch", "ordered", "vllm_cpu", "head", False, torch.float32)
    with pytest.raises(ValueError, match="gpu_runner"):
        CopyEngine(c.kv_caches, "vllm_cpu", 3, 4, 4, 10, c.store, per_head=True, gpu_runner="cuda")
    with pytest.raises(ValueError, match="planner_mode"):
        CopyEngine(c.kv_caches, "vllm_cpu", 3, 4, 4, 10, c.store, per_head=True, planner_mode="naive")
    monkeypatch.setenv("VTOKEN_GPU_COPY", "triton")
    assert CopyEngine(c.kv_caches, "vllm_cpu", 3, 4, 4, 10, c.store, per_head=True).gpu_runner == "triton"
    c.engine.gpu_runner = "auto"  # CPU tensors: "auto" never takes the kernel
    plan = CopyPlan(np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64))
    c.engine.submit(plan)
    assert "triton" not in c.engine.jobs_run
    c.engine.gpu_runner = "triton"  # forced onto CPU tensors: only under the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        c.engine.submit(plan)


# ---------------------------------------------------------------- tests/gpu, run as on the GPU machine
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")
           and not k.startswith("VTOKEN_GPU_")}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], report: Path) -> dict:
    """Runs the checks; returns the JSON report (``report``), which must agree with pytest's exit code."""
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout[-5000:]}\nstderr:\n{p.stderr[-3000:]}"
    doc = json.loads(report.read_text())
    assert doc["failed"] == 0 and doc["passed"] + doc["skipped"] == len(doc["tests"])
    return doc


def test_smoke_run_passes_every_check_and_skips_the_cuda_only_parts(tmp_path: Path) -> None:
    """``scripts/gpu_check.sh --smoke --json PATH`` from the repository root (no PYTHONPATH, no
    TRITON_INTERPRET: the set-up sets the interpreter flag itself)."""
    out = tmp_path / "gpu_check.json"
    doc = _run(["bash", SCRIPT, "--smoke", "--json", str(out)], _env(), out)
    assert doc["smoke"] is True and doc["setup"]["triton_interpret"] is True and doc["setup"]["device"] == "cpu"
    assert set(doc["checks"]) == CHECKS
    assert {t for t, o in doc["tests"].items() if o == "skipped"} == SKIPPED_HERE
    assert doc["passed"] == len(doc["tests"]) - len(SKIPPED_HERE) >= 13
    for m in ("kernels", "cache") if HAS_VLLM else ():
        (rp,) = doc["checks"][f"row_pages_{m}"]
        assert rp["pass"] and rp["interpreted"] and rp["max_abs_err"] < 1e-4
    cl = doc["checks"]["copy_layouts"]
    assert {(c["layout"], c["planner"], c["granularity"]) for c in cl} == {
        (lay, p, g) for lay in ("LBNHC", "LBHNC") for p in ("compact", "ordered") for g in ("request", "head")}
    assert all(c["jobs_by_runner"].keys() == {"triton"} and c["moves"] > 0 and c["pass"] for c in cl)
    for run in doc["checks"]["async_steps"]:
        assert run["steps"] == 100 and run["tokens_moved"] > 0 and run["reused_while_copy_in_flight"] > 0
        assert run["A_jobs_by_runner"].keys() == {"triton"} and run["sync_debug"] == {"skipped": "no CUDA"}
    (cg,) = doc["checks"]["cuda_graph"]
    assert cg["skipped"] == "no CUDA" and not cg["captured"] and cg["steps"] == 50 and cg["data_ptrs_unchanged"]
    assert cg["blocks_freed"] > 0
    (kern,) = doc["checks"]["kernels"]
    assert {r["kernel"] for r in kern["rows"]} >= {"select[single]", "select[tiled]", "repack[compact]",
                                                   "attn_stats[decode]"}
    (dec,) = doc["checks"]["decode_overhead"]
    assert dec["held_blocks"]["h2o_after_eviction"] < dec["held_blocks"]["no_eviction"]
    assert dec["overhead_ratio"]["n"] >= 3 and dec["repack_moves_kv_stats_positions_together"] is True
    assert doc["goals_meaningful"] is False


def test_without_cuda_every_check_is_skipped_never_passed(tmp_path: Path) -> None:
    """No ``--smoke`` on a machine without CUDA: every test SKIPPED with the reason, nothing measured."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the checks would run")
    out = tmp_path / "gpu_check.json"
    doc = _run(["bash", SCRIPT, "--json", str(out)], _env(), out)
    assert doc["passed"] == 0 and doc["skipped"] == len(doc["tests"]) >= 16 and doc["checks"] == {}
    assert doc["setup"]["skip"].startswith("no CUDA device")


def _make_wheel(dist: str, folder: Path) -> str:
    """A wheel of an installed distribution, zipped from its installed files (pure -> py3-none-any,
    compiled -> this interpreter's tag)."""
    d = importlib.metadata.distribution(dist)
    files = [f for f in d.files or [] if "__pycache__" not in f.parts and not str(f).startswith("..")]
    compiled = any(str(f).endswith((".so", ".pyd")) for f in files)
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    tag = f"{py}-{py}-linux_{platform.machine()}" if compiled else "py3-none-any"
    name = f"{d.metadata['Name'].replace('-', '_')}-{d.version}-{tag}.whl"
    with zipfile.ZipFile(folder / name, "w") as zf:
        for f in files:
            zf.write(f.locate(), str(f))
    return name


def test_runs_from_the_plain_tree_with_wheels(tmp_path: Path) -> None:
    """As on the GPU machine: only torch, numpy, triton and pytest importable (``python -S`` + a folder with
    just those), no vtoken install, no pydantic. The set-up aliases the tree's packages under their installed
    names and takes pydantic (compiled core: extracted) and its deps from ``VTOKEN_GPU_WHEELS``."""
    if sys.platform != "linux":
        pytest.skip("wheel tags built here are linux ones")
    site_dir = Path(torch.__file__).resolve().parents[1]
    only = tmp_path / "site"
    only.mkdir()
    for name in ("torch", "torchgen", "numpy", "numpy.libs", "triton", "typing_extensions.py", "sympy", "mpmath",
                 "networkx", "jinja2", "markupsafe", "fsspec", "filelock", "pytest", "_pytest", "pluggy", "iniconfig",
                 "packaging", "py.py", "pygments"):
        if (site_dir / name).exists():
            (only / name).symlink_to(site_dir / name)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    made = [_make_wheel(d, wheels) for d in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")
            if importlib.util.find_spec(d.replace("-", "_")) is not None]
    assert any(m.startswith("pydantic_core-") and "none-any" not in m for m in made)
    out = tmp_path / "gpu_check.json"
    doc = _run([sys.executable, "-S", "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/gpu", "-k",
                "byte_exact_on_vllm_layouts or kernels_match"],
               _env(PYTHONPATH=str(only), TMPDIR=str(tmp_path), VTOKEN_GPU_SMOKE="1", VTOKEN_GPU_WHEELS=str(wheels),
                    VTOKEN_GPU_JSON=str(out)), out)
    setup = doc["setup"]
    assert setup["packages"] == {"vtoken_sdk": "this tree, on sys.path", "vtoken_runtime": "alias of runtime/",
                                 "vtoken_policies": "alias of policies/", "vtoken_bench": "alias of benchmarks/"}
    used = {w["wheel"].split("-")[0]: w for w in setup["wheels"] if w["used"]}
    assert used["pydantic"]["how"] == "zip on sys.path" and used["pydantic_core"]["how"].startswith("extracted")
    assert str(wheels) in setup["modules"]["pydantic"] and str(tmp_path) in setup["modules"]["pydantic_core"]
    assert setup["modules"]["numba"].startswith("MISSING")
    assert set(doc["checks"]) == {"copy_layouts", "kernels"} and doc["passed"] == len(doc["tests"]) == 9
