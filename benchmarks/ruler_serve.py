"""RULER through the serving path: RULER's own OpenAI-compatible client against ``vtoken-cli serve``, checked
against the in-process path on the same samples, policy and budget.

What runs:

* **samples**: :func:`vtoken_bench.ruler_tasks.generate_ruler` (the package's own generators, RULER's ``base``
  template) writes ``<work_dir>/gen/data/<task>/validation.jsonl``, the files RULER's client reads
  (``--data_dir <work_dir>/gen/data``).
* **server**: ``vtoken-cli serve MODEL --policy P --eviction-ratio R --dtype float32`` (a subprocess in its own
  process group, :class:`vtoken_bench.serve_soak.Server`), started first, so that it boots while the samples are
  generated and the in-process path runs.
* **client**: ``long_context_eval/pred/call_api.py`` from ``nvidia-long-context-eval`` 26.3, run unchanged as a
  script (:func:`call_api_command`: ``--server_type generic_oai_server --generic_oai_server_mode completion
  --temperature 0 --threads 1``, the served model name = the model path). Its ``GenericOAIURLClient`` posts
  ``{"prompt": <the generator's input>, "temperature": 0.0, "top_p": 1.0, "stop": [], "model": ...,
  "max_tokens": <the task's tokens_to_generate>, "seed": 0}`` to ``/v1/completions``: ``top_k`` (32 by
  default) is held by the client and never sent; temperature 0 is vLLM's greedy sampling (the seed is then
  unused); no stop string, so a request ends at EOS (SmolLM2: ``<|im_end|>``, id 2, the tokenizer's and the
  generation config's) or after ``max_tokens``. :func:`client_body` builds that body with the package's own
  class. It writes ``<work_dir>/pred/<task>.jsonl`` with ``pred``.
* **scores**: the package's scorer (:func:`vtoken_bench.ruler_tasks.score_ruler`: ``postprocess_pred`` +
  the task's ``string_match_all`` / ``string_match_part``), for both sides.

The protocol the server applies (``runtime/vllm_plugin``, ``docs/vllm.md``), replicated in process:

1. **The whole prompt** (context + question + answer prefix: RULER's ``input``) is one completion prompt,
   tokenized by vLLM with ``add_special_tokens=True``; SmolLM2's tokenizer adds no BOS. The in-process ids
   are the same call of the same tokenizer, and are checked against the server's ``/tokenize`` per sample.
   The prompt (< 2048 tokens at 2K) is prefilled in one step (vLLM's CPU ``max_num_batched_tokens`` 2048).
2. **No eviction inside the prompt** (the budget's ``when`` is ``both``, not ``chunks``). The step that completes
   the prompt samples the first token from the full cache's logits, then evicts (phase ``prefill``) down to
   ``budget = floor((1 - r) * L + 0.5)`` of the ``L`` prompt tokens, the policy's protections (StreamingLLM: 4
   sinks) kept.
3. **Decode**: after every decode step (phase ``decode``) with the serving default ``slack="block"``: a request
   whose ``live`` tokens exceed ``budget(L + k)`` is trimmed to it when its last block is full or it holds more
   blocks than the budget needs (block size: passed to the server as ``--block-size``, default 128, vLLM's own
   CPU default, and checked against the worker's start-up line). The token sampled at a step comes from logits computed before that step's
   eviction; the last token is never fed back.

The in-process side uses the very policy object the server's worker builds
(``PluginConfig(policy, eviction_ratio=r).load_policy()``: the budget with the serving slack), an
:class:`~vtoken_runtime.hf_adapter.HFSession` with the server's block size, the policy's granularity and compact
mode, ``prefill`` (the whole prompt in one forward, then ``evict("prefill")``), greedy ``decode`` steps
(each followed by ``evict("decode")``) until EOS or ``max_tokens``, the text decoded with
``skip_special_tokens`` (vLLM's detokenizer drops the EOS). Per task the server's eviction counters
(``/metrics`` deltas around the client's run: ``vtoken_evictions_total``, ``vtoken_tokens_evicted_total``,
``vtoken_tokens_moved_total``) are compared with the in-process driver's: equal evictions and evicted
row-tokens mean the same phases and budgets; equal moves mean (compact mode, same initial layout) the same
kept sets.

**Differences**, sample by sample: the client's request is sent again with ``logprobs: 20`` and
``return_tokens_as_token_ids`` (greedy: the same tokens; checked), giving the server's tokens and its top-20
log-probabilities (vLLM's raw log-softmax: a gap between two tokens' logprobs is their logit gap). At the
first differing token the report gives both candidates and the gap between them on each side (the
in-process gap from its top-20 logits of that step; a candidate outside a side's top 20 gives a bound).
The vLLM CPU kernels (paged attention, its Llama implementation, torch.compile) and the HF model are
different code, so float rounding can flip a greedy token where two candidates nearly tie, and it can move a
float-scored policy's selection at its threshold (KNorm's key norms); StreamingLLM's decisions depend on
positions only.

**Why this is not the kvpress-leaderboard protocol** (:mod:`vtoken_bench.ruler_eval`): there the context is
compressed before the question is seen (query-agnostic: ``prefill(context)``, evict, then the question and
answer prefix are fed uncompressed) and the budget is a fraction of the context only. A server cannot know
where a prompt's question starts: it evicts after prefilling the whole prompt, so the question and answer
prefix are in the cache when the policy scores (query-aware, e.g. SnapKV's observation window is the
question), they can themselves be evicted, and the budget counts them; eviction also continues during decode.
Scores from the two protocols are not comparable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .serve_soak import CLI, Server, _free_port, last_errors, parse_metrics

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_TASKS",
    "call_api_command",
    "call_api_path",
    "client_body",
    "explain_difference",
    "parse_server_protocol",
    "run_ruler_serve",
    "server_command",
]

DEFAULT_TASKS = ("niah_single_1", "qa_1")
DEFAULT_POLICY = "streaming_llm"  # decisions by position only: no float-rounding sensitivity in what is kept
CPU_BLOCK_SIZE = 128  # vLLM's KV block size on CPU when --block-size is not given (vllm/platforms/cpu.py)
TOP_K = 20  # vLLM's default max_logprobs: top candidates kept per step on both sides for the explanations
COUNTERS = ("evictions", "tokens_evicted", "tokens_moved", "blocks_freed")
_POLICY_LINE = re.compile(r"vtoken: (policy=\S+ budget\([^)]*\) granularity=\S+ statistics=.*?); mode=(\S+); "
                          r"KV cache (\d+) blocks x (\d+) tokens")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"[ruler-serve] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the pieces
def call_api_path() -> Path:
    """RULER's client script, ``long_context_eval/pred/call_api.py`` of the installed package."""
    from .ruler_tasks import ruler_package_dir

    path = ruler_package_dir() / "pred" / "call_api.py"
    if not path.is_file():
        raise RuntimeError(f"{path} not found: is nvidia-long-context-eval 26.3 installed?")
    return path


