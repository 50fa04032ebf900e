"""Serving with prefix caching on (``vtoken-cli bench prefix``, issue 40): vanilla vLLM with prefix caching, the
baseline a user actually runs, against vToken with prefix caching on, in-process, closed loop, SmolLM2.

Two traces, essay tokens, seeded:

* ``shared``: ``num_requests`` requests, each a ``system_tokens`` system prompt shared by all of them followed
  by its own question (``question_tokens``), answers of ``output_tokens``; all arrive at t=0.
* ``chat``: ``conversations`` conversations of ``turns`` turns, each starting with the same system prompt; turn
  ``t + 1``'s prompt is turn ``t``'s prompt, its answer and a new message (``message_tokens``), sent when turn
  ``t`` finishes (each conversation is a closed loop of its own).

Engines (each built once; its prefix cache is reset before every run):

* ``vanilla``: vLLM with prefix caching on;
* ``none``: vToken with policy ``none`` (the plugin's overhead: interleaved with vanilla, ``rounds`` rounds);
* ``POLICY@RATIO``: vToken evicting (after every prefill chunk, ``when="chunks"``), each request pinning its
  system prompt (``vtoken_pinned_spans``, which is how a deployment keeps a shared prefix cacheable: see
  ``vtoken_runtime.vllm_plugin.prefix``).

Figures per (trace, engine): prefix-cache hit rate (prompt tokens served from the cache, ``num_cached_tokens``
over prompt tokens), running peak (most requests in the running set after a ``schedule()``), preemptions,
closed-loop throughput (requests and output tokens per second on this process's CPU clock), and blocks
freed by eviction. The KV cache holds the system prompt plus ``vanilla_target + 0.5`` requests' own tokens.

Goodput (``goodput=True``, :func:`prefix_goodput`): the shared trace open loop, Poisson arrivals, vanilla and the
evicting engine searched in turn under SLOs set from vanilla's requests run alone.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .serve_config import resolve_dtype, set_env
from .serve_engine import Probe, free_engine, kv_bytes, scheduler_of, start_engine


@dataclass(frozen=True)
class PrefixConfig:
    """The budget counts the pinned system prompt (``vllm_plugin.prefix``), so the questions are long enough that
    the budget leaves room past it (at 0.5: about a third of a question's own tokens are kept)."""

    system_tokens: int = 1024
    question_tokens: tuple[int, int] = (1536, 2048)
    output_tokens: tuple[int, int] = (64, 96)
    num_requests: int = 10
    conversations: int = 4
    turns: int = 2
    message_tokens: tuple[int, int] = (1024, 1536)
    answer_tokens: tuple[int, int] = (48, 64)
    policy: str = "h2o"
    ratio: float = 0.5
    when: str = "chunks"  # evict after every prefill chunk: admitted on budget + a chunk (bench serve's H2O rows)
    rounds: int = 3
    vanilla_target: int = 3
    block_size: int = 32
    chunk_tokens: int = 512
    max_num_seqs: int = 32
    dtype: str = "auto"
    seed: int = 0
    # goodput on the shared trace (open loop, Poisson arrivals): its own requests (the same system prompt, new
    # questions), SLOs from vanilla's requests run alone (factor x mean TTFT / TPOT), the searches of vanilla
    # and the evicting engine in turn (serve_slo.search_goodput_paired), then ``goodput_confirm`` rotated rounds
    # of both at both goodputs found
    closed_loop: bool = True  # False: the goodput search alone (engines vanilla and POLICY@RATIO only)
    goodput: bool = True
    goodput_requests: int = 16
    ttft_slo_factor: float = 5.0
    tpot_slo_factor: float = 3.0
    slo_attainment: float = 0.9
    rate_factor: float = 2.0
    max_ladder: int = 4
    bisect_steps: int = 1
    goodput_confirm: int = 1
    clock: str = "cpu"  # TTFT / TPOT / arrivals on this process's CPU clock (serve_engine.ServingClock)


QUICK = PrefixConfig(system_tokens=512, question_tokens=(768, 1024), output_tokens=(48, 64), num_requests=8,
                     conversations=3, turns=2, message_tokens=(512, 768), answer_tokens=(32, 48), rounds=3,
                     goodput_requests=10, max_ladder=3)


@dataclass
class Shared:
    system: list[int]
    questions: list[list[int]]
    outputs: list[int]
    messages: list[list[list[int]]]  # [conversation][turn]
    answers: list[list[int]]
    gp_questions: list[list[int]] = field(default_factory=list)  # the goodput trace's own questions
    gp_outputs: list[int] = field(default_factory=list)


def make_traces(model_dir: str, cfg: PrefixConfig) -> Shared:
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests

    tok = AutoTokenizer.from_pretrained(model_dir)
    g = np.random.default_rng(cfg.seed)
    ql = [int(x) for x in g.integers(cfg.question_tokens[0], cfg.question_tokens[1] + 1, cfg.num_requests)]
    ol = [int(x) for x in g.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1, cfg.num_requests)]
    ml = [int(x) for x in g.integers(cfg.message_tokens[0], cfg.message_tokens[1] + 1, cfg.conversations * cfg.turns)]
    al = [[int(x) for x in g.integers(cfg.answer_tokens[0], cfg.answer_tokens[1] + 1, cfg.turns)]
          for _ in range(cfg.conversations)]
    n_gp = cfg.goodput_requests if cfg.goodput else 0  # drawn after the closed-loop traces: those stay as they were
    gql = [int(x) for x in g.integers(cfg.question_tokens[0], cfg.question_tokens[1] + 1, n_gp)]
    gol = [int(x) for x in g.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1, n_gp)]
    texts = essay_token_requests(tok, [cfg.system_tokens, *ql, *ml, *gql], 1, offset=cfg.seed * 7919 + 101)
    system, qs = texts[0], texts[1:1 + len(ql)]
    ms, gqs = texts[1 + len(ql):1 + len(ql) + len(ml)], texts[1 + len(ql) + len(ml):]
    msgs = [ms[c * cfg.turns:(c + 1) * cfg.turns] for c in range(cfg.conversations)]
    return Shared(system, qs, ol, msgs, al, gqs, gol)


