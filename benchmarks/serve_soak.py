"""The soak (``vtoken-cli bench soak``): one real ``vtoken-cli serve`` server, open-loop Poisson arrivals of a
mixed workload for N minutes (bounded request count), then checks of what a long-running server must keep:
every good request completes, no 5xx, invalid options are 400s naming the key, temperature-0 outputs equal
those the same requests get alone, KV usage and the block pool back to empty, the vtoken counters agree
with the mix, resident memory flat. The mix and the verdicts are in :mod:`.soak_mix`.

The server runs ``--dtype float32``: only batch-invariant numerics let a request's greedy output under load
equal its output alone (bf16 vLLM gives other greedy tokens in a batch).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .soak_mix import (
    DISCONNECT,
    GOOD,
    INVALID,
    Result,
    Spec,
    aggregate,
    build_spec,
    counter_verdicts,
    eviction_bounds,
    kinds_sequence,
    verdicts,
)

CLI = [sys.executable, "-c", "from vtoken_cli.main import main; main()"]
COUNTERS = ("vtoken_evictions_total", "vtoken_tokens_evicted_total", "vtoken_policy_failures_total",
            "vtoken_rejected_requests_total", "vtoken_blocks_freed_total")


@dataclass
class SoakConfig:
    minutes: float = 10.0
    max_requests: int = 400
    rate: float = 0.15  # requests per second (Poisson)
    prompt_tokens: tuple[int, int] = (1024, 3072)
    output_tokens: tuple[int, int] = (16, 64)
    replay: int = 8
    kv_blocks: int = 256
    block_size: int = 32
    max_num_seqs: int = 8
    # concurrent evicting requests at the longest prompt in the warm-up (with one chat n>1): the server reaches
    # its working set for a full batch before the RSS baseline is read (None: max_num_seqs)
    warm_requests: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    drain_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    model: str | None = None
    log: Path | None = None

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens[1] + 2 * self.output_tokens[1]


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the server
# the environment the memory figures depend on, as the server got it (the report's server_env)
MEMORY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "VTOKEN_MALLOC_TRIM_S", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def server_command(cfg: SoakConfig, model: str, port: int) -> list[str]:
    from .serve_engine import kv_bytes

    args = ["serve", model, "--port", str(port), "--host", "127.0.0.1", "--policy", "h2o", "--eviction-ratio", "0.5",
            "--dtype", "float32", "--max-model-len", str(cfg.max_model_len), "--block-size", str(cfg.block_size),
            "--max-num-seqs", str(cfg.max_num_seqs),
            "--kv-cache-memory-bytes", str(kv_bytes(model, cfg.kv_blocks, cfg.block_size))]
    return [*CLI, *args, *(["--enforce-eager"] if cfg.enforce_eager else [])]


class Server:
    """``vtoken-cli serve`` in its own process group; stopped with SIGTERM to the group."""

    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        self.cmd, self.port, self.log = cmd, port, log
        self.base = f"http://127.0.0.1:{port}"
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (rc={self.proc.poll()}):\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def rss_bytes(self) -> int:
        """Resident memory of the server's process tree (API server, engine core, the launcher)."""
        return sum(self.rss_by_process().values())

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory per process of the server's tree, keyed ``name[pid]`` (vLLM titles its engine core
        ``VLLM::EngineCore``; the launcher and the API server are ``python``/``vtoken-cli``)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out: dict[str, int] = {}
        for p in procs:
            try:
                out[f"{p.name()}[{p.pid}]"] = p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return out

    def server_env(self, names: tuple[str, ...] = MEMORY_ENV) -> dict[str, str | None]:
        """``names`` in the server process's environment (what ``serve`` exec'ed it with; vLLM's engine core and
        workers inherit it: their own ``/proc/<pid>/environ`` is overwritten by their process titles, so it
        is read here). Empty when the process is gone."""
        import psutil

        try:
            env = psutil.Process(self.proc.pid).environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return {}
        return {k: env.get(k) for k in names}