def call_api_command(task: str, data_dir: Path, save_dir: Path, url: str, model_name: str,
                     python: str = sys.executable) -> list[str]:
    """The client's command line: RULER's ``call_api.py`` against an OpenAI-compatible completions URL, greedy,
    one request at a time. It reads ``data_dir/<task>/validation.jsonl`` and writes ``save_dir/<task>.jsonl``."""
    return [python, str(call_api_path()),
            "--server_type", "generic_oai_server", "--generic_oai_server_url", url,
            "--generic_oai_server_mode", "completion", "--model_name_or_path", model_name,
            "--temperature", "0", "--threads", "1",
            "--data_dir", str(data_dir), "--save_dir", str(save_dir), "--task", task]


def client_body(prompt: str, model_name: str, max_tokens: int) -> dict[str, Any]:
    """The JSON body ``call_api.py``'s ``GenericOAIURLClient`` posts for one prompt, built by that class with
    ``call_api.py``'s defaults (temperature 0 as in :func:`call_api_command`): its HTTP call is intercepted."""
    path = call_api_path().parent / "client_wrappers.py"
    spec = importlib.util.spec_from_file_location("_ruler_client_wrappers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    client = mod.GenericOAIURLClient(url="http://unused/v1/completions", mode="completion", model_name=model_name,
                                     temperature=0.0, top_k=32, top_p=1.0, random_seed=0, stop=[],
                                     tokens_to_generate=max_tokens, timeout=300)
    sent: dict[str, Any] = {}

    def capture(data: dict[str, Any]) -> dict[str, Any]:
        sent.update(data)
        return {"choices": [{"text": ""}]}

    client.nv_client.send_request = capture
    client(prompt=prompt)
    return sent