def kv_blocks(cfg: PrefixConfig, tr: Shared) -> int:
    """The system prompt's blocks plus ``vanilla_target + 0.5`` mean requests' own blocks (shared trace)."""
    bs = cfg.block_size
    own = [math.ceil((len(q) + o) / bs) + 1 for q, o in zip(tr.questions, tr.outputs, strict=True)]
    return math.ceil(cfg.system_tokens / bs) + math.ceil((cfg.vanilla_target + 0.5) * sum(own) / len(own))


def build(model_dir: str, cfg: PrefixConfig, blocks: int, max_len: int, plugin: dict[str, Any] | None) -> Any:
    set_env()
    dtype = resolve_dtype(cfg.dtype)
    args: dict[str, Any] = dict(model=model_dir, dtype=dtype, max_model_len=max_len, block_size=cfg.block_size,
                                enforce_eager=True, seed=0, kv_cache_memory_bytes=kv_bytes(model_dir, blocks,
                                                                                           cfg.block_size, dtype),
                                max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=True,
                                enable_chunked_prefill=True, max_num_batched_tokens=cfg.chunk_tokens,
                                long_prefill_token_threshold=cfg.chunk_tokens)
    return start_engine(args, plugin)


@dataclass
class Run:
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    requests: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_running: int = 0
    preemptions: int = 0
    blocks_freed: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 4), "rps": round(self.rps, 4),
                "tok_s": round(self.output_tokens / self.cpu_seconds, 2) if self.cpu_seconds else 0.0}


def _params(max_tokens: int, vtoken: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args={"vtoken": vtoken} if vtoken else None)


