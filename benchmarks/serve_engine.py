"""vLLM engines of the serving benchmark: built in-process and instrumented (a probe after every ``schedule()``),
driven over a trace (:func:`run_trace`, or several engines in lockstep: :func:`run_lockstep`) on a
:class:`ServingClock`, and read (the plugin's statistics time and backend)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .serve_config import DTYPES, ServeConfig, Trace, set_env
from .serve_slo import meets_slo, tpot_of


def kv_bytes(model_dir: str, blocks: int, block_size: int, dtype: str = "float32") -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return blocks * 2 * c.num_hidden_layers * c.num_key_value_heads * hd * block_size * DTYPES[dtype]


class ServingClock:
    """The time line of a serving run, in seconds from its start.

    ``wall``: ``time.perf_counter``; waiting for the next arrival sleeps. ``cpu``: this process's CPU time
    (the engine runs in-process on one thread), and waiting for the next arrival with nothing in flight
    jumps the clock there instead of sleeping. On a machine shared with other jobs, ``cpu`` measures the
    run as if it had its core to itself: time another process takes from it is not counted (cache and
    memory-bandwidth contention still is), and idle gaps cost no real time."""

    def __init__(self, kind: str = "wall", wall: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.process_time) -> None:
        if kind not in ("wall", "cpu"):
            raise ValueError(f"clock {kind!r}; expected wall or cpu")
        self.kind = kind
        self._f = cpu if kind == "cpu" else wall
        self._t0 = self._f()
        self._skipped = 0.0

    def now(self) -> float:
        return self._f() - self._t0 + self._skipped

    def wait_until(self, t: float) -> None:
        d = t - self.now()
        if d <= 0:
            return
        if self.kind == "wall":
            time.sleep(d)
        else:
            self._skipped += d


@dataclass
class Probe:
    """Filled by the scheduler wrapper after every ``schedule()`` (so chunk allocations that the step's
    eviction frees again are counted)."""
    max_running: int = 0
    peak_blocks: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    steps: int = 0
    # per schedule(): (requests decoding one token, prefill tokens scheduled) - what the step computes
    mix: list[tuple[int, int]] = field(default_factory=list)


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def model_runner_of(llm: Any) -> Any:
    w = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    return getattr(w, "worker", w).model_runner


def _instrument(llm: Any) -> None:
    sched = scheduler_of(llm)
    sched._bench_probe = Probe()
    orig = sched.schedule
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]

    def schedule(*a: Any, **kw: Any) -> Any:
        out = orig(*a, **kw)
        p: Probe = sched._bench_probe
        p.steps += 1
        p.max_running = max(p.max_running, len(sched.running))
        p.preemptions += len(getattr(out, "preempted_req_ids", None) or ())
        n = getattr(out, "num_scheduled_tokens", None) or {}
        p.mix.append((sum(1 for k in n.values() if k == 1), sum(k for k in n.values() if k > 1)))
        for req in sched.running:
            held = len(mgr.req_to_blocks.get(req.request_id, ()))
            if held > p.peak_blocks.get(req.request_id, 0):
                p.peak_blocks[req.request_id] = held
        return out

    sched.schedule = schedule


def build_engine(model_dir: str, cfg: ServeConfig, plugin: dict[str, Any] | None, max_num_seqs: int) -> Any:
    set_env()
    assert cfg.kv_blocks is not None and cfg.max_model_len is not None
    args: dict[str, Any] = dict(model=model_dir, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                                block_size=cfg.block_size, enforce_eager=True, seed=0,
                                kv_cache_memory_bytes=kv_bytes(model_dir, cfg.kv_blocks, cfg.block_size, cfg.dtype),
                                max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                enable_chunked_prefill=True,
                                max_num_batched_tokens=max(cfg.step_tokens or cfg.chunk_tokens, cfg.chunk_tokens),
                                long_prefill_token_threshold=cfg.chunk_tokens)
    return start_engine(args, plugin)


def start_engine(args: dict[str, Any], plugin: dict[str, Any] | None) -> Any:
    """An in-process ``LLM(**args)``, with vToken's engine arguments merged in for ``plugin`` (None: vanilla
    vLLM), instrumented for the benchmark (:class:`Probe`)."""
    from vllm import LLM

    from vtoken_runtime.vllm_plugin import vllm_engine_args

    if plugin is not None:
        args = {**args, **vllm_engine_args(**plugin)}
    llm = LLM(**args)
    _instrument(llm)
    return llm


def free_engine(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@dataclass
class RunResult:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: what another job on the machine cannot inflate
    output_tokens: int = 0
    ttft: list[float | None] = field(default_factory=list)  # per request in trace order (None: no token)
    tpot: list[float | None] = field(default_factory=list)  # None: not finished
    probe: Probe = field(default_factory=Probe)
    blocks_freed: int = 0
    aborted: bool = False
    # with run_trace(record_steps=True), per engine step: (seconds on the run's clock, requests decoding,
    # prefill tokens, seconds in the plugin: statistics collector + policy + compaction)
    steps: list[tuple[float, int, int, float]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_peak_blocks(self) -> float:
        pk = self.probe.peak_blocks
        return sum(pk.values()) / len(pk) if pk else 0.0

    def guaranteed_concurrency(self, kv_blocks: int) -> int:
        """Requests like these that fit together for their whole lives, with no preemption:
        ``floor(kv_blocks / mean per-request peak blocks)``."""
        m = self.mean_peak_blocks
        return int(kv_blocks // m) if m > 0 else 0


_RUN_IDS = iter(range(10**9))


def run_trace(llm: Any, trace: Trace, arrivals: np.ndarray | None = None,
              slo: tuple[float, float] | None = None, max_misses: int | None = None,
              clock: str = "wall", record_steps: bool = False,
              extra_args: dict[str, Any] | None = None) -> RunResult:
    """Drive ``llm.llm_engine.step()`` over ``trace``: request ``i`` is added once ``arrivals[i]`` has passed
    on ``clock`` (see :class:`ServingClock`; None: everything at t=0, a closed loop). TTFT and TPOT are
    read on the same clock. With ``slo=(ttft_s, tpot_s)`` and ``max_misses``, the run stops (aborting what
    is left) as soon as more than ``max_misses`` requests have certainly missed. ``record_steps``: fill
    ``RunResult.steps`` (what each step computed and cost, the plugin's share apart). ``extra_args``: every
    request's ``SamplingParams.extra_args`` (e.g. ``{"vtoken": {"pinned_spans": [0, 1024]}}``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    sched = scheduler_of(llm)
    sched._bench_probe = probe = Probe()
    run_id = next(_RUN_IDS)
    n = len(trace)
    arr = np.zeros(n) if arrivals is None else np.asarray(arrivals, dtype=float)
    res = RunResult(probe=probe, ttft=[None] * n, tpot=[None] * n)
    first: list[float | None] = [None] * n
    index: dict[str, int] = {}
    missed: set[int] = set()
    freed0 = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0))
    nxt = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    clk = ServingClock(clock)
    while nxt < n or eng.has_unfinished_requests():
        now = clk.now()
        while nxt < n and arr[nxt] <= now:
            p, m = trace[nxt]
            rid = f"r{run_id}-{nxt}"
            index[rid] = nxt
            eng.add_request(rid, TokensPrompt(prompt_token_ids=p),
                            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, extra_args=extra_args))
            nxt += 1
        if not eng.has_unfinished_requests():
            clk.wait_until(float(arr[nxt]))
            continue
        if record_steps:
            k0, ts, vt0 = len(probe.mix), clk.now(), plugin_seconds(llm)
        outs = eng.step()
        t = clk.now()
        if record_steps and len(probe.mix) > k0:
            res.steps.append((t - ts, *probe.mix[k0], plugin_seconds(llm) - vt0))
        for o in outs:
            i = index.get(o.request_id)
            if i is None:
                continue
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k and first[i] is None:
                first[i] = t
                res.ttft[i] = t - arr[i]
            if o.finished:
                res.output_tokens += k
                if first[i] is not None:
                    res.tpot[i] = tpot_of(first[i], t, k)
        if slo is not None and max_misses is not None:
            for i in range(nxt):
                if i in missed:
                    continue
                if first[i] is None:
                    late = t - arr[i] > slo[0]
                else:
                    late = res.tpot[i] is None and t - first[i] > slo[1] * max(1, trace[i][1] - 1)
                    late = late or (res.tpot[i] is not None and not meets_slo(res.ttft[i], res.tpot[i], *slo))
                if late:
                    missed.add(i)
            if len(missed) > max_misses:
                eng.abort_request([r for r, i in index.items() if res.tpot[i] is None])
                res.aborted = True
                while eng.has_unfinished_requests():  # nothing should be left; never leak into the next run
                    eng.step()
                break
    res.seconds = time.perf_counter() - t0
    res.cpu_seconds = time.process_time() - c0
    res.blocks_freed = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0)) - freed0
    return res