def server_command(model: str, policy: str, ratio: float, port: int, extra: Sequence[str] = ()) -> list[str]:
    """``vtoken-cli serve MODEL --policy P --eviction-ratio R --dtype float32`` on 127.0.0.1:``port``."""
    return [*CLI, "serve", model, "--policy", policy, "--eviction-ratio", str(ratio), "--dtype", "float32",
            "--port", str(port), "--host", "127.0.0.1", *extra]


def parse_server_protocol(log_text: str) -> dict[str, Any]:
    """The worker's start-up line (``vtoken: policy=... budget(...) ...; mode=...; KV cache N blocks x BS
    tokens``) -> ``{"policy_line", "mode", "kv_blocks", "block_size"}``; ValueError when it is missing."""
    m = _POLICY_LINE.search(log_text)
    if m is None:
        raise ValueError("the server's log has no 'vtoken: policy=... KV cache N blocks x BS tokens' line")
    return {"policy_line": m.group(1), "mode": m.group(2), "kv_blocks": int(m.group(3)), "block_size": int(m.group(4))}


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _post(base: str, path: str, body: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
    import httpx

    r = httpx.post(base + path, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _metrics(base: str) -> dict[str, float]:
    import httpx

    return parse_metrics(httpx.get(base + "/metrics", timeout=30).text)


def _server_counters(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(round(after.get(f"vtoken_{k}_total", 0.0) - before.get(f"vtoken_{k}_total", 0.0)))
            for k in COUNTERS}


def run_call_api(server: Server, task: str, data_dir: Path, save_dir: Path, model_name: str, log_path: Path,
                 timeout_s: float) -> dict[int, str]:
    """Run RULER's client for one task against ``server``; ``{sample index: pred}``. The client retries a failed
    request forever (``call_api.py``'s ``get_output``), so it is stopped when the server dies or ``timeout_s``
    passes, and that is a RuntimeError with the tails of both logs."""
    out = save_dir / f"{task}.jsonl"
    out.unlink(missing_ok=True)  # the client skips indices already in its output file
    cmd = call_api_command(task, data_dir, save_dir, server.base + "/v1/completions", model_name)
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=save_dir)
    try:
        while proc.poll() is None:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"the server exited with status {server.proc.poll()}; its last errors:\n"
                       f"{last_errors(server.log)}" if server.proc.poll() is not None else f"timed out after {timeout_s:.0f} s")
                raise RuntimeError(f"call_api.py for {task}: {why}\n--- client log tail ---\n"
                                   f"{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"call_api.py for {task} failed (exit {proc.returncode}); log {log_path}:\n"
                           f"{log_path.read_text(errors='replace')[-2000:]}")
    return {int(r["index"]): r["pred"] for r in map(json.loads, out.read_text().splitlines()) if r}