def run(llm: Any, tr: Shared, trace: str, pin: bool) -> Run:
    """One closed-loop run of ``trace`` (``shared`` or ``chat``) on ``llm`` with an empty prefix cache."""
    from vllm.inputs import TokensPrompt

    _reset_cache(llm)
    eng, sched = llm.llm_engine, scheduler_of(llm)
    sched._bench_probe = probe = Probe()
    freed0 = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0))
    opts = {"pinned_spans": [0, len(tr.system)]} if pin else None
    res = Run()
    pending: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (conversation, turn, prompt)
    tag = f"{trace}{time.monotonic_ns()}"

    def add(rid: str, prompt: list[int], m: int) -> None:
        eng.add_request(rid, TokensPrompt(prompt_token_ids=prompt), _params(m, opts))
        res.prompt_tokens += len(prompt)

    c0, t0 = time.process_time(), time.perf_counter()
    if trace == "shared":
        for i, (q, m) in enumerate(zip(tr.questions, tr.outputs, strict=True)):
            add(f"{tag}-{i}", tr.system + q, m)
    else:
        for c, msgs in enumerate(tr.messages):
            p = tr.system + msgs[0]
            pending[f"{tag}-{c}-0"] = (c, 0, p)
            add(f"{tag}-{c}-0", p, tr.answers[c][0])
    while eng.has_unfinished_requests():
        for o in eng.step():
            if not o.finished:
                continue
            res.requests += 1
            res.output_tokens += len(o.outputs[0].token_ids)
            res.cached_tokens += int(o.num_cached_tokens or 0)
            if o.request_id in pending:
                c, t, p = pending.pop(o.request_id)
                if t + 1 < len(tr.messages[c]):
                    nxt = p + list(o.outputs[0].token_ids) + tr.messages[c][t + 1]
                    rid = f"{tag}-{c}-{t + 1}"
                    pending[rid] = (c, t + 1, nxt)
                    add(rid, nxt, tr.answers[c][t + 1])
    res.cpu_seconds, res.wall_seconds = time.process_time() - c0, time.perf_counter() - t0
    res.max_running, res.preemptions = probe.max_running, probe.preemptions
    res.blocks_freed = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0)) - freed0
    return res


def run_prefix_bench(model_dir: str, cfg: PrefixConfig, log: Any = print) -> dict[str, Any]:
    if not (cfg.closed_loop or cfg.goodput):
        raise ValueError("closed_loop=False and goodput=False: nothing to run (drop --no-closed-loop or "
                         "--no-goodput)")
    tr = make_traces(model_dir, cfg)
    blocks = kv_blocks(cfg, tr)
    longest_chat = max(len(tr.system) + sum(len(m) for m in ms) + sum(a) for ms, a in zip(tr.messages, tr.answers,
                                                                                          strict=True))
    max_len = max(longest_chat, cfg.system_tokens + cfg.question_tokens[1] + cfg.output_tokens[1]) + cfg.block_size
    evict = f"{cfg.policy}@{cfg.ratio:g}"
    engines = {"vanilla": None, "none": {"policy": "none", "device": "cpu"},
               evict: {"policy": cfg.policy, "eviction_ratio": cfg.ratio, "when": cfg.when, "device": "cpu"}}
    if not cfg.closed_loop:
        del engines["none"]
    log(f"KV cache {blocks} blocks of {cfg.block_size}; system prompt {cfg.system_tokens} tokens; "
        f"{cfg.num_requests} shared-prefix requests, {cfg.conversations} x {cfg.turns}-turn chats; dtype "
        f"{resolve_dtype(cfg.dtype)}")
    llms = {}
    try:
        for name, plugin in engines.items():
            llms[name] = build(model_dir, cfg, blocks, max_len, plugin)
        for name, llm in llms.items():  # warm-up: one request each, outside every figure
            run(llm, Shared(tr.system, tr.questions[:1], [8], [], []), "shared", pin=name == evict)
        rows: list[dict[str, Any]] = []
        overhead: list[float] = []
        for trace in ("shared", "chat") if cfg.closed_loop else ():
            for r in range(cfg.rounds if trace == "shared" else 1):
                order = ["vanilla", "none", evict] if r % 2 == 0 else [evict, "none", "vanilla"]
                got = {name: run(llms[name], tr, trace, pin=name == evict) for name in order}
                if trace == "shared":
                    overhead.append(got["none"].cpu_seconds / got["vanilla"].cpu_seconds)
                for name in ("vanilla", "none", evict):
                    rows.append({"trace": trace, "round": r, "engine": name, **got[name].row()})
                    log(f"{trace} round {r} {name}: {rows[-1]}")
        goodput = prefix_goodput({"vanilla": llms["vanilla"], evict: llms[evict]}, evict, cfg, tr, log) \
            if cfg.goodput else None
    finally:
        for llm in llms.values():
            free_engine(llm)
    return {"config": {**asdict(cfg), "kv_blocks": blocks, "dtype": resolve_dtype(cfg.dtype)},
            "rows": rows, "overhead_none": {"ratios": [round(x, 4) for x in overhead],
                                            "median": round(statistics.median(overhead), 4),
                                            "min": round(min(overhead), 4), "max": round(max(overhead), 4)}
            if overhead else None,
            "summary": summarize(rows, evict), "goodput": goodput}