def run_lockstep(llms: dict[str, Any], trace: Trace) -> dict[str, RunResult]:
    """The closed loop ``trace`` on every engine of ``llms`` at once, one ``step()`` of each in turn (in the
    dict's order): A B C A B C ... at step granularity, so a change of load on the machine hits every
    engine alike. Per engine a :class:`RunResult` whose ``seconds`` / ``cpu_seconds`` are summed over its
    own steps (its end-to-end time had it run alone), with its scheduler probe (running peak, per-request
    peak blocks) and the blocks its eviction freed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run_id = next(_RUN_IDS)
    res: dict[str, RunResult] = {}
    freed0: dict[str, int] = {}
    for k, llm in llms.items():
        sched = scheduler_of(llm)
        sched._bench_probe = probe = Probe()
        res[k] = RunResult(probe=probe)
        freed0[k] = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0))
        for i, (p, m) in enumerate(trace):
            llm.llm_engine.add_request(f"l{run_id}-{k}-{i}", TokensPrompt(prompt_token_ids=p),
                                       SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    live = list(llms)
    while live:
        for k in list(live):
            eng = llms[k].llm_engine
            if not eng.has_unfinished_requests():
                live.remove(k)
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            outs = eng.step()
            r = res[k]
            r.seconds += time.perf_counter() - t0
            r.cpu_seconds += time.process_time() - c0
            r.output_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished and o.outputs)
    for k, llm in llms.items():
        sched = scheduler_of(llm)
        res[k].blocks_freed = int((getattr(sched, "vtoken_stats", None) or {}).get("blocks_freed", 0)) - freed0[k]
    return res


def stats_seconds(llm: Any) -> float | None:
    """Seconds the plugin's statistics collector has spent so far (None: vanilla / no statistics)."""
    try:
        col = model_runner_of(llm)._vt_collector
    except AttributeError:
        return None
    return None if col is None else float(col.seconds)


def plugin_seconds(llm: Any) -> float:
    """Seconds the plugin has spent so far on this engine: statistics collector, policy, compaction and its
    input preparation (0 for vanilla)."""
    try:
        c = model_runner_of(llm).vtoken_counters
    except AttributeError:
        return 0.0
    return ((stats_seconds(llm) or 0.0) + float(c.get("policy_seconds", 0.0)) + float(c.get("reclaim_seconds", 0.0))
            + float(c.get("prepare_seconds", 0.0)))


def stats_backend(llm: Any) -> str | None:
    try:
        col = model_runner_of(llm)._vt_collector
    except AttributeError:
        return None
    return None if col is None else str(getattr(col, "backend", "torch"))


def warm_engine(llm: Any, trace: Trace) -> None:
    run_trace(llm, [(trace[0][0][:64], 2)])