def parse_metrics(text: str) -> dict[str, float]:
    """``/metrics`` text -> {name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(3) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def metrics(client: Any, base: str) -> dict[str, float]:
    return parse_metrics((await client.get(base + "/metrics", timeout=30)).text)


# ------------------------------------------------------------------ one request
async def _stream(client: Any, base: str, spec: Spec, res: Result, t0: float) -> None:
    """A streamed request: collects text, TTFT, TPOT; a disconnect kind closes the connection early."""
    chunks_t: list[float] = []
    async with client.stream("POST", base + spec.path, json=spec.body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            await _error_body(r, res, spec)
            return
        if spec.kind == "disconnect_first":  # headers came, no token yet: leave
            res.ok, res.extra["left_after"] = True, "headers"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                res.completion_tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or []:
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if piece:
                    chunks_t.append(time.perf_counter())
                    res.text += piece
                if ch.get("finish_reason"):
                    res.extra["finish_reason"] = ch["finish_reason"]
            if spec.kind == "disconnect_mid" and chunks_t:
                res.ok, res.extra["left_after"] = True, "first_token"
                return
    if chunks_t:
        res.ttft_s = chunks_t[0] - t0
        if res.completion_tokens > 1:
            res.tpot_s = (chunks_t[-1] - chunks_t[0]) / (res.completion_tokens - 1)
    res.ok = bool(res.text) and "finish_reason" in res.extra and res.completion_tokens >= 1


async def _error_body(r: Any, res: Result, spec: Spec) -> None:
    body = (await r.aread()).decode(errors="replace")
    try:
        res.error = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        res.error = body[:500]
    res.ok = spec.expect_key is not None and r.status_code == 400 and spec.expect_key in res.error


async def _plain(client: Any, base: str, spec: Spec, res: Result) -> None:
    r = await client.post(base + spec.path, json=spec.body)
    res.status = r.status_code
    if r.status_code != 200:
        res.error = r.text[:500]
        try:
            res.error = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        res.ok = spec.expect_key is not None and r.status_code == 400 and spec.expect_key in res.error
        return
    js = r.json()
    choices = js.get("choices") or []
    res.completion_tokens = (js.get("usage") or {}).get("completion_tokens", 0)
    texts = [c.get("text") if "text" in c else (c.get("message") or {}).get("content") for c in choices]
    res.text = texts[0] or "" if texts else ""
    res.extra["choices"] = len(choices)
    res.ok = (len(choices) == spec.n and all(c.get("finish_reason") for c in choices) and res.completion_tokens >= 1)
    if spec.kind == "context_limit":
        total = (js.get("usage") or {}).get("prompt_tokens", 0) + res.completion_tokens
        res.extra["total_tokens"] = total
        res.ok = res.ok and res.completion_tokens == spec.max_tokens


async def send(client: Any, base: str, spec: Spec) -> Result:
    """Send one request; never raises (a connection error is status 0)."""
    import httpx

    res = Result(spec.index, spec.kind, 0, prompt_tokens=spec.prompt_tokens, max_tokens=spec.max_tokens, n=spec.n,
                 replayable=spec.replayable)
    t0 = time.perf_counter()
    try:
        if spec.stream:
            await _stream(client, base, spec, res, t0)
        else:
            await _plain(client, base, spec, res)
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:500]
    res.extra["seconds"] = round(time.perf_counter() - t0, 3)
    return res


# ------------------------------------------------------------------ phases
def make_specs(cfg: SoakConfig, model: str) -> tuple[list[Spec], dict[str, Any]]:
    """The soak's requests (deterministic for a seed) and the warm-up requests."""
    from transformers import AutoTokenizer

    from .essays import essay_token_stream

    tok = AutoTokenizer.from_pretrained(model)
    stream = essay_token_stream(tok)
    rng = random.Random(cfg.seed)
    specs: list[Spec] = []
    pos = 0
    chat_text = "Summarise in one sentence: " + tok.decode(stream[5000:5200])
    kw = {"model": model, "max_model_len": cfg.max_model_len, "output_tokens": cfg.output_tokens,
          "chat_text": chat_text}
    for i, kind in enumerate(kinds_sequence(cfg.max_requests)):
        n = rng.randint(*cfg.prompt_tokens) if kind != "context_limit" else cfg.max_model_len
        if pos + n > len(stream):
            pos = 0
        specs.append(build_spec(i, kind, rng, stream[pos:pos + n], **kw))
        pos += n
    n_warm = cfg.max_num_seqs if cfg.warm_requests is None else cfg.warm_requests
    L = cfg.prompt_tokens[1]
    warm = [build_spec(-10 - k, "evict", rng, stream[len(stream) - (k + 1) * L: len(stream) - k * L], **kw)
            for k in range(n_warm)] + [build_spec(-2, "chat_n", rng, [], **kw)]
    optout = build_spec(-3, "opt_out", rng, stream[: cfg.prompt_tokens[0]], **kw)
    return specs, {"warm": warm, "opt_out": optout}


async def open_loop(client: Any, base: str, specs: list[Spec], cfg: SoakConfig) -> list[Result]:
    """Poisson arrivals at ``cfg.rate`` until ``cfg.minutes`` or the specs run out; then wait for all."""
    rng = random.Random(cfg.seed + 1)
    sent: list[tuple[Spec, asyncio.Task]] = []
    t_end = time.monotonic() + cfg.minutes * 60
    for i, spec in enumerate(specs):
        if time.monotonic() >= t_end:
            break
        sent.append((spec, asyncio.create_task(send(client, base, spec))))
        if i + 1 < len(specs):
            await asyncio.sleep(min(rng.expovariate(cfg.rate), max(t_end - time.monotonic(), 0)))
    _log(f"{len(sent)} requests sent; draining")
    tasks = [t for _, t in sent]
    done, pending = await asyncio.wait(tasks, timeout=cfg.drain_timeout_s) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    return [t.result() if t in done else  # an undrained request keeps its kind: a good one counts as incomplete
            Result(s.index, s.kind, 0, error="not finished within the drain timeout", prompt_tokens=s.prompt_tokens,
                   max_tokens=s.max_tokens, n=s.n)
            for s, t in sent]