def summarize(rows: list[dict[str, Any]], evict: str) -> dict[str, Any]:
    """Per trace: the median over rounds of each engine's figures, and the evicting engine's against vanilla."""
    out: dict[str, Any] = {}
    for trace in sorted({r["trace"] for r in rows}):
        med = {}
        for eng in ("vanilla", "none", evict):
            rs = [r for r in rows if r["trace"] == trace and r["engine"] == eng]
            med[eng] = {k: statistics.median(r[k] for r in rs)
                        for k in ("hit_rate", "max_running", "rps", "tok_s", "preemptions", "blocks_freed")}
        v, e = med["vanilla"], med[evict]
        out[trace] = {"median": med,
                      "hit_rate_gap": round(v["hit_rate"] - e["hit_rate"], 4),
                      "running_peak_x": round(e["max_running"] / v["max_running"], 3) if v["max_running"] else None,
                      "rps_x": round(e["rps"] / v["rps"], 3) if v["rps"] else None}
    return out


# --------------------------------------------------------------------------- goodput on the shared trace


def _reset_cache(llm: Any) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset the prefix cache (requests still running)")


def prefix_goodput(llms: dict[str, Any], evict: str, cfg: PrefixConfig, tr: Shared,
                   log: Any = print) -> dict[str, Any]:
    """Goodput (DistServe's: the highest Poisson rate at which ``slo_attainment`` of the requests meet both the
    TTFT and the TPOT SLO) of ``llms`` (``vanilla`` and the evicting engine ``evict``) on the shared trace's
    goodput requests: the system prompt plus a question of their own each.

    * SLOs: ``ttft_slo_factor`` / ``tpot_slo_factor`` x vanilla's mean TTFT / TPOT with each request run alone
      and the system prompt already in its prefix cache (a deployment's steady state);
    * every probe starts from an empty prefix cache (its first request computes the system prompt; the others
      hit it) and runs the same arrival pattern scaled to its rate; the evicting engine's requests pin the
      system prompt, as in the closed-loop runs; a probe stops once more requests missed than allowed;
    * the searches run in turn (:func:`serve_slo.search_goodput_paired`: same rates, order rotated), from
      ``1 / TTFT`` (the prefill-bound rate) down to ``0.25 / unloaded end-to-end`` (below it requests rarely
      overlap), then ``goodput_confirm`` rotated rounds of every engine at every goodput found.

    Returns ``{"slo", "unloaded", "engines": {label: {goodput_rps, bracket, saturated, probes, confirm}},
    "goodput_x"}`` (``goodput_x``: the evicting engine's over vanilla's, None when vanilla's is 0)."""
    from .serve_engine import run_trace
    from .serve_goodput import unloaded
    from .serve_slo import allowed_misses, attainment, miss_counts, poisson_arrivals, search_goodput_paired

    trace = [(tr.system + q, m) for q, m in zip(tr.gp_questions, tr.gp_outputs, strict=True)]
    if not trace:
        raise ValueError("goodput_requests=0: no goodput trace")
    pins = {"vtoken": {"pinned_spans": [0, len(tr.system)]}}
    van = llms["vanilla"]
    _reset_cache(van)
    run_trace(van, trace[:1], clock=cfg.clock)  # the system prompt into the cache
    tt, tp = unloaded(van, trace, cfg.clock)
    ref_ttft, ref_tpot = float(np.mean(tt)), float(np.mean(tp))
    slo = (cfg.ttft_slo_factor * ref_ttft, cfg.tpot_slo_factor * ref_tpot)
    e2e = ref_ttft + (float(np.mean([m for _, m in trace])) - 1.0) * ref_tpot
    start, floor = 1.0 / ref_ttft, 0.25 / e2e
    log(f"goodput: SLOs TTFT {slo[0]:.2f}s ({cfg.ttft_slo_factor}x {ref_ttft:.2f}s), TPOT {1e3 * slo[1]:.0f}ms "
        f"({cfg.tpot_slo_factor}x {1e3 * ref_tpot:.1f}ms), attainment {cfg.slo_attainment}, {len(trace)} requests "
        f"per probe, rates from {start:.3f} rps (floor {floor:.3f})")
    pattern = poisson_arrivals(len(trace), 1.0)
    max_misses = allowed_misses(len(trace), cfg.slo_attainment)

    def probe(label: str, rate: float) -> dict[str, Any]:
        llm = llms[label]
        _reset_cache(llm)
        r = run_trace(llm, trace, pattern / rate, slo=slo, max_misses=max_misses, clock=cfg.clock,
                      extra_args=pins if label == evict else None)
        miss = miss_counts(r.ttft, r.tpot, *slo)
        rec = {"rate_rps": round(rate, 4), "attainment": round(attainment(r.ttft, r.tpot, *slo), 3),
               "aborted": r.aborted, "missed_ttft": miss["ttft"], "missed_tpot": miss["tpot"],
               "running_peak": r.probe.max_running, "preemptions": r.probe.preemptions,
               "blocks_freed": r.blocks_freed, "seconds": round(r.seconds, 1)}
        log(f"  {label}: rate {rate:.3f} rps -> attainment {rec['attainment']:.2f} (missed TTFT {miss['ttft']}, "
            f"TPOT {miss['tpot']} of {len(trace)}; running peak {rec['running_peak']})"
            f"{' (stopped early)' if r.aborted else ''} [{r.seconds:.0f}s]")
        return rec

    probes: dict[str, list[dict[str, Any]]] = {k: [] for k in llms}

    def search_probe(label: str, rate: float) -> float:
        probes[label].append(probe(label, rate))
        return float(probes[label][-1]["attainment"])

    found = search_goodput_paired(search_probe, list(llms), start, cfg.slo_attainment, factor=cfg.rate_factor,
                                  max_ladder=cfg.max_ladder, bisect_steps=cfg.bisect_steps, min_rate=floor)
    engines = {k: {"goodput_rps": round(s.goodput, 4),
                   "bracket": [round(s.bracket[0], 4), None if s.bracket[1] is None else round(s.bracket[1], 4)],
                   "saturated": s.saturated, "probes": probes[k], "confirm": {}} for k, s in found.items()}
    rates = sorted({s.goodput for s in found.values() if s.goodput > 0})
    order = list(llms)
    for _ in range(cfg.goodput_confirm if rates else 0):
        for k in order:
            for rate in rates:
                engines[k]["confirm"].setdefault(f"{rate:.4f}", []).append(probe(k, rate)["attainment"])
        order = order[1:] + order[:1]
    v, e = engines["vanilla"]["goodput_rps"], engines[evict]["goodput_rps"]
    log(f"goodput: vanilla {v} rps, {evict} {e} rps")
    return {"slo": {"ttft_slo_s": round(slo[0], 3), "tpot_slo_s": round(slo[1], 4), "attainment": cfg.slo_attainment,
                    "clock": cfg.clock},
            "unloaded": {"ttft_s": round(ref_ttft, 3), "tpot_s": round(ref_tpot, 4), "e2e_s": round(e2e, 3),
                         "start_rps": round(start, 4), "floor_rps": round(floor, 4)},
            "requests": len(trace), "engines": engines, "goodput_x": round(e / v, 3) if v else None}