# ------------------------------------------------------------------ the in-process path
def _stop_ids(model_dir: str, tokenizer: Any) -> set[int]:
    """What vLLM stops on without stop strings: the tokenizer's EOS and the generation config's."""
    from transformers import GenerationConfig

    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    ids |= {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    return ids


def in_process_generate(model: Any, policy: Any, prompt_ids: Sequence[int], max_new_tokens: int, block_size: int,
                        stop_ids: set[int]) -> dict[str, Any]:
    """The server's protocol on an :class:`HFSession`: prefill the whole prompt, evict ("prefill"), greedy decode
    (each step followed by eviction, "decode") until a stop id or ``max_new_tokens``. Returns the tokens, the
    top-:data:`TOP_K` logits of every step, the smallest top-1/top-2 gap and the driver's counters."""
    import torch

    from vtoken_runtime.hf_adapter import HFSession

    n = len(prompt_ids)
    s = HFSession(model, block_size=block_size, num_blocks=-(-(n + max_new_tokens) // block_size) + 4,
                  granularity=policy.granularity, mode="compact", chunk_size=max(n, 1), max_requests=2,
                  policies=[policy])
    tokens: list[int] = []
    top: list[tuple[list[int], list[float]]] = []
    try:
        s.add("r", policy)
        logits = s.prefill(["r"], [list(prompt_ids)])[0]
        for k in range(max_new_tokens):
            v, i = torch.topk(logits.float(), TOP_K)
            top.append((i.tolist(), v.tolist()))
            t = int(i[0])
            tokens.append(t)
            if t in stop_ids or k == max_new_tokens - 1:
                break
            logits = s.decode(["r"], [t])[0]
        if s.requests["r"].failures:
            raise RuntimeError(f"policy {policy.name!r} failed in process: {s.requests['r'].failures}")
        counters = {k: int(s.driver.counters[k]) for k in COUNTERS}
    finally:
        s.cache.close()
    margins = [vals[0] - vals[1] for _, vals in top]
    return {"tokens": tokens, "top": top, "min_margin": min(margins) if margins else None, "counters": counters}


# ------------------------------------------------------------------ explanations
def _server_steps(resp: dict[str, Any]) -> tuple[list[int], list[dict[int, float]]]:
    lp = resp["choices"][0]["logprobs"]

    def tid(s: str) -> int:
        return int(s.split(":", 1)[1])

    return [tid(t) for t in lp["tokens"]], [{tid(k): float(v) for k, v in (d or {}).items()}
                                           for d in lp["top_logprobs"]]


def _gap(scores: dict[int, float], winner: int, other: int) -> dict[str, Any]:
    """``scores[winner] - scores[other]`` when both are in the top list; else a lower bound (other below the
    list's last entry)."""
    if winner not in scores:
        return {"gap": None, "note": "own token not in the top list"}
    if other in scores:
        return {"gap": scores[winner] - scores[other], "bound": False}
    return {"gap": scores[winner] - min(scores.values()), "bound": True,
            "note": f"the other token is outside this side's top {len(scores)}: the gap is at least this"}


def explain_difference(tokenizer: Any, server_tokens: Sequence[int], server_top: Sequence[dict[int, float]],
                       inproc_tokens: Sequence[int], inproc_top: Sequence[tuple[list[int], list[float]]]
                       ) -> dict[str, Any]:
    """The first differing generated token and, at that step, both candidates' gap on each side (server: its
    log-probabilities; in process: its logits; equal quantities, the log-softmax normaliser cancels)."""
    i = next((k for k, (a, b) in enumerate(zip(server_tokens, inproc_tokens, strict=False)) if a != b), None)
    if i is None:
        if len(server_tokens) == len(inproc_tokens):
            return {"first_diff_step": None, "why": "same token ids: the texts differ in detokenization only"}
        i = min(len(server_tokens), len(inproc_tokens))
        return {"first_diff_step": i, "why": "one side stopped earlier (same tokens up to there)",
                "server_tokens": len(server_tokens), "in_process_tokens": len(inproc_tokens)}
    b, a = int(server_tokens[i]), int(inproc_tokens[i])
    ids, vals = inproc_top[i]
    hf = dict(zip(ids, vals, strict=True))
    srv = _gap(server_top[i], b, a) if i < len(server_top) else {"gap": None, "note": "no server logprobs"}
    hf_gap = _gap(hf, a, b)
    return {
        "first_diff_step": i,
        "common_prefix": tokenizer.decode(list(inproc_tokens[:i]), skip_special_tokens=True),
        "server_token": {"id": b, "text": tokenizer.decode([b])},
        "in_process_token": {"id": a, "text": tokenizer.decode([a])},
        "server_gap": srv,  # logprob(server token) - logprob(in-process token) on the server
        "in_process_gap": hf_gap,  # logit(in-process token) - logit(server token) in process
        "server_top2_margin_at_step": _margin(list(server_top[i].values())) if i < len(server_top) else None,
        "in_process_top2_margin_at_step": vals[0] - vals[1],
    }


def _margin(values: list[float]) -> float | None:
    v = sorted(values, reverse=True)
    return v[0] - v[1] if len(v) > 1 else None


# ------------------------------------------------------------------ the run
def run_ruler_serve(tasks: Sequence[str] = DEFAULT_TASKS, samples_per_task: int = 2, policy: str = DEFAULT_POLICY,
                    ratio: float = 0.5, *, context_tokens: int = 2048, seed: int = 42,
                    work_dir: str | Path = "results/ruler_serve", port: int | None = None,
                    model: str | Path | None = None, block_size: int = CPU_BLOCK_SIZE, server_args: Sequence[str] = (),
                    start_timeout_s: float = 600.0, client_timeout_s: float | None = None,
                    log: Log = _stderr) -> dict[str, Any]:
    """RULER's ``call_api.py`` against ``vtoken-cli serve`` vs the in-process path, same samples and policy.

    Args:
        tasks, samples_per_task, context_tokens, seed: the RULER samples (:func:`generate_ruler`).
        policy, ratio: the server's ``--policy`` / ``--eviction-ratio`` (and the in-process policy).
        work_dir: generated data (``gen/``), the client's predictions (``pred/``), logs, kept afterwards.
        port: the server's port (default: a free one). model: default SmolLM2 (:func:`smollm2_path`).
        block_size: the server's ``--block-size`` and the in-process cache's (default 128, vLLM's CPU default);
            checked against the block size the server's worker reports.
        server_args: more ``vtoken-cli serve`` / vLLM flags (e.g. ``["--enforce-eager"]``).
        client_timeout_s: limit for one task's client run (default 120 s + 300 s per sample).

    Returns a dict: ``scores`` (``{"server": {task: score}, "in_process": {...}}``), ``samples`` (per sample both
    predictions, per-sample scores, whether they are identical, the prompt-ids check, the in-process smallest
    top-2 margin, and for a differing sample the token-level ``explanation``), ``identical`` / ``total``,
    ``evictions`` (per task, the server's ``/metrics`` deltas and the in-process driver's counters),
    ``protocol`` (the server's start-up line, block size), ``config`` (commands), ``seconds`` (wall times).
    Raises ValueError for bad arguments, RuntimeError when the server, the client or a generator fails.
    """
    from .ruler_tasks import _check_tasks, generate_ruler, score_ruler, score_ruler_samples

    tasks = _check_tasks(tasks)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must lie in [0, 1), got {ratio}")
    if isinstance(samples_per_task, bool) or not isinstance(samples_per_task, int) or samples_per_task < 1:
        raise ValueError(f"samples_per_task must be an int >= 1, got {samples_per_task!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    from vtoken_runtime.vllm_plugin.config import PluginConfig, describe_policy

    pol = PluginConfig(policy=policy, eviction_ratio=ratio).load_policy()  # what the server's worker builds
    if pol is None:
        raise ValueError("policy 'none' evicts nothing: pick a policy")
    if model is None:
        from .models import smollm2_path

        model = smollm2_path()
    model_dir = str(Path(model).expanduser())
    work = Path(work_dir).expanduser().resolve()
    (work / "pred").mkdir(parents=True, exist_ok=True)
    if port is None:
        port = _free_port()
    elif not _port_free(port):
        raise ValueError(f"port {port} is in use on 127.0.0.1; pick another (or leave it out: a free one)")
    cmd = server_command(model_dir, policy, ratio, port, ["--block-size", str(block_size), *server_args])
    t_start = time.monotonic()
    secs: dict[str, float] = {}
    log(f"server: {shlex.join(cmd)} (log {work / 'server.log'})")
    server = Server(cmd, port, work / "server.log")
    try:
        # while the server boots: the samples, then the in-process path
        t0 = time.monotonic()
        samples = generate_ruler(context_tokens, samples_per_task, tasks=list(tasks), seed=seed,
                                 tokenizer_path=model_dir, out_dir=work / "gen")
        secs["generate"] = round(time.monotonic() - t0, 1)
        log(f"{len(samples)} RULER samples in {secs['generate']} s")
        inproc, tokenizer, prompt_ids = _in_process(samples, pol, model_dir, block_size, log, secs)
        t0 = time.monotonic()
        server.wait_healthy(max(1.0, start_timeout_s - (t0 - t_start)))
        secs["server_healthy_after"] = round(time.monotonic() - t_start, 1)
        log(f"server healthy {secs['server_healthy_after']} s after its start")
        proto = parse_server_protocol(server.log.read_text(errors="replace"))
        if proto["block_size"] != block_size:
            raise RuntimeError(f"block size: the server reports {proto['block_size']}, in process {block_size}")
        ids_ok = {}
        for s, ids in zip(samples, prompt_ids, strict=True):
            got = _post(server.base, "/tokenize", {"model": model_dir, "prompt": s.prompt, "add_special_tokens": True})
            ids_ok[(s.task, s.index)] = got["tokens"] == ids
        preds: dict[tuple[str, int], str] = {}
        evictions: dict[str, dict[str, dict[str, int]]] = {}
        for task in tasks:
            n_task = sum(1 for s in samples if s.task == task)
            before = _metrics(server.base)
            t0 = time.monotonic()
            got = run_call_api(server, task, work / "gen" / "data", work / "pred", model_dir,
                               work / f"call_api_{task}.log", client_timeout_s or 120.0 + 300.0 * n_task)
            secs[f"call_api_{task}"] = round(time.monotonic() - t0, 1)
            srv_counts = _server_counters(_metrics(server.base), before)
            mine = {k: sum(inproc["runs"][(s.task, s.index)]["counters"][k] for s in samples if s.task == task)
                    for k in COUNTERS}
            evictions[task] = {"server": srv_counts, "in_process": mine}
            log(f"call_api.py {task}: {len(got)} predictions in {secs[f'call_api_{task}']} s; evictions "
                f"server {srv_counts} / in process {mine}")
            for s in samples:
                if s.task == task:
                    if s.index not in got:
                        raise RuntimeError(f"call_api.py wrote no prediction for {task} sample {s.index}")
                    preds[(s.task, s.index)] = got[s.index]
        rows = _compare(samples, preds, inproc, ids_ok, tokenizer, server, model_dir, log, secs)
    finally:
        server.stop()
    server_preds = [preds[(s.task, s.index)] for s in samples]
    local_preds = [inproc["runs"][(s.task, s.index)]["text"] for s in samples]
    for row, a, b in zip(rows, score_ruler_samples(samples, server_preds), score_ruler_samples(samples, local_preds),
                         strict=True):
        row["server_score"], row["in_process_score"] = a, b
    secs["total"] = round(time.monotonic() - t_start, 1)
    return {
        "scores": {"server": score_ruler(samples, server_preds), "in_process": score_ruler(samples, local_preds)},
        "samples": rows,
        "identical": sum(r["identical"] for r in rows),
        "total": len(rows),
        "differences": [f"{r['task']}/{r['index']}" for r in rows if not r["identical"]],
        "evictions": evictions,
        "evictions_equal": {t: all(e["server"][k] == e["in_process"][k] for k in ("evictions", "tokens_evicted"))
                            for t, e in evictions.items()},
        "protocol": {**proto, "in_process_policy": describe_policy(pol), "stop_ids": sorted(inproc["stop_ids"]),
                     "prompt_ids_equal_server_tokenize": all(ids_ok.values())},
        "config": {"tasks": list(tasks), "samples_per_task": samples_per_task, "policy": policy, "ratio": ratio,
                   "context_tokens": context_tokens, "seed": seed, "model": model_dir, "port": port,
                   "server_command": shlex.join(cmd),
                   "call_api_command": shlex.join(call_api_command("TASK", work / "gen" / "data", work / "pred",
                                                                   server.base + "/v1/completions", model_dir)),
                   "client_body": {k: v for k, v in client_body("PROMPT", model_dir, 0).items() if k != "prompt"}
                   | {"prompt": "<the sample's input>", "max_tokens": "<the task's tokens_to_generate>"},
                   "work_dir": str(work)},
        "seconds": secs,
    }


def _in_process(samples: Sequence[Any], pol: Any, model_dir: str, block_size: int, log: Log,
                secs: dict[str, float]) -> tuple[dict[str, Any], Any, list[list[int]]]:
    """Every sample through :func:`in_process_generate` (while the server boots)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop_ids = _stop_ids(model_dir, tokenizer)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    all_ids = []
    t1 = time.monotonic()
    for s in samples:
        ids = list(tokenizer(s.prompt, add_special_tokens=True).input_ids)  # what vLLM does with a completion prompt
        all_ids.append(ids)
        t = time.monotonic()
        r = in_process_generate(model, pol, ids, s.max_new_tokens, block_size, stop_ids)
        r["text"] = tokenizer.decode([x for x in r["tokens"] if x not in stop_ids], skip_special_tokens=True)
        r["prompt_tokens"] = len(ids)
        runs[(s.task, s.index)] = r
        log(f"in process {s.task}/{s.index}: {len(ids)} prompt tokens, {len(r['tokens'])} generated in "
            f"{time.monotonic() - t:.1f} s: {r['text']!r}")
    secs["in_process"] = round(time.monotonic() - t1, 1)
    del model
    return {"runs": runs, "stop_ids": stop_ids}, tokenizer, all_ids


def _compare(samples: Sequence[Any], preds: dict[tuple[str, int], str], inproc: dict[str, Any],
             ids_ok: dict[tuple[str, int], bool], tokenizer: Any, server: Server, model_dir: str, log: Log,
             secs: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    t0 = time.monotonic()
    for s in samples:
        key = (s.task, s.index)
        r = inproc["runs"][key]
        row: dict[str, Any] = {
            "task": s.task, "index": s.index, "answers": list(s.answers), "prompt_tokens": r["prompt_tokens"],
            "server_pred": preds[key], "in_process_pred": r["text"], "identical": preds[key] == r["text"],
            "prompt_ids_equal_server": ids_ok[key], "in_process_generated_tokens": len(r["tokens"]),
            "in_process_min_top2_margin": r["min_margin"],
        }
        if not row["identical"]:
            body = client_body(s.prompt, model_dir, s.max_new_tokens) | {"logprobs": TOP_K,
                                                                        "return_tokens_as_token_ids": True}
            resp = _post(server.base, "/v1/completions", body)
            stoks, stop = _server_steps(resp)
            row["explanation"] = explain_difference(tokenizer, stoks, stop, r["tokens"], r["top"])
            row["explanation"]["replay_text_equals_call_api"] = resp["choices"][0]["text"] == preds[key]
            log(f"{s.task}/{s.index} differs: {json.dumps(row['explanation'])}")
        rows.append(row)
    secs["explanations"] = round(time.monotonic() - t0, 1)
    return rows