async def replay(client: Any, base: str, specs: list[Spec], results: list[Result], k: int) -> list[dict[str, Any]]:
    """Re-run up to ``k`` completed temperature-0 requests alone, one at a time; compare their text."""
    by_index = {s.index: s for s in specs}
    done = [r for r in results if r.replayable and r.ok and r.kind in GOOD]
    sample = random.Random(7).sample(done, min(k, len(done)))
    out = []
    for r in sample:
        alone = await send(client, base, by_index[r.index])
        out.append({"index": r.index, "kind": r.kind, "match": alone.ok and alone.text == r.text,
                    "under_load": r.text[:80], "alone": alone.text[:80]})
    return out


async def wait_idle(client: Any, base: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Metrics once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await metrics(client, base)
        idle = m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        if (idle and m.get("vllm:kv_cache_usage_perc", 0) == 0) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(1)


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}


async def _rss_sampler(server: Server, samples: list[tuple[float, dict[str, int]]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), server.rss_by_process()))
        try:
            await asyncio.wait_for(stop.wait(), 5)
        except asyncio.TimeoutError:
            pass


async def soak_phases(server: Server, cfg: SoakConfig, model: str) -> dict[str, Any]:
    """Warm-up, the open loop, replay alone, an opted-out-only phase, the end-state checks."""
    import httpx

    specs, extra = make_specs(cfg, model)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.drain_timeout_s, connect=30), limits=limits) as client:
        t0 = time.monotonic()
        warm = await asyncio.gather(*(send(client, server.base, s) for s in extra["warm"]))
        _log(f"warm-up: {[(r.kind, r.status, r.ok) for r in warm]} in {time.monotonic() - t0:.1f} s")
        m0 = await wait_idle(client, server.base)
        rss0 = server.rss_by_process()
        server_env = server.server_env()
        samples: list[tuple[float, dict[str, int]]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_rss_sampler(server, samples, stop))
        t_run = time.monotonic()
        results = await open_loop(client, server.base, specs, cfg)
        run_s = time.monotonic() - t_run
        m1 = await wait_idle(client, server.base)
        rss1 = server.rss_by_process()
        stop.set()
        await sampler
        _log(f"open loop: {len(results)} requests in {run_s:.1f} s; replaying {cfg.replay} alone")
        replays = await replay(client, server.base, specs, results, cfg.replay)
        m2 = await wait_idle(client, server.base)
        optout = await send(client, server.base, extra["opt_out"])
        m3 = await wait_idle(client, server.base)
    return {"results": results, "warm": warm, "m0": m0, "m1": m1, "m2": m2, "m3": m3, "rss": (rss0, rss1),
            "rss_samples": samples, "replays": replays, "optout": optout, "run_s": run_s, "specs": specs,
            "server_env": server_env}


def _model_shape(model: str) -> tuple[int, int]:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    return int(c.num_hidden_layers), int(c.num_key_value_heads)


