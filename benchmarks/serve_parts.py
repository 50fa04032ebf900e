"""The report's independent parts (closed loop, interleaved, goodput, one row each) and the worker processes
that run them side by side (:func:`run_parts`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .serve_concurrency import run_closed_loop, single_row
from .serve_config import ServeConfig, Trace, set_env
from .serve_goodput import run_goodput_only
from .serve_overhead import run_interleaved
from .serve_traces import goodput_traces, make_trace

# The whole report's independent parts. Each builds, uses and frees its own engines, and whatever one part
# compares runs interleaved inside it, so parts can run side by side (one process and one core each): another
# part's load then hits both sides of a comparison alike. With ``workers`` > 1 they run in that many spawned
# processes, longest first, one fresh process per part (an in-process vLLM engine cannot be freed while another
# lives, and a fresh process starts each part alike); with 1, one after another in this process.
#   closed_loop   (a) vanilla vs vToken H2O 0.5 in lockstep, and their rows       run_closed_loop
#   interleaved   (c) the overhead trio and the statistics cost                   run_interleaved
#   goodput       (b) vanilla's SLOs and goodput, then the goodput rows'          run_goodput_only
#   row           (a) one other configuration, one closed-loop run                single_row
PARTS_ORDER = ("closed_loop", "interleaved", "goodput", "row")


def run_part(cfg: ServeConfig, model_dir: str, trace: Trace, part: str, key: tuple[str, str, float] | None,
             log: Callable[[str], None], el: Callable[[], str]) -> Any:
    """One part of the report (see :data:`PARTS_ORDER`); ``key`` = ``(mode, policy, ratio)`` of a ``row``."""
    if part == "closed_loop":
        return run_closed_loop(cfg, model_dir, trace, log, el)
    if part == "interleaved":
        return run_interleaved(cfg, model_dir, trace, log, el)
    if part == "goodput":
        return run_goodput_only(cfg, model_dir, trace, *goodput_traces(cfg, trace), log, el)
    if part == "row" and key is not None:
        row, backend = single_row(model_dir, cfg, trace, key)
        log(f"{key[0]} {key[1]} {key[2]}: running peak {row['max_concurrency']}, guaranteed "
            f"{row['guaranteed_concurrency']}, {row['closed_loop_tok_s']:.1f} tok/s closed loop {el()}")
        return row, backend
    raise ValueError(f"part {part!r} (key {key}); expected one of {PARTS_ORDER} (a row with its key)")


def _part_job(cfg: ServeConfig, model_dir: str, part: str, key: tuple[str, str, float] | None,
              t_start: float) -> Any:
    """Worker-process entry: the trace (tokenised again: deterministic) and one part; log lines go to stderr
    prefixed with the part (``t_start`` is the parent's ``perf_counter``, a clock every process shares)."""
    import sys

    set_env()
    label = part if key is None else f"row {key[0]} {key[1]} {key[2]}"

    def log(m: str) -> None:
        print(f"[{label}] {m}", file=sys.stderr, flush=True)

    return run_part(cfg, model_dir, make_trace(model_dir, cfg), part, key, log,
                    lambda: f"[{time.perf_counter() - t_start:.0f}s]")


def run_parts(cfg: ServeConfig, model_dir: str, trace: Trace, jobs: Sequence[tuple[str, tuple[str, str, float] | None]],
              log: Callable[[str], None], el: Callable[[], str], t_start: float) -> list[Any]:
    """The results of ``jobs`` (``(part, key)``, in that order): side by side in ``cfg.workers`` spawned processes,
    or one after another in this process when ``cfg.workers`` is 1 (see :data:`PARTS_ORDER`)."""
    if cfg.workers <= 1 or len(jobs) <= 1:
        return [run_part(cfg, model_dir, trace, part, key, log, el) for part, key in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    log(f"{len(jobs)} parts ({', '.join(sorted({p for p, _ in jobs}))}), {cfg.workers} worker processes side by "
        f"side {el()}")
    with ProcessPoolExecutor(max_workers=cfg.workers, mp_context=mp.get_context("spawn"),
                             max_tasks_per_child=1) as ex:
        futs = [ex.submit(_part_job, cfg, model_dir, part, key, t_start) for part, key in jobs]
        return [f.result() for f in futs]
