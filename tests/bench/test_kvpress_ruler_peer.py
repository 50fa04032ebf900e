"""``benchmarks/kvpress_ruler_peer.py`` (kvpress's own pipeline on RULER samples), run as a subprocess
with the peer venv (``.venv-kvpress``, ``make kvpress``): ``--list``, the token-id check (exit 3, one
line), and PyramidKVPress through the attention-mask workaround on a ~400-token passkey sample (its
per-layer budgets leave cache layers of different lengths; without the workaround the question forward
fails in transformers 5.2).  ~30 s on one core."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import vtoken_bench
from vtoken_bench.kvpress_check import PEER_PY

SCRIPT = Path(vtoken_bench.__file__).resolve().parent / "kvpress_ruler_peer.py"
REQUIRED = ("none", "knorm", "streaming_llm", "snapkv", "tova", "observed_attention", "keydiff",
            "expected_attention", "chunkkv", "cur", "lagkv", "ada_expected_attention", "ada_snapkv",
            "pyramidkv", "critical_ada_expected_attention")
KEY = "passkey/0"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not PEER_PY.exists(), reason=f"{PEER_PY} missing: run `make kvpress`")]


def _peer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([str(PEER_PY), str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from vtoken_bench.models import smollm2_path

    try:
        return smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 checkpoint unavailable: {e}")


@pytest.fixture(scope="module")
def sample(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A ~400-token passkey sample, with the ids kvpress's preprocess gives (``--dump-ids``)."""
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    context = filler * 9 + "The special magic number for quiet-lake is: 4817263. " + filler * 9
    s = {"key": KEY, "context": context,
         "question": "What is the special magic number for quiet-lake mentioned in the provided text? ",
         "answer_prefix": "The special magic number for quiet-lake mentioned in the provided text is",
         "max_new_tokens": 8, "context_ids": [], "question_ids": []}
    d = tmp_path_factory.mktemp("kvpress_ruler_peer")
    (d / "s.json").write_text(json.dumps([s]))
    r = _peer("--model-dir", str(model_dir), "--samples", str(d / "s.json"),
              "--dump-ids", str(d / "ids.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    ids = json.loads((d / "ids.json").read_text())[KEY]
    assert 350 < len(ids["context_ids"]) < 500 and ids["question_ids"], {k: len(v) for k, v in ids.items()}
    return {**s, **ids}


def test_list_names_the_methods_and_the_unavailable_presses() -> None:
    r = _peer("--list", timeout=60)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(REQUIRED) <= set(d["methods"])
    assert {"duo_attention", "qfilter"} <= set(d["unavailable"])
    assert not set(d["methods"]) & set(d["unavailable"])
    assert all(isinstance(why, str) and why for why in d["unavailable"].values())


def test_mismatched_ids_exit_3_with_one_line(sample: dict, model_dir: Path, tmp_path: Path) -> None:
    bad = {**sample, "question_ids": [*sample["question_ids"][:5], sample["question_ids"][5] + 1,
                                      *sample["question_ids"][6:]]}
    (tmp_path / "s.json").write_text(json.dumps([bad]))
    out = tmp_path / "out.jsonl"
    r = _peer("--model-dir", str(model_dir), "--samples", str(tmp_path / "s.json"), "--out", str(out),
              "--methods", "none,knorm", "--ratios", "0.5")
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if "mismatch" in ln]
    assert len(lines) == 1, r.stderr
    assert KEY in lines[0] and "question_ids" in lines[0] and "first_diff_at=5" in lines[0], lines[0]
    n = len(sample["question_ids"])
    assert f"kvpress_len={n}" in lines[0] and f"sample_len={n}" in lines[0], lines[0]
    assert not out.exists() or not out.read_text().strip()  # nothing ran


def test_pyramidkv_runs_through_the_mask_workaround(sample: dict, model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps([sample]))
    base = ["--model-dir", str(model_dir), "--samples", str(tmp_path / "s.json"), "--methods", "pyramidkv",
            "--ratios", "0.5"]
    r = _peer(*base, "--out", str(tmp_path / "out.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["key"] == KEY and rows[0]["method"] == "pyramidkv", rows
    assert rows[0]["ratio"] == 0.5 and rows[0]["answer"].strip() and rows[0]["seconds"] > 0, rows
    # the cache layers had different lengths, so masks were fitted (one per layer but layer 0)
    progress = [ln for ln in r.stdout.splitlines() if "pyramidkv" in ln]
    assert len(progress) == 1 and "mask fixes 0)" not in progress[0], r.stdout
    # resumable: a second run finds the configuration done
    again = _peer(*base, "--out", str(tmp_path / "out.jsonl"))
    assert again.returncode == 0 and "done already" in again.stdout, again.stdout + again.stderr[-2000:]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1
    # without the workaround transformers 5.2 fails on the question forward (the bug it works around)
    broken = _peer(*base, "--out", str(tmp_path / "broken.jsonl"), "--no-mask-fix")
    assert broken.returncode == 4 and "must match the size of tensor" in broken.stderr, broken.stderr[-3000:]