def rss_trajectory(samples: list[tuple[float, dict[str, int]]], base: int) -> dict[str, Any]:
    """Where the run's RSS growth happened: the tree's total at each quarter of the open loop (the median of the
    samples in that quarter) as % over the after-warm-up baseline. A leak keeps climbing quarter after quarter;
    an allocator's high-water mark (a larger batch or shape than the warm-up's) steps up and stays."""
    if not samples or not base:
        return {}
    t0, t1 = samples[0][0], samples[-1][0]
    span = max(t1 - t0, 1e-9)
    quarters: list[float | None] = []
    for q in range(4):
        vals = sorted(sum(b.values()) for t, b in samples if q / 4 <= (t - t0) / span <= (q + 1) / 4)
        quarters.append(round(100.0 * (vals[len(vals) // 2] - base) / base, 3) if vals else None)
    return {"quarters_pct": quarters, "samples": len(samples), "interval_s": 5}


def summarise(cfg: SoakConfig, ph: dict[str, Any], model: str, cmd: list[str], wall_s: float) -> dict[str, Any]:
    """The soak's JSON object: counts, figures, per-check verdicts."""
    results: list[Result] = ph["results"]
    s = aggregate(results)
    layers, heads = _model_shape(model)
    bounds = eviction_bounds(results, layers, heads)
    delta = _delta(ph["m1"], ph["m0"])
    opt_delta = _delta(ph["m3"], ph["m2"]) if ph["optout"].ok else None
    checks = counter_verdicts(delta, bounds, s["invalid_sent"], opt_delta)
    m3 = ph["m3"]
    by0, by1 = ph["rss"]
    rss0, rss1 = sum(by0.values()), sum(by1.values())
    pool = ({"total": m3["vtoken_kv_blocks_total"], "free": m3.get("vtoken_kv_blocks_free"),
             "held": m3.get("vtoken_kv_blocks_held")} if "vtoken_kv_blocks_total" in m3 else {})
    s.update({
        "mismatched_outputs": sum(not r["match"] for r in ph["replays"]),
        "replayed": len(ph["replays"]),
        "kv_usage_end": m3.get("vllm:kv_cache_usage_perc"),
        "kv_blocks": pool,
        "vtoken_counters_consistent": all(v for v in checks.values()) if None not in checks.values() else None,
        "vtoken_counters_checks": checks,
        "vtoken_counters_delta": delta,
        "eviction_bounds": bounds,
        "opt_out_phase_delta": opt_delta,
        "rss_bytes_after_warmup": rss0,
        "rss_bytes_end": rss1,
        "rss_bytes_peak": max((sum(b.values()) for _, b in ph["rss_samples"]), default=None),
        "rss_growth_pct": round(100.0 * (rss1 - rss0) / rss0, 3) if rss0 else None,
        "rss_by_process": {"after_warmup": by0, "end": by1},
        "rss_trajectory": rss_trajectory(ph["rss_samples"], rss0),
        "preemptions": ph["m1"].get("vllm:num_preemptions_total", 0) - ph["m0"].get("vllm:num_preemptions_total", 0),
        "run_seconds": round(ph["run_s"], 1),
        "wall_seconds": round(wall_s, 1),
        "replays": ph["replays"],
        "failures": [{"index": r.index, "kind": r.kind, "status": r.status, "error": r.error}
                     for r in results if not r.ok][:20],
        "skipped": {"best_of": "vLLM 0.32 accepts best_of and ignores it (CompletionRequest has no such field: an "
                               "extra key, dropped with a debug log; ChatCompletionRequest declares it and nothing "
                               "reads it): not part of the mix"},
        "server_command": shlex.join(cmd),
        "server_env": ph["server_env"],
        "config": {"minutes": cfg.minutes, "max_requests": cfg.max_requests, "rate_rps": cfg.rate,
                   "prompt_tokens": list(cfg.prompt_tokens), "output_tokens": list(cfg.output_tokens),
                   "max_model_len": cfg.max_model_len, "kv_blocks": cfg.kv_blocks, "block_size": cfg.block_size,
                   "max_num_seqs": cfg.max_num_seqs, "warm_requests": len(ph["warm"]) - 1, "dtype": "float32",
                   "policy": "h2o", "eviction_ratio": 0.5,
                   "enforce_eager": cfg.enforce_eager, "seed": cfg.seed},
    })
    s["checks"] = verdicts(s)
    return s


class SoakAborted(RuntimeError):
    """The server died during the soak: no figure is meaningful; the message carries its exit status and errors."""


def last_errors(log: Path, n: int = 12) -> str:
    """The last ``n`` lines of the server's log that name an error (the root cause of an engine's death)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(log unreadable: {e})"
    hits = [ln for ln in lines if "Error" in ln or "error" in ln]
    return "\n".join(hits[-n:]) or "\n".join(lines[-n:])


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Start the server, run the phases, stop the server; the summary (with ``checks``)."""
    from .models import smollm2_path

    model = cfg.model or str(smollm2_path())
    port = _free_port()
    cmd = server_command(cfg, model, port)
    log = cfg.log or Path(os.environ.get("TMPDIR", "/tmp")) / f"vtoken-soak-{os.getpid()}.log"
    t0 = time.monotonic()
    _log(f"server: {shlex.join(cmd)} (log {log})")
    server = Server(cmd, port, log)
    try:
        server.wait_healthy(cfg.start_timeout_s)
        _log(f"healthy after {time.monotonic() - t0:.1f} s")
        ph = asyncio.run(soak_phases(server, cfg, model))
    except Exception as e:
        rc = server.proc.poll()
        if rc is None:
            raise
        raise SoakAborted(f"the server exited with status {rc} during the soak ({type(e).__name__}: {e}); its "
                          f"last errors:\n{last_errors(log)}\nfull log: {log}") from e
    finally:
        server.stop()
    out = summarise(cfg, ph, model, cmd, time.monotonic() - t0)
    out["server_log"] = str(log)
    return out


__all__ = ["DISCONNECT", "INVALID", "SoakAborted", "SoakConfig", "last_errors", "parse_metrics", "run_soak", "server_command"]
